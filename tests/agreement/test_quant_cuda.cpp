// Agreement of the CUDA quantizer tile codecs (cuda/quant.cu) with the CPU quantizer
// (quant/quantizer.hpp). Criterion: packed bytes identical (scales, zero points, codes, norms)
// and decoded stored-form values bit-identical. The CPU half emulates the kernels on the host:
// the warp FWHT over 32 lanes (shuffle = read the partner lane's register), the per-token norm
// threads, the per-channel / per-group encode threads and the decode threads, all through
// quant/tile_kernel.hpp's KVP_HD functions, which the kernels call. The [gpu] half runs the
// kernels (fp32 and fp16 input) and asks for the same bytes; without a GPU it warns and returns.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <kvpolicy/core/dtype.hpp>
#include <kvpolicy/cuda/quant.hpp>
#include <kvpolicy/quant/quantizer.hpp>
#include <kvpolicy/quant/split_merge.hpp>
#include <kvpolicy/quant/tile_kernel.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_quant_cuda {

using namespace kvpolicy;
namespace q = kvpolicy::quant;

namespace {

// --- Host emulation of cuda/quant.cu ---------------------------------------------------------

// encode_tiles' rotation of one row by one warp: lane l holds v[l][e] = x[e * 32 + l].
template <int D>
void emulate_warp_fwht(const float* x, float* y) {
  constexpr int E = D / 32;
  float v[32][E], p[32][E];
  for (int l = 0; l < 32; ++l)
    for (int e = 0; e < E; ++e) v[l][e] = x[e * 32 + l];
  for (int half = 1; half < 32; half *= 2) {
    for (int l = 0; l < 32; ++l)
      for (int e = 0; e < E; ++e) p[l][e] = v[l ^ half][e];  // __shfl_xor_sync
    for (int l = 0; l < 32; ++l)
      for (int e = 0; e < E; ++e) v[l][e] = q::dev::fwht_combine(v[l][e], p[l][e], (l & half) != 0);
  }
  const float s = q::dev::fwht_scale(D);
  for (int l = 0; l < 32; ++l) {
    q::dev::fwht_thread_stages<E>(v[l]);
    for (int e = 0; e < E; ++e) y[e * 32 + l] = v[l][e] * s;
  }
}

void emulate_fwht(int d, const float* x, float* y) {
  if (d == 64) emulate_warp_fwht<64>(x, y);
  else if (d == 128) emulate_warp_fwht<128>(x, y);
  else emulate_warp_fwht<256>(x, y);
}

// One thread block of encode_tiles: rows x [n][d] of one tile -> tile bytes.
template <class Blk>
void emulate_encode_tile(const cuda::QuantFormat& f, bool keys, const float* x, int n, int d,
                         std::byte* out) {
  constexpr int G = Blk::group;
  // NaN: unwritten rows and pads must stay unread (a NaN reaching a block would show in its bytes)
  std::vector<float> sm(static_cast<std::size_t>(q::dev::tile_floats(d, G)), std::nanf("")), norms(G), row(d);
  for (int t = 0; t < n; ++t) {
    if (f.rotate) emulate_fwht(d, x + t * d, row.data());
    else std::memcpy(row.data(), x + t * d, sizeof(float) * static_cast<std::size_t>(d));
    for (int i = 0; i < d; ++i) sm[q::dev::tile_index(keys, t, i, d, G)] = row[i];
  }
  if (keys) {
    if (f.token_norm) {
      const int S = q::dev::key_stride(d);
      for (int t = 0; t < G; ++t) norms[t] = t < n ? q::dev::key_norm(sm.data() + t * S, d) : 0.0f;
      for (int i = 0; i < n * S; ++i) sm[i] = q::dev::normalize_key(sm[i], norms[i / S]);
      std::memcpy(out + d * sizeof(Blk), norms.data(), sizeof(float) * G);
    }
    for (int c = 0; c < d; ++c) {
      Blk b;
      q::dev::encode_key_channel(sm.data(), n, d, c, b);
      std::memcpy(out + c * sizeof(Blk), &b, sizeof b);
    }
  } else {
    for (int i = 0; i < G * (d / G); ++i) {
      Blk b;
      q::dev::encode_value_block(sm.data(), n, d, i, b);
      std::memcpy(out + i * sizeof(Blk), &b, sizeof b);
    }
  }
}

// One thread block of decode_tiles.
template <class Blk>
void emulate_decode_tile(bool keys, bool token_norm, const std::byte* in, int n, int d, float* out,
                         float* norms) {
  std::vector<Blk> blocks(static_cast<std::size_t>(d));
  std::memcpy(blocks.data(), in, sizeof(Blk) * static_cast<std::size_t>(d));
  if (keys) {
    for (int c = 0; c < d; ++c) q::dev::decode_key_channel(blocks[c], n, d, c, out);
    for (int t = 0; t < n; ++t) {
      float nr = 1.0f;
      if (token_norm) std::memcpy(&nr, in + d * sizeof(Blk) + t * sizeof(float), sizeof nr);
      norms[t] = nr;
    }
  } else {
    for (int i = 0; i < n * (d / Blk::group); ++i) q::dev::decode_value_block(blocks[i], i, out);
  }
}

// --- CPU reference: BasicQuantizer::encode's per-tile steps ----------------------------------

q::QuantConfig config_of(const cuda::QuantFormat& f) {
  return {f.bits, f.group, 0, f.rotate, f.token_norm};
}

template <class Blk>
void cpu_encode_tile(const cuda::QuantFormat& f, bool keys, const float* x, int n, int d,
                     std::byte* out) {
  const q::QuantConfig c = config_of(f);
  std::vector<float> rows(x, x + n * d), norms(static_cast<std::size_t>(n));
  if (keys) {
    for (int t = 0; t < n; ++t) norms[t] = q::prepare_key(c, rows.data() + t * d, d);
    q::encode_key_tile<Blk>(c, rows.data(), norms.data(), n, d, out);
  } else {
    q::prepare_values(c, rows.data(), n, d);
    q::encode_value_tile<Blk>(rows.data(), n, d, out);
  }
}

// Whole rows [rows][tokens][d], packed as cuda::quant_encode lays them out.
[[maybe_unused]] std::vector<std::byte> cpu_encode_rows(const cuda::QuantFormat& f, bool keys, const std::vector<float>& x,
                                       std::int64_t rows, std::int64_t tokens, int d) {
  const std::size_t rb = cuda::quant_row_bytes(f, keys, tokens, d), tb = cuda::quant_row_bytes(f, keys, f.group, d);
  std::vector<std::byte> out(static_cast<std::size_t>(rows) * rb, std::byte{0xAB});
  q::with_block(f.bits, f.group, [&](auto blk) {
    using Blk = decltype(blk);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t t0 = 0; t0 < tokens; t0 += f.group)
        cpu_encode_tile<Blk>(f, keys, x.data() + (r * tokens + t0) * d,
                             static_cast<int>(std::min<std::int64_t>(f.group, tokens - t0)), d,
                             out.data() + r * rb + static_cast<std::size_t>(t0 / f.group) * tb);
  });
  return out;
}

