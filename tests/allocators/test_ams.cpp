// AMS: the mass, the EMA credit, the cumulative-mass cuts with min/max segment lengths and the
// quota arithmetic by hand; a whole event by hand; a constructed "region wipe-out" that a global
// top-k empties and AMS does not; credit state carried across events; spec parameters.
#include <cmath>
#include <numeric>
#include <vector>

#include "allocators/alloc_util.hpp"
#include "scorers/naive.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_allocators_ams {

using namespace kvpolicy;
using alloc_test::context;
using ams::Segment;
using Catch::Contains;

namespace {

std::vector<std::int64_t> lengths_to_quotas(const std::vector<std::int64_t>& len,
                                            const std::vector<double>& mass, std::int64_t B,
                                            std::int64_t min_keep) {
  std::vector<Segment> segs;
  std::int64_t at = 0;
  for (auto n : len) {
    segs.push_back({at, at + n});
    at += n;
  }
  return ams::quotas(segs, mass, B, min_keep);
}

// An event of one row: scores, and window attention of `w` queries in stats.
struct Event {
  ScoreMap scores;
  Stats stats;
  AllocContext ctx;
  Event(const std::vector<float>& s, const std::vector<float>& attn, std::int64_t w, Protect p) {
    const auto T = static_cast<std::int64_t>(s.size());
    scores.resize(1, 1, T);
    std::copy(s.begin(), s.end(), scores.data());
    ScoreMap& a = stats.slot(w, GqaReduce::mean);
    a.resize(1, 1, T);
    std::copy(attn.begin(), attn.end(), a.data());
    ctx = context(scores, p);
    ctx.stats = &stats;
    ctx.queries = w;
  }
  std::vector<std::int32_t> keep(const AMS& a, std::int64_t B) {
    std::vector<std::int64_t> b{B};
    a.allocate(ctx, b);
    Selection sel;
    cpu::select(cpu_backend{1}, scores, b, ctx.protect, sel);
    auto k = sel.kept(0, 0);
    return {k.begin(), k.end()};
  }
};

}  // namespace

TEST_CASE("ams: mass and EMA credit by hand", "[allocators][ams]") {
  std::vector<double> x = {1, 3, -2, 0};
  ams::normalize(x);
  CHECK(x[0] == Approx(0.25));
  CHECK(x[1] == Approx(0.75));
  CHECK(x[2] == Approx(0).margin(1e-11));
  // Window of 2: tokens 0..5 pooled (kernel 1: as they are), the window gets their maximum 6.
  const std::vector<float> attn = {1, 2, 3, 4, 5, 6, 7, 8};
  auto m = ams::current_mass(attn, 2, 1);
  CHECK(m[0] == Approx(1.0 / 33));
  CHECK(m[5] == Approx(6.0 / 33));
  CHECK(m[6] == Approx(6.0 / 33));
  CHECK(m[7] == Approx(6.0 / 33));
  // Kernel 3, average counting the padding (PyTorch's default): 1, 2, 3, 4, 5, 11/3; max 5.
  m = ams::current_mass(attn, 2, 3);
  CHECK(m[0] == Approx(1.0 / (86.0 / 3)));
  CHECK(m[5] == Approx(11.0 / 86));
  CHECK(m[7] == Approx(15.0 / 86));
  // No token before the window: uniform.
  m = ams::current_mass(attn, 8, 5);
  for (double v : m) CHECK(v == Approx(0.125));

  // credit = 0.8 prev + 0.2 m_cur = [0.45, 0.05, 0.25, 0.25] (sums to 1);
  // m = 0.7 m_cur + 0.3 credit = [0.31, 0.19, 0.25, 0.25].
  std::vector<float> credit = {0.5f, 0.f, 0.25f, 0.25f};
  const std::vector<double> cur(4, 0.25);
  m = ams::update_credit(credit, cur, 0.8, 0.7);
  CHECK(credit[0] == Approx(0.45));
  CHECK(credit[1] == Approx(0.05));
  CHECK(credit[2] == Approx(0.25));
  CHECK(m[0] == Approx(0.31));
  CHECK(m[1] == Approx(0.19));
  CHECK(m[3] == Approx(0.25));
  // A second event: credit = 0.8 [0.45, 0.05, 0.25, 0.25] + 0.2 [1, 0, 0, 0].
  m = ams::update_credit(credit, std::vector<double>{1, 0, 0, 0}, 0.8, 0.7);
  CHECK(credit[0] == Approx(0.56));
  CHECK(credit[1] == Approx(0.04));
  CHECK(m[0] == Approx(0.7 + 0.3 * 0.56));
  // No history: m is m_cur.
  std::vector<float> zero(4, 0.f);
  m = ams::update_credit(zero, std::vector<double>{0.1, 0.2, 0.3, 0.4}, 0.8, 0.7);
  CHECK(m[2] == Approx(0.3));
  CHECK(zero[2] == Approx(0.06));
}

