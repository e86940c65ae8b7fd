// A merger without merge(backend, args) does not model kvpolicy::Merger.
// expect-error: satisfaction of 'Merger<M>'|does not satisfy 'Merger'
// expect-error: m\.merge\(be, args\)
#include <kvpolicy/kvpolicy.hpp>

struct NoMerge {
  static constexpr std::string_view name = "no_merge";
};

template <kvpolicy::Merger M>
void use_merger(const M&) {}

void f() { use_merger(NoMerge{}); }
