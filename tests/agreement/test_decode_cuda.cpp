// Agreement of the split-KV decode attention (cuda/decode.cu) with cpu::attention, and of the
// packed one (cuda/decode_packed.cu) with quant::packed_attention (second half of this file).
// CPU half: a host emulation of the three passes, driving exactly the kernels' per-thread math
// (kvpolicy/cuda/decode_math.hpp: per (KV head, split) block with key tiles, merge of the splits
// per row, per-key H2O statistics), compared with cpu::attention over GQA groups 1 / 4, ragged
// lengths including 0 and 1, log_count bias on / off, causal on / off, n_q 1 and 3, splits that
// do not divide the lengths, HND / NHD caches, float / half / bfloat16.
// Bound: NMSE <= 1e-7 on the outputs and the accumulators for every element type: half and
// bfloat16 inputs convert to fp32 exactly and both sides compute in fp32, so only the summation
// orders (split-KV merge vs one softmax pass, key tiles vs one GEMM) differ. observed counts are
// compared exactly (sums of 1.0f), rows without visible keys must be exactly 0 on both sides.
// CUDA half ([gpu]): the real kernels on the same cases; without a GPU it warns and returns.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <kvpolicy/cpu/stages.hpp>  // the CPU ops the stages declare (cpu/fwd.hpp)
#include <kvpolicy/cpu/attention.hpp>
#include <kvpolicy/cuda/decode_math.hpp>
#include <kvpolicy/cuda/decode_packed.hpp>
#include <kvpolicy/quant/attention.hpp>
#include <kvpolicy/quant/tile_kernel.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/decode.hpp>
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_decode_cuda {

using namespace kvpolicy;
namespace dm = kvpolicy::cuda::decode_math;

namespace {

constexpr double kBound = 1e-7;

double nmse(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    num += e * e;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? num / den : num;
}

struct Case {
  std::int64_t Hkv, g, T, d, nq;
  std::vector<std::int64_t> lengths;  // [Hkv]
  bool bias, causal, stats, nhd;
  std::int64_t split;  // keys per split (multiple of key_tile(d)); 0: default-like
};

std::string describe(const Case& c) {
  std::string s = "Hkv=" + std::to_string(c.Hkv) + " g=" + std::to_string(c.g) +
                  " T=" + std::to_string(c.T) + " d=" + std::to_string(c.d) +
                  " nq=" + std::to_string(c.nq) + " split=" + std::to_string(c.split) +
                  " len=";
  for (auto l : c.lengths) s += std::to_string(l) + ",";
  s += c.bias ? " bias" : "";
  s += c.causal ? " causal" : "";
  s += c.stats ? " h2o" : "";
  s += c.nhd ? " NHD" : " HND";
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (std::int64_t d : {64, 128})
    for (std::int64_t g : {1, 4})
      for (std::int64_t nq : {1, 3})
        for (int flags = 0; flags < 4; ++flags) {
          const std::int64_t tk = dm::key_tile(static_cast<int>(d));
          const std::int64_t T = 2 * tk + 37;  // not a multiple of the tile
          Case c{3, g, T, d, nq, {0, 1, T}, (flags & 1) != 0, (flags & 2) != 0, true,
                 flags % 2 == 1, flags < 2 ? tk : 2 * tk};
          out.push_back(c);
          c.lengths = {T - 5, tk + 1, 7};
          c.stats = flags != 3;
          c.split = 3 * tk;  // one split holds everything but the tail
          out.push_back(c);
        }
  out.push_back({2, 2, 40, 256, 2, {40, 17}, true, false, true, false, 16});
  return out;
}

template <class T>
struct Data {
  std::vector<T> k, v, q;
  std::vector<float> bias, acc0, obs0;
  KVView<const T> keys, values, queries;
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  Data<T> x;
  x.k = rng.normals<T>(c.Hkv * c.T * c.d);
  x.v = rng.normals<T>(c.Hkv * c.T * c.d);
  x.q = rng.normals<T>(c.Hkv * c.g * c.nq * c.d, 1.5f);
  x.bias.resize(static_cast<std::size_t>(c.Hkv * c.T));
  for (auto& b : x.bias) b = std::log(static_cast<float>(rng.integer(1, 8)));
  x.acc0.resize(static_cast<std::size_t>(c.Hkv * (c.T + 3)));
  x.obs0.resize(x.acc0.size());
  for (auto& a : x.acc0) a = static_cast<float>(rng.uniform(0.0, 2.0));
  for (auto& o : x.obs0) o = static_cast<float>(rng.integer(0, 5));
  auto view = [&](const std::vector<T>& b) {
    return c.nhd ? KVView<const T>::nhd(b.data(), 1, c.Hkv, c.T, c.d)
                 : KVView<const T>::hnd(b.data(), 1, c.Hkv, c.T, c.d);
  };
  x.keys = view(x.k);
  x.values = view(x.v);
  x.queries = KVView<const T>::hnd(x.q.data(), 1, c.Hkv * c.g, c.nq, c.d);
  return x;
}

struct Result {
  std::vector<float> out, acc, obs;
};

template <class T>
Result reference(const Case& c, const Data<T>& x) {
  Result r{std::vector<float>(static_cast<std::size_t>(c.Hkv * c.g * c.nq * c.d)), x.acc0, x.obs0};
  cpu::RaggedAttentionArgs a;
  a.lengths = c.lengths.data();
  a.bias = c.bias ? x.bias.data() : nullptr;
  a.bias_stride = c.T;
  a.causal = c.causal;
  if (c.stats) {
    a.accumulate = r.acc.data();
    a.observed = r.obs.data();
    a.state_stride = c.T + 3;
    a.acc_scale = 0.5f;
  }
  cpu::attention(cpu_backend{1}, x.keys, x.values, x.queries, a, r.out.data());
  return r;
}

// Host emulation of the three passes (same loops as cuda/decode.cu, threads run in sequence
// between barriers).
template <class T>
Result emulate(const Case& c, const Data<T>& x) {
  Result res{std::vector<float>(static_cast<std::size_t>(c.Hkv * c.g * c.nq * c.d)), x.acc0,
             x.obs0};
  const int D = static_cast<int>(c.d), TK = dm::key_tile(D);
  const std::int64_t g = c.g, nq = c.nq, rows = c.Hkv * g * nq, split = c.split;
  const std::int64_t splits = dm::split_count(c.T, split);
  const int R = static_cast<int>(g * nq);
  std::vector<float> ws(static_cast<std::size_t>(dm::workspace_floats(rows, splits, D, c.T, c.stats)),
                        std::nanf(""));
  const dm::Workspace w = dm::carve_workspace(ws.data(), rows, splits, D, c.stats);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  std::vector<float> smem(static_cast<std::size_t>(dm::smem_floats(R, D, TK)), std::nanf(""));
  for (std::int64_t h = 0; h < c.Hkv; ++h)
    for (std::int64_t s = 0; s < splits; ++s) {
      const std::int64_t len = c.lengths[h], s0 = s * split, s1 = std::min(s0 + split, len);
      const dm::BlockSmem sm = dm::carve(smem.data(), R, D, TK);
      for (int r = 0; r < R; ++r)
        for (int ch = 0; ch < D; ++ch)
          sm.qs[r * D + ch] = to_float(x.queries.at(0, h * g + r / nq, r % nq, ch)) * scale;
      dm::phase_init(sm, R, D, 0, 1);
      const float* bias = c.bias ? x.bias.data() + h * c.T : nullptr;
      const std::int64_t row0 = h * g * nq;
      for (std::int64_t t0 = s0; t0 < s1; t0 += TK) {
        const int n = static_cast<int>(std::min<std::int64_t>(s1 - t0, TK));
        for (int j = 0; j < n; ++j)
          for (int ch = 0; ch < D; ++ch) {
            sm.kt[j * dm::kt_stride(D) + ch] = to_float(x.keys.at(0, h, t0 + j, ch));
            sm.vt[j * D + ch] = to_float(x.values.at(0, h, t0 + j, ch));
          }
        for (int r = 0; r < R; ++r)
          for (int j = 0; j < TK; ++j) {
            const std::int64_t vis = dm::visible_keys(len, nq, r % nq, c.causal);
            const float l = dm::tile_logit(sm, D, r, j, n, t0, vis, bias);
            sm.lg[r * TK + j] = l;
            if (w.logits && j < n) w.logits[(row0 + r) * c.T + t0 + j] = l;
          }
        for (int r = 0; r < R; ++r) sm.tp[r] = dm::tile_part(sm.lg + r * TK, TK);
        for (int ch = 0; ch < D; ++ch) dm::fold_channel(sm, R, D, TK, n, ch);
        for (int r = 0; r < R; ++r) dm::fold_state(sm, r);
      }
      for (int r = 0; r < R; ++r) w.part_stat[(row0 + r) * splits + s] = sm.state[r];
      for (int r = 0; r < R; ++r)
        for (int ch = 0; ch < D; ++ch)
          w.part_acc[((row0 + r) * splits + s) * D + ch] = sm.acc[r * D + ch];
    }
  for (std::int64_t row = 0; row < rows; ++row)
    for (int ch = 0; ch < D; ++ch) {
      const dm::SoftmaxPart f = dm::merge_channel(w, row, splits, D, ch, res.out.data() + row * D);
      if (ch == 0) w.final_stat[row] = f;
    }
  if (c.stats)
    for (std::int64_t h = 0; h < c.Hkv; ++h)
      for (std::int64_t j = 0; j < c.T; ++j)
        dm::key_stats(w, h, j, c.lengths[h], g, nq, c.T, c.causal, 0.5f,
                      res.acc.data() + h * (c.T + 3), res.obs.data() + h * (c.T + 3));
  return res;
}

// Rows with no visible key (length 0, or causal with len < n_q - i) are exact zeros on both
// sides; everything else within kBound; counts exact.
void require_agree(const Case& c, const Result& got, const Result& want) {
  INFO(describe(c));
  REQUIRE(got.out.size() == want.out.size());
  for (std::int64_t qh = 0; qh < c.Hkv * c.g; ++qh)
    for (std::int64_t i = 0; i < c.nq; ++i)
      if (dm::visible_keys(c.lengths[qh / c.g], c.nq, i, c.causal) == 0)
        for (std::int64_t ch = 0; ch < c.d; ++ch) {
          const std::size_t k = static_cast<std::size_t>((qh * c.nq + i) * c.d + ch);
          REQUIRE(got.out[k] == 0.0f);
          REQUIRE(want.out[k] == 0.0f);
        }
  CHECK(nmse(got.out, want.out) <= kBound);
  if (c.stats) {
    CHECK(nmse(got.acc, want.acc) <= kBound);
    CHECK(got.obs == want.obs);
  }
}

template <class T>
void require_finite_differs_from_init(const Case& c, const Data<T>& x, const Result& r) {
  if (!c.stats) return;
  // The accumulators really moved for keys inside the lengths (sanity of the emulation).
  double moved = 0;
  for (std::size_t k = 0; k < r.acc.size(); ++k) moved += std::abs(r.acc[k] - x.acc0[k]);
  CHECK(moved > 0.1);
}

}  // namespace

TEMPLATE_TEST_CASE("decode attention: split-KV host emulation matches cpu::attention",
                   "[agreement]", float, half, bfloat16) {
  std::uint64_t seed = 11;
  for (const Case& c : cases()) {
    const Data<TestType> x = make_data<TestType>(c, seed++);
    const Result want = reference(c, x);
    const Result got = emulate(c, x);
    require_agree(c, got, want);
    require_finite_differs_from_init(c, x, got);
  }
}

TEST_CASE("decode attention: split size does not change the result beyond rounding",
          "[agreement]") {
  Case c{2, 4, 300, 64, 2, {300, 129}, true, true, true, false, 64};
  const Data<float> x = make_data<float>(c, 99);
  const Result one = emulate(c, x);
  for (std::int64_t split : {128, 192, 320}) {
    c.split = split;
    const Result other = emulate(c, x);
    CHECK(nmse(other.out, one.out) <= 1e-12);
    CHECK(nmse(other.acc, one.acc) <= 1e-12);
    CHECK(other.obs == one.obs);
  }
}

TEST_CASE("decode attention: tile_part and visible_keys", "[agreement]") {
  float l[4] = {1.0f, -INFINITY, 3.0f, 2.0f};
  const dm::SoftmaxPart p = dm::tile_part(l, 4);
  CHECK(p.max == 3.0f);
  CHECK(l[1] == 0.0f);
  CHECK(l[2] == 1.0f);
  CHECK(p.sum == Approx(std::exp(-2.0f) + 1.0f + std::exp(-1.0f)));
  float m[2] = {-INFINITY, -INFINITY};
  const dm::SoftmaxPart e = dm::tile_part(m, 2);
  CHECK(e.max == -INFINITY);
  CHECK(e.sum == 0.0f);
  CHECK(dm::visible_keys(5, 3, 0, true) == 3);
  CHECK(dm::visible_keys(1, 3, 0, true) == 0);
  CHECK(dm::visible_keys(1, 3, 2, true) == 1);
  CHECK(dm::visible_keys(5, 3, 0, false) == 5);
}

#if defined(KVPOLICY_WITH_CUDA)
namespace {
template <class T>
Result run_device(const Case& c, const Data<T>& x) {
  const cuda::DeviceBuffer dk = kvtest::upload(x.k), dv = kvtest::upload(x.v),
                           dq = kvtest::upload(x.q), dlen = kvtest::upload(c.lengths),
                           dbias = kvtest::upload(x.bias), dacc = kvtest::upload(x.acc0),
                           dobs = kvtest::upload(x.obs0);
  const std::size_t n_out = static_cast<std::size_t>(c.Hkv * c.g * c.nq * c.d);
  cuda::DeviceBuffer dout(n_out * sizeof(float));
  auto dview = [&](const cuda::DeviceBuffer& b) {
    const T* p = b.as<const T>();
    return c.nhd ? KVView<const T>::nhd(p, 1, c.Hkv, c.T, c.d)
                 : KVView<const T>::hnd(p, 1, c.Hkv, c.T, c.d);
  };
  const KVView<const T> keys = dview(dk), values = dview(dv);
  const KVView<const T> queries =
      KVView<const T>::hnd(dq.as<const T>(), 1, c.Hkv * c.g, c.nq, c.d);
  cuda::DecodeArgs a;
  a.lengths = dlen.as<const std::int64_t>();
  a.bias = c.bias ? dbias.as<const float>() : nullptr;
  a.bias_stride = c.T;
  a.causal = c.causal;
  if (c.stats) {
    a.accumulate = dacc.as<float>();
    a.observed = dobs.as<float>();
    a.state_stride = c.T + 3;
    a.acc_scale = 0.5f;
  }
  a.split = c.split;
  const std::size_t bytes = cuda::attention_workspace_bytes(keys, values, queries, a);
  cuda::DeviceBuffer ws(std::max<std::size_t>(bytes, 256));
  cuda::attention(cuda_backend{nullptr, ws.data(), ws.bytes()}, keys, values, queries, a,
                  dout.as<float>());
  cuda::synchronize();
  return {kvtest::download<float>(dout, n_out), kvtest::download<float>(dacc, x.acc0.size()),
          kvtest::download<float>(dobs, x.obs0.size())};
}
}  // namespace

TEMPLATE_TEST_CASE("decode attention: CUDA kernels match cpu::attention", "[agreement][gpu]",
                   float, half, bfloat16) {
  if (!kvtest::gpu_present()) return;
  std::uint64_t seed = 11;
  for (const Case& c : cases()) {
    const Data<TestType> x = make_data<TestType>(c, seed++);
    require_agree(c, run_device(c, x), reference(c, x));
  }
  // Default split (args.split = 0) on a longer cache.
  Case c{2, 4, 5000, 128, 1, {5000, 3001}, true, false, true, false, 0};
  const Data<TestType> x = make_data<TestType>(c, 7);
  require_agree(c, run_device(c, x), reference(c, x));
}
#endif

// ---- packed caches ----------------------------------------------------------------------------
// Host emulation of cuda/decode_packed.cu on the host image of the caches (cuda::flatten, the
// bytes the device reads) vs quant::packed_attention. Both sides see the same dequantized values
// y * scale (the CPU folds the scale into the other factor: (q s) y vs q (y s)) and accumulate
// in fp32 in other orders, so the outputs agree up to fp32 rounding: NMSE <= 1e-7, as dense.

namespace {

struct PCase {
  int bits, group;
  bool rotate;
  std::int64_t d, g, nq, residual;
  std::vector<std::int64_t> sizes;  // tokens appended per KV head
  bool bias, causal;
  std::int64_t split;  // multiple of group
};

std::string describe(const PCase& c) {
  std::string s = "bits=" + std::to_string(c.bits) + " group=" + std::to_string(c.group) +
                  (c.rotate ? " rotate" : " plain") + " d=" + std::to_string(c.d) +
                  " g=" + std::to_string(c.g) + " nq=" + std::to_string(c.nq) +
                  " residual=" + std::to_string(c.residual) + " split=" + std::to_string(c.split) +
                  " sizes=";
  for (auto n : c.sizes) s += std::to_string(n) + ",";
  return s + (c.bias ? " bias" : "") + (c.causal ? " causal" : "");
}

std::vector<PCase> pcases() {
  std::vector<PCase> out;
  for (int bits : {2, 4})
    for (int group : {32, 64})
      for (std::int64_t d : {64, 128})
        for (int f = 0; f < 4; ++f) {
          const std::int64_t g = f % 2 ? 4 : 1, nq = f / 2 ? 3 : 1;
          out.push_back({bits, group, true, d, g, nq, 40, {0, 1, 5 * group + 7},
                         (f & 1) != 0, f == 3, f < 2 ? group : 3 * group});
        }
  out.push_back({2, 32, false, 64, 2, 2, 0, {96, 33}, true, true, 64});
  out.push_back({4, 128, true, 128, 4, 1, 100, {700, 129, 128}, true, false, 256});
  return out;
}

struct PData {
  std::vector<quant::PackedCache> heads;
  std::vector<float> q, bias;
  KVView<const float> queries;
  std::int64_t max_len = 0;
};

PData make_pdata(const PCase& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  PData x;
  quant::QuantConfig cfg;
  cfg.bits = c.bits;
  cfg.group = c.group;
  cfg.residual = static_cast<int>(c.residual);
  cfg.rotate = c.rotate;
  cfg.token_norm = c.rotate;
  for (std::int64_t n : c.sizes) {
    x.heads.emplace_back(cfg, c.d);
    const std::vector<float> k = rng.normals(n * c.d), v = rng.normals(n * c.d);
    if (n) x.heads.back().append(k.data(), v.data(), n);
    x.max_len = std::max(x.max_len, n);
  }
  const std::int64_t Hkv = static_cast<std::int64_t>(c.sizes.size());
  x.q = rng.normals(Hkv * c.g * c.nq * c.d, 1.5f);
  x.queries = KVView<const float>::hnd(x.q.data(), 1, Hkv * c.g, c.nq, c.d);
  x.bias.resize(static_cast<std::size_t>(Hkv * std::max<std::int64_t>(x.max_len, 1)));
  for (auto& b : x.bias) b = std::log(static_cast<float>(rng.integer(1, 8)));
  return x;
}

std::vector<float> packed_reference(const PCase& c, const PData& x) {
  std::vector<float> out(x.q.size());
  quant::PackedAttentionArgs a;
  a.bias = c.bias ? x.bias.data() : nullptr;
  a.bias_stride = std::max<std::int64_t>(x.max_len, 1);
  a.causal = c.causal;
  quant::packed_attention(cpu_backend{1}, std::span<const quant::PackedCache>(x.heads), x.queries,
                          a, out.data());
  return out;
}

template <class Blk>
std::vector<float> packed_emulate(const PCase& c, const PData& x, const cuda::PackedHeadsView& v) {
  constexpr int G = Blk::group;
  const int D = static_cast<int>(c.d);
  const std::int64_t g = c.g, nq = c.nq, Hkv = v.heads, rows = Hkv * g * nq, split = c.split;
  const std::int64_t splits = dm::split_count(v.max_tokens, split);
  const int R = static_cast<int>(g * nq);
  std::vector<float> ws(static_cast<std::size_t>(dm::workspace_floats(rows, splits, D, 0, false)),
                        std::nanf(""));
  const dm::Workspace w = dm::carve_workspace(ws.data(), rows, splits, D, false);
  std::vector<float> smem(static_cast<std::size_t>(dm::smem_floats(R, D, G)), std::nanf(""));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const std::int64_t bias_stride = std::max<std::int64_t>(x.max_len, 1);
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t s = 0; s < splits; ++s) {
      const std::int64_t tile0 = v.tile_offset[h], res0 = v.res_offset[h];
      const std::int64_t packed = (v.tile_offset[h + 1] - tile0) * G;
      const std::int64_t len = packed + v.res_offset[h + 1] - res0, s0 = s * split;
      const std::int64_t s1 = std::min(s0 + split, len);
      const dm::BlockSmem sm = dm::carve(smem.data(), R, D, G);
      for (int xx = 0; xx < R * D; ++xx)
        sm.qs[xx] = x.queries.at(0, h * g + xx / D / nq, (xx / D) % nq, xx % D) * scale;
      dm::phase_init(sm, R, D, 0, 1);
      if (v.rotate) {
        for (int half = 1; half < D; half *= 2)
          for (int p = 0; p < R * (D / 2); ++p) dm::fwht_pair(sm.qs + (p / (D / 2)) * D, half, p % (D / 2));
        for (int xx = 0; xx < R * D; ++xx) sm.qs[xx] *= dm::fwht_norm(D);
      }
      const float* bias = c.bias ? x.bias.data() + h * bias_stride : nullptr;
      const std::int64_t row0 = h * g * nq;
      for (std::int64_t t0 = s0; t0 < s1; t0 += G) {
        const int n = static_cast<int>(std::min<std::int64_t>(s1 - t0, G));
        if (t0 < packed) {
          REQUIRE(n == G);
          const std::int64_t tile = tile0 + t0 / G;
          const unsigned char* kt = v.key_tiles + tile * static_cast<std::int64_t>(v.key_tile_bytes);
          const auto* kb = reinterpret_cast<const Blk*>(kt);
          const auto* vb = reinterpret_cast<const Blk*>(v.value_tiles + tile * static_cast<std::int64_t>(v.value_tile_bytes));
          for (int ch = 0; ch < D; ++ch) {
            quant::dev::decode_key_channel(kb[ch], G, dm::kt_stride(D), ch, sm.kt);
            quant::dev::decode_value_block(vb[ch], ch, sm.vt);
          }
          const auto* nr = reinterpret_cast<const float*>(kt + D * sizeof(Blk));
          for (int t = 0; t < G; ++t) sm.norms[t] = v.token_norm ? nr[t] : 1.0f;
        } else {
          const std::int64_t r = res0 + (t0 - packed);
          for (int xx = 0; xx < n * D; ++xx) {
            sm.kt[(xx / D) * dm::kt_stride(D) + xx % D] = v.res_keys[r * D + xx];
            sm.vt[xx] = v.res_values[r * D + xx];
          }
          for (int t = 0; t < n; ++t) sm.norms[t] = v.res_norms[r + t];
        }
        for (int xx = 0; xx < R * G; ++xx) {
          const int r = xx / G, j = xx % G;
          const std::int64_t vis = dm::visible_keys(len, nq, r % nq, c.causal);
          sm.lg[xx] = dm::tile_logit(sm, D, r, j, n, t0, vis, bias, sm.norms);
        }
        for (int r = 0; r < R; ++r) sm.tp[r] = dm::tile_part(sm.lg + r * G, G);
        for (int ch = 0; ch < D; ++ch) dm::fold_channel(sm, R, D, G, n, ch);
        for (int r = 0; r < R; ++r) dm::fold_state(sm, r);
      }
      for (int r = 0; r < R; ++r) w.part_stat[(row0 + r) * splits + s] = sm.state[r];
      for (int xx = 0; xx < R * D; ++xx)
        w.part_acc[((row0 + xx / D) * splits + s) * D + xx % D] = sm.acc[xx];
    }
  std::vector<float> out(static_cast<std::size_t>(rows * D)), row(static_cast<std::size_t>(D));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (int ch = 0; ch < D; ++ch) dm::merge_channel(w, r, splits, D, ch, row.data());
    if (v.rotate)
      for (int half = 1; half < D; half *= 2)
        for (int i = 0; i < D / 2; ++i) dm::fwht_pair(row.data(), half, i);
    for (int ch = 0; ch < D; ++ch)
      out[static_cast<std::size_t>(r * D + ch)] = v.rotate ? row[ch] * dm::fwht_norm(D) : row[ch];
  }
  return out;
}

