#include "engine/weights.hpp"

#include <cstring>

#include "engine/ggml_types.hpp"
#include "kvpolicy/core/error.hpp"

#if defined(__x86_64__) || defined(_M_X64)
#define KVP_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace kvpolicy::engine {

WeightMatrix::WeightMatrix(std::uint32_t type, std::int64_t rows, std::int64_t cols,
                           std::span<const std::uint8_t> bytes)
    : type_(type), rows_(rows), cols_(cols) {
  const auto info = ggml_type_info(type);
  KVP_REQUIRE(info && info->dequantizable, "weights: ggml type ", ggml_type_name(type),
              " cannot be dequantized");
  KVP_REQUIRE(rows >= 0 && cols > 0 && cols % info->block == 0, "weights: a [", rows, "][", cols,
              "] ", info->name, " matrix needs rows of whole ", info->block, "-element blocks");
  row_bytes_ = static_cast<std::size_t>(cols / info->block) * info->block_bytes;
  KVP_REQUIRE(bytes.size() == row_bytes_ * static_cast<std::size_t>(rows), "weights: ",
              bytes.size(), " bytes for a [", rows, "][", cols, "] ", info->name, " matrix, which needs ",
              row_bytes_ * static_cast<std::size_t>(rows));
  data_.assign(bytes.begin(), bytes.end());
}

WeightMatrix WeightMatrix::f32(std::span<const float> values, std::int64_t rows,
                               std::int64_t cols) {
  return WeightMatrix(ggml_type::F32, rows, cols,
                      std::span<const std::uint8_t>(
                          reinterpret_cast<const std::uint8_t*>(values.data()),
                          values.size() * sizeof(float)));
}

void WeightMatrix::dequantize_rows(std::int64_t r0, std::int64_t n, float* out) const {
  KVP_REQUIRE(r0 >= 0 && n >= 0 && r0 + n <= rows_, "weights: rows [", r0, ", ", r0 + n,
              ") are outside [0, ", rows_, ")");
  dequantize(type_, std::span<const std::uint8_t>(row(r0), row_bytes_ * static_cast<std::size_t>(n)),
             std::span<float>(out, static_cast<std::size_t>(n * cols_)));
}

WeightMatrix WeightMatrix::permute_rows(std::span<const std::int64_t> src) const {
  KVP_REQUIRE(static_cast<std::int64_t>(src.size()) == rows_, "weights: a permutation of ",
              src.size(), " rows for a matrix of ", rows_);
  WeightMatrix out = *this;
  for (std::size_t i = 0; i < src.size(); ++i) {
    KVP_REQUIRE(src[i] >= 0 && src[i] < rows_, "weights: permutation entry ", src[i],
                " is outside [0, ", rows_, ")");
    std::memcpy(out.data_.data() + i * row_bytes_, row(src[i]), row_bytes_);
  }
  return out;
}

