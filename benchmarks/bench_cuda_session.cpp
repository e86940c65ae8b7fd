// The device Session's decode loop (kvpolicy/cuda/session.hpp) at an 8K prompt, fp16, a
// Llama-3-8B layer shape (Hq = 32, Hkv = 8, d = 128), 4 layers: the wall time of one decode step
// (append + attend + compress_if_due on every layer, then a stream synchronisation) for the full
// cache, snapkv at 20% (compressed once after the prefill) and h2o at 20% (compressed back to
// its budget at every step: one selection and compaction per layer per token), in the same run.
// Manual time: snapkv's step. Counters: full_us, snapkv_us, h2o_us, snapkv_speedup (full /
// snapkv), h2o_speedup (full / h2o). Host work and synchronisations are inside the step times,
// as an engine would see them. For scale, attn_full_us / attn_20_us: one layer's decode
// attention alone (cuda::attention, CUDA events, mean of 100 back-to-back launches) over the
// full 8K cache and over 20% of it: the kernel time a step spends per layer.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kvpolicy/cpu/stages.hpp"  // the CPU ops the stages declare (cpu/fwd.hpp)
#include "kvpolicy/cuda/session.hpp"

#include "cuda_bench_util.hpp"

namespace {

using namespace kvpolicy;

constexpr std::int64_t kLayers = 4, kHq = 32, kHkv = 8, kD = 128, kPrompt = 8192, kSteps = 32;

// Mean seconds per decode step of a session running `spec` at `budget`.
double decode_step_seconds(const std::string& spec, Budget budget, cudaStream_t stream) {
  SessionConfig cfg;
  cfg.layers = kLayers;
  cfg.kv_heads = kHkv;
  cfg.q_heads = kHq;
  cfg.head_dim = kD;
  cfg.budget = budget;
  cfg.initial_capacity = kPrompt + kSteps + 1;
  cuda::Session<half> s(Policy(spec), cfg, stream);
  const auto kv = kvbench::random_values<half>(static_cast<std::size_t>(kHkv * kPrompt * kD), 1, 1.f);
  const auto qs = kvbench::random_values<half>(static_cast<std::size_t>(kHq * kPrompt * kD), 2, 1.f);
  const cuda::DeviceBuffer dk = kvbench::upload(kv), dq = kvbench::upload(qs),
                           out(static_cast<std::size_t>(kHq * kPrompt * kD) * sizeof(float));
  auto view = [](const cuda::DeviceBuffer& b, std::int64_t heads, std::int64_t n) {
    return KVView<const half>::hnd(b.as<const half>(), 1, heads, n, kD);
  };
  const bool tracks = s.policy().decode_time();
  for (std::int64_t l = 0; l < kLayers; ++l) {  // prefill (H2O needs its attention statistics)
    s.append(l, view(dk, kHkv, kPrompt), view(dk, kHkv, kPrompt), view(dq, kHq, kPrompt));
    if (tracks) s.attend(l, view(dq, kHq, kPrompt), out.as<float>());
    s.compress_if_due(l);
  }
  cuda::synchronize(stream);
  const auto t0 = std::chrono::steady_clock::now();
  for (std::int64_t step = 0; step < kSteps; ++step) {
    for (std::int64_t l = 0; l < kLayers; ++l) {
      s.append(l, view(dk, kHkv, 1), view(dk, kHkv, 1), view(dq, kHq, 1));
      s.attend(l, view(dq, kHq, 1), out.as<float>());
      s.compress_if_due(l);
    }
    cuda::synchronize(stream);
  }
  const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
  return dt.count() / kSteps;
}

// Mean microseconds of one layer's decode attention over `tokens` keys of the fp16 cache.
double attention_us(std::int64_t tokens, cudaStream_t stream) {
  const auto kv = kvbench::random_values<half>(static_cast<std::size_t>(kHkv * tokens * kD), 3, 1.f);
  const auto q = kvbench::random_values<half>(static_cast<std::size_t>(kHq * kD), 4, 1.f);
  const std::vector<std::int64_t> lengths(kHkv, tokens);
  const cuda::DeviceBuffer dk = kvbench::upload(kv), dq = kvbench::upload(q),
                           dl = kvbench::upload(lengths), out(static_cast<std::size_t>(kHq * kD) * 4);
  const auto keys = KVView<const half>::hnd(dk.as<const half>(), 1, kHkv, tokens, kD);
  const auto queries = KVView<const half>::hnd(dq.as<const half>(), 1, kHq, 1, kD);
  cuda::DecodeArgs a;
  a.lengths = dl.as<const std::int64_t>();
  const cuda::DeviceBuffer ws(std::max<std::size_t>(cuda::attention_workspace_bytes(keys, keys, queries, a), 256));
  const cuda_backend be{stream, ws.data(), ws.bytes()};
  cuda::attention(be, keys, keys, queries, a, out.as<float>());  // warm up
  kvbench::Events ev(2);
  constexpr int kReps = 100;
  cudaEventRecord(ev.e[0], stream);
  for (int i = 0; i < kReps; ++i) cuda::attention(be, keys, keys, queries, a, out.as<float>());
  cudaEventRecord(ev.e[1], stream);
  cudaEventSynchronize(ev.e[1]);
  return ev.ms(0, 1) * 1e3 / kReps;
}

void BM_cuda_session_decode_8k(benchmark::State& state) {
  if (kvbench::skip_without_gpu(state)) return;
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  double full = 0, snap = 0, h2o = 0;
  for (auto _ : state) {
    full = decode_step_seconds("knorm", Budget::ratio(1.0), stream);
    snap = decode_step_seconds("snapkv", Budget::ratio(0.2), stream);
    h2o = decode_step_seconds("h2o", Budget::ratio(0.2), stream);
    state.SetIterationTime(snap);
  }
  state.counters["full_us"] = full * 1e6;
  state.counters["snapkv_us"] = snap * 1e6;
  state.counters["h2o_us"] = h2o * 1e6;
  state.counters["snapkv_speedup"] = full / snap;
  state.counters["h2o_speedup"] = full / h2o;
  state.counters["attn_full_us"] = attention_us(kPrompt, stream);
  state.counters["attn_20_us"] = attention_us(kPrompt / 5, stream);
  cudaStreamDestroy(stream);
}

}  // namespace

BENCHMARK(BM_cuda_session_decode_8k)->UseManualTime()->Iterations(1)->Unit(benchmark::kMicrosecond);
