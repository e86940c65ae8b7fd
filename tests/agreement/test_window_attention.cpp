// Agreement of the CUDA scoring kernels (cuda/window_attention.cu) with the CPU references:
// cpu::window_attention, SnapKV::score and H2O::score from queries.
// CPU half: the kernels' per-element math (kvpolicy/cuda/score_math.hpp, scorers/snapkv_row.hpp,
// scorers/h2o_row.hpp; KVP_HD) checked on its
// own, then driven by a host emulation of both passes (row statistics per key split, merged in
// split order; one column sum per key over the group's heads and visible queries), compared with
// the references by NMSE over GQA groups 1/2/4, reduce mean/max/sum, T not a multiple of any
// tile, n_q = 1 and n_q = T, HND / NHD / transposed layouts, float / half / bfloat16.
// CUDA half ([gpu]): the real kernels on the same cases; without a GPU it warns and returns.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

#include <kvpolicy/cpu/stages.hpp>  // the CPU ops the stages declare (cpu/fwd.hpp)
#include <kvpolicy/cuda/score_math.hpp>
#include <kvpolicy/scorers/h2o_row.hpp>
#include <kvpolicy/scorers/snapkv_row.hpp>
#include <kvpolicy/ops.hpp>
#include <kvpolicy/scorers/h2o.hpp>
#include <kvpolicy/scorers/snapkv.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/window_attention.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "agreement/storage.hpp"
#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_window_attention {

using namespace kvpolicy;
namespace sm = kvpolicy::cuda::scoring;
namespace rm = kvpolicy::row_math;

namespace {

// ---- cases ----------------------------------------------------------------------------------

using kvtest::make_view;
using kvtest::Storage;
using kvtest::storage_name;

struct Case {
  std::int64_t L, Hkv, g, T, d, nq;
  std::int64_t extra_q = 0;  // queries before the last nq (the view holds nq + extra_q)
  Storage storage = Storage::hnd;
};

std::string describe(const Case& c) {
  return "L=" + std::to_string(c.L) + " Hkv=" + std::to_string(c.Hkv) +
         " g=" + std::to_string(c.g) + " T=" + std::to_string(c.T) +
         " d=" + std::to_string(c.d) + " nq=" + std::to_string(c.nq) +
         " extra_q=" + std::to_string(c.extra_q) + " " + storage_name(c.storage);
}

// GQA 1/2/4; T below, between and above the kernels' tiles (64, 128 keys; 32 queries; 128 rows)
// and over several pass-1 key splits (256+ keys each); n_q = 1, n_q = T, a window; pass-1 row
// blocks that straddle two query heads (g * nq > 128); strided layouts.
std::vector<Case> cases() {
  return {
      {1, 2, 1, 37, 16, 5, 0, Storage::hnd},     {2, 2, 2, 37, 8, 1, 0, Storage::nhd},
      {1, 3, 4, 37, 12, 37, 0, Storage::hdn},    {1, 1, 4, 131, 16, 40, 3, Storage::hnd},
      {2, 1, 2, 300, 16, 300, 0, Storage::nhd},  {1, 2, 2, 700, 8, 32, 2, Storage::hdn},
      {1, 1, 1, 1, 4, 1, 0, Storage::hnd},       {1, 2, 4, 129, 7, 129, 0, Storage::hnd},
      {1, 1, 2, 1100, 8, 64, 0, Storage::nhd},
  };
}

template <class T>
struct Data {
  std::vector<T> kbuf, qbuf;
  KVView<const T> keys, queries;  // queries: nq + extra_q tokens
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  Data<T> d;
  const std::int64_t nqv = c.nq + c.extra_q;
  d.kbuf = rng.normals<T>(c.L * c.Hkv * c.T * c.d);
  d.qbuf = rng.normals<T>(c.L * c.Hkv * c.g * nqv * c.d, 1.5f);
  d.keys = make_view<const T>(c.storage, d.kbuf.data(), c.L, c.Hkv, c.T, c.d);
  d.queries = make_view<const T>(c.storage, d.qbuf.data(), c.L, c.Hkv * c.g, nqv, c.d);
  return d;
}

double nmse(const float* got, const float* want, std::size_t n) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double e = static_cast<double>(got[i]) - want[i];
    num += e * e;
    den += static_cast<double>(want[i]) * want[i];
  }
  return den > 0 ? num / den : num;
}

