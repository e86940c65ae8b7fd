// Attention of one layer over packed caches (PackedCache per KV head, packed tiles + fp32
// residual), never materializing the full-precision cache: each tile of `group` tokens is
// unpacked as it is read and folded into an online softmax (running max, sum and output per
// query row), so memory is O(group * d) per thread whatever the length.
//   out[q, i] = H^T sum_j softmax_j((H q_i).K~_j * n_j / sqrt(d) + bias[h, j]) V~_j
// which equals the plain attention over the dequantized cache (see quantizer.hpp: K~, V~, n).
// GQA: query head q reads KV head q / (Hq / Hkv); the tiles of a KV head are read once for all
// its query heads and queries (and unpacked once per 4 of those query rows: once at decode with
// 4 query heads per KV head). causal: query i of n_q sees the first len - n_q + i + 1 tokens
// (as cpu::attention). Deterministic and independent of the thread count (work items are a KV
// head, or at decode a fixed chunk of its tiles; see packed_attention).
//
// A tile is unpacked to y = code - zero (small exact integers) and each block's scale is folded
// into the other factor instead of into y (block.hpp: a dequantized value is y * scale):
//   keys   (block c = channel c over the tile's tokens t):
//            logit_t = n_t * sum_c (q_c * scale_c) * y_ct       -- one product per channel
//   values (block (t, b) = channels [b G, (b + 1) G) of token t):
//            acc_e  += (p_t * scale_tb) * y_te                   -- one product per block
// These are the dequantized products up to fp32 rounding (q * (y * s) vs (q * s) * y).
//
// The kernel: a decode step is compute bound (int2 reads 8x fewer bytes than fp32, and a tile
// costs ~32K multiply-adds and 8K unpacked values for 4 query rows), so each part is vectorized:
// - unpack: per block a 16-entry table of (k & max_code) - zero, indexed by the code word shifted
//   by each lane's bit offset (one shift + one permute per 16 values with AVX-512; block_offsets'
//   bits exactly, tested), done in registers inside the two kernels below (tile_logits_packed,
//   accumulate_packed), so a packed tile never goes through memory as floats;
// - logits and values: kRowBlock (4) query rows per pass over the tile, their running sums in
//   registers; logit t sums its channels in order from 0, output e its tokens in order (one fused
//   multiply-add per term with AVX-512);
// - softmax: e^x by a polynomial (exp_nonpositive, a few ulp from std::exp), the tile's terms
//   summed in 16 lanes and then pairwise; the running sum and output are rescaled by
//   e^(old max - new max) once per row and tile, the 4 rows' steps interleaved.
// The next tile's bytes are prefetched, and each work item holds one scratch allocation.
// Without AVX-512 (portable builds) the same kernels are plain loops, with the same order.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/quant/packed_cache.hpp"

// Build flags: the AVX-512 forms are compiled where the compiler targets AVX-512F (e.g.
// -march=native on such a CPU), the plain loops elsewhere, under the same names. Compile every
// translation unit of one program that includes the quant headers with the same instruction-set
// flags: otherwise the linker keeps one of the two definitions of each inline function (an ODR
// violation), which can run AVX-512 code on a CPU without it. (The tests build the quant tests
// both ways, as two programs: kvpolicy_tests and kvpolicy_tests_avx512.)
#if !defined(__CUDACC__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVP_QUANT_AVX512 1
#else
#define KVP_QUANT_AVX512 0
#endif

