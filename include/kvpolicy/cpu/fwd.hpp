// The CPU backend's ops that the stage headers (scorers/, allocators/, mergers/) call, declared
// here without their definitions. A stage header includes this and no backend: no Eigen, no
// OpenMP, nothing nvcc refuses (cuda/host_device_headers.cu compiles every stage header), so
// cuda/ takes the stages' own parameter structs instead of mirror copies.
//
// The definitions live in cpu/*.hpp; cpu/stages.hpp includes them all, and registry.hpp,
// pipeline.hpp (so policy.hpp, session.hpp and kvpolicy.hpp) include cpu/stages.hpp. A program
// that runs a stage's CPU member (score, allocate, merge) from the stage header alone must
// include kvpolicy/cpu/stages.hpp as well: an op instantiated without its definition in the
// same translation unit is ill-formed (no diagnostic required; usually the link fails naming
// it, e.g. kvpolicy::cpu::window_attention<float>, but another object's copy may satisfy it).
#pragma once
#include <cstdint>
#include <vector>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/core/parallel.hpp"  // cpu::parallel_for, the host executor (no Eigen)
#include "kvpolicy/core/score_map.hpp"
#include "kvpolicy/core/types.hpp"

namespace kvpolicy::cpu {

// cpu/window_attention.hpp: column sums of the causal softmax of `queries` (the last n_q
// positions) over `keys`, reduced over each GQA group, into out [L][Hkv][T].
template <class T>
void window_attention(const cpu_backend& be, const KVView<const T>& keys,
                      const KVView<const T>& queries, GqaReduce reduce, ScoreMap& out);

// cpu/expected.hpp: out = Xc^T Xc / n (d x d, row-major) of the n x d row-major `rows` after
// subtracting `mean` from each row in place (fp64).
template <class Real>
void centered_gram(Real* rows, std::int64_t n, std::int64_t d, const Real* mean, Real* out);

// cpu/expected.hpp: for the keys j in [j0, j1) of row (l, h), in blocks of `block` keys,
// z[j] = (k_j . mu) * lin_scale + (k_j . Sigma k_j) / quad_div (the quadratic term only when
// sigma is given; mu [d], sigma [d][d] row-major, fp32 GEMMs). Returns the largest z
// (-inf when j0 >= j1).
template <class T>
double key_logits(const KVView<const T>& keys, std::int64_t l, std::int64_t h, std::int64_t j0,
                  std::int64_t j1, std::int64_t block, const float* mu, const float* sigma,
                  double lin_scale, double quad_div, double* z);

// cpu/nearest.hpp: for each evicted token of row (l, h), the target whose key has the largest
// cosine with its own (ties to the later target); -1 when there is no target. fp32 GEMMs over
// blocks of `block` evicted tokens.
template <class T>
std::vector<std::int32_t> nearest_targets(const KVView<T>& keys, std::int64_t l, std::int64_t h,
                                          const std::vector<std::int32_t>& evicted,
                                          const std::vector<std::int32_t>& targets,
                                          std::int64_t block);

}  // namespace kvpolicy::cpu
