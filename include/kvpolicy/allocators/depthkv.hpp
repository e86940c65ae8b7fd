// DepthKV: the global budget is split across layers by each layer's sensitivity to pruning,
// measured offline per model (shared/algorithms.md; only the abstract is public, the rules below
// are ours). Two rules:
// - proportional (algorithms.md): B_l = clip(L B s_l / sum(s), B_min, T), the clipped excess
//   redistributed so sum B_l = L B; s_l is the profile's "sensitivity", one loss per layer
//   measured at one budget.
// - marginal (the default when the profile has loss curves, rule=marginal): the profile holds
//   per layer the loss f_l(r) measured with that layer alone kept at fractions r_1 < ... < r_K
//   (kvpolicy_calibrate --budgets), and f_l(1) = 0. The budgets minimize sum_l f_l(B_l / T)
//   under sum B_l = L B, with f_l the lower convex hull of the measured points, linear between
//   them: every layer first gets max(r_1 T, B_min) (below the lowest measured fraction the
//   curves say nothing, so the layers share equally: a mean budget under it is split uniformly),
//   then the rest goes to the hull segments with the steepest loss decrease per token first
//   (segments of equal slope share in proportion to their lengths). When B_min is above r_1 T,
//   the curve starts at (B_min, f_l(B_min)), interpolated between the measured points, and the
//   points below B_min are dropped before the hull is taken. This is exact for
//   piecewise-linear convex losses that add up over layers; the losses of layers compressed
//   together do not add up exactly, which is why the rule is checked on held-out text (README).
//   Why it exists: one loss per layer at one budget (the proportional rule) starves layers whose
//   loss at that budget happens to be small, and at a lower mean budget they fall below the
//   point where their own loss rises steeply (measured: README, "DepthKV revisited").
// Choices the sources leave open:
// - Proportional rule: redistribution is water-filling: B_l = clip(c s_l, B_min, T) with the one
//   scale c that makes them sum to L B, i.e. what a clipped layer gives up (or is owed) goes to
//   the unclipped ones in proportion to their sensitivity. A profile of all zeros splits
//   uniformly. Both rules then round with alloc::round_to_total (exact sum, bounds kept).
// - B_min defaults to the tokens the chain protects (no layer can keep fewer); min_tokens=N
//   raises it (never below the protected count).
// - The profile (allocators/profile.hpp) must list exactly the model's layers: events carry the
//   model's layer count (EventInfo::model_layers; the event's own layers when absent).
// - Spec: depthkv(profile=path.json) reads the file when the policy is built; weights=a:b:c gives
//   the values inline (colon-separated, for tests and quick experiments). One of them is required.
// - Proportional rule: power=p (default 1) splits in proportion to s_l^p: p < 1 tempers a
//   profile whose values span orders of magnitude (the first SmolLM2 profile, snapkv-0.2.json,
//   spans 115x, and the proportional rule then starves its least sensitive layers), p = 0 is
//   uniform.
// - Each KV head is split on its own (the curves are per layer, the same for every head); see
//   alloc::split_across_layers for what one-layer events conserve. The allocator holds the
//   profile in fixed arrays (kMaxLayers, kMaxKnots) so that it stays a trivially copyable value.
// - power applies to the proportional rule only; rule=marginal without loss curves (weights=, or
//   a profile without "curves") and power with rule=marginal are refused by name.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "kvpolicy/allocators/common.hpp"
#include "kvpolicy/allocators/profile.hpp"
#include "kvpolicy/core/params.hpp"

namespace kvpolicy {

struct DepthKV {
  static constexpr std::string_view name = "depthkv";
  static constexpr AllocLevel level = AllocLevel::layers;
  static constexpr std::int64_t kMaxLayers = 512;
  static constexpr std::int64_t kMaxKnots = 8;  // loss-curve points per layer
  enum class Rule { proportional, marginal };

  std::array<float, kMaxLayers> sensitivity{};
  std::int64_t layers = 0;       // entries of `sensitivity` in use
  std::int64_t min_tokens = -1;  // B_min; -1: the protected tokens
  double power = 1.0;            // budgets in proportion to sensitivity^power
  Rule rule = Rule::proportional;
  std::array<float, kMaxKnots> knots{};              // curve fractions, ascending in (0, 1)
  std::int64_t n_knots = 0;                          // 0: no loss curves
  std::array<float, kMaxLayers * kMaxKnots> loss{};  // loss[l * kMaxKnots + k] = f_l(knots[k])

