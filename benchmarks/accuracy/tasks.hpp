// The accuracy benchmark's tasks, on the reference engine. Each task runs the full-cache model
// once per prompt and forks that state (Engine::fork) for every (policy, budget) of the grid, so
// prefill cost does not grow with the grid.
//
//   passkey   filler text with a 5-digit key at a depth of 0-100%, the question at the end;
//             correct when the greedy answer's first 5-digit number is the key.
//   fidelity  teacher-forced continuation of real English text (licence texts that Debian
//             installs under /usr/share/common-licenses): KL(full || policy) of the next-token
//             distributions, top-1 agreement with the full cache, and the NLL change.
//   decode    a long greedy generation with decode-time compression (the cache is evicted back
//             to its budget at every step), teacher-forced on the full cache's own generation:
//             token agreement and KL against the full cache.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/engine.hpp"

namespace kvbench {

using kvpolicy::engine::Engine;
using kvpolicy::engine::EngineConfig;
using kvpolicy::engine::Model;

struct GridPoint {
  std::string policy;
  double budget = 1.0;  // ratio of the prompt
};

// The DepthKV stage with the bundled SmolLM2-135M profile of `profile_dir` (benchmarks/profiles):
// snapkv's loss curves from kvpolicy_calibrate's defaults, so the marginal rule.
std::string depthkv_stage(const std::string& profile_dir);
// The default suite's policies (kvpolicy_accuracy's --policies default; kvpolicy_keptsets
// checks them for determinism).
std::vector<std::string> default_policies(const std::string& profile_dir);

// Wall-clock seconds of a callable.
template <class F>
double seconds(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---- passkey ----------------------------------------------------------------------------
// A passkey prompt is head + unit x before + key + unit x after + question (token pieces
// tokenized separately, each starting at a word boundary). Prompts of one length share
// head + unit x before, so the benchmark computes that prefix once and forks it per depth.
struct PasskeyPieces {
  std::vector<std::int32_t> head, unit, key, question;
  std::string key_digits;
};
PasskeyPieces passkey_pieces(const Model& m, const std::string& key_digits);
// Filler units so that the prompt has at most `target_tokens` tokens (throws if none fit).
std::int64_t passkey_units(const PasskeyPieces& p, std::int64_t target_tokens);
// A 5-digit key, deterministic in its arguments.
std::string passkey_digits(std::uint64_t seed, std::int64_t length, double depth);
// The first run of 5 digits in `text`, or "".
std::string first_five_digits(const std::string& text);
void append_units(std::vector<std::int32_t>& out, const PasskeyPieces& p, std::int64_t units);

// Greedy continuations of several engines at once (Engine::step_batch): up to max_new tokens
// each, an engine stops after emitting EOS.
std::vector<std::vector<std::int32_t>> generate_batch(const std::vector<Engine*>& es,
                                                      std::int64_t max_new);

// ---- fidelity ---------------------------------------------------------------------------
struct FidelityText {
  std::string name;  // e.g. "GPL-3"
  std::vector<std::int32_t> prompt, continuation;
};
// Loads /usr/share/common-licenses/<name> (or any path) and cuts prompt/continuation tokens;
// throws if the text is too short.
FidelityText load_fidelity_text(const Model& m, const std::string& path, std::int64_t prompt_tokens,
                                std::int64_t cont_tokens);

struct Fidelity {
  double kl = 0;         // mean over continuation positions of KL(full || policy), nats
  double top1 = 0;       // fraction of positions where both argmaxes agree
  double nll = 0;        // mean NLL of the continuation under the policy
  double delta_nll = 0;  // nll - full-cache nll
};
// Reference: full-cache teacher forcing of `cont`; keeps the log-softmax rows.
struct Reference {
  kvpolicy::engine::Matrix logp;  // [n][vocab] log-probabilities
  std::vector<std::int32_t> argmax;
  double nll = 0;
};
Reference reference_run(Engine& full, std::span<const std::int32_t> cont);
Fidelity compare_run(Engine& policy, std::span<const std::int32_t> cont, const Reference& ref);
// The same for decode-time policies, fed token by token, all engines batched per step.
// Optionally also per position: kl_pos[s][i] and agree_pos[s][i] (1 if the argmaxes agree).
std::vector<Fidelity> compare_run_batch(const std::vector<Engine*>& es,
                                        std::span<const std::int32_t> cont, const Reference& ref,
                                        std::vector<std::vector<double>>* kl_pos = nullptr,
                                        std::vector<std::vector<std::uint8_t>>* agree_pos = nullptr);

// In-place log-softmax of a row (double accumulation).
void log_softmax(std::span<float> row);

}  // namespace kvbench
