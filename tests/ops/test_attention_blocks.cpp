// The blockwise kernel behind cpu::attention and cpu::window_attention (detail::fused_attention):
// causal row blocks that skip masked key blocks, chunks of blocks per work item, the split-K
// decode path, and the H2O column sums of both, against the naive reference and bitwise across
// thread counts.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include <kvpolicy/cpu/attention.hpp>
#include <kvpolicy/ops.hpp>

#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_attention_blocks {

using kvpolicy::KVView;
namespace cpu = kvpolicy::cpu;

struct Case {
  std::int64_t Hkv, g, cap, d, nq;
  std::vector<std::int64_t> lengths;
  bool causal, bias;
};

struct Result {
  std::vector<float> out, acc, obs;
};

// Runs cpu::attention with H2O statistics on seeded data.
Result run(const Case& c, int threads, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  auto kb = rng.normals(c.Hkv * c.cap * c.d), vb = rng.normals(c.Hkv * c.cap * c.d);
  auto qb = rng.normals(c.Hkv * c.g * c.nq * c.d);
  std::vector<float> bias(static_cast<std::size_t>(c.Hkv * c.cap));
  for (auto& b : bias) b = static_cast<float>(rng.uniform(0.0, 2.0));
  const auto K = KVView<const float>::hnd(kb.data(), 1, c.Hkv, c.cap, c.d);
  const auto V = KVView<const float>::hnd(vb.data(), 1, c.Hkv, c.cap, c.d);
  const auto Q = KVView<const float>::hnd(qb.data(), 1, c.Hkv * c.g, c.nq, c.d);
  Result r;
  r.out.assign(static_cast<std::size_t>(c.Hkv * c.g * c.nq * c.d), 9.f);
  r.acc.assign(static_cast<std::size_t>(c.Hkv * c.cap), 0.25f);
  r.obs.assign(r.acc.size(), 0.f);
  cpu::RaggedAttentionArgs args;
  args.lengths = c.lengths.data();
  args.causal = c.causal;
  if (c.bias) args.bias = bias.data(), args.bias_stride = c.cap;
  args.accumulate = r.acc.data();
  args.observed = r.obs.data();
  args.state_stride = c.cap;
  args.acc_scale = 0.5f;
  cpu::attention(kvpolicy::cpu_backend{threads}, K, V, Q, args, r.out.data());
  return r;
}

