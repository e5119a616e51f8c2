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
// copied asynchronously a tile ahead (cp.async: pipelined_tiles), or each
// in one buffer, the values' copy overlapping the scores and the next
// keys' the products with the values (TC_SPLIT_STAGES:
// split_pipelined_tiles); the scores, P and acc stay in registers. The
// exponentials are taken in base 2 (m and s in units of log 2). Splits of
// the keys (flash-decoding) as in forward.cu.
//
// Compile-time constants: tensor_tiles.cuh's, TC_MIN_BLOCKS: blocks per
// multiprocessor the registers are capped to fit (npattn.fast_cupy.
// tensor_min_blocks; 0: the compiler's choice), and TC_KEPT_Q: Q's
// fragments, read once, kept in dynamic shared memory (operands.cuh's
// RowOperand, TC_THREADS * H / KSTEP fragments) rather than registers, so
// that more blocks fit a multiprocessor (npattn.fast_cupy.tensor_kept_q),
// and TC_WGMMA: both products on sm_90a's warpgroup tensor cores (ptx.cuh's
// wgmma, float16 at H = Hv = 64, 4 warps, 64 keys a tile: wgmma reads the
// key and value tiles in shared memory once for the block, where each warp
// reads them for its own mma.sync; npattn.fast_cupy.tensor_wgmma).
//
// Where out_rounded is not null (float16 inputs, one split), O is written
// there too, each entry rounded to float16 as the caller's cast of `out`
// would round it (entries.cuh's store_entry): the call's output, with no
// cast of its own.
#ifndef TC_KEPT_Q
#define TC_KEPT_Q 0
#endif

#if TC_MIN_BLOCKS > 0
#define TC_FORWARD_BOUNDS __launch_bounds__(TC_THREADS, TC_MIN_BLOCKS)
#else
#define TC_FORWARD_BOUNDS __launch_bounds__(TC_THREADS)
#endif

extern "C" __global__ void TC_FORWARD_BOUNDS
    npattn_forward_tc(const tile_t* __restrict__ q,  // (B, N, T, H)
                      const tile_t* __restrict__ k,  // (B, KH, S, H), heads kv_head_rows rows apart
                      const tile_t* __restrict__ v,  // (B, KH, S, Hv), the same
                      scalar_t* __restrict__ out,       // (splits, B, N, T, Hv)
                      scalar_t* __restrict__ lse,       // (splits, B, N, T)
                      tile_t* __restrict__ out_rounded,  // (B, N, T, Hv) or null: O again, as tile_t (one split)
                      const Config config) {
  constexpr int stages = TC_SPLIT_STAGES ? 1 : TC_STAGES;
  // 1024-byte aligned for wgmma's swizzle (ptx.cuh), whose tiles take TC_KEYS * 128 bytes each
  __shared__ __align__(TC_WGMMA ? 1024 : 16) tile_t key_tile[stages][TC_KEYS * tile_stride<HEAD_DIM>];
  __shared__ __align__(TC_WGMMA ? 1024 : 16) tile_t value_tile[stages][TC_KEYS * tile_stride<VALUE_DIM>];
  __shared__ long long scratch[2 * TC_WARPS];
  const Problem pb = read_problem(config);
  load_exp2_table();  // fast_exp2's, in float64
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int splits = (int)config.splits;
  const int h = blockIdx.y, b = blockIdx.z / splits, split = blockIdx.z % splits;
  const long long stacked = (long long)pb.G * pb.T;
  const scalar_t minus_inf = negative_infinity((scalar_t)0);
  const bool plain = plain_scores(pb);  // scores are scale * q . k: no unit of the pipeline to run
  const scalar_t scale_log2 = pb.scale * LOG2_E;

  // This thread's rows: g and g + 8 of its warp's 16.
  Row rows[2];
  long long row_index[2];  // (b, n, i) flattened; -1 past the last row
  const tile_t* q_rows[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long r = block_first_row() + warp * 16 + g + 8 * i;
    long long index;
    rows[i] = stacked_row(pb, b, h, r, stacked, index);
    row_index[i] = r < stacked ? index : -1;
    q_rows[i] = q + index * HEAD_DIM;
  }
  extern __shared__ __align__(16) Piece kept_pieces[];  // Q's fragments where TC_KEPT_Q
  const RowOperand<HEAD_DIM, TC_KEPT_Q != 0, TC_THREADS> q_operand(q_rows[0], q_rows[1], t, kept_pieces);
  scalar_t acc[VALUE_DIM / 8][4] = {}, m[2] = {minus_inf, minus_inf}, l[2] = {(scalar_t)0, (scalar_t)0};  // l: this lane's share

  long long first, end;
  block_key_span(rows, scratch, first, end);
  const long long per_split = ((pb.S + (long long)splits * TC_KEYS - 1) / ((long long)splits * TC_KEYS)) * TC_KEYS;
  first = max(first, split * per_split);
  end = min(end, (split + 1) * per_split);
  const long long kv_base = kv_head_row(pb, b, h);

  auto tile_start = [&](int it) { return first + (long long)it * TC_KEYS; };
  scalar_t s[TC_KEYS / 8][4];  // S = Q K^T, then P: (16, TC_KEYS) per warp
  auto scores = [&](int it) {  // S, the running maximum and sum, P
    const long long tile = tile_start(it);
#pragma unroll
    for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nb][e] = 0;
    q_operand.with_fragments([&](const FragA(&q_frag)[HEAD_DIM / KSTEP]) {
      products_with_rows<HEAD_DIM>(s, q_frag, key_tile[it % stages], lane);
    });
    const KeyRange range = key_range(pb, rows, tile, end);
    scalar_t tile_max[2] = {minus_inf, minus_inf};
    scalar_t to_log2 = 1;  // s * to_log2: the score in units of log 2
    if (plain && scale_log2 > 0 && sees_whole_tile(range)) {  // FlashAttention-2's common tile: no test per score
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) tile_max[e / 2] = larger(tile_max[e / 2], s[nb][e]);
      // s stays q . k, scaled inside the exponentials' fma; the max scales exactly (rounding is monotone)
      to_log2 = scale_log2;
      tile_max[0] *= scale_log2;
      tile_max[1] *= scale_log2;
    } else {
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2;
          const int offset = nb * 8 + 2 * t + e % 2;
          scalar_t capped_tanh;
          const scalar_t x =
              plain ? s[nb][e] * scale_log2 : score(pb, rows[i], tile + offset, s[nb][e], capped_tanh) * LOG2_E;
          s[nb][e] = sees(range, pb, rows, b, i, offset) ? x : minus_inf;
          tile_max[i] = larger(tile_max[i], s[nb][e]);
        }
    }
    scalar_t new_m[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) new_m[i] = larger(m[i], group_max(tile_max[i]));
    // A row whose maximum stayed has alpha = 2^0 = 1: a warp whose rows all kept theirs (most
    // tiles, once the rows have seen a few) skips the rescaling, with the same bits.
    if (__any_sync(0xffffffffu, new_m[0] > m[0] || new_m[1] > m[1])) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const scalar_t alpha = new_m[i] == minus_inf ? (scalar_t)1 : fast_exp2(m[i] - new_m[i]);  // 0 while m = -inf
        l[i] *= alpha;
