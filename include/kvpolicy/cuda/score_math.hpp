// Per-element math of the CUDA scoring kernels (cuda/window_attention.cu), as KVP_HD functions in
// a header free of CUDA and Eigen, so the CPU tests drive exactly this logic in a host emulation
// of the kernels' grids (tests/agreement/test_window_attention.cpp).
//
// Window attention runs in two passes (flash-style, never a T x T or Hq x n_q x T buffer):
//   pass 1: per (layer, query head, query) row, the softmax maximum and sum over the keys the
//           query sees, as an online (max, sum) pair per key split, merged over splits in order;
//   pass 2: per (layer, KV head, key), the column sum over the group's heads and queries of
//           exp(logit - max) / sum, reduced over the group (mean / max / sum).
// Query i of n_q sits at position T - n_q + i and sees keys j <= T - n_q + i (causal).
#pragma once
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/types.hpp"

namespace kvpolicy::cuda::scoring {

// ---- masking --------------------------------------------------------------------------------

// Position of query i of the last n_q queries over T keys.
KVP_HD inline std::int64_t query_pos(std::int64_t i, std::int64_t nq, std::int64_t T) {
  return T - nq + i;
}
// Causal rule: query i sees key j.
KVP_HD inline bool visible(std::int64_t i, std::int64_t j, std::int64_t nq, std::int64_t T) {
  return j <= query_pos(i, nq, T);
}
// First query that sees key j (queries before it are masked for this key).
KVP_HD inline std::int64_t first_query_seeing(std::int64_t j, std::int64_t nq, std::int64_t T) {
  const std::int64_t i = j - (T - nq);
  return i < 0 ? 0 : i;
}

// ---- online softmax statistics --------------------------------------------------------------

struct RowStat {
  float max;  // -inf while no key was seen
  float sum;  // sum of exp(logit - max)
};

KVP_HD inline RowStat empty_stat() { return {-INFINITY, 0.f}; }

// Adds one logit to a row's running (max, sum).
KVP_HD inline void stat_add(RowStat& s, float x) {
  if (x > s.max) {
    s.sum = s.sum * expf(s.max - x) + 1.f;  // exp(-inf) = 0 for the first key
    s.max = x;
  } else {
    s.sum += expf(x - s.max);
  }
}

// Merges two partial statistics (a then b; the order is fixed by the caller, so the result is
// deterministic). Empty partials (no visible key) are neutral.
KVP_HD inline RowStat stat_merge(RowStat a, RowStat b) {
  if (b.sum == 0.f) return a;
  if (a.sum == 0.f) return b;
  const float m = a.max > b.max ? a.max : b.max;
  return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// Softmax probability of one (query, key) pair from the query row's final statistics.
KVP_HD inline float attn_prob(float logit, RowStat s) { return expf(logit - s.max) / s.sum; }

// Dot product of two fp32 rows in the kernels' order: four fused multiply-add chains over the
// indices c % 4 (independent chains hide the FMA latency), summed as (a0 + a1) + (a2 + a3).
KVP_HD inline float dot(const float* a, const float* b, int d) {
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  int c = 0;
  for (; c + 4 <= d; c += 4) {
    a0 = fmaf(a[c], b[c], a0);
    a1 = fmaf(a[c + 1], b[c + 1], a1);
    a2 = fmaf(a[c + 2], b[c + 2], a2);
    a3 = fmaf(a[c + 3], b[c + 3], a3);
  }
  if (c < d) a0 = fmaf(a[c], b[c], a0);
  if (c + 1 < d) a1 = fmaf(a[c + 1], b[c + 1], a1);
  if (c + 2 < d) a2 = fmaf(a[c + 2], b[c + 2], a2);
  return (a0 + a1) + (a2 + a3);
}

// ---- GQA reduction over a group's heads -----------------------------------------------------

// Folds head m's column sum x into the running value (m = 0 starts it).
KVP_HD inline float gqa_fold(float acc, float x, int m, GqaReduce r) {
  if (m == 0) return x;
  return r == GqaReduce::max ? (x > acc ? x : acc) : acc + x;
}
KVP_HD inline float gqa_finish(float acc, int g, GqaReduce r) {
  return r == GqaReduce::mean ? acc / static_cast<float>(g) : acc;
}

// ---- key splits of pass 1 -------------------------------------------------------------------

// Pass 1 splits each row's keys into `splits` contiguous ranges so that short windows still fill
// the device; the count depends on the shapes only (never on the device), so results do too.
inline constexpr int kPass1Rows = 128;       // rows (threads) per pass-1 block
inline constexpr int kTargetBlocks = 512;    // pass-1 blocks wanted
inline constexpr std::int64_t kMinSplitKeys = 256;

KVP_HD inline int pass1_row_blocks_per_item(std::int64_t g, std::int64_t nq) {
  return static_cast<int>((g * nq + kPass1Rows - 1) / kPass1Rows);
}
KVP_HD inline int pass1_splits(std::int64_t items, std::int64_t g, std::int64_t nq,
                               std::int64_t T) {
  const std::int64_t blocks = items * pass1_row_blocks_per_item(g, nq);
  std::int64_t s = (kTargetBlocks + blocks - 1) / blocks;
  const std::int64_t by_keys = (T + kMinSplitKeys - 1) / kMinSplitKeys;
  if (s > by_keys) s = by_keys;
  if (s > 64) s = 64;
  return static_cast<int>(s < 1 ? 1 : s);
}
KVP_HD inline std::int64_t split_len(std::int64_t T, int splits) {
  return (T + splits - 1) / splits;
}

}  // namespace kvpolicy::cuda::scoring
