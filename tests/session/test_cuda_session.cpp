// cuda::Session (kvpolicy/cuda/session.hpp), the decode loop on a GPU.
// CPU half: the per-thread arithmetic of its kernels (cuda/session_math.hpp: where an appended
// element lands, where each slot of the query window comes from after a push, checked against a
// deque through a sequence of pushes, the causal horizon of a chunk of queries), and, in builds
// with CUDA, the constructor's refusals, which come before any device call. [gpu] half: kvpolicy::Session and cuda::Session run the same prefill and decode
// steps (append, attend, compress_if_due) side by side; after every step the lengths, the original
// positions of every head's tokens, the stored keys and values and the log counts (mergers) must
// be identical (merged rows: to 1e-5, since the scores that weight them are equal to fp32
// rounding), and the attention
// outputs equal to fp32 rounding (max abs difference 1e-4 on O(1) values).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <deque>
#include <string>
#include <vector>

#include <kvpolicy/cuda/session_math.hpp>
#include <kvpolicy/kvpolicy.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/session.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "common/error_of.hpp"
#include "common/random.hpp"

namespace kvt_session_cuda_session {

using namespace kvpolicy;
namespace sm = kvpolicy::cuda::session_math;
using Catch::Matchers::Contains;
using kvtest::error_of;

TEST_CASE("cuda session math: an appended element lands after its head's rows") {
  // 3 new tokens, dim 4, capacity 10, the head holding 5 rows: element (head 1, token 2, dim 1)
  // is e = (1 * 3 + 2) * 4 + 1 = 21 and lands in row 1 * 10 + 5 + 2 = 17.
  const sm::AppendSlot s = sm::append_slot(21, 3, 4, 10, 5);
  CHECK(s.head == 1);
  CHECK(s.token == 2);
  CHECK(s.dim == 1);
  CHECK(s.row == 17);
  const sm::AppendSlot first = sm::append_slot(0, 3, 4, 10, 0);
  CHECK((first.head == 0 && first.token == 0 && first.dim == 0 && first.row == 0));
  const sm::AppendSlot last = sm::append_slot(2 * 3 * 4 - 1, 3, 4, 10, 7);  // head 1, token 2, dim 3
  CHECK((last.head == 1 && last.token == 2 && last.dim == 3 && last.row == 19));
}

TEST_CASE("cuda session math: a chunk of queries sees the cache up to its last query") {
  // 10 new queries of a head holding 25 tokens (positions 15..24), in chunks of 4: [0, 4) ends at
  // position 18 (19 tokens visible to its last query), [4, 8) at 22, [8, 10) at 24.
  CHECK(sm::chunk_horizon(25, 10, 4, 0) == 19);
  CHECK(sm::chunk_horizon(25, 10, 4, 1) == 23);
  CHECK(sm::chunk_horizon(25, 10, 4, 2) == 25);
  // Query i of a chunk of mc sees horizon - mc + i + 1 keys, the unchunked block's count for
  // query c * m + i (decode_math's visible_keys rule), for every chunk and query.
  for (std::int64_t n : {1, 7, 8, 9, 33})
    for (std::int64_t m : {1, 3, 8})
      for (std::int64_t c = 0; c * m < n; ++c) {
        const std::int64_t mc = std::min(m, n - c * m), hz = sm::chunk_horizon(40, n, m, c);
        for (std::int64_t i = 0; i < mc; ++i)
          CHECK(hz - mc + i + 1 == 40 - n + (c * m + i) + 1);
      }
}

TEST_CASE("cuda session math: window pushes keep the newest queries, right-aligned, in order") {
  constexpr std::int64_t W = 5;
  std::vector<int> buf(W, -1);  // one query head, dim 1: a query is its id
  std::deque<int> want;
  std::int64_t held = 0;
  int next_id = 0;
  for (const std::int64_t n : {2, 1, 7, 3, 5, 1, 4}) {
    std::vector<int> fresh(static_cast<std::size_t>(n));
    for (auto& x : fresh) x = next_id++;
    std::vector<int> out(W);
    for (std::int64_t i = 0; i < W; ++i) {
      const sm::WindowSource s = sm::window_source(i, W, n);
      if (s.fresh) {
        REQUIRE((s.fresh_index >= 0 && s.fresh_index < n));
        out[static_cast<std::size_t>(i)] = fresh[static_cast<std::size_t>(s.fresh_index)];
      } else {
        REQUIRE((s.old_slot > i && s.old_slot < W));
        out[static_cast<std::size_t>(i)] = buf[static_cast<std::size_t>(s.old_slot)];
      }
    }
    buf = out;
    for (int x : fresh) want.push_back(x);
    while (static_cast<std::int64_t>(want.size()) > W) want.pop_front();
    held = sm::window_held(held, W, n);
    REQUIRE(held == static_cast<std::int64_t>(want.size()));
    for (std::int64_t j = 0; j < held; ++j)
      CHECK(buf[static_cast<std::size_t>(W - held + j)] == want[static_cast<std::size_t>(j)]);
  }
  CHECK(held == W);
}

#if defined(KVPOLICY_WITH_CUDA)

namespace {

SessionConfig config(Budget budget, std::int64_t head_dim = 64, std::int64_t interval = 0) {
  SessionConfig c;
  c.layers = 2;
  c.kv_heads = 2;
  c.q_heads = 4;
  c.head_dim = head_dim;
  c.budget = budget;
  c.initial_capacity = 16;  // below the prompt: the first append grows the storage
  c.decode_interval = interval;
  return c;
}

// The half-split RoPE frequencies of a theta-10000 model, for expected attention.
SessionConfig rope(SessionConfig c) {
  for (std::int64_t i = 0; i < c.head_dim / 2; ++i)
    c.rope_inv_freq.push_back(static_cast<float>(std::pow(10000.0, -2.0 * i / c.head_dim)));
  return c;
}

}  // namespace

TEST_CASE("cuda session: refuses what it does not run, before touching a device") {
  const SessionConfig c = config(Budget::ratio(0.5));
  auto make = [&](const char* spec, SessionConfig cfg) {
    return [spec, cfg] { (void)cuda::Session<float>(Policy(spec), cfg); };
  };
  CHECK_THAT(error_of(make("snapkv | nearest", c)),
             Contains("merger 'nearest' has no device kernel (device mergers: semantic)"));
  CHECK_THAT(error_of(make("snapkv | int4", c)), Contains("quantizer stage (int4)"));
  CHECK_THAT(error_of(make("kvzip", c)), Contains("context-reconstruction pass"));
  CHECK_THAT(error_of(make("snapkv | semantic(chunk=0)", c)),
             Contains("semantic(chunk=0) cuts chunks at delimiters only"));
  CHECK_THAT(error_of(make("h2o(reduce=max)", c)), Contains("reduce=max"));
  CHECK_THAT(error_of(make("snapkv", config(Budget::ratio(0.5), 48))),
             Contains("head_dim 48 (the device attention supports 64, 128 and 256)"));
  SessionConfig bad = c;
  bad.q_heads = 3;
  CHECK_THAT(error_of(make("snapkv", bad)), Contains("cuda::Session: q_heads 3"));
  // 64 query heads per KV head at head_dim 128: one launch of the device attention holds 58
  // query rows in 99 KB of shared memory (2 * 58 * 128 + 2 * 32 * 128 + 32 + 58 * 32 + 4 * 58 +
  // 32 = 25,192 floats; 59 rows need 25,484 > 101,376 / 4 = 25,344).
  SessionConfig mqa = config(Budget::ratio(0.5), 128);
  mqa.kv_heads = 1;
  mqa.q_heads = 64;
  CHECK_THAT(error_of(make("snapkv", mqa)),
             Contains("64 query heads per KV head (q_heads 64, kv_heads 1) at head_dim 128 "
                      "exceed the 58 query rows"));
}

namespace {

// One sequence through both sessions: a prompt of `prompt` tokens, then `steps` decode tokens;
// after each compress_if_due the two must hold the same tokens.
// shrink: both give back their free storage after the prefill compression (shrink_to_fit), so
// that the decode steps grow it again with heads of different lengths.
template <class T>
void run_both(const std::string& spec, const SessionConfig& cfg, std::int64_t prompt,
              std::int64_t steps, std::uint64_t seed, bool shrink = false) {
  INFO("policy " << spec);
  const Policy policy(spec);
  Session<T> host(policy, cfg);
  cuda::Session<T> dev(policy, cfg);
  const std::int64_t H = cfg.kv_heads, Hq = cfg.q_heads, d = cfg.head_dim;
  kvtest::Rng rng(seed);
  std::int64_t step = 0;
  bool merged_prefill = false, merged_decode = false;  // some row stands for several tokens
  auto feed = [&](std::int64_t n) {
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      INFO("step " << step << ", layer " << l);
      const std::vector<T> k = rng.normals<T>(H * n * d), v = rng.normals<T>(H * n * d),
                           q = rng.normals<T>(Hq * n * d);
      const auto kh = KVView<const T>::hnd(k.data(), 1, H, n, d);
      const auto vh = KVView<const T>::hnd(v.data(), 1, H, n, d);
      const auto qh = KVView<const T>::hnd(q.data(), 1, Hq, n, d);
      const auto kd_buf = kvtest::upload(k), vd_buf = kvtest::upload(v), qd_buf = kvtest::upload(q);
      const auto kd = KVView<const T>::hnd(kd_buf.template as<const T>(), 1, H, n, d);
      const auto vd = KVView<const T>::hnd(vd_buf.template as<const T>(), 1, H, n, d);
      const auto qd = KVView<const T>::hnd(qd_buf.template as<const T>(), 1, Hq, n, d);
      host.append(l, kh, vh, qh);
      dev.append(l, kd, vd, qd);
      std::vector<float> out_host(static_cast<std::size_t>(Hq * n * d));
      host.attend(l, qh, out_host.data());
      cuda::DeviceBuffer out_dev(out_host.size() * sizeof(float));
      dev.attend(l, qd, out_dev.as<float>());
      const std::vector<float> got = kvtest::download<float>(out_dev, out_host.size());
      double worst = 0;
      for (std::size_t i = 0; i < got.size(); ++i)
        worst = std::max(worst, std::abs(static_cast<double>(got[i]) - out_host[i]));
      CHECK(worst <= 1e-4);
      const bool c_host = host.compress_if_due(l);
      const bool c_dev = dev.compress_if_due(l);
      REQUIRE(c_host == c_dev);
      const auto lh = host.lengths(l), ld = dev.lengths(l);
      REQUIRE(std::vector<std::int64_t>(lh.begin(), lh.end()) ==
              std::vector<std::int64_t>(ld.begin(), ld.end()));
      const KVView<const T> keys = dev.keys(l), values = dev.values(l);
      for (std::int64_t h = 0; h < H; ++h) {
        INFO("head " << h);
        const auto ph = host.positions(l, h);
        CHECK(std::vector<std::int32_t>(ph.begin(), ph.end()) == dev.positions(l, h));
        const std::int64_t len = lh[static_cast<std::size_t>(h)];
        std::vector<T> rows(static_cast<std::size_t>(len * d));
        cuda::copy_to_host(rows.data(), keys.row(0, h, 0), rows.size() * sizeof(T));
        std::vector<T> vrows(rows.size());
        cuda::copy_to_host(vrows.data(), values.row(0, h, 0), vrows.size() * sizeof(T));
        const KVView<const T> hk = host.keys(l), hv = host.values(l);
        // Kept rows are moved bytes: identical. A merged row (log count > 0) is a score-weighted
        // mean, and the device's scores equal the CPU's to fp32 rounding (~1e-7 relative), so it
        // may differ by that much, or by one rounding step of T once stored (half: 2^-10
        // relative; values here are O(1)).
        std::vector<float> counts;
        if (policy.merger()) {
          const auto ch = host.log_counts(l, h);
          counts.assign(ch.begin(), ch.end());
        }
        const double merged_tol = sizeof(T) == 2 ? 2e-3 : 1e-5;
        double kept_diff = 0, merged_diff = 0;
        for (std::int64_t t = 0; t < len; ++t) {
          const bool row_merged = !counts.empty() && counts[static_cast<std::size_t>(t)] > 0;
          for (std::int64_t i = 0; i < d; ++i) {
            const auto e = static_cast<std::size_t>(t * d + i);
            const double wk = to_float(hk.at(0, h, t, i)), wv = to_float(hv.at(0, h, t, i));
            const double dk = std::abs(to_float(rows[e]) - wk), dv = std::abs(to_float(vrows[e]) - wv);
            if (row_merged)
              merged_diff = std::max({merged_diff, dk / std::max(1.0, std::abs(wk)),
                                      dv / std::max(1.0, std::abs(wv))});
            else
              kept_diff = std::max({kept_diff, dk, dv});
          }
        }
        CHECK(kept_diff == 0.0);
        CHECK(merged_diff <= merged_tol);
        if (policy.decode_time()) {  // H2O sums: fp32 sums in another order
          const auto ah = host.accumulated(l, h);
          const std::vector<float> ad = dev.accumulated(l, h);
          REQUIRE(ad.size() == ah.size());
          double err = 0, top = 0;
          for (std::size_t i = 0; i < ad.size(); ++i) {
            err = std::max(err, std::abs(static_cast<double>(ad[i]) - ah[i]));
            top = std::max(top, std::abs(static_cast<double>(ah[i])));
          }
          CHECK(err <= 1e-5 * std::max(top, 1.0));
        }
        if (policy.merger()) {
          const auto ch = host.log_counts(l, h);
          CHECK(std::vector<float>(ch.begin(), ch.end()) == dev.log_counts(l, h));
          if (std::any_of(ch.begin(), ch.end(), [](float x) { return x > 0; }))
            (step == 0 ? merged_prefill : merged_decode) = true;
        } else {
          CHECK(dev.log_counts(l, h).empty());
        }
      }
    }
    ++step;
  };
  feed(prompt);
  std::vector<std::int64_t> shrunk;
  if (shrink) {
    host.shrink_to_fit();
    dev.shrink_to_fit();
    for (std::int64_t l = 0; l < cfg.layers; ++l) {
      CHECK(dev.capacity(l) == host.capacity(l));
      shrunk.push_back(dev.capacity(l));
    }
  }
  for (std::int64_t s = 0; s < steps; ++s) feed(1);
  for (std::int64_t l = 0; l < cfg.layers && shrink; ++l) {  // the decode steps grew it again
    CHECK(dev.capacity(l) == host.capacity(l));
    CHECK(dev.capacity(l) > shrunk[static_cast<std::size_t>(l)]);
  }
  CHECK(host.take_warning().empty() == dev.take_warning().empty());
  // A merger case that merged nothing proves little; one that compresses at decode time must
  // merge then too (per-head events, decode targets).
  CHECK(merged_prefill == policy.merger().has_value());
  if (policy.merger() && dev.decode_interval() > 0) CHECK(merged_decode);
}

}  // namespace

