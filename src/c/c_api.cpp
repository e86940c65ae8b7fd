// C ABI: errors, tensors, plug-in scorers, policies, dense compression, sessions and the CUDA
// entry points. Paged compaction and batches: c_paged.cpp. Every entry point is noexcept at the
// boundary (capi::guard) and checks all of its arguments before it writes anything.
#include <algorithm>
#include <cstring>
#include <optional>

#include "c/c_internal.hpp"
#include "c/c_session.hpp"
#include "kvpolicy/cuda/policy.hpp"
#include "kvpolicy/session.hpp"
#if defined(KVPOLICY_WITH_CUDA)
#include "kvpolicy/cuda/runtime.hpp"
#endif

using namespace kvpolicy;
using namespace kvpolicy::capi;

namespace {
thread_local std::string t_error;
thread_local std::string t_plugin_error;
thread_local std::string t_warning;
}  // namespace

namespace kvpolicy::capi {
void set_error(const std::string& message) { t_error = message; }
void clear_error() {
  t_error.clear();
  t_plugin_error.clear();
  t_warning.clear();
}
void set_warning(const std::string& message) { t_warning = message; }
std::string take_plugin_error() { return std::exchange(t_plugin_error, {}); }
}  // namespace kvpolicy::capi

// ---- Status and errors -------------------------------------------------------------------

extern "C" const char* kvp_last_error(void) { return t_error.c_str(); }
extern "C" const char* kvp_last_warning(void) { return t_warning.c_str(); }

extern "C" const char* kvp_status_string(kvp_status status) {
  switch (raw_enum(status)) {
    case KVP_OK: return "KVP_OK";
    case KVP_ERROR_INVALID_ARGUMENT: return "KVP_ERROR_INVALID_ARGUMENT";
    case KVP_ERROR_BAD_SPEC: return "KVP_ERROR_BAD_SPEC";
    case KVP_ERROR_BUFFER_TOO_SMALL: return "KVP_ERROR_BUFFER_TOO_SMALL";
    case KVP_ERROR_SHARED_BLOCK: return "KVP_ERROR_SHARED_BLOCK";
    case KVP_ERROR_UNSUPPORTED: return "KVP_ERROR_UNSUPPORTED";
    case KVP_ERROR_PLUGIN: return "KVP_ERROR_PLUGIN";
    case KVP_ERROR_CUDA: return "KVP_ERROR_CUDA";
    case KVP_ERROR_OUT_OF_MEMORY: return "KVP_ERROR_OUT_OF_MEMORY";
    case KVP_ERROR_INTERNAL: return "KVP_ERROR_INTERNAL";
  }
  return "KVP_ERROR_UNKNOWN_STATUS";
}

extern "C" const char* kvp_version(void) { return KVPOLICY_VERSION_STRING; }
extern "C" int kvp_abi_version(void) { return KVP_ABI_VERSION; }

// ---- Tensors and parameters -----------------------------------------------------------------

extern "C" kvp_tensor kvp_tensor_hnd(void* data, kvp_dtype dtype, int64_t L, int64_t H,
                                     int64_t T, int64_t D) {
  return {data, dtype, L, H, T, D, H * T * D, T * D, D, 1};
}
extern "C" kvp_tensor kvp_tensor_nhd(void* data, kvp_dtype dtype, int64_t L, int64_t H,
                                     int64_t T, int64_t D) {
  return {data, dtype, L, H, T, D, T * H * D, D, H * D, 1};
}

extern "C" kvp_compress_params kvp_compress_default_params(void) {
  kvp_compress_params p{};
  p.struct_size = sizeof(kvp_compress_params);
  p.budget = {KVP_BUDGET_RATIO, 0.5};
  p.compact = 1;
  p.threads = 0;
  p.shard = nullptr;
  p.reconstruction = nullptr;
  p.reconstruction_stride = 0;
  p.alloc_state = nullptr;
  p.alloc_state_stride = 0;
  p.rope_inv_freq = nullptr;
  p.rope_pairs = 0;
  return p;
}

// ---- Plug-in scorers --------------------------------------------------------------------------

extern "C" kvp_scorer_plugin kvp_scorer_plugin_default(void) {
  kvp_scorer_plugin p{};
  p.struct_size = sizeof(kvp_scorer_plugin);
  return p;
}

extern "C" void kvp_plugin_set_error(const char* message) {
  t_plugin_error = message ? message : "";
}

