// Agreement of the CUDA baseline scorers and the device Ada-KV budgets (cuda/baselines.cu) with
// the CPU references: KNorm, KeyDiff, TOVA, Streaming scores and AdaKV::allocate budgets.
// CPU half: the kernels' per-element math (scorers/*_row.hpp, allocators/adakv_row.hpp and the
// warp helpers of kvpolicy/cuda/baseline_math.hpp, KVP_HD) driven by a
// host emulation of the grids (32-lane warps with the xor butterfly, KeyDiff's anchor chunks,
// Ada-KV's sorted rows + radix select + per-head counts), compared with the CPU scorers (NMSE,
// exact where the CPU result is exact) and with AdaKV::allocate (exact integers, many random
// cases with ties).
// CUDA half ([gpu]): the real kernels on the same cases; without a GPU it warns and returns.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <kvpolicy/cpu/stages.hpp>  // the CPU ops the stages declare (cpu/fwd.hpp)
#include <kvpolicy/allocators/adakv.hpp>
#include <kvpolicy/allocators/pyramid.hpp>
#include <kvpolicy/cpu/select.hpp>
#include <kvpolicy/allocators/adakv_row.hpp>
#include <kvpolicy/cuda/baseline_math.hpp>
#include <kvpolicy/scorers/keydiff_row.hpp>
#include <kvpolicy/scorers/knorm_row.hpp>
#include <kvpolicy/scorers/streaming_row.hpp>
#include <kvpolicy/scorers/tova_row.hpp>
#include <kvpolicy/scorers/h2o.hpp>
#include <kvpolicy/scorers/keydiff.hpp>
#include <kvpolicy/scorers/knorm.hpp>
#include <kvpolicy/scorers/streaming.hpp>
#include <kvpolicy/scorers/tova.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/baselines.hpp>
#include <kvpolicy/cuda/window_attention.hpp>
#include <kvpolicy/cuda/select.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "agreement/storage.hpp"
#include "common/error_of.hpp"
#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_baselines_cuda {

using namespace kvpolicy;
namespace bm = kvpolicy::cuda::baseline;
namespace rm = kvpolicy::row_math;

namespace {

// ---- score cases ----------------------------------------------------------------------------

using kvtest::make_view;
using kvtest::Storage;

struct Case {
  std::int64_t L, Hkv, g, T, d;
  Storage storage = Storage::hnd;
  bool zero_keys = false;  // some all-zero keys (KNorm 0, KeyDiff cosine 0)
};

std::string describe(const Case& c) {
  return "L=" + std::to_string(c.L) + " Hkv=" + std::to_string(c.Hkv) +
         " g=" + std::to_string(c.g) + " T=" + std::to_string(c.T) +
         " d=" + std::to_string(c.d) + " storage=" + std::to_string(static_cast<int>(c.storage)) +
         (c.zero_keys ? " zero-keys" : "");
}

// d below, at and above the warp (32), not a multiple of 32; T around KeyDiff's anchor chunk
// (256) and over several chunks; strided layouts.
std::vector<Case> cases() {
  return {
      {1, 2, 1, 37, 16, Storage::hnd},       {2, 2, 2, 37, 8, Storage::nhd, true},
      {1, 3, 4, 37, 12, Storage::hdn},       {1, 1, 4, 300, 64, Storage::hnd},
      {2, 1, 2, 513, 33, Storage::nhd},      {1, 2, 2, 256, 128, Storage::hdn, true},
      {1, 1, 1, 1, 4, Storage::hnd},         {1, 2, 1, 257, 7, Storage::hnd},
  };
}

template <class T>
struct Data {
  std::vector<T> kbuf, qbuf;
  KVView<const T> keys, queries;  // queries: the last 3 positions
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  Data<T> d;
  d.kbuf = rng.normals<T>(c.L * c.Hkv * c.T * c.d);
  const std::int64_t nq = std::min<std::int64_t>(3, c.T);
  d.qbuf = rng.normals<T>(c.L * c.Hkv * c.g * nq * c.d, 1.5f);
  d.keys = make_view<const T>(c.storage, d.kbuf.data(), c.L, c.Hkv, c.T, c.d);
  d.queries = make_view<const T>(c.storage, d.qbuf.data(), c.L, c.Hkv * c.g, nq, c.d);
  if (c.zero_keys) {  // every 5th token of every row is an all-zero key
    auto kv = make_view<T>(c.storage, d.kbuf.data(), c.L, c.Hkv, c.T, c.d);
    for (std::int64_t l = 0; l < c.L; ++l)
      for (std::int64_t h = 0; h < c.Hkv; ++h)
        for (std::int64_t j = 0; j < c.T; j += 5)
          for (std::int64_t i = 0; i < c.d; ++i) kv.at(l, h, j, i) = from_float<T>(0.f);
  }
  return d;
}

template <class T>
Inputs<T> inputs_of(const Data<T>& d) {
  Inputs<T> in;
  in.keys = d.keys;
  in.queries = d.queries;
  return in;
}

double nmse(const ScoreMap& got, const ScoreMap& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < static_cast<std::size_t>(want.layers() * want.heads() * want.tokens());
       ++i) {
    const double e = static_cast<double>(got.data()[i]) - want.data()[i];
    num += e * e;
    den += static_cast<double>(want.data()[i]) * want.data()[i];
  }
  return den > 0 ? num / den : num;
}

