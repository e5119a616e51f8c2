// FlashAttention-2 backward on the tensor cores: backward.cu's two kernels
// (the same formulas, the same fixed order of every sum: no atomics but
// TC_FUSED_DQ's, below, in an order its flags fix), with
// every product on the tensor cores (operands.cuh):
//
//   npattn_backward_dq_tc:   per 16 query rows a warp, first their D
//                            (delta.cuh, written for the dkdv kernel), then
//                            over key tiles S = Q K^T, dP = dO V^T,
//                            dR (entry_backward), dQ += dR K
//   npattn_backward_dkdv_tc: per 16 keys a warp, over tiles of query rows
//                            S^T = K Q^T, dP^T = V dO^T, dR^T,
//                            dV += (P drop)^T dO,  dK += dR^T Q
//
// and dQ, dK scaled by the softmax scale at the end, each gradient written
// once as tile_t (float16 in PRECISION_F16: no float32 copy of it is made).
// P, dP and dR stay in registers between the products; tiles are copied as
// in tensor_forward.cu, and with TC_WGMMA (float16 at H = Hv = 64:
// npattn.fast_cupy.tensor_wgmma) every product runs on sm_90a's warpgroup
// tensor cores, as there.
//
// Each warp's A operands (Q and dO in dq, K and V in dkdv) are read once;
// the first TC_KEPT_DQ (or TC_KEPT_DKDV) of the two (0, 1 or 2) are kept in
// dynamic shared memory (operands.cuh's RowOperand, TC_THREADS * (H + Hv) /
// KSTEP fragments where both are), the others in registers, whose products
// they feed each tile.
//
// With TC_FUSED_DQ (float64, plain scores: npattn.fast_cupy.tensor_fused_dq)
// the dkdv kernel sums dQ too, and the dq kernel is not launched (D comes
// from npattn_backward_d, backward_d.cu):
//
//   dQ_tile += scale dR_tile,block K_block
//
// each key block's share of a tile of query rows added into dQ (zeros
// before the launch) in the order of the key blocks, 0 first, which flags
// of their own keep (ptx.cuh's wait_for_flag and release_flag, one a tile,
// zeros before the launch: tile tau's holds 1 + the last key block that
// added into it; a block takes its keys by the order the kv head's blocks
// started in, take_ticket, so that it waits only for a block that has
// started): a fixed order of every sum, and so the same bits each
// run, without the dq kernel's second S = Q K^T and dP = dO V^T. Each
// block keeps its keys as a tile in dynamic shared memory (the A operand
// of K Q^T and the B of dR K), writes dR^T's tile there for its warps'
// dQ products (each warp (16 rows, 8 columns) blocks of a tile's dQ over
// half the block's keys, the halves summed in shared memory), and adds
// each tile's share as it goes over the next tile (ptx.cuh's
// add_to_global: red.add, performed in L2, nothing read back), the adds
// landing while that tile's dQ products run. Its tiles are aligned on
// multiples of TC_KEYS stacked rows (the same tiles in every key block)
// and taken last first: the key blocks of a causal mask, whose rows end
// together, then go over the same tiles in step, and those of a sliding
// window each reach a tile after the block before it (taken first first,
// each would start where the one before reaches only later, and wait for
// it).
//
// Compile-time constants: tensor_tiles.cuh's (TC_KEYS: keys per tile of the
// dq kernel, query rows per tile of the dkdv kernel), TC_KEPT_DQ and
// TC_KEPT_DKDV (npattn.fast_cupy.tensor_kept_operands; with TC_FUSED_DQ the
// keys are in shared memory as a tile, and V is kept where TC_KEPT_DKDV is 2).
#ifndef TC_KEPT_DQ
#define TC_KEPT_DQ 0
#endif
#ifndef TC_KEPT_DKDV
#define TC_KEPT_DKDV 0
#endif
#ifndef TC_FUSED_DQ
#define TC_FUSED_DQ 0
#endif
#if TC_FUSED_DQ && PRECISION != PRECISION_F64
#error "TC_FUSED_DQ sums dQ in its own dtype: float64 alone"
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
// (pipeline.cuh, which writes dS_ij to `score_grad` where given), or, where
// the scores are plain (no bias), its formulas in base 2.
__device__ __forceinline__ scalar_t tensor_entry_backward(const Problem& pb, bool plain, const Row& row, long long j,
                                                       scalar_t product, scalar_t dp, scalar_t row_lse, scalar_t row_D,
                                                       scalar_t& dropped, scalar_t& slope_grad,
                                                       scalar_t* score_grad = nullptr) {
  if (!plain) return entry_backward(pb, row, j, product, dp, row_lse, row_D, dropped, slope_grad, score_grad);
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
                          scalar_t* __restrict__ D,           // (B, N, T): written here (delta.cuh)
                          const scalar_t* __restrict__ out,   // (B, N, T, Hv)
                          const scalar_t* __restrict__ dlse,  // (B, N, T) or null
                          tile_t* __restrict__ dq,            // (B, N, T, H)
                          scalar_t* __restrict__ slope_rows,  // (B, N, T): -sum_j dS_ij |p_i - j|, with ALiBi
                          const Config config) {
  __shared__ __align__(TC_WGMMA ? 1024 : 16) tile_t key_tile[TC_STAGES][TC_KEYS * tile_stride<HEAD_DIM>];
  __shared__ __align__(TC_WGMMA ? 1024 : 16) tile_t value_tile[TC_STAGES][TC_KEYS * tile_stride<VALUE_DIM>];
  __shared__ long long scratch[2 * TC_WARPS];
  const Problem pb = read_problem(config);
  load_exp2_table();  // fast_exp2's, in float64
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
  const long long stacked = (long long)pb.G * pb.T;

  Row rows[2];
  long long index[2], row_index[2];  // into (B, N, T) arrays: the last real row's past the rows; -1 there
  const tile_t *q_rows[2], *dout_rows[2];
  const bool plain = plain_scores(pb);
  const scalar_t scale_log2 = pb.scale * LOG2_E;
  scalar_t row_lse[2], row_D[2], slope_grad[2] = {(scalar_t)0, (scalar_t)0};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long r = block_first_row() + warp * 16 + g + 8 * i;
    rows[i] = stacked_row(pb, b, h, r, stacked, index[i]);
    row_index[i] = r < stacked ? index[i] : -1;
    q_rows[i] = q + index[i] * HEAD_DIM;
    dout_rows[i] = dout + index[i] * VALUE_DIM;
    row_lse[i] = lse[index[i]];
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {  // D_i (delta.cuh), each of the row's 4 lanes summing columns t, t + 4, ..
    row_D[i] = group_sum(delta_share<4>(dout_rows[i], out + index[i] * VALUE_DIM, t));
    row_D[i] -= dlse ? dlse[index[i]] : 0;
    if (t == 0 && row_index[i] >= 0) D[index[i]] = row_D[i];  // for npattn_backward_dkdv_tc
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
                                                 row_D[i], dropped, slope_grad[i],
                                                 bias_grad_at(pb, row_index[i], tile + offset))
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
// range [first_key, end_key) (window and lengths; segment ids and masks aside): a
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

#if TC_FUSED_DQ
static_assert(TC_KEYS == 16, "the fused dQ's tiles: one (16 rows) block of query rows");
// A tile's dQ (16 rows, HEAD_DIM columns) in blocks of 8 columns, each
// summed over the block's keys in DQ_KEY_PARTS parts of DQ_PART_KEYS keys:
// warp w sums part w / DQ_PART_WARPS of its blocks dq_block(w, u), u = 0, 1, ..
// (a part's warps reading dR's columns of its keys alone, each its
// fragments once for all its blocks).
constexpr int DQ_BLOCKS = HEAD_DIM / 8, DQ_KEY_PARTS = 2;
constexpr int DQ_PART_KEYS = TC_ROWS / DQ_KEY_PARTS, DQ_PART_WARPS = TC_WARPS / DQ_KEY_PARTS;
constexpr int DQ_BLOCKS_A_WARP = (DQ_BLOCKS + DQ_PART_WARPS - 1) / DQ_PART_WARPS;
__device__ __forceinline__ int dq_block(int warp, int u) { return warp % DQ_PART_WARPS * DQ_BLOCKS_A_WARP + u; }

// The tiles [lo, hi) of TC_KEYS stacked rows that the key block from
// key_first goes over: those of its query rows [first, end) (query_range),
// aligned on multiples of TC_KEYS, so that every key block's tile tau holds
// the same rows.
__device__ __forceinline__ void fused_tiles(const Problem& pb, int b, long long key_first, long long& lo,
                                            long long& hi) {
  long long first, end;
  query_range(pb, b, key_first, min(key_first + TC_ROWS, (long long)pb.S) - 1, first, end);
  lo = first * pb.G / TC_KEYS;
  hi = end > first ? (end * pb.G + TC_KEYS - 1) / TC_KEYS : lo;
}

// dR's tile (TC_KEYS query rows by the block's TC_ROWS keys) in the order
// the dQ products read it: each A fragment (rows q0 + g and q0 + g + 8,
// keys k0 + 2t and k0 + 2t + 1, a_from_rows' order) as one lane's 32 bytes,
// its two 16-byte halves swapped in odd rows g, so that a quarter-warp's
// 16-byte loads (rows g and g + 1) take the banks once; a fragment's
// entries lie in its registers' order (no moves between load and mma).
// The offset, in entries, of dR[q][key].
__device__ __forceinline__ int dr_entry(int q, int key) {
  const int g = q % 8, fragment = q / 16 * (TC_ROWS / KSTEP) + key / KSTEP;
  return fragment * 128 + g * 16 + key % 8 / 2 * 4 + (key % 2 ^ g % 2) * 2 + q / 8 % 2;
}

// dR^T's (16 keys of this warp, TC_KEYS query rows) C fragments `s` into
// dR's tile: the entries of rows q and q + 8 (blocks nb and nb + 1) side by
// side, 16 bytes a store.
__device__ __forceinline__ void store_dr(tile_t* dr, const scalar_t (&s)[TC_KEYS / 8][4], int warp, int lane) {
#pragma unroll
  for (int nb = 0; nb < TC_KEYS / 8; nb += 2)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int q = nb * 8 + 2 * (lane % 4) + e % 2, key = warp * 16 + lane / 4 + 8 * (e / 2);
      *reinterpret_cast<Piece*>(dr + dr_entry(q, key)) = Piece{s[nb][e], s[nb + 1][e]};
    }
}

