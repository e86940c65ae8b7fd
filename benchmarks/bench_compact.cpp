// Compaction bandwidth: cpu::compact of K and V with a random 20% selection per head, against
// std::memcpy of exactly the bytes it moves (kept rows x row bytes x 2) on the same threads.
// The spec'd comparison runs warm (whatever the caches keep between iterations); the _cold
// variant evicts the caches before every timed call, so both sides start from DRAM.
#include <cstdlib>

#include "common.hpp"
#include "kvpolicy/cpu/compact.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;

// memcpy's source and destination: page-aligned, then skewed by half a page, because glibc 2.36
// copies 2 KiB..L2-sized blocks with `rep movsb`, which on AMD Zen runs ~7x slower when the two
// addresses are equal modulo 4 KiB (measured here: 2.8 vs 19 GB/s) — the reference would then
// depend on where malloc put the buffers.
struct CopyBuffers {
  std::size_t bytes;
  unsigned char *src, *dst, *src_alloc, *dst_alloc;
  explicit CopyBuffers(std::size_t n)
      : bytes(n),
        src_alloc(static_cast<unsigned char*>(std::aligned_alloc(4096, n / 4096 * 4096 + 8192))),
        dst_alloc(static_cast<unsigned char*>(std::aligned_alloc(4096, n / 4096 * 4096 + 8192))) {
    src = src_alloc, dst = dst_alloc + 2048;
    for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 131), dst[i] = 0;
  }
  ~CopyBuffers() { std::free(src_alloc), std::free(dst_alloc); }
  CopyBuffers(const CopyBuffers&) = delete;
  CopyBuffers& operator=(const CopyBuffers&) = delete;
};

// Evicts the caches by reading 3x the L3 size.
void evict_caches() {
  static std::vector<std::uint64_t> junk(std::size_t{96} << 17, 1);  // 96 MiB
  std::uint64_t s = 0;
  for (std::size_t i = 0; i < junk.size(); i += 8) s += junk[i];
  benchmark::DoNotOptimize(s);
}

template <class T>
void bm_compact(benchmark::State& state, std::int64_t tokens, std::string key, bool cold) {
  auto& data = layer_data<T>(tokens);
  const cpu_backend be{};
  const Selection sel = random_selection(tokens, 42 + static_cast<std::uint64_t>(tokens));
  const std::int64_t keep = sel.count(0, 0);
  const std::size_t chunk = static_cast<std::size_t>(keep * kDim) * sizeof(T);  // one head
  const std::int64_t chunks = 2 * kHkv;                                         // K and V
  const double bytes = static_cast<double>(chunk) * static_cast<double>(chunks);
  CopyBuffers buf(chunk * static_cast<std::size_t>(chunks));

  time_pair(
      state, key, bytes, [&] { data.restore(keep); },
      [&] {
        cpu::compact(be, data.keys(), data.values(), sel);
        benchmark::ClobberMemory();
      },
      [&] {
        cpu::parallel_for(be, chunks, [&](std::int64_t i) {
          std::memcpy(buf.dst + i * chunk, buf.src + i * chunk, chunk);
        });
        benchmark::ClobberMemory();
      },
      [&] {
        if (cold) evict_caches();
      });
  data.restore(keep);
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
}

template <class T>
void register_dtype() {
  for (bool cold : {false, true})
    for (std::int64_t t : {kShortT, kLongT}) {
      const std::string key = std::string(cold ? "compact_vs_memcpy_cold/" : "compact_vs_memcpy/") +
                              dtype_label<T>() + "/T:" + std::to_string(t);
      const int iters = cold ? (t >= kLongT ? 15 : 40) : (t >= kLongT ? 30 : 200);
      benchmark::RegisterBenchmark(key.c_str(), &bm_compact<T>, t, key, cold)
          ->UseManualTime()
          ->Iterations(iters)
          ->Unit(benchmark::kMillisecond);
    }
}

}  // namespace

void register_compact() {
  register_dtype<kvpolicy::half>();
  register_dtype<float>();
}

}  // namespace kvbench
