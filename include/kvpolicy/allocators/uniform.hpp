// Uniform allocation: every (layer, head) keeps the same number of tokens (the remainder of an
// indivisible global budget goes one token each to the first rows, see Budget::resolve). It is
// the identity on the budgets Budget::resolve produced.
#pragma once
#include <span>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/core/params.hpp"

namespace kvpolicy {

struct Uniform {
  static constexpr std::string_view name = "uniform";
  static Uniform from_params(Params&) { return {}; }
  void allocate(const AllocContext&, std::span<std::int64_t>) const {}
};

}  // namespace kvpolicy