// A tile's share of dQ, this warp's blocks of it over its part's keys:
// part[u] (16 rows, 8 columns n0..) = dR (the tile's rows, the part's keys)
// K (those keys, columns n0..), dR from its tile (store_dr) and K from
// `keys` (TC_ROWS rows of HEAD_DIM). Every warp runs the products (the
// emulator's mma is block-wide): a block past the last repeats the last,
// and its part is not added.
__device__ __forceinline__ void dq_products(scalar_t (&part)[DQ_BLOCKS_A_WARP][4], const tile_t* dr,
                                            const tile_t* keys, int warp, int lane) {
#pragma unroll
  for (int u = 0; u < DQ_BLOCKS_A_WARP; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) part[u][e] = (scalar_t)0;
  // the part's keys: its columns of dR's tile (whole fragments) and its rows of the keys' tile
  const int part_first = warp / DQ_PART_WARPS * DQ_PART_KEYS;
  dr += dr_entry(0, part_first);
  keys += part_first * tile_stride<HEAD_DIM>;
#pragma unroll
  for (int kk = 0; kk < DQ_PART_KEYS / KSTEP; ++kk) {  // k0 = kk KSTEP: (16, DQ_PART_KEYS) (DQ_PART_KEYS, 8) a block
    FragA a;
#pragma unroll
    for (int half = 0; half < 2; ++half)  // the part's keys k0 + 2t (rows g, g + 8), then k0 + 2t + 1
      set_frag_piece(a, half,
                     *reinterpret_cast<const Piece*>(dr + dr_entry(lane / 4, kk * KSTEP + 2 * (lane % 4) + half)));
#pragma unroll
    for (int u = 0; u < DQ_BLOCKS_A_WARP; ++u)
      mma(part[u], a, TileColumns<HEAD_DIM>(keys, min(dq_block(warp, u), DQ_BLOCKS - 1) * 8, lane)(kk * KSTEP));
  }
}

