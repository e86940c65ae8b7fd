// Test helper shared by every tests/<area>: small dense K/V/Q tensors in any element type and
// layout, from explicit values or a seeded portable generator.
//
//   kvtest::Rng rng(42);
//   auto k = kvtest::random_tensor<kvpolicy::half>(rng, L, Hkv, T, d);  // HND, values in [-1, 1)
//   auto q = kvtest::make_tensor<float>(1, 1, 2, 2, {0, 1, 2, 3}, kvpolicy::Layout::NHD);
//   in.keys = k.view();          // KVView<const T> over k.buf, laid out as requested
//   double x = k.ref.at(l, h, t, i);  // the same value after rounding to T, for naive references
//
// `ref` holds exactly the values the library sees (rounded to T first), so a reference computed
// from `ref` in double differs from the library only by the library's fp32 arithmetic.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include <kvpolicy/core/dtype.hpp>
#include <kvpolicy/core/kv_view.hpp>

namespace kvtest {

// splitmix64: tiny, and portable (std::normal_distribution differs between standard libraries).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi).
  double uniform(double lo = -1.0, double hi = 1.0) {
    return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53;
  }
  // Integer in [lo, hi] (inclusive).
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(next() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  // N(0, stddev^2) by Box-Muller (portable, unlike std::normal_distribution).
  float normal(float stddev = 1.0f) {
    const double u1 = (static_cast<double>(next() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]
    const double u2 = uniform(0.0, 1.0);
    return static_cast<float>(stddev * std::sqrt(-2.0 * std::log(u1)) *
                              std::cos(6.283185307179586 * u2));
  }
  // n normal values rounded to the element type T.
  template <kvpolicy::Element T = float>
  std::vector<T> normals(std::int64_t n, float stddev = 1.0f) {
    std::vector<T> v(static_cast<std::size_t>(n));
    for (auto& x : v) x = kvpolicy::from_float<T>(normal(stddev));
    return v;
  }

 private:
  std::uint64_t s_;
};

// Layout-free [L][H][N][d] values in double, row-major.
struct Dense {
  std::int64_t L = 0, H = 0, N = 0, d = 0;
  std::vector<double> v;
  double at(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t i) const {
    return v[static_cast<std::size_t>(((l * H + h) * N + t) * d + i)];
  }
};

template <kvpolicy::Element T>
struct Tensor {
  Dense ref;           // values after rounding to T
  std::vector<T> buf;  // the same values in `layout`
  kvpolicy::Layout layout = kvpolicy::Layout::HND;

  kvpolicy::KVView<T> mut_view() {
    return kvpolicy::KVView<T>::make(layout, buf.data(), ref.L, ref.H, ref.N, ref.d);
  }
  kvpolicy::KVView<const T> view() const {
    return kvpolicy::KVView<const T>::make(layout, buf.data(), ref.L, ref.H, ref.N, ref.d);
  }
};

// values: [L][H][N][d] row-major, rounded to T.
template <kvpolicy::Element T>
Tensor<T> make_tensor(std::int64_t L, std::int64_t H, std::int64_t N, std::int64_t d,
                      const std::vector<double>& values,
                      kvpolicy::Layout layout = kvpolicy::Layout::HND) {
  Tensor<T> t;
  t.ref = Dense{L, H, N, d, std::vector<double>(values.size())};
  t.layout = layout;
  t.buf.resize(values.size());
  auto view = t.mut_view();
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t i = 0; i < d; ++i) {
          const auto s = static_cast<std::size_t>(((l * H + h) * N + n) * d + i);
          const T x = static_cast<T>(static_cast<float>(values[s]));
          view.at(l, h, n, i) = x;
          t.ref.v[s] = static_cast<double>(static_cast<float>(x));
        }
  return t;
}

// Uniform values in [-scale, scale).
template <kvpolicy::Element T>
Tensor<T> random_tensor(Rng& rng, std::int64_t L, std::int64_t H, std::int64_t N, std::int64_t d,
                        double scale = 1.0, kvpolicy::Layout layout = kvpolicy::Layout::HND) {
  std::vector<double> v(static_cast<std::size_t>(L * H * N * d));
  for (auto& x : v) x = scale * rng.uniform();
  return make_tensor<T>(L, H, N, d, v, layout);
}

}  // namespace kvtest
