// The training step's memory-bound ops on CPU in float32, forward and backward, each one pass:
// RMSNorm, SwiGLU (SiLU(gate) * up) and RoPE.
//
// Python twins: HF's LlamaRMSNorm.forward (weight * (x * rsqrt(mean(x^2) + eps))), LlamaMLP's
// act_fn(gate) * up and apply_rotary_pos_emb (x * cos + rotate_half(x) * sin) under autograd;
// rlflow.engine.fused_ops wraps each pair of calls in an autograd Function and the tests compare
// both passes with the twin's. Autograd runs each as several ops forward and more backward, each
// a pass over the activations; here each pass reads its inputs and writes its outputs once, so a
// memory-bound op moves a fraction of the bytes.
//
// Rows are independent and split over torch's thread count (OpenMP: the same runtime as torch's,
// see on_threads in cpu.h). The weight's gradient sums over rows in fixed blocks of
// kBlockRows, added in block order: the same bits whatever the thread count.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace py = pybind11;
using i64 = int64_t;

namespace {

constexpr i64 kBlockRows = 64;

// The tensors come as addresses (torch's data_ptr()), checked by the Python side: float32,
// C-contiguous, on the CPU, of the sizes named here. Not numpy arrays: turning a tensor into one
// pins its storage's size, and FSDP frees and refills a gathered weight's storage around every
// forward.
const float* at(std::uintptr_t address) { return reinterpret_cast<const float*>(address); }
float* at_mut(std::uintptr_t address) { return reinterpret_cast<float*>(address); }

float sum_of_squares(const float* x, i64 n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (i64 i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

// y = weight * (x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) per row of x (rows, hidden).
void rms_norm(std::uintptr_t x_at, std::uintptr_t w_at, i64 rows, i64 hidden, double eps, std::uintptr_t y_at,
              std::uintptr_t rstd_at, int threads) {
  if (rows < 0 || hidden < 1) throw std::invalid_argument("fused: rows and hidden must be positive");
  const float *x = at(x_at), *w = at(w_at);
  float *y = at_mut(y_at), *rstd = at_mut(rstd_at);
  const float e = static_cast<float>(eps);
  py::gil_scoped_release release;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (i64 r = 0; r < rows; ++r) {
    const float* xr = x + r * hidden;
    float* yr = y + r * hidden;
    const float inv = 1.0f / std::sqrt(sum_of_squares(xr, hidden) / static_cast<float>(hidden) + e);
    rstd[r] = inv;
#pragma omp simd
    for (i64 i = 0; i < hidden; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

// dx = rstd * (g - n * mean(g * n)) with g = dy * weight, n = x * rstd; dweight = sum over rows of dy * n.
void rms_norm_backward(std::uintptr_t dy_at, std::uintptr_t x_at, std::uintptr_t w_at, std::uintptr_t rstd_at,
                       i64 rows, i64 hidden, std::uintptr_t dx_at, std::uintptr_t dw_at, int threads) {
  if (rows < 0 || hidden < 1) throw std::invalid_argument("fused: rows and hidden must be positive");
  const float *dy = at(dy_at), *x = at(x_at), *w = at(w_at), *rstd = at(rstd_at);
  float *dx = at_mut(dx_at), *dw = at_mut(dw_at);
  const i64 blocks = (rows + kBlockRows - 1) / kBlockRows;
  std::vector<float> partial(blocks * hidden, 0.f);  // each block's sum of dy * n
  py::gil_scoped_release release;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (i64 b = 0; b < blocks; ++b) {
    float* pb = partial.data() + b * hidden;
    const i64 end = std::min(rows, (b + 1) * kBlockRows);
    for (i64 r = b * kBlockRows; r < end; ++r) {
      const float* dyr = dy + r * hidden;
      const float* xr = x + r * hidden;
      float* dxr = dx + r * hidden;
      const float inv = rstd[r];
      float dot = 0.f;  // sum of g * n
#pragma omp simd reduction(+ : dot)
      for (i64 i = 0; i < hidden; ++i) dot += (dyr[i] * w[i]) * (xr[i] * inv);
      const float mean = dot / static_cast<float>(hidden);
#pragma omp simd
      for (i64 i = 0; i < hidden; ++i) {
        const float n = xr[i] * inv;
        dxr[i] = inv * (dyr[i] * w[i] - n * mean);
        pb[i] += dyr[i] * n;
      }
    }
  }
  std::fill_n(dw, hidden, 0.f);
  for (i64 b = 0; b < blocks; ++b) {
    const float* pb = partial.data() + b * hidden;
    for (i64 i = 0; i < hidden; ++i) dw[i] += pb[i];
  }
}

void swiglu_backward_scalar(const float* dh, const float* g, const float* u, i64 begin, i64 end, float* dg,
                            float* du) {
  for (i64 i = begin; i < end; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-g[i]));
    du[i] = dh[i] * (g[i] * s);
    dg[i] = dh[i] * u[i] * (s * (1.0f + g[i] * (1.0f - s)));
  }
}

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma"))) void swiglu_backward_avx2(const float* dh, const float* g, const float* u,
                                                               i64 begin, i64 end, float* dg, float* du) {
  const __m256 one = _mm256_set1_ps(1.0f);
  i64 i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i), dhi = _mm256_loadu_ps(dh + i);
    const __m256 s = rlflow_cpu::sigmoid_avx2(gi);
    _mm256_storeu_ps(du + i, _mm256_mul_ps(dhi, _mm256_mul_ps(gi, s)));
    const __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(gi, _mm256_sub_ps(one, s), one));  // s (1 + g (1 - s))
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(dhi, _mm256_loadu_ps(u + i)), slope));
  }
  swiglu_backward_scalar(dh, g, u, i, end, dg, du);
}
#endif