// A tile's share of dQ kept while the block goes over the next tile: this
// thread's part[u][e] in dynamic shared memory, 16-byte pieces a plane of
// TC_THREADS apiece (`mine` points at this thread's piece of the first
// plane; as RowOperand keeps fragments, but read back by add_share from the
// threads of each part). The tile's rows, as indices into (B, N, T) arrays
// (-1 past the block's rows), are the kernel's `kept_rows`.
__device__ __forceinline__ void keep_share(Piece* mine, const scalar_t (&part)[DQ_BLOCKS_A_WARP][4]) {
#pragma unroll
  for (int u = 0; u < DQ_BLOCKS_A_WARP; ++u)
#pragma unroll
    for (int i = 0; i < 2; ++i) mine[(2 * u + i) * TC_THREADS] = Piece{part[u][2 * i], part[u][2 * i + 1]};
}

// dQ += scale (part 0 + part 1 + ..) of the kept share (add_to_global: in
// the flags' order) at the blocks this warp adds: its slots u = part +
// DQ_KEY_PARTS j (each block by a warp of its own), each part's pieces
// from the thread of this lane in that part's warp of the same blocks.
// This thread's entries: rows g + 8i, columns n0 + 2t and n0 + 2t + 1.
__device__ __forceinline__ void add_share(tile_t* dq, const long long* rows, const Piece* mine, scalar_t scale,
                                          int warp, int lane) {
  constexpr int adds = (DQ_BLOCKS_A_WARP + DQ_KEY_PARTS - 1) / DQ_KEY_PARTS, part_threads = DQ_PART_WARPS * 32;
  const int part = warp / DQ_PART_WARPS;
#pragma unroll
  for (int j = 0; j < adds; ++j) {
    const int u = part + DQ_KEY_PARTS * j, block = dq_block(warp, u);
    if (u >= DQ_BLOCKS_A_WARP || block >= DQ_BLOCKS) continue;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const long long index = rows[lane / 4 + 8 * i];
      if (index < 0) continue;
      const Piece* pieces = mine + (2 * u + i) * TC_THREADS - part * part_threads;  // part 0's
      Piece sum = pieces[0];
#pragma unroll
      for (int p = 1; p < DQ_KEY_PARTS; ++p) {
        const Piece more = pieces[p * part_threads];
        sum = Piece{sum.x + more.x, sum.y + more.y};
      }
      tile_t* at = dq + index * HEAD_DIM + block * 8 + 2 * (lane % 4);
      add_to_global(at, scale * sum.x);
      add_to_global(at + 1, scale * sum.y);
    }
  }
}
#endif

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
                            tile_t* dq,                      // (B, N, T, H), zeros: with TC_FUSED_DQ, dQ
                            int* dq_flags,  // (B, KH, 1 + tiles of G T rows), zeros: TC_FUSED_DQ's tickets, flags
                            const Config config) {
  __shared__ __align__(TC_WGMMA ? 1024 : 16) tile_t query_tile[TC_STAGES][TC_KEYS * tile_stride<HEAD_DIM>];
  __shared__ __align__(TC_WGMMA ? 1024 : 16) tile_t dout_tile[TC_STAGES][TC_KEYS * tile_stride<VALUE_DIM>];
  __shared__ Row tile_rows[TC_STAGES][TC_KEYS];
  __shared__ long long tile_index[TC_STAGES][TC_KEYS];  // each row's index into (B, N, T) arrays
  __shared__ scalar_t tile_lse[TC_STAGES][TC_KEYS], tile_D[TC_STAGES][TC_KEYS];
  const Problem pb = read_problem(config);
  load_exp2_table();  // fast_exp2's, in float64
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.y, b = blockIdx.z;
#if TC_FUSED_DQ
  // This block's keys by the order the kv head's blocks started in, not by
  // blockIdx.x: a ticket of the head's counter, the first of its entries in
  // dq_flags (its tiles' flags follow). The block before its keys, whose
  // flags it waits for, took a lower ticket, so it has started, whatever
  // order the GPU started the blocks in.
  int* head_flags = dq_flags + ((long long)b * pb.KH + h) * (1 + (pb.G * (long long)pb.T + TC_KEYS - 1) / TC_KEYS);
  __shared__ int ticket;
  if (threadIdx.x == 0) ticket = take_ticket(head_flags);
  __syncthreads();
  // read where used (as blockIdx.x is), so that no register holds it
  auto key_block = [&] { return *static_cast<volatile int*>(&ticket); };
#else
  auto key_block = [] { return (int)blockIdx.x; };
#endif
  // this thread's key g + 8 i of its warp's 16
  auto key = [&](int i) { return (long long)key_block() * TC_ROWS + warp * 16 + g + 8 * i; };

  const tile_t *k_rows[2], *v_rows[2];
  const bool plain = plain_scores(pb);
  const scalar_t scale_log2 = pb.scale * LOG2_E;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const long long index = kv_head_row(pb, b, h) + key(i);
    k_rows[i] = key(i) < pb.S ? k + index * HEAD_DIM : nullptr;
    v_rows[i] = key(i) < pb.S ? v + index * VALUE_DIM : nullptr;
  }
  const long long key_first = (long long)key_block() * TC_ROWS;
  const long long key_last = min(key_first + TC_ROWS, (long long)pb.S) - 1;
  extern __shared__ __align__(16) Piece kept_pieces[];  // TC_KEPT_DKDV operands' fragments
