// The backward's D (FlashAttention-2's preprocessing), for both kinds of
// kernels:
//
//     D_r = rowsum(dO_r * O_r) - dlse_r     (dlse null: 0)
//
// over the B N T rows of VALUE_DIM entries, dO as the kernels read it (tile_t)
// and O in scalar_t, the products summed in scalar_t. The dQ kernels
// (backward.cu, tensor_backward.cu) work it out for their own rows before
// their tile loop and write it for the dK/dV kernel, launched after them;
// npattn_backward_d (backward_d.cu) writes it where no dQ kernel runs
// (TC_FUSED_DQ).

// One lane's share of rowsum(dO_r * O_r): the columns first, first + STRIDE,
// ... of row r (`dout` and `out` at its first entry), summed in that order.
// The caller sums the lanes' shares by a fixed butterfly (the same bits on
// every run).
template <int STRIDE>
__device__ __forceinline__ scalar_t delta_share(const tile_t* dout, const scalar_t* out, int first) {
  scalar_t sum = 0;
#pragma unroll
  for (int u = 0; u < (VALUE_DIM + STRIDE - 1) / STRIDE; ++u) {  // first < STRIDE
    const int c = first + u * STRIDE;
    if (c < VALUE_DIM) sum += (scalar_t)entry_value(dout[c]) * out[c];
  }
  return sum;
}
