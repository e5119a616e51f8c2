// Operands of the tensor-core kernels (tensor_forward.cu, tensor_backward.cu),
// the same code for both precisions of ptx.cuh: which values of a tile each
// lane gives the tensor cores, and the tiles in shared memory.
//
// A warp multiplies 16 rows at a time. Its scores come out of the tensor
// cores as C fragments (ptx.cuh): lane (g, t) holds, for each block of 8
// keys (or query rows) nb, the entries
//
//     c[nb][0], c[nb][1]  of row g      and keys nb*8 + 2t, nb*8 + 2t + 1
//     c[nb][2], c[nb][3]  of row g + 8  and the same keys
//
// and a_from_scores hands them back to the tensor cores as the A operand of
// the next product (P V, dS K, ...) without leaving the registers
// (FlashAttention-2's layout). In TF32X3 that A operand's column t stands
// for key 2t and column t + 4 for key 2t + 1: b_from_columns reads B's rows
// in the same order, so the product sums the same pairs.
//
// Compile-time constants: PRECISION (ptx.cuh), HEAD_DIM, VALUE_DIM; tile_t
// (entries.cuh) is float16 in PRECISION_F16, float32 in PRECISION_TF32X3,
// float64 in PRECISION_F64; scalar_t, the C fragments' and every sum's type,
// float64 in PRECISION_F64, else float32.

#if PRECISION == PRECISION_F16
#define KSTEP 16  // the product's inner dimension per mma
struct FragA {
  unsigned r[4];
};
struct FragB {
  unsigned r[2];
};
#elif PRECISION == PRECISION_TF32X3 || PRECISION == PRECISION_F64
#define KSTEP 8
struct FragA {
  scalar_t r[4];
};
struct FragB {
  scalar_t r[2];
};
#else
#error "PRECISION must be PRECISION_F16, PRECISION_TF32X3 or PRECISION_F64"
#endif

// The layout of a tile of WIDTH entries a row in shared memory: entry (row,
// col) at row * tile_stride<WIDTH> + (col ^ tile_swizzle<WIDTH>(row)).
//
// - float16 and float32: rows padded by 16 bytes, so that the lanes of a
//   warp read different banks in both b_pair_from_rows (ldmatrix's 8 rows
//   of 16 bytes) and b_pair_from_columns;
// - float64, WIDTH a multiple of 16 (swizzled_tile): rows unpadded, row r's
//   16-byte pieces permuted by an XOR of the column with tile_swizzle(r) =
//   0, 8, 4, 12, 8, 0, 12, 4 for r % 8 = 0 .. 7 (as CUTLASS swizzles its
//   shared-memory layouts). b_pair_from_rows' 16-byte loads then take one
//   pass of the 32 banks for each quarter-warp (rows g and g + 1 in
//   opposite halves of the banks), b_from_columns' 8-byte loads one for
//   each half-warp (rows k0 + 2t + e, t = 0 .. 3, in different quarters):
//   the fewest (tests/test_fast_cupy.py counts them). No padding does both,
//   the first needing rows 64 bytes apart modulo 128 and the second 16 or
//   48 modulo 64; with 16-byte padding, b_pair_from_rows' 8-byte loads
//   took two passes for each half-warp;
// - float64, other widths: padded by 16 bytes as float16 and float32 are
//   (b_pair_from_rows' loads then share banks).
//
// The cp.async copies (Pieces) move 16-byte pieces, which the XOR (a
// multiple of 4 entries) keeps whole.
//
// Under TC_WGMMA (float16, WIDTH 64: the tiles wgmma reads, ptx.cuh), rows of
// 128 bytes unpadded, row r's 16-byte pieces permuted by an XOR of the
// column with tile_swizzle(r) = 8 (r % 8): the 128-byte swizzle the tensor
// cores read (tiles 1024-byte aligned).
template <int WIDTH>
constexpr bool wgmma_tile = TC_WGMMA && PRECISION == PRECISION_F16 && WIDTH == 64;

template <int WIDTH>
constexpr bool swizzled_tile = (PRECISION == PRECISION_F64 && WIDTH % 16 == 0) || wgmma_tile<WIDTH>;

template <int WIDTH>
constexpr int tile_stride = swizzled_tile<WIDTH> ? WIDTH : WIDTH + 16 / (int)sizeof(tile_t);

