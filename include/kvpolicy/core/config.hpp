// Portability macros shared by the host headers and the CUDA sources.
#pragma once

#if defined(__CUDACC__)
#define KVP_HD __host__ __device__
#else
#define KVP_HD
#endif

#define KVP_STRINGIFY_IMPL(x) #x
#define KVP_STRINGIFY(x) KVP_STRINGIFY_IMPL(x)
