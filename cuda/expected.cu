// Expected attention on the GPU (kvpolicy/cuda/expected.hpp): the device twin of
// scorers/expected.hpp, in five kernels on the backend's stream (see the header). Per-element
// math: scorers/expected_row.hpp (KVP_HD, driven on the host by
// tests/agreement/test_expected_cuda.cpp's emulation of these grids).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "check.cuh"
#include "elem.cuh"
#include "kvpolicy/cuda/expected.hpp"

namespace kvpolicy::cuda {
namespace {

namespace rm = row_math;

constexpr int kBlock = 256;
constexpr int kWarpsPerBlock = kBlock / kWarpLanes;
constexpr std::size_t align256(std::size_t x) { return (x + 255) & ~std::size_t{255}; }

// A strided [L][H][T][d] tensor; row(l, h, t) reads one token's d elements as float.
template <class E>
using Row = detail::ElemRow<E>;
template <class E>
struct View4 {
  const E* data;
  std::int64_t sl, sh, st, sd;
  __device__ Row<E> row(std::int64_t l, std::int64_t h, std::int64_t t) const {
    return {data + l * sl + h * sh + t * st, sd};
  }
};
template <class E>
View4<E> view_of(const TensorRef& v) {
  return {static_cast<const E*>(v.data), v.stride_layer, v.stride_head, v.stride_token,
          v.stride_dim};
}

struct Doubles {  // element access for the row math
  const double* p;
  __host__ __device__ double operator()(std::int64_t i) const { return p[i]; }
};

template <class V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int off = kWarpLanes / 2; off >= 1; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// ---- workspace --------------------------------------------------------------------------------

struct Shape {
  std::int64_t L = 0, H = 0, Hq = 0, T = 0, d = 0, n = 0;  // n: queries whose statistics count
  __host__ __device__ std::int64_t rows() const { return L * Hq; }
};
struct Layout {
  std::size_t rq = 0, sig = 0, muf = 0, sigf = 0, z = 0, zmax = 0, zsum = 0, total = 0;
};
Layout layout_of(const Shape& s, bool cov) {
  const auto R = static_cast<std::size_t>(s.rows()), n = static_cast<std::size_t>(s.n),
             d = static_cast<std::size_t>(s.d), T = static_cast<std::size_t>(s.T);
  Layout w;
  std::size_t at = 0;
  w.rq = at, at += align256(R * n * d * sizeof(double));
  w.sig = at, at += cov ? align256(R * d * d * sizeof(double)) : 0;
  w.muf = at, at += align256(R * d * sizeof(float));
  w.sigf = at, at += cov ? align256(R * d * d * sizeof(float)) : 0;
  w.z = at, at += align256(R * T * sizeof(double));
  w.zmax = at, at += align256(R * sizeof(double));
  w.zsum = at, at += align256(R * sizeof(double));
  w.total = at;
  return w;
}
struct Ws {
  double* rq;
  double* sig;
  float* muf;
  float* sigf;
  double* z;
  double* zmax;
  double* zsum;
};
Ws carve(void* base, const Layout& w) {
  auto* b = static_cast<unsigned char*>(base);
  return {reinterpret_cast<double*>(b + w.rq),  reinterpret_cast<double*>(b + w.sig),
          reinterpret_cast<float*>(b + w.muf),  reinterpret_cast<float*>(b + w.sigf),
          reinterpret_cast<double*>(b + w.z),   reinterpret_cast<double*>(b + w.zmax),
          reinterpret_cast<double*>(b + w.zsum)};
}

// ---- kernels ----------------------------------------------------------------------------------

// 1. One block per query head row (l, hq): the used queries rotated to the next position, their
// mean (each dim summed over the queries in order), R mu; with cov, the covariance entries (each
// a sum over the queries in order) and R Sigma R^T.
template <class E>
__global__ void __launch_bounds__(kBlock)
    stats_kernel(View4<E> q, Shape s, std::int64_t q0, ExpectedArgs a, Ws w) {
  __shared__ double mu[2 * rm::kExpectedMaxPairs];
  const std::int64_t row = blockIdx.x, l = row / s.Hq, hq = row % s.Hq;
  const std::int64_t n = s.n, d = s.d, half = d / 2;
  double* rq = w.rq + row * n * d;
  for (std::int64_t idx = threadIdx.x; idx < n * d; idx += blockDim.x) {
    const std::int64_t i = a.skip + idx / d, e = idx % d, p = e < half ? e : e - half;
    double sn = 0, cs = 0;
    sincos(rm::rope_angle(a.nq - i, a.inv_freq[p]), &sn, &cs);
    const Row<E> qi = q.row(l, hq, q0 + i);
    double rx = 0, rw = 0;
    rm::rope_pair(qi(p), qi(p + half), cs, sn, rx, rw);
    rq[idx] = e < half ? rx : rw;
  }
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < d; e += blockDim.x) {
    double m = 0;
    for (std::int64_t i = 0; i < n; ++i) m += rq[i * d + e];
    mu[e] = m / static_cast<double>(n);
  }
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < d; e += blockDim.x)
    w.muf[row * d + e] = static_cast<float>(rm::rotate_component(Doubles{mu}, half, a.cbar, a.sbar, e));
  if (!a.cov) return;
  double* sig = w.sig + row * d * d;
  for (std::int64_t idx = threadIdx.x; idx < d * d; idx += blockDim.x) {
    const std::int64_t e = idx / d, f = idx % d;
    double acc = 0;
    for (std::int64_t i = 0; i < n; ++i) acc += (rq[i * d + e] - mu[e]) * (rq[i * d + f] - mu[f]);
    sig[idx] = acc / static_cast<double>(n);
  }
  __syncthreads();
  for (std::int64_t idx = threadIdx.x; idx < d * d; idx += blockDim.x)
    w.sigf[row * d * d + idx] =
        static_cast<float>(rm::rotate_sigma_entry(sig, d, a.cbar, a.sbar, idx / d, idx % d));
}

