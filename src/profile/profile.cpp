// The DepthKV profile reader (declared in include/kvpolicy/allocators/profile.hpp), compiled here
// so that the header-only part of kvpolicy depends on no JSON library. nlohmann-json parses; this
// file only checks the schema and words the errors.
#include "kvpolicy/allocators/profile.hpp"

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy {
namespace {

// Python's json module writes the non-standard tokens NaN, Infinity and -Infinity for non-finite
// floats. Strict JSON parsers refuse them with a syntax error; quoting them outside strings lets
// the schema check below name the layer instead ("sensitivity of layer 3 is NaN").
std::string quote_nonfinite_tokens(const std::string& s) {
  std::string out;
  out.reserve(s.size() + 16);
  bool in_string = false;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < s.size()) out += s[++i];
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const char* tok : {"-Infinity", "Infinity", "NaN"}) {
      const std::string t(tok);
      if (s.compare(i, t.size(), t) == 0) {
        out += '"' + t + '"';
        i += t.size() - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += c;
  }
  return out;
}

}  // namespace

LayerProfile parse_layer_profile(const std::string& text, const std::string& where) {
  const auto check = [&](bool ok, const std::string& what) {
    KVP_REQUIRE(ok, "depthkv: profile '", where, "': ", what);
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(quote_nonfinite_tokens(text));
  } catch (const nlohmann::json::exception& e) {
    // parse_error, and out_of_range for a number beyond a double ("1e999"): both the input's.
    check(false, std::string("not valid JSON: ") + e.what());
  }
  check(j.is_object(), "the top level must be a JSON object");
  LayerProfile p;
  for (const char* key : {"model", "scorer"}) {
    const auto it = j.find(key);
    if (it != j.end() && it->is_string()) (key[0] == 'm' ? p.model : p.scorer) = it->get<std::string>();
  }
  const auto sens = j.find("sensitivity");
  check(sens != j.end(), "no \"sensitivity\" array");
  check(sens->is_array(), "\"sensitivity\" must be an array of numbers");
  check(!sens->empty(), "\"sensitivity\" lists no layers");
  // One finite number >= 0, or an error naming `what` (NaN / Infinity written by Python named).
  const auto number = [&](const nlohmann::json& v, const std::string& array,
                          const std::string& what) {
    if (v.is_string()) {
      const auto s = v.get<std::string>();
      check(s != "NaN", what + " is NaN");
      check(s != "Infinity" && s != "-Infinity", what + " is infinite");
    }
    check(v.is_number(), "\"" + array + "\" expects numbers; " + what + " is " + v.dump());
    const double x = v.get<double>();
    check(std::isfinite(x), what + " is infinite");
    check(x >= 0, what + " is negative (" + v.dump() + ")");
    return x;
  };
  for (std::size_t l = 0; l < sens->size(); ++l)
    p.sensitivity.push_back(
        number((*sens)[l], "sensitivity", "sensitivity of layer " + std::to_string(l)));
  const auto knots = j.find("curve_budgets"), curves = j.find("curves");
  check((knots == j.end()) == (curves == j.end()),
        "\"curve_budgets\" and \"curves\" come together (one of them is missing)");
  if (knots != j.end()) {
    check(knots->is_array() && !knots->empty(),
          "\"curve_budgets\" must be a non-empty array of kept fractions");
    for (std::size_t k = 0; k < knots->size(); ++k) {
      const double b = number((*knots)[k], "curve_budgets", "curve budget " + std::to_string(k));
      check(b > 0 && b < 1, "curve budget " + std::to_string(k) + " (" + (*knots)[k].dump() +
                                ") is outside (0, 1)");
      check(p.curve_budgets.empty() || b > p.curve_budgets.back(),
            "\"curve_budgets\" must be strictly ascending (entry " + std::to_string(k) + ")");
      p.curve_budgets.push_back(b);
    }
    check(curves->is_array() && curves->size() == p.sensitivity.size(),
          "\"curves\" must be an array of one row per layer (" +
              std::to_string(p.sensitivity.size()) + ")");
    for (std::size_t l = 0; l < curves->size(); ++l) {
      const auto& row = (*curves)[l];
      const std::string layer = "curve of layer " + std::to_string(l);
      check(row.is_array() && row.size() == p.curve_budgets.size(),
            layer + " must hold one loss per curve budget (" +
                std::to_string(p.curve_budgets.size()) + ")");
      std::vector<double> r;
      for (std::size_t k = 0; k < row.size(); ++k)
        r.push_back(number(row[k], "curves", layer + " at budget " + std::to_string(k)));
      p.curves.push_back(std::move(r));
    }
  }
  if (const auto layers = j.find("layers"); layers != j.end()) {
    check(layers->is_number_integer() && layers->get<std::int64_t>() >= 0,
          "\"layers\" must be a non-negative integer, got " + layers->dump());
    check(layers->get<std::int64_t>() == static_cast<std::int64_t>(p.sensitivity.size()),
          "\"layers\" is " + layers->dump() + " but \"sensitivity\" lists " +
              std::to_string(p.sensitivity.size()) + " values (missing layers)");
  }
  return p;
}

LayerProfile load_layer_profile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  KVP_REQUIRE(f.good(), "depthkv: cannot open profile '", path, "'");
  std::stringstream ss;
  ss << f.rdbuf();
  KVP_REQUIRE(!f.bad(), "depthkv: cannot read profile '", path, "'");
  return parse_layer_profile(ss.str(), path);
}

}  // namespace kvpolicy
