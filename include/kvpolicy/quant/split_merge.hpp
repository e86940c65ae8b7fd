// Split-KV decode attention, the merge step (KVP_HD, CUDA-free): the cache of one query row is cut
// into splits (packed tiles, residual window), each reduced to a partial online-softmax state
//   m = max_t l_t,  s = sum_t exp(l_t - m),  acc = sum_t exp(l_t - m) v_t
// over its logits l_t (log_count bias included), and the partial states are merged
//   M = max(m1, m2),  s = s1 e^(m1 - M) + s2 e^(m2 - M),  acc = acc1 e^(m1 - M) + acc2 e^(m2 - M)
// before out = acc / s. A split whose logits are all masked (m = -inf, s = 0) is the identity.
// The merge is exact in real arithmetic for any split points and merge order; in fp32 the result
// differs from one pass by rounding only. Used by the split-KV decode kernels (cuda/decode.cu,
// cuda/decode_packed.cu).
#pragma once
#include <math.h>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::quant::dev {

struct SoftmaxPart {
  float max = -INFINITY;
  float sum = 0.0f;
};

// Folds logit l with value row v [d] into (p, acc).
KVP_HD inline void softmax_add(SoftmaxPart& p, float* acc, float l, const float* v, int d) {
  if (l == -INFINITY) return;
  const float m = p.max > l ? p.max : l;
  const float c = expf(p.max - m), e = expf(l - m);  // expf(-inf) = 0 for the first logit
  p.sum = p.sum * c + e;
  for (int i = 0; i < d; ++i) acc[i] = acc[i] * c + e * v[i];
  p.max = m;
}

// (a, acc_a) <- merge of (a, acc_a) and (b, acc_b).
KVP_HD inline void softmax_merge(SoftmaxPart& a, float* acc_a, const SoftmaxPart& b,
                                 const float* acc_b, int d) {
  if (b.max == -INFINITY) return;
  if (a.max == -INFINITY) {
    a = b;
    for (int i = 0; i < d; ++i) acc_a[i] = acc_b[i];
    return;
  }
  const float m = a.max > b.max ? a.max : b.max;
  const float ca = expf(a.max - m), cb = expf(b.max - m);
  a.sum = a.sum * ca + b.sum * cb;
  for (int i = 0; i < d; ++i) acc_a[i] = acc_a[i] * ca + acc_b[i] * cb;
  a.max = m;
}

// out [d] = acc / sum (0 for a row whose logits were all masked).
KVP_HD inline void softmax_finish(const SoftmaxPart& p, const float* acc, float* out, int d) {
  const float inv = p.sum > 0.0f ? 1.0f / p.sum : 0.0f;
  for (int i = 0; i < d; ++i) out[i] = acc[i] * inv;
}

}  // namespace kvpolicy::quant::dev
