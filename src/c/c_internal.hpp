// Shared by the C ABI's translation units: the handle types, the exception-to-status boundary
// and the conversions from C descriptors to kvpolicy views.
#pragma once
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "kvpolicy/c/kvpolicy.h"
#include "kvpolicy/policy.hpp"

namespace kvpolicy::capi {

// A failure with a status other than the default mapping of its exception type.
struct CError {
  kvp_status status;
  std::string message;
};

[[noreturn]] inline void raise(kvp_status s, std::string msg) { throw CError{s, std::move(msg)}; }

void set_error(const std::string& message);
void clear_error();
void set_warning(const std::string& message);
std::string take_plugin_error();

// Runs `f` (returning void) and turns every exception into a status and a thread-local message;
// nothing propagates across the C boundary.
template <class F>
kvp_status guard(F&& f) noexcept {
  try {
    clear_error();
    f();
    return KVP_OK;
  } catch (const CError& e) {
    set_error(e.message);
    return e.status;
  } catch (const PluginError& e) {
    set_error(e.what());
    return KVP_ERROR_PLUGIN;
  } catch (const Error& e) {
    set_error(e.what());
    return KVP_ERROR_INVALID_ARGUMENT;
  } catch (const std::bad_alloc&) {
    set_error("kvpolicy: out of memory");
    return KVP_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error(std::string("kvpolicy: internal error: ") + e.what());
    return KVP_ERROR_INTERNAL;
  } catch (...) {
    set_error("kvpolicy: internal error (unknown exception)");
    return KVP_ERROR_INTERNAL;
  }
}

#define KVP_C_NONNULL(p, what) \
  KVP_REQUIRE((p) != nullptr, what, " is NULL")

}  // namespace kvpolicy::capi

// The opaque handles.
struct kvp_policy {
  kvpolicy::Policy policy;
  // The plug-in the spec uses (its state and callbacks), shared with the policy's External.
  std::shared_ptr<struct kvp_plugin_holder> plugin;
  std::string spec, scorer;
};

struct kvp_plugin_holder {
  kvp_scorer_plugin fns{};
  std::string name;
  ~kvp_plugin_holder() {
    if (fns.free) fns.free(fns.state);
  }
};

