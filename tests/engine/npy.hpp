// Reads a float32 .npy file (tests/engine/npy.cpp; kept out of the unity batches, see there).
#pragma once
#include <string>

#include <xtensor/xarray.hpp>

namespace kvp_engine_test {

xt::xarray<float> load_npy_f32(const std::string& path);

}  // namespace kvp_engine_test
