// Session: the KV cache of one sequence, all layers, as a policy sees it. An engine, per layer:
//   append(l, k_new, v_new, q_new)   new tokens' K/V (and queries when the policy reads them)
//   attend(l, q, out)                attention over the cache (updates H2O accumulators)
//   compress_if_due(l)               prefill compression to the budget, then decode-time
//                                    compression back to the targets every decode_interval
//                                    tokens (every token for H2O; see SessionConfig)
// and reads the ragged cache back with keys(l) / values(l) / lengths(l). Storage is per layer,
// HND, one capacity for all heads of a layer; every KV head has its own length, so per-head
// budgets shrink memory for real. Per-token state (original positions, H2O accumulators and
// observation counts, allocator state, merge counts and chunk delimiters) is compacted together
// with K/V.
// With a merger stage (semantic, nearest), each compression folds evicted tokens into kept rows
// before compacting (MergeArgs: the event's scores and protected tokens), every row carries
// log(count) (log_counts()) and attend() adds it to the row's logit (proportional attention).
// append() takes an optional per-token delimiter mask (1 where a token ends a chunk; the engine
// builds it from token text with Policy::is_delimiter); the semantic merger then cuts chunks at
// delimiters, and the mask it writes back (the last kept row of each chunk) is compacted with
// the cache, so boundaries survive the eviction of the delimiter tokens themselves. Without a
// mask, semantic uses fixed-size chunks.
// With a quantizer stage (int2, int4, kivi), eviction comes first and the survivors are then
// quantized: at its first compression a layer moves every head into a quant::PackedCache (packed
// tiles + fp32 residual window) and frees its full-precision storage; later tokens are appended
// to the packed caches and attend() reads them with quant::packed_attention (never dequantizing
// the whole cache). A packed cache is compressed once: decode-time eviction (h2o, a
// decode_interval) and H2O statistics (record_attention) are rejected with a quantizer, and
// keys()/values() are unavailable for a quantized layer (packed() gives its caches).
// Context reconstruction (kvzip): between the prefill and the first compression, an engine may
// run a pass that repeats the context and hand each chunk's Q/K/V to reconstruct(l, ...); the
// largest attention every cached token receives is kept as its reconstruction score, compacted
// with the cache like the other per-token state.
#pragma once
#include <algorithm>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpolicy/cpu/attention.hpp"
#include "kvpolicy/policy.hpp"
#include "kvpolicy/quant/attention.hpp"
#include "kvpolicy/quant/packed_cache.hpp"

namespace kvpolicy {

namespace detail {
// The newest `window` queries of every query head, in a ring buffer: push() costs O(new
// queries) whatever the window; newest(n) unrolls the newest n of them, oldest first. The
// buffer is allocated at the first push.
template <Element T>
class QueryRing {
 public:
  QueryRing() = default;
  QueryRing(std::int64_t heads, std::int64_t window, std::int64_t dim)
      : heads_(heads), window_(window), dim_(dim) {}

  std::int64_t window() const { return window_; }
  std::int64_t size() const { return count_; }  // queries held, at most window()

  // Adds the queries of q ([1][heads][n][dim]); only the newest window() of them can stay.
  void push(const KVView<const T>& q) {
    if (window_ == 0 || !q.data) return;
    if (buf_.empty()) buf_.assign(static_cast<std::size_t>(heads_ * window_ * dim_), T{});
    const std::int64_t n = std::min(q.tokens, window_);
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t slot = (next_ + t) % window_;
      for (std::int64_t h = 0; h < heads_; ++h)
        for (std::int64_t i = 0; i < dim_; ++i)
          buf_[static_cast<std::size_t>((h * window_ + slot) * dim_ + i)] =
              q.at(0, h, q.tokens - n + t, i);
    }
    next_ = (next_ + n) % window_;
    count_ = std::min(window_, count_ + n);
  }

  // The newest n <= size() queries as a [1][heads][n][dim] view over `out`, oldest first.
  KVView<const T> newest(std::int64_t n, std::vector<T>& out) const {
    KVP_REQUIRE(n >= 0 && n <= count_, "query ring: ", n, " queries asked, ", count_, " held");
    out.resize(static_cast<std::size_t>(heads_ * n * dim_));
    for (std::int64_t h = 0; h < heads_; ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t slot = ((next_ - n + t) % window_ + window_) % window_;
        std::copy_n(buf_.data() + (h * window_ + slot) * dim_, dim_, out.data() + (h * n + t) * dim_);
      }
    return KVView<const T>::hnd(out.data(), 1, heads_, n, dim_);
  }

 private:
  std::vector<T> buf_;  // [heads][window][dim]
  std::int64_t heads_ = 0, window_ = 0, dim_ = 0;
  std::int64_t count_ = 0, next_ = 0;  // valid entries, next slot to write
};
// A layer's compression schedule: the first (prefill) event fixes one budget per head; after it,
// once `interval` tokens have been appended since the last event, the heads longer than their
// budgets are compressed back to them. Decode targets, when configured, replace the prefill
// budgets at the first decode-time check (computed from the prompt length).
struct CompressionSchedule {
  std::vector<std::int64_t> budgets;  // per head; empty until the first event
  std::int64_t since = 0;             // tokens appended since the last event
  std::int64_t prompt_length = 0;     // the longest head at the first event
  bool targets_set = false;           // the decode targets replaced the prefill budgets

