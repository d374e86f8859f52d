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
// Layouts (all float32, C-contiguous; the Python side packs them once per weight version):
//   matrices (in, out): y = x @ W, the LM head too (H, V); the embedding (V, H).
//   KV buffers (N, Hkv, T, D) per layer, shared with the twin (it filled the prompt slots).
//   rope tables (N, R, D): cos, and sin with its first half negated (FastDecoder's form:
//   rope(q) = q * cos + roll(q, D/2) * sin).
//   key mask (N, T) additive: 0 where a row may attend, -inf where not.
// The arithmetic follows HF's order (RMSNorm in float32 then times the weight; softmax with the
// row maximum subtracted), but sums run in another order than MKL's, so results agree with the
// twin to float rounding, not bit for bit.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RLFLOW_X86 1
#endif

namespace py = pybind11;
using i64 = int64_t;
using FArray = py::array_t<float, py::array::c_style | py::array::forcecast>;

namespace {

// ---------------------------------------------------------------- matmul: y[n, :] = base + x[n, :] @ w

// Scalar kernel (any CPU): rows one at a time, the inner loop over contiguous output columns.
void matmul_scalar(const float* x, i64 n, i64 in, const float* w, i64 out, float* y) {
  for (i64 r = 0; r < n; ++r) {
    float* yr = y + r * out;
    const float* xr = x + r * in;
    for (i64 k = 0; k < in; ++k) {
      const float a = xr[k];
      const float* wk = w + k * out;
      for (i64 j = 0; j < out; ++j) yr[j] += a * wk[j];
    }
  }
}

#ifdef RLFLOW_X86
// AVX2/FMA kernel: for each strip of 16 output columns (its in x 16 weights stay in cache while
// every row passes), tiles of 4 rows x 16 columns held in 8 registers across the whole k loop, so
// each weight vector loaded feeds 4 FMAs; leftover rows take 1-row tiles, leftover columns the
// scalar loop. y holds the base (bias, residual or 0) on entry.
__attribute__((target("avx2,fma"))) void matmul_avx2(const float* x, i64 n, i64 in, const float* w, i64 out,
                                                      float* y) {
  const i64 cols16 = out - out % 16;
  for (i64 j = 0; j < cols16; j += 16) {
    i64 r = 0;
    for (; r + 4 <= n; r += 4) {
      const float* x0 = x + r * in;
      __m256 acc[4][2];
      for (int i = 0; i < 4; ++i) {
        acc[i][0] = _mm256_loadu_ps(y + (r + i) * out + j);
        acc[i][1] = _mm256_loadu_ps(y + (r + i) * out + j + 8);
      }
      for (i64 k = 0; k < in; ++k) {
        const __m256 w0 = _mm256_loadu_ps(w + k * out + j);
        const __m256 w1 = _mm256_loadu_ps(w + k * out + j + 8);
        for (int i = 0; i < 4; ++i) {
          const __m256 a = _mm256_broadcast_ss(x0 + i * in + k);
          acc[i][0] = _mm256_fmadd_ps(a, w0, acc[i][0]);
          acc[i][1] = _mm256_fmadd_ps(a, w1, acc[i][1]);
        }
      }
      for (int i = 0; i < 4; ++i) {
        _mm256_storeu_ps(y + (r + i) * out + j, acc[i][0]);
        _mm256_storeu_ps(y + (r + i) * out + j + 8, acc[i][1]);
      }
    }
    for (; r < n; ++r) {
      const float* xr = x + r * in;
      __m256 a0 = _mm256_loadu_ps(y + r * out + j), a1 = _mm256_loadu_ps(y + r * out + j + 8);
      for (i64 k = 0; k < in; ++k) {
        const __m256 a = _mm256_broadcast_ss(xr + k);
        a0 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + k * out + j), a0);
        a1 = _mm256_fmadd_ps(a, _mm256_loadu_ps(w + k * out + j + 8), a1);
      }
      _mm256_storeu_ps(y + r * out + j, a0);
      _mm256_storeu_ps(y + r * out + j + 8, a1);
    }
  }
  if (cols16 < out) {  // the last out % 16 columns
    for (i64 r = 0; r < n; ++r) {
      for (i64 k = 0; k < in; ++k) {
        const float a = x[r * in + k];
        for (i64 j = cols16; j < out; ++j) y[r * out + j] += a * w[k * out + j];
      }
    }
  }
}

// <a, b> over n floats with 8-wide FMAs in two accumulators (a scalar sum is one long dependency chain).
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, i64 n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  i64 i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  const __m256 s = _mm256_add_ps(s0, s1);
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  float total = _mm_cvtss_f32(lo);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

bool has_avx2_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
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
  FArray input_norm, qkv_w, qkv_b, qk_norm, o_w, o_b, post_norm, gate_up_w, gate_up_b, down_w, down_b;
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

