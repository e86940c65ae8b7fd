// Agreement of the CUDA expected-attention scorer (cuda/expected.cu) with the CPU stage
// (scorers/expected.hpp).
// Spec half: the row math (scorers/expected_row.hpp) against the formulas written out here: RoPE
// pairs, R v and R Sigma R^T with a dense rotation matrix, the logit, the finish.
// CPU half: a host emulation of the five kernels' grids (one block per query head row for the
// statistics, one 32-lane warp per key with the xor butterfly for the logits, one thread per key
// for the finish, one block per layer for the sinks) driving the row math, against
// ExpectedAttention::score. Not emulated: the order of the softmax sum (a block tree on the
// device), sincos against std::cos / std::sin, nvcc's FMA contraction, and the workspace layout
// (each emulated kernel keeps its own buffers): those are the [gpu] half's to check. Cases: GQA, strided layouts, fp16 / bf16,
// windows shorter than the queries, sinks' queries left out (some, all), cov / vnorm off, eps,
// fewer keys than sinks.
// CUDA half ([gpu]): the kernels on the same cases; without a GPU it warns and returns.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <kvpolicy/cpu/stages.hpp>  // the CPU ops the stages declare (cpu/fwd.hpp)
#include <kvpolicy/policy.hpp>
#include <kvpolicy/cuda/baseline_math.hpp>
#include <kvpolicy/scorers/expected.hpp>
#include <kvpolicy/scorers/expected_row.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/expected.hpp>
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "agreement/storage.hpp"
#include "common/random_kv.hpp"

