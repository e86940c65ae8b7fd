#include "engine/tokenizer.hpp"

#include <algorithm>
#include <queue>

#include "engine/gguf.hpp"
#include "engine/unicode.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::engine {

namespace {

using unicode::CodePoint;

bool is_other(char32_t c) {
  return !unicode::is_space(c) && !unicode::is_letter(c) && !unicode::is_number(c);
}

// End of the GPT-2 pre-tokenizer match starting at cps[i] (leftmost-first alternation of
// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ ).
std::size_t gpt2_match(const std::vector<CodePoint>& cps, std::size_t i, std::size_t n) {
  const char32_t c = cps[i].cp;
  if (c == '\'' && i + 1 < n) {
    const char32_t c1 = cps[i + 1].cp;
    if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return i + 2;
    if (i + 2 < n) {
      const char32_t c2 = cps[i + 2].cp;
      if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l'))
        return i + 3;
    }
  }
  const std::size_t j = i + (c == ' ' ? 1 : 0);  // the optional leading space
  if (j < n) {
    bool (*cls)(char32_t) = nullptr;
    if (unicode::is_letter(cps[j].cp))
      cls = unicode::is_letter;
    else if (unicode::is_number(cps[j].cp))
      cls = unicode::is_number;
    else if (is_other(cps[j].cp))
      cls = is_other;
    if (cls) {
      std::size_t k = j + 1;
      while (k < n && cls(cps[k].cp)) ++k;
      return k;
    }
  }
  // Here cps[i] is whitespace. \s+(?!\S) leaves the last space of a run to the next word.
  std::size_t k = i + 1;
  while (k < n && unicode::is_space(cps[k].cp)) ++k;
  if (k == n || k - i == 1) return k;
  return k - 1;
}

}  // namespace

