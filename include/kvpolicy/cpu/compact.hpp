// CPU reference gather-compact, in place: row i of each (layer, head) becomes the row of its
// i-th kept token. Kept lists are ascending, so kept[i] >= i and a forward pass never reads a
// row it has already overwritten. Rows past the kept count are left as they were.
#pragma once
#include <cstring>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/selection.hpp"
#include "kvpolicy/cpu/parallel.hpp"

namespace kvpolicy::cpu {

template <class T>
void compact(const cpu_backend& be, const KVView<T>& kv, const Selection& sel) {
  static_assert(!std::is_const_v<T>, "compact writes the cache: pass a mutable view");
  KVP_REQUIRE(sel.layers() == kv.layers && sel.heads() == kv.heads, "compact: selection is [",
              sel.layers(), ",", sel.heads(), "] but the cache has [", kv.layers, ",", kv.heads,
              "] layers x heads");
  sel.validate(kv.tokens);
  parallel_for(be, kv.layers * kv.heads, [&](std::int64_t r) {
    const std::int64_t l = r / kv.heads, h = r % kv.heads;
    auto kept = sel.kept(l, h);
    for (std::size_t i = 0; i < kept.size(); ++i) {
      const auto src = static_cast<std::int64_t>(kept[i]);
      if (src == static_cast<std::int64_t>(i)) continue;
      T* d = kv.row(l, h, static_cast<std::int64_t>(i));
      const T* s = kv.row(l, h, src);
      if (kv.stride_dim == 1) {
        std::memcpy(static_cast<void*>(d), static_cast<const void*>(s), sizeof(T) * kv.dim);
      } else {
        for (std::int64_t e = 0; e < kv.dim; ++e) d[e * kv.stride_dim] = s[e * kv.stride_dim];
      }
    }
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
