// A spec-string Policy on the CUDA backend: one call runs the chain scorer -> allocators ->
// selection (-> compaction) on device tensors, with one caller-owned workspace.
//
//   kvpolicy::Policy p("snapkv(window=32) | pyramid | adakv");
//   const auto plan = kvpolicy::cuda::plan(p, in, budget);      // host arithmetic of the shapes
//   // ... cudaMalloc plan.workspace_bytes (256-byte aligned) and a CsrSelection holding
//   //     plan.rows + 1 offsets and plan.kept_capacity indices ...
//   cuda_backend be{stream, workspace, plan.workspace_bytes};
//   kvpolicy::cuda::select(be, p, in, budget, csr);            // or compress(...)
//
// The kept sets equal Policy::select on the CPU for the same spec, inputs and budget (the kernels
// each equal their CPU stage: tests/agreement; the chain: tests/agreement/test_device_policy.cpp,
// which runs this runner on a host emulation of the kernels everywhere and on the GPU where
// there is one), except with expected attention, whose scores equal the CPU's to fp32 rounding
// only, so that its kept sets can differ at near-ties.
//
// What runs where:
//   - scorers: every built-in one: h2o, snapkv, streaming, tova, knorm, keydiff, expected with
//     kernels, kvzip by a device copy of the engine's reconstruction scores (Inputs::
//     reconstruction, device memory). A scorer has a device path when cuda::score(const
//     cuda_backend&, const S&, const Inputs<T>&, MutableScoreView) and
//     cuda::score_workspace_bytes(S, Inputs<T>) exist (detail::device_scorer); plug-ins (host
//     callbacks) are refused by name. Expected
//     attention's scores equal the CPU's to fp32 rounding (see cuda/expected.hpp), the others'
//     kept sets are identical.
//   - allocators: the layer-level ones (pyramid, depthkv) and uniform split the budget from the
//     shapes alone, so they run on the host, as on the CPU path; adakv runs as a kernel and leaves
//     the budgets on the device; ams runs as four kernels (window attention, mass and credit,
//     segments and quotas, candidates' mask: cuda::allocate in cuda/baselines.hpp), with its
//     credit state in EventInfo::alloc_state as device memory ([L * Hkv][alloc_state_stride]
//     floats, updated in place; null: a first event). Its row arithmetic is the CPU's bit for
//     bit; its window attention equals the CPU's to fp32 rounding, so masses and credits agree
//     to about 1e-7 relative and a cut or quota on a rounding edge can move.
//   - mergers and quantizers are Session stages: select/compress ignore them, as on the CPU path.
//   - paged caches (plan_paged / compress_paged: one request, gathered into a dense copy in the
//     workspace, then compacted inside its blocks) and ragged batches (plan_batch /
//     compress_batch: one event per sequence, in order).
//   - tensor parallelism over KV heads (select / compress with EventInfo::shard, dense caches;
//     core/head_shard.hpp): each rank runs the chain on its own heads with the model's budget
//     split, and keeps what a single-rank run keeps for those heads. Chains that combine no
//     heads exchange nothing. adakv gathers every rank's numbers through the engine's
//     all_gather on the host (below); the ranks first agree on their checks, so that an error on
//     one rank is raised on all, as on the CPU path. Scorers that combine heads (tova,
//     expected) are refused under a shard of more than one rank. With adakv under a shard,
//     plan() takes part in the agreement too (every rank calls plan() and select() alike), and
//     its kept_capacity is every token (a rank's heads may gain budget from another rank's).
//   - the decode loop of a Session on the device: cuda/session.hpp (cuda::Session).
//   - not on this path yet: tensor parallelism for batches and paged caches.
//
// Host synchronisation: one per event, the upload of the per-row budgets (computed on the host
// from the shapes, then uploaded before the event's first kernel; it waits for the work already
// on be.stream, not for this event's; a batch has one per sequence). Every kernel after it is
// asynchronous: the CSR selection (and the compacted cache) are ready when the stream is. Inputs
// must stay valid until then. adakv under a shard adds two: the download of this rank's scores
// (4 * layers * heads * row_stride bytes, tokens rounded up to a multiple of 4) after the
// scorer's kernels, and the upload of the budgets
// that its host step and collectives computed.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "kvpolicy/cuda/baselines.hpp"
#include "kvpolicy/cuda/compact.hpp"
#include "kvpolicy/cuda/expected.hpp"
#include "kvpolicy/cuda/paged.hpp"
#include "kvpolicy/cuda/runtime.hpp"
#include "kvpolicy/cuda/select.hpp"
#include "kvpolicy/cuda/window_attention.hpp"
#include "kvpolicy/batch.hpp"
#include "kvpolicy/paged.hpp"
#include "kvpolicy/policy.hpp"

namespace kvpolicy::cuda {

// Sizes of one event on the device: what the caller allocates before select()/compress().
struct PolicyPlan {
  std::size_t workspace_bytes = 0;  // the cuda_backend's workspace, 256-byte aligned
  std::int64_t rows = 0;            // (layer, head) rows: the CSR offsets hold rows + 1 entries
  std::int64_t kept_capacity = 0;   // CSR indices the event writes at most (CsrSelection::capacity)
};

// What select() reports on the host (the selection itself is on the device).
struct PolicyEvent {
  Protect protect;      // the tokens the selection protected (after fitting a small budget)
  bool evicts = false;  // false: every row kept every token (nothing was scored)
  std::string warning;  // as Selection::warning() on the CPU path
  // Scores ranked (post-allocator, as Policy::select's `scores`), in the workspace until its next
  // use (a batch's next event); a merger reads them. cuda::Session::compress returns none.
  ScoreView scores;
};

// A scratch region of the caller's workspace handed to one kernel.
struct Scratch {
  void* data = nullptr;
  std::size_t bytes = 0;
};

namespace detail {

template <class S, class T>
concept device_scorer = requires(const cuda_backend& be, const S& s, const Inputs<T>& in,
                                 const MutableScoreView& out) {
  cuda::score(be, s, in, out);
  { cuda::score_workspace_bytes(s, in) } -> std::convertible_to<std::size_t>;
};

// Allocators the device path runs on the host: they read only the event's shape (no statistics,
// no per-token state, no tokens of their own to protect).
template <class A>
constexpr bool host_allocator() {
  constexpr AllocLevel lv = kvpolicy::detail::alloc_level<A>();
  constexpr bool shape_only = !requires(const A a) { a.needs(); } &&
                              !requires(const A a) { a.protects(); } &&
                              !kvpolicy::detail::alloc_stateful<A>();
  return shape_only && (std::is_same_v<A, Uniform> || lv == AllocLevel::layers);
}

// The registry's scorers (registry.hpp) that have a device path for T, by name.
template <Element T>
std::string device_scorer_names() {
  std::string out;
  auto add = [&](auto s) {
    if constexpr (device_scorer<decltype(s), T>)
      out += (out.empty() ? "" : ", ") + std::string(decltype(s)::name);
  };
  std::apply([&](auto... s) { (add(s), ...); }, scorer_types{});
  return out;
}

inline constexpr std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }
inline constexpr std::int64_t score_row_stride(std::int64_t tokens) { return (tokens + 3) / 4 * 4; }

// The kernels of a chain, as the runner calls them. cuda_device is the CUDA one; tests drive the
// same runner through a host emulation with this interface (tests/common/device_emulation.hpp).
struct cuda_device {
  cuda_backend be;

