// PyramidKV (Cai et al. 2024): lower layers keep more tokens, higher layers fewer, in a linear
// schedule whose mean over the layers is the uniform budget. The schedule is kvpress's
// PyramidKVPress (after KVCache-Factory), see shared/algorithms.md. With B the per-head budget
// (protected tokens included), W the window and L the model's layers:
//   min = B / beta, max = 2B - min; if max >= T - W: max = T - W, min = 2B - max;
//   unless T >= max >= min >= W (then every layer keeps B, kvpress's fallback),
//   layer l keeps round(max - l (max - min) / (L - 1)) tokens.
// Facts and choices the sources leave open:
// - B and the schedule count every kept token, window included: in kvpress, cap = W + B is its
//   max_capacity_prompt with B = T (1 - compression_ratio), and the layer value is the n_kept it
//   passes to top-k (algorithms.md's "non-window tokens" reads it otherwise; the numbers here
//   are kvpress's).
// - Rounding: kvpress rounds each layer on its own (half to even), so its layer sum can miss
//   L*B by a few tokens. Here the rounded values are corrected one token at a time (to the layers
//   whose rounding lost the most) so that they sum to L*B exactly; when kvpress's numbers already
//   sum to L*B they are returned unchanged. (With an integer B they do, floating-point ties
//   aside: layers l and L-1-l add up to 2B, and half-to-even rounds such a pair to 2B.
//   Corrections happen for a fractional mean B or when the protected floor clips.) No layer goes
//   below the protected tokens or above T.
// - The fallback matters in practice: min >= W needs B >= beta * W, i.e. 1280 tokens per head
//   with kvpress's beta 20 and W 64; below that every layer keeps B (uniform), as in kvpress.
// - W defaults to the tokens the scorer and the other stages protect (sinks + recent: snapkv's
//   window, 64 in kvpress); window=N sets it. beta defaults to 20 (kvpress), must be >= 1.
// - A one-layer model (kvpress divides by L - 1 = 0) keeps B.
// - Each KV head is split on its own: a head's rows over the event's layers are averaged into B.
//   Events that hold one layer of the model (Session) pass EventInfo{layer, model_layers}; see
//   alloc::split_across_layers for what is conserved then.
#pragma once
#include <span>
#include <vector>

#include "kvpolicy/allocators/common.hpp"
#include "kvpolicy/core/params.hpp"

namespace kvpolicy {

struct Pyramid {
  static constexpr std::string_view name = "pyramid";
  static constexpr AllocLevel level = AllocLevel::layers;
  double beta = 20.0;
  std::int64_t window = -1;  // -1: the protected tokens of the chain

  void validate() const {
    KVP_REQUIRE(std::isfinite(beta) && beta >= 1.0, "pyramid: beta must be >= 1, got ", beta);
    KVP_REQUIRE(window >= -1, "pyramid: window must be >= 0 (or -1 for the protected tokens), got ",
                window);
  }
  static Pyramid from_params(Params& p) {
    Pyramid s;
    s.beta = p.get_double("beta", s.beta);
    s.window = p.get_int("window", s.window);
    s.validate();
    return s;
  }

  // kvpress's per-layer budgets (before rounding) for per-head budget B over `layers` layers of
  // T tokens with window W. They sum to layers * B.
  std::vector<double> schedule(double B, std::int64_t layers, std::int64_t T,
                               std::int64_t W) const {
    std::vector<double> y(static_cast<std::size_t>(layers), B);
    if (layers < 2) return y;
    const double t = static_cast<double>(T), w = static_cast<double>(W);
    double mn = B / beta, mx = 2 * B - mn;
    if (mx >= t - w) {
      mx = t - w;
      mn = 2 * B - mx;
    }
    if (!(t >= mx && mx >= mn && mn >= w)) return y;
    const double steps = (mx - mn) / static_cast<double>(layers - 1);
    for (std::int64_t l = 0; l < layers; ++l)
      y[static_cast<std::size_t>(l)] = mx - static_cast<double>(l) * steps;
    return y;
  }

  void allocate(const AllocContext& ctx, std::span<std::int64_t> budgets) const {
    validate();
    const std::int64_t W = window >= 0 ? window : ctx.min_keep();
    alloc::split_across_layers(ctx, budgets, name, ctx.min_keep(), [&](double B) {
      return schedule(B, ctx.model_layers, ctx.tokens, W);
    });
  }
};

}  // namespace kvpolicy
