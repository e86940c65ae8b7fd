// PackedCache (residual window) and packed_attention: flush boundaries, token-by-token appends
// equal one bulk append, rotation + norm scaling are exact without quantization, packed attention
// equals attention over the dequantized cache, and on outlier channels + low-norm sink tokens
// int2 with rotation and norm scaling beats KIVI. Then the tile kernels alone.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <kvpolicy/cpu/attention.hpp>
#include <kvpolicy/quant/attention.hpp>

#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_quant_packed_attention {

using Catch::Matchers::Contains;
using kvpolicy::KVView;
namespace q = kvpolicy::quant;
namespace qd = kvpolicy::quant::detail;

namespace {

std::vector<q::PackedCache> make_caches(const q::QuantConfig& c, const std::vector<float>& k,
                                        const std::vector<float>& v, std::int64_t cap, std::int64_t d,
                                        const std::vector<std::int64_t>& lengths) {
  std::vector<q::PackedCache> caches;
  for (std::size_t h = 0; h < lengths.size(); ++h) {
    caches.emplace_back(c, d);
    const auto off = static_cast<std::int64_t>(h) * cap * d;
    caches.back().append(k.data() + off, v.data() + off, lengths[h]);
  }
  return caches;
}

// fp32 ragged attention (cpu::attention) over K/V [Hkv][cap][d].
std::vector<float> dense_attention(const std::vector<float>& k, const std::vector<float>& v,
                                   std::int64_t cap, std::int64_t d, const std::vector<std::int64_t>& lengths,
                                   const std::vector<float>& queries, std::int64_t Hq, std::int64_t nq,
                                   bool causal, const float* bias, std::int64_t bias_stride) {
  const auto Hkv = static_cast<std::int64_t>(lengths.size());
  kvpolicy::cpu::RaggedAttentionArgs a;
  a.lengths = lengths.data();
  a.causal = causal;
  a.bias = bias;
  a.bias_stride = bias_stride;
  std::vector<float> out(static_cast<std::size_t>(Hq * nq * d));
  kvpolicy::cpu::attention(kvpolicy::cpu_backend{1}, KVView<const float>::hnd(k.data(), 1, Hkv, cap, d),
                           KVView<const float>::hnd(v.data(), 1, Hkv, cap, d),
                           KVView<const float>::hnd(queries.data(), 1, Hq, nq, d), a, out.data());
  return out;
}

std::vector<float> run_packed(const std::vector<q::PackedCache>& caches, const std::vector<float>& queries,
                              std::int64_t Hq, std::int64_t nq, std::int64_t d, bool causal,
                              const float* bias, std::int64_t bias_stride, int threads = 2) {
  q::PackedAttentionArgs a;
  a.causal = causal;
  a.bias = bias;
  a.bias_stride = bias_stride;
  std::vector<float> out(static_cast<std::size_t>(Hq * nq * d), 7.f);
  q::packed_attention(kvpolicy::cpu_backend{threads}, std::span<const q::PackedCache>(caches),
                      KVView<const float>::hnd(queries.data(), 1, Hq, nq, d), a, out.data());
  return out;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float v : x) m = std::max(m, double(std::abs(v)));
  return m;
}
double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - b[i]));
  return m;
}
double rel_l2(const std::vector<float>& a, const std::vector<float>& ref) {
  double e = 0, r = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    e += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    r += double(ref[i]) * ref[i];
  }
  return std::sqrt(e / r);
}

bool same_state(const q::PackedCache& a, const q::PackedCache& b) {
  if (a.size() != b.size() || a.packed_tokens() != b.packed_tokens()) return false;
  const auto d = static_cast<std::size_t>(a.head_dim());
  const auto res = static_cast<std::size_t>(a.residual_tokens());
  return (a.tiles() == 0 ||
          (std::memcmp(a.key_tile(0), b.key_tile(0), a.key_tile_size() * static_cast<std::size_t>(a.tiles())) == 0 &&
           std::memcmp(a.value_tile(0), b.value_tile(0), a.value_tile_size() * static_cast<std::size_t>(a.tiles())) == 0)) &&
         (res == 0 || (std::memcmp(a.residual_keys(), b.residual_keys(), res * d * sizeof(float)) == 0 &&
                       std::memcmp(a.residual_values(), b.residual_values(), res * d * sizeof(float)) == 0 &&
                       std::memcmp(a.residual_norms(), b.residual_norms(), res * sizeof(float)) == 0));
}

}  // namespace

