// One decode step of a Llama-style decoder on CPU in float32: the whole step in one call.
//
// Python twin: rlflow.engine.rollout.fast_decode.FastDecoder.step (the tests compare the two).
// On the small models of CPU rollouts a decode step is a few dozen tiny torch ops, each costing
// more in dispatch and allocation than in arithmetic (docs/benchmarks.md, "Sampler"). Here the
// same math runs in one C++ call over buffers allocated once: embedding, per layer RMSNorm →
// fused q/k/v (+ bias, per-head q/k RMSNorm) → RoPE → KV write at the step's slot → attention
// over the valid keys (additive key mask, sliding window, grouped-query heads) → o-projection +
// residual → RMSNorm → fused gate/up → SiLU(gate) · up →
// down-projection + residual; then the final RMSNorm and the LM head.
//
// Layouts (all float32, C-contiguous):
//   matrices given (in, out): y = x @ W, the LM head too (H, V); the decoder packs each once into
//   panels of 16 output columns (Panels below). The embedding (V, H).
//   KV buffers (N, Hkv, T, D) per layer, shared with the twin (it filled the prompt slots).
//   rope tables (N, R, D): cos, and sin with its first half negated (FastDecoder's form:
//   rope(q) = q * cos + roll(q, D/2) * sin).
//   key mask (N, T) additive: 0 where a row may attend, -inf where not.
// The arithmetic follows HF's order (RMSNorm in float32 then times the weight; softmax with the
// row maximum subtracted), but sums run in another order than MKL's (and the AVX-512 softmax takes
// its exp from cpu.h's polynomial, within 1 ulp of expf), so results agree with the twin to float
// rounding, not bit for bit. Matmuls, attention and the SiLU split over torch's
// threads (rlflow_cpu::on_threads in cpu.h).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RLFLOW_X86 1
#endif

namespace py = pybind11;
using i64 = int64_t;
using FArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

namespace {

using rlflow_cpu::kernel_level;
using rlflow_cpu::on_threads;
using rlflow_cpu::share;
#ifdef RLFLOW_X86
using rlflow_cpu::dot_avx2;
using rlflow_cpu::dot_avx512;
using rlflow_cpu::exp_sum_avx512;
using rlflow_cpu::first_lanes;
#endif

// ---------------------------------------------------------------- matmul: y[n, :] = base + x[n, :] @ w

// A matrix (in, out) held as panels of kPanel output columns: panel p is its columns
// [p kPanel, (p + 1) kPanel) as an (in, kPanel) contiguous block, zero past `out`. A kernel streams
// one panel front to back (the hardware prefetchers follow it, where the rows of an (in, out) matrix
// lie a whole row apart), and threads take disjoint runs of panels.
constexpr i64 kPanel = 16;

// A decoder's panels, all of them in one buffer, kept after the decoder is gone for the next decoder
// of the same shapes (a generate call builds one, and every call of a run packs the same shapes):
// fresh pages cost as much to touch as the packing itself. At most kKeptBytes are kept.
class Kept {
 public:
  static constexpr size_t kKeptBytes = size_t{1} << 30;

  static float* take(size_t floats) {
    std::lock_guard<std::mutex> hold(mutex());
    auto& kept = buffers();
    for (auto it = kept.begin(); it != kept.end(); ++it) {
      if (it->first == floats) {
        float* buffer = it->second;
        kept.erase(it);
        bytes() -= floats * sizeof(float);
        return buffer;
      }
    }
    return allocate(floats);
  }

  static void give(float* buffer, size_t floats) {
    std::lock_guard<std::mutex> hold(mutex());
    if (bytes() + floats * sizeof(float) > kKeptBytes) {
      std::free(buffer);
      return;
    }
    buffers().emplace_back(floats, buffer);
    bytes() += floats * sizeof(float);
  }

 private:
  // Room for `floats` floats, 64-byte aligned; on Linux one of 2 MB or more in 2 MB pages where the
  // kernel grants them (transparent huge pages on request): a step streams every panel once, and
  // through 4 KB pages tens of MB of them miss the TLB page after page (docs/benchmarks.md, "All
  // three tasks on an AVX2 CPU").
  static float* allocate(size_t floats) {
    constexpr size_t kLine = 64, kHuge = size_t{2} << 20;
    size_t bytes = floats * sizeof(float);
    const bool huge = bytes >= kHuge;
    const size_t align = huge ? kHuge : kLine;
    bytes = (bytes + align - 1) / align * align;  // aligned_alloc's size: a multiple of the alignment
    void* buffer = std::aligned_alloc(align, bytes);
    if (buffer == nullptr) throw std::bad_alloc();
#ifdef __linux__
    if (huge) madvise(buffer, bytes, MADV_HUGEPAGE);  // advice: 4 KB pages where refused
#endif
    return static_cast<float*>(buffer);
  }

  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::vector<std::pair<size_t, float*>>& buffers() {
    static std::vector<std::pair<size_t, float*>> b;
    return b;
  }
  static size_t& bytes() {
    static size_t n = 0;
    return n;
  }
};

struct KeptDeleter {
  size_t floats = 0;
  void operator()(float* buffer) const { Kept::give(buffer, floats); }
};

struct Panels {
  i64 in = 0, out = 0, count = 0;
  const float* source = nullptr;  // the (in, out) matrix packed from, until fill() has run
  float* data = nullptr;  // count x in x kPanel floats in the decoder's buffer, 64-byte aligned
  i64 floats() const { return count * in * kPanel; }  // a multiple of 16: a whole number of cache lines
  const float* panel(i64 p) const { return data + p * in * kPanel; }

