// Threads: what an engine shares between threads. N threads use one const Policy per chain (every
// stage kind, and one plug-in scorer), each with its own Session or its own dense cache, and call
// the C ABI at the same time, each provoking failures of its own between successful calls. Every
// thread's results must equal, bit for bit, the same work done beforehand on one thread with a
// one-thread backend, and every thread must read its own kvp_last_error().
// scripts/tsan.sh builds this file (with tests/main.cpp and the C ABI) under ThreadSanitizer.
//
// Catch2 2.x assertions are not thread-safe: workers only record what they computed and what went
// wrong (as text); the main thread checks everything after join().
#include <catch2/catch.hpp>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "c_api/c_util.hpp"
#include "common/random_kv.hpp"
#include "kvpolicy/c/kvpolicy.h"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_threads_threads {

using kvpolicy::Budget;
using kvpolicy::KVView;
using kvpolicy::Policy;
using kvpolicy::Session;
using kvpolicy::SessionConfig;

namespace {

constexpr int kThreads = 8;
constexpr std::int64_t kL = 2, kHkv = 2, kHq = 4, kD = 32;

// Runs work(i) for i in [0, n) on n threads released at the same moment. Returns what escaped
// each thread ("" if nothing).
std::vector<std::string> run_threads(int n, const std::function<void(int)>& work) {
  std::vector<std::string> escaped(static_cast<std::size_t>(n));
  std::latch start(n);
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      start.arrive_and_wait();
      try {
        work(i);
      } catch (const std::exception& e) {
        escaped[static_cast<std::size_t>(i)] = e.what();
      } catch (...) {
        escaped[static_cast<std::size_t>(i)] = "unknown exception";
      }
    });
  for (auto& t : threads) t.join();
  return escaped;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

std::uint64_t seed_of(int thread, std::size_t item) {
  return 1000 * static_cast<std::uint64_t>(thread + 1) + item;
}

// K, V [L][Hkv][S][d] and Q [L][Hq][S][d], normally distributed.
struct Stream {
  std::int64_t S;
  std::vector<float> k, v, q;
  Stream(std::int64_t s, std::uint64_t seed) : S(s) {
    kvtest::Rng rng(seed);
    k = rng.normals(kL * kHkv * S * kD);
    v = rng.normals(kL * kHkv * S * kD);
    q = rng.normals(kL * kHq * S * kD);
  }
  // Tokens [t0, t0 + n) of layer l, as the [1][heads][n][d] block a Session takes.
  KVView<const float> view(const std::vector<float>& b, std::int64_t heads, std::int64_t l,
                           std::int64_t t0, std::int64_t n) const {
    return {b.data() + (l * heads * S + t0) * kD, 1, heads, n, kD, heads * S * kD, S * kD, kD, 1};
  }
  KVView<const float> K(std::int64_t l, std::int64_t t0, std::int64_t n) const {
    return view(k, kHkv, l, t0, n);
  }
  KVView<const float> V(std::int64_t l, std::int64_t t0, std::int64_t n) const {
    return view(v, kHkv, l, t0, n);
  }
  KVView<const float> Q(std::int64_t l, std::int64_t t0, std::int64_t n) const {
    return view(q, kHq, l, t0, n);
  }
};

kvp_tensor c_block(const KVView<const float>& b) {
  return {const_cast<float*>(b.data), KVP_F32, b.layers, b.heads, b.tokens, b.dim,
          b.stride_layer, b.stride_head, b.stride_token, b.stride_dim};
}

// -||k|| of every key of a float32 [L][H][T][d] view into scores [L][H][T] (what knorm scores).
void negative_norms(const void* data, std::int64_t L, std::int64_t H, std::int64_t T,
                    std::int64_t d, const std::int64_t stride[4], float* scores) {
  const float* base = static_cast<const float*>(data);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        float sq = 0;
        for (std::int64_t i = 0; i < d; ++i) {
          const float x =
              base[l * stride[0] + h * stride[1] + t * stride[2] + i * stride[3]];
          sq += x * x;
        }
        scores[(l * H + h) * T + t] = -std::sqrt(sq);
      }
}