  cuda_backend with(Scratch s) const { return {be.stream, s.data, s.bytes}; }
  template <class S, Element T>
  std::size_t score_bytes(const S& s, const Inputs<T>& in) const {
    return cuda::score_workspace_bytes(s, in);
  }
  template <class S, Element T>
  void score(const S& s, const Inputs<T>& in, const MutableScoreView& out, Scratch ws) const {
    cuda::score(with(ws), s, in, out);
  }
  template <Element T>
  std::size_t ams_bytes(const AMS& a, const Inputs<T>& in, Protect p) const {
    return cuda::allocate_workspace_bytes(a, in, p);
  }
  template <Element T>
  void ams(const AMS& a, const Inputs<T>& in, const MutableScoreView& s,
           const std::int64_t* device_budgets, Protect p, float* state, std::int64_t stride,
           Scratch ws) const {
    cuda::allocate(with(ws), a, in, s, device_budgets, p, state, stride);
  }
  std::size_t adakv_bytes(const AdaKV& a, const ScoreView& s, Protect p) const {
    return cuda::allocate_workspace_bytes(a, s, p);
  }
  void adakv(const AdaKV& a, const ScoreView& s, const std::int64_t* device_budgets, Protect p,
             std::int64_t* out, Scratch ws) const {
    cuda::allocate(with(ws), a, s, device_budgets, p, out);
  }
  std::size_t select_bytes(std::int64_t rows, std::int64_t tokens) const {
    return cuda::select_workspace_bytes(rows, tokens);
  }
  // Blocking with respect to the host (pageable memory): waits for the stream's earlier work.
  void upload(void* dst, const void* src, std::size_t bytes) const {
    copy_to_device(dst, src, bytes, be.stream);
  }
  // Blocking too: waits for the stream's earlier work (the scorer's kernels), then copies.
  void download(void* dst, const void* src, std::size_t bytes) const {
    copy_to_host(dst, src, bytes, be.stream);
  }
  void select(const ScoreView& s, const std::int64_t* device_budgets, Protect p,
              CsrSelection& out, Scratch ws) const {
    cuda::select(with(ws), s, device_budgets, p, out);
  }
  template <Element T>
  void compact(const KVView<T>& kv, const CsrSelection& sel) const {
    cuda::compact(be, kv, sel);
  }
  template <class T, class U>
  void paged_gather(const PagedKVView<T>& src, const std::int32_t* table, std::int64_t length,
                    const KVView<U>& dst) const {
    cuda::paged_gather(be, src, table, length, dst);
  }
  template <Element T>
  std::size_t paged_compact_bytes(const PagedKVView<T>& pool, const PagedTables& tables) const {
    return cuda::paged_compact_workspace_bytes(pool, tables);
  }
  template <Element T>
  void paged_compact(const PagedKVView<T>& keys, const PagedKVView<T>& values,
                     const PagedTables& tables, const CsrSelection& sel, Scratch ws) const {
    cuda::paged_compact(with(ws), keys, values, tables, sel);
  }
};

// "" when every stage of `policy` has a device path for element type T, else why not (naming
// the stage). The C ABI reports it as KVP_ERROR_UNSUPPORTED.
template <Element T>
std::string unsupported_stage(const Policy& policy) {
  std::string why;
  if (!policy.keeps_all())
    std::visit(
        [&](const auto& s) {
          using S = std::decay_t<decltype(s)>;
          if constexpr (!device_scorer<S, T>)
            why = kvpolicy::detail::cat(
                "cuda policy '", policy.spec(), "': scorer '", policy.scorer_name(),
                "' has no CUDA kernel (device scorers: ", device_scorer_names<T>(),
                "); run it with the cpu_backend");
        },
        policy.scorer());
  for (const auto& a : policy.allocators())
    std::visit(
        [&](const auto& al) {
          using A = std::decay_t<decltype(al)>;
          if constexpr (!std::is_same_v<A, AdaKV> && !std::is_same_v<A, AMS> &&
                        !host_allocator<A>())
            if (why.empty())
              why = kvpolicy::detail::cat(
                  "cuda policy '", policy.spec(), "': allocator '", A::name,
                  "' has no device path yet (device allocators: uniform, pyramid, depthkv, "
                  "adakv, ams); run it with the cpu_backend");
        },
        a);
  return why;
}

// The host half of an event: checks, budgets after the host allocators, protection.
struct EventSetup {
  std::vector<std::int64_t> budgets;  // per row, after the host-side allocators
  PolicyEvent event;
  std::int64_t layers = 0, heads = 0, tokens = 0;
  bool device_allocators = false;  // some allocator runs as a kernel (adakv; ams reads the
                                   // budgets as they stand and changes none)
  // Tensor parallelism with a chain that combines heads (adakv): the ranks agree on their checks
  // and on whether any evicts, and adakv runs on the host with the engine's all-gather.
  const HeadShard* exchange = nullptr;
};

// A sharded chain whose scorer combines heads (tova's mean over every head, expected's layer
// maximum) needs the ranks' numbers inside the scorer: not on the device path yet. Allocators
// that combine heads (adakv) exchange on the host (see select()).
inline std::string unsupported_shard(const Policy& policy, const HeadShard* shard) {
  if (!kvpolicy::detail::sharded(shard) || policy.keeps_all()) return {};
  std::string why;
  std::visit(
      [&](const auto& s) {
        using S = std::decay_t<decltype(s)>;
        if constexpr (kvpolicy::detail::spans_heads<S>())
          why = kvpolicy::detail::cat(
              "cuda policy '", policy.spec(), "': scorer '", S::name,
              "' combines KV heads across tensor-parallel ranks (EventInfo::shard), which runs "
              "on the CPU path only; on the device, shard a scorer that scores each head alone "
              "(h2o, snapkv, streaming, knorm, keydiff, kvzip), with any allocator");
      },
      policy.scorer());
  return why;
}

template <Element T>
EventSetup setup_local(const Policy& policy, const Inputs<T>& in, const Budget& budget,
                       const EventInfo& ev) {
  const std::string_view label = policy.keeps_all() ? std::string_view("(keep all)")
                                                    : policy.scorer_name();
  const HeadShard* shard = ev.shard;
  const std::string unsupported = unsupported_stage<T>(policy);
  KVP_REQUIRE(unsupported.empty(), unsupported);
  const std::string unsharded = unsupported_shard(policy, shard);
  KVP_REQUIRE(unsharded.empty(), unsharded);
  if (shard) kvpolicy::detail::check_shard(*shard, in.kv_heads());
  bool on_device = false;
  for (const auto& a : policy.allocators()) on_device = on_device || std::holds_alternative<AdaKV>(a);
  validate(in, policy.needs(), policy.query_window());
  kvpolicy::detail::check_event_layers(ev, in.layers());
  KVP_REQUIRE(ev.alloc_state_stride == 0 || ev.alloc_state_stride >= in.tokens(),
              "alloc_state_stride ", ev.alloc_state_stride, " is below the ", in.tokens(),
              " tokens of the event");
  EventSetup s;
  s.layers = in.layers();
  s.heads = in.kv_heads();
  s.tokens = in.tokens();
  s.device_allocators = on_device;
  if (kvpolicy::detail::sharded(shard) && policy.spans_heads()) s.exchange = shard;
  const std::int64_t L = s.layers, H = s.heads, Tk = s.tokens, rows = L * H;
  // The model's rows (every rank's): budgets and protection as a single-rank run splits them.
  const std::int64_t Hm = kvpolicy::detail::model_heads(shard, H), model_rows = L * Hm;
  if (policy.keeps_all()) {
    KVP_REQUIRE(budget.global(L, Hm, Tk) >= model_rows * Tk, "policy '", policy.spec(),
                "' has no scorer and keeps every token; the budget keeps ",
                budget.global(L, Hm, Tk), " of ", model_rows * Tk);
    s.budgets.assign(static_cast<std::size_t>(rows), Tk);
    return s;
  }
  s.budgets = kvpolicy::detail::resolve_budgets(budget, L, H, Tk, shard);
  const std::int64_t per_row = model_rows > 0 ? budget.global(L, Hm, Tk) / model_rows : 0;
  const std::int64_t smallest = model_rows > 0 ? per_row : Tk;
  const Protect own = std::visit([&](const auto& sc) { return sc.protect(Tk, per_row); },
                                 policy.scorer());
  Protect protect = policy.protect(Tk, per_row);
  s.event.warning = kvpolicy::detail::fit_protected(label, protect, own, smallest, Tk);
  s.event.protect = protect;
  for (std::int64_t b : s.budgets) s.event.evicts = s.event.evicts || b < Tk;
  // (A rank that exchanges runs its allocators even where it keeps everything: another rank may
  // evict, and then every rank scores and allocates, as on the CPU path.)
  if (!s.event.evicts && !s.exchange) return s;
  // The host allocators, in chain order (they precede every head-level one: layers -> heads).
  ScoreMap shape(L, H, 0);  // they read the shape only
  AllocContext ctx;
  ctx.scores = &shape;
  ctx.tokens = Tk;
  ctx.protect = protect;
  ctx.first_layer = ev.first_layer;
  ctx.model_layers = ev.model_layers > 0 ? ev.model_layers : L;
  ctx.queries = in.queries.data ? in.queries.tokens : 0;
  ctx.shard = s.exchange;
  for (const auto& a : policy.allocators())
    std::visit(
        [&](const auto& al) {
          if constexpr (host_allocator<std::decay_t<decltype(al)>>())
            al.allocate(ctx, std::span<std::int64_t>(s.budgets));
        },
        a);
  // The host budgets' checks (the CPU path's: cpu::select's, and adakv's for its input), so that
  // plan() refuses what select() would.
  const std::int64_t P = protect.total(Tk);
  for (std::int64_t b : s.budgets) {
    KVP_REQUIRE(b >= Tk || b >= P, "budget of ", b, " tokens is below the ", P,
                " protected tokens (", protect.sinks, " sinks + ", protect.recent, " recent)");
    KVP_REQUIRE(!on_device || (b >= std::min(P, Tk) && b <= Tk), "adakv: budget ", b,
                " is outside [", std::min(P, Tk), ", ", Tk, "]");
  }
  return s;
}

// What a rank reports to the others when one of its steps fails (kvpolicy::detail::agree).
inline std::string failure_text(const std::exception& e) {
  if (const auto* k = dynamic_cast<const Error*>(&e)) return kvpolicy::detail::error_text(*k);
  return e.what();
}

// setup_local, and, where `agree_ranks` and the event exchanges (a sharded chain with adakv), the
// ranks' agreement on it (kvpolicy::detail::agree, one 256-byte all-gather: an error on one rank
// is raised on every rank; evicts when any rank evicts), as Policy::select does before its first
// exchange. plan() and select() each agree, so that a rank whose plan() fails fails every
// rank's plan() instead of leaving the others blocked in select(): every rank calls both.
// `more_checks(setup)`: the caller's own checks of the event, agreed on with the rest.
template <Element T>
EventSetup setup_event(const Policy& policy, const Inputs<T>& in, const Budget& budget,
                       const EventInfo& ev, bool agree_ranks = false,
                       const std::function<void(const EventSetup&)>& more_checks = {}) {
  const HeadShard* shard = ev.shard;
  const auto local = [&] {
    EventSetup s = setup_local(policy, in, budget, ev);
    if (more_checks) more_checks(s);
    return s;
  };
  if (!agree_ranks || !kvpolicy::detail::sharded(shard) || !policy.spans_heads() ||
      !unsupported_shard(policy, shard).empty())
    return local();
  kvpolicy::detail::require_all_gather(*shard);
  EventSetup s;
  std::string error;
  try {
    s = local();
  } catch (const std::exception& e) {
    error = failure_text(e);
  }
  s.event.evicts = kvpolicy::detail::agree(*shard, error, in.layers(), in.kv_heads(), in.tokens(),
                                           s.event.evicts);
  return s;
}

// The shard an event exchanges through (a sharded chain with adakv and an all-gather), or null.
inline const HeadShard* exchange_of(const Policy& policy, const EventInfo& ev) {
  const HeadShard* s = ev.shard;
  const bool x = kvpolicy::detail::sharded(s) && s->all_gather && policy.spans_heads() &&
                 unsupported_shard(policy, s).empty();
  return x ? s : nullptr;
}

// A rank whose step between two agreements failed (an allocation between plan() and select())
// reports it to the others' next agreement, so that they fail too; the caller then rethrows.
inline void report_failure(const HeadShard& s, const std::exception& e) {
  try {
    kvpolicy::detail::agree(s, failure_text(e), 0, 0, 0, false);
  } catch (const Error&) {  // (agree raises this rank's own error: the caller's to rethrow)
  }
}

// CSR indices an event may write: the budgets' total, or every token when adakv moves budget
// between ranks (a rank's heads may then keep more than its share).
inline std::int64_t kept_capacity(const EventSetup& s) {
  if (s.exchange && s.device_allocators) return s.layers * s.heads * s.tokens;
  return kept_total(s.budgets, s.tokens);
}

// Workspace layout: scores [rows][row_stride] fp32 | device budgets [rows] i64 | one scratch
// region the kernels take in turn (they run in stream order, so they share it).
struct Layout {
  std::int64_t row_stride = 0;
  std::size_t budgets_at = 0, scratch_at = 0, scratch_bytes = 0, total = 0;
};

// `tail`: int64 values uploaded with the budgets (a paged event's table offsets); `extra_scratch`:
// scratch a kernel after the selection needs (paged compaction).
template <class Dev, Element T>
Layout layout(const Dev& dev, const Policy& policy, const Inputs<T>& in, const EventSetup& s,
              std::size_t tail = 0, std::size_t extra_scratch = 0) {
  Layout lay;
  const std::int64_t rows = s.layers * s.heads;
  lay.row_stride = score_row_stride(s.tokens);
  const ScoreView scores{nullptr, s.layers, s.heads, s.tokens, lay.row_stride};
  std::size_t scratch = std::max(dev.select_bytes(rows, s.tokens), extra_scratch);
  if (s.event.evicts || s.exchange) {  // (an exchanging rank scores when any rank evicts)
    std::visit(
        [&](const auto& sc) {
          if constexpr (device_scorer<std::decay_t<decltype(sc)>, T>)
            scratch = std::max(scratch, dev.score_bytes(sc, in));
        },
        policy.scorer());
    for (const auto& a : policy.allocators()) {
      if (const auto* ada = std::get_if<AdaKV>(&a))
        scratch = std::max(scratch, dev.adakv_bytes(*ada, scores, s.event.protect));
      if (const auto* ams = std::get_if<AMS>(&a))
        scratch = std::max(scratch, dev.ams_bytes(*ams, in, s.event.protect));
    }
  }
  lay.budgets_at = align256(static_cast<std::size_t>(rows * lay.row_stride) * sizeof(float));
  lay.scratch_at =
      lay.budgets_at + align256((static_cast<std::size_t>(rows) + tail) * sizeof(std::int64_t));
  lay.scratch_bytes = align256(scratch);
  lay.total = lay.scratch_at + lay.scratch_bytes;
  return lay;
}

template <class Dev, Element T>
PolicyPlan plan(const Dev& dev, const Policy& policy, const Inputs<T>& in, const Budget& budget,
                const EventInfo& ev) {
  // (The workspace queries inside the agreement too: they can fail.)
  std::size_t bytes = 0;
  const EventSetup s = setup_event(policy, in, budget, ev, /*agree_ranks=*/true,
                                   [&](const EventSetup& e) { bytes = layout(dev, policy, in, e).total; });
  PolicyPlan p;
  p.workspace_bytes = bytes;
  p.rows = s.layers * s.heads;
  p.kept_capacity = kept_capacity(s);
  return p;
}

// adakv under tensor parallelism: its layer-wide threshold needs every rank's scores, which the
// CPU allocator gathers through the engine's all-gather (allocators/adakv.hpp). The device path
// runs that allocator on the host over this rank's scores (`staged`: downloaded by select(),
// [rows][row_stride]; a host synchronisation), then uploads the budgets (a second). Same
// arithmetic as the CPU path, so the same kept sets as a single-rank run over every head.
template <class Dev>
void adakv_on_host(const Dev& dev, const AdaKV& ada, const std::vector<float>& staged,
                   std::int64_t row_stride, std::int64_t* dev_budgets, EventSetup& s,
                   const EventInfo& ev) {
  ScoreMap host(s.layers, s.heads, s.tokens);
  const std::int64_t rows = s.layers * s.heads;
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy_n(staged.data() + r * row_stride, s.tokens, host.data() + r * s.tokens);
  AllocContext ctx;
  ctx.scores = &host;
  ctx.tokens = s.tokens;
  ctx.protect = s.event.protect;
  ctx.first_layer = ev.first_layer;
  ctx.model_layers = ev.model_layers > 0 ? ev.model_layers : s.layers;
  ctx.shard = s.exchange;
  ada.allocate(ctx, std::span<std::int64_t>(s.budgets));
  if (rows > 0)
    dev.upload(dev_budgets, s.budgets.data(), static_cast<std::size_t>(rows) * sizeof(std::int64_t));
}

// Where select() left what a later kernel of the same event reads.
struct Regions {
  std::int64_t* tail = nullptr;  // the uploaded `tail` values (device)
  Scratch scratch;               // the shared scratch region
};

template <class Dev, Element T>
PolicyEvent select(const Dev& dev, void* workspace, std::size_t workspace_bytes,
                   const Policy& policy, const Inputs<T>& in, const Budget& budget,
                   CsrSelection& out, const EventInfo& ev,
                   std::span<const std::int64_t> tail = {}, std::size_t extra_scratch = 0,
                   Regions* regions = nullptr, const std::function<void()>& after_upload = {},
                   const std::function<void()>& caller_checks = {}) {
  // Every check of the event (the caller's, the buffers') runs inside the ranks' agreement when
  // the event exchanges, so that a buffer too small on one rank fails every rank.
  Layout lay;
  EventSetup s = setup_event(policy, in, budget, ev, /*agree_ranks=*/true, [&](const EventSetup& e) {
    if (caller_checks) caller_checks();
    lay = layout(dev, policy, in, e, tail.size(), extra_scratch);
    KVP_REQUIRE(workspace_bytes >= lay.total, "cuda policy '", policy.spec(), "': workspace of ",
                workspace_bytes, " bytes is below the ", lay.total,
                " the event needs (cuda::plan(...).workspace_bytes)");
    KVP_REQUIRE(lay.total == 0 || workspace, "cuda policy '", policy.spec(),
                "': null workspace pointer");
    KVP_REQUIRE(reinterpret_cast<std::uintptr_t>(workspace) % 256 == 0, "cuda policy '",
                policy.spec(), "': the workspace must be 256-byte aligned (cudaMalloc's)");
    KVP_REQUIRE(out.layers == e.layers && out.heads == e.heads, "cuda policy '", policy.spec(),
                "': output selection is [", out.layers, ",", out.heads, "] but the cache is [",
                e.layers, ",", e.heads, "]");
    const std::int64_t need = kept_capacity(e);
    KVP_REQUIRE(out.capacity >= need, "cuda policy '", policy.spec(),
                "': output selection holds ", out.capacity, " indices but the event keeps ", need,
                " (cuda::plan(...).kept_capacity)");
    KVP_REQUIRE(e.layers * e.heads == 0 || out.offsets, "cuda policy '", policy.spec(),
                "': output selection has null offsets");
    KVP_REQUIRE(need == 0 || out.indices, "cuda policy '", policy.spec(),
                "': output selection has null indices");
  });
  const std::int64_t rows = s.layers * s.heads;
  // One upload before any kernel of the event, so that every later stage reads device budgets.
  auto* base = static_cast<std::byte*>(workspace);
  float* score_data = reinterpret_cast<float*>(base);
  auto* dev_budgets = reinterpret_cast<std::int64_t*>(base + lay.budgets_at);
  const Scratch scratch{base + lay.scratch_at, lay.scratch_bytes};
  const MutableScoreView wscores{rows ? score_data : nullptr, s.layers, s.heads, s.tokens,
                                 lay.row_stride};
  const ScoreView scores{wscores.data, s.layers, s.heads, s.tokens, lay.row_stride};
  // Under an exchange where some rank evicts, the ranks agree once more after scoring (the CPU
  // path's second agreement), on everything before adakv's collectives: the budgets' upload,
  // the scorer's own checks and kernels, and the download of the scores adakv reads.
  const bool second = s.exchange && s.event.evicts;
  bool host_adakv = false;
  for (const auto& a : policy.allocators()) host_adakv = host_adakv || std::holds_alternative<AdaKV>(a);
  host_adakv = host_adakv && second;
  std::vector<float> host_scores;  // adakv's input on the host: [rows][row_stride]
  const auto score_steps = [&] {
    std::vector<std::int64_t> upload = s.budgets;
    upload.insert(upload.end(), tail.begin(), tail.end());  // one upload for both
    if (!upload.empty())
      dev.upload(dev_budgets, upload.data(), upload.size() * sizeof(std::int64_t));
    if (regions) *regions = {dev_budgets + rows, scratch};
    if (after_upload) after_upload();  // the event's own first kernels (a paged event's gathers)
    if (!s.event.evicts) {
      // Every row keeps every token; the selection kernel still reads a score per token, so
      // give it positions (streaming's scores: no inputs read, no workspace).
      dev.score(Streaming{}, in, wscores, scratch);
      return;
    }
    std::visit(
        [&](const auto& sc) {
          if constexpr (device_scorer<std::decay_t<decltype(sc)>, T>)
            dev.score(sc, in, wscores, scratch);
        },
        policy.scorer());
    if (host_adakv && rows > 0) {  // (waits for the scorer's kernels: a host synchronisation)
      host_scores.resize(static_cast<std::size_t>(rows * lay.row_stride));
      dev.download(host_scores.data(), scores.data, host_scores.size() * sizeof(float));
    }
  };
  if (!second) {
    score_steps();
  } else {
    std::string error;
    try {
      score_steps();
    } catch (const std::exception& e) {
      error = failure_text(e);
    }
    kvpolicy::detail::agree(*s.exchange, error, s.layers, s.heads, s.tokens, true);
  }
  if (s.event.evicts) {
    // In chain order (layers -> heads -> segments): ams, the last, reads adakv's budgets.
    const std::int64_t state_stride = ev.alloc_state_stride > 0 ? ev.alloc_state_stride : s.tokens;
    for (const auto& a : policy.allocators()) {
      if (const auto* ada = std::get_if<AdaKV>(&a)) {
        if (host_adakv)
          adakv_on_host(dev, *ada, host_scores, lay.row_stride, dev_budgets, s, ev);
        else
          dev.adakv(*ada, scores, dev_budgets, s.event.protect, dev_budgets, scratch);
      }
      if (const auto* ams = std::get_if<AMS>(&a))
        dev.ams(*ams, in, wscores, dev_budgets, s.event.protect, ev.alloc_state, state_stride,
                scratch);
    }
  }
  dev.select(scores, dev_budgets, s.event.protect, out, scratch);
  PolicyEvent e = s.event;
  e.scores = scores;
  return e;
}

template <class Dev, Element T>
PolicyEvent compress(const Dev& dev, void* workspace, std::size_t workspace_bytes,
                     const Policy& policy, const KVView<T>& keys, const KVView<T>& values,
                     Inputs<T> in, const Budget& budget, CsrSelection& out, const EventInfo& ev) {
  in.keys = keys;
  in.values = values;
  const auto checks = [&] {
    if (values.data) {
      validate(values, "values");
      KVP_REQUIRE(values.layers == keys.layers && values.heads == keys.heads &&
                      values.tokens == keys.tokens,
                  "values shape does not match keys");
    }
    KVP_REQUIRE(out.rows() == 0 || keys.tokens == 0 || out.indices, "cuda policy '",
                policy.spec(), "': output selection has null indices (compaction reads them)");
  };
  PolicyEvent e = select(dev, workspace, workspace_bytes, policy, in, budget, out, ev, {}, 0,
                         nullptr, {}, checks);
  dev.compact(keys, out);
  if (values.data) dev.compact(values, out);
  return e;
}

// ---- batches of ragged dense sequences --------------------------------------------------------
// One event per sequence, in order, on one stream and one workspace (stream order makes the reuse
// safe); every sequence is checked before the first kernel, as kvpolicy::compress_batch does.

template <Element T>
Inputs<T> sequence_inputs(const DenseSequence<T>& s) {
  Inputs<T> in;
  in.keys = s.keys;
  in.values = s.values;
  in.queries = s.queries;
  return in;
}

template <class Dev, Element T>
PolicyPlan plan_batch(const Dev& dev, const Policy& policy, std::span<const DenseSequence<T>> seqs,
                      const Budget& budget, std::span<const Budget> budgets) {
  kvpolicy::detail::require_selection_only(policy, "cuda::compress_batch");
  kvpolicy::detail::check_budgets(budgets, budget, seqs.size());
  PolicyPlan out;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    kvpolicy::detail::for_sequence(i, [&] {
      const auto &k = seqs[i].keys, &k0 = seqs[0].keys;
      KVP_REQUIRE(k.layers == k0.layers && k.heads == k0.heads && k.dim == k0.dim, "keys are [",
                  k.layers, ",", k.heads, ",", k.tokens, ",", k.dim, "] but sequence 0 has [",
                  k0.layers, ",", k0.heads, ",", k0.tokens, ",", k0.dim,
                  "] (layers, heads and dim must match across the batch)");
      const PolicyPlan p = plan(dev, policy, sequence_inputs(seqs[i]),
                                kvpolicy::detail::budget_of(budgets, budget, i), EventInfo{});
      out.workspace_bytes = std::max(out.workspace_bytes, p.workspace_bytes);
      out.rows = p.rows;
      out.kept_capacity = std::max(out.kept_capacity, p.kept_capacity);
    });
  return out;
}

template <class Dev, Element T>
std::vector<PolicyEvent> compress_batch(const Dev& dev, void* workspace,
                                        std::size_t workspace_bytes, const Policy& policy,
                                        std::span<const DenseSequence<T>> seqs,
                                        const Budget& budget, std::span<const Budget> budgets,
                                        std::span<CsrSelection> outs) {
  KVP_REQUIRE(outs.size() == seqs.size(), "cuda::compress_batch: ", outs.size(),
              " output selections for ", seqs.size(), " sequences");
  const PolicyPlan all = plan_batch(dev, policy, seqs, budget, budgets);
  KVP_REQUIRE(workspace_bytes >= all.workspace_bytes, "cuda policy '", policy.spec(),
              "': workspace of ", workspace_bytes, " bytes is below the ", all.workspace_bytes,
              " the batch needs (cuda::plan_batch(...).workspace_bytes)");
  for (std::size_t i = 0; i < seqs.size(); ++i)
    kvpolicy::detail::for_sequence(i, [&] {
      const PolicyPlan p = plan(dev, policy, sequence_inputs(seqs[i]),
                                kvpolicy::detail::budget_of(budgets, budget, i), EventInfo{});
      KVP_REQUIRE(outs[i].layers == seqs[i].keys.layers && outs[i].heads == seqs[i].keys.heads &&
                      outs[i].capacity >= p.kept_capacity,
                  "output selection is [", outs[i].layers, ",", outs[i].heads, "] holding ",
                  outs[i].capacity, " indices; the sequence needs [", seqs[i].keys.layers, ",",
                  seqs[i].keys.heads, "] and ", p.kept_capacity);
      KVP_REQUIRE(p.rows == 0 || outs[i].offsets, "output selection has null offsets");
      KVP_REQUIRE(p.kept_capacity == 0 || outs[i].indices, "output selection has null indices");
    });
  std::vector<PolicyEvent> events;
  for (std::size_t i = 0; i < seqs.size(); ++i)
    events.push_back(kvpolicy::detail::for_sequence(i, [&] {
      const DenseSequence<T>& s = seqs[i];
      return compress(dev, workspace, workspace_bytes, policy, s.keys, s.values,
                      sequence_inputs(s), kvpolicy::detail::budget_of(budgets, budget, i),
                      outs[i], EventInfo{});
    }));
  return events;
}

// ---- paged caches ---------------------------------------------------------------------------
// One request of a paged pool: its tokens are gathered into a dense copy at the front of the
// workspace (keys, and values when the policy reads them), the chain selects on the copy, and the
// pool is compacted in place inside the request's own blocks (cuda::paged_compact). The same kept
// sets as kvpolicy::compress_paged on the CPU, which selects on a dense copy too.

struct PagedLayout {
  std::size_t values_at = 0, event_at = 0, total = 0;
  std::size_t event_bytes = 0;
  std::int64_t kept_capacity = 0;
  bool evicts = false;  // false: every row keeps every token, and nothing reads the dense copy
};

template <Element T>
Inputs<std::remove_const_t<T>> dense_inputs(const PagedKVView<T>& keys, bool with_values,
                                            const PagedSequence& seq,
                                            const KVView<const std::remove_const_t<T>>& queries,
                                            const std::byte* base, const PagedLayout& lay) {
  using E = std::remove_const_t<T>;
  const std::int64_t L = keys.layers, H = keys.heads, N = seq.length, D = keys.dim;
  const auto at = [&](std::size_t offset) {  // (integer arithmetic: base may be a placeholder)
    return reinterpret_cast<const E*>(reinterpret_cast<std::uintptr_t>(base) + offset);
  };
  Inputs<E> in;
  in.keys = KVView<const E>::hnd(at(0), L, H, N, D);
  if (with_values) in.values = KVView<const E>::hnd(at(lay.values_at), L, H, N, D);
  in.queries = queries;
  return in;
}

template <class Dev, Element T>
PagedLayout paged_layout(const Dev& dev, const Policy& policy, const PagedKVView<T>& keys,
                         const PagedKVView<T>& values, const PagedSequence& seq,
                         const KVView<const std::remove_const_t<T>>& queries,
                         const Budget& budget) {
  using E = std::remove_const_t<T>;
  kvpolicy::detail::require_selection_only(policy, "cuda::compress_paged");
  kvpolicy::detail::check_paged(keys, values, seq, {});
  const bool with_values = has(policy.needs(), Needs::values);
  KVP_REQUIRE(!with_values || values.data, "values: policy '", policy.spec(),
              "' reads values but none were given");
  const std::int64_t L = keys.layers, H = keys.heads, N = seq.length, D = keys.dim;
  PagedLayout lay;
  const std::size_t dense = align256(static_cast<std::size_t>(L * H * N * D) * sizeof(E));
  lay.values_at = dense;
  lay.event_at = dense * (with_values ? 2 : 1);
  // The dense copy's shapes, for the event's checks and sizes (the views are not read: their
  // pointers are placeholders past a null workspace base).
  const auto* placeholder = reinterpret_cast<const std::byte*>(alignof(std::max_align_t));
  const Inputs<E> shapes = dense_inputs(keys, with_values, seq, queries, placeholder, lay);
  const EventSetup s = setup_event(policy, shapes, budget, EventInfo{});
  const PagedTables tables{nullptr, nullptr, 1, N};
  lay.event_bytes = layout(dev, policy, shapes, s, 2, dev.paged_compact_bytes(keys, tables)).total;
  lay.total = lay.event_at + lay.event_bytes;
  lay.kept_capacity = kept_capacity(s);
  lay.evicts = s.event.evicts;
  return lay;
}

template <class Dev, Element T>
PolicyPlan plan_paged(const Dev& dev, const Policy& policy, const PagedKVView<T>& keys,
                      const PagedKVView<T>& values, const PagedSequence& seq,
                      const KVView<const std::remove_const_t<T>>& queries, const Budget& budget) {
  const PagedLayout lay = paged_layout(dev, policy, keys, values, seq, queries, budget);
  return {lay.total, keys.layers * keys.heads, lay.kept_capacity};
}

template <class Dev, Element T>
PolicyEvent compress_paged(const Dev& dev, void* workspace, std::size_t workspace_bytes,
                           const Policy& policy, const PagedKVView<T>& keys,
                           const PagedKVView<T>& values, const PagedSequence& seq,
                           const std::int32_t* device_table,
                           const KVView<const std::remove_const_t<T>>& queries,
                           const Budget& budget, CsrSelection& out) {
  static_assert(!std::is_const_v<T>, "cuda::compress_paged writes the pool: pass mutable views");
  const PagedLayout lay = paged_layout(dev, policy, keys, values, seq, queries, budget);
  KVP_REQUIRE(workspace_bytes >= lay.total, "cuda policy '", policy.spec(), "': workspace of ",
              workspace_bytes, " bytes is below the ", lay.total,
              " the paged event needs (cuda::plan_paged(...).workspace_bytes)");
  KVP_REQUIRE(lay.total == 0 || workspace, "cuda policy '", policy.spec(),
              "': null workspace pointer");
  KVP_REQUIRE(seq.length == 0 || device_table, "cuda::compress_paged: null device block table");
  auto* base = static_cast<std::byte*>(workspace);
  const bool with_values = has(policy.needs(), Needs::values);
  const Inputs<T> in = dense_inputs(keys, with_values, seq, queries, base, lay);
  using E = std::remove_const_t<T>;
  const std::int64_t L = keys.layers, H = keys.heads, N = seq.length, D = keys.dim;
  // The gathers run after the budgets' upload (the event's one synchronisation), so that it
  // waits for earlier work on the stream only, not for this event's copies. An event that keeps
  // every token reads no input (its selection comes from positions), so it gathers nothing.
  const auto gather = [&] {
    if (N == 0 || !lay.evicts) return;
    dev.paged_gather(PagedKVView<const E>(keys), device_table, N,
                     KVView<E>::hnd(reinterpret_cast<E*>(base), L, H, N, D));
    if (with_values)
      dev.paged_gather(PagedKVView<const E>(values), device_table, N,
                       KVView<E>::hnd(reinterpret_cast<E*>(base + lay.values_at), L, H, N, D));
  };
  // The table's CSR offsets for the compaction ({0, pages}) travel with the budgets.
  const std::int64_t offsets[2] = {0, seq.pages(keys.page_size)};
  const std::size_t compact_bytes = dev.paged_compact_bytes(keys, PagedTables{nullptr, nullptr, 1, N});
  Regions regions;
  PolicyEvent e = select(dev, base + lay.event_at, lay.event_bytes, policy, in, budget, out,
                         EventInfo{}, offsets, compact_bytes, &regions, gather);
  const PagedTables tables{device_table, regions.tail, 1, N};
  dev.paged_compact(keys, values, tables, out, regions.scratch);
  return e;
}

}  // namespace detail