namespace kvpolicy::quant {

struct PackedAttentionArgs {
  const float* bias = nullptr;  // optional [Hkv][bias_stride] additive logit bias (log_count),
  std::int64_t bias_stride = 0;  //   token j of head h in cache order (packed, then residual)
  bool causal = false;
};

namespace detail {

// e^x for x <= 0 (a logit minus the running maximum), within a few ulp of std::exp: Cephes'
// expf, x = n ln2 + r with n = round(x / ln2) and |r| <= ln2 / 2 (ln2 split in two so r is
// exact), e^r = 1 + r + r^2 P(r) with a degree-5 minimax P, times 2^n written into the exponent
// bits (n >= -126 here: a normal number). Below -87 it returns 0 where std::exp returns a number
// under 1.7e-38 (normal down to -87.34, then denormal): a term under 2^-125 of the row's largest
// one, e^0 = 1, in the sum. x is also clamped to 0 from above, so that a positive x (outside the
// domain: only a NaN logit upstream leads there) gives e^0 = 1 and never an undefined int
// conversion or an exponent that overflows into the sign bit. Only arithmetic and selects against
// constants, so the loops calling it vectorize (GCC, Clang).
inline float exp_nonpositive(float x) {
  // -inf and NaN too go to -87: the int conversion stays defined
  const float xc = x >= -87.0f ? (x <= 0.0f ? x : 0.0f) : -87.0f;
  // round(xc * log2 e) to nearest: adding 1.5 * 2^23 leaves no fraction bits (|xc| < 2^22).
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  const auto bits = static_cast<std::uint32_t>(static_cast<std::int32_t>(n) + 127) << 23;
  const float e = er * std::bit_cast<float>(bits);
  return x >= -87.0f ? e : (x < -87.0f ? 0.0f : x);  // a NaN passes through, as in std::exp
}

// The tile kernels below exist twice: as plain loops (every build; tests run them against the
// intrinsics) and, where the compiler targets AVX-512F, with intrinsics that keep the running
// sums in registers. Both sum in the same order; the intrinsics fuse every product into its sum
// (one rounding instead of two), the loops where the compiler contracts them.
namespace loops {

// y = block_offsets(b): (code - zero) for the block's Group values.
template <int Bits, int Group>
inline void unpack_offsets(const Block<Bits, Group>& b, float* y) {
  block_offsets(b, y);
}

// s[r][t] = sum_c w[r][c] * ky[c][t] for R rows and t < G, the channels summed in order from 0.
// w: [R][d] (query times key scale), ky: [d][G], s: [R][G].
template <int G, int R>
inline void tile_logits(const float* w, const float* ky, std::int64_t d, float* s) {
  for (std::int64_t i = 0; i < R * G; ++i) s[i] = 0.0f;
  for (std::int64_t c = 0; c < d; ++c)
    for (int r = 0; r < R; ++r) {
      const float wr = w[r * d + c];
      float* sr = s + r * G;
      for (int t = 0; t < G; ++t) sr[t] += wr * ky[c * G + t];
    }
}

// acc[r][e] += sum_{t < n} u[r][e / G][t] * y[t][e] for R rows, in token order. u: [R][d / G][G]
// (probability times value scale), y: [n][d], acc: [R][d].
template <int G, int R>
inline void accumulate_values(const float* u, std::int64_t n, const float* y, std::int64_t d,
                              float* acc) {
  for (int r = 0; r < R; ++r)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t b = 0; b < d / G; ++b) {
        const float p = u[(r * (d / G) + b) * G + t];
        float* a = acc + r * d + b * G;
        const float* yt = y + t * d + b * G;
        for (int j = 0; j < G; ++j) a[j] += p * yt[j];
      }
}

// The largest of s[0..n) (-inf for n = 0). s holds whole chunks of kLanes floats.
constexpr int kLanes = 16;
inline float tile_max(const float* s, std::int64_t n) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float lane[kLanes];
  for (float& l : lane) l = kNegInf;
  for (std::int64_t t0 = 0; t0 < n; t0 += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = s[t0 + j];  // loaded unconditionally, so that the select vectorizes
      const float x = j < n - t0 ? v : kNegInf;
      lane[j] = lane[j] > x ? lane[j] : x;
    }
  for (int w = kLanes / 2; w > 0; w /= 2)  // max is exact in any order
    for (int j = 0; j < w; ++j) lane[j] = lane[j] > lane[j + w] ? lane[j] : lane[j + w];
  return lane[0];
}

// s[t] = e^(s[t] - mx) for t < n, 0 for the rest of the last chunk; returns their sum, taken in
// kLanes running sums (term t in lane t % kLanes), then the lanes pairwise (lane j += lane j + w
// for w = 8, 4, 2, 1): a fixed order that vectorizes.
inline float tile_exp_sum(float* s, std::int64_t n, float mx) {
  float lane[kLanes] = {};
  for (std::int64_t t0 = 0; t0 < n; t0 += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = s[t0 + j] - mx;
      const float x = j < n - t0 ? v : -std::numeric_limits<float>::infinity();
      lane[j] += (s[t0 + j] = exp_nonpositive(x));
    }
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) lane[j] += lane[j + w];
  return lane[0];
}

// tile_logits over the packed key blocks kb [d] (block c = channel c), unpacked one at a time.
template <class Blk, int R>
inline void tile_logits_packed(const float* w, const Blk* kb, std::int64_t d, float* s) {
  constexpr int G = Blk::group;
  float y[G];
  for (std::int64_t i = 0; i < R * G; ++i) s[i] = 0.0f;
  for (std::int64_t c = 0; c < d; ++c) {
    unpack_offsets(kb[c], y);
    for (int r = 0; r < R; ++r) {
      const float wr = w[r * d + c];
      float* sr = s + r * G;
      for (int t = 0; t < G; ++t) sr[t] += wr * y[t];
    }
  }
}