// ---- The C++ plug-in shared by every thread -----------------------------------------------------

std::atomic<long> g_plugin_calls{0};
// Calls made on this thread: callbacks run on the thread that called the policy, never on an
// OpenMP worker, so a thread's count is the same as in the single-threaded run.
thread_local long t_plugin_calls = 0;

kvpolicy::External negnorm_plugin() {
  kvpolicy::External::Spec s;
  s.name = "negnorm";
  s.score = [](const kvpolicy::ExternalInputs& in, std::span<float> out) {
    g_plugin_calls.fetch_add(1, std::memory_order_relaxed);
    ++t_plugin_calls;
    const auto& k = in.keys;
    KVP_REQUIRE(k.dtype == kvpolicy::DType::f32, "negnorm: float32 keys only");
    KVP_REQUIRE(out.size() == static_cast<std::size_t>(k.layers * k.heads * k.tokens),
                "negnorm: score buffer of ", out.size());
    const std::int64_t stride[4] = {k.stride_layer, k.stride_head, k.stride_token, k.stride_dim};
    negative_norms(k.data, k.layers, k.heads, k.tokens, k.dim, stride, out.data());
  };
  return kvpolicy::External(std::move(s));
}

// ---- Sessions -------------------------------------------------------------------------------

struct SessionCase {
  const char* spec;
  Budget budget;
  std::int64_t decode_interval;  // 0: the policy's default (every token for h2o, else never)
  bool delimiters;               // pass a chunk-delimiter mask with every append
};

std::vector<SessionCase> session_cases() {
  return {
      {"h2o(recent=0.25) | nearest", Budget::tokens(24), 0, false},
      {"snapkv(window=8) | adakv | semantic(tau=0.5,chunk=8)", Budget::ratio(0.4), 4, true},
      {"tova | pyramid | adakv", Budget::ratio(0.5), 6, false},
      {"snapkv(window=8) | depthkv(weights=1:3) | ams(window=8,kernel=3,min_seg_len=4,"
       "max_seg_len=16,min_keep=1,sinks=2,keep_last=4)",
       Budget::ratio(0.5), 5, false},
      {"keydiff | uniform | int4(residual=16)", Budget::ratio(0.5), 0, false},
      {"streaming(sinks=2) | kivi(bits=2,residual=8)", Budget::tokens(40), 0, false},
      {"negnorm | adakv | nearest", Budget::ratio(0.5), 4, false},
  };
}

// Everything a Session run produced.
struct SessionTrace {
  std::vector<float> attn;              // every attend() output, in call order
  std::vector<std::int64_t> lengths;    // every head's length after every compress_if_due()
  std::vector<std::int32_t> positions;  // final kept positions of every (layer, head)
  std::vector<float> rows;              // final K, V rows, log counts, H2O sums (fp layers)
  int compressions = 0;
  int quantized_layers = 0;
  long plugin_calls = 0;  // plug-in calls made on the running thread
};

constexpr std::int64_t kPrompt = 64, kSteps = 20;

