// The loop of the tensor-core kernels (tensor_forward.cu, tensor_backward.cu)
// over their tiles, and the products and stores each of them makes of a
// warp's 16 rows (operands.cuh's layouts): written once for the three kernels.
//
// Compile-time constants: TC_KEYS (keys, or query rows, per tile; a multiple
// of 16, small enough that TC_STAGES tiles fit: npattn.fast_cupy.tensor_tile),
// TC_WARPS (warps per block, 16 rows or keys each: 4, or 1 or 2 in the
// forward of a few stacked rows, such as a decode step's), TC_SPLIT_STAGES
// (the forward's: 1 where its key and value tiles are one each,
// split_pipelined_tiles; npattn.fast_cupy.tensor_split_stages), and
// operands.cuh's.

#define TC_STAGES 2  // tiles in shared memory: the next one's copy in flight while this one is used
#ifndef TC_SPLIT_STAGES
#define TC_SPLIT_STAGES 0
#endif
#define TC_THREADS (32 * TC_WARPS)
#define TC_ROWS (16 * TC_WARPS)
#define LOG2_E ((scalar_t)1.4426950408889634)
#define LN_2 ((scalar_t)0.6931471805599453)

// The first stacked query row of this block's TC_ROWS (the forward, dQ),
// the grid's last tile of rows first: under a causal mask later rows see
// more keys, so the longest blocks start first and the shortest fill the
// last wave (longest-first scheduling; GPUs start blocks in blockIdx order).
__device__ __forceinline__ long long block_first_row() { return (long long)(gridDim.x - 1 - blockIdx.x) * TC_ROWS; }

// `smallest` and `largest` become their minimum and maximum over the warp.
__device__ __forceinline__ void warp_min_max(long long& smallest, long long& largest) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    smallest = min(smallest, __shfl_xor_sync(0xffffffffu, smallest, offset));
    largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
}

// The union of the rows' key ranges [first_key, end_key) over the block
// (two rows per thread); every thread gets the same answer.
__device__ __forceinline__ void block_key_span(const Row (&rows)[2], long long* scratch, long long& first,
                                               long long& end) {
  rows_key_union(rows, 2, first, end);
  warp_min_max(first, end);
  block_key_union(scratch, threadIdx.x / 32, TC_WARPS, threadIdx.x % 32 == 0, first, end);
}

// Start copying key tile [tile, tile + TC_KEYS) of one kv head's keys and
// values (rows from kv_base of k and v) into `keys` and `values`, zeros past
// `end`: the forward's and the dQ kernel's `issue`.
__device__ __forceinline__ void load_key_tiles(tile_t* keys, tile_t* values, const tile_t* __restrict__ k,
                                               const tile_t* __restrict__ v, long long kv_base, long long tile,
                                               long long end) {
  load_rows<HEAD_DIM, TC_KEYS, TC_THREADS>(keys, k + kv_base * HEAD_DIM, tile, end);
  load_rows<VALUE_DIM, TC_KEYS, TC_THREADS>(values, v + kv_base * VALUE_DIM, tile, end);
  async_commit();
}

// The tiles of a loop over [first, end) in steps of TILE rows: tile `it`
// copied into buffer it % TC_STAGES by `issue(it)`, the copy of the next one
// started before `use(it)` runs on this one.
template <int TILE, class Issue, class Use>
__device__ __forceinline__ void pipelined_tiles(long long first, long long end, Issue issue, Use use) {
  const int tiles = end > first ? (int)((end - first + TILE - 1) / TILE) : 0;
  if (tiles > 0) issue(0);
  for (int it = 0; it < tiles; ++it) {
    if (it + 1 < tiles) {
      issue(it + 1);
      async_wait<1>();
    } else {
      async_wait<0>();
    }
#if TC_WGMMA
    fence_proxy_async();  // this thread's copies, to the tensor cores' reads
#endif
    __syncthreads();
    use(it);
    __syncthreads();
  }
}

