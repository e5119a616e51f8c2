// The backward's first step (FlashAttention-2's preprocessing), for both
// kinds of kernels:
//
//     D_r = rowsum(dO_r * O_r) - dlse_r     (dlse null: 0)
//
// over the B N T rows of VALUE_DIM entries, dO as the kernels read it (tile_t)
// and O in scalar_t; the products summed in scalar_t, by each lane over the
// columns lane, lane + 32, ... and then over the warp (the same order on
// every run). One warp per row, so that no temporary dO * O is stored.

extern "C" __global__ void npattn_backward_d(const tile_t* __restrict__ dout,  // (rows, Hv)
                                             const scalar_t* __restrict__ out,  // (rows, Hv)
                                             const scalar_t* __restrict__ dlse,  // (rows,) or null
                                             scalar_t* __restrict__ D,           // (rows,)
                                             const Config config) {
  const long long rows = config.B * config.N * config.T;
  const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool real = r < rows;  // every thread takes part in the shuffles
  scalar_t sum = 0;
  for (int c = lane; real && c < VALUE_DIM; c += 32)
    sum += (scalar_t)entry_value(dout[r * VALUE_DIM + c]) * out[r * VALUE_DIM + c];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (real && lane == 0) D[r] = dlse ? sum - dlse[r] : sum;
}
