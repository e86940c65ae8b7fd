// Host tile encoders on GCC/Clang vector extensions (8 floats: one AVX register, two SSE ones
// otherwise; the key encoder takes 16 floats, one AVX-512 register, where AVX-512 is enabled),
// giving quantize_block's bytes for key and value tiles (quantizer.hpp) at a fraction of the
// cost of the per-group code in block.hpp, which remains the fallback and the only path
// elsewhere (CUDA, other compilers: KVP_QUANT_VECTOR undefined). The lane-wise steps are the
// same at either width, so the argument below holds for both.
//
// Why it is exact:
// - min / max: the same comparisons (keys: per channel in token order, as the reference scans;
//   values: in a tree, then group_min_max's rule for the sign of a zero result). The order only
//   matters for a NaN (a rotation that overflowed), so value batches with a non-finite sum take
//   the exact path.
// - quant_range8 is quant_range lane by lane: the same divisions (IEEE, so the same bits in a
//   vector), its branches as selects, and truncf as an int32 round trip where |x| < 2^23 (larger
//   values are integers already) with truncf's sign put back.
// - Codes: quantize_value needs round(q), q = fl(x / scale); the division is most of the
//   reference's cost. We take v = x * inv with inv = fl(1 / scale) instead (v rounded, or exact
//   where the compiler fuses the product into the next operation). With inv normal
//   (2^-125 <= scale <= 2^125), |v - q| <= (3 * 2^-24 + 2^-48) |x / scale| <= 3.0001 * 2^-24 b,
//   b = max |x| / scale over the group. Where v is more than t = 2^-21 b (+ 2^-25 for the
//   roundings of the test itself) away from every half-integer, q lies strictly inside the same
//   interval between half-integers, so it rounds (half away from zero) to the same integer, and
//   c = round + zero, clamped, is the same code. (For b < 1/10 every |q| and |v| is below 0.11:
//   code 0 either way, and never flagged.) Values within the margin (about 2^-20 of random
//   ones) send their whole batch (8 value groups, or 64 key channels of a tile) to the exact
//   path, which divides; so do groups with b >= 2^18 or a reciprocal that is not normal.
// - A zero r = round(v) may be +0 where round(q) is -0; r + zero then differs only in the sign
//   of a zero, which clamps to code 0 either way.
//
// Functions take and return vectors by reference: a vector argument or result changes the ABI
// without AVX (-Wpsabi), and these inline functions may be compiled both ways in one program.
#pragma once
#include <cfloat>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvpolicy/quant/block.hpp"

#if !defined(__CUDACC__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define KVP_QUANT_VECTOR 1