// A prefill of kPrompt tokens in two appends, then kSteps decode tokens; per layer: append,
// attend, compress_if_due.
SessionTrace run_session(const Policy& policy, const SessionCase& c, std::uint64_t seed,
                         int threads) {
  const Stream s(kPrompt + kSteps, seed);
  SessionConfig cfg;
  cfg.layers = kL, cfg.kv_heads = kHkv, cfg.q_heads = kHq, cfg.head_dim = kD;
  cfg.budget = c.budget;
  cfg.decode_interval = c.decode_interval;
  cfg.initial_capacity = 16;  // grows by doubling during the run
  cfg.backend = kvpolicy::cpu_backend{threads};
  Session<float> session(policy, cfg);  // a copy of the shared policy
  SessionTrace tr;
  const long calls_before = t_plugin_calls;
  std::vector<float> out(static_cast<std::size_t>(kHq * kPrompt * kD));
  auto append = [&](std::int64_t l, std::int64_t t0, std::int64_t n) {
    std::vector<std::uint8_t> delim;
    if (c.delimiters)
      for (std::int64_t t = t0; t < t0 + n; ++t) delim.push_back(t % 7 == 6);
    session.append(l, s.K(l, t0, n), s.V(l, t0, n), s.Q(l, t0, n), delim);
  };
  auto attend_and_compress = [&](std::int64_t l, std::int64_t t0, std::int64_t n) {
    session.attend(l, s.Q(l, t0, n), out.data());
    tr.attn.insert(tr.attn.end(), out.begin(), out.begin() + kHq * n * kD);
    if (session.compress_if_due(l)) ++tr.compressions;
    for (std::int64_t h = 0; h < kHkv; ++h) tr.lengths.push_back(session.length(l, h));
  };
  for (std::int64_t l = 0; l < kL; ++l) {
    append(l, 0, 40);
    append(l, 40, kPrompt - 40);
    attend_and_compress(l, 0, kPrompt);
  }
  for (std::int64_t t = kPrompt; t < kPrompt + kSteps; ++t)
    for (std::int64_t l = 0; l < kL; ++l) {
      append(l, t, 1);
      attend_and_compress(l, t, 1);
    }
  for (std::int64_t l = 0; l < kL; ++l) {
    const bool packed = session.quantized(l);
    tr.quantized_layers += packed ? 1 : 0;
    for (std::int64_t h = 0; h < kHkv; ++h) {
      const auto pos = session.positions(l, h);
      tr.positions.insert(tr.positions.end(), pos.begin(), pos.end());
      if (packed) continue;
      for (std::int64_t t = 0; t < session.length(l, h); ++t)
        for (std::int64_t i = 0; i < kD; ++i) {
          tr.rows.push_back(session.keys(l).at(0, h, t, i));
          tr.rows.push_back(session.values(l).at(0, h, t, i));
        }
      for (float x : session.log_counts(l, h)) tr.rows.push_back(x);
      for (float x : session.accumulated(l, h)) tr.rows.push_back(x);
    }
  }
  tr.plugin_calls = t_plugin_calls - calls_before;
  return tr;
}

// ---- Dense caches ---------------------------------------------------------------------------

struct DenseTrace {
  std::vector<std::int32_t> selected, compressed;  // per (layer, head): count, then indices
  std::vector<float> k, v;                         // the cache after compress()
  long plugin_calls = 0;
};

void flatten(const kvpolicy::Selection& sel, std::vector<std::int32_t>& out) {
  for (std::int64_t l = 0; l < sel.layers(); ++l)
    for (std::int64_t h = 0; h < sel.heads(); ++h) {
      const auto kept = sel.kept(l, h);
      out.push_back(static_cast<std::int32_t>(kept.size()));
      out.insert(out.end(), kept.begin(), kept.end());
    }
}

// select(), then compress() in place, on a cache of this call's own.
DenseTrace run_dense(const Policy& policy, std::uint64_t seed, int threads) {
  constexpr std::int64_t T = 80, nq = 16;
  kvtest::Rng rng(seed);
  DenseTrace tr;
  tr.k = rng.normals(kL * kHkv * T * kD);
  tr.v = rng.normals(kL * kHkv * T * kD);
  const std::vector<float> q = rng.normals(kL * kHq * nq * kD);
  const long calls_before = t_plugin_calls;
  kvpolicy::Inputs<float> in;
  in.keys = KVView<const float>::hnd(tr.k.data(), kL, kHkv, T, kD);
  in.values = KVView<const float>::hnd(tr.v.data(), kL, kHkv, T, kD);
  in.queries = KVView<const float>::hnd(q.data(), kL, kHq, nq, kD);
  const kvpolicy::cpu_backend be{threads};
  const Budget budget = Budget::ratio(0.3);
  flatten(policy.select(be, in, budget), tr.selected);
  flatten(policy.compress(be, KVView<float>::hnd(tr.k.data(), kL, kHkv, T, kD),
                          KVView<float>::hnd(tr.v.data(), kL, kHkv, T, kD), in, budget),
          tr.compressed);
  tr.plugin_calls = t_plugin_calls - calls_before;
  return tr;
}

