#include "engine/engine.hpp"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace kvpolicy::engine {

namespace {

int thread_count(int requested) {
#if defined(_OPENMP)
  return requested > 0 ? requested : omp_get_max_threads();
#else
  (void)requested;
  return 1;
#endif
}

// y = x W^T over fixed blocks of kBlockRows rows of W (output columns of y), each block one
// single-threaded Eigen product (a GEMM for prefill chunks, a GEMV for decode), the blocks spread
// over our own OpenMP threads. Eigen's built-in GEMM parallelism is kept out: its threads
// busy-wait on each other, which collapses when the machine is oversubscribed (measured: 10x
// slower prefill on a loaded 2-core box), and it never parallelizes GEMVs.
//
// The blocks are the same whatever the thread count, and the single-threaded path runs the same
// blocks, so the forward pass is bitwise the same for any thread count: Eigen's GEMM gives rows
// at the edge of a register panel (48 rows of W with AVX-512, 24 with AVX2, 12 with SSE) another
// rounding than rows inside one, so a partition that followed the thread count changed the last
// bits of Q/K/V (measured under -march=native, 512 x 576 by 576 x 576: blocks of 80 rows differ
// from one product in 2.6% of the outputs, blocks of 48 or 96 in none; without -march=native no
// partition differs) and with them near-tied kept sets (scripts/determinism.sh).
//
// Products below kParallelMacs multiply-adds run on the calling thread: a decode step's per-layer
// GEMVs take well under a millisecond each, and a parallel region per GEMV costs more than it
// saves whenever the cores are shared (OpenMP workers spin at the barrier while the thread they
// wait for is descheduled). Prefill chunks and the vocabulary projection stay parallel.
constexpr double kParallelMacs = 8e6;
constexpr Eigen::Index kBlockRows = 96;  // two AVX-512 panels; a multiple of every panel size

// Runs block(b) for b < blocks on the calling thread (Eigen kept single-threaded) or spread over
// `threads` OpenMP threads.
template <class F>
void for_blocks(Eigen::Index blocks, bool parallel, int threads, F&& block) {
  if (!parallel || threads <= 1) {
#if defined(_OPENMP)
    // Eigen would otherwise start omp_get_max_threads() threads of its own.
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    for (Eigen::Index b = 0; b < blocks; ++b) block(b);
#if defined(_OPENMP)
    omp_set_num_threads(saved);
#endif
    return;
  }
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
#endif
  for (Eigen::Index b = 0; b < blocks; ++b) block(b);
}

// Decode: up to kMatvecMaxRows activation rows read the weights in their stored type
// (engine/weights.hpp), in blocks of kMatvecBlockRows weight rows. Matrix-vector products are
// bound by the bytes of W, so parallel threads pay off from fewer multiply-adds than a GEMM's;
// products that read the same activations (Q, K and V; gate and up) share one parallel region,
// so a decode step opens four per layer.
constexpr Eigen::Index kMatvecBlockRows = 64;
constexpr double kParallelMatvecMacs = 1e5;

struct Product {
  const WeightMatrix* w;
  Matrix* y;
};

// y = x W^T for every (W, y) in `ps`; the blocks of all of them are the work items of one loop.
void linear(const Matrix& x, std::initializer_list<Product> ps, int threads) {
  const bool decode = x.rows() <= kMatvecMaxRows;
  const Eigen::Index rows_per_block = decode ? kMatvecBlockRows : kBlockRows;
  struct Item {
    const Product* p;
    Eigen::Index r0, n;
  };
  std::vector<Item> items;
  double macs = 0;
  for (const Product& p : ps) {
    p.y->resize(x.rows(), p.w->rows());
    macs += static_cast<double>(x.rows()) * static_cast<double>(p.w->rows()) *
            static_cast<double>(p.w->cols());
    for (Eigen::Index r0 = 0; r0 < p.w->rows(); r0 += rows_per_block)
      items.push_back({&p, r0, std::min(rows_per_block, p.w->rows() - r0)});
  }
  const bool parallel = macs >= (decode ? kParallelMatvecMacs : kParallelMacs);
  for_blocks(static_cast<Eigen::Index>(items.size()), parallel, threads, [&](Eigen::Index b) {
    const Item& it = items[static_cast<std::size_t>(b)];
    const WeightMatrix& w = *it.p->w;
    Matrix& y = *it.p->y;
    if (decode) {
      matvec(w, x.data(), x.rows(), x.cols(), it.r0, it.n, y.data() + it.r0, y.cols());
      return;
    }
    // Prefill: the block's weight rows are dequantized (exact fp32 values) into a scratch
    // matrix and multiplied with one single-threaded Eigen GEMM.
    thread_local Matrix wb;
    wb.resize(it.n, w.cols());
    w.dequantize_rows(it.r0, it.n, wb.data());
    y.middleCols(it.r0, it.n).noalias() = x * wb.transpose();
  });
}

void linear(const Matrix& x, const WeightMatrix& w, Matrix& y, int threads) {
  linear(x, {Product{&w, &y}}, threads);
}

// out = x / rms(x) * weight, row by row (fp32, as Hugging Face computes it).
void rms_norm(const Matrix& x, const Vector& weight, float eps, Matrix& out) {
  out.resize(x.rows(), x.cols());
  for (Eigen::Index r = 0; r < x.rows(); ++r) {
    const float ms = x.row(r).squaredNorm() / static_cast<float>(x.cols());
    const float inv = 1.0f / std::sqrt(ms + eps);
    out.row(r) = (x.row(r) * inv).cwiseProduct(weight.transpose());
  }
}

// Which vocabulary entries end a chunk for `policy`'s semantic merger (its delimiter set, or the
// default one), from each token's decoded text.
std::vector<std::uint8_t> delimiter_table(const Model& m, const Policy& policy) {
  const auto vocab = m.config().n_vocab;
  std::vector<std::uint8_t> t(static_cast<std::size_t>(vocab), 0);
  for (std::int32_t id = 0; id < vocab; ++id)
    t[static_cast<std::size_t>(id)] =
        policy.is_delimiter(m.tokenizer().decode(std::span<const std::int32_t>(&id, 1))) ? 1 : 0;
  return t;
}

// RoPE frequencies as Hugging Face computes them (fp32): base^(-2i/d), optionally divided by
// per-frequency factors (Llama 3.1 style rope_freqs).
std::vector<float> rope_frequencies(const Model& model) {
  std::vector<float> inv_freq =
      rope_inv_freq(static_cast<double>(model.config().rope_base), model.config().head_dim);
  const auto& factors = model.weights().rope_freq_factors;
  if (factors.size())
    for (std::size_t i = 0; i < inv_freq.size(); ++i)
      inv_freq[i] /= factors[static_cast<Eigen::Index>(i)];
  return inv_freq;
}

}  // namespace

