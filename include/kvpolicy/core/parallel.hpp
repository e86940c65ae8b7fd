// The host executor of cpu_backend: OpenMP when enabled, a plain loop otherwise (so nvcc and
// builds without OpenMP compile it). Work is split into independent items (usually (layer,
// head) pairs) that each write their own output, so results never depend on the number of
// threads.
#pragma once
#include <cstdint>
#include <exception>
#include <mutex>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kvpolicy/core/backend.hpp"

namespace kvpolicy::cpu {

// Runs f(i) for i in [0, n) on the backend's threads. The first exception thrown by any item is
// rethrown on the calling thread after the loop. Each item runs single-threaded: without the
// omp_set_num_threads(1) below, Eigen's GEMMs inside an item open nested OpenMP teams of
// omp_get_max_threads() threads whenever the outer team has one thread (n == 1, or
// cpu_backend{1}), so the backend's thread count would not bound the threads used and
// oversubscribed machines would spin (measured on 2 busy cores: one window_attention call of
// g*T = 160000 took 4.5 s instead of 0.13 s).
template <class F>
void parallel_for(const cpu_backend& be, std::int64_t n, F&& f) {
  std::exception_ptr err;
  std::mutex mu;
  auto run = [&](std::int64_t i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  };
#if defined(_OPENMP)
  const int threads = be.threads > 0 ? be.threads : omp_get_max_threads();
#pragma omp parallel num_threads(threads) if (n > 1)
  {
    omp_set_num_threads(1);  // per-task ICV: affects only teams nested inside this region
#pragma omp for schedule(dynamic, 1) nowait  // the region's end is the one barrier
    for (std::int64_t i = 0; i < n; ++i) run(i);
  }
#else
  for (std::int64_t i = 0; i < n; ++i) run(i);
#endif
  (void)be;
  if (err) std::rethrow_exception(err);
}

}  // namespace kvpolicy::cpu
