// Orthonormal fast Walsh-Hadamard transform (fp32, in place) over a head_dim that is a power of
// two: x <- H_n x / sqrt(n) with H_n the Sylvester matrix (H_1 = [1], H_2n = [[H, H], [H, -H]]).
// OScaR's "canalized rotation" (shared/algorithms.md): rotating K and Q by the same orthonormal
// matrix leaves every logit unchanged, (Hq).(Hk) = q.k, while spreading outlier channels over
// all channels so per-group quantization ranges shrink. H_n / sqrt(n) is symmetric and
// orthonormal, hence its own inverse: the same call rotates back (the attention output of a
// rotated V).
//
// The per-butterfly and per-stage functions are KVP_HD so a CUDA kernel can run the same
// arithmetic (one thread per butterfly, one stage per synchronisation step); only the host entry
// points check sizes and throw.
#pragma once
#include <math.h>  // sqrtf, also in device code
#include <cstdint>
#include <span>
#include <string_view>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::quant {

KVP_HD constexpr bool is_power_of_two(std::int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

// One butterfly: (a, b) <- (a + b, a - b).
KVP_HD inline void hadamard_butterfly(float& a, float& b) {
  const float s = a + b, t = a - b;
  a = s;
  b = t;
}

// Butterfly `i` (of n / 2) of the stage whose pairs are `half` apart: pairs (j, j + half) with
// j = (i / half) * 2 * half + i % half. A stage is n / 2 independent butterflies.
KVP_HD inline void hadamard_stage_butterfly(float* x, std::int64_t half, std::int64_t i) {
  const std::int64_t j = (i / half) * 2 * half + i % half;
  hadamard_butterfly(x[j], x[j + half]);
}

// Unnormalized transform x <- H_n x (log2(n) stages of n / 2 butterflies). n: a power of two.
KVP_HD inline void hadamard_unnormalized(float* x, std::int64_t n) {
  for (std::int64_t half = 1; half < n; half *= 2)
    for (std::int64_t i = 0; i < n / 2; ++i) hadamard_stage_butterfly(x, half, i);
}

// Orthonormal transform x <- H_n x / sqrt(n). n: a power of two (unchecked here).
KVP_HD inline void hadamard_unchecked(float* x, std::int64_t n) {
  hadamard_unnormalized(x, n);
  const float s = 1.0f / sqrtf(static_cast<float>(n));
  for (std::int64_t i = 0; i < n; ++i) x[i] *= s;
}

// Throws unless n is a power of two; `what` names the argument (e.g. "int2: head_dim").
inline void require_hadamard_size(std::int64_t n, std::string_view what = "hadamard: size") {
  KVP_REQUIRE(is_power_of_two(n), what, " ", n,
              " is not a power of two (the Walsh-Hadamard rotation needs 64, 128, 256, ...)");
}

// Orthonormal in-place transform of one vector.
inline void hadamard(std::span<float> x) {
  require_hadamard_size(static_cast<std::int64_t>(x.size()));
  hadamard_unchecked(x.data(), static_cast<std::int64_t>(x.size()));
}

// Orthonormal in-place transform of `rows` contiguous vectors of length n.
inline void hadamard_rows(float* x, std::int64_t rows, std::int64_t n) {
  require_hadamard_size(n);
  KVP_REQUIRE(rows >= 0, "hadamard: negative row count ", rows);
  for (std::int64_t r = 0; r < rows; ++r) hadamard_unchecked(x + r * n, n);
}

}  // namespace kvpolicy::quant