// SnapKV maps: NMSE over the pooled tokens, exact FLT_MAX on the window.
void require_snapkv_match(const ScoreMap& got, const ScoreMap& want, std::int64_t w,
                          double bound) {
  REQUIRE(got.tokens() == want.tokens());
  std::vector<float> g, v;
  for (std::int64_t l = 0; l < want.layers(); ++l)
    for (std::int64_t h = 0; h < want.heads(); ++h)
      for (std::int64_t j = 0; j < want.tokens(); ++j) {
        const float a = got.row(l, h)[j], b = want.row(l, h)[j];
        if (j >= want.tokens() - w) {
          REQUIRE(b == FLT_MAX);
          REQUIRE(a == FLT_MAX);
        } else {
          g.push_back(a), v.push_back(b);
        }
      }
  if (!v.empty()) CHECK(nmse(g.data(), v.data(), v.size()) <= bound);
}

// ---- host emulation of the kernels ----------------------------------------------------------

// Scaled fp32 query row / fp32 key row, as the kernels stage them in shared memory.
template <class T>
std::vector<float> row_f32(const KVView<const T>& v, std::int64_t l, std::int64_t h,
                           std::int64_t t, float scale = 1.f) {
  std::vector<float> r(static_cast<std::size_t>(v.dim));
  for (std::int64_t c = 0; c < v.dim; ++c) r[c] = to_float(v.at(l, h, t, c)) * scale;
  return r;
}

// Pass 1 + merge: per (layer, query head, query) row, the statistics per key split (keys of the
// split the query sees, in order), merged in split order. [L][Hq][nq].
template <class T>
std::vector<sm::RowStat> emulate_stats(const KVView<const T>& k, const KVView<const T>& q,
                                       std::int64_t nq) {
  const std::int64_t L = k.layers, Hkv = k.heads, Hq = q.heads, g = Hq / Hkv, T_ = k.tokens;
  const std::int64_t qoff = q.tokens - nq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(k.dim));
  const int splits = sm::pass1_splits(L * Hkv, g, nq, T_);
  const std::int64_t len = sm::split_len(T_, splits);
  std::vector<sm::RowStat> out(static_cast<std::size_t>(L * Hq * nq));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t hq = 0; hq < Hq; ++hq)
      for (std::int64_t i = 0; i < nq; ++i) {
        const auto qr = row_f32(q, l, hq, qoff + i, scale);
        const std::int64_t pos = sm::query_pos(i, nq, T_);
        sm::RowStat merged{};
        for (int s = 0; s < splits; ++s) {
          const std::int64_t k0 = s * len, k1 = std::min({k0 + len, T_, pos + 1});
          sm::RowStat st = sm::empty_stat();
          for (std::int64_t j = k0; j < k1; ++j) {
            const auto kr = row_f32(k, l, hq / g, j);
            sm::stat_add(st, sm::dot(qr.data(), kr.data(), static_cast<int>(k.dim)));
          }
          merged = s == 0 ? st : sm::stat_merge(merged, st);
        }
        out[static_cast<std::size_t>((l * Hq + hq) * nq + i)] = merged;
      }
  return out;
}

