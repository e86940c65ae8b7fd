// Policy: the runtime form of a pipeline, built from a spec string (for the CLI, Python and the
// C ABI). "snapkv(window=32,kernel=7,pool=max) | adakv | semantic(tau=0.9) | int2": one scorer,
// then allocators (layers -> heads -> segments), then at most one merger (semantic, nearest),
// then at most one quantizer (int2, int4, kivi), in that order. Unknown names or parameters, and
// stages out of order, raise kvpolicy::Error listing what is valid.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvpolicy/pipeline.hpp"
#include "kvpolicy/registry.hpp"
#include "kvpolicy/scorers/external.hpp"
#include "kvpolicy/spec.hpp"

namespace kvpolicy {

namespace detail {
template <class Tuple, class... Extra>
struct variant_of;
template <class... Ts, class... Extra>
struct variant_of<std::tuple<Ts...>, Extra...> {
  using type = std::variant<Ts..., Extra...>;
};

template <class... Ts>
std::string names_of(std::tuple<Ts...>*) {
  std::string s;
  ((s += (s.empty() ? "" : ", ") + std::string(Ts::name)), ...);
  return s;
}

// Builds the registered type called `stage.name`, if any.
template <class Variant, class... Ts>
bool make_stage(SpecStage& stage, Variant& out, std::tuple<Ts...>*) {
  return ((stage.name == Ts::name ? (out = Ts::from_params(stage.params), stage.params.finish(),
                                     true)
                                  : false) ||
          ...);
}
}  // namespace detail

class Policy {
 public:
  // Built-in scorers, and External for plug-ins (scorers/external.hpp).
  using AnyScorer = detail::variant_of<scorer_types, External>::type;
  using AnyAllocator = detail::variant_of<allocator_types>::type;
  using AnyMerger = detail::variant_of<merger_types>::type;
  using AnyQuantizer = detail::variant_of<quantizer_types>::type;

  Policy() : Policy("streaming") {}
  explicit Policy(std::string_view spec) : Policy(spec, {}) {}
  // `plugins`: scorers implemented outside the library, found by name when the first stage is
  // not a built-in scorer. A plug-in stage takes no parameters; a plug-in named like a built-in
  // stage is rejected.
  Policy(std::string_view spec, std::span<const External> plugins) {
    auto stages = parse_spec(spec);
    const std::string scorer_names = detail::names_of(static_cast<scorer_types*>(nullptr));
    const std::string alloc_names = detail::names_of(static_cast<allocator_types*>(nullptr));
    const std::string merger_names = detail::names_of(static_cast<merger_types*>(nullptr));
    const std::string quant_names = detail::names_of(static_cast<quantizer_types*>(nullptr));
    std::string plugin_names;
    for (const External& p : plugins) {
      const std::string_view n = p.plugin_name();
      auto clashes = [&](const std::string& names) {
        std::string_view rest = names;
        while (!rest.empty()) {
          const std::size_t c = rest.find(", ");
          if (rest.substr(0, c) == n) return true;
          rest = c == std::string_view::npos ? std::string_view{} : rest.substr(c + 2);
        }
        return false;
      };
      KVP_REQUIRE(!clashes(scorer_names) && !clashes(alloc_names) && !clashes(merger_names) &&
                      !clashes(quant_names),
                  "plug-in scorer '", n, "' has the name of a built-in stage");
      plugin_names += (plugin_names.empty() ? "" : ", ") + std::string(n);
    }
    // A quantizer alone ("int2", "kivi(residual=64)"): keep every token, packed.
    if (AnyQuantizer q; stages.size() == 1 &&
                        detail::make_stage(stages[0], q, static_cast<quantizer_types*>(nullptr))) {
      quantizer_ = q;
      keep_all_ = true;
      scorer_ = Streaming{};  // never scores; not the variant's default H2O (decode-time)
      spec_ = stages[0].text;
      return;
    }
    if (!detail::make_stage(stages[0], scorer_, static_cast<scorer_types*>(nullptr))) {
      const External* found = nullptr;
      for (const External& p : plugins)
        if (p.plugin_name() == stages[0].name) found = &p;
      KVP_REQUIRE(found, "unknown scorer '", stages[0].name, "' (valid scorers: ", scorer_names,
                  plugin_names.empty() ? "" : "; plug-ins: ", plugin_names,
                  "; or a quantizer alone: ", quant_names, ")");
      KVP_REQUIRE(stages[0].text == stages[0].name, "plug-in scorer '", stages[0].name,
                  "' takes no parameters (got '", stages[0].text, "')");
      scorer_ = *found;
    }
    spec_ = stages[0].text;
    for (std::size_t i = 1; i < stages.size(); ++i) {
      SpecStage& st = stages[i];
      AnyAllocator a;
      AnyMerger m;
      AnyQuantizer q;
      if (detail::make_stage(st, a, static_cast<allocator_types*>(nullptr))) {
        KVP_REQUIRE(!merger_ && !quantizer_, "policy spec '", spec, "': allocator '", st.name,
                    "' comes after the ", merger_ ? "merger" : "quantizer",
                    "; the order is scorer | allocators | merger | quantizer");
        allocators_.push_back(a);
        std::visit([&](const auto& al) { req_.add(al); }, a);
        KVP_REQUIRE(req_.order_error.empty(), "policy spec '", spec, "': ", req_.order_error);
      } else if (detail::make_stage(st, m, static_cast<merger_types*>(nullptr))) {
        KVP_REQUIRE(!merger_ && !quantizer_, "policy spec '", spec, "': merger '", st.name,
                    "' comes after ", merger_ ? "another merger (at most one)" : "the quantizer",
                    "; the order is scorer | allocators | merger | quantizer");
        merger_ = m;
      } else if (detail::make_stage(st, q, static_cast<quantizer_types*>(nullptr))) {
        KVP_REQUIRE(!quantizer_, "policy spec '", spec, "': quantizer '", st.name,
                    "' comes after another quantizer (at most one)");
        quantizer_ = q;
      } else {
        KVP_REQUIRE(false, "unknown stage '", st.name, "' after the scorer (allocators: ",
                    alloc_names, "; mergers: ", merger_names, "; quantizers: ", quant_names,
                    "; the first stage must be a scorer: ", scorer_names, ")");
      }
      spec_ += " | " + st.text;
    }
  }