  bool started() const { return !budgets.empty(); }
  void appended(std::int64_t n) { since += n; }
  // Forgets the budgets (a fork to another policy or budget starts over); `since` stays.
  void restart() {
    budgets.clear();
    targets_set = false;
  }
  // An event with per-head budgets `requested` kept kept[h] of lengths[h] tokens (longest head:
  // `len`). At the first event the targets are what each head kept where it evicted
  // (allocators may have moved budget between heads); a head that kept everything keeps its
  // requested budget, so a budget above the prompt length lets the cache grow to it.
  void compressed(std::vector<std::int64_t> requested, std::span<const std::int64_t> kept,
                  std::span<const std::int64_t> lengths, std::int64_t len) {
    if (!started()) {
      prompt_length = len;
      for (std::size_t h = 0; h < requested.size(); ++h)
        if (kept[h] < lengths[h]) requested[h] = kept[h];
    }
    budgets = std::move(requested);
    since = 0;
  }
  // After the first event: true when `interval` tokens have arrived since the last one and a
  // head is longer than its budget. targets(prompt_length) -> optional per-head decode targets,
  // asked once.
  template <class Targets>
  bool due(std::int64_t interval, std::span<const std::int64_t> lengths, Targets&& targets) {
    if (!started() || interval == 0 || since < interval) return false;
    if (!targets_set) {
      if (auto t = targets(prompt_length)) {
        budgets = std::move(*t);
        targets_set = true;
      }
    }
    for (std::size_t h = 0; h < lengths.size(); ++h)
      if (lengths[h] > budgets[h]) return true;
    return false;
  }
};

}  // namespace detail

struct SessionConfig {
  std::int64_t layers = 0, kv_heads = 0, q_heads = 0, head_dim = 0;
  // Tokens kept per KV head after prefill compression (ratio of the prefill length, tokens per
  // head, or a total over a layer's heads; tokens and totals above the prompt length are not
  // clamped to it: the cache grows to them before evicting). Decode-time policies evict back to
  // the same per-head count after every step.
  Budget budget = Budget::ratio(1.0);
  std::int64_t initial_capacity = 256;  // tokens; storage grows by doubling
  cpu_backend backend{};
  // Recording for fork(): keep at least this many of the newest queries per query head, and
  // accumulate H2O statistics (mean attention over each KV head's query group) even when the
  // session's own policy reads neither. A full-cache session that records both can be forked
  // into any policy whose window is at most `record_queries`.
  std::int64_t record_queries = 0;
  bool record_attention = false;
  // The model's inverse RoPE frequencies [head_dim / 2] (Hugging Face's half-split rotation),
  // for scorers that rotate queries to future positions (expected). Empty: unknown; such a
  // scorer then needs theta= in its spec.
  std::vector<float> rope_inv_freq;
  // Decode-time compression, after the prefill compression: once `decode_interval` tokens have
  // been appended since a layer's last compression, every head of it longer than its target is
  // compressed back to exactly the target (so the cache oscillates between target and
  // target + interval). 0: the policy's default, which is every token for decode-time
  // policies (H2O) and never for the others. Targets: `decode_target` per head
  // (Budget::tokens(n): n; Budget::total(n): n split over a layer's heads, neither clamped to
  // the prompt; Budget::ratio(r): round(r * prompt length)); unset: what the prefill
  // compression kept per head (or its per-head budget where it kept everything). Statistics are
  // not recomputed: H2O sums and recorded queries carry over and are compacted with the tokens.
  std::int64_t decode_interval = 0;
  std::optional<Budget> decode_target;
};

namespace detail {
// The checks of a SessionConfig that every session makes (kvpolicy::Session, cuda::Session);
// `who` starts each message.
inline void check_session_config(const Policy& policy, const SessionConfig& cfg, const char* who) {
  KVP_REQUIRE(cfg.layers > 0 && cfg.kv_heads > 0 && cfg.head_dim > 0,
              who, ": layers, kv_heads and head_dim must be positive (got ", cfg.layers,
              ", ", cfg.kv_heads, ", ", cfg.head_dim, ")");
  KVP_REQUIRE(cfg.q_heads > 0 && cfg.q_heads % cfg.kv_heads == 0, who, ": q_heads ",
              cfg.q_heads, " is not a positive multiple of kv_heads ", cfg.kv_heads);
  KVP_REQUIRE(cfg.initial_capacity > 0, who, ": initial_capacity must be positive");
  KVP_REQUIRE(cfg.rope_inv_freq.empty() ||
                  static_cast<std::int64_t>(cfg.rope_inv_freq.size()) * 2 == cfg.head_dim,
              who, ": rope_inv_freq has ", cfg.rope_inv_freq.size(),
              " frequencies; head_dim ", cfg.head_dim, " needs ", cfg.head_dim / 2);
  for (float f : cfg.rope_inv_freq)
    KVP_REQUIRE(std::isfinite(f) && f > 0, who, ": rope_inv_freq holds ", f,
                "; frequencies must be finite and positive");

  cfg.budget.validate();
  KVP_REQUIRE(policy.accumulation() != GqaReduce::max, who, ": ", policy.scorer_name(),
              " with reduce=max cannot be accumulated step by step; use mean or sum");
  KVP_REQUIRE(cfg.record_queries >= 0, who, ": record_queries must be >= 0 (got ",
              cfg.record_queries, ")");
  KVP_REQUIRE(cfg.decode_interval >= 0, who, ": decode_interval must be >= 0 (got ",
              cfg.decode_interval, "; 0 is the policy's default)");
  if (cfg.decode_target) cfg.decode_target->validate();
}

// Per-head token counts of `b` for a layer of `heads` KV heads whose prompt has `prompt` tokens:
// tokens(n) is n per head and total(n) splits n over the heads (Budget::resolve's rule); neither
// is clamped to the prompt, so a budget above it lets the cache grow to it before evicting (a
// clamped target could also fall below the tokens the policy protects, and every decode-time
// compression would throw). ratio(r) is round(r * prompt) per head.
inline std::vector<std::int64_t> head_budgets(const Budget& b, std::int64_t heads,
                                              std::int64_t prompt) {
  switch (b.kind()) {
    case Budget::Kind::per_head:
      return std::vector<std::int64_t>(static_cast<std::size_t>(heads), b.count());
    case Budget::Kind::total: {
      // Budget::resolve's split of n over the rows, without its clamp to heads * tokens (which
      // would overflow for an n near INT64_MAX).
      const std::int64_t n = b.count();
      std::vector<std::int64_t> out(static_cast<std::size_t>(heads), n / heads);
      for (std::int64_t r = 0; r < n % heads; ++r) ++out[static_cast<std::size_t>(r)];
      return out;
    }
    case Budget::Kind::ratio:
      break;
  }
  return b.resolve(1, heads, prompt);
}

// Tokens between decode-time compressions (0: none); see SessionConfig::decode_interval.
inline std::int64_t decode_interval(const Policy& p, const SessionConfig& c) {
  if (c.decode_interval > 0) return c.decode_interval;
  return p.decode_time() ? 1 : 0;
}

// Whether a layer with this schedule and these per-head lengths compresses now: its first
// compression once it holds a prefill, then every decode_interval tokens while a head is longer
// than its target (the decode targets replace the prefill budgets at the first check).
inline bool compression_due(CompressionSchedule& schedule, std::span<const std::int64_t> lengths,
                            const Policy& p, const SessionConfig& c) {
  if (!schedule.started()) return lengths[0] != 0;  // no prefill yet: nothing to fix budgets from
  return schedule.due(decode_interval(p, c), lengths, [&](std::int64_t prompt) {
    return c.decode_target ? std::optional(head_budgets(*c.decode_target, c.kv_heads, prompt))
                           : std::nullopt;
  });
}

// An accumulating scorer's per-KV-head accumulation (H2O): the sum over its query group, or
// (mean, and when only recording) that sum divided by the group size.
inline float acc_scale(const Policy& p, std::int64_t q_heads, std::int64_t kv_heads) {
  return p.accumulation() == GqaReduce::sum ? 1.0f
                                            : 1.0f / static_cast<float>(q_heads / kv_heads);
}
}  // namespace detail