  // Panels [p0, p1) from `source` (columns past `out` zero); the threads fill disjoint runs, each
  // touching its own pages first.
  void fill(i64 p0, i64 p1) const {
    for (i64 q = p0; q < p1; ++q) {
      const i64 width = std::min(kPanel, out - q * kPanel);
      float* dst = data + q * in * kPanel;
      for (i64 k = 0; k < in; ++k) {
        std::copy_n(source + k * out + q * kPanel, width, dst + k * kPanel);
        std::fill(dst + k * kPanel + width, dst + (k + 1) * kPanel, 0.f);
      }
    }
  }
};

// The panels of an (in, out) matrix, placed and filled later (Decoder::fill_panels, on its threads).
Panels panels_of(const float* source, i64 in, i64 out) {
  Panels p;
  p.in = in;
  p.out = out;
  p.count = (out + kPanel - 1) / kPanel;
  p.source = source;
  return p;
}

// Scalar kernel (any CPU): panels [p0, p1), rows one at a time. y holds the base on entry.
void panels_scalar(const float* x, i64 n, const Panels& w, i64 p0, i64 p1, float* y) {
  for (i64 q = p0; q < p1; ++q) {
    const float* panel = w.panel(q);
    const i64 j = q * kPanel, width = std::min(kPanel, w.out - j);
    for (i64 r = 0; r < n; ++r) {
      float acc[kPanel];
      std::copy_n(y + r * w.out + j, width, acc);
      const float* xr = x + r * w.in;
      for (i64 k = 0; k < w.in; ++k) {
        const float a = xr[k];
        for (i64 c = 0; c < width; ++c) acc[c] += a * panel[k * kPanel + c];
      }
      std::copy_n(acc, width, y + r * w.out + j);
    }
  }
}

// How far ahead (in panel rows of 64 bytes) the kernels ask for weights: the hardware prefetchers
// stop at page boundaries, a panel runs over many pages.
constexpr i64 kPrefetchRows = 64;
// Panel rows (of 64 bytes) the AVX2 tiles of a step's rows take in turn before the next ones, and
// how far ahead each tile asks for the weights.
constexpr i64 kAvx2Depth = 64;
constexpr i64 kAvx2PrefetchRows = 2 * kAvx2Depth;

// Asks for the cache lines of floats [p, p + n) (a no-op off x86): a row of attention runs over each
// (row, kv head)'s keys, then its values, front to back, a few KB each, too short for the hardware
// prefetchers to get ahead.
inline void prefetch_lines(const float* p, i64 n) {
#ifdef RLFLOW_X86
  for (i64 i = 0; i < n; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
#else
  (void)p, (void)n;
#endif
}
constexpr i64 kKeysAhead = 8;  // keys (or values) ahead of the one in use that attention asks for

#ifdef RLFLOW_X86
// AVX2/FMA tile: R <= 6 rows x one panel over panel rows [k0, k1), 12 accumulators, so each weight
// vector loaded feeds R FMAs; the rows' values come k-major (xt[k n + r]: one contiguous run a k).
// Every tile, not only the first, asks for the weights ahead: the later tiles read the block from
// cache, and a step streams more weights than the L3 holds, so without their requests the memory
// would idle while they run.
template <int R>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* xt, i64 n, const float* panel, i64 k0, i64 k1,
                                                        float* y, i64 out) {
  __m256 acc[R][2];
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    acc[i][0] = _mm256_loadu_ps(y + i * out);
    acc[i][1] = _mm256_loadu_ps(y + i * out + 8);
  }
  for (i64 k = k0; k < k1; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * kPanel);
    const __m256 w1 = _mm256_load_ps(panel + k * kPanel + 8);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kAvx2PrefetchRows) * kPanel), _MM_HINT_T0);
    const float* a = xt + k * n;
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      const __m256 ai = _mm256_broadcast_ss(a + i);
      acc[i][0] = _mm256_fmadd_ps(ai, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(ai, w1, acc[i][1]);
    }
  }
#pragma GCC unroll 6
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(y + i * out, acc[i][0]);
    _mm256_storeu_ps(y + i * out + 8, acc[i][1]);
  }
}

// AVX2/FMA kernel: panels [p0, p1), the step's rows in tiles of 6 (tile_avx2), kAvx2Depth panel
// rows at a time so the block stays in L1 for every tile; x given row-major (the scalar kernel's,
// for a last panel narrower than kPanel) and k-major (xt, the tiles'). y holds the base on entry.
__attribute__((target("avx2,fma"))) void panels_avx2(const float* x, const float* xt, i64 n, const Panels& w, i64 p0,
                                                      i64 p1, float* y) {
  using Tile = void (*)(const float*, i64, const float*, i64, i64, float*, i64);
  static constexpr Tile kTiles[7] = {nullptr,          &tile_avx2<1>, &tile_avx2<2>, &tile_avx2<3>,
                                     &tile_avx2<4>, &tile_avx2<5>, &tile_avx2<6>};
  const i64 in = w.in, out = w.out;
  for (i64 q = p0; q < p1; ++q) {
    const i64 j = q * kPanel;
    if (out - j < kPanel) {
      panels_scalar(x, n, w, q, q + 1, y);
      continue;
    }
    const float* panel = w.panel(q);
    for (i64 k0 = 0; k0 < in; k0 += kAvx2Depth) {
      const i64 k1 = std::min(in, k0 + kAvx2Depth);
      for (i64 r = 0; r < n; r += 6) kTiles[std::min<i64>(6, n - r)](xt + r, n, panel, k0, k1, y + r * out + j, out);
    }
  }
}

