// CPU reference gather-compact, in place: row i of each (layer, head) becomes the row of its
// i-th kept token. Kept lists are ascending, so kept[i] >= i and a forward pass never reads a
// row it has already overwritten. Rows past the kept count are left as they were.
// The kept rows are scattered, so the copy is bound by load latency rather than bandwidth: the
// source row kPrefetchRows ahead is prefetched, rows of the usual sizes are copied with a
// compile-time size (inlined vector moves instead of a memcpy call per row), and with rows back
// to back a run of consecutive kept tokens moves as one block.
// Large compactions (more than kStreamBytes written by one call, rows back to back) write with
// non-temporal stores instead (x86): a normal store first reads the destination line from
// memory (write-allocate), so a compaction whose destination is not in cache moves 3 bytes per
// byte kept where memcpy (`rep movsb`, which skips that read) moves 2. See stream_rows.
// compact(be, keys, values, sel) does K and V in one parallel region: one wake-up of the
// backend's threads instead of two, which is a third of the time of a small compaction.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVP_COMPACT_STREAM 1
#endif

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/selection.hpp"
#include "kvpolicy/core/parallel.hpp"

namespace kvpolicy::cpu {

inline constexpr std::size_t kPrefetchRows = 8;

// Bytes written by one compact() call above which dense rows are written with non-temporal
// stores. Below, the destination usually is in cache (it was written or read a moment ago) and
// stays there for the attention that reads it next: cached stores are faster (kvpolicy_bench,
// 8 KV heads, d = 128, 20% kept: at T=4096, 3.4 / 6.7 MB, 0.75 / 0.83 of memcpy cached against
// 0.40 streamed; at T=32768 fp16, 27 MB, still 0.73-0.77 cached against 0.58-0.70 streamed).
// Above, the rows written do not stay in a typical L3 (tens of MiB shared by every core) and
// streaming saves the write-allocate read (T=32768 fp32, 54 MB: 0.63-0.66 -> 0.72-0.75 of
// memcpy with the caches evicted). Measured on a loaded 2-core VM: the crossover is rough.
inline constexpr std::size_t kStreamBytes = std::size_t{32} << 20;

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

#if defined(KVP_COMPACT_STREAM)
// Whether stream_rows can take rows of rb bytes at base (dense rows).
inline bool can_stream(const char* base, std::size_t rb) {
  return rb % 16 == 0 && reinterpret_cast<std::uintptr_t>(base) % 16 == 0;
}

// compact_rows for dense rows (stride = rb, a multiple of 16; base 16-byte aligned) with
// non-temporal stores, row after row, 16 bytes at a time. The destination is written in address
// order, so a cache line that a row boundary splits (rows start at any multiple of 16 bytes,
// e.g. 16 past a page for a large malloc) is completed by the next row's first stores while its
// write-combining buffer is still open. (Assembling whole lines from two source rows instead
// measured slower: the per-chunk bookkeeping costs more than it saves.) Every source row lies
// past the destination written so far (kept[r] > r once a row moved), so nothing is read after
// it is overwritten. The final sfence orders the streamed stores before whatever the caller
// does next (another thread reads these rows after the parallel region).
inline void stream_rows(char* base, std::size_t rb, std::span<const std::int32_t> kept) {
  const std::size_t n = kept.size();
  std::size_t i0 = 0;
  while (i0 < n && static_cast<std::size_t>(kept[i0]) == i0) ++i0;  // already in place
  if (i0 == n) return;
  auto src = [&](std::size_t r) { return base + static_cast<std::size_t>(kept[r]) * rb; };
  std::size_t ahead = i0;  // rows below it have been prefetched
  auto prefetch_to = [&](std::size_t r) {
    for (r = std::min(n, r); ahead < r; ++ahead)
      for (std::size_t b = 0; b < rb; b += 64) __builtin_prefetch(src(ahead) + b);
  };
  prefetch_to(i0 + kPrefetchRows);
  for (std::size_t r = i0; r < n; ++r) {
    prefetch_to(r + kPrefetchRows);
    const char* s = src(r);
    char* d = base + r * rb;
    std::size_t b = 0;
    for (; b + 64 <= rb; b += 64) {
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b));
      const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b + 16));
      const __m128i x2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b + 32));
      const __m128i x3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + b), x0);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + b + 16), x1);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + b + 32), x2);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + b + 48), x3);
    }
    for (; b < rb; b += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + b),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
  }
  _mm_sfence();
}
#endif