namespace {

kvp_tensor to_c(const TensorRef& v) {
  kvp_tensor t{};
  t.data = const_cast<void*>(v.data);
  t.dtype = v.dtype == DType::f32 ? KVP_F32 : v.dtype == DType::f16 ? KVP_F16 : KVP_BF16;
  t.layers = v.layers, t.heads = v.heads, t.tokens = v.tokens, t.dim = v.dim;
  t.stride_layer = v.stride_layer, t.stride_head = v.stride_head;
  t.stride_token = v.stride_token, t.stride_dim = v.stride_dim;
  return t;
}

// The C++ scorer that calls a plug-in's callbacks.
External make_external(const std::shared_ptr<kvp_plugin_holder>& h) {
  External::Spec s;
  s.name = h->name;
  s.needs = Needs::keys;
  if (h->fns.needs & KVP_NEEDS_VALUES) s.needs = s.needs | Needs::values;
  if (h->fns.needs & KVP_NEEDS_QUERIES) s.needs = s.needs | Needs::queries;
  s.query_window = h->fns.query_window;
  s.protect = {h->fns.sinks, h->fns.recent};
  s.score = [h](const ExternalInputs& in, std::span<float> scores) {
    kvp_score_args a{};
    a.keys = to_c(in.keys);
    a.values = to_c(in.values);
    a.queries = to_c(in.queries);
    a.scores = scores.data();
    t_plugin_error.clear();
    const int rc = h->fns.score(h->fns.state, &a);
    if (rc != 0) {
      std::string msg = "plug-in scorer '" + h->name + "' failed (returned " +
                        std::to_string(rc) + ")";
      const std::string detail = take_plugin_error();
      if (!detail.empty()) msg += ": " + detail;
      throw PluginError(msg);
    }
  };
  return External(std::move(s));
}

// Validates a plug-in description and copies it into a holder that does not own the state yet
// (fns.free is set only once a policy has taken ownership).
std::shared_ptr<kvp_plugin_holder> make_holder(const kvp_scorer_plugin& p, std::size_t i) {
  const std::string what = "plugins[" + std::to_string(i) + "]";
  check_struct(p.struct_size, sizeof(kvp_scorer_plugin), what.c_str());
  KVP_REQUIRE(p.name != nullptr, what, ".name is NULL");
  KVP_REQUIRE(p.score != nullptr, what, ".score is NULL");
  KVP_REQUIRE((p.needs & ~(KVP_NEEDS_VALUES | KVP_NEEDS_QUERIES)) == 0, what, ".needs has unknown bits (",
              p.needs, ")");
  const char* name = p.name(p.state);
  KVP_REQUIRE(name != nullptr, what, ".name() returned NULL");
  auto h = std::make_shared<kvp_plugin_holder>();
  h->fns = p;
  h->fns.free = nullptr;
  h->name = name;
  return h;
}

kvp_policy* new_policy(Policy policy, std::shared_ptr<kvp_plugin_holder> plugin) {
  auto* out = new kvp_policy{std::move(policy), std::move(plugin), {}, {}};
  out->spec = out->policy.spec();
  out->scorer = std::string(out->policy.scorer_name());
  return out;
}

}  // namespace

// ---- Policies -------------------------------------------------------------------------------

extern "C" kvp_status kvp_policy_create(const char* spec, kvp_policy** out) {
  return kvp_policy_create_with_plugins(spec, nullptr, 0, out);
}

extern "C" kvp_status kvp_policy_create_with_plugins(const char* spec,
                                                     const kvp_scorer_plugin* plugins,
                                                     size_t num_plugins, kvp_policy** out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    *out = nullptr;
    KVP_C_NONNULL(spec, "spec");
    KVP_REQUIRE(num_plugins == 0 || plugins != nullptr, "plugins is NULL but num_plugins is ",
                num_plugins);
    std::vector<std::shared_ptr<kvp_plugin_holder>> holders;
    std::vector<External> externals;
    for (std::size_t i = 0; i < num_plugins; ++i) {
      holders.push_back(make_holder(plugins[i], i));
      for (std::size_t j = 0; j < i; ++j)
        KVP_REQUIRE(holders[j]->name != holders[i]->name, "plugins[", j, "] and plugins[", i,
                    "] are both named '", holders[i]->name, "' (a name may appear only once)");
      externals.push_back(make_external(holders.back()));
    }
    std::optional<Policy> policy;
    try {
      policy.emplace(spec, externals);
    } catch (const Error& e) {
      raise(KVP_ERROR_BAD_SPEC, e.what());
    }
    std::shared_ptr<kvp_plugin_holder> used;
    if (std::holds_alternative<External>(policy->scorer()))
      for (std::size_t i = 0; i < holders.size(); ++i)
        if (holders[i]->name == policy->scorer_name()) {
          used = holders[i];
          used->fns.free = plugins[i].free;  // owned from here on
        }
    *out = new_policy(std::move(*policy), std::move(used));
  });
}

