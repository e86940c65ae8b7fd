// H2O per layer: decode-time compression from the accumulated-attention state (select + compact
// K, V and the accumulator; no attention is recomputed), and the prefill accumulation that builds
// that state (column sums of full causal attention, n_q = T).
#include "common.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/cpu/compact.hpp"
#include "kvpolicy/cpu/window_attention.hpp"
#include "kvpolicy/pipeline.hpp"
#include "kvpolicy/scorers/h2o.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;

template <class T>
void bm_compress(benchmark::State& state, std::int64_t tokens, std::string key) {
  auto& data = layer_data<T>(tokens);
  const Pipeline<H2O, Uniform> pipe(H2O{}, Uniform{});
  const cpu_backend be{};
  Inputs<T> in;
  in.keys = data.keys();
  in.values = data.values();
  in.accumulated = data.acc.data();
  const auto keep = std::llround(kKeepRatio * static_cast<double>(tokens));
  time_op(state, key, 0, [&] { data.restore(keep); },
          [&] {
            Selection sel = pipe.select(be, in, Budget::ratio(kKeepRatio));
            cpu::compact(be, data.keys(), data.values(), sel);
            cpu::compact_state(be, data.acc.data(), 0, tokens, sel);
            benchmark::DoNotOptimize(sel.total());
          });
  data.restore(keep);
}

// Prefill: every query attends causally, so only T(T+1)/2 of the T x T logits are needed.
template <class T>
void bm_prefill(benchmark::State& state, std::int64_t tokens, std::string key) {
  auto& data = layer_data<T>(tokens);
  std::vector<T> q(static_cast<std::size_t>(kHq * tokens * kDim));
  fill_uniform(q, 5, 2.0f);
  const auto queries = KVView<const T>::hnd(q.data(), 1, kHq, tokens, kDim);
  const auto keys = KVView<const T>::hnd(data.k0.data(), 1, kHkv, tokens, kDim);
  const cpu_backend be{};
  ScoreMap out;
  const double flops = 2.0 * kHq * kDim * 0.5 * static_cast<double>(tokens) * (tokens + 1);
  time_op(state, key, flops, [] {},
          [&] {
            cpu::window_attention(be, keys, queries, GqaReduce::mean, out);
            benchmark::DoNotOptimize(out.data());
          },
          /*warm_up=*/false);  // seconds per call: a warm-up would only cost run time
}

template <class T>
void register_dtype() {
  const std::string dt = dtype_label<T>();
  for (std::int64_t t : {kShortT, kLongT}) {
    const std::string key = "h2o_compress/" + dt + "/T:" + std::to_string(t);
    benchmark::RegisterBenchmark(key.c_str(), &bm_compress<T>, t, key)
        ->UseManualTime()
        ->Iterations(t >= kLongT ? 10 : 30)
        ->Unit(benchmark::kMillisecond);
  }
  // O(T^2 d Hq): about 1 s per layer at T=4096 on 2 cores, ~64x that at T=32768, so only 4096.
  const std::string key = "h2o_prefill_accumulate/" + dt + "/T:" + std::to_string(kShortT);
  benchmark::RegisterBenchmark(key.c_str(), &bm_prefill<T>, kShortT, key)
      ->UseManualTime()
      ->Iterations(2)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

void register_h2o() {
  register_dtype<kvpolicy::half>();
  register_dtype<float>();
}

}  // namespace kvbench