// Sizes the caller allocates for one event: reads shapes only (device pointers in `in` are not
// dereferenced here, but must be the non-null device pointers select() will read). Same checks
// as select(): a stage without a device path, a bad shape or budget raise kvpolicy::Error naming
// it.
template <Element T>
PolicyPlan plan(const Policy& policy, const Inputs<T>& in, const Budget& budget,
                const EventInfo& ev = {}) {
  return detail::plan(detail::cuda_device{}, policy, in, budget, ev);
}

// Policy::select on device tensors: `in` holds device views, `out` a device CSR selection of
// plan().rows + 1 offsets and plan().kept_capacity indices, be.workspace plan().workspace_bytes
// bytes. Asynchronous on be.stream (see the header comment).
template <Element T>
PolicyEvent select(const cuda_backend& be, const Policy& policy, const Inputs<T>& in,
                   const Budget& budget, CsrSelection& out, const EventInfo& ev = {}) {
  return detail::select(detail::cuda_device{be}, be.workspace, be.workspace_bytes, policy, in,
                        budget, out, ev);
}

// Policy::compress on device tensors: select, then compact `keys` and `values` (device views of
// the memory in.keys / in.values read; values may be empty) in place on the same stream.
template <Element T>
PolicyEvent compress(const cuda_backend& be, const Policy& policy, const KVView<T>& keys,
                     const KVView<T>& values, const Inputs<T>& in, const Budget& budget,
                     CsrSelection& out, const EventInfo& ev = {}) {
  const detail::cuda_device dev{be};
  return detail::compress(dev, be.workspace, be.workspace_bytes, policy, keys, values, in, budget,
                          out, ev);
}

