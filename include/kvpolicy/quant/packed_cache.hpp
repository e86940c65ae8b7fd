// PackedCache: the quantized cache of one (layer, KV head) with a full-precision residual window
// (OScaR / KIVI, shared/algorithms.md). Tokens are appended in original space (post-RoPE K, V);
// they are stored at once in their transformed form (rotated, key divided by its norm) in an fp32
// residual. Whenever the residual holds more than `residual` tokens, its oldest whole groups of
// `group` tokens are packed into one key tile + one value tile each (quantizer.hpp), the fewest
// that bring it back to <= `residual` tokens (when residual < group - 1 only complete groups are
// packed, so up to group - 1 tokens may stay). Hence:
//   packed_tokens() = group * min(ceil(max(0, size - residual) / group), floor(size / group))
// depends only on size(): appending token by token or all at once gives the same bytes, and
// packed tiles always cover aligned token ranges [i * group, (i + 1) * group).
// Cache order = token order: packed tiles first, then the residual (a log_count bias follows it).
//
// Memory: packed_tokens() * bytes_per_token() + residual_tokens() * (2 * d + 1) * 4 bytes.
//
// Appending does not stream every token through the residual: a call works out which tiles its
// tokens end up in (packed_target), so once the residual holds only tokens that are packed anyway
// it is packed whole and the next tiles pass through the empty buffer one group at a time. The
// buffer's rows stay at its front, and only a small append that keeps part of the residual moves
// rows (as many as the residual keeps). The result is the same as packing group by group.
#pragma once
#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvpolicy/quant/quantizer.hpp"

namespace kvpolicy::quant {

namespace detail {
// std::allocator whose value-initialization (vector::resize) leaves the elements as they are:
// the encoders write every byte of a new tile, so zero-filling it first is a wasted pass.
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
}  // namespace detail

// The largest magnitude a quantized cache takes: the rotation's butterflies and the key norms
// of larger elements overflow fp32 (found by fuzz_spec: rows of 3e38 became -inf after the
// Hadamard rotation). 2^100 ~ 1.3e30 leaves room for head_dim up to 2^27.
inline constexpr float kMaxMagnitude = 0x1p100f;

// Throws, naming the element, unless every element of `v` is finite and below kMaxMagnitude.
template <class T>
void require_quantizable(const KVView<T>& v, std::string_view what) {
  require_finite(v, what, kMaxMagnitude,
                 "a quantized cache takes magnitudes below 2^100 (the rotation and the norms "
                 "would overflow fp32)");
}

// Tokens packed once a cache of `config` holds `size` tokens (the formula above).
inline std::int64_t packed_tokens_at(const QuantConfig& config, std::int64_t size) {
  const std::int64_t G = config.group;
  return G * std::min((std::max<std::int64_t>(0, size - config.residual) + G - 1) / G, size / G);
}

// Bytes a cache of `config` holds at `size` tokens (memory_bytes(), without buffer slack).
inline std::size_t packed_bytes_at(const QuantConfig& config, std::int64_t head_dim,
                                   std::int64_t size) {
  const std::int64_t p = packed_tokens_at(config, size);
  return static_cast<std::size_t>(p / config.group) *
             (key_tile_bytes(config, head_dim) + value_tile_bytes(config, head_dim)) +
         static_cast<std::size_t>((size - p) * (2 * head_dim + 1)) * sizeof(float);
}

// True when a cache of `config` that starts with `tokens` tokens and then grows never holds more
// bytes than those tokens at `plain_bytes_per_token` each (the full-precision cache it
// replaces): packed_bytes_at(s) <= s * plain_bytes_per_token for every s >= tokens. One growth
// cycle (residual + 2 * group sizes) is checked: past it the residual's bytes repeat and each
// further packed group only adds savings, as every format here packs a token into fewer bytes
// than an fp16 row.
inline bool packed_never_exceeds(const QuantConfig& config, std::int64_t head_dim,
                                 std::int64_t tokens, std::size_t plain_bytes_per_token) {
  for (std::int64_t s = tokens; s < tokens + config.residual + 2 * config.group; ++s)
    if (packed_bytes_at(config, head_dim, s) > static_cast<std::size_t>(s) * plain_bytes_per_token)
      return false;
  return true;
}

// The residual window a Session gives a head that starts with `tokens` survivors: the largest
// window <= config.residual with which packed_never_exceeds holds. Where none does (fewer than
// `group` survivors: nothing can be packed, and fp32 rows plus key norms cost more than fp32 or
// fp16 rows; with fp16 rows also some counts just past a group boundary), 0: the fewest bytes
// the format allows.
inline std::int64_t fit_residual(QuantConfig config, std::int64_t head_dim, std::int64_t tokens,
                                 std::size_t plain_bytes_per_token) {
  for (std::int64_t r = config.residual; r > 0; --r) {
    config.residual = static_cast<int>(r);
    if (packed_never_exceeds(config, head_dim, tokens, plain_bytes_per_token)) return r;
  }
  return 0;
}

class PackedCache {
 public:
  PackedCache() = default;
  PackedCache(const QuantConfig& config, std::int64_t head_dim, std::string_view who = "quant")
      : config_(config), d_(head_dim) {
    quant::validate(config, head_dim, who);
    key_tile_ = key_tile_bytes(config, head_dim);
    value_tile_ = value_tile_bytes(config, head_dim);
  }
  template <class Tag>
  PackedCache(const BasicQuantizer<Tag>& q, std::int64_t head_dim)
      : PackedCache(q.config, head_dim, BasicQuantizer<Tag>::name) {}

