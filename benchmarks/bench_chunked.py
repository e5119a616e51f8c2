"""Dense vs chunked attention on NumPy: time and peak memory.

Times :mod:`npattn.dense` against the generic Array API chunked path,
:mod:`npattn.chunked`, and against the NumPy fast path of the same
algorithm, :mod:`npattn.fast_numpy` (what ``impl="chunked"`` runs on NumPy).

For float32, B=1, N=8, H=64, T=S in {1024, 2048, 4096, 8192}, non-causal and
causal, prints one table with the best wall time of the forward and of
forward+backward for each path, and the tracemalloc peak of forward+backward
(every NumPy allocation is traced; inputs allocated before tracing starts are
not counted). The dense path is skipped where its estimated peak (about
``DENSE_LIVE_SCORE_TENSORS`` score tensors of N*T*S float32) would exceed the
memory budget (2/3 of the available memory unless ``--memory-gib`` is given),
and the row says so.

    python benchmarks/bench_chunked.py            # the full table (minutes)
    python benchmarks/bench_chunked.py --quick    # small sizes, a smoke run
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc

import numpy as np

try:
    import npattn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from npattn import fast_numpy
from npattn.chunked import chunked_backward, chunked_forward
from npattn.dense import dense_backward, dense_forward
from npattn.options import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, make_spec

#: Dense forward+backward keeps about this many (N, T, S) float32 tensors
#: alive at its peak (probabilities, dP, dS and a temporary); 4.0 was measured
#: at T=S=2048, rounded up for safety.
DENSE_LIVE_SCORE_TENSORS = 5


def _available_bytes():
    """MemAvailable from /proc/meminfo (Linux), else free physical pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * 2**30


def _best_seconds(fn, repeats):
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _peak_bytes(fn):
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _measure(q, k, v, dout, impl, causal, repeats):
    """(forward s, forward+backward s, peak bytes of forward+backward).

    Calls the paths' own functions, as ``npattn.attention_forward`` and
    ``attention_backward`` do (float32 needs no casts), so that "chunked" is
    always the generic Array API path of :mod:`npattn.chunked`, whatever
    backend-specific fast path the public API may dispatch NumPy inputs to;
    ``impl="fast"`` is that NumPy fast path.
    """
    kernels = {"chunked": (chunked_forward, chunked_backward), "fast": (fast_numpy.forward, fast_numpy.backward)}

    def forward():
        spec = make_spec(q, k, v, impl="dense" if impl == "dense" else "chunked", causal=causal)
        if impl == "dense":
            out, lse, probs = dense_forward(spec, q, k, v)
            return spec, out, lse, probs
        return (spec, *kernels[impl][0](spec, q, k, v))

    def forward_backward():
        if impl == "dense":
            spec, out, lse, probs = forward()
            return dense_backward(spec, q, k, v, probs, out, dout, None)
        spec, out, lse = forward()
        return kernels[impl][1](spec, q, k, v, out, lse, dout, None)

    return _best_seconds(forward, repeats), _best_seconds(forward_backward, repeats), _peak_bytes(forward_backward)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (T=S in {128, 256}), one repeat")
    parser.add_argument("--lengths", type=int, nargs="+", help="override the T=S values")
    parser.add_argument(
        "--repeats", type=int, help="best of this many runs (default 3; 2 for T=S >= 4096; 1 with --quick)"
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        help="skip dense when its estimated peak exceeds this (default: 2/3 of available memory)",
    )
    args = parser.parse_args(argv)
    if args.lengths is not None and min(args.lengths) < 1:
        parser.error(f"--lengths must all be >= 1, got {args.lengths}")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.memory_gib is not None and not args.memory_gib > 0:  # also rejects nan
        parser.error(f"--memory-gib must be a positive number of GiB, got {args.memory_gib}")
    B, N, H = 1, 8, 64
    lengths = args.lengths or ([128, 256] if args.quick else [1024, 2048, 4096, 8192])
    rng = np.random.default_rng(0)
    budget = args.memory_gib * 2**30 if args.memory_gib is not None else 2 / 3 * _available_bytes()

    print(
        f"npattn dense vs chunked, NumPy {np.__version__}, float32, B={B}, N={N}, H={H}, "
        f"blocks {DEFAULT_BLOCK_Q}x{DEFAULT_BLOCK_K}, "
        f"{os.cpu_count()} CPU cores; times are best-of-n wall seconds, memory is the tracemalloc peak of fwd+bwd"
    )
    warm = rng.standard_normal((1, 1, 8, 4), dtype=np.float32)
    for impl in ("dense", "chunked", "fast"):  # imports and first-call costs stay out of the table
        _measure(warm, warm, warm, warm, impl, True, 1)
    header = (
        f"{'T=S':>6} {'mask':>7} | {'dense fwd':>9} {'dense f+b':>9} {'dense MiB':>9} | "
        f"{'chunk fwd':>9} {'chunk f+b':>9} {'chunk MiB':>9} | {'fast fwd':>9} {'fast f+b':>9} "
        f"{'fast MiB':>9} | {'f+b ratio':>9} {'mem ratio':>9}"
    )
    print(header)
    print("-" * len(header))
    for T in lengths:
        q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))
        scores_bytes = B * N * T * T * 4
        repeats = args.repeats or (1 if args.quick else 2 if T >= 4096 else 3)
        for causal in (False, True):
            name = "causal" if causal else "full"
            c_fwd, c_all, c_mem = _measure(q, k, v, dout, "chunked", causal, repeats)
            chunk = f"{c_fwd:9.3f} {c_all:9.3f} {c_mem / 2**20:9.1f}"
            f_fwd, f_all, f_mem = _measure(q, k, v, dout, "fast", causal, repeats)
            chunk += f" | {f_fwd:9.3f} {f_all:9.3f} {f_mem / 2**20:9.1f}"
            estimate = DENSE_LIVE_SCORE_TENSORS * scores_bytes
            if estimate > budget:
                why = f"skip: ~{estimate / 2**30:.0f} GiB > {budget / 2**30:.0f} GiB budget"
                print(f"{T:>6} {name:>7} | {why:>29} | {chunk} | {'n/a':>9} {'n/a':>9}")
                continue
            d_fwd, d_all, d_mem = _measure(q, k, v, dout, "dense", causal, repeats)
            print(
                f"{T:>6} {name:>7} | {d_fwd:9.3f} {d_all:9.3f} {d_mem / 2**20:9.1f} | {chunk} | "
                f"{c_all / d_all:9.2f} {c_mem / d_mem:9.4f}",
                flush=True,
            )
    print(
        "f+b ratio = chunked (generic) / dense forward+backward time; mem ratio = chunked / dense peak; "
        f"the fast path uses {fast_numpy.FAST_BLOCKS[0]}x{fast_numpy.FAST_BLOCKS[1]} tiles and "
        f"{fast_numpy.num_threads()} threads"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
