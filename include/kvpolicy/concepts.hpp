// The concepts a policy stage must model. Each stage is a small trivially copyable value (so it
// can be passed into a kernel) that says what it reads (`needs`) and does its work on a backend.
#pragma once
#include <concepts>
#include <cstddef>
#include <span>
#include <string_view>
#include <type_traits>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/budget.hpp"
#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/core/selection.hpp"

namespace kvpolicy {

// Scorer: inputs -> ScoreMap [L][Hkv][T] (fp32, higher = keep), plus the tokens it protects.
template <class S>
concept Scorer = std::is_trivially_copyable_v<S> &&
    requires(const S s, const cpu_backend& be, const Inputs<float>& in, Stats& st,
             ScoreMap& out, std::int64_t tokens, std::int64_t budget) {
      { S::name } -> std::convertible_to<std::string_view>;
      { s.needs() } -> std::same_as<Needs>;
      { s.query_window() } -> std::convertible_to<std::int64_t>;  // -1: every query
      { s.protect(tokens, budget) } -> std::same_as<Protect>;
      s.score(be, in, st, out);
    };

// What an allocator sees: the scores of the event and the tokens per row.
struct AllocContext {
  const ScoreMap* scores = nullptr;
  std::int64_t tokens = 0;
  Protect protect;
};

// Allocator: redistributes per-(layer, head) budgets in place (row-major [L][Hkv]) and must
// conserve their sum exactly.
template <class A>
concept Allocator = std::is_trivially_copyable_v<A> &&
    requires(const A a, const AllocContext& ctx, std::span<std::int64_t> budgets) {
      { A::name } -> std::convertible_to<std::string_view>;
      a.allocate(ctx, budgets);
    };

// What a merger sees: the cache of one event (mutable: cores are written into kept rows), the
// selection, the scores and the per-token log-count bias [L][Hkv][T] it updates.
template <class T>
struct MergeArgs {
  KVView<T> keys, values;
  const Selection* selection = nullptr;
  const ScoreMap* scores = nullptr;
  float* log_count = nullptr;
};

// Merger: folds evicted tokens into kept ones (semantic cores, nearest neighbour) before
// compaction, recording how many tokens each kept row now represents.
template <class M>
concept Merger = std::is_trivially_copyable_v<M> &&
    requires(const M m, const cpu_backend& be, const MergeArgs<float>& args) {
      { M::name } -> std::convertible_to<std::string_view>;
      m.merge(be, args);
    };

// Quantizer: K/V rows -> packed blocks and back.
template <class Q>
concept Quantizer = std::is_trivially_copyable_v<Q> &&
    requires(const Q q, const KVView<const float>& src, const KVView<float>& dst,
             std::span<std::byte> packed, std::span<const std::byte> cpacked, std::int64_t n) {
      { Q::name } -> std::convertible_to<std::string_view>;
      { q.bits() } -> std::convertible_to<int>;
      { q.packed_bytes(n, n) } -> std::convertible_to<std::size_t>;  // (tokens, head_dim)
      q.encode(src, packed);
      q.decode(cpacked, dst);
    };

// Backend: a tag value that ops are overloaded on.
template <class B>
concept Backend = std::is_trivially_copyable_v<B> && requires {
  { B::kind } -> std::convertible_to<BackendKind>;
};

static_assert(Backend<cpu_backend> && Backend<cuda_backend>);

}  // namespace kvpolicy
