// CUDA semantic merger: the device twin of mergers/semantic.hpp (Semantic::merge), with results
// bit-identical to the CPU merger (same clusters, same K/V bytes, same log_count). Host wrapper
// over merge_launch.hpp that checks its arguments and throws kvpolicy::Error; the work is
// enqueued on the backend's stream. Kernel: cuda/merge.cu; the row logic: mergers/gsc_row.hpp.
#pragma once
#include <type_traits>

#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/cuda/compact.hpp"
#include "kvpolicy/cuda/merge_launch.hpp"
#include "kvpolicy/mergers/semantic.hpp"

namespace kvpolicy::cuda {

// MergeArgs on the device: a CSR selection and fp32 scores instead of the host containers.
// Every pointer is device memory. log_count must hold finite values >= 0 (the CPU merger checks
// them; here they are trusted, reading them back would cost a copy).
template <Element T>
struct DeviceMergeArgs {
  KVView<T> keys, values;
  CsrSelection selection;
  ScoreView scores;
  float* log_count = nullptr;
  std::int64_t log_count_stride = 0;  // 0: keys.tokens
  Protect protect;
  const std::uint8_t* delimiter = nullptr;
  std::int64_t delimiter_stride = 0;  // 0: one mask shared by every row
  std::uint8_t* chunk_end = nullptr;
  std::int64_t chunk_end_stride = 0;  // 0: keys.tokens
};

template <Element T>
std::size_t semantic_merge_workspace_bytes(const KVView<T>& keys) {
  return semantic_merge_workspace_bytes(keys.layers * keys.heads, keys.tokens);
}

template <Element T>
void merge(const cuda_backend& be, const Semantic& s, const DeviceMergeArgs<T>& a) {
  static_assert(!std::is_const_v<T>, "merge writes the cache: pass a mutable view");
  s.validate();
  validate(a.keys, "semantic (cuda): keys");
  validate(a.values, "semantic (cuda): values");
  const std::int64_t L = a.keys.layers, H = a.keys.heads, Tk = a.keys.tokens;
  KVP_REQUIRE(a.values.layers == L && a.values.heads == H && a.values.tokens == Tk &&
                  a.values.dim == a.keys.dim,
              "semantic (cuda): values do not match keys");
  KVP_REQUIRE(Tk <= (std::int64_t{1} << 31) - 1, "semantic (cuda): ", Tk,
              " tokens exceed the int32 index range");
  require_selection_shape(a.selection, L, H, "semantic (cuda)");
  KVP_REQUIRE(a.scores.layers == L && a.scores.heads == H && a.scores.tokens == Tk &&
                  a.scores.row_stride >= Tk && (L * H * Tk == 0 || a.scores.data),
              "semantic (cuda): scores are [", a.scores.layers, ",", a.scores.heads, ",",
              a.scores.tokens, "] (row stride ", a.scores.row_stride, ") but the cache has [", L,
              ",", H, ",", Tk, "]");
  KVP_REQUIRE(a.log_count != nullptr || L * H * Tk == 0, "semantic (cuda): log_count is required");
  KVP_REQUIRE(a.log_count_stride == 0 || a.log_count_stride >= Tk,
              "semantic (cuda): log_count_stride below the tokens");
  KVP_REQUIRE(a.delimiter_stride == 0 || a.delimiter_stride >= Tk,
              "semantic (cuda): delimiter_stride below the tokens");
  KVP_REQUIRE(a.chunk_end_stride == 0 || a.chunk_end_stride >= Tk,
              "semantic (cuda): chunk_end_stride below the tokens");
  KVP_REQUIRE(a.protect.sinks >= 0 && a.protect.recent >= 0, "semantic (cuda): negative protect");
  KVP_REQUIRE(a.delimiter != nullptr || s.chunk > 0,
              "semantic: chunk must be > 0 when no delimiter mask is given, got ", s.chunk);
  KVP_REQUIRE(!(a.chunk_end != nullptr && a.chunk_end == a.delimiter &&
                a.delimiter_stride == 0 && L * H > 1),
              "semantic: chunk_end may alias the delimiter mask only when it is per row "
              "(delimiter_stride > 0)");
  SemanticMergeArgs d;
  d.keys = rows_view(a.keys);
  d.values = rows_view(a.values);
  d.type = dtype_of<T>;
  d.selection = a.selection;
  d.scores = a.scores.data;
  d.score_stride = a.scores.row_stride;
  d.log_count = a.log_count;
  d.log_count_stride = a.log_count_stride;
  d.sinks = a.protect.sinks;
  d.recent = a.protect.recent;
  d.delimiter = a.delimiter;
  d.delimiter_stride = a.delimiter_stride;
  d.chunk_end = a.chunk_end;
  d.chunk_end_stride = a.chunk_end_stride;
  gsc::Params p;
  p.tau = s.tau;
  p.chunk = s.chunk;
  p.importance = s.weight == MergeWeight::importance;
  throw_if_error(semantic_merge(be, p, d), "cuda::merge (semantic)");
}

}  // namespace kvpolicy::cuda
