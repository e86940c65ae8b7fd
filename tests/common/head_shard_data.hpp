// Test helper: one event's data for every KV head of a small model, for the tensor-parallel
// tests (tests/core/test_head_shard.cpp, tests/agreement/test_device_head_shard.cpp): K, V, Q
// and the per-token state (H2O sums, kvzip scores). With `ties`, three values only, so that
// key norms and scores repeat across heads and tokens.
#pragma once
#include <cstdint>
#include <vector>

#include "common/random_kv.hpp"

namespace kvtest {

struct HeadShardData {
  Tensor<float> k, v, q;
  std::vector<float> acc, recon;  // [L][H][T]

  HeadShardData(std::uint64_t seed, bool ties, std::int64_t L, std::int64_t H, std::int64_t G,
                std::int64_t T, std::int64_t D, std::int64_t Q) {
    Rng rng(seed);
    auto values = [&](std::int64_t heads, std::int64_t n) {
      std::vector<double> x(static_cast<std::size_t>(L * heads * n * D));
      for (auto& e : x) e = ties ? static_cast<double>(rng.integer(-1, 1)) : 2.0 * rng.uniform();
      return x;
    };
    k = make_tensor<float>(L, H, T, D, values(H, T));
    v = make_tensor<float>(L, H, T, D, values(H, T));
    q = make_tensor<float>(L, H * G, Q, D, values(H * G, Q));
    acc.resize(static_cast<std::size_t>(L * H * T));
    recon.resize(acc.size());
    for (std::size_t i = 0; i < acc.size(); ++i) {
      acc[i] = ties ? static_cast<float>(rng.integer(0, 3)) : static_cast<float>(rng.uniform(0, 5));
      recon[i] = ties ? static_cast<float>(rng.integer(0, 2)) * 0.25f : static_cast<float>(rng.uniform(0, 1));
    }
  }
};

}  // namespace kvtest
