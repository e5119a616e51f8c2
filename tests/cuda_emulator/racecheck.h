// Shared-memory race detection for the CPU emulator: what CUDA's
// compute-sanitizer calls racecheck, on the emulator's fibers.
//
// Included by emulator.h when CUDA_EMULATOR_RACECHECK is defined; build.py's
// RACECHECK_FLAGS turn it on. The kernel source is then compiled with g++'s
// ThreadSanitizer instrumentation (-fsanitize=thread, not linked against its
// runtime): g++ calls __tsan_readN / __tsan_writeN before each load and
// store, and this header defines those functions itself. Every access to
// shared memory (the static `__shared__` arrays, which __shared__ puts in a
// section of their own, and the dynamic shared memory) is checked against
// the accesses before it in the block and recorded, byte by byte.
//
// Time in a block: the emulator runs every thread to its next barrier of
// any kind (a pass), so a pass is an interval between two consecutive
// barriers, and an epoch runs from one __syncthreads() to the next. Two
// accesses to a byte by different threads, one of them a write, are ordered
// when a __syncthreads() lies between them (a later epoch), or when both
// threads are in one warp and a warp-wide operation lies between them (a
// later pass: a shuffle, a vote, an mma or ldmatrix; treated as ordering
// the warp's shared-memory accesses, as __syncwarp() does). Anything else
// is a race, whatever order the emulator ran the threads in: so a warp
// that writes a tile other warps may still be reading (write after read),
// which the emulator's lockstep hides, fails here as on a GPU it would
// race.
//
// cp.async (ptx.h): a copy writes its bytes at its issue (the check for
// readers still at the tile) and again when it lands, at its thread's wait
// (the check for readers before the barrier that follows); in between, any
// read or write of its bytes is an error. A read of a byte no thread of the
// block has written is an error too: static shared arrays keep the previous
// block's contents here, where a GPU leaves them undefined.
//
// Each error prints both accesses' source lines (addr2line on the kernel
// library; RACECHECK_FLAGS include -g) and aborts.
#pragma once

#include <dlfcn.h>

extern "C" unsigned char __start_cuda_shared[] __attribute__((weak, visibility("hidden")));
extern "C" unsigned char __stop_cuda_shared[] __attribute__((weak, visibility("hidden")));

#define CUDA_EMULATOR_UNCHECKED __attribute__((no_sanitize_thread, noinline))