#if TC_FUSED_DQ
  // the block's keys (TC_ROWS rows of H), dR's tile (TC_KEYS query rows of
  // the TC_ROWS keys), the kept share of dQ, then V's fragments where kept
  tile_t* keys = reinterpret_cast<tile_t*>(kept_pieces);
  tile_t* scores = keys + TC_ROWS * tile_stride<HEAD_DIM>;
  Piece* kept_share = reinterpret_cast<Piece*>(scores + TC_KEYS * TC_ROWS) + threadIdx.x;
  Piece* v_pieces = kept_share - threadIdx.x + 2 * DQ_BLOCKS_A_WARP * TC_THREADS;
  __shared__ long long kept_rows[TC_KEYS];  // the kept share's rows (keep_share)
  load_rows<HEAD_DIM, TC_ROWS, TC_THREADS>(keys, k + kv_head_row(pb, b, h) * HEAD_DIM, key_first, pb.S);
  async_commit();
  async_wait<0>();
  __syncthreads();
  const TileRows<HEAD_DIM> k_operand{keys, warp * 16, lane};
#else
  using KOperand = RowOperand<HEAD_DIM, TC_KEPT_DKDV >= 1, TC_THREADS>;
  const KOperand k_operand(k_rows[0], k_rows[1], t, kept_pieces);
  Piece* v_pieces = kept_pieces + KOperand::planes * TC_THREADS;