TEST_CASE("ams: cuts at cumulative mass, split long, merge short", "[allocators][ams]") {
  const std::vector<double> flat(8, 0.125);
  // Targets 0.25, 0.5, 0.75 are first reached at tokens 1, 3, 5, which start new segments.
  CHECK(ams::segments(flat, 0.25, 1, 100) ==
        std::vector<Segment>{{0, 1}, {1, 3}, {3, 5}, {5, 8}});
  // min_seg_len 2: [0, 1) merged forward.
  CHECK(ams::segments(flat, 0.25, 2, 100) == std::vector<Segment>{{0, 3}, {3, 5}, {5, 8}});
  // max_seg_len 2: [5, 8) split into [5, 7) + [7, 8); the short last piece stays.
  CHECK(ams::segments(flat, 0.25, 1, 2) ==
        std::vector<Segment>{{0, 1}, {1, 3}, {3, 5}, {5, 7}, {7, 8}});
  // min_seg_len 3 merges [0,1)+[1,3) and [3,5)+[5,8).
  CHECK(ams::segments(flat, 0.25, 3, 100) == std::vector<Segment>{{0, 3}, {3, 8}});
  // A mass spike on token 0: every target is reached there; cuts clamp to 1 and deduplicate.
  CHECK(ams::segments(std::vector<double>{0.9, 0.02, 0.02, 0.02, 0.02, 0.02}, 0.3, 1, 100) ==
        std::vector<Segment>{{0, 1}, {1, 6}});
  // segment_mass 1: one segment; one token: one segment.
  CHECK(ams::segments(flat, 1.0, 1, 100) == std::vector<Segment>{{0, 8}});
  CHECK(ams::segments(std::vector<double>{1.0}, 0.02, 1, 100) == std::vector<Segment>{{0, 1}});
}

TEST_CASE("ams: quota arithmetic by hand", "[allocators][ams]") {
  // min 8 each = 32; remain 8 by mass: round(0.8, 1.6, 2.4, 3.2) = 1, 2, 2, 3.
  CHECK(lengths_to_quotas({10, 20, 30, 40}, {0.1, 0.2, 0.3, 0.4}, 40, 8) ==
        std::vector<std::int64_t>{9, 10, 10, 11});
  // Equal masses, remain 2: round(0.5) = 0 each, then +1 round-robin from segment 0.
  CHECK(lengths_to_quotas({10, 10, 10, 10}, {0.25, 0.25, 0.25, 0.25}, 34, 8) ==
        std::vector<std::int64_t>{9, 9, 8, 8});
  // Rounding overshoots (2 + 2 + 2 > 5): -1 round-robin from segment 0.
  CHECK(lengths_to_quotas({20, 20, 20}, {1.0 / 3, 1.0 / 3, 1.0 / 3}, 5, 0) ==
        std::vector<std::int64_t>{1, 2, 2});
  // Capped at the length (4); the rest goes round-robin to the only segment with room.
  CHECK(lengths_to_quotas({4, 100}, {0.9, 0.1}, 50, 8) == std::vector<std::int64_t>{4, 46});
  // Minimums alone exceed the budget: lowered round-robin to 1, then to 0.
  CHECK(lengths_to_quotas({10, 10, 10, 10, 10}, std::vector<double>(5, 0.2), 12, 8) ==
        std::vector<std::int64_t>{2, 2, 2, 3, 3});
  CHECK(lengths_to_quotas({10, 10, 10, 10, 10}, std::vector<double>(5, 0.2), 3, 8) ==
        std::vector<std::int64_t>{0, 0, 1, 1, 1});
  // Short segments: their minimum is their length.
  CHECK(lengths_to_quotas({3, 30}, {0.5, 0.5}, 20, 8) == std::vector<std::int64_t>{3, 17});
  REQUIRE_THROWS_WITH(lengths_to_quotas({3, 4}, {0.5, 0.5}, 8, 1), Contains("ams: budget 8"));
}

