"""One attention step, unchanged, on NumPy (CPU) and CuPy (GPU).

    python examples/gpu_swap.py            # B=4, N=8, K=2 (GQA), T=S=512, H=64, float32
    python examples/gpu_swap.py --quick    # tiny shapes (used by the tests)

``step`` below never names a library: npattn reads the array namespace from
its inputs, so swapping NumPy arrays for CuPy arrays moves the whole forward
and backward to the GPU. Without CuPy or a CUDA device the script says so and
runs NumPy alone (exit status 0). It also runs on array-api-strict, the strict
reference namespace, when that is installed: proof that nothing NumPy-specific
is needed. When several backends run, their results are compared.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import numpy as np

import npattn
from npattn.__main__ import max_difference


def step(q, k, v, dout, kv_lengths):
    """Forward and backward of causal GQA attention with padded keys; any namespace."""
    out, res = npattn.attention_forward(q, k, v, causal=True, kv_lengths=kv_lengths)
    grads = npattn.attention_backward(dout, res)
    return {"out": out, "lse": res.lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv}


def _cupy():
    """``(cupy, None)`` when CuPy sees a CUDA device, else ``(None, reason)``."""
    try:
        cp = importlib.import_module("cupy")
        count = cp.cuda.runtime.getDeviceCount()
        if count < 1:
            raise RuntimeError("no CUDA device is visible")
    except Exception as err:  # ImportError, CUDARuntimeError, ...
        return None, f"{type(err).__name__}: {err}"
    return cp, None


def _backends():
    """``{name: (to_device, to_host, sync)}`` for every backend present, and why CuPy is missing."""
    found = {"numpy": (np.asarray, np.asarray, lambda: None)}
    cp, why_not = _cupy()
    if cp is not None:
        found["cupy"] = (cp.asarray, cp.asnumpy, cp.cuda.runtime.deviceSynchronize)
    try:
        xps = importlib.import_module("array_api_strict")
        found["array-api-strict"] = (xps.asarray, np.asarray, lambda: None)
    except ImportError:
        pass
    return found, why_not


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a fast check")
    args = parser.parse_args(argv)
    B, N, K, T, H = (2, 4, 2, 16, 8) if args.quick else (4, 8, 2, 512, 64)

    rng = np.random.default_rng(0)
    host = {
        "q": rng.standard_normal((B, N, T, H), dtype=np.float32),  # (B, N, T, H)
        "k": rng.standard_normal((B, K, T, H), dtype=np.float32),  # (B, K, S, H)
        "v": rng.standard_normal((B, K, T, H), dtype=np.float32),  # (B, K, S, H)
        "dout": rng.standard_normal((B, N, T, H), dtype=np.float32),  # (B, N, T, H)
        "kv_lengths": np.array([T - i * (T // (2 * B)) for i in range(B)]),  # (B,)
    }
    backends, why_not = _backends()
    print(f"causal GQA attention, forward + backward: B={B}, N={N}, K={K}, T=S={T}, H={H}, float32")
    if "cupy" not in backends:
        print(
            f"CuPy with a CUDA GPU is not available here ({why_not}); running without it.\n"
            '  On a GPU machine: pip install "npattn[cuda12]" (or "npattn[cuda13]") and run again.'
        )

    results = {}
    print(f"  {'backend':<17} {'arrays returned':<17} {'fwd+bwd':>9}")
    for name, (to_device, to_host, sync) in backends.items():
        arrays = {key: to_device(a) for key, a in host.items()}
        step(**arrays)  # warm-up (CuPy compiles its kernels on first use)
        sync()
        start = time.perf_counter()
        got = step(**arrays)
        sync()
        ms = (time.perf_counter() - start) * 1e3
        results[name] = {key: np.asarray(to_host(a)) for key, a in got.items()}
        print(f"  {name:<17} {type(got['out']).__module__.split('.')[0]:<17} {ms:9.1f} ms")

    ok = True
    for name in [n for n in results if n != "numpy"]:
        worst = max(max_difference(ref, results[name][key]) for key, ref in results["numpy"].items())
        same = worst <= 1e-3  # a NaN or a mismatched -inf counts as infinite
        ok &= same
        print(f"max |{name} - numpy| over out, lse, dq, dk, dv: {worst:.2e} ({'agree' if same else 'DISAGREE'})")
    print("ran on:", ", ".join(results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
