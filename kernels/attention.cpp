// Causal self-attention of packed sequences on CPU in float32, forward and backward: the training
// engine's packed rows (rlflow.engine.attention), several sequences laid end to end in one row of
// `total` tokens with cu_seqlens marking where each starts.
//
// Python twin: torch's scaled_dot_product_attention(is_causal=True) on each sequence alone;
// rlflow.engine.fused_ops.PackedAttentionFunction wraps the two passes in an autograd Function and
// the tests compare both with the twin's. torch's CPU flash kernel computes each block of 32
// queries against all keys of the block's sequence, masked ones included, in calls to a general
// GEMM; here each (sequence, kv head) is one task on one thread that multiplies only the causal
// triangle, in register tiles of 6 rows x 64 (AVX-512) or 16 (AVX2) columns reading a sequence's
// q, k and v from the packed row itself (no gather into a padded batch, no scatter back). Rows of
// one length without padding are packed sequences too (bounds every L tokens).
//
// Forward, per query row i of a block: s_ij = q_i . k_j for j <= i, p_i = softmax(scale * s_i),
// o_i = sum_j p_ij v_j, lse_i = log sum_j e^(scale s_ij) kept for the backward. Backward (flash
// attention's, scores recomputed from lse): dp_ij = do_i . v_j, ds_ij = p_ij (dp_ij - do_i . o_i),
// dq_i = scale sum_j ds_ij k_j, dk_j = scale sum_i ds_ij q_i, dv_j = sum_i p_ij do_i. The query
// heads of one kv head (GQA) run in the same task, so their dk and dv add up without a race; each
// task's arithmetic is fixed, so the result has the same bits at any thread count.

#include <pybind11/pybind11.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "cpu.h"

namespace py = pybind11;
using i64 = int64_t;
#if defined(__x86_64__) || defined(_M_X64)
using rlflow_cpu::first_lanes;
#endif

