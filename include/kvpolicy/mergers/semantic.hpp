// Semantic clustering merger, after SemantiCache (2026; abstract only, shared/algorithms.md): the
// cache is cut into chunks at delimiter tokens, tokens inside a chunk are grouped by Greedy
// Seed-Based Clustering (GSC) on key cosine, and each cluster is merged into a "semantic core"
// that carries a count; attention adds log(count) to a core's logit (proportional attention,
// cpu::attention's `bias`), which is exact when the merged keys are identical.
//
// [ours] Everything below is our reading; the abstract gives no code.
// - Cores and the budget. The selection fixes which rows survive the event, so a cluster can
//   only live on in a kept row. Roles per (layer, KV head) row: *protected* tokens (the
//   MergeArgs::protect sinks and recent window) are never seeds, members or written; *kept*
//   tokens (kept by score) may seed a cluster but are never absorbed into another one, so every
//   kept row stays its own row ("top-budget tokens stay singleton": no two kept tokens share a
//   row); *evicted* tokens are the ones clusters absorb. A semantic core is a kept row together
//   with the evicted tokens of its chunk that its cluster absorbed; its K and V are written into
//   that row and its count into log_count. A kept token that absorbs nothing is unchanged.
//   Clusters seeded by an evicted token have no row and are evicted as a whole, exactly as
//   without a merger. The number of rows, and so the memory, is the selection's.
// - GSC inside a chunk: candidates are the chunk's kept and evicted tokens, ordered by score
//   (higher first, then the more recent: the library's top-k order, topk_key). The first
//   unassigned candidate is a seed; it absorbs every unassigned evicted token of the chunk with
//   cos(k_i, k_seed) >= tau. Since the selection keeps the top scores, kept seeds come first;
//   once no kept candidate is left, the remaining clusters would be evicted anyway and the loop
//   stops. Cosines are computed in fp64 and compared with tau - 1e-9, so tau = 1 merges keys of
//   one direction despite rounding (identical keys have cosine exactly 1). A zero key has cosine
//   1 with another zero key and 0 with any other key.
// - Chunks: a chunk ends at a token whose delimiter flag is set (the delimiter is the chunk's
//   last token), at the end of the row, and, when chunk > 0, after `chunk` tokens (fixed-size
//   chunks without a mask; a cap on long delimiter-free runs with one). Protected tokens count
//   toward chunk lengths. With a mask, chunk = 0 means chunks end at delimiters only; without one
//   it is rejected. The engine builds the mask from token text with is_delimiter() (default set
//   `. , ; : ! ? \n`). Across events, the owner keeps a per-row mask compacted with K/V; passing
//   MergeArgs::chunk_end (it may alias that mask) marks the last kept row of every chunk, so a
//   boundary survives the eviction of its delimiter token.
// - Core K and V: member i has weight c_i * s_i (weight=importance, s = score) or c_i
//   (weight=mean), with c_i the count it already stands for (round(exp(log_count))). The
//   importance weights are used only when every member's score is finite and >= 0 and their sum
//   is finite and positive (attention-mass scorers: snapkv, h2o, tova); otherwise (key-norm
//   scores, -inf from ams) the core falls back to the count-weighted mean. Count-weighting
//   makes weight=mean consistent across events: a core merged again averages the original
//   tokens it stands for. Means are taken in fp64 and rounded to the cache type once.
// - Counts add: log_count of a core = log(sum of member counts), so sum over rows of count is
//   the number of tokens the cache represents, across any number of events.
// - Keys are merged post-RoPE, as the engine stores them; a core's position is its kept row's.
// - Rows (layer, KV head) are independent work items, so a core never mixes heads or layers and
//   results are bit-identical for any thread count. Cost per row: O(sum over chunks of kept
//   seeds x chunk length x head_dim).
// - The rule's arithmetic (chunk ends, the cosine decision, the weight rule, unfused fp64 sums,
//   counts) lives in gsc_row.hpp as KVP_HD functions, shared with the CUDA kernel
//   (cuda/merge.cu, cuda/merge.hpp), which gives bit-identical results.
#pragma once
#include <cmath>
#include <cstring>
#include <string>
#include <string_view>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/core/topk_key.hpp"
#include "kvpolicy/cpu/fwd.hpp"
#include "kvpolicy/mergers/common.hpp"
#include "kvpolicy/mergers/gsc_row.hpp"

namespace kvpolicy {

// How the members of a core are weighted (both also by the counts they already carry).
enum class MergeWeight : std::uint8_t { importance, mean };

struct Semantic {
  static constexpr std::string_view name = "semantic";
  static constexpr std::size_t max_delimiters = 15;
  static constexpr double cos_slack = gsc::cos_slack;

  float tau = 0.9f;         // cosine threshold in [-1, 1]
  std::int64_t chunk = 32;  // fixed chunk length (no mask) or cap (with a mask); 0: no cap
  MergeWeight weight = MergeWeight::importance;
  // Characters that make a token a delimiter (for the engine's mask), NUL-terminated.
  char delimiters[max_delimiters + 1] = {'.', ',', ';', ':', '!', '?', '\n', '\0'};

