// row_math::pool1d (SnapKV smoothing) against hand-computed values.
#include <catch2/catch.hpp>

#include <limits>
#include <vector>

#include <kvpolicy/scorers/snapkv_row.hpp>

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_ops_pooling {

using kvpolicy::Pool;
using Catch::Matchers::Contains;

namespace {
std::vector<float> pool(const std::vector<float>& in, int kernel, Pool p) {
  std::vector<float> out(in.size(), -12345.f);
  kvpolicy::row_math::pool1d(in.data(), out.data(), static_cast<std::int64_t>(in.size()), kernel, p);
  return out;
}
void check_close(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("index " << i);
    CHECK(got[i] == Approx(want[i]).margin(1e-6));
  }
}
}  // namespace

TEST_CASE("avg pooling divides by the kernel including padding", "[ops]") {
  const std::vector<float> x = {1, 2, 3, 4, 5};
  check_close(pool(x, 3, Pool::avg), {3.0 / 3, 6.0 / 3, 9.0 / 3, 12.0 / 3, 9.0 / 3});
  check_close(pool(x, 5, Pool::avg), {6.0 / 5, 10.0 / 5, 15.0 / 5, 14.0 / 5, 12.0 / 5});
  check_close(pool(x, 1, Pool::avg), {1, 2, 3, 4, 5});
  // Kernel wider than the row: every output is sum/kernel.
  check_close(pool({2, 4}, 7, Pool::avg), {6.0 / 7, 6.0 / 7});
  check_close(pool({-1, 0.5f, 3, -2, 8, 1, 0}, 5, Pool::avg),
              {2.5 / 5, 0.5 / 5, 8.5 / 5, 10.5 / 5, 10.0 / 5, 7.0 / 5, 9.0 / 5});
}

TEST_CASE("max pooling ignores padding", "[ops]") {
  check_close(pool({-1, -5, -3}, 3, Pool::max), {-1, -1, -3});
  check_close(pool({-4, -5, -3, -7}, 5, Pool::max), {-3, -3, -3, -3});
  check_close(pool({1, 9, 2, 0, 0, 5, 1}, 3, Pool::max), {9, 9, 9, 2, 5, 5, 5});
  check_close(pool({1, 9, 2, 0, 0, 5, 1}, 1, Pool::max), {1, 9, 2, 0, 0, 5, 1});
  check_close(pool({3}, 7, Pool::max), {3});
}

TEST_CASE("avg pooling stays exact over a long row (no running-sum drift)", "[ops]") {
  std::vector<float> x(100000);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = (i % 3 == 0) ? 1e4f : 1e-4f;
  auto out = pool(x, 7, Pool::avg);
  // Interior windows of 7 hold either two or three 1e4 values.
  for (std::size_t j = 3; j + 3 < x.size(); ++j) {
    double s = 0;
    for (std::size_t t = j - 3; t <= j + 3; ++t) s += x[t];
    REQUIRE(out[j] == Approx(s / 7).epsilon(1e-6));
  }
}

TEST_CASE("pooling rejects even or non-positive kernels and aliasing", "[ops]") {
  std::vector<float> x(4, 1.f), y(4);
  CHECK_THROWS_WITH(kvpolicy::row_math::pool1d(x.data(), y.data(), 4, 4, Pool::avg),
                    Contains("pooling kernel 4 must be odd and positive"));
  CHECK_THROWS_WITH(kvpolicy::row_math::pool1d(x.data(), y.data(), 4, 0, Pool::max),
                    Contains("pooling kernel 0"));
  CHECK_THROWS_WITH(kvpolicy::row_math::pool1d(x.data(), y.data(), 4, -3, Pool::max),
                    Contains("pooling kernel -3"));
  CHECK_THROWS_WITH(kvpolicy::row_math::pool1d(x.data(), x.data(), 4, 3, Pool::avg),
                    Contains("must not alias"));
}

}  // namespace kvt_ops_pooling