template <Element T>
class Session {
 public:
  Session(Policy policy, SessionConfig cfg)
      : policy_(std::move(policy)), fixed_policy_(policy_.with_fixed_budgets()), cfg_(cfg) {
    detail::check_session_config(policy_, cfg, "session");
    check_quantizer(policy_, cfg_, "session");
    window_ = std::max<std::int64_t>({0, policy_.query_window(), cfg.record_queries});
    // Each buffer's size is a product of these; one that overflows could never be allocated
    // and would wrap around to a small size.
    const auto sz = [](std::size_t n) { return static_cast<std::int64_t>(n); };
    using detail::product_fits;
    KVP_REQUIRE(product_fits({cfg.layers, sz(sizeof(Layer))}) &&
                    product_fits({cfg.kv_heads, cfg.initial_capacity, cfg.head_dim, sz(sizeof(T))}) &&
                    product_fits({cfg.q_heads, std::max<std::int64_t>(window_, 1), cfg.head_dim,
                                  sz(sizeof(T))}),
                "session: layers ", cfg.layers, ", kv_heads ", cfg.kv_heads, ", q_heads ",
                cfg.q_heads, ", head_dim ", cfg.head_dim, ", initial_capacity ",
                cfg.initial_capacity, " and a query window of ", window_,
                " need buffers larger than the address space");
    layers_.resize(static_cast<std::size_t>(cfg.layers));
    for (auto& L : layers_) {
      L.lengths.assign(static_cast<std::size_t>(cfg.kv_heads), 0);
      L.queries = detail::QueryRing<T>(cfg.q_heads, window_, cfg.head_dim);
      reserve(L, cfg.initial_capacity);
    }
  }

  const Policy& policy() const { return policy_; }

  // A copy of this session (cache, positions, statistics, recorded queries) that will compress
  // with `policy` to `budget` at its next compress_if_due(), as if it had been created with them
  // before the prompt went in. This is how one full-cache prefill serves many policies. Requires
  // a session that has not compressed anything away yet (every head still holds every token),
  // that recorded at least the policy's query window, and, for H2O, the attention statistics.
  Session fork(Policy policy, Budget budget, std::int64_t decode_interval = 0,
               std::optional<Budget> decode_target = std::nullopt) const {
    budget.validate();
    KVP_REQUIRE(decode_interval >= 0, "session.fork: decode_interval must be >= 0 (got ",
                decode_interval, ")");
    if (decode_target) decode_target->validate();
    for (const auto& L : layers_)
      KVP_REQUIRE(!quantized(L), "session.fork: the source session is quantized; fork a "
                  "full-precision session");
    for (const auto& L : layers_)
      for (auto len : L.lengths)
        KVP_REQUIRE(len == L.next_position, "session.fork: a layer holds ", len, " of its ",
                    L.next_position, " tokens; fork only a session that kept everything");
    const std::int64_t w = policy.query_window();
    KVP_REQUIRE(w <= window_ || (w < 0 && has(policy.needs(), Needs::accumulated) &&
                                 !has(policy.needs(), Needs::queries)),
                "session.fork: policy '", policy.spec(), "' reads the last ", w,
                " queries but this session kept ", window_, " (raise SessionConfig::record_queries)");
    const bool acc = has(policy.needs(), Needs::accumulated);
    KVP_REQUIRE(!acc || tracks_attention(), "session.fork: policy '", policy.spec(),
                "' reads accumulated attention but this session did not record it (set "
                "SessionConfig::record_attention)");
    KVP_REQUIRE(policy.accumulation() != GqaReduce::max, "session: ", policy.scorer_name(),
                " with reduce=max cannot be accumulated step by step; use mean or sum");
    if (has(policy.needs(), Needs::reconstruction))
      for (std::int64_t l = 0; l < cfg_.layers; ++l)
        KVP_REQUIRE(layers_[static_cast<std::size_t>(l)].reconstructed, "session.fork: policy '",
                    policy.spec(), "' reads context-reconstruction scores but layer ", l,
                    " has none; run the reconstruction pass (reconstruct()) before forking");
    Session out = *this;
    const float from = acc_scale(policy_), to = acc_scale(policy);
    out.policy_ = std::move(policy);
    out.fixed_policy_ = out.policy_.with_fixed_budgets();
    out.cfg_.budget = budget;
    out.cfg_.decode_interval = decode_interval;
    out.cfg_.decode_target = decode_target;
    // A quantized fork reads no attention statistics (packed attention does not accumulate).
    if (out.policy_.quantizer()) out.cfg_.record_attention = false;
    check_quantizer(out.policy_, out.cfg_, "session.fork");
    if (out.policy_.quantizer())  // what the packed caches will take: refused here, not later
      for (std::int64_t l = 0; l < cfg_.layers; ++l) {
        const Layer& L = layers_[static_cast<std::size_t>(l)];
        quant::require_quantizable(keys(l).prefix(L.next_position), "session.fork: k");
        quant::require_quantizable(values(l).prefix(L.next_position), "session.fork: v");
      }
    for (auto& L : out.layers_) {
      L.schedule.restart();
      // A stateful allocator (AMS) starts from zero credit, as on a first event.
      if (out.policy_.alloc_state())
        L.credit.assign(static_cast<std::size_t>(cfg_.kv_heads * L.capacity), 0.f);
      else
        L.credit.clear();
      if (acc && from != to)
        for (auto& a : L.acc) a *= to / from;
    }
    return out;
  }
  const SessionConfig& config() const { return cfg_; }
  // Sets the storage of `layer` to `tokens` per head, or to its longest head if that is more
  // (growing or shrinking it; the cache is unchanged). An engine that knows how long its heads
  // will get (decode-time targets + interval) reserves that once instead of growing by doubling.
  void reserve(std::int64_t layer, std::int64_t tokens) {
    Layer& L = at(layer);
    KVP_REQUIRE(tokens > 0, "session.reserve: tokens must be positive (got ", tokens, ")");
    KVP_REQUIRE(detail::product_fits({cfg_.kv_heads, tokens, cfg_.head_dim,
                                      static_cast<std::int64_t>(sizeof(T))}),
                "session.reserve: ", tokens, " tokens need buffers larger than the address space");
    const std::int64_t len = *std::max_element(L.lengths.begin(), L.lengths.end());
    const std::int64_t cap = std::max(tokens, len);
    if (cap != L.capacity) reserve(L, cap);
  }

