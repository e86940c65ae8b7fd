#include "engine/gguf.hpp"

#include <bit>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "engine/ggml_types.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::engine {

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::u8:
      return "u8";
    case GgufType::i8:
      return "i8";
    case GgufType::u16:
      return "u16";
    case GgufType::i16:
      return "i16";
    case GgufType::u32:
      return "u32";
    case GgufType::i32:
      return "i32";
    case GgufType::f32:
      return "f32";
    case GgufType::boolean:
      return "bool";
    case GgufType::string:
      return "string";
    case GgufType::array:
      return "array";
    case GgufType::u64:
      return "u64";
    case GgufType::i64:
      return "i64";
    case GgufType::f64:
      return "f64";
  }
  return "unknown";
}

namespace {

constexpr std::uint32_t kMaxDims = 4;          // GGML_MAX_DIMS
constexpr int kMaxArrayDepth = 8;              // nested metadata arrays
constexpr std::uint64_t kMinKvBytes = 13;      // key length + value type + a 1-byte value
constexpr std::uint64_t kMinTensorBytes = 24;  // name length + n_dims + type + offset

bool valid_value_type(std::uint32_t t) { return t <= 12; }

// Smallest encoding of one value of type t (bounds array counts before allocating).
std::uint64_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::u8:
    case GgufType::i8:
    case GgufType::boolean:
      return 1;
    case GgufType::u16:
    case GgufType::i16:
      return 2;
    case GgufType::u32:
    case GgufType::i32:
    case GgufType::f32:
      return 4;
    case GgufType::u64:
    case GgufType::i64:
    case GgufType::f64:
    case GgufType::string:
      return 8;
    case GgufType::array:
      return 12;
  }
  return 1;
}

}  // namespace

// Cursor over the file bytes; every read checks the remaining length first.
class GgufParser {
 public:
  explicit GgufParser(GgufFile& f) : f_(f), data_(f.bytes_.data()), size_(f.bytes_.size()) {}

  void run() {
    KVP_REQUIRE(size_ >= 4 && std::memcmp(data_, "GGUF", 4) == 0, "gguf: ", f_.origin_,
                ": not a GGUF file (bad magic", size_ >= 4 ? "" : ": file shorter than 4 bytes",
                ")");
    pos_ = 4;
    f_.version_ = u32("the version");
    KVP_REQUIRE(
        f_.version_ != 1, "gguf: ", f_.origin_,
        ": GGUF version 1 is not supported (re-convert the model with a current llama.cpp)");
    KVP_REQUIRE(f_.version_ == 2 || f_.version_ == 3, "gguf: ", f_.origin_,
                ": unsupported GGUF version ", f_.version_,
                (f_.version_ > 0xFFFF ? " (a big-endian file?)" : ""),
                "; this reader knows 2 and 3");
    const std::uint64_t n_tensors = u64("the tensor count");
    const std::uint64_t n_kv = u64("the metadata count");
    KVP_REQUIRE(n_kv <= remaining() / kMinKvBytes, "gguf: ", f_.origin_, ": metadata count ", n_kv,
                " is impossible for a file of ", size_, " bytes");
    f_.kv_.reserve(n_kv);
    for (std::uint64_t i = 0; i < n_kv; ++i) read_kv(i);
    read_alignment();
    KVP_REQUIRE(n_tensors <= remaining() / kMinTensorBytes, "gguf: ", f_.origin_, ": tensor count ",
                n_tensors, " is impossible for a file of ", size_, " bytes");
    f_.tensors_.reserve(n_tensors);
    for (std::uint64_t i = 0; i < n_tensors; ++i) read_tensor_info(i);
    place_data();
  }

 private:
  std::uint64_t remaining() const { return size_ - pos_; }

