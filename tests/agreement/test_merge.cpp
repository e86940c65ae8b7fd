// Agreement of the CUDA semantic merger (cuda/merge.cu) with the CPU merger (Semantic::merge).
// Criterion: bit-identical results -- the same K and V bytes in every row, the same log_count
// bits and the same chunk_end mask -- which holds only if both form the same clusters and
// compute the same means. The CPU half drives the kernel's row logic (gsc::merge_row, KVP_HD)
// through a host emulation of a thread block (every "thread" of each phase in turn, barriers as
// no-ops) with several block sizes; the CUDA half ([gpu]) runs the kernel on the same cases and
// compares bytes (skipped without a GPU or in a build without CUDA).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <kvpolicy/cpu/stages.hpp>  // the CPU ops the stages declare (cpu/fwd.hpp)
#include <kvpolicy/cuda/csr.hpp>
#include <kvpolicy/mergers/gsc_row.hpp>
#include <kvpolicy/mergers/semantic.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/merge.hpp>
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"
#include "mergers/merge_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_merge {

using namespace kvpolicy;
using mtest::Cache;

namespace {

// ---- host emulation of one thread block -------------------------------------------------------

struct HostBlock {
  int threads = 1;
  template <class F>
  void par(F&& f) const {
    for (int t = 0; t < threads; ++t) f(t, threads);
  }
  template <class F>
  void single(F&& f) const {
    f();
  }
  void sync() const {}
  void atomic_add(int* p, int v) const { *p += v; }
};

template <class E>
struct HostElem {
  static double load(const void* p, std::int64_t i) {
    return static_cast<double>(to_float(static_cast<const E*>(p)[i]));
  }
  static void store(void* p, std::int64_t i, float x) { static_cast<E*>(p)[i] = from_float<E>(x); }
};

template <class E>
gsc::Rows rows_of(const KVView<E>& v) {
  return {v.data, v.stride_layer, v.stride_head, v.stride_token, v.stride_dim};
}

// The kernel's grid on the host: each row run as one block of `threads` threads.
template <class E>
void emulate(const Semantic& s, const MergeArgs<E>& a, int threads) {
  const cuda::HostCsr csr = cuda::to_csr(*a.selection);
  gsc::Geometry g;
  g.layers = a.keys.layers;
  g.heads = a.keys.heads;
  g.tokens = a.keys.tokens;
  g.dim = a.keys.dim;
  g.keys = rows_of(a.keys);
  g.values = rows_of(a.values);
  g.scores = a.scores->data();
  g.score_stride = g.tokens;
  g.log_count = a.log_count;
  g.log_count_stride = a.log_count_stride > 0 ? a.log_count_stride : g.tokens;
  g.kept_offsets = csr.offsets.data();
  g.kept_indices = csr.indices.data();
  g.sinks = a.protect.sinks;
  g.recent = a.protect.recent;
  g.delimiter = a.delimiter;
  g.delimiter_stride = a.delimiter_stride;
  g.chunk_end = a.chunk_end;
  g.chunk_end_stride = a.chunk_end_stride > 0 ? a.chunk_end_stride : g.tokens;
  gsc::Params p;
  p.tau = s.tau;
  p.chunk = s.chunk;
  p.importance = s.weight == MergeWeight::importance;
  std::vector<std::uint64_t> scratch(
      static_cast<std::size_t>(gsc::scratch_row_bytes(g.tokens) / 8 + 1));
  std::vector<double> seed(static_cast<std::size_t>(g.dim));
  for (std::int64_t r = 0; r < g.layers * g.heads; ++r) {
    gsc::Shared sh{0, 0, 0, seed.data()};
    gsc::merge_row<HostElem<E>>(HostBlock{threads}, p, g, r,
                                gsc::scratch_at(scratch.data(), g.tokens), sh);
  }
}

// ---- cases ------------------------------------------------------------------------------------

enum class Keys { random, clustered, identical, zeros };
enum class Mask { none, shared, per_row };
enum class Ends { none, separate, alias };

struct MCase {
  std::int64_t L, H, T, d;
  Protect protect;
  float tau;
  std::int64_t chunk;
  Mask mask;
  Ends ends;
  MergeWeight weight;
  std::int64_t max_count;  // prior counts in [1, max_count]
  Keys keys;
  bool odd_scores;  // negative, -inf and tied scores (the importance -> mean fallback)
  std::uint64_t seed;
};

std::string describe(const MCase& c) {
  const char* k[] = {"random", "clustered", "identical", "zeros"};
  const char* m[] = {"none", "shared", "per-row"};
  const char* e[] = {"none", "separate", "alias"};
  return "L=" + std::to_string(c.L) + " H=" + std::to_string(c.H) + " T=" + std::to_string(c.T) +
         " d=" + std::to_string(c.d) + " sinks=" + std::to_string(c.protect.sinks) +
         " recent=" + std::to_string(c.protect.recent) + " tau=" + std::to_string(c.tau) +
         " chunk=" + std::to_string(c.chunk) + " mask=" + m[int(c.mask)] +
         " chunk_end=" + e[int(c.ends)] +
         (c.weight == MergeWeight::mean ? " mean" : " importance") +
         " max_count=" + std::to_string(c.max_count) + " keys=" + k[int(c.keys)] +
         (c.odd_scores ? " odd-scores" : "") + " seed=" + std::to_string(c.seed);
}

// Random cases that between them cover every option (tau 1, 0.9, 0.5, 0, -1; each key kind,
// mask kind, chunk_end kind, weight; prior counts; odd scores); a per-row mask needs T.
std::vector<MCase> make_cases(int n) {
  std::vector<MCase> out;
  kvtest::Rng rng(2026);
  const float taus[] = {1.f, 0.9f, 0.5f, 0.f, -1.f, 0.3f};
  for (int i = 0; i < n; ++i) {
    MCase c{};
    c.L = rng.integer(1, 2);
    c.H = rng.integer(1, 3);
    c.T = rng.integer(1, 90);
    c.d = i % 3 == 0 ? 4 : (i % 3 == 1 ? 16 : 7);
    c.protect = {rng.integer(0, 3), rng.integer(0, 6)};
    c.tau = taus[i % 6];
    c.mask = static_cast<Mask>((i / 6) % 3);
    c.chunk = c.mask == Mask::none ? rng.integer(1, 40) : (i % 4 == 0 ? 0 : rng.integer(1, 40));
    c.ends = static_cast<Ends>((i / 18) % 3);
    if (c.ends == Ends::alias && c.mask != Mask::per_row) c.ends = Ends::separate;
    c.weight = (i / 2) % 2 ? MergeWeight::mean : MergeWeight::importance;
    c.max_count = (i / 5) % 2 ? 7 : 1;
    c.keys = static_cast<Keys>((i / 3) % 4);
    c.odd_scores = i % 7 == 3;
    c.seed = 100 + static_cast<std::uint64_t>(i);
    out.push_back(c);
  }
  return out;
}

template <class E>
Cache<E> make_cache(const MCase& mc) {
  kvtest::Rng rng(mc.seed);
  Cache<E> c(mc.L, mc.H, mc.T, mc.d);
  c.randomize(rng);
  c.protect = mc.protect;
  c.randomize_scores(rng, mc.max_count);
  const std::int64_t R = mc.L * mc.H;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t l = r / mc.H, h = r % mc.H;
    if (mc.keys == Keys::clustered) {
      // Three directions per row plus noise: cosines spread over (-1, 1], many near 1.
      std::vector<float> base(static_cast<std::size_t>(3 * mc.d));
      for (auto& x : base) x = rng.normal();
      for (std::int64_t t = 0; t < mc.T; ++t) {
        const auto b = static_cast<std::size_t>(rng.integer(0, 2) * mc.d);
        const float noise = static_cast<float>(rng.uniform(0.0, 0.8));
        const float scale = static_cast<float>(rng.uniform(0.5, 2.0));
        for (std::int64_t x = 0; x < mc.d; ++x)
          c.key(l, h, t, x) = from_float<E>(scale * base[b + static_cast<std::size_t>(x)] +
                                            noise * rng.normal());
      }
    } else if (mc.keys == Keys::identical || mc.keys == Keys::zeros) {
      // Copies of a few keys (cosine exactly 1), or zero keys among random ones.
      for (std::int64_t t = 0; t < mc.T; ++t) {
        if (rng.integer(0, 2) == 0) continue;
        const std::int64_t src = rng.integer(0, std::min<std::int64_t>(mc.T - 1, 3));
        for (std::int64_t x = 0; x < mc.d; ++x)
          c.key(l, h, t, x) =
              mc.keys == Keys::zeros ? from_float<E>(0.f) : c.key(l, h, src, x);
      }
    }
    if (mc.odd_scores) {
      auto row = c.scores.row(l, h);
      for (auto& s : row) {
        const auto k = rng.integer(0, 9);
        if (k == 0) s = -std::numeric_limits<float>::infinity();
        else if (k == 1) s = -0.25f;
        else if (k < 5) s = 0.5f;  // ties: broken by index
      }
    }
  }
  if (mc.mask != Mask::none) {
    const std::int64_t n = mc.mask == Mask::shared ? mc.T : R * mc.T;
    c.delimiter.assign(static_cast<std::size_t>(n), 0);
    for (auto& m : c.delimiter) m = rng.integer(0, 5) == 0 ? 1 : 0;
    c.delimiter_stride = mc.mask == Mask::shared ? 0 : mc.T;
  }
  // Per-row budgets: below, at and (sometimes) above T, so some rows evict nothing.
  std::vector<std::int64_t> b(static_cast<std::size_t>(R));
  const std::int64_t prot = mc.protect.total(mc.T);
  for (auto& x : b) x = rng.integer(0, 5) == 0 ? mc.T + rng.integer(0, 2) : rng.integer(prot, mc.T);
  cpu::select(cpu_backend{1}, c.scores, b, c.protect, c.sel);
  return c;
}