// ---- The C ABI ------------------------------------------------------------------------------

// The C plug-in every thread registers in a policy of its own: scores like knorm, and fails with
// this thread's message while t_fail is set (thread_local, so the failure shows only if the
// callback runs on the calling thread). state: a call counter shared by every thread.
thread_local const char* t_fail = nullptr;
thread_local int t_fail_code = 0;

const char* cnorm_name(const void*) { return "cnorm"; }
int cnorm_score(void* state, const kvp_score_args* a) {
  static_cast<std::atomic<long>*>(state)->fetch_add(1, std::memory_order_relaxed);
  if (t_fail) {
    kvp_plugin_set_error(t_fail);
    return t_fail_code;
  }
  const kvp_tensor& k = a->keys;
  if (k.dtype != KVP_F32) return 1;
  const std::int64_t stride[4] = {k.stride_layer, k.stride_head, k.stride_token, k.stride_dim};
  negative_norms(k.data, k.layers, k.heads, k.tokens, k.dim, stride, a->scores);
  return 0;
}

struct CTrace {
  std::vector<std::string> problems;  // what went wrong, checked by the main thread
  std::vector<std::string> errors;    // kvp_last_error() after each provoked failure
  std::vector<std::int64_t> counts;   // successful compressions: counts, indices, K and V after
  std::vector<std::int32_t> indices;
  std::vector<float> kv;
  std::vector<std::int64_t> lengths;  // the session's final cache
  std::vector<std::int32_t> positions;
  std::vector<float> rows;
};

constexpr int kRounds = 8;
constexpr std::int64_t kCPrompt = 32;
const char* const kSharedSpec = "snapkv(window=8) | adakv";

// "t<thread>r<round>": in the messages of the provoked bad-spec and plug-in failures (the bad
// layer failure names layer 100 + 10 * thread + round instead).
std::string round_tag(int thread, int round) {
  std::string s = "t";
  s += std::to_string(thread);
  s += 'r';
  s += std::to_string(round);
  return s;
}

