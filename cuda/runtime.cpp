// Host-side CUDA runtime services (runtime.hpp). Plain C++ against the CUDA runtime API.
#include "kvpolicy/cuda/runtime.hpp"

#include <cuda_runtime.h>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy::cuda {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    ::kvpolicy::detail::fail(what, ": CUDA error ", static_cast<int>(e), " (",
                             cudaGetErrorString(e), ")");
}

cudaStream_t stream_of(void* s) { return static_cast<cudaStream_t>(s); }

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so later calls do not report it
    return 0;
  }
  return n;
}

void copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_of(stream)),
        "copy_to_device");
  check(cudaStreamSynchronize(stream_of(stream)), "copy_to_device");
}

void copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(stream)),
        "copy_to_host");
  check(cudaStreamSynchronize(stream_of(stream)), "copy_to_host");
}

void fill_bytes(void* dst, int value, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  check(cudaMemsetAsync(dst, value, bytes, stream_of(stream)), "fill_bytes");
  check(cudaStreamSynchronize(stream_of(stream)), "fill_bytes");
}

void synchronize(void* stream) { check(cudaStreamSynchronize(stream_of(stream)), "synchronize"); }

DeviceGuard::DeviceGuard(int device) {
  int current = 0;
  check(cudaGetDevice(&current), "DeviceGuard");
  if (current == device) return;
  const cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    ::kvpolicy::detail::fail("cuda device ", device, ": cannot select it: CUDA error ",
                             static_cast<int>(e), " (", cudaGetErrorString(e), ")");
  }
  previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) (void)cudaSetDevice(previous_);
}

DeviceBuffer::DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t e = cudaMalloc(&ptr_, bytes);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();  // a failed allocation is not sticky: don't report it again later
    ptr_ = nullptr;
    check(e, "DeviceBuffer");
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_) (void)cudaFree(ptr_);
}

}  // namespace kvpolicy::cuda