// Cache plus the chunk_end output the case asks for.
template <class E>
struct Run {
  Cache<E> c;
  std::vector<std::uint8_t> ends;
  MergeArgs<E> args() {
    MergeArgs<E> a = c.args();
    if (!ends.empty()) a.chunk_end = ends.data();
    else if (a.delimiter && a.delimiter_stride > 0 && alias) a.chunk_end = c.delimiter.data();
    return a;
  }
  bool alias = false;
};

template <class E>
Run<E> make_run(const MCase& mc) {
  Run<E> r{make_cache<E>(mc), {}};
  if (mc.ends == Ends::separate)
    r.ends.assign(static_cast<std::size_t>(mc.L * mc.H * mc.T), 0xAB);  // evicted slots kept
  r.alias = mc.ends == Ends::alias;
  return r;
}

Semantic semantic_of(const MCase& mc) {
  Semantic s;
  s.tau = mc.tau;
  s.chunk = mc.chunk;
  s.weight = mc.weight;
  return s;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Rows whose log_count changed: cores formed (guards against cases that merge nothing).
std::int64_t cores_formed(const std::vector<float>& before, const std::vector<float>& after) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < before.size(); ++i) n += before[i] != after[i];
  return n;
}

template <class E>
void check_bytes(Run<E>& got, Run<E>& want) {
  CHECK(same_bytes(got.c.k, want.c.k));
  CHECK(same_bytes(got.c.v, want.c.v));
  CHECK(same_bytes(got.c.lc, want.c.lc));
  CHECK(same_bytes(got.ends, want.ends));
  CHECK(same_bytes(got.c.delimiter, want.c.delimiter));  // the aliased chunk_end
}

