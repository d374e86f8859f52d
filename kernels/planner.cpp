// Planner hot loop: the list-scheduling simulator and the Metropolis-Hastings search over plans.
//
// The C++ twin of rlflow/planner/simulate.py. Both read the arrays of a CompiledProblem
// (rlflow/planner/compiled.py, whose docstring defines the unrolled graph) and must agree to
// the last bit: the same (ready time, node id) pop order, the same max/add sequence for times
// and the same per-device summation order for memory.
//
// Device sets are bitsets of ceil(num_devices / 64) words, so any cluster size works.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;
using i64 = int64_t;

namespace {

constexpr i64 kPreRealloc = 1;
constexpr i64 kPreReload = 2;

const std::vector<std::string> kIntFields = {
    "opt_offset", "opt_lo",  "opt_size", "opt_layout", "nbr_offset",    "nbr",           "mfc_model",
    "pre_kind",   "home",    "realloc_offset", "reload_offset", "model_trainable", "model_home",
    "model_calls_offset", "model_calls", "edge_src", "edge_dst", "edge_offset", "child_offset", "child", "indegree",
    "hook_src", "hook_offset", "edge_rows", "edge_cols", "edge_src_at", "edge_dst_at", "eopt_group", "eopt_host_lo",
    "eopt_host_hi", "eopt_key"};
const std::vector<std::string> kFloatFields = {"opt_time",      "opt_act",      "opt_weight", "opt_state",
                                               "realloc_table", "reload_table", "data_table", "hook_table"};

// ------------------------------------------------------------------------------------------ problem

struct Problem {
  int D, M, T, K, W;  // devices, MFCs, iterations, nodes per iteration, bitset words
  int F, G;           // the steady state's iterations: the period is measured from the end of F to that of G
  double mem_cap, penalty;
  std::vector<i64> opt_offset, opt_lo, opt_size, opt_layout, nbr_offset, nbr, mfc_model, pre_kind, home,
      realloc_offset, reload_offset, model_trainable, model_home, model_calls_offset, model_calls, edge_src,
      edge_dst, edge_offset, child_offset, child, indegree, hook_src, hook_offset, edge_rows, edge_cols, edge_src_at,
      edge_dst_at, eopt_group, eopt_host_lo, eopt_host_hi, eopt_key;
  std::vector<double> opt_time, opt_act, opt_weight, opt_state, realloc_table, reload_table, data_table, hook_table;
  std::vector<uint64_t> opt_bits;  // (num_options, W)
  std::vector<int> movable;        // MFCs with more than one option

  Problem(int D_, int M_, int T_, int K_, double cap, double pen, const py::dict& arrays, int F_, int G_)
      : D(D_), M(M_), T(T_), K(K_), W((D_ + 63) / 64), F(F_), G(G_ < 0 ? T_ - 1 : G_), mem_cap(cap), penalty(pen) {
    if (T > 1 && !(0 <= F && F < G && G <= T - 1))
      throw std::invalid_argument("need 0 <= period_from < period_to <= num_iterations - 1");
    std::vector<std::vector<i64>*> ints = {&opt_offset, &opt_lo, &opt_size, &opt_layout, &nbr_offset, &nbr,
                                           &mfc_model, &pre_kind, &home, &realloc_offset, &reload_offset,
                                           &model_trainable, &model_home, &model_calls_offset, &model_calls,
                                           &edge_src, &edge_dst, &edge_offset, &child_offset, &child, &indegree,
                                           &hook_src, &hook_offset, &edge_rows, &edge_cols, &edge_src_at,
                                           &edge_dst_at, &eopt_group, &eopt_host_lo, &eopt_host_hi, &eopt_key};
    std::vector<std::vector<double>*> floats = {&opt_time, &opt_act, &opt_weight, &opt_state,
                                                &realloc_table, &reload_table, &data_table, &hook_table};
    for (size_t f = 0; f < kIntFields.size(); ++f) {
      auto a = arrays[kIntFields[f].c_str()].cast<py::array_t<i64, py::array::c_style | py::array::forcecast>>();
      ints[f]->assign(a.data(), a.data() + a.size());
    }
    for (size_t f = 0; f < kFloatFields.size(); ++f) {
      auto a = arrays[kFloatFields[f].c_str()].cast<py::array_t<double, py::array::c_style | py::array::forcecast>>();
      floats[f]->assign(a.data(), a.data() + a.size());
    }
    if ((int)opt_offset.size() != M + 1 || (int)indegree.size() != T * K)
      throw std::invalid_argument("compiled arrays do not match num_mfcs / num_iterations");
    const i64 n_opts = opt_offset[M];
    opt_bits.assign(n_opts * W, 0);
    for (i64 f = 0; f < n_opts; ++f) {
      if (opt_lo[f] < 0 || opt_lo[f] + opt_size[f] > D) throw std::invalid_argument("option mesh outside the cluster");
      for (i64 d = opt_lo[f]; d < opt_lo[f] + opt_size[f]; ++d) opt_bits[f * W + d / 64] |= uint64_t(1) << (d % 64);
    }
    for (int i = 0; i < M; ++i)
      if (opt_offset[i + 1] - opt_offset[i] > 1) movable.push_back(i);
  }

