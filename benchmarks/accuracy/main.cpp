// kvpolicy_accuracy: accuracy and throughput of KV-cache policies on a real model (default
// SmolLM2-135M-Instruct, GGUF) through the reference engine. See --help, retrieval.hpp and
// tasks.hpp.
//
// Sections (each can be skipped):
//   curve       full-cache exact match of every retrieval task over --lengths
//   retrieval   every task at --grid-length: the policy x budget grid in both regimes
//               (question-known, question-agnostic), exact match and answer log-probability
//   fidelity    teacher-forced KL / top-1 / NLL change on windows of real texts
//   long        a long structured generation, teacher-forced through decode-time compression
//   throughput  prefill and decode tokens/s, bytes read per token and the decode speed-ups (GGUF
//               weights vs fp32 weights, eviction vs full cache) at 4K and 8K
// Every prompt is a work unit numbered in a fixed order; --shard i/n runs the units whose number
// is i mod n and writes their raw records; --merge combines shards. The report (tables,
// intervals, paired comparisons; report.cpp) is always computed from the sorted raw records,
// so merged shards give exactly the numbers of one run.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cli_lists.hpp"
#include "report.hpp"
#include "retrieval.hpp"
#include "tasks.hpp"

namespace {

using namespace kvbench;
using json = nlohmann::json;
using kvpolicy::Budget;
using kvpolicy::Policy;

constexpr const char* kFull = "streaming";  // with Budget::ratio(1.0): keeps every token
const std::string kProfile = depthkv_stage(KVPOLICY_PROFILE_DIR);

struct Options {
  std::string model, out = "accuracy-results", suite = "default", shard, prompt_set = "eval";
  std::vector<std::string> merge;
  int threads = 0;
  bool plots = true;
  std::vector<std::string> policies = default_policies(KVPOLICY_PROFILE_DIR);
  std::vector<double> budgets = {0.1, 0.2, 0.3};
  std::vector<std::string> tasks = retrieval_tasks();
  std::vector<std::string> regimes = {"known", "agnostic"};
  std::vector<std::int64_t> lengths = {512, 1024};
  std::int64_t grid_length = 1024, prompts = 6, curve_prompts = 4, greedy_tokens = 12;
  std::int64_t windows = 4, text_prompt = 768, text_cont = 32;
  std::vector<std::string> long_policies = {"h2o", "snapkv", "snapkv | ams"};
  std::vector<std::int64_t> long_budgets = {128, 256};
  std::int64_t long_tokens = 1024, long_prompts = 1, long_interval = 16, long_bin = 64;
  std::vector<std::int64_t> throughput_lengths = {4096, 8192};
  double throughput_budget = 0.2;
  std::string throughput_policy = "snapkv";
  std::int64_t throughput_steps = 16;
  bool reconstruct_cost = false;  // also time kvzip's reconstruction pass against a prefill
  std::vector<std::string> skip;
  int resamples = 2000;
};

const std::set<std::string> kSections = {"curve", "retrieval", "fidelity", "long", "throughput"};

// Presets: the default run (the README's main job, ~10 minutes on 2 cores), the full suite
// (>= 50 prompts per cell, <= 60 minutes), focused comparisons, and the CI smoke run.
void apply_suite(Options& o) {
  const std::string& s = o.suite;
  if (s == "default") return;
  if (s == "full") {
    o.prompts = 50;
    o.curve_prompts = 20;
    o.lengths = {512, 1024, 2048};
    o.windows = 5;
    o.text_prompt = 1024;
    o.text_cont = 64;
    o.long_policies = {"streaming", "h2o", "snapkv", "snapkv | ams"};
    o.long_prompts = 2;
    o.long_budgets = {128, 256, 512};
    o.throughput_lengths = {4096, 8192};
    return;
  }
  if (s == "quick") {
    o.policies = {"streaming", "h2o", "snapkv(window=16)",
                  "snapkv(window=16) | " + kProfile + " | adakv"};
    o.budgets = {0.3, 0.5};
    o.lengths = {320, 384};
    o.grid_length = 384;
    o.prompts = 2;
    o.curve_prompts = 1;
    o.greedy_tokens = 8;
    o.windows = 1;
    o.text_prompt = 192;
    o.text_cont = 16;
    o.long_policies = {"h2o", "snapkv(window=16)"};
    o.long_budgets = {48};
    o.long_tokens = 48;
    o.long_interval = 8;
    o.long_bin = 16;
    o.throughput_lengths = {512};
    o.throughput_steps = 4;
    o.resamples = 200;
    return;
  }
  o.skip = {"long", "throughput"};
  o.policies.clear();
  if (s == "allocators") {
    for (const char* scorer : {"snapkv", "h2o"})
      for (const std::string& chain :
           {std::string(), std::string(" | pyramid"), " | " + kProfile,
            " | " + kProfile.substr(0, kProfile.size() - 1) + ",rule=proportional,power=0.25)",
            std::string(" | adakv"), std::string(" | ams")})
        o.policies.push_back(scorer + chain);
  } else if (s == "mergers") {
    for (const char* scorer : {"snapkv", "h2o"})
      for (const char* merger :
           {"", " | nearest", " | semantic(tau=0.9)", " | semantic(tau=0.5)"})
        o.policies.push_back(std::string(scorer) + merger);
    o.policies.push_back("snapkv | ams | semantic(tau=0.9)");
    o.long_policies = {"snapkv", "snapkv | semantic(tau=0.9)", "h2o", "h2o | semantic(tau=0.9)"};
    o.skip = {"throughput"};
  } else if (s == "quant") {
    for (const char* q : {"", " | int4", " | kivi", " | int2"})
      o.policies.push_back(std::string("snapkv") + q);
    o.budgets = {0.2, 1.0};
  } else {
    KVP_REQUIRE(false, "--suite: unknown suite '", s,
                "' (default, full, quick, allocators, mergers, quant)");
  }
  o.skip.push_back("curve");
}

struct Shard {
  std::int64_t index = 0, count = 1;
};
Shard parse_shard(const std::string& s) {
  if (s.empty()) return {};
  const auto slash = s.find('/');
  Shard sh;
  try {
    KVP_REQUIRE(slash != std::string::npos, "");
    std::size_t a = 0, b = 0;
    sh.index = std::stoll(s.substr(0, slash), &a);
    sh.count = std::stoll(s.substr(slash + 1), &b);
    KVP_REQUIRE(a == slash && b == s.size() - slash - 1, "");
  } catch (const std::exception&) {
    KVP_REQUIRE(false, "--shard: '", s, "' is not of the form i/n (e.g. 0/4)");
  }
  KVP_REQUIRE(sh.count >= 1 && sh.index >= 0 && sh.index < sh.count, "--shard ", s,
              ": need 0 <= i < n");
  return sh;
}

template <class T>
std::string join(const std::vector<T>& v, const char* sep = ",") {
  std::ostringstream out;
  for (std::size_t i = 0; i < v.size(); ++i) out << (i ? sep : "") << v[i];
  return out.str();
}

// Parses the command line. CLI11 runs twice: first for --suite (a preset), then for every
// flag, so explicit flags override the preset whatever their order.
Options parse_args(int argc, char** argv) {
  Options o;
  {
    CLI::App pre;
    pre.allow_extras();
    pre.set_help_flag();
    pre.add_option("--suite", o.suite);
    bool quick = false;
    pre.add_flag("--quick", quick);
    try {
      pre.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      std::exit(pre.exit(e));
    }
    KVP_REQUIRE(!quick || o.suite == "default" || o.suite == "quick",
                "--quick and --suite ", o.suite, " exclude each other");
    if (quick) o.suite = "quick";
    apply_suite(o);
  }
  CLI::App app(
      "Accuracy and throughput of KV-cache policies on a real model through kvpolicy's "
      "reference engine. Prints markdown tables with 95% intervals, writes <out>/results.json "
      "(schema: README, 'Accuracy benchmark') and PNG plots.",
      "kvpolicy_accuracy");
  app.get_formatter()->column_width(30);
  std::string policies, long_policies, budgets, tasks, regimes, lengths, long_budgets, skip,
      throughput_lengths;
  app.add_option("--suite", o.suite,
                 "preset: default (the main job, ~10 min), full (>= 50 prompts per cell, "
                 "<= 60 min), quick (CI smoke run), allocators, mergers, quant; later flags "
                 "override it");
  bool quick = false;
  app.add_flag("--quick", quick, "same as --suite quick");
  app.add_option("--model", o.model,
                 "GGUF model (default: $KVPOLICY_MODEL or the bundled SmolLM2-135M-Instruct in "
                 "~/.cache/kvpolicy)");
  app.add_option("--out", o.out, "output folder (default accuracy-results)");
  app.add_option("--threads", o.threads, "OpenMP threads (default: all cores)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--policies", policies, "policy specs separated by ';' (default: " + join(o.policies, "; ") + ")");
  app.add_option("--budgets", budgets, "kept fractions of the prompt, comma-separated (default " + join(o.budgets) + ")");
  app.add_option("--tasks", tasks, "retrieval tasks, comma-separated (default " + join(o.tasks) + ")");
  app.add_option("--regimes", regimes, "retrieval regimes (default " + join(o.regimes) + ")");
  app.add_option("--lengths", lengths, "prompt lengths (tokens) of the full-cache curve (default " + join(o.lengths) + ")");
  app.add_option("--grid-length", o.grid_length, "prompt length of the policy grid")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--prompts", o.prompts, "prompts per (task, regime) cell of the grid")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--curve-prompts", o.curve_prompts,
                 "prompts per (task, length) of the full-cache curve (the grid's prompts count "
                 "at the grid length)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--windows", o.windows, "fidelity windows per source text")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--text-prompt", o.text_prompt, "fidelity prompt tokens")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--text-cont", o.text_cont, "fidelity continuation tokens (teacher-forced)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--long-policies", long_policies,
                 "policy specs of the long-generation task, ';'-separated (default: " + join(o.long_policies, "; ") + ")");
  app.add_option("--long-budgets", long_budgets,
                 "long-generation budgets in tokens per KV head, comma-separated (default " + join(o.long_budgets) + ")");
  app.add_option("--long-tokens", o.long_tokens, "tokens generated in the long-generation task")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--long-prompts", o.long_prompts, "long-generation prompts")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--long-interval", o.long_interval,
                 "tokens between decode-time compressions (H2O evicts at every step)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--throughput-lengths", throughput_lengths, "contexts of the throughput table (default " + join(o.throughput_lengths) + ")");
  app.add_option("--skip", skip, "sections to skip: curve,retrieval,fidelity,long,throughput (default: " + (o.skip.empty() ? std::string("none") : join(o.skip)) + ")");
  app.add_option("--prompt-set", o.prompt_set,
                 "eval (default) or calibration: disjoint corpora and seeds, for tuning")
      ->check(CLI::IsMember({"eval", "calibration"}));
  app.add_option("--shard", o.shard, "run slice i of n of the prompts (i/n) and write raw records");
  app.add_option("--merge", o.merge, "combine shard result files into one report")
      ->expected(1, -1)
      ->check(CLI::ExistingFile);
  app.add_option("--resamples", o.resamples, "bootstrap resamples (default 2000)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--no-plots", [&](std::int64_t) { o.plots = false; }, "do not draw PNG plots");
  app.add_flag("--reconstruct-cost", o.reconstruct_cost,
               "throughput section: also time kvzip's reconstruction pass (Engine::reconstruct) "
               "against a plain prefill of the same context (adds about 1.5 prefills per length)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  if (!policies.empty()) o.policies = split_list(policies, ';');
  if (!long_policies.empty()) o.long_policies = split_list(long_policies, ';');
  if (!budgets.empty()) parse_numbers("--budgets", budgets, o.budgets);
  if (!lengths.empty()) parse_numbers("--lengths", lengths, o.lengths);
  if (!long_budgets.empty()) parse_numbers("--long-budgets", long_budgets, o.long_budgets);
  if (!throughput_lengths.empty())
    parse_numbers("--throughput-lengths", throughput_lengths, o.throughput_lengths);
  if (!tasks.empty()) o.tasks = split_list(tasks, ',');
  if (!regimes.empty()) o.regimes = split_list(regimes, ',');
  if (!skip.empty()) o.skip = split_list(skip, ',');
  require_unique("--policies", o.policies);
  require_unique("--long-policies", o.long_policies);
  require_unique("--budgets", o.budgets);
  require_unique("--long-budgets", o.long_budgets);
  require_unique("--tasks", o.tasks);
  require_unique("--regimes", o.regimes);
  require_unique("--lengths", o.lengths);
  require_unique("--throughput-lengths", o.throughput_lengths);
  require_unique("--skip", o.skip);
  KVP_REQUIRE(o.long_prompts <= 5, "--long-prompts: ", o.long_prompts,
              " is more than the 5 long-generation prompts there are");
  for (double b : o.budgets) KVP_REQUIRE(b > 0 && b <= 1, "--budgets: ", b, " is not in (0, 1]");
  for (auto b : o.long_budgets) KVP_REQUIRE(b > 0, "--long-budgets: ", b, " is not positive");
  for (auto L : o.lengths) KVP_REQUIRE(L > 0, "--lengths: ", L, " is not positive");
  require_tasks(o.tasks);
  require_regimes(o.regimes);
  for (const auto& s : o.skip)
    KVP_REQUIRE(kSections.count(s), "--skip: unknown section '", s,
                "' (curve, retrieval, fidelity, long, throughput)");
  KVP_REQUIRE(!o.policies.empty() && !o.tasks.empty() && !o.regimes.empty(),
              "--policies, --tasks and --regimes need at least one entry");
  std::sort(o.lengths.begin(), o.lengths.end());
  std::sort(o.budgets.begin(), o.budgets.end());
  parse_shard(o.shard);  // validates
  KVP_REQUIRE(o.merge.empty() || o.shard.empty(), "--merge and --shard exclude each other");
  return o;
}

