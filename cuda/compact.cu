// Gather-compact on the GPU, in place.
//
// Why an ordered pass: row i receives row kept[i] >= i, so a row may be overwritten before the
// thread that needs it as a source has read it. Running rows of one (layer, head) in several
// blocks races; gathering into a side buffer first would cost up to a full copy of the cache in
// workspace (the kept total of a device selection is unknown on the host), which defeats a
// library whose point is memory. Instead one thread block owns a (layer, head) row and walks its
// kept list in tiles: it reads a tile's source rows into shared memory, synchronises, then
// writes them. Within a tile the barrier orders every read before any write; a later tile only
// reads rows >= its first destination, which no earlier tile wrote. Different (layer, head)
// rows never alias (validate(KVView)), so blocks are independent. No workspace.
//
// Copies are bit moves, so the kernel is templated on the copy unit only: 16-byte vectors when
// the row size, the base pointer and every stride allow, else 8, 4, 2 or 1 bytes. A view with a
// head_dim stride other than 1 (transposed layouts) copies element by element.
// Parallelism: on compute capability 9.0 and later a cluster of 8 thread blocks owns a (layer,
// head) row, and the cluster barrier gives the read-before-write order across its blocks: each
// round, every block loads its share of the round's kept rows into registers
// (compact_cluster_units copy units per thread), the cluster synchronises, then every block
// stores. Rounds move forward through the row as tiles do above: a moved row's source is strictly
// after it (kept[i] > i past the rows already in place), so a round reads only rows strictly after
// every row an earlier round wrote (rounds count units: a row can be split between two rounds),
// and only the write-after-read order inside a round needs the barrier (nothing a round reads was written by this kernel, so no store
// has to become visible to another block). A cluster moves up to 8 x 512 x 8 x 16 B = 512 KiB per
// round, against one block's 32 KiB shared-memory tile before. Measured on an H200 (one layer of
// 8 KV heads, T = 32768, fp16, 20% kept: kvpolicy_bench BM_cuda_compact_vs_memcpy): 691 us with
// one block per row (2.5% of a memcpy of the same bytes), 61 us with clusters of 8 (26%); clusters
// of 16 (non-portable) with 16 units per thread ran at 70 us, no better. Older devices, and a
// cluster launch the device refuses (the error it leaves is cleared), and builds without sm_90
// code take the one-block kernel.
#include <cooperative_groups.h>

#include <atomic>
#include <cstdint>

#include "check.cuh"
#include "kvpolicy/cuda/compact_math.hpp"
#include "kvpolicy/cuda/launch.hpp"

