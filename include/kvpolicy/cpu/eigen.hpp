// Eigen/Core, included through one place. GCC 12 with AVX-512 enabled (-march=native on such a
// CPU) reports -Wmaybe-uninitialized inside its own avx512fintrin.h (_mm512_undefined_ps's
// self-initialised `__Y`, GCC bug 105593, fixed in GCC 13) wherever Eigen's packet transposes
// are inlined. The warning's location is in that intrinsics header, which is first included
// from here: ignoring the warning across this include silences exactly those reports and no
// warning of the project's own code. Every kvpolicy file includes Eigen through this header.
#pragma once
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <Eigen/Core>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
