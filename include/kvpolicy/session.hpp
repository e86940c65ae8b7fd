// Session: the KV cache of one sequence, all layers, as a policy sees it. An engine, per layer:
//   append(l, k_new, v_new, q_new)   new tokens' K/V (and queries when the policy reads them)
//   attend(l, q, out)                attention over the cache (updates H2O accumulators)
//   compress_if_due(l)               prefill compression to the budget, then for decode-time
//                                    policies (H2O) greedy eviction back to it after each step
// and reads the ragged cache back with keys(l) / values(l) / lengths(l). Storage is per layer,
// HND, one capacity for all heads of a layer; every KV head has its own length, so per-head
// budgets shrink memory for real. Per-token state (original positions, H2O accumulators and
// observation counts) is compacted together with K/V.
#pragma once
#include <algorithm>
#include <numeric>
#include <span>
#include <vector>

#include "kvpolicy/cpu/attention.hpp"
#include "kvpolicy/policy.hpp"

namespace kvpolicy {

struct SessionConfig {
  std::int64_t layers = 0, kv_heads = 0, q_heads = 0, head_dim = 0;
  // Tokens kept per KV head after prefill compression (ratio of the prefill length, or tokens).
  // Decode-time policies evict back to the same per-head count after every step.
  Budget budget = Budget::ratio(1.0);
  std::int64_t initial_capacity = 256;  // tokens; storage grows by doubling
  cpu_backend backend{};
};

template <Element T>
class Session {
 public:
  Session(Policy policy, SessionConfig cfg) : policy_(std::move(policy)), cfg_(cfg) {
    KVP_REQUIRE(cfg.layers > 0 && cfg.kv_heads > 0 && cfg.head_dim > 0,
                "session: layers, kv_heads and head_dim must be positive (got ", cfg.layers,
                ", ", cfg.kv_heads, ", ", cfg.head_dim, ")");
    KVP_REQUIRE(cfg.q_heads > 0 && cfg.q_heads % cfg.kv_heads == 0, "session: q_heads ",
                cfg.q_heads, " is not a positive multiple of kv_heads ", cfg.kv_heads);
    KVP_REQUIRE(cfg.initial_capacity > 0, "session: initial_capacity must be positive");
    cfg.budget.validate();
    if (const auto* h2o = std::get_if<H2O>(&policy_.scorer()))
      KVP_REQUIRE(h2o->reduce != GqaReduce::max,
                  "session: h2o with reduce=max cannot be accumulated step by step; use mean or sum");
    window_ = std::max<std::int64_t>(0, policy_.query_window());
    layers_.resize(static_cast<std::size_t>(cfg.layers));
    for (auto& L : layers_) {
      L.lengths.assign(static_cast<std::size_t>(cfg.kv_heads), 0);
      reserve(L, cfg.initial_capacity);
    }
  }

  const Policy& policy() const { return policy_; }
  const SessionConfig& config() const { return cfg_; }

