// What a compression event sees: keys, values, the recent queries and stateful statistics, for
// one or several layers. Stats memoizes statistics that several stages share (window attention,
// key norms) so each is computed once per event.
#pragma once
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <tuple>

#include "kvpolicy/core/head_shard.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/score_map.hpp"
#include "kvpolicy/core/types.hpp"

namespace kvpolicy {

// What a stage reads. Bit flags.
enum class Needs : unsigned {
  none = 0,
  keys = 1u << 0,
  values = 1u << 1,
  queries = 1u << 2,      // the last `query_window()` queries, post-RoPE
  accumulated = 1u << 3,  // accumulated attention per key (H2O state)
  reconstruction = 1u << 4,  // context-reconstruction scores per key (kvzip; Session::reconstruct)
};
constexpr Needs operator|(Needs a, Needs b) {
  return static_cast<Needs>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
constexpr bool has(Needs set, Needs flag) {
  return (static_cast<unsigned>(set) & static_cast<unsigned>(flag)) != 0;
}

// Tokens a scorer always keeps (they count toward the budget): the first `sinks` and the last
// `recent`. Both are >= 0 and may be huge (a plug-in may say INT64_MAX for "everything").
struct Protect {
  std::int64_t sinks = 0;
  std::int64_t recent = 0;
  // min(tokens, sinks + recent) for tokens >= 0, without overflowing for any counts.
  std::int64_t total(std::int64_t tokens) const {
    const std::int64_t s = std::min(sinks, tokens);
    return std::min(tokens, s + std::min(recent, tokens - s));
  }
};

template <Element T>
struct Inputs {
  KVView<const T> keys;     // [L][Hkv][T][d]
  KVView<const T> values;   // [L][Hkv][T][d]; may be empty for scorers that do not read it
  KVView<const T> queries;  // [L][Hq][n_q][d]: queries of positions T-n_q .. T-1; may be empty
  // [L][Hkv][T] accumulated attention (H2O state) and, optionally, the number of queries that
  // contributed to each entry (for normalize=true); both may be null.
  const float* accumulated = nullptr;
  const float* observed = nullptr;
  // [L][Hkv][T] context-reconstruction scores (kvzip): the largest attention each key received
  // from the queries of a pass that repeats the context (Session::reconstruct); may be null.
  const float* reconstruction = nullptr;
  std::int64_t state_stride = 0;  // elements between (layer, head) rows of the state; 0 = T
  GqaReduce reduce = GqaReduce::mean;
  // The model's inverse RoPE frequencies [d/2] (Hugging Face's half-split rotation), for scorers
  // that rotate queries to future positions (expected); empty when the caller does not know them.
  std::span<const float> rope_inv_freq{};
  // The absolute position of the first given query (the queries are those of the last n_q
  // positions before the next token); -1: the cache's own, T - n_q (nothing evicted yet). A
  // Session passes it, so that a scorer can tell the sequence's first tokens after eviction.
  std::int64_t first_query_position = -1;
  // The event's share of a model whose KV heads are split across ranks (EventInfo::shard; the
  // pipeline sets it for the stages that combine heads, see core/head_shard.hpp); null: the
  // event holds every head.
  const HeadShard* shard = nullptr;

  std::int64_t state_row_stride() const { return state_stride > 0 ? state_stride : keys.tokens; }

  std::int64_t layers() const { return keys.layers; }
  std::int64_t kv_heads() const { return keys.heads; }
  std::int64_t tokens() const { return keys.tokens; }
  std::int64_t dim() const { return keys.dim; }
};

// Memo of per-event statistics keyed by their parameters. Owned by the caller of a pipeline.
class Stats {
 public:
  // Returns the cached map for `key`, or nullptr.
  const ScoreMap* find(std::int64_t window, GqaReduce r) const {
    auto it = window_attn_.find({window, r});
    return it == window_attn_.end() ? nullptr : &it->second;
  }
  ScoreMap& slot(std::int64_t window, GqaReduce r) { return window_attn_[{window, r}]; }
  void clear() { window_attn_.clear(); }

 private:
  std::map<std::tuple<std::int64_t, GqaReduce>, ScoreMap> window_attn_;
};

}  // namespace kvpolicy

namespace kvpolicy {

// Checks that the views a stage needs are present and consistent with each other.
template <Element T>
void validate(const Inputs<T>& in, Needs needs, std::int64_t query_window = 0) {
  validate(in.keys, "keys");
  KVP_REQUIRE(in.keys.tokens <= (std::int64_t{1} << 31) - 1, "keys: ", in.keys.tokens,
              " tokens exceed the int32 index range");
  if (has(needs, Needs::values) || in.values.data) {
    validate(in.values, "values");
    KVP_REQUIRE(in.values.layers == in.keys.layers && in.values.heads == in.keys.heads &&
                    in.values.tokens == in.keys.tokens,
                "values shape [", in.values.layers, ",", in.values.heads, ",", in.values.tokens,
                ",", in.values.dim, "] does not match keys [", in.keys.layers, ",", in.keys.heads,
                ",", in.keys.tokens, ",", in.keys.dim, "]");
  }
  if (has(needs, Needs::queries))
    KVP_REQUIRE(in.queries.data != nullptr && in.queries.tokens > 0,
                "queries: this policy needs the last ", query_window,
                " queries but none were given");
  if (in.queries.data != nullptr) {
    validate(in.queries, "queries");
    KVP_REQUIRE(in.queries.layers == in.keys.layers, "queries have ", in.queries.layers,
                " layers but keys have ", in.keys.layers);
    KVP_REQUIRE(in.queries.dim == in.keys.dim, "queries head_dim ", in.queries.dim,
                " differs from keys head_dim ", in.keys.dim);
    KVP_REQUIRE(in.keys.heads > 0 && in.queries.heads % in.keys.heads == 0, "queries: ",
                in.queries.heads, " query heads are not a multiple of ", in.keys.heads,
                " KV heads");
    KVP_REQUIRE(in.queries.tokens <= in.keys.tokens, "queries: ", in.queries.tokens,
                " queries for only ", in.keys.tokens, " keys");
  }
  KVP_REQUIRE(in.state_stride == 0 || in.state_stride >= in.keys.tokens, "state_stride ",
              in.state_stride, " is below the ", in.keys.tokens, " tokens of a row");
  if (has(needs, Needs::reconstruction))
    KVP_REQUIRE(in.reconstruction != nullptr,
                "context-reconstruction scores are required but none were given: run the "
                "reconstruction pass first (Session::reconstruct, kvp_session_reconstruct, "
                "Engine::reconstruct) or pass them (Inputs::reconstruction; Python: "
                "reconstruction=; C: kvp_compress_params.reconstruction)");
  if (has(needs, Needs::accumulated))
    KVP_REQUIRE(in.accumulated != nullptr || (in.queries.data != nullptr && in.queries.tokens > 0),
                "accumulated attention is required (or the queries to compute it) but neither "
                "was given");
}

}  // namespace kvpolicy
