// Seeded random test data: kvtest::Rng lives in random_kv.hpp (one definition for the whole test
// executable); this header is kept for the files that include it by this name.
#pragma once
#include "common/random_kv.hpp"
