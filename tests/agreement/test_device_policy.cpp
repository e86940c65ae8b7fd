// Spec-string policies on the device path (kvpolicy/cuda/policy.hpp) against Policy::select on
// the CPU: for every device scorer x allocator chain, ratio and total budgets, random data and
// data full of ties, the kept sets, the protection and the warning must be identical.
// The CPU half runs the device runner on a host emulation of the kernels
// (tests/common/device_emulation.hpp): it checks the chain the runner builds, its workspace and
// its budgets. The [gpu] half runs the same cases on a cuda_backend where a GPU exists.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include <kvpolicy/cuda/policy.hpp>
#include <kvpolicy/kvpolicy.hpp>

#include "agreement/gpu_util.hpp"
#include "common/device_emulation.hpp"
#include "common/random_kv.hpp"

namespace kvt_agreement_device_policy {

using namespace kvpolicy;
using Catch::Contains;

namespace {

constexpr std::int64_t kL = 3, kH = 3, kG = 2, kT = 97, kD = 8, kQ = 20;

struct Model {
  kvtest::Tensor<float> k, v, q;
  std::vector<float> rec;  // context-reconstruction scores [L][H][tokens] (kvzip)

  Model(std::uint64_t seed, bool ties, std::int64_t tokens = kT) {
    kvtest::Rng rng(seed);
    auto values = [&](std::int64_t heads, std::int64_t n) {
      std::vector<double> x(static_cast<std::size_t>(kL * heads * n * kD));
      for (auto& e : x) e = ties ? static_cast<double>(rng.integer(-1, 1)) : 2.0 * rng.uniform();
      return x;
    };
    k = kvtest::make_tensor<float>(kL, kH, tokens, kD, values(kH, tokens));
    v = kvtest::make_tensor<float>(kL, kH, tokens, kD, values(kH, tokens));
    q = kvtest::make_tensor<float>(kL, kH * kG, kQ, kD, values(kH * kG, kQ));
    for (double x : values(kH, tokens / kD + 1)) rec.push_back(static_cast<float>(x));
    rec.resize(static_cast<std::size_t>(kL * kH * tokens));
  }
  Inputs<float> inputs() const {
    Inputs<float> in;
    in.keys = k.view();
    in.values = v.view();
    in.queries = q.view();
    in.reconstruction = rec.data();
    return in;
  }
};

// The device runner on the emulation: plan, a 256-byte aligned workspace, a CSR of the planned
// size, select.
struct EmulatedRun {
  Selection sel;
  cuda::PolicyEvent event;
  std::vector<std::string> calls;
};

EmulatedRun run_emulated(const Policy& p, const Inputs<float>& in, const Budget& b,
                         const EventInfo& ev = {}) {
  kvtest::EmulatedDevice dev;
  const cuda::PolicyPlan plan = cuda::detail::plan(dev, p, in, b, ev);
  REQUIRE(plan.rows == in.layers() * in.kv_heads());
  std::vector<std::byte> storage(plan.workspace_bytes + 256);
  void* ws = storage.data() + (256 - reinterpret_cast<std::uintptr_t>(storage.data()) % 256) % 256;
  std::memset(ws, 0xff, plan.workspace_bytes);  // NaN bytes: nothing may read before writing
  dev.ws_begin = static_cast<const std::byte*>(ws);
  dev.ws_bytes = plan.workspace_bytes;
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(plan.rows + 1), -1);
  std::vector<std::int32_t> indices(static_cast<std::size_t>(plan.kept_capacity) + 1, -1);
  cuda::CsrSelection csr{in.layers(), in.kv_heads(), offsets.data(), indices.data(),
                         plan.kept_capacity};
  EmulatedRun r;
  r.event = cuda::detail::select(dev, ws, plan.workspace_bytes, p, in, b, csr, ev);
  REQUIRE(indices.back() == -1);  // nothing past the planned capacity
  r.sel = cuda::from_csr(in.layers(), in.kv_heads(), offsets, indices);
  r.calls = dev.calls;
  return r;
}

#if defined(KVPOLICY_WITH_CUDA)  // used by the [gpu] half only
// For a device scorer whose scores equal the CPU's only to fp32 rounding (expected attention's
// GEMMs sum in another order): the same number of kept tokens per layer, and in each row at most
// 3% of the kept tokens (at least 1) exchanged, i.e. near-ties at the cut.
void require_nearly_same_rows(const Selection& want, const Selection& got) {
  REQUIRE(got.layers() == want.layers());
  REQUIRE(got.heads() == want.heads());
  for (std::int64_t l = 0; l < want.layers(); ++l) {
    std::int64_t nw = 0, ng = 0;
    for (std::int64_t h = 0; h < want.heads(); ++h) {
      INFO("layer " << l << " head " << h);
      const auto w = want.kept(l, h), g = got.kept(l, h);
      nw += static_cast<std::int64_t>(w.size());
      ng += static_cast<std::int64_t>(g.size());
      std::vector<std::int32_t> common;
      std::set_intersection(w.begin(), w.end(), g.begin(), g.end(), std::back_inserter(common));
      const auto missing = static_cast<std::int64_t>(w.size() - common.size());
      REQUIRE(missing <= std::max<std::int64_t>(1, static_cast<std::int64_t>(w.size()) * 3 / 100));
    }
    REQUIRE(ng == nw);
  }
}
#endif

void require_same_rows(const Selection& want, const Selection& got) {
  REQUIRE(got.layers() == want.layers());
  REQUIRE(got.heads() == want.heads());
  for (std::int64_t l = 0; l < want.layers(); ++l)
    for (std::int64_t h = 0; h < want.heads(); ++h) {
      INFO("layer " << l << " head " << h);
      const auto w = want.kept(l, h), g = got.kept(l, h);
      REQUIRE(std::vector<std::int32_t>(g.begin(), g.end()) ==
              std::vector<std::int32_t>(w.begin(), w.end()));
    }
}

// cuda::plan on the emulation (cuda::plan itself asks the CUDA library for workspace sizes).
cuda::PolicyPlan plan_emulated(const Policy& p, const Inputs<float>& in, const Budget& b,
                               const EventInfo& ev = {}) {
  return cuda::detail::plan(kvtest::EmulatedDevice{}, p, in, b, ev);
}

// Every registered scorer with a device path (so that a new kernel is compared here without an
// edit), snapkv with a window that leaves tokens to evict.
const std::vector<std::string>& scorers() {
  static const std::vector<std::string> s = [] {
    std::vector<std::string> out;
    auto add = [&](auto sc) {
      using S = decltype(sc);
      if constexpr (cuda::detail::device_scorer<S, float>)
        out.push_back(S::name == "snapkv"     ? "snapkv(window=16,kernel=5)"
                      : S::name == "expected" ? "expected(theta=10000,window=16)"
                                              : std::string(S::name));
    };
    std::apply([&](auto... sc) { (add(sc), ...); }, scorer_types{});
    return out;
  }();
  return s;
}
const std::vector<std::string>& chains() {
  static const std::vector<std::string> c = {"",
                                             " | pyramid",
                                             " | depthkv(weights=0.2:1:3)",
                                             " | adakv",
                                             " | adakv(alpha=0)",
                                             " | pyramid | adakv",
                                             " | depthkv(weights=0.2:1:3) | adakv",
                                             " | uniform | adakv | uniform",
                                             " | adakv | adakv(alpha=0.5)",
                                             " | adakv | semantic | int2",
                                             " | ams(window=8,min_seg_len=4,max_seg_len=16,"
                                             "sinks=2,keep_last=4)",
                                             " | pyramid | adakv | ams(window=32,kernel=3,"
                                             "segment_mass=0.1,min_seg_len=3,min_keep=2,"
                                             "sinks=1,keep_last=3)"};
  return c;
}
std::vector<Budget> budgets() {
  return {Budget::ratio(0.3), Budget::total(kL * kH * 31 + 5), Budget::tokens(8), Budget::ratio(1.0)};
}

}  // namespace