// Pass 2: one column sum per (layer, KV head, key) over the group's heads and visible queries,
// folded over the group, optionally H2O-normalised.
template <class T>
ScoreMap emulate_colsums(const KVView<const T>& k, const KVView<const T>& q, std::int64_t nq,
                         GqaReduce reduce, bool h2o_normalize = false) {
  const std::int64_t L = k.layers, Hkv = k.heads, Hq = q.heads, g = Hq / Hkv, T_ = k.tokens;
  const std::int64_t qoff = q.tokens - nq;
  const float scale = 1.0f / std::sqrt(static_cast<float>(k.dim));
  const auto stats = emulate_stats(k, q, nq);
  const GqaReduce r = reduce;
  ScoreMap out(L, Hkv, T_);
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t j = 0; j < T_; ++j) {
        const auto kr = row_f32(k, l, h, j);
        float red = 0.f;
        for (int m = 0; m < g; ++m) {
          const std::int64_t hq = h * g + m;
          float acc = 0.f;
          for (std::int64_t i = sm::first_query_seeing(j, nq, T_); i < nq; ++i) {
            if (!sm::visible(i, j, nq, T_)) continue;
            const auto qr = row_f32(q, l, hq, qoff + i, scale);
            acc += sm::attn_prob(sm::dot(kr.data(), qr.data(), static_cast<int>(k.dim)),
                                 stats[static_cast<std::size_t>((l * Hq + hq) * nq + i)]);
          }
          red = sm::gqa_fold(red, acc, m, r);
        }
        float v = sm::gqa_finish(red, static_cast<int>(g), r);
        if (h2o_normalize) v /= rm::h2o_seen(j, nq, T_);
        out.row(l, h)[j] = v;
      }
  return out;
}

template <class T>
ScoreMap emulate_snapkv(const SnapKV& s, const KVView<const T>& k, const KVView<const T>& q) {
  const std::int64_t T_ = k.tokens, w = std::min(s.window, T_);
  const ScoreMap col = emulate_colsums(k, q, w, s.reduce);
  ScoreMap out(k.layers, k.heads, T_);
  for (std::int64_t l = 0; l < k.layers; ++l)
    for (std::int64_t h = 0; h < k.heads; ++h)
      for (std::int64_t j = 0; j < T_; ++j)
        out.row(l, h)[j] = rm::snapkv_at(col.row(l, h).data(), T_, w, j, s.kernel,
                                         static_cast<Pool>(s.pool));
  return out;
}

constexpr GqaReduce kReduces[] = {GqaReduce::mean, GqaReduce::max, GqaReduce::sum};
const char* reduce_name(GqaReduce r) {
  return r == GqaReduce::mean ? "mean" : r == GqaReduce::max ? "max" : "sum";
}

// Both sides convert every element to fp32 exactly and then run fp32 math; the only differences
// are summation orders and exp rounding (~1e-7 relative per value, NMSE ~1e-14). The issue's
// 1e-7 bound therefore holds for half and bfloat16 inputs as well: no looser bound is needed.
constexpr double kBound = 1e-7;

}  // namespace

// ---- per-element math -----------------------------------------------------------------------

TEST_CASE("online softmax statistics equal the two-pass max and sum", "[agreement]") {
  kvtest::Rng rng(5);
  for (int n : {1, 2, 7, 64, 300}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = static_cast<float>(rng.uniform(-20, 20));
    const float mx = *std::max_element(x.begin(), x.end());
    double sum = 0;
    for (float v : x) sum += std::exp(static_cast<double>(v) - mx);
    sm::RowStat all = sm::empty_stat();
    for (float v : x) sm::stat_add(all, v);
    CHECK(all.max == mx);
    CHECK(std::abs(all.sum - sum) <= 1e-5 * sum);
    // Any split into contiguous parts, merged in order, gives the same pair (empty parts too).
    for (int cut : {0, n / 3, n / 2, n}) {
      sm::RowStat a = sm::empty_stat(), b = sm::empty_stat();
      for (int i = 0; i < n; ++i) sm::stat_add(i < cut ? a : b, x[static_cast<std::size_t>(i)]);
      const sm::RowStat m = sm::stat_merge(sm::stat_merge(a, sm::empty_stat()), b);
      CHECK(m.max == mx);
      CHECK(std::abs(m.sum - sum) <= 1e-5 * sum);
    }
  }
  const sm::RowStat e = sm::stat_merge(sm::empty_stat(), sm::empty_stat());
  CHECK(e.sum == 0.f);
  CHECK(std::isinf(e.max));
}

