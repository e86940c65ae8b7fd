// CPU reference: column sums of causal softmax attention of the last n_q queries over T keys,
// reduced over each GQA group to its KV head:
//   out[l, h, j] = reduce_{q in group(h)} sum_{i < n_q} softmax_j(q_i . k_j / sqrt(d))
// with query i at position T - n_q + i seeing keys j <= T - n_q + i.
// Blockwise: a work item (layer, KV head) holds one strip of logits of at most g*Bq rows by T
// columns, where Bq shrinks as T grows so the strip stays within kStripFloats; no T x T or
// Hq x n_q x T buffer exists. H2O prefill (n_q = T) runs through the same code with many query
// blocks. Inside a block, keys are taken kKeyTile at a time (converted to fp32 per tile, so an
// fp16 cache never needs a T x d fp32 copy) and each tile's logits are exponentiated against the
// tile's own row maxima while still in cache; a second pass rescales every tile to the row's
// global maximum and sum while adding the column sums (two passes over the strip instead of six).
#pragma once
#include "kvpolicy/core/eigen.hpp"
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/cpu/parallel.hpp"
#include "kvpolicy/cpu/rows.hpp"

namespace kvpolicy::cpu {

inline constexpr std::int64_t kStripFloats = std::int64_t{4} << 20;  // 16 MiB of fp32 logits
inline constexpr std::int64_t kKeyTile = 256;  // keys per GEMM tile: tile of logits + keys in L2

inline float reduce_group(const float* v, std::int64_t n, std::int64_t stride, GqaReduce r) {
  float acc = v[0];
  for (std::int64_t m = 1; m < n; ++m) {
    float x = v[m * stride];
    acc = r == GqaReduce::max ? std::max(acc, x) : acc + x;
  }
  return r == GqaReduce::mean ? acc / static_cast<float>(n) : acc;
}

namespace detail {

// One query block's strip of logits, [rows][klim] with rows = g * bq (query head m, query i at
// row m * bq + i), processed key tile by key tile; see the file comment.
struct StripBlock {
  Eigen::Map<RowMatrix> logits;
  std::int64_t bq, pos0;         // queries per head; position of the block's first query
  std::int64_t tiles;
  float* tile_max;               // [rows][tiles]
  float* tile_scale;             // [rows][tiles]: tile sums, then the rescaling factors

  std::int64_t rows() const { return logits.rows(); }

  // Pass 1 on keys [j0, j0 + nb) (logits already written): exp against each row's tile maximum,
  // masked (causal) entries zeroed.
  void exp_tile(std::int64_t t, std::int64_t j0, std::int64_t nb) {
    for (std::int64_t r = 0; r < rows(); ++r) {
      const std::int64_t len = pos0 + (r % bq) + 1;  // causal: keys 0..pos
      const std::int64_t n = std::clamp<std::int64_t>(len - j0, 0, nb);
      auto seg = logits.row(r).segment(j0, nb).array();
      float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
      if (n > 0) {
        mx = seg.head(n).maxCoeff();
        seg.head(n) = (seg.head(n) - mx).exp();
        sum = seg.head(n).sum();  // >= 1: the maximum contributes exp(0)
      }
      seg.tail(nb - n).setZero();
      tile_max[r * tiles + t] = mx;
      tile_scale[r * tiles + t] = sum;
    }
  }

  // softmax = exp(x - m_tile) * exp(m_tile - m_row) / sum_row: per (row, tile), the factor.
  void normalise() {
    for (std::int64_t r = 0; r < rows(); ++r) {
      const float* mt = tile_max + r * tiles;
      float* st = tile_scale + r * tiles;
      const float mx = *std::max_element(mt, mt + tiles);
      float sum = 0.f;
      for (std::int64_t t = 0; t < tiles; ++t)
        if (st[t] > 0.f) sum += st[t] * std::exp(mt[t] - mx);
      for (std::int64_t t = 0; t < tiles; ++t)
        st[t] = st[t] > 0.f ? std::exp(mt[t] - mx) / sum : 0.f;
    }
  }