TEST_CASE("device policy (emulated kernels): every device scorer x allocator chain keeps the CPU's sets",
          "[agreement][device_policy]") {
  // Every registered scorer has a device path today (h2o, snapkv, streaming, tova, knorm,
  // keydiff, expected, kvzip); a new device scorer joins the list from the registry.
  REQUIRE(scorers().size() == std::tuple_size_v<scorer_types>);
  for (bool ties : {false, true}) {
    const Model m(ties ? 11 : 7, ties);
    const Inputs<float> in = m.inputs();
    for (const auto& sc : scorers())
      for (const auto& ch : chains())
        for (const Budget& b : budgets()) {
          const std::string spec = sc + ch;
          INFO(spec << (ties ? " (ties)" : "") << " budget kind " << static_cast<int>(b.kind())
                    << " value " << b.value());
          const Policy p(spec);
          Protect want_protect;
          const Selection want = p.select(cpu_backend{}, in, b, EventInfo{}, nullptr, &want_protect);
          const EmulatedRun got = run_emulated(p, in, b);
          require_same_rows(want, got.sel);
          REQUIRE(got.event.protect.sinks == want_protect.sinks);
          REQUIRE(got.event.protect.recent == want_protect.recent);
          REQUIRE(got.event.warning == want.warning());
          // The chain the runner built: the budgets uploaded first, one score, one adakv kernel per
          // adakv stage, the ams step, the selection.
          const bool evicts = b.kind() != Budget::Kind::ratio || b.value() < 1.0;
          REQUIRE(got.event.evicts == evicts);
          std::vector<std::string> calls = {"upload"};
          if (!evicts) {
            calls.push_back("score:streaming");
          } else {
            calls.push_back("score:" + std::string(p.scorer_name()));
            for (const auto& a : p.allocators()) {
              if (std::holds_alternative<AdaKV>(a)) calls.push_back("adakv:device");
              if (std::holds_alternative<AMS>(a)) calls.push_back("ams:device");
            }
          }
          calls.push_back("select:device");
          REQUIRE(got.calls == calls);
        }
  }
}

