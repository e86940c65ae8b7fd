// The accuracy benchmark's retrieval tasks and corpora (benchmarks/accuracy/retrieval.hpp) on the
// bundled model: corpus reading (plain, gzip, corrupt), prompt construction (determinism, the
// prompt sets' separation, lengths, needles), answer scoring on hand-made logits, and both
// regimes of run_retrieval against the full cache.
#include <zlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine/engine_test_util.hpp"
#include "retrieval.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_bench_retrieval {

namespace {

using kvbench::Corpus;
using kvbench::PromptSet;
using kvbench::Regime;
using kvp_engine_test::model;

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvpolicy_test_" + name)).string();
}

// A text of `sentences` numbered sentences separated by runs of mixed whitespace.
std::string sample_text(int sentences) {
  std::string t;
  for (int i = 0; i < sentences; ++i)
    t += "Sentence number " + std::to_string(i) + " talks about gardens and rivers.\n  \t";
  return t;
}

const std::vector<Corpus>& eval_corpora() {
  static const std::vector<Corpus> c = [] {
    std::vector<Corpus> out;
    for (const auto& p : kvbench::corpus_paths(PromptSet::eval))
      out.push_back(kvbench::load_corpus(model(), p));
    return out;
  }();
  return c;
}

}  // namespace

TEST_CASE("corpus: plain and gzip files read the same, whitespace collapsed, boundaries at sentences",
          "[bench]") {
  const std::string text = sample_text(900);
  const std::string plain = temp_path("corpus.txt"), gz = temp_path("corpus.txt.gz");
  { std::ofstream(plain) << text; }
  {
    gzFile f = gzopen(gz.c_str(), "wb");
    REQUIRE(f != nullptr);
    REQUIRE(gzwrite(f, text.data(), static_cast<unsigned>(text.size())) == static_cast<int>(text.size()));
    gzclose(f);
  }
  const Corpus a = kvbench::load_corpus(model(), plain, 0.0);
  const Corpus b = kvbench::load_corpus(model(), gz, 0.0);
  CHECK(a.ids == b.ids);
  CHECK(a.name == "kvpolicy_test_corpus");  // extensions dropped
  const std::string decoded = model().tokenizer().decode(a.ids);
  CHECK(decoded.find('\n') == std::string::npos);
  CHECK(decoded.find("  ") == std::string::npos);
  CHECK(decoded.starts_with("Sentence number 0 talks"));
  // A boundary before every sentence but the first: the token before it ends with '.'.
  std::int64_t boundaries = 0;
  for (std::size_t i = 0; i < a.ids.size(); ++i)
    if (a.boundary[i]) {
      ++boundaries;
      CHECK(model().tokenizer().token(a.ids[i - 1]).back() == '.');
    }
  CHECK(boundaries == 899);
  // skip_fraction drops the front.
  const Corpus c = kvbench::load_corpus(model(), plain, 0.5);
  CHECK(c.ids.size() < a.ids.size() * 6 / 10);
  std::filesystem::remove(plain);
  std::filesystem::remove(gz);
}

TEST_CASE("corpus: errors name the file", "[bench]") {
  CHECK_THROWS_WITH(kvbench::load_corpus(model(), "/nonexistent/corpus.txt.gz"),
                    Catch::Contains("/nonexistent/corpus.txt.gz"));
  // A gzip file cut in half.
  const std::string text = sample_text(900), gz = temp_path("cut.gz");
  std::string bytes;
  {
    gzFile f = gzopen(gz.c_str(), "wb");
    gzwrite(f, text.data(), static_cast<unsigned>(text.size()));
    gzclose(f);
    std::ifstream in(gz, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  { std::ofstream(gz, std::ios::binary) << bytes.substr(0, bytes.size() / 2); }
  CHECK_THROWS_WITH(kvbench::load_corpus(model(), gz), Catch::Contains(gz) && Catch::Contains("corrupt"));
  // Too short to cut haystacks from.
  const std::string small = temp_path("small.txt");
  { std::ofstream(small) << sample_text(3); }
  CHECK_THROWS_WITH(kvbench::load_corpus(model(), small), Catch::Contains("at least 4096"));
  CHECK_THROWS_WITH(kvbench::load_corpus(model(), small, 1.0), Catch::Contains("skip_fraction"));
  std::filesystem::remove(gz);
  std::filesystem::remove(small);
}

TEST_CASE("retrieval prompts: deterministic, within length, answer and needles in place", "[bench]") {
  const auto& tok = model().tokenizer();
  for (const auto& task : kvbench::retrieval_tasks()) {
    INFO(task);
    const auto p = kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::eval, task, 600, 3);
    const auto q = kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::eval, task, 600, 3);
    const auto other = kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::eval, task, 600, 4);
    const auto calib = kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::calibration, task, 600, 3);
    CHECK(p.context == q.context);
    CHECK(p.answer == q.answer);
    CHECK(p.answer_text != other.answer_text);
    CHECK(p.answer_text != calib.answer_text);  // another seed space
    const auto total = static_cast<std::int64_t>(p.context.size() + p.question.size());
    CHECK(total <= 600);
    CHECK(total >= 540);
    // The reply is prefix + answer, and the answer's tokens spell the answer text.
    std::vector<std::int32_t> reply = p.prefix;
    reply.insert(reply.end(), p.answer.begin(), p.answer.end());
    CHECK(tok.decode(reply).ends_with(" " + p.answer_text));
    // Every number of the answer is written in the context.
    const std::string context = tok.decode(p.context);
    int numbers = 0;
    for (std::size_t at = 0; at + 5 <= p.answer_text.size(); ++at)
      if (std::all_of(p.answer_text.begin() + static_cast<std::ptrdiff_t>(at),
                      p.answer_text.begin() + static_cast<std::ptrdiff_t>(at + 5),
                      [](char ch) { return ch >= '0' && ch <= '9'; })) {
        CHECK(context.find(p.answer_text.substr(at, 5)) != std::string::npos);
        ++numbers;
        at += 4;
      }
    CHECK(numbers == (task == "multivalue" ? 2 : 1));
    for (double d : p.depths) CHECK((d >= 0 && d <= 1));
    CHECK(p.source == (task == "passkey" || task == "vartrack" ? std::string("filler") : p.source));
    CHECK_FALSE(p.source.empty());
  }
  CHECK_THROWS_WITH(kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::eval, "nope", 600, 0),
                    Catch::Contains("unknown task 'nope'"));
  CHECK_THROWS_WITH(kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::eval, "niah", 60, 0),
                    Catch::Contains("too short"));
  CHECK_THROWS_WITH(kvbench::make_retrieval_prompt(model(), {}, PromptSet::eval, "niah", 600, 0),
                    Catch::Contains("needs a real-text corpus"));
}

