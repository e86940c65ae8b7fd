#include "retrieval.hpp"

#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <memory>
#include <random>

#include "kvpolicy/core/error.hpp"

namespace kvbench {

namespace {

constexpr const char* kFull = "streaming";  // with Budget::ratio(1.0): keeps every token
constexpr const char* kMark = "\x01KVPOLICY_USER_CONTENT\x01";
// Forks compress once: a decode interval no sequence reaches.
constexpr std::int64_t kNever = std::int64_t{1} << 40;

constexpr const char* kFillerUnit =
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

// Needle keys: common nouns, one token-friendly word each.
const std::vector<std::string>& key_words() {
  static const std::vector<std::string> w = {
      "apple",  "river",   "candle", "garden", "mirror", "pencil",  "window", "forest",
      "bottle", "ladder",  "violin", "anchor", "basket", "compass", "dragon", "feather",
      "harbor", "island",  "jacket", "kettle", "lantern", "meadow", "needle", "orchard",
      "parrot", "quarry",  "saddle", "tunnel", "tiger",  "valley",  "wagon",  "yacht",
      "blanket", "cabinet", "desert", "engine", "falcon", "glacier", "hammer", "helmet",
      "marble", "pepper",  "rocket", "silver", "thunder", "velvet", "walnut", "zebra"};
  return w;
}

// A 64-bit seed from the prompt's identity; the calibration set lives in another seed space.
std::uint64_t prompt_seed(PromptSet set, const std::string& task, std::int64_t length,
                          std::int64_t index) {
  std::uint64_t h = set == PromptSet::eval ? 0x9e3779b97f4a7c15ull : 0xc2b2ae3d27d4eb4full;
  for (char c : task) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ull;
  h ^= static_cast<std::uint64_t>(length) * 0xff51afd7ed558ccdull;
  h ^= static_cast<std::uint64_t>(index) * 0xd6e8feb86659fd93ull;
  return h;
}

// Uniform integer in [lo, hi] from raw 64-bit draws (the same on every standard library,
// unlike std::uniform_int_distribution).
std::int64_t draw(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  const auto span = static_cast<std::uint64_t>(hi - lo + 1);
  return lo + static_cast<std::int64_t>(rng() % span);
}
double draw_unit(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

std::string number(std::mt19937_64& rng) { return std::to_string(draw(rng, 10000, 99999)); }

std::string read_file(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");  // reads plain files as they are
  KVP_REQUIRE(f != nullptr, "corpus: cannot open ", path,
              " (scripts/setup.sh installs the Debian packages that provide the corpora)");
  std::string out;
  char buf[1 << 16];
  int n = 0;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  int err = 0;
  const char* msg = gzerror(f, &err);
  const std::string why = err != Z_OK && err != Z_STREAM_END ? msg : "";
  gzclose(f);
  KVP_REQUIRE(n == 0 && why.empty(), "corpus: ", path, " is corrupt or truncated (", why, ")");
  return out;
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == '\f'; }

// What a prompt is made of before tokenization.
struct Needle {
  std::string text;
  double depth = 0;
  bool asked = false;  // holds the answer (multivalue: its first value)
};

// Haystack tokens of about `budget` tokens: filler units, or a window of a corpus starting at
// a seeded sentence boundary. Needles are inserted at their depth (between filler units, or
// at the nearest sentence boundary), in order of depth.
std::vector<std::int32_t> haystack(const Model& m, const Corpus* corpus,
                                   std::vector<Needle>& needles, std::int64_t budget,
                                   std::mt19937_64& rng, std::string& source) {
  const auto& tok = m.tokenizer();
  std::vector<std::vector<std::int32_t>> needle_ids;
  std::int64_t needle_tokens = 0;
  std::sort(needles.begin(), needles.end(),
            [](const Needle& a, const Needle& b) { return a.depth < b.depth; });
  for (const auto& n : needles) {
    needle_ids.push_back(tok.encode(n.text, false, false));
    needle_tokens += static_cast<std::int64_t>(needle_ids.back().size());
  }
  const std::int64_t body = budget - needle_tokens;
  KVP_REQUIRE(body > 16, "retrieval: ", budget, " haystack tokens cannot hold the needles");
  std::vector<std::int32_t> out;
  if (corpus == nullptr) {
    source = "filler";
    const auto unit = tok.encode(kFillerUnit, false, false);
    const auto units = body / static_cast<std::int64_t>(unit.size());
    std::size_t next = 0;
    for (std::int64_t u = 0; u <= units; ++u) {
      while (next < needles.size() &&
             static_cast<std::int64_t>(std::lround(needles[next].depth * static_cast<double>(units))) == u)
        out.insert(out.end(), needle_ids[next].begin(), needle_ids[next].end()), ++next;
      if (u < units) out.insert(out.end(), unit.begin(), unit.end());
    }
    return out;
  }
  source = corpus->name;
  const auto total = static_cast<std::int64_t>(corpus->ids.size());
  KVP_REQUIRE(total > body + 2, "retrieval: corpus ", corpus->path, " has ", total,
              " tokens, too few for a haystack of ", body);
  // Start at a sentence boundary (the first one at or after a random offset).
  std::int64_t start = draw(rng, 0, total - body - 1);
  while (start < total - body - 1 && !corpus->boundary[static_cast<std::size_t>(start)]) ++start;
  const std::int64_t end = start + body;
  std::size_t next = 0;
  for (std::int64_t i = start; i < end; ++i) {
    // Needle k goes before the first boundary at or after its depth.
    const double at = static_cast<double>(i - start) / static_cast<double>(body);
    while (next < needles.size() && at >= needles[next].depth &&
           (corpus->boundary[static_cast<std::size_t>(i)] || i == start)) {
      needles[next].depth = at;
      out.insert(out.end(), needle_ids[next].begin(), needle_ids[next].end());
      ++next;
    }
    out.push_back(corpus->ids[static_cast<std::size_t>(i)]);
  }
  for (; next < needles.size(); ++next) {  // past the last boundary: at the end
    needles[next].depth = 1.0;
    out.insert(out.end(), needle_ids[next].begin(), needle_ids[next].end());
  }
  return out;
}

struct Chat {
  std::string pre, post;  // the template around the user message
};
Chat chat(const Model& m) {
  const std::string t = m.tokenizer().apply_chat_template({{"user", kMark}}, true);
  const auto at = t.find(kMark);
  KVP_REQUIRE(at != std::string::npos, "retrieval: the chat template dropped the user message");
  return {t.substr(0, at), t.substr(at + std::string(kMark).size())};
}

}  // namespace

const char* prompt_set_name(PromptSet s) {
  return s == PromptSet::eval ? "eval" : "calibration";
}

std::vector<std::string> corpus_paths(PromptSet s) {
  if (s == PromptSet::eval)
    return {"/usr/share/common-licenses/GPL-3",
            "/usr/share/doc/debian-policy/policy.txt.gz",
            "/usr/share/developers-reference/developers-reference.txt.gz",
            "/usr/share/doc/gnu-standards/standards.text.gz",
            "/usr/share/debian-reference/debian-reference.en.txt.gz"};
  return {"/usr/share/common-licenses/LGPL-2.1", "/usr/share/common-licenses/GFDL-1.3",
          "/usr/share/doc/debian/constitution.txt.gz"};
}

Corpus load_corpus(const Model& m, const std::string& path, double skip_fraction) {
  KVP_REQUIRE(skip_fraction >= 0 && skip_fraction < 1, "corpus: skip_fraction ", skip_fraction,
              " is outside [0, 1)");
  const std::string raw = read_file(path);
  std::string text;
  text.reserve(raw.size());
  bool space = true;  // also drops leading whitespace
  for (char c : raw) {
    if (is_space(c)) {
      if (!space) text.push_back(' ');
      space = true;
    } else {
      text.push_back(c);
      space = false;
    }
  }
  if (!text.empty() && text.back() == ' ') text.pop_back();
  // Skip the front matter, then start at a word.
  std::size_t from = static_cast<std::size_t>(skip_fraction * static_cast<double>(text.size()));
  if (from > 0)
    while (from < text.size() && text[from] != ' ') ++from;
  Corpus c;
  c.path = path;
  auto name = path.substr(path.find_last_of('/') + 1);
  for (const char* ext : {".gz", ".txt", ".text", ".en"})
    if (name.size() > std::string(ext).size() && name.ends_with(ext))
      name.resize(name.size() - std::string(ext).size());
  for (const char* ext : {".txt", ".en"})
    if (name.ends_with(ext)) name.resize(name.size() - std::string(ext).size());
  c.name = name;
  c.ids = m.tokenizer().encode(std::string_view(text).substr(from), false, false);
  KVP_REQUIRE(c.ids.size() >= 4096, "corpus: ", path, " has only ", c.ids.size(),
              " tokens after its front matter; a corpus needs at least 4096");
  c.boundary.assign(c.ids.size(), 0);
  std::string prev = m.tokenizer().token(c.ids[0]);
  for (std::size_t i = 1; i < c.ids.size(); ++i) {
    const std::string cur = m.tokenizer().decode(std::span<const std::int32_t>(&c.ids[i], 1));
    c.boundary[i] = !prev.empty() && prev.back() == '.' && !cur.empty() && cur.front() == ' ';
    prev = cur;
  }
  return c;
}

const std::vector<std::string>& retrieval_tasks() {
  static const std::vector<std::string> t = {"passkey", "niah", "multikey", "multivalue",
                                             "vartrack"};
  return t;
}

const char* regime_name(Regime r) {
  return r == Regime::question_known ? "question-known" : "question-agnostic";
}

RetrievalPrompt make_retrieval_prompt(const Model& m, const std::vector<Corpus>& corpora,
                                      PromptSet set, const std::string& task, std::int64_t length,
                                      std::int64_t index) {
  const auto& tasks = retrieval_tasks();
  KVP_REQUIRE(std::find(tasks.begin(), tasks.end(), task) != tasks.end(),
              "retrieval: unknown task '", task,
              "' (passkey, niah, multikey, multivalue, vartrack)");
  KVP_REQUIRE(index >= 0, "retrieval: prompt index ", index, " is negative");
  std::mt19937_64 rng(prompt_seed(set, task, length, index));
  const auto& tok = m.tokenizer();
  const Chat c = chat(m);
  RetrievalPrompt p;
  p.task = task;
  p.length = length;
  p.index = index;
  std::string intro, question, prefix;
  std::vector<Needle> needles;
  const bool text = task != "passkey" && task != "vartrack";
  const auto& words = key_words();
  auto pick_words = [&](std::size_t n) {
    std::vector<std::string> out;
    while (out.size() < n) {
      const auto& w = words[static_cast<std::size_t>(draw(rng, 0, static_cast<std::int64_t>(words.size()) - 1))];
      if (std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
    }
    return out;
  };
  if (task == "passkey") {
    intro = "There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the important information there.";
    const std::string key = number(rng);
    needles.push_back({" The pass key is " + key + ". Remember it. " + key + " is the pass key.",
                       draw_unit(rng), true});
    question = "What is the pass key? Answer with the 5-digit number only.";
    prefix = "The pass key is";
    p.answer_text = key;
  } else if (task == "niah" || task == "multikey") {
    intro = "Some special magic numbers are hidden inside the following text. Make sure to "
            "memorize them. I will quiz you about the numbers afterwards.";
    const auto keys = pick_words(task == "niah" ? 1 : 4);
    std::vector<std::string> values;
    for (const auto& k : keys) {
      values.push_back(number(rng));
      needles.push_back({" The special magic number for " + k + " is " + values.back() + ".",
                         draw_unit(rng)});
    }
    const auto asked = static_cast<std::size_t>(draw(rng, 0, static_cast<std::int64_t>(keys.size()) - 1));
    needles[asked].asked = true;
    question = "What is the special magic number for " + keys[asked] +
               " mentioned in the text? Answer with the number only.";
    prefix = "The special magic number for " + keys[asked] + " mentioned in the text is";
    p.answer_text = values[asked];
  } else if (task == "multivalue") {
    intro = "Some special magic numbers are hidden inside the following text. Make sure to "
            "memorize them. I will quiz you about the numbers afterwards.";
    const auto keys = pick_words(2);  // keys[0] is asked, keys[1] is a distractor
    std::vector<Needle> asked;
    for (int v = 0; v < 2; ++v)
      asked.push_back({" One of the special magic numbers for " + keys[0] + " is " + number(rng) +
                           ".",
                       draw_unit(rng)});
    std::sort(asked.begin(), asked.end(),
              [](const Needle& a, const Needle& b) { return a.depth < b.depth; });
    std::vector<std::string> values;
    asked[0].asked = true;
    for (const auto& n : asked) {
      const auto is = n.text.rfind(" is ");
      values.push_back(n.text.substr(is + 4, n.text.size() - is - 5));
      needles.push_back(n);
    }
    needles.push_back({" One of the special magic numbers for " + keys[1] + " is " + number(rng) +
                           ".",
                       draw_unit(rng)});
    question = "What are all the special magic numbers for " + keys[0] +
               " mentioned in the text? List them in order.";
    // The model answers with a numbered list; the reply's prefix opens it.
    prefix = "The special magic numbers for " + keys[0] + " mentioned in the text are:\n\n1.";
    p.answer_text = values[0] + "\n2. " + values[1];
  } else {  // vartrack
    intro = "Memorize and track the chain of variable assignments hidden in the following text.";
    auto name = [&] {
      std::string s = "VAR ";
      for (int i = 0; i < 5; ++i) s.push_back(static_cast<char>('A' + draw(rng, 0, 25)));
      return s;
    };
    const std::string x = name(), y = name(), dx = name(), dy = name();
    const std::string value = number(rng), other = number(rng);
    double d1 = draw_unit(rng), d2 = draw_unit(rng);
    if (d1 > d2) std::swap(d1, d2);
    double e1 = draw_unit(rng), e2 = draw_unit(rng);
    if (e1 > e2) std::swap(e1, e2);
    needles.push_back({" " + x + " = " + value + ".", d1, true});
    needles.push_back({" " + y + " = " + x + ".", d2});
    needles.push_back({" " + dx + " = " + other + ".", e1});
    needles.push_back({" " + dy + " = " + dx + ".", e2});
    question = "What is the value of " + y + "? Answer with the number only.";
    prefix = "The value of " + y + " is";
    p.answer_text = value;
  }
  p.context = tok.encode(c.pre + intro, true, false);
  p.header = static_cast<std::int64_t>(tok.encode(c.pre, true, false).size());
  p.question = tok.encode("\n\n" + question + c.post, true, false);
  // The answer's tokens as they follow the prefix in one reply (BPE must not merge across).
  p.prefix = tok.encode(prefix, false, false);
  const auto reply = tok.encode(prefix + " " + p.answer_text, false, false);
  KVP_REQUIRE(reply.size() > p.prefix.size() &&
                  std::equal(p.prefix.begin(), p.prefix.end(), reply.begin()),
              "retrieval: the tokenizer merges the reply prefix '", prefix, "' with its answer");
  p.answer.assign(reply.begin() + static_cast<std::ptrdiff_t>(p.prefix.size()), reply.end());
  const std::int64_t fixed = static_cast<std::int64_t>(p.context.size() + p.question.size());
  KVP_REQUIRE(length >= fixed + 64, "retrieval: ", length, " tokens is too short for a ", task,
              " prompt (at least ", fixed + 64, ")");
  const Corpus* corpus = nullptr;
  if (text) {
    KVP_REQUIRE(!corpora.empty(), "retrieval: task ", task, " needs a real-text corpus");
    corpus = &corpora[static_cast<std::size_t>(draw(rng, 0, static_cast<std::int64_t>(corpora.size()) - 1))];
  }
  const auto hay = haystack(m, corpus, needles, length - fixed, rng, p.source);
  p.context.insert(p.context.end(), hay.begin(), hay.end());
  for (const auto& n : needles) {
    p.depths.push_back(n.depth);
    if (n.asked) p.asked_depth = n.depth;
  }
  return p;
}

AnswerScore score_answer(const kvpolicy::engine::Matrix& logits,
                         std::span<const std::int32_t> answer) {
  KVP_REQUIRE(logits.rows() == static_cast<Eigen::Index>(answer.size()),
              "score_answer: ", logits.rows(), " logit rows for ", answer.size(), " answer tokens");
  AnswerScore s;
  s.em = true;
  std::vector<float> row(static_cast<std::size_t>(logits.cols()));
  for (std::size_t j = 0; j < answer.size(); ++j) {
    std::copy_n(logits.row(static_cast<Eigen::Index>(j)).data(), row.size(), row.begin());
    const auto am = std::max_element(row.begin(), row.end()) - row.begin();
    s.em = s.em && am == answer[j];
    log_softmax(row);
    s.logp += row[static_cast<std::size_t>(answer[j])];
  }
  return s;
}

RetrievalOutcome run_retrieval(const Model& m, const RetrievalPrompt& p,
                               const std::vector<GridPoint>& grid,
                               const std::vector<Regime>& regimes, const EngineConfig& full_cfg,
                               std::int64_t greedy_tokens) {
  using kvpolicy::Budget;
  using kvpolicy::engine::Matrix;
  KVP_REQUIRE(!p.answer.empty(), "retrieval: empty answer");
  const auto A = static_cast<std::int64_t>(p.answer.size());
  RetrievalOutcome out;
  Engine full(m, full_cfg);
  full.prefill(p.context);
  // kvzip reads the scores of a pass that repeats the context (the chat header left out, as
  // kvpress does); the forks copy them.
  const bool recon = std::any_of(grid.begin(), grid.end(), [](const GridPoint& g) {
    return has(kvpolicy::Policy(g.policy).needs(), kvpolicy::Needs::reconstruction);
  });
  const kvpolicy::engine::ReconstructOptions recon_opt{2048, p.header};
  if (recon) full.reconstruct(recon_opt);

  // Appended after the context: question + prefix + answer without its last token; its last
  // A logit rows predict the answer. After the question (question-known): prefix + answer
  // without its last token, and when the prefix is empty the first answer token is predicted
  // by the prompt's last logits.
  std::vector<std::int32_t> qa = p.question, pa = p.prefix;
  qa.insert(qa.end(), p.prefix.begin(), p.prefix.end());
  qa.insert(qa.end(), p.answer.begin(), p.answer.end() - 1);
  pa.insert(pa.end(), p.answer.begin(), p.answer.end() - 1);
  const std::span<const std::int32_t> qa_span(qa);

  // Full cache: scored once (no compression: both regimes see the same cache).
  {
    Engine ref = full.fork(kFull, Budget::ratio(1.0));
    Engine* e = &ref;
    const auto logits = Engine::extend_batch(std::span<Engine* const>(&e, 1),
                                             std::span<const std::span<const std::int32_t>>(&qa_span, 1), A);
    out.full = score_answer(logits[0], p.answer);
  }
  if (greedy_tokens > 0) {
    Engine g = full.fork(kFull, Budget::ratio(1.0));
    std::vector<std::int32_t> head = p.question;
    head.insert(head.end(), p.prefix.begin(), p.prefix.end());
    g.extend(head);
    // Long enough for the whole answer (one token per digit) and the character after it.
    const auto ids = g.generate(std::max<std::int64_t>(greedy_tokens, A + 2));
    out.full_greedy = m.tokenizer().decode(ids);
    const std::string trimmed = out.full_greedy.substr(
        std::min(out.full_greedy.find_first_not_of(" \n"), out.full_greedy.size()));
    const std::size_t n = p.answer_text.size();
    // The answer, not followed by another digit (12345 must not match 123456).
    out.full_greedy_match = trimmed.starts_with(p.answer_text) &&
                            (trimmed.size() == n || !std::isdigit(static_cast<unsigned char>(trimmed[n])));
  }

  // The forks of one regime go through one batched forward pass, in groups that bound memory.
  constexpr std::size_t kGroup = 16;
  for (Regime r : regimes) {
    std::vector<AnswerScore> scores(grid.size());
    std::vector<double> kept(grid.size(), 0.0);
    if (grid.empty()) {  // full-cache curve only
      out.cells.emplace_back();
      out.kept_fraction.emplace_back();
      continue;
    }
    std::unique_ptr<Engine> base;  // question-known: the full prompt, question included
    if (r == Regime::question_known) {
      base = std::make_unique<Engine>(full.fork(kFull, Budget::ratio(1.0)));
      base->extend(p.question);
      if (recon) base->reconstruct(recon_opt);  // the question is part of what is repeated
    }
    const Engine& src = base ? *base : full;
    const std::span<const std::int32_t> tail = base ? std::span<const std::int32_t>(pa) : qa_span;
    // Logit rows the tail provides for the answer (question-known with an empty prefix: A - 1).
    const std::int64_t rows = std::min<std::int64_t>(A, static_cast<std::int64_t>(tail.size()));
    for (std::size_t g0 = 0; g0 < grid.size(); g0 += kGroup) {
      const std::size_t g1 = std::min(grid.size(), g0 + kGroup);
      std::vector<std::unique_ptr<Engine>> forks;
      for (std::size_t i = g0; i < g1; ++i) {
        // Decode-time policies (H2O) would evict while the question and answer go in: their
        // interval is pushed out of reach. The others never compress after the first event
        // (interval 0), which also keeps quantizers valid (a packed cache is compressed once).
        const std::int64_t interval = kvpolicy::Policy(grid[i].policy).decode_time() ? kNever : 0;
        forks.push_back(std::make_unique<Engine>(
            src.fork(grid[i].policy, Budget::ratio(grid[i].budget), interval)));
        auto& f = *forks.back();
        f.compress_now();
        f.session().shrink_to_fit();
        double held = 0, total = 0;
        for (std::int64_t l = 0; l < m.config().n_layers; ++l)
          for (std::int64_t h = 0; h < m.config().n_head_kv; ++h) {
            held += static_cast<double>(f.session().lengths(l)[static_cast<std::size_t>(h)]);
            total += static_cast<double>(f.position());
          }
        kept[i] = total > 0 ? held / total : 0.0;
      }
      std::vector<Engine*> es;
      for (auto& f : forks) es.push_back(f.get());
      std::vector<Matrix> got;
      if (rows > 0) {
        std::vector<std::span<const std::int32_t>> toks(es.size(), tail);
        got = Engine::extend_batch(es, toks, rows);
      }
      for (std::size_t k = 0; k < es.size(); ++k) {
        Matrix logits(A, m.config().n_vocab);
        if (rows < A) {  // the first answer token from the prompt's own (uncompressed) logits
          const auto ll = src.last_logits();
          std::copy(ll.begin(), ll.end(), logits.row(0).data());
        }
        if (rows > 0) logits.bottomRows(rows) = got[k];
        scores[g0 + k] = score_answer(logits, p.answer);
      }
    }
    out.cells.push_back(std::move(scores));
    out.kept_fraction.push_back(std::move(kept));
  }
  return out;
}

}  // namespace kvbench
