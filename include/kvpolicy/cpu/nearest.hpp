// CPU kernel of the nearest-neighbour merger (mergers/nearest.hpp): cosine similarities of the
// evicted tokens' keys to the kept targets' as fp32 GEMMs on unit rows. Declared in cpu/fwd.hpp.
#pragma once
#include "kvpolicy/cpu/eigen.hpp"
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kvpolicy/cpu/fwd.hpp"
#include "kvpolicy/cpu/rows.hpp"

namespace kvpolicy::cpu {

namespace detail {
// Keys of idx[b, b+n) as fp32 unit rows (zero keys stay zero).
template <class T>
void unit_rows(const KVView<T>& keys, std::int64_t l, std::int64_t h,
               const std::vector<std::int32_t>& idx, std::size_t b, std::size_t n, RowMatrix& out) {
  out.resize(static_cast<Eigen::Index>(n), keys.dim);
  for (std::size_t i = 0; i < n; ++i) {
    const T* src = keys.row(l, h, idx[b + i]);
    for (std::int64_t x = 0; x < keys.dim; ++x)
      out(static_cast<Eigen::Index>(i), x) = to_float(src[x * keys.stride_dim]);
    const float norm = out.row(static_cast<Eigen::Index>(i)).norm();
    if (norm > 0.f) out.row(static_cast<Eigen::Index>(i)) /= norm;
  }
}
}  // namespace detail

template <class T>
std::vector<std::int32_t> nearest_targets(const KVView<T>& keys, std::int64_t l, std::int64_t h,
                                          const std::vector<std::int32_t>& evicted,
                                          const std::vector<std::int32_t>& targets,
                                          std::int64_t block) {
  std::vector<std::int32_t> out(evicted.size(), -1);
  if (targets.empty()) return out;
  RowMatrix kt, ke, sim;
  detail::unit_rows(keys, l, h, targets, 0, targets.size(), kt);
  const auto step = static_cast<std::size_t>(block);
  for (std::size_t b = 0; b < evicted.size(); b += step) {
    const std::size_t n = std::min(step, evicted.size() - b);
    detail::unit_rows(keys, l, h, evicted, b, n, ke);
    sim.noalias() = ke * kt.transpose();
    for (std::size_t i = 0; i < n; ++i) {
      Eigen::Index best = 0;
      for (Eigen::Index t = 1; t < sim.cols(); ++t)
        if (sim(static_cast<Eigen::Index>(i), t) >= sim(static_cast<Eigen::Index>(i), best)) best = t;
      out[b + i] = targets[static_cast<std::size_t>(best)];
    }
  }
  return out;
}

}  // namespace kvpolicy::cpu