  static DepthKV from_values(std::span<const double> s, const std::string& where) {
    KVP_REQUIRE(!s.empty(), "depthkv: ", where, " lists no layers");
    KVP_REQUIRE(static_cast<std::int64_t>(s.size()) <= kMaxLayers, "depthkv: ", where, " has ",
                s.size(), " layers; at most ", kMaxLayers, " are supported");
    DepthKV d;
    for (std::size_t l = 0; l < s.size(); ++l) {
      KVP_REQUIRE(std::isfinite(s[l]), "depthkv: ", where, ": sensitivity of layer ", l,
                  " is not finite");
      KVP_REQUIRE(s[l] >= 0, "depthkv: ", where, ": sensitivity of layer ", l,
                  " is negative (", s[l], ")");
      // Held as float: a larger finite double would become infinity.
      KVP_REQUIRE(s[l] <= std::numeric_limits<float>::max(), "depthkv: ", where,
                  ": sensitivity of layer ", l, " (", s[l], ") is above the float range");
      d.sensitivity[l] = static_cast<float>(s[l]);
    }
    d.layers = static_cast<std::int64_t>(s.size());
    return d;
  }
  // A number with `precision` significant digits (error messages about values that round).
  static std::string digits(double v, int precision) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.*g", precision, v);
    return buf;
  }
  static DepthKV from_profile(const LayerProfile& p, const std::string& where) {
    const std::string w = "profile '" + where + "'";
    DepthKV d = from_values(p.sensitivity, w);
    if (p.curve_budgets.empty()) return d;
    const auto K = static_cast<std::int64_t>(p.curve_budgets.size());
    KVP_REQUIRE(K <= kMaxKnots, "depthkv: ", w, " has loss curves at ", K,
                " budgets; at most ", kMaxKnots, " are supported");
    KVP_REQUIRE(p.curves.size() == p.sensitivity.size(), "depthkv: ", w, " has ",
                p.curves.size(), " loss curves for ", p.sensitivity.size(), " layers");
    for (std::int64_t k = 0; k < K; ++k) {
      const double b = p.curve_budgets[static_cast<std::size_t>(k)];
      const auto bf = static_cast<float>(b);  // held as float: must still ascend strictly
      const bool ascends = k == 0 || bf > d.knots[static_cast<std::size_t>(k - 1)];
      KVP_REQUIRE(bf > 0 && bf < 1 && ascends, "depthkv: ", w,
                  ": curve budgets must ascend strictly inside (0, 1) as floats (budget ", k,
                  " is ", digits(b, 17), ", as a float ", digits(bf, 9), ")");
      d.knots[static_cast<std::size_t>(k)] = bf;
    }
    for (std::size_t l = 0; l < p.curves.size(); ++l) {
      KVP_REQUIRE(static_cast<std::int64_t>(p.curves[l].size()) == K, "depthkv: ", w,
                  ": the loss curve of layer ", l, " has ", p.curves[l].size(), " points for ", K,
                  " budgets");
      for (std::int64_t k = 0; k < K; ++k) {
        const double v = p.curves[l][static_cast<std::size_t>(k)];
        KVP_REQUIRE(std::isfinite(v) && v >= 0 && v <= std::numeric_limits<float>::max(),
                    "depthkv: ", w, ": loss of layer ", l, " at budget ", k, " is ", v,
                    " (finite, >= 0 and in the float range)");
        d.loss[l * kMaxKnots + static_cast<std::size_t>(k)] = static_cast<float>(v);
      }
    }
    d.n_knots = K;
    d.rule = Rule::marginal;
    return d;
  }

  static DepthKV from_params(Params& p) {
    const std::string path = p.get_string("profile", ""), inline_w = p.get_string("weights", "");
    const std::int64_t min_tokens = p.get_int("min_tokens", -1);
    KVP_REQUIRE(path.empty() != inline_w.empty(),
                "depthkv: give exactly one of 'profile' (a JSON file) or 'weights' (a:b:c)");
    DepthKV d;
    if (!path.empty()) {
      d = from_profile(load_layer_profile(path), path);
    } else {
      std::vector<double> w;
      std::size_t start = 0;
      while (start <= inline_w.size()) {
        std::size_t colon = inline_w.find(':', start);
        if (colon == std::string::npos) colon = inline_w.size();
        const std::string item = inline_w.substr(start, colon - start);
        char* end = nullptr;
        const double v = std::strtod(item.c_str(), &end);
        KVP_REQUIRE(!item.empty() && end == item.c_str() + item.size(),
                    "depthkv: parameter 'weights' expects numbers separated by ':', got '",
                    inline_w, "'");
        w.push_back(v);
        start = colon + 1;
      }
      d = from_values(w, "parameter 'weights'");
    }
    d.min_tokens = min_tokens;
    const std::string rule = p.get_choice("rule", d.n_knots > 0 ? "marginal" : "proportional",
                                          {"marginal", "proportional"});
    d.rule = rule == "marginal" ? Rule::marginal : Rule::proportional;
    KVP_REQUIRE(d.rule == Rule::proportional || d.n_knots > 0,
                "depthkv: rule=marginal needs loss curves (a profile with \"curve_budgets\" and "
                "\"curves\", written by kvpolicy_calibrate --budgets)");
    KVP_REQUIRE(d.rule == Rule::proportional || !p.contains("power"),
                "depthkv: power applies to rule=proportional only (add rule=proportional to use "
                "it with a curve profile)");
    d.power = p.get_double("power", 1.0);
    KVP_REQUIRE(std::isfinite(d.power) && d.power >= 0, "depthkv: power must be >= 0, got ",
                d.power);
    KVP_REQUIRE(min_tokens >= -1, "depthkv: min_tokens must be >= 0 (or -1 for the protected "
                "tokens), got ", min_tokens);
    return d;
  }