bool runs(const Options& o, const std::string& section) {
  return std::find(o.skip.begin(), o.skip.end(), section) == o.skip.end();
}

// The configuration that decides the records; shards must agree on it to be merged.
json config_json(const Options& o) {
  json c;
  c["suite"] = o.suite;
  c["prompt_set"] = o.prompt_set;
  c["policies"] = o.policies;
  c["budgets"] = o.budgets;
  c["tasks"] = o.tasks;
  c["regimes"] = o.regimes;
  c["lengths"] = o.lengths;
  c["grid_length"] = o.grid_length;
  c["prompts"] = o.prompts;
  c["curve_prompts"] = o.curve_prompts;
  c["greedy_tokens"] = o.greedy_tokens;
  c["windows"] = o.windows;
  c["text_prompt"] = o.text_prompt;
  c["text_cont"] = o.text_cont;
  c["long_policies"] = o.long_policies;
  c["long_budgets"] = o.long_budgets;
  c["long_tokens"] = o.long_tokens;
  c["long_prompts"] = o.long_prompts;
  c["long_interval"] = o.long_interval;
  c["long_bin"] = o.long_bin;
  c["skip"] = o.skip;
  c["resamples"] = o.resamples;
  c["throughput_lengths"] = o.throughput_lengths;
  c["reconstruct_cost"] = o.reconstruct_cost;
  c["throughput_policy"] = o.throughput_policy;
  c["throughput_budget"] = o.throughput_budget;
  c["throughput_steps"] = o.throughput_steps;
  return c;
}

