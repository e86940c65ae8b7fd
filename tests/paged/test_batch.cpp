// Batched compression (batch.hpp): the same result as one call per sequence, dense and paged,
// and all or nothing: a bad sequence anywhere leaves every sequence untouched.
#include <catch2/catch.hpp>

#include <limits>

#include <kvpolicy/batch.hpp>

#include "paged/paged_util.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_paged_batch {

using namespace pagedtest;
using kvpolicy::Budget;
using kvpolicy::DenseSequence;
using kvpolicy::Policy;
using Catch::Matchers::Contains;

namespace {

const kvpolicy::cpu_backend be{};
constexpr std::int64_t L = 2, H = 2, Hq = 4, D = 8, NQ = 8;

bool same_selection(const Selection& a, const Selection& b) {
  if (a.layers() != b.layers() || a.heads() != b.heads()) return false;
  for (std::int64_t r = 0; r < a.layers() * a.heads(); ++r) {
    const auto x = a.kept(r / a.heads(), r % a.heads()), y = b.kept(r / a.heads(), r % a.heads());
    if (!std::equal(x.begin(), x.end(), y.begin(), y.end())) return false;
  }
  return true;
}

// Dense sequences of different lengths, each with its own buffers.
struct DenseBatch {
  kvpolicy::Layout layout;
  std::vector<std::int64_t> lengths;
  std::vector<std::vector<float>> k, v, q;

  DenseBatch(kvtest::Rng& rng, kvpolicy::Layout lay, std::vector<std::int64_t> n)
      : layout(lay), lengths(std::move(n)) {
    for (std::int64_t t : lengths) {
      k.push_back(rng.normals<float>(L * H * t * D));
      v.push_back(rng.normals<float>(L * H * t * D));
      q.push_back(rng.normals<float>(L * Hq * NQ * D));
    }
  }
  DenseSequence<float> seq(std::size_t i) {
    return {KVView<float>::make(layout, k[i].data(), L, H, lengths[i], D),
            KVView<float>::make(layout, v[i].data(), L, H, lengths[i], D),
            KVView<const float>::hnd(q[i].data(), L, Hq, NQ, D)};
  }
  std::vector<DenseSequence<float>> seqs() {
    std::vector<DenseSequence<float>> out;
    for (std::size_t i = 0; i < lengths.size(); ++i) out.push_back(seq(i));
    return out;
  }
};

}  // namespace

TEST_CASE("compress_batch equals Policy::compress per sequence", "[batch]") {
  const std::vector<Budget> budgets = {Budget::ratio(0.5), Budget::tokens(20), Budget::ratio(0.3)};
  for (const char* spec : {"snapkv(window=8)", "h2o", "snapkv(window=8) | adakv", "knorm"})
    for (auto layout : {kvpolicy::Layout::HND, kvpolicy::Layout::NHD})
      for (bool per_seq : {false, true}) {
        INFO(spec << (per_seq ? ", one budget per sequence" : ", one budget"));
        kvtest::Rng rng(17);
        DenseBatch batch(rng, layout, {40, 73, 55}), ref = batch;
        const Policy policy(spec);
        const auto sels = kvpolicy::compress_batch(policy, be, batch.seqs(), Budget::ratio(0.5),
                                                   per_seq ? budgets : std::vector<Budget>{});
        REQUIRE(sels.size() == 3);
        for (std::size_t i = 0; i < 3; ++i) {
          auto s = ref.seq(i);
          kvpolicy::Inputs<float> in;
          in.queries = s.queries;
          const auto want = policy.compress(be, s.keys, s.values, in,
                                            per_seq ? budgets[i] : Budget::ratio(0.5));
          CHECK(same_selection(sels[i], want));
          CHECK(same_bytes(batch.k[i], ref.k[i]));
          CHECK(same_bytes(batch.v[i], ref.v[i]));
        }
      }
}

