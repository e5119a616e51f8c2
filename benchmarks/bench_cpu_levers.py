"""Which lever moves the CPU time: the chunked path with one lever changed at a time.

    python benchmarks/bench_cpu_levers.py            # B=1, N=8, H=64, T=S=4096, float32
    python benchmarks/bench_cpu_levers.py --quick    # T=S=512

Rows, each against the full NumPy fast path (the last row):

- the generic Array API chunked path (``NPATTN_FAST_NUMPY=0``), 128x128 tiles;
- the fast path with a pool of one thread (``NPATTN_NUM_THREADS=1``): items
  run one after another, and BLAS may then use every core inside each product;
- the fast path with BLAS threads left unlimited inside the pool's threads;
- the fast path with the generic path's 128x128 tiles;
- the fast path with causal masking (hidden tiles skipped);
- the same without cutting partly visible tiles into spans
  (:func:`npattn.fast_numpy.plan_tile`): each diagonal tile whole, masked;
- the fast path as shipped.

Times are the best of ``--repeats`` runs (the generic path runs once: it is
slow). The ratio column is time / the shipped fast path's time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import numpy as np
import threadpoolctl

import npattn
from npattn import fast_numpy, threads


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@contextlib.contextmanager
def _env(**values):
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _blas_unlimited():
    limit = threads.single_threaded_blas
    threads.single_threaded_blas = contextlib.nullcontext
    try:
        yield
    finally:
        threads.single_threaded_blas = limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=4096, help="T = S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="T=S=512, one repeat")
    args = parser.parse_args(argv)
    if args.length < 1 or args.repeats < 1:
        parser.error("--length and --repeats must be >= 1")
    if args.quick:
        args.length, args.repeats = 512, 1
    B, N, H, T = 1, 8, 64, args.length
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))

    def measure(repeats, **options):
        def fwd():
            return npattn.attention_forward(q, k, v, impl="chunked", **options)

        def fwd_bwd():
            _out, res = fwd()
            npattn.attention_backward(dout, res)

        return _best(fwd, repeats), _best(fwd_bwd, repeats)

    rows = []
    with _env(NPATTN_FAST_NUMPY="0"):
        rows.append(("generic Array API path, 128x128 tiles", measure(1)))
    with _env(NPATTN_NUM_THREADS="1"):
        rows.append(("fast path, 1 pool thread (BLAS threads free)", measure(args.repeats)))
    with _blas_unlimited():
        rows.append(("fast path, BLAS threads not limited", measure(args.repeats)))
    rows.append(("fast path, 128x128 tiles", measure(args.repeats, block_q=128, block_k=128)))
    rows.append(("fast path, causal (hidden tiles skipped)", measure(args.repeats, causal=True)))
    split = fast_numpy.SPLIT_BLOCK
    fast_numpy.SPLIT_BLOCK = max(T, 1)  # a partly visible tile is then one span
    try:
        rows.append(("fast path, causal, diagonal tiles not split", measure(args.repeats, causal=True)))
    finally:
        fast_numpy.SPLIT_BLOCK = split
    shipped = measure(args.repeats)
    rows.append(("fast path as shipped", shipped))

    print(
        f"float32, B={B}, N={N}, H={H}, T=S={T}; {fast_numpy.num_threads()} threads; "
        f"BLAS: {threadpoolctl.threadpool_info()[0].get('internal_api', '?')}"
    )
    print(f"{'configuration':<44} {'fwd ms':>8} {'x shipped':>9} {'f+b ms':>8} {'x shipped':>9}")
    for label, (t_fwd, t_all) in rows:
        print(f"{label:<44} {t_fwd * 1e3:8.1f} {t_fwd / shipped[0]:9.2f} {t_all * 1e3:8.1f} {t_all / shipped[1]:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
