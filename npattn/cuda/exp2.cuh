// 2^x in float64 for the tensor-core kernels' softmax (PRECISION_F64), in
// about half the instructions of libdevice's exp2 (Tang's table method):
//
//     2^x = 2^n 2^(j/16) 2^r,   k = rint(16 x) = 16 n + j  (0 <= j < 16),
//                               r = x - k / 16  in [-1/32, 1/32],
//
//     2^r - 1 = sum_{i=1..7} (r ln 2)^i / i!   (the Taylor polynomial; the
//               first term left out, (ln 2 / 32)^8 / 8!, is below 2^-59)
//
// with 2^(j/16) from a 16-entry table in shared memory: 128 bytes, one bank
// pair per entry, so that a warp's 32 lookups never conflict. The product
// 2^(j/16) (1 + (2^r - 1)) is one fma, and 2^n is added to its exponent
// field. Error: within 1.1 ulp (the table's and the fma's roundings, 0.5
// ulp each; tests/test_fast_cupy.py measures it); results below
// 2^-1022 (x < -1022) are flushed to 0, 2^x for x >= 1024 is inf, and NaN
// stays NaN.
//
// libdevice's exp2 takes 44 instructions a call in the float64 forward's
// loop (12 of them DFMA): about half of the forward's and dQ's loops, a
// quarter of dK/dV's (benchmarks/count_sass.py). The float32 kernels take ex2.approx
// (ptx.cuh's fast_exp2).
//
// A kernel that calls fast_exp2(double) first calls load_exp2_table(),
// with every thread of its block.

#if PRECISION == PRECISION_F64

// 2^(j / 16), j = 0 .. 15, correctly rounded (tests/test_fast_cupy.py
// checks them against 60-digit decimals).
__constant__ double EXP2_SIXTEENTHS[16] = {
    0x1.0000000000000p+0, 0x1.0b5586cf9890fp+0, 0x1.172b83c7d517bp+0, 0x1.2387a6e756238p+0,
    0x1.306fe0a31b715p+0, 0x1.3dea64c123422p+0, 0x1.4bfdad5362a27p+0, 0x1.5ab07dd485429p+0,
    0x1.6a09e667f3bcdp+0, 0x1.7a11473eb0187p+0, 0x1.8ace5422aa0dbp+0, 0x1.9c49182a3f090p+0,
    0x1.ae89f995ad3adp+0, 0x1.c199bdd85529cp+0, 0x1.d5818dcfba487p+0, 0x1.ea4afa2a490dap+0,
};

// (ln 2)^i / i!, i = 1 .. 7, correctly rounded (in constant memory, where
// an fma reads them as operands; as literals, each would take two moves).
__constant__ double EXP2_TAYLOR[7] = {
    0x1.62e42fefa39efp-1, 0x1.ebfbdff82c58fp-3, 0x1.c6b08d704a0c0p-5, 0x1.3b2ab6fba4e77p-7,
    0x1.5d87fe78a6731p-10, 0x1.430912f86c787p-13, 0x1.ffcbfc588b0c7p-17,
};

__shared__ double exp2_sixteenths[16];

// Copy the table into this block's shared memory (every thread calls it).
__device__ __forceinline__ void load_exp2_table() {
  for (int j = threadIdx.x; j < 16; j += blockDim.x) exp2_sixteenths[j] = EXP2_SIXTEENTHS[j];
  __syncthreads();
}

__device__ __forceinline__ double fast_exp2(double x) {
  const double shifter = 0x1.8p52;  // 1.5 * 2^52: adding it rounds to an integer, held in the low bits
  const double shifted = fma(x, 16.0, shifter);
  const int k = __double2loint(shifted);              // rint(16 x), two's complement
  const double r = fma(shifted - shifter, -0.0625, x);  // x - k / 16, exact
  double q = EXP2_TAYLOR[6];  // 2^r - 1, by Horner's rule
#pragma unroll
  for (int i = 5; i >= 0; --i) q = fma(q, r, EXP2_TAYLOR[i]);
  q *= r;
  const double fraction = exp2_sixteenths[k & 15];
  const double y = fma(fraction, q, fraction);  // 2^(j/16 + r), in [2^(-1/32), 2^(31/32)]
  // * 2^n, on the exponent field (unsigned: no overflow where x is out of range and the result unused)
  const unsigned high = (unsigned)__double2hiint(y) + ((unsigned)(k >> 4) << 20);
  const double result = __hiloint2double((int)high, __double2loint(y));
  if (x >= -1022.0 && x < 1024.0) return result;
  return x < -1022.0 ? 0.0 : x + __longlong_as_double(0x7ff0000000000000LL);  // 0, inf, or NaN
}

#else

__device__ __forceinline__ void load_exp2_table() {}

#endif