TEST_CASE("ams: random quotas sum exactly, within [minimum, length]", "[allocators][ams]") {
  kvtest::Rng rng(77);
  for (int it = 0; it < 500; ++it) {
    const auto n = static_cast<std::size_t>(rng.integer(1, 40));
    std::vector<std::int64_t> len(n);
    std::vector<double> mass(n);
    std::int64_t total = 0, mins = 0;
    const std::int64_t min_keep = rng.integer(0, 12);
    for (std::size_t i = 0; i < n; ++i) {
      len[i] = rng.integer(1, 80);
      mass[i] = rng.integer(0, 5) == 0 ? 0.0 : rng.uniform(0, 1);
      total += len[i];
      mins += std::min(len[i], min_keep);
    }
    const std::int64_t B = rng.integer(0, total);
    const auto q = lengths_to_quotas(len, mass, B, min_keep);
    REQUIRE(alloc_test::sum(q) == B);
    for (std::size_t i = 0; i < n; ++i) {
      REQUIRE(q[i] >= 0);
      REQUIRE(q[i] <= len[i]);
      if (B >= mins) REQUIRE(q[i] >= std::min(len[i], min_keep));
    }
  }
}

TEST_CASE("ams: a whole event by hand", "[allocators][ams]") {
  // T = 16, window 4 (tokens 12..15), kernel 1, no protected tokens, min_keep 1,
  // segment_mass 0.33. Attention [4 x4, 1 x8 | window] -> window gets 4 -> mass
  // [.1 x4, .025 x8, .1 x4]; cumulative .1 .2 .3 .4 ... .6 .7 .8 .9 1: targets .33, .66, .99 are
  // reached at tokens 3, 12, 15: segments [0,3) [3,12) [12,15) [15,16), masses .3 .3 .3 .1.
  // Quotas for B = 8: 1 each + round(4 x (.3, .3, .3, .1)) = 2, 2, 2, 1 = 7, +1 to segment 0:
  // 3, 2, 2, 1. Candidates: all of [0,3); tokens 3 and 5 (0.9, 0.8); 13 and 12 (0.6, 0.5); 15.
  AMS a;
  a.window = 4;
  a.kernel = 1;
  a.segment_mass = 0.33;
  a.min_seg_len = 1;
  a.min_keep = 1;
  a.sinks = a.keep_last = 0;
  const std::vector<float> attn = {4, 4, 4, 4, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0};
  const std::vector<float> s = {0.1f, 0.2f, 0.3f, 0.9f, 0.1f, 0.8f, 0.1f, 0.1f,
                                0.1f, 0.1f, 0.1f, 0.7f, 0.5f, 0.6f, 0.4f, 0.05f};
  Event ev(s, attn, 4, {});
  CHECK(ev.keep(a, 8) == std::vector<std::int32_t>{0, 1, 2, 3, 5, 12, 13, 15});
  // A global top-8 would have kept 1, 2, 3, 5, 11, 12, 13, 14 instead.
  Selection plain;
  cpu::select(cpu_backend{1}, Event(s, attn, 4, {}).scores, std::vector<std::int64_t>{8},
              Protect{}, plain);
  auto k = plain.kept(0, 0);
  CHECK(std::vector<std::int32_t>(k.begin(), k.end()) ==
        std::vector<std::int32_t>{1, 2, 3, 5, 11, 12, 13, 14});
  // Non-candidates are masked in the scores the selection used.
  CHECK(std::isinf(ev.scores.data()[11]));
  CHECK(ev.scores.data()[3] == 0.9f);
}