// 2. One warp per (query head row, non-sink key): the log-MGF logit.
template <class E>
__global__ void __launch_bounds__(kBlock)
    logits_kernel(View4<E> k, Shape s, std::int64_t s_end, bool cov, const float* muf,
                  const float* sigf, double* z) {
  const int lane = threadIdx.x % kWarpLanes;
  const std::int64_t keys = s.T - s_end, items = s.rows() * keys, group = s.Hq / s.H;
  const double lin_scale = 1.0 / sqrt(static_cast<double>(s.d)), quad_div = 2.0 * s.d;
  const std::int64_t warps = std::int64_t{gridDim.x} * kWarpsPerBlock;
  for (std::int64_t it = blockIdx.x * std::int64_t{kWarpsPerBlock} + threadIdx.x / kWarpLanes;
       it < items; it += warps) {
    const std::int64_t row = it / keys, j = s_end + it % keys;
    const std::int64_t l = row / s.Hq, h = (row % s.Hq) / group;
    float lin = 0.f, quad = 0.f;
    rm::expected_logit_lane(k.row(l, h, j), muf + row * s.d, cov ? sigf + row * s.d * s.d : nullptr,
                            lane, s.d, lin, quad);
    lin = warp_sum(lin);
    quad = warp_sum(quad);
    if (lane == 0) z[row * s.T + j] = rm::expected_logit(lin, quad, lin_scale, quad_div);
  }
}

// 3. One block per query head row: max and sum of exp(z - max) over the non-sink keys.
__global__ void __launch_bounds__(kBlock)
    softmax_kernel(const double* z, std::int64_t T, std::int64_t s_end, double* zmax,
                   double* zsum) {
  __shared__ double red[kBlock];
  const double* zr = z + std::int64_t{blockIdx.x} * T;
  double m = -HUGE_VAL;
  for (std::int64_t j = s_end + threadIdx.x; j < T; j += blockDim.x) m = fmax(m, zr[j]);
  red[threadIdx.x] = m;
  __syncthreads();
  for (int off = kBlock / 2; off > 0; off /= 2) {
    if (threadIdx.x < off) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + off]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  double sum = 0;
  for (std::int64_t j = s_end + threadIdx.x; j < T; j += blockDim.x) sum += exp(zr[j] - m);
  red[threadIdx.x] = sum;
  __syncthreads();
  for (int off = kBlock / 2; off > 0; off /= 2) {
    if (threadIdx.x < off) red[threadIdx.x] += red[threadIdx.x + off];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    zmax[blockIdx.x] = m;
    zsum[blockIdx.x] = red[0];
  }
}

