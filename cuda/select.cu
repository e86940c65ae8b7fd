// Batched per-(layer, head) top-k with protected tokens, one launch sequence for all rows.
//
//   1. row_setup: per-row kept counts min(budget, T) -> CSR output offsets (block scan), and the
//      uniform segment offsets r * T of the key array.
//   2. build_keys: key of token j = select_key(score, j, protected span): protected tokens above
//      every scored one, scored ones by topk_key (higher score, then higher index).
//   3. cub::DeviceSegmentedRadixSort::SortKeysDescending over all rows at once (double buffer,
//      so CUB's own temp storage stays small).
//   4. take: the first count_r keys of row r -> their token indices, at the row's CSR offset.
//   5. cub::DeviceSegmentedRadixSort::SortKeys over the CSR segments, only the bits an index can
//      use, straight into the caller's indices: ascending kept lists.
// Keys are unique (the index is in the low word), so the result is deterministic and equal to
// cpu::select whatever the sort's internals.
//
// Workspace (each region 256-byte aligned): budgets R x i64 (host budgets are uploaded there),
// segment offsets (R + 1) x i64, two key buffers R*T x u64, unsorted kept indices R*T x i32,
// and CUB's temp storage (the larger of the two sorts'), about 20 bytes per score in all.
#include <climits>
#include <cstdint>

#include <cub/block/block_scan.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "check.cuh"
#include "kvpolicy/cuda/launch.hpp"
#include "kvpolicy/cuda/select_key.hpp"

namespace kvpolicy::cuda {
namespace {

constexpr int setup_block = 256;
constexpr int item_block = 256;

__global__ void __launch_bounds__(setup_block)
    row_setup_kernel(const std::int64_t* budgets, std::int64_t rows, std::int64_t tokens,
                     std::int64_t* segment_offsets, std::int64_t* out_offsets) {
  using Scan = cub::BlockScan<std::int64_t, setup_block>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ std::int64_t carry;
  if (threadIdx.x == 0) {
    carry = 0;
    out_offsets[0] = 0;
    segment_offsets[rows] = rows * tokens;
  }
  __syncthreads();
  for (std::int64_t r0 = 0; r0 < rows; r0 += setup_block) {
    const std::int64_t r = r0 + threadIdx.x;
    std::int64_t count = 0;
    if (r < rows) {
      const std::int64_t b = budgets[r];
      count = b < 0 ? 0 : (b > tokens ? tokens : b);
      segment_offsets[r] = r * tokens;
    }
    std::int64_t inclusive, tile_total;
    Scan(scan_storage).InclusiveSum(count, inclusive, tile_total);
    if (r < rows) out_offsets[r + 1] = carry + inclusive;
    __syncthreads();  // everyone has read carry (and scan_storage is free again)
    if (threadIdx.x == 0) carry += tile_total;
    __syncthreads();
  }
}

__global__ void __launch_bounds__(item_block)
    build_keys_kernel(const float* scores, std::int64_t row_stride, std::int64_t rows,
                      std::int64_t tokens, ProtectedSpan prot, std::uint64_t* keys) {
  const std::int64_t n = rows * tokens;
  for (std::int64_t g = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; g < n;
       g += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = g / tokens, j = g - r * tokens;
    keys[g] = select_key(scores[r * row_stride + j], static_cast<std::int32_t>(j), prot);
  }
}

__global__ void __launch_bounds__(item_block)
    take_kernel(const std::uint64_t* sorted, std::int64_t rows, std::int64_t tokens,
                const std::int64_t* out_offsets, std::int32_t* kept) {
  const std::int64_t n = rows * tokens;
  for (std::int64_t g = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; g < n;
       g += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = g / tokens, i = g - r * tokens;
    const std::int64_t begin = out_offsets[r];
    if (i < out_offsets[r + 1] - begin) kept[begin + i] = topk_key_index(sorted[g]);
  }
}

constexpr std::size_t align_up(std::size_t x) { return (x + 255) & ~std::size_t{255}; }

// Bits an index in [0, tokens) can use (at least one: CUB wants begin_bit < end_bit).
int index_bits(std::int64_t tokens) {
  int b = 1;
  while (b < 31 && (std::int64_t{1} << b) < tokens) ++b;
  return b;
}

struct Layout {
  std::size_t budgets = 0, segments = 0, keys_a = 0, keys_b = 0, unsorted = 0, cub = 0;
  std::size_t cub_bytes = 0, total = 0;
};

Status plan(std::int64_t rows, std::int64_t tokens, Layout& lay) {
  if (rows < 0 || tokens < 0) return detail::invalid("negative rows or tokens");
  if (tokens > 0 && rows > std::int64_t{INT_MAX} / tokens)
    return detail::invalid("rows * tokens exceeds the int range of CUB's item count");
  const int items = static_cast<int>(rows * tokens), segments = static_cast<int>(rows);
  std::size_t desc_bytes = 0, asc_bytes = 0;
  if (items > 0) {
    // Size queries: no kernel runs and the pointers are not read.
    cub::DoubleBuffer<std::uint64_t> keys(nullptr, nullptr);
    KVP_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeysDescending(
        nullptr, desc_bytes, keys, items, segments, static_cast<const std::int64_t*>(nullptr),
        static_cast<const std::int64_t*>(nullptr)));
    KVP_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeys(
        nullptr, asc_bytes, static_cast<const std::uint32_t*>(nullptr),
        static_cast<std::uint32_t*>(nullptr), items, segments,
        static_cast<const std::int64_t*>(nullptr), static_cast<const std::int64_t*>(nullptr), 0,
        index_bits(tokens)));
  }
  const std::size_t R = static_cast<std::size_t>(rows), N = static_cast<std::size_t>(items);
  std::size_t at = 0;
  lay.budgets = at, at += align_up(R * sizeof(std::int64_t));
  lay.segments = at, at += align_up((R + 1) * sizeof(std::int64_t));
  lay.keys_a = at, at += align_up(N * sizeof(std::uint64_t));
  lay.keys_b = at, at += align_up(N * sizeof(std::uint64_t));
  lay.unsorted = at, at += align_up(N * sizeof(std::int32_t));
  lay.cub_bytes = desc_bytes > asc_bytes ? desc_bytes : asc_bytes;
  lay.cub = at, at += align_up(lay.cub_bytes);
  lay.total = at;
  return {};
}

}  // namespace

