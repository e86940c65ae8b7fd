// kvpolicy_bench: per-layer timings of the CPU paths at the shape, then a markdown report
// of the ratio targets (compaction vs memcpy >= 0.7, SnapKV scoring vs Eigen GEMM >= 0.6,
// allocator overhead < 10%, quantized encode vs memcpy >= 0.5, INT2 decode attention >= 3x fp32,
// H2O column sums added to the prefill attention <= 20%)
// and of the merge cost as a fraction of SnapKV's scoring.
// Every ratio is measured side by side, alternating inside one benchmark, because the machine
// is shared; `--benchmark_filter` selects benchmarks as usual and the report covers what ran.
// `--repeats=N` runs the selected benchmarks N times in a row (default 3): the report then shows
// each judged ratio as its median over the runs with the range (min..max), and a target counts
// as met only when it holds in every run.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common.hpp"

namespace kvbench {
namespace {

// One map of results per run (--repeats).
std::vector<std::map<std::string, Result>>& runs() {
  static std::vector<std::map<std::string, Result>> r;
  return r;
}

// Ratios (ref / subject, wall time) of `key` over the runs that have it.
struct Spread {
  double lo = 0, med = 0, hi = 0;
  int n = 0;
};
Spread spread(const std::string& key) {
  std::vector<double> v;
  for (const auto& run : runs())
    if (auto it = run.find(key); it != run.end()) v.push_back(it->second.ratio);
  Spread s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.lo = v.front(), s.hi = v.back(), s.med = median(v), s.n = static_cast<int>(v.size());
  return s;
}

// The result of the run whose ratio is the median one (the lower middle for an even count), so
// that a row's times and rates come from one run.
const Result* find(const std::string& key) {
  std::vector<const Result*> v;
  for (const auto& run : runs())
    if (auto it = run.find(key); it != run.end()) v.push_back(&it->second);
  if (v.empty()) return nullptr;
  std::sort(v.begin(), v.end(), [](const Result* a, const Result* b) { return a->ratio < b->ratio; });
  return v[(v.size() - 1) / 2];
}

// "median" for one run, else "median (min..max)", of `f(ratio)` (f maps a ratio to what the
// column shows, e.g. an overhead; it may reverse the order).
template <class F>
std::string cell(const Spread& s, F&& f, const char* fmt = "%.2f") {
  char a[32], b[32], c[32];
  std::snprintf(a, sizeof a, fmt, f(s.med));
  if (s.n <= 1) return a;
  const double x = f(s.lo), y = f(s.hi);
  std::snprintf(b, sizeof b, fmt, std::min(x, y));
  std::snprintf(c, sizeof c, fmt, std::max(x, y));
  return std::string(a) + " (" + b + ".." + c + ")";
}
std::string cell(const Spread& s, const char* fmt = "%.2f") {
  return cell(s, [](double x) { return x; }, fmt);
}

// Judged targets, in report order, for the summary at the end.
struct Target {
  std::string what, value;
  std::string target;
  bool met = false;
  int n = 0;
};
std::vector<Target>& targets() {
  static std::vector<Target> t;
  return t;
}

// Met in every run: the smallest ratio reaches `target`.
const char* judge(const std::string& what, const Spread& s, double target, const char* fmt = "%.2f") {
  const bool met = s.n > 0 && s.lo >= target;
  char t[32];
  std::snprintf(t, sizeof t, ">= %g", target);
  targets().push_back({what, cell(s, fmt), t, met, s.n});
  return met ? "yes" : "**no**";
}

std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  f >> a >> b >> c;
  return a.empty() ? "n/a" : a + " " + b + " " + c;
}

const char* isa() {
  return "AVX2 "
#if defined(EIGEN_VECTORIZE_AVX2)
         "on"
#else
         "off"
#endif
         ", FMA "
#if defined(EIGEN_VECTORIZE_FMA)
         "on"
#else
         "off"
#endif
         ", F16C "
#if defined(__F16C__)
         "on";
#else
         "off";
#endif
}

void report_times(const char* const dts[2], const std::int64_t ts[2]) {
  std::printf("\n### Compression time per layer (median ms; 20%% budget)\n\n");
  std::printf("| op | dtype | T | median ms | CPU ms (2 threads) | iters |\n"
              "|---|---|---:|---:|---:|---:|\n");
  const char* ops[] = {"snapkv_compress", "snapkv_compress_checked", "h2o_compress",
                       "h2o_prefill_accumulate"};
  for (const char* op : ops)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const std::string key = std::string(op) + "/" + dts[i] + "/T:" + std::to_string(ts[j]);
        const Result* r = find(key);
        if (!r) continue;
        std::printf("| %s | %s | %lld | %.3f | %.3f | %d |\n", op, dts[i],
                    static_cast<long long>(ts[j]), r->subject_s * 1e3, r->subject_cpu_s * 1e3,
                    r->iterations);
        if (r->work > 0)  // prefill: also its rate
          std::printf("|   ↳ %.1f GFLOP causal: %.1f GFLOP/s wall, %.1f GFLOP per CPU-second "
                      "| | | | | |\n",
                      r->work * 1e-9, r->work / r->subject_s * 1e-9,
                      r->work / r->subject_cpu_s * 1e-9);
      }
  std::printf(
      "\nsnapkv_compress = Pipeline<SnapKV(window=32,kernel=7,max), Uniform>::select + "
      "cpu::compact(K, V) (what Session runs); snapkv_compress_checked = "
      "Pipeline::compress, which adds the NaN/Inf scan of K, V and Q. h2o_compress = select from "
      "Inputs::accumulated + compact K, V and the accumulator. h2o_prefill_accumulate at "
      "T=32768 is not run: it is O(T^2 d Hq), ~64x the T=4096 time per layer on this CPU.\n");
}

