// kvzip: context-reconstruction scores.
// - Session::reconstruct against a naive double-precision attention over [cache; chunk]: the
//   output, the running maximum over several chunks, and a cache left as it was. Chunk sizes
//   reach both attention kernels (split-K for <= 16 stacked rows, blocks otherwise) with several
//   key chunks and row-block chunks.
// - Ragged heads (a cache that adakv already compressed).
// - kvzip's selection: the sinks plus the top scores of each head.
// - fork, errors, the spec, and the C ABI (kvp_session_reconstruct gives the C++ kept sets).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include <kvpolicy/c/kvpolicy.h>
#include <kvpolicy/kvpolicy.hpp>

#include "common/error_of.hpp"
#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_scorers_kvzip {

using namespace kvpolicy;
using Catch::Matchers::Contains;

constexpr std::int64_t kLayers = 2, kHkv = 2, kG = 3, kHq = kHkv * kG, kD = 8;

// [heads][n][d] rows of one layer, contiguous.
struct Block {
  std::int64_t heads = 0, n = 0;
  std::vector<float> x;
  KVView<const float> view() const { return KVView<const float>::hnd(x.data(), 1, heads, n, kD); }
  const float* row(std::int64_t h, std::int64_t t) const { return x.data() + (h * n + t) * kD; }
};

Block random_block(kvtest::Rng& rng, std::int64_t heads, std::int64_t n) {
  return {heads, n, rng.normals<float>(heads * n * kD)};
}

SessionConfig config(const Budget& b) {
  SessionConfig c;
  c.layers = kLayers;
  c.kv_heads = kHkv;
  c.q_heads = kHq;
  c.head_dim = kD;
  c.budget = b;
  c.initial_capacity = 4;  // reconstruct() must grow the storage for its chunk
  return c;
}

// What one chunk should do to one layer, from the rows the session holds (keys/values of each
// head: `len[h]` rows) and the chunk: out [Hq][n][d] and, per head, the column maxima of the
// softmax over the cached rows.
struct Expected {
  std::vector<double> out;
  std::vector<std::vector<double>> colmax;  // [Hkv][len[h]]
};

Expected naive(const std::vector<std::vector<const float*>>& k_rows,
               const std::vector<std::vector<const float*>>& v_rows, const Block& ck,
               const Block& cv, const Block& q) {
  const std::int64_t n = q.n;
  Expected e;
  e.out.assign(static_cast<std::size_t>(kHq * n * kD), 0.0);
  e.colmax.resize(kHkv);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  for (std::int64_t h = 0; h < kHkv; ++h) {
    const auto len = static_cast<std::int64_t>(k_rows[static_cast<std::size_t>(h)].size());
    auto& mx = e.colmax[static_cast<std::size_t>(h)];
    mx.assign(static_cast<std::size_t>(len), 0.0);
    for (std::int64_t m = 0; m < kG; ++m) {
      const std::int64_t qh = h * kG + m;
      for (std::int64_t i = 0; i < n; ++i) {
        // Keys: the cache's rows, then the chunk's first i + 1 rows (causal).
        std::vector<const float*> ks = k_rows[static_cast<std::size_t>(h)];
        std::vector<const float*> vs = v_rows[static_cast<std::size_t>(h)];
        for (std::int64_t t = 0; t <= i; ++t)
          ks.push_back(ck.row(h, t)), vs.push_back(cv.row(h, t));
        std::vector<double> logit(ks.size());
        for (std::size_t j = 0; j < ks.size(); ++j) {
          double s = 0;
          for (std::int64_t x = 0; x < kD; ++x)
            s += static_cast<double>(q.row(qh, i)[x]) * ks[j][x];
          logit[j] = s * scale;
        }
        const double top = *std::max_element(logit.begin(), logit.end());
        double z = 0;
        for (double& l : logit) z += (l = std::exp(l - top));
        for (std::size_t j = 0; j < ks.size(); ++j) {
          const double p = logit[j] / z;
          if (static_cast<std::int64_t>(j) < len) mx[j] = std::max(mx[j], p);
          for (std::int64_t x = 0; x < kD; ++x)
            e.out[static_cast<std::size_t>((qh * n + i) * kD + x)] += p * vs[j][x];
        }
      }
    }
  }
  return e;
}

