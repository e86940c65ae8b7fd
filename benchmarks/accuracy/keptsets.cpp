// kvpolicy_keptsets: which tokens every policy keeps on the accuracy benchmark's retrieval
// prompts, per (prompt, regime, policy, budget, layer, KV head), as JSON, so that runs of
// different builds (portable vs -march=native) and thread counts can be compared
// (benchmarks/accuracy/compare_keptsets.py; scripts/determinism.sh runs both).
//
// Each prompt is prefilled once with the full cache, as kvpolicy_accuracy does; each (policy,
// budget) is a fork of that state compressed once (Session::fork, then every layer's first
// compression). Before the fork compresses, the tool replays the same selection outside the
// session (Policy::select on the fork's keys, values and accumulators and the queries captured
// during the prefill) to obtain the scores the top-k ranked, and records per (layer, KV head)
// the tokens within 1e-4 (relative) of the cut on each side with their scores, and, for ams,
// how close the cumulative mass comes to a segment target. The replayed selection must equal
// what the session kept (`replay`; a mismatch is reported and makes the exit status 2). Where
// two runs keep different sets, those numbers give the margin the difference needed.
//
// Besides the kept sets the tool hashes the caches before and after compression (K/V rows or
// packed tiles, merge counts, H2O accumulators; before, also the queries the policies read):
// runs of one build with 1 and N threads must agree on those too.
// --synthetic replaces the model by pseudo-random K/V/Q that are the same bits in every build,
// which separates the policies' own arithmetic from the forward pass's.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cli_lists.hpp"
#include "retrieval.hpp"
#include "tasks.hpp"