template <class E>
void emulation_agrees(int n_cases) {
  std::int64_t cores = 0, cases_with_cores = 0, tau1_cores = 0, tau0_cores = 0;
  for (const MCase& mc : make_cases(n_cases)) {
    INFO(describe(mc));
    const Semantic s = semantic_of(mc);
    Run<E> want = make_run<E>(mc);
    const std::vector<float> lc0 = want.c.lc;
    s.merge(cpu_backend{1}, want.args());
    const std::int64_t formed = cores_formed(lc0, want.c.lc);
    cores += formed;
    cases_with_cores += formed > 0;
    if (mc.tau == 1.f) tau1_cores += formed;
    if (mc.tau == 0.f) tau0_cores += formed;
    for (int threads : {1, 5, 128}) {
      INFO("threads=" << threads);
      Run<E> got = make_run<E>(mc);
      emulate(s, got.args(), threads);
      check_bytes(got, want);
    }
  }
  // The cases are not vacuous: most of them form cores, tau 1 and tau 0 among them.
  INFO("cores=" << cores << " cases with cores=" << cases_with_cores);
  CHECK(cases_with_cores * 2 > n_cases);
  CHECK(tau1_cores > 0);
  CHECK(tau0_cores > tau1_cores);
}

}  // namespace

TEST_CASE("merge agreement: gsc helpers follow the CPU rule", "[agreement]") {
  // Identical keys have cosine exactly 1 and merge at tau = 1; zero keys merge only with zero keys.
  const double k[] = {0.3, -1.7, 2.5};
  double dot = 0, n2 = 0;
  for (double x : k) dot = gsc::add_product(dot, x, x), n2 = gsc::add_product(n2, x, x);
  CHECK(gsc::similar(dot, n2, n2, 1.f));
  CHECK(gsc::similar(0.0, 0.0, 0.0, 1.f));
  CHECK_FALSE(gsc::similar(0.0, 0.0, n2, 0.f + 1e-6f));
  CHECK(gsc::similar(0.0, 0.0, n2, 0.f));  // cosine 0 >= tau 0
  CHECK_FALSE(gsc::similar(-n2, n2, n2, -0.5f));
  CHECK(gsc::similar(-n2, n2, n2, -1.f));
  // Slack: a cosine 1e-10 below tau still passes, 1e-8 below does not.
  CHECK(gsc::similar(0.5 - 1e-10, 1.0, 1.0, 0.5f));
  CHECK_FALSE(gsc::similar(0.5 - 1e-8, 1.0, 1.0, 0.5f));
  CHECK(gsc::count_of(0.f) == 1.0);
  CHECK(gsc::count_of(static_cast<float>(std::log(7.0))) == 7.0);
  CHECK(gsc::log_count_of(7.0) == static_cast<float>(std::log(7.0)));
  // Chunks: delimiter, cap, end of row.
  const std::uint8_t mask[] = {0, 0, 1, 0, 0, 0, 0, 0};
  CHECK(gsc::chunk_last(mask, 0, 0, 8) == 2);
  CHECK(gsc::chunk_last(mask, 0, 3, 8) == 7);
  CHECK(gsc::chunk_last(mask, 3, 3, 8) == 5);
  CHECK(gsc::chunk_last(nullptr, 2, 0, 8) == 1);
  CHECK(gsc::chunk_last(nullptr, 20, 4, 8) == 7);
  // Weight rule: importance while every score is finite and >= 0 with a positive sum.
  gsc::CoreStats st;
  st.importance = true;
  gsc::core_stats_add(st, true, 0.5f, 2.0);
  gsc::core_stats_add(st, false, 0.25f, 3.0);
  CHECK(st.any);
  CHECK(gsc::core_uses_importance(st));
  CHECK(st.wsum == 1.75);
  CHECK(st.count == 5.0);
  gsc::core_stats_add(st, false, -0.1f, 1.0);
  CHECK_FALSE(gsc::core_uses_importance(st));
  gsc::CoreStats zero;
  zero.importance = true;
  gsc::core_stats_add(zero, true, 0.f, 1.0);
  gsc::core_stats_add(zero, false, 0.f, 1.0);
  CHECK_FALSE(gsc::core_uses_importance(zero));  // all-zero scores: mean
  CHECK(gsc::member_weight(true, 3.0, 0.5f) == 1.5);
  CHECK(gsc::member_weight(false, 3.0, 0.5f) == 3.0);
}