TEST_CASE("device policy (emulated kernels): layered events, small budgets and the keep-all policy",
          "[agreement][device_policy]") {
  const Model m(3, false);
  const Inputs<float> in = m.inputs();
  SECTION("an event that is layers [2, 5) of a 6-layer model (pyramid and depthkv read it)") {
    EventInfo ev;
    ev.first_layer = 2;
    ev.model_layers = 6;
    for (const char* spec : {"snapkv(window=16) | pyramid | adakv", "knorm | depthkv(weights=1:2:0.5:3:1:1)"}) {
      INFO(spec);
      const Policy p(spec);
      const Selection want = p.select(cpu_backend{}, in, Budget::ratio(0.25), ev);
      require_same_rows(want, run_emulated(p, in, Budget::ratio(0.25), ev).sel);
    }
  }
  SECTION("a budget below snapkv's protected window keeps the newest tokens, with the warning") {
    const Policy p("snapkv(window=16) | adakv");
    const Selection want = p.select(cpu_backend{}, in, Budget::tokens(6));
    const EmulatedRun got = run_emulated(p, in, Budget::tokens(6));
    REQUIRE_FALSE(want.warning().empty());
    REQUIRE(got.event.warning == want.warning());
    REQUIRE(got.event.protect.recent == 6);
    require_same_rows(want, got.sel);
  }
  SECTION("a quantizer-only policy keeps every token and refuses a budget that evicts") {
    const Policy p("int2");
    const EmulatedRun got = run_emulated(p, in, Budget::ratio(1.0));
    require_same_rows(Selection::all(kL, kH, kT), got.sel);
    REQUIRE_THROWS_WITH(run_emulated(p, in, Budget::ratio(0.5)), Contains("keeps every token"));
  }
  SECTION("compress compacts keys and values like the CPU") {
    const Policy p("snapkv(window=16) | pyramid | adakv");
    Model a(3, false), c(3, false);
    Inputs<float> ina = a.inputs(), inc = c.inputs();
    p.compress(cpu_backend{}, a.k.mut_view(), a.v.mut_view(), ina, Budget::ratio(0.4));
    kvtest::EmulatedDevice dev;
    const auto plan = cuda::detail::plan(dev, p, inc, Budget::ratio(0.4), {});
    std::vector<std::byte> storage(plan.workspace_bytes + 256);
    void* ws = storage.data() + (256 - reinterpret_cast<std::uintptr_t>(storage.data()) % 256) % 256;
    dev.ws_begin = static_cast<const std::byte*>(ws);
    dev.ws_bytes = plan.workspace_bytes;
    std::vector<std::int64_t> off(static_cast<std::size_t>(plan.rows + 1));
    std::vector<std::int32_t> idx(static_cast<std::size_t>(plan.kept_capacity));
    cuda::CsrSelection csr{kL, kH, off.data(), idx.data(), plan.kept_capacity};
    cuda::detail::compress(dev, ws, plan.workspace_bytes, p, c.k.mut_view(), c.v.mut_view(), inc,
                           Budget::ratio(0.4), csr, EventInfo{});
    REQUIRE(dev.calls.back() == "compact");
    REQUIRE(a.k.buf == c.k.buf);
    REQUIRE(a.v.buf == c.v.buf);
  }
}

