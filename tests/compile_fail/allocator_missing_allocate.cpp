// An allocator without allocate(ctx, budgets) in a Pipeline's allocator slots.
// expect-error: every A must model kvpolicy::Allocator
// expect-error: a\.allocate\(ctx, budgets\)
#include <kvpolicy/kvpolicy.hpp>

struct NoAllocate {
  static constexpr std::string_view name = "no_allocate";
};

kvpolicy::Pipeline<kvpolicy::SnapKV, NoAllocate> pipeline;