  // Appends n tokens to every KV head of `layer`. k, v: [1][Hkv][n][d]; q: [1][Hq][n][d] or empty.
  // delimiters: empty, or n flags (nonzero: the token ends a chunk for the semantic merger).
  void append(std::int64_t layer, const KVView<const T>& k, const KVView<const T>& v,
              const KVView<const T>& q = {}, std::span<const std::uint8_t> delimiters = {}) {
    Layer& L = at(layer);
    check_block(k, cfg_.kv_heads, "k");
    check_block(v, cfg_.kv_heads, "v");
    KVP_REQUIRE(v.tokens == k.tokens, "session.append: v has ", v.tokens, " tokens, k has ",
                k.tokens);
    if (q.data) {
      check_block(q, cfg_.q_heads, "q");
      KVP_REQUIRE(q.tokens == k.tokens, "session.append: q has ", q.tokens, " tokens, k has ",
                  k.tokens);
      require_finite(q, "q");
    }
    KVP_REQUIRE(q.data || !has(policy_.needs(), Needs::queries),
                "session.append: policy '", policy_.spec(), "' needs the queries; pass q");
    if (policy_.quantizer()) {  // checked before anything moves: packing them would fail later
      quant::require_quantizable(k, "session.append: k");
      quant::require_quantizable(v, "session.append: v");
    } else {
      require_finite(k, "k");
      require_finite(v, "v");
    }
    const std::int64_t n = k.tokens;
    KVP_REQUIRE(delimiters.empty() || static_cast<std::int64_t>(delimiters.size()) == n,
                "session.append: ", delimiters.size(), " delimiter flags for ", n, " tokens");
    if (!delimiters.empty()) has_delimiters_ = true;
    const std::int64_t maxlen = *std::max_element(L.lengths.begin(), L.lengths.end());
    if (maxlen + n > L.capacity) reserve(L, std::max(2 * L.capacity, maxlen + n));
    const bool packed = quantized(L);
    for (std::int64_t h = 0; h < cfg_.kv_heads; ++h) {
      const std::int64_t len = L.lengths[static_cast<std::size_t>(h)];
      if (packed) L.packed[static_cast<std::size_t>(h)].append(k, v, 0, h, 0, n);
      for (std::int64_t t = 0; t < n; ++t) {
        if (!packed) {
          copy_row(k, h, t, L.k.data() + (h * L.capacity + len + t) * cfg_.head_dim);
          copy_row(v, h, t, L.v.data() + (h * L.capacity + len + t) * cfg_.head_dim);
        }
        const auto s = static_cast<std::size_t>(h * L.capacity + len + t);
        L.for_each_token_array([&](auto& a) {
          if (!a.empty()) a[s] = {};
        });
        L.positions[s] = static_cast<std::int32_t>(L.next_position + t);
        L.delim[s] = delimiters.empty() ? 0 : (delimiters[static_cast<std::size_t>(t)] != 0);
      }
      L.lengths[static_cast<std::size_t>(h)] = len + n;
    }
    L.next_position += n;
    L.schedule.appended(n);
    L.queries.push(q);
  }

  // Attention of q ([1][Hq][n][d], the queries of the last n appended tokens, causal among them)
  // over the layer's cache. out: fp32 [Hq][n][d]. Accumulates H2O statistics when needed.
  void attend(std::int64_t layer, const KVView<const T>& q, float* out) {
    Layer& L = at(layer);
    check_block(q, cfg_.q_heads, "q");
    KVP_REQUIRE(out != nullptr, "session.attend: out is null");
    cpu::RaggedAttentionArgs args;
    args.lengths = L.lengths.data();
    args.causal = true;
    if (tracks_attention()) {
      args.accumulate = L.acc.data();
      args.observed = L.observed.data();
      args.state_stride = L.capacity;
      args.acc_scale = acc_scale(policy_);
    }
    if (policy_.merger()) {  // proportional attention: + log(count) on every row's logit
      args.bias = L.log_count.data();
      args.bias_stride = L.capacity;
    }
    if (quantized(L)) {
      quant::PackedAttentionArgs pa;
      pa.bias = args.bias;
      pa.bias_stride = args.bias_stride;
      pa.causal = true;
      quant::packed_attention(cfg_.backend, std::span<const quant::PackedCache>(L.packed), q, pa,
                              out);
      return;
    }
    cpu::attention(cfg_.backend, keys(layer), values(layer), q, args, out);
  }

