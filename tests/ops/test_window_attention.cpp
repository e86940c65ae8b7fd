// cpu::window_attention against a naive double-precision explicit-softmax reference.
#include <catch2/catch.hpp>

#include <vector>

#include <kvpolicy/cpu/window_attention.hpp>

#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_window_attention {

using kvpolicy::GqaReduce;
using kvpolicy::KVView;
using Catch::Matchers::Contains;

namespace {

struct Shape {
  std::int64_t L, Hkv, g, T, nq, d;
};

// Runs the op and the reference on random data; returns the largest error relative to
// max(1, max |ref|).
template <class T>
double run_case(const Shape& s, GqaReduce reduce, kvpolicy::Layout layout, std::uint64_t seed,
                int threads = 1) {
  kvtest::Rng rng(seed);
  auto kbuf = rng.normals<T>(s.L * s.Hkv * s.T * s.d);
  auto qbuf = rng.normals<T>(s.L * s.Hkv * s.g * s.nq * s.d);
  auto keys = KVView<const T>::make(layout, kbuf.data(), s.L, s.Hkv, s.T, s.d);
  auto queries = KVView<const T>::make(layout, qbuf.data(), s.L, s.Hkv * s.g, s.nq, s.d);
  kvpolicy::ScoreMap out;
  kvpolicy::cpu::window_attention(kvpolicy::cpu_backend{threads}, keys, queries, reduce, out);
  REQUIRE(out.layers() == s.L);
  REQUIRE(out.heads() == s.Hkv);
  REQUIRE(out.tokens() == s.T);
  const auto ref = kvtest::naive_window_attention(keys, queries, reduce);
  std::vector<float> got(out.data(), out.data() + ref.size());
  return kvtest::max_rel_err(got, ref);
}

}  // namespace

TEMPLATE_TEST_CASE("window_attention matches the naive reference (GQA, reductions, dtypes)",
                   "[ops]", float, kvpolicy::half, kvpolicy::bfloat16) {
  const auto reduce = GENERATE(GqaReduce::mean, GqaReduce::max, GqaReduce::sum);
  const std::int64_t g = GENERATE(1, 3, 4, 8);
  const std::int64_t T = 29;
  const std::int64_t nq = GENERATE(29, 6, 1);  // n_q == T is H2O prefill
  const auto layout = GENERATE(kvpolicy::Layout::HND, kvpolicy::Layout::NHD);
  INFO("g=" << g << " nq=" << nq << " reduce=" << static_cast<int>(reduce)
            << " layout=" << static_cast<int>(layout));
  const double err =
      run_case<TestType>({2, 2, g, T, nq, 16}, reduce, layout, 100 + g * 7 + nq);
  CHECK(err < 2e-6);
}

TEST_CASE("window_attention: n_q == T over several query blocks of 64", "[ops]") {
  // Row blocks stack 128 / g queries of each query head (42 at g = 3: blocks of 42, 42, 42 and
  // 24, in up to 16 chunks of work per KV head), so a 150-query prefill spans several blocks.
  const double err = run_case<float>({1, 2, 3, 150, 150, 32}, GqaReduce::mean,
                                     kvpolicy::Layout::HND, 5);
  CHECK(err < 2e-6);
  const double err_tail = run_case<kvpolicy::half>({1, 1, 2, 150, 97, 8}, GqaReduce::sum,
                                                   kvpolicy::Layout::NHD, 6);
  CHECK(err_tail < 2e-6);
}

TEST_CASE("window_attention: long T shrinks the strip into many small query blocks", "[ops]") {
  // g*T = 160000 > kStripFloats/64, so a block has at most kStripFloats/(g*T) = 26 queries (and
  // 128 / g = 16 rows per head): the 40 window queries take several blocks, each later one with
  // a longer causal horizon.
  const Shape s{1, 1, 8, 20000, 40, 4};
  const std::int64_t bq = kvpolicy::cpu::kStripFloats / (s.g * s.T);
  REQUIRE(bq > 1);
  REQUIRE(bq < 64);
  REQUIRE(s.nq > bq);
  CHECK(run_case<float>(s, GqaReduce::mean, kvpolicy::Layout::HND, 9) < 2e-6);
}

TEST_CASE("window_attention: exact values on a tiny hand-checked case", "[ops]") {
  // d = 1, keys 0, 0, 0: every query spreads its attention uniformly over the keys it sees.
  std::vector<float> k = {0, 0, 0}, q = {1, 2, 3};
  kvpolicy::ScoreMap out;
  kvpolicy::cpu::window_attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(k.data(), 1, 1, 3, 1),
                                  KVView<const float>::hnd(q.data(), 1, 1, 3, 1),
                                  GqaReduce::mean, out);
  // Query 0 sees key 0 (1), query 1 sees keys 0..1 (1/2 each), query 2 sees all (1/3 each).
  CHECK(out.row(0, 0)[0] == Approx(1 + 0.5 + 1.0 / 3));
  CHECK(out.row(0, 0)[1] == Approx(0.5 + 1.0 / 3));
  CHECK(out.row(0, 0)[2] == Approx(1.0 / 3));
  // Two queries (positions 1 and 2) over three keys.
  kvpolicy::cpu::window_attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(k.data(), 1, 1, 3, 1),
                                  KVView<const float>::hnd(q.data(), 1, 1, 2, 1),
                                  GqaReduce::mean, out);
  CHECK(out.row(0, 0)[0] == Approx(0.5 + 1.0 / 3));
  CHECK(out.row(0, 0)[2] == Approx(1.0 / 3));
}

TEST_CASE("window_attention rejects bad shapes with messages", "[ops]") {
  std::vector<float> k(2 * 10 * 8), q(6 * 12 * 8);
  const auto keys = KVView<const float>::hnd(k.data(), 1, 2, 10, 8);
  kvpolicy::ScoreMap out;
  const kvpolicy::cpu_backend be{1};
  CHECK_THROWS_WITH(kvpolicy::cpu::window_attention(
                        be, keys, KVView<const float>::hnd(q.data(), 1, 3, 4, 8), GqaReduce::mean, out),
                    Contains("3 query heads are not a multiple of 2 KV heads"));
  CHECK_THROWS_WITH(kvpolicy::cpu::window_attention(
                        be, keys, KVView<const float>::hnd(q.data(), 1, 4, 11, 8), GqaReduce::mean, out),
                    Contains("need 1..10 queries, got 11"));
  CHECK_THROWS_WITH(kvpolicy::cpu::window_attention(
                        be, keys, KVView<const float>::hnd(q.data(), 1, 4, 0, 8), GqaReduce::mean, out),
                    Contains("got 0"));
  CHECK_THROWS_WITH(kvpolicy::cpu::window_attention(
                        be, keys, KVView<const float>::hnd(q.data(), 1, 4, 5, 4), GqaReduce::mean, out),
                    Contains("query head_dim 4 != key head_dim 8"));
}

}  // namespace kvt_ops_window_attention