TEST_CASE("merge agreement: emulated kernel rows are bit-identical to the CPU merger (float)",
          "[agreement]") {
  emulation_agrees<float>(216);
}

TEST_CASE("merge agreement: emulated kernel rows are bit-identical to the CPU merger (half)",
          "[agreement]") {
  emulation_agrees<half>(108);
}

TEST_CASE("merge agreement: emulated kernel rows are bit-identical to the CPU merger (bfloat16)",
          "[agreement]") {
  emulation_agrees<bfloat16>(54);
}

TEST_CASE("merge agreement: identical tokens form one core per group at tau 1", "[agreement]") {
  // Row of 12 tokens, keys in two groups of identical keys (tokens 1..5 and 6..11, token 0 a
  // sink); the selection keeps the best of each group, so each group becomes one core.
  Cache<float> c(1, 1, 12, 4);
  kvtest::Rng rng(5);
  c.randomize(rng);
  for (std::int64_t t = 1; t < 12; ++t)
    for (std::int64_t x = 0; x < 4; ++x) c.key(0, 0, t, x) = c.key(0, 0, t < 6 ? 1 : 6, x);
  c.protect = {1, 0};
  for (std::int64_t t = 0; t < 12; ++t) c.scores.row(0, 0)[static_cast<std::size_t>(t)] = 0.1f * float(t % 5);
  c.sel = Selection(1, 1);
  c.sel.kept(0, 0) = {0, 4, 9};
  const Semantic s = mtest::semantic(1.f, 12);
  Cache<float> want = c;
  s.merge(cpu_backend{1}, want.args());
  emulate(s, c.args(), 32);
  CHECK(same_bytes(c.k, want.k));
  CHECK(same_bytes(c.v, want.v));
  CHECK(same_bytes(c.lc, want.lc));
  CHECK(c.count(0, 0, 4) == Approx(5.0));
  CHECK(c.count(0, 0, 9) == Approx(6.0));
  CHECK(c.count(0, 0, 0) == Approx(1.0));
}