  // Context reconstruction (scorers/kvzip.hpp). q [1][Hq][n][d], k and v [1][Hkv][n][d]: n tokens
  // of the engine's reconstruction pass at this layer (a prompt asking to repeat the context,
  // then a chunk of it, teacher-forced), placed after the cache. Writes their attention over the
  // cache and their own earlier tokens (causal) to out [Hq][n][d], as append() then attend()
  // would, and raises each cached token's reconstruction score to the largest attention
  // probability it receives from these queries (over its KV head's query group). The n tokens
  // are not kept: lengths, positions, H2O statistics and recorded queries stay as they were.
  // The chunks of one pass add to the same scores; clear_reconstruction() starts over.
  void reconstruct(std::int64_t layer, const KVView<const T>& k, const KVView<const T>& v,
                   const KVView<const T>& q, float* out) {
    Layer& L = at(layer);
    KVP_REQUIRE(!quantized(L), "session.reconstruct: layer ", layer,
                " is quantized; run the reconstruction pass before the compression that packs it");
    check_block(k, cfg_.kv_heads, "k");
    check_block(v, cfg_.kv_heads, "v");
    check_block(q, cfg_.q_heads, "q");
    KVP_REQUIRE(k.tokens > 0, "session.reconstruct: no tokens");
    KVP_REQUIRE(v.tokens == k.tokens && q.tokens == k.tokens, "session.reconstruct: k, v and q "
                "hold ", k.tokens, ", ", v.tokens, " and ", q.tokens, " tokens; they must agree");
    KVP_REQUIRE(out != nullptr, "session.reconstruct: out is null");
    require_finite(k, "k");
    require_finite(v, "v");
    require_finite(q, "q");
    const std::int64_t n = k.tokens, d = cfg_.head_dim;
    const std::int64_t maxlen = *std::max_element(L.lengths.begin(), L.lengths.end());
    // Room for the chunk, exactly (no doubling: the chunk leaves again; reserve(layer, n)
    // gives the storage back).
    if (maxlen + n > L.capacity) reserve(L, maxlen + n);
    // The chunk goes, for this call only, after each head's rows (its own log(count) is 0).
    std::vector<std::int64_t> lens = L.lengths;
    for (std::int64_t h = 0; h < cfg_.kv_heads; ++h) {
      auto& len = lens[static_cast<std::size_t>(h)];
      for (std::int64_t t = 0; t < n; ++t) {
        copy_row(k, h, t, L.k.data() + (h * L.capacity + len + t) * d);
        copy_row(v, h, t, L.v.data() + (h * L.capacity + len + t) * d);
        L.log_count[static_cast<std::size_t>(h * L.capacity + len + t)] = 0.f;
      }
      len += n;
    }
    cpu::RaggedAttentionArgs args;
    args.lengths = lens.data();
    args.causal = true;
    args.max_attention = L.recon.data();
    args.state_stride = L.capacity;
    if (policy_.merger()) {
      args.bias = L.log_count.data();
      args.bias_stride = L.capacity;
    }
    cpu::attention(cfg_.backend, keys(layer), values(layer), q, args, out);
    L.reconstructed = true;
  }
  // Zeroes every reconstruction score: the next reconstruct() calls start a new pass (over a
  // longer context, say).
  void clear_reconstruction() {
    for (auto& L : layers_) {
      std::fill(L.recon.begin(), L.recon.end(), 0.f);
      L.reconstructed = false;
    }
  }
  // True once reconstruct() ran on `layer` (since the last clear_reconstruction()).
  bool reconstructed(std::int64_t layer) const { return at(layer).reconstructed; }

  // Compresses `layer` if it is due: the first call (prefill) compresses to the configured
  // budget; later calls compress back to the decode targets every decode_interval() tokens
  // (see SessionConfig). Returns true if it compacted.
  bool compress_if_due(std::int64_t layer) {
    Layer& L = at(layer);
    const bool due = detail::compression_due(L.schedule, L.lengths, policy_, cfg_);
    if (due) compress(layer);
    return due;
  }

  // Tokens between decode-time compressions (0: none); see SessionConfig::decode_interval.
  std::int64_t decode_interval() const { return detail::decode_interval(policy_, cfg_); }