namespace kvt_agreement_expected_cuda {

using namespace kvpolicy;
namespace rm = kvpolicy::row_math;
namespace bm = kvpolicy::cuda::baseline;

namespace {

using kvtest::make_view;
using kvtest::Storage;

struct Case {
  std::int64_t L, H, g, T, nq, d;
  Storage storage;
  std::string spec;                        // the stage's parameters
  std::int64_t first_query_position = -1;  // Inputs::first_query_position
};

std::string describe(const Case& c) {
  return c.spec + " L=" + std::to_string(c.L) + " H=" + std::to_string(c.H) +
         " g=" + std::to_string(c.g) + " T=" + std::to_string(c.T) + " nq=" + std::to_string(c.nq) +
         " d=" + std::to_string(c.d) + " storage=" + kvtest::storage_name(c.storage) +
         " first_query_position=" + std::to_string(c.first_query_position);
}

std::vector<Case> cases() {
  return {
      {1, 2, 2, 37, 12, 16, Storage::hnd, "expected(theta=10000)"},
      {2, 1, 3, 70, 20, 8, Storage::nhd, "expected(theta=500,window=9,future=7)"},
      {1, 2, 1, 50, 8, 12, Storage::hdn, "expected(theta=10000,cov=false,eps=0.05)"},
      {1, 1, 4, 300, 40, 64, Storage::hnd, "expected(theta=10000,vnorm=false,sinks=6)"},
      // the 3 queries sit at positions 0..2, below sinks=4: none is used
      {1, 2, 2, 30, 3, 8, Storage::nhd, "expected(theta=10000)", 0},
      // queries at positions 2..9: the first two are sinks' queries, left out
      {1, 1, 2, 40, 8, 8, Storage::hnd, "expected(theta=10000)", 2},
      {1, 2, 2, 3, 2, 8, Storage::hnd, "expected(theta=10000)"},  // fewer keys than sinks
      {1, 1, 2, 64, 10, 128, Storage::hdn, "expected(theta=1000000,sinks=0,eps=0.01)"},
  };
}

template <class T>
struct Data {
  std::vector<T> kbuf, vbuf, qbuf;
  Inputs<T> in;
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  Data<T> d;
  d.kbuf = rng.normals<T>(c.L * c.H * c.T * c.d);
  d.vbuf = rng.normals<T>(c.L * c.H * c.T * c.d, 0.7f);
  d.qbuf = rng.normals<T>(c.L * c.H * c.g * c.nq * c.d, 1.5f);
  d.in.keys = make_view<const T>(c.storage, d.kbuf.data(), c.L, c.H, c.T, c.d);
  d.in.values = make_view<const T>(c.storage, d.vbuf.data(), c.L, c.H, c.T, c.d);
  d.in.queries = make_view<const T>(c.storage, d.qbuf.data(), c.L, c.H * c.g, c.nq, c.d);
  d.in.first_query_position = c.first_query_position;
  return d;
}

ExpectedAttention stage_of(const Case& c) {
  return std::get<ExpectedAttention>(Policy(c.spec).scorer());
}

template <class T>
ScoreMap cpu_score(const ExpectedAttention& s, const Inputs<T>& in) {
  Stats stats;
  ScoreMap out;
  s.score(cpu_backend{1}, in, stats, out);
  return out;
}

// Host emulation of cuda::expected_score's grids, through the row math.
template <class T>
ScoreMap emulate(const ExpectedAttention& s, const Inputs<T>& in) {
  const auto st = s.setup(in);
  const auto& k = in.keys;
  const auto& q = in.queries;
  const std::int64_t L = k.layers, H = k.heads, Hq = q.heads, T_ = k.tokens, d = k.dim;
  const std::int64_t half = d / 2, group = Hq / H, n = st.nq - st.skip, q0 = q.tokens - st.nq;
  const std::int64_t s_end = std::min(s.sinks, T_);
  const std::size_t ud = static_cast<std::size_t>(d);
  std::vector<double> z(static_cast<std::size_t>(L * Hq * T_)), zmax(static_cast<std::size_t>(L * Hq)),
      zsum(zmax.size());
  if (n > 0 && s_end < T_)
    for (std::int64_t row = 0; row < L * Hq; ++row) {
      const std::int64_t l = row / Hq, hq = row % Hq, h = hq / group;
      // kernel 1: the rotated queries, the mean, R mu, Sigma, R Sigma R^T
      std::vector<double> rq(static_cast<std::size_t>(n) * ud), mu(ud), sig(ud * ud);
      std::vector<float> muf(ud), sigf(ud * ud);
      for (std::int64_t idx = 0; idx < n * d; ++idx) {
        const std::int64_t i = st.skip + idx / d, e = idx % d, p = e < half ? e : e - half;
        const double a = rm::rope_angle(st.nq - i, st.inv_freq[static_cast<std::size_t>(p)]);
        double rx = 0, rw = 0;
        rm::rope_pair(to_float(q.at(l, hq, q0 + i, p)), to_float(q.at(l, hq, q0 + i, p + half)),
                      std::cos(a), std::sin(a), rx, rw);
        rq[static_cast<std::size_t>(idx)] = e < half ? rx : rw;
      }
      for (std::int64_t e = 0; e < d; ++e) {
        double m = 0;
        for (std::int64_t i = 0; i < n; ++i) m += rq[static_cast<std::size_t>(i * d + e)];
        mu[static_cast<std::size_t>(e)] = m / static_cast<double>(n);
      }
      for (std::int64_t e = 0; e < d; ++e)
        muf[static_cast<std::size_t>(e)] = static_cast<float>(rm::rotate_component(
            [&](std::int64_t a) { return mu[static_cast<std::size_t>(a)]; }, half, st.cbar.data(),
            st.sbar.data(), e));
      if (s.cov) {
        for (std::int64_t e = 0; e < d; ++e)
          for (std::int64_t f = 0; f < d; ++f) {
            double acc = 0;
            for (std::int64_t i = 0; i < n; ++i)
              acc += (rq[static_cast<std::size_t>(i * d + e)] - mu[static_cast<std::size_t>(e)]) *
                     (rq[static_cast<std::size_t>(i * d + f)] - mu[static_cast<std::size_t>(f)]);
            sig[static_cast<std::size_t>(e * d + f)] = acc / static_cast<double>(n);
          }
        for (std::int64_t e = 0; e < d; ++e)
          for (std::int64_t f = 0; f < d; ++f)
            sigf[static_cast<std::size_t>(e * d + f)] = static_cast<float>(
                rm::rotate_sigma_entry(sig.data(), d, st.cbar.data(), st.sbar.data(), e, f));
      }
      // kernel 2: one warp per key
      for (std::int64_t j = s_end; j < T_; ++j) {
        float lin[bm::kWarp], quad[bm::kWarp];
        for (int lane = 0; lane < bm::kWarp; ++lane)
          rm::expected_logit_lane([&](std::int64_t e) { return to_float(k.at(l, h, j, e)); },
                                  muf.data(), s.cov ? sigf.data() : nullptr, lane, d, lin[lane],
                                  quad[lane]);
        z[static_cast<std::size_t>(row * T_ + j)] =
            rm::expected_logit(bm::warp_tree_sum(lin), bm::warp_tree_sum(quad),
                               1.0 / std::sqrt(static_cast<double>(d)), 2.0 * static_cast<double>(d));
      }
      // kernel 3 (in order here; a block tree on the device)
      double m = -HUGE_VAL, sum = 0;
      for (std::int64_t j = s_end; j < T_; ++j) m = std::fmax(m, z[static_cast<std::size_t>(row * T_ + j)]);
      for (std::int64_t j = s_end; j < T_; ++j) sum += std::exp(z[static_cast<std::size_t>(row * T_ + j)] - m);
      zmax[static_cast<std::size_t>(row)] = m;
      zsum[static_cast<std::size_t>(row)] = sum;
    }
  ScoreMap out(L, H, T_);
  // kernel 4: one thread per (layer, KV head, non-sink key)
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = s_end; j < T_; ++j) {
        double acc = 0;
        if (n > 0)
          for (std::int64_t g = 0; g < group; ++g) {
            const auto row = static_cast<std::size_t>(l * Hq + h * group + g);
            acc += std::exp(z[row * static_cast<std::size_t>(T_) + static_cast<std::size_t>(j)] - zmax[row]) / zsum[row];
          }
        const double n2 = s.vnorm ? rm::value_sqnorm(
                                        [&](std::int64_t e) { return to_float(in.values.at(l, h, j, e)); }, d)
                                  : 0.0;
        out.row(l, h)[j] = rm::expected_finish(acc, group, s.vnorm, s.eps, n2);
      }
  // kernel 5: the sinks
  for (std::int64_t l = 0; l < L && s_end > 0; ++l) {
    float top = 0.f;
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = s_end; j < T_; ++j) top = std::fmax(top, out.row(l, h)[j]);
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < s_end; ++j) out.row(l, h)[j] = top + 1.0f;
  }
  return out;
}

