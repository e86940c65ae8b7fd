// One decode step on the device at T = 32768, Hq = 32, Hkv = 8, d = 128, n_q = 1: the split-KV
// decode attention over an fp16 dense cache (cuda/decode.cu) and over int2 packed caches
// (cuda/decode_packed.cu: group 32, rotation + token norm, residual 128), timed with CUDA events
// in the same run, alternating, with a device-to-device cudaMemcpy of the dense K + V bytes.
// Manual time: the packed step. Counters: dense_us, packed_us, speedup (dense / packed),
// dense_vs_memcpy (memcpy time / dense time: the dense kernel's fraction of copy bandwidth).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kvpolicy/cuda/decode.hpp"
#include "kvpolicy/cuda/decode_packed.hpp"

namespace {

using namespace kvpolicy;

void BM_cuda_decode_dense_fp16_vs_packed_int2(benchmark::State& state) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    state.SkipWithError("no GPU");
    return;
  }
  constexpr std::int64_t T = 32768, Hq = 32, Hkv = 8, d = 128;
  std::uint32_t seed = 12345;
  auto next = [&] { return seed = seed * 1664525u + 1013904223u, static_cast<float>(seed >> 8) * 0x1p-24f - 0.5f; };
  // Host data: fp32 for the packed caches, fp16 copies for the dense one.
  std::vector<float> k(static_cast<std::size_t>(Hkv * T * d)), v(k.size()), q(static_cast<std::size_t>(Hq * d));
  for (float& x : k) x = next();
  for (float& x : v) x = next();
  for (float& x : q) x = next();
  std::vector<half> kh(k.size()), vh(v.size()), qh(q.size());
  for (std::size_t i = 0; i < k.size(); ++i) kh[i] = half(k[i]), vh[i] = half(v[i]);
  for (std::size_t i = 0; i < q.size(); ++i) qh[i] = half(q[i]);
  quant::QuantConfig cfg;  // int2, group 32, residual 128, rotate, token_norm
  std::vector<quant::PackedCache> heads;
  for (std::int64_t h = 0; h < Hkv; ++h) {
    heads.emplace_back(cfg, d);
    heads.back().append(k.data() + h * T * d, v.data() + h * T * d, T);
  }
  const cuda::PackedImage im = cuda::flatten(heads);
  const std::vector<std::int64_t> lengths(Hkv, T);

  std::vector<void*> bufs;
  auto dev = [&](const void* src, std::size_t bytes) -> void* {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) return nullptr;
    bufs.push_back(p);
    if (bytes) cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice);
    return p;
  };
  const std::size_t kv_bytes = kh.size() * sizeof(half);
  void* dk = dev(kh.data(), kv_bytes);
  void* dv = dev(vh.data(), kv_bytes);
  void* dq = dev(qh.data(), qh.size() * sizeof(half));
  void* dlen = dev(lengths.data(), lengths.size() * sizeof(std::int64_t));
  void* dcopy = dev(nullptr, 2 * kv_bytes);
  void* dout = dev(nullptr, q.size() * sizeof(float));
  void* pk = dev(im.key_tiles.data(), im.key_tiles.size());
  void* pv = dev(im.value_tiles.data(), im.value_tiles.size());
  void* pto = dev(im.tile_offset.data(), im.tile_offset.size() * sizeof(std::int64_t));
  void* prk = dev(im.res_keys.data(), im.res_keys.size() * sizeof(float));
  void* prv = dev(im.res_values.data(), im.res_values.size() * sizeof(float));
  void* prn = dev(im.res_norms.data(), im.res_norms.size() * sizeof(float));
  void* pro = dev(im.res_offset.data(), im.res_offset.size() * sizeof(std::int64_t));
  auto release = [&] {
    for (void* p : bufs) cudaFree(p);
  };
  if (!dk || !dv || !dq || !dlen || !dcopy || !dout || !pk || !pv || !pto || !prk || !prv ||
      !prn || !pro) {
    state.SkipWithError("cudaMalloc failed");
    release();
    return;
  }
  const auto keys = KVView<const half>::hnd(static_cast<const half*>(dk), 1, Hkv, T, d);
  const auto values = KVView<const half>::hnd(static_cast<const half*>(dv), 1, Hkv, T, d);
  const auto queries = KVView<const half>::hnd(static_cast<const half*>(dq), 1, Hq, 1, d);
  cuda::DecodeArgs da;
  da.lengths = static_cast<const std::int64_t*>(dlen);
  const cuda::PackedHeadsView pview = im.view(pk, pv, pto, prk, prv, prn, pro);
  const cuda::TensorView qview = cuda::decode_view(queries);
  const cuda::PackedDecodeArgs pa;
  std::size_t wd = cuda::attention_workspace_bytes(keys, values, queries, da), wp = 0;
  cuda::throw_if_error(cuda::packed_decode_workspace_bytes(pview, qview, pa, wp), "workspace");
  void* ws = dev(nullptr, wd > wp ? wd : wp);
  if (!ws) {
    state.SkipWithError("cudaMalloc failed");
    release();
    return;
  }
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const cuda_backend be{stream, ws, wd > wp ? wd : wp};
  cudaEvent_t e[4];
  for (auto& x : e) cudaEventCreate(&x);
  float* out = static_cast<float*>(dout);
  cuda::attention(be, keys, values, queries, da, out);  // warm up
  cuda::throw_if_error(cuda::packed_decode_attention(be, pview, qview, pa, out), "packed");
  double dense_s = 0, packed_s = 0, copy_s = 0;
  for (auto _ : state) {
    cudaEventRecord(e[0], stream);
    const cuda::Status s1 = cuda::decode_attention(be, cuda::decode_view(keys),
                                                   cuda::decode_view(values), qview, da, out);
    cudaEventRecord(e[1], stream);
    const cuda::Status s2 = cuda::packed_decode_attention(be, pview, qview, pa, out);
    cudaEventRecord(e[2], stream);
    cudaMemcpyAsync(dcopy, dk, kv_bytes, cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(static_cast<char*>(dcopy) + kv_bytes, dv, kv_bytes, cudaMemcpyDeviceToDevice, stream);
    cudaEventRecord(e[3], stream);
    cudaEventSynchronize(e[3]);
    if (!s1.ok() || !s2.ok()) {
      state.SkipWithError(!s1.ok() ? s1.message : s2.message);
      break;
    }
    float a = 0, b = 0, c = 0;
    cudaEventElapsedTime(&a, e[0], e[1]);
    cudaEventElapsedTime(&b, e[1], e[2]);
    cudaEventElapsedTime(&c, e[2], e[3]);
    state.SetIterationTime(b * 1e-3);
    dense_s += a * 1e-3, packed_s += b * 1e-3, copy_s += c * 1e-3;
  }
  if (packed_s > 0 && dense_s > 0) {
    const double it = static_cast<double>(state.iterations());
    state.counters["dense_us"] = dense_s / it * 1e6;
    state.counters["packed_us"] = packed_s / it * 1e6;
    state.counters["speedup"] = dense_s / packed_s;
    state.counters["dense_vs_memcpy"] = copy_s / dense_s;
  }
  for (auto& x : e) cudaEventDestroy(x);
  cudaStreamDestroy(stream);
  release();
}

}  // namespace

BENCHMARK(BM_cuda_decode_dense_fp16_vs_packed_int2)->UseManualTime()->Unit(benchmark::kMicrosecond);
