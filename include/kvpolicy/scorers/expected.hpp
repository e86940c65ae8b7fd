// Expected attention (kvpress ExpectedAttentionPress; arXiv 2510.00636). A key's score is the
// attention that future queries are expected to give it, modelled from the statistics of the
// recent queries, times its value's norm. It needs no question and works at decode time.
//
// Per query head, from the given queries (the last `window`):
//  1. mean mu and covariance Sigma (divided by the count) of the queries as they would be at the
//     next position P; the queries of the sequence's first `sinks` positions are left out
//     (outliers; positions from Inputs::first_query_position, else the cache's own);
//  2. the RoPE rotation averaged over the next `future` positions, Rbar = mean_{j<future} R(j),
//     applied as mu <- Rbar mu, Sigma <- Rbar Sigma Rbar^T;
//  3. z_j = mu.k_j / sqrt(d) + k_j^T Sigma k_j / (2 d) (the log of the Gaussian moment-generating
//     function of q.k_j / sqrt(d)), softmax over the non-sink keys j;
//  4. mean over the query heads of the KV head's group, then (a_j + eps) * ||v_j||.
// The first `sinks` keys are protected and get the layer's highest score + 1, as in kvpress
// (over every rank's heads under tensor parallelism, core/head_shard.hpp).
// Defaults follow kvpress: future=512, sinks=4, cov=true, vnorm=true, eps=0.
// Device path: cuda/expected.hpp (same host setup(), per-thread math in expected_row.hpp; the
// scores equal these to fp32 rounding of the logits, head_dim up to 256).
//
// [ours] Post-RoPE queries, relative rotation. kvpress takes pre-RoPE queries from the hidden
// states and rotates their statistics to absolute positions P..P+future-1. The library receives
// post-RoPE queries of the positions P-n..P-1, so it rotates query i by R(n - i) to position P
// first, then by Rbar. Rotations compose (R(P+j) R(-p) = R(j) R(P-p)), so the statistics are
// the same, and so are the scores.
// [ours] The query window. kvpress uses every prefill query; a Session keeps only the newest
// `window` (default 1024) in its ring, which also serves decode-time compression. With a window at
// least the prompt's length the scores equal kvpress's. The given queries must be those of the
// last n_q positions, the newest one just before the next token (a Session's ring is; callers of
// Policy::select must pass them so): the rotation uses their offsets.
// [ours] RoPE. The rotation is Hugging Face's half-split one (pairs (i, i + d/2)) with inverse
// frequencies inv_freq[i] = theta^(-2i/d). `theta` in the spec sets them; otherwise the scorer
// takes Inputs::rope_inv_freq, which an engine supplies (SessionConfig::rope_inv_freq; the
// reference engine fills it, Llama-3.1 frequency factors included). Without either it refuses.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvpolicy/core/params.hpp"
#include "kvpolicy/scorers/common.hpp"
#include "kvpolicy/scorers/expected_row.hpp"

namespace kvpolicy {

// Inverse RoPE frequencies theta^(-2i/d), i < d/2, as Hugging Face computes them (the exponent
// 2i/d in fp32, the power, then 1 / it in fp32); the reference engine uses this too.
inline std::vector<float> rope_inv_freq(double theta, std::int64_t head_dim) {
  std::vector<float> f(static_cast<std::size_t>(head_dim / 2));
  for (std::size_t i = 0; i < f.size(); ++i) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    f[i] = 1.0f / static_cast<float>(std::pow(theta, static_cast<double>(expo)));
  }
  return f;
}

struct ExpectedAttention {
  static constexpr std::string_view name = "expected";
  static constexpr bool spans_heads = true;  // the sinks' score is the layer's maximum + 1
  static constexpr std::int64_t kBlock = 256;  // keys per GEMM block
  std::int64_t window = 1024;  // newest queries whose statistics model the future ones
  std::int64_t future = 512;   // future positions the rotation is averaged over (<= 65536)
  std::int64_t sinks = 4;      // first tokens: protected, and their queries left out
  bool cov = true;             // use the covariance term
  bool vnorm = true;           // multiply by ||v||
  double eps = 0.0;            // added to the attention before the value norm
  double theta = 0.0;          // RoPE base; 0: Inputs::rope_inv_freq

