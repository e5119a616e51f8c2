"""GPU speed and memory of npattn on CuPy against PyTorch's SDPA on CUDA, side by side.

    python benchmarks/bench_gpu.py            # B=1, N=8, H=64, T=S in {1024, 4096, 8192, 16384}
    python benchmarks/bench_gpu.py --quick    # small shapes, a smoke run (seconds)
    python benchmarks/bench_gpu.py --targets  # issue 18's table: the fused CuPy path against torch
    python benchmarks/bench_gpu.py --scores   # the same with a boolean mask or a bias (and its gradient)
    python benchmarks/bench_gpu.py --count-memory  # the fused path's arrays, counted on the CPU
    python benchmarks/bench_gpu.py --kernels  # where the fused path's time goes, kernel by kernel
    python benchmarks/bench_gpu.py --kernels --base HEAD~3  # each kernel against a revision's, interleaved
    python benchmarks/bench_gpu.py --tiles    # each tensor-core kernel at each tile size
    python benchmarks/bench_gpu.py --kept     # the backward with 0, 1 or 2 operands kept in shared memory
    python benchmarks/bench_gpu.py --fused-dq --kernels --base HEAD   # float64's dQ summed in dK/dV, against not
    python benchmarks/bench_gpu.py --kept-q --kernels --base HEAD     # float64's forward keeping Q in shared memory
    python benchmarks/bench_gpu.py --wgmma --kernels --base HEAD      # float16's kernels on sm_90a's wgmma
    python benchmarks/bench_gpu.py --auto     # the fused path against the dense one at small sizes
    python benchmarks/bench_gpu.py --cache    # a decode step on a preallocated KV cache's views
    python benchmarks/bench_gpu.py --host-time --base HEAD~1  # npattn's Python per call (decode, training), no GPU

``--targets`` prints, for each workload of the fused path's targets, torch
SDPA, the fused CuPy kernels (``npattn.fast_cupy``, what ``impl="chunked"``
runs on CuPy; "fwd share": their forward's time over their
forward+backward's) and, at T=S=4096, the fused kernels on the CUDA cores
(``NPATTN_CUPY_TENSOR_CORES=0``) and the generic chunked path
(``NPATTN_FAST_CUPY=0``): float16 and float32 at B=1, N=8, H=64, T=S in
{4096, 16384}, full and causal, forward+backward; float64 at T=S=4096;
decoding T=1 against S=32768 with N=32 query heads on 8 kv heads, H=128,
float16 (torch with ``enable_gqa=True``, forward only); and the peak
memory of forward+backward at T=S=16384.

``--scores`` prints the same columns for float16 and float32 at B=1, N=8,
H=64, T=S=4096, forward+backward, with the user's scores: a padding mask
``(B, 1, 1, S)`` (its last eighth of keys hidden), a boolean mask ``(T,
S)`` (each key kept with probability 0.9, the diagonal always), and a bias
``(N, T, S)`` in the inputs' dtype whose gradient both libraries return
(torch's ``attn_mask``, boolean or additive, with ``requires_grad``).

Prints one table. For each dtype (float32, float16; bfloat16 is reported as
skipped because CuPy has no bfloat16), each length and each mask (non-causal,
causal), one row per implementation measured in the same process:

- ``torch sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on
  CUDA (when torch with CUDA is importable; ``--no-torch`` leaves it out);
- ``dense``: ``npattn.attention_forward(..., impl="dense")`` on CuPy;
- ``fused (fast_cupy)``: ``impl="chunked"`` on CuPy, which runs the fused
  CUDA kernels of ``npattn.fast_cupy``;
- ``chunked BQxBK (default)``: the generic Array API chunked path
  (``NPATTN_FAST_CUPY=0``) with no block sizes, so the tiles are the library's accelerator
  default, ``npattn.chunked.default_blocks`` (2048x2048 at B*N = 8: one score
  tile over all heads holds ``ACCELERATOR_TILE_SCORES`` = 2**25 entries);
- ``chunked BQxBK``: the same with explicit square tiles, for each size of
  ``--blocks`` (default: 128, the CPU default, and 1024; ``--blocks none``
  leaves them out; a size equal to the default tiles is not repeated). The
  fastest chunked row is named after the table.
  Measured on an H100 (float32, T=S=16384): 128x128 tiles are ~200-330x
  slower than torch in fwd+bwd (the Python loop launches ~20 small kernels
  per tile), 512x512 ~15x, 1024x1024 ~4-8x, 2048x2048 (the default) ~3.2-3.5x,
  the fastest, at under 1 GiB of peak memory against dense's 32 GiB.

Columns: best forward ms and forward+backward ms (the device synchronized
before and after every run, after a warm-up run, best of ``--repeats``; a
run slower than 2 s is not repeated), the peak device MiB of one
forward+backward beyond the inputs (CuPy: a dedicated ``cupy.cuda.MemoryPool``
read after every allocation, see ``npattn.__main__.cupy_peak_bytes``; torch:
``torch.cuda.max_memory_allocated``), both times as a multiple of torch's,
and ``max |out - torch|`` as a check that the rows compute the same thing.
Both libraries' memory pools are emptied between cases. A dense row is
skipped when its estimated peak (``DENSE_LIVE_SCORE_TENSORS`` float32 score
tensors) exceeds 90% of the free device memory, and a chunked row when
extrapolating its time from the previous length exceeds ``--row-budget``.

``--count-memory`` needs no GPU: it runs the fused path's Python side
(``npattn.fast_cupy``, through ``attention_forward``/``attention_backward``)
with NumPy arrays in CuPy's place and kernels that do nothing, and prints the
peak bytes its arrays take beyond the inputs (``tracemalloc``) for the peak
memory row's problem (B=1, N=8, H=64, causal, forward+backward) in float16
and float32: what the GPU's pool holds at its peak, kernels aside (they
allocate nothing). It counts 97.0 MiB for float16 at T=S=16384, what the
H100 measured (and, for the code before float16 stayed float16, 337.0 MiB
where the H100 measured 337).

``--kernels`` says where the fused path's time goes, for the float16,
float32 and float64 rows of ``--targets`` at T=S=4096 and the decode step: each
kernel's device time (CUDA events around each launch, summed over the
call; best of ``--repeats`` calls) with the TFLOP/s of its products
(forward ``4 B N T S H``, dQ ``6``, dK/dV ``8``, halved when causal; a
decode step's forward: the GB/s at which it reads ``k`` and ``v``), the
whole call's wall time (synchronized before and after, as ``--targets``
measures it), and the host's share: the wall time of ``DECODE_REPEATS``
calls issued back to back without synchronizing, per call, against the
host's own time to issue them (which the device time hides only where it
is the longer), and one synchronized call's timeline: for each launch,
when the host issued it and when the device started and ended it (ms from
the call's start), and the device's idle time before the first kernel and
between kernels, where the call waited on the host. With ``--base REV``,
that git revision of npattn (or a
folder with a copy of the package, ``worktree`` for the files on disk)
runs beside, call by call in turn on the same arrays, and each kernel's
best device ms is printed for both with their ratio (a kernel change's
effect, measured on one machine in one process), then each side's
timeline.

``--tiles`` times each tensor-core kernel (forward, dQ, dK/dV) at each
tile size of ``TILE_SIZES`` whose two tiles fit its shared memory (or, for
the float64 forward, one key and one value tile:
``npattn.fast_cupy.tensor_split_stages``)
(``npattn.fast_cupy.tensor_tile`` patched; the other kernels keep their
own), in float16, float32 and float64 at T=S=4096, full, B=1, N=8, H=64:
device ms per kernel, best of ``--repeats``, ``*`` on the size
``tensor_tile`` picks, and the forward again without its registers capped
to fit ``npattn.fast_cupy.tensor_min_blocks`` blocks per multiprocessor
("forward uncapped", where they are); then the decode step's forward (the ``--targets``
row) with its keys split for each of ``SPLIT_SWEEP`` blocks per
multiprocessor (``npattn.fast_cupy.SPLIT_BLOCKS_PER_SM`` patched): its key
ranges, the forward's and the merge's device ms and the GB/s of ``k`` and
``v``. These are the data to choose both rules from.

``--kept`` times the tensor-core backward's dQ and dK/dV kernels with 0,
1 and 2 of each one's A operands kept in shared memory
(``npattn.fast_cupy.TENSOR_KEPT_OPERANDS`` patched, each count's modules
and plans kept apart), the counts in turn call by call, best of
``--repeats`` calls each, ``*`` on what ``tensor_kept_operands`` picks, a
count in brackets where the shared memory took fewer: float16 at H=64
(T=S=4096 and 16384) and H=128, float32 at H=64 and 128, float64 at H=64,
full and causal, B=1, N=8. These are the data to choose
``TENSOR_KEPT_OPERANDS`` from.

``--fused-dq`` runs whatever else is asked (``--kernels``, ``--kernels
--base REV``, ``--targets``) with float64's dK/dV kernel summing dQ
(``npattn.fast_cupy.TENSOR_FUSED_DQ`` set to float64 for the run; not yet
shipped): against ``--base HEAD``, each kernel with and without the dQ
kernel, and their sum (``--kernels --base`` prints every kernel's best
summed too). These are the data to ship it from. ``--kept-q`` does the
same with float64's tensor-core forward keeping Q's fragments in shared
memory at 3 blocks a multiprocessor (``npattn.fast_cupy.TENSOR_KEPT_Q``;
not yet shipped): against ``--base HEAD``, the forward kernel each way.
``--wgmma`` does the same with float16's tensor-core kernels on sm_90a's
warpgroup tensor cores (``npattn.fast_cupy.TENSOR_WGMMA``, forward and
backward; not yet shipped; H=Hv=64 on an H100 or H200): against ``--base
HEAD``, each kernel each way, and with ``--targets`` the float16 rows.

``--auto`` holds up ``impl="auto"``'s rule on CuPy (the fused kernels
wherever they run the call, however small): the dense path and the fused
path (``impl="chunked"``) on CuPy, the dense side timed before and after
the fused one (best of ``AUTO_REPEATS`` synchronized calls each), at B=1,
N=8, H=64, T=S from 16 to 2048, full and causal, forward+backward, and
decode steps (T=1 against S from 128 to 32768, N=32 on 8 kv heads, H=128,
forward), in float16, float32 and float64, with the path ``"auto"`` takes.

``--cache`` times a decode step (float16, T=1, N=32 on 8 kv heads, H=128,
``causal=True, align="bottom_right"``) on the first ``S`` positions of
preallocated cache buffers (``CACHE_ROWS``: ``S`` and the buffers' spare
positions past it), as a :class:`npattn.KVCache` hands them out: on
C-order copies of those keys, on the views themselves (read where they lie),
and on the views copied to C order first (what every step did before the
fused kernels read such views), best of ``DECODE_REPEATS`` synchronized
calls each, the three in turn, twice.

``--host-time`` needs no GPU either: the Python npattn runs per call on the
fused path, which a decode step's kernels (tens of microseconds) wait on, with
``--count-memory``'s stand-ins (NumPy arrays in CuPy's place, kernels that do
nothing), outputs from a pool of zeros and casts that take one from it
(as CuPy's ``astype`` is an allocation and a kernel): ``attention_forward``'s
time per call, best of ``--repeats`` rounds of ``HOST_CALLS`` calls, for
the decode step of ``--targets`` (``impl="chunked"``), the same step with
``causal=True, align="bottom_right"`` (a KV cache's), the same step with
the keys growing by one a call (a decoding loop's, each call a spec not
seen before), and a float16 training call's forward and backward (B=1,
N=8, T=S=4096, H=64, whose forward kernel runs about 0.19 ms on an H100
while the host issues the rest), and of each the time
before the call's first kernel launch, which a synchronized step waits
through before its kernels start (the rest of the call overlaps the
kernels). With ``--base REV`` that git revision of npattn (or a
folder with a copy of the package, ``worktree`` for the files on disk) runs
beside, round by round in one process, so that the ratio attributes a change
on a CPU whose speed drifts. CuPy's own calls (allocations, launches, its
``astype``) are not in these times; NumPy's stand in for them.

Without CuPy or a CUDA device the tables print ``skipped: ...`` and exit
with 0; bad arguments exit with 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import os
import runpy
import sys
import time
import tracemalloc
from unittest import mock

import array_api_compat.numpy
import numpy as np

try:
    import npattn
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import npattn
from npattn import attention_backward, attention_forward
from npattn.__main__ import cupy_peak_bytes
from npattn.chunked import default_blocks
from npattn.options import DEFAULT_BLOCK_Q, SpecMemo, make_spec

#: Dense forward+backward keeps about this many (B, N, T, S) float32 tensors
#: alive at its peak (scores, probabilities, dP, dS and a temporary).
DENSE_LIVE_SCORE_TENSORS = 5

#: A timed run longer than this is not repeated.
SLOW_RUN_S = 2.0

#: Width of the table's impl column ("chunked 2048x2048 (default)" fits).
LABEL = 28


def _cupy():
    """``(cupy, None)``, or ``(None, why)`` without CuPy or a CUDA device."""
    try:
        cp = importlib.import_module("cupy")
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device is visible")
        cp.zeros(1).sum()  # a device that cannot run a kernel fails here, not mid-table
    except Exception as err:  # ImportError, CUDARuntimeError, ...
        return None, f"{type(err).__name__}: {err}"
    return cp, None


def _torch_cuda():
    """``(torch, None)``, or ``(None, why)`` without torch built with CUDA."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as err:
        return None, f"torch is not installed ({err})"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return torch, None


