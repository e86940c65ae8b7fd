// Allocator overhead per layer: the whole compression of one layer (Pipeline::select with an
// allocator chain + compaction of K and V) against the same scorer with the uniform split, timed
// side by side. The layer is layer 15 of a 32-layer model (EventInfo), so layer-level allocators
// run their per-model schedule; pyramid's and depthkv's budget for that layer is within a few
// tokens of the uniform one, so compaction moves about the same bytes on both sides.
// Overhead = (t_chain - t_uniform) / t_chain, from the paired median ratio.
#include <array>

#include "common.hpp"
#include "kvpolicy/allocators/adakv.hpp"
#include "kvpolicy/allocators/ams.hpp"
#include "kvpolicy/allocators/depthkv.hpp"
#include "kvpolicy/allocators/pyramid.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/cpu/compact.hpp"
#include "kvpolicy/pipeline.hpp"
#include "kvpolicy/scorers/h2o.hpp"
#include "kvpolicy/scorers/snapkv.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;

constexpr std::int64_t kModelLayers = 32, kLayer = 15;

// A 32-layer profile with layer 15 at the mean, so that its budget equals the uniform one.
DepthKV bench_profile() {
  std::array<double, kModelLayers> s{};
  for (std::int64_t l = 0; l < kModelLayers; ++l) s[static_cast<std::size_t>(l)] = (l % 2) ? 1.5 : 0.5;
  s[kLayer] = 1.0, s[kLayer + 1] = 1.0;  // keep the sum at 32 (mean 1)
  return DepthKV::from_values(s, "benchmark profile");
}

template <class S>
S make_scorer() {
  if constexpr (std::is_same_v<S, SnapKV>) return SnapKV::authors();
  else return S{};
}

template <class S, class T>
Inputs<T> scorer_inputs(LayerData<T>& data) {
  Inputs<T> in;
  in.keys = data.keys();
  in.values = data.values();
  in.queries = data.queries();  // snapkv scores from them; ams reads them with any scorer
  if constexpr (std::is_same_v<S, H2O>) in.accumulated = data.acc.data();
  return in;
}

template <class S, class T, class... As>
void bm_overhead(benchmark::State& state, std::int64_t tokens, std::string key, As... allocators) {
  auto& data = layer_data<T>(tokens);
  const Pipeline<S, As...> chain(make_scorer<S>(), allocators...);
  const Pipeline<S, Uniform> uniform(make_scorer<S>(), Uniform{});
  const cpu_backend be{};
  const Inputs<T> in = scorer_inputs<S>(data);
  std::vector<float> credit(static_cast<std::size_t>(kHkv * tokens), 0.0f);  // AMS state
  EventInfo ev;
  ev.first_layer = kLayer;
  ev.model_layers = kModelLayers;
  ev.alloc_state = credit.data();
  EventInfo ev_uniform = ev;
  ev_uniform.alloc_state = nullptr;
  const auto compress = [&](const auto& pipe, const EventInfo& e) {
    Selection sel = pipe.select(be, in, Budget::ratio(kKeepRatio), e);
    cpu::compact(be, data.keys(), data.values(), sel);
    if constexpr (std::is_same_v<S, H2O>) cpu::compact_state(be, data.acc.data(), 0, tokens, sel);
    benchmark::DoNotOptimize(sel.total());
  };
  time_pair(
      state, key, 0, [] {}, [&] { compress(chain, ev); }, [&] { compress(uniform, ev_uniform); },
      [&] {  // untimed, before every timed call of either side: undo the last compaction
        data.restore(tokens);  // adakv's heads may keep more rows than the mean
        std::fill(credit.begin(), credit.end(), 0.0f);
      });
  data.restore(tokens);
}

template <class S, class T>
void register_scorer(const std::string& scorer) {
  const std::int64_t t = kLongT;
  const std::string suffix = std::string("/") + dtype_label<T>() + "/T:" + std::to_string(t);
  const auto reg = [&](const std::string& chain, auto fn) {
    const std::string key = "alloc_overhead/" + scorer + "|" + chain + suffix;
    benchmark::RegisterBenchmark(key.c_str(), fn, t, key)
        ->UseManualTime()
        ->Iterations(6)
        ->Unit(benchmark::kMillisecond);
  };
  reg("pyramid", [](benchmark::State& st, std::int64_t tk, std::string k) {
    bm_overhead<S, T>(st, tk, k, Pyramid{});
  });
  reg("depthkv", [](benchmark::State& st, std::int64_t tk, std::string k) {
    bm_overhead<S, T>(st, tk, k, bench_profile());
  });
  reg("adakv", [](benchmark::State& st, std::int64_t tk, std::string k) {
    bm_overhead<S, T>(st, tk, k, AdaKV{});
  });
  reg("ams", [](benchmark::State& st, std::int64_t tk, std::string k) {
    bm_overhead<S, T>(st, tk, k, AMS{});
  });
  reg("pyramid|adakv|ams", [](benchmark::State& st, std::int64_t tk, std::string k) {
    bm_overhead<S, T>(st, tk, k, Pyramid{}, AdaKV{}, AMS{});
  });
}

}  // namespace

void register_alloc() {
  register_scorer<SnapKV, kvpolicy::half>("snapkv");
  register_scorer<H2O, kvpolicy::half>("h2o");
}

}  // namespace kvbench
