// Shared pieces of kvpolicy_bench: one layer's synthetic cache at the shape (Hq=32,
// Hkv=8, d=128, W=32), paired timing (a subject and its reference alternate inside one benchmark,
// so both see the same machine load and the ratio survives noisy neighbours) and the result store
// the final report reads.
#pragma once
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/selection.hpp"

namespace kvbench {

using kvpolicy::cpu_backend;

inline constexpr std::int64_t kHq = 32, kHkv = 8, kDim = 128, kWindow = 32;
inline constexpr double kKeepRatio = 0.2;
inline constexpr std::int64_t kShortT = 4096, kLongT = 32768;

template <class T>
const char* dtype_label() {
  return std::is_same_v<T, float> ? "fp32" : "fp16";
}

// Fast deterministic fill (xorshift); values uniform in [-a, a].
template <class T>
void fill_uniform(std::vector<T>& v, std::uint64_t seed, float a) {
  std::uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& x : v) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    const float u = static_cast<float>(s >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    x = static_cast<T>(a * (2.0f * u - 1.0f));
  }
}

// One layer: K/V [1][Hkv][T][d] (HND), the pristine copies compaction is undone from, the last W
// queries [1][Hq][W][d] and an H2O accumulator [1][Hkv][T].
template <class T>
struct LayerData {
  std::int64_t tokens = 0;
  std::vector<T> k, v, k0, v0, q;
  std::vector<float> acc, acc0;

  explicit LayerData(std::int64_t t) : tokens(t) {
    const auto n = static_cast<std::size_t>(kHkv * t * kDim);
    k0.resize(n), v0.resize(n);
    fill_uniform(k0, 1, 1.0f), fill_uniform(v0, 2, 1.0f);
    k = k0, v = v0;
    q.resize(static_cast<std::size_t>(kHq * kWindow * kDim));
    fill_uniform(q, 3, 2.0f);
    acc0.resize(static_cast<std::size_t>(kHkv * t));
    fill_uniform(acc0, 4, 1.0f);
    for (auto& x : acc0) x = 1.0f + x;  // positive like real accumulators
    acc = acc0;
  }
  kvpolicy::KVView<T> keys() { return kvpolicy::KVView<T>::hnd(k.data(), 1, kHkv, tokens, kDim); }
  kvpolicy::KVView<T> values() {
    return kvpolicy::KVView<T>::hnd(v.data(), 1, kHkv, tokens, kDim);
  }
  kvpolicy::KVView<const T> queries() const {
    return kvpolicy::KVView<const T>::hnd(q.data(), 1, kHq, kWindow, kDim);
  }
  // Undoes an in-place compaction: only rows [0, rows) of each head were written.
  void restore(std::int64_t rows) {
    const std::size_t n = static_cast<std::size_t>(rows * kDim) * sizeof(T);
    for (std::int64_t h = 0; h < kHkv; ++h) {
      const std::size_t off = static_cast<std::size_t>(h * tokens * kDim);
      std::memcpy(static_cast<void*>(k.data() + off), k0.data() + off, n);
      std::memcpy(static_cast<void*>(v.data() + off), v0.data() + off, n);
    }
    acc = acc0;
  }
};

// Built once per (dtype, T) and kept for the whole run (about 0.8 GB at most).
template <class T>
LayerData<T>& layer_data(std::int64_t tokens) {
  static std::map<std::int64_t, std::unique_ptr<LayerData<T>>> cache;
  auto& p = cache[tokens];
  if (!p) p = std::make_unique<LayerData<T>>(tokens);
  return *p;
}

// A realistic 20% selection: per head, a random ascending set of round(0.2 T) tokens.
inline kvpolicy::Selection random_selection(std::int64_t tokens, std::uint64_t seed) {
  kvpolicy::Selection sel(1, kHkv);
  const auto keep = static_cast<std::int64_t>(std::llround(kKeepRatio * static_cast<double>(tokens)));
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(tokens));
  for (std::int64_t h = 0; h < kHkv; ++h) {
    for (std::int64_t j = 0; j < tokens; ++j) perm[static_cast<std::size_t>(j)] = static_cast<std::int32_t>(j);
    for (std::int64_t i = 0; i < keep; ++i) {  // partial Fisher-Yates
      std::uniform_int_distribution<std::int64_t> pick(i, tokens - 1);
      std::swap(perm[static_cast<std::size_t>(i)], perm[static_cast<std::size_t>(pick(rng))]);
    }
    auto& k = sel.kept(0, h);
    k.assign(perm.begin(), perm.begin() + keep);
    std::sort(k.begin(), k.end());
  }
  return sel;
}

// ---- results the final report reads ------------------------------------------------------------