namespace {

[[maybe_unused]] std::uint16_t load16(const std::uint8_t* p) {  // used by the x86 kernels
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ---- scalar: the portable reference --------------------------------------------------------
// Decodes each block to fp32 exactly as engine::dequantize() does and accumulates in 8
// interleaved partial sums (summed pairwise at the end), an order SIMD kernels can match.

template <int NX>
void dot_block_scalar(const float* wb, const float* x, std::int64_t xs, std::int64_t c0,
                      float (&acc)[kMatvecMaxRows][8]) {
  for (int i = 0; i < NX; ++i)
    for (int j = 0; j < 32; ++j) acc[i][j % 8] += wb[j] * x[i * xs + c0 + j];
}

template <int NX>
void matvec_scalar(const WeightMatrix& w, const float* x, std::int64_t xs, std::int64_t r0,
                   std::int64_t n, float* y, std::int64_t ys) {
  const std::int64_t cols = w.cols();
  std::vector<float> buf(static_cast<std::size_t>(cols));
  for (std::int64_t r = r0; r < r0 + n; ++r) {
    w.dequantize_rows(r, 1, buf.data());
    float acc[kMatvecMaxRows][8] = {};
    std::int64_t c = 0;
    for (; c + 32 <= cols; c += 32) dot_block_scalar<NX>(buf.data() + c, x, xs, c, acc);
    for (int i = 0; i < NX; ++i) {
      float tail = 0.f;
      for (std::int64_t t = c; t < cols; ++t) tail += buf[static_cast<std::size_t>(t)] * x[i * xs + t];
      const float s = ((acc[i][0] + acc[i][4]) + (acc[i][2] + acc[i][6])) +
                      ((acc[i][1] + acc[i][5]) + (acc[i][3] + acc[i][7]));
      y[i * ys + (r - r0)] = s + tail;
    }
  }
}

#if defined(KVP_X86)
// ---- AVX2 + FMA + F16C ---------------------------------------------------------------------
// A block of 32 weights as four vectors of 8 fp32 values.
#define KVP_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

KVP_TARGET_AVX2 inline float half_f16c(const std::uint8_t* p) {
  return _cvtsh_ss(load16(p));
}

KVP_TARGET_AVX2 inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; weight j = d * q_j + m with q_j the
// low nibble of byte j (j < 16) or the high nibble of byte j - 16.
KVP_TARGET_AVX2 inline void q4_1_block256(const std::uint8_t* blk, __m256 (&wv)[4]) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256 vd = _mm256_set1_ps(half_f16c(blk)), vm = _mm256_set1_ps(half_f16c(blk + 2));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i lo = _mm_and_si128(raw, m4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
  const __m128i q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int k = 0; k < 4; ++k)
    wv[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q[k])), vd, vm);
}

// Q8_0 block (34 bytes): fp16 d, 32 int8 q; weight j = d * q_j.
KVP_TARGET_AVX2 inline void q8_0_block256(const std::uint8_t* blk, __m256 (&wv)[4]) {
  const __m256 vd = _mm256_set1_ps(half_f16c(blk));
  for (int k = 0; k < 4; ++k)
    wv[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * k)))),
                          vd);
}

// Blocks of `Bytes` bytes decoded by `decode` into four vectors of 8, one accumulator per vector
// and activation row.
template <int NX, int Bytes, void (*decode)(const std::uint8_t*, __m256 (&)[4])>
KVP_TARGET_AVX2 void matvec_blocks_avx2(const WeightMatrix& w, const float* x, std::int64_t xs,
                                        std::int64_t r0, std::int64_t n, float* y,
                                        std::int64_t ys) {
  const std::int64_t blocks = w.cols() / 32;
  for (std::int64_t r = r0; r < r0 + n; ++r) {
    const std::uint8_t* blk = w.row(r);
    __m256 acc[NX][4];
    for (int i = 0; i < NX; ++i)
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm256_setzero_ps();
    for (std::int64_t b = 0; b < blocks; ++b, blk += Bytes) {
      __m256 wv[4];
      decode(blk, wv);
      for (int i = 0; i < NX; ++i) {
        const float* xb = x + i * xs + b * 32;
        for (int k = 0; k < 4; ++k)
          acc[i][k] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + 8 * k), acc[i][k]);
      }
    }
    for (int i = 0; i < NX; ++i)
      y[i * ys + (r - r0)] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                                   _mm256_add_ps(acc[i][2], acc[i][3])));
  }
}