  i64 num_options(int i) const { return opt_offset[i + 1] - opt_offset[i]; }

  // Seconds of data edge e from source option a to destination option b (compiled.data_seconds):
  // 0 between equal placements, else the (one host / across hosts, source group, destination
  // group) entry of the edge's table.
  double data_seconds(int e, i64 a, i64 b) const {
    const i64 sa = edge_src_at[e] + a, sb = edge_dst_at[e] + b;
    if (eopt_key[sa] >= 0 && eopt_key[sa] == eopt_key[sb]) return 0.0;
    const i64 lo = std::min(eopt_host_lo[sa], eopt_host_lo[sb]), hi = std::max(eopt_host_hi[sa], eopt_host_hi[sb]);
    const i64 cross = hi - lo != 1 ? 1 : 0;
    return data_table[edge_offset[e] + (cross * edge_rows[e] + eopt_group[sa]) * edge_cols[e] + eopt_group[sb]];
  }
};

// ------------------------------------------------------------------------------------------ simulator

// Scratch space for evaluating plans of one problem; one per thread.
//
// Scheduling keeps, instead of a free time per device, the latest end on each *distinct* device
// set of the plan (a handful: the chosen meshes and their unions) and a table of which sets
// overlap. A node starts after the latest end on any set overlapping its own — the same value
// as the maximum of per-device free times (what the Python twin computes), at O(#sets) per node
// instead of O(#devices).
struct Evaluator {
  const Problem& p;
  std::vector<double> ready, start, end, dur, stat, dyn, iter_end, last_end;
  std::vector<i64> pending;
  std::vector<uint8_t> active, copy;
  std::vector<uint64_t> bits;      // (K, W) device set of each node of one iteration
  std::vector<uint64_t> set_bits;  // (S, W) distinct device sets
  std::vector<int> set_of;         // (K,) index of each active node's set
  std::vector<int> ov_offset, ov;  // CSR: sets overlapping each set (itself included)
  int n_sets = 0;
  std::vector<std::pair<double, i64>> heap;
  double period = 0, total = 0, max_bytes = 0;
  bool fits = true;

  explicit Evaluator(const Problem& prob)
      : p(prob), ready(prob.T * prob.K), start(prob.T * prob.K), end(prob.T * prob.K), dur(prob.K), stat(prob.D),
        dyn(prob.D), iter_end(prob.T), last_end(prob.K), pending(prob.T * prob.K), active(prob.K), copy(prob.M),
        bits(prob.K * prob.W), set_bits(prob.K * prob.W), set_of(prob.K), ov_offset(prob.K + 1),
        ov(prob.K * prob.K) {
    heap.reserve(prob.T * prob.K);
  }

  bool resident(const i64* choice, i64 model) const {
    i64 layout = -1;
    for (i64 c = p.model_calls_offset[model]; c < p.model_calls_offset[model + 1]; ++c) {
      i64 i = p.model_calls[c], l = p.opt_layout[p.opt_offset[i] + choice[i]];
      if (layout >= 0 && l != layout) return false;
      layout = l;
    }
    return true;
  }

  void set_node(int j, double duration, i64 f1, i64 f2) {
    active[j] = 1;
    dur[j] = duration;
    for (int w = 0; w < p.W; ++w)
      bits[j * p.W + w] = p.opt_bits[f1 * p.W + w] | (f2 >= 0 ? p.opt_bits[f2 * p.W + w] : 0);
  }

  // Extends node j (active or not) by `duration` seconds and the meshes of options f1 and f2.
  void add_to_node(int j, double duration, i64 f1, i64 f2) {
    if (!active[j]) {
      set_node(j, 0.0, f1, f2);
    } else {
      for (int w = 0; w < p.W; ++w) bits[j * p.W + w] |= p.opt_bits[f1 * p.W + w] | p.opt_bits[f2 * p.W + w];
    }
    dur[j] += duration;
  }

