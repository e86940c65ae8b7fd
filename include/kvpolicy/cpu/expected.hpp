// CPU kernels of the expected-attention scorer (scorers/expected.hpp): the covariance of the
// rotated queries and the keys' log-MGF logit terms, as Eigen GEMMs. Declared in cpu/fwd.hpp.
#pragma once
#include "kvpolicy/cpu/eigen.hpp"
#include <algorithm>
#include <cstdint>
#include <limits>

#include "kvpolicy/cpu/fwd.hpp"
#include "kvpolicy/cpu/rows.hpp"
#include "kvpolicy/scorers/expected_row.hpp"

namespace kvpolicy::cpu {

template <class Real>
void centered_gram(Real* rows, std::int64_t n, std::int64_t d, const Real* mean, Real* out) {
  using Rows = Eigen::Matrix<Real, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<Rows> X(rows, n, d);
  const Eigen::Map<const Eigen::Matrix<Real, 1, Eigen::Dynamic>> m(mean, d);
  X.rowwise() -= m;
  Eigen::Map<Rows>(out, d, d).noalias() = X.transpose() * X / static_cast<Real>(n);
}

template <class T>
double key_logits(const KVView<const T>& keys, std::int64_t l, std::int64_t h, std::int64_t j0,
                  std::int64_t j1, std::int64_t block, const float* mu, const float* sigma,
                  double lin_scale, double quad_div, double* z) {
  const std::int64_t d = keys.dim;
  // Owned (aligned) copies, so that the GEMMs take Eigen's aligned paths as before the split.
  const Eigen::VectorXf muf = Eigen::Map<const Eigen::VectorXf>(mu, d);
  RowMatrix sigf;
  if (sigma) sigf = Eigen::Map<const RowMatrix>(sigma, d, d);
  Eigen::VectorXf lin;
  RowMatrix kbuf, ks;
  double zmax = -std::numeric_limits<double>::infinity();
  for (std::int64_t b = j0; b < j1; b += block) {
    const std::int64_t nb = std::min(block, j1 - b);
    const RowMap K = rows_f32(keys, l, h, b, nb, kbuf);
    lin.noalias() = K * muf;
    if (sigma) ks.noalias() = K * sigf;
    for (std::int64_t r = 0; r < nb; ++r) {
      const float quad = sigma ? K.row(r).dot(ks.row(r)) : 0.f;
      const double v = row_math::expected_logit(lin(r), quad, lin_scale, quad_div);
      z[b + r] = v;
      zmax = std::max(zmax, v);
    }
  }
  return zmax;
}

}  // namespace kvpolicy::cpu
