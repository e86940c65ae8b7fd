// kvpolicy_calibrate: DepthKV layer-sensitivity profile of a model. For each layer l, only that
// layer is compressed (scorer at --budget, e.g. snapkv at 20%) after a full-cache prefill of
// calibration text, and the mean KL(full || compressed) of the next-token distributions over a
// teacher-forced continuation is that layer's sensitivity. The profile (JSON, read by
// `depthkv(profile=...)`; see include/kvpolicy/allocators/profile.hpp) gives more budget to the
// layers whose compression hurts most.
//
//   kvpolicy_calibrate [--model PATH] [--scorer SPEC] [--budget R] [--texts A,B]
//                      [--prompt N] [--continuation N] [--out FILE]
//
// Each layer forks the same recorded full-cache prefill (Engine::fork), so a profile costs one
// prefill per text plus, per layer, one compression and one teacher-forced continuation.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include <CLI/CLI.hpp>

#include "report.hpp"
#include "tasks.hpp"

namespace {

using namespace kvbench;

struct Options {
  std::string model, scorer = "snapkv", out = "depthkv_profile.json";
  double budget = 0.2;
  std::vector<std::string> texts = {"/usr/share/common-licenses/LGPL-2.1",
                                    "/usr/share/common-licenses/GFDL-1.3"};
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
  app.add_option("--budget", o.budget, "kept fraction of the prompt in that layer, in (0, 1)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--texts", o.texts,
                 "calibration texts, comma-separated (default LGPL-2.1 and GFDL-1.3 from "
                 "/usr/share/common-licenses; the accuracy benchmark's prompts use other texts)")
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
    std::vector<double> kl(static_cast<std::size_t>(layers), 0.0);
    Progress prog(static_cast<double>(o.texts.size() * static_cast<std::size_t>(layers + 4)));
    std::vector<std::string> names;
    for (const auto& t : o.texts) {
      const auto text = load_fidelity_text(*model, t, o.prompt, o.continuation);
      names.push_back(text.name);
      kvpolicy::engine::EngineConfig cfg;
      cfg.policy = "streaming";
      cfg.threads = o.threads;
      cfg.record_queries = std::max<std::int64_t>(1, policy.query_window());
      cfg.record_attention = true;
      Engine full(*model, cfg);
      full.prefill(text.prompt);
      Engine ref_engine = full.fork("streaming", kvpolicy::Budget::ratio(1.0));
      const Reference ref = reference_run(ref_engine, text.continuation);
      prog.advance(4, "calibrate " + text.name + ": full cache");
      for (std::int64_t l = 0; l < layers; ++l) {
        Engine e = full.fork(o.scorer, kvpolicy::Budget::ratio(o.budget));
        // Only layer l is compressed; the others stay full (they are never due again: the
        // continuation is fed as a block, and prefill-time policies do not compress while
        // decoding).
        e.session().compress(l);
        kl[static_cast<std::size_t>(l)] += compare_run(e, text.continuation, ref).kl;
        prog.advance(1, fmt("calibrate %s: layer %lld", text.name.c_str(),
                            static_cast<long long>(l)));
      }
    }
    prog.finish();
    for (auto& v : kl) v /= static_cast<double>(o.texts.size());

    const nlohmann::json j = {{"model", model->config().name},
                              {"model_file", path.substr(path.find_last_of('/') + 1)},
                              {"scorer", o.scorer},
                              {"budget", o.budget},
                              {"metric", "kl"},
                              {"prompt_tokens", o.prompt},
                              {"continuation_tokens", o.continuation},
                              {"layers", layers},
                              {"texts", names},
                              {"sensitivity", kl}};
    std::ofstream f(o.out);
    f << j.dump(2) << "\n";
    KVP_REQUIRE(f.good(), "cannot write ", o.out);
    std::printf("| layer | mean KL (nats) |\n|---|---|\n");
    for (std::int64_t l = 0; l < layers; ++l)
      std::printf("| %lld | %.5f |\n", static_cast<long long>(l), kl[static_cast<std::size_t>(l)]);
    std::fprintf(stderr, "wrote %s\n", o.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvpolicy_calibrate: %s\n", e.what());
    return 1;
  }
}