  const QuantConfig& config() const { return config_; }
  std::int64_t head_dim() const { return d_; }
  std::int64_t size() const { return packed_ + residual_tokens(); }
  std::int64_t packed_tokens() const { return packed_; }
  std::int64_t residual_tokens() const { return res_n_; }
  std::int64_t tiles() const { return packed_ / config_.group; }

  // Packed tile i (tokens [i * group, (i + 1) * group)).
  const std::byte* key_tile(std::int64_t i) const { return keys_.data() + i * static_cast<std::int64_t>(key_tile_); }
  const std::byte* value_tile(std::int64_t i) const { return values_.data() + i * static_cast<std::int64_t>(value_tile_); }
  std::size_t key_tile_size() const { return key_tile_; }
  std::size_t value_tile_size() const { return value_tile_; }
  // Residual rows in stored form, [residual_tokens()][d], and the key norms (1 without token_norm).
  const float* residual_keys() const { return res_k_.data(); }
  const float* residual_values() const { return res_v_.data(); }
  const float* residual_norms() const { return res_norm_.data(); }

  // Held bytes: the packed tiles and the live residual rows (the residual buffer keeps its
  // capacity, at most about twice residual + group rows).
  std::size_t memory_bytes() const {
    return keys_.size() + values_.size() + static_cast<std::size_t>(res_n_ * (2 * d_ + 1)) * sizeof(float);
  }

  // Empties the cache; the buffers keep their capacity.
  void clear() {
    keys_.clear();
    values_.clear();
    res_n_ = 0;
    packed_ = 0;
  }

  // Tokens packed once the cache holds `size` tokens (the formula at the top).
  std::int64_t packed_target(std::int64_t size) const { return packed_tokens_at(config_, size); }

  // Appends n tokens: k, v contiguous [n][d] fp32 in original space (finite). A token with a
  // non-finite element throws; the tokens before it are appended.
  void append(const float* k, const float* v, std::int64_t n) {
    require_appendable(n);
    append_rows(k, v, n, 0);
  }

  // Appends tokens [t0, t0 + n) of (layer, head) of two views of any element type and layout
  // (e.g. the survivors of an eviction, or the newest decode step).
  template <class T>
  void append(const KVView<const T>& keys, const KVView<const T>& values, std::int64_t layer,
              std::int64_t head, std::int64_t t0, std::int64_t n) {
    KVP_REQUIRE(keys.dim == d_ && values.dim == d_, "PackedCache::append: head_dim ", keys.dim,
                "/", values.dim, " does not match the cache's ", d_);
    KVP_REQUIRE(layer >= 0 && layer < keys.layers && layer < values.layers && head >= 0 &&
                    head < keys.heads && head < values.heads,
                "PackedCache::append: (layer ", layer, ", head ", head, ") is outside the views");
    KVP_REQUIRE(t0 >= 0 && n >= 0 && t0 + n <= keys.tokens && t0 + n <= values.tokens,
                "PackedCache::append: tokens [", t0, ", ", t0 + n, ") are outside the views (",
                keys.tokens, "/", values.tokens, " tokens)");
    require_appendable(n);
    // Converted to fp32 rows in chunks, then appended as rows (same state as one call).
    constexpr std::int64_t kChunk = 256;
    std::vector<float> kr(static_cast<std::size_t>(std::min(n, kChunk) * d_)), vr(kr.size());
    for (std::int64_t c0 = 0; c0 < n; c0 += kChunk) {
      const std::int64_t m = std::min(kChunk, n - c0);
      for (std::int64_t t = 0; t < m; ++t)
        for (std::int64_t i = 0; i < d_; ++i) {
          kr[static_cast<std::size_t>(t * d_ + i)] = to_float(keys.at(layer, head, t0 + c0 + t, i));
          vr[static_cast<std::size_t>(t * d_ + i)] = to_float(values.at(layer, head, t0 + c0 + t, i));
        }
      append_rows(kr.data(), vr.data(), m, c0);
    }
  }