template <class T>
std::function<float(std::int64_t)> key_row(const KVView<const T>& k, std::int64_t l,
                                            std::int64_t h, std::int64_t j) {
  return [=](std::int64_t i) { return to_float(k.at(l, h, j, i)); };
}

// Host emulation of one warp's reduction: lane partials, then the xor butterfly.
template <class V, class F>
V warp_emulate(F&& lane_partial) {
  V p[bm::kWarp];
  for (int lane = 0; lane < bm::kWarp; ++lane) p[lane] = lane_partial(lane);
  return bm::warp_tree_sum(p);
}

template <class T>
ScoreMap emulate_knorm(const KVView<const T>& k) {
  ScoreMap out(k.layers, k.heads, k.tokens);
  for (std::int64_t l = 0; l < k.layers; ++l)
    for (std::int64_t h = 0; h < k.heads; ++h)
      for (std::int64_t j = 0; j < k.tokens; ++j) {
        const auto get = key_row(k, l, h, j);
        out.row(l, h)[j] = rm::knorm_finish(
            warp_emulate<float>([&](int lane) { return rm::knorm_lane(get, lane, k.dim); }));
      }
  return out;
}

template <class T>
ScoreMap emulate_keydiff(const KVView<const T>& k) {
  const std::int64_t T_ = k.tokens, d = k.dim, C = rm::anchor_chunks(T_);
  ScoreMap out(k.layers, k.heads, T_);
  for (std::int64_t l = 0; l < k.layers; ++l)
    for (std::int64_t h = 0; h < k.heads; ++h) {
      std::vector<double> norms(static_cast<std::size_t>(T_)), anchor(static_cast<std::size_t>(d));
      for (std::int64_t j = 0; j < T_; ++j) {  // kernel 1: one warp per token
        const auto get = key_row(k, l, h, j);
        norms[j] = std::sqrt(
            warp_emulate<double>([&](int lane) { return rm::sumsq_lane(get, lane, d); }));
      }
      std::vector<double> partial(static_cast<std::size_t>(C * d));
      for (std::int64_t c = 0; c < C; ++c)  // kernel 2: one block per chunk, thread per dim
        for (std::int64_t i = 0; i < d; ++i) {
          double acc = 0;
          for (std::int64_t j = c * rm::kAnchorChunk; j < std::min(T_, (c + 1) * rm::kAnchorChunk); ++j)
            acc += rm::anchor_term(to_float(k.at(l, h, j, i)), norms[j]);
          partial[c * d + i] = acc;
        }
      double an2 = 0;  // kernel 3
      for (std::int64_t i = 0; i < d; ++i) {
        double a = 0;
        for (std::int64_t c = 0; c < C; ++c) a += partial[c * d + i];
        anchor[i] = a / static_cast<double>(T_);
      }
      for (std::int64_t i = 0; i < d; ++i) an2 += anchor[i] * anchor[i];
      const double an = std::sqrt(an2);
      for (std::int64_t j = 0; j < T_; ++j) {  // kernel 4
        const auto get = key_row(k, l, h, j);
        const double dot = warp_emulate<double>(
            [&](int lane) { return rm::anchor_dot_lane(get, anchor.data(), lane, d); });
        out.row(l, h)[j] = rm::keydiff_score(static_cast<float>(norms[j]), dot, an);
      }
    }
  return out;
}