TEST_CASE("ams: a region that global top-k wipes out keeps min_keep tokens", "[allocators][ams]") {
  // T = 200, 4 sinks + last 32 protected, budget 100. Tokens [60, 120) score 0.5, every other
  // unprotected token 1.0: the 64 free slots all go outside the region under a global top-k.
  const std::int64_t T = 200, B = 100;
  std::vector<float> s(T, 1.0f), attn(T, 1.0f);
  for (std::int64_t j = 60; j < 120; ++j) s[static_cast<std::size_t>(j)] = 0.5f;
  const Protect p{4, 32};
  Selection plain;
  {
    Event ev(s, attn, 32, p);
    cpu::select(cpu_backend{1}, ev.scores, std::vector<std::int64_t>{B}, p, plain);
  }
  std::int64_t in_region = 0;
  for (auto j : plain.kept(0, 0)) in_region += j >= 60 && j < 120;
  REQUIRE(in_region == 0);

  const AMS a;  // defaults: min_keep 8, min_seg_len 32, segment_mass 0.02
  Event ev(s, attn, 32, p);
  const auto kept = ev.keep(a, B);
  CHECK(static_cast<std::int64_t>(kept.size()) == B);
  in_region = 0;
  for (auto j : kept) in_region += j >= 60 && j < 120;
  CHECK(in_region >= a.min_keep);
  // Every segment of the unprotected middle [4, 168) keeps at least min(len, 8).
  std::vector<float> no_credit(T, 0.f);
  const auto m = a.mass(attn, 32, no_credit);
  std::vector<double> mid(m.begin() + 4, m.begin() + 168);
  ams::normalize(mid);
  const auto segs = ams::segments(mid, a.segment_mass, a.min_seg_len, a.max_seg_len);
  CHECK(segs.size() >= 4);
  for (const auto& seg : segs) {
    std::int64_t n = 0;
    for (auto j : kept) n += j >= 4 + seg.begin && j < 4 + seg.end;
    CHECK(n >= std::min<std::int64_t>(seg.size(), a.min_keep));
  }
  for (std::int64_t j = 0; j < 4; ++j) CHECK(std::count(kept.begin(), kept.end(), j) == 1);
  for (std::int64_t j = T - 32; j < T; ++j) CHECK(std::count(kept.begin(), kept.end(), j) == 1);
}

TEST_CASE("ams: credit state is read and written per token", "[allocators][ams]") {
  const std::int64_t T = 64;
  kvtest::Rng rng(4);
  std::vector<float> s(T), attn(T);
  for (auto& x : s) x = static_cast<float>(rng.uniform(0, 1));
  for (auto& x : attn) x = static_cast<float>(rng.uniform(0, 1));
  AMS a;
  a.window = 8;
  a.min_seg_len = 8;
  a.min_keep = 0;  // quotas by mass alone
  a.sinks = 2;
  a.keep_last = 8;
  // Two rows of state with a stride above T, the second (unused) row must stay untouched.
  const std::int64_t stride = 80;
  std::vector<float> state(2 * stride, 0.f), prev(T);
  for (std::int64_t j = 0; j < T; ++j) state[j] = prev[j] = static_cast<float>(rng.uniform(0, 0.05));
  state[stride] = 123.f;
  Event ev(s, attn, 8, {2, 8});
  ev.ctx.state = state.data();
  ev.ctx.state_stride = stride;
  ev.keep(a, 24);
  const auto m_cur = ams::current_mass(attn, 8, a.kernel);
  for (std::int64_t j = 0; j < T; ++j)
    CHECK(state[j] == Approx(0.8 * prev[j] + 0.2 * m_cur[j]).margin(1e-7));
  CHECK(state[stride] == 123.f);
  // Credit changes the choice: with a large credit on tokens 20..27 their segment grows.
  Event fresh(s, attn, 8, {2, 8});
  const auto without = fresh.keep(a, 24);
  std::vector<float> heavy(stride, 0.f);
  for (std::int64_t j = 20; j < 28; ++j) heavy[j] = 5.f;
  Event with(s, attn, 8, {2, 8});
  with.ctx.state = heavy.data();
  with.ctx.state_stride = stride;
  const auto with_credit = with.keep(a, 24);
  auto count = [](const std::vector<std::int32_t>& k) {
    return std::count_if(k.begin(), k.end(), [](std::int32_t j) { return j >= 20 && j < 28; });
  };
  CHECK(count(with_credit) > count(without));
}

