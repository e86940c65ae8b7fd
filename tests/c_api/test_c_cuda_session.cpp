// kvp_cuda_session_*: the device Session through the C ABI. kvp_cuda_session_create's argument
// checks and policy refusals run in every build, before the device is touched; then a build
// without CUDA gives UNSUPPORTED, one with CUDA but no GPU KVP_ERROR_CUDA (the first allocation). The [gpu] case runs kvp_session on the
// host and kvp_cuda_session on the device side by side through a prefill and decode steps, and
// requires the same compress_if_due answers, lengths, original positions and stored keys and
// values (read through kvp_cuda_session_cache), and attention outputs to 1e-4.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "agreement/gpu_util.hpp"
#include "c_api/c_util.hpp"
#include "common/random_kv.hpp"
#include "kvpolicy/c/kvpolicy.h"

namespace kvt_c_api_c_cuda_session {

using ctest::make;
using ctest::mentions;

namespace {

kvp_session_config config(int64_t head_dim = 64) {
  kvp_session_config c = kvp_session_default_config();
  c.layers = 2;
  c.kv_heads = 2;
  c.q_heads = 4;
  c.head_dim = head_dim;
  c.budget = {KVP_BUDGET_RATIO, 0.4};
  c.initial_capacity = 16;
  c.decode_interval = 2;
  return c;
}

}  // namespace

TEST_CASE("C ABI: kvp_cuda_session checks its arguments before touching the device", "[c_api]") {
  kvp_policy* p = make("snapkv(window=8) | adakv");
  kvp_session_config cfg = config();
  kvp_cuda_session* s = nullptr;
  CHECK(kvp_cuda_session_create(nullptr, &cfg, KVP_F32, nullptr, &s) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("policy is NULL"));
  CHECK(s == nullptr);
  CHECK(kvp_cuda_session_create(p, nullptr, KVP_F32, nullptr, &s) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("config is NULL"));
  CHECK(kvp_cuda_session_create(p, &cfg, KVP_F32, nullptr, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("out is NULL"));
  kvp_session_config old = cfg;
  old.struct_size = 8;
  CHECK(kvp_cuda_session_create(p, &old, KVP_F32, nullptr, &s) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("config.struct_size is 8"));
  // (An out-of-range dtype cannot be passed from C++ without undefined behaviour: UBSan reports
  // the load of the enum argument. The library reads it through raw_enum and names it.)
  for (const char* spec : {"snapkv | nearest", "snapkv | int2", "kvzip"}) {
    INFO(spec);
    kvp_policy* q = make(spec);
    CHECK(kvp_cuda_session_create(q, &cfg, KVP_F16, nullptr, &s) == KVP_ERROR_UNSUPPORTED);
    CHECK(mentions("kvp_cuda_session_create: cuda::Session: policy"));
    kvp_policy_destroy(q);
  }
  CHECK(s == nullptr);
#if defined(KVPOLICY_WITH_CUDA)
  kvp_session_config narrow = config(48);
  CHECK(kvp_cuda_session_create(p, &narrow, KVP_F32, nullptr, &s) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("head_dim 48 (the device attention supports 64, 128 and 256)"));
  CHECK(kvp_cuda_session_append(nullptr, 0, nullptr, nullptr, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("session is NULL"));
  if (kvp_cuda_device_count() == 0) {  // the first allocation fails: a CUDA error, no handle
    CHECK(kvp_cuda_session_create(p, &cfg, KVP_F32, nullptr, &s) == KVP_ERROR_CUDA);
    CHECK(mentions("CUDA error"));
    CHECK(s == nullptr);
  }
#else
  CHECK(kvp_cuda_session_create(p, &cfg, KVP_F32, nullptr, &s) == KVP_ERROR_UNSUPPORTED);
  CHECK(mentions("no CUDA support"));
  CHECK(s == nullptr);
#endif
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: kvp_cuda_session on the GPU keeps what kvp_session keeps [gpu]", "[gpu]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  for (const char* spec : {"snapkv(window=8) | adakv", "h2o"}) {
    INFO(spec);
    kvp_policy* p = make(spec);
    const kvp_session_config cfg = config();
    const int64_t H = cfg.kv_heads, Hq = cfg.q_heads, d = cfg.head_dim;
    kvp_session* host = nullptr;
    kvp_cuda_session* dev = nullptr;
    REQUIRE(kvp_session_create(p, &cfg, &host) == KVP_OK);
    REQUIRE(kvp_cuda_session_create(p, &cfg, KVP_F32, nullptr, &dev) == KVP_OK);
    kvtest::Rng rng(31);
    auto feed = [&](int64_t n) {
      for (int64_t l = 0; l < cfg.layers; ++l) {
        std::vector<float> k = rng.normals(H * n * d), v = rng.normals(H * n * d),
                           q = rng.normals(Hq * n * d);
        const auto kd = kvtest::upload(k), vd = kvtest::upload(v), qd = kvtest::upload(q);
        const kvp_tensor kh = kvp_tensor_hnd(k.data(), KVP_F32, 1, H, n, d),
                         vh = kvp_tensor_hnd(v.data(), KVP_F32, 1, H, n, d),
                         qh = kvp_tensor_hnd(q.data(), KVP_F32, 1, Hq, n, d);
        const kvp_tensor kdt = kvp_tensor_hnd(kd.data(), KVP_F32, 1, H, n, d),
                         vdt = kvp_tensor_hnd(vd.data(), KVP_F32, 1, H, n, d),
                         qdt = kvp_tensor_hnd(qd.data(), KVP_F32, 1, Hq, n, d);
        REQUIRE(kvp_session_append(host, l, &kh, &vh, &qh) == KVP_OK);
        REQUIRE(kvp_cuda_session_append(dev, l, &kdt, &vdt, &qdt) == KVP_OK);
        std::vector<float> out(static_cast<std::size_t>(Hq * n * d));
        kvpolicy::cuda::DeviceBuffer out_d(out.size() * sizeof(float));
        REQUIRE(kvp_session_attend(host, l, &qh, out.data(), out.size()) == KVP_OK);
        REQUIRE(kvp_cuda_session_attend(dev, l, &qdt, out_d.as<float>(), out.size()) == KVP_OK);
        const std::vector<float> got = kvtest::download<float>(out_d, out.size());
        double worst = 0;
        for (std::size_t i = 0; i < out.size(); ++i)
          worst = std::max(worst, std::abs(static_cast<double>(got[i]) - out[i]));
        CHECK(worst <= 1e-4);
        int ch = -1, cd = -1;
        REQUIRE(kvp_session_compress_if_due(host, l, &ch) == KVP_OK);
        REQUIRE(kvp_cuda_session_compress_if_due(dev, l, &cd) == KVP_OK);
        REQUIRE(ch == cd);
        std::vector<int64_t> lh(static_cast<std::size_t>(H)), ld(lh.size());
        REQUIRE(kvp_session_lengths(host, l, lh.data(), lh.size()) == KVP_OK);
        REQUIRE(kvp_cuda_session_lengths(dev, l, ld.data(), ld.size()) == KVP_OK);
        REQUIRE(lh == ld);
        kvp_tensor kc{}, vc{};
        REQUIRE(kvp_cuda_session_cache(dev, l, &kc, &vc) == KVP_OK);
        CHECK((kc.dtype == KVP_F32 && kc.layers == 1 && kc.heads == H && kc.dim == d &&
               kc.tokens >= lh[0] && vc.stride_head == kc.stride_head));
        for (int64_t h = 0; h < H; ++h) {
          const int64_t len = lh[static_cast<std::size_t>(h)];
          std::vector<float> hk(static_cast<std::size_t>(len * d)), hv(hk.size());
          std::vector<int32_t> hp(static_cast<std::size_t>(len)), dp(hp.size());
          REQUIRE(kvp_session_read(host, l, h, hk.data(), hv.data(), hp.data(), len) == KVP_OK);
          REQUIRE(kvp_cuda_session_positions(dev, l, h, dp.data(), len) == KVP_OK);
          CHECK(hp == dp);
          std::vector<float> dk(hk.size()), dv(hv.size());
          const auto row = [&](const kvp_tensor& t) {
            return static_cast<const float*>(t.data) + h * t.stride_head;
          };
          kvpolicy::cuda::copy_to_host(dk.data(), row(kc), dk.size() * sizeof(float));
          kvpolicy::cuda::copy_to_host(dv.data(), row(vc), dv.size() * sizeof(float));
          CHECK(dk == hk);
          CHECK(dv == hv);
        }
      }
    };
    feed(40);
    for (int step = 0; step < 8; ++step) feed(1);
    std::size_t bh = 0, bd = 0;
    REQUIRE(kvp_session_kv_bytes(host, &bh) == KVP_OK);
    REQUIRE(kvp_cuda_session_kv_bytes(dev, &bd) == KVP_OK);
    CHECK(bh == bd);
    std::vector<int64_t> small(1);
    CHECK(kvp_cuda_session_lengths(dev, 0, small.data(), small.size()) == KVP_ERROR_BUFFER_TOO_SMALL);
    std::vector<float> dummy(static_cast<std::size_t>(H * d));
    const kvp_tensor one = kvp_tensor_hnd(dummy.data(), KVP_F32, 1, H, 1, d);
    CHECK(kvp_cuda_session_append(dev, 5, &one, &one, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("layer 5 is outside [0, 2)"));
    int32_t pos[1];
    CHECK(kvp_cuda_session_positions(dev, 0, 0, pos, 1) == KVP_ERROR_BUFFER_TOO_SMALL);
    const kvp_tensor halfs = kvp_tensor_hnd(dummy.data(), KVP_F16, 1, H, 1, d);
    CHECK(kvp_cuda_session_append(dev, 0, &halfs, &halfs, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
    CHECK(mentions("k has dtype float16 but float32 was expected"));
    kvp_cuda_session_destroy(dev);
    kvp_session_destroy(host);
    kvp_policy_destroy(p);
  }
#endif
}

}  // namespace kvt_c_api_c_cuda_session
