// Per-thread math of the split-KV decode attention kernels (cuda/decode.cu), as KVP_HD functions
// in a header free of CUDA and Eigen, so the CPU tests drive exactly this logic in a host
// emulation of the grids (tests/agreement/test_decode_cuda.cpp).
//
// Three passes (FlashDecoding style) over one layer of a ragged cache (len[h] keys per KV head):
//   1. partial: one block per (KV head h, split s of `split` keys). Its R = g * n_q rows are the
//      group's query heads times the queries (row r = (qh - h g) n_q + i). Keys are staged in
//      tiles of TK = key_tile(D) rows; per tile: logits (scaled query . key + bias, -inf where
//      masked), the tile's softmax part (max, sum of e_j = exp(l_j - max)), folded into the
//      block's running state with quant/split_merge.hpp's softmax_merge (one thread per channel
//      folds sum_j e_j v_j[c]; the row state is then merged once more with d = 0). The split's
//      (max, sum, acc[D]) goes to the workspace; with H2O statistics the raw logits too.
//   2. merge: one block per row, one thread per channel merges the splits in order
//      (softmax_merge, d = 1) and finishes (softmax_finish); thread 0 keeps the row's final
//      (max, sum) for pass 3.
//   3. statistics (H2O only): one thread per (KV head, key) sums the probabilities
//      exp(l - max) / sum (score_math.hpp's attn_prob) over the group's query heads (outer) and
//      queries (inner) as cpu::attention does, then accumulate[h, j] += acc_scale * s and
//      observed[h, j] += the number of queries that see j. One thread owns a key: no atomics.
#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/cuda/score_math.hpp"
#include "kvpolicy/quant/hadamard.hpp"
#include "kvpolicy/quant/split_merge.hpp"

