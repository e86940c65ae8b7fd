// Shared by the one-layer Session tests (merge, quant): random tokens of one layer, sliced into
// the [1][heads][n][d] views Session::append/attend take, and a one-layer SessionConfig.
#pragma once
#include <cstdint>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "common/random.hpp"

namespace kvtest {

// k, v [Hkv][S][d] and q [Hq][S][d] (HND), normally distributed.
template <std::int64_t Hkv, std::int64_t Hq, std::int64_t D>
struct LayerTokens {
  std::int64_t S;
  std::vector<float> k, v, q;

  LayerTokens(std::int64_t s, std::uint64_t seed) : S(s) {
    Rng rng(seed);
    k = rng.normals<float>(Hkv * S * D);
    v = rng.normals<float>(Hkv * S * D);
    q = rng.normals<float>(Hq * S * D);
  }
  // Tokens [t0, t0 + n) of a buffer with `heads` heads.
  kvpolicy::KVView<const float> view(const std::vector<float>& b, std::int64_t heads,
                                     std::int64_t t0, std::int64_t n) const {
    return {b.data() + t0 * D, 1, heads, n, D, heads * S * D, S * D, D, 1};
  }
  kvpolicy::KVView<const float> K(std::int64_t t0, std::int64_t n) const { return view(k, Hkv, t0, n); }
  kvpolicy::KVView<const float> V(std::int64_t t0, std::int64_t n) const { return view(v, Hkv, t0, n); }
  kvpolicy::KVView<const float> Q(std::int64_t t0, std::int64_t n) const { return view(q, Hq, t0, n); }
};

inline kvpolicy::SessionConfig one_layer_config(std::int64_t kv_heads, std::int64_t q_heads,
                                                std::int64_t head_dim, kvpolicy::Budget b,
                                                int threads) {
  kvpolicy::SessionConfig c;
  c.layers = 1;
  c.kv_heads = kv_heads;
  c.q_heads = q_heads;
  c.head_dim = head_dim;
  c.budget = b;
  c.initial_capacity = 8;
  c.backend = kvpolicy::cpu_backend{threads};
  return c;
}

}  // namespace kvtest
