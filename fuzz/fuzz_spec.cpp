// libFuzzer target: kvpolicy::Policy(spec) on arbitrary text, then the parsed policy once on a
// tiny random cache, so that every parameter value the parser accepts is also run.
//
// Input: the spec is the bytes before the first NUL (all of them without one); the bytes after
// it choose the cache (shapes, values, queries, budget, H2O statistics). With a policy:
// - its canonical spec() must parse again to the same spec;
// - a selection-only policy compresses a dense cache (Policy::compress), and the selection must
//   be valid (ascending indices inside the cache, one list per (layer, head));
// - every policy drives a Session<float>: prefill append, compression, attention, a few decode
//   steps (decode-time eviction, merging, quantization).
// Rejections must be kvpolicy::Error; anything else, a crash or a sanitizer report is a finding.
// A session is skipped for a query window of 2^16 .. 2^62 tokens: its query ring would take
// that much memory, legitimately (see kvp_fuzz::window_too_large_to_back).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_common.hpp"
#include "kvpolicy/policy.hpp"
#include "kvpolicy/session.hpp"

using namespace kvpolicy;
using kvp_fuzz::finding;

namespace {

struct Shape {
  std::int64_t L, H, g, T, d, nq;
};

Shape pick_shape(FuzzedDataProvider& fdp) {
  static constexpr std::int64_t kDims[] = {1, 2, 3, 4, 8, 16, 32, 64};
  Shape s;
  s.L = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  s.H = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  s.g = fdp.ConsumeIntegralInRange<std::int64_t>(1, 3);
  s.T = fdp.ConsumeIntegralInRange<std::int64_t>(0, 40);
  s.d = kDims[fdp.ConsumeIntegralInRange<std::size_t>(0, std::size(kDims) - 1)];
  s.nq = fdp.ConsumeIntegralInRange<std::int64_t>(0, s.T);
  return s;
}

Budget pick_budget(FuzzedDataProvider& fdp, std::int64_t T) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: return Budget::ratio(kvp_fuzz::pick_double(fdp, 0.0, 1.0));
    case 1: return Budget::tokens(kvp_fuzz::pick_int(fdp, 0, T + 2));
    default: return Budget::total(kvp_fuzz::pick_int(fdp, 0, 4 * (T + 2)));
  }
}

std::vector<float> tensor(FuzzedDataProvider& fdp, kvp_fuzz::Rng& rng, std::int64_t n,
                          bool allow_nonfinite) {
  const kvp_fuzz::Fill f = kvp_fuzz::pick_fill(fdp, allow_nonfinite);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = kvp_fuzz::fill_value(f, rng, i);
  return v;
}

void check_selection(const Selection& sel, std::int64_t L, std::int64_t H, std::int64_t T,
                     const char* where) {
  if (sel.layers() != L || sel.heads() != H)
    finding("%s: selection is [%lld,%lld], the cache [%lld,%lld]", where,
            static_cast<long long>(sel.layers()), static_cast<long long>(sel.heads()),
            static_cast<long long>(L), static_cast<long long>(H));
  for (std::int64_t l = 0; l < L; ++l)
    for (std::int64_t h = 0; h < H; ++h) {
      const auto k = sel.kept(l, h);
      for (std::size_t i = 0; i < k.size(); ++i)
        if (k[i] < 0 || k[i] >= T || (i > 0 && k[i] <= k[i - 1]))
          finding("%s: row (%lld,%lld) keeps index %d at %zu (tokens %lld): not ascending in "
                  "range", where, static_cast<long long>(l), static_cast<long long>(h), k[i], i,
                  static_cast<long long>(T));
    }
}

// Policy::compress on a dense [L][H][T][d] cache (selection-only policies).
void run_dense(const Policy& p, FuzzedDataProvider& fdp, kvp_fuzz::Rng& rng) {
  const Shape s = pick_shape(fdp);
  const std::int64_t n = s.L * s.H * s.T * s.d;
  std::vector<float> k = tensor(fdp, rng, n, true), v = tensor(fdp, rng, n, false);
  std::vector<float> q = tensor(fdp, rng, s.L * s.H * s.g * s.nq * s.d, false);
  std::vector<float> acc, obs;
  const Layout lay = fdp.ConsumeBool() ? Layout::HND : Layout::NHD;
  const KVView<float> kv = KVView<float>::make(lay, k.data(), s.L, s.H, s.T, s.d);
  const KVView<float> vv = KVView<float>::make(lay, v.data(), s.L, s.H, s.T, s.d);
  Inputs<float> in;
  if (s.nq > 0 && fdp.ConsumeBool())
    in.queries = KVView<const float>::hnd(q.data(), s.L, s.H * s.g, s.nq, s.d);
  if (fdp.ConsumeBool()) {  // H2O statistics, as a session keeps them
    acc.resize(static_cast<std::size_t>(s.L * s.H * s.T));
    obs.resize(acc.size());
    for (std::size_t i = 0; i < acc.size(); ++i) {
      acc[i] = static_cast<float>(std::abs(rng.uniform())) * static_cast<float>(s.T);
      obs[i] = static_cast<float>(rng.next() % 8);
    }
    in.accumulated = acc.data();
    in.observed = fdp.ConsumeBool() ? obs.data() : nullptr;
    // The same buffer as context-reconstruction scores (kvzip reads any non-negative floats).
    if (fdp.ConsumeBool()) in.reconstruction = acc.data();
  }
  in.reduce = static_cast<GqaReduce>(fdp.ConsumeIntegralInRange<int>(0, 2));
  const Budget b = pick_budget(fdp, s.T);
  const cpu_backend be{1};
  try {
    const Selection sel = p.compress(be, kv, vv, in, b);
    check_selection(sel, s.L, s.H, s.T, "Policy::compress");
  } catch (const Error&) {
  }
}