  // Compresses `layer` now. The first call fixes the per-head budgets from the configured Budget
  // and the current length; later calls compress back to them.
  Selection compress(std::int64_t layer) {
    Layer& L = at(layer);
    KVP_REQUIRE(!quantized(L), "session: layer ", layer,
                " is already quantized; a packed cache is compressed once");
    const std::int64_t H = cfg_.kv_heads, d = cfg_.head_dim;
    const std::int64_t len = *std::max_element(L.lengths.begin(), L.lengths.end());
    const bool ragged = *std::min_element(L.lengths.begin(), L.lengths.end()) != len;
    if (len == 0) return Selection(1, H);  // nothing cached (and a ratio of nothing at first)
    // Fixed only once the selection succeeded: a failed first compression (bad inputs, a
    // quantizer-only policy given a budget that evicts) must leave the layer as it was, still due.
    std::vector<std::int64_t> budgets = L.schedule.budgets;
    if (budgets.empty()) budgets = head_budgets(cfg_.budget, len);
    Inputs<T> in;
    in.keys = keys(layer).prefix(len);
    in.values = values(layer).prefix(len);
    const std::int64_t pw = policy_.query_window();
    // The newest queries of the window, at most one per cached token: a policy may read more
    // queries than it protects tokens (ams), and takes no more queries than keys.
    const std::int64_t held = L.queries.size();
    const std::int64_t nq = std::min(pw < 0 ? held : std::min(held, pw), len);
    std::vector<T> qbuf;
    if (nq > 0) in.queries = L.queries.newest(nq, qbuf);
    in.accumulated = L.acc.data();
    in.observed = L.observed.data();
    if (L.reconstructed) in.reconstruction = L.recon.data();
    in.rope_inv_freq = cfg_.rope_inv_freq;
    in.first_query_position = L.next_position - nq;
    in.state_stride = L.capacity;
    Selection sel(1, H);
    // After the first event the per-head budgets are fixed: no layer/head re-allocation.
    const Policy& pol = L.schedule.started() ? fixed_policy_ : policy_;
    const bool merging = policy_.merger().has_value();
    const bool uneven = L.schedule.started() &&
                        *std::min_element(budgets.begin(), budgets.end()) !=
                            *std::max_element(budgets.begin(), budgets.end());
    // Mutable views of the layer's K and V (rows [0, len) of every head).
    KVView<T> k_mut = KVView<T>::hnd(L.k.data(), 1, H, len, d);
    k_mut.stride_head = L.capacity * d;
    KVView<T> v_mut = k_mut;
    v_mut.data = L.v.data();
    // A merger reads the event's scores and protected tokens, and only where it evicts.
    auto merge_args = [&](const KVView<T>& k, const KVView<T>& v, const Selection& s,
                          const ScoreMap& scores, const Protect& protect, std::int64_t h0) {
      MergeArgs<T> a;
      a.keys = k;
      a.values = v;
      a.selection = &s;
      a.scores = &scores;
      a.log_count = L.log_count.data() + h0 * L.capacity;
      a.log_count_stride = L.capacity;
      a.protect = protect;
      if (has_delimiters_) {  // chunk_end aliases the per-row mask: it is the next event's mask
        a.delimiter = a.chunk_end = L.delim.data() + h0 * L.capacity;
        a.delimiter_stride = a.chunk_end_stride = L.capacity;
      }
      return a;
    };
    if (!ragged && !uneven) {
      // A per-head budget above the length keeps every token; clamped, the sum cannot overflow
      // (Budget::tokens(n) with n near INT64_MAX).
      std::int64_t total = 0;
      for (const std::int64_t b : budgets) total += std::min(b, len);
      const bool evicts = total < H * len;
      ScoreMap scores;
      Protect protect;
      sel = pol.select(cfg_.backend, in, Budget::total(total),
                       EventInfo{layer, cfg_.layers, credit(L, 0), L.capacity},
                       merging && evicts ? &scores : nullptr, &protect);
      if (merging && evicts)
        pol.merge(cfg_.backend, merge_args(k_mut, v_mut, sel, scores, protect, 0));
    } else {
      // Heads of different lengths or fixed per-head budgets that differ (a budget that does not
      // divide evenly, per-head allocators): each KV head, with its own query group and state, is
      // an event of its own. Every head is selected before any is merged, so a failure leaves
      // the cache as it was.
      const std::int64_t g = cfg_.q_heads / H;
      std::vector<Selection> one_sel(static_cast<std::size_t>(H));
      std::vector<ScoreMap> one_scores(merging ? static_cast<std::size_t>(H) : 0);
      std::vector<Protect> one_protect(static_cast<std::size_t>(H));
      for (std::int64_t h = 0; h < H; ++h) {
        const auto hs = static_cast<std::size_t>(h);
        const std::int64_t n = L.lengths[hs];
        if (n == 0) {  // an empty head (a target of 0 and nothing appended since): keeps nothing
          one_sel[hs] = Selection(1, 1);
          continue;
        }
        Inputs<T> one = in;
        one.keys = head_view(in.keys, h, n);
        one.values = head_view(in.values, h, n);
        if (in.queries.data) {  // the head's query group, its newest n queries at most
          const std::int64_t m = std::min(in.queries.tokens, n);
          one.queries.data = in.queries.row(0, h * g, in.queries.tokens - m);
          one.queries.heads = g;
          one.queries.tokens = m;
        }
        one.accumulated = in.accumulated + h * L.capacity;
        one.observed = in.observed + h * L.capacity;
        if (in.reconstruction) one.reconstruction = in.reconstruction + h * L.capacity;
        const bool evicts = budgets[hs] < n;
        one_sel[hs] = pol.select(cfg_.backend, one, Budget::total(budgets[hs]),
                                 EventInfo{layer, cfg_.layers, credit(L, h), L.capacity},
                                 merging && evicts ? &one_scores[hs] : nullptr, &one_protect[hs]);
      }
      for (std::int64_t h = 0; h < H; ++h) {
        const auto hs = static_cast<std::size_t>(h);
        const std::int64_t n = L.lengths[hs];
        if (merging && one_sel[hs].count(0, 0) < n) {
          KVView<T> kh = k_mut, vh = v_mut;
          kh.data += h * L.capacity * d, vh.data += h * L.capacity * d;
          kh.heads = vh.heads = 1;
          kh.tokens = vh.tokens = n;
          pol.merge(cfg_.backend, merge_args(kh, vh, one_sel[hs], one_scores[hs],
                                             one_protect[hs], h));
        }
        sel.kept(0, h) = std::move(one_sel[hs].kept(0, 0));
        if (sel.warning().empty()) sel.set_warning(one_sel[hs].warning());
      }
    }
    if (!sel.warning().empty()) warning_ = detail::cat("session: layer ", layer, ": ", sel.warning());
    std::vector<std::int64_t> kept(static_cast<std::size_t>(H));
    for (std::int64_t h = 0; h < H; ++h) kept[static_cast<std::size_t>(h)] = sel.count(0, h);
    L.schedule.compressed(std::move(budgets), kept, L.lengths, len);
    cpu::compact(cfg_.backend, k_mut, v_mut, sel);
    L.for_each_token_array([&](auto& a) {
      if (!a.empty()) cpu::compact_state(cfg_.backend, a.data(), 0, L.capacity, sel);
    });
    for (std::int64_t h = 0; h < cfg_.kv_heads; ++h)
      L.lengths[static_cast<std::size_t>(h)] = sel.count(0, h);
    if (const auto& quantizer = policy_.quantizer()) {
      // Eviction first, then the quantizer stage packs each head's survivors (its residual window
      // fitted to them, so the packed cache never holds more bytes than the full-precision one it
      // replaces); fp storage is released.
      std::vector<quant::PackedCache> packed;
      for (std::int64_t h = 0; h < H; ++h)
        packed.push_back(std::visit(
            [&](const auto& q) {
              return q.pack(KVView<const T>(k_mut), KVView<const T>(v_mut), 0, h,
                            L.lengths[static_cast<std::size_t>(h)]);
            },
            *quantizer));
      L.packed = std::move(packed);
      std::vector<T>().swap(L.k);
      std::vector<T>().swap(L.v);
    }
    return sel;
  }