  void build_nodes(const i64* choice) {
    std::fill(active.begin(), active.end(), 0);
    std::fill(dur.begin(), dur.end(), 0.0);
    std::fill(copy.begin(), copy.end(), 0);
    const int ne = (int)p.edge_src.size();
    for (int i = 0; i < p.M; ++i) {
      const i64 f = p.opt_offset[i] + choice[i];
      set_node(ne + 2 * i + 1, p.opt_time[f], f, -1);
      if (p.pre_kind[i] == kPreRealloc) {
        const i64 h = p.home[i], fh = p.opt_offset[h] + choice[h];
        if (p.opt_layout[fh] != p.opt_layout[f]) {
          set_node(ne + 2 * i, p.realloc_table[p.realloc_offset[i] + choice[h] * p.num_options(i) + choice[i]], fh, f);
          copy[i] = 1;
        }
      } else if (p.pre_kind[i] == kPreReload && !resident(choice, p.mfc_model[i])) {
        set_node(ne + 2 * i, p.reload_table[p.reload_offset[i] + choice[i]], f, -1);
        copy[i] = 1;
      }
      if (p.hook_src[i] >= 0) {  // a weight hook (EMA blend) after the realloc/reload, on both meshes
        const i64 s = p.hook_src[i], fs = p.opt_offset[s] + choice[s];
        const double t = p.hook_table[p.hook_offset[i] + choice[s] * p.num_options(i) + choice[i]];
        add_to_node(ne + 2 * i, t, fs, f);
      }
    }
    for (int e = 0; e < ne; ++e) {
      const i64 s = p.edge_src[e], d = p.edge_dst[e];
      const double t = p.data_seconds(e, choice[s], choice[d]);
      if (t > 0) set_node(e, t, p.opt_offset[s] + choice[s], p.opt_offset[d] + choice[d]);
    }
    index_sets();
  }

  // Numbers the distinct device sets of the active nodes and lists which of them overlap.
  void index_sets() {
    const int W = p.W;
    n_sets = 0;
    for (int j = 0; j < p.K; ++j) {
      if (!active[j]) continue;
      const uint64_t* b = &bits[j * W];
      int s = 0;
      while (s < n_sets && !std::equal(b, b + W, &set_bits[s * W])) ++s;
      if (s == n_sets) std::copy(b, b + W, &set_bits[n_sets++ * W]);
      set_of[j] = s;
    }
    int n = 0;
    for (int a = 0; a < n_sets; ++a) {
      ov_offset[a] = n;
      for (int b = 0; b < n_sets; ++b) {
        bool hit = false;
        for (int w = 0; w < W && !hit; ++w) hit = (set_bits[a * W + w] & set_bits[b * W + w]) != 0;
        if (hit) ov[n++] = b;
      }
    }
    ov_offset[n_sets] = n;
  }

  void schedule() {
    const int n = p.T * p.K;
    std::fill(last_end.begin(), last_end.begin() + n_sets, 0.0);
    std::fill(ready.begin(), ready.end(), 0.0);
    std::copy(p.indegree.begin(), p.indegree.end(), pending.begin());
    auto later = [](const std::pair<double, i64>& a, const std::pair<double, i64>& b) { return a > b; };
    heap.clear();
    for (int v = 0; v < n; ++v)
      if (pending[v] == 0) heap.emplace_back(0.0, v);
    std::make_heap(heap.begin(), heap.end(), later);
    const int ne = (int)p.edge_src.size();
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      double r = heap.back().first;
      i64 v = heap.back().second;
      heap.pop_back();
      while (v >= 0) {
        const int j = int(v % p.K);
        const bool pre = j >= ne && (j - ne) % 2 == 0;
        double s = r, e = r;
        if (active[j]) {
          const int set = set_of[j];
          for (int q = ov_offset[set]; q < ov_offset[set + 1]; ++q) s = std::max(s, last_end[ov[q]]);
          e = s + dur[j];
          last_end[set] = e;
        }
        start[v] = s;
        end[v] = e;
        for (i64 c = p.child_offset[v]; c < p.child_offset[v + 1]; ++c) {
          const i64 u = p.child[c];
          ready[u] = std::max(ready[u], e);
          if (--pending[u] == 0 && !pre) {
            heap.emplace_back(ready[u], u);
            std::push_heap(heap.begin(), heap.end(), later);
          }
        }
        // A pre-node's only child, its call, is placed at once: nothing runs between them.
        v = pre ? v + 1 : -1;
        r = e;
      }
    }
  }

  void memory(const i64* choice) {
    std::fill(stat.begin(), stat.end(), 0.0);
    std::fill(dyn.begin(), dyn.end(), 0.0);
    const i64 n_models = (i64)p.model_trainable.size();
    for (i64 m = 0; m < n_models; ++m) {
      const i64 c0 = p.model_calls_offset[m], c1 = p.model_calls_offset[m + 1];
      i64 f;
      double v;
      if (p.model_trainable[m]) {
        f = p.opt_offset[p.model_home[m]] + choice[p.model_home[m]];
        v = p.opt_state[f] + p.opt_weight[f];
      } else {
        if (c0 == c1 || !resident(choice, m)) continue;
        f = p.opt_offset[p.model_calls[c0]] + choice[p.model_calls[c0]];
        v = 0.0;
        for (i64 c = c0; c < c1; ++c) {
          const i64 i = p.model_calls[c];
          v = std::max(v, p.opt_weight[p.opt_offset[i] + choice[i]]);
        }
      }
      for (i64 d = p.opt_lo[f]; d < p.opt_lo[f] + p.opt_size[f]; ++d) stat[d] += v;
    }
    for (int i = 0; i < p.M; ++i) {
      const i64 f = p.opt_offset[i] + choice[i];
      const double need = p.opt_act[f] + (copy[i] ? p.opt_weight[f] : 0.0);
      for (i64 d = p.opt_lo[f]; d < p.opt_lo[f] + p.opt_size[f]; ++d) dyn[d] = std::max(dyn[d], need);
    }
    max_bytes = 0.0;
    for (int d = 0; d < p.D; ++d) max_bytes = std::max(max_bytes, stat[d] + dyn[d]);
    fits = max_bytes <= p.mem_cap;
  }