// The rows a session holds for one layer, per head.
std::vector<std::vector<const float*>> rows_of(const Session<float>& s, std::int64_t l,
                                               const KVView<const float>& v) {
  std::vector<std::vector<const float*>> out(kHkv);
  for (std::int64_t h = 0; h < kHkv; ++h)
    for (std::int64_t t = 0; t < s.length(l, h); ++t)
      out[static_cast<std::size_t>(h)].push_back(v.row(0, h, t));
  return out;
}

struct Prompt {
  std::vector<Block> k, v, q;  // per layer
};
Prompt random_prompt(kvtest::Rng& rng, std::int64_t T) {
  Prompt p;
  for (std::int64_t l = 0; l < kLayers; ++l) {
    p.k.push_back(random_block(rng, kHkv, T));
    p.v.push_back(random_block(rng, kHkv, T));
    p.q.push_back(random_block(rng, kHq, T));
  }
  return p;
}

void append(Session<float>& s, const Prompt& p) {
  for (std::int64_t l = 0; l < kLayers; ++l)
    s.append(l, p.k[static_cast<std::size_t>(l)].view(), p.v[static_cast<std::size_t>(l)].view(),
             p.q[static_cast<std::size_t>(l)].view());
}

// Runs one chunk of n random tokens through reconstruct() on every layer and checks the output
// and the new running maxima against `best` (updated).
void check_chunk(Session<float>& s, kvtest::Rng& rng, std::int64_t n,
                 std::vector<std::vector<std::vector<double>>>& best) {
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const Block ck = random_block(rng, kHkv, n), cv = random_block(rng, kHkv, n),
                q = random_block(rng, kHq, n);
    const Expected e = naive(rows_of(s, l, s.keys(l)), rows_of(s, l, s.values(l)), ck, cv, q);
    std::vector<float> out(static_cast<std::size_t>(kHq * n * kD), -1.f);
    s.reconstruct(l, ck.view(), cv.view(), q.view(), out.data());
    for (std::size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == Approx(e.out[i]).margin(1e-5));
    auto& b = best[static_cast<std::size_t>(l)];
    for (std::int64_t h = 0; h < kHkv; ++h) {
      auto& bh = b[static_cast<std::size_t>(h)];
      const auto& eh = e.colmax[static_cast<std::size_t>(h)];
      bh.resize(eh.size(), 0.0);
      const auto got = s.reconstruction(l, h);
      REQUIRE(got.size() == eh.size());
      for (std::size_t j = 0; j < eh.size(); ++j) {
        bh[j] = std::max(bh[j], eh[j]);
        REQUIRE(got[j] == Approx(bh[j]).margin(1e-6));
      }
    }
    REQUIRE(s.reconstructed(l));
  }
}

// Positions kvzip keeps on one head: the first `sinks` (as many as the budget holds), then the
// best scores.
std::vector<std::int32_t> expected_kept(const std::vector<double>& score, std::int64_t budget,
                                        std::int64_t sinks) {
  const auto T = static_cast<std::int64_t>(score.size());
  std::vector<std::int32_t> rest;
  for (std::int64_t j = std::min(sinks, T); j < T; ++j)
    rest.push_back(static_cast<std::int32_t>(j));
  std::sort(rest.begin(), rest.end(), [&](std::int32_t a, std::int32_t b) {
    return score[static_cast<std::size_t>(a)] > score[static_cast<std::size_t>(b)];
  });
  std::vector<std::int32_t> kept;
  for (std::int64_t j = 0; j < std::min({sinks, T, budget}); ++j)
    kept.push_back(static_cast<std::int32_t>(j));
  const std::int64_t more =
      std::max<std::int64_t>(0, budget - static_cast<std::int64_t>(kept.size()));
  kept.insert(kept.end(), rest.begin(),
              rest.begin() + std::min<std::int64_t>(more, static_cast<std::int64_t>(rest.size())));
  std::sort(kept.begin(), kept.end());
  return kept;
}

