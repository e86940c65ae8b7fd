// Agreement tests: each CUDA op against its CPU reference, from one source for both back-ends.
// The CPU half always runs: the references against naive versions, the CSR conversions, and the
// key function the CUDA top-k sorts by (select_key, KVP_HD), emulated on the host against
// cpu::select. The CUDA half ([gpu]) runs the same cases through ops:: on a cuda_backend and
// asks for identical kept sets (ties included) and bit-exact compaction; without a GPU, or in a
// build without CUDA, it warns "skipped" and returns.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <kvpolicy/cuda/csr.hpp>
#include <kvpolicy/cuda/select_key.hpp>
#include <kvpolicy/ops.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "agreement/storage.hpp"
#include "common/random.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_agreement {

using namespace kvpolicy;
using Catch::Matchers::Contains;

namespace {

// ---- cases ------------------------------------------------------------------------------------

using kvtest::make_view;
using kvtest::Storage;
using kvtest::storage_name;

enum class BudgetKind { below, equal, above, mixed };

struct Case {
  std::int64_t L, H, T, D;
  Protect protect;
  BudgetKind budget;
};

std::string describe(const Case& c) {
  const char* b[] = {"below", "equal", "above", "mixed"};
  return "L=" + std::to_string(c.L) + " H=" + std::to_string(c.H) + " T=" + std::to_string(c.T) +
         " d=" + std::to_string(c.D) + " sinks=" + std::to_string(c.protect.sinks) +
         " recent=" + std::to_string(c.protect.recent) + " budget " +
         b[static_cast<int>(c.budget)] + " T";
}

// Below / equal / above T, odd head dims (no vector path), rows long enough for several shared
// memory tiles on the device and, at T = 20000, for several rounds of the cluster compaction
// (cuda/compact_math.hpp: 32768 copy units per round; 6686 kept rows of 128 fp32 are 214k 16-byte
// units, 27 rounds of element units in the transposed layout), a row shorter than its protected
// tokens, empty rows.
const std::vector<Case>& cases() {
  static const std::vector<Case> all = {
      {2, 3, 37, 64, {4, 8}, BudgetKind::below},  {2, 3, 37, 64, {4, 8}, BudgetKind::equal},
      {2, 3, 37, 64, {4, 8}, BudgetKind::above},  {2, 3, 37, 7, {4, 8}, BudgetKind::mixed},
      {1, 5, 29, 5, {0, 0}, BudgetKind::mixed},   {3, 2, 700, 128, {4, 16}, BudgetKind::mixed},
      {1, 2, 3000, 16, {1, 32}, BudgetKind::below}, {2, 2, 5, 4, {4, 8}, BudgetKind::below},
      {1, 3, 1, 3, {0, 0}, BudgetKind::mixed},    {2, 2, 0, 8, {4, 8}, BudgetKind::mixed},
      {1, 2, 20000, 128, {4, 16}, BudgetKind::below},
  };
  return all;
}

std::vector<std::int64_t> make_budgets(const Case& c) {
  const std::int64_t n_prot = c.protect.total(c.T);
  const std::int64_t below = std::max(n_prot, std::min(c.T - 1, c.T / 3 + n_prot));
  std::vector<std::int64_t> b(static_cast<std::size_t>(c.L * c.H));
  for (std::size_t r = 0; r < b.size(); ++r) {
    switch (c.budget) {
      case BudgetKind::below: b[r] = below; break;
      case BudgetKind::equal: b[r] = c.T; break;
      case BudgetKind::above: b[r] = c.T + 5; break;
      case BudgetKind::mixed: {
        const std::int64_t pick[] = {below, c.T, c.T + 3, n_prot, std::min(c.T, below + 1)};
        b[r] = std::max<std::int64_t>(0, pick[r % 5]);
        if (b[r] < c.T) b[r] = std::max(b[r], n_prot);
      }
    }
  }
  return b;
}

// Scores on a coarse grid, so many tokens tie and the tie-break decides what is kept.
ScoreMap tied_scores(const Case& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  ScoreMap s(c.L, c.H, c.T);
  for (std::int64_t i = 0; i < c.L * c.H * c.T; ++i)
    s.data()[i] = static_cast<float>(rng.integer(-3, 3)) * 0.25f;
  return s;
}

template <class T>
std::vector<T> random_cache(const Case& c, std::uint64_t seed) {
  kvtest::Rng rng(seed);
  return rng.normals<T>(c.L * c.H * c.T * c.D);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void require_same_selection(const Selection& got, const Selection& want) {
  REQUIRE(got.layers() == want.layers());
  REQUIRE(got.heads() == want.heads());
  for (std::int64_t l = 0; l < want.layers(); ++l)
    for (std::int64_t h = 0; h < want.heads(); ++h) {
      INFO("layer " << l << ", head " << h);
      auto g = got.kept(l, h), w = want.kept(l, h);
      REQUIRE(std::vector<std::int32_t>(g.begin(), g.end()) ==
              std::vector<std::int32_t>(w.begin(), w.end()));
    }
}

// ---- the pipeline under test: written once, against ops::, for any backend ----------------

template <Backend B, class T>
void select_and_compact(const B& be, const ops::scores_t<B>& scores,
                        std::span<const std::int64_t> budgets, Protect p, ops::selection_t<B>& sel,
                        const KVView<T>& keys, const KVView<T>& values) {
  ops::select(be, scores, budgets, p, sel);
  ops::compact(be, keys, sel);
  ops::compact(be, values, sel);
}

// ---- CPU half ---------------------------------------------------------------------------------

// What the CUDA top-k computes, on the host: keys by select_key, the first min(budget, T) of
// each row sorted descending, then ascending indices.
Selection select_by_keys(const ScoreMap& s, std::span<const std::int64_t> budgets, Protect p) {
  const std::int64_t T = s.tokens();
  const cuda::ProtectedSpan span = cuda::protected_span(p.sinks, p.recent, T);
  Selection out(s.layers(), s.heads());
  for (std::int64_t l = 0; l < s.layers(); ++l)
    for (std::int64_t h = 0; h < s.heads(); ++h) {
      auto row = s.row(l, h);
      std::vector<std::uint64_t> keys;
      for (std::int64_t j = 0; j < T; ++j)
        keys.push_back(cuda::select_key(row[static_cast<std::size_t>(j)],
                                        static_cast<std::int32_t>(j), span));
      std::sort(keys.begin(), keys.end(), std::greater<>());
      const std::int64_t n = std::clamp<std::int64_t>(
          budgets[static_cast<std::size_t>(l * s.heads() + h)], 0, T);
      auto& kept = out.kept(l, h);
      for (std::int64_t i = 0; i < n; ++i)
        kept.push_back(topk_key_index(keys[static_cast<std::size_t>(i)]));
      std::sort(kept.begin(), kept.end());
    }
  return out;
}

// Out-of-place gather: the meaning of in-place compaction.
template <class T>
std::vector<T> naive_compact(const std::vector<T>& buf, Storage st, const Case& c,
                             const Selection& sel) {
  std::vector<T> out = buf;
  auto src = make_view(st, buf.data(), c.L, c.H, c.T, c.D);
  auto dst = make_view(st, out.data(), c.L, c.H, c.T, c.D);
  for (std::int64_t l = 0; l < c.L; ++l)
    for (std::int64_t h = 0; h < c.H; ++h) {
      auto kept = sel.kept(l, h);
      for (std::size_t i = 0; i < kept.size(); ++i)
        for (std::int64_t e = 0; e < c.D; ++e)
          dst.at(l, h, static_cast<std::int64_t>(i), e) = src.at(l, h, kept[i], e);
    }
  return out;
}

}  // namespace

TEST_CASE("protected_span matches the CPU reference's protected tokens", "[agreement]") {
  for (std::int64_t T : {0, 1, 5, 12, 40})
    for (std::int64_t sinks : {0, 1, 4, 50})
      for (std::int64_t recent : {0, 3, 8, 60}) {
        INFO("T=" << T << " sinks=" << sinks << " recent=" << recent);
        const auto s = cuda::protected_span(sinks, recent, T);
        CHECK(s.count(T) == Protect{sinks, recent}.total(T));
        std::int64_t n = 0;
        for (std::int64_t j = 0; j < T; ++j) n += s.contains(j);
        CHECK(n == s.count(T));
        for (std::int64_t j = 0; j < std::min(sinks, T); ++j) CHECK(s.contains(j));
        for (std::int64_t j = std::max<std::int64_t>(0, T - recent); j < T; ++j)
          CHECK(s.contains(j));
      }
}

TEST_CASE("select_key puts protected tokens first, then follows topk_key", "[agreement]") {
  const auto span = cuda::protected_span(2, 3, 20);  // protected: 0, 1, 17, 18, 19
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(cuda::select_key(-inf, 0, span) > cuda::select_key(inf, 5, span));
  CHECK(cuda::select_key(-1e30f, 19, span) > cuda::select_key(3e38f, 16, span));
  CHECK(cuda::select_key(1.f, 5, span) == topk_key(1.f, 5));
  CHECK(cuda::select_key(1.f, 9, span) > cuda::select_key(1.f, 5, span));  // tie: later wins
  CHECK(cuda::select_key(2.f, 5, span) > cuda::select_key(1.f, 9, span));
  CHECK(cuda::select_key(-0.f, 6, span) == cuda::select_key(0.f, 6, span));
  for (std::int32_t j : {0, 1, 5, 17, 19})
    CHECK(topk_key_index(cuda::select_key(0.5f, j, span)) == j);
}

TEST_CASE("the CUDA top-k algorithm, emulated on the host, equals cpu::select", "[agreement]") {
  std::uint64_t seed = 1;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const ScoreMap scores = tied_scores(c, seed++);
    const auto budgets = make_budgets(c);
    Selection want;
    cpu::select(cpu_backend{2}, scores, budgets, c.protect, want);
    require_same_selection(select_by_keys(scores, budgets, c.protect), want);
  }
}

