// CPU reference attention over a ragged cache (one layer): every KV head h has its own length
// len[h]; query head q reads KV head q / g. An optional per-token additive logit bias (log of a
// merged token's count: proportional attention) is added before the softmax. With causal=true,
// query i of n_q sees the first len - n_q + i + 1 keys (prefill of an uncompressed tail).
//   out[q, i, :] = sum_j softmax_j(q_i . k_j / sqrt(d) + bias[h, j]) v_j     (fp32)
// The same blockwise kernel (detail::fused_attention) computes the observed-attention column
// sums that H2O accumulates, in the same pass as the output: Session::attend during an engine's
// prefill and decode, and cpu::window_attention (kvpolicy::ops::window_attention, the scorers)
// without values. It also takes, instead of those sums, the column maxima max_i A[q, i, j] that
// the context-reconstruction scorer reads (scorers/kvzip.hpp, Session::reconstruct). No T x T
// buffer exists: a work item holds one strip of at most kRowBlock stacked query rows by the keys
// they see.
#pragma once
#include "kvpolicy/cpu/eigen.hpp"
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
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
  // Optional context-reconstruction scores, [Hkv][state_stride]: max_attention[h, j] becomes the
  // largest of itself and A[q, i, j] over the group's query heads and the queries, for j <
  // lengths[h]. Not together with `accumulate` (one pass keeps one kind of column statistic).
  float* max_attention = nullptr;
};

inline constexpr std::int64_t kStripFloats = std::int64_t{4} << 20;  // 16 MiB of fp32 logits

