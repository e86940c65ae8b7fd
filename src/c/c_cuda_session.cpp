// C ABI of the device Session (kvp_cuda_session_*, include/kvpolicy/c/kvpolicy.h): a handle over
// kvpolicy::cuda::Session<T> for the cache's element type. Every entry point is noexcept at the
// boundary (capi::guard) and checks its arguments before it writes anything. Without CUDA in
// the build, kvp_cuda_session_create checks its arguments and the policy as with CUDA, then
// gives KVP_ERROR_UNSUPPORTED, as the other entry points do at once.
#include <algorithm>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "c/c_internal.hpp"
#include "c/c_session.hpp"
#include "kvpolicy/cuda/session.hpp"  // (without CUDA: its host checks only, nothing instantiated)

using namespace kvpolicy;
using namespace kvpolicy::capi;

namespace {
// The argument and policy checks of kvp_cuda_session_create in every build; f(T{}, config).
template <class F>
void create_checks(const kvp_policy* policy, const kvp_session_config* config, kvp_dtype dtype,
                   F&& f) {
  KVP_C_NONNULL(policy, "policy");
  KVP_C_NONNULL(config, "config");
  const SessionConfig c = session_config_from(*config);
  dispatch(dtype, "dtype", [&](auto tag) {
    using T = decltype(tag);
    const std::string why = cuda::detail::session_unsupported<T>(policy->policy);
    if (!why.empty()) raise(KVP_ERROR_UNSUPPORTED, "kvpolicy: kvp_cuda_session_create: " + why);
    f(tag, c);
  });
}
}  // namespace

#if defined(KVPOLICY_WITH_CUDA)

struct kvp_cuda_session {
  std::variant<cuda::Session<float>, cuda::Session<half>, cuda::Session<bfloat16>> s;
};

namespace {

void check_layer(const kvp_cuda_session* s, int64_t layer) {
  const std::int64_t L = std::visit([](const auto& x) { return x.config().layers; }, s->s);
  KVP_REQUIRE(layer >= 0 && layer < L, "layer ", layer, " is outside [0, ", L, ")");
}

// Tensor descriptor of a device view (the cache's storage).
template <class T>
kvp_tensor tensor_of(const KVView<const T>& v) {
  kvp_tensor t{};
  t.data = const_cast<T*>(v.data);  // the engine's own cache: it may read or write it
  t.dtype = dtype_of<T> == DType::f32 ? KVP_F32 : dtype_of<T> == DType::f16 ? KVP_F16 : KVP_BF16;
  t.layers = v.layers, t.heads = v.heads, t.tokens = v.tokens, t.dim = v.dim;
  t.stride_layer = v.stride_layer, t.stride_head = v.stride_head;
  t.stride_token = v.stride_token, t.stride_dim = v.stride_dim;
  return t;
}

}  // namespace

extern "C" kvp_status kvp_cuda_session_create(const kvp_policy* policy,
                                              const kvp_session_config* config, kvp_dtype dtype,
                                              void* stream, kvp_cuda_session** out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    *out = nullptr;
    create_checks(policy, config, dtype, [&](auto tag, const SessionConfig& c) {
      using T = decltype(tag);
      *out = cuda_call([&] {
        return new kvp_cuda_session{decltype(kvp_cuda_session::s)(
            std::in_place_type<cuda::Session<T>>, policy->policy, c, stream)};
      });
    });
  });
}

extern "C" void kvp_cuda_session_destroy(kvp_cuda_session* session) { delete session; }

extern "C" kvp_status kvp_cuda_session_append(kvp_cuda_session* session, int64_t layer,
                                              const kvp_tensor* k, const kvp_tensor* v,
                                              const kvp_tensor* q) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(k, "k");
    KVP_C_NONNULL(v, "v");
    check_layer(session, layer);
    std::visit(
        [&](auto& s) {
          using T = typename std::decay_t<decltype(s)>::element_type;
          KVView<const T> qv;
          if (q && q->data) qv = view_of<const T>(*q, "q");
          const KVView<const T> kv = view_of<const T>(*k, "k"), vv = view_of<const T>(*v, "v");
          cuda_call([&] { s.append(layer, kv, vv, qv); });
        },
        session->s);
  });
}

extern "C" kvp_status kvp_cuda_session_attend(kvp_cuda_session* session, int64_t layer,
                                              const kvp_tensor* q, float* out, size_t out_len) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(q, "q");
    KVP_C_NONNULL(out, "out");
    check_layer(session, layer);
    std::visit(
        [&](auto& s) {
          using T = typename std::decay_t<decltype(s)>::element_type;
          const KVView<const T> qv = view_of<const T>(*q, "q");
          const auto need = static_cast<std::size_t>(qv.heads * qv.tokens * qv.dim);
          if (out_len < need)
            raise(KVP_ERROR_BUFFER_TOO_SMALL, "kvpolicy: out holds " + std::to_string(out_len) +
                                                  " floats but the attention output needs " +
                                                  std::to_string(need) + " (Hq * n * d)");
          cuda_call([&] { s.attend(layer, qv, out); });
        },
        session->s);
  });
}