extern "C" kvp_status kvp_policy_clone(const kvp_policy* policy, kvp_policy** out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    *out = nullptr;
    KVP_C_NONNULL(policy, "policy");
    if (!policy->plugin || !policy->plugin->fns.clone) {
      *out = new_policy(policy->policy, policy->plugin);
      return;
    }
    auto h = std::make_shared<kvp_plugin_holder>();
    h->fns = policy->plugin->fns;
    h->name = policy->plugin->name;
    h->fns.free = nullptr;
    h->fns.state = policy->plugin->fns.clone(policy->plugin->fns.state);
    KVP_REQUIRE(h->fns.state != nullptr || policy->plugin->fns.state == nullptr,
                "plug-in scorer '", h->name, "': clone() returned NULL");
    h->fns.free = policy->plugin->fns.free;
    std::vector<External> ext{make_external(h)};
    *out = new_policy(Policy(policy->spec, ext), std::move(h));
  });
}

extern "C" void kvp_policy_destroy(kvp_policy* policy) { delete policy; }

extern "C" kvp_status kvp_policy_reset(kvp_policy* policy) {
  return guard([&] {
    KVP_C_NONNULL(policy, "policy");
    if (policy->plugin && policy->plugin->fns.reset)
      policy->plugin->fns.reset(policy->plugin->fns.state);
  });
}

extern "C" kvp_status kvp_policy_get_info(const kvp_policy* policy, kvp_policy_info* out) {
  return guard([&] {
    KVP_C_NONNULL(policy, "policy");
    KVP_C_NONNULL(out, "out");
    const Policy& p = policy->policy;
    kvp_policy_info info{};
    info.spec = policy->spec.c_str();
    info.scorer = policy->scorer.c_str();
    if (has(p.needs(), Needs::values)) info.needs |= KVP_NEEDS_VALUES;
    if (has(p.needs(), Needs::queries) || p.query_window() != 0) info.needs |= KVP_NEEDS_QUERIES;
    if (has(p.needs(), Needs::reconstruction)) info.needs |= KVP_NEEDS_RECONSTRUCTION;
    info.query_window = p.query_window();
    info.decode_time = p.decode_time() ? 1 : 0;
    info.has_merger = p.merger() ? 1 : 0;
    info.has_quantizer = p.quantizer() ? 1 : 0;
    info.spans_heads = p.spans_heads() ? 1 : 0;
    *out = info;
  });
}

// ---- Dense compression ----------------------------------------------------------------------

namespace kvpolicy::capi {

void check_selection_out(const kvp_selection& out, std::int64_t L, std::int64_t H,
                         std::int64_t T, const char* what) {
  KVP_REQUIRE(out.layers == L && out.heads == H, what, " is [", out.layers, ",", out.heads,
              "] but the keys have [", L, ",", H, "] layers x heads");
  KVP_REQUIRE(L * H == 0 || out.counts != nullptr, what, ".counts is NULL");
  if (out.indices && out.capacity < T)
    raise(KVP_ERROR_BUFFER_TOO_SMALL, std::string("kvpolicy: ") + what + ".capacity is " +
                                          std::to_string(out.capacity) + " but a row may keep " +
                                          std::to_string(T) + " tokens");
}

void write_selection(const Selection& sel, kvp_selection& out) {
  for (std::int64_t l = 0; l < sel.layers(); ++l)
    for (std::int64_t h = 0; h < sel.heads(); ++h) {
      const std::int64_t r = l * sel.heads() + h;
      auto k = sel.kept(l, h);
      out.counts[r] = static_cast<std::int64_t>(k.size());
      if (out.indices) std::copy(k.begin(), k.end(), out.indices + r * out.capacity);
    }
}

}  // namespace kvpolicy::capi