  // Simulates one plan; returns its cost (time per iteration, times the penalty if it does not fit).
  double run(const i64* choice) {
    build_nodes(choice);
    schedule();
    memory(choice);
    total = 0.0;
    for (int t = 0; t < p.T; ++t) {
      double m = end[t * p.K];
      for (int j = 1; j < p.K; ++j) m = std::max(m, end[t * p.K + j]);
      iter_end[t] = m;
      total = std::max(total, m);
    }
    period = p.T > 1 ? (iter_end[p.G] - iter_end[p.F]) / (p.G - p.F) : iter_end[0];
    return fits ? period : period * p.penalty;
  }
};

std::vector<i64> as_choice(const Problem& p, const py::array_t<i64, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 1 || a.shape(0) != p.M) throw std::invalid_argument("a plan has one option index per MFC");
  std::vector<i64> c(a.data(), a.data() + p.M);
  for (int i = 0; i < p.M; ++i)
    if (c[i] < 0 || c[i] >= p.num_options(i)) throw std::invalid_argument("option index out of range");
  return c;
}

template <typename T>
py::array_t<T> to_array(const std::vector<T>& v) {
  py::array_t<T> a(v.size());
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

// ------------------------------------------------------------------------------------------ search

double acceptance_probability(double old_cost, double new_cost, double temperature) {
  if (new_cost <= old_cost) return 1.0;
  if (temperature <= 0.0 || old_cost <= 0.0) return 0.0;
  return std::exp(-(new_cost - old_cost) / old_cost / temperature);
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// xoshiro256** — small, fast and identical on every platform, unlike std distributions.
struct Rng {
  uint64_t s[4];
  explicit Rng(uint64_t seed) {
    for (auto& x : s) x = splitmix64(seed);
  }
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t next() {
    const uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
  }
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }
  i64 below(i64 n) { return i64(next() % uint64_t(n)); }
};

using Ranked = std::pair<double, std::vector<i64>>;

// Keeps the k cheapest distinct plans, cheapest first.
void offer(std::vector<Ranked>& top, size_t k, double cost, const std::vector<i64>& plan) {
  if (top.size() >= k && !(cost < top.back().first)) return;
  for (const auto& r : top)
    if (r.second == plan) return;
  Ranked item(cost, plan);
  top.insert(std::upper_bound(top.begin(), top.end(), item), item);
  if (top.size() > k) top.pop_back();
}

struct Chain {
  Evaluator ev;
  Rng rng;
  std::vector<i64> cur;
  double cur_cost;
  i64 steps = 0, accepted = 0;
  std::vector<Ranked> top;
  Chain(const Problem& p, uint64_t seed, std::vector<i64> init)
      : ev(p), rng(seed), cur(std::move(init)), cur_cost(ev.run(cur.data())) {}
};

class Search {
 public:
  Search(std::shared_ptr<Problem> p, const std::vector<std::vector<i64>>& inits, int n_chains, uint64_t seed,
         double temperature, double local_prob, double pair_prob, int top_k)
      : p_(std::move(p)), temperature_(temperature), local_prob_(local_prob), pair_prob_(pair_prob),
        k_(size_t(std::max(1, top_k))) {
    if (inits.empty() || n_chains < 1) throw std::invalid_argument("need at least one initial plan and one chain");
    for (int c = 0; c < n_chains; ++c) {
      uint64_t s = seed ^ (0xD1B54A32D192ED03ULL * uint64_t(c + 1));
      chains_.push_back(std::make_unique<Chain>(*p_, splitmix64(s), checked(inits[c % inits.size()])));
    }
    // Every initial plan competes for the result, also those no chain starts from.
    Evaluator ev(*p_);
    for (size_t j = 0; j < inits.size(); ++j) {
      auto plan = checked(inits[j]);
      offer(chains_[j % chains_.size()]->top, k_, ev.run(plan.data()), plan);
    }
  }

  // Advances every chain until it has made `until_steps` proposals in all (0: no step limit) or for
  // `seconds` (0: no time limit), whichever comes first.
  void run(i64 until_steps, double seconds) {
    if (until_steps <= 0 && seconds <= 0) throw std::invalid_argument("give until_steps or seconds");
    auto work = [&](Chain* ch) { advance(*ch, until_steps, seconds); };
    if (chains_.size() == 1) {
      work(chains_[0].get());
      return;
    }
    std::vector<std::thread> threads;
    for (auto& ch : chains_) threads.emplace_back(work, ch.get());
    for (auto& t : threads) t.join();
  }

  std::vector<Ranked> top() const {
    std::vector<Ranked> all;
    for (const auto& ch : chains_)
      for (const auto& r : ch->top) offer(all, k_, r.first, r.second);
    return all;
  }
  i64 steps() const {
    i64 s = 0;
    for (const auto& ch : chains_) s += ch->steps;
    return s;
  }
  i64 min_steps() const {
    i64 s = chains_[0]->steps;
    for (const auto& ch : chains_) s = std::min(s, ch->steps);
    return s;
  }
  i64 accepted() const {
    i64 a = 0;
    for (const auto& ch : chains_) a += ch->accepted;
    return a;
  }

 private:
  std::vector<i64> checked(const std::vector<i64>& plan) const {
    if ((int)plan.size() != p_->M) throw std::invalid_argument("an initial plan has one option index per MFC");
    for (int i = 0; i < p_->M; ++i)
      if (plan[i] < 0 || plan[i] >= p_->num_options(i)) throw std::invalid_argument("initial plan index out of range");
    return plan;
  }

  i64 propose(Chain& ch, int i) const {
    const i64 cur = ch.cur[i], f = p_->opt_offset[i] + cur;
    const i64 n_nbr = p_->nbr_offset[f + 1] - p_->nbr_offset[f];
    if (n_nbr > 0 && ch.rng.uniform() < local_prob_) return p_->nbr[p_->nbr_offset[f] + ch.rng.below(n_nbr)];
    const i64 j = ch.rng.below(p_->num_options(i) - 1);
    return j >= cur ? j + 1 : j;
  }

  void advance(Chain& ch, i64 until_steps, double seconds) const {
    const i64 n_movable = (i64)p_->movable.size();
    if (n_movable == 0) return;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    for (i64 n = 0; until_steps <= 0 || ch.steps < until_steps; ++n) {
      if (seconds > 0 && (n & 31) == 0 && std::chrono::steady_clock::now() >= deadline) break;
      // One MFC changes; with pair_prob a second one too (e.g. two calls moving onto disjoint halves,
      // which no single change reaches without first passing through a much slower plan).
      const i64 a = ch.rng.below(n_movable);
      const int i = p_->movable[a];
      int j = -1;
      if (n_movable > 1 && ch.rng.uniform() < pair_prob_) {
        const i64 b = ch.rng.below(n_movable - 1);
        j = p_->movable[b >= a ? b + 1 : b];
      }
      const i64 old_i = ch.cur[i], old_j = j >= 0 ? ch.cur[j] : 0;
      ch.cur[i] = propose(ch, i);
      if (j >= 0) ch.cur[j] = propose(ch, j);
      const double cost = ch.ev.run(ch.cur.data());
      ++ch.steps;
      if (ch.rng.uniform() < acceptance_probability(ch.cur_cost, cost, temperature_)) {
        ch.cur_cost = cost;
        ++ch.accepted;
        offer(ch.top, k_, cost, ch.cur);
      } else {
        ch.cur[i] = old_i;
        if (j >= 0) ch.cur[j] = old_j;
      }
    }
  }

  std::shared_ptr<Problem> p_;
  double temperature_, local_prob_, pair_prob_;
  size_t k_;
  std::vector<std::unique_ptr<Chain>> chains_;
};

// Every plan, in mixed-radix order; the k cheapest.
std::pair<std::vector<Ranked>, i64> exhaustive(const Problem& p, i64 max_plans, int top_k) {
  double count = 1;
  for (int i = 0; i < p.M; ++i) count *= double(p.num_options(i));
  if (count > double(max_plans)) throw std::invalid_argument("too many plans for an exhaustive search");
  Evaluator ev(p);
  std::vector<i64> plan(p.M, 0);
  std::vector<Ranked> top;
  i64 n = 0;
  while (true) {
    offer(top, size_t(std::max(1, top_k)), ev.run(plan.data()), plan);
    ++n;
    int i = 0;
    while (i < p.M && ++plan[i] == p.num_options(i)) plan[i++] = 0;
    if (i == p.M) break;
  }
  return {top, n};
}

py::list ranked_to_py(const std::vector<Ranked>& top) {
  py::list out;
  for (const auto& r : top) out.append(py::make_tuple(r.first, to_array(r.second)));
  return out;
}


// ------------------------------------------------------------------------------------------ reallocation

// Reallocation time table (rlflow/planner/transfer.py, realloc_time_table): for every home option h
// and target option t, the slowest receive time over t's destination columns. Columns are the
// distinct (device, tp, tp rank, share, stage start, stage stop) of the targets' ranks; `inverse`
// maps each (target, rank) to its column and `segments[t]` is the first rank of target t. The same
// arithmetic, in the same order, as the numpy twin (_node_holdings, _column_costs, then
// np.maximum.reduceat), so both give the same bits.
struct ReallocInputs {
  i64 dpn, num_nodes;
  double intra, inter, latency;
  std::vector<i64> h_first, h_size, h_dp, h_tp, h_pp, h_start, h_stop;  // h_start/h_stop: (n_home, width)
  std::vector<i64> c_device, c_tp, c_r, c_s, c_e, inverse, segments, tensors, t_first;
  std::vector<double> c_share, cum, item_bytes;
};

// A destination receives nothing when what it holds of the home layout is all it needs, up to
// rounding (the numpy twin's _LOCAL_TOLERANCE).
constexpr double kLocalTolerance = 1e-9;

// cum[n * (items + 1) + k]: bytes of items < k that home option h holds on node n.
void node_holdings(const ReallocInputs& in, i64 h, i64 width, std::vector<double>& hold, std::vector<double>& counts) {
  const i64 items = (i64)in.item_bytes.size(), dp = in.h_dp[h], tp = in.h_tp[h], pp = in.h_pp[h];
  counts.assign(in.num_nodes * pp, 0.0);
  for (i64 g = 0; g < dp * pp; ++g) counts[((in.h_first[h] + g * tp) / in.dpn) * pp + g / dp] += 1.0;
  hold.assign(in.num_nodes * (items + 1), 0.0);
  for (i64 n = 0; n < in.num_nodes; ++n) {
    double acc = 0.0;
    for (i64 st = 0; st < pp; ++st) {
      const double c = counts[n * pp + st];
      for (i64 k = in.h_start[h * width + st]; k < in.h_stop[h * width + st]; ++k) {
        acc += c / double(dp) * in.item_bytes[k];
        hold[n * (items + 1) + k + 1] = acc;
      }
    }
  }
}

double column_seconds(const ReallocInputs& in, i64 h, i64 width, const std::vector<double>& hold, i64 u) {
  const i64 items = (i64)in.item_bytes.size();
  const i64 device = in.c_device[u], tp = in.c_tp[u], r = in.c_r[u], s = in.c_s[u], e = in.c_e[u];
  const double share = in.c_share[u];
  const i64 node = device / in.dpn;
  const double total = (in.cum[e] - in.cum[s]) / double(tp) * share;
  const double* held = &hold[node * (items + 1)];
  const double on_node = (held[e] - held[s]) / double(tp) * share;
  const i64 h_tp = in.h_tp[h], h_dp = in.h_dp[h];
  i64 rho = device - in.h_first[h];
  const bool inside = rho >= 0 && rho < in.h_size[h];
  if (!inside) rho = 0;
  const i64 q = rho % h_tp, i = rho / (h_tp * h_dp);
  const i64 lo = std::max(in.h_start[h * width + i], s), hi = std::min(in.h_stop[h * width + i], e);
  const double shared = in.cum[std::max(hi, lo)] - in.cum[lo];
  const double tp_part = std::max(0.0, std::min(double(q + 1) / double(h_tp), double(r + 1) / double(tp)) -
                                           std::max(double(q) / double(h_tp), double(r) / double(tp)));
  const double local = inside ? shared * tp_part / double(h_dp) * share : 0.0;
  const double seconds = (on_node - local) / in.intra + (total - on_node) / in.inter;
  // One broadcast per parameter tensor; a device that holds all it needs copies it in memory.
  if (!(total - local > kLocalTolerance * total)) return local / in.intra;
  return seconds + double(in.tensors[e] - in.tensors[s]) * in.latency;
}

// A destination on a host where the home holds nothing receives everything across hosts: its
// time does not depend on the home (the twin's arithmetic with on_node = local = 0).
double far_seconds(const ReallocInputs& in, i64 u) {
  const double total = (in.cum[in.c_e[u]] - in.cum[in.c_s[u]]) / double(in.c_tp[u]) * in.c_share[u];
  const double seconds = (0.0 - 0.0) / in.intra + (total - 0.0) / in.inter;
  return seconds + double(in.tensors[in.c_e[u]] - in.tensors[in.c_s[u]]) * in.latency;
}

// Only the columns on the home's hosts (a contiguous run: columns are sorted by device) depend on
// the home. A target that does not reach those hosts takes its far time; one that does takes the
// slowest of its ranks there (recomputed) and of its other ranks (prefix / suffix maxima of the far
// times: rank k of a target sits on device first + k).
py::array_t<double> realloc_table(const ReallocInputs& in) {
  const i64 n_home = (i64)in.h_first.size(), n_cols = (i64)in.c_device.size();
  const i64 n_targets = (i64)in.segments.size(), n_ranks = (i64)in.inverse.size();
  const i64 width = n_home ? (i64)in.h_start.size() / n_home : 0;
  py::array_t<double> out({n_home, n_targets});
  double* table = out.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<double> hold, counts, cost(n_cols), prefix(n_ranks), suffix(n_ranks);
    auto end_of = [&](i64 t) { return t + 1 < n_targets ? in.segments[t + 1] : n_ranks; };
    for (i64 u = 0; u < n_cols; ++u) cost[u] = far_seconds(in, u);
    for (i64 t = 0; t < n_targets; ++t) {
      const i64 r0 = in.segments[t], r1 = end_of(t);
      prefix[r0] = cost[in.inverse[r0]];
      for (i64 k = r0 + 1; k < r1; ++k) prefix[k] = std::max(prefix[k - 1], cost[in.inverse[k]]);
      suffix[r1 - 1] = cost[in.inverse[r1 - 1]];
      for (i64 k = r1 - 2; k >= r0; --k) suffix[k] = std::max(suffix[k + 1], cost[in.inverse[k]]);
    }
    for (i64 h = 0; h < n_home; ++h) {
      const i64 dev_lo = in.h_first[h] / in.dpn * in.dpn;
      const i64 dev_hi = ((in.h_first[h] + in.h_size[h] - 1) / in.dpn + 1) * in.dpn;
      const i64 u0 = std::lower_bound(in.c_device.begin(), in.c_device.end(), dev_lo) - in.c_device.begin();
      const i64 u1 = std::lower_bound(in.c_device.begin(), in.c_device.end(), dev_hi) - in.c_device.begin();
      node_holdings(in, h, width, hold, counts);
      std::vector<double> near(cost.begin() + u0, cost.begin() + u1);
      for (i64 u = u0; u < u1; ++u) near[u - u0] = column_seconds(in, h, width, hold, u);
      for (i64 t = 0; t < n_targets; ++t) {
        const i64 seg = in.segments[t], n = end_of(t) - seg, first = in.t_first[t];
        const i64 k0 = std::max<i64>(0, dev_lo - first), k1 = std::min<i64>(n, dev_hi - first);
        if (k0 >= k1) {
          table[h * n_targets + t] = prefix[seg + n - 1];
          continue;
        }
        double m = near[in.inverse[seg + k0] - u0];
        for (i64 k = k0 + 1; k < k1; ++k) m = std::max(m, near[in.inverse[seg + k] - u0]);
        if (k0 > 0) m = std::max(m, prefix[seg + k0 - 1]);
        if (k1 < n) m = std::max(m, suffix[seg + k1]);
        table[h * n_targets + t] = m;
      }
    }
  }
  return out;
}