// AVX-512 kernel: tiles of up to 16 rows x one panel (one 16-wide accumulator a row), so a decode
// step's rows read each weight once from memory and each weight vector feeds up to 16 FMAs; a
// last panel narrower than kPanel is loaded and stored under a mask.
template <int R>
__attribute__((target("avx512f"))) inline void tile_avx512(const float* x, i64 in, const float* panel, float* y,
                                                          i64 out, __mmask16 cols) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_maskz_loadu_ps(cols, y + i * out);
  for (i64 k = 0; k < in; ++k) {
    const __m512 wk = _mm512_load_ps(panel + k * kPanel);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetchRows) * kPanel), _MM_HINT_T0);
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i * in + k]), wk, acc[i]);
  }
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + i * out, cols, acc[i]);
}

__attribute__((target("avx512f"))) void panels_avx512(const float* x, i64 n, const Panels& w, i64 p0, i64 p1,
                                                        float* y) {
  const i64 in = w.in, out = w.out;
  for (i64 q = p0; q < p1; ++q) {
    const i64 j = q * kPanel, width = std::min(kPanel, out - j);
    const __mmask16 cols = first_lanes(width);
    const float* panel = w.panel(q);
    i64 r = 0;
    for (; r + 16 <= n; r += 16) tile_avx512<16>(x + r * in, in, panel, y + r * out + j, out, cols);
    if (r + 8 <= n) tile_avx512<8>(x + r * in, in, panel, y + r * out + j, out, cols), r += 8;
    if (r + 4 <= n) tile_avx512<4>(x + r * in, in, panel, y + r * out + j, out, cols), r += 4;
    for (; r < n; ++r) tile_avx512<1>(x + r * in, in, panel, y + r * out + j, out, cols);
  }
}

