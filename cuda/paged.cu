// Paged gather-compact on the GPU (device twin of kvpolicy::paged_compact / paged_gather).
// The in-place order (chunks, read flags, tickets) and the address math are described and
// written as KVP_HD functions in include/kvpolicy/cuda/paged_plan.hpp; this file only launches
// them. Copies are bit moves: the kernels are templated on the copy unit (16, 8, 4, 2 or 1 bytes,
// the widest that divides the row, the base pointers and every stride).
#include <cstdint>

#include "check.cuh"
#include "kvpolicy/cuda/paged_plan.hpp"

namespace kvpolicy::cuda {
namespace {

constexpr int paged_block = 256;
// Staged source rows per chunk: below the 48 KiB a launch gets without opting in.
constexpr std::int64_t paged_smem_bytes = 32 * 1024;

struct CompactArgs {
  PagedGeometry g;
  const std::int32_t* ids;
  const std::int64_t* table_offsets;
  const std::int64_t* offsets;
  const std::int32_t* indices;
  std::int64_t chunk_tokens, chunks_per_row, items;  // items per pool
  unsigned long long* ticket;
  int* flags;  // per pool, per work item (row * chunks_per_row + chunk): 1 once it has read
};

template <class U>
__global__ void __launch_bounds__(paged_block) paged_compact_kernel(U* pool0, U* pool1, CompactArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  U* tile = reinterpret_cast<U*>(smem);
  __shared__ unsigned long long item;
  // Work items in ticket order, not blockIdx order: every item this one may wait on holds a
  // smaller ticket, so its block is already resident and reaches its flag without waiting.
  if (threadIdx.x == 0) item = atomicAdd(a.ticket, 1ull);
  __syncthreads();
  // Items [0, items) compact pool0 (keys), [items, 2 items) pool1 (values, if given).
  const auto wg = static_cast<std::int64_t>(item);
  const std::int64_t pi = wg >= a.items ? 1 : 0, w = wg - pi * a.items;
  if (pi == 1 && !pool1) return;
  U* pool = pi ? pool1 : pool0;
  int* flags = a.flags + pi * a.items;
  const PagedGeometry& g = a.g;
  const PagedItem it = paged_item(g, w, a.chunks_per_row, a.chunk_tokens, a.ids,
                                  a.table_offsets, a.offsets, a.indices);
  const std::int64_t units = it.nt * g.row_units;
  if (it.moves)
    for (std::int64_t e = threadIdx.x; e < units; e += blockDim.x)
      paged_chunk_read(g, pool, it.table, it.l, it.h, it.kept, it.t0, e, tile);
  __syncthreads();  // every read of this chunk is in the tile
  if (threadIdx.x == 0) {
    __threadfence();
    atomicExch(flags + w, 1);
  }
  if (!it.moves) return;
  if (threadIdx.x == 0) {
    const ChunkRange wait = paged_chunk_waits(it.kept, it.n, a.chunk_tokens, it.j);
    for (std::int64_t k = wait.first; k <= wait.last; ++k) {
      const volatile int* f = flags + it.row * a.chunks_per_row + k;
      while (*f == 0) {
      }
    }
    __threadfence();
  }
  __syncthreads();  // the chunks reading our destinations have read them
  for (std::int64_t e = threadIdx.x; e < units; e += blockDim.x)
    paged_chunk_write(g, pool, it.table, it.l, it.h, it.kept, it.t0, e, tile);
}

template <class U>
__global__ void __launch_bounds__(paged_block)
    paged_gather_kernel(const U* pool, PagedGeometry g, const std::int32_t* table,
                        std::int64_t length, DenseUnits d, U* dst, std::int64_t total) {
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       e < total; e += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    paged_gather_unit(g, pool, table, length, d, dst, e);
}

bool divides(int unit, const std::int64_t* parts, int n) {
  for (int i = 0; i < n; ++i)
    if (parts[i] % unit != 0) return false;
  return true;
}

// Widest unit dividing the pool's row, pointer and strides (and those of `dst` if given).
int pick_unit(const PagedRowsView& p, const RowsView* dst) {
  const std::int64_t eb = p.elem_bytes;
  if (p.stride_dim != 1 || (dst && dst->stride_dim != 1)) return p.elem_bytes;
  std::int64_t parts[10] = {p.dim * eb, p.stride_layer * eb, p.stride_block * eb,
                            p.stride_head * eb, p.stride_token * eb,
                            static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(p.data))};
  int n = 6;
  if (dst) {
    parts[n++] = dst->stride_layer * eb;
    parts[n++] = dst->stride_head * eb;
    parts[n++] = dst->stride_token * eb;
    parts[n++] = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(dst->data));
  }
  for (int unit = 16; unit > p.elem_bytes; unit /= 2)
    if (divides(unit, parts, n)) return unit;
  return p.elem_bytes;
}

