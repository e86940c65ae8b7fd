// Backend dispatch: every op is overloaded on the backend tag (cpu_backend, cuda_backend), so a
// pipeline written against ops:: runs on either by changing the backend value it is given.
// backend_traits<B> names what each backend consumes and produces: the CPU works on owning host
// containers (ScoreMap, Selection); the CUDA backend on views of device memory (ScoreView,
// CsrSelection) sized by the caller through the *_workspace_bytes queries (two-phase, like CUB).
// The CUDA overloads exist when the build links kvpolicy::cuda (KVPOLICY_WITH_CUDA).
#pragma once
#include <cstddef>
#include <span>
#include <type_traits>
#include <utility>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/cpu/compact.hpp"
#include "kvpolicy/cpu/select.hpp"
#include "kvpolicy/cpu/window_attention.hpp"
#if defined(KVPOLICY_WITH_CUDA)
#include "kvpolicy/cuda/compact.hpp"
#include "kvpolicy/cuda/select.hpp"
#include "kvpolicy/cuda/window_attention.hpp"
#endif

namespace kvpolicy::ops {

template <class B>
struct backend_traits;

template <>
struct backend_traits<cpu_backend> {
  using scores = ScoreMap;
  using selection = Selection;
};

template <class B>
using scores_t = typename backend_traits<B>::scores;
template <class B>
using selection_t = typename backend_traits<B>::selection;

// ---- CPU ------------------------------------------------------------------------------------

inline std::size_t select_workspace_bytes(const cpu_backend&, std::int64_t, std::int64_t) {
  return 0;
}
template <Element T>
std::size_t compact_workspace_bytes(const cpu_backend&, const KVView<T>&) {
  return 0;
}

inline void select(const cpu_backend& be, const ScoreMap& scores,
                   std::span<const std::int64_t> budgets, Protect p, Selection& out) {
  cpu::select(be, scores, budgets, p, out);
}

template <Element T>
void compact(const cpu_backend& be, const KVView<T>& kv, const Selection& sel) {
  cpu::compact(be, kv, sel);
}

template <class S>
void compact_state(const cpu_backend& be, S* data, std::int64_t stride_layer,
                   std::int64_t stride_head, const Selection& sel) {
  cpu::compact_state(be, data, stride_layer, stride_head, sel);
}

// Column sums of the causal softmax of all of `queries` (the last n_q) over `keys`, GQA-reduced.
template <Element T>
std::size_t window_attention_workspace_bytes(const cpu_backend&, const KVView<const T>&,
                                             const KVView<const T>&) {
  return 0;
}
template <Element T>
void window_attention(const cpu_backend& be, const KVView<const T>& keys,
                      const KVView<const T>& queries, GqaReduce reduce, ScoreMap& out) {
  cpu::window_attention(be, keys, queries, reduce, out);
}

// ---- CUDA -----------------------------------------------------------------------------------
#if defined(KVPOLICY_WITH_CUDA)

template <>
struct backend_traits<cuda_backend> {
  using scores = cuda::ScoreView;
  using selection = cuda::CsrSelection;
};

inline std::size_t select_workspace_bytes(const cuda_backend&, std::int64_t rows,
                                          std::int64_t tokens) {
  return cuda::select_workspace_bytes(rows, tokens);
}
template <Element T>
std::size_t compact_workspace_bytes(const cuda_backend&, const KVView<T>& kv) {
  return cuda::compact_workspace_bytes(kv);
}

// Host budgets (checked like the CPU path) or device budgets (see cuda/select.hpp).
inline void select(const cuda_backend& be, const cuda::ScoreView& scores,
                   std::span<const std::int64_t> budgets, Protect p, cuda::CsrSelection& out) {
  cuda::select(be, scores, budgets, p, out);
}
inline void select(const cuda_backend& be, const cuda::ScoreView& scores,
                   const std::int64_t* device_budgets, Protect p, cuda::CsrSelection& out) {
  cuda::select(be, scores, device_budgets, p, out);
}

template <Element T>
void compact(const cuda_backend& be, const KVView<T>& kv, const cuda::CsrSelection& sel) {
  cuda::compact(be, kv, sel);
}

template <class S>
void compact_state(const cuda_backend& be, S* data, std::int64_t stride_layer,
                   std::int64_t stride_head, const cuda::CsrSelection& sel) {
  cuda::compact_state(be, data, stride_layer, stride_head, sel);
}

// `out` is a device score view [L][Hkv][T]; see cuda/window_attention.hpp.
template <Element T>
std::size_t window_attention_workspace_bytes(const cuda_backend&, const KVView<const T>& keys,
                                             const KVView<const T>& queries) {
  return cuda::window_attention_workspace_bytes(keys, queries, queries.tokens);
}
template <Element T>
void window_attention(const cuda_backend& be, const KVView<const T>& keys,
                      const KVView<const T>& queries, GqaReduce reduce,
                      const cuda::MutableScoreView& out) {
  cuda::window_attention(be, keys, queries, reduce, queries.tokens, out);
}

#endif  // KVPOLICY_WITH_CUDA

}  // namespace kvpolicy::ops

namespace kvpolicy {

// Backend: what code written against ops:: needs of a backend value (tests/agreement's
// select_and_compact is one): its kind, the score and selection types it works on
// (ops::backend_traits), a workspace query for the selection, the selection itself, and the
// in-place compaction of a cache by a selection. cpu_backend models it; cuda_backend does in a
// build with KVPOLICY_WITH_CUDA. A backend's stages (scorers, allocators) are overloads on it as
// well (cuda/policy.hpp detects them per stage), which a concept cannot list.
template <class B>
concept Backend = std::is_trivially_copyable_v<B> &&
    requires {
      { B::kind } -> std::convertible_to<BackendKind>;
      typename ops::backend_traits<B>::scores;
      typename ops::backend_traits<B>::selection;
    } &&
    requires(const B be, const ops::scores_t<B>& scores, std::span<const std::int64_t> budgets,
             Protect p, ops::selection_t<B>& out, const KVView<float>& kv) {
      { ops::select_workspace_bytes(be, std::int64_t{}, std::int64_t{}) }
          -> std::convertible_to<std::size_t>;
      ops::select(be, scores, budgets, p, out);
      ops::compact(be, kv, std::as_const(out));
    };

static_assert(Backend<cpu_backend>);
#if defined(KVPOLICY_WITH_CUDA)
static_assert(Backend<cuda_backend>);
#endif

}  // namespace kvpolicy
