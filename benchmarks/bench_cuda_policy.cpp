// A spec-string policy end to end on the device (cuda::compress: score, allocate, select,
// compact keys and values in place) against the same Policy::compress on the CPU, side by side in
// one run: 4 layers of a model with Hkv = 8, Hq = 32, d = 128, T = 8192 fp16 tokens, the last 64
// queries, 20% kept. Counters: gpu_us (CUDA events around the call; includes its one host
// synchronisation, the budgets' upload), cpu_us (the CPU path on this machine's threads) and
// cpu_vs_gpu. Each iteration restores the caches first (outside the timed region).
// Registered statically (names contain "cuda"); without a GPU each benchmark skips with an error.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kvpolicy/cuda/policy.hpp"
#include "kvpolicy/cuda/runtime.hpp"

#include "cuda_bench_util.hpp"

namespace {

using namespace kvpolicy;

constexpr std::int64_t kL = 4, kHkv = 8, kHq = 32, kT = 8192, kD = 128, kQ = 64;

using kvbench::Events;
using kvbench::random_values;
using kvbench::skip_without_gpu;
using kvbench::upload;

void policy_end_to_end(benchmark::State& state, const char* spec) {
  if (skip_without_gpu(state)) return;
  const Policy policy(spec);
  const Budget budget = Budget::ratio(0.2);
  const std::size_t n = static_cast<std::size_t>(kL * kHkv * kT * kD);
  const std::vector<half> k0 = random_values<half>(n, 1, 1.f), v0 = random_values<half>(n, 2, 1.f);
  const std::vector<half> q0 =
      random_values<half>(static_cast<std::size_t>(kL * kHq * kQ * kD), 3, 1.f);
  cuda::DeviceBuffer k = upload(k0), v = upload(v0), q = upload(q0);
  const auto view = [](void* p, std::int64_t heads, std::int64_t tokens) {
    return KVView<half>::hnd(static_cast<half*>(p), kL, heads, tokens, kD);
  };
  Inputs<half> in;
  in.keys = view(k.data(), kHkv, kT);
  in.values = view(v.data(), kHkv, kT);
  in.queries = view(q.data(), kHq, kQ);
  const cuda::PolicyPlan plan = cuda::plan(policy, in, budget);
  cuda::DeviceBuffer ws(plan.workspace_bytes), off(static_cast<std::size_t>(plan.rows + 1) * 8),
      idx(static_cast<std::size_t>(plan.kept_capacity) * 4);
  cuda::CsrSelection sel{kL, kHkv, off.as<std::int64_t>(), idx.as<std::int32_t>(),
                         plan.kept_capacity};
  const cuda_backend be{nullptr, ws.data(), ws.bytes()};
  // The CPU run's own copies.
  std::vector<half> hk = k0, hv = v0;
  Inputs<half> hin;
  hin.queries = KVView<const half>::hnd(q0.data(), kL, kHq, kQ, kD);
  Events ev(2);
  double t_gpu = 0, t_cpu = 0;
  for (auto _ : state) {
    state.PauseTiming();
    cuda::copy_to_device(k.data(), k0.data(), n * sizeof(half));
    cuda::copy_to_device(v.data(), v0.data(), n * sizeof(half));
    hk = k0, hv = v0;
    state.ResumeTiming();
    cudaEventRecord(ev.e[0]);
    cuda::compress(be, policy, view(k.data(), kHkv, kT), view(v.data(), kHkv, kT), in, budget,
                   sel);
    cudaEventRecord(ev.e[1]);
    cudaEventSynchronize(ev.e[1]);
    const double g = ev.ms(0, 1);
    const auto c0 = std::chrono::steady_clock::now();
    policy.compress(cpu_backend{}, KVView<half>::hnd(hk.data(), kL, kHkv, kT, kD),
                    KVView<half>::hnd(hv.data(), kL, kHkv, kT, kD), hin, budget);
    const double c = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - c0).count();
    t_gpu += g, t_cpu += c;
    state.SetIterationTime(g * 1e-3);
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["gpu_us"] = 1e3 * t_gpu / it;
  state.counters["cpu_us"] = 1e3 * t_cpu / it;
  state.counters["cpu_vs_gpu"] = t_gpu > 0 ? t_cpu / t_gpu : 0;
}

void BM_cuda_policy_snapkv_pyramid_adakv(benchmark::State& state) {
  policy_end_to_end(state, "snapkv | pyramid | adakv");
}
void BM_cuda_policy_knorm(benchmark::State& state) { policy_end_to_end(state, "knorm"); }

BENCHMARK(BM_cuda_policy_snapkv_pyramid_adakv)->UseManualTime()->Iterations(5)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_cuda_policy_knorm)->UseManualTime()->Iterations(5)->Unit(benchmark::kMicrosecond);

}  // namespace
