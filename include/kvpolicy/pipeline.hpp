// Compile-time pipeline: Scorer -> Allocators... -> selection -> compaction. Engines that know
// their policy use Pipeline<SnapKV, Uniform>; the runtime Policy (policy.hpp) runs the same steps
// through detail::select_tokens.
#pragma once
#include <algorithm>
#include <string>
#include <tuple>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/cpu/compact.hpp"
#include "kvpolicy/cpu/select.hpp"
#include "kvpolicy/cpu/stages.hpp"
#include "kvpolicy/scorers/common.hpp"

namespace kvpolicy {

namespace detail {

// A scorer's name in messages: its spec name (a plug-in's own for External).
template <class S>
std::string_view scorer_label(const S& s) {
  if constexpr (requires { s.plugin_name(); })
    return s.plugin_name();
  else
    return S::name;
}

// An event's layers [first_layer, first_layer + layers) must lie inside the model.
inline void check_event_layers(const EventInfo& ev, std::int64_t layers) {
  KVP_REQUIRE(ev.first_layer >= 0 && ev.model_layers >= 0 &&
                  (ev.model_layers == 0 || ev.first_layer + layers <= ev.model_layers),
              "event layers [", ev.first_layer, ", ", ev.first_layer + layers,
              ") do not fit a model of ", ev.model_layers, " layers");
}

// Per-(layer, head) budgets of an event holding heads [first_head, first_head + heads) of the
// model's (core/head_shard.hpp): the model's uniform split, this rank's part of it.
inline std::vector<std::int64_t> resolve_budgets(const Budget& budget, std::int64_t layers,
                                                 std::int64_t heads, std::int64_t tokens,
                                                 const HeadShard* shard) {
  const std::int64_t hm = model_heads(shard, heads), h0 = first_head(shard);
  if (hm == heads) return budget.resolve(layers, heads, tokens);
  // Budget::resolve over the model's rows without materializing them: floor(G / rows) each,
  // one more for the first G % rows rows.
  const std::int64_t rows = layers * hm, g = budget.global(layers, hm, tokens);
  std::vector<std::int64_t> out(static_cast<std::size_t>(layers * heads));
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::int64_t h = 0; h < heads; ++h)
      out[static_cast<std::size_t>(l * heads + h)] =
          rows ? g / rows + (l * hm + h0 + h < g % rows ? 1 : 0) : 0;
  return out;
}

template <Element T>
void require_finite_inputs(const Inputs<T>& in) {
  require_finite(in.keys, "keys");
  if (in.values.data) require_finite(in.values, "values");
  if (in.queries.data) require_finite(in.queries, "queries");
}

// A kvpolicy::Error's message without its "kvpolicy: " prefix.
inline std::string error_text(const Error& e) {
  const std::string_view w = e.what(), prefix = "kvpolicy: ";
  return std::string(w.substr(0, prefix.size()) == prefix ? w.substr(prefix.size()) : w);
}

// When the smallest row budget of the model is below the protected tokens (snapkv's 64 queries'
// window at a small budget, a short prompt), narrows `protect` to what fits, the newest tokens
// first, then the sinks, and returns the selection's warning saying so; else returns "".
// `own` is the scorer's protection before the allocators widened it.
inline std::string fit_protected(std::string_view scorer, Protect& protect, Protect own,
                                 std::int64_t smallest, std::int64_t tokens) {
  const std::int64_t n_protected = protect.total(tokens);
  if (smallest >= n_protected) return {};
  const bool widened = protect.sinks != own.sinks || protect.recent != own.recent;
  const std::int64_t recent = std::min(protect.recent, smallest);
  const Protect fit{std::min(protect.sinks, smallest - recent), recent};
  const std::string newest = fit.recent ? "the newest " + std::to_string(fit.recent) : "";
  const std::string first = fit.sinks ? "the first " + std::to_string(fit.sinks) : "";
  std::string warning = cat("budget of ", smallest, " tokens per head is below the ", n_protected,
                            " tokens ", scorer,
                            widened ? " and its allocators protect (" : " protects (",
                            protect.sinks, " sinks + ", protect.recent, " recent): kept ",
                            newest.empty() && first.empty() ? "none of them"
                            : newest.empty() || first.empty() ? newest + first
                                                              : newest + " and " + first,
                            " instead");
  protect = fit;
  return warning;
}

// One compression event's selection: validate inputs, resolve the budget, score, let the
// allocators redistribute, select per row. `allocate(ctx, budgets)` runs the allocator chain;
// `req` is what that chain reads (merged over its stages), `ev` where the event sits. Under
// tensor parallelism (ev.shard) with a chain that combines heads, every rank's checks are agreed
// on before the first exchange (detail::agree), so a failure on one rank is raised on all.
template <class S, Element T, class AllocateFn>
Selection select_tokens(const cpu_backend& be, const S& scorer, AllocateFn&& allocate,
                        const AllocRequirements& req, const Inputs<T>& given, const Budget& budget,
                        Stats& stats, ScoreMap* scores_out, const EventInfo& ev = {},
                        Protect* protect_out = nullptr) {
  const HeadShard* shard = ev.shard;
  const bool spans = spans_heads<S>() || req.spans_heads;
  const bool exchanges = sharded(shard) && spans;
  if (exchanges) require_all_gather(*shard);
  const std::int64_t L = given.layers(), H = given.kv_heads(), Tk = given.tokens();
  std::vector<std::int64_t> budgets;
  Protect protect, own;
  std::int64_t smallest = Tk;  // the smallest row budget of the model (every rank's)
  std::string error;
  try {
    if (shard) check_shard(*shard, H);
    KVP_REQUIRE(req.order_error.empty(), req.order_error);
    validate(given, scorer.needs() | req.needs, std::max(scorer.query_window(), req.window));
    check_event_layers(ev, L);
    KVP_REQUIRE(ev.alloc_state_stride == 0 || ev.alloc_state_stride >= Tk, "alloc_state_stride ",
                ev.alloc_state_stride, " is below the ", Tk, " tokens of the event");
    budgets = resolve_budgets(budget, L, H, Tk, shard);
    const std::int64_t rows = L * model_heads(shard, H);
    const std::int64_t per_row = rows > 0 ? budget.global(L, model_heads(shard, H), Tk) / rows : 0;
    // (Budget::resolve's rows are per_row or per_row + 1.)
    if (rows > 0) smallest = per_row;
    own = scorer.protect(Tk, per_row);
    // Under an exchange, NaN/Inf on one rank must fail every rank (callers that check inputs
    // themselves before select skip that under a shard).
    if (exchanges) require_finite_inputs(given);
    protect = {std::max(own.sinks, req.protect.sinks), std::max(own.recent, req.protect.recent)};
  } catch (const Error& e) {
    if (!exchanges) throw;
    error = error_text(e);
  }
  bool evicts = false;
  for (std::int64_t b : budgets) evicts = evicts || b < Tk;
  // Ranks that exchange must all score, or none (a rank that returned early would leave the
  // others waiting).
  if (exchanges) evicts = agree(*shard, error, L, H, Tk, evicts || scores_out);
  Inputs<T> in = given;
  in.shard = exchanges ? shard : nullptr;
  // A budget below the protected window (snapkv's 64 queries' window at a small budget, a short
  // prompt) keeps what fits of it: the newest tokens first, then the sinks. The selection says so
  // in its warning.
  std::string warning = fit_protected(scorer_label(scorer), protect, own, smallest, Tk);
  if (protect_out) *protect_out = protect;
  ScoreMap local;
  ScoreMap& scores = scores_out ? *scores_out : local;
  if (!evicts && !scores_out) return Selection::all(L, H, Tk);  // keep everything, no scoring
  // Under an exchange, a scorer that fails on one rank (its own checks: a query window longer
  // than the queries given, say) must fail every rank before the allocators exchange: a second
  // agreement. (A scorer that itself exchanges, tova or expected, checks before its exchange
  // only what every rank shares.)
  const bool second = exchanges && req.spans_heads;
  try {
    scorer.score(be, in, stats, scores);
    for (std::int64_t w : req.windows)
      if (in.queries.data && in.queries.tokens > 0)
        window_attention_stat(be, in, stats, w, GqaReduce::mean);
  } catch (const Error& e) {
    if (!second) throw;
    agree(*shard, error_text(e), L, H, Tk, true);
  }
  if (second) agree(*shard, {}, L, H, Tk, true);
  AllocContext ctx;
  ctx.scores = &scores;
  ctx.tokens = Tk;
  ctx.protect = protect;
  ctx.first_layer = ev.first_layer;
  ctx.model_layers = ev.model_layers > 0 ? ev.model_layers : L;
  ctx.stats = &stats;
  ctx.queries = in.queries.data ? in.queries.tokens : 0;
  ctx.state = ev.alloc_state;
  ctx.state_stride = ev.alloc_state_stride > 0 ? ev.alloc_state_stride : Tk;
  ctx.backend = &be;
  ctx.shard = in.shard;
  allocate(ctx, std::span<std::int64_t>(budgets));
  Selection sel;
  cpu::select(be, scores, budgets, protect, sel);
  sel.set_warning(std::move(warning));
  return sel;
}

// Compacts keys and values in place after checking them (no write happens if a check fails).
template <Element T>
void compact_kv(const cpu_backend& be, const KVView<T>& keys, const KVView<T>& values,
                const Selection& sel) {
  if (values.data) {
    KVP_REQUIRE(values.layers == keys.layers && values.heads == keys.heads &&
                    values.tokens == keys.tokens,
                "values shape does not match keys");
    sel.validate(values.tokens);
  }
  if (values.data)
    cpu::compact(be, keys, values, sel);  // one parallel region for both
  else
    cpu::compact(be, keys, sel);
}

// Select with `policy` (a Pipeline or a Policy), then compact keys/values in place. Checks for
// NaN/Inf and every shape before anything is written.
template <class P, Element T>
Selection compress_in_place(const P& policy, const cpu_backend& be, const KVView<T>& keys,
                            const KVView<T>& values, Inputs<T> in, const Budget& budget) {
  in.keys = keys;
  in.values = values;
  require_finite_inputs(in);
  Selection sel = policy.select(be, in, budget);
  compact_kv(be, keys, values, sel);
  return sel;
}

}  // namespace detail

