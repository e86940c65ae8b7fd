// The concepts a policy stage must model. Each stage is a small trivially copyable value (so it
// can be passed into a kernel) that says what it reads (`needs`) and does its work on a backend.
#pragma once
#include <algorithm>
#include <concepts>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

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

// Where a compression event sits in the model, and the per-token allocator state it carries.
// Engines that compress one layer at a time (Session) say which layer it is, so allocators that
// split a budget across layers (pyramid, depthkv) give each layer its share of the model's.
struct EventInfo {
  std::int64_t first_layer = 0;   // model index of the event's layer 0
  std::int64_t model_layers = 0;  // layers of the whole model; 0: the event holds all of them
  // Per-token allocator state [L][Hkv][alloc_state_stride] (AMS credit), read and updated in
  // place, or null (stateless: every token starts from zero). The owner zeroes new tokens and
  // compacts it with K/V after the selection, like the H2O accumulators.
  float* alloc_state = nullptr;
  std::int64_t alloc_state_stride = 0;  // 0: tokens
  // Tensor parallelism: the event holds this rank's share of the model's KV heads, and the
  // stages that combine heads exchange data through the shard's all-gather
  // (core/head_shard.hpp). Null: the event holds every KV head.
  const HeadShard* shard = nullptr;
};

// What an allocator sees. `scores` is mutable so that a token-level allocator (ams) can steer the
// final per-row top-k: it lowers the scores of tokens outside its candidate set to -inf.
struct AllocContext {
  ScoreMap* scores = nullptr;
  std::int64_t tokens = 0;
  Protect protect;  // the scorer's protected tokens widened by every allocator's own
  std::int64_t first_layer = 0, model_layers = 0;  // see EventInfo; model_layers is never 0 here
  const Stats* stats = nullptr;  // window attention the allocators asked for (query_window())
  std::int64_t queries = 0;      // queries the event holds
  float* state = nullptr;        // see EventInfo::alloc_state
  std::int64_t state_stride = 0;
  // The event's CPU threads, for allocators that split their work over rows (adakv); null: the
  // calling thread only. The budgets must not depend on it.
  const cpu_backend* backend = nullptr;
  // Set when the event holds one rank's share of the KV heads and the chain combines heads
  // (see EventInfo::shard); null otherwise. An allocator that compares heads (adakv) reduces
  // across ranks through it; heads() is then this rank's.
  const HeadShard* shard = nullptr;

  std::int64_t layers() const { return scores ? scores->layers() : 0; }
  std::int64_t heads() const { return scores ? scores->heads() : 0; }
  // Fewest tokens any row may keep: the protected ones (all of them when the row is shorter).
  std::int64_t min_keep() const { return protect.total(tokens); }
};

// The level an allocator works at. A chain goes layers -> heads -> segments (each level splits
// the budget the previous one produced); `any` stages (uniform) fit anywhere.
enum class AllocLevel : std::uint8_t { any, layers, heads, segments };

// Allocator: redistributes per-(layer, head) budgets in place (row-major [L][Hkv]) and must
// conserve their sum exactly (layer-level allocators conserve the model's sum: see pyramid.hpp).
// Optional members: `static constexpr AllocLevel level`; `Needs needs()` and
// `std::int64_t query_window()` (statistics the pipeline computes for it: GQA-mean window
// attention of the last query_window() queries, in ctx.stats); `Protect protects()` (tokens it
// always keeps besides the scorer's, e.g. AMS sinks and last tokens); `static constexpr bool
// stateful = true` (it reads and writes per-token state, EventInfo::alloc_state).
template <class A>
concept Allocator = std::is_trivially_copyable_v<A> &&
    requires(const A a, const AllocContext& ctx, std::span<std::int64_t> budgets) {
      { A::name } -> std::convertible_to<std::string_view>;
      a.allocate(ctx, budgets);
    };