// ---- work units -------------------------------------------------------------------------

struct Unit {
  enum Kind { curve, grid, fidelity, long_gen } kind;
  std::string task;  // curve/grid: task; fidelity: corpus path
  std::int64_t length = 0, index = 0;
  double cost = 1;  // for the progress bar, ~ prompt tokens
};

std::vector<Unit> units(const Options& o) {
  std::vector<Unit> u;
  const bool grid = runs(o, "retrieval");
  for (const auto& t : o.tasks) {
    if (grid)
      for (std::int64_t i = 0; i < o.prompts; ++i)
        u.push_back({Unit::grid, t, o.grid_length, i,
                     static_cast<double>(o.grid_length) * (1 + double(o.grid_length) / 4096) +
                         30.0 * static_cast<double>(o.policies.size() * o.budgets.size() *
                                                    o.regimes.size())});
    if (runs(o, "curve"))
      for (auto L : o.lengths) {
        if (grid && L == o.grid_length) continue;  // the grid's prompts are this point
        for (std::int64_t i = 0; i < o.curve_prompts; ++i)
          u.push_back({Unit::curve, t, L, i,
                       static_cast<double>(L) * (1 + double(L) / 4096) + 20.0 * o.greedy_tokens});
      }
  }
  if (runs(o, "fidelity"))
    for (const auto& path : corpus_paths(o.prompt_set == "eval" ? PromptSet::eval
                                                                : PromptSet::calibration))
      for (std::int64_t w = 0; w < o.windows; ++w)
        u.push_back({Unit::fidelity, path, o.text_prompt, w,
                     static_cast<double>(o.text_prompt) +
                         2.0 * static_cast<double>(o.text_cont * o.policies.size() *
                                                   o.budgets.size())});
  if (runs(o, "long"))
    for (std::int64_t i = 0; i < o.long_prompts; ++i)
      u.push_back({Unit::long_gen, "", o.long_tokens, i,
                   static_cast<double>(o.long_tokens) *
                       (4.0 + 2.0 * static_cast<double>(o.long_policies.size() *
                                                        o.long_budgets.size()))});
  return u;
}

