// Online-softmax forward on the tensor cores (FlashAttention-2, Algorithm 1):
// the same recurrence as forward.cu,
//
//     s_j   = score(q_i . k_j)               (steps 1-3; -inf where hidden)
//     m'    = max(m, max_j s_j)
//     l     = l exp(m - m') + sum_j exp(s_j - m')
//     acc   = acc exp(m - m') + sum_j exp(s_j - m') drop_ij v_j
//     O_i   = acc / l,  lse_i = m + log l     (0 and -inf where no key is seen)
//
// with the two products S = Q K^T and acc += P V on the tensor cores
// (operands.cuh). A block holds TC_ROWS stacked rows of a kv head, 16 per
// warp; key and value tiles of TC_KEYS rows pass through shared memory,
// copied asynchronously TC_STAGES - 1 tiles ahead (cp.async); the scores, P
// and acc stay in registers. The exponentials are taken in base 2 (m and s
// in units of log 2). Splits of the keys (flash-decoding) as in forward.cu.
//
// Compile-time constants: TC_KEYS (a multiple of 16), TC_STAGES (1 or 2),
// and operands.cuh's.

#define TC_WARPS 4
#define TC_THREADS (32 * TC_WARPS)
#define TC_ROWS (16 * TC_WARPS)
#define LOG2_E 1.4426950408889634f
#define LN_2 0.6931471805599453f

// The union of the rows' key ranges [first_key, end_key) over the block
// (two rows per thread); every thread gets the same answer.
__device__ __forceinline__ void block_key_span(const Row (&rows)[2], long long* scratch, long long& first,
                                               long long& end) {
  long long mine_first = (long long)1 << 62, mine_end = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (rows[i].end_key <= rows[i].first_key) continue;
    mine_first = min(mine_first, rows[i].first_key);
    mine_end = max(mine_end, rows[i].end_key);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    mine_first = min(mine_first, __shfl_xor_sync(0xffffffffu, mine_first, offset));
    mine_end = max(mine_end, __shfl_xor_sync(0xffffffffu, mine_end, offset));
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    scratch[warp] = mine_first;
    scratch[TC_WARPS + warp] = mine_end;
  }
  __syncthreads();
  first = (long long)1 << 62;
  end = 0;
  for (int w = 0; w < TC_WARPS; ++w) {
    first = min(first, scratch[w]);
    end = max(end, scratch[TC_WARPS + w]);
  }
  __syncthreads();
}

// Whether every key of [first, end) passes the row's window and lengths and
// no segment ids are given: then its scores need no visibility test.
__device__ __forceinline__ bool sees_all(const Problem& pb, const Row& row, long long first, long long end) {
  return !pb.kv_segments && row.first_key <= first && end <= row.end_key;
}

// The tiles of a loop over [first, end) in steps of TILE rows: tile `it`
// copied into buffer it % TC_STAGES by `issue(it)`, the copy of the next one
// started before `use(it)` runs on this one (with two stages).
template <int TILE, class Issue, class Use>
__device__ __forceinline__ void pipelined_tiles(long long first, long long end, Issue issue, Use use) {
  const int tiles = end > first ? (int)((end - first + TILE - 1) / TILE) : 0;
  if (TC_STAGES > 1 && tiles > 0) issue(0);
  for (int it = 0; it < tiles; ++it) {
    if (TC_STAGES == 1) {
      issue(it);
      async_wait<0>();
    } else if (it + 1 < tiles) {
      issue(it + 1);
      async_wait<1>();
    } else {
      async_wait<0>();
    }
    __syncthreads();
    use(it);
    __syncthreads();
  }
}

