// Agreement of the CUDA paged gather-compact (cuda/paged.cu) with kvpolicy::paged_compact and
// kvpolicy::paged_gather. The CPU half drives the kernels' per-thread functions
// (cuda/paged_plan.hpp) in a host loop that emulates the grid -- including adversarial
// interleavings of the chunks' reads and writes that respect only the kernel's flag waits -- and
// asks for a pool bit-identical to the CPU reference, on random shuffled block tables, partial
// pages, NHD/HND, float/half and several copy units. The [gpu] half runs the kernels.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <kvpolicy/cuda/csr.hpp>
#include <kvpolicy/cuda/paged.hpp>
#include <kvpolicy/paged.hpp>
#if defined(KVPOLICY_WITH_CUDA)
#include <kvpolicy/cuda/runtime.hpp>
#endif

#include "agreement/gpu_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_agreement_paged {

using namespace kvpolicy;

namespace {

// A pool of R requests with disjoint, shuffled block tables (plus unused blocks), random data.
template <class T>
struct Scenario {
  std::int64_t num_blocks = 0, L = 0, H = 0, P = 0, D = 0;
  Layout layout = Layout::HND;
  std::vector<T> keys, values;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<Selection> sels;

  PagedKVView<T> view(std::vector<T>& buf) {
    return PagedKVView<T>::make(layout, buf.data(), num_blocks, L, H, P, D);
  }
  PagedSequence seq(std::size_t q) const { return {tables[q], lengths[q]}; }
};

enum class Keep { random, all, none, prefix, sparse };

template <class T>
Scenario<T> make_scenario(std::uint32_t seed, std::int64_t R, std::int64_t L, std::int64_t H,
                          std::int64_t P, std::int64_t D, std::int64_t max_len, Layout layout,
                          Keep keep) {
  std::mt19937 rng(seed);
  Scenario<T> s;
  s.L = L, s.H = H, s.P = P, s.D = D, s.layout = layout;
  std::int64_t pages = 0;
  for (std::int64_t q = 0; q < R; ++q) {
    const std::int64_t len = std::uniform_int_distribution<std::int64_t>(0, max_len)(rng);
    s.lengths.push_back(len);
    pages += (len + P - 1) / P + 1;  // one padding entry past the sequence's pages
  }
  s.num_blocks = pages + 3;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(s.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  std::size_t next = 0;
  for (std::int64_t q = 0; q < R; ++q) {
    const std::int64_t n = (s.lengths[static_cast<std::size_t>(q)] + P - 1) / P + 1;
    s.tables.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(next),
                          ids.begin() + static_cast<std::ptrdiff_t>(next + n));
    next += static_cast<std::size_t>(n);
  }
  const auto elems = static_cast<std::size_t>(s.num_blocks * L * H * P * D);
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < elems; ++i) s.keys.push_back(from_float<T>(nd(rng)));
  for (std::size_t i = 0; i < elems; ++i) s.values.push_back(from_float<T>(nd(rng)));
  for (std::int64_t q = 0; q < R; ++q) {
    const std::int64_t len = s.lengths[static_cast<std::size_t>(q)];
    Selection sel(L, H);
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h) {
        auto& k = sel.kept(l, h);
        const std::int64_t pre = std::uniform_int_distribution<std::int64_t>(0, len)(rng);
        const float frac = std::uniform_real_distribution<float>(0.f, 1.f)(rng);
        for (std::int32_t t = 0; t < len; ++t) {
          bool take = false;
          switch (keep) {
            case Keep::all: take = true; break;
            case Keep::none: take = false; break;
            case Keep::prefix: take = t < pre; break;
            case Keep::sparse: take = rng() % 9 == 0; break;
            case Keep::random: take = t < pre / 4 || std::uniform_real_distribution<float>()(rng) < frac; break;
          }
          if (take) k.push_back(t);
        }
      }
    s.sels.push_back(std::move(sel));
  }
  return s;
}

