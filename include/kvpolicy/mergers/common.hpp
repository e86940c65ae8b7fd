// What the mergers (semantic, nearest) share: checking MergeArgs before anything is written, the
// per-row roles of tokens (protected, kept, evicted), token counts read from log_count, and
// writing a merged row. Internal to mergers/.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "kvpolicy/concepts.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/mergers/gsc_row.hpp"

namespace kvpolicy::merge_detail {

template <class T>
std::int64_t log_count_stride(const MergeArgs<T>& a) {
  return a.log_count_stride > 0 ? a.log_count_stride : a.keys.tokens;
}

// Every shape, stride and count check, so that a bad argument throws before any row changes.
template <class T>
void validate(const MergeArgs<T>& a, std::string_view who, bool needs_scores) {
  validate(a.keys, "keys");
  validate(a.values, "values");
  const std::int64_t L = a.keys.layers, H = a.keys.heads, Tk = a.keys.tokens;
  KVP_REQUIRE(a.values.layers == L && a.values.heads == H && a.values.tokens == Tk &&
                  a.values.dim == a.keys.dim,
              who, ": values [", a.values.layers, ",", a.values.heads, ",", a.values.tokens, ",",
              a.values.dim, "] do not match keys [", L, ",", H, ",", Tk, ",", a.keys.dim, "]");
  KVP_REQUIRE(Tk <= (std::int64_t{1} << 31) - 1, who, ": ", Tk,
              " tokens exceed the int32 index range");
  KVP_REQUIRE(a.selection != nullptr, who, ": a selection is required");
  KVP_REQUIRE(a.selection->layers() == L && a.selection->heads() == H, who, ": selection is [",
              a.selection->layers(), ",", a.selection->heads(), "] but the cache has [", L, ",",
              H, "]");
  a.selection->validate(Tk);
  if (needs_scores) {
    KVP_REQUIRE(a.scores != nullptr, who, ": scores are required (they order the seeds)");
    KVP_REQUIRE(a.scores->layers() == L && a.scores->heads() == H && a.scores->tokens() == Tk,
                who, ": scores are [", a.scores->layers(), ",", a.scores->heads(), ",",
                a.scores->tokens(), "] but the cache has [", L, ",", H, ",", Tk, "]");
  }
  KVP_REQUIRE(a.log_count != nullptr, who, ": log_count is required (it receives the counts)");
  KVP_REQUIRE(a.log_count_stride == 0 || a.log_count_stride >= Tk, who, ": log_count_stride ",
              a.log_count_stride, " is below the ", Tk, " tokens of the event");
  KVP_REQUIRE(a.delimiter_stride == 0 || a.delimiter_stride >= Tk, who, ": delimiter_stride ",
              a.delimiter_stride, " is below the ", Tk, " tokens of the event");
  KVP_REQUIRE(a.chunk_end_stride == 0 || a.chunk_end_stride >= Tk, who, ": chunk_end_stride ",
              a.chunk_end_stride, " is below the ", Tk, " tokens of the event");
  KVP_REQUIRE(a.protect.sinks >= 0 && a.protect.recent >= 0, who, ": negative protect (sinks ",
              a.protect.sinks, ", recent ", a.protect.recent, ")");
  const std::int64_t ls = log_count_stride(a);
  for (std::int64_t r = 0; r < L * H; ++r)
    for (std::int64_t j = 0; j < Tk; ++j) {
      const float lc = a.log_count[r * ls + j];
      KVP_REQUIRE(std::isfinite(lc) && lc >= 0.f, who, ": log_count ", lc, " at layer ", r / H,
                  ", head ", r % H, ", token ", j,
                  " is not the log of a count >= 1 (new tokens start at 0)");
    }
}

// The count a token stands for. Counts are integers; rounding exp(log_count) keeps their sums
// exact across events (float log_count carries ~1e-7 relative error).
inline double count_of(float log_count) { return gsc::count_of(log_count); }

// Per-row token roles. Tokens in the protected ranges (first `sinks`, last `recent`, as the
// selection protected them) are never seeds, members or targets.
// Same values as gsc::role_* (the CUDA path and mark_chunk_end read them as bytes).
enum class Role : std::uint8_t { evicted = gsc::role_evicted, kept = gsc::role_kept,
                                 protected_ = gsc::role_protected };

inline void row_roles(std::int64_t tokens, Protect p, std::span<const std::int32_t> kept,
                      std::vector<Role>& roles) {
  roles.assign(static_cast<std::size_t>(tokens), Role::evicted);
  for (std::int32_t j : kept) roles[static_cast<std::size_t>(j)] = Role::kept;
  const std::int64_t sinks = std::min(p.sinks, tokens);
  const std::int64_t recent_begin = std::max(sinks, tokens - p.recent);
  for (std::int64_t j = 0; j < tokens; ++j)
    if (j < sinks || j >= recent_begin) roles[static_cast<std::size_t>(j)] = Role::protected_;
}

// Row (l, h, t) of a view as fp64.
template <class T>
void load_row(const KVView<T>& v, std::int64_t l, std::int64_t h, std::int64_t t, double* out) {
  const T* src = v.row(l, h, t);
  for (std::int64_t i = 0; i < v.dim; ++i)
    out[i] = static_cast<double>(to_float(src[i * v.stride_dim]));
}

template <class T>
void store_row(const KVView<T>& v, std::int64_t l, std::int64_t h, std::int64_t t,
               const double* in) {
  T* dst = v.row(l, h, t);
  for (std::int64_t i = 0; i < v.dim; ++i)
    dst[i * v.stride_dim] = from_float<T>(static_cast<float>(in[i]));
}

// Accumulates the weighted sum of member rows of K and V, then writes their mean into the
// target's row together with log(total count).
template <class T>
class RowAccumulator {
 public:
  explicit RowAccumulator(std::int64_t dim)
      : d_(dim), k_(static_cast<std::size_t>(dim)), v_(k_.size()), tmp_(k_.size()) {}

