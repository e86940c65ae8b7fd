// libFuzzer target: the DepthKV layer profile parser, kvpolicy::parse_layer_profile(json, where)
// (include/kvpolicy/allocators/profile.hpp), on arbitrary bytes.
//
// Contracts checked on a profile it accepts (profile.hpp):
// - "sensitivity" lists at least one layer and every value is finite and >= 0;
// - the values and the printable "model"/"scorer" names survive a round trip: written back as
//   JSON (%.17g numbers) and parsed again, they are the same;
// - the depthkv allocator accepts the profile exactly when it has at most DepthKV::kMaxLayers
//   layers and every value fits a float, and then holds every value as a finite float.
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

std::string to_json(const kvpolicy::LayerProfile& p) {
  std::string out = "{\"model\": \"" + p.model + "\", \"scorer\": \"" + p.scorer +
                    "\", \"layers\": " + std::to_string(p.sensitivity.size()) +
                    ", \"sensitivity\": [";
  char buf[40];
  for (std::size_t i = 0; i < p.sensitivity.size(); ++i) {
    std::snprintf(buf, sizeof buf, "%s%.17g", i ? ", " : "", p.sensitivity[i]);
    out += buf;
  }
  return out + "]}";
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

  if (plain(p.model) && plain(p.scorer)) {
    kvpolicy::LayerProfile q;
    const std::string written = to_json(p);
    try {
      q = kvpolicy::parse_layer_profile(written, "round trip");
    } catch (const kvpolicy::Error& e) {
      finding("its own profile written back does not parse: %s (%s)", e.what(), written.c_str());
    }
    if (q.sensitivity != p.sensitivity || q.model != p.model || q.scorer != p.scorer)
      finding("round trip changed the profile: %s", written.c_str());
  }

  bool fits = static_cast<std::int64_t>(p.sensitivity.size()) <= kvpolicy::DepthKV::kMaxLayers;
  for (double v : p.sensitivity) fits = fits && v <= std::numeric_limits<float>::max();
  try {
    const kvpolicy::DepthKV d = kvpolicy::DepthKV::from_profile(p, "fuzz.json");
    if (!fits)
      finding("depthkv took %zu layers (at most %lld) or a value above the float range",
              p.sensitivity.size(), static_cast<long long>(kvpolicy::DepthKV::kMaxLayers));
    for (std::int64_t l = 0; l < d.layers; ++l)
      if (!std::isfinite(d.sensitivity[static_cast<std::size_t>(l)]))
        finding("depthkv holds sensitivity %g (profile %.17g) at layer %lld",
                static_cast<double>(d.sensitivity[static_cast<std::size_t>(l)]),
                p.sensitivity[static_cast<std::size_t>(l)], static_cast<long long>(l));
  } catch (const kvpolicy::Error& e) {
    if (fits) finding("depthkv rejected an accepted profile: %s", e.what());
  }
  return 0;
}