template <int NX>
KVP_TARGET_AVX2 void matvec_f32_avx2(const WeightMatrix& w, const float* x, std::int64_t xs,
                                     std::int64_t r0, std::int64_t n, float* y, std::int64_t ys) {
  const std::int64_t cols = w.cols();
  for (std::int64_t r = r0; r < r0 + n; ++r) {
    const auto* wr = reinterpret_cast<const float*>(w.row(r));
    __m256 acc[NX][4];
    for (int i = 0; i < NX; ++i)
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm256_setzero_ps();
    std::int64_t c = 0;
    for (; c + 32 <= cols; c += 32)
      for (int k = 0; k < 4; ++k) {
        const __m256 wv = _mm256_loadu_ps(wr + c + 8 * k);
        for (int i = 0; i < NX; ++i)
          acc[i][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * xs + c + 8 * k), acc[i][k]);
      }
    for (int i = 0; i < NX; ++i) {
      float tail = 0.f;
      for (std::int64_t t = c; t < cols; ++t) tail += wr[t] * x[i * xs + t];
      y[i * ys + (r - r0)] = hsum256(_mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]),
                                                   _mm256_add_ps(acc[i][2], acc[i][3]))) +
                             tail;
    }
  }
}

// ---- AVX-512 (F, BW for the byte shifts) ---------------------------------------------------
// A block as two vectors of 16.
constexpr int kPrefetchBytes = 2048;
#define KVP_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
// GCC 12 warns that the AVX-512 conversion intrinsics' internal "undefined" pass-through operand
// (__Y in avx512fintrin.h) may be used uninitialized: a false positive inside the header, as the
// operand is fully masked. Silenced for these functions only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

KVP_TARGET_AVX512 inline void q4_1_block512(const std::uint8_t* blk, __m512& w0, __m512& w1) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m512 vd = _mm512_set1_ps(half_f16c(blk)), vm = _mm512_set1_ps(half_f16c(blk + 2));
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i lo = _mm_and_si128(raw, m4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
  w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), vd, vm);
  w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), vd, vm);
}

KVP_TARGET_AVX512 inline void q8_0_block512(const std::uint8_t* blk, __m512& w0, __m512& w1) {
  const __m512 vd = _mm512_set1_ps(half_f16c(blk));
  w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))),
                     vd);
  w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))),
                     vd);
}

// Blocks of `Bytes` bytes decoded by `decode`; blocks alternate between two pairs of
// accumulators, so four FMA chains are in flight per activation row.
template <int NX, int Bytes, void (*decode)(const std::uint8_t*, __m512&, __m512&)>
KVP_TARGET_AVX512 void matvec_blocks_avx512(const WeightMatrix& w, const float* x,
                                            std::int64_t xs, std::int64_t r0, std::int64_t n,
                                            float* y, std::int64_t ys) {
  const std::int64_t blocks = w.cols() / 32;
  for (std::int64_t r = r0; r < r0 + n; ++r) {
    const std::uint8_t* blk = w.row(r);
    __m512 acc[NX][4];
    for (int i = 0; i < NX; ++i)
      for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_setzero_ps();
    std::int64_t b = 0;
    for (; b + 2 <= blocks; b += 2, blk += 2 * Bytes) {
      // The weights stream through once; fetching them ahead of use hides the memory latency
      // that otherwise stalls every block's first load (measured: 19 ns per 20-byte block
      // without it on the development machine).
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetchBytes, _MM_HINT_T0);
      __m512 w0, w1, w2, w3;
      decode(blk, w0, w1);
      decode(blk + Bytes, w2, w3);
      for (int i = 0; i < NX; ++i) {
        const float* xb = x + i * xs + b * 32;
        acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[i][1]);
        acc[i][2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xb + 32), acc[i][2]);
        acc[i][3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xb + 48), acc[i][3]);
      }
    }
    if (b < blocks) {
      __m512 w0, w1;
      decode(blk, w0, w1);
      for (int i = 0; i < NX; ++i) {
        const float* xb = x + i * xs + b * 32;
        acc[i][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc[i][1]);
      }
    }
    for (int i = 0; i < NX; ++i)
      y[i * ys + (r - r0)] = _mm512_reduce_add_ps(_mm512_add_ps(
          _mm512_add_ps(acc[i][0], acc[i][2]), _mm512_add_ps(acc[i][1], acc[i][3])));
  }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // KVP_X86

using MatvecFn = void (*)(const WeightMatrix&, const float*, std::int64_t, std::int64_t,
                          std::int64_t, float*, std::int64_t);