#endif
  const RowOperand<VALUE_DIM, TC_KEPT_DKDV >= 2, TC_THREADS> v_operand(v_rows[0], v_rows[1], t, v_pieces);
  scalar_t dk_acc[HEAD_DIM / 8][4] = {}, dv_acc[VALUE_DIM / 8][4] = {};

  long long first, end;  // query positions i, then stacked rows i * G + g
  query_range(pb, b, key_first, key_last, first, end);
  const long long stacked_end = end * pb.G;
#if TC_FUSED_DQ
  long long tile_lo, tile_hi, before_lo = 0, before_hi = 0;  // this block's tiles, and the block before's
  fused_tiles(pb, b, key_first, tile_lo, tile_hi);
  if (key_block() > 0) fused_tiles(pb, b, key_first - TC_ROWS, before_lo, before_hi);
  int* flags = head_flags + 1;
  const long long loop_first = end > first ? tile_lo * TC_KEYS : stacked_end;
  // tile it's first stacked row: the last tile first
  auto tile_of = [&](int it) { return (tile_hi - 1 - it) * TC_KEYS; };
  // Add the kept share (of `tile`; none where -1) into dQ once the block
  // before has added its own, then run `meanwhile` (this tile's products)
  // while the adds land, and let the block after add next.
  auto add_kept_share = [&](long long tile, auto meanwhile) {
    const long long tau = tile / TC_KEYS;
    if (tile >= 0 && threadIdx.x == 0 && before_lo <= tau && tau < before_hi) wait_for_flag(flags + tau, key_block());
    __syncthreads();  // the block before's adds done (and this tile's dR written)
    if (tile >= 0) add_share(dq, kept_rows, kept_share, pb.scale, warp, lane);
    meanwhile();
    __syncthreads();  // every warp's adds made, and the kept share and rows read
    if (tile >= 0 && threadIdx.x == 0) release_flag(flags + tau, key_block() + 1);
  };
