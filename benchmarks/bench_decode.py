"""Decoding on the CPU: one query row against a long KV cache, GQA, npattn against torch.

    python benchmarks/bench_decode.py [--repeats 20] [--quick] [--no-torch]

T=1 query against S=8192 and S=512 keys, N=32 query heads on K=8 kv heads,
H=128, float32, forward only (the workload of issue 17's first two rows).
npattn runs ``impl="auto"`` (and reports the path it took) and torch 2.x's
``scaled_dot_product_attention(enable_gqa=True)`` with the same 2 threads;
the two alternate call by call in one process and each row prints the
median of ``--repeats`` calls, the ratio, and the load average of the other
processes before and after the row (rerun a row whose load was not ~0).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import npattn


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _interleaved(calls: dict, repeats: int) -> dict:
    """Median seconds of each call, the calls alternating, after one warm-up each."""
    times: dict = {name: [] for name in calls}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def _calls(torch, q, k, v) -> dict:
    """The row's calls: npattn's, and torch's SDPA with the same GQA heads."""
    calls = {"npattn": lambda: npattn.attention_forward(q, k, v)}
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        calls["torch"] = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="S=512 and 64, 3 repeats")
    parser.add_argument("--no-torch", action="store_true", help="npattn only")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    torch = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(2)
        except ImportError:
            print("torch is not installed: npattn only")
    lengths, repeats = ((512, 64), 3) if args.quick else ((8192, 512), args.repeats)
    print(f"decode, T=1, N=32 on K=8 kv heads, H=128, float32, {_cpu_model()}, {os.cpu_count()} cores")
    print(f"{'S':>6} {'path':>8} {'npattn ms':>10} {'torch ms':>9} {'ratio':>6}  load before/after")
    rng = np.random.default_rng(0)
    for S in lengths:
        q = rng.standard_normal((1, 32, 1, 128)).astype(np.float32)  # (B, N, T, H)
        k = rng.standard_normal((1, 8, S, 128)).astype(np.float32)  # (B, K, S, H)
        v = rng.standard_normal((1, 8, S, 128)).astype(np.float32)  # (B, K, S, Hv)
        calls = _calls(torch, q, k, v)
        load_before = os.getloadavg()[0]
        ms = {name: 1e3 * t for name, t in _interleaved(calls, repeats).items()}
        load_after = os.getloadavg()[0]
        path = npattn.attention_forward(q, k, v)[1].spec.impl
        torch_ms = f"{ms['torch']:>9.2f}" if "torch" in ms else f"{'-':>9}"
        ratio = f"{ms['npattn'] / ms['torch']:>5.2f}x" if "torch" in ms else f"{'-':>6}"
        print(f"{S:>6} {path:>8} {ms['npattn']:>10.2f} {torch_ms} {ratio}  {load_before:.2f}/{load_after:.2f}")
    raise SystemExit(0)


if __name__ == "__main__":
    main()
