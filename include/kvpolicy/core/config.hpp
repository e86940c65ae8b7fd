// Portability macros shared by the host headers and the CUDA sources.
#pragma once

#if defined(__CUDACC__)
#define KVP_HD __host__ __device__
#else
#define KVP_HD
#endif

// Lanes of a CUDA warp, as the kernels and their host emulations (row math) use them.
namespace kvpolicy {
inline constexpr int kWarpLanes = 32;
}

#define KVP_STRINGIFY_IMPL(x) #x
#define KVP_STRINGIFY(x) KVP_STRINGIFY_IMPL(x)
