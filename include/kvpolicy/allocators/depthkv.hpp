// DepthKV: the global budget is split across layers in proportion to each layer's sensitivity
// to pruning, measured offline per model (shared/algorithms.md; only the abstract is public, the
// rule below is ours as written there):
//   B_l = clip(L B s_l / sum(s), B_min, T), the clipped excess redistributed so sum B_l = L B.
// Choices the sources leave open:
// - Redistribution is water-filling: B_l = clip(c s_l, B_min, T) with the one scale c that makes
//   them sum to L B, i.e. what a clipped layer gives up (or is owed) goes to the unclipped ones
//   in proportion to their sensitivity. Then integers: alloc::round_to_total (exact sum, bounds
//   kept). A profile of all zeros splits uniformly.
// - B_min defaults to the tokens the chain protects (no layer can keep fewer); min_tokens=N
//   raises it (never below the protected count).
// - The profile (allocators/profile.hpp) must list exactly the model's layers: events carry the
//   model's layer count (EventInfo::model_layers; the event's own layers when absent).
// - Spec: depthkv(profile=path.json) reads the file when the policy is built; weights=a:b:c gives
//   the values inline (colon-separated, for tests and quick experiments). One of them is required.
// - power=p (default 1, the rule above) splits in proportion to s_l^p instead: p < 1 tempers a
//   profile whose values span orders of magnitude (the bundled SmolLM2 profile spans 115x, and
//   the proportional rule then starves its least sensitive layers), p = 0 is uniform.
// - Each KV head is split on its own; see alloc::split_across_layers for what one-layer events
//   conserve. The allocator holds the profile in a fixed array (kMaxLayers) so that it stays a
//   trivially copyable value.
#pragma once
#include <array>
#include <cmath>
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

  std::array<float, kMaxLayers> sensitivity{};
  std::int64_t layers = 0;       // entries of `sensitivity` in use
  std::int64_t min_tokens = -1;  // B_min; -1: the protected tokens
  double power = 1.0;            // budgets in proportion to sensitivity^power

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
  static DepthKV from_profile(const LayerProfile& p, const std::string& where) {
    return from_values(p.sensitivity, "profile '" + where + "'");
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
    d.power = p.get_double("power", 1.0);
    KVP_REQUIRE(std::isfinite(d.power) && d.power >= 0, "depthkv: power must be >= 0, got ",
                d.power);
    KVP_REQUIRE(min_tokens >= -1, "depthkv: min_tokens must be >= 0 (or -1 for the protected "
                "tokens), got ", min_tokens);
    return d;
  }

  // Real per-layer budgets for mean budget B over the model's layers of T tokens, floor lo.
  std::vector<double> targets(double B, std::int64_t T, std::int64_t lo) const {
    const auto n = static_cast<std::size_t>(layers);
    std::vector<double> w(sensitivity.begin(), sensitivity.begin() + layers);
    if (power != 1.0)
      for (auto& x : w) x = std::pow(x, power);  // pow(0, 0) = 1: power 0 is uniform
    const std::vector<double> lo_v(n, static_cast<double>(std::min(lo, T))),
        hi_v(n, static_cast<double>(T));
    return alloc::water_fill(w, B * static_cast<double>(layers), lo_v, hi_v);
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