  const std::string& spec() const { return spec_; }
  // True for a quantizer-only spec ("int2"): no scorer, every token is kept (and packed by a
  // Session). Such a policy accepts only budgets that keep every token.
  bool keeps_all() const { return keep_all_; }
  // The scorer's spec name (a plug-in's own name for External; empty for a quantizer-only spec).
  std::string_view scorer_name() const {
    if (keep_all_) return {};
    if (const auto* e = std::get_if<External>(&scorer_)) return e->plugin_name();
    return std::visit([](const auto& s) { return std::string_view(s.name); }, scorer_);
  }
  const AnyScorer& scorer() const { return scorer_; }
  // What the scorer and the allocators read.
  Needs needs() const {
    if (keep_all_) return Needs::none;
    return std::visit([](const auto& s) { return s.needs(); }, scorer_) | req_.needs;
  }
  // Queries the policy reads: 0 none, -1 all of them (H2O without accumulated state). An
  // allocator that reads a bounded window (ams) turns -1 into that window: with it, the
  // accumulated statistics are the only way H2O can be served.
  std::int64_t query_window() const {
    if (keep_all_) return 0;
    const std::int64_t s = std::visit([](const auto& s) { return s.query_window(); }, scorer_);
    if (s < 0) return req_.window > 0 ? req_.window : -1;
    return std::max(s, req_.window);
  }
  // Tokens always kept: the scorer's, widened by the allocators' own (ams sinks and last tokens).
  Protect protect(std::int64_t tokens, std::int64_t budget) const {
    if (keep_all_) return {};
    const Protect p = std::visit([&](const auto& s) { return s.protect(tokens, budget); }, scorer_);
    return {std::max(p.sinks, req_.protect.sinks), std::max(p.recent, req_.protect.recent)};
  }
  const std::vector<AnyAllocator>& allocators() const { return allocators_; }
  // True when a stage combines KV heads (adakv, tova, expected): under tensor parallelism over
  // KV heads the ranks then exchange data through EventInfo::shard's all-gather
  // (core/head_shard.hpp); other policies run on each rank's heads alone.
  bool spans_heads() const {
    if (keep_all_) return false;
    return req_.spans_heads ||
           std::visit([](const auto& s) { return detail::spans_heads<std::decay_t<decltype(s)>>(); },
                      scorer_);
  }
  // True when an allocator keeps per-token state across events (ams credit): the owner of the
  // cache should then pass EventInfo::alloc_state and compact it with K/V.
  bool alloc_state() const { return req_.state; }
  // The policy for events whose per-head budgets are already fixed (a Session's compressions
  // after the first): the layer and head allocators (pyramid, depthkv, adakv), which decided
  // those budgets at the first event, are left out; scorer, segment allocators (ams) and
  // requirements stay. Re-running them would re-split budgets that are no longer uniform.
  Policy with_fixed_budgets() const {
    Policy p = *this;
    p.allocators_.clear();
    for (const auto& a : allocators_) {
      const bool keep = std::visit(
          [](const auto& al) {
            constexpr AllocLevel lv = detail::alloc_level<std::decay_t<decltype(al)>>();
            return lv != AllocLevel::layers && lv != AllocLevel::heads;
          },
          a);
      if (keep) p.allocators_.push_back(a);
    }
    return p;
  }
  // The merger stage (semantic, nearest), if any; see merge().
  const std::optional<AnyMerger>& merger() const { return merger_; }
  // The quantizer stage (int2, int4, kivi), if any, and its format.
  const std::optional<AnyQuantizer>& quantizer() const { return quantizer_; }
  std::optional<quant::QuantConfig> quant_config() const {
    if (!quantizer_) return std::nullopt;
    return std::visit([](const auto& q) { return q.config; }, *quantizer_);
  }
  std::string quantizer_name() const {
    if (!quantizer_) return {};
    return std::string(std::visit([](const auto& q) { return q.name; }, *quantizer_));
  }
  // Folds evicted tokens into kept ones with the merger (no-op without one); see MergeArgs.
  template <Element T>
  void merge(const cpu_backend& be, const MergeArgs<T>& args) const;
  // Chunk delimiters of a semantic merger (its default set without one): what an engine's
  // per-token delimiter mask is built from.
  // (A merger that reads delimiters has `is_delimiter(text)` and `delimiters`.)
  bool is_delimiter(std::string_view token_text) const {
    return with_delimiters([&](const auto& m) { return m.is_delimiter(token_text); });
  }
  std::string delimiter_set() const {
    return with_delimiters([](const auto& m) { return std::string(m.delimiters); });
  }

