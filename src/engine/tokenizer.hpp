// Byte-level BPE tokenizer (GGUF tokenizer.ggml.model = "gpt2") built from the file's vocabulary
// and merges: control / user-defined tokens are matched literally in the text first, the rest is
// split by the pre-tokenizer the model was trained with (tokenizer.ggml.pre), every byte is
// mapped to GPT-2's printable code points, and merges are applied by rank (lowest first,
// leftmost on ties), as Hugging Face tokenizers and llama.cpp do.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvpolicy::engine {

class GgufFile;

// How text is cut into words before BPE.
enum class PreTokenizer : std::uint8_t {
  // GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  gpt2,
  // StarCoder / SmolLM: every \p{N} code point is its own word, then the GPT-2 rule.
  digits_then_gpt2,
};

// tokenizer.ggml.pre name -> PreTokenizer; throws an Error listing the supported names.
PreTokenizer pre_tokenizer_from_name(std::string_view name);
const char* pre_tokenizer_name(PreTokenizer p);

struct ChatMessage {
  std::string role, content;
};

class Tokenizer {
 public:
  struct Options {
    PreTokenizer pre = PreTokenizer::gpt2;
    std::int32_t bos = -1, eos = -1, unk = -1;
    bool add_bos = false;
    std::string chat_template;
  };

  // tokens[i] is token i's text in the byte-level alphabet; types: GGUF token types
  // (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte); merges: "left right".
  Tokenizer(std::vector<std::string> tokens, std::vector<std::int32_t> types,
            const std::vector<std::string>& merges, Options opt);
  // From tokenizer.ggml.* metadata; errors name the missing or inconsistent key.
  static Tokenizer from_gguf(const GgufFile& f);

  // Token ids of `text`. With parse_special, control and user-defined tokens written in the
  // text (e.g. "<|im_start|>") become their ids; otherwise they are tokenized as plain text.
  // add_bos prepends the BOS id (Options::add_bos is the model's default).
  std::vector<std::int32_t> encode(std::string_view text, bool parse_special = true,
                                   bool add_bos = false) const;
  // The bytes the ids stand for (special tokens as their text).
  std::string decode(std::span<const std::int32_t> ids) const;
  const std::string& token(std::int32_t id) const;

  std::int32_t n_vocab() const { return static_cast<std::int32_t>(tokens_.size()); }
  std::int32_t bos() const { return opt_.bos; }
  std::int32_t eos() const { return opt_.eos; }
  bool add_bos() const { return opt_.add_bos; }
  bool is_special(std::int32_t id) const;
  PreTokenizer pre_tokenizer() const { return opt_.pre; }
  void set_pre_tokenizer(PreTokenizer p) { opt_.pre = p; }

  const std::string& chat_template() const { return opt_.chat_template; }
  // Renders messages with the model's chat template. Supported: ChatML templates
  // (<|im_start|>role\ncontent<|im_end|>\n), including a default system message that the
  // template inserts when the first message is not a system one (SmolLM2 does).
  std::string apply_chat_template(const std::vector<ChatMessage>& messages,
                                  bool add_generation_prompt) const;

 private:
  void encode_word(std::string_view bytes, std::vector<std::int32_t>& out) const;
  void encode_text(std::string_view text, std::vector<std::int32_t>& out) const;
  std::int32_t lookup_char(std::string_view mapped) const;

  struct Merge {
    std::int32_t rank, result;
  };
  std::vector<std::string> tokens_;
  std::vector<std::int32_t> types_;
  std::unordered_map<std::string, std::int32_t> ids_;
  std::unordered_map<std::uint64_t, Merge> merges_;  // (left << 32 | right) -> rank, merged id
  std::vector<std::int32_t> specials_;               // control + user-defined ids, longest first
  std::int32_t byte_ids_[256];                       // id of each byte's mapped character
  Options opt_;
};

}  // namespace kvpolicy::engine
