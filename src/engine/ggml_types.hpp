// ggml tensor element types as GGUF stores them: block size (elements) and bytes per block for
// every type id the format defines, so the reader can bounds-check any tensor, plus fp32
// dequantization of the types a Llama GGUF commonly uses (F32, F16, BF16, Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0 and the K-quants Q2_K..Q6_K). Block layouts follow ggml-common.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace kvpolicy::engine {

struct GgmlTypeInfo {
  std::uint32_t id = 0;
  const char* name = "";
  std::uint32_t block = 1;        // elements per block
  std::uint32_t block_bytes = 0;  // bytes per block
  bool dequantizable = false;     // dequantize() supports it
};

// The type with this id, or nullopt for an id GGUF does not define (or has retired).
std::optional<GgmlTypeInfo> ggml_type_info(std::uint32_t id);
// "Q4_1", or "type 42" for an unknown id.
std::string ggml_type_name(std::uint32_t id);

// Well-known ids used by the engine and the tests.
namespace ggml_type {
inline constexpr std::uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
                               Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30;
}

// Dequantizes `src` (whole blocks of `type`) into `dst`; dst.size() must be a multiple of the
// block size and src.size() exactly the matching byte count. Throws kvpolicy::Error otherwise,
// or when the type is unknown or not supported for dequantization.
void dequantize(std::uint32_t type, std::span<const std::uint8_t> src, std::span<float> dst);

}  // namespace kvpolicy::engine