namespace detail {
template <class A>
constexpr AllocLevel alloc_level() {
  if constexpr (requires { A::level; }) return A::level;
  return AllocLevel::any;
}
template <class A>
Needs alloc_needs(const A& a) {
  if constexpr (requires { a.needs(); }) return a.needs();
  return Needs::none;
}
template <class A>
std::int64_t alloc_window(const A& a) {
  if constexpr (requires { a.query_window(); }) return a.query_window();
  return 0;
}
template <class A>
constexpr bool alloc_stateful() {
  if constexpr (requires { A::stateful; }) return A::stateful;
  return false;
}
// Stages that combine KV heads (compare or average them) declare `static constexpr bool
// spans_heads = true`: under tensor parallelism they exchange data across ranks
// (core/head_shard.hpp).
template <class S>
constexpr bool spans_heads() {
  if constexpr (requires { S::spans_heads; }) return S::spans_heads;
  return false;
}
// Scorers whose statistics accumulate over decode steps (H2O) say so with
// `GqaReduce accumulation() const` (how the query group's attention is reduced into the
// per-token sums): an engine then evicts at every decode step and keeps the sums per token.
template <class S>
constexpr bool accumulates() {
  return requires(const S s) { { s.accumulation() } -> std::same_as<GqaReduce>; };
}
template <class A>
Protect alloc_protects(const A& a) {
  if constexpr (requires { a.protects(); }) return a.protects();
  return {};
}
}  // namespace detail

// What a chain of allocators asks of the pipeline, merged over its stages.
struct AllocRequirements {
  Needs needs = Needs::none;
  std::int64_t window = 0;             // largest query window any stage reads
  std::vector<std::int64_t> windows;   // every window a stage reads (GQA-mean window attention)
  Protect protect;                     // union of the stages' own protected tokens
  bool state = false;                  // some stage keeps per-token state (EventInfo)
  bool spans_heads = false;            // some stage combines KV heads (EventInfo::shard)
  std::string order_error;             // non-empty: the chain breaks layers -> heads -> segments

  template <class A>
  void add(const A& a) {
    needs = needs | detail::alloc_needs(a);
    const std::int64_t w = detail::alloc_window(a);
    if (w > 0) {
      window = std::max(window, w);
      windows.push_back(w);
    }
    state = state || detail::alloc_stateful<A>();
    spans_heads = spans_heads || detail::spans_heads<A>();
    const Protect p = detail::alloc_protects(a);
    protect.sinks = std::max(protect.sinks, p.sinks);
    protect.recent = std::max(protect.recent, p.recent);
    constexpr AllocLevel lv = detail::alloc_level<A>();
    if (lv == AllocLevel::any || !order_error.empty()) return;
    if (last_level_ == AllocLevel::segments || lv < last_level_)
      order_error = std::string("allocator '") + std::string(A::name) + "' cannot follow '" +
                    last_name_ + "': allocators go layers -> heads -> segments, and a " +
                    "segment-level allocator (ams) must be the last stage";
    last_level_ = lv;
    last_name_ = std::string(A::name);
  }

 private:
  AllocLevel last_level_ = AllocLevel::any;
  std::string last_name_;
};

// What a merger sees: the cache of one event (mutable: cores are written into kept rows), the
// selection, the scores and the per-token log-count bias [L][Hkv][T] it updates.
template <class T>
struct MergeArgs {
  KVView<T> keys, values;
  const Selection* selection = nullptr;
  const ScoreMap* scores = nullptr;
  float* log_count = nullptr;
  // Elements between (layer, head) rows of log_count; 0: keys.tokens. log(1) = 0 for a token
  // that stands for itself; the owner zeroes new tokens and compacts it with K/V afterwards.
  std::int64_t log_count_stride = 0;
  // Tokens the selection protected (sinks, recent window): never merged, never written.
  Protect protect;
  // Optional chunk delimiters, 1 where a token ends a chunk (see mergers/semantic.hpp).
  // delimiter_stride 0: one mask [T] shared by every (layer, head) row (an uncompacted cache);
  // > 0: one mask per row, [L][Hkv][delimiter_stride] (rows of a cache compacted per head hold
  // different tokens; the owner compacts the mask with K/V).
  const std::uint8_t* delimiter = nullptr;
  std::int64_t delimiter_stride = 0;
  // Optional output [L][Hkv][chunk_end_stride] (0: T; may alias a per-row `delimiter`): 1 at
  // the last kept row of every chunk, 0 at the other kept rows, so that compacted with K/V it is
  // the next event's per-row delimiter mask and chunk boundaries survive the eviction of the
  // delimiter tokens themselves. Evicted slots are left as they were.
  std::uint8_t* chunk_end = nullptr;
  std::int64_t chunk_end_stride = 0;
};

// Merger: folds evicted tokens into kept ones (semantic cores, nearest neighbour) before
// compaction, recording how many tokens each kept row now represents.
template <class M>
concept Merger = std::is_trivially_copyable_v<M> &&
    requires(const M m, const cpu_backend& be, const MergeArgs<float>& args) {
      { M::name } -> std::convertible_to<std::string_view>;
      m.merge(be, args);
    };

}  // namespace kvpolicy