extern "C" kvp_status kvp_compress_workspace_size(const kvp_policy* policy, const kvp_tensor* keys,
                                                  const kvp_compress_params* params,
                                                  size_t* bytes) {
  return guard([&] {
    KVP_C_NONNULL(policy, "policy");
    KVP_C_NONNULL(keys, "keys");
    KVP_C_NONNULL(bytes, "bytes");
    kvp_compress_params storage;
    params_or_default(params, storage);
    *bytes = 0;
  });
}

namespace {

// params.shard as a HeadShard in `hs`; null when the call holds every head.
const HeadShard* shard_of(const kvp_compress_params& prm, HeadShard& hs) {
  if (!prm.shard) return nullptr;
  hs = {prm.shard->rank,        prm.shard->ranks,      prm.shard->first_head,
        prm.shard->model_heads, prm.shard->all_gather, prm.shard->user};
  return &hs;
}

// Runs f(). Under an exchange (a sharded policy that combines heads), a rank whose f() fails
// outside the policy's own agreement (`inside` false: the C ABI's argument checks) reports its
// error through that agreement, so that every rank fails with it instead of waiting; this rank
// keeps its own error and status.
template <class F>
void reporting_to_ranks(const HeadShard& shard, bool exchanges, const bool& inside, F&& f) {
  try {
    f();
  } catch (const Error& e) {
    if (!exchanges || inside) throw;
    detail::agree(shard, detail::error_text(e), 0, 0, 0, false);  // throws on every rank
  } catch (const CError& e) {  // (a status of its own, e.g. KVP_ERROR_BUFFER_TOO_SMALL)
    if (!exchanges || inside) throw;
    const std::string_view prefix = "kvpolicy: ";
    std::string_view m = e.message;
    if (m.substr(0, prefix.size()) == prefix) m.remove_prefix(prefix.size());
    try {
      detail::agree(shard, std::string(m), 0, 0, 0, false);  // fails the other ranks
    } catch (const Error&) {
    }
    throw;
  } catch (const std::exception& e) {  // (std::bad_alloc, ...: guard() reports them)
    if (!exchanges || inside) throw;
    cuda::detail::report_failure(shard, e);
    throw;
  }
}

// A dense call's keys, values and queries as views (k, v: the mutable ones compaction writes;
// values may be NULL unless params.compact), with the per-event inputs of params.
template <class T>
Inputs<T> call_inputs(const kvp_compress_params& prm, const kvp_tensor& keys,
                      const kvp_tensor* values, const kvp_tensor* queries, KVView<T>& k,
                      KVView<T>& v, EventInfo& ev) {
  k = view_of<T>(keys, "keys");
  if (values && values->data) v = view_of<T>(*values, "values");
  KVP_REQUIRE(!prm.compact || v.data, "values is NULL but params.compact is set (pass the "
              "values to compact, or compact = 0 to select only)");
  Inputs<T> in;
  in.keys = k;
  in.values = v;
  if (queries && queries->data) in.queries = view_of<const T>(*queries, "queries");
  apply_event_inputs(prm, in, ev);
  return in;
}

}  // namespace

extern "C" kvp_status kvp_compress(const kvp_policy* policy, const kvp_compress_params* params,
                                   const kvp_tensor* keys, const kvp_tensor* values,
                                   const kvp_tensor* queries, void*, size_t,
                                   kvp_selection* out) {
  return guard([&] {
    KVP_C_NONNULL(policy, "policy");
    KVP_C_NONNULL(keys, "keys");
    KVP_C_NONNULL(out, "out");
    kvp_compress_params storage;
    const kvp_compress_params& prm = params_or_default(params, storage);
    const Policy& p = policy->policy;
    require_policy_stages_dense(p, "kvp_compress");
    HeadShard shard;
    EventInfo ev;
    ev.shard = shard_of(prm, shard);
    // Under an exchange, an argument error found here on one rank goes through the policy's
    // agreement step, so that every rank fails with it.
    const bool exchanges = prm.shard && shard.ranks > 1 && p.spans_heads() && shard.all_gather;
    bool selecting = false;
    reporting_to_ranks(shard, exchanges, selecting, [&] {
      const Budget budget = budget_from(prm.budget, "params.budget");
      dispatch(keys->dtype, "keys", [&](auto tag) {
        using T = decltype(tag);
        KVView<T> k, v;
        const Inputs<T> in = call_inputs<T>(prm, *keys, values, queries, k, v, ev);
        check_selection_out(*out, k.layers, k.heads, k.tokens, "out");
        if (!exchanges) detail::require_finite_inputs(in);  // (else the selection checks them)
        const cpu_backend be{prm.threads};
        selecting = true;
        Selection sel = p.select(be, in, budget, ev);
        if (prm.compact) detail::compact_kv(be, k, v, sel);
        write_selection(sel, *out);
        set_warning(sel.warning());
      });
    });
  });
}