// TOVA from given window attention (the CUDA window attention's own agreement is
// test_window_attention.cpp's job): the kernel's head mean.
ScoreMap emulate_tova(const ScoreMap& attn) {
  const std::int64_t L = attn.layers(), H = attn.heads(), T_ = attn.tokens();
  ScoreMap out(L, H, T_);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t j = 0; j < T_; ++j) {
      const float v = rm::tova_at(attn.data() + l * H * T_ + j, H, T_);
      for (std::int64_t h = 0; h < H; ++h) out.row(l, h)[j] = v;
    }
  return out;
}

template <class S, class T>
ScoreMap cpu_score(const S& s, const Inputs<T>& in) {
  Stats stats;
  ScoreMap out;
  s.score(cpu_backend{1}, in, stats, out);
  return out;
}

constexpr double kBound = 1e-7;

// ---- Ada-KV cases ---------------------------------------------------------------------------

struct AdaCase {
  std::int64_t L, H, T;
  Protect protect;
  double alpha;
  ScoreMap scores;
  std::vector<std::int64_t> budgets;
};

// Scores from a few levels (ties within and across heads), sometimes -0/+0, +-inf.
AdaCase random_ada_case(kvtest::Rng& rng) {
  AdaCase c;
  c.L = rng.integer(1, 3);
  c.H = rng.integer(1, 9);
  c.T = rng.integer(1, 70);
  c.protect = {rng.integer(0, 6), rng.integer(0, 10)};
  const double alphas[] = {0.0, 0.2, 0.5, 1.0, rng.uniform(0, 1)};
  c.alpha = alphas[rng.integer(0, 4)];
  const int levels = static_cast<int>(rng.integer(1, 6));
  const int flavour = static_cast<int>(rng.integer(0, 3));
  c.scores = ScoreMap(c.L, c.H, c.T);
  for (std::int64_t i = 0; i < c.L * c.H * c.T; ++i) {
    float v = static_cast<float>(rng.integer(0, levels - 1));
    if (flavour == 1) v = static_cast<float>(rng.normal());
    if (flavour == 2 && v == 0.f && rng.integer(0, 1)) v = -0.f;
    if (flavour == 3 && rng.integer(0, 9) == 0) v = rng.integer(0, 1) ? INFINITY : -INFINITY;
    c.scores.data()[i] = v;
  }
  const std::int64_t P = c.protect.total(c.T);
  for (std::int64_t r = 0; r < c.L * c.H; ++r) c.budgets.push_back(rng.integer(P, c.T));
  return c;
}

// The CPU allocators' budgets for the case: adakv, or the chain pyramid | adakv.
std::vector<std::int64_t> cpu_adakv(const AdaCase& c, bool pyramid_first = false) {
  ScoreMap s = c.scores;
  AllocContext ctx;
  ctx.scores = &s;
  ctx.tokens = c.T;
  ctx.protect = c.protect;
  ctx.model_layers = c.L;
  std::vector<std::int64_t> b = c.budgets;
  if (pyramid_first) Pyramid{}.allocate(ctx, b);
  AdaKV{c.alpha}.allocate(ctx, b);
  return b;
}