namespace kvpolicy::quant::detail {

typedef float qv8f __attribute__((vector_size(32)));
typedef std::int32_t qv8i __attribute__((vector_size(32)));
typedef std::uint32_t qv8u __attribute__((vector_size(32)));
// 16 lanes: one AVX-512 register. The lane-wise functions below take either width (F: the float
// vector; QV<F> names its int and unsigned twins); the key encoder runs on 16 lanes where
// AVX-512 is enabled (half the instructions per channel), 8 otherwise.
typedef float qv16f __attribute__((vector_size(64)));
typedef std::int32_t qv16i __attribute__((vector_size(64)));
typedef std::uint32_t qv16u __attribute__((vector_size(64)));

template <class F>
struct QV;
template <>
struct QV<qv8f> {
  using i = qv8i;
  using u = qv8u;
  static constexpr int lanes = 8;
};
template <>
struct QV<qv16f> {
  using i = qv16i;
  using u = qv16u;
  static constexpr int lanes = 16;
};

template <class F>
inline void qload(F& v, const float* p) {
  __builtin_memcpy(&v, p, sizeof v);
}

template <class F>
inline void qabs(F& a, const F& x) {
  a = (F)((typename QV<F>::u)x & 0x7fffffffu);
}

// a <- |a| with the sign of s.
template <class F>
inline void qcopysign(F& a, const F& s) {
  using U = typename QV<F>::u;
  a = (F)(((U)a & 0x7fffffffu) | ((U)s & 0x80000000u));
}

template <class I>
inline bool any_lane(const I& m) {
  std::uint64_t w[sizeof(I) / 8];
  __builtin_memcpy(w, &m, sizeof w);
  std::uint64_t r = 0;
  for (std::uint64_t x : w) r |= x;
  return r != 0;
}

enum class LaneOp { min, max, bit_or };

template <LaneOp Op, class V>
inline void lane_op(V& a, const V& b) {
  if constexpr (Op == LaneOp::min) a = b < a ? b : a;
  else if constexpr (Op == LaneOp::max) a = b > a ? b : a;
  else a |= b;
}

// r[k] = Op over the 8 lanes of a[k], k < 8: three rounds of pairing, each halving the vectors
// (21 operations where eight separate reductions take 56).
template <LaneOp Op, class V>
inline void reduce_lanes8(const V* a, V& r) {
  V b[4], c[2];
  for (int p = 0; p < 4; ++p) {  // lanes: a0 a1 a0 a1 ... over lane pairs
    b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 8, 2, 10, 4, 12, 6, 14);
    lane_op<Op>(b[p], __builtin_shufflevector(a[2 * p], a[2 * p + 1], 1, 9, 3, 11, 5, 13, 7, 15));
  }
  for (int p = 0; p < 2; ++p) {  // lanes: a0 a1 a2 a3 a0 a1 a2 a3 over lane quadruples
    c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 8, 9, 4, 5, 12, 13);
    lane_op<Op>(c[p], __builtin_shufflevector(b[2 * p], b[2 * p + 1], 2, 3, 10, 11, 6, 7, 14, 15));
  }
  r = __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11);
  lane_op<Op>(r, __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15));
}

// x <- round_half_away(x) lane by lane, bit for bit (signed zeros, infinities and NaN included).
template <class F>
inline void round_half_away8(F& x) {
  F a;
  qabs(a, x);
  const typename QV<F>::i small = a < 8388608.0f;  // 2^23: below, a fraction may remain; NaN is not
  F t = __builtin_convertvector(__builtin_convertvector(small ? x : 0.0f, typename QV<F>::i), F);
  t = small ? t : x;
  qcopysign(t, x);  // truncf(-0.3) = -0
  F d;
  qabs(d, x - t);
  F up = d >= 0.5f ? 1.0f : 0.0f;
  qcopysign(up, x);
  x = t + up;
}

// quant_range(lo[j], hi[j], max_code) for every lane (8 or 16).
template <class F>
inline void quant_range8(const F& lo, const F& hi, int max_code, F& scale, F& zero) {
  using I = typename QV<F>::i;
  const float m = static_cast<float>(max_code);
  const QuantRange r0 = quant_range(0.0f, 0.0f, max_code);
  const F s = hi / m - lo / m;
  F z = -lo / s;
  round_half_away8(z);
  F az;
  qabs(az, z);
  const I ok = (lo != hi) & (s > 0.0f) & (az <= FLT_MAX);
  const F c = lo != 0.0f ? lo : hi;
  F cs;
  qabs(cs, c);
  const F cz = c < 0.0f ? 1.0f : 0.0f;
  const I both0 = (lo == 0.0f) & (hi == 0.0f);
  scale = both0 ? r0.scale : (ok ? s : cs);
  zero = both0 ? r0.zero : (ok ? z : cz);
}

// Per-lane constants of codes8 for groups (lanes) with minimum lo, maximum hi, the given scale
// and zero point: inv = 1 / scale; limit = 1/2 - t (top of the file; t and the subtraction
// are exact or within the 2^-25); the zero point as an int32; bad |= lanes where the
// reciprocal is not normal or b >= 2^18 (otherwise |zero| <= 2^18 + 1, so the integer
// arithmetic below is exact).
template <class F, class I>
inline void code_constants(const F& lo, const F& hi, const F& scale, const F& zero, F& inv,
                           F& limit, I& izero, I& bad) {
  inv = 1.0f / scale;
  F al, ah;
  qabs(al, lo);
  qabs(ah, hi);
  const F bound = (al > ah ? al : ah) * inv;
  limit = 0.5f - bound * 0x1p-21f;
  const I ok = (scale >= 0x1p-125f) & (scale <= 0x1p125f) & (bound < 262144.0f);
  bad |= ~ok;
  izero = __builtin_convertvector(ok ? zero : 0.0f, I);
}

