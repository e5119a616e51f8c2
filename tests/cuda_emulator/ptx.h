// The emulator's stand-in for npattn/cuda/ptx.cuh (the tensor cores' PTX
// mma.sync): the same functions and fragment layouts, in C++. A product
// gathers the warp's operands (emulator.h's warp_gather) and each lane sums
// its own four entries of C from them, the products exact and summed in
// double, then rounded to float32 (the hardware sums in at least float32, in
// an order PTX leaves open); in float64, each product and sum rounded to
// float64 (fused multiply-adds, in k's order).
#define PRECISION_F16 1
#define PRECISION_TF32X3 2
#define PRECISION_F64 3

inline unsigned pack_halves(unsigned short low, unsigned short high) { return (unsigned)low | ((unsigned)high << 16); }

inline unsigned pack_floats(float low, float high) { return pack_halves(half_bits(low), half_bits(high)); }

namespace cuda_emulator {

// One lane's A and B fragments (32-bit words, or doubles in float64).
template <class Word>
struct Fragments {
  Word a[4], b[2];
};
using MmaOperands = Fragments<unsigned>;

// Every lane's fragments, gathered from the warp.
template <class Word>
inline void gather_fragments(detail::Site site, const Word (&a)[4], const Word (&b)[2], Fragments<Word> (&all)[32]) {
  Fragments<Word> mine{};
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  detail::warp_gather(site, mine, all);
}

// Each lane's C entries from every lane's operands; `a_entry(ops, r, k)` and
// `b_entry(ops, k, n)` read A[r][k] and B[k][n] out of the gathered fragments.
template <int K, class AEntry, class BEntry>
inline void mma_lane(detail::Site site, float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2], AEntry a_entry,
                     BEntry b_entry) {
  MmaOperands all[32];
  gather_fragments(site, a, b, all);
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e / 2), n = 2 * t + e % 2;
    double sum = 0;
    for (int k = 0; k < K; ++k) sum += (double)a_entry(all, r, k) * (double)b_entry(all, k, n);
    c[e] = (float)((double)c[e] + sum);
  }
}

inline float half_of(unsigned word, int high) { return half_value((unsigned short)(high ? word >> 16 : word & 0xFFFFu)); }

inline void mma_f16_at(detail::Site site, float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  mma_lane<16>(
      site, c, a, b,
      [](const MmaOperands* all, int r, int k) {  // a[0] rows 0-7 cols 0-7, a[1] rows 8-15, a[2] cols 8-15, ...
        return half_of(all[(r % 8) * 4 + (k % 8) / 2].a[(r / 8) + 2 * (k / 8)], k % 2);
      },
      [](const MmaOperands* all, int k, int n) { return half_of(all[n * 4 + (k % 8) / 2].b[k / 8], k % 2); });
}

inline void mma_tf32_at(detail::Site site, float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  mma_lane<8>(
      site, c, a, b,
      [](const MmaOperands* all, int r, int k) {  // the tensor cores read the top 19 bits
        return __uint_as_float(all[(r % 8) * 4 + k % 4].a[(r / 8) + 2 * (k / 4)] & 0xFFFFE000u);
      },
      [](const MmaOperands* all, int k, int n) { return __uint_as_float(all[n * 4 + k % 4].b[k / 4] & 0xFFFFE000u); });
}

// m16n8k8 in float64, with the TF32 layouts of ptx.cuh (one double an entry).
inline void mma_f64_at(detail::Site site, double (&c)[4], const double (&a)[4], const double (&b)[2]) {
  Fragments<double> all[32];
  gather_fragments(site, a, b, all);
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int r = g + 8 * (e / 2), n = 2 * t + e % 2;
    for (int k = 0; k < 8; ++k)
      c[e] = std::fma(all[(r % 8) * 4 + k % 4].a[(r / 8) + 2 * (k / 4)], all[n * 4 + k % 4].b[k / 4], c[e]);
  }
}