  void need(std::uint64_t n, const std::string& what) const {
    KVP_REQUIRE(n <= remaining(), "gguf: ", f_.origin_, ": truncated at byte ", pos_, " reading ",
                what, " (needs ", n, " bytes, ", remaining(), " left)");
  }
  template <class T>
  T scalar(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::uint32_t u32(const std::string& what) { return scalar<std::uint32_t>(what); }
  std::uint64_t u64(const std::string& what) { return scalar<std::uint64_t>(what); }

  std::string str(const std::string& what) {
    const std::uint64_t at = pos_;
    const std::uint64_t n = u64("the length of " + what);
    KVP_REQUIRE(n <= remaining(), "gguf: ", f_.origin_, ": ", what, " at byte ", at, " claims ", n,
                " bytes but only ", remaining(), " are left");
    std::string s(reinterpret_cast<const char*>(data_ + pos_), static_cast<std::size_t>(n));
    pos_ += n;
    return s;
  }

  GgufType value_type(const std::string& what) {
    const std::uint64_t at = pos_;
    const std::uint32_t t = u32("the type of " + what);
    KVP_REQUIRE(valid_value_type(t), "gguf: ", f_.origin_, ": unknown value type ", t, " for ",
                what, " at byte ", at);
    return static_cast<GgufType>(t);
  }

  void read_kv(std::uint64_t i) {
    const std::uint64_t at = pos_;
    std::string key = str("the key of metadata entry " + std::to_string(i));
    const std::string what = "metadata '" + key + "'";
    KVP_REQUIRE(!f_.kv_index_.count(key), "gguf: ", f_.origin_, ": duplicate metadata key '", key,
                "' at byte ", at);
    GgufValue v;
    v.type = value_type(what);
    read_value(v, what);
    f_.kv_index_.emplace(key, f_.kv_.size());
    f_.kv_.emplace_back(std::move(key), std::move(v));
  }

  void read_value(GgufValue& v, const std::string& what) {
    switch (v.type) {
      case GgufType::u8:
        v.v = std::uint64_t{scalar<std::uint8_t>(what)};
        break;
      case GgufType::u16:
        v.v = std::uint64_t{scalar<std::uint16_t>(what)};
        break;
      case GgufType::u32:
        v.v = std::uint64_t{scalar<std::uint32_t>(what)};
        break;
      case GgufType::u64:
        v.v = scalar<std::uint64_t>(what);
        break;
      case GgufType::i8:
        v.v = std::int64_t{scalar<std::int8_t>(what)};
        break;
      case GgufType::i16:
        v.v = std::int64_t{scalar<std::int16_t>(what)};
        break;
      case GgufType::i32:
        v.v = std::int64_t{scalar<std::int32_t>(what)};
        break;
      case GgufType::i64:
        v.v = scalar<std::int64_t>(what);
        break;
      case GgufType::f32:
        v.v = double{scalar<float>(what)};
        break;
      case GgufType::f64:
        v.v = scalar<double>(what);
        break;
      case GgufType::boolean:
        v.v = read_bool(what);
        break;
      case GgufType::string:
        v.v = str(what);
        break;
      case GgufType::array: {
        GgufArray a;
        read_array(a, what, 1);
        v.v = std::move(a);
        break;
      }
    }
  }

  bool read_bool(const std::string& what) {
    const std::uint64_t at = pos_;
    const std::uint8_t b = scalar<std::uint8_t>(what);
    KVP_REQUIRE(b <= 1, "gguf: ", f_.origin_, ": ", what, " at byte ", at, " is a bool with value ",
                int{b});
    return b != 0;
  }

  void read_array(GgufArray& a, const std::string& what, int depth) {
    KVP_REQUIRE(depth <= kMaxArrayDepth, "gguf: ", f_.origin_, ": ", what,
                " nests arrays deeper than ", kMaxArrayDepth, " levels");
    a.elem = value_type("the elements of " + what);
    const std::uint64_t at = pos_;
    const std::uint64_t n = u64("the length of " + what);
    KVP_REQUIRE(n <= remaining() / min_value_bytes(a.elem), "gguf: ", f_.origin_, ": ", what,
                " at byte ", at, " claims ", n, " elements of type ", gguf_type_name(a.elem),
                " but only ", remaining(), " bytes are left");
    const auto count = static_cast<std::size_t>(n);
    switch (a.elem) {
      case GgufType::u8:
      case GgufType::u16:
      case GgufType::u32:
      case GgufType::u64:
      case GgufType::boolean:
      case GgufType::i8:
      case GgufType::i16:
      case GgufType::i32:
      case GgufType::i64:
      case GgufType::f32:
      case GgufType::f64: {
        for (std::size_t j = 0; j < count; ++j) {
          GgufValue e;
          e.type = a.elem;
          read_value(e, what);
          if (auto* u = std::get_if<std::uint64_t>(&e.v))
            a.uints.push_back(*u);
          else if (auto* s = std::get_if<std::int64_t>(&e.v))
            a.ints.push_back(*s);
          else if (auto* d = std::get_if<double>(&e.v))
            a.floats.push_back(*d);
          else
            a.uints.push_back(std::get<bool>(e.v) ? 1 : 0);
        }
        break;
      }
      case GgufType::string:
        a.strings.reserve(count);
        for (std::size_t j = 0; j < count; ++j) a.strings.push_back(str(what));
        break;
      case GgufType::array:
        a.arrays.reserve(count);
        for (std::size_t j = 0; j < count; ++j) {
          a.arrays.emplace_back();
          read_array(a.arrays.back(), what, depth + 1);
        }
        break;
    }
  }

  void read_alignment() {
    const GgufValue* v = f_.find("general.alignment");
    if (!v) return;
    const auto* a = std::get_if<std::uint64_t>(&v->v);
    KVP_REQUIRE(v->type == GgufType::u32 && a && *a != 0 && std::has_single_bit(*a),
                "gguf: ", f_.origin_, ": general.alignment must be a non-zero power of two u32");
    f_.alignment_ = *a;
  }

  void read_tensor_info(std::uint64_t i) {
    GgufTensorInfo t;
    const std::uint64_t at = pos_;
    t.name = str("the name of tensor " + std::to_string(i));
    const std::string what = "tensor '" + t.name + "'";
    KVP_REQUIRE(!f_.tensor_index_.count(t.name), "gguf: ", f_.origin_, ": duplicate ", what,
                " at byte ", at);
    const std::uint32_t n_dims = u32("the dimension count of " + what);
    KVP_REQUIRE(n_dims <= kMaxDims, "gguf: ", f_.origin_, ": ", what, " has ", n_dims,
                " dimensions (at most ", kMaxDims, ")");
    t.elements = 1;
    for (std::uint32_t d = 0; d < n_dims; ++d) {
      const std::uint64_t ne = u64("a dimension of " + what);
      KVP_REQUIRE(
          ne <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) &&
              (ne == 0 ||
               t.elements <=
                   static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / ne),
          "gguf: ", f_.origin_, ": ", what, " has an absurd shape (dimension ", d, " = ", ne, ")");
      t.elements *= ne;
      t.dims.push_back(ne);
    }
    if (n_dims == 0) t.elements = 1;
    t.type = u32("the type of " + what);
    const auto info = ggml_type_info(t.type);
    KVP_REQUIRE(info.has_value(), "gguf: ", f_.origin_, ": ", what, " has unknown ggml type id ",
                t.type);
    const std::uint64_t ne0 = t.dims.empty() ? 1 : t.dims[0];
    KVP_REQUIRE(ne0 % info->block == 0, "gguf: ", f_.origin_, ": ", what, " of type ", info->name,
                " has a first dimension ", ne0, " that is not a multiple of its block size ",
                info->block);
    // Checked before multiplying: elements * 4 for an F32 tensor of 2^62 elements would wrap.
    const std::uint64_t blocks = t.elements / info->block;
    KVP_REQUIRE(blocks <= size_ / info->block_bytes, "gguf: ", f_.origin_, ": ", what, " (",
                info->name, ", ", t.elements, " elements) needs more bytes than the whole file (",
                size_, ")");
    t.bytes = blocks * info->block_bytes;
    t.offset = u64("the offset of " + what);
    KVP_REQUIRE(t.offset % f_.alignment_ == 0, "gguf: ", f_.origin_, ": ", what, " has offset ",
                t.offset, ", not a multiple of the alignment ", f_.alignment_);
    f_.tensor_index_.emplace(t.name, f_.tensors_.size());
    f_.tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment; every tensor must lie in it.
  void place_data() {
    const std::uint64_t al = f_.alignment_;
    const std::uint64_t pad = (al - pos_ % al) % al;
    f_.data_offset_ = pos_ + pad;
    if (f_.tensors_.empty()) return;
    KVP_REQUIRE(pad <= remaining(), "gguf: ", f_.origin_,
                ": truncated: the data section would "
                "start at byte ",
                f_.data_offset_, " but the file has ", size_, " bytes");
    const std::uint64_t data_size = size_ - f_.data_offset_;
    for (const auto& t : f_.tensors_)
      KVP_REQUIRE(t.offset <= data_size && t.bytes <= data_size - t.offset, "gguf: ", f_.origin_,
                  ": tensor '", t.name, "' (", t.bytes, " bytes at data offset ", t.offset,
                  ") lies beyond the end of the file (data section of ", data_size,
                  " bytes starting at byte ", f_.data_offset_, ")");
  }

  GgufFile& f_;
  const std::uint8_t* data_;
  std::uint64_t size_, pos_ = 0;
};

GgufFile GgufFile::open(const std::string& path) {
  std::error_code ec;
  KVP_REQUIRE(std::filesystem::is_regular_file(path, ec), "gguf: cannot open '", path, "' (",
              std::filesystem::exists(path, ec) ? "not a regular file" : "missing", ")");
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  KVP_REQUIRE(in.good(), "gguf: cannot open '", path, "' (missing or unreadable)");
  const std::streamoff size = in.tellg();
  KVP_REQUIRE(size >= 0, "gguf: cannot determine the size of '", path, "'");
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  in.seekg(0);
  if (size > 0) in.read(reinterpret_cast<char*>(bytes.data()), size);
  KVP_REQUIRE(in.good() || (size == 0), "gguf: error reading '", path, "'");
  return parse(std::move(bytes), path);
}

GgufFile GgufFile::parse(std::vector<std::uint8_t> bytes, std::string origin) {
  GgufFile f;
  f.origin_ = std::move(origin);
  f.bytes_ = std::move(bytes);
  GgufParser(f).run();
  return f;
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
}

namespace {
[[noreturn]] void wrong_type(const GgufFile& f, std::string_view key, const GgufValue& v,
                             const char* expected) {
  detail::fail("gguf: ", f.origin(), ": metadata '", key, "' is a ", gguf_type_name(v.type),
               ", expected ", expected);
}
}  // namespace

std::uint64_t GgufFile::get_uint(std::string_view key) const {
  const GgufValue* v = find(key);
  KVP_REQUIRE(v, "gguf: ", origin_, ": metadata '", key, "' is missing");
  if (auto* u = std::get_if<std::uint64_t>(&v->v)) return *u;
  if (auto* i = std::get_if<std::int64_t>(&v->v); i && *i >= 0)
    return static_cast<std::uint64_t>(*i);
  wrong_type(*this, key, *v, "a non-negative integer");
}
std::uint64_t GgufFile::get_uint(std::string_view key, std::uint64_t fallback) const {
  return has(key) ? get_uint(key) : fallback;
}
double GgufFile::get_float(std::string_view key) const {
  const GgufValue* v = find(key);
  KVP_REQUIRE(v, "gguf: ", origin_, ": metadata '", key, "' is missing");
  if (auto* d = std::get_if<double>(&v->v)) return *d;
  if (auto* u = std::get_if<std::uint64_t>(&v->v)) return static_cast<double>(*u);
  if (auto* i = std::get_if<std::int64_t>(&v->v)) return static_cast<double>(*i);
  wrong_type(*this, key, *v, "a number");
}
double GgufFile::get_float(std::string_view key, double fallback) const {
  return has(key) ? get_float(key) : fallback;
}
bool GgufFile::get_bool(std::string_view key, bool fallback) const {
  const GgufValue* v = find(key);
  if (!v) return fallback;
  if (auto* b = std::get_if<bool>(&v->v)) return *b;
  wrong_type(*this, key, *v, "a bool");
}
const std::string& GgufFile::get_string(std::string_view key) const {
  const GgufValue* v = find(key);
  KVP_REQUIRE(v, "gguf: ", origin_, ": metadata '", key, "' is missing");
  if (auto* s = std::get_if<std::string>(&v->v)) return *s;
  wrong_type(*this, key, *v, "a string");
}
std::string GgufFile::get_string(std::string_view key, std::string fallback) const {
  return has(key) ? get_string(key) : fallback;
}
std::vector<std::string> GgufFile::get_string_array(std::string_view key) const {
  const GgufValue* v = find(key);
  KVP_REQUIRE(v, "gguf: ", origin_, ": metadata '", key, "' is missing");
  const auto* a = std::get_if<GgufArray>(&v->v);
  if (!a || a->elem != GgufType::string) wrong_type(*this, key, *v, "an array of strings");
  return a->strings;
}
std::vector<std::int64_t> GgufFile::get_int_array(std::string_view key) const {
  const GgufValue* v = find(key);
  KVP_REQUIRE(v, "gguf: ", origin_, ": metadata '", key, "' is missing");
  const auto* a = std::get_if<GgufArray>(&v->v);
  if (!a || !(a->uints.size() == a->size() || a->ints.size() == a->size()) ||
      a->elem == GgufType::boolean || a->elem == GgufType::string || a->elem == GgufType::array ||
      a->elem == GgufType::f32 || a->elem == GgufType::f64)
    wrong_type(*this, key, *v, "an array of integers");
  if (!a->ints.empty()) return a->ints;
  std::vector<std::int64_t> out;
  out.reserve(a->uints.size());
  for (auto u : a->uints) {
    KVP_REQUIRE(u <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()),
                "gguf: ", origin_, ": metadata '", key, "' holds an integer too large (", u, ")");
    out.push_back(static_cast<std::int64_t>(u));
  }
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}
const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* t = find_tensor(name);
  KVP_REQUIRE(t, "gguf: ", origin_, ": tensor '", name, "' is missing");
  return *t;
}

