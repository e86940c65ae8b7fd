// HeadShard from Python (kvpolicy.HeadShard._args(): (rank, ranks, first_head, model_heads,
// all_gather or None)), for the host entry (policy.cpp) and the device entry (device.cpp).
#pragma once
#include <cstring>
#include <string>

#include "arrays.hpp"
#include "kvpolicy/core/head_shard.hpp"

namespace kvpy {

// A Python all-gather behind HeadShard::all_gather: fn(bytes) returns every rank's bytes
// concatenated in rank order (ranks * len bytes) as bytes. Its exception, if any, is kept for
// the error message. Called with the GIL released (it takes it).
struct PyGather {
  py::object fn;
  std::int64_t ranks = 1;
  std::string error;

  static int call(void* user, const void* send, void* recv, std::size_t bytes) {
    auto& g = *static_cast<PyGather*>(user);
    py::gil_scoped_acquire gil;
    try {
      // (The Python wrapper turns what the engine's function returns into bytes.)
      const auto r = g.fn(py::bytes(static_cast<const char*>(send), bytes)).cast<std::string>();
      const std::size_t want = bytes * static_cast<std::size_t>(g.ranks);
      if (r.size() != want) {
        g.error = kvpolicy::detail::cat("all_gather returned ", r.size(), " bytes, expected ",
                                        want, " (", g.ranks, " ranks x ", bytes, ")");
        return 1;
      }
      if (want) std::memcpy(recv, r.data(), want);
      return 0;
    } catch (const std::exception& e) {
      g.error = e.what();
      return 1;
    }
  }
};

// One call's shard: `hs` filled from the Python tuple, its all_gather bound to `gather`; returns
// &hs, or nullptr for None (the call holds every head).
inline const kvpolicy::HeadShard* shard_of(const py::object& shard, kvpolicy::HeadShard& hs,
                                           PyGather& gather) {
  if (shard.is_none()) return nullptr;
  const auto t = shard.cast<py::tuple>();
  hs.rank = t[0].cast<std::int64_t>();
  hs.ranks = t[1].cast<std::int64_t>();
  hs.first_head = t[2].cast<std::int64_t>();
  hs.model_heads = t[3].cast<std::int64_t>();
  if (!t[4].is_none()) {
    gather.fn = t[4];
    gather.ranks = hs.ranks;
    hs.all_gather = &PyGather::call;
    hs.user = &gather;
  }
  return &hs;
}

// Runs f() (a policy call that may exchange through `gather`); a failure of the Python
// all-gather is added to the library's message.
template <class F>
decltype(auto) with_gather_errors(const PyGather& gather, F&& f) {
  try {
    return f();
  } catch (const kvpolicy::Error& e) {
    if (gather.error.empty()) throw;
    throw kvpolicy::Error(kvpolicy::detail::error_text(e) + ": " + gather.error);
  }
}

}  // namespace kvpy
