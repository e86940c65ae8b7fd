// Nearest-neighbour merger, the baseline next to semantic (shared/algorithms.md: "merge each
// evicted token's value into its most cosine-similar kept token", as in kvpress's merging
// presses): every evicted token's value is folded into the kept token of the same (layer, KV
// head) whose key is most cosine-similar to its own; the kept token's count grows by the
// evicted token's, and attention adds log(count) to its logit (proportional attention).
//
// [ours] choices the source leaves open:
// - Only values are folded; the kept token's key is unchanged (algorithms.md names the value
//   only). The evicted token's own logit is thus approximated by the kept token's, which is
//   exact when their keys are identical.
// - Targets are the kept tokens outside the protected ranges (MergeArgs::protect): sinks and
//   the recent window are never written, as in semantic. A row with no such target evicts as
//   without a merger. There are no chunks: any kept token of the row is a candidate.
// - Similarity: cosine of keys, computed in fp32 (one GEMM per block of evicted tokens on unit
//   keys). Ties go to the more recent kept token (the library's top-k order); a zero key has
//   cosine 0 with everything, so it folds into the most recent target.
// - Weights: counts only, V_kept = (c_kept v_kept + sum c_e v_e) / (c_kept + sum c_e), summed in
//   fp64 in token order (no importance weighting; `merge` reads no scores). Counts add, so the
//   count-weighted mean stays consistent when the row is merged again in a later event.
// - Rows (layer, KV head) are independent work items: never mixes heads or layers, and results
//   are bit-identical for any thread count. Cost per row: evicted x kept x head_dim (GEMM).
#pragma once
#include <string_view>
#include <vector>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/cpu/fwd.hpp"
#include "kvpolicy/mergers/common.hpp"

namespace kvpolicy {

struct Nearest {
  static constexpr std::string_view name = "nearest";
  static constexpr std::int64_t block = 256;  // evicted tokens per similarity GEMM

  static Nearest from_params(Params&) { return {}; }
  Needs needs() const { return Needs::keys | Needs::values; }

  template <Element T>
  void merge(const cpu_backend& be, const MergeArgs<T>& a) const {
    merge_detail::validate(a, name, false);
    const std::int64_t H = a.keys.heads;
    cpu::parallel_for(be, a.keys.layers * H, [&](std::int64_t r) { merge_row(a, r / H, r % H); });
  }

  // For each evicted token of row (l, h), the index of its most similar target; -1 if none.
  template <Element T>
  static std::vector<std::int32_t> nearest_targets(const MergeArgs<T>& a, std::int64_t l,
                                                   std::int64_t h,
                                                   const std::vector<std::int32_t>& evicted,
                                                   const std::vector<std::int32_t>& targets) {
    return cpu::nearest_targets(a.keys, l, h, evicted, targets, block);
  }

 private:
  template <Element T>
  void merge_row(const MergeArgs<T>& a, std::int64_t l, std::int64_t h) const {
    using merge_detail::Role;
    const std::int64_t Tk = a.keys.tokens, r = l * a.keys.heads + h;
    if (a.selection->count(l, h) >= Tk) return;
    std::vector<Role> roles;
    merge_detail::row_roles(Tk, a.protect, a.selection->kept(l, h), roles);
    std::vector<std::int32_t> targets, evicted;
    for (std::int64_t j = 0; j < Tk; ++j) {
      const Role rj = roles[static_cast<std::size_t>(j)];
      if (rj != Role::protected_) (rj == Role::kept ? targets : evicted).push_back(static_cast<std::int32_t>(j));
    }
    if (targets.empty() || evicted.empty()) return;
    const std::vector<std::int32_t> into = nearest_targets(a, l, h, evicted, targets);
    // Group the evicted tokens by target (stable: token order inside a group).
    std::vector<std::int32_t> slot(static_cast<std::size_t>(Tk), -1), first(targets.size(), -1),
        next(evicted.size(), -1), tail(targets.size(), -1);
    for (std::size_t t = 0; t < targets.size(); ++t)
      slot[static_cast<std::size_t>(targets[t])] = static_cast<std::int32_t>(t);
    for (std::size_t e = 0; e < evicted.size(); ++e) {
      const auto t = static_cast<std::size_t>(slot[static_cast<std::size_t>(into[e])]);
      (tail[t] < 0 ? first[t] : next[static_cast<std::size_t>(tail[t])]) = static_cast<std::int32_t>(e);
      tail[t] = static_cast<std::int32_t>(e);
    }
    float* lc = a.log_count + r * merge_detail::log_count_stride(a);
    merge_detail::RowAccumulator<T> acc(a.keys.dim);
    for (std::size_t t = 0; t < targets.size(); ++t) {
      if (first[t] < 0) continue;
      acc.reset();
      const double ct = merge_detail::count_of(lc[targets[t]]);
      acc.add(a, l, h, targets[t], ct, ct, false);
      for (std::int32_t e = first[t]; e >= 0; e = next[static_cast<std::size_t>(e)]) {
        const std::int32_t j = evicted[static_cast<std::size_t>(e)];
        const double c = merge_detail::count_of(lc[j]);
        acc.add(a, l, h, j, c, c, false);
      }
      acc.write(a, l, h, targets[t], false, lc);
    }
  }
};

static_assert(Merger<Nearest>);

}  // namespace kvpolicy
