// What the CPU kernels that run on torch's threads share (attention.cpp, decode.cpp, fused.cpp): the
// CPU's widest kernels, work split over an OpenMP team, e^x in vector registers, SwiGLU's forward and
// a transpose.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

namespace rlflow_cpu {

using i64 = int64_t;

// The widest kernels this CPU runs, capped at `cap`: 0 scalar, 1 AVX2/FMA, 2 AVX-512 (the CPU is
// asked once a process).
inline int kernel_level(int cap = 2) {
  static const int level = [] {
    int found = 0;
#if defined(__x86_64__) || defined(_M_X64)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) found = 1;
    if (found == 1 && __builtin_cpu_supports("avx512f")) found = 2;
#endif
    return found;
  }();
  return std::min(level, std::max(0, cap));
}

// f(t, n) on each thread t of a team of n <= `threads` (fewer when the OpenMP runtime gives
// fewer), the calling thread being t = 0. The team is OpenMP's: the extensions link libgomp by the
// soname torch's own copy carries, so in a process that imported torch first both share one
// runtime and one set of threads — the ones torch's last op left spinning take the kernel's work,
// rather than a second set of threads contending with them for the cores. Without OpenMP, or
// with one thread, f(0, 1) here.
template <class F>
void on_threads(int threads, F&& f) {
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    f(omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  f(0, 1);
}

// [begin, end) of `count` items for thread t of `threads`: contiguous, sizes differing by at most one.
inline std::pair<i64, i64> share(i64 count, int t, int threads) {
  return {count * t / threads, count * (t + 1) / threads};
}

#if defined(__x86_64__) || defined(_M_X64)
// The first min(n, 16) lanes of a 16-float vector as a mask (none for n <= 0): a narrow panel, a row's tail.
inline __mmask16 first_lanes(i64 n) {
  if (n <= 0) return 0;
  return n >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
}

// The sum of a vector's 8 floats.
__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 x) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

// <a, b> over n floats with 8-wide FMAs in two accumulators (a scalar sum is one long dependency chain).
__attribute__((target("avx2,fma"))) inline float dot_avx2(const float* a, const float* b, i64 n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  i64 i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float total = hsum_avx2(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

// dot_avx2 in 16-wide registers, a tail under a mask.
__attribute__((target("avx512f"))) inline float dot_avx512(const float* a, const float* b, i64 n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  i64 i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = first_lanes(n - i);
    s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

// e^x of a vector of floats, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts), e^r
// = 1 + r + r^2 P(r) with P of degree 5, times 2^n; within 1 ulp of glibc's expf over [-87, 0] (the
// softmax's range); 0 below kExpLow (where float's normal range ends; -inf too), infinity from
// about 88.4 on (2^n overflows) and above kExpHigh. The SiLU of fused.cpp (8 wide) and the softmax
// of decode.cpp and attention.cpp take it.
constexpr float kExpLow = -87.33654f, kExpHigh = 88.72283f;
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpLow), hi = _mm256_set1_ps(kExpHigh);
  const __m256 c = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), c);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  e = _mm256_blendv_ps(e, inf, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
  return _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kExpLow), hi = _mm512_set1_ps(kExpHigh);
  const __m512 c = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), c);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  __m512 e = _mm512_scalef_ps(y, n);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), inf);
  return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), _mm512_setzero_ps());
}

// s[0:n] = e^(scale s - shift) in place, 16 at a time with a masked tail; returns their sum (a
// softmax's numerators and denominator: the decode step's and the attention kernel's).
__attribute__((target("avx512f"))) inline float exp_sum_avx512(float* s, i64 n, float scale, float shift) {
  const __m512 k = _mm512_set1_ps(scale), c = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (i64 j = 0; j < n; j += 16) {
    const __mmask16 m = first_lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_avx512(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), k, c)));
    sum = _mm512_add_ps(sum, e);
    _mm512_mask_storeu_ps(s + j, m, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

// h[i] = SiLU(g[i]) * u[i] over [begin, end), SiLU(g) = g / (1 + e^-g): the MLP's activation (fused.cpp's
// training kernel, decode.cpp's step).
inline void swiglu_scalar(const float* g, const float* u, i64 begin, i64 end, float* h) {
  for (i64 i = begin; i < end; ++i) h[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

#if defined(__x86_64__) || defined(_M_X64)
// The sigmoid of 8 floats: 1 / (1 + e^-g).
__attribute__((target("avx2,fma"))) inline __m256 sigmoid_avx2(__m256 g) {
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_div_ps(one, _mm256_add_ps(one, exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// swiglu_scalar 8 at a time (exp_avx2's e^x), the tail one by one.
__attribute__((target("avx2,fma"))) inline void swiglu_avx2(const float* g, const float* u, i64 begin, i64 end,
                                                           float* h) {
  i64 i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 gi = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_mul_ps(gi, sigmoid_avx2(gi)), _mm256_loadu_ps(u + i)));
  }
  swiglu_scalar(g, u, i, end, h);
}

// dst[c * ld + j] = src[j * row + c] for j < len, c < dim: `len` rows of `dim` floats, `row` apart,
// transposed in 8 x 8 blocks held in registers (unpack, shuffle, swap halves); what the blocks leave
// one by one.
__attribute__((target("avx2,fma"))) inline void transpose_avx2(const float* src, i64 row, i64 len, i64 dim, float* dst,
                                                              i64 ld) {
  const i64 len8 = len / 8 * 8, dim8 = dim / 8 * 8;
  for (i64 j = 0; j < len8; j += 8) {
    for (i64 c = 0; c < dim8; c += 8) {
      __m256 a[8], b[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(src + (j + i) * row + c);
      for (int i = 0; i < 8; i += 2) {
        b[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        a[i] = _mm256_shuffle_ps(b[i], b[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        a[i + 1] = _mm256_shuffle_ps(b[i], b[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        a[i + 2] = _mm256_shuffle_ps(b[i + 1], b[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        a[i + 3] = _mm256_shuffle_ps(b[i + 1], b[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int i = 0; i < 4; ++i) {  // a[i] holds columns c + i (low half: rows 0-3) and c + i + 4 (high half)
        _mm256_storeu_ps(dst + (c + i) * ld + j, _mm256_permute2f128_ps(a[i], a[i + 4], 0x20));
        _mm256_storeu_ps(dst + (c + i + 4) * ld + j, _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
      }
    }
    for (i64 c = dim8; c < dim; ++c)
      for (i64 i = j; i < j + 8; ++i) dst[c * ld + i] = src[i * row + c];
  }
  for (i64 i = len8; i < len; ++i)
    for (i64 c = 0; c < dim; ++c) dst[c * ld + i] = src[i * row + c];
}
#endif

}  // namespace rlflow_cpu