// Flattened device-style arguments (what the kernel receives), on the host.
struct Flat {
  std::vector<std::int32_t> ids;
  std::vector<std::int64_t> table_offsets{0};
  cuda::HostCsr csr;
  std::int64_t max_tokens = 0;
};

template <class T>
Flat flatten(const Scenario<T>& s) {
  Flat f;
  f.csr.layers = static_cast<std::int64_t>(s.sels.size()) * s.L;
  f.csr.heads = s.H;
  f.csr.offsets.push_back(0);
  for (std::size_t q = 0; q < s.sels.size(); ++q) {
    f.ids.insert(f.ids.end(), s.tables[q].begin(), s.tables[q].end());
    f.table_offsets.push_back(static_cast<std::int64_t>(f.ids.size()));
    const cuda::HostCsr c = cuda::to_csr(s.sels[q]);
    for (std::size_t r = 1; r < c.offsets.size(); ++r)
      f.csr.offsets.push_back(f.csr.offsets.back() + c.offsets[r] - c.offsets[r - 1]);
    f.csr.indices.insert(f.csr.indices.end(), c.indices.begin(), c.indices.end());
    f.max_tokens = std::max(f.max_tokens, s.lengths[q]);
  }
  return f;
}

// Pool geometry in units of U (the kernel's pick: U must divide row, strides and base).
template <class T, class U>
cuda::PagedGeometry unit_geometry(const PagedKVView<T>& v) {
  const std::int64_t eb = sizeof(T), u = sizeof(U);
  cuda::PagedGeometry g;
  g.layers = v.layers, g.heads = v.heads, g.page_size = v.page_size;
  g.stride_layer = v.stride_layer * eb / u;
  g.stride_block = v.stride_block * eb / u;
  g.stride_head = v.stride_head * eb / u;
  g.stride_token = v.stride_token * eb / u;
  g.stride_col = 1;
  g.row_units = v.dim * eb / u;
  return g;
}

enum class Schedule { random, adversarial };