template <class S, class... As>
class Pipeline {
  static_assert(Scorer<S>,
                "kvpolicy::Pipeline<S, ...>: S must model kvpolicy::Scorer (a trivially copyable "
                "type with `name`, `needs()`, `query_window()`, `protect(tokens, budget)` and "
                "`score(backend, inputs, stats, out)`)");
  static_assert((Allocator<As> && ...),
                "kvpolicy::Pipeline<S, A...>: every A must model kvpolicy::Allocator (a trivially "
                "copyable type with `name` and `allocate(ctx, budgets)`)");

 public:
  Pipeline() = default;
  explicit Pipeline(S scorer, As... allocators) : scorer_(scorer), allocators_(allocators...) {}

  const S& scorer() const { return scorer_; }
  // True when a stage combines KV heads; see Policy::spans_heads().
  static constexpr bool spans_heads() {
    return detail::spans_heads<S>() || (detail::spans_heads<As>() || ...);
  }

  // Kept token indices per (layer, KV head). `scores`, if given, receives the scores the
  // selection used (the scorer's output, with non-candidates at -inf after a token-level
  // allocator such as ams).
  template <Element T>
  Selection select(const cpu_backend& be, const Inputs<T>& in, const Budget& budget,
                   ScoreMap* scores = nullptr) const {
    return select(be, in, budget, EventInfo{}, scores);
  }
  // The same for an event that is part of a larger model (one layer at a time) or that carries
  // per-token allocator state; see EventInfo.
  template <Element T>
  Selection select(const cpu_backend& be, const Inputs<T>& in, const Budget& budget,
                   const EventInfo& ev, ScoreMap* scores = nullptr) const {
    Stats stats;
    AllocRequirements req;
    std::apply([&](const auto&... a) { (req.add(a), ...); }, allocators_);
    return detail::select_tokens(
        be, scorer_,
        [&](const AllocContext& ctx, std::span<std::int64_t> b) {
          std::apply([&](const auto&... a) { (a.allocate(ctx, b), ...); }, allocators_);
        },
        req, in, budget, stats, scores, ev);
  }

  // Selects and compacts in.keys / in.values in place (they must be mutable views of the same
  // memory as `keys` / `values`). Rejects NaN/Inf before anything is written.
  template <Element T>
  Selection compress(const cpu_backend& be, const KVView<T>& keys, const KVView<T>& values,
                     const Inputs<T>& in, const Budget& budget) const {
    return detail::compress_in_place(*this, be, keys, values, in, budget);
  }

 private:
  S scorer_{};
  std::tuple<As...> allocators_;
};

}  // namespace kvpolicy