// The forward's tiles of a loop over [first, end) in steps of TILE keys with
// one key tile and one value tile in shared memory (FlashAttention-2's
// forward): the values' copy overlaps this tile's scores(it) (S = Q K^T and
// the softmax, reading the key tile), the next keys' copy its values(it)
// (acc += P V, reading the value tile). issue_keys(it) and issue_values(it)
// start a tile's copy, a group of its own each; one group is in flight at
// each wait, and each barrier both shows the landed tile and closes the
// other one's reads before its next copy.
template <int TILE, class IssueKeys, class IssueValues, class Scores, class Values>
__device__ __forceinline__ void split_pipelined_tiles(long long first, long long end, IssueKeys issue_keys,
                                                      IssueValues issue_values, Scores scores, Values values) {
  const int tiles = end > first ? (int)((end - first + TILE - 1) / TILE) : 0;
  if (tiles == 0) return;
  issue_keys(0);
  issue_values(0);
  async_wait<1>();  // keys 0
  __syncthreads();
  for (int it = 0; it < tiles; ++it) {
    scores(it);
    async_wait<0>();  // values it
    __syncthreads();  // every warp done with keys it
    if (it + 1 < tiles) issue_keys(it + 1);
    values(it);
    async_wait<0>();  // keys it + 1
    __syncthreads();  // every warp done with values it
    if (it + 1 < tiles) issue_values(it + 1);
  }
}

// Which keys of the tile [first, first + count) this thread's two rows see:
// `all[i]` where every key of the tile passes row i's window and lengths and
// nothing else hides keys (ranges_decide_visibility), so that its scores
// need no visibility test.
struct KeyRange {
  long long first;
  int count;
  bool all[2];
};

__device__ __forceinline__ KeyRange key_range(const Problem& pb, const Row (&rows)[2], long long tile,
                                              long long end) {
  KeyRange range;
  range.first = tile;
  const long long tile_end = min(tile + TC_KEYS, end);
  range.count = (int)(tile_end - tile);
#pragma unroll
  for (int i = 0; i < 2; ++i)
    range.all[i] = ranges_decide_visibility(pb) && rows[i].first_key <= tile && tile_end <= rows[i].end_key;
  return range;
}

// Whether both of this thread's rows see every key of a whole tile (no
// test per score is needed).
__device__ __forceinline__ bool sees_whole_tile(const KeyRange& range) {
  return range.count == TC_KEYS && range.all[0] && range.all[1];
}

// Whether row i sees key first + offset of the tile.
__device__ __forceinline__ bool sees(const KeyRange& range, const Problem& pb, const Row (&rows)[2], int b, int i,
                                     int offset) {
  return offset < range.count && (range.all[i] || visible(pb, rows[i], b, range.first + offset));
}

#if TC_WGMMA
// The products below on the whole block's tensor cores (ptx.cuh's wgmma:
// the 4 warps' 16 rows each of A, B read from the swizzled tile once for
// them all): c (+)= A B over WIDTH / KSTEP steps of k, B the tile's
// K-major (TRANS_B = 0: its rows as B's columns) or MN-major (1) 16 rows
// of k a step, each step's sums in order, as the loops below take them.
template <int TRANS_B, int STEPS>
__device__ __forceinline__ void wgmma_products(scalar_t (&c)[8][4], const FragA (&a)[STEPS], const tile_t* tile) {
  static_assert(PRECISION == PRECISION_F16 && TC_WARPS == 4, "wgmma: float16, a warpgroup a block");
  constexpr int step_bytes = TRANS_B ? KSTEP * 64 * (int)sizeof(tile_t) : KSTEP * (int)sizeof(tile_t);
  constexpr int group_bytes = 8 * 64 * (int)sizeof(tile_t);  // 8 rows of 128 bytes: SBO
  // LBO: unused in both (K-major: 16, as CUTLASS sets it; MN-major: a second 64-column block's offset)
  constexpr int leading_bytes = TRANS_B ? TC_KEYS * 64 * (int)sizeof(tile_t) : 16;
  const shared_address_t start = shared_address(tile);
  fence_operands(c);
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < STEPS; ++ks)
    wgmma_f16<TRANS_B>(c, a[ks].r, wgmma_descriptor(start + ks * step_bytes, leading_bytes, group_bytes), 1);
  wgmma_commit();
  wgmma_wait_all();
  fence_operands(c);
}
#endif

