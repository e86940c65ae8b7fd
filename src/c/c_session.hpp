// Shared by the C ABI's sessions (c_api.cpp: kvp_session_*; c_cuda_session.cpp:
// kvp_cuda_session_*) and its CUDA entry points: the session configuration from its C struct,
// and how CUDA failures and CUDA-less builds are reported.
#pragma once
#include <string>

#include "c/c_internal.hpp"
#include "kvpolicy/session.hpp"

namespace kvpolicy::capi {

inline SessionConfig session_config_from(const kvp_session_config& config) {
  check_struct(config.struct_size, sizeof(kvp_session_config), "config");
  SessionConfig c;
  c.layers = config.layers;
  c.kv_heads = config.kv_heads;
  c.q_heads = config.q_heads;
  c.head_dim = config.head_dim;
  c.budget = budget_from(config.budget, "config.budget");
  c.initial_capacity = config.initial_capacity;
  c.decode_interval = config.decode_interval;
  if (config.has_decode_target)
    c.decode_target = budget_from(config.decode_target, "config.decode_target");
  c.backend.threads = config.threads;
  return c;
}

// f(), with a failed CUDA runtime call or launch reported as KVP_ERROR_CUDA.
template <class F>
decltype(auto) cuda_call(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (std::string(e.what()).find("CUDA error") != std::string::npos)
      raise(KVP_ERROR_CUDA, e.what());
    throw;
  }
}

[[noreturn]] inline void no_cuda(const char* fn) {
  raise(KVP_ERROR_UNSUPPORTED,
        std::string("kvpolicy: ") + fn + ": this build of kvpolicy has no CUDA support "
        "(configure with -DKVPOLICY_CUDA=ON and nvcc available)");
}

}  // namespace kvpolicy::capi
