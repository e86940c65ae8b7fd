// CPU reference attention over a ragged cache (one layer): every KV head h has its own length
// len[h]; query head q reads KV head q / g. An optional per-token additive logit bias (log of a
// merged token's count: proportional attention) is added before the softmax. With causal=true,
// query i of n_q sees the first len - n_q + i + 1 keys (prefill of an uncompressed tail).
//   out[q, i, :] = sum_j softmax_j(q_i . k_j / sqrt(d) + bias[h, j]) v_j     (fp32)
#pragma once
#include "kvpolicy/core/eigen.hpp"
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
  // GQA-aware: the g query heads of KV head h are stacked into R = g * n_q rows (row
  // r = qi * n_q + i is query i of query head h * g + qi), so each block of rows reads K and V
  // once for the whole group (at decode, n_q = 1, one KV head's K/V are read once instead of g
  // times). Items are (KV head, block of kRowBlock rows); the blocks depend only on the shape,
  // never on the thread count, and each item writes its own output rows and, for H2O, its own
  // column sums of the probabilities, added afterwards in item order: results do not depend on
  // the number of threads.
  constexpr std::int64_t kRowBlock = 128;
  const std::int64_t R = g * nq, blocks = (R + kRowBlock - 1) / kRowBlock;
  std::vector<float> col_sums(args.accumulate ? static_cast<std::size_t>(Hkv * blocks * max_len)
                                              : 0);
  parallel_for(be, Hkv * blocks, [&](std::int64_t item) {
    const std::int64_t h = item / blocks, r0 = (item % blocks) * kRowBlock;
    const std::int64_t rows = std::min(kRowBlock, R - r0), len = args.lengths[h];
    auto out_row = [&](std::int64_t r) {
      const std::int64_t qh = h * g + r / nq, i = r % nq;
      return out + (qh * nq + i) * d;
    };
    if (len == 0) {
      for (std::int64_t r = r0; r < r0 + rows; ++r) std::fill_n(out_row(r), d, 0.0f);
      return;
    }
    RowMatrix kb, vb, qb(rows, d), probs, o;
    RowMap K = rows_f32(keys, 0, h, 0, len, kb);
    RowMap V = rows_f32(values, 0, h, 0, len, vb);
    for (std::int64_t r = r0; r < r0 + rows; ++r) {
      const auto* src = queries.row(0, h * g + r / nq, r % nq);
      for (std::int64_t x = 0; x < d; ++x)
        qb(r - r0, x) = static_cast<float>(src[x * queries.stride_dim]);
    }
    probs.noalias() = (qb * scale) * K.transpose();  // rows x len logits
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t n = visible(len, (r0 + r) % nq);
      auto row = probs.row(r).array();
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
    for (std::int64_t r = 0; r < rows; ++r) std::copy_n(o.row(r).data(), d, out_row(r0 + r));
    if (args.accumulate) {
      // Row after row: every column sums its rows in row order, whatever the SIMD width and the
      // buffer's address. (probs.colwise().sum() sums the columns it vectorizes in another order
      // than those it peels off to align the destination; with 64-byte AVX-512 packets and a
      // malloc-aligned col_sums the peeled columns, and so the accumulators' last bits, followed
      // the heap layout, which changes with the thread count. Measured with -march=native: up to
      // 12 of 1000 column sums of a 128-row block change with the destination's offset.)
      Eigen::Map<Eigen::RowVectorXf> cs(col_sums.data() + item * max_len, len);
      cs = probs.row(0);
      for (std::int64_t r = 1; r < rows; ++r) cs += probs.row(r);
    }
  });
  if (!args.accumulate && !args.observed) return;
  for (std::int64_t h = 0; h < Hkv; ++h) {
    const std::int64_t len = args.lengths[h];
    if (args.accumulate) {
      float* acc = args.accumulate + h * args.state_stride;
      for (std::int64_t j = 0; j < len; ++j) {
        float s = 0.f;
        for (std::int64_t b = 0; b < blocks; ++b)
          s += col_sums[static_cast<std::size_t>((h * blocks + b) * max_len + j)];
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