// True when a policy of the list reads context-reconstruction scores (kvzip): the full-cache
// engine then runs the reconstruction pass once, and every fork copies its scores.
bool reads_reconstruction(const std::vector<std::string>& policies) {
  return std::any_of(policies.begin(), policies.end(), [](const std::string& p) {
    return has(Policy(p).needs(), kvpolicy::Needs::reconstruction);
  });
}

EngineConfig full_config(const Options& o, std::int64_t record_queries) {
  EngineConfig c;
  c.policy = kFull;
  c.budget = Budget::ratio(1.0);
  c.threads = o.threads;
  c.record_queries = record_queries;
  c.record_attention = true;
  return c;
}

// ---- fidelity ---------------------------------------------------------------------------

// Window `w` of a corpus: prompt + continuation at a seeded offset (windows of one corpus are
// spread over it and do not overlap when it is long enough).
json run_fidelity_unit(const Model& m, const Options& o, const Corpus& c, std::int64_t w,
                       const EngineConfig& cfg) {
  const std::int64_t need = o.text_prompt + o.text_cont;
  const auto total = static_cast<std::int64_t>(c.ids.size());
  KVP_REQUIRE(total >= need, "fidelity: ", c.path, " has ", total, " tokens, fewer than ", need);
  // Windows sit in distinct slots of `need` tokens, spread over the text (preflight checked
  // that there are at least --windows slots).
  const std::int64_t slots = total / need;
  KVP_REQUIRE(w < slots, "fidelity: window ", w, " of ", c.path, " does not fit (", slots, " slots)");
  const std::int64_t offset = (w * slots / o.windows) * need;
  const std::span<const std::int32_t> ids(c.ids);
  const auto prompt = ids.subspan(static_cast<std::size_t>(offset), static_cast<std::size_t>(o.text_prompt));
  const auto cont = ids.subspan(static_cast<std::size_t>(offset + o.text_prompt),
                                static_cast<std::size_t>(o.text_cont));
  Engine full(m, cfg);
  full.prefill(prompt);
  if (reads_reconstruction(o.policies)) full.reconstruct();
  Engine ref_engine = full.fork(kFull, Budget::ratio(1.0));
  const Reference ref = reference_run(ref_engine, cont);
  json rec = {{"source", c.name}, {"window", w}, {"offset", offset}, {"full_nll", ref.nll}};
  json cells = json::array();
  std::vector<std::unique_ptr<Engine>> decode_forks;
  std::vector<std::pair<std::string, double>> decode_cells;
  for (const auto& p : o.policies)
    for (double b : o.budgets) {
      auto e = std::make_unique<Engine>(full.fork(p, Budget::ratio(b)));
      e->compress_now();
      e->session().shrink_to_fit();
      if (e->session().decode_interval() > 0) {
        decode_forks.push_back(std::move(e));
        decode_cells.emplace_back(p, b);
        continue;
      }
      const Fidelity f = compare_run(*e, cont, ref);
      cells.push_back({{"policy", p}, {"budget", b}, {"kl", f.kl}, {"top1", f.top1},
                       {"dnll", f.delta_nll}});
    }
  if (!decode_forks.empty()) {
    std::vector<Engine*> es;
    for (auto& e : decode_forks) es.push_back(e.get());
    const auto fs = compare_run_batch(es, cont, ref);
    for (std::size_t k = 0; k < fs.size(); ++k)
      cells.push_back({{"policy", decode_cells[k].first}, {"budget", decode_cells[k].second},
                       {"kl", fs[k].kl}, {"top1", fs[k].top1}, {"dnll", fs[k].delta_nll}});
  }
  rec["cells"] = std::move(cells);
  return rec;
}

// ---- long generation --------------------------------------------------------------------

// Structured prompts: the model writes long numbered lists, so a policy that evicts a region
// the text refers back to (the list's format, its earlier items) shows up as KL at the
// positions after the eviction.
const std::vector<std::string>& long_prompts() {
  static const std::vector<std::string> p = {
      "Write a numbered list of 100 different animals. For each one, give its name and one "
      "sentence about where it lives and what it eats.",
      "Solve these step by step, showing every step on its own line: 17 + 28, 45 - 19, 6 x 7, "
      "84 / 4, 123 + 456, 1000 - 357, 12 x 12, 81 / 9, 250 + 750, 99 - 33, 15 x 4, 144 / 12, "
      "then add all the results together.",
      "Write a numbered list of 80 everyday objects found in a kitchen. For each one, give one "
      "sentence about what it is used for.",
      "Write a detailed step-by-step recipe with at least 40 numbered steps for baking bread, "
      "then list 30 common mistakes and how to avoid each one.",
      "Write a numbered list of 100 countries. For each one, give its capital city and the "
      "continent it is on."};
  return p;
}

// The full cache's continuation, sampled at temperature 0.7 with a fixed seed (draws from
// std::mt19937_64's fixed sequence, not from implementation-defined distributions). Greedy
// decoding of this small model falls into loops ("1. The Lion (Lionidae)" a thousand times),
// which no policy can get wrong; sampled text keeps referring to the list's format and
// earlier items. EOS is never drawn: the task needs its length.
std::vector<std::int32_t> sample_continuation(Engine& e, std::int64_t n, std::uint64_t seed) {
  constexpr double kTemperature = 0.7;
  std::mt19937_64 rng(seed);
  const std::int32_t eos = e.model().tokenizer().eos();
  std::vector<std::int32_t> out;
  std::vector<double> p;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto logits = e.last_logits();
    const float mx = *std::max_element(logits.begin(), logits.end());
    p.assign(logits.size(), 0.0);
    double sum = 0;
    for (std::size_t j = 0; j < logits.size(); ++j) {
      if (static_cast<std::int32_t>(j) == eos) continue;
      p[j] = std::exp(static_cast<double>(logits[j] - mx) / kTemperature);
      sum += p[j];
    }
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * sum;
    std::size_t t = 0;
    for (double acc = p[0]; acc <= u && t + 1 < p.size(); acc += p[++t]) {
    }
    while (p[t] == 0.0 && t > 0) --t;  // never land on an excluded token
    out.push_back(static_cast<std::int32_t>(t));
    e.step(out.back());
  }
  return out;
}