SessionConfig Engine::session_config(const Model& m, const EngineConfig& c) {
  SessionConfig s;
  s.layers = m.config().n_layers;
  s.kv_heads = m.config().n_head_kv;
  s.q_heads = m.config().n_head;
  s.head_dim = m.config().head_dim;
  s.budget = c.budget;
  s.backend = cpu_backend{c.threads};
  s.record_queries = c.record_queries;
  s.record_attention = c.record_attention;
  s.decode_interval = c.decode_interval;
  s.decode_target = c.decode_target;
  s.rope_inv_freq = rope_frequencies(m);
  return s;
}

Engine::Engine(const Engine& src, EngineConfig cfg, Session<float> session, const Model* model)
    : model_(model ? *model : src.model_),
      cfg_(std::move(cfg)),
      session_(std::move(session)),
      position_(src.position_),
      tokens_(src.tokens_),
      last_logits_(src.last_logits_),
      inv_freq_(src.inv_freq_),
      capture_(src.capture_),
      delimiter_table_(src.delimiter_table_),
      delimiter_set_(src.delimiter_set_) {}

Engine Engine::fork(const std::string& policy, Budget budget, std::int64_t decode_interval,
                    std::optional<Budget> decode_target) const {
  EngineConfig cfg = cfg_;
  cfg.policy = policy;
  cfg.budget = budget;
  cfg.decode_interval = decode_interval;
  cfg.decode_target = decode_target;
  Policy p(policy);
  // The session's delimiter flags were computed with this engine's set when the tokens went in.
  KVP_REQUIRE(p.delimiter_set() == delimiter_set_, "engine.fork: policy '", policy,
              "' cuts chunks at other delimiters than the ones this engine recorded; run the "
              "full-cache engine with the same semantic(delimiters=...)");
  return Engine(*this, cfg, session_.fork(std::move(p), budget, decode_interval, decode_target));
}

