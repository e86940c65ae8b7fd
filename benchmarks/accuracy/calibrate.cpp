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

const char* kUsage = R"(usage: kvpolicy_calibrate [options]

Measures how much compressing each layer alone hurts (mean KL of next-token distributions
against the full cache on teacher-forced text) and writes a DepthKV profile.

  --model PATH          GGUF model (default: the bundled SmolLM2-135M-Instruct)
  --scorer SPEC         policy used to compress one layer (default snapkv)
  --budget R            kept fraction of the prompt in that layer (default 0.2)
  --texts A,B           calibration texts (default LGPL-2.1 and GFDL-1.3 from
                        /usr/share/common-licenses; the accuracy benchmark uses others)
  --prompt N            prompt tokens per text (default 1024)
  --continuation N      teacher-forced tokens per text (default 64)
  --threads N           OpenMP threads (default: all cores)
  --out FILE            profile to write (default depthkv_profile.json)
)";

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto val = [&]() -> std::string {
      KVP_REQUIRE(i + 1 < argc, a, " needs a value (see --help)");
      return argv[++i];
    };
    auto num = [&](const std::string& s) {
      std::size_t used = 0;
      double v = 0;
      try {
        v = std::stod(s, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      KVP_REQUIRE(used == s.size() && !s.empty(), a, ": '", s, "' is not a number");
      return v;
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--model") {
      o.model = val();
    } else if (a == "--scorer") {
      o.scorer = val();
    } else if (a == "--budget") {
      o.budget = num(val());
      KVP_REQUIRE(o.budget > 0 && o.budget < 1, "--budget must be in (0, 1) (got ", o.budget, ")");
    } else if (a == "--texts") {
      o.texts.clear();
      std::istringstream in(val());
      for (std::string t; std::getline(in, t, ',');)
        if (!t.empty()) o.texts.push_back(t);
      KVP_REQUIRE(!o.texts.empty(), "--texts: empty list");
    } else if (a == "--prompt") {
      o.prompt = static_cast<std::int64_t>(num(val()));
      KVP_REQUIRE(o.prompt > 0, "--prompt must be positive");
    } else if (a == "--continuation") {
      o.continuation = static_cast<std::int64_t>(num(val()));
      KVP_REQUIRE(o.continuation > 0, "--continuation must be positive");
    } else if (a == "--threads") {
      o.threads = static_cast<int>(num(val()));
    } else if (a == "--out") {
      o.out = val();
    } else {
      KVP_REQUIRE(false, "unknown argument '", a, "' (see --help)");
    }
  }
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