// ---- Sessions -------------------------------------------------------------------------------

struct kvp_session {
  Session<float> session;
  std::shared_ptr<kvp_plugin_holder> plugin;  // keeps a plug-in scorer alive
};

extern "C" kvp_session_config kvp_session_default_config(void) {
  kvp_session_config c{};
  c.struct_size = sizeof(kvp_session_config);
  c.budget = {KVP_BUDGET_RATIO, 1.0};
  c.initial_capacity = 256;
  c.decode_target = {KVP_BUDGET_RATIO, 1.0};
  return c;
}

extern "C" kvp_status kvp_session_create(const kvp_policy* policy, const kvp_session_config* config,
                                         kvp_session** out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    *out = nullptr;
    KVP_C_NONNULL(policy, "policy");
    KVP_C_NONNULL(config, "config");
    const SessionConfig c = session_config_from(*config);
    auto s = std::make_unique<kvp_session>(kvp_session{Session<float>(policy->policy, c),
                                                       policy->plugin});
    if (policy->plugin && policy->plugin->fns.reset)
      policy->plugin->fns.reset(policy->plugin->fns.state);
    *out = s.release();
  });
}

extern "C" void kvp_session_destroy(kvp_session* session) { delete session; }

namespace {
void check_layer(const kvp_session* s, int64_t layer) {
  KVP_REQUIRE(layer >= 0 && layer < s->session.config().layers, "layer ", layer,
              " is outside [0, ", s->session.config().layers, ")");
}
}  // namespace

extern "C" kvp_status kvp_session_append(kvp_session* session, int64_t layer, const kvp_tensor* k,
                                         const kvp_tensor* v, const kvp_tensor* q) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(k, "k");
    KVP_C_NONNULL(v, "v");
    check_layer(session, layer);
    KVView<const float> qv;
    if (q && q->data) qv = view_of<const float>(*q, "q");
    const KVView<const float> kv = view_of<const float>(*k, "k");
    const KVView<const float> vv = view_of<const float>(*v, "v");
    require_finite(kv, "k");
    require_finite(vv, "v");
    if (qv.data) require_finite(qv, "q");
    session->session.append(layer, kv, vv, qv);
  });
}

namespace {
// out of kvp_session_attend / kvp_session_reconstruct: [Hq][n][d] floats for the queries qv.
void require_attention_out(const KVView<const float>& qv, size_t out_len) {
  const auto need = static_cast<std::size_t>(qv.heads * qv.tokens * qv.dim);
  if (out_len < need)
    raise(KVP_ERROR_BUFFER_TOO_SMALL, "kvpolicy: out holds " + std::to_string(out_len) +
                                          " floats but the attention output needs " +
                                          std::to_string(need) + " (Hq * n * d)");
}
}  // namespace

extern "C" kvp_status kvp_session_attend(kvp_session* session, int64_t layer, const kvp_tensor* q,
                                         float* out, size_t out_len) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(q, "q");
    KVP_C_NONNULL(out, "out");
    check_layer(session, layer);
    const KVView<const float> qv = view_of<const float>(*q, "q");
    require_attention_out(qv, out_len);
    require_finite(qv, "q");
    session->session.attend(layer, qv, out);
  });
}

extern "C" kvp_status kvp_session_reconstruct(kvp_session* session, int64_t layer,
                                              const kvp_tensor* k, const kvp_tensor* v,
                                              const kvp_tensor* q, float* out, size_t out_len) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(k, "k");
    KVP_C_NONNULL(v, "v");
    KVP_C_NONNULL(q, "q");
    KVP_C_NONNULL(out, "out");
    check_layer(session, layer);
    const KVView<const float> kv = view_of<const float>(*k, "k");
    const KVView<const float> vv = view_of<const float>(*v, "v");
    const KVView<const float> qv = view_of<const float>(*q, "q");
    require_attention_out(qv, out_len);
    session->session.reconstruct(layer, kv, vv, qv, out);
  });
}

extern "C" kvp_status kvp_session_clear_reconstruction(kvp_session* session) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    session->session.clear_reconstruction();
  });
}

