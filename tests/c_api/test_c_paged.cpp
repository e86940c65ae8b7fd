// The C ABI's batches and paged compaction: equal to the C++ API (itself tested against dense
// compaction in tests/paged/), all-or-nothing checks, shared blocks, caller buffers.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "common/random_kv.hpp"
#include "kvpolicy/batch.hpp"
#include "c_api/c_util.hpp"
#include "kvpolicy/c/kvpolicy.h"
#include "kvpolicy/paged.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_c_api_c_paged {

using namespace kvpolicy;
using ctest::make;
using ctest::mentions;
using Out = ctest::SelOut;

namespace {

constexpr std::int64_t L = 2, H = 2, Hq = 4, D = 8, NQ = 8;

}  // namespace

TEST_CASE("C ABI: kvp_compress_batch equals kvp_compress per sequence", "[c_api]") {
  const std::vector<std::int64_t> lens = {40, 73, 55};
  kvtest::Rng rng(9);
  std::vector<std::vector<float>> k, v, q;
  for (auto t : lens) {
    k.push_back(rng.normals(L * H * t * D));
    v.push_back(rng.normals(L * H * t * D));
    q.push_back(rng.normals(L * Hq * NQ * D));
  }
  auto k2 = k, v2 = v;
  kvp_policy* p = make("snapkv(window=8) | adakv");
  kvp_compress_params prm = kvp_compress_default_params();
  prm.budget = {KVP_BUDGET_RATIO, 0.4};
  const kvp_budget own = {KVP_BUDGET_PER_HEAD, 20};
  std::vector<kvp_sequence> seqs(3);
  std::vector<Out> outs;
  for (std::size_t i = 0; i < 3; ++i) {
    seqs[i].keys = kvp_tensor_nhd(k[i].data(), KVP_F32, L, H, lens[i], D);
    seqs[i].values = kvp_tensor_nhd(v[i].data(), KVP_F32, L, H, lens[i], D);
    seqs[i].queries = kvp_tensor_hnd(q[i].data(), KVP_F32, L, Hq, NQ, D);
    seqs[i].budget = i == 1 ? &own : nullptr;
    outs.emplace_back(L, H, lens[i]);
  }
  std::vector<kvp_selection> sels;
  for (auto& o : outs) sels.push_back(o.sel);
  REQUIRE(kvp_compress_batch(p, &prm, seqs.data(), 3, sels.data()) == KVP_OK);
  for (std::size_t i = 0; i < 3; ++i) {
    Out one(L, H, lens[i]);
    kvp_tensor ck = kvp_tensor_nhd(k2[i].data(), KVP_F32, L, H, lens[i], D);
    kvp_tensor cv = kvp_tensor_nhd(v2[i].data(), KVP_F32, L, H, lens[i], D);
    kvp_compress_params pi = prm;
    if (i == 1) pi.budget = own;
    REQUIRE(kvp_compress(p, &pi, &ck, &cv, &seqs[i].queries, nullptr, 0, &one.sel) == KVP_OK);
    CHECK(one.counts == outs[i].counts);
    CHECK(one.idx == outs[i].idx);
    CHECK(k[i] == k2[i]);
    CHECK(v[i] == v2[i]);
  }
  CHECK(std::accumulate(outs[1].counts.begin(), outs[1].counts.end(), std::int64_t{0}) ==
        L * H * 20);

  // A bad sequence in the middle: nothing in the batch is written.
  const auto k0 = k, v0 = v;
  q[1][5] = NAN;
  CHECK(kvp_compress_batch(p, &prm, seqs.data(), 3, sels.data()) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("non-finite"));
  CHECK(k == k0);
  CHECK(v == v0);
  q[1][5] = 0;
  seqs[2].keys.dim = 4;
  CHECK(kvp_compress_batch(p, &prm, seqs.data(), 3, sels.data()) == KVP_ERROR_INVALID_ARGUMENT);
  INFO(kvp_last_error());
  CHECK(mentions("sequence 2"));
  CHECK(k == k0);
  seqs[2].keys.dim = D;
  CHECK(kvp_compress_batch(p, &prm, nullptr, 3, sels.data()) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_compress_batch(p, &prm, seqs.data(), 0, nullptr) == KVP_OK);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: kvp_compress_paged equals compress_paged, with shared blocks", "[c_api]") {
  for (kvp_layout layout : {KVP_LAYOUT_NHD, KVP_LAYOUT_HND}) {
    INFO((layout == KVP_LAYOUT_NHD ? "NHD" : "HND"));
    const std::int64_t blocks = 24, page = 4;
    kvtest::Rng rng(31);
    std::vector<float> kp = rng.normals(L * blocks * page * H * D),
                       vp = rng.normals(L * blocks * page * H * D);
    std::vector<float> kr = kp, vr = vp;  // the C++ reference works on copies
    // Two requests on shuffled, interleaved blocks; the last pages are partial.
    std::vector<std::int32_t> ids(blocks);
    std::iota(ids.begin(), ids.end(), 0);
    for (std::size_t i = ids.size(); i > 1; --i)
      std::swap(ids[i - 1], ids[static_cast<std::size_t>(rng.integer(0, static_cast<std::int64_t>(i) - 1))]);
    std::vector<std::int32_t> t0(ids.begin(), ids.begin() + 10), t1(ids.begin() + 10, ids.begin() + 18);
    const std::int64_t len0 = 37, len1 = 30;
    std::vector<float> q0 = rng.normals(L * Hq * NQ * D), q1 = rng.normals(L * Hq * NQ * D);

    kvp_policy* p = make("snapkv(window=8) | adakv");
    kvp_compress_params prm = kvp_compress_default_params();
    prm.budget = {KVP_BUDGET_RATIO, 0.4};
    kvp_paged_tensor ck = kvp_paged_tensor_make(layout, kp.data(), KVP_F32, blocks, L, H, page, D);
    kvp_paged_tensor cv = kvp_paged_tensor_make(layout, vp.data(), KVP_F32, blocks, L, H, page, D);
    kvp_paged_sequence seqs[2] = {};
    seqs[0] = {t0.data(), 10, len0, kvp_tensor_hnd(q0.data(), KVP_F32, L, Hq, NQ, D), nullptr};
    seqs[1] = {t1.data(), 8, len1, kvp_tensor_hnd(q1.data(), KVP_F32, L, Hq, NQ, D), nullptr};
    std::int32_t freed[2][10];
    std::int64_t lengths[2][L * H];
    kvp_paged_result res[2] = {};
    for (int i = 0; i < 2; ++i) {
      res[i].freed_blocks = freed[i];
      res[i].freed_capacity = 10;
      res[i].lengths = lengths[i];
    }
    REQUIRE(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, seqs, 2, res) == KVP_OK);

    const Layout lay = layout == KVP_LAYOUT_NHD ? Layout::NHD : Layout::HND;
    auto rk = PagedKVView<float>::make(lay, kr.data(), blocks, L, H, page, D);
    auto rv = PagedKVView<float>::make(lay, vr.data(), blocks, L, H, page, D);
    const Policy cpp("snapkv(window=8) | adakv");
    const std::vector<float>* qs[2] = {&q0, &q1};
    const std::vector<std::int32_t>* ts[2] = {&t0, &t1};
    const std::int64_t lens[2] = {len0, len1};
    for (int i = 0; i < 2; ++i) {
      PagedSequence s{*ts[i], lens[i]};
      const auto want = compress_paged<float>(
          cpp, cpu_backend{}, rk, rv, s, KVView<const float>::hnd(qs[i]->data(), L, Hq, NQ, D),
          Budget::ratio(0.4));
      CHECK(res[i].compacted == 1);
      CHECK(res[i].new_length == want.compact.new_length);
      CHECK(res[i].pages_used == want.compact.pages_used);
      REQUIRE(res[i].num_freed == static_cast<std::int64_t>(want.compact.freed_blocks.size()));
      CHECK(std::equal(freed[i], freed[i] + res[i].num_freed, want.compact.freed_blocks.begin()));
      CHECK(std::equal(lengths[i], lengths[i] + L * H, want.compact.lengths.begin()));
      CHECK(res[i].num_freed > 0);
    }
    CHECK(kp == kr);
    CHECK(vp == vr);

    // A shared first block of request 0 that the compaction would rewrite: request 0 is left as
    // it was, request 1 is compacted, and the call says which block.
    std::vector<std::uint8_t> shared(blocks, 0);
    shared[static_cast<std::size_t>(t0[0])] = 1;
    std::vector<float> kp2 = rng.normals(kp.size()), vp2 = rng.normals(vp.size());
    ck.data = kp2.data();
    cv.data = vp2.data();
    const auto before = kp2;
    REQUIRE(kvp_compress_paged(p, &prm, &ck, &cv, shared.data(), seqs, 2, res) ==
            KVP_ERROR_SHARED_BLOCK);
    CHECK(mentions(("seqs[0] would write shared block(s) " + std::to_string(t0[0])).c_str()));
    CHECK(res[0].compacted == 0);
    CHECK(res[0].num_freed == 0);
    CHECK(res[0].new_length == len0);
    CHECK(res[1].compacted == 1);
    auto row_of = [&](std::int32_t block, std::int64_t l) {
      const auto v = PagedKVView<float>::make(lay, kp2.data(), blocks, L, H, page, D);
      return v.row(l, block, 0, 0) - kp2.data();
    };
    for (std::int32_t b : t0)
      for (std::int64_t l = 0; l < L; ++l) {
        const auto off = static_cast<std::size_t>(row_of(b, l));
        CHECK(std::equal(kp2.begin() + static_cast<std::ptrdiff_t>(off),
                         kp2.begin() + static_cast<std::ptrdiff_t>(off + page * H * D),
                         before.begin() + static_cast<std::ptrdiff_t>(off)));
      }
    kvp_policy_destroy(p);
  }
}