Engine Engine::with_model(const Model& other) const {
  const ModelConfig &a = model_.config(), &b = other.config();
  KVP_REQUIRE(a.n_layers == b.n_layers && a.n_embd == b.n_embd && a.n_ff == b.n_ff &&
                  a.n_head == b.n_head && a.n_head_kv == b.n_head_kv &&
                  a.head_dim == b.head_dim && a.n_vocab == b.n_vocab,
              "engine.with_model: the other model's shape differs from this engine's");
  return Engine(*this, cfg_, session_, &other);
}

void Engine::compress_now() {
  for (std::int64_t l = 0; l < model_.config().n_layers; ++l) session_.compress_if_due(l);
}

Engine::Engine(const Model& model, EngineConfig cfg)
    : model_(model),
      cfg_(std::move(cfg)),
      session_(Policy(cfg_.policy), session_config(model, cfg_)) {
  KVP_REQUIRE(cfg_.prefill_chunk > 0, "engine: prefill_chunk must be positive (got ",
              cfg_.prefill_chunk, ")");
  delimiter_set_ = session_.policy().delimiter_set();
  delimiter_table_ = std::make_shared<const std::vector<std::uint8_t>>(
      delimiter_table(model, session_.policy()));
  inv_freq_ = rope_frequencies(model);
}

void Engine::reset() {
  session_ = Session<float>(Policy(cfg_.policy), session_config(model_, cfg_));
  position_ = 0;
  tokens_.clear();
  last_logits_.clear();
}

void Engine::forward(std::span<const std::int32_t> tokens, bool evict_after_each_layer) {
  Engine* self = this;
  forward_multi(std::span<Engine* const>(&self, 1),
                std::span<const std::span<const std::int32_t>>(&tokens, 1), evict_after_each_layer);
}

