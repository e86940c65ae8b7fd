// Semantic merger on the GPU: one thread block per (layer, KV head) row, the row's logic in
// gsc::merge_row (mergers/gsc_row.hpp, shared with the host emulation in the agreement test).
//
// Inside a row, chunks run in order. For each chunk the block ranks the candidates by topk_key
// (one thread per candidate counts the better keys: keys are distinct, so the ranks are a
// permutation; O(n^2 / threads), below the O(seeds x n x head_dim) of the clustering), computes
// squared key norms (one thread per candidate, fp64 over head_dim in order), then walks the
// seeds in order: for each seed, one thread per remaining candidate tests the cosine (its own
// fp64 dot product, summed in the CPU's order), so every decision matches SemanticMerger's.
// Cores are written with one thread per head_dim column summing the members in candidate order.
// Built with --fmad=false (cuda/CMakeLists.txt): no multiply-add is contracted into an FMA.
// Rows are independent, so a grid-stride loop over rows needs no inter-block ordering; the
// scratch (candidates, owners, norms, roles) is one row's worth per block in the workspace.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "check.cuh"
#include "kvpolicy/cuda/merge_launch.hpp"

namespace kvpolicy::cuda {
namespace {

constexpr int merge_block = 128;

struct DeviceBlock {
  template <class F>
  KVP_HD void par(F&& f) const {
#if defined(__CUDA_ARCH__)
    f(static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
#else
    (void)f;
#endif
  }
  template <class F>
  KVP_HD void single(F&& f) const {
#if defined(__CUDA_ARCH__)
    if (threadIdx.x == 0) f();
#else
    (void)f;
#endif
  }
  KVP_HD void sync() const {
#if defined(__CUDA_ARCH__)
    __syncthreads();
#endif
  }
  KVP_HD void atomic_add(int* p, int v) const {
#if defined(__CUDA_ARCH__)
    atomicAdd(p, v);
#else
    (void)p, (void)v;
#endif
  }
};

struct ElemF32 {
  static __device__ double load(const void* p, std::int64_t i) {
    return static_cast<double>(static_cast<const float*>(p)[i]);
  }
  static __device__ void store(void* p, std::int64_t i, float x) { static_cast<float*>(p)[i] = x; }
};
struct ElemF16 {
  static __device__ double load(const void* p, std::int64_t i) {
    return static_cast<double>(__half2float(static_cast<const __half*>(p)[i]));
  }
  static __device__ void store(void* p, std::int64_t i, float x) {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  }
};
struct ElemBF16 {
  static __device__ double load(const void* p, std::int64_t i) {
    return static_cast<double>(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
  }
  static __device__ void store(void* p, std::int64_t i, float x) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  }
};

template <class Elem>
__global__ void __launch_bounds__(merge_block)
    semantic_merge_kernel(gsc::Params p, gsc::Geometry g, unsigned char* workspace) {
  extern __shared__ double seed_key[];
  __shared__ gsc::Shared sh;
  if (threadIdx.x == 0) sh.seed_key = seed_key;
  __syncthreads();
  const gsc::Scratch s =
      gsc::scratch_at(workspace + blockIdx.x * gsc::scratch_row_bytes(g.tokens), g.tokens);
  const std::int64_t rows = g.layers * g.heads;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    gsc::merge_row<Elem>(DeviceBlock{}, p, g, r, s, sh);
    __syncthreads();  // scratch reused by the next row
  }
}

gsc::Rows rows_of(const RowsView& v) {
  return {v.data, v.stride_layer, v.stride_head, v.stride_token, v.stride_dim};
}

}  // namespace

Status semantic_merge(const cuda_backend& be, const gsc::Params& params,
                      const SemanticMergeArgs& a) {
  const RowsView& k = a.keys;
  const int eb = a.type == DType::f32 ? 4 : 2;
  if (k.elem_bytes != eb || a.values.elem_bytes != eb)
    return detail::invalid("element size does not match the cache type");
  if (a.values.layers != k.layers || a.values.heads != k.heads || a.values.tokens != k.tokens ||
      a.values.dim != k.dim)
    return detail::invalid("values extents differ from keys");
  if (k.layers < 0 || k.heads < 0 || k.tokens < 0 || k.dim < 0)
    return detail::invalid("negative extent");
  if (a.selection.layers != k.layers || a.selection.heads != k.heads)
    return detail::invalid("selection shape differs from the cache's layers x heads");
  if (params.chunk < 0 || (params.chunk == 0 && a.delimiter == nullptr))
    return detail::invalid("chunk must be > 0 without a delimiter mask");
  const std::int64_t rows = k.layers * k.heads;
  if (rows == 0 || k.tokens == 0) return {};
  if (!k.data || !a.values.data || !a.selection.offsets || !a.scores || !a.log_count)
    return detail::invalid("null pointer");
  const std::size_t need = semantic_merge_workspace_bytes(rows, k.tokens);
  if (be.workspace_bytes < need || (need > 0 && be.workspace == nullptr))
    return {StatusCode::insufficient_workspace, 0,
            "workspace below semantic_merge_workspace_bytes(rows, tokens)"};
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % 8 != 0)
    return detail::invalid("workspace is not 8-byte aligned");
  gsc::Geometry g;
  g.layers = k.layers;
  g.heads = k.heads;
  g.tokens = k.tokens;
  g.dim = k.dim;
  g.keys = rows_of(k);
  g.values = rows_of(a.values);
  g.scores = a.scores;
  g.score_stride = a.score_stride > 0 ? a.score_stride : k.tokens;
  g.log_count = a.log_count;
  g.log_count_stride = a.log_count_stride > 0 ? a.log_count_stride : k.tokens;
  g.kept_offsets = a.selection.offsets;
  g.kept_indices = a.selection.indices;
  g.sinks = a.sinks;
  g.recent = a.recent;
  g.delimiter = a.delimiter;
  g.delimiter_stride = a.delimiter_stride;
  g.chunk_end = a.chunk_end;
  g.chunk_end_stride = a.chunk_end_stride > 0 ? a.chunk_end_stride : k.tokens;
  const unsigned grid =
      static_cast<unsigned>(rows < semantic_merge_max_blocks ? rows : semantic_merge_max_blocks);
  const std::size_t smem = static_cast<std::size_t>(k.dim) * sizeof(double);
  // The static shared state counts toward the 48 KiB a launch gets without opting in.
  if (smem > 48 * 1024 - sizeof(gsc::Shared))
    return detail::invalid("head_dim too large: its fp64 row exceeds the 48 KiB of shared memory");
  auto* ws = static_cast<unsigned char*>(be.workspace);
  const cudaStream_t st = detail::stream_of(be.stream);
  switch (a.type) {
    case DType::f32:
      semantic_merge_kernel<ElemF32><<<grid, merge_block, smem, st>>>(params, g, ws);
      break;
    case DType::f16:
      semantic_merge_kernel<ElemF16><<<grid, merge_block, smem, st>>>(params, g, ws);
      break;
    case DType::bf16:
      semantic_merge_kernel<ElemBF16><<<grid, merge_block, smem, st>>>(params, g, ws);
      break;
  }
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace kvpolicy::cuda
