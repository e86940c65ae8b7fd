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
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvpolicy/quant/quantizer.hpp"

namespace kvpolicy::quant {

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
  std::int64_t residual_tokens() const { return static_cast<std::int64_t>(res_norm_.size()); }
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

  std::size_t memory_bytes() const {
    return keys_.size() + values_.size() + (res_k_.size() + res_v_.size() + res_norm_.size()) * sizeof(float);
  }

  void clear() {
    keys_.clear();
    values_.clear();
    res_k_.clear();
    res_v_.clear();
    res_norm_.clear();
    packed_ = 0;
  }

  // Appends n tokens: k, v contiguous [n][d] fp32 in original space (finite).
  void append(const float* k, const float* v, std::int64_t n) {
    append_rows(n, [&](std::int64_t t, float* kr, float* vr) {
      std::copy(k + t * d_, k + (t + 1) * d_, kr);
      std::copy(v + t * d_, v + (t + 1) * d_, vr);
    });
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
    append_rows(n, [&](std::int64_t t, float* kr, float* vr) {
      for (std::int64_t i = 0; i < d_; ++i) {
        kr[i] = to_float(keys.at(layer, head, t0 + t, i));
        vr[i] = to_float(values.at(layer, head, t0 + t, i));
      }
    });
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
  template <class Load>
  void append_rows(std::int64_t n, Load&& load) {
    KVP_REQUIRE(d_ > 0, "PackedCache::append: the cache was default-constructed (no head_dim)");
    KVP_REQUIRE(n >= 0, "PackedCache::append: negative token count ", n);
    for (std::int64_t t = 0; t < n; ++t) {
      const std::size_t off = res_k_.size();
      res_k_.resize(off + static_cast<std::size_t>(d_));
      res_v_.resize(off + static_cast<std::size_t>(d_));
      float* kr = res_k_.data() + off;
      float* vr = res_v_.data() + off;
      load(t, kr, vr);
      for (std::int64_t i = 0; i < d_; ++i)
        if (!std::isfinite(kr[i]) || !std::isfinite(vr[i])) {
          res_k_.resize(off);
          res_v_.resize(off);
          kvpolicy::detail::fail("PackedCache::append: token ", t, " has a non-finite ",
                       std::isfinite(kr[i]) ? "value" : "key", " element at dim ", i);
        }
      res_norm_.push_back(prepare_key(config_, kr, d_));
      prepare_value(config_, vr, d_);
      flush();
    }
  }

  // Packs the oldest whole groups while the residual is longer than `residual`.
  void flush() {
    const std::int64_t G = config_.group;
    while (residual_tokens() > config_.residual && residual_tokens() >= G) {
      const std::size_t k0 = keys_.size(), v0 = values_.size();
      keys_.resize(k0 + key_tile_);
      values_.resize(v0 + value_tile_);
      with_block(config_.bits, G, [&](auto blk) {
        using Blk = decltype(blk);
        encode_key_tile<Blk>(config_, res_k_.data(), res_norm_.data(), static_cast<int>(G), d_, keys_.data() + k0);
        encode_value_tile<Blk>(res_v_.data(), static_cast<int>(G), d_, values_.data() + v0);
      });
      res_k_.erase(res_k_.begin(), res_k_.begin() + G * d_);
      res_v_.erase(res_v_.begin(), res_v_.begin() + G * d_);
      res_norm_.erase(res_norm_.begin(), res_norm_.begin() + G);
      packed_ += G;
    }
  }

  QuantConfig config_{};
  std::int64_t d_ = 0;
  std::size_t key_tile_ = 0, value_tile_ = 0;
  std::int64_t packed_ = 0;
  std::vector<std::byte> keys_, values_;   // tiles() key tiles / value tiles
  std::vector<float> res_k_, res_v_, res_norm_;
};

}  // namespace kvpolicy::quant