void Engine::forward_multi(std::span<Engine* const> es,
                           std::span<const std::span<const std::int32_t>> toks,
                           bool evict_after_each_layer, bool reconstruct) {
  KVP_REQUIRE(!es.empty() && es.size() == toks.size(), "engine: ", es.size(), " engines for ",
              toks.size(), " token spans");
  KVP_REQUIRE(!reconstruct || (es.size() == 1 && !evict_after_each_layer),
              "engine: a reconstruction pass runs one engine and never evicts");
  Engine& e0 = *es[0];
  const Model& model = e0.model_;
  const ModelConfig& c = model.config();
  const ModelWeights& w = model.weights();
  const int threads = thread_count(e0.cfg_.threads);
  const std::int64_t d = c.head_dim, Hq = c.n_head, Hkv = c.n_head_kv, half = d / 2;
  // Rows of the stacked activations: sequence s owns rows [row0[s], row0[s] + n[s]).
  std::vector<std::int64_t> row0(es.size() + 1, 0);
  for (std::size_t s = 0; s < es.size(); ++s) {
    KVP_REQUIRE(&es[s]->model_ == &model, "engine: a batch must share one model");
    for (std::int32_t t : toks[s])
      KVP_REQUIRE(t >= 0 && t < c.n_vocab, "engine: token id ", t,
                  " is outside the vocabulary [0, ", c.n_vocab, ")");
    row0[s + 1] = row0[s] + static_cast<std::int64_t>(toks[s].size());
  }
  const std::int64_t rows = row0.back();
  Matrix& x = e0.x_;
  Matrix& xn = e0.xn_;
  x.resize(rows, c.n_embd);
  for (std::size_t s = 0; s < es.size(); ++s)
    for (std::size_t i = 0; i < toks[s].size(); ++i)
      w.token_embd.dequantize_rows(toks[s][i], 1,
                                   x.row(row0[s] + static_cast<std::int64_t>(i)).data());

  // Chunk-delimiter flags of every row (semantic merger), from each engine's table.
  std::vector<std::uint8_t> delim(static_cast<std::size_t>(rows));
  for (std::size_t s = 0; s < es.size(); ++s)
    for (std::size_t i = 0; i < toks[s].size(); ++i)
      delim[static_cast<std::size_t>(row0[s]) + i] =
          (*es[s]->delimiter_table_)[static_cast<std::size_t>(toks[s][i])];

  // cos/sin of every (row, frequency), fp32 angles like Hugging Face, at each sequence's own
  // positions.
  std::vector<float> cs(static_cast<std::size_t>(rows * half)), sn(cs.size());
  for (std::size_t s = 0; s < es.size(); ++s)
    for (std::int64_t i = 0; i < row0[s + 1] - row0[s]; ++i)
      for (std::int64_t j = 0; j < half; ++j) {
        const float angle = static_cast<float>(es[s]->position_ + i) *
                            e0.inv_freq_[static_cast<std::size_t>(j)];
        const auto at = static_cast<std::size_t>((row0[s] + i) * half + j);
        cs[at] = std::cos(angle);
        sn[at] = std::sin(angle);
      }
  // Half-split rotation: (x_j, x_{j+d/2}) -> (x_j cos - x_{j+d/2} sin, x_{j+d/2} cos + x_j sin).
  auto rope = [&](Matrix& m, std::int64_t heads) {
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t h = 0; h < heads; ++h) {
        float* v = m.data() + i * heads * d + h * d;
        const float* ci = cs.data() + i * half;
        const float* si = sn.data() + i * half;
        for (std::int64_t j = 0; j < half; ++j) {
          const float a = v[j], b = v[j + half];
          v[j] = a * ci[j] - b * si[j];
          v[j + half] = b * ci[j] + a * si[j];
        }
      }
  };

  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<std::size_t>(l)];
    rms_norm(x, L.attn_norm, c.rms_eps, xn);
    linear(xn, {Product{&L.wq, &e0.q_}, Product{&L.wk, &e0.k_}, Product{&L.wv, &e0.v_}},
           threads);
    rope(e0.q_, Hq);
    rope(e0.k_, Hkv);
    e0.attn_.resize(rows, Hq * d);
    for (std::size_t s = 0; s < es.size(); ++s) {
      Engine& e = *es[s];
      const std::int64_t r0 = row0[s], n = row0[s + 1] - r0;
      if (n == 0) continue;
      // Projections are token-major: rows [r0, r0+n) of [rows][H*d] are the NHD layout of a
      // [1][H][n][d] view.
      const auto qv = KVView<const float>::nhd(e0.q_.data() + r0 * Hq * d, 1, Hq, n, d);
      const auto kv = KVView<const float>::nhd(e0.k_.data() + r0 * Hkv * d, 1, Hkv, n, d);
      const auto vv = KVView<const float>::nhd(e0.v_.data() + r0 * Hkv * d, 1, Hkv, n, d);
      e.attn_hnd_.resize(static_cast<std::size_t>(Hq * n * d));
      if (reconstruct) {
        e.session_.reconstruct(l, kv, vv, qv, e.attn_hnd_.data());
      } else {
        if (e.capture_) e.capture_(LayerCapture{l, e.position_, qv, kv, vv});
        e.session_.append(
            l, kv, vv, qv,
            std::span<const std::uint8_t>(delim.data() + r0, static_cast<std::size_t>(n)));
        e.session_.attend(l, qv, e.attn_hnd_.data());
      }
      if (evict_after_each_layer) e.session_.compress_if_due(l);
      // [Hq][n][d] -> rows [r0, r0+n) of [rows][Hq*d]
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t i = 0; i < n; ++i)
          std::copy_n(e.attn_hnd_.data() + (h * n + i) * d, d,
                      e0.attn_.data() + (r0 + i) * Hq * d + h * d);
    }
    // The reconstruction pass reads only the queries: the last layer's output is not needed.
    if (reconstruct && l + 1 == c.n_layers) return;
    linear(e0.attn_, L.wo, xn, threads);
    x += xn;

    rms_norm(x, L.ffn_norm, c.rms_eps, xn);
    linear(xn, {Product{&L.w_gate, &e0.gate_}, Product{&L.w_up, &e0.up_}}, threads);
    e0.gate_ = (e0.gate_.array() / (1.0f + (-e0.gate_.array()).exp()))
                   .cwiseProduct(e0.up_.array())
                   .matrix();
    linear(e0.gate_, L.w_down, xn, threads);
    x += xn;
  }
  rms_norm(x, w.output_norm, c.rms_eps, xn);
  for (std::size_t s = 0; s < es.size(); ++s) {
    const std::int64_t n = row0[s + 1] - row0[s];
    es[s]->hidden_ = xn.middleRows(row0[s], n);
    es[s]->position_ += n;
    es[s]->tokens_.insert(es[s]->tokens_.end(), toks[s].begin(), toks[s].end());
  }
}