// --- Test data -------------------------------------------------------------------------------

enum class Kind { gauss, outliers, ties, zeros, constant, large };

// n rows of d values. ties: half-integers on a grid of step 1 with each 32-run spanning [0, 3]
// (scale 1: x / scale lands exactly on .5, round-half-away decides); zeros: +0 / -0 mixed;
// constant: one value per row (a constant K channel across tokens is a constant column);
// large: |x| up to 1e30.
std::vector<float> make_rows(Kind kind, int n, int d, std::mt19937& rng) {
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_int_distribution<int> u(0, 6);
  std::vector<float> x(static_cast<std::size_t>(n * d));
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < d; ++i) {
      float& v = x[static_cast<std::size_t>(t * d + i)];
      switch (kind) {
        case Kind::gauss: v = g(rng); break;
        case Kind::outliers: v = g(rng) * (i % 17 == 3 ? 300.0f : 1.0f); break;
        case Kind::ties: v = (i % 32 == 0 || t == 0) ? 0.0f : (i % 32 == 1 || t == 1) ? 3.0f : 0.5f * static_cast<float>(u(rng)); break;
        case Kind::zeros: v = (u(rng) & 1) ? -0.0f : 0.0f; break;
        case Kind::constant: v = 1.5f * static_cast<float>(t % 5) - 3.0f; break;
        case Kind::large: v = g(rng) * 1e30f; break;
      }
    }
  return x;
}