// Host emulation of cuda::adakv_budgets: keys, per-row descending sort, the budget kernel.
std::vector<std::int64_t> emulate_adakv(const AdaCase& c) {
  const rm::AdaSpan span = rm::ada_span(c.protect.sinks, c.protect.recent, c.T);
  const std::int64_t N = span.scored(), P = span.protected_count(c.T), H = c.H;
  std::vector<std::uint64_t> keys(static_cast<std::size_t>(c.L * H * N));
  for (std::int64_t r = 0; r < c.L * H; ++r) {
    for (std::int64_t u = 0; u < N; ++u) {
      const std::int64_t j = span.sinks + u;
      keys[r * N + u] = topk_key(c.scores.data()[r * c.T + j], static_cast<std::int32_t>(j));
    }
    std::sort(keys.begin() + r * N, keys.begin() + (r + 1) * N, std::greater<>());
  }
  std::vector<std::int64_t> out(static_cast<std::size_t>(c.L * H));
  for (std::int64_t l = 0; l < c.L; ++l) {
    const std::uint64_t* rows = keys.data() + l * H * N;
    std::vector<std::int64_t> keep(H), gt(H), eq(H);
    std::int64_t free = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t b = rm::ada_clamp(c.budgets[l * H + h], P, c.T);
      keep[h] = rm::ada_keep(b, P, c.alpha);
      free += b - keep[h];
    }
    if (free > 0) {
      std::uint64_t prefix = 0;
      for (int r = 0; r < rm::kRounds; ++r) {
        std::vector<std::int64_t> count(rm::kDigits, 0);
        for (int d = 0; d < rm::kDigits; ++d)
          for (std::int64_t h = 0; h < H; ++h)
            count[d] += rm::pool_ge(rows + h * N, N, keep[h] - P, rm::candidate(prefix, r, d));
        int wins = 0, digit = -1;
        for (int d = 0; d < rm::kDigits; ++d)
          if (rm::digit_wins(count.data(), d, free)) ++wins, digit = d;
        REQUIRE(wins == 1);  // exactly one thread writes the prefix
        prefix = rm::candidate(prefix, r, digit);
      }
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t g = keep[h] - P;
        gt[h] = rm::pool_ge(rows + h * N, N, g, prefix + 1);
        eq[h] = rm::pool_ge(rows + h * N, N, g, prefix) - gt[h];
        REQUIRE((eq[h] == 0 || eq[h] == 1));
      }
    }
    rm::ada_assign(keep.data(), gt.data(), eq.data(), H, free, out.data() + l * H);
  }
  return out;
}

#if defined(KVPOLICY_WITH_CUDA)
using kvtest::download;
using kvtest::upload;

template <class T>
struct DeviceKeys {
  cuda::DeviceBuffer k, q;
  Inputs<T> in;
  explicit DeviceKeys(const Data<T>& d) : k(upload(d.kbuf)), q(upload(d.qbuf)) {
    in.keys = d.keys;
    in.keys.data = k.as<const T>();
    in.queries = d.queries;
    in.queries.data = q.as<const T>();
  }
};

// Runs a cuda::score overload into a padded device score buffer; returns the host ScoreMap.
template <class S, class T>
ScoreMap gpu_score(const S& s, const Inputs<T>& in) {
  const std::int64_t L = in.layers(), H = in.kv_heads(), T_ = in.tokens(), stride = T_ + 5;
  cuda::DeviceBuffer out(static_cast<std::size_t>(L * H * stride) * sizeof(float));
  cuda::DeviceBuffer ws(std::max<std::size_t>(cuda::score_workspace_bytes(s, in), 1));
  cuda_backend be{nullptr, ws.data(), ws.bytes()};
  cuda::score(be, s, in, cuda::MutableScoreView{out.as<float>(), L, H, T_, stride});
  cuda::synchronize();
  const auto all = download<float>(out, static_cast<std::size_t>(L * H * stride));
  ScoreMap m(L, H, T_);
  for (std::int64_t r = 0; r < L * H; ++r)
    std::copy_n(all.begin() + r * stride, T_, m.data() + r * T_);
  return m;
}
#endif

}  // namespace

// ---- CPU half -------------------------------------------------------------------------------

TEST_CASE("the warp butterfly sums 32 partials like a plain sum", "[agreement]") {
  float p[32];
  double q[32], want = 0;
  for (int i = 0; i < 32; ++i) p[i] = static_cast<float>(i + 1), q[i] = 0.5 * i, want += 0.5 * i;
  CHECK(bm::warp_tree_sum(p) == 528.f);
  CHECK(bm::warp_tree_sum(q) == want);
  for (int i = 0; i < 32; ++i) CHECK(p[i] == 528.f);  // every lane ends with the sum
}