json run_long_unit(const Model& m, const Options& o, std::int64_t index, const EngineConfig& cfg) {
  const auto& tok = m.tokenizer();
  const auto& prompts = long_prompts();
  const std::string& text = prompts[static_cast<std::size_t>(index) % prompts.size()];
  const auto ids = tok.encode(tok.apply_chat_template({{"user", text}}, true), true, false);
  Engine full(m, cfg);
  full.prefill(ids);
  if (reads_reconstruction(o.long_policies)) full.reconstruct();
  Engine gen = full.fork(kFull, Budget::ratio(1.0));
  // The full cache's own generation, then teacher-forced through every policy.
  const std::vector<std::int32_t> cont =
      sample_continuation(gen, o.long_tokens, 0x5eed0000u + static_cast<std::uint64_t>(index));
  Engine ref_engine = full.fork(kFull, Budget::ratio(1.0));
  const Reference ref = reference_run(ref_engine, cont);
  std::vector<std::unique_ptr<Engine>> forks;
  json cells = json::array();
  for (const auto& p : o.long_policies) {
    // H2O evicts at every step (its own algorithm); the others every `interval` tokens.
    const std::int64_t interval = Policy(p).decode_time() ? 0 : o.long_interval;
    for (auto b : o.long_budgets) {
      forks.push_back(std::make_unique<Engine>(full.fork(p, Budget::tokens(b), interval)));
      forks.back()->compress_now();
      cells.push_back({{"policy", p}, {"budget", b}});
    }
  }
  std::vector<Engine*> es;
  for (auto& e : forks) es.push_back(e.get());
  std::vector<std::vector<double>> kl_pos;
  std::vector<std::vector<std::uint8_t>> agree_pos;
  const auto fs = compare_run_batch(es, cont, ref, &kl_pos, &agree_pos);
  const auto n = static_cast<std::int64_t>(cont.size());
  for (std::size_t i = 0; i < fs.size(); ++i) {
    json kl_bins = json::array(), top1_bins = json::array();
    for (std::int64_t b0 = 0; b0 < n; b0 += o.long_bin) {
      const std::int64_t b1 = std::min(n, b0 + o.long_bin);
      double kl = 0, ag = 0;
      for (std::int64_t t = b0; t < b1; ++t) {
        kl += kl_pos[i][static_cast<std::size_t>(t)];
        ag += agree_pos[i][static_cast<std::size_t>(t)];
      }
      kl_bins.push_back(kl / static_cast<double>(b1 - b0));
      top1_bins.push_back(ag / static_cast<double>(b1 - b0));
    }
    cells[i]["kl"] = fs[i].kl;
    cells[i]["top1"] = fs[i].top1;
    cells[i]["dnll"] = fs[i].delta_nll;
    cells[i]["kv_bytes"] = es[i]->session().kv_bytes();
    cells[i]["kl_bins"] = std::move(kl_bins);
    cells[i]["top1_bins"] = std::move(top1_bins);
  }
  const auto head = std::span<const std::int32_t>(cont).first(std::min<std::size_t>(cont.size(), 40));
  return {{"prompt", index},       {"prompt_tokens", ids.size()}, {"generated", n},
          {"full_nll", ref.nll},   {"sample", tok.decode(head)},  {"bin", o.long_bin},
          {"cells", std::move(cells)}};
}

// ---- throughput -------------------------------------------------------------------------

volatile std::uint64_t g_bandwidth_sink = 0;

// Read bandwidth of this machine in GB/s: `threads` threads each XOR-reduce their half of a
// 512 MiB buffer (far larger than the caches decode streams through, if not than every L3),
// eight independent lanes per thread so that loads, not the reduction, bound it; best of 3.
double read_bandwidth(int threads) {
  const std::size_t n = (std::size_t{512} << 20) / sizeof(std::uint64_t);
  std::vector<std::uint64_t> buf(n);
  for (std::size_t i = 0; i < n; ++i) buf[i] = i * 0x9E3779B97F4A7C15ull;
  double best = 0;
  std::uint64_t sink = 0;
  for (int pass = 0; pass < 3; ++pass) {
    std::uint64_t acc = 0;
    const double s = seconds([&] {
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) reduction(^ : acc)
#endif
      {
#if defined(_OPENMP)
        const auto t = static_cast<std::size_t>(omp_get_thread_num()),
                   T = static_cast<std::size_t>(omp_get_num_threads());
#else
        const std::size_t t = 0, T = 1;
#endif
        const std::size_t lo = n * t / T / 8 * 8, hi = n * (t + 1) / T / 8 * 8;
        std::uint64_t lane[8] = {};
        for (std::size_t i = lo; i < hi; i += 8)
          for (int k = 0; k < 8; ++k) lane[k] ^= buf[i + static_cast<std::size_t>(k)];
        for (std::uint64_t x : lane) acc ^= x;
      }
    });
    sink ^= acc;
    best = std::max(best, static_cast<double>(n * sizeof(std::uint64_t)) / s * 1e-9);
  }
  g_bandwidth_sink = sink;  // the reductions are not dead code
  (void)threads;
  return best;
}

// Decode timing: every cache's engine runs `steps` greedy steps per round, the engines taking
// turns, for kRounds rounds; a row reports the median round. Interleaving makes the ratios
// between rows (the speed-up targets) robust to load that comes and goes on a shared machine.
constexpr int kRounds = 3;

