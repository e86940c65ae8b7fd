// CUDA window-attention scoring: the device twin of cpu/window_attention.hpp and of the SnapKV
// and H2O scorers' query paths (same ScoreMap content, written into a device score view). Host
// wrappers over score_launch.hpp that check their arguments and throw kvpolicy::Error; work is
// enqueued on the backend's stream and uses its caller-owned workspace (two-phase: size it with
// the *_workspace_bytes query first). Kernels: cuda/window_attention.cu.
#pragma once
#include <type_traits>

#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/scorers/snapkv_row.hpp"
#include "kvpolicy/cuda/score_launch.hpp"
#include "kvpolicy/cuda/tensor_view.hpp"
#include "kvpolicy/scorers/h2o.hpp"
#include "kvpolicy/scorers/snapkv.hpp"

namespace kvpolicy::cuda {


namespace detail {
template <Element T>
void require_score_args(const cuda_backend& be, const KVView<const T>& keys,
                        const KVView<const T>& queries, std::int64_t nq,
                        const MutableScoreView& out, const char* op) {
  validate(keys, "keys");
  validate(queries, "queries");
  KVP_REQUIRE(keys.layers > 0 && keys.heads > 0 && keys.tokens > 0 && keys.dim > 0, op,
              ": empty keys");
  KVP_REQUIRE(queries.layers == keys.layers, op, ": queries have ", queries.layers,
              " layers but keys have ", keys.layers);
  KVP_REQUIRE(queries.heads % keys.heads == 0, op, ": ", queries.heads,
              " query heads are not a multiple of ", keys.heads, " KV heads");
  KVP_REQUIRE(queries.dim == keys.dim, op, ": query head_dim ", queries.dim,
              " != key head_dim ", keys.dim);
  KVP_REQUIRE(nq >= 1 && nq <= keys.tokens && nq <= queries.tokens, op, ": need 1..",
              std::min(keys.tokens, queries.tokens), " queries, got ", nq);
  KVP_REQUIRE(keys.dim <= 256, op, ": head_dim ", keys.dim, " above 256 is not supported");
  require_score_output(be, keys, out, op);
}

// `bytes` by reference: callers pass the variable that the query call in the same argument list
// fills (bytes_or_throw(query(..., b), b, op)), and the order in which a call's arguments are
// evaluated is unspecified (GCC evaluates right to left: a by-value `bytes` read 0 there, and
// every device workspace sized through it was 1 byte).
inline std::size_t bytes_or_throw(Status s, const std::size_t& bytes, const char* op) {
  throw_if_error(s, op);
  return bytes;
}
}  // namespace detail

// ---- window attention -----------------------------------------------------------------------

template <Element T>
std::size_t window_attention_workspace_bytes(const KVView<const T>& keys,
                                             const KVView<const T>& queries, std::int64_t nq) {
  std::size_t b = 0;
  return detail::bytes_or_throw(
      window_attention_workspace_bytes(erase(keys), erase(queries), nq, b), b,
      "cuda::window_attention_workspace_bytes");
}

// Column sums of the causal softmax of the last `nq` of `queries` over `keys`, GQA-reduced, into
// `out` [L][Hkv][T] (device memory): what cpu::window_attention computes.
template <Element T>
void window_attention(const cuda_backend& be, const KVView<const T>& keys,
                      const KVView<const T>& queries, GqaReduce reduce, std::int64_t nq,
                      const MutableScoreView& out) {
  detail::require_score_args(be, keys, queries, nq, out, "cuda::window_attention");
  throw_if_error(window_attention(be, erase(keys), erase(queries), reduce, nq, out),
                 "cuda::window_attention");
}

// ---- SnapKV / H2O scores from queries -------------------------------------------------------

template <Element T>
std::size_t score_workspace_bytes(const SnapKV& s, const Inputs<T>& in) {
  std::size_t b = 0;
  return detail::bytes_or_throw(snapkv_workspace_bytes(erase(in.keys), erase(in.queries),
                                                       s, b),
                                b, "cuda::score_workspace_bytes(snapkv)");
}

// SnapKV::score on device views: pooled window attention of the last min(window, T) queries,
// FLT_MAX on the window's own tokens.
template <Element T>
void score(const cuda_backend& be, const SnapKV& s, const Inputs<T>& in,
           const MutableScoreView& out) {
  s.validate();
  const std::int64_t w = std::min(s.window, in.tokens());
  KVP_REQUIRE(in.queries.data && in.queries.tokens >= w, "snapkv: needs the last ", w,
              " queries, got ", in.queries.tokens);
  detail::require_score_args(be, in.keys, in.queries, w, out, "cuda::score(snapkv)");
  throw_if_error(
      snapkv_score(be, erase(in.keys), erase(in.queries), s, out),
      "cuda::score(snapkv)");
}

template <Element T>
std::size_t score_workspace_bytes(const H2O&, const Inputs<T>& in) {
  if (in.accumulated) return 0;
  std::size_t b = 0;
  return detail::bytes_or_throw(
      h2o_workspace_bytes(erase(in.keys), erase(in.queries), b), b,
      "cuda::score_workspace_bytes(h2o)");
}

// H2O::score: from given state (in.accumulated / in.observed, device memory) when present, else
// from all given queries (column sums, divided by the number of observing queries when
// normalize). No workspace on the state path.
template <Element T>
void score(const cuda_backend& be, const H2O& s, const Inputs<T>& in,
           const MutableScoreView& out) {
  s.validate();
  if (in.accumulated) {
    KVP_REQUIRE(!s.normalize || in.observed, "h2o: normalize=true with given accumulators "
                                             "also needs the observed-query counts");
    KVP_REQUIRE(out.data && out.layers == in.layers() && out.heads == in.kv_heads() &&
                    out.tokens == in.tokens() && out.row_stride >= out.tokens,
                "cuda::score(h2o): output score view must be non-null [", in.layers(), ",",
                in.kv_heads(), ",", in.tokens(), "] with row_stride >= tokens");
    throw_if_error(h2o_score_from_state(be, in.accumulated, in.observed, in.state_row_stride(), s,
                                        out),
                   "cuda::score(h2o)");
    return;
  }
  KVP_REQUIRE(in.queries.data && in.queries.tokens > 0,
              "h2o: needs accumulated attention or the queries to compute it");
  detail::require_score_args(be, in.keys, in.queries, in.queries.tokens, out,
                             "cuda::score(h2o)");
  throw_if_error(h2o_score(be, erase(in.keys), erase(in.queries), s, out),
                 "cuda::score(h2o)");
}

}  // namespace kvpolicy::cuda