cuda::PackedHeadsView host_view(const cuda::PackedImage& im) {
  return im.view(im.key_tiles.data(), im.value_tiles.data(), im.tile_offset.data(),
                 im.res_keys.data(), im.res_values.data(), im.res_norms.data(),
                 im.res_offset.data());
}

void require_packed_agree(const PCase& c, const std::vector<float>& got,
                          const std::vector<float>& want) {
  INFO(describe(c));
  REQUIRE(got.size() == want.size());
  const std::int64_t d = c.d;
  for (std::size_t h = 0; h < c.sizes.size(); ++h)
    for (std::int64_t m = 0; m < c.g; ++m)
      for (std::int64_t i = 0; i < c.nq; ++i)
        if (dm::visible_keys(c.sizes[h], c.nq, i, c.causal) == 0)
          for (std::int64_t e = 0; e < d; ++e) {
            const std::size_t k = static_cast<std::size_t>(((static_cast<std::int64_t>(h) * c.g + m) * c.nq + i) * d + e);
            REQUIRE(got[k] == 0.0f);
            REQUIRE(want[k] == 0.0f);
          }
  CHECK(nmse(got, want) <= kBound);
}

}  // namespace

TEST_CASE("packed decode attention: host emulation matches quant::packed_attention",
          "[agreement]") {
  std::uint64_t seed = 101;
  for (const PCase& c : pcases()) {
    const PData x = make_pdata(c, seed++);
    const cuda::PackedImage im = cuda::flatten(x.heads);
    const cuda::PackedHeadsView v = host_view(im);
    // The image holds what the caches hold: tiles plus residual per head.
    for (std::size_t h = 0; h < x.heads.size(); ++h) {
      REQUIRE(im.tile_offset[h + 1] - im.tile_offset[h] == x.heads[h].tiles());
      REQUIRE(im.res_offset[h + 1] - im.res_offset[h] == x.heads[h].residual_tokens());
    }
    const std::vector<float> got = quant::with_block(c.bits, c.group, [&](auto blk) {
      return packed_emulate<decltype(blk)>(c, x, v);
    });
    require_packed_agree(c, got, packed_reference(c, x));
  }
}

