// float16 conversions, for both kinds of kernels (entries.cuh): PTX's cvt.
// The CPU tests replace this file with the same functions in C++
// (tests/cuda_emulator/half.h).

// float16 bits of x, rounded to nearest even.
__device__ __forceinline__ unsigned short half_bits(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}

// The float32 value of float16 bits (exact).
__device__ __forceinline__ float half_value(unsigned short bits) {
  float x;
  asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(bits));
  return x;
}
