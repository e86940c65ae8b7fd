// cpu::attention over a ragged cache: naive reference, causal prefill, log_count bias, H2O
// statistics and argument checks.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include <kvpolicy/cpu/attention.hpp>

#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_attention {

using kvpolicy::KVView;
using Catch::Matchers::Contains;

TEMPLATE_TEST_CASE("attention over a ragged cache matches the naive reference", "[ops]", float,
                   kvpolicy::half, kvpolicy::bfloat16) {
  const bool causal = GENERATE(false, true);
  const bool with_bias = GENERATE(false, true);
  const auto layout = GENERATE(kvpolicy::Layout::HND, kvpolicy::Layout::NHD);
  const std::int64_t Hkv = 3, g = 2, cap = 20, d = 16, nq = 5;
  kvtest::Rng rng(31 + causal * 2 + with_bias);
  auto kb = rng.normals<TestType>(Hkv * cap * d), vb = rng.normals<TestType>(Hkv * cap * d);
  auto qb = rng.normals<TestType>(Hkv * g * nq * d);
  std::vector<float> bias(static_cast<std::size_t>(Hkv * (cap + 3)));
  for (auto& b : bias) b = static_cast<float>(rng.uniform(0.0, 2.0));
  const auto K = KVView<const TestType>::make(layout, kb.data(), 1, Hkv, cap, d);
  const auto V = KVView<const TestType>::make(layout, vb.data(), 1, Hkv, cap, d);
  const auto Q = KVView<const TestType>::make(layout, qb.data(), 1, Hkv * g, nq, d);
  // Different lengths per KV head; with causal, the head of length 3 < n_q has queries that see
  // no key at all (zero output).
  const std::vector<std::int64_t> lengths = {20, 3, 11};
  kvpolicy::cpu::RaggedAttentionArgs args;
  args.lengths = lengths.data();
  args.causal = causal;
  if (with_bias) args.bias = bias.data(), args.bias_stride = cap + 3;
  std::vector<float> out(static_cast<std::size_t>(Hkv * g * nq * d), 123.f);
  kvpolicy::cpu::attention(kvpolicy::cpu_backend{2}, K, V, Q, args, out.data());
  const auto ref = kvtest::naive_attention(K, V, Q, lengths, causal, args.bias, args.bias_stride);
  INFO("causal=" << causal << " bias=" << with_bias << " layout=" << static_cast<int>(layout));
  CHECK(kvtest::max_rel_err(out, ref) < 2e-6);
  if (causal) {
    // Query 0 of a head of length 3 with 5 queries sees max(0, 3 - 5 + 0 + 1) = 0 keys.
    for (std::int64_t e = 0; e < d; ++e) CHECK(out[static_cast<std::size_t>((2 * nq + 0) * d + e)] == 0.f);
  }
}

TEST_CASE("attention accumulates H2O statistics over the valid keys", "[ops]") {
  const std::int64_t Hkv = 2, g = 3, cap = 12, d = 8, nq = 4;
  kvtest::Rng rng(8);
  auto kb = rng.normals(Hkv * cap * d), vb = rng.normals(Hkv * cap * d), qb = rng.normals(Hkv * g * nq * d);
  const auto K = KVView<const float>::hnd(kb.data(), 1, Hkv, cap, d);
  const auto V = KVView<const float>::hnd(vb.data(), 1, Hkv, cap, d);
  const auto Q = KVView<const float>::hnd(qb.data(), 1, Hkv * g, nq, d);
  const std::vector<std::int64_t> lengths = {12, 7};
  const std::int64_t stride = cap + 2;
  std::vector<float> acc(static_cast<std::size_t>(Hkv * stride), 0.5f), obs(acc.size(), 1.f);
  kvpolicy::cpu::RaggedAttentionArgs args;
  args.lengths = lengths.data();
  args.causal = true;
  args.accumulate = acc.data();
  args.observed = obs.data();
  args.state_stride = stride;
  args.acc_scale = 1.f / 3;
  std::vector<float> out(static_cast<std::size_t>(Hkv * g * nq * d));
  kvpolicy::cpu::attention(kvpolicy::cpu_backend{1}, K, V, Q, args, out.data());
  std::vector<double> ref_acc(static_cast<std::size_t>(Hkv * cap), 0.0);
  kvtest::naive_attention(K, V, Q, lengths, true, nullptr, 0, &ref_acc, 1.0 / 3);
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t j = 0; j < stride; ++j) {
      INFO("head " << h << " key " << j);
      const auto s = static_cast<std::size_t>(h * stride + j);
      const std::int64_t len = lengths[static_cast<std::size_t>(h)];
      if (j >= len) {  // beyond the valid keys nothing changes
        CHECK(acc[s] == 0.5f);
        CHECK(obs[s] == 1.f);
        continue;
      }
      CHECK(acc[s] == Approx(0.5 + ref_acc[static_cast<std::size_t>(h * cap + j)]).margin(1e-6));
      // Causal: key j is seen by the queries at positions >= j among len-nq..len-1.
      const std::int64_t seen = len - std::max(j, len - nq);
      CHECK(obs[s] == 1.f + static_cast<float>(seen));
    }
}

