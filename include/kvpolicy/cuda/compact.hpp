// CUDA gather-compact, in place: the device twin of cpu/compact.hpp (same contract, bit-exact).
// Host wrappers over launch.hpp that check their arguments and throw kvpolicy::Error; the work
// is enqueued on the backend's stream. Kernel and in-place strategy: cuda/compact.cu.
#pragma once
#include <type_traits>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/cuda/launch.hpp"

namespace kvpolicy::cuda {

template <class T>
RowsView rows_view(const KVView<T>& kv) {
  return {const_cast<std::remove_const_t<T>*>(kv.data),
          static_cast<int>(sizeof(T)),
          kv.layers,
          kv.heads,
          kv.tokens,
          kv.dim,
          kv.stride_layer,
          kv.stride_head,
          kv.stride_token,
          kv.stride_dim};
}

inline void require_selection_shape(const CsrSelection& sel, std::int64_t layers,
                                    std::int64_t heads, const char* op) {
  KVP_REQUIRE(sel.layers == layers && sel.heads == heads, op, ": selection is [", sel.layers, ",",
              sel.heads, "] but the cache has [", layers, ",", heads, "] layers x heads");
  KVP_REQUIRE(sel.rows() == 0 || (sel.offsets && sel.indices), op,
              ": selection has null offsets or indices");
}

template <Element T>
std::size_t compact_workspace_bytes(const KVView<T>& kv) {
  return compact_workspace_bytes(rows_view(kv));
}

// `kv` points to device memory; `sel` is a device CSR selection over the same (layer, head) rows.
template <Element T>
void compact(const cuda_backend& be, const KVView<T>& kv, const CsrSelection& sel) {
  static_assert(!std::is_const_v<T>, "compact writes the cache: pass a mutable view");
  validate(kv, "compact: cache");
  require_selection_shape(sel, kv.layers, kv.heads, "compact");
  if (kv.tokens == 0) return;  // nothing to move (and the data pointer may be null)
  throw_if_error(compact_rows(be, rows_view(kv), sel), "cuda::compact");
}

// Per-token state [layer][head][token] (device memory, tokens contiguous), compacted with the
// cache like cpu::compact_state.
template <class S>
void compact_state(const cuda_backend& be, S* data, std::int64_t stride_layer,
                   std::int64_t stride_head, const CsrSelection& sel) {
  static_assert(std::is_trivially_copyable_v<S> && !std::is_const_v<S>,
                "compact_state moves trivially copyable per-token values in place");
  static_assert(sizeof(S) == 1 || sizeof(S) == 2 || sizeof(S) == 4 || sizeof(S) == 8 ||
                    sizeof(S) == 16,
                "compact_state supports 1, 2, 4, 8 or 16-byte values");
  require_selection_shape(sel, sel.layers, sel.heads, "compact_state");
  KVP_REQUIRE(stride_layer >= 0 && stride_head >= 0, "compact_state: negative stride (layer ",
              stride_layer, ", head ", stride_head, ")");
  RowsView v{data, static_cast<int>(sizeof(S)), sel.layers, sel.heads, 0, 1,
             stride_layer, stride_head, 1, 1};
  throw_if_error(compact_rows(be, v, sel), "cuda::compact_state");
}

}  // namespace kvpolicy::cuda
