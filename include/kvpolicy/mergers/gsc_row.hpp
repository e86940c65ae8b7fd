// One (layer, KV head) row of the semantic merger (mergers/semantic.hpp) written as the work of
// one thread block, for the CUDA kernel (cuda/merge.cu) and its host emulation (the agreement
// test) alike. Free of CUDA and Eigen headers; everything here is KVP_HD.
//
// The rule is SemanticMerger's, step for step, so that the results are bit-identical: the same
// chunk boundaries, candidates ordered by topk_key, the greedy seed loop that stops when no kept
// candidate is left, cosines in fp64 with the same summation order (each dot product and norm is
// summed by ONE thread over head_dim in index order; the parallelism is across candidates, not
// across dimensions, because a tree reduction would change the rounding and so, near tau, the
// decisions), the importance -> count-weighted mean fallback, means summed in fp64 in candidate
// order (one thread per dimension) and rounded once to float and then to the cache type, as
// merge_detail::store_row does, and log_count = float(log(sum of counts)).
//
// Transcendentals are the one place the two sides can differ: count_of (nearbyint(exp)) gives
// the same integer on both, but log_count = float(log(count)) goes through the device's double
// log (max 1 ulp error) and glibc's, so its float can differ when log(count) lies within an ulp
// of a float rounding boundary (about one core in 2^29; not seen in the tests).
//
// Products are added with add_product(): on the device __dmul_rn / __dadd_rn, so nvcc cannot
// contract them into an FMA (which rounds once and would differ from the host), on the host
// through unfused(), so GCC cannot either (it does by default in C++ on FMA targets).
//
// The driver merge_row() is written once for a `Block` policy:
//   blk.par(f)    f(t, B) for every thread t of the block (device: this thread only)
//   blk.single(f) f() by thread 0
//   blk.sync()    barrier (device: __syncthreads; host emulation: nothing)
//   blk.atomic_add(int* p, int v)
// Code outside par/single is "uniform": every device thread runs it on the same shared or
// global values (read only after a barrier), the host emulation runs it once.
#pragma once
#include <cmath>
#include <cstdint>

#include "kvpolicy/core/config.hpp"
#include "kvpolicy/core/topk_key.hpp"

namespace kvpolicy::gsc {

inline constexpr double cos_slack = 1e-9;  // Semantic::cos_slack

enum : std::uint8_t { role_evicted = 0, role_kept = 1, role_protected = 2 };

// A host product the compiler cannot fuse with a later addition. GCC contracts `a + x * y` into
// an FMA in C++ whenever the target has one (-ffp-contract=fast is its C++ default, ISO mode or
// not: -march=native on x86, always on AArch64); an empty asm makes the value opaque at the cost
// of nothing but the fusion. (Device code uses __dmul_rn / __dadd_rn instead.)
inline double unfused(double p) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
  __asm__("" : "+x"(p));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(p));
#elif defined(__GNUC__)
  __asm__("" : "+m"(p));
#endif
  return p;
}

// acc + x * y with two roundings (never an FMA).
KVP_HD inline double add_product(double acc, double x, double y) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(acc, __dmul_rn(x, y));
#else
  return acc + unfused(x * y);
#endif
}

