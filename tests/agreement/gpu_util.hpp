// Helpers shared by the agreement tests' CUDA halves: whether a device is usable (warning
// "CUDA half skipped: ..." otherwise), and blocking uploads / downloads of std::vector data.
#pragma once
#include <catch2/catch.hpp>

#include <cstddef>
#include <vector>

#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/runtime.hpp>
#endif

namespace kvtest {

// True when the CUDA half can run here; otherwise says why, visibly, and the caller returns.
inline bool gpu_present() {
#if defined(KVPOLICY_WITH_CUDA)
  if (kvpolicy::cuda::device_count() > 0) return true;
  WARN("CUDA half skipped: no GPU (cudaGetDeviceCount found none)");
#else
  WARN("CUDA half skipped: built without CUDA (KVPOLICY_WITH_CUDA undefined)");
#endif
  return false;
}

#if defined(KVPOLICY_WITH_CUDA)

template <class T>
kvpolicy::cuda::DeviceBuffer upload(const std::vector<T>& v) {
  // At least one element, so an empty input still yields a valid (non-null) device pointer.
  kvpolicy::cuda::DeviceBuffer b((v.empty() ? 1 : v.size()) * sizeof(T));
  if (!v.empty()) kvpolicy::cuda::copy_to_device(b.data(), v.data(), v.size() * sizeof(T));
  return b;
}

template <class T>
std::vector<T> download(const kvpolicy::cuda::DeviceBuffer& b, std::size_t n) {
  std::vector<T> v(n);
  if (n) kvpolicy::cuda::copy_to_host(v.data(), b.data(), n * sizeof(T));
  return v;
}

#endif  // KVPOLICY_WITH_CUDA

}  // namespace kvtest
