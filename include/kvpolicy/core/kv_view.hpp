// KVView<T>: non-owning strided view [layer][kv_head][token][head_dim] over an engine's memory.
// Strides are in elements. HND (head-major, the default) and NHD (token-major, as vLLM and
// llama.cpp store K) are two stride patterns of the same view; a transposed layout is expressed
// by a head_dim stride other than 1. Trivially copyable, so it can be passed to a kernel.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string_view>
#include <utility>
#include <type_traits>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"

namespace kvpolicy {

enum class Layout : std::uint8_t { HND, NHD };

template <class T>
struct KVView {
  T* data = nullptr;
  std::int64_t layers = 0, heads = 0, tokens = 0, dim = 0;
  std::int64_t stride_layer = 0, stride_head = 0, stride_token = 0, stride_dim = 1;

  // Contiguous [layer][head][token][dim].
  static KVView hnd(T* p, std::int64_t L, std::int64_t H, std::int64_t N, std::int64_t D) {
    return {p, L, H, N, D, H * N * D, N * D, D, 1};
  }
  // Contiguous [layer][token][head][dim].
  static KVView nhd(T* p, std::int64_t L, std::int64_t H, std::int64_t N, std::int64_t D) {
    return {p, L, H, N, D, N * H * D, D, H * D, 1};
  }
  static KVView make(Layout lay, T* p, std::int64_t L, std::int64_t H, std::int64_t N,
                     std::int64_t D) {
    return lay == Layout::HND ? hnd(p, L, H, N, D) : nhd(p, L, H, N, D);
  }