template <int WIDTH>
__device__ __forceinline__ int tile_swizzle(int row) {
  if constexpr (wgmma_tile<WIDTH>)
    return (row & 7) << 3;
  else if constexpr (swizzled_tile<WIDTH>)
    return ((row & 6) << 1) ^ ((row & 1) << 3);
  else
    return 0;
}

// Entries c0 + x of row r of a tile (c0 a multiple of 8 known at compile
// time, x < 8 a lane's): (c0 + x) ^ tile_swizzle(r) = (c0 & ~15) +
// ((8 h + x) ^ tile_swizzle(r)) with h = c0 / 8 % 2, read through one of
// two pointers worked out once, so that each load addresses a register plus
// a constant.
template <int WIDTH>
struct SwizzledRow {
  const tile_t* at[2];  // entries x and 8 + x, swizzled
  __device__ __forceinline__ SwizzledRow(const tile_t* row, int r, int x)
      : at{row + (x ^ tile_swizzle<WIDTH>(r)), row + ((8 + x) ^ tile_swizzle<WIDTH>(r))} {}
  // Entry c0 + x of this row, or of the row `rows` below it whose swizzle
  // differs from this one's by 8 * flip (whose entry c0 + x lies where this
  // row's (c0 ^ 8 flip) + x does).
  __device__ __forceinline__ const tile_t* entry(int c0, int rows = 0, int flip = 0) const {
    return at[(c0 / 8 + flip) % 2] + rows * tile_stride<WIDTH> + (c0 & ~15);
  }
};

// x = big + small as the tensor cores read them (TensorFloat-32: the top 19
// bits of each, the rest truncated), both rounded to nearest by half a TF32
// ulp added to the bits (CUTLASS's round_half_ulp_truncate): big as
// cvt.rna.tf32.f32 rounds (x - big is then exact), small left for the
// tensor cores to truncate; |x - big - small| <= 2^-22 |x|. Four integer or
// float instructions, where cvt.rna.tf32.f32 takes about five for each half.
// Both halves round to nearest so that the dropped small * small terms
// carry no sign bias (truncating big biased them, and long sums with them).
// A NaN stays NaN in small (and so in the product).
__device__ __forceinline__ void split_tf32(float x, unsigned& big, unsigned& small) {
  big = (__float_as_uint(x) + 0x1000u) & 0xFFFFE000u;
  small = __float_as_uint(x - __uint_as_float(big)) + 0x1000u;
}

// c += A B on the tensor cores.
__device__ __forceinline__ void mma(scalar_t (&c)[4], const FragA& a, const FragB& b) {
#if PRECISION == PRECISION_F16
  mma_f16(c, a.r, b.r);
#elif PRECISION == PRECISION_F64
  mma_f64(c, a.r, b.r);
#else
  unsigned a_big[4], a_small[4], b_big[2], b_small[2];
#pragma unroll
  for (int e = 0; e < 4; ++e) split_tf32(a.r[e], a_big[e], a_small[e]);
#pragma unroll
  for (int e = 0; e < 2; ++e) split_tf32(b.r[e], b_big[e], b_small[e]);
  mma_tf32(c, a_small, b_big);  // the small terms first, then the large
  mma_tf32(c, a_big, b_small);
  mma_tf32(c, a_big, b_big);
#endif
}

// A = rows `upper` (row g) and `lower` (row g + 8) of a row-major matrix of
// WIDTH columns in global memory, one fragment per KSTEP columns. A null
// row reads zeros.
template <int WIDTH>
__device__ __forceinline__ void a_from_rows(FragA (&a)[WIDTH / KSTEP], const tile_t* upper, const tile_t* lower,
                                            int t) {
#pragma unroll
  for (int ks = 0; ks < WIDTH / KSTEP; ++ks) {
    const int k0 = ks * KSTEP;
#if PRECISION == PRECISION_F16
    const tile_t* rows[2] = {upper, lower};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const tile_t* row = rows[e % 2];
      a[ks].r[e] = row ? *reinterpret_cast<const unsigned*>(row + k0 + 2 * t + 8 * (e / 2)) : 0u;
    }
#else
    // float64: column t of the fragment is entry k0 + 2t, column t + 4 entry
    // k0 + 2t + 1, as b_pair_from_rows reads B's (a 16-byte load a lane)
    const int first = PRECISION == PRECISION_F64 ? k0 + 2 * t : k0 + t;
    const int second = PRECISION == PRECISION_F64 ? first + 1 : first + 4;
    a[ks].r[0] = upper ? upper[first] : (scalar_t)0;
    a[ks].r[1] = lower ? lower[first] : (scalar_t)0;
    a[ks].r[2] = upper ? upper[second] : (scalar_t)0;
    a[ks].r[3] = lower ? lower[second] : (scalar_t)0;
#endif
  }
}