template <int NX>
MatvecFn pick(DotKernel k, std::uint32_t type) {
#if defined(KVP_X86)
  if (k == DotKernel::avx512) {
    if (type == ggml_type::Q4_1) return &matvec_blocks_avx512<NX, 20, &q4_1_block512>;
    if (type == ggml_type::Q8_0) return &matvec_blocks_avx512<NX, 34, &q8_0_block512>;
    if (type == ggml_type::F32) return &matvec_f32_avx2<NX>;
  }
  if (k == DotKernel::avx2) {
    if (type == ggml_type::Q4_1) return &matvec_blocks_avx2<NX, 20, &q4_1_block256>;
    if (type == ggml_type::Q8_0) return &matvec_blocks_avx2<NX, 34, &q8_0_block256>;
    if (type == ggml_type::F32) return &matvec_f32_avx2<NX>;
  }
#else
  (void)type;
  (void)k;
#endif
  return &matvec_scalar<NX>;  // any type, and every type without a SIMD kernel
}

}  // namespace

#if defined(KVP_X86)
namespace {
// CPUID leaf 1, ECX bit 29 (clang's __builtin_cpu_supports does not know "f16c").
bool has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}
}  // namespace
#endif

bool dot_kernel_supported(DotKernel k) {
  switch (k) {
    case DotKernel::best:
    case DotKernel::scalar:
      return true;
#if defined(KVP_X86)
    case DotKernel::avx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && has_f16c();
    case DotKernel::avx512:
      return dot_kernel_supported(DotKernel::avx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw");
#else
    default:
      return false;
#endif
  }
  return false;
}

DotKernel best_dot_kernel() {
  static const DotKernel best = dot_kernel_supported(DotKernel::avx512) ? DotKernel::avx512
                                : dot_kernel_supported(DotKernel::avx2) ? DotKernel::avx2
                                                                        : DotKernel::scalar;
  return best;
}

std::string dot_kernel_name(DotKernel k) {
  switch (k) {
    case DotKernel::best:
      return "best (" + dot_kernel_name(best_dot_kernel()) + ")";
    case DotKernel::scalar:
      return "scalar";
    case DotKernel::avx2:
      return "avx2";
    case DotKernel::avx512:
      return "avx512";
  }
  return "?";
}

void matvec(const WeightMatrix& w, const float* x, std::int64_t nx, std::int64_t x_stride,
            std::int64_t r0, std::int64_t n, float* y, std::int64_t y_stride, DotKernel kernel) {
  KVP_REQUIRE(nx >= 1 && nx <= kMatvecMaxRows, "matvec: ", nx, " activation rows (1 to ",
              kMatvecMaxRows, ")");
  KVP_REQUIRE(r0 >= 0 && n >= 0 && r0 + n <= w.rows(), "matvec: weight rows [", r0, ", ", r0 + n,
              ") are outside [0, ", w.rows(), ")");
  KVP_REQUIRE(x != nullptr && y != nullptr, "matvec: null x or y");
  KVP_REQUIRE(x_stride >= w.cols() || nx == 1, "matvec: activation stride ", x_stride,
              " is shorter than a row of ", w.cols());
  KVP_REQUIRE(y_stride >= n || nx == 1, "matvec: output stride ", y_stride, " is shorter than ",
              n, " outputs");
  KVP_REQUIRE(dot_kernel_supported(kernel), "matvec: this CPU does not support the ",
              dot_kernel_name(kernel), " kernel");
  if (kernel == DotKernel::best) kernel = best_dot_kernel();
  MatvecFn fn = nx == 1   ? pick<1>(kernel, w.type())
                : nx == 2 ? pick<2>(kernel, w.type())
                : nx == 3 ? pick<3>(kernel, w.type())
                          : pick<4>(kernel, w.type());
  fn(w, x, x_stride, r0, n, y, y_stride);
}

}  // namespace kvpolicy::engine
