// Helpers shared by the C ABI tests: caller-owned selection buffers, policy creation, and a check
// on the thread's last error message.
#pragma once
#include <catch2/catch.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "kvpolicy/c/kvpolicy.h"

namespace ctest {

// A kvp_selection over owned buffers, pre-filled with -1 so a test can tell what was written.
struct SelOut {
  std::vector<std::int64_t> counts;
  std::vector<std::int32_t> idx;
  kvp_selection sel{};
  SelOut(std::int64_t L, std::int64_t H, std::int64_t cap)
      : counts(static_cast<std::size_t>(L * H), -1),
        idx(static_cast<std::size_t>(L * H * cap), -1) {
    sel = {L, H, cap, counts.data(), idx.data()};
  }
  std::vector<std::int32_t> row(std::int64_t r) const {
    auto b = idx.begin() + r * sel.capacity;
    return {b, b + counts[static_cast<std::size_t>(r)]};
  }
};

inline kvp_policy* make(const char* spec) {
  kvp_policy* p = nullptr;
  REQUIRE(kvp_policy_create(spec, &p) == KVP_OK);
  REQUIRE(p != nullptr);
  return p;
}

inline bool mentions(const char* needle) {
  return std::string(kvp_last_error()).find(needle) != std::string::npos;
}

}  // namespace ctest