// accumulate_values over the packed value blocks vb (block t (d / G) + b = channels
// [b G, b G + G) of token t), unpacked one at a time.
template <class Blk, int R>
inline void accumulate_packed(const float* u, std::int64_t n, const Blk* vb, std::int64_t d, float* acc) {
  constexpr int G = Blk::group;
  float y[G];
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t b = 0; b < d / G; ++b) {
      unpack_offsets(vb[t * (d / G) + b], y);
      for (int r = 0; r < R; ++r) {
        const float p = u[(r * (d / G) + b) * G + t];
        float* a = acc + r * d + b * G;
        for (int j = 0; j < G; ++j) a[j] += p * y[j];
      }
    }
}

}  // namespace loops

#if KVP_QUANT_AVX512
namespace avx512 {

// block_offsets bit for bit: a table of the 16 values a 4-bit index selects, entry k =
// (k & max_code) - zero (the same float subtraction), then per 16 values one variable shift of
// the broadcast code word (value j at bit j * Bits) and one permute by its low 4 bits.
// (The zero-masking forms with every lane selected are the plain instructions; GCC 12 flags the
// undefined pass-through operand of the unmasked intrinsics with -Wuninitialized.)
constexpr __mmask16 kAll = 0xFFFF;

template <int Bits, int Group>
inline __m512 offset_table(const Block<Bits, Group>& b) {
  const __m512 codes = Bits == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                                 : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_sub_ps(codes, _mm512_set1_ps(b.zero));
}

// Values 16 k .. 16 k + 15 of block b, through its offset_table.
template <int Bits, int Group>
inline __m512 unpack16(const Block<Bits, Group>& b, __m512 table, int k) {
  __m512i idx;
  if constexpr (Bits == 2) {  // 16 values = one 32-bit word
    std::uint32_t w;
    memcpy(&w, b.qs + 4 * k, 4);
    idx = _mm512_maskz_srlv_epi32(kAll, _mm512_set1_epi32(static_cast<int>(w)),
                                  _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30));
  } else {  // 16 values = one 64-bit word: its low half to lanes 0-7, its high half to 8-15
    std::uint64_t w;
    memcpy(&w, b.qs + 8 * k, 8);
    const __m512i halves = _mm512_maskz_permutexvar_epi32(
        kAll, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_set1_epi64(static_cast<long long>(w)));
    idx = _mm512_maskz_srlv_epi32(
        kAll, halves, _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28));
  }
  return _mm512_maskz_permutexvar_ps(kAll, idx, table);
}

template <int Bits, int Group>
inline void unpack_offsets(const Block<Bits, Group>& b, float* y) {
  const __m512 table = offset_table(b);
  for (int k = 0; k < Group / 16; ++k) _mm512_storeu_ps(y + 16 * k, unpack16(b, table, k));
}