namespace kvpolicy::cuda {
namespace {

using compact_math::first_moved;

constexpr int compact_block = 256;

// Strides in copy units.
struct UnitGeometry {
  std::int64_t heads, rows;
  std::int64_t stride_layer, stride_head, stride_token, stride_col;
  int row_units;  // copy units per token row
  int tile_rows;  // rows staged per tile
};

template <class U>
__global__ void __launch_bounds__(compact_block)
    compact_ordered_kernel(U* data, UnitGeometry g, const std::int64_t* offsets,
                           const std::int32_t* indices) {
  extern __shared__ __align__(16) unsigned char smem[];
  U* tile = reinterpret_cast<U*>(smem);
  for (std::int64_t r = blockIdx.x; r < g.rows; r += gridDim.x) {
    U* base = data + (r / g.heads) * g.stride_layer + (r % g.heads) * g.stride_head;
    const std::int64_t begin = offsets[r];
    const std::int64_t n = offsets[r + 1] - begin;
    const std::int32_t* kept = indices + begin;
    for (std::int64_t t0 = first_moved(kept, n); t0 < n; t0 += g.tile_rows) {
      const int nt = static_cast<int>(n - t0 < g.tile_rows ? n - t0 : g.tile_rows);
      const int units = nt * g.row_units;
      for (int e = threadIdx.x; e < units; e += blockDim.x) {
        const int i = e / g.row_units, c = e - i * g.row_units;
        tile[e] = base[kept[t0 + i] * g.stride_token + c * g.stride_col];
      }
      __syncthreads();
      for (int e = threadIdx.x; e < units; e += blockDim.x) {
        const int i = e / g.row_units, c = e - i * g.row_units;
        base[(t0 + i) * g.stride_token + c * g.stride_col] = tile[e];
      }
      __syncthreads();
    }
  }
}

constexpr int compact_cluster_blocks = compact_math::kClusterBlocks;
constexpr int compact_cluster_threads = compact_math::kClusterThreads;
constexpr int compact_cluster_units = compact_math::kClusterUnits;

template <class U>
__global__ void __launch_bounds__(compact_cluster_threads)
    compact_cluster_kernel(U* data, UnitGeometry g, const std::int64_t* offsets,
                           const std::int32_t* indices) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  namespace cm = compact_math;
  cg::cluster_group cluster = cg::this_cluster();
  const std::int64_t rank = cluster.block_rank();
  const std::int64_t clusters = gridDim.x / compact_cluster_blocks;
  const int t = static_cast<int>(threadIdx.x);
  // Every bound below is the same in all blocks of the cluster, so they meet at every barrier.
  for (std::int64_t r = blockIdx.x / compact_cluster_blocks; r < g.rows; r += clusters) {
    U* base = data + (r / g.heads) * g.stride_layer + (r % g.heads) * g.stride_head;
    const std::int64_t begin = offsets[r];
    const std::int64_t n = offsets[r + 1] - begin;
    const std::int32_t* kept = indices + begin;
    const std::int64_t t0 = first_moved(kept, n);
    const std::int64_t units = (n - t0) * g.row_units;  // units to move in this row
    const cm::UnitStep step = cm::unit_step(g.row_units);
    for (std::int64_t u0 = 0; u0 < units; u0 += cm::cluster_round_units()) {
      U v[compact_cluster_units];
      const std::int64_t first = cm::cluster_first_unit(u0, rank, t);
      const cm::Unit u_first = cm::unit_at(first, g.row_units);
      cm::Unit u = u_first;
#pragma unroll
      for (int k = 0; k < compact_cluster_units; ++k) {
        if (first + std::int64_t{k} * compact_cluster_threads < units)
          v[k] = base[kept[t0 + u.i] * g.stride_token + u.c * g.stride_col];
        cm::next_unit(u, step, g.row_units);
      }
      cluster.sync();  // every read of the round before any write
      u = u_first;
#pragma unroll
      for (int k = 0; k < compact_cluster_units; ++k) {
        if (first + std::int64_t{k} * compact_cluster_threads < units)
          base[(t0 + u.i) * g.stride_token + u.c * g.stride_col] = v[k];
        cm::next_unit(u, step, g.row_units);
      }
    }
  }
#else
  (void)data, (void)g, (void)offsets, (void)indices, (void)compact_cluster_units;
  __trap();  // never launched: clusters_available() requires this kernel's sm_90 form
#endif
}

// Whether the cluster kernel can run on the current device: compute capability 9.0 or later, and
// the build holds its sm_90 form (a build for older architectures alone would run the PTX of its
// trap branch through the driver's JIT).
template <class U>
bool clusters_available() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // The answer for (U, device) holds for the process: asked once per device (three runtime
  // queries, kept off the per-event path). 0 unknown, 1 no, 2 yes; devices past 64 ask each time.
  static std::atomic<signed char> known[64] = {};
  if (dev < 64) {
    const signed char k = known[dev].load(std::memory_order_relaxed);
    if (k != 0) return k == 2;
  }
  int major = 0;
  bool yes = false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;  // not cached: a transient failure
  }
  if (major >= 9) {
    cudaFuncAttributes fa{};
    if (cudaFuncGetAttributes(&fa, compact_cluster_kernel<U>) != cudaSuccess)
      (void)cudaGetLastError();  // no image of the kernel for this device: the one-block launch says so
    else
      yes = fa.ptxVersion >= 90;
  }
  if (dev < 64) known[dev].store(yes ? 2 : 1, std::memory_order_relaxed);
  return yes;
}

