// CUDA batched per-(layer, head) top-k with protected tokens: the device twin of cpu/select.hpp
// (identical kept sets, ties included: both order by topk_key, see select_key.hpp). Host
// wrappers over launch.hpp that check their arguments and throw kvpolicy::Error; the work is
// enqueued on the backend's stream. Algorithm and workspace layout: cuda/select.cu.
#pragma once
#include <algorithm>
#include <span>

#include "kvpolicy/core/inputs.hpp"
#include "kvpolicy/cuda/launch.hpp"
#include "kvpolicy/cuda/select_key.hpp"

namespace kvpolicy::cuda {

// Workspace select() needs for `rows` rows of `tokens` tokens on the current device.
inline std::size_t select_workspace_bytes(std::int64_t rows, std::int64_t tokens) {
  std::size_t bytes = 0;
  throw_if_error(select_workspace_bytes(rows, tokens, bytes), "cuda::select_workspace_bytes");
  return bytes;
}
inline std::size_t select_workspace_bytes(const ScoreView& s) {
  return select_workspace_bytes(s.rows(), s.tokens);
}

// Entries the CSR indices need for these budgets: sum over rows of min(budget, tokens).
inline std::int64_t kept_total(std::span<const std::int64_t> budgets, std::int64_t tokens) {
  std::int64_t n = 0;
  for (std::int64_t b : budgets) n += std::clamp<std::int64_t>(b, 0, tokens);
  return n;
}

namespace detail {
inline void require_select_args(const cuda_backend& be, const ScoreView& s,
                                const CsrSelection& out) {
  KVP_REQUIRE(s.layers >= 0 && s.heads >= 0 && s.tokens >= 0, "select: negative score shape [",
              s.layers, ",", s.heads, ",", s.tokens, "]");
  KVP_REQUIRE(s.tokens <= (std::int64_t{1} << 31) - 1, "select: ", s.tokens,
              " tokens exceed the int32 index range");
  KVP_REQUIRE(s.row_stride >= s.tokens, "select: score row stride ", s.row_stride,
              " is below the ", s.tokens, " tokens of a row");
  KVP_REQUIRE(s.rows() == 0 || s.tokens == 0 || s.data, "select: null score pointer");
  KVP_REQUIRE(out.layers == s.layers && out.heads == s.heads, "select: output selection is [",
              out.layers, ",", out.heads, "] but the scores are [", s.layers, ",", s.heads, "]");
  KVP_REQUIRE(s.rows() == 0 || out.offsets, "select: output selection has null offsets");
  KVP_REQUIRE(be.workspace_bytes == 0 || be.workspace, "select: workspace_bytes is ",
              be.workspace_bytes, " but the workspace pointer is null");
}
}  // namespace detail

// Budgets on the host, one per (layer, head) row, checked like cpu::select: each >= 0, and at
// least the protected count where it evicts; out.capacity must hold kept_total(budgets).
inline void select(const cuda_backend& be, const ScoreView& scores,
                   std::span<const std::int64_t> budgets, Protect p, CsrSelection& out) {
  detail::require_select_args(be, scores, out);
  const std::int64_t T = scores.tokens;
  KVP_REQUIRE(static_cast<std::int64_t>(budgets.size()) == scores.rows(), "select: ",
              budgets.size(), " budgets for ", scores.rows(), " (layer, head) rows");
  const std::int64_t n_protected = protected_span(p.sinks, p.recent, T).count(T);
  for (std::int64_t b : budgets) {
    KVP_REQUIRE(b >= 0, "select: negative budget ", b);
    KVP_REQUIRE(b >= T || b >= n_protected, "budget of ", b, " tokens is below the ",
                n_protected, " protected tokens (", p.sinks, " sinks + ", p.recent, " recent)");
  }
  const std::int64_t need = kept_total(budgets, T);
  KVP_REQUIRE(out.capacity >= need, "select: output selection holds ", out.capacity,
              " indices but the budgets keep ", need);
  KVP_REQUIRE(need == 0 || out.indices, "select: output selection has null indices");
  throw_if_error(select_rows(be, scores, budgets.data(), BudgetsAt::host, p.sinks, p.recent, out),
                 "cuda::select");
}

// Budgets already on the device (an allocator ran there): nothing about them can be checked
// without a copy, so out.capacity must hold sum(min(budget, tokens)) and each budget should be
// at least the protected count (see select_rows).
inline void select(const cuda_backend& be, const ScoreView& scores,
                   const std::int64_t* device_budgets, Protect p, CsrSelection& out) {
  detail::require_select_args(be, scores, out);
  KVP_REQUIRE(scores.rows() == 0 || device_budgets, "select: null budgets pointer");
  throw_if_error(
      select_rows(be, scores, device_budgets, BudgetsAt::device, p.sinks, p.recent, out),
      "cuda::select");
}

}  // namespace kvpolicy::cuda
