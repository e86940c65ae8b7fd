// Byte-level BPE tokenizer: merge order and special tokens on a toy vocabulary, then the real
// SmolLM2 vocabulary against the ids Hugging Face tokenizers produced (golden/golden.json) for
// unicode, digits, whitespace runs, code and chat-templated text.
#include <catch2/catch.hpp>

#include "engine/gguf.hpp"
#include "engine/tokenizer.hpp"
#include "engine/unicode.hpp"
#include "engine_test_util.hpp"
#include "kvpolicy/core/error.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_engine_tokenizer {

namespace eng = kvpolicy::engine;
using Catch::Matchers::Contains;

namespace {
// Ids 0..255: the 256 byte characters; then merged tokens and one control token.
eng::Tokenizer toy(std::vector<std::string> merges) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b)
    tokens.push_back(eng::unicode::byte_to_token_char(static_cast<std::uint8_t>(b)));
  for (const char* t : {"bc", "ab", "aa", "aaaa", "<|sp|>", "ĠĠ"}) tokens.emplace_back(t);
  std::vector<std::int32_t> types(tokens.size(), 1);
  types[260] = 3;
  eng::Tokenizer::Options o;
  o.bos = 260;
  return eng::Tokenizer(tokens, types, merges, o);
}
std::vector<std::int32_t> ids(std::initializer_list<int> v) { return {v.begin(), v.end()}; }
}  // namespace

TEST_CASE("tokenizer: merges apply by rank, leftmost first", "[engine][tokenizer]") {
  const auto t = toy({"b c", "a b", "a a", "aa aa"});
  CHECK(t.encode("abc") == ids({'a', 256}));  // "b c" outranks "a b"
  CHECK(t.encode("aaaa") == ids({259}));      // a a | a a -> aa aa -> aaaa
  CHECK(t.encode("aaa") == ids({258, 'a'}));  // the leftmost pair merges first
  CHECK(toy({"a b", "b c"}).encode("abc") == ids({257, 'c'}));
  CHECK(t.encode("").empty());
}

TEST_CASE("tokenizer: special tokens, BOS and byte round trips", "[engine][tokenizer]") {
  const auto t = toy({"a b"});
  CHECK(t.encode("x<|sp|>ab") == ids({'x', 260, 257}));
  CHECK(t.encode("x<|sp|>ab", /*parse_special=*/false).size() == 1 + 6 + 1);
  CHECK(t.encode("ab", true, /*add_bos=*/true) == ids({260, 257}));
  CHECK(t.decode(t.encode("x<|sp|>ab")) == "x<|sp|>ab");
  const std::string bytes = "\xff\xfe bad utf8 \xc3 \xe2\x82 ok \xf0\x9f\x98\x80";
  CHECK(t.decode(t.encode(bytes)) == bytes);
  CHECK(t.encode(bytes).size() == bytes.size());  // no merges apply: one token per byte
  CHECK_THROWS_WITH(t.token(999), Contains("outside"));
  CHECK_THROWS_WITH(eng::pre_tokenizer_from_name("qwen2"), Contains("'qwen2' is not implemented"));
}

TEST_CASE("tokenizer: GPT-2 pre-tokenizer splits like the regex", "[engine][tokenizer]") {
  // With no merges every byte is a token; check word boundaries through merges of "Ġ Ġ" only:
  // a run of n spaces before a word keeps its last space for the word, so "ĠĠ" appears once.
  const auto t = toy({"Ġ Ġ"});
  const std::int32_t sp = ' ', dsp = 261;
  CHECK(t.encode("   x") == ids({dsp, sp, 'x'}));              // "  " then " x"
  CHECK(t.encode("x   ") == ids({'x', dsp, sp}));              // trailing run stays whole: "   "
  CHECK(t.encode("x\n  y") == ids({'x', '\n', sp, sp, 'y'}));  // "\n " then " y"
}

TEST_CASE("tokenizer: SmolLM2 ids equal Hugging Face's for every golden string",
          "[engine][tokenizer][model]") {
  const auto& g = kvp_engine_test::golden();
  const eng::GgufFile f = eng::GgufFile::open(kvp_engine_test::model_path());
  eng::Tokenizer tok = eng::Tokenizer::from_gguf(f);
  REQUIRE(tok.pre_tokenizer() == eng::PreTokenizer::digits_then_gpt2);
  CHECK(tok.n_vocab() == 49152);
  CHECK(tok.bos() == 1);
  CHECK(tok.eos() == 2);
  CHECK_FALSE(tok.add_bos());
  int n = 0;
  for (const auto& c : g["tokenizer_cases"]) {
    const auto text = c["text"].get<std::string>();
    INFO("text: " << text);
    const auto expect = c["ids"].get<std::vector<std::int32_t>>();
    CHECK(tok.encode(text) == expect);
    CHECK(tok.decode(expect) == text);
    ++n;
  }
  CHECK(n >= 30);
  // Plain GPT-2 pre-tokenization is what transformers' GGUF loader uses; it differs only on
  // digits (and spaces before them).
  tok.set_pre_tokenizer(eng::PreTokenizer::gpt2);
  int differing = 0;
  for (const auto& c : g["tokenizer_cases"]) {
    const auto text = c["text"].get<std::string>();
    INFO("text (gpt2 pre-tokenizer): " << text);
    const bool differs = c.contains("ids_gguf_loader");
    differing += differs;
    CHECK(tok.encode(text) ==
          c[differs ? "ids_gguf_loader" : "ids"].get<std::vector<std::int32_t>>());
  }
  CHECK(differing > 0);
}

TEST_CASE("tokenizer: SmolLM2 chat template matches Hugging Face's", "[engine][tokenizer][model]") {
  const auto& c = kvp_engine_test::golden()["chat_template_case"];
  const eng::GgufFile f = eng::GgufFile::open(kvp_engine_test::model_path());
  const eng::Tokenizer tok = eng::Tokenizer::from_gguf(f);
  std::vector<eng::ChatMessage> msgs;
  for (const auto& m : c["messages"]) msgs.push_back({m["role"], m["content"]});
  const std::string text = tok.apply_chat_template(msgs, c["add_generation_prompt"].get<bool>());
  CHECK(text == c["text"].get<std::string>());
  CHECK(tok.encode(text) == c["ids"].get<std::vector<std::int32_t>>());
  // A conversation that brings its own system turn gets no default one.
  const std::string own = tok.apply_chat_template({{"system", "Be brief."}, {"user", "Hi"}}, false);
  CHECK(own == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

}  // namespace kvt_engine_tokenizer