// Emulates paged_compact_kernel on one pool: work items (thread blocks) take tickets in order;
// once started, an item reads its chunk's units into its tile, then writes them once the items
// named by paged_chunk_waits have read (the flag spin; skipped when honor_waits is false).
// random: any enabled action at random. adversarial: every ticket first, then the highest item
// that may write writes, else the highest unread item reads -- later chunks write as early as
// the waits allow, before earlier chunks read.
template <class U>
void emulate_compact(U* pool, const cuda::PagedGeometry& g, const Flat& f, std::int64_t C,
                     std::uint32_t seed, bool honor_waits, Schedule sched) {
  const std::int64_t rows = f.csr.layers * f.csr.heads;
  const std::int64_t cpr = f.max_tokens > 0 ? (f.max_tokens + C - 1) / C : 0;
  const std::int64_t items = rows * cpr;
  std::vector<int> state(static_cast<std::size_t>(items), 0);  // 0 fresh, 1 read, 2 done
  std::vector<std::vector<U>> tiles(static_cast<std::size_t>(items));
  std::vector<cuda::PagedItem> its;
  for (std::int64_t w = 0; w < items; ++w)
    its.push_back(cuda::paged_item(g, w, cpr, C, f.ids.data(), f.table_offsets.data(),
                                   f.csr.offsets.data(), f.csr.indices.data()));
  std::mt19937 rng(seed);
  std::int64_t started = sched == Schedule::adversarial ? items : 0, done = 0;
  auto can_write = [&](std::int64_t w) {
    const auto& it = its[static_cast<std::size_t>(w)];
    if (!honor_waits || !it.moves) return true;
    const auto r = cuda::paged_chunk_waits(it.kept, it.n, C, it.j);
    for (std::int64_t k = r.first; k <= r.last; ++k)
      if (state[static_cast<std::size_t>(it.row * cpr + k)] == 0) return false;
    return true;
  };
  while (done < items) {
    std::vector<std::int64_t> writable, readable;
    for (std::int64_t w = 0; w < started; ++w) {
      const int st = state[static_cast<std::size_t>(w)];
      if (st == 0) readable.push_back(w);
      else if (st == 1 && can_write(w)) writable.push_back(w);
    }
    std::int64_t w = -1;
    bool write = false;
    if (sched == Schedule::adversarial) {
      REQUIRE((!writable.empty() || !readable.empty()));  // stuck = a deadlock on the device
      if (!writable.empty()) w = writable.back(), write = true;
      else w = readable.back();
    } else {
      const std::size_t choices = writable.size() + readable.size() + (started < items ? 1 : 0);
      REQUIRE(choices > 0);
      const std::size_t c = rng() % choices;
      if (c < writable.size()) w = writable[c], write = true;
      else if (c < writable.size() + readable.size()) w = readable[c - writable.size()];
      else {
        ++started;  // takes its ticket
        continue;
      }
    }
    const auto& it = its[static_cast<std::size_t>(w)];
    auto& tile = tiles[static_cast<std::size_t>(w)];
    const std::int64_t units = it.nt * g.row_units;
    if (!write) {
      tile.resize(static_cast<std::size_t>(units));
      if (it.moves)
        for (std::int64_t e = 0; e < units; ++e)
          cuda::paged_chunk_read(g, static_cast<const U*>(pool), it.table, it.l, it.h, it.kept,
                                 it.t0, e, tile.data());
      state[static_cast<std::size_t>(w)] = 1;
    } else {
      if (it.moves)
        for (std::int64_t e = 0; e < units; ++e)
          cuda::paged_chunk_write(g, pool, it.table, it.l, it.h, it.kept, it.t0, e, tile.data());
      state[static_cast<std::size_t>(w)] = 2;
      ++done;
    }
  }
}

struct Unit16 {
  std::uint64_t lo, hi;
};