// A thread's A fragments of 16 rows of WIDTH entries (a_from_rows'), held
// in registers or, where KEPT, in dynamic shared memory (the backward's Q
// and dO, K and V: TC_KEPT_DQ and TC_KEPT_DKDV, tensor_backward.cu):
// written once, read back at each use. In shared memory a fragment is
// FRAG_PIECES 16-byte pieces, piece p of fragment ks in its own plane of
// THREADS_ pieces, one a thread (`kept` points at this thread's piece of
// the operand's first plane), so that a warp's read of a piece takes the
// fewest passes of the banks. Each thread reads only its own pieces: no
// barrier is needed.
#if PRECISION == PRECISION_F64
using Piece = double2;
constexpr int FRAG_PIECES = 2;
__device__ __forceinline__ Piece frag_piece(const FragA& a, int p) { return Piece{a.r[2 * p], a.r[2 * p + 1]}; }
__device__ __forceinline__ void set_frag_piece(FragA& a, int p, const Piece& x) {
  a.r[2 * p] = x.x;
  a.r[2 * p + 1] = x.y;
}
#else
using Piece = float4;
constexpr int FRAG_PIECES = 1;
__device__ __forceinline__ float as_float(float x) { return x; }
__device__ __forceinline__ float as_float(unsigned x) { return __uint_as_float(x); }
__device__ __forceinline__ void from_float(float& to, float x) { to = x; }
__device__ __forceinline__ void from_float(unsigned& to, float x) { to = __float_as_uint(x); }
__device__ __forceinline__ Piece frag_piece(const FragA& a, int) {
  return make_float4(as_float(a.r[0]), as_float(a.r[1]), as_float(a.r[2]), as_float(a.r[3]));
}
__device__ __forceinline__ void set_frag_piece(FragA& a, int, const Piece& x) {
  from_float(a.r[0], x.x);
  from_float(a.r[1], x.y);
  from_float(a.r[2], x.z);
  from_float(a.r[3], x.w);
}
#endif

template <int WIDTH, bool KEPT, int THREADS_>
struct RowOperand {
  static constexpr int frags = WIDTH / KSTEP;
  static constexpr int planes = frags * FRAG_PIECES;  // pieces a thread keeps
  FragA held[KEPT ? 1 : frags];                       // the fragments, where not kept
  Piece* kept;

  // The rows `upper` (row g) and `lower` (row g + 8), as a_from_rows reads them.
  __device__ __forceinline__ RowOperand(const tile_t* upper, const tile_t* lower, int t, Piece* planes_at)
      : kept(planes_at + threadIdx.x) {
    if constexpr (KEPT) {
      FragA a[frags];
      a_from_rows<WIDTH>(a, upper, lower, t);
#pragma unroll
      for (int ks = 0; ks < frags; ++ks)
#pragma unroll
        for (int p = 0; p < FRAG_PIECES; ++p) kept[(ks * FRAG_PIECES + p) * THREADS_] = frag_piece(a[ks], p);
    } else {
      a_from_rows<WIDTH>(held, upper, lower, t);
    }
  }

  // use(a) with the fragments a (FragA[WIDTH / KSTEP]).
  template <class Use>
  __device__ __forceinline__ void with_fragments(Use use) const {
    if constexpr (KEPT) {
      FragA a[frags];
#pragma unroll
      for (int ks = 0; ks < frags; ++ks)
#pragma unroll
        for (int p = 0; p < FRAG_PIECES; ++p) set_frag_piece(a[ks], p, kept[(ks * FRAG_PIECES + p) * THREADS_]);
      use(a);
    } else {
      use(held);
    }
  }
};