namespace {

using namespace kvbench;
using json = nlohmann::json;
using kvpolicy::Budget;
using kvpolicy::Policy;
using kvpolicy::engine::LayerCapture;

constexpr const char* kFull = "streaming";  // with Budget::ratio(1.0): keeps every token

struct Options {
  std::string model, out = "keptsets.json", prompt_set = "eval";
  int threads = 1;
  std::int64_t prompts = 3, grid_length = 1024;
  std::vector<std::string> policies, tasks = retrieval_tasks(), regimes = {"known", "agnostic"};
  std::vector<double> budgets = {0.1, 0.2};
  bool margins = true, synthetic = false;
};

Options parse_args(int argc, char** argv) {
  Options o;
  o.policies = default_policies(KVPOLICY_PROFILE_DIR);
  o.policies.push_back("snapkv | semantic(tau=0.9)");
  o.policies.push_back("snapkv | int2");
  CLI::App app(
      "Kept positions of KV-cache policies per (prompt, regime, policy, budget, layer, KV head) "
      "on kvpolicy_accuracy's retrieval prompts, with the score margin at each cut, as JSON "
      "(compare two runs with benchmarks/accuracy/compare_keptsets.py).",
      "kvpolicy_keptsets");
  app.get_formatter()->column_width(30);
  std::string policies, tasks, regimes, budgets;
  app.add_option("--model", o.model,
                 "GGUF model (default: $KVPOLICY_MODEL or the bundled SmolLM2-135M-Instruct)");
  app.add_option("--out", o.out, "output JSON file")->capture_default_str();
  app.add_option("--threads", o.threads, "OpenMP threads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--prompts", o.prompts, "prompts per task")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--grid-length", o.grid_length, "prompt length (kvpolicy_accuracy's grid)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  std::ostringstream pol;
  for (std::size_t i = 0; i < o.policies.size(); ++i) pol << (i ? "; " : "") << o.policies[i];
  app.add_option("--policies", policies,
                 "policy specs separated by ';' (default: " + pol.str() + ")");
  app.add_option("--budgets", budgets, "kept fractions, comma-separated (default 0.1,0.2)");
  app.add_option("--tasks", tasks, "retrieval tasks, comma-separated (default: all five)");
  app.add_option("--regimes", regimes, "known, agnostic or both (default known,agnostic)");
  app.add_option("--prompt-set", o.prompt_set, "eval (default) or calibration")
      ->check(CLI::IsMember({"eval", "calibration"}));
  app.add_flag(
      "--no-margins", [&](std::int64_t) { o.margins = false; },
      "kept sets and digests only: skip the replayed selection and its scores");
  app.add_flag("--synthetic", o.synthetic,
               "instead of the model's K/V/Q, the same pseudo-random ones in every build (the "
               "model's shape, --prompts sequences of --grid-length tokens): isolates the "
               "policies' own arithmetic from the forward pass's");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (o.synthetic) {
    KVP_REQUIRE(tasks.empty() && regimes.empty(), "--synthetic takes no --tasks or --regimes");
    o.tasks = {"synthetic"};
    o.regimes = {"none"};
  }
  if (!policies.empty()) o.policies = split_list(policies, ';');
  if (!tasks.empty()) o.tasks = split_list(tasks, ',');
  if (!regimes.empty()) o.regimes = split_list(regimes, ',');
  if (!budgets.empty()) parse_numbers("--budgets", budgets, o.budgets);
  if (!o.synthetic) {
    require_tasks(o.tasks);
    require_regimes(o.regimes);
  }
  for (double b : o.budgets) KVP_REQUIRE(b > 0 && b <= 1, "--budgets: ", b, " is not in (0, 1]");
  KVP_REQUIRE(!o.policies.empty() && !o.tasks.empty() && !o.regimes.empty() && !o.budgets.empty(),
              "--policies, --tasks, --regimes and --budgets need at least one entry");
  for (const auto& p : o.policies) Policy{p};   // every spec parses before anything runs
  require_unique("--policies", o.policies);
  require_unique("--budgets", o.budgets);
  require_unique("--tasks", o.tasks);
  require_unique("--regimes", o.regimes);
  return o;
}

// FNV-1a, 64 bits: a digest that is the same on every platform.
struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <class T>
  void value(const T& v) {
    bytes(&v, sizeof v);
  }
  void text(const std::string& s) { bytes(s.data(), s.size() + 1); }
  std::string hex() const {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
    return buf;
  }
};

// The newest `window` queries of every layer, token-major [t][Hq][d], as the session's query
// ring holds them: what a compression event reads.
class QueryTail {
 public:
  QueryTail(std::int64_t layers, std::int64_t window)
      : window_(window), q_(static_cast<std::size_t>(layers)) {}
  void add(const LayerCapture& c) {
    auto& buf = q_[static_cast<std::size_t>(c.layer)];
    heads_ = c.q.heads, dim_ = c.q.dim;
    for (std::int64_t t = 0; t < c.q.tokens; ++t)
      for (std::int64_t h = 0; h < c.q.heads; ++h)
        for (std::int64_t i = 0; i < c.q.dim; ++i) buf.push_back(c.q.at(0, h, t, i));
    const auto keep = static_cast<std::size_t>(window_ * heads_ * dim_);
    if (buf.size() > keep) buf.erase(buf.begin(), buf.end() - static_cast<std::ptrdiff_t>(keep));
  }
  // The newest n queries of `layer` as [Hq][n][d] (HND).
  std::vector<float> newest(std::int64_t layer, std::int64_t n) const {
    const auto& buf = q_[static_cast<std::size_t>(layer)];
    const std::int64_t have = static_cast<std::int64_t>(buf.size()) / (heads_ * dim_);
    KVP_REQUIRE(n <= have, "keptsets: ", n, " queries asked, ", have, " captured");
    std::vector<float> out(static_cast<std::size_t>(heads_ * n * dim_));
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t h = 0; h < heads_; ++h)
        std::copy_n(buf.begin() + ((have - n + t) * heads_ + h) * dim_, dim_,
                    out.begin() + (h * n + t) * dim_);
    return out;
  }
  std::int64_t heads() const { return heads_; }
  std::int64_t dim() const { return dim_; }
  void hash(Fnv& f) const {
    for (const auto& b : q_) f.bytes(b.data(), b.size() * sizeof(float));
  }

