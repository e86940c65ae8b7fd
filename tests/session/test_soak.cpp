// Randomized Session soak (issue 19, long runs). For KVPOLICY_SOAK_STEPS steps (default 1500,
// a few seconds in Release; scripts/soak.sh runs 100,000) with seed KVPOLICY_SOAK_SEED (default
// 19, printed), the run steps together:
//   - two marathon sessions that live the whole run (H2O accumulating and merging with
//     delimiter masks; SnapKV + Ada-KV + AMS with decode-time compression every 16 tokens, fp16,
//     recording attention), whose memory must stop growing: after a warm-up (the first tenth),
//     the largest storage capacity and kv_bytes() over the second half of the run do not exceed
//     those over the first half;
//   - a stream of sessions, each re-created after a few hundred steps with the next chain of
//     kChains and random parameters, shape, element type, budget, decode interval and target,
//     some forked from a recorded full-cache prefill; quantizing chains run next to a twin
//     without the quantizer.
// Every step appends one token or a chunk to every layer, attends with the new queries and calls
// compress_if_due; then Tracked (soak_tracked.hpp) checks the whole state against its shadow
// model (the list is in soak.hpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "session/soak_tracked.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_session_soak {

namespace {

using namespace kvtest::soak;
using kvtest::Rng;

// Stage chains the stream of sessions cycles through (parameters are drawn per session).
const std::vector<std::string> kChains = {
    "h2o", "h2o|nearest", "h2o|semantic", "h2o|adakv", "h2o|ams|semantic",
    "snapkv", "snapkv|adakv", "snapkv|pyramid", "snapkv|depthkv|adakv", "snapkv|ams",
    "snapkv|ams|semantic", "snapkv|int2", "snapkv|semantic|int4", "snapkv|adakv|kivi",
    "streaming", "streaming|nearest", "streaming|int4", "tova", "tova|pyramid|nearest",
    "tova|kivi", "keydiff|adakv", "keydiff|ams|nearest", "knorm|semantic", "knorm|int2"};

std::int64_t env_int(const char* name, std::int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoll(v, nullptr, 10) : fallback;
}

bool coin(Rng& rng, double p) { return rng.uniform(0.0, 1.0) < p; }
template <class X>
X pick(Rng& rng, std::initializer_list<X> xs) {
  return *(xs.begin() + rng.integer(0, static_cast<std::int64_t>(xs.size()) - 1));
}

// One stage of a chain with random parameters; sets *masks when semantic wants delimiter flags.
std::string random_stage(Rng& rng, const std::string& stage, const std::string& chain,
                         std::int64_t layers, std::int64_t d, bool* masks) {
  std::ostringstream os;
  os << stage;
  auto param = [&, first = true](const char* key, const auto& value) mutable {
    os << (first ? "(" : ",") << key << "=" << value;
    first = false;
  };
  if (stage == "h2o") {
    param("sinks", rng.integer(0, 3));
    if (chain.find("ams") != std::string::npos || coin(rng, 0.3)) param("recent_tokens", rng.integer(0, 6));
    else param("recent", pick(rng, {0.0, 0.25, 0.5, 0.75, 1.0}));
    param("reduce", coin(rng, 0.3) ? "sum" : "mean");
    if (coin(rng, 0.15)) param("normalize", "true");
  } else if (stage == "snapkv") {
    param("window", rng.integer(1, 10));
    param("kernel", pick(rng, {1, 3, 5, 7}));
    param("pool", coin(rng, 0.5) ? "avg" : "max");
    param("reduce", pick(rng, {"mean", "max", "sum"}));
    param("sinks", rng.integer(0, 2));
  } else if (stage == "streaming") {
    param("sinks", rng.integer(0, 6));
  } else if (stage == "adakv") {
    param("alpha", pick(rng, {0.0, 0.2, 0.5, 1.0}));
  } else if (stage == "pyramid") {
    param("beta", pick(rng, {1.5, 4.0, 20.0}));
  } else if (stage == "depthkv") {
    std::string w;
    for (std::int64_t l = 0; l < layers; ++l) w += (l ? ":" : "") + std::string(pick(rng, {"0.5", "1", "2", "3"}));
    param("weights", w);
  } else if (stage == "ams") {
    const std::int64_t min_seg = rng.integer(1, 6);
    param("window", rng.integer(1, 10));
    param("kernel", pick(rng, {1, 3, 5}));
    param("segment_mass", pick(rng, {0.05, 0.1, 0.3}));
    param("min_seg_len", min_seg);
    param("max_seg_len", min_seg + rng.integer(0, 40));
    param("min_keep", rng.integer(0, 3));
    param("sinks", rng.integer(0, 3));
    param("keep_last", rng.integer(0, 6));
    param("lambda", pick(rng, {0.0, 0.5, 0.8}));
    param("beta", pick(rng, {0.3, 0.7, 1.0}));
  } else if (stage == "semantic") {
    *masks = coin(rng, 0.5);
    param("tau", pick(rng, {-1.0, 0.0, 0.6, 0.9, 1.0}));
    param("chunk", *masks ? pick(rng, {0, 8, 32}) : pick(rng, {4, 16, 64}));
    param("weight", coin(rng, 0.5) ? "importance" : "mean");
  } else if (stage == "int2" || stage == "int4" || stage == "kivi") {
    if (stage == "kivi") param("bits", pick(rng, {2, 4}));
    param("group", d >= 64 && coin(rng, 0.5) ? 64 : 32);
    param("residual", pick(rng, {0, 1, 7, 32, 40, 128}));
    if (stage != "kivi") {
      param("rotate", coin(rng, 0.8) ? "true" : "false");
      param("token_norm", coin(rng, 0.8) ? "true" : "false");
    }
  }
  if (os.str() != stage) os << ")";
  return os.str();
}

// ---- Sessions and how they are driven ---------------------------------------------------------

struct Setup {
  std::string name;
  Plan plan;
  std::int64_t layers = 1, hkv = 1, g = 1, d = 8;
  bool half = false;
  int threads = 1;
  std::int64_t initial_capacity = 8;
  std::vector<std::int64_t> prompt;  // prefill chunks
  Budget budget = Budget::ratio(1.0);
  std::int64_t interval = 0;
  std::optional<Budget> target;
  std::int64_t record_queries = 0;
  bool record_attention = false, fork = false, flags = false, shrinks = false;
  // Marathons append `period_chunk` tokens every `period` steps and one otherwise (a
  // deterministic pattern, so both halves of the run see the same lengths); 0: random chunks.
  std::int64_t period = 0, period_chunk = 1;
};

SessionConfig config_of(const Setup& s) {
  SessionConfig c;
  c.layers = s.layers;
  c.kv_heads = s.hkv;
  c.q_heads = s.hkv * s.g;
  c.head_dim = s.d;
  c.budget = s.budget;
  c.initial_capacity = s.initial_capacity;
  c.backend = kvpolicy::cpu_backend{s.threads};
  c.record_queries = s.record_queries;
  c.record_attention = s.record_attention;
  c.decode_interval = s.interval;
  c.decode_target = s.target;
  return c;
}

class Runner {
 public:
  virtual ~Runner() = default;
  virtual void step(std::int64_t i) = 0;  // i: the session's own step (0: the prefill)
  virtual void finish() = 0;
  virtual std::int64_t capacity() const = 0;
  virtual std::size_t kv_bytes() const = 0;
  virtual const std::string& name() const = 0;
};

template <class T>
class SessionRunner final : public Runner {
 public:
  SessionRunner(Setup s, const Where& w, Counters& c, std::uint64_t seed)
      : s_(std::move(s)), w_(w), c_(c), rng_(seed), tokens_(seed ^ 0x9e3779b97f4a7c15ull, s_.layers, s_.hkv, s_.hkv * s_.g, s_.d) {
    needs_q_ = kvpolicy::has(Policy(s_.plan.spec).needs(), kvpolicy::Needs::queries);
  }

