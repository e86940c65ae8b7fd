// Paged compaction (paged.hpp): on random block tables it writes exactly what dense compaction
// of the same tokens writes and nothing else in the pool; shared blocks are never written; bad
// input changes nothing; compress_paged selects what the policy selects on a dense copy.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include <kvpolicy/cpu/compact.hpp>
#include <kvpolicy/paged.hpp>

#include "paged/paged_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_paged_paged {

using namespace pagedtest;
using kvpolicy::Budget;
using kvpolicy::half;
using Catch::Matchers::Contains;

namespace {

const kvpolicy::cpu_backend be{};

// Expected pool after compacting `s` with `sel`: its tokens compacted densely with cpu::compact,
// written back; every other element of the pool as before.
template <class T>
std::vector<T> expected_pool(Pool<T>& pool, std::vector<T>& buf, const Seq& s,
                             const Selection& sel) {
  std::vector<T> out = buf;
  std::vector<T> dense = gather(pool.view(buf), s);
  kvpolicy::cpu::compact(be, KVView<T>::hnd(dense.data(), pool.L, pool.H, s.length, pool.D), sel);
  scatter(pool.view(out), s, dense);
  return out;
}

// Every element of block b, all layers and heads.
template <class T>
std::vector<float> block_of(const PagedKVView<T>& v, std::int32_t b) {
  std::vector<float> out;
  for (std::int64_t l = 0; l < v.layers; ++l)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t t = 0; t < v.page_size; ++t)
        for (std::int64_t e = 0; e < v.dim; ++e)
          out.push_back(static_cast<float>(v.row(l, b, h, t)[e * v.stride_dim]));
  return out;
}

template <class T>
std::vector<std::int32_t> expected_freed(const Seq& s, const Selection& sel, std::int64_t P) {
  std::int64_t n = 0;
  for (std::int64_t r = 0; r < sel.layers() * sel.heads(); ++r)
    n = std::max(n, sel.count(r / sel.heads(), r % sel.heads()));
  return {s.table.begin() + (n + P - 1) / P, s.table.begin() + (s.length + P - 1) / P};
}

template <class T>
void check_against_dense(std::uint64_t seed, Form form, std::int64_t P, bool with_values) {
  kvtest::Rng rng(seed);
  const std::int64_t L = 2, H = 3, D = 8;
  // Partial last pages, a full-page length, and lengths of one page or less.
  const std::vector<std::int64_t> lengths = {rng.integer(1, 5 * P), 4 * P, rng.integer(1, P),
                                             rng.integer(2 * P, 6 * P)};
  const std::int64_t NB = pages_for(lengths, P) + 7;  // spare blocks nobody owns
  Pool<T> pool(rng, form, NB, L, H, P, D);
  auto seqs = random_sequences(rng, NB, P, lengths);
  for (const Seq& s : seqs) {  // compact them one after another
    const Selection sel = random_selection(rng, L, H, s.length);
    const auto want_k = expected_pool(pool, pool.k, s, sel);
    const auto want_v = with_values ? expected_pool(pool, pool.v, s, sel) : pool.v;
    const auto values = with_values ? pool.values() : PagedKVView<T>{};
    const auto res = kvpolicy::paged_compact(be, pool.keys(), values, s.seq(), sel);
    CHECK(res.compacted);
    CHECK(same_bytes(pool.k, want_k));  // kept rows, stale rows, other sequences, spare blocks
    CHECK(same_bytes(pool.v, want_v));
    CHECK(res.freed_blocks == expected_freed<T>(s, sel, P));
    CHECK(res.shared_conflicts.empty());
    for (std::int64_t r = 0; r < L * H; ++r) {
      CHECK(res.lengths[static_cast<std::size_t>(r)] == sel.count(r / H, r % H));
      CHECK(res.new_length >= sel.count(r / H, r % H));
    }
    CHECK(res.pages_used == (res.new_length + P - 1) / P);
    CHECK(res.pages_used + static_cast<std::int64_t>(res.freed_blocks.size()) ==
          static_cast<std::int64_t>(s.table.size()));
  }
}

}  // namespace

TEST_CASE("paged_compact equals dense compaction on random block tables", "[paged]") {
  for (std::int64_t P : {1, 3, 16})
    for (Form form : {Form::nhd, Form::hnd, Form::transposed})
      for (std::uint64_t seed = 1; seed <= 4; ++seed) {
        INFO("page_size " << P << ", " << form_name(form) << ", seed " << seed);
        check_against_dense<float>(seed, form, P, seed % 2 == 1);
        check_against_dense<half>(seed + 100, form, P, true);
      }
}

