// CUDA baseline scorers (KNorm, KeyDiff, TOVA, StreamingLLM) and Ada-KV / PyramidKV head budgets
// on the device: the device twins of scorers/{knorm,keydiff,tova,streaming}.hpp and
// allocators/{adakv,pyramid}.hpp (same ScoreMap contents, same budgets). Host wrappers over
// baseline_launch.hpp that check their arguments and throw kvpolicy::Error; work is enqueued on
// the backend's stream and uses its caller-owned workspace (two-phase: size it with the
// *_workspace_bytes query first). Kernels: cuda/baselines.cu.
#pragma once
#include <span>
#include <vector>

#include "kvpolicy/allocators/adakv.hpp"
#include "kvpolicy/allocators/pyramid.hpp"
#include "kvpolicy/cuda/baseline_launch.hpp"
#include "kvpolicy/cuda/runtime.hpp"
#include "kvpolicy/cuda/window_attention.hpp"
#include "kvpolicy/scorers/keydiff.hpp"
#include "kvpolicy/scorers/knorm.hpp"
#include "kvpolicy/scorers/streaming.hpp"
#include "kvpolicy/scorers/tova.hpp"

namespace kvpolicy::cuda {

namespace detail {
template <Element T>
void require_key_args(const cuda_backend& be, const KVView<const T>& keys,
                      const MutableScoreView& out, const char* op) {
  validate(keys, "keys");
  KVP_REQUIRE(keys.data && keys.layers > 0 && keys.heads > 0 && keys.tokens > 0 && keys.dim > 0,
              op, ": empty keys");
  require_score_output(be, keys, out, op);
}
}  // namespace detail

// ---- KNorm ----------------------------------------------------------------------------------

template <Element T>
std::size_t score_workspace_bytes(const KNorm&, const Inputs<T>&) {
  return 0;
}

// KNorm::score: -||k_j|| (fp32 sum of squares). No workspace.
template <Element T>
void score(const cuda_backend& be, const KNorm&, const Inputs<T>& in, const MutableScoreView& out) {
  detail::require_key_args(be, in.keys, out, "cuda::score(knorm)");
  throw_if_error(knorm_score(be, erase(in.keys), out), "cuda::score(knorm)");
}

// ---- KeyDiff --------------------------------------------------------------------------------

template <Element T>
std::size_t score_workspace_bytes(const KeyDiff&, const Inputs<T>& in) {
  std::size_t b = 0;
  return detail::bytes_or_throw(keydiff_workspace_bytes(erase(in.keys), b), b,
                                "cuda::score_workspace_bytes(keydiff)");
}

// KeyDiff::score: -cos(k_j, mean of the head's normalised keys), double like the CPU scorer.
template <Element T>
void score(const cuda_backend& be, const KeyDiff&, const Inputs<T>& in,
           const MutableScoreView& out) {
  detail::require_key_args(be, in.keys, out, "cuda::score(keydiff)");
  KVP_REQUIRE(in.keys.dim <= 1024, "cuda::score(keydiff): head_dim ", in.keys.dim,
              " above 1024 is not supported");
  KVP_REQUIRE(in.keys.layers * in.keys.heads <= 65535, "cuda::score(keydiff): ",
              in.keys.layers * in.keys.heads, " (layer, head) rows exceed a grid's y extent");
  throw_if_error(keydiff_score(be, erase(in.keys), out), "cuda::score(keydiff)");
}

// ---- TOVA -----------------------------------------------------------------------------------

template <Element T>
std::size_t score_workspace_bytes(const TOVA&, const Inputs<T>& in) {
  std::size_t b = 0;
  return detail::bytes_or_throw(
      tova_workspace_bytes(erase(in.keys), erase(in.queries), b), b,
      "cuda::score_workspace_bytes(tova)");
}

// TOVA::score: attention of the last query (GQA mean), averaged over the layer's KV heads; every
// head of a layer gets the same row.
template <Element T>
void score(const cuda_backend& be, const TOVA&, const Inputs<T>& in, const MutableScoreView& out) {
  KVP_REQUIRE(in.queries.data && in.queries.tokens >= 1, "tova: needs the last query");
  detail::require_score_args(be, in.keys, in.queries, 1, out, "cuda::score(tova)");
  throw_if_error(tova_score(be, erase(in.keys), erase(in.queries), out),
                 "cuda::score(tova)");
}

// ---- StreamingLLM ---------------------------------------------------------------------------

template <Element T>
std::size_t score_workspace_bytes(const Streaming&, const Inputs<T>&) {
  return 0;
}

// Streaming::score: the position j. Reads no key data (only the shape).
template <Element T>
void score(const cuda_backend& be, const Streaming&, const Inputs<T>& in,
           const MutableScoreView& out) {
  KVP_REQUIRE(out.layers == in.layers() && out.heads == in.kv_heads() &&
                  out.tokens == in.tokens() && out.row_stride >= out.tokens &&
                  (out.data || out.layers * out.heads * out.tokens == 0),
              "cuda::score(streaming): output score view must be non-null [", in.layers(), ",",
              in.kv_heads(), ",", in.tokens(), "] with row_stride >= tokens");
  throw_if_error(streaming_score(be, out), "cuda::score(streaming)");
}

// ---- Ada-KV ---------------------------------------------------------------------------------

inline std::size_t allocate_workspace_bytes(const AdaKV&, const ScoreView& s, Protect p) {
  std::size_t b = 0;
  return detail::bytes_or_throw(
      adakv_workspace_bytes(s.layers, s.heads, s.tokens, p.sinks, p.recent, b), b,
      "cuda::allocate_workspace_bytes(adakv)");
}

namespace detail {
inline void require_adakv_args(const cuda_backend& be, const AdaKV& a, const ScoreView& s,
                               Protect p, const std::int64_t* out) {
  a.validate();
  KVP_REQUIRE(s.layers >= 0 && s.heads >= 0 && s.tokens >= 0, "adakv: negative score shape");
  KVP_REQUIRE(s.heads <= adakv_max_heads, "cuda adakv: ", s.heads, " heads exceed ",
              adakv_max_heads);
  KVP_REQUIRE(s.row_stride >= s.tokens, "adakv: score row stride ", s.row_stride,
              " is below the ", s.tokens, " tokens of a row");
  KVP_REQUIRE(s.rows() == 0 || s.tokens == 0 || s.data, "adakv: null score pointer");
  KVP_REQUIRE(s.rows() == 0 || out, "adakv: null output budgets pointer");
  KVP_REQUIRE(p.sinks >= 0 && p.recent >= 0, "adakv: negative protection");
  KVP_REQUIRE(be.workspace_bytes == 0 || be.workspace, "adakv: workspace_bytes is ",
              be.workspace_bytes, " but the workspace pointer is null");
}
}  // namespace detail

// AdaKV::allocate on the device with host budgets (checked like the CPU allocator: each in
// [min(P, T), T]); the per-(layer, head) budgets land in `device_out` ([L * H] int64, device),
// ready for cuda::select(be, scores, device_out, p, ...). `p` is the chain's protection
// (AllocContext::protect).
inline void allocate(const cuda_backend& be, const AdaKV& a, const ScoreView& scores,
                     std::span<const std::int64_t> budgets, Protect p, std::int64_t* device_out) {
  detail::require_adakv_args(be, a, scores, p, device_out);
  KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == scores.rows(), "adakv: ",
              budgets.size(), " budgets for ", scores.rows(), " (layer, head) rows");
  const std::int64_t T = scores.tokens, P = p.total(T);
  for (std::int64_t b : budgets)
    KVP_REQUIRE(b >= std::min(P, T) && b <= T, "adakv: budget ", b, " is outside [",
                std::min(P, T), ", ", T, "]");
  throw_if_error(adakv_budgets(be, scores, budgets.data(), BudgetsAt::host, p.sinks, p.recent,
                               a.alpha, device_out),
                 "cuda::allocate(adakv)");
}

