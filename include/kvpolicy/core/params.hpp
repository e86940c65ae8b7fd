// Named parameters of one stage of a spec string, e.g. the "window=32,kernel=7,pool=max" of
// "snapkv(window=32,kernel=7,pool=max)". Typed getters record what was read so that finish()
// can reject unknown names, listing the valid ones.
#pragma once
#include <charconv>
#include <cmath>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy {

class Params {
 public:
  Params() = default;
  explicit Params(std::string stage) : stage_(std::move(stage)) {}

  void set(const std::string& key, const std::string& value) {
    KVP_REQUIRE(!values_.count(key), stage_, ": parameter '", key, "' given twice");
    values_[key] = value;
  }
  const std::string& stage() const { return stage_; }
  bool contains(const std::string& key) const { return values_.count(key) != 0; }

  double get_double(const std::string& key, double def) {
    known_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return def;
    const std::string& s = it->second;
    double v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    KVP_REQUIRE(ec == std::errc() && p == s.data() + s.size() && std::isfinite(v), stage_,
                ": parameter '", key, "' expects a number, got '", s, "'");
    return v;
  }
  std::int64_t get_int(const std::string& key, std::int64_t def) {
    known_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return def;
    const std::string& s = it->second;
    std::int64_t v = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    KVP_REQUIRE(ec == std::errc() && p == s.data() + s.size(), stage_, ": parameter '", key,
                "' expects an integer, got '", s, "'");
    return v;
  }
  // Any text (a file path, a list); the stage parses it.
  std::string get_string(const std::string& key, const std::string& def) {
    known_.insert(key);
    auto it = values_.find(key);
    return it == values_.end() ? def : it->second;
  }
  bool get_bool(const std::string& key, bool def) {
    std::string v = get_choice(key, def ? "true" : "false", {"true", "false", "1", "0"});
    return v == "true" || v == "1";
  }
  std::string get_choice(const std::string& key, const std::string& def,
                         std::initializer_list<std::string_view> allowed) {
    known_.insert(key);
    auto it = values_.find(key);
    if (it == values_.end()) return def;
    for (auto a : allowed)
      if (it->second == a) return it->second;
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    detail::fail(stage_, ": parameter '", key, "' must be one of {", list, "}, got '",
                 it->second, "'");
  }
  // Rejects parameters no getter asked for.
  void finish() const {
    for (auto& [k, v] : values_) {
      if (known_.count(k)) continue;
      std::string list;
      for (auto& n : known_) list += (list.empty() ? "" : ", ") + n;
      detail::fail(stage_, ": unknown parameter '", k, "' (valid: ",
                   list.empty() ? "none" : list, ")");
    }
  }

 private:
  std::string stage_;
  std::map<std::string, std::string> values_;
  std::set<std::string> known_;
};

}  // namespace kvpolicy