namespace cuda_emulator::racecheck {

// What happened to one byte of shared memory in the current block.
struct Shadow {
  std::uint32_t block;  // the block these fields belong to (a serial number; 0: none yet)
  std::uint32_t write_epoch, write_pass, read_epoch, read_pass;
  int writer;             // the last thread to write the byte (a linear id), -1: none this block
  int epoch_reader;       // the first thread to read it in read_epoch
  int other_warp_reader;  // a thread of another warp than epoch_reader's that read it in read_epoch, or -1
  int pass_reader;        // the first thread to read it in read_pass
  bool pass_readers;      // whether another thread read it in read_pass too
  bool in_flight;         // a cp.async copy, issued by `writer`, has yet to land
  const void *write_at, *epoch_read_at, *other_warp_read_at, *pass_read_at;  // code addresses
};

struct Region {
  const char* name;
  unsigned char* begin;
  std::size_t size;   // bytes the running kernel may use
  std::size_t span;   // bytes checked: an access from `size` up to here is past the kernel's shared memory
  Shadow* shadow;     // `capacity` entries, or null until first used
  std::size_t capacity;
};

// The block being run: serial number, epoch and pass (all grow for the
// whole process, so a stamp of an earlier block is always earlier).
struct Clock {
  std::uint32_t block = 0, epoch = 0, pass = 0;
};
inline Clock clock;
// Like the emulator's runtime, one for the process: each kernel library's
// inline variables are the same objects (g++ makes them unique symbols).
inline Region regions[2] = {{"static __shared__", nullptr, 0, 0, nullptr, 0},
                            {"dynamic shared memory", nullptr, 0, 0, nullptr, 0}};
inline bool running = false;  // fibers are running a block

enum class Access { read, write, copy_issue, copy_landing };

CUDA_EMULATOR_UNCHECKED inline void block_started(unsigned char* dynamic, std::size_t dynamic_bytes) {
  ++clock.block, ++clock.epoch, ++clock.pass;
  regions[0].begin = __start_cuda_shared;
  regions[0].size = regions[0].span = static_cast<std::size_t>(__stop_cuda_shared - __start_cuda_shared);
  regions[1].begin = dynamic;
  regions[1].size = dynamic_bytes;
  regions[1].span = max_dynamic_shared_bytes;
  running = true;
}

CUDA_EMULATOR_UNCHECKED inline void pass_ended(bool syncthreads) {
  ++clock.pass;
  if (syncthreads) ++clock.epoch;
}

CUDA_EMULATOR_UNCHECKED inline void block_ended() { running = false; }

// The length of a demangled function's name: up to its parameters' "(",
// past any in its template arguments.
CUDA_EMULATOR_UNCHECKED inline std::size_t name_length(const char* function) {
  int depth = 0;
  std::size_t i = 0;
  for (; function[i] != '\0' && function[i] != '\n'; ++i) {
    if (function[i] == '<') ++depth;
    if (function[i] == '>') --depth;
    if (function[i] == '(' && depth == 0 && i > 0) break;
  }
  return i;
}

// "tensor_tiles.cuh:52 (load_key_tiles) <- tensor_backward.cu:90 (...)" for a
// code address: its line and the lines it is inlined into, by addr2line.
CUDA_EMULATOR_UNCHECKED inline void describe(const void* at, char* text, std::size_t size) {
  Dl_info info{};
  std::snprintf(text, size, "%p", at);
  if (at == nullptr || dladdr(at, &info) == 0 || info.dli_fname == nullptr) return;
  const auto offset = static_cast<std::size_t>(static_cast<const char*>(at) - static_cast<const char*>(info.dli_fbase)) - 1;
  char command[4200];
  std::snprintf(command, sizeof command, "addr2line -C -f -i -e '%s' 0x%zx 2>/dev/null", info.dli_fname, offset);
  FILE* pipe = popen(command, "r");
  if (pipe == nullptr) return;
  char function[1024], line[1024];
  std::size_t used = 0;
  for (int frame = 0; frame < 4 && std::fgets(function, sizeof function, pipe) != nullptr &&
                      std::fgets(line, sizeof line, pipe) != nullptr;
       ++frame) {
    const std::size_t length = name_length(function);
    if (length > 60) std::strcpy(function + 57, "...");  // a lambda's name holds its enclosing function's
    else function[length] = '\0';
    line[std::strcspn(line, " \n")] = '\0';  // less " (discriminator 1)"
    const char* file = std::strrchr(line, '/');  // #line names the file alone; addr2line adds the build's folder
    const int n = std::snprintf(text + used, size - used, "%s%s (%s)", frame ? " <- " : "", file ? file + 1 : line,
                                function);
    if (n < 0 || static_cast<std::size_t>(n) >= size - used) break;
    used += static_cast<std::size_t>(n);
  }
  pclose(pipe);
}

CUDA_EMULATOR_UNCHECKED inline const char* verb(Access access) {
  switch (access) {
    case Access::read: return "reads";
    case Access::write: return "writes";
    case Access::copy_issue: return "issues a cp.async copy to";
    default: return "lands a cp.async copy in";
  }
}

[[noreturn]] CUDA_EMULATOR_UNCHECKED inline void report(const char* problem, const Region& region, std::size_t offset,
                                                         Access access, const void* at, int other,
                                                         const char* other_did, const void* other_at) {
  char here[2048], there[2048];
  describe(at, here, sizeof here);
  describe(other_at, there, sizeof there);
  const detail::Launch& L = *detail::runtime.launch;
  const uint3 me = detail::thread_index(L, L.current), b = blockIdx;
  if (other < 0)
    detail::fail("%s in block (%u,%u,%u): thread (%u,%u,%u) %s byte %zu of %s at %s", problem, b.x, b.y, b.z, me.x,
                 me.y, me.z, verb(access), offset, region.name, here);
  const uint3 them = detail::thread_index(L, static_cast<unsigned>(other));
  detail::fail("%s in block (%u,%u,%u): thread (%u,%u,%u) %s byte %zu of %s at %s, which thread (%u,%u,%u) %s at %s",
               problem, b.x, b.y, b.z, me.x, me.y, me.z, verb(access), offset, region.name, here, them.x, them.y,
               them.z, other_did, there);
}

// Whether an access by thread `other` in (epoch, pass) is ordered before one by `me` now.
CUDA_EMULATOR_UNCHECKED inline bool ordered(int other, std::uint32_t epoch, std::uint32_t pass, int me) {
  return other == me || epoch != clock.epoch || (other / 32 == me / 32 && pass != clock.pass);
}

CUDA_EMULATOR_UNCHECKED inline void check_read(Shadow& s, const Region& r, std::size_t offset, int me, const void* at) {
  if (s.in_flight)
    report("read of a cp.async copy in flight (its thread has not waited for it)", r, offset, Access::read, at,
           s.writer, "issued", s.write_at);
  if (s.writer < 0)
    report("read of shared memory not yet written in this block (or written with no barrier before the read)", r,
           offset, Access::read, at, -1, "", nullptr);
  if (!ordered(s.writer, s.write_epoch, s.write_pass, me))
    report("shared memory race (read after write, no barrier between)", r, offset, Access::read, at, s.writer,
           "wrote", s.write_at);
  if (s.read_epoch != clock.epoch) {
    s.read_epoch = clock.epoch, s.epoch_reader = me, s.epoch_read_at = at, s.other_warp_reader = -1;
  } else if (s.other_warp_reader < 0 && s.epoch_reader / 32 != me / 32) {
    s.other_warp_reader = me, s.other_warp_read_at = at;
  }
  if (s.read_pass != clock.pass) {
    s.read_pass = clock.pass, s.pass_reader = me, s.pass_read_at = at, s.pass_readers = false;
  } else if (s.pass_reader != me) {
    s.pass_readers = true;
  }
}

CUDA_EMULATOR_UNCHECKED inline void check_write(Shadow& s, const Region& r, std::size_t offset, int me,
                                                Access access, const void* at) {
  if (s.in_flight && access != Access::copy_landing)
    report("write to a cp.async copy's bytes in flight", r, offset, access, at, s.writer, "issued the copy",
           s.write_at);
  if (s.read_epoch == clock.epoch) {
    const bool first_other = s.epoch_reader / 32 != me / 32;
    const int reader = first_other ? s.epoch_reader : s.other_warp_reader;
    if (reader >= 0)
      report("shared memory race (write after read, no __syncthreads() between)", r, offset, access, at, reader,
             "read", first_other ? s.epoch_read_at : s.other_warp_read_at);
    if (s.read_pass == clock.pass && (s.pass_readers || s.pass_reader != me))
      report("shared memory race (write after another lane's read, no warp-wide operation between)", r, offset,
             access, at, s.pass_reader, "read", s.pass_read_at);
  }
  if (s.writer >= 0 && !ordered(s.writer, s.write_epoch, s.write_pass, me))
    report("shared memory race (two writes, no barrier between)", r, offset, access, at, s.writer, "wrote",
           s.write_at);
  s.writer = me, s.write_epoch = clock.epoch, s.write_pass = clock.pass, s.write_at = at;
  s.in_flight = access == Access::copy_issue;
}

// Check and record an access of `size` bytes at `address` by the running thread.
CUDA_EMULATOR_UNCHECKED inline void access(const void* address, std::size_t size, Access access, const void* at) {
  if (!running) return;
  const auto* p = static_cast<const unsigned char*>(address);
  for (Region& r : regions) {
    if (p < r.begin || p >= r.begin + r.span) continue;
    if (r.capacity < r.span) {  // entries of earlier blocks are dropped anyway
      std::free(r.shadow);
      r.shadow = static_cast<Shadow*>(std::calloc(r.span, sizeof(Shadow)));
      if (r.shadow == nullptr) detail::fail("out of memory for the race check's record of %s", r.name);
      r.capacity = r.span;
    }
    const std::size_t first = static_cast<std::size_t>(p - r.begin);
    if (first + size > r.size)
      report("access past the kernel's shared memory", r, first + size - 1, access, at, -1, "", nullptr);
    const int me = static_cast<int>(detail::runtime.launch->current);
    for (std::size_t offset = first; offset < first + size; ++offset) {
      Shadow& s = r.shadow[offset];
      if (s.block != clock.block) s = Shadow{}, s.block = clock.block, s.writer = -1;
      if (access == Access::read) check_read(s, r, offset, me, at);
      else check_write(s, r, offset, me, access, at);
    }
    return;
  }
}

}  // namespace cuda_emulator::racecheck