  // Appends n tokens to every KV head of `layer`. k, v: [1][Hkv][n][d]; q: [1][Hq][n][d] or empty.
  void append(std::int64_t layer, const KVView<const T>& k, const KVView<const T>& v,
              const KVView<const T>& q = {}) {
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
    require_finite(k, "k");
    require_finite(v, "v");
    const std::int64_t n = k.tokens;
    const std::int64_t maxlen = *std::max_element(L.lengths.begin(), L.lengths.end());
    if (maxlen + n > L.capacity) reserve(L, std::max(2 * L.capacity, maxlen + n));
    for (std::int64_t h = 0; h < cfg_.kv_heads; ++h) {
      const std::int64_t len = L.lengths[static_cast<std::size_t>(h)];
      for (std::int64_t t = 0; t < n; ++t) {
        copy_row(k, h, t, L.k.data() + (h * L.capacity + len + t) * cfg_.head_dim);
        copy_row(v, h, t, L.v.data() + (h * L.capacity + len + t) * cfg_.head_dim);
        const auto s = static_cast<std::size_t>(h * L.capacity + len + t);
        L.positions[s] = static_cast<std::int32_t>(L.next_position + t);
        L.acc[s] = 0.f;
        L.observed[s] = 0.f;
      }
      L.lengths[static_cast<std::size_t>(h)] = len + n;
    }
    L.next_position += n;
    if (window_ > 0 && q.data) push_queries(L, q);
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
    if (has(policy_.needs(), Needs::accumulated)) {
      args.accumulate = L.acc.data();
      args.observed = L.observed.data();
      args.state_stride = L.capacity;
      const auto* h2o = std::get_if<H2O>(&policy_.scorer());
      args.acc_scale = h2o && h2o->reduce == GqaReduce::sum
                           ? 1.0f
                           : 1.0f / static_cast<float>(cfg_.q_heads / cfg_.kv_heads);
    }
    cpu::attention(cfg_.backend, keys(layer), values(layer), q, args, out);
  }

  // Compresses `layer` if it is due: the first call (prefill) compresses to the configured
  // budget; later calls evict back to it for decode-time policies. Returns true if it compacted.
  bool compress_if_due(std::int64_t layer) {
    Layer& L = at(layer);
    if (L.budgets.empty()) {
      if (L.lengths[0] == 0) return false;  // no prefill yet: nothing to fix the budgets from
      compress(layer);
      return true;
    }
    if (!policy_.decode_time()) return false;
    for (std::int64_t h = 0; h < cfg_.kv_heads; ++h)
      if (L.lengths[static_cast<std::size_t>(h)] > L.budgets[static_cast<std::size_t>(h)]) {
        compress(layer);
        return true;
      }
    return false;
  }

  // Compresses `layer` now. The first call fixes the per-head budgets from the configured Budget
  // and the current length; later calls compress back to them.
  Selection compress(std::int64_t layer) {
    Layer& L = at(layer);
    const std::int64_t H = cfg_.kv_heads, d = cfg_.head_dim;
    const std::int64_t len = *std::max_element(L.lengths.begin(), L.lengths.end());
    const bool ragged = *std::min_element(L.lengths.begin(), L.lengths.end()) != len;
    if (L.budgets.empty() && len == 0) return Selection(1, H);  // ratio of nothing
    // Fixed only once the selection succeeded: a failed first compression (budget below the
    // protected count) must leave the layer as it was, still due.
    std::vector<std::int64_t> budgets = L.budgets;
    if (budgets.empty())
      budgets = cfg_.budget.kind() == Budget::Kind::per_head
                    ? std::vector<std::int64_t>(static_cast<std::size_t>(H),
                                                static_cast<std::int64_t>(cfg_.budget.value()))
                    : cfg_.budget.resolve(1, H, len);
    Inputs<T> in;
    in.keys = keys(layer).prefix(len);
    in.values = values(layer).prefix(len);
    if (window_ > 0 && L.q_count > 0) {
      in.queries = KVView<const T>::hnd(L.q.data() + (window_ - L.q_count) * d, 1, cfg_.q_heads,
                                        L.q_count, d);
      in.queries.stride_head = window_ * d;
    }
    in.accumulated = L.acc.data();
    in.observed = L.observed.data();
    in.state_stride = L.capacity;
    Selection sel(1, H);
    if (!ragged) {
      sel = policy_.select(cfg_.backend, in, Budget::total(std::accumulate(
                                                 budgets.begin(), budgets.end(), std::int64_t{0})));
    } else {
      // Heads of different lengths (a budget that does not divide evenly, or per-head budgets):
      // each KV head, with its own query group and state, is an event of its own.
      const std::int64_t g = cfg_.q_heads / H;
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t n = L.lengths[static_cast<std::size_t>(h)];
        Inputs<T> one = in;
        one.keys = head_view(in.keys, h, n);
        one.values = head_view(in.values, h, n);
        if (in.queries.data) {
          one.queries.data = in.queries.row(0, h * g, 0);
          one.queries.heads = g;
        }
        one.accumulated = in.accumulated + h * L.capacity;
        one.observed = in.observed + h * L.capacity;
        sel.kept(0, h) = policy_.select(cfg_.backend, one,
                                        Budget::total(budgets[static_cast<std::size_t>(h)]))
                             .kept(0, 0);
      }
    }
    L.budgets = std::move(budgets);
    const KVView<T> kv = KVView<T>::hnd(L.k.data(), 1, cfg_.kv_heads, len, cfg_.head_dim);
    KVView<T> k_mut = kv, v_mut = kv;
    k_mut.stride_head = v_mut.stride_head = L.capacity * cfg_.head_dim;
    v_mut.data = L.v.data();
    cpu::compact(cfg_.backend, k_mut, sel);
    cpu::compact(cfg_.backend, v_mut, sel);
    cpu::compact_state(cfg_.backend, L.positions.data(), 0, L.capacity, sel);
    cpu::compact_state(cfg_.backend, L.acc.data(), 0, L.capacity, sel);
    cpu::compact_state(cfg_.backend, L.observed.data(), 0, L.capacity, sel);
    for (std::int64_t h = 0; h < cfg_.kv_heads; ++h)
      L.lengths[static_cast<std::size_t>(h)] = sel.count(0, h);
    return sel;
  }