TEMPLATE_TEST_CASE("emulated CUDA KNorm and KeyDiff equal the CPU scorers", "[agreement]", float,
                   half, bfloat16) {
  std::uint64_t seed = 11;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const auto d = make_data<TestType>(c, seed++);
    const auto in = inputs_of(d);
    const ScoreMap kn_want = cpu_score(KNorm{}, in), kn_got = emulate_knorm(d.keys);
    CHECK(nmse(kn_got, kn_want) <= kBound);
    const ScoreMap kd_want = cpu_score(KeyDiff{}, in), kd_got = emulate_keydiff(d.keys);
    CHECK(nmse(kd_got, kd_want) <= kBound);
    for (std::int64_t i = 0; i < c.L * c.Hkv * c.T; ++i) {
      // Exact where the CPU result is exact: a zero key scores 0 in both.
      if (kn_want.data()[i] == 0.f) REQUIRE(kn_got.data()[i] == 0.f);
      if (kd_want.data()[i] == 0.f) REQUIRE(kd_got.data()[i] == 0.f);
      REQUIRE(std::abs(kn_got.data()[i] - kn_want.data()[i]) <=
              1e-5f * std::abs(kn_want.data()[i]));
      REQUIRE(std::abs(kd_got.data()[i] - kd_want.data()[i]) <= 1e-6f);
    }
  }
}

TEMPLATE_TEST_CASE("emulated CUDA TOVA and StreamingLLM equal the CPU scorers", "[agreement]",
                   float, half, bfloat16) {
  std::uint64_t seed = 40;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const auto d = make_data<TestType>(c, seed++);
    const auto in = inputs_of(d);
    Stats stats;
    const ScoreMap attn = window_attention_stat(cpu_backend{1}, in, stats, 1, GqaReduce::mean);
    const ScoreMap want = cpu_score(TOVA{}, in), got = emulate_tova(attn);
    for (std::int64_t i = 0; i < c.L * c.Hkv * c.T; ++i) REQUIRE(got.data()[i] == want.data()[i]);
    const ScoreMap sw = cpu_score(Streaming{}, in);
    for (std::int64_t l = 0; l < c.L; ++l)
      for (std::int64_t h = 0; h < c.Hkv; ++h)
        for (std::int64_t j = 0; j < c.T; ++j) {  // the spec (the token's position), not the row math the CPU calls
          REQUIRE(sw.row(l, h)[j] == static_cast<float>(j));
          REQUIRE(rm::streaming_at(j) == static_cast<float>(j));
        }
  }
}

TEST_CASE("Ada-KV helpers follow AdaKV's safeguard and protection rules", "[agreement]") {
  for (double alpha : {0.0, 0.2, 0.37, 1.0})
    for (std::int64_t P : {0, 1, 5})
      for (std::int64_t b = P; b <= 40; ++b) {
        // The spec's safeguard min(b, max(P, floor(alpha b))), written out here: AdaKV::safeguard
        // itself calls rm::ada_keep.
        const auto f = static_cast<std::int64_t>(std::floor(alpha * static_cast<double>(b)));
        CHECK(rm::ada_keep(b, P, alpha) == std::min(b, std::max(P, f)));
      }
  CHECK(rm::ada_keep(10, 1, 0.2) == 2);
  CHECK(rm::ada_keep(10, 3, 0.2) == 3);
  CHECK(rm::ada_keep(2, 3, 0.2) == 2);
  for (std::int64_t T : {0, 1, 7, 20})
    for (std::int64_t s : {0, 3, 25})
      for (std::int64_t r : {0, 2, 30}) {
        const rm::AdaSpan a = rm::ada_span(s, r, T);
        const std::int64_t sinks = std::min(s, T), rb = std::max(sinks, T - r);
        CHECK(a.sinks == sinks);
        CHECK(a.recent_begin == rb);
        CHECK(a.protected_count(T) == Protect{s, r}.total(T));
      }
  const std::uint64_t row[] = {9, 7, 7, 4, 1};
  CHECK(rm::count_ge(row, 5, 10) == 0);
  CHECK(rm::count_ge(row, 5, 7) == 3);
  CHECK(rm::count_ge(row, 5, 0) == 5);
  CHECK(rm::pool_ge(row, 5, 2, 7) == 1);
  CHECK(rm::pool_ge(row, 5, 4, 7) == 0);
  CHECK(rm::ada_clamp(2, 3, 9) == 3);
  CHECK(rm::ada_clamp(12, 3, 9) == 9);
}

