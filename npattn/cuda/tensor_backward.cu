// FlashAttention-2 backward on the tensor cores: backward.cu's two kernels
// (the same formulas, the same fixed order of every sum: no atomics), with
// every product on the tensor cores (operands.cuh):
//
//   npattn_backward_dq_tc:   per 16 query rows a warp, over key tiles
//                            S = Q K^T, dP = dO V^T, dR (entry_backward),
//                            dQ += dR K
//   npattn_backward_dkdv_tc: per 16 keys a warp, over tiles of query rows
//                            S^T = K Q^T, dP^T = V dO^T, dR^T,
//                            dV += (P drop)^T dO,  dK += dR^T Q
//
// and dQ, dK scaled by the softmax scale at the end, each gradient written
// once as tile_t (float16 in PRECISION_F16: no float32 copy of it is made).
// P, dP and dR stay in registers between the products; tiles are copied as
// in tensor_forward.cu.
//
// Each warp's A operands (Q and dO in dq, K and V in dkdv) are read once;
// the first TC_KEPT_DQ (or TC_KEPT_DKDV) of the two (0, 1 or 2) are kept in
// dynamic shared memory (operands.cuh's RowOperand, TC_THREADS * (H + Hv) /
// KSTEP fragments where both are), the others in registers, whose products
// they feed each tile.
//
// Compile-time constants: tensor_tiles.cuh's (TC_KEYS: keys per tile of the
// dq kernel, query rows per tile of the dkdv kernel), TC_KEPT_DQ and
// TC_KEPT_DKDV (npattn.fast_cupy.tensor_kept_operands).
#ifndef TC_KEPT_DQ
#define TC_KEPT_DQ 0
#endif
#ifndef TC_KEPT_DKDV
#define TC_KEPT_DKDV 0
#endif

// dR_ij = dS_ij = P_ij (dP_ij - D_i) of an entry with a plain score (scale *
// q . k: no softcap, no ALiBi) and no dropout, and P_ij in `p`:
// entry_backward's formula with P = 2^(q . k scale log2(e) - lse log2(e)),
// the forward's base-2 exponentials, one fma with scale_log2 = scale log2(e)
// and lse_log2 = lse log2(e).
__device__ __forceinline__ scalar_t plain_entry_backward(scalar_t product, scalar_t dp, scalar_t scale_log2,
                                                         scalar_t lse_log2, scalar_t row_D, scalar_t& p) {
  p = fast_exp2(product * scale_log2 - lse_log2);
  return p * (dp - row_D);
}

