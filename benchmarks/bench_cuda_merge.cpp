// CUDA semantic merge per layer (cuda/merge.cu) at the shape: T = 32768, Hkv = 8,
// d = 128, fp16, a SnapKV 20% selection with its scores (computed once on the CPU, untimed, as in
// bench_merge.cpp), tau 0.5 and 0, fixed 32-token chunks. Each iteration restores the pristine
// K/V and a zero log_count on the device (untimed), then times the merge with CUDA events.
// Without a GPU the benchmarks SkipWithError("no GPU").
#include <cuda_runtime.h>

#include <cmath>
#include <string>

#include "common.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/cuda/merge.hpp"
#include "kvpolicy/cuda/runtime.hpp"
#include "kvpolicy/mergers/semantic.hpp"
#include "kvpolicy/pipeline.hpp"
#include "kvpolicy/scorers/snapkv.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;

template <class T>
void bm_cuda_merge(benchmark::State& state, std::int64_t tokens, float tau) {
  if (cuda::device_count() == 0) {
    state.SkipWithError("no GPU");
    return;
  }
  auto& data = layer_data<T>(tokens);
  const cpu_backend cpu{};
  const SnapKV snap = SnapKV::authors();
  Inputs<T> in;
  in.keys = KVView<const T>::hnd(data.k0.data(), 1, kHkv, tokens, kDim);
  in.values = KVView<const T>::hnd(data.v0.data(), 1, kHkv, tokens, kDim);
  in.queries = data.queries();
  ScoreMap scores;
  const Selection sel =
      Pipeline<SnapKV, Uniform>(snap, Uniform{}).select(cpu, in, Budget::ratio(kKeepRatio), &scores);
  const cuda::HostCsr csr = cuda::to_csr(sel);

  const std::size_t kv_bytes = data.k0.size() * sizeof(T);
  const std::size_t lc_bytes = static_cast<std::size_t>(kHkv * tokens) * sizeof(float);
  cuda::DeviceBuffer k0(kv_bytes), v0(kv_bytes), k(kv_bytes), v(kv_bytes), lc(lc_bytes),
      sc(lc_bytes), off(csr.offsets.size() * sizeof(std::int64_t)),
      idx(csr.indices.size() * sizeof(std::int32_t));
  cuda::copy_to_device(k0.data(), data.k0.data(), kv_bytes);
  cuda::copy_to_device(v0.data(), data.v0.data(), kv_bytes);
  cuda::copy_to_device(sc.data(), scores.data(), lc_bytes);
  cuda::copy_to_device(off.data(), csr.offsets.data(), off.bytes());
  cuda::copy_to_device(idx.data(), csr.indices.data(), idx.bytes());

  cuda::DeviceMergeArgs<T> a;
  a.keys = KVView<T>::hnd(k.as<T>(), 1, kHkv, tokens, kDim);
  a.values = KVView<T>::hnd(v.as<T>(), 1, kHkv, tokens, kDim);
  a.selection = {1, kHkv, off.as<std::int64_t>(), idx.as<std::int32_t>(),
                 static_cast<std::int64_t>(csr.indices.size())};
  a.scores = {sc.as<float>(), 1, kHkv, tokens, tokens};
  a.log_count = lc.as<float>();
  a.protect = snap.protect(tokens, sel.count(0, 0));
  Semantic s;  // chunk 32, importance weights, no mask, as bench_merge.cpp
  s.tau = tau;
  cuda::DeviceBuffer ws(std::max<std::size_t>(1, cuda::semantic_merge_workspace_bytes(a.keys)));
  const cuda_backend be{nullptr, ws.data(), ws.bytes()};

  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (auto _ : state) {
    cudaMemcpyAsync(k.data(), k0.data(), kv_bytes, cudaMemcpyDeviceToDevice);
    cudaMemcpyAsync(v.data(), v0.data(), kv_bytes, cudaMemcpyDeviceToDevice);
    cudaMemsetAsync(lc.data(), 0, lc_bytes);
    cudaEventRecord(start);
    cuda::merge(be, s, a);
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(static_cast<double>(ms) * 1e-3);
  }
  std::vector<float> out(static_cast<std::size_t>(kHkv * tokens));
  cuda::copy_to_host(out.data(), lc.data(), lc_bytes);
  double absorbed = 0;
  for (float x : out) absorbed += std::nearbyint(std::exp(static_cast<double>(x))) - 1.0;
  state.counters["absorbed"] = absorbed;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

const bool registered = [] {
  for (float tau : {0.5f, 0.f}) {
    const std::string key = std::string("cuda_merge/semantic:tau=") + (tau == 0.f ? "0" : "0.5") +
                            "/f16/T:" + std::to_string(kLongT);
    benchmark::RegisterBenchmark(key.c_str(), [tau](benchmark::State& st) {
      bm_cuda_merge<kvpolicy::half>(st, kLongT, tau);
    })
        ->UseManualTime()
        ->Iterations(5)
        ->Unit(benchmark::kMillisecond);
  }
  return true;
}();

}  // namespace
}  // namespace kvbench