TEST_CASE("paged_gather copies a sequence into any dense layout", "[paged]") {
  kvtest::Rng rng(7);
  const std::int64_t L = 2, H = 2, P = 3, D = 5;
  for (Form form : {Form::nhd, Form::hnd, Form::transposed}) {
    Pool<half> pool(rng, form, 20, L, H, P, D);
    const auto seqs = random_sequences(rng, 20, P, {11, 7});
    const Seq& s = seqs[1];
    const auto want = gather(pool.keys(), s);
    // Into fp32 NHD: converted element by element, laid out by the destination's strides.
    std::vector<float> dst(want.size());
    const auto dv = KVView<float>::nhd(dst.data(), L, H, s.length, D);
    kvpolicy::paged_gather(be, pool.keys(), s.seq(), dv);
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t t = 0; t < s.length; ++t)
          for (std::int64_t e = 0; e < D; ++e)
            CHECK(dv.at(l, h, t, e) ==
                  static_cast<float>(want[static_cast<std::size_t>(((l * H + h) * s.length + t) * D + e)]));
    // Same type, HND: a plain copy.
    std::vector<half> same(want.size());
    kvpolicy::paged_gather(be, PagedKVView<const half>(pool.keys()), s.seq(),
                           KVView<half>::hnd(same.data(), L, H, s.length, D));
    CHECK(same_bytes(same, want));
    CHECK_THROWS_WITH(kvpolicy::paged_gather(be, pool.keys(), s.seq(),
                                             KVView<float>::hnd(dst.data(), L, H, 3, D)),
                      Contains("dst: shape [2,2,3,5] but the sequence is [2,2,7,5]"));
  }
}

TEST_CASE("paged_compact never writes a shared block", "[paged]") {
  kvtest::Rng rng(11);
  const std::int64_t L = 2, H = 2, P = 4, D = 4, NB = 12;
  for (Form form : {Form::nhd, Form::hnd}) {
    Pool<float> pool(rng, form, NB, L, H, P, D);
    Seq s{{9, 2, 5, 7}, 14};  // block 9 holds the shared prompt prefix, block 2 is shared too
    std::vector<std::uint8_t> shared(NB, 0);
    shared[9] = shared[2] = 1;
    auto k0 = pool.k, v0 = pool.v;
    const auto k0_view = pool.view(k0);

    SECTION("kept in place: compacted, the shared block untouched") {
      Selection sel(L, H);
      for (std::int64_t r = 0; r < L * H; ++r) {
        auto& k = sel.kept(r / H, r % H);
        for (std::int32_t t = 0; t < 8; ++t) k.push_back(t);  // blocks 9 and 2 stay as they are
        for (std::int32_t t = 9; t < 14; t += 1 + static_cast<std::int32_t>(r)) k.push_back(t);
      }
      const auto want_k = expected_pool(pool, pool.k, s, sel);
      const auto res = kvpolicy::paged_compact(be, pool.keys(), pool.values(), s.seq(), sel, shared);
      CHECK(res.compacted);
      CHECK(same_bytes(pool.k, want_k));
      CHECK(res.new_length == 13);
      CHECK(res.freed_blocks.empty());
      for (std::int32_t b : {9, 2}) CHECK(block_of(pool.keys(), b) == block_of(k0_view, b));
    }
    SECTION("a write into a shared block: nothing written, conflicts listed") {
      Selection sel(L, H);
      for (std::int64_t r = 0; r < L * H; ++r) sel.kept(r / H, r % H) = {0, 1, 2, 3, 4, 5, 6, 7};
      sel.kept(1, 0) = {0, 2, 3, 12};  // writes slots 1..3: all in block 9
      const auto res = kvpolicy::paged_compact(be, pool.keys(), pool.values(), s.seq(), sel, shared);
      CHECK_FALSE(res.compacted);
      CHECK(res.shared_conflicts == std::vector<std::int32_t>{9});
      CHECK(res.freed_blocks.empty());
      CHECK(res.new_length == 14);
      CHECK(res.pages_used == 4);
      CHECK(same_bytes(pool.k, k0));
      CHECK(same_bytes(pool.v, v0));

      sel.kept(0, 1) = {0, 1, 2, 3, 4, 6};  // also writes slot 5 (block 2)
      const auto res2 = kvpolicy::paged_compact(be, pool.keys(), pool.values(), s.seq(), sel, shared);
      CHECK(res2.shared_conflicts == std::vector<std::int32_t>{9, 2});
      CHECK(same_bytes(pool.k, k0));
    }
    SECTION("a shared block past the new length is freed like any other") {
      Selection sel(L, H);
      for (std::int64_t r = 0; r < L * H; ++r) sel.kept(r / H, r % H) = {0, 1, 2};
      const auto res = kvpolicy::paged_compact(be, pool.keys(), pool.values(), s.seq(), sel, shared);
      CHECK(res.compacted);
      CHECK(res.pages_used == 1);
      CHECK(res.freed_blocks == std::vector<std::int32_t>{2, 5, 7});
      CHECK(same_bytes(pool.k, k0));  // every kept token was in place
    }
  }
}