  void validate() const {
    KVP_REQUIRE(tau >= -1.f && tau <= 1.f, "semantic: tau must be in [-1, 1], got ", tau);
    KVP_REQUIRE(chunk >= 0, "semantic: chunk must be >= 0 (0: chunks end at delimiters only), got ",
                chunk);
    KVP_REQUIRE(chunk > 0 || delimiters[0] != '\0',
                "semantic: no delimiters and chunk=0 leave no way to cut chunks; give chunk > 0 "
                "or a delimiter set");
  }

  // Spec parameters: tau (default 0.9), chunk (32), weight=importance|mean, delimiters (the
  // characters; escapes \n \t \s (space) \c (',') \p ('|') \\, since ',' and '|' separate spec
  // parameters and stages; `none` or empty: no delimiters).
  static Semantic from_params(Params& p) {
    Semantic s;
    const double tau = p.get_double("tau", 0.9);
    // Checked before narrowing, so that 1.00000001 is not rounded into range.
    KVP_REQUIRE(tau >= -1.0 && tau <= 1.0, "semantic: tau must be in [-1, 1], got ", tau);
    s.tau = static_cast<float>(tau);
    s.chunk = p.get_int("chunk", s.chunk);
    s.weight = p.get_choice("weight", "importance", {"importance", "mean"}) == "mean"
                   ? MergeWeight::mean
                   : MergeWeight::importance;
    if (p.contains("delimiters")) s.set_delimiters(p.get_string("delimiters", ""));
    s.validate();
    return s;
  }

  void set_delimiters(std::string_view text) {
    std::string out;
    if (text != "none")
      for (std::size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '\\') {
          out += text[i];
          continue;
        }
        KVP_REQUIRE(i + 1 < text.size(), "semantic: delimiters '", text, "' end with '\\'");
        const char e = text[++i];
        const char* from = "ntscp\\";
        const char* to = "\n\t ,|\\";
        const char* at = std::strchr(from, e);
        KVP_REQUIRE(e != '\0' && at != nullptr, "semantic: unknown escape '\\", e,
                    "' in delimiters (valid: \\n \\t \\s \\c \\p \\\\)");
        out += to[at - from];
      }
    KVP_REQUIRE(out.size() <= max_delimiters, "semantic: at most ", max_delimiters,
                " delimiter characters, got ", out.size());
    std::memset(delimiters, 0, sizeof delimiters);
    std::memcpy(delimiters, out.data(), out.size());
  }

  // True if a token's text contains a delimiter character (how the engine builds the mask).
  bool is_delimiter(std::string_view token_text) const {
    for (char c : token_text)
      if (c != '\0' && std::strchr(delimiters, c) != nullptr) return true;
    return false;
  }

  Needs needs() const { return Needs::keys | Needs::values; }

  template <Element T>
  void merge(const cpu_backend& be, const MergeArgs<T>& a) const {
    validate();
    merge_detail::validate(a, name, true);
    KVP_REQUIRE(a.delimiter != nullptr || chunk > 0,
                "semantic: chunk must be > 0 when no delimiter mask is given, got ", chunk);
    const std::int64_t H = a.keys.heads;
    KVP_REQUIRE(!(a.chunk_end != nullptr && a.chunk_end == a.delimiter &&
                  a.delimiter_stride == 0 && a.keys.layers * H > 1),
                "semantic: chunk_end may alias the delimiter mask only when it is per row "
                "(delimiter_stride > 0)");
    cpu::parallel_for(be, a.keys.layers * H,
                      [&](std::int64_t r) { merge_row(a, r / H, r % H); });
  }

 private:
  // Scratch of one row's work item.
  struct Scratch {
    std::vector<merge_detail::Role> roles;
    std::vector<std::int32_t> cand;   // the chunk's candidates, best score first
    std::vector<std::int32_t> owner;  // position in cand of the seed that took it, or -1
    std::vector<double> keys, norm2;  // candidates' keys [n][d] and squared norms, fp64
  };

  template <Element T>
  void merge_row(const MergeArgs<T>& a, std::int64_t l, std::int64_t h) const {
    const std::int64_t Tk = a.keys.tokens, r = l * a.keys.heads + h;
    Scratch s;
    merge_detail::row_roles(Tk, a.protect, a.selection->kept(l, h), s.roles);
    const bool evicts = a.selection->count(l, h) < Tk;
    const std::uint8_t* delim =
        a.delimiter ? a.delimiter + (a.delimiter_stride > 0 ? r * a.delimiter_stride : 0) : nullptr;
    std::uint8_t* ends =
        a.chunk_end ? a.chunk_end + r * (a.chunk_end_stride > 0 ? a.chunk_end_stride : Tk) : nullptr;
    merge_detail::RowAccumulator<T> acc(a.keys.dim);
    std::int64_t start = 0;
    for (std::int64_t j = 0; j < Tk; ++j) {
      if (!gsc::ends_chunk(delim, chunk, start, j, Tk)) continue;
      // delim[start..j] has been read, so writing ends[start..j] is safe when they alias.
      if (ends)
        gsc::mark_chunk_end(reinterpret_cast<const std::uint8_t*>(s.roles.data()), start, j, ends);
      if (evicts) merge_chunk(a, l, h, start, j + 1, s, acc);
      start = j + 1;
    }
  }