// o[0:dim] = sum over t in [start, end] of p[t] * vals[t dim : (t + 1) dim], for dim a multiple of 8:
// chunks of 64 columns held in 8 registers across the whole t loop (attention's weighted values).
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* p, const float* vals, i64 start, i64 end,
                                                            i64 dim, float* o) {
  for (i64 c = 0; c < dim; c += 64) {
    const int width = static_cast<int>(std::min<i64>(64, dim - c)) / 8;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (i64 t = start; t <= end; ++t) {
      const __m256 pt = _mm256_broadcast_ss(p + t);
      const float* v = vals + t * dim + c;
      prefetch_lines(v + kKeysAhead * dim, 8 * width);
      for (int i = 0; i < width; ++i) acc[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    for (int i = 0; i < width; ++i) _mm256_storeu_ps(o + c + 8 * i, acc[i]);
  }
}

// Attention's softmax over s[start..end] in place, the row maximum `top` subtracted: exp, sum, then
// each divided by the sum (as the scalar loop does it), 16 at a time with a masked tail. AVX2 keeps
// the scalar loop: 8 wide with exp_avx2 its step runs slower than with expf one by one.
__attribute__((target("avx512f"))) void softmax_avx512(float* s, i64 start, i64 end, float top) {
  const __m512 total = _mm512_set1_ps(exp_sum_avx512(s + start, end + 1 - start, 1.0f, top));
  for (i64 i = start; i <= end; i += 16) {
    const __mmask16 m = first_lanes(end + 1 - i);
    _mm512_mask_storeu_ps(s + i, m, _mm512_div_ps(_mm512_maskz_loadu_ps(m, s + i), total));
  }
}

// weighted_sum_avx2 in 16-wide registers (dim a multiple of 16): chunks of 128 columns.
__attribute__((target("avx512f"))) void weighted_sum_avx512(const float* p, const float* vals, i64 start, i64 end,
                                                              i64 dim, float* o) {
  for (i64 c = 0; c < dim; c += 128) {
    const int width = static_cast<int>(std::min<i64>(128, dim - c)) / 16;
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (i64 t = start; t <= end; ++t) {
      const __m512 pt = _mm512_set1_ps(p[t]);
      const float* v = vals + t * dim + c;
      for (int i = 0; i < width; ++i) acc[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16 * i), acc[i]);
    }
    for (int i = 0; i < width; ++i) _mm512_storeu_ps(o + c + 16 * i, acc[i]);
  }
}
#endif

float dot_scalar(const float* a, const float* b, i64 n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;  // four chains: the adds overlap
  i64 i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

// ---------------------------------------------------------------- the decoder

struct Layer {
  FArray input_norm, qkv_b, qk_norm, o_b, post_norm, gate_up_b, down_b;
  Panels qkv_w, o_w, gate_up_w, down_w;  // packed from the (in, out) matrices the Python side gives
  bool has_qkv_b = false, has_qk_norm = false, has_o_b = false, has_gate_up_b = false, has_down_b = false;
  i64 window = 0;  // 0: full attention
};

// A float32 C-contiguous array used as it is (written in place), never a converted copy.
py::array_t<float, py::array::c_style> in_place(py::handle h, const std::string& name) {
  if (!py::isinstance<py::array_t<float, py::array::c_style>>(h)) {
    throw std::invalid_argument("NativeDecoder: " + name + " must be a float32 C-contiguous array (written in place)");
  }
  auto a = py::reinterpret_borrow<py::array_t<float, py::array::c_style>>(h);
  if (!a.writeable()) throw std::invalid_argument("NativeDecoder: " + name + " is read-only");
  return a;
}

void check_shape(const FArray& a, std::vector<i64> shape, const std::string& name) {
  bool ok = a.ndim() == static_cast<py::ssize_t>(shape.size());
  for (size_t i = 0; ok && i < shape.size(); ++i) ok = a.shape(i) == shape[i];
  if (!ok) {
    std::string want = "(";
    for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
    std::string got = "(";
    for (py::ssize_t i = 0; i < a.ndim(); ++i) got += (i ? ", " : "") + std::to_string(a.shape(i));
    throw std::invalid_argument("NativeDecoder: " + name + " has shape " + got + "), expected " + want + ")");
  }
}

// Room for the panels of an (in, out) matrix, checked; `sources` keeps the array alive until filled.
Panels packed(py::handle h, i64 in, i64 out, const std::string& name, std::vector<FArray>& sources) {
  FArray a = h.cast<FArray>();
  check_shape(a, {in, out}, name);
  sources.push_back(a);
  return panels_of(a.data(), in, out);
}

// Work below this many multiply-adds (or exps) runs on the calling thread: waking the team costs
// about a microsecond, as much as that work does.
constexpr i64 kParallelMacs = 1 << 16;

class Decoder {
 public:
  Decoder(i64 hidden, i64 heads, i64 kv_heads, i64 head_dim, i64 inter, i64 vocab, double eps, double scale,
          FArray embed, FArray final_norm, py::handle head_t, py::list layers, int threads, int kernels)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), inter_(inter), vocab_(vocab),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)), embed_(embed), final_norm_(final_norm),
        level_(kernel_level(kernels)), threads_(threads) {
    if (heads % kv_heads != 0) throw std::invalid_argument("NativeDecoder: heads must be a multiple of kv_heads");
    if (threads < 1) throw std::invalid_argument("NativeDecoder: threads must be at least 1");
    check_shape(embed_, {vocab, hidden}, "embed");
    check_shape(final_norm_, {hidden}, "final_norm");
    std::vector<FArray> sources;
    head_t_ = packed(head_t, hidden, vocab, "head_t", sources);
    const i64 qkv = (heads + 2 * kv_heads) * head_dim;
    for (py::handle item : layers) {
      py::dict d = py::reinterpret_borrow<py::dict>(item);
      Layer l;
      l.input_norm = d["input_norm"].cast<FArray>();
      l.post_norm = d["post_norm"].cast<FArray>();
      check_shape(l.input_norm, {hidden}, "input_norm");
      check_shape(l.post_norm, {hidden}, "post_norm");
      l.qkv_w = packed(d["qkv_w"], hidden, qkv, "qkv_w", sources);
      l.o_w = packed(d["o_w"], heads * head_dim, hidden, "o_w", sources);
      l.gate_up_w = packed(d["gate_up_w"], hidden, 2 * inter, "gate_up_w", sources);
      l.down_w = packed(d["down_w"], inter, hidden, "down_w", sources);
      auto optional = [&](const char* key, FArray& dst, bool& has, std::vector<i64> shape) {
        if (d.contains(key) && !d[key].is_none()) {
          dst = d[key].cast<FArray>();
          check_shape(dst, shape, key);
          has = true;
        }
      };
      optional("qkv_b", l.qkv_b, l.has_qkv_b, {qkv});
      optional("qk_norm", l.qk_norm, l.has_qk_norm, {heads + kv_heads, head_dim});
      optional("o_b", l.o_b, l.has_o_b, {hidden});
      optional("gate_up_b", l.gate_up_b, l.has_gate_up_b, {2 * inter});
      optional("down_b", l.down_b, l.has_down_b, {hidden});
      l.window = d.contains("window") && !d["window"].is_none() ? d["window"].cast<i64>() : 0;
      layers_.push_back(std::move(l));
    }
    fill_panels();
  }

  // Every matrix's panels, one after another in one buffer, the threads taking equal shares of all
  // of them (the pages may be new: touching them costs as much as copying into them).
  void fill_panels() {
    std::vector<Panels*> all{&head_t_};
    for (auto& l : layers_) all.insert(all.end(), {&l.qkv_w, &l.o_w, &l.gate_up_w, &l.down_w});
    size_t floats = 0;
    for (const Panels* p : all) floats += p->floats();
    panels_ = std::unique_ptr<float[], KeptDeleter>(Kept::take(floats), KeptDeleter{floats});
    float* next = panels_.get();
    for (Panels* p : all) next = (p->data = next) + p->floats();
    i64 total = 0;
    for (const Panels* p : all) total += p->count;
    auto task = [&](int t, int n) {
      const auto [begin, end] = share(total, t, n);
      i64 first = 0;  // index of the current matrix's first panel among all
      for (const Panels* p : all) {
        const i64 lo = std::max(begin, first), hi = std::min(end, first + p->count);
        if (lo < hi) p->fill(lo - first, hi - first);
        first += p->count;
      }
    };
    {
      py::gil_scoped_release release;
      on_threads(threads_, task);
    }
    for (Panels* p : all) p->source = nullptr;
  }

  // The kernels in use (0 scalar, 1 AVX2/FMA, 2 AVX-512) and the step's threads.
  int kernels() const { return level_; }
  int threads() const { return threads_; }

  // The rows' state after the prefill or a pruning: KV buffers per layer, rope tables, key mask.
  void set_state(py::list k, py::list v, FArray cos, FArray sin, FArray key_mask) {
    if (static_cast<size_t>(py::len(k)) != layers_.size() || static_cast<size_t>(py::len(v)) != layers_.size()) {
      throw std::invalid_argument("NativeDecoder.set_state: one k and one v buffer per layer");
    }
    rows_ = key_mask.shape(0);
    total_ = key_mask.shape(1);
    steps_ = cos.shape(1);
    k_.clear();
    v_.clear();
    for (size_t i = 0; i < layers_.size(); ++i) {
      // the step writes its k/v into these buffers in place: no converted copies
      k_.push_back(in_place(k[i], "k[" + std::to_string(i) + "]"));
      v_.push_back(in_place(v[i], "v[" + std::to_string(i) + "]"));
      check_shape(k_.back(), {rows_, kv_heads_, total_, dim_}, "k[" + std::to_string(i) + "]");
      check_shape(v_.back(), {rows_, kv_heads_, total_, dim_}, "v[" + std::to_string(i) + "]");
    }
    check_shape(cos, {rows_, steps_, dim_}, "cos");
    check_shape(sin, {rows_, steps_, dim_}, "sin");
    cos_ = cos;
    sin_ = sin;
    key_mask_ = key_mask;
    const i64 qkv = (heads_ + 2 * kv_heads_) * dim_;
    h_.assign(rows_ * hidden_, 0.f);
    x_.assign(rows_ * hidden_, 0.f);
    qkv_.assign(rows_ * qkv, 0.f);
    attn_.assign(rows_ * heads_ * dim_, 0.f);
    gate_up_.assign(rows_ * 2 * inter_, 0.f);
    act_.assign(rows_ * inter_, 0.f);
    scores_.assign(threads_ * total_, 0.f);  // one row of scores per thread
    rotated_.assign(threads_ * dim_, 0.f);  // a row of rotation scratch per thread
    xt_.assign(rows_ * std::max({hidden_, heads_ * dim_, inter_}), 0.f);
  }

  // Feed tokens (N,) at response position `step` (KV slot `slot`); logits (N, V) written in place.
  void step(py::array_t<i64, py::array::c_style> tokens, i64 step, i64 slot, py::handle logits_out) {
    auto logits = in_place(logits_out, "logits");
    if (k_.empty() && !layers_.empty()) throw std::logic_error("NativeDecoder.step before set_state");
    if (tokens.ndim() != 1 || tokens.shape(0) != rows_) {
      throw std::invalid_argument("NativeDecoder.step: tokens must be (" + std::to_string(rows_) + ",)");
    }
    if (step < 0 || step >= steps_ || slot < 0 || slot >= total_) {
      throw std::invalid_argument("NativeDecoder.step: step " + std::to_string(step) + " / slot " +
                                  std::to_string(slot) + " outside the buffers");
    }
    if (logits.ndim() != 2 || logits.shape(0) != rows_ || logits.shape(1) != vocab_) {
      throw std::invalid_argument("NativeDecoder.step: logits must be (rows, vocab)");
    }
    const i64* tok = tokens.data();
    for (i64 r = 0; r < rows_; ++r) {
      if (tok[r] < 0 || tok[r] >= vocab_) {
        throw std::out_of_range("NativeDecoder.step: token id " + std::to_string(tok[r]) + " outside the vocabulary");
      }
    }
    float* out = logits.mutable_data();
    {
      py::gil_scoped_release release;
      for (i64 r = 0; r < rows_; ++r) std::copy_n(embed_.data() + tok[r] * hidden_, hidden_, h_.data() + r * hidden_);
      for (size_t i = 0; i < layers_.size(); ++i) layer(layers_[i], i, step, slot);
      for (i64 r = 0; r < rows_; ++r) rms_norm(h_.data() + r * hidden_, final_norm_.data(), x_.data() + r * hidden_);
      std::fill_n(out, rows_ * vocab_, 0.f);
      matmul(x_.data(), head_t_, out);
    }
  }

 private:
  float dot(const float* a, const float* b, i64 n) const {
#ifdef RLFLOW_X86
    if (level_ == 2) return dot_avx512(a, b, n);
    if (level_ == 1) return dot_avx2(a, b, n);
#endif
    return dot_scalar(a, b, n);
  }

  // fn(begin, end, thread) over `count` items: split among the step's threads when `work`
  // (multiply-adds or the like) is worth waking them, else on this thread (thread 0).
  template <class F>
  void parallel(i64 count, i64 work, F&& fn) {
    const int threads = static_cast<int>(std::min<i64>(threads_, count));
    if (threads <= 1 || work < kParallelMacs) return fn(i64{0}, count, 0);
    on_threads(threads, [&](int t, int n) {
      const auto [begin, end] = share(count, t, n);
      fn(begin, end, t);
    });
  }

  // y (rows_, out) = base + x @ w, the step's threads taking runs of w's panels (the AVX2 tiles
  // read x k-major: transposed here once a call).
  void matmul(const float* x, const Panels& w, float* y) {
    if (level_ == 1) {
#ifdef RLFLOW_X86
      rlflow_cpu::transpose_avx2(x, w.in, rows_, w.in, xt_.data(), rows_);
#endif
    }
    parallel(w.count, rows_ * w.in * w.out, [&](i64 p0, i64 p1, int) {
#ifdef RLFLOW_X86
      if (level_ == 2) return panels_avx512(x, rows_, w, p0, p1, y);
      if (level_ == 1) return panels_avx2(x, xt_.data(), rows_, w, p0, p1, y);
#endif
      panels_scalar(x, rows_, w, p0, p1, y);
    });
  }

  // y = base + x @ w over all rows: base is bias (or 0) broadcast, or y's own content (residual).
  void project(const float* x, const Panels& w, const float* bias, float* y, bool residual) {
    const i64 out = w.out;
    if (!residual) {
      for (i64 r = 0; r < rows_; ++r) {
        if (bias) std::copy_n(bias, out, y + r * out);
        else std::fill_n(y + r * out, out, 0.f);
      }
    } else if (bias) {
      for (i64 r = 0; r < rows_; ++r)
        for (i64 j = 0; j < out; ++j) y[r * out + j] += bias[j];
    }
    matmul(x, w, y);
  }

  // HF's RMSNorm in float32: x * rsqrt(mean(x^2) + eps) * weight (weight may be null); the sum of
  // squares in dot()'s vector accumulators (one chain of scalar adds would be a step's longest serial part).
  void rms_norm_n(const float* x, const float* weight, float* y, i64 n) const {
    const float sum = dot(x, x, n);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps_);
    for (i64 i = 0; i < n; ++i) y[i] = weight ? weight[i] * (x[i] * inv) : x[i] * inv;
  }
  void rms_norm(const float* x, const float* weight, float* y) const { rms_norm_n(x, weight, y, hidden_); }

  // Attention of q head `hq` of row `r` over its valid keys [start, slot]; `scores` holds total_ floats.
  void attend(i64 r, i64 hq, i64 start, i64 slot, const float* kbuf, const float* vbuf, float* scores) {
    const i64 qkv = (heads_ + 2 * kv_heads_) * dim_, g = hq / (heads_ / kv_heads_);
    const float* q = qkv_.data() + r * qkv + hq * dim_;
    const float* keys = kbuf + (r * kv_heads_ + g) * total_ * dim_;
    const float* vals = vbuf + (r * kv_heads_ + g) * total_ * dim_;
    const float* mask = key_mask_.data() + r * total_;
    float top = -std::numeric_limits<float>::infinity();
    for (i64 t = start; t <= slot; ++t) {
      prefetch_lines(keys + (t + kKeysAhead) * dim_, dim_);
      scores[t] = mask[t] + scale_ * dot(q, keys + t * dim_, dim_);
      top = std::max(top, scores[t]);
    }
    float* o = attn_.data() + (r * heads_ + hq) * dim_;
#ifdef RLFLOW_X86
    if (level_ == 2) {
      softmax_avx512(scores, start, slot, top);
    } else
#endif
    {
      float total = 0.f;
      for (i64 t = start; t <= slot; ++t) {
        scores[t] = std::exp(scores[t] - top);
        total += scores[t];
      }
      for (i64 t = start; t <= slot; ++t) scores[t] /= total;
    }
#ifdef RLFLOW_X86
    if (level_ == 2 && dim_ % 16 == 0) return weighted_sum_avx512(scores, vals, start, slot, dim_, o);
    if (level_ >= 1 && dim_ % 8 == 0) return weighted_sum_avx2(scores, vals, start, slot, dim_, o);
#endif
    std::fill_n(o, dim_, 0.f);
    for (i64 t = start; t <= slot; ++t) {
      const float p = scores[t];
      for (i64 i = 0; i < dim_; ++i) o[i] += p * vals[t * dim_ + i];
    }
  }

  void layer(const Layer& l, size_t index, i64 step, i64 slot) {
    const i64 qkv = (heads_ + 2 * kv_heads_) * dim_, half = dim_ / 2;
    for (i64 r = 0; r < rows_; ++r) rms_norm(h_.data() + r * hidden_, l.input_norm.data(), x_.data() + r * hidden_);
    project(x_.data(), l.qkv_w, l.has_qkv_b ? l.qkv_b.data() : nullptr, qkv_.data(), false);
    float* kbuf = k_[index].mutable_data();
    float* vbuf = v_[index].mutable_data();
    const i64 start = l.window > 0 ? std::max<i64>(0, slot + 1 - l.window) : 0;
    // The rows apart: each thread with its own rotation scratch. Writing k and v into the slot
    // touches cache lines of a KV buffer far apart (rarely in cache): the threads wait on them together.
    const i64 rope_heads = heads_ + kv_heads_;
    parallel(rows_, 8 * rows_ * rope_heads * dim_, [&](i64 begin, i64 end, int t) {
      float* scratch = rotated_.data() + t * dim_;
      for (i64 r = begin; r < end; ++r) {
        float* row = qkv_.data() + r * qkv;
        const float* c = cos_.data() + (r * steps_ + step) * dim_;
        const float* s = sin_.data() + (r * steps_ + step) * dim_;
        for (i64 hd = 0; hd < rope_heads; ++hd) {  // q/k norm, then RoPE
          float* vec = row + hd * dim_;
          if (l.has_qk_norm) rms_norm_n(vec, l.qk_norm.data() + hd * dim_, vec, dim_);
          for (i64 i = 0; i < half; ++i) scratch[i] = vec[i] * c[i] + vec[i + half] * s[i];
          for (i64 i = half; i < dim_; ++i) scratch[i] = vec[i] * c[i] + vec[i - half] * s[i];
          std::copy_n(scratch, dim_, vec);
        }
        for (i64 g = 0; g < kv_heads_; ++g) {  // this step's k and v into slot
          const i64 at = ((r * kv_heads_ + g) * total_ + slot) * dim_;
          std::copy_n(row + (heads_ + g) * dim_, dim_, kbuf + at);
          std::copy_n(row + (heads_ + kv_heads_ + g) * dim_, dim_, vbuf + at);
        }
      }
    });
    // every (row, q head) apart: the threads take runs of them, each with its own row of scores
    const i64 pairs = rows_ * heads_;
    const i64 keys = slot + 1 - start;
    parallel(pairs, 2 * pairs * keys * dim_, [&](i64 begin, i64 end, int t) {
      float* scores = scores_.data() + t * total_;
      for (i64 i = begin; i < end; ++i) attend(i / heads_, i % heads_, start, slot, kbuf, vbuf, scores);
    });
    project(attn_.data(), l.o_w, l.has_o_b ? l.o_b.data() : nullptr, h_.data(), true);
    for (i64 r = 0; r < rows_; ++r) rms_norm(h_.data() + r * hidden_, l.post_norm.data(), x_.data() + r * hidden_);
    project(x_.data(), l.gate_up_w, l.has_gate_up_b ? l.gate_up_b.data() : nullptr, gate_up_.data(), false);
    parallel(rows_, 16 * rows_ * inter_, [&](i64 begin, i64 end, int) {  // an exp: ~16 multiply-adds (scalar)
      for (i64 r = begin; r < end; ++r) {
        const float* gu = gate_up_.data() + r * 2 * inter_;  // SiLU(gate) * up
#ifdef RLFLOW_X86
        if (level_ >= 1) {
          rlflow_cpu::swiglu_avx2(gu, gu + inter_, 0, inter_, act_.data() + r * inter_);
          continue;
        }
#endif
        rlflow_cpu::swiglu_scalar(gu, gu + inter_, 0, inter_, act_.data() + r * inter_);
      }
    });
    project(act_.data(), l.down_w, l.has_down_b ? l.down_b.data() : nullptr, h_.data(), true);
  }

  i64 hidden_, heads_, kv_heads_, dim_, inter_, vocab_;
  float eps_, scale_;
  FArray embed_, final_norm_;
  std::unique_ptr<float[], KeptDeleter> panels_;  // every matrix's panels (fill_panels)
  Panels head_t_;
  std::vector<Layer> layers_;
  std::vector<py::array_t<float, py::array::c_style>> k_, v_;
  FArray cos_, sin_, key_mask_;
  i64 rows_ = 0, total_ = 0, steps_ = 0;
  std::vector<float> h_, x_, qkv_, attn_, gate_up_, act_, scores_, rotated_, xt_;  // scratch, sized by set_state
  int level_;
  int threads_;
};