TEST_CASE("emulated CUDA Ada-KV budgets equal AdaKV::allocate exactly", "[agreement]") {
  kvtest::Rng rng(2026);
  int compared = 0, redistributed = 0;
  for (int it = 0; it < 1500; ++it) {
    const AdaCase c = random_ada_case(rng);
    INFO("case " << it << " L=" << c.L << " H=" << c.H << " T=" << c.T << " sinks="
                 << c.protect.sinks << " recent=" << c.protect.recent << " alpha=" << c.alpha);
    const auto want = cpu_adakv(c);
    const auto got = emulate_adakv(c);
    REQUIRE(got == want);
    ++compared;
    redistributed += got != c.budgets;
  }
  CHECK(compared == 1500);
  CHECK(redistributed > 500);  // the cases really move budget between heads
}

#if defined(KVPOLICY_WITH_CUDA)
// Argument checks run before any CUDA call, so these run without a GPU too.
TEST_CASE("CUDA baseline wrappers and entry points reject bad arguments", "[agreement]") {
  using kvtest::error_of;
  std::vector<float> k(2 * 3 * 5 * 4, 1.f);
  Inputs<float> in;
  in.keys = KVView<const float>::hnd(k.data(), 2, 3, 5, 4);
  std::vector<float> o(2 * 3 * 5);
  const cuda_backend be{};
  const cuda::MutableScoreView bad{o.data(), 2, 3, 4, 5};  // 4 tokens, keys have 5
  CHECK(error_of([&] { cuda::score(be, KNorm{}, in, bad); }).find("output score view") !=
        std::string::npos);
  CHECK(error_of([&] { cuda::score(be, KeyDiff{}, in, bad); }).find("output score view") !=
        std::string::npos);
  CHECK(error_of([&] { cuda::score(be, Streaming{}, in, bad); }).find("output score view") !=
        std::string::npos);
  CHECK(error_of([&] { cuda::score(be, TOVA{}, in, cuda::MutableScoreView{o.data(), 2, 3, 5, 5}); })
            .find("needs the last query") != std::string::npos);
  const cuda_backend no_ws{nullptr, nullptr, 64};
  CHECK(error_of([&] { cuda::score(no_ws, KNorm{}, in, cuda::MutableScoreView{o.data(), 2, 3, 5, 5}); })
            .find("workspace pointer is null") != std::string::npos);

  const cuda::ScoreView sv{o.data(), 2, 3, 5, 5};
  std::int64_t out[6];
  const std::vector<std::int64_t> low{1, 5, 5, 5, 5, 5}, high{3, 5, 6, 5, 5, 5}, ok(6, 5);
  CHECK(error_of([&] { cuda::allocate(be, AdaKV{}, sv, low, Protect{1, 1}, out); })
            .find("outside [2, 5]") != std::string::npos);
  CHECK(error_of([&] { cuda::allocate(be, AdaKV{}, sv, high, Protect{1, 1}, out); })
            .find("outside [2, 5]") != std::string::npos);
  CHECK(error_of([&] { cuda::allocate(be, AdaKV{1.5}, sv, ok, Protect{1, 1}, out); })
            .find("alpha") != std::string::npos);
  CHECK(error_of([&] {
          cuda::allocate(be, AdaKV{}, sv, std::span<const std::int64_t>(ok).first(5),
                         Protect{1, 1}, out);
        }).find("5 budgets for 6") != std::string::npos);
  CHECK(error_of([&] { cuda::allocate(be, AdaKV{}, sv, ok, Protect{1, 1}, nullptr); })
            .find("null output budgets") != std::string::npos);
  CHECK(error_of([&] {
          cuda::allocate(be, AdaKV{}, cuda::ScoreView{o.data(), 1, 1025, 1, 1}, ok, Protect{},
                         out);
        }).find("exceed") != std::string::npos);

  // Type-erased entry points: a Status, never a throw.
  const TensorRef tv = erase(in.keys);
  TensorRef null_keys = tv;
  null_keys.data = nullptr;
  CHECK(cuda::knorm_score(be, null_keys, cuda::MutableScoreView{o.data(), 2, 3, 5, 5}).code ==
        cuda::StatusCode::invalid_argument);
  CHECK(cuda::knorm_score(be, tv, bad).code == cuda::StatusCode::invalid_argument);
  CHECK(cuda::keydiff_score(be, tv, bad).code == cuda::StatusCode::invalid_argument);
  std::size_t bytes = 1;
  CHECK(cuda::adakv_workspace_bytes(1, 1025, 8, 0, 0, bytes).code ==
        cuda::StatusCode::invalid_argument);
  CHECK(bytes == 0);
  CHECK(cuda::adakv_budgets(be, sv, ok.data(), cuda::BudgetsAt::host, 1, 1, -0.1, out).code ==
        cuda::StatusCode::invalid_argument);
  CHECK(cuda::streaming_score(be, cuda::MutableScoreView{nullptr, 0, 3, 5, 5}).ok());  // empty
  CHECK(cuda::streaming_score(be, cuda::MutableScoreView{nullptr, 1, 3, 5, 5}).code ==
        cuda::StatusCode::invalid_argument);
}
#endif

