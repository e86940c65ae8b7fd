// Every policy stage the runtime Policy knows by name. Adding a policy: one header, one test
// file, one line here.
#pragma once
#include <tuple>

#include "kvpolicy/allocators/adakv.hpp"
#include "kvpolicy/allocators/ams.hpp"
#include "kvpolicy/allocators/depthkv.hpp"
#include "kvpolicy/allocators/pyramid.hpp"
#include "kvpolicy/allocators/uniform.hpp"
#include "kvpolicy/cpu/stages.hpp"
#include "kvpolicy/mergers/nearest.hpp"
#include "kvpolicy/mergers/semantic.hpp"
#include "kvpolicy/quant/quantizer.hpp"
#include "kvpolicy/scorers/expected.hpp"
#include "kvpolicy/scorers/h2o.hpp"
#include "kvpolicy/scorers/keydiff.hpp"
#include "kvpolicy/scorers/knorm.hpp"
#include "kvpolicy/scorers/kvzip.hpp"
#include "kvpolicy/scorers/snapkv.hpp"
#include "kvpolicy/scorers/streaming.hpp"
#include "kvpolicy/scorers/tova.hpp"

namespace kvpolicy {

using scorer_types = std::tuple<H2O, SnapKV, Streaming, TOVA, KNorm, KeyDiff, ExpectedAttention,
                                KVzip>;
using allocator_types = std::tuple<Uniform, Pyramid, DepthKV, AdaKV, AMS>;
using merger_types = std::tuple<Semantic, Nearest>;
using quantizer_types = std::tuple<quant::Int2, quant::Int4, quant::Kivi>;

}  // namespace kvpolicy
