// Shared by the fuzz targets (each includes it from its one source file): sanitizer defaults, how
// a target reports a finding, and value pickers over libFuzzer's FuzzedDataProvider that mix
// ordinary values with the edges (0, -1, the int32/int64 limits, NaN, infinities) that break
// size arithmetic.
#pragma once
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include <common/random_kv.hpp>

// UBSan reports with the stack that led to them (UBSAN_OPTIONS overrides it). Defined here, not
// inline: the runtime's weak default must be overridden.
extern "C" const char* __ubsan_default_options() { return "print_stacktrace=1"; }

// One OpenMP thread unless the environment says otherwise (scripts/fuzz.sh sets the same): the
// library's OpenMP loops run on the calling thread, so results and coverage do not depend on
// scheduling, and libomp starts no worker threads, whose state it allocates lazily and never
// frees (libFuzzer's per-input leak check reports it). OMP_THREAD_LIMIT also caps num_threads
// clauses, e.g. the C ABI's params->threads. libomp reads both when it first initializes, which
// is after this: nothing calls OpenMP before the first input.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("OMP_NUM_THREADS", "1", 0);
  setenv("OMP_THREAD_LIMIT", "1", 0);
  return 0;
}

namespace kvp_fuzz {

// A broken contract: prints the reason and aborts, which libFuzzer records as a crash with the
// input that caused it.
[[noreturn, gnu::format(printf, 1, 2)]] inline void finding(const char* fmt, ...) {
  std::va_list ap;
  va_start(ap, fmt);
  std::fputs("FINDING: ", stderr);
  std::vfprintf(stderr, fmt, ap);
  std::fputc('\n', stderr);
  va_end(ap);
  std::abort();
}

// Which edge values pick_int may return besides [lo, hi].
enum class Edges : std::uint8_t {
  // Anything: negative, the int32 limits, 2^32, 2^40, ... For values nothing is allocated by
  // (budgets, strides, indices, buffer counts the harness backs itself).
  any,
  // Sizes the library may allocate by (extents, session shapes): only values whose product with
  // any factor >= 2 overflows int64 (which the library must reject, not compute), and negatives.
  // A huge but representable size is a legitimate request for that much memory, and under ASan
  // a failing operator new aborts instead of throwing std::bad_alloc.
  sizes,
};

// An integer that is usually in [lo, hi] and sometimes an edge value (see Edges).
inline std::int64_t pick_int(FuzzedDataProvider& fdp, std::int64_t lo, std::int64_t hi,
                             Edges edges = Edges::any) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  static constexpr std::int64_t kAny[] = {
      0,         -1,        1,          2,
      3,         7,         64,         255,
      4096,      (std::int64_t{1} << 31) - 1,     std::int64_t{1} << 31,
      std::int64_t{1} << 32,          (std::int64_t{1} << 32) + 1,
      std::int64_t{1} << 40,          std::int64_t{1} << 62,
      kMax,      kMax / 2 + 1,        -kMax - 1,  -(std::int64_t{1} << 31)};
  static constexpr std::int64_t kSizes[] = {0, -1, -kMax - 1, std::int64_t{1} << 62, kMax / 2 + 1,
                                            kMax};
  if (fdp.ConsumeIntegralInRange<int>(0, 15) != 0) return fdp.ConsumeIntegralInRange(lo, hi);
  if (edges == Edges::sizes)
    return kSizes[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kSizes) - 1)];
  return kAny[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kAny) - 1)];
}

// A Session keeps the newest query_window queries of every query head in a ring allocated up
// front: a window of millions is a legitimate request for that much memory (see Edges::sizes),
// so targets skip sessions for windows between 2^16 and 2^62. From 2^62 on the ring's size
// overflows, which the library must reject.
inline bool window_too_large_to_back(std::int64_t query_window) {
  return query_window > (std::int64_t{1} << 16) && query_window < (std::int64_t{1} << 62);
}

// A double that is usually in [lo, hi] and sometimes NaN, an infinity, a denormal, a huge value
// or a value just past the int64 range.
inline double pick_double(FuzzedDataProvider& fdp, double lo, double hi) {
  static constexpr double kEdges[] = {std::numeric_limits<double>::quiet_NaN(),
                                      std::numeric_limits<double>::infinity(),
                                      -std::numeric_limits<double>::infinity(),
                                      0.0,
                                      -0.0,
                                      4.9e-324,
                                      1e300,
                                      -1.0,
                                      9.0e18,
                                      9.3e18,
                                      1.0000001,
                                      0.5};
  if (fdp.ConsumeIntegralInRange<int>(0, 7) != 0) {
    const double u = fdp.ConsumeProbability<double>();
    return lo + (hi - lo) * u;
  }
  return kEdges[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kEdges) - 1)];
}

// Deterministic filler for tensors: small inputs still give many distinct values. The tests'
// portable splitmix64 generator; uniform() is in [-1, 1).
using Rng = kvtest::Rng;

// How tensor values are drawn: ties and huge magnitudes stress scoring and top-k.
enum class Fill : std::uint8_t { random, constant, few_levels, huge, tiny, nonfinite };

inline Fill pick_fill(FuzzedDataProvider& fdp, bool allow_nonfinite) {
  const auto f = static_cast<Fill>(fdp.ConsumeIntegralInRange<int>(0, 5));
  return f == Fill::nonfinite && !allow_nonfinite ? Fill::random : f;
}

inline float fill_value(Fill f, Rng& rng, std::size_t i) {
  switch (f) {
    case Fill::random: return static_cast<float>(rng.uniform());
    case Fill::constant: return 0.25f;
    case Fill::few_levels: return static_cast<float>(rng.next() % 3) - 1.0f;
    case Fill::huge: return static_cast<float>(rng.uniform() * 3.0e38);
    case Fill::tiny: return static_cast<float>(rng.uniform() * 1e-40);
    case Fill::nonfinite:
      return i % 7 == 3 ? std::numeric_limits<float>::quiet_NaN()
             : i % 7 == 5 ? std::numeric_limits<float>::infinity()
                          : static_cast<float>(rng.uniform());
  }
  return 0.0f;
}

}  // namespace kvp_fuzz