// dR_ij of one entry, and P_ij drop_ij in `dropped`: entry_backward
// (pipeline.cuh), or, where the scores are plain, its formulas in base 2.
__device__ __forceinline__ scalar_t tensor_entry_backward(const Problem& pb, bool plain, const Row& row, long long j,
                                                       scalar_t product, scalar_t dp, scalar_t row_lse, scalar_t row_D,
                                                       scalar_t& dropped, scalar_t& slope_grad) {
  if (!plain) return entry_backward(pb, row, j, product, dp, row_lse, row_D, dropped, slope_grad);
  const scalar_t p = fast_exp2((product * pb.scale - row_lse) * LOG2_E);
  const scalar_t drop = pb.dropout ? dropout_factor(pb, row, j) : (scalar_t)1;
  dropped = p * drop;
  return p * (dp * drop - row_D);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    npattn_backward_dq_tc(const tile_t* __restrict__ q,     // (B, N, T, H)
                          const tile_t* __restrict__ k,     // (B, KH, S, H), heads kv_head_rows rows apart
                          const tile_t* __restrict__ v,     // (B, KH, S, Hv), the same
                          const tile_t* __restrict__ dout,  // (B, N, T, Hv)
                          const scalar_t* __restrict__ lse,   // (B, N, T)
                          const scalar_t* __restrict__ D,     // (B, N, T)
                          tile_t* __restrict__ dq,         // (B, N, T, H)
                          scalar_t* __restrict__ slope_rows,  // (B, N, T): -sum_j dS_ij |p_i - j|, with ALiBi
                          const Config config) {
  __shared__ __align__(16) tile_t key_tile[TC_STAGES][TC_KEYS * tile_stride<HEAD_DIM>];
  __shared__ __align__(16) tile_t value_tile[TC_STAGES][TC_KEYS * tile_stride<VALUE_DIM>];
  __shared__ long long scratch[2 * TC_WARPS];
  const Problem pb = read_problem(config);
  load_exp2_table();  // fast_exp2's, in float64
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
  const long long stacked = (long long)pb.G * pb.T;

  Row rows[2];
  long long row_index[2];
  const tile_t *q_rows[2], *dout_rows[2];
  const bool plain = pb.softcap == 0 && !pb.slopes;
  const scalar_t scale_log2 = pb.scale * LOG2_E;
  scalar_t row_lse[2], row_D[2], slope_grad[2] = {(scalar_t)0, (scalar_t)0};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long r = block_first_row() + warp * 16 + g + 8 * i;
    long long index;
    rows[i] = stacked_row(pb, b, h, r, stacked, index);
    row_index[i] = r < stacked ? index : -1;
    q_rows[i] = q + index * HEAD_DIM;
    dout_rows[i] = dout + index * VALUE_DIM;
    row_lse[i] = lse[index];
    row_D[i] = D[index];
  }
  extern __shared__ __align__(16) Piece kept_pieces[];  // TC_KEPT_DQ operands' fragments
  using QOperand = RowOperand<HEAD_DIM, TC_KEPT_DQ >= 1, TC_THREADS>;
  const QOperand q_operand(q_rows[0], q_rows[1], t, kept_pieces);
  const RowOperand<VALUE_DIM, TC_KEPT_DQ >= 2, TC_THREADS> dout_operand(dout_rows[0], dout_rows[1], t,
                                                                     kept_pieces + QOperand::planes * TC_THREADS);
  scalar_t dq_acc[HEAD_DIM / 8][4] = {};

  long long first, end;
  block_key_span(rows, scratch, first, end);
  const long long kv_base = kv_head_row(pb, b, h);

  auto issue = [&](int it) {
    const int stage = it % TC_STAGES;
    load_key_tiles(key_tile[stage], value_tile[stage], k, v, kv_base, first + (long long)it * TC_KEYS, end);
  };
  auto use = [&](int it) {
    const long long tile = first + (long long)it * TC_KEYS;
    const tile_t *keys = key_tile[it % TC_STAGES], *values = value_tile[it % TC_STAGES];
    scalar_t s[TC_KEYS / 8][4] = {}, dp[TC_KEYS / 8][4] = {};  // Q K^T and dO V^T: (16, TC_KEYS) per warp
    q_operand.with_fragments([&](const FragA(&q_frag)[HEAD_DIM / KSTEP]) {
      products_with_rows<HEAD_DIM>(s, q_frag, keys, lane);
    });
    dout_operand.with_fragments([&](const FragA(&dout_frag)[VALUE_DIM / KSTEP]) {
      products_with_rows<VALUE_DIM>(dp, dout_frag, values, lane);
    });
    const KeyRange range = key_range(pb, rows, tile, end);
    if (plain && !pb.dropout && sees_whole_tile(range)) {  // the common tile: dR = dS = P (dP - D)
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          scalar_t p;
          s[nb][e] = plain_entry_backward(s[nb][e], dp[nb][e], scale_log2, row_lse[e / 2] * LOG2_E, row_D[e / 2], p);
        }
    } else {
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2, offset = nb * 8 + 2 * t + e % 2;
          scalar_t dropped;
          s[nb][e] = sees(range, pb, rows, b, i, offset)
                         ? tensor_entry_backward(pb, plain, rows[i], tile + offset, s[nb][e], dp[nb][e], row_lse[i],
                                                 row_D[i], dropped, slope_grad[i])
                         : (scalar_t)0;  // dR
        }
    }
    products_with_columns<HEAD_DIM>(dq_acc, s, keys, lane);  // dQ += dR K: (16, TC_KEYS) (TC_KEYS, H)
  };
  pipelined_tiles<TC_KEYS>(first, end, issue, use);

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const scalar_t row_slope_grad = group_sum(slope_grad[i]);
    if (row_index[i] < 0) continue;
    store_row<HEAD_DIM>(dq + row_index[i] * HEAD_DIM, dq_acc, i, t, pb.scale);
    if (pb.slopes && t == 0) slope_rows[row_index[i]] = row_slope_grad;
  }
}