@contextlib.contextmanager
def _environment(settings: dict[str, str]):
    """``settings`` in ``os.environ`` for the duration: ``NPATTN_FAST_CUPY=0``
    runs CuPy's chunked path on the generic Array API path instead of the fused
    kernels, ``NPATTN_CUPY_TENSOR_CORES=0`` the fused kernels on the CUDA cores."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


#: The environment of each of the CuPy rows of ``--targets`` beside the fused
#: kernels' default (the tensor cores where they apply).
GENERIC = {"NPATTN_FAST_CUPY": "0"}
CUDA_CORES = {"NPATTN_CUPY_TENSOR_CORES": "0"}


def _best_ms(fn, sync, repeats: int) -> float:
    """Best wall time of ``fn()`` in ms, the device synchronized around each run."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        if elapsed > SLOW_RUN_S:
            break
    return best * 1e3


class _Case:
    """One (dtype, T, causal) problem: the same host data on CuPy and on torch."""

    def __init__(self, cp, torch, dtype: str, B: int, N: int, T: int, H: int, causal: bool, seed: int = 0):
        rng = np.random.default_rng(seed)
        host = [rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4)]  # q, k, v, dout
        self.cp, self.torch, self.causal = cp, torch, causal
        self.q, self.k, self.v, self.dout = (cp.asarray(a).astype(getattr(cp, dtype)) for a in host)  # (B, N, T, H)
        self.t = None
        if torch is not None:
            tdtype = getattr(torch, dtype)
            self.t = [torch.tensor(a, device="cuda").to(tdtype) for a in host]

    # -- npattn on CuPy --

    def npattn_forward(self, options):
        options = dict(options)
        with _environment(GENERIC if options.pop("generic", False) else {}):
            return attention_forward(self.q, self.k, self.v, causal=self.causal, **options)

    def npattn_forward_backward(self, options):
        out, res = self.npattn_forward(options)
        return out, attention_backward(self.dout, res)  # the backward follows the forward's kernel

    # -- torch SDPA --

    def _torch_inputs(self):
        return [x.detach().requires_grad_(True) for x in self.t[:3]]

    def torch_forward(self):
        q, k, v = self._torch_inputs()  # grad-enabled, so the forward keeps what the backward needs
        return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def torch_forward_backward(self):
        q, k, v = self._torch_inputs()
        out = self.torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out.backward(self.t[3])
        return out, (q.grad, k.grad, v.grad)


def _device_name(cp) -> str:
    """The current CUDA device's name (CuPy gives it as bytes)."""
    name = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _free_pools(cp, torch) -> None:
    cp.cuda.runtime.deviceSynchronize()
    cp.get_default_memory_pool().free_all_blocks()
    if torch is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _torch_row(case: _Case, repeats: int):
    torch = case.torch
    sync = torch.cuda.synchronize
    _free_pools(case.cp, torch)
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, _ = case.torch_forward_backward()  # warm-up, and the memory peak
    sync()
    peak = torch.cuda.max_memory_allocated() - base
    reference = case.cp.from_dlpack(out.detach().float().contiguous())  # (B, N, T, H) float32
    del out
    fwd = _best_ms(case.torch_forward, sync, repeats)
    both = _best_ms(case.torch_forward_backward, sync, repeats)
    return fwd, both, peak, reference


def _npattn_row(case: _Case, options: dict, repeats: int, reference):
    cp = case.cp
    sync = cp.cuda.runtime.deviceSynchronize
    _free_pools(cp, case.torch)
    difference = [None]

    def warm_up():  # warm-up (kernels compile on first use), and the memory peak
        out, _ = case.npattn_forward_backward(options)
        if reference is not None:
            difference[0] = float(cp.max(cp.abs(out.astype(cp.float32) - reference)))

    peak = cupy_peak_bytes(cp, warm_up)
    fwd = _best_ms(lambda: case.npattn_forward(options), sync, repeats)
    both = _best_ms(lambda: case.npattn_forward_backward(options), sync, repeats)
    return fwd, both, peak, difference[0]


