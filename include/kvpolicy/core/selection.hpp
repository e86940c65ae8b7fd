// Selection: ragged kept token indices per (layer, kv_head), each list ascending. Physical
// compaction consumes it, so per-head budgets really shrink the cache.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy {

class Selection {
 public:
  Selection() = default;
  Selection(std::int64_t layers, std::int64_t heads)
      : layers_(layers), heads_(heads), lists_(static_cast<std::size_t>(layers * heads)) {}

  // Every token of every row kept.
  static Selection all(std::int64_t layers, std::int64_t heads, std::int64_t tokens) {
    Selection s(layers, heads);
    for (auto& row : s.lists_) {
      row.resize(static_cast<std::size_t>(tokens));
      for (std::int64_t j = 0; j < tokens; ++j) row[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(j);
    }
    return s;
  }

  std::int64_t layers() const { return layers_; }
  std::int64_t heads() const { return heads_; }
  std::vector<std::int32_t>& kept(std::int64_t l, std::int64_t h) {
    return lists_[static_cast<std::size_t>(l * heads_ + h)];
  }
  std::span<const std::int32_t> kept(std::int64_t l, std::int64_t h) const {
    return lists_[static_cast<std::size_t>(l * heads_ + h)];
  }
  std::int64_t count(std::int64_t l, std::int64_t h) const {
    return static_cast<std::int64_t>(kept(l, h).size());
  }
  std::int64_t total() const {
    std::int64_t s = 0;
    for (auto& v : lists_) s += static_cast<std::int64_t>(v.size());
    return s;
  }
  // Every list strictly ascending and inside [0, tokens).
  void validate(std::int64_t tokens) const {
    for (std::int64_t l = 0; l < layers_; ++l)
      for (std::int64_t h = 0; h < heads_; ++h) {
        auto k = kept(l, h);
        for (std::size_t i = 0; i < k.size(); ++i) {
          KVP_REQUIRE(k[i] >= 0 && k[i] < tokens, "selection: index ", k[i], " at layer ", l,
                      ", head ", h, " is outside [0, ", tokens, ")");
          KVP_REQUIRE(i == 0 || k[i] > k[i - 1], "selection: indices at layer ", l, ", head ", h,
                      " are not strictly ascending");
        }
      }
  }

  // Set when the selection departed from the policy as specified to honour the budget (a budget
  // below the scorer's protected window keeps only the newest tokens): the reason, for the caller
  // to pass on as a warning. Empty otherwise.
  const std::string& warning() const { return warning_; }
  void set_warning(std::string w) { warning_ = std::move(w); }

 private:
  std::string warning_;
  std::int64_t layers_ = 0, heads_ = 0;
  std::vector<std::vector<std::int32_t>> lists_;
};

}  // namespace kvpolicy