namespace {

constexpr int kRows = 6;  // rows of a register tile, both ISAs

// An operand read one float at a time (broadcast): element (m, k) at p[m * rs + k * cs], so a
// transposed operand (p^T, ds^T) costs nothing but its strides.
struct Strided {
  const float* p;
  i64 rs, cs;
};

#if defined(__x86_64__) || defined(_M_X64)
// c = r, or c += r, on the lanes given.
__attribute__((target("avx512f"))) inline void put_avx512(float* c, __mmask16 lanes, __m512 r, bool add) {
  if (add) r = _mm512_add_ps(r, _mm512_maskz_loadu_ps(lanes, c));
  _mm512_mask_storeu_ps(c, lanes, r);
}

__attribute__((target("avx2,fma"))) inline void put_avx2(float* c, __m256i lanes, __m256 r, bool add) {
  if (add) r = _mm256_add_ps(r, _mm256_maskload_ps(c, lanes));
  _mm256_maskstore_ps(c, lanes, r);
}

// The tiles: c[m, 0:n] (+)= sum_k a(m, k) * b[k * ldb + 0:n] for m < MR, n <= NV vectors, the
// last one under a mask of `tail` lanes. The loops over rows are unrolled (#pragma GCC unroll):
// without it GCC kept the accumulators on the stack and stored them every iteration.
template <int MR, int NV>
__attribute__((target("avx512f"))) void tile_avx512(Strided a, const float* b, i64 ldb, i64 K, float* c, i64 ldc,
                                                     int tail, bool add) {
  static_assert(NV >= 1 && NV <= 4);
  const __mmask16 last = first_lanes(tail);
  constexpr __mmask16 full = 0xffff;
  __m512 c0[MR], c1[MR], c2[MR], c3[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = c2[m] = c3[m] = _mm512_setzero_ps();
  for (i64 k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    const __m512 b0 = _mm512_maskz_loadu_ps(NV == 1 ? last : full, bk);
    const __m512 b1 = NV > 1 ? _mm512_maskz_loadu_ps(NV == 2 ? last : full, bk + 16) : b0;
    const __m512 b2 = NV > 2 ? _mm512_maskz_loadu_ps(NV == 3 ? last : full, bk + 32) : b0;
    const __m512 b3 = NV > 3 ? _mm512_maskz_loadu_ps(last, bk + 48) : b0;
    const float* ak = a.p + k * a.cs;
  #pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
      const __m512 x = _mm512_set1_ps(ak[m * a.rs]);
      c0[m] = _mm512_fmadd_ps(x, b0, c0[m]);
      if constexpr (NV > 1) c1[m] = _mm512_fmadd_ps(x, b1, c1[m]);
      if constexpr (NV > 2) c2[m] = _mm512_fmadd_ps(x, b2, c2[m]);
      if constexpr (NV > 3) c3[m] = _mm512_fmadd_ps(x, b3, c3[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    float* cm = c + m * ldc;
    put_avx512(cm, NV == 1 ? last : full, c0[m], add);
    if constexpr (NV > 1) put_avx512(cm + 16, NV == 2 ? last : full, c1[m], add);
    if constexpr (NV > 2) put_avx512(cm + 32, NV == 3 ? last : full, c2[m], add);
    if constexpr (NV > 3) put_avx512(cm + 48, last, c3[m], add);
  }
}

template <int MR, int NV>
__attribute__((target("avx2,fma"))) void tile_avx2(Strided a, const float* b, i64 ldb, i64 K, float* c, i64 ldc,
                                                   int tail, bool add) {
  static_assert(NV >= 1 && NV <= 2);
  const __m256i last = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i full = _mm256_set1_epi32(-1);
  __m256 c0[MR], c1[MR];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) c0[m] = c1[m] = _mm256_setzero_ps();
  for (i64 k = 0; k < K; ++k) {
    const float* bk = b + k * ldb;
    const __m256 b0 = NV == 1 ? _mm256_maskload_ps(bk, last) : _mm256_loadu_ps(bk);
    const __m256 b1 = NV > 1 ? _mm256_maskload_ps(bk + 8, last) : b0;
    const float* ak = a.p + k * a.cs;
  #pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
      const __m256 x = _mm256_broadcast_ss(ak + m * a.rs);
      c0[m] = _mm256_fmadd_ps(x, b0, c0[m]);
      if constexpr (NV > 1) c1[m] = _mm256_fmadd_ps(x, b1, c1[m]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    put_avx2(c + m * ldc, NV == 1 ? last : full, c0[m], add);
    if constexpr (NV > 1) put_avx2(c + m * ldc + 8, last, c1[m], add);
  }
}
#endif

using Tile = void (*)(Strided, const float*, i64, i64, float*, i64, int, bool);

// The instantiations by rows and vectors: kAvx512[rows - 1][vectors - 1], kAvx2 likewise.
#if defined(__x86_64__) || defined(_M_X64)
template <int MR>
constexpr std::array<Tile, 4> avx512_row() {
  return {&tile_avx512<MR, 1>, &tile_avx512<MR, 2>, &tile_avx512<MR, 3>, &tile_avx512<MR, 4>};
}
template <int MR>
constexpr std::array<Tile, 2> avx2_row() {
  return {&tile_avx2<MR, 1>, &tile_avx2<MR, 2>};
}
const std::array<std::array<Tile, 4>, kRows> kAvx512 = {avx512_row<1>(), avx512_row<2>(), avx512_row<3>(),
                                                         avx512_row<4>(), avx512_row<5>(), avx512_row<6>()};
const std::array<std::array<Tile, 2>, kRows> kAvx2 = {avx2_row<1>(), avx2_row<2>(), avx2_row<3>(),
                                                       avx2_row<4>(), avx2_row<5>(), avx2_row<6>()};
#endif

// Where a kernel below is reached with no vector kernels to run (no x86; the entry points refuse
// levels below 1 first).
[[noreturn, maybe_unused]] void no_vector_kernels() { throw std::runtime_error("attention: no vector kernels on this CPU"); }

// c[0:rows, 0:n] (+)= a[0:rows, 0:K] * b[0:K, 0:n], rows <= kRows, in tiles across n.
void gemm(int level, int rows, i64 n, i64 K, Strided a, const float* b, i64 ldb, float* c, i64 ldc, bool add) {
#if defined(__x86_64__) || defined(_M_X64)
  const int width = level == 2 ? 16 : 8, most = level == 2 ? 4 : 2;
  for (i64 j = 0; j < n; j += width * most) {
    const i64 cols = std::min<i64>(width * most, n - j);
    const int vectors = static_cast<int>((cols + width - 1) / width);
    const int tail = static_cast<int>(cols - width * (vectors - 1));
    const Tile tile = level == 2 ? kAvx512[rows - 1][vectors - 1] : kAvx2[rows - 1][vectors - 1];
    tile(a, b + j, ldb, K, c + j, ldc, tail, add);
  }
#else
  (void)level, (void)rows, (void)n, (void)K, (void)a, (void)b, (void)ldb, (void)c, (void)ldc, (void)add;
  no_vector_kernels();
#endif
}

// <a, b> over n floats (level 1 or 2).
float dot(int level, const float* a, const float* b, i64 n) {
#if defined(__x86_64__) || defined(_M_X64)
  if (level == 2) return rlflow_cpu::dot_avx512(a, b, n);
  return rlflow_cpu::dot_avx2(a, b, n);
#else
  no_vector_kernels();
#endif
}

// One packed row's shapes and tensors (token-major: token t, head h at t * heads + h rows of dim).
struct Packed {
  const i64* cu;  // (seqs + 1,) sequence boundaries
  i64 seqs, heads, kv_heads, dim, max_len;
  float scale;
  const float *q, *k, *v;  // (total, heads | kv_heads, dim)
  i64 q_row() const { return heads * dim; }
  i64 kv_row() const { return kv_heads * dim; }
};

// Runs task(s, g, work) for every (sequence, kv head) on the team, longest sequences first, each
// task on one thread with that thread's workspace of `floats`.
template <class F>
void over_tasks(const Packed& pk, int threads, i64 floats, F&& task) {
  std::vector<i64> order(pk.seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](i64 a, i64 b) { return pk.cu[a + 1] - pk.cu[a] > pk.cu[b + 1] - pk.cu[b]; });
  const i64 count = pk.seqs * pk.kv_heads;
  std::atomic<i64> next{0};
  py::gil_scoped_release release;
  rlflow_cpu::on_threads(threads, [&](int, int) {
    std::vector<float> work(floats);
    for (i64 n; (n = next.fetch_add(1)) < count;) task(order[n / pk.kv_heads], n % pk.kv_heads, work.data());
  });
}

// dst[c * ld + j] = src[j * row + c]: a sequence's (len, dim) keys or values of one head, transposed:
// AVX-512 a vector of rows at a time (gathered down a column, stored along a row of dst), AVX2 in
// cpu.h's 8 x 8 register blocks (faster than AMD's gathers: docs/benchmarks.md).
#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx512f"))) void transpose_avx512(const float* src, i64 row, i64 len, i64 dim, float* dst,
                                                         i64 ld) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(row)));
  for (i64 j = 0; j < len; j += 16) {
    const __mmask16 m = first_lanes(len - j);
    for (i64 c = 0; c < dim; ++c) {
      const __m512 column = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, rows, src + j * row + c, 4);
      _mm512_mask_storeu_ps(dst + c * ld + j, m, column);
    }
  }
}

