// Tensor parallelism on the device path (kvpolicy/cuda/policy.hpp with EventInfo::shard): N ranks
// simulated by N threads sharing an in-memory all-gather, each running the device runner on its
// share of the heads. Every rank must keep exactly what Policy::select on the CPU keeps for its
// heads in a single-rank run over every head, for every device scorer that scores heads alone x
// every allocator chain (adakv exchanging on the host), 3 KV heads split 3, 2+1, 1+2 and 1+1+1
// ways. The CPU half runs the runner on the host emulation of the kernels
// (tests/common/device_emulation.hpp); the [gpu] half runs the same ranks on one GPU.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <exception>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <kvpolicy/cuda/policy.hpp>
#include <kvpolicy/kvpolicy.hpp>

#include "agreement/gpu_util.hpp"
#include "common/all_gather_group.hpp"
#include "common/device_emulation.hpp"
#include "common/head_shard_data.hpp"
#include "common/random_kv.hpp"

namespace kvt_agreement_device_head_shard {

using namespace kvpolicy;
using Catch::Contains;

namespace {

constexpr std::int64_t kL = 3, kH = 3, kG = 2, kT = 90, kD = 8, kQ = 16;

// One event's data for every head (tests/common/head_shard_data.hpp).
struct Model : kvtest::HeadShardData {
  Model(std::uint64_t seed, bool ties) : HeadShardData(seed, ties, kL, kH, kG, kT, kD, kQ) {}
};

// Heads [h0, h0 + n): K, V, Q and the per-token state copied out contiguously (as a rank holds
// them), and the inputs over those copies.
struct Share {
  std::vector<float> k, v, q, acc, recon;
  std::int64_t heads = 0;