TEST_CASE("device policy (emulated kernels): a paged request is selected and compacted as "
          "compress_paged does", "[agreement][device_policy]") {
  constexpr std::int64_t kP = 8, kBlocks = 14, kN = 45;  // 6 pages of 8 tokens
  const Model m(4, false);
  kvtest::Rng rng(21);
  std::vector<float> kpool(static_cast<std::size_t>(kL * kBlocks * kP * kH * kD)), vpool(kpool.size());
  for (auto& e : kpool) e = static_cast<float>(2.0 * rng.uniform());
  for (auto& e : vpool) e = static_cast<float>(2.0 * rng.uniform());
  const std::vector<std::int32_t> table = {9, 2, 13, 5, 0, 11, 7};  // the last entry: padding
  const PagedSequence seq{table, kN};
  for (const char* spec : {"snapkv(window=16) | pyramid | adakv", "knorm | adakv(alpha=0)", "tova",
                           "streaming", "h2o | depthkv(weights=1:2:3)", "keydiff | uniform"})
    for (const Budget& b : {Budget::ratio(0.3), Budget::total(kL * kH * 11 + 2), Budget::ratio(1.0)}) {
      INFO(spec << " budget value " << b.value());
      const Policy p(spec);
      std::vector<float> ka = kpool, va = vpool, kb = kpool, vb = vpool;
      auto pool = [](std::vector<float>& x) {
        return PagedKVView<float>::nhd(x.data(), kBlocks, kL, kH, kP, kD);
      };
      const PagedCompressResult want =
          compress_paged(p, cpu_backend{}, pool(ka), pool(va), seq, m.q.view(), b);
      kvtest::EmulatedDevice dev;
      const cuda::PolicyPlan plan =
          cuda::detail::plan_paged(dev, p, pool(kb), pool(vb), seq, m.q.view(), b);
      std::vector<std::byte> storage(plan.workspace_bytes + 256);
      void* ws = storage.data() + (256 - reinterpret_cast<std::uintptr_t>(storage.data()) % 256) % 256;
      std::memset(ws, 0xff, plan.workspace_bytes);
      dev.ws_begin = static_cast<const std::byte*>(ws);
      dev.ws_bytes = plan.workspace_bytes;
      std::vector<std::int64_t> off(static_cast<std::size_t>(plan.rows + 1));
      std::vector<std::int32_t> idx(static_cast<std::size_t>(plan.kept_capacity));
      cuda::CsrSelection csr{kL, kH, off.data(), idx.data(), plan.kept_capacity};
      const cuda::PolicyEvent e = cuda::detail::compress_paged(
          dev, ws, plan.workspace_bytes, p, pool(kb), pool(vb), seq, table.data(), m.q.view(), b, csr);
      require_same_rows(want.selection, cuda::from_csr(kL, kH, off, idx));
      REQUIRE(e.warning == want.selection.warning());
      REQUIRE(kb == ka);
      REQUIRE(vb == va);
      // One synchronisation (the upload) before the event's own kernels, the gathers first; an
      // event that keeps every token gathers nothing.
      REQUIRE(dev.calls.size() >= 3);
      REQUIRE(dev.calls[0] == "upload");
      const bool keeps_all = b.kind() == Budget::Kind::ratio && b.value() == 1.0;
      REQUIRE((dev.calls[1] == "paged_gather") == !keeps_all);
      const long gathers = keeps_all ? 0 : has(p.needs(), Needs::values) ? 2 : 1;  // keys, values
      REQUIRE(std::count(dev.calls.begin(), dev.calls.end(), "paged_gather") == gathers);
      REQUIRE(dev.calls.back() == "paged_compact");
      // What the host learns from the offsets alone: compress_paged's bookkeeping.
      const cuda::PagedBookkeeping book = cuda::paged_bookkeeping(off, seq, kP);
      REQUIRE(book.new_length == want.compact.new_length);
      REQUIRE(book.freed_blocks == want.compact.freed_blocks);
    }
  kvtest::EmulatedDevice dev;
  std::vector<float> k = kpool;
  const auto pool = PagedKVView<float>::nhd(k.data(), kBlocks, kL, kH, kP, kD);
  const std::vector<std::int32_t> twice = {9, 2, 9, 5, 0, 11};
  const PagedKVView<float> none{};
  REQUIRE_THROWS_WITH(cuda::detail::plan_paged(dev, Policy("knorm"), pool, none,
                                               PagedSequence{twice, kN}, m.q.view(), Budget::ratio(0.5)),
                      Contains("appears twice"));
  REQUIRE_THROWS_WITH(cuda::detail::plan_paged(dev, Policy("knorm"), pool, pool, seq, m.q.view(),
                                               Budget::ratio(0.5)),
                      Contains("same memory as keys"));
  REQUIRE_THROWS_WITH(cuda::detail::plan_paged(dev, Policy("knorm | semantic"), pool, none, seq,
                                               m.q.view(), Budget::ratio(0.5)),
                      Contains("merger"));
}

