// C = op(A) op(B) + beta * C in float32, row-major, through a BLAS's cblas_sgemm run once on each
// thread of torch's OpenMP team over that thread's share of C, the BLAS itself single-threaded.
//
// Python twin: torch.mm (rlflow.engine.cpu_gemm compares them). The BLAS comes as the address of
// its cblas_sgemm (rlflow.engine.cpu_gemm loads OpenBLAS from the scipy-openblas32 wheel and sets
// its own thread count to one). Run on its own threads, a BLAS contends with the team torch's last
// op left spinning for the same cores; here the team itself runs it (on_threads in cpu.h), each
// thread over a block of C's rows, whole multiples of kAlign, so that every share but the last
// keeps the BLAS's widest kernels. Neither K nor C's columns are split: each element of C is one
// thread's dot product in the order one call over all of C takes it (a split of the columns would
// not be: OpenBLAS's edge kernels sum in another order), so the bits do not depend on the thread
// count.

#include <pybind11/pybind11.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "cpu.h"

namespace py = pybind11;
using rlflow_cpu::i64;

namespace {

// CBLAS's enums (cblas.h): every implementation uses these values.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// Shares of C are multiples of this many rows (a multiple of every x86 sgemm kernel's
// tile edge in OpenBLAS).
constexpr i64 kAlign = 48;

using cblas_sgemm_fn = void (*)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                                int lda, const float* b, int ldb, float beta, float* c, int ldc);

void check_int(i64 v, const char* name) {
  if (v < 0 || v > INT_MAX) throw std::invalid_argument(std::string("gemm: ") + name + " out of the BLAS's int range");
}

// C (m, n) = op(A) (m, k) . op(B) (k, n) + beta * C. op(A) = A (m rows of lda) or, trans_a, A^T of
// A (k rows of lda); likewise op(B). Pointers are addresses (torch's data_ptr()), checked by the
// Python side.
void sgemm(std::uintptr_t fn_at, bool trans_a, bool trans_b, i64 m, i64 n, i64 k, std::uintptr_t a_at, i64 lda,
           std::uintptr_t b_at, i64 ldb, float beta, std::uintptr_t c_at, i64 ldc, int threads) {
  for (auto [v, name] : {std::pair{m, "m"}, {n, "n"}, {k, "k"}, {lda, "lda"}, {ldb, "ldb"}, {ldc, "ldc"}})
    check_int(v, name);
  if (fn_at == 0) throw std::invalid_argument("gemm: no cblas_sgemm");
  auto fn = reinterpret_cast<cblas_sgemm_fn>(fn_at);
  const float* a = reinterpret_cast<const float*>(a_at);
  const float* b = reinterpret_cast<const float*>(b_at);
  float* c = reinterpret_cast<float*>(c_at);
  const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
  const i64 units = (m + kAlign - 1) / kAlign;
  py::gil_scoped_release release;
  rlflow_cpu::on_threads(static_cast<int>(std::min<i64>(threads, std::max<i64>(units, 1))), [&](int t, int team) {
    auto [u0, u1] = rlflow_cpu::share(units, t, team);
    const i64 lo = std::min(u0 * kAlign, m), hi = std::min(u1 * kAlign, m);
    if (hi <= lo && m > 0) return;
    // rows lo..hi of C: of A's rows, or of A^T's (A's columns)
    fn(kRowMajor, ta, tb, static_cast<int>(hi - lo), static_cast<int>(n), static_cast<int>(k), 1.f,
       trans_a ? a + lo : a + lo * lda, static_cast<int>(lda), b, static_cast<int>(ldb), beta, c + lo * ldc,
       static_cast<int>(ldc));
  });
}

}  // namespace

PYBIND11_MODULE(_C_gemm, m) {
  m.doc() = "float32 GEMM through a single-threaded BLAS on each thread of torch's OpenMP team";
  m.def("sgemm", &sgemm, py::arg("fn"), py::arg("trans_a"), py::arg("trans_b"), py::arg("m"), py::arg("n"),
        py::arg("k"), py::arg("a"), py::arg("lda"), py::arg("b"), py::arg("ldb"), py::arg("beta"), py::arg("c"),
        py::arg("ldc"), py::arg("threads"),
        "C (m, n) = op(A) op(B) + beta * C, row-major, C's rows shared over `threads` threads");
}
