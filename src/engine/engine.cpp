#include "engine/engine.hpp"

#include <algorithm>
#include <cmath>

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

// y = x W^T, split over blocks of W's rows on our own OpenMP threads, each block one
// single-threaded Eigen product (a GEMM for prefill chunks, a GEMV for decode). Eigen's built-in
// GEMM parallelism is kept out: its threads busy-wait on each other, which collapses when the
// machine is oversubscribed (measured: 10x slower prefill on a loaded 2-core box), and it never
// parallelizes GEMVs.
//
// Products below kParallelMacs multiply-adds run on the calling thread: a decode step's per-layer
// GEMVs take well under a millisecond each, and a parallel region per GEMV costs more than it
// saves whenever the cores are shared (OpenMP workers spin at the barrier while the thread they
// wait for is descheduled). Prefill chunks and the vocabulary projection stay parallel.
constexpr double kParallelMacs = 8e6;

void linear(const Matrix& x, const Matrix& w, Matrix& y, int threads) {
  y.resize(x.rows(), w.rows());
  const Eigen::Index out = w.rows();
  const double macs =
      static_cast<double>(x.rows()) * static_cast<double>(w.rows()) * static_cast<double>(w.cols());
  if (threads <= 1 || macs < kParallelMacs) {
#if defined(_OPENMP)
    // Eigen would otherwise start omp_get_max_threads() threads of its own.
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
#endif
    y.noalias() = x * w.transpose();
#if defined(_OPENMP)
    omp_set_num_threads(saved);
#endif
    return;
  }
  const Eigen::Index block = std::max<Eigen::Index>(16, (out / (4 * threads) + 15) / 16 * 16);
  const Eigen::Index blocks = (out + block - 1) / block;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
#endif
  for (Eigen::Index b = 0; b < blocks; ++b) {
    const Eigen::Index r0 = b * block, n = std::min(block, out - r0);
    y.middleCols(r0, n).noalias() = x * w.middleRows(r0, n).transpose();
  }
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

}  // namespace

SessionConfig Engine::session_config(const Model& m, const EngineConfig& c) {
  SessionConfig s;
  s.layers = m.config().n_layers;
  s.kv_heads = m.config().n_head_kv;
  s.q_heads = m.config().n_head;
  s.head_dim = m.config().head_dim;
  s.budget = c.budget;
  s.backend = cpu_backend{c.threads};
  return s;
}

Engine::Engine(const Model& model, EngineConfig cfg)
    : model_(model),
      cfg_(std::move(cfg)),
      session_(Policy(cfg_.policy), session_config(model, cfg_)) {
  KVP_REQUIRE(cfg_.prefill_chunk > 0, "engine: prefill_chunk must be positive (got ",
              cfg_.prefill_chunk, ")");
  // RoPE frequencies as Hugging Face computes them (fp32): base^(-2i/d), optionally divided by
  // per-frequency factors (Llama 3.1 style rope_freqs).
  const std::int64_t d = model.config().head_dim;
  const auto& factors = model.weights().rope_freq_factors;
  inv_freq_.resize(static_cast<std::size_t>(d / 2));
  for (std::int64_t i = 0; i < d / 2; ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(d);
    float f = 1.0f / static_cast<float>(std::pow(static_cast<double>(model.config().rope_base),
                                                 static_cast<double>(expo)));
    if (factors.size()) f /= factors[i];
    inv_freq_[static_cast<std::size_t>(i)] = f;
  }
}

void Engine::reset() {
  session_ = Session<float>(Policy(cfg_.policy), session_config(model_, cfg_));
  position_ = 0;
  last_logits_.clear();
}