TEST_CASE("score_answer: exact match and log-probability from hand-made logits", "[bench]") {
  kvpolicy::engine::Matrix logits = kvpolicy::engine::Matrix::Zero(2, 4);
  // Row 0: logits (0, 0, ln 2, 0): softmax (1/5, 1/5, 2/5, 1/5); answer token 2 is the argmax.
  logits(0, 2) = static_cast<float>(std::log(2.0));
  // Row 1: logits (ln 3, 0, 0, 0): softmax (1/2, 1/6, 1/6, 1/6); answer token 1 is not.
  logits(1, 0) = static_cast<float>(std::log(3.0));
  const std::vector<std::int32_t> answer = {2, 1};
  const auto s = kvbench::score_answer(logits, answer);
  CHECK_FALSE(s.em);
  CHECK(s.logp == Approx(std::log(0.4) + std::log(1.0 / 6.0)).epsilon(1e-6));
  const auto t = kvbench::score_answer(logits.topRows(1), std::vector<std::int32_t>{2});
  CHECK(t.em);
  CHECK(t.logp == Approx(std::log(0.4)).epsilon(1e-6));
  CHECK_THROWS_WITH(kvbench::score_answer(logits, std::vector<std::int32_t>{2}),
                    Catch::Contains("2 logit rows for 1 answer tokens"));
}

TEST_CASE("run_retrieval: budget 1.0 equals the full cache in both regimes, evictions cost", "[bench]") {
  const auto p = kvbench::make_retrieval_prompt(model(), eval_corpora(), PromptSet::eval, "niah", 400, 0);
  kvpolicy::engine::EngineConfig cfg;
  cfg.policy = "streaming";
  cfg.record_queries = 8;
  cfg.record_attention = true;
  const std::vector<kvbench::GridPoint> grid = {{"snapkv(window=8)", 1.0}, {"h2o", 1.0},
                                                {"streaming", 0.1}, {"snapkv(window=8)", 0.1}};
  const auto r = kvbench::run_retrieval(model(), p, grid,
                                        {Regime::question_known, Regime::question_agnostic}, cfg, 8);
  REQUIRE(r.cells.size() == 2);
  CHECK(r.full_greedy_match == r.full.em);
  for (std::size_t ri = 0; ri < 2; ++ri) {
    INFO("regime " << ri);
    for (std::size_t i = 0; i < 2; ++i) {  // nothing evicted
      CHECK(r.cells[ri][i].em == r.full.em);
      CHECK(r.cells[ri][i].logp == Approx(r.full.logp).margin(2e-3));
      CHECK(r.kept_fraction[ri][i] == 1.0);
    }
    for (std::size_t i = 2; i < 4; ++i) CHECK(r.kept_fraction[ri][i] == Approx(0.1).margin(0.01));
  }
  // StreamingLLM at 10% keeps the first 4 and the newest tokens: without the question in the
  // cache (question-agnostic) the needle, placed in the body, is lost, and the answer's
  // probability falls well below the full cache's.
  CHECK(p.depths[0] < 0.85);
  CHECK(r.cells[1][2].logp < r.full.logp - 1.0);
}

}  // namespace kvt_bench_retrieval
