// ScoreMap: fp32 importance scores [layer][kv_head][token]; higher means keep.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kvpolicy {

class ScoreMap {
 public:
  ScoreMap() = default;
  ScoreMap(std::int64_t layers, std::int64_t heads, std::int64_t tokens, float fill = 0.f)
      : layers_(layers), heads_(heads), tokens_(tokens),
        data_(static_cast<std::size_t>(layers * heads * tokens), fill) {}

  void resize(std::int64_t layers, std::int64_t heads, std::int64_t tokens, float fill = 0.f) {
    layers_ = layers, heads_ = heads, tokens_ = tokens;
    data_.assign(static_cast<std::size_t>(layers * heads * tokens), fill);
  }
  std::int64_t layers() const { return layers_; }
  std::int64_t heads() const { return heads_; }
  std::int64_t tokens() const { return tokens_; }
  std::span<float> row(std::int64_t l, std::int64_t h) {
    return {data_.data() + (l * heads_ + h) * tokens_, static_cast<std::size_t>(tokens_)};
  }
  std::span<const float> row(std::int64_t l, std::int64_t h) const {
    return {data_.data() + (l * heads_ + h) * tokens_, static_cast<std::size_t>(tokens_)};
  }
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }

 private:
  std::int64_t layers_ = 0, heads_ = 0, tokens_ = 0;
  std::vector<float> data_;
};

}  // namespace kvpolicy
