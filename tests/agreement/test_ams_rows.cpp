// Agreement of the AMS segment/quota row logic (allocators/ams_rows.hpp; the CUDA kernel
// cuda/ams.cu runs it one thread block per row) with the CPU allocator's functions
// (ams::normalize, ams::segments, ams::quotas as AMS::candidates calls them): the host loop
// emulates the kernel's phases and asks for identical segments and quotas (integers exactly,
// segment masses bit for bit). The [gpu] case runs the kernel.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <kvpolicy/cpu/stages.hpp>  // the CPU ops the stages declare (cpu/fwd.hpp)
#include <kvpolicy/allocators/ams.hpp>
#include <kvpolicy/cuda/ams.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_ams_rows {

using namespace kvpolicy;

namespace {

struct RowCase {
  std::vector<double> m;  // the row's mass (T)
  std::int64_t begin = 0, end = 0, budget = 0;
  ams::rows::Params p;
};

struct RowResult {
  std::vector<ams::Segment> segs;
  std::vector<double> seg_mass;
  std::vector<std::int64_t> quota;
  bool ok = true;
};

// What AMS::candidates computes before marking candidates.
RowResult cpu_row(const RowCase& c) {
  RowResult r;
  std::vector<double> mid(c.m.begin() + c.begin, c.m.begin() + c.end);
  ams::normalize(mid);
  r.segs = ams::segments(mid, c.p.segment_mass, c.p.min_seg_len, c.p.max_seg_len);
  for (auto& s : r.segs)
    r.seg_mass.push_back(std::accumulate(mid.begin() + s.begin, mid.begin() + s.end, 0.0));
  try {
    r.quota = ams::quotas(r.segs, r.seg_mass, c.budget, c.p.min_keep);
  } catch (const Error&) {
    r.ok = false;
  }
  for (auto& s : r.segs) s.begin += c.begin, s.end += c.begin;
  return r;
}

// The kernel's phases for one row (thread 0 / all threads), on the host.
RowResult emulated_row(const RowCase& c) {
  const std::int64_t cap = c.end - c.begin + 1;
  std::vector<double> d(static_cast<std::size_t>(3 * cap));
  std::vector<std::int64_t> s(static_cast<std::size_t>(5 * cap));
  const ams::rows::RowBuffers b{d.data(),           d.data() + cap,     d.data() + 2 * cap,
                                s.data(),           s.data() + cap,     s.data() + 2 * cap,
                                s.data() + 3 * cap, s.data() + 4 * cap};
  const std::int64_t ns = ams::rows::row_segments(c.m.data(), c.begin, c.end, c.p, b);
  for (std::int64_t i = ns - 1; i >= 0; --i) ams::rows::row_segment_mass(b, i);  // any order
  RowResult r;
  r.ok = ams::rows::row_quotas(ns, c.budget, c.p, b);
  for (std::int64_t i = 0; i < ns; ++i) ams::rows::row_shift(b, i, c.begin);
  for (std::int64_t i = 0; i < ns; ++i) {
    r.segs.push_back({b.seg_begin[i], b.seg_end[i]});
    r.seg_mass.push_back(b.seg_mass[i]);
    if (r.ok) r.quota.push_back(b.quota[i]);
  }
  return r;
}

std::vector<RowCase> make_cases() {
  std::mt19937 rng(11);
  std::vector<RowCase> out;
  const ams::rows::Params params[] = {
      {0.02, 32, 1024, 8}, {0.05, 4, 16, 2}, {0.001, 1, 8, 0}, {0.3, 2, 3, 5}, {1.0, 1, 1, 1}};
  const std::int64_t lengths[] = {1, 2, 5, 37, 300, 2000};
  for (const auto& p : params)
    for (std::int64_t T : lengths)
      for (int kind = 0; kind < 5; ++kind) {
        RowCase c;
        c.p = p;
        c.m.resize(static_cast<std::size_t>(T));
        std::exponential_distribution<double> ex(1.0);
        for (std::int64_t j = 0; j < T; ++j) {
          double x = ex(rng);
          if (kind == 1) x = rng() % 50 == 0 ? 100 * x : 1e-3 * x;  // spiky
          if (kind == 2) x = 1.0;                                    // uniform
          if (kind == 3) x = rng() % 3 == 0 ? 0.0 : x;               // zeros (relu'd + eps)
          if (kind == 4) x = j < T / 2 ? 0.0 : x;                    // an empty region
          c.m[static_cast<std::size_t>(j)] = x;
        }
        c.begin = T > 2 ? static_cast<std::int64_t>(rng() % 3) : 0;
        c.end = T - (T > 4 ? static_cast<std::int64_t>(rng() % 4) : 0);
        const std::int64_t n = c.end - c.begin;
        for (std::int64_t budget : {std::int64_t{0}, n / 7, n / 2, n - 1, n, n + 1}) {
          c.budget = budget;
          out.push_back(c);
        }
      }
  return out;
}

}  // namespace

