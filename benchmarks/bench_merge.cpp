// Merge cost per layer: a merger (semantic, nearest) folding the evicted tokens of one SnapKV
// event into the kept ones, against SnapKV's scoring of the same layer, timed side by side. The
// event (a 20% selection, its scores and protected tokens) is computed once from the pristine
// cache, untimed; every timed merge starts from the pristine K/V and a zero log_count, as the
// first compression of a prefill does. Reported as the fraction t_merge / t_score.
#include <cmath>

#include "common.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/mergers/nearest.hpp"
#include "kvpolicy/mergers/semantic.hpp"
#include "kvpolicy/pipeline.hpp"
#include "kvpolicy/scorers/snapkv.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;

// Odd, so that the fraction the report derives (1 / median of t_score / t_merge) is exactly the
// median of t_merge / t_score. Nearest's similarity GEMM (evicted x kept x d per head, ~350
// GFLOP at T=32768) takes seconds, hence fewer iterations there.
int iterations_for(std::int64_t tokens, bool nearest) {
  if (tokens < kLongT) return 11;
  return nearest ? 3 : 5;
}

// Tokens folded into kept rows over the layer: sum over rows of (count - 1), from log_count.
double absorbed_tokens(const std::vector<float>& log_count) {
  double n = 0;
  for (float lc : log_count) n += std::nearbyint(std::exp(static_cast<double>(lc))) - 1.0;
  return n;
}

template <class T, class M>
void bm_merge(benchmark::State& state, std::int64_t tokens, std::string key, M merger) {
  auto& data = layer_data<T>(tokens);
  data.restore(tokens);
  const cpu_backend be{};
  const SnapKV snap = SnapKV::authors();
  // Scoring and selection read the pristine copies; the merger writes into data.k / data.v.
  Inputs<T> in;
  in.keys = KVView<const T>::hnd(data.k0.data(), 1, kHkv, tokens, kDim);
  in.values = KVView<const T>::hnd(data.v0.data(), 1, kHkv, tokens, kDim);
  in.queries = data.queries();
  ScoreMap scores, ref_scores;
  const Selection sel =
      Pipeline<SnapKV, Uniform>(snap, Uniform{}).select(be, in, Budget::ratio(kKeepRatio), &scores);
  std::vector<float> log_count(static_cast<std::size_t>(kHkv * tokens), 0.0f);
  MergeArgs<T> args;
  args.keys = data.keys();
  args.values = data.values();
  args.selection = &sel;
  args.scores = &scores;
  args.log_count = log_count.data();
  args.protect = snap.protect(tokens, sel.count(0, 0));

  double absorbed = 0;
  time_pair(
      state, key, 0,
      [&] {  // untimed, right before each merge: what the previous merge did, then a fresh count
        absorbed = absorbed_tokens(log_count);
        std::fill(log_count.begin(), log_count.end(), 0.0f);
      },
      [&] {
        merger.merge(be, args);
        benchmark::ClobberMemory();
      },
      [&] {
        Stats stats;  // fresh: Stats memoizes the window attention
        snap.score(be, in, stats, ref_scores);
        benchmark::DoNotOptimize(ref_scores.data());
      },
      [&] { data.restore(tokens); });  // untimed, before either side: undo the last merge
  absorbed = absorbed_tokens(log_count);  // the last merge's
  results()[key].aux = absorbed;
  state.counters["absorbed"] = absorbed;
  data.restore(tokens);
}

Semantic semantic_with(float tau) {
  Semantic s;  // chunk 32, importance weights, no delimiter mask: fixed 32-token chunks
  s.tau = tau;
  return s;
}

template <class T>
void register_dtype() {
  for (std::int64_t t : {kShortT, kLongT}) {
    const std::string suffix = std::string("/") + dtype_label<T>() + "/T:" + std::to_string(t);
    const auto reg = [&](const std::string& merger, auto fn, bool nearest) {
      const std::string key = "merge_vs_snapkv_score/" + merger + suffix;
      benchmark::RegisterBenchmark(key.c_str(), fn, t, key)
          ->UseManualTime()
          ->Iterations(iterations_for(t, nearest))
          ->Unit(benchmark::kMillisecond);
    };
    for (const char* tau : {"0.9", "0.5", "0"})
      reg(std::string("semantic:tau=") + tau,
          [tau](benchmark::State& st, std::int64_t tk, std::string k) {
            bm_merge<T>(st, tk, k, semantic_with(std::stof(tau)));
          },
          false);
    reg("nearest",
        [](benchmark::State& st, std::int64_t tk, std::string k) {
          bm_merge<T>(st, tk, k, Nearest{});
        },
        true);
  }
}

}  // namespace

void register_merge() { register_dtype<kvpolicy::half>(); }

}  // namespace kvbench