TEST_CASE("CSR conversion round-trips a selection and checks its structure", "[agreement]") {
  const Case c{2, 3, 37, 4, {2, 4}, BudgetKind::mixed};
  const auto budgets = make_budgets(c);
  Selection sel;
  cpu::select(cpu_backend{}, tied_scores(c, 5), budgets, c.protect, sel);
  const cuda::HostCsr csr = cuda::to_csr(sel);
  REQUIRE(csr.offsets.size() == 7);
  CHECK(csr.offsets.front() == 0);
  CHECK(csr.offsets.back() == sel.total());
  CHECK(csr.offsets[4] - csr.offsets[3] == sel.count(1, 0));
  require_same_selection(cuda::from_csr(csr), sel);

  cuda::HostCsr bad = csr;
  bad.offsets[2] = bad.offsets[1] - 1;
  CHECK_THROWS_WITH(cuda::from_csr(bad), Contains("csr: row 1"));
  bad = csr;
  bad.offsets.back() += 1;
  CHECK_THROWS_WITH(cuda::from_csr(bad), Contains("outside"));
  bad = csr;
  bad.offsets.pop_back();
  CHECK_THROWS_WITH(cuda::from_csr(bad), Contains("offsets for 6 rows"));
}

TEMPLATE_TEST_CASE("CPU compaction through ops:: equals an out-of-place gather", "[agreement]",
                   float, half, bfloat16) {
  std::uint64_t seed = 100;
  for (const Case& c : cases())
    for (Storage st : {Storage::hnd, Storage::nhd, Storage::hdn}) {
      INFO(describe(c) << " " << storage_name(st));
      const ScoreMap scores = tied_scores(c, seed);
      const auto budgets = make_budgets(c);
      auto k = random_cache<TestType>(c, seed + 1), v = random_cache<TestType>(c, seed + 2);
      ++seed;
      const auto k0 = k, v0 = v;
      Selection sel;
      select_and_compact(cpu_backend{2}, scores, budgets, c.protect, sel,
                         make_view(st, k.data(), c.L, c.H, c.T, c.D),
                         make_view(st, v.data(), c.L, c.H, c.T, c.D));
      CHECK(same_bits(k, naive_compact(k0, st, c, sel)));
      CHECK(same_bits(v, naive_compact(v0, st, c, sel)));
    }
}