// One request of a paged device pool (vLLM-style blocks): sizes for compress_paged. `seq` is the
// request's host block table and length (checked like kvpolicy::compress_paged: table entries
// in range, no block twice). The workspace holds a dense copy of the request's keys (and values
// when the policy reads them) besides the event's own: L * H * length * dim elements each.
template <Element T>
PolicyPlan plan_paged(const Policy& policy, const PagedKVView<T>& keys,
                      const PagedKVView<T>& values, const PagedSequence& seq,
                      const KVView<const std::remove_const_t<T>>& queries, const Budget& budget) {
  return detail::plan_paged(detail::cuda_device{}, policy, keys, values, seq, queries, budget);
}

// kvpolicy::compress_paged on the device: gather, select, compact the pool in place inside the
// request's blocks (values too when values.data is set). `device_table` is seq.block_table in
// device memory. `out` receives the selection (device CSR, plan_paged's rows and
// kept_capacity); cuda::paged_bookkeeping turns its downloaded offsets into the new length,
// per-head lengths and freed blocks. Shared (prefix-cache) blocks are not checked here: see
// cuda/paged.hpp. One host synchronisation, as select().
template <Element T>
PolicyEvent compress_paged(const cuda_backend& be, const Policy& policy,
                           const PagedKVView<T>& keys, const PagedKVView<T>& values,
                           const PagedSequence& seq, const std::int32_t* device_table,
                           const KVView<const std::remove_const_t<T>>& queries,
                           const Budget& budget, CsrSelection& out) {
  return detail::compress_paged(detail::cuda_device{be}, be.workspace, be.workspace_bytes, policy,
                                keys, values, seq, device_table, queries, budget, out);
}