  // Pass 2: acc[m, j] += sum_i softmax of query i of head m at key j, tile by tile.
  void add_column_sums(RowMatrix& acc, std::int64_t g) const {
    Eigen::VectorXf w(bq);
    for (std::int64_t t = 0; t < tiles; ++t) {
      const std::int64_t j0 = t * kKeyTile, nb = std::min(kKeyTile, logits.cols() - j0);
      for (std::int64_t m = 0; m < g; ++m) {
        for (std::int64_t i = 0; i < bq; ++i) w[i] = tile_scale[(m * bq + i) * tiles + t];
        acc.row(m).segment(j0, nb).noalias() +=
            w.transpose() * logits.block(m * bq, j0, bq, nb);
      }
    }
  }
};

}  // namespace detail

template <class T>
void window_attention(const cpu_backend& be, const KVView<const T>& keys,
                      const KVView<const T>& queries, GqaReduce reduce, ScoreMap& out) {
  const std::int64_t L = keys.layers, Hkv = keys.heads, Tk = keys.tokens, d = keys.dim;
  const std::int64_t Hq = queries.heads, nq = queries.tokens;
  KVP_REQUIRE(Hkv > 0 && Hq % Hkv == 0, "window_attention: ", Hq,
              " query heads are not a multiple of ", Hkv, " KV heads");
  KVP_REQUIRE(nq >= 1 && nq <= Tk, "window_attention: need 1..", Tk, " queries, got ", nq);
  KVP_REQUIRE(queries.dim == d, "window_attention: query head_dim ", queries.dim,
              " != key head_dim ", d);
  const std::int64_t g = Hq / Hkv, first = Tk - nq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const std::int64_t bq_max = std::clamp<std::int64_t>(kStripFloats / (g * Tk), 1, 64);
  out.resize(L, Hkv, Tk);

  parallel_for(be, L * Hkv, [&](std::int64_t item) {
    const std::int64_t l = item / Hkv, h = item % Hkv;
    RowMatrix kbuf, qbuf, qs, acc = RowMatrix::Zero(g, Tk);
    Eigen::VectorXf strip(g * std::min(bq_max, nq) * Tk);  // uninitialised
    std::vector<float> tile_max, tile_scale;
    for (std::int64_t q0 = 0; q0 < nq; q0 += bq_max) {
      const std::int64_t bq = std::min(bq_max, nq - q0);
      const std::int64_t klim = first + q0 + bq;  // keys visible to the block's last query
      const std::int64_t tiles = (klim + kKeyTile - 1) / kKeyTile;
      qs.resize(g * bq, d);
      for (std::int64_t m = 0; m < g; ++m) {
        load_rows(queries, l, h * g + m, q0, bq, qbuf);
        qs.middleRows(m * bq, bq) = qbuf * scale;
      }
      tile_max.resize(static_cast<std::size_t>(g * bq * tiles));
      tile_scale.resize(tile_max.size());
      detail::StripBlock blk{Eigen::Map<RowMatrix>(strip.data(), g * bq, klim), bq, first + q0,
                             tiles, tile_max.data(), tile_scale.data()};
      for (std::int64_t t = 0; t < tiles; ++t) {
        const std::int64_t j0 = t * kKeyTile, nb = std::min(kKeyTile, klim - j0);
        RowMap K = rows_f32(keys, l, h, j0, nb, kbuf);
        blk.logits.middleCols(j0, nb).noalias() = qs * K.transpose();
        blk.exp_tile(t, j0, nb);
      }
      blk.normalise();
      blk.add_column_sums(acc, g);
    }
    auto dst = out.row(l, h);
    for (std::int64_t j = 0; j < Tk; ++j) dst[j] = reduce_group(acc.data() + j, g, Tk, reduce);
  });
}

}  // namespace kvpolicy::cpu
