"""The CPU emulator of CUDA kernels (tests/cuda_emulator): barriers, warp shuffles and votes, indices,
dynamic shared memory, cp.async's copies in flight, and that divergent barriers abort instead of hanging."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cuda_emulator import build

pytestmark = pytest.mark.skipif(not build.available(), reason="g++ cannot build the CUDA emulator here")


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


#: ptx.h, the emulator's stand-in for npattn/cuda/ptx.cuh (cp.async, mma), and half.h, which it needs.
STAND_INS = [Path(build.__file__).with_name(name) for name in ("half.h", "ptx.h")]


def _in_new_process(environment: dict[str, str] | None, script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c script *args`` with ``environment``, cuda_emulator importable."""
    command = [sys.executable, "-c", script, *args]
    cwd = Path(__file__).parent
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, cwd=cwd)


def _build(tmp_path: Path, source: str, wrapper: str, name: str, defines: dict[str, str] | None = None) -> ctypes.CDLL:
    path = tmp_path / f"{name}.cu"
    path.write_text(source)
    return build.build([path], wrapper, defines or {}, name)


BLOCK_SUM = r"""
extern "C" __global__ void __launch_bounds__(BLOCK)
block_sum(const float* __restrict__ x, float* __restrict__ out, int n) {
    __shared__ float s[BLOCK];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}
"""
BLOCK_SUM_WRAPPER = r"""
extern "C" void run_block_sum(const float* x, float* out, int n, int blocks) {
    cuda_emulator::launch(dim3(blocks), dim3(BLOCK), [&] { block_sum(x, out, n); });
}
"""