namespace kvpolicy::capi {

// The integer a C caller stored in an enum field. A C enum object may hold any int; in C++,
// loading a value outside the enumerators' range is undefined, so fields are read as raw ints.
template <class E>
int raw_enum(const E& e) {
  static_assert(sizeof(E) == sizeof(int), "C enums of this ABI are int-sized");
  int v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

inline DType dtype_from(const kvp_dtype& field, const char* what) {
  switch (raw_enum(field)) {
    case KVP_F32: return DType::f32;
    case KVP_F16: return DType::f16;
    case KVP_BF16: return DType::bf16;
  }
  detail::fail(what, ": unknown dtype ", raw_enum(field), " (KVP_F32, KVP_F16, KVP_BF16)");
}

// Calls f(T{}) with T the element type of `d`.
template <class F>
decltype(auto) dispatch(const kvp_dtype& d, const char* what, F&& f) {
  switch (dtype_from(d, what)) {
    case DType::f32: return f(float{});
    case DType::f16: return f(half{});
    case DType::bf16: return f(bfloat16{});
  }
  detail::fail(what, ": unknown dtype");
}

template <class T>
KVView<T> view_of(const kvp_tensor& t, const char* what) {
  KVP_REQUIRE(dtype_from(t.dtype, what) == dtype_of<T>, what, " has dtype ",
              dtype_name(dtype_from(t.dtype, what)), " but ", dtype_name(dtype_of<T>),
              " was expected (all tensors of a call share the keys' dtype)");
  KVView<T> v{static_cast<T*>(t.data), t.layers, t.heads, t.tokens, t.dim,
              t.stride_layer, t.stride_head, t.stride_token, t.stride_dim};
  validate(v, what);
  return v;
}

inline Budget budget_from(const kvp_budget& b, const char* what) {
  Budget out = Budget::ratio(1.0);
  const int kind = raw_enum(b.kind);
  switch (kind) {
    case KVP_BUDGET_RATIO: out = Budget::ratio(b.value); break;
    case KVP_BUDGET_PER_HEAD:
    case KVP_BUDGET_TOTAL:
      KVP_REQUIRE(b.value >= 0 && b.value <= 9.0e18 && b.value == static_cast<double>(
                      static_cast<std::int64_t>(b.value)),
                  what, ": a token budget must be a non-negative integer (got ", b.value, ")");
      out = kind == KVP_BUDGET_PER_HEAD ? Budget::tokens(static_cast<std::int64_t>(b.value))
                                          : Budget::total(static_cast<std::int64_t>(b.value));
      break;
    default:
      detail::fail(what, ": unknown budget kind ", kind);
  }
  out.validate();
  return out;
}

// Checks a versioned struct's size: a caller built against an older header passes a smaller
// size, a garbage value is caught here.
inline void check_struct(std::uint32_t got, std::size_t expected, const char* what) {
  KVP_REQUIRE(got == expected, what, ".struct_size is ", got, " but this library expects ",
              expected, " (initialize it with its kvp_*_default*() function)");
}

inline const kvp_compress_params& params_or_default(const kvp_compress_params* p,
                                                    kvp_compress_params& storage) {
  if (!p) {
    storage = kvp_compress_default_params();
    return storage;
  }
  check_struct(p->struct_size, sizeof(kvp_compress_params), "params");
  return *p;
}

// Tensor parallelism (kvp_compress_params.shard) is served by kvp_compress and kvp_cuda_compress.
inline void require_no_shard(const kvp_compress_params& p, const char* call) {
  if (p.shard)
    raise(KVP_ERROR_UNSUPPORTED, std::string("kvpolicy: ") + call +
                                     ": params.shard (tensor parallelism over KV heads) is "
                                     "supported by kvp_compress and kvp_cuda_compress only");
}

// kvp_compress_params' per-event inputs (ABI 4): into the event's Inputs and EventInfo.
template <class T>
void apply_event_inputs(const kvp_compress_params& p, Inputs<T>& in, EventInfo& ev) {
  KVP_REQUIRE(p.reconstruction_stride >= 0 && p.alloc_state_stride >= 0 && p.rope_pairs >= 0,
              "params: negative reconstruction_stride, alloc_state_stride or rope_pairs");
  KVP_REQUIRE(!p.rope_pairs || p.rope_inv_freq, "params.rope_inv_freq is NULL but rope_pairs is ",
              p.rope_pairs);
  KVP_REQUIRE(!p.rope_inv_freq || p.rope_pairs > 0,
              "params.rope_inv_freq is set but rope_pairs is 0 (head_dim / 2 frequencies)");
  in.reconstruction = p.reconstruction;
  in.state_stride = p.reconstruction ? p.reconstruction_stride : 0;
  ev.alloc_state = p.alloc_state;
  ev.alloc_state_stride = p.alloc_state ? p.alloc_state_stride : 0;
  if (p.rope_inv_freq)
    in.rope_inv_freq = {p.rope_inv_freq, static_cast<std::size_t>(p.rope_pairs)};
}

// Batches and paged caches take no per-event inputs (kvp_compress and kvp_cuda_compress do).
inline void require_no_event_inputs(const kvp_compress_params& p, const char* call) {
  if (p.reconstruction || p.alloc_state || p.rope_inv_freq)
    raise(KVP_ERROR_UNSUPPORTED, std::string("kvpolicy: ") + call +
                                     ": params.reconstruction, alloc_state and rope_inv_freq "
                                     "are taken by kvp_compress and kvp_cuda_compress only");
}

inline void require_policy_stages_dense(const Policy& p, const char* call) {
  if (p.merger() || p.quantizer())
    raise(KVP_ERROR_UNSUPPORTED,
          std::string("kvpolicy: ") + call + ": policy '" + p.spec() + "' has a " +
              (p.merger() ? "merger" : "quantizer") +
              " stage, which needs the per-token state of a session (kvp_session_*)");
}

}  // namespace kvpolicy::capi
