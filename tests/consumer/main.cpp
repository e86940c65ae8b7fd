// Uses an installed kvpolicy: compresses a small random cache with SnapKV through the runtime
// Policy and the compile-time Pipeline, and checks what an engine relies on. Exit 0 on success.
#include <kvpolicy/kvpolicy.hpp>
#if defined(KVP_CONSUMER_CUDA)
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

}  // namespace

int main() {
  constexpr std::int64_t L = 2, Hkv = 2, Hq = 4, T = 48, d = 16, nq = 4, keep = 12;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  auto random = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = normal(rng);
    return v;
  };
  std::vector<float> k = random(L * Hkv * T * d), v = random(L * Hkv * T * d),
                     q = random(L * Hq * nq * d);
  const std::vector<float> k0 = k;

  using kvpolicy::KVView;
  const auto keys = KVView<float>::hnd(k.data(), L, Hkv, T, d);
  const auto values = KVView<float>::hnd(v.data(), L, Hkv, T, d);
  kvpolicy::Inputs<float> in;
  in.queries = KVView<const float>::hnd(q.data(), L, Hq, nq, d);

  const kvpolicy::cpu_backend cpu{};
  const kvpolicy::Budget budget = kvpolicy::Budget::tokens(keep);

  // The compile-time pipeline selects (without compacting) what the runtime policy keeps.
  kvpolicy::Inputs<float> sel_in = in;
  sel_in.keys = keys;
  sel_in.values = values;
  const kvpolicy::Pipeline<kvpolicy::SnapKV, kvpolicy::Uniform> pipeline(
      kvpolicy::SnapKV{.window = 4},
      kvpolicy::Uniform{});
  const kvpolicy::Selection expected = pipeline.select(cpu, sel_in, budget);

  const kvpolicy::Policy policy("snapkv(window=4) | uniform");
  check(policy.scorer_name() == "snapkv", "scorer name");
  const kvpolicy::Selection sel = policy.compress(cpu, keys, values, in, budget);

  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < Hkv; ++h) {
      auto kept = sel.kept(l, h);
      check(sel.count(l, h) == keep, "every head keeps the budget");
      check(std::equal(kept.begin(), kept.end(), expected.kept(l, h).begin(),
                       expected.kept(l, h).end()),
            "Policy and Pipeline agree");
      for (std::int64_t j = T - 4; j < T; ++j)
        check(std::find(kept.begin(), kept.end(), static_cast<std::int32_t>(j)) != kept.end(),
              "the observation window is kept");
      for (std::size_t i = 0; i < kept.size(); ++i) {
        check(i == 0 || kept[i] > kept[i - 1], "kept indices ascend");
        for (std::int64_t e = 0; e < d; ++e)
          check(keys.at(l, h, static_cast<std::int64_t>(i), e) ==
                    k0[static_cast<std::size_t>(((l * Hkv + h) * T + kept[i]) * d + e)],
                "compacted row i holds the i-th kept key");
      }
    }

  try {
    kvpolicy::Policy bad("snapkv(windw=4)");
    check(false, "an unknown parameter is rejected");
  } catch (const kvpolicy::Error& e) {
    check(std::string(e.what()).find("window") != std::string::npos,
          "the error lists the valid parameters");
  }

#if defined(KVP_CONSUMER_CUDA)
  // Links against the installed kvpolicy::cuda and the CUDA runtime; a GPU is not required.
  std::printf("kvpolicy consumer: kvpolicy::cuda linked, %d CUDA device(s)\n",
              kvpolicy::cuda::device_count());
#endif

  if (failures) {
    std::fprintf(stderr, "kvpolicy consumer: %d check(s) failed\n", failures);
    return 1;
  }
  std::printf("kvpolicy consumer: OK (%lld of %lld tokens kept per head)\n",
              static_cast<long long>(keep), static_cast<long long>(T));
  return 0;
}
