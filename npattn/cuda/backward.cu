// FlashAttention-2 backward (Algorithm 2) in two kernels, so that every
// gradient is summed by one thread group in a fixed order (no atomics: the
// same inputs give the same bits):
//
//     P_ij  = exp(s_ij - lse_i)                      (0 where hidden)
//     dP_ij = drop_ij (dO_i . v_j)
//     dS_ij = P_ij (dP_ij - D_i),   D_i = rowsum(dO_i * O_i) - dlse_i
//     dR_ij = dS_ij (1 - t_ij^2)    through the softcap (t = tanh(s / c))
//
//   npattn_backward_dq:   dQ_i  = scale sum_j dR_ij k_j, the ALiBi
//                         slope's share -sum_j dS_ij |p_i - j| of row i,
//                         and dS_ij itself, the bias's gradient, with a bias
//   npattn_backward_dkdv: dK_j  = scale sum_i dR_ij q_i,
//                         dV_j  = sum_i P_ij drop_ij dO_i,
//                         i over the G query heads of kv head h, stacked
//                         position-major as in the forward.
//
// Each thread group holds TILE rows (dq) or keys (dkdv), so that a
// slice read from shared memory serves all of them. `lse` and `D` come in
// shape (B, N, T); D (delta.cuh) from the dq kernel, which works it out for
// its rows and writes it before the dkdv kernel runs.

extern "C" __global__ void __launch_bounds__(THREADS)
    npattn_backward_dq(const tile_t* __restrict__ q,     // (B, N, T, H)
                       const tile_t* __restrict__ k,     // (B, KH, S, H), heads kv_head_rows rows apart
                       const tile_t* __restrict__ v,     // (B, KH, S, Hv), the same
                       const tile_t* __restrict__ dout,  // (B, N, T, Hv)
                       const scalar_t* __restrict__ lse,   // (B, N, T)
                       scalar_t* __restrict__ D,           // (B, N, T): written here (delta.cuh)
                       const scalar_t* __restrict__ out,   // (B, N, T, Hv)
                       const scalar_t* __restrict__ dlse,  // (B, N, T) or null
                       tile_t* __restrict__ dq,            // (B, N, T, H)
                       scalar_t* __restrict__ slope_rows,  // (B, N, T): -sum_j dS_ij |p_i - j|, with ALiBi
                       const Config config) {
  __shared__ __align__(16) scalar_t key_tile[KEYS * HEAD_DIM];
  __shared__ __align__(16) scalar_t value_tile[KEYS * VALUE_DIM];
  __shared__ long long scratch[2 * ROWS];
  const Problem pb = read_problem(config);
  const int lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const int h = blockIdx.y, b = blockIdx.z;
  const int stacked = pb.G * pb.T;
  Row rows[TILE];
  long long row_index[TILE];
  scalar_t q_lane[TILE][DH], dout_lane[TILE][DV], dq_lane[TILE][DH], row_lse[TILE], row_D[TILE], slope_grad[TILE];
#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    const int r = (blockIdx.x * TILE + t) * ROWS + group;
    long long index;
    rows[t] = stacked_row(pb, b, h, r, stacked, index);
    row_index[t] = r < stacked ? index : -1;
    read_slice<HEAD_DIM, DH>(q_lane[t], q + index * HEAD_DIM, lane);
    read_slice<VALUE_DIM, DV>(dout_lane[t], dout + index * VALUE_DIM, lane);
#pragma unroll
    for (int u = 0; u < DH; ++u) dq_lane[t][u] = 0;
    row_lse[t] = lse[index];
    // D_i (delta.cuh) over the row's LANES lanes, each the columns lane, lane + LANES, ...
    row_D[t] = lanes_sum(delta_share<LANES>(dout + index * VALUE_DIM, out + index * VALUE_DIM, lane));
    row_D[t] -= dlse ? dlse[index] : 0;
    if (lane == 0 && row_index[t] >= 0) D[index] = row_D[t];  // for npattn_backward_dkdv
    slope_grad[t] = 0;
  }
  long long first, end;
  block_key_range<TILE>(rows, scratch, first, end);
  const long long kv_base = kv_head_row(pb, b, h);

  for (long long tile = first; tile < end; tile += KEYS) {
    load_rows<HEAD_DIM>(key_tile, k + kv_base * HEAD_DIM, tile, end);
    load_rows<VALUE_DIM>(value_tile, v + kv_base * VALUE_DIM, tile, end);
    __syncthreads();
    for (int c = 0; c < KEYS; ++c) {
      const long long j = tile + c;
      scalar_t key_lane[DH], value_lane[DV];
      read_slice<HEAD_DIM, DH>(key_lane, key_tile + c * HEAD_DIM, lane);
      read_slice<VALUE_DIM, DV>(value_lane, value_tile + c * VALUE_DIM, lane);
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
        const scalar_t product = lanes_sum(lane_dot<DH>(q_lane[t], key_lane));
        const scalar_t dp = lanes_sum(lane_dot<DV>(dout_lane[t], value_lane));
        if (j >= end || !visible(pb, rows[t], b, j)) continue;
        scalar_t dropped;
        const scalar_t dr = entry_backward(pb, rows[t], j, product, dp, row_lse[t], row_D[t], dropped, slope_grad[t],
                                           lane == 0 ? bias_grad_at(pb, row_index[t], j) : nullptr);
        lane_axpy<DH>(dq_lane[t], dr, key_lane);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    if (row_index[t] < 0) continue;
    store_lane<HEAD_DIM, DH>(dq + row_index[t] * HEAD_DIM, dq_lane[t], lane, pb.scale);
    if (pb.slopes && lane == 0) slope_rows[row_index[t]] = slope_grad[t];
  }
}