// ---------------------------------------------------------------- one sampling step

// The sampler's per-step bookkeeping in one call (twin: the loop of hf_sampler._decode with
// choose_tokens and token_logprobs, no top-k/top-p): each row's token is the argmax of its logits
// (greedy) or of softmax(logits / T) / noise with noise ~ Exp(1) drawn by torch (torch.multinomial's
// own algorithm); rows still alive get the token, mask 1 and log_softmax(logits / T)[token] at
// (rows[i], step), finished rows pad / 0 / 0; a stop token finishes its row. Returns the rows alive.
i64 sample_step(py::array_t<float, py::array::c_style> logits, py::object noise, double temperature, bool greedy,
                py::array_t<i64, py::array::c_style> stop_ids, py::handle alive_out, py::array_t<i64, py::array::c_style> rows,
                i64 step, i64 pad, py::handle responses_out, py::handle mask_out, py::handle logp_out,
                py::handle tokens_out) {
  if (logits.ndim() != 2) throw std::invalid_argument("sample_step: logits must be (N, V)");
  const i64 n = logits.shape(0), vocab = logits.shape(1);
  auto alive = py::reinterpret_borrow<py::array>(alive_out);
  if (!py::isinstance<py::array_t<bool, py::array::c_style>>(alive) || alive.ndim() != 1 || alive.shape(0) != n ||
      !alive.writeable()) {
    throw std::invalid_argument("sample_step: alive must be a writable (N,) bool array");
  }
  auto tokens = py::reinterpret_borrow<py::array>(tokens_out);
  if (!py::isinstance<py::array_t<i64, py::array::c_style>>(tokens) || tokens.ndim() != 1 || tokens.shape(0) != n) {
    throw std::invalid_argument("sample_step: tokens must be a writable (N,) int64 array");
  }
  auto check_out = [&](py::handle h, bool is_float, const char* name) {
    auto a = py::reinterpret_borrow<py::array>(h);
    const bool dtype_ok = is_float ? py::isinstance<py::array_t<float, py::array::c_style>>(a)
                                   : py::isinstance<py::array_t<i64, py::array::c_style>>(a);
    if (!dtype_ok || a.ndim() != 2 || !a.writeable() || step < 0 || step >= a.shape(1)) {
      throw std::invalid_argument(std::string("sample_step: ") + name + " must be a writable (B, R) array, step < R");
    }
    return a;
  };
  auto responses = check_out(responses_out, false, "responses");
  auto mask = check_out(mask_out, false, "response_mask");
  auto logp = check_out(logp_out, true, "old_logp");
  const i64 width = responses.shape(1), num_out = responses.shape(0);
  if (rows.ndim() != 1 || rows.shape(0) != n) throw std::invalid_argument("sample_step: rows must be (N,)");
  const float* q = nullptr;
  py::array_t<float, py::array::c_style> noise_arr;
  if (!greedy) {
    noise_arr = noise.cast<py::array_t<float, py::array::c_style>>();
    if (noise_arr.ndim() != 2 || noise_arr.shape(0) != n || noise_arr.shape(1) != vocab) {
      throw std::invalid_argument("sample_step: noise must be (N, V) like the logits");
    }
    q = noise_arr.data();
  }
  const float* x = logits.data();
  const i64* row_of = rows.data();
  const i64* stops = stop_ids.data();
  const i64 num_stops = stop_ids.size();
  bool* live = static_cast<bool*>(alive.mutable_data());
  i64* tok = static_cast<i64*>(tokens.mutable_data());
  i64* resp = static_cast<i64*>(responses.mutable_data());
  i64* msk = static_cast<i64*>(mask.mutable_data());
  float* lp = static_cast<float*>(logp.mutable_data());
  const bool scale = !greedy && temperature != 1.0;
  thread_local std::vector<float> scaled, exps;  // reused across steps: no allocation per token
  scaled.resize(vocab);
  exps.resize(vocab);
  i64 num_alive = 0;
  for (i64 r = 0; r < n; ++r) {
    const float* xr = x + r * vocab;
    // torch divides by the temperature (x / T); multiplying by 1 / T could round differently
    for (i64 v = 0; v < vocab; ++v) scaled[v] = scale ? xr[v] / static_cast<float>(temperature) : xr[v];
    float top = -std::numeric_limits<float>::infinity();
    i64 best = 0;
    for (i64 v = 0; v < vocab; ++v) {
      if (scaled[v] > top) {
        top = scaled[v];
        best = v;
      }
    }
    float total = 0.f;
    for (i64 v = 0; v < vocab; ++v) {
      exps[v] = std::exp(scaled[v] - top);  // once: the sum and the sampling ratio share them
      total += exps[v];
    }
    if (!greedy) {  // argmax of probs / noise, probs = softmax(scaled) as ATen forms it (times 1 / sum)
      const float* qr = q + r * vocab;
      const float inv_total = 1.0f / total;
      float top_ratio = -std::numeric_limits<float>::infinity();
      for (i64 v = 0; v < vocab; ++v) {
        const float ratio = (exps[v] * inv_total) / qr[v];
        if (ratio > top_ratio) {
          top_ratio = ratio;
          best = v;
        }
      }
    }
    tok[r] = best;
    const i64 out = row_of[r];
    if (out < 0 || out >= num_out) throw std::out_of_range("sample_step: rows holds an index outside the outputs");
    const i64 at = out * width + step;
    if (live[r]) {
      resp[at] = best;
      msk[at] = 1;
      lp[at] = scaled[best] - top - std::log(total);
      for (i64 s = 0; s < num_stops; ++s) {
        if (stops[s] == best) live[r] = false;
      }
    } else {
      resp[at] = pad;
      msk[at] = 0;
      lp[at] = 0.f;
    }
    num_alive += live[r] ? 1 : 0;
  }
  return num_alive;
}

}  // namespace

