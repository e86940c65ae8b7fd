// Ada-KV (Feng et al. 2024), as kvpress's AdaKVPress computes it: inside a layer, every KV head
// first keeps its own best alpha * B tokens (the safeguard, alpha = 0.2), and the rest of the
// layer's budget goes to the highest remaining scores across all of its heads. Heads with
// concentrated attention give tokens to heads with flat attention; the layer's total is
// conserved exactly. The kept sets are physically ragged here (kvpress only masks evicted keys),
// so the memory is really saved. See shared/algorithms.md.
// Choices the sources leave open:
// - The safeguard of a head with budget B is max(P, floor(alpha B)) tokens: its P protected
//   tokens (sinks + recent, kept anyway) and then its best other tokens. kvpress's int(alpha B)
//   top-k includes the window because SnapKV scores the window highest; protected sinks count
//   the same way here, whatever their score.
// - Scores are compared across heads as they are (no per-head normalization, like kvpress).
//   Order: higher score, then the more recent token, then the higher head, so the result is
//   deterministic and each head's kept set is a prefix of its own score order.
// - B is each row's budget as the previous stages left it (uniform, pyramid, depthkv), so
//   `depthkv | adakv` first splits across layers, then across heads inside each layer.
#pragma once
#include <algorithm>
#include <span>
#include <vector>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/core/topk_key.hpp"

namespace kvpolicy {

struct AdaKV {
  static constexpr std::string_view name = "adakv";
  static constexpr AllocLevel level = AllocLevel::heads;
  double alpha = 0.2;

  void validate() const {
    KVP_REQUIRE(std::isfinite(alpha) && alpha >= 0.0 && alpha <= 1.0,
                "adakv: alpha must be in [0, 1], got ", alpha);
  }
  static AdaKV from_params(Params& p) {
    AdaKV a;
    a.alpha = p.get_double("alpha", a.alpha);
    a.validate();
    return a;
  }

  // Tokens head budget b keeps no matter what the other heads score.
  std::int64_t safeguard(std::int64_t b, std::int64_t protected_tokens) const {
    const auto s = static_cast<std::int64_t>(std::floor(alpha * static_cast<double>(b)));
    return std::min(b, std::max(protected_tokens, s));
  }

  void allocate(const AllocContext& ctx, std::span<std::int64_t> budgets) const {
    validate();
    const std::int64_t L = ctx.layers(), H = ctx.heads(), T = ctx.tokens;
    KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == L * H, "adakv: ", budgets.size(),
                " budgets for ", L * H, " (layer, head) rows");
    const std::int64_t sinks = std::min(ctx.protect.sinks, T);
    const std::int64_t recent_begin = std::max(sinks, T - ctx.protect.recent);
    const std::int64_t P = sinks + (T - recent_begin);
    struct Cand {
      std::uint64_t key;
      std::int64_t head;
      bool operator>(const Cand& o) const { return key != o.key ? key > o.key : head > o.head; }
    };
    // The pool (every head's tokens past its safeguard) is only counted, never gathered: the
    // free budget goes to the pool's `free` largest (key, head) pairs, found with a histogram of
    // the keys' top 16 bits (sign, exponent and 7 mantissa bits of the score). The buckets above
    // the one where the count reaches `free` are taken whole; only that bucket's entries are
    // gathered and partially sorted. The same pairs as a partial sort of the whole pool (one
    // gathered array of 16-byte entries and nth_element over it were most of adakv's cost: 32%
    // of `h2o | adakv` at T=32768), in two passes over the scores.
    constexpr int kShift = 48;
    std::vector<std::uint32_t> hist(std::size_t{1} << (64 - kShift));
    std::vector<std::uint64_t> row, limit(static_cast<std::size_t>(H));
    std::vector<std::int64_t> in_pool(static_cast<std::size_t>(H)), extra(static_cast<std::size_t>(H));
    std::vector<Cand> edge;
    for (std::int64_t l = 0; l < L; ++l) {
      std::span<std::int64_t> b = budgets.subspan(static_cast<std::size_t>(l * H),
                                                  static_cast<std::size_t>(H));
      std::int64_t free = 0, pool = 0;
      for (std::int64_t h = 0; h < H; ++h) {
        KVP_REQUIRE(b[h] >= std::min(P, T) && b[h] <= T, "adakv: budget ", b[h], " of layer ",
                    l, ", head ", h, " is outside [", std::min(P, T), ", ", T, "]");
        const std::int64_t keep = safeguard(b[h], P);
        free += b[h] - keep;
        b[h] = keep;
        // The head's own best g others stay out of the pool: it holds the keys <= the g-th
        // largest (keys are distinct within a row: they hold the token index).
        const auto g = static_cast<std::size_t>(keep - P);
        const auto n = static_cast<std::size_t>(std::max<std::int64_t>(0, recent_begin - sinks));
        auto& lim = limit[static_cast<std::size_t>(h)];
        lim = ~std::uint64_t{0};
        if (g > 0 && g < n) {
          auto s = ctx.scores->row(l, h);
          row.clear();
          for (std::int64_t j = sinks; j < recent_begin; ++j)
            row.push_back(topk_key(s[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)));
          std::nth_element(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(g), row.end(),
                           std::greater<>());
          lim = row[g];
        }
        in_pool[static_cast<std::size_t>(h)] = g < n ? static_cast<std::int64_t>(n - g) : 0;
        pool += in_pool[static_cast<std::size_t>(h)];
      }
      if (free == 0) continue;
      if (free >= pool) {  // (free <= pool: every budget is at most T) the whole pool
        for (std::int64_t h = 0; h < H; ++h) b[h] += in_pool[static_cast<std::size_t>(h)];
        continue;
      }
      auto for_pool = [&](auto&& f) {  // f(key, head) for every pool entry
        for (std::int64_t h = 0; h < H; ++h) {
          if (in_pool[static_cast<std::size_t>(h)] == 0) continue;
          const std::uint64_t lim = limit[static_cast<std::size_t>(h)];
          auto s = ctx.scores->row(l, h);
          for (std::int64_t j = sinks; j < recent_begin; ++j) {
            const std::uint64_t key = topk_key(s[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j));
            if (key <= lim) f(key, h);
          }
        }
      };
      std::fill(hist.begin(), hist.end(), 0u);
      for_pool([&](std::uint64_t key, std::int64_t) { ++hist[key >> kShift]; });
      std::size_t edge_bucket = hist.size();
      std::int64_t above = 0;  // entries in the buckets above edge_bucket
      while (edge_bucket > 0 && above + hist[edge_bucket - 1] < free) above += hist[--edge_bucket];
      --edge_bucket;  // the bucket where the count reaches `free`
      std::fill(extra.begin(), extra.end(), 0);
      edge.clear();
      for_pool([&](std::uint64_t key, std::int64_t h) {
        const std::size_t bucket = key >> kShift;
        if (bucket > edge_bucket) ++extra[static_cast<std::size_t>(h)];
        else if (bucket == edge_bucket) edge.push_back({key, h});
      });
      const auto m = static_cast<std::size_t>(free - above);  // 0 < m <= edge.size()
      std::nth_element(edge.begin(), edge.begin() + static_cast<std::ptrdiff_t>(m - 1), edge.end(),
                       std::greater<>());
      for (std::size_t i = 0; i < m; ++i) ++extra[static_cast<std::size_t>(edge[i].head)];
      for (std::int64_t h = 0; h < H; ++h) b[h] += extra[static_cast<std::size_t>(h)];
    }
  }
};

}  // namespace kvpolicy
