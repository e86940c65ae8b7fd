// The randomized Session soak (issue 19, long runs): a Session driven for many steps next to a
// shadow model of what it must hold, keyed by original position. Used by test_soak.cpp; the
// pieces live here so that the test file reads as the run's plan.
//
// Per step, every layer: append (one token or a chunk; queries and delimiter flags as the policy
// needs them), attend with the new queries, compress_if_due, then compare the whole state with
// the shadow. Invariants, from session.hpp, quant/*.hpp and the stage headers:
//   - positions ascending and unique per (layer, head); an event keeps a subset of the rows and
//     new tokens arrive at the end;
//   - events and lengths exactly as SessionConfig says: prefill keeps min(len, budget) per head
//     (without layer/head allocators), decode events happen when decode_interval tokens came in
//     and a head is over its target, and bring every head to min(len, target); so after the
//     prefill every length stays in [target, target + interval) once it has reached the target;
//     budgets(l) are the prefill's kept counts (or the requested budget where nothing was evicted)
//     and switch to decode_target at the first due check;
//   - every event keeps the protected tokens (Policy::protect), streaming keeps its sinks and the
//     newest rows, H2O keeps the protected rows plus the highest accumulators;
//   - K/V rows bit-identical to the appended tokens at their positions, except rows whose merge
//     count grew at an event (a merged row then stays bit-identical until the next event);
//   - H2O accumulators: carried bit-exactly by events (row i after = the row of its position
//     before), and each attend() adds the reference attention of the new queries to the row of
//     the right position (fp64 reference, fp32 tolerance);
//   - merge counts: integers, never shrinking for a kept row, the growth of a chunk's counts at
//     most the counts evicted from it (exactly them for nearest and for semantic with tau = -1),
//     new tokens at count 1, no counts without a merger; chunk-end flags exactly as semantic
//     writes them; AMS credit never below lambda times its previous value;
//   - packed caches (int2/int4/kivi): sizes and bytes by the packing formula; each tile, when it
//     appears, decodes within half a quantization step per element of the stored form of the
//     (pre-quantization) row at its position, and its bytes never change afterwards; residual
//     rows equal the stored form; decode() within the L2 bound the block scales give; attention
//     over the packed cache equals attention over its decoded rows;
//   - storage: capacity follows the documented doubling exactly, kv_bytes() matches the lengths
//     (or the packed caches), so memory is bounded by the longest head ever (see test_soak.cpp for
//     the plateau over a long run).
// A failed check throws SoakFailure with the seed, the step and the session, so that
// KVPOLICY_SOAK_SEED / KVPOLICY_SOAK_STEPS reproduce it.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvpolicy/kvpolicy.hpp>

#include "common/random.hpp"

