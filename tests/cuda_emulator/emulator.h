// CPU emulator for plain CUDA C++ kernel sources (the text CuPy's RawModule
// compiles), for tests on machines without a GPU.
//
//     g++ -std=c++17 -O1 -shared -fPIC -include emulator.h -x c++ kernel.cu ...
//
// The kernel source is compiled as ordinary C++ after this header. The CUDA
// keywords become harmless (`__shared__` becomes `static`), and a launch runs
// the blocks of the grid one at a time, x fastest, then y, then z (or in the
// reverse order, the last block first, where the environment variable
// CUDA_EMULATOR_BLOCK_ORDER is `reversed`: CUDA promises no order). Within a
// block every CUDA thread is a cooperative fiber (ucontext) with its own
// stack, scheduled round-robin in the calling OS thread, so a run is
// deterministic. `__syncthreads()` switches to the next fiber; the block goes
// past a barrier once every fiber has reached it.
//
// Limits (stricter than hardware, and loud: a violation prints a message on
// stderr and aborts):
// - Every thread of a block must reach every `__syncthreads()` and
//   `__shfl_xor_sync()` at the same call site (file and line), in the same
//   order: uniform control flow. A thread that returns while others wait at a
//   barrier, or two threads waiting at different call sites, abort.
// - `__shfl_xor_sync` is a block-wide exchange (a staging buffer and two
//   barriers), so every thread of the block, not only of the warp, must call
//   it; so are `__any_sync` and `warp_gather` (every lane's value to every
//   lane of its warp: what `__any_sync` and ptx.h's warp-wide instructions,
//   mma.sync and ldmatrix, are built on). Reading a lane outside `mask`, or
//   a lane past the end of a partial last warp, aborts.
// - No warp-synchronous programming without barriers: threads run one after
//   the other between barriers.
// - `extern __shared__ T name[];` (dynamic shared memory) needs the source
//   rewrite that build.py does (to `cuda_emulator::dynamic_shared<T>()`);
//   the byte count is launch's 4th argument. It is filled with 0xFF bytes at
//   the start of each block. Static `__shared__` arrays keep their contents
//   from the previous block or launch (real hardware leaves them undefined).
// - Launches are serialized by a process-wide mutex; no launch from a kernel.
// - Include any standard header before the kernel source: afterwards the
//   macros below (`__noinline__` in particular) can break library headers.
//
// Built with CUDA_EMULATOR_RACECHECK defined (build.py's RACECHECK_FLAGS),
// racecheck.h checks every access to shared memory against the other
// threads' of the block, so that a race the round-robin order hides (a warp
// writing a tile another warp may still read) stops the run too.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------- index types
struct uint3 {
  unsigned x, y, z;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};

// The current emulated thread's indices: the scheduler sets them before it
// switches to a fiber.
inline uint3 threadIdx{0, 0, 0};
inline uint3 blockIdx{0, 0, 0};
inline dim3 blockDim{1, 1, 1};
inline dim3 gridDim{1, 1, 1};
inline constexpr int warpSize = 32;

// ------------------------------------------------------------------ keywords
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#ifdef CUDA_EMULATOR_RACECHECK
#define __shared__ static __attribute__((section("cuda_shared")))  // racecheck.h's bounds of the static arrays
#else
#define __shared__ static
#endif

// ------------------------------------------------------------------- runtime
#ifndef CUDA_EMULATOR_STACK_BYTES
#define CUDA_EMULATOR_STACK_BYTES (256 * 1024)
#endif

