// Dequantization of every block type the engine supports: hand-built blocks with values worked
// out from the format, and random blocks decoded by gguf-py (golden/quant_blocks.json).
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/ggml_types.hpp"
#include "engine_test_util.hpp"
#include "kvpolicy/core/error.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_engine_ggml_types {

namespace eng = kvpolicy::engine;
using Catch::Matchers::Contains;

namespace {
std::vector<float> dq(std::uint32_t type, const std::vector<std::uint8_t>& src, std::size_t n) {
  std::vector<float> out(n);
  eng::dequantize(type, src, out);
  return out;
}
void put16(std::vector<std::uint8_t>& b, std::uint16_t v) {
  b.push_back(static_cast<std::uint8_t>(v & 0xFF));
  b.push_back(static_cast<std::uint8_t>(v >> 8));
}
constexpr std::uint16_t kHalf = 0x3800, kMinusOne = 0xBC00, kTwo = 0x4000, kQuarter = 0x3400;
}  // namespace

TEST_CASE("ggml: hand-built Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks", "[engine][quant]") {
  // Q4_0: x = (nibble - 8) * d; low nibbles are elements 0..15, high nibbles 16..31.
  std::vector<std::uint8_t> q40;
  put16(q40, kHalf);
  for (int j = 0; j < 16; ++j) q40.push_back(static_cast<std::uint8_t>(j | ((15 - j) << 4)));
  auto y = dq(eng::ggml_type::Q4_0, q40, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[static_cast<std::size_t>(j)] == 0.5f * static_cast<float>(j - 8));
    CHECK(y[static_cast<std::size_t>(j + 16)] == 0.5f * static_cast<float>(7 - j));
  }
  // Q4_1: x = nibble * d + m.
  std::vector<std::uint8_t> q41;
  put16(q41, kTwo);
  put16(q41, kMinusOne);
  for (int j = 0; j < 16; ++j) q41.push_back(static_cast<std::uint8_t>(j | ((15 - j) << 4)));
  y = dq(eng::ggml_type::Q4_1, q41, 32);
  for (int j = 0; j < 16; ++j) {
    CHECK(y[static_cast<std::size_t>(j)] == 2.0f * static_cast<float>(j) - 1.0f);
    CHECK(y[static_cast<std::size_t>(j + 16)] == 2.0f * static_cast<float>(15 - j) - 1.0f);
  }
  // Q5_0: the fifth bit of element j is bit j of qh (elements 16..31: bits 16..31); x = (q - 16) d.
  std::vector<std::uint8_t> q50;
  put16(q50, kQuarter);
  const std::uint32_t qh = 0xA5A5F00Fu;
  for (int k = 0; k < 4; ++k) q50.push_back(static_cast<std::uint8_t>(qh >> (8 * k)));
  for (int j = 0; j < 16; ++j) q50.push_back(static_cast<std::uint8_t>(j | ((j ^ 5) << 4)));
  y = dq(eng::ggml_type::Q5_0, q50, 32);
  for (int j = 0; j < 16; ++j) {
    const int lo = j | (((qh >> j) & 1) << 4), hi = (j ^ 5) | (((qh >> (j + 16)) & 1) << 4);
    CHECK(y[static_cast<std::size_t>(j)] == 0.25f * static_cast<float>(lo - 16));
    CHECK(y[static_cast<std::size_t>(j + 16)] == 0.25f * static_cast<float>(hi - 16));
  }
  // Q5_1: same bits, x = q d + m.
  std::vector<std::uint8_t> q51;
  put16(q51, kQuarter);
  put16(q51, kMinusOne);
  for (std::size_t k = 2; k < q50.size(); ++k) q51.push_back(q50[k]);
  y = dq(eng::ggml_type::Q5_1, q51, 32);
  for (int j = 0; j < 16; ++j) {
    const int lo = j | (((qh >> j) & 1) << 4), hi = (j ^ 5) | (((qh >> (j + 16)) & 1) << 4);
    CHECK(y[static_cast<std::size_t>(j)] == 0.25f * static_cast<float>(lo) - 1.0f);
    CHECK(y[static_cast<std::size_t>(j + 16)] == 0.25f * static_cast<float>(hi) - 1.0f);
  }
  // Q8_0 over two blocks: x = int8 * d.
  std::vector<std::uint8_t> q80;
  for (int blk = 0; blk < 2; ++blk) {
    put16(q80, blk ? kTwo : kHalf);
    for (int j = 0; j < 32; ++j)
      q80.push_back(static_cast<std::uint8_t>(static_cast<std::int8_t>(j * 8 - 128)));
  }
  y = dq(eng::ggml_type::Q8_0, q80, 64);
  for (int j = 0; j < 32; ++j) {
    CHECK(y[static_cast<std::size_t>(j)] == 0.5f * static_cast<float>(j * 8 - 128));
    CHECK(y[static_cast<std::size_t>(32 + j)] == 2.0f * static_cast<float>(j * 8 - 128));
  }
}

TEST_CASE("ggml: every supported type matches gguf-py on random blocks", "[engine][quant]") {
  std::ifstream in(kvp_engine_test::golden_dir() / "quant_blocks.json");
  REQUIRE(in);
  const auto j = nlohmann::json::parse(in);
  std::vector<std::string> seen;
  for (const auto& [name, c] : j.items()) {
    INFO("type " << name);
    const auto id = c["id"].get<std::uint32_t>();
    const auto hex = c["hex"].get<std::string>();
    std::vector<std::uint8_t> raw;
    for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
      raw.push_back(static_cast<std::uint8_t>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    const auto& vals = c["values"];
    const auto y = dq(id, raw, vals.size());
    for (std::size_t i = 0; i < vals.size(); ++i) {
      if (vals[i].is_string()) {
        CHECK(std::isinf(y[i]));
        CHECK((y[i] < 0) == (vals[i].get<std::string>()[0] == '-'));
        continue;
      }
      const auto expect = vals[i].get<double>();
      // gguf-py evaluates some products in another order; one float rounding at most.
      if (std::abs(y[i] - expect) > 1e-6 * std::max(1.0, std::abs(expect)))
        FAIL(name << " element " << i << ": " << y[i] << " vs " << expect);
    }
    seen.push_back(name);
  }
  CHECK(seen.size() == 12);
}

TEST_CASE("ggml: dequantize rejects bad sizes and unsupported types", "[engine][quant]") {
  std::vector<std::uint8_t> src(20);
  std::vector<float> dst(32);
  CHECK_THROWS_WITH(eng::dequantize(eng::ggml_type::Q8_0, src, dst),
                    Contains("Q8_0") && Contains("20 bytes"));
  std::vector<float> odd(31);
  CHECK_THROWS_WITH(eng::dequantize(eng::ggml_type::Q4_1, src, odd), Contains("whole number"));
  CHECK_THROWS_WITH(eng::dequantize(99, src, dst), Contains("unknown ggml type id 99"));
  CHECK_THROWS_WITH(eng::dequantize(20, src, dst), Contains("IQ4_NL is not supported"));
  CHECK(eng::ggml_type_name(3) == "Q4_1");
  CHECK(eng::ggml_type_name(5) == "type 5");
}

}  // namespace kvt_engine_ggml_types