namespace detail {
// A GPU faults on an access at an address that is not a multiple of its
// size (ldmatrix's 16-byte rows, cp.async's copies): so does the emulator.
inline void check_aligned(Site site, const char* what, const char* space, const void* address, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(address) % bytes == 0) return;
  fail("%s at %s:%d: thread (%u,%u,%u) of block (%u,%u,%u) gives %s address %p, not a multiple of %zu bytes", what,
       site.file, site.line, threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z, space,
       address, bytes);
}
}  // namespace detail

// ldmatrix .x4: the warp's row addresses gathered, then each lane's entries.
inline void load_matrices_at(detail::Site site, unsigned (&r)[4], const void* row, bool trans) {
  detail::check_aligned(site, trans ? "ldmatrix.trans" : "ldmatrix", "a row's shared", row, 16);
  const void* rows[32];
  detail::warp_gather(site, row, rows);
  const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  for (int m = 0; m < 4; ++m) {
    unsigned short entry[2];
    for (int e = 0; e < 2; ++e) {  // (g, 2t + e), or transposed (2t + e, g)
      const unsigned row_index = trans ? 2 * t + e : g, column = trans ? g : 2 * t + e;
      std::memcpy(&entry[e], static_cast<const unsigned char*>(rows[8 * m + row_index]) + 2 * column, 2);
    }
    r[m] = pack_halves(entry[0], entry[1]);
  }
}

// wgmma (sm_90a, ptx.cuh's TC_WGMMA): the descriptor keeps the tile's
// address whole (the GPU's 14 bits of it are a shared-window offset), and
// each entry of B is read where the tensor cores read it: the canonical
// layout's address (ptx.cuh: K-major rows n, or MN-major rows k, 128 bytes
// apart, 8-row groups `stride_bytes` apart, 64-column blocks
// `leading_bytes` apart), its 16-byte piece then swizzled by the address's
// own bits (bits 4-6 ^= bits 7-9, as the GPU does: a tile not 1024-byte
// aligned reads other pieces there and here alike). A gathered from the
// warpgroup's 128 threads, D's entries each summed as mma_f16's are.
struct wgmma_descriptor_t {
  const unsigned char* start;
  int leading_bytes, stride_bytes;
};
inline wgmma_descriptor_t wgmma_descriptor(const unsigned char* start, int leading_bytes, int stride_bytes) {
  return {start, leading_bytes, stride_bytes};
}

inline float wgmma_b_entry(const wgmma_descriptor_t& b, bool trans_b, int k, int n) {
  const int row = trans_b ? k : n, column = trans_b ? n % 64 : k;
  const std::uintptr_t logical = reinterpret_cast<std::uintptr_t>(b.start) + (row % 8) * 128 +
                                 (row / 8) * b.stride_bytes + (trans_b ? (n / 64) * b.leading_bytes : 0) +
                                 column * 2;
  const std::uintptr_t swizzled = logical ^ (((logical >> 7) & 7) << 4);
  unsigned short bits;
  std::memcpy(&bits, reinterpret_cast<const void*>(swizzled), 2);
  return half_value(bits);
}

