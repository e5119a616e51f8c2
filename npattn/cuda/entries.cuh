// Entries of the arrays the kernels read and write, for both kinds of
// kernels. q, k, v and dO are read, and dQ, dK, dV written, as tile_t: the
// caller's float16 as it is (its 16 bits, with OPERANDS_F16 = 1:
// npattn.fast_cupy.operand_dtype, no float32 copies), else the compute
// dtype scalar_t. out, lse and D are in scalar_t, and every sum runs in it.
//
// Compile-time constants: scalar_t, OPERANDS_F16 (0 or 1).

#if OPERANDS_F16
typedef unsigned short tile_t;  // float16 bits
#else
typedef scalar_t tile_t;
#endif

// An entry's value in the compute dtype (exact).
__device__ __forceinline__ float entry_value(float x) { return x; }
__device__ __forceinline__ double entry_value(double x) { return x; }
__device__ __forceinline__ float entry_value(unsigned short bits) { return half_value(bits); }

// *slot = x, rounded to nearest even into a float16 slot (as the caller's
// cast would round it).
__device__ __forceinline__ void store_entry(float* slot, float x) { *slot = x; }
__device__ __forceinline__ void store_entry(double* slot, double x) { *slot = x; }
__device__ __forceinline__ void store_entry(unsigned short* slot, float x) { *slot = half_bits(x); }