#if defined(KVPOLICY_WITH_CUDA)
namespace {
using kvtest::download;
using kvtest::gpu_present;
using kvtest::upload;

template <class E>
void device_agrees(int n_cases) {
  for (const MCase& mc : make_cases(n_cases)) {
    INFO(describe(mc));
    const Semantic s = semantic_of(mc);
    Run<E> want = make_run<E>(mc);
    s.merge(cpu_backend{1}, want.args());

    Run<E> got = make_run<E>(mc);
    Cache<E>& c = got.c;
    const cuda::HostCsr csr = cuda::to_csr(c.sel);
    auto dk = upload(c.k), dv = upload(c.v), dlc = upload(c.lc), dsc = upload(std::vector<float>(
        c.scores.data(), c.scores.data() + c.L * c.H * c.T));
    auto doff = upload(csr.offsets), didx = upload(csr.indices);
    auto ddelim = upload(c.delimiter), dends = upload(got.ends);
    cuda::DeviceMergeArgs<E> a;
    a.keys = KVView<E>::hnd(dk.template as<E>(), c.L, c.H, c.T, c.d);
    a.values = KVView<E>::hnd(dv.template as<E>(), c.L, c.H, c.T, c.d);
    a.selection = {c.L, c.H, doff.template as<std::int64_t>(), didx.template as<std::int32_t>(),
                   static_cast<std::int64_t>(csr.indices.size())};
    a.scores = {dsc.template as<float>(), c.L, c.H, c.T, c.T};
    a.log_count = dlc.template as<float>();
    a.protect = c.protect;
    if (!c.delimiter.empty()) {
      a.delimiter = ddelim.template as<std::uint8_t>();
      a.delimiter_stride = c.delimiter_stride;
      if (got.alias) a.chunk_end = ddelim.template as<std::uint8_t>();
    }
    if (!got.ends.empty()) a.chunk_end = dends.template as<std::uint8_t>();
    cuda::DeviceBuffer ws(std::max<std::size_t>(1, cuda::semantic_merge_workspace_bytes(a.keys)));
    cuda_backend be{nullptr, ws.data(), ws.bytes()};
    cuda::merge(be, s, a);
    cuda::synchronize();
    c.k = download<E>(dk, c.k.size());
    c.v = download<E>(dv, c.v.size());
    c.lc = download<float>(dlc, c.lc.size());
    c.delimiter = download<std::uint8_t>(ddelim, c.delimiter.size());
    got.ends = download<std::uint8_t>(dends, got.ends.size());
    check_bytes(got, want);
  }
}
}  // namespace
#endif