TEST_CASE("residual window: aligned flushes, and token-by-token appends equal one bulk append", "[quant]") {
  const int residual = GENERATE(0, 5, 31, 32, 100, 128);
  const std::int64_t d = 64, T = 300, G = 32;
  const q::QuantConfig c{2, 32, residual, true, true};
  kvtest::Rng rng(static_cast<std::uint64_t>(residual) + 1);
  auto k = rng.normals(T * d), v = rng.normals(T * d);
  INFO("residual " << residual);
  q::PackedCache one(c, d), chunks(c, d);
  for (std::int64_t t = 0; t < T; ++t) {
    one.append(k.data() + t * d, v.data() + t * d, 1);
    const std::int64_t n = t + 1;
    const std::int64_t want = G * std::min((std::max<std::int64_t>(0, n - residual) + G - 1) / G, n / G);
    REQUIRE(one.packed_tokens() == want);
    REQUIRE(one.size() == n);
    REQUIRE(one.residual_tokens() <= std::max<std::int64_t>(residual, G - 1));
  }
  // Random chunk sizes crossing block boundaries, and one bulk append.
  for (std::int64_t t = 0; t < T;) {
    const std::int64_t n = std::min<std::int64_t>(T - t, rng.integer(0, 70));
    chunks.append(k.data() + t * d, v.data() + t * d, n);
    t += n;
  }
  q::PackedCache bulk(c, d);
  bulk.append(k.data(), v.data(), T);
  CHECK(same_state(one, bulk));
  CHECK(same_state(chunks, bulk));
  // The packed tiles are exactly what the Quantizer concept's encode() makes of the same tokens.
  const std::int64_t P = bulk.packed_tokens();
  if (P > 0) {
    const q::Int2 quant{c};
    std::vector<std::byte> pk(quant.keys().packed_bytes(P, d)), pv(quant.values().packed_bytes(P, d));
    quant.keys().encode(KVView<const float>::hnd(k.data(), 1, 1, P, d), pk);
    quant.values().encode(KVView<const float>::hnd(v.data(), 1, 1, P, d), pv);
    CHECK(std::memcmp(pk.data(), bulk.key_tile(0), pk.size()) == 0);
    CHECK(std::memcmp(pv.data(), bulk.value_tile(0), pv.size()) == 0);
  }
  CHECK(bulk.memory_bytes() == static_cast<std::size_t>(P / G) * (bulk.key_tile_size() + bulk.value_tile_size()) +
                                   static_cast<std::size_t>(bulk.residual_tokens() * (2 * d + 1)) * sizeof(float));
}

TEST_CASE("PackedCache appends from typed strided views", "[quant]") {
  const std::int64_t d = 64, T = 70;
  kvtest::Rng rng(9);
  std::vector<double> kd(static_cast<std::size_t>(2 * T * d)), vd(kd.size());
  for (auto& x : kd) x = rng.normal();
  for (auto& x : vd) x = rng.normal();
  auto K = kvtest::make_tensor<kvpolicy::half>(1, 2, T, d, kd, kvpolicy::Layout::NHD);
  auto V = kvtest::make_tensor<kvpolicy::half>(1, 2, T, d, vd, kvpolicy::Layout::NHD);
  const q::QuantConfig c{2, 32, 16, true, true};
  q::PackedCache from_view(c, d), from_rows(c, d);
  from_view.append(K.view(), V.view(), 0, 1, 0, 20);
  from_view.append(K.view(), V.view(), 0, 1, 20, T - 20);
  std::vector<float> kr(static_cast<std::size_t>(T * d)), vr(kr.size());
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < d; ++i) {
      kr[static_cast<std::size_t>(t * d + i)] = static_cast<float>(K.ref.at(0, 1, t, i));
      vr[static_cast<std::size_t>(t * d + i)] = static_cast<float>(V.ref.at(0, 1, t, i));
    }
  from_rows.append(kr.data(), vr.data(), T);
  CHECK(same_state(from_view, from_rows));
  CHECK_THROWS_WITH(from_view.append(K.view(), V.view(), 0, 2, 0, 1), Contains("(layer 0, head 2) is outside the views"));
  CHECK_THROWS_WITH(from_view.append(K.view(), V.view(), 0, 0, 60, 11), Contains("tokens [60, 71) are outside the views"));
}

