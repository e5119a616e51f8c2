"""CPU speed of npattn's chunked path against PyTorch's C++ kernels, side by side.

    python benchmarks/bench_cpu.py            # the issue's shape: B=1, N=8, H=64, T=S=4096, float32
    python benchmarks/bench_cpu.py --quick    # a small shape, seconds

Prints one table: for each shape and mask (non-causal, causal), the forward
and forward+backward times of npattn (``impl="chunked"``, which on NumPy is
the fast path of :mod:`npattn.fast_numpy`) and of
``torch.nn.functional.scaled_dot_product_attention`` (when torch is
installed, limited to the same number of threads), their ratio, the attained
GFLOP/s and its share of this machine's large-SGEMM GFLOP/s measured in the
same run, and npattn's peak traced memory.

FLOPs are counted as the issue fixes them: forward ``4 B N T S H`` (halved
for causal, whose hidden half is skipped), backward 2.5x the forward.
Times are the best of ``--repeats`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc

import numpy as np

import npattn
from npattn.fast_numpy import num_threads


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def sgemm_gflops(n: int = 4096, repeats: int = 3) -> float:
    """GFLOP/s of one large float32 matrix product with all BLAS threads."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / _best(lambda: a @ a, repeats) / 1e9


def _peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096, help="T = S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="T=S=512, one repeat")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch columns")
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "head_dim", "length", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.length, args.repeats = 512, 1

    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("torch is not installed: torch columns are skipped (pip install torch)")
    threads = num_threads()
    if torch is not None:
        torch.set_num_threads(threads)

    B, N, H, T = args.batch, args.heads, args.head_dim, args.length
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))
    sgemm = sgemm_gflops()
    print(f"npattn CPU benchmark: float32, B={B}, N={N}, H={H}, T=S={T}; {threads} threads; "
          f"large SGEMM {sgemm:.0f} GFLOP/s")
    header = (f"{'shape / mask':<26} {'pass':<8} {'impl':<8} {'npattn ms':>10} {'torch ms':>9} {'ratio':>6} "
              f"{'GFLOP/s':>8} {'% SGEMM':>8} {'peak MiB':>9}")
    print(header)
    print("-" * len(header))
    for causal in (False, True):
        def fwd():
            return npattn.attention_forward(q, k, v, causal=causal, impl="chunked")

        def fwd_bwd():
            out, res = fwd()
            return npattn.attention_backward(dout, res)

        times = {"forward": _best(fwd, args.repeats), "fwd+bwd": _best(fwd_bwd, args.repeats)}
        peaks = {"forward": _peak_mib(fwd), "fwd+bwd": _peak_mib(fwd_bwd)}
        torch_times = {}
        if torch is not None:
            time.sleep(1.0)  # let npattn's BLAS threads go idle before torch's OpenMP threads start
            tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
            tdout = torch.from_numpy(dout)

            def t_fwd():
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            def t_fwd_bwd():
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                out.backward(tdout)

            torch_times = {"forward": _best(t_fwd, args.repeats), "fwd+bwd": _best(t_fwd_bwd, args.repeats)}
            time.sleep(1.0)  # and the other way round
        flops_fwd = 4 * B * N * T * T * H * (0.5 if causal else 1.0)
        for name, flops in (("forward", flops_fwd), ("fwd+bwd", 3.5 * flops_fwd)):
            ms = times[name] * 1e3
            gflops = flops / times[name] / 1e9
            t_ms = torch_times.get(name)
            torch_col = f"{t_ms * 1e3:9.1f}" if t_ms else f"{'-':>9}"
            ratio = f"{times[name] / t_ms:6.2f}" if t_ms else f"{'-':>6}"
            label = f"({B},{N},{T},{H}) {'causal' if causal else 'full'}"
            print(f"{label:<26} {name:<8} {'chunked':<8} {ms:10.1f} {torch_col} {ratio} "
                  f"{gflops:8.1f} {100 * gflops / sgemm:7.1f}% {peaks[name]:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