// g++'s -fsanitize=thread instrumentation calls these around every load and
// store; each passes its caller's address, the kernel's line, on.
#define CUDA_EMULATOR_TSAN_HOOK(name, n, kind)                                                     \
  extern "C" CUDA_EMULATOR_UNCHECKED void name(void* p) {                                           \
    ::cuda_emulator::racecheck::access(p, n, ::cuda_emulator::racecheck::Access::kind,              \
                                       __builtin_return_address(0));                                 \
  }
#define CUDA_EMULATOR_TSAN_HOOKS(n)                                 \
  CUDA_EMULATOR_TSAN_HOOK(__tsan_read##n, n, read)                  \
  CUDA_EMULATOR_TSAN_HOOK(__tsan_write##n, n, write)                \
  CUDA_EMULATOR_TSAN_HOOK(__tsan_unaligned_read##n, n, read)        \
  CUDA_EMULATOR_TSAN_HOOK(__tsan_unaligned_write##n, n, write)
CUDA_EMULATOR_TSAN_HOOKS(1)
CUDA_EMULATOR_TSAN_HOOKS(2)
CUDA_EMULATOR_TSAN_HOOKS(4)
CUDA_EMULATOR_TSAN_HOOKS(8)
CUDA_EMULATOR_TSAN_HOOKS(16)
#undef CUDA_EMULATOR_TSAN_HOOKS
#undef CUDA_EMULATOR_TSAN_HOOK

extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_read_range(void* p, unsigned long size) {
  ::cuda_emulator::racecheck::access(p, size, ::cuda_emulator::racecheck::Access::read, __builtin_return_address(0));
}
extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_write_range(void* p, unsigned long size) {
  ::cuda_emulator::racecheck::access(p, size, ::cuda_emulator::racecheck::Access::write, __builtin_return_address(0));
}
extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_init() {}
extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_func_entry(void*) {}
extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_func_exit() {}
extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_vptr_update(void**, void*) {}
extern "C" CUDA_EMULATOR_UNCHECKED void __tsan_vptr_read(void**) {}
