#include "engine/ggml_types.hpp"

#include <array>
#include <bit>
#include <cstring>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy::engine {

namespace {

constexpr std::array<GgmlTypeInfo, 33> kTypes = {{
    {0, "F32", 1, 4, true},          {1, "F16", 1, 2, true},
    {2, "Q4_0", 32, 18, true},       {3, "Q4_1", 32, 20, true},
    {6, "Q5_0", 32, 22, true},       {7, "Q5_1", 32, 24, true},
    {8, "Q8_0", 32, 34, true},       {9, "Q8_1", 32, 36, false},
    {10, "Q2_K", 256, 84, true},     {11, "Q3_K", 256, 110, true},
    {12, "Q4_K", 256, 144, true},    {13, "Q5_K", 256, 176, true},
    {14, "Q6_K", 256, 210, true},    {15, "Q8_K", 256, 292, false},
    {16, "IQ2_XXS", 256, 66, false}, {17, "IQ2_XS", 256, 74, false},
    {18, "IQ3_XXS", 256, 98, false}, {19, "IQ1_S", 256, 50, false},
    {20, "IQ4_NL", 32, 18, false},   {21, "IQ3_S", 256, 110, false},
    {22, "IQ2_S", 256, 82, false},   {23, "IQ4_XS", 256, 136, false},
    {24, "I8", 1, 1, false},         {25, "I16", 1, 2, false},
    {26, "I32", 1, 4, false},        {27, "I64", 1, 8, false},
    {28, "F64", 1, 8, false},        {29, "IQ1_M", 256, 56, false},
    {30, "BF16", 1, 2, true},        {34, "TQ1_0", 256, 54, false},
    {35, "TQ2_0", 256, 66, false},   {39, "MXFP4", 32, 17, false},
    {41, "Q1_0", 128, 18, false},
}};

// Little-endian loads from unaligned block memory (GGUF is little-endian; so is every host the
// engine targets).
inline std::uint16_t le16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
inline std::uint32_t le32(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
inline float f16(const std::uint8_t* p) { return kvpolicy::half_bits_to_float(le16(p)); }

// One block each: b points at block_bytes bytes, y receives `block` floats.
void dq_q4_0(const std::uint8_t* b, float* y) {
  const float d = f16(b);
  const std::uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}
void dq_q4_1(const std::uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const std::uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}
void dq_q5_0(const std::uint8_t* b, float* y) {
  const float d = f16(b);
  const std::uint32_t qh = le32(b + 2);
  const std::uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>(((qs[j] & 0x0F) | h0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | h1) - 16) * d;
  }
}
void dq_q5_1(const std::uint8_t* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const std::uint32_t qh = le32(b + 4);
  const std::uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>((qs[j] & 0x0F) | h0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | h1) * d + m;
  }
}
void dq_q8_0(const std::uint8_t* b, float* y) {
  const float d = f16(b);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<std::int8_t>(b[2 + j])) * d;
}