#endif

void transpose(int level, const float* src, i64 row, i64 len, i64 dim, float* dst, i64 ld) {
#if defined(__x86_64__) || defined(_M_X64)
  if (level == 2) return transpose_avx512(src, row, len, dim, dst, ld);
  return rlflow_cpu::transpose_avx2(src, row, len, dim, dst, ld);
#endif
}

i64 padded(i64 n) { return (n + 15) / 16 * 16; }

// A row's largest score, and its scores s turned in place into e^(scale s - shift) with their sum.
#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx512f"))) float row_max_avx512(const float* s, i64 n) {
  __m512 most = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (i64 j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    most = _mm512_mask_max_ps(most, m, most, _mm512_maskz_loadu_ps(m, s + j));
  }
  return _mm512_reduce_max_ps(most);
}

__attribute__((target("avx2,fma"))) float hmax_avx2(__m256 x) {
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_max_ss(r, _mm_movehdup_ps(r)));
}

__attribute__((target("avx2,fma"))) float row_max_avx2(const float* s, i64 n) {
  const i64 whole = n / 8 * 8;
  __m256 most = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (i64 j = 0; j < whole; j += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(s + j));
  float top = hmax_avx2(most);
  for (i64 j = whole; j < n; ++j) top = std::max(top, s[j]);
  return top;
}