#else
  const long long loop_first = first * pb.G;
  auto tile_of = [&](int it) { return first * pb.G + (long long)it * TC_KEYS; };
#endif
  scalar_t unused_slope_grad = 0;  // the dq kernel sums the slopes' gradient

  auto issue = [&](int it) {
    const long long tile = tile_of(it);
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
    const long long my_key = key(0), warp_first = my_key - g, warp_last = warp_first + 15;  // this warp's keys
    const bool seen = rows_see_keys(tile_rows[stage], warp_first, warp_last, lane);  // every thread: it shuffles
    // The common tile: dR = P (dP - D), and P for dV.
    if (plain && !pb.dropout && ranges_decide_visibility(pb) && seen && warp_last < pb.S) {
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
          const long long key_i = my_key + 8 * i;  // key(i)
          if (key_i < pb.S && visible(pb, row, b, key_i))
            dr = tensor_entry_backward(pb, plain, row, key_i, s[nb][e], dp[nb][e], tile_lse[stage][c],
                                       tile_D[stage][c], dropped, unused_slope_grad);
          s[nb][e] = dr;
          dp[nb][e] = dropped;
        }
    }
#if TC_FUSED_DQ
    store_dr(scores, s, warp, lane);  // dR^T (16, TC_KEYS) into dR's tile (TC_KEYS, TC_ROWS)
#endif
    products_with_columns<VALUE_DIM>(dv_acc, dp, douts, lane);  // dV += (P drop)^T dO: (16, TC_KEYS) (TC_KEYS, Hv)
    products_with_columns<HEAD_DIM>(dk_acc, s, queries, lane);   // dK += dR^T Q: (16, TC_KEYS) (TC_KEYS, H)
#if TC_FUSED_DQ
    scalar_t part[DQ_BLOCKS_A_WARP][4];  // this tile's share of dQ, kept for the next tile's add
    add_kept_share(it > 0 ? tile_of(it - 1) : -1, [&] { dq_products(part, scores, keys, warp, lane); });
    keep_share(kept_share, part);
    if (threadIdx.x < TC_KEYS)
      kept_rows[threadIdx.x] = tile_of(it) + threadIdx.x < stacked_end ? tile_index[stage][threadIdx.x] : -1;
#endif
  };
  pipelined_tiles<TC_KEYS>(loop_first, stacked_end, issue, use);
#if TC_FUSED_DQ
  if (tile_hi > tile_lo) add_kept_share(tile_lo * TC_KEYS, [] {});  // the last tile taken: the first
#endif

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (key(i) >= pb.S) continue;
    const long long index = (long long)((unsigned)b * pb.KH + h) * pb.S + key(i);
    store_row<HEAD_DIM>(dk + index * HEAD_DIM, dk_acc, i, t, pb.scale);
    store_row<VALUE_DIM>(dv + index * VALUE_DIM, dv_acc, i, t, (scalar_t)1);
  }
}