TEST_CASE("C ABI: kvp_compress_paged rejects bad input before writing", "[c_api]") {
  const std::int64_t blocks = 8, page = 4;
  kvtest::Rng rng(2);
  std::vector<float> kp = rng.normals(L * blocks * page * H * D), vp = kp;
  const auto k0 = kp;
  std::vector<std::int32_t> table = {3, 1, 6};
  kvp_policy* p = make("knorm");
  kvp_compress_params prm = kvp_compress_default_params();
  kvp_paged_tensor ck = kvp_paged_tensor_make(KVP_LAYOUT_NHD, kp.data(), KVP_F32, blocks, L, H, page, D);
  kvp_paged_tensor cv = kvp_paged_tensor_make(KVP_LAYOUT_NHD, vp.data(), KVP_F32, blocks, L, H, page, D);
  kvp_paged_sequence seq{table.data(), 3, 10, {}, nullptr};
  std::int32_t freed[3];
  kvp_paged_result res{};
  res.freed_blocks = freed;
  res.freed_capacity = 3;

  CHECK(kvp_compress_paged(nullptr, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(kvp_compress_paged(p, &prm, nullptr, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("keys is NULL"));
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, nullptr) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("results is NULL"));
  res.freed_capacity = 2;
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_BUFFER_TOO_SMALL);
  CHECK(mentions("freed_blocks"));
  res.freed_capacity = 3;
  table[2] = 3;  // block 3 twice
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("3"));
  table[2] = 8;  // out of the pool
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  table[2] = 6;
  seq.num_pages = 2;  // too short for 10 tokens
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  seq.num_pages = 3;
  kvp_paged_tensor half = cv;
  half.dtype = KVP_F16;
  CHECK(kvp_compress_paged(p, &prm, &ck, &half, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("dtype"));
  kvp_policy* merge = make("knorm | semantic");
  CHECK(kvp_compress_paged(merge, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_UNSUPPORTED);
  kp[3 * page * H * D + 5] = NAN;  // block 3: the request's first page
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("non-finite"));
  kp[3 * page * H * D + 5] = k0[3 * page * H * D + 5];
  CHECK(kp == k0);
  REQUIRE(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_OK);
  CHECK(res.new_length == 5);
  CHECK(res.pages_used == 2);
  REQUIRE(res.num_freed == 1);
  CHECK(freed[0] == 6);
  kvp_policy_destroy(merge);
  kvp_policy_destroy(p);
}

