// kvp_cuda_compress_plan / kvp_cuda_compress: a whole policy on device tensors through the C ABI.
// The argument checks run in every build, before the device is touched; the [gpu] case compares
// the device call's kept sets and compacted cache with kvp_compress on the host.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include "agreement/gpu_util.hpp"
#include "c_api/c_util.hpp"
#include "common/random_kv.hpp"
#include "kvpolicy/c/kvpolicy.h"

namespace kvt_c_api_c_cuda_policy {

using ctest::make;
using ctest::mentions;

namespace {

constexpr std::int64_t kL = 2, kH = 2, kG = 2, kT = 64, kD = 8, kQ = 16;

struct Data {
  std::vector<float> k, v, q;
  explicit Data(std::uint64_t seed) {
    kvtest::Rng rng(seed);
    k = rng.normals(kL * kH * kT * kD);
    v = rng.normals(kL * kH * kT * kD);
    q = rng.normals(kL * kH * kG * kQ * kD);
  }
};

// A plug-in scorer (its callbacks run on the host only, so the device path refuses it).
const char* ones_name(const void*) { return "ones"; }
int ones_score(void*, const kvp_score_args*) { return 0; }

kvp_tensor keys_of(float* p) { return kvp_tensor_hnd(p, KVP_F32, kL, kH, kT, kD); }
kvp_tensor queries_of(float* p) { return kvp_tensor_hnd(p, KVP_F32, kL, kH * kG, kQ, kD); }

}  // namespace

TEST_CASE("C ABI: kvp_cuda_compress checks its arguments before touching the device", "[c_api]") {
  Data d(1);
  kvp_tensor k = keys_of(d.k.data()), v = keys_of(d.v.data()), q = queries_of(d.q.data());
  kvp_cuda_plan plan{};
  kvp_csr out{};
  kvp_compress_params prm = kvp_compress_default_params();

  CHECK(kvp_cuda_compress_plan(nullptr, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("policy"));
  kvp_policy* p = make("snapkv(window=8) | pyramid | adakv");
  CHECK(kvp_cuda_compress_plan(p, &prm, nullptr, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("keys"));
  CHECK(kvp_cuda_compress_plan(p, &prm, &k, &v, &q, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_cuda_compress(p, &prm, &k, &v, &q, nullptr, 0, nullptr, nullptr) ==
        KVP_ERROR_INVALID_ARGUMENT);

  SECTION("stages without a device path, a merger and a shard: unsupported, by name") {
    // kvzip has a device path; without params.reconstruction it is an argument error.
    kvp_policy* z = make("kvzip | adakv");
    CHECK(kvp_cuda_compress_plan(z, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("reconstruction"));
    kvp_policy_destroy(z);
    kvp_scorer_plugin plugin = kvp_scorer_plugin_default();
    plugin.name = ones_name;
    plugin.score = ones_score;
    for (const char* spec : {"ones", "ones | pyramid | adakv"}) {
      INFO(spec);
      kvp_policy* u = nullptr;
      REQUIRE(kvp_policy_create_with_plugins(spec, &plugin, 1, &u) == KVP_OK);
      CHECK(kvp_cuda_compress_plan(u, &prm, &k, &v, &q, &plan) == KVP_ERROR_UNSUPPORTED);
      CHECK(mentions("cpu_backend"));
      CHECK(kvp_cuda_compress(u, &prm, &k, &v, &q, nullptr, 0, nullptr, &out) ==
            KVP_ERROR_UNSUPPORTED);
      kvp_policy_destroy(u);
    }
    kvp_policy* m = make("snapkv(window=8) | semantic");
    CHECK(kvp_cuda_compress_plan(m, &prm, &k, &v, &q, &plan) == KVP_ERROR_UNSUPPORTED);
    CHECK(mentions("merger"));
    kvp_policy_destroy(m);
  }
  SECTION("a shard: checked on the host; scorers that combine heads refused by name") {
    // (Sharded runs: tests/agreement/test_device_head_shard.cpp; the ranks' agreement on errors:
    // tests/c_api/test_c_head_shard.cpp.)
    kvp_policy* t = make("tova");
    const kvp_head_shard two{0, 2, 0, kH + 1, nullptr, nullptr};
    prm.shard = &two;
    CHECK(kvp_cuda_compress_plan(t, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("scorer 'tova' combines KV heads across tensor-parallel ranks"));
    kvp_policy_destroy(t);
    const kvp_head_shard misfit{1, 2, 1, kH, nullptr, nullptr};
    prm.shard = &misfit;
    CHECK(kvp_cuda_compress(p, &prm, &k, &v, &q, nullptr, 0, nullptr, &out) ==
          KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("heads [1, 3) of rank 1 do not fit the model's 2 KV heads"));
    const kvp_head_shard no_gather{0, 2, 0, kH + 1, nullptr, nullptr};
    prm.shard = &no_gather;  // adakv exchanges: it needs the engine's all_gather
    const kvp_status s = kvp_cuda_compress_plan(p, &prm, &k, &v, &q, &plan);
    if (kvp_cuda_device_count() > 0 || s != KVP_ERROR_UNSUPPORTED) {
      CHECK(s == KVP_ERROR_INVALID_ARGUMENT);
      CHECK(mentions("needs HeadShard::all_gather"));
    } else {
      CHECK(mentions("no CUDA support"));  // a build without CUDA stops before any exchange
    }
  }
  SECTION("bad budgets, shapes and dtypes") {
    prm.budget = {KVP_BUDGET_RATIO, 1.5};
    CHECK(kvp_cuda_compress_plan(p, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("above 1"));
    prm = kvp_compress_default_params();
    CHECK(kvp_cuda_compress_plan(p, &prm, &k, nullptr, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("values is NULL but params.compact is set"));
    kvp_tensor qh = q;
    qh.dtype = KVP_F16;
    CHECK(kvp_cuda_compress_plan(p, &prm, &k, &v, &qh, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("dtype"));
    kvp_tensor bad = k;
    bad.stride_head = -1;
    CHECK(kvp_cuda_compress_plan(p, &prm, &bad, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("negative head stride"));
    prm.struct_size = 3;
    CHECK(kvp_cuda_compress_plan(p, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
  }
  SECTION("per-event inputs: checked on the host like kvp_compress's") {
    std::vector<float> rec(static_cast<std::size_t>(kL * kH * kT), 0.5f);
    kvp_policy* z = make("kvzip | adakv");
    prm.reconstruction = rec.data();  // (a stand-in: the checks never read it)
    prm.reconstruction_stride = kT - 1;
    CHECK(kvp_cuda_compress_plan(z, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("state_stride 63 is below the 64 tokens"));
    prm.reconstruction_stride = 0;
    prm.rope_pairs = 4;
    CHECK(kvp_cuda_compress(z, &prm, &k, &v, &q, nullptr, 0, nullptr, &out) ==
          KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("rope_inv_freq is NULL"));
    kvp_policy_destroy(z);
    kvp_policy* a = make("knorm | ams(window=8)");
    prm = kvp_compress_default_params();
    prm.alloc_state = rec.data();
    prm.alloc_state_stride = 5;
    CHECK(kvp_cuda_compress_plan(a, &prm, &k, &v, &q, &plan) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("alloc_state_stride 5 is below the 64 tokens"));
    kvp_policy_destroy(a);
  }
  SECTION("valid arguments without a usable device: an error, not a result") {
    if (kvp_cuda_device_count() > 0) {
      SUCCEED("a device is present: the [gpu] case runs the call");
    } else {
      std::vector<float> rec(static_cast<std::size_t>(kL * kH * kT), 0.5f);
      prm.reconstruction = rec.data();
      prm.alloc_state = rec.data();
      for (const char* spec : {"snapkv(window=8) | pyramid | adakv", "kvzip | adakv",
                               "knorm | ams(window=8,min_seg_len=4)"}) {
        INFO(spec);
        kvp_policy* u = spec[0] == 's' ? nullptr : make(spec);
        const kvp_status s = kvp_cuda_compress_plan(u ? u : p, &prm, &k, &v, &q, &plan);
        CHECK((s == KVP_ERROR_UNSUPPORTED || s == KVP_ERROR_CUDA));
        CHECK(std::string(kvp_last_error()).size() > 10);
        if (u) kvp_policy_destroy(u);
      }
    }
  }
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: kvp_cuda_compress on the GPU keeps and compacts what kvp_compress does",
          "[gpu][c_api]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  for (const char* spec : {"snapkv(window=8) | pyramid | adakv", "tova", "knorm | adakv(alpha=0)",
                           "h2o | depthkv(weights=1:3)", "streaming", "kvzip(sinks=2) | adakv",
                           "knorm | adakv | ams(window=8,min_seg_len=4,sinks=2,keep_last=4)"}) {
    INFO(spec);
    kvp_policy* p = make(spec);
    Data host(7), dev_data(7);
    // Per-event inputs (kvzip's scores, ams's credit), on the host for kvp_compress and on the
    // device for kvp_cuda_compress.
    kvtest::Rng rng(3);
    std::vector<float> rec = rng.normals(kL * kH * kT), host_state(rec.size(), 0.f);
    auto drec = kvtest::upload(rec), dstate = kvtest::upload(host_state);
    kvp_compress_params prm = kvp_compress_default_params();
    prm.budget = {KVP_BUDGET_RATIO, 0.3};
    prm.reconstruction = rec.data();
    prm.alloc_state = host_state.data();
    // Host reference.
    kvp_tensor hk = keys_of(host.k.data()), hv = keys_of(host.v.data()),
               hq = queries_of(host.q.data());
    ctest::SelOut want(kL, kH, kT);
    REQUIRE(kvp_compress(p, &prm, &hk, &hv, &hq, nullptr, 0, &want.sel) == KVP_OK);
    // Device call.
    auto dk = kvtest::upload(dev_data.k), dv = kvtest::upload(dev_data.v),
         dq = kvtest::upload(dev_data.q);
    kvp_tensor k = keys_of(static_cast<float*>(dk.data())),
               v = keys_of(static_cast<float*>(dv.data())),
               q = queries_of(static_cast<float*>(dq.data()));
    prm.reconstruction = static_cast<const float*>(drec.data());
    prm.alloc_state = static_cast<float*>(dstate.data());
    kvp_cuda_plan plan{};
    REQUIRE(kvp_cuda_compress_plan(p, &prm, &k, &v, &q, &plan) == KVP_OK);
    REQUIRE(plan.rows == kL * kH);
    kvpolicy::cuda::DeviceBuffer ws(plan.workspace_bytes ? plan.workspace_bytes : 1);
    kvpolicy::cuda::DeviceBuffer off(static_cast<std::size_t>(plan.rows + 1) * 8);
    kvpolicy::cuda::DeviceBuffer idx(static_cast<std::size_t>(plan.kept_capacity + 1) * 4);
    kvp_csr out{kL, kH, static_cast<std::int64_t*>(off.data()),
                static_cast<std::int32_t*>(idx.data()), plan.kept_capacity};
    CHECK(kvp_cuda_compress(p, &prm, &k, &v, &q, ws.data(), plan.workspace_bytes - 1, nullptr,
                            &out) == KVP_ERROR_BUFFER_TOO_SMALL);
    REQUIRE(kvp_cuda_compress(p, &prm, &k, &v, &q, ws.data(), plan.workspace_bytes, nullptr,
                              &out) == KVP_OK);
    kvpolicy::cuda::synchronize();
    const auto offsets = kvtest::download<std::int64_t>(off, static_cast<std::size_t>(plan.rows + 1));
    const auto indices = kvtest::download<std::int32_t>(idx, static_cast<std::size_t>(offsets.back()));
    for (std::int64_t r = 0; r < plan.rows; ++r) {
      const auto b = static_cast<std::size_t>(offsets[static_cast<std::size_t>(r)]);
      const auto e = static_cast<std::size_t>(offsets[static_cast<std::size_t>(r) + 1]);
      CHECK(std::vector<std::int32_t>(indices.begin() + b, indices.begin() + e) == want.row(r));
    }
    CHECK(kvtest::download<float>(dk, host.k.size()) == host.k);
    CHECK(kvtest::download<float>(dv, host.v.size()) == host.v);
    // The credit follows the window attention, which equals the host's to fp32 rounding.
    const auto dev_state = kvtest::download<float>(dstate, host_state.size());
    for (std::size_t i = 0; i < host_state.size(); ++i)
      CHECK(dev_state[i] == Approx(host_state[i]).epsilon(1e-5).margin(1e-9));
    kvp_policy_destroy(p);
  }
#endif
}

}  // namespace kvt_c_api_c_cuda_policy