namespace detail {

// Blocking, fixed by the shapes alone (never by the thread count), so that every sum is taken in
// the same order whatever the number of threads.
// A row block stacks bq consecutive queries of each of the g query heads of one KV head (row
// m * bq + i is query q0 + i of query head h * g + m): one GEMM reads the KV head's keys once for
// its whole group, and all rows of a block share the causal horizon of its last query, so the
// block computes logits for keys [0, klim) only: a causal prefill skips the masked upper triangle
// except for the block's own bq x bq diagonal.
inline constexpr std::int64_t kRowBlock = 128;
// Prefill work items are (layer, KV head, chunk of consecutive row blocks) with about
// kTargetItems items per call, cut at equal causal work (block rows x klim), so two threads get
// even shares without the per-item column sums growing with the number of blocks.
inline constexpr std::int64_t kTargetItems = 48;
inline constexpr std::int64_t kMaxChunks = 16;
// Keys per GEMM call: an fp16/bf16 (or strided) cache is converted to fp32 one tile at a time,
// so the tile is still in L2 when the GEMM reads it (a whole head converted at once, 16 MiB at
// T = 32K and d = 128, went through DRAM: snapkv_score_vs_gemm fp16 fell to 0.52-0.57).
inline constexpr std::int64_t kKeyTile = 512;
// Split-K (flash-decoding): with at most kSplitRows stacked rows per KV head (decode: g * n_q)
// a head's keys are cut into chunks of kKeyChunk, one item each, merged in chunk order. Without
// it a decode step has Hkv items (3 on the bundled model: one of 2 threads idles a third).
inline constexpr std::int64_t kSplitRows = 16;
inline constexpr std::int64_t kKeyChunk = 1024;
// Below this many multiply-adds the split-K merge runs on the calling thread (see fused_split).
inline constexpr double kSerialMergeWork = 1 << 18;

struct FusedArgs {
  std::int64_t g = 1;
  const std::int64_t* lengths = nullptr;  // [L * Hkv]
  const float* bias = nullptr;            // optional [L * Hkv][bias_stride]
  std::int64_t bias_stride = 0;
  bool causal = false;
  float* out = nullptr;  // optional [L][Hq][n_q][d]; needs values
  // Optional [L * Hkv][g][colsum_stride]: colsum[lh, m, j] = sum_i A[h * g + m, i, j], for
  // j < len (the rest is left alone); written, not added to. With colmax, the column maxima
  // max_i A[h * g + m, i, j] instead.
  float* colsum = nullptr;
  std::int64_t colsum_stride = 0;
  bool colmax = false;
};

// Work buffers are Eigen vectors, aligned to EIGEN_MAX_ALIGN_BYTES: Eigen peels the elements
// before the first aligned packet off its vectorized loops and computes them with scalar code
// (a scalar exp, another summation order), so a row's results follow its address; with aligned
// bases every row's alignment is fixed by the shapes, not by where malloc put a thread's buffer.
using Buffer = Eigen::VectorXf;

inline float* reserve(Buffer& b, std::int64_t n) {
  if (b.size() < n) b.resize(n);
  return b.data();
}

// Rows [t0, t0 + n) of head (l, h) as an fp32 row-major map: the cache itself for float rows
// with unit head_dim stride, else converted into buf.
template <class T>
RowMap rows_into(const KVView<const T>& v, std::int64_t l, std::int64_t h, std::int64_t t0,
                 std::int64_t n, Buffer& buf) {
  if constexpr (std::is_same_v<T, float>) {
    if (v.stride_dim == 1 && (n <= 1 || v.stride_token >= v.dim))
      return RowMap(v.row(l, h, t0), n, v.dim,
                    Eigen::OuterStride<>(n <= 1 ? v.dim : v.stride_token));
  }
  float* base = reserve(buf, n * v.dim);
  for (std::int64_t r = 0; r < n; ++r) {
    const auto* src = v.row(l, h, t0 + r);
    float* dst = base + r * v.dim;
    if (v.stride_dim == 1) {  // the common case, vectorized (F16C for half)
      for (std::int64_t x = 0; x < v.dim; ++x) dst[x] = static_cast<float>(src[x]);
    } else {
      for (std::int64_t x = 0; x < v.dim; ++x) dst[x] = static_cast<float>(src[x * v.stride_dim]);
    }
  }
  return RowMap(buf.data(), n, v.dim, Eigen::OuterStride<>(v.dim));
}

template <class Q>
void load_queries(const KVView<const Q>& q, std::int64_t l, std::int64_t qh, std::int64_t i0,
                  std::int64_t n, float scale, float* dst) {
  for (std::int64_t i = 0; i < n; ++i, dst += q.dim) {
    const auto* src = q.row(l, qh, i0 + i);
    for (std::int64_t x = 0; x < q.dim; ++x)
      dst[x] = static_cast<float>(src[x * q.stride_dim]) * scale;
  }
}

// exp(x - max) of one row's visible logits in place (+ bias), the rest zeroed; returns their sum
// (n > 0). The caller divides by it where it uses the row (column sums, the output row), which
// saves a pass over the strip.
inline float exp_row(float* row, std::int64_t n, std::int64_t width, const float* bias) {
  Eigen::Map<Eigen::ArrayXf> vis(row, n);
  if (bias) vis += Eigen::Map<const Eigen::ArrayXf>(bias, n);
  const float mx = vis.maxCoeff();
  vis = (vis - mx).exp();
  std::fill(row + n, row + width, 0.0f);
  return vis.sum();
}

// The prefill path: see kRowBlock and kTargetItems.
template <class T, class Q>
void fused_blocks(const cpu_backend& be, const KVView<const T>& keys,
                  const KVView<const T>* values, const KVView<const Q>& queries,
                  const FusedArgs& a) {
  const std::int64_t L = keys.layers, Hkv = keys.heads, nq = queries.tokens, d = keys.dim;
  const std::int64_t g = a.g, Hq = queries.heads, LH = L * Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  std::int64_t max_len = 0;
  for (std::int64_t r = 0; r < LH; ++r) max_len = std::max(max_len, a.lengths[r]);
  auto visible = [&](std::int64_t len, std::int64_t i) {
    return a.causal ? std::clamp<std::int64_t>(len - nq + i + 1, 0, len) : len;
  };
  const std::int64_t bq = std::clamp<std::int64_t>(
      std::min(kRowBlock / g, kStripFloats / (g * std::max<std::int64_t>(max_len, 1))), 1, nq);
  const std::int64_t blocks = (nq + bq - 1) / bq;
  const std::int64_t chunks =
      std::clamp<std::int64_t>((kTargetItems + LH - 1) / LH, 1, std::min(kMaxChunks, blocks));
  // Chunk c of head lh covers blocks [first[lh][c], first[lh][c + 1]): cut where the running
  // work (rows x klim) passes c / chunks of the head's total.
  std::vector<std::int64_t> first(static_cast<std::size_t>(LH * (chunks + 1)));
  for (std::int64_t lh = 0; lh < LH; ++lh) {
    const std::int64_t len = a.lengths[lh];
    std::vector<double> cum(static_cast<std::size_t>(blocks + 1), 0.0);
    for (std::int64_t b = 0; b < blocks; ++b) {
      const std::int64_t last = std::min(nq, (b + 1) * bq) - 1;
      cum[static_cast<std::size_t>(b + 1)] =
          cum[static_cast<std::size_t>(b)] + static_cast<double>(visible(len, last) + 1);
    }
    std::int64_t* f = first.data() + lh * (chunks + 1);
    std::int64_t b = 0;
    for (std::int64_t c = 0; c < chunks; ++c) {
      const double goal = cum.back() * static_cast<double>(c) / static_cast<double>(chunks);
      while (b < blocks && cum[static_cast<std::size_t>(b)] < goal) ++b;
      f[c] = b;
    }
    f[chunks] = blocks;
  }
  // Column sums per item, [item][g][max_len], reduced below in chunk order.
  Buffer parts(a.colsum ? LH * chunks * g * max_len : 0);

  parallel_for(be, LH * chunks, [&](std::int64_t item) {
    const std::int64_t lh = item / chunks, c = item % chunks;
    const std::int64_t l = lh / Hkv, h = lh % Hkv, len = a.lengths[lh];
    const std::int64_t* f = first.data() + lh * (chunks + 1);
    const std::int64_t b0 = f[c], b1 = f[c + 1];
    float* cs = a.colsum ? parts.data() + item * g * max_len : nullptr;
    if (cs) std::fill_n(cs, g * max_len, 0.0f);
    if (b0 == b1) return;
    auto out_row = [&](std::int64_t m, std::int64_t i) {
      return a.out + ((l * Hq + h * g + m) * nq + i) * d;
    };
    const std::int64_t kmax = visible(len, std::min(nq, b1 * bq) - 1);  // the chunk's horizon
    if (kmax == 0) {  // no query of the chunk sees a key (causal, len < n_q)
      if (a.out)
        for (std::int64_t m = 0; m < g; ++m)
          std::fill_n(out_row(m, b0 * bq), (std::min(nq, b1 * bq) - b0 * bq) * d, 0.0f);
      return;
    }
    Buffer kbuf, vbuf, qbuf(g * bq * d), strip(g * bq * kmax), inv_sum(g * bq);
    const float* bias = a.bias ? a.bias + lh * a.bias_stride : nullptr;
    RowMatrix o;
    for (std::int64_t b = b0; b < b1; ++b) {
      const std::int64_t q0 = b * bq, n = std::min(bq, nq - q0), rows = g * n;
      const std::int64_t klim = visible(len, q0 + n - 1);
      if (klim == 0) {
        if (a.out)
          for (std::int64_t m = 0; m < g; ++m) std::fill_n(out_row(m, q0), n * d, 0.0f);
        continue;
      }
      for (std::int64_t m = 0; m < g; ++m)
        load_queries(queries, l, h * g + m, q0, n, scale, qbuf.data() + m * n * d);
      Eigen::Map<const RowMatrix> qs(qbuf.data(), rows, d);
      Eigen::Map<RowMatrix> s(strip.data(), rows, klim);
      for (std::int64_t j0 = 0; j0 < klim; j0 += kKeyTile) {
        const std::int64_t nb = std::min(kKeyTile, klim - j0);
        s.middleCols(j0, nb).noalias() = qs * rows_into(keys, l, h, j0, nb, kbuf).transpose();
      }
      // Row after row, each row's exps taken and (H2O) added, normalised, to its head's column
      // sums while in L1: the sums take rows in a fixed order, whatever the SIMD width. The
      // output rows are divided by their sums after the P V product.
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t vis = visible(len, q0 + r % n);
        float* row = strip.data() + r * klim;
        if (vis == 0) {
          std::fill_n(row, klim, 0.0f);
          inv_sum[r] = 0.0f;
          continue;
        }
        const float inv = 1.0f / exp_row(row, vis, klim, bias);
        inv_sum[r] = inv;
        if (cs) {
          Eigen::Map<Eigen::ArrayXf> col(cs + (r / n) * max_len, vis);
          const Eigen::Map<const Eigen::ArrayXf> p(row, vis);
          if (a.colmax)
            col = col.max(inv * p);
          else
            col += inv * p;
        }
      }
      if (!a.out) continue;
      // P V tile by tile, tiles in order; masked entries are exact zeros.
      for (std::int64_t j0 = 0; j0 < klim; j0 += kKeyTile) {
        const std::int64_t nb = std::min(kKeyTile, klim - j0);
        const RowMap vt = rows_into(*values, l, h, j0, nb, vbuf);
        if (j0 == 0)
          o.noalias() = s.middleCols(0, nb) * vt;
        else
          o.noalias() += s.middleCols(j0, nb) * vt;
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        float* dst = out_row(r / n, q0 + r % n);
        for (std::int64_t x = 0; x < d; ++x) dst[x] = o(r, x) * inv_sum[r];
      }
    }
  });
  if (!a.colsum) return;
  parallel_for(be, LH, [&](std::int64_t lh) {
    const std::int64_t len = a.lengths[lh];
    for (std::int64_t m = 0; m < g; ++m) {
      float* dst = a.colsum + (lh * g + m) * a.colsum_stride;
      const float* src = parts.data() + (lh * chunks * g + m) * max_len;
      std::copy_n(src, len, dst);
      for (std::int64_t c = 1; c < chunks; ++c)
        for (std::int64_t j = 0; j < len; ++j)
          dst[j] = a.colmax ? std::max(dst[j], src[c * g * max_len + j])
                            : dst[j] + src[c * g * max_len + j];
    }
  });
}