// Codes of v = x * inv (+ zero, clamped to [0, m]); near |= lanes that may differ from
// quantize_value (see the top of the file). r = the integer nearest to v by adding and removing
// 1.5 * 2^23 (exact for |v| < 2^22; ties are flagged anyway), so |v - r| <= 1/2 and v is
// 1/2 - |v - r| from the nearest half-integer. FMA contraction (GCC fuses x * inv into both
// uses) replaces v by the exact product, which is within the same error budget.
template <class F, class I, class U>
inline void codes8(const F& x, const F& inv, const F& limit, const I& izero, std::int32_t m,
                   U& code, I& near) {
  const F v = x * inv;
  const F r = (v + 12582912.0f) - 12582912.0f;
  F e;
  qabs(e, v - r);
  near |= e >= limit;
  I c = __builtin_convertvector(r, I) + izero;  // the reference's float sum: exact
  c = c > 0 ? c : 0;
  code = (U)(c < m ? c : m);
}

// reduce_lanes8's rounds on 16-lane vectors (pairs of lanes, of pairs, of quads, of halves).
// With all four rounds (a[0..16)) lane k of r is Op over the lanes of a[k]; with the first three
// (a[0..8)) lane 8 h + k is Op over lanes [8 h, 8 h + 8) of a[k].
template <LaneOp Op, int Rounds, class V>
inline void reduce_lanes16(const V* a, V& r) {
  static_assert(Rounds == 3 || Rounds == 4);
  V b[8], c[4], e[2];
  for (int p = 0; p < 8 && p < (Rounds == 4 ? 8 : 4); ++p) {
    b[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    lane_op<Op>(b[p], __builtin_shufflevector(a[2 * p], a[2 * p + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31));
  }
  for (int p = 0; p < (Rounds == 4 ? 4 : 2); ++p) {
    c[p] = __builtin_shufflevector(b[2 * p], b[2 * p + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    lane_op<Op>(c[p], __builtin_shufflevector(b[2 * p], b[2 * p + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31));
  }
  for (int p = 0; p < (Rounds == 4 ? 2 : 1); ++p) {
    e[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    lane_op<Op>(e[p], __builtin_shufflevector(c[2 * p], c[2 * p + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31));
  }
  if constexpr (Rounds == 3) {
    r = e[0];
  } else {
    r = __builtin_shufflevector(e[0], e[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    lane_op<Op>(r, __builtin_shufflevector(e[0], e[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31));
  }
}

// encode_value_groups8 for 16 groups of 32 values on 16-lane vectors (AVX-512): the same steps
// lane for lane (so the same bytes, and the same exact-path rule per batch), half the
// instructions per value. Two vectors per group; a vector of 16 codes is one 32-bit word of
// int2 codes, two words (lanes 0-7, 8-15) of int4 codes, so the words come from four or three
// rounds of lane ORs.
template <class Blk>
inline bool encode_value_groups16(const float* x, Blk* blocks) {
  static_assert(Blk::group == 32, "two 16-lane vectors per group");
  constexpr int G = 32, M = Blk::max_code, B = Blk::bits, W = G * B / 32;
  qv16f gl[16], gh[16], sum = {};
  for (int g = 0; g < 16; ++g) {
    qv16f l, h, v;
    qload(l, x + g * G);
    qload(v, x + g * G + 16);
    h = l;
    sum += l;
    lane_op<LaneOp::min>(l, v);
    lane_op<LaneOp::max>(h, v);
    sum += v;
    gl[g] = l;
    gh[g] = h;
  }
  qv16f asum;
  qabs(asum, sum);
  if (any_lane(~(asum <= FLT_MAX))) return false;  // NaN, infinity, overflow: exact path
  qv16f lo, hi;
  reduce_lanes16<LaneOp::min, 4>(gl, lo);
  reduce_lanes16<LaneOp::max, 4>(gh, hi);
  if (any_lane((lo == 0.0f) | (hi == 0.0f))) {  // group_min_max's sign of a zero result
    float l[16], h[16];
    __builtin_memcpy(l, &lo, sizeof l);
    __builtin_memcpy(h, &hi, sizeof h);
    for (int g = 0; g < 16; ++g)
      if (l[g] == 0.0f || h[g] == 0.0f)
        for (int i = 0; i < G; ++i)
          if (x[g * G + i] == 0.0f) {
            if (l[g] == 0.0f) l[g] = x[g * G + i];
            if (h[g] == 0.0f) h[g] = x[g * G + i];
            break;
          }
    __builtin_memcpy(&lo, l, sizeof l);
    __builtin_memcpy(&hi, h, sizeof h);
  }
  qv16f scale, zero, inv, limit;
  qv16i izero, bad = {};
  quant_range8(lo, hi, M, scale, zero);
  code_constants(lo, hi, scale, zero, inv, limit, izero, bad);
  if (any_lane(bad)) return false;
  float sc[16], ze[16], iv[16], li[16];
  std::int32_t iz[16];
  __builtin_memcpy(sc, &scale, sizeof sc);
  __builtin_memcpy(ze, &zero, sizeof ze);
  __builtin_memcpy(iv, &inv, sizeof iv);
  __builtin_memcpy(li, &limit, sizeof li);
  __builtin_memcpy(iz, &izero, sizeof iz);
  // Value 16 k + j of a group: bit B (16 k + j) of its qs, i.e. word k, bit 2 j (int2), or word
  // 2 k + j / 8, bit 4 (j % 8) (int4).
  qv16u lane_shift;
  for (int j = 0; j < 16; ++j) lane_shift[j] = static_cast<std::uint32_t>((B * j) % 32);
  qv16u codes[32];  // [group][vector]
  qv16i near = {};
  for (int g = 0; g < 16; ++g) {
    const qv16f ivg = iv[g] + qv16f{}, lig = li[g] + qv16f{};
    const qv16i izg = iz[g] + qv16i{};
    for (int k = 0; k < 2; ++k) {
      qv16f v;
      qload(v, x + g * G + 16 * k);
      qv16u c;
      codes8(v, ivg, lig, izg, M, c, near);
      codes[2 * g + k] = c << lane_shift;
    }
  }
  if (any_lane(near)) return false;
  for (int g = 0; g < 16; ++g) {
    blocks[g].scale = sc[g];
    blocks[g].zero = ze[g];
  }
  std::uint32_t out[16];
  if constexpr (B == 2) {  // lane j of batch q: word (16 q + j) % 2 of group (16 q + j) / 2
    for (int q = 0; q < 2; ++q) {
      qv16u r;
      reduce_lanes16<LaneOp::bit_or, 4>(codes + 16 * q, r);
      __builtin_memcpy(out, &r, sizeof out);
      for (int j = 0; j < 16; ++j) {
        const int wi = 16 * q + j;
        __builtin_memcpy(blocks[wi / W].qs + 4 * (wi % W), &out[j], 4);
      }
    }
  } else {  // lane 8 h + j of batch q: half h of vector 8 q + j = word 2 ((8 q + j) % 2) + h
    for (int q = 0; q < 4; ++q) {
      qv16u r;
      reduce_lanes16<LaneOp::bit_or, 3>(codes + 8 * q, r);
      __builtin_memcpy(out, &r, sizeof out);
      for (int j = 0; j < 16; ++j) {
        const int vi = 8 * q + j % 8, h = j / 8;
        __builtin_memcpy(blocks[vi / 2].qs + 4 * (2 * (vi % 2) + h), &out[j], 4);
      }
    }
  }
  return true;
}

// Value groups 8 at a time: blocks[0..8) = quantize_group of x[0 .. 8 G) (Blk::group = G
// contiguous values each). Returns false where a lane needs the exact path (quantize_group),
// with blocks partly written.
template <class Blk>
inline bool encode_value_groups8(const float* x, Blk* blocks) {
  constexpr int G = Blk::group, VG = G / 8, M = Blk::max_code, B = Blk::bits;
  qv8f gl[8], gh[8], sum = {};
  for (int g = 0; g < 8; ++g) {
    const float* p = x + g * G;
    qv8f l, h;
    qload(l, p);
    h = l;
    sum += l;
    for (int k = 1; k < VG; ++k) {
      qv8f v;
      qload(v, p + 8 * k);
      lane_op<LaneOp::min>(l, v);
      lane_op<LaneOp::max>(h, v);
      sum += v;
    }
    gl[g] = l;
    gh[g] = h;
  }
  // A NaN (from a rotation that overflowed) makes the result depend on the order of the
  // comparisons, which differs from group_min_max's: such batches, and any with an infinity or
  // a sum that overflows, take the exact path.
  qv8f asum;
  qabs(asum, sum);
  if (any_lane(~(asum <= FLT_MAX))) return false;
  qv8f lo, hi;
  reduce_lanes8<LaneOp::min>(gl, lo);
  reduce_lanes8<LaneOp::max>(gh, hi);
  if (any_lane((lo == 0.0f) | (hi == 0.0f))) {  // group_min_max's sign of a zero result
    float l[8], h[8];
    __builtin_memcpy(l, &lo, sizeof l);
    __builtin_memcpy(h, &hi, sizeof h);
    for (int g = 0; g < 8; ++g)
      if (l[g] == 0.0f || h[g] == 0.0f)
        for (int i = 0; i < G; ++i)
          if (x[g * G + i] == 0.0f) {
            if (l[g] == 0.0f) l[g] = x[g * G + i];
            if (h[g] == 0.0f) h[g] = x[g * G + i];
            break;
          }
    __builtin_memcpy(&lo, l, sizeof l);
    __builtin_memcpy(&hi, h, sizeof h);
  }
  qv8f scale, zero, inv, limit;
  qv8i izero, bad = {};
  quant_range8(lo, hi, M, scale, zero);
  code_constants(lo, hi, scale, zero, inv, limit, izero, bad);
  float sc[8], ze[8], iv[8], li[8];
  std::int32_t iz[8];
  __builtin_memcpy(sc, &scale, sizeof sc);
  __builtin_memcpy(ze, &zero, sizeof ze);
  __builtin_memcpy(iv, &inv, sizeof iv);
  __builtin_memcpy(li, &limit, sizeof li);
  __builtin_memcpy(iz, &izero, sizeof iz);
  for (int g = 0; g < 8; ++g) {
    blocks[g].scale = sc[g];
    blocks[g].zero = ze[g];
  }
  if (any_lane(bad)) return false;

  // Value i of a group sits at bit B * i of its qs (little-endian words): vector k (values 8k ..
  // 8k + 7) fills 8 B bits, so one 32-bit word takes 32 / (8 B) vectors, each lane shifted to
  // its place; the word is the OR of the lanes.
  constexpr int VW = 32 / (8 * B);  // vectors per word: 2 (int2) or 1 (int4)
  constexpr int W = VG / VW;        // words per group
  qv8u lane_shift;
  for (int j = 0; j < 8; ++j) lane_shift[j] = static_cast<std::uint32_t>(B * j);
  qv8u words[8 * W];
  qv8i near = {};
  for (int g = 0; g < 8; ++g) {
    const qv8f ivg = {iv[g], iv[g], iv[g], iv[g], iv[g], iv[g], iv[g], iv[g]};
    const qv8f lig = {li[g], li[g], li[g], li[g], li[g], li[g], li[g], li[g]};
    const qv8i izg = {iz[g], iz[g], iz[g], iz[g], iz[g], iz[g], iz[g], iz[g]};
    for (int w = 0; w < W; ++w) {
      qv8u acc = {};
      for (int u = 0; u < VW; ++u) {
        qv8f v;
        qload(v, x + g * G + 8 * (w * VW + u));
        qv8u c;
        codes8(v, ivg, lig, izg, M, c, near);
        acc |= c << (lane_shift + static_cast<std::uint32_t>(8 * B * u));
      }
      words[g * W + w] = acc;
    }
  }
  if (any_lane(near)) return false;
  for (int w0 = 0; w0 < 8 * W; w0 += 8) {
    qv8u r;
    reduce_lanes8<LaneOp::bit_or>(words + w0, r);
    std::uint32_t out[8];
    __builtin_memcpy(out, &r, sizeof out);
    for (int j = 0; j < 8; ++j) {
      const int wi = w0 + j;  // word wi % W of group wi / W
      __builtin_memcpy(blocks[wi / W].qs + 4 * (wi % W), &out[j], 4);
    }
  }
  return true;
}

// 16 key blocks of a group-32 format (channels j < 16 in lanes: scale, zero point, the
// W = 2 (int2) or 4 (int4) code words) written as whole vectors: the blocks are contiguous,
// 2 + W words each, so the 16 x (2 + W) words are transposed in registers (interleave two
// fields, then place the pairs) and stored as 2 + W vectors, where a lane-by-lane write takes an
// extract and a store per word (2 + W per channel).
template <class Blk>
inline void store_key_blocks16(const qv16f& scale, const qv16f& zero, const qv16u* words,
                               Blk* blocks) {
  constexpr int W = Blk::group * Blk::bits / 32;
  static_assert(Blk::group == 32 && (W == 2 || W == 4) && sizeof(Blk) == 4 * (2 + W));
  // lo / hi: lanes 2c, 2c + 1 = x[c], y[c] for channels c < 8 / c >= 8.
  const auto lo = [](const qv16u& x, const qv16u& y) {
    return __builtin_shufflevector(x, y, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  };
  const auto hi = [](const qv16u& x, const qv16u& y) {
    return __builtin_shufflevector(x, y, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  };
  const qv16u s = (qv16u)scale, z = (qv16u)zero;
  qv16u out[2 + W];
  if constexpr (W == 2) {  // block c = words 4c .. 4c + 3: pair c of (s, z), then of (w0, w1)
    const qv16u sz[2] = {lo(s, z), hi(s, z)}, c[2] = {lo(words[0], words[1]), hi(words[0], words[1])};
    for (int h = 0; h < 2; ++h) {
      out[2 * h] = __builtin_shufflevector(sz[h], c[h], 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
      out[2 * h + 1] = __builtin_shufflevector(sz[h], c[h], 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
    }
  } else {  // block c = words 6c .. 6c + 5: pair c of (s, z), (w0, w1), (w2, w3)
    const qv16u sz[2] = {lo(s, z), hi(s, z)}, a[2] = {lo(words[0], words[1]), hi(words[0], words[1])},
                b[2] = {lo(words[2], words[3]), hi(words[2], words[3])};
    for (int h = 0; h < 2; ++h) {  // 48 words per half, 3 vectors; (s, z) and (w0, w1), then (w2, w3)
      out[3 * h] = __builtin_shufflevector(__builtin_shufflevector(sz[h], a[h], 0, 1, 16, 17, 0, 0, 2, 3, 18, 19, 0, 0, 4, 5, 20, 21), b[h],
                                           0, 1, 2, 3, 16, 17, 6, 7, 8, 9, 18, 19, 12, 13, 14, 15);
      out[3 * h + 1] = __builtin_shufflevector(__builtin_shufflevector(sz[h], a[h], 0, 0, 6, 7, 22, 23, 0, 0, 8, 9, 24, 25, 0, 0, 10, 11), b[h],
                                               20, 21, 2, 3, 4, 5, 22, 23, 8, 9, 10, 11, 24, 25, 14, 15);
      out[3 * h + 2] = __builtin_shufflevector(__builtin_shufflevector(sz[h], a[h], 26, 27, 0, 0, 12, 13, 28, 29, 0, 0, 14, 15, 30, 31, 0, 0), b[h],
                                               0, 1, 26, 27, 4, 5, 6, 7, 28, 29, 10, 11, 12, 13, 30, 31);
    }
  }
  __builtin_memcpy(static_cast<void*>(blocks), out, sizeof out);
}

// Key blocks of channels [0, nv * L) of rows x [n][d] (1 <= n <= G), L = the lanes of F (8 or
// 16): blocks[j] = quantize_block(x + j, d, n). Returns false (blocks unwritten) where a lane
// needs the exact path. nv <= 64 / L. Everything is computed before anything is written, so
// that 16-lane group-32 blocks are stored whole (store_key_blocks16).
template <class Blk, class F = qv8f>
inline bool encode_key_channels(const float* x, int n, std::int64_t d, int nv, Blk* blocks) {
  using I = typename QV<F>::i;
  using U = typename QV<F>::u;
  constexpr int G = Blk::group, M = Blk::max_code, B = Blk::bits, W = G * B / 32, L = QV<F>::lanes;
  constexpr int kV = 64 / L;
  F lo[kV], hi[kV], inv[kV], limit[kV], scale[kV], zero[kV];
  I izero[kV];
  for (int v = 0; v < nv; ++v) {
    qload(lo[v], x + L * v);
    hi[v] = lo[v];
  }
  for (int t = 1; t < n; ++t)  // in token order per channel, as quantize_block (ties of zeros)
    for (int v = 0; v < nv; ++v) {
      F e;
      qload(e, x + t * d + L * v);
      lane_op<LaneOp::min>(lo[v], e);
      lane_op<LaneOp::max>(hi[v], e);
    }
  I bad = {};
  for (int v = 0; v < nv; ++v) {
    quant_range8(lo[v], hi[v], M, scale[v], zero[v]);
    code_constants(lo[v], hi[v], scale[v], zero[v], inv[v], limit[v], izero[v], bad);
  }
  if (any_lane(bad)) return false;
  // Token t of a channel sits at bit B * t of its qs: word (B t) / 32, shifted by (B t) % 32.
  // Channels outer, then words: a vector's reciprocal, zero point and word stay in registers.
  // A whole tile (n = G, the packed cache's case) runs with constant bounds and shifts.
  constexpr int per_word = 32 / B;
  I near = {};
  U words[kV][W];
  const auto code_words = [&](auto full) {
    for (int v = 0; v < nv; ++v)
#pragma GCC unroll 4
      for (int w = 0; w < W; ++w) {
        U acc = {};
        const int t0 = w * per_word;
        const int t1 = decltype(full)::value ? t0 + per_word : (n < t0 + per_word ? n : t0 + per_word);
#pragma GCC unroll 16
        for (int t = t0; t < t1; ++t) {
          F e;
          qload(e, x + t * d + L * v);
          U c;
          codes8(e, inv[v], limit[v], izero[v], M, c, near);
          acc |= c << static_cast<std::uint32_t>(B * (t - t0));
        }
        words[v][w] = acc;
      }
  };
  if (n == G) code_words(std::true_type{});
  else code_words(std::false_type{});
  if (any_lane(near)) return false;
  for (int v = 0; v < nv; ++v) {
    if constexpr (L == 16 && G == 32) {
      store_key_blocks16(scale[v], zero[v], words[v], blocks + L * v);
    } else {
      float sc[L], ze[L];
      __builtin_memcpy(sc, &scale[v], sizeof sc);
      __builtin_memcpy(ze, &zero[v], sizeof ze);
      for (int j = 0; j < L; ++j) {
        blocks[L * v + j].scale = sc[j];
        blocks[L * v + j].zero = ze[j];
      }
      for (int w = 0; w < W; ++w) {
        std::uint32_t out[L];
        __builtin_memcpy(out, &words[v][w], sizeof out);
        for (int j = 0; j < L; ++j) __builtin_memcpy(blocks[L * v + j].qs + 4 * w, &out[j], 4);
      }
    }
  }
  return true;
}

}  // namespace kvpolicy::quant::detail
#endif
