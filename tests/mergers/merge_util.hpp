// Shared by the [merger] tests: a small owned cache (K, V, log_count, scores, selection) in HND
// fp32 or 16-bit, the MergeArgs over it, the compaction an owner runs after a merge, and a
// naive GSC reference (fp64, straight from the rule in mergers/semantic.hpp).
#pragma once
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include <kvpolicy/cpu/attention.hpp>
#include <kvpolicy/cpu/compact.hpp>
#include <kvpolicy/cpu/select.hpp>
#include <kvpolicy/cpu/stages.hpp>
#include <kvpolicy/mergers/nearest.hpp>
#include <kvpolicy/mergers/semantic.hpp>

#include "common/random.hpp"

namespace mtest {

using namespace kvpolicy;

template <class E = float>
struct Cache {
  std::int64_t L = 1, H = 1, T = 0, d = 0;
  std::vector<E> k, v;
  std::vector<float> lc;  // [L][H][T]: log counts, 0 for a fresh token
  ScoreMap scores;
  Selection sel;
  Protect protect;
  std::vector<std::uint8_t> delimiter;  // empty: no mask; else [T] (shared) or [L][H][T]
  std::int64_t delimiter_stride = 0;

  Cache(std::int64_t layers, std::int64_t heads, std::int64_t tokens, std::int64_t dim)
      : L(layers), H(heads), T(tokens), d(dim),
        k(static_cast<std::size_t>(layers * heads * tokens * dim)), v(k.size()),
        lc(static_cast<std::size_t>(layers * heads * tokens), 0.f),
        scores(layers, heads, tokens, 0.f) {}

  KVView<E> keys() { return KVView<E>::hnd(k.data(), L, H, T, d); }
  KVView<E> values() { return KVView<E>::hnd(v.data(), L, H, T, d); }
  E& key(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t i) { return keys().at(l, h, t, i); }
  E& value(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t i) { return values().at(l, h, t, i); }
  float& log_count(std::int64_t l, std::int64_t h, std::int64_t t) {
    return lc[static_cast<std::size_t>((l * H + h) * T + t)];
  }
  double count(std::int64_t l, std::int64_t h, std::int64_t t) { return std::exp(double(log_count(l, h, t))); }