TEST_CASE("compress_batch leaves the whole batch untouched when one sequence is bad", "[batch]") {
  kvtest::Rng rng(19);
  DenseBatch batch(rng, kvpolicy::Layout::HND, {40, 73, 55});
  const DenseBatch before = batch;
  const Policy policy("snapkv(window=8)");
  auto run = [&](std::vector<DenseSequence<float>> seqs, std::vector<Budget> budgets = {}) {
    return error_of([&] {
      kvpolicy::compress_batch(policy, be, seqs, Budget::ratio(0.5), budgets);
    });
  };
  auto untouched = [&] {
    for (std::size_t i = 0; i < 3; ++i)
      if (!same_bytes(batch.k[i], before.k[i]) || !same_bytes(batch.v[i], before.v[i]))
        return false;
    return true;
  };

  batch.k[1][100] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THAT(run(batch.seqs()), Contains("sequence 1: keys contains a non-finite value"));
  batch.k[1] = before.k[1];
  CHECK(untouched());

  auto seqs = batch.seqs();
  seqs[1].keys.heads = seqs[1].values.heads = 1;
  CHECK_THAT(run(seqs), Contains("sequence 1: keys are [2,1,73,8] but sequence 0 has [2,2,40,8]"));
  seqs = batch.seqs();
  seqs[1].queries = {};
  CHECK_THAT(run(seqs), Contains("sequence 1: queries: this policy needs the last 8 queries"));
  // Passes every shape check; only the budget of sequence 1 is wrong.
  CHECK_THAT(run(batch.seqs(), {Budget::ratio(0.5), Budget::tokens(-4), Budget::ratio(0.5)}),
             Contains("sequence 1: budget is negative (-4)"));
  CHECK_THAT(run(batch.seqs(), {Budget::ratio(0.5)}), Contains("budgets: 1 budgets for 3 sequences"));
  CHECK_THAT(run(batch.seqs(), {Budget::ratio(0.5), Budget::ratio(2), Budget::ratio(0.5)}),
             Contains("sequence 1: budget ratio 2 is above 1"));
  CHECK_THAT(error_of([&] {
               kvpolicy::compress_batch(Policy("knorm | nearest"), be, batch.seqs(), Budget::ratio(0.5));
             }),
             Contains("compress_batch: policy 'knorm | nearest' has a merger stage"));
  CHECK(untouched());
}

namespace {

// A pool with several requests of different lengths, and their queries.
struct PagedBatch {
  std::int64_t P, NB;
  Pool<float> pool;
  std::vector<Seq> seqs;
  std::vector<std::vector<float>> q;

  PagedBatch(kvtest::Rng& rng, Form form, std::int64_t page_size, std::vector<std::int64_t> n)
      : P(page_size), NB(pages_for(n, page_size) + 5),
        pool(rng, form, NB, L, H, page_size, D), seqs(random_sequences(rng, NB, page_size, n)) {
    for (std::size_t i = 0; i < n.size(); ++i) q.push_back(rng.normals<float>(L * Hq * NQ * D));
  }
  std::vector<PagedSequence> paged() const {
    std::vector<PagedSequence> out;
    for (const Seq& s : seqs) out.push_back(s.seq());
    return out;
  }
  std::vector<KVView<const float>> queries() const {
    std::vector<KVView<const float>> out;
    for (const auto& x : q) out.push_back(KVView<const float>::hnd(x.data(), L, Hq, NQ, D));
    return out;
  }
};

}  // namespace

TEST_CASE("compress_paged_batch equals compress_paged per request", "[batch]") {
  for (const char* spec : {"snapkv(window=8)", "streaming", "snapkv(window=8) | adakv"})
    for (Form form : {Form::nhd, Form::hnd})
      for (std::int64_t P : {1, 16}) {
        INFO(spec << ", " << form_name(form) << ", page_size " << P);
        kvtest::Rng rng(23);
        PagedBatch batch(rng, form, P, {45, 17, 70});
        PagedBatch ref = batch;
        const Policy policy(spec);
        const std::vector<Budget> budgets = {Budget::ratio(0.5), Budget::tokens(9), Budget::ratio(0.25)};
        const auto res = kvpolicy::compress_paged_batch(policy, be, batch.pool.keys(),
                                                        batch.pool.values(), batch.paged(),
                                                        batch.queries(), Budget::ratio(1),
                                                        budgets);
        REQUIRE(res.size() == 3);
        const auto qs = ref.queries();
        for (std::size_t i = 0; i < 3; ++i) {
          const auto want = kvpolicy::compress_paged(policy, be, ref.pool.keys(), ref.pool.values(),
                                                     ref.seqs[i].seq(), qs[i], budgets[i]);
          CHECK(same_selection(res[i].selection, want.selection));
          CHECK(res[i].compact.compacted);
          CHECK(res[i].compact.new_length == want.compact.new_length);
          CHECK(res[i].compact.lengths == want.compact.lengths);
          CHECK(res[i].compact.freed_blocks == want.compact.freed_blocks);
        }
        CHECK(same_bytes(batch.pool.k, ref.pool.k));
        CHECK(same_bytes(batch.pool.v, ref.pool.v));
      }
}