// One thread's C ABI work: kRounds rounds of (a failure of its own, wait for every thread to fail,
// check its message survived, successful compressions with the shared policy and its own plug-in
// policy, a session step). `sync` has one participant per running thread.
CTrace c_worker(int i, const kvp_policy* shared, const kvp_scorer_plugin& plugin, int threads,
                std::barrier<>& sync) {
  CTrace tr;
  auto problem = [&](const std::string& what) {
    tr.problems.push_back(what + " (kvp_last_error: '" + kvp_last_error() + "')");
  };
  auto safely = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::exception& e) {
      problem(std::string("exception: ") + e.what());
    }
  };
  kvp_policy* mine = nullptr;
  kvp_session* session = nullptr;
  const Stream tokens(kCPrompt + kRounds, seed_of(i, 99));
  kvp_compress_params prm = kvp_compress_default_params();
  prm.budget = {KVP_BUDGET_RATIO, 0.4};
  prm.threads = threads;
  safely([&] {
    if (kvp_policy_create_with_plugins("cnorm | adakv", &plugin, 1, &mine) != KVP_OK)
      problem("kvp_policy_create_with_plugins failed");
    kvp_session_config cfg = kvp_session_default_config();
    cfg.layers = kL, cfg.kv_heads = kHkv, cfg.q_heads = kHq, cfg.head_dim = kD;
    cfg.budget = {KVP_BUDGET_RATIO, 0.5};
    cfg.decode_interval = 3;
    cfg.initial_capacity = 8;
    cfg.threads = threads;
    if (kvp_session_create(shared, &cfg, &session) != KVP_OK) problem("kvp_session_create failed");
  });
  for (int r = 0; r < kRounds; ++r) {
    std::string msg;
    safely([&] {
      const std::string tag = round_tag(i, r);
      kvp_status got = KVP_OK, want = KVP_OK;
      std::string text;
      switch ((i + r) % 3) {
        case 0: {
          kvp_policy* p = nullptr;
          const std::string spec = "nosuch_" + tag + " | adakv";
          got = kvp_policy_create(spec.c_str(), &p);
          want = KVP_ERROR_BAD_SPEC;
          text = "unknown scorer 'nosuch_" + tag + "'";
          if (p) problem("kvp_policy_create returned a policy for a bad spec");
          break;
        }
        case 1: {
          const std::int64_t layer = 100 + 10 * i + r;
          const kvp_tensor k = c_block(tokens.K(0, 0, 1)), v = c_block(tokens.V(0, 0, 1));
          got = kvp_session_append(session, layer, &k, &v, nullptr);
          want = KVP_ERROR_INVALID_ARGUMENT;
          text = "layer " + std::to_string(layer) + " is outside [0, 2)";
          break;
        }
        default: {
          std::vector<float> k(static_cast<std::size_t>(kHkv * 16 * kD), 1.f), v = k;
          const std::vector<float> k0 = k;
          ctest::SelOut out(1, kHkv, 16);
          const kvp_tensor ck = kvp_tensor_hnd(k.data(), KVP_F32, 1, kHkv, 16, kD);
          const kvp_tensor cv = kvp_tensor_hnd(v.data(), KVP_F32, 1, kHkv, 16, kD);
          t_fail = tag.c_str();
          t_fail_code = 40 + i;
          got = kvp_compress(mine, &prm, &ck, &cv, nullptr, nullptr, 0, &out.sel);
          t_fail = nullptr;
          want = KVP_ERROR_PLUGIN;
          text = "plug-in scorer 'cnorm' failed (returned " + std::to_string(40 + i) + "): " + tag;
          if (k != k0) problem("a failed kvp_compress wrote the keys");
        }
      }
      msg = kvp_last_error();
      if (got != want)
        problem(std::string("status ") + kvp_status_string(got) + " instead of " +
                kvp_status_string(want));
      if (msg.find(text) == std::string::npos) problem("the message does not contain '" + text + "'");
      tr.errors.push_back(msg);
    });
    sync.arrive_and_wait();  // every thread has now failed with a message of its own
    safely([&] {
      if (msg != kvp_last_error())
        problem("after the other threads failed, kvp_last_error() is not '" + msg + "'");
      // Successful calls: a cache of its own, with the shared policy and with its plug-in policy.
      for (const kvp_policy* p : {shared, static_cast<const kvp_policy*>(mine)}) {
        constexpr std::int64_t T = 48;
        kvtest::Rng rng(seed_of(i, static_cast<std::size_t>(r)));
        std::vector<float> k = rng.normals(kL * kHkv * T * kD), v = rng.normals(kL * kHkv * T * kD);
        const std::vector<float> q = rng.normals(kL * kHq * 8 * kD);
        ctest::SelOut out(kL, kHkv, T);
        const kvp_tensor ck = kvp_tensor_hnd(k.data(), KVP_F32, kL, kHkv, T, kD);
        const kvp_tensor cv = kvp_tensor_hnd(v.data(), KVP_F32, kL, kHkv, T, kD);
        const kvp_tensor cq =
            kvp_tensor_hnd(const_cast<float*>(q.data()), KVP_F32, kL, kHq, 8, kD);
        if (kvp_compress(p, &prm, &ck, &cv, &cq, nullptr, 0, &out.sel) != KVP_OK)
          problem("kvp_compress failed");
        if (*kvp_last_error() != '\0') problem("a successful call left an error message");
        tr.counts.insert(tr.counts.end(), out.counts.begin(), out.counts.end());
        tr.indices.insert(tr.indices.end(), out.idx.begin(), out.idx.end());
        tr.kv.insert(tr.kv.end(), k.begin(), k.end());
        tr.kv.insert(tr.kv.end(), v.begin(), v.end());
      }
      // A batch of two sequences of different lengths (NHD), with the shared policy.
      {
        const std::int64_t lens[2] = {40 + r, 56};
        kvtest::Rng rng(seed_of(i, 50 + static_cast<std::size_t>(r)));
        std::vector<std::vector<float>> buf;
        std::vector<kvp_sequence> seqs(2);
        std::vector<ctest::SelOut> outs;
        std::vector<kvp_selection> sels;
        for (std::size_t b = 0; b < 2; ++b) {
          buf.push_back(rng.normals(kL * kHkv * lens[b] * kD));
          buf.push_back(rng.normals(kL * kHkv * lens[b] * kD));
          buf.push_back(rng.normals(kL * kHq * 8 * kD));
        }
        for (std::size_t b = 0; b < 2; ++b) {
          seqs[b].keys = kvp_tensor_nhd(buf[3 * b].data(), KVP_F32, kL, kHkv, lens[b], kD);
          seqs[b].values = kvp_tensor_nhd(buf[3 * b + 1].data(), KVP_F32, kL, kHkv, lens[b], kD);
          seqs[b].queries = kvp_tensor_hnd(buf[3 * b + 2].data(), KVP_F32, kL, kHq, 8, kD);
          outs.emplace_back(kL, kHkv, lens[b]);
        }
        for (auto& o : outs) sels.push_back(o.sel);
        if (kvp_compress_batch(shared, &prm, seqs.data(), 2, sels.data()) != KVP_OK)
          problem("kvp_compress_batch failed");
        for (std::size_t b = 0; b < 2; ++b) {
          tr.counts.insert(tr.counts.end(), outs[b].counts.begin(), outs[b].counts.end());
          tr.indices.insert(tr.indices.end(), outs[b].idx.begin(), outs[b].idx.end());
          tr.kv.insert(tr.kv.end(), buf[3 * b].begin(), buf[3 * b].end());
          tr.kv.insert(tr.kv.end(), buf[3 * b + 1].begin(), buf[3 * b + 1].end());
        }
      }
      // The session: the prompt in round 0, one decode token per later round.
      const std::int64_t t0 = r == 0 ? 0 : kCPrompt + r - 1, n = r == 0 ? kCPrompt : 1;
      for (std::int64_t l = 0; l < kL; ++l) {
        const kvp_tensor k = c_block(tokens.K(l, t0, n)), v = c_block(tokens.V(l, t0, n)),
                         q = c_block(tokens.Q(l, t0, n));
        int done = 0;
        if (kvp_session_append(session, l, &k, &v, &q) != KVP_OK ||
            kvp_session_compress_if_due(session, l, &done) != KVP_OK)
          problem("a session call failed");
      }
    });
    sync.arrive_and_wait();
  }
  safely([&] {
    for (std::int64_t l = 0; l < kL; ++l) {
      std::vector<std::int64_t> len(kHkv);
      if (kvp_session_lengths(session, l, len.data(), len.size()) != KVP_OK)
        problem("kvp_session_lengths failed");
      tr.lengths.insert(tr.lengths.end(), len.begin(), len.end());
      for (std::int64_t h = 0; h < kHkv; ++h) {
        std::vector<float> k(static_cast<std::size_t>(len[h] * kD)), v = k;
        std::vector<std::int32_t> pos(static_cast<std::size_t>(len[h]));
        if (kvp_session_read(session, l, h, k.data(), v.data(), pos.data(), len[h]) != KVP_OK)
          problem("kvp_session_read failed");
        tr.positions.insert(tr.positions.end(), pos.begin(), pos.end());
        tr.rows.insert(tr.rows.end(), k.begin(), k.end());
        tr.rows.insert(tr.rows.end(), v.begin(), v.end());
      }
    }
  });
  kvp_session_destroy(session);
  kvp_policy_destroy(mine);
  return tr;
}

}  // namespace