#if defined(KVPOLICY_WITH_CUDA)
TEST_CASE("CUDA wrappers reject bad arguments before touching the device", "[agreement][cuda]") {
  const cuda_backend be{};
  std::int64_t offsets[7] = {};
  std::int32_t indices[4] = {};
  cuda::CsrSelection sel{2, 3, offsets, indices, 4};

  SECTION("launch layer returns a status") {
    cuda::RowsView rows{indices, 3, 2, 3, 4, 1, 12, 4, 1, 1};
    CHECK(cuda::compact_rows(be, rows, sel).code == cuda::StatusCode::invalid_argument);
    rows.elem_bytes = 4;
    rows.dim = 100000;
    CHECK(cuda::compact_rows(be, rows, sel).code == cuda::StatusCode::invalid_argument);
    rows.dim = 1;
    rows.layers = 1;
    CHECK(cuda::compact_rows(be, rows, sel).code == cuda::StatusCode::invalid_argument);
    CHECK_THROWS_WITH(cuda::throw_if_error({cuda::StatusCode::invalid_argument, 0, "bad stride"},
                                           "cuda::compact"),
                      Contains("cuda::compact: invalid argument: bad stride"));
  }
  SECTION("compact checks the selection's shape") {
    std::vector<float> k(2 * 2 * 4 * 8);
    auto kv = KVView<float>::hnd(k.data(), 2, 2, 4, 8);
    CHECK_THROWS_WITH(ops::compact(be, kv, sel), Contains("selection is [2,3]"));
  }
  SECTION("select checks budgets and capacity like the CPU path") {
    float scores[2 * 3 * 10] = {};
    const cuda::ScoreView sv{scores, 2, 3, 10, 10};
    const std::vector<std::int64_t> ok = {4, 4, 4, 4, 4, 4};
    std::vector<std::int64_t> low = ok;
    low[4] = 2;
    CHECK_THROWS_WITH(ops::select(be, sv, low, Protect{1, 2}, sel),
                      Contains("budget of 2 tokens is below the 3 protected"));
    CHECK_THROWS_WITH(ops::select(be, sv, ok, Protect{1, 2}, sel),
                      Contains("holds 4 indices but the budgets keep 24"));
    CHECK_THROWS_WITH(ops::select(be, sv, std::span(ok).first(5), Protect{}, sel),
                      Contains("5 budgets for 6"));
    const cuda::ScoreView narrow{scores, 2, 3, 10, 9};
    CHECK_THROWS_WITH(ops::select(be, narrow, ok, Protect{}, sel), Contains("row stride 9"));
  }
}
#endif

