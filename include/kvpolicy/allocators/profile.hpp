// DepthKV layer-sensitivity profiles: a small JSON file per model, written by the calibration
// tool (kvpolicy_calibrate) and read by the depthkv allocator (`depthkv(profile=path.json)`).
//   {"model": "SmolLM2-135M-Instruct", "scorer": "snapkv", "budget": 0.2, "metric": "kl",
//    "layers": 30, "sensitivity": [0.31, 0.12, ...],
//    "curve_budgets": [0.05, 0.1, 0.2], "curves": [[0.9, 0.5, 0.31], [0.4, 0.2, 0.12], ...]}
// Only "sensitivity" (one finite value >= 0 per layer, in layer order) is required; "layers", if
// present, must equal its length; "model" and "scorer" are kept when they are strings.
// Loss curves are optional and come as a pair: "curve_budgets" lists kept fractions, strictly
// ascending in (0, 1), and "curves" one row per layer (as many as "sensitivity"), each with one
// finite loss >= 0 per fraction: the layer's loss when it alone keeps that fraction. Every other
// key is ignored. The NaN / Infinity tokens that Python's json module writes are rejected with a
// message naming the layer rather than a syntax error.
//
// The reader is compiled code (src/profile/profile.cpp, CMake target kvpolicy_profile, which
// kvpolicy::kvpolicy links), so that these headers need no JSON library. Without CMake, compile
// that file with nlohmann-json 3 on the include path.
#pragma once
#include <string>
#include <vector>

namespace kvpolicy {

struct LayerProfile {
  std::string model, scorer;
  std::vector<double> sensitivity;
  std::vector<double> curve_budgets;        // empty: no loss curves
  std::vector<std::vector<double>> curves;  // [layer][budget], when curve_budgets is not empty
};

// Parses a profile's text; `where` names it in error messages. Throws kvpolicy::Error.
LayerProfile parse_layer_profile(const std::string& json, const std::string& where);
// Reads and parses the file at `path`. Throws kvpolicy::Error.
LayerProfile load_layer_profile(const std::string& path);

}  // namespace kvpolicy