json run_throughput(const Model& m, const std::string& model_path, const Options& o, int threads,
                    Progress& prog) {
  json rows = json::array();
  const std::int64_t record_q =
      std::max<std::int64_t>(1, Policy(o.throughput_policy).query_window());
  // The same file with every matrix dequantized to fp32 at load: how the engine held weights
  // before it kept their GGUF types; its rows are the "before" of the decode speed-ups.
  const auto f32_model = Model::load(model_path, /*f32_weights=*/true);
  const double bandwidth = read_bandwidth(threads);
  for (std::int64_t L : o.throughput_lengths) {
    const auto pieces = passkey_pieces(m, passkey_digits(11, L, 0.5));
    const std::int64_t units = passkey_units(pieces, L);
    std::vector<std::int32_t> ids = pieces.head;
    append_units(ids, pieces, units / 2);
    ids.insert(ids.end(), pieces.key.begin(), pieces.key.end());
    append_units(ids, pieces, units - units / 2);
    ids.insert(ids.end(), pieces.question.begin(), pieces.question.end());
    Engine full(m, full_config(o, record_q));
    const double prefill_s = seconds([&] { full.prefill(ids); });
    if (has(Policy(o.throughput_policy).needs(), kvpolicy::Needs::reconstruction))
      full.reconstruct();  // a kvzip throughput policy: its fork copies the scores
    // kvzip's reconstruction pass against a plain prefill (nothing recorded, nothing
    // compressed) of the same context, on one engine (issue 16's target: <= 1.2x).
    double plain_prefill_s = 0, reconstruct_s = 0;
    if (o.reconstruct_cost) {
      EngineConfig pc = full_config(o, 0);
      pc.record_attention = false;
      Engine plain(m, pc);
      plain_prefill_s = seconds([&] { plain.prefill(ids); });
      reconstruct_s = seconds([&] { plain.reconstruct(); });
    }
    const auto prefill_tokens = static_cast<double>(ids.size());
    prog.advance(static_cast<double>(L) * (1.0 + static_cast<double>(L) / 4096.0),
                 fmt("throughput: prefill %lld", static_cast<long long>(L)));
    struct Cache {
      std::string name;
      Engine engine;
      const Model* model;
      double compress_s = 0;
      std::vector<double> rates{};
    };
    std::vector<Cache> caches;
    caches.push_back({"full cache, fp32 weights", full.with_model(*f32_model), f32_model.get()});
    caches.push_back({"full cache", full.fork(kFull, Budget::ratio(1.0)), &m});
    // The throughput policy at its budget, then the quantized cache alone and after eviction.
    const std::vector<std::pair<std::string, double>> budgeted = {
        {o.throughput_policy, o.throughput_budget},
        {"streaming | int2", 1.0},
        {o.throughput_policy + " | int2", o.throughput_budget}};
    for (const auto& [policy, budget] : budgeted) {
      Engine e = full.fork(policy, Budget::ratio(budget));
      const double c = seconds([&] { e.compress_now(); });
      e.session().shrink_to_fit();
      caches.push_back({budget < 1.0 ? fmt("%s @ %.0f%%", policy.c_str(), budget * 100)
                                     : policy + " (no eviction)",
                        std::move(e), &m, c});
    }
    for (int round = 0; round < kRounds; ++round)
      for (Cache& c : caches) {
        const double s = seconds([&] {
          for (std::int64_t i = 0; i < o.throughput_steps; ++i) {
            const auto lg = c.engine.last_logits();
            c.engine.step(
                static_cast<std::int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin()));
          }
        });
        c.rates.push_back(static_cast<double>(o.throughput_steps) / s);
      }
    for (Cache& c : caches) {
      std::sort(c.rates.begin(), c.rates.end());
      const double tps = c.rates[c.rates.size() / 2];
      // Bytes one decode step reads: every weight matrix once (the embedding lookup reads one
      // row, left out) and the K/V it holds.
      const double wbytes = static_cast<double>(c.model->weights().matrix_bytes());
      const double kv = static_cast<double>(c.engine.session().kv_bytes());
      json row = {{"context", L},
                      {"cache", c.name},
                      {"prefill_tokens_per_s", prefill_tokens / (prefill_s + c.compress_s)},
                      {"compress_ms", c.compress_s * 1e3},
                      {"decode_tokens_per_s", tps},
                      {"decode_tokens_per_s_rounds", c.rates},
                      {"weight_bytes_per_token", wbytes},
                      {"kv_bytes", kv},
                      {"memory_read_gb_per_s", bandwidth}};
      if (o.reconstruct_cost) {
        row["plain_prefill_s"] = plain_prefill_s;
        row["reconstruct_s"] = reconstruct_s;
      }
      rows.push_back(std::move(row));
    }
    prog.advance(static_cast<double>(o.throughput_steps) * 160, "throughput: decode");
  }
  return rows;
}

// ---- running ----------------------------------------------------------------------------

