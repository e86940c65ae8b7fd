// The few CUDA runtime services host code needs without including CUDA headers: device
// discovery, an owning device buffer and blocking copies. For tests, benchmarks, examples and
// bindings; the ops themselves never allocate (workspace is the caller's).
#pragma once
#include <cstddef>
#include <utility>

namespace kvpolicy::cuda {

// Number of visible CUDA devices; 0 when there is no device or no usable driver. Never throws.
int device_count();

// Blocking helpers (enqueue on `stream`, then wait for it). Throw kvpolicy::Error on failure.
void copy_to_device(void* dst, const void* src, std::size_t bytes, void* stream = nullptr);
void copy_to_host(void* dst, const void* src, std::size_t bytes, void* stream = nullptr);
void fill_bytes(void* dst, int value, std::size_t bytes, void* stream = nullptr);
void synchronize(void* stream = nullptr);

// Makes `device` the calling thread's current CUDA device for its lifetime and restores the
// previous one after (allocations and launches go to the current device). Throws
// kvpolicy::Error naming the device when it cannot be selected (e.g. no such device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

// Owning device allocation (cudaMalloc / cudaFree). Movable, not copyable.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace kvpolicy::cuda
