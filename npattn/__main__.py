"""``python -m npattn``: the demo. Runs attention forward and backward on a
realistic shape, compares the dense and chunked paths, and gradient-checks
both in float64.

    python -m npattn                  # NumPy on the CPU
    python -m npattn --backend cupy   # CuPy on a GPU (fails clearly without one)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import tracemalloc

import numpy as np

from . import attention_backward, attention_forward, check_gradients
from .options import IMPLS, check_int


def _backend(name: str):
    """Return ``(module, to_host, sync)`` for the requested backend, or exit."""
    if name == "numpy":
        return np, np.asarray, lambda: None
    try:
        cp = importlib.import_module("cupy")
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device is visible")
    except Exception as err:  # ImportError, CUDARuntimeError, ...
        sys.exit(
            f"npattn: --backend cupy needs CuPy and a CUDA GPU ({type(err).__name__}: {err}); "
            "install npattn[cuda12] or npattn[cuda13] on a GPU machine, or use --backend numpy"
        )
    return cp, cp.asnumpy, cp.cuda.runtime.deviceSynchronize


#: Largest |dense - chunked| accepted in float32 (the demo's T=S=512 gives ~1e-5).
AGREEMENT_TOLERANCE = 1e-3


def max_difference(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b|`` over the entries where ``a`` is finite; infinite when the
    two disagree on which entries are -inf (fully masked lse) or any NaN shows."""
    if not np.array_equal(np.isneginf(a), np.isneginf(b)):
        return float("inf")
    finite = np.isfinite(a)
    difference = np.abs(a[finite] - b[finite])
    if np.isnan(a).any() or np.isnan(difference).any():
        return float("inf")
    return float(np.max(difference, initial=0.0))


def _timed(fn, sync, repeats=3):
    """Best wall time in ms over ``repeats`` runs, and the last result."""
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        result = fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, result


def traced_peak_mib(fn) -> float:
    """Peak host memory, in MiB, that tracemalloc sees allocated while ``fn()`` runs."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


#: Pool behind :func:`cupy_peak_bytes`, made on first use and kept for the
#: process (an allocation must not outlive the pool it came from).
_PEAK_POOL = None


def cupy_peak_bytes(cp, fn) -> int | None:
    """Peak CuPy device memory, in bytes, allocated while ``fn()`` runs beyond
    what was in use when it started; None where this CuPy cannot say.

    ``fn`` runs with a dedicated ``cupy.cuda.MemoryPool`` as the allocator
    (``cupy.cuda.using_allocator``), whose ``used_bytes()`` is read after every
    allocation: bytes in use only grow at an allocation, so the largest value
    read is the peak. Like tracemalloc for NumPy, arrays made before ``fn``
    are not counted; the pool's cached blocks are given back afterwards.
    """
    global _PEAK_POOL
    try:
        if _PEAK_POOL is None:
            _PEAK_POOL = cp.cuda.MemoryPool()
        pool, using_allocator = _PEAK_POOL, cp.cuda.using_allocator
    except AttributeError:
        return None
    cp.cuda.runtime.deviceSynchronize()
    start = peak = pool.used_bytes()

    def malloc(size):
        nonlocal peak
        memory = pool.malloc(size)
        peak = max(peak, pool.used_bytes())
        return memory

    with using_allocator(malloc):
        fn()
        cp.cuda.runtime.deviceSynchronize()
    pool.free_all_blocks()
    return peak - start


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1 (0 or negatives failed deep inside the demo).

    The library's :func:`~npattn.options.check_int` decides; this adapter only
    turns its error into argparse's, which names the flag itself."""
    try:
        value: int | str = int(text)
    except ValueError:
        value = text
    try:
        return check_int("value", value, minimum=1)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}") from None


#: ``--help``'s description, written for a terminal (the module docstring is reStructuredText).
DESCRIPTION = """\
The npattn demo: runs masked attention forward and backward on a realistic
shape (float32, causal, grouped-query heads, padded keys), times the dense
and the chunked path and compares their outputs and gradients, then
gradient-checks both paths in float64 against central differences.

Exit status 0 when the paths agree and every gradient check passes, else 1."""

EXAMPLES = """\
examples (the npattn command runs the same demo):
  python -m npattn                      NumPy on the CPU
  python -m npattn --backend cupy       CuPy on a GPU (fails clearly without one)
  python -m npattn --length 2048 --batch 1"""


def _parser() -> argparse.ArgumentParser:
    """The command line: backend and problem sizes."""
    parser = argparse.ArgumentParser(
        prog="npattn",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        choices=("numpy", "cupy"),
        default="numpy",
        help="array library to run on: numpy on the CPU, cupy on a CUDA GPU (default: %(default)s)",
    )
    sizes = (
        ("--batch", 2, "batch size B"),
        ("--heads", 8, "query heads N"),
        ("--kv-heads", 2, "key/value heads K, a divisor of --heads; fewer than N is grouped-query attention"),
        ("--length", 512, "sequence length T = S"),
        ("--head-dim", 64, "head dimension H"),
    )
    for flag, default, meaning in sizes:
        parser.add_argument(flag, type=_positive_int, default=default, help=f"{meaning} (default: %(default)s)")
    return parser


