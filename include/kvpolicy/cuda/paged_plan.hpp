// Paged gather-compact on the GPU: the type-erased entry points (cuda/paged.cu) and the
// per-thread logic the kernels run, as KVP_HD functions on raw arrays. Free of CUDA and Eigen
// headers, so the CPU tests drive exactly these functions in a host loop that emulates the grid
// (tests/agreement/test_paged.cpp) and the CPU paged code could share the address math.
//
// Addressing: a token t of a request lives in logical page t / page_size, i.e. block
// table[t / page_size], slot t % page_size; the row of (layer, head) there starts at
//   layer * stride_layer + block * stride_block + head * stride_head + slot * stride_token
// (PagedKVView::row), in copy units here (the kernels move bits: 16, 8, 4, 2 or 1 bytes).
//
// In-place order. Compaction writes logical slot i from slot kept[i] >= i (the kept list is
// strictly ascending), through the request's own distinct blocks, so the logical-slot map is a
// bijection and the hazard is the dense one: a row may be overwritten before it was read.
// cuda/compact.cu serialises a (layer, head) row inside one thread block; a paged pool of one
// request has few rows (8 KV heads x layers), so here a row is split into chunks of C kept
// tokens, one thread block per chunk. A chunk stages its C source rows in shared memory (all
// reads), publishes a "read" flag, then writes its destinations [jC, jC + C). The only chunks
// reading a destination slot of chunk j are chunks j' <= j (kept[i] >= i), found by two binary
// searches on kept (paged_chunk_waits); chunk j waits for their flags before writing. Blocks
// take their chunk from an atomic ticket, so every chunk waited on started earlier and never
// waits on a later one: no deadlock whatever the scheduler does.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/config.hpp"
#include "kvpolicy/cuda/csr.hpp"
#include "kvpolicy/cuda/launch.hpp"
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

// ---- type-erased entry points -----------------------------------------------------------------

// A PagedKVView with its element type erased. Extents and strides in elements.
struct PagedRowsView {
  void* data = nullptr;
  int elem_bytes = 0;  // 1, 2, 4, 8 or 16
  std::int64_t num_blocks = 0, layers = 0, heads = 0, page_size = 0, dim = 0;
  std::int64_t stride_layer = 0, stride_block = 0, stride_head = 0, stride_token = 0,
               stride_dim = 1;
};

// Block tables of R requests in device memory: request q's table is
// ids[offsets[q] .. offsets[q + 1]) (logical page -> block id; distinct ids within a request,
// enough pages for its length: validate(PagedSequence) on the host; no block in two requests).
// `max_tokens` bounds every
// request's kept count (e.g. the longest length); it sizes the grid.
struct PagedTables {
  const std::int32_t* ids = nullptr;
  const std::int64_t* offsets = nullptr;  // [requests + 1]
  std::int64_t requests = 0;
  std::int64_t max_tokens = 0;
};

// Workspace (the ticket counter and a flag per chunk of each pool) for paged_compact_rows.
std::size_t paged_compact_workspace_bytes(const PagedRowsView& pool, const PagedTables& tables);

// Row i of every (request, layer, head) becomes the row of its i-th kept token, inside the
// request's own blocks, in the keys pool and (when values.data is set) the values pool; rows
// already in place (kept[i] == i) and rows past the kept count are not written. `sel` is a
// device CSR over rows ((q * layers + l) * heads + h), i.e. sel.layers == requests * layers, each
// row ascending and below the request's length (trusted, as select() writes it). Pools of one
// geometry are compacted in one launch. Bit-identical to kvpolicy::paged_compact of each request
// (without shared blocks: the shared-block check needs the selection on the host, see paged.hpp).
Status paged_compact_rows(const cuda_backend& be, const PagedRowsView& keys,
                          const PagedRowsView& values, const PagedTables& tables,
                          const CsrSelection& sel);

// Copies one request's tokens (device block table `table`, `length` tokens) into the dense rows
// `dst` [layers][heads][length][dim] (same element size, any strides; must not overlap the pool).
Status paged_gather_rows(const cuda_backend& be, const PagedRowsView& pool,
                         const std::int32_t* table, std::int64_t length, const RowsView& dst);

// ---- per-thread logic (KVP_HD) ----------------------------------------------------------------

// Pool geometry in copy units.
struct PagedGeometry {
  std::int64_t layers = 0, heads = 0, page_size = 1;
  std::int64_t stride_layer = 0, stride_block = 0, stride_head = 0, stride_token = 0,
               stride_col = 1;
  std::int64_t row_units = 0;  // copy units per token row
};

// Offset (in units) of unit c of token t's row of (l, h), through block table `table`.
KVP_HD inline std::int64_t paged_offset(const PagedGeometry& g, const std::int32_t* table,
                                        std::int64_t l, std::int64_t h, std::int64_t t,
                                        std::int64_t c) {
  const std::int64_t page = t / g.page_size;
  return l * g.stride_layer + static_cast<std::int64_t>(table[page]) * g.stride_block +
         h * g.stride_head + (t - page * g.page_size) * g.stride_token + c * g.stride_col;
}