  // The whole cache in original space, k and v [size()][d] (materializes: tests and debugging,
  // not the attention path).
  void decode(float* k, float* v) const {
    std::vector<float> norms(static_cast<std::size_t>(config_.group));
    with_block(config_.bits, config_.group, [&](auto blk) {
      using Blk = decltype(blk);
      for (std::int64_t i = 0; i < tiles(); ++i) {
        float* kt = k + i * config_.group * d_;
        float* vt = v + i * config_.group * d_;
        decode_key_tile<Blk>(config_, key_tile(i), config_.group, d_, kt, norms.data());
        decode_value_tile<Blk>(value_tile(i), config_.group, d_, vt);
      }
    });
    for (std::int64_t t = 0; t < packed_; ++t) {
      restore_key(config_, k + t * d_, d_, norms_of_packed(t));
      restore_value(config_, v + t * d_, d_);
    }
    for (std::int64_t r = 0; r < residual_tokens(); ++r) {
      float* kr = k + (packed_ + r) * d_;
      float* vr = v + (packed_ + r) * d_;
      std::copy(res_k_.begin() + r * d_, res_k_.begin() + (r + 1) * d_, kr);
      std::copy(res_v_.begin() + r * d_, res_v_.begin() + (r + 1) * d_, vr);
      restore_key(config_, kr, d_, res_norm_[static_cast<std::size_t>(r)]);
      restore_value(config_, vr, d_);
    }
  }

  // Token norm of packed token t (1 without token_norm).
  float norms_of_packed(std::int64_t t) const {
    if (!config_.token_norm) return 1.0f;
    const std::byte* tile = key_tile(t / config_.group);
    const auto* nr = reinterpret_cast<const float*>(tile + d_ * static_cast<std::int64_t>(block_bytes(config_.bits, config_.group)));
    return nr[t % config_.group];
  }

 private:
  void require_appendable(std::int64_t n) const {
    KVP_REQUIRE(d_ > 0, "PackedCache::append: the cache was default-constructed (no head_dim)");
    KVP_REQUIRE(n >= 0, "PackedCache::append: negative token count ", n);
  }

  // Appends rows k, v [n][d] (original space); `first` numbers row 0 in error messages.
  // While a segment is encoded, push_rows prefetches the next one (ahead_): otherwise its
  // check, the first read of the input, waits for memory with no work to overlap (the check
  // was 12 % of the samples of 8 heads on 2 threads at T=32768, the input in DRAM).
  // Segments of finite rows, checked just before they are copied (so still in cache then); a
  // segment spans more than the residual window, so appending one packs the residual whole.
  void append_rows(const float* k, const float* v, std::int64_t n, std::int64_t first) {
    const std::int64_t seg = std::max<std::int64_t>(256, 2 * (config_.residual + config_.group));
    for (std::int64_t t0 = 0; t0 < n; t0 += seg) {
      const std::int64_t m = std::min(seg, n - t0);
      std::int64_t ok = 0;
      while (ok < m) {  // blocks of rows, one reduction each; the first bad row within a block
        const std::int64_t b = std::min(kCheckRows, m - ok);
        const float* kb = k + (t0 + ok) * d_;
        const float* vb = v + (t0 + ok) * d_;
        if (finite_rows(kb, b) && finite_rows(vb, b)) {
          ok += b;
          continue;
        }
        while (finite_rows(k + (t0 + ok) * d_, 1) && finite_rows(v + (t0 + ok) * d_, 1)) ++ok;
        break;
      }
      ahead_ = {k + (t0 + m) * d_, v + (t0 + m) * d_, std::min(seg, n - t0 - m)};
      append_finite(k + t0 * d_, v + t0 * d_, ok);
      ahead_.rows = 0;
      if (ok < m) fail_non_finite(k + (t0 + ok) * d_, v + (t0 + ok) * d_, first + t0 + ok);
    }
  }