TEST_CASE("rotation and token-norm scaling are exact without quantization", "[quant]") {
  const bool causal = GENERATE(false, true);
  const bool with_bias = GENERATE(false, true);
  const std::int64_t Hkv = 2, g = 3, d = 128, cap = 90, nq = 4;
  kvtest::Rng rng(17 + causal + 2 * with_bias);
  auto k = rng.normals(Hkv * cap * d), v = rng.normals(Hkv * cap * d), qs = rng.normals(Hkv * g * nq * d);
  for (std::int64_t t = 0; t < cap; ++t)  // token norms from 0.01 to ~30
    for (std::int64_t i = 0; i < d; ++i) k[static_cast<std::size_t>(t * d + i)] *= 0.01f + 0.03f * static_cast<float>(t);
  std::vector<float> bias(static_cast<std::size_t>(Hkv * cap));
  for (auto& b : bias) b = static_cast<float>(rng.uniform(0, 2));
  const std::vector<std::int64_t> lengths = {90, 33};
  // residual >= length: everything stays in the fp32 residual, in rotated + normalized form.
  const auto caches = make_caches({2, 32, 1000, true, true}, k, v, cap, d, lengths);
  REQUIRE(caches[0].packed_tokens() == 0);
  const float* bp = with_bias ? bias.data() : nullptr;
  const auto out = run_packed(caches, qs, Hkv * g, nq, d, causal, bp, cap);
  const auto ref = dense_attention(k, v, cap, d, lengths, qs, Hkv * g, nq, causal, bp, cap);
  // Logits up to ~30 * |q| |k~| / sqrt(d) ~ 30; fp32 rounding of the rotation, the division by
  // the norm and the product with it is a few ulp of each logit, ~1e-5 absolute, which moves
  // the outputs (|o| <~ 3) by about as much.
  INFO("max |out - ref| = " << max_diff(out, ref) << ", max |ref| = " << max_abs(ref));
  CHECK(max_diff(out, ref) < 2e-5 * std::max(1.0, max_abs(ref)));
}

TEST_CASE("packed attention equals attention over the dequantized cache", "[quant]") {
  const int bits = GENERATE(2, 4);
  const int group = GENERATE(32, 64);
  const bool transform = GENERATE(true, false);  // int2/int4 vs kivi
  const bool causal = GENERATE(false, true);
  // g * nq query rows go through the kernels 4 at a time: 15 rows end in a block of 3, 9 in a
  // block of 1, 210 in a block of 2. With 70 causal queries, the rows of one block see different
  // numbers of a tile's tokens (some none), and blocks cross from one query head to the next.
  const std::int64_t nq = GENERATE(5, 3, 70);
  const std::int64_t Hkv = 2, g = 3, d = 128, cap = 300;
  const q::QuantConfig c{bits, group, 40, transform, transform};
  kvtest::Rng rng(static_cast<std::uint64_t>(bits * 100 + group + 2 * transform + causal + 7 * nq));
  auto k = rng.normals(Hkv * cap * d, 2.0f), v = rng.normals(Hkv * cap * d), qs = rng.normals(Hkv * g * nq * d);
  std::vector<float> bias(static_cast<std::size_t>(Hkv * cap));
  for (auto& b : bias) b = std::log(static_cast<float>(rng.integer(1, 5)));
  const std::vector<std::int64_t> lengths = {300, 77};  // 77: one packed tile of 64, or 32 + 45
  const auto caches = make_caches(c, k, v, cap, d, lengths);
  REQUIRE(caches[0].tiles() > 0);
  REQUIRE(caches[1].tiles() > 0);
  std::vector<float> kd(k.size()), vd(v.size());
  for (std::int64_t h = 0; h < Hkv; ++h) caches[static_cast<std::size_t>(h)].decode(kd.data() + h * cap * d, vd.data() + h * cap * d);
  const auto out = run_packed(caches, qs, Hkv * g, nq, d, causal, bias.data(), cap);
  const auto ref = dense_attention(kd, vd, cap, d, lengths, qs, Hkv * g, nq, causal, bias.data(), cap);
  // Both compute the same real number in fp32 in a different order: the packed path rotates q
  // and the output (log2(128) = 7 rounded additions each), multiplies each logit by the stored
  // norm instead of using the restored key, and sums the softmax online per tile. Logits are
  // O(10) (|k| ~ 2 sqrt(d)), so each differs by ~1e-6 relative -> ~1e-5 absolute; outputs are
  // O(1). 3e-5 of the output scale leaves headroom but is far below one quantization step (~0.3).
  INFO("bits " << bits << " group " << group << " rotate+norm " << transform << " causal " << causal
               << " nq " << nq << ": max |out - ref| = " << max_diff(out, ref) << ", max |ref| = " << max_abs(ref));
  CHECK(max_diff(out, ref) < 3e-5 * std::max(1.0, max_abs(ref)));
  // Thread count does not change a bit.
  CHECK(run_packed(caches, qs, Hkv * g, nq, d, causal, bias.data(), cap, 1) == out);
}