__attribute__((target("avx2,fma"))) float exp_sum_avx2(float* s, i64 n, float scale, float shift) {
  const i64 whole = n / 8 * 8;
  const __m256 k = _mm256_set1_ps(scale), c = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  for (i64 j = 0; j < whole; j += 8) {
    const __m256 e = rlflow_cpu::exp_avx2(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), k, c));
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + j, e);
  }
  float total = rlflow_cpu::hsum_avx2(sum);
  for (i64 j = whole; j < n; ++j) total += (s[j] = std::exp(s[j] * scale - shift));
  return total;
}
#endif

float row_max(int level, const float* s, i64 n) {
#if defined(__x86_64__) || defined(_M_X64)
  if (level == 2) return row_max_avx512(s, n);
  return row_max_avx2(s, n);
#else
  no_vector_kernels();
#endif
}

float exp_sum(int level, float* s, i64 n, float scale, float shift) {
#if defined(__x86_64__) || defined(_M_X64)
  if (level == 2) return rlflow_cpu::exp_sum_avx512(s, n, scale, shift);
  return exp_sum_avx2(s, n, scale, shift);
#else
  no_vector_kernels();
#endif
}

// The block of rows [i0, i0 + rows) of e^(scale q k^T - shift) over keys j <= i (zero beyond, up to
// the block's last key): p[r * ld + j] for r < rows, from q's rows (qs floats apart) and kt (dim, ld). The
// backward gives lse (shift = lse_i: p is softmax(scale q k^T)); else shift = each row's largest
// scaled score, its log-sum-exp goes to lse_out[i] and 1 / the row's sum to inv[r].
void probabilities(int level, const Packed& pk, const float* q, i64 qs, const float* kt, i64 ld, i64 i0, int rows,
                   float* p, const float* lse, float* lse_out, float* inv) {
  const i64 keys = i0 + rows;
  gemm(level, rows, keys, pk.dim, {q + i0 * qs, qs, 1}, kt, ld, p, ld, false);
  for (int r = 0; r < rows; ++r) {
    const i64 i = i0 + r;
    float* pr = p + r * ld;
    if (lse != nullptr) {
      exp_sum(level, pr, i + 1, pk.scale, lse[i]);
    } else {
      const float top = pk.scale * row_max(level, pr, i + 1);  // scale > 0
      const float total = exp_sum(level, pr, i + 1, pk.scale, top);
      lse_out[i] = top + std::log(total);
      inv[r] = 1.0f / total;
    }
    std::fill(pr + i + 1, pr + keys, 0.f);
  }
}