KVP_HD inline bool finite(double x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// merge_detail::count_of: the integer count a token stands for.
KVP_HD inline double count_of(float log_count) {
#if defined(__CUDA_ARCH__)
  return nearbyint(exp(static_cast<double>(log_count)));
#else
  return std::nearbyint(std::exp(static_cast<double>(log_count)));
#endif
}

KVP_HD inline float log_count_of(double count) {
#if defined(__CUDA_ARCH__)
  return static_cast<float>(log(count));
#else
  return static_cast<float>(std::log(count));
#endif
}

// The GSC decision: cos(seed, m) >= tau - slack, from the dot product and squared norms. A zero
// key has cosine 1 with another zero key and 0 with any other key.
KVP_HD inline bool similar(double dot, double n_seed, double n_m, float tau) {
  double c;
  if (n_seed == 0.0 || n_m == 0.0) {
    c = (n_seed == 0.0 && n_m == 0.0) ? 1.0 : 0.0;
  } else {
#if defined(__CUDA_ARCH__)
    c = dot / sqrt(n_seed * n_m);
#else
    c = dot / std::sqrt(n_seed * n_m);
#endif
  }
  return c >= static_cast<double>(tau) - cos_slack;
}

// True if token j ends the chunk that began at `start` (a delimiter, `chunk` tokens, the end).
KVP_HD inline bool ends_chunk(const std::uint8_t* delim, std::int64_t chunk, std::int64_t start,
                              std::int64_t j, std::int64_t tokens) {
  return (delim && delim[j] != 0) || (chunk > 0 && j - start + 1 == chunk) || j == tokens - 1;
}

// Last token of the chunk beginning at `start` (< tokens).
KVP_HD inline std::int64_t chunk_last(const std::uint8_t* delim, std::int64_t chunk,
                                      std::int64_t start, std::int64_t tokens) {
  std::int64_t j = start;
  while (!ends_chunk(delim, chunk, start, j, tokens)) ++j;
  return j;
}

// chunk_end over tokens [b, e] (inclusive): 1 at the last non-evicted token, 0 at the others,
// evicted slots untouched.
KVP_HD inline void mark_chunk_end(const std::uint8_t* roles, std::int64_t b, std::int64_t e,
                                  std::uint8_t* ends) {
  bool seen = false;
  for (std::int64_t j = e; j >= b; --j) {
    if (roles[j] == role_evicted) continue;
    ends[j] = seen ? 0 : 1;
    seen = true;
  }
}

// Weight rule of one core, accumulated over its members in candidate order (the seed first).
struct CoreStats {
  bool any = false;         // absorbed something besides the seed
  bool importance = false;  // importance weights still possible
  double wsum = 0.0;        // sum of count * score while importance holds
  double count = 0.0;       // sum of counts
};

KVP_HD inline void core_stats_add(CoreStats& s, bool is_seed, float score, double count) {
  s.any = s.any || !is_seed;
  const double sc = static_cast<double>(score);
  s.importance = s.importance && finite(sc) && sc >= 0.0;
  if (s.importance) s.wsum = add_product(s.wsum, count, sc);
  s.count += count;
}

// Importance weights only when every member's score is finite and >= 0 and their weighted sum
// is finite and positive; else the count-weighted mean.
KVP_HD inline bool core_uses_importance(const CoreStats& s) {
  return s.importance && finite(s.wsum) && s.wsum > 0.0;
}

// A product rounded on its own: the caller adds it up (`ws += w`), which nvcc would otherwise
// be free to contract into an FMA.
KVP_HD inline double member_weight(bool importance, double count, float score) {
#if defined(__CUDA_ARCH__)
  return importance ? __dmul_rn(count, static_cast<double>(score)) : count;
#else
  return importance ? unfused(count * static_cast<double>(score)) : count;
#endif
}

// sum * (1 / weight) rounded to float (the caller converts float -> cache type).
KVP_HD inline float mean_value(double sum, double inv_weight) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dmul_rn(sum, inv_weight));
#else
  return static_cast<float>(sum * inv_weight);
#endif
}

// ---- one row as a block's work ------------------------------------------------------------------

struct Params {
  float tau = 0.9f;
  std::int64_t chunk = 32;  // > 0, or 0 with a delimiter mask
  bool importance = true;   // MergeWeight::importance
};

// Strided element view (element offsets): row (l, h, t), column x.
struct Rows {
  void* data = nullptr;
  std::int64_t stride_layer = 0, stride_head = 0, stride_token = 0, stride_dim = 1;

  KVP_HD std::int64_t at(std::int64_t l, std::int64_t h, std::int64_t t, std::int64_t x) const {
    return l * stride_layer + h * stride_head + t * stride_token + x * stride_dim;
  }
};

// Everything merge_row reads and writes (device pointers in the kernel). Strides already
// resolved (> 0) except delimiter_stride (0: one mask shared by every row).
struct Geometry {
  std::int64_t layers = 0, heads = 0, tokens = 0, dim = 0;
  Rows keys, values;
  const float* scores = nullptr;
  std::int64_t score_stride = 0;
  float* log_count = nullptr;
  std::int64_t log_count_stride = 0;
  const std::int64_t* kept_offsets = nullptr;  // CSR selection, rows + 1
  const std::int32_t* kept_indices = nullptr;
  std::int64_t sinks = 0, recent = 0;
  const std::uint8_t* delimiter = nullptr;
  std::int64_t delimiter_stride = 0;
  std::uint8_t* chunk_end = nullptr;  // optional
  std::int64_t chunk_end_stride = 0;
};

