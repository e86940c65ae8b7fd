#include "tasks.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

#include "kvpolicy/core/error.hpp"

namespace kvbench {

namespace {

constexpr const char* kIntro =
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it "
    "and memorize it. I will quiz you about the important information there.";
constexpr const char* kUnit =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
// The instruct model answers reliably with this wording (measured: 5/5 at 1K and 2K), not when
// the answer is primed with "The pass key is" after the assistant header (2/5 at 1K).
constexpr const char* kQuestion =
    "\n\nWhat is the pass key? Answer with the 5-digit number only.";
constexpr const char* kMark = "\x01KVPOLICY_USER_CONTENT\x01";

}  // namespace

std::string depthkv_stage(const std::string& profile_dir) {
  return "depthkv(profile=" + profile_dir + "/SmolLM2-135M-Instruct.snapkv.json)";
}

std::vector<std::string> default_policies(const std::string& profile_dir) {
  return {"streaming",      "h2o",          "snapkv",       "tova",
          "knorm",          "keydiff",      "snapkv | pyramid", "snapkv | adakv",
          "snapkv | ams",   "snapkv | " + depthkv_stage(profile_dir)};
}

PasskeyPieces passkey_pieces(const Model& m, const std::string& key_digits) {
  const auto& tok = m.tokenizer();
  const std::string chat = tok.apply_chat_template({{"user", kMark}}, true);
  const auto at = chat.find(kMark);
  KVP_REQUIRE(at != std::string::npos, "passkey: the chat template dropped the user message");
  const std::string pre = chat.substr(0, at), post = chat.substr(at + std::string(kMark).size());
  PasskeyPieces p;
  p.key_digits = key_digits;
  p.head = tok.encode(pre + kIntro, true, false);
  p.unit = tok.encode(kUnit, false, false);
  p.key = tok.encode(" The pass key is " + key_digits + ". Remember it. " + key_digits +
                         " is the pass key.",
                     false, false);
  p.question = tok.encode(kQuestion + post, true, false);
  return p;
}

std::int64_t passkey_units(const PasskeyPieces& p, std::int64_t target_tokens) {
  const auto fixed = static_cast<std::int64_t>(p.head.size() + p.key.size() + p.question.size());
  const auto unit = static_cast<std::int64_t>(p.unit.size());
  KVP_REQUIRE(target_tokens >= fixed + unit, "passkey: ", target_tokens,
              " tokens is too short for the prompt (at least ", fixed + unit, ")");
  return (target_tokens - fixed) / unit;
}

std::string passkey_digits(std::uint64_t seed, std::int64_t length, double depth) {
  std::mt19937_64 rng(seed * 1000003u + static_cast<std::uint64_t>(length) * 31u +
                      static_cast<std::uint64_t>(std::lround(depth * 1000)));
  return std::to_string(std::uniform_int_distribution<int>(10000, 99999)(rng));
}

void append_units(std::vector<std::int32_t>& out, const PasskeyPieces& p, std::int64_t units) {
  for (std::int64_t i = 0; i < units; ++i) out.insert(out.end(), p.unit.begin(), p.unit.end());
}

std::string first_five_digits(const std::string& text) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    std::size_t j = i;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    if (j - i >= 5) return text.substr(i, 5);
    i = j;
  }
  return {};
}

std::vector<std::vector<std::int32_t>> generate_batch(const std::vector<Engine*>& es,
                                                      std::int64_t max_new) {
  std::vector<std::vector<std::int32_t>> out(es.size());
  std::vector<std::size_t> active(es.size());
  for (std::size_t i = 0; i < es.size(); ++i) active[i] = i;
  for (std::int64_t step = 0; step < max_new && !active.empty(); ++step) {
    std::vector<Engine*> batch;
    std::vector<std::int32_t> next;
    for (std::size_t i : active) {
      const auto logits = es[i]->last_logits();
      const auto t = static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                               logits.begin());
      out[i].push_back(t);
      if (t != es[i]->model().tokenizer().eos() && step + 1 < max_new) {
        batch.push_back(es[i]);
        next.push_back(t);
      }
    }
    Engine::step_batch(batch, next);
    std::vector<std::size_t> still;
    for (std::size_t i : active)
      if (out[i].back() != es[i]->model().tokenizer().eos()) still.push_back(i);
    active.swap(still);
  }
  return out;
}

FidelityText load_fidelity_text(const Model& m, const std::string& path, std::int64_t prompt_tokens,
                                std::int64_t cont_tokens) {
  std::ifstream f(path, std::ios::binary);
  KVP_REQUIRE(f.good(), "fidelity: cannot read ", path,
              " (the texts come from Debian's base-files package, /usr/share/common-licenses)");
  std::stringstream ss;
  ss << f.rdbuf();
  FidelityText t;
  t.name = path.substr(path.find_last_of('/') + 1);
  const auto ids = m.tokenizer().encode(ss.str(), false, false);
  KVP_REQUIRE(static_cast<std::int64_t>(ids.size()) >= prompt_tokens + cont_tokens, "fidelity: ",
              path, " has ", ids.size(), " tokens, fewer than the ", prompt_tokens + cont_tokens,
              " needed");
  t.prompt.assign(ids.begin(), ids.begin() + prompt_tokens);
  t.continuation.assign(ids.begin() + prompt_tokens, ids.begin() + prompt_tokens + cont_tokens);
  return t;
}

