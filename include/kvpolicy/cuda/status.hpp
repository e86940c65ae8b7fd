// Status of a CUDA-path call. The launch layer (launch.hpp) never throws: it returns a Status,
// which is trivially copyable so it can cross the C ABI unchanged. The typed host wrappers
// (cuda/compact.hpp, cuda/select.hpp) turn a failure into kvpolicy::Error with the op's name.
#pragma once
#include <string_view>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy::cuda {

enum class StatusCode : int {
  success = 0,
  invalid_argument,        // shape, stride or pointer the kernels cannot handle
  insufficient_workspace,  // cuda_backend::workspace_bytes below the op's workspace query
  cuda_error,              // a CUDA runtime call or launch failed; `cuda_error` holds its code
};

struct Status {
  StatusCode code = StatusCode::success;
  int cuda_error = 0;       // cudaError_t value when code == cuda_error
  const char* message = "";  // static string: never freed, safe to keep

  constexpr bool ok() const { return code == StatusCode::success; }
};

constexpr std::string_view status_name(StatusCode c) {
  switch (c) {
    case StatusCode::success: return "success";
    case StatusCode::invalid_argument: return "invalid argument";
    case StatusCode::insufficient_workspace: return "insufficient workspace";
    case StatusCode::cuda_error: return "CUDA error";
  }
  return "?";
}

// Host API boundary: a failed Status becomes kvpolicy::Error("<op>: <kind>: <message>").
inline void throw_if_error(const Status& s, std::string_view op) {
  if (s.ok()) return;
  if (s.code == StatusCode::cuda_error)
    detail::fail(op, ": CUDA error ", s.cuda_error, " (", s.message, ")");
  detail::fail(op, ": ", status_name(s.code), ": ", s.message);
}

}  // namespace kvpolicy::cuda
