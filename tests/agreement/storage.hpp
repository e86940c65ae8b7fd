// Cache layouts the agreement tests run every op on: Layout::HND and NHD, plus a transposed
// layout [L][H][d][T] (head_dim stride != 1, so no vector path applies).
#pragma once
#include <cstdint>

#include <kvpolicy/core/kv_view.hpp>

namespace kvtest {

enum class Storage { hnd, nhd, hdn };

inline const char* storage_name(Storage s) {
  return s == Storage::hnd ? "HND" : s == Storage::nhd ? "NHD" : "HDN";
}

template <class T>
kvpolicy::KVView<T> make_view(Storage s, T* p, std::int64_t L, std::int64_t H, std::int64_t N,
                              std::int64_t D) {
  if (s == Storage::hnd) return kvpolicy::KVView<T>::hnd(p, L, H, N, D);
  if (s == Storage::nhd) return kvpolicy::KVView<T>::nhd(p, L, H, N, D);
  return {p, L, H, N, D, H * D * N, D * N, 1, N};
}

}  // namespace kvtest
