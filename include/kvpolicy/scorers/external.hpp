// External: a scorer implemented outside the library (a C ABI plug-in, later a Python callable)
// that a Policy accepts in place of a built-in scorer. Policy("mine | adakv", plugins) looks the
// first stage up among the built-ins, then among `plugins` by name; allocators, selection and
// compaction then run exactly as for a built-in scorer.
//
// Choices:
// - The inputs cross the boundary type-erased (TensorRef: pointer, dtype, extents, strides in
//   elements), in the caller's element type: no conversion copy of the cache for the plug-in.
// - The plug-in states what it reads (needs, query window) and its protected tokens (first
//   `sinks`, last `recent`) up front, like a built-in scorer's protect().
// - The callback fills a contiguous fp32 [L][Hkv][T] buffer. A non-finite score is rejected
//   (PluginError naming the plug-in and the first bad entry): the selection would otherwise
//   depend on NaN ordering.
// - State is shared: copies of an External (copies of the Policy) call the same callbacks. A
//   stateful plug-in that is used from several threads must be cloned by its owner (the C ABI's
//   kvp_policy_clone calls the plug-in's clone). Callbacks run on the calling thread, never on
//   OpenMP workers.
#pragma once
#include <cmath>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kvpolicy/core/backend.hpp"
#include "kvpolicy/core/inputs.hpp"

namespace kvpolicy {

// What an external scorer sees: keys always; values and queries when it asked for them and the
// caller gave them (data == nullptr otherwise); H2O-style accumulated attention if present.
struct ExternalInputs {
  TensorRef keys, values, queries;
  const float* accumulated = nullptr;
  std::int64_t state_stride = 0;  // elements between (layer, head) rows of `accumulated`
};

// Raised when an external scorer fails or returns unusable scores (the C ABI maps it to
// KVP_ERROR_PLUGIN).
class PluginError : public Error {
 public:
  using Error::Error;
};

class External {
 public:
  // Name used in diagnostics of the generic pipeline; scorer_name() gives the plug-in's own.
  static constexpr std::string_view name = "external";

  // Fills `scores` ([L][Hkv][T] row-major, higher = keep); throws on failure.
  using ScoreFn = std::function<void(const ExternalInputs&, std::span<float> scores)>;

  struct Spec {
    std::string name;  // the spec-string name: [a-z0-9_]+, not a built-in stage's
    Needs needs = Needs::keys;
    std::int64_t query_window = 0;  // queries it reads: 0 none, n the last n, -1 all given
    Protect protect;                // tokens it always keeps
    ScoreFn score;
  };

  explicit External(Spec spec) {
    KVP_REQUIRE(!spec.name.empty(), "external scorer: empty name");
    for (char c : spec.name)
      KVP_REQUIRE((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_',
                  "external scorer '", spec.name,
                  "': names use lowercase letters, digits and '_' (they appear in spec strings)");
    KVP_REQUIRE(static_cast<bool>(spec.score), "external scorer '", spec.name,
                "': no score function");
    KVP_REQUIRE(spec.protect.sinks >= 0 && spec.protect.recent >= 0, "external scorer '",
                spec.name, "': negative protected counts (sinks ", spec.protect.sinks,
                ", recent ", spec.protect.recent, ")");
    KVP_REQUIRE(spec.query_window >= -1, "external scorer '", spec.name, "': query_window ",
                spec.query_window, " (use -1 for every query, 0 for none)");
    if (spec.query_window != 0) spec.needs = spec.needs | Needs::queries;
    spec.needs = spec.needs | Needs::keys;
    impl_ = std::make_shared<const Spec>(std::move(spec));
  }

  const std::string& plugin_name() const { return impl_->name; }
  Needs needs() const { return impl_->needs; }
  std::int64_t query_window() const { return impl_->query_window; }
  Protect protect(std::int64_t, std::int64_t) const { return impl_->protect; }

  template <Element T>
  void score(const cpu_backend&, const Inputs<T>& in, Stats&, ScoreMap& out) const {
    const std::int64_t L = in.layers(), H = in.kv_heads(), Tk = in.tokens();
    out.resize(L, H, Tk, std::nanf(""));  // a callback that skips entries is caught below
    ExternalInputs x;
    x.keys = erase(in.keys);
    if (has(impl_->needs, Needs::values) && in.values.data) x.values = erase(in.values);
    if (in.queries.data) {
      KVView<const T> q = in.queries;
      if (impl_->query_window > 0 && q.tokens > impl_->query_window) {
        q.data = q.row(0, 0, q.tokens - impl_->query_window);
        q.tokens = impl_->query_window;
      }
      x.queries = erase(q);
    }
    x.accumulated = in.accumulated;
    x.state_stride = in.state_row_stride();
    const std::size_t n = static_cast<std::size_t>(L * H * Tk);
    impl_->score(x, std::span<float>(out.data(), n));
    for (std::size_t i = 0; i < n; ++i)
      if (!std::isfinite(out.data()[i])) {
        const auto r = static_cast<std::int64_t>(i) / Tk;
        throw PluginError(std::string("external scorer '") + impl_->name +
                          "' returned a non-finite score at layer " + std::to_string(r / H) +
                          ", head " + std::to_string(r % H) + ", token " +
                          std::to_string(static_cast<std::int64_t>(i) % Tk));
      }
  }

 private:
  std::shared_ptr<const Spec> impl_;
};

}  // namespace kvpolicy
