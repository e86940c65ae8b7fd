// The few Unicode facts a byte-level BPE tokenizer needs: UTF-8 decoding that tolerates invalid
// bytes, the classes \p{L}, \p{N} and \s of the pre-tokenizer regexes, and GPT-2's reversible
// byte <-> printable code point mapping.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvpolicy::engine::unicode {

// One decoded code point and the bytes it came from. An invalid or truncated UTF-8 sequence
// yields one entry per offending byte with cp = kInvalid (it counts as "other": neither a
// letter, a number nor a space), so no input byte is ever dropped.
struct CodePoint {
  char32_t cp;
  std::uint32_t offset, length;
};
inline constexpr char32_t kInvalid = 0xFFFFFFFF;

std::vector<CodePoint> decode_utf8(std::string_view s);
void append_utf8(std::string& out, char32_t cp);

bool is_letter(char32_t cp);  // general category L*
bool is_number(char32_t cp);  // general category N*
bool is_space(char32_t cp);   // White_Space property (what \s matches)

// GPT-2 byte-level mapping: every byte to a printable code point (as UTF-8) and back.
const std::string& byte_to_token_char(std::uint8_t b);
// The byte a mapped code point stands for, or -1 if cp is not in the mapping.
int token_char_to_byte(char32_t cp);

}  // namespace kvpolicy::engine::unicode