// A = the scores of keys [n0, n0 + KSTEP) as the C fragments hold them
// (c points at block n0 / 8).
__device__ __forceinline__ FragA a_from_scores(const scalar_t (*c)[4]) {
  FragA a;
#if PRECISION == PRECISION_F16
  a.r[0] = pack_floats(c[0][0], c[0][1]);
  a.r[1] = pack_floats(c[0][2], c[0][3]);
  a.r[2] = pack_floats(c[1][0], c[1][1]);
  a.r[3] = pack_floats(c[1][2], c[1][3]);
#else
  a.r[0] = c[0][0];  // column t: key 2t
  a.r[1] = c[0][2];
  a.r[2] = c[0][1];  // column t + 4: key 2t + 1
  a.r[3] = c[0][3];
#endif
  return a;
}

// B of two blocks of 8 keys: b[m][k][n] = tile[n0 + 8m + n][k0 + k], the
// transpose of 16 rows of a tile (keys as the columns of K^T in Q K^T), by
// one ldmatrix.x4 (ptx.cuh): lanes 16m .. 16m + 15 address rows n0 + 8m ..;
// in float16 their matrices are columns k0 .. and k0 + 8 ..; in float32
// (two 16-bit halves an entry) columns k0 .. and k0 + 4 ..; in float64 one
// 16-byte load a lane, columns k0 + 2t and k0 + 2t + 1 of row n0 + 8m + g
// as B's rows t and t + 4 (b[m].r[0], b[m].r[1]), a_from_rows' order.
template <int WIDTH>
__device__ __forceinline__ void b_pair_from_rows(FragB (&b)[2], const tile_t* tile, int n0, int k0, int lane) {
#if PRECISION == PRECISION_F64
  const SwizzledRow<WIDTH> row(tile + (lane / 4) * tile_stride<WIDTH>, lane / 4, 2 * (lane % 4));  // row g's swizzle: n0 + 8m's
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const double2 pair = *reinterpret_cast<const double2*>(row.entry(k0, n0 + 8 * m));
    b[m].r[0] = pair.x;
    b[m].r[1] = pair.y;
  }
#else
  static_assert(!wgmma_tile<WIDTH>, "wgmma's swizzled tiles are read by the tensor cores (tensor_tiles.cuh)");
  const int entry = (n0 + lane / 16 * 8 + lane % 8) * tile_stride<WIDTH> + k0 + lane / 8 % 2 * (KSTEP / 2);
  unsigned bits[4];
  load_matrices(bits, shared_address(tile) + entry * (int)sizeof(tile_t));
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#if PRECISION == PRECISION_F16
    b[m].r[0] = bits[2 * m];
    b[m].r[1] = bits[2 * m + 1];
#else
    b[m].r[0] = __uint_as_float(bits[2 * m]);
    b[m].r[1] = __uint_as_float(bits[2 * m + 1]);
#endif
  }
#endif
}

// A = rows row0 + g and row0 + g + 8 of a tile in shared memory, columns
// k0 .. k0 + KSTEP - 1 in a_from_rows' order: the two fragments
// b_pair_from_rows reads of those rows are that A's halves (their lane g's
// row, B's rows t and t + 4 as A's columns; by ptx.cuh's layouts in every
// precision, and run in float64's fused dK/dV alone).
template <int WIDTH>
__device__ __forceinline__ FragA a_from_tile_rows(const tile_t* tile, int row0, int k0, int lane) {
  FragB b[2];
  b_pair_from_rows<WIDTH>(b, tile, row0, k0, lane);
  FragA a;
  a.r[0] = b[0].r[0];
  a.r[1] = b[1].r[0];
  a.r[2] = b[0].r[1];
  a.r[3] = b[1].r[1];
  return a;
}

// A warp's A operand of 16 rows [row0, row0 + 16) of a tile that the block
// keeps in shared memory (the fused dK/dV's keys, whose dQ products read
// them as B too), read back at each use: RowOperand's interface.
template <int WIDTH>
struct TileRows {
  const tile_t* tile;
  int row0, lane;
  template <class Use>
  __device__ __forceinline__ void with_fragments(Use use) const {
    FragA a[WIDTH / KSTEP];
#pragma unroll
    for (int ks = 0; ks < WIDTH / KSTEP; ++ks) a[ks] = a_from_tile_rows<WIDTH>(tile, row0, ks * KSTEP, lane);
    use(a);
  }
};

