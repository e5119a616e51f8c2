// Tiles shared by the CUDA-core kernels of npattn.fast_cupy (forward.cu,
// backward.cu): a lane's slice of a row, which keys a block of query rows can
// see, and the cooperative copy of a tile of rows into shared memory.
//
// Compile-time constants (-D options, npattn/fast_cupy.py):
//   HEAD_DIM, VALUE_DIM  H and Hv
//   LANES                threads that share one row (a power of two <= 32),
//                        each holding a slice of it (see lane_entry)
//   ROWS                 thread groups per block (LANES * ROWS threads)
//   TILE                 rows (or keys) each thread group holds (its register
//                        tile): a value read from shared memory serves TILE rows
//   KEYS                 rows of a tile in shared memory
//   CHUNK                keys scored together before the softmax update (divides KEYS)

// A lane's slice of a row: lanes take VEC consecutive entries in turn
// (lane l holds entries [l VEC, l VEC + VEC), [(l + LANES) VEC, ...), ...),
// so that a slice is read in aligned 16-byte pieces, and the LANES lanes of
// a row read consecutive ones.
#define VEC (16 / (int)sizeof(scalar_t))
#define SLICE(WIDTH) (VEC * (((WIDTH) + LANES * VEC - 1) / (LANES * VEC)))
#define DH SLICE(HEAD_DIM)   // entries of a query/key row per lane
#define DV SLICE(VALUE_DIM)  // entries of a value row per lane
#define THREADS (LANES * ROWS)

// Sum of `x` over the LANES consecutive threads that share one row: a
// butterfly, after which every lane holds the total (the same bits on each).
__device__ __forceinline__ scalar_t lanes_sum(scalar_t x) {
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// VEC consecutive entries of a row, read at once (16 bytes in the compute
// dtype, 8 in float16).
template <class Entry>
struct alignas(VEC * sizeof(Entry)) Piece {
  Entry x[VEC];
};

// The row entry that entry u of `lane`'s slice holds.
__device__ __forceinline__ int lane_entry(int lane, int u) { return (u / VEC) * (LANES * VEC) + lane * VEC + u % VEC; }

// Copy rows [first, first + KEYS) of a (rows, width) row-major matrix into
// `tile` in the compute dtype, zeros past `end` (coalesced: consecutive
// threads, consecutive entries).
template <int WIDTH>
__device__ __forceinline__ void load_rows(scalar_t* tile, const tile_t* __restrict__ matrix, long long first,
                                          long long end) {
  const long long available = max(0LL, min((long long)KEYS, end - first)) * WIDTH;
  const tile_t* source = matrix + first * WIDTH;
  for (int e = threadIdx.x; e < KEYS * WIDTH; e += THREADS)
    tile[e] = e < available ? (scalar_t)entry_value(source[e]) : (scalar_t)0;
}

// This lane's slice of a row of WIDTH entries (tile_t in global memory, or
// scalar_t in shared memory) in the compute dtype, zeros past the end: in
// pieces of VEC entries where WIDTH allows (rows then start on a piece's
// boundary), else entry by entry.
template <int WIDTH, int PER_LANE, class Entry>
__device__ __forceinline__ void read_slice(scalar_t* dst, const Entry* row, int lane) {
#pragma unroll
  for (int p = 0; p < PER_LANE / VEC; ++p) {
    const int d = p * LANES * VEC + lane * VEC;
    if (WIDTH % VEC == 0) {
      Piece<Entry> piece;
      if (d < WIDTH) {
        piece = *reinterpret_cast<const Piece<Entry>*>(row + d);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) piece.x[e] = 0;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[p * VEC + e] = entry_value(piece.x[e]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) dst[p * VEC + e] = d + e < WIDTH ? (scalar_t)entry_value(row[d + e]) : (scalar_t)0;
    }
  }
}

// row[d] = factor * src's entry for the row entries d of this lane's slice,
// into a row of scalar_t (O) or tile_t (the gradients: entries.cuh's store_entry).
template <int WIDTH, int PER_LANE, class Entry>
__device__ __forceinline__ void store_lane(Entry* __restrict__ row, const scalar_t* src, int lane, scalar_t factor) {
#pragma unroll
  for (int u = 0; u < PER_LANE; ++u) {
    const int d = lane_entry(lane, u);
    if (d < WIDTH) store_entry(row + d, src[u] * factor);
  }
}

// This lane's share of the dot product of two of its slices.
template <int PER_LANE>
__device__ __forceinline__ scalar_t lane_dot(const scalar_t* a, const scalar_t* b) {
  scalar_t sum = 0;
#pragma unroll
  for (int u = 0; u < PER_LANE; ++u) sum += a[u] * b[u];
  return sum;
}

// acc += weight * x, on this lane's slices.
template <int PER_LANE>
__device__ __forceinline__ void lane_axpy(scalar_t* acc, scalar_t weight, const scalar_t* x) {
#pragma unroll
  for (int u = 0; u < PER_LANE; ++u) acc[u] += weight * x[u];
}

// The union of the rows' key ranges [first_key, end_key) over the block:
// every thread gets the same answer (COUNT rows per thread group).
// `scratch` holds 2 * ROWS entries.
template <int COUNT>
__device__ __forceinline__ void block_key_range(const Row* rows, long long* scratch, long long& first,
                                                long long& end) {
  rows_key_union(rows, COUNT, first, end);  // the same in every lane of a group
  block_key_union(scratch, threadIdx.x / LANES, ROWS, threadIdx.x % LANES == 0, first, end);
}