#if defined(KVPOLICY_WITH_CUDA)
// The typed workspace queries are host code and need no device: each returns the bytes that the
// Status query it wraps fills in. They once returned 0 (detail::bytes_or_throw read its `bytes`
// argument before the query beside it in the same call had set it), so every workspace sized by
// them was 1 byte; only the first run on a GPU found it.
TEST_CASE("the typed CUDA workspace queries return the bytes their status queries fill",
          "[agreement]") {
  for (const Case& c : cases()) {
    INFO(describe(c));
    const auto d = make_data<float>(c, 5);
    const auto in = inputs_of(d);
    const std::int64_t nq = in.queries.tokens;
    std::size_t b = 0;
    REQUIRE(cuda::keydiff_workspace_bytes(erase(in.keys), b).ok());
    CHECK(b > 0);
    CHECK(cuda::score_workspace_bytes(KeyDiff{}, in) == b);
    REQUIRE(cuda::tova_workspace_bytes(erase(in.keys), erase(in.queries), b).ok());
    CHECK(b > 0);
    CHECK(cuda::score_workspace_bytes(TOVA{}, in) == b);
    REQUIRE(cuda::h2o_workspace_bytes(erase(in.keys), erase(in.queries), b).ok());
    CHECK(b > 0);
    CHECK(cuda::score_workspace_bytes(H2O{}, in) == b);
    REQUIRE(cuda::window_attention_workspace_bytes(erase(in.keys), erase(in.queries), nq, b).ok());
    CHECK(b > 0);
    CHECK(cuda::window_attention_workspace_bytes(in.keys, in.queries, nq) == b);
  }
  // The helper itself, whichever order the arguments are evaluated in (adakv's query asks CUB,
  // which needs a device, so it is not among the host cases above).
  std::size_t b = 0;
  const auto fill = [&b](std::size_t v) {
    b = v;
    return cuda::Status{};
  };
  CHECK(cuda::detail::bytes_or_throw(fill(4096), b, "fill") == 4096);
}
#endif

// ---- CUDA half ------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("CUDA KNorm, KeyDiff, TOVA and StreamingLLM equal the CPU scorers",
                   "[agreement][gpu]", float, half, bfloat16) {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 70;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const auto d = make_data<TestType>(c, seed++);
    const auto in = inputs_of(d);
    DeviceKeys<TestType> dev(d);
    CHECK(nmse(gpu_score(KNorm{}, dev.in), cpu_score(KNorm{}, in)) <= kBound);
    CHECK(nmse(gpu_score(KeyDiff{}, dev.in), cpu_score(KeyDiff{}, in)) <= kBound);
    CHECK(nmse(gpu_score(TOVA{}, dev.in), cpu_score(TOVA{}, in)) <= kBound);
    const ScoreMap sg = gpu_score(Streaming{}, dev.in), sw = cpu_score(Streaming{}, in);
    for (std::int64_t i = 0; i < c.L * c.Hkv * c.T; ++i) REQUIRE(sg.data()[i] == sw.data()[i]);
  }
#endif
}