  void step(std::int64_t i) override {
    if (i == 0) return prefill();
    const std::int64_t n = s_.period > 0 ? (i % s_.period == 0 ? s_.period_chunk : 1) : random_chunk();
    feed(n, true, i);
    if (s_.shrinks && !twin_ && coin(rng_, 0.005))  // an engine may also compress on its own
      for (std::int64_t l = 0; l < s_.layers; ++l) {
        main_->compress_now(l);
        main_->verify(l);
      }
    if (s_.shrinks && coin(rng_, 0.01)) {
      for (auto* t : sessions()) {
        t->shrink_to_fit();
        for (std::int64_t l = 0; l < s_.layers; ++l) t->verify(l);
      }
    }
    ++c_.session_steps;
  }
  void finish() override {
    for (std::int64_t l = 0; l < s_.layers; ++l) main_->verify_decode(l);
  }
  std::int64_t capacity() const override { return main_->capacity_sum(); }
  std::size_t kv_bytes() const override { return main_->session().kv_bytes(); }
  const std::string& name() const override { return s_.name; }

 private:
  std::vector<Tracked<T>*> sessions() {
    std::vector<Tracked<T>*> v;
    if (twin_) v.push_back(&*twin_);  // first: the quantized session reads its rows
    v.push_back(&*main_);
    return v;
  }