namespace kvtest::soak {

using kvpolicy::Budget;
using kvpolicy::KVView;
using kvpolicy::Policy;
using kvpolicy::Session;
using kvpolicy::SessionConfig;

// ---- Where the run is, and failures ---------------------------------------------------------

struct Where {
  std::uint64_t seed = 0;
  std::int64_t steps = 0, step = 0;
};

class SoakFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <class... A>
[[noreturn]] void fail(const Where& w, const std::string& session, const A&... what) {
  std::ostringstream os;
  os << "soak (seed " << w.seed << ", " << w.steps << " steps) failed at step " << w.step
     << ", session " << session << ": ";
  (os << ... << what);
  os << "\n  rerun: KVPOLICY_SOAK_SEED=" << w.seed << " KVPOLICY_SOAK_STEPS=" << w.steps
     << " kvpolicy_tests '[soak]'";
  throw SoakFailure(os.str());
}

// What the run did, for the report and for checking that every path was exercised.
struct Counters {
  std::int64_t sessions = 0, forks = 0, session_steps = 0, tokens = 0, shrinks = 0;
  std::int64_t prefill_events = 0, decode_events = 0, evicted = 0, merged_rows = 0;
  std::int64_t acc_checks = 0, attend_checks = 0, h2o_exact = 0, streaming_exact = 0;
  std::int64_t tiles_checked = 0, decode_checks = 0, delimiter_rewrites = 0, credit_checks = 0;
  std::map<std::string, std::int64_t> chain_sessions, chain_events;
};

// ---- What a policy implies for the checks, read from the Policy itself ------------------------

enum class MergerKind { none, semantic, nearest };

struct Plan {
  std::string chain;  // stage names, e.g. "snapkv|ams|semantic"
  std::string spec;
  std::string twin_spec;         // the spec without its quantizer (quantizing policies only)
  std::int64_t min_budget = 0;   // smallest budget that covers what every event protects
  bool h2o = false, h2o_exact = false;  // h2o_exact: the kept set follows from the accumulators
  std::int64_t streaming_sinks = -1;    // >= 0: streaming without ams (exact kept set)
  bool head_alloc = false;              // pyramid, depthkv or adakv split the prefill budget
  bool ams = false;
  double ams_lambda = 0;
  MergerKind merger = MergerKind::none;
  double tau = 0;
  std::int64_t chunk = 0;
  bool masks = false;  // every append passes delimiter flags
  std::optional<kvpolicy::quant::QuantConfig> quant;
};

inline Plan analyze(const std::string& chain, const std::string& spec, bool masks) {
  const Policy p(spec);
  Plan plan;
  plan.chain = chain;
  plan.spec = p.spec();
  plan.masks = masks;
  if (const auto* h = std::get_if<kvpolicy::H2O>(&p.scorer())) {
    plan.h2o = true;
    plan.h2o_exact = !h->normalize;
  }
  if (const auto* st = std::get_if<kvpolicy::Streaming>(&p.scorer())) plan.streaming_sinks = st->sinks;
  for (const auto& a : p.allocators()) {
    if (const auto* ams = std::get_if<kvpolicy::AMS>(&a)) {
      plan.ams = true;
      plan.ams_lambda = ams->lambda;
    } else if (!std::holds_alternative<kvpolicy::Uniform>(a)) {
      plan.head_alloc = true;
    }
  }
  if (plan.ams) plan.h2o_exact = false, plan.streaming_sinks = -1;  // ams masks the scores
  if (p.merger()) {
    if (const auto* s = std::get_if<kvpolicy::Semantic>(&*p.merger())) {
      plan.merger = MergerKind::semantic;
      plan.tau = s->tau;
      plan.chunk = s->chunk;
    } else {
      plan.merger = MergerKind::nearest;
    }
  }
  plan.quant = p.quant_config();
  if (plan.quant) plan.twin_spec = plan.spec.substr(0, plan.spec.rfind(" | "));
  // The smallest budget b from which every larger budget covers the protected tokens (h2o's
  // recent window is a fraction of the budget, so probe a range).
  auto covers = [&](std::int64_t b) { return p.protect(1 << 20, b).total(1 << 20) <= b; };
  std::int64_t b = 0;
  for (std::int64_t x = 0; x < 400; ++x)
    if (!covers(x)) b = x + 1;
  plan.min_budget = b;
  return plan;
}

// ---- Random tokens with some structure (repeated keys to merge, a heavy direction per head) --

template <class T>
struct TokenBlock {
  std::int64_t n = 0, hkv = 0, hq = 0, d = 0;
  std::vector<T> k, v, q;           // [Hkv][n][d], [Hkv][n][d], [Hq][n][d] (HND)
  std::vector<std::uint8_t> flags;  // n delimiter flags
  KVView<const T> K() const { return KVView<const T>::hnd(k.data(), 1, hkv, n, d); }
  KVView<const T> V() const { return KVView<const T>::hnd(v.data(), 1, hkv, n, d); }
  KVView<const T> Q() const { return KVView<const T>::hnd(q.data(), 1, hq, n, d); }
  const T* k_row(std::int64_t h, std::int64_t t) const { return k.data() + (h * n + t) * d; }
  const T* v_row(std::int64_t h, std::int64_t t) const { return v.data() + (h * n + t) * d; }
};

class TokenSource {
 public:
  TokenSource(std::uint64_t seed, std::int64_t layers, std::int64_t hkv, std::int64_t hq,
              std::int64_t d)
      : rng_(seed), hkv_(hkv), hq_(hq), d_(d) {
    dir_.resize(static_cast<std::size_t>(layers * hkv * d));
    for (auto& x : dir_) x = rng_.normal();
    last_ = dir_;
  }

