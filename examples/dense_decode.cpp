// A decode loop whose KV cache lives in a kvpolicy::Session: prefill, compress to the budget,
// then generate. The "model" is a stand-in (random projections of a random token stream): what
// matters is the order of calls an engine makes per layer, and what the cache holds after.
//
//   dense_decode [spec] [budget ratio]      default: "h2o(sinks=4)" 0.25
//
// H2O is a decode-time policy: after the prefill compression every new token evicts one, so
// each head's cache stays at its budget while attention statistics keep accumulating.
#include <kvpolicy/kvpolicy.hpp>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

int main(int argc, char** argv) try {
  const std::string spec = argc > 1 ? argv[1] : "h2o(sinks=4)";
  const double ratio = argc > 2 ? std::atof(argv[2]) : 0.25;
  const std::int64_t layers = 4, kv_heads = 2, q_heads = 8, dim = 64, prompt = 512, steps = 64;

  kvpolicy::SessionConfig cfg;
  cfg.layers = layers, cfg.kv_heads = kv_heads, cfg.q_heads = q_heads, cfg.head_dim = dim;
  cfg.budget = kvpolicy::Budget::ratio(ratio);
  kvpolicy::Session<float> cache(kvpolicy::Policy(spec), cfg);

  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  auto random = [&](std::int64_t n) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (float& e : x) e = normal(rng);
    return x;
  };
  std::vector<float> attn(static_cast<std::size_t>(q_heads * prompt * dim));

  // One forward step over n new tokens: per layer, append K/V/Q, attend, compress if due.
  auto forward = [&](std::int64_t n) {
    for (std::int64_t l = 0; l < layers; ++l) {
      const auto k = random(kv_heads * n * dim), v = random(kv_heads * n * dim),
                 q = random(q_heads * n * dim);
      using View = kvpolicy::KVView<const float>;
      cache.append(l, View::hnd(k.data(), 1, kv_heads, n, dim),
                   View::hnd(v.data(), 1, kv_heads, n, dim),
                   View::hnd(q.data(), 1, q_heads, n, dim));
      cache.attend(l, View::hnd(q.data(), 1, q_heads, n, dim), attn.data());
      cache.compress_if_due(l);
    }
  };

  forward(prompt);
  const std::size_t full_bytes = static_cast<std::size_t>(2 * layers * kv_heads * dim) *
                                 sizeof(float);  // per token of an uncompressed cache
  std::printf("policy '%s', budget %.2f: after the %lld-token prompt the cache holds %zu bytes "
              "(full: %zu)\n",
              cache.policy().spec().c_str(), ratio, (long long)prompt, cache.kv_bytes(),
              full_bytes * prompt);
  for (std::int64_t s = 0; s < steps; ++s) forward(1);

  // Decode-time policies stay at the budget; the others grow by one token per head and step.
  // Per-head allocators (adakv) split the budget unevenly, so check the total.
  const std::int64_t budget = static_cast<std::int64_t>(ratio * prompt + 0.5);
  const std::int64_t per_head = cache.policy().decode_time() ? budget : budget + steps;
  std::int64_t total = 0;
  bool ok = true;
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::int64_t h = 0; h < kv_heads; ++h) {
      const auto pos = cache.positions(l, h);
      total += cache.length(l, h);
      ok = ok && pos.back() == prompt + steps - 1;  // the newest token is always kept
      if (l == 0)
        std::printf("layer 0, kv head %lld: %lld tokens, oldest kept position %d, newest %d\n",
                    (long long)h, (long long)cache.length(l, h), pos.front(), pos.back());
    }
  ok = ok && total == layers * kv_heads * per_head;
  std::printf("after %lld decode steps: %zu bytes of K/V (full: %zu) -> %s\n", (long long)steps,
              cache.kv_bytes(), full_bytes * (prompt + steps), ok ? "ok" : "UNEXPECTED");
  return ok ? 0 : 1;
} catch (const kvpolicy::Error& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
