// cuda::Session: kvpolicy::Session's decode loop on a GPU, for a dense-cache engine. The cache,
// the per-token state and the policy's query window live in device memory; each call enqueues
// its kernels on the session's stream.
//
//   kvpolicy::cuda::Session<half> s(kvpolicy::Policy("snapkv | adakv"), cfg, stream);
//   // per layer: device K/V/Q views of the new tokens ([1][Hkv][n][d], [1][Hq][n][d])
//   s.append(l, k, v, q);
//   s.attend(l, q, out);         // out: device fp32 [Hq][n][d]
//   s.compress_if_due(l);
//
// Same contract as kvpolicy::Session (session.hpp; SessionConfig's fields mean the same, its
// `backend`, the CPU thread count, is not used): the first compress_if_due() of a layer
// compresses its prefill to the budget, later ones compress back to the decode targets every
// decode_interval() tokens (every token for h2o). For the same policy, configuration and inputs
// it keeps the same tokens as kvpolicy::Session (tests/session/test_cuda_session.cpp compares the
// two step by step on a GPU), except where a score is a sum the device adds in another order:
// H2O's accumulated attention, expected attention's scores and AMS's window attention equal the
// CPU's to fp32 rounding, so a near-tie can fall the other way.
//
// What it runs: the scorer -> allocators -> selection chain of cuda::select (cuda/policy.hpp:
// every device scorer but kvzip, every allocator it runs), the semantic merger (cuda/merge.hpp,
// bit-identical to the CPU's for the same scores; the device's scores equal the CPU's to fp32
// rounding, so the importance-weighted means of merged rows do too; it reads the event's scores
// where select left them, and every row
// carries log(count), which attend() adds to its logit), then the compaction of K, V and every
// per-token array (original positions, H2O sums and counts, AMS credit, log counts) with the same
// selection; attend() is cuda::attention (head_dim 64, 128 or 256) and accumulates the H2O
// statistics. Layers with heads of different lengths, or fixed per-head budgets that differ
// (after adakv, or a total budget that does not divide evenly), compress head by head, as on the
// CPU; with a merger each head's merge
// follows its selection (the next selection reuses the workspace). Every event is planned, with
// the selection's own checks, before the first one runs, so only a CUDA error can stop a
// compression part-way; it then leaves earlier heads merged, or their AMS credit advanced, but
// nothing compacted. Refused by the constructor, by name: quantizer stages, the nearest merger,
// semantic(chunk=0) (chunks at delimiters only) and kvzip (its reconstruction pass), which have
// no device path here yet. Not provided:
// fork(), delimiters (semantic cuts fixed chunks).
//
// Host synchronisation, and why (each is a blocking copy or a stream synchronisation):
//   - compress(): the chain's upload of the per-row budgets (cuda/policy.hpp; one per head with
//     per-head events), then the download of the selection's row offsets (8 * (rows + 1) bytes)
//     after the compaction, and the upload of the new lengths: the host keeps every head's
//     length, which decides the next event's shapes and whether it is due. A layer that is not
//     due costs nothing.
//   - attend() of more queries than one launch holds (a prefill; see attend()): one upload of
//     every chunk's lengths.
//   - growing device memory: a layer's storage (append() past its capacity; reserve(),
//     shrink_to_fit()), the shared workspace, the CSR, the chunk buffers and the merger's
//     workspace, when a call needs more than they hold: a stream synchronisation, cudaMalloc,
//     and for storage the copy of the held rows. Growth is by doubling; reserve() the longest a
//     layer will get (decode targets + interval) to keep the decode loop free of storage growth
//     (the attention's workspace follows the longest head and may still grow, by doubling).
//   - the constructor: two blocking fills (the device lengths) and one synchronisation (the
//     first storage) per layer.
// A decode step's append() and attend() (one query per sequence) are asynchronous: lengths are
// double-buffered on the device.
// Inputs must stay valid until the stream has run the calls that read them. Appended K/V/Q are
// not checked for NaN (that would cost a synchronisation per call); the engine's own.
// Every call runs on the CUDA device that was current when the session was made, and must be
// made with it current. Not thread-safe: one session per sequence, one thread at a time.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "kvpolicy/cuda/compact.hpp"
#include "kvpolicy/cuda/decode.hpp"
#include "kvpolicy/cuda/decode_math.hpp"
#include "kvpolicy/cuda/merge.hpp"
#include "kvpolicy/cuda/policy.hpp"
#include "kvpolicy/cuda/runtime.hpp"
#include "kvpolicy/cuda/session_launch.hpp"
#include "kvpolicy/cuda/session_math.hpp"
#include "kvpolicy/session.hpp"