void Engine::reconstruct(ReconstructOptions opt) {
  KVP_REQUIRE(opt.chunk > 0, "engine.reconstruct: chunk must be positive (got ", opt.chunk, ")");
  KVP_REQUIRE(opt.first >= 0 && opt.first < position_, "engine.reconstruct: first ", opt.first,
              " is outside the ", position_, " cached positions");
  KVP_REQUIRE(static_cast<std::int64_t>(tokens_.size()) == position_,
              "engine.reconstruct: the engine's token history is incomplete");
  const Tokenizer& tok = model_.tokenizer();
  // What follows the user message in the chat template (the assistant turn's opener).
  std::string suffix = "\n";
  if (tok.chat_template().find("<|im_start|>") != std::string::npos) {  // ChatML (see Tokenizer)
    const std::string mark = "\x01kvpolicy-reconstruct\x01";
    const std::string t = tok.apply_chat_template({{"user", mark}}, true);
    suffix = t.substr(t.find(mark) + mark.size());
  }
  const auto encode = [&](const std::string& text) { return tok.encode(text, true, false); };
  const std::vector<std::int32_t> first_prompt = encode("\n\nRepeat the previous context exactly.");
  const std::vector<std::int32_t> next_prompt =
      encode("\n\nRepeat the part of the previous context exactly, starting with");
  const std::vector<std::int32_t> opener = encode(suffix);
  constexpr std::int64_t kOverlap = 8;  // tokens of the previous chunk that cue the next one
  const std::int64_t L = model_.config().n_layers;
  std::vector<std::int64_t> capacity(static_cast<std::size_t>(L));
  for (std::int64_t l = 0; l < L; ++l) capacity[static_cast<std::size_t>(l)] = session_.capacity(l);
  session_.clear_reconstruction();
  std::vector<std::int32_t> ids;
  Engine* self = this;
  try {
    for (std::int64_t s = opt.first; s < position_; s += opt.chunk) {
      const std::int64_t e = std::min(position_, s + opt.chunk);
      const auto at = [&](std::int64_t p) { return tokens_.begin() + p; };
      ids = s == opt.first ? first_prompt : next_prompt;
      if (s > opt.first) ids.insert(ids.end(), at(std::max(opt.first, s - kOverlap)), at(s));
      ids.insert(ids.end(), opener.begin(), opener.end());
      ids.insert(ids.end(), at(s), at(e));
      const std::span<const std::int32_t> span(ids);
      forward_multi(std::span<Engine* const>(&self, 1),
                    std::span<const std::span<const std::int32_t>>(&span, 1), false, true);
    }
  } catch (...) {
    session_.clear_reconstruction();  // no partial pass is left to be read as a whole one
    throw;
  }
  // The storage the chunks needed goes back (reserve keeps at least each layer's longest head).
  for (std::int64_t l = 0; l < L; ++l) session_.reserve(l, capacity[static_cast<std::size_t>(l)]);
}