TEST_CASE("the kernels' dot product equals a double-precision dot product", "[agreement]") {
  kvtest::Rng rng(3);
  for (int d = 1; d <= 130; d += (d < 12 ? 1 : 39)) {
    std::vector<float> a(static_cast<std::size_t>(d)), b(a.size());
    double want = 0, mag = 0;
    for (std::size_t c = 0; c < a.size(); ++c) {
      a[c] = rng.normal(), b[c] = rng.normal();
      want += static_cast<double>(a[c]) * b[c];
      mag += std::abs(static_cast<double>(a[c]) * b[c]);
    }
    INFO("d=" << d);
    CHECK(std::abs(sm::dot(a.data(), b.data(), d) - want) <= 1e-6 * mag);
  }
}

TEST_CASE("masking, split and normalisation helpers follow the CPU reference's rules",
          "[agreement]") {
  for (std::int64_t T : {1, 5, 37}) {
    for (std::int64_t nq : {std::int64_t{1}, T / 2 + 1, T}) {
      for (std::int64_t j = 0; j < T; ++j) {
        std::int64_t seen = 0, first = -1;
        for (std::int64_t i = 0; i < nq; ++i) {
          // cpu::window_attention: query i at position T - nq + i sees keys 0..position.
          const bool v = j <= T - nq + i;
          CHECK(sm::visible(i, j, nq, T) == v);
          if (v && first < 0) first = i;
          seen += v;
        }
        CHECK(sm::first_query_seeing(j, nq, T) == first);
        // H2O::score: seen = T - max(j, T - nq).
        CHECK(rm::h2o_seen(j, nq, T) == static_cast<float>(seen));
        CHECK(rm::h2o_seen(j, nq, T) == static_cast<float>(T - std::max(j, T - nq)));
      }
    }
  }
  for (std::int64_t items : {1, 8, 4096})
    for (std::int64_t T : {1, 255, 256, 257, 32768})
      for (std::int64_t nq : {std::int64_t{1}, std::int64_t{32}, T}) {
        const int s = sm::pass1_splits(items, 4, nq, T);
        CHECK(s >= 1);
        CHECK(s <= 64);
        CHECK(sm::split_len(T, s) * s >= T);
        CHECK(sm::split_len(T, s) * (s - 1) < T);  // no empty trailing split
      }
  CHECK(sm::pass1_splits(8, 4, 32, 32768) == 64);  // SnapKV at the shape: 512 blocks
}

TEST_CASE("pooling of one output element equals row_math::pool1d", "[agreement]") {
  kvtest::Rng rng(9);
  for (std::int64_t n : {1, 2, 5, 33, 200}) {
    std::vector<float> in(static_cast<std::size_t>(n)), want(in.size());
    for (auto& v : in) v = static_cast<float>(rng.uniform(0, 1));
    for (int kernel : {1, 3, 5, 7, 9}) {
      for (Pool p : {Pool::avg, Pool::max}) {
        row_math::pool1d(in.data(), want.data(), n, kernel, p);
        for (std::int64_t j = 0; j < n; ++j) {
          const float got = rm::pool_at(in.data(), n, j, kernel, static_cast<Pool>(p));
          if (p == Pool::max) CHECK(got == want[static_cast<std::size_t>(j)]);
          else CHECK(std::abs(got - want[static_cast<std::size_t>(j)]) <=
                     1e-6f * std::abs(want[static_cast<std::size_t>(j)]));
        }
      }
    }
  }
  const float col[4] = {1, 2, 3, 4};
  CHECK(rm::snapkv_at(col, 4, 2, 2, 3, Pool::avg) == FLT_MAX);
  CHECK(rm::snapkv_at(col, 4, 2, 3, 3, Pool::avg) == FLT_MAX);
  CHECK(rm::snapkv_at(col, 4, 2, 0, 3, Pool::avg) == Approx(1.0f));  // (0 + 1 + 2) / 3
  CHECK(rm::snapkv_at(col, 4, 2, 1, 3, Pool::max) == 2.0f);          // max(1, 2)
}