def _positive_ints(text: str) -> list[int]:
    if text.strip().lower() == "none":
        return []
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be integers >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T=S in {256, 512}, one repeat: a smoke run")
    parser.add_argument("--lengths", type=_positive_ints, help="comma-separated T=S values")
    parser.add_argument(
        "--blocks",
        type=_positive_ints,
        help=f"comma-separated square chunked tile sizes besides the default tiles "
        f"(default {DEFAULT_BLOCK_Q},1024; 'none' for none)",
    )
    parser.add_argument(
        "--dtypes", default="float32,float16,bfloat16", help="comma-separated, from float32, float16, bfloat16"
    )
    parser.add_argument("--repeats", type=int, default=3, help="best of this many timed runs (default 3)")
    parser.add_argument(
        "--row-budget",
        type=float,
        default=30.0,
        help="skip a chunked row whose fwd+bwd is extrapolated past this many seconds",
    )
    parser.add_argument("--no-torch", action="store_true", help="leave out torch SDPA")
    parser.add_argument("--targets", action="store_true", help="issue 18's table: fused CuPy path vs torch")
    parser.add_argument("--scores", action="store_true", help="--targets' columns with a mask or a bias")
    parser.add_argument(
        "--count-memory", action="store_true", help="the fused path's arrays at their peak, counted on the CPU"
    )
    parser.add_argument("--kernels", action="store_true", help="the fused path's time, kernel by kernel")
    parser.add_argument("--tiles", action="store_true", help="each tensor-core kernel at each tile size")
    parser.add_argument("--kept", action="store_true", help="the backward by operands kept in shared memory")
    parser.add_argument("--auto", action="store_true", help="the fused path against the dense one at small sizes")
    parser.add_argument("--cache", action="store_true", help="a decode step on a preallocated KV cache's views")
    parser.add_argument(
        "--host-time", action="store_true", help="npattn's Python per decode and training call, on the CPU"
    )
    parser.add_argument(
        "--base", help="with --host-time or --kernels: a git revision (or folder, or 'worktree') of npattn beside"
    )
    parser.add_argument(
        "--fused-dq",
        action="store_true",
        help="float64's dK/dV kernel sums dQ (fast_cupy.TENSOR_FUSED_DQ, not yet shipped); "
        "with --kernels --base REV, against REV's dQ kernel",
    )
    parser.add_argument(
        "--kept-q",
        action="store_true",
        help="float64's forward keeps Q in shared memory, 3 blocks a multiprocessor "
        "(fast_cupy.TENSOR_KEPT_Q, not yet shipped); with --kernels --base REV, against REV's",
    )
    parser.add_argument(
        "--wgmma",
        action="store_true",
        help="float16's kernels on sm_90a's wgmma (fast_cupy.TENSOR_WGMMA, not yet shipped); "
        "with --kernels --base REV, against REV's",
    )
    args = parser.parse_args(argv)
    if args.fused_dq or args.kept_q or args.wgmma:
        import npattn.fast_cupy

        if args.fused_dq:
            npattn.fast_cupy.TENSOR_FUSED_DQ = frozenset({"f64"})
        if args.kept_q:
            npattn.fast_cupy.TENSOR_KEPT_Q = {"f64": 3}
        if args.wgmma:
            npattn.fast_cupy.TENSOR_WGMMA = {"f16": (True, True)}
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.row_budget > 0:
        parser.error(f"--row-budget must be > 0, got {args.row_budget}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in ("float32", "float16", "bfloat16"):
            parser.error(f"--dtypes: unknown dtype {d!r} (choose from float32, float16, bfloat16)")

    if args.base is not None and not (args.host_time or args.kernels):
        parser.error("--base goes with --host-time or --kernels")
    if args.count_memory:
        return count_memory(args.lengths or [16384])
    if args.host_time:
        return host_time(args.base, args.repeats)
    cp, why_not = _cupy()
    if cp is None:
        print(f"skipped: CuPy with a CUDA device is not available ({why_not})")
        return 0
    torch, why_no_torch = (None, "--no-torch") if args.no_torch else _torch_cuda()
    if args.targets:
        return targets(cp, torch, why_no_torch, args.repeats)
    if args.scores:
        return scores(cp, torch, why_no_torch, args.repeats)
    if args.kernels:
        if args.base is not None:
            return kernels_against(cp, _workload_helpers()["load_base"](args.base), args.base, args.repeats)
        return kernels(cp, args.repeats)
    if args.tiles:
        return tiles(cp, args.repeats)
    if args.kept:
        return kept(cp, args.repeats)
    if args.auto:
        return auto(cp)
    if args.cache:
        return cache(cp)

    B, N, H = 1, 8, 64
    lengths = args.lengths or ([256, 512] if args.quick else [1024, 4096, 8192, 16384])
    blocks = args.blocks if args.blocks is not None else ([DEFAULT_BLOCK_Q] if args.quick else [DEFAULT_BLOCK_Q, 1024])
    repeats = 1 if args.quick else args.repeats
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = _device_name(cp)
    print(
        f"npattn on CuPy {cp.__version__} vs torch SDPA ({torch.__version__ if torch else why_no_torch}) "
        f"on {name}, {props['totalGlobalMem'] / 2**30:.0f} GiB; B={B}, N={N}, H={H}, T=S; "
        f"CUPY_TF32={os.environ.get('CUPY_TF32', 'unset')}"
    )
    print(
        f"times: best of {repeats} after a warm-up, device synchronized; peak MiB: one fwd+bwd beyond the inputs; "
        "x torch: this row's time / torch's"
    )
    header = (
        f"{'dtype':<8} {'T=S':>6} {'mask':<6} {'impl':<{LABEL}} {'fwd ms':>9} {'f+b ms':>9} {'peak MiB':>9} "
        f"{'fwd x torch':>11} {'f+b x torch':>11} {'max|out-torch|':>14}"
    )
    print(header)
    print("-" * len(header))
    failures = 0
    best = {}  # (dtype, causal) -> {impl label: f+b ms at the largest length measured}
    slow = {}  # (dtype, causal, impl label) -> (T, f+b seconds) of the last row
    for dtype in dtypes:
        if dtype == "bfloat16" and not hasattr(cp, "bfloat16"):
            print(
                f"{dtype:<8} skipped: CuPy has no bfloat16 dtype (npattn supports bfloat16 where the namespace has it)"
            )
            continue
        for T in lengths:
            for causal in (False, True):
                mask = "causal" if causal else "full"
                case = _Case(cp, torch, dtype, B, N, T, H, causal)
                prefix = f"{dtype:<8} {T:>6} {mask:<6}"
                reference, t_fwd, t_both = None, None, None
                if torch is not None:
                    try:
                        t_fwd, t_both, t_peak, reference = _torch_row(case, repeats)
                        print(
                            f"{prefix} {'torch sdpa':<{LABEL}} {t_fwd:9.2f} {t_both:9.2f} {t_peak / 2**20:9.1f} "
                            f"{1:11.2f} {1:11.2f} {0:14.1e}",
                            flush=True,
                        )
                    except torch.cuda.OutOfMemoryError:
                        print(f"{prefix} {'torch sdpa':<{LABEL}} out of device memory", flush=True)
                bq, bk = default_blocks(make_spec(case.q, case.k, case.v, causal=causal, impl="chunked"))
                impls = [
                    ("dense", "dense", dict(impl="dense")),  # (key for extrapolation, label, options)
                    ("fused", "fused (fast_cupy)", dict(impl="chunked")),
                    ("default", f"chunked {bq}x{bk} (default)", dict(impl="chunked", generic=True)),
                ]
                impls += [
                    (f"{b}x{b}", f"chunked {b}x{b}", dict(impl="chunked", block_q=b, block_k=b, generic=True))
                    for b in blocks
                    if (b, b) != (bq, bk)
                ]
                for key, label, options in impls:
                    if key == "dense":
                        _free_pools(cp, torch)
                        need = DENSE_LIVE_SCORE_TENSORS * B * N * T * T * 4
                        free = cp.cuda.runtime.memGetInfo()[0]
                        if need > 0.9 * free:
                            print(
                                f"{prefix} {label:<{LABEL}} skipped: needs ~{need / 2**30:.0f} GiB, "
                                f"{free / 2**30:.0f} GiB free",
                                flush=True,
                            )
                            continue
                    else:
                        last = slow.get((dtype, causal, key))
                        if last is not None and last[1] * (T / last[0]) ** 2 > args.row_budget:
                            print(
                                f"{prefix} {label:<{LABEL}} skipped: fwd+bwd extrapolated to "
                                f"~{last[1] * (T / last[0]) ** 2:.0f} s > --row-budget {args.row_budget:g} s",
                                flush=True,
                            )
                            continue
                    try:
                        fwd, both, peak, diff = _npattn_row(case, options, repeats, reference)
                    except cp.cuda.memory.OutOfMemoryError:
                        print(f"{prefix} {label:<{LABEL}} out of device memory", flush=True)
                        continue
                    except Exception as err:  # a failure is a finding: report it and go on
                        print(f"{prefix} {label:<{LABEL}} FAILED: {type(err).__name__}: {err}", flush=True)
                        failures += 1
                        continue
                    slow[(dtype, causal, key)] = (T, both / 1e3)
                    if max(lengths) == T:
                        best.setdefault((dtype, causal), {})[label] = both
                    ratio_f = f"{fwd / t_fwd:11.2f}" if t_fwd else f"{'n/a':>11}"
                    ratio_b = f"{both / t_both:11.2f}" if t_both else f"{'n/a':>11}"
                    peak_s = f"{peak / 2**20:9.1f}" if peak is not None else f"{'n/a':>9}"
                    diff_s = f"{diff:14.1e}" if diff is not None else f"{'n/a':>14}"
                    print(
                        f"{prefix} {label:<{LABEL}} {fwd:9.2f} {both:9.2f} {peak_s} {ratio_f} {ratio_b} {diff_s}",
                        flush=True,
                    )
                del case
                _free_pools(cp, torch)
    for (dtype, causal), rows in best.items():
        chunked = {label: ms for label, ms in rows.items() if label.startswith("chunked")}
        if chunked:
            pick = min(chunked, key=chunked.get)
            print(
                f"fastest chunked tiles, {dtype} {'causal' if causal else 'full'} at T=S={max(lengths)}: "
                f"{pick} ({chunked[pick]:.1f} ms fwd+bwd"
                + (f"; dense {rows['dense']:.1f} ms" if "dense" in rows else "; dense skipped")
                + ")"
            )
    return 1 if failures else 0


# --- the fused path's arrays, counted on the CPU ----------------------------------------


class _NoKernels:
    """``npattn.fast_cupy.Runtime`` whose kernels do nothing, on NumPy
    arrays; ``first_launch``: the ``time.perf_counter()`` of the first
    launch since it was last set to None."""

    first_launch: float | None = None

    def module(self, source, defines):
        return defines  # a stand-in module, which fast_cupy keeps as it keeps CuPy's (None is not kept)

    def launch(self, module, name, grid, threads, args, shared_bytes=0):
        if self.first_launch is None:
            self.first_launch = time.perf_counter()

    def multiprocessors(self, like):
        return 132  # an H100's

    def shared_memory(self, like):
        return 227 * 1024  # an H100's opt-in maximum a block


def _forward_backward(q, k, v, dout) -> None:
    _, res = attention_forward(q, k, v, impl="chunked", causal=True)
    assert res.kernel == "cupy", res.kernel
    attention_backward(dout, res)


@contextlib.contextmanager
def _fused_on_numpy(package):
    """``package`` (npattn, or another revision of it) sends NumPy arrays to
    its fused CuPy path, whose kernels do nothing: yields its :class:`_NoKernels`."""
    runtime = _NoKernels()
    with (
        mock.patch.object(package.fast_numpy, "supports", lambda spec: False),
        mock.patch.object(package.fast_cupy, "supports", package.fast_cupy._kernels_take),
        mock.patch.object(package.fast_cupy, "_CUPY_RUNTIME", runtime),
        np.errstate(all="ignore"),  # the arrays the kernels would fill hold whatever was in memory
    ):
        yield runtime


def count_memory(lengths: list[int]) -> int:
    """Print the peak bytes of the fused path's arrays (see the module's docstring)."""
    import npattn.fast_numpy
    from npattn import fast_cupy

    print("peak MiB of the fused CuPy path's arrays beyond the inputs, counted on the CPU (kernels not run):")
    print("B=1, N=8, H=64, causal, forward+backward (bench_gpu --targets' peak memory row)")
    with _fused_on_numpy(npattn):
        for dtype in (np.float16, np.float32):
            for T in lengths:
                q, k, v, dout = (np.zeros((1, 8, T, 64), dtype) for _ in range(4))
                _forward_backward(q, k, v, dout)  # caches and compiled specs aside
                tracemalloc.start()
                _forward_backward(q, k, v, dout)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                precision = fast_cupy.tensor_precision(make_spec(q, k, v))
                print(f"{np.dtype(dtype).name:<8} T=S={T:<6} {peak / 2**20:9.1f} MiB  (kernels: {precision})")
    return 0


# --- npattn's Python per call, on the CPU -------------------------------------------

#: Calls per round of each ``--host-time`` row.
HOST_CALLS = 500


@contextlib.contextmanager
def _zeros_pool(fast_cupy):
    """``fast_cupy``'s allocations patched (``_empties`` and ``_scratch``;
    ``_empty`` in revisions before 2026-11-27's fourth session), and the
    namespace's ``astype`` where it casts: one array of zeros per shape and
    dtype (or scratch size), handed out again (an allocation's cost, and a
    cast's kernel, are CuPy's, not timed here)."""
    pool: dict = {}

    def empty(shape, dtype):
        key = (tuple(shape), np.dtype(dtype))
        if key not in pool:
            pool[key] = np.zeros(shape, dtype)
        return pool[key]

    def astype(x, dtype, /, *, copy=True, device=None):
        return x if x.dtype == dtype and not copy else empty(x.shape, dtype)

    with contextlib.ExitStack() as stack:
        if hasattr(fast_cupy, "_empties"):
            allocate = lambda spec, *requests: [None if r is None else empty(*r) for r in requests]  # noqa: E731
            stack.enter_context(mock.patch.object(fast_cupy, "_empties", allocate))
        else:
            stack.enter_context(mock.patch.object(fast_cupy, "_empty", lambda spec, shape, dtype: empty(shape, dtype)))
        if hasattr(fast_cupy, "_scratch"):
            scratch = lambda spec, sizes: [empty((size,), np.uint8) for size in sizes]  # noqa: E731
            stack.enter_context(mock.patch.object(fast_cupy, "_scratch", scratch))
        stack.enter_context(mock.patch.object(array_api_compat.numpy, "astype", astype))
        yield


def _host_rows(rng: np.random.Generator, calls: int):
    """``(label, calls)`` of ``--host-time``'s rows: ``calls(package)`` is
    a call of that revision of npattn, a function of no argument. The third
    row's keys grow by one a call, from views of preallocated buffers, as a
    decoding loop's do (through :class:`npattn.KVCache`), for up to
    ``calls`` calls, each of a key count not seen before; the last row is a
    float16 training call, forward and backward."""
    q = rng.standard_normal((1, 32, 1, 128)).astype(np.float16)
    S = 32768
    k, v = (np.zeros((1, 8, S + calls, 128), np.float16) for _ in range(2))
    kc, vc = (rng.standard_normal((1, 8, S, 128)).astype(np.float16) for _ in range(2))
    training = [np.zeros((1, 8, 4096, 64), np.float16) for _ in range(4)]  # q, k, v, dout

    def fixed(**options):
        return lambda package: functools.partial(package.attention_forward, q, kc, vc, **options)

    def growing(package):
        lengths = iter(range(S + 1, S + calls + 1))

        def step():
            n = next(lengths)
            return package.attention_forward(q, k[:, :, :n], v[:, :, :n], causal=True, align="bottom_right")

        return step

    def forward_backward(package):
        def call():
            out, res = package.attention_forward(*training[:3], impl="chunked")
            package.attention_backward(training[3], res)
            return out, res

        return call

    return [
        ("decode T=1 S=32768 (--targets')", fixed(impl="chunked")),
        ("  causal, bottom_right (a KV cache's)", fixed(causal=True, align="bottom_right")),
        ("  the same, S growing a key a call", growing),
        ("train T=S=4096 N=8 H=64, fwd+bwd", forward_backward),
    ]


def _best_call_us(calls: dict, runtimes: dict, rounds: int) -> dict:
    """Best µs per call of each of ``calls``, whole and before its first
    launch (read from its :class:`_NoKernels` in ``runtimes``): round after
    round, in turn, the order reversed every other round, the garbage
    collector paused."""
    best = {name: (float("inf"), float("inf")) for name in calls}
    names = list(calls)
    clock = time.perf_counter
    gc.disable()
    try:
        for round_ in range(rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                call, runtime = calls[name], runtimes[name]
                whole = before = 0.0
                for _ in range(HOST_CALLS):
                    runtime.first_launch = None
                    start = clock()
                    call()
                    whole += clock() - start
                    before += runtime.first_launch - start
                whole, before = whole / HOST_CALLS * 1e6, before / HOST_CALLS * 1e6
                best[name] = (min(best[name][0], whole), min(best[name][1], before))
    finally:
        gc.enable()
    return best


def _workload_helpers() -> dict:
    """``bench_workloads.py``'s functions (``load_base``, ``cpu_model``)."""
    return runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_workloads.py"))


def host_time(base: str | None, rounds: int) -> int:
    """Print npattn's Python per call on the fused path (see the module's docstring)."""
    helpers = _workload_helpers()
    packages = {"now": npattn} | ({"base": helpers["load_base"](base)} if base else {})
    print(f"npattn's Python per call on the fused CuPy path, on the CPU ({helpers['cpu_model']()}; kernels not run)")
    print(
        f"float16, decode N=32 on K=8, H=128; best of {rounds} rounds of {HOST_CALLS} calls"
        + (f"; base: {base}" if base else "")
        + "; us a call, whole and (pre) before its first launch"
    )
    columns = ("now us", "pre") + (("base us", "pre", "now/base", "pre") if base else ())
    print(f"{'call':<40}" + "".join(f" {column:>8}" for column in columns))
    with contextlib.ExitStack() as stack:
        runtimes = {}
        for name, package in packages.items():
            runtimes[name] = stack.enter_context(_fused_on_numpy(package))
            stack.enter_context(_zeros_pool(package.fast_cupy))
        for label, make in _host_rows(np.random.default_rng(0), (rounds + 1) * HOST_CALLS):
            calls = {name: make(package) for name, package in packages.items()}
            for name, call in calls.items():
                assert call()[1].kernel == "cupy", name  # and the caches warm
            us = _best_call_us(calls, runtimes, rounds)
            cells = list(us["now"])
            if base:
                cells += [*us["base"], us["now"][0] / us["base"][0], us["now"][1] / us["base"][1]]
            print(
                f"{label:<40}" + "".join(f" {cell:8.2f}" if i < 4 else f" {cell:8.3f}" for i, cell in enumerate(cells)),
                flush=True,
            )
    return 0


# --- issue 18's targets -------------------------------------------------------------

#: Repeats of the decode rows, whose calls take tens of microseconds.
DECODE_REPEATS = 50

#: The decode step of the targets: (dtype, B, N, K, T, S, H, causal), T=1
#: against S=32768, N=32 query heads on 8 kv heads, H=128, float16.
DECODE = ("float16", 1, 32, 8, 1, 32768, 128, False)


class _Problem:
    """q (B, N, T, H), k and v (B, K, S, H), dout like q, on CuPy and on
    torch; with ``scores`` (one of :data:`SCORES`) a mask or a bias too."""

    def __init__(self, cp, torch, dtype, B, N, K, T, S, H, causal, seed=0, scores=None):
        rng = np.random.default_rng(seed)
        shapes = [(B, N, T, H), (B, K, S, H), (B, K, S, H), (B, N, T, H)]
        host = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
        self.cp, self.torch, self.causal, self.gqa = cp, torch, causal, N != K
        self.arrays = [cp.asarray(a).astype(getattr(cp, dtype)) for a in host]
        self.tensors = None
        if torch is not None:
            self.tensors = [torch.tensor(a, device="cuda").to(getattr(torch, dtype)) for a in host]
        self.options = dict(causal=causal, align="bottom_right" if causal and T != S else None)
        self.scores, self.torch_scores = {}, None  # npattn's mask= or bias=, and torch's attn_mask
        if scores is not None:
            name, user = SCORES[scores](rng, B, N, T, S)
            user = user.astype(dtype) if name == "bias" else user
            self.scores = {name: cp.asarray(user)}
            if torch is not None:
                self.torch_scores = torch.tensor(user, device="cuda")

    def npattn(self, backward: bool, settings: dict[str, str] | None = None, impl: str = "chunked", package=npattn):
        """One call of ``package``'s (this npattn's, or ``--base``'s)."""
        q, k, v, dout = self.arrays
        with _environment(settings or {}):
            out, res = package.attention_forward(q, k, v, impl=impl, **self.options, **self.scores)
            if backward:
                package.attention_backward(dout, res)
        return out

    def sdpa(self, backward: bool):
        torch = self.torch
        q, k, v = (x.detach().requires_grad_(backward) for x in self.tensors[:3])
        kwargs = dict(enable_gqa=True) if self.gqa else {}
        if self.torch_scores is not None:
            bias = self.torch_scores.is_floating_point()
            kwargs["attn_mask"] = self.torch_scores.detach().requires_grad_(backward and bias)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal, **kwargs)
        if backward:
            out.backward(self.tensors[3])
        return out


def _peak(cp, torch, fn, on_torch: bool):
    """Peak device bytes of ``fn()`` beyond what was allocated before it."""
    _free_pools(cp, torch)
    if not on_torch:
        return cupy_peak_bytes(cp, fn)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _target_rows():
    """``(label, problem arguments, backward, with the generic row)`` of each workload."""
    for dtype in ("float16", "float32", "float64"):
        for T in (4096,) if dtype == "float64" else (4096, 16384):
            for causal in (False, True):
                mask = "causal" if causal else "full"
                yield f"{dtype} T=S={T} {mask} fwd+bwd", (dtype, 1, 8, 8, T, T, 64, causal), True, T == 4096
    yield "float16 decode T=1 S=32768 N=32 K=8 H=128 fwd", DECODE, False, True


def _target_row(cp, torch, label, arguments, backward, with_generic, repeats, scores=None) -> None:
    problem = _Problem(cp, torch, *arguments, scores=scores)
    csync, tsync = cp.cuda.runtime.deviceSynchronize, torch.cuda.synchronize
    ours = problem.npattn(backward).astype(cp.float32)
    theirs = cp.from_dlpack(problem.sdpa(backward).detach().float().contiguous())
    diff = float(cp.max(cp.abs(ours - theirs)))
    del ours, theirs
    t_torch = _best_ms(lambda: problem.sdpa(backward), tsync, repeats)
    t_fused = _best_ms(lambda: problem.npattn(backward), csync, repeats)
    t_forward = _best_ms(lambda: problem.npattn(False), csync, repeats) if backward else t_fused
    t_torch = min(t_torch, _best_ms(lambda: problem.sdpa(backward), tsync, repeats))  # torch, fused, torch
    others = []
    for settings in (CUDA_CORES, GENERIC):
        if not with_generic:
            others.append(f"{'-':>10}")
            continue
        run = functools.partial(problem.npattn, backward, settings)
        run()  # warm-up: kernels compile on first use
        others.append(f"{_best_ms(run, csync, 2) / t_torch:10.2f}")
    times = f"{t_torch:9.3f} {t_fused:9.3f} {t_fused / t_torch:8.2f} {t_forward / t_fused:9.2f}"
    print(f"{label:<46} {times} {' '.join(others)} {diff:10.1e}", flush=True)
    if label.startswith("float16 T=S=16384 causal"):
        fused = _peak(cp, torch, lambda: problem.npattn(True), False)
        ref = _peak(cp, torch, lambda: problem.sdpa(True), True)
        if fused is not None:
            row = f"{'peak MiB, that fwd+bwd':<46} {ref / 2**20:9.1f} {fused / 2**20:9.1f} {fused / ref:8.2f}"
            print(row, flush=True)


def targets(cp, torch, why_no_torch, repeats: int) -> int:
    """Print issue 18's table: each workload's times as a multiple of torch's.
    The fused rows run the fused kernels in float64 too, where ``impl="chunked"``
    would leave calls of more than ``FLOAT64_MAX_SCORES`` scores to the
    generic path (the "generic x" column)."""
    from npattn import fast_cupy

    fast_cupy.FLOAT64_MAX_SCORES = float("inf")
    if torch is None:
        print(f"skipped: the targets compare with torch SDPA on CUDA ({why_no_torch})")
        return 0
    name = _device_name(cp)
    host = _workload_helpers()["cpu_model"]()  # at small sizes both libraries' times are the host's too
    print(f"npattn fused CuPy path vs torch {torch.__version__} SDPA on {name}, host {host} ({os.cpu_count()} CPUs)")
    print(
        f"best of {repeats} (decode: {DECODE_REPEATS}), interleaved torch, fused, torch; "
        "CUDA cores (NPATTN_CUPY_TENSOR_CORES=0) and generic (NPATTN_FAST_CUPY=0): best of 2"
    )
    header = f"{'workload':<46} {'torch ms':>9} {'fused ms':>9} {'x torch':>8} {'fwd share':>9}"
    header += f" {'cores x':>10} {'generic x':>10}"
    print(f"{header} {'max|diff|':>10}")
    for label, arguments, backward, with_generic in _target_rows():
        reps = repeats if backward else DECODE_REPEATS
        _target_row(cp, torch, label, arguments, backward, with_generic, reps)
        _free_pools(cp, torch)
    return 0


# --- the user's mask or bias ------------------------------------------------------------


def _padding_mask(rng, B, N, T, S):
    """``("mask", (B, 1, 1, S))``: the last eighth of each batch element's keys hidden."""
    return "mask", np.broadcast_to(np.arange(S) < S - S // 8, (B, 1, 1, S)).copy()


def _random_mask(rng, B, N, T, S):
    """``("mask", (T, S))``: each key kept with probability 0.9, the
    diagonal always (no row hidden whole: torch's rows would be NaN)."""
    return "mask", (rng.random((T, S)) < 0.9) | np.eye(T, S, dtype=bool)


def _bias(rng, B, N, T, S):
    """``("bias", (N, T, S))``: standard normal, float32 (cast to the inputs' dtype)."""
    return "bias", rng.standard_normal((N, T, S), dtype=np.float32)


#: ``--scores``' kinds of the user's scores: ``make(rng, B, N, T, S) -> (option, host array)``.
SCORES = {"padding mask": _padding_mask, "mask": _random_mask, "bias": _bias}


def scores(cp, torch, why_no_torch, repeats: int) -> int:
    """Print ``--targets``' columns for calls with the user's mask or bias
    (see the module's docstring)."""
    if torch is None:
        print(f"skipped: the table compares with torch SDPA on CUDA ({why_no_torch})")
        return 0
    host = _workload_helpers()["cpu_model"]()
    print(f"npattn fused CuPy path vs torch {torch.__version__} SDPA on {_device_name(cp)}, host {host}")
    print(f"best of {repeats}, interleaved torch, fused, torch; cores and generic: best of 2")
    header = f"{'workload':<46} {'torch ms':>9} {'fused ms':>9} {'x torch':>8} {'fwd share':>9}"
    print(f"{header} {'cores x':>10} {'generic x':>10} {'max|diff|':>10}")
    for dtype in ("float16", "float32"):
        for kind in SCORES:
            label = f"{dtype} T=S=4096 {kind} fwd+bwd"
            _target_row(cp, torch, label, (dtype, 1, 8, 8, 4096, 4096, 64, False), True, True, repeats, kind)
            _free_pools(cp, torch)
    return 0


# --- impl="auto" on CuPy -------------------------------------------------------------

#: Timed calls per side of each ``--auto`` row (calls of 0.1-3 ms).
AUTO_REPEATS = 20


def _auto_rows():
    """``(label, problem arguments, backward)`` of ``--auto``."""
    for dtype in ("float16", "float32", "float64"):
        for T in (16, 64, 256, 1024, 2048):
            for causal in (False, True):
                mask = "causal" if causal else "full"
                yield f"{dtype} T=S={T} {mask} fwd+bwd", (dtype, 1, 8, 8, T, T, 64, causal), True
        for S in (128, 512, 4096, 32768):
            yield f"{dtype} decode T=1 S={S} fwd", (dtype, 1, 32, 8, 1, S, 128, True), False


def auto(cp) -> int:
    """Print the dense path's and the fused path's times on CuPy, and the
    path ``impl="auto"`` takes (see the module's docstring)."""
    from npattn.attention import choose_impl

    name = _device_name(cp)
    print(f"npattn on CuPy, {name}: dense and fused (impl='chunked') paths, best of {AUTO_REPEATS} each")
    print(f"{'workload':<40} {'dense us':>9} {'fused us':>9} {'fused/dense':>11} {'auto':>8}")
    sync = cp.cuda.runtime.deviceSynchronize
    for label, arguments, backward in _auto_rows():
        problem = _Problem(cp, None, *arguments)
        dense, fused = (functools.partial(problem.npattn, backward, impl=impl) for impl in ("dense", "chunked"))
        for run in (dense, fused):
            run()  # warm-up: kernels compile on first use
        t_dense = _best_ms(dense, sync, AUTO_REPEATS)
        t_fused = _best_ms(fused, sync, AUTO_REPEATS)
        t_dense = min(t_dense, _best_ms(dense, sync, AUTO_REPEATS))  # dense, fused, dense
        taken = choose_impl(make_spec(*problem.arrays[:3], **problem.options)).impl
        times = f"{t_dense * 1e3:9.0f} {t_fused * 1e3:9.0f} {t_fused / t_dense:11.2f}"
        print(f"{label:<40} {times} {taken:>8}", flush=True)
        _free_pools(cp, None)
    return 0


# --- a decode step on a preallocated KV cache -----------------------------------------

#: ``--cache``'s rows: ``S``, and the cache buffers' spare positions past it.
CACHE_ROWS = ((4096, 1024), (32768, 1024))


def cache(cp) -> int:
    """Print a decode step's time on a preallocated cache's views, on C-order
    copies of them, and on the views copied first (see the module's docstring)."""
    name = _device_name(cp)
    print(f"npattn decode step on CuPy, {name}: float16, T=1, N=32 on K=8, H=128, causal bottom_right")
    print(f"best of {DECODE_REPEATS} synchronized calls, twice in turn; ratios to the C-order keys")
    header = f"{'S (spare)':<14} {'C-order ms':>10} {'views ms':>9} {'copied ms':>10} {'views x':>8} {'copied x':>9}"
    print(f"{header} {'max|diff|':>10}")
    rng = np.random.default_rng(0)
    for S, spare in CACHE_ROWS:
        _cache_row(cp, rng, S, spare)
        _free_pools(cp, None)
    return 0


def _cache_row(cp, rng: np.random.Generator, S: int, spare: int) -> None:
    q = cp.asarray(rng.standard_normal((1, 32, 1, 128), dtype=np.float32)).astype(cp.float16)
    buffers = [cp.asarray(rng.standard_normal((1, 8, S + spare, 128), dtype=np.float32)) for _ in range(2)]
    views = [b.astype(cp.float16)[:, :, :S] for b in buffers]  # (1, 8, S, 128), kv heads S + spare rows apart
    packed = [x.copy() for x in views]

    def step(k, v, copy=False):
        k, v = (k.copy(), v.copy()) if copy else (k, v)
        return attention_forward(q, k, v, causal=True, align="bottom_right")[0]

    calls = {
        "C-order": functools.partial(step, *packed),
        "views": functools.partial(step, *views),
        "copied": functools.partial(step, *views, copy=True),
    }
    diff = float(cp.max(cp.abs(calls["views"]().astype(cp.float32) - calls["C-order"]().astype(cp.float32))))
    sync = cp.cuda.runtime.deviceSynchronize
    times = dict.fromkeys(calls, float("inf"))
    for _ in range(2):
        for label, call in calls.items():
            times[label] = min(times[label], _best_ms(call, sync, DECODE_REPEATS))
    ms = " ".join(f"{times[label]:{width}.3f}" for label, width in (("C-order", 10), ("views", 9), ("copied", 10)))
    ratios = f"{times['views'] / times['C-order']:8.2f} {times['copied'] / times['C-order']:9.2f}"
    print(f"{f'{S} ({spare})':<14} {ms} {ratios} {diff:10.1e}", flush=True)


# --- where the time goes ------------------------------------------------------------

#: Products per kernel, each ``B N T S H`` multiply-adds (before causal halves them).
KERNEL_PRODUCTS = {"npattn_forward": 2, "npattn_backward_dq": 3, "npattn_backward_dkdv": 4}


class _TimedLaunches:
    """``npattn.fast_cupy.Runtime`` that records CUDA events around each
    launch of another runtime, to sum each kernel's device time, and the
    host's ``time.perf_counter()`` as it records each launch's first event."""

    def __init__(self, cp, inner):
        self.cp, self.inner, self.events = cp, inner, []
        self.issued: list[float] = []  # each launch's host time, in the order of events
        self.grids: dict[str, tuple[int, int, int]] = {}  # each kernel's last grid

    def module(self, source, defines):
        return self.inner.module(source, defines)

    def multiprocessors(self, like):
        return self.inner.multiprocessors(like)

    def shared_memory(self, like):
        return self.inner.shared_memory(like)

    def launch(self, module, name, grid, threads, args, shared_bytes=0):
        start, end = self.cp.cuda.Event(), self.cp.cuda.Event()
        self.issued.append(time.perf_counter())
        start.record()
        self.grids[name] = grid
        # a base revision's runtime, from before dynamic shared memory, takes no shared_bytes
        self.inner.launch(module, name, grid, threads, args, *((shared_bytes,) if shared_bytes else ()))
        end.record()
        self.events.append((name, start, end))

    def kernel_ms(self) -> dict[str, float]:
        """Each kernel's device ms since the last call, summed over its launches."""
        self.cp.cuda.runtime.deviceSynchronize()
        totals: dict[str, float] = {}
        for name, start, end in self.events:
            totals[name] = totals.get(name, 0.0) + self.cp.cuda.get_elapsed_time(start, end)
        self.events, self.issued = [], []
        return totals

    def timeline(self, call) -> list[tuple[str, float, float, float]]:
        """``call()`` once, the device synchronized before and after: each
        launch's ``(kernel, issued, started, ended)``, ms from the call's
        start (an event recorded, and the host's clock read, just before
        it): when the host issued it, and when the device started and ended
        it (its events'). A kernel started as soon as issued waited on the
        host; one started as the one before ended, on the device."""
        self.kernel_ms()  # synchronizes; earlier events dropped
        origin = self.cp.cuda.Event()
        origin.record()
        host_origin = time.perf_counter()
        call()
        self.cp.cuda.runtime.deviceSynchronize()
        elapsed = self.cp.cuda.get_elapsed_time
        rows = [
            (name, (issued - host_origin) * 1e3, elapsed(origin, start), elapsed(origin, end))
            for (name, start, end), issued in zip(self.events, self.issued, strict=True)
        ]
        self.events, self.issued = [], []
        return rows


def _kernel_rows():
    """``(label, problem arguments, backward)`` of ``--kernels``."""
    for dtype in ("float16", "float32", "float64"):
        for causal in (False, True):
            yield f"{dtype} T=S=4096 {'causal' if causal else 'full'}", (dtype, 1, 8, 8, 4096, 4096, 64, causal), True
    yield "float16 decode T=1 S=32768 N=32 K=8 H=128", DECODE, False


def kernels(cp, repeats: int) -> int:
    """Print the fused path's time kernel by kernel (see the module's docstring)."""
    from npattn import fast_cupy

    name = _device_name(cp)
    print(f"npattn fused CuPy path on {name}: device ms per kernel (CUDA events), best of {repeats} calls")
    timed = _TimedLaunches(cp, fast_cupy._CUPY_RUNTIME)
    with mock.patch.object(fast_cupy, "_CUPY_RUNTIME", timed):
        for label, arguments, backward in _kernel_rows():
            print(label)
            _kernel_row(cp, timed, _Problem(cp, None, *arguments), arguments, backward, repeats)
            _free_pools(cp, None)
    return 0


def kernels_against(cp, base, label: str, repeats: int) -> int:
    """Print each kernel's device ms against those of ``base``, another
    npattn package (``label``'s: see the module's docstring)."""
    packages = {"now": npattn, "base": base}
    print(
        f"npattn fused CuPy path on {_device_name(cp)}, against {label}: device ms per kernel (CUDA events), "
        f"best of {repeats} calls each, the two in turn"
    )
    with contextlib.ExitStack() as stack:
        timed = {}
        for name, package in packages.items():
            timed[name] = _TimedLaunches(cp, package.fast_cupy._CUPY_RUNTIME)
            stack.enter_context(mock.patch.object(package.fast_cupy, "_CUPY_RUNTIME", timed[name]))
        for row, arguments, backward in _kernel_rows():
            problem = _Problem(cp, None, *arguments)
            best: dict[str, dict[str, float]] = {name: {} for name in packages}
            for package in packages.values():  # compiles
                problem.npattn(backward, package=package)
            for round_ in range(repeats):
                for name in packages if round_ % 2 == 0 else reversed(packages):
                    timed[name].kernel_ms()
                    problem.npattn(backward, package=packages[name])
                    for kernel, ms in timed[name].kernel_ms().items():
                        best[name][kernel] = min(best[name].get(kernel, float("inf")), ms)
            print(f"{row}: {'now ms':>9} {'base ms':>9} {'now/base':>9}")
            for kernel in dict.fromkeys([*best["now"], *best["base"]]):  # in launch order
                now, then = best["now"].get(kernel, float("nan")), best["base"].get(kernel, float("nan"))
                print(f"  {kernel:<26} {now:9.3f} {then:9.3f} {now / then:9.3f}", flush=True)
            # every kernel's best summed: the call's kernels where one side launches fewer (--fused-dq)
            now, then = sum(best["now"].values()), sum(best["base"].values())
            print(f"  {'every kernel':<26} {now:9.3f} {then:9.3f} {now / then:9.3f}", flush=True)
            for name, package in packages.items():
                call = functools.partial(problem.npattn, backward, package=package)
                _print_timeline(timed[name].timeline(call), f"{name}'s timeline")
            del problem
            _free_pools(cp, None)
    return 0


def _best_kernel_ms(timed: _TimedLaunches, problem: _Problem, backward: bool, repeats: int) -> dict[str, float]:
    """Each kernel's best device ms over ``repeats`` calls, after one that compiles."""
    problem.npattn(backward)
    best: dict[str, float] = {}
    for _ in range(repeats):
        timed.kernel_ms()
        problem.npattn(backward)
        for kernel, ms in timed.kernel_ms().items():
            best[kernel] = min(best.get(kernel, float("inf")), ms)
    return best


def _kernel_row(cp, timed: _TimedLaunches, problem: _Problem, arguments: tuple, backward: bool, repeats: int) -> None:
    dtype, B, N, K, T, S, H, causal = arguments
    for kernel, ms in _best_kernel_ms(timed, problem, backward, repeats).items():
        units = KERNEL_PRODUCTS.get(kernel.removesuffix("_tc"))
        rate = ""
        if units and backward:
            flops = 2 * units * B * N * T * S * H / (2 if causal else 1)  # 2 flops a multiply-add
            rate = f" {flops / ms / 1e9:8.1f} TFLOP/s"
        elif units:  # a decode step reads k and v once
            rate = f" {2 * B * K * S * H * np.dtype(dtype).itemsize / ms / 1e6:8.1f} GB/s of k and v"
        print(f"  {kernel:<26} {ms:8.3f} ms{rate}")
    sync = cp.cuda.runtime.deviceSynchronize
    wall = _best_ms(lambda: problem.npattn(backward), sync, repeats)
    sync()
    start = time.perf_counter()
    for _ in range(DECODE_REPEATS):
        problem.npattn(backward)
    issued = time.perf_counter() - start
    sync()
    streamed = time.perf_counter() - start
    timed.kernel_ms()  # the back-to-back calls' events, dropped
    print(
        f"  call: {wall:.3f} ms synchronized; {DECODE_REPEATS} back to back: {streamed / DECODE_REPEATS * 1e3:.3f} ms "
        f"a call, of which the host issued for {issued / DECODE_REPEATS * 1e3:.3f} ms",
        flush=True,
    )
    _print_timeline(timed.timeline(functools.partial(problem.npattn, backward)))


def _print_timeline(rows: list[tuple[str, float, float, float]], label: str = "timeline") -> None:
    """One synchronized call's launches (:meth:`_TimedLaunches.timeline`),
    under ``label``, and the device's idle time before its first kernel and
    between kernels: what the host's issuing adds to the call."""
    print(f"  {label}, ms from the call's start: kernel, issued by the host, started and ended on the device")
    idle, before = 0.0, rows[0][2]
    for (name, issued, started, ended), previous in zip(rows, [None, *rows[:-1]]):
        gap = 0.0 if previous is None else max(0.0, started - previous[3])
        idle += gap
        print(f"    {name:<26} {issued:8.3f} {started:8.3f} {ended:8.3f}" + (f"  (idle {gap:.3f})" if gap else ""))
    print(f"    device idle: {before:.3f} ms before the first kernel, {idle:.3f} between kernels", flush=True)


#: Tile sizes ``--tiles`` tries: keys per tile of the forward and dQ, query rows of dK/dV.
TILE_SIZES = (16, 32, 64)

#: Blocks per multiprocessor ``--tiles`` splits a decode step's keys for.
SPLIT_SWEEP = (2, 4, 8, 16)

#: The tensor-core kernels ``--tiles`` times, and whether each is the backward's.
TILED_KERNELS = (("npattn_forward_tc", False), ("npattn_backward_dq_tc", True), ("npattn_backward_dkdv_tc", True))


def _tile_rows():
    """``(label, problem arguments)`` of ``--tiles``."""
    for dtype in ("float16", "float32", "float64"):
        yield f"{dtype} T=S=4096 full", (dtype, 1, 8, 8, 4096, 4096, 64, False)


def tiles(cp, repeats: int) -> int:
    """Print each tensor-core kernel's device ms at each tile size (see the module's docstring)."""
    from npattn import fast_cupy

    name = _device_name(cp)
    print(f"npattn tensor-core kernels on {name}: device ms by tile size, best of {repeats}; * fast_cupy's choice")
    columns = [kernel.removeprefix("npattn_") for kernel, _ in TILED_KERNELS] + ["forward uncapped"]
    print(f"{'problem':<24} {'tile':>5} " + " ".join(f"{column:>17}" for column in columns))
    timed = _TimedLaunches(cp, fast_cupy._CUPY_RUNTIME)
    with mock.patch.object(fast_cupy, "_CUPY_RUNTIME", timed):
        for label, problem, spec, precision in _tensor_problems(cp, _tile_rows(), 24):
            for tile in TILE_SIZES:
                _tile_row(timed, problem, spec, precision, tile, label, repeats)
        _split_rows(cp, timed, repeats)
    return 0


def _tensor_problems(cp, rows, width: int):
    """``(label, problem, spec, precision)`` of each ``(label, problem
    arguments)`` of ``rows`` that the tensor cores run on this device (the
    others say so, ``label`` ``width`` wide), its memory freed after its
    turn."""
    from npattn import fast_cupy

    for label, arguments in rows:
        problem = _Problem(cp, None, *arguments)
        spec = make_spec(*problem.arrays[:3])
        precision = fast_cupy.tensor_precision(spec)
        if precision is None:
            print(f"{label:<{width}} skipped: no tensor-core kernels for it on this device")
            continue
        yield label, problem, spec, precision
        del problem
        _free_pools(cp, None)


def _tile_row(timed: _TimedLaunches, problem: _Problem, spec, precision: str, tile: int, label: str, repeats: int):
    """One row of ``--tiles``: each kernel at ``tile`` where two fit (the
    forward of one key and one value tile where its precision takes that,
    ``tensor_split_stages``, and one fits), and the forward without its
    registers capped (``tensor_min_blocks``) where they are."""
    from npattn import fast_cupy

    chosen = fast_cupy.tensor_tile
    fit = fast_cupy._tiles_fit
    split = precision in fast_cupy.TENSOR_SPLIT_STAGES and not fit(spec, precision, tile, False)
    split = split and fit(spec, precision, tile, False, stages=1)
    fits = {False: fit(spec, precision, tile, False) or split, True: fit(spec, precision, tile, True)}
    if not any(fits.values()):
        return

    def rule(spec, precision, backward=False):  # this size where it fits
        return tile if fits[backward] else chosen(spec, precision, backward)

    with (
        mock.patch.object(fast_cupy, "tensor_tile", rule),
        mock.patch.object(fast_cupy, "tensor_split_stages", lambda spec, precision: split),
        _fresh_lookups(fast_cupy),
    ):
        best = _best_kernel_ms(timed, problem, True, repeats)
        uncapped = None
        if fits[False] and fast_cupy.tensor_min_blocks(spec, precision):
            with (
                mock.patch.object(fast_cupy, "tensor_min_blocks", lambda spec, precision: 0),
                _fresh_lookups(fast_cupy),
            ):
                uncapped = _best_kernel_ms(timed, problem, False, repeats)["npattn_forward_tc"]
    cells = [
        f"{best[kernel]:16.3f}{'*' if chosen(spec, precision, backward) == tile else ' '}"
        if fits[backward]
        else f"{'-':>17}"
        for kernel, backward in TILED_KERNELS
    ]
    cells.append(f"{'-':>17}" if uncapped is None else f"{uncapped:16.3f} ")
    print(f"{label:<24} {tile:5d} " + " ".join(cells), flush=True)


@contextlib.contextmanager
def _fresh_lookups(fast_cupy):
    """``fast_cupy``'s tensor-core modules and launch plans looked up anew
    inside, and the ones outside kept: they are kept by what picks their
    definitions and launches (precision, dims, warps; the spec), not by
    what ``--tiles`` patches the rules of (``TC_KEYS``, ``TC_MIN_BLOCKS``,
    the key ranges)."""
    with (
        mock.patch.dict(fast_cupy._TENSOR_MODULES, clear=True),
        mock.patch.object(fast_cupy, "RECURRING_SPECS", SpecMemo()),
    ):
        yield


#: Counts of each backward kernel's A operands ``--kept`` keeps in shared memory.
KEPT_SWEEP = (0, 1, 2)

#: The backward kernels ``--kept`` times.
KEPT_KERNELS = ("npattn_backward_dq_tc", "npattn_backward_dkdv_tc")


def _kept_rows():
    """``(label, problem arguments)`` of ``--kept``."""
    for dtype, H, lengths in (
        ("float16", 64, (4096, 16384)),
        ("float16", 128, (4096,)),
        ("float32", 64, (4096,)),
        ("float32", 128, (4096,)),
        ("float64", 64, (4096,)),
    ):
        for T in lengths:
            for causal in (False, True):
                yield f"{dtype} H={H} T=S={T} {'causal' if causal else 'full'}", (dtype, 1, 8, 8, T, T, H, causal)


def kept(cp, repeats: int) -> int:
    """Print the backward's kernels' device ms by the operands they keep in
    shared memory (see the module's docstring)."""
    from npattn import fast_cupy

    name = _device_name(cp)
    print(
        f"npattn tensor-core backward on {name}: device ms by A operands kept in shared memory, "
        f"best of {repeats} calls each, the counts in turn; * fast_cupy's choice, (n) where fewer fit"
    )
    columns = [f"{kernel.removeprefix('npattn_backward_')} {n}" for kernel in KEPT_KERNELS for n in KEPT_SWEEP]
    print(f"{'problem':<30} " + " ".join(f"{column:>13}" for column in columns))
    timed = _TimedLaunches(cp, fast_cupy._CUPY_RUNTIME)
    with mock.patch.object(fast_cupy, "_CUPY_RUNTIME", timed):
        for label, problem, spec, precision in _tensor_problems(cp, _kept_rows(), 30):
            _kept_row(timed, problem, spec, precision, label, repeats)
    return 0


def _kept_row(timed: _TimedLaunches, problem: _Problem, spec, precision: str, label: str, repeats: int) -> None:
    """One row of ``--kept``: each count's modules and plans looked up apart
    (compiled in a first call each), then ``repeats`` calls of each count in
    turn."""
    from npattn import fast_cupy

    shared = timed.shared_memory(problem.arrays[0])
    chosen = fast_cupy.tensor_kept_operands(spec, precision, shared)
    lookups = {n: ({}, SpecMemo()) for n in KEPT_SWEEP}  # each count's modules and plans

    @contextlib.contextmanager
    def keeping(n: int):
        modules, plans = lookups[n]
        with (
            mock.patch.dict(fast_cupy.TENSOR_KEPT_OPERANDS, {precision: ((n, n), (n, n))}),
            mock.patch.object(fast_cupy, "_TENSOR_MODULES", modules),
            mock.patch.object(fast_cupy, "RECURRING_SPECS", plans),
        ):
            yield fast_cupy.tensor_kept_operands(spec, precision, shared)

    best: dict[int, dict[str, float]] = {n: {} for n in KEPT_SWEEP}
    fitted = {}
    for n in KEPT_SWEEP:
        with keeping(n) as fitted[n]:
            problem.npattn(True)  # compiles
    timed.kernel_ms()
    for round_ in range(repeats):
        for n in KEPT_SWEEP if round_ % 2 == 0 else reversed(KEPT_SWEEP):
            with keeping(n):
                problem.npattn(True)
            for kernel, ms in timed.kernel_ms().items():
                best[n][kernel] = min(best[n].get(kernel, float("inf")), ms)
    cells = []
    for index, kernel in enumerate(KEPT_KERNELS):
        for n in KEPT_SWEEP:
            cell = f"{best[n][kernel]:.3f}" + ("*" if n == chosen[index] else "")
            cells.append(f"{cell + (f'({fitted[n][index]})' if fitted[n][index] != n else ''):>13}")
    print(f"{label:<30} " + " ".join(cells), flush=True)


def _split_rows(cp, timed: _TimedLaunches, repeats: int) -> None:
    """The decode step's forward at each of SPLIT_SWEEP blocks per multiprocessor."""
    from npattn import fast_cupy

    dtype, B, N, K, _, S, H, _ = DECODE
    problem = _Problem(cp, None, *DECODE)
    print(f"decode T=1 S={S} N={N} K={K} H={H}: blocks per SM, key ranges, forward ms, merge ms, GB/s of k and v")
    for per_sm in SPLIT_SWEEP:
        with mock.patch.object(fast_cupy, "SPLIT_BLOCKS_PER_SM", per_sm), _fresh_lookups(fast_cupy):
            best = _best_kernel_ms(timed, problem, False, repeats)
        splits = timed.grids["npattn_forward_tc"][2] // B  # the grid's z: batch elements times key ranges
        total = sum(best.values())
        rate = 2 * B * K * S * H * np.dtype(dtype).itemsize / total / 1e6
        forward, merge = best.get("npattn_forward_tc", float("nan")), best.get("npattn_merge_splits", 0.0)
        print(f"  {per_sm:3d} {splits:5d} {forward:9.3f} {merge:9.3f} {rate:9.1f}", flush=True)
    _free_pools(cp, None)


if __name__ == "__main__":
    sys.exit(main())