PagedGeometry geometry(const PagedRowsView& p, int unit) {
  PagedGeometry g;
  const std::int64_t eb = p.elem_bytes;
  g.layers = p.layers;
  g.heads = p.heads;
  g.page_size = p.page_size;
  g.stride_layer = p.stride_layer * eb / unit;
  g.stride_block = p.stride_block * eb / unit;
  g.stride_head = p.stride_head * eb / unit;
  g.stride_token = p.stride_token * eb / unit;
  g.stride_col = p.stride_dim == 1 ? 1 : p.stride_dim * eb / unit;
  g.row_units = p.dim * eb / unit;
  return g;
}

Status check_pool(const PagedRowsView& p) {
  const int eb = p.elem_bytes;
  if (eb != 1 && eb != 2 && eb != 4 && eb != 8 && eb != 16)
    return detail::invalid("element size must be 1, 2, 4, 8 or 16 bytes");
  if (p.num_blocks < 0 || p.layers < 0 || p.heads < 0 || p.dim < 0)
    return detail::invalid("negative extent");
  if (p.page_size < 1) return detail::invalid("page_size must be >= 1");
  if (p.data && reinterpret_cast<std::uintptr_t>(p.data) % eb != 0)
    return detail::invalid("pool pointer is not aligned to its element size");
  if (p.dim * eb > compact_max_row_bytes)
    return detail::invalid("head_dim * element size exceeds compact_max_row_bytes");
  return {};
}

struct CompactPlan {
  std::int64_t chunk_tokens = 1, chunks_per_row = 0, rows = 0, items = 0;
  std::size_t bytes = 0;
};

CompactPlan plan(const PagedRowsView& p, const PagedTables& t) {
  CompactPlan c;
  c.chunk_tokens = paged_chunk_tokens(p.dim * p.elem_bytes, paged_smem_bytes);
  c.chunks_per_row = t.max_tokens > 0 ? (t.max_tokens + c.chunk_tokens - 1) / c.chunk_tokens : 0;
  c.rows = t.requests * p.layers * p.heads;
  c.items = c.rows * c.chunks_per_row;
  // The ticket and two pools' flags (keys and values in one launch).
  c.bytes = c.items > 0
                ? sizeof(unsigned long long) + 2 * static_cast<std::size_t>(c.items) * sizeof(int)
                : 0;
  c.bytes = (c.bytes + 255) / 256 * 256;
  return c;
}

template <class U>
Status launch_compact(const cuda_backend& be, const PagedRowsView& p, void* second, int unit,
                      const PagedTables& t, const CsrSelection& sel, const CompactPlan& c) {
  cudaStream_t s = detail::stream_of(be.stream);
  KVP_CUDA_TRY(cudaMemsetAsync(be.workspace, 0, c.bytes, s));
  CompactArgs a{};
  a.g = geometry(p, unit);
  a.ids = t.ids;
  a.table_offsets = t.offsets;
  a.offsets = sel.offsets;
  a.indices = sel.indices;
  a.chunk_tokens = c.chunk_tokens;
  a.chunks_per_row = c.chunks_per_row;
  a.items = c.items;
  a.ticket = static_cast<unsigned long long*>(be.workspace);
  a.flags = reinterpret_cast<int*>(a.ticket + 1);
  const std::size_t smem =
      static_cast<std::size_t>(c.chunk_tokens) * static_cast<std::size_t>(p.dim * p.elem_bytes);
  const auto grid = static_cast<unsigned>(second ? 2 * c.items : c.items);
  paged_compact_kernel<U><<<grid, paged_block, smem, s>>>(static_cast<U*>(p.data),
                                                           static_cast<U*>(second), a);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

template <class U>
Status launch_gather(const cuda_backend& be, const PagedRowsView& p, int unit,
                     const std::int32_t* table, std::int64_t length, const RowsView& dst) {
  const PagedGeometry g = geometry(p, unit);
  const std::int64_t eb = p.elem_bytes;
  DenseUnits d;
  d.stride_layer = dst.stride_layer * eb / unit;
  d.stride_head = dst.stride_head * eb / unit;
  d.stride_token = dst.stride_token * eb / unit;
  d.stride_col = dst.stride_dim == 1 ? 1 : dst.stride_dim * eb / unit;
  const std::int64_t total = p.layers * p.heads * length * g.row_units;
  paged_gather_kernel<U><<<detail::grid_for(total, paged_block, 1u << 20), paged_block, 0,
                           detail::stream_of(be.stream)>>>(static_cast<const U*>(p.data), g,
                                                           table, length, d,
                                                           static_cast<U*>(dst.data), total);
  KVP_CUDA_TRY(cudaGetLastError());
  return {};
}

}  // namespace

std::size_t paged_compact_workspace_bytes(const PagedRowsView& pool, const PagedTables& tables) {
  return plan(pool, tables).bytes;
}

