// .npy files for `kvpolicy compress`, read and written with xtensor (npy.cpp, the one unit that
// includes <xtensor/xnpy.hpp>). xtensor has no half type: a float16 file is read as its raw
// 16-bit patterns (the header's dtype decides) and written back with a float16 header.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kvpolicy_cli {

enum class NpyType { f32, f16 };

struct NpyArray {
  NpyType type = NpyType::f32;
  std::vector<std::int64_t> shape;
  std::vector<float> f32;          // type f32: the elements in C (row-major) order
  std::vector<std::uint16_t> f16;  // type f16: IEEE half bit patterns in C order
};

// Reads a float32 or float16 .npy file (C or Fortran order; either way the result is in C
// order). Throws Failure{path, problem}: missing or unreadable file, not a .npy file, another
// dtype (named as numpy names it), data shorter than the header's shape.
NpyArray read_npy(const std::string& path);

// Writes a C-order .npy file of `shape` from `bytes` bytes at `data`; `type` is "float32",
// "float16" or "int64". Throws std::runtime_error (with the system's reason) on any I/O error.
void write_npy(const std::string& path, const std::string& type,
               const std::vector<std::int64_t>& shape, const void* data, std::size_t bytes);

}  // namespace kvpolicy_cli
