// The CPU ops give bit-identical results for 1 and 2 threads (no cross-thread reductions).
#include <catch2/catch.hpp>

#include <cstring>
#include <stdexcept>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <kvpolicy/cpu/attention.hpp>
#include <kvpolicy/cpu/compact.hpp>
#include <kvpolicy/cpu/select.hpp>
#include <kvpolicy/cpu/window_attention.hpp>

#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_determinism {

using kvpolicy::cpu_backend;
using kvpolicy::KVView;

namespace {
bool same_bits(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}
}  // namespace

TEST_CASE("window_attention is bit-identical across thread counts", "[ops]") {
  // L * Hkv == 1 and > 1: with one work item the loop runs on one thread either way, with
  // several items the items are spread over the threads.
  const std::int64_t Hkv = GENERATE(1, 3);
  const std::int64_t L = 2, g = 4, T = 200, d = 32;  // n_q = T: several query blocks
  kvtest::Rng rng(40 + Hkv);
  auto kb = rng.normals<kvpolicy::half>(L * Hkv * T * d), qb = rng.normals<kvpolicy::half>(L * Hkv * g * T * d);
  const auto K = KVView<const kvpolicy::half>::hnd(kb.data(), L, Hkv, T, d);
  for (std::int64_t nq : {T, std::int64_t{32}}) {
    const auto Q = KVView<const kvpolicy::half>::hnd(qb.data(), L, Hkv * g, nq, d);
    kvpolicy::ScoreMap a, b;
    kvpolicy::cpu::window_attention(cpu_backend{1}, K, Q, kvpolicy::GqaReduce::mean, a);
    kvpolicy::cpu::window_attention(cpu_backend{2}, K, Q, kvpolicy::GqaReduce::mean, b);
    CHECK(same_bits(a.data(), b.data(), static_cast<std::size_t>(L * Hkv * T)));
  }
}

TEST_CASE("attention, select and compact are bit-identical across thread counts", "[ops]") {
  const std::int64_t Hkv = 4, g = 2, cap = 200, d = 32, nq = 7;
  kvtest::Rng rng(50);
  auto kb = rng.normals(Hkv * cap * d), vb = rng.normals(Hkv * cap * d), qb = rng.normals(Hkv * g * nq * d);
  const auto K = KVView<const float>::nhd(kb.data(), 1, Hkv, cap, d);
  const auto V = KVView<const float>::nhd(vb.data(), 1, Hkv, cap, d);
  const auto Q = KVView<const float>::hnd(qb.data(), 1, Hkv * g, nq, d);
  const std::vector<std::int64_t> lengths = {200, 150, 7, 99};
  std::vector<float> bias(static_cast<std::size_t>(Hkv * cap));
  for (auto& x : bias) x = static_cast<float>(rng.uniform(0.0, 1.0));
  std::vector<float> out1(static_cast<std::size_t>(Hkv * g * nq * d)), out2(out1.size());
  std::vector<float> acc1(static_cast<std::size_t>(Hkv * cap), 0.f), acc2 = acc1;
  kvpolicy::cpu::RaggedAttentionArgs args;
  args.lengths = lengths.data();
  args.bias = bias.data();
  args.bias_stride = cap;
  args.causal = true;
  args.state_stride = cap;
  args.accumulate = acc1.data();
  kvpolicy::cpu::attention(cpu_backend{1}, K, V, Q, args, out1.data());
  args.accumulate = acc2.data();
  kvpolicy::cpu::attention(cpu_backend{2}, K, V, Q, args, out2.data());
  CHECK(same_bits(out1.data(), out2.data(), out1.size()));
  CHECK(same_bits(acc1.data(), acc2.data(), acc1.size()));

  kvpolicy::ScoreMap scores(3, Hkv, cap);
  for (std::int64_t i = 0; i < 3 * Hkv * cap; ++i) scores.data()[i] = static_cast<float>(rng.integer(0, 9));
  const std::vector<std::int64_t> budgets(static_cast<std::size_t>(3 * Hkv), 60);
  kvpolicy::Selection s1, s2;
  kvpolicy::cpu::select(cpu_backend{1}, scores, budgets, {4, 8}, s1);
  kvpolicy::cpu::select(cpu_backend{2}, scores, budgets, {4, 8}, s2);
  for (std::int64_t r = 0; r < 3 * Hkv; ++r) {
    auto x = s1.kept(r / Hkv, r % Hkv), y = s2.kept(r / Hkv, r % Hkv);
    REQUIRE(x.size() == 60);
    CHECK(std::equal(x.begin(), x.end(), y.begin(), y.end()));
  }

  auto c1 = rng.normals<kvpolicy::bfloat16>(3 * Hkv * cap * d), c2 = c1;
  kvpolicy::cpu::compact(cpu_backend{1}, KVView<kvpolicy::bfloat16>::nhd(c1.data(), 3, Hkv, cap, d), s1);
  kvpolicy::cpu::compact(cpu_backend{2}, KVView<kvpolicy::bfloat16>::nhd(c2.data(), 3, Hkv, cap, d), s1);
  CHECK(kvtest::bytes_of(c1) == kvtest::bytes_of(c2));
}

TEST_CASE("parallel_for: items run single-threaded, errors reach the caller", "[ops]") {
#if defined(_OPENMP)
  const int before = omp_get_max_threads();
  for (int threads : {0, 1, 2})
    for (std::int64_t n : {1, 5}) {
      INFO("threads " << threads << " n " << n);
      std::vector<int> nested(static_cast<std::size_t>(n), -1);
      kvpolicy::cpu::parallel_for(cpu_backend{threads}, n, [&](std::int64_t i) {
        nested[static_cast<std::size_t>(i)] = omp_get_max_threads();  // what a nested GEMM would get
      });
      for (int x : nested) CHECK(x == 1);
    }
  CHECK(omp_get_max_threads() == before);  // the caller's setting is untouched
#endif
  std::vector<int> done(6, 0);
  CHECK_THROWS_WITH(kvpolicy::cpu::parallel_for(cpu_backend{2}, 6,
                                                [&](std::int64_t i) {
                                                  if (i == 3) throw std::runtime_error("item 3");
                                                  done[static_cast<std::size_t>(i)] = 1;
                                                }),
                    "item 3");
  CHECK(done == std::vector<int>{1, 1, 1, 0, 1, 1});  // the other items still ran
}

}  // namespace kvt_ops_determinism