// The scores agree to fp32 rounding of the logits (the CPU's GEMMs sum in another order): every
// non-sink score within `bound` times the layer's highest non-sink score, the sinks' score (that
// highest + 1) within `bound` of the CPU's.
void require_close(const ScoreMap& got, const ScoreMap& want, std::int64_t sinks, float bound) {
  REQUIRE(got.layers() == want.layers());
  REQUIRE(got.heads() == want.heads());
  REQUIRE(got.tokens() == want.tokens());
  const std::int64_t s_end = std::min(sinks, want.tokens());
  for (std::int64_t l = 0; l < want.layers(); ++l) {
    float top = 0.f;
    for (std::int64_t h = 0; h < want.heads(); ++h)
      for (std::int64_t j = s_end; j < want.tokens(); ++j) top = std::max(top, std::abs(want.row(l, h)[j]));
    for (std::int64_t h = 0; h < want.heads(); ++h)
      for (std::int64_t j = 0; j < want.tokens(); ++j) {
        INFO("layer " << l << " head " << h << " token " << j << ": " << got.row(l, h)[j] << " vs "
                      << want.row(l, h)[j]);
        REQUIRE(std::isfinite(got.row(l, h)[j]));
        const float scale = j < s_end ? std::abs(want.row(l, h)[j]) : top;
        REQUIRE(std::abs(got.row(l, h)[j] - want.row(l, h)[j]) <= bound * std::max(scale, 1e-30f));
      }
  }
}

}  // namespace