TEST_CASE("device policy (emulated kernels): a ragged batch equals compress_batch",
          "[agreement][device_policy]") {
  const std::int64_t lengths[] = {97, 60, 33};
  std::vector<Model> cpu, dev_models;
  for (std::size_t i = 0; i < 3; ++i) {
    cpu.emplace_back(30 + i, false, lengths[i]);
    dev_models.emplace_back(30 + i, false, lengths[i]);
  }
  auto sequences = [](std::vector<Model>& ms) {
    std::vector<DenseSequence<float>> out;
    for (auto& m : ms) out.push_back({m.k.mut_view(), m.v.mut_view(), m.q.view()});
    return out;
  };
  const std::vector<Budget> per_seq = {Budget::ratio(0.3), Budget::total(kL * kH * 20),
                                       Budget::ratio(1.0)};
  for (const char* spec : {"snapkv(window=16) | pyramid | adakv", "knorm", "tova | adakv"}) {
    INFO(spec);
    const Policy p(spec);
    auto a = cpu, b = dev_models;
    const auto sa = sequences(a), sb = sequences(b);
    const std::vector<Selection> want = compress_batch(p, cpu_backend{}, sa, Budget::ratio(0.5), per_seq);
    kvtest::EmulatedDevice dev;
    const auto span = std::span<const DenseSequence<float>>(sb);
    const cuda::PolicyPlan plan = cuda::detail::plan_batch(dev, p, span, Budget::ratio(0.5),
                                                           std::span<const Budget>(per_seq));
    std::vector<std::byte> storage(plan.workspace_bytes + 256);
    void* ws = storage.data() + (256 - reinterpret_cast<std::uintptr_t>(storage.data()) % 256) % 256;
    dev.ws_begin = static_cast<const std::byte*>(ws);
    dev.ws_bytes = plan.workspace_bytes;
    std::vector<std::vector<std::int64_t>> off(3, std::vector<std::int64_t>(static_cast<std::size_t>(plan.rows + 1)));
    std::vector<std::vector<std::int32_t>> idx(3, std::vector<std::int32_t>(static_cast<std::size_t>(plan.kept_capacity)));
    std::vector<cuda::CsrSelection> outs;
    for (std::size_t i = 0; i < 3; ++i)
      outs.push_back({kL, kH, off[i].data(), idx[i].data(), plan.kept_capacity});
    cuda::detail::compress_batch(dev, ws, plan.workspace_bytes, p, span, Budget::ratio(0.5),
                                 std::span<const Budget>(per_seq), std::span<cuda::CsrSelection>(outs));
    for (std::size_t i = 0; i < 3; ++i) {
      INFO("sequence " << i);
      require_same_rows(want[i], cuda::from_csr(kL, kH, off[i], idx[i]));
      REQUIRE(b[i].k.buf == a[i].k.buf);
      REQUIRE(b[i].v.buf == a[i].v.buf);
    }
    // A bad sequence anywhere: nothing is written.
    auto c = dev_models;
    auto sc = sequences(c);
    sc[2].queries = {};
    kvtest::EmulatedDevice dev2;
    dev2.ws_begin = dev.ws_begin;
    dev2.ws_bytes = dev.ws_bytes;
    if (p.query_window() != 0) {  // (knorm reads no queries)
      REQUIRE_THROWS_WITH(
          cuda::detail::compress_batch(dev2, ws, plan.workspace_bytes, p,
                                       std::span<const DenseSequence<float>>(sc), Budget::ratio(0.5),
                                       std::span<const Budget>(per_seq),
                                       std::span<cuda::CsrSelection>(outs)),
          Contains("sequence 2"));
      REQUIRE(dev2.calls.empty());
      REQUIRE(c[0].k.buf == dev_models[0].k.buf);
    }
  }
}