  // Whether all values of `rows` rows are finite and below kMaxMagnitude: exponent bits below
  // 2^100's. On the bits, as an integer max, so that the scan vectorizes (std::isfinite is an fp
  // comparison, kept scalar by -ftrapping-math). append_rows checks kCheckRows rows per call:
  // one horizontal reduction and branch per block instead of per row (a row of d = 128 is 16
  // vector maxima, which the per-row reduction and call nearly doubled).
  static constexpr std::int64_t kCheckRows = 8;
  bool finite_rows(const float* x, std::int64_t rows) const {
    constexpr std::uint32_t kLimit = (100u + 127u) << 23;  // exponent field of 2^100
    std::uint32_t top = 0;
    for (std::int64_t i = 0; i < rows * d_; ++i) {
      std::uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      top = std::max(top, bits & 0x7f800000u);
    }
    return top < kLimit;
  }

  // Throws for the first element of token t that is non-finite or too large (key before value
  // at the same dim).
  [[noreturn]] void fail_non_finite(const float* kr, const float* vr, std::int64_t t) const {
    const auto ok = [](float x) { return std::isfinite(x) && std::fabs(x) < kMaxMagnitude; };
    std::int64_t i = 0;
    while (i + 1 < d_ && ok(kr[i]) && ok(vr[i])) ++i;
    const bool key = !ok(kr[i]);
    const float x = key ? kr[i] : vr[i];
    if (!std::isfinite(x))
      kvpolicy::detail::fail("PackedCache::append: token ", t, " has a non-finite ",
                             key ? "key" : "value", " element at dim ", i);
    kvpolicy::detail::fail("PackedCache::append: token ", t, " has a ", key ? "key" : "value",
                           " element of ", x, " at dim ", i,
                           "; a quantized cache takes magnitudes below 2^100 (the rotation and "
                           "the norms would overflow fp32)");
  }

  // Appends n finite rows. to_pack = the tokens this call packs, counted from the residual's
  // first row. While they cover the whole residual, rows are added up to the next group boundary
  // and the residual's groups packed, which empties it; the rows left over then stay as the
  // residual. Otherwise (a small append) the rows are added and the oldest groups packed from
  // the front, the rest moved down.
  void append_finite(const float* k, const float* v, std::int64_t n) {
    const std::int64_t G = config_.group;
    std::int64_t to_pack = packed_target(size() + n) - packed_;
    std::int64_t t = 0;
    for (;;) {
      if (res_n_ > 0 && res_n_ % G == 0 && to_pack >= res_n_) {
        pack_front(res_n_ / G);
        to_pack -= res_n_;
        res_n_ = 0;
      }
      if (t == n) break;
      const std::int64_t m = to_pack > res_n_ ? std::min(n - t, G - res_n_ % G) : n - t;
      push_rows(k + t * d_, v + t * d_, m);
      t += m;
    }
    if (to_pack > 0) {
      pack_front(to_pack / G);
      const auto rows = static_cast<std::size_t>(to_pack), rest = static_cast<std::size_t>(res_n_ - to_pack);
      const auto d = static_cast<std::size_t>(d_);
      std::memmove(res_k_.data(), res_k_.data() + rows * d, rest * d * sizeof(float));
      std::memmove(res_v_.data(), res_v_.data() + rows * d, rest * d * sizeof(float));
      std::memmove(res_norm_.data(), res_norm_.data() + rows, rest * sizeof(float));
      res_n_ -= to_pack;
    }
  }

  // Brings n rows to stored form at the end of the residual (the rotation reads the input and
  // writes the residual: no separate copy pass).
  void push_rows(const float* k, const float* v, std::int64_t n) {
    const auto need = static_cast<std::size_t>(res_n_ + n);
    if (res_norm_.size() < need) {  // grow only; clear() and packing keep the capacity
      res_k_.resize(need * static_cast<std::size_t>(d_));
      res_v_.resize(need * static_cast<std::size_t>(d_));
      res_norm_.resize(need);
    }
    float* kr = res_k_.data() + res_n_ * d_;
    float* vr = res_v_.data() + res_n_ * d_;
    // One row of the next segment prefetched per value row rotated: bursts of 8 rows (128
    // lines of K and V) filled the core's line-fill buffers, so the prefetches stalled the
    // core instead of overlapping the rotations (8 heads at T=32768, input in DRAM, 1 thread:
    // encode CPU time 90 -> 80 ms; prefetcht0 / t2 instead of t1 made no difference).
    for (std::int64_t t = 0; t < n; ++t) {
      prefetch_ahead(1);
      prepare_values(config_, v + t * d_, vr + t * d_, 1, d_);
    }
    prepare_keys(config_, k, kr, n, d_, res_norm_.data() + res_n_);
    res_n_ += n;
  }