#pragma unroll
        for (int nd = 0; nd < VALUE_DIM / 8; ++nd) {
          acc[nd][2 * i] *= alpha;
          acc[nd][2 * i + 1] *= alpha;
        }
        m[i] = new_m[i];
      }
    }
    scalar_t reference[2];  // m, or 0 while no key is seen (so that -inf - m is not NaN)
#pragma unroll
    for (int i = 0; i < 2; ++i) reference[i] = m[i] == minus_inf ? (scalar_t)0 : m[i];
#pragma unroll
    for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nb][e] = fast_exp2(s[nb][e] * to_log2 - reference[e / 2]);  // P, 0 where hidden
        l[e / 2] += s[nb][e];
      }
    if (pb.dropout)
#pragma unroll
      for (int nb = 0; nb < TC_KEYS / 8; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nb][e] *= dropout_factor(pb, rows[e / 2], tile + nb * 8 + 2 * t + e % 2);
  };
  auto values = [&](int it) {  // acc += P V: (16, TC_KEYS) (TC_KEYS, Hv)
    products_with_columns<VALUE_DIM>(acc, s, value_tile[it % stages], lane);
  };
#if TC_SPLIT_STAGES
  auto issue_keys = [&](int it) {
    load_rows<HEAD_DIM, TC_KEYS, TC_THREADS>(key_tile[0], k + kv_base * HEAD_DIM, tile_start(it), end);
    async_commit();
  };
  auto issue_values = [&](int it) {
    load_rows<VALUE_DIM, TC_KEYS, TC_THREADS>(value_tile[0], v + kv_base * VALUE_DIM, tile_start(it), end);
    async_commit();
  };
  split_pipelined_tiles<TC_KEYS>(first, end, issue_keys, issue_values, scores, values);
#else
  auto issue = [&](int it) {
    load_key_tiles(key_tile[it % stages], value_tile[it % stages], k, v, kv_base, tile_start(it), end);
  };
  pipelined_tiles<TC_KEYS>(first, end, issue, [&](int it) {
    scores(it);
    values(it);
  });
#endif

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const scalar_t row_l = group_sum(l[i]);
    if (row_index[i] < 0) continue;
    const long long slot = (long long)split * pb.B * pb.N * pb.T + row_index[i];
    const scalar_t factor = row_l > 0 ? 1 / row_l : (scalar_t)0;
    store_row<VALUE_DIM>(out + slot * VALUE_DIM, acc, i, t, factor);
    if (out_rounded) store_row<VALUE_DIM>(out_rounded + slot * VALUE_DIM, acc, i, t, factor);
    if (t == 0) lse[slot] = row_l > 0 ? m[i] * LN_2 + fn_log(row_l) : minus_inf;
  }
}
