"""CPU time of npattn's derivative modes relative to one forward+backward of the same shape.

For float32 B=1, N=8, H=64, T=S=4096 (``--length``), full and causal, on
the chunked path (the NumPy fast path's machinery), measured side by side and
interleaved in one process (``_best_side_by_side``):

- ``fwd+bwd``: :func:`npattn.attention_forward` then :func:`npattn.attention_backward`;
- ``jvp``: :func:`npattn.attention_jvp` along random tangents of q, k, v
  (issue 16's target: at most 1.2x fwd+bwd);
- ``fwd-over-rev``: :func:`npattn.attention_backward_jvp` on saved residuals
  (a Hessian-vector product with ``dout_dot``; target at most 2.5x fwd+bwd);
- ``double bwd`` (with ``--double``): :func:`npattn.attention_double_backward`
  on saved residuals (the generic chunked code on NumPy, whose float32
  ``exp`` of hidden ``-inf`` scores is slow; no target, for reference).

Then peak traced memory (tracemalloc) of each mode at T/2 and T, to show it
grows linearly in T (a T x S array per head would quadruple it).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

import npattn
from npattn.__main__ import traced_peak_mib
from npattn.fast_numpy import num_threads


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else ``platform``)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _best_side_by_side(fns: dict, repeats: int) -> dict:
    """Best time of each function, running them in turn ``repeats`` times."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(0.2)
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _modes(B: int, N: int, T: int, H: int, causal: bool, double: bool) -> dict:
    """The timed functions of one shape."""
    rng = np.random.default_rng(0)
    q, k, v, dout, q_dot, k_dot, v_dot, dout_dot = (
        rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(8)
    )
    options = {"impl": "chunked", "causal": causal}
    _, residuals = npattn.attention_forward(q, k, v, **options)
    tangents = (q_dot, k_dot, v_dot)
    fns = {
        "fwd+bwd": lambda: npattn.attention_backward(dout, npattn.attention_forward(q, k, v, **options)[1]),
        "jvp": lambda: npattn.attention_jvp((q, k, v), tangents, **options),
        "fwd-over-rev": lambda: npattn.attention_backward_jvp(dout, residuals, tangents, dout_dot=dout_dot),
    }
    if double:
        fns["double bwd"] = lambda: npattn.attention_double_backward(q_dot, k_dot, v_dot, residuals, dout)
    return fns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096, help="T = S")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="T=S=256, one repeat")
    parser.add_argument("--double", action="store_true", help="time the double backward too (generic code: slow)")
    args = parser.parse_args(argv)
    for name in ("heads", "head_dim", "length", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.length, args.repeats = 256, 1
    N, H, T = args.heads, args.head_dim, args.length
    print(f"npattn derivative modes, float32, B=1, N={N}, H={H}, T=S={T}; {num_threads()} threads; {cpu_model()}")
    header = f"{'shape':<8} {'mode':<14} {'ms':>9} {'÷ fwd+bwd':>10}"
    print(header)
    print("-" * len(header))
    for causal in (False, True):
        best = _best_side_by_side(_modes(1, N, T, H, causal, args.double), args.repeats)
        for name, seconds in best.items():
            print(
                f"{'causal' if causal else 'full':<8} {name:<14} {seconds * 1e3:9.1f} {seconds / best['fwd+bwd']:9.2f}x"
            )
    print()
    print("peak traced memory (MiB), causal: linear in T on the chunked path")
    half = max(T // 2, 1)
    print(f"{'mode':<14} {f'T={half}':>9} {f'T={T}':>9} {'ratio':>6}")
    small, large = (_modes(1, N, length, H, True, args.double) for length in (half, T))
    for name in small:
        peaks = [traced_peak_mib(fns[name]) for fns in (small, large)]
        print(f"{name:<14} {peaks[0]:9.1f} {peaks[1]:9.1f} {peaks[1] / peaks[0]:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