  void validate() const {
    KVP_REQUIRE(window >= 1, "expected: window must be >= 1, got ", window);
    KVP_REQUIRE(future >= 1 && future <= 65536, "expected: future must be in [1, 65536], got ",
                future);
    KVP_REQUIRE(sinks >= 0, "expected: sinks must be >= 0, got ", sinks);
    KVP_REQUIRE(std::isfinite(eps) && eps >= 0, "expected: eps must be finite and >= 0, got ", eps);
    KVP_REQUIRE(theta == 0 || (std::isfinite(theta) && theta > 1),
                "expected: theta (the RoPE base) must be > 1, got ", theta);
  }
  static ExpectedAttention from_params(Params& p) {
    ExpectedAttention s;
    s.window = p.get_int("window", s.window);
    s.future = p.get_int("future", s.future);
    s.sinks = p.get_int("sinks", s.sinks);
    s.cov = p.get_bool("cov", s.cov);
    s.vnorm = p.get_bool("vnorm", s.vnorm);
    s.eps = p.get_double("eps", s.eps);
    s.theta = p.get_double("theta", s.theta);
    s.validate();
    return s;
  }

  Needs needs() const { return vnorm ? Needs::keys | Needs::values | Needs::queries
                                     : Needs::keys | Needs::queries; }
  std::int64_t query_window() const { return window; }
  Protect protect(std::int64_t, std::int64_t) const { return {sinks, 0}; }

  // What the CPU stage and the CUDA kernels (cuda/expected.hpp) compute on the host before
  // touching a key: the checks, the frequencies, the queries used and the averaged rotation.
  struct Setup {
    std::vector<float> inv_freq;     // [d/2]
    std::int64_t nq = 0;             // the newest nq queries are read: q0 = q.tokens - nq
    std::int64_t skip = 0;           // of them, the first `skip` are sinks' queries, left out
    std::vector<double> cbar, sbar;  // Rbar = [[cbar, -sbar], [sbar, cbar]] per pair, [d/2]
  };
  template <Element T>
  Setup setup(const Inputs<T>& in) const {
    validate();
    const auto& k = in.keys;
    const auto& q = in.queries;
    const std::int64_t L = k.layers, H = k.heads, Tk = k.tokens, d = k.dim;
    KVP_REQUIRE(q.data && q.tokens > 0, "expected: needs the recent queries");
    KVP_REQUIRE(q.dim == d && q.layers == L && q.heads % H == 0 && q.heads > 0,
                "expected: queries [", q.layers, ", ", q.heads, ", ", q.tokens, ", ", q.dim,
                "] do not match keys [", L, ", ", H, ", ", Tk, ", ", d, "]");
    KVP_REQUIRE(d % 2 == 0, "expected: head_dim must be even for RoPE, got ", d);
    KVP_REQUIRE(!vnorm || (in.values.data && in.values.tokens == Tk && in.values.dim == d),
                "expected: vnorm=true needs the values");
    Setup s;
    if (theta > 0) {
      s.inv_freq = rope_inv_freq(theta, d);
    } else {
      KVP_REQUIRE(!in.rope_inv_freq.empty(),
                  "expected: needs the model's RoPE frequencies: give theta=<rope base> in the "
                  "spec, or run it where the engine supplies them (SessionConfig::rope_inv_freq)");
      KVP_REQUIRE(static_cast<std::int64_t>(in.rope_inv_freq.size()) == d / 2, "expected: ",
                  in.rope_inv_freq.size(), " RoPE frequencies for head_dim ", d, " (want ", d / 2,
                  ")");
      s.inv_freq.assign(in.rope_inv_freq.begin(), in.rope_inv_freq.end());
      for (std::size_t i = 0; i < s.inv_freq.size(); ++i)
        KVP_REQUIRE(std::isfinite(s.inv_freq[i]), "expected: RoPE frequency ", i, " is ",
                    s.inv_freq[i], " (frequencies must be finite)");
    }
    const std::int64_t half = d / 2;
    s.nq = std::min(window, q.tokens);
    // Absolute position of the first query used (the newest sits just before the next token);
    // query i of the window sits at first_pos + i and is a sink's below `sinks`.
    const std::int64_t first_pos =
        (in.first_query_position >= 0 ? in.first_query_position + q.tokens : Tk) - s.nq;
    // clamp(sinks - first_pos, 0, nq), without overflow for any sinks >= 0
    s.skip = sinks <= first_pos ? 0 : sinks - s.nq >= first_pos ? s.nq : sinks - first_pos;
    // Averaged future rotation per frequency.
    s.cbar.resize(static_cast<std::size_t>(half));
    s.sbar.resize(s.cbar.size());
    for (std::int64_t f = 0; f < half; ++f) {
      double c = 0, sn = 0;
      for (std::int64_t j = 0; j < future; ++j) {
        const double a = row_math::rope_angle(j, s.inv_freq[static_cast<std::size_t>(f)]);
        c += std::cos(a);
        sn += std::sin(a);
      }
      s.cbar[static_cast<std::size_t>(f)] = c / static_cast<double>(future);
      s.sbar[static_cast<std::size_t>(f)] = sn / static_cast<double>(future);
    }
    return s;
  }

