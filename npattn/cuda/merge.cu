// Flash-decoding's last step, for both kinds of kernels: the forward's SPLITS
// key ranges merged through their lse (npattn.merge.merge_partials'
// formula), in one launch:
//
//     m = max_s lse_s,   w_s = exp(lse_s - m),   l = sum_s w_s
//     O = sum_s w_s O_s / l,   lse = m + log l
//
// with O = 0 and lse = -inf where no range saw a key (every lse_s = -inf).
// One warp per row of the B N T rows, its lanes over the columns; the
// ranges summed in order (the same bits on every run).

extern "C" __global__ void npattn_merge_splits(const scalar_t* __restrict__ outs,  // (splits, rows, Hv)
                                               const scalar_t* __restrict__ lses,  // (splits, rows)
                                               scalar_t* __restrict__ out,         // (rows, Hv)
                                               scalar_t* __restrict__ lse,         // (rows,)
                                               const Config config) {
  const long long rows = config.B * config.N * config.T;
  const int splits = (int)config.splits;
  const long long r = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const scalar_t minus_inf = negative_infinity((scalar_t)0);
  scalar_t m = minus_inf;
  for (int s = 0; s < splits; ++s) m = max(m, lses[s * rows + r]);
  scalar_t total = 0;
  for (int s = 0; s < splits && m != minus_inf; ++s) total += fn_exp(lses[s * rows + r] - m);
  for (int c = lane; c < VALUE_DIM; c += 32) {
    scalar_t sum = 0;
    for (int s = 0; s < splits && m != minus_inf; ++s)
      sum += fn_exp(lses[s * rows + r] - m) * outs[(s * rows + r) * VALUE_DIM + c];
    out[r * VALUE_DIM + c] = m == minus_inf ? (scalar_t)0 : sum / total;
  }
  if (lane == 0) lse[r] = m == minus_inf ? minus_inf : m + fn_log(total);
}