  std::int64_t random_chunk() {
    const double u = rng_.uniform(0.0, 1.0);
    return u < 0.85 ? 1 : u < 0.97 ? rng_.integer(2, 16) : rng_.integer(17, 48);
  }

  Session<T> make_session(const std::string& spec) const { return Session<T>(Policy(spec), config_of(s_)); }

  // Chunked prefill into the sessions (or into a recording full-cache session that is then
  // forked), then the first compress_if_due.
  void prefill() {
    if (s_.fork) {
      Setup rs = s_;
      rs.budget = Budget::ratio(1.0);
      rs.interval = 0;
      rs.target.reset();
      rs.record_attention = true;
      const Policy p(s_.plan.spec);
      rs.record_queries = std::max<std::int64_t>(1, p.query_window()) + rng_.integer(0, 4);
      const Plan rp = analyze("streaming", "streaming", false);
      recorder_.emplace(s_.name + "/recorder", rp, Session<T>(Policy("streaming"), config_of(rs)), w_, c_);
      for (std::int64_t n : s_.prompt) feed_into({&*recorder_}, n, false, 0);
      main_.emplace(recorder_->fork(s_.name, s_.plan, s_.budget, s_.interval, s_.target));
      if (s_.plan.quant)
        twin_.emplace(recorder_->fork(s_.name + "/twin", analyze(s_.plan.chain, s_.plan.twin_spec, s_.plan.masks),
                                      s_.budget, s_.interval, s_.target));
      recorder_.reset();
      ++c_.forks;
    } else {
      main_.emplace(s_.name, s_.plan, make_session(s_.plan.spec), w_, c_);
      if (s_.plan.quant)
        twin_.emplace(s_.name + "/twin", analyze(s_.plan.chain, s_.plan.twin_spec, s_.plan.masks),
                      make_session(s_.plan.twin_spec), w_, c_);
      for (std::int64_t n : s_.prompt) feed(n, false, 0);
    }
    if (twin_) main_->set_twin(&*twin_);
    for (std::int64_t l = 0; l < s_.layers; ++l)
      for (auto* t : sessions()) {
        if (!t->compress_if_due(l)) fail(w_, s_.name, "layer ", l, ": no prefill compression");
        t->verify(l);
      }
    ++c_.session_steps;
  }

  void feed(std::int64_t n, bool compress, std::int64_t i) { feed_into(sessions(), n, compress, i); }

  // n new tokens into every layer of `ts`: append, attend (checked), compress_if_due, verify.
  void feed_into(std::vector<Tracked<T>*> ts, std::int64_t n, bool compress, std::int64_t i) {
    const bool pass_q = needs_q_ || s_.record_queries > 0 || s_.fork || coin(rng_, 0.7);
    const bool flags = s_.plan.masks || s_.flags;
    for (std::int64_t l = 0; l < s_.layers; ++l) {
      const auto block = tokens_.next<T>(l, n, flags ? 0.12 : 0.0);
      for (auto* t : ts) {
        t->append(l, block, pass_q, flags);
        t->attend(l, block, !t->quantized(l) || i % 4 == 0);
        if (compress) t->compress_if_due(l);
        t->verify(l);
        if (t->quantized(l) && i % 16 == 0) t->verify_decode(l);
      }
    }
    for (auto* t : ts) t->verify_bytes();
  }

