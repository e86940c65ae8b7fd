// libFuzzer target: the engine's byte-level BPE tokenizer (src/engine/tokenizer.hpp) on arbitrary
// bytes, over a vocabulary the input partly chooses.
//
// Input, read with FuzzedDataProvider (integers from the end, strings from the front): a flags
// byte (the last byte), then what the flags ask for (bytes to drop; extra tokens, merges and
// special tokens), then the text: every byte left. The vocabulary always has SmolLM2-like control tokens and merged tokens;
// it has every byte's token unless the input drops some (with or without an unknown token).
// Contracts checked (tokenizer.hpp, unicode.hpp):
// - UTF-8 decoding keeps every byte: the code points' byte ranges tile the text, each invalid
//   byte is one kInvalid entry, and a valid code point re-encodes to its bytes;
// - every id is inside the vocabulary;
// - with every byte in the vocabulary, decode(encode(text)) == text (BOS decodes to its text),
//   with and without parsing special tokens, for either pre-tokenizer: no byte is dropped;
// - with bytes missing and no unknown token, encode without special parsing throws
//   kvpolicy::Error exactly when the text holds such a byte; with an unknown token it never
//   throws and emits one unknown id per missing byte.
// Anything else (another exception, a crash, a sanitizer report) is a finding.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer.hpp"
#include "engine/unicode.hpp"
#include "fuzz_common.hpp"
#include "kvpolicy/core/error.hpp"

namespace eng = kvpolicy::engine;
namespace uni = kvpolicy::engine::unicode;
using kvp_fuzz::finding;

