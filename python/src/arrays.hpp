// numpy arrays <-> kvpolicy views for the bindings. The Python layer (kvpolicy/_arrays.py) has
// already turned DLPack tensors into numpy arrays (zero-copy) and lifted 3-d caches to 4-d; here
// every array is checked and mapped onto a KVView without copying: numpy's byte strides become
// element strides. What cannot be mapped raises TypeError (not an array, wrong dtype) or
// ValueError (rank, shape, strides, read-only), the message starting with the argument's name.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "kvpolicy/core/budget.hpp"
#include "kvpolicy/core/kv_view.hpp"
#include "kvpolicy/policy.hpp"
#include "kvpolicy/core/selection.hpp"

namespace kvpy {

namespace py = pybind11;

// Python's TypeError / ValueError with a message built like KVP_REQUIRE's.
template <class... Args>
[[noreturn]] void type_error(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw py::type_error(os.str());
}
template <class... Args>
[[noreturn]] void value_error(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw py::value_error(os.str());
}

inline std::string type_name(const py::handle& h) {
  return py::str(py::type::handle_of(h).attr("__name__"));
}

// `obj` as a numpy array (no conversion), or TypeError naming `what`.
inline py::array as_array(const py::handle& obj, const char* what) {
  if (!py::isinstance<py::array>(obj))
    type_error(what, ": expected a numpy array (or a DLPack tensor), got ", type_name(obj));
  return py::reinterpret_borrow<py::array>(obj);
}

inline std::string dtype_str(const py::array& a) { return py::str(a.dtype()); }

// The cache element type of `a`: float32 or float16 (allow_f16 = false: float32 only).
inline kvpolicy::DType cache_dtype(const py::array& a, const char* what, bool allow_f16 = true) {
  if (a.dtype().is(py::dtype::of<float>())) return kvpolicy::DType::f32;
  if (allow_f16 && a.dtype().is(py::dtype("float16"))) return kvpolicy::DType::f16;
  type_error(what, ": dtype ", dtype_str(a), " is not supported (expected ",
             allow_f16 ? "float32 or float16" : "float32", ")");
}

inline void require_rank(const py::array& a, py::ssize_t rank, const char* what,
                         const char* layout) {
  if (a.ndim() != rank)
    value_error(what, ": expected a ", rank, "-d array ", layout, ", got ", a.ndim(), " dimensions");
}

// Element strides of `a` (byte strides divided by the item size).
inline std::vector<std::int64_t> element_strides(const py::array& a, const char* what) {
  std::vector<std::int64_t> s(static_cast<std::size_t>(a.ndim()));
  const auto item = static_cast<std::int64_t>(a.itemsize());
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    const auto b = static_cast<std::int64_t>(a.strides(i));
    if (a.shape(i) > 1 && b < 0)
      value_error(what, ": negative stride on axis ", i,
                  " (a reversed view) is not supported; pass a copy (numpy.ascontiguousarray)");
    if (b % item != 0)
      value_error(what, ": stride ", b, " bytes on axis ", i, " is not a multiple of the item size ",
                  item, " (unaligned view); pass a copy");
    s[static_cast<std::size_t>(i)] = a.shape(i) > 1 ? b / item : 0;
  }
  return s;
}

// A [L][H][T][d] view of a 4-d array (T is the element type the caller dispatched on).
template <class T>
kvpolicy::KVView<T> kv_view(const py::array& a, const char* what, bool writable) {
  require_rank(a, 4, what, "[layers][heads][tokens][head_dim]");
  if (writable && !a.writeable())
    value_error(what, ": array is read-only; compacting in place writes to it (pass inplace=False "
                "to work on a copy)");
  const auto s = element_strides(a, what);
  void* p = const_cast<void*>(a.data());  // writability was checked above
  return {static_cast<T*>(p), a.shape(0), a.shape(1), a.shape(2), a.shape(3), s[0], s[1], s[2],
          s[3]};
}

// A [1][H][n][d] view of a 3-d array [H][n][d] (one layer, as Session and packed attention take).
template <class T>
kvpolicy::KVView<const T> layer_view(const py::array& a, const char* what) {
  require_rank(a, 3, what, "[heads][tokens][head_dim]");
  const auto s = element_strides(a, what);
  return {static_cast<const T*>(a.data()), 1, a.shape(0), a.shape(1), a.shape(2),
          0, s[0], s[1], s[2]};
}

// A C-contiguous float32 array of `shape` (owned by numpy).
inline py::array_t<float> new_f32(std::vector<py::ssize_t> shape) {
  return py::array_t<float>(std::move(shape));
}

// Kept indices as a padded int32 array [L][H][max count] (-1 past each row's count) and the
// counts [L][H] (int64).
inline py::tuple selection_arrays(const kvpolicy::Selection& sel) {
  const std::int64_t L = sel.layers(), H = sel.heads();
  std::int64_t width = 0;
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) width = std::max(width, sel.count(l, h));
  py::array_t<std::int32_t> kept({L, H, width});
  py::array_t<std::int64_t> counts({L, H});
  auto k = kept.mutable_unchecked<3>();
  auto c = counts.mutable_unchecked<2>();
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      const auto row = sel.kept(l, h);
      c(l, h) = static_cast<std::int64_t>(row.size());
      for (std::int64_t j = 0; j < width; ++j)
        k(l, h, j) = j < static_cast<std::int64_t>(row.size()) ? row[static_cast<std::size_t>(j)] : -1;
    }
  return py::make_tuple(kept, counts);
}

// The budget the Python wrapper resolved: kind 'r' ratio, 't' tokens per head, 'T' in total.
inline kvpolicy::Budget make_budget(char kind, double value) {
  switch (kind) {
    case 'r': return kvpolicy::Budget::ratio(value);
    case 't': return kvpolicy::Budget::tokens(static_cast<std::int64_t>(value));
    case 'T': return kvpolicy::Budget::total(static_cast<std::int64_t>(value));
    default: value_error("budget kind must be 'r', 't' or 'T'");
  }
}

// Registration functions of the translation units.
void bind_policy(py::module_& m);
void bind_policy_device(py::class_<kvpolicy::Policy>& cls);  // device.cpp: Policy._run_device
bool cuda_built();  // device.cpp: whether this module runs CUDA tensors where they are
void bind_session(py::module_& m);
void bind_quant(py::module_& m);
void bind_engine(py::module_& m);

}  // namespace kvpy