  void randomize(kvtest::Rng& rng) {
    for (auto& x : k) x = from_float<E>(rng.normal());
    for (auto& x : v) x = from_float<E>(rng.normal());
  }
  // Scores uniform in [0, 1) and, if max_count > 1, carried counts uniform in [1, max_count]
  // (log_count is left as it is otherwise).
  void randomize_scores(kvtest::Rng& rng, std::int64_t max_count = 1) {
    for (auto& x : std::span<float>(scores.data(), static_cast<std::size_t>(L * H * T)))
      x = static_cast<float>(rng.uniform(0.0, 1.0));
    if (max_count > 1)
      for (auto& x : lc) x = static_cast<float>(std::log(double(rng.integer(1, max_count))));
  }
  // Selects with the library's top-k (every row the same budget).
  void select(std::int64_t budget) {
    std::vector<std::int64_t> b(static_cast<std::size_t>(L * H), budget);
    cpu::select(cpu_backend{1}, scores, b, protect, sel);
  }
  MergeArgs<E> args() {
    MergeArgs<E> a;
    a.keys = keys();
    a.values = values();
    a.selection = &sel;
    a.scores = &scores;
    a.log_count = lc.data();
    a.protect = protect;
    if (!delimiter.empty()) {
      a.delimiter = delimiter.data();
      a.delimiter_stride = delimiter_stride;
    }
    return a;
  }
  // What the owner does after merging: compact K, V, log_count (and a per-row mask) with the
  // selection, then shrink T to the largest kept count. Rows keep their stride until `shrink`.
  void compact() {
    cpu::compact(cpu_backend{1}, keys(), sel);
    cpu::compact(cpu_backend{1}, values(), sel);
    cpu::compact_state(cpu_backend{1}, lc.data(), H * T, T, sel);
    if (!delimiter.empty() && delimiter_stride > 0)
      cpu::compact_state(cpu_backend{1}, delimiter.data(), H * delimiter_stride, delimiter_stride,
                         sel);
  }
  // After compact() with the same kept count n in every row: a dense cache of n tokens.
  Cache shrink() const {
    const std::int64_t n = sel.count(0, 0);
    Cache out(L, H, n, d);
    for (std::int64_t r = 0; r < L * H; ++r) {
      REQUIRE(sel.count(r / H, r % H) == n);
      for (std::int64_t t = 0; t < n; ++t) {
        out.lc[static_cast<std::size_t>(r * n + t)] = lc[static_cast<std::size_t>(r * T + t)];
        for (std::int64_t i = 0; i < d; ++i) {
          out.k[static_cast<std::size_t>((r * n + t) * d + i)] = k[static_cast<std::size_t>((r * T + t) * d + i)];
          out.v[static_cast<std::size_t>((r * n + t) * d + i)] = v[static_cast<std::size_t>((r * T + t) * d + i)];
        }
      }
      if (!delimiter.empty() && delimiter_stride > 0) {
        out.delimiter.resize(static_cast<std::size_t>(L * H * n));
        out.delimiter_stride = n;
      }
    }
    if (!out.delimiter.empty())
      for (std::int64_t r = 0; r < L * H; ++r)
        for (std::int64_t t = 0; t < n; ++t)
          out.delimiter[static_cast<std::size_t>(r * n + t)] =
              delimiter[static_cast<std::size_t>(r * delimiter_stride + t)];
    out.protect = protect;
    return out;
  }
  // Sum over the rows of (l, h) of the counts, after compact(): the tokens the row represents.
  double represented(std::int64_t l, std::int64_t h) {
    double s = 0;
    for (std::int64_t t = 0; t < sel.count(l, h); ++t) s += count(l, h, t);
    return s;
  }
};

// Naive GSC of one row: owner[j] = the kept seed that absorbed token j (j itself for a kept
// seed), or -1 (protected, or evicted and not absorbed by a kept seed).
template <class E>
std::vector<std::int64_t> naive_gsc(Cache<E>& c, std::int64_t l, std::int64_t h, double tau,
                                    std::int64_t chunk) {
  const std::int64_t n = c.T;
  std::vector<int> role(static_cast<std::size_t>(n), 0);  // 0 evicted, 1 kept, 2 protected
  for (std::int32_t j : c.sel.kept(l, h)) role[static_cast<std::size_t>(j)] = 1;
  for (std::int64_t j = 0; j < n; ++j)
    if (j < c.protect.sinks || j >= n - c.protect.recent) role[static_cast<std::size_t>(j)] = 2;
  auto key = [&](std::int64_t j, std::int64_t i) { return double(to_float(c.key(l, h, j, i))); };
  auto cosine = [&](std::int64_t a, std::int64_t b) {
    double dot = 0, na = 0, nb = 0;
    for (std::int64_t i = 0; i < c.d; ++i)
      dot += key(a, i) * key(b, i), na += key(a, i) * key(a, i), nb += key(b, i) * key(b, i);
    return dot / std::sqrt(na * nb);
  };
  std::vector<std::int64_t> owner(static_cast<std::size_t>(n), -1), seed_of(owner);
  const std::uint8_t* delim = c.delimiter.empty()
      ? nullptr
      : c.delimiter.data() + (c.delimiter_stride > 0 ? (l * c.H + h) * c.delimiter_stride : 0);
  std::int64_t start = 0;
  for (std::int64_t e = 0; e < n; ++e) {
    if (!((delim && delim[e]) || (chunk > 0 && e - start + 1 == chunk) || e == n - 1)) continue;
    // Candidates in score order (higher, then more recent).
    std::vector<std::int64_t> cand;
    for (std::int64_t j = start; j <= e; ++j)
      if (role[static_cast<std::size_t>(j)] != 2) cand.push_back(j);
    std::sort(cand.begin(), cand.end(), [&](std::int64_t a, std::int64_t b) {
      const float sa = c.scores.row(l, h)[static_cast<std::size_t>(a)];
      const float sb = c.scores.row(l, h)[static_cast<std::size_t>(b)];
      return sa != sb ? sa > sb : a > b;
    });
    for (std::int64_t s : cand) {
      if (seed_of[static_cast<std::size_t>(s)] >= 0) continue;
      seed_of[static_cast<std::size_t>(s)] = s;
      for (std::int64_t m : cand)
        if (seed_of[static_cast<std::size_t>(m)] < 0 && role[static_cast<std::size_t>(m)] == 0 &&
            cosine(s, m) >= tau - 1e-9)
          seed_of[static_cast<std::size_t>(m)] = s;
    }
    start = e + 1;
  }
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t s = seed_of[static_cast<std::size_t>(j)];
    if (s >= 0 && role[static_cast<std::size_t>(s)] == 1) owner[static_cast<std::size_t>(j)] = s;
  }
  return owner;
}

// Attention of nq queries (g query heads per KV head, [H*g][nq][d]) over layer 0 of `c`, whose
// head h holds lengths[h] tokens, with the log-count bias (proportional attention) or without.
inline std::vector<float> attend(Cache<float>& c, const std::vector<float>& q, std::int64_t g,
                                 std::int64_t nq, const std::vector<std::int64_t>& lengths,
                                 bool bias) {
  cpu::RaggedAttentionArgs args;
  args.lengths = lengths.data();
  if (bias) args.bias = c.lc.data(), args.bias_stride = c.T;
  std::vector<float> out(static_cast<std::size_t>(c.H * g * nq * c.d));
  const auto Q = KVView<const float>::hnd(q.data(), 1, c.H * g, nq, c.d);
  cpu::attention(cpu_backend{1}, KVView<const float>(c.keys()), KVView<const float>(c.values()), Q,
                 args, out.data());
  return out;
}

inline std::vector<std::uint8_t> mask(std::int64_t n, std::initializer_list<std::int64_t> at) {
  std::vector<std::uint8_t> m(static_cast<std::size_t>(n), 0);
  for (auto j : at) m[static_cast<std::size_t>(j)] = 1;
  return m;
}

inline Semantic semantic(float tau, std::int64_t chunk, MergeWeight w = MergeWeight::mean) {
  Semantic s;
  s.tau = tau;
  s.chunk = chunk;
  s.weight = w;
  return s;
}

}  // namespace mtest