namespace cuda_emulator {

inline constexpr std::size_t stack_bytes = CUDA_EMULATOR_STACK_BYTES;
inline constexpr std::size_t max_dynamic_shared_bytes = 227 * 1024;  // an H100's opt-in maximum per block
inline constexpr std::size_t gather_slot_bytes = 64;                  // the most one lane gives warp_gather

namespace detail {

enum class Kind { syncthreads, shfl_write, shfl_read, gather_write, gather_read };

struct Site {
  const char* file;
  int line;
};

// A thread's asynchronous copies to shared memory in flight (ptx.h's
// cp.async): the group it is adding to, and those it committed, oldest
// first; each copy holds the bytes it will write.
struct AsyncCopy {
  unsigned char* shared;
  unsigned char bytes[16];
  unsigned size;
};
struct AsyncCopies {
  std::vector<AsyncCopy> open;
  std::deque<std::vector<AsyncCopy>> committed;
};

struct Fiber {
  ucontext_t context;
  Site site;
  Kind kind;
  unsigned long long barriers;  // barriers passed in this block
  bool waiting;
  bool finished;
  AsyncCopies copies;
};

// Everything one launch needs; lives on the launching thread's stack.
struct Launch {
  dim3 grid, block;
  unsigned nthreads;
  std::unique_ptr<Fiber[]> fibers;
  std::unique_ptr<unsigned long long[]> stage;  // __shfl_xor_sync's exchange slots, one per thread
  std::unique_ptr<unsigned char[]> wide_stage;   // warp_gather's slots, gather_slot_bytes per thread
  ucontext_t scheduler;
  unsigned current;  // linear id of the running fiber
  void (*call)(void*);
  void* body;
};

// Process-wide: the stack pool (grown once, reused), the launch lock, the
// launch in progress and the dynamic shared memory (fixed address, so that a
// namespace-scope `extern __shared__` array works too).
struct Runtime {
  std::recursive_mutex mutex;
  Launch* launch = nullptr;
  unsigned char** stacks = nullptr;
  unsigned nstacks = 0;
  alignas(256) unsigned char shared[max_dynamic_shared_bytes];
};
inline Runtime runtime;

[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* format, ...) {
  std::fflush(stdout);
  std::fputs("cuda_emulator: ", stderr);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::fflush(stderr);
  std::abort();
}

inline uint3 thread_index(const Launch& L, unsigned linear) {
  return uint3{linear % L.block.x, linear / L.block.x % L.block.y, linear / (L.block.x * L.block.y)};
}

inline const char* kind_name(Kind kind) {
  if (kind == Kind::syncthreads) return "__syncthreads()";
  return kind == Kind::shfl_write || kind == Kind::shfl_read ? "__shfl_xor_sync()" : "warp_gather()";
}

inline Launch& current_launch(const char* what) {
  if (runtime.launch == nullptr) fail("%s called outside cuda_emulator::launch", what);
  return *runtime.launch;
}

}  // namespace detail
}  // namespace cuda_emulator

#ifdef CUDA_EMULATOR_RACECHECK
#include "racecheck.h"
#define CUDA_EMULATOR_RACECHECK_CALL(call) ::cuda_emulator::racecheck::call
#else
#define CUDA_EMULATOR_RACECHECK_CALL(call) ((void)0)
#endif