namespace kvpolicy::cuda {

namespace detail {
// Why `policy` cannot run in a cuda::Session for element type T ("" when it can).
template <Element T>
std::string session_unsupported(const Policy& policy) {
  const std::string who = kvpolicy::detail::cat("cuda::Session: policy '", policy.spec(), "'");
  if (const auto* sem = policy.merger() ? std::get_if<Semantic>(&*policy.merger()) : nullptr;
      sem && sem->chunk == 0)
    return who + ": semantic(chunk=0) cuts chunks at delimiters only, and the device session "
                 "takes no delimiter masks; give chunk > 0";
  if (policy.merger() && !std::holds_alternative<Semantic>(*policy.merger()))
    return who + ": merger '" +
           std::visit([](const auto& m) { return std::string(std::decay_t<decltype(m)>::name); },
                      *policy.merger()) +
           "' has no device kernel (device mergers: semantic); use kvpolicy::Session";
  if (policy.quantizer())
    return who + " has a quantizer stage (" + std::string(policy.quantizer_name()) +
           "); packed caches run in kvpolicy::Session on the CPU only so far";
  if (!policy.keeps_all() && std::holds_alternative<KVzip>(policy.scorer()))
    return who + ": kvzip needs the context-reconstruction pass (Session::reconstruct), which "
                 "the device session does not run yet";
  return unsupported_stage<T>(policy);
}
}  // namespace detail

template <Element T>
class Session {
 public:
  using element_type = T;

  // Allocates every layer's storage (cfg.initial_capacity tokens per head) on the current
  // device; all work goes to `stream` (nullptr: the legacy default stream).
  Session(Policy policy, SessionConfig cfg, void* stream = nullptr)
      : policy_(std::move(policy)), fixed_policy_(policy_.with_fixed_budgets()), cfg_(std::move(cfg)),
        stream_(stream) {
    kvpolicy::detail::check_session_config(policy_, cfg_, "cuda::Session");
    KVP_REQUIRE(cfg_.head_dim == 64 || cfg_.head_dim == 128 || cfg_.head_dim == 256,
                "cuda::Session: head_dim ", cfg_.head_dim,
                " (the device attention supports 64, 128 and 256)");
    KVP_REQUIRE(attend_rows() >= cfg_.q_heads / cfg_.kv_heads, "cuda::Session: ",
                cfg_.q_heads / cfg_.kv_heads, " query heads per KV head (q_heads ", cfg_.q_heads,
                ", kv_heads ", cfg_.kv_heads, ") at head_dim ", cfg_.head_dim, " exceed the ",
                attend_rows(), " query rows the device attention holds in ", kSharedBytes,
                " bytes of shared memory");
    if (const std::string why = detail::session_unsupported<T>(policy_); !why.empty())
      kvpolicy::detail::fail(why);
    window_ = std::max<std::int64_t>({0, policy_.query_window(), cfg_.record_queries});
    using kvpolicy::detail::product_fits;
    KVP_REQUIRE(product_fits({cfg_.layers, static_cast<std::int64_t>(sizeof(Layer))}) &&
                    product_fits({cfg_.kv_heads, cfg_.initial_capacity, cfg_.head_dim,
                              static_cast<std::int64_t>(sizeof(T))}) &&
                    product_fits({cfg_.q_heads, std::max<std::int64_t>(window_, 1), cfg_.head_dim,
                                  static_cast<std::int64_t>(sizeof(T))}),
                "cuda::Session: layers ", cfg_.layers, ", kv_heads ", cfg_.kv_heads, ", q_heads ", cfg_.q_heads,
                ", head_dim ", cfg_.head_dim, ", initial_capacity ", cfg_.initial_capacity,
                " and a query window of ", window_, " need buffers larger than the address space");
    layers_.resize(static_cast<std::size_t>(cfg_.layers));
    const auto H = static_cast<std::size_t>(cfg_.kv_heads);
    for (auto& L : layers_) {
      L.lengths.assign(H, 0);
      for (auto& b : L.lens) {
        b = DeviceBuffer(H * sizeof(std::int64_t));
        fill_bytes(b.data(), 0, b.bytes(), stream_);
      }
      if (window_ > 0)
        for (auto& w : L.window)
          w = DeviceBuffer(static_cast<std::size_t>(cfg_.q_heads * window_ * cfg_.head_dim) *
                           sizeof(T));
      grow(L, cfg_.initial_capacity);
    }
  }