// Whether every row of a tile of TC_KEYS rows has keys [first, last] in its
// range [first_key, end_key) (window and lengths; segment ids aside): a
// warp-wide answer, each lane reading TC_KEYS / 32 rows.
__device__ __forceinline__ bool rows_see_keys(const Row* tile_rows, long long first, long long last, int lane) {
  long long latest_first = 0, earliest_end = (long long)1 << 62;
#pragma unroll
  for (int c = lane; c < TC_KEYS; c += 32) {
    latest_first = max(latest_first, tile_rows[c].first_key);
    earliest_end = min(earliest_end, tile_rows[c].end_key);
  }
  warp_min_max(earliest_end, latest_first);
  return latest_first <= first && last < earliest_end;
}

// One block per TC_ROWS keys of kv head h and batch element b; the query
// rows that can see them pass through shared memory TC_KEYS stacked rows at
// a time.
extern "C" __global__ void __launch_bounds__(TC_THREADS)
    npattn_backward_dkdv_tc(const tile_t* __restrict__ q,     // (B, N, T, H)
                            const tile_t* __restrict__ k,     // (B, KH, S, H), heads kv_head_rows rows apart
                            const tile_t* __restrict__ v,     // (B, KH, S, Hv), the same
                            const tile_t* __restrict__ dout,  // (B, N, T, Hv)
                            const scalar_t* __restrict__ lse,   // (B, N, T)
                            const scalar_t* __restrict__ D,     // (B, N, T)
                            tile_t* __restrict__ dk,         // (B, KH, S, H)
                            tile_t* __restrict__ dv,         // (B, KH, S, Hv)
                            const Config config) {
  __shared__ __align__(16) tile_t query_tile[TC_STAGES][TC_KEYS * tile_stride<HEAD_DIM>];
  __shared__ __align__(16) tile_t dout_tile[TC_STAGES][TC_KEYS * tile_stride<VALUE_DIM>];
  __shared__ Row tile_rows[TC_STAGES][TC_KEYS];
  __shared__ long long tile_index[TC_STAGES][TC_KEYS];  // each row's index into (B, N, T) arrays
  __shared__ scalar_t tile_lse[TC_STAGES][TC_KEYS], tile_D[TC_STAGES][TC_KEYS];
  const Problem pb = read_problem(config);
  load_exp2_table();  // fast_exp2's, in float64
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;

  long long key[2];  // this thread's keys: g and g + 8 of its warp's 16
  const tile_t *k_rows[2], *v_rows[2];
  const bool plain = pb.softcap == 0 && !pb.slopes;
  const scalar_t scale_log2 = pb.scale * LOG2_E;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    key[i] = (long long)blockIdx.x * TC_ROWS + warp * 16 + g + 8 * i;
    const long long index = kv_head_row(pb, b, h) + key[i];
    k_rows[i] = key[i] < pb.S ? k + index * HEAD_DIM : nullptr;
    v_rows[i] = key[i] < pb.S ? v + index * VALUE_DIM : nullptr;
  }
  extern __shared__ __align__(16) Piece kept_pieces[];  // TC_KEPT_DKDV operands' fragments
  using KOperand = RowOperand<HEAD_DIM, TC_KEPT_DKDV >= 1, TC_THREADS>;
  const KOperand k_operand(k_rows[0], k_rows[1], t, kept_pieces);
  const RowOperand<VALUE_DIM, TC_KEPT_DKDV >= 2, TC_THREADS> v_operand(v_rows[0], v_rows[1], t,
                                                                  kept_pieces + KOperand::planes * TC_THREADS);
  scalar_t dk_acc[HEAD_DIM / 8][4] = {}, dv_acc[VALUE_DIM / 8][4] = {};

  const long long key_first = (long long)blockIdx.x * TC_ROWS;
  const long long key_last = min(key_first + TC_ROWS, (long long)pb.S) - 1;
  long long first, end;  // query positions i, then stacked rows i * G + g
  query_range(pb, b, key_first, key_last, first, end);
  const long long stacked_end = end * pb.G;
  scalar_t unused_slope_grad = 0;  // the dq kernel sums the slopes' gradient

  auto issue = [&](int it) {
    const long long tile = first * pb.G + (long long)it * TC_KEYS;
    const int stage = it % TC_STAGES;
    static_assert(TC_KEYS <= TC_THREADS, "a thread per query row of a tile");
    if (const int e = threadIdx.x; e < TC_KEYS) {  // each row's index once (a division by G)
      long long index;
      tile_rows[stage][e] = stacked_row(pb, b, h, tile + e, stacked_end, index);
      tile_index[stage][e] = index;
      // lse and D copied as the rows are (no wait for global memory before the barrier)
      async_copy_entry(shared_address(&tile_lse[stage][e]), lse + index);
      async_copy_entry(shared_address(&tile_D[stage][e]), D + index);
    }
    if (pb.G == 1) {  // one query head per kv head: the stacked rows are consecutive rows of head h
      const long long head_rows = ((long long)b * pb.N + h) * pb.T;
      load_rows<HEAD_DIM, TC_KEYS, TC_THREADS>(query_tile[stage], q + head_rows * HEAD_DIM, tile, stacked_end);
      load_rows<VALUE_DIM, TC_KEYS, TC_THREADS>(dout_tile[stage], dout + head_rows * VALUE_DIM, tile, stacked_end);
    } else {
      __syncthreads();  // every row's index written
      auto indexed = [&](long long r) { return tile_index[stage][r - tile]; };
      load_tile<HEAD_DIM, TC_KEYS, TC_THREADS>(query_tile[stage], q, tile, stacked_end, indexed);
      load_tile<VALUE_DIM, TC_KEYS, TC_THREADS>(dout_tile[stage], dout, tile, stacked_end, indexed);
    }
    async_commit();
  };
  const long long warp_first = key_first + warp * 16, warp_last = warp_first + 15;  // this warp's keys
  auto use = [&](int it) {
    const int stage = it % TC_STAGES;
    const tile_t *queries = query_tile[stage], *douts = dout_tile[stage];
    scalar_t s[TC_KEYS / 8][4] = {}, dp[TC_KEYS / 8][4] = {};  // K Q^T and V dO^T: (16, TC_KEYS) per warp
    k_operand.with_fragments([&](const FragA(&k_frag)[HEAD_DIM / KSTEP]) {
      products_with_rows<HEAD_DIM>(s, k_frag, queries, lane);
    });
    v_operand.with_fragments([&](const FragA(&v_frag)[VALUE_DIM / KSTEP]) {
      products_with_rows<VALUE_DIM>(dp, v_frag, douts, lane);
    });
    const bool seen = rows_see_keys(tile_rows[stage], warp_first, warp_last, lane);  // every thread: it shuffles
    // The common tile: dR = P (dP - D), and P for dV.
    if (plain && !pb.dropout && !pb.kv_segments && seen && warp_last < pb.S) {
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = nb * 8 + 2 * t + e % 2;
          const scalar_t lse_log2 = tile_lse[stage][c] * LOG2_E;
          s[nb][e] = plain_entry_backward(s[nb][e], dp[nb][e], scale_log2, lse_log2, tile_D[stage][c], dp[nb][e]);
        }
    } else {
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2, c = nb * 8 + 2 * t + e % 2;
          const Row& row = tile_rows[stage][c];
          scalar_t dropped = (scalar_t)0, dr = (scalar_t)0;
          if (key[i] < pb.S && visible(pb, row, b, key[i]))
            dr = tensor_entry_backward(pb, plain, row, key[i], s[nb][e], dp[nb][e], tile_lse[stage][c],
                                       tile_D[stage][c], dropped, unused_slope_grad);
          s[nb][e] = dr;
          dp[nb][e] = dropped;
        }
    }
    products_with_columns<VALUE_DIM>(dv_acc, dp, douts, lane);  // dV += (P drop)^T dO: (16, TC_KEYS) (TC_KEYS, Hv)
    products_with_columns<HEAD_DIM>(dk_acc, s, queries, lane);   // dK += dR^T Q: (16, TC_KEYS) (TC_KEYS, H)
  };
  pipelined_tiles<TC_KEYS>(first * pb.G, stacked_end, issue, use);

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key[i] >= pb.S) continue;
    const long long index = (long long)((unsigned)b * pb.KH + h) * pb.S + key[i];
    store_row<HEAD_DIM>(dk + index * HEAD_DIM, dk_acc, i, t, pb.scale);
    store_row<VALUE_DIM>(dv + index * VALUE_DIM, dv_acc, i, t, (scalar_t)1);
  }
}