  Setup s_;
  const Where& w_;
  Counters& c_;
  Rng rng_;
  TokenSource tokens_;
  bool needs_q_ = false;
  std::optional<Tracked<T>> recorder_, main_, twin_;
};

std::unique_ptr<Runner> make_runner(Setup s, const Where& w, Counters& c, std::uint64_t seed) {
  ++c.sessions;
  ++c.chain_sessions[s.plan.chain];
  if (s.half) return std::make_unique<SessionRunner<kvpolicy::half>>(std::move(s), w, c, seed);
  return std::make_unique<SessionRunner<float>>(std::move(s), w, c, seed);
}

std::string describe(const Budget& b) {
  std::ostringstream os;
  switch (b.kind()) {
    case Budget::Kind::ratio: os << "ratio(" << b.value() << ")"; break;
    case Budget::Kind::per_head: os << "tokens(" << b.value() << ")"; break;
    case Budget::Kind::total: os << "total(" << b.value() << ")"; break;
  }
  return os.str();
}

// A random session of `chain`: shape, element type, budget, prompt, schedule.
Setup random_setup(Rng& rng, const std::string& chain, std::int64_t index) {
  Setup s;
  const bool quant = chain.find("int") != std::string::npos || chain.find("kivi") != std::string::npos;
  s.layers = rng.integer(1, 3);
  s.hkv = rng.integer(1, 4);
  s.g = rng.integer(1, 3);
  s.d = quant ? pick(rng, {32, 64}) : pick(rng, {8, 16, 32, 64});
  s.half = coin(rng, 0.3);
  s.threads = coin(rng, 0.15) ? 2 : 1;
  s.initial_capacity = rng.integer(1, 64);
  std::string spec;
  bool masks = false;
  for (std::size_t b = 0; b <= chain.size();) {
    const std::size_t e = std::min(chain.find('|', b), chain.size());
    spec += (spec.empty() ? "" : " | ") + random_stage(rng, chain.substr(b, e - b), chain, s.layers, s.d, &masks);
    b = e + 1;
  }
  s.plan = analyze(chain, spec, masks);
  const std::int64_t lo = s.plan.min_budget;
  const std::int64_t B = lo == 0 && coin(rng, 0.1) ? rng.integer(0, 3) : lo + rng.integer(0, 64);
  const double u = rng.uniform(0.0, 1.0);
  const std::int64_t P = std::max<std::int64_t>(1, u < 0.6 ? B + rng.integer(0, 300)
                                                           : u < 0.85 ? rng.integer(1, std::max<std::int64_t>(1, B))
                                                                      : B + rng.integer(300, 700));
  for (std::int64_t left = P, parts = rng.integer(1, 3); left > 0; --parts) {
    const std::int64_t n = parts == 1 ? left : rng.integer(1, left);
    s.prompt.push_back(n);
    left -= n;
  }
  // Budgets of each kind that resolve to at least `lo` tokens per head.
  auto budget = [&](std::int64_t b) {
    const double k = rng.uniform(0.0, 1.0);
    if (k < 0.4) return Budget::tokens(b);
    if (k < 0.7) return Budget::total(s.hkv * b + rng.integer(0, s.hkv - 1));
    const double r = (static_cast<double>(b) + 0.25) / static_cast<double>(P);
    return r <= 1.0 ? Budget::ratio(r) : Budget::tokens(b);
  };
  s.budget = budget(B);
  if (!quant) {
    s.interval = s.plan.h2o ? (coin(rng, 0.6) ? 0 : rng.integer(2, 8)) : (coin(rng, 0.15) ? 0 : rng.integer(1, 32));
    if (coin(rng, 0.5)) s.target = budget(lo + rng.integer(0, 48));
    s.record_attention = coin(rng, 0.25);
  }
  s.record_queries = coin(rng, 0.3) ? rng.integer(1, 16) : 0;
  s.fork = coin(rng, 0.25);
  s.flags = coin(rng, 0.2);
  s.shrinks = true;
  std::ostringstream name;
  name << "#" << index << " (" << (s.half ? "half" : "float") << " L" << s.layers << " Hkv" << s.hkv
       << " g" << s.g << " d" << s.d << ", prompt " << P << ", budget " << describe(s.budget);
  if (s.interval > 0) name << ", interval " << s.interval;
  if (s.target) name << ", target " << describe(*s.target);
  if (s.record_queries > 0) name << ", record_queries " << s.record_queries;
  if (s.record_attention) name << ", record_attention";
  name << (s.fork ? ", forked" : "") << ")";
  s.name = name.str();
  return s;
}

// The marathons: fixed policies whose caches stay bounded, run for the whole soak.
std::vector<Setup> marathon_setups() {
  Setup a;
  a.name = "marathon-A (float L2 Hkv2 g2 d16)";
  a.plan = analyze("h2o|semantic", "h2o(recent=0.5,sinks=2) | semantic(tau=0.6,chunk=16)", true);
  a.layers = 2, a.hkv = 2, a.g = 2, a.d = 16;
  a.initial_capacity = 16;
  a.prompt = {20};
  a.budget = Budget::tokens(48);
  a.period = 13, a.period_chunk = 8;
  Setup b;
  b.name = "marathon-B (half L2 Hkv3 g2 d32)";
  b.plan = analyze("snapkv|adakv|ams",
                   "snapkv(window=6,kernel=3) | adakv | ams(window=6,min_seg_len=4,max_seg_len=32,"
                   "min_keep=1,sinks=2,keep_last=4,segment_mass=0.1)",
                   false);
  b.layers = 2, b.hkv = 3, b.g = 2, b.d = 32;
  b.half = true;
  b.initial_capacity = 8;
  b.prompt = {100, 30, 20};
  b.budget = Budget::total(3 * 40 + 1);
  b.interval = 16;
  b.record_attention = true;
  b.period = 7, b.period_chunk = 5;
  return {a, b};
}

long proc_status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::strtol(line.c_str() + std::strlen(key), nullptr, 10);
  return -1;
}

