// The engine tests' .npy goldens, read with xtensor. Its .npy header parser uses std::regex, and
// GCC 12 at -O1 with the sanitizers reports a false -Wmaybe-uninitialized inside libstdc++'s
// regex automaton (std::function's move, GCC bug 105562). This file is the one place that
// includes <xtensor/xnpy.hpp>, so tests/CMakeLists.txt turns that warning off here only.
#include "engine/npy.hpp"

#include <xtensor/xnpy.hpp>

namespace kvp_engine_test {

xt::xarray<float> load_npy_f32(const std::string& path) { return xt::load_npy<float>(path); }

}  // namespace kvp_engine_test