TEST_CASE("kvzip: Session::reconstruct equals a naive attention over the cache and the chunk",
          "[kvzip][session]") {
  // (T, chunk sizes): 1 and 2 tokens take the split-K kernel (g * n <= 16), over one key chunk
  // and, at T = 1500, over two; 7 and 100 tokens take the row-block kernel (100: several row
  // blocks, cut into work items whose maxima are merged).
  const std::vector<std::pair<std::int64_t, std::vector<std::int64_t>>> cases = {
      {5, {1, 7}}, {40, {2, 100, 7}}, {1500, {2, 7}}};
  std::uint64_t seed = 11;
  for (const auto& [T, chunks] : cases) {
    CAPTURE(T);
    kvtest::Rng rng(seed++);
    Session<float> s(Policy("kvzip"), config(Budget::ratio(0.5)));
    const Prompt p = random_prompt(rng, T);
    append(s, p);
    std::vector<std::vector<std::vector<double>>> best(kLayers,
                                                       std::vector<std::vector<double>>(kHkv));
    for (std::int64_t n : chunks) {
      CAPTURE(n);
      check_chunk(s, rng, n, best);
    }
    // The cache is as it was: lengths, positions, rows.
    for (std::int64_t l = 0; l < kLayers; ++l)
      for (std::int64_t h = 0; h < kHkv; ++h) {
        REQUIRE(s.length(l, h) == T);
        const auto pos = s.positions(l, h);
        for (std::int64_t t = 0; t < T; ++t) {
          REQUIRE(pos[static_cast<std::size_t>(t)] == t);
          for (std::int64_t x = 0; x < kD; ++x) {
            REQUIRE(s.keys(l).at(0, h, t, x) == p.k[static_cast<std::size_t>(l)].row(h, t)[x]);
            REQUIRE(s.values(l).at(0, h, t, x) == p.v[static_cast<std::size_t>(l)].row(h, t)[x]);
          }
        }
      }
    // kvzip keeps the sinks and the best running maxima of every head.
    for (std::int64_t l = 0; l < kLayers; ++l) {
      REQUIRE(s.compress_if_due(l));
      const std::int64_t B = (T + 1) / 2;  // round(0.5 T)
      for (std::int64_t h = 0; h < kHkv; ++h) {
        const auto got = s.positions(l, h);
        const auto want =
            expected_kept(best[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)], B, 4);
        REQUIRE(std::vector<std::int32_t>(got.begin(), got.end()) == want);
        // The scores were compacted with the tokens.
        const auto sc = s.reconstruction(l, h);
        for (std::size_t i = 0; i < want.size(); ++i)
          REQUIRE(sc[i] == Approx(best[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)]
                                      [static_cast<std::size_t>(want[i])])
                               .margin(1e-6));
      }
    }
  }
}

TEST_CASE("kvzip: reconstruct over ragged heads, clear_reconstruction, and a later append",
          "[kvzip][session]") {
  kvtest::Rng rng(5);
  const std::int64_t T = 60;
  Session<float> s(Policy("kvzip | adakv(alpha=0)"), config(Budget::ratio(0.4)));
  const Prompt p = random_prompt(rng, T);
  append(s, p);
  std::vector<std::vector<std::vector<double>>> best(kLayers,
                                                     std::vector<std::vector<double>>(kHkv));
  check_chunk(s, rng, 9, best);
  for (std::int64_t l = 0; l < kLayers; ++l) s.compress_if_due(l);
  bool ragged = false;
  for (std::int64_t l = 0; l < kLayers; ++l) ragged |= s.length(l, 0) != s.length(l, 1);
  REQUIRE(ragged);  // adakv(alpha=0) split the budget unevenly on some layer
  s.clear_reconstruction();
  for (std::int64_t l = 0; l < kLayers; ++l) {
    REQUIRE_FALSE(s.reconstructed(l));
    for (std::int64_t h = 0; h < kHkv; ++h)
      for (float x : s.reconstruction(l, h)) REQUIRE(x == 0.f);
  }
  // A new pass over the compressed, ragged cache.
  best.assign(kLayers, std::vector<std::vector<double>>(kHkv));
  check_chunk(s, rng, 3, best);
  check_chunk(s, rng, 20, best);
  // Tokens appended later start at 0 (nothing reconstructed them).
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const Block k = random_block(rng, kHkv, 2), v = random_block(rng, kHkv, 2);
    s.append(l, k.view(), v.view());
    for (std::int64_t h = 0; h < kHkv; ++h) {
      const auto sc = s.reconstruction(l, h);
      REQUIRE(sc[sc.size() - 1] == 0.f);
      REQUIRE(sc[sc.size() - 2] == 0.f);
    }
  }
}