#if PRECISION != PRECISION_F16
// B[k][n] = tile[k0 + k][n0 + n]: 8 columns of a tile (V in P V), rows in
// the order a_from_scores gives the keys, entry by entry (float32, float64;
// float16 takes them in pairs, its widths being multiples of 16).
template <int WIDTH>
__device__ __forceinline__ FragB b_from_columns(const tile_t* tile, int k0, int n0, int lane) {
  FragB b;
  if constexpr (swizzled_tile<WIDTH>) {
    // rows k0 + 2t and k0 + 2t + 1: 2t's swizzle and 2t + 1's differ by 8
    const SwizzledRow<WIDTH> row(tile + 2 * (lane % 4) * tile_stride<WIDTH>, 2 * (lane % 4), lane / 4);
    b.r[0] = *row.entry(n0, k0);
    b.r[1] = *row.entry(n0, k0 + 1, 1);
  } else {
    const tile_t* column = tile + k0 * tile_stride<WIDTH> + n0 + lane / 4;
    b.r[0] = column[(2 * (lane % 4)) * tile_stride<WIDTH>];
    b.r[1] = column[(2 * (lane % 4) + 1) * tile_stride<WIDTH>];
  }
  return b;
}
#endif

// b_from_columns' B of columns n0 .. n0 + 7 of a tile, for an n0 known at
// run time alone (a warp's block of dQ in the fused dK/dV kernel) and the
// same at each use: this lane's two entries found once (rows 2t and 2t + 1
// of column n0 + g), and rows k0 + 2t and k0 + 2t + 1 read k0 rows further
// on (k0 a multiple of 8 keeps each row's swizzle), so that no address
// hangs on n0's parity as b_from_columns' does.
template <int WIDTH>
struct TileColumns {
  const tile_t* at[2];
  __device__ __forceinline__ TileColumns(const tile_t* tile, int n0, int lane) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int row = 2 * (lane % 4) + e;
      at[e] = tile + row * tile_stride<WIDTH> + ((n0 + lane / 4) ^ tile_swizzle<WIDTH>(row));
    }
  }
  __device__ __forceinline__ FragB operator()(int k0) const {
    FragB b;
    b.r[0] = at[0][k0 * tile_stride<WIDTH>];
    b.r[1] = at[1][k0 * tile_stride<WIDTH>];
    return b;
  }
};

// The B of columns n0 .. n0 + 7 and n0 + 8 .. n0 + 15 (b_from_columns'):
// in float16 by one ldmatrix.x4.trans, whose matrices are rows k0 .. and
// k0 + 8 .. of each (lanes 16m .. 16m + 15 address rows k0 .. k0 + 15 at
// column n0 + 8m).
template <int WIDTH>
__device__ __forceinline__ void b_pair_from_columns(FragB (&b)[2], const tile_t* tile, int k0, int n0, int lane) {
#if PRECISION == PRECISION_F16
  static_assert(!wgmma_tile<WIDTH>, "wgmma's swizzled tiles are read by the tensor cores (tensor_tiles.cuh)");
  const int entry = (k0 + lane % 16) * tile_stride<WIDTH> + n0 + lane / 16 * 8;
  unsigned bits[4];
  load_matrices_trans(bits, shared_address(tile) + entry * (int)sizeof(tile_t));
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    b[m].r[0] = bits[2 * m];
    b[m].r[1] = bits[2 * m + 1];
  }
#else
  b[0] = b_from_columns<WIDTH>(tile, k0, n0, lane);
  b[1] = b_from_columns<WIDTH>(tile, k0, n0 + 8, lane);
#endif
}

// The shared address of entry (row, col) of a tile at shared address `tile`.
template <int WIDTH>
__device__ __forceinline__ shared_address_t tile_address(shared_address_t tile, int row, int col) {
  return tile + (row * tile_stride<WIDTH> + (col ^ tile_swizzle<WIDTH>(row))) * (int)sizeof(tile_t);
}

