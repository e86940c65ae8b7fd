// Host tile encoders on GCC/Clang vector extensions (8 floats: one AVX register, two SSE ones
// otherwise), giving quantize_block's bytes for key and value tiles (quantizer.hpp) at a fraction
// of the cost of the per-group code in block.hpp, which remains the fallback and the only path
// elsewhere (CUDA, other compilers: KVP_QUANT_VECTOR undefined).
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

#include "kvpolicy/quant/block.hpp"

#if !defined(__CUDACC__) && (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12))
#define KVP_QUANT_VECTOR 1

namespace kvpolicy::quant::detail {

typedef float qv8f __attribute__((vector_size(32)));
typedef std::int32_t qv8i __attribute__((vector_size(32)));
typedef std::uint32_t qv8u __attribute__((vector_size(32)));

inline void qload(qv8f& v, const float* p) { __builtin_memcpy(&v, p, sizeof v); }

inline void qabs(qv8f& a, const qv8f& x) { a = (qv8f)((qv8u)x & 0x7fffffffu); }

// a <- |a| with the sign of s.
inline void qcopysign(qv8f& a, const qv8f& s) {
  a = (qv8f)(((qv8u)a & 0x7fffffffu) | ((qv8u)s & 0x80000000u));
}

inline bool any_lane(const qv8i& m) {
  std::uint64_t w[4];
  __builtin_memcpy(w, &m, sizeof w);
  return (w[0] | w[1] | w[2] | w[3]) != 0;
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
inline void round_half_away8(qv8f& x) {
  qv8f a;
  qabs(a, x);
  const qv8i small = a < 8388608.0f;  // 2^23: below, a fraction may remain; NaN is not
  qv8f t = __builtin_convertvector(__builtin_convertvector(small ? x : 0.0f, qv8i), qv8f);
  t = small ? t : x;
  qcopysign(t, x);  // truncf(-0.3) = -0
  qv8f d;
  qabs(d, x - t);
  qv8f up = d >= 0.5f ? 1.0f : 0.0f;
  qcopysign(up, x);
  x = t + up;
}

// quant_range(lo[j], hi[j], max_code) for the 8 lanes.
inline void quant_range8(const qv8f& lo, const qv8f& hi, int max_code, qv8f& scale, qv8f& zero) {
  const float m = static_cast<float>(max_code);
  const QuantRange r0 = quant_range(0.0f, 0.0f, max_code);
  const qv8f s = hi / m - lo / m;
  qv8f z = -lo / s;
  round_half_away8(z);
  qv8f az;
  qabs(az, z);
  const qv8i ok = (lo != hi) & (s > 0.0f) & (az <= FLT_MAX);
  const qv8f c = lo != 0.0f ? lo : hi;
  qv8f cs;
  qabs(cs, c);
  const qv8f cz = c < 0.0f ? 1.0f : 0.0f;
  const qv8i both0 = (lo == 0.0f) & (hi == 0.0f);
  scale = both0 ? r0.scale : (ok ? s : cs);
  zero = both0 ? r0.zero : (ok ? z : cz);
}

// Per-lane constants of codes8 for groups (lanes) with minimum lo, maximum hi, the given scale
// and zero point: inv = 1 / scale; limit = 1/2 - t (top of the file; t and the subtraction
// are exact or within the 2^-25); the zero point as an int32; bad |= lanes where the
// reciprocal is not normal or b >= 2^18 (otherwise |zero| <= 2^18 + 1, so the integer
// arithmetic below is exact).
inline void code_constants(const qv8f& lo, const qv8f& hi, const qv8f& scale, const qv8f& zero,
                           qv8f& inv, qv8f& limit, qv8i& izero, qv8i& bad) {
  inv = 1.0f / scale;
  qv8f al, ah;
  qabs(al, lo);
  qabs(ah, hi);
  const qv8f bound = (al > ah ? al : ah) * inv;
  limit = 0.5f - bound * 0x1p-21f;
  const qv8i ok = (scale >= 0x1p-125f) & (scale <= 0x1p125f) & (bound < 262144.0f);
  bad |= ~ok;
  izero = __builtin_convertvector(ok ? zero : 0.0f, qv8i);
}

// Codes of v = x * inv (+ zero, clamped to [0, m]); near |= lanes that may differ from
// quantize_value (see the top of the file). r = the integer nearest to v by adding and removing
// 1.5 * 2^23 (exact for |v| < 2^22; ties are flagged anyway), so |v - r| <= 1/2 and v is
// 1/2 - |v - r| from the nearest half-integer. FMA contraction (GCC fuses x * inv into both
// uses) replaces v by the exact product, which is within the same error budget.
inline void codes8(const qv8f& x, const qv8f& inv, const qv8f& limit, const qv8i& izero,
                   std::int32_t m, qv8u& code, qv8i& near) {
  const qv8f v = x * inv;
  const qv8f r = (v + 12582912.0f) - 12582912.0f;
  qv8f e;
  qabs(e, v - r);
  near |= e >= limit;
  qv8i c = __builtin_convertvector(r, qv8i) + izero;  // the reference's float sum: exact
  c = c > 0 ? c : 0;
  code = (qv8u)(c < m ? c : m);
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

// Key blocks of channels [0, nv * 8) of rows x [n][d] (1 <= n <= G): blocks[j] =
// quantize_block(x + j, d, n). Returns false (codes unwritten) where a lane needs the exact path.
template <class Blk>
inline bool encode_key_channels(const float* x, int n, std::int64_t d, int nv, Blk* blocks) {
  constexpr int G = Blk::group, M = Blk::max_code, B = Blk::bits, W = G * B / 32, kV = 8;
  qv8f lo[kV], hi[kV], inv[kV], limit[kV];
  qv8i izero[kV];
  for (int v = 0; v < nv; ++v) {
    qload(lo[v], x + 8 * v);
    hi[v] = lo[v];
  }
  for (int t = 1; t < n; ++t)  // in token order per channel, as quantize_block (ties of zeros)
    for (int v = 0; v < nv; ++v) {
      qv8f e;
      qload(e, x + t * d + 8 * v);
      lane_op<LaneOp::min>(lo[v], e);
      lane_op<LaneOp::max>(hi[v], e);
    }
  qv8i bad = {};
  for (int v = 0; v < nv; ++v) {
    qv8f scale, zero;
    quant_range8(lo[v], hi[v], M, scale, zero);
    code_constants(lo[v], hi[v], scale, zero, inv[v], limit[v], izero[v], bad);
    float sc[8], ze[8];
    __builtin_memcpy(sc, &scale, sizeof sc);
    __builtin_memcpy(ze, &zero, sizeof ze);
    for (int j = 0; j < 8; ++j) {
      blocks[8 * v + j].scale = sc[j];
      blocks[8 * v + j].zero = ze[j];
    }
  }
  if (any_lane(bad)) return false;
  // Token t of a channel sits at bit B * t of its qs: word (B t) / 32, shifted by (B t) % 32.
  // Channels outer, then words: a vector's reciprocal, zero point and word stay in registers.
  constexpr int per_word = 32 / B;
  qv8i near = {};
  for (int v = 0; v < nv; ++v)
    for (int w = 0; w < W; ++w) {
      qv8u acc = {};
      const int t0 = w * per_word, t1 = n < t0 + per_word ? n : t0 + per_word;
      for (int t = t0; t < t1; ++t) {
        qv8f e;
        qload(e, x + t * d + 8 * v);
        qv8u c;
        codes8(e, inv[v], limit[v], izero[v], M, c, near);
        acc |= c << static_cast<std::uint32_t>(B * (t - t0));
      }
      std::uint32_t out[8];
      __builtin_memcpy(out, &acc, sizeof out);
      for (int j = 0; j < 8; ++j) __builtin_memcpy(blocks[8 * v + j].qs + 4 * w, &out[j], 4);
    }
  if (any_lane(near)) return false;
  return true;
}

}  // namespace kvpolicy::quant::detail
#endif
