#include <catch2/catch.hpp>
#include <kvpolicy/kvpolicy.hpp>

TEST_CASE("policy parses a spec", "[policy]") {
  kvpolicy::Policy p("snapkv(window=8) | uniform");
  REQUIRE(p.scorer_name() == "snapkv");
}