  // One-layer views over the storage; tokens = capacity, valid rows per head = lengths(l)[h].
  KVView<const T> keys(std::int64_t layer) const { return view(at(layer), at(layer).k); }
  KVView<const T> values(std::int64_t layer) const { return view(at(layer), at(layer).v); }
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
  // Per-head token budgets fixed at the first compression (empty before it).
  std::span<const std::int64_t> budgets(std::int64_t layer) const { return at(layer).budgets; }
  // Bytes of K and V held by valid tokens (what a tight allocator would need).
  std::size_t kv_bytes() const {
    std::size_t n = 0;
    for (const auto& L : layers_)
      for (auto len : L.lengths) n += static_cast<std::size_t>(len) * cfg_.head_dim * 2 * sizeof(T);
    return n;
  }

 private:
  struct Layer {
    std::int64_t capacity = 0, next_position = 0, q_count = 0;
    std::vector<T> k, v, q;  // k, v: [Hkv][capacity][d]; q: [Hq][window][d], newest last
    std::vector<std::int32_t> positions;
    std::vector<float> acc, observed;
    std::vector<std::int64_t> lengths, budgets;
  };

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

  KVView<const T> view(const Layer& L, const std::vector<T>& buf) const {
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
    regrow(L.k, d);
    regrow(L.v, d);
    regrow(L.positions, 1);
    regrow(L.acc, 1);
    regrow(L.observed, 1);
    L.capacity = cap;
    if (L.q.empty() && window_ > 0)
      L.q.assign(static_cast<std::size_t>(cfg_.q_heads * window_ * d), T{});
  }

  // Keeps the newest `window_` queries per query head, oldest first.
  void push_queries(Layer& L, const KVView<const T>& q) {
    const std::int64_t d = cfg_.head_dim, n = std::min(q.tokens, window_);
    const std::int64_t shift = std::min(window_ - n, L.q_count);  // old queries that stay
    for (std::int64_t h = 0; h < cfg_.q_heads; ++h) {
      T* base = L.q.data() + h * window_ * d;
      std::copy(base + (window_ - shift) * d, base + window_ * d, base + (window_ - shift - n) * d);
      for (std::int64_t t = 0; t < n; ++t)
        copy_row(q, h, q.tokens - n + t, base + (window_ - n + t) * d);
    }
    L.q_count = shift + n;
  }

  Policy policy_;
  SessionConfig cfg_;
  std::int64_t window_ = 0;
  std::vector<Layer> layers_;
};

}  // namespace kvpolicy
