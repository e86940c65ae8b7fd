// Weight matrices in their GGUF types and the matrix-vector products on them
// (engine/weights.hpp): every kernel the CPU supports against an fp64 product with the exactly
// dequantized weights, hand-built cases with exact answers, argument checks, and the model run
// with GGUF-typed weights against the same model dequantized to fp32 at load.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "engine/engine.hpp"
#include "engine/ggml_types.hpp"
#include "engine/weights.hpp"
#include "engine_test_util.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvt_engine_weights {

namespace eng = kvpolicy::engine;
using Catch::Matchers::Contains;

namespace {

std::vector<eng::DotKernel> kernels() {
  std::vector<eng::DotKernel> ks;
  for (auto k : {eng::DotKernel::scalar, eng::DotKernel::avx2, eng::DotKernel::avx512})
    if (eng::dot_kernel_supported(k)) ks.push_back(k);
  return ks;
}

void put16(std::vector<std::uint8_t>& b, std::uint16_t v) {
  b.push_back(static_cast<std::uint8_t>(v & 0xFF));
  b.push_back(static_cast<std::uint8_t>(v >> 8));
}

// Random bytes of `rows` rows of a block type, with scales drawn from ordinary halves (an
// exponent in [-8, 1]) so that no weight is inf or NaN.
std::vector<std::uint8_t> random_rows(std::uint32_t type, std::int64_t rows, std::int64_t cols,
                                      std::mt19937& rng) {
  const auto info = *eng::ggml_type_info(type);
  std::uniform_int_distribution<int> byte(0, 255), expo(7, 16), mant(0, 1023), sign(0, 1);
  auto half = [&] {
    return static_cast<std::uint16_t>((sign(rng) << 15) | (expo(rng) << 10) | mant(rng));
  };
  std::vector<std::uint8_t> b;
  const std::int64_t blocks = rows * cols / info.block;
  for (std::int64_t i = 0; i < blocks; ++i) {
    if (type == eng::ggml_type::F32) {
      const float v = std::ldexp(static_cast<float>(byte(rng) - 128), -6);
      const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
      b.insert(b.end(), p, p + 4);
      continue;
    }
    if (type == eng::ggml_type::F16) {
      put16(b, half());
      continue;
    }
    put16(b, half());                                 // d
    if (type == eng::ggml_type::Q4_1) put16(b, half());  // m
    const std::size_t rest = info.block_bytes - (type == eng::ggml_type::Q4_1 ? 4u : 2u);
    for (std::size_t j = 0; j < rest; ++j) b.push_back(static_cast<std::uint8_t>(byte(rng)));
  }
  return b;
}

}  // namespace

TEST_CASE("weights: every kernel's products match fp64 on the dequantized weights",
          "[engine][weights]") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  // 576 columns = 18 blocks (the bundled model's width), 96 = 3 (an odd count: the AVX-512
  // kernels' two-block loop has a tail), 70 rows (not a multiple of any row block).
  for (std::uint32_t type : {eng::ggml_type::Q4_1, eng::ggml_type::Q8_0, eng::ggml_type::F32,
                             eng::ggml_type::Q4_0, eng::ggml_type::F16})
    for (std::int64_t cols : {576, 96}) {
      const std::int64_t rows = 70;
      const eng::WeightMatrix w(type, rows, cols, random_rows(type, rows, cols, rng));
      std::vector<float> wf(static_cast<std::size_t>(rows * cols));
      w.dequantize_rows(0, rows, wf.data());
      for (std::int64_t nx = 1; nx <= eng::kMatvecMaxRows; ++nx) {
        const std::int64_t xs = cols + 3;  // a stride longer than a row
        std::vector<float> x(static_cast<std::size_t>(nx * xs));
        for (auto& v : x) v = normal(rng);
        for (auto k : kernels()) {
          INFO(eng::ggml_type_name(type) << " cols " << cols << " nx " << nx << " kernel "
                                         << eng::dot_kernel_name(k));
          const std::int64_t ys = rows + 1;
          std::vector<float> y(static_cast<std::size_t>(nx * ys), -7.f);
          eng::matvec(w, x.data(), nx, xs, 0, rows, y.data(), ys, k);
          // Split into uneven ranges: the same numbers (each output is one row's dot product).
          std::vector<float> y2(y.size(), -7.f);
          for (std::int64_t r0 = 0; r0 < rows; r0 += 17)
            eng::matvec(w, x.data(), nx, xs, r0, std::min<std::int64_t>(17, rows - r0),
                        y2.data() + r0, ys, k);
          int bad = 0, differ = 0;
          for (std::int64_t i = 0; i < nx; ++i) {
            for (std::int64_t r = 0; r < rows; ++r) {
              double ref = 0, mag = 0;
              for (std::int64_t c = 0; c < cols; ++c) {
                const double p = static_cast<double>(wf[static_cast<std::size_t>(r * cols + c)]) *
                                 x[static_cast<std::size_t>(i * xs + c)];
                ref += p;
                mag += std::abs(p);
              }
              const float got = y[static_cast<std::size_t>(i * ys + r)];
              if (!(std::abs(got - ref) <= 1e-5 * mag + 1e-30)) ++bad;
              if (got != y2[static_cast<std::size_t>(i * ys + r)]) ++differ;
            }
            CHECK(y[static_cast<std::size_t>(i * ys + rows)] == -7.f);  // padding untouched
          }
          CHECK(bad == 0);
          CHECK(differ == 0);
        }
      }
    }
}