TEST_CASE("CUDA Ada-KV budgets equal AdaKV::allocate and select keeps the same tokens",
          "[agreement][gpu]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  kvtest::Rng rng(77);
  for (int it = 0; it < 300; ++it) {
    const AdaCase c = random_ada_case(rng);
    INFO("case " << it << " L=" << c.L << " H=" << c.H << " T=" << c.T);
    const auto want = cpu_adakv(c);
    auto sbuf = upload(std::vector<float>(c.scores.data(), c.scores.data() + c.L * c.H * c.T));
    const cuda::ScoreView sv{sbuf.as<const float>(), c.L, c.H, c.T, c.T};
    const std::size_t wb = std::max(cuda::allocate_workspace_bytes(AdaKV{c.alpha}, sv, c.protect),
                                    cuda::select_workspace_bytes(sv));
    cuda::DeviceBuffer ws(std::max<std::size_t>(wb, 1));
    const cuda_backend be{nullptr, ws.data(), ws.bytes()};
    auto dbud = upload(c.budgets);
    if (it % 2) {
      cuda::allocate(be, AdaKV{c.alpha}, sv, c.budgets, c.protect, dbud.as<std::int64_t>());
    } else {  // device budgets in, in place
      cuda::allocate(be, AdaKV{c.alpha}, sv, dbud.as<const std::int64_t>(), c.protect,
                     dbud.as<std::int64_t>());
    }
    cuda::synchronize();
    REQUIRE(download<std::int64_t>(dbud, want.size()) == want);
    // cuda::select with the device budgets keeps what cpu::select keeps with AdaKV's budgets.
    Selection cpu_sel;
    cpu::select(cpu_backend{1}, c.scores, want, c.protect, cpu_sel);
    const std::int64_t total = cuda::kept_total(want, c.T);
    cuda::DeviceBuffer off(static_cast<std::size_t>(c.L * c.H + 1) * sizeof(std::int64_t));
    cuda::DeviceBuffer idx(static_cast<std::size_t>(std::max<std::int64_t>(total, 1)) * sizeof(std::int32_t));
    cuda::CsrSelection csr{c.L, c.H, off.as<std::int64_t>(), idx.as<std::int32_t>(), total};
    cuda::select(be, sv, dbud.as<const std::int64_t>(), c.protect, csr);
    cuda::synchronize();
    const auto o = download<std::int64_t>(off, static_cast<std::size_t>(c.L * c.H + 1));
    const auto x = download<std::int32_t>(idx, static_cast<std::size_t>(o.back()));
    const cuda::HostCsr want_csr = cuda::to_csr(cpu_sel);
    REQUIRE(o == want_csr.offsets);
    REQUIRE(x == want_csr.indices);
  }
#endif
}

TEST_CASE("CUDA pyramid | adakv on the device equals the CPU chain", "[agreement][gpu]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  kvtest::Rng rng(91);
  for (int it = 0; it < 50; ++it) {
    AdaCase c = random_ada_case(rng);
    c.L = std::max<std::int64_t>(c.L, 2);
    c.scores = ScoreMap(c.L, c.H, c.T);
    for (std::int64_t i = 0; i < c.L * c.H * c.T; ++i)
      c.scores.data()[i] = static_cast<float>(rng.integer(0, 3));
    const std::int64_t P = c.protect.total(c.T);
    const std::int64_t b = rng.integer(P, c.T);
    c.budgets.assign(static_cast<std::size_t>(c.L * c.H), b);
    INFO("case " << it << " L=" << c.L << " H=" << c.H << " T=" << c.T << " b=" << b);
    const std::vector<std::int64_t> want = cpu_adakv(c, /*pyramid_first=*/true);
    // Device chain.
    auto sbuf = upload(std::vector<float>(c.scores.data(), c.scores.data() + c.L * c.H * c.T));
    const cuda::ScoreView sv{sbuf.as<const float>(), c.L, c.H, c.T, c.T};
    cuda::DeviceBuffer ws(std::max<std::size_t>(
        cuda::allocate_workspace_bytes(AdaKV{c.alpha}, sv, c.protect), 1));
    const cuda_backend be{nullptr, ws.data(), ws.bytes()};
    cuda::DeviceBuffer dbud(want.size() * sizeof(std::int64_t));
    std::vector<std::int64_t> host = c.budgets;
    cuda::allocate(be, Pyramid{}, c.L, c.H, c.T, c.protect, 0, c.L, host,
                   dbud.as<std::int64_t>());
    cuda::allocate(be, AdaKV{c.alpha}, sv, dbud.as<const std::int64_t>(), c.protect,
                   dbud.as<std::int64_t>());
    cuda::synchronize();
    REQUIRE(download<std::int64_t>(dbud, want.size()) == want);
  }
#endif
}

}  // namespace kvt_agreement_baselines_cuda