void Engine::step_batch(std::span<Engine* const> engines, std::span<const std::int32_t> tokens) {
  KVP_REQUIRE(engines.size() == tokens.size(), "engine.step_batch: ", engines.size(),
              " engines but ", tokens.size(), " tokens");
  if (engines.empty()) return;
  std::vector<std::span<const std::int32_t>> toks;
  for (std::size_t s = 0; s < engines.size(); ++s) {
    KVP_REQUIRE(engines[s] != nullptr, "engine.step_batch: engine ", s, " is null");
    KVP_REQUIRE(engines[s]->position_ > 0, "engine.step_batch: engine ", s,
                " has no prompt; prefill first");
    for (std::size_t t = 0; t < s; ++t)
      KVP_REQUIRE(engines[t] != engines[s], "engine.step_batch: engine ", s,
                  " appears twice in the batch");
    toks.emplace_back(&tokens[s], 1);
  }
  forward_multi(engines, toks, true);
  // One vocabulary GEMM for the whole batch.
  Matrix hidden(static_cast<Eigen::Index>(engines.size()), engines[0]->model_.config().n_embd);
  for (std::size_t s = 0; s < engines.size(); ++s)
    hidden.row(static_cast<Eigen::Index>(s)) = engines[s]->hidden_.row(0);
  Matrix logits;
  linear(hidden, engines[0]->model_.weights().lm_head(), logits,
         thread_count(engines[0]->cfg_.threads));
  for (std::size_t s = 0; s < engines.size(); ++s) {
    const float* r = logits.row(static_cast<Eigen::Index>(s)).data();
    engines[s]->last_logits_.assign(r, r + logits.cols());
  }
}

std::vector<Matrix> Engine::extend_batch(std::span<Engine* const> engines,
                                         std::span<const std::span<const std::int32_t>> tokens,
                                         std::int64_t logit_rows) {
  KVP_REQUIRE(engines.size() == tokens.size(), "engine.extend_batch: ", engines.size(),
              " engines but ", tokens.size(), " token spans");
  std::vector<Matrix> out(engines.size());
  if (engines.empty()) return out;
  for (std::size_t s = 0; s < engines.size(); ++s) {
    KVP_REQUIRE(engines[s] != nullptr, "engine.extend_batch: engine ", s, " is null");
    KVP_REQUIRE(engines[s]->position_ > 0, "engine.extend_batch: engine ", s,
                " has no prompt; prefill first");
    KVP_REQUIRE(!tokens[s].empty(), "engine.extend_batch: no tokens for engine ", s);
    for (std::size_t t = 0; t < s; ++t)
      KVP_REQUIRE(engines[t] != engines[s], "engine.extend_batch: engine ", s,
                  " appears twice in the batch");
  }
  forward_multi(engines, tokens, false);
  // One vocabulary GEMM over the requested rows of the whole batch.
  auto wanted = [&](std::size_t s) {
    const auto n = static_cast<std::int64_t>(tokens[s].size());
    return logit_rows > 0 ? std::min(n, logit_rows) : n;
  };
  std::int64_t rows = 0;
  for (std::size_t s = 0; s < engines.size(); ++s) rows += wanted(s);
  Matrix hidden(rows, engines[0]->model_.config().n_embd), logits;
  std::int64_t r = 0;
  for (std::size_t s = 0; s < engines.size(); ++s) {
    const std::int64_t m = wanted(s), n = static_cast<std::int64_t>(tokens[s].size());
    hidden.middleRows(r, m) = engines[s]->hidden_.middleRows(n - m, m);
    r += m;
  }
  linear(hidden, engines[0]->model_.weights().lm_head(), logits,
         thread_count(engines[0]->cfg_.threads));
  r = 0;
  for (std::size_t s = 0; s < engines.size(); ++s) {
    const std::int64_t m = wanted(s);
    out[s] = logits.middleRows(r, m);
    r += m;
    const float* last = out[s].row(m - 1).data();
    engines[s]->last_logits_.assign(last, last + out[s].cols());
  }
  return out;
}

void Engine::logits_rows(std::int64_t first, std::int64_t count, Matrix& out) const {
  const Matrix rows = hidden_.middleRows(first, count);
  linear(rows, model_.weights().lm_head(), out, thread_count(cfg_.threads));
}

Matrix Engine::prefill(std::span<const std::int32_t> tokens, bool all_logits) {
  KVP_REQUIRE(position_ == 0, "engine.prefill: the sequence already holds ", position_,
              " tokens; call reset() first, or continue with extend()/step()/teacher_force()");
  return extend(tokens, all_logits);
}