void report_compact(const char* const dts[2], const std::int64_t ts[2]) {
  std::printf("\n### Compaction bandwidth vs memcpy of the same bytes (target >= 0.7)\n\n");
  std::printf(
      "| dtype | T | caches | MB moved | compact ms | compact GB/s | memcpy ms | memcpy GB/s | "
      "ratio | CPU-time ratio | target | met |\n"
      "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (const char* bm : {"compact_vs_memcpy", "compact_vs_memcpy_cold"})
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        const Result* r = find(std::string(bm) + "/" + dts[i] + "/T:" + std::to_string(ts[j]));
        if (!r) continue;
        const bool cold = std::string(bm).ends_with("cold");
        const std::string key = std::string(bm) + "/" + dts[i] + "/T:" + std::to_string(ts[j]);
        const Spread sp = spread(key);
        const std::string what = std::string("compaction ") + dts[i] + " T=" +
                                 std::to_string(ts[j]) + (cold ? " evicted" : " warm");
        std::printf(
            "| %s | %lld | %s | %.2f | %.3f | %.2f | %.3f | %.2f | %s | %.2f | 0.7 | %s |\n",
            dts[i], static_cast<long long>(ts[j]), cold ? "evicted" : "warm", r->work * 1e-6,
            r->subject_s * 1e3, r->work / r->subject_s * 1e-9, r->ref_s * 1e3,
            r->work / r->ref_s * 1e-9, cell(sp).c_str(), r->cpu_ratio, judge(what, sp, 0.7));
      }
  std::printf(
      "\nBytes = kept rows x row bytes x 2 (K and V), counted once (each is read and written); "
      "random ascending 20%% kept set per head. Ratio = median over paired iterations of "
      "t_memcpy / t_compact in wall time (judged, warm and evicted); CPU-time ratio = the same "
      "with process CPU time (steadier when the machine is oversubscribed). warm: as the loop "
      "leaves the caches (memcpy's source and destination fit in L3 at T=4096, compaction's "
      "scattered source rows span the whole K/V buffer); evicted: caches flushed before every "
      "timed call, both sides from DRAM.\n");
}