TEST_CASE("device policy (emulated kernels): ams carries its credit state across events as the "
          "CPU does", "[agreement][device_policy]") {
  const Model m(13, false);
  const Inputs<float> in = m.inputs();
  const Policy p("knorm | adakv | ams(window=8,min_seg_len=4,max_seg_len=16,sinks=2,keep_last=4)");
  const std::int64_t stride = kT + 3;  // a state row longer than the event's tokens
  std::vector<float> cpu_state(static_cast<std::size_t>(kL * kH * stride), 0.f);
  std::vector<float> dev_state = cpu_state;
  for (const Budget& b : {Budget::ratio(0.4), Budget::tokens(30), Budget::ratio(1.0)}) {
    EventInfo cpu_ev, dev_ev;
    cpu_ev.alloc_state = cpu_state.data();
    dev_ev.alloc_state = dev_state.data();
    cpu_ev.alloc_state_stride = dev_ev.alloc_state_stride = stride;
    const Selection want = p.select(cpu_backend{}, in, b, cpu_ev);
    const EmulatedRun got = run_emulated(p, in, b, dev_ev);
    require_same_rows(want, got.sel);
    // Every event moves the credit on (a keep-all one scores nothing, so it moves none), and the
    // padding past the event's tokens is never written.
    REQUIRE(dev_state == cpu_state);
    for (std::int64_t r = 0; r < kL * kH; ++r)
      for (std::int64_t j = kT; j < stride; ++j)
        REQUIRE(dev_state[static_cast<std::size_t>(r * stride + j)] == 0.f);
  }
  REQUIRE(std::any_of(cpu_state.begin(), cpu_state.end(), [](float x) { return x > 0.f; }));
}

TEST_CASE("device policy: stages without a device path, and bad arguments, are refused by name",
          "[agreement][device_policy]") {
  const Model m(5, false);
  const Inputs<float> in = m.inputs();
  const Budget b = Budget::ratio(0.3);
  const External mine(External::Spec{"mine", Needs::keys, 0, {}, [](const ExternalInputs&, std::span<float> s) {
                                       std::fill(s.begin(), s.end(), 1.f);
                                     }});
  REQUIRE_THROWS_WITH(plan_emulated(Policy("mine | adakv", std::span<const External>(&mine, 1)), in, b),
                      Contains("scorer 'mine' has no CUDA kernel"));
  // The scorer's own checks, as on the CPU path: the default snapkv window wants 64 queries (20
  // given).
  REQUIRE_THROWS_WITH(Policy("snapkv").select(cpu_backend{}, in, b), Contains("queries"));
  REQUIRE_THROWS_WITH(run_emulated(Policy("snapkv"), in, b), Contains("queries"));
  REQUIRE_THROWS_WITH(plan_emulated(Policy("knorm"), in, Budget::ratio(1.5)), Contains("above 1"));
  EventInfo ev;
  ev.first_layer = 4;
  ev.model_layers = 6;
  REQUIRE_THROWS_WITH(plan_emulated(Policy("knorm | pyramid"), in, b, ev),
                      Contains("do not fit a model of 6 layers"));
#if defined(KVPOLICY_WITH_CUDA)
  // run_owned makes the tensors' device current before it allocates or launches anything: a
  // device no machine has is refused (here, without a GPU, the runtime's own error comes first)
  // and the (host) views are never read.
  {
    Model h(5, false);
    Inputs<float> hin = h.inputs();
    REQUIRE_THROWS_WITH(cuda::run_owned(4095, nullptr, Policy("knorm"), h.k.mut_view(),
                                        h.v.mut_view(), hin, b, true),
                        Contains("cuda device 4095: cannot select it") ||
                            Contains("DeviceGuard: CUDA error"));
  }
#endif
  // A shard's own checks (tests/agreement/test_device_head_shard.cpp runs sharded events).
  const HeadShard shard{0, 1, 0, kH + 1, nullptr, nullptr};
  EventInfo sharded;
  sharded.shard = &shard;
  REQUIRE_THROWS_WITH(plan_emulated(Policy("knorm"), in, b, sharded),
                      Contains("a single rank holds every KV head"));

  // Workspace and capacity below the plan: refused before any kernel runs.
  const Policy p("snapkv(window=16) | adakv");
  kvtest::EmulatedDevice dev;
  const auto plan = cuda::detail::plan(dev, p, in, b, {});
  std::vector<std::byte> storage(plan.workspace_bytes + 256);
  void* ws = storage.data() + (256 - reinterpret_cast<std::uintptr_t>(storage.data()) % 256) % 256;
  dev.ws_begin = static_cast<const std::byte*>(ws);
  dev.ws_bytes = plan.workspace_bytes;
  std::vector<std::int64_t> off(static_cast<std::size_t>(plan.rows + 1));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(plan.kept_capacity));
  cuda::CsrSelection csr{kL, kH, off.data(), idx.data(), plan.kept_capacity - 1};
  REQUIRE_THROWS_WITH(cuda::detail::select(dev, ws, plan.workspace_bytes, p, in, b, csr, {}),
                      Contains("kept_capacity"));
  csr.capacity = plan.kept_capacity;
  REQUIRE_THROWS_WITH(cuda::detail::select(dev, ws, plan.workspace_bytes - 1, p, in, b, csr, {}),
                      Contains("workspace of"));
  REQUIRE_THROWS_WITH(
      cuda::detail::select(dev, static_cast<std::byte*>(ws) + 8, plan.workspace_bytes, p, in, b,
                           csr, {}),
      Contains("256-byte aligned"));
  cuda::CsrSelection wrong{kL, kH + 1, off.data(), idx.data(), plan.kept_capacity};
  REQUIRE_THROWS_WITH(cuda::detail::select(dev, ws, plan.workspace_bytes, p, in, b, wrong, {}),
                      Contains("output selection is"));
  REQUIRE(dev.calls.empty());
}