// ---- CUDA half ----------------------------------------------------------------------------------

namespace {

using kvtest::gpu_present;

#if defined(KVPOLICY_WITH_CUDA)

using kvtest::download;
using kvtest::upload;

// A device CSR selection with its storage.
struct DeviceSelection {
  cuda::DeviceBuffer offsets, indices;
  cuda::CsrSelection view;

  DeviceSelection(std::int64_t L, std::int64_t H, std::int64_t capacity)
      : offsets(static_cast<std::size_t>(L * H + 1) * sizeof(std::int64_t)),
        indices(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)) * sizeof(std::int32_t)),
        view{L, H, offsets.as<std::int64_t>(), indices.as<std::int32_t>(), capacity} {}
  explicit DeviceSelection(const cuda::HostCsr& c)
      : DeviceSelection(c.layers, c.heads, static_cast<std::int64_t>(c.indices.size())) {
    cuda::copy_to_device(offsets.data(), c.offsets.data(), c.offsets.size() * sizeof(std::int64_t));
    cuda::copy_to_device(indices.data(), c.indices.data(), c.indices.size() * sizeof(std::int32_t));
  }
  Selection to_host() const {
    const std::size_t rows = static_cast<std::size_t>(view.rows());
    auto off = download<std::int64_t>(offsets, rows + 1);
    auto idx = download<std::int32_t>(indices, static_cast<std::size_t>(off.back()));
    return cuda::from_csr(view.layers, view.heads, off, idx);
  }
};

// Scores on the device with a padded row stride (row_stride > tokens is part of the contract).
struct DeviceScores {
  cuda::DeviceBuffer buf;
  cuda::ScoreView view;
  explicit DeviceScores(const ScoreMap& s, std::int64_t pad = 3) {
    const std::int64_t stride = s.tokens() + pad, rows = s.layers() * s.heads();
    std::vector<float> padded(static_cast<std::size_t>(rows * stride), -7.f);
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(s.data() + r * s.tokens(), s.tokens(), padded.begin() + r * stride);
    buf = upload(padded);
    view = {buf.as<const float>(), s.layers(), s.heads(), s.tokens(), stride};
  }
};

cuda_backend backend_with_workspace(cuda::DeviceBuffer& ws, std::int64_t rows,
                                    std::int64_t tokens) {
  ws = cuda::DeviceBuffer(ops::select_workspace_bytes(cuda_backend{}, rows, tokens));
  return cuda_backend{nullptr, ws.data(), ws.bytes()};
}

#endif  // KVPOLICY_WITH_CUDA

}  // namespace