void report_score(const char* const dts[2], const std::int64_t ts[2]) {
  std::printf("\n### SnapKV scoring GFLOP/s vs Eigen GEMM of the same shape (target >= 0.6)\n\n");
  std::printf(
      "| dtype | T | GFLOP | score ms | score GFLOP/s | GEMM ms | GEMM GFLOP/s | ratio | "
      "CPU-time ratio | target | met |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      const Result* r =
          find(std::string("snapkv_score_vs_gemm/") + dts[i] + "/T:" + std::to_string(ts[j]));
      if (!r) continue;
      const Spread sp =
          spread(std::string("snapkv_score_vs_gemm/") + dts[i] + "/T:" + std::to_string(ts[j]));
      const std::string what = std::string("snapkv scoring vs GEMM ") + dts[i] + " T=" +
                               std::to_string(ts[j]);
      std::printf("| %s | %lld | %.2f | %.3f | %.1f | %.3f | %.1f | %s | %.2f | 0.6 | %s |\n",
                  dts[i], static_cast<long long>(ts[j]), r->work * 1e-9, r->subject_s * 1e3,
                  r->work / r->subject_s * 1e-9, r->ref_s * 1e3, r->work / r->ref_s * 1e-9,
                  cell(sp).c_str(), r->cpu_ratio, judge(what, sp, 0.6));
    }
  std::printf(
      "\nFLOP = 2*Hq*W*T*d (QK^T only). The causal mask inside the window removes only "
      "W(W-1)/2 of W*T logits per head ((W-1)/2T: 0.4%% at 4096, 0.05%% at 32768), so it halves "
      "nothing; the kernel computes those logits anyway. Score time = cpu::window_attention of "
      "the last W queries (fp32 GEMM, softmax, column sums, GQA mean) + max pooling. Reference = "
      "per KV head (g*W x d).(d x T) fp32 Eigen GEMM into a g*W x T buffer, 8 heads over "
      "cpu::parallel_for; for fp16 it runs on pre-converted fp32 keys (Eigen has no fast half "
      "GEMM; the library converts K to fp32 inside the timed score). Ratio = median over paired "
      "iterations of t_gemm / t_score in wall time (judged); CPU-time ratio = the same with "
      "process CPU time.\n");
}

void report_alloc() {
  std::printf("\n### Allocator overhead per layer at T=%lld, fp16 (target < 10%% of the pipeline)\n\n",
              static_cast<long long>(kLongT));
  std::printf("| chain | pipeline ms | same scorer, uniform ms | overhead | CPU-time overhead | "
              "target | met |\n|---|---:|---:|---:|---:|---:|---|\n");
  const std::string prefix = "alloc_overhead/", suffix = "/fp16/T:" + std::to_string(kLongT);
  if (runs().empty()) return;
  for (const auto& [key, unused] : runs().front()) {
    if (!key.starts_with(prefix) || !key.ends_with(suffix)) continue;
    const Result& r = *find(key);
    const Spread sp = spread(key);
    const std::string chain = key.substr(prefix.size(), key.size() - prefix.size() - suffix.size());
    const double cpu_over = 1.0 - r.cpu_ratio;
    std::string shown;
    for (char c : chain) shown += c == '|' ? std::string(" \\| ") : std::string(1, c);
    const auto pct = [](double ratio) { return 100.0 * (1.0 - ratio); };
    // overhead < 10% in every run: the smallest ratio t_uniform / t_chain above 0.9
    const bool met = sp.n > 0 && 1.0 - sp.lo < 0.10;
    targets().push_back({"allocator overhead " + chain, cell(sp, pct, "%.1f%%"), "< 10%", met, sp.n});
    std::printf("| `%s` | %.2f | %.2f | %s | %.1f%% | 10%% | %s |\n", shown.c_str(),
                r.subject_s * 1e3, r.ref_s * 1e3, cell(sp, pct, "%.1f%%").c_str(), 100 * cpu_over,
                met ? "yes" : "**no**");
  }
  std::printf(
      "\nPipeline = Pipeline<scorer, chain>::select for layer 15 of a 32-layer model + compaction "
      "of K and V (and of the H2O accumulator), 20%% budget; reference = the same with the "
      "uniform split, alternating inside one benchmark. Overhead = 1 - median(t_uniform / "
      "t_chain). ams reads the GQA-mean attention of the last 32 queries: with snapkv it shares "
      "the scorer's window attention (Stats), with h2o it computes it, and that attention is "
      "most of its cost (2 Hq w T d = 8.6 GFLOP at T=32768, ~15x the rest of the event). It "
      "cannot be shared there: h2o scores from its accumulator, the sum of the attention of "
      "every query so far, and nothing in the event holds the last 32 queries' share of it "
      "(the accumulator minus a copy taken 32 queries earlier is not one: the window is about "
      "w/T of each sum, so fp32 cancellation leaves a relative error near 2^-24 T/w). Sharing "
      "would take a second, windowed accumulator filled by the attention that fills the first "
      "(cpu::attention's accumulate, for the last w queries before an event); until then "
      "`h2o | ams` pays for the window attention.\n");
}