TEST_CASE("weights: hand-built Q4_1 and Q8_0 rows give exact products", "[engine][weights]") {
  // Q4_1 row of two blocks: d = 0.5, m = -1, nibble q_j = j % 16 in block 0 and 15 - j % 16 in
  // block 1 (low nibbles are elements 0..15, high nibbles 16..31). With x = 1 the product is
  // sum(0.5 q - 1) = 0.5 * (2 * 120 + 2 * 120) - 64 = 176, exact in any summation order.
  std::vector<std::uint8_t> q41;
  for (int blk = 0; blk < 2; ++blk) {
    put16(q41, 0x3800);  // 0.5
    put16(q41, 0xBC00);  // -1
    for (int j = 0; j < 16; ++j) {
      const int q = blk == 0 ? j : 15 - j;
      q41.push_back(static_cast<std::uint8_t>(q | (q << 4)));
    }
  }
  const eng::WeightMatrix w41(eng::ggml_type::Q4_1, 1, 64, q41);
  // Q8_0 row of two blocks: d = 0.25, q_j = j - 16 (block 0) and 2 (block 1); x_j = 2:
  // 2 * 0.25 * (sum(j - 16) + 64) = 0.5 * (-16 + 64) = 24.
  std::vector<std::uint8_t> q80;
  put16(q80, 0x3400);
  for (int j = 0; j < 32; ++j) q80.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(j - 16)));
  put16(q80, 0x3400);
  for (int j = 0; j < 32; ++j) q80.push_back(2);
  const eng::WeightMatrix w80(eng::ggml_type::Q8_0, 1, 64, q80);
  const std::vector<float> ones(64, 1.f), twos(64, 2.f);
  for (auto k : kernels()) {
    INFO(eng::dot_kernel_name(k));
    float y = 0;
    eng::matvec(w41, ones.data(), 1, 64, 0, 1, &y, 1, k);
    CHECK(y == 176.f);
    eng::matvec(w80, twos.data(), 1, 64, 0, 1, &y, 1, k);
    CHECK(y == 24.f);
  }
  // The stored rows dequantize to what the format says.
  std::vector<float> row(64);
  w41.dequantize_rows(0, 1, row.data());
  CHECK(row[0] == -1.f);
  CHECK(row[17] == -0.5f);   // block 0, high nibble of byte 1: q = 1
  CHECK(row[32] == 6.5f);    // block 1, q = 15
  w80.dequantize_rows(0, 1, row.data());
  CHECK(row[0] == -4.f);
  CHECK(row[63] == 0.5f);
}