namespace cuda_emulator {
namespace detail {

// Called on a fiber: wait at a block-wide barrier.
inline void barrier(Site site, Kind kind) {
  Launch& L = current_launch(kind_name(kind));
  Fiber& f = L.fibers[L.current];
  f.site = site;
  f.kind = kind;
  f.waiting = true;
  if (swapcontext(&f.context, &L.scheduler) != 0) fail("swapcontext failed");
  ++f.barriers;
}

inline void fiber_main() {
  Launch& L = *runtime.launch;
  L.call(L.body);
  Fiber& f = L.fibers[L.current];
  if (!f.copies.open.empty() || !f.copies.committed.empty())
    fail("thread (%u,%u,%u) of block (%u,%u,%u) returned with cp.async copies it never waited for", threadIdx.x,
         threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z);
  f.finished = true;
}  // returns to uc_link, the scheduler

inline void grow_stacks(unsigned n) {
  if (n <= runtime.nstacks) return;
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  auto** stacks = static_cast<unsigned char**>(std::realloc(runtime.stacks, n * sizeof(unsigned char*)));
  if (stacks == nullptr) fail("out of memory for %u fiber stacks", n);
  runtime.stacks = stacks;
  for (unsigned i = runtime.nstacks; i < n; ++i) {
    void* p = mmap(nullptr, stack_bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail("mmap of a %zu-byte fiber stack failed", stack_bytes);
    mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
    stacks[i] = static_cast<unsigned char*>(p) + page;
  }
  runtime.nstacks = n;
}

inline bool same_site(const Fiber& a, const Fiber& b) {
  return a.kind == b.kind && a.site.line == b.site.line &&
         (a.site.file == b.site.file || std::strcmp(a.site.file, b.site.file) == 0);
}

// Its own function: GCC treats getcontext like setjmp (returns twice).
__attribute__((noinline)) inline void start_fiber(Fiber& f, unsigned char* stack, ucontext_t* scheduler) {
  f.waiting = f.finished = false;
  f.barriers = 0;
  if (getcontext(&f.context) != 0) fail("getcontext failed");
  f.context.uc_stack.ss_sp = stack;
  f.context.uc_stack.ss_size = stack_bytes;
  f.context.uc_link = scheduler;
  makecontext(&f.context, fiber_main, 0);
}

inline void run_block(Launch& L) {
  const unsigned n = L.nthreads;
  for (unsigned i = 0; i < n; ++i) start_fiber(L.fibers[i], runtime.stacks[i], &L.scheduler);
  for (;;) {
    // One pass: run every live fiber until it waits at a barrier or returns.
    for (unsigned i = 0; i < n; ++i) {
      Fiber& f = L.fibers[i];
      if (f.finished) continue;
      f.waiting = false;
      L.current = i;
      threadIdx = thread_index(L, i);
      if (swapcontext(&L.scheduler, &f.context) != 0) fail("swapcontext failed");
    }
    int waiter = -1, finisher = -1;
    for (unsigned i = 0; i < n && (waiter < 0 || finisher < 0); ++i) {
      if (L.fibers[i].waiting && waiter < 0) waiter = static_cast<int>(i);
      if (L.fibers[i].finished && finisher < 0) finisher = static_cast<int>(i);
    }
    if (waiter < 0) return;  // every fiber returned
    const Fiber& w = L.fibers[waiter];
    const uint3 b = blockIdx, tw = thread_index(L, static_cast<unsigned>(waiter));
    if (finisher >= 0) {
      const uint3 tf = thread_index(L, static_cast<unsigned>(finisher));
      fail("divergent barrier in block (%u,%u,%u): thread (%u,%u,%u) waits at %s at %s:%d (barrier #%llu) "
           "but thread (%u,%u,%u) has returned; every thread of a block must reach every barrier",
           b.x, b.y, b.z, tw.x, tw.y, tw.z, kind_name(w.kind), w.site.file, w.site.line, w.barriers + 1, tf.x,
           tf.y, tf.z);
    }
    for (unsigned i = 0; i < n; ++i) {
      const Fiber& f = L.fibers[i];
      if (!same_site(f, w)) {
        const uint3 t = thread_index(L, i);
        fail("divergent barrier in block (%u,%u,%u), barrier #%llu: thread (%u,%u,%u) waits at %s at %s:%d "
             "but thread (%u,%u,%u) waits at %s at %s:%d",
             b.x, b.y, b.z, w.barriers + 1, tw.x, tw.y, tw.z, kind_name(w.kind), w.site.file, w.site.line, t.x, t.y,
             t.z, kind_name(f.kind), f.site.file, f.site.line);
      }
    }
    CUDA_EMULATOR_RACECHECK_CALL(pass_ended(w.kind == Kind::syncthreads));
  }
}

inline void run_launch(dim3 grid, dim3 block, std::size_t shared_bytes, void (*call)(void*), void* body) {
  std::lock_guard<std::recursive_mutex> lock(runtime.mutex);
  if (runtime.launch != nullptr) fail("launch from inside a kernel is not supported");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
    fail("invalid grid (%u,%u,%u)", grid.x, grid.y, grid.z);
  const unsigned long long n = 1ull * block.x * block.y * block.z;
  if (n == 0 || n > 1024 || block.z > 64) fail("invalid block (%u,%u,%u)", block.x, block.y, block.z);
  if (shared_bytes > max_dynamic_shared_bytes)
    fail("%zu bytes of dynamic shared memory requested, at most %zu", shared_bytes, max_dynamic_shared_bytes);
  grow_stacks(static_cast<unsigned>(n));

  Launch L{};
  L.grid = grid;
  L.block = block;
  L.nthreads = static_cast<unsigned>(n);
  L.fibers.reset(new Fiber[n]());
  L.stage.reset(new unsigned long long[n]());
  L.wide_stage.reset(new unsigned char[n * gather_slot_bytes]());
  L.call = call;
  L.body = body;
  runtime.launch = &L;
  gridDim = grid;
  blockDim = block;
  const char* order = std::getenv("CUDA_EMULATOR_BLOCK_ORDER");
  const bool reversed = order != nullptr && std::strcmp(order, "reversed") == 0;
  const unsigned long long blocks = 1ull * grid.x * grid.y * grid.z;
  for (unsigned long long i = 0; i < blocks; ++i) {
    const unsigned long long linear = reversed ? blocks - 1 - i : i;  // x fastest, then y, then z
    blockIdx = uint3{static_cast<unsigned>(linear % grid.x), static_cast<unsigned>(linear / grid.x % grid.y),
                     static_cast<unsigned>(linear / grid.x / grid.y)};
    std::memset(runtime.shared, 0xFF, shared_bytes);
    CUDA_EMULATOR_RACECHECK_CALL(block_started(runtime.shared, shared_bytes));
    run_block(L);
    CUDA_EMULATOR_RACECHECK_CALL(block_ended());
  }
  runtime.launch = nullptr;
}

template <class T>
inline T shfl_xor(Site site, unsigned mask, T value, int lane_mask, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(unsigned long long));
  Launch& L = current_launch("__shfl_xor_sync()");
  unsigned long long slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  L.stage[L.current] = slot;
  barrier(site, Kind::shfl_write);  // every thread has published its value
  const unsigned me = L.current, lane = me % 32, base = me - lane;
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    fail("__shfl_xor_sync at %s:%d: width %d is not a power of two in [1, 32]", site.file, site.line, width);
  // PTX shfl.bfly: a source lane past the caller's width-segment yields the caller's own value.
  unsigned src = lane ^ static_cast<unsigned>(lane_mask);
  if (src >= (lane & ~static_cast<unsigned>(width - 1)) + static_cast<unsigned>(width)) src = lane;
  const char* problem = ((mask >> lane) & 1u) == 0  ? "its own lane is not in the mask"
                        : ((mask >> src) & 1u) == 0 ? "the source lane is not in the mask"
                        : base + src >= L.nthreads  ? "the source lane is past the end of the block (partial warp)"
                                                    : nullptr;
  if (problem != nullptr) {
    const uint3 t = threadIdx, b = blockIdx;
    fail("__shfl_xor_sync at %s:%d: thread (%u,%u,%u) of block (%u,%u,%u), lane %u, mask 0x%08x, reads lane %u: %s",
         site.file, site.line, t.x, t.y, t.z, b.x, b.y, b.z, lane, mask, src, problem);
  }
  T result;
  std::memcpy(&result, &L.stage[base + src], sizeof(T));
  barrier(site, Kind::shfl_read);  // every thread has read before any slot is reused
  return result;
}

// Every lane's `mine`, in lane order, into `all` (GatherLanes entries: 32, a warp's,
// or 128, a warpgroup's): what a warp-wide instruction such as the tensor
// cores' mma.sync (or sm_90's warpgroup-wide wgmma) sees of its operands.
// Like __shfl_xor_sync, a block-wide exchange: every thread of the block calls
// it, and the block's warps (warpgroups) must all be whole.
template <unsigned GatherLanes = 32, class T>
inline void warp_gather(Site site, const T& mine, T* all) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= gather_slot_bytes);
  Launch& L = current_launch("warp_gather()");
  std::memcpy(&L.wide_stage[L.current * gather_slot_bytes], &mine, sizeof(T));
  barrier(site, Kind::gather_write);
  const unsigned base = L.current - L.current % GatherLanes;
  if (base + GatherLanes > L.nthreads)
    fail("warp_gather at %s:%d: the %u lanes of thread %u are not whole", site.file, site.line, GatherLanes, L.current);
  for (unsigned i = 0; i < GatherLanes; ++i) std::memcpy(&all[i], &L.wide_stage[(base + i) * gather_slot_bytes], sizeof(T));
  barrier(site, Kind::gather_read);
}