// Same with the input budgets on the device (a previous stage ran there; may equal device_out).
// They cannot be checked without a copy: each is clamped to [P, T] (P = protected count).
inline void allocate(const cuda_backend& be, const AdaKV& a, const ScoreView& scores,
                     const std::int64_t* device_budgets, Protect p, std::int64_t* device_out) {
  detail::require_adakv_args(be, a, scores, p, device_out);
  KVP_REQUIRE(scores.rows() == 0 || device_budgets, "adakv: null budgets pointer");
  throw_if_error(adakv_budgets(be, scores, device_budgets, BudgetsAt::device, p.sinks, p.recent,
                               a.alpha, device_out),
                 "cuda::allocate(adakv)");
}

// ---- PyramidKV ------------------------------------------------------------------------------

// Pyramid::allocate's budgets are host arithmetic of the shapes (the scores are never read), so
// there is no kernel: this thin wrapper runs the CPU allocator on `budgets` (host, [L * H],
// updated in place) and copies the result to `device_out` on the backend's stream (blocking
// until the copy is done), so a device chain `pyramid | adakv` can continue there.
inline void allocate(const cuda_backend& be, const Pyramid& a, std::int64_t layers,
                     std::int64_t heads, std::int64_t tokens, Protect p,
                     std::int64_t first_layer, std::int64_t model_layers,
                     std::span<std::int64_t> budgets, std::int64_t* device_out) {
  KVP_REQUIRE(layers >= 0 && heads >= 0 && tokens >= 0, "pyramid: negative shape");
  KVP_REQUIRE(layers * heads == 0 || device_out, "pyramid: null output budgets pointer");
  ScoreMap shape(layers, heads, 0);  // the allocator reads the shape only
  AllocContext ctx;
  ctx.scores = &shape;
  ctx.tokens = tokens;
  ctx.protect = p;
  ctx.first_layer = first_layer;
  ctx.model_layers = model_layers;
  a.allocate(ctx, budgets);
  copy_to_device(device_out, budgets.data(), budgets.size() * sizeof(std::int64_t), be.stream);
}

}  // namespace kvpolicy::cuda