// ---- host emulation of the kernels vs the references ----------------------------------------

TEMPLATE_TEST_CASE("emulated CUDA window attention equals cpu::window_attention", "[agreement]",
                   float, half, bfloat16) {
  std::uint64_t seed = 100;
  for (const Case& c : cases()) {
    const auto data = make_data<TestType>(c, seed++);
    const auto q = last_tokens(data.queries, c.nq);
    for (GqaReduce r : kReduces) {
      INFO(describe(c) << " reduce=" << reduce_name(r));
      ScoreMap want;
      ops::window_attention(cpu_backend{1}, data.keys, q, r, want);
      const ScoreMap got = emulate_colsums(data.keys, data.queries, c.nq, r);
      REQUIRE(got.layers() == want.layers());
      REQUIRE(got.heads() == want.heads());
      REQUIRE(got.tokens() == want.tokens());
      const auto n = static_cast<std::size_t>(want.layers() * want.heads() * want.tokens());
      CHECK(nmse(got.data(), want.data(), n) <= kBound);
      // Column sums of softmax rows: over all keys they add up to nq per head.
      double total = 0;
      for (std::size_t e = 0; e < n; ++e) total += want.data()[e];
      if (r == GqaReduce::mean)
        CHECK(total == Approx(static_cast<double>(c.nq * c.L * c.Hkv)).epsilon(1e-4));
    }
  }
}

TEMPLATE_TEST_CASE("emulated CUDA SnapKV scores equal SnapKV::score", "[agreement]", float,
                   half) {
  std::uint64_t seed = 200;
  const SnapKV configs[] = {{4, 5, Pool::avg, GqaReduce::mean, 0},
                            {32, 7, Pool::max, GqaReduce::max, 0},
                            {1, 3, Pool::avg, GqaReduce::sum, 0},
                            {64, 1, Pool::max, GqaReduce::mean, 0}};
  for (const Case& base : cases()) {
    for (const SnapKV& s : configs) {
      Case c = base;
      c.nq = std::min(s.window, c.T);  // the scorer uses the last min(window, T) queries
      c.extra_q = base.extra_q;
      const auto data = make_data<TestType>(c, seed++);
      INFO(describe(c) << " window=" << s.window << " kernel=" << s.kernel);
      Inputs<TestType> in{data.keys, {}, data.queries};
      Stats stats;
      ScoreMap want;
      s.score(cpu_backend{1}, in, stats, want);
      const ScoreMap got = emulate_snapkv(s, data.keys, data.queries);
      require_snapkv_match(got, want, c.nq, kBound);
    }
  }
}

TEMPLATE_TEST_CASE("emulated CUDA H2O scores equal H2O::score from queries", "[agreement]", float,
                   half) {
  std::uint64_t seed = 300;
  for (const Case& c : cases()) {
    const auto data = make_data<TestType>(c, seed++);
    const auto q = last_tokens(data.queries, c.nq);  // H2O uses every given query
    for (bool normalize : {false, true}) {
      for (GqaReduce r : {GqaReduce::mean, GqaReduce::max}) {
        INFO(describe(c) << " normalize=" << normalize << " reduce=" << reduce_name(r));
        H2O s;
        s.normalize = normalize;
        s.reduce = r;
        Inputs<TestType> in{data.keys, {}, q};
        Stats stats;
        ScoreMap want;
        s.score(cpu_backend{1}, in, stats, want);
        const ScoreMap got = emulate_colsums(data.keys, q, c.nq, r, normalize);
        const auto n = static_cast<std::size_t>(want.layers() * want.heads() * want.tokens());
        CHECK(nmse(got.data(), want.data(), n) <= kBound);
      }
    }
  }
}