// 4. One thread per (layer, KV head, non-sink key): the group's softmax weights in order, the
// group mean, the value norm.
template <class E>
__global__ void __launch_bounds__(kBlock)
    finish_kernel(View4<E> v, Shape s, std::int64_t s_end, bool vnorm, double eps,
                  const double* z, const double* zmax, const double* zsum, float* out,
                  std::int64_t out_stride) {
  const std::int64_t keys = s.T - s_end, items = s.L * s.H * keys, group = s.Hq / s.H;
  for (std::int64_t it = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; it < items;
       it += std::int64_t{gridDim.x} * blockDim.x) {
    const std::int64_t r = it / keys, j = s_end + it % keys, l = r / s.H, h = r % s.H;
    double acc = 0;
    if (s.n > 0)
      for (std::int64_t g = 0; g < group; ++g) {
        const std::int64_t row = l * s.Hq + h * group + g;
        acc += exp(z[row * s.T + j] - zmax[row]) / zsum[row];
      }
    const double n2 = vnorm ? rm::value_sqnorm(v.row(l, h, j), s.d) : 0.0;
    out[r * out_stride + j] = rm::expected_finish(acc, group, vnorm, eps, n2);
  }
}

// 5. One block per layer: the sinks score the layer's highest non-sink score (at least 0) + 1.
__global__ void __launch_bounds__(kBlock)
    sinks_kernel(std::int64_t H, std::int64_t T, std::int64_t s_end, float* out,
                 std::int64_t out_stride) {
  __shared__ float red[kBlock];
  const std::int64_t l = blockIdx.x, keys = T - s_end;
  float m = 0.f;
  for (std::int64_t idx = threadIdx.x; idx < H * keys; idx += blockDim.x)
    m = fmaxf(m, out[(l * H + idx / keys) * out_stride + s_end + idx % keys]);
  red[threadIdx.x] = m;
  __syncthreads();
  for (int off = kBlock / 2; off > 0; off /= 2) {
    if (threadIdx.x < off) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + off]);
    __syncthreads();
  }
  const float top = red[0] + 1.0f;
  for (std::int64_t idx = threadIdx.x; idx < H * s_end; idx += blockDim.x)
    out[(l * H + idx / s_end) * out_stride + idx % s_end] = top;
}

// ---- checks and launch ------------------------------------------------------------------------

bool strides_ok(const TensorRef& t) {
  return t.stride_layer >= 0 && t.stride_head >= 0 && t.stride_token >= 0 && t.stride_dim >= 0;
}

Status check(const TensorRef& k, const TensorRef& q, const ExpectedArgs& a, Shape& s) {
  if (!k.data || k.layers <= 0 || k.heads <= 0 || k.tokens <= 0 || k.dim <= 0)
    return detail::invalid("empty or null keys");
  if (!q.data || q.tokens <= 0) return detail::invalid("expected attention needs the queries");
  if (!strides_ok(k) || !strides_ok(q)) return detail::invalid("negative strides");
  if (q.layers != k.layers || q.heads <= 0 || q.heads % k.heads != 0 || q.dim != k.dim)
    return detail::invalid("queries do not match the keys' [layers][heads (a multiple)][.][head_dim]");
  if (q.dtype != k.dtype) return detail::invalid("queries and keys differ in element type");
  static_assert(rm::kExpectedMaxPairs == 128, "the message below says 256");
  if (k.dim % 2 != 0 || k.dim > 2 * rm::kExpectedMaxPairs)
    return detail::invalid("head_dim must be even and at most 256");
  if (k.layers * q.heads > INT_MAX) return detail::invalid("more than INT_MAX query head rows");
  if (a.nq < 1 || a.nq > q.tokens || a.skip < 0 || a.skip > a.nq || a.sinks < 0)
    return detail::invalid("ExpectedArgs: nq must be in [1, queries], skip in [0, nq], sinks >= 0");
  s = {k.layers, k.heads, q.heads, k.tokens, k.dim, a.nq - a.skip};
  return {};
}