  void reset() {
    std::fill(k_.begin(), k_.end(), 0.0);
    std::fill(v_.begin(), v_.end(), 0.0);
    weight_ = count_ = 0.0;
  }
  // Adds member t with weight w (K only when with_keys) standing for `count` tokens.
  void add(const MergeArgs<T>& a, std::int64_t l, std::int64_t h, std::int64_t t, double w,
           double count, bool with_keys) {
    if (with_keys) {
      load_row(a.keys, l, h, t, tmp_.data());
      for (std::int64_t i = 0; i < d_; ++i)
        k_[static_cast<std::size_t>(i)] = gsc::add_product(k_[static_cast<std::size_t>(i)], w, tmp_[static_cast<std::size_t>(i)]);
    }
    load_row(a.values, l, h, t, tmp_.data());
    for (std::int64_t i = 0; i < d_; ++i)
      v_[static_cast<std::size_t>(i)] = gsc::add_product(v_[static_cast<std::size_t>(i)], w, tmp_[static_cast<std::size_t>(i)]);
    weight_ += w;
    count_ += count;
  }
  void write(const MergeArgs<T>& a, std::int64_t l, std::int64_t h, std::int64_t t,
             bool with_keys, float* log_count_row) {
    const double inv = 1.0 / weight_;
    for (auto& x : k_) x *= inv;
    for (auto& x : v_) x *= inv;
    if (with_keys) store_row(a.keys, l, h, t, k_.data());
    store_row(a.values, l, h, t, v_.data());
    log_count_row[t] = gsc::log_count_of(count_);
  }

 private:
  std::int64_t d_;
  std::vector<double> k_, v_, tmp_;
  double weight_ = 0.0, count_ = 0.0;
};

}  // namespace kvpolicy::merge_detail
