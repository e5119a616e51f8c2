// Flash-decoding's last step, for both kinds of kernels: the forward's SPLITS
// key ranges merged through their lse (npattn.merge.merge_partials'
// formula), in one launch:
//
//     m = max_s lse_s,   w_s = exp(lse_s - m),   l = sum_s w_s
//     O = sum_s w_s O_s / l,   lse = m + log l
//
// with O = 0 and lse = -inf where no range saw a key (every lse_s = -inf).
// One block of MERGE_THREADS per row of the B N T rows, so that its loads of
// the ranges are in flight together: thread t reduces the lse of ranges t,
// t + MERGE_THREADS, ..., then the block combines them; warp w sums w_s O_s
// over the ranges s = w, w + MERGE_WARPS, ..., its lanes over the columns,
// and the warps' sums are added in order (the same bits on every run).
// Where out_rounded is not null (float16 inputs), O is written there too,
// rounded to float16 as the caller's cast of `out` would round it
// (entries.cuh's store_entry): the call's output.

constexpr int MERGE_THREADS = 128;  // npattn/fast_cupy.py's MERGE_THREADS
constexpr int MERGE_WARPS = MERGE_THREADS / 32;
constexpr int MERGE_COLUMNS = (VALUE_DIM + 31) / 32;  // per lane

// x reduced over the block (the largest, or the sum), in one fixed order:
// over each warp's lanes, then the warps' results in order. Every thread
// of the block calls it and gets the result.
template <bool LARGEST>
__device__ __forceinline__ scalar_t merge_reduce(scalar_t x, scalar_t (&per_warp)[MERGE_WARPS]) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const scalar_t other = __shfl_xor_sync(0xffffffffu, x, offset);
    x = LARGEST ? max(x, other) : x + other;
  }
  if (threadIdx.x % 32 == 0) per_warp[threadIdx.x / 32] = x;
  __syncthreads();
  x = per_warp[0];
  for (int w = 1; w < MERGE_WARPS; ++w) x = LARGEST ? max(x, per_warp[w]) : x + per_warp[w];
  __syncthreads();  // per_warp is written again by the next call
  return x;
}

extern "C" __global__ void __launch_bounds__(MERGE_THREADS)
    npattn_merge_splits(const scalar_t* __restrict__ outs,  // (splits, rows, Hv)
                        const scalar_t* __restrict__ lses,  // (splits, rows)
                        scalar_t* __restrict__ out,         // (rows, Hv)
                        scalar_t* __restrict__ lse,         // (rows,)
                        tile_t* __restrict__ out_rounded,   // (rows, Hv) or null: O again, as tile_t
                        const Config config) {
  __shared__ scalar_t per_warp[MERGE_WARPS];
  __shared__ scalar_t sums[MERGE_WARPS][VALUE_DIM];
  const long long rows = config.B * config.N * config.T, r = blockIdx.x;
  const int splits = (int)config.splits, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const scalar_t minus_inf = negative_infinity((scalar_t)0);
  scalar_t m = minus_inf;
  for (int s = threadIdx.x; s < splits; s += MERGE_THREADS) m = max(m, lses[s * rows + r]);
  m = merge_reduce<true>(m, per_warp);
  if (m == minus_inf) {  // the same for the whole block
    for (int c = threadIdx.x; c < VALUE_DIM; c += MERGE_THREADS) {
      out[r * VALUE_DIM + c] = 0;
      if (out_rounded) store_entry(out_rounded + r * VALUE_DIM + c, (scalar_t)0);
    }
    if (threadIdx.x == 0) lse[r] = minus_inf;
    return;
  }
  scalar_t total = 0;
  for (int s = threadIdx.x; s < splits; s += MERGE_THREADS) total += fn_exp(lses[s * rows + r] - m);
  total = merge_reduce<false>(total, per_warp);
  scalar_t sum[MERGE_COLUMNS] = {};
#pragma unroll 4
  for (int s = warp; s < splits; s += MERGE_WARPS) {
    const scalar_t w = fn_exp(lses[s * rows + r] - m);
#pragma unroll
    for (int i = 0; i < MERGE_COLUMNS; ++i)
      if (const int c = lane + 32 * i; c < VALUE_DIM) sum[i] += w * outs[(s * rows + r) * VALUE_DIM + c];
  }
#pragma unroll
  for (int i = 0; i < MERGE_COLUMNS; ++i)
    if (const int c = lane + 32 * i; c < VALUE_DIM) sums[warp][c] = sum[i];
  __syncthreads();
  for (int c = threadIdx.x; c < VALUE_DIM; c += MERGE_THREADS) {
    scalar_t merged = sums[0][c];
    for (int w = 1; w < MERGE_WARPS; ++w) merged += sums[w][c];
    const scalar_t o = merged / total;
    out[r * VALUE_DIM + c] = o;
    if (out_rounded) store_entry(out_rounded + r * VALUE_DIM + c, o);
  }
  if (threadIdx.x == 0) lse[r] = m + fn_log(total);
}