  // Prefetches (into L2) the next n of the rows ahead_ points to, as far as there are any.
  void prefetch_ahead(std::int64_t n) {
    const std::int64_t m = std::min(n, ahead_.rows);
#if defined(__GNUC__) || defined(__clang__)
    const auto bytes = static_cast<std::size_t>(m * d_) * sizeof(float);
    const char* pk = reinterpret_cast<const char*>(ahead_.k);
    const char* pv = reinterpret_cast<const char*>(ahead_.v);
    for (std::size_t i = 0; i < bytes; i += 64) {
      __builtin_prefetch(pk + i, 0, 2);
      __builtin_prefetch(pv + i, 0, 2);
    }
#endif
    ahead_.k += m * d_;
    ahead_.v += m * d_;
    ahead_.rows -= m;
  }

  // Packs the residual's first `tiles` groups into new tiles (the rows stay where they are).
  void pack_front(std::int64_t tiles) {
    const std::int64_t G = config_.group;
    const std::size_t k0 = keys_.size(), v0 = values_.size();
    keys_.resize(k0 + static_cast<std::size_t>(tiles) * key_tile_);
    values_.resize(v0 + static_cast<std::size_t>(tiles) * value_tile_);
    with_block(config_.bits, G, [&](auto blk) {
      using Blk = decltype(blk);
      for (std::int64_t i = 0; i < tiles; ++i) {
        encode_key_tile<Blk>(config_, res_k_.data() + i * G * d_, res_norm_.data() + i * G, static_cast<int>(G), d_,
                             keys_.data() + k0 + static_cast<std::size_t>(i) * key_tile_);
        encode_value_tile<Blk>(res_v_.data() + i * G * d_, static_cast<int>(G), d_,
                               values_.data() + v0 + static_cast<std::size_t>(i) * value_tile_);
      }
    });
    packed_ += tiles * G;
  }

  QuantConfig config_{};
  std::int64_t d_ = 0;
  std::size_t key_tile_ = 0, value_tile_ = 0;
  std::int64_t packed_ = 0;
  std::vector<std::byte, detail::UninitAllocator<std::byte>> keys_, values_;  // tiles() key / value tiles
  std::int64_t res_n_ = 0;                  // residual rows in use (the buffers may be longer)
  struct Ahead {
    const float* k = nullptr;
    const float* v = nullptr;
    std::int64_t rows = 0;
  } ahead_;  // input rows of the next segment of the running append, not yet prefetched
  std::vector<float> res_k_, res_v_, res_norm_;  // [res_n_][d], [res_n_][d], [res_n_] in front
};

template <class Tag>
template <class T>
PackedCache BasicQuantizer<Tag>::pack(const KVView<const T>& keys, const KVView<const T>& values,
                                      std::int64_t layer, std::int64_t head,
                                      std::int64_t tokens) const {
  QuantConfig c = config;
  const std::int64_t d = keys.dim;
  c.residual = static_cast<int>(
      fit_residual(c, d, tokens, static_cast<std::size_t>(2 * d) * sizeof(T)));
  PackedCache p(c, d, name);
  p.append(keys, values, layer, head, 0, tokens);
  return p;
}

}  // namespace kvpolicy::quant

namespace kvpolicy {

// Quantizer: the last stage of a policy. A Session hands it each KV head's survivors after the
// prefill eviction; pack() returns them as a quant::PackedCache, which the Session stores and
// attends over (packed_attention) in place of the full-precision rows. bits(): the code width.
template <class Q>
concept Quantizer = std::is_trivially_copyable_v<Q> &&
    requires(const Q q, const KVView<const float>& kv, std::int64_t n) {
      { Q::name } -> std::convertible_to<std::string_view>;
      { q.bits() } -> std::convertible_to<int>;
      { q.pack(kv, kv, n, n, n) } -> std::same_as<quant::PackedCache>;
    };

static_assert(Quantizer<quant::Int2> && Quantizer<quant::Int4> && Quantizer<quant::Kivi>);

}  // namespace kvpolicy
