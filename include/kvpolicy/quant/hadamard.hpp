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
// j = (i / half) * 2 * half + i % half. A stage is n / 2 independent butterflies. half is a power
// of two, so the division and remainder are a mask and a shift.
KVP_HD inline void hadamard_stage_butterfly(float* x, std::int64_t half, std::int64_t i) {
  const std::int64_t j = ((i & ~(half - 1)) << 1) | (i & (half - 1));
  hadamard_butterfly(x[j], x[j + half]);
}

// One whole stage, the same butterflies as hadamard_stage_butterfly for i = 0 .. n/2 - 1 but
// walked as blocks of 2 * half values whose first half pairs with the second: the inner loop
// runs over contiguous values, so it vectorizes once half >= the SIMD width.
KVP_HD inline void hadamard_stage(float* x, std::int64_t n, std::int64_t half) {
  for (std::int64_t b = 0; b < n; b += 2 * half) {
    float* lo = x + b;
    float* hi = lo + half;
    for (std::int64_t j = 0; j < half; ++j) hadamard_butterfly(lo[j], hi[j]);
  }
}

// Stages 1, 2 and 4 at once: each aligned block of 8 values goes through its 8-point transform
// (the same 12 butterflies in the same order per value as the three stages).
KVP_HD inline void hadamard_stages_1_2_4(float* x, std::int64_t n) {
  for (std::int64_t b = 0; b < n; b += 8) {
    float* y = x + b;
    for (int h = 1; h < 8; h *= 2)
      for (int j = 0; j < 8; ++j)
        if ((j & h) == 0) hadamard_butterfly(y[j], y[j + h]);
  }
}

#if !defined(__CUDACC__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define KVP_HADAMARD_VECTOR 1
// Host path on GCC (12+: __builtin_shufflevector) / Clang vector extensions (one 8-float vector;
// AVX when enabled, two SSE halves otherwise): the stages below are the scalar ones with the same
// additions per value. Elsewhere (CUDA, other compilers) the scalar loops above run.
namespace detail {
typedef float hadamard_v8 __attribute__((vector_size(32)));

// Stages 1, 2 and 4 within one 8-value vector a. In stage `half` lane j pairs with lane
// j ^ half, and p = a with those lanes swapped: the lower lane takes a + p = x_j + x_{j+half},
// the upper one p - a = x_{j-half} - x_j (the butterfly's a - b); the blend keeps one per lane.
// (p + (-a) would save the blend with the same bits for numbers, but not for a NaN from an
// overflowing rotation: negating flips its sign, and x86 passes a NaN operand through.)
// (By reference: a vector argument or result would change the ABI without AVX.)
inline void hadamard_in_vector(hadamard_v8& a) {
  hadamard_v8 p = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6);
  a = __builtin_shufflevector(a + p, p - a, 0, 9, 2, 11, 4, 13, 6, 15);
  p = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5);
  a = __builtin_shufflevector(a + p, p - a, 0, 1, 10, 11, 4, 5, 14, 15);
  p = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3);
  a = __builtin_shufflevector(a + p, p - a, 0, 1, 2, 3, 12, 13, 14, 15);
}

// Stage 8 * H and the ones above it between the V vectors v[]: vector i pairs with i + H.
template <int V, int H>
inline void hadamard_between_vectors(hadamard_v8* v) {
  if constexpr (H < V) {
#pragma GCC unroll 32
    for (int i = 0; i < V; ++i)
      if ((i & H) == 0) {
        const hadamard_v8 lo = v[i], hi = v[i + H];
        v[i] = lo + hi;
        v[i + H] = lo - hi;
      }
    hadamard_between_vectors<V, 2 * H>(v);
  }
}

// The whole transform of V * 8 values held in V vectors (registers, for V <= 16: the loops are
// unrolled so that v[] has constant indices): stages 1, 2, 4 within each vector, then the
// others between vectors. Scaled by s at the end. Reads x, writes y (may be x).
template <int V>
inline void hadamard_vectors(const float* x, float* y, float s) {
  hadamard_v8 v[static_cast<std::size_t>(V)];
#pragma GCC unroll 32
  for (int i = 0; i < V; ++i) {
    __builtin_memcpy(&v[i], x + 8 * i, sizeof v[i]);
    hadamard_in_vector(v[i]);
  }
  hadamard_between_vectors<V, 1>(v);
#pragma GCC unroll 32
  for (int i = 0; i < V; ++i) {
    if (s != 1.0f) v[i] *= s;
    __builtin_memcpy(y + 8 * i, &v[i], sizeof v[i]);
  }
}

#if defined(__AVX512F__)
// With AVX-512 (one 16-float vector per register, 32 registers), blocks of 32 values take their
// five lowest stages in Pease's form instead: a stage maps the block x to y with
// y[i] = x[2i] + x[2i+1], y[16 + i] = x[2i] - x[2i+1] (i < 16), two 2-source permutes and two
// additions per pair of vectors, where the stages above spend a swap, an addition, a subtraction
// and a blend per vector and stage. Applying it five times is the 32-point transform in natural
// order: the j-th application adds (first - second) the values whose indices differ in bit j - 1,
// the partial sums of stage 2^(j-1) with the lower index first, so every output is the same
// sequence of fp32 additions as the per-butterfly form (the stage order of the Sylvester tree is
// kept, only where the partial sums sit in between changes). The stages from 32 up are between
// vectors, as above. 2x faster than the 8-lane form at n = 128 (L1-resident rows).
typedef float hadamard_v16 __attribute__((vector_size(64)));

