// Observed attention at prefill cost (issue 20, part 3): causal prefill attention of one layer
// (cpu::attention, n_q = T queries over T keys, what Session::attend runs during an engine's
// prefill) with and without the H2O column sums, side by side, and the column sums alone
// through kvpolicy::ops::window_attention (for engines that run their own prefill attention).
// Also one decode step (n_q = 1) against memcpy of the K/V bytes it reads.
// Shapes: the bundled model (SmolLM2-135M: Hq=9, Hkv=3, d=64) and the benchmark's default
// (Hq=32, Hkv=8, d=128), fp32 caches, T = 4096 and 8192.
#include <cstdio>
#include <cstring>

#include "common.hpp"
#include "kvpolicy/cpu/attention.hpp"
#include "kvpolicy/ops.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;

struct Shape {
  const char* name;
  std::int64_t hq, hkv, d;
};
constexpr Shape kModel{"model", 9, 3, 64};
constexpr Shape kDefault{"default", kHq, kHkv, kDim};
constexpr std::int64_t kPrefillT[2] = {4096, 8192};
constexpr double kAddedTarget = 0.20;  // added cost of the column sums, fraction of attention

// One layer's fp32 K, V (capacity T) and T queries per query head.
struct PrefillData {
  Shape s;
  std::int64_t t;
  std::vector<float> k, v, q, acc, obs, out;
  std::vector<std::int64_t> lengths;
  PrefillData(Shape sh, std::int64_t tokens, std::int64_t nq) : s(sh), t(tokens) {
    k.resize(static_cast<std::size_t>(s.hkv * t * s.d)), v.resize(k.size());
    q.resize(static_cast<std::size_t>(s.hq * nq * s.d));
    fill_uniform(k, 11, 1.0f), fill_uniform(v, 12, 1.0f), fill_uniform(q, 13, 2.0f);
    acc.assign(static_cast<std::size_t>(s.hkv * t), 0.0f), obs = acc;
    out.resize(static_cast<std::size_t>(s.hq * nq * s.d));
    lengths.assign(static_cast<std::size_t>(s.hkv), t);
  }
  KVView<const float> keys() const { return KVView<const float>::hnd(k.data(), 1, s.hkv, t, s.d); }
  KVView<const float> values() const {
    return KVView<const float>::hnd(v.data(), 1, s.hkv, t, s.d);
  }
  KVView<const float> queries() const {
    return KVView<const float>::hnd(q.data(), 1, s.hq, static_cast<std::int64_t>(q.size()) / (s.hq * s.d), s.d);
  }
  void attend(bool accumulate) {
    cpu::RaggedAttentionArgs args;
    args.lengths = lengths.data();
    args.causal = true;
    if (accumulate) {  // as Session::attend does for H2O / record_attention
      args.accumulate = acc.data(), args.observed = obs.data();
      args.state_stride = t, args.acc_scale = static_cast<float>(s.hkv) / static_cast<float>(s.hq);
    }
    cpu::attention(cpu_backend{}, keys(), values(), queries(), args, out.data());
    benchmark::DoNotOptimize(out.data());
  }
};

std::string key_of(const char* what, const Shape& s, std::int64_t t) {
  return std::string(what) + "/" + s.name + "/fp32/T:" + std::to_string(t);
}

// QK^T and PV of a causal prefill: 2 * 2 * Hq * d * T(T+1)/2.
double prefill_flops(const Shape& s, std::int64_t t) {
  return 2.0 * static_cast<double>(s.hq * s.d) * static_cast<double>(t) * static_cast<double>(t + 1);
}

// Subject: attention + column sums; reference: the same attention without them. ratio =
// median(t_plain / t_with), so the added cost is 1 / ratio - 1.
void bm_added(benchmark::State& state, Shape s, std::int64_t t, std::string key) {
  PrefillData data(s, t, t);
  time_pair(state, key, prefill_flops(s, t), [] {}, [&] { data.attend(true); },
            [&] { data.attend(false); });
}

// Subject: ops::window_attention over all T queries (column sums, GQA mean: H2O's scores
// computed by the library for an engine that ran its own prefill); reference: the prefill
// attention without column sums. ratio = median(t_attention / t_ops).
void bm_ops(benchmark::State& state, Shape s, std::int64_t t, std::string key) {
  PrefillData data(s, t, t);
  ScoreMap scores;
  time_pair(state, key, prefill_flops(s, t) / 2, [] {},
            [&] {
              ops::window_attention(cpu_backend{}, data.keys(), data.queries(), GqaReduce::mean,
                                    scores);
              benchmark::DoNotOptimize(scores.data());
            },
            [&] { data.attend(false); });
}

// One decode step at T: subject cpu::attention (n_q = 1), reference memcpy of the K and V bytes
// it reads, over cpu::parallel_for on the same threads. ratio = median(t_memcpy / t_attention).
void bm_decode(benchmark::State& state, Shape s, std::int64_t t, std::string key) {
  PrefillData data(s, t, 1);
  std::vector<float> dst(data.k.size() + data.v.size());
  const std::int64_t parts = 16;
  const auto per = static_cast<std::int64_t>(data.k.size()) / parts;
  time_pair(state, key, 2.0 * static_cast<double>(data.k.size()) * sizeof(float), [] {},
            [&] { data.attend(false); },
            [&] {
              cpu::parallel_for(cpu_backend{}, 2 * parts, [&](std::int64_t i) {
                const float* src = (i < parts ? data.k.data() : data.v.data()) + (i % parts) * per;
                std::memcpy(dst.data() + i * per, src, static_cast<std::size_t>(per) * sizeof(float));
              });
              benchmark::DoNotOptimize(dst.data());
            },
            flush_caches);
}

}  // namespace