TEST_CASE("kvzip: fork copies the scores, and a fork or compression without them is refused",
          "[kvzip][session]") {
  kvtest::Rng rng(9);
  const std::int64_t T = 30;
  SessionConfig rec = config(Budget::ratio(1.0));
  Session<float> full(Policy("streaming"), rec);
  const Prompt p = random_prompt(rng, T);
  append(full, p);
  CHECK_THAT(kvtest::error_of([&] { (void)full.fork(Policy("kvzip"), Budget::ratio(0.5)); }),
             Contains("reads context-reconstruction scores but layer 0 has none"));
  // Same chunk into the full session and into a kvzip session: the fork keeps what kvzip does.
  Session<float> direct(Policy("kvzip"), config(Budget::ratio(0.5)));
  append(direct, p);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const Block ck = random_block(rng, kHkv, 6), cv = random_block(rng, kHkv, 6),
                q = random_block(rng, kHq, 6);
    std::vector<float> o1(static_cast<std::size_t>(kHq * 6 * kD)), o2(o1.size());
    full.reconstruct(l, ck.view(), cv.view(), q.view(), o1.data());
    direct.reconstruct(l, ck.view(), cv.view(), q.view(), o2.data());
    REQUIRE(o1 == o2);
  }
  Session<float> forked = full.fork(Policy("kvzip"), Budget::ratio(0.5));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    forked.compress_if_due(l);
    direct.compress_if_due(l);
    for (std::int64_t h = 0; h < kHkv; ++h) {
      const auto a = forked.positions(l, h), b = direct.positions(l, h);
      REQUIRE(std::vector<std::int32_t>(a.begin(), a.end()) ==
              std::vector<std::int32_t>(b.begin(), b.end()));
    }
  }
  // Without a pass, the first compression fails and leaves the layer as it was (still due).
  Session<float> none(Policy("kvzip"), config(Budget::ratio(0.5)));
  append(none, p);
  CHECK_THAT(kvtest::error_of([&] { none.compress_if_due(0); }),
             Contains("context-reconstruction scores"));
  REQUIRE(none.length(0, 0) == T);
  REQUIRE(none.budgets(0).empty());
}

TEST_CASE("kvzip: argument errors leave the session unchanged", "[kvzip][session]") {
  kvtest::Rng rng(3);
  Session<float> s(Policy("kvzip"), config(Budget::ratio(0.5)));
  const Prompt p = random_prompt(rng, 10);
  append(s, p);
  const Block k = random_block(rng, kHkv, 4), v = random_block(rng, kHkv, 4),
              q = random_block(rng, kHq, 4), q3 = random_block(rng, kHq, 3),
              kq = random_block(rng, kHkv, 4);
  std::vector<float> out(static_cast<std::size_t>(kHq * 4 * kD));
  CHECK_THAT(kvtest::error_of([&] { s.reconstruct(0, k.view(), v.view(), q3.view(), out.data()); }),
             Contains("must agree"));
  CHECK_THAT(kvtest::error_of([&] { s.reconstruct(0, k.view(), v.view(), kq.view(), out.data()); }),
             Contains("q must be [1][6]"));
  CHECK_THAT(kvtest::error_of([&] { s.reconstruct(0, k.view(), v.view(), q.view(), nullptr); }),
             Contains("out is null"));
  CHECK_THAT(kvtest::error_of([&] { s.reconstruct(2, k.view(), v.view(), q.view(), out.data()); }),
             Contains("layer 2 is outside"));
  Block bad = q;
  bad.x[5] = std::nanf("");
  CHECK_THAT(
      kvtest::error_of([&] { s.reconstruct(0, k.view(), v.view(), bad.view(), out.data()); }),
      Contains("q"));
  for (std::int64_t l = 0; l < kLayers; ++l) {
    REQUIRE_FALSE(s.reconstructed(l));
    REQUIRE(s.length(l, 0) == 10);
  }
  // The spec.
  REQUIRE(has(Policy("kvzip").needs(), Needs::reconstruction));
  REQUIRE(Policy("kvzip").query_window() == 0);
  REQUIRE(Policy("kvzip(sinks=0,recent=3)").protect(100, 10).recent == 3);
  CHECK_THAT(kvtest::error_of([] { Policy("kvzip(sinks=-1)"); }), Contains("sinks must be >= 0"));
  CHECK_THAT(kvtest::error_of([] { Policy("kvzip(window=3)"); }), Contains("window"));
}

