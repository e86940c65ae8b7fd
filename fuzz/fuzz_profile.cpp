// libFuzzer target: the DepthKV layer profile parser, kvpolicy::parse_layer_profile(json, where)
// (include/kvpolicy/allocators/profile.hpp), on arbitrary bytes.
//
// Contracts checked on a profile it accepts (profile.hpp):
// - "sensitivity" lists at least one layer and every value is finite and >= 0; loss curves, when
//   present, have ascending budgets in (0, 1) and one row per layer of one finite loss >= 0 per
//   budget;
// - the values, the curves and the printable "model"/"scorer" names survive a round trip:
//   written back as JSON (%.17g numbers) and parsed again, they are the same;
// - the depthkv allocator accepts the profile exactly when it has at most DepthKV::kMaxLayers
//   layers, at most DepthKV::kMaxKnots curve budgets that stay strictly ascending inside (0, 1)
//   as floats, and every value fits a float, and then holds every value as a finite float.
// Rejections must be kvpolicy::Error; anything else, a crash or a sanitizer report, is a finding.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "fuzz_common.hpp"
#include "kvpolicy/allocators/depthkv.hpp"
#include "kvpolicy/allocators/profile.hpp"
#include "kvpolicy/core/error.hpp"

using kvp_fuzz::finding;

namespace {

// Names with nothing a JSON writer would escape, so both the reader and the writer below agree.
bool plain(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c >= 0x7F || c == '"' || c == '\\') return false;
  return true;
}

std::string numbers(const std::vector<double>& v) {
  std::string out = "[";
  char buf[40];
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s%.17g", i ? ", " : "", v[i]);
    out += buf;
  }
  return out + "]";
}

std::string to_json(const kvpolicy::LayerProfile& p) {
  std::string out = "{\"model\": \"" + p.model + "\", \"scorer\": \"" + p.scorer +
                    "\", \"layers\": " + std::to_string(p.sensitivity.size()) +
                    ", \"sensitivity\": " + numbers(p.sensitivity);
  if (!p.curve_budgets.empty()) {
    out += ", \"curve_budgets\": " + numbers(p.curve_budgets) + ", \"curves\": [";
    for (std::size_t l = 0; l < p.curves.size(); ++l) out += (l ? ", " : "") + numbers(p.curves[l]);
    out += "]";
  }
  return out + "}";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  kvpolicy::LayerProfile p;
  try {
    p = kvpolicy::parse_layer_profile(json, "fuzz.json");
  } catch (const kvpolicy::Error&) {
    return 0;
  }
  if (p.sensitivity.empty()) finding("accepted a profile without layers");
  for (std::size_t l = 0; l < p.sensitivity.size(); ++l)
    if (!std::isfinite(p.sensitivity[l]) || p.sensitivity[l] < 0)
      finding("accepted sensitivity %g at layer %zu", p.sensitivity[l], l);
  for (std::size_t k = 0; k < p.curve_budgets.size(); ++k)
    if (!(p.curve_budgets[k] > 0 && p.curve_budgets[k] < 1) ||
        (k > 0 && !(p.curve_budgets[k] > p.curve_budgets[k - 1])))
      finding("accepted curve budget %g at %zu", p.curve_budgets[k], k);
  if (!p.curve_budgets.empty() && p.curves.size() != p.sensitivity.size())
    finding("accepted %zu loss curves for %zu layers", p.curves.size(), p.sensitivity.size());
  for (const auto& row : p.curves) {
    if (row.size() != p.curve_budgets.size())
      finding("accepted a loss curve of %zu points for %zu budgets", row.size(),
              p.curve_budgets.size());
    for (double v : row)
      if (!std::isfinite(v) || v < 0) finding("accepted loss %g", v);
  }

  if (plain(p.model) && plain(p.scorer)) {
    kvpolicy::LayerProfile q;
    const std::string written = to_json(p);
    try {
      q = kvpolicy::parse_layer_profile(written, "round trip");
    } catch (const kvpolicy::Error& e) {
      finding("its own profile written back does not parse: %s (%s)", e.what(), written.c_str());
    }
    if (q.sensitivity != p.sensitivity || q.model != p.model || q.scorer != p.scorer ||
        q.curve_budgets != p.curve_budgets || q.curves != p.curves)
      finding("round trip changed the profile: %s", written.c_str());
  }

  bool fits = static_cast<std::int64_t>(p.sensitivity.size()) <= kvpolicy::DepthKV::kMaxLayers &&
              static_cast<std::int64_t>(p.curve_budgets.size()) <= kvpolicy::DepthKV::kMaxKnots;
  for (double v : p.sensitivity) fits = fits && v <= std::numeric_limits<float>::max();
  // The allocator holds the curve budgets as floats: they must stay inside (0, 1), ascending.
  for (std::size_t k = 0; k < p.curve_budgets.size(); ++k) {
    const auto bf = static_cast<float>(p.curve_budgets[k]);
    fits = fits && bf > 0 && bf < 1 && (k == 0 || bf > static_cast<float>(p.curve_budgets[k - 1]));
  }
  for (const auto& row : p.curves)
    for (double v : row) fits = fits && v <= std::numeric_limits<float>::max();
  try {
    const kvpolicy::DepthKV d = kvpolicy::DepthKV::from_profile(p, "fuzz.json");
    if (!fits)
      finding("depthkv took %zu layers (at most %lld), %zu curve budgets (at most %lld) or a "
              "value above the float range",
              p.sensitivity.size(), static_cast<long long>(kvpolicy::DepthKV::kMaxLayers),
              p.curve_budgets.size(), static_cast<long long>(kvpolicy::DepthKV::kMaxKnots));
    for (std::int64_t l = 0; l < d.layers; ++l)
      if (!std::isfinite(d.sensitivity[static_cast<std::size_t>(l)]))
        finding("depthkv holds sensitivity %g (profile %.17g) at layer %lld",
                static_cast<double>(d.sensitivity[static_cast<std::size_t>(l)]),
                p.sensitivity[static_cast<std::size_t>(l)], static_cast<long long>(l));
    for (std::int64_t i = 0; i < d.layers * kvpolicy::DepthKV::kMaxKnots; ++i)
      if (!std::isfinite(d.loss[static_cast<std::size_t>(i)]))
        finding("depthkv holds loss %g at entry %lld",
                static_cast<double>(d.loss[static_cast<std::size_t>(i)]),
                static_cast<long long>(i));
    if (d.n_knots != static_cast<std::int64_t>(p.curve_budgets.size()) ||
        (d.rule == kvpolicy::DepthKV::Rule::marginal) != !p.curve_budgets.empty())
      finding("depthkv holds %lld curve budgets of %zu", static_cast<long long>(d.n_knots),
              p.curve_budgets.size());
  } catch (const kvpolicy::Error& e) {
    if (fits) finding("depthkv rejected an accepted profile: %s", e.what());
  }
  return 0;
}