Matrix Engine::extend(std::span<const std::int32_t> tokens, bool all_logits) {
  KVP_REQUIRE(!tokens.empty(), "engine: the prompt is empty");
  const auto n = static_cast<std::int64_t>(tokens.size());
  Matrix out(all_logits ? n : 1, model_.config().n_vocab), chunk_logits;
  for (std::int64_t s = 0; s < n; s += cfg_.prefill_chunk) {
    const std::int64_t m = std::min(cfg_.prefill_chunk, n - s);
    forward(tokens.subspan(static_cast<std::size_t>(s), static_cast<std::size_t>(m)), false);
    if (all_logits) {
      logits_rows(0, m, chunk_logits);
      out.middleRows(s, m) = chunk_logits;
    } else if (s + m == n) {
      logits_rows(m - 1, 1, chunk_logits);
      out.row(0) = chunk_logits.row(0);
    }
  }
  // Compression only after the whole prompt went through, so every prompt token attended the
  // full prompt (as in a one-shot prefill) and the policy sees all of it. A policy that reads
  // context-reconstruction scores (kvzip) gets its pass first, before the first compression.
  if (has(session_.policy().needs(), Needs::reconstruction) && session_.budgets(0).empty() &&
      !session_.reconstructed(0))
    reconstruct(cfg_.reconstruct);
  compress_now();
  last_logits_.assign(out.row(out.rows() - 1).data(), out.row(out.rows() - 1).data() + out.cols());
  return out;
}

std::span<const float> Engine::step(std::int32_t token) {
  KVP_REQUIRE(position_ > 0, "engine.step: prefill a prompt first");
  forward(std::span<const std::int32_t>(&token, 1), true);
  Matrix logits;
  logits_rows(0, 1, logits);
  last_logits_.assign(logits.data(), logits.data() + logits.cols());
  return last_logits_;
}

namespace {
std::int32_t argmax(std::span<const float> v) {
  return static_cast<std::int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}
float log_softmax_at(std::span<const float> v, std::int32_t i) {
  const float mx = *std::max_element(v.begin(), v.end());
  double s = 0;
  for (float x : v) s += std::exp(static_cast<double>(x - mx));
  return static_cast<float>(static_cast<double>(v[static_cast<std::size_t>(i)] - mx) - std::log(s));
}
}  // namespace

std::vector<std::int32_t> Engine::generate(std::int64_t max_new, std::vector<std::int32_t> stop) {
  KVP_REQUIRE(!last_logits_.empty(), "engine.generate: prefill a prompt first");
  if (stop.size() == 1 && stop[0] == -2) stop = {model_.tokenizer().eos()};
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < max_new; ++i) {
    const std::int32_t t = argmax(last_logits_);
    out.push_back(t);
    step(t);
    if (std::find(stop.begin(), stop.end(), t) != stop.end()) break;
  }
  return out;
}

TeacherForced Engine::teacher_force(std::span<const std::int32_t> cont, bool keep_logits) {
  KVP_REQUIRE(!last_logits_.empty(), "engine.teacher_force: prefill a prompt first");
  const auto n = static_cast<std::int64_t>(cont.size());
  const std::int64_t V = model_.config().n_vocab;
  TeacherForced r;
  if (keep_logits) r.logits.resize(n, V);
  Matrix pred(1, V);  // logits that predict cont[i]
  std::copy(last_logits_.begin(), last_logits_.end(), pred.data());
  auto score = [&](std::int64_t i, const float* logits) {
    std::span<const float> row(logits, static_cast<std::size_t>(V));
    r.logprob.push_back(log_softmax_at(row, cont[static_cast<std::size_t>(i)]));
    r.argmax.push_back(argmax(row));
    if (keep_logits) std::copy(row.begin(), row.end(), r.logits.row(i).data());
  };
  if (session_.decode_interval() > 0) {
    for (std::int64_t i = 0; i < n; ++i) {
      score(i, last_logits_.data());
      step(cont[static_cast<std::size_t>(i)]);
    }
    return r;
  }
  Matrix chunk_logits;
  for (std::int64_t s = 0; s < n; s += cfg_.prefill_chunk) {
    const std::int64_t m = std::min(cfg_.prefill_chunk, n - s);
    forward(cont.subspan(static_cast<std::size_t>(s), static_cast<std::size_t>(m)), false);
    logits_rows(0, m, chunk_logits);
    score(s, pred.data());
    for (std::int64_t i = 1; i < m; ++i) score(s + i, chunk_logits.row(i - 1).data());
    pred.row(0) = chunk_logits.row(m - 1);
  }
  last_logits_.assign(pred.data(), pred.data() + V);
  return r;
}

}  // namespace kvpolicy::engine
