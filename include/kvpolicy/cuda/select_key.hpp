// Sort key of token j in a selection row, shared by the CUDA top-k and the CPU tests: protected
// tokens (sinks, recent) are forced above every scored token, the rest follow the library's
// total order topk_key (higher score first, ties -> higher index). Taking the first `budget`
// keys of a row sorted descending therefore yields exactly what cpu::select keeps.
// Header is free of Eigen and CUDA headers so .cu translation units include it as is.
#pragma once
#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/topk_key.hpp"

namespace kvpolicy::cuda {

// Protected tokens of a row of `tokens` tokens: [0, sinks) and [recent_begin, tokens). Matches
// cpu::select_row: sinks clipped to the row, the recent window never overlapping the sinks.
struct ProtectedSpan {
  std::int64_t sinks = 0;
  std::int64_t recent_begin = 0;

  KVP_HD bool contains(std::int64_t j) const { return j < sinks || j >= recent_begin; }
  KVP_HD std::int64_t count(std::int64_t tokens) const { return sinks + (tokens - recent_begin); }
};

KVP_HD inline ProtectedSpan protected_span(std::int64_t sinks, std::int64_t recent,
                                           std::int64_t tokens) {
  const std::int64_t s = sinks < 0 ? 0 : (sinks > tokens ? tokens : sinks);
  const std::int64_t r = recent < 0 ? 0 : recent;
  const std::int64_t rb = tokens - r;
  return {s, rb > s ? rb : s};
}

// High word of every protected key. orderable_bits() of any float (+inf included) is at most
// 0xff800000, so scored keys stay strictly below it whatever the score.
inline constexpr std::uint64_t protected_key_floor = 0xffffffff00000000ull;

KVP_HD inline std::uint64_t select_key(float score, std::int32_t j, ProtectedSpan p) {
  if (p.contains(j)) return protected_key_floor | static_cast<std::uint32_t>(j);
  return topk_key(score, j);
}

}  // namespace kvpolicy::cuda