// First i in [0, n) with kept[i] >= x (n if none); kept ascending.
KVP_HD inline std::int64_t paged_lower_bound(const std::int32_t* kept, std::int64_t n,
                                             std::int64_t x) {
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (kept[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Chunks [first, last] of the same row (empty when first > last) whose reads must finish before
// chunk j (kept tokens [jC, min(jC + C, n))) writes: the earlier chunks holding a kept token whose
// source slot is one of chunk j's destinations.
struct ChunkRange {
  std::int64_t first = 0, last = -1;
};
KVP_HD inline ChunkRange paged_chunk_waits(const std::int32_t* kept, std::int64_t n,
                                           std::int64_t C, std::int64_t j) {
  const std::int64_t d0 = j * C, d1 = (d0 + C < n) ? d0 + C : n;
  const std::int64_t lo = paged_lower_bound(kept, n, d0);  // first reader of slot >= d0
  const std::int64_t hi = paged_lower_bound(kept, n, d1);  // first reader of slot >= d1
  ChunkRange r;
  if (lo >= hi) return r;
  r.first = lo / C;
  r.last = (hi - 1) / C < j - 1 ? (hi - 1) / C : j - 1;  // chunk j orders its own reads
  return r;
}

// Work item w (one thread block of the compaction grid): chunk j of row
// ((q * layers + l) * heads + h), kept tokens [t0, t0 + nt) of the row's n.
struct PagedItem {
  std::int64_t row = 0, j = 0, q = 0, l = 0, h = 0, n = 0, t0 = 0, nt = 0;
  const std::int32_t* table = nullptr;  // request q's block table
  const std::int32_t* kept = nullptr;   // the row's kept list
  bool moves = false;  // some row of the chunk moves (kept[i] == i holds exactly on a prefix)
};
KVP_HD inline PagedItem paged_item(const PagedGeometry& g, std::int64_t w,
                                   std::int64_t chunks_per_row, std::int64_t chunk_tokens,
                                   const std::int32_t* ids, const std::int64_t* table_offsets,
                                   const std::int64_t* offsets, const std::int32_t* indices) {
  PagedItem it;
  it.row = w / chunks_per_row;
  it.j = w - it.row * chunks_per_row;
  const std::int64_t lh = g.layers * g.heads;
  it.q = it.row / lh;
  it.l = (it.row - it.q * lh) / g.heads;
  it.h = it.row % g.heads;
  it.table = ids + table_offsets[it.q];
  const std::int64_t begin = offsets[it.row];
  it.n = offsets[it.row + 1] - begin;
  it.kept = indices + begin;
  it.t0 = it.j * chunk_tokens;
  it.nt = it.t0 < it.n ? (it.n - it.t0 < chunk_tokens ? it.n - it.t0 : chunk_tokens) : 0;
  it.moves = it.nt > 0 && it.kept[it.t0 + it.nt - 1] != it.t0 + it.nt - 1;
  return it;
}

// What one thread block does for one chunk, split at the flag handshake; `e` is the unit index
// in the chunk, e in [0, nt * row_units) with nt = min(C, n - t0).
// Read: tile[e] = unit c of source row kept[t0 + i].
template <class U>
KVP_HD inline void paged_chunk_read(const PagedGeometry& g, const U* pool,
                                    const std::int32_t* table, std::int64_t l, std::int64_t h,
                                    const std::int32_t* kept, std::int64_t t0, std::int64_t e,
                                    U* tile) {
  const std::int64_t i = e / g.row_units, c = e - i * g.row_units;
  tile[e] = pool[paged_offset(g, table, l, h, kept[t0 + i], c)];
}
// Write: unit c of destination row t0 + i = tile[e], unless the row is already in place.
template <class U>
KVP_HD inline void paged_chunk_write(const PagedGeometry& g, U* pool, const std::int32_t* table,
                                     std::int64_t l, std::int64_t h, const std::int32_t* kept,
                                     std::int64_t t0, std::int64_t e, const U* tile) {
  const std::int64_t i = e / g.row_units, c = e - i * g.row_units;
  if (kept[t0 + i] == t0 + i) return;  // the in-place prefix: never written (shared blocks)
  pool[paged_offset(g, table, l, h, t0 + i, c)] = tile[e];
}

// Gather: unit `e` of the dense copy, e in [0, layers * heads * length * row_units); the dense
// side's strides in units.
struct DenseUnits {
  std::int64_t stride_layer = 0, stride_head = 0, stride_token = 0, stride_col = 1;
};
template <class U>
KVP_HD inline void paged_gather_unit(const PagedGeometry& g, const U* pool,
                                     const std::int32_t* table, std::int64_t length,
                                     const DenseUnits& d, U* dst, std::int64_t e) {
  const std::int64_t c = e % g.row_units;
  std::int64_t r = e / g.row_units;
  const std::int64_t t = r % length;
  r /= length;
  const std::int64_t h = r % g.heads, l = r / g.heads;
  dst[l * d.stride_layer + h * d.stride_head + t * d.stride_token + c * d.stride_col] =
      pool[paged_offset(g, table, l, h, t, c)];
}

// Kept tokens per chunk: as many rows as fit in `smem_bytes` of shared memory, at most 128.
inline std::int64_t paged_chunk_tokens(std::int64_t row_bytes, std::int64_t smem_bytes) {
  std::int64_t c = row_bytes > 0 ? smem_bytes / row_bytes : 128;
  return c < 1 ? 1 : (c > 128 ? 128 : c);
}

}  // namespace kvpolicy::cuda