void log_softmax(std::span<float> row) {
  const float mx = *std::max_element(row.begin(), row.end());
  double s = 0;
  for (float x : row) s += std::exp(static_cast<double>(x - mx));
  const auto lse = static_cast<float>(static_cast<double>(mx) + std::log(s));
  for (float& x : row) x -= lse;
}

Reference reference_run(Engine& full, std::span<const std::int32_t> cont) {
  auto tf = full.teacher_force(cont, true);
  Reference r;
  r.logp = std::move(tf.logits);
  r.argmax = std::move(tf.argmax);
  for (Eigen::Index i = 0; i < r.logp.rows(); ++i)
    log_softmax(std::span<float>(r.logp.row(i).data(), static_cast<std::size_t>(r.logp.cols())));
  double nll = 0;
  for (float lp : tf.logprob) nll -= lp;
  r.nll = cont.empty() ? 0.0 : nll / static_cast<double>(cont.size());
  return r;
}

Fidelity compare_run(Engine& policy, std::span<const std::int32_t> cont, const Reference& ref) {
  auto tf = policy.teacher_force(cont, true);
  const auto n = static_cast<Eigen::Index>(cont.size());
  KVP_REQUIRE(tf.logits.rows() == n && ref.logp.rows() == n, "fidelity: row count mismatch");
  Fidelity f;
  double kl = 0, nll = 0;
  std::int64_t agree = 0;
  std::vector<float> row(static_cast<std::size_t>(tf.logits.cols()));
  for (Eigen::Index i = 0; i < n; ++i) {
    std::copy_n(tf.logits.row(i).data(), row.size(), row.begin());
    log_softmax(row);
    const float* p = ref.logp.row(i).data();
    double k = 0;
    for (std::size_t j = 0; j < row.size(); ++j)
      k += std::exp(static_cast<double>(p[j])) * (static_cast<double>(p[j]) - row[j]);
    kl += std::max(0.0, k);
    nll -= tf.logprob[static_cast<std::size_t>(i)];
    agree += tf.argmax[static_cast<std::size_t>(i)] == ref.argmax[static_cast<std::size_t>(i)];
  }
  if (n > 0) {
    f.kl = kl / static_cast<double>(n);
    f.nll = nll / static_cast<double>(n);
    f.top1 = static_cast<double>(agree) / static_cast<double>(n);
    f.delta_nll = f.nll - ref.nll;
  }
  return f;
}

std::vector<Fidelity> compare_run_batch(const std::vector<Engine*>& es,
                                        std::span<const std::int32_t> cont, const Reference& ref,
                                        std::vector<std::vector<double>>* kl_pos,
                                        std::vector<std::vector<std::uint8_t>>* agree_pos) {
  const auto n = static_cast<Eigen::Index>(cont.size());
  if (kl_pos) kl_pos->assign(es.size(), std::vector<double>(static_cast<std::size_t>(n), 0.0));
  if (agree_pos)
    agree_pos->assign(es.size(), std::vector<std::uint8_t>(static_cast<std::size_t>(n), 0));
  std::vector<Fidelity> f(es.size());
  std::vector<double> kl(es.size(), 0), nll(es.size(), 0);
  std::vector<std::int64_t> agree(es.size(), 0);
  std::vector<float> row;
  std::vector<std::int32_t> next(es.size());
  for (Eigen::Index i = 0; i < n; ++i) {
    const float* p = ref.logp.row(i).data();
    for (std::size_t s = 0; s < es.size(); ++s) {
      const auto logits = es[s]->last_logits();
      row.assign(logits.begin(), logits.end());
      const auto am = std::max_element(row.begin(), row.end()) - row.begin();
      log_softmax(row);
      double k = 0;
      for (std::size_t j = 0; j < row.size(); ++j)
        k += std::exp(static_cast<double>(p[j])) * (static_cast<double>(p[j]) - row[j]);
      kl[s] += std::max(0.0, k);
      nll[s] -= row[static_cast<std::size_t>(cont[static_cast<std::size_t>(i)])];
      agree[s] += am == ref.argmax[static_cast<std::size_t>(i)];
      if (kl_pos) (*kl_pos)[s][static_cast<std::size_t>(i)] = std::max(0.0, k);
      if (agree_pos)
        (*agree_pos)[s][static_cast<std::size_t>(i)] = am == ref.argmax[static_cast<std::size_t>(i)];
      next[s] = cont[static_cast<std::size_t>(i)];
    }
    Engine::step_batch(es, next);
  }
  for (std::size_t s = 0; s < es.size() && n > 0; ++s) {
    f[s].kl = kl[s] / static_cast<double>(n);
    f[s].nll = nll[s] / static_cast<double>(n);
    f[s].top1 = static_cast<double>(agree[s]) / static_cast<double>(n);
    f[s].delta_nll = f[s].nll - ref.nll;
  }
  return f;
}

}  // namespace kvbench