TEST_CASE("weights: bad shapes, ranges and kernels are refused", "[engine][weights]") {
  std::vector<std::uint8_t> bytes(2 * 20, 0);
  CHECK_THROWS_WITH(eng::WeightMatrix(eng::ggml_type::Q4_1, 2, 48, bytes),
                    Contains("whole 32-element blocks"));
  CHECK_THROWS_WITH(eng::WeightMatrix(eng::ggml_type::Q4_1, 3, 32, bytes),
                    Contains("40 bytes for a [3][32] Q4_1 matrix, which needs 60"));
  CHECK_THROWS_WITH(eng::WeightMatrix(9, 1, 32, bytes), Contains("cannot be dequantized"));
  const eng::WeightMatrix w(eng::ggml_type::Q4_1, 2, 32, bytes);
  std::vector<float> x(5 * 32), y(10);
  CHECK_THROWS_WITH(eng::matvec(w, x.data(), 0, 32, 0, 2, y.data(), 2),
                    Contains("0 activation rows (1 to 4)"));
  CHECK_THROWS_WITH(eng::matvec(w, x.data(), 5, 32, 0, 2, y.data(), 2),
                    Contains("5 activation rows"));
  CHECK_THROWS_WITH(eng::matvec(w, x.data(), 1, 32, 1, 2, y.data(), 2),
                    Contains("weight rows [1, 3) are outside [0, 2)"));
  CHECK_THROWS_WITH(eng::matvec(w, x.data(), 2, 16, 0, 2, y.data(), 2),
                    Contains("activation stride 16 is shorter than a row of 32"));
  CHECK_THROWS_WITH(eng::matvec(w, x.data(), 2, 32, 0, 2, y.data(), 1),
                    Contains("output stride 1 is shorter than 2 outputs"));
  CHECK_THROWS_WITH(w.dequantize_rows(1, 2, y.data()), Contains("rows [1, 3) are outside"));
  const std::vector<std::int64_t> perm = {0, 2};
  CHECK_THROWS_WITH(w.permute_rows(perm), Contains("permutation entry 2"));
  if (!eng::dot_kernel_supported(eng::DotKernel::avx512))
    CHECK_THROWS_WITH(eng::matvec(w, x.data(), 1, 32, 0, 2, y.data(), 2, eng::DotKernel::avx512),
                      Contains("does not support the avx512 kernel"));
}

TEST_CASE("weights: the model in its GGUF types against the model dequantized at load",
          "[engine][weights][model]") {
  const eng::Model& native = kvp_engine_test::model();
  const auto f32 = eng::Model::load(kvp_engine_test::model_path(), /*f32_weights=*/true);
  // The bundled model: Q4_1 layers and a Q8_0 embedding, 0.18 of the fp32 bytes.
  CHECK(native.weights().layers[0].wq.type() == eng::ggml_type::Q4_1);
  CHECK(native.weights().token_embd.type() == eng::ggml_type::Q8_0);
  CHECK(f32->weights().layers[0].wq.type() == eng::ggml_type::F32);
  CHECK(f32->weights().matrix_bytes() == native.weights().matrix_bytes_f32());
  CHECK(native.weights().matrix_bytes() < native.weights().matrix_bytes_f32() / 5);

  std::vector<std::int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back(200 + 37 * i);
  eng::EngineConfig cfg;
  cfg.threads = 1;
  eng::Engine a(native, cfg), b(*f32, cfg);
  // Prefill: GEMMs on blocks of exactly dequantized rows, bitwise the same logits.
  const eng::Matrix la = a.prefill(ids, true), lb = b.prefill(ids, true);
  CHECK((la.array() == lb.array()).all());
  // Decode: dot products on the stored blocks; the same up to the order of the additions.
  float worst = 0;
  for (int s = 0; s < 6; ++s) {
    a.step(ids[static_cast<std::size_t>(s)]);
    b.step(ids[static_cast<std::size_t>(s)]);
    const auto x = a.last_logits(), y = b.last_logits();
    for (std::size_t v = 0; v < x.size(); ++v) worst = std::max(worst, std::abs(x[v] - y[v]));
    CHECK(std::max_element(x.begin(), x.end()) - x.begin() ==
          std::max_element(y.begin(), y.end()) - y.begin());
  }
  INFO("max |decode logit difference| " << worst);
  CHECK(worst < 2e-4f);
  // Two different computations, not one path run twice: with AVX-512 the Q4_1 and Q8_0 kernels
  // sum in another order than the F32 one. (The scalar kernel sums the dequantized rows of both
  // models in one order, so there the logits may be bitwise equal.)
  if (eng::best_dot_kernel() == eng::DotKernel::avx512) CHECK(worst > 0.f);
}

}  // namespace kvt_engine_weights