// Checks r against the naive double-precision reference on the same seeded data.
void check_reference(const Case& c, const Result& r, std::uint64_t seed, double tol) {
  kvtest::Rng rng(seed);
  auto kb = rng.normals(c.Hkv * c.cap * c.d), vb = rng.normals(c.Hkv * c.cap * c.d);
  auto qb = rng.normals(c.Hkv * c.g * c.nq * c.d);
  std::vector<float> bias(static_cast<std::size_t>(c.Hkv * c.cap));
  for (auto& b : bias) b = static_cast<float>(rng.uniform(0.0, 2.0));
  const auto K = KVView<const float>::hnd(kb.data(), 1, c.Hkv, c.cap, c.d);
  const auto V = KVView<const float>::hnd(vb.data(), 1, c.Hkv, c.cap, c.d);
  const auto Q = KVView<const float>::hnd(qb.data(), 1, c.Hkv * c.g, c.nq, c.d);
  std::vector<double> acc(static_cast<std::size_t>(c.Hkv * c.cap), 0.0);
  const auto ref = kvtest::naive_attention(K, V, Q, c.lengths, c.causal,
                                           c.bias ? bias.data() : nullptr, c.cap, &acc, 0.5);
  CHECK(kvtest::max_rel_err(r.out, ref) < tol);
  for (std::int64_t h = 0; h < c.Hkv; ++h) {
    const std::int64_t len = c.lengths[static_cast<std::size_t>(h)];
    for (std::int64_t j = 0; j < c.cap; ++j) {
      const auto s = static_cast<std::size_t>(h * c.cap + j);
      INFO("KV head " << h << " key " << j);
      if (j >= len) {  // beyond the valid keys nothing changes
        REQUIRE(r.acc[s] == 0.25f);
        REQUIRE(r.obs[s] == 0.f);
        continue;
      }
      REQUIRE(r.acc[s] == Approx(0.25 + acc[s]).epsilon(1e-4).margin(1e-5));
      const std::int64_t seen = c.causal ? len - std::max(j, len - c.nq) : c.nq;
      REQUIRE(r.obs[s] == static_cast<float>(std::max<std::int64_t>(seen, 0)));
    }
  }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("blockwise prefill attention with H2O sums matches the reference, any thread count",
          "[ops]") {
  // g * n_q > kSplitRows: row blocks of 128 / g queries x g heads, cut into several chunks per
  // KV head; ragged lengths (one shorter than n_q, so causal rows see no key), odd sizes.
  const bool causal = GENERATE(true, false);
  const bool bias = GENERATE(false, true);
  const std::int64_t g = GENERATE(1, 3, 5);
  const Case c{3, g, 301, 13, 300, {301, 257, 31}, causal, bias};
  INFO("causal=" << causal << " bias=" << bias << " g=" << g);
  const std::uint64_t seed = 70 + static_cast<std::uint64_t>(g);
  const Result r1 = run(c, 1, seed);
  check_reference(c, r1, seed, 2e-5);
  for (int threads : {2, 3}) {
    const Result r = run(c, threads, seed);
    CHECK(same_bits(r.out, r1.out));  // items and their sums are fixed by the shapes
    CHECK(same_bits(r.acc, r1.acc));
  }
}

TEST_CASE("split-K decode attention matches the reference, any thread count", "[ops]") {
  // g * n_q <= kSplitRows: a KV head's keys are cut into chunks of kKeyChunk (1024), merged in
  // chunk order. Lengths: several chunks with a short tail, exactly one chunk, one key past a
  // chunk, a single key, an empty head. n_q = 4 causal queries of the head of length 1 see at
  // most one key (three see none).
  const std::int64_t nq = GENERATE(1, 4);
  const bool causal = GENERATE(true, false);
  const bool bias = GENERATE(false, true);
  const Case c{5, 3, 2600, 16, nq, {2600, 1024, 1025, 1, 0}, causal, bias};
  REQUIRE(c.g * c.nq <= cpu::detail::kSplitRows);
  INFO("nq=" << nq << " causal=" << causal << " bias=" << bias);
  const std::uint64_t seed = 90 + static_cast<std::uint64_t>(nq);
  const Result r1 = run(c, 1, seed);
  check_reference(c, r1, seed, 2e-5);
  for (std::int64_t e = 0; e < c.g * c.nq * c.d; ++e)  // the empty head's rows are zeros
    REQUIRE(r1.out[static_cast<std::size_t>(4 * c.g * c.nq * c.d + e)] == 0.f);
  for (int threads : {2, 3}) {
    const Result r = run(c, threads, seed);
    CHECK(same_bits(r.out, r1.out));
    CHECK(same_bits(r.acc, r1.acc));
  }
}

TEST_CASE("blockwise attention: exact values on a hand-checked case", "[ops]") {
  // d = 1, every key 0: each query spreads its attention uniformly over the keys it sees, so
  // its output is the mean of those values and key j collects 1/n from every query seeing n.
  const std::int64_t T = 4;
  std::vector<float> k(T, 0.f), v = {1, 2, 3, 4}, q = {5, -1, 2, 7};
  const std::vector<std::int64_t> len = {T};
  for (const bool causal : {true, false}) {
    std::vector<float> out(T), acc(T, 0.f), obs(T, 0.f);
    cpu::RaggedAttentionArgs args;
    args.lengths = len.data();
    args.causal = causal;
    args.accumulate = acc.data();
    args.observed = obs.data();
    args.state_stride = T;
    cpu::attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(k.data(), 1, 1, T, 1),
                   KVView<const float>::hnd(v.data(), 1, 1, T, 1),
                   KVView<const float>::hnd(q.data(), 1, 1, T, 1), args, out.data());
    if (causal) {
      for (std::int64_t i = 0; i < T; ++i) CHECK(out[static_cast<std::size_t>(i)] == Approx(1 + 0.5 * i));
      CHECK(acc[0] == Approx(1 + 1.0 / 2 + 1.0 / 3 + 1.0 / 4));
      CHECK(acc[3] == Approx(1.0 / 4));
      CHECK(obs == std::vector<float>{4, 3, 2, 1});
    } else {
      for (float o : out) CHECK(o == Approx(2.5));
      for (float a : acc) CHECK(a == Approx(1.0));
      CHECK(obs == std::vector<float>{4, 4, 4, 4});
    }
  }
}

