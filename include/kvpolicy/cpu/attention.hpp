// CPU reference attention over a ragged cache (one layer): every KV head h has its own length
// len[h]; query head q reads KV head q / g. An optional per-token additive logit bias (log of a
// merged token's count: proportional attention) is added before the softmax. With causal=true,
// query i of n_q sees the first len - n_q + i + 1 keys (prefill of an uncompressed tail).
//   out[q, i, :] = sum_j softmax_j(q_i . k_j / sqrt(d) + bias[h, j]) v_j     (fp32)
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <vector>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/cpu/parallel.hpp"
#include "kvpolicy/cpu/rows.hpp"

namespace kvpolicy::cpu {

struct RaggedAttentionArgs {
  const std::int64_t* lengths = nullptr;  // [Hkv] valid tokens per KV head
  const float* bias = nullptr;            // optional [Hkv][bias_stride] additive logit bias
  std::int64_t bias_stride = 0;
  bool causal = false;
  // Optional H2O statistics, [Hkv][state_stride]: accumulate[h, j] += acc_scale * sum over the
  // group's query heads and the queries of A[q, i, j]; observed[h, j] += number of queries that
  // saw key j.
  float* accumulate = nullptr;
  float* observed = nullptr;
  std::int64_t state_stride = 0;
  float acc_scale = 1.0f;
};

// keys/values: one layer, tokens = capacity. queries: one layer [Hq][n_q][d].
// out: fp32 [Hq][n_q][d] contiguous.
template <class T, class Q>
void attention(const cpu_backend& be, const KVView<const T>& keys, const KVView<const T>& values,
               const KVView<const Q>& queries, const RaggedAttentionArgs& args, float* out) {
  const std::int64_t Hkv = keys.heads, Hq = queries.heads, nq = queries.tokens, d = keys.dim;
  KVP_REQUIRE(keys.layers == 1 && values.layers == 1 && queries.layers == 1,
              "attention: pass one layer");
  KVP_REQUIRE(Hkv > 0 && Hq % Hkv == 0, "attention: ", Hq, " query heads are not a multiple of ",
              Hkv, " KV heads");
  KVP_REQUIRE(queries.dim == d && values.dim == d, "attention: head_dim mismatch (q ",
              queries.dim, ", k ", d, ", v ", values.dim, ")");
  KVP_REQUIRE(args.lengths != nullptr, "attention: lengths are required");
  for (std::int64_t h = 0; h < Hkv; ++h)
    KVP_REQUIRE(args.lengths[h] >= 0 && args.lengths[h] <= keys.tokens, "attention: length ",
                args.lengths[h], " of KV head ", h, " is outside [0, ", keys.tokens, "]");
  const std::int64_t g = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Keys visible to query i: all len of them, or (causal) len - nq + i + 1.
  auto visible = [&](std::int64_t len, std::int64_t i) {
    return args.causal ? std::clamp<std::int64_t>(len - nq + i + 1, 0, len) : len;
  };
  std::int64_t max_len = 0;
  for (std::int64_t h = 0; h < Hkv; ++h) max_len = std::max(max_len, args.lengths[h]);
  // One item per query head (Hq items keep both cores busy even with 3 KV heads). Each item
  // writes its own output rows and, for H2O, its own column sums of the probabilities; the
  // group's sums are added afterwards in query-head order, so results do not depend on the
  // thread count.
  std::vector<float> col_sums(args.accumulate ? static_cast<std::size_t>(Hq * max_len) : 0);
  parallel_for(be, Hq, [&](std::int64_t qh) {
    const std::int64_t h = qh / g, len = args.lengths[h];
    Eigen::Map<RowMatrix> o(out + qh * nq * d, nq, d);
    if (len == 0) {
      o.setZero();
      return;
    }
    RowMatrix kb, vb, qb, probs;
    RowMap K = rows_f32(keys, 0, h, 0, len, kb);
    RowMap V = rows_f32(values, 0, h, 0, len, vb);
    load_rows(queries, 0, qh, 0, nq, qb);
    probs.noalias() = (qb * scale) * K.transpose();  // n_q x len logits
    for (std::int64_t i = 0; i < nq; ++i) {
      const std::int64_t n = visible(len, i);
      auto row = probs.row(i).array();
      if (n == 0) {
        row.setZero();
        continue;
      }
      auto vis = row.head(n);
      if (args.bias)
        vis += Eigen::Map<const Eigen::ArrayXf>(args.bias + h * args.bias_stride, n).transpose();
      const float mx = vis.maxCoeff();
      vis = (vis - mx).exp();
      vis /= vis.sum();
      row.tail(len - n).setZero();
    }
    o.noalias() = probs * V;  // one GEMM; masked entries are exact zeros
    if (args.accumulate) {
      float* cs = col_sums.data() + qh * max_len;
      Eigen::Map<Eigen::RowVectorXf>(cs, len).noalias() = probs.colwise().sum();
    }
  });
  if (!args.accumulate && !args.observed) return;
  for (std::int64_t h = 0; h < Hkv; ++h) {
    const std::int64_t len = args.lengths[h];
    if (args.accumulate) {
      float* acc = args.accumulate + h * args.state_stride;
      for (std::int64_t j = 0; j < len; ++j) {
        float s = 0.f;
        for (std::int64_t qh = h * g; qh < (h + 1) * g; ++qh)
          s += col_sums[static_cast<std::size_t>(qh * max_len + j)];
        acc[j] += args.acc_scale * s;
      }
    }
    if (args.observed) {
      // Key j is seen by every query i with visible(len, i) > j.
      float* obs = args.observed + h * args.state_stride;
      for (std::int64_t i = 0; i < nq; ++i) {
        const std::int64_t n = visible(len, i);
        for (std::int64_t j = 0; j < n; ++j) obs[j] += 1.0f;
      }
    }
  }
}

}  // namespace kvpolicy::cpu