TEST_CASE("AMS row logic (emulated kernel) equals ams::segments and ams::quotas exactly",
          "[agreement]") {
  std::size_t compared = 0, rejected = 0;
  for (const RowCase& c : make_cases()) {
    INFO("T=" << c.m.size() << " [" << c.begin << "," << c.end << ") budget=" << c.budget
              << " segment_mass=" << c.p.segment_mass << " min/max=" << c.p.min_seg_len << "/"
              << c.p.max_seg_len << " min_keep=" << c.p.min_keep);
    const RowResult want = cpu_row(c), got = emulated_row(c);
    REQUIRE(got.segs == want.segs);
    REQUIRE(got.seg_mass.size() == want.seg_mass.size());
    REQUIRE((want.seg_mass.empty() ||
             std::memcmp(got.seg_mass.data(), want.seg_mass.data(),
                         want.seg_mass.size() * sizeof(double)) == 0));
    REQUIRE(got.ok == want.ok);
    if (want.ok) {
      REQUIRE(got.quota == want.quota);
      CHECK(std::accumulate(got.quota.begin(), got.quota.end(), std::int64_t{0}) == c.budget);
    }
    ++compared;
    rejected += want.ok ? 0 : 1;
  }
  CHECK(compared > 500);
  CHECK(rejected > 0);  // budgets above the row were rejected by both
}

namespace {
// The mass kernel's row (cuda/ams.cu) on the host: thread t handles tokens t, t + 256, ...; the
// threads run in reverse order (a kernel's threads run in any), the block totals add the lane
// sums in lane order.
std::vector<double> emulated_mass(const AMS& a, const std::vector<float>& attn, std::int64_t w,
                                  float* credit) {
  namespace rows = ams::rows;
  constexpr int L = rows::kMassLanes;
  const auto T = static_cast<std::int64_t>(attn.size());
  const std::int64_t pooled = T - std::min(w, T);
  std::vector<double> mc(static_cast<std::size_t>(T)), out(static_cast<std::size_t>(T));
  double lanes[L];
  float mx = -INFINITY;
  for (int t = L - 1; t >= 0; --t)
    for (std::int64_t j = t; j < pooled; j += L) {
      const float v = rows::mass_pooled(attn.data(), pooled, j, a.kernel);
      mc[static_cast<std::size_t>(j)] = v;
      mx = std::max(mx, v);
    }
  const auto phase = [&](auto&& per_token) {
    for (int t = L - 1; t >= 0; --t) {
      double part = 0.0;
      for (std::int64_t j = t; j < T; j += L) part += per_token(static_cast<std::size_t>(j));
      lanes[t] = part;
    }
    return rows::lanes_total(lanes);
  };
  const double s1 = phase([&](std::size_t j) {
    return mc[j] = rows::mass_current(static_cast<float>(mc[j]), pooled,
                                      static_cast<std::int64_t>(j), mx);
  });
  const double s2 = phase([&](std::size_t j) {
    mc[j] /= s1;
    const float c = rows::credit_next(credit ? credit[j] : 0.f, mc[j], a.lambda);
    if (credit) credit[j] = c;
    return out[j] = rows::relu_eps(c);
  });
  const double s3 =
      phase([&](std::size_t j) { return out[j] = rows::mass_mix(mc[j], out[j], s2, a.beta); });
  for (double& x : out) x /= s3;
  return out;
}

// AMS steps 1-2 as algorithms.md states them, with plain serial sums: the reference the lane
// order must stay close to.
std::vector<double> spec_mass(const AMS& a, const std::vector<float>& attn, std::int64_t w,
                              std::vector<float>& credit) {
  const auto T = static_cast<std::int64_t>(attn.size());
  const std::int64_t n = T - std::min(w, T);
  auto normalize = [](std::vector<double>& x) {
    double s = 0;
    for (double& v : x) s += (v = std::max(v, 0.0) + 1e-12);
    for (double& v : x) v /= s;
  };
  std::vector<double> cur(static_cast<std::size_t>(T), 1.0);
  if (n > 0) {
    double mx = -1e300;
    std::vector<double> pooled(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t t = j - a.kernel / 2; t <= j + a.kernel / 2; ++t)
        if (t >= 0 && t < n) s += attn[static_cast<std::size_t>(t)];
      pooled[static_cast<std::size_t>(j)] = static_cast<float>(s / a.kernel);  // fp32 scores
      mx = std::max(mx, pooled[static_cast<std::size_t>(j)]);
    }
    for (std::int64_t j = 0; j < T; ++j)
      cur[static_cast<std::size_t>(j)] = j < n ? pooled[static_cast<std::size_t>(j)] : mx;
  }
  normalize(cur);
  std::vector<double> c(cur.size()), m(cur.size());
  for (std::size_t j = 0; j < cur.size(); ++j)
    c[j] = credit[j] = static_cast<float>(a.lambda * credit[j] + (1 - a.lambda) * cur[j]);
  normalize(c);
  for (std::size_t j = 0; j < cur.size(); ++j) m[j] = a.beta * cur[j] + (1 - a.beta) * c[j];
  normalize(m);
  return m;
}
}  // namespace

