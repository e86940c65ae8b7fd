// kvpolicy_calibrate: DepthKV layer-sensitivity profile of a model. For each layer l and each
// kept fraction r of --budgets, only that layer is compressed (the scorer at r, e.g. snapkv at
// 20%) after a full-cache prefill of calibration text, and the mean KL(full || compressed) of the
// next-token distributions over a teacher-forced continuation is that layer's loss at r. The
// profile (JSON, read by `depthkv(profile=...)`; see include/kvpolicy/allocators/profile.hpp)
// holds these loss curves ("curve_budgets", "curves"), which depthkv turns into per-layer budgets
// by marginal allocation, and the losses at --budget as "sensitivity" (the proportional rule).
//
//   kvpolicy_calibrate [--model PATH] [--scorer SPEC] [--budget R] [--budgets R,R,...]
//                      [--texts A,B] [--prompt N] [--continuation N] [--out FILE]
//
// Each (layer, budget) forks the same recorded full-cache prefill (Engine::fork), so a profile
// costs one prefill per text plus, per layer and budget, one compression and one teacher-forced
// continuation. The default texts are the accuracy benchmark's calibration corpora
// (`--prompt-set calibration`), disjoint from its evaluation corpora.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <span>
#include <sstream>

#include <CLI/CLI.hpp>

#include "kvpolicy/allocators/depthkv.hpp"

#include "report.hpp"
#include "retrieval.hpp"
#include "tasks.hpp"

