// Runs the program named by argv[1] (with the rest of the arguments) on an x86-64-v4 CPU (AVX-512
// F/BW/CD/DQ/VL, AVX2, FMA, BMI), which it was compiled for (kvpolicy_tests_avx512); elsewhere
// prints the line ctest reads as Skipped. Built without those flags, so that it can tell.
#include <unistd.h>

#include <cstdio>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PROGRAM [ARGS...]\n", argv[0]);
    return 2;
  }
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                  __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
#else
  const bool ok = false;
#endif
  if (!ok) {
    std::puts("skipped: this CPU is not x86-64-v4");
    return 0;
  }
  execv(argv[1], argv + 1);
  std::perror("avx512_launcher: execv");
  return 1;
}