extern "C" kvp_status kvp_session_compress_if_due(kvp_session* session, int64_t layer,
                                                  int* compressed) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    check_layer(session, layer);
    const bool c = session->session.compress_if_due(layer);
    set_warning(session->session.take_warning());
    if (compressed) *compressed = c ? 1 : 0;
  });
}

extern "C" kvp_status kvp_session_lengths(const kvp_session* session, int64_t layer, int64_t* out,
                                          size_t n) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(out, "out");
    check_layer(session, layer);
    auto len = session->session.lengths(layer);
    if (n < len.size())
      raise(KVP_ERROR_BUFFER_TOO_SMALL, "kvpolicy: out holds " + std::to_string(n) +
                                            " entries but the layer has " +
                                            std::to_string(len.size()) + " KV heads");
    std::copy(len.begin(), len.end(), out);
  });
}

extern "C" kvp_status kvp_session_read(const kvp_session* session, int64_t layer, int64_t head,
                                       float* keys, float* values, int32_t* positions,
                                       int64_t capacity_tokens) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    check_layer(session, layer);
    const Session<float>& s = session->session;
    KVP_REQUIRE(head >= 0 && head < s.config().kv_heads, "head ", head, " is outside [0, ",
                s.config().kv_heads, ")");
    const std::int64_t n = s.length(layer, head), d = s.config().head_dim;
    if (capacity_tokens < n)
      raise(KVP_ERROR_BUFFER_TOO_SMALL, "kvpolicy: capacity_tokens is " +
                                            std::to_string(capacity_tokens) + " but (layer " +
                                            std::to_string(layer) + ", head " +
                                            std::to_string(head) + ") holds " +
                                            std::to_string(n) + " tokens");
    if ((keys || values) && s.quantized(layer))
      raise(KVP_ERROR_UNSUPPORTED, "kvpolicy: layer " + std::to_string(layer) +
                                       " is quantized: it holds packed codes, not float rows");
    auto copy_rows = [&](const KVView<const float>& v, float* dst) {
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t i = 0; i < d; ++i) dst[t * d + i] = v.at(0, head, t, i);
    };
    if (keys) copy_rows(s.keys(layer), keys);
    if (values) copy_rows(s.values(layer), values);
    if (positions) {
      auto pos = s.positions(layer, head);
      std::copy(pos.begin(), pos.end(), positions);
    }
  });
}

extern "C" kvp_status kvp_session_kv_bytes(const kvp_session* session, size_t* out) {
  return guard([&] {
    KVP_C_NONNULL(session, "session");
    KVP_C_NONNULL(out, "out");
    *out = session->session.kv_bytes();
  });
}

// ---- CUDA -------------------------------------------------------------------------------------

#if defined(KVPOLICY_WITH_CUDA)
namespace {
cuda::CsrSelection csr_of(const kvp_csr& c) {
  return {c.layers, c.heads, c.offsets, c.indices, c.capacity};
}
}  // namespace

extern "C" int kvp_cuda_device_count(void) { return cuda::device_count(); }

extern "C" kvp_status kvp_cuda_select_workspace_size(int64_t rows, int64_t tokens, size_t* bytes) {
  return guard([&] {
    KVP_C_NONNULL(bytes, "bytes");
    KVP_REQUIRE(rows >= 0 && tokens >= 0, "negative rows (", rows, ") or tokens (", tokens, ")");
    *bytes = cuda::select_workspace_bytes(rows, tokens);
  });
}

extern "C" kvp_status kvp_cuda_select(const float* scores, int64_t layers, int64_t heads,
                                      int64_t tokens, int64_t row_stride, const int64_t* budgets,
                                      int64_t sinks, int64_t recent, void* workspace,
                                      size_t workspace_bytes, void* stream, kvp_csr* out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    KVP_REQUIRE(layers * heads == 0 || budgets, "budgets is NULL");
    KVP_REQUIRE(sinks >= 0 && recent >= 0, "negative sinks (", sinks, ") or recent (", recent,
                ")");
    const std::size_t need = cuda::select_workspace_bytes(layers * heads, tokens);
    if (workspace_bytes < need)
      raise(KVP_ERROR_BUFFER_TOO_SMALL, "kvpolicy: workspace_bytes is " +
                                            std::to_string(workspace_bytes) + " but select needs " +
                                            std::to_string(need));
    const cuda_backend be{stream, workspace, workspace_bytes};
    cuda::ScoreView sv{scores, layers, heads, tokens, row_stride};
    cuda::CsrSelection sel = csr_of(*out);
    const std::span<const std::int64_t> b(budgets, static_cast<std::size_t>(layers * heads));
    cuda_call([&] { cuda::select(be, sv, b, Protect{sinks, recent}, sel); });
  });
}

