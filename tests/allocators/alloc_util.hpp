// Helpers for the allocator tests: contexts over hand-made score maps, random scores (with ties
// on purpose), and the invariants every allocation must satisfy.
#pragma once
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "common/random_kv.hpp"

namespace alloc_test {

using kvpolicy::AllocContext;
using kvpolicy::Protect;
using kvpolicy::ScoreMap;

inline AllocContext context(ScoreMap& s, Protect p = {}, std::int64_t first_layer = 0,
                            std::int64_t model_layers = 0) {
  AllocContext c;
  c.scores = &s;
  c.tokens = s.tokens();
  c.protect = p;
  c.first_layer = first_layer;
  c.model_layers = model_layers > 0 ? model_layers : s.layers();
  return c;
}

inline std::int64_t sum(std::span<const std::int64_t> v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

// Scores in [0, 1); levels > 0 rounds them to that many values so that ties are common.
inline ScoreMap random_scores(kvtest::Rng& rng, std::int64_t L, std::int64_t H, std::int64_t T,
                              int levels = 0) {
  ScoreMap s(L, H, T);
  for (std::int64_t i = 0; i < L * H * T; ++i) {
    double x = rng.uniform(0.0, 1.0);
    if (levels > 0) x = std::floor(x * levels) / levels;
    s.data()[i] = static_cast<float>(x);
  }
  return s;
}

// Every row within [min(protected, T), T]; the protected tokens kept; lists ascending.
inline void require_valid(const kvpolicy::Selection& sel, std::int64_t T, Protect p) {
  sel.validate(T);
  const std::int64_t sinks = std::min(p.sinks, T), recent_begin = std::max(sinks, T - p.recent);
  for (std::int64_t l = 0; l < sel.layers(); ++l)
    for (std::int64_t h = 0; h < sel.heads(); ++h) {
      auto k = sel.kept(l, h);
      REQUIRE(sel.count(l, h) >= p.total(T));
      REQUIRE(sel.count(l, h) <= T);
      std::vector<char> in(static_cast<std::size_t>(T), 0);
      for (auto j : k) in[static_cast<std::size_t>(j)] = 1;
      for (std::int64_t j = 0; j < T; ++j)
        if (j < sinks || j >= recent_begin) REQUIRE(in[static_cast<std::size_t>(j)]);
    }
}

// Layer l of a multi-layer event, as an event of its own (what a Session compresses).
template <class T>
kvpolicy::Inputs<T> layer_of(kvpolicy::Inputs<T> in, std::int64_t l) {
  in.keys.data = in.keys.row(l, 0, 0);
  in.keys.layers = 1;
  if (in.queries.data) {
    in.queries.data = in.queries.row(l, 0, 0);
    in.queries.layers = 1;
  }
  return in;
}

inline std::vector<std::int32_t> kept(const kvpolicy::Selection& s, std::int64_t l, std::int64_t h) {
  auto k = s.kept(l, h);
  return {k.begin(), k.end()};
}

// A file in the build's working directory, removed when the object dies.
struct TempFile {
  std::string path;
  TempFile(const std::string& name, const std::string& text) : path(name) {
    std::ofstream(path) << text;
  }
  ~TempFile() { std::remove(path.c_str()); }
};

}  // namespace alloc_test
