// CUDA int2 encode (cuda/quant.cu) at T = 32768, Hkv = 8, d = 128, fp32 input, keys and values
// separately: bandwidth as a fraction of a device-to-device cudaMemcpy of the same input bytes,
// both timed with CUDA events in the same run, alternating (counter "vs_memcpy"; target >= 0.5).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kvpolicy/cuda/quant.hpp"

namespace {

using namespace kvpolicy;

void BM_cuda_quant_int2_encode(benchmark::State& state) {
  const bool keys = state.range(0) != 0;
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no GPU");
    return;
  }
  const std::int64_t rows = 8, tokens = 32768, d = 128;
  const cuda::QuantFormat f{2, 32, true, true};
  const std::size_t in_bytes = static_cast<std::size_t>(rows * tokens * d) * sizeof(float);
  const std::size_t out_bytes = static_cast<std::size_t>(rows) * cuda::quant_row_bytes(f, keys, tokens, d);
  void *src = nullptr, *dst = nullptr, *packed = nullptr;
  if (cudaMalloc(&src, in_bytes) != cudaSuccess || cudaMalloc(&dst, in_bytes) != cudaSuccess ||
      cudaMalloc(&packed, out_bytes) != cudaSuccess) {
    state.SkipWithError("cudaMalloc failed");
    cudaFree(src), cudaFree(dst), cudaFree(packed);
    return;
  }
  {  // deterministic, non-degenerate input
    std::vector<float> h(static_cast<std::size_t>(rows * tokens * d));
    std::uint32_t s = 12345;
    for (float& v : h) s = s * 1664525u + 1013904223u, v = static_cast<float>(s >> 8) * 0x1p-24f - 0.5f;
    cudaMemcpy(src, h.data(), in_bytes, cudaMemcpyHostToDevice);
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const cuda_backend be{stream, nullptr, 0};
  cudaEvent_t e0, e1, e2;
  cudaEventCreate(&e0), cudaEventCreate(&e1), cudaEventCreate(&e2);
  double enc_s = 0, copy_s = 0;
  cuda::encode(be, f, keys, src, cuda::QuantInput::f32, rows, tokens, d, packed);  // warm up
  for (auto _ : state) {
    cudaEventRecord(e0, stream);
    const cuda::Status st = cuda::quant_encode(be, f, keys, src, cuda::QuantInput::f32, rows, tokens, d, packed);
    cudaEventRecord(e1, stream);
    cudaMemcpyAsync(dst, src, in_bytes, cudaMemcpyDeviceToDevice, stream);
    cudaEventRecord(e2, stream);
    cudaEventSynchronize(e2);
    if (!st.ok()) {
      state.SkipWithError(st.message);
      break;
    }
    float a = 0, b = 0;
    cudaEventElapsedTime(&a, e0, e1);
    cudaEventElapsedTime(&b, e1, e2);
    state.SetIterationTime(a * 1e-3);
    enc_s += a * 1e-3, copy_s += b * 1e-3;
  }
  if (enc_s > 0) {
    state.counters["vs_memcpy"] = copy_s / enc_s;  // encode bandwidth / memcpy bandwidth
    state.counters["in_GBps"] = static_cast<double>(in_bytes) * static_cast<double>(state.iterations()) / enc_s * 1e-9;
  }
  cudaEventDestroy(e0), cudaEventDestroy(e1), cudaEventDestroy(e2);
  cudaStreamDestroy(stream);
  cudaFree(src), cudaFree(dst), cudaFree(packed);
}

}  // namespace

BENCHMARK(BM_cuda_quant_int2_encode)->ArgName("keys")->Arg(1)->Arg(0)->UseManualTime()->Unit(benchmark::kMicrosecond);