namespace {
// H2O state [L][Hkv] rows of `stride` floats: accumulators and observed counts (some zero).
struct H2OState {
  std::int64_t L = 2, H = 3, T = 41, stride = 45;
  std::vector<float> acc, obs;
  explicit H2OState(std::uint64_t seed) {
    kvtest::Rng rng(seed);
    acc.resize(static_cast<std::size_t>(L * H * stride));
    obs.resize(acc.size());
    for (std::size_t e = 0; e < acc.size(); ++e) {
      acc[e] = static_cast<float>(rng.uniform(0, 5));
      obs[e] = static_cast<float>(rng.integer(0, 4));
    }
  }
};
}  // namespace

TEST_CASE("H2O scores from given state, per element, equal H2O::score", "[agreement]") {
  const H2OState st(11);
  std::vector<float> kb(static_cast<std::size_t>(st.L * st.H * st.T * 2));
  for (bool normalize : {false, true}) {
    for (bool with_obs : {false, true}) {
      if (normalize && !with_obs) continue;  // rejected by H2O::score
      INFO("normalize=" << normalize << " observed=" << with_obs);
      H2O s;
      s.normalize = normalize;
      Inputs<float> in;
      in.keys = KVView<const float>::hnd(kb.data(), st.L, st.H, st.T, 2);
      in.accumulated = st.acc.data();
      in.observed = with_obs ? st.obs.data() : nullptr;
      in.state_stride = st.stride;
      Stats stats;
      ScoreMap want;
      s.score(cpu_backend{1}, in, stats, want);
      int zeros = 0;
      for (std::int64_t r = 0; r < st.L * st.H; ++r)
        for (std::int64_t j = 0; j < st.T; ++j) {
          const std::size_t at = static_cast<std::size_t>(r * st.stride + j);
          const float got = rm::h2o_from_state(st.acc[at], with_obs ? &st.obs[at] : nullptr,
                                               normalize);
          REQUIRE(got == want.data()[r * st.T + j]);
          zeros += normalize && st.obs[at] == 0;
        }
      if (normalize) CHECK(zeros > 0);  // the unobserved-key rule was exercised
    }
  }
}

// ---- the CUDA kernels vs the references -----------------------------------------------------

#if defined(KVPOLICY_WITH_CUDA)
namespace {

// Device cases: the templated head dims (64, 128) and the generic path (odd, small d).
std::vector<Case> device_cases() {
  std::vector<Case> v = cases();
  v.push_back({2, 2, 4, 1000, 128, 32, 3, Storage::hnd});
  v.push_back({1, 2, 2, 517, 64, 517, 0, Storage::nhd});
  v.push_back({1, 1, 4, 300, 128, 64, 0, Storage::hdn});
  v.push_back({1, 8, 4, 4096, 128, 32, 0, Storage::nhd});
  return v;
}

template <class T>
struct DeviceData {
  cuda::DeviceBuffer k, q, out, ws;
  KVView<const T> keys, queries;
  cuda::MutableScoreView view;
  std::int64_t pad = 5;

  DeviceData(const Case& c, const Data<T>& h)
      : k(kvtest::upload(h.kbuf)), q(kvtest::upload(h.qbuf)) {
    keys = make_view<const T>(c.storage, k.as<const T>(), c.L, c.Hkv, c.T, c.d);
    queries = make_view<const T>(c.storage, q.as<const T>(), c.L, c.Hkv * c.g,
                                 c.nq + c.extra_q, c.d);
    const std::int64_t stride = c.T + pad;
    out = cuda::DeviceBuffer(static_cast<std::size_t>(c.L * c.Hkv * stride) * sizeof(float));
    cuda::fill_bytes(out.data(), 0x7f, out.bytes());
    view = {out.as<float>(), c.L, c.Hkv, c.T, stride};
  }
  cuda_backend backend(std::size_t bytes) {
    ws = cuda::DeviceBuffer(std::max<std::size_t>(bytes, 256));
    return cuda_backend{nullptr, ws.data(), ws.bytes()};
  }
  ScoreMap result() const {
    const auto raw = kvtest::download<float>(out, static_cast<std::size_t>(
                                                      view.layers * view.heads * view.row_stride));
    ScoreMap s(view.layers, view.heads, view.tokens);
    for (std::int64_t r = 0; r < view.layers * view.heads; ++r)
      std::copy_n(raw.begin() + r * view.row_stride, view.tokens, s.data() + r * view.tokens);
    return s;
  }
};

}  // namespace
#endif