// One (layer, head), any strides. stream: use stream_rows where the rows allow it.
template <class T>
void compact_head(const KVView<T>& kv, std::int64_t l, std::int64_t h,
                  std::span<const std::int32_t> kept, bool stream = false) {
  if (kv.stride_dim == 1) {
    char* base = reinterpret_cast<char*>(kv.row(l, h, 0));
    const std::size_t rb = sizeof(T) * static_cast<std::size_t>(kv.dim);
    const std::size_t stride = sizeof(T) * static_cast<std::size_t>(kv.stride_token);
#if defined(KVP_COMPACT_STREAM)
    if (stream && stride == rb && can_stream(base, rb)) return stream_rows(base, rb, kept);
#else
    (void)stream;
#endif
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

template <class T>
void check_compact(const KVView<T>& kv, const Selection& sel) {
  static_assert(!std::is_const_v<T>, "compact writes the cache: pass a mutable view");
  KVP_REQUIRE(sel.layers() == kv.layers && sel.heads() == kv.heads, "compact: selection is [",
              sel.layers(), ",", sel.heads(), "] but the cache has [", kv.layers, ",", kv.heads,
              "] layers x heads");
  sel.validate(kv.tokens);
}

// Bytes one view's compaction writes (the kept rows).
template <class T>
std::size_t compact_bytes(const KVView<T>& kv, const Selection& sel) {
  return static_cast<std::size_t>(sel.total()) * static_cast<std::size_t>(kv.dim) * sizeof(T);
}

}  // namespace detail

template <class T>
void compact(const cpu_backend& be, const KVView<T>& kv, const Selection& sel) {
  detail::check_compact(kv, sel);
  // No rows, or rows of no bytes: nothing moves (and the data of an empty view may be null).
  if (kv.tokens == 0 || kv.dim == 0) return;
  const bool stream = detail::compact_bytes(kv, sel) > kStreamBytes;
  parallel_for(be, kv.layers * kv.heads, [&](std::int64_t r) {
    detail::compact_head(kv, r / kv.heads, r % kv.heads, sel.kept(r / kv.heads, r % kv.heads),
                         stream);
  });
}

// Keys and values with the same selection, in one parallel region (the same result as two
// compact() calls). Both views are checked before either is written.
template <class T>
void compact(const cpu_backend& be, const KVView<T>& keys, const KVView<T>& values,
             const Selection& sel) {
  detail::check_compact(keys, sel);
  detail::check_compact(values, sel);
  const bool k_rows = keys.tokens > 0 && keys.dim > 0, v_rows = values.tokens > 0 && values.dim > 0;
  if (!k_rows && !v_rows) return;
  const bool stream = (k_rows ? detail::compact_bytes(keys, sel) : 0) +
                          (v_rows ? detail::compact_bytes(values, sel) : 0) >
                      kStreamBytes;
  const std::int64_t rows = sel.layers() * sel.heads();
  parallel_for(be, 2 * rows, [&](std::int64_t i) {
    const bool is_key = i < rows;
    if (!(is_key ? k_rows : v_rows)) return;
    const KVView<T>& kv = is_key ? keys : values;
    const std::int64_t r = is_key ? i : i - rows;
    detail::compact_head(kv, r / kv.heads, r % kv.heads, sel.kept(r / kv.heads, r % kv.heads),
                         stream);
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
