// SnapKV (Li et al. 2024): observation-window voting. At prefill, each key's score is the
// attention it receives from the last `window` queries (causal inside the window, fp32 softmax,
// GQA reduced to KV heads), smoothed by 1-D pooling with kernel `kernel`; the window's own tokens
// are always kept. Defaults follow kvpress (window=64, kernel=5, avg); `preset=authors` gives
// the authors' LongBench configuration (window=32, kernel=7, max). See shared/algorithms.md.
// [ours] sinks (default 0) can additionally protect the first tokens; window scores are
// computed from queries, never from stored attention maps.
#pragma once
#include <limits>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/snapkv_row.hpp"
#include "kvpolicy/scorers/common.hpp"

namespace kvpolicy {

struct SnapKV {
  static constexpr std::string_view name = "snapkv";
  std::int64_t window = 64;
  int kernel = 5;
  Pool pool = Pool::avg;
  GqaReduce reduce = GqaReduce::mean;
  std::int64_t sinks = 0;

  static SnapKV authors() { return {32, 7, Pool::max, GqaReduce::mean, 0}; }

  void validate() const {
    KVP_REQUIRE(window >= 1, "snapkv: window must be >= 1, got ", window);
    KVP_REQUIRE(kernel >= 1 && kernel % 2 == 1, "snapkv: kernel must be odd and >= 1, got ",
                kernel);
    KVP_REQUIRE(sinks >= 0, "snapkv: sinks must be >= 0, got ", sinks);
  }
  static SnapKV from_params(Params& p) {
    SnapKV s = p.get_choice("preset", "kvpress", {"kvpress", "authors"}) == "authors"
                   ? authors()
                   : SnapKV{};
    s.window = p.get_int("window", s.window);
    const std::int64_t kernel = p.get_int("kernel", s.kernel);
    // Check before narrowing, or kernel=4294967297 would wrap to a valid kernel of 1.
    KVP_REQUIRE(kernel >= std::numeric_limits<int>::min() &&
                    kernel <= std::numeric_limits<int>::max(),
                "snapkv: kernel ", kernel, " is out of range");
    s.kernel = static_cast<int>(kernel);
    s.pool = p.get_choice("pool", s.pool == Pool::max ? "max" : "avg", {"avg", "max"}) == "max"
                 ? Pool::max
                 : Pool::avg;
    s.reduce = parse_reduce(p.get_choice("reduce", "mean", {"mean", "max", "sum"}));
    s.sinks = p.get_int("sinks", 0);
    s.validate();
    return s;
  }

  Needs needs() const { return Needs::keys | Needs::queries; }
  std::int64_t query_window() const { return window; }
  Protect protect(std::int64_t, std::int64_t) const { return {sinks, window}; }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats& stats, ScoreMap& out) const {
    validate();
    const std::int64_t Tk = in.tokens(), w = std::min(window, Tk);
    KVP_REQUIRE(in.queries.tokens >= w, "snapkv: needs the last ", w, " queries, got ",
                in.queries.tokens);
    const ScoreMap& attn = window_attention_stat(be, in, stats, w, reduce);
    out.resize(in.layers(), in.kv_heads(), Tk);
    const std::int64_t n = Tk - w;  // tokens outside the window
    cpu::parallel_for(be, in.layers() * in.kv_heads(), [&](std::int64_t r) {
      const std::int64_t l = r / in.kv_heads(), h = r % in.kv_heads();
      auto dst = out.row(l, h);
      if (n > 0) row_math::pool1d(attn.row(l, h).data(), dst.data(), n, kernel, pool);
      for (std::int64_t j = n; j < Tk; ++j) dst[j] = std::numeric_limits<float>::max();
    });
  }
};

}  // namespace kvpolicy
