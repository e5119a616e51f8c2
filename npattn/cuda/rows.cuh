// Rows of the stacked layout shared by every kernel of npattn.fast_cupy (on
// CUDA cores and on tensor cores): the G query heads of kv head h stacked
// position-major (row r = i * G + g is query i of head n = h * G + g), and the
// query rows a range of keys is seen by, and the keys a block's rows see.

// Head n = h * G + g and query i of stacked row r = i * G + g < G * T of kv
// head h: none with one query head per kv head (i = r < T, an int), else
// in 32-bit arithmetic wherever r fits (a 64-bit division is a call of some
// 70 instructions; a call has over 2^31 stacked rows per kv head only past
// G * T = 2^31).
__device__ __forceinline__ void stacked_position(const Problem& pb, int h, long long r, int& n, int& i) {
  if (pb.G == 1) {
    i = (int)r;
    n = h;
  } else if (r <= 0x7fffffffLL) {
    i = (int)r / pb.G;
    n = h * pb.G + ((int)r - i * pb.G);
  } else {
    i = (int)(r / pb.G);
    n = h * pb.G + (int)(r % pb.G);
  }
}

// Row of k and v that holds key 0 of kv head h in batch element b: the
// heads are kv_head_rows rows apart (S in C-order arrays, more in a view of a
// longer buffer). b * KH + h < 2^32 (B and KH at most 65535:
// npattn.fast_cupy.MAX_GRID_YZ): exact in 32-bit unsigned arithmetic, which
// leaves the float16 forward's registers as they were with S.
__device__ __forceinline__ long long kv_head_row(const Problem& pb, int b, int h) {
  return (long long)((unsigned)b * pb.KH + h) * pb.kv_head_rows;
}

// Index into (B, N, T) arrays of query i of head n in batch element b.
__device__ __forceinline__ long long row_index(const Problem& pb, int b, int n, int i) {
  return ((long long)b * pb.N + n) * pb.T + i;
}

// Index into (B, N, T) arrays of stacked row r of kv head h in batch element b.
__device__ __forceinline__ long long stacked_index(const Problem& pb, int b, int h, long long r) {
  int n, i;
  stacked_position(pb, h, r, n, i);
  return row_index(pb, b, n, i);
}

// Stacked row r (as stacked_index) and its index. A row at or past `end`
// (a thread of a partial tile) takes the last real row's index, so that
// its reads stay in bounds, and sees no key.
__device__ __forceinline__ Row stacked_row(const Problem& pb, int b, int h, long long r, long long end,
                                           long long& index) {
  const long long real = min(r, end - 1);
  int n, i;
  stacked_position(pb, h, real, n, i);
  index = row_index(pb, b, n, i);
  Row row = make_row(pb, b, n, i);
  if (r >= end) row.end_key = row.first_key;
  return row;
}

// Query rows [first, end) of batch element b that can see some key in
// [key_first, key_last]: the window and the lengths, read backwards.
__device__ __forceinline__ void query_range(const Problem& pb, int b, long long key_first, long long key_last,
                                            long long& first, long long& end) {
  const long long offset = batch_offset(pb, b);
  first = 0;
  end = min((long long)pb.T, batch_q_len(pb, b));
  if (key_first >= batch_kv_len(pb, b)) end = 0;
  if (pb.right >= 0) first = max(first, key_first - pb.right - offset);  // j <= p + right
  if (pb.left >= 0) end = min(end, key_last + pb.left - offset + 1);      // j >= p - left
  if (end < first) end = first;
}

// The union [first, end) of `count` rows' key ranges [first_key, end_key)
// (none: first = 2^62, end = 0).
__device__ __forceinline__ void rows_key_union(const Row* rows, int count, long long& first, long long& end) {
  first = (long long)1 << 62;
  end = 0;
#pragma unroll
  for (int i = 0; i < count; ++i) {
    if (rows[i].end_key <= rows[i].first_key) continue;
    first = min(first, rows[i].first_key);
    end = max(end, rows[i].end_key);
  }
}

// The union over the block of `slots` partial unions [first, end), which
// each slot's `leader` thread writes into `scratch` (2 * slots entries):
// every thread gets it in `first` and `end`.
__device__ __forceinline__ void block_key_union(long long* scratch, int slot, int slots, bool leader,
                                                long long& first, long long& end) {
  if (leader) {
    scratch[slot] = first;
    scratch[slots + slot] = end;
  }
  __syncthreads();
  first = (long long)1 << 62;
  end = 0;
  for (int s = 0; s < slots; ++s) {
    first = min(first, scratch[s]);
    end = max(end, scratch[slots + s]);
  }
  __syncthreads();
}