void register_prefill_attention() {
  for (const Shape& s : {kModel, kDefault})
    for (std::int64_t t : kPrefillT) {
      // Seconds per call at the default shape: few iterations (each runs both sides).
      const int iters = s.hq == kModel.hq ? 7 : 3;
      const std::string a = key_of("prefill_colsum_added", s, t);
      benchmark::RegisterBenchmark(a.c_str(), &bm_added, s, t, a)
          ->UseManualTime()->Iterations(iters)->Unit(benchmark::kMillisecond);
      const std::string o = key_of("prefill_colsum_ops", s, t);
      benchmark::RegisterBenchmark(o.c_str(), &bm_ops, s, t, o)
          ->UseManualTime()->Iterations(iters)->Unit(benchmark::kMillisecond);
    }
  const std::string dk = key_of("decode_attention_vs_memcpy", kModel, 8192);
  benchmark::RegisterBenchmark(dk.c_str(), &bm_decode, kModel, 8192, dk)
      ->UseManualTime()->Iterations(60)->Unit(benchmark::kMillisecond);
}

void report_prefill_attention() {
  auto find = [](const std::string& k) { return median_result(k); };
  std::printf("\n### Observed attention (H2O column sums) at prefill cost, fp32 (target: added "
              "cost <= %.0f%%)\n\n", kAddedTarget * 100);
  std::printf("| shape | T | attention ms | GFLOP/s | + column sums ms | added cost | CPU-time "
              "added | target | met | ops column sums ms | ops / attention |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n");
  for (const Shape& s : {kModel, kDefault})
    for (std::int64_t t : kPrefillT) {
      const Result* a = find(key_of("prefill_colsum_added", s, t));
      if (!a) continue;
      const Result* o = find(key_of("prefill_colsum_ops", s, t));
      const double cpu_added = 1.0 / a->cpu_ratio - 1.0;
      const Judged j = judge_added_cost(
          std::string("column sums added to prefill attention, ") + s.name + " T=" + std::to_string(t),
          key_of("prefill_colsum_added", s, t), kAddedTarget);
      std::printf("| %s (Hq=%lld, Hkv=%lld, d=%lld) | %lld | %.1f | %.1f | %.1f | %s | "
                  "%+.1f%% | %.0f%% | %s |",
                  s.name, static_cast<long long>(s.hq), static_cast<long long>(s.hkv),
                  static_cast<long long>(s.d), static_cast<long long>(t), a->ref_s * 1e3,
                  a->work / a->ref_s * 1e-9, a->subject_s * 1e3, j.cell.c_str(), cpu_added * 100,
                  kAddedTarget * 100, j.met ? "yes" : "**no**");
      if (o)
        std::printf(" %.1f | %.2f |\n", o->subject_s * 1e3, 1.0 / o->ratio);
      else
        std::printf(" | |\n");
    }
  std::printf(
      "\nAttention = cpu::attention of one layer, causal prefill (n_q = T queries per head over "
      "T keys, fp32), what Session::attend runs; GFLOP/s counts QK^T and PV over the causal "
      "half (4 Hq d T(T+1)/2). + column sums = the same call accumulating H2O's statistics "
      "(accumulate and observed, as with an H2O policy or record_attention). Added cost = 1 / "
      "median over paired iterations of t_plain / t_with - 1, wall time (judged); CPU-time added "
      "= the same with process CPU time. ops column sums = kvpolicy::ops::window_attention over "
      "all T queries (GQA mean; H2O's scores for an engine that ran its own attention), paired "
      "with the plain attention: ops / attention = 1 / median of t_attention / t_ops.\n");
  const Result* d = find(key_of("decode_attention_vs_memcpy", kModel, 8192));
  if (!d) return;
  std::printf("\n### Decode attention, model shape (Hq=9, Hkv=3, d=64), fp32, T=8192\n\n"
              "| attention ms | GB/s | memcpy ms | memcpy GB/s | ratio | CPU-time ratio |\n"
              "|---:|---:|---:|---:|---:|---:|\n");
  std::printf("| %.3f | %.2f | %.3f | %.2f | %.2f | %.2f |\n", d->subject_s * 1e3,
              d->work / d->subject_s * 1e-9, d->ref_s * 1e3, d->work / d->ref_s * 1e-9, d->ratio,
              d->cpu_ratio);
  std::printf("\nOne decode step (n_q = 1 query per head) of cpu::attention over one layer's "
              "K and V (lengths = T), caches evicted before every timed call; reference = memcpy "
              "of the same bytes (K and V) over cpu::parallel_for on the same threads. Ratio = "
              "median over paired iterations of t_memcpy / t_attention.\n");
}

}  // namespace kvbench