TEST_CASE("attention: GQA row blocks (g * n_q > 128, a block ending inside a query head) match "
          "the reference and do not depend on the thread count", "[ops]") {
  // Rows of KV head h are the g query heads' n_q queries stacked: 3 * 50 = 150 rows, cut into
  // blocks of 128 and 22; the first block ends at query 28 of the third query head.
  const std::int64_t Hkv = 2, g = 3, cap = 80, d = 16, nq = 50;
  kvtest::Rng rng(12);
  auto kb = rng.normals(Hkv * cap * d), vb = rng.normals(Hkv * cap * d), qb = rng.normals(Hkv * g * nq * d);
  const auto K = KVView<const float>::hnd(kb.data(), 1, Hkv, cap, d);
  const auto V = KVView<const float>::hnd(vb.data(), 1, Hkv, cap, d);
  const auto Q = KVView<const float>::nhd(qb.data(), 1, Hkv * g, nq, d);  // strided queries
  const std::vector<std::int64_t> lengths = {80, 61};
  std::vector<std::vector<float>> outs, accs;
  for (int threads : {1, 2}) {
    std::vector<float> acc(static_cast<std::size_t>(Hkv * cap), 0.f), obs(acc.size(), 0.f);
    kvpolicy::cpu::RaggedAttentionArgs args;
    args.lengths = lengths.data();
    args.causal = true;
    args.accumulate = acc.data();
    args.observed = obs.data();
    args.state_stride = cap;
    std::vector<float> out(static_cast<std::size_t>(Hkv * g * nq * d), 7.f);
    kvpolicy::cpu::attention(kvpolicy::cpu_backend{threads}, K, V, Q, args, out.data());
    outs.push_back(out);
    accs.push_back(acc);
  }
  CHECK(outs[0] == outs[1]);  // bitwise: blocks are fixed by the shape
  CHECK(accs[0] == accs[1]);
  std::vector<double> ref_acc(static_cast<std::size_t>(Hkv * cap), 0.0);
  const auto ref = kvtest::naive_attention(K, V, Q, lengths, true, nullptr, 0, &ref_acc, 1.0);
  CHECK(kvtest::max_rel_err(outs[0], ref) < 2e-6);
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t j = 0; j < lengths[static_cast<std::size_t>(h)]; ++j)
      CHECK(accs[0][static_cast<std::size_t>(h * cap + j)] ==
            Approx(ref_acc[static_cast<std::size_t>(h * cap + j)]).margin(2e-5));
}