  KVP_HD T* row(std::int64_t l, std::int64_t h, std::int64_t t) const {
    return data + l * stride_layer + h * stride_head + t * stride_token;
  }
  KVP_HD T& at(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t i) const {
    return row(l, h, t)[i * stride_dim];
  }
  // One layer as a view with layers == 1.
  KVView layer(std::int64_t l) const {
    KVView v = *this;
    v.data = row(l, 0, 0);
    v.layers = 1;
    return v;
  }
  // First n tokens.
  KVView prefix(std::int64_t n) const {
    KVView v = *this;
    v.tokens = n;
    return v;
  }
  // A template (U is T) so that KVView<const T> declares no conversion to itself, which nvcc
  // warns about (#554) even under the constraint.
  template <class U>
    requires(std::is_same_v<U, T> && !std::is_const_v<U>)
  operator KVView<const U>() const  // NOLINT: implicit view-to-const like std::span
  {
    return {data, layers, heads, tokens, dim, stride_layer, stride_head, stride_token, stride_dim};
  }
  bool rows_contiguous() const { return stride_dim == 1; }
};

namespace detail {
// True when the product of non-negative factors fits an int64 (ptrdiff_t, a std::vector's limit
// in bytes). Buffers sized by a product of extents check it before computing the product.
inline bool product_fits(std::initializer_list<std::int64_t> factors) {
  std::int64_t p = 1;
  for (const std::int64_t f : factors) {
    if (f != 0 && p > std::numeric_limits<std::int64_t>::max() / f) return false;
    p *= f;
  }
  return true;
}

// The index space of a view must be addressable even when the view is empty: [2^62][4][0][d]
// holds no element, but selections and budgets still count its L * H rows. Zero extents count
// as 1 here.
template <std::size_t N>
void require_addressable(const std::int64_t (&ext)[N], std::size_t elem_bytes,
                         std::string_view what) {
  std::int64_t p = static_cast<std::int64_t>(elem_bytes);
  for (const std::int64_t e : ext) {
    const std::int64_t f = e > 0 ? e : 1;
    KVP_REQUIRE(p <= std::numeric_limits<std::int64_t>::max() / f, what,
                ": extents span more elements than the address space holds");
    p *= f;
  }
}

// No two elements of an N-d strided view alias each other. Sufficient check: order the dims by
// stride (extent-1 dims do not matter) and require each stride to step over the full extent of
// the smaller ones. Extents are positive, strides were checked non-negative.
template <std::size_t N>
void require_no_overlap(const std::int64_t (&ext)[N], const std::int64_t (&str)[N],
                        const char* const (&names)[N], std::string_view what) {
  std::size_t order[N];
  for (std::size_t i = 0; i < N; ++i) order[i] = i;
  for (std::size_t i = 0; i < N; ++i)
    for (std::size_t j = i + 1; j < N; ++j)
      if (str[order[j]] < str[order[i]]) std::swap(order[i], order[j]);
  std::int64_t span = 1;  // elements covered by the dims seen so far
  for (std::size_t k = 0; k < N; ++k) {
    const std::size_t d = order[k];
    if (ext[d] == 1) continue;
    KVP_REQUIRE(str[d] >= span, what, ": ", names[d], " stride ", str[d],
                " overlaps the inner dimensions (needs >= ", span, ")");
    KVP_REQUIRE(str[d] <= (std::numeric_limits<std::int64_t>::max() - span) / (ext[d] - 1), what,
                ": ", names[d], " stride ", str[d], " x ", ext[d] - 1,
                " reaches past the address space");
    span = str[d] * (ext[d] - 1) + span;
  }
}
}  // namespace detail

// Checks shape and strides: positive extents, non-negative strides, and no two elements of the
// view aliasing each other (see detail::require_no_overlap). `what` names the argument in the
// message.
template <class T>
void validate(const KVView<T>& v, std::string_view what) {
  KVP_REQUIRE(v.layers >= 0 && v.heads >= 0 && v.tokens >= 0 && v.dim >= 0, what,
              ": negative extent (layers=", v.layers, ", heads=", v.heads, ", tokens=", v.tokens,
              ", dim=", v.dim, ")");
  const std::int64_t ext[4] = {v.layers, v.heads, v.tokens, v.dim};
  detail::require_addressable(ext, sizeof(T), what);
  if (v.layers == 0 || v.heads == 0 || v.tokens == 0 || v.dim == 0) return;
  KVP_REQUIRE(v.data != nullptr, what, ": null data pointer");
  const std::int64_t str[4] = {v.stride_layer, v.stride_head, v.stride_token, v.stride_dim};
  const char* const names[4] = {"layer", "head", "token", "dim"};
  for (int i = 0; i < 4; ++i)
    KVP_REQUIRE(str[i] >= 0, what, ": negative ", names[i], " stride ", str[i]);
  detail::require_no_overlap(ext, str, names, what);
}

// Checks that keys/values contain only finite numbers (NaN/Inf in the cache would make every
// score meaningless and selection non-deterministic) and, when `max_abs` is given, that every
// magnitude is below it (`why` says what needs that), in one pass.
template <class T>
void require_finite(const KVView<T>& v, std::string_view what,
                    float max_abs = std::numeric_limits<float>::infinity(),
                    std::string_view why = {}) {
  // An empty view may have huge other extents (validate() accepts [2^40][1][0][d]): no loop.
  if (v.layers == 0 || v.heads == 0 || v.tokens == 0 || v.dim == 0) return;
  for (std::int64_t l = 0; l < v.layers; ++l)
    for (std::int64_t h = 0; h < v.heads; ++h)
      for (std::int64_t t = 0; t < v.tokens; ++t)
        for (std::int64_t i = 0; i < v.dim; ++i) {
          float x = to_float(v.at(l, h, t, i));
          KVP_REQUIRE(std::isfinite(x), what, " contains a non-finite value (", x, ") at layer ",
                      l, ", head ", h, ", token ", t, ", dim ", i);
          KVP_REQUIRE(std::fabs(x) < max_abs, what, " holds ", x, " at layer ", l, ", head ", h,
                      ", token ", t, ", dim ", i, ": ", why);
        }
}

// `v` as a TensorRef (core/types.hpp): the element type carried at run time, for external scorers
// and the CUDA kernels' type-erased entry points.
template <class T>
  requires Element<T>
TensorRef erase(const KVView<T>& v) {
  return {v.data,         dtype_of<T>,   v.layers,       v.heads,      v.tokens, v.dim,
          v.stride_layer, v.stride_head, v.stride_token, v.stride_dim};
}

}  // namespace kvpolicy
