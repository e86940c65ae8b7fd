// CPU reference: column sums of causal softmax attention of the last n_q queries over T keys,
// reduced over each GQA group to its KV head:
//   out[l, h, j] = reduce_{q in group(h)} sum_{i < n_q} softmax_j(q_i . k_j / sqrt(d))
// with query i at position T - n_q + i seeing keys j <= T - n_q + i.
// It runs the blockwise kernel of cpu::attention (detail::fused_attention) without values: the
// same code accumulates H2O statistics inside Session::attend, so SnapKV/TOVA windows, H2O
// prefill (n_q = T, kvpolicy::ops::window_attention) and the engine's own prefill share one
// mechanism. No T x T or Hq x n_q x T buffer exists (see kRowBlock, kStripFloats).
#pragma once
#include <algorithm>
#include <vector>

#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/cpu/attention.hpp"
#include "kvpolicy/core/parallel.hpp"

namespace kvpolicy::cpu {

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
  KVP_REQUIRE(queries.layers == L, "window_attention: ", queries.layers,
              " query layers for ", L, " key layers");
  const std::int64_t g = Hq / Hkv;
  out.resize(L, Hkv, Tk);
  const std::vector<std::int64_t> lengths(static_cast<std::size_t>(L * Hkv), Tk);
  detail::Buffer colsum(L * Hkv * g * Tk);  // per query head
  detail::FusedArgs a;
  a.g = g;
  a.lengths = lengths.data();
  a.causal = true;
  a.colsum = colsum.data();
  a.colsum_stride = Tk;
  detail::fused_attention<T, T>(be, keys, nullptr, queries, a);
  parallel_for(be, L * Hkv, [&](std::int64_t lh) {
    auto dst = out.row(lh / Hkv, lh % Hkv);
    const float* src = colsum.data() + lh * g * Tk;
    for (std::int64_t j = 0; j < Tk; ++j) dst[j] = reduce_group(src + j, g, Tk, reduce);
  });
}

}  // namespace kvpolicy::cpu