  // Real per-layer budgets for mean budget B over the model's layers of T tokens, floor lo.
  std::vector<double> targets(double B, std::int64_t T, std::int64_t lo) const {
    if (rule == Rule::marginal) return marginal_targets(B, T, lo);
    const auto n = static_cast<std::size_t>(layers);
    std::vector<double> w(sensitivity.begin(), sensitivity.begin() + layers);
    if (power != 1.0)
      for (auto& x : w) x = std::pow(x, power);  // pow(0, 0) = 1: power 0 is uniform
    const std::vector<double> lo_v(n, static_cast<double>(std::min(lo, T))),
        hi_v(n, static_cast<double>(T));
    return alloc::water_fill(w, B * static_cast<double>(layers), lo_v, hi_v);
  }

  // The marginal rule (header comment): every layer from s0 = clamp(r_1 T, lo, T) along the
  // lower convex hull of its points (x, f_l(x)), x in tokens, steepest segments first.
  std::vector<double> marginal_targets(double B, std::int64_t T, std::int64_t lo) const {
    KVP_REQUIRE(n_knots > 0, "depthkv: rule=marginal needs loss curves");
    const auto n = static_cast<std::size_t>(layers);
    const double Td = static_cast<double>(T), lo_d = static_cast<double>(std::min(lo, T));
    const double s0 = std::clamp(static_cast<double>(knots[0]) * Td, lo_d, Td);
    if (B <= s0) return std::vector<double>(n, std::clamp(B, lo_d, Td));  // equal shares
    // Point k of a layer's curve in tokens; k = n_knots is (T, 0), the full cache.
    const auto x_at = [&](std::int64_t k) {
      return k < n_knots ? static_cast<double>(knots[static_cast<std::size_t>(k)]) * Td : Td;
    };
    struct Seg {
      double slope, length;
      std::size_t layer;
    };
    std::vector<Seg> segs;
    std::vector<double> px, py;
    for (std::size_t l = 0; l < n; ++l) {
      const float* f = &loss[l * kMaxKnots];
      const auto y_at = [&](std::int64_t k) {
        return k < n_knots ? static_cast<double>(f[k]) : 0.0;
      };
      // The loss at s0: linear between the measured points (s0 >= the first one).
      double y0 = y_at(0);
      for (std::int64_t k = 1; k <= n_knots; ++k)
        if (s0 > x_at(k - 1) && s0 <= x_at(k))
          y0 = y_at(k - 1) + (y_at(k) - y_at(k - 1)) * (s0 - x_at(k - 1)) / (x_at(k) - x_at(k - 1));
      px.assign(1, s0), py.assign(1, y0);
      for (std::int64_t k = 0; k <= n_knots; ++k) {
        const double x = x_at(k), y = y_at(k);
        if (x <= px.back()) continue;
        // Lower hull (monotone chain): drop the last point while it is on or above the chord.
        while (px.size() >= 2) {
          const std::size_t m = px.size();
          const double cross = (px[m - 1] - px[m - 2]) * (y - py[m - 2]) -
                               (py[m - 1] - py[m - 2]) * (x - px[m - 2]);
          if (cross > 0) break;
          px.pop_back(), py.pop_back();
        }
        px.push_back(x), py.push_back(y);
      }
      for (std::size_t i = 1; i < px.size(); ++i)
        segs.push_back({(py[i] - py[i - 1]) / (px[i] - px[i - 1]), px[i] - px[i - 1], l});
    }
    // Steepest decrease first; equal slopes share what is left in proportion to their lengths.
    std::stable_sort(segs.begin(), segs.end(),
                     [](const Seg& a, const Seg& b) { return a.slope < b.slope; });
    std::vector<double> y(n, s0);
    double rest = (B - s0) * static_cast<double>(layers);
    for (std::size_t i = 0; i < segs.size() && rest > 0;) {
      std::size_t j = i;
      double group = 0;
      for (; j < segs.size() && segs[j].slope == segs[i].slope; ++j) group += segs[j].length;
      const double share = std::min(1.0, rest / group);
      for (; i < j; ++i) y[segs[i].layer] += share * segs[i].length;
      rest -= share * group;
    }
    return y;
  }

  void allocate(const AllocContext& ctx, std::span<std::int64_t> budgets) const {
    KVP_REQUIRE(layers > 0, "depthkv: no profile loaded");
    KVP_REQUIRE(ctx.model_layers == layers, "depthkv: the profile has ", layers,
                " layers but the model has ", ctx.model_layers,
                layers < ctx.model_layers ? " (missing layers)" : "");
    // B_min above the protected floor: the mean budget must still cover it in every layer.
    const std::int64_t lo = std::max(ctx.min_keep(), min_tokens);
    alloc::split_across_layers(ctx, budgets, name, lo, [&](double B) {
      KVP_REQUIRE(B >= static_cast<double>(std::min(lo, ctx.tokens)), "depthkv: min_tokens ",
                  min_tokens, " is above the mean per-head budget ", B);
      return targets(B, ctx.tokens, lo);
    });
  }
};

}  // namespace kvpolicy