TEST_CASE("packed attention at decode: long heads split into chunks, merged exactly", "[quant]") {
  // One query row per query head (decode) over heads long enough to be cut into several chunks
  // of 16 units (tiles or residual pieces): 1500 tokens at G = 32 are 46 tiles + 1 residual
  // piece = 3 chunks, 700 tokens 2 chunks, 20 tokens (residual only) one.
  const int bits = GENERATE(2, 4);
  const bool causal = GENERATE(false, true);
  const std::int64_t Hkv = 3, g = 3, d = 64, cap = 1500, nq = 1;
  const q::QuantConfig c{bits, 32, 40, true, true};
  kvtest::Rng rng(static_cast<std::uint64_t>(bits * 10 + causal));
  auto k = rng.normals(Hkv * cap * d, 2.0f), v = rng.normals(Hkv * cap * d), qs = rng.normals(Hkv * g * nq * d);
  std::vector<float> bias(static_cast<std::size_t>(Hkv * cap));
  for (auto& b : bias) b = std::log(static_cast<float>(rng.integer(1, 5)));
  const std::vector<std::int64_t> lengths = {1500, 700, 20};
  const auto caches = make_caches(c, k, v, cap, d, lengths);
  REQUIRE(caches[0].tiles() > 32);
  std::vector<float> kd(k.size()), vd(v.size());
  for (std::int64_t h = 0; h < Hkv; ++h) caches[static_cast<std::size_t>(h)].decode(kd.data() + h * cap * d, vd.data() + h * cap * d);
  const auto out = run_packed(caches, qs, Hkv * g, nq, d, causal, bias.data(), cap);
  const auto ref = dense_attention(kd, vd, cap, d, lengths, qs, Hkv * g, nq, causal, bias.data(), cap);
  INFO("bits " << bits << " causal " << causal << ": max |out - ref| = " << max_diff(out, ref));
  CHECK(max_diff(out, ref) < 3e-5 * std::max(1.0, max_abs(ref)));
  for (int threads : {1, 3}) CHECK(run_packed(caches, qs, Hkv * g, nq, d, causal, bias.data(), cap, threads) == out);
}

namespace {

// Keys with a shared offset in a few outlier channels (queries point away from it, so normal
// tokens get negative logits) and 4 low-norm sink tokens at the start that draw most of the
// attention, the pattern OScaR describes; values with two outlier channels. Token scales vary.
struct OutlierCase {
  std::int64_t Hkv = 2, g = 2, d = 128, T = 512, nq = 4;
  std::vector<float> k, v, qs;
  explicit OutlierCase(std::uint64_t seed) {
    kvtest::Rng rng(seed);
    k = rng.normals(Hkv * T * d);
    v = rng.normals(Hkv * T * d);
    qs = rng.normals(Hkv * g * nq * d);
    for (std::int64_t h = 0; h < Hkv; ++h) {
      std::vector<float> mu(static_cast<std::size_t>(d), 0.0f);
      for (int o = 0; o < 6; ++o) mu[static_cast<std::size_t>(rng.integer(0, d - 1))] = rng.uniform() < 0.5 ? -6.0f : 6.0f;
      for (std::int64_t t = 0; t < T; ++t) {
        float* kr = k.data() + (h * T + t) * d;
        float* vr = v.data() + (h * T + t) * d;
        const bool sink = t < 4;
        const float a = sink ? 0.05f : static_cast<float>(std::exp(rng.uniform(std::log(0.5), std::log(2.0))));
        for (std::int64_t i = 0; i < d; ++i) kr[i] = sink ? a * kr[i] : a * (kr[i] + mu[static_cast<std::size_t>(i)]);
        if (sink)
          for (std::int64_t i = 0; i < d; ++i) vr[i] *= 0.1f;
        else
          vr[5] += 15.0f, vr[77] -= 15.0f;
      }
      for (std::int64_t r = 0; r < g * nq; ++r) {
        float* qr = qs.data() + (h * g * nq + r) * d;
        for (std::int64_t i = 0; i < d; ++i) qr[i] -= 0.3f * mu[static_cast<std::size_t>(i)];
      }
    }
  }
  double error(const q::QuantConfig& c) const {
    const std::vector<std::int64_t> lengths(static_cast<std::size_t>(Hkv), T);
    const auto caches = make_caches(c, k, v, T, d, lengths);
    const auto out = run_packed(caches, qs, Hkv * g, nq, d, false, nullptr, 0);
    const auto ref = dense_attention(k, v, T, d, lengths, qs, Hkv * g, nq, false, nullptr, 0);
    return rel_l2(out, ref);
  }
};

}  // namespace