inline void hadamard_pease32(hadamard_v16& a, hadamard_v16& b) {
  const hadamard_v16 e =
      __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const hadamard_v16 o =
      __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  a = e + o;
  b = e - o;
}

// The whole transform of V * 16 values (V even, <= 16: registers), scaled by s at the end.
// Reads x, writes y (may be x).
template <int V>
inline void hadamard_vectors16(const float* x, float* y, float s) {
  hadamard_v16 v[static_cast<std::size_t>(V)];
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) __builtin_memcpy(&v[i], x + 16 * i, sizeof v[i]);
#pragma GCC unroll 16
  for (int c = 0; c < V; c += 2)
#pragma GCC unroll 5
    for (int stage = 0; stage < 5; ++stage) hadamard_pease32(v[c], v[c + 1]);
#pragma GCC unroll 4
  for (int h = 2; h < V; h *= 2)
#pragma GCC unroll 16
    for (int i = 0; i < V; ++i)
      if ((i & h) == 0) {
        const hadamard_v16 lo = v[i], hi = v[i + h];
        v[i] = lo + hi;
        v[i + h] = lo - hi;
      }
#pragma GCC unroll 16
  for (int i = 0; i < V; ++i) {
    if (s != 1.0f) v[i] *= s;
    __builtin_memcpy(y + 16 * i, &v[i], sizeof v[i]);
  }
}
#endif

// The register-resident sizes of hadamard_vector; false for others.
inline bool hadamard_vector_to(const float* x, float* y, std::int64_t n, float s) {
#if defined(__AVX512F__)
  switch (n) {
    case 32: return hadamard_vectors16<2>(x, y, s), true;
    case 64: return hadamard_vectors16<4>(x, y, s), true;
    case 128: return hadamard_vectors16<8>(x, y, s), true;
    case 256: return hadamard_vectors16<16>(x, y, s), true;
    default: break;
  }
#endif
  switch (n) {
    case 8: return hadamard_vectors<1>(x, y, s), true;
    case 16: return hadamard_vectors<2>(x, y, s), true;
    case 32: return hadamard_vectors<4>(x, y, s), true;
    case 64: return hadamard_vectors<8>(x, y, s), true;
    case 128: return hadamard_vectors<16>(x, y, s), true;
    default: return false;
  }
}

// hadamard_unnormalized for n >= 8, then x *= s (s = 1: none).
inline void hadamard_vector(float* x, std::int64_t n, float s) {
  if (hadamard_vector_to(x, x, n, s)) return;
  for (std::int64_t b = 0; b < n; b += 8) {
    hadamard_v8 a;
    __builtin_memcpy(&a, x + b, sizeof a);
    hadamard_in_vector(a);
    __builtin_memcpy(x + b, &a, sizeof a);
  }
  for (std::int64_t half = 8; half < n; half *= 2)
    for (std::int64_t b = 0; b < n; b += 2 * half)
      for (std::int64_t j = b; j < b + half; j += 8) {
        hadamard_v8 lo, hi;
        __builtin_memcpy(&lo, x + j, sizeof lo);
        __builtin_memcpy(&hi, x + j + half, sizeof hi);
        const hadamard_v8 sum = lo + hi, diff = lo - hi;
        __builtin_memcpy(x + j, &sum, sizeof sum);
        __builtin_memcpy(x + j + half, &diff, sizeof diff);
      }
  if (s != 1.0f)
    for (std::int64_t i = 0; i < n; ++i) x[i] *= s;
}
}  // namespace detail
#endif

// Unnormalized transform x <- H_n x (log2(n) stages of n / 2 butterflies). n: a power of two.
// Every output is the same sequence of fp32 additions as the per-butterfly form, so the bits do
// not depend on how the stages are walked.
KVP_HD inline void hadamard_unnormalized(float* x, std::int64_t n) {
#if defined(KVP_HADAMARD_VECTOR)
  if (n >= 8) return detail::hadamard_vector(x, n, 1.0f);
#endif
  std::int64_t half = 1;
  if (n >= 8) {
    hadamard_stages_1_2_4(x, n);
    half = 8;
  }
  for (; half < n; half *= 2) hadamard_stage(x, n, half);
}

// Orthonormal transform x <- H_n x / sqrt(n). n: a power of two (unchecked here).
KVP_HD inline void hadamard_unchecked(float* x, std::int64_t n) {
  const float s = 1.0f / sqrtf(static_cast<float>(n));
#if defined(KVP_HADAMARD_VECTOR)
  if (n >= 8) return detail::hadamard_vector(x, n, s);
#endif
  hadamard_unnormalized(x, n);
  for (std::int64_t i = 0; i < n; ++i) x[i] *= s;
}

// y <- H_n x / sqrt(n) (y == x allowed, else no overlap): the bits of hadamard_unchecked on a
// copy, without the separate copy pass for the sizes held in registers.
inline void hadamard_unchecked_to(const float* x, float* y, std::int64_t n) {
#if defined(KVP_HADAMARD_VECTOR)
  if (detail::hadamard_vector_to(x, y, n, 1.0f / sqrtf(static_cast<float>(n)))) return;
#endif
  if (y != x)
    for (std::int64_t i = 0; i < n; ++i) y[i] = x[i];
  hadamard_unchecked(y, n);
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
