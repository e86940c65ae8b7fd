// .npy reading and writing with xtensor's npy support. This is the one unit of the tool that
// includes <xtensor/xnpy.hpp>: its header parser uses std::regex, in which GCC 12 reports a false
// -Wmaybe-uninitialized (GCC bug 105562), turned off for this file only (CMakeLists.txt).
//
// xt::load_npy<T> needs the element type up front and has no half type, so the file is read
// with the steps of xt::detail::load_npy_file (what load_npy itself calls: magic, header, data),
// and the header's typestring ("<f4", "<f2", ...) decides how the data is viewed: float32 as
// float, float16 as its raw 16-bit patterns (cast without xtensor's type check). Writing goes
// through xt::detail::write_header for the same reason (a "<f2" header for float16 data).
#include "npy.hpp"

#include <xtensor/xnpy.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <system_error>

#include "failure.hpp"

namespace kvpolicy_cli {
namespace {

std::string shape_text(const std::vector<std::size_t>& shape) {
  std::ostringstream os;
  os << '(';
  for (std::size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << (shape.size() == 1 ? ",)" : ")");
  return os.str();
}

// The typestrings this machine writes for float32, float16 and int64 ("<f4", "<f2", "<i8" on a
// little-endian machine).
std::string f32_descr() { return xt::detail::build_typestring<float>(); }
std::string f16_descr() {
  return std::string(1, xt::detail::build_typestring<std::uint16_t>()[0]) + "f2";
}
std::string i64_descr() { return xt::detail::build_typestring<std::int64_t>(); }

// numpy's name of a typestring xtensor accepted (byte order, kind i/u/f/c/b, item size in
// bytes): "<i4" -> "int32", ">f4" -> "float32 (big-endian)".
std::string dtype_name(const std::string& ts) {
  if (ts.size() < 3) return "'" + ts + "'";
  const int bits = 8 * std::atoi(ts.c_str() + 2);
  std::string name;
  switch (ts[1]) {
    case 'f': name = "float" + std::to_string(bits); break;
    case 'i': name = "int" + std::to_string(bits); break;
    case 'u': name = "uint" + std::to_string(bits); break;
    case 'c': name = "complex" + std::to_string(bits); break;
    case 'b': name = "bool"; break;
    default: return "'" + ts + "'";
  }
  const char native = f32_descr()[0];
  if (ts[0] != '|' && ts[0] != native)
    name += ts[0] == '>' ? " (big-endian)" : " (little-endian)";
  return name + " ('" + ts + "')";
}

template <class T>
std::vector<T> c_order(xt::detail::npy_file& file, std::size_t n) {
  std::vector<T> out(n);
  if (!file.m_fortran_order || file.m_shape.size() < 2) {
    if (n) std::memcpy(out.data(), file.ptr(), n * sizeof(T));
  } else {
    // A view with the file's (column-major) strides; xtensor iterates it in row-major order.
    const auto view = file.cast<T>(false);
    std::copy(view.begin(), view.end(), out.begin());
  }
  return out;
}

}  // namespace

NpyArray read_npy(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (!fs::exists(st)) throw Failure(path, "no such file");
  if (fs::is_directory(st)) throw Failure(path, "is a directory, not a .npy file");
  const std::uintmax_t file_size = fs::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (!in || ec) throw Failure(path, std::string("cannot open: ") + std::strerror(errno));

  // xt::detail::load_npy_file in steps, so that the dtype and the data size are checked before
  // the data buffer is allocated (a corrupt header cannot ask for terabytes) and the data read
  // is checked (load_npy_file does not).
  std::string typestr;
  bool fortran = false;
  std::vector<std::size_t> shape;
  try {
    unsigned char major = 0, minor = 0;
    xt::detail::read_magic(in, &major, &minor);
    std::string header;
    if (major == 1 && minor == 0)
      header = xt::detail::read_header_1_0(in);
    else if (major == 2 && minor == 0)
      header = xt::detail::read_header_2_0(in);
    else
      throw std::runtime_error("format version " + std::to_string(major) + "." +
                               std::to_string(minor) + " is not supported (1.0, 2.0)");
    if (!in) throw std::runtime_error("the file ends inside the header");
    if (header.empty()) throw std::runtime_error("empty header");  // xtensor reads its last char
    xt::detail::parse_header(header, typestr, &fortran, shape);
  } catch (const std::exception& e) {
    throw Failure(path, std::string("not a valid .npy file (") + e.what() + ")");
  }

  const bool is_f32 = typestr == f32_descr(), is_f16 = typestr == f16_descr();
  if (!is_f32 && !is_f16)
    throw Failure(path, "dtype " + dtype_name(typestr) +
                            " is not supported (accepted: float32, float16; convert with "
                            "numpy's astype)");
  const std::size_t item = is_f32 ? 4 : 2;
  std::size_t n = 1;  // elements, checked for overflow
  bool overflow = false;
  for (const std::size_t d : shape) {
    if (d != 0 && n > std::numeric_limits<std::size_t>::max() / item / d) overflow = true;
    n *= d;
  }
  const std::streamoff at = in.tellg();
  const std::uintmax_t left =
      at >= 0 && std::uintmax_t(at) <= file_size ? file_size - std::uintmax_t(at) : 0;
  if (overflow || n * item > left) {
    std::ostringstream os;
    os << "truncated: shape " << shape_text(shape) << " of " << (is_f32 ? "float32" : "float16");
    if (overflow)
      os << " is more data than any file holds";
    else
      os << " needs " << n * item << " bytes of data, the file holds " << left;
    throw Failure(path, os.str());
  }

  xt::detail::npy_file file(shape, fortran, typestr);  // allocates n * item bytes
  in.read(file.ptr(), static_cast<std::streamsize>(file.n_bytes()));
  if (!in || file.n_bytes() != n * item)
    throw Failure(path, "cannot read the data: " + std::string(std::strerror(errno ? errno : EIO)));

  NpyArray a;
  a.type = is_f32 ? NpyType::f32 : NpyType::f16;
  for (const std::size_t d : shape) a.shape.push_back(static_cast<std::int64_t>(d));
  if (is_f32)
    a.f32 = c_order<float>(file, n);
  else
    a.f16 = c_order<std::uint16_t>(file, n);
  return a;
}

void write_npy(const std::string& path, const std::string& type,
               const std::vector<std::int64_t>& shape, const void* data, std::size_t bytes) {
  const std::string descr = type == "float32"   ? f32_descr()
                            : type == "float16" ? f16_descr()
                            : type == "int64"   ? i64_descr()
                                                : "";
  if (descr.empty()) throw std::logic_error("write_npy: unknown type " + type);
  std::vector<std::size_t> s;
  for (const std::int64_t d : shape) s.push_back(static_cast<std::size_t>(d));
  errno = 0;
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  if (!os) throw std::runtime_error(std::strerror(errno ? errno : EIO));
  xt::detail::write_header(os, descr, false, s);
  if (bytes) os.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  os.close();
  if (!os) throw std::runtime_error(std::strerror(errno ? errno : EIO));
}

}  // namespace kvpolicy_cli