TEST_CASE("rotation + token-norm scaling beat KIVI on outlier channels and low-norm sinks", "[quant]") {
  // residual 0: every token is quantized, so the comparison measures the codes alone.
  const q::QuantConfig int2{2, 32, 0, true, true}, kivi2{2, 32, 0, false, false};
  const q::QuantConfig rot_only{2, 32, 0, true, false}, norm_only{2, 32, 0, false, true};
  const q::QuantConfig int4{4, 32, 0, true, true}, kivi4{4, 32, 0, false, false};
  const int seeds = 20;
  double sum[6] = {0, 0, 0, 0, 0, 0};
  for (int s = 0; s < seeds; ++s) {
    const OutlierCase oc(1000 + static_cast<std::uint64_t>(s));
    const double e[6] = {oc.error(int2), oc.error(kivi2), oc.error(rot_only), oc.error(norm_only),
                         oc.error(int4), oc.error(kivi4)};
    for (int i = 0; i < 6; ++i) sum[i] += e[i];
    INFO("seed " << s << ": int2 " << e[0] << ", kivi-2 " << e[1] << ", int4 " << e[4] << ", kivi-4 " << e[5]);
    CHECK(e[0] < e[1]);
    CHECK(e[4] < e[5]);
  }
  std::ostringstream os;
  os << "mean relative L2 attention-output error over " << seeds << " seeds: int2 (rotate+norm) "
     << sum[0] / seeds << ", rotate only " << sum[2] / seeds << ", norm only " << sum[3] / seeds
     << ", kivi-2 " << sum[1] / seeds << "; int4 " << sum[4] / seeds << ", kivi-4 " << sum[5] / seeds;
  SUCCEED(os.str());  // shown with -s
  CHECK(sum[0] < 0.5 * sum[1]);
}

TEST_CASE("packed attention and PackedCache reject bad arguments with messages", "[quant]") {
  const std::int64_t d = 64;
  std::vector<float> k(static_cast<std::size_t>(40 * d), 0.5f), qs(static_cast<std::size_t>(4 * d), 1.0f), out(qs.size());
  std::vector<q::PackedCache> caches;
  caches.emplace_back(q::QuantConfig{}, d);
  caches.emplace_back(q::QuantConfig{}, d);
  for (auto& c : caches) c.append(k.data(), k.data(), 40);
  const kvpolicy::cpu_backend be{1};
  const std::span<const q::PackedCache> hs(caches);
  const auto Q = KVView<const float>::hnd(qs.data(), 1, 4, 1, d);
  CHECK_NOTHROW(q::packed_attention(be, hs, Q, {}, out.data()));
  CHECK_THROWS_WITH(q::packed_attention(be, hs, KVView<const float>::hnd(qs.data(), 1, 3, 1, d), {}, out.data()),
                    Contains("3 query heads are not a multiple of 2 KV heads"));
  CHECK_THROWS_WITH(q::packed_attention(be, hs, KVView<const float>::hnd(qs.data(), 1, 2, 1, 2 * d), {}, out.data()),
                    Contains("head_dim mismatch (queries 128, KV head 0 64)"));
  CHECK_THROWS_WITH(q::packed_attention(be, hs, KVView<const float>::hnd(qs.data(), 2, 2, 1, d), {}, out.data()),
                    Contains("pass one layer"));
  CHECK_THROWS_WITH(q::packed_attention(be, hs.first(0), Q, {}, out.data()), Contains("no KV heads"));
  std::vector<float> bias(39);
  CHECK_THROWS_WITH(q::packed_attention(be, hs, Q, {bias.data(), 39, false}, out.data()),
                    Contains("bias_stride 39 is shorter than KV head 0's 40 tokens"));
  caches[1] = q::PackedCache(q::QuantConfig{4, 32, 128, true, true}, d);
  CHECK_THROWS_WITH(q::packed_attention(be, std::span<const q::PackedCache>(caches), Q, {}, out.data()),
                    Contains("KV head 1 was quantized with another configuration"));
  CHECK_THROWS_WITH(q::PackedCache(q::Int2{}, 96), Contains("int2: head_dim 96 is not a power of two"));
  CHECK_THROWS_WITH(q::PackedCache(q::Kivi{}, 80), Contains("kivi: group 32 does not divide head_dim 80"));
  CHECK_THROWS_WITH(q::PackedCache(q::QuantConfig{3, 32, 128, false, false}, 64), Contains("bits must be 2 or 4, got 3"));
  q::PackedCache c(q::QuantConfig{}, d);
  k[70] = INFINITY;
  CHECK_THROWS_WITH(c.append(k.data(), k.data(), 40), Contains("token 1 has a non-finite key element at dim 6"));
  CHECK(c.size() == 1);  // the tokens before the bad one were appended
  // Finite but too large for the rotation and the norms (fuzz_spec: 3e38 became -inf in the
  // Hadamard butterflies and reached the encoder as a NaN code).
  k[70] = 3e38f;
  q::PackedCache big(q::QuantConfig{}, d);
  CHECK_THROWS_WITH(big.append(k.data(), k.data(), 40),
                    Contains("token 1 has a key element of 3e+38 at dim 6; a quantized cache takes "
                             "magnitudes below 2^100"));
  CHECK(big.size() == 1);
  k[70] = 1e29f;  // below the limit: packs like any other row
  q::PackedCache fine(q::QuantConfig{2, 32, 0, true, true}, d);  // residual 0: token 1 is packed
  fine.append(k.data(), k.data(), 40);
  CHECK(fine.size() == 40);
  {  // the large row survives the rotation, the norm and packing: finite, its scale kept
    REQUIRE(fine.residual_tokens() < 40);  // token 1 sits in a packed tile
    std::vector<float> dk(static_cast<std::size_t>(40 * d)), dv(dk.size());
    fine.decode(dk.data(), dv.data());
    for (float x : dk) REQUIRE(std::isfinite(x));
    CHECK(dk[70] > 5e28f);
    CHECK(dk[70] < 2e29f);
  }
  CHECK_THROWS_WITH(q::PackedCache().append(k.data(), k.data(), 1), Contains("default-constructed"));
}