TEST_CASE("device policy on the GPU: every device scorer x allocator chain keeps the CPU's sets",
          "[gpu][agreement][device_policy]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  for (bool ties : {false, true}) {
    Model m(ties ? 11 : 7, ties);
    const Inputs<float> host = m.inputs();
    auto dk = kvtest::upload(m.k.buf), dv = kvtest::upload(m.v.buf), dq = kvtest::upload(m.q.buf),
         dr = kvtest::upload(m.rec);
    Inputs<float> in = host;
    in.keys.data = static_cast<const float*>(dk.data());
    in.values.data = static_cast<const float*>(dv.data());
    in.queries.data = static_cast<const float*>(dq.data());
    in.reconstruction = static_cast<const float*>(dr.data());
    for (const auto& sc : scorers())
      for (const auto& ch : chains())
        for (const Budget& b : budgets()) {
          const std::string spec = sc + ch;
          INFO(spec << (ties ? " (ties)" : "") << " budget value " << b.value());
          const Policy p(spec);
          const Selection want = p.select(cpu_backend{}, host, b);
          const cuda::PolicyPlan plan = cuda::plan(p, in, b);
          cuda::DeviceBuffer ws(plan.workspace_bytes ? plan.workspace_bytes : 1);
          cuda::DeviceBuffer off(static_cast<std::size_t>(plan.rows + 1) * sizeof(std::int64_t));
          cuda::DeviceBuffer idx(static_cast<std::size_t>(std::max<std::int64_t>(plan.kept_capacity, 1)) *
                                 sizeof(std::int32_t));
          cuda::CsrSelection csr{kL, kH, static_cast<std::int64_t*>(off.data()),
                                 static_cast<std::int32_t*>(idx.data()), plan.kept_capacity};
          const cuda_backend be{nullptr, ws.data(), plan.workspace_bytes};
          const cuda::PolicyEvent e = cuda::select(be, p, in, b, csr);
          cuda::synchronize();
          const auto offsets = kvtest::download<std::int64_t>(off, static_cast<std::size_t>(plan.rows + 1));
          const auto indices = kvtest::download<std::int32_t>(idx, static_cast<std::size_t>(offsets.back()));
          const Selection got = cuda::from_csr(kL, kH, offsets, indices);
          // Expected attention's scores, and ams's masses (through the window attention), equal
          // the CPU's to fp32 rounding only.
          if (p.scorer_name() == "expected" || spec.find("ams") != std::string::npos)
            require_nearly_same_rows(want, got);
          else
            require_same_rows(want, got);
          REQUIRE(e.warning == want.warning());
        }
  }
#endif
}