TEST_CASE("merge agreement: CUDA semantic merge is bit-identical to the CPU merger",
          "[agreement][gpu]") {
#if defined(KVPOLICY_WITH_CUDA)
  if (!gpu_present()) return;
  device_agrees<float>(216);
  device_agrees<half>(108);
  device_agrees<bfloat16>(54);
#else
  WARN("CUDA half skipped: built without CUDA (KVPOLICY_WITH_CUDA undefined)");
#endif
}

TEST_CASE("merge agreement: the CUDA entry points reject bad arguments before any launch",
          "[agreement]") {
#if defined(KVPOLICY_WITH_CUDA)
  // Host pointers stand in for device ones: every check below fails before a kernel is launched,
  // so this runs without a GPU.
  std::vector<float> k(2 * 3 * 10 * 4), v(k.size()), lc(2 * 3 * 10), sc(lc.size());
  std::vector<std::int64_t> off(7, 0);
  std::vector<std::int32_t> idx(1, 0);
  cuda::SemanticMergeArgs a;
  a.keys = {k.data(), 4, 2, 3, 10, 4, 120, 40, 4, 1};
  a.values = {v.data(), 4, 2, 3, 10, 4, 120, 40, 4, 1};
  a.selection = {2, 3, off.data(), idx.data(), 1};
  a.scores = sc.data();
  a.log_count = lc.data();
  gsc::Params p;
  cuda_backend be;  // no workspace
  CHECK(cuda::semantic_merge(be, p, a).code == cuda::StatusCode::insufficient_workspace);
  CHECK(cuda::semantic_merge_workspace_bytes(6, 10) ==
        static_cast<std::size_t>(6 * gsc::scratch_row_bytes(10)));
  CHECK(cuda::semantic_merge_workspace_bytes(1000, 10) ==
        static_cast<std::size_t>(cuda::semantic_merge_max_blocks * gsc::scratch_row_bytes(10)));
  CHECK(gsc::scratch_row_bytes(10) == 16 * 17);
  a.type = DType::f16;  // 4-byte elements
  CHECK(cuda::semantic_merge(be, p, a).code == cuda::StatusCode::invalid_argument);
  a.type = DType::f32;
  p.chunk = 0;  // no mask
  CHECK(cuda::semantic_merge(be, p, a).code == cuda::StatusCode::invalid_argument);
  p.chunk = 32;
  a.selection.heads = 2;
  CHECK(cuda::semantic_merge(be, p, a).code == cuda::StatusCode::invalid_argument);
  a.selection.heads = 3;
  a.log_count = nullptr;
  CHECK(cuda::semantic_merge(be, p, a).code == cuda::StatusCode::invalid_argument);
  a.keys.tokens = a.values.tokens = 0;  // nothing to do: success without a launch
  CHECK(cuda::semantic_merge(be, p, a).ok());

  // The typed wrapper: Semantic's own checks and the chunk_end alias rule.
  cuda::DeviceMergeArgs<float> t;
  t.keys = KVView<float>::hnd(k.data(), 2, 3, 10, 4);
  t.values = KVView<float>::hnd(v.data(), 2, 3, 10, 4);
  t.selection = {2, 3, off.data(), idx.data(), 1};
  t.scores = {sc.data(), 2, 3, 10, 10};
  t.log_count = lc.data();
  Semantic s;
  s.chunk = 0;
  CHECK_THROWS_WITH(cuda::merge(be, s, t), Catch::Contains("chunk must be > 0"));
  std::vector<std::uint8_t> mask(10, 0);
  t.delimiter = mask.data();
  t.chunk_end = mask.data();  // aliases a shared mask over 6 rows
  CHECK_THROWS_WITH(cuda::merge(be, s, t), Catch::Contains("alias"));
  t.chunk_end = nullptr;
  t.scores.tokens = 9;
  CHECK_THROWS_WITH(cuda::merge(be, s, t), Catch::Contains("scores"));
  t.scores.tokens = 10;
  CHECK_THROWS_WITH(cuda::merge(be, s, t), Catch::Contains("insufficient workspace"));
#else
  WARN("CUDA half skipped: built without CUDA (KVPOLICY_WITH_CUDA undefined)");
#endif
}

}  // namespace kvt_agreement_merge
