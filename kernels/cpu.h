// What the CPU kernels that run on torch's threads share (decode.cpp, fused.cpp): the CPU's widest
// kernels, and work split over an OpenMP team.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

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

}  // namespace rlflow_cpu