PYBIND11_MODULE(_C_decode, m) {
  m.doc() = "One float32 decode step of a Llama-style decoder on CPU (twin: rlflow.engine.rollout.fast_decode)";
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<i64, i64, i64, i64, i64, i64, double, double, FArray, FArray, py::handle, py::list, int, int>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"),
           py::arg("vocab"), py::arg("eps"), py::arg("scale"), py::arg("embed"), py::arg("final_norm"),
           py::arg("head_t"), py::arg("layers"), py::arg("threads") = 1, py::arg("kernels") = 2)
      .def_property_readonly("kernels", &Decoder::kernels)
      .def_property_readonly("threads", &Decoder::threads)
      .def("set_state", &Decoder::set_state, py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
           py::arg("key_mask"))
      .def("step", &Decoder::step, py::arg("tokens"), py::arg("step"), py::arg("slot"), py::arg("logits"));
  m.def("sample_step", &sample_step, py::arg("logits"), py::arg("noise"), py::arg("temperature"), py::arg("greedy"),
        py::arg("stop_ids"), py::arg("alive"), py::arg("rows"), py::arg("step"), py::arg("pad"), py::arg("responses"),
        py::arg("response_mask"), py::arg("old_logp"), py::arg("tokens"),
        "One sampling step's tokens, outputs and stop checks; returns the rows still alive.");
}
