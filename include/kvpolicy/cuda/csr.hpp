// Device form of a Selection: CSR over the rows r = layer * heads + head. `offsets[r]` ..
// `offsets[r+1]` delimit row r's kept token indices in `indices`, ascending. The host helpers
// convert a Selection to and from CSR arrays (to upload a CPU selection, or read back a device
// one); they need no CUDA headers, so CPU tests exercise them too.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "kvpolicy/core/error.hpp"
#include "kvpolicy/core/selection.hpp"

namespace kvpolicy::cuda {

// Non-owning view over caller memory (device memory when passed to a CUDA op). Trivially
// copyable. An op that writes a selection (select) fills offsets[0..rows] and the first
// offsets[rows] entries of indices; `capacity` is how many entries `indices` can hold.
struct CsrSelection {
  std::int64_t layers = 0, heads = 0;
  std::int64_t* offsets = nullptr;  // [rows() + 1]
  std::int32_t* indices = nullptr;  // [capacity]
  std::int64_t capacity = 0;

  constexpr std::int64_t rows() const { return layers * heads; }
};

// Host-side CSR arrays (what a CsrSelection points to, before upload or after download).
struct HostCsr {
  std::int64_t layers = 0, heads = 0;
  std::vector<std::int64_t> offsets;  // rows + 1
  std::vector<std::int32_t> indices;

  std::int64_t rows() const { return layers * heads; }
};

inline HostCsr to_csr(const Selection& sel) {
  HostCsr c;
  c.layers = sel.layers();
  c.heads = sel.heads();
  c.offsets.reserve(static_cast<std::size_t>(c.rows() + 1));
  c.indices.reserve(static_cast<std::size_t>(sel.total()));
  c.offsets.push_back(0);
  for (std::int64_t l = 0; l < c.layers; ++l)
    for (std::int64_t h = 0; h < c.heads; ++h) {
      auto k = sel.kept(l, h);
      c.indices.insert(c.indices.end(), k.begin(), k.end());
      c.offsets.push_back(static_cast<std::int64_t>(c.indices.size()));
    }
  return c;
}

// Checks the CSR structure (offsets start at 0, never decrease, end inside `indices`); the
// per-row ordering is checked by Selection::validate.
inline Selection from_csr(std::int64_t layers, std::int64_t heads,
                          std::span<const std::int64_t> offsets,
                          std::span<const std::int32_t> indices) {
  const std::int64_t rows = layers * heads;
  KVP_REQUIRE(layers >= 0 && heads >= 0, "csr: negative shape [", layers, ",", heads, "]");
  KVP_REQUIRE(static_cast<std::int64_t>(offsets.size()) == rows + 1, "csr: ", offsets.size(),
              " offsets for ", rows, " rows (needs rows + 1)");
  KVP_REQUIRE(offsets[0] == 0, "csr: offsets[0] is ", offsets[0], ", not 0");
  Selection sel(layers, heads);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = offsets[static_cast<std::size_t>(r)];
    const std::int64_t e = offsets[static_cast<std::size_t>(r + 1)];
    KVP_REQUIRE(b <= e && e <= static_cast<std::int64_t>(indices.size()), "csr: row ", r,
                " spans [", b, ", ", e, ") outside the ", indices.size(), " indices");
    sel.kept(r / heads, r % heads).assign(indices.begin() + b, indices.begin() + e);
  }
  return sel;
}

inline Selection from_csr(const HostCsr& c) {
  return from_csr(c.layers, c.heads, c.offsets, c.indices);
}

}  // namespace kvpolicy::cuda
