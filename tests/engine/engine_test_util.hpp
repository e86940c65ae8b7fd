// Shared by the engine tests: where the golden data and the model are, one model per process,
// and a builder for small synthetic GGUF files.
#pragma once
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/model.hpp"

namespace kvp_engine_test {

inline std::filesystem::path golden_dir() {
  if (const char* g = std::getenv("KVPOLICY_GOLDEN_DIR"); g && *g) return g;
  return std::filesystem::path(__FILE__).parent_path() / "golden";
}

inline const nlohmann::json& golden() {
  static const nlohmann::json j = [] {
    std::ifstream in(golden_dir() / "golden.json");
    if (!in) FAIL("cannot read " << (golden_dir() / "golden.json").string());
    return nlohmann::json::parse(in);
  }();
  return j;
}

// The model every model-based test uses: KVPOLICY_MODEL or the default cache path. A missing
// file fails the test with the message that says how to fetch it (setup always fetches it).
inline std::string model_path() {
  const std::string p = kvpolicy::engine::default_model_path();
  if (!std::filesystem::exists(p)) FAIL(kvpolicy::engine::missing_model_message(p));
  return p;
}

inline const kvpolicy::engine::Model& model() {
  static std::unique_ptr<kvpolicy::engine::Model> m;
  if (!m) m = kvpolicy::engine::Model::load(model_path());
  return *m;
}

// Little-endian GGUF writer with the positions of interesting fields recorded, so tests can
// corrupt exactly one of them.
struct GgufBuilder {
  std::vector<std::uint8_t> b;

  std::size_t pos() const { return b.size(); }
  template <class T>
  std::size_t put(T v) {
    const std::size_t at = b.size();
    b.resize(at + sizeof(T));
    std::memcpy(b.data() + at, &v, sizeof(T));
    return at;
  }
  std::size_t str(const std::string& s) {
    const std::size_t at = put<std::uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return at;
  }
  void align(std::size_t a) {
    while (b.size() % a) b.push_back(0);
  }
  template <class T>
  void patch(std::size_t at, T v) {
    std::memcpy(b.data() + at, &v, sizeof(T));
  }
};

// A small valid GGUF v3: five metadata entries (string, u32 alignment, i32 array, string array,
// nested u8 arrays) and two tensors, "a" (F32 [4, 2]) and "b" (Q8_0 [32], d = 0.5,
// qs = -16..15), 32-byte aligned.
struct SampleGguf {
  GgufBuilder g;
  std::size_t version, n_tensors, n_kv, key0_len, arr_type, arr_len, nested_len, a_ndims, a_dim0,
      a_type, a_offset, b_dim0, b_type, b_offset, b_name, first_tensor;
  std::size_t data_start;

  SampleGguf() {
    g.b = {'G', 'G', 'U', 'F'};
    version = g.put<std::uint32_t>(3);
    n_tensors = g.put<std::uint64_t>(2);
    n_kv = g.put<std::uint64_t>(5);
    key0_len = g.str("general.architecture");
    g.put<std::uint32_t>(8);
    g.str("llama");
    g.str("general.alignment");
    g.put<std::uint32_t>(4);
    g.put<std::uint32_t>(32);
    g.str("test.ints");
    g.put<std::uint32_t>(9);
    arr_type = g.put<std::uint32_t>(5);
    arr_len = g.put<std::uint64_t>(3);
    for (std::int32_t v : {1, -2, 3}) g.put(v);
    g.str("test.strings");
    g.put<std::uint32_t>(9);
    g.put<std::uint32_t>(8);
    g.put<std::uint64_t>(2);
    g.str("a");
    g.str("bc");
    g.str("test.nested");
    g.put<std::uint32_t>(9);
    g.put<std::uint32_t>(9);
    nested_len = g.put<std::uint64_t>(2);
    for (int k = 0; k < 2; ++k) {
      g.put<std::uint32_t>(0);
      g.put<std::uint64_t>(1);
      g.put<std::uint8_t>(static_cast<std::uint8_t>(7 + k));
    }
    first_tensor = g.str("a");
    a_ndims = g.put<std::uint32_t>(2);
    a_dim0 = g.put<std::uint64_t>(4);
    g.put<std::uint64_t>(2);
    a_type = g.put<std::uint32_t>(0);
    a_offset = g.put<std::uint64_t>(0);
    b_name = g.str("b");
    g.put<std::uint32_t>(1);
    b_dim0 = g.put<std::uint64_t>(32);
    b_type = g.put<std::uint32_t>(8);
    b_offset = g.put<std::uint64_t>(32);
    g.align(32);
    data_start = g.pos();
    for (int i = 0; i < 8; ++i) g.put<float>(static_cast<float>(i) * 0.25f);
    g.put<std::uint16_t>(0x3800);  // 0.5 in f16
    for (int i = 0; i < 32; ++i) g.put<std::int8_t>(static_cast<std::int8_t>(i - 16));
  }
  std::vector<std::uint8_t> bytes() const { return g.b; }
};

}  // namespace kvp_engine_test