  const Policy& policy() const { return policy_; }
  const SessionConfig& config() const { return cfg_; }
  void* stream() const { return stream_; }

  // As kvpolicy::Session::reserve: storage of `layer` becomes max(tokens, its longest head).
  void reserve(std::int64_t layer, std::int64_t tokens) {
    Layer& L = at(layer);
    KVP_REQUIRE(tokens > 0, "cuda::Session::reserve: tokens must be positive (got ", tokens, ")");
    KVP_REQUIRE(kvpolicy::detail::product_fits({cfg_.kv_heads, tokens, cfg_.head_dim,
                                                static_cast<std::int64_t>(sizeof(T))}),
                "cuda::Session::reserve: ", tokens,
                " tokens need buffers larger than the address space");
    const std::int64_t cap = std::max(tokens, longest(L));
    if (cap != L.capacity) grow(L, cap);
  }

  // As kvpolicy::Session::shrink_to_fit: every layer's storage becomes its longest head (at
  // least 1 token), giving back what compression freed.
  void shrink_to_fit() {
    for (auto& L : layers_) {
      const std::int64_t len = std::max<std::int64_t>(longest(L), 1);
      if (len < L.capacity) grow(L, len);
    }
  }

  // Appends n tokens to every KV head of `layer`. k, v: device [1][Hkv][n][d]; q: device
  // [1][Hq][n][d], or empty when the policy reads no queries. Any strides.
  void append(std::int64_t layer, const KVView<const T>& k, const KVView<const T>& v,
              const KVView<const T>& q = {}) {
    Layer& L = at(layer);
    check_block(k, cfg_.kv_heads, "k");
    check_block(v, cfg_.kv_heads, "v");
    KVP_REQUIRE(v.tokens == k.tokens, "cuda::Session::append: v has ", v.tokens,
                " tokens, k has ", k.tokens);
    if (q.data) {
      check_block(q, cfg_.q_heads, "q");
      KVP_REQUIRE(q.tokens == k.tokens, "cuda::Session::append: q has ", q.tokens,
                  " tokens, k has ", k.tokens);
    }
    KVP_REQUIRE(q.data || !has(policy_.needs(), Needs::queries), "cuda::Session::append: policy '",
                policy_.spec(), "' needs the queries; pass q");
    const std::int64_t n = k.tokens;
    if (n == 0) return;
    KVP_REQUIRE(L.next_position + n <= std::numeric_limits<std::int32_t>::max(),
                "cuda::Session::append: positions past 2^31 - 1 (int32 positions)");
    const std::int64_t maxlen = longest(L);
    if (maxlen + n > L.capacity) grow(L, std::max(2 * L.capacity, maxlen + n));
    // Both launches write only buffers the session does not read yet (the other window buffer,
    // the other lengths buffer, rows past every head's length): the host state moves once both
    // were enqueued, so a failed launch leaves the session as it was.
    const bool push = window_ > 0 && q.data;
    if (push) {
      WindowPushArgs w;
      w.queries = erase(q);
      w.window_in = L.window[L.cur_window].data();
      w.window_out = L.window[1 - L.cur_window].data();
      w.window = window_;
      throw_if_error(session_push_window(backend(), w), "cuda::Session::append (queries)");
    }
    SessionAppendArgs a;
    a.keys = erase(k);
    a.values = erase(v);
    a.key_store = L.k.data();
    a.value_store = L.v.data();
    a.capacity = L.capacity;
    a.lengths = L.lens[L.cur].template as<std::int64_t>();
    a.lengths_out = L.lens[1 - L.cur].template as<std::int64_t>();
    a.positions = L.positions.template as<std::int32_t>();
    a.first_position = static_cast<std::int32_t>(L.next_position);
    a.zeroed[0] = L.acc.template as<float>();
    a.zeroed[1] = L.observed.template as<float>();
    a.zeroed[2] = L.credit.template as<float>();
    a.zeroed[3] = L.log_count.template as<float>();
    throw_if_error(session_append(backend(), a), "cuda::Session::append");
    L.cur = 1 - L.cur;
    for (auto& len : L.lengths) len += n;
    L.next_position += n;
    L.schedule.appended(n);
    if (push) {
      L.cur_window = 1 - L.cur_window;
      L.held = session_math::window_held(L.held, window_, n);
    }
  }