// ---- spec half --------------------------------------------------------------------------------

TEST_CASE("expected row math: RoPE pairs, R v and R Sigma R^T equal the dense rotation",
          "[agreement][expected]") {
  const std::int64_t d = 6, half = 3;
  const double c[3] = {std::cos(0.3), std::cos(-1.1), std::cos(2.0)};
  const double s[3] = {std::sin(0.3), std::sin(-1.1), std::sin(2.0)};
  // The dense R: pair p turns dims (p, p + half) by the angle of p.
  double R[6][6] = {};
  for (std::int64_t p = 0; p < half; ++p) {
    R[p][p] = c[p], R[p][p + half] = -s[p];
    R[p + half][p] = s[p], R[p + half][p + half] = c[p];
  }
  const double v[6] = {0.5, -1.0, 2.0, 0.25, 3.0, -0.75};
  for (std::int64_t e = 0; e < d; ++e) {
    double want = 0;
    for (std::int64_t a = 0; a < d; ++a) want += R[e][a] * v[a];
    CHECK(rm::rotate_component([&](std::int64_t a) { return v[a]; }, half, c, s, e) ==
          Approx(want).margin(1e-14));
  }
  double rx = 0, rw = 0;
  rm::rope_pair(2.0, 0.0, 0.0, 1.0, rx, rw);  // a quarter turn: (2, 0) -> (0, 2)
  CHECK(rx == 0.0);
  CHECK(rw == 2.0);
  double sig[36];
  for (std::int64_t i = 0; i < d; ++i)
    for (std::int64_t j = 0; j <= i; ++j) sig[i * d + j] = sig[j * d + i] = 0.1 * static_cast<double>(i + 2 * j) - 0.3;
  for (std::int64_t e = 0; e < d; ++e)
    for (std::int64_t f = 0; f < d; ++f) {
      double want = 0;
      for (std::int64_t a = 0; a < d; ++a)
        for (std::int64_t b = 0; b < d; ++b) want += R[e][a] * sig[a * d + b] * R[f][b];
      CHECK(rm::rotate_sigma_entry(sig, d, c, s, e, f) == Approx(want).margin(1e-14));
    }
  CHECK(rm::rope_angle(3, 0.5f) == 1.5);
}

TEST_CASE("expected row math: the logit, the lane sums and the finish follow the formulas",
          "[agreement][expected]") {
  // z = lin / sqrt(d) + quad / (2 d) with d = 4.
  CHECK(rm::expected_logit(2.0f, 8.0f, 0.5, 8.0) == 2.0);
  // k = (1, 2, 3), mu = (1, 0, -1), Sigma = diag(1, 2, 3) + 1 off the diagonal of (0, 1):
  // k.mu = -2, k^T Sigma k = 1 + 8 + 27 + 2 * 2 = 40.
  const float k[3] = {1, 2, 3}, mu[3] = {1, 0, -1};
  const float sig[9] = {1, 1, 0, 1, 2, 0, 0, 0, 3};
  float lin[bm::kWarp], quad[bm::kWarp];
  for (int lane = 0; lane < bm::kWarp; ++lane)
    rm::expected_logit_lane([&](std::int64_t e) { return k[e]; }, mu, sig, lane, 3, lin[lane], quad[lane]);
  CHECK(bm::warp_tree_sum(lin) == -2.0f);
  CHECK(bm::warp_tree_sum(quad) == 40.0f);
  for (int lane = 0; lane < bm::kWarp; ++lane)
    rm::expected_logit_lane([&](std::int64_t e) { return k[e]; }, mu, nullptr, lane, 3, lin[lane], quad[lane]);
  CHECK(bm::warp_tree_sum(quad) == 0.0f);
  // ||(3, 4)||^2 = 25; group mean of 0.6 over 3 heads = 0.2; (0.2 + 0.3) * 5 = 2.5.
  CHECK(rm::value_sqnorm([](std::int64_t e) { return e == 0 ? 3.0f : 4.0f; }, 2) == 25.0);
  CHECK(rm::expected_finish(0.6, 3, true, 0.3, 25.0) == Approx(2.5f));
  CHECK(rm::expected_finish(0.6, 3, false, 0.3, 25.0) == Approx(0.2f));
}

