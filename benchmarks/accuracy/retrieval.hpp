// Retrieval tasks in the spirit of RULER (Hsieh et al., 2024), on real-text and repeated-filler
// haystacks, scored in two regimes, plus the real-text corpora they and the fidelity windows
// are cut from.
//
// Tasks (each prompt: chat header, instruction, haystack with needles, question; one answer):
//   passkey     filler haystack; "The pass key is 12345..." once; answer the 5-digit key
//   niah        real-text haystack; one "special magic number for <word>" needle
//   multikey    real-text haystack; four such needles with different words, one is asked
//   multivalue  real-text haystack; two numbers for one word (and one distractor word); answer
//               both, in order of appearance, as the numbered list the model writes
//   vartrack    filler haystack; "VAR X = 12345." ... "VAR Y = VAR X." and a distractor
//               chain; asked for the value of Y (one hop of variable tracking)
//
// Regimes:
//   question-known     the whole prompt, question included, is prefilled with the full cache,
//                      then compressed; the reply (prefix, then answer) is decoded over the
//                      compressed cache.
//   question-agnostic  the context (everything before the question) is prefilled and
//                      compressed; the question and the answer are appended uncompressed, as
//                      with prefix caching or kvpress's pipeline.
// Exactly one compression event per fork: nothing is evicted while the question and answer
// are appended (H2O included), so both regimes compare the same budget.
//
// Metrics per (prompt, regime, policy, budget), all teacher-forced on the answer tokens:
//   em     every answer token is the argmax given the ones before it (after the reply's prefix):
//          greedy decoding would reproduce the answer exactly (the full cache's greedy
//          generation is also run and reported, to show that the model answers in this form)
//   logp   sum of the answer tokens' log-probabilities; dlogp = logp - the full cache's
// Prompts are deterministic in (prompt set, task, length, index): the evaluation and the
// calibration sets use different corpora and seeds, so nothing tuned on calibration prompts
// has seen an evaluation prompt.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tasks.hpp"

namespace kvbench {

// ---- corpora ----------------------------------------------------------------------------
// A real text, whitespace-collapsed, tokenized once. boundary[i] = 1 where a sentence ends
// before token i (token i-1 ends with '.', token i starts with a space): needles go there.
struct Corpus {
  std::string name, path;
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> boundary;
};
enum class PromptSet { eval, calibration };
const char* prompt_set_name(PromptSet s);
// The corpora of a prompt set (Debian packages that scripts/setup.sh installs):
//   eval:        GPL-3 (base-files), Debian Policy (debian-policy), Debian Developer's Reference
//                (developers-reference), GNU Coding Standards (gnu-standards), Debian Reference
//                (debian-reference-en)
//   calibration: LGPL-2.1, GFDL-1.3 (base-files), the Debian Constitution (doc-debian)
std::vector<std::string> corpus_paths(PromptSet s);
// Reads a plain or gzip-compressed text (zlib), collapses whitespace runs to one space and
// drops the first `skip_fraction` of it (tables of contents). Errors name the file and the
// package that provides it.
Corpus load_corpus(const Model& m, const std::string& path, double skip_fraction = 0.1);

// ---- retrieval prompts --------------------------------------------------------------------
const std::vector<std::string>& retrieval_tasks();  // the five names above, in order
struct RetrievalPrompt {
  std::string task;
  std::int64_t length = 0, index = 0;       // requested tokens, prompt number
  std::vector<std::int32_t> context;        // chat header .. end of the haystack
  std::int64_t header = 0;                  // tokens of the chat header (the context's first;
                                            // kvzip's reconstruction pass does not repeat them)
  std::vector<std::int32_t> question;       // question, end of the user turn, assistant header
  // The assistant's reply is prefix + answer: the prefix restates the question the way this
  // model starts its answers ("The pass key is"), so that the answer tokens are what greedy
  // decoding produces; only the answer tokens are scored.
  std::vector<std::int32_t> prefix, answer;
  std::string answer_text, source;          // source: corpus name or "filler"
  std::vector<double> depths;               // needle positions, fraction of the haystack
  double asked_depth = 0;                   // position of the needle that holds the answer
                                            // (multivalue: the first; vartrack: the value)
};
// Prompt `index` of `task` with at most `length` tokens. Throws if the length is too short.
RetrievalPrompt make_retrieval_prompt(const Model& m, const std::vector<Corpus>& corpora,
                                      PromptSet set, const std::string& task,
                                      std::int64_t length, std::int64_t index);

// ---- scoring ------------------------------------------------------------------------------
enum class Regime { question_known, question_agnostic };
const char* regime_name(Regime r);  // "question-known", "question-agnostic"
struct AnswerScore {
  bool em = false;
  double logp = 0;
};
struct RetrievalOutcome {
  AnswerScore full;                 // full cache (the same in both regimes)
  std::string full_greedy;          // the full cache's greedy answer (text)
  bool full_greedy_match = false;   // that answer starts with the expected one
  // [regime][grid point], regimes in the order asked for
  std::vector<std::vector<AnswerScore>> cells;
  std::vector<std::vector<double>> kept_fraction;  // kept tokens / cached tokens after compression
};
// Prefills the context once with the full cache (recording what the policies read), then
// scores the full cache and every grid point in each regime; forks of one regime are scored in
// one batched forward pass. `greedy_tokens` > 0 also runs the full cache's greedy answer.
RetrievalOutcome run_retrieval(const Model& m, const RetrievalPrompt& p,
                               const std::vector<GridPoint>& grid,
                               const std::vector<Regime>& regimes, const EngineConfig& full_cfg,
                               std::int64_t greedy_tokens);

// The score of `answer` from logits [A][vocab] (row j predicts answer[j]).
AnswerScore score_answer(const kvpolicy::engine::Matrix& logits,
                         std::span<const std::int32_t> answer);

}  // namespace kvbench