  // How an accumulating scorer (H2O) reduces a query group's attention into its per-token sums,
  // or nothing for scorers without accumulated state (detail::accumulates).
  std::optional<GqaReduce> accumulation() const {
    if (keep_all_) return std::nullopt;
    return std::visit(
        [](const auto& s) -> std::optional<GqaReduce> {
          if constexpr (detail::accumulates<std::decay_t<decltype(s)>>()) return s.accumulation();
          return std::nullopt;
        },
        scorer_);
  }
  // True for policies that evict at every decode step once the budget is reached: those whose
  // scorer accumulates (H2O).
  bool decode_time() const { return accumulation().has_value(); }

  // See Pipeline::select.
  template <Element T>
  Selection select(const cpu_backend& be, const Inputs<T>& in, const Budget& budget,
                   ScoreMap* scores = nullptr) const {
    return select(be, in, budget, EventInfo{}, scores);
  }
  // `protect`, if given, receives the tokens the selection protected (what MergeArgs needs).
  template <Element T>
  Selection select(const cpu_backend& be, const Inputs<T>& in, const Budget& budget,
                   const EventInfo& ev, ScoreMap* scores = nullptr,
                   Protect* protect = nullptr) const;

  // Selects and compacts keys/values in place; see Pipeline::compress.
  template <Element T>
  Selection compress(const cpu_backend& be, const KVView<T>& keys, const KVView<T>& values,
                     const Inputs<T>& in, const Budget& budget) const;