// Per-row scratch (global memory in the kernel), `tokens` entries each.
struct Scratch {
  std::uint8_t* roles = nullptr;
  std::int32_t* cand = nullptr;   // candidates, best topk_key first
  std::int32_t* owner = nullptr;  // position in cand of the seed that took it, or -1
  double* norm2 = nullptr;        // squared key norm of cand[i]
};

inline constexpr std::int64_t scratch_bytes_per_token = 1 + 4 + 4 + 8;

// Lays out Scratch over `bytes` of memory for rows of `tokens` tokens (8-byte aligned base).
KVP_HD inline Scratch scratch_at(void* base, std::int64_t tokens) {
  auto* p = static_cast<unsigned char*>(base);
  const std::int64_t t8 = (tokens + 7) / 8 * 8;
  Scratch s;
  s.norm2 = reinterpret_cast<double*>(p);
  s.cand = reinterpret_cast<std::int32_t*>(p + 8 * t8);
  s.owner = reinterpret_cast<std::int32_t*>(p + 12 * t8);
  s.roles = p + 16 * t8;
  return s;
}
KVP_HD inline std::int64_t scratch_row_bytes(std::int64_t tokens) {
  return (tokens + 7) / 8 * 8 * scratch_bytes_per_token;
}

// Block-shared values (shared memory in the kernel).
struct Shared {
  std::int64_t last;
  int kept, evicted;
  double* seed_key;  // [dim]
};

// Elem: static double load(const void*, std::int64_t), static void store(void*, std::int64_t,
// float) for the cache type.
template <class Elem, class Block>
KVP_HD void merge_chunk(const Block& blk, const Params& p, const Geometry& g, std::int64_t l,
                        std::int64_t h, std::int64_t b, std::int64_t e, std::int64_t sinks_end,
                        std::int64_t recent_begin, const Scratch& s, Shared& sh) {
  // Protected tokens are a prefix and a suffix of the row: the candidates are contiguous.
  const std::int64_t cb = b > sinks_end ? b : sinks_end;
  const std::int64_t ce = e < recent_begin ? e : recent_begin;
  if (ce <= cb) return;
  const std::int64_t n = ce - cb, d = g.dim, r = l * g.heads + h;
  const float* score = g.scores + r * g.score_stride;
  float* lc = g.log_count + r * g.log_count_stride;
  const Rows K = g.keys, V = g.values;
  // Candidate order by rank: keys are distinct (indices are), so ranks are a permutation.
  blk.par([&](int t, int B) {
    int kept = 0, evicted = 0;
    for (std::int64_t i = t; i < n; i += B) {
      const std::int64_t j = cb + i;
      const std::uint64_t key = topk_key(score[j], static_cast<std::int32_t>(j));
      std::int64_t rank = 0;
      for (std::int64_t k = cb; k < ce; ++k)
        rank += topk_key(score[k], static_cast<std::int32_t>(k)) > key ? 1 : 0;
      s.cand[rank] = static_cast<std::int32_t>(j);
      (s.roles[j] == role_kept ? kept : evicted) += 1;
    }
    if (kept) blk.atomic_add(&sh.kept, kept);
    if (evicted) blk.atomic_add(&sh.evicted, evicted);
  });
  blk.sync();
  int kept_left = sh.kept;
  if (kept_left == 0 || sh.evicted == 0) return;
  blk.par([&](int t, int B) {
    for (std::int64_t i = t; i < n; i += B) {
      const std::int32_t j = s.cand[i];
      double q = 0;
      for (std::int64_t x = 0; x < d; ++x) {
        const double k = Elem::load(K.data, K.at(l, h, j, x));
        q = add_product(q, k, k);
      }
      s.norm2[i] = q;
      s.owner[i] = -1;
    }
  });
  blk.sync();
  for (std::int64_t i = 0; i < n && kept_left > 0; ++i) {
    if (s.owner[i] >= 0) continue;
    const std::int32_t si = s.cand[i];
    const bool seed_kept = s.roles[si] == role_kept;
    blk.par([&](int t, int B) {
      for (std::int64_t x = t; x < d; x += B) sh.seed_key[x] = Elem::load(K.data, K.at(l, h, si, x));
    });
    blk.sync();  // every thread has read owner[i]; seed_key is ready
    blk.single([&] { s.owner[i] = static_cast<std::int32_t>(i); });
    if (seed_kept) --kept_left;
    const double ni = s.norm2[i];
    const auto me = static_cast<std::int32_t>(i);
    blk.par([&](int t, int B) {
      for (std::int64_t m = i + 1 + t; m < n; m += B) {
        const std::int32_t j = s.cand[m];
        if (s.owner[m] >= 0 || s.roles[j] != role_evicted) continue;
        double dot = 0;
        for (std::int64_t x = 0; x < d; ++x)
          dot = add_product(dot, sh.seed_key[x], Elem::load(K.data, K.at(l, h, j, x)));
        if (similar(dot, ni, s.norm2[m], p.tau)) s.owner[m] = me;
      }
    });
    blk.sync();
  }
  // Cores: one per kept seed that absorbed something, members in candidate order.
  for (std::int64_t i = 0; i < n; ++i) {
    const auto me = static_cast<std::int32_t>(i);
    const std::int32_t si = s.cand[i];
    if (s.owner[i] != me || s.roles[si] != role_kept) continue;
    CoreStats st;
    st.importance = p.importance;
    for (std::int64_t m = i; m < n; ++m)
      if (s.owner[m] == me) core_stats_add(st, m == i, score[s.cand[m]], count_of(lc[s.cand[m]]));
    if (!st.any) continue;
    const bool imp = core_uses_importance(st);
    blk.par([&](int t, int B) {
      for (std::int64_t x = t; x < d; x += B) {
        double ks = 0, vs = 0, ws = 0;
        for (std::int64_t m = i; m < n; ++m) {
          if (s.owner[m] != me) continue;
          const std::int32_t j = s.cand[m];
          const double w = member_weight(imp, count_of(lc[j]), score[j]);
          ks = add_product(ks, w, Elem::load(K.data, K.at(l, h, j, x)));
          vs = add_product(vs, w, Elem::load(V.data, V.at(l, h, j, x)));
          ws += w;
        }
        const double inv = 1.0 / ws;
        Elem::store(K.data, K.at(l, h, si, x), mean_value(ks, inv));
        Elem::store(V.data, V.at(l, h, si, x), mean_value(vs, inv));
      }
    });
    blk.sync();  // every thread has read lc[si]
    blk.single([&] { lc[si] = log_count_of(st.count); });
  }
}