TEST_CASE("device policy on the GPU: run_owned allocates, compresses and downloads as "
          "Policy::compress does", "[gpu][agreement][device_policy]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  const Policy p("snapkv(window=16) | pyramid | adakv");
  Model a(3, false), c(3, false);
  Inputs<float> ina = a.inputs();
  const Selection want =
      p.compress(cpu_backend{}, a.k.mut_view(), a.v.mut_view(), ina, Budget::ratio(0.4));
  auto dk = kvtest::upload(c.k.buf), dv = kvtest::upload(c.v.buf), dq = kvtest::upload(c.q.buf);
  KVView<float> k = c.k.mut_view(), v = c.v.mut_view();
  k.data = static_cast<float*>(dk.data());
  v.data = static_cast<float*>(dv.data());
  Inputs<float> in = c.inputs();
  in.keys = k;
  in.values = v;
  in.queries.data = static_cast<const float*>(dq.data());
  const cuda::OwnedEvent got =
      cuda::run_owned(0, nullptr, p, k, v, in, Budget::ratio(0.4), true);
  require_same_rows(want, got.selection);
  REQUIRE(got.event.warning == want.warning());
  REQUIRE(kvtest::download<float>(dk, a.k.buf.size()) == a.k.buf);
  REQUIRE(kvtest::download<float>(dv, a.v.buf.size()) == a.v.buf);
#endif
}

TEST_CASE("device policy on the GPU: a paged request is selected and compacted as "
          "compress_paged does", "[gpu][agreement][device_policy]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  constexpr std::int64_t kP = 8, kBlocks = 14, kN = 45;
  Model m(4, false);
  kvtest::Rng rng(21);
  std::vector<float> kpool(static_cast<std::size_t>(kL * kBlocks * kP * kH * kD)), vpool(kpool.size());
  for (auto& e : kpool) e = static_cast<float>(2.0 * rng.uniform());
  for (auto& e : vpool) e = static_cast<float>(2.0 * rng.uniform());
  const std::vector<std::int32_t> table = {9, 2, 13, 5, 0, 11, 7};
  const PagedSequence seq{table, kN};
  auto dq = kvtest::upload(m.q.buf);
  KVView<const float> q = m.q.view();
  q.data = static_cast<const float*>(dq.data());
  auto dtable = kvtest::upload(table);
  for (const char* spec : {"snapkv(window=16) | pyramid | adakv", "knorm | adakv(alpha=0)", "tova",
                           "h2o | depthkv(weights=1:2:3)"}) {
    INFO(spec);
    const Policy p(spec);
    std::vector<float> ka = kpool, va = vpool;
    const PagedCompressResult want = compress_paged(
        p, cpu_backend{}, PagedKVView<float>::nhd(ka.data(), kBlocks, kL, kH, kP, kD),
        PagedKVView<float>::nhd(va.data(), kBlocks, kL, kH, kP, kD), seq, m.q.view(),
        Budget::ratio(0.3));
    auto dk = kvtest::upload(kpool), dv = kvtest::upload(vpool);
    const auto keys = PagedKVView<float>::nhd(static_cast<float*>(dk.data()), kBlocks, kL, kH, kP, kD);
    const auto values = PagedKVView<float>::nhd(static_cast<float*>(dv.data()), kBlocks, kL, kH, kP, kD);
    const cuda::PolicyPlan plan = cuda::plan_paged(p, keys, values, seq, q, Budget::ratio(0.3));
    cuda::DeviceBuffer ws(plan.workspace_bytes), off(static_cast<std::size_t>(plan.rows + 1) * 8),
        idx(static_cast<std::size_t>(plan.kept_capacity + 1) * 4);
    cuda::CsrSelection csr{kL, kH, static_cast<std::int64_t*>(off.data()),
                           static_cast<std::int32_t*>(idx.data()), plan.kept_capacity};
    const cuda_backend be{nullptr, ws.data(), plan.workspace_bytes};
    cuda::compress_paged(be, p, keys, values, seq, static_cast<const std::int32_t*>(dtable.data()),
                         q, Budget::ratio(0.3), csr);
    cuda::synchronize();
    const auto offsets = kvtest::download<std::int64_t>(off, static_cast<std::size_t>(plan.rows + 1));
    const auto indices = kvtest::download<std::int32_t>(idx, static_cast<std::size_t>(offsets.back()));
    require_same_rows(want.selection, cuda::from_csr(kL, kH, offsets, indices));
    REQUIRE(kvtest::download<float>(dk, ka.size()) == ka);
    REQUIRE(kvtest::download<float>(dv, va.size()) == va);
  }
#endif
}

}  // namespace kvt_agreement_device_policy
