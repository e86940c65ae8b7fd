// Type-erased entry points of the CUDA baseline scorers (KNorm, KeyDiff, TOVA, StreamingLLM) and
// of the device Ada-KV head budgets (cuda/baselines.cu). Plain structs in, a Status out, nothing
// thrown; free of Eigen and CUDA headers. Typed, throwing wrappers: cuda/baselines.hpp. All work
// is enqueued on cuda_backend::stream; workspaces are caller-owned (256-byte aligned, sized with
// the *_workspace_bytes queries first).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/allocators/adakv_row.hpp"
#include "kvpolicy/cuda/baseline_math.hpp"
#include "kvpolicy/scorers/keydiff_row.hpp"
#include "kvpolicy/scorers/knorm_row.hpp"
#include "kvpolicy/scorers/streaming_row.hpp"
#include "kvpolicy/scorers/tova_row.hpp"
#include "kvpolicy/cuda/launch.hpp"
#include "kvpolicy/cuda/score_launch.hpp"
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

// KNorm::score: out[l][h][j] = -||k_j||_2 (fp32). No workspace.
Status knorm_score(const cuda_backend& be, const TensorRef& keys, const MutableScoreView& out);

// KeyDiff::score: -cos(k_j, anchor), anchor = mean_j k_j / ||k_j|| per (layer, head), in double
// like the CPU scorer. Workspace: per-token norms, anchor partials per token chunk, anchors.
Status keydiff_workspace_bytes(const TensorRef& keys, std::size_t& bytes);
Status keydiff_score(const cuda_backend& be, const TensorRef& keys, const MutableScoreView& out);

// TOVA::score: window attention (GQA mean) of the last query, averaged over the layer's KV
// heads; every head of a layer gets the same row. Workspace: window attention's plus its
// [L][Hkv][T] result.
Status tova_workspace_bytes(const TensorRef& keys, const TensorRef& queries, std::size_t& bytes);
Status tova_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& queries,
                  const MutableScoreView& out);

// Streaming::score: out[l][h][j] = j. No workspace.
Status streaming_score(const cuda_backend& be, const MutableScoreView& out);

// KVzip::score: the given per-token scores `src` (device; row r at src + r * src_stride, the
// reconstruction scores an engine's pass computed) copied into `out`, device to device,
// asynchronously on the stream. No workspace.
Status copy_score_rows(const cuda_backend& be, const float* src, std::int64_t src_stride,
                       const MutableScoreView& out);

// Ada-KV head budgets (AdaKV::allocate) on the device: from scores [L][H][T] (device), each
// row's budget (host or device, clamped to [P, T], P = the protected count of sinks + recent)
// and alpha, writes the per-(layer, head) budgets to `out_budgets` (device, [L * H]; may equal
// `budgets` when those are on the device). cuda::select with BudgetsAt::device then keeps what
// the CPU chain `... | adakv` keeps. At most adakv_max_heads heads per layer.
inline constexpr std::int64_t adakv_max_heads = 1024;
Status adakv_workspace_bytes(std::int64_t layers, std::int64_t heads, std::int64_t tokens,
                             std::int64_t sinks, std::int64_t recent, std::size_t& bytes);
Status adakv_budgets(const cuda_backend& be, const ScoreView& scores, const std::int64_t* budgets,
                     BudgetsAt where, std::int64_t sinks, std::int64_t recent, double alpha,
                     std::int64_t* out_budgets);

}  // namespace kvpolicy::cuda