template <class E>
Status launch(const cuda_backend& be, const TensorRef& keys, const TensorRef& values,
              const TensorRef& queries, const ExpectedArgs& a, const Shape& s,
              const MutableScoreView& out) {
  const cudaStream_t st = detail::stream_of(be.stream);
  const Ws w = carve(be.workspace, layout_of(s, a.cov));
  const std::int64_t s_end = a.sinks < s.T ? a.sinks : s.T, keys_left = s.T - s_end;
  if (s.n > 0 && keys_left > 0) {
    stats_kernel<E><<<static_cast<unsigned>(s.rows()), kBlock, 0, st>>>(
        view_of<E>(queries), s, queries.tokens - a.nq, a, w);
    KVP_CUDA_TRY(cudaGetLastError());
    logits_kernel<E><<<detail::grid_for(s.rows() * keys_left, kWarpsPerBlock, 1u << 20), kBlock,
                       0, st>>>(view_of<E>(keys), s, s_end, a.cov, w.muf, w.sigf, w.z);
    KVP_CUDA_TRY(cudaGetLastError());
    softmax_kernel<<<static_cast<unsigned>(s.rows()), kBlock, 0, st>>>(w.z, s.T, s_end, w.zmax,
                                                                      w.zsum);
    KVP_CUDA_TRY(cudaGetLastError());
  }
  if (keys_left > 0) {
    finish_kernel<E><<<detail::grid_for(s.L * s.H * keys_left, kBlock, 1u << 20), kBlock, 0, st>>>(
        view_of<E>(a.vnorm ? values : keys), s, s_end, a.vnorm, a.eps, w.z, w.zmax, w.zsum,
        out.data, out.row_stride);
    KVP_CUDA_TRY(cudaGetLastError());
  }
  if (s_end > 0) {
    sinks_kernel<<<static_cast<unsigned>(s.L), kBlock, 0, st>>>(s.H, s.T, s_end, out.data,
                                                               out.row_stride);
    KVP_CUDA_TRY(cudaGetLastError());
  }
  return {};
}

}  // namespace

// ---- entry points -----------------------------------------------------------------------------

Status expected_workspace_bytes(const TensorRef& keys, const TensorRef& queries,
                                const ExpectedArgs& args, std::size_t& bytes) {
  bytes = 0;
  Shape s;
  if (Status e = check(keys, queries, args, s); !e.ok()) return e;
  bytes = layout_of(s, args.cov).total;
  return {};
}

Status expected_score(const cuda_backend& be, const TensorRef& keys, const TensorRef& values,
                      const TensorRef& queries, const ExpectedArgs& args,
                      const MutableScoreView& out) {
  Shape s;
  if (Status e = check(keys, queries, args, s); !e.ok()) return e;
  if (args.vnorm) {
    if (!values.data || values.layers != keys.layers || values.heads != keys.heads ||
        values.tokens != keys.tokens || values.dim != keys.dim || !strides_ok(values))
      return detail::invalid("vnorm needs values of the keys' shape");
    if (values.dtype != keys.dtype) return detail::invalid("values and keys differ in element type");
  }
  if (!out.data) return detail::invalid("null output pointer");
  if (out.layers != s.L || out.heads != s.H || out.tokens != s.T || out.row_stride < s.T)
    return detail::invalid("output shape differs from the keys' [layers][heads][tokens]");
  if (be.workspace_bytes < layout_of(s, args.cov).total)
    return {StatusCode::insufficient_workspace, 0, "below expected_workspace_bytes"};
  if (!be.workspace || reinterpret_cast<std::uintptr_t>(be.workspace) % 256 != 0)
    return detail::invalid("workspace must be non-null and 256-byte aligned");
  switch (keys.dtype) {
    case DType::f32: return launch<float>(be, keys, values, queries, args, s, out);
    case DType::f16: return launch<__half>(be, keys, values, queries, args, s, out);
    case DType::bf16: return launch<__nv_bfloat16>(be, keys, values, queries, args, s, out);
  }
  return detail::invalid("unknown element type");
}

}  // namespace kvpolicy::cuda