bool same_bytes(const std::vector<std::byte>& a, const std::vector<std::byte>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size()) == 0;
}

const cuda::QuantFormat kFormats[] = {
    {2, 32, true, true},  {2, 64, true, true},   {2, 128, true, true}, {4, 32, true, true},
    {4, 128, true, true}, {2, 32, false, false}, {4, 64, false, false}, {2, 32, true, false},
};

}  // namespace

TEST_CASE("quant cuda: the warp FWHT emulation gives hadamard's bits", "[agreement]") {
  std::mt19937 rng(7);
  int rows = 0;
  for (int d : {64, 128, 256})
    for (Kind k : {Kind::gauss, Kind::outliers, Kind::large, Kind::ties}) {
      const auto x = make_rows(k, 20, d, rng);
      std::vector<float> a(static_cast<std::size_t>(d)), b(static_cast<std::size_t>(d));
      for (int t = 0; t < 20; ++t, ++rows) {
        emulate_fwht(d, x.data() + t * d, a.data());
        q::hadamard_unchecked_to(x.data() + t * d, b.data(), d);
        REQUIRE(std::memcmp(a.data(), b.data(), sizeof(float) * static_cast<std::size_t>(d)) == 0);
      }
    }
  CHECK(rows == 240);
}

TEST_CASE("quant cuda: emulated encode and decode tiles give the CPU quantizer's bytes and values", "[agreement]") {
  std::mt19937 rng(11);
  int tiles = 0;
  for (const auto& f : kFormats)
    for (int d : {64, 128, 256}) {
      if (f.group > d) continue;
      for (bool keys : {true, false})
        for (Kind k : {Kind::gauss, Kind::outliers, Kind::ties, Kind::zeros, Kind::constant, Kind::large})
          for (int n : {f.group, f.group - 1, 1, 5}) {
            q::with_block(f.bits, f.group, [&](auto blk) {
              using Blk = decltype(blk);
              const auto x = make_rows(k, n, d, rng);
              const std::size_t tb = cuda::quant_row_bytes(f, keys, f.group, d);
              std::vector<std::byte> cpu(tb, std::byte{0xCD}), emu(tb, std::byte{0xCD});
              cpu_encode_tile<Blk>(f, keys, x.data(), n, d, cpu.data());
              emulate_encode_tile<Blk>(f, keys, x.data(), n, d, emu.data());
              INFO("bits " << f.bits << " group " << f.group << " rotate " << f.rotate << " norm "
                           << f.token_norm << " d " << d << " keys " << keys << " kind "
                           << static_cast<int>(k) << " n " << n);
              REQUIRE(same_bytes(cpu, emu));
              // Decode: the CPU's decode_*_tile vs the emulated decode threads, bit for bit.
              const q::QuantConfig c = config_of(f);
              std::vector<float> yc(static_cast<std::size_t>(n * d)), ye(yc.size()), nc(n), ne(n);
              if (keys) q::decode_key_tile<Blk>(c, cpu.data(), n, d, yc.data(), nc.data());
              else q::decode_value_tile<Blk>(cpu.data(), n, d, yc.data());
              emulate_decode_tile<Blk>(keys, f.token_norm, emu.data(), n, d, ye.data(), ne.data());
              REQUIRE(std::memcmp(yc.data(), ye.data(), sizeof(float) * yc.size()) == 0);
              if (keys) REQUIRE(std::memcmp(nc.data(), ne.data(), sizeof(float) * nc.size()) == 0);
              // The codes are real: every decoded stored-form value is finite.
              for (float v : ye) REQUIRE(std::isfinite(v));
              ++tiles;
            });
          }
    }
  CHECK(tiles == 22 * 2 * 6 * 4);  // 22 (format, d) pairs with group <= d
}

