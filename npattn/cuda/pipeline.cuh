// The score pipeline of CONVENTIONS.md section 1b, for one (query row, key) pair,
// as the CUDA kernels of npattn.fast_cupy run it. Each function is the CUDA
// transcription of one unit of npattn/scores (named beside it), with the same
// formulas, so that every path computes the same numbers:
//
//   1. s   = scale * q_i . k_j                          (the kernels' products)
//   2. s  <- c tanh(s / c)                              softcap.py
//   3. s  <- s + bias[b, n, i, j] - m_n |p_i - j|       (the user's bias), alibi.py
//   5. hidden unless  i < q_len, j < kv_len,             visibility.py
//                     p_i - left <= j <= p_i + right,
//                     q_seg_i == kv_seg_j,
//                     mask[b, n, i, j],                 (the user's bool mask)
//                     bias[b, n, i, j] > -inf           (a -inf bias entry acts as a mask)
//   7. keep_ij = mix32(... ^ j) >= threshold            dropout.py
//
// Step 4 (user score modifications) is not here: npattn.fast_cupy leaves
// such calls to the generic chunked path.
// Sinks (step 6) are merged outside the kernels, as on every path.
//
// Compiled with scalar_t defined as float or double (the compute dtype).

// ---------------------------------------------------------------- config
// The call's scalar options and the addresses of its per-batch arrays,
// passed to every kernel by value (no copy to the device per call; one
// argument, not seven): npattn/fast_cupy.py's CONFIG_DTYPE, field for field.
struct Config {
  long long B;               // batch elements (the leading axes flattened)
  long long N;               // query heads
  long long KH;              // kv heads
  long long T;               // query length
  long long S;               // key length
  long long left;            // window's left side, -1: unbounded (clipped to T + S)
  long long right;           // window's right side, -1: unbounded (causal: 0)
  long long q_offset;        // position of query 0, when one offset serves every batch element
  long long drop_threshold;  // keep a hash >= this (npattn.dropout.keep_threshold)
  long long seed_hash;       // the seed's hash (npattn.dropout._seed_hash)
  long long row0;            // row index of query 0 in the dropout hash (index_origin)
  long long col0;            // column index of key 0 in the dropout hash
  long long splits;          // forward: key splits per (batch, kv head) (flash-decoding)
  long long dropout;         // 1 with dropout, else 0
  long long kv_head_rows;    // rows of k and v from one kv head's first key to the next's (S when contiguous)
  long long q_offsets;       // address of (B,) int64 per-batch positions of query 0, or 0
  long long q_lengths;       // address of (B,) int64, or 0
  long long kv_lengths;      // address of (B,) int64, or 0
  long long q_segments;      // address of (B, T) int64, or 0
  long long kv_segments;     // address of (B, S) int64, or 0
  long long slopes;          // address of ALiBi's (B, N) scalar_t, or 0
  long long mask;            // address of the user's bool mask, or 0: entry (b, n, i, j) at
  long long mask_stride_b;   //   mask + b stride_b + n stride_n + i stride_i + j stride_j,
  long long mask_stride_n;   //   its strides in entries (bytes), 0 along the axes it
  long long mask_stride_i;   //   broadcasts over
  long long mask_stride_j;
  long long bias;            // address of the user's bias in scalar_t, or 0: its strides as the mask's
  long long bias_stride_b;
  long long bias_stride_n;
  long long bias_stride_i;
  long long bias_stride_j;
  long long bias_grad;       // address of (B, N, T, S) scalar_t zeros for dS (the dQ kernels'), or 0
  double scale;              // softmax scale (rounded to scalar_t by read_problem)
  double softcap;            // softcap c, 0: none
  double keep_scale;         // 1 / (1 - dropout_p)
};