TEST_CASE("ams: through a Policy, conservation and protected tokens", "[allocators][ams]") {
  kvtest::Rng rng(12);
  const Policy p("snapkv(window=8) | ams(window=16, min_seg_len=8)");
  CHECK(p.query_window() == 16);
  CHECK(p.protect(100, 50).sinks == 4);
  CHECK(p.protect(100, 50).recent == 32);
  CHECK(has(Policy("knorm | ams").needs(), Needs::queries));
  CHECK(Policy("h2o | ams").query_window() == 32);
  CHECK(p.alloc_state());
  CHECK_FALSE(Policy("snapkv | pyramid | adakv").alloc_state());
  for (int it = 0; it < 40; ++it) {
    const std::int64_t L = rng.integer(1, 3), H = rng.integer(1, 3), T = rng.integer(1, 180);
    const auto c = naive::random_case<float>(rng, L, H, 2, T, std::min<std::int64_t>(T, 16), 8,
                                             Layout::HND);
    const std::int64_t B = rng.integer(std::min<std::int64_t>(T, 36), T + 3);
    const Selection sel = p.select(cpu_backend{1}, c.inputs(), Budget::tokens(B));
    alloc_test::require_valid(sel, T, {4, 32});
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t h = 0; h < H; ++h) REQUIRE(sel.count(l, h) == std::min(B, T));
  }
  const auto c = naive::random_case<float>(rng, 1, 1, 1, 64, 8, 8, Layout::HND);
  // Below what scorer and allocator protect: the newest 30, with a warning.
  const Selection cut = p.select(cpu_backend{1}, c.inputs(), Budget::tokens(30));
  CHECK(cut.count(0, 0) == 30);
  CHECK(cut.kept(0, 0).front() == 34);
  CHECK_THAT(cut.warning(), Contains("below the 36 tokens snapkv and its allocators protect (4 sinks + "
                                     "32 recent): kept the newest 30 instead"));
  Inputs<float> no_q = c.inputs();
  no_q.queries = {};
  REQUIRE_THROWS_WITH(Policy("knorm | ams").select(cpu_backend{1}, no_q, Budget::tokens(40)),
                      Contains("needs the last 32 queries"));
}

TEST_CASE("ams: spec parameters", "[allocators][ams][spec]") {
  const Policy p("tova | ams(window=16, kernel=3, segment_mass=0.05, min_seg_len=16, "
                 "max_seg_len=256, min_keep=4, sinks=2, keep_last=8, lambda=0.5, beta=0.9)");
  const auto& a = std::get<AMS>(p.allocators().at(0));
  CHECK(a.window == 16);
  CHECK(a.kernel == 3);
  CHECK(a.segment_mass == 0.05);
  CHECK(a.min_seg_len == 16);
  CHECK(a.max_seg_len == 256);
  CHECK(a.min_keep == 4);
  CHECK(a.sinks == 2);
  CHECK(a.keep_last == 8);
  CHECK(a.lambda == 0.5);
  CHECK(a.beta == 0.9);
  const AMS d = std::get<AMS>(Policy("tova | ams").allocators().at(0));
  CHECK(d.window == 32);
  CHECK(d.segment_mass == 0.02);
  CHECK(d.min_seg_len == 32);
  CHECK(d.max_seg_len == 1024);
  CHECK(d.min_keep == 8);
  CHECK(d.lambda == 0.8);
  CHECK(d.beta == 0.7);
  auto bad = [](const std::string& params) { return Policy("tova | ams(" + params + ")"); };
  REQUIRE_THROWS_WITH(bad("window=0"), Contains("ams: window must be >= 1"));
  REQUIRE_THROWS_WITH(bad("kernel=4"), Contains("ams: kernel must be odd"));
  REQUIRE_THROWS_WITH(bad("segment_mass=0"), Contains("ams: segment_mass must be in (0, 1]"));
  REQUIRE_THROWS_WITH(bad("segment_mass=1.5"), Contains("ams: segment_mass must be in (0, 1]"));
  REQUIRE_THROWS_WITH(bad("min_seg_len=0"), Contains("ams: min_seg_len must be >= 1"));
  REQUIRE_THROWS_WITH(bad("min_seg_len=64, max_seg_len=32"),
                      Contains("ams: max_seg_len (32) must be >= min_seg_len (64)"));
  REQUIRE_THROWS_WITH(bad("min_keep=-1"), Contains("ams: min_keep must be >= 0"));
  REQUIRE_THROWS_WITH(bad("sinks=-1"), Contains("ams: sinks must be >= 0"));
  REQUIRE_THROWS_WITH(bad("keep_last=-1"), Contains("ams: keep_last must be >= 0"));
  REQUIRE_THROWS_WITH(bad("lambda=1"), Contains("ams: lambda must be in [0, 1)"));
  REQUIRE_THROWS_WITH(bad("beta=1.1"), Contains("ams: beta must be in [0, 1]"));
  REQUIRE_THROWS_WITH(bad("lambda=abc"), Contains("'lambda' expects a number"));
  REQUIRE_THROWS_WITH(bad("segments=3"), Contains("unknown parameter 'segments'"));
}

}  // namespace kvt_allocators_ams
