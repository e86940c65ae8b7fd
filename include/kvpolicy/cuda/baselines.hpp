// CUDA baseline scorers (KNorm, KeyDiff, TOVA, StreamingLLM) and the Ada-KV / PyramidKV budgets
// and AMS segment quotas on the device: the device twins of scorers/{knorm,keydiff,tova,
// streaming}.hpp and allocators/{adakv,pyramid,ams}.hpp (same ScoreMap contents, same budgets). Host wrappers over
// baseline_launch.hpp that check their arguments and throw kvpolicy::Error; work is enqueued on
// the backend's stream and uses its caller-owned workspace (two-phase: size it with the
// *_workspace_bytes query first). Kernels: cuda/baselines.cu.
#pragma once
#include <span>
#include <vector>

#include "kvpolicy/allocators/adakv.hpp"
#include "kvpolicy/allocators/ams.hpp"
#include "kvpolicy/allocators/pyramid.hpp"
#include "kvpolicy/cuda/ams.hpp"
#include "kvpolicy/cuda/baseline_launch.hpp"
#include "kvpolicy/cuda/runtime.hpp"
#include "kvpolicy/cuda/window_attention.hpp"
#include "kvpolicy/scorers/keydiff.hpp"
#include "kvpolicy/scorers/knorm.hpp"
#include "kvpolicy/scorers/kvzip.hpp"
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

// ---- KVzip ----------------------------------------------------------------------------------

template <Element T>
std::size_t score_workspace_bytes(const KVzip&, const Inputs<T>&) {
  return 0;
}

