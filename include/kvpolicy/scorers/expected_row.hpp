// Per-thread math of expected attention (scorers/expected.hpp) shared by the CPU stage and the
// CUDA kernels (cuda/expected.cu): KVP_HD functions free of CUDA and Eigen, so that the host
// emulation of the kernels' grids (tests/agreement/test_expected_cuda.cpp) drives exactly the
// logic the device runs. RoPE is Hugging Face's half-split rotation: dim f < d/2 pairs with
// f + d/2 and turns by the angle of frequency f.
#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::row_math {

// The device kernels take the frequencies and the averaged rotation by value (kernel
// parameters), for head_dim up to 2 * kExpectedMaxPairs.
inline constexpr std::int64_t kExpectedMaxPairs = 128;

// The angle of `steps` positions at inverse frequency `inv_freq`, in double.
KVP_HD inline double rope_angle(std::int64_t steps, float inv_freq) {
  return static_cast<double>(steps) * static_cast<double>(inv_freq);
}

// One RoPE pair (x at dim f, w at dim f + d/2) turned by the angle with cosine c and sine s.
KVP_HD inline void rope_pair(double x, double w, double c, double s, double& rx, double& rw) {
  rx = x * c - w * s;
  rw = w * c + x * s;
}

// Component e of R v, R the block rotation with per-pair cosines c[p] and sines s[p] and `get(i)`
// the components of v: the pair of e is (p, p + half), p = e mod half.
template <class Get>
KVP_HD inline double rotate_component(const Get& get, std::int64_t half, const double* c,
                                      const double* s, std::int64_t e) {
  const std::int64_t p = e < half ? e : e - half;
  double rx = 0, rw = 0;
  rope_pair(get(p), get(p + half), c[p], s[p], rx, rw);
  return e < half ? rx : rw;
}

// Entry (e, f) of R Sigma R^T for a d x d row-major Sigma (rows turned first, then columns:
// the same operations in the same order as two in-place passes).
KVP_HD inline double rotate_sigma_entry(const double* sigma, std::int64_t d, const double* c,
                                        const double* s, std::int64_t e, std::int64_t f) {
  const std::int64_t half = d / 2;
  auto rows_turned = [&](std::int64_t col) {  // (R Sigma)[e][col]
    return rotate_component([&](std::int64_t a) { return sigma[a * d + col]; }, half, c, s, e);
  };
  return rotate_component(rows_turned, half, c, s, f);
}

// Lane `lane`'s parts of k . mu and k^T Sigma k over its dims e = lane, lane + 32, ..., fp32
// like the CPU's GEMMs (Sigma row-major d x d, symmetric; null: no covariance term). The warp
// sums both over its lanes.
template <class Get>
KVP_HD inline void expected_logit_lane(const Get& k, const float* mu, const float* sigma,
                                       int lane, std::int64_t d, float& lin, float& quad) {
  lin = 0.f;
  quad = 0.f;
  for (std::int64_t e = lane; e < d; e += kWarpLanes) {
    const float ke = k(e);
    lin += ke * mu[e];
    if (sigma) {
      float ks = 0.f;  // (K Sigma)[e]
      for (std::int64_t f = 0; f < d; ++f) ks += k(f) * sigma[f * d + e];
      quad += ke * ks;
    }
  }
}

// The key's logit z = mu.k / sqrt(d) + k^T Sigma k / (2 d): the log of the Gaussian
// moment-generating function of q.k / sqrt(d) (lin_scale = 1 / sqrt(d), quad_div = 2 d).
KVP_HD inline double expected_logit(float lin, float quad, double lin_scale, double quad_div) {
  return static_cast<double>(lin) * lin_scale + static_cast<double>(quad) / quad_div;
}

// ||v||^2 in double, dims in order.
template <class Get>
KVP_HD inline double value_sqnorm(const Get& v, std::int64_t d) {
  double n2 = 0;
  for (std::int64_t e = 0; e < d; ++e) {
    const double x = v(e);
    n2 += x * x;
  }
  return n2;
}

// The key's score from the sum over its query group of the softmax weights: the group mean,
// then (a + eps) * ||v|| when vnorm.
KVP_HD inline float expected_finish(double group_sum, std::int64_t group, bool vnorm, double eps,
                                    double v_sqnorm) {
  double a = group_sum / static_cast<double>(group);
  if (vnorm) a = (a + eps) * sqrt(v_sqnorm);
  return static_cast<float>(a);
}

}  // namespace kvpolicy::row_math