// The register-blocked loops of the two kernels below, their operands read by `load`, which
// sets y0, y1 to the 32 values at (channel c, tokens t0 ..) for the logits and at (token t,
// channels e0 ..) for the values: from the unpacked floats or from the blocks.
//   logits: s[r][t0 + j] = sum_c w[r][c] * y(c, t0 + j), c in order, one fused product per term
template <int G, int R, class Load>
inline void logits_loop(const float* w, std::int64_t d, float* s, Load&& load) {
  for (int t0 = 0; t0 < G; t0 += 32) {
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (std::int64_t c = 0; c < d; ++c) {
      __m512 y0, y1;
      load(c, t0, y0, y1);
      for (int r = 0; r < R; ++r) {
        const __m512 wr = _mm512_set1_ps(w[r * d + c]);
        a[r][0] = _mm512_fmadd_ps(wr, y0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(wr, y1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * G + t0, a[r][0]);
      _mm512_storeu_ps(s + r * G + t0 + 16, a[r][1]);
    }
  }
}

//   values: acc[r][e0 + j] += sum_{t < n} u[r][e0 / G][t] * y(t, e0 + j), t in order
template <int G, int R, class Load>
inline void values_loop(const float* u, std::int64_t n, std::int64_t d, float* acc, Load&& load) {
  for (std::int64_t e0 = 0; e0 < d; e0 += 32) {
    const float* ub = u + (e0 / G) * G;
    __m512 a[R][2];
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm512_loadu_ps(acc + r * d + e0);
      a[r][1] = _mm512_loadu_ps(acc + r * d + e0 + 16);
    }
    for (std::int64_t t = 0; t < n; ++t) {
      __m512 y0, y1;
      load(t, e0, y0, y1);
      for (int r = 0; r < R; ++r) {
        const __m512 p = _mm512_set1_ps(ub[r * d + t]);  // u[r][e0 / G][t]: row stride (d / G) G = d
        a[r][0] = _mm512_fmadd_ps(p, y0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(p, y1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * d + e0, a[r][0]);
      _mm512_storeu_ps(acc + r * d + e0 + 16, a[r][1]);
    }
  }
}

template <int G, int R>
inline void tile_logits(const float* w, const float* ky, std::int64_t d, float* s) {
  logits_loop<G, R>(w, d, s, [&](std::int64_t c, int t0, __m512& y0, __m512& y1) {
    y0 = _mm512_loadu_ps(ky + c * G + t0);
    y1 = _mm512_loadu_ps(ky + c * G + t0 + 16);
  });
}

template <int G, int R>
inline void accumulate_values(const float* u, std::int64_t n, const float* y, std::int64_t d,
                              float* acc) {
  values_loop<G, R>(u, n, d, acc, [&](std::int64_t t, std::int64_t e0, __m512& y0, __m512& y1) {
    y0 = _mm512_loadu_ps(y + t * d + e0);
    y1 = _mm512_loadu_ps(y + t * d + e0 + 16);
  });
}

// Over the blocks, unpacked in registers (unpack_offsets' operations), so the same bits as the
// float kernels over the unpacked tile. Keys kb [d]: block c = channel c.
template <class Blk, int R>
inline void tile_logits_packed(const float* w, const Blk* kb, std::int64_t d, float* s) {
  logits_loop<Blk::group, R>(w, d, s, [&](std::int64_t c, int t0, __m512& y0, __m512& y1) {
    const __m512 table = offset_table(kb[c]);
    y0 = unpack16(kb[c], table, t0 / 16);
    y1 = unpack16(kb[c], table, t0 / 16 + 1);
  });
}

// Values vb: block t (d / G) + b = channels [b G, b G + G) of token t.
template <class Blk, int R>
inline void accumulate_packed(const float* u, std::int64_t n, const Blk* vb, std::int64_t d, float* acc) {
  constexpr int G = Blk::group;
  values_loop<G, R>(u, n, d, acc, [&](std::int64_t t, std::int64_t e0, __m512& y0, __m512& y1) {
    const Blk& blk = vb[t * (d / G) + e0 / G];
    const __m512 table = offset_table(blk);
    const int k = static_cast<int>(e0 % G) / 16;
    y0 = unpack16(blk, table, k);
    y1 = unpack16(blk, table, k + 1);
  });
}

// exp_nonpositive on 16 lanes, the same operations (with fused multiply-adds, so the bits can
// differ from the scalar form's in the last place).
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f), magic = _mm512_set1_ps(12582912.0f);
  // clamped to [-87, 0]; a NaN x gives lo (max_ps returns its second operand)
  const __m512 xc = _mm512_maskz_min_ps(kAll, _mm512_maskz_max_ps(kAll, x, lo), _mm512_setzero_ps());
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 er = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_maskz_slli_epi32(
      kAll, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll, n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(er, _mm512_castsi512_ps(bits));
  const __m512 small = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);  // 0, or the NaN
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), small, e);
}

// Lanes t0 .. t0 + 15 of a row of n.
inline __mmask16 lanes_below(std::int64_t n, std::int64_t t0) {
  return n - t0 >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (n - t0)) - 1u);
}

// v with lane j swapped with lane j ^ w (w = 8, 4, 2, 1): a butterfly step of the reductions
// below, which leave every lane holding lane j (op)= lane j + w for w = 8, 4, 2, 1.
template <int W>
inline __m512 swap_lanes(__m512 v) {
  if constexpr (W == 8) return _mm512_maskz_shuffle_f32x4(kAll, v, v, 0x4E);
  if constexpr (W == 4) return _mm512_maskz_shuffle_f32x4(kAll, v, v, 0xB1);
  if constexpr (W == 2) return _mm512_maskz_permute_ps(kAll, v, 0x4E);
  return _mm512_maskz_permute_ps(kAll, v, 0xB1);
}

inline float tile_max(const float* s, std::int64_t n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (std::int64_t t0 = 0; t0 < n; t0 += 16)
    m = _mm512_mask_max_ps(m, lanes_below(n, t0), m, _mm512_loadu_ps(s + t0));
  m = _mm512_maskz_max_ps(kAll, m, swap_lanes<8>(m));
  m = _mm512_maskz_max_ps(kAll, m, swap_lanes<4>(m));
  m = _mm512_maskz_max_ps(kAll, m, swap_lanes<2>(m));
  m = _mm512_maskz_max_ps(kAll, m, swap_lanes<1>(m));
  return _mm512_cvtss_f32(m);
}

