// PagedKVView<T>: non-owning view of a paged KV pool (vLLM / FlashInfer style): fixed-size pages
// (blocks) of page_size tokens, shared by all sequences and addressed through a per-sequence
// block table (PagedSequence). Strides are in elements, so NHD pages (vLLM), HND pages
// (FlashInfer's HND) and padded pools are all one view. Trivially copyable.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/kv_view.hpp"

namespace kvpolicy {

template <class T>
struct PagedKVView {
  T* data = nullptr;            // base of the pool
  std::int64_t num_blocks = 0;  // block ids are in [0, num_blocks)
  std::int64_t layers = 0, heads = 0, page_size = 0, dim = 0;
  std::int64_t stride_layer = 0, stride_block = 0, stride_head = 0, stride_token = 0,
               stride_dim = 1;

  // Contiguous [layer][block][token][head][dim] (NHD pages, as vLLM stores them).
  static PagedKVView nhd(T* p, std::int64_t num_blocks, std::int64_t layers, std::int64_t heads,
                         std::int64_t page_size, std::int64_t dim) {
    const std::int64_t page = page_size * heads * dim;
    return {p, num_blocks, layers, heads, page_size, dim,
            num_blocks * page, page, dim, heads * dim, 1};
  }
  // Contiguous [layer][block][head][token][dim] (HND pages, FlashInfer's HND layout).
  static PagedKVView hnd(T* p, std::int64_t num_blocks, std::int64_t layers, std::int64_t heads,
                         std::int64_t page_size, std::int64_t dim) {
    const std::int64_t page = heads * page_size * dim;
    return {p, num_blocks, layers, heads, page_size, dim,
            num_blocks * page, page, page_size * dim, dim, 1};
  }
  static PagedKVView make(Layout lay, T* p, std::int64_t num_blocks, std::int64_t layers,
                          std::int64_t heads, std::int64_t page_size, std::int64_t dim) {
    return lay == Layout::HND ? hnd(p, num_blocks, layers, heads, page_size, dim)
                              : nhd(p, num_blocks, layers, heads, page_size, dim);
  }

  // The row of (layer, head) in slot `slot` of block `block`.
  KVP_HD T* row(std::int64_t layer, std::int64_t block, std::int64_t head,
                std::int64_t slot) const {
    return data + layer * stride_layer + block * stride_block + head * stride_head +
           slot * stride_token;
  }
  operator PagedKVView<const T>() const  // NOLINT: implicit view-to-const like std::span
    requires(!std::is_const_v<T>)
  {
    return {data,         num_blocks,   layers,      heads,        page_size,  dim,
            stride_layer, stride_block, stride_head, stride_token, stride_dim};
  }
};

// Checks extents and strides like validate(KVView): non-negative extents and strides, and no two
// elements of the pool aliasing each other (in-place compaction relies on distinct rows).
template <class T>
void validate(const PagedKVView<T>& v, std::string_view what) {
  KVP_REQUIRE(v.num_blocks >= 0 && v.layers >= 0 && v.heads >= 0 && v.page_size >= 0 &&
                  v.dim >= 0,
              what, ": negative extent (num_blocks=", v.num_blocks, ", layers=", v.layers,
              ", heads=", v.heads, ", page_size=", v.page_size, ", dim=", v.dim, ")");
  KVP_REQUIRE(v.page_size > 0, what, ": page_size must be >= 1");
  const std::int64_t ext[5] = {v.layers, v.num_blocks, v.heads, v.page_size, v.dim};
  detail::require_addressable(ext, sizeof(T), what);
  const std::int64_t str[5] = {v.stride_layer, v.stride_block, v.stride_head, v.stride_token,
                               v.stride_dim};
  const char* const names[5] = {"layer", "block", "head", "token", "dim"};
  for (int i = 0; i < 5; ++i)
    KVP_REQUIRE(str[i] >= 0, what, ": negative ", names[i], " stride ", str[i]);
  if (v.layers == 0 || v.num_blocks == 0 || v.heads == 0 || v.dim == 0) return;
  KVP_REQUIRE(v.data != nullptr, what, ": null data pointer");
  detail::require_no_overlap(ext, str, names, what);
}

// One sequence (request) in the pool.
struct PagedSequence {
  std::span<const std::int32_t> block_table;  // logical page i -> block id
  std::int64_t length = 0;  // tokens; needs ceil(length / page_size) <= block_table.size()

  std::int64_t pages(std::int64_t page_size) const {
    return (length + page_size - 1) / page_size;
  }
};

// Checks the table: enough pages for `length`, ids in [0, num_blocks), no id twice (two logical
// pages on one block would make in-place compaction read rows it has overwritten). Only the
// first ceil(length / page_size) entries are read: engines pad their block tables (vLLM pads a
// batch's tables with 0), and entries past the sequence's pages are never touched.
inline void validate(const PagedSequence& s, std::int64_t page_size, std::int64_t num_blocks,
                     std::string_view what) {
  KVP_REQUIRE(page_size >= 1, what, ": page_size must be >= 1, got ", page_size);
  KVP_REQUIRE(s.length >= 0, what, ": negative length ", s.length);
  KVP_REQUIRE(s.length <= std::numeric_limits<std::int32_t>::max(), what, ": length ", s.length,
              " exceeds the int32 index range");
  const std::int64_t pages = s.pages(page_size);
  KVP_REQUIRE(static_cast<std::int64_t>(s.block_table.size()) >= pages, what, ": block table has ",
              s.block_table.size(), " entries but length ", s.length, " needs ", pages,
              " pages of ", page_size);
  std::vector<std::int32_t> seen(s.block_table.begin(), s.block_table.begin() + pages);
  for (std::int64_t i = 0; i < pages; ++i) {
    const std::int32_t b = seen[static_cast<std::size_t>(i)];
    KVP_REQUIRE(b >= 0 && b < num_blocks, what, ": block table entry ", i, " is block ", b,
                ", outside [0, ", num_blocks, ")");
  }
  std::sort(seen.begin(), seen.end());
  const auto dup = std::adjacent_find(seen.begin(), seen.end());
  KVP_REQUIRE(dup == seen.end(), what, ": block ", dup == seen.end() ? 0 : *dup,
              " appears twice in the block table (every logical page needs its own block)");
}

// Checks that the sequence's rows of the pool hold only finite numbers (what require_finite does
// for a dense view; the token in the message is the logical position).
template <class T>
void require_finite(const PagedKVView<T>& v, const PagedSequence& s, std::string_view what) {
  if (v.layers == 0 || v.heads == 0 || s.length == 0 || v.dim == 0) return;  // see KVView's
  for (std::int64_t l = 0; l < v.layers; ++l)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t t = 0; t < s.length; ++t) {
        const std::int32_t b = s.block_table[static_cast<std::size_t>(t / v.page_size)];
        const T* r = v.row(l, b, h, t % v.page_size);
        for (std::int64_t i = 0; i < v.dim; ++i) {
          const float x = to_float(r[i * v.stride_dim]);
          KVP_REQUIRE(std::isfinite(x), what, " contains a non-finite value (", x, ") at layer ",
                      l, ", head ", h, ", token ", t, " (block ", b, ", slot ",
                      t % v.page_size, "), dim ", i);
        }
      }
}

}  // namespace kvpolicy
