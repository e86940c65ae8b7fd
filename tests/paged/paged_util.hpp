// Test helpers for paged pools: a pool of random K/V in one of three page forms, sequences with
// shuffled block tables drawn from it, a naive gather/scatter between a sequence and a dense HND
// copy (so the references do not go through the code under test), and random selections.
#pragma once
#include "common/error_of.hpp"
#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include <kvpolicy/paged.hpp>

#include "common/random_kv.hpp"

namespace pagedtest {

using kvpolicy::KVView;
using kvpolicy::PagedKVView;
using kvpolicy::PagedSequence;
using kvpolicy::Selection;

// nhd / hnd: the contiguous layouts; transposed: [layer][block][head][dim][token] (head_dim
// stride != 1, the element-by-element path).
enum class Form { nhd, hnd, transposed };
inline const char* form_name(Form f) {
  return f == Form::nhd ? "nhd" : f == Form::hnd ? "hnd" : "transposed";
}

template <class T>
struct Pool {
  std::int64_t NB = 0, L = 0, H = 0, P = 0, D = 0;
  Form form = Form::nhd;
  std::vector<T> k, v;

  Pool(kvtest::Rng& rng, Form f, std::int64_t nb, std::int64_t l, std::int64_t h,
       std::int64_t p, std::int64_t d)
      : NB(nb), L(l), H(h), P(p), D(d), form(f) {
    k = rng.normals<T>(NB * L * H * P * D);
    v = rng.normals<T>(NB * L * H * P * D);
  }
  PagedKVView<T> view(std::vector<T>& buf) {
    switch (form) {
      case Form::nhd: return PagedKVView<T>::nhd(buf.data(), NB, L, H, P, D);
      case Form::hnd: return PagedKVView<T>::hnd(buf.data(), NB, L, H, P, D);
      case Form::transposed:
        return {buf.data(), NB, L, H, P, D, NB * H * D * P, H * D * P, D * P, 1, P};
    }
    return {};
  }
  PagedKVView<T> keys() { return view(k); }
  PagedKVView<T> values() { return view(v); }
};

// A sequence owning its block table.
struct Seq {
  std::vector<std::int32_t> table;
  std::int64_t length = 0;
  PagedSequence seq() const { return {table, length}; }
};

// Sequences of the given lengths with disjoint block tables: ids drawn at random from the pool
// (shuffled, non-contiguous), so neighbouring logical pages are far apart.
inline std::vector<Seq> random_sequences(kvtest::Rng& rng, std::int64_t num_blocks,
                                         std::int64_t page_size,
                                         const std::vector<std::int64_t>& lengths) {
  std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  for (std::size_t i = ids.size(); i > 1; --i)
    std::swap(ids[i - 1], ids[static_cast<std::size_t>(rng.integer(0, static_cast<std::int64_t>(i) - 1))]);
  std::vector<Seq> out;
  std::size_t next = 0;
  for (std::int64_t n : lengths) {
    Seq s;
    s.length = n;
    for (std::int64_t p = 0; p < (n + page_size - 1) / page_size; ++p) s.table.push_back(ids.at(next++));
    out.push_back(std::move(s));
  }
  return out;
}

inline std::int64_t pages_for(const std::vector<std::int64_t>& lengths, std::int64_t P) {
  std::int64_t n = 0;
  for (std::int64_t x : lengths) n += (x + P - 1) / P;
  return n;
}

// Naive copies between a sequence of the pool and a dense HND [L][H][length][D] vector.
template <class T>
std::vector<T> gather(const PagedKVView<T>& pool, const Seq& s) {
  std::vector<T> out(static_cast<std::size_t>(pool.layers * pool.heads * s.length * pool.dim));
  std::size_t o = 0;
  for (std::int64_t l = 0; l < pool.layers; ++l)
    for (std::int64_t h = 0; h < pool.heads; ++h)
      for (std::int64_t t = 0; t < s.length; ++t)
        for (std::int64_t e = 0; e < pool.dim; ++e)
          out[o++] = pool.row(l, s.table[static_cast<std::size_t>(t / pool.page_size)], h,
                              t % pool.page_size)[e * pool.stride_dim];
  return out;
}
template <class T>
void scatter(const PagedKVView<T>& pool, const Seq& s, const std::vector<T>& dense) {
  std::size_t o = 0;
  for (std::int64_t l = 0; l < pool.layers; ++l)
    for (std::int64_t h = 0; h < pool.heads; ++h)
      for (std::int64_t t = 0; t < s.length; ++t)
        for (std::int64_t e = 0; e < pool.dim; ++e)
          pool.row(l, s.table[static_cast<std::size_t>(t / pool.page_size)], h,
                   t % pool.page_size)[e * pool.stride_dim] = dense[o++];
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Random kept lists with different counts per (layer, head): all, none, a prefix, a random
// subset, or runs of consecutive tokens.
inline Selection random_selection(kvtest::Rng& rng, std::int64_t L, std::int64_t H, std::int64_t T) {
  Selection sel(L, H);
  for (std::int64_t r = 0; r < L * H; ++r) {
    auto& k = sel.kept(r / H, r % H);
    const std::int64_t kind = rng.integer(0, 5);
    if (kind == 5) {
      for (std::int64_t t = rng.integer(0, 3); t < T; t += rng.integer(1, 4))
        for (std::int64_t run = rng.integer(1, 6); run > 0 && t < T; --run)
          k.push_back(static_cast<std::int32_t>(t++));
      continue;
    }
    const std::int64_t c = kind == 0 ? T : kind == 1 ? 0 : rng.integer(0, T);
    for (std::int64_t t = 0; t < T; ++t) k.push_back(static_cast<std::int32_t>(t));
    if (kind != 2)  // kind 2: a prefix
      for (std::int64_t i = T - 1; i > 0; --i)
        std::swap(k[static_cast<std::size_t>(i)], k[static_cast<std::size_t>(rng.integer(0, i))]);
    k.resize(static_cast<std::size_t>(c));
    std::sort(k.begin(), k.end());
  }
  return sel;
}

using kvtest::error_of;

}  // namespace pagedtest
