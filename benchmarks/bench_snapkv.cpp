// SnapKV per layer: compression time (score + select + compact K and V at a 20% budget) and the
// scoring kernel's GFLOP/s against an Eigen GEMM of the same shape, side by side.
#include <omp.h>

#include "common.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/cpu/rows.hpp"
#include "kvpolicy/pipeline.hpp"
#include "kvpolicy/scorers/expected.hpp"
#include "kvpolicy/scorers/snapkv.hpp"

namespace kvbench {
namespace {

using namespace kvpolicy;
using SnapPipeline = Pipeline<SnapKV, Uniform>;

int iterations_for(std::int64_t tokens) { return tokens >= kLongT ? 6 : 20; }

template <class T>
Inputs<T> snapkv_inputs(LayerData<T>& data) {
  Inputs<T> in;
  in.keys = data.keys();
  in.values = data.values();
  in.queries = data.queries();
  return in;
}

// What a Session runs per layer: Pipeline::select, then cpu::compact of K and V.
template <class T>
void bm_compress(benchmark::State& state, std::int64_t tokens, std::string key) {
  auto& data = layer_data<T>(tokens);
  const SnapPipeline pipe(SnapKV::authors(), Uniform{});
  const cpu_backend be{};
  const Inputs<T> in = snapkv_inputs(data);
  const auto keep = std::llround(kKeepRatio * static_cast<double>(tokens));
  time_op(state, key, 0, [&] { data.restore(keep); },
          [&] {
            Selection sel = pipe.select(be, in, Budget::ratio(kKeepRatio));
            cpu::compact(be, data.keys(), data.values(), sel);
            benchmark::DoNotOptimize(sel.total());
          });
  data.restore(keep);
}

// The public Pipeline::compress, which also scans K, V and Q for NaN/Inf before writing.
template <class T>
void bm_compress_checked(benchmark::State& state, std::int64_t tokens, std::string key) {
  auto& data = layer_data<T>(tokens);
  const SnapPipeline pipe(SnapKV::authors(), Uniform{});
  const cpu_backend be{};
  const Inputs<T> in = snapkv_inputs(data);
  const auto keep = std::llround(kKeepRatio * static_cast<double>(tokens));
  time_op(state, key, 0, [&] { data.restore(keep); },
          [&] {
            Selection sel =
                pipe.compress(be, data.keys(), data.values(), in, Budget::ratio(kKeepRatio));
            benchmark::DoNotOptimize(sel.total());
          });
  data.restore(keep);
}

// Scoring (window attention of the last W queries + pooling) vs the GEMM at its core:
// per KV head (g*W x d) . (d x T) in fp32, over the same 8 heads on the same OpenMP threads.
template <class T>
void bm_score(benchmark::State& state, std::int64_t tokens, std::string key) {
  auto& data = layer_data<T>(tokens);
  const cpu_backend be{};
  const SnapKV snap = SnapKV::authors();
  Inputs<T> in;
  in.keys = KVView<const T>::hnd(data.k0.data(), 1, kHkv, tokens, kDim);
  in.queries = data.queries();
  ScoreMap scores;

  const std::int64_t rows = (kHq / kHkv) * kWindow;
  std::vector<float> kf(data.k0.size());
  for (std::size_t i = 0; i < kf.size(); ++i) kf[i] = static_cast<float>(data.k0[i]);
  std::vector<cpu::RowMatrix> a(static_cast<std::size_t>(kHkv));
  for (auto& m : a) m = cpu::RowMatrix::Random(rows, kDim);
  std::vector<cpu::RowMatrix> c(static_cast<std::size_t>(omp_get_max_threads()),
                                cpu::RowMatrix::Zero(rows, tokens));
  const double flops = 2.0 * kHq * kWindow * static_cast<double>(tokens) * kDim;

  time_pair(
      state, key, flops, [] {},
      [&] {
        Stats stats;  // fresh: Stats memoizes the window attention
        snap.score(be, in, stats, scores);
        benchmark::DoNotOptimize(scores.data());
      },
      [&] {
        cpu::parallel_for(be, kHkv, [&](std::int64_t h) {
          const cpu::RowMap K(kf.data() + h * tokens * kDim, tokens, kDim,
                              Eigen::OuterStride<>(kDim));
          auto& out = c[static_cast<std::size_t>(omp_get_thread_num())];
          out.noalias() = a[static_cast<std::size_t>(h)] * K.transpose();
        });
        benchmark::DoNotOptimize(c[0].data());
      });
}

// Expected attention's scoring (statistics of `nq` queries, then k.mu + k^T Sigma k per key and
// query head: O(T d^2) per query head) vs SnapKV's window scoring of the same layer, side by
// side. nq = kWindow (a decode-time window) or 1024 (the default window, a prefill's statistics).
template <class T>
void bm_expected(benchmark::State& state, std::int64_t tokens, std::int64_t nq, std::string key) {
  auto& data = layer_data<T>(tokens);
  const cpu_backend be{};
  const SnapKV snap = SnapKV::authors();
  ExpectedAttention exp;
  exp.theta = 500000, exp.window = nq;
  std::vector<T> q(static_cast<std::size_t>(kHq * nq * kDim));
  fill_uniform(q, 5, 1.0f);
  Inputs<T> in;
  in.keys = KVView<const T>::hnd(data.k0.data(), 1, kHkv, tokens, kDim);
  in.values = KVView<const T>::hnd(data.v0.data(), 1, kHkv, tokens, kDim);
  in.queries = KVView<const T>::hnd(q.data(), 1, kHq, nq, kDim);
  Inputs<T> win = in;
  win.queries = data.queries();
  ScoreMap a, b;
  time_pair(
      state, key, 0, [] {},
      [&] {
        Stats stats;
        exp.score(be, in, stats, a);
        benchmark::DoNotOptimize(a.data());
      },
      [&] {
        Stats stats;
        snap.score(be, win, stats, b);
        benchmark::DoNotOptimize(b.data());
      });
}

template <class T>
void register_dtype() {
  for (std::int64_t t : {kShortT, kLongT}) {
    const std::string suffix = std::string("/") + dtype_label<T>() + "/T:" + std::to_string(t);
    for (auto [name, fn] : {std::pair{"snapkv_compress", &bm_compress<T>},
                            std::pair{"snapkv_compress_checked", &bm_compress_checked<T>},
                            std::pair{"snapkv_score_vs_gemm", &bm_score<T>}}) {
      const std::string key = name + suffix;
      benchmark::RegisterBenchmark(key.c_str(), fn, t, key)
          ->UseManualTime()
          ->Iterations(iterations_for(t))
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

void register_snapkv() {
  register_dtype<kvpolicy::half>();
  register_dtype<float>();
  for (std::int64_t nq : {kWindow, std::int64_t{1024}}) {
    const std::string key = "expected_vs_snapkv_score/fp16/T:8192/nq:" + std::to_string(nq);
    benchmark::RegisterBenchmark(key.c_str(), bm_expected<kvpolicy::half>, 8192, nq, key)
        ->UseManualTime()
        ->Iterations(5)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace kvbench