TEST_CASE("paged_compact rejects bad input and writes nothing", "[paged]") {
  kvtest::Rng rng(5);
  const std::int64_t L = 2, H = 2, P = 3, D = 4, NB = 10;
  Pool<float> pool(rng, Form::hnd, NB, L, H, P, D);
  const auto k0 = pool.k, v0 = pool.v;
  std::vector<std::int32_t> table = {4, 1, 8};
  const Selection sel = [&] {
    Selection s(L, H);
    for (std::int64_t r = 0; r < L * H; ++r) s.kept(r / H, r % H) = {1, 4, 8};
    return s;
  }();
  auto compact = [&](std::vector<std::int32_t> t, std::int64_t n, const Selection& s,
                     std::vector<std::uint8_t> shared = {}) {
    return error_of([&] {
      kvpolicy::paged_compact(be, pool.keys(), pool.values(), PagedSequence{t, n}, s, shared);
    });
  };
  CHECK_THAT(compact({4, 1, 4}, 9, sel), Contains("seq: block 4 appears twice in the block table"));
  CHECK_THAT(compact({4, 10, 8}, 9, sel), Contains("seq: block table entry 1 is block 10, outside [0, 10)"));
  CHECK_THAT(compact({4, -1, 8}, 9, sel), Contains("outside [0, 10)"));
  CHECK_THAT(compact({4, 1}, 9, sel), Contains("seq: block table has 2 entries but length 9 needs 3 pages"));
  CHECK_THAT(compact(table, 8, sel), Contains("selection: index 8 at layer 0, head 0 is outside [0, 8)"));
  CHECK_THAT(compact(table, -1, sel), Contains("seq: negative length"));
  CHECK_THAT(compact(table, 9, Selection(L, H + 1)),
             Contains("selection: [2,3] layers x heads but the pool has [2,2]"));
  CHECK_THAT(compact(table, 9, sel, std::vector<std::uint8_t>(NB - 1, 0)),
             Contains("shared: 9 flags for a pool of 10 blocks"));
  Selection unsorted = sel;
  unsorted.kept(1, 1) = {4, 1};
  CHECK_THAT(compact(table, 9, unsorted), Contains("not strictly ascending"));
  // Padded tables are fine: entries past the sequence's pages are not read.
  CHECK(compact({4, 1, 8, 0, 0, -1}, 9, sel) == "<no exception>");
  pool.k = k0;
  pool.v = v0;

  auto bad_pool = [&](PagedKVView<float> keys, PagedKVView<float> values) {
    return error_of([&] {
      kvpolicy::paged_compact(be, keys, values, PagedSequence{table, 9}, sel);
    });
  };
  auto overlapping = pool.keys();
  overlapping.stride_block = 4;  // blocks overlap each other
  CHECK_THAT(bad_pool(overlapping, pool.values()), Contains("keys: block stride 4 overlaps"));
  auto negative = pool.values();
  negative.stride_head = -1;
  CHECK_THAT(bad_pool(pool.keys(), negative), Contains("values: negative head stride -1"));
  auto other = PagedKVView<float>::hnd(pool.v.data(), NB, L, H, P + 1, D - 1);
  CHECK_THAT(bad_pool(pool.keys(), other), Contains("values pool [blocks=10, layers=2, heads=2, page_size=4"));
  CHECK_THAT(bad_pool(pool.keys(), pool.keys()), Contains("values: same memory as keys"));
  CHECK(same_bytes(pool.k, k0));
  CHECK(same_bytes(pool.v, v0));
}