TEST_CASE("CUDA select keeps exactly what cpu::select keeps", "[agreement][gpu]") {
  if (!gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 1;
  for (const Case& c : cases()) {
    INFO(describe(c));
    const ScoreMap scores = tied_scores(c, seed++);
    const auto budgets = make_budgets(c);
    Selection want;
    ops::select(cpu_backend{2}, scores, budgets, c.protect, want);

    cuda::DeviceBuffer ws;
    const cuda_backend be = backend_with_workspace(ws, c.L * c.H, c.T);
    const DeviceScores dscores(scores);
    DeviceSelection got(c.L, c.H, cuda::kept_total(budgets, c.T));
    ops::select(be, dscores.view, std::span<const std::int64_t>(budgets), c.protect, got.view);
    require_same_selection(got.to_host(), want);

    // Budgets already on the device: same result through the same launch path.
    const cuda::DeviceBuffer dbudgets = upload(budgets);
    DeviceSelection got_dev(c.L, c.H, cuda::kept_total(budgets, c.T));
    ops::select(be, dscores.view, dbudgets.as<const std::int64_t>(), c.protect, got_dev.view);
    require_same_selection(got_dev.to_host(), want);
  }
#endif
}

TEMPLATE_TEST_CASE("CUDA compaction is bit-exact with cpu::compact", "[agreement][gpu]", float,
                   half, bfloat16) {
  if (!gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 100;
  for (const Case& c : cases())
    for (Storage st : {Storage::hnd, Storage::nhd, Storage::hdn}) {
      INFO(describe(c) << " " << storage_name(st));
      const ScoreMap scores = tied_scores(c, seed);
      const auto budgets = make_budgets(c);
      const auto k0 = random_cache<TestType>(c, seed + 1), v0 = random_cache<TestType>(c, seed + 2);
      ++seed;

      // CPU reference.
      auto k_cpu = k0, v_cpu = v0;
      Selection sel_cpu;
      select_and_compact(cpu_backend{2}, scores, budgets, c.protect, sel_cpu,
                         make_view(st, k_cpu.data(), c.L, c.H, c.T, c.D),
                         make_view(st, v_cpu.data(), c.L, c.H, c.T, c.D));

      // The same pipeline on the device.
      cuda::DeviceBuffer ws;
      const cuda_backend be = backend_with_workspace(ws, c.L * c.H, c.T);
      const DeviceScores dscores(scores);
      DeviceSelection sel(c.L, c.H, cuda::kept_total(budgets, c.T));
      cuda::DeviceBuffer dk = upload(k0), dv = upload(v0);
      select_and_compact(be, dscores.view, budgets, c.protect, sel.view,
                         make_view(st, dk.as<TestType>(), c.L, c.H, c.T, c.D),
                         make_view(st, dv.as<TestType>(), c.L, c.H, c.T, c.D));
      require_same_selection(sel.to_host(), sel_cpu);
      CHECK(same_bits(download<TestType>(dk, k0.size()), k_cpu));
      CHECK(same_bits(download<TestType>(dv, v0.size()), v_cpu));

      // A selection made on the host and uploaded compacts identically.
      if (st == Storage::hnd) {
        DeviceSelection uploaded(cuda::to_csr(sel_cpu));
        cuda::DeviceBuffer dk2 = upload(k0);
        ops::compact(be, make_view(st, dk2.as<TestType>(), c.L, c.H, c.T, c.D), uploaded.view);
        CHECK(same_bits(download<TestType>(dk2, k0.size()), k_cpu));
      }
    }
#endif
}

TEST_CASE("CUDA per-token state compaction equals cpu::compact_state", "[agreement][gpu]") {
  if (!gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint64_t seed = 300;
  for (const Case& c : cases()) {
    INFO(describe(c));
    Selection sel;
    ops::select(cpu_backend{}, tied_scores(c, seed++), make_budgets(c), c.protect, sel);
    const std::int64_t stride = c.T + 2;  // capacity beyond the live tokens
    const std::size_t n = static_cast<std::size_t>(c.L * c.H * stride);
    kvtest::Rng rng(seed);
    std::vector<float> acc(n);
    std::vector<std::int32_t> pos(n);
    for (std::size_t i = 0; i < n; ++i) {
      acc[i] = rng.normal();
      pos[i] = static_cast<std::int32_t>(i);
    }
    auto acc_cpu = acc;
    auto pos_cpu = pos;
    ops::compact_state(cpu_backend{}, acc_cpu.data(), c.H * stride, stride, sel);
    ops::compact_state(cpu_backend{}, pos_cpu.data(), c.H * stride, stride, sel);

    DeviceSelection dsel(cuda::to_csr(sel));
    cuda::DeviceBuffer dacc = upload(acc), dpos = upload(pos);
    const cuda_backend be{};
    ops::compact_state(be, dacc.as<float>(), c.H * stride, stride, dsel.view);
    ops::compact_state(be, dpos.as<std::int32_t>(), c.H * stride, stride, dsel.view);
    CHECK(same_bits(download<float>(dacc, n), acc_cpu));
    CHECK(same_bits(download<std::int32_t>(dpos, n), pos_cpu));
  }
#endif
}

}  // namespace kvt_agreement_agreement