  Share(const Model& m, std::int64_t h0, std::int64_t n) : heads(n) {
    auto take = [](const kvtest::Tensor<float>& t, std::int64_t first, std::int64_t count) {
      const KVView<const float> x = t.view();
      std::vector<float> out;
      for (std::int64_t l = 0; l < x.layers; ++l)
        for (std::int64_t h = first; h < first + count; ++h)
          for (std::int64_t j = 0; j < x.tokens; ++j)
            for (std::int64_t i = 0; i < x.dim; ++i) out.push_back(x.at(l, h, j, i));
      return out;
    };
    k = take(m.k, h0, n);
    v = take(m.v, h0, n);
    q = take(m.q, h0 * kG, n * kG);
    for (std::int64_t l = 0; l < kL; ++l)
      for (std::int64_t h = h0; h < h0 + n; ++h)
        for (std::int64_t j = 0; j < kT; ++j) {
          const auto at = static_cast<std::size_t>((l * kH + h) * kT + j);
          acc.push_back(m.acc[at]);
          recon.push_back(m.recon[at]);
        }
  }
  // The inputs over `data` pointers (host copies, or their device uploads).
  Inputs<float> inputs(const float* kp, const float* vp, const float* qp, const float* ap,
                       const float* rp) const {
    Inputs<float> in;
    in.keys = KVView<const float>::hnd(kp, kL, heads, kT, kD);
    in.values = KVView<const float>::hnd(vp, kL, heads, kT, kD);
    in.queries = KVView<const float>::hnd(qp, kL, heads * kG, kQ, kD);
    in.accumulated = ap;
    in.reconstruction = rp;
    return in;
  }
  Inputs<float> inputs() const {
    return inputs(k.data(), v.data(), q.data(), acc.data(), recon.data());
  }
};

struct RankResult {
  Selection sel;
  cuda::PolicyEvent event;
  cuda::PolicyPlan plan;
  std::vector<std::string> calls;  // the emulated kernels, in order
  std::string error;
  std::int64_t gathers = 0;  // all_gather calls
};

// One rank's event on the emulated device: plan, then select (both agree when adakv exchanges).
void run_emulated(const Policy& p, const Inputs<float>& in, const Budget& b, const EventInfo& ev,
                  RankResult& res, bool short_workspace = false) {
  kvtest::EmulatedDevice dev;
  res.plan = cuda::detail::plan(dev, p, in, b, ev);
  std::vector<std::byte> storage(res.plan.workspace_bytes + 256);
  void* ws = storage.data() + (256 - reinterpret_cast<std::uintptr_t>(storage.data()) % 256) % 256;
  std::memset(ws, 0xff, res.plan.workspace_bytes);
  dev.ws_begin = static_cast<const std::byte*>(ws);
  dev.ws_bytes = res.plan.workspace_bytes;
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(res.plan.rows + 1), -1);
  std::vector<std::int32_t> indices(static_cast<std::size_t>(res.plan.kept_capacity) + 1, -1);
  cuda::CsrSelection csr{in.layers(), in.kv_heads(), offsets.data(), indices.data(),
                         res.plan.kept_capacity};
  try {
    res.event = cuda::detail::select(dev, ws, res.plan.workspace_bytes - (short_workspace ? 1 : 0),
                                     p, in, b, csr, ev);
  } catch (...) {
    res.calls = dev.calls;  // what ran before the error
    throw;
  }
  if (indices.back() != -1) throw std::runtime_error("wrote past the planned capacity");
  res.sel = cuda::from_csr(in.layers(), in.kv_heads(), offsets, indices);
  res.calls = dev.calls;
}

#if defined(KVPOLICY_WITH_CUDA)  // used by the [gpu] half only
// One rank's event on the GPU (every rank on the same device, each with its own buffers).
void run_gpu(const Policy& p, const Share& sh, const Budget& b, const EventInfo& ev,
             RankResult& res) {
  auto dk = kvtest::upload(sh.k), dv = kvtest::upload(sh.v), dq = kvtest::upload(sh.q),
       da = kvtest::upload(sh.acc), dr = kvtest::upload(sh.recon);
  const Inputs<float> in = sh.inputs(static_cast<const float*>(dk.data()),
                                     static_cast<const float*>(dv.data()),
                                     static_cast<const float*>(dq.data()),
                                     static_cast<const float*>(da.data()),
                                     static_cast<const float*>(dr.data()));
  res.plan = cuda::plan(p, in, b, ev);
  cuda::DeviceBuffer ws(res.plan.workspace_bytes ? res.plan.workspace_bytes : 1);
  cuda::DeviceBuffer off(static_cast<std::size_t>(res.plan.rows + 1) * sizeof(std::int64_t));
  cuda::DeviceBuffer idx(static_cast<std::size_t>(std::max<std::int64_t>(res.plan.kept_capacity, 1)) *
                         sizeof(std::int32_t));
  cuda::CsrSelection csr{kL, sh.heads, static_cast<std::int64_t*>(off.data()),
                         static_cast<std::int32_t*>(idx.data()), res.plan.kept_capacity};
  const cuda_backend be{nullptr, ws.data(), res.plan.workspace_bytes};
  res.event = cuda::select(be, p, in, b, csr, ev);
  cuda::synchronize();
  const auto offsets = kvtest::download<std::int64_t>(off, static_cast<std::size_t>(res.plan.rows + 1));
  const auto indices = kvtest::download<std::int32_t>(idx, static_cast<std::size_t>(offsets.back()));
  res.sel = cuda::from_csr(kL, sh.heads, offsets, indices);
}
#endif

// Runs `p` on ranks holding `split` heads each, one thread per rank, on the emulated device or
// the GPU. `tweak(rank, shard, in)` may spoil a rank's arguments.
template <class Tweak>
std::vector<RankResult> run_ranks(const Policy& p, const Model& m, const Budget& b,
                                  const std::vector<std::int64_t>& split, bool gpu, Tweak&& tweak,
                                  int short_workspace_rank = -1) {
  const int R = static_cast<int>(split.size());
  kvtest::Group group(R);
  std::vector<kvtest::Group::Member> members(static_cast<std::size_t>(R));
  std::vector<RankResult> out(static_cast<std::size_t>(R));
  std::vector<std::thread> threads;
  std::int64_t h0 = 0;
  for (int r = 0; r < R; ++r) {
    const std::int64_t n = split[static_cast<std::size_t>(r)];
    threads.emplace_back([&, r, h0, n] {
      auto& res = out[static_cast<std::size_t>(r)];
      auto& mem = members[static_cast<std::size_t>(r)];
      mem.group = &group;
      mem.rank = r;
      const Share share(m, h0, n);
      HeadShard shard;
      shard.rank = r;
      shard.ranks = R;
      shard.first_head = h0;
      shard.model_heads = kH;
      shard.all_gather = &kvtest::Group::all_gather;
      shard.user = &mem;
      Inputs<float> in = share.inputs();
      tweak(r, shard, in);
      EventInfo ev;
      ev.shard = &shard;
      try {
        if (gpu) {
#if defined(KVPOLICY_WITH_CUDA)
          run_gpu(p, share, b, ev, res);
#endif
        } else {
          run_emulated(p, in, b, ev, res, r == short_workspace_rank);
        }
      } catch (const std::exception& e) {
        res.error = e.what();
      }
      res.gathers = mem.calls;
    });
    h0 += n;
  }
  for (auto& t : threads) t.join();
  return out;
}
std::vector<RankResult> run_ranks(const Policy& p, const Model& m, const Budget& b,
                                  const std::vector<std::int64_t>& split, bool gpu = false) {
  return run_ranks(p, m, b, split, gpu, [](int, HeadShard&, Inputs<float>&) {});
}

// Every rank keeps the single-rank CPU run's rows of its heads.
void require_same_as_one_rank(const std::string& spec, const Model& m, const Budget& b, bool gpu) {
  const Policy p(spec);
  const Share all(m, 0, kH);
  const Selection want = p.select(cpu_backend{1}, all.inputs(), b);
  for (const auto& split : std::vector<std::vector<std::int64_t>>{{3}, {2, 1}, {1, 2}, {1, 1, 1}}) {
    INFO(spec << ", " << split.size() << " ranks, the first holding " << split[0] << " heads");
    const auto res = run_ranks(p, m, b, split, gpu);
    std::int64_t h0 = 0;
    for (std::size_t r = 0; r < res.size(); ++r) {
      INFO("rank " << r);
      REQUIRE(res[r].error.empty());
      const std::int64_t n = split[r];
      REQUIRE(res[r].sel.heads() == n);
      // On the GPU, ams's masses equal the CPU's to fp32 rounding only (its window attention):
      // a row may then exchange a near-tie at its cut (at most 3% of its kept tokens, at least 1).
      const bool near = gpu && spec.find("ams") != std::string::npos;
      for (std::int64_t l = 0; l < kL; ++l)
        for (std::int64_t h = 0; h < n; ++h) {
          INFO("layer " << l << ", model head " << h0 + h);
          const auto got = res[r].sel.kept(l, h), ref = want.kept(l, h0 + h);
          const std::vector<std::int32_t> g(got.begin(), got.end()), w(ref.begin(), ref.end());
          if (!near) {
            REQUIRE(g == w);
            continue;
          }
          REQUIRE(g.size() == w.size());
          std::vector<std::int32_t> common;
          std::set_intersection(w.begin(), w.end(), g.begin(), g.end(), std::back_inserter(common));
          REQUIRE(static_cast<std::int64_t>(w.size() - common.size()) <=
                  std::max<std::int64_t>(1, static_cast<std::int64_t>(w.size()) * 3 / 100));
        }
      REQUIRE(res[r].event.warning == want.warning());
      // Chains that combine no heads exchange nothing; adakv's do once they are sharded, and
      // only theirs download scores (its host step).
      const bool exchanges = split.size() > 1 && p.spans_heads();
      if (!exchanges) REQUIRE(res[r].gathers == 0);
      else REQUIRE(res[r].gathers > 0);
      if (!gpu) {
        const bool downloads =
            std::find(res[r].calls.begin(), res[r].calls.end(), "download") != res[r].calls.end();
        const bool evicts = b.kind() != Budget::Kind::ratio || b.value() < 1.0;
        REQUIRE(downloads == (exchanges && evicts));
        if (exchanges) REQUIRE(res[r].plan.kept_capacity == kL * n * kT);
      }
      h0 += n;
    }
  }
}

// The device scorers that score each head alone (tova and expected combine heads: refused under a
// shard, tested below), from the registry.
std::vector<std::string> scorer_specs() {
  std::vector<std::string> out;
  auto add = [&](auto s) {
    using S = decltype(s);
    if constexpr (cuda::detail::device_scorer<S, float> && !kvpolicy::detail::spans_heads<S>())
      out.push_back(S::name == "snapkv" ? "snapkv(window=8)" : std::string(S::name));
  };
  std::apply([&](auto... s) { (add(s), ...); }, scorer_types{});
  return out;
}
const char* const kChains[] = {"",
                               " | pyramid(beta=2)",
                               " | depthkv(weights=0.2:1:3)",
                               " | adakv",
                               " | adakv(alpha=0)",
                               " | ams(window=8,min_seg_len=4)",
                               " | pyramid(beta=2) | adakv(alpha=0.1)",
                               " | depthkv(weights=0.2:1:3) | adakv | ams(window=8,min_seg_len=4)",
                               " | adakv(alpha=0.5) | ams(window=8,min_seg_len=4,min_keep=2)"};

void every_chain(bool gpu) {
  const std::vector<std::string> scorers = scorer_specs();
  REQUIRE(scorers.size() == std::tuple_size_v<scorer_types> - 2);  // all but tova and expected
  for (bool ties : {false, true}) {
    const Model m(ties ? 91 : 90, ties);
    for (const std::string& s : scorers)
      for (const char* c : kChains) {
        const std::string spec = s + c;
        require_same_as_one_rank(spec, m, Budget::ratio(0.3), gpu);
        // A total that does not divide over the 9 rows: the remainder goes to the model's first
        // rows whichever rank holds them.
        require_same_as_one_rank(spec, m, Budget::total(9 * 37 + 5), gpu);
      }
    require_same_as_one_rank("snapkv(window=8) | adakv", m, Budget::ratio(1.0), gpu);
    // 8 of the 9 rows keep every token, the last (rank 1's in a 2+1 split) evicts one: every
    // rank still takes part in adakv's exchange.
    require_same_as_one_rank("knorm | adakv", m, Budget::total(9 * kT - 1), gpu);
  }
}

}  // namespace