  template <class T>
  TokenBlock<T> next(std::int64_t layer, std::int64_t n, double flag_rate) {
    TokenBlock<T> b;
    b.n = n, b.hkv = hkv_, b.hq = hq_, b.d = d_;
    b.k.resize(static_cast<std::size_t>(hkv_ * n * d_));
    b.v.resize(b.k.size());
    b.q.resize(static_cast<std::size_t>(hq_ * n * d_));
    const std::int64_t g = hq_ / hkv_;
    for (std::int64_t h = 0; h < hkv_; ++h) {
      float* last = last_.data() + (layer * hkv_ + h) * d_;
      const float* dir = dir_.data() + (layer * hkv_ + h) * d_;
      for (std::int64_t t = 0; t < n; ++t) {
        const double u = rng_.uniform(0.0, 1.0);
        const float scale = static_cast<float>(std::exp(0.5 * rng_.normal()));
        for (std::int64_t i = 0; i < d_; ++i) {
          float x;
          if (u < 0.2) x = last[i];                                // the same key again
          else if (u < 0.3) x = last[i] + 0.05f * rng_.normal();   // nearly the same
          else x = 0.7f * dir[i] + scale * rng_.normal();
          // Stored as T: the shadow compares the values the session received.
          b.k[static_cast<std::size_t>((h * n + t) * d_ + i)] = kvpolicy::from_float<T>(x);
          last[i] = kvpolicy::to_float(b.k[static_cast<std::size_t>((h * n + t) * d_ + i)]);
          b.v[static_cast<std::size_t>((h * n + t) * d_ + i)] = kvpolicy::from_float<T>(rng_.normal());
        }
        for (std::int64_t qi = 0; qi < g; ++qi)
          for (std::int64_t i = 0; i < d_; ++i)
            b.q[static_cast<std::size_t>(((h * g + qi) * n + t) * d_ + i)] =
                kvpolicy::from_float<T>(0.8f * dir[i] + 1.2f * rng_.normal());
      }
    }
    b.flags.resize(static_cast<std::size_t>(n));
    for (auto& f : b.flags) f = rng_.uniform(0.0, 1.0) < flag_rate ? 1 : 0;
    return b;
  }

 private:
  Rng rng_;
  std::int64_t hkv_, hq_, d_;
  std::vector<float> dir_, last_;  // [layers][Hkv][d]
};

// ---- Reference attention (fp64) ---------------------------------------------------------------

// One KV head's rows as fp32, [len][d], and their logit bias.
struct HeadRows {
  std::int64_t len = 0;
  std::vector<float> k, v, bias;
};

// out [Hq][n][d]: causal attention of the block's queries over each KV head's rows (the newest n
// rows are the block's own tokens); colsum[h][j] (optional) += the probabilities of row j
// summed over the head's query group and the n queries.
template <class T>
std::vector<double> reference_attention(const std::vector<HeadRows>& heads,
                                        const TokenBlock<T>& b,
                                        std::vector<std::vector<double>>* colsum) {
  const std::int64_t d = b.d, g = b.hq / b.hkv, n = b.n;
  std::vector<double> out(static_cast<std::size_t>(b.hq * n * d), 0.0), p;
  if (colsum) colsum->assign(heads.size(), {});
  for (std::int64_t h = 0; h < b.hkv; ++h) {
    const HeadRows& r = heads[static_cast<std::size_t>(h)];
    if (colsum) (*colsum)[static_cast<std::size_t>(h)].assign(static_cast<std::size_t>(r.len), 0.0);
    for (std::int64_t qh = h * g; qh < (h + 1) * g; ++qh)
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t vis = std::clamp<std::int64_t>(r.len - n + i + 1, 0, r.len);
        if (vis == 0) continue;
        const T* q = b.q.data() + (qh * n + i) * d;
        p.assign(static_cast<std::size_t>(vis), 0.0);
        double mx = -1e300;
        for (std::int64_t j = 0; j < vis; ++j) {
          double s = 0;
          for (std::int64_t e = 0; e < d; ++e)
            s += static_cast<double>(kvpolicy::to_float(q[e])) * r.k[static_cast<std::size_t>(j * d + e)];
          p[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(d)) + r.bias[static_cast<std::size_t>(j)];
          mx = std::max(mx, p[static_cast<std::size_t>(j)]);
        }
        double sum = 0;
        for (auto& x : p) sum += (x = std::exp(x - mx));
        double* o = out.data() + (qh * n + i) * d;
        for (std::int64_t j = 0; j < vis; ++j) {
          const double w = p[static_cast<std::size_t>(j)] / sum;
          for (std::int64_t e = 0; e < d; ++e) o[e] += w * r.v[static_cast<std::size_t>(j * d + e)];
          if (colsum) (*colsum)[static_cast<std::size_t>(h)][static_cast<std::size_t>(j)] += w;
        }
      }
  }
  return out;
}

