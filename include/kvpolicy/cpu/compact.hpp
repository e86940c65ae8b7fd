// CPU reference gather-compact, in place: row i of each (layer, head) becomes the row of its
// i-th kept token. Kept lists are ascending, so kept[i] >= i and a forward pass never reads a
// row it has already overwritten. Rows past the kept count are left as they were.
// The kept rows are scattered, so the copy is bound by load latency rather than bandwidth: the
// source row kPrefetchRows ahead is prefetched, rows of the usual sizes are copied with a
// compile-time size (inlined vector moves instead of a memcpy call per row), and with rows back
// to back a run of consecutive kept tokens moves as one block.
#pragma once
#include <algorithm>
#include <cstring>
#include <span>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/selection.hpp"
#include "kvpolicy/cpu/parallel.hpp"

namespace kvpolicy::cpu {

inline constexpr std::size_t kPrefetchRows = 8;

namespace detail {

// Forward in-place compaction of one (layer, head) with unit head_dim stride. B is the row size
// in bytes when known at compile time, 0 otherwise.
template <std::size_t B>
void compact_rows(char* base, std::size_t row_bytes, std::size_t stride,
                  std::span<const std::int32_t> kept) {
  const std::size_t n = kept.size(), rb = B ? B : row_bytes;
  const bool dense = stride == rb;  // rows back to back: a run of kept tokens is one block
  auto src = [&](std::size_t k) { return base + static_cast<std::size_t>(kept[k]) * stride; };
  std::size_t i = 0, ahead = 0;
  while (i < n && static_cast<std::size_t>(kept[i]) == i) ++i;  // already in place
  while (i < n) {
    std::size_t j = i + 1;
    if (dense)
      while (j < n && kept[j] == kept[j - 1] + 1) ++j;
    for (ahead = std::max(ahead, j); ahead < std::min(n, j + kPrefetchRows); ++ahead)
      for (std::size_t b = 0; b < rb; b += 64) __builtin_prefetch(src(ahead) + b);
    char* d = base + i * stride;
    if (j - i > 1)
      std::memmove(d, src(i), (j - i) * rb);  // may overlap its own source
    else if constexpr (B != 0)
      std::memcpy(d, src(i), B);
    else
      std::memcpy(d, src(i), rb);
    i = j;
  }
}

// One (layer, head), any strides.
template <class T>
void compact_head(const KVView<T>& kv, std::int64_t l, std::int64_t h,
                  std::span<const std::int32_t> kept) {
  if (kv.stride_dim == 1) {
    char* base = reinterpret_cast<char*>(kv.row(l, h, 0));
    const std::size_t rb = sizeof(T) * static_cast<std::size_t>(kv.dim);
    const std::size_t stride = sizeof(T) * static_cast<std::size_t>(kv.stride_token);
    switch (rb) {
      case 128: return compact_rows<128>(base, rb, stride, kept);
      case 256: return compact_rows<256>(base, rb, stride, kept);
      case 512: return compact_rows<512>(base, rb, stride, kept);
      default: return compact_rows<0>(base, rb, stride, kept);
    }
  }
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const auto src = static_cast<std::int64_t>(kept[i]);
    if (src == static_cast<std::int64_t>(i)) continue;
    T* d = kv.row(l, h, static_cast<std::int64_t>(i));
    const T* s = kv.row(l, h, src);
    for (std::int64_t e = 0; e < kv.dim; ++e) d[e * kv.stride_dim] = s[e * kv.stride_dim];
  }
}

}  // namespace detail

template <class T>
void compact(const cpu_backend& be, const KVView<T>& kv, const Selection& sel) {
  static_assert(!std::is_const_v<T>, "compact writes the cache: pass a mutable view");
  KVP_REQUIRE(sel.layers() == kv.layers && sel.heads() == kv.heads, "compact: selection is [",
              sel.layers(), ",", sel.heads(), "] but the cache has [", kv.layers, ",", kv.heads,
              "] layers x heads");
  sel.validate(kv.tokens);
  // No rows, or rows of no bytes: nothing moves (and the data of an empty view may be null).
  if (kv.tokens == 0 || kv.dim == 0) return;
  parallel_for(be, kv.layers * kv.heads, [&](std::int64_t r) {
    detail::compact_head(kv, r / kv.heads, r % kv.heads, sel.kept(r / kv.heads, r % kv.heads));
  });
}

// Per-token state [layer][head][token] (H2O accumulators, positions, counts), compacted with the
// cache. stride_layer/stride_head in elements; tokens contiguous.
template <class S>
void compact_state(const cpu_backend& be, S* data, std::int64_t stride_layer,
                   std::int64_t stride_head, const Selection& sel) {
  parallel_for(be, sel.layers() * sel.heads(), [&](std::int64_t r) {
    const std::int64_t l = r / sel.heads(), h = r % sel.heads();
    S* row = data + l * stride_layer + h * stride_head;
    auto kept = sel.kept(l, h);
    for (std::size_t i = 0; i < kept.size(); ++i) row[i] = row[kept[i]];
  });
}

}  // namespace kvpolicy::cpu
