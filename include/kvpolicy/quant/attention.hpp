// Attention of one layer over packed caches (PackedCache per KV head, packed tiles + fp32
// residual), never materializing the full-precision cache: each tile of `group` tokens is
// unpacked into a small buffer and folded into an online softmax (running max, sum and output per
// query row), so memory is O(group * d) per thread whatever the length.
//   out[q, i] = H^T sum_j softmax_j((H q_i).K~_j * n_j / sqrt(d) + bias[h, j]) V~_j
// which equals the plain attention over the dequantized cache (see quantizer.hpp: K~, V~, n).
// GQA: query head q reads KV head q / (Hq / Hkv); the tiles of a KV head are unpacked once for all
// its query heads and queries. causal: query i of n_q sees the first len - n_q + i + 1 tokens
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
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/cpu/parallel.hpp"
#include "kvpolicy/quant/packed_cache.hpp"

namespace kvpolicy::quant {

struct PackedAttentionArgs {
  const float* bias = nullptr;  // optional [Hkv][bias_stride] additive logit bias (log_count),
  std::int64_t bias_stride = 0;  //   token j of head h in cache order (packed, then residual)
  bool causal = false;
};

// Online-softmax state of the query rows of one KV head: rows = g * n_q.
struct OnlineSoftmax {
  std::int64_t rows = 0, d = 0;
  std::vector<float> max, sum, acc;  // [rows], [rows], [rows][d]
  OnlineSoftmax(std::int64_t r, std::int64_t dim)
      : rows(r), d(dim), max(static_cast<std::size_t>(r), -std::numeric_limits<float>::infinity()),
        sum(static_cast<std::size_t>(r), 0.0f), acc(static_cast<std::size_t>(r * dim), 0.0f) {}

  // Turns the logits s[0..n) of row r into probabilities relative to the new running max
  // (s[n..n_max) are zeroed too: the caller adds p * v for a whole tile), updates the max and
  // sum and rescales the row's output. Returns false (s all zero) when every logit is masked.
  bool rescale(std::int64_t r, float* s, std::int64_t n, std::int64_t n_max) {
    const auto ri = static_cast<std::size_t>(r);
    float mx = max[ri];
    for (std::int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
    if (n == 0 || mx == -std::numeric_limits<float>::infinity()) {  // all masked
      std::fill(s, s + n_max, 0.0f);
      return false;
    }
    const float corr = std::exp(max[ri] - mx);
    float add = 0;
    for (std::int64_t t = 0; t < n; ++t) add += (s[t] = std::exp(s[t] - mx));
    std::fill(s + n, s + n_max, 0.0f);
    sum[ri] = sum[ri] * corr + add;
    max[ri] = mx;
    if (corr != 1.0f) {
      float* a = acc.data() + r * d;
      for (std::int64_t e = 0; e < d; ++e) a[e] *= corr;
    }
    return true;
  }

  // Folds n logits s[0..n) (overwritten with probabilities) and values v [n][d] into row r.
  void fold(std::int64_t r, float* s, std::int64_t n, const float* v) {
    if (!rescale(r, s, n, n)) return;
    float* a = acc.data() + r * d;
    for (std::int64_t t = 0; t < n; ++t) {
      const float p = s[t];
      const float* vt = v + t * d;
      for (std::int64_t e = 0; e < d; ++e) a[e] += p * vt[e];
    }
  }
};

namespace detail {

// One tile of G tokens in the form the kernels below read: keys channel-major ky [d][G] with a
// scale per channel, values token-major vy [G][d] with a scale per (token, block of G channels).
// Packed tiles hold y = code - zero and the blocks' scales; the residual's fp32 rows are copied
// in with scales of 1 (keys transposed, values as they are).
template <int G>
struct TileBuffer {
  std::int64_t d;
  std::vector<float> ky, kscale, vy, vscale, ones, zeros;
  explicit TileBuffer(std::int64_t dim)
      : d(dim), ky(static_cast<std::size_t>(dim * G)), kscale(static_cast<std::size_t>(dim)),
        vy(static_cast<std::size_t>(G * dim)), vscale(static_cast<std::size_t>(dim)),
        ones(static_cast<std::size_t>(dim), 1.0f), zeros(static_cast<std::size_t>(dim), 0.0f) {}