void report_expected() {
  std::printf("\n### Expected attention scoring per layer vs SnapKV scoring, fp16, T = 8192\n\n");
  std::printf("| queries in the statistics | expected ms | snapkv scoring ms | expected/snapkv | "
              "CPU-time expected/snapkv | iters |\n|---:|---:|---:|---:|---:|---:|\n");
  for (int nq : {static_cast<int>(kWindow), 1024}) {
    const Result* r = find("expected_vs_snapkv_score/fp16/T:8192/nq:" + std::to_string(nq));
    if (!r) continue;
    std::printf("| %d | %.1f | %.1f | %.2f | %.2f | %d |\n", nq, r->subject_s * 1e3,
                r->ref_s * 1e3, 1.0 / r->ratio, 1.0 / r->cpu_ratio, r->iterations);
  }
  std::printf("\nExpected = ExpectedAttention::score (defaults: covariance and value norms on) "
              "on one layer of 8 KV heads, 32 query heads, d = 128, with the statistics of the "
              "given number of queries; SnapKV = SnapKV::score with its authors' window of 32 "
              "queries, fresh Stats, alternating inside one benchmark.\n");
}

void report_merge(const std::int64_t ts[2]) {
  std::printf("\n### Merge cost per layer vs SnapKV scoring, fp16 (20%% budget)\n\n");
  std::printf("| merger | T | merge ms | snapkv scoring ms | merge/score | CPU-time merge/score | "
              "tokens absorbed | iters |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int j = 0; j < 2; ++j)
    for (const char* m : {"semantic:tau=0.9", "semantic:tau=0.5", "semantic:tau=0", "nearest"}) {
      const Result* r = find(std::string("merge_vs_snapkv_score/") + m + "/fp16/T:" +
                             std::to_string(ts[j]));
      if (!r) continue;
      const double evicted = static_cast<double>(
          kHkv * (ts[j] - std::llround(kKeepRatio * static_cast<double>(ts[j]))));
      std::printf("| %s | %lld | %.2f | %.2f | %.3f | %.3f | %.0f (%.1f%% of evicted) | %d |\n", m,
                  static_cast<long long>(ts[j]), r->subject_s * 1e3, r->ref_s * 1e3, 1.0 / r->ratio,
                  1.0 / r->cpu_ratio, r->aux, 100.0 * r->aux / evicted, r->iterations);
    }
  std::printf(
      "\nThe event: Pipeline<SnapKV(window=32,kernel=7,max), Uniform>::select at 20%% with its "
      "ScoreMap, protect = snapkv.protect (the last 32 tokens), computed once, untimed. Merge = "
      "Merger::merge on the layer (K/V restored and log_count zeroed, untimed, before every "
      "call); semantic uses its defaults (chunk = 32: fixed 32-token chunks, as no delimiter "
      "mask is given; weight = importance) with the tau shown; nearest folds every evicted "
      "token's value into the most cosine-similar kept key (one fp32 GEMM of evicted x kept x d "
      "per head). Reference = SnapKV::score of the same layer with a fresh Stats (fp16 K "
      "converted inside, window attention + max pooling), alternating with the merge inside one "
      "benchmark. merge/score = 1 / median over paired iterations of t_score / t_merge in wall "
      "time (odd iteration counts: the median of t_merge / t_score); CPU-time merge/score = the "
      "same with process CPU time. Tokens absorbed = sum over kept rows of (count - 1) after "
      "one merge, over the 8 KV heads. The keys are uniform random, so the cosine of two keys "
      "has a spread of about 1/sqrt(d) = 0.09 around 0: tau = 0.9 and 0.5 merge next to nothing "
      "and semantic's cost is its clustering scan; tau = 0 absorbs about 60%% of the evicted "
      "tokens and shows the cost of writing cores.\n");
}

void report_quant(const std::int64_t ts[2]) {
  std::printf("\n### Quantized encode bandwidth vs memcpy of the same input (target >= 0.5)\n\n");
  std::printf("| format | T | input MB | packed MB | encode ms | encode GB/s | memcpy ms | "
              "memcpy GB/s | ratio | CPU-time ratio | target | met |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  const char* formats[] = {"int2", "kivi", "int4"};
  for (const char* f : formats)
    for (int j = 0; j < 2; ++j) {
      const Result* r = find(std::string("quant_encode_vs_memcpy/") + f + "/fp32/T:" +
                             std::to_string(ts[j]));
      if (!r) continue;
      const Spread sp = spread(std::string("quant_encode_vs_memcpy/") + f + "/fp32/T:" +
                               std::to_string(ts[j]));
      const std::string what = std::string(f) + " encode vs memcpy T=" + std::to_string(ts[j]);
      std::printf(
          "| %s | %lld | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f | %s | %.3f | 0.5 | %s |\n", f,
          static_cast<long long>(ts[j]), r->work * 1e-6, r->aux * 1e-6, r->subject_s * 1e3,
          r->work / r->subject_s * 1e-9, r->ref_s * 1e3, r->work / r->ref_s * 1e-9,
          cell(sp, "%.3f").c_str(), r->cpu_ratio, judge(what, sp, 0.5, "%.3f"));
    }
  std::printf(
      "\nFormats (group 32, residual 128): int2 = 2-bit codes after the Hadamard rotation and "
      "per-token key norm (OScaR); kivi = 2-bit codes without either; int4 = int2's transform "
      "with 4-bit codes. Encode = PackedCache::append of T fp32 tokens (K and V) into each of "
      "the 8 KV heads' emptied caches (clear() keeps capacity, so no allocation is timed), one "
      "head per task over cpu::parallel_for. Reference = memcpy of the same input bytes "
      "(K and V, 16 chunks of T x d x 4 bytes) over cpu::parallel_for on the same threads, into "
      "a destination skewed by half a page. GB/s = input bytes (2 x 8 x T x d x 4) / time for "
      "both. Ratio = median over paired iterations of t_memcpy / t_encode in wall time (judged); "
      "CPU-time ratio = the same with process CPU time. Packed MB = the caches' memory_bytes() "
      "(packed tiles + the fp32 residual of 128 tokens per head).\n");

  std::printf("\n### Decode attention over packed caches vs fp32 attention, T=%lld (target >= "
              "3x)\n\n", static_cast<long long>(kLongT));
  std::printf("| format | caches | packed MB | fp32 MB | packed ms | fp32 ms | speedup | "
              "CPU-time speedup | rel. error | target | met |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  const double fp32_bytes = 2.0 * kHkv * static_cast<double>(kLongT) * kDim * sizeof(float);
  for (const char* bm : {"quant_decode_attention_cold/", "quant_decode_attention/"})
    for (const char* f : formats) {
      const Result* r = find(std::string(bm) + f + "/fp32/T:" + std::to_string(kLongT));
      if (!r) continue;
      const bool cold = std::string(bm).find("cold") != std::string::npos;
      const Spread sp = spread(std::string(bm) + f + "/fp32/T:" + std::to_string(kLongT));
      const bool judged = cold && std::string(f) == "int2";
      std::printf("| %s | %s | %.1f | %.1f | %.2f | %.2f | %sx | %.2fx | %.3f | 3x | %s |\n", f,
                  cold ? "evicted" : "warm", r->work * 1e-6, fp32_bytes * 1e-6, r->subject_s * 1e3,
                  r->ref_s * 1e3, cell(sp).c_str(), r->cpu_ratio, r->aux,
                  judged ? judge("int2 decode attention vs fp32, evicted", sp, 3.0) : "(info)");
    }
  std::printf(
      "\nOne decode step of one layer: n_q = 1 query per head, Hq = 32 query heads over 8 KV "
      "heads (GQA 4), T tokens per KV head, no bias. Packed = quant::packed_attention over the 8 "
      "PackedCaches encoded from the fp32 layer (1020 packed tiles of 32 tokens + 128 residual "
      "tokens per head); fp32 = cpu::attention over that fp32 K/V (lengths = T). Speedup = "
      "median over paired iterations of t_fp32 / t_packed in wall time; CPU-time speedup = the "
      "same with process CPU time. Judged: int2 with the caches evicted before every timed call "
      "(a layer's cache is cold when the next step reaches it); warm = what the loop leaves in "
      "the 32 MiB L3 (the int2 caches nearly fit, fp32 never does). rel. error = ||out_packed - "
      "out_fp32|| / ||out_fp32|| over the 32 heads' outputs (quantization error, for scale).\n");
}

void report_targets() {
  if (targets().empty()) return;
  std::printf("\n### Targets over %zu run(s) of the selected benchmarks\n\n", runs().size());
  std::printf("| target | median (min..max) | target | met in every run |\n|---|---:|---:|---|\n");
  int met = 0;
  for (const Target& t : targets()) {
    std::printf("| %s | %s | %s | %s |\n", t.what.c_str(), t.value.c_str(), t.target.c_str(),
                t.met ? "yes" : "**no**");
    met += t.met;
  }
  std::printf("\n%d of %zu targets met in every run.\n", met, targets().size());
}

// Takes `--repeats=N` out of argv (Google Benchmark rejects flags it does not know).
int take_repeats(int& argc, char** argv) {
  int repeats = 3, out = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--repeats=", 0) == 0) {
      char* end = nullptr;
      const long v = std::strtol(a.c_str() + 10, &end, 10);
      if (end == a.c_str() + 10 || *end != '\0' || v < 1 || v > 100) {
        std::fprintf(stderr,
                     "kvpolicy_bench: --repeats takes a whole number from 1 to 100 (got '%s')\n",
                     a.c_str() + 10);
        std::exit(2);
      }
      repeats = static_cast<int>(v);
      continue;
    }
    argv[out++] = argv[i];
  }
  argc = out;
  return repeats;
}

}  // namespace