// out (total, heads, dim) and lse (heads, total) of q, k, v.
void forward(const Packed& pk, int level, float* out, float* lse, int threads) {
  const i64 ld = padded(pk.max_len), total = pk.cu[pk.seqs], group = pk.heads / pk.kv_heads, dim = pk.dim;
  over_tasks(pk, threads, dim * ld + kRows * ld, [&](i64 s, i64 g, float* work) {
    const i64 t0 = pk.cu[s], len = pk.cu[s + 1] - t0, qr = pk.q_row(), kr = pk.kv_row();
    float *kt = work, *p = kt + dim * ld;
    transpose(level, pk.k + t0 * kr + g * dim, kr, len, dim, kt, ld);
    const float* v = pk.v + t0 * kr + g * dim;
    for (i64 h = g * group; h < (g + 1) * group; ++h) {
      const float* q = pk.q + t0 * qr + h * dim;
      float* o = out + t0 * qr + h * dim;
      for (i64 i0 = 0; i0 < len; i0 += kRows) {
        const int rows = static_cast<int>(std::min<i64>(kRows, len - i0));
        float inv[kRows];
        probabilities(level, pk, q, qr, kt, ld, i0, rows, p, nullptr, lse + h * total + t0, inv);
        gemm(level, rows, dim, i0 + rows, {p, ld, 1}, v, kr, o + i0 * qr, qr, false);
        for (int r = 0; r < rows; ++r) {  // the softmax's division, on the row's output
          float* orow = o + (i0 + r) * qr;
          for (i64 c = 0; c < dim; ++c) orow[c] *= inv[r];
        }
      }
    }
  });
}

// dq (total, heads, dim), dk and dv (total, kv_heads, dim) of d_out, with the forward's out and lse.
void backward(const Packed& pk, int level, const float* out, const float* lse, const float* d_out, float* dq,
              float* dk, float* dv, int threads) {
  const i64 ld = padded(pk.max_len), total = pk.cu[pk.seqs], group = pk.heads / pk.kv_heads, dim = pk.dim;
  const i64 floats = 2 * dim * ld + 2 * pk.max_len * ld + kRows * ld + pk.max_len;
  over_tasks(pk, threads, floats, [&](i64 s, i64 g, float* work) {
    const i64 t0 = pk.cu[s], len = pk.cu[s + 1] - t0, qr = pk.q_row(), kr = pk.kv_row();
    float *kt = work, *vt = kt + dim * ld, *p = vt + dim * ld, *ds = p + pk.max_len * ld;
    float *dp = ds + pk.max_len * ld, *delta = dp + kRows * ld;
    const float* k = pk.k + t0 * kr + g * dim;
    float *dkg = dk + t0 * kr + g * dim, *dvg = dv + t0 * kr + g * dim;
    transpose(level, k, kr, len, dim, kt, ld);
    transpose(level, pk.v + t0 * kr + g * dim, kr, len, dim, vt, ld);
    for (i64 h = g * group; h < (g + 1) * group; ++h) {
      const i64 at = t0 * qr + h * dim;
      const float *q = pk.q + at, *dout = d_out + at;
      for (i64 i = 0; i < len; ++i) delta[i] = dot(level, dout + i * qr, out + at + i * qr, dim);
      for (i64 i0 = 0; i0 < len; i0 += kRows) {
        const int rows = static_cast<int>(std::min<i64>(kRows, len - i0));
        const i64 keys = i0 + rows;
        float *pb = p + i0 * ld, *dsb = ds + i0 * ld;
        probabilities(level, pk, q, qr, kt, ld, i0, rows, pb, lse + h * total + t0, nullptr, nullptr);
        gemm(level, rows, keys, dim, {dout + i0 * qr, qr, 1}, vt, ld, dp, ld, false);
        for (int r = 0; r < rows; ++r) {
          const float *pr = pb + r * ld, *dpr = dp + r * ld;
          float* dsr = dsb + r * ld;
          const float d = delta[i0 + r];
          for (i64 j = 0; j < keys; ++j) dsr[j] = pr[j] * (dpr[j] - d) * pk.scale;
        }
        gemm(level, rows, dim, keys, {dsb, ld, 1}, k, kr, dq + at + i0 * qr, qr, false);
      }
      // dv_j = sum_{i >= j} p_ij do_i and dk_j = sum_{i >= j} ds_ij q_i: p^T and ds^T as strided
      // operands. Key blocks start where query blocks did (multiples of kRows), so every (i, j) read
      // here, i >= j0, lies within row i's block of keys: written above, zero past the diagonal.
      const bool add = h != g * group;
      for (i64 j0 = 0; j0 < len; j0 += kRows) {
        const int rows = static_cast<int>(std::min<i64>(kRows, len - j0));
        const i64 n = len - j0;
        gemm(level, rows, dim, n, {p + j0 * ld + j0, 1, ld}, dout + j0 * qr, qr, dvg + j0 * kr, kr, add);
        gemm(level, rows, dim, n, {ds + j0 * ld + j0, 1, ld}, q + j0 * qr, qr, dkg + j0 * kr, kr, add);
      }
    }
  });
}

