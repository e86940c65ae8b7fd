// Expected attention on the GPU: the device twin of scorers/expected.hpp (the same ScoreMap
// content up to fp32 summation order, written into a device score view). The launch part (plain
// structs in, a Status out, nothing thrown) is what cuda/expected.cu implements; the typed,
// throwing wrapper below it makes ExpectedAttention a device scorer of the policy runner
// (cuda/policy.hpp). Per-thread math: scorers/expected_row.hpp.
//
// The kernels, in stream order (no host synchronisation; the host arithmetic of
// ExpectedAttention::setup travels as kernel parameters):
//  1. statistics, one thread block per query head row (layer, query head): the used queries
//     rotated to the next position (double, into the workspace), their mean, the covariance
//     (each entry a sum over the queries in order), then R mu and R Sigma R^T in fp32;
//  2. logits, one warp per (query head row, non-sink key): fp32 lane sums of k.mu and k^T Sigma k,
//     the log-MGF logit in double;
//  3. per query head row, the max and the sum of exp(z - max) over the non-sink keys (one block);
//  4. per (layer, KV head, non-sink key): the softmax weights summed over the query group in
//     order, the group mean, (a + eps) * ||v||;
//  5. per layer, the sinks get the highest score + 1.
// Workspace (expected_workspace_bytes): the rotated queries (8 * n * d bytes per query head row,
// n the queries used), the covariance (8 * d * d), mean and covariance in fp32, the logits
// (8 bytes per key and query head) and two doubles per query head row.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/types.hpp"
#include "kvpolicy/cuda/score_launch.hpp"
#include "kvpolicy/cuda/status.hpp"
#include "kvpolicy/scorers/expected_row.hpp"

namespace kvpolicy::cuda {

// ExpectedAttention::setup's results and the stage's switches, by value.
struct ExpectedArgs {
  std::int64_t nq = 0;     // the newest nq of the queries are read
  std::int64_t skip = 0;   // the first `skip` of those are sinks' queries, left out
  std::int64_t sinks = 0;  // the first min(sinks, tokens) keys are protected
  bool cov = true, vnorm = true;
  double eps = 0;
  float inv_freq[row_math::kExpectedMaxPairs] = {};  // [head_dim / 2]
  double cbar[row_math::kExpectedMaxPairs] = {};     // averaged future rotation, per pair
  double sbar[row_math::kExpectedMaxPairs] = {};
};

// keys [L][H][T][d], queries [L][Hq][n][d] (Hq a multiple of H), values [L][H][T][d] (read when
// vnorm), device memory; d even and at most 2 * kExpectedMaxPairs.
Status expected_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                                const ExpectedArgs& args, std::size_t& bytes);
Status expected_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& values,
                      const TensorRef& queries, const ExpectedArgs& args,
                      const MutableScoreView& out);

}  // namespace kvpolicy::cuda

#if !defined(__CUDACC__)
#include <algorithm>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/cuda/tensor_view.hpp"
#include "kvpolicy/cuda/window_attention.hpp"
#include "kvpolicy/scorers/expected.hpp"

namespace kvpolicy::cuda {

namespace detail {
// The CPU stage's checks and host arithmetic (ExpectedAttention::setup), then the device's own
// limits: non-empty keys, head_dim <= 2 * kExpectedMaxPairs, no tensor parallelism.
template <Element T>
ExpectedArgs expected_args(const ExpectedAttention& s, const Inputs<T>& in, const char* op) {
  validate(in.keys, "keys");
  KVP_REQUIRE(in.keys.data && in.keys.layers > 0 && in.keys.heads > 0 && in.keys.tokens > 0 &&
                  in.keys.dim > 0,
              op, ": empty keys");
  if (in.queries.data) validate(in.queries, "queries");
  if (s.vnorm && in.values.data) validate(in.values, "values");
  const ExpectedAttention::Setup st = s.setup(in);
  KVP_REQUIRE(in.keys.dim <= 2 * row_math::kExpectedMaxPairs, op, ": head_dim ", in.keys.dim,
              " above ", 2 * row_math::kExpectedMaxPairs, " is not supported");
  KVP_REQUIRE(!kvpolicy::detail::sharded(in.shard), op,
              ": tensor parallelism (Inputs::shard) runs on the CPU path only");
  KVP_REQUIRE(!s.vnorm || (in.values.layers == in.keys.layers && in.values.heads == in.keys.heads),
              op, ": values [", in.values.layers, ", ", in.values.heads, ", ...] do not match keys [",
              in.keys.layers, ", ", in.keys.heads, ", ...]");
  ExpectedArgs a;
  a.nq = st.nq;
  a.skip = st.skip;
  a.sinks = s.sinks;
  a.cov = s.cov;
  a.vnorm = s.vnorm;
  a.eps = s.eps;
  std::copy(st.inv_freq.begin(), st.inv_freq.end(), a.inv_freq);
  std::copy(st.cbar.begin(), st.cbar.end(), a.cbar);
  std::copy(st.sbar.begin(), st.sbar.end(), a.sbar);
  return a;
}
}  // namespace detail

template <Element T>
std::size_t score_workspace_bytes(const ExpectedAttention& s, const Inputs<T>& in) {
  const ExpectedArgs a = detail::expected_args(s, in, "cuda::score_workspace_bytes(expected)");
  std::size_t b = 0;
  return detail::bytes_or_throw(expected_workspace_bytes(erase(in.keys), erase(in.queries), a, b),
                                b, "cuda::score_workspace_bytes(expected)");
}

// ExpectedAttention::score on the device: the scores of the CPU stage up to fp32 rounding (the
// GEMMs' summation order), so kept sets agree except at near-ties.
template <Element T>
void score(const cuda_backend& be, const ExpectedAttention& s, const Inputs<T>& in,
           const MutableScoreView& out) {
  const ExpectedArgs a = detail::expected_args(s, in, "cuda::score(expected)");
  detail::require_score_output(be, in.keys, out, "cuda::score(expected)");
  const TensorRef values = s.vnorm ? erase(in.values) : TensorRef{};
  throw_if_error(expected_score(be, erase(in.keys), values, erase(in.queries), a, out),
                 "cuda::score(expected)");
}

}  // namespace kvpolicy::cuda
#endif