TEST_CASE("compress_paged_batch checks every request before writing", "[batch]") {
  kvtest::Rng rng(29);
  PagedBatch batch(rng, Form::nhd, 4, {45, 30, 70});
  const auto k0 = batch.pool.k, v0 = batch.pool.v;
  const Policy policy("snapkv(window=8)");
  auto run = [&](std::vector<PagedSequence> seqs, std::vector<KVView<const float>> queries,
                 std::vector<Budget> budgets = {}, std::vector<std::uint8_t> shared = {}) {
    return error_of([&] {
      kvpolicy::compress_paged_batch(policy, be, batch.pool.keys(), batch.pool.values(), seqs,
                                     queries, Budget::ratio(0.5), budgets, shared);
    });
  };
  auto untouched = [&] { return same_bytes(batch.pool.k, k0) && same_bytes(batch.pool.v, v0); };

  // Request 2 borrows a block of request 0.
  auto tables = batch.seqs;
  tables[2].table[5] = tables[0].table[1];
  std::vector<PagedSequence> seqs;
  for (const Seq& s : tables) seqs.push_back(s.seq());
  CHECK_THAT(run(seqs, batch.queries()),
             Contains("sequence 2: seq: block " + std::to_string(tables[0].table[1]) +
                      " is also in the block table of sequence 0"));
  // ... which is fine for a shared (prefix-cache) block: no request writes it. A request whose
  // compaction would write it reports the conflict and is left as it was.
  {
    const std::int32_t b = tables[0].table[1];
    std::vector<std::uint8_t> shared(static_cast<std::size_t>(batch.NB), 0);
    shared[static_cast<std::size_t>(b)] = 1;
    auto block = [&] {
      std::vector<float> out;
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t t = 0; t < 4; ++t)
            for (std::int64_t e = 0; e < D; ++e) out.push_back(batch.pool.keys().row(l, b, h, t)[e]);
      return out;
    };
    const auto b0 = block();
    const auto res = kvpolicy::compress_paged_batch(policy, be, batch.pool.keys(), batch.pool.values(),
                                                    seqs, batch.queries(), Budget::ratio(0.5), {}, shared);
    CHECK(block() == b0);
    for (const auto& r : res)
      CHECK((r.compact.compacted || r.compact.shared_conflicts == std::vector<std::int32_t>{b}));
    CHECK_FALSE(res[0].compact.compacted);  // at ratio 0.5 a kept token moves into its page 1
    batch.pool.k = k0;
    batch.pool.v = v0;
  }
  CHECK_THAT(run(batch.paged(), {batch.queries()[0]}), Contains("queries: 1 views for 3 requests"));

  auto bad = batch.paged();
  bad[1].length = 200;
  CHECK_THAT(run(bad, batch.queries()), Contains("sequence 1: seq: block table has 8 entries but length 200 needs 50 pages"));
  // Selection of the middle request fails (too few queries) after request 0 was selected.
  auto qs = batch.queries();
  qs[1].tokens = 4;
  CHECK_THAT(run(batch.paged(), qs), Contains("sequence 1: snapkv: needs the last 8 queries, got 4"));
  CHECK_THAT(run(batch.paged(), batch.queries(), {Budget::ratio(0.5), Budget::tokens(-3), Budget::ratio(0.5)}),
             Contains("sequence 1: budget is negative (-3)"));
  batch.pool.k[static_cast<std::size_t>(batch.pool.keys().row(1, batch.seqs[1].table[2], 0, 1) - batch.pool.k.data())] =
      std::numeric_limits<float>::infinity();
  CHECK_THAT(run(batch.paged(), batch.queries()), Contains("sequence 1: keys contains a non-finite value (inf) at layer 1, head 0, token 9"));
  batch.pool.k = k0;
  CHECK(untouched());
}

}  // namespace kvt_paged_batch