// __any_sync: whether `predicate` is nonzero on any lane of the caller's warp
// in `mask`. A block-wide exchange like __shfl_xor_sync (every thread of the
// block calls it at the same site; the warps whole).
inline int any_sync(Site site, unsigned mask, int predicate) {
  int all[32];
  warp_gather(site, predicate, all);
  const unsigned lane = current_launch("__any_sync()").current % 32;
  if (((mask >> lane) & 1u) == 0) fail("__any_sync at %s:%d: lane %u is not in the mask 0x%08x", site.file, site.line, lane, mask);
  for (unsigned i = 0; i < 32; ++i)
    if (((mask >> i) & 1u) != 0 && all[i] != 0) return 1;
  return 0;
}

#define CUDA_EMULATOR_SHFL_XOR(T)                                                                   \
  inline T shfl_xor_sync(Site site, unsigned mask, T value, int lane_mask, int width = warpSize) { \
    return shfl_xor<T>(site, mask, value, lane_mask, width);                                      \
  }
CUDA_EMULATOR_SHFL_XOR(int)
CUDA_EMULATOR_SHFL_XOR(unsigned)
CUDA_EMULATOR_SHFL_XOR(long)
CUDA_EMULATOR_SHFL_XOR(unsigned long)
CUDA_EMULATOR_SHFL_XOR(long long)
CUDA_EMULATOR_SHFL_XOR(unsigned long long)
CUDA_EMULATOR_SHFL_XOR(float)
CUDA_EMULATOR_SHFL_XOR(double)
#undef CUDA_EMULATOR_SHFL_XOR

}  // namespace detail

