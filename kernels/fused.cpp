// The training step's RMSNorm on CPU in float32, forward and backward, each one pass over its rows.
//
// Python twin: HF's LlamaRMSNorm.forward (weight * (x * rsqrt(mean(x^2) + eps))) under autograd;
// rlflow.engine.fused_ops wraps these two calls in an autograd Function and the tests compare both
// passes with the twin's. Autograd runs that norm as about five ops forward and a dozen backward,
// each a pass over the (rows, hidden) activations; here the forward reads x and writes y, the
// backward reads dy and x and writes dx (and the weight's gradient), so a memory-bound op moves a
// fifth of the bytes.
//
// Rows are independent and split over torch's thread count (OpenMP: the same runtime as torch's,
// see kernels/decode.cpp's on_threads). The weight's gradient sums over rows in fixed blocks of
// kBlockRows, added in block order: the same bits whatever the thread count.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
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

}  // namespace

PYBIND11_MODULE(_C_fused, m) {
  m.doc() = "The training step's float32 RMSNorm on CPU, forward and backward (twin: HF's LlamaRMSNorm)";
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("rows"), py::arg("hidden"), py::arg("eps"),
        py::arg("y"), py::arg("rstd"), py::arg("threads"), "y = weight * x * rstd; rstd (rows,) written too.");
  m.def("rms_norm_backward", &rms_norm_backward, py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("rstd"),
        py::arg("rows"), py::arg("hidden"), py::arg("dx"), py::arg("dweight"), py::arg("threads"),
        "dx and the weight's gradient of rms_norm.");
}