template <int TRANS_B>
inline void wgmma_f16_at(detail::Site site, float (&d)[8][4], const unsigned (&a)[4], wgmma_descriptor_t b,
                         int accumulate) {
  detail::check_aligned(site, "wgmma", "a descriptor's shared", b.start, 16);
  if ((reinterpret_cast<std::uintptr_t>(b.start) >> 7) % 8 != 0)  // the descriptors' base offset is 0
    detail::fail("wgmma at %s:%d: a descriptor's start %p lies in the swizzle's row %d, not in a 1024-byte-aligned "
                 "pattern's first",
                 site.file, site.line, static_cast<const void*>(b.start),
                 (int)((reinterpret_cast<std::uintptr_t>(b.start) >> 7) % 8));
  struct Lane {
    unsigned a[4];
  } mine{}, all[128];
  std::memcpy(mine.a, a, sizeof mine.a);
  detail::warp_gather<128>(site, mine, all);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x % 128 / 32, g = lane / 4, t = lane % 4;
  for (int nb = 0; nb < 8; ++nb)
    for (int e = 0; e < 4; ++e) {
      const int r = g + 8 * (e / 2), n = nb * 8 + 2 * t + e % 2;  // row r of this warp's 16
      double sum = 0;
      for (int k = 0; k < 16; ++k) {
        const Lane& holder = all[warp * 32 + (r % 8) * 4 + (k % 8) / 2];  // mma_f16's A layout, warp by warp
        sum += (double)half_of(holder.a[(r / 8) + 2 * (k / 8)], k % 2) * (double)wgmma_b_entry(b, TRANS_B, k, n);
      }
      d[nb][e] = accumulate ? (float)((double)d[nb][e] + sum) : (float)sum;
    }
}

}  // namespace cuda_emulator

// A shared-memory address: the emulator's shared memory is host memory, so an
// address is a byte pointer (offsets in bytes, as on the GPU).
typedef unsigned char* shared_address_t;
inline shared_address_t shared_address(const void* pointer) {
  return static_cast<unsigned char*>(const_cast<void*>(pointer));
}

// cp.async as a GPU may run it at its latest: a copy writes its shared bytes
// only when its thread waits for its group (async_wait<N>: every committed
// group but the newest N), and until then they hold 0xff bytes (NaN in
// every float type), written when it is issued. So a kernel that reads a
// tile before waiting for its copy (or, after the wait, before the barrier
// that covers the other threads' copies) reads NaN rather than the tile and
// fails the tests, where a GPU would race. A copy issued into a tile that
// other threads have yet to read spoils their reads too, but the emulator's
// threads seldom get that far ahead (its shuffles and mma gathers hold the
// whole block at each), so a missing barrier before a tile's next copy
// passes here unless the race check (racecheck.h) is on: it sees the issue
// as a write of the tile, and fails it.
namespace cuda_emulator::detail {
inline AsyncCopies& my_async_copies() {
  Launch& L = current_launch("cp.async");
  return L.fibers[L.current].copies;
}
// Not instrumented by the race check (racecheck.h): it sees the issue and
// the landing as accesses of their own, made at the kernel's line.
__attribute__((no_sanitize_thread, noinline)) inline void issue_async_copy(void* shared, const void* global,
                                                                           unsigned size) {
  CUDA_EMULATOR_RACECHECK_CALL(access(shared, size, racecheck::Access::copy_issue, __builtin_return_address(0)));
  AsyncCopy copy{static_cast<unsigned char*>(shared), {}, size};
  // the source's bytes now (global memory stays put while a kernel runs); zeros where nullptr
  if (global != nullptr) std::memcpy(copy.bytes, global, size);
  std::memset(shared, 0xff, size);
  my_async_copies().open.push_back(copy);
}
// async_wait<pending>: every committed group but the newest `pending` lands.
__attribute__((no_sanitize_thread, noinline)) inline void land_async_copies(std::size_t pending) {
  auto& copies = my_async_copies();
  while (copies.committed.size() > pending) {
    for (const auto& copy : copies.committed.front()) {
      CUDA_EMULATOR_RACECHECK_CALL(
          access(copy.shared, copy.size, racecheck::Access::copy_landing, __builtin_return_address(0)));
      std::memcpy(copy.shared, copy.bytes, copy.size);
    }
    copies.committed.pop_front();
  }
}
}  // namespace cuda_emulator::detail