TEST_CASE("quant cuda: ties at rounding boundaries round half away from zero", "[agreement]") {
  // One K channel over 32 tokens: 0, 3 fix scale 1 and zero 0; 0.5 / 1.5 / 2.5 are exact ties.
  const cuda::QuantFormat f{2, 32, false, false};
  const int d = 64;
  std::vector<float> x(32 * d, 0.0f);
  const float pattern[4] = {0.5f, 1.5f, 2.5f, 1.0f};
  for (int t = 0; t < 32; ++t) x[t * d] = t == 0 ? 0.0f : t == 1 ? 3.0f : pattern[t % 4];
  std::vector<std::byte> emu(cuda::quant_row_bytes(f, true, 32, d));
  emulate_encode_tile<q::Block<2, 32>>(f, true, x.data(), 32, d, emu.data());
  q::Block<2, 32> b;
  std::memcpy(&b, emu.data(), sizeof b);
  CHECK(b.scale == 1.0f);
  CHECK(b.zero == 0.0f);
  for (int t = 2; t < 32; ++t) {
    const int want = t % 4 == 0 ? 1 : t % 4 == 1 ? 2 : t % 4 == 2 ? 3 : 1;  // 0.5->1, 1.5->2, 2.5->3
    REQUIRE(q::block_code(b, t) == want);
  }
}

// ---- CUDA half ----------------------------------------------------------------------------------

using kvtest::gpu_present;
#if defined(KVPOLICY_WITH_CUDA)
using kvtest::download;
using kvtest::upload;
#endif

