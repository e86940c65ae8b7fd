// CUDA baseline scorers and Ada-KV budgets per layer at T=32768, Hkv=8, d=128 (fp16 keys, HND):
// - KNorm / KeyDiff scoring, timed with CUDA events, against a device-to-device cudaMemcpy of
//   the key bytes in the same run (counter read_vs_memcpy = memcpy time / scoring time: both
//   read the keys once; KeyDiff reads them three times by design).
// - Ada-KV head budgets (alpha 0.2, 20% budget per head, 32 protected tokens) on the device,
//   then cuda::select with those device budgets (counters adakv_us, select_us).
// Registered statically (names contain "cuda"); without a GPU each benchmark skips with an error.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kvpolicy/cpu/stages.hpp"  // the CPU ops the stages declare (cpu/fwd.hpp)
#include "kvpolicy/cuda/baselines.hpp"
#include "kvpolicy/cuda/runtime.hpp"
#include "kvpolicy/cuda/select.hpp"

#include "cuda_bench_util.hpp"

namespace {

using namespace kvpolicy;

constexpr std::int64_t kT = 32768, kHkv = 8, kD = 128;
constexpr double kKeep = 0.2;

using kvbench::Events;
using kvbench::random_values;
using kvbench::skip_without_gpu;
using kvbench::upload;

template <class Scorer>
void key_scorer_layer(benchmark::State& state, const Scorer& scorer) {
  if (skip_without_gpu(state)) return;
  const std::size_t n = static_cast<std::size_t>(kHkv * kT * kD);
  cuda::DeviceBuffer k = upload(random_values<half>(n, 1, 1.f));
  Inputs<half> in;
  in.keys = KVView<const half>::hnd(k.as<const half>(), 1, kHkv, kT, kD);
  cuda::DeviceBuffer scores(static_cast<std::size_t>(kHkv * kT) * sizeof(float));
  const cuda::MutableScoreView out{scores.as<float>(), 1, kHkv, kT, kT};
  cuda::DeviceBuffer ws(std::max<std::size_t>(cuda::score_workspace_bytes(scorer, in), 256));
  const cuda_backend be{nullptr, ws.data(), ws.bytes()};
  cuda::DeviceBuffer copy(n * sizeof(half));
  cuda::score(be, scorer, in, out);  // warm-up
  cuda::synchronize();
  Events ev(4);
  double t_score = 0, t_copy = 0;
  for (auto _ : state) {
    cudaEventRecord(ev.e[0]);
    cuda::score(be, scorer, in, out);
    cudaEventRecord(ev.e[1]);
    cudaMemcpyAsync(copy.data(), k.data(), n * sizeof(half), cudaMemcpyDeviceToDevice, nullptr);
    cudaEventRecord(ev.e[2]);
    cudaEventSynchronize(ev.e[2]);
    const double s = ev.ms(0, 1), c = ev.ms(1, 2);
    t_score += s, t_copy += c;
    state.SetIterationTime(s * 1e-3);
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["score_us"] = 1e3 * t_score / it;
  state.counters["memcpy_us"] = 1e3 * t_copy / it;
  state.counters["read_vs_memcpy"] = t_score > 0 ? t_copy / t_score : 0;
}

void BM_cuda_knorm_layer(benchmark::State& state) { key_scorer_layer(state, KNorm{}); }
void BM_cuda_keydiff_layer(benchmark::State& state) { key_scorer_layer(state, KeyDiff{}); }

void BM_cuda_adakv_layer(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  cuda::DeviceBuffer scores = upload(random_values<float>(static_cast<std::size_t>(kHkv * kT), 4, 1.f));
  const cuda::ScoreView sv{scores.as<const float>(), 1, kHkv, kT, kT};
  const AdaKV ada{};
  const Protect protect{4, 28};
  const auto budget = std::llround(kKeep * static_cast<double>(kT));
  const std::vector<std::int64_t> budgets(static_cast<std::size_t>(kHkv), budget);
  cuda::DeviceBuffer ws(std::max({cuda::allocate_workspace_bytes(ada, sv, protect),
                                  cuda::select_workspace_bytes(sv), std::size_t{256}}));
  const cuda_backend be{nullptr, ws.data(), ws.bytes()};
  cuda::DeviceBuffer dbud(budgets.size() * sizeof(std::int64_t));
  const std::int64_t cap = kHkv * budget;  // Ada-KV conserves the layer's total
  cuda::DeviceBuffer offsets(static_cast<std::size_t>(kHkv + 1) * sizeof(std::int64_t));
  cuda::DeviceBuffer indices(static_cast<std::size_t>(cap) * sizeof(std::int32_t));
  cuda::CsrSelection sel{1, kHkv, offsets.as<std::int64_t>(), indices.as<std::int32_t>(), cap};
  cuda::allocate(be, ada, sv, budgets, protect, dbud.as<std::int64_t>());  // warm-up
  cuda::synchronize();
  Events ev(4);
  double t_alloc = 0, t_select = 0;
  for (auto _ : state) {
    cudaEventRecord(ev.e[0]);
    cuda::allocate(be, ada, sv, budgets, protect, dbud.as<std::int64_t>());
    cudaEventRecord(ev.e[1]);
    cuda::select(be, sv, dbud.as<const std::int64_t>(), protect, sel);
    cudaEventRecord(ev.e[2]);
    cudaEventSynchronize(ev.e[2]);
    const double a = ev.ms(0, 1), s = ev.ms(1, 2);
    t_alloc += a, t_select += s;
    state.SetIterationTime((a + s) * 1e-3);
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["adakv_us"] = 1e3 * t_alloc / it;
  state.counters["select_us"] = 1e3 * t_select / it;
}

BENCHMARK(BM_cuda_knorm_layer)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_cuda_keydiff_layer)->UseManualTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_cuda_adakv_layer)->UseManualTime()->Unit(benchmark::kMicrosecond);

}  // namespace
