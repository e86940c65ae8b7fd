// An allocator in the scorer slot of a Pipeline.
// expect-error: S must model kvpolicy::Scorer
// expect-error: s\.score\(be, in, st, out\)
#include <kvpolicy/kvpolicy.hpp>

kvpolicy::Pipeline<kvpolicy::Uniform> pipeline;