// ---- CPU half ---------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("emulated CUDA expected attention equals ExpectedAttention::score",
                   "[agreement][expected]", float, half, bfloat16) {
  std::uint64_t seed = 300;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const auto d = make_data<TestType>(c, seed++);
    const ExpectedAttention s = stage_of(c);
    const ScoreMap want = cpu_score(s, d.in), got = emulate(s, d.in);
    require_close(got, want, s.sinks, 2e-5f);
  }
}

TEST_CASE("expected attention with every query a sink's scores by value norm alone",
          "[agreement][expected]") {
  // Queries at positions 0..2 with sinks=4: no statistics, so every weight is 0 and a key's
  // score is eps * ||v||; the sinks get the layer's highest + 1.
  const Case c{1, 2, 2, 30, 3, 8, Storage::hnd, "expected(theta=10000,eps=0.5)", 0};
  const auto d = make_data<float>(c, 5);
  const ExpectedAttention s = stage_of(c);
  REQUIRE(s.setup(d.in).skip == 3);
  // The count of sinks' queries, clamp(sinks - first position, 0, nq), also where the positions
  // start below 0 (more queries than keys) and for sinks near INT64_MAX.
  ExpectedAttention big = s;
  big.sinks = std::numeric_limits<std::int64_t>::max() - 1;
  CHECK(big.setup(d.in).skip == 3);
  Inputs<float> more = d.in;  // 3 queries over 2 keys: positions -1, 0, 1
  more.first_query_position = -1;
  more.keys.tokens = more.values.tokens = 2;
  CHECK(s.setup(more).skip == 3);
  ExpectedAttention one = s;
  one.sinks = 1;
  CHECK(one.setup(more).skip == 2);
  const ScoreMap want = cpu_score(s, d.in), got = emulate(s, d.in);
  float top = 0.f;
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t j = 4; j < c.T; ++j) {
      double n2 = 0;
      for (std::int64_t e = 0; e < c.d; ++e) n2 += static_cast<double>(d.in.values.at(0, h, j, e)) * d.in.values.at(0, h, j, e);
      const float spec = static_cast<float>(0.5 * std::sqrt(n2));
      CHECK(want.row(0, h)[j] == spec);
      CHECK(got.row(0, h)[j] == spec);
      top = std::max(top, spec);
    }
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t j = 0; j < 4; ++j) {
      CHECK(want.row(0, h)[j] == top + 1.0f);
      CHECK(got.row(0, h)[j] == top + 1.0f);
    }
}