namespace cuda_emulator {
// Both addresses a multiple of the copy's size (the global one too where
// `valid` is false and no byte is read: the instruction takes it all the same).
inline void async_copy_16_at(detail::Site site, void* shared, const void* global, bool valid) {
  detail::check_aligned(site, "cp.async", "shared", shared, 16);
  detail::check_aligned(site, "cp.async", "global", global, 16);
  detail::issue_async_copy(shared, valid ? global : nullptr, 16);
}
template <class T>
inline void async_copy_entry_at(detail::Site site, void* shared, const T* global) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "cp.async copies 4, 8 or 16 bytes");
  detail::check_aligned(site, "cp.async", "shared", shared, sizeof(T));
  detail::check_aligned(site, "cp.async", "global", global, sizeof(T));
  detail::issue_async_copy(shared, global, sizeof(T));
}
}  // namespace cuda_emulator

#define async_copy_16(shared, global, valid) \
  ::cuda_emulator::async_copy_16_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, shared, global, valid)
#define async_copy_entry(shared, global) \
  ::cuda_emulator::async_copy_entry_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, shared, global)
inline void async_commit() {
  auto& copies = ::cuda_emulator::detail::my_async_copies();
  copies.committed.push_back(std::move(copies.open));
  copies.open.clear();
}
template <int PENDING>
inline void async_wait() {
  ::cuda_emulator::detail::land_async_copies(PENDING);
}

// The flags between blocks (ptx.cuh's wait_for_flag, release_flag and
// take_ticket): the emulator runs a grid's blocks one at a time (in
// blockIdx order, or the reverse: emulator.h), so a block finds every flag
// a block with a lower ticket released already set, and one that is not
// would be waited for forever (on a GPU too, where only blocks started
// before it set it): that aborts.
inline int take_ticket(int* counter) { return (*counter)++; }
inline void wait_for_flag(const int* flag, int value) {
  if (*flag < value)
    ::cuda_emulator::detail::fail("block (%u,%u,%u) waits for a flag to reach %d, at %d, which no earlier block sets",
                                  blockIdx.x, blockIdx.y, blockIdx.z, value, *flag);
}
inline void release_flag(int* flag, int value) { *flag = value; }
inline void add_to_global(double* at, double x) { *at += x; }

inline float fast_exp2(float x) { return std::exp2(x); }

#define load_matrices(r, row) \
  ::cuda_emulator::load_matrices_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, r, row, false)
#define load_matrices_trans(r, row) \
  ::cuda_emulator::load_matrices_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, r, row, true)
#define mma_f16(c, a, b) ::cuda_emulator::mma_f16_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, c, a, b)
#define mma_tf32(c, a, b) ::cuda_emulator::mma_tf32_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, c, a, b)
#define mma_f64(c, a, b) ::cuda_emulator::mma_f64_at(::cuda_emulator::detail::Site{__FILE__, __LINE__}, c, a, b)
#define wgmma_f16 ::cuda_emulator::wgmma_f16_site{::cuda_emulator::detail::Site{__FILE__, __LINE__}}.run
namespace cuda_emulator {
// wgmma_f16<TRANS_B>(d, a, b, accumulate) at its call site (a macro cannot take the template argument).
struct wgmma_f16_site {
  detail::Site site;
  template <int TRANS_B>
  void run(float (&d)[8][4], const unsigned (&a)[4], wgmma_descriptor_t b, int accumulate) const {
    wgmma_f16_at<TRANS_B>(site, d, a, b, accumulate);
  }
};
}  // namespace cuda_emulator
using ::cuda_emulator::wgmma_descriptor;
using ::cuda_emulator::wgmma_descriptor_t;
#ifndef TC_WGMMA
#define TC_WGMMA 0
#endif
// The rest of ptx.cuh's wgmma: the emulator's wgmma runs at once, and its
// memory is the threads' own (no proxy, no registers in flight).
inline void wgmma_fence() {}
inline void wgmma_commit() {}
inline void wgmma_wait_all() {}
inline void fence_proxy_async() {}
inline void fence_operands(float (&)[8][4]) {}
