// Definitions of every CPU op that the stage headers declare through cpu/fwd.hpp. Included by
// registry.hpp and pipeline.hpp; a program that runs a stage's CPU member from the stage header
// alone includes this too.
#pragma once
#include "kvpolicy/cpu/expected.hpp"
#include "kvpolicy/cpu/nearest.hpp"
#include "kvpolicy/cpu/window_attention.hpp"
