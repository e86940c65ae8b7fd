// Policy::compress / Pipeline::compress on bad input: every problem raises kvpolicy::Error with a
// message naming it, and no buffer is modified.
#include <catch2/catch.hpp>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "common/error_of.hpp"
#include "common/random.hpp"
#include "ops/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_core_compress_errors {

using kvpolicy::Budget;
using kvpolicy::KVView;
using Catch::Matchers::Contains;

namespace {

using kvtest::error_of;

template <class T>
struct Fixture {
  static constexpr std::int64_t L = 2, H = 2, g = 2, N = 24, D = 8, NQ = 8;
  std::vector<T> k, v, q, q_big;
  Fixture() {
    kvtest::Rng rng(2024);
    k = rng.normals<T>(L * H * N * D);
    v = rng.normals<T>(L * H * N * D);
    q = rng.normals<T>(L * H * g * NQ * D);
    q_big = rng.normals<T>(L * 3 * H * g * (N + 1) * D);  // room for any bad query shape
  }
  KVView<T> keys() { return KVView<T>::hnd(k.data(), L, H, N, D); }
  KVView<T> values() { return KVView<T>::hnd(v.data(), L, H, N, D); }
  KVView<const T> queries() const { return KVView<const T>::hnd(q.data(), L, H * g, NQ, D); }
};

// Runs `compress` through a Policy and through the equivalent Pipeline.
template <class T>
using CompressFn = std::function<kvpolicy::Selection(const KVView<T>&, const KVView<T>&,
                                                     const kvpolicy::Inputs<T>&, const Budget&)>;

template <class T>
std::vector<std::pair<std::string, CompressFn<T>>> compressors() {
  const kvpolicy::Policy policy("snapkv(window=4,kernel=3)");
  const kvpolicy::Pipeline<kvpolicy::SnapKV, kvpolicy::Uniform> pipeline(
      kvpolicy::SnapKV{4, 3, kvpolicy::Pool::avg, kvpolicy::GqaReduce::mean, 0}, kvpolicy::Uniform{});
  const kvpolicy::cpu_backend be{1};
  return {
      {"Policy", [=](auto& k, auto& v, auto& in, auto& b) { return policy.compress(be, k, v, in, b); }},
      {"Pipeline", [=](auto& k, auto& v, auto& in, auto& b) { return pipeline.compress(be, k, v, in, b); }},
  };
}

}  // namespace

