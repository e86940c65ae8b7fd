// A backend tag without `kind` does not model kvpolicy::Backend.
// expect-error: satisfaction of 'Backend<B>'|does not satisfy 'Backend'
// expect-error: B::kind
#include <kvpolicy/kvpolicy.hpp>

struct NoKind {
  int threads = 0;
};

template <kvpolicy::Backend B>
void use_backend(const B&) {}

void f() { use_backend(NoKind{}); }
