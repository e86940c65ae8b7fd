// Quantized caches per layer (int2 = OScaR's rotation + token norm, kivi, int4; group 32,
// residual 128): encoding bandwidth against memcpy of the same input on the same threads, and
// one decode step's attention over the packed caches against fp32 attention over the same
// tokens, side by side. Input: the fp32 layer (K and V, 8 KV heads x T tokens x d = 128).
#include <cmath>
#include <cstdlib>
#include <span>

#include "common.hpp"
#include "kvpolicy/cpu/attention.hpp"
#include "kvpolicy/quant/attention.hpp"
#include "kvpolicy/quant/packed_cache.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;
using quant::PackedCache;
using quant::QuantConfig;

struct Format {
  const char* name;
  QuantConfig config;
};
constexpr Format kFormats[] = {{"int2", quant::Int2Tag::defaults},
                               {"kivi", quant::KiviTag::defaults},
                               {"int4", quant::Int4Tag::defaults}};

// A memcpy destination of n bytes whose address is half a page from `src` modulo 4 KiB. glibc's
// `rep movsb` copies run several times slower on AMD Zen when source and destination are equal
// modulo 4 KiB (see CopyBuffers in bench_compact.cpp), and malloc gives every large vector the
// same page offset, so a plain vector would make the reference depend on that accident.
class SkewedDestination {
 public:
  SkewedDestination(const void* src, std::size_t n)
      : alloc_(static_cast<unsigned char*>(std::aligned_alloc(4096, (n / 4096 + 2) * 4096))) {
    dst_ = alloc_ + (reinterpret_cast<std::uintptr_t>(src) + 2048) % 4096;
    std::memset(dst_, 0, n);
  }
  ~SkewedDestination() { std::free(alloc_); }
  SkewedDestination(const SkewedDestination&) = delete;
  SkewedDestination& operator=(const SkewedDestination&) = delete;
  unsigned char* data() const { return dst_; }

 private:
  unsigned char* alloc_;
  unsigned char* dst_;
};

// Encodes the layer's fp32 K/V into one PackedCache per KV head (appending into whatever the
// caches hold), one head per task on the backend's threads, as a Session fills them.
void encode_layer(const cpu_backend& be, const LayerData<float>& data,
                  std::vector<PackedCache>& caches) {
  const std::int64_t n = data.tokens * kDim;
  cpu::parallel_for(be, kHkv, [&](std::int64_t h) {
    caches[static_cast<std::size_t>(h)].append(data.k0.data() + h * n, data.v0.data() + h * n,
                                                data.tokens);
  });
}

double packed_bytes(const std::vector<PackedCache>& caches) {
  double b = 0;
  for (const auto& c : caches) b += static_cast<double>(c.memory_bytes());
  return b;
}