// c += A tile^T: A (16, WIDTH) in fragments, the tile's TC_KEYS rows of WIDTH
// entries as B's columns (S = Q K^T, dP = dO V^T, and their transposes),
// two blocks of 8 keys per load of B (on wgmma_tile<WIDTH>, wgmma_products).
template <int WIDTH>
__device__ __forceinline__ void products_with_rows(scalar_t (&c)[TC_KEYS / 8][4], const FragA (&a)[WIDTH / KSTEP],
                                                   const tile_t* tile, int lane) {
#if TC_WGMMA
  if constexpr (wgmma_tile<WIDTH>) {
    static_assert(TC_KEYS == 64, "wgmma: 64 keys a tile");
    wgmma_products<0>(c, a, tile);
  } else
#endif
  {
#pragma unroll
    for (int nb = 0; nb < TC_KEYS / 8; nb += 2)
#pragma unroll
      for (int ks = 0; ks < WIDTH / KSTEP; ++ks) {
        FragB b[2];
        b_pair_from_rows<WIDTH>(b, tile, nb * 8, ks * KSTEP, lane);
        mma(c[nb], a[ks], b[0]);
        mma(c[nb + 1], a[ks], b[1]);
      }
  }
}

// acc += A tile: A = `scores` (16, TC_KEYS) as the C fragments hold them,
// the tile (TC_KEYS, WIDTH) (P V, dR K, (P drop)^T dO, dR^T Q), two blocks
// of 8 columns per load of B (and the last alone where WIDTH / 8 is odd, in
// float32 and float64; on wgmma_tile<WIDTH>, wgmma_products).
template <int WIDTH>
__device__ __forceinline__ void products_with_columns(scalar_t (&acc)[WIDTH / 8][4], const scalar_t (&scores)[TC_KEYS / 8][4],
                                                      const tile_t* tile, int lane) {
#if TC_WGMMA
  if constexpr (wgmma_tile<WIDTH>) {
    FragA a[TC_KEYS / KSTEP];
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / KSTEP; ++kk) a[kk] = a_from_scores(scores + kk * (KSTEP / 8));
    wgmma_products<1>(acc, a, tile);
  } else
#endif
  {
#pragma unroll
    for (int kk = 0; kk < TC_KEYS / KSTEP; ++kk) {
      const FragA a = a_from_scores(scores + kk * (KSTEP / 8));
#pragma unroll
      for (int nd = 0; nd + 1 < WIDTH / 8; nd += 2) {
        FragB b[2];
        b_pair_from_columns<WIDTH>(b, tile, kk * KSTEP, nd * 8, lane);
        mma(acc[nd], a, b[0]);
        mma(acc[nd + 1], a, b[1]);
      }
#if PRECISION != PRECISION_F16
      if constexpr (WIDTH / 8 % 2 == 1)
        mma(acc[WIDTH / 8 - 1], a, b_from_columns<WIDTH>(tile, kk * KSTEP, WIDTH - 8, lane));
#endif
    }
  }
}

// row[c] = factor * acc's entry (row g + 8i, column c) for this thread's
// columns c = 8 nd + 2t, 8 nd + 2t + 1 of a (16, WIDTH) accumulator, into a
// row of scalar_t (O) or of tile_t (the gradients: operands.cuh's store_entry).
template <int WIDTH, class Entry>
__device__ __forceinline__ void store_row(Entry* __restrict__ row, const scalar_t (&acc)[WIDTH / 8][4], int i, int t,
                                          scalar_t factor) {
#pragma unroll
  for (int nd = 0; nd < WIDTH / 8; ++nd) {
    store_entry(row + nd * 8 + 2 * t, acc[nd][2 * i] * factor);
    store_entry(row + nd * 8 + 2 * t + 1, acc[nd][2 * i + 1] * factor);
  }
}