  // Gives back the storage that compression freed: every layer's capacity becomes its longest
  // head (at least 1 token). Later appends grow it again by doubling.
  void shrink_to_fit() {
    for (auto& L : layers_) {
      const std::int64_t len = *std::max_element(L.lengths.begin(), L.lengths.end());
      if (std::max<std::int64_t>(len, 1) < L.capacity) reserve(L, std::max<std::int64_t>(len, 1));
    }
  }
  // The warning of the latest compression that departed from the policy to honour the budget
  // (see Selection::warning), and clears it; empty when there was none since the last call.
  std::string take_warning() { return std::exchange(warning_, std::string()); }
  // Tokens of storage per head of `layer` (valid rows are lengths(layer)).
  std::int64_t capacity(std::int64_t layer) const { return at(layer).capacity; }

  // One-layer views over the storage; tokens = capacity, valid rows per head = lengths(l)[h].
  // Not for a quantized layer (see packed()).
  KVView<const T> keys(std::int64_t layer) const { return view(at(layer), at(layer).k, layer); }
  KVView<const T> values(std::int64_t layer) const { return view(at(layer), at(layer).v, layer); }
  // True once `layer` holds packed caches (a policy with a quantizer, after its compression).
  bool quantized(std::int64_t layer) const { return quantized(at(layer)); }
  // The packed cache of (layer, head) of a quantized layer.
  const quant::PackedCache& packed(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    KVP_REQUIRE(quantized(L), "session: layer ", layer, " is not quantized");
    KVP_REQUIRE(head >= 0 && head < cfg_.kv_heads, "session: head ", head, " is outside [0, ",
                cfg_.kv_heads, ")");
    return L.packed[static_cast<std::size_t>(head)];
  }
  std::span<const std::int64_t> lengths(std::int64_t layer) const { return at(layer).lengths; }
  std::int64_t length(std::int64_t layer, std::int64_t head) const {
    return at(layer).lengths.at(static_cast<std::size_t>(head));
  }
  // Original positions of the kept tokens of (layer, head), ascending.
  std::span<const std::int32_t> positions(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    return {L.positions.data() + head * L.capacity,
            static_cast<std::size_t>(L.lengths.at(static_cast<std::size_t>(head)))};
  }
  // H2O accumulated attention of the kept tokens of (layer, head).
  std::span<const float> accumulated(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    return {L.acc.data() + head * L.capacity,
            static_cast<std::size_t>(L.lengths.at(static_cast<std::size_t>(head)))};
  }
  // Context-reconstruction scores of the kept tokens of (layer, head) (zeros before any
  // reconstruct()).
  std::span<const float> reconstruction(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    return {L.recon.data() + head * L.capacity,
            static_cast<std::size_t>(L.lengths.at(static_cast<std::size_t>(head)))};
  }
  // Allocator state of the kept tokens of (layer, head) (AMS credit); empty for stateless
  // policies.
  std::span<const float> alloc_state(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    if (L.credit.empty()) return {};
    return {L.credit.data() + head * L.capacity,
            static_cast<std::size_t>(L.lengths.at(static_cast<std::size_t>(head)))};
  }
  // log(count) of the kept rows of (layer, head): how many tokens each stands for after merging
  // (0 for a token that stands for itself).
  std::span<const float> log_counts(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    return {L.log_count.data() + head * L.capacity,
            static_cast<std::size_t>(L.lengths.at(static_cast<std::size_t>(head)))};
  }
  // Chunk-delimiter flags of the kept rows of (layer, head) (see append()).
  std::span<const std::uint8_t> delimiters(std::int64_t layer, std::int64_t head) const {
    const Layer& L = at(layer);
    return {L.delim.data() + head * L.capacity,
            static_cast<std::size_t>(L.lengths.at(static_cast<std::size_t>(head)))};
  }
  // Per-head token budgets fixed at the first compression (empty before it).
  std::span<const std::int64_t> budgets(std::int64_t layer) const {
    return at(layer).schedule.budgets;
  }
  // Bytes of K and V held by valid tokens (what a tight allocator would need); for a quantized
  // layer, its packed caches' bytes (tiles, scales, norms and the fp32 residual window).
  std::size_t kv_bytes() const {
    std::size_t n = 0;
    for (const auto& L : layers_)
      if (quantized(L))
        for (const auto& p : L.packed) n += p.memory_bytes();
      else
        for (auto len : L.lengths) n += static_cast<std::size_t>(len) * cfg_.head_dim * 2 * sizeof(T);
    return n;
  }

