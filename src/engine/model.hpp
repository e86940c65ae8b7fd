// A Llama-architecture model loaded from GGUF: hyper-parameters, the tokenizer, and the weight
// matrices in their GGUF storage type (row-major [out][in]; engine/weights.hpp computes on them
// without an fp32 copy), norms in fp32. Immutable after load, so many Engines (sequences) can
// share one Model.
#pragma once
#include "kvpolicy/cpu/eigen.hpp"
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/gguf.hpp"
#include "engine/tokenizer.hpp"
#include "engine/weights.hpp"

namespace kvpolicy::engine {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::VectorXf;

struct ModelConfig {
  std::string architecture, name;
  std::int64_t n_layers = 0, n_embd = 0, n_ff = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
  std::int64_t n_vocab = 0, n_ctx_train = 0;
  float rope_base = 10000.f, rms_eps = 1e-5f;
  bool tied_embeddings = false;
};

struct LayerWeights {
  Vector attn_norm, ffn_norm;
  WeightMatrix wq, wk, wv, wo;        // [Hq*d][E], [Hkv*d][E], [Hkv*d][E], [E][Hq*d]
  WeightMatrix w_gate, w_up, w_down;  // [F][E], [F][E], [E][F]
};

struct ModelWeights {
  WeightMatrix token_embd;  // [V][E]
  WeightMatrix output;      // [V][E]; empty when tied to token_embd
  Vector output_norm;
  Vector rope_freq_factors;  // optional [d/2] divisors of the RoPE frequencies (Llama 3.1)
  std::vector<LayerWeights> layers;
  const WeightMatrix& lm_head() const { return output.empty() ? token_embd : output; }
  // Bytes of the weight matrices as held (what a decode step reads), and of their fp32 copies.
  std::size_t matrix_bytes() const;
  std::size_t matrix_bytes_f32() const;
};

// $KVPOLICY_MODEL if set, else
// ${KVPOLICY_CACHE:-$HOME/.cache/kvpolicy}/SmolLM2-135M-Instruct.Q4_1.gguf
std::string default_model_path();
// "model file ... not found" plus how to get the default model.
std::string missing_model_message(const std::string& path);

class Model {
 public:
  // Loads a Llama-family GGUF; a missing file raises an Error that says how to fetch the default.
  // `f32_weights`: dequantize every matrix to fp32 at load (what the engine held before it kept
  // the GGUF types; the throughput benchmark runs both side by side). Products over more than 4
  // activation rows (prefill chunks) are bitwise the same either way; products of 1-4 rows
  // (decode) differ in rounding only (engine/weights.hpp).
  static std::unique_ptr<Model> load(const std::string& path, bool f32_weights = false);
  static std::unique_ptr<Model> load(const GgufFile& file, bool f32_weights = false);
  // Hyper-parameters only (no weights); validates them. Used by load and by the fuzzer.
  static ModelConfig read_config(const GgufFile& file);

  const ModelConfig& config() const { return cfg_; }
  const Tokenizer& tokenizer() const { return *tok_; }
  const ModelWeights& weights() const { return w_; }

 private:
  Model() = default;
  ModelConfig cfg_;
  std::unique_ptr<Tokenizer> tok_;
  ModelWeights w_;
};

}  // namespace kvpolicy::engine