TEST_CASE("kvzip: kvp_session_reconstruct gives the C++ session's kept sets", "[kvzip][c_api]") {
  kvtest::Rng rng(21);
  const std::int64_t T = 50, n = 12;
  const Prompt p = random_prompt(rng, T);
  std::vector<Block> ck, cv, cq;
  for (std::int64_t l = 0; l < kLayers; ++l) {
    ck.push_back(random_block(rng, kHkv, n));
    cv.push_back(random_block(rng, kHkv, n));
    cq.push_back(random_block(rng, kHq, n));
  }
  Session<float> ref(Policy("kvzip"), config(Budget::ratio(0.3)));
  append(ref, p);
  kvp_policy* pol = nullptr;
  REQUIRE(kvp_policy_create("kvzip", &pol) == KVP_OK);
  kvp_session_config c = kvp_session_default_config();
  c.layers = kLayers, c.kv_heads = kHkv, c.q_heads = kHq, c.head_dim = kD;
  c.budget = {KVP_BUDGET_RATIO, 0.3};
  kvp_session* s = nullptr;
  REQUIRE(kvp_session_create(pol, &c, &s) == KVP_OK);
  auto t = [](const Block& b) {
    return kvp_tensor_hnd(const_cast<float*>(b.x.data()), KVP_F32, 1, b.heads, b.n, kD);
  };
  std::vector<float> out(static_cast<std::size_t>(kHq * n * kD)), ref_out(out.size());
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const auto ls = static_cast<std::size_t>(l);
    const kvp_tensor k = t(p.k[ls]), v = t(p.v[ls]), q = t(p.q[ls]);
    REQUIRE(kvp_session_append(s, l, &k, &v, &q) == KVP_OK);
    const kvp_tensor rk = t(ck[ls]), rv = t(cv[ls]), rq = t(cq[ls]);
    REQUIRE(kvp_session_reconstruct(s, l, &rk, &rv, &rq, out.data(), out.size() - 1) ==
            KVP_ERROR_BUFFER_TOO_SMALL);
    REQUIRE(kvp_session_reconstruct(s, l, &rk, &rv, nullptr, out.data(), out.size()) ==
            KVP_ERROR_INVALID_ARGUMENT);
    REQUIRE(kvp_session_reconstruct(s, l, &rk, &rv, &rq, out.data(), out.size()) == KVP_OK);
    ref.reconstruct(l, ck[ls].view(), cv[ls].view(), cq[ls].view(), ref_out.data());
    REQUIRE(out == ref_out);
    int done = 0;
    REQUIRE(kvp_session_compress_if_due(s, l, &done) == KVP_OK);
    REQUIRE(done == 1);
    REQUIRE(ref.compress_if_due(l));
    for (std::int64_t h = 0; h < kHkv; ++h) {
      std::vector<std::int32_t> pos(static_cast<std::size_t>(T), -1);
      REQUIRE(kvp_session_read(s, l, h, nullptr, nullptr, pos.data(), T) == KVP_OK);
      const auto want = ref.positions(l, h);
      pos.resize(want.size());
      REQUIRE(pos == std::vector<std::int32_t>(want.begin(), want.end()));
    }
  }
  REQUIRE(kvp_session_clear_reconstruction(s) == KVP_OK);
  REQUIRE(kvp_session_clear_reconstruction(nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  kvp_session_destroy(s);
  kvp_policy_destroy(pol);
}

}  // namespace kvt_scorers_kvzip
