// DepthKV layer-sensitivity profiles: a small JSON file per model, written by the calibration
// tool and read by the depthkv allocator.
//   {"model": "SmolLM2-135M-Instruct", "scorer": "snapkv", "budget": 0.2, "metric": "kl",
//    "layers": 30, "sensitivity": [0.31, 0.12, ...]}
// Only "sensitivity" (one finite value >= 0 per layer, in layer order) is required; "layers", if
// present, must equal its length; every other key is kept as text or ignored. The reader takes
// strict JSON plus the NaN / Infinity tokens Python's json module writes, so that such a file is
// rejected with a message naming the layer rather than a syntax error.
#pragma once
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy {

struct LayerProfile {
  std::string model, scorer;
  std::vector<double> sensitivity;
};

namespace detail {

class ProfileReader {
 public:
  ProfileReader(std::string text, std::string where) : s_(std::move(text)), where_(std::move(where)) {}

  LayerProfile read() {
    LayerProfile p;
    double layers = -1;
    bool have_sens = false;
    expect('{');
    if (!peek('}')) {
      do {
        const std::string key = string();
        expect(':');
        if (key == "sensitivity") {
          have_sens = true;
          p.sensitivity = numbers(key);
        } else if (key == "layers") {
          layers = number(key);
        } else if (key == "model" || key == "scorer") {
          (key == "model" ? p.model : p.scorer) = peek('"') ? string() : (skip(), std::string());
        } else {
          skip();
        }
      } while (accept(','));
    }
    expect('}');
    ws();
    check(i_ == s_.size(), "unexpected text after the closing '}'");
    check(have_sens, "no \"sensitivity\" array");
    check(!p.sensitivity.empty(), "\"sensitivity\" lists no layers");
    for (std::size_t l = 0; l < p.sensitivity.size(); ++l) {
      const double v = p.sensitivity[l];
      check(!std::isnan(v), "sensitivity of layer " + std::to_string(l) + " is NaN");
      check(std::isfinite(v), "sensitivity of layer " + std::to_string(l) + " is infinite");
      check(v >= 0, "sensitivity of layer " + std::to_string(l) + " is negative (" +
                        std::to_string(v) + ")");
    }
    if (layers >= 0)
      check(layers == static_cast<double>(p.sensitivity.size()),
            "\"layers\" is " + std::to_string(static_cast<long long>(layers)) +
                " but \"sensitivity\" lists " + std::to_string(p.sensitivity.size()) +
                " values (missing layers)");
    return p;
  }

 private:
  void check(bool ok, const std::string& what) const {
    KVP_REQUIRE(ok, "depthkv: profile ", where_, ": ", what);
  }
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  bool peek(char c) {
    ws();
    return i_ < s_.size() && s_[i_] == c;
  }
  bool accept(char c) {
    if (!peek(c)) return false;
    ++i_;
    return true;
  }
  void expect(char c) {
    check(accept(c), std::string("expected '") + c + "' at offset " + std::to_string(i_));
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      if (s_[i_] == '\\') {
        ++i_;
        check(i_ < s_.size(), "unterminated string");
        if (s_[i_] == 'u') i_ += 4;  // \uXXXX: kept out of names we compare
        else out += s_[i_] == 'n' ? '\n' : s_[i_] == 't' ? '\t' : s_[i_];
        ++i_;
        continue;
      }
      out += s_[i_++];
    }
    check(i_ < s_.size(), "unterminated string");
    ++i_;
    return out;
  }
  double number(const std::string& key) {
    ws();
    for (const char* tok : {"NaN", "Infinity", "-Infinity"}) {
      const std::string t(tok);
      if (s_.compare(i_, t.size(), t) == 0) {
        i_ += t.size();
        return t == "NaN" ? std::numeric_limits<double>::quiet_NaN()
                          : (t[0] == '-' ? -1.0 : 1.0) * std::numeric_limits<double>::infinity();
      }
    }
    const char* begin = s_.c_str() + i_;
    char* end = nullptr;
    const double v = std::strtod(begin, &end);
    check(end != begin, "\"" + key + "\" expects numbers (offset " + std::to_string(i_) + ")");
    i_ += static_cast<std::size_t>(end - begin);
    return v;
  }
  std::vector<double> numbers(const std::string& key) {
    std::vector<double> v;
    check(peek('['), "\"" + key + "\" must be an array of numbers");
    expect('[');
    if (accept(']')) return v;
    do v.push_back(number(key));
    while (accept(','));
    expect(']');
    return v;
  }
  // Skips any JSON value.
  void skip() {
    ws();
    check(i_ < s_.size(), "unexpected end of file");
    const char c = s_[i_];
    if (c == '"') {
      string();
    } else if (c == '{' || c == '[') {
      const char close = c == '{' ? '}' : ']';
      ++i_;
      if (accept(close)) return;
      do {
        if (c == '{') {
          string();
          expect(':');
        }
        skip();
      } while (accept(','));
      expect(close);
    } else if (std::isalpha(static_cast<unsigned char>(c))) {
      while (i_ < s_.size() && std::isalpha(static_cast<unsigned char>(s_[i_]))) ++i_;
    } else {
      number("value");
    }
  }

  std::string s_, where_;
  std::size_t i_ = 0;
};

}  // namespace detail

inline LayerProfile parse_layer_profile(const std::string& json, const std::string& where) {
  return detail::ProfileReader(json, "'" + where + "'").read();
}

inline LayerProfile load_layer_profile(const std::string& path) {
  std::ifstream f(path);
  KVP_REQUIRE(f.good(), "depthkv: cannot open profile '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_layer_profile(ss.str(), path);
}

}  // namespace kvpolicy