// A block's split of a tile of ROWS_ rows of WIDTH entries into 16-byte
// pieces, consecutive threads on consecutive pieces. Where the block's
// threads cover whole rows (`strided`), each copies column `c` of rows r0,
// r0 + step, ..., so that its shared addresses step by constants from
// `target[j % period]`: rows 8 apart share their swizzle, so that a thread
// whose rows are `step` < 8 apart works out the first 8 / step of its
// addresses.
template <int WIDTH, int ROWS_, int THREADS_>
struct Pieces {
  static constexpr int per_piece = 16 / (int)sizeof(tile_t), count = WIDTH / per_piece;  // WIDTH: whole pieces
  static constexpr int step = THREADS_ / count;  // rows between a thread's pieces
  static constexpr bool strided = THREADS_ % count == 0 && step <= ROWS_ && ROWS_ % step == 0;
  static constexpr int period = swizzled_tile<WIDTH> && step < 8 ? 8 / step : 1;
  static constexpr int target_step = period * step * tile_stride<WIDTH> * (int)sizeof(tile_t);
  int r0, c;
  shared_address_t target[period];
  __device__ __forceinline__ explicit Pieces(const tile_t* tile)
      : r0(THREADS_ == count ? 0 : threadIdx.x / count),  // 0 known to the compiler where a row takes every thread
        c(threadIdx.x % count * per_piece) {
#pragma unroll
    for (int j = 0; j < period; ++j) target[j] = tile_address<WIDTH>(shared_address(tile), r0 + j * step, c);
  }
  // The shared address of this thread's piece of row r0 + j * step.
  __device__ __forceinline__ shared_address_t target_of(int j) const {
    return target[j % period] + j / period * target_step;
  }
};

// Start copying rows [first, first + ROWS_) of a (rows, WIDTH) row-major
// matrix into a tile, zeros past `end` (ptx.cuh's cp.async: complete after
// async_wait and a barrier); `row_of(r)` gives the matrix row of tile row r.
template <int WIDTH, int ROWS_, int THREADS_, class RowOf>
__device__ __forceinline__ void load_tile(tile_t* tile, const tile_t* __restrict__ matrix, long long first,
                                          long long end, RowOf row_of) {
  using P = Pieces<WIDTH, ROWS_, THREADS_>;
  if constexpr (P::strided) {
    const P p(tile);
#pragma unroll
    for (int j = 0; j < ROWS_ / P::step; ++j) {
      const long long r = first + p.r0 + j * P::step;
      const tile_t* source = r < end ? matrix + row_of(r) * WIDTH + p.c : matrix;
      async_copy_16(p.target_of(j), source, r < end);
    }
  } else {
    for (int e = threadIdx.x; e < ROWS_ * P::count; e += THREADS_) {
      const int r = e / P::count, c = (e % P::count) * P::per_piece;
      const bool valid = first + r < end;
      const tile_t* source = valid ? matrix + row_of(first + r) * WIDTH + c : matrix;
      async_copy_16(tile_address<WIDTH>(shared_address(tile), r, c), source, valid);
    }
  }
}

// load_tile of consecutive rows [first, first + ROWS_) (the key and value
// tiles): each thread's sources step by constants from one pointer, so that
// a whole tile, the common one, takes one instruction a piece; a partial
// tile tests each row.
template <int WIDTH, int ROWS_, int THREADS_>
__device__ __forceinline__ void load_rows(tile_t* tile, const tile_t* __restrict__ matrix, long long first,
                                          long long end) {
  using P = Pieces<WIDTH, ROWS_, THREADS_>;
  if constexpr (P::strided) {
    const P p(tile);
    const tile_t* source = matrix + (first + p.r0) * WIDTH + p.c;
    constexpr int source_step = P::step * WIDTH;
    if (end - first >= ROWS_) {
#pragma unroll
      for (int j = 0; j < ROWS_ / P::step; ++j)
        async_copy_16(p.target_of(j), source + j * source_step, true);
    } else {
      const int rows = (int)(end - first);
#pragma unroll
      for (int j = 0; j < ROWS_ / P::step; ++j) {
        const bool valid = p.r0 + j * P::step < rows;
        async_copy_16(p.target_of(j), valid ? source + j * source_step : matrix, valid);
      }
    }
  } else {
    load_tile<WIDTH, ROWS_, THREADS_>(tile, matrix, first, end, [](long long r) { return r; });
  }
}

// Sum of x over the 4 lanes of a row's group (lanes 4g .. 4g + 3).
__device__ __forceinline__ scalar_t group_sum(scalar_t x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ scalar_t group_max(scalar_t x) {
  x = larger(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return larger(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
