// Split-KV decode attention on the device: the twin of cpu::attention (cpu/attention.hpp) for one
// layer of a ragged cache (per-KV-head lengths, GQA, optional log_count bias, optional causal
// tail, optional H2O accumulate / observed statistics), fp32 / fp16 / bf16 strided K, V and
// queries, fp32 output [Hq][n_q][d]. Three passes (partial per (KV head, split), merge per row,
// statistics per key); the math is kvpolicy/cuda/decode_math.hpp. Kernels: cuda/decode.cu
// (head_dim 64, 128, 256 as template constants). The launch layer returns a Status and never
// throws; attention() below checks its arguments and throws. Caller-owned workspace (two-phase:
// size it with decode_workspace_bytes). No CUDA or Eigen headers in the launch part.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/cuda/score_launch.hpp"  // TensorRef, DType
#include "kvpolicy/cuda/status.hpp"

namespace kvpolicy::cuda {

// Device pointers, as cpu::RaggedAttentionArgs (lengths live in device memory here).
struct DecodeArgs {
  const std::int64_t* lengths = nullptr;  // [Hkv], each in [0, keys.tokens] (trusted)
  const float* bias = nullptr;            // optional [Hkv][bias_stride]
  std::int64_t bias_stride = 0;
  bool causal = false;
  float* accumulate = nullptr;  // optional [Hkv][state_stride]
  float* observed = nullptr;    // optional [Hkv][state_stride]
  std::int64_t state_stride = 0;
  float acc_scale = 1.0f;
  std::int64_t split = 0;  // keys per split (a multiple of 4096 / d); 0: chosen from the shape
};

// Keys per split for a shape (what split = 0 means): enough (KV head, split) blocks to fill a
// large GPU, at least one key tile, a multiple of the tile.
std::int64_t decode_default_split(std::int64_t kv_heads, std::int64_t tokens, std::int64_t dim);

// keys, values: one layer (layers == 1) in device memory; queries [1][Hq][n_q][d].
Status decode_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                              const DecodeArgs& args, std::size_t& bytes);

// out: device fp32 [Hq][n_q][d] contiguous.
Status decode_attention(const cuda_backend& be, const TensorRef& keys, const TensorRef& values,
                        const TensorRef& queries, const DecodeArgs& args, float* out);

}  // namespace kvpolicy::cuda

#if !defined(__CUDACC__)
#include <type_traits>

#include "kvpolicy/core/dtype.hpp"
#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/cuda/tensor_view.hpp"

namespace kvpolicy::cuda {

namespace detail {
template <Element T, Element Q>
void require_decode_args(const KVView<const T>& keys, const KVView<const T>& values,
                         const KVView<const Q>& queries, const DecodeArgs& a) {
  KVP_REQUIRE(keys.layers == 1 && values.layers == 1 && queries.layers == 1,
              "cuda::attention: pass one layer");
  KVP_REQUIRE(keys.data && values.data && queries.data && a.lengths,
              "cuda::attention: null keys, values, queries or lengths");
  KVP_REQUIRE(keys.heads > 0 && queries.heads % keys.heads == 0, "cuda::attention: ",
              queries.heads, " query heads are not a multiple of ", keys.heads, " KV heads");
  KVP_REQUIRE(values.heads == keys.heads && values.tokens == keys.tokens,
              "cuda::attention: values shape differs from keys");
  KVP_REQUIRE(queries.dim == keys.dim && values.dim == keys.dim,
              "cuda::attention: head_dim mismatch");
  KVP_REQUIRE(keys.dim == 64 || keys.dim == 128 || keys.dim == 256,
              "cuda::attention: head_dim ", keys.dim, " (supported: 64, 128, 256)");
  KVP_REQUIRE(queries.tokens >= 1, "cuda::attention: no queries");
  KVP_REQUIRE(!a.bias || a.bias_stride >= keys.tokens, "cuda::attention: bias_stride ",
              a.bias_stride, " < tokens ", keys.tokens);
  KVP_REQUIRE(!(a.accumulate || a.observed) || a.state_stride >= keys.tokens,
              "cuda::attention: state_stride ", a.state_stride, " < tokens ", keys.tokens);
}
}  // namespace detail

template <Element T, Element Q>
std::size_t attention_workspace_bytes(const KVView<const T>& keys, const KVView<const T>& values,
                                      const KVView<const Q>& queries, const DecodeArgs& args) {
  detail::require_decode_args(keys, values, queries, args);
  std::size_t b = 0;
  throw_if_error(decode_workspace_bytes(erase(keys), erase(queries), args, b),
                 "cuda::attention_workspace_bytes");
  return b;
}

// cpu::attention on device views (args: device pointers). Asynchronous on be.stream.
template <Element T, Element Q>
void attention(const cuda_backend& be, const KVView<const T>& keys, const KVView<const T>& values,
               const KVView<const Q>& queries, const DecodeArgs& args, float* out) {
  detail::require_decode_args(keys, values, queries, args);
  KVP_REQUIRE(out, "cuda::attention: null output");
  throw_if_error(decode_attention(be, erase(keys), erase(values),
                                  erase(queries), args, out),
                 "cuda::attention");
}

}  // namespace kvpolicy::cuda
#endif
