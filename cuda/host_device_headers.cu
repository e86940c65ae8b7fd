// Compile-time check that the host/device-shared headers stay free of Eigen and CUDA-hostile
// code: every core header, every stage header (scorers/, allocators/, mergers/, the quantizer;
// they reach the CPU backend only through cpu/fwd.hpp's declarations) and their row math,
// compiled by nvcc. It also pins the
// host 16-bit element types to CUDA's layout, since device tensors' bytes are read as either.
// Nothing here runs; a header that stops compiling with nvcc fails the build.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/budget.hpp"
#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/head_shard.hpp"
#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/paged_kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"
#include "kvpolicy/core/params.hpp"
#include "kvpolicy/core/score_map.hpp"
#include "kvpolicy/core/selection.hpp"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/core/types.hpp"
#include "kvpolicy/scorers/common.hpp"
#include "kvpolicy/scorers/expected.hpp"
#include "kvpolicy/scorers/expected_row.hpp"
#include "kvpolicy/scorers/external.hpp"
#include "kvpolicy/scorers/h2o.hpp"
#include "kvpolicy/scorers/h2o_row.hpp"
#include "kvpolicy/scorers/keydiff.hpp"
#include "kvpolicy/scorers/keydiff_row.hpp"
#include "kvpolicy/scorers/knorm.hpp"
#include "kvpolicy/scorers/knorm_row.hpp"
#include "kvpolicy/scorers/kvzip.hpp"
#include "kvpolicy/scorers/snapkv.hpp"
#include "kvpolicy/scorers/snapkv_row.hpp"
#include "kvpolicy/scorers/streaming.hpp"
#include "kvpolicy/scorers/streaming_row.hpp"
#include "kvpolicy/scorers/tova.hpp"
#include "kvpolicy/scorers/tova_row.hpp"
#include "kvpolicy/allocators/adakv.hpp"
#include "kvpolicy/allocators/adakv_row.hpp"
#include "kvpolicy/allocators/ams.hpp"
#include "kvpolicy/allocators/ams_rows.hpp"
#include "kvpolicy/allocators/common.hpp"
#include "kvpolicy/allocators/depthkv.hpp"
#include "kvpolicy/allocators/profile.hpp"
#include "kvpolicy/allocators/pyramid.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/mergers/common.hpp"
#include "kvpolicy/mergers/gsc_row.hpp"
#include "kvpolicy/mergers/nearest.hpp"
#include "kvpolicy/mergers/semantic.hpp"
#include "kvpolicy/quant/quantizer.hpp"
#include "kvpolicy/concepts.hpp"

static_assert(sizeof(kvpolicy::half) == sizeof(__half) && alignof(kvpolicy::half) == alignof(__half),
              "kvpolicy::half must have __half's layout");
static_assert(sizeof(kvpolicy::bfloat16) == sizeof(__nv_bfloat16) &&
                  alignof(kvpolicy::bfloat16) == alignof(__nv_bfloat16),
              "kvpolicy::bfloat16 must have __nv_bfloat16's layout");