// One block per ROWS * TILE keys of kv head h and batch element
// b; the query rows that can see them pass through shared memory KEYS
// stacked rows at a time.
extern "C" __global__ void __launch_bounds__(THREADS)
    npattn_backward_dkdv(const tile_t* __restrict__ q,     // (B, N, T, H)
                         const tile_t* __restrict__ k,     // (B, KH, S, H), heads kv_head_rows rows apart
                         const tile_t* __restrict__ v,     // (B, KH, S, Hv), the same
                         const tile_t* __restrict__ dout,  // (B, N, T, Hv)
                         const scalar_t* __restrict__ lse,   // (B, N, T)
                         const scalar_t* __restrict__ D,     // (B, N, T)
                         tile_t* __restrict__ dk,            // (B, KH, S, H)
                         tile_t* __restrict__ dv,            // (B, KH, S, Hv)
                         const Config config) {
  __shared__ __align__(16) scalar_t query_tile[KEYS * HEAD_DIM];
  __shared__ __align__(16) scalar_t dout_tile[KEYS * VALUE_DIM];
  __shared__ Row tile_rows[KEYS];
  __shared__ scalar_t tile_lse[KEYS], tile_D[KEYS];
  const Problem pb = read_problem(config);
  const int lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const int h = blockIdx.y, b = blockIdx.z;
  long long key[TILE];
  scalar_t k_lane[TILE][DH], v_lane[TILE][DV], dk_lane[TILE][DH], dv_lane[TILE][DV];
#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    key[t] = ((long long)blockIdx.x * TILE + t) * ROWS + group;
    const long long index = kv_head_row(pb, b, h) + min(key[t], (long long)pb.S - 1);
    read_slice<HEAD_DIM, DH>(k_lane[t], k + index * HEAD_DIM, lane);
    read_slice<VALUE_DIM, DV>(v_lane[t], v + index * VALUE_DIM, lane);
#pragma unroll
    for (int u = 0; u < DH; ++u) dk_lane[t][u] = 0;
#pragma unroll
    for (int u = 0; u < DV; ++u) dv_lane[t][u] = 0;
  }

  const long long key_first = (long long)blockIdx.x * TILE * ROWS;
  const long long key_last = min(key_first + TILE * ROWS, (long long)pb.S) - 1;
  long long first, end;  // query positions i, then stacked rows i * G + g
  query_range(pb, b, key_first, key_last, first, end);
  const long long stacked_end = end * pb.G;
  scalar_t unused_slope_grad = 0;  // the dq kernel sums the slopes' gradient

  for (long long tile = first * pb.G; tile < stacked_end; tile += KEYS) {
    for (int e = threadIdx.x; e < KEYS * HEAD_DIM; e += THREADS) {
      const long long r = tile + e / HEAD_DIM;
      query_tile[e] = r < stacked_end ? entry_value(q[stacked_index(pb, b, h, r) * HEAD_DIM + e % HEAD_DIM]) : 0;
    }
    for (int e = threadIdx.x; e < KEYS * VALUE_DIM; e += THREADS) {
      const long long r = tile + e / VALUE_DIM;
      dout_tile[e] = r < stacked_end ? entry_value(dout[stacked_index(pb, b, h, r) * VALUE_DIM + e % VALUE_DIM]) : 0;
    }
    for (int e = threadIdx.x; e < KEYS; e += THREADS) {
      long long index;
      tile_rows[e] = stacked_row(pb, b, h, tile + e, stacked_end, index);
      tile_lse[e] = lse[index];
      tile_D[e] = D[index];
    }
    __syncthreads();
    for (int c = 0; c < KEYS; ++c) {
      scalar_t query_lane[DH], dout_lane[DV];
      read_slice<HEAD_DIM, DH>(query_lane, query_tile + c * HEAD_DIM, lane);
      read_slice<VALUE_DIM, DV>(dout_lane, dout_tile + c * VALUE_DIM, lane);
      const Row& row = tile_rows[c];
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
        const scalar_t product = lanes_sum(lane_dot<DH>(k_lane[t], query_lane));
        const scalar_t dp = lanes_sum(lane_dot<DV>(v_lane[t], dout_lane));
        if (key[t] >= pb.S || !visible(pb, row, b, key[t])) continue;
        scalar_t dropped;
        const scalar_t dr =
            entry_backward(pb, row, key[t], product, dp, tile_lse[c], tile_D[c], dropped, unused_slope_grad);
        lane_axpy<DV>(dv_lane[t], dropped, dout_lane);
        lane_axpy<DH>(dk_lane[t], dr, query_lane);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    if (key[t] >= pb.S) continue;
    const long long index = (long long)((unsigned)b * pb.KH + h) * pb.S + key[t];
    store_lane<HEAD_DIM, DH>(dk + index * HEAD_DIM, dk_lane[t], lane, pb.scale);
    store_lane<VALUE_DIM, DV>(dv + index * VALUE_DIM, dv_lane[t], lane, (scalar_t)1);
  }
}