// Run `body` (the kernel call with its arguments bound, e.g. `[&] { k(x, y, n); }`)
// once per thread of every block of `grid`; `shared_bytes` sizes the dynamic
// shared memory (`extern __shared__`).
template <class F>
void launch(dim3 grid, dim3 block, F&& body, std::size_t shared_bytes = 0) {
  using Body = std::remove_reference_t<F>;
  void* erased = const_cast<void*>(static_cast<const void*>(std::addressof(body)));
  detail::run_launch(grid, block, shared_bytes, [](void* p) { (*static_cast<Body*>(p))(); }, erased);
}

// What build.py turns `extern __shared__ T name[];` into.
template <class T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(detail::runtime.shared);
}

}  // namespace cuda_emulator

#define __syncthreads() \
  ::cuda_emulator::detail::barrier(::cuda_emulator::detail::Site{__FILE__, __LINE__}, ::cuda_emulator::detail::Kind::syncthreads)
#define __shfl_xor_sync(...) \
  ::cuda_emulator::detail::shfl_xor_sync(::cuda_emulator::detail::Site{__FILE__, __LINE__}, __VA_ARGS__)
#define __any_sync(...) ::cuda_emulator::detail::any_sync(::cuda_emulator::detail::Site{__FILE__, __LINE__}, __VA_ARGS__)

// ------------------------------------------------------- device math helpers
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct __attribute__((aligned(16))) double2 {
  double x, y;
};

inline float __int_as_float(int v) { float r; std::memcpy(&r, &v, sizeof r); return r; }
inline int __float_as_int(float v) { int r; std::memcpy(&r, &v, sizeof r); return r; }
inline float __uint_as_float(unsigned v) { float r; std::memcpy(&r, &v, sizeof r); return r; }
inline unsigned __float_as_uint(float v) { unsigned r; std::memcpy(&r, &v, sizeof r); return r; }
inline double __longlong_as_double(long long v) { double r; std::memcpy(&r, &v, sizeof r); return r; }
inline long long __double_as_longlong(double v) { long long r; std::memcpy(&r, &v, sizeof r); return r; }
inline int __double2hiint(double v) { return (int)(__double_as_longlong(v) >> 32); }
inline int __double2loint(double v) { return (int)(unsigned)__double_as_longlong(v); }
inline double __hiloint2double(int hi, int lo) {
  return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}

// CUDA's float overloads in the global namespace (exp(float) is a float exp).
using std::abs, std::exp, std::log, std::tanh, std::fabs, std::sqrt, std::fmax, std::fmin, std::pow;
using std::fma, std::floor, std::ceil, std::isinf, std::isnan, std::isfinite, std::log1p, std::expm1, std::exp2, std::log2;

// CUDA's unqualified min/max: the common type of the arguments (int, unsigned,
// long long, ... and mixed signed/unsigned like CUDA's overloads); float and
// double go through fmin/fmax like CUDA's. Not std::min/std::max.
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) return std::fmin(C(a), C(b));
  else return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B, class = std::enable_if_t<std::is_arithmetic_v<A> && std::is_arithmetic_v<B>>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  if constexpr (std::is_floating_point_v<C>) return std::fmax(C(a), C(b));
  else return C(a) < C(b) ? C(b) : C(a);
}