// ---- Stored form of the quantizers (quant/quantizer.hpp), in fp64 ----------------------------

// x <- H x / sqrt(d), Sylvester order (quant/hadamard.hpp), by the plain butterfly recursion.
inline void hadamard(std::vector<double>& x) {
  const std::size_t d = x.size();
  for (std::size_t half = 1; half < d; half *= 2)
    for (std::size_t b = 0; b < d; b += 2 * half)
      for (std::size_t j = b; j < b + half; ++j) {
        const double s = x[j] + x[j + half], t = x[j] - x[j + half];
        x[j] = s, x[j + half] = t;
      }
  const double f = 1.0 / std::sqrt(static_cast<double>(d));
  for (auto& v : x) v *= f;
}

// One row's stored form: K~ = H k / ||k|| (norm 1 without token_norm), V~ = H v.
struct StoredRow {
  std::vector<double> k, v;
  double norm = 1;
};

template <class T>
StoredRow stored_form(const kvpolicy::quant::QuantConfig& c, const T* k, const T* v,
                      std::int64_t d) {
  StoredRow r;
  r.k.resize(static_cast<std::size_t>(d));
  r.v.resize(static_cast<std::size_t>(d));
  for (std::int64_t i = 0; i < d; ++i) {
    r.k[static_cast<std::size_t>(i)] = kvpolicy::to_float(k[i]);
    r.v[static_cast<std::size_t>(i)] = kvpolicy::to_float(v[i]);
  }
  if (c.rotate) hadamard(r.k), hadamard(r.v);
  if (c.token_norm) {
    double n2 = 0;
    for (double x : r.k) n2 += x * x;
    r.norm = std::sqrt(n2);
    if (r.norm > 0)
      for (auto& x : r.k) x /= r.norm;
  }
  return r;
}

// A block of the packed format (quant/block.hpp): fp32 scale, fp32 zero, then the codes, value i
// in byte i / (8 / bits) from bit (i % (8 / bits)) * bits, low bits first.
struct BlockRef {
  float scale = 0, zero = 0;
  const std::byte* qs = nullptr;
  int bits = 0;
  static std::size_t bytes(int bits, int group) { return 8 + static_cast<std::size_t>(group * bits / 8); }
  static BlockRef at(const std::byte* base, std::size_t i, int bits, int group) {
    BlockRef b;
    const std::byte* p = base + i * bytes(bits, group);
    std::memcpy(&b.scale, p, 4);
    std::memcpy(&b.zero, p + 4, 4);
    b.qs = p + 8;
    b.bits = bits;
    return b;
  }
  double value(int i) const {
    const int per = 8 / bits;
    const unsigned byte = std::to_integer<unsigned>(qs[i / per]);
    const unsigned code = (byte >> ((i % per) * bits)) & ((1u << bits) - 1u);
    return (static_cast<double>(code) - zero) * scale;
  }
};

}  // namespace kvtest::soak
