// Helpers shared by the CUDA benchmarks (bench_cuda_*.cpp): skipping without a device, random
// host data, uploads, and CUDA events for timing inside one stream.
#pragma once
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kvpolicy/cuda/runtime.hpp"

namespace kvbench {

// True (and the benchmark marked skipped with "no GPU") when no CUDA device is usable.
inline bool skip_without_gpu(benchmark::State& state) {
  if (kvpolicy::cuda::device_count() > 0) return false;
  state.SkipWithError("no GPU");
  return true;
}

// n values uniform in [-a, a], converted to T.
template <class T>
std::vector<T> random_values(std::size_t n, std::uint64_t seed, float a) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-a, a);
  std::vector<T> v(n);
  for (auto& x : v) x = static_cast<T>(u(rng));
  return v;
}

template <class T>
kvpolicy::cuda::DeviceBuffer upload(const std::vector<T>& v) {
  kvpolicy::cuda::DeviceBuffer b((v.empty() ? 1 : v.size()) * sizeof(T));  // never null
  if (!v.empty()) kvpolicy::cuda::copy_to_device(b.data(), v.data(), v.size() * sizeof(T));
  return b;
}

// n CUDA events; ms(a, b) = elapsed time between events a and b (both recorded and complete).
struct Events {
  std::vector<cudaEvent_t> e;
  explicit Events(int n) : e(static_cast<std::size_t>(n)) {
    for (auto& x : e) cudaEventCreate(&x);
  }
  ~Events() {
    for (auto& x : e) cudaEventDestroy(x);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  double ms(int a, int b) const {
    float t = 0;
    cudaEventElapsedTime(&t, e[static_cast<std::size_t>(a)], e[static_cast<std::size_t>(b)]);
    return t;
  }
};

}  // namespace kvbench