// Row r = l * heads + h, start to end. `s` is this row's scratch; sh.seed_key holds dim doubles.
template <class Elem, class Block>
KVP_HD void merge_row(const Block& blk, const Params& p, const Geometry& g, std::int64_t r,
                      const Scratch& s, Shared& sh) {
  const std::int64_t Tk = g.tokens, l = r / g.heads, h = r % g.heads;
  const std::int64_t kb = g.kept_offsets[r], ke = g.kept_offsets[r + 1];
  const bool evicts = ke - kb < Tk;
  const std::int64_t sinks_end = g.sinks < Tk ? g.sinks : Tk;
  const std::int64_t recent_begin = Tk - g.recent > sinks_end ? Tk - g.recent : sinks_end;
  blk.par([&](int t, int B) {
    for (std::int64_t j = t; j < Tk; j += B)
      s.roles[j] = (j < sinks_end || j >= recent_begin) ? role_protected : role_evicted;
  });
  blk.sync();
  blk.par([&](int t, int B) {
    for (std::int64_t i = kb + t; i < ke; i += B) {
      const std::int32_t j = g.kept_indices[i];
      if (s.roles[j] != role_protected) s.roles[j] = role_kept;
    }
  });
  blk.sync();
  const std::uint8_t* delim =
      g.delimiter ? g.delimiter + (g.delimiter_stride > 0 ? r * g.delimiter_stride : 0) : nullptr;
  std::uint8_t* ends = g.chunk_end ? g.chunk_end + r * g.chunk_end_stride : nullptr;
  for (std::int64_t start = 0; start < Tk;) {
    blk.single([&] {
      sh.last = chunk_last(delim, p.chunk, start, Tk);
      sh.kept = sh.evicted = 0;
    });
    blk.sync();
    const std::int64_t last = sh.last;
    // delim[start..last] has been read, so writing ends there is safe when they alias.
    if (ends) blk.single([&] { mark_chunk_end(s.roles, start, last, ends); });
    if (evicts) merge_chunk<Elem>(blk, p, g, l, h, start, last + 1, sinks_end, recent_begin, s, sh);
    blk.sync();  // every thread has read sh before thread 0 rewrites it
    start = last + 1;
  }
}

}  // namespace kvpolicy::gsc