TEST_CASE("C ABI: paged sizes beyond the address space are argument errors (fuzz_c_api "
          "regression)", "[c_api]") {
  // Found by fuzz_c_api: a request length of INT64_MAX overflowed the page count before the
  // sequence was checked, and an empty pool (dim 0) of 2^62 heads passed validation.
  const std::int64_t blocks = 4, page = 4;
  std::vector<float> kp(static_cast<std::size_t>(L * blocks * page * H * D), 0.5f), vp = kp;
  kvp_policy* p = make("knorm");
  kvp_compress_params prm = kvp_compress_default_params();
  kvp_paged_tensor ck = kvp_paged_tensor_make(KVP_LAYOUT_NHD, kp.data(), KVP_F32, blocks, L, H, page, D);
  kvp_paged_tensor cv = kvp_paged_tensor_make(KVP_LAYOUT_NHD, vp.data(), KVP_F32, blocks, L, H, page, D);
  std::int32_t table[2] = {0, 1}, freed[2];
  kvp_paged_sequence seq{table, 2, std::numeric_limits<std::int64_t>::max(), {}, nullptr};
  kvp_paged_result res{};
  res.freed_blocks = freed;
  res.freed_capacity = 2;
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("seqs[0].length 9223372036854775807 is outside"));
  seq.length = 6;
  kvp_paged_tensor empty = ck;
  empty.dim = 0;
  empty.heads = std::int64_t{1} << 62;
  kvp_paged_tensor empty_v = empty;
  empty_v.data = vp.data();
  CHECK(kvp_compress_paged(p, &prm, &empty, &empty_v, nullptr, &seq, 1, &res) ==
        KVP_ERROR_INVALID_ARGUMENT);
  CHECK(mentions("address space"));
  CHECK(kvp_compress_paged(p, &prm, &ck, &cv, nullptr, &seq, 1, &res) == KVP_OK);
  kvp_policy_destroy(p);
}

}  // namespace kvt_c_api_c_paged