TEST_CASE("device head shard (emulated kernels): every chain keeps on 1, 2 and 3 ranks what one "
          "CPU rank keeps", "[agreement][device_policy][head_shard]") {
  every_chain(false);
}

TEST_CASE("device head shard (emulated kernels): refusals and errors reach every rank",
          "[agreement][device_policy][head_shard]") {
  const Model m(92, false);
  const Budget b = Budget::ratio(0.3);
  SECTION("a scorer that combines heads is refused by name on every rank") {
    for (const char* spec : {"tova", "tova | adakv", "expected(window=8,theta=10000)"}) {
      const auto res = run_ranks(Policy(spec), m, b, {2, 1});
      for (const auto& r : res) {
        REQUIRE_THAT(r.error, Contains("combines KV heads across tensor-parallel ranks"));
        REQUIRE(r.gathers == 0);
      }
      // One rank holding every head is no shard: the device path runs it.
      const auto one = run_ranks(Policy(spec), m, b, {3});
      REQUIRE(one[0].error.empty());
    }
  }
  SECTION("a rank's inputs fail their checks: every rank fails, naming it") {
    const auto res = run_ranks(Policy("snapkv(window=8) | adakv"), m, b, {1, 1, 1}, false,
                               [](int r, HeadShard&, Inputs<float>& in) {
                                 if (r == 1) in.queries = {};
                               });
    REQUIRE_THAT(res[1].error, Contains("queries: this policy needs the last 8 queries"));
    REQUIRE_THAT(res[0].error, Contains("head shard: rank 1 failed its checks: queries"));
    REQUIRE_THAT(res[2].error, Contains("head shard: rank 1 failed its checks: queries"));
  }
  SECTION("a scorer's own check fails on one rank after the first agreement") {
    const auto res = run_ranks(Policy("snapkv(window=8) | adakv"), m, b, {2, 1}, false,
                               [](int r, HeadShard&, Inputs<float>& in) {
                                 if (r == 0) {  // the newest 4 queries: too few for snapkv only
                                   in.queries.data += (in.queries.tokens - 4) * in.queries.stride_token;
                                   in.queries.tokens = 4;
                                 }
                               });
    REQUIRE_THAT(res[0].error, Contains("snapkv"));
    REQUIRE_THAT(res[1].error, Contains("head shard: rank 0 failed its checks: snapkv"));
  }
  SECTION("a workspace too small on one rank, after the plan's agreement: every rank fails") {
    const auto res = run_ranks(Policy("knorm | adakv"), m, b, {1, 2}, false,
                               [](int, HeadShard&, Inputs<float>&) {}, 1);
    REQUIRE_THAT(res[1].error, Contains("bytes is below the"));
    REQUIRE_THAT(res[0].error, Contains("head shard: rank 1 failed its checks: cuda policy"));
    REQUIRE(res[0].calls.empty());  // no kernel ran on either rank
    REQUIRE(res[1].calls.empty());
  }
  SECTION("no all_gather for adakv; none needed without it") {
    const auto res = run_ranks(Policy("knorm | adakv"), m, b, {2, 1}, false,
                               [](int, HeadShard& s, Inputs<float>&) { s.all_gather = nullptr; });
    for (const auto& r : res) REQUIRE_THAT(r.error, Contains("needs HeadShard::all_gather"));
    const auto ok = run_ranks(Policy("knorm | pyramid | ams(window=8,min_seg_len=4)"), m, b, {2, 1},
                              false, [](int, HeadShard& s, Inputs<float>&) { s.all_gather = nullptr; });
    for (const auto& r : ok) REQUIRE(r.error.empty());
  }
  SECTION("a shard that does not fit the model") {
    const auto res = run_ranks(Policy("knorm"), m, b, {2, 1}, false,
                               [](int, HeadShard& s, Inputs<float>&) { s.model_heads = 2; });
    REQUIRE_THAT(res[1].error, Contains("heads [2, 3) of rank 1 do not fit the model's 2 KV heads"));
  }
}

TEST_CASE("device head shard on the GPU: every chain keeps on 1, 2 and 3 ranks what one CPU rank "
          "keeps", "[gpu][agreement][device_policy][head_shard]") {
  if (!kvtest::gpu_present()) return;
  every_chain(true);
}

}  // namespace kvt_agreement_device_head_shard