def _block_sums(tmp_path: Path, x: np.ndarray, block: int) -> np.ndarray:
    lib = _build(tmp_path, BLOCK_SUM, BLOCK_SUM_WRAPPER, "block_sum", {"BLOCK": str(block)})
    blocks = -(-x.size // block)
    out = np.full(blocks, np.nan, np.float32)
    lib.run_block_sum(_ptr(x), _ptr(out), x.size, blocks)
    return out


def _tree_sums(x: np.ndarray, block: int) -> np.ndarray:
    """The kernel's order of additions, in NumPy."""
    padded = np.zeros(-(-x.size // block) * block, np.float32)
    padded[: x.size] = x
    s = padded.reshape(-1, block)
    while s.shape[1] > 1:
        half = s.shape[1] // 2
        s = s[:, :half] + s[:, half:]
    return s[:, 0]


def test_block_sum_shared_memory_tree(tmp_path):
    x = np.random.default_rng(0).integers(-8, 9, 1000).astype(np.float32)  # small integers: every sum is exact
    out = _block_sums(tmp_path, x, 128)
    expected = np.pad(x, (0, 1024 - 1000)).reshape(8, 128).sum(axis=1)
    np.testing.assert_array_equal(out, expected)


def test_repeat_is_deterministic(tmp_path):
    x = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    first = _block_sums(tmp_path, x, 256)
    for _ in range(3):
        assert _block_sums(tmp_path, x, 256).tobytes() == first.tobytes()
    np.testing.assert_array_equal(first, _tree_sums(x, 256))  # same order of float additions as NumPy's tree


SHUFFLE = r"""
template <class T>
__device__ __forceinline__ T butterfly_sum(T v, int width) {
    for (int m = 1; m < width; m *= 2) v += __shfl_xor_sync(0xffffffffu, v, m, width);
    return v;
}

// out[0..5): one shuffle per lane mask 1..16; out[5]: full-warp sum; out[6]: sums within groups of 4 lanes.
template <class T>
__global__ void shuffles(const T* x, T* out, int width) {
    const int n = gridDim.x * blockDim.x;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const T v = x[i];
    int k = 0;
    for (int m = 1; m < 32; m *= 2, ++k) out[k * n + i] = __shfl_xor_sync(0xffffffffu, v, m, width);
    out[5 * n + i] = butterfly_sum(v, 32);
    out[6 * n + i] = butterfly_sum(v, 4);
}
"""
SHUFFLE_WRAPPER = "\n".join(
    f'extern "C" void run_{name}(const {t}* x, {t}* out, int width) {{\n'
    f"    cuda_emulator::launch(dim3(2), dim3(64), [&] {{ shuffles<{t}>(x, out, width); }});\n}}"
    for name, t in [
        ("f32", "float"),
        ("f64", "double"),
        ("i32", "int"),
        ("u32", "unsigned"),
        ("i64", "long long"),
        ("u64", "unsigned long long"),
    ]
)
DTYPES = {"f32": np.float32, "f64": np.float64, "i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64}


def _shfl_xor_sources(n: int, lane_mask: int, width: int) -> np.ndarray:
    """CUDA's rule: lane ^ lane_mask, or the caller's own lane when that is past its width-segment."""
    i = np.arange(n)
    lane = i % 32
    src = lane ^ lane_mask
    src = np.where(src >= (lane // width + 1) * width, lane, src)
    return i - lane + src


@pytest.mark.parametrize("width", [32, 4])
def test_shfl_xor_butterfly(tmp_path, width):
    lib = _build(tmp_path, SHUFFLE, SHUFFLE_WRAPPER, "shuffles")
    n = 128
    for name, dtype in DTYPES.items():
        x = np.random.default_rng(2).integers(0, 1000, n) + (0.5 if name.startswith("f") else 0)
        x = x.astype(dtype)  # integers and halves: every sum is exact
        out = np.zeros((7, n), dtype)
        getattr(lib, f"run_{name}")(_ptr(x), _ptr(out), width)
        for k, m in enumerate([1, 2, 4, 8, 16]):
            np.testing.assert_array_equal(out[k], x[_shfl_xor_sources(n, m, width)], err_msg=f"{name} mask {m}")
        np.testing.assert_array_equal(out[5], np.repeat(x.reshape(-1, 32).sum(axis=1, dtype=dtype), 32))
        np.testing.assert_array_equal(out[6], np.repeat(x.reshape(-1, 4).sum(axis=1, dtype=dtype), 4))


ANY = r"""
extern "C" __global__ void any_lane(const int* flags, int* out, unsigned mask) {
    out[threadIdx.x] = __any_sync(mask, flags[threadIdx.x]);
}
"""
ANY_WRAPPER = r"""
extern "C" void run_any(const int* flags, int* out, unsigned mask) {
    cuda_emulator::launch(dim3(1), dim3(128), [&] { any_lane(flags, out, mask); });
}
"""


def test_any_sync_votes_per_warp(tmp_path):
    """__any_sync: each lane learns whether any lane of its own warp holds a
    nonzero flag."""
    lib = _build(tmp_path, ANY, ANY_WRAPPER, "any")
    flags = np.zeros(128, np.int32)
    flags[[5, 70, 71]] = [1, 3, 1]  # warps 0 and 2; warps 1 and 3 have none
    out = np.full(128, -1, np.int32)
    lib.run_any(_ptr(flags), _ptr(out), ctypes.c_uint(0xFFFFFFFF))
    np.testing.assert_array_equal(out, np.repeat([1, 0, 1, 0], 32))
    flags[:] = 0
    lib.run_any(_ptr(flags), _ptr(out), ctypes.c_uint(0xFFFFFFFF))
    np.testing.assert_array_equal(out, 0)


ASYNC_COPIES = r"""
// Each thread copies 16 bytes (4 floats) of x into shared memory by cp.async
// and reads its neighbour's piece: before waiting (NaN), after waiting but
// before the barrier (its neighbour's thread ran first: the bytes landed),
// and after both; a second group waits behind the first.
extern "C" __global__ void async_copies(const float* x, float* seen) {
    __shared__ __align__(16) float tile[2][64 * 4];
    const int t = threadIdx.x, other = (t + 1) % 64;
    async_copy_16(shared_address(&tile[0][4 * t]), x + 4 * t, true);
    async_commit();
    async_copy_16(shared_address(&tile[1][4 * t]), x + 4 * t, false);  // zeros
    async_commit();
    seen[6 * t + 0] = tile[0][4 * t];  // issued, not waited for: the 0xff bytes
    async_wait<1>();                   // the first group, not the second
    seen[6 * t + 1] = tile[0][4 * t];
    seen[6 * t + 2] = tile[1][4 * t];
    __syncthreads();
    seen[6 * t + 3] = tile[0][4 * other];
    async_wait<0>();
    __syncthreads();
    seen[6 * t + 4] = tile[1][4 * other];
    seen[6 * t + 5] = tile[0][4 * other + 3];
}

extern "C" __global__ void never_waits(const float* x, float* seen) {
    __shared__ __align__(16) float tile[64 * 4];
    async_copy_16(shared_address(&tile[4 * threadIdx.x]), x + 4 * threadIdx.x, true);
    async_commit();
    seen[threadIdx.x] = 1;
}

// Addresses a GPU faults on: each kernel's thread 1 (or its lane 1) gives
// one 4 bytes past where it should.
extern "C" __global__ void copy_to_misaligned_shared(const float* x, float* seen) {
    __shared__ __align__(16) float tile[65 * 4];
    async_copy_16(shared_address(&tile[4 * threadIdx.x + (threadIdx.x == 1)]), x + 4 * threadIdx.x, true);
    async_commit();
    async_wait<0>();
}

extern "C" __global__ void copy_from_misaligned_global(const float* x, float* seen) {
    __shared__ __align__(16) float tile[64 * 4];
    async_copy_16(shared_address(&tile[4 * threadIdx.x]), x + 4 * threadIdx.x + (threadIdx.x == 1), true);
    async_commit();
    async_wait<0>();
}

extern "C" __global__ void zeros_from_misaligned_global(const float* x, float* seen) {
    __shared__ __align__(16) float tile[64 * 4];
    async_copy_16(shared_address(&tile[4 * threadIdx.x]), x + 4 * threadIdx.x + (threadIdx.x == 1), false);
    async_commit();
    async_wait<0>();
}

extern "C" __global__ void copy_misaligned_entry(const float* x, float* seen) {
    __shared__ __align__(16) double entries[65];
    async_copy_entry(shared_address(reinterpret_cast<float*>(entries) + (threadIdx.x == 1)),
                     reinterpret_cast<const double*>(x) + threadIdx.x);
    async_commit();
    async_wait<0>();
}

extern "C" __global__ void load_misaligned_matrix_rows(const float* x, float* seen) {
    __shared__ __align__(16) float rows[64 * 8];
    rows[threadIdx.x] = 0;
    __syncthreads();
    unsigned r[4];
    load_matrices(r, shared_address(&rows[8 * threadIdx.x + 2 * (threadIdx.x == 1)]));
}
"""
MISALIGNED = {  # kernel: (the instruction, the address it names, its size)
    "copy_to_misaligned_shared": ("cp.async", "shared", 16),
    "copy_from_misaligned_global": ("cp.async", "global", 16),
    "zeros_from_misaligned_global": ("cp.async", "global", 16),
    "copy_misaligned_entry": ("cp.async", "shared", 8),
    "load_misaligned_matrix_rows": ("ldmatrix", "a row's shared", 16),
}
ASYNC_COPIES_WRAPPER = "\n".join(
    f'extern "C" void run_{k}(const float* x, float* seen) {{\n'
    f"    cuda_emulator::launch(dim3(1), dim3(64), [&] {{ {k}(x, seen); }});\n}}"
    for k in ["async_copies", "never_waits", *MISALIGNED]
)


def _async_library(tmp_path: Path) -> ctypes.CDLL:
    """ASYNC_COPIES with the emulator's cp.async (ptx.h, and half.h that it needs)."""
    path = tmp_path / "async.cu"
    path.write_text(ASYNC_COPIES)
    return build.build([*STAND_INS, path], ASYNC_COPIES_WRAPPER, {}, "async_copies")


def test_async_copies_land_when_their_thread_waits(tmp_path):
    """ptx.h's cp.async: a copy's bytes read as 0xff (NaN) until its thread
    waits for its group, async_wait<N> leaves the newest N groups in flight,
    and a barrier after every thread's wait shows every piece; so a kernel
    that reads a tile too early reads NaN."""
    lib = _async_library(tmp_path)
    x = np.arange(256, dtype=np.float32) + 1
    seen = np.full((64, 6), -1.0, np.float32)
    lib.run_async_copies(_ptr(x), _ptr(seen))
    t = np.arange(64)
    assert np.isnan(seen[:, 0]).all() and np.isnan(seen[:, 2]).all()
    np.testing.assert_array_equal(seen[:, 1], x[4 * t])
    np.testing.assert_array_equal(seen[:, 3], x[4 * ((t + 1) % 64)])
    np.testing.assert_array_equal(seen[:, 4], 0)
    np.testing.assert_array_equal(seen[:, 5], x[4 * ((t + 1) % 64) + 3])


def test_copies_never_waited_for_abort(tmp_path):
    lib = _async_library(tmp_path)
    script = "import ctypes, sys, numpy as np; x = np.ones(256, np.float32); s = np.zeros(64, np.float32)\n"
    script += "ctypes.CDLL(sys.argv[1]).run_never_waits(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(s.ctypes.data))"
    result = _in_new_process(None, script, lib._name)
    assert result.returncode != 0
    assert "returned with cp.async copies it never waited for" in result.stderr


@pytest.mark.parametrize("kernel", list(MISALIGNED))
def test_misaligned_copies_and_matrix_rows_abort(tmp_path, kernel):
    """cp.async (16 bytes, or one 4- or 8-byte entry) and ldmatrix's rows at
    an address that is not a multiple of their size stop the run, naming the
    line and the thread, as a GPU faults on them (misaligned address)."""
    lib = _async_library(tmp_path)
    script = "import ctypes, sys, numpy as np; x = np.ones(1024, np.float32); s = np.zeros(64, np.float32)\n"
    script += f"ctypes.CDLL(sys.argv[1]).run_{kernel}(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(s.ctypes.data))"
    result = _in_new_process(None, script, lib._name)
    lines = ASYNC_COPIES.splitlines()
    kernel_line = next(i for i, line in enumerate(lines) if f" {kernel}(" in line)
    line = 1 + next(i for i in range(kernel_line, len(lines)) if re.search(r"async_copy|load_matrices", lines[i]))
    what, space, size = MISALIGNED[kernel]
    assert result.returncode != 0
    assert f"{what} at async.cu:{line}: thread (1,0,0) of block (0,0,0) gives {space} address" in result.stderr
    assert f"not a multiple of {size} bytes" in result.stderr


INDICES = r"""
extern "C" __global__ void indices(int* ids, int* coords) {
    const int tid = threadIdx.x + threadIdx.y * blockDim.x + threadIdx.z * blockDim.x * blockDim.y;
    const int bid = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    const int g = bid * blockDim.x * blockDim.y * blockDim.z + tid;
    ids[g] = g;
    const unsigned c[6] = {threadIdx.x, threadIdx.y, threadIdx.z, blockIdx.x, blockIdx.y, blockIdx.z};
    for (int k = 0; k < 6; ++k) coords[6 * g + k] = c[k];
}
"""
INDICES_WRAPPER = r"""
extern "C" void run_indices(int* ids, int* coords, const unsigned* g, const unsigned* b) {
    cuda_emulator::launch(dim3(g[0], g[1], g[2]), dim3(b[0], b[1], b[2]), [&] { indices(ids, coords); });
}
"""


@pytest.mark.parametrize(("grid", "block"), [((3, 2, 1), (8, 4, 1)), ((3, 2, 2), (4, 3, 2))])
def test_grid_and_block_indices(tmp_path, grid, block):
    lib = _build(tmp_path, INDICES, INDICES_WRAPPER, "indices")
    total = int(np.prod(grid) * np.prod(block))
    ids = np.full(total, -1, np.int32)
    coords = np.full((total, 6), -1, np.int32)
    g, b = np.array(grid, np.uint32), np.array(block, np.uint32)  # alive during the call
    lib.run_indices(_ptr(ids), _ptr(coords), _ptr(g), _ptr(b))
    np.testing.assert_array_equal(ids, np.arange(total))
    # Linear ids run x fastest: reversed (z, y, x) C-order index grids.
    bz, by, bx, tz, ty, tx = np.indices(grid[::-1] + block[::-1]).reshape(6, total)
    np.testing.assert_array_equal(coords, np.stack([tx, ty, tz, bx, by, bz], axis=1))


BLOCK_ORDER = r"""
extern "C" __global__ void block_order(int* started, int* next) {
    const int bid = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    if (threadIdx.x == 0) started[bid] = (*next)++;  // the blocks run one at a time
}
"""
BLOCK_ORDER_WRAPPER = r"""
extern "C" void run_block_order(int* started, int* next) {
    cuda_emulator::launch(dim3(3, 2, 2), dim3(32), [&] { block_order(started, next); });
}
"""


@pytest.mark.parametrize("order", [None, "reversed"])
def test_blocks_run_in_index_order_or_its_reverse(tmp_path, monkeypatch, order):
    """A launch runs its blocks x fastest, then y, then z, or, where
    ``CUDA_EMULATOR_BLOCK_ORDER`` is ``reversed`` (read at each launch), the
    last first: a kernel that needs blocks to start in index order fails
    its tests then, as it could on a GPU, which promises no order."""
    if order:
        monkeypatch.setenv("CUDA_EMULATOR_BLOCK_ORDER", order)
    lib = _build(tmp_path, BLOCK_ORDER, BLOCK_ORDER_WRAPPER, "block_order")
    started, next_ = np.full(12, -1, np.int32), np.zeros(1, np.int32)
    lib.run_block_order(_ptr(started), _ptr(next_))
    np.testing.assert_array_equal(started, np.arange(12)[::-1] if order else np.arange(12))


DEVICE_HELPERS = r"""
extern "C" __global__ void helpers(const float* x, float* out, int n) {
    extern __shared__ __align__(16) float tile[];  // dynamic shared memory: launch's 4th argument
    const int i = threadIdx.x;
    tile[i] = x[i];
    __syncthreads();
    const float v = tile[n - 1 - i];  // reversed through shared memory
    out[0 * n + i] = v;
    out[1 * n + i] = __int_as_float(__float_as_int(v));
    out[2 * n + i] = (float)__longlong_as_double(__double_as_longlong((double)v));
    out[3 * n + i] = fmaxf(v, 0.0f) + fminf(v, 0.0f) - fabsf(v) * 0.0f;
    out[4 * n + i] = max(i, 3) + min(i, 3) + min(2u, (unsigned)i) + max(1ll, (long long)i);
    out[5 * n + i] = expf(0.0f) + logf(1.0f) + tanhf(0.0f) + sqrtf(4.0f);  // exactly 3
    out[6 * n + i] = (float)(exp(0.0) + log(1.0) + tanh(0.0) + fabs(-1.0));  // exactly 2
}
"""
DEVICE_HELPERS_WRAPPER = r"""
extern "C" void run_helpers(const float* x, float* out, int n) {
    cuda_emulator::launch(dim3(1), dim3(n), [&] { helpers(x, out, n); }, n * sizeof(float));
}
"""


def test_dynamic_shared_memory_and_device_helpers(tmp_path):
    lib = _build(tmp_path, DEVICE_HELPERS, DEVICE_HELPERS_WRAPPER, "helpers")
    n = 48
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    out = np.zeros((7, n), np.float32)
    lib.run_helpers(_ptr(x), _ptr(out), n)
    i = np.arange(n)
    for k in range(4):
        np.testing.assert_array_equal(out[k], x[::-1], err_msg=f"row {k}")
    np.testing.assert_array_equal(out[4], np.maximum(i, 3) + np.minimum(i, 3) + np.minimum(2, i) + np.maximum(1, i))
    np.testing.assert_array_equal(out[5], 3.0)
    np.testing.assert_array_equal(out[6], 2.0)


DIVERGENT = r"""
extern "C" __global__ void early_return(int* out) {
    if (threadIdx.x % 2) return;  // half the block never reaches the barrier
    __syncthreads();
    out[threadIdx.x] = 1;
}

extern "C" __global__ void two_barriers(int* out) {
    if (threadIdx.x < 8) {
        __syncthreads();
    } else {
        __syncthreads();  // another call site
    }
    out[threadIdx.x] = 1;
}

extern "C" __global__ void half_shuffle(int* out) {
    int v = threadIdx.x;
    if (threadIdx.x < 32) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    out[threadIdx.x] = v;
}
"""
DIVERGENT_WRAPPER = "\n".join(
    f'extern "C" void run_{k}() {{\n'
    f"    static int out[64];\n"
    f"    cuda_emulator::launch(dim3(2), dim3(64), [&] {{ {k}(out); }});\n}}"
    for k in ["early_return", "two_barriers", "half_shuffle"]
)
SECOND_SITE = 1 + next(i for i, line in enumerate(DIVERGENT.splitlines()) if "another call site" in line)


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        ("early_return", "has returned"),
        ("two_barriers", f"divergent.cu:{SECOND_SITE}"),
        ("half_shuffle", "__syncthreads()"),
    ],
)
def test_divergent_barrier_aborts(tmp_path, kernel, message):
    lib = _build(tmp_path, DIVERGENT, DIVERGENT_WRAPPER, "divergent")
    script = f"import ctypes, sys; ctypes.CDLL(sys.argv[1]).run_{kernel}()"
    result = _in_new_process(None, script, lib._name)
    assert result.returncode != 0
    assert "cuda_emulator: divergent barrier in block (0,0,0)" in result.stderr
    assert message in result.stderr


def test_compile_error_raises(tmp_path):
    with pytest.raises(RuntimeError, match=r"broken\.cu:2"):
        _build(tmp_path, "__global__ void k() {\n  undeclared_name = 1;\n}\n", "", "broken")


SANITIZED = r"""
extern "C" __global__ void read_past_the_end(const float* x, float* y) {
    y[threadIdx.x] = x[threadIdx.x + 1];  // the last thread reads x[n]
}

extern "C" __global__ void write_past_shared(float* y) {
    __shared__ float s[4];
    s[threadIdx.x + 1] = 1.0f;  // the last thread writes s[4]
    __syncthreads();
    y[threadIdx.x] = s[threadIdx.x];
}

extern "C" __global__ void overflow_an_index(const int* start, int* y) {
    y[threadIdx.x] = start[0] + (int)threadIdx.x;  // from INT_MAX: INT_MAX + 1 in the second thread
}

extern "C" __global__ void read_misaligned(const float* x, float* y) {
    const float* shifted = (const float*)((const char*)x + OFFSET);  // bytes; 1: off a float's alignment
    y[threadIdx.x] = shifted[threadIdx.x];
}
"""
SANITIZED_WRAPPER = r"""
extern "C" void run_read_past_the_end(const float* x, float* y) {
    cuda_emulator::launch(dim3(1), dim3(4), [&] { read_past_the_end(x, y); });
}
extern "C" void run_write_past_shared(float* y) {
    cuda_emulator::launch(dim3(1), dim3(4), [&] { write_past_shared(y); });
}
extern "C" void run_overflow_an_index(const int* start, int* y) {
    cuda_emulator::launch(dim3(1), dim3(4), [&] { overflow_an_index(start, y); });
}
extern "C" void run_read_misaligned(const float* x, float* y) {
    cuda_emulator::launch(dim3(1), dim3(4), [&] { read_misaligned(x, y); });
}
"""
SANITIZED_CALLS = {  # each launch (START: the first thread's index, set by the test)
    "read_past_the_end": "lib.run_read_past_the_end(p(np.ones(4, np.float32)), p(np.zeros(4, np.float32)))",
    "write_past_shared": "lib.run_write_past_shared(p(np.zeros(4, np.float32)))",
    "overflow_an_index": "lib.run_overflow_an_index(p(np.full(1, START, np.int32)), p(np.zeros(4, np.int32)))",
    "read_misaligned": "lib.run_read_misaligned(p(np.ones(5, np.float32)), p(np.zeros(4, np.float32)))",
}


def _run_sanitized(tmp_path: Path, source: str, call: str) -> subprocess.CompletedProcess:
    """Build ``source`` with SANITIZED_WRAPPER under the sanitizers and make
    ``call`` (``lib``: the library, ``p``: an array's pointer) in a new
    process."""
    environment = build.sanitizer_environment(tmp_path / "cache")
    if environment is None:
        pytest.skip("no AddressSanitizer runtime (libasan) that a Python starts with")
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "sanitized.cu"
    path.write_text(source)
    script = (
        "import ctypes, sys, numpy as np\n"
        "from cuda_emulator import build\n"
        f"lib = build.build([sys.argv[1]], {SANITIZED_WRAPPER!r}, {{}}, 'sanitized')\n"
        "p = lambda a: ctypes.c_void_p(a.ctypes.data)\n"
        f"{call}\n"
    )
    return _in_new_process(environment, script, str(path))


@pytest.mark.parametrize(
    ("kernel", "report"),
    [
        ("read_past_the_end", "AddressSanitizer: heap-buffer-overflow"),
        ("write_past_shared", "index 4 out of bounds for type 'float [4]'"),
        ("overflow_an_index", "runtime error: signed integer overflow"),
        ("read_misaligned", "runtime error: load of misaligned address"),
    ],
)
def test_sanitized_builds_stop_at_a_kernels_first_fault(tmp_path, kernel, report):
    """Under :func:`build.sanitizer_environment` a kernel that reads past
    an array, writes past a static shared array, overflows a signed index
    or reads a float off its alignment stops its process with the
    sanitizer's report naming it (so test_fast_cupy's sanitized run of the
    fused kernels would fail on one); the same launch within bounds (from
    INT_MAX - 3, at an offset of 4 bytes) runs clean."""
    call = SANITIZED_CALLS[kernel]
    faulty_source = SANITIZED.replace("OFFSET", "1")
    faulty = _run_sanitized(tmp_path / "faulty", faulty_source, call.replace("START", "2**31 - 1"))
    assert faulty.returncode != 0, faulty.stderr[-2000:]
    assert report in faulty.stderr and kernel in faulty.stderr, faulty.stderr[-2000:]
    within = SANITIZED.replace("[threadIdx.x + 1]", "[threadIdx.x]").replace("OFFSET", "4")
    clean = _run_sanitized(tmp_path / "clean", within, call.replace("START", "2**31 - 4"))
    assert clean.returncode == 0, clean.stderr[-2000:]


RACES = r"""
// Two warps (one in lanes_without_a_warp_operation), each kernel correct
// with the clean build's definitions of SYNC(), WARP_SYNC(), EARLY_WAIT()
// and WRITTEN, racy with the racy build's (RACE_DEFINES). The emulator runs
// thread 0 first, so in each racy kernel a thread of the second warp (or
// lane 1) makes the later of the two accesses, marked "later" ("earlier":
// the other).
extern "C" __global__ void read_after_write(float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = t;  // earlier
    SYNC();
    if (t >= 32) y[t] = s[t - 32];  // later: warp 0's entries
}

extern "C" __global__ void write_after_read(float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    s[t] = t;
    __syncthreads();
    if (t < 32) y[t] = s[t + 32];  // earlier: warp 1's entries...
    SYNC();
    if (t >= 32) s[t] = 0;  // later: ...which warp 1 writes again
}

extern "C" __global__ void two_writes(float* y) {
    __shared__ float s[32];
    const int t = threadIdx.x;
    if (t < 32) s[t] = 1;  // earlier
    SYNC();
    if (t >= 32) s[t - 32] = 2;  // later
    __syncthreads();
    y[t] = s[t % 32];
}

extern "C" __global__ void copy_over_a_tile_being_read(const float* x, float* y) {
    __shared__ __align__(16) float tile[64 * 4];
    const int t = threadIdx.x;
    async_copy_16(shared_address(&tile[4 * t]), x + 4 * t, true);
    async_commit();
    async_wait<0>();
    __syncthreads();
    if (t < 32) y[t] = tile[4 * (t + 32)];  // earlier
    SYNC();  // the tile loop's closing barrier
    async_copy_16(shared_address(&tile[4 * t]), x + 256 + 4 * t, true);  // later
    async_commit();
    async_wait<0>();
    __syncthreads();
    y[t] += tile[4 * t];
}

extern "C" __global__ void read_before_the_copies_barrier(const float* x, float* y) {
    __shared__ __align__(16) float tile[64 * 4];
    const int t = threadIdx.x;
    async_copy_16(shared_address(&tile[4 * t]), x + 4 * t, true);
    async_commit();
    async_wait<0>();  // earlier: the copy lands
    SYNC();
    if (t >= 32) y[t] = tile[4 * (t - 32)];  // later
    __syncthreads();
}

extern "C" __global__ void read_a_copy_in_flight(const float* x, float* y) {
    __shared__ __align__(16) float tile[64 * 4];
    const int t = threadIdx.x;
    async_copy_16(shared_address(&tile[4 * t]), x + 4 * t, true);  // earlier
    async_commit();
    EARLY_WAIT();
    __syncthreads();
    if (t < 32) y[t] = tile[4 * (t + 32)];  // later: warp 1's copies, yet to be waited for
    async_wait<0>();
    __syncthreads();
}

extern "C" __global__ void lanes_without_a_warp_operation(float* y) {
    __shared__ float s[32];
    const int t = threadIdx.x;
    s[t] = t;  // earlier
    WARP_SYNC();
    y[t] = s[t > 0 ? t - 1 : 0];  // later
}

extern "C" __global__ void read_unwritten(float* y) {
    __shared__ float s[64];
    const int t = threadIdx.x;
    if (t < WRITTEN) s[t] = 1;
    __syncthreads();
    y[t] = s[63 - t];  // later
}
"""
RACE_WRAPPER = r"""
#define RUN(kernel, threads, ...)                                                            \
  extern "C" void run_##kernel(const float* x, float* y) {                                   \
    cuda_emulator::launch(dim3(2), dim3(threads), [&] { kernel(__VA_ARGS__); });             \
  }
RUN(read_after_write, 64, y)
RUN(write_after_read, 64, y)
RUN(two_writes, 64, y)
RUN(copy_over_a_tile_being_read, 64, x, y)
RUN(read_before_the_copies_barrier, 64, x, y)
RUN(read_a_copy_in_flight, 64, x, y)
RUN(lanes_without_a_warp_operation, 32, y)
RUN(read_unwritten, 64, y)
"""
RACE_DEFINES = {
    "clean": {
        "SYNC()": "__syncthreads()",
        "WARP_SYNC()": "(void)__shfl_xor_sync(0xffffffffu, 0, 1)",
        "EARLY_WAIT()": "async_wait<0>()",
        "WRITTEN": "64",
    },
    "racy": {"SYNC()": "", "WARP_SYNC()": "", "EARLY_WAIT()": "", "WRITTEN": "63"},
}
#: Each racy kernel's report: the problem, the thread making the later
#: access, and what it and the earlier one did (None: no earlier access).
RACE_REPORTS = {
    "read_after_write": ("read after write, no barrier between", 32, "reads", "wrote"),
    "write_after_read": ("write after read, no __syncthreads() between", 32, "writes", "read"),
    "two_writes": ("two writes, no barrier between", 32, "writes", "wrote"),
    "copy_over_a_tile_being_read": (
        "write after read, no __syncthreads() between",
        32,
        "issues a cp.async copy to",
        "read",
    ),
    "read_before_the_copies_barrier": ("read after write, no barrier between", 32, "reads", "wrote"),
    "read_a_copy_in_flight": ("read of a cp.async copy in flight", 0, "reads", "issued"),
    "lanes_without_a_warp_operation": ("read after write, no barrier between", 1, "reads", "wrote"),
    "read_unwritten": ("read of shared memory not yet written in this block", 0, "reads", None),
}


def _race_report(kernel: str) -> str:
    """RACE_REPORTS[kernel] as a pattern of the report, with the source lines
    of the kernel's accesses marked "later" and "earlier" in RACES."""
    problem, thread, later, earlier = RACE_REPORTS[kernel]
    lines = RACES.lstrip("\n").splitlines()
    first = next(i for i, line in enumerate(lines) if f" {kernel}(" in line)
    body = lines[first : next((i for i in range(first + 1, len(lines)) if "extern" in lines[i]), len(lines))]
    at = {mark: first + i + 1 for i, line in enumerate(body) for mark in ("later", "earlier") if f"// {mark}" in line}
    pattern = rf"{re.escape(problem)}.* thread \({thread},0,0\) {re.escape(later)} .* races\.cu:{at['later']} "
    return pattern if earlier is None else pattern + rf".* which thread .* {earlier} at .*races\.cu:{at['earlier']} "


def _run_racechecked(tmp_path: Path, variant: str, kernels: list[str]) -> subprocess.CompletedProcess:
    """RACES built under :func:`build.racecheck_environment` with
    RACE_DEFINES[variant], each of ``kernels`` run in turn in a new process."""
    environment = build.racecheck_environment(tmp_path / "cache")
    path = tmp_path / "races.cu"
    path.write_text(RACES.lstrip("\n"))
    script = (
        "import ctypes, sys, numpy as np\n"
        "from cuda_emulator import build\n"
        f"lib = build.build([*{[str(x) for x in STAND_INS]!r}, sys.argv[1]], "
        f"{RACE_WRAPPER!r}, {RACE_DEFINES[variant]!r}, 'races')\n"
        "x, y = np.arange(512, dtype=np.float32), np.zeros(64, np.float32)\n"
        f"for kernel in {kernels!r}:\n"
        "    getattr(lib, 'run_' + kernel)(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data))\n"
    )
    return _in_new_process(environment, script, str(path))


@pytest.mark.parametrize("kernel", list(RACE_REPORTS))
def test_racecheck_stops_at_each_race(tmp_path, kernel):
    """Under :func:`build.racecheck_environment` (racecheck.h) each kind of
    shared-memory race stops its process with both accesses' source lines:
    a read after another warp's write, a write after another warp's read, two
    writes, a cp.async copy issued into a tile another warp is reading (the
    tile loop without its closing barrier, which the emulator's lockstep
    alone lets pass), a read of a landed copy before the barrier, a read of
    a copy in flight, two lanes of a warp with no warp-wide operation
    between, and a read of bytes the block never wrote."""
    result = _run_racechecked(tmp_path, "racy", [kernel])
    assert result.returncode != 0, result.stderr[-2000:]
    assert re.search(_race_report(kernel), result.stderr), result.stderr[-2000:]


def test_racecheck_passes_the_same_kernels_with_their_barriers(tmp_path):
    """The kernels of test_racecheck_stops_at_each_race with the barriers,
    the warp-wide operation, the wait and the write they lack run clean, two
    blocks each (the second block's accesses checked afresh)."""
    result = _run_racechecked(tmp_path, "clean", list(RACE_REPORTS))
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.skipif("-DCUDA_EMULATOR_RACECHECK" in build.FLAGS, reason="the race check is on in this process")
def test_lockstep_alone_passes_a_copy_over_a_tile_being_read(tmp_path):
    """Why the race check exists: without it the emulator runs the racy
    copy_over_a_tile_being_read to the right numbers (its threads run in
    order, so every read of the tile comes before the copy over it), where a
    GPU's warps may copy first."""
    path = tmp_path / "races.cu"
    path.write_text(RACES.lstrip("\n"))
    lib = build.build([*STAND_INS, path], RACE_WRAPPER, RACE_DEFINES["racy"], "races")
    x, y = np.arange(512, dtype=np.float32), np.zeros(64, np.float32)
    lib.run_copy_over_a_tile_being_read(_ptr(x), _ptr(y))
    t = np.arange(32)
    np.testing.assert_array_equal(y[:32], x[4 * (t + 32)] + x[256 + 4 * t])  # as if every warp waited