 private:
  std::int64_t window_, heads_ = 0, dim_ = 0;
  std::vector<std::vector<float>> q_;
};

// What the first compression event of `layer` scores and keeps, replayed outside the session
// exactly as Session::compress calls the policy (same inputs, budgets and event info). `raw` are
// the scorer's own scores: the scores the top-k ranked, except that ams lowers the tokens it
// does not pick to -inf (its kept set is a top-k per segment of the raw scores).
struct Replay {
  kvpolicy::ScoreMap scores, raw;
  kvpolicy::Selection sel;
  kvpolicy::Protect protect;
  std::vector<double> mass_gap;  // per KV head, with ams (see ams_mass_gap)
};

// ams cuts a row into segments where the cumulative mass of its unprotected tokens (window
// attention, pooled and normalized as AMS::mass and AMS::candidates do) first reaches a multiple
// k of segment_mass. Returns how close that cumulative mass comes to any such target, relative
// to the target: where it is within rounding, a segment boundary (and with it a kept token) can
// move by one position between builds.
double ams_mass_gap(const kvpolicy::AMS& a, const kvpolicy::ScoreMap& attn, std::int64_t h,
                    std::int64_t window, const kvpolicy::Protect& p) {
  const std::int64_t T = attn.tokens();
  std::vector<float> credit(static_cast<std::size_t>(T), 0.f);  // first event: no credit yet
  const auto m = a.mass(attn.row(0, h), window, credit);
  const std::int64_t begin = std::min(p.sinks, T), end = std::max(begin, T - p.recent);
  std::vector<double> cum(m.begin() + begin, m.begin() + end);
  kvpolicy::ams::normalize(cum);
  std::partial_sum(cum.begin(), cum.end(), cum.begin());
  double gap = std::numeric_limits<double>::infinity();
  for (double k = 1; k * a.segment_mass < 1.0 - 1e-12; ++k) {
    const double target = k * a.segment_mass;
    const auto it = std::lower_bound(cum.begin(), cum.end(), target);
    for (auto at : {it, it == cum.begin() ? it : it - 1})
      if (at != cum.end()) gap = std::min(gap, std::abs(*at - target) / target);
  }
  return gap;
}
Replay replay(const kvpolicy::Session<float>& s, std::int64_t layer, const QueryTail& q,
              std::int64_t recorded) {
  const auto& cfg = s.config();
  const Policy& policy = s.policy();
  const std::int64_t T = s.length(layer, 0), H = cfg.kv_heads;
  kvpolicy::Inputs<float> in;
  in.keys = s.keys(layer).prefix(T);
  in.values = s.values(layer).prefix(T);
  const std::int64_t pw = policy.query_window(), have = std::min(recorded, T);
  const std::int64_t nq = pw < 0 ? have : std::min(have, pw);
  std::vector<float> qbuf;
  if (nq > 0) {
    qbuf = q.newest(layer, nq);
    in.queries = kvpolicy::KVView<const float>::hnd(qbuf.data(), 1, q.heads(), nq, q.dim());
  }
  in.accumulated = s.accumulated(layer, 0).data();
  in.state_stride = s.capacity(layer);
  const auto b = cfg.budget.resolve(1, H, T);
  std::int64_t total = 0;
  for (auto v : b) total += v;
  std::vector<float> credit(static_cast<std::size_t>(H * T), 0.f);  // AMS starts from zero
  Replay r;
  r.sel = policy.select(
      cfg.backend, in, Budget::total(total),
      kvpolicy::EventInfo{layer, cfg.layers, policy.alloc_state() ? credit.data() : nullptr, T},
      &r.scores, &r.protect);
  for (const auto& alloc : policy.allocators())
    if (const auto* a = std::get_if<kvpolicy::AMS>(&alloc)) {
      kvpolicy::Stats stats;
      const std::int64_t w = std::min(a->window, nq);
      const auto& attn =
          kvpolicy::window_attention_stat(cfg.backend, in, stats, w, kvpolicy::GqaReduce::mean);
      for (std::int64_t h = 0; h < H; ++h)
        r.mass_gap.push_back(ams_mass_gap(*a, attn, h, w, r.protect));
    }
  if (policy.allocators().empty()) {
    r.raw = r.scores;
  } else {  // the scorer alone: the spec's first stage
    const std::string& spec = policy.spec();
    Policy(spec.substr(0, spec.find('|'))).select(cfg.backend, in, Budget::total(total), &r.raw);
  }
  return r;
}