TEMPLATE_TEST_CASE("compress: bad input raises an error naming it and modifies no buffer", "[core]",
                   float, kvpolicy::half) {
  using T = TestType;
  using F = Fixture<T>;
  const int which = GENERATE(0, 1);
  const auto entry = compressors<T>()[static_cast<std::size_t>(which)];
  const CompressFn<T>& compress = entry.second;
  INFO(entry.first);
  F f;
  const auto k0 = kvtest::bytes_of(f.k), v0 = kvtest::bytes_of(f.v);
  kvpolicy::Inputs<T> in;
  in.queries = f.queries();
  // Expects an error containing `expect` and K/V bytes unchanged by the call.
  auto rejected = [&](const Budget& budget, const std::string& expect, KVView<T> keys,
                      KVView<T> values, const kvpolicy::Inputs<T>& inputs) {
    INFO("expecting: " << expect);
    const auto kb = kvtest::bytes_of(f.k), vb = kvtest::bytes_of(f.v);
    CHECK_THAT(error_of([&] { compress(keys, values, inputs, budget); }), Contains(expect));
    CHECK(kvtest::bytes_of(f.k) == kb);
    CHECK(kvtest::bytes_of(f.v) == vb);
  };
  const T nan = kvpolicy::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  const T inf = kvpolicy::from_float<T>(std::numeric_limits<float>::infinity());
  SECTION("NaN / Inf in keys, values, queries") {
    f.keys().at(1, 1, 5, 3) = nan;
    rejected(Budget::tokens(10),
             "keys contains a non-finite value (nan) at layer 1, head 1, token 5, dim 3",
             f.keys(), f.values(), in);
    f.keys().at(1, 1, 5, 3) = kvpolicy::from_float<T>(0.25f);
    f.values().at(0, 1, 23, 0) = inf;
    rejected(Budget::tokens(10),
             "values contains a non-finite value (inf) at layer 0, head 1, token 23, dim 0",
             f.keys(), f.values(), in);
    f.values().at(0, 1, 23, 0) = kvpolicy::from_float<T>(0.5f);
    std::vector<T> qn = f.q;
    KVView<T>::hnd(qn.data(), F::L, F::H * F::g, F::NQ, F::D).at(1, 3, 7, 7) = nan;
    kvpolicy::Inputs<T> bad_q;
    bad_q.queries = KVView<const T>::hnd(qn.data(), F::L, F::H * F::g, F::NQ, F::D);
    rejected(Budget::tokens(10),
             "queries contains a non-finite value (nan) at layer 1, head 3, token 7, dim 7",
             f.keys(), f.values(), bad_q);
  }
  SECTION("wrong shapes") {
    // values with a different token count / head count
    auto v_short = KVView<T>::hnd(f.v.data(), F::L, F::H, F::N - 1, F::D);
    rejected(Budget::tokens(10), "values shape [2,2,23,8] does not match keys [2,2,24,8]", f.keys(), v_short, in);
    auto v_heads = KVView<T>::hnd(f.v.data(), F::L, 1, F::N, F::D);
    rejected(Budget::tokens(10), "values shape [2,1,24,8] does not match keys", f.keys(), v_heads, in);
    // queries: head_dim, head count, too many, layers
    kvpolicy::Inputs<T> bad = in;
    bad.queries = KVView<const T>::hnd(f.q_big.data(), F::L, F::H * F::g, F::NQ, 4);
    rejected(Budget::tokens(10), "queries head_dim 4 differs from keys head_dim 8", f.keys(), f.values(), bad);
    bad.queries = KVView<const T>::hnd(f.q_big.data(), F::L, 3, F::NQ, F::D);
    rejected(Budget::tokens(10), "queries: 3 query heads are not a multiple of 2 KV heads", f.keys(), f.values(), bad);
    bad.queries = KVView<const T>::hnd(f.q_big.data(), F::L, F::H * F::g, F::N + 1, F::D);
    rejected(Budget::tokens(10), "queries: 25 queries for only 24 keys", f.keys(), f.values(), bad);
    bad.queries = KVView<const T>::hnd(f.q_big.data(), 1, F::H * F::g, F::NQ, F::D);
    rejected(Budget::tokens(10), "queries have 1 layers but keys have 2", f.keys(), f.values(), bad);
    // missing queries for a policy that reads them
    rejected(Budget::tokens(10), "needs the last 4 queries but none were given", f.keys(), f.values(),
             kvpolicy::Inputs<T>{});
    // overlapping key strides
    auto k_bad = f.keys();
    k_bad.stride_token = 4;
    rejected(Budget::tokens(10), "keys: token stride 4 overlaps", k_bad, f.values(), in);
  }
  SECTION("bad budgets") {
    rejected(Budget::tokens(-1), "budget is negative (-1)", f.keys(), f.values(), in);
    rejected(Budget::total(-5), "budget is negative (-5)", f.keys(), f.values(), in);
    rejected(Budget::ratio(-0.5), "budget is negative (-0.5)", f.keys(), f.values(), in);
    rejected(Budget::ratio(std::nan("")), "budget is not a finite number", f.keys(), f.values(), in);
    rejected(Budget::ratio(1.5), "budget ratio 1.5 is above 1", f.keys(), f.values(), in);
  }
  SECTION("control: valid input compacts K and V in place") {
    const auto sel = compress(f.keys(), f.values(), in, Budget::tokens(10));
    REQUIRE(sel.layers() == F::L);
    REQUIRE(sel.heads() == F::H);
    std::vector<T> k_orig(F::L * F::H * F::N * F::D), v_orig = k_orig;
    std::memcpy(static_cast<void*>(k_orig.data()), k0.data(), k0.size());
    std::memcpy(static_cast<void*>(v_orig.data()), v0.data(), v0.size());
    const auto ko = KVView<T>::hnd(k_orig.data(), F::L, F::H, F::N, F::D);
    const auto vo = KVView<T>::hnd(v_orig.data(), F::L, F::H, F::N, F::D);
    for (std::int64_t l = 0; l < F::L; ++l)
      for (std::int64_t h = 0; h < F::H; ++h) {
        auto kept = sel.kept(l, h);
        REQUIRE(kept.size() == 10);
        CHECK(kept[9] == 23);  // the window's tokens are kept
        CHECK(kept[6] == 20);
        for (std::size_t i = 0; i < kept.size(); ++i)
          for (std::int64_t e = 0; e < F::D; ++e) {
            REQUIRE(kvpolicy::to_float(f.keys().at(l, h, static_cast<std::int64_t>(i), e)) ==
                    kvpolicy::to_float(ko.at(l, h, kept[i], e)));
            REQUIRE(kvpolicy::to_float(f.values().at(l, h, static_cast<std::int64_t>(i), e)) ==
                    kvpolicy::to_float(vo.at(l, h, kept[i], e)));
          }
      }
    CHECK(kvtest::bytes_of(f.k) != k0);
  }
}

}  // namespace kvt_core_compress_errors