 private:
  // f(the merger, if it reads delimiters, else the default semantic merger).
  template <class F>
  auto with_delimiters(F&& f) const -> decltype(f(Semantic{})) {
    if (merger_)
      return std::visit(
          [&](const auto& m) {
            if constexpr (requires { m.is_delimiter(std::string_view{}); }) return f(m);
            else return f(Semantic{});
          },
          *merger_);
    return f(Semantic{});
  }

  // A quantizer-only policy's selection: every token, after the same input and event checks a
  // scorer's selection makes; a budget that would evict is refused.
  template <Element T>
  Selection select_all(const Inputs<T>& in, const Budget& budget, const EventInfo& ev,
                       ScoreMap* scores, Protect* protect) const {
    validate(in, Needs::none, 0);
    const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens();
    detail::check_event_layers(ev, L);
    if (ev.shard) detail::check_shard(*ev.shard, H);
    const std::int64_t Hm = detail::model_heads(ev.shard, H);
    const std::int64_t kept = budget.global(L, Hm, Tk);
    KVP_REQUIRE(kept >= L * Hm * Tk, "policy '", spec_, "' has no scorer and keeps every token; ",
                "the budget keeps ", kept, " of ", L * Hm * Tk,
                " (to evict, put a scorer first, e.g. 'snapkv | ", spec_, "')");
    if (protect) *protect = {};
    if (scores) scores->resize(L, H, Tk, 0.0f);
    return Selection::all(L, H, Tk);
  }

  bool keep_all_ = false;
  AnyScorer scorer_;
  std::vector<AnyAllocator> allocators_;
  std::optional<AnyMerger> merger_;
  std::optional<AnyQuantizer> quantizer_;
  AllocRequirements req_;
  std::string spec_;
};

// merge, select and compress are defined out of the class, so they are not implicitly inline:
// these three instantiate every scorer, allocator and merger of the registry, and a build that
// compiles them once for float (src/instances/policy.cpp, the CMake target kvpolicy_instances)
// declares them extern in its other units (KVPOLICY_EXTERN_TEMPLATES).
// Header-only users are unaffected: without the macro each unit instantiates what it uses.
template <Element T>
void Policy::merge(const cpu_backend& be, const MergeArgs<T>& args) const {
  if (merger_) std::visit([&](const auto& m) { m.merge(be, args); }, *merger_);
}

template <Element T>
Selection Policy::select(const cpu_backend& be, const Inputs<T>& in, const Budget& budget,
                         const EventInfo& ev, ScoreMap* scores, Protect* protect) const {
  if (keep_all_) return select_all(in, budget, ev, scores, protect);
  Stats stats;
  return std::visit(
      [&](const auto& s) {
        return detail::select_tokens(
            be, s,
            [&](const AllocContext& ctx, std::span<std::int64_t> b) {
              for (const auto& a : allocators_)
                std::visit([&](const auto& al) { al.allocate(ctx, b); }, a);
            },
            req_, in, budget, stats, scores, ev, protect);
      },
      scorer_);
}

template <Element T>
Selection Policy::compress(const cpu_backend& be, const KVView<T>& keys, const KVView<T>& values,
                           const Inputs<T>& in, const Budget& budget) const {
  return detail::compress_in_place(*this, be, keys, values, in, budget);
}

// KVPOLICY_POLICY_INSTANCES(extern, T) declares the instances of one element type;
// KVPOLICY_POLICY_INSTANCES(, T) defines them (src/instances/policy.cpp).
#define KVPOLICY_POLICY_INSTANCES(EXTERN, T)                                                     \
  EXTERN template void Policy::merge<T>(const cpu_backend&, const MergeArgs<T>&) const;          \
  EXTERN template Selection Policy::select<T>(const cpu_backend&, const Inputs<T>&,              \
                                              const Budget&, const EventInfo&, ScoreMap*,        \
                                              Protect*) const;                                   \
  EXTERN template Selection Policy::compress<T>(const cpu_backend&, const KVView<T>&,            \
                                                const KVView<T>&, const Inputs<T>&,              \
                                                const Budget&) const;
#ifdef KVPOLICY_EXTERN_TEMPLATES
KVPOLICY_POLICY_INSTANCES(extern, float)
#endif

}  // namespace kvpolicy
