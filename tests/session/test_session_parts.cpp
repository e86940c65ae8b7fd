// The parts a Session is made of: the query ring (hand-computed contents after wrapping), the
// compression schedule (hand-computed budgets and due checks) and the stage traits it reads
// instead of testing stage types (accumulation, delimiters).
#include <catch2/catch.hpp>

#include <optional>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

namespace kvt_session_parts {

using namespace kvpolicy;
using Catch::Contains;

TEST_CASE("query ring: keeps the newest window queries per head, oldest first", "[session][ring]") {
  // 2 heads, window 3, dim 2; query t of head h is (10 h + t, -(10 h + t)).
  auto block = [](std::int64_t first, std::int64_t n, std::vector<float>& buf) {
    buf.clear();
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t t = first; t < first + n; ++t) {
        buf.push_back(static_cast<float>(10 * h + t));
        buf.push_back(-static_cast<float>(10 * h + t));
      }
    return KVView<const float>::hnd(buf.data(), 1, 2, n, 2);
  };
  detail::QueryRing<float> ring(2, 3, 2);
  std::vector<float> in, out;
  ring.push(block(0, 2, in));  // queries 0, 1
  REQUIRE(ring.size() == 2);
  KVView<const float> v = ring.newest(2, out);
  CHECK(out == std::vector<float>{0, 0, 1, -1, 10, -10, 11, -11});
  ring.push(block(2, 3, in));  // 2, 3, 4: the ring wraps; 0 and 1 are gone
  REQUIRE(ring.size() == 3);
  v = ring.newest(3, out);
  CHECK(v.heads == 2);
  CHECK(v.tokens == 3);
  CHECK(out == std::vector<float>{2, -2, 3, -3, 4, -4, 12, -12, 13, -13, 14, -14});
  ring.newest(1, out);
  CHECK(out == std::vector<float>{4, -4, 14, -14});
  ring.push(block(5, 7, in));  // more than the window at once: only 9, 10, 11 stay
  ring.newest(3, out);
  CHECK(out == std::vector<float>{9, -9, 10, -10, 11, -11, 19, -19, 20, -20, 21, -21});
  CHECK_THROWS_WITH(ring.newest(4, out), Contains("4 queries asked, 3 held"));
  detail::QueryRing<float> none(2, 0, 2);  // a policy that reads no queries records none
  none.push(block(0, 2, in));
  CHECK(none.size() == 0);
}

TEST_CASE("stage traits: accumulation and delimiters without type tests", "[session][traits]") {
  CHECK(Policy("h2o").accumulation() == GqaReduce::mean);
  CHECK(Policy("h2o(reduce=sum)").accumulation() == GqaReduce::sum);
  CHECK(Policy("h2o(preset=observed) | adakv").decode_time());
  CHECK_FALSE(Policy("snapkv").accumulation().has_value());
  CHECK_FALSE(Policy("int2").decode_time());
  // A merger that reads no delimiters (nearest) leaves the default set; semantic's own set wins.
  CHECK(Policy("snapkv | nearest").delimiter_set() == Policy("snapkv").delimiter_set());
  CHECK(Policy("snapkv | semantic(delimiters=ab)").delimiter_set() == "ab");
  CHECK(Policy("snapkv | semantic(delimiters=ab)").is_delimiter("b"));
  CHECK_FALSE(Policy("snapkv | semantic(delimiters=ab)").is_delimiter("."));
  CHECK(Policy("snapkv").is_delimiter("."));
  // h2o's max reduction cannot be accumulated step by step: refused by name.
  SessionConfig cfg;
  cfg.layers = 1;
  cfg.kv_heads = 1;
  cfg.q_heads = 1;
  cfg.head_dim = 4;
  CHECK_THROWS_WITH(Session<float>(Policy("h2o(reduce=max)"), cfg),
                    Contains("session: h2o with reduce=max cannot be accumulated step by step"));
}

TEST_CASE("compression schedule: prefill budgets, decode-time checks, targets once",
          "[session][schedule]") {
  detail::CompressionSchedule s;
  CHECK_FALSE(s.started());
  // Prefill of 10 / 10 / 10 tokens with budgets 4, 4, 20: heads 0 and 1 evicted (head 1 kept 3,
  // fewer than asked: an allocator moved budget), head 2 kept all and keeps its budget of 20.
  const std::vector<std::int64_t> lengths = {10, 10, 10};
  s.appended(10);
  s.compressed({4, 4, 20}, std::vector<std::int64_t>{4, 3, 10}, lengths, 10);
  REQUIRE(s.started());
  CHECK(s.budgets == std::vector<std::int64_t>{4, 3, 20});
  CHECK(s.prompt_length == 10);
  CHECK(s.since == 0);
  int asked = 0;
  auto no_targets = [&](std::int64_t) {
    ++asked;
    return std::optional<std::vector<std::int64_t>>();
  };
  // Interval 2: one token is not enough; after two, head 0 (4 + 2 > 4) is due.
  s.appended(1);
  CHECK_FALSE(s.due(2, std::vector<std::int64_t>{5, 4, 11}, no_targets));
  s.appended(1);
  CHECK(s.due(2, std::vector<std::int64_t>{6, 5, 12}, no_targets));
  CHECK(asked == 1);  // asked again at every check while there are none
  // No head above its budget: not due, whatever the interval.
  CHECK_FALSE(s.due(2, std::vector<std::int64_t>{4, 3, 20}, no_targets));
  CHECK_FALSE(s.due(0, std::vector<std::int64_t>{40, 40, 40}, no_targets));  // 0: never
  // Later events keep the budgets they were given; since restarts.
  s.compressed({4, 3, 20}, std::vector<std::int64_t>{4, 3, 12}, std::vector<std::int64_t>{6, 5, 12}, 12);
  CHECK(s.budgets == std::vector<std::int64_t>{4, 3, 20});
  CHECK(s.since == 0);
  CHECK(s.prompt_length == 10);
  // Decode targets replace the budgets once, from the prompt length.
  int targets_asked = 0;
  auto targets = [&](std::int64_t prompt) {
    ++targets_asked;
    return std::optional(std::vector<std::int64_t>{prompt / 2, prompt / 2, prompt / 2});
  };
  s.appended(2);
  CHECK(s.due(2, std::vector<std::int64_t>{6, 5, 14}, targets));  // 6 > 5
  CHECK(s.budgets == std::vector<std::int64_t>{5, 5, 5});
  CHECK(s.due(2, std::vector<std::int64_t>{6, 5, 5}, targets));
  CHECK(targets_asked == 1);
  s.restart();
  CHECK_FALSE(s.started());
  CHECK_FALSE(s.targets_set);
}

}  // namespace kvt_session_parts