PreTokenizer pre_tokenizer_from_name(std::string_view name) {
  for (std::string_view n : {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"})
    if (name == n) return PreTokenizer::gpt2;
  for (std::string_view n :
       {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
    if (name == n) return PreTokenizer::digits_then_gpt2;
  detail::fail("tokenizer: pre-tokenizer '", name,
               "' is not implemented (supported: default, "
               "gpt2, gpt-2, mpt, olmo, jais, trillion, smollm, starcoder, refact, command-r, "
               "codeshell, exaone, minerva)");
}

const char* pre_tokenizer_name(PreTokenizer p) {
  return p == PreTokenizer::gpt2 ? "gpt2" : "digits_then_gpt2";
}

Tokenizer::Tokenizer(std::vector<std::string> tokens, std::vector<std::int32_t> types,
                     const std::vector<std::string>& merges, Options opt)
    : tokens_(std::move(tokens)), types_(std::move(types)), opt_(std::move(opt)) {
  const auto n = static_cast<std::int64_t>(tokens_.size());
  KVP_REQUIRE(n > 0 && n < (std::int64_t{1} << 31), "tokenizer: vocabulary size ", n,
              " is out of range");
  KVP_REQUIRE(types_.empty() || static_cast<std::int64_t>(types_.size()) == n,
              "tokenizer: ", types_.size(), " token types for ", n, " tokens");
  if (types_.empty()) types_.assign(tokens_.size(), 1);
  for (std::int32_t* id : {&opt_.bos, &opt_.eos, &opt_.unk})
    KVP_REQUIRE(*id >= -1 && *id < n, "tokenizer: special token id ", *id,
                " is outside the vocabulary of ", n);
  ids_.reserve(tokens_.size());
  for (std::int32_t i = 0; i < n; ++i) {
    ids_.emplace(tokens_[static_cast<std::size_t>(i)], i);  // first id wins on duplicates
    const std::int32_t t = types_[static_cast<std::size_t>(i)];
    if ((t == 3 || t == 4) && !tokens_[static_cast<std::size_t>(i)].empty()) specials_.push_back(i);
  }
  std::stable_sort(specials_.begin(), specials_.end(), [&](std::int32_t a, std::int32_t b) {
    return token(a).size() > token(b).size();
  });
  for (int b = 0; b < 256; ++b) {
    auto it = ids_.find(unicode::byte_to_token_char(static_cast<std::uint8_t>(b)));
    byte_ids_[b] = it == ids_.end() ? -1 : it->second;
  }
  merges_.reserve(merges.size());
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const std::size_t sp = m.find(' ', 1);
    if (sp == std::string::npos) continue;  // malformed: ignored, as the HF loader would reject
    auto l = ids_.find(m.substr(0, sp)), rt = ids_.find(m.substr(sp + 1));
    auto res = ids_.find(m.substr(0, sp) + m.substr(sp + 1));
    if (l == ids_.end() || rt == ids_.end() || res == ids_.end()) continue;
    const std::uint64_t key =
        (static_cast<std::uint64_t>(l->second) << 32) | static_cast<std::uint32_t>(rt->second);
    merges_.emplace(key, Merge{static_cast<std::int32_t>(r), res->second});  // first rank wins
  }
}

Tokenizer Tokenizer::from_gguf(const GgufFile& f) {
  const std::string model = f.get_string("tokenizer.ggml.model");
  KVP_REQUIRE(model == "gpt2", "tokenizer: ", f.origin(), ": tokenizer.ggml.model is '", model,
              "'; only byte-level BPE ('gpt2') is implemented");
  Options opt;
  opt.pre = pre_tokenizer_from_name(f.get_string("tokenizer.ggml.pre", "default"));
  auto id = [&](const char* key) {
    const std::uint64_t v = f.get_uint(key, static_cast<std::uint64_t>(-1));
    return v > static_cast<std::uint64_t>(INT32_MAX) ? -1 : static_cast<std::int32_t>(v);
  };
  opt.bos = id("tokenizer.ggml.bos_token_id");
  opt.eos = id("tokenizer.ggml.eos_token_id");
  opt.unk = id("tokenizer.ggml.unknown_token_id");
  opt.add_bos = f.get_bool("tokenizer.ggml.add_bos_token", false);
  opt.chat_template = f.get_string("tokenizer.chat_template", "");
  std::vector<std::int32_t> types;
  if (f.has("tokenizer.ggml.token_type")) {
    for (std::int64_t t : f.get_int_array("tokenizer.ggml.token_type"))
      types.push_back(static_cast<std::int32_t>(std::clamp<std::int64_t>(t, -1, 7)));
  }
  std::vector<std::string> merges;
  if (f.has("tokenizer.ggml.merges")) merges = f.get_string_array("tokenizer.ggml.merges");
  return Tokenizer(f.get_string_array("tokenizer.ggml.tokens"), std::move(types), merges,
                   std::move(opt));
}

const std::string& Tokenizer::token(std::int32_t id) const {
  KVP_REQUIRE(id >= 0 && id < n_vocab(), "tokenizer: token id ", id, " is outside [0, ", n_vocab(),
              ")");
  return tokens_[static_cast<std::size_t>(id)];
}

bool Tokenizer::is_special(std::int32_t id) const {
  const std::int32_t t = types_.at(static_cast<std::size_t>(id));
  return t == 3 || t == 4;
}

// BPE over one pre-tokenized word: symbols start as single mapped bytes; the adjacent pair with
// the lowest merge rank (leftmost among equals) is merged until no pair has a rank.
void Tokenizer::encode_word(std::string_view bytes, std::vector<std::int32_t>& out) const {
  struct Sym {
    std::int32_t id;
    std::int32_t prev, next;  // -1 at the ends
  };
  std::vector<Sym> sym;
  sym.reserve(bytes.size());
  for (unsigned char b : bytes) {
    std::int32_t id = byte_ids_[b];
    if (id < 0) {
      KVP_REQUIRE(opt_.unk >= 0, "tokenizer: byte 0x", std::hex, int{b},
                  " has no token and the vocabulary has no unknown token");
      id = opt_.unk;
    }
    const auto i = static_cast<std::int32_t>(sym.size());
    sym.push_back({id, i - 1, -1});
    if (i > 0) sym[static_cast<std::size_t>(i - 1)].next = i;
  }
  struct Cand {
    std::int32_t rank, left, left_id, right_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> pq;
  auto push = [&](std::int32_t left) {
    if (left < 0) return;
    const std::int32_t right = sym[static_cast<std::size_t>(left)].next;
    if (right < 0) return;
    const std::int32_t a = sym[static_cast<std::size_t>(left)].id;
    const std::int32_t b = sym[static_cast<std::size_t>(right)].id;
    auto it = merges_.find((static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint32_t>(b));
    if (it != merges_.end()) pq.push({it->second.rank, left, a, b});
  };
  for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(sym.size()); ++i) push(i);
  while (!pq.empty()) {
    const Cand c = pq.top();
    pq.pop();
    Sym& l = sym[static_cast<std::size_t>(c.left)];
    if (l.id != c.left_id || l.next < 0 || sym[static_cast<std::size_t>(l.next)].id != c.right_id)
      continue;  // stale: one side was merged since
    const auto key =
        (static_cast<std::uint64_t>(c.left_id) << 32) | static_cast<std::uint32_t>(c.right_id);
    Sym& r = sym[static_cast<std::size_t>(l.next)];
    l.id = merges_.at(key).result;
    r.id = -1;  // dead
    l.next = r.next;
    if (l.next >= 0) sym[static_cast<std::size_t>(l.next)].prev = c.left;
    push(l.prev);
    push(c.left);
  }
  for (std::int32_t i = sym.empty() ? -1 : 0; i >= 0; i = sym[static_cast<std::size_t>(i)].next)
    out.push_back(sym[static_cast<std::size_t>(i)].id);
}

void Tokenizer::encode_text(std::string_view text, std::vector<std::int32_t>& out) const {
  const std::vector<CodePoint> cps = unicode::decode_utf8(text);
  auto word = [&](std::size_t a, std::size_t b) {  // code points [a, b)
    const std::size_t from = cps[a].offset, to = cps[b - 1].offset + cps[b - 1].length;
    encode_word(text.substr(from, to - from), out);
  };
  auto split_gpt2 = [&](std::size_t a, std::size_t b) {
    for (std::size_t i = a; i < b;) {
      const std::size_t e = gpt2_match(cps, i, b);
      word(i, e);
      i = e;
    }
  };
  if (opt_.pre == PreTokenizer::gpt2) {
    split_gpt2(0, cps.size());
    return;
  }
  std::size_t start = 0;
  for (std::size_t i = 0; i < cps.size(); ++i) {
    if (!unicode::is_number(cps[i].cp)) continue;
    split_gpt2(start, i);
    word(i, i + 1);
    start = i + 1;
  }
  split_gpt2(start, cps.size());
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool parse_special,
                                            bool add_bos) const {
  std::vector<std::int32_t> out;
  if (add_bos) {
    KVP_REQUIRE(opt_.bos >= 0, "tokenizer: add_bos requested but the model has no BOS token");
    out.push_back(opt_.bos);
  }
  std::size_t start = 0, i = 0;
  while (parse_special && i < text.size()) {
    std::int32_t hit = -1;
    for (std::int32_t id : specials_) {  // longest first
      const std::string& s = tokens_[static_cast<std::size_t>(id)];
      if (text.compare(i, s.size(), s) == 0) {
        hit = id;
        break;
      }
    }
    if (hit < 0) {
      ++i;
      continue;
    }
    encode_text(text.substr(start, i - start), out);
    out.push_back(hit);
    i += tokens_[static_cast<std::size_t>(hit)].size();
    start = i;
  }
  encode_text(text.substr(start), out);
  return out;
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids) const {
  std::string out;
  for (std::int32_t id : ids) {
    const std::string& t = token(id);
    if (is_special(id)) {
      out += t;
      continue;
    }
    for (const CodePoint& c : unicode::decode_utf8(t)) {
      const int b = c.cp == unicode::kInvalid ? -1 : unicode::token_char_to_byte(c.cp);
      if (b >= 0)
        out += static_cast<char>(b);
      else
        out.append(t, c.offset, c.length);
    }
  }
  return out;
}

std::string Tokenizer::apply_chat_template(const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt) const {
  const std::string& tpl = opt_.chat_template;
  KVP_REQUIRE(tpl.find("<|im_start|>") != std::string::npos,
              "tokenizer: the model's chat "
              "template is not a ChatML one (",
              tpl.empty() ? "none in the file" : "unsupported",
              "); only ChatML (<|im_start|>role ... <|im_end|>) is implemented");
  // A template like SmolLM2's inserts a fixed system turn when the conversation has none.
  std::string default_system;
  const std::string sys_open = "<|im_start|>system\n";
  if (tpl.find("messages[0]['role'] != 'system'") != std::string::npos) {
    const std::size_t a = tpl.find(sys_open);
    const std::size_t b = a == std::string::npos ? a : tpl.find("<|im_end|>", a);
    if (b != std::string::npos) default_system = tpl.substr(a, b - a) + "<|im_end|>\n";
  }
  std::string out;
  if (!default_system.empty() && !messages.empty() && messages.front().role != "system")
    out += default_system;
  for (const auto& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace kvpolicy::engine
