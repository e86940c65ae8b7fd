// Type-erased entry points of the CUDA scoring kernels (cuda/window_attention.cu): window
// attention column sums, SnapKV and H2O scores from queries. Plain structs in, a Status out,
// nothing thrown; free of Eigen and CUDA headers. Typed, throwing wrappers:
// cuda/window_attention.hpp. All work is enqueued on cuda_backend::stream.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/types.hpp"
#include "kvpolicy/cuda/score_math.hpp"
#include "kvpolicy/cuda/status.hpp"
#include "kvpolicy/scorers/h2o.hpp"  // H2O and SnapKV are the kernels' parameter structs
#include "kvpolicy/scorers/h2o_row.hpp"
#include "kvpolicy/scorers/snapkv.hpp"
#include "kvpolicy/scorers/snapkv_row.hpp"

namespace kvpolicy::cuda {

// Tensors arrive as kvpolicy::TensorRef (core/types.hpp) over device memory.

// fp32 scores [layers][heads][tokens] written by an op; row r = l * heads + h starts at
// data + r * row_stride (row_stride >= tokens).
struct MutableScoreView {
  float* data = nullptr;
  std::int64_t layers = 0, heads = 0, tokens = 0, row_stride = 0;
};

// Workspace (bytes, 256-byte aligned parts) for window attention of the last `nq` of the
// queries over `keys`: the per-row (max, sum) statistics, per key split and merged.
Status window_attention_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                                        std::int64_t nq, std::size_t& bytes);

// out[l][h][j] = reduce over the group of h of sum_{i < nq} softmax_j(q_i . k_j / sqrt(d)), the
// queries being the last nq of `queries` (query i at position T - nq + i, causal). Same values
// as cpu::window_attention; deterministic (no atomics, fixed reduction orders).
Status window_attention(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                        GqaReduce reduce, std::int64_t nq, const MutableScoreView& out);

// SnapKV::score from queries: window attention of the last w = min(window, T) queries, pooled
// over the T - w tokens before the window; window tokens score FLT_MAX.
Status snapkv_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                              const SnapKV& p, std::size_t& bytes);
Status snapkv_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                    const SnapKV& p, const MutableScoreView& out);

// H2O::score from queries (no given accumulators): column sums of all given queries' attention
// (reduced over the group by p.reduce), divided by the number of queries that saw each key when
// p.normalize.
Status h2o_workspace_bytes(const TensorRef& keys, const TensorRef& queries, std::size_t& bytes);
Status h2o_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                 const H2O& p, const MutableScoreView& out);

// H2O::score from given state (a Session's accumulators, device memory, rows of `state_stride`
// floats): the accumulators, or divided by the observed-query counts when p.normalize (then
// `observed` must be given). No workspace.
Status h2o_score_from_state(const cuda_backend& be, const float* accumulated,
                            const float* observed, std::int64_t state_stride, const H2O& p,
                            const MutableScoreView& out);

}  // namespace kvpolicy::cuda
