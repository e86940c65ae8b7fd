// One decode step on the device at T = 32768, Hq = 32, Hkv = 8, d = 128, n_q = 1: the split-KV
// decode attention over an fp16 dense cache (cuda/decode.cu) and over int2 packed caches
// (cuda/decode_packed.cu: group 32, rotation + token norm, residual 128), timed with CUDA events
// in the same run, alternating, with a device-to-device cudaMemcpy of the dense K + V bytes.
// Manual time: the packed step. Counters: dense_us, packed_us, speedup (dense / packed),
// dense_vs_memcpy (memcpy time / dense time: the dense kernel's fraction of copy bandwidth).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvpolicy/cpu/stages.hpp"  // the CPU ops the stages declare (cpu/fwd.hpp)
#include "kvpolicy/cuda/decode.hpp"
#include "kvpolicy/cuda/decode_packed.hpp"
#include "kvpolicy/cuda/runtime.hpp"

#include "cuda_bench_util.hpp"

namespace {

using namespace kvpolicy;

using kvbench::Events;
using kvbench::random_values;
using kvbench::skip_without_gpu;
using kvbench::upload;

void BM_cuda_decode_dense_fp16_vs_packed_int2(benchmark::State& state) {
  if (skip_without_gpu(state)) return;
  constexpr std::int64_t T = 32768, Hq = 32, Hkv = 8, d = 128;
  // Host data: fp32 for the packed caches, fp16 copies for the dense one.
  const std::size_t n = static_cast<std::size_t>(Hkv * T * d);
  const std::vector<float> k = random_values<float>(n, 1, 0.5f), v = random_values<float>(n, 2, 0.5f),
                           q = random_values<float>(static_cast<std::size_t>(Hq * d), 3, 0.5f);
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

  const std::size_t kv_bytes = kh.size() * sizeof(half);
  const cuda::DeviceBuffer dk = upload(kh), dv = upload(vh), dq = upload(qh),
                           dlen = upload(lengths), dcopy(2 * kv_bytes),
                           dout(q.size() * sizeof(float));
  const cuda::DeviceBuffer pk = upload(im.key_tiles), pv = upload(im.value_tiles),
                           pto = upload(im.tile_offset), prk = upload(im.res_keys),
                           prv = upload(im.res_values), prn = upload(im.res_norms),
                           pro = upload(im.res_offset);
  const auto keys = KVView<const half>::hnd(dk.as<const half>(), 1, Hkv, T, d);
  const auto values = KVView<const half>::hnd(dv.as<const half>(), 1, Hkv, T, d);
  const auto queries = KVView<const half>::hnd(dq.as<const half>(), 1, Hq, 1, d);
  cuda::DecodeArgs da;
  da.lengths = dlen.as<const std::int64_t>();
  const cuda::PackedHeadsView pview =
      im.view(pk.data(), pv.data(), pto.data(), prk.data(), prv.data(), prn.data(), pro.data());
  const TensorRef qview = erase(queries);
  const cuda::PackedDecodeArgs pa;
  std::size_t wd = cuda::attention_workspace_bytes(keys, values, queries, da), wp = 0;
  cuda::throw_if_error(cuda::packed_decode_workspace_bytes(pview, qview, pa, wp), "workspace");
  const cuda::DeviceBuffer ws(std::max<std::size_t>({wd, wp, 256}));
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const cuda_backend be{stream, ws.data(), ws.bytes()};
  Events ev(4);
  float* out = dout.as<float>();
  cuda::attention(be, keys, values, queries, da, out);  // warm up
  cuda::throw_if_error(cuda::packed_decode_attention(be, pview, qview, pa, out), "packed");
  double dense_s = 0, packed_s = 0, copy_s = 0;
  for (auto _ : state) {
    cudaEventRecord(ev.e[0], stream);
    const cuda::Status s1 = cuda::decode_attention(be, erase(keys),
                                                   erase(values), qview, da, out);
    cudaEventRecord(ev.e[1], stream);
    const cuda::Status s2 = cuda::packed_decode_attention(be, pview, qview, pa, out);
    cudaEventRecord(ev.e[2], stream);
    cudaMemcpyAsync(dcopy.data(), dk.data(), kv_bytes, cudaMemcpyDeviceToDevice, stream);
    cudaMemcpyAsync(static_cast<char*>(dcopy.data()) + kv_bytes, dv.data(), kv_bytes,
                    cudaMemcpyDeviceToDevice, stream);
    cudaEventRecord(ev.e[3], stream);
    cudaEventSynchronize(ev.e[3]);
    if (!s1.ok() || !s2.ok()) {
      state.SkipWithError(!s1.ok() ? s1.message : s2.message);
      break;
    }
    const double a = ev.ms(0, 1), b = ev.ms(1, 2), c = ev.ms(2, 3);
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
  cudaStreamDestroy(stream);
}

}  // namespace

BENCHMARK(BM_cuda_decode_dense_fp16_vs_packed_int2)->UseManualTime()->Unit(benchmark::kMicrosecond);
