// kvpolicy_accuracy: accuracy and throughput of KV-cache policies on a real model (default
// SmolLM2-135M-Instruct, GGUF) through the reference engine. See --help and tasks.hpp.
//
// Sections (each can be skipped):
//   passkey     full-cache accuracy over lengths x depths, then the policy x budget grid at
//               --grid-length, forking each prompt's full-cache state
//   fidelity    teacher-forced KL / top-1 / NLL change on licence texts
//   decode      decode-time policies over a long generation, against the full cache
//   throughput  prefill and decode tokens/s and KV bytes at 4K and 8K (full cache vs a budget)
// Output: markdown on stdout, <out>/results.json, PNG plots from plot.py (matplotlib).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "report.hpp"
#include "tasks.hpp"

namespace {

using namespace kvbench;
using kvpolicy::Budget;
using kvpolicy::Policy;
using kvpolicy::engine::EngineConfig;

constexpr const char* kFull = "streaming";  // with Budget::ratio(1.0): keeps every token

struct Options {
  std::string model, out = "accuracy-results";
  int threads = 0;
  bool quick = false, plots = true;
  std::vector<std::string> policies = {
      "streaming", "h2o", "snapkv", "tova", "knorm", "keydiff", "snapkv | pyramid",
      "snapkv | adakv", "snapkv | ams",
      "snapkv | depthkv(profile=" KVPOLICY_PROFILE_DIR "/SmolLM2-135M-Instruct.snapkv-0.2.json)"};
  std::vector<double> budgets = {0.1, 0.2, 0.3};
  // Decode-time task: the scorers and AMS only. Its prompt (60 tokens) is below every budget, so
  // the layer and head allocators would split budgets the cache never reaches: their rows equal
  // snapkv's (measured: identical to 3 decimals). Empty: the --policies list.
  std::vector<std::string> decode_policies = {"streaming", "h2o", "snapkv", "tova",
                                              "knorm",     "keydiff", "snapkv | ams"};
  std::vector<std::int64_t> lengths = {1024, 2048, 4096, 8192};
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};  // at lengths <= grid length
  std::vector<double> long_depths = {0.0, 0.5, 1.0};         // at longer lengths, up to 4K
  std::vector<double> longest_depths = {0.0, 1.0};           // beyond 4K (time budget)
  std::int64_t grid_length = 2048;
  std::vector<std::string> texts = {"/usr/share/common-licenses/GPL-3",
                                    "/usr/share/common-licenses/MPL-2.0"};
  std::int64_t text_prompt = 1024, text_cont = 128;
  std::int64_t decode_tokens = 256;
  std::vector<std::int64_t> decode_budgets = {96, 192};  // tokens per KV head
  std::int64_t decode_interval = 16;  // for policies that are not decode-time by nature
  std::vector<std::int64_t> throughput_lengths = {4096, 8192};
  double throughput_budget = 0.2;
  std::string throughput_policy = "snapkv";
  std::int64_t throughput_steps = 16;
  std::set<std::string> skip;
};

const char* kUsage = R"(usage: kvpolicy_accuracy [options]