extern "C" __global__ void __launch_bounds__(TC_THREADS)
    npattn_forward_tc(const tile_t* __restrict__ q,  // (B, N, T, H)
                      const tile_t* __restrict__ k,  // (B, KH, S, H)
                      const tile_t* __restrict__ v,  // (B, KH, S, Hv)
                      float* __restrict__ out,       // (splits, B, N, T, Hv)
                      float* __restrict__ lse,       // (splits, B, N, T)
                      const long long* config, const float* reals, const long long* q_offsets,
                      const long long* q_lengths, const long long* kv_lengths, const long long* q_segments,
                      const long long* kv_segments, const float* slopes) {
  __shared__ __align__(16) tile_t key_tile[TC_STAGES][TC_KEYS * STRIDE(HEAD_DIM)];
  __shared__ __align__(16) tile_t value_tile[TC_STAGES][TC_KEYS * STRIDE(VALUE_DIM)];
  __shared__ long long scratch[2 * TC_WARPS];
  const Problem pb = read_problem(config, reals, q_offsets, q_lengths, kv_lengths, q_segments, kv_segments, slopes);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int splits = (int)config[CFG_SPLITS];
  const int h = blockIdx.y, b = blockIdx.z / splits, split = blockIdx.z % splits;
  const long long stacked = (long long)pb.G * pb.T;
  const float minus_inf = negative_infinity(0.f);
  const bool plain = pb.softcap == 0 && !pb.slopes;  // scores are scale * q . k: no unit of the pipeline to run
  const float scale_log2 = pb.scale * LOG2_E;

  // This thread's rows: g and g + 8 of its warp's 16.
  Row rows[2];
  long long row_index[2];  // (b, n, i) flattened; -1 past the last row
  const tile_t* q_rows[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long r = (long long)blockIdx.x * TC_ROWS + warp * 16 + g + 8 * i;
    long long index;
    rows[i] = stacked_row(pb, b, h, r, stacked, index);
    row_index[i] = r < stacked ? index : -1;
    q_rows[i] = q + index * HEAD_DIM;
  }
  FragA q_frag[HEAD_DIM / KSTEP];
#pragma unroll
  for (int ks = 0; ks < HEAD_DIM / KSTEP; ++ks) q_frag[ks] = a_from_rows(q_rows[0], q_rows[1], ks * KSTEP, t);
  float acc[VALUE_DIM / 8][4] = {}, m[2] = {minus_inf, minus_inf}, l[2] = {0.f, 0.f};  // l: this lane's share

  long long first, end;
  block_key_span(rows, scratch, first, end);
  const long long per_split = ((pb.S + (long long)splits * TC_KEYS - 1) / ((long long)splits * TC_KEYS)) * TC_KEYS;
  first = max(first, split * per_split);
  end = min(end, (split + 1) * per_split);
  const long long kv_base = ((long long)b * pb.KH + h) * pb.S;
  auto same_row = [](long long r) { return r; };

  auto issue = [&](int it) {
    const long long tile = first + (long long)it * TC_KEYS;
    load_tile<HEAD_DIM, TC_KEYS, TC_THREADS>(key_tile[it % TC_STAGES], k + kv_base * HEAD_DIM, tile, end, same_row);
    load_tile<VALUE_DIM, TC_KEYS, TC_THREADS>(value_tile[it % TC_STAGES], v + kv_base * VALUE_DIM, tile, end,
                                              same_row);
    async_commit();
  };
  auto use = [&](int it) {
    const long long tile = first + (long long)it * TC_KEYS;
    const tile_t *keys = key_tile[it % TC_STAGES], *values = value_tile[it % TC_STAGES];
    float s[TC_KEYS / 8][4] = {};  // S = Q K^T: (16, TC_KEYS) per warp
#pragma unroll
    for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
      for (int ks = 0; ks < HEAD_DIM / KSTEP; ++ks)
        mma(s[nb], q_frag[ks], b_from_rows(keys, STRIDE(HEAD_DIM), nb * 8, ks * KSTEP, lane));

    const long long tile_end = min(tile + TC_KEYS, end);
    const int keys_in_tile = (int)(tile_end - tile);
    const bool all[2] = {sees_all(pb, rows[0], tile, tile_end), sees_all(pb, rows[1], tile, tile_end)};
    float tile_max[2] = {minus_inf, minus_inf};
#pragma unroll
    for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        const int offset = nb * 8 + 2 * t + e % 2;
        const long long j = tile + offset;
        float capped_tanh;
        const bool seen = offset < keys_in_tile && (all[i] || visible(pb, rows[i], b, j));
        const float x = plain ? s[nb][e] * scale_log2 : score(pb, rows[i], j, s[nb][e], capped_tanh) * LOG2_E;
        s[nb][e] = seen ? x : minus_inf;  // the score in units of log 2
        tile_max[i] = max(tile_max[i], s[nb][e]);
      }
    float reference[2];  // m, or 0 while no key is seen (so that -inf - m is not NaN)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float new_m = max(m[i], group_max(tile_max[i]));
      const float alpha = new_m == minus_inf ? 1.f : fast_exp2(m[i] - new_m);  // 0 while m = -inf
      l[i] *= alpha;
#pragma unroll
      for (int nd = 0; nd < VALUE_DIM / 8; ++nd) {
        acc[nd][2 * i] *= alpha;
        acc[nd][2 * i + 1] *= alpha;
      }
      m[i] = new_m;
      reference[i] = new_m == minus_inf ? 0.f : new_m;
    }
#pragma unroll
    for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        const float p = fast_exp2(s[nb][e] - reference[i]);  // 0 where hidden
        l[i] += p;
        s[nb][e] = pb.dropout ? p * dropout_factor(pb, rows[i], tile + nb * 8 + 2 * t + e % 2) : p;
      }
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / KSTEP; ++kk) {  // acc += P V: (16, TC_KEYS) (TC_KEYS, Hv)
      const FragA p = a_from_scores(s + kk * (KSTEP / 8));
#pragma unroll
      for (int nd = 0; nd < VALUE_DIM / 8; ++nd)
        mma(acc[nd], p, b_from_columns(values, STRIDE(VALUE_DIM), kk * KSTEP, nd * 8, lane));
    }
  };
  pipelined_tiles<TC_KEYS>(first, end, issue, use);

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float row_l = group_sum(l[i]);
    if (row_index[i] < 0) continue;
    const long long slot = (long long)split * pb.B * pb.N * pb.T + row_index[i];
    const float inverse = row_l > 0 ? 1 / row_l : 0.f;
#pragma unroll
    for (int nd = 0; nd < VALUE_DIM / 8; ++nd) {
      out[slot * VALUE_DIM + nd * 8 + 2 * t] = acc[nd][2 * i] * inverse;
      out[slot * VALUE_DIM + nd * 8 + 2 * t + 1] = acc[nd][2 * i + 1] * inverse;
    }
    if (t == 0) lse[slot] = row_l > 0 ? m[i] * LN_2 + fn_log(row_l) : minus_inf;
  }
}