// KVzip::score: the context-reconstruction scores the engine's pass computed (in.reconstruction,
// device memory, [L][Hkv] rows of in.state_row_stride() floats), copied into `out` (a
// device-to-device copy on the stream). The pass itself is the engine's (scorers/kvzip.hpp).
template <Element T>
void score(const cuda_backend& be, const KVzip& s, const Inputs<T>& in,
           const MutableScoreView& out) {
  s.validate();
  KVP_REQUIRE(in.reconstruction != nullptr,
              "kvzip: needs context-reconstruction scores (Inputs::reconstruction, device memory "
              "on the CUDA path) from the engine's reconstruction pass");
  KVP_REQUIRE(out.layers == in.layers() && out.heads == in.kv_heads() &&
                  out.tokens == in.tokens() && out.row_stride >= out.tokens &&
                  (out.data || out.layers * out.heads * out.tokens == 0),
              "cuda::score(kvzip): output score view must be non-null [", in.layers(), ",",
              in.kv_heads(), ",", in.tokens(), "] with row_stride >= tokens");
  throw_if_error(copy_score_rows(be, in.reconstruction, in.state_row_stride(), out),
                 "cuda::score(kvzip)");
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

// ---- AMS ------------------------------------------------------------------------------------

namespace detail {
// The AMS step's part of the workspace: the window attention and its scratch, the two mass
// arrays, the per-row budgets of the unprotected tokens, the segments and quotas, their scratch.
struct AmsLayout {
  std::int64_t window = 0, attn_stride = 0, begin = 0, end = 0, cap = 0;
  std::size_t wa_at = 0, m_cur_at = 0, mass_at = 0, budgets_at = 0, segments_at = 0,
              seg_begin_at = 0, seg_end_at = 0, quota_at = 0, rows_at = 0, total = 0;
};

template <Element E>
AmsLayout ams_layout(const AMS& a, const Inputs<E>& in, Protect p) {
  a.validate();
  KVP_REQUIRE(in.queries.data && in.queries.tokens > 0, "ams: needs the last ", a.window,
              " queries (window attention) but none were given");
  const auto up = [](std::size_t n) { return (n + 255) / 256 * 256; };
  const std::int64_t rows = in.layers() * in.kv_heads(), Tk = in.tokens();
  AmsLayout l;
  l.window = std::min(a.window, in.queries.tokens);
  l.attn_stride = (Tk + 3) / 4 * 4;
  l.begin = std::min(std::max<std::int64_t>(p.sinks, 0), Tk);
  l.end = std::max(l.begin, Tk - std::max<std::int64_t>(p.recent, 0));
  l.cap = l.end - l.begin + 1;
  const auto n = static_cast<std::size_t>(rows);
  const auto per_token = static_cast<std::size_t>(rows * Tk);
  const auto per_seg = static_cast<std::size_t>(rows * l.cap) * sizeof(std::int64_t);
  std::size_t at = up(static_cast<std::size_t>(rows * l.attn_stride) * sizeof(float));
  l.wa_at = at;
  at += up(window_attention_workspace_bytes(in.keys, in.queries, l.window));
  l.m_cur_at = at;
  at += up(per_token * sizeof(double));
  l.mass_at = at;
  at += up(per_token * sizeof(double));
  l.budgets_at = at;
  at += up(n * sizeof(std::int64_t));
  l.segments_at = at;
  at += up(n * sizeof(std::int64_t));
  l.seg_begin_at = at;
  at += up(per_seg);
  l.seg_end_at = at;
  at += up(per_seg);
  l.quota_at = at;
  at += up(per_seg);
  l.rows_at = at;
  at += up(ams_rows_workspace_bytes(rows, l.begin, l.end));
  l.total = at;
  return l;
}
}  // namespace detail

// Workspace of cuda::allocate(be, const AMS&, ...) for these inputs and the chain's protection.
template <Element E>
std::size_t allocate_workspace_bytes(const AMS& a, const Inputs<E>& in, Protect p) {
  return detail::ams_layout(a, in, p).total;
}

// AMS::allocate on the device, as a chain step after the scorer and the head-level allocators:
// the GQA-mean window attention of the last min(window, queries) queries of `in` (device views),
// the mass with the credit `state` ([L * H][state_stride] floats, device, updated in place; null
// for a first event: every credit 0), the segments and quotas, and the candidates' mask written
// into `scores` (AMS::allocate's). `device_budgets` holds each row's budget (device; rows with a
// budget >= tokens are left as they are); `p` is the chain's protection (AllocContext::protect,
// which includes AMS's sinks and keep_last). A budget below the protected count cannot be checked
// on the device: the caller checks it (the device policy runner checks the host budgets, and
// adakv keeps its budgets at or above it). The window attention's launches, then three kernels;
// no host synchronisation. The window attention equals the CPU's to fp32 rounding (summation
// order, exp), so masses and credits equal the CPU's to about 1e-7 relative, not bitwise, and
// kept sets can differ where a cut or a quota sits on a rounding edge.
template <Element E>
void allocate(const cuda_backend& be, const AMS& a, const Inputs<E>& in,
              const MutableScoreView& scores, const std::int64_t* device_budgets, Protect p,
              float* state, std::int64_t state_stride) {
  const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens(), rows = L * H;
  const detail::AmsLayout l = detail::ams_layout(a, in, p);
  KVP_REQUIRE(scores.layers == L && scores.heads == H && scores.tokens == Tk &&
                  scores.row_stride >= Tk && (rows * Tk == 0 || scores.data),
              "cuda::allocate(ams): score view must be non-null [", L, ",", H, ",", Tk,
              "] with row_stride >= tokens");
  KVP_REQUIRE(rows == 0 || device_budgets, "cuda::allocate(ams): null budgets pointer");
  KVP_REQUIRE(!state || state_stride >= Tk, "cuda::allocate(ams): state_stride ", state_stride,
              " is below the ", Tk, " tokens");
  KVP_REQUIRE(be.workspace_bytes >= l.total && (l.total == 0 || be.workspace),
              "cuda::allocate(ams): workspace of ", be.workspace_bytes, " bytes is below the ",
              l.total, " it needs (allocate_workspace_bytes)");
  KVP_REQUIRE(reinterpret_cast<std::uintptr_t>(be.workspace) % 256 == 0,
              "cuda::allocate(ams): the workspace must be 256-byte aligned");
  if (rows == 0 || Tk == 0) return;
  auto* base = static_cast<std::byte*>(be.workspace);
  const auto at = [&](std::size_t off) { return base + off; };
  float* attn = reinterpret_cast<float*>(base);
  const cuda_backend wa_be{be.stream, at(l.wa_at), l.m_cur_at - l.wa_at};
  window_attention(wa_be, in.keys, in.queries, GqaReduce::mean, l.window,
                   MutableScoreView{attn, L, H, Tk, l.attn_stride});
  auto* mass = reinterpret_cast<double*>(at(l.mass_at));
  auto* unprotected = reinterpret_cast<std::int64_t*>(at(l.budgets_at));
  const AmsMass m{.attn = attn,
                  .rows = rows,
                  .tokens = Tk,
                  .attn_stride = l.attn_stride,
                  .window = l.window,
                  .state = state,
                  .state_stride = state ? state_stride : 0,
                  .budgets = device_budgets,
                  .n_protected = l.begin + (Tk - l.end),
                  .m_cur = reinterpret_cast<double*>(at(l.m_cur_at)),
                  .mass = mass,
                  .unprotected_budgets = unprotected};
  throw_if_error(ams_mass(be, m, AmsMassParams{a.kernel, a.lambda, a.beta}),
                 "cuda::allocate(ams)");
  const AmsRows r{.mass = mass,
                  .rows = rows,
                  .tokens = Tk,
                  .mass_stride = Tk,
                  .begin = l.begin,
                  .end = l.end,
                  .budgets = unprotected,
                  .segments = reinterpret_cast<std::int64_t*>(at(l.segments_at)),
                  .seg_begin = reinterpret_cast<std::int64_t*>(at(l.seg_begin_at)),
                  .seg_end = reinterpret_cast<std::int64_t*>(at(l.seg_end_at)),
                  .quota = reinterpret_cast<std::int64_t*>(at(l.quota_at))};
  const cuda_backend rows_be{be.stream, at(l.rows_at), l.total - l.rows_at};
  throw_if_error(ams_segment_quotas(rows_be, r,
                                    ams::rows::Params{a.segment_mass, a.min_seg_len,
                                                      a.max_seg_len, a.min_keep}),
                 "cuda::allocate(ams)");
  const AmsMark k{scores.data, rows, Tk, scores.row_stride, r.segments, r.seg_begin, r.seg_end,
                  r.quota, l.cap};
  throw_if_error(ams_mark(be, k), "cuda::allocate(ams)");
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
