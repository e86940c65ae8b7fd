// Walsh-Hadamard rotation: equals the dense Sylvester matrix / sqrt(n), is orthonormal and its
// own inverse, and rejects sizes that are not powers of two.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <vector>

#include <kvpolicy/quant/hadamard.hpp>

#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_quant_hadamard {

using Catch::Matchers::Contains;
namespace q = kvpolicy::quant;

TEST_CASE("hadamard equals the Sylvester matrix / sqrt(n) and is orthonormal", "[quant]") {
  const std::int64_t n = GENERATE(1, 2, 4, 8, 16, 32, 64, 128, 256);
  INFO("n = " << n);
  // Column j of the transform = transform of the unit vector e_j. Sylvester: H[i][j] =
  // (-1)^popcount(i & j).
  std::vector<float> M(static_cast<std::size_t>(n * n));  // M[j][i] = (H e_j)[i]
  double worst_entry = 0;
  const double inv = 1.0 / std::sqrt(static_cast<double>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    float* col = M.data() + j * n;
    col[j] = 1.0f;
    q::hadamard(std::span<float>(col, static_cast<std::size_t>(n)));
    for (std::int64_t i = 0; i < n; ++i) {
      const double sylvester = (std::popcount(static_cast<std::uint64_t>(i & j)) % 2 ? -1.0 : 1.0) * inv;
      worst_entry = std::max(worst_entry, std::abs(col[i] - sylvester));
    }
  }
  // Each entry is +-1 times fp32(1 / sqrtf(n)): two roundings (the butterflies add exact
  // integers), so within 2^-23 relative.
  CHECK(worst_entry <= 0x1.0p-23 * inv);
  // H H^T = I: each dot product sums n terms of ~1/n, each off by <= 2^-23 / n relative.
  double worst_gram = 0;
  for (std::int64_t a = 0; a < n; ++a)
    for (std::int64_t b = 0; b < n; ++b) {
      double s = 0;
      for (std::int64_t i = 0; i < n; ++i)
        s += static_cast<double>(M[static_cast<std::size_t>(a * n + i)]) * M[static_cast<std::size_t>(b * n + i)];
      worst_gram = std::max(worst_gram, std::abs(s - (a == b ? 1.0 : 0.0)));
    }
  CHECK(worst_gram < 4 * 0x1.0p-23);
}

TEST_CASE("hadamard is its own inverse, preserves norms and matches its per-butterfly form", "[quant]") {
  const std::int64_t n = GENERATE(32, 64, 128, 256);
  kvtest::Rng rng(static_cast<std::uint64_t>(n));
  auto x = rng.normals(3 * n);
  auto y = x;
  q::hadamard_rows(y.data(), 3, n);
  for (std::int64_t r = 0; r < 3; ++r) {
    double nx = 0, ny = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      nx += double(x[static_cast<std::size_t>(r * n + i)]) * x[static_cast<std::size_t>(r * n + i)];
      ny += double(y[static_cast<std::size_t>(r * n + i)]) * y[static_cast<std::size_t>(r * n + i)];
    }
    CHECK(std::sqrt(ny) == Approx(std::sqrt(nx)).epsilon(1e-6));
  }
  // The stage-by-stage butterflies (what a CUDA kernel runs, one thread per butterfly) give the
  // same bits as the host loop.
  std::vector<float> z(x.begin(), x.begin() + n);
  for (std::int64_t half = 1; half < n; half *= 2)
    for (std::int64_t i = n / 2 - 1; i >= 0; --i) q::hadamard_stage_butterfly(z.data(), half, i);
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (std::int64_t i = 0; i < n; ++i) CHECK(z[static_cast<std::size_t>(i)] * s == y[static_cast<std::size_t>(i)]);
  q::hadamard_rows(y.data(), 3, n);
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, double(std::abs(x[i] - y[i])));
  CHECK(worst < 1e-5);  // |x| <~ 4.5; two rounds of log2(n) fp32 additions
}

TEST_CASE("hadamard rejects sizes that are not powers of two", "[quant]") {
  std::vector<float> x(96);
  CHECK_THROWS_WITH(q::hadamard(x), Contains("96 is not a power of two"));
  CHECK_THROWS_WITH(q::hadamard(std::span<float>(x.data(), 0)), Contains("0 is not a power of two"));
  CHECK_THROWS_WITH(q::hadamard_rows(x.data(), 2, 48), Contains("48 is not a power of two"));
  CHECK_THROWS_AS(q::hadamard(std::span<float>(x.data(), 3)), kvpolicy::Error);
  CHECK_NOTHROW(q::hadamard(std::span<float>(x.data(), 64)));
  CHECK(q::is_power_of_two(256));
  CHECK_FALSE(q::is_power_of_two(-4));
}

}  // namespace kvt_quant_hadamard
