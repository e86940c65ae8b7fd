// A quantizer stage that cannot pack a head's survivors into a packed cache does not model
// kvpolicy::Quantizer (a whole-view codec alone is not a stage a Session can use).
// expect-error: satisfaction of 'Quantizer<Q>'|does not satisfy 'Quantizer'
// expect-error: q\.pack\(kv, kv, n, n, n\)
#include <kvpolicy/kvpolicy.hpp>

struct CodecOnly {
  static constexpr std::string_view name = "codec_only";
  int bits() const { return 2; }
  void encode(const kvpolicy::KVView<const float>&, std::span<std::byte>) const {}
  void decode(std::span<const std::byte>, const kvpolicy::KVView<float>&) const {}
};

template <kvpolicy::Quantizer Q>
void use_quantizer(const Q&) {}

void f() { use_quantizer(CodecOnly{}); }