 private:
  struct Layer {
    std::int64_t capacity = 0, next_position = 0;
    detail::CompressionSchedule schedule;  // when this layer compresses, and to which budgets
    std::vector<T> k, v;           // [Hkv][capacity][d]
    detail::QueryRing<T> queries;  // the newest recorded queries (the policy's window)
    bool reconstructed = false;
    std::vector<quant::PackedCache> packed;  // per KV head once quantized (k, v then empty)
    std::vector<std::int64_t> lengths;
    // The per-token arrays, [Hkv][capacity] each, in step with K/V: for_each_token_array() is
    // the one list that append() zeroes for new tokens, reserve() regrows and compress()
    // compacts, so a new one is a member here and a line there. `credit` is the one that may
    // be absent (empty): the policy keeps no allocator state.
    std::vector<std::int32_t> positions;  // original position (set by append())
    std::vector<float> acc, observed;     // H2O attention sums and the queries behind them
    std::vector<float> recon;             // context-reconstruction scores (reconstruct())
    std::vector<float> credit;            // allocator state (AMS credit)
    std::vector<float> log_count;         // merge counts, log(tokens a row stands for)
    std::vector<std::uint8_t> delim;      // 1: the row ends a chunk (semantic merger)
    template <class F>
    void for_each_token_array(F&& f) {
      f(positions), f(acc), f(observed), f(recon), f(credit), f(log_count), f(delim);
    }
  };

  // Head h's allocator state row (stride: capacity), or null for stateless policies.
  static float* credit(Layer& L, std::int64_t h) {
    return L.credit.empty() ? nullptr : L.credit.data() + h * L.capacity;
  }

  static bool quantized(const Layer& L) { return !L.packed.empty(); }

  std::vector<std::int64_t> head_budgets(const Budget& b, std::int64_t prompt) const {
    return detail::head_budgets(b, cfg_.kv_heads, prompt);
  }

  // What a quantizer stage requires of the session: a head_dim its format supports, and no
  // compression or statistics after the cache is packed.
  static void check_quantizer(const Policy& p, const SessionConfig& c, const char* who) {
    const auto qc = p.quant_config();
    if (!qc) return;
    quant::validate(*qc, c.head_dim, std::string(who) + ": " + p.quantizer_name());
    KVP_REQUIRE(!p.decode_time() && c.decode_interval == 0, who, ": policy '", p.spec(),
                "' quantizes the cache after its prefill compression and cannot evict from "
                "packed tiles later; decode-time compression (",
                p.decode_time() ? "h2o evicts at every step" : "decode_interval > 0",
                ") is not supported with a quantizer");
    KVP_REQUIRE(!c.record_attention, who, ": policy '", p.spec(),
                "': packed attention does not accumulate H2O statistics (record_attention)");
  }

  bool tracks_attention() const {
    return cfg_.record_attention || has(policy_.needs(), Needs::accumulated);
  }
  float acc_scale(const Policy& p) const {
    return detail::acc_scale(p, cfg_.q_heads, cfg_.kv_heads);
  }

  Layer& at(std::int64_t l) {
    KVP_REQUIRE(l >= 0 && l < cfg_.layers, "session: layer ", l, " is outside [0, ", cfg_.layers,
                ")");
    return layers_[static_cast<std::size_t>(l)];
  }
  const Layer& at(std::int64_t l) const { return const_cast<Session*>(this)->at(l); }

  static KVView<const T> head_view(const KVView<const T>& v, std::int64_t h, std::int64_t n) {
    KVView<const T> out = v;
    out.data = v.row(0, h, 0);
    out.heads = 1;
    out.tokens = n;
    return out;
  }

  KVView<const T> view(const Layer& L, const std::vector<T>& buf, std::int64_t layer) const {
    KVP_REQUIRE(!quantized(L), "session: layer ", layer,
                " is quantized; its keys and values live in packed caches (packed(layer, head))");
    KVView<const T> v = KVView<const T>::hnd(buf.data(), 1, cfg_.kv_heads, L.capacity,
                                             cfg_.head_dim);
    return v;
  }

  void check_block(const KVView<const T>& x, std::int64_t heads, const char* what) const {
    validate(x, what);
    KVP_REQUIRE(x.layers == 1 && x.heads == heads && x.dim == cfg_.head_dim, "session: ", what,
                " must be [1][", heads, "][n][", cfg_.head_dim, "], got [", x.layers, "][",
                x.heads, "][", x.tokens, "][", x.dim, "]");
  }

  void copy_row(const KVView<const T>& src, std::int64_t h, std::int64_t t, T* dst) const {
    for (std::int64_t i = 0; i < cfg_.head_dim; ++i) dst[i] = src.at(0, h, t, i);
  }

  void reserve(Layer& L, std::int64_t cap) {
    const std::int64_t H = cfg_.kv_heads, d = cfg_.head_dim;
    auto regrow = [&](auto& vec, std::int64_t row) {
      using V = typename std::decay_t<decltype(vec)>::value_type;
      std::vector<V> next(static_cast<std::size_t>(H * cap * row));
      for (std::int64_t h = 0; h < H && L.capacity > 0; ++h)
        std::copy_n(vec.begin() + h * L.capacity * row, L.lengths[static_cast<std::size_t>(h)] * row,
                    next.begin() + h * cap * row);
      vec.swap(next);
    };
    if (!quantized(L)) {
      regrow(L.k, d);
      regrow(L.v, d);
    }
    if (policy_.alloc_state() && L.credit.empty() && L.capacity > 0)
      L.credit.assign(static_cast<std::size_t>(H * L.capacity), 0.f);
    L.for_each_token_array([&](auto& a) {
      if (static_cast<const void*>(&a) != &L.credit || policy_.alloc_state()) regrow(a, 1);
    });
    L.capacity = cap;
  }


  Policy policy_;
  Policy fixed_policy_;  // policy_ without layer/head allocators: events after the first
  SessionConfig cfg_;
  std::int64_t window_ = 0;
  bool has_delimiters_ = false;  // some append() passed delimiter flags
  std::vector<Layer> layers_;
  std::string warning_;  // see take_warning()
};

}  // namespace kvpolicy
