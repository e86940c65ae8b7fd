// CUDA paged gather-compact: typed, throwing host wrappers over paged_plan.hpp (kernels in
// cuda/paged.cu), the device twin of kvpolicy::paged_compact / paged_gather (kvpolicy/paged.hpp).
//
// Split of work: the device moves the rows (bit-identical to paged_compact for each request);
// the host bookkeeping -- new length, per-head lengths, pages used, freed block ids -- needs only
// the selection's row counts (offsets, (L * H + 1) integers per request) and the block table,
// so it stays on the host (paged_bookkeeping; O(L * H + pages) per request). The shared-block
// (prefix-cache) rule of paged_compact needs the kept lists on the host: an engine with shared
// blocks runs paged_shared_conflicts on a host copy of the selection first and calls the device
// compaction only when it is empty.
#pragma once
#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/cuda/compact.hpp"
#include "kvpolicy/cuda/paged_plan.hpp"

namespace kvpolicy::cuda {

template <class T>
PagedRowsView paged_rows_view(const PagedKVView<T>& v) {
  return {const_cast<std::remove_const_t<T>*>(v.data),
          static_cast<int>(sizeof(T)),
          v.num_blocks,
          v.layers,
          v.heads,
          v.page_size,
          v.dim,
          v.stride_layer,
          v.stride_block,
          v.stride_head,
          v.stride_token,
          v.stride_dim};
}

// What kvpolicy::PagedCompactResult reports for a compacted request, from the request's CSR row
// offsets ([L * H + 1], host) and its host block table.
struct PagedBookkeeping {
  std::int64_t new_length = 0;
  std::vector<std::int64_t> lengths;  // [L][H]
  std::int64_t pages_used = 0;
  std::vector<std::int32_t> freed_blocks;  // table entries [pages_used, old pages), table order
};

inline PagedBookkeeping paged_bookkeeping(std::span<const std::int64_t> offsets,
                                          const PagedSequence& seq, std::int64_t page_size) {
  KVP_REQUIRE(!offsets.empty() && page_size >= 1, "paged_bookkeeping: empty offsets or page_size ",
              page_size, " < 1");
  PagedBookkeeping b;
  for (std::size_t r = 0; r + 1 < offsets.size(); ++r) {
    b.lengths.push_back(offsets[r + 1] - offsets[r]);
    b.new_length = std::max(b.new_length, b.lengths.back());
  }
  KVP_REQUIRE(b.new_length <= seq.length, "paged_bookkeeping: a row keeps ", b.new_length,
              " tokens of ", seq.length);
  b.pages_used = (b.new_length + page_size - 1) / page_size;
  for (std::int64_t p = b.pages_used; p < seq.pages(page_size); ++p)
    b.freed_blocks.push_back(seq.block_table[static_cast<std::size_t>(p)]);
  return b;
}

// Shared blocks (flags per block id) the compaction would write, in table order; empty: safe to
// compact. Same rule as kvpolicy::paged_compact. `sel` is the request's selection on the host.
inline std::vector<std::int32_t> paged_shared_conflicts(const Selection& sel,
                                                        const PagedSequence& seq,
                                                        std::int64_t page_size,
                                                        std::span<const std::uint8_t> shared) {
  std::vector<std::int32_t> out;
  if (shared.empty()) return out;
  const std::int64_t P = page_size, pages = seq.pages(P);
  std::vector<char> written(static_cast<std::size_t>(pages), 0);
  for (std::int64_t l = 0; l < sel.layers(); ++l)
    for (std::int64_t h = 0; h < sel.heads(); ++h) {
      const auto kept = sel.kept(l, h);
      std::int64_t m = 0;
      const auto n = static_cast<std::int64_t>(kept.size());
      while (m < n && kept[static_cast<std::size_t>(m)] == m) ++m;
      for (std::int64_t p = m / P; m < n && p <= (n - 1) / P; ++p)
        written[static_cast<std::size_t>(p)] = 1;
    }
  for (std::int64_t p = 0; p < pages; ++p) {
    const std::int32_t b = seq.block_table[static_cast<std::size_t>(p)];
    if (written[static_cast<std::size_t>(p)] && shared[static_cast<std::size_t>(b)])
      out.push_back(b);
  }
  return out;
}

template <Element T>
std::size_t paged_compact_workspace_bytes(const PagedKVView<T>& pool, const PagedTables& tables) {
  return paged_compact_workspace_bytes(paged_rows_view(pool), tables);
}

// In-place compaction of `tables.requests` requests of a device pool (keys and, when
// values.data is set, values). `sel` is a device CSR with layers == requests * pool layers.
// Block tables are trusted (validate(PagedSequence) them on the host); workspace from
// paged_compact_workspace_bytes in be.workspace.
template <Element T>
void paged_compact(const cuda_backend& be, const PagedKVView<T>& keys,
                   const PagedKVView<T>& values, const PagedTables& tables,
                   const CsrSelection& sel) {
  static_assert(!std::is_const_v<T>, "paged_compact writes the pool: pass mutable views");
  validate(keys, "paged_compact: keys");
  KVP_REQUIRE(tables.requests >= 0 && tables.max_tokens >= 0,
              "paged_compact: negative request count or max_tokens");
  require_selection_shape(sel, tables.requests * keys.layers, keys.heads, "paged_compact");
  PagedRowsView vr{};
  if (values.data) {
    validate(values, "paged_compact: values");
    KVP_REQUIRE(values.num_blocks == keys.num_blocks && values.layers == keys.layers &&
                    values.heads == keys.heads && values.page_size == keys.page_size &&
                    values.dim == keys.dim && values.data != keys.data,
                "paged_compact: values pool does not match keys pool (or is the same memory)");
    vr = paged_rows_view(values);
  }
  throw_if_error(paged_compact_rows(be, paged_rows_view(keys), vr, tables, sel),
                 "cuda::paged_compact");
}

// One request's tokens into a dense device view dst [L][H][length][dim] (same element type).
template <Element T, class U>
void paged_gather(const cuda_backend& be, const PagedKVView<T>& src, const std::int32_t* table,
                  std::int64_t length, const KVView<U>& dst) {
  static_assert(std::is_same_v<std::remove_const_t<T>, U>,
                "cuda::paged_gather copies bits: dst has the pool's element type");
  validate(src, "paged_gather: src");
  validate(dst, "paged_gather: dst");
  KVP_REQUIRE(dst.layers == src.layers && dst.heads == src.heads && dst.tokens == length &&
                  dst.dim == src.dim,
              "paged_gather: dst shape [", dst.layers, ",", dst.heads, ",", dst.tokens, ",",
              dst.dim, "] but the sequence is [", src.layers, ",", src.heads, ",", length, ",",
              src.dim, "]");
  throw_if_error(paged_gather_rows(be, paged_rows_view(src), table, length, rows_view(dst)),
                 "cuda::paged_gather");
}

}  // namespace kvpolicy::cuda
