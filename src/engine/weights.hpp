// Weight matrices kept in their GGUF storage type, and the matrix-vector products that read them
// in that form.
//
// Decoding one token reads every weight once: ~430 MB per token for SmolLM2-135M in fp32, more
// than the KV cache of an 8K context. So the engine keeps weights as GGUF stores them (Q4_1 is
// 0.625 bytes per weight, Q8_0 1.06) and computes decode products on the stored blocks:
//   - Q4_1 and Q8_0 have SIMD dot kernels (AVX-512 and AVX2+FMA+F16C, chosen at run time from
//     what the CPU supports, plus a portable scalar one). Activations stay fp32: a block's 32
//     weights are decoded into registers (w = d*q + m, or d*q) and multiplied with fp32 x, so the
//     differences from an fp32 product with the dequantized weights are the order of the additions
//     and, for Q4_1, d*q + m taken as one fused multiply-add (no activation quantization, unlike
//     llama.cpp's Q8 dot products). Tests bound them:
//     |y - y_ref| <= 1e-5 * sum_j |w_j x_j| (+1e-30), tests/engine/test_weights.cpp.
//   - F32 rows are read as they are; every other dequantizable type (F16, BF16, Q4_0, Q5_x,
//     K-quants) is kept packed and each row is dequantized into a buffer before its dot.
// Products over more than kMatvecMaxRows activation rows (prefill chunks) dequantize blocks of
// weight rows into a scratch matrix and run Eigen's GEMM on it: the fp32 weights are the exact
// values engine::dequantize() gives, so those products are bitwise what they were with fp32
// weights held in memory. Products of 1 to kMatvecMaxRows rows (decode steps, step_batch of up to
// 4 sequences, a prompt's last-position logits, chunks of 1-4 tokens) use the dot kernels.
//
// Determinism: each output element is one weight row's dot product computed by one thread in a
// fixed order, so results are the same for any thread count; they differ between kernels (the
// summation order follows the vector width), which is why the kernel can be chosen explicitly.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvpolicy::engine {

class WeightMatrix {
 public:
  WeightMatrix() = default;
  // A [rows][cols] matrix of ggml `type`, rows stored one after another, each cols / block whole
  // blocks (`bytes` is copied; its size must be rows * row bytes). Throws on a type that cannot
  // be dequantized or on sizes that do not match.
  WeightMatrix(std::uint32_t type, std::int64_t rows, std::int64_t cols,
               std::span<const std::uint8_t> bytes);
  // An fp32 matrix (row-major), e.g. for tests.
  static WeightMatrix f32(std::span<const float> values, std::int64_t rows, std::int64_t cols);

  std::uint32_t type() const { return type_; }
  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  bool empty() const { return rows_ == 0; }
  std::size_t row_bytes() const { return row_bytes_; }
  std::size_t memory_bytes() const { return data_.size(); }
  const std::uint8_t* row(std::int64_t r) const {
    return data_.data() + static_cast<std::size_t>(r) * row_bytes_;
  }

  // out[i][:] = fp32 row r0 + i, for i < n (exactly engine::dequantize()'s values).
  void dequantize_rows(std::int64_t r0, std::int64_t n, float* out) const;
  // The matrix whose row i is this one's row src[i] (a permutation of whole stored rows).
  WeightMatrix permute_rows(std::span<const std::int64_t> src) const;

 private:
  std::uint32_t type_ = 0;
  std::int64_t rows_ = 0, cols_ = 0;
  std::size_t row_bytes_ = 0;
  std::vector<std::uint8_t> data_;
};

// The dot kernels. `best` is the fastest the running CPU supports.
enum class DotKernel { best, scalar, avx2, avx512 };
DotKernel best_dot_kernel();
bool dot_kernel_supported(DotKernel k);
std::string dot_kernel_name(DotKernel k);

// Largest number of activation rows one matvec call takes (decode steps, small batches).
inline constexpr std::int64_t kMatvecMaxRows = 4;

// y[i * y_stride + r - r0] = sum_c W[r][c] * x[i * x_stride + c] for weight rows
// r in [r0, r0 + n) and activation rows i < nx (1 <= nx <= kMatvecMaxRows), reading W in its
// stored form. Throws std::invalid_argument-style kvpolicy::Error on bad ranges or an
// unsupported kernel.
void matvec(const WeightMatrix& w, const float* x, std::int64_t nx, std::int64_t x_stride,
            std::int64_t r0, std::int64_t n, float* y, std::int64_t y_stride,
            DotKernel kernel = DotKernel::best);

}  // namespace kvpolicy::engine