TEST_CASE("quant cuda: device encode / decode give the CPU quantizer's bytes", "[agreement][gpu]") {
  if (!gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::mt19937 rng(3);
  const cuda_backend be{};
  const std::int64_t rows = 3, tokens = 77;  // two full tiles of 32 and a partial one
  for (const auto& f : kFormats)
    for (int d : {64, 128, 256}) {
      if (f.group > d) continue;
      for (bool keys : {true, false})
        for (Kind k : {Kind::gauss, Kind::outliers, Kind::ties}) {
          INFO("bits " << f.bits << " group " << f.group << " d " << d << " keys " << keys << " kind " << static_cast<int>(k));
          const auto x = make_rows(k, static_cast<int>(rows * tokens), d, rng);
          const auto want = cpu_encode_rows(f, keys, x, rows, tokens, d);
          cuda::DeviceBuffer dx = upload(x), dp(want.size());
          cuda::encode(be, f, keys, dx.data(), cuda::QuantInput::f32, rows, tokens, d, dp.data());
          const auto got = download<std::byte>(dp, want.size());
          REQUIRE(same_bytes(want, got));
          // fp16 input: the same bytes as the CPU on the inputs rounded to half.
          std::vector<half> xh(x.size());
          std::vector<float> xr(x.size());
          for (std::size_t i = 0; i < x.size(); ++i) xh[i] = half(x[i]), xr[i] = static_cast<float>(xh[i]);
          cuda::DeviceBuffer dxh = upload(xh);
          cuda::encode(be, f, keys, dxh.data(), cuda::QuantInput::f16, rows, tokens, d, dp.data());
          REQUIRE(same_bytes(cpu_encode_rows(f, keys, xr, rows, tokens, d), download<std::byte>(dp, want.size())));
          // Decode the fp32 bytes back: the CPU decode of every tile, bit for bit.
          dp = upload(want);
          cuda::DeviceBuffer dy(x.size() * sizeof(float)), dn(static_cast<std::size_t>(rows * tokens) * sizeof(float));
          cuda::decode(be, f, keys, dp.data(), rows, tokens, d, dy.as<float>(), keys ? dn.as<float>() : nullptr);
          const auto y = download<float>(dy, x.size());
          const auto nr = download<float>(dn, static_cast<std::size_t>(rows * tokens));
          const std::size_t rb = want.size() / rows, tb = cuda::quant_row_bytes(f, keys, f.group, d);
          q::with_block(f.bits, f.group, [&](auto blk) {
            using Blk = decltype(blk);
            for (std::int64_t r = 0; r < rows; ++r)
              for (std::int64_t t0 = 0; t0 < tokens; t0 += f.group) {
                const int n = static_cast<int>(std::min<std::int64_t>(f.group, tokens - t0));
                std::vector<float> yc(static_cast<std::size_t>(n * d)), nc(n);
                const std::byte* in = want.data() + r * rb + static_cast<std::size_t>(t0 / f.group) * tb;
                if (keys) q::decode_key_tile<Blk>(config_of(f), in, n, d, yc.data(), nc.data());
                else q::decode_value_tile<Blk>(in, n, d, yc.data());
                REQUIRE(std::memcmp(yc.data(), y.data() + (r * tokens + t0) * d, sizeof(float) * yc.size()) == 0);
                if (keys) REQUIRE(std::memcmp(nc.data(), nr.data() + r * tokens + t0, sizeof(float) * n) == 0);
              }
          });
        }
    }
#endif
}

// ---- Split-KV merge (the per-split online-softmax merge a split-KV decode kernel runs) --------


TEST_CASE("quant cuda: split-KV online-softmax merge equals one softmax pass", "[agreement]") {
  // Logits (q.k plus a log_count bias) and values of one query row; the splits are merged in
  // order and in reverse. Reference: softmax in double. Criterion: max |out - ref| <= 6e-5
  // (|out| is a convex combination of |v| values, normal samples; fp32 exp and accumulation
  // over <= 300 terms round at ~1e-7 relative, so 6e-5 absolute leaves a wide margin).
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 1.0f);
  std::uniform_int_distribution<int> cnt(1, 50);
  const int d = 64;
  double worst = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % 300;
    std::vector<float> l(n), v(static_cast<std::size_t>(n * d));
    for (int t = 0; t < n; ++t) l[t] = 4.0f * g(rng) + std::log(static_cast<float>(cnt(rng)));
    if (trial % 7 == 0) for (int t = 0; t < n / 2; ++t) l[t] = -INFINITY;  // masked prefix: an empty split
    for (float& x : v) x = g(rng);
    // Reference.
    double mx = -INFINITY;
    for (float x : l) mx = std::max(mx, static_cast<double>(x));
    std::vector<double> ref(d, 0.0);
    double s = 0;
    for (int t = 0; t < n; ++t) {
      if (l[t] == -INFINITY) continue;
      const double e = std::exp(static_cast<double>(l[t]) - mx);
      s += e;
      for (int i = 0; i < d; ++i) ref[i] += e * v[t * d + i];
    }
    for (double& x : ref) x /= s;
    // Splits of a random size each.
    const int splits = 1 + trial % 9;
    std::vector<q::dev::SoftmaxPart> parts(splits);
    std::vector<float> acc(static_cast<std::size_t>(splits * d), 0.0f);
    for (int t = 0; t < n; ++t) {
      const int sp = static_cast<int>(static_cast<long long>(t) * splits / n);
      q::dev::softmax_add(parts[sp], acc.data() + sp * d, l[t], v.data() + t * d, d);
    }
    for (int order = 0; order < 2; ++order) {
      q::dev::SoftmaxPart m;
      std::vector<float> macc(d, 0.0f), out(d);
      for (int k = 0; k < splits; ++k) {
        const int sp = order == 0 ? k : splits - 1 - k;
        q::dev::softmax_merge(m, macc.data(), parts[sp], acc.data() + sp * d, d);
      }
      q::dev::softmax_finish(m, macc.data(), out.data(), d);
      for (int i = 0; i < d; ++i) {
        const double err = std::abs(out[i] - ref[i]);
        worst = std::max(worst, err);
        REQUIRE(err <= 6e-5);
      }
    }
  }
  WARN("split-KV merge: worst |out - ref| = " << worst);
  CHECK(worst > 0.0);  // fp32 is not exact: the comparison really ran
}

}  // namespace kvt_agreement_quant_cuda
