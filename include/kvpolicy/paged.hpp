// Paged-KV compaction: compress one request of a vLLM / FlashInfer style paged pool in place.
// Kept tokens move to the front of the request's own blocks, in their original order; block ids
// never change and the block table is only truncated, so the engine's block manager stays the
// owner of memory and gets back the ids of the emptied pages (PagedCompactResult::freed_blocks).
//
// Choices an engine must know:
// - Per-head lengths. Per-head budgets (adakv, pyramid, ...) keep different counts per
//   (layer, head), but a page holds a token slot for every head, so the sequence's new length is
//   the largest count and pages are freed up to the longest head. Rows of a head past its own
//   count (PagedCompactResult::lengths, [L][H]) are stale: the engine must mask them in attention
//   (a per-head length, or -inf logits), or the shorter heads attend to leftover tokens.
// - Shared blocks (prefix cache) are read-only. If compaction would write any row of one (a kept
//   token moves to another slot of it), nothing is written for the sequence and the result lists
//   the conflicting blocks; the engine can copy-on-write them into private blocks and retry. A
//   shared block past the new length is simply freed (the engine drops its reference).
// - Order of writes: forward in logical order, as in cpu::compact. kept[i] >= i, so a logical slot
//   is read before any write can reach it; that needs distinct block ids in the table (checked).
// - Every check (shapes, table, selection, NaN/Inf) happens before the first write: on an error,
//   kvpolicy::Error names the argument and the pool is unchanged.
// - Scoring reads a dense copy of the request's keys (paged_gather; L * H * length * dim elements
//   of T, allocated per call and freed before compaction): the policies' kernels work on strided
//   dense views, and a request's tokens are scattered over pages. Values are copied only for a
//   policy that reads them.
#pragma once
#include <algorithm>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/policy.hpp"