// Fails before anything long runs when a budget would keep fewer tokens than a policy protects
// (e.g. snapkv's 64-token window at 10% of a 512-token prompt), when a corpus is too short for
// the haystacks or the fidelity windows, or when windows would repeat: errors name the flags.
void preflight(const Options& o, const Model& m, const std::vector<Corpus>& corpora) {
  auto check = [](const std::string& spec, std::int64_t keep, std::int64_t tokens,
                  const std::string& what, const char* flag) {
    const Policy p(spec);
    const std::int64_t prot = p.protect(tokens, keep).total(tokens);
    KVP_REQUIRE(keep >= tokens || keep >= prot, "a budget of ", keep, " of the ", tokens,
                " tokens of a ", what, " is below the ", prot, " tokens that '", spec,
                "' protects; raise ", flag, " or the budget");
  };
  auto ratio = [](double b, std::int64_t t) {
    return static_cast<std::int64_t>(std::llround(b * static_cast<double>(t)));
  };
  // The question-agnostic regime compresses the context alone: the prompt minus its question.
  std::int64_t context = o.grid_length;
  if (runs(o, "retrieval") && !corpora.empty())
    for (const auto& t : o.tasks) {
      const auto p = make_retrieval_prompt(m, corpora, o.prompt_set == "eval" ? PromptSet::eval
                                                                              : PromptSet::calibration,
                                           t, o.grid_length, 0);
      context = std::min<std::int64_t>(context, static_cast<std::int64_t>(p.context.size()));
    }
  for (const auto& p : o.policies)
    for (double b : o.budgets) {
      if (runs(o, "fidelity"))
        check(p, ratio(b, o.text_prompt), o.text_prompt, "fidelity prompt", "--text-prompt");
      if (runs(o, "retrieval"))
        check(p, ratio(b, context), context, "retrieval context", "--grid-length");
    }
  if (runs(o, "long"))
    for (const auto& p : o.long_policies)
      for (auto b : o.long_budgets)
        check(p, b, o.long_tokens, "long generation", "--long-budgets");
  std::int64_t longest = 0;
  if (runs(o, "retrieval")) longest = o.grid_length;
  if (runs(o, "curve") && !o.lengths.empty()) longest = std::max(longest, o.lengths.back());
  const std::int64_t window = o.text_prompt + o.text_cont;
  for (const auto& c : corpora) {
    const auto n = static_cast<std::int64_t>(c.ids.size());
    KVP_REQUIRE(n > longest + 2, "corpus ", c.path, " has ", n,
                " tokens, too few for prompts of ", longest, " tokens; lower --lengths");
    if (runs(o, "fidelity"))
      KVP_REQUIRE(n / window >= o.windows, "corpus ", c.path, " holds ", n / window,
                  " windows of ", window, " tokens, fewer than --windows ", o.windows,
                  "; lower --windows, --text-prompt or --text-cont");
  }
}

json run(const Options& o) {
  const std::string model_path =
      o.model.empty() ? kvpolicy::engine::default_model_path() : o.model;
  // Every spec must parse before anything long runs.
  std::int64_t record_q = 1;
  for (const auto& p : o.policies) record_q = std::max(record_q, Policy(p).query_window());
  for (const auto& p : o.long_policies) record_q = std::max(record_q, Policy(p).query_window());
  const Shard shard = parse_shard(o.shard);
  const auto t_load = std::chrono::steady_clock::now();
  const auto model = Model::load(model_path);
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  const Model& m = *model;
#if defined(_OPENMP)
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
#else
  const int threads = 1;
#endif
  const PromptSet set = o.prompt_set == "eval" ? PromptSet::eval : PromptSet::calibration;
  std::vector<Unit> mine;
  {
    const auto all = units(o);
    for (std::size_t k = 0; k < all.size(); ++k)
      if (static_cast<std::int64_t>(k) % shard.count == shard.index) mine.push_back(all[k]);
  }
  const bool throughput = runs(o, "throughput") && shard.index == 0;
  double total = 0;
  for (const auto& u : mine) total += u.cost;
  if (throughput)
    for (auto L : o.throughput_lengths)
      total += static_cast<double>(L) * (1 + static_cast<double>(L) / 4096.0) +
               160.0 * static_cast<double>(o.throughput_steps);
  Progress prog(total);

  // The corpora (tokenized once) when a section reads them, then every check that can fail.
  std::vector<Corpus> corpora;
  if (runs(o, "retrieval") || runs(o, "curve") || runs(o, "fidelity"))
    for (const auto& path : corpus_paths(set)) corpora.push_back(load_corpus(m, path));
  preflight(o, m, corpora);
  std::vector<GridPoint> grid;
  for (const auto& p : o.policies)
    for (double b : o.budgets) grid.push_back({p, b});
  std::vector<Regime> regimes;
  for (const auto& r : o.regimes)
    regimes.push_back(r == "known" ? Regime::question_known : Regime::question_agnostic);
  const EngineConfig cfg = full_config(o, record_q);

  json retrieval = json::array(), fidelity = json::array(), long_gen = json::array();
  std::map<std::string, double> section_s;
  for (const auto& u : mine) {
    const auto t0 = std::chrono::steady_clock::now();
    std::string section;
    if (u.kind == Unit::curve || u.kind == Unit::grid) {
      section = u.kind == Unit::grid ? "retrieval" : "curve";
      const auto p = make_retrieval_prompt(m, corpora, set, u.task, u.length, u.index);
      const auto r = run_retrieval(m, p, u.kind == Unit::grid ? grid : std::vector<GridPoint>{},
                                   regimes, cfg, o.greedy_tokens);
      json rec = {{"task", u.task},
                  {"length", u.length},
                  {"index", u.index},
                  {"tokens", p.context.size() + p.question.size()},
                  {"source", p.source},
                  {"depths", p.depths},
                  {"asked_depth", p.asked_depth},
                  {"answer", p.answer_text},
                  {"full_em", r.full.em},
                  {"full_logp", r.full.logp},
                  {"full_greedy", r.full_greedy},
                  {"full_greedy_match", r.full_greedy_match}};
      json cells = json::array();
      if (u.kind == Unit::grid)
        for (std::size_t ri = 0; ri < regimes.size(); ++ri)
          for (std::size_t g = 0; g < grid.size(); ++g) {
            const auto& s = r.cells[ri][g];
            cells.push_back({{"regime", o.regimes[ri]},
                             {"policy", grid[g].policy},
                             {"budget", grid[g].budget},
                             {"em", s.em},
                             {"logp", s.logp},
                             {"dlogp", s.logp - r.full.logp},
                             {"kept", r.kept_fraction[ri][g]}});
          }
      rec["cells"] = std::move(cells);
      retrieval.push_back(std::move(rec));
      prog.advance(u.cost, fmt("%s %s %lld #%lld", section.c_str(), u.task.c_str(),
                               static_cast<long long>(u.length), static_cast<long long>(u.index)));
    } else if (u.kind == Unit::fidelity) {
      section = "fidelity";
      const auto it = std::find_if(corpora.begin(), corpora.end(),
                                   [&](const Corpus& c) { return c.path == u.task; });
      fidelity.push_back(run_fidelity_unit(m, o, *it, u.index, cfg));
      prog.advance(u.cost, fmt("fidelity %s #%lld", it->name.c_str(),
                               static_cast<long long>(u.index)));
    } else {
      section = "long";
      long_gen.push_back(run_long_unit(m, o, u.index, cfg));
      prog.advance(u.cost, fmt("long generation #%lld", static_cast<long long>(u.index)));
    }
    section_s[section] +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  json thr = json::array();
  if (throughput)
    section_s["throughput"] =
        seconds([&] { thr = run_throughput(m, model_path, o, threads, prog); });
  prog.finish();

  const auto& mc = m.config();
  json out;
  out["schema"] = "kvpolicy-accuracy/2";
  out["config"] = config_json(o);
  out["shards"] = json::array({o.shard.empty() ? "0/1" : o.shard});
  out["model"] = {{"name", mc.name},           {"architecture", mc.architecture},
                  {"layers", mc.n_layers},     {"q_heads", mc.n_head},
                  {"kv_heads", mc.n_head_kv},  {"head_dim", mc.head_dim},
                  {"path", model_path},        {"load_seconds", load_s}};
  out["threads"] = threads;
  out["seconds"] = section_s;
  out["records"] = {{"retrieval", retrieval}, {"fidelity", fidelity}, {"long", long_gen}};
  out["throughput"] = thr;
  return out;
}

json read_json(const std::string& path) {
  std::ifstream f(path);
  KVP_REQUIRE(f.good(), "cannot read ", path);
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    KVP_REQUIRE(false, path, " is not valid JSON: ", e.what());
  }
  return {};
}