// A batch of dense sequences (ragged lengths; layers, heads and dim equal): sizes for
// compress_batch. workspace_bytes covers the largest sequence; kept_capacity bounds every
// sequence's CSR output (each sequence has its own).
template <Element T>
PolicyPlan plan_batch(const Policy& policy, std::span<const DenseSequence<T>> seqs,
                      const Budget& budget, std::span<const Budget> budgets = {}) {
  return detail::plan_batch(detail::cuda_device{}, policy, seqs, budget, budgets);
}

// kvpolicy::compress_batch on the device: every sequence is checked first (nothing is written
// unless all pass), then each is selected and compacted in place, in order, on be.stream with
// the one workspace; outs[i] receives sequence i's selection. budgets: empty (`budget` for all)
// or one per sequence. One host synchronisation per sequence (its budgets' upload).
template <Element T>
std::vector<PolicyEvent> compress_batch(const cuda_backend& be, const Policy& policy,
                                        std::span<const DenseSequence<T>> seqs,
                                        const Budget& budget, std::span<CsrSelection> outs,
                                        std::span<const Budget> budgets = {}) {
  return detail::compress_batch(detail::cuda_device{be}, be.workspace, be.workspace_bytes, policy,
                                seqs, budget, budgets, outs);
}

#if defined(KVPOLICY_WITH_CUDA)
// What run_owned() reports: the selection, downloaded, and the event.
struct OwnedEvent {
  Selection selection;
  PolicyEvent event;
};

