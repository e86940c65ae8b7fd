// Backends: every op in ops/ is overloaded on one of these, so one pipeline runs on either.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvpolicy {

enum class BackendKind : std::uint8_t { cpu, cuda };

// CPU reference path: OpenMP across (layer, head) work items. threads <= 0 uses the OpenMP
// default. Results never depend on the thread count (no cross-thread reductions).
struct cpu_backend {
  static constexpr BackendKind kind = BackendKind::cpu;
  int threads = 0;
};

// CUDA path: kernels are enqueued on `stream` (a cudaStream_t, kept opaque so host code does not
// include CUDA headers) and use caller-owned `workspace` sized by the op's workspace query.
struct cuda_backend {
  static constexpr BackendKind kind = BackendKind::cuda;
  void* stream = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
};

}  // namespace kvpolicy