const Result* median_result(const std::string& key) { return find(key); }

Judged judge_added_cost(const std::string& what, const std::string& key, double limit) {
  const Spread sp = spread(key);
  const auto added = [](double ratio) { return 100.0 * (1.0 / ratio - 1.0); };
  // The largest added cost is that of the smallest ratio.
  const bool met = sp.n > 0 && sp.lo > 0 && added(sp.lo) <= 100.0 * limit;
  char t[32];
  std::snprintf(t, sizeof t, "<= %g%%", 100.0 * limit);
  const std::string c = cell(sp, added, "%+.1f%%");
  targets().push_back({what, c, t, met, sp.n});
  return {c, met};
}

// Observed attention at prefill cost and decode attention (bench_prefill_attention.cpp).
void register_prefill_attention();
void report_prefill_attention();
}  // namespace kvbench

int main(int argc, char** argv) {
  const int repeats = kvbench::take_repeats(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf(
      "kvpolicy_bench: one layer, Hq=%lld, Hkv=%lld, d=%lld, W=%lld, budget %.0f%%; OpenMP "
      "default threads = %d (used for every op and reference); %s; load average %s\n",
      static_cast<long long>(kvbench::kHq), static_cast<long long>(kvbench::kHkv),
      static_cast<long long>(kvbench::kDim), static_cast<long long>(kvbench::kWindow),
      kvbench::kKeepRatio * 100, omp_get_max_threads(), kvbench::isa(),
      kvbench::load_average().c_str());
  std::fflush(stdout);
  kvbench::register_snapkv();
  kvbench::register_h2o();
  kvbench::register_compact();
  kvbench::register_alloc();
  kvbench::register_merge();
  kvbench::register_quant();
  kvbench::register_prefill_attention();
  for (int r = 0; r < repeats; ++r) {  // each run fills results(); kept per run for the report
    if (repeats > 1) std::printf("\n# run %d of %d\n", r + 1, repeats), std::fflush(stdout);
    // A reporter of our own per run: Google Benchmark 1.7's default one does not survive a
    // second RunSpecifiedBenchmarks (it crashes).
    benchmark::ConsoleReporter display;
    benchmark::RunSpecifiedBenchmarks(&display);
    kvbench::runs().push_back(std::move(kvbench::results()));
    kvbench::results().clear();
  }

  // The report tables are built from the CPU benchmarks' results; a filter that selected none
  // of them (e.g. the CUDA ones, scripts/device_check.sh) gets no empty tables.
  if (std::all_of(kvbench::runs().begin(), kvbench::runs().end(),
                  [](const auto& run) { return run.empty(); })) {
    std::printf("\nkvpolicy_bench: no CPU ratio benchmark was selected, so no report tables\n");
    std::fflush(stdout);
    benchmark::Shutdown();
    return 0;
  }
  const char* dts[2] = {"fp16", "fp32"};
  const std::int64_t ts[2] = {kvbench::kShortT, kvbench::kLongT};
  std::printf("\n## kvpolicy_bench report (OpenMP threads: %d for every op; %s; load average "
              "%s at the end; %d run(s): judged ratios are medians over the runs with their "
              "range, met = in every run)\n",
              omp_get_max_threads(), kvbench::isa(), kvbench::load_average().c_str(), repeats);
  kvbench::report_times(dts, ts);
  kvbench::report_compact(dts, ts);
  kvbench::report_score(dts, ts);
  kvbench::report_alloc();
  kvbench::report_merge(ts);
  kvbench::report_expected();
  kvbench::report_quant(ts);
  kvbench::report_prefill_attention();
  kvbench::report_targets();
  std::fflush(stdout);
  benchmark::Shutdown();
  return 0;
}