TEST_CASE("Threads: Sessions on N threads sharing one const Policy equal the single-threaded run",
          "[threads]") {
  const std::vector<kvpolicy::External> plugins{negnorm_plugin()};
  const auto cases = session_cases();
  std::vector<Policy> policies;
  for (const auto& c : cases) policies.emplace_back(c.spec, plugins);
  const std::size_t nc = cases.size();
  // Thread i runs every chain, starting at chain i, on data of its own.
  auto work = [&](int i, int backend_threads) {
    std::vector<SessionTrace> traces;
    for (std::size_t j = 0; j < nc; ++j) {
      const std::size_t c = (j + static_cast<std::size_t>(i)) % nc;
      traces.push_back(run_session(policies[c], cases[c], seed_of(i, c), backend_threads));
    }
    return traces;
  };
  g_plugin_calls = 0;
  std::vector<std::vector<SessionTrace>> want, got(kThreads);
  for (int i = 0; i < kThreads; ++i) want.push_back(work(i, 1));
  const long ref_calls = g_plugin_calls.exchange(0);
  CHECK(ref_calls > 0);
  const auto escaped = run_threads(kThreads, [&](int i) {
    got[static_cast<std::size_t>(i)] = work(i, 1 + i % 2);
  });
  CHECK(g_plugin_calls.load() == ref_calls);
  for (int i = 0; i < kThreads; ++i) {
    const auto& w = want[static_cast<std::size_t>(i)];
    const auto& g = got[static_cast<std::size_t>(i)];
    INFO("thread " << i);
    CHECK(escaped[static_cast<std::size_t>(i)] == "");
    REQUIRE(g.size() == nc);
    for (std::size_t j = 0; j < nc; ++j) {
      const SessionCase& c = cases[(j + static_cast<std::size_t>(i)) % nc];
      INFO("policy " << c.spec);
      // The workload does what it is meant to: a prefill compression per layer, decode-time
      // compressions where the chain has them, packed layers for a quantizer.
      const bool decode_time = c.decode_interval > 0 || std::string(c.spec).rfind("h2o", 0) == 0;
      CHECK(w[j].compressions >= (decode_time ? kL + 2 : kL));
      const bool quant = std::string(c.spec).find("int4") != std::string::npos ||
                         std::string(c.spec).find("kivi") != std::string::npos;
      CHECK(w[j].quantized_layers == (quant ? kL : 0));
      CHECK(g[j].compressions == w[j].compressions);
      CHECK(g[j].quantized_layers == w[j].quantized_layers);
      CHECK(g[j].plugin_calls == w[j].plugin_calls);
      CHECK(same_bits(g[j].lengths, w[j].lengths));
      CHECK(same_bits(g[j].positions, w[j].positions));
      CHECK(same_bits(g[j].attn, w[j].attn));
      CHECK(same_bits(g[j].rows, w[j].rows));
    }
  }
}