// The kept positions of a row as a bitmap, hex, lowest position in the last digit.
std::string bitmap_hex(std::span<const std::int32_t> kept, std::int64_t tokens) {
  std::string hex(static_cast<std::size_t>((tokens + 3) / 4), '0');
  for (std::int32_t p : kept) {
    auto& c = hex[hex.size() - 1 - static_cast<std::size_t>(p / 4)];
    const int v = (c <= '9' ? c - '0' : c - 'a' + 10) | (1 << (p % 4));
    c = static_cast<char>(v < 10 ? '0' + v : 'a' + v - 10);
  }
  return hex;
}

// The cut of one row, by the scorer's raw scores: "lo" lists kept and "hi" evicted unprotected
// tokens as [position, score], each the kBoundary lowest-ranked kept / highest-ranked evicted
// ones (ranked as the top-k ranks: score, then position) plus every token whose score lies
// within kBand (relative) of a token on the other side, at most kMaxBand per list ("full":
// false when more qualified). A token missing from the lists is further than kBand from every
// token on the other side. "gap": the smallest relative score difference between a kept and an
// evicted token (for a plain top-k the lowest kept against the highest evicted).
constexpr std::size_t kBoundary = 4, kMaxBand = 256;
constexpr double kBand = 1e-4;

double rel_gap(double a, double b) {
  const double scale = std::max(std::abs(a), std::abs(b));
  return scale > 0 ? (a - b) / scale : 0.0;
}

// The smallest |rel_gap(x, y)| over the finite y of `sorted` (ascending); +inf if none.
double nearest(float x, const std::vector<float>& sorted) {
  if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
  const auto it = std::lower_bound(sorted.begin(), sorted.end(), x);
  double best = std::numeric_limits<double>::infinity();
  for (auto at : {it, it == sorted.begin() ? it : it - 1})
    if (at != sorted.end() && std::isfinite(*at)) best = std::min(best, std::abs(rel_gap(x, *at)));
  return best;
}

json cut_of(std::span<const float> score, std::span<const std::int32_t> kept,
            const kvpolicy::Protect& p) {
  const auto T = static_cast<std::int64_t>(score.size());
  const std::int64_t sinks = std::min(p.sinks, T), recent_begin = std::max(sinks, T - p.recent);
  std::vector<std::uint8_t> is_kept(static_cast<std::size_t>(T), 0);
  for (auto k : kept) is_kept[static_cast<std::size_t>(k)] = 1;
  std::vector<std::uint64_t> in, out;
  std::vector<float> in_s, out_s;
  for (std::int64_t j = sinks; j < recent_begin; ++j) {
    const float x = score[static_cast<std::size_t>(j)];
    const bool k = is_kept[static_cast<std::size_t>(j)];
    (k ? in : out).push_back(kvpolicy::topk_key(x, static_cast<std::int32_t>(j)));
    (k ? in_s : out_s).push_back(x);
  }
  std::sort(in.begin(), in.end());
  std::sort(out.begin(), out.end(), std::greater<>());
  std::sort(in_s.begin(), in_s.end());
  std::sort(out_s.begin(), out_s.end());
  bool full = true;
  double gap = std::numeric_limits<double>::infinity();
  auto band = [&](const std::vector<std::uint64_t>& keys, const std::vector<float>& other) {
    json a = json::array();
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const auto pos = kvpolicy::topk_key_index(keys[i]);
      const float x = score[static_cast<std::size_t>(pos)];
      const double d = nearest(x, other);
      gap = std::min(gap, d);
      if (i >= kBoundary && !(d <= kBand)) continue;
      if (a.size() == kMaxBand) {
        full = false;
        continue;
      }
      a.push_back(json::array({pos, std::isfinite(x) ? json(x) : json(x > 0 ? "inf" : "-inf")}));
    }
    return a;
  };
  json c = {{"lo", band(in, out_s)}, {"hi", band(out, in_s)}};
  c["full"] = full;
  if (std::isfinite(gap)) c["gap"] = gap;
  return c;
}