Accuracy and throughput of KV-cache policies on a real model through kvpolicy's reference
engine. Prints markdown tables, writes <out>/results.json and PNG plots (<out>/*.png).

  --model PATH         GGUF model (default: $KVPOLICY_MODEL or the bundled SmolLM2-135M-Instruct
                       in ~/.cache/kvpolicy; scripts/fetch_model.sh fetches it)
  --out DIR            output folder (default accuracy-results)
  --threads N          OpenMP threads (default: all cores)
  --policies LIST      policy specs separated by ';' (default: streaming, h2o, snapkv, tova,
                       knorm, keydiff, then snapkv with each allocator: pyramid, adakv, ams,
                       depthkv with the bundled model's profile)
  --suite NAME         a preset comparison instead of the default run (later flags still apply):
                         allocators  snapkv and h2o, each alone and with pyramid, depthkv
                                     (bundled profile; power 1 and 0.25), adakv, ams; passkey
                                     grid at 2048 and fidelity at 10/20/30%; no decode or
                                     throughput section
                         mergers     snapkv and h2o: eviction only, nearest, semantic(tau=0.9),
                                     semantic(tau=0.5); snapkv | ams | semantic; passkey grid,
                                     fidelity and decode-time task; no throughput section
                         quant       snapkv alone and with int4, kivi (2-bit), int2, at 20% and
                                     100% (no eviction); passkey grid and fidelity
  --budgets LIST       kept fraction of the prompt, comma-separated (default 0.1,0.2,0.3)
  --lengths LIST       passkey prompt lengths in tokens for the full-cache curve
                       (default 1024,2048,4096,8192)
  --grid-length N      passkey length of the policy x budget grid (default 2048; must be one of
                       --lengths)
  --decode-policies L  policy specs of the decode-time task, ';'-separated (default: the scorers
                       and snapkv | ams; with --policies and without this flag: that list)
  --decode-tokens N    tokens generated in the decode-time task (default 256)
  --decode-budgets L   decode-time budgets in tokens per KV head (default 96,192)
  --decode-interval N  tokens between decode-time compressions for policies other than H2O,
                       which evicts at every step (default 16)
  --skip LIST          sections to skip: passkey,fidelity,decode,throughput
  --quick              a small smoke run (seconds; CI)
  --no-plots           do not run plot.py
  --help               this text
)";

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep))
    if (!cur.empty()) out.push_back(cur);
  return out;
}

template <class T>
std::vector<T> parse_list(const std::string& flag, const std::string& s) {
  std::vector<T> out;
  for (const auto& item : split(s, ',')) {
    std::size_t used = 0;
    T v{};
    try {
      if constexpr (std::is_floating_point_v<T>)
        v = static_cast<T>(std::stod(item, &used));
      else
        v = static_cast<T>(std::stoll(item, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    KVP_REQUIRE(used == item.size(), flag, ": '", item, "' is not a number");
    out.push_back(v);
  }
  KVP_REQUIRE(!out.empty(), flag, ": empty list");
  return out;
}

Options parse_args(int argc, char** argv) {
  Options o;
  auto need = [&](int& i) -> std::string {
    KVP_REQUIRE(i + 1 < argc, argv[i], " needs a value (see --help)");
    return argv[++i];
  };
  bool quick = false, decode_policies_set = false, policies_set = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    if (a == "--suite") {
      KVP_REQUIRE(i + 1 < argc, "--suite needs a value (see --help)");
      const std::string suite = argv[i + 1];
      KVP_REQUIRE(suite == "allocators" || suite == "mergers" || suite == "quant",
                  "--suite: unknown suite '", suite, "' (allocators, mergers, quant)");
      o.policies.clear();
      if (suite == "allocators") {
        for (const char* scorer : {"snapkv", "h2o"})
          for (const char* chain :
               {"", " | pyramid", " | depthkv(profile=" KVPOLICY_PROFILE_DIR
                    "/SmolLM2-135M-Instruct.snapkv-0.2.json)",
                " | depthkv(profile=" KVPOLICY_PROFILE_DIR
                "/SmolLM2-135M-Instruct.snapkv-0.2.json,power=0.25)",
                " | adakv", " | ams"})
            o.policies.push_back(std::string(scorer) + chain);
        o.skip = {"decode", "throughput"};
      } else if (suite == "quant") {
        for (const char* q : {"", " | int4", " | kivi", " | int2"})
          o.policies.push_back(std::string("snapkv") + q);
        o.budgets = {0.2, 1.0};
        o.skip = {"decode", "throughput"};
      } else {
        for (const char* scorer : {"snapkv", "h2o"})
          for (const char* merger : {"", " | nearest", " | semantic(tau=0.9)",
                                     " | semantic(tau=0.5)"})
            o.policies.push_back(std::string(scorer) + merger);
        o.policies.push_back("snapkv | ams | semantic(tau=0.9)");
        o.skip = {"throughput"};
      }
      o.decode_policies.clear();
      o.lengths = {o.grid_length};
    }
  }
  if (quick) {
    o.quick = true;
    o.policies = {"streaming", "h2o", "snapkv(window=16)",
                  "snapkv(window=16) | depthkv(profile=" KVPOLICY_PROFILE_DIR
                  "/SmolLM2-135M-Instruct.snapkv-0.2.json) | adakv"};
    o.budgets = {0.3, 0.5};
    o.lengths = {512};
    o.depths = {0.0, 1.0};
    o.grid_length = 512;
    o.texts = {"/usr/share/common-licenses/Apache-2.0"};
    o.text_prompt = 256;
    o.text_cont = 24;
    o.decode_policies.clear();
    o.decode_tokens = 32;
    o.decode_budgets = {48};
    o.decode_interval = 8;
    o.throughput_lengths = {512};
    o.throughput_steps = 4;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--quick") {
    } else if (a == "--suite") {
      ++i;  // applied above
    } else if (a == "--model") {
      o.model = need(i);
    } else if (a == "--out") {
      o.out = need(i);
    } else if (a == "--threads") {
      o.threads = static_cast<int>(parse_list<std::int64_t>(a, need(i)).at(0));
      KVP_REQUIRE(o.threads >= 0, "--threads must be >= 0");
    } else if (a == "--policies") {
      o.policies = split(need(i), ';');
      KVP_REQUIRE(!o.policies.empty(), "--policies: empty list");
      policies_set = true;
    } else if (a == "--decode-policies") {
      o.decode_policies = split(need(i), ';');
      KVP_REQUIRE(!o.decode_policies.empty(), "--decode-policies: empty list");
      decode_policies_set = true;
    } else if (a == "--budgets") {
      o.budgets = parse_list<double>(a, need(i));
      for (double b : o.budgets)
        KVP_REQUIRE(b > 0 && b <= 1, "--budgets: ", b, " is not a fraction in (0, 1]");
    } else if (a == "--lengths") {
      o.lengths = parse_list<std::int64_t>(a, need(i));
    } else if (a == "--grid-length") {
      o.grid_length = parse_list<std::int64_t>(a, need(i)).at(0);
    } else if (a == "--decode-tokens") {
      o.decode_tokens = parse_list<std::int64_t>(a, need(i)).at(0);
      KVP_REQUIRE(o.decode_tokens > 0, "--decode-tokens must be positive");
    } else if (a == "--decode-budgets") {
      o.decode_budgets = parse_list<std::int64_t>(a, need(i));
      for (auto b : o.decode_budgets) KVP_REQUIRE(b > 0, "--decode-budgets: ", b, " is not positive");
    } else if (a == "--decode-interval") {
      o.decode_interval = parse_list<std::int64_t>(a, need(i)).at(0);
      KVP_REQUIRE(o.decode_interval > 0, "--decode-interval must be positive");
    } else if (a == "--skip") {
      for (const auto& s : split(need(i), ',')) {
        KVP_REQUIRE(s == "passkey" || s == "fidelity" || s == "decode" || s == "throughput",
                    "--skip: unknown section '", s, "' (passkey, fidelity, decode, throughput)");
        o.skip.insert(s);
      }
    } else if (a == "--no-plots") {
      o.plots = false;
    } else {
      KVP_REQUIRE(false, "unknown argument '", a, "' (see --help)");
    }
  }
  if (policies_set && !decode_policies_set) o.decode_policies.clear();
  if (o.decode_policies.empty()) o.decode_policies = o.policies;
  std::sort(o.lengths.begin(), o.lengths.end());
  for (auto L : o.lengths) KVP_REQUIRE(L > 0, "--lengths: ", L, " is not positive");
  KVP_REQUIRE(std::find(o.lengths.begin(), o.lengths.end(), o.grid_length) != o.lengths.end(),
              "--grid-length ", o.grid_length, " is not one of --lengths");
  std::sort(o.budgets.begin(), o.budgets.end());
  return o;
}

std::string pct(double x) { return fmt("%.0f%%", 100 * x); }

// A spec as shown in tables and plots: the bundled profile folder left out.
std::string label(std::string spec) {
  const std::string dir = std::string(KVPOLICY_PROFILE_DIR) + "/";
  for (std::size_t at; (at = spec.find(dir)) != std::string::npos;) spec.erase(at, dir.size());
  return spec;
}
// Text inside a markdown table cell: pipes escaped.
std::string escape_pipes(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out;
}
// A spec inside a markdown table cell: code span, pipes escaped.
std::string cell(const std::string& spec) {
  std::string out = "`";
  for (char c : label(spec)) {
    if (c == '|') out += '\\';
    out += c;
  }
  return out + "`";
}

// ---- passkey ----------------------------------------------------------------------------

struct PasskeyRow {
  std::int64_t length = 0, tokens = 0;
  double depth = 0;
  std::string key, answer;
  bool correct = false;
};
struct GridCell {
  std::string policy;
  double budget = 0;
  int correct = 0, total = 0;
};
struct PrefillTiming {
  std::int64_t tokens = 0;
  double seconds = 0;
};

struct PasskeyResults {
  std::vector<PasskeyRow> full;
  std::vector<GridCell> grid;
  std::map<std::int64_t, PrefillTiming> prefill;  // length -> depth-0 prompt prefill
  // Full-cache state after the depth-0 prompt, kept for the throughput section's lengths.
  std::map<std::int64_t, std::shared_ptr<Engine>> kept;
};

EngineConfig full_config(const Options& o, std::int64_t record_queries) {
  EngineConfig c;
  c.policy = kFull;
  c.budget = Budget::ratio(1.0);
  c.threads = o.threads;
  c.record_queries = record_queries;
  c.record_attention = true;
  return c;
}

// Per length: the shared prefix (head + filler before the shallowest key) is prefilled once and
// extended depth by depth; each depth's prompt is the trunk forked and extended with its own
// key, remaining filler and question. The full-cache answer and every (policy, budget) fork
// then decode together in one batch.
PasskeyResults run_passkey(const Model& m, const Options& o, std::int64_t record_q,
                           Progress& prog) {
  PasskeyResults r;
  for (const auto& p : o.policies)
    for (double b : o.budgets) r.grid.push_back({p, b, 0, 0});
  for (std::int64_t L : o.lengths) {
    auto depths = L <= o.grid_length ? o.depths : L <= 4096 ? o.long_depths : o.longest_depths;
    std::sort(depths.begin(), depths.end());
    const auto probe = passkey_pieces(m, "00000");
    const std::int64_t units = passkey_units(probe, L);
    std::unique_ptr<Engine> trunk;
    std::int64_t trunk_units = 0;
    for (double depth : depths) {
      const auto before = static_cast<std::int64_t>(std::lround(depth * static_cast<double>(units)));
      const auto pieces = passkey_pieces(m, passkey_digits(7, L, depth));
      KVP_REQUIRE(pieces.head == probe.head && pieces.unit == probe.unit &&
                      pieces.question == probe.question,
                  "passkey: prompt pieces depend on the key");
      std::vector<std::int32_t> more;
      if (!trunk) {
        more = pieces.head;
        append_units(more, pieces, before);
        trunk = std::make_unique<Engine>(m, full_config(o, record_q));
        trunk->prefill(more);
      } else if (before > trunk_units) {
        append_units(more, pieces, before - trunk_units);
        trunk->extend(more);
      }
      trunk_units = before;
      std::vector<std::int32_t> rest = pieces.key;
      append_units(rest, pieces, units - before);
      rest.insert(rest.end(), pieces.question.begin(), pieces.question.end());
      Engine full = trunk->fork(kFull, Budget::ratio(1.0));
      const double t = seconds([&] { full.extend(rest); });
      const std::int64_t tokens = full.position();
      if (depth == depths.front() && before == 0) {
        r.prefill[L] = {tokens, t};
        if (std::find(o.throughput_lengths.begin(), o.throughput_lengths.end(), L) !=
                o.throughput_lengths.end() &&
            !o.skip.count("throughput"))
          r.kept[L] = std::make_shared<Engine>(full.fork(kFull, Budget::ratio(1.0)));
      }
      prog.advance(static_cast<double>(rest.size()) * (1.0 + static_cast<double>(tokens) / 4096.0),
                   fmt("passkey %lld tokens, depth %.0f%%", static_cast<long long>(tokens),
                       depth * 100));

      // Full-cache answer plus, at the grid length, every (policy, budget) fork.
      std::vector<std::unique_ptr<Engine>> forks;
      forks.push_back(std::make_unique<Engine>(full.fork(kFull, Budget::ratio(1.0))));
      const bool grid = L == o.grid_length;
      if (grid)
        for (const auto& c : r.grid) {
          forks.push_back(std::make_unique<Engine>(full.fork(c.policy, Budget::ratio(c.budget))));
          forks.back()->compress_now();
          forks.back()->session().shrink_to_fit();
          prog.advance(40, fmt("passkey grid: %s @ %.0f%%", c.policy.c_str(), c.budget * 100));
        }
      std::vector<Engine*> es;
      for (auto& f : forks) es.push_back(f.get());
      const auto outs = generate_batch(es, 16);
      for (std::size_t i = 0; i < outs.size(); ++i) {
        const std::string text = m.tokenizer().decode(outs[i]);
        const bool ok = first_five_digits(text) == pieces.key_digits;
        if (i == 0) {
          r.full.push_back({L, tokens, depth, pieces.key_digits, text, ok});
        } else {
          r.grid[i - 1].correct += ok;
          r.grid[i - 1].total += 1;
        }
      }
      prog.advance(static_cast<double>(es.size()) * 8, "passkey answers");
    }
  }
  return r;
}

// ---- fidelity ---------------------------------------------------------------------------

struct FidelityCell {
  std::string policy;
  double budget = 0;
  Fidelity f;  // averaged over texts
  int texts = 0;
};
struct FidelityResults {
  std::vector<std::pair<std::string, double>> full_nll;  // text -> full-cache NLL
  std::vector<FidelityCell> grid;
};

FidelityResults run_fidelity(const Model& m, const Options& o, std::int64_t record_q,
                             Progress& prog) {
  FidelityResults r;
  for (const auto& p : o.policies)
    for (double b : o.budgets) r.grid.push_back({p, b, {}, 0});
  for (const auto& path : o.texts) {
    const auto text = load_fidelity_text(m, path, o.text_prompt, o.text_cont);
    Engine full(m, full_config(o, record_q));
    full.prefill(text.prompt);
    Engine ref_engine = full.fork(kFull, Budget::ratio(1.0));
    const Reference ref = reference_run(ref_engine, text.continuation);
    r.full_nll.emplace_back(text.name, ref.nll);
    prog.advance(static_cast<double>(o.text_prompt + o.text_cont), "fidelity: " + text.name);
    std::vector<std::unique_ptr<Engine>> decode_forks;
    std::vector<std::size_t> decode_cells;
    for (std::size_t i = 0; i < r.grid.size(); ++i) {
      auto& c = r.grid[i];
      auto e = std::make_unique<Engine>(full.fork(c.policy, Budget::ratio(c.budget)));
      e->compress_now();
      e->session().shrink_to_fit();
      if (e->session().decode_interval() > 0) {
        decode_forks.push_back(std::move(e));
        decode_cells.push_back(i);
        continue;
      }
      const Fidelity f = compare_run(*e, text.continuation, ref);
      c.f.kl += f.kl;
      c.f.top1 += f.top1;
      c.f.nll += f.nll;
      c.f.delta_nll += f.delta_nll;
      c.texts += 1;
      prog.advance(static_cast<double>(o.text_cont) * 1.2,
                   fmt("fidelity %s: %s @ %.0f%%", text.name.c_str(), c.policy.c_str(),
                       c.budget * 100));
    }
    if (!decode_forks.empty()) {
      std::vector<Engine*> es;
      for (auto& e : decode_forks) es.push_back(e.get());
      const auto fs = compare_run_batch(es, text.continuation, ref);
      for (std::size_t k = 0; k < fs.size(); ++k) {
        auto& c = r.grid[decode_cells[k]];
        c.f.kl += fs[k].kl;
        c.f.top1 += fs[k].top1;
        c.f.nll += fs[k].nll;
        c.f.delta_nll += fs[k].delta_nll;
        c.texts += 1;
      }
      prog.advance(static_cast<double>(o.text_cont) * 1.2 * static_cast<double>(es.size()),
                   "fidelity " + text.name + ": decode-time policies");
    }
  }
  for (auto& c : r.grid)
    if (c.texts > 0) {
      const double n = c.texts;
      c.f.kl /= n;
      c.f.top1 /= n;
      c.f.nll /= n;
      c.f.delta_nll /= n;
    }
  return r;
}

// ---- decode-time ------------------------------------------------------------------------

struct DecodeCell {
  std::string policy;
  std::int64_t budget = 0;  // tokens per KV head
  Fidelity f;
  std::int64_t kv_bytes = 0;
};
struct DecodeResults {
  std::int64_t prompt_tokens = 0, generated = 0;
  std::string sample;  // start of the full-cache generation
  std::vector<DecodeCell> cells;
  std::int64_t interval = 0;
};

DecodeResults run_decode(const Model& m, const Options& o, std::int64_t record_q,
                         Progress& prog) {
  DecodeResults r;
  const auto& tok = m.tokenizer();
  const std::string prompt = tok.apply_chat_template(
      {{"user",
        "Write a long, detailed essay about the history of printing, from woodblocks in China "
        "to the Gutenberg press and the modern newspaper. Use several paragraphs."}},
      true);
  const auto ids = tok.encode(prompt, true, false);
  r.prompt_tokens = static_cast<std::int64_t>(ids.size());
  Engine full(m, full_config(o, record_q));
  full.prefill(ids);
  Engine gen = full.fork(kFull, Budget::ratio(1.0));
  // The full cache's own greedy generation, then teacher-forced through every policy.
  std::vector<std::int32_t> cont;
  const double t = seconds([&] { cont = gen.generate(o.decode_tokens); });
  (void)t;
  r.generated = static_cast<std::int64_t>(cont.size());
  r.sample = tok.decode(std::span<const std::int32_t>(cont).first(std::min<std::size_t>(cont.size(), 48)));
  prog.advance(static_cast<double>(cont.size()), "decode: full-cache generation");
  Engine ref_engine = full.fork(kFull, Budget::ratio(1.0));
  const Reference ref = reference_run(ref_engine, cont);
  std::vector<std::unique_ptr<Engine>> forks;
  r.interval = o.decode_interval;
  for (const auto& p : o.decode_policies) {
    // H2O evicts at every step (its own algorithm); the others every `interval` tokens.
    const std::int64_t interval = Policy(p).decode_time() ? 0 : o.decode_interval;
    for (std::int64_t b : o.decode_budgets) {
      forks.push_back(std::make_unique<Engine>(full.fork(p, Budget::tokens(b), interval)));
      forks.back()->compress_now();
      r.cells.push_back({p, b, {}, 0});
    }
  }
  if (!forks.empty()) {
    std::vector<Engine*> es;
    for (auto& e : forks) es.push_back(e.get());
    const auto fs = compare_run_batch(es, cont, ref);
    for (std::size_t i = 0; i < fs.size(); ++i) {
      r.cells[i].f = fs[i];
      r.cells[i].kv_bytes = static_cast<std::int64_t>(es[i]->session().kv_bytes());
    }
  }
  prog.advance(static_cast<double>(cont.size()) * 1.5, "decode: policies");
  return r;
}

// ---- throughput -------------------------------------------------------------------------

struct ThroughputRow {
  std::int64_t context = 0;
  std::string config;  // "full" or "<policy> @ <budget>"
  double prefill_tps = 0, compress_ms = 0, decode_tps = 0;
  std::int64_t kv_bytes = 0;
};

std::vector<ThroughputRow> run_throughput(const Model& m, const Options& o,
                                          const PasskeyResults* pk, Progress& prog) {
  std::vector<ThroughputRow> rows;
  for (std::int64_t L : o.throughput_lengths) {
    std::shared_ptr<Engine> full;
    double prefill_s = 0;
    std::int64_t prefill_tokens = 0;
    if (pk && pk->kept.count(L)) {  // prefilled and timed by the passkey section (depth 0)
      full = pk->kept.at(L);
      prefill_s = pk->prefill.at(L).seconds;
      prefill_tokens = pk->prefill.at(L).tokens;
    } else {
      const auto pieces = passkey_pieces(m, passkey_digits(11, L, 0.5));
      const std::int64_t units = passkey_units(pieces, L);
      std::vector<std::int32_t> ids = pieces.head;
      append_units(ids, pieces, units / 2);
      ids.insert(ids.end(), pieces.key.begin(), pieces.key.end());
      append_units(ids, pieces, units - units / 2);
      ids.insert(ids.end(), pieces.question.begin(), pieces.question.end());
      full = std::make_shared<Engine>(
          m, full_config(o, std::max<std::int64_t>(1, Policy(o.throughput_policy).query_window())));
      prefill_s = seconds([&] { full->prefill(ids); });
      prefill_tokens = static_cast<std::int64_t>(ids.size());
    }
    if (!(pk && pk->kept.count(L)))
      prog.advance(static_cast<double>(L) * (1.0 + static_cast<double>(L) / 8192.0),
                   fmt("throughput: prefill %lld", static_cast<long long>(L)));
    auto decode_rate = [&](Engine& e) {
      std::int32_t t = 0;
      const double s = seconds([&] {
        for (std::int64_t i = 0; i < o.throughput_steps; ++i) {
          const auto lg = e.last_logits();
          t = static_cast<std::int32_t>(std::max_element(lg.begin(), lg.end()) - lg.begin());
          e.step(t);
        }
      });
      return static_cast<double>(o.throughput_steps) / s;
    };
    {
      Engine e = full->fork(kFull, Budget::ratio(1.0));
      ThroughputRow row{L, "full cache", static_cast<double>(prefill_tokens) / prefill_s, 0, 0, 0};
      row.decode_tps = decode_rate(e);
      row.kv_bytes = static_cast<std::int64_t>(e.session().kv_bytes());
      rows.push_back(row);
    }
    // Budgeted rows: the throughput policy at its budget, then the quantized cache alone and
    // combined with that eviction.
    std::vector<std::pair<std::string, double>> budgeted = {
        {o.throughput_policy, o.throughput_budget},
        {"streaming | int2", 1.0},
        {o.throughput_policy + " | int2", o.throughput_budget}};
    for (const auto& [policy, budget] : budgeted) {
      Engine e = full->fork(policy, Budget::ratio(budget));
      const double c = seconds([&] { e.compress_now(); });
      e.session().shrink_to_fit();
      ThroughputRow row{L, budget < 1.0 ? fmt("%s @ %.0f%%", policy.c_str(), budget * 100)
                                        : policy + " (no eviction)",
                        static_cast<double>(prefill_tokens) / (prefill_s + c), c * 1e3, 0, 0};
      row.decode_tps = decode_rate(e);
      row.kv_bytes = static_cast<std::int64_t>(e.session().kv_bytes());
      rows.push_back(row);
    }
    prog.advance(static_cast<double>(o.throughput_steps) * 40, "throughput: decode");
  }
  return rows;
}

// ---- report -----------------------------------------------------------------------------

double grid_accuracy(const GridCell& c) { return c.total ? double(c.correct) / c.total : 0.0; }

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_args(argc, argv);
    const std::string model_path = o.model.empty() ? kvpolicy::engine::default_model_path() : o.model;
    // Every spec must parse before anything long runs.
    std::int64_t record_q = 1;
    for (const auto& p : o.policies) record_q = std::max(record_q, Policy(p).query_window());
    for (const auto& p : o.decode_policies)
      record_q = std::max(record_q, Policy(p).query_window());
    // The throughput section forks the passkey prefills into its policy too.
    record_q = std::max(record_q, Policy(o.throughput_policy).query_window());
    const auto t_load = std::chrono::steady_clock::now();
    const auto model = Model::load(model_path);
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
#if defined(_OPENMP)
    const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
#else
    const int threads = 1;
#endif
    std::filesystem::create_directories(o.out);

    // Rough cost model for the progress bar (units ~ prompt tokens).
    double total = 0;
    if (!o.skip.count("passkey"))
      for (auto L : o.lengths) {
        const auto nd = static_cast<double>(
            (L <= o.grid_length ? o.depths : L <= 4096 ? o.long_depths : o.longest_depths).size());
        total += 0.6 * nd * static_cast<double>(L) * (1.0 + static_cast<double>(L) / 4096.0);
        total += nd * 8 * (1 + (L == o.grid_length ? o.policies.size() * o.budgets.size() : 0));
        if (L == o.grid_length) total += nd * 40.0 * o.policies.size() * o.budgets.size();
      }
    if (!o.skip.count("fidelity"))
      total += static_cast<double>(o.texts.size()) *
               (static_cast<double>(o.text_prompt + o.text_cont) +
                1.2 * static_cast<double>(o.text_cont * o.policies.size() * o.budgets.size()));
    if (!o.skip.count("decode"))
      total += static_cast<double>(o.decode_tokens) * 2.5;
    if (!o.skip.count("throughput"))
      for (auto L : o.throughput_lengths) {
        const bool reused = !o.skip.count("passkey") &&
                            std::find(o.lengths.begin(), o.lengths.end(), L) != o.lengths.end();
        total += (reused ? 0.0 : static_cast<double>(L) * (1.0 + static_cast<double>(L) / 8192.0)) +
                 static_cast<double>(o.throughput_steps) * 40;
      }
    Progress prog(total);

    std::optional<PasskeyResults> pk;
    std::optional<FidelityResults> fid;
    std::optional<DecodeResults> dec;
    std::vector<ThroughputRow> thr;
    double pk_s = 0, fid_s = 0, dec_s = 0, thr_s = 0;
    if (!o.skip.count("passkey")) pk_s = seconds([&] { pk = run_passkey(*model, o, record_q, prog); });
    if (!o.skip.count("fidelity"))
      fid_s = seconds([&] { fid = run_fidelity(*model, o, record_q, prog); });
    if (!o.skip.count("decode")) dec_s = seconds([&] { dec = run_decode(*model, o, record_q, prog); });
    if (!o.skip.count("throughput"))
      thr_s = seconds([&] { thr = run_throughput(*model, o, pk ? &*pk : nullptr, prog); });
    prog.finish();

    // ---- markdown ----
    std::ostringstream md;
    const auto& mc = model->config();
    md << "# kvpolicy accuracy benchmark" << (o.quick ? " (--quick)" : "") << "\n\n";
    md << fmt("Model: %s (%s, %lld layers, %lld query / %lld KV heads, head_dim %lld), loaded in "
              "%.1f s from %s. Threads: %d.\n\n",
              mc.name.c_str(), mc.architecture.c_str(), static_cast<long long>(mc.n_layers),
              static_cast<long long>(mc.n_head), static_cast<long long>(mc.n_head_kv),
              static_cast<long long>(mc.head_dim), load_s, model_path.c_str(), threads);
    if (pk) {
      md << "## Passkey retrieval\n\nFull cache, accuracy over key depths (greedy answer must "
            "contain the 5-digit key):\n\n";
      std::vector<std::vector<std::string>> rows;
      for (auto L : o.lengths) {
        int ok = 0, n = 0;
        std::string detail;
        std::int64_t tokens = 0;
        for (const auto& row : pk->full)
          if (row.length == L) {
            ok += row.correct;
            ++n;
            tokens = std::max(tokens, row.tokens);
            detail += fmt("%s%.0f%%:%s", detail.empty() ? "" : " ", row.depth * 100,
                          row.correct ? "ok" : "miss");
          }
        rows.push_back({std::to_string(L), std::to_string(tokens), fmt("%d/%d", ok, n),
                        pct(n ? double(ok) / n : 0), detail});
      }
      md << markdown_table({"length", "tokens (max)", "correct", "accuracy", "by depth"}, rows);
      int ok = 0, n = 0;
      for (const auto& row : pk->full)
        if (row.length == o.grid_length) ok += row.correct, ++n;
      md << fmt("\nPolicy x budget at %lld tokens (%d prompts; budget = kept fraction of the "
                "prompt; full cache: %d/%d%s):\n\n",
                static_cast<long long>(o.grid_length), n, ok, n,
                n && ok * 10 < n * 9 ? ", below 90%: choose a shorter --grid-length" : "");
      std::vector<std::string> header = {"policy"};
      for (double b : o.budgets) header.push_back(pct(b));
      rows.clear();
      for (const auto& p : o.policies) {
        std::vector<std::string> row = {cell(p)};
        for (const auto& c : pk->grid)
          if (c.policy == p) row.push_back(pct(grid_accuracy(c)));
        rows.push_back(row);
      }
      md << markdown_table(header, rows) << "\n";
    }
    if (fid) {
      md << "## Teacher-forced fidelity\n\n";
      md << fmt("Prompt %lld tokens, continuation %lld tokens of: ",
                static_cast<long long>(o.text_prompt), static_cast<long long>(o.text_cont));
      for (std::size_t i = 0; i < fid->full_nll.size(); ++i)
        md << fmt("%s%s (full-cache NLL %.3f)", i ? ", " : "", fid->full_nll[i].first.c_str(),
                  fid->full_nll[i].second);
      md << ". Cells: mean KL(full || policy) in nats / top-1 agreement with the full cache / NLL "
            "change.\n\n";
      std::vector<std::string> header = {"policy"};
      for (double b : o.budgets) header.push_back(pct(b));
      std::vector<std::vector<std::string>> rows;
      for (const auto& p : o.policies) {
        std::vector<std::string> row = {cell(p)};
        for (const auto& c : fid->grid)
          if (c.policy == p)
            row.push_back(fmt("%.3f / %.0f%% / %+.3f", c.f.kl, 100 * c.f.top1, c.f.delta_nll));
        rows.push_back(row);
      }
      md << markdown_table(header, rows) << "\n";
    }
    if (dec) {
      md << fmt("## Decode-time compression\n\nPrompt %lld tokens; the full cache generates %lld "
                "tokens greedily, which are then teacher-forced through each policy compressing "
                "back to its budget (tokens per KV head) while decoding: H2O at every step, the "
                "others every %lld tokens. Token agreement: the policy's greedy choice equals the "
                "full cache's.%s\n\n",
                static_cast<long long>(dec->prompt_tokens), static_cast<long long>(dec->generated),
                static_cast<long long>(dec->interval),
                o.decode_policies == o.policies
                    ? ""
                    : " The layer and head allocators are left out: the prompt is below every "
                      "budget, so they split budgets the cache never reaches and their rows would "
                      "equal the bare scorer's (--decode-policies adds them).");
      std::vector<std::vector<std::string>> rows;
      for (const auto& c : dec->cells)
        rows.push_back({cell(c.policy), std::to_string(c.budget), pct(c.f.top1),
                        fmt("%.3f", c.f.kl), fmt("%+.3f", c.f.delta_nll),
                        fmt("%.2f", static_cast<double>(c.kv_bytes) / (1 << 20))});
      md << markdown_table({"policy", "budget", "token agreement", "KL", "NLL change", "KV MiB"},
                           rows);
      md << "\n";
    }
    if (!thr.empty()) {
      md << "## Throughput\n\nPrefill (chunks of 512 tokens) and greedy decode on this machine; "
            "a compressed row's prefill includes its compression (and, with int2, the packing "
            "of the survivors; int2 = 2-bit rotated codes, 32-token groups, the newest 128 "
            "tokens in fp32). KV MiB: bytes of K and V held (fp32, or packed tiles + scales + "
            "norms + residual window).\n\n";
      std::vector<std::vector<std::string>> rows;
      for (const auto& t : thr)
        rows.push_back({std::to_string(t.context), escape_pipes(t.config), fmt("%.0f", t.prefill_tps),
                        t.compress_ms > 0 ? fmt("%.0f", t.compress_ms) : "-",
                        fmt("%.1f", t.decode_tps),
                        fmt("%.1f", static_cast<double>(t.kv_bytes) / (1 << 20))});
      md << markdown_table({"context", "cache", "prefill tok/s", "compress ms", "decode tok/s",
                            "KV MiB"},
                           rows)
         << "\n";
    }
    md << fmt("Section times: passkey %.0f s, fidelity %.0f s, decode %.0f s, throughput %.0f s.\n",
              pk_s, fid_s, dec_s, thr_s);
    std::cout << md.str() << std::flush;

    // ---- JSON ----
    Json j;
    j.begin_object();
    j.value("model", mc.name).value("model_path", model_path).value("threads", threads);
    j.value("quick", o.quick);
    j.begin_array("policies");
    for (const auto& p : o.policies) j.value(nullptr, p);
    j.end_array();
    j.begin_array("budgets");
    for (double b : o.budgets) j.value(nullptr, b);
    j.end_array();
    if (pk) {
      j.begin_object("passkey").value("grid_length", o.grid_length);
      j.begin_array("full_cache");
      for (const auto& r : pk->full)
        j.begin_object()
            .value("length", r.length)
            .value("tokens", r.tokens)
            .value("depth", r.depth)
            .value("key", r.key)
            .value("answer", r.answer)
            .value("correct", r.correct)
            .end_object();
      j.end_array().begin_array("grid");
      for (const auto& c : pk->grid)
        j.begin_object()
            .value("policy", label(c.policy))
            .value("spec", c.policy)
            .value("budget", c.budget)
            .value("correct", c.correct)
            .value("total", c.total)
            .value("accuracy", grid_accuracy(c))
            .end_object();
      j.end_array().value("seconds", pk_s).end_object();
    }
    if (fid) {
      j.begin_object("fidelity")
          .value("prompt_tokens", o.text_prompt)
          .value("continuation_tokens", o.text_cont);
      j.begin_array("texts");
      for (const auto& [name, nll] : fid->full_nll)
        j.begin_object().value("name", name).value("full_nll", nll).end_object();
      j.end_array().begin_array("grid");
      for (const auto& c : fid->grid)
        j.begin_object()
            .value("policy", label(c.policy))
            .value("spec", c.policy)
            .value("budget", c.budget)
            .value("kl", c.f.kl)
            .value("top1", c.f.top1)
            .value("nll", c.f.nll)
            .value("delta_nll", c.f.delta_nll)
            .end_object();
      j.end_array().value("seconds", fid_s).end_object();
    }
    if (dec) {
      j.begin_object("decode")
          .value("prompt_tokens", dec->prompt_tokens)
          .value("generated", dec->generated)
          .value("interval", dec->interval)
          .value("sample", dec->sample);
      j.begin_array("cells");
      for (const auto& c : dec->cells)
        j.begin_object()
            .value("policy", label(c.policy))
            .value("spec", c.policy)
            .value("budget_tokens", c.budget)
            .value("agreement", c.f.top1)
            .value("kl", c.f.kl)
            .value("delta_nll", c.f.delta_nll)
            .value("kv_bytes", c.kv_bytes)
            .end_object();
      j.end_array().value("seconds", dec_s).end_object();
    }
    if (!thr.empty()) {
      j.begin_array("throughput");
      for (const auto& t : thr)
        j.begin_object()
            .value("context", t.context)
            .value("cache", t.config)
            .value("prefill_tokens_per_s", t.prefill_tps)
            .value("compress_ms", t.compress_ms)
            .value("decode_tokens_per_s", t.decode_tps)
            .value("kv_bytes", t.kv_bytes)
            .end_object();
      j.end_array();
    }
    j.end_object();
    const std::string json_path = o.out + "/results.json";
    {
      std::ofstream f(json_path);
      f << j.str() << "\n";
      KVP_REQUIRE(f.good(), "cannot write ", json_path);
    }
    std::cerr << "wrote " << json_path << "\n";
    if (o.plots) {
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
