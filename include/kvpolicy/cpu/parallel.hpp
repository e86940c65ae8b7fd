// OpenMP helpers. Work is split into independent items (usually (layer, head) pairs) that each
// write their own output, so results never depend on the number of threads.
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
// rethrown on the calling thread after the loop.
template <class F>
void parallel_for(const cpu_backend& be, std::int64_t n, F&& f) {
  std::exception_ptr err;
  std::mutex mu;
#if defined(_OPENMP)
  const int threads = be.threads > 0 ? be.threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (n > 1)
#endif
  for (std::int64_t i = 0; i < n; ++i) {
    try {
      f(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  }
  (void)be;
  if (err) std::rethrow_exception(err);
}

}  // namespace kvpolicy::cpu