TEMPLATE_TEST_CASE("CUDA window attention equals cpu::window_attention", "[agreement][gpu]",
                   float, half, bfloat16) {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 400;
  for (const Case& c : device_cases()) {
    const auto data = make_data<TestType>(c, seed++);
    DeviceData<TestType> dev(c, data);
    for (GqaReduce r : kReduces) {
      INFO(describe(c) << " reduce=" << reduce_name(r));
      ScoreMap want;
      cpu::window_attention(cpu_backend{}, data.keys, last_tokens(data.queries, c.nq), r, want);
      const cuda_backend be =
          dev.backend(cuda::window_attention_workspace_bytes(dev.keys, dev.queries, c.nq));
      cuda::window_attention(be, dev.keys, dev.queries, r, c.nq, dev.view);
      const ScoreMap got = dev.result();
      const auto n = static_cast<std::size_t>(want.layers() * want.heads() * want.tokens());
      CHECK(nmse(got.data(), want.data(), n) <= kBound);
      // Deterministic: a second run, through ops:: on a view of just the last nq queries, gives
      // the same bits.
      const auto dq = last_tokens(dev.queries, c.nq);
      REQUIRE(ops::window_attention_workspace_bytes(be, dev.keys, dq) <= be.workspace_bytes);
      ops::window_attention(be, dev.keys, dq, r, dev.view);
      const ScoreMap again = dev.result();
      CHECK(std::equal(got.data(), got.data() + n, again.data()));
    }
  }
#endif
}

TEMPLATE_TEST_CASE("CUDA SnapKV and H2O scores equal the CPU scorers", "[agreement][gpu]", float,
                   half) {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 500;
  for (const Case& base : device_cases()) {
    for (const SnapKV& s : {SnapKV{}, SnapKV::authors(), SnapKV{3, 3, Pool::avg, GqaReduce::sum,
                                                                0}}) {
      Case c = base;
      c.nq = std::min(s.window, c.T);
      const auto data = make_data<TestType>(c, seed++);
      DeviceData<TestType> dev(c, data);
      INFO(describe(c) << " snapkv window=" << s.window);
      Stats stats;
      ScoreMap want;
      s.score(cpu_backend{}, Inputs<TestType>{data.keys, {}, data.queries}, stats, want);
      const Inputs<TestType> din{dev.keys, {}, dev.queries};
      const cuda_backend be = dev.backend(cuda::score_workspace_bytes(s, din));
      cuda::score(be, s, din, dev.view);
      require_snapkv_match(dev.result(), want, c.nq, kBound);
    }
    for (bool normalize : {false, true}) {
      const auto data = make_data<TestType>(base, seed++);
      DeviceData<TestType> dev(base, data);
      INFO(describe(base) << " h2o normalize=" << normalize);
      H2O s;
      s.normalize = normalize;
      const auto q = last_tokens(data.queries, base.nq);
      const auto dq = last_tokens(dev.queries, base.nq);
      Stats stats;
      ScoreMap want;
      s.score(cpu_backend{}, Inputs<TestType>{data.keys, {}, q}, stats, want);
      const Inputs<TestType> din{dev.keys, {}, dq};
      const cuda_backend be = dev.backend(cuda::score_workspace_bytes(s, din));
      cuda::score(be, s, din, dev.view);
      const ScoreMap got = dev.result();
      const auto n = static_cast<std::size_t>(want.layers() * want.heads() * want.tokens());
      CHECK(nmse(got.data(), want.data(), n) <= kBound);
    }
  }
#endif
}