#if defined(KVPOLICY_WITH_CUDA)
TEST_CASE("CUDA expected attention refuses bad arguments before touching the device",
          "[agreement][expected][cuda]") {
  const Case c{1, 2, 2, 37, 12, 16, Storage::hnd, "expected(theta=10000)"};
  auto d = make_data<float>(c, 1);
  const ExpectedAttention s = stage_of(c);
  std::vector<float> out(static_cast<std::size_t>(2 * 37));
  const cuda::MutableScoreView view{out.data(), 1, 2, 37, 37};
  const cuda_backend be{nullptr, nullptr, 0};
  using Catch::Contains;
  {
    Inputs<float> in = d.in;  // no queries
    in.queries = {};
    REQUIRE_THROWS_WITH(cuda::score(be, s, in, view), Contains("needs the recent queries"));
  }
  {
    const ExpectedAttention no_rope = std::get<ExpectedAttention>(Policy("expected").scorer());
    REQUIRE_THROWS_WITH(cuda::score(be, no_rope, d.in, view), Contains("RoPE frequencies"));
  }
  {
    std::vector<float> big(static_cast<std::size_t>(258 * 40));
    Inputs<float> in;
    in.keys = KVView<const float>::hnd(big.data(), 1, 1, 20, 258);
    in.values = in.keys;
    in.queries = KVView<const float>::hnd(big.data(), 1, 1, 20, 258);
    REQUIRE_THROWS_WITH(cuda::score_workspace_bytes(s, in), Contains("head_dim 258 above 256"));
  }
  REQUIRE_THROWS_WITH(cuda::score(be, s, d.in, cuda::MutableScoreView{out.data(), 1, 2, 36, 37}),
                      Contains("output score view"));
  // The type-erased entry: bad ExpectedArgs and shapes come back as invalid_argument.
  cuda::ExpectedArgs a = cuda::detail::expected_args(s, d.in, "test");
  std::size_t bytes = 0;
  REQUIRE(cuda::expected_workspace_bytes(erase(d.in.keys), erase(d.in.queries), a, bytes).ok());
  CHECK(bytes > 0);
  cuda::ExpectedArgs bad = a;
  bad.nq = 13;  // more than the 12 queries
  CHECK(cuda::expected_workspace_bytes(erase(d.in.keys), erase(d.in.queries), bad, bytes).code ==
        cuda::StatusCode::invalid_argument);
  bad = a;
  bad.skip = a.nq + 1;
  CHECK(cuda::expected_score(be, erase(d.in.keys), erase(d.in.values), erase(d.in.queries), bad, view)
            .code == cuda::StatusCode::invalid_argument);
  // vnorm without values; a workspace smaller than asked for.
  CHECK(cuda::expected_score(be, erase(d.in.keys), TensorRef{}, erase(d.in.queries), a, view).code ==
        cuda::StatusCode::invalid_argument);
  CHECK(cuda::expected_score(be, erase(d.in.keys), erase(d.in.values), erase(d.in.queries), a, view)
            .code == cuda::StatusCode::insufficient_workspace);
}
#endif

// ---- CUDA half --------------------------------------------------------------------------------

TEMPLATE_TEST_CASE("CUDA expected attention equals ExpectedAttention::score", "[agreement][gpu]",
                   float, half, bfloat16) {
  if (!kvtest::gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 300;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const auto d = make_data<TestType>(c, seed++);
    const ExpectedAttention s = stage_of(c);
    const cuda::DeviceBuffer k = kvtest::upload(d.kbuf), v = kvtest::upload(d.vbuf),
                             q = kvtest::upload(d.qbuf);
    Inputs<TestType> in = d.in;
    in.keys.data = k.as<const TestType>();
    in.values.data = v.as<const TestType>();
    in.queries.data = q.as<const TestType>();
    const std::int64_t stride = c.T + 3;
    cuda::DeviceBuffer out(static_cast<std::size_t>(c.L * c.H * stride) * sizeof(float));
    cuda::DeviceBuffer ws(std::max<std::size_t>(cuda::score_workspace_bytes(s, in), 1));
    const cuda_backend be{nullptr, ws.data(), ws.bytes()};
    cuda::score(be, s, in, cuda::MutableScoreView{out.as<float>(), c.L, c.H, c.T, stride});
    cuda::synchronize();
    const auto all = kvtest::download<float>(out, static_cast<std::size_t>(c.L * c.H * stride));
    ScoreMap got(c.L, c.H, c.T);
    for (std::int64_t r = 0; r < c.L * c.H; ++r)
      std::copy_n(all.begin() + r * stride, c.T, got.data() + r * c.T);
    require_close(got, cpu_score(s, d.in), s.sinks, 1e-4f);
  }
#endif
}

}  // namespace kvt_agreement_expected_cuda