// select() / compress() for callers without an allocator of their own (bindings, scripts, the
// Python device entry): on CUDA device `device` (the tensors' own; made current for the call and
// restored after), allocates the workspace and the CSR output (cudaMalloc), runs the event on
// `stream` (a stream of that device; nullptr: the legacy default stream), downloads the
// selection and waits for the stream. `compact`: compress `keys` / `values` in place (the memory
// `in` reads) after selecting. Not for an engine's hot path: cudaMalloc / cudaFree synchronise
// the device.
template <Element T>
OwnedEvent run_owned(int device, void* stream, const Policy& policy, const KVView<T>& keys,
                     const KVView<T>& values, const Inputs<T>& in, const Budget& budget,
                     bool compact, const EventInfo& ev = {}) {
  const DeviceGuard on_device(device);  // first: the workspace queries ask the current device
  const PolicyPlan p = plan(policy, in, budget, ev);
  // Under an exchange, an allocation that fails on one rank fails the others' select().
  DeviceBuffer ws, offsets, indices;
  try {
    ws = DeviceBuffer(p.workspace_bytes);
    offsets = DeviceBuffer(static_cast<std::size_t>(p.rows + 1) * sizeof(std::int64_t));
    indices = DeviceBuffer(static_cast<std::size_t>(std::max<std::int64_t>(p.kept_capacity, 1)) *
                           sizeof(std::int32_t));
  } catch (const std::exception& e) {
    if (const HeadShard* x = detail::exchange_of(policy, ev)) detail::report_failure(*x, e);
    throw;
  }
  CsrSelection csr{in.layers(), in.kv_heads(), offsets.as<std::int64_t>(),
                   indices.as<std::int32_t>(), p.kept_capacity};
  const cuda_backend be{stream, ws.data(), p.workspace_bytes};
  OwnedEvent r;
  r.event = compact ? compress(be, policy, keys, values, in, budget, csr, ev)
                    : select(be, policy, in, budget, csr, ev);
  HostCsr host;
  host.layers = csr.layers;
  host.heads = csr.heads;
  host.offsets.assign(static_cast<std::size_t>(p.rows + 1), 0);
  if (p.rows == 0) {  // (no kernel wrote offsets[0])
    synchronize(stream);
    r.selection = from_csr(host);
    return r;
  }
  copy_to_host(host.offsets.data(), csr.offsets, host.offsets.size() * sizeof(std::int64_t),
               stream);
  KVP_REQUIRE(host.offsets.back() >= 0 && host.offsets.back() <= p.kept_capacity,
              "cuda::run_owned: the device selection holds ", host.offsets.back(),
              " indices, outside [0, ", p.kept_capacity, "]");
  host.indices.resize(static_cast<std::size_t>(host.offsets.back()));
  copy_to_host(host.indices.data(), csr.indices, host.indices.size() * sizeof(std::int32_t),
               stream);
  r.selection = from_csr(host);
  return r;
}
#endif

}  // namespace kvpolicy::cuda
