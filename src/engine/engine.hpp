// Engine: one sequence running a Llama Model with a kvpolicy::Session<float> as its KV cache.
// Forward per layer: RMSNorm -> Q/K/V projections -> RoPE (half-split, Hugging Face order) ->
// Session::append(K, V, Q) -> Session::attend (the library's GQA attention over the possibly
// compressed, ragged cache) -> output projection -> RMSNorm -> SwiGLU MLP. Prefill runs the
// prompt as chunked GEMMs and then compresses every layer to the budget; decode steps evict for
// decode-time policies (H2O). Weights stay in their GGUF types (engine/weights.hpp); activations,
// K/V and attention are fp32. Prefill chunks run as Eigen GEMMs (OpenMP) on blocks of exactly
// dequantized weight rows; decode steps run SIMD dot products on the stored Q4_1/Q8_0 blocks. Greedy decoding and teacher forcing for the accuracy benchmark.
// Determinism: every result is bitwise the same for any thread count (the GEMMs run in fixed
// blocks of weight rows, attention in fixed blocks of query rows). It is not the same between
// builds of different SIMD width: Eigen's kernels round differently with AVX-512 and FMA than
// with SSE2, so Q/K/V differ in the last bits between scripts/test.sh's portable build and
// scripts/main.sh's -march=native build, and kept sets differ where scores are near-tied at a
// cut (README, "Determinism"; scripts/determinism.sh measures it).
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/model.hpp"
#include "kvpolicy/session.hpp"

namespace kvpolicy::engine {

// Engine::reconstruct's pass (scorers/kvzip.hpp).
struct ReconstructOptions {
  std::int64_t chunk = 2048;  // context tokens per chunk (the KVzip authors' and kvpress's 2048)
  std::int64_t first = 0;     // first position to repeat: after a system prompt, say (kvpress
                              // repeats the context without the chat template's prefix)
};

struct EngineConfig {
  std::string policy = "streaming";    // kvpolicy::Policy spec, e.g. "snapkv(window=32) | uniform"
  Budget budget = Budget::ratio(1.0);  // ratio(1.0): keep everything (exact model)
  int threads = 0;                     // 0: the OpenMP default
  std::int64_t prefill_chunk = 512;    // prompt tokens per forward chunk (bounds memory)
  // What the session records for fork() (see SessionConfig): the newest queries per head, and
  // H2O attention statistics.
  std::int64_t record_queries = 0;
  bool record_attention = false;
  // Decode-time compression (SessionConfig::decode_interval / decode_target): 0 and unset use
  // the policy's defaults (H2O evicts back to its prefill budget at every step).
  std::int64_t decode_interval = 0;
  std::optional<Budget> decode_target;
  // The reconstruction pass prefill() runs for a policy that reads its scores (kvzip).
  ReconstructOptions reconstruct{};
};

// What one layer computed for the tokens of the current forward chunk: post-RoPE queries
// [1][Hq][n][d], post-RoPE keys and values [1][Hkv][n][d] (token-major views over engine
// buffers, valid only during the callback), for original positions first_position.. .
struct LayerCapture {
  std::int64_t layer = 0, first_position = 0;
  KVView<const float> q, k, v;
};

// Teacher-forced continuation: logprob[i] = log p(cont[i] | prompt, cont[<i]), argmax[i] the
// greedy prediction at that point; logits (if requested) [n][vocab].
struct TeacherForced {
  std::vector<float> logprob;
  std::vector<std::int32_t> argmax;
  Matrix logits;
};

class Engine {
 public:
  explicit Engine(const Model& model, EngineConfig cfg = {});

  // Runs the prompt, caches its K/V, then compresses every layer to the budget (first
  // compression event). Returns logits [n][vocab] for every prompt position, or [1][vocab] for
  // the last one. Only on an empty sequence (see reset()).
  Matrix prefill(std::span<const std::int32_t> tokens, bool all_logits = false);
  // prefill() at any position: more prompt tokens in causal chunks on top of the current cache,
  // then the compressions that are due. Lets a shared prefix be computed once and forked.
  Matrix extend(std::span<const std::int32_t> tokens, bool all_logits = false);
  // Appends one token and returns the logits that predict the next one; decode-time policies
  // evict back to their budget here.
  std::span<const float> step(std::int32_t token);
  // One step for several sequences at once: engines[i] appends tokens[i]. The projections run
  // over the stacked rows at once (weights are read once for the whole batch: dot kernels on the
  // GGUF blocks for up to 4 rows, a GEMM beyond); attention
  // and compression stay per sequence, each over its own session and length. All engines must
  // share one Model and be distinct; afterwards each one's last_logits() predicts its next token.
  static void step_batch(std::span<Engine* const> engines, std::span<const std::int32_t> tokens);
  // extend() for several sequences at once, without compressing: engines[i] appends tokens[i]
  // (any lengths, at least one token each) in one forward pass whose projections run as GEMMs
  // over all stacked rows; attention stays per sequence. Returns, per engine, the logits
  // [m_i][vocab] of its last m_i = min(n_i, logit_rows) appended positions (logit_rows <= 0: all
  // of them; the vocabulary projection is the costliest GEMM, so ask only for the rows you
  // score). The last row is also the engine's last_logits(). No
  // compression runs, whatever the policy: callers that want one call compress_now(). This is
  // how the accuracy benchmark scores a question and answer on many compressed forks of one
  // prompt. Engines must share one Model, be distinct and hold a prefix (position() > 0).
  static std::vector<Matrix> extend_batch(std::span<Engine* const> engines,
                                          std::span<const std::span<const std::int32_t>> tokens,
                                          std::int64_t logit_rows = 0);
  // Greedy continuation of the current state (the last logits): up to max_new tokens, stopping
  // after any id in `stop` (default: the model's EOS). The stop token is included and fed.
  std::vector<std::int32_t> generate(std::int64_t max_new, std::vector<std::int32_t> stop = {-2});
  // Scores `cont` as the continuation of the current state, feeding it through the cache (in
  // causal blocks when nothing compresses while decoding, token by token when the session
  // compresses at decode time, which gives the same numbers as step() would).
  TeacherForced teacher_force(std::span<const std::int32_t> cont, bool keep_logits = false);