// loops::tile_exp_sum; the lanes are summed in the same pairwise order.
inline float tile_exp_sum(float* s, std::int64_t n, float mx) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), vmx = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (std::int64_t t0 = 0; t0 < n; t0 += 16) {
    const __m512 x = _mm512_mask_sub_ps(ninf, lanes_below(n, t0), _mm512_loadu_ps(s + t0), vmx);
    const __m512 e = exp_nonpositive(x);
    _mm512_storeu_ps(s + t0, e);
    sum = _mm512_add_ps(sum, e);
  }
  sum = _mm512_add_ps(sum, swap_lanes<8>(sum));
  sum = _mm512_add_ps(sum, swap_lanes<4>(sum));
  sum = _mm512_add_ps(sum, swap_lanes<2>(sum));
  sum = _mm512_add_ps(sum, swap_lanes<1>(sum));
  return _mm512_cvtss_f32(sum);
}

}  // namespace avx512
using avx512::accumulate_packed;
using avx512::tile_logits_packed;
using avx512::tile_exp_sum;
using avx512::tile_max;
using avx512::accumulate_values;
using avx512::tile_logits;
using avx512::unpack_offsets;
#else
using loops::accumulate_packed;
using loops::tile_logits_packed;
using loops::tile_exp_sum;
using loops::tile_max;
using loops::accumulate_values;
using loops::tile_logits;
using loops::unpack_offsets;
#endif

}  // namespace detail

// Online-softmax state of the query rows of one KV head: rows = g * n_q.
struct OnlineSoftmax {
  std::int64_t rows = 0, d = 0;
  std::vector<float> max, sum, acc;  // [rows], [rows], [rows][d]
  OnlineSoftmax(std::int64_t r, std::int64_t dim)
      : rows(r), d(dim), max(static_cast<std::size_t>(r), -std::numeric_limits<float>::infinity()),
        sum(static_cast<std::size_t>(r), 0.0f), acc(static_cast<std::size_t>(r * dim), 0.0f) {}

  // Turns the logits of rows r0 .. r0 + R - 1 (row r at s + r * stride, its first n[r] valid)
  // into probabilities relative to the new running maxima, updates the maxima and sums and
  // rescales the rows' outputs by e^(old max - new max). A row whose logits are all masked is
  // left as it was, with n[r] set to 0. Each step runs for all the rows before the next, so
  // their dependency chains (reductions, exponentials) overlap. Rows hold whole chunks of 16
  // floats (those past n[r] are read, not used).
  template <int R>
  void rescale_rows(std::int64_t r0, float* s, std::int64_t stride, std::int64_t* n) {
    float mx[R], corr[R];
    for (int r = 0; r < R; ++r) {
      const float tmax = detail::tile_max(s + r * stride, n[r]);
      const float old = max[static_cast<std::size_t>(r0 + r)];
      mx[r] = tmax > old ? tmax : old;
    }
    for (int r = 0; r < R; ++r) {
      const float old = max[static_cast<std::size_t>(r0 + r)];
      if (n[r] == 0 || mx[r] == -std::numeric_limits<float>::infinity()) n[r] = 0;  // all masked
      corr[r] = mx[r] == old ? 1.0f : detail::exp_nonpositive(old - mx[r]);  // 0 for a first tile
    }
    for (int r = 0; r < R; ++r) {
      if (n[r] == 0) continue;
      const auto ri = static_cast<std::size_t>(r0 + r);
      const float add = detail::tile_exp_sum(s + r * stride, n[r], mx[r]);
      sum[ri] = sum[ri] * corr[r] + add;
      max[ri] = mx[r];
      if (corr[r] != 1.0f) {
        float* a = acc.data() + (r0 + r) * d;
        for (std::int64_t e = 0; e < d; ++e) a[e] *= corr[r];
      }
    }
  }
};