// Hash of the cache of every layer and head: K/V rows (or packed tiles and residual rows), merge
// counts and H2O accumulators.
void hash_cache(const kvpolicy::Session<float>& s, Fnv& f) {
  const auto& cfg = s.config();
  for (std::int64_t l = 0; l < cfg.layers; ++l)
    for (std::int64_t h = 0; h < cfg.kv_heads; ++h) {
      const std::int64_t n = s.length(l, h), d = cfg.head_dim;
      if (s.quantized(l)) {
        const auto& pc = s.packed(l, h);
        for (std::int64_t i = 0; i < pc.tiles(); ++i) {
          f.bytes(pc.key_tile(i), pc.key_tile_size());
          f.bytes(pc.value_tile(i), pc.value_tile_size());
        }
        const auto r = static_cast<std::size_t>(pc.residual_tokens() * d);
        f.bytes(pc.residual_keys(), r * sizeof(float));
        f.bytes(pc.residual_values(), r * sizeof(float));
      } else {
        for (std::int64_t t = 0; t < n; ++t) {
          f.bytes(s.keys(l).row(0, h, t), static_cast<std::size_t>(d) * sizeof(float));
          f.bytes(s.values(l).row(0, h, t), static_cast<std::size_t>(d) * sizeof(float));
        }
      }
      const auto lc = s.log_counts(l, h);
      f.bytes(lc.data(), lc.size() * sizeof(float));
      const auto acc = s.accumulated(l, h);
      f.bytes(acc.data(), acc.size() * sizeof(float));
    }
}

// A full-cache session over `tokens` pseudo-random tokens in the model's shape, as the engine's
// prefill would leave it (K/V and queries appended per layer, then the causal attention that
// accumulates H2O's statistics), with the queries recorded in `q`. Values are drawn from an
// integer hash and scaled by single correctly rounded products, so every build starts from the
// same bits. Keys get a per-token scale, as real keys do, so that norms and attention differ.
kvpolicy::Session<float> synthetic_session(const Model& m, const EngineConfig& ec,
                                           std::int64_t tokens, std::int64_t seed, QueryTail& q) {
  // The session an engine with `ec` would run (its shape, threads and recording), empty.
  kvpolicy::Session<float> s = Engine(m, ec).session();
  const auto& sc = s.config();
  const std::int64_t d = sc.head_dim, T = tokens;
  auto draw = [&](std::uint64_t a, std::uint64_t b, std::uint64_t c) {
    Fnv f;
    f.value(seed), f.value(a), f.value(b), f.value(c);
    return static_cast<float>(static_cast<std::int64_t>(f.h >> 41) - (std::int64_t{1} << 22)) *
           0x1p-22f;  // uniform in [-1, 1)
  };
  std::vector<float> k(static_cast<std::size_t>(sc.kv_heads * T * d)), v(k.size()),
      qv(static_cast<std::size_t>(sc.q_heads * T * d)), out(qv.size());
  for (std::int64_t l = 0; l < sc.layers; ++l) {
    const auto L = static_cast<std::uint64_t>(l) << 32;
    for (std::size_t i = 0; i < k.size(); ++i) {
      const auto t = static_cast<std::uint64_t>((static_cast<std::int64_t>(i) / d) % T);
      const float scale = 1.0f + std::ldexp(std::floor(4 * (draw(L, t, 3) + 1)), -1);  // 1..4.5
      k[i] = scale * draw(L | 1, i, 0);
      v[i] = draw(L | 2, i, 0);
    }
    for (std::size_t i = 0; i < qv.size(); ++i) qv[i] = 2.0f * draw(L | 4, i, 0);
    using View = kvpolicy::KVView<const float>;
    const View kk = View::hnd(k.data(), 1, sc.kv_heads, T, d),
               vv = View::hnd(v.data(), 1, sc.kv_heads, T, d),
               qq = View::hnd(qv.data(), 1, sc.q_heads, T, d);
    s.append(l, kk, vv, qq);
    s.attend(l, qq, out.data());
    q.add(LayerCapture{l, 0, qq, kk, vv});
  }
  return s;
}