namespace kvpolicy {

struct PagedCompactResult {
  bool compacted = false;  // false: nothing was written (see shared_conflicts)
  // The sequence after the call: max kept count over (layer, head). Unchanged (= length) when
  // compacted is false, and so are `lengths` and `pages_used`.
  std::int64_t new_length = 0;
  std::vector<std::int64_t> lengths;  // kept count per (layer, head), row-major [L][H]
  std::int64_t pages_used = 0;  // ceil(new_length / page_size): the table keeps this many entries
  // Block ids of table entries [pages_used, ceil(length / page_size)), in table order.
  std::vector<std::int32_t> freed_blocks;
  // Shared blocks the compaction would have written, in table order (then compacted == false).
  std::vector<std::int32_t> shared_conflicts;
};

namespace detail {

// Checks common to every paged entry point; `shared` is empty or one flag per block id.
template <class T>
void check_paged(const PagedKVView<T>& keys, const PagedKVView<T>& values,
                 const PagedSequence& seq, std::span<const std::uint8_t> shared) {
  validate(keys, "keys");
  if (values.data) {
    validate(values, "values");
    KVP_REQUIRE(values.num_blocks == keys.num_blocks && values.layers == keys.layers &&
                    values.heads == keys.heads && values.page_size == keys.page_size &&
                    values.dim == keys.dim,
                "values pool [blocks=", values.num_blocks, ", layers=", values.layers,
                ", heads=", values.heads, ", page_size=", values.page_size, ", dim=", values.dim,
                "] does not match keys pool [blocks=", keys.num_blocks, ", layers=", keys.layers,
                ", heads=", keys.heads, ", page_size=", keys.page_size, ", dim=", keys.dim, "]");
    // The same pool twice would be compacted twice.
    KVP_REQUIRE(values.data != keys.data, "values: same memory as keys");
  }
  validate(seq, keys.page_size, keys.num_blocks, "seq");
  KVP_REQUIRE(shared.empty() || static_cast<std::int64_t>(shared.size()) == keys.num_blocks,
              "shared: ", shared.size(), " flags for a pool of ", keys.num_blocks,
              " blocks (give none, or one per block id)");
}

// Kept rows before the first one that moves are already in place; from there on every kept row
// moves (kept is strictly ascending, so kept[i] > i implies kept[i + 1] > i + 1).
inline std::size_t first_moved(std::span<const std::int32_t> kept) {
  std::size_t i = 0;
  while (i < kept.size() && static_cast<std::size_t>(kept[i]) == i) ++i;
  return i;
}

// Forward in-place compaction of one (layer, head) of a paged sequence.
template <class T>
void compact_paged_row(const PagedKVView<T>& v, std::span<const std::int32_t> table,
                       std::int64_t l, std::int64_t h, std::span<const std::int32_t> kept) {
  const std::int64_t P = v.page_size;
  auto slot = [&](std::int64_t t) {
    return v.row(l, table[static_cast<std::size_t>(t / P)], h, t % P);
  };
  const auto rb = sizeof(T) * static_cast<std::size_t>(v.dim);
  for (std::size_t i = first_moved(kept); i < kept.size(); ++i) {
    T* d = slot(static_cast<std::int64_t>(i));
    const T* s = slot(kept[i]);
    if (v.stride_dim == 1)
      std::memcpy(d, s, rb);  // distinct slots of distinct blocks: rows never overlap
    else
      for (std::int64_t e = 0; e < v.dim; ++e) d[e * v.stride_dim] = s[e * v.stride_dim];
  }
}

}  // namespace detail

// Copies a sequence's tokens into a dense view dst [L][H][length][dim] (any strides), converting
// the element type if U differs from T (e.g. a half pool into fp32 for scoring). dst must not
// overlap the pool.
template <class T, class U>
void paged_gather(const cpu_backend& be, const PagedKVView<const T>& src, const PagedSequence& seq,
                  const KVView<U>& dst) {
  static_assert(!std::is_const_v<U>, "paged_gather writes dst: pass a mutable view");
  validate(src, "src");
  validate(seq, src.page_size, src.num_blocks, "seq");
  validate(dst, "dst");
  KVP_REQUIRE(dst.layers == src.layers && dst.heads == src.heads && dst.tokens == seq.length &&
                  dst.dim == src.dim,
              "dst: shape [", dst.layers, ",", dst.heads, ",", dst.tokens, ",", dst.dim,
              "] but the sequence is [", src.layers, ",", src.heads, ",", seq.length, ",",
              src.dim, "]");
  const std::int64_t P = src.page_size;
  cpu::parallel_for(be, src.layers * src.heads, [&](std::int64_t r) {
    const std::int64_t l = r / src.heads, h = r % src.heads;
    for (std::int64_t t = 0; t < seq.length; ++t) {
      const T* s = src.row(l, seq.block_table[static_cast<std::size_t>(t / P)], h, t % P);
      U* d = dst.row(l, h, t);
      if constexpr (std::is_same_v<std::remove_const_t<T>, U>) {
        if (src.stride_dim == 1 && dst.stride_dim == 1) {
          std::memcpy(d, s, sizeof(U) * static_cast<std::size_t>(src.dim));
          continue;
        }
        for (std::int64_t e = 0; e < src.dim; ++e) d[e * dst.stride_dim] = s[e * src.stride_dim];
      } else {
        for (std::int64_t e = 0; e < src.dim; ++e)
          d[e * dst.stride_dim] = from_float<U>(to_float(s[e * src.stride_dim]));
      }
    }
  });
}
// The same from a mutable pool view (template deduction does not see the conversion to const).
template <class T, class U>
  requires(!std::is_const_v<T>)
void paged_gather(const cpu_backend& be, const PagedKVView<T>& src, const PagedSequence& seq,
                  const KVView<U>& dst) {
  paged_gather(be, PagedKVView<const T>(src), seq, dst);
}

// In-place paged compaction: row i of each (layer, head) becomes the row of its i-th kept token,
// inside the sequence's own blocks. `values` may have data == nullptr (keys only). `shared`:
// empty, or one flag per block id (nonzero = read-only, e.g. a prefix-cache block); see the
// header comment for the rule. Throws kvpolicy::Error before any write on bad input.
template <class T>
PagedCompactResult paged_compact(const cpu_backend& be, const PagedKVView<T>& keys,
                                 const PagedKVView<T>& values, const PagedSequence& seq,
                                 const Selection& sel, std::span<const std::uint8_t> shared = {}) {
  static_assert(!std::is_const_v<T>, "paged_compact writes the pool: pass mutable views");
  detail::check_paged(keys, values, seq, shared);
  const std::int64_t L = keys.layers, H = keys.heads, P = keys.page_size;
  KVP_REQUIRE(sel.layers() == L && sel.heads() == H, "selection: [", sel.layers(), ",",
              sel.heads(), "] layers x heads but the pool has [", L, ",", H, "]");
  sel.validate(seq.length);

  PagedCompactResult res;
  const std::int64_t old_pages = seq.pages(P);
  res.lengths.resize(static_cast<std::size_t>(L * H));
  for (std::int64_t r = 0; r < L * H; ++r) {
    res.lengths[static_cast<std::size_t>(r)] = sel.count(r / H, r % H);
    res.new_length = std::max(res.new_length, res.lengths[static_cast<std::size_t>(r)]);
  }
  res.pages_used = (res.new_length + P - 1) / P;

  if (!shared.empty()) {
    // Rows written by a (layer, head) are the logical slots [first_moved, count).
    std::vector<char> written(static_cast<std::size_t>(old_pages), 0);
    for (std::int64_t r = 0; r < L * H; ++r) {
      const auto kept = sel.kept(r / H, r % H);
      const auto m = static_cast<std::int64_t>(detail::first_moved(kept));
      const auto n = static_cast<std::int64_t>(kept.size());
      for (std::int64_t p = m / P; m < n && p <= (n - 1) / P; ++p)
        written[static_cast<std::size_t>(p)] = 1;
    }
    for (std::int64_t p = 0; p < old_pages; ++p) {
      const std::int32_t b = seq.block_table[static_cast<std::size_t>(p)];
      if (written[static_cast<std::size_t>(p)] && shared[static_cast<std::size_t>(b)])
        res.shared_conflicts.push_back(b);
    }
    if (!res.shared_conflicts.empty()) {  // the sequence stays exactly as it was
      res.new_length = seq.length;
      std::fill(res.lengths.begin(), res.lengths.end(), seq.length);
      res.pages_used = old_pages;
      return res;
    }
  }

  cpu::parallel_for(be, L * H, [&](std::int64_t r) {
    const auto kept = sel.kept(r / H, r % H);
    detail::compact_paged_row(keys, seq.block_table, r / H, r % H, kept);
    if (values.data) detail::compact_paged_row(values, seq.block_table, r / H, r % H, kept);
  });
  res.compacted = true;
  for (std::int64_t p = res.pages_used; p < old_pages; ++p)
    res.freed_blocks.push_back(seq.block_table[static_cast<std::size_t>(p)]);
  return res;
}

struct PagedCompressResult {
  Selection selection;
  PagedCompactResult compact;
};

namespace detail {

// Paged compaction only moves rows: merged K/V (log_count) and packed blocks need a Session.
inline void require_selection_only(const Policy& policy, std::string_view fn) {
  KVP_REQUIRE(!policy.merger(), fn, ": policy '", policy.spec(),
              "' has a merger stage, which needs a Session (merged K/V carry log_count); paged "
              "compaction only keeps or evicts tokens");
  KVP_REQUIRE(!policy.quantizer(), fn, ": policy '", policy.spec(), "' has a quantizer stage ('",
              policy.quantizer_name(), "'), which needs a Session (packed blocks); paged "
              "compaction only keeps or evicts tokens");
}

// The selection compress_paged would make; reads the pool, writes nothing to it. Checks NaN/Inf
// of keys and values in place (values even if the policy does not read them, as Policy::compress
// does), then gathers what the policy reads into a dense HND copy and selects on it.
template <Element T>
Selection select_paged(const Policy& policy, const cpu_backend& be, const PagedKVView<T>& keys,
                       const PagedKVView<T>& values, const PagedSequence& seq,
                       const KVView<const T>& queries, const Budget& budget) {
  using E = std::remove_const_t<T>;
  check_paged(keys, values, seq, {});
  const bool need_values = has(policy.needs(), Needs::values);
  KVP_REQUIRE(!need_values || values.data, "values: policy '", policy.spec(),
              "' reads values but none were given");
  require_finite(keys, seq, "keys");
  if (values.data) require_finite(values, seq, "values");
  if (queries.data) {
    validate(queries, "queries");
    require_finite(queries, "queries");
  }
  const std::int64_t L = keys.layers, H = keys.heads, N = seq.length, D = keys.dim;
  std::vector<E> k(static_cast<std::size_t>(L * H * N * D)), v;
  paged_gather(be, PagedKVView<const T>(keys), seq, KVView<E>::hnd(k.data(), L, H, N, D));
  Inputs<E> in;
  in.keys = KVView<const E>::hnd(k.data(), L, H, N, D);
  if (need_values) {
    v.resize(k.size());
    paged_gather(be, PagedKVView<const T>(values), seq, KVView<E>::hnd(v.data(), L, H, N, D));
    in.values = KVView<const E>::hnd(v.data(), L, H, N, D);
  }
  in.queries = queries;
  return policy.select(be, in, budget);
}

}  // namespace detail

// Policy-level paged compression of one request: select with `policy` and `budget` on what the
// policy reads (queries: the request's last queries, dense [L][Hq][n][d], may be empty), then
// paged_compact. Policies with a merger or a quantizer stage are rejected. NaN/Inf in keys,
// values or queries is rejected before any write. The selection equals policy.select on a dense
// copy of the request (paged_gather).
template <Element T>
PagedCompressResult compress_paged(const Policy& policy, const cpu_backend& be,
                                   const PagedKVView<T>& keys, const PagedKVView<T>& values,
                                   const PagedSequence& seq,
                                   const KVView<const std::type_identity_t<T>>& queries,
                                   const Budget& budget,
                                   std::span<const std::uint8_t> shared = {}) {
  detail::require_selection_only(policy, "compress_paged");
  detail::check_paged(keys, values, seq, shared);
  PagedCompressResult out;
  out.selection = detail::select_paged(policy, be, keys, values, seq, queries, budget);
  out.compact = paged_compact(be, keys, values, seq, out.selection, shared);
  return out;
}

}  // namespace kvpolicy