template <typename T>
std::vector<T> as_vector(const py::array_t<T, py::array::c_style | py::array::forcecast>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

}  // namespace

PYBIND11_MODULE(_C_planner, m) {
  m.doc() = "Planner simulator and Metropolis-Hastings search (C++ twin of rlflow.planner.simulate)";
  using IntArray = py::array_t<i64, py::array::c_style | py::array::forcecast>;

  py::class_<Problem, std::shared_ptr<Problem>> problem(m, "Problem");
  std::vector<std::string> fields(kIntFields);
  fields.insert(fields.end(), kFloatFields.begin(), kFloatFields.end());
  problem.attr("ARRAY_FIELDS") = py::cast(fields);
  problem
      .def(py::init<int, int, int, int, double, double, const py::dict&, int, int>(), py::arg("num_devices"),
           py::arg("num_mfcs"), py::arg("num_iterations"), py::arg("nodes_per_iteration"),
           py::arg("device_memory_bytes"), py::arg("penalty"), py::arg("arrays"), py::arg("period_from") = 0,
           py::arg("period_to") = -1)
      .def("cost", [](const Problem& p, const IntArray& a) {
        auto c = as_choice(p, a);
        return Evaluator(p).run(c.data());
      })
      .def("costs", [](const Problem& p, const IntArray& plans) {
        if (plans.ndim() != 2 || plans.shape(1) != p.M) throw std::invalid_argument("plans must have shape (n, num_mfcs)");
        const i64 n = plans.shape(0);
        std::vector<i64> flat(plans.data(), plans.data() + n * p.M);
        for (i64 r = 0; r < n; ++r)
          for (int i = 0; i < p.M; ++i)
            if (flat[r * p.M + i] < 0 || flat[r * p.M + i] >= p.num_options(i))
              throw std::invalid_argument("option index out of range");
        std::vector<double> out(n);
        {
          py::gil_scoped_release release;
          Evaluator ev(p);
          for (i64 r = 0; r < n; ++r) out[r] = ev.run(&flat[r * p.M]);
        }
        return to_array(out);
      })
      .def("evaluate", [](const Problem& p, const IntArray& a) {
        auto c = as_choice(p, a);
        Evaluator ev(p);
        ev.run(c.data());
        std::vector<uint8_t> act(p.T * p.K);
        for (int v = 0; v < p.T * p.K; ++v) act[v] = ev.active[v % p.K];
        std::vector<double> peak(p.D);
        for (int d = 0; d < p.D; ++d) peak[d] = ev.stat[d] + ev.dyn[d];
        return py::make_tuple(to_array(ev.start), to_array(ev.end), to_array(act), to_array(ev.stat), to_array(peak));
      });

  py::class_<Search>(m, "Search")
      .def(py::init([](std::shared_ptr<Problem> p, const std::vector<std::vector<i64>>& inits, int n_chains,
                       uint64_t seed, double temperature, double local_prob, double pair_prob, int top_k) {
             return new Search(std::move(p), inits, n_chains, seed, temperature, local_prob, pair_prob, top_k);
           }),
           py::arg("problem"), py::arg("initial_plans"), py::arg("num_chains"), py::arg("seed"),
           py::arg("temperature"), py::arg("local_prob"), py::arg("pair_prob"), py::arg("top_k"))
      .def("run", &Search::run, py::arg("until_steps"), py::arg("seconds"), py::call_guard<py::gil_scoped_release>())
      .def("top", [](const Search& s) { return ranked_to_py(s.top()); })
      .def_property_readonly("steps", &Search::steps)
      .def_property_readonly("min_steps", &Search::min_steps)
      .def_property_readonly("accepted", &Search::accepted);

  m.def("acceptance_probability", &acceptance_probability, py::arg("old_cost"), py::arg("new_cost"),
        py::arg("temperature"), "min(1, exp(-(new - old) / old / temperature))");
  m.def(
      "exhaustive",
      [](std::shared_ptr<Problem> p, i64 max_plans, int top_k) {
        std::pair<std::vector<Ranked>, i64> r;
        {
          py::gil_scoped_release release;
          r = exhaustive(*p, max_plans, top_k);
        }
        return py::make_tuple(ranked_to_py(r.first), r.second);
      },
      py::arg("problem"), py::arg("max_plans"), py::arg("top_k"));
  using FloatArray = py::array_t<double, py::array::c_style | py::array::forcecast>;
  m.def(
      "realloc_table",
      [](const py::dict& home, const py::dict& cols, const IntArray& inverse, const IntArray& segments,
         const IntArray& t_first,
         const FloatArray& cum, const IntArray& tensors, const FloatArray& item_bytes, i64 dpn, i64 num_nodes,
         double intra, double inter, double latency) {
        ReallocInputs in;
        in.dpn = dpn;
        in.num_nodes = num_nodes;
        in.intra = intra;
        in.inter = inter;
        in.latency = latency;
        auto ints = [](const py::dict& d, const char* k) { return as_vector<i64>(d[k].cast<IntArray>()); };
        in.h_first = ints(home, "first");
        in.h_size = ints(home, "size");
        in.h_dp = ints(home, "dp");
        in.h_tp = ints(home, "tp");
        in.h_pp = ints(home, "pp");
        in.h_start = ints(home, "start");
        in.h_stop = ints(home, "stop");
        in.c_device = ints(cols, "device");
        in.c_tp = ints(cols, "tp");
        in.c_r = ints(cols, "r");
        in.c_s = ints(cols, "s");
        in.c_e = ints(cols, "e");
        in.c_share = as_vector<double>(cols["share"].cast<FloatArray>());
        in.inverse = as_vector<i64>(inverse);
        in.segments = as_vector<i64>(segments);
        in.t_first = as_vector<i64>(t_first);
        if (in.t_first.size() != in.segments.size()) throw std::invalid_argument("one first device per target");
        if (!std::is_sorted(in.c_device.begin(), in.c_device.end()))
          throw std::invalid_argument("columns must be sorted by device");
        in.cum = as_vector<double>(cum);
        in.tensors = as_vector<i64>(tensors);
        in.item_bytes = as_vector<double>(item_bytes);
        const size_t n_home = in.h_first.size();
        for (const auto* v : {&in.h_size, &in.h_dp, &in.h_tp, &in.h_pp})
          if (v->size() != n_home) throw std::invalid_argument("home arrays differ in length");
        if (n_home && (in.h_start.size() != in.h_stop.size() || in.h_start.size() % n_home))
          throw std::invalid_argument("home stage tables must have shape (n_home, width)");
        for (i64 i : in.inverse)
          if (i < 0 || i >= (i64)in.c_device.size()) throw std::invalid_argument("inverse index outside the columns");
        for (i64 k = 0; k < (i64)in.segments.size(); ++k)
          if (in.segments[k] < 0 || in.segments[k] >= (i64)in.inverse.size() || (k && in.segments[k] <= in.segments[k - 1]))
            throw std::invalid_argument("segments must increase within the ranks");
        return realloc_table(in);
      },
      py::arg("home"), py::arg("columns"), py::arg("inverse"), py::arg("segments"), py::arg("target_first"),
      py::arg("cum"),
      py::arg("tensors"), py::arg("item_bytes"), py::arg("devices_per_node"), py::arg("num_nodes"),
      py::arg("intra_host_bandwidth"), py::arg("inter_host_bandwidth"), py::arg("latency"),
      "realloc_time_table's (n_home, n_targets) slowest receive times (the numpy twin's bits)");
}