// A Session<float>: prefill, compression, attention and a few decode steps.
void run_session(const Policy& p, FuzzedDataProvider& fdp, kvp_fuzz::Rng& rng) {
  const Shape s = pick_shape(fdp);
  SessionConfig c;
  c.layers = s.L;
  c.kv_heads = s.H;
  c.q_heads = s.H * s.g;
  c.head_dim = s.d;
  c.budget = pick_budget(fdp, s.T);
  c.initial_capacity = fdp.ConsumeIntegralInRange<std::int64_t>(1, 64);
  c.decode_interval = fdp.ConsumeIntegralInRange<std::int64_t>(0, 4);
  if (fdp.ConsumeBool()) c.decode_target = pick_budget(fdp, s.T);
  c.backend.threads = 1;
  const int steps = fdp.ConsumeIntegralInRange<int>(0, 6);
  try {
    Session<float> ses(p, c);
    auto feed = [&](std::int64_t layer, std::int64_t n) {
      const std::vector<float> k = tensor(fdp, rng, s.H * n * s.d, false);
      const std::vector<float> v = tensor(fdp, rng, s.H * n * s.d, false);
      const std::vector<float> q = tensor(fdp, rng, s.H * s.g * n * s.d, false);
      const auto kv = KVView<const float>::hnd(k.data(), 1, s.H, n, s.d);
      const auto vv = KVView<const float>::hnd(v.data(), 1, s.H, n, s.d);
      const auto qv = KVView<const float>::hnd(q.data(), 1, s.H * s.g, n, s.d);
      std::vector<std::uint8_t> delim;
      if (fdp.ConsumeBool())
        for (std::int64_t t = 0; t < n; ++t) delim.push_back(rng.next() % 4 == 0);
      ses.append(layer, kv, vv, fdp.ConsumeIntegralInRange<int>(0, 7) ? qv : KVView<const float>{},
                 delim);
      std::vector<float> out(static_cast<std::size_t>(s.H * s.g * n * s.d));
      ses.attend(layer, qv, out.data());
      ses.compress_if_due(layer);
      const auto len = ses.lengths(layer);
      for (std::int64_t h = 0; h < s.H; ++h) {
        const auto pos = ses.positions(layer, h);
        for (std::size_t i = 1; i < pos.size(); ++i)
          if (pos[i] <= pos[i - 1])
            finding("session: positions of (%lld,%lld) not ascending at %zu",
                    static_cast<long long>(layer), static_cast<long long>(h), i);
        if (static_cast<std::int64_t>(pos.size()) != len[static_cast<std::size_t>(h)])
          finding("session: %zu positions for length %lld", pos.size(),
                  static_cast<long long>(len[static_cast<std::size_t>(h)]));
      }
    };
    for (std::int64_t l = 0; l < s.L; ++l) feed(l, s.T);
    for (int i = 0; i < steps; ++i) feed(fdp.ConsumeIntegralInRange<std::int64_t>(0, s.L - 1), 1);
    (void)ses.kv_bytes();
  } catch (const Error&) {
  }
}

// Everything a parsed policy answers without a cache.
void run_queries(const Policy& p, FuzzedDataProvider& fdp) {
  (void)p.needs();
  (void)p.query_window();
  (void)p.scorer_name();
  (void)p.alloc_state();
  (void)p.decode_time();
  (void)p.quant_config();
  (void)p.quantizer_name();
  (void)p.delimiter_set();
  (void)p.is_delimiter(fdp.ConsumeRandomLengthString(8));
  const std::int64_t t = kvp_fuzz::pick_int(fdp, 0, 64);
  const Protect pr = p.protect(t, kvp_fuzz::pick_int(fdp, 0, 64));
  if (pr.sinks < 0 || pr.recent < 0)
    finding("protect(%lld): negative sinks %lld / recent %lld", static_cast<long long>(t),
            static_cast<long long>(pr.sinks), static_cast<long long>(pr.recent));
  (void)p.with_fixed_budgets().spec();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const std::size_t nul = std::min(all.find('\0'), size);
  const std::string_view spec = all.substr(0, nul);
  const std::size_t rest = nul < size ? nul + 1 : size;
  FuzzedDataProvider fdp(data + rest, size - rest);

  std::optional<Policy> p;
  try {
    p.emplace(spec);
  } catch (const Error&) {
    return 0;
  }
  // The canonical form is itself a spec for the same policy.
  try {
    const Policy again(p->spec());
    if (again.spec() != p->spec())
      finding("spec '%s' re-parses as '%s'", p->spec().c_str(), again.spec().c_str());
  } catch (const Error& e) {
    finding("canonical spec '%s' does not parse again: %s", p->spec().c_str(), e.what());
  }
  run_queries(*p, fdp);
  kvp_fuzz::Rng rng(fdp.ConsumeIntegral<std::uint64_t>());
  if (!p->merger() && !p->quantizer()) run_dense(*p, fdp, rng);
  if (!kvp_fuzz::window_too_large_to_back(p->query_window())) run_session(*p, fdp, rng);
  return 0;
}
