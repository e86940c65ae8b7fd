// KVzip (Kim et al. 2025, "Query-Agnostic KV Cache Compression with Context Reconstruction"):
// after the context's prefill, the model is asked to repeat the context ("Repeat the previous
// context exactly." followed by the context itself, teacher-forced, in chunks) on top of the
// cache. A key's score is the largest attention any query of that pass gives it. The keys the
// model needs to reproduce the context are the ones a later question can need, so the scores do
// not depend on the question, at the price of about one more prefill.
//
// The pass is the engine's; the library defines what it hands over. Per layer and chunk, the
// chunk's post-RoPE queries, keys and values go to Session::reconstruct (C:
// kvp_session_reconstruct, Python: Session.reconstruct), which attends over the cache and the
// chunk's earlier tokens and keeps the running maximum per cached token. The chunk's own tokens are
// dropped again. The reference engine runs the whole pass (Engine::reconstruct, chunks of 2048
// tokens, as the authors and kvpress do). Engines that compute the scores themselves pass them
// directly as Inputs::reconstruction ([L][Hkv][T]; Python: Policy.select(..., reconstruction=)).
//
// score[l, h, j] = max over the reconstruction queries i and the query heads q of KV head h of
//                  softmax_j'(q_i . k_j' / sqrt(d))[j]
//
// Choices the sources leave open, or that differ from kvpress's KVzipPress:
// - [ours] The softmax runs over every key the query sees: the whole cache plus the chunk's
//   earlier tokens, which is the attention the forward pass computes anyway (one fused pass,
//   no second scoring kernel). kvpress normalises over a subset: the first n_sink keys, the cache
//   keys of the chunk being repeated and the repeat tokens, so a chunk scores only its own part
//   of the cache and its scores are larger. Kept sets therefore differ from kvpress's.
// - Tokens before the repeated span (Engine::reconstruct's `first`: a chat header) are not
//   repeated but still score the attention the repeat queries give them; kvpress scores them 0
//   beyond its n_sink first tokens.
// - sinks=4 (kvpress's n_sink): the first tokens are always kept (they count toward the budget).
// - recent=0: tokens appended after the pass score 0 (nothing reconstructed them). With
//   decode-time compression, keep the newest ones with recent=N or run the pass again.
// - The split of the budget is left to the allocators. `kvzip | adakv(alpha=0)` keeps a layer's
//   best scores over all of its heads, as KVzipPress(layerwise=True) does. kvpress's default is one
//   threshold over all layers, which no allocator here implements.
#pragma once
#include <cmath>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"

namespace kvpolicy {

struct KVzip {
  static constexpr std::string_view name = "kvzip";
  std::int64_t sinks = 4;
  std::int64_t recent = 0;

  void validate() const {
    KVP_REQUIRE(sinks >= 0, "kvzip: sinks must be >= 0, got ", sinks);
    KVP_REQUIRE(recent >= 0, "kvzip: recent must be >= 0, got ", recent);
  }
  static KVzip from_params(Params& p) {
    KVzip s;
    s.sinks = p.get_int("sinks", s.sinks);
    s.recent = p.get_int("recent", s.recent);
    s.validate();
    return s;
  }
  Needs needs() const { return Needs::keys | Needs::reconstruction; }
  std::int64_t query_window() const { return 0; }
  Protect protect(std::int64_t, std::int64_t) const { return {sinks, recent}; }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats&, ScoreMap& out) const {
    validate();
    KVP_REQUIRE(in.reconstruction != nullptr,
                "kvzip: needs context-reconstruction scores; run the reconstruction pass first "
                "(Session::reconstruct, kvp_session_reconstruct, Engine::reconstruct) or set "
                "Inputs::reconstruction (Python: reconstruction=)");
    const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens();
    const std::int64_t st = in.state_row_stride();
    out.resize(L, H, Tk);
    for (std::int64_t r = 0; r < L * H; ++r)  // (checked first: nothing is written on error)
      for (std::int64_t j = 0; j < Tk; ++j)
        KVP_REQUIRE(std::isfinite(in.reconstruction[r * st + j]), "kvzip: reconstruction score of "
                    "layer ", r / H, ", head ", r % H, ", token ", j, " is ",
                    in.reconstruction[r * st + j], " (scores must be finite)");
    cpu::parallel_for(be, L * H, [&](std::int64_t r) {
      auto dst = out.row(r / H, r % H);
      const float* src = in.reconstruction + r * st;
      for (std::int64_t j = 0; j < Tk; ++j) dst[j] = src[j];
    });
  }
};

}  // namespace kvpolicy
