// D (delta.cuh) by itself, where no dQ kernel runs to work it out
// (TC_FUSED_DQ): one warp per row, each lane summing the columns lane,
// lane + 32, ... (delta_share), so that no temporary dO * O is stored.

extern "C" __global__ void npattn_backward_d(const tile_t* __restrict__ dout,  // (rows, Hv)
                                             const scalar_t* __restrict__ out,  // (rows, Hv)
                                             const scalar_t* __restrict__ dlse,  // (rows,) or null
                                             scalar_t* __restrict__ D,           // (rows,)
                                             const Config config) {
  const long long rows = config.B * config.N * config.T;
  const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool real = r < rows;  // every thread takes part in the shuffles
  scalar_t sum = real ? delta_share<32>(dout + r * VALUE_DIM, out + r * VALUE_DIM, lane) : (scalar_t)0;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (real && lane == 0) D[r] = dlse ? sum - dlse[r] : sum;
}