namespace {

// compress_paged on one request of a pool vs Policy::compress on a dense copy of it.
template <class T>
void check_compress_paged(const std::string& spec, Form form, std::int64_t P, std::uint64_t seed) {
  INFO(spec << ", " << form_name(form) << ", page_size " << P << ", seed " << seed);
  kvtest::Rng rng(seed);
  const std::int64_t L = 2, H = 2, Hq = 4, D = 16, NQ = 8;
  const std::vector<std::int64_t> lengths = {rng.integer(40, 70), rng.integer(40, 70)};
  const std::int64_t NB = pages_for(lengths, P) + 3;
  Pool<T> pool(rng, form, NB, L, H, P, D);
  const auto seqs = random_sequences(rng, NB, P, lengths);
  const Seq& s = seqs[1];
  const auto q = rng.normals<T>(L * Hq * NQ * D);
  const auto queries = KVView<const T>::hnd(q.data(), L, Hq, NQ, D);
  const kvpolicy::Policy policy(spec);
  const Budget budget = Budget::ratio(0.5);

  auto dk = gather(pool.keys(), s), dv = gather(pool.values(), s);
  kvpolicy::Inputs<T> in;
  in.queries = queries;
  const Selection want = policy.compress(be, KVView<T>::hnd(dk.data(), L, H, s.length, D),
                                         KVView<T>::hnd(dv.data(), L, H, s.length, D), in, budget);
  auto want_k = pool.k, want_v = pool.v;
  scatter(pool.view(want_k), s, dk);
  scatter(pool.view(want_v), s, dv);

  const auto res = kvpolicy::compress_paged(policy, be, pool.keys(), pool.values(), s.seq(),
                                            queries, budget);
  for (std::int64_t r = 0; r < L * H; ++r) {
    const auto a = res.selection.kept(r / H, r % H), b = want.kept(r / H, r % H);
    CHECK(std::vector<std::int32_t>(a.begin(), a.end()) == std::vector<std::int32_t>(b.begin(), b.end()));
  }
  CHECK(res.compact.compacted);
  CHECK(same_bytes(pool.k, want_k));
  CHECK(same_bytes(pool.v, want_v));
}

}  // namespace

TEST_CASE("compress_paged equals Policy::compress on a dense copy", "[paged]") {
  for (const char* spec : {"snapkv(window=8)", "h2o", "streaming", "snapkv(window=8) | adakv",
                           "knorm", "tova | pyramid"})
    for (Form form : {Form::nhd, Form::hnd})
      for (std::int64_t P : {3, 16}) {
        check_compress_paged<float>(spec, form, P, 21 + static_cast<std::uint64_t>(P));
        check_compress_paged<half>(spec, form, P, 41 + static_cast<std::uint64_t>(P));
      }
}

TEST_CASE("compress_paged rejects bad input before writing", "[paged]") {
  kvtest::Rng rng(3);
  const std::int64_t L = 2, H = 2, P = 4, D = 8, NB = 16, NQ = 8;
  Pool<float> pool(rng, Form::nhd, NB, L, H, P, D);
  const Seq s{{3, 11, 6, 0, 9, 14, 2, 8}, 30};
  auto q = rng.normals<float>(L * H * NQ * D);
  const auto queries = KVView<const float>::hnd(q.data(), L, H, NQ, D);
  auto compress = [&](const char* spec, Budget budget = Budget::ratio(0.5)) {
    return error_of([&] {
      kvpolicy::compress_paged(kvpolicy::Policy(spec), be, pool.keys(), pool.values(), s.seq(),
                               queries, budget);
    });
  };
  auto poke = [&](std::vector<float>& buf, std::int64_t l, std::int64_t t, float x) {
    auto v = pool.view(buf);
    v.row(l, s.table[static_cast<std::size_t>(t / P)], 1, t % P)[2] = x;
  };
  const auto k0 = pool.k, v0 = pool.v;
  CHECK_THAT(compress("snapkv(window=8) | semantic"), Contains("compress_paged: policy 'snapkv(window=8) | semantic' has a merger stage"));
  CHECK_THAT(compress("snapkv(window=8) | int2"), Contains("has a quantizer stage ('int2')"));
  CHECK_THAT(compress("snapkv(window=8)", Budget::tokens(-4)), Contains("budget is negative (-4)"));
  CHECK_THAT(compress("snapkv(window=16)", Budget::ratio(0.8)), Contains("snapkv: needs the last 16 queries, got 8"));
  poke(pool.k, 1, 17, std::numeric_limits<float>::quiet_NaN());
  CHECK_THAT(compress("knorm"), Contains("keys contains a non-finite value (nan) at layer 1, head 1, token 17 (block 9, slot 1), dim 2"));
  pool.k = k0;
  poke(pool.v, 0, 29, std::numeric_limits<float>::infinity());
  CHECK_THAT(compress("knorm"), Contains("values contains a non-finite value (inf) at layer 0, head 1, token 29"));
  pool.v = v0;
  q[5] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THAT(compress("snapkv(window=8)"), Contains("queries contains a non-finite value"));
  CHECK(same_bytes(pool.k, k0));
  CHECK(same_bytes(pool.v, v0));
}

}  // namespace kvt_paged_paged