TEST_CASE("cuda session: the decode loop keeps what kvpolicy::Session keeps [gpu]", "[gpu]") {
  if (!kvtest::gpu_present()) return;
  // Prefill compression of every device scorer but kvzip (expected: the model's RoPE
  // frequencies given in the config) and of the allocators; then decode-time compression: every
  // 4 tokens (snapkv), per head after adakv (uneven fixed budgets, with and without ams and its
  // credit), every token (h2o).
  for (const char* spec : {"snapkv(window=8)", "knorm", "streaming", "tova", "keydiff",
                           "snapkv(window=8) | pyramid", "snapkv(window=8) | adakv",
                           "snapkv(window=8) | ams", "expected(window=8)"})
    run_both<float>(spec, rope(config(Budget::ratio(0.5))), 61, 6, 11);
  run_both<float>("snapkv(window=8)", config(Budget::ratio(0.4), 64, 4), 50, 13, 12);
  run_both<float>("snapkv(window=8) | adakv", config(Budget::ratio(0.4), 128, 3), 40, 10, 13);
  run_both<float>("snapkv(window=8) | adakv", config(Budget::ratio(0.3), 64, 2), 60, 12, 19,
                  /*shrink=*/true);
  run_both<float>("snapkv(window=8) | adakv | ams", config(Budget::ratio(0.4), 64, 2), 56, 10, 21);
  run_both<half>("h2o", config(Budget::ratio(0.4), 256), 40, 8, 20, /*shrink=*/true);
  run_both<float>("h2o", config(Budget::ratio(0.5)), 45, 10, 14);
  // The semantic merger folds evicted rows into kept ones (identical clusters and log counts),
  // and attention reads the log counts; per layer, per head (adakv), and at decode time.
  run_both<float>("snapkv(window=8) | semantic(chunk=8,tau=0)", config(Budget::ratio(0.4)), 64, 6, 16);
  run_both<float>("snapkv(window=8) | adakv | semantic(tau=-0.1)", config(Budget::ratio(0.4), 64, 3),
                  50, 9, 17);
  run_both<half>("h2o | semantic(chunk=16,tau=0)", config(Budget::ratio(0.5)), 48, 8, 18);
  run_both<half>("snapkv(window=8)", config(Budget::ratio(0.5), 64, 5), 70, 11, 15);
}

#endif  // KVPOLICY_WITH_CUDA

}  // namespace kvt_session_cuda_session