// The split-K path: see kSplitRows. Item (head lh, key chunk c) keeps its rows' maxima m_c, sums
// of exp s_c and unnormalised partial outputs; the merge rescales chunk c by exp(m_c - m) and
// divides by the merged sum, chunk after chunk, and (H2O) weighs the chunk's stored exps by the
// same factor over the merged sum before adding them to the column sums.
template <class T, class Q>
void fused_split(const cpu_backend& be, const KVView<const T>& keys,
                 const KVView<const T>* values, const KVView<const Q>& queries,
                 const FusedArgs& a) {
  const std::int64_t L = keys.layers, Hkv = keys.heads, nq = queries.tokens, d = keys.dim;
  const std::int64_t g = a.g, Hq = queries.heads, LH = L * Hkv, R = g * nq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  auto visible = [&](std::int64_t len, std::int64_t i) {
    return a.causal ? std::clamp<std::int64_t>(len - nq + i + 1, 0, len) : len;
  };
  // Items and per-head offsets: head lh has max(1, ceil(len / kKeyChunk)) chunks; the stored
  // exps (H2O only) of head lh start at strip_at[lh] (R x len).
  std::vector<std::int64_t> item_at(static_cast<std::size_t>(LH + 1), 0), strip_at(item_at);
  for (std::int64_t lh = 0; lh < LH; ++lh) {
    const std::int64_t len = a.lengths[lh];
    item_at[static_cast<std::size_t>(lh + 1)] =
        item_at[static_cast<std::size_t>(lh)] + std::max<std::int64_t>(1, (len + kKeyChunk - 1) / kKeyChunk);
    strip_at[static_cast<std::size_t>(lh + 1)] = strip_at[static_cast<std::size_t>(lh)] + R * len;
  }
  const std::int64_t items = item_at.back();
  Buffer part_out(items * R * d), part_max(items * R), part_sum(items * R);
  Buffer exps(a.colsum ? strip_at.back() : 0);

  parallel_for(be, items, [&](std::int64_t item) {
    const auto lh = static_cast<std::int64_t>(
        std::upper_bound(item_at.begin(), item_at.end(), item) - item_at.begin() - 1);
    const std::int64_t l = lh / Hkv, h = lh % Hkv, len = a.lengths[lh];
    const std::int64_t j0 = (item - item_at[static_cast<std::size_t>(lh)]) * kKeyChunk;
    const std::int64_t nb = std::min(kKeyChunk, len - j0);  // 0 only when len == 0
    float* mx = part_max.data() + item * R;
    float* sm = part_sum.data() + item * R;
    Eigen::Map<RowMatrix> o(part_out.data() + item * R * d, R, d);
    if (nb <= 0) {
      std::fill_n(mx, R, -std::numeric_limits<float>::infinity());
      std::fill_n(sm, R, 0.0f);
      o.setZero();
      return;
    }
    Buffer kbuf, vbuf, qbuf(R * d), local;
    for (std::int64_t m = 0; m < g; ++m)
      load_queries(queries, l, h * g + m, 0, nq, scale, qbuf.data() + m * nq * d);
    // Exps of row r at [r * stride + j0, + nb): the head's stored strip (H2O) or a local one.
    float* e = nullptr;
    std::int64_t stride = nb;
    if (a.colsum) {
      e = exps.data() + strip_at[static_cast<std::size_t>(lh)] + j0;
      stride = len;
    } else {
      e = reserve(local, R * nb);
    }
    Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>> s(e, R, nb, Eigen::OuterStride<>(stride));
    // Coefficient-based products: with at most kSplitRows rows a GEMM's packing of the chunk's
    // keys and values (a copy of every byte) costs more than the products themselves.
    s.noalias() = Eigen::Map<const RowMatrix>(qbuf.data(), R, d)
                      .lazyProduct(rows_into(keys, l, h, j0, nb, kbuf).transpose());
    const float* bias = a.bias ? a.bias + lh * a.bias_stride + j0 : nullptr;
    for (std::int64_t r = 0; r < R; ++r) {
      const std::int64_t n = std::clamp<std::int64_t>(visible(len, r % nq) - j0, 0, nb);
      float* row = e + r * stride;
      mx[r] = -std::numeric_limits<float>::infinity();
      sm[r] = 0.0f;
      if (n > 0) {
        Eigen::Map<Eigen::ArrayXf> vis(row, n);
        if (bias) vis += Eigen::Map<const Eigen::ArrayXf>(bias, n);
        mx[r] = vis.maxCoeff();
        vis = (vis - mx[r]).exp();
        sm[r] = vis.sum();
      }
      std::fill(row + n, row + nb, 0.0f);
    }
    o.noalias() = s.lazyProduct(rows_into(*values, l, h, j0, nb, vbuf));
  });

  // The merge, per head (rows and chunks in a fixed order); plain loops, so that every element
  // takes the same instructions wherever the buffers are.
  auto merge = [&](std::int64_t lh) {
    const std::int64_t l = lh / Hkv, h = lh % Hkv, len = a.lengths[lh];
    const std::int64_t i0 = item_at[static_cast<std::size_t>(lh)];
    const std::int64_t nc = item_at[static_cast<std::size_t>(lh + 1)] - i0;
    const float* pm = part_max.data() + i0 * R;
    const float* ps = part_sum.data() + i0 * R;
    const float* po = part_out.data() + i0 * R * d;
    std::vector<float> w(static_cast<std::size_t>(nc)), acc(static_cast<std::size_t>(d));
    if (a.colsum)
      for (std::int64_t m = 0; m < g; ++m)
        std::fill_n(a.colsum + (lh * g + m) * a.colsum_stride, len, 0.0f);
    for (std::int64_t r = 0; r < R; ++r) {
      float m_all = -std::numeric_limits<float>::infinity(), total = 0.0f;
      for (std::int64_t c = 0; c < nc; ++c) m_all = std::max(m_all, pm[c * R + r]);
      float* dst = a.out ? a.out + ((l * Hq + h * g + r / nq) * nq + r % nq) * d : nullptr;
      if (m_all == -std::numeric_limits<float>::infinity()) {  // the row sees no key
        if (dst) std::fill_n(dst, d, 0.0f);
        continue;
      }
      for (std::int64_t c = 0; c < nc; ++c) {
        float& wc = w[static_cast<std::size_t>(c)];
        wc = ps[c * R + r] > 0.0f ? std::exp(pm[c * R + r] - m_all) : 0.0f;
        total += ps[c * R + r] * wc;
      }
      if (dst) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::int64_t c = 0; c < nc; ++c) {
          const float wc = w[static_cast<std::size_t>(c)];
          const float* oc = po + (c * R + r) * d;
          for (std::int64_t x = 0; x < d; ++x) acc[static_cast<std::size_t>(x)] += wc * oc[x];
        }
        for (std::int64_t x = 0; x < d; ++x) dst[x] = acc[static_cast<std::size_t>(x)] / total;
      }
      if (a.colsum) {  // softmax = exp(x - m_c) * exp(m_c - m) / total
        float* cs = a.colsum + (lh * g + r / nq) * a.colsum_stride;
        const float* row = exps.data() + strip_at[static_cast<std::size_t>(lh)] + r * len;
        for (std::int64_t c = 0; c < nc; ++c) {
          const float f = w[static_cast<std::size_t>(c)] / total;
          if (f == 0.0f) continue;
          for (std::int64_t j = c * kKeyChunk; j < std::min(len, (c + 1) * kKeyChunk); ++j)
            cs[j] = a.colmax ? std::max(cs[j], f * row[j]) : cs[j] + f * row[j];
        }
      }
    }
  };
  // A decode step's merge is a few thousand operations, less than waking the other threads for a
  // second parallel region costs (a decode step runs this once per layer); large merges (window
  // attention over many layers with column sums) stay parallel. Each head is merged the same way
  // on either path.
  double merge_work = 0;
  for (std::int64_t lh = 0; lh < LH; ++lh)
    merge_work += static_cast<double>(R) *
                  static_cast<double>((item_at[static_cast<std::size_t>(lh + 1)] -
                                       item_at[static_cast<std::size_t>(lh)]) * d +
                                      (a.colsum ? a.lengths[lh] : 0));
  if (merge_work < kSerialMergeWork)
    for (std::int64_t lh = 0; lh < LH; ++lh) merge(lh);
  else
    parallel_for(be, LH, merge);
}