  // GSC over tokens [b, e) of row (l, h), then one core per kept seed that absorbed something.
  template <Element T>
  void merge_chunk(const MergeArgs<T>& a, std::int64_t l, std::int64_t h, std::int64_t b,
                   std::int64_t e, Scratch& s, merge_detail::RowAccumulator<T>& acc) const {
    using merge_detail::Role;
    const auto score = a.scores->row(l, h);
    auto role = [&](std::int32_t j) { return s.roles[static_cast<std::size_t>(j)]; };
    s.cand.clear();
    std::int64_t kept_left = 0, evicted = 0;
    for (std::int64_t j = b; j < e; ++j) {
      const Role rj = s.roles[static_cast<std::size_t>(j)];
      if (rj == Role::protected_) continue;
      s.cand.push_back(static_cast<std::int32_t>(j));
      (rj == Role::kept ? kept_left : evicted) += 1;
    }
    if (kept_left == 0 || evicted == 0) return;
    std::sort(s.cand.begin(), s.cand.end(), [&](std::int32_t x, std::int32_t y) {
      return topk_key(score[static_cast<std::size_t>(x)], x) >
             topk_key(score[static_cast<std::size_t>(y)], y);
    });
    const std::size_t n = s.cand.size(), d = static_cast<std::size_t>(a.keys.dim);
    s.keys.resize(n * d);
    s.norm2.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      double* k = s.keys.data() + i * d;
      merge_detail::load_row(a.keys, l, h, s.cand[i], k);
      double q = 0;
      for (std::size_t x = 0; x < d; ++x) q = gsc::add_product(q, k[x], k[x]);
      s.norm2[i] = q;
    }
    s.owner.assign(n, -1);
    for (std::size_t i = 0; i < n && kept_left > 0; ++i) {
      if (s.owner[i] >= 0) continue;
      s.owner[i] = static_cast<std::int32_t>(i);
      if (role(s.cand[i]) == Role::kept) --kept_left;
      for (std::size_t m = i + 1; m < n; ++m)
        if (s.owner[m] < 0 && role(s.cand[m]) == Role::evicted && similar(s, i, m, d))
          s.owner[m] = static_cast<std::int32_t>(i);
    }
    for (std::size_t i = 0; i < n; ++i)
      if (s.owner[i] == static_cast<std::int32_t>(i) && role(s.cand[i]) == Role::kept)
        write_core(a, l, h, i, s, acc);
  }

  bool similar(const Scratch& s, std::size_t i, std::size_t m, std::size_t d) const {
    const double ni = s.norm2[i], nm = s.norm2[m];
    double dot = 0;
    if (ni != 0.0 && nm != 0.0) {
      const double* x = s.keys.data() + i * d;
      const double* y = s.keys.data() + m * d;
      for (std::size_t k = 0; k < d; ++k) dot = gsc::add_product(dot, x[k], y[k]);
    }
    return gsc::similar(dot, ni, nm, tau);
  }

  template <Element T>
  void write_core(const MergeArgs<T>& a, std::int64_t l, std::int64_t h, std::size_t seed,
                  const Scratch& s, merge_detail::RowAccumulator<T>& acc) const {
    const std::int64_t r = l * a.keys.heads + h;
    float* lc = a.log_count + r * merge_detail::log_count_stride(a);
    const auto score = a.scores->row(l, h);
    const auto me = static_cast<std::int32_t>(seed);
    // Members in candidate order (the seed first): a fixed order, so sums are reproducible.
    gsc::CoreStats st;
    st.importance = weight == MergeWeight::importance;
    for (std::size_t m = 0; m < s.owner.size(); ++m) {
      if (s.owner[m] != me) continue;
      const std::int32_t j = s.cand[m];
      gsc::core_stats_add(st, m == seed, score[static_cast<std::size_t>(j)],
                          merge_detail::count_of(lc[j]));
    }
    if (!st.any) return;
    const bool importance = gsc::core_uses_importance(st);
    acc.reset();
    for (std::size_t m = 0; m < s.owner.size(); ++m) {
      if (s.owner[m] != me) continue;
      const std::int32_t j = s.cand[m];
      const double c = merge_detail::count_of(lc[j]);
      acc.add(a, l, h, j, gsc::member_weight(importance, c, score[static_cast<std::size_t>(j)]),
              c, true);
    }
    acc.write(a, l, h, s.cand[seed], true, lc);
  }
};

static_assert(Merger<Semantic>);

}  // namespace kvpolicy