TEST_CASE("log_count bias: n copies of a token equal one copy with bias log(n)", "[ops]") {
  const std::int64_t Hkv = 2, g = 2, d = 32, nq = 3, T = 9;
  kvtest::Rng rng(12);
  auto kb = rng.normals(Hkv * T * d), vb = rng.normals(Hkv * T * d), qb = rng.normals(Hkv * g * nq * d);
  // Token j is repeated counts[h][j] times in the expanded cache.
  const std::vector<std::vector<int>> counts = {{1, 3, 1, 1, 7, 1, 2, 1, 1}, {4, 1, 1, 2, 1, 1, 1, 1, 5}};
  std::int64_t cap = 0;
  for (auto& c : counts) {
    std::int64_t n = 0;
    for (int x : c) n += x;
    cap = std::max(cap, n);
  }
  std::vector<float> ke(static_cast<std::size_t>(Hkv * cap * d)), ve(ke.size());
  std::vector<float> bias(static_cast<std::size_t>(Hkv * T));
  std::vector<std::int64_t> len_e(Hkv), len_m(Hkv, T);
  for (std::int64_t h = 0; h < Hkv; ++h) {
    std::int64_t row = 0;
    for (std::int64_t j = 0; j < T; ++j) {
      const int c = counts[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)];
      bias[static_cast<std::size_t>(h * T + j)] = std::log(static_cast<float>(c));
      for (int r = 0; r < c; ++r, ++row)
        for (std::int64_t e = 0; e < d; ++e) {
          ke[static_cast<std::size_t>((h * cap + row) * d + e)] = kb[static_cast<std::size_t>((h * T + j) * d + e)];
          ve[static_cast<std::size_t>((h * cap + row) * d + e)] = vb[static_cast<std::size_t>((h * T + j) * d + e)];
        }
    }
    len_e[static_cast<std::size_t>(h)] = row;
  }
  const auto Q = KVView<const float>::hnd(qb.data(), 1, Hkv * g, nq, d);
  std::vector<float> out_e(static_cast<std::size_t>(Hkv * g * nq * d)), out_m(out_e.size());
  kvpolicy::cpu::RaggedAttentionArgs ae;
  ae.lengths = len_e.data();
  kvpolicy::cpu::attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(ke.data(), 1, Hkv, cap, d),
                           KVView<const float>::hnd(ve.data(), 1, Hkv, cap, d), Q, ae, out_e.data());
  kvpolicy::cpu::RaggedAttentionArgs am;
  am.lengths = len_m.data();
  am.bias = bias.data();
  am.bias_stride = T;
  kvpolicy::cpu::attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(kb.data(), 1, Hkv, T, d),
                           KVView<const float>::hnd(vb.data(), 1, Hkv, T, d), Q, am, out_m.data());
  double worst = 0;
  for (std::size_t i = 0; i < out_e.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(out_e[i]) - out_m[i]));
  CHECK(worst < 4e-6);  // fp32 rounding of outputs of magnitude ~1
  // The bias matters: without it the outputs differ clearly.
  am.bias = nullptr;
  kvpolicy::cpu::attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(kb.data(), 1, Hkv, T, d),
                           KVView<const float>::hnd(vb.data(), 1, Hkv, T, d), Q, am, out_m.data());
  double diff = 0;
  for (std::size_t i = 0; i < out_e.size(); ++i)
    diff = std::max(diff, std::abs(static_cast<double>(out_e[i]) - out_m[i]));
  CHECK(diff > 1e-2);
}

TEST_CASE("attention rejects bad arguments with messages", "[ops]") {
  std::vector<float> k(2 * 8 * 4), q(6 * 2 * 4), out(6 * 2 * 4);
  const auto K = KVView<const float>::hnd(k.data(), 1, 2, 8, 4);
  const std::vector<std::int64_t> ok = {8, 2}, too_long = {8, 9}, negative = {-1, 2};
  kvpolicy::cpu::RaggedAttentionArgs args;
  args.lengths = ok.data();
  const kvpolicy::cpu_backend be{1};
  CHECK_NOTHROW(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 1, 4, 2, 4), args, out.data()));
  CHECK_THROWS_WITH(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 1, 3, 2, 4), args, out.data()),
                    Contains("3 query heads are not a multiple of 2 KV heads"));
  CHECK_THROWS_WITH(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 1, 2, 2, 3), args, out.data()),
                    Contains("head_dim mismatch (q 3, k 4, v 4)"));
  CHECK_THROWS_WITH(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 2, 2, 1, 4), args, out.data()),
                    Contains("pass one layer"));
  args.lengths = too_long.data();
  CHECK_THROWS_WITH(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 1, 2, 2, 4), args, out.data()),
                    Contains("length 9 of KV head 1 is outside [0, 8]"));
  args.lengths = negative.data();
  CHECK_THROWS_WITH(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 1, 2, 2, 4), args, out.data()),
                    Contains("length -1 of KV head 0"));
  args.lengths = nullptr;
  CHECK_THROWS_WITH(kvpolicy::cpu::attention(be, K, K, KVView<const float>::hnd(q.data(), 1, 2, 2, 4), args, out.data()),
                    Contains("lengths are required"));
}

}  // namespace kvt_ops_attention
