// Batched compression: one policy over several sequences (requests), dense or in one paged pool.
//
// All or nothing: every sequence is checked, then every selection is made (selection only reads
// the caches), and only then is anything compacted. So a bad sequence, a budget below what the
// policy protects, or a scorer that rejects its inputs (too few queries, ...) throws
// kvpolicy::Error naming the sequence ("sequence 2: ...") and leaves the whole batch untouched.
// Paged shared-block conflicts are not errors: that request's result says compacted == false and
// the other requests are compacted.
//
// Sequences run one after another: each policy step already spreads over (layer, head) rows with
// OpenMP, and the selections of all sequences are held until the compaction pass (their kept
// lists, a few bytes per kept token; the dense copies the paged path scores on are freed per
// request).
#pragma once
#include <span>
#include <string>
#include <vector>

#include "kvpolicy/paged.hpp"
#include "kvpolicy/policy.hpp"

namespace kvpolicy {

// One sequence of a dense batch: its own cache views (layers, heads and dim equal across the
// batch, tokens may differ) and its last queries (may be empty if the policy reads none).
// Sequences must not share memory.
template <Element T>
struct DenseSequence {
  KVView<T> keys, values;
  KVView<const T> queries;
};

namespace detail {

// Runs f() and prefixes any kvpolicy::Error with the sequence it is about.
template <class F>
auto for_sequence(std::size_t i, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    std::string_view m = e.what();
    if (m.starts_with("kvpolicy: ")) m.remove_prefix(10);
    throw Error("sequence " + std::to_string(i) + ": " + std::string(m));
  }
}

// budgets: empty (`budget` for all) or one per sequence; checked up front.
inline const Budget& budget_of(std::span<const Budget> budgets, const Budget& budget,
                               std::size_t i) {
  return budgets.empty() ? budget : budgets[i];
}
inline void check_budgets(std::span<const Budget> budgets, const Budget& budget, std::size_t n) {
  KVP_REQUIRE(budgets.empty() || budgets.size() == n, "budgets: ", budgets.size(),
              " budgets for ", n, " sequences (give none, or one per sequence)");
  if (budgets.empty()) budget.validate();
  for (std::size_t i = 0; i < budgets.size(); ++i)
    for_sequence(i, [&] { budgets[i].validate(); });
}

}  // namespace detail

// Compresses every sequence in place with `policy`: budgets empty = `budget` for each, or one
// Budget per sequence. Equal to policy.compress per sequence, except that nothing is written
// unless every sequence can be compressed, and that merger and quantizer stages are rejected
// (they need a Session). Returns the selections in order.
template <Element T>
std::vector<Selection> compress_batch(const Policy& policy, const cpu_backend& be,
                                      std::span<const DenseSequence<T>> seqs,
                                      const Budget& budget, std::span<const Budget> budgets = {}) {
  detail::require_selection_only(policy, "compress_batch");
  detail::check_budgets(budgets, budget, seqs.size());
  auto inputs = [&](std::size_t i) {
    Inputs<T> in;
    in.keys = seqs[i].keys;
    in.values = seqs[i].values;
    in.queries = seqs[i].queries;
    return in;
  };
  for (std::size_t i = 0; i < seqs.size(); ++i)
    detail::for_sequence(i, [&] {
      const Inputs<T> in = inputs(i);
      validate(in, policy.needs(), policy.query_window());
      const auto &k = seqs[i].keys, &k0 = seqs[0].keys;
      KVP_REQUIRE(k.layers == k0.layers && k.heads == k0.heads && k.dim == k0.dim, "keys are [",
                  k.layers, ",", k.heads, ",", k.tokens, ",", k.dim, "] but sequence 0 has [",
                  k0.layers, ",", k0.heads, ",", k0.tokens, ",", k0.dim,
                  "] (layers, heads and dim must match across the batch)");
      detail::require_finite_inputs(in);
    });
  std::vector<Selection> sels(seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i)
    sels[i] = detail::for_sequence(
        i, [&] { return policy.select(be, inputs(i), detail::budget_of(budgets, budget, i)); });
  for (std::size_t i = 0; i < seqs.size(); ++i)
    detail::for_sequence(
        i, [&] { detail::compact_kv(be, seqs[i].keys, seqs[i].values, sels[i]); });
  return sels;
}
// The same for a vector (a span of a class template is not deduced from it).
template <Element T>
std::vector<Selection> compress_batch(const Policy& policy, const cpu_backend& be,
                                      const std::vector<DenseSequence<T>>& seqs,
                                      const Budget& budget, std::span<const Budget> budgets = {}) {
  return compress_batch(policy, be, std::span<const DenseSequence<T>>(seqs), budget, budgets);
}

// Paged batch: several requests over one pool. queries: empty, or one view per request (an
// empty view for a request without queries). Checks every request first, including that no
// block id is in two requests' tables unless it is flagged in `shared` (prefix-cache blocks are
// shared by design and never written); then selects every request, then compacts each with
// paged_compact. Returns one result per request, in order.
template <Element T>
std::vector<PagedCompressResult> compress_paged_batch(
    const Policy& policy, const cpu_backend& be, const PagedKVView<T>& keys,
    const PagedKVView<T>& values, std::span<const PagedSequence> seqs,
    std::span<const KVView<const std::type_identity_t<T>>> queries, const Budget& budget,
    std::span<const Budget> budgets = {}, std::span<const std::uint8_t> shared = {}) {
  detail::require_selection_only(policy, "compress_paged_batch");
  detail::check_budgets(budgets, budget, seqs.size());
  KVP_REQUIRE(queries.empty() || queries.size() == seqs.size(), "queries: ", queries.size(),
              " views for ", seqs.size(), " requests (give none, or one per request)");
  validate(keys, "keys");  // before num_blocks sizes the owner table
  std::vector<std::int32_t> owner(seqs.empty() ? 0 : static_cast<std::size_t>(keys.num_blocks),
                                  -1);
  for (std::size_t i = 0; i < seqs.size(); ++i)
    detail::for_sequence(i, [&] {
      detail::check_paged(keys, values, seqs[i], shared);
      for (std::int64_t p = 0; p < seqs[i].pages(keys.page_size); ++p) {
        const std::int32_t b = seqs[i].block_table[static_cast<std::size_t>(p)];
        if (!shared.empty() && shared[static_cast<std::size_t>(b)]) continue;
        auto& o = owner[static_cast<std::size_t>(b)];
        KVP_REQUIRE(o < 0, "seq: block ", b, " is also in the block table of sequence ", o,
                    " (only shared blocks may be in several tables)");
        o = static_cast<std::int32_t>(i);
      }
    });
  std::vector<PagedCompressResult> out(seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i)
    out[i].selection = detail::for_sequence(i, [&] {
      return detail::select_paged(policy, be, keys, values, seqs[i],
                                  queries.empty() ? KVView<const T>{} : queries[i],
                                  detail::budget_of(budgets, budget, i));
    });
  for (std::size_t i = 0; i < seqs.size(); ++i)
    out[i].compact = detail::for_sequence(
        i, [&] { return paged_compact(be, keys, values, seqs[i], out[i].selection, shared); });
  return out;
}

}  // namespace kvpolicy