def _demo_inputs(xb, rng, B: int, N: int, K: int, T: int, H: int) -> tuple[list, dict]:
    """``[q, k, v, dout]`` in float32 on the backend, and the attention options (causal, padded keys)."""
    arrays = [
        xb.asarray(rng.standard_normal(s, dtype=np.float32))
        for s in ((B, N, T, H), (B, K, T, H), (B, K, T, H), (B, N, T, H))
    ]  # q (B, N, T, H), k and v (B, K, T, H), dout (B, N, T, H)
    kv_lengths = xb.asarray(np.array([T, T * 3 // 4] * (B // 2) + [T] * (B % 2)))  # (B,): every other one padded
    return arrays, dict(causal=True, kv_lengths=kv_lengths)


def _time_paths(backend: str, xb, sync, q, k, v, dout, options: dict) -> dict:
    """Time forward and forward+backward on each path, print a table row per
    path with its peak memory; returns ``{impl: (out, residuals, grads)}``."""
    print(f"{'impl':>8} {'forward ms':>11} {'fwd+bwd ms':>11} {'peak MiB':>9}")
    results = {}
    for impl in [i for i in IMPLS if i != "auto"]:

        def fwd(impl=impl):
            return attention_forward(q, k, v, impl=impl, **options)

        def fwd_bwd(fwd=fwd):
            out, res = fwd()
            return out, res, attention_backward(dout, res)

        t_fwd, _ = _timed(fwd, sync)
        t_all, results[impl] = _timed(fwd_bwd, sync)
        if backend == "numpy":
            peak = f"{traced_peak_mib(fwd_bwd):9.1f}"
        else:  # tracemalloc sees host memory only: ask CuPy's allocator instead
            peak_bytes = cupy_peak_bytes(xb, fwd_bwd)
            peak = f"{'n/a':>9}" if peak_bytes is None else f"{peak_bytes / 2**20:9.1f}"
        print(f"{impl:>8} {t_fwd:11.1f} {t_all:11.1f} {peak}")
    return results


def _paths_agree(results: dict, to_host) -> bool:
    """Print the largest dense/chunked difference over out, lse and the gradients; whether it is within tolerance."""
    (out_d, res_d, g_d), (out_c, res_c, g_c) = results["dense"], results["chunked"]
    pairs = [
        ("out", out_d, out_c),
        ("lse", res_d.lse, res_c.lse),
        ("dq", g_d.dq, g_c.dq),
        ("dk", g_d.dk, g_c.dk),
        ("dv", g_d.dv, g_c.dv),
    ]
    worst = max(max_difference(to_host(a), to_host(b)) for _, a, b in pairs)
    agree = worst <= AGREEMENT_TOLERANCE
    print(
        f"max |dense - chunked| over out, lse, dq, dk, dv (float32): {worst:.2e} "
        f"({'agree' if agree else 'DISAGREE'}: tolerance {AGREEMENT_TOLERANCE:g})"
    )
    return agree


def _gradient_checks_pass(xb, rng) -> bool:
    """Gradient-check both paths in float64 on a small problem (every input,
    bias and dropout included); print each report, return whether all pass."""
    small = [xb.asarray(rng.standard_normal(s)) for s in ((2, 4, 6, 3), (2, 2, 6, 3), (2, 2, 6, 3))]
    bias = xb.asarray(rng.standard_normal((4, 6, 6)))
    ok = True
    for impl in ("dense", "chunked"):

        def forward(q, k, v, bias, impl=impl):
            out, res = attention_forward(
                q, k, v, bias=bias, causal=True, dropout_p=0.25, seed=7, impl=impl, block_q=4, block_k=4
            )
            return (out, res.lse), res

        def backward(cotangents, res):
            dout, dlse = cotangents
            g = attention_backward(dout, res, dlse=dlse)
            return g.dq, g.dk, g.dv, g.dbias

        report = check_gradients(
            forward, backward, small + [bias], names=["q", "k", "v", "bias"], jacobian=False, raise_on_failure=False
        )
        ok &= report.ok
        print(f"[{impl}] {report}")
    return ok


def main(argv: list[str] | None = None) -> int:
    """Run the demo with the command line ``argv``; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    xb, to_host, sync = _backend(args.backend)
    B, N, K, T, H = args.batch, args.heads, args.kv_heads, args.length, args.head_dim
    rng = np.random.default_rng(0)
    (q, k, v, dout), options = _demo_inputs(xb, rng, B, N, K, T, H)
    print(
        f"npattn demo on {args.backend}: float32, B={B}, N={N} query heads, K={K} kv heads (GQA), "
        f"T=S={T}, H={H}, causal, padded keys"
    )
    results = _time_paths(args.backend, xb, sync, q, k, v, dout, options)
    agree = _paths_agree(results, to_host)
    ok = _gradient_checks_pass(xb, rng) and agree
    print("demo finished:", "paths agree and all gradient checks passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