TEST_CASE("CUDA H2O scores from given state equal H2O::score", "[agreement][gpu]") {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  const H2OState st(12);
  std::vector<float> kb(static_cast<std::size_t>(st.L * st.H * st.T * 2));
  const cuda::DeviceBuffer dacc = kvtest::upload(st.acc), dobs = kvtest::upload(st.obs);
  cuda::DeviceBuffer dout(static_cast<std::size_t>(st.L * st.H * (st.T + 2)) * sizeof(float));
  const cuda::MutableScoreView view{dout.as<float>(), st.L, st.H, st.T, st.T + 2};
  for (bool normalize : {false, true}) {
    INFO("normalize=" << normalize);
    H2O s;
    s.normalize = normalize;
    Inputs<float> in;
    in.keys = KVView<const float>::hnd(kb.data(), st.L, st.H, st.T, 2);
    in.accumulated = st.acc.data();
    in.observed = st.obs.data();
    in.state_stride = st.stride;
    Stats stats;
    ScoreMap want;
    s.score(cpu_backend{1}, in, stats, want);
    in.accumulated = dacc.as<const float>();
    in.observed = dobs.as<const float>();
    REQUIRE(cuda::score_workspace_bytes(s, in) == 0);
    cuda::score(cuda_backend{}, s, in, view);
    const auto raw = kvtest::download<float>(dout, static_cast<std::size_t>(st.L * st.H * (st.T + 2)));
    for (std::int64_t r = 0; r < st.L * st.H; ++r)
      for (std::int64_t j = 0; j < st.T; ++j)
        REQUIRE(raw[static_cast<std::size_t>(r * (st.T + 2) + j)] == want.data()[r * st.T + j]);
  }
#endif
}

#if defined(KVPOLICY_WITH_CUDA)
TEST_CASE("CUDA scoring wrappers reject bad arguments before touching the device",
          "[agreement][cuda]") {
  // Fake, never dereferenced device pointers: every check fails before a launch.
  std::vector<float> kb(2 * 4 * 8), qb(2 * 8 * 8);
  const auto k = KVView<const float>::hnd(kb.data(), 1, 2, 4, 8);
  const auto q = KVView<const float>::hnd(qb.data(), 1, 4, 4, 8);
  float o[16];
  const cuda::MutableScoreView out{o, 1, 2, 4, 4};
  const cuda_backend be{};
  using Catch::Matchers::Contains;
  CHECK_THROWS_WITH(cuda::window_attention(be, k, q, GqaReduce::mean, 5, out),
                    Contains("need 1..4 queries, got 5"));
  CHECK_THROWS_WITH(cuda::window_attention(be, k, q, GqaReduce::mean, 0, out),
                    Contains("got 0"));
  const auto q3 = KVView<const float>::hnd(qb.data(), 1, 3, 4, 8);
  CHECK_THROWS_WITH(cuda::window_attention(be, k, q3, GqaReduce::mean, 2, out),
                    Contains("not a multiple"));
  const cuda::MutableScoreView narrow{o, 1, 2, 4, 3};
  CHECK_THROWS_WITH(cuda::window_attention(be, k, q, GqaReduce::mean, 2, narrow),
                    Contains("row_stride"));
  // Insufficient workspace is reported by the launch layer as a Status.
  CHECK_THROWS_WITH(cuda::window_attention(be, k, q, GqaReduce::mean, 2, out),
                    Contains("insufficient workspace"));
  H2O h;
  h.normalize = true;
  Inputs<float> with_state{k, {}, q};
  float acc[8] = {};
  with_state.accumulated = acc;
  CHECK_THROWS_WITH(cuda::score(be, h, with_state, out), Contains("observed-query counts"));
}
#endif

}  // namespace kvt_agreement_window_attention
