// Attention of one layer over packed caches (PackedCache per KV head, packed tiles + fp32
// residual), never materializing the full-precision cache: each tile of `group` tokens is
// dequantized into a small buffer and folded into an online softmax (running max, sum and
// output per query row), so memory is O(group * d) per thread whatever the length.
//   out[q, i] = H^T sum_j softmax_j((H q_i).K~_j * n_j / sqrt(d) + bias[h, j]) V~_j
// which equals the plain attention over the dequantized cache (see quantizer.hpp: K~, V~, n).
// GQA: query head q reads KV head q / (Hq / Hkv); the tiles of a KV head are decoded once for all
// its query heads and queries. causal: query i of n_q sees the first len - n_q + i + 1 tokens
// (as cpu::attention). Deterministic and independent of the thread count (one KV head per task).
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

  // Folds n logits s[0..n) (overwritten with probabilities) and values v [n][d] into row r.
  void fold(std::int64_t r, float* s, std::int64_t n, const float* v) {
    float mx = max[static_cast<std::size_t>(r)];
    for (std::int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
    if (mx == -std::numeric_limits<float>::infinity()) return;  // all masked
    const float corr = std::exp(max[static_cast<std::size_t>(r)] - mx);
    float* a = acc.data() + r * d;
    float add = 0;
    for (std::int64_t t = 0; t < n; ++t) add += (s[t] = std::exp(s[t] - mx));
    sum[static_cast<std::size_t>(r)] = sum[static_cast<std::size_t>(r)] * corr + add;
    max[static_cast<std::size_t>(r)] = mx;
    for (std::int64_t e = 0; e < d; ++e) a[e] *= corr;
    for (std::int64_t t = 0; t < n; ++t) {
      const float p = s[t];
      const float* vt = v + t * d;
      for (std::int64_t e = 0; e < d; ++e) a[e] += p * vt[e];
    }
  }
};

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
  const std::int64_t g = Hq / Hkv, G = cfg.group, rows = g * nq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  with_block(cfg.bits, G, [&](auto blk) {
    using Blk = decltype(blk);
    cpu::parallel_for(be, Hkv, [&](std::int64_t h) {
      const PackedCache& c = heads[static_cast<std::size_t>(h)];
      const std::int64_t len = c.size();
      // Query rows r = m * n_q + i of query head h * g + m, rotated and pre-scaled.
      std::vector<float> q(static_cast<std::size_t>(rows * d));
      for (std::int64_t r = 0; r < rows; ++r) {
        float* qr = q.data() + r * d;
        for (std::int64_t e = 0; e < d; ++e) qr[e] = to_float(queries.at(0, h * g + r / nq, r % nq, e)) * scale;
        if (cfg.rotate) hadamard_unchecked(qr, d);
      }
      std::vector<float> kt(static_cast<std::size_t>(d * G)), vt(static_cast<std::size_t>(G * d));
      std::vector<float> norms(static_cast<std::size_t>(G)), s(static_cast<std::size_t>(G));
      const float* bias = args.bias ? args.bias + h * args.bias_stride : nullptr;
      OnlineSoftmax st(rows, d);
      // One tile: keys channel-major kt [d][G], values vt [n][d], norms [n].
      auto fold_tile = [&](std::int64_t base, std::int64_t n, const float* v) {
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t i = r % nq;
          const std::int64_t visible = args.causal ? len - nq + i + 1 : len;
          const std::int64_t m = std::clamp<std::int64_t>(visible - base, 0, n);
          if (m == 0) continue;
          const float* qr = q.data() + r * d;
          std::fill(s.begin(), s.begin() + m, 0.0f);
          for (std::int64_t e = 0; e < d; ++e) {
            const float qe = qr[e];
            const float* ke = kt.data() + e * G;
            for (std::int64_t t = 0; t < m; ++t) s[static_cast<std::size_t>(t)] += qe * ke[t];
          }
          for (std::int64_t t = 0; t < m; ++t) {
            s[static_cast<std::size_t>(t)] *= norms[static_cast<std::size_t>(t)];
            if (bias) s[static_cast<std::size_t>(t)] += bias[base + t];
          }
          st.fold(r, s.data(), m, v);
        }
      };
      for (std::int64_t tile = 0; tile < c.tiles(); ++tile) {
        const auto* kb = reinterpret_cast<const Blk*>(c.key_tile(tile));
        for (std::int64_t e = 0; e < d; ++e) dequantize_block(kb[e], kt.data() + e * G, 1, static_cast<int>(G));
        if (cfg.token_norm) {
          const auto* nr = reinterpret_cast<const float*>(c.key_tile(tile) + d * static_cast<std::int64_t>(sizeof(Blk)));
          std::copy(nr, nr + G, norms.begin());
        } else {
          std::fill(norms.begin(), norms.end(), 1.0f);
        }
        decode_value_tile<Blk>(c.value_tile(tile), static_cast<int>(G), d, vt.data());
        fold_tile(tile * G, G, vt.data());
      }
      // Residual, in chunks of up to G tokens (values read in place).
      for (std::int64_t r0 = 0; r0 < c.residual_tokens(); r0 += G) {
        const std::int64_t n = std::min(G, c.residual_tokens() - r0);
        for (std::int64_t t = 0; t < n; ++t) {
          const float* kr = c.residual_keys() + (r0 + t) * d;
          for (std::int64_t e = 0; e < d; ++e) kt[static_cast<std::size_t>(e * G + t)] = kr[e];
          norms[static_cast<std::size_t>(t)] = c.residual_norms()[r0 + t];
        }
        fold_tile(c.packed_tokens() + r0, n, c.residual_values() + r0 * d);
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        float* o = out + ((h * g + r / nq) * nq + r % nq) * d;
        const float sum = st.sum[static_cast<std::size_t>(r)];
        const float* a = st.acc.data() + r * d;
        for (std::int64_t e = 0; e < d; ++e) o[e] = sum > 0.0f ? a[e] / sum : 0.0f;
        if (cfg.rotate) hadamard_unchecked(o, d);
      }
    });
  });
}

}  // namespace kvpolicy::quant