  template <class Blk>
  void unpack_keys(const std::byte* tile) {
    const auto* kb = reinterpret_cast<const Blk*>(tile);
    for (std::int64_t c = 0; c < d; ++c) {
      block_offsets(kb[c], ky.data() + c * G);
      kscale[static_cast<std::size_t>(c)] = kb[c].scale;
    }
  }
  // Blocks (t, b) in token order, G per token row of the tile: G * d / G = d blocks.
  template <class Blk>
  void unpack_values(const std::byte* tile) {
    const auto* vb = reinterpret_cast<const Blk*>(tile);
    for (std::int64_t i = 0; i < d; ++i) {
      block_offsets(vb[i], vy.data() + i * G);
      vscale[static_cast<std::size_t>(i)] = vb[i].scale;
    }
  }
  // n <= G residual key rows [n][d] (stored form), transposed; tokens past n are zero.
  void load_keys(const float* k, std::int64_t n) {
    for (std::int64_t c = 0; c < d; ++c) {
      float* y = ky.data() + c * G;
      for (std::int64_t t = 0; t < n; ++t) y[t] = k[t * d + c];
      for (std::int64_t t = n; t < G; ++t) y[t] = 0.0f;
    }
    std::fill(kscale.begin(), kscale.end(), 1.0f);
  }
};

// Products folded into one load and store of each running sum: the sums stay in registers for
// kFold terms (a compiler keeps an accumulator array in memory across an outer loop, and a
// store-to-load round trip per term would bound the loops below by its latency). The terms are
// still added in order.
constexpr int kFold = 8;

// s[t] = sum_c (q_c * kscale_c) * ky[c][t], t < G: the tile's key logits of one query row, the
// channels summed in order. d: a multiple of kFold.
template <int G>
void tile_logits(const float* q, const float* ky, const float* kscale, std::int64_t d, float* s) {
  std::fill(s, s + G, 0.0f);
  for (std::int64_t c0 = 0; c0 < d; c0 += kFold) {
    float w[kFold];
    for (int k = 0; k < kFold; ++k) w[k] = q[c0 + k] * kscale[c0 + k];
    const float* y = ky + c0 * G;
    for (int t = 0; t < G; ++t) {
      float a = s[t];
      for (int k = 0; k < kFold; ++k) a += w[k] * y[k * G + t];
      s[t] = a;
    }
  }
}

// a[e] += sum_t p_t * scale(t, e / G) * y[t][e] for t < n, in token order. y: [n][d]; scale:
// [n][d / G] with stride `scale_stride` per token (d / G, or 0 for one row of ones); zero: d
// zeros, read in place of the rows past n.
template <int G>
void accumulate_values(const float* p, std::int64_t n, const float* y, const float* scale,
                       std::int64_t scale_stride, const float* zero, std::int64_t d, float* a) {
  for (std::int64_t t0 = 0; t0 < n; t0 += kFold) {
    const float* row[kFold];
    for (int k = 0; k < kFold; ++k) row[k] = t0 + k < n ? y + (t0 + k) * d : zero;
    for (std::int64_t b = 0; b < d / G; ++b) {
      float u[kFold];
      for (int k = 0; k < kFold; ++k) u[k] = t0 + k < n ? p[t0 + k] * scale[(t0 + k) * scale_stride + b] : 0.0f;
      float* ab = a + b * G;
      for (int j = 0; j < G; ++j) {
        float acc = ab[j];
        for (int k = 0; k < kFold; ++k) acc += u[k] * row[k][b * G + j];
        ab[j] = acc;
      }
    }
  }
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
      // Query rows r = m * n_q + i of query head h * g + m, rotated and pre-scaled.
      std::vector<float> q(static_cast<std::size_t>(rows * d));
      for (std::int64_t r = 0; r < rows; ++r) {
        float* qr = q.data() + r * d;
        for (std::int64_t e = 0; e < d; ++e) qr[e] = to_float(queries.at(0, h * g + r / nq, r % nq, e)) * scale;
        if (cfg.rotate) hadamard_unchecked(qr, d);
      }
      detail::TileBuffer<G> buf(d);
      std::vector<float> norms(static_cast<std::size_t>(G)), s(static_cast<std::size_t>(G));
      const float* bias = args.bias ? args.bias + h * args.bias_stride : nullptr;
      OnlineSoftmax& st = states[static_cast<std::size_t>(item)];
      // One tile of n <= G tokens from token `base` on, its keys in buf and norms [n]; values y
      // [n][d] with scales [n][d / G] (scale_stride d / G) or all ones (scale_stride 0).
      auto fold_tile = [&](std::int64_t base, std::int64_t n, const float* vy, const float* vscale,
                           std::int64_t scale_stride) {
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = r % nq;
          const std::int64_t visible = args.causal ? len - nq + i + 1 : len;
          const std::int64_t m = std::clamp<std::int64_t>(visible - base, 0, n);
          if (m == 0) continue;
          detail::tile_logits<G>(q.data() + r * d, buf.ky.data(), buf.kscale.data(), d, s.data());
          for (std::int64_t t = 0; t < m; ++t) {
            s[static_cast<std::size_t>(t)] *= norms[static_cast<std::size_t>(t)];
            if (bias) s[static_cast<std::size_t>(t)] += bias[base + t];
          }
          if (!st.rescale(r, s.data(), m, n)) continue;
          detail::accumulate_values<G>(s.data(), n, vy, vscale, scale_stride, buf.zeros.data(), d,
                                       st.acc.data() + r * d);
        }
      };
      for (std::int64_t u = it.u0; u < it.u1; ++u) {
        if (u < c.tiles()) {
          const std::int64_t tile = u;
          buf.template unpack_keys<Blk>(c.key_tile(tile));
          if (cfg.token_norm) {
            const auto* nr = reinterpret_cast<const float*>(c.key_tile(tile) + d * static_cast<std::int64_t>(sizeof(Blk)));
            std::copy(nr, nr + G, norms.begin());
          } else {
            std::fill(norms.begin(), norms.end(), 1.0f);
          }
          buf.template unpack_values<Blk>(c.value_tile(tile));
          fold_tile(tile * G, G, buf.vy.data(), buf.vscale.data(), d / G);
          continue;
        }
        // Residual piece: keys transposed into buf, values read in place (scale 1).
        const std::int64_t r0 = (u - c.tiles()) * G;
        const std::int64_t n = std::min<std::int64_t>(G, c.residual_tokens() - r0);
        buf.load_keys(c.residual_keys() + r0 * d, n);
        std::copy(c.residual_norms() + r0, c.residual_norms() + r0 + n, norms.begin());
        fold_tile(c.packed_tokens() + r0, n, c.residual_values() + r0 * d, buf.ones.data(), 0);
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
