// Type-erased entry points of the CUDA kernels (cuda/*.cu): plain pointer + stride structs in,
// a Status out, nothing thrown. Free of Eigen and CUDA headers so that both the .cu translation
// units and host code include it; the typed, throwing wrappers are cuda/compact.hpp and
// cuda/select.hpp. All work is enqueued on cuda_backend::stream and is asynchronous.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/cuda/csr.hpp"
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

// ---- gather-compact -------------------------------------------------------------------------

// A KVView with its element type erased: compaction only moves bits, so the element size is all
// the kernel needs (float, half and bfloat16 caches share the 4- and 2-byte paths, and per-token
// state is the same thing with dim == 1). Extents and strides in elements.
struct RowsView {
  void* data = nullptr;
  int elem_bytes = 0;  // 1, 2, 4, 8 or 16
  std::int64_t layers = 0, heads = 0, tokens = 0, dim = 0;
  std::int64_t stride_layer = 0, stride_head = 0, stride_token = 0, stride_dim = 1;
};

// Largest row (dim * elem_bytes) the compaction kernel stages in shared memory.
inline constexpr std::int64_t compact_max_row_bytes = 32 * 1024;

// In-place compaction runs as an ordered pass with one thread block per (layer, head) and needs
// no workspace; the query exists so callers follow the same two-phase protocol for every op.
std::size_t compact_workspace_bytes(const RowsView& rows);

// Row i of every (layer, head) becomes its i-th kept row; rows past the kept count are left as
// they were (same contract as cpu::compact, bit for bit). `sel` lives in device memory and is
// trusted: each row ascending and inside [0, tokens), as select() produces it.
Status compact_rows(const cuda_backend& be, const RowsView& rows, const CsrSelection& sel);

// ---- batched top-k selection ----------------------------------------------------------------

// fp32 scores [layers][heads][tokens] in device memory; row r = l * heads + h starts at
// data + r * row_stride (row_stride >= tokens).
struct ScoreView {
  const float* data = nullptr;
  std::int64_t layers = 0, heads = 0, tokens = 0, row_stride = 0;

  constexpr std::int64_t rows() const { return layers * heads; }
};

enum class BudgetsAt : std::uint8_t { host, device };

// Workspace for select_rows over `rows` rows of `tokens` tokens, for the current device (CUB's
// temporary storage depends on the architecture), about 20 bytes per score. CUB-style: fills
// `bytes`, returns a Status. cuda_backend::workspace must be 256-byte aligned (cudaMalloc's).
Status select_workspace_bytes(std::int64_t rows, std::int64_t tokens, std::size_t& bytes);

// Per row: keep every token if budget >= tokens, else the protected tokens (first `sinks`, last
// `recent`) plus the best others under topk_key, budget in all; write ascending indices as CSR
// into `out` (device memory). `budgets` holds rows entries, on the host or the device as `where`
// says. Budgets are not checked here (the typed wrapper checks host budgets): out.indices must
// hold sum(min(budget, tokens)) entries, and a budget below the protected count keeps the
// `budget` highest-index protected tokens. NaN scores order below every number, as in topk_key.
Status select_rows(const cuda_backend& be, const ScoreView& scores, const std::int64_t* budgets,
                   BudgetsAt where, std::int64_t sinks, std::int64_t recent, CsrSelection& out);

}  // namespace kvpolicy::cuda
