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
// - Tensor parallelism over KV heads (AllocContext::shard): the layer's free budget goes to the
//   best pool entries of every rank's heads. The ranks add up their free budgets and pool sizes
//   and the two radix histograms below (4096 counts each), and gather the entries that tie at
//   the histograms' edge; heads are compared by their model index. Each rank then gives its own
//   heads what a single rank holding every head would give them.
#pragma once
#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/allocators/adakv_row.hpp"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/cpu/fwd.hpp"

namespace kvpolicy {

namespace detail {
// orderable_bits (topk_key.hpp) for every input, on the bits only: no floating-point compare
// and no branch, so that the passes below vectorize.
inline std::uint32_t orderable_bits_int(float s) {
  std::uint32_t u;
  std::memcpy(&u, &s, sizeof u);
  const std::uint32_t a = u & 0x7fffffffu;
  u = a == 0 ? 0u : u;  // -0 like +0
  const std::uint32_t o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return a > 0x7f800000u ? 0u : o;  // NaN below every number
}
}  // namespace detail

struct AdaKV {
  static constexpr std::string_view name = "adakv";
  static constexpr AllocLevel level = AllocLevel::heads;
  static constexpr bool spans_heads = true;  // the free budget goes to the best of all heads
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
    return row_math::ada_keep(b, protected_tokens, alpha);
  }

