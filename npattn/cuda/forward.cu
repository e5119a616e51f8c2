// Online-softmax forward (FlashAttention-2, Algorithm 1), one block per
// ROWS * TILE stacked query rows of one kv head and one batch element.
//
// The G query heads that share kv head h are stacked position-major, row
// r = i * G + g for query i of head n = h * G + g, so that a block's rows
// see nearly the same keys. Each thread group of LANES threads holds TILE
// rows (rows r0 + t * ROWS + group), each thread a slice of every row's q_i
// and accumulator, so that a key or value slice read from shared memory
// serves TILE rows. Per tile of KEYS keys in shared memory, CHUNK keys at a
// time:
//
//     s_j   = score(q_i . k_j)               (steps 1-3; -inf where hidden)
//     m'    = max(m, max_j s_j)
//     l     = l exp(m - m') + sum_j exp(s_j - m')
//     acc   = acc exp(m - m') + sum_j exp(s_j - m') drop_ij v_j
//
// and at the end  O_i = acc / l,  lse_i = m + log l  (O_i = 0, lse_i = -inf
// where the row sees no key). With config.splits > 1 (flash-decoding) the keys
// are cut into that many ranges, grid.z runs batch element * splits, and
// each range writes its own (O, lse) into slice `split` of `out` and `lse`,
// which npattn.fast_cupy merges through lse. Where out_rounded is not null
// (float16 inputs, one split), O is written there too, rounded to float16
// as the caller's cast of `out` would round it: the call's output.
extern "C" __global__ void __launch_bounds__(THREADS)
    npattn_forward(const tile_t* __restrict__ q,  // (B, N, T, H)
                   const tile_t* __restrict__ k,  // (B, KH, S, H), heads kv_head_rows rows apart
                   const tile_t* __restrict__ v,  // (B, KH, S, Hv), the same
                   scalar_t* __restrict__ out,      // (splits, B, N, T, Hv)
                   scalar_t* __restrict__ lse,      // (splits, B, N, T)
                   tile_t* __restrict__ out_rounded,  // (B, N, T, Hv) or null: O again, as tile_t (one split)
                   const Config config) {
  __shared__ __align__(16) scalar_t key_tile[KEYS * HEAD_DIM];
  __shared__ __align__(16) scalar_t value_tile[KEYS * VALUE_DIM];
  __shared__ long long scratch[2 * ROWS];
  const Problem pb = read_problem(config);
  const int lane = threadIdx.x % LANES, group = threadIdx.x / LANES;
  const int splits = (int)config.splits;
  const int h = blockIdx.y, b = blockIdx.z / splits, split = blockIdx.z % splits;
  const int stacked = pb.G * pb.T;
  Row rows[TILE];
  long long row_index[TILE];  // (b, n, i) flattened
  scalar_t q_lane[TILE][DH], acc[TILE][DV], m[TILE], l[TILE];
  const scalar_t minus_inf = negative_infinity((scalar_t)0);
#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    const int r = (blockIdx.x * TILE + t) * ROWS + group;
    long long index;
    rows[t] = stacked_row(pb, b, h, r, stacked, index);
    row_index[t] = r < stacked ? index : -1;  // past the last row: sees nothing, writes nothing
    read_slice<HEAD_DIM, DH>(q_lane[t], q + index * HEAD_DIM, lane);
#pragma unroll
    for (int u = 0; u < DV; ++u) acc[t][u] = 0;
    m[t] = minus_inf;
    l[t] = 0;
  }

  // This split's keys: chunks of whole tiles, the last ones possibly empty.
  long long first, end;
  block_key_range<TILE>(rows, scratch, first, end);
  const long long per_split = ((pb.S + (long long)splits * KEYS - 1) / ((long long)splits * KEYS)) * KEYS;
  first = max(first, split * per_split);
  end = min(end, (split + 1) * per_split);
  const long long kv_base = kv_head_row(pb, b, h);

  for (long long tile = first; tile < end; tile += KEYS) {
    load_rows<HEAD_DIM>(key_tile, k + kv_base * HEAD_DIM, tile, end);
    load_rows<VALUE_DIM>(value_tile, v + kv_base * VALUE_DIM, tile, end);
    __syncthreads();
    for (int c0 = 0; c0 < KEYS; c0 += CHUNK) {
      scalar_t s[TILE][CHUNK];
#pragma unroll
      for (int c = 0; c < CHUNK; ++c) {
        scalar_t key_lane[DH];
        read_slice<HEAD_DIM, DH>(key_lane, key_tile + (c0 + c) * HEAD_DIM, lane);
#pragma unroll
        for (int t = 0; t < TILE; ++t) s[t][c] = lanes_sum(lane_dot<DH>(q_lane[t], key_lane));
      }
      scalar_t weight[TILE][CHUNK];  // exp(s_j - m) drop_ij, 0 where hidden
#pragma unroll
      for (int t = 0; t < TILE; ++t) {
        scalar_t chunk_max = minus_inf;
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
          const long long j = tile + c0 + c;
          scalar_t capped_tanh;
          s[t][c] = (j < end && visible(pb, rows[t], b, j)) ? score(pb, rows[t], j, s[t][c], capped_tanh) : minus_inf;
          chunk_max = larger(chunk_max, s[t][c]);
        }
        if (chunk_max > m[t]) {  // FlashAttention-2's rescale
          const scalar_t alpha = fn_exp(m[t] - chunk_max);  // 0 while m = -inf
          l[t] *= alpha;
#pragma unroll
          for (int u = 0; u < DV; ++u) acc[t][u] *= alpha;
          m[t] = chunk_max;
        }
#pragma unroll
        for (int c = 0; c < CHUNK; ++c) {
          const scalar_t p = s[t][c] == minus_inf ? (scalar_t)0 : fn_exp(s[t][c] - m[t]);
          l[t] += p;
          weight[t][c] = p == 0 ? p : p * dropout_factor(pb, rows[t], tile + c0 + c);
        }
      }
#pragma unroll
      for (int c = 0; c < CHUNK; ++c) {
        scalar_t value_lane[DV];
        read_slice<VALUE_DIM, DV>(value_lane, value_tile + (c0 + c) * VALUE_DIM, lane);
#pragma unroll
        for (int t = 0; t < TILE; ++t) lane_axpy<DV>(acc[t], weight[t][c], value_lane);
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int t = 0; t < TILE; ++t) {
    if (row_index[t] < 0) continue;
    const long long slot = (long long)split * pb.B * pb.N * pb.T + row_index[t];
    const scalar_t factor = l[t] > 0 ? 1 / l[t] : (scalar_t)0;
    store_lane<VALUE_DIM, DV>(out + slot * VALUE_DIM, acc[t], lane, factor);
    if (out_rounded) store_lane<VALUE_DIM, DV>(out_rounded + slot * VALUE_DIM, acc[t], lane, factor);
    if (lane == 0) lse[slot] = l[t] > 0 ? m[t] + fn_log(l[t]) : minus_inf;
  }
}