  // Attention of q (device [1][Hq][n][d], the queries of the last n appended tokens, causal among
  // them) over the layer's cache into out (device fp32 [Hq][n][d]); accumulates the H2O
  // statistics when the policy reads them (or cfg.record_attention).
  void attend(std::int64_t layer, const KVView<const T>& q, float* out) {
    Layer& L = at(layer);
    check_block(q, cfg_.q_heads, "q");
    KVP_REQUIRE(out != nullptr, "cuda::Session::attend: out is null");
    const std::int64_t shortest = *std::min_element(L.lengths.begin(), L.lengths.end());
    KVP_REQUIRE(q.tokens >= 1 && q.tokens <= shortest, "cuda::Session::attend: q has ", q.tokens,
                " tokens; it must hold 1 to ", shortest,
                " (the shortest head's length): the newest appended tokens' queries");
    DecodeArgs args;
    args.lengths = L.lens[L.cur].template as<std::int64_t>();
    args.causal = true;
    if (tracks_attention()) {
      args.accumulate = L.acc.template as<float>();
      args.observed = L.observed.template as<float>();
      args.state_stride = L.capacity;
      args.acc_scale = kvpolicy::detail::acc_scale(policy_, cfg_.q_heads, cfg_.kv_heads);
    }
    if (policy_.merger()) {  // proportional attention: + log(count) on every row's logit
      args.bias = L.log_count.template as<float>();
      args.bias_stride = L.capacity;
    }
    // Views as long as the longest head (not the capacity): the kernel's splits cover its keys.
    const KVView<const T> k = stored(L, L.k, 0, cfg_.kv_heads, longest(L)),
                          v = stored(L, L.v, 0, cfg_.kv_heads, longest(L));
    // The device attention holds a block's query rows (group size x queries) in shared memory:
    // more than attend_rows() of them run in chunks of queries, each with its own causal horizon.
    const std::int64_t g = cfg_.q_heads / cfg_.kv_heads, n = q.tokens;
    const std::int64_t m = attend_rows() / g;  // >= 1 (checked by the constructor)
    if (n <= m) {
      ensure_workspace(attention_workspace_bytes(k, v, q, args));
      cuda::attention(backend(), k, v, q, args, out);
      return;
    }
    // Chunk [j0, j1) sees what query j1 - 1 of the block sees: each head's cache minus the block's
    // later n - j1 tokens (one upload of every chunk's lengths, then asynchronous).
    const std::int64_t H = cfg_.kv_heads, d = cfg_.head_dim, chunks = (n + m - 1) / m;
    std::vector<std::int64_t> horizon(static_cast<std::size_t>(chunks * H));
    for (std::int64_t c = 0; c < chunks; ++c)
      for (std::int64_t h = 0; h < H; ++h)
        horizon[static_cast<std::size_t>(c * H + h)] =
            session_math::chunk_horizon(L.lengths[static_cast<std::size_t>(h)], n, m, c);
    ensure(chunk_lengths_, horizon.size() * sizeof(std::int64_t));
    copy_to_device(chunk_lengths_.data(), horizon.data(), horizon.size() * sizeof(std::int64_t),
                   stream_);
    ensure(chunk_out_, static_cast<std::size_t>(cfg_.q_heads * m * d) * sizeof(float));
    KVView<const T> qc = q;
    qc.tokens = m;
    ensure_workspace(attention_workspace_bytes(k, v, qc, args));
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t j0 = c * m, mc = std::min(m, n - j0);
      qc.data = q.row(0, 0, j0);
      qc.tokens = mc;
      args.lengths = chunk_lengths_.template as<std::int64_t>() + c * H;
      cuda::attention(backend(), k, v, qc, args, chunk_out_.template as<float>());
      const std::size_t row = static_cast<std::size_t>(d) * sizeof(float);
      throw_if_error(copy_rows_on_device(backend(), out + j0 * d, static_cast<std::size_t>(n) * row,
                                         chunk_out_.data(), static_cast<std::size_t>(mc) * row,
                                         static_cast<std::size_t>(mc) * row,
                                         static_cast<std::size_t>(cfg_.q_heads)),
                     "cuda::Session::attend");
    }
  }