// kernel(begin, end, avx2) over n floats, each thread taking a run of whole cache lines (64
// floats); avx2: the CPU runs the AVX2/FMA kernels.
template <class F>
void over_floats(i64 n, int threads, F&& kernel) {
  const bool avx2 = rlflow_cpu::kernel_level() >= 1;
  py::gil_scoped_release release;
  rlflow_cpu::on_threads(threads, [&](int t, int team) {
    const auto [first, last] = rlflow_cpu::share((n + 63) / 64, t, team);
    kernel(std::min(n, first * 64), std::min(n, last * 64), avx2);
  });
}

// h = SiLU(g) * u over n floats, SiLU(g) = g / (1 + e^-g) (AVX2 where the CPU has it, with the
// exponential above; std::exp elsewhere).
void swiglu(std::uintptr_t g_at, std::uintptr_t u_at, i64 n, std::uintptr_t h_at, int threads) {
  const float *g = at(g_at), *u = at(u_at);
  float* h = at_mut(h_at);
  over_floats(n, threads, [&](i64 begin, i64 end, bool avx2) {
#if defined(__x86_64__) || defined(_M_X64)
    if (avx2) return rlflow_cpu::swiglu_avx2(g, u, begin, end, h);
#endif
    rlflow_cpu::swiglu_scalar(g, u, begin, end, h);
  });
}

// dg = dh * u * s * (1 + g (1 - s)), du = dh * SiLU(g), s = sigmoid(g).
void swiglu_backward(std::uintptr_t dh_at, std::uintptr_t g_at, std::uintptr_t u_at, i64 n, std::uintptr_t dg_at,
                     std::uintptr_t du_at, int threads) {
  const float *dh = at(dh_at), *g = at(g_at), *u = at(u_at);
  float *dg = at_mut(dg_at), *du = at_mut(du_at);
  over_floats(n, threads, [&](i64 begin, i64 end, bool avx2) {
#if defined(__x86_64__) || defined(_M_X64)
    if (avx2) return swiglu_backward_avx2(dh, g, u, begin, end, dg, du);
#endif
    swiglu_backward_scalar(dh, g, u, begin, end, dg, du);
  });
}

// RoPE over x (rows, heads, dim) with cos / sin (table_rows, dim) and row r's table row
// r % table_rows (one table per position broadcast over a batch, or one per row):
//   forward  y = x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x2, x1);
//   backward dx = dy * cos + rotate_half^T(dy * sin),  rotate_half^T(z) = (z2, -z1).
void rope(std::uintptr_t x_at, std::uintptr_t cos_at, std::uintptr_t sin_at, i64 rows, i64 heads, i64 dim,
          i64 table_rows, bool backward, std::uintptr_t y_at, int threads) {
  if (dim % 2 != 0 || table_rows < 1) throw std::invalid_argument("fused: rope needs an even dim and a table");
  const float *x = at(x_at), *cos = at(cos_at), *sin = at(sin_at);
  float* y = at_mut(y_at);
  const i64 half = dim / 2;
  py::gil_scoped_release release;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (i64 r = 0; r < rows; ++r) {
    const float* c = cos + (r % table_rows) * dim;
    const float* s = sin + (r % table_rows) * dim;
    for (i64 h = 0; h < heads; ++h) {
      const float* xr = x + (r * heads + h) * dim;
      float* yr = y + (r * heads + h) * dim;
      if (!backward) {
#pragma omp simd
        for (i64 i = 0; i < half; ++i) yr[i] = xr[i] * c[i] - xr[i + half] * s[i];
#pragma omp simd
        for (i64 i = half; i < dim; ++i) yr[i] = xr[i] * c[i] + xr[i - half] * s[i];
      } else {
#pragma omp simd
        for (i64 i = 0; i < half; ++i) yr[i] = xr[i] * c[i] + xr[i + half] * s[i + half];
#pragma omp simd
        for (i64 i = half; i < dim; ++i) yr[i] = xr[i] * c[i] - xr[i - half] * s[i - half];
      }
    }
  }
}

}  // namespace

PYBIND11_MODULE(_C_fused, m) {
  m.doc() = "The training step's float32 RMSNorm, SwiGLU and RoPE on CPU, forward and backward (twins: HF's)";
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("rows"), py::arg("hidden"), py::arg("eps"),
        py::arg("y"), py::arg("rstd"), py::arg("threads"), "y = weight * x * rstd; rstd (rows,) written too.");
  m.def("rms_norm_backward", &rms_norm_backward, py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("rstd"),
        py::arg("rows"), py::arg("hidden"), py::arg("dx"), py::arg("dweight"), py::arg("threads"),
        "dx and the weight's gradient of rms_norm.");
  m.def("swiglu", &swiglu, py::arg("gate"), py::arg("up"), py::arg("n"), py::arg("out"), py::arg("threads"),
        "out = SiLU(gate) * up over n floats.");
  m.def("swiglu_backward", &swiglu_backward, py::arg("grad"), py::arg("gate"), py::arg("up"), py::arg("n"),
        py::arg("grad_gate"), py::arg("grad_up"), py::arg("threads"), "The gradients of swiglu's gate and up.");
  m.def("rope", &rope, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("rows"), py::arg("heads"),
        py::arg("dim"), py::arg("table_rows"), py::arg("backward"), py::arg("out"), py::arg("threads"),
        "RoPE of x (rows, heads, dim), or with backward=True its transpose applied to a gradient.");
}
