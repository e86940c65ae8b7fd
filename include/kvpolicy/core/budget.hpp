// Budget: how many tokens survive a compression event, as a ratio of the cache length or as a
// token count. Resolves to exact integer per-(layer, head) budgets whose sum is exactly the
// global budget; allocators (allocators/) redistribute that global budget non-uniformly.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvpolicy/core/error.hpp"

namespace kvpolicy {

class Budget {
 public:
  enum class Kind : std::uint8_t { ratio, per_head, total };

  // Keep round(r * T) tokens per (layer, head); r in [0, 1].
  static Budget ratio(double r) { return Budget(Kind::ratio, r); }
  // Keep n tokens per (layer, head) (clamped to T when T <= n: nothing to evict).
  static Budget tokens(std::int64_t n) { return Budget(Kind::per_head, static_cast<double>(n)); }
  // Keep n tokens in total over all (layer, head) pairs.
  static Budget total(std::int64_t n) { return Budget(Kind::total, static_cast<double>(n)); }

  Kind kind() const { return kind_; }
  double value() const { return value_; }
  // The token count of a per_head or total budget (validated first). The value is a double, which
  // holds INT64_MAX as 2^63: that saturates back to INT64_MAX here instead of overflowing the
  // conversion.
  std::int64_t count() const {
    return value_ >= 0x1p63 ? std::numeric_limits<std::int64_t>::max()
                            : static_cast<std::int64_t>(value_);
  }

  void validate() const {
    KVP_REQUIRE(std::isfinite(value_), "budget is not a finite number (", value_, ")");
    KVP_REQUIRE(value_ >= 0, "budget is negative (", value_, ")");
    if (kind_ == Kind::ratio) KVP_REQUIRE(value_ <= 1.0, "budget ratio ", value_, " is above 1");
  }

  // Global number of tokens kept over `layers * heads` rows of `tokens` tokens each.
  std::int64_t global(std::int64_t layers, std::int64_t heads, std::int64_t tokens) const {
    validate();
    const std::int64_t rows = layers * heads;
    switch (kind_) {
      case Kind::ratio:
        return rows * static_cast<std::int64_t>(std::llround(value_ * static_cast<double>(tokens)));
      case Kind::per_head:
        return rows * std::min<std::int64_t>(count(), tokens);
      case Kind::total:
        return std::min<std::int64_t>(count(), rows * tokens);
    }
    return 0;
  }

  // Uniform split of global(): every row gets floor(G / rows); the remainder goes one token each
  // to the first rows. The result sums exactly to global().
  std::vector<std::int64_t> resolve(std::int64_t layers, std::int64_t heads,
                                    std::int64_t tokens) const {
    const std::int64_t rows = layers * heads;
    const std::int64_t g = global(layers, heads, tokens);
    std::vector<std::int64_t> out(static_cast<std::size_t>(rows), rows ? g / rows : 0);
    for (std::int64_t r = 0; r < (rows ? g % rows : 0); ++r) ++out[static_cast<std::size_t>(r)];
    return out;
  }

 private:
  Budget(Kind k, double v) : kind_(k), value_(v) {}
  Kind kind_ = Kind::ratio;
  double value_ = 1.0;
};

}  // namespace kvpolicy