struct Totals {
  std::int64_t sets = 0, rows = 0, replay_mismatch = 0;
  Fnv digest;
};

// One regime of one prompt: every (policy, budget) forked from the full-cache session `src`,
// compressed once (as Engine::fork and compress_now do), recorded.
void run_grid(const Options& o, const kvpolicy::Session<float>& src, const QueryTail& q,
              std::int64_t recorded, const json& id, json& sets, Totals& tot) {
  // The full cache before any compression and the queries: the forward pass's own output.
  Fnv full;
  hash_cache(src, full);
  q.hash(full);
  for (const auto& spec : o.policies)
    for (double b : o.budgets) {
      kvpolicy::Session<float> f = src.fork(Policy(spec), Budget::ratio(b));
      const auto& cfg = f.config();
      const std::int64_t T = f.length(0, 0);
      std::vector<Replay> rp;
      if (o.margins)
        for (std::int64_t l = 0; l < cfg.layers; ++l) rp.push_back(replay(f, l, q, recorded));
      for (std::int64_t l = 0; l < cfg.layers; ++l) f.compress_if_due(l);
      Fnv set_digest, kv;
      json rows = json::array();
      bool replay_ok = true;
      for (std::int64_t l = 0; l < cfg.layers; ++l)
        for (std::int64_t h = 0; h < cfg.kv_heads; ++h) {
          const auto kept = f.positions(l, h);
          const std::string bits = bitmap_hex(kept, T);
          set_digest.text(bits);
          json row = {{"l", l}, {"h", h}, {"n", kept.size()}, {"kept", bits}};
          if (o.margins) {
            const auto& r = rp[static_cast<std::size_t>(l)];
            const auto& want = r.sel.kept(0, h);
            const bool same = std::equal(want.begin(), want.end(), kept.begin(), kept.end());
            replay_ok = replay_ok && same;
            row["cut"] = cut_of(r.raw.row(0, h), kept, r.protect);
            if (!r.mass_gap.empty())
              row["cut"]["mass_gap"] = r.mass_gap[static_cast<std::size_t>(h)];
          }
          rows.push_back(std::move(row));
          ++tot.rows;
        }
      hash_cache(f, kv);
      json set = id;
      set["policy"] = spec;
      set["budget"] = b;
      set["tokens"] = T;
      set["digest"] = set_digest.hex();
      set["kv_digest"] = kv.hex();
      set["prefill_kv_digest"] = full.hex();
      if (o.margins) set["replay"] = replay_ok;
      set["rows"] = std::move(rows);
      tot.digest.text(id.dump() + spec + std::to_string(b) + set_digest.hex());
      tot.replay_mismatch += replay_ok ? 0 : 1;
      if (!replay_ok)
        std::cerr << "keptsets: the replayed selection differs from the session's for " << spec
                  << " @ " << b << " on " << id.dump() << "\n";
      ++tot.sets;
      sets.push_back(std::move(set));
    }
}