extern "C" kvp_status kvp_cuda_compact_workspace_size(const kvp_tensor* kv, size_t* bytes) {
  return guard([&] {
    KVP_C_NONNULL(kv, "kv");
    KVP_C_NONNULL(bytes, "bytes");
    *bytes = dispatch(kv->dtype, "kv", [&](auto tag) {
      using T = decltype(tag);
      return cuda::compact_workspace_bytes(view_of<T>(*kv, "kv"));
    });
  });
}

extern "C" kvp_status kvp_cuda_compact(const kvp_tensor* kv, const kvp_csr* selection,
                                       void* workspace, size_t workspace_bytes, void* stream) {
  return guard([&] {
    KVP_C_NONNULL(kv, "kv");
    KVP_C_NONNULL(selection, "selection");
    const cuda_backend be{stream, workspace, workspace_bytes};
    dispatch(kv->dtype, "kv", [&](auto tag) {
      using T = decltype(tag);
      cuda_call([&] { cuda::compact(be, view_of<T>(*kv, "kv"), csr_of(*selection)); });
    });
  });
}
#else
extern "C" int kvp_cuda_device_count(void) { return 0; }
extern "C" kvp_status kvp_cuda_select_workspace_size(int64_t, int64_t, size_t*) {
  return guard([] { no_cuda("kvp_cuda_select_workspace_size"); });
}
extern "C" kvp_status kvp_cuda_select(const float*, int64_t, int64_t, int64_t, int64_t,
                                      const int64_t*, int64_t, int64_t, void*, size_t, void*,
                                      kvp_csr*) {
  return guard([] { no_cuda("kvp_cuda_select"); });
}
extern "C" kvp_status kvp_cuda_compact_workspace_size(const kvp_tensor*, size_t*) {
  return guard([] { no_cuda("kvp_cuda_compact_workspace_size"); });
}
extern "C" kvp_status kvp_cuda_compact(const kvp_tensor*, const kvp_csr*, void*, size_t, void*) {
  return guard([] { no_cuda("kvp_cuda_compact"); });
}
#endif

// ---- A policy on device tensors -----------------------------------------------------------------

namespace {

// The checks kvp_cuda_compress_plan and kvp_cuda_compress share (both builds, before anything
// touches the device), then f(policy, params, budget, inputs, keys, values, event, collective)
// with the event's views of device memory (nothing is read through them here).
// Tensor parallelism (params.shard) with a policy that exchanges (adakv): cuda::plan and
// cuda::select agree on every rank's checks themselves; a rank that fails before them (these
// checks, or f's buffer checks between plan and select) reports its error through the same
// agreement, so that every rank fails and none is left waiting. f sets `collective` while it is
// inside a call that agrees by itself. (Builds without CUDA stop every rank before any
// collective.)
template <class F>
void with_device_event(const kvp_policy* policy, const kvp_compress_params* params,
                       const kvp_tensor* keys, const kvp_tensor* values, const kvp_tensor* queries,
                       const char* call, F&& f) {
  KVP_C_NONNULL(policy, "policy");
  KVP_C_NONNULL(keys, "keys");
  kvp_compress_params storage;
  const kvp_compress_params& prm = params_or_default(params, storage);
  const Policy& p = policy->policy;
  HeadShard shard;
  EventInfo ev;
  ev.shard = shard_of(prm, shard);
#if defined(KVPOLICY_WITH_CUDA)
  const bool exchanges = prm.shard && shard.ranks > 1 && shard.all_gather && p.spans_heads();
#else
  const bool exchanges = false;
#endif
  bool collective = false;
  reporting_to_ranks(shard, exchanges, collective, [&] {
    require_policy_stages_dense(p, call);
    const Budget budget = budget_from(prm.budget, "params.budget");
    dispatch(keys->dtype, "keys", [&](auto tag) {
      using T = decltype(tag);
      const std::string why = cuda::detail::unsupported_stage<T>(p);
      if (!why.empty()) raise(KVP_ERROR_UNSUPPORTED, "kvpolicy: " + std::string(call) + ": " + why);
      KVView<T> k, v;
      const Inputs<T> in = call_inputs<T>(prm, *keys, values, queries, k, v, ev);
      // The event's host checks (shapes, inputs the stages need, budgets, the shard), in builds
      // without CUDA too, before anything is sized or launched.
      (void)cuda::detail::setup_event(p, in, budget, ev);
      f(p, prm, budget, in, k, v, static_cast<const EventInfo&>(ev), collective);
    });
  });
}

}  // namespace