// The tensors come as addresses (torch's data_ptr()), checked by the Python side: float32 (cu_seqlens
// int64), C-contiguous, on the CPU, of the sizes named here (fused.cpp says why not numpy arrays).
const float* at(std::uintptr_t address) { return reinterpret_cast<const float*>(address); }
float* at_mut(std::uintptr_t address) { return reinterpret_cast<float*>(address); }

Packed packed(std::uintptr_t cu_at, i64 seqs, i64 heads, i64 kv_heads, i64 dim, i64 max_len, double scale,
              std::uintptr_t q_at, std::uintptr_t k_at, std::uintptr_t v_at, int level) {
  if (level < 1) throw std::invalid_argument("attention: needs the AVX2 or AVX-512 kernels (level 1 or 2)");
  if (seqs < 1 || heads < 1 || kv_heads < 1 || dim < 1 || heads % kv_heads != 0)
    throw std::invalid_argument("attention: seqs, heads, kv_heads and dim must be positive, heads a multiple of kv_heads");
  const i64* cu = reinterpret_cast<const i64*>(cu_at);
  for (i64 s = 0; s < seqs; ++s) {
    if (cu[s + 1] < cu[s] || cu[s + 1] - cu[s] > max_len)
      throw std::invalid_argument("attention: cu_seqlens must rise by at most max_len a sequence");
  }
  return {cu, seqs, heads, kv_heads, dim, max_len, static_cast<float>(scale), at(q_at), at(k_at), at(v_at)};
}

int level_of(int cap) { return rlflow_cpu::kernel_level(cap); }

}  // namespace

PYBIND11_MODULE(_C_attention, m) {
  m.doc() = "Causal attention of packed sequences on CPU in float32 (twin: torch's SDPA per sequence)";
  m.def("kernels", &level_of, py::arg("cap") = 2,
        "The widest kernels this CPU runs up to cap: 2 AVX-512, 1 AVX2/FMA, 0 none (the kernels need 1 or 2).");
  m.def(
      "forward",
      [](std::uintptr_t cu, i64 seqs, i64 heads, i64 kv_heads, i64 dim, i64 max_len, double scale, std::uintptr_t q,
         std::uintptr_t k, std::uintptr_t v, std::uintptr_t out, std::uintptr_t lse, int level, int threads) {
        forward(packed(cu, seqs, heads, kv_heads, dim, max_len, scale, q, k, v, level), level, at_mut(out),
                at_mut(lse), threads);
      },
      py::arg("cu_seqlens"), py::arg("seqs"), py::arg("heads"), py::arg("kv_heads"), py::arg("dim"),
      py::arg("max_len"), py::arg("scale"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
      py::arg("level"), py::arg("threads"));
  m.def(
      "backward",
      [](std::uintptr_t cu, i64 seqs, i64 heads, i64 kv_heads, i64 dim, i64 max_len, double scale, std::uintptr_t q,
         std::uintptr_t k, std::uintptr_t v, std::uintptr_t out, std::uintptr_t lse, std::uintptr_t d_out,
         std::uintptr_t dq, std::uintptr_t dk, std::uintptr_t dv, int level, int threads) {
        backward(packed(cu, seqs, heads, kv_heads, dim, max_len, scale, q, k, v, level), level, at(out), at(lse),
                 at(d_out), at_mut(dq), at_mut(dk), at_mut(dv), threads);
      },
      py::arg("cu_seqlens"), py::arg("seqs"), py::arg("heads"), py::arg("kv_heads"), py::arg("dim"),
      py::arg("max_len"), py::arg("scale"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
      py::arg("d_out"), py::arg("dq"), py::arg("dk"), py::arg("dv"), py::arg("level"), py::arg("threads"));
}