  template <Element T>
  void score(const cpu_backend& be, const Inputs<T>& in, Stats&, ScoreMap& out) const {
    const Setup st = setup(in);
    const auto& k = in.keys;
    const auto& q = in.queries;
    const std::int64_t L = k.layers, H = k.heads, Tk = k.tokens, d = k.dim;
    const std::int64_t half = d / 2, nq = st.nq, q0 = q.tokens - nq;
    // The rotation of query i to position P, R(nq - i), per frequency (shared by every head).
    std::vector<double> qcos(static_cast<std::size_t>(nq * half)), qsin(qcos.size());
    for (std::int64_t i = st.skip; i < nq; ++i)
      for (std::int64_t f = 0; f < half; ++f) {
        const double a = row_math::rope_angle(nq - i, st.inv_freq[static_cast<std::size_t>(f)]);
        qcos[static_cast<std::size_t>(i * half + f)] = std::cos(a);
        qsin[static_cast<std::size_t>(i * half + f)] = std::sin(a);
      }
    const std::int64_t group = q.heads / H;
    const std::int64_t s_end = std::min(sinks, Tk);  // protected keys [0, s_end)
    out.resize(L, H, Tk);
    cpu::parallel_for(be, L * H, [&](std::int64_t r) {
      const std::int64_t l = r / H, h = r % H;
      const auto ud = static_cast<std::size_t>(d);
      std::vector<double> mu(ud), sig(ud * ud), rows;
      std::vector<float> muf(ud), sigf(ud * ud);
      std::vector<double> acc(static_cast<std::size_t>(Tk), 0.0), z(static_cast<std::size_t>(Tk));
      const std::int64_t n = nq - st.skip;  // queries whose statistics are taken
      if (n > 0)
        for (std::int64_t g = 0; g < group; ++g) {
          const std::int64_t hq = h * group + g;
          // 1. statistics of the queries rotated to position P (query i sits at P - (nq - i)).
          rows.assign(static_cast<std::size_t>(n * d), 0.0);
          std::fill(mu.begin(), mu.end(), 0.0);
          for (std::int64_t i = st.skip; i < nq; ++i) {
            double* qi = rows.data() + (i - st.skip) * d;
            for (std::int64_t f = 0; f < half; ++f) {
              const auto at = static_cast<std::size_t>(i * half + f);
              row_math::rope_pair(to_float(q.at(l, hq, q0 + i, f)),
                                  to_float(q.at(l, hq, q0 + i, f + half)), qcos[at], qsin[at],
                                  qi[f], qi[f + half]);
            }
            for (std::size_t e = 0; e < ud; ++e) mu[e] += qi[e];
          }
          for (auto& m : mu) m /= static_cast<double>(n);
          if (cov)  // Sigma = Xc^T Xc / n, Xc the centred rotated queries (a double GEMM)
            cpu::centered_gram(rows.data(), n, d, mu.data(), sig.data());
          // 2. Rbar mu and Rbar Sigma Rbar^T.
          for (std::int64_t e = 0; e < d; ++e)
            muf[static_cast<std::size_t>(e)] = static_cast<float>(row_math::rotate_component(
                [&](std::int64_t a) { return mu[static_cast<std::size_t>(a)]; }, half,
                st.cbar.data(), st.sbar.data(), e));
          if (cov)
            for (std::int64_t e = 0; e < d; ++e)
              for (std::int64_t f = 0; f < d; ++f)
                sigf[static_cast<std::size_t>(e * d + f)] = static_cast<float>(
                    row_math::rotate_sigma_entry(sig.data(), d, st.cbar.data(), st.sbar.data(), e, f));
          // 3. log-MGF logits and their softmax over the non-sink keys, in blocks of keys:
          // lin = K mu and quad_j = k_j . (Sigma k_j) = rowsum(K .* (K Sigma)) (Sigma symmetric),
          // two fp32 GEMMs per block.
          const double inv_sqrt_d = 1.0 / std::sqrt(static_cast<double>(d));
          const double zmax = cpu::key_logits(k, l, h, s_end, Tk, kBlock, muf.data(),
                                              cov ? sigf.data() : nullptr, inv_sqrt_d,
                                              2.0 * static_cast<double>(d), z.data());
          double sum = 0;
          for (std::int64_t j = s_end; j < Tk; ++j) {
            auto& v = z[static_cast<std::size_t>(j)];
            v = std::exp(v - zmax);
            sum += v;
          }
          for (std::int64_t j = s_end; j < Tk; ++j)
            acc[static_cast<std::size_t>(j)] += z[static_cast<std::size_t>(j)] / sum;
        }
      // 4. group mean, value norm. (No query left after the sinks': every weight is 0.)
      auto dst = out.row(l, h);
      for (std::int64_t j = s_end; j < Tk; ++j) {
        const double n2 = vnorm ? row_math::value_sqnorm(
                                      [&](std::int64_t e) { return to_float(in.values.at(l, h, j, e)); }, d)
                                : 0.0;
        dst[j] = row_math::expected_finish(acc[static_cast<std::size_t>(j)], group, vnorm, eps, n2);
      }
    });
    // The sinks: the layer's highest score + 1 (kvpress pads them with max + 1); under tensor
    // parallelism the highest over every rank's heads (4 bytes per layer exchanged).
    if (s_end > 0) {
      std::vector<float> top(static_cast<std::size_t>(L), 0.f);
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t j = s_end; j < Tk; ++j)
            top[static_cast<std::size_t>(l)] = std::max(top[static_cast<std::size_t>(l)], out.row(l, h)[j]);
      if (detail::sharded(in.shard)) {
        const std::vector<float> all = detail::all_gather(*in.shard, std::span<const float>(top));
        for (std::size_t i = 0; i < all.size(); ++i)
          top[i % top.size()] = std::max(top[i % top.size()], all[i]);
      }
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t j = 0; j < s_end; ++j) out.row(l, h)[j] = top[static_cast<std::size_t>(l)] + 1.0f;
    }
  }
};

}  // namespace kvpolicy
