// CPU reference: column sums of causal softmax attention of the last n_q queries over T keys,
// reduced over each GQA group to its KV head:
//   out[l, h, j] = reduce_{q in group(h)} sum_{i < n_q} softmax_j(q_i . k_j / sqrt(d))
// with query i at position T - n_q + i seeing keys j <= T - n_q + i.
// Blockwise: a work item (layer, KV head) holds its keys in fp32 and one strip of logits of at
// most g*Bq rows by T columns, where Bq shrinks as T grows so the strip stays within
// kStripFloats; no T x T or Hq x n_q x T buffer exists. H2O prefill (n_q = T) runs through the
// same code with many query blocks.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/cpu/parallel.hpp"
#include "kvpolicy/cpu/rows.hpp"

namespace kvpolicy::cpu {

inline constexpr std::int64_t kStripFloats = std::int64_t{4} << 20;  // 16 MiB of fp32 logits

inline float reduce_group(const float* v, std::int64_t n, std::int64_t stride, GqaReduce r) {
  float acc = v[0];
  for (std::int64_t m = 1; m < n; ++m) {
    float x = v[m * stride];
    acc = r == GqaReduce::max ? std::max(acc, x) : acc + x;
  }
  return r == GqaReduce::mean ? acc / static_cast<float>(n) : acc;
}

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
    RowMatrix kbuf, qbuf, qs, strip, acc = RowMatrix::Zero(g, Tk);
    RowMap K = rows_f32(keys, l, h, 0, Tk, kbuf);
    for (std::int64_t q0 = 0; q0 < nq; q0 += bq_max) {
      const std::int64_t bq = std::min(bq_max, nq - q0);
      const std::int64_t klim = first + q0 + bq;  // keys visible to the block's last query
      qs.resize(g * bq, d);
      for (std::int64_t m = 0; m < g; ++m) {
        load_rows(queries, l, h * g + m, q0, bq, qbuf);
        qs.middleRows(m * bq, bq) = qbuf * scale;
      }
      strip.resize(g * bq, klim);
      strip.noalias() = qs * K.topRows(klim).transpose();
      for (std::int64_t r = 0; r < g * bq; ++r) {
        const std::int64_t len = first + q0 + (r % bq) + 1;  // causal: keys 0..pos
        auto row = strip.row(r);
        auto valid = row.head(len).array();
        const float mx = valid.maxCoeff();
        valid = (valid - mx).exp();
        valid /= valid.sum();
        row.tail(klim - len).setZero();
      }
      for (std::int64_t m = 0; m < g; ++m)
        acc.row(m).head(klim) += strip.middleRows(m * bq, bq).colwise().sum();
    }
    auto dst = out.row(l, h);
    for (std::int64_t j = 0; j < Tk; ++j) dst[j] = reduce_group(acc.data() + j, g, Tk, reduce);
  });
}

}  // namespace kvpolicy::cpu