template <class U>
Status launch(const cuda_backend& be, const RowsView& v, int unit, const CsrSelection& sel) {
  UnitGeometry g{};
  g.heads = v.heads;
  g.rows = v.layers * v.heads;
  const bool packed = v.stride_dim == 1;
  // Element strides -> unit strides (pick_unit checked that the bytes divide).
  g.stride_layer = v.stride_layer * v.elem_bytes / unit;
  g.stride_head = v.stride_head * v.elem_bytes / unit;
  g.stride_token = v.stride_token * v.elem_bytes / unit;
  g.stride_col = packed ? 1 : v.stride_dim * v.elem_bytes / unit;
  g.row_units = static_cast<int>(v.dim * v.elem_bytes / unit);
  const std::int64_t row_bytes = v.dim * v.elem_bytes;
  g.tile_rows = static_cast<int>(compact_max_row_bytes / row_bytes);
  if (clusters_available<U>()) {
    cudaLaunchConfig_t cfg{};
    const std::int64_t clusters = g.rows < (1 << 16) ? g.rows : (1 << 16);
    cfg.gridDim = dim3(static_cast<unsigned>(clusters * compact_cluster_blocks));
    cfg.blockDim = dim3(compact_cluster_threads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = detail::stream_of(be.stream);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = compact_cluster_blocks;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, compact_cluster_kernel<U>, static_cast<U*>(v.data),
                                             g, sel.offsets, sel.indices);
    if (e == cudaSuccess) return {};
    (void)cudaGetLastError();  // refused (e.g. no room for a cluster): the one-block kernel
  }
  const std::size_t smem = static_cast<std::size_t>(g.tile_rows) * row_bytes;
  const unsigned grid = static_cast<unsigned>(g.rows < (1 << 20) ? g.rows : (1 << 20));
  compact_ordered_kernel<U><<<grid, compact_block, smem, detail::stream_of(be.stream)>>>(
      static_cast<U*>(v.data), g, sel.offsets, sel.indices);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

// Widest copy unit that divides the row, the base address and every stride (in bytes).
int pick_unit(const RowsView& v) {
  if (v.stride_dim != 1) return v.elem_bytes;
  const std::int64_t eb = v.elem_bytes;
  const std::int64_t parts[] = {v.dim * eb, v.stride_layer * eb, v.stride_head * eb,
                                v.stride_token * eb,
                                static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(v.data))};
  for (int unit = 16; unit > v.elem_bytes; unit /= 2) {
    bool ok = true;
    for (std::int64_t p : parts) ok = ok && p % unit == 0;
    if (ok) return unit;
  }
  return v.elem_bytes;
}

}  // namespace

std::size_t compact_workspace_bytes(const RowsView&) { return 0; }

Status compact_rows(const cuda_backend& be, const RowsView& v, const CsrSelection& sel) {
  const int eb = v.elem_bytes;
  if (eb != 1 && eb != 2 && eb != 4 && eb != 8 && eb != 16)
    return detail::invalid("element size must be 1, 2, 4, 8 or 16 bytes");
  if (v.layers < 0 || v.heads < 0 || v.dim < 0) return detail::invalid("negative extent");
  if (sel.layers != v.layers || sel.heads != v.heads)
    return detail::invalid("selection shape differs from the cache's layers x heads");
  if (v.layers * v.heads == 0 || v.dim == 0) return {};
  if (!v.data || !sel.offsets || !sel.indices) return detail::invalid("null pointer");
  if (reinterpret_cast<std::uintptr_t>(v.data) % eb != 0)
    return detail::invalid("cache pointer is not aligned to its element size");
  if (v.dim * eb > compact_max_row_bytes)
    return detail::invalid("head_dim * element size exceeds compact_max_row_bytes");
  switch (pick_unit(v)) {
    case 16: return launch<uint4>(be, v, 16, sel);
    case 8: return launch<uint2>(be, v, 8, sel);
    case 4: return launch<std::uint32_t>(be, v, 4, sel);
    case 2: return launch<std::uint16_t>(be, v, 2, sel);
    default: return launch<std::uint8_t>(be, v, 1, sel);
  }
}

}  // namespace kvpolicy::cuda
