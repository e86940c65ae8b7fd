// The total order used by every top-k in the library, on every backend: higher score first; on
// equal scores the more recent (higher) index first. Packed into one 64-bit key so that a plain
// descending sort (CUB radix sort on the device, nth_element on the host) realises it exactly.
#pragma once
#include <cstdint>
#include <cstring>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy {

// Monotone map from fp32 to uint32: a < b  <=>  orderable(a) < orderable(b). -0 maps like +0;
// NaN maps below every number (the host API rejects NaN scores before this is reached).
KVP_HD inline std::uint32_t orderable_bits(float s) {
  if (s != s) return 0u;  // NaN
  if (s == 0.0f) s = 0.0f;
  std::uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(s);
#else
  std::memcpy(&u, &s, sizeof u);
#endif
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

KVP_HD inline std::uint64_t topk_key(float score, std::int32_t index) {
  return (static_cast<std::uint64_t>(orderable_bits(score)) << 32) |
         static_cast<std::uint32_t>(index);
}

KVP_HD inline std::int32_t topk_key_index(std::uint64_t key) {
  return static_cast<std::int32_t>(key & 0xffffffffu);
}

}  // namespace kvpolicy
