// Host side of the type-erased CUDA entry points: the argument checks every score-producing op
// shares (a typed KVView becomes the TensorRef the kernels take with kvpolicy::erase). Not for
// .cu files (kv_view.hpp brings Eigen); the kernels see score_launch.hpp only.
#pragma once
#include <type_traits>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/cuda/score_launch.hpp"

namespace kvpolicy::cuda {

namespace detail {
// `out` must be a non-null [layers][heads][tokens] score view of `keys`' shape, and a non-zero
// workspace size must come with a pointer.
template <Element T>
void require_score_output(const cuda_backend& be, const KVView<const T>& keys,
                          const MutableScoreView& out, const char* op) {
  KVP_REQUIRE(out.data && out.layers == keys.layers && out.heads == keys.heads &&
                  out.tokens == keys.tokens && out.row_stride >= out.tokens,
              op, ": output score view must be non-null [", keys.layers, ",", keys.heads, ",",
              keys.tokens, "] with row_stride >= tokens");
  KVP_REQUIRE(be.workspace_bytes == 0 || be.workspace, op, ": workspace_bytes is ",
              be.workspace_bytes, " but the workspace pointer is null");
}
}  // namespace detail

}  // namespace kvpolicy::cuda
