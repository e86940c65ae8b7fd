// kvpolicy._core: the compiled half of the Python package. The public API, its docstrings and
// type hints are in python/kvpolicy/*.py, which wrap these classes. kvpolicy::Error derives from
// std::invalid_argument, which pybind11 raises as ValueError with the library's message.
#include "arrays.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "kvpolicy C++ core (use the kvpolicy package, not this module)";
  kvpy::bind_policy(m);
  kvpy::bind_session(m);
  kvpy::bind_quant(m);
  kvpy::bind_engine(m);
}
