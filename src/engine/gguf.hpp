// GGUF reader (versions 2 and 3): metadata key/values, tensor infos and the aligned data section.
// The whole file is held in memory and every read is bounds-checked with overflow-safe
// arithmetic, so a corrupt or hostile file (bad magic, truncation, absurd counts, sizes or
// offsets, unknown types, nesting bombs) raises kvpolicy::Error naming the file, the byte offset
// and the item, and never over-reads or allocates more than the file could describe.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

namespace kvpolicy::engine {

enum class GgufType : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};
const char* gguf_type_name(GgufType t);

// A metadata array, stored compactly by element kind (memory stays within a small multiple of
// the file size even for hostile element counts). Exactly one vector is used, chosen by `elem`:
// u8..u64 and bool -> uints, i8..i64 -> ints, f32/f64 -> floats, string -> strings,
// array -> arrays.
struct GgufArray {
  GgufType elem = GgufType::u8;
  std::vector<std::uint64_t> uints;
  std::vector<std::int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
  std::vector<GgufArray> arrays;
  std::size_t size() const {
    return uints.size() + ints.size() + floats.size() + strings.size() + arrays.size();
  }
};

// One metadata value. Integers keep their signedness (u8..u64 -> uint64_t, i8..i64 -> int64_t);
// f32/f64 -> double.
struct GgufValue {
  GgufType type = GgufType::u8;
  std::variant<std::uint64_t, std::int64_t, double, bool, std::string, GgufArray> v;
};

struct GgufTensorInfo {
  std::string name;
  std::vector<std::uint64_t> dims;  // ggml order: dims[0] is the contiguous (fastest) dimension
  std::uint32_t type = 0;           // ggml type id (see ggml_types.hpp)
  std::uint64_t offset = 0;         // from the start of the data section
  std::uint64_t elements = 0;
  std::uint64_t bytes = 0;
};

class GgufFile {
 public:
  // Reads and parses `path`. A missing file raises an Error that says so.
  static GgufFile open(const std::string& path);
  // Parses bytes already in memory (tests, fuzzing); `origin` names them in messages.
  static GgufFile parse(std::vector<std::uint8_t> bytes, std::string origin = "<memory>");

  const std::string& origin() const { return origin_; }
  std::uint32_t version() const { return version_; }
  std::uint64_t alignment() const { return alignment_; }
  std::uint64_t data_offset() const { return data_offset_; }

  // Metadata in file order, and lookups by key.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return kv_; }
  const GgufValue* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }
  // Typed getters: throw an Error naming the key when it is missing or of another type.
  // get_uint accepts any non-negative integer type; get_float any integer or float type.
  std::uint64_t get_uint(std::string_view key) const;
  std::uint64_t get_uint(std::string_view key, std::uint64_t fallback) const;
  double get_float(std::string_view key) const;
  double get_float(std::string_view key, double fallback) const;
  bool get_bool(std::string_view key, bool fallback) const;
  const std::string& get_string(std::string_view key) const;
  std::string get_string(std::string_view key, std::string fallback) const;
  std::vector<std::string> get_string_array(std::string_view key) const;
  std::vector<std::int64_t> get_int_array(std::string_view key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  const GgufTensorInfo& tensor(std::string_view name) const;  // throws if absent
  // Raw bytes of a tensor (bounds were checked at parse time).
  std::span<const std::uint8_t> tensor_data(const GgufTensorInfo& t) const;
  // fp32 copy of a tensor, checking its type is dequantizable and, if given, its shape.
  std::vector<float> dequantize(const GgufTensorInfo& t) const;
  std::vector<float> dequantize(std::string_view name,
                                std::initializer_list<std::uint64_t> expected_dims) const;

 private:
  std::string origin_;
  std::vector<std::uint8_t> bytes_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32, data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> kv_;
  std::unordered_map<std::string, std::size_t> kv_index_, tensor_index_;
  std::vector<GgufTensorInfo> tensors_;

  friend class GgufParser;
};

}  // namespace kvpolicy::engine
