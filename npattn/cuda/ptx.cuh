// The PTX instructions of the tensor-core kernels of npattn.fast_cupy (sm_80
// and later): the tensor cores' matrix product, and the asynchronous copy of
// a tile from global to shared memory.
//
// mma.sync: one warp computes
//
//     C (16 x 8, float32; float64 in PRECISION_F64)  +=  A (16 x KSTEP)  B (KSTEP x 8)
//
// with each operand spread over the warp's 32 lanes in registers. Lane
// `lane` has group g = lane / 4 and thread t = lane % 4, and holds
//
//     C:  c[0], c[1] = C[g][2t], C[g][2t+1];  c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
//
// and, by precision (PRECISION, a -D option):
//
//   PRECISION_F16 (m16n8k16: float16 products, exact, summed in float32)
//     A:  a[0] = A[g][2t..2t+1]  a[1] = A[g+8][2t..2t+1]
//         a[2] = A[g][2t+8..]    a[3] = A[g+8][2t+8..]    (two float16 per register)
//     B:  b[0] = B[2t..2t+1][g]  b[1] = B[2t+8..2t+9][g]
//
//   PRECISION_TF32X3 (m16n8k8, three passes: float32 to about 2^-21)
//     A:  a[0] = A[g][t]  a[1] = A[g+8][t]  a[2] = A[g][t+4]  a[3] = A[g+8][t+4]
//     B:  b[0] = B[t][g]  b[1] = B[t+4][g]
//     each float32 x split into x = big + small, both TensorFloat-32 (10-bit
//     mantissas), and A B ~ big_A big_B + big_A small_B + small_A big_B
//     (NVIDIA's 3xTF32; CUTLASS's OpMultiplyAddFastF32). The tensor cores
//     read a .tf32 operand's top 19 bits (they truncate the rest), so the
//     split is integer arithmetic on the bits (operands.cuh's split_tf32).
//
//   PRECISION_F64 (m16n8k8 in float64: the float64 tensor cores, each
//   product and sum IEEE float64; A, B and C as in TF32X3, one double per
//   register pair): sm_90's mma.m16n8k8.f64, or on sm_80 the four
//   mma.m8n8k4.f64 it is made of (rows g of one, g + 8 of another; columns
//   t, then t + 4), whose fragments are the same lanes' entries.
//
// These layouts are PTX's (the ISA's "Matrix Fragments for mma.m16n8k16" and
// "mma.m16n8k8"). The CPU tests replace this file with an emulation of the
// same functions and layouts (tests/cuda_emulator/ptx.h).

#define PRECISION_F16 1
#define PRECISION_TF32X3 2
#define PRECISION_F64 3

// Two float16 in one register: `low` in bits 0-15 (the lower column or row).
__device__ __forceinline__ unsigned pack_halves(unsigned short low, unsigned short high) {
  return (unsigned)low | ((unsigned)high << 16);
}

__device__ __forceinline__ unsigned pack_floats(float low, float high) {
  return pack_halves(half_bits(low), half_bits(high));
}

__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_f64(double (&c)[4], const double (&a)[4], const double (&b)[2]) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
      : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#else
#pragma unroll
  for (int half = 0; half < 2; ++half)  // columns t (a[0], a[1] and b[0]), then t + 4 (a[2], a[3] and b[1])
#pragma unroll
    for (int rows = 0; rows < 2; ++rows)  // rows g (c[0], c[1]), then g + 8 (c[2], c[3])
      asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};"
                   : "+d"(c[2 * rows]), "+d"(c[2 * rows + 1])
                   : "d"(a[2 * half + rows]), "d"(b[half]));
#endif
}

// A byte address in shared memory (32 bits), as ldmatrix and cp.async take
// it; the address of a generic pointer into shared memory. Offsets are added
// to an address in bytes, so that a tile's address is converted once and
// each access adds a constant (folded into the instruction).
typedef unsigned shared_address_t;

__device__ __forceinline__ shared_address_t shared_address(const void* pointer) {
  unsigned address;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(address) : "l"(pointer));
  return address;
}

// ldmatrix (.x4): four 8 x 8 matrices of 16-bit entries from shared memory,
// lanes 8m .. 8m + 7 giving the addresses of matrix m's rows. Lane (g, t)
// receives in r[m] entries (g, 2t) and (g, 2t + 1) of matrix m; with
// `trans`, entries (2t, g) and (2t + 1, g).
__device__ __forceinline__ void load_matrices(unsigned (&r)[4], shared_address_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row)
               : "memory");
}

__device__ __forceinline__ void load_matrices_trans(unsigned (&r)[4], shared_address_t row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(row)
               : "memory");
}

// cp.async: 16 bytes from global memory to shared memory without passing
// through registers (zeros where `valid` is false), in flight until
// async_wait; async_commit closes a group of copies.
__device__ __forceinline__ void async_copy_16(shared_address_t shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared), "l"(global), "r"(valid ? 16 : 0));
}

// cp.async of one 4- or 8-byte entry (.ca: the form for copies under 16
// bytes), so that a tile's per-row scalars travel with its rows.
template <class T>
__device__ __forceinline__ void async_copy_entry(shared_address_t shared, const T* global) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(shared), "l"(global), "n"((int)sizeof(T)));
}