// --- Tile kernels: the unpacking equals block_offsets bit for bit; the logit and value kernels in
// use (intrinsics where built for AVX-512) agree with the plain loops and a double-precision sum;
// exp_nonpositive is std::exp within a few ulp.

namespace {

template <class Blk>
void check_unpack(kvtest::Rng& rng) {
  constexpr int G = Blk::group;
  const float zeros[] = {0.0f, -0.0f, 1.0f, 2.0f, 3.0f, -1.0f, 15.0f, -37.0f, 0.5f, 1e9f, -3e38f};
  for (int trial = 0; trial < 200; ++trial) {
    Blk b;
    b.scale = static_cast<float>(rng.uniform(0.01, 3));
    b.zero = trial < 11 ? zeros[trial] : static_cast<float>(rng.integer(-20, 20));
    for (auto& byte : b.qs) byte = static_cast<std::uint8_t>(trial == 11 ? 0xFF : rng.integer(0, 255));
    float ref[G], got[G], plain[G];
    q::block_offsets(b, ref);
    qd::unpack_offsets(b, got);
    qd::loops::unpack_offsets(b, plain);
    INFO("bits " << Blk::bits << " group " << G << " zero " << b.zero);
    REQUIRE(std::memcmp(ref, got, sizeof ref) == 0);
    REQUIRE(std::memcmp(ref, plain, sizeof ref) == 0);
  }
}

// Random blocks: codes from random bytes, integer zero points, any scale (the kernels read the
// codes and zero points only).
template <class Blk>
std::vector<Blk> random_blocks(kvtest::Rng& rng, std::int64_t count) {
  std::vector<Blk> blocks(static_cast<std::size_t>(count));
  for (Blk& b : blocks) {
    b.scale = static_cast<float>(rng.uniform(0.01, 2));
    b.zero = static_cast<float>(rng.integer(-3, 2 * Blk::max_code));
    for (auto& byte : b.qs) byte = static_cast<std::uint8_t>(rng.integer(0, 255));
  }
  return blocks;
}

// Logits and value sums of R rows over one tile of G tokens with random packed blocks: the
// kernels in use and the plain loops, over the unpacked floats and over the blocks, against a
// double-precision sum of the same products; with AVX-512 the packed kernels give the float
// kernels' bits (the same fused products in the same order).
template <class Blk, int R>
void check_kernels(kvtest::Rng& rng, std::int64_t d, std::int64_t n) {
  constexpr int G = Blk::group;
  const auto kb = random_blocks<Blk>(rng, d), vb = random_blocks<Blk>(rng, n * (d / G));
  std::vector<float> ky(static_cast<std::size_t>(d * G)), y(static_cast<std::size_t>(n * d));
  for (std::int64_t c = 0; c < d; ++c) q::block_offsets(kb[static_cast<std::size_t>(c)], ky.data() + c * G);
  for (std::size_t i = 0; i < vb.size(); ++i) q::block_offsets(vb[i], y.data() + i * G);
  const auto w = rng.normals(R * d), u0 = rng.normals(R * d);
  auto u = u0;  // u[r][b][t] is read for t < n only; poison the rest
  for (std::int64_t i = 0; i < R * d; ++i)
    if (i % G >= n) u[static_cast<std::size_t>(i)] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::vector<float>> s(4, std::vector<float>(R * G));
  qd::tile_logits<G, R>(w.data(), ky.data(), d, s[0].data());
  qd::loops::tile_logits<G, R>(w.data(), ky.data(), d, s[1].data());
  qd::tile_logits_packed<Blk, R>(w.data(), kb.data(), d, s[2].data());
  qd::loops::tile_logits_packed<Blk, R>(w.data(), kb.data(), d, s[3].data());
  const auto acc0 = rng.normals(R * d);
  std::vector<std::vector<float>> acc(4, acc0);
  qd::accumulate_values<G, R>(u.data(), n, y.data(), d, acc[0].data());
  qd::loops::accumulate_values<G, R>(u.data(), n, y.data(), d, acc[1].data());
  qd::accumulate_packed<Blk, R>(u.data(), n, vb.data(), d, acc[2].data());
  qd::loops::accumulate_packed<Blk, R>(u.data(), n, vb.data(), d, acc[3].data());
  INFO("bits " << Blk::bits << " G " << G << " R " << R << " d " << d << " n " << n);
  if (KVP_QUANT_AVX512) {
    REQUIRE(s[2] == s[0]);
    REQUIRE(acc[2] == acc[0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < G; ++t) {
      double ref = 0, mag = 0;
      for (std::int64_t c = 0; c < d; ++c) {
        const double p = double(w[static_cast<std::size_t>(r * d + c)]) * ky[static_cast<std::size_t>(c * G + t)];
        ref += p, mag += std::abs(p);
      }
      // d rounded additions (and products), each within 2^-24 of the running magnitude.
      const double tol = 2.0 * static_cast<double>(d) * 0x1p-24 * mag;
      for (const auto& si : s) REQUIRE(std::abs(si[static_cast<std::size_t>(r * G + t)] - ref) <= tol);
    }
    for (std::int64_t e = 0; e < d; ++e) {
      double ref = acc0[static_cast<std::size_t>(r * d + e)], mag = std::abs(ref);
      for (std::int64_t t = 0; t < n; ++t) {
        const double p = double(u[static_cast<std::size_t>(r * d + (e / G) * G + t)]) * y[static_cast<std::size_t>(t * d + e)];
        ref += p, mag += std::abs(p);
      }
      const double tol = 2.0 * static_cast<double>(n + 1) * 0x1p-24 * mag;
      for (const auto& ai : acc) REQUIRE(std::abs(ai[static_cast<std::size_t>(r * d + e)] - ref) <= tol);
    }
  }
}

}  // namespace

TEST_CASE("packed attention: unpacking a block equals block_offsets bit for bit", "[quant]") {
  kvtest::Rng rng(41);
  check_unpack<q::Block<2, 32>>(rng);
  check_unpack<q::Block<2, 64>>(rng);
  check_unpack<q::Block<2, 128>>(rng);
  check_unpack<q::Block<4, 32>>(rng);
  check_unpack<q::Block<4, 64>>(rng);
  check_unpack<q::Block<4, 128>>(rng);
}

TEST_CASE("packed attention: logit and value kernels, over floats and over blocks, match a double sum", "[quant]") {
  kvtest::Rng rng(43);
  for (std::int64_t n : {32, 7, 1}) {
    check_kernels<q::Block<2, 32>, 1>(rng, 64, n);
    check_kernels<q::Block<2, 32>, 2>(rng, 128, n);
    check_kernels<q::Block<4, 32>, 3>(rng, 96, n);
    check_kernels<q::Block<2, 32>, 4>(rng, 128, n);
    check_kernels<q::Block<4, 32>, 4>(rng, 128, n);
  }
  check_kernels<q::Block<2, 64>, 4>(rng, 128, 64);
  check_kernels<q::Block<4, 64>, 3>(rng, 64, 40);
  check_kernels<q::Block<2, 128>, 4>(rng, 256, 128);
  check_kernels<q::Block<4, 128>, 1>(rng, 128, 9);
}

TEST_CASE("packed attention: exp_nonpositive is std::exp within 4 ulp, 0 below -87", "[quant]") {
  kvtest::Rng rng(47);
  std::vector<float> xs = {0.0f, -0.0f, -1e-30f, -0.34657359f, -0.6931472f, -1.0f, -10.0f, -86.99f, -87.0f};
  for (int i = 0; i < 200000; ++i) xs.push_back(-static_cast<float>(rng.uniform(0, 87)));
  for (int i = 0; i < 2000; ++i) xs.push_back(-static_cast<float>(rng.uniform(0, 1e-3)));
  for (float x : xs) {
    const float got = qd::exp_nonpositive(x), ref = std::exp(x);
    const double ulp = std::ldexp(1.0, std::ilogb(ref) - 23);
    INFO("x = " << x << " exp " << ref << " got " << got);
    REQUIRE(std::abs(double(got) - double(ref)) <= 4 * ulp);
  }
  for (float x : {-87.01f, -100.0f, -1e30f, -std::numeric_limits<float>::infinity()}) {
    INFO("x = " << x);
    REQUIRE(qd::exp_nonpositive(x) == 0.0f);
  }
  // Outside the domain: a NaN passes through; a positive x (only after a NaN logit) gives e^0.
  REQUIRE(std::isnan(qd::exp_nonpositive(std::numeric_limits<float>::quiet_NaN())));
  for (float x : {1e-30f, 1.0f, 100.0f, 3e38f, std::numeric_limits<float>::infinity()})
    REQUIRE(qd::exp_nonpositive(x) == 1.0f);
#if KVP_QUANT_AVX512
  // The 16-lane form: the same bounds, lane by lane (x padded to whole vectors with 0).
  xs.insert(xs.end(), {-87.01f, -100.0f, -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN(), 5.0f});
  while (xs.size() % 16) xs.push_back(0.0f);
  for (std::size_t i = 0; i < xs.size(); i += 16) {
    alignas(64) float got[16];
    _mm512_store_ps(got, qd::avx512::exp_nonpositive(_mm512_loadu_ps(xs.data() + i)));
    for (std::size_t j = 0; j < 16; ++j) {
      const float x = xs[i + j];
      INFO("lane x = " << x << " got " << got[j]);
      if (std::isnan(x)) {
        REQUIRE(std::isnan(got[j]));
      } else if (x < -87.0f) {
        REQUIRE(got[j] == 0.0f);
      } else if (x > 0.0f) {
        REQUIRE(got[j] == 1.0f);
      } else {
        const float ref = std::exp(x);
        REQUIRE(std::abs(double(got[j]) - double(ref)) <= 4 * std::ldexp(1.0, std::ilogb(ref) - 23));
      }
    }
  }
#endif
}

TEST_CASE("packed attention: the softmax pieces in use match the plain loops and std::exp", "[quant]") {
  // tile_max and tile_exp_sum read whole chunks of 16 floats: the values past n are poisoned.
  kvtest::Rng rng(53);
  for (std::int64_t n : {1, 15, 16, 17, 31, 32, 33}) {
    std::vector<float> s(static_cast<std::size_t>((n + 15) / 16 * 16), 1e30f);
    for (std::int64_t t = 0; t < n; ++t) s[static_cast<std::size_t>(t)] = static_cast<float>(rng.uniform(-30, 30));
    INFO("n = " << n);
    const float mx = qd::tile_max(s.data(), n);
    REQUIRE(mx == *std::max_element(s.begin(), s.begin() + n));
    REQUIRE(mx == qd::loops::tile_max(s.data(), n));
    for (const bool in_use : {true, false}) {
      auto e = s;
      const float sum = in_use ? qd::tile_exp_sum(e.data(), n, mx) : qd::loops::tile_exp_sum(e.data(), n, mx);
      double ref_sum = 0, mag = 0;
      for (std::int64_t t = 0; t < n; ++t) {
        const float ref = std::exp(s[static_cast<std::size_t>(t)] - mx);
        INFO("in use " << in_use << " t " << t);
        REQUIRE(std::abs(double(e[static_cast<std::size_t>(t)]) - ref) <= 4 * std::ldexp(1.0, std::ilogb(ref) - 23));
        ref_sum += e[static_cast<std::size_t>(t)], mag += std::abs(e[static_cast<std::size_t>(t)]);
      }
      // the terms summed in 16 lanes and then pairwise: n rounded additions at most
      REQUIRE(std::abs(double(sum) - ref_sum) <= static_cast<double>(n) * 0x1p-24 * mag);
    }
  }
  REQUIRE(qd::tile_max(nullptr, 0) == -std::numeric_limits<float>::infinity());
}

TEST_CASE("PackedCache::append finds the first bad row inside a checked block of rows", "[quant]") {
  // append_rows checks blocks of rows at once and then looks for the first bad one: a bad value
  // row in the second segment (rows 320..), inside its second block of 8, one in the first row of
  // a block, and one in the last row of the input.
  const std::int64_t d = 128, T = 400;
  kvtest::Rng rng(41);
  const auto k = rng.normals(T * d), v = rng.normals(T * d);
  for (const std::int64_t bad : {std::int64_t{333}, std::int64_t{8}, T - 1}) {
    INFO("bad token " << bad);
    auto vb = v;
    vb[static_cast<std::size_t>(bad * d + 17)] = NAN;
    q::PackedCache c(q::QuantConfig{}, d), ref(q::QuantConfig{}, d);
    CHECK_THROWS_WITH(c.append(k.data(), vb.data(), T),
                      Contains("token " + std::to_string(bad) + " has a non-finite value element at dim 17"));
    ref.append(k.data(), v.data(), bad);
    CHECK(same_state(c, ref));  // exactly the rows before it were appended
  }
}

}  // namespace kvt_quant_packed_attention