Status select_workspace_bytes(std::int64_t rows, std::int64_t tokens, std::size_t& bytes) {
  Layout lay;
  const Status s = plan(rows, tokens, lay);
  bytes = s.ok() ? lay.total : 0;
  return s;
}

Status select_rows(const cuda_backend& be, const ScoreView& scores, const std::int64_t* budgets,
                   BudgetsAt where, std::int64_t sinks, std::int64_t recent, CsrSelection& out) {
  const std::int64_t R = scores.rows(), T = scores.tokens;
  if (out.layers != scores.layers || out.heads != scores.heads)
    return detail::invalid("output selection shape differs from the scores'");
  if (T > (std::int64_t{1} << 31) - 1) return detail::invalid("tokens exceed the int32 range");
  if (R == 0) return {};
  if (!out.offsets || !budgets) return detail::invalid("null pointer");
  if (T > 0 && (!scores.data || scores.row_stride < T))
    return detail::invalid("null scores or row stride below tokens");
  Layout lay;
  if (Status s = plan(R, T, lay); !s.ok()) return s;
  if (be.workspace_bytes < lay.total || (lay.total > 0 && !be.workspace))
    return {StatusCode::insufficient_workspace, 0,
            "cuda_backend::workspace_bytes is below select_workspace_bytes(rows, tokens)"};
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % 256 != 0)
    return detail::invalid("workspace must be 256-byte aligned (as cudaMalloc returns it)");
  const cudaStream_t stream = detail::stream_of(be.stream);
  auto* ws = static_cast<unsigned char*>(be.workspace);
  auto* ws_budgets = reinterpret_cast<std::int64_t*>(ws + lay.budgets);
  auto* segments = reinterpret_cast<std::int64_t*>(ws + lay.segments);
  auto* keys_a = reinterpret_cast<std::uint64_t*>(ws + lay.keys_a);
  auto* keys_b = reinterpret_cast<std::uint64_t*>(ws + lay.keys_b);
  auto* unsorted = reinterpret_cast<std::int32_t*>(ws + lay.unsorted);
  void* cub_temp = ws + lay.cub;

  if (where == BudgetsAt::host) {
    KVP_CUDA_TRY(cudaMemcpyAsync(ws_budgets, budgets, static_cast<std::size_t>(R) * sizeof(std::int64_t),
                                 cudaMemcpyHostToDevice, stream));
    budgets = ws_budgets;
  }
  row_setup_kernel<<<1, setup_block, 0, stream>>>(budgets, R, T, segments, out.offsets);
  KVP_CUDA_TRY(cudaGetLastError());
  const std::int64_t items = R * T;
  if (items == 0) return {};

  const unsigned grid = detail::grid_for(items, item_block);
  build_keys_kernel<<<grid, item_block, 0, stream>>>(scores.data, scores.row_stride, R, T,
                                                     protected_span(sinks, recent, T), keys_a);
  KVP_CUDA_TRY(cudaGetLastError());

  cub::DoubleBuffer<std::uint64_t> keys(keys_a, keys_b);
  std::size_t temp = lay.cub_bytes;
  KVP_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      cub_temp, temp, keys, static_cast<int>(items), static_cast<int>(R), segments, segments + 1,
      0, 64, stream));

  take_kernel<<<grid, item_block, 0, stream>>>(keys.Current(), R, T, out.offsets, unsorted);
  KVP_CUDA_TRY(cudaGetLastError());

  temp = lay.cub_bytes;
  // Indices are non-negative: sorting their bits as uint32 needs no sign handling, and only the
  // low index_bits(T) bits can differ.
  KVP_CUDA_TRY(cub::DeviceSegmentedRadixSort::SortKeys(
      cub_temp, temp, reinterpret_cast<const std::uint32_t*>(unsorted),
      reinterpret_cast<std::uint32_t*>(out.indices), static_cast<int>(items),
      static_cast<int>(R), out.offsets, out.offsets + 1, 0, index_bits(T), stream));
  return {};
}

}  // namespace kvpolicy::cuda
