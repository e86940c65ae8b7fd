// Naive double-precision references for the CPU ops (explicit softmax, no blocking), shared by
// the [ops] and [session] tests.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <kvpolicy/core/inputs.hpp>
#include <kvpolicy/core/kv_view.hpp>

namespace kvtest {

template <class T>
double val(const kvpolicy::KVView<T>& v, std::int64_t l, std::int64_t h, std::int64_t t,
           std::int64_t i) {
  return static_cast<double>(kvpolicy::to_float(v.at(l, h, t, i)));
}

// Softmax over logits[0..n) in double.
inline std::vector<double> softmax(std::vector<double> x) {
  double mx = -INFINITY;
  for (double a : x) mx = std::max(mx, a);
  double s = 0;
  for (double& a : x) s += (a = std::exp(a - mx));
  for (double& a : x) a /= s;
  return x;
}

// Column sums of causal attention of the n_q queries (positions T-n_q..T-1) over T keys,
// reduced over each GQA group: [L][Hkv][T].
template <class T>
std::vector<double> naive_window_attention(const kvpolicy::KVView<const T>& keys,
                                           const kvpolicy::KVView<const T>& queries,
                                           kvpolicy::GqaReduce reduce) {
  const std::int64_t L = keys.layers, H = keys.heads, Tk = keys.tokens, d = keys.dim;
  const std::int64_t g = queries.heads / H, nq = queries.tokens;
  std::vector<double> out(static_cast<std::size_t>(L * H * Tk), 0.0);
  std::vector<double> col(static_cast<std::size_t>(Tk));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t m = 0; m < g; ++m) {
        std::fill(col.begin(), col.end(), 0.0);
        for (std::int64_t i = 0; i < nq; ++i) {
          const std::int64_t n = Tk - nq + i + 1;
          std::vector<double> logit(static_cast<std::size_t>(n));
          for (std::int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (std::int64_t e = 0; e < d; ++e)
              s += val(queries, l, h * g + m, i, e) * val(keys, l, h, j, e);
            logit[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(d));
          }
          auto p = softmax(std::move(logit));
          for (std::int64_t j = 0; j < n; ++j) col[static_cast<std::size_t>(j)] += p[static_cast<std::size_t>(j)];
        }
        double* dst = out.data() + (l * H + h) * Tk;
        for (std::int64_t j = 0; j < Tk; ++j) {
          const double c = col[static_cast<std::size_t>(j)];
          if (m == 0) dst[j] = c;
          else if (reduce == kvpolicy::GqaReduce::max) dst[j] = std::max(dst[j], c);
          else dst[j] += c;
        }
      }
  if (reduce == kvpolicy::GqaReduce::mean)
    for (auto& x : out) x /= static_cast<double>(g);
  return out;
}

// Ragged attention of one layer: out [Hq][n_q][d]; acc (optional) [Hkv][keys.tokens] receives
// acc_scale * sum over the group's heads and queries of the probabilities.
template <class T, class Q>
std::vector<double> naive_attention(const kvpolicy::KVView<const T>& keys,
                                    const kvpolicy::KVView<const T>& values,
                                    const kvpolicy::KVView<const Q>& queries,
                                    const std::vector<std::int64_t>& lengths, bool causal,
                                    const float* bias = nullptr, std::int64_t bias_stride = 0,
                                    std::vector<double>* acc = nullptr, double acc_scale = 1.0) {
  const std::int64_t H = keys.heads, Hq = queries.heads, nq = queries.tokens, d = keys.dim;
  const std::int64_t g = Hq / H;
  std::vector<double> out(static_cast<std::size_t>(Hq * nq * d), 0.0);
  for (std::int64_t q = 0; q < Hq; ++q) {
    const std::int64_t h = q / g, len = lengths[static_cast<std::size_t>(h)];
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t n = causal ? std::max<std::int64_t>(0, len - nq + i + 1) : len;
      if (n == 0) continue;
      std::vector<double> logit(static_cast<std::size_t>(n));
      for (std::int64_t j = 0; j < n; ++j) {
        double s = 0;
        for (std::int64_t e = 0; e < d; ++e) s += val(queries, 0, q, i, e) * val(keys, 0, h, j, e);
        logit[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(d)) +
                                             (bias ? bias[h * bias_stride + j] : 0.0);
      }
      auto p = softmax(std::move(logit));
      double* o = out.data() + (q * nq + i) * d;
      for (std::int64_t j = 0; j < n; ++j) {
        for (std::int64_t e = 0; e < d; ++e) o[e] += p[static_cast<std::size_t>(j)] * val(values, 0, h, j, e);
        if (acc) (*acc)[static_cast<std::size_t>(h * keys.tokens + j)] += acc_scale * p[static_cast<std::size_t>(j)];
      }
    }
  }
  return out;
}

// Largest |a - b| relative to max(1, max |b|).
template <class A, class B>
double max_rel_err(const A& a, const B& b) {
  double err = 0, scale = 1;
  for (std::size_t i = 0; i < b.size(); ++i) scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  for (std::size_t i = 0; i < b.size(); ++i)
    err = std::max(err, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return err / scale;
}

template <class T>
std::vector<unsigned char> bytes_of(const std::vector<T>& v) {
  std::vector<unsigned char> b(v.size() * sizeof(T));
  if (!v.empty()) std::memcpy(b.data(), static_cast<const void*>(v.data()), b.size());
  return b;
}

}  // namespace kvtest