#if defined(KVPOLICY_WITH_CUDA)
TEST_CASE("packed decode attention: CUDA kernels match quant::packed_attention",
          "[agreement][gpu]") {
  if (!kvtest::gpu_present()) return;
  std::uint64_t seed = 101;
  for (const PCase& c : pcases()) {
    const PData x = make_pdata(c, seed++);
    const cuda::PackedImage im = cuda::flatten(x.heads);
    const cuda::DeviceBuffer kt = kvtest::upload(im.key_tiles), vt = kvtest::upload(im.value_tiles),
                             to = kvtest::upload(im.tile_offset), rk = kvtest::upload(im.res_keys),
                             rv = kvtest::upload(im.res_values), rn = kvtest::upload(im.res_norms),
                             ro = kvtest::upload(im.res_offset), dq = kvtest::upload(x.q),
                             db = kvtest::upload(x.bias);
    const cuda::PackedHeadsView v =
        im.view(kt.data(), vt.data(), to.data(), rk.data(), rv.data(), rn.data(), ro.data());
    const TensorRef q{dq.data(), DType::f32, 1, x.queries.heads, c.nq, c.d,
                             x.queries.stride_layer, x.queries.stride_head,
                             x.queries.stride_token, 1};
    cuda::PackedDecodeArgs a;
    a.bias = c.bias ? db.as<const float>() : nullptr;
    a.bias_stride = std::max<std::int64_t>(x.max_len, 1);
    a.causal = c.causal;
    a.split = c.split;
    std::size_t bytes = 0;
    cuda::throw_if_error(cuda::packed_decode_workspace_bytes(v, q, a, bytes), "workspace");
    cuda::DeviceBuffer ws(std::max<std::size_t>(bytes, 256)), dout(x.q.size() * sizeof(float));
    cuda::throw_if_error(cuda::packed_decode_attention(cuda_backend{nullptr, ws.data(), ws.bytes()},
                                                       v, q, a, dout.as<float>()),
                         "packed_decode_attention");
    cuda::synchronize();
    require_packed_agree(c, kvtest::download<float>(dout, x.q.size()), packed_reference(c, x));
  }
}
#endif

}  // namespace kvt_agreement_decode_cuda
