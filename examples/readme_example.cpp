// Compress a KV cache to a quarter of its length with SnapKV, in place.
#include <kvpolicy/kvpolicy.hpp>

#include <cstdio>
#include <random>
#include <vector>

int main() {
  const std::int64_t layers = 2, kv_heads = 2, q_heads = 6, tokens = 256, dim = 64, window = 16;
  std::vector<float> k(layers * kv_heads * tokens * dim), v(k.size());
  std::vector<float> q(layers * q_heads * window * dim);  // the last `window` queries
  std::mt19937 rng(0);
  std::normal_distribution<float> normal;
  for (auto* buf : {&k, &v, &q})
    for (float& x : *buf) x = normal(rng);

  // Non-owning views over the engine's memory, [layer][head][token][dim] (HND).
  auto keys = kvpolicy::KVView<float>::hnd(k.data(), layers, kv_heads, tokens, dim);
  auto values = kvpolicy::KVView<float>::hnd(v.data(), layers, kv_heads, tokens, dim);
  kvpolicy::Inputs<float> in;
  in.queries = kvpolicy::KVView<const float>::hnd(q.data(), layers, q_heads, window, dim);

  const kvpolicy::Policy policy("snapkv(window=16,kernel=7,pool=max) | uniform");
  const kvpolicy::Selection kept = policy.compress(kvpolicy::cpu_backend{}, keys, values, in,
                                                   kvpolicy::Budget::ratio(0.25));

  // Rows [0, count) of every (layer, head) now hold the kept tokens, in their original order.
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::int64_t h = 0; h < kv_heads; ++h)
      std::printf("layer %lld, kv head %lld: kept %lld of %lld tokens, last kept %d\n",
                  (long long)l, (long long)h, (long long)kept.count(l, h), (long long)tokens,
                  kept.kept(l, h).back());
  return kept.total() == layers * kv_heads * tokens / 4 ? 0 : 1;
}
