// Comma- and semicolon-separated list options of the accuracy tools (kvpolicy_accuracy,
// kvpolicy_keptsets): splitting, numbers, and the checks that name the offending flag.
#pragma once
#include <algorithm>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kvpolicy/core/error.hpp"
#include "retrieval.hpp"

namespace kvbench {

// The items of `s` between `sep`s, trimmed of spaces; empty items are dropped.
inline std::vector<std::string> split_list(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= s.size()) {
    const auto next = std::min(s.find(sep, at), s.size());
    std::string item = s.substr(at, next - at);
    const auto b = item.find_first_not_of(' '), e = item.find_last_not_of(' ');
    if (b != std::string::npos) out.push_back(item.substr(b, e - b + 1));
    at = next + 1;
  }
  return out;
}

// `out` = the comma-separated numbers of `s`; throws naming `flag` on a non-number or none.
template <class T>
void parse_numbers(const std::string& flag, const std::string& s, std::vector<T>& out) {
  out.clear();
  for (const auto& item : split_list(s, ',')) {
    std::size_t used = 0;
    T v{};
    try {
      if constexpr (std::is_floating_point_v<T>)
        v = static_cast<T>(std::stod(item, &used));
      else
        v = static_cast<T>(std::stoll(item, &used));
    } catch (const std::exception&) {
      used = 0;
    }
    KVP_REQUIRE(used == item.size(), flag, ": '", item, "' is not a number");
    out.push_back(v);
  }
  KVP_REQUIRE(!out.empty(), flag, ": empty list");
}

// A repeated entry would count the same samples twice (and rank a policy against itself).
template <class T>
void require_unique(const char* flag, std::vector<T> v) {
  std::sort(v.begin(), v.end());
  const auto dup = std::adjacent_find(v.begin(), v.end());
  if (dup != v.end()) {
    std::ostringstream os;
    os << *dup;
    KVP_REQUIRE(false, flag, ": '", os.str(), "' is listed twice");
  }
}

// Every entry names a retrieval task (--tasks) or a regime (--regimes).
inline void require_tasks(const std::vector<std::string>& tasks) {
  for (const auto& t : tasks)
    KVP_REQUIRE(std::find(retrieval_tasks().begin(), retrieval_tasks().end(), t) !=
                    retrieval_tasks().end(),
                "--tasks: unknown task '", t, "' (passkey, niah, multikey, multivalue, vartrack)");
}
inline void require_regimes(const std::vector<std::string>& regimes) {
  for (const auto& r : regimes)
    KVP_REQUIRE(r == "known" || r == "agnostic", "--regimes: unknown regime '", r,
                "' (known, agnostic)");
}

}  // namespace kvbench