// K-quants: 256-element super-blocks with 6-bit (Q4_K/Q5_K) or 4-bit (Q2_K) sub-block scales.
void dq_q2_k(const std::uint8_t* b, float* y) {
  const std::uint8_t* scales = b;
  const std::uint8_t* q = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const std::uint8_t sc = scales[is++];
        const float dl = d * static_cast<float>(sc & 0x0F), ml = dmin * static_cast<float>(sc >> 4);
        for (int l = 0; l < 16; ++l)
          *y++ = dl * static_cast<float>((q[l + 16 * half] >> shift) & 3) - ml;
      }
    }
    q += 32;
  }
}
void dq_q3_k(const std::uint8_t* b, float* y) {
  const std::uint8_t* hm = b;
  const std::uint8_t* q = b + 32;
  const std::uint8_t* packed = b + 96;  // 12 bytes: 16 six-bit scales
  const float d = f16(b + 108);
  std::uint32_t aux[4];
  std::memcpy(aux, packed, 12);
  const std::uint32_t k1 = 0x03030303u, k2 = 0x0f0f0f0fu, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
  aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
  aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
  aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
  std::int8_t sc[16];
  std::memcpy(sc, aux, 16);
  int is = 0;
  std::uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    for (int shift = 0; shift < 8; shift += 2, m = static_cast<std::uint8_t>(m << 1)) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d * static_cast<float>(sc[is++] - 32);
        for (int l = 0; l < 16; ++l) {
          const int i = l + 16 * half;
          *y++ = dl * static_cast<float>(((q[i] >> shift) & 3) - ((hm[i] & m) ? 0 : 4));
        }
      }
    }
    q += 32;
  }
}
// Scale and min of sub-block j from the 12 packed bytes of Q4_K/Q5_K.
inline void scale_min_k4(int j, const std::uint8_t* q, std::uint8_t& d, std::uint8_t& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = static_cast<std::uint8_t>((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
    m = static_cast<std::uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}
void dq_q4_k(const std::uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const std::uint8_t* scales = b + 4;
  const std::uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    std::uint8_t s1, m1, s2, m2;
    scale_min_k4(is, scales, s1, m1);
    scale_min_k4(is + 1, scales, s2, m2);
    const float d1 = d * s1, mm1 = dmin * m1, d2 = d * s2, mm2 = dmin * m2;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0x0F) - mm1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - mm2;
  }
}
void dq_q5_k(const std::uint8_t* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const std::uint8_t* scales = b + 4;
  const std::uint8_t* qh = b + 16;
  const std::uint8_t* ql = b + 48;
  std::uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32) {
    std::uint8_t s1, m1, s2, m2;
    scale_min_k4(is, scales, s1, m1);
    scale_min_k4(is + 1, scales, s2, m2);
    const float d1 = d * s1, mm1 = dmin * m1, d2 = d * s2, mm2 = dmin * m2;
    for (int l = 0; l < 32; ++l)
      *y++ = d1 * static_cast<float>((ql[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0)) - mm1;
    for (int l = 0; l < 32; ++l)
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - mm2;
    u1 = static_cast<std::uint8_t>(u1 << 2);
    u2 = static_cast<std::uint8_t>(u2 << 2);
  }
}
void dq_q6_k(const std::uint8_t* b, float* y) {
  const std::uint8_t* ql = b;
  const std::uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const std::int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int n = 0; n < 256; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
  }
}

using BlockFn = void (*)(const std::uint8_t*, float*);

BlockFn block_fn(std::uint32_t id) {
  switch (id) {
    case ggml_type::Q4_0:
      return dq_q4_0;
    case ggml_type::Q4_1:
      return dq_q4_1;
    case ggml_type::Q5_0:
      return dq_q5_0;
    case ggml_type::Q5_1:
      return dq_q5_1;
    case ggml_type::Q8_0:
      return dq_q8_0;
    case ggml_type::Q2_K:
      return dq_q2_k;
    case ggml_type::Q3_K:
      return dq_q3_k;
    case ggml_type::Q4_K:
      return dq_q4_k;
    case ggml_type::Q5_K:
      return dq_q5_k;
    case ggml_type::Q6_K:
      return dq_q6_k;
    default:
      return nullptr;
  }
}

}  // namespace

std::optional<GgmlTypeInfo> ggml_type_info(std::uint32_t id) {
  for (const auto& t : kTypes)
    if (t.id == id) return t;
  return std::nullopt;
}

std::string ggml_type_name(std::uint32_t id) {
  if (auto t = ggml_type_info(id)) return t->name;
  return "type " + std::to_string(id);
}

void dequantize(std::uint32_t type, std::span<const std::uint8_t> src, std::span<float> dst) {
  const auto info = ggml_type_info(type);
  KVP_REQUIRE(info.has_value(), "dequantize: unknown ggml type id ", type);
  KVP_REQUIRE(info->dequantizable, "dequantize: ggml type ", info->name,
              " is not supported (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, "
              "Q3_K, Q4_K, Q5_K, Q6_K)");
  KVP_REQUIRE(dst.size() % info->block == 0, "dequantize: ", dst.size(),
              " elements are not a whole number of ", info->name, " blocks of ", info->block);
  const std::size_t blocks = dst.size() / info->block;
  KVP_REQUIRE(src.size() == blocks * info->block_bytes, "dequantize: ", info->name, " source has ",
              src.size(), " bytes, ", blocks, " blocks need ", blocks * info->block_bytes);
  const std::uint8_t* s = src.data();
  float* y = dst.data();
  switch (type) {
    case ggml_type::F32:
      if (!dst.empty()) std::memcpy(y, s, dst.size() * 4);
      return;
    case ggml_type::F16:
      for (std::size_t i = 0; i < dst.size(); ++i) y[i] = kvpolicy::half_bits_to_float(le16(s + 2 * i));
      return;
    case ggml_type::BF16:
      for (std::size_t i = 0; i < dst.size(); ++i) y[i] = kvpolicy::bfloat16_bits_to_float(le16(s + 2 * i));
      return;
    default:
      break;
  }
  const BlockFn fn = block_fn(type);
  for (std::size_t i = 0; i < blocks; ++i) fn(s + i * info->block_bytes, y + i * info->block);
}

}  // namespace kvpolicy::engine