struct Result {
  double subject_s = 0;      // median wall seconds per iteration of the measured op
  double subject_cpu_s = 0;  // median process CPU seconds (all threads) of the op
  double ref_s = 0;          // median wall seconds of its reference (0: none)
  double ratio = 0;          // median over iterations of ref / subject wall time (paired)
  double cpu_ratio = 0;      // the same with process CPU time
  double work = 0;           // bytes or flops per iteration (for rates)
  double aux = 0;            // a figure of the benchmark's own the report shows (0: none)
  int iterations = 0;
};

inline std::map<std::string, Result>& results() {
  static std::map<std::string, Result> r;
  return r;
}

// For the reports, after every run (--repeats): the result of `key` from the run whose ratio is
// the median one, or nullptr (benchmarks/main.cpp).
const Result* median_result(const std::string& key);

// For the reports: judges an added cost c = 1 / ratio - 1 of `key` (a subject that does more than
// its reference) against c <= limit in every run, adds it to the targets summary as `what`, and
// returns the cell shown ("+3.6% (+3.1%..+4.0%)") and whether it was met.
struct Judged {
  std::string cell;
  bool met = false;
};
Judged judge_added_cost(const std::string& what, const std::string& key, double limit);

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Wall and process CPU time of one call. CPU time leaves out the time our threads sat
// descheduled while other processes ran, so on an oversubscribed machine it is the steadier
// measure of the work done (it does include OpenMP's barrier spinning).
struct Timing {
  double wall = 0, cpu = 0;
};

inline double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

template <class F>
Timing timed(F&& f) {
  const double c0 = process_cpu_seconds();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const auto t1 = std::chrono::steady_clock::now();
  return {std::chrono::duration<double>(t1 - t0).count(), process_cpu_seconds() - c0};
}

// Times `subject` each iteration (manual time = wall), with `setup` run untimed right before it,
// after one untimed warm-up call (first-touch pages, allocator growth) unless warm_up is false.
// Register with UseManualTime().
template <class Setup, class Subject>
void time_op(benchmark::State& state, const std::string& key, double work, Setup&& setup,
             Subject&& subject, bool warm_up = true) {
  if (warm_up) setup(), subject();
  std::vector<double> wall, cpu;
  for (auto _ : state) {
    setup();
    const Timing t = timed(subject);
    state.SetIterationTime(t.wall);
    wall.push_back(t.wall), cpu.push_back(t.cpu);
  }
  Result r;
  r.subject_s = median(wall);
  r.subject_cpu_s = median(cpu);
  r.work = work;
  r.iterations = static_cast<int>(wall.size());
  results()[key] = r;
  state.counters["cpu_ms"] = r.subject_cpu_s * 1e3;
}

// Paired form: each iteration times the subject (after its untimed setup) and the reference,
// alternating which goes first; the manual time is the subject's wall time. The ratios are the
// medians of the per-iteration ratios ref/subject, so a burst of load from elsewhere tends to hit
// both sides of a pair. `before_each` runs untimed before every timed call of either side (a
// cache flush, or nothing).
template <class Setup, class Subject, class Ref, class Before = void (*)()>
void time_pair(benchmark::State& state, const std::string& key, double work, Setup&& setup,
               Subject&& subject, Ref&& ref, Before&& before_each = [] {}) {
  setup(), subject(), ref();
  std::vector<double> wall_s, wall_r, cpu_s, ratio, cpu_ratio;
  bool subject_first = true;
  for (auto _ : state) {
    Timing s, r;
    if (!subject_first) before_each(), r = timed(ref);
    setup();
    before_each();
    s = timed(subject);
    if (subject_first) before_each(), r = timed(ref);
    subject_first = !subject_first;
    state.SetIterationTime(s.wall);
    wall_s.push_back(s.wall), wall_r.push_back(r.wall), cpu_s.push_back(s.cpu);
    ratio.push_back(r.wall / s.wall), cpu_ratio.push_back(r.cpu / s.cpu);
  }
  Result r;
  r.subject_s = median(wall_s);
  r.subject_cpu_s = median(cpu_s);
  r.ref_s = median(wall_r);
  r.ratio = median(ratio);
  r.cpu_ratio = median(cpu_ratio);
  r.work = work;
  r.iterations = static_cast<int>(wall_s.size());
  results()[key] = r;
  state.counters["ref_ms"] = r.ref_s * 1e3;
  state.counters["ratio"] = r.ratio;
  state.counters["cpu_ratio"] = r.cpu_ratio;
}

// Evicts the caches by reading 3x the L3 size (32 MiB here), so that the next call starts from
// DRAM, as a decode step finds a layer's cache after the other layers have run.
inline void flush_caches() {
  static std::vector<std::uint64_t> junk(std::size_t{96} << 17, 1);  // 96 MiB
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < junk.size(); i += 8) s += junk[i];
  benchmark::DoNotOptimize(s);
}

// Registration hooks, called from main in report order.
void register_snapkv();
void register_h2o();
void register_compact();
void register_alloc();
void register_merge();
void register_quant();

}  // namespace kvbench
