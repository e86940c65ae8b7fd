// Per-thread arithmetic of the device Session's bookkeeping kernels (cuda/session.cu): where an
// appended element lands in the per-layer storage, and where each slot of the query window
// comes from when new queries are pushed. __host__ __device__ and free of CUDA headers, so the
// CPU tests check the same functions the kernels run (tests/session/test_cuda_session.cpp).
//
// Storage of one layer, per KV head h: rows [h * capacity, h * capacity + lengths[h]) hold the
// cached tokens in order (HND, as kvpolicy::Session). The query window of one layer is
// [q_heads][window][dim], right-aligned: its newest `held` queries sit in the last `held` slots,
// oldest first, so the newest n of them are one strided view (slot window - n onwards).
#pragma once
#include <cstdint>

#include "kvpolicy/core/config.hpp"

namespace kvpolicy::cuda::session_math {

// Flat index of the n appended tokens' element `e` (e in [0, heads * n * dim), ordered
// [head][token][dim]) in a [heads][capacity][dim] storage whose head h holds `length` rows.
struct AppendSlot {
  std::int64_t head = 0, token = 0, dim = 0;  // the element's source coordinates
  std::int64_t row = 0;                       // destination row: head * capacity + length + token
};
KVP_HD inline AppendSlot append_slot(std::int64_t e, std::int64_t n, std::int64_t dim,
                                     std::int64_t capacity, std::int64_t length) {
  AppendSlot s;
  s.dim = e % dim;
  s.token = (e / dim) % n;
  s.head = e / (dim * n);
  s.row = s.head * capacity + length + s.token;
  return s;
}

// After pushing n new queries into a window of `window` slots: slot i (in [0, window)) takes
// the new query `fresh_index` when fresh, else the old slot `old_slot`. Only the newest
// min(n, window) new queries are kept (the last ones of the n).
struct WindowSource {
  bool fresh = false;
  std::int64_t fresh_index = 0;  // in [0, n)
  std::int64_t old_slot = 0;     // in [0, window)
};
KVP_HD inline WindowSource window_source(std::int64_t slot, std::int64_t window, std::int64_t n) {
  const std::int64_t taken = n < window ? n : window;
  WindowSource s;
  if (slot >= window - taken) {
    s.fresh = true;
    s.fresh_index = n - taken + (slot - (window - taken));
  } else {
    s.old_slot = slot + taken;
  }
  return s;
}

// Queries a window holds after pushing n into one that held `held`.
KVP_HD inline std::int64_t window_held(std::int64_t held, std::int64_t window, std::int64_t n) {
  const std::int64_t h = held + n;
  return h < window ? h : window;
}

// Attention of a block of n new queries (the newest n of a head's `length` tokens) in chunks of m:
// chunk c (queries [c * m, min(n, (c + 1) * m))) sees the cache as if it ended at its last query,
// so its causal tail is its own queries. The head's length for that launch:
KVP_HD inline std::int64_t chunk_horizon(std::int64_t length, std::int64_t n, std::int64_t m,
                                         std::int64_t c) {
  const std::int64_t end = (c + 1) * m < n ? (c + 1) * m : n;
  return length - (n - end);
}

}  // namespace kvpolicy::cuda::session_math