__device__ __forceinline__ float fn_exp(float x) { return expf(x); }
__device__ __forceinline__ double fn_exp(double x) { return exp(x); }
__device__ __forceinline__ float fn_log(float x) { return logf(x); }
__device__ __forceinline__ double fn_log(double x) { return log(x); }
__device__ __forceinline__ float fn_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double fn_tanh(double x) { return tanh(x); }
// The larger of a running maximum `m` (never NaN) and `x`: fmax for float
// (one instruction), a compare and a select for double, where fmax takes
// about 7 (its NaN rules); a NaN x leaves m as fmax would.
__device__ __forceinline__ float larger(float m, float x) { return fmaxf(m, x); }
__device__ __forceinline__ double larger(double m, double x) { return x > m ? x : m; }
__device__ __forceinline__ float negative_infinity(float) { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ double negative_infinity(double) { return -__longlong_as_double(0x7ff0000000000000LL); }

// ---------------------------------------------------------------- dropout.py
__device__ __forceinline__ unsigned int mix32(unsigned int x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// ---------------------------------------------------------------- one problem
// The whole call's options, read once per thread from `config`.
struct Problem {
  int B, N, KH, G, T, S;
  int kv_head_rows;  // kv head h of batch element b: k and v from row (b * KH + h) * kv_head_rows
  long long left, right, q_offset, row0, col0;
  bool dropout;
  unsigned long long drop_threshold;
  unsigned int seed_hash;
  scalar_t scale, softcap, keep_scale;
  const long long* q_offsets;    // (B,) per-batch positions of query 0, or null
  const long long* q_lengths;    // (B,) or null
  const long long* kv_lengths;   // (B,) or null
  const long long* q_segments;   // (B, T) or null
  const long long* kv_segments;  // (B, S) or null
  const scalar_t* slopes;        // ALiBi (B, N), or null
  const unsigned char* mask;     // the user's bool mask (USER_MASK builds), or null
  long long mask_stride_b, mask_stride_n, mask_stride_i, mask_stride_j;
  const scalar_t* bias;          // the user's bias (USER_BIAS builds), or null
  long long bias_stride_b, bias_stride_n, bias_stride_i, bias_stride_j;
  scalar_t* bias_grad;           // dS (B, N, T, S), written by the dQ kernels (USER_BIAS builds), or null
};

// PLAIN_SCORES 1: kernels built for calls with plain scores and no segment
// ids (no softcap, ALiBi, dropout or segment ids: npattn.fast_cupy picks
// them per call), where read_problem makes those options compile-time
// absent, so that their branches, and the registers they hold, leave the
// kernels; 0: every option read from the call's Config.
#ifndef PLAIN_SCORES
#define PLAIN_SCORES 0
#endif

// USER_MASK 1: kernels built for calls with the user's bool mask, whose
// Row holds its offset to the row's entries; 0: no mask (the pointer
// compile-time null, Row as it was).
#ifndef USER_MASK
#define USER_MASK 0
#endif

// USER_BIAS 1: kernels built for calls with the user's bias, whose Row
// holds its offset to the row's entries and whose dQ kernels write dS, the
// bias's gradient before its broadcast axes are summed; 0: no bias.
#ifndef USER_BIAS
#define USER_BIAS 0
#endif

__device__ __forceinline__ Problem read_problem(const Config& config) {
  Problem pb;
  pb.B = (int)config.B;
  pb.N = (int)config.N;
  pb.KH = (int)config.KH;
  pb.G = pb.N / pb.KH;
  pb.T = (int)config.T;
  pb.S = (int)config.S;
  pb.kv_head_rows = (int)config.kv_head_rows;
  pb.left = config.left;
  pb.right = config.right;
  pb.q_offset = config.q_offset;
  pb.dropout = config.dropout != 0;
  pb.drop_threshold = (unsigned long long)config.drop_threshold;
  pb.seed_hash = (unsigned int)config.seed_hash;
  pb.row0 = config.row0;
  pb.col0 = config.col0;
  pb.scale = (scalar_t)config.scale;
  pb.softcap = (scalar_t)config.softcap;
  pb.keep_scale = (scalar_t)config.keep_scale;
  pb.q_offsets = reinterpret_cast<const long long*>(config.q_offsets);
  pb.q_lengths = reinterpret_cast<const long long*>(config.q_lengths);
  pb.kv_lengths = reinterpret_cast<const long long*>(config.kv_lengths);
  pb.q_segments = reinterpret_cast<const long long*>(config.q_segments);
  pb.kv_segments = reinterpret_cast<const long long*>(config.kv_segments);
  pb.slopes = reinterpret_cast<const scalar_t*>(config.slopes);
  pb.mask = USER_MASK ? reinterpret_cast<const unsigned char*>(config.mask) : nullptr;
  pb.mask_stride_b = config.mask_stride_b;
  pb.mask_stride_n = config.mask_stride_n;
  pb.mask_stride_i = config.mask_stride_i;
  pb.mask_stride_j = config.mask_stride_j;
  pb.bias = USER_BIAS ? reinterpret_cast<const scalar_t*>(config.bias) : nullptr;
  pb.bias_stride_b = config.bias_stride_b;
  pb.bias_stride_n = config.bias_stride_n;
  pb.bias_stride_i = config.bias_stride_i;
  pb.bias_stride_j = config.bias_stride_j;
  pb.bias_grad = USER_BIAS ? reinterpret_cast<scalar_t*>(config.bias_grad) : nullptr;
#if PLAIN_SCORES
  pb.dropout = false;
  pb.softcap = 0;
  pb.q_segments = pb.kv_segments = nullptr;
  pb.slopes = nullptr;
#endif
  return pb;
}

// What one query row needs for every key: its position, its visibility
// bounds, its segment id, ALiBi slope and dropout hash.
struct Row {
  long long position;   // p_i = i + q_offset
  long long first_key;  // keys [first_key, end_key) pass the window and kv_len
  long long end_key;
  long long segment;
  scalar_t slope;
  unsigned int hash;    // dropout: mix32(mix32(mix32(b ^ seed) ^ n) ^ row)
#if USER_MASK
  long long mask_row;   // b stride_b + n stride_n + i stride_i: the row's entries of the mask, stride_j apart
#endif
#if USER_BIAS
  long long bias_row;   // the same, of the bias
#endif
};

__device__ __forceinline__ long long batch_offset(const Problem& pb, int b) {
  return pb.q_offsets ? pb.q_offsets[b] : pb.q_offset;
}

__device__ __forceinline__ long long batch_kv_len(const Problem& pb, int b) {
  return pb.kv_lengths ? pb.kv_lengths[b] : (long long)pb.S;
}

__device__ __forceinline__ long long batch_q_len(const Problem& pb, int b) {
  return pb.q_lengths ? pb.q_lengths[b] : (long long)pb.T;
}

// Row i of query head n in batch element b; a padded row (i >= q_len)
// sees no key.
__device__ __forceinline__ Row make_row(const Problem& pb, int b, int n, int i) {
  Row row;
  row.position = i + batch_offset(pb, b);
  long long first = 0, end = batch_kv_len(pb, b);
  if (pb.left >= 0) first = max(first, row.position - pb.left);
  if (pb.right >= 0) end = min(end, row.position + pb.right + 1);
  row.first_key = first;
  const bool padded = i >= pb.T || i >= batch_q_len(pb, b);  // padded rows see nothing
  row.end_key = padded ? first : end;
  row.segment = (pb.q_segments && i < pb.T) ? pb.q_segments[(long long)b * pb.T + i] : 0;
  row.slope = pb.slopes ? pb.slopes[(long long)b * pb.N + n] : (scalar_t)0;
  // only dropout reads the hash (dK/dV makes a Row per query row and tile)
  const unsigned int row_number = (unsigned int)(pb.row0 + i);
  row.hash = pb.dropout ? mix32(mix32(mix32((unsigned int)b ^ pb.seed_hash) ^ (unsigned int)n) ^ row_number) : 0u;
#if USER_MASK
  row.mask_row = b * pb.mask_stride_b + n * pb.mask_stride_n + i * pb.mask_stride_i;
#endif
#if USER_BIAS
  row.bias_row = b * pb.bias_stride_b + n * pb.bias_stride_n + i * pb.bias_stride_i;
#endif
  return row;
}

// The user's bias at (row, key j) (USER_BIAS builds; 0 otherwise), 0 past
// the last key, which it does not hold: the tensor-core forward scores a
// partial tile's every column before it hides those past the keys' end.
__device__ __forceinline__ scalar_t bias_entry(const Problem& pb, const Row& row, long long j) {
#if USER_BIAS
  return j < pb.S ? pb.bias[row.bias_row + j * pb.bias_stride_j] : (scalar_t)0;
#else
  return 0;
#endif
}

// Whether a row's key range [first_key, end_key) alone says which keys it
// sees (no segment ids, mask or -inf bias entries hide keys within it), so
// that a tile inside every row's range needs no test per score.
__device__ __forceinline__ bool ranges_decide_visibility(const Problem& pb) {
  return !pb.kv_segments && !USER_MASK && !USER_BIAS;
}

// Whether the scores are scale * q . k alone (no softcap, ALiBi or bias),
// so that a kernel may compute them in base 2 without the pipeline's units.
__device__ __forceinline__ bool plain_scores(const Problem& pb) { return pb.softcap == 0 && !pb.slopes && !USER_BIAS; }

// Step 5: whether key j is visible to the row.
__device__ __forceinline__ bool visible(const Problem& pb, const Row& row, int b, long long j) {
  if (j < row.first_key || j >= row.end_key) return false;
#if USER_MASK
  if (!pb.mask[row.mask_row + j * pb.mask_stride_j]) return false;
#endif
  if (USER_BIAS && bias_entry(pb, row, j) == negative_infinity((scalar_t)0)) return false;
  return !pb.kv_segments || pb.kv_segments[(long long)b * pb.S + j] == row.segment;
}

// Steps 1-3: the score from the product q_i . k_j. `capped_tanh` keeps
// t = tanh(s / c) for the backward (0 without a softcap).
__device__ __forceinline__ scalar_t score(const Problem& pb, const Row& row, long long j, scalar_t product,
                                          scalar_t& capped_tanh) {
  scalar_t s = pb.scale * product;
  capped_tanh = 0;
  if (pb.softcap != 0) {
    capped_tanh = fn_tanh(s / pb.softcap);
    s = pb.softcap * capped_tanh;
  }
  if (USER_BIAS) s += bias_entry(pb, row, j);
  if (pb.slopes) s -= row.slope * (scalar_t)llabs(row.position - j);
  return s;
}

// Step 7: the dropout factor keep / (1 - p) of entry (row, j); 1 without dropout.
__device__ __forceinline__ scalar_t dropout_factor(const Problem& pb, const Row& row, long long j) {
  if (!pb.dropout) return 1;
  unsigned int h = mix32(row.hash ^ (unsigned int)(pb.col0 + j));
  return (unsigned long long)h >= pb.drop_threshold ? pb.keep_scale : (scalar_t)0;
}

// The backward of steps 2-3: from dS (the gradient of the final score) the
// gradient of the raw scaled product, and the ALiBi term's share
// -dS |p_i - j| of the slope's gradient (added to `slope_grad`).
__device__ __forceinline__ scalar_t score_backward(const Problem& pb, const Row& row, long long j, scalar_t ds,
                                                   scalar_t capped_tanh, scalar_t& slope_grad) {
  if (pb.slopes) slope_grad -= ds * (scalar_t)llabs(row.position - j);
  if (pb.softcap != 0) ds *= 1 - capped_tanh * capped_tanh;
  return ds;
}

// One entry (row, key j) of the backward, given the two products:
// returns dR_ij (through steps 3-2) and sets the dropped probability
// P_ij drop_ij; adds the ALiBi slope's share to `slope_grad`; writes dS_ij,
// the bias's gradient, to `score_grad` where that is not null
// (bias_grad_at).
__device__ __forceinline__ scalar_t entry_backward(const Problem& pb, const Row& row, long long j, scalar_t product,
                                                   scalar_t dp, scalar_t row_lse, scalar_t row_D,
                                                   scalar_t& dropped, scalar_t& slope_grad,
                                                   scalar_t* score_grad = nullptr) {
  scalar_t capped_tanh;
  const scalar_t p = fn_exp(score(pb, row, j, product, capped_tanh) - row_lse);
  const scalar_t drop = dropout_factor(pb, row, j);
  dropped = p * drop;
  const scalar_t ds = p * (dp * drop - row_D);
  if (score_grad) *score_grad = ds;
  return score_backward(pb, row, j, ds, capped_tanh, slope_grad);
}

// Where the dQ kernels write dS_ij of key j and the row of (B, N, T) index
// `row_index` (-1: a thread's row past the last, which writes nothing):
// entry (row_index, j) of the bias's gradient before its broadcast axes
// are summed; null without a bias. Each entry is written once, by the
// thread that computes it; the entries no row sees stay 0.
__device__ __forceinline__ scalar_t* bias_grad_at(const Problem& pb, long long row_index, long long j) {
  return USER_BIAS && row_index >= 0 ? pb.bias_grad + row_index * pb.S + j : nullptr;
}