TEST_CASE("Threads: Policy::select and compress on per-thread caches equal the single-threaded "
          "run",
          "[threads]") {
  const std::vector<kvpolicy::External> plugins{negnorm_plugin()};
  const std::vector<Policy> policies{
      Policy("snapkv(window=8) | adakv", plugins),
      Policy("h2o(recent=0.25) | pyramid", plugins),
      Policy("tova | depthkv(weights=1:3) | adakv", plugins),
      Policy("knorm | ams(window=8,kernel=3,min_seg_len=4,max_seg_len=16,min_keep=1,sinks=2,"
             "keep_last=4)",
             plugins),
      Policy("negnorm | adakv", plugins)};
  constexpr int kDenseRounds = 3;
  auto work = [&](int i, int backend_threads) {
    std::vector<DenseTrace> traces;
    for (int r = 0; r < kDenseRounds; ++r)
      for (std::size_t p = 0; p < policies.size(); ++p)
        traces.push_back(run_dense(policies[p], seed_of(i, 10 * p + static_cast<std::size_t>(r)),
                                   backend_threads));
    return traces;
  };
  std::vector<std::vector<DenseTrace>> want, got(kThreads);
  for (int i = 0; i < kThreads; ++i) want.push_back(work(i, 1));
  const auto escaped = run_threads(kThreads, [&](int i) {
    got[static_cast<std::size_t>(i)] = work(i, 1 + i % 2);
  });
  for (int i = 0; i < kThreads; ++i) {
    const auto& w = want[static_cast<std::size_t>(i)];
    const auto& g = got[static_cast<std::size_t>(i)];
    INFO("thread " << i);
    CHECK(escaped[static_cast<std::size_t>(i)] == "");
    REQUIRE(g.size() == w.size());
    for (std::size_t j = 0; j < w.size(); ++j) {
      INFO("policy " << policies[j % policies.size()].spec() << ", round " << j / policies.size());
      // compress() keeps what select() chose, and it evicts (ratio 0.3).
      CHECK(w[j].compressed == w[j].selected);
      CHECK(w[j].selected.size() < static_cast<std::size_t>(kL * kHkv * 80));
      CHECK(same_bits(g[j].selected, w[j].selected));
      CHECK(same_bits(g[j].compressed, w[j].compressed));
      CHECK(same_bits(g[j].k, w[j].k));
      CHECK(same_bits(g[j].v, w[j].v));
      CHECK(g[j].plugin_calls == w[j].plugin_calls);
    }
  }
}