class Decoder {
 public:
  Decoder(i64 hidden, i64 heads, i64 kv_heads, i64 head_dim, i64 inter, i64 vocab, double eps, double scale,
          FArray embed, FArray final_norm, FArray head_t, py::list layers)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), dim_(head_dim), inter_(inter), vocab_(vocab),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)), embed_(embed), final_norm_(final_norm),
        head_t_(head_t) {
    if (heads % kv_heads != 0) throw std::invalid_argument("NativeDecoder: heads must be a multiple of kv_heads");
    check_shape(embed_, {vocab, hidden}, "embed");
    check_shape(final_norm_, {hidden}, "final_norm");
    check_shape(head_t_, {hidden, vocab}, "head_t");
    const i64 qkv = (heads + 2 * kv_heads) * head_dim;
    for (py::handle item : layers) {
      py::dict d = py::reinterpret_borrow<py::dict>(item);
      Layer l;
      l.input_norm = d["input_norm"].cast<FArray>();
      l.qkv_w = d["qkv_w"].cast<FArray>();
      l.o_w = d["o_w"].cast<FArray>();
      l.post_norm = d["post_norm"].cast<FArray>();
      l.gate_up_w = d["gate_up_w"].cast<FArray>();
      l.down_w = d["down_w"].cast<FArray>();
      check_shape(l.input_norm, {hidden}, "input_norm");
      check_shape(l.qkv_w, {hidden, qkv}, "qkv_w");
      check_shape(l.o_w, {heads * head_dim, hidden}, "o_w");
      check_shape(l.post_norm, {hidden}, "post_norm");
      check_shape(l.gate_up_w, {hidden, 2 * inter}, "gate_up_w");
      check_shape(l.down_w, {inter, hidden}, "down_w");
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
#ifdef RLFLOW_X86
    avx2_ = has_avx2_fma();
#endif
  }

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
    scores_.assign(total_, 0.f);
    rotated_.assign(dim_, 0.f);
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
      head_logits(out);
    }
  }

 private:
  float dot(const float* a, const float* b, i64 n) const {
#ifdef RLFLOW_X86
    if (avx2_) return dot_avx2(a, b, n);
#endif
    return dot_scalar(a, b, n);
  }

  void matmul(const float* x, i64 n, i64 in, const float* w, i64 out, float* y) const {
#ifdef RLFLOW_X86
    if (avx2_) return matmul_avx2(x, n, in, w, out, y);
#endif
    matmul_scalar(x, n, in, w, out, y);
  }

  // y = base + x @ w over all rows: base is bias (or 0) broadcast, or y's own content (residual).
  void project(const float* x, i64 in, const float* w, i64 out, const float* bias, float* y, bool residual) const {
    if (!residual) {
      for (i64 r = 0; r < rows_; ++r) {
        if (bias) std::copy_n(bias, out, y + r * out);
        else std::fill_n(y + r * out, out, 0.f);
      }
    } else if (bias) {
      for (i64 r = 0; r < rows_; ++r)
        for (i64 j = 0; j < out; ++j) y[r * out + j] += bias[j];
    }
    matmul(x, rows_, in, w, out, y);
  }

  // HF's RMSNorm in float32: x * rsqrt(mean(x^2) + eps) * weight (weight may be null).
  void rms_norm_n(const float* x, const float* weight, float* y, i64 n) const {
    float sum = 0.f;
    for (i64 i = 0; i < n; ++i) sum += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps_);
    for (i64 i = 0; i < n; ++i) y[i] = weight ? weight[i] * (x[i] * inv) : x[i] * inv;
  }
  void rms_norm(const float* x, const float* weight, float* y) const { rms_norm_n(x, weight, y, hidden_); }

  void layer(const Layer& l, size_t index, i64 step, i64 slot) {
    const i64 qkv = (heads_ + 2 * kv_heads_) * dim_, half = dim_ / 2, group = heads_ / kv_heads_;
    for (i64 r = 0; r < rows_; ++r) rms_norm(h_.data() + r * hidden_, l.input_norm.data(), x_.data() + r * hidden_);
    project(x_.data(), hidden_, l.qkv_w.data(), qkv, l.has_qkv_b ? l.qkv_b.data() : nullptr, qkv_.data(), false);
    float* kbuf = k_[index].mutable_data();
    float* vbuf = v_[index].mutable_data();
    const i64 start = l.window > 0 ? std::max<i64>(0, slot + 1 - l.window) : 0;
    for (i64 r = 0; r < rows_; ++r) {
      float* row = qkv_.data() + r * qkv;
      const float* c = cos_.data() + (r * steps_ + step) * dim_;
      const float* s = sin_.data() + (r * steps_ + step) * dim_;
      for (i64 hd = 0; hd < heads_ + kv_heads_; ++hd) {  // q/k norm, then RoPE
        float* vec = row + hd * dim_;
        if (l.has_qk_norm) rms_norm_n(vec, l.qk_norm.data() + hd * dim_, vec, dim_);
        for (i64 i = 0; i < dim_; ++i) rotated_[i] = vec[i] * c[i] + vec[(i + half) % dim_] * s[i];
        std::copy_n(rotated_.data(), dim_, vec);
      }
      for (i64 g = 0; g < kv_heads_; ++g) {  // this step's k and v into slot
        const i64 at = ((r * kv_heads_ + g) * total_ + slot) * dim_;
        std::copy_n(row + (heads_ + g) * dim_, dim_, kbuf + at);
        std::copy_n(row + (heads_ + kv_heads_ + g) * dim_, dim_, vbuf + at);
      }
      const float* mask = key_mask_.data() + r * total_;
      for (i64 hq = 0; hq < heads_; ++hq) {
        const i64 g = hq / group;
        const float* q = row + hq * dim_;
        const float* keys = kbuf + (r * kv_heads_ + g) * total_ * dim_;
        const float* vals = vbuf + (r * kv_heads_ + g) * total_ * dim_;
        float top = -std::numeric_limits<float>::infinity();
        for (i64 t = start; t <= slot; ++t) {
          scores_[t] = mask[t] + scale_ * dot(q, keys + t * dim_, dim_);
          top = std::max(top, scores_[t]);
        }
        float total = 0.f;
        for (i64 t = start; t <= slot; ++t) {
          scores_[t] = std::exp(scores_[t] - top);
          total += scores_[t];
        }
        float* o = attn_.data() + (r * heads_ + hq) * dim_;
        std::fill_n(o, dim_, 0.f);
        for (i64 t = start; t <= slot; ++t) {
          const float p = scores_[t] / total;
          for (i64 i = 0; i < dim_; ++i) o[i] += p * vals[t * dim_ + i];
        }
      }
    }
    project(attn_.data(), heads_ * dim_, l.o_w.data(), hidden_, l.has_o_b ? l.o_b.data() : nullptr, h_.data(), true);
    for (i64 r = 0; r < rows_; ++r) rms_norm(h_.data() + r * hidden_, l.post_norm.data(), x_.data() + r * hidden_);
    project(x_.data(), hidden_, l.gate_up_w.data(), 2 * inter_, l.has_gate_up_b ? l.gate_up_b.data() : nullptr,
            gate_up_.data(), false);
    for (i64 r = 0; r < rows_; ++r) {
      const float* gu = gate_up_.data() + r * 2 * inter_;
      float* a = act_.data() + r * inter_;
      for (i64 i = 0; i < inter_; ++i) {
        const float g = gu[i];
        a[i] = (g / (1.0f + std::exp(-g))) * gu[inter_ + i];  // SiLU(gate) * up
      }
    }
    project(act_.data(), inter_, l.down_w.data(), hidden_, l.has_down_b ? l.down_b.data() : nullptr, h_.data(), true);
  }

  // logits (N, V) = normed h @ head_t, the LM head packed (H, V).
  void head_logits(float* out) const {
    std::fill_n(out, rows_ * vocab_, 0.f);
    matmul(x_.data(), rows_, hidden_, head_t_.data(), vocab_, out);
  }

  i64 hidden_, heads_, kv_heads_, dim_, inter_, vocab_;
  float eps_, scale_;
  FArray embed_, final_norm_, head_t_;
  std::vector<Layer> layers_;
  std::vector<py::array_t<float, py::array::c_style>> k_, v_;
  FArray cos_, sin_, key_mask_;
  i64 rows_ = 0, total_ = 0, steps_ = 0;
  std::vector<float> h_, x_, qkv_, attn_, gate_up_, act_, scores_, rotated_;  // scratch, sized by set_state
  bool avx2_ = false;
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
      .def(py::init<i64, i64, i64, i64, i64, i64, double, double, FArray, FArray, FArray, py::list>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"),
           py::arg("vocab"), py::arg("eps"), py::arg("scale"), py::arg("embed"), py::arg("final_norm"),
           py::arg("head_t"), py::arg("layers"))
      .def("set_state", &Decoder::set_state, py::arg("k"), py::arg("v"), py::arg("cos"), py::arg("sin"),
           py::arg("key_mask"))
      .def("step", &Decoder::step, py::arg("tokens"), py::arg("step"), py::arg("slot"), py::arg("logits"));
  m.def("sample_step", &sample_step, py::arg("logits"), py::arg("noise"), py::arg("temperature"), py::arg("greedy"),
        py::arg("stop_ids"), py::arg("alive"), py::arg("rows"), py::arg("step"), py::arg("pad"), py::arg("responses"),
        py::arg("response_mask"), py::arg("old_logp"), py::arg("tokens"),
        "One sampling step's tokens, outputs and stop checks; returns the rows still alive.");
}