#if defined(KVPOLICY_WITH_CUDA)
extern "C" kvp_status kvp_cuda_compress_plan(const kvp_policy* policy,
                                             const kvp_compress_params* params,
                                             const kvp_tensor* keys, const kvp_tensor* values,
                                             const kvp_tensor* queries, kvp_cuda_plan* out) {
  return guard([&] {
    with_device_event(policy, params, keys, values, queries, "kvp_cuda_compress_plan",
                      [&](const Policy& p, const kvp_compress_params&, const Budget& budget,
                          const auto& in, const auto&, const auto&, const EventInfo& ev,
                          bool& collective) {
                        KVP_C_NONNULL(out, "out");
                        collective = true;
                        const cuda::PolicyPlan plan =
                            cuda_call([&] { return cuda::plan(p, in, budget, ev); });
                        *out = {plan.workspace_bytes, plan.rows, plan.kept_capacity};
                      });
  });
}

extern "C" kvp_status kvp_cuda_compress(const kvp_policy* policy,
                                        const kvp_compress_params* params,
                                        const kvp_tensor* keys, const kvp_tensor* values,
                                        const kvp_tensor* queries, void* workspace,
                                        size_t workspace_bytes, void* stream, kvp_csr* out) {
  return guard([&] {
    with_device_event(
        policy, params, keys, values, queries, "kvp_cuda_compress",
        [&](const Policy& p, const kvp_compress_params& prm, const Budget& budget, const auto& in,
            const auto& k, const auto& v, const EventInfo& ev, bool& collective) {
          KVP_C_NONNULL(out, "out");
          collective = true;
          const cuda::PolicyPlan plan = cuda_call([&] { return cuda::plan(p, in, budget, ev); });
          collective = false;  // the buffer checks fail every rank through select's agreement
          if (workspace_bytes < plan.workspace_bytes)
            raise(KVP_ERROR_BUFFER_TOO_SMALL,
                  "kvpolicy: kvp_cuda_compress: workspace_bytes is " +
                      std::to_string(workspace_bytes) + " but the call needs " +
                      std::to_string(plan.workspace_bytes) + " (kvp_cuda_compress_plan)");
          if (out->capacity < plan.kept_capacity)
            raise(KVP_ERROR_BUFFER_TOO_SMALL,
                  "kvpolicy: kvp_cuda_compress: out->capacity is " + std::to_string(out->capacity) +
                      " but the call keeps up to " + std::to_string(plan.kept_capacity) +
                      " tokens (kvp_cuda_compress_plan)");
          KVP_REQUIRE(out->offsets && (plan.kept_capacity == 0 || out->indices),
                      "out->offsets or out->indices is NULL");
          cuda::CsrSelection sel = csr_of(*out);
          const cuda_backend be{stream, workspace, workspace_bytes};
          collective = true;
          const cuda::PolicyEvent e = cuda_call([&] {
            return prm.compact ? cuda::compress(be, p, k, v, in, budget, sel, ev)
                               : cuda::select(be, p, in, budget, sel, ev);
          });
          set_warning(e.warning);
        });
  });
}
#else
extern "C" kvp_status kvp_cuda_compress_plan(const kvp_policy* policy,
                                             const kvp_compress_params* params,
                                             const kvp_tensor* keys, const kvp_tensor* values,
                                             const kvp_tensor* queries, kvp_cuda_plan* out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    with_device_event(policy, params, keys, values, queries, "kvp_cuda_compress_plan",
                      [](auto&&...) { no_cuda("kvp_cuda_compress_plan"); });
  });
}
extern "C" kvp_status kvp_cuda_compress(const kvp_policy* policy,
                                        const kvp_compress_params* params,
                                        const kvp_tensor* keys, const kvp_tensor* values,
                                        const kvp_tensor* queries, void*, size_t, void*,
                                        kvp_csr* out) {
  return guard([&] {
    KVP_C_NONNULL(out, "out");
    with_device_event(policy, params, keys, values, queries, "kvp_cuda_compress",
                      [](auto&&...) { no_cuda("kvp_cuda_compress"); });
  });
}
#endif
