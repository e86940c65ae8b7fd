// The C ABI's tensor parallelism (kvp_compress_params.shard): ranks simulated by threads with an
// in-memory all-gather call kvp_compress on strided views of their KV heads and keep what one
// call over every head keeps; a failing rank's error reaches every rank; the batch and paged
// entry points refuse a shard; kvp_cuda_compress_plan fails every rank with one rank's error.
#include <string>
#include <thread>
#include <vector>

#include "c_api/c_util.hpp"
#include "common/all_gather_group.hpp"
#include "common/random_kv.hpp"

namespace kvt_c_api_c_head_shard {

namespace {

constexpr std::int64_t L = 2, H = 3, G = 3, T = 100, D = 8, NQ = 8;

struct Cache {
  std::vector<float> k, v, q;
  explicit Cache(std::uint64_t seed) {
    kvtest::Rng rng(seed);
    for (auto* x : {&k, &v}) {
      x->resize(static_cast<std::size_t>(L * H * T * D));
      for (float& e : *x) e = static_cast<float>(rng.uniform(-2, 2));
    }
    q.resize(static_cast<std::size_t>(L * H * G * NQ * D));
    for (float& e : q) e = static_cast<float>(rng.uniform(-2, 2));
  }
  // Heads [h0, h0 + n) of a contiguous [L][heads][tokens][D] tensor.
  static kvp_tensor heads(std::vector<float>& buf, std::int64_t heads, std::int64_t tokens,
                          std::int64_t h0, std::int64_t n) {
    kvp_tensor t = kvp_tensor_hnd(buf.data(), KVP_F32, L, heads, tokens, D);
    t.data = buf.data() + h0 * t.stride_head;
    t.heads = n;
    return t;
  }
};

struct RankOut {
  kvp_status status = KVP_OK;
  std::string error;
  ctest::SelOut sel{L, 1, T};
};

// One thread per rank; `bad_rank` (if >= 0) passes no queries, `bad_out_rank` an output buffer
// too small for its tokens.
std::vector<RankOut> run(const char* spec, Cache& c, const std::vector<std::int64_t>& split,
                         int bad_rank = -1, int bad_out_rank = -1) {
  const int R = static_cast<int>(split.size());
  kvtest::Group group(R);
  std::vector<kvtest::Group::Member> members(static_cast<std::size_t>(R));
  std::vector<RankOut> out;
  for (std::int64_t n : split) out.push_back(RankOut{KVP_OK, {}, ctest::SelOut(L, n, T)});
  kvp_policy* p = ctest::make(spec);
  std::vector<std::thread> threads;
  std::int64_t h0 = 0;
  for (int r = 0; r < R; ++r) {
    const std::int64_t n = split[static_cast<std::size_t>(r)];
    threads.emplace_back([&, r, h0, n] {
      members[static_cast<std::size_t>(r)] = {&group, r, 0};
      kvp_head_shard shard{r, R, h0, H, &kvtest::Group::all_gather, &members[static_cast<std::size_t>(r)]};
      kvp_compress_params prm = kvp_compress_default_params();
      prm.budget = {KVP_BUDGET_RATIO, 0.3};
      prm.compact = 0;
      prm.threads = 1;
      prm.shard = &shard;
      const kvp_tensor k = Cache::heads(c.k, H, T, h0, n), v = Cache::heads(c.v, H, T, h0, n);
      const kvp_tensor q = Cache::heads(c.q, H * G, NQ, h0 * G, n * G);
      auto& o = out[static_cast<std::size_t>(r)];
      if (r == bad_out_rank) o.sel.sel.capacity = T - 1;
      o.status = kvp_compress(p, &prm, &k, &v, r == bad_rank ? nullptr : &q, nullptr, 0, &o.sel.sel);
      if (o.status != KVP_OK) o.error = kvp_last_error();
    });
    h0 += n;
  }
  for (auto& t : threads) t.join();
  kvp_policy_destroy(p);
  return out;
}

}  // namespace

TEST_CASE("C ABI: kvp_compress on 2 and 3 ranks keeps what one call keeps", "[c_api][head_shard]") {
  Cache c(11);
  for (const char* spec : {"snapkv(window=8) | adakv", "tova | pyramid(beta=2) | adakv(alpha=0)",
                           "knorm | ams(window=8,min_seg_len=4)"}) {
    INFO(spec);
    const auto one = run(spec, c, {3});
    REQUIRE(one[0].status == KVP_OK);
    for (const auto& split : std::vector<std::vector<std::int64_t>>{{2, 1}, {1, 1, 1}}) {
      const auto res = run(spec, c, split);
      std::int64_t h0 = 0;
      for (std::size_t r = 0; r < res.size(); ++r) {
        REQUIRE(res[r].status == KVP_OK);
        for (std::int64_t l = 0; l < L; ++l)
          for (std::int64_t h = 0; h < split[r]; ++h)
            REQUIRE(res[r].sel.row(l * split[r] + h) == one[0].sel.row(l * H + h0 + h));
        h0 += split[r];
      }
    }
  }
  kvp_policy* p = ctest::make("knorm | adakv");
  kvp_policy_info info{};
  REQUIRE(kvp_policy_get_info(p, &info) == KVP_OK);
  CHECK(info.spans_heads == 1);
  kvp_policy_destroy(p);
  p = ctest::make("knorm | pyramid");
  REQUIRE(kvp_policy_get_info(p, &info) == KVP_OK);
  CHECK(info.spans_heads == 0);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: a rank's bad arguments fail every rank's kvp_compress", "[c_api][head_shard]") {
  Cache c(12);
  const auto res = run("tova | adakv", c, {1, 1, 1}, 2);
  for (const auto& o : res) REQUIRE(o.status == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(res[2].error.find("queries: this policy needs the last 1 queries") != std::string::npos);
  CHECK(res[0].error.find("head shard: rank 2 failed its checks") != std::string::npos);
  // An argument the C ABI checks before the policy runs (the output buffer) fails every rank too.
  const auto out = run("tova | adakv", c, {2, 1}, -1, 0);
  REQUIRE(out[0].status == KVP_ERROR_BUFFER_TOO_SMALL);
  REQUIRE(out[1].status == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(out[0].error.find("out.capacity is 99") != std::string::npos);
  CHECK(out[1].error.find("head shard: rank 0 failed its checks: out.capacity is 99") !=
        std::string::npos);
}

TEST_CASE("C ABI: a rank's bad arguments fail every rank's kvp_cuda_compress_plan",
          "[c_api][head_shard]") {
  // kvp_cuda_compress_plan reads shapes only, so host pointers stand in for device memory. Rank 1
  // passes no queries; with CUDA every rank fails through the ranks' agreement, without CUDA every
  // rank stops before any exchange.
  Cache c(14);
  kvp_policy* p = ctest::make("snapkv(window=4) | adakv");
  constexpr int R = 3;
  kvtest::Group group(R);
  std::vector<kvtest::Group::Member> members(R);
  std::vector<kvp_status> status(R);
  std::vector<std::string> error(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      members[static_cast<std::size_t>(r)] = {&group, r, 0};
      kvp_head_shard shard{r, R, r, H, &kvtest::Group::all_gather, &members[static_cast<std::size_t>(r)]};
      kvp_compress_params prm = kvp_compress_default_params();
      prm.shard = &shard;
      const kvp_tensor k = Cache::heads(c.k, H, T, r, 1), v = Cache::heads(c.v, H, T, r, 1);
      const kvp_tensor q = Cache::heads(c.q, H * G, NQ, r * G, G);
      kvp_cuda_plan plan{};
      status[static_cast<std::size_t>(r)] =
          kvp_cuda_compress_plan(p, &prm, &k, &v, r == 1 ? nullptr : &q, &plan);
      error[static_cast<std::size_t>(r)] = kvp_last_error();
    });
  for (auto& t : threads) t.join();
  kvp_policy_destroy(p);
  REQUIRE(status[1] == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(error[1].find("queries: this policy needs the last 4 queries") != std::string::npos);
  for (int r : {0, 2}) {
    INFO("rank " << r << ": " << error[static_cast<std::size_t>(r)]);
#if defined(KVPOLICY_WITH_CUDA)
    // One agreement each, whatever happened (no rank waits). With a GPU the others' checks pass
    // and they report rank 1's error; without one, their own workspace query fails inside the
    // same agreement and each reports that (KVP_ERROR_CUDA).
    CHECK(members[static_cast<std::size_t>(r)].calls == 1);
    if (kvp_cuda_device_count() > 0) {
      CHECK(status[static_cast<std::size_t>(r)] == KVP_ERROR_INVALID_ARGUMENT);
      CHECK(error[static_cast<std::size_t>(r)].find("head shard: rank 1 failed its checks: queries") !=
            std::string::npos);
    } else {
      CHECK(status[static_cast<std::size_t>(r)] == KVP_ERROR_CUDA);
    }
#else
    CHECK(status[static_cast<std::size_t>(r)] == KVP_ERROR_UNSUPPORTED);
    CHECK(members[static_cast<std::size_t>(r)].calls == 0);
#endif
  }
}

TEST_CASE("C ABI: kvp_compress_batch and kvp_compress_paged refuse a shard", "[c_api][head_shard]") {
  Cache c(13);
  kvp_policy* p = ctest::make("knorm");
  kvp_head_shard shard{0, 1, 0, H, nullptr, nullptr};
  kvp_compress_params prm = kvp_compress_default_params();
  prm.shard = &shard;
  prm.compact = 0;
  kvp_sequence seq{};
  seq.keys = kvp_tensor_hnd(c.k.data(), KVP_F32, L, H, T, D);
  ctest::SelOut out(L, H, T);
  REQUIRE(kvp_compress_batch(p, &prm, &seq, 1, &out.sel) == KVP_ERROR_UNSUPPORTED);
  CHECK(ctest::mentions("kvp_compress_batch: params.shard"));
  const kvp_paged_tensor pk{}, pv{};
  REQUIRE(kvp_compress_paged(p, &prm, &pk, &pv, nullptr, nullptr, 0, nullptr) == KVP_ERROR_UNSUPPORTED);
  CHECK(ctest::mentions("kvp_compress_paged: params.shard"));
  kvp_policy_destroy(p);
}

}  // namespace kvt_c_api_c_head_shard