extern "C" kvp_status kvp_cuda_session_compress_if_due(kvp_cuda_session* session, int64_t layer,
                                                       int* compressed) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    check_layer(session, layer);
    std::visit(
        [&](auto& s) {
          const bool c = cuda_call([&] { return s.compress_if_due(layer); });
          set_warning(s.take_warning());
          if (compressed) *compressed = c ? 1 : 0;
        },
        session->s);
  });
}

extern "C" kvp_status kvp_cuda_session_lengths(const kvp_cuda_session* session, int64_t layer,
                                               int64_t* out, size_t n) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(out, "out");
    check_layer(session, layer);
    std::visit(
        [&](const auto& s) {
          const auto len = s.lengths(layer);
          if (n < len.size())
            raise(KVP_ERROR_BUFFER_TOO_SMALL, "kvpolicy: out holds " + std::to_string(n) +
                                                  " entries but the layer has " +
                                                  std::to_string(len.size()) + " KV heads");
          std::copy(len.begin(), len.end(), out);
        },
        session->s);
  });
}

extern "C" kvp_status kvp_cuda_session_cache(const kvp_cuda_session* session, int64_t layer,
                                             kvp_tensor* keys, kvp_tensor* values) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    check_layer(session, layer);
    std::visit(
        [&](const auto& s) {
          if (keys) *keys = tensor_of(s.keys(layer));
          if (values) *values = tensor_of(s.values(layer));
        },
        session->s);
  });
}

extern "C" kvp_status kvp_cuda_session_positions(const kvp_cuda_session* session, int64_t layer,
                                                 int64_t head, int32_t* out,
                                                 int64_t capacity_tokens) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(out, "out");
    check_layer(session, layer);
    std::visit(
        [&](const auto& s) {
          const std::int64_t H = s.config().kv_heads;
          KVP_REQUIRE(head >= 0 && head < H, "head ", head, " is outside [0, ", H, ")");
          const std::int64_t n = s.lengths(layer)[static_cast<std::size_t>(head)];
          if (capacity_tokens < n)
            raise(KVP_ERROR_BUFFER_TOO_SMALL,
                  "kvpolicy: capacity_tokens is " + std::to_string(capacity_tokens) +
                      " but (layer " + std::to_string(layer) + ", head " + std::to_string(head) +
                      ") holds " + std::to_string(n) + " tokens");
          const std::vector<std::int32_t> pos = cuda_call([&] { return s.positions(layer, head); });
          std::copy(pos.begin(), pos.end(), out);
        },
        session->s);
  });
}

extern "C" kvp_status kvp_cuda_session_kv_bytes(const kvp_cuda_session* session, size_t* out) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(out, "out");
    *out = std::visit([](const auto& s) { return s.kv_bytes(); }, session->s);
  });
}

#else  // no CUDA: the pointers are checked, then KVP_ERROR_UNSUPPORTED

struct kvp_cuda_session {};

extern "C" kvp_status kvp_cuda_session_create(const kvp_policy* policy,
                                              const kvp_session_config* config, kvp_dtype dtype,
                                              void*, kvp_cuda_session** out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    *out = nullptr;
    create_checks(policy, config, dtype,
                  [](auto, const SessionConfig&) { no_cuda("kvp_cuda_session_create"); });
  });
}
extern "C" void kvp_cuda_session_destroy(kvp_cuda_session* session) { delete session; }
extern "C" kvp_status kvp_cuda_session_append(kvp_cuda_session*, int64_t, const kvp_tensor*,
                                              const kvp_tensor*, const kvp_tensor*) {
  return guard([] { no_cuda("kvp_cuda_session_append"); });
}
extern "C" kvp_status kvp_cuda_session_attend(kvp_cuda_session*, int64_t, const kvp_tensor*,
                                              float*, size_t) {
  return guard([] { no_cuda("kvp_cuda_session_attend"); });
}
extern "C" kvp_status kvp_cuda_session_compress_if_due(kvp_cuda_session*, int64_t, int*) {
  return guard([] { no_cuda("kvp_cuda_session_compress_if_due"); });
}
extern "C" kvp_status kvp_cuda_session_lengths(const kvp_cuda_session*, int64_t, int64_t*,
                                               size_t) {
  return guard([] { no_cuda("kvp_cuda_session_lengths"); });
}
extern "C" kvp_status kvp_cuda_session_cache(const kvp_cuda_session*, int64_t, kvp_tensor*,
                                             kvp_tensor*) {
  return guard([] { no_cuda("kvp_cuda_session_cache"); });
}
extern "C" kvp_status kvp_cuda_session_positions(const kvp_cuda_session*, int64_t, int64_t,
                                                 int32_t*, int64_t) {
  return guard([] { no_cuda("kvp_cuda_session_positions"); });
}
extern "C" kvp_status kvp_cuda_session_kv_bytes(const kvp_cuda_session*, size_t*) {
  return guard([] { no_cuda("kvp_cuda_session_kv_bytes"); });
}

#endif