TEST_CASE("AMS mass (emulated kernel: 256 lanes, threads in any order) equals AMS::mass bit for "
          "bit, and the spec's serial sums to 1e-12", "[agreement][allocators][ams]") {
  std::mt19937 rng(5);
  std::exponential_distribution<double> ex(1.0);
  std::size_t compared = 0;
  for (std::int64_t T : {1, 5, 40, 300, 700})
    for (std::int64_t w : {1, 8, 32, 1000})
      for (int kernel : {1, 3, 5}) {
        AMS a;
        a.kernel = kernel;
        std::vector<float> attn(static_cast<std::size_t>(T));
        for (auto& x : attn) x = rng() % 4 == 0 ? 0.f : static_cast<float>(ex(rng));
        std::vector<float> prev(attn.size());
        for (auto& x : prev) x = static_cast<float>(1e-3 * ex(rng));
        for (bool with_credit : {false, true}) {
          INFO("T=" << T << " w=" << w << " kernel=" << kernel << " credit=" << with_credit);
          std::vector<float> c_cpu = prev, c_dev = prev, c_spec = prev;
          std::vector<float> zero(attn.size(), 0.f);
          const std::vector<double> want =
              a.mass(attn, w, with_credit ? std::span<float>(c_cpu) : std::span<float>(zero));
          const std::vector<double> got =
              emulated_mass(a, attn, w, with_credit ? c_dev.data() : nullptr);
          REQUIRE(std::memcmp(got.data(), want.data(), want.size() * sizeof(double)) == 0);
          if (with_credit) REQUIRE(c_dev == c_cpu);
          if (!with_credit) std::fill(c_spec.begin(), c_spec.end(), 0.f);
          const std::vector<double> ref = spec_mass(a, attn, w, c_spec);
          for (std::size_t j = 0; j < ref.size(); ++j)
            REQUIRE(want[j] == Approx(ref[j]).epsilon(1e-12).margin(1e-15));
          ++compared;
        }
      }
  CHECK(compared == 120);
}

TEST_CASE("AMS candidates by the kernel's bitwise k-th key search equal ams::mark_candidates",
          "[agreement][allocators][ams]") {
  std::mt19937 rng(9);
  std::size_t segments = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t T = 1 + static_cast<std::int64_t>(rng() % 300);
    std::vector<float> scores(static_cast<std::size_t>(T));
    for (auto& x : scores) {
      const unsigned kind = rng() % 10;
      x = kind == 0   ? -INFINITY
          : kind == 1 ? INFINITY
          : kind < 5  ? static_cast<float>(static_cast<int>(rng() % 3) - 1)  // ties, +-0
                      : std::ldexp(static_cast<float>(rng() % 1000) - 500.f, -7);
    }
    // Random segments covering [0, T) and quotas in [0, len].
    std::vector<ams::Segment> segs;
    for (std::int64_t b = 0; b < T;) {
      const std::int64_t e = std::min(T, b + 1 + static_cast<std::int64_t>(rng() % 40));
      segs.push_back({b, e});
      b = e;
    }
    std::vector<std::int64_t> quota;
    for (const auto& sg : segs)
      quota.push_back(static_cast<std::int64_t>(rng() % static_cast<unsigned>(sg.size() + 1)));
    std::vector<char> want;
    ams::mark_candidates(scores, segs, quota, want);
    for (std::size_t i = 0; i < segs.size(); ++i) {
      const std::int64_t b = segs[i].begin, e = segs[i].end, q = quota[i];
      const bool all = q >= e - b, none = q <= 0;
      std::uint64_t kth = 0;
      if (!all && !none)
        kth = ams::rows::kth_key(q, [&](std::uint64_t t) {
          std::int64_t c = 0;
          for (std::int64_t j = b; j < e; ++j)
            c += topk_key(scores[static_cast<std::size_t>(j)], static_cast<std::int32_t>(j)) >= t;
          return c;
        });
      for (std::int64_t j = b; j < e; ++j) {
        const float x = scores[static_cast<std::size_t>(j)];
        const bool cand = all || (!none && topk_key(x, static_cast<std::int32_t>(j)) >= kth);
        INFO("trial " << trial << " segment " << i << " token " << j);
        REQUIRE(cand == static_cast<bool>(want[static_cast<std::size_t>(j)]));
        const float masked = ams::rows::mask_score(x, cand);
        REQUIRE(masked == (!cand ? -INFINITY : x == -INFINITY ? -FLT_MAX : x));
      }
      ++segments;
    }
  }
  CHECK(segments > 1000);
}