template <class T>
void cpu_reference(Scenario<T>& s, std::vector<T>& keys, std::vector<T>& values) {
  const cpu_backend be{1};
  for (std::size_t q = 0; q < s.sels.size(); ++q) {
    const auto res = kvpolicy::paged_compact(be, s.view(keys), s.view(values), s.seq(q), s.sels[q]);
    REQUIRE(res.compacted);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <class T, class U>
void check_emulated(Scenario<T> s, std::int64_t C, std::uint32_t seed, Schedule sched) {
  std::vector<T> rk = s.keys, rv = s.values;
  cpu_reference(s, rk, rv);
  const Flat f = flatten(s);
  std::vector<T> ek = s.keys, ev = s.values;
  const auto gk = unit_geometry<T, U>(s.view(ek));
  emulate_compact(reinterpret_cast<U*>(ek.data()), gk, f, C, seed, true, sched);
  emulate_compact(reinterpret_cast<U*>(ev.data()), gk, f, C, seed + 1, true, sched);
  CHECK(same_bits(ek, rk));
  CHECK(same_bits(ev, rv));
}

struct Shape {
  std::int64_t R, L, H, P, D, max_len;
};

const Shape shapes[] = {
    {1, 2, 3, 16, 8, 100},  // partial last pages
    {3, 1, 2, 4, 16, 57},   // several requests
    {2, 2, 1, 1, 4, 40},    // page size 1
    {1, 1, 2, 7, 6, 300},   // odd page size and head dim
};

template <class T>
void emulated_cases() {
  const Keep keeps[] = {Keep::random, Keep::all, Keep::none, Keep::prefix, Keep::sparse};
  const Layout layouts[] = {Layout::HND, Layout::NHD};
  std::uint32_t seed = 1;
  for (const Shape& sh : shapes)
    for (Layout lay : layouts)
      for (Keep k : keeps)
        for (std::int64_t C : {1, 3, 16, 128}) {
          ++seed;
          INFO("R=" << sh.R << " L=" << sh.L << " H=" << sh.H << " P=" << sh.P << " D=" << sh.D
                    << (lay == Layout::HND ? " HND" : " NHD") << " keep=" << static_cast<int>(k)
                    << " C=" << C << " seed=" << seed);
          auto s = make_scenario<T>(seed, sh.R, sh.L, sh.H, sh.P, sh.D, sh.max_len, lay, k);
          for (Schedule sc : {Schedule::random, Schedule::adversarial}) {
            check_emulated<T, T>(s, C, seed * 7, sc);
            // Wider copy units where the row allows (the kernel's pick_unit).
            if ((sh.D * sizeof(T)) % 8 == 0) check_emulated<T, std::uint64_t>(s, C, seed * 11, sc);
            if ((sh.D * sizeof(T)) % 16 == 0) check_emulated<T, Unit16>(s, C, seed * 13, sc);
          }
        }
}

}  // namespace

TEST_CASE("paged_compact emulated grid is bit-identical to kvpolicy::paged_compact (float)",
          "[agreement]") {
  emulated_cases<float>();
}

TEST_CASE("paged_compact emulated grid is bit-identical to kvpolicy::paged_compact (half)",
          "[agreement]") {
  emulated_cases<half>();
}

TEST_CASE("paged_compact emulation detects the in-place hazard without the flag waits",
          "[agreement]") {
  // Half the tokens kept, spread out: chunk j's destinations are sources of chunk j / 2, so a
  // later chunk writing before an earlier one read corrupts rows -- what the waits prevent.
  auto s = make_scenario<float>(99, 1, 1, 2, 8, 8, 200, Layout::HND, Keep::sparse);
  s.lengths[0] = 200;
  s.tables[0].resize(26);  // 25 pages + padding: regenerate a long table from the shuffled ids
  std::iota(s.tables[0].begin(), s.tables[0].end(), 0);
  std::shuffle(s.tables[0].begin(), s.tables[0].end(), std::mt19937(5));
  s.num_blocks = std::max<std::int64_t>(s.num_blocks, 26);
  s.keys.resize(static_cast<std::size_t>(s.num_blocks * 2 * 8 * 8));
  s.values = s.keys;
  for (std::size_t i = 0; i < s.keys.size(); ++i) s.keys[i] = static_cast<float>(i);
  Selection sel(1, 2);
  for (std::int32_t t = 0; t < 200; t += 2) sel.kept(0, 0).push_back(t + 1);
  for (std::int32_t t = 0; t < 200; t += 3) sel.kept(0, 1).push_back(t);
  s.sels = {sel};
  std::vector<float> rk = s.keys, rv = s.values;
  cpu_reference(s, rk, rv);
  const Flat f = flatten(s);
  for (bool honor : {true, false}) {
    std::vector<float> ek = s.keys;
    emulate_compact(ek.data(), unit_geometry<float, float>(s.view(ek)), f, 4, 3, honor,
                    Schedule::adversarial);
    CHECK(same_bits(ek, rk) == honor);
  }
  // The wait ranges themselves, by hand: kept = 1, 3, 5, ..., C = 4: chunk 1 writes slots 4..7,
  // read by kept indices 2 and 3 (sources 5, 7), i.e. chunk 0.
  const auto& k = sel.kept(0, 0);
  const auto r1 = cuda::paged_chunk_waits(k.data(), 100, 4, 1);
  CHECK(r1.first == 0);
  CHECK(r1.last == 0);
  const auto r0 = cuda::paged_chunk_waits(k.data(), 100, 4, 0);  // only itself: none
  CHECK(r0.first > r0.last);
  const auto r10 = cuda::paged_chunk_waits(k.data(), 100, 4, 10);  // slots 40..43: i = 20, 21
  CHECK(r10.first == 5);
  CHECK(r10.last == 5);
}

namespace {

template <class T>
void check_gather_emulated(std::uint32_t seed, Layout lay, Layout dense) {
  auto s = make_scenario<T>(seed, 2, 2, 3, 5, 12, 60, lay, Keep::random);
  const cpu_backend be{1};
  for (std::size_t q = 0; q < 2; ++q) {
    const std::int64_t N = s.lengths[q];
    const auto n = static_cast<std::size_t>(s.L * s.H * N * s.D);
    std::vector<T> ref(n), got(n, from_float<T>(-1.f));
    auto rv = KVView<T>::make(dense, ref.data(), s.L, s.H, N, s.D);
    auto gv = KVView<T>::make(dense, got.data(), s.L, s.H, N, s.D);
    kvpolicy::paged_gather(be, s.view(s.keys), s.seq(q), rv);
    const auto g = unit_geometry<T, T>(s.view(s.keys));
    const cuda::DenseUnits d{gv.stride_layer, gv.stride_head, gv.stride_token, 1};
    for (std::int64_t e = 0; e < s.L * s.H * N * g.row_units; ++e)
      cuda::paged_gather_unit(g, static_cast<const T*>(s.keys.data()), s.tables[q].data(), N, d,
                              got.data(), e);
    CHECK(same_bits(got, ref));
  }
}

}  // namespace

TEST_CASE("paged_gather emulated grid equals kvpolicy::paged_gather", "[agreement]") {
  std::uint32_t seed = 40;
  for (Layout lay : {Layout::HND, Layout::NHD})
    for (Layout dense : {Layout::HND, Layout::NHD}) {
      check_gather_emulated<float>(++seed, lay, dense);
      check_gather_emulated<half>(++seed, lay, dense);
    }
}

TEST_CASE("paged bookkeeping and shared conflicts equal kvpolicy::paged_compact's result",
          "[agreement]") {
  const cpu_backend be{1};
  for (std::uint32_t seed = 60; seed < 80; ++seed) {
    auto s = make_scenario<float>(seed, 1, 2, 2, 4, 4, 50, Layout::NHD,
                                  seed % 2 ? Keep::random : Keep::prefix);
    const cuda::HostCsr c = cuda::to_csr(s.sels[0]);
    const auto b = cuda::paged_bookkeeping(c.offsets, s.seq(0), s.P);
    std::vector<std::uint8_t> shared(static_cast<std::size_t>(s.num_blocks), 0);
    for (std::size_t i = 0; i < shared.size(); i += 3) shared[i] = 1;
    const auto conflicts = cuda::paged_shared_conflicts(s.sels[0], s.seq(0), s.P, shared);
    std::vector<float> k1 = s.keys, v1 = s.values;
    const auto res1 = kvpolicy::paged_compact(be, s.view(k1), s.view(v1), s.seq(0), s.sels[0],
                                              shared);
    CHECK(conflicts == res1.shared_conflicts);
    std::vector<float> k2 = s.keys, v2 = s.values;
    const auto res = kvpolicy::paged_compact(be, s.view(k2), s.view(v2), s.seq(0), s.sels[0]);
    CHECK(b.new_length == res.new_length);
    CHECK(b.lengths == res.lengths);
    CHECK(b.pages_used == res.pages_used);
    CHECK(b.freed_blocks == res.freed_blocks);
  }
}

// ---- CUDA half ----------------------------------------------------------------------------------

namespace {

using kvtest::gpu_present;

#if defined(KVPOLICY_WITH_CUDA)
using kvtest::download;
using kvtest::upload;

template <class T>
void check_device_compact(std::uint32_t seed, const Shape& sh, Layout lay, Keep keep) {
  auto s = make_scenario<T>(seed, sh.R, sh.L, sh.H, sh.P, sh.D, sh.max_len, lay, keep);
  std::vector<T> rk = s.keys, rv = s.values;
  cpu_reference(s, rk, rv);
  const Flat f = flatten(s);
  cuda::DeviceBuffer dk = upload(s.keys), dv = upload(s.values), ids = upload(f.ids),
                     toff = upload(f.table_offsets), off = upload(f.csr.offsets),
                     idx = upload(f.csr.indices);
  auto kv = PagedKVView<T>::make(lay, dk.as<T>(), s.num_blocks, s.L, s.H, s.P, s.D);
  auto vv = PagedKVView<T>::make(lay, dv.as<T>(), s.num_blocks, s.L, s.H, s.P, s.D);
  const cuda::PagedTables tables{ids.as<const std::int32_t>(), toff.as<const std::int64_t>(),
                                 static_cast<std::int64_t>(s.sels.size()), f.max_tokens};
  const cuda::CsrSelection sel{f.csr.layers, f.csr.heads, off.as<std::int64_t>(),
                               idx.as<std::int32_t>(),
                               static_cast<std::int64_t>(f.csr.indices.size())};
  const std::size_t wsb = cuda::paged_compact_workspace_bytes(kv, tables);
  cuda::DeviceBuffer ws(std::max<std::size_t>(wsb, 1));
  const cuda_backend be{nullptr, ws.data(), wsb};
  cuda::paged_compact(be, kv, vv, tables, sel);
  cuda::synchronize();
  CHECK(same_bits(download<T>(dk, s.keys.size()), rk));
  CHECK(same_bits(download<T>(dv, s.values.size()), rv));
}
#endif

}  // namespace

TEST_CASE("cuda::paged_compact is bit-identical to kvpolicy::paged_compact", "[agreement][gpu]") {
  if (!gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  std::uint32_t seed = 200;
  for (const Shape& sh : shapes)
    for (Layout lay : {Layout::HND, Layout::NHD})
      for (Keep k : {Keep::random, Keep::all, Keep::none, Keep::prefix, Keep::sparse}) {
        INFO("seed=" << seed + 1);
        check_device_compact<float>(++seed, sh, lay, k);
        check_device_compact<half>(++seed, sh, lay, k);
      }
  // Long rows: many chunks per row, waits across thread blocks.
  check_device_compact<half>(++seed, {1, 2, 8, 16, 128, 5000}, Layout::NHD, Keep::random);
  check_device_compact<float>(++seed, {2, 1, 4, 16, 64, 3000}, Layout::HND, Keep::sparse);
#endif
}

TEST_CASE("cuda::paged_gather equals kvpolicy::paged_gather", "[agreement][gpu]") {
  if (!gpu_present()) return;
#if defined(KVPOLICY_WITH_CUDA)
  const cpu_backend cb{1};
  for (Layout lay : {Layout::HND, Layout::NHD}) {
    auto s = make_scenario<half>(300, 1, 2, 8, 16, 128, 700, lay, Keep::random);
    const std::int64_t N = s.lengths[0];
    const auto n = static_cast<std::size_t>(s.L * s.H * N * s.D);
    std::vector<half> ref(std::max<std::size_t>(n, 1));
    kvpolicy::paged_gather(cb, s.view(s.keys), s.seq(0),
                           KVView<half>::hnd(ref.data(), s.L, s.H, N, s.D));
    cuda::DeviceBuffer pool = upload(s.keys), table = upload(s.tables[0]),
                       out(std::max<std::size_t>(n, 1) * sizeof(half));
    auto pv = PagedKVView<half>::make(lay, pool.as<half>(), s.num_blocks, s.L, s.H, s.P, s.D);
    const cuda_backend be{};
    cuda::paged_gather(be, pv, table.as<const std::int32_t>(), N,
                       KVView<half>::hnd(out.as<half>(), s.L, s.H, N, s.D));
    cuda::synchronize();
    ref.resize(n);
    CHECK(same_bits(download<half>(out, n), ref));
  }
#endif
}

TEST_CASE("cuda::paged_compact_rows rejects bad arguments before any device work",
          "[agreement]") {
#if !defined(KVPOLICY_WITH_CUDA)
  WARN("CUDA half skipped: built without CUDA (KVPOLICY_WITH_CUDA undefined)");
#else
  // Host pointers are fine here: every case fails its checks before touching memory.
  std::vector<half> k(2 * 1 * 2 * 4 * 8), v(k.size());
  std::vector<std::int32_t> ids{1, 0};
  std::vector<std::int64_t> toff{0, 2}, off{0, 1, 2};
  std::vector<std::int32_t> idx{3, 5};
  auto kv = cuda::paged_rows_view(PagedKVView<half>::nhd(k.data(), 2, 1, 2, 4, 8));
  auto vv = cuda::paged_rows_view(PagedKVView<half>::nhd(v.data(), 2, 1, 2, 4, 8));
  const cuda::PagedTables t{ids.data(), toff.data(), 1, 8};
  const cuda::CsrSelection sel{1, 2, off.data(), idx.data(), 2};
  const std::size_t wsb = cuda::paged_compact_workspace_bytes(kv, t);
  CHECK(wsb >= sizeof(unsigned long long) + 2 * 2 * sizeof(int));  // 2 rows x 1 chunk, 2 pools
  const cuda_backend no_ws{};
  CHECK(cuda::paged_compact_rows(no_ws, kv, vv, t, sel).code ==
        cuda::StatusCode::insufficient_workspace);
  const cuda::CsrSelection wrong{2, 2, off.data(), idx.data(), 2};
  CHECK(cuda::paged_compact_rows(no_ws, kv, vv, t, wrong).code ==
        cuda::StatusCode::invalid_argument);
  auto same = kv;
  CHECK(cuda::paged_compact_rows(no_ws, kv, same, t, sel).code ==
        cuda::StatusCode::invalid_argument);
  // A values pool with another element size (e.g. fp32 values, fp16 keys): rejected, since the
  // launch plan (rows staged in shared memory) is made for the keys' row size.
  auto wide = vv;
  wide.elem_bytes = 4;
  CHECK(cuda::paged_compact_rows(no_ws, kv, wide, t, sel).code ==
        cuda::StatusCode::invalid_argument);
  // A misaligned workspace (large enough) is rejected before any launch.
  std::vector<unsigned long long> ws_host(wsb / sizeof(unsigned long long) + 2);
  const cuda_backend misaligned{nullptr, reinterpret_cast<char*>(ws_host.data()) + 4, wsb};
  CHECK(cuda::paged_compact_rows(misaligned, kv, vv, t, sel).code ==
        cuda::StatusCode::invalid_argument);
  auto odd = kv;
  odd.elem_bytes = 3;
  CHECK(cuda::paged_compact_rows(no_ws, odd, {}, t, sel).code ==
        cuda::StatusCode::invalid_argument);
  auto zero_page = kv;
  zero_page.page_size = 0;
  CHECK(cuda::paged_compact_rows(no_ws, zero_page, {}, t, sel).code ==
        cuda::StatusCode::invalid_argument);
  const cuda::PagedTables empty{ids.data(), toff.data(), 0, 0};
  const cuda::CsrSelection none{0, 2, nullptr, nullptr, 0};
  CHECK(cuda::paged_compact_rows(no_ws, kv, vv, empty, none).ok());  // nothing to do
  CHECK(cuda::paged_gather_rows(no_ws, kv, ids.data(), -1, {}).code ==
        cuda::StatusCode::invalid_argument);
  CHECK_THROWS_WITH(cuda::paged_compact(no_ws, PagedKVView<half>::nhd(k.data(), 2, 1, 2, 4, 8),
                                        PagedKVView<half>::nhd(v.data(), 2, 1, 2, 4, 8), t,
                                        wrong),
                    Catch::Matchers::Contains("selection"));
#endif
}

}  // namespace kvt_agreement_paged