TEST_CASE("Threads: concurrent C ABI calls keep each thread's kvp_last_error and equal the "
          "single-threaded run",
          "[threads][c_api]") {
  kvp_policy* shared = ctest::make(kSharedSpec);
  std::atomic<long> calls{0};
  kvp_scorer_plugin plugin = kvp_scorer_plugin_default();
  plugin.state = &calls;
  plugin.name = cnorm_name;
  plugin.score = cnorm_score;  // no free: the counter is the test's

  std::vector<CTrace> want, got(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    std::barrier<> alone(1);
    want.push_back(c_worker(i, shared, plugin, 1, alone));
  }
  const long ref_calls = calls.exchange(0);
  CHECK(ref_calls > 0);
  std::barrier<> sync(kThreads);
  const auto escaped = run_threads(kThreads, [&](int i) {
    got[static_cast<std::size_t>(i)] = c_worker(i, shared, plugin, 1 + i % 2, sync);
  });
  CHECK(calls.load() == ref_calls);
  for (int i = 0; i < kThreads; ++i) {
    const CTrace& w = want[static_cast<std::size_t>(i)];
    const CTrace& g = got[static_cast<std::size_t>(i)];
    INFO("thread " << i);
    CHECK(escaped[static_cast<std::size_t>(i)] == "");
    for (const auto& p : w.problems) FAIL_CHECK("single-threaded: " << p);
    for (const auto& p : g.problems) FAIL_CHECK("concurrent: " << p);
    REQUIRE(w.errors.size() == static_cast<std::size_t>(kRounds));
    CHECK(g.errors == w.errors);
    // Every round's message names this thread's round, so no two threads share one.
    for (int r = 0; r < kRounds; ++r)
      CHECK_THAT(g.errors[static_cast<std::size_t>(r)],
                 Catch::Matchers::Contains(round_tag(i, r)) ||
                     Catch::Matchers::Contains("layer " + std::to_string(100 + 10 * i + r)));
    CHECK(same_bits(g.counts, w.counts));
    CHECK(same_bits(g.indices, w.indices));
    CHECK(same_bits(g.kv, w.kv));
    CHECK(same_bits(g.lengths, w.lengths));
    CHECK(same_bits(g.positions, w.positions));
    CHECK(same_bits(g.rows, w.rows));
    // The session compressed (ratio 0.5 of the prompt, then back to it every 3 tokens).
    CHECK(g.lengths.size() == static_cast<std::size_t>(kL * kHkv));
    for (auto n : g.lengths) CHECK(n < kCPrompt);
  }
  kvp_policy_destroy(shared);
}

}  // namespace kvt_threads_threads