TEST_CASE("ops::window_attention and Session's H2O accumulation are one mechanism", "[ops]") {
  // The same column sums, bit for bit: ops::window_attention (sum over the group) and
  // cpu::attention's accumulate (acc_scale 1, from zero) over the full causal prefill.
  const std::int64_t Hkv = 2, g = 3, T = 333, d = 24;
  kvtest::Rng rng(5);
  auto kb = rng.normals(Hkv * T * d), vb = rng.normals(Hkv * T * d), qb = rng.normals(Hkv * g * T * d);
  const auto K = KVView<const float>::hnd(kb.data(), 1, Hkv, T, d);
  const auto V = KVView<const float>::hnd(vb.data(), 1, Hkv, T, d);
  const auto Q = KVView<const float>::hnd(qb.data(), 1, Hkv * g, T, d);
  kvpolicy::ScoreMap scores;
  kvpolicy::ops::window_attention(kvpolicy::cpu_backend{2}, K, Q, kvpolicy::GqaReduce::sum, scores);
  const std::vector<std::int64_t> lengths(Hkv, T);
  std::vector<float> acc(static_cast<std::size_t>(Hkv * T), 0.f), out(static_cast<std::size_t>(Hkv * g * T * d));
  cpu::RaggedAttentionArgs args;
  args.lengths = lengths.data();
  args.causal = true;
  args.accumulate = acc.data();
  args.state_stride = T;
  cpu::attention(kvpolicy::cpu_backend{1}, K, V, Q, args, out.data());
  CHECK(std::memcmp(acc.data(), scores.data(), acc.size() * sizeof(float)) == 0);
  const auto ref = kvtest::naive_window_attention(K, Q, kvpolicy::GqaReduce::sum);
  CHECK(kvtest::max_rel_err(acc, ref) < 2e-6);
}

TEST_CASE("attention with no queries adds nothing to the H2O statistics", "[ops]") {
  // An empty query block (n_q = 0) is valid: no output rows, and the accumulators the caller
  // passes keep their values exactly.
  const std::int64_t Hkv = 2, g = 2, T = 40, d = 16;
  kvtest::Rng rng(3);
  const auto k = rng.normals(Hkv * T * d), v = rng.normals(Hkv * T * d);
  std::vector<float> q(1);
  const std::vector<std::int64_t> len = {T, 17};
  std::vector<float> acc(static_cast<std::size_t>(Hkv * T), 0.25f), obs(acc.size(), 3.0f);
  cpu::RaggedAttentionArgs a;
  a.lengths = len.data();
  a.causal = true;
  a.accumulate = acc.data();
  a.observed = obs.data();
  a.state_stride = T;
  float out = 7.0f;
  cpu::attention(kvpolicy::cpu_backend{2}, kvpolicy::KVView<const float>::hnd(k.data(), 1, Hkv, T, d),
                 kvpolicy::KVView<const float>::hnd(v.data(), 1, Hkv, T, d),
                 kvpolicy::KVView<const float>::hnd(q.data(), 1, Hkv * g, 0, d), a, &out);
  CHECK(acc == std::vector<float>(acc.size(), 0.25f));
  CHECK(obs == std::vector<float>(obs.size(), 3.0f));
  CHECK(out == 7.0f);
}

}  // namespace kvt_ops_attention_blocks