namespace kvpolicy::cuda::decode_math {

using quant::dev::SoftmaxPart;

// Row stride of the staged key tile: one pad float, so the logit threads (consecutive keys,
// reading down their rows) hit 32 different banks.
KVP_HD constexpr int kt_stride(int D) { return D + 1; }

// Keys of one shared-memory tile: K and V tiles take 2 * 4096 floats (32 KiB) for any head_dim.
KVP_HD constexpr int key_tile(int D) { return 4096 / D; }

// Keys query i of n_q sees among len (causal: the last n_q keys are the queries' own positions).
KVP_HD inline std::int64_t visible_keys(std::int64_t len, std::int64_t nq, std::int64_t i,
                                        bool causal) {
  if (!causal) return len;
  const std::int64_t n = len - nq + i + 1;
  return n < 0 ? 0 : (n > len ? len : n);
}

// Number of splits of `split` keys over a capacity of `tokens` keys (at least one).
KVP_HD inline std::int64_t split_count(std::int64_t tokens, std::int64_t split) {
  const std::int64_t s = (tokens + split - 1) / split;
  return s < 1 ? 1 : s;
}

// ---- pass 1: shared memory of a (KV head, split) block ----------------------------------------

struct BlockSmem {
  float* qs;           // [R][D] scaled queries
  float* kt;           // [TK][kt_stride(D)] key tile (fp32)
  float* vt;           // [TK][D] value tile (fp32)
  float* lg;           // [R][TK] logits, then e_j of the tile
  float* acc;          // [R][D] running accumulators
  SoftmaxPart* state;  // [R] running (max, sum)
  SoftmaxPart* tp;     // [R] the current tile's part
  float* norms;        // [TK] key norms of the tile (packed caches only)
};

// TK: keys per tile (key_tile(D) for dense caches, the quant group for packed ones).
KVP_HD inline std::int64_t smem_floats(int R, int D, int TK) {
  return 2LL * R * D + 2LL * TK * D + TK + static_cast<std::int64_t>(R) * TK + 4LL * R + TK;
}

KVP_HD inline BlockSmem carve(float* base, int R, int D, int TK) {
  BlockSmem s;
  s.qs = base;
  s.kt = s.qs + R * D;
  s.vt = s.kt + TK * kt_stride(D);
  s.lg = s.vt + TK * D;
  s.acc = s.lg + R * TK;
  s.state = reinterpret_cast<SoftmaxPart*>(s.acc + R * D);
  s.tp = s.state + R;
  s.norms = reinterpret_cast<float*>(s.tp + R);
  return s;
}

// Before the first tile: zero accumulators, empty states (queries are loaded by the caller:
// qs[r * D + c] = float(q[qh, i, c]) * scale).
KVP_HD inline void phase_init(const BlockSmem& s, int R, int D, int tid, int nt) {
  for (int x = tid; x < R * D; x += nt) s.acc[x] = 0.0f;
  for (int r = tid; r < R; r += nt) s.state[r] = SoftmaxPart{};
}

// Logit of row r (query i = r % nq) and tile key j (absolute key t0 + j); -inf when masked (past
// the tile's n keys or not visible to the query). norms: the tile's key norms (packed caches:
// logit = (q . k~) n), nullptr for dense caches.
KVP_HD inline float tile_logit(const BlockSmem& s, int D, int r, int j, int n, std::int64_t t0,
                               std::int64_t visible, const float* bias,
                               const float* norms = nullptr) {
  const std::int64_t key = t0 + j;
  if (j >= n || key >= visible) return -INFINITY;
  float l = scoring::dot(s.qs + r * D, s.kt + j * kt_stride(D), D);
  if (norms) l *= norms[j];
  if (bias) l += bias[key];
  return l;
}

// The tile's softmax part of one row: max over the TK logits, e_j = exp(l_j - max) in place
// (0 for masked keys), sum in key order. All masked: (-inf, 0), every e_j = 0.
KVP_HD inline SoftmaxPart tile_part(float* l, int TK) {
  SoftmaxPart p;
  for (int j = 0; j < TK; ++j) p.max = l[j] > p.max ? l[j] : p.max;
  if (p.max == -INFINITY) {
    for (int j = 0; j < TK; ++j) l[j] = 0.0f;
    return p;
  }
  for (int j = 0; j < TK; ++j) {
    l[j] = l[j] == -INFINITY ? 0.0f : expf(l[j] - p.max);
    p.sum += l[j];
  }
  return p;
}

// Thread of channel c folds the tile into acc[r, c] for every row (state[r] is still the state
// before this tile).
KVP_HD inline void fold_channel(const BlockSmem& s, int R, int D, int TK, int n, int c) {
  for (int r = 0; r < R; ++r) {
    const float* e = s.lg + r * TK;
    float t = 0.0f;
    for (int j = 0; j < n; ++j) t = fmaf(e[j], s.vt[j * D + c], t);
    SoftmaxPart a = s.state[r];
    quant::dev::softmax_merge(a, s.acc + r * D + c, s.tp[r], &t, 1);
  }
}

// After every channel folded: the row states take the tile too.
KVP_HD inline void fold_state(const BlockSmem& s, int r) {
  quant::dev::softmax_merge(s.state[r], nullptr, s.tp[r], nullptr, 0);
}

// Pair i < D / 2 of one stage (half) of the in-place FWHT of a row in shared memory, and the
// orthonormal scale applied after the last stage: hadamard_unchecked's arithmetic, one thread per
// butterfly and one barrier per stage (the result does not depend on the stage order).
KVP_HD inline void fwht_pair(float* row, int half, int i) {
  quant::hadamard_stage_butterfly(row, half, i);
}
KVP_HD inline float fwht_norm(int D) { return 1.0f / sqrtf(static_cast<float>(D)); }

// ---- workspace --------------------------------------------------------------------------------

// rows = Hq * n_q query rows (row = qh * n_q + i), S splits, head_dim D, tokens = capacity.
struct Workspace {
  SoftmaxPart* part_stat;  // [rows][S]
  float* part_acc;         // [rows][S][D]
  SoftmaxPart* final_stat; // [rows]
  float* logits;           // [rows][tokens] (H2O statistics only, else nullptr)
};

KVP_HD inline std::int64_t align_floats(std::int64_t n) { return (n + 63) / 64 * 64; }

KVP_HD inline std::int64_t workspace_floats(std::int64_t rows, std::int64_t S, std::int64_t D,
                                            std::int64_t tokens, bool stats) {
  return align_floats(2 * rows * S) + align_floats(rows * S * D) + align_floats(2 * rows) +
         (stats ? align_floats(rows * tokens) : 0);
}

KVP_HD inline Workspace carve_workspace(float* base, std::int64_t rows, std::int64_t S,
                                        std::int64_t D, bool stats) {
  Workspace w;
  w.part_stat = reinterpret_cast<SoftmaxPart*>(base);
  w.part_acc = base + align_floats(2 * rows * S);
  w.final_stat = reinterpret_cast<SoftmaxPart*>(w.part_acc + align_floats(rows * S * D));
  w.logits = stats ? reinterpret_cast<float*>(w.final_stat) + align_floats(2 * rows) : nullptr;
  return w;
}

// ---- pass 2: merge of one row's splits, thread of channel c -----------------------------------

KVP_HD inline SoftmaxPart merge_channel(const Workspace& w, std::int64_t row, std::int64_t S,
                                        int D, int c, float* out_row) {
  SoftmaxPart a;
  float acc = 0.0f;
  for (std::int64_t s = 0; s < S; ++s)
    quant::dev::softmax_merge(a, &acc, w.part_stat[row * S + s],
                              w.part_acc + (row * S + s) * D + c, 1);
  quant::dev::softmax_finish(a, &acc, out_row + c, 1);
  return a;
}

// ---- pass 3: H2O statistics of key j of KV head h ---------------------------------------------

KVP_HD inline void key_stats(const Workspace& w, std::int64_t h, std::int64_t j, std::int64_t len,
                             std::int64_t g, std::int64_t nq, std::int64_t tokens, bool causal,
                             float acc_scale, float* accumulate, float* observed) {
  if (j >= len) return;
  if (accumulate) {
    float s = 0.0f;
    for (std::int64_t qh = h * g; qh < (h + 1) * g; ++qh) {
      float cs = 0.0f;
      for (std::int64_t i = 0; i < nq; ++i) {
        const std::int64_t row = qh * nq + i;
        if (j < visible_keys(len, nq, i, causal)) {
          const SoftmaxPart f = w.final_stat[row];
          cs += scoring::attn_prob(w.logits[row * tokens + j], scoring::RowStat{f.max, f.sum});
        }
      }
      s += cs;
    }
    accumulate[j] += acc_scale * s;
  }
  if (observed)
    for (std::int64_t i = 0; i < nq; ++i)
      if (j < visible_keys(len, nq, i, causal)) observed[j] += 1.0f;
}

}  // namespace kvpolicy::cuda::decode_math