  // Logits after the last processed token (empty before any).
  std::span<const float> last_logits() const { return last_logits_; }
  std::int64_t position() const { return position_; }  // tokens processed so far
  void reset();                                        // empty cache, position 0

  // A copy of this engine after a full-cache prefill (same position and last logits) whose
  // session will compress with `policy` to `budget`: the next compress_now() or step() applies
  // it. The full-cache prefill must have been run with record_queries >= the policy's window
  // (and record_attention for H2O); see Session::fork.
  Engine fork(const std::string& policy, Budget budget, std::int64_t decode_interval = 0,
              std::optional<Budget> decode_target = std::nullopt) const;
  // A copy of this engine (cache, position, last logits, configuration) that runs `other`, a model
  // of the same shape: e.g. the same GGUF file loaded with fp32 weights, to time both weight
  // formats on one cache. Throws if the shapes differ.
  Engine with_model(const Model& other) const;
  // Compresses every layer that is due (what prefill() does at its end).
  void compress_now();
  // Context reconstruction for kvzip (scorers/kvzip.hpp): a teacher-forced pass that repeats the
  // tokens at positions [first, position()) on top of the cache, in chunks of `chunk` tokens.
  // Chunk c is "\n\nRepeat the previous context exactly." (c = 0) or "\n\nRepeat the part of
  // the previous context exactly, starting with" and the previous chunk's last 8 tokens (c > 0),
  // then the chat template's assistant opener (the text after the user message of a ChatML
  // template; "\n" for other templates or none), then the chunk's tokens: KVzip's prompts, as
  // kvpress words them. Each layer hands the chunk's Q/K/V to Session::reconstruct; the chunk is
  // then dropped, so the cache, position() and last_logits() are unchanged and only the
  // reconstruction scores are new (earlier ones are cleared; if the pass fails, none are left).
  // Needs a cache that has not been quantized; run it between prefill() and compression: an
  // engine whose policy reads the scores (kvzip) runs it inside prefill() itself (with
  // EngineConfig::reconstruct), and forks of a recording full-cache engine copy its scores.
  // Memory: one chunk's activations and attention strips; each layer's storage grows by one
  // chunk during the pass and is given back after it.
  void reconstruct(ReconstructOptions opt = {});

  const Model& model() const { return model_; }
  const Session<float>& session() const { return session_; }
  Session<float>& session() { return session_; }
  // Called for every layer of every forward with that layer's Q/K/V (nullptr to remove).
  void set_capture(std::function<void(const LayerCapture&)> cb) { capture_ = std::move(cb); }

 private:
  // Runs tokens [p0, p0+n) through all layers; fills hidden_ with the final-normed states.
  void forward(std::span<const std::int32_t> tokens, bool evict_after_each_layer);
  // forward() over several sequences, their rows stacked; scratch of es[0] is used. With
  // `reconstruct` (one engine), the tokens go through Session::reconstruct instead of
  // append/attend and leave nothing behind (no position, no hidden states).
  static void forward_multi(std::span<Engine* const> es,
                            std::span<const std::span<const std::int32_t>> toks,
                            bool evict_after_each_layer, bool reconstruct = false);
  void logits_rows(std::int64_t first, std::int64_t count, Matrix& out) const;
  static SessionConfig session_config(const Model& m, const EngineConfig& c);
  Engine(const Engine& src, EngineConfig cfg, Session<float> session,
         const Model* model = nullptr);

  const Model& model_;
  EngineConfig cfg_;
  Session<float> session_;
  std::int64_t position_ = 0;
  std::vector<std::int32_t> tokens_;  // every token processed, in order (reconstruct())
  std::vector<float> last_logits_;
  std::vector<float> inv_freq_;
  std::function<void(const LayerCapture&)> capture_;
  // Per vocabulary id: 1 if the token's text ends a chunk for the semantic merger, under the
  // delimiter set it was built for (the policy's; shared by forks).
  std::shared_ptr<const std::vector<std::uint8_t>> delimiter_table_;
  std::string delimiter_set_;
  // Scratch, reused across calls.
  Matrix x_, xn_, q_, k_, v_, attn_, gate_, up_, hidden_;
  std::vector<float> attn_hnd_;
};

}  // namespace kvpolicy::engine