std::span<const std::uint8_t> GgufFile::tensor_data(const GgufTensorInfo& t) const {
  return {bytes_.data() + data_offset_ + t.offset, static_cast<std::size_t>(t.bytes)};
}

std::vector<float> GgufFile::dequantize(const GgufTensorInfo& t) const {
  const auto info = ggml_type_info(t.type);
  KVP_REQUIRE(info && info->dequantizable, "gguf: ", origin_, ": tensor '", t.name, "' has type ",
              ggml_type_name(t.type), ", which this engine cannot dequantize");
  std::vector<float> out(static_cast<std::size_t>(t.elements));
  engine::dequantize(t.type, tensor_data(t), out);
  return out;
}

std::vector<float> GgufFile::dequantize(std::string_view name,
                                        std::initializer_list<std::uint64_t> expected) const {
  const GgufTensorInfo& t = tensor(name);
  const std::vector<std::uint64_t> want(expected);
  if (t.dims != want) {
    std::string got, exp;
    for (auto d : t.dims) got += (got.empty() ? "" : ", ") + std::to_string(d);
    for (auto d : want) exp += (exp.empty() ? "" : ", ") + std::to_string(d);
    detail::fail("gguf: ", origin_, ": tensor '", name, "' has shape [", got, "], expected [", exp,
                 "]");
  }
  return dequantize(t);
}

}  // namespace kvpolicy::engine