// keys/values: L layers; queries [L][g * Hkv][n_q][d]; lengths [L * Hkv] (each <= keys.tokens).
// Values may be null only when out is null (column sums alone: window attention).
template <class T, class Q>
void fused_attention(const cpu_backend& be, const KVView<const T>& keys,
                     const KVView<const T>* values, const KVView<const Q>& queries,
                     const FusedArgs& a) {
  if (queries.tokens == 0) return;
  KVP_REQUIRE(values || !a.out, "attention: values are needed for the output");
  if (a.g * queries.tokens <= kSplitRows && values)
    fused_split(be, keys, values, queries, a);
  else
    fused_blocks(be, keys, values, queries, a);
}

}  // namespace detail

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
  if (nq == 0) return;  // no query: no output, and nothing to add to the H2O statistics
  const std::int64_t g = Hq / Hkv;
  std::int64_t max_len = 0;
  for (std::int64_t h = 0; h < Hkv; ++h) max_len = std::max(max_len, args.lengths[h]);
  KVP_REQUIRE(!(args.accumulate && args.max_attention),
              "attention: accumulate and max_attention cannot be taken in one call");
  // Per query head column sums (or maxima) [Hkv][g][max_len], reduced over the group below.
  const bool columns = args.accumulate || args.max_attention;
  detail::Buffer colsum(columns ? Hkv * g * max_len : 0);
  detail::FusedArgs a;
  a.g = g;
  a.lengths = args.lengths;
  a.bias = args.bias;
  a.bias_stride = args.bias_stride;
  a.causal = args.causal;
  a.out = out;
  a.colsum = columns ? colsum.data() : nullptr;
  a.colsum_stride = max_len;
  a.colmax = args.max_attention != nullptr;
  detail::fused_attention(be, keys, &values, queries, a);
  if (args.max_attention)
    for (std::int64_t h = 0; h < Hkv; ++h) {
      float* mx = args.max_attention + h * args.state_stride;
      const float* cs = colsum.data() + h * g * max_len;
      for (std::int64_t j = 0; j < args.lengths[h]; ++j)
        for (std::int64_t m = 0; m < g; ++m) mx[j] = std::max(mx[j], cs[m * max_len + j]);
    }
  if (!args.accumulate && !args.observed) return;
  auto visible = [&](std::int64_t len, std::int64_t i) {
    return args.causal ? std::clamp<std::int64_t>(len - nq + i + 1, 0, len) : len;
  };
  for (std::int64_t h = 0; h < Hkv; ++h) {
    const std::int64_t len = args.lengths[h];
    if (args.accumulate) {
      float* acc = args.accumulate + h * args.state_stride;
      const float* cs = colsum.data() + h * g * max_len;
      for (std::int64_t j = 0; j < len; ++j) {
        float s = cs[j];
        for (std::int64_t m = 1; m < g; ++m) s += cs[m * max_len + j];
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
