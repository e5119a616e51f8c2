"""The calls Nsight Compute profiles in a GPU session (``gpu_session.py --profile``).

    ncu --profile-from-start off --clock-control none --set full --kernel-name regex:npattn_ \\
        -f -o /tmp/npattn-profile python benchmarks/profile_gpu.py
    ncu --import /tmp/npattn-profile.ncu-rep --page raw --csv   # every metric, a row a kernel
    ncu --import /tmp/npattn-profile.ncu-rep --page details     # each section's figures and advice

One forward+backward call of each workload of :data:`WORKLOADS` (B=1, N=8,
H=64, T=S=4096, full; ``impl="chunked"``, the fused kernels): float64 with
its dQ kernel, float64 with the kernels not yet shipped (dQ summed by the
dK/dV kernel, ``npattn.fast_cupy.TENSOR_FUSED_DQ``, and the forward keeping
Q in shared memory at 3 blocks a multiprocessor, ``TENSOR_KEPT_Q``),
float16, and float16 on sm_90a's wgmma (``TENSOR_WGMMA``, not yet
shipped); then a float16 decode step's forward (:data:`DECODE`: T=1
against S=32768, N=32 on 8 kv heads, H=128, ``bench_gpu.py --targets'``
step: the forward over key ranges and their merge). Each runs once to
compile its kernels and warm up, then once
between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that a profiler
started with ``--profile-from-start off`` sees that call's kernels alone;
the script prints the workloads in the order their calls were profiled
(the report lists the kernels in launch order: forward, ``D``, dQ where it
runs, dK/dV; the decode step's forward and merge).

What it is for: ``count_sass.py``'s static bounds (a warp's tile in
multiprocessor cycles of issue, of shared memory and, in float64, of the
tensor cores) put every tensor-core kernel's loop at about half the time
the H100 measured (docs/gpu_performance.rst); the profile's pipe
utilizations, shared-memory wavefronts and bank conflicts, issue activity
and warp stall reasons say where the rest goes. Without CuPy or a CUDA
device it prints ``skipped: ...`` and exits with 0.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
from collections.abc import Callable
from unittest import mock

import numpy as np

try:
    import npattn
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import npattn
from npattn import fast_cupy
from npattn.options import SpecMemo

#: ``(label, dtype, the kernels not yet shipped)`` of each profiled call,
#: at B=1, N=8, H=64, T=S=4096, full.
WORKLOADS = (
    ("float64 T=S=4096 full fwd+bwd, dQ kernel", "float64", False),
    ("float64 T=S=4096 full fwd+bwd, dQ fused, Q kept", "float64", True),
    ("float16 T=S=4096 full fwd+bwd", "float16", False),
    ("float16 T=S=4096 full fwd+bwd, wgmma", "float16", True),
)

#: The workloads' shape: (B, N, T, H), T = S.
SHAPE = (1, 8, 4096, 64)

#: The decode step's (N, K, S, H), B = T = 1: ``bench_gpu.py --targets'``,
#: whose forward reads ``k`` and ``v`` at 69% of an H100's bandwidth (59
#: µs by Nsight Compute, the code of 76f0ecd).
DECODE = (32, 8, 32768, 128)
DECODE_LABEL = "float16 decode T=1 S=32768 N=32 K=8 H=128 forward"


def _unshipped(on: bool) -> contextlib.ExitStack:
    """For the duration: ``fast_cupy.TENSOR_FUSED_DQ`` holding float64,
    ``fast_cupy.TENSOR_KEPT_Q`` float64 at 3 blocks and
    ``fast_cupy.TENSOR_WGMMA`` float16's kernels (``on``), or nothing, and
    the launch plans made anew for each call (a recurring spec's plans,
    kept by spec, would keep the other setting's)."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"} if on else ())))
    stack.enter_context(mock.patch.object(fast_cupy, "TENSOR_KEPT_Q", {"f64": 3} if on else {}))
    stack.enter_context(mock.patch.object(fast_cupy, "TENSOR_WGMMA", {"f16": (True, True)} if on else {}))
    stack.enter_context(mock.patch.object(fast_cupy, "RECURRING_SPECS", SpecMemo()))
    return stack


def _forward_backward(q, k, v, dout) -> None:
    """One call on the fused kernels (``impl="chunked"`` on CuPy), forward and backward."""
    _, res = npattn.attention_forward(q, k, v, impl="chunked")
    assert res.kernel == "cupy", res.kernel  # the fused kernels, not the generic path
    npattn.attention_backward(dout, res)


def profile(
    cp, start: Callable[[], None], stop: Callable[[], None], shape: tuple[int, ...] = SHAPE, decode=DECODE
) -> int:
    """Run each workload's call once, then once more between ``start()`` and
    ``stop()``, the device synchronized around it; print each label as its
    call is profiled. ``shape`` and ``decode``: :data:`SHAPE`'s and
    :data:`DECODE`'s (smaller in the tests)."""
    rng = np.random.default_rng(0)
    host = [rng.standard_normal(shape, dtype=np.float32) for _ in range(4)]  # q, k, v, dout
    for label, dtype, unshipped in WORKLOADS:
        arrays = [cp.asarray(a).astype(getattr(cp, dtype)) for a in host]
        with _unshipped(unshipped):
            _profiled(cp, start, stop, functools.partial(_forward_backward, *arrays))
        print(f"profiled: {label}", flush=True)
    N, K, S, H = decode
    q, k, v = (
        cp.asarray(rng.standard_normal(s, dtype=np.float32)).astype(cp.float16)
        for s in ((1, N, 1, H), (1, K, S, H), (1, K, S, H))
    )
    _profiled(cp, start, stop, functools.partial(_decode_step, q, k, v))
    print(f"profiled: {DECODE_LABEL}", flush=True)
    return 0


def _profiled(cp, start: Callable[[], None], stop: Callable[[], None], call: Callable[[], None]) -> None:
    """``call()`` once to compile its kernels, then once between ``start()`` and ``stop()``."""
    call()
    cp.cuda.runtime.deviceSynchronize()
    start()
    call()
    cp.cuda.runtime.deviceSynchronize()
    stop()


def _decode_step(q, k, v) -> None:
    """A decode step's forward on the fused kernels."""
    _, res = npattn.attention_forward(q, k, v, impl="chunked")
    assert res.kernel == "cupy", res.kernel


def main() -> int:
    try:
        cp = importlib.import_module("cupy")
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device is visible")
    except Exception as error:  # ImportError, CUDARuntimeError, ...
        print(f"skipped: CuPy with a CUDA device is not available ({type(error).__name__}: {error})")
        return 0
    return profile(cp, cp.cuda.runtime.profilerStart, cp.cuda.runtime.profilerStop)


if __name__ == "__main__":
    sys.exit(main())