__device__ __forceinline__ void async_commit() { asm volatile("cp.async.commit_group;"); }

// Wait until at most `PENDING` groups of copies are in flight.
template <int PENDING>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING));
}

// Flags that order the blocks of one grid (the fused dQ's sums,
// tensor_backward.cu), as CUTLASS's generic barrier (cutlass/barrier.h)
// orders its split-K reductions: one thread waits until a flag reaches a
// value (ld.acquire, gpu scope) and the block's barrier then passes that
// order on to its other threads; after a barrier that follows the block's
// writes, one thread releases the flag (fence.acq_rel, then the store). A
// block waits only for blocks that took a lower ticket (take_ticket), which
// have started, so that every block waited for runs or has run.
__device__ __forceinline__ void wait_for_flag(const int* flag, int value) {
  int seen;
  do {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen < value);
}

__device__ __forceinline__ void release_flag(int* flag, int value) {
  asm volatile("fence.acq_rel.gpu;\n\tst.relaxed.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}

// The next ticket of a counter (zero before the launch): the order in
// which the blocks that take one started, for the flags above to follow
// rather than blockIdx, since CUDA promises no order in which a grid's
// blocks start (a block waiting for a block that has not started could
// hold the multiprocessor that one needs).
__device__ __forceinline__ int take_ticket(int* counter) { return atomicAdd(counter, 1); }

// *at += x in global memory (red.add: performed in L2, nothing read back),
// in the order the flags above keep.
__device__ __forceinline__ void add_to_global(double* at, double x) {
  asm volatile("red.relaxed.gpu.global.add.f64 [%0], %1;" ::"l"(at), "d"(x) : "memory");
}

// wgmma (sm_90a alone: TC_WGMMA, npattn.fast_cupy.tensor_wgmma): a
// warpgroup (4 warps, 128 threads, all of them at each instruction) computes
//
//     D (64 x 64, float32)  (+)=  A (64 x 16, float16)  B (16 x 64, float16)
//
// asynchronously: warp w of the group holds rows 16w .. 16w + 15 of A in
// mma.sync's A layout above (a[0..3]) and of D in its C layout, block by
// block of 8 columns (d[nb][0..3], columns 8nb + 2t, 8nb + 2t + 1), while
// the tensor cores read B from shared memory themselves, once for the whole
// group, through a descriptor (PTX's "Matrix Descriptor Format"): the start
// address, the leading and stride byte offsets (LBO, SBO) and the swizzle.
// Here every B is a tile of 128-byte rows (64 float16) in the 128-byte
// swizzle (CUTLASS's Swizzle<3,4,3>, its GMMA Layout_*_SW128_Atom): the
// 16-byte piece p of a row r lies at piece p ^ (r % 8) of the row, from a
// tile start 1024-byte aligned (operands.cuh's tile_swizzle), since the
// tensor cores swizzle the bits of the address itself. The same tile is
//
// - K-major (TRANS_B = 0: B[k][n] = tile[n][k0 + k], K^T in Q K^T): rows n
//   128 bytes apart, 8-row groups SBO = 1024 apart, LBO unused; columns
//   k0 .. k0 + 15 start 2 k0 bytes into the rows;
// - MN-major (TRANS_B = 1: B[k][n] = tile[k0 + k][n], V in P V): rows k
//   128 bytes apart, 8-row groups SBO = 1024 apart (a 16-row k-step starts
//   2048 k0 / 16 bytes on), LBO the bytes between 64-column blocks (none
//   with 64 columns).
//
// wgmma_fence orders the registers' earlier writes before the next wgmma
// reads them, wgmma_commit closes a group of wgmma and wgmma_wait_all waits
// for every group: until then a wgmma's A and D registers are the tensor
// cores' (fence_operands keeps the compiler from moving D's other uses
// across; ptxas holds A's registers itself), and its tile must stay as it
// is. Shared memory written by this thread's generic stores or cp.async
// reaches the tensor cores' async proxy only after fence_proxy_async (then
// a barrier for the other threads').
#ifndef TC_WGMMA
#define TC_WGMMA 0
#endif
#if TC_WGMMA
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "TC_WGMMA needs sm_90a's wgmma (NVRTC's -arch=sm_90a)"
#endif
typedef unsigned long long wgmma_descriptor_t;

__device__ __forceinline__ wgmma_descriptor_t wgmma_descriptor(shared_address_t start, int leading_bytes,
                                                               int stride_bytes) {
  return (wgmma_descriptor_t)((start & 0x3FFFF) >> 4) | ((wgmma_descriptor_t)(leading_bytes >> 4) << 16) |
         ((wgmma_descriptor_t)(stride_bytes >> 4) << 32) | (1ull << 62);  // 1 << 62: the 128-byte swizzle
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void fence_operands(float (&d)[8][4]) {
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[nb][e])::"memory");
}

// D (+)= A B: `accumulate` 0 overwrites D.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_f16(float (&d)[8][4], const unsigned (&a)[4], wgmma_descriptor_t b,
                                          int accumulate) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %37, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]),
        "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate), "n"(TRANS_B));
}
#endif

// 2^x (ex2.approx: about 2 ulp; the softmax's exponentials in base 2); in
// float64, exp2.cuh's.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