// Combines shard outputs: same configuration, disjoint shards of one partition, records
// concatenated (the report sorts them); seconds add up; throughput from the shard that has it.
json merge(const std::vector<std::string>& paths) {
  json out;
  std::set<std::string> seen;
  std::int64_t count = -1;
  for (const auto& path : paths) {
    json j = read_json(path);
    KVP_REQUIRE(j.value("schema", "") == "kvpolicy-accuracy/2", path,
                ": not a kvpolicy_accuracy result (schema kvpolicy-accuracy/2)");
    if (out.is_null()) {
      out = j;
      out["shards"] = json::array();
      out["seconds"] = json::object();
      out["records"] = {{"retrieval", json::array()}, {"fidelity", json::array()},
                        {"long", json::array()}};
      out["throughput"] = json::array();
    }
    KVP_REQUIRE(j["config"] == out["config"], path,
                ": its configuration differs from the first file's (shards must come from the "
                "same command line)");
    for (const char* k : {"name", "architecture", "layers", "q_heads", "kv_heads", "head_dim"})
      KVP_REQUIRE(j["model"][k] == out["model"][k], path, ": another model (", k, " differs)");
    for (const auto& s : j["shards"]) {
      const std::string id = s.get<std::string>();
      const Shard sh = parse_shard(id);
      KVP_REQUIRE(count < 0 || sh.count == count, path, ": shard ", id,
                  " belongs to another partition than ", count);
      count = sh.count;
      KVP_REQUIRE(seen.insert(id).second, path, ": shard ", id, " appears twice");
      out["shards"].push_back(id);
    }
    for (const char* k : {"retrieval", "fidelity", "long"})
      for (const auto& r : j["records"][k]) out["records"][k].push_back(r);
    for (const auto& [k, v] : j["seconds"].items())
      out["seconds"][k] = out["seconds"].value(k, 0.0) + v.get<double>();
    if (!j["throughput"].empty()) out["throughput"] = j["throughput"];
  }
  KVP_REQUIRE(static_cast<std::int64_t>(seen.size()) == count, "--merge: ", seen.size(), " of ",
              count, " shards given; a report needs all of them");
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_args(argc, argv);
    json results = o.merge.empty() ? run(o) : merge(o.merge);
    std::filesystem::create_directories(o.out);
    const bool partial = !o.shard.empty() && parse_shard(o.shard).count > 1;
    std::string md;
    if (!partial) {
      md = render_report(results);  // adds results["summary"]
      std::cout << md << std::flush;
    }
    const std::string name = partial ? "shard-" + std::to_string(parse_shard(o.shard).index) + "-of-" +
                                           std::to_string(parse_shard(o.shard).count) + ".json"
                                     : "results.json";
    const std::string json_path = o.out + "/" + name;
    {
      std::ofstream f(json_path);
      f << results.dump(1) << "\n";
      KVP_REQUIRE(f.good(), "cannot write ", json_path);
    }
    std::cerr << "wrote " << json_path << "\n";
    if (!partial) {
      std::ofstream f(o.out + "/report.md");
      f << md;
    }
    if (!partial && o.plots) {
      // The first Python that has matplotlib (a pyenv or venv python3 may shadow Debian's).
      const std::string cmd =
          std::string("for py in python3 /usr/bin/python3; do if \"$py\" -c 'import matplotlib' "
                      "2>/dev/null; then exec \"$py\" '") +
          KVPOLICY_PLOT_SCRIPT + "' '" + json_path + "' '" + o.out + "'; fi; done; exit 1";
      if (std::system(cmd.c_str()) != 0)
        std::cerr << "plots: `" << cmd << "` failed (needs python3-matplotlib; "
                  << "scripts/setup.sh installs it); the tables and JSON are complete\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvpolicy_accuracy: %s\n", e.what());
    return 1;
  }
}
