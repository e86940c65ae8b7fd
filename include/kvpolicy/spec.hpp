// Spec strings: stages separated by '|', each `name` or `name(key=value,...)`, e.g.
//   "snapkv(window=32,kernel=7,pool=max) | uniform"
// Whitespace around tokens is ignored. Names and keys are [A-Za-z0-9_]; values are any text
// without ',', '(', ')' or '|'.
#pragma once
#include <cctype>
#include <string>
#include <string_view>
#include <vector>

#include "kvpolicy/core/params.hpp"

namespace kvpolicy {

struct SpecStage {
  std::string name;
  Params params;
  std::string text;  // the stage as written, trimmed
};

namespace detail {
inline std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}
inline bool is_ident(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
  return true;
}
}  // namespace detail

inline std::vector<SpecStage> parse_spec(std::string_view spec) {
  using detail::trim;
  std::vector<SpecStage> stages;
  KVP_REQUIRE(!trim(spec).empty(), "policy spec is empty");
  std::size_t start = 0;
  while (start <= spec.size()) {
    std::size_t bar = spec.find('|', start);
    if (bar == std::string_view::npos) bar = spec.size();
    std::string_view st = trim(spec.substr(start, bar - start));
    KVP_REQUIRE(!st.empty(), "policy spec '", spec, "' has an empty stage");
    SpecStage out;
    out.text = std::string(st);
    const std::size_t open = st.find('(');
    std::string_view name = trim(st.substr(0, open));
    KVP_REQUIRE(detail::is_ident(name), "policy spec: bad stage name '", name, "' in '", st, "'");
    out.name = std::string(name);
    out.params = Params(out.name);
    if (open != std::string_view::npos) {
      KVP_REQUIRE(st.back() == ')', "policy spec: stage '", st, "' lacks a closing ')'");
      std::string_view body = st.substr(open + 1, st.size() - open - 2);
      KVP_REQUIRE(body.find_first_of("()") == std::string_view::npos,
                  "policy spec: nested parentheses in '", st, "'");
      if (!trim(body).empty()) {
        std::size_t p = 0;
        while (p <= body.size()) {
          std::size_t comma = body.find(',', p);
          if (comma == std::string_view::npos) comma = body.size();
          std::string_view kv = trim(body.substr(p, comma - p));
          const std::size_t eq = kv.find('=');
          KVP_REQUIRE(eq != std::string_view::npos, "policy spec: expected key=value, got '", kv,
                      "' in '", st, "'");
          std::string_view key = trim(kv.substr(0, eq)), val = trim(kv.substr(eq + 1));
          KVP_REQUIRE(detail::is_ident(key), "policy spec: bad parameter name '", key, "' in '",
                      st, "'");
          KVP_REQUIRE(!val.empty(), "policy spec: parameter '", key, "' has no value in '", st,
                      "'");
          out.params.set(std::string(key), std::string(val));
          p = comma + 1;
        }
      }
    }
    stages.push_back(std::move(out));
    start = bar + 1;
  }
  return stages;
}

}  // namespace kvpolicy