// Encode of all 8 KV heads (PackedCache::append of T tokens into emptied caches) vs memcpy of
// the same input (K and V fp32, 2 * 8 * T * d * 4 bytes) into skewed buffers, 16 chunks on the
// same threads. Both rates count the input bytes once.
void bm_encode(benchmark::State& state, std::int64_t tokens, std::string key, QuantConfig config) {
  auto& data = layer_data<float>(tokens);
  const cpu_backend be{};
  const std::int64_t n = tokens * kDim;
  const std::size_t head_bytes = static_cast<std::size_t>(n) * sizeof(float);
  const double bytes = 2.0 * kHkv * static_cast<double>(head_bytes);
  std::vector<PackedCache> caches(static_cast<std::size_t>(kHkv), PackedCache(config, kDim));
  SkewedDestination kcopy(data.k0.data(), kHkv * head_bytes);
  SkewedDestination vcopy(data.v0.data(), kHkv * head_bytes);

  time_pair(
      state, key, bytes,
      [&] {  // untimed: clear() keeps the buffers' capacity, so no allocation is timed
        for (auto& c : caches) c.clear();
      },
      [&] {
        encode_layer(be, data, caches);
        benchmark::ClobberMemory();
      },
      [&] {
        cpu::parallel_for(be, 2 * kHkv, [&](std::int64_t i) {
          const std::int64_t h = i % kHkv;
          const float* src = (i < kHkv ? data.k0 : data.v0).data() + h * n;
          unsigned char* dst =
              (i < kHkv ? kcopy : vcopy).data() + h * static_cast<std::int64_t>(head_bytes);
          std::memcpy(dst, src, head_bytes);
        });
        benchmark::ClobberMemory();
      });
  results()[key].aux = packed_bytes(caches);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

// One decode step (n_q = 1, Hq = 32 query heads, no bias) over T tokens per KV head:
// quant::packed_attention over the 8 packed caches vs cpu::attention over the fp32 K/V they were
// encoded from. `cold`: caches flushed before every timed call (the step finds a layer's cache
// after the model's other layers ran); warm: what the loop leaves in L3.
void bm_decode(benchmark::State& state, std::int64_t tokens, std::string key, QuantConfig config,
               bool cold) {
  auto& data = layer_data<float>(tokens);
  const cpu_backend be{};
  std::vector<PackedCache> caches(static_cast<std::size_t>(kHkv), PackedCache(config, kDim));
  encode_layer(be, data, caches);
  std::vector<float> q(static_cast<std::size_t>(kHq * kDim));
  fill_uniform(q, 5, 2.0f);
  const auto queries = KVView<const float>::hnd(q.data(), 1, kHq, 1, kDim);
  const auto keys = KVView<const float>::hnd(data.k0.data(), 1, kHkv, tokens, kDim);
  const auto values = KVView<const float>::hnd(data.v0.data(), 1, kHkv, tokens, kDim);
  const std::vector<std::int64_t> lengths(static_cast<std::size_t>(kHkv), tokens);
  cpu::RaggedAttentionArgs ref_args;
  ref_args.lengths = lengths.data();
  std::vector<float> out_q(q.size()), out_f(q.size());

  time_pair(
      state, key, packed_bytes(caches), [] {},
      [&] {
        quant::packed_attention(be, std::span<const PackedCache>(caches), queries, {},
                                out_q.data());
        benchmark::ClobberMemory();
      },
      [&] {
        cpu::attention(be, keys, values, queries, ref_args, out_f.data());
        benchmark::ClobberMemory();
      },
      [&] {
        if (cold) flush_caches();
      });
  // How far the packed output is from the fp32 one: ||out_q - out_f|| / ||out_f||.
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < q.size(); ++i) {
    const double e = static_cast<double>(out_q[i]) - static_cast<double>(out_f[i]);
    err += e * e, norm += static_cast<double>(out_f[i]) * static_cast<double>(out_f[i]);
  }
  results()[key].aux = std::sqrt(err / norm);
  state.counters["rel_err"] = results()[key].aux;
}

}  // namespace

void register_quant() {
  for (const Format& f : kFormats)
    for (std::int64_t t : {kShortT, kLongT}) {
      const std::string key =
          std::string("quant_encode_vs_memcpy/") + f.name + "/fp32/T:" + std::to_string(t);
      benchmark::RegisterBenchmark(key.c_str(), &bm_encode, t, key, f.config)
          ->UseManualTime()
          ->Iterations(t >= kLongT ? 5 : 15)
          ->Unit(benchmark::kMillisecond);
    }
  for (bool cold : {true, false})
    for (const Format& f : kFormats) {
      const std::string key = std::string(cold ? "quant_decode_attention_cold/"
                                               : "quant_decode_attention/") +
                              f.name + "/fp32/T:" + std::to_string(kLongT);
      benchmark::RegisterBenchmark(key.c_str(), &bm_decode, kLongT, key, f.config, cold)
          ->UseManualTime()
          ->Iterations(15)
          ->Unit(benchmark::kMillisecond);
    }
}

}  // namespace kvbench