namespace {

bool same_geometry(const PagedRowsView& a, const PagedRowsView& b) {
  return a.elem_bytes == b.elem_bytes && a.num_blocks == b.num_blocks && a.layers == b.layers &&
         a.heads == b.heads && a.page_size == b.page_size && a.dim == b.dim &&
         a.stride_layer == b.stride_layer && a.stride_block == b.stride_block &&
         a.stride_head == b.stride_head && a.stride_token == b.stride_token &&
         a.stride_dim == b.stride_dim;
}

// One launch for `p` (and `second`, a pool of identical geometry and copy unit, if not null).
Status compact_pools(const cuda_backend& be, const PagedRowsView& p, void* second, int unit,
                     const PagedTables& t, const CsrSelection& sel, const CompactPlan& c) {
  switch (unit) {
    case 16: return launch_compact<uint4>(be, p, second, 16, t, sel, c);
    case 8: return launch_compact<uint2>(be, p, second, 8, t, sel, c);
    case 4: return launch_compact<std::uint32_t>(be, p, second, 4, t, sel, c);
    case 2: return launch_compact<std::uint16_t>(be, p, second, 2, t, sel, c);
    default: return launch_compact<std::uint8_t>(be, p, second, 1, t, sel, c);
  }
}

}  // namespace

Status paged_compact_rows(const cuda_backend& be, const PagedRowsView& keys,
                          const PagedRowsView& values, const PagedTables& t,
                          const CsrSelection& sel) {
  if (Status st = check_pool(keys); !st.ok()) return st;
  const bool with_values = values.data != nullptr;
  if (with_values) {
    if (Status st = check_pool(values); !st.ok()) return st;
    if (values.num_blocks != keys.num_blocks || values.layers != keys.layers ||
        values.heads != keys.heads || values.page_size != keys.page_size ||
        values.dim != keys.dim || values.elem_bytes != keys.elem_bytes ||
        values.data == keys.data)
      // Equal element sizes also keep the keys' plan (chunk rows staged in shared memory) valid
      // for the values' launch.
      return detail::invalid("values pool does not match the keys pool (or is the same memory)");
  }
  if (t.requests < 0 || t.max_tokens < 0) return detail::invalid("negative request count");
  if (sel.layers != t.requests * keys.layers || sel.heads != keys.heads)
    return detail::invalid("selection shape differs from requests * layers x heads");
  const CompactPlan c = plan(keys, t);
  if (c.items == 0 || keys.dim == 0) return {};
  if (!keys.data || !t.ids || !t.offsets || !sel.offsets || !sel.indices)
    return detail::invalid("null pointer");
  if (be.workspace_bytes < c.bytes || !be.workspace)
    return {StatusCode::insufficient_workspace, 0,
            "workspace below paged_compact_workspace_bytes"};
  if (reinterpret_cast<std::uintptr_t>(be.workspace) % alignof(unsigned long long) != 0)
    return detail::invalid("workspace is not 8-byte aligned");
  if (2 * c.items > 0x7fffffff) return detail::invalid("too many chunks for one grid");
  const int uk = pick_unit(keys, nullptr);
  if (!with_values) return compact_pools(be, keys, nullptr, uk, t, sel, c);
  const int uv = pick_unit(values, nullptr);
  if (same_geometry(keys, values) && uk == uv)
    return compact_pools(be, keys, values.data, uk, t, sel, c);
  if (Status st = compact_pools(be, keys, nullptr, uk, t, sel, c); !st.ok()) return st;
  return compact_pools(be, values, nullptr, uv, t, sel, c);  // stream order: after the keys
}

Status paged_gather_rows(const cuda_backend& be, const PagedRowsView& p,
                         const std::int32_t* table, std::int64_t length, const RowsView& dst) {
  if (Status st = check_pool(p); !st.ok()) return st;
  if (length < 0) return detail::invalid("negative length");
  if (dst.elem_bytes != p.elem_bytes || dst.layers != p.layers || dst.heads != p.heads ||
      dst.tokens != length || dst.dim != p.dim)
    return detail::invalid("dst shape or element size differs from the request's");
  if (p.layers * p.heads * length * p.dim == 0) return {};
  if (!p.data || !table || !dst.data) return detail::invalid("null pointer");
  if (reinterpret_cast<std::uintptr_t>(dst.data) % p.elem_bytes != 0)
    return detail::invalid("dst pointer is not aligned to its element size");
  switch (pick_unit(p, &dst)) {
    case 16: return launch_gather<uint4>(be, p, 16, table, length, dst);
    case 8: return launch_gather<uint2>(be, p, 8, table, length, dst);
    case 4: return launch_gather<std::uint32_t>(be, p, 4, table, length, dst);
    case 2: return launch_gather<std::uint16_t>(be, p, 2, table, length, dst);
    default: return launch_gather<std::uint8_t>(be, p, 1, table, length, dst);
  }
}

}  // namespace kvpolicy::cuda