json build_info() {
  json b;
#if defined(__FMA__)
  b["fma"] = true;
#else
  b["fma"] = false;
#endif
#if defined(__AVX512F__)
  b["vector_bits"] = 512;
#elif defined(__AVX__)
  b["vector_bits"] = 256;
#else
  b["vector_bits"] = 128;
#endif
  b["eigen_simd"] = Eigen::SimdInstructionSetsInUse();
  b["compiler"] = __VERSION__;
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_args(argc, argv);
#if defined(_OPENMP)
    omp_set_num_threads(o.threads);
#endif
    const auto t0 = std::chrono::steady_clock::now();
    const std::string path = o.model.empty() ? kvpolicy::engine::default_model_path() : o.model;
    const auto model = Model::load(path);
    const Model& m = *model;
    const PromptSet set = o.prompt_set == "eval" ? PromptSet::eval : PromptSet::calibration;
    std::vector<Corpus> corpora;
    if (!o.synthetic)
      for (const auto& p : corpus_paths(set)) corpora.push_back(load_corpus(m, p));

    std::int64_t recorded = 1;
    for (const auto& p : o.policies) recorded = std::max(recorded, Policy(p).query_window());
    EngineConfig cfg;
    cfg.policy = kFull;
    cfg.budget = Budget::ratio(1.0);
    cfg.threads = o.threads;
    cfg.record_queries = recorded;
    cfg.record_attention = true;
    // The session's query ring: the full cache's own window or what it records, whichever is more.
    recorded = std::max({std::int64_t{0}, Policy(kFull).query_window(), recorded});

    Totals tot;
    json sets = json::array();
    const std::int64_t L = m.config().n_layers;
    for (const auto& task : o.tasks)
      for (std::int64_t i = 0; i < o.prompts; ++i) {
        if (o.synthetic) {
          QueryTail q(L, recorded);
          const auto full = synthetic_session(m, cfg, o.grid_length, i, q);
          run_grid(o, full, q, recorded, {{"task", task}, {"index", i}, {"regime", "none"}}, sets,
                   tot);
          continue;
        }
        const auto p = make_retrieval_prompt(m, corpora, set, task, o.grid_length, i);
        Engine full(m, cfg);
        QueryTail ctx_q(L, recorded);
        full.set_capture([&](const LayerCapture& c) { ctx_q.add(c); });
        full.prefill(p.context);
        for (const auto& r : o.regimes) {
          const json id = {{"task", task}, {"index", i}, {"regime", r}};
          if (r == "agnostic") {
            run_grid(o, full.session(), ctx_q, recorded, id, sets, tot);
            continue;
          }
          // Question-known: the question goes into the full cache before compressing.
          Engine base = full.fork(kFull, Budget::ratio(1.0));
          QueryTail q = ctx_q;
          base.set_capture([&](const LayerCapture& c) { q.add(c); });
          base.extend(p.question);
          run_grid(o, base.session(), q, recorded, id, sets, tot);
        }
        std::cerr << "keptsets: " << task << " #" << i << " done\n";
      }

    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    json out = {{"schema", "kvpolicy-keptsets/1"},
                {"build", build_info()},
                {"threads", o.threads},
                {"config",
                 {{"prompt_set", o.prompt_set},
                  {"grid_length", o.grid_length},
                  {"prompts", o.prompts},
                  {"tasks", o.tasks},
                  {"regimes", o.regimes},
                  {"policies", o.policies},
                  {"budgets", o.budgets},
                  {"margins", o.margins},
                  {"synthetic", o.synthetic}}},
                {"model", {{"name", m.config().name}, {"path", path}}},
                {"sets_count", tot.sets},
                {"rows_count", tot.rows},
                {"replay_mismatches", tot.replay_mismatch},
                {"digest", tot.digest.hex()},
                {"seconds", secs},
                {"sets", std::move(sets)}};
    std::ofstream f(o.out);
    f << out.dump() << "\n";
    KVP_REQUIRE(f.good(), "cannot write ", o.out);
    std::cerr << "keptsets: " << tot.sets << " sets, " << tot.rows
              << " kept sets (layer, head), digest " << tot.digest.hex() << ", " << secs
              << " s, wrote " << o.out << "\n";
    if (tot.replay_mismatch > 0) {
      std::cerr << "keptsets: " << tot.replay_mismatch
                << " sets whose replayed selection differs from the session's\n";
      return 2;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvpolicy_keptsets: %s\n", e.what());
    return 1;
  }
}