namespace {

enum Flag : std::uint8_t {
  kDigits = 1,        // the digits_then_gpt2 pre-tokenizer (else gpt2)
  kParseSpecial = 2,  // encode(..., parse_special)
  kAddBos = 4,        // encode(..., add_bos)
  kDropBytes = 8,     // some bytes have no token
  kUnknown = 16,      // ... and an unknown token stands in for them
  kExtraVocab = 32,   // tokens, merges and specials from the input
};

std::string mapped(std::string_view bytes) {
  std::string s;
  for (unsigned char b : bytes) s += uni::byte_to_token_char(b);
  return s;
}

void check_utf8(std::string_view text) {
  const auto cps = uni::decode_utf8(text);
  std::size_t at = 0;
  for (const auto& c : cps) {
    if (c.offset != at || c.length < 1 || c.length > 4 || at + c.length > text.size())
      finding("decode_utf8: entry at %u (length %u) does not continue at byte %zu", c.offset,
              c.length, at);
    if (c.cp == uni::kInvalid) {
      if (c.length != 1) finding("decode_utf8: invalid entry of %u bytes", c.length);
    } else {
      std::string re;
      uni::append_utf8(re, c.cp);
      if (c.cp > 0x10FFFF || (c.cp >= 0xD800 && c.cp <= 0xDFFF) ||
          re != text.substr(c.offset, c.length))
        finding("decode_utf8: U+%X at %u does not re-encode to its %u bytes", unsigned(c.cp),
                c.offset, c.length);
    }
    at += c.length;
  }
  if (at != text.size()) finding("decode_utf8: covers %zu of %zu bytes", at, text.size());
}

struct Vocab {
  std::vector<std::string> tokens;
  std::vector<std::int32_t> types;
  std::vector<std::string> merges;
  std::vector<bool> byte_missing = std::vector<bool>(256, false);
  eng::Tokenizer::Options opt;
};

Vocab build_vocab(FuzzedDataProvider& fdp, std::uint8_t flags) {
  Vocab v;
  auto add = [&](std::string text, std::int32_t type) {
    v.tokens.push_back(std::move(text));
    v.types.push_back(type);
    return static_cast<std::int32_t>(v.tokens.size() - 1);
  };
  add("<|endoftext|>", 3);
  v.opt.bos = add("<|im_start|>", 3);
  v.opt.eos = add("<|im_end|>", 3);
  std::vector<bool> drop(256, false);
  if (flags & kDropBytes)
    for (int i = fdp.ConsumeIntegralInRange<int>(1, 8); i > 0; --i)
      drop[fdp.ConsumeIntegral<std::uint8_t>()] = true;
  for (int b = 0; b < 256; ++b)
    if (!drop[static_cast<std::size_t>(b)]) add(uni::byte_to_token_char(static_cast<std::uint8_t>(b)), 6);
  // Raw \x01 never occurs in mapped text and no input token is this long: no merge can make it.
  if (flags & kUnknown) v.opt.unk = add("\x01<unknown>", 2);
  // Merged tokens: "he", "ll", "hell", "Ġw" as in fuzz/seeds' tiny model, then the input's own.
  for (const char* m : {"h e", "l l", "he ll", "Ġ w"}) {
    std::string t(m);
    add(t.substr(0, t.find(' ')) + t.substr(t.find(' ') + 1), 1);
    v.merges.push_back(t);
  }
  if (flags & kExtraVocab) {
    for (int i = fdp.ConsumeIntegralInRange<int>(0, 12); i > 0; --i) {
      const std::string bytes = fdp.ConsumeRandomLengthString(6);
      if (bytes.size() < 2) continue;
      const std::size_t cut = fdp.ConsumeIntegralInRange<std::size_t>(1, bytes.size() - 1);
      add(mapped(bytes), 1);
      v.merges.push_back(mapped(bytes.substr(0, cut)) + " " + mapped(bytes.substr(cut)));
    }
    // Merges the input writes directly (malformed ones must be ignored).
    for (int i = fdp.ConsumeIntegralInRange<int>(0, 4); i > 0; --i)
      v.merges.push_back(fdp.ConsumeRandomLengthString(8));
    // Special tokens with raw text: control (3) or user-defined (4), possibly empty.
    for (int i = fdp.ConsumeIntegralInRange<int>(0, 3); i > 0; --i)
      add(fdp.ConsumeRandomLengthString(6), fdp.ConsumeBool() ? 3 : 4);
    // Merge order is rank order: shuffle by rotating.
    if (!v.merges.empty()) {
      const std::size_t r = fdp.ConsumeIntegralInRange<std::size_t>(0, v.merges.size() - 1);
      std::rotate(v.merges.begin(), v.merges.begin() + static_cast<std::ptrdiff_t>(r),
                  v.merges.end());
    }
  }
  v.opt.pre = (flags & kDigits) ? eng::PreTokenizer::digits_then_gpt2 : eng::PreTokenizer::gpt2;
  // A byte has no token when no token of any type has its mapped text (a special token written
  // like a dropped byte's character stands in for it).
  for (int b = 0; b < 256; ++b)
    v.byte_missing[static_cast<std::size_t>(b)] =
        std::find(v.tokens.begin(), v.tokens.end(),
                  uni::byte_to_token_char(static_cast<std::uint8_t>(b))) == v.tokens.end();
  return v;
}

void check_ids(const eng::Tokenizer& tok, const std::vector<std::int32_t>& ids) {
  for (std::int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) finding("encode: id %d outside [0, %d)", id, tok.n_vocab());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const auto flags = fdp.ConsumeIntegral<std::uint8_t>();
  Vocab v = build_vocab(fdp, flags);
  const std::string text = fdp.ConsumeRemainingBytesAsString();
  check_utf8(text);

  const bool parse_special = flags & kParseSpecial, add_bos = flags & kAddBos;
  const eng::Tokenizer tok(v.tokens, v.types, v.merges, v.opt);
  bool has_missing = false;
  for (unsigned char c : text) has_missing = has_missing || v.byte_missing[c];

  if (!(flags & kDropBytes)) {
    const auto ids = tok.encode(text, parse_special, add_bos);
    check_ids(tok, ids);
    const std::string expect = (add_bos ? tok.token(tok.bos()) : std::string()) + text;
    if (tok.decode(ids) != expect)
      finding("decode(encode(text)) differs from the text (%zu bytes, %zu ids)", text.size(),
              ids.size());
    return 0;
  }
  // Bytes without a token: special parsing may cover them, so check the plain encoding exactly.
  try {
    const auto ids = tok.encode(text, false, add_bos);
    check_ids(tok, ids);
    if (has_missing && v.opt.unk < 0) finding("encode accepted a byte that has no token");
    if (v.opt.unk >= 0) {
      std::size_t missing = 0, unknown = 0;
      for (unsigned char c : text) missing += v.byte_missing[c];
      for (std::int32_t id : ids) unknown += id == v.opt.unk;
      if (unknown != missing)
        finding("%zu unknown ids for %zu bytes without a token", unknown, missing);
    }
  } catch (const kvpolicy::Error&) {
    if (!has_missing || v.opt.unk >= 0) finding("encode threw on a text it can encode");
  }
  try {
    check_ids(tok, tok.encode(text, true, add_bos));
  } catch (const kvpolicy::Error&) {
  }
  return 0;
}