  void allocate(const AllocContext& ctx, std::span<std::int64_t> budgets) const {
    validate();
    const std::int64_t L = ctx.layers(), H = ctx.heads(), T = ctx.tokens;
    KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == L * H, "adakv: ", budgets.size(),
                " budgets for ", L * H, " (layer, head) rows");
    const row_math::AdaSpan span = row_math::ada_span(ctx.protect.sinks, ctx.protect.recent, T);
    const std::int64_t sinks = span.sinks, recent_begin = span.recent_begin;
    const std::int64_t P = span.protected_count(T);
    struct Cand {
      std::uint64_t key;
      std::int64_t head;
      bool operator>(const Cand& o) const { return key != o.key ? key > o.key : head > o.head; }
    };
    // The pool (every head's tokens past its safeguard) is never gathered whole: the free budget
    // goes to the pool's `free` largest (key, head) pairs, found by a radix select on the keys'
    // top 32 bits o = orderable_bits(score), 12 bits at a time. Level 1 counts the pool by
    // o >> 20, level 2 the entries of level 1's edge bucket (where the count reaches `free`) by
    // the next 12 bits; the buckets above each edge are taken whole (their counts per head come
    // from per-head histograms), and only the entries that share the 24-bit edge prefix are
    // gathered and partially sorted on the full (key, head) order. The same pairs as a partial
    // sort of the whole pool: the histograms are integer counts, exact in any order.
    // Both passes over the pool are per head (items of cpu::parallel_for when the context
    // has a backend): each head fills its own histogram and edge list, merged in head order,
    // so the budgets do not depend on the thread count. Level 2 gathers e1's entries, so the
    // final step reads only those. The passes compute o with integer operations in a
    // vectorized loop (orderable_bits_int) before the histogram reads them. One layer of 8
    // heads x 29.5K pool entries (h2o at T=32768, 20 %): 1.17 ms before (16-bit histogram,
    // then a classifying pass, both scalar), 0.55 ms on one thread, 0.39 ms on two.
    constexpr int kDigit = 12;
    constexpr std::size_t kBuckets = std::size_t{1} << kDigit;
    // The buffers persist per calling thread (capacity only; every call overwrites what it
    // reads): the histograms alone are 128 KiB for 8 heads, which glibc maps and unmaps anew on
    // every call (page faults: ~10% of an event's allocation at T = 32768). Each call starts by
    // resizing or clearing what it uses, so nothing carries over between calls. The capacity
    // stays with the thread (at most about 16 bytes per pool entry of the largest layer seen, in
    // the edge lists). One thread must not run two allocate calls at once (nothing does: the
    // per-head passes below call no allocator).
    struct Scratch {
      std::vector<std::uint32_t> hist;
      std::vector<std::uint64_t> row;
      std::vector<std::vector<Cand>> edge_rows;
      std::vector<Cand> edge;
    };
    static thread_local Scratch scratch;
    std::vector<std::uint32_t>& hist = scratch.hist;
    hist.resize(static_cast<std::size_t>(H) * kBuckets);
    std::vector<std::uint64_t>& row = scratch.row;
    std::vector<std::vector<Cand>>& edge_rows = scratch.edge_rows;
    if (edge_rows.size() < static_cast<std::size_t>(H)) edge_rows.resize(static_cast<std::size_t>(H));
    std::vector<Cand>& edge = scratch.edge;
    std::vector<std::uint64_t> limit(static_cast<std::size_t>(H));
    std::vector<std::int64_t> in_pool(static_cast<std::size_t>(H)), extra(static_cast<std::size_t>(H));
    // Tensor parallelism: this rank's heads are the model's [h0, h0 + H); sums run over ranks.
    const std::int64_t h0 = ctx.shard ? ctx.shard->first_head : 0;
    std::vector<std::int64_t> bucket_total(kBuckets);
    const auto for_heads = [&](auto&& f) {  // f(h) for every head, on the backend's threads
      if (ctx.backend && H > 1) cpu::parallel_for(*ctx.backend, H, f);
      else for (std::int64_t h = 0; h < H; ++h) f(h);
    };
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
      std::int64_t free_pool[2] = {free, pool};
      detail::all_sum(ctx.shard, std::span<std::int64_t>(free_pool));
      free = free_pool[0];
      pool = free_pool[1];
      if (free == 0) continue;
      if (free >= pool) {  // (free <= pool: every budget is at most T) the whole pool
        for (std::int64_t h = 0; h < H; ++h) b[h] += in_pool[static_cast<std::size_t>(h)];
        continue;
      }
      // f(o, j) for every pool entry of head h (o: the key's top 32 bits, j: the token). The
      // o of a chunk are computed first, in a loop that vectorizes; f (a histogram) then reads
      // them.
      const auto for_pool = [&](std::int64_t h, auto&& f) {
        if (in_pool[static_cast<std::size_t>(h)] == 0) return;
        const std::uint64_t lim = limit[static_cast<std::size_t>(h)];
        const float* s = ctx.scores->row(l, h).data();
        constexpr std::int64_t kChunk = 256;
        std::uint32_t o[kChunk];
        for (std::int64_t j0 = sinks; j0 < recent_begin; j0 += kChunk) {
          const std::int64_t c = std::min(kChunk, recent_begin - j0);
          for (std::int64_t i = 0; i < c; ++i) o[i] = detail::orderable_bits_int(s[j0 + i]);
          if (lim == ~std::uint64_t{0}) {
            for (std::int64_t i = 0; i < c; ++i) f(o[i], j0 + i);
          } else {
            for (std::int64_t i = 0; i < c; ++i)
              if (((static_cast<std::uint64_t>(o[i]) << 32) | static_cast<std::uint32_t>(j0 + i)) <= lim)
                f(o[i], j0 + i);
          }
        }
      };
      std::fill(extra.begin(), extra.end(), 0);
      std::int64_t need = free;  // still to take, from the entries that match the edge so far
      // From the per-head histograms: the edge bucket (from the top, where the count reaches
      // `need`); the buckets above it go to their heads whole.
      const auto take_above_edge = [&]() {
        std::fill(bucket_total.begin(), bucket_total.end(), 0);
        for (std::int64_t h = 0; h < H; ++h)
          for (std::size_t i = 0; i < kBuckets; ++i)
            bucket_total[i] += hist[static_cast<std::size_t>(h) * kBuckets + i];
        detail::all_sum(ctx.shard, std::span<std::int64_t>(bucket_total));
        std::size_t e = kBuckets;
        std::int64_t above = 0;
        for (;;) {
          --e;
          const std::int64_t c = bucket_total[e];
          if (above + c >= need) break;
          above += c;
        }
        for (std::int64_t h = 0; h < H; ++h) {
          const std::uint32_t* hh = hist.data() + static_cast<std::size_t>(h) * kBuckets;
          for (std::size_t i = e + 1; i < kBuckets; ++i) extra[static_cast<std::size_t>(h)] += hh[i];
        }
        need -= above;  // 0 < need <= the edge bucket's count
        return static_cast<std::uint32_t>(e);
      };
      // Level 1: the pool by o's top 12 bits.
      for_heads([&](std::int64_t h) {
        std::uint32_t* hh = hist.data() + static_cast<std::size_t>(h) * kBuckets;
        std::fill(hh, hh + kBuckets, 0u);
        for_pool(h, [&](std::uint32_t o, std::int64_t) { ++hh[o >> (32 - kDigit)]; });
      });
      const std::uint32_t e1 = take_above_edge();
      // Level 2: the entries of e1 (gathered as full keys, per head) by the next 12 bits.
      for_heads([&](std::int64_t h) {
        std::uint32_t* hh = hist.data() + static_cast<std::size_t>(h) * kBuckets;
        std::fill(hh, hh + kBuckets, 0u);
        auto& er = edge_rows[static_cast<std::size_t>(h)];
        er.clear();
        for_pool(h, [&](std::uint32_t o, std::int64_t j) {
          if ((o >> (32 - kDigit)) != e1) return;
          ++hh[(o >> (32 - 2 * kDigit)) & (kBuckets - 1)];
          er.push_back({(static_cast<std::uint64_t>(o) << 32) | static_cast<std::uint32_t>(j), h0 + h});
        });
      });
      const std::uint32_t prefix = (e1 << kDigit) | take_above_edge();
      // The entries whose top 24 bits are the edge prefix (in head order): the `need` largest.
      edge.clear();
      for (std::int64_t h = 0; h < H; ++h)  // (edge_rows may be longer: a previous call's H)
        for (const Cand& c : edge_rows[static_cast<std::size_t>(h)])
          if ((c.key >> (64 - 2 * kDigit)) == prefix) edge.push_back(c);
      if (detail::sharded(ctx.shard)) edge = detail::all_gather_v(*ctx.shard, std::span<const Cand>(edge));
      const auto m = static_cast<std::size_t>(need);  // 0 < m <= edge.size()
      std::nth_element(edge.begin(), edge.begin() + static_cast<std::ptrdiff_t>(m - 1), edge.end(),
                       std::greater<>());
      for (std::size_t i = 0; i < m; ++i)  // (the other ranks' heads are theirs to count)
        if (edge[i].head >= h0 && edge[i].head < h0 + H) ++extra[static_cast<std::size_t>(edge[i].head - h0)];
      for (std::int64_t h = 0; h < H; ++h) b[h] += extra[static_cast<std::size_t>(h)];
    }
  }
};

}  // namespace kvpolicy