namespace detail {

// Rows of the online softmax taken together per tile pass: the logit and value kernels hold
// 2 kRowBlock running sums of 16 floats each (8 of the 32 AVX-512 registers), enough
// independent sums to keep both FMA ports busy through the 4-cycle latency.
constexpr int kRowBlock = 4;

// Calls f(std::integral_constant<int, R>) for the rows of a block, 1 <= R <= kRowBlock.
template <class F>
void with_rows(std::int64_t rows, F&& f) {
  switch (rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

// Scratch of one work item, in one 64-byte aligned allocation: every part is a multiple of 16
// floats (d and G are multiples of 32), so each starts on a cache line. Left uninitialized
// (zeroing it cost as much as a tenth of a decode step): every part is written before it is read.
struct Workspace {
  std::unique_ptr<float[]> buf;
  float *q, *ky, *kscale, *vscale, *norms, *s, *w, *u;  // ky: the residual's keys
  Workspace(std::int64_t rows, std::int64_t d, std::int64_t G) {
    const std::int64_t sizes[] = {rows * d, d * G, d, d, G, kRowBlock * G, kRowBlock * d, kRowBlock * d};
    std::int64_t total = 16;
    for (std::int64_t n : sizes) total += n;
    buf.reset(new float[static_cast<std::size_t>(total)]);
    const auto addr = reinterpret_cast<std::uintptr_t>(buf.get());
    float* p = buf.get() + ((64 - addr % 64) % 64) / sizeof(float);
    float** parts[] = {&q, &ky, &kscale, &vscale, &norms, &s, &w, &u};
    for (int i = 0; i < 8; ++i) {
      *parts[i] = p;
      p += sizes[i];
    }
  }
};

// The scales of a packed tile into ws: keys kb (block c = channel c) to kscale [d], the token
// norms stored after them (or ones) to norms [G]; values vb (block t (d / G) + b = channels
// [b G, b G + G) of token t) transposed to vscale [d / G][G]. The kernels unpack the codes.
template <class Blk>
void tile_scales(const Blk* kb, const Blk* vb, std::int64_t d, bool token_norm, const Workspace& ws) {
  constexpr int G = Blk::group;
  float* const kscale = ws.kscale;
  for (std::int64_t c = 0; c < d; ++c) kscale[c] = kb[c].scale;
  if (token_norm) {
    const auto* nr = reinterpret_cast<const float*>(kb + d);
    std::copy(nr, nr + G, ws.norms);
  } else {
    std::fill(ws.norms, ws.norms + G, 1.0f);
  }
  float* const vscale = ws.vscale;
  const std::int64_t per_row = d / G;
  for (int t = 0; t < G; ++t)
    for (std::int64_t b = 0; b < per_row; ++b) vscale[b * G + t] = vb[t * per_row + b].scale;
}

// Requests tile i's key and value bytes ahead of their use. The tiles of a work item are read
// once, in order, from L3 or memory, and the work on one tile is short enough that its loads,
// issued as the unpacking reaches them, stalled it (half the time of a warm decode step went to
// the first instruction reading each block).
inline void prefetch_tile(const PackedCache& c, std::int64_t i) {
#if defined(__GNUC__)
  const std::byte* k = c.key_tile(i);
  const std::byte* v = c.value_tile(i);
  for (std::size_t b = 0; b < c.key_tile_size(); b += 64) __builtin_prefetch(k + b, 0, 1);
  for (std::size_t b = 0; b < c.value_tile_size(); b += 64) __builtin_prefetch(v + b, 0, 1);
#else
  (void)c, (void)i;
#endif
}


}  // namespace detail

// heads: the Hkv caches of one layer (same config and head_dim). queries: one layer [Hq][n_q][d]
// in original space (post-RoPE), any element type. out: fp32 [Hq][n_q][d] contiguous. A query
// that sees no token gets a zero output.
template <class Q>
void packed_attention(const cpu_backend& be, std::span<const PackedCache> heads,
                      const KVView<const Q>& queries, const PackedAttentionArgs& args, float* out) {
  const std::int64_t Hkv = static_cast<std::int64_t>(heads.size()), Hq = queries.heads;
  const std::int64_t nq = queries.tokens, d = queries.dim;
  KVP_REQUIRE(Hkv > 0, "packed_attention: no KV heads");
  KVP_REQUIRE(queries.layers == 1, "packed_attention: pass one layer of queries");
  KVP_REQUIRE(Hq % Hkv == 0, "packed_attention: ", Hq, " query heads are not a multiple of ", Hkv,
              " KV heads");
  kvpolicy::validate(queries, "packed_attention: queries");
  const QuantConfig& cfg = heads[0].config();
  for (std::int64_t h = 0; h < Hkv; ++h) {
    const PackedCache& c = heads[static_cast<std::size_t>(h)];
    KVP_REQUIRE(c.head_dim() == d, "packed_attention: head_dim mismatch (queries ", d,
                ", KV head ", h, " ", c.head_dim(), ")");
    KVP_REQUIRE(c.config() == cfg, "packed_attention: KV head ", h,
                " was quantized with another configuration than KV head 0");
    KVP_REQUIRE(!args.bias || args.bias_stride >= c.size(), "packed_attention: bias_stride ",
                args.bias_stride, " is shorter than KV head ", h, "'s ", c.size(), " tokens");
  }
  const std::int64_t g = Hq / Hkv, rows = g * nq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  with_block(cfg.bits, cfg.group, [&](auto blk) {
    using Blk = decltype(blk);
    constexpr int G = Blk::group;
    // Work units of a KV head: its packed tiles, then its residual in pieces of up to G tokens.
    // At decode (few query rows) a head's units are split into chunks of kSplitUnits, each with
    // an online softmax of its own, merged afterwards in chunk order (split-K): a layer has only
    // Hkv heads (3 on the bundled model), too few items for the threads otherwise. The chunks
    // follow the shapes only, so results do not depend on the thread count; with one chunk per
    // head the merge multiplies by exp(0) = 1 and the result is that of one pass.
    constexpr std::int64_t kSplitRows = 16, kSplitUnits = 16;
    struct Item {
      std::int64_t h, u0, u1;
    };
    std::vector<Item> items;
    std::vector<std::int64_t> first_item(static_cast<std::size_t>(Hkv + 1), 0);
    for (std::int64_t h = 0; h < Hkv; ++h) {
      const PackedCache& c = heads[static_cast<std::size_t>(h)];
      const std::int64_t units = c.tiles() + (c.residual_tokens() + G - 1) / G;
      const std::int64_t per = rows <= kSplitRows ? kSplitUnits : std::max<std::int64_t>(units, 1);
      first_item[static_cast<std::size_t>(h)] = static_cast<std::int64_t>(items.size());
      std::int64_t u0 = 0;
      do {
        items.push_back({h, u0, std::min(units, u0 + per)});
        u0 += per;
      } while (u0 < units);
    }
    first_item[static_cast<std::size_t>(Hkv)] = static_cast<std::int64_t>(items.size());
    std::vector<OnlineSoftmax> states(items.size(), OnlineSoftmax(rows, d));
    cpu::parallel_for(be, static_cast<std::int64_t>(items.size()), [&](std::int64_t item) {
      const Item& it = items[static_cast<std::size_t>(item)];
      const std::int64_t h = it.h;
      const PackedCache& c = heads[static_cast<std::size_t>(h)];
      const std::int64_t len = c.size();
      detail::Workspace ws(rows, d, G);
      // Query rows r = m * n_q + i of query head h * g + m, rotated and pre-scaled.
      for (std::int64_t r = 0; r < rows; ++r) {
        float* qr = ws.q + r * d;
        for (std::int64_t e = 0; e < d; ++e) qr[e] = to_float(queries.at(0, h * g + r / nq, r % nq, e)) * scale;
        if (cfg.rotate) hadamard_unchecked(qr, d);
      }
      const float* bias = args.bias ? args.bias + h * args.bias_stride : nullptr;
      OnlineSoftmax& st = states[static_cast<std::size_t>(item)];
      // One tile of n <= G tokens from token `base` on: key scales ws.kscale, norms ws.norms
      // [G], value scales ws.vscale [d / G][G]; logits(rc, w, s) writes the logits of R rows,
      // values(rc, u, n, acc) adds their weighted values. Rows are taken kRowBlock at a time.
      auto fold_tile = [&](std::int64_t base, std::int64_t n, auto&& logits, auto&& values) {
        for (std::int64_t r0 = 0; r0 < rows; r0 += detail::kRowBlock) {
          detail::with_rows(std::min<std::int64_t>(detail::kRowBlock, rows - r0), [&](auto rc) {
            constexpr int R = decltype(rc)::value;
            std::int64_t m[R], m_max = 0;  // tokens of the tile each row sees
            for (int r = 0; r < R; ++r) {
              const std::int64_t visible = args.causal ? len - nq + (r0 + r) % nq + 1 : len;
              m[r] = std::clamp<std::int64_t>(visible - base, 0, n);
              m_max = std::max(m_max, m[r]);
            }
            if (m_max == 0) return;
            for (int r = 0; r < R; ++r)
              for (std::int64_t e = 0; e < d; ++e) ws.w[r * d + e] = ws.q[(r0 + r) * d + e] * ws.kscale[e];
            logits(rc, ws.w, ws.s);
            for (int r = 0; r < R; ++r) {
              float* s = ws.s + r * G;
              for (int t = 0; t < G; ++t) s[t] *= ws.norms[t];
              if (bias)
                for (std::int64_t t = 0; t < m[r]; ++t) s[t] += bias[base + t];
            }
            st.template rescale_rows<R>(r0, ws.s, G, m);
            for (int r = 0; r < R; ++r) {
              // u[r][b][t] = p_t * scale(t, b), zero for the tokens the row does not see.
              const float* s = ws.s + r * G;
              for (std::int64_t b = 0; b < d / G; ++b) {
                float* u = ws.u + r * d + b * G;
                const float* vs = ws.vscale + b * G;
                for (int t = 0; t < G; ++t) u[t] = t < m[r] ? s[t] * vs[t] : 0.0f;
              }
            }
            values(rc, ws.u, m_max, st.acc.data() + r0 * d);
          });
        }
      };
      const std::int64_t last_tile = std::min(it.u1, c.tiles()) - 1;
      if (it.u0 <= last_tile) detail::prefetch_tile(c, it.u0);
      for (std::int64_t u = it.u0; u < it.u1; ++u) {
        if (u < c.tiles()) {
          const std::int64_t tile = u;
          if (tile < last_tile) detail::prefetch_tile(c, tile + 1);
          const auto* kb = reinterpret_cast<const Blk*>(c.key_tile(tile));
          const auto* vb = reinterpret_cast<const Blk*>(c.value_tile(tile));
          detail::tile_scales(kb, vb, d, cfg.token_norm, ws);
          fold_tile(
              tile * G, G,
              [&](auto rc, const float* w, float* s) {
                detail::tile_logits_packed<Blk, decltype(rc)::value>(w, kb, d, s);
              },
              [&](auto rc, const float* p, std::int64_t m, float* acc) {
                detail::accumulate_packed<Blk, decltype(rc)::value>(p, m, vb, d, acc);
              });
          continue;
        }
        // Residual piece: keys transposed into ws.ky (zero past n) with scales 1, values read in
        // place with scales 1.
        const std::int64_t r0 = (u - c.tiles()) * G;
        const std::int64_t n = std::min<std::int64_t>(G, c.residual_tokens() - r0);
        const float* k = c.residual_keys() + r0 * d;
        for (std::int64_t ch = 0; ch < d; ++ch) {
          float* yc = ws.ky + ch * G;
          for (std::int64_t t = 0; t < n; ++t) yc[t] = k[t * d + ch];
          std::fill(yc + n, yc + G, 0.0f);
        }
        std::fill(ws.kscale, ws.kscale + d, 1.0f);
        std::fill(ws.vscale, ws.vscale + d, 1.0f);
        std::copy(c.residual_norms() + r0, c.residual_norms() + r0 + n, ws.norms);
        std::fill(ws.norms + n, ws.norms + G, 0.0f);
        const float* y = c.residual_values() + r0 * d;
        fold_tile(
            c.packed_tokens() + r0, n,
            [&](auto rc, const float* w, float* s) {
              detail::tile_logits<G, decltype(rc)::value>(w, ws.ky, d, s);
            },
            [&](auto rc, const float* p, std::int64_t m, float* acc) {
              detail::accumulate_values<G, decltype(rc)::value>(p, m, y, d, acc);
            });
      }
    });
    // Merge each head's chunks in order and write its rows (with the output rotation): on the
    // calling thread at decode, where it is a few thousand operations, else one task per head.
    auto merge = [&](std::int64_t h) {
      std::vector<float> a(static_cast<std::size_t>(d));
      const auto i0 = static_cast<std::size_t>(first_item[static_cast<std::size_t>(h)]);
      const auto i1 = static_cast<std::size_t>(first_item[static_cast<std::size_t>(h + 1)]);
      for (std::int64_t r = 0; r < rows; ++r) {
        const auto ri = static_cast<std::size_t>(r);
        float mx = -std::numeric_limits<float>::infinity();
        for (std::size_t k = i0; k < i1; ++k) mx = std::max(mx, states[k].max[ri]);
        float sum = 0.0f;
        std::fill(a.begin(), a.end(), 0.0f);
        if (mx != -std::numeric_limits<float>::infinity())
          for (std::size_t k = i0; k < i1; ++k) {
            const OnlineSoftmax& st = states[k];
            if (st.sum[ri] == 0.0f) continue;  // every token of the chunk masked
            const float f = std::exp(st.max[ri] - mx);
            sum += st.sum[ri] * f;
            const float* acc = st.acc.data() + r * d;
            for (std::int64_t e = 0; e < d; ++e) a[static_cast<std::size_t>(e)] += acc[e] * f;
          }
        float* o = out + ((h * g + r / nq) * nq + r % nq) * d;
        for (std::int64_t e = 0; e < d; ++e)
          o[e] = sum > 0.0f ? a[static_cast<std::size_t>(e)] / sum : 0.0f;
        if (cfg.rotate) hadamard_unchecked(o, d);
      }
    };
    if (rows <= kSplitRows)
      for (std::int64_t h = 0; h < Hkv; ++h) merge(h);
    else
      cpu::parallel_for(be, Hkv, merge);
  });
}

}  // namespace kvpolicy::quant