using kvtest::gpu_present;

TEST_CASE("cuda::ams_segment_quotas equals ams::segments and ams::quotas", "[agreement][gpu]") {
#if !defined(KVPOLICY_WITH_CUDA)
  WARN("CUDA half skipped: built without CUDA (KVPOLICY_WITH_CUDA undefined)");
#else
  if (!gpu_present()) return;
  // Rows of one call share T, [begin, end) and the parameters: group the cases by those.
  const auto all = make_cases();
  std::size_t checked = 0;
  for (std::size_t g0 = 0; g0 < all.size();) {
    std::size_t g1 = g0 + 1;
    while (g1 < all.size() && all[g1].m.size() == all[g0].m.size() &&
           all[g1].begin == all[g0].begin && all[g1].end == all[g0].end &&
           all[g1].p.segment_mass == all[g0].p.segment_mass)
      ++g1;
    const std::int64_t rows = static_cast<std::int64_t>(g1 - g0);
    const std::int64_t T = static_cast<std::int64_t>(all[g0].m.size());
    const std::int64_t cap = all[g0].end - all[g0].begin + 1;
    std::vector<double> mass;
    std::vector<std::int64_t> budgets;
    for (std::size_t i = g0; i < g1; ++i) {
      mass.insert(mass.end(), all[i].m.begin(), all[i].m.end());
      budgets.push_back(all[i].budget);
    }
    cuda::DeviceBuffer dm(mass.size() * 8), db(budgets.size() * 8), ds(budgets.size() * 8),
        dbeg(static_cast<std::size_t>(rows * cap) * 8), dend(dbeg.bytes()), dq(dbeg.bytes());
    cuda::copy_to_device(dm.data(), mass.data(), dm.bytes());
    cuda::copy_to_device(db.data(), budgets.data(), db.bytes());
    const std::size_t wsb = cuda::ams_rows_workspace_bytes(rows, all[g0].begin, all[g0].end);
    cuda::DeviceBuffer ws(wsb);
    const cuda_backend be{nullptr, ws.data(), wsb};
    const cuda::AmsRows a{dm.as<const double>(), rows, T, T, all[g0].begin, all[g0].end,
                          db.as<const std::int64_t>(), ds.as<std::int64_t>(),
                          dbeg.as<std::int64_t>(), dend.as<std::int64_t>(), dq.as<std::int64_t>()};
    cuda::throw_if_error(cuda::ams_segment_quotas(be, a, all[g0].p), "ams_segment_quotas");
    std::vector<std::int64_t> ns(static_cast<std::size_t>(rows)),
        beg(static_cast<std::size_t>(rows * cap)), end(beg.size()), q(beg.size());
    cuda::copy_to_host(ns.data(), ds.data(), ds.bytes());
    cuda::copy_to_host(beg.data(), dbeg.data(), dbeg.bytes());
    cuda::copy_to_host(end.data(), dend.data(), dend.bytes());
    cuda::copy_to_host(q.data(), dq.data(), dq.bytes());
    for (std::int64_t r = 0; r < rows; ++r) {
      const RowCase& rc = all[g0 + static_cast<std::size_t>(r)];
      const RowResult want = cpu_row(rc);
      INFO("row " << r << " of " << rows << ": T=" << T << " [" << rc.begin << "," << rc.end
                  << ") budget=" << rc.budget << " segment_mass=" << rc.p.segment_mass
                  << " min/max=" << rc.p.min_seg_len << "/" << rc.p.max_seg_len
                  << " min_keep=" << rc.p.min_keep << "; cpu: " << want.segs.size()
                  << " segments, ok=" << want.ok << "; device: "
                  << ns[static_cast<std::size_t>(r)] << " segments");
      if (rc.budget < 0) {  // the kernel's contract (cuda/ams.hpp): a skipped row, no segments
        CHECK(ns[static_cast<std::size_t>(r)] == 0);
        continue;
      }
      if (!want.ok) {
        CHECK(ns[static_cast<std::size_t>(r)] == -1);
        continue;
      }
      REQUIRE(ns[static_cast<std::size_t>(r)] == static_cast<std::int64_t>(want.segs.size()));
      for (std::size_t i = 0; i < want.segs.size(); ++i) {
        const auto at = static_cast<std::size_t>(r * cap) + i;
        CHECK(beg[at] == want.segs[i].begin);
        CHECK(end[at] == want.segs[i].end);
        CHECK(q[at] == want.quota[i]);
      }
      ++checked;
    }
    g0 = g1;
  }
  CHECK(checked > 0);
#endif
}

}  // namespace kvt_agreement_ams_rows
