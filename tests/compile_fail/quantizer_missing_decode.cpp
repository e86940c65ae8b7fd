// A quantizer that can encode but not decode does not model kvpolicy::Quantizer.
// expect-error: satisfaction of 'Quantizer<Q>'|does not satisfy 'Quantizer'
// expect-error: q\.decode\(cpacked, dst\)
#include <kvpolicy/kvpolicy.hpp>

struct EncodeOnly {
  static constexpr std::string_view name = "encode_only";
  int bits() const { return 2; }
  std::size_t packed_bytes(std::int64_t tokens, std::int64_t dim) const {
    return static_cast<std::size_t>(tokens * dim / 4);
  }
  void encode(const kvpolicy::KVView<const float>&, std::span<std::byte>) const {}
};

template <kvpolicy::Quantizer Q>
void use_quantizer(const Q&) {}

void f() { use_quantizer(EncodeOnly{}); }
