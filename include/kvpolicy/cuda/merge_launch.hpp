// Type-erased entry points of the CUDA semantic merger (cuda/merge.cu): plain pointer + stride
// structs in, a Status out, nothing thrown. Free of Eigen and CUDA headers; the typed, throwing
// wrapper is cuda/merge.hpp. Work is enqueued on cuda_backend::stream and is asynchronous.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/types.hpp"
#include "kvpolicy/cuda/csr.hpp"
#include "kvpolicy/cuda/launch.hpp"
#include "kvpolicy/cuda/status.hpp"
#include "kvpolicy/mergers/gsc_row.hpp"

namespace kvpolicy::cuda {

// MergeArgs with device pointers. keys/values: same extents, element type `type`. Scores are
// fp32 [rows][score_stride]; log_count [rows][log_count_stride] (0: tokens); delimiter optional
// (stride 0: one mask [tokens] for every row); chunk_end optional (stride 0: tokens).
struct SemanticMergeArgs {
  RowsView keys, values;
  DType type = DType::f32;
  CsrSelection selection;
  const float* scores = nullptr;
  std::int64_t score_stride = 0;
  float* log_count = nullptr;
  std::int64_t log_count_stride = 0;
  std::int64_t sinks = 0, recent = 0;
  const std::uint8_t* delimiter = nullptr;
  std::int64_t delimiter_stride = 0;
  std::uint8_t* chunk_end = nullptr;
  std::int64_t chunk_end_stride = 0;
};

// One thread block per (layer, KV head) row, at most this many blocks (a grid-stride loop over
// the rows beyond): the workspace holds one row's scratch per block.
inline constexpr std::int64_t semantic_merge_max_blocks = 256;

// Workspace bytes for `rows` rows of `tokens` tokens: min(rows, max_blocks) row scratches of
// gsc::scratch_row_bytes(tokens) (17 bytes per token).
inline std::size_t semantic_merge_workspace_bytes(std::int64_t rows, std::int64_t tokens) {
  const std::int64_t blocks = rows < semantic_merge_max_blocks ? rows : semantic_merge_max_blocks;
  return static_cast<std::size_t>(blocks > 0 ? blocks * gsc::scratch_row_bytes(tokens) : 0);
}

// The semantic merge (mergers/semantic.hpp) of every row, bit-identical to the CPU merger.
// Arguments are trusted as the typed wrapper checks them (selection ascending inside
// [0, tokens), log_count >= 0 and finite); the workspace (cuda_backend::workspace, 256-byte
// aligned) must hold semantic_merge_workspace_bytes.
Status semantic_merge(const cuda_backend& be, const gsc::Params& params,
                      const SemanticMergeArgs& args);

}  // namespace kvpolicy::cuda