struct Plateau {
  std::int64_t cap_first = 0, cap_second = 0;
  std::size_t bytes_first = 0, bytes_second = 0;
  long rss_warm = 0, rss_mid = 0, rss_end = 0;
};

}  // namespace

TEST_CASE("Session soak: random appends, policies and compressions keep every invariant",
          "[session][soak]") {
  Where w;
  w.seed = static_cast<std::uint64_t>(env_int("KVPOLICY_SOAK_SEED", 19));
  w.steps = env_int("KVPOLICY_SOAK_STEPS", 1500);
  REQUIRE(w.steps >= 100);
  std::printf("soak: seed %llu, %lld steps\n", static_cast<unsigned long long>(w.seed),
              static_cast<long long>(w.steps));
  std::fflush(stdout);
  Counters c;
  Plateau mem;
  Rng rng(w.seed);
  const std::int64_t nchains = static_cast<std::int64_t>(kChains.size());
  const std::int64_t life = std::clamp<std::int64_t>(w.steps * 2 / (3 * nchains), 12, 1200);
  const std::int64_t warm = w.steps / 10, mid = warm + (w.steps - warm) / 2;
  const auto t0 = std::chrono::steady_clock::now();

  std::vector<std::unique_ptr<Runner>> marathons;
  for (Setup s : marathon_setups()) marathons.push_back(make_runner(std::move(s), w, c, rng.next()));
  std::unique_ptr<Runner> current;
  std::int64_t current_step = 0, current_end = 0, index = 0;
  auto run = [&](Runner& r, std::int64_t i) {
    try {
      r.step(i);
    } catch (const SoakFailure&) {
      throw;
    } catch (const std::exception& e) {  // a library error: report where it happened
      fail(w, r.name(), "exception: ", e.what());
    }
  };
  try {
    for (w.step = 0; w.step < w.steps; ++w.step) {
      if (!current || current_step == current_end) {
        if (current) current->finish();
        const std::string& chain = kChains[static_cast<std::size_t>(index % nchains)];
        current = make_runner(random_setup(rng, chain, index), w, c, rng.next());
        current_step = 0;
        current_end = rng.integer(life / 2, life * 3 / 2);
        ++index;
      }
      for (auto& m : marathons) run(*m, w.step);
      run(*current, current_step++);
      std::int64_t cap = 0;
      std::size_t bytes = 0;
      for (auto& m : marathons) cap += m->capacity(), bytes += m->kv_bytes();
      if (w.step >= warm) {
        auto& mc = w.step < mid ? mem.cap_first : mem.cap_second;
        auto& mb = w.step < mid ? mem.bytes_first : mem.bytes_second;
        mc = std::max(mc, cap), mb = std::max(mb, bytes);
      }
      if (w.step == warm) mem.rss_warm = proc_status_kb("VmRSS:");
      if (w.step == mid) mem.rss_mid = proc_status_kb("VmRSS:");
      if (w.steps >= 10000 && (w.step + 1) % (w.steps / 10) == 0) {  // progress of long runs
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("soak: step %lld, %.0f s, %lld sessions; marathons: capacity %lld, kv_bytes %zu; VmRSS %ld kB\n",
                    static_cast<long long>(w.step + 1), s, static_cast<long long>(c.sessions),
                    static_cast<long long>(cap), bytes, proc_status_kb("VmRSS:"));
        std::fflush(stdout);
      }
    }
    current->finish();
    for (auto& m : marathons) m->finish();
  } catch (const SoakFailure& f) {
    FAIL(f.what());
  }
  mem.rss_end = proc_status_kb("VmRSS:");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  std::printf("soak: %lld steps in %.1f s (%.3f ms/step); %lld sessions (%lld forked), %lld session-steps, %lld tokens\n",
              static_cast<long long>(w.steps), secs, 1e3 * secs / static_cast<double>(w.steps),
              static_cast<long long>(c.sessions), static_cast<long long>(c.forks),
              static_cast<long long>(c.session_steps), static_cast<long long>(c.tokens));
  std::printf("soak: events %lld prefill + %lld decode-time, %lld rows evicted, %lld merged rows\n",
              static_cast<long long>(c.prefill_events), static_cast<long long>(c.decode_events),
              static_cast<long long>(c.evicted), static_cast<long long>(c.merged_rows));
  std::printf("soak: checks: %lld attend, %lld accumulators, %lld h2o and %lld streaming kept sets, "
              "%lld packed tiles, %lld decodes, %lld chunk-end rewrites, %lld credit events\n",
              static_cast<long long>(c.attend_checks), static_cast<long long>(c.acc_checks),
              static_cast<long long>(c.h2o_exact), static_cast<long long>(c.streaming_exact),
              static_cast<long long>(c.tiles_checked), static_cast<long long>(c.decode_checks),
              static_cast<long long>(c.delimiter_rewrites), static_cast<long long>(c.credit_checks));
  std::printf("soak: marathons after step %lld: capacity max %lld (steps %lld-%lld) vs %lld (%lld-%lld), "
              "kv_bytes max %zu vs %zu\n",
              static_cast<long long>(warm), static_cast<long long>(mem.cap_first),
              static_cast<long long>(warm), static_cast<long long>(mid - 1),
              static_cast<long long>(mem.cap_second), static_cast<long long>(mid),
              static_cast<long long>(w.steps - 1), mem.bytes_first, mem.bytes_second);
  std::printf("soak: VmRSS %ld kB at step %lld, %ld kB at step %lld, %ld kB at the end; VmHWM %ld kB\n",
              mem.rss_warm, static_cast<long long>(warm), mem.rss_mid, static_cast<long long>(mid),
              mem.rss_end, proc_status_kb("VmHWM:"));
  std::string chains = "soak: chains (sessions/events):";
  for (const auto& ch : kChains)
    chains += " " + ch + " " + std::to_string(c.chain_sessions[ch]) + "/" + std::to_string(c.chain_events[ch]);
  std::printf("%s\n", chains.c_str());
  std::fflush(stdout);

  // Memory stops growing.
  CHECK(mem.cap_second <= mem.cap_first);
  CHECK(mem.bytes_second <= mem.bytes_first);
  // Every path was exercised, every chain compressed.
  for (const auto& ch : kChains) {
    INFO(ch);
    CHECK(c.chain_events[ch] > 0);
  }
  CHECK(c.forks > 0);
  CHECK(c.decode_events > 0);
  CHECK(c.merged_rows > 0);
  CHECK(c.h2o_exact > 0);
  CHECK(c.streaming_exact > 0);
  CHECK(c.tiles_checked > 0);
  CHECK(c.decode_checks > 0);
  CHECK(c.delimiter_rewrites > 0);
  CHECK(c.credit_checks > 0);
  CHECK(c.acc_checks > 0);
}

}  // namespace kvt_session_soak