namespace {

using namespace kvbench;

struct Options {
  std::string model, scorer = "snapkv", out = "depthkv_profile.json";
  double budget = 0.2;
  std::vector<double> budgets = {0.05, 0.1, 0.2, 0.3, 0.5};
  std::vector<std::string> texts = corpus_paths(PromptSet::calibration);
  std::int64_t prompt = 1024, continuation = 64;
  int threads = 0;
};

// Parses the command line (CLI11; --help lists every option with its default).
Options parse(int argc, char** argv) {
  Options o;
  CLI::App app(
      "Measures how much compressing each layer alone hurts (mean KL of next-token "
      "distributions against the full cache on teacher-forced text) and writes a DepthKV "
      "profile, read by depthkv(profile=FILE).",
      "kvpolicy_calibrate");
  app.get_formatter()->column_width(28);
  app.add_option("--model", o.model, "GGUF model (default: the bundled SmolLM2-135M-Instruct)");
  app.add_option("--scorer", o.scorer, "policy used to compress one layer")->capture_default_str();
  app.add_option("--budget", o.budget,
                 "kept fraction of the prompt in that layer for the \"sensitivity\" values (the "
                 "proportional rule), in (0, 1); it joins --budgets if missing")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--budgets", o.budgets,
                 "kept fractions of the loss curves (marginal allocation), comma-separated, each "
                 "in (0, 1)")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--texts", o.texts,
                 "calibration texts (plain or .gz), comma-separated (default: the accuracy "
                 "benchmark's calibration corpora, LGPL-2.1, GFDL-1.3 and the Debian "
                 "Constitution; its evaluation prompts use other texts)")
      ->delimiter(',')
      ->check(CLI::ExistingFile);
  app.add_option("--prompt", o.prompt, "prompt tokens per text")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--continuation", o.continuation, "teacher-forced tokens per text")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "OpenMP threads (default: all cores)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--out", o.out, "profile to write")->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }
  KVP_REQUIRE(o.budget > 0 && o.budget < 1, "--budget must be in (0, 1) (got ", o.budget, ")");
  for (double b : o.budgets)
    KVP_REQUIRE(b > 0 && b < 1, "--budgets: each must be in (0, 1) (got ", b, ")");
  o.budgets.push_back(o.budget);
  std::sort(o.budgets.begin(), o.budgets.end());
  // depthkv holds the fractions as floats: two that a float does not tell apart are one.
  const auto same = [](double a, double b) {
    return static_cast<float>(a) == static_cast<float>(b);
  };
  o.budgets.erase(std::unique(o.budgets.begin(), o.budgets.end(), same), o.budgets.end());
  if (std::find(o.budgets.begin(), o.budgets.end(), o.budget) == o.budgets.end())
    *std::find_if(o.budgets.begin(), o.budgets.end(),
                  [&](double b) { return same(b, o.budget); }) = o.budget;
  KVP_REQUIRE(o.budgets.size() <= static_cast<std::size_t>(kvpolicy::DepthKV::kMaxKnots),
              "--budgets: at most ", kvpolicy::DepthKV::kMaxKnots,
              " distinct fractions (with --budget), got ", o.budgets.size());
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const kvpolicy::Policy policy(o.scorer);  // fails early on a bad spec
    const std::string path =
        o.model.empty() ? kvpolicy::engine::default_model_path() : o.model;
    const auto model = Model::load(path);
    const std::int64_t layers = model->config().n_layers;
    const std::size_t nb = o.budgets.size();
    // curve[l][k]: mean KL with only layer l compressed to budgets[k].
    std::vector<std::vector<double>> curve(static_cast<std::size_t>(layers),
                                           std::vector<double>(nb, 0.0));
    Progress prog(static_cast<double>(o.texts.size() * static_cast<std::size_t>(layers) * nb +
                                      4 * o.texts.size()));
    std::vector<std::string> names;
    for (const auto& t : o.texts) {
      const Corpus c = load_corpus(*model, t, 0.0);
      const std::int64_t need = o.prompt + o.continuation;
      KVP_REQUIRE(static_cast<std::int64_t>(c.ids.size()) >= need, "text ", t, " has ",
                  c.ids.size(), " tokens, fewer than --prompt + --continuation = ", need);
      const std::span<const std::int32_t> ids(c.ids);
      const auto prompt = ids.first(static_cast<std::size_t>(o.prompt));
      const auto cont = ids.subspan(static_cast<std::size_t>(o.prompt),
                                    static_cast<std::size_t>(o.continuation));
      names.push_back(c.name);
      kvpolicy::engine::EngineConfig cfg;
      cfg.policy = "streaming";
      cfg.threads = o.threads;
      cfg.record_queries = std::max<std::int64_t>(1, policy.query_window());
      cfg.record_attention = true;
      Engine full(*model, cfg);
      full.prefill(prompt);
      Engine ref_engine = full.fork("streaming", kvpolicy::Budget::ratio(1.0));
      const Reference ref = reference_run(ref_engine, cont);
      prog.advance(4, "calibrate " + c.name + ": full cache");
      for (std::size_t k = 0; k < nb; ++k)
        for (std::int64_t l = 0; l < layers; ++l) {
          Engine e = full.fork(o.scorer, kvpolicy::Budget::ratio(o.budgets[k]));
          // Only layer l is compressed; the others stay full (they are never due again: the
          // continuation is fed as a block, and prefill-time policies do not compress while
          // decoding).
          e.session().compress(l);
          curve[static_cast<std::size_t>(l)][k] += compare_run(e, cont, ref).kl;
          prog.advance(1, fmt("calibrate %s: budget %g, layer %lld", c.name.c_str(),
                              o.budgets[k], static_cast<long long>(l)));
        }
    }
    prog.finish();
    const auto at = static_cast<std::size_t>(
        std::find(o.budgets.begin(), o.budgets.end(), o.budget) - o.budgets.begin());
    std::vector<double> kl(static_cast<std::size_t>(layers));
    for (std::size_t l = 0; l < kl.size(); ++l) {
      for (double& v : curve[l]) v /= static_cast<double>(o.texts.size());
      kl[l] = curve[l][at];
    }

    const nlohmann::json j = {{"model", model->config().name},
                              {"model_file", path.substr(path.find_last_of('/') + 1)},
                              {"scorer", o.scorer},
                              {"budget", o.budget},
                              {"metric", "kl"},
                              {"prompt_tokens", o.prompt},
                              {"continuation_tokens", o.continuation},
                              {"layers", layers},
                              {"texts", names},
                              {"sensitivity", kl},
                              {"curve_budgets", o.budgets},
                              {"curves", curve}};
    std::ofstream f(o.out);
    f << j.dump(2) << "\n";
    KVP_REQUIRE(f.good(), "cannot write ", o.out);
    std::printf("| layer |");
    for (double b : o.budgets) std::printf(" KL at %g |", b);
    std::printf("\n|---|");
    for (std::size_t k = 0; k < nb; ++k) std::printf("---|");
    std::printf("\n");
    for (std::int64_t l = 0; l < layers; ++l) {
      std::printf("| %lld |", static_cast<long long>(l));
      for (double v : curve[static_cast<std::size_t>(l)]) std::printf(" %.5f |", v);
      std::printf("\n");
    }
    std::fprintf(stderr, "wrote %s\n", o.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvpolicy_calibrate: %s\n", e.what());
    return 1;
  }
}