void Engine::forward(std::span<const std::int32_t> tokens, bool evict_after_each_layer) {
  const ModelConfig& c = model_.config();
  const ModelWeights& w = model_.weights();
  const int threads = thread_count(cfg_.threads);
  const auto n = static_cast<std::int64_t>(tokens.size());
  const std::int64_t d = c.head_dim, Hq = c.n_head, Hkv = c.n_head_kv, p0 = position_;
  for (std::int32_t t : tokens)
    KVP_REQUIRE(t >= 0 && t < c.n_vocab, "engine: token id ", t, " is outside the vocabulary [0, ",
                c.n_vocab, ")");

  x_.resize(n, c.n_embd);
  for (std::int64_t i = 0; i < n; ++i)
    x_.row(i) = w.token_embd.row(tokens[static_cast<std::size_t>(i)]);

  // cos/sin of every (position, frequency) of this chunk, fp32 angles like Hugging Face.
  const std::int64_t half = d / 2;
  std::vector<float> cs(static_cast<std::size_t>(n * half)), sn(cs.size());
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < half; ++j) {
      const float angle = static_cast<float>(p0 + i) * inv_freq_[static_cast<std::size_t>(j)];
      cs[static_cast<std::size_t>(i * half + j)] = std::cos(angle);
      sn[static_cast<std::size_t>(i * half + j)] = std::sin(angle);
    }
  // Half-split rotation: (x_j, x_{j+d/2}) -> (x_j cos - x_{j+d/2} sin, x_{j+d/2} cos + x_j sin).
  auto rope = [&](Matrix& m, std::int64_t heads) {
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t h = 0; h < heads; ++h) {
        float* x = m.data() + i * heads * d + h * d;
        const float* ci = cs.data() + i * half;
        const float* si = sn.data() + i * half;
        for (std::int64_t j = 0; j < half; ++j) {
          const float a = x[j], b = x[j + half];
          x[j] = a * ci[j] - b * si[j];
          x[j + half] = b * ci[j] + a * si[j];
        }
      }
  };

  attn_hnd_.resize(static_cast<std::size_t>(Hq * n * d));
  for (std::int64_t l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<std::size_t>(l)];
    rms_norm(x_, L.attn_norm, c.rms_eps, xn_);
    linear(xn_, L.wq, q_, threads);
    linear(xn_, L.wk, k_, threads);
    linear(xn_, L.wv, v_, threads);
    rope(q_, Hq);
    rope(k_, Hkv);
    // Projections are token-major: [n][H*d] is the NHD layout of a [1][H][n][d] view.
    const auto qv = KVView<const float>::nhd(q_.data(), 1, Hq, n, d);
    const auto kv = KVView<const float>::nhd(k_.data(), 1, Hkv, n, d);
    const auto vv = KVView<const float>::nhd(v_.data(), 1, Hkv, n, d);
    if (capture_) capture_(LayerCapture{l, p0, qv, kv, vv});
    session_.append(l, kv, vv, qv);
    session_.attend(l, qv, attn_hnd_.data());
    if (evict_after_each_layer) session_.compress_if_due(l);
    // [Hq][n][d] -> [n][Hq*d]
    attn_.resize(n, Hq * d);
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < n; ++i)
        std::copy_n(attn_hnd_.data() + (h * n + i) * d, d, attn_.data() + i * Hq * d + h * d);
    linear(attn_, L.wo, xn_, threads);
    x_ += xn_;

    rms_norm(x_, L.ffn_norm, c.rms_eps, xn_);
    linear(xn_, L.w_gate, gate_, threads);
    linear(xn_, L.w_up, up_, threads);
    gate_ = (gate_.array() / (1.0f + (-gate_.array()).exp())).cwiseProduct(up_.array()).matrix();
    linear(gate_, L.w_down, xn_, threads);
    x_ += xn_;
  }
  rms_norm(x_, w.output_norm, c.rms_eps, hidden_);
  position_ += n;
}

void Engine::logits_rows(std::int64_t first, std::int64_t count, Matrix& out) const {
  const Matrix rows = hidden_.middleRows(first, count);
  linear(rows, model_.weights().lm_head(), out, thread_count(cfg_.threads));
}

Matrix Engine::prefill(std::span<const std::int32_t> tokens, bool all_logits) {
  KVP_REQUIRE(position_ == 0, "engine.prefill: the sequence already holds ", position_,
              " tokens; call reset() first, or continue with step()/teacher_force()");
  KVP_REQUIRE(!tokens.empty(), "engine.prefill: the prompt is empty");
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
  // full prompt (as in a one-shot prefill) and the policy sees all of it.
  for (std::int64_t l = 0; l < model_.config().n_layers; ++l) session_.compress_if_due(l);
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
  if (session_.policy().decode_time()) {
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
