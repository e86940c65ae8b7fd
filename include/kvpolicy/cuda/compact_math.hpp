// Per-thread logic of the dense compaction kernels (cuda/compact.cu) as KVP_HD functions, free of
// CUDA headers, so that the CPU tests run exactly these functions in a host loop that emulates
// the cluster kernel's grid and barriers (tests/agreement/test_compact_rounds.cpp).
//
// A (layer, head) row keeps rows kept[0..n) (strictly ascending, kept[i] >= i) and moves row
// kept[i] to row i, in place. Rows before first_moved() are already in place. The rest is moved
// in copy units: unit e is column c of kept row i, e = i * row_units + c (i counted from
// first_moved). The cluster kernel moves a row in rounds of cluster_round_units() units; in a
// round, thread t of block `rank` handles units cluster_first_unit(u0, rank, t) + k *
// kClusterThreads for k < kClusterUnits: it loads all of them, the cluster synchronises, then it
// stores them.
#pragma once
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::cuda::compact_math {

inline constexpr int kClusterBlocks = 8;     // blocks per cluster (the portable maximum)
inline constexpr int kClusterThreads = 512;  // threads per block
inline constexpr int kClusterUnits = 8;      // units per thread and round, staged in registers

// First i with kept[i] != i: kept[i] == i holds exactly on a prefix.
KVP_HD inline std::int64_t first_moved(const std::int32_t* kept, std::int64_t n) {
  std::int64_t lo = 0, hi = n;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (kept[mid] == mid) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Units a cluster moves per round.
KVP_HD inline constexpr std::int64_t cluster_round_units() {
  return std::int64_t{kClusterBlocks} * kClusterThreads * kClusterUnits;
}

// The first unit thread `thread` of block `rank` handles in the round that starts at unit u0.
KVP_HD inline std::int64_t cluster_first_unit(std::int64_t u0, std::int64_t rank, int thread) {
  return u0 + rank * (std::int64_t{kClusterThreads} * kClusterUnits) + thread;
}

// Unit e as (kept row i, column c).
struct Unit {
  std::int64_t i = 0;
  int c = 0;
};

KVP_HD inline Unit unit_at(std::int64_t e, int row_units) {
  Unit u;
  u.i = e / row_units;
  u.c = static_cast<int>(e - u.i * row_units);
  return u;
}

// A thread's next unit is kClusterThreads further on: (i, c) advance by (di, dc) =
// (kClusterThreads / row_units, kClusterThreads % row_units), computed once per row, with one
// carry (c + dc stays below 2 * row_units), so the loop divides nowhere.
struct UnitStep {
  std::int64_t di = 0;
  int dc = 0;
};

KVP_HD inline UnitStep unit_step(int row_units) {
  return {kClusterThreads / row_units, kClusterThreads % row_units};
}

KVP_HD inline void next_unit(Unit& u, const UnitStep& s, int row_units) {
  u.i += s.di;
  u.c += s.dc;
  if (u.c >= row_units) u.c -= row_units, ++u.i;
}

}  // namespace kvpolicy::cuda::compact_math