  // As kvpolicy::Session::compress_if_due.
  bool compress_if_due(std::int64_t layer) {
    Layer& L = at(layer);
    const bool due = kvpolicy::detail::compression_due(L.schedule, L.lengths, policy_, cfg_);
    if (due) compress(layer);
    return due;
  }

  std::int64_t decode_interval() const { return kvpolicy::detail::decode_interval(policy_, cfg_); }

  // Compresses `layer` now (see kvpolicy::Session::compress); returns the event (for per-head
  // events: whether any evicted, the first warning, head 0's protection).
  PolicyEvent compress(std::int64_t layer) {
    Layer& L = at(layer);
    const std::int64_t H = cfg_.kv_heads, g = cfg_.q_heads / H;
    const std::int64_t len = longest(L);
    if (len == 0) return {};
    const bool ragged = *std::min_element(L.lengths.begin(), L.lengths.end()) != len;
    std::vector<std::int64_t> budgets = L.schedule.budgets;
    if (budgets.empty()) budgets = kvpolicy::detail::head_budgets(cfg_.budget, H, len);
    const Policy& pol = L.schedule.started() ? fixed_policy_ : policy_;
    const bool uneven = L.schedule.started() &&
                        *std::min_element(budgets.begin(), budgets.end()) !=
                            *std::max_element(budgets.begin(), budgets.end());
    Inputs<T> in;
    in.keys = stored(L, L.k, 0, H, len);
    in.values = stored(L, L.v, 0, H, len);
    const std::int64_t pw = policy_.query_window();
    const std::int64_t nq = std::min(pw < 0 ? L.held : std::min(L.held, pw), len);
    if (nq > 0) in.queries = window_view(L, 0, cfg_.q_heads, nq);
    in.accumulated = L.acc.template as<float>();
    in.observed = L.observed.template as<float>();
    in.rope_inv_freq = cfg_.rope_inv_freq;
    in.first_query_position = L.next_position - nq;
    in.state_stride = L.capacity;

    // The events: one for the layer, or one per non-empty head.
    struct Event {
      std::int64_t head0 = 0, heads = 0;
      Inputs<T> in;
      Budget budget = Budget::ratio(1.0);
      EventInfo info;
      PolicyPlan plan;
    };
    std::vector<Event> events;
    auto info = [&](std::int64_t h) {
      return EventInfo{layer, cfg_.layers, credit(L, h), L.capacity, nullptr};
    };
    if (!ragged && !uneven) {
      std::int64_t total = 0;
      for (const std::int64_t b : budgets) total += std::min(b, len);
      events.push_back({0, H, in, Budget::total(total), info(0), {}});
    } else {
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t n = L.lengths[static_cast<std::size_t>(h)];
        if (n == 0) continue;  // an empty head keeps nothing; nothing to compact
        Inputs<T> one = in;
        one.keys = stored(L, L.k, h, 1, n);
        one.values = stored(L, L.v, h, 1, n);
        if (nq > 0) one.queries = window_view(L, h * g, g, std::min(nq, n));
        if (one.accumulated) one.accumulated += h * L.capacity;
        if (one.observed) one.observed += h * L.capacity;
        events.push_back({h, 1, one, Budget::total(budgets[static_cast<std::size_t>(h)]),
                          info(h), {}});
      }
    }
    // Plan every event, then size the workspace and one CSR for all of them.
    std::int64_t offsets = 0, indices = 0;
    std::size_t ws = 0;
    for (auto& e : events) {
      e.plan = cuda::plan(pol, e.in, e.budget, e.info);
      ws = std::max(ws, e.plan.workspace_bytes);
      offsets += e.plan.rows + 1;
      indices += e.plan.kept_capacity;
    }
    ensure_workspace(ws);
    ensure(offsets_, static_cast<std::size_t>(offsets) * sizeof(std::int64_t));
    ensure(indices_, static_cast<std::size_t>(std::max<std::int64_t>(indices, 1)) *
                         sizeof(std::int32_t));
    // Every event is selected (and merged) before anything is compacted.
    std::vector<CsrSelection> csrs;
    PolicyEvent result;
    std::int64_t at_offset = 0, at_index = 0;
    for (auto& e : events) {
      CsrSelection csr{1, e.heads, offsets_.template as<std::int64_t>() + at_offset,
                       indices_.template as<std::int32_t>() + at_index, e.plan.kept_capacity};
      const PolicyEvent pe = cuda::select(backend(), pol, e.in, e.budget, csr, e.info);
      if (pe.evicts && policy_.merger()) {
        // The merger reads the event's scores where select left them (the workspace), so it
        // runs before the next event's selection; it writes only this event's heads.
        const std::int64_t n = e.in.keys.tokens;
        DeviceMergeArgs<T> m;
        m.keys = mutable_stored(L, L.k, e.head0, e.heads, n);
        m.values = mutable_stored(L, L.v, e.head0, e.heads, n);
        m.selection = csr;
        m.scores = pe.scores;
        m.log_count = L.log_count.template as<float>() + e.head0 * L.capacity;
        m.log_count_stride = L.capacity;
        m.protect = pe.protect;
        ensure(merge_workspace_, semantic_merge_workspace_bytes(m.keys));
        cuda::merge(cuda_backend{stream_, merge_workspace_.data(), merge_workspace_.bytes()},
                    std::get<Semantic>(*policy_.merger()), m);
      }
      if (&e == &events.front()) result.protect = pe.protect;
      result.evicts = result.evicts || pe.evicts;
      if (result.warning.empty()) result.warning = pe.warning;
      csrs.push_back(csr);
      at_offset += e.plan.rows + 1;
      at_index += e.plan.kept_capacity;
    }
    for (std::size_t i = 0; i < events.size(); ++i) {
      const Event& e = events[i];
      const std::int64_t n = e.in.keys.tokens;
      cuda::compact(backend(), mutable_stored(L, L.k, e.head0, e.heads, n), csrs[i]);
      cuda::compact(backend(), mutable_stored(L, L.v, e.head0, e.heads, n), csrs[i]);
      for_each_state(L, [&](auto* data) {
        cuda::compact_state(backend(), data + e.head0 * L.capacity, 0, L.capacity, csrs[i]);
      });
    }
    // The kept counts, for the host's lengths (the one download of the event).
    std::vector<std::int64_t> off(static_cast<std::size_t>(offsets));
    copy_to_host(off.data(), offsets_.data(), off.size() * sizeof(std::int64_t), stream_);
    std::vector<std::int64_t> kept(static_cast<std::size_t>(H), 0);
    std::int64_t base = 0;
    for (const auto& e : events) {
      for (std::int64_t r = 0; r < e.heads; ++r)
        kept[static_cast<std::size_t>(e.head0 + r)] =
            off[static_cast<std::size_t>(base + r + 1)] - off[static_cast<std::size_t>(base + r)];
      base += e.plan.rows + 1;
    }
    if (!result.warning.empty())
      warning_ = kvpolicy::detail::cat("cuda::Session: layer ", layer, ": ", result.warning);
    L.schedule.compressed(std::move(budgets), kept, L.lengths, len);
    L.lengths = kept;
    copy_to_device(L.lens[L.cur].data(), L.lengths.data(), L.lengths.size() * sizeof(std::int64_t),
                   stream_);
    return result;
  }

  // The latest compression's departure from the policy (see Selection::warning), cleared.
  std::string take_warning() { return std::exchange(warning_, std::string()); }

  std::int64_t capacity(std::int64_t layer) const { return at(layer).capacity; }
  std::span<const std::int64_t> lengths(std::int64_t layer) const { return at(layer).lengths; }
  // Device views over the layer's storage; tokens = capacity, valid rows per head = lengths.
  KVView<const T> keys(std::int64_t layer) const {
    const Layer& L = at(layer);
    return stored(L, L.k, 0, cfg_.kv_heads, L.capacity);
  }
  KVView<const T> values(std::int64_t layer) const {
    const Layer& L = at(layer);
    return stored(L, L.v, 0, cfg_.kv_heads, L.capacity);
  }
  // Downloads (blocking: waits for the stream) of head `head`'s per-token state: original
  // positions; H2O attention sums (empty when the session does not track attention).
  std::vector<std::int32_t> positions(std::int64_t layer, std::int64_t head) const {
    return download_state<std::int32_t>(at(layer), at(layer).positions, head);
  }
  std::vector<float> accumulated(std::int64_t layer, std::int64_t head) const {
    return download_state<float>(at(layer), at(layer).acc, head);
  }
  // log(tokens each row stands for) with a merger (empty without one).
  std::vector<float> log_counts(std::int64_t layer, std::int64_t head) const {
    return download_state<float>(at(layer), at(layer).log_count, head);
  }
  // Bytes of K and V held by valid tokens.
  std::size_t kv_bytes() const {
    std::size_t n = 0;
    for (const auto& L : layers_)
      for (auto len : L.lengths) n += static_cast<std::size_t>(len * cfg_.head_dim) * 2 * sizeof(T);
    return n;
  }

 private:
  struct Layer {
    std::int64_t capacity = 0, next_position = 0;
    kvpolicy::detail::CompressionSchedule schedule;
    std::vector<std::int64_t> lengths;  // host copy, authoritative
    DeviceBuffer lens[2];               // device lengths, double-buffered (append writes the other)
    int cur = 0;
    DeviceBuffer k, v;                   // [Hkv][capacity][d]
    DeviceBuffer positions;              // int32 [Hkv][capacity]
    DeviceBuffer acc, observed, credit;  // float [Hkv][capacity], empty when not tracked
    DeviceBuffer log_count;              // float [Hkv][capacity], log(tokens a row stands for)
    DeviceBuffer window[2];              // [Hq][window][d], right-aligned (session_math.hpp)
    int cur_window = 0;
    std::int64_t held = 0;  // queries in the window
  };

  cuda_backend backend() const { return {stream_, workspace_.data(), workspace_.bytes()}; }

  bool tracks_attention() const {
    return cfg_.record_attention || has(policy_.needs(), Needs::accumulated);
  }

  Layer& at(std::int64_t l) {
    KVP_REQUIRE(l >= 0 && l < cfg_.layers, "cuda::Session: layer ", l, " is outside [0, ",
                cfg_.layers, ")");
    return layers_[static_cast<std::size_t>(l)];
  }
  const Layer& at(std::int64_t l) const { return const_cast<Session*>(this)->at(l); }

  static std::int64_t longest(const Layer& L) {
    return *std::max_element(L.lengths.begin(), L.lengths.end());
  }

  static float* credit(Layer& L, std::int64_t h) {
    return L.credit.data() ? L.credit.template as<float>() + h * L.capacity : nullptr;
  }

  // Heads [h0, h0 + heads) of a storage buffer, `tokens` rows each.
  template <class E = const T>
  KVView<E> stored(const Layer& L, const DeviceBuffer& b, std::int64_t h0, std::int64_t heads,
                   std::int64_t tokens) const {
    KVView<E> v = KVView<E>::hnd(b.template as<E>() + h0 * L.capacity * cfg_.head_dim, 1, heads,
                                 tokens, cfg_.head_dim);
    v.stride_head = L.capacity * cfg_.head_dim;
    v.stride_layer = heads * v.stride_head;
    return v;
  }
  KVView<T> mutable_stored(const Layer& L, const DeviceBuffer& b, std::int64_t h0,
                           std::int64_t heads, std::int64_t tokens) const {
    return stored<T>(L, b, h0, heads, tokens);
  }
  // The newest n queries of query heads [h0, h0 + heads).
  KVView<const T> window_view(const Layer& L, std::int64_t h0, std::int64_t heads,
                              std::int64_t n) const {
    const std::int64_t d = cfg_.head_dim;
    KVView<const T> v = KVView<const T>::hnd(
        L.window[L.cur_window].template as<const T>() + (h0 * window_ + window_ - n) * d, 1,
        heads, n, d);
    v.stride_head = window_ * d;
    v.stride_layer = heads * v.stride_head;
    return v;
  }

  template <class F>
  static void for_each_state(Layer& L, F&& f) {
    f(L.positions.template as<std::int32_t>());
    for (DeviceBuffer* b : {&L.acc, &L.observed, &L.credit, &L.log_count})
      if (b->data()) f(b->template as<float>());
  }

  template <class S>
  std::vector<S> download_state(const Layer& L, const DeviceBuffer& b, std::int64_t head) const {
    KVP_REQUIRE(head >= 0 && head < cfg_.kv_heads, "cuda::Session: head ", head,
                " is outside [0, ", cfg_.kv_heads, ")");
    if (!b.data()) return {};
    std::vector<S> out(static_cast<std::size_t>(L.lengths[static_cast<std::size_t>(head)]));
    copy_to_host(out.data(), b.template as<const S>() + head * L.capacity, out.size() * sizeof(S),
                 stream_);
    return out;
  }

  void check_block(const KVView<const T>& x, std::int64_t heads, const char* what) const {
    validate(x, what);
    KVP_REQUIRE(x.layers == 1 && x.heads == heads && x.dim == cfg_.head_dim, "cuda::Session: ",
                what, " must be [1][", heads, "][n][", cfg_.head_dim, "], got [", x.layers, "][",
                x.heads, "][", x.tokens, "][", x.dim, "]");
  }

  void ensure(DeviceBuffer& b, std::size_t bytes) const {
    if (b.bytes() >= bytes) return;
    synchronize(stream_);  // queued kernels may still use the old buffer
    b = DeviceBuffer(bytes);
  }
  void ensure_workspace(std::size_t bytes) {
    if (workspace_.bytes() < bytes) {
      synchronize(stream_);  // the old workspace may still be read by queued kernels
      workspace_ = DeviceBuffer(std::max(bytes, 2 * workspace_.bytes()));
    }
  }

  // Storage of `cap` rows per head, keeping every held row.
  void grow(Layer& L, std::int64_t cap) {
    const std::int64_t H = cfg_.kv_heads, d = cfg_.head_dim, rows = longest(L);
    const bool first = L.capacity == 0;
    auto regrow = [&](DeviceBuffer& b, std::size_t row_bytes) {
      DeviceBuffer next(static_cast<std::size_t>(H * cap) * row_bytes);
      if (!first)
        throw_if_error(copy_rows_on_device(backend(), next.data(), cap * row_bytes, b.data(),
                                           L.capacity * row_bytes, rows * row_bytes,
                                           static_cast<std::size_t>(H)),
                       "cuda::Session (growing the storage)");
      return next;
    };
    DeviceBuffer k = regrow(L.k, d * sizeof(T)), v = regrow(L.v, d * sizeof(T));
    DeviceBuffer pos = regrow(L.positions, sizeof(std::int32_t));
    DeviceBuffer acc, observed, cred;
    if (tracks_attention()) {
      acc = regrow(L.acc, sizeof(float));
      observed = regrow(L.observed, sizeof(float));
    }
    if (policy_.alloc_state()) cred = regrow(L.credit, sizeof(float));
    DeviceBuffer logc;
    if (policy_.merger()) logc = regrow(L.log_count, sizeof(float));
    synchronize(stream_);  // the copies read the old buffers, freed below
    L.k = std::move(k), L.v = std::move(v), L.positions = std::move(pos);
    L.acc = std::move(acc), L.observed = std::move(observed), L.credit = std::move(cred);
    L.log_count = std::move(logc);
    L.capacity = cap;
  }

  Policy policy_;
  Policy fixed_policy_;
  SessionConfig cfg_;
  void* stream_ = nullptr;
  std::int64_t window_ = 0;
  std::vector<Layer> layers_;
  // Shared memory one launch of the device attention may use: the smallest opt-in limit of the
  // GPUs the kernels are built for (sm_86 / sm_89: 99 KB; sm_80: 163 KB; sm_90: 227 KB).
  static constexpr std::int64_t kSharedBytes = 101376;
  // Query rows (group size x queries) one launch holds within kSharedBytes at this head_dim
  // (cuda/decode_math.hpp's shared-memory layout): 86 at 64, 58 at 128, 32 at 256.
  std::int64_t attend_rows() const {
    const int d = static_cast<int>(cfg_.head_dim), tk = decode_math::key_tile(d);
    std::int64_t rows = 0;
    while (decode_math::smem_floats(static_cast<int>(rows + 1), d, tk) * 4 <= kSharedBytes) ++rows;
    return rows;
  }
  DeviceBuffer workspace_, offsets_, indices_, chunk_lengths_, chunk_out_, merge_workspace_;
  std::string warning_;
};

}  // namespace kvpolicy::cuda
