"""MPI worker for tests/test_distributed.py: run under ``mpiexec -n P``.

    mpiexec -n P python tests/mpi_ring_worker.py cases  RESULT.json [CASE ...]
    mpiexec -n P python tests/mpi_ring_worker.py errors RESULT.json

``cases`` runs ring attention forward and backward for each case of
:data:`CASES` and compares every rank's shard with single-process attention
on the concatenated sequence (npattn's dense path, and the independent
float64 oracle tests/reference.py for out and lse), all computed on every
rank from the same seeded full arrays. ``errors`` runs each bad input of
:data:`ERROR_CASES` on every rank and records what each rank raised. Rank 0
writes the results as JSON. Nothing here imports mpi4py at module level, so
pytest's doctest collection can import this file without MPI.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

# name -> options. "lengths": per-P query/kv shard lengths ("equal", "unequal"
# or explicit {"q": {P: [...]}, "kv": {P: [...]}}); "shape": (B, N, K, H, Hv)
# with B=None for 3-D inputs; anything else goes to ring_attention_forward.
CASES = {
    "noncausal-equal": dict(lengths="equal"),
    "causal-equal": dict(lengths="equal", causal=True),
    "noncausal-unequal": dict(lengths="unequal"),
    "causal-unequal": dict(lengths="unequal", causal=True),
    "causal-unequal-gqa-chunked": dict(
        lengths="unequal", causal=True, shape=(2, 4, 2, 3, 2), impl="chunked", block_q=2, block_k=3
    ),
    "mqa-window": dict(lengths="unequal", shape=(1, 3, 1, 2, 3), window=(2, 1)),
    "window-left-only": dict(lengths="unequal", window=(3, None)),
    "causal-bottom-right-T>S": dict(
        lengths={"q": {2: [4, 3], 4: [3, 2, 1, 3]}, "kv": {2: [2, 3], 4: [1, 2, 2, 1]}},
        causal=True,
        align="bottom_right",
    ),
    "causal-top-left-T<S": dict(
        lengths={"q": {2: [2, 1], 4: [1, 2, 1, 1]}, "kv": {2: [3, 4], 4: [4, 1, 3, 2]}}, causal=True, align="top_left"
    ),
    "window-bottom-right-T<S": dict(
        lengths={"q": {2: [2, 2], 4: [1, 1, 2, 1]}, "kv": {2: [4, 3], 4: [2, 3, 3, 1]}},
        window=(1, 0),
        align="bottom_right",
    ),
    "permuted-starts-causal": dict(lengths="unequal", causal=True, permute=True),
    "3d-inputs-causal": dict(lengths="unequal", causal=True, shape=(None, 2, 2, 3, 3)),
    "dense-impl-causal-scale": dict(lengths="unequal", causal=True, impl="dense", scale=0.7),
    "no-dlse": dict(lengths="unequal", causal=True, no_dlse=True),
    "transport-host": dict(lengths="unequal", causal=True, transport="host"),
    "array-api-strict": dict(lengths="unequal", causal=True, backend="strict"),
    "array-api-strict-device1-host": dict(lengths="unequal", causal=True, backend="strict-device1", transport="host"),
    "numpy-readonly-inputs": dict(lengths="unequal", causal=True, backend="numpy-readonly"),
    "torch-cpu": dict(lengths="unequal", causal=True, backend="torch"),
    # CuPy (skipped without a CUDA device): auto transport stages device arrays through host buffers.
    "cupy-device": dict(lengths="unequal", causal=True, backend="cupy"),
    "cupy-gqa-chunked-float32": dict(
        lengths="unequal",
        causal=True,
        backend="cupy",
        dtype="float32",
        shape=(2, 4, 2, 3, 2),
        impl="chunked",
        block_q=2,
        block_k=3,
    ),
    "float32": dict(lengths="unequal", causal=True, dtype="float32"),
    "float16-computes-in-float32": dict(lengths="unequal", causal=True, dtype="float16"),
}

UNEQUAL = {1: [5], 2: [5, 2], 3: [3, 1, 4], 4: [3, 1, 5, 2]}


def shard_lengths(case: dict, P: int) -> tuple[list[int], list[int]]:
    spec = case.get("lengths", "equal")
    if spec == "equal":
        return [3] * P, [3] * P
    if spec == "unequal":
        return UNEQUAL[P], UNEQUAL[P]
    return spec["q"][P], spec["kv"][P]


def _backend(name: str):
    """(asarray, to_numpy) for a backend name."""
    if name == "numpy":
        return np.asarray, np.asarray
    if name == "numpy-readonly":  # catches any write into the caller's arrays

        def frozen(a):
            a = np.array(a)
            a.flags.writeable = False
            return a

        return frozen, np.asarray
    if name.startswith("strict"):
        import array_api_strict as xps

        device = xps.Device("device1") if name.endswith("device1") else None

        def to_numpy(x):
            return np.asarray(xps.asarray(x, device=xps.Device("CPU_DEVICE"), copy=True))

        return (lambda a: xps.asarray(a, device=device)), to_numpy
    if name == "torch":
        import torch

        return (lambda a: torch.asarray(np.array(a))), (lambda x: x.detach().numpy())
    if name == "cupy":
        import cupy

        return cupy.asarray, cupy.asnumpy
    raise ValueError(name)


def _starts(lengths: list[int], order: list[int]) -> list[int]:
    """Global start of each rank's shard when shards are laid out in ``order``."""
    starts, position = [0] * len(lengths), 0
    for r in order:
        starts[r] = position
        position += lengths[r]
    return starts


def run_case(comm, name: str) -> dict:
    """Ring vs single-process attention for one case; this rank's max errors."""
    from reference import reference_attention

    import npattn
    import npattn.distributed as dist

    case = CASES[name]
    P, r = comm.Get_size(), comm.Get_rank()
    if case.get("backend") == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return {"skipped": "torch is not installed"}
    if case.get("backend") == "cupy":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as err:  # ImportError, or CUDA's own errors without a driver
            return {"skipped": f"CuPy with a CUDA device is not available ({type(err).__name__})"}
    B, N, K, H, Hv = case.get("shape", (2, 2, 2, 3, 2))
    lead = () if B is None else (B,)
    q_lengths, kv_lengths = shard_lengths(case, P)
    order = list(reversed(range(P))) if case.get("permute") else list(range(P))
    q_starts, kv_starts = _starts(q_lengths, order), _starts(kv_lengths, order)
    T, S = sum(q_lengths), sum(kv_lengths)
    rng = np.random.default_rng(sum(map(ord, name)))
    dtype = np.dtype(case.get("dtype", "float64"))
    q = rng.standard_normal((*lead, N, T, H)).astype(dtype)
    k = rng.standard_normal((*lead, K, S, H)).astype(dtype)
    v = rng.standard_normal((*lead, K, S, Hv)).astype(dtype)
    options = {key: case[key] for key in ("causal", "window", "align", "scale") if key in case}

    # Single process, float64, on the concatenated sequence.
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref_out, ref_res = npattn.attention_forward(q64, k64, v64, impl="dense", **options)
    oracle_out, oracle_lse, _ = reference_attention(q64, k64, v64, **options)
    dout = rng.standard_normal(ref_out.shape)
    dlse = None if case.get("no_dlse") else rng.standard_normal(ref_res.lse.shape)
    ref = npattn.attention_backward(dout, ref_res, dlse=dlse)

    # This rank's shards, on the case's backend.
    asarray, to_numpy = _backend(case.get("backend", "numpy"))
    qs, ks = slice(q_starts[r], q_starts[r] + q_lengths[r]), slice(kv_starts[r], kv_starts[r] + kv_lengths[r])
    local = lambda a, rows: asarray(np.ascontiguousarray(a[..., rows, :]))  # noqa: E731
    extra = {key: case[key] for key in ("impl", "block_q", "block_k", "transport") if key in case}
    if case.get("permute"):
        extra.update(q_start=q_starts[r], kv_start=kv_starts[r])
    fwd_stats, bwd_stats = {}, {}
    out, res = dist.ring_attention_forward(
        local(q, qs), local(k, ks), local(v, ks), comm=comm, stats=fwd_stats, **options, **extra
    )
    dlse_local = None
    if dlse is not None:
        lse_dtype = np.float32 if dtype == np.float16 else dtype  # the compute dtype
        dlse_local = asarray(np.ascontiguousarray(dlse[..., qs]).astype(lse_dtype))
    grads = dist.ring_attention_backward(
        asarray(np.ascontiguousarray(dout[..., qs, :]).astype(dtype)), res, dlse=dlse_local, stats=bwd_stats
    )

    def err(got, want):
        got, want = to_numpy(got).astype(np.float64), np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            return float("inf")
        both_neginf = np.isneginf(got) & np.isneginf(want)
        if (np.isneginf(got) != np.isneginf(want)).any() or np.isnan(got).any():
            return float("inf")
        with np.errstate(invalid="ignore"):  # -inf - -inf where both are -inf
            diff = np.abs(np.where(both_neginf, 0.0, got - want))
        return float(diff.max(initial=0.0))

    lse = res.lse
    return {
        "out": err(out, ref_out[..., qs, :]),
        "lse": err(lse, ref_res.lse[..., qs]),
        "out_oracle": err(out, oracle_out[..., qs, :]),
        "lse_oracle": err(lse, oracle_lse[..., qs]),
        "dq": err(grads.dq, ref.dq[..., qs, :]),
        "dk": err(grads.dk, ref.dk[..., ks, :]),
        "dv": err(grads.dv, ref.dv[..., ks, :]),
        "out_dtype": str(out.dtype).rsplit(".", 1)[-1],
        "grad_dtype": str(grads.dq.dtype).rsplit(".", 1)[-1],
        "libraries": sorted({type(a).__module__.split(".")[0] for a in (out, lse, grads.dq, grads.dk, grads.dv)}),
        "fully_masked_rows": int(np.isneginf(ref_res.lse[..., qs]).sum()),
        "forward": fwd_stats,
        "backward": bwd_stats,
    }


def _call(fn) -> list | None:
    """``[exception type, message]`` of ``fn()``, or None if it returned."""
    try:
        fn()
    except Exception as err:
        return [type(err).__name__, str(err)]
    return None


def run_errors(comm) -> dict:
    """Every bad input on every rank; what each rank raised."""
    from mpi4py import MPI

    import npattn.distributed as dist

    r = comm.Get_rank()
    rng = np.random.default_rng(0)

    def qkv(T=3, H=4, dtype=np.float64, N=2):
        return tuple(rng.standard_normal((1, N, T, H)).astype(dtype) for _ in range(3))

    q, k, v = qkv()
    out, res = dist.ring_attention_forward(q, k, v, comm=comm, causal=True)
    other_H = qkv(H=4 if r == 0 else 2)
    other_dtype = qkv(dtype=np.float64 if r == 0 else np.float32)
    other_N = qkv(N=2 if r == 0 else 4)
    cases = {
        "head-dim-mismatch": lambda: dist.ring_attention_forward(*other_H, comm=comm),
        "dtype-mismatch": lambda: dist.ring_attention_forward(*other_dtype, comm=comm),
        "heads-mismatch": lambda: dist.ring_attention_forward(*other_N, comm=comm),
        "comm-none": lambda: dist.ring_attention_forward(q, k, v, comm=None),
        "comm-not-communicator": lambda: dist.ring_attention_forward(q, k, v, comm="COMM_WORLD"),
        "comm-null": lambda: dist.ring_attention_forward(q, k, v, comm=MPI.COMM_NULL),
        "starts-overlap": lambda: dist.ring_attention_forward(q, k, v, comm=comm, causal=True, q_start=0, kv_start=0),
        "starts-gap": lambda: dist.ring_attention_forward(
            q, k, v, comm=comm, causal=True, q_start=4 * r, kv_start=3 * r
        ),
        "starts-some-ranks": lambda: dist.ring_attention_forward(
            q, k, v, comm=comm, causal=True, q_start=0 if r == 0 else None
        ),
        "causal-T!=S-no-align": lambda: dist.ring_attention_forward(
            q, k[:, :, :2], v[:, :, :2], comm=comm, causal=True
        ),
        "causal-mismatch": lambda: dist.ring_attention_forward(q, k, v, comm=comm, causal=(r == 0)),
        "bad-input-one-rank": lambda: dist.ring_attention_forward(q if r == 0 else q[0, 0], k, v, comm=comm),
        "empty-kv-shard": lambda: dist.ring_attention_forward(
            q, k if r == 0 else k[:, :, :0], v if r == 0 else v[:, :, :0], comm=comm
        ),
        "bad-transport": lambda: dist.ring_attention_forward(q, k, v, comm=comm, transport="tcp"),
        "backward-bad-dout-one-rank": lambda: dist.ring_attention_backward(
            np.ones_like(out) if r == 1 else np.ones(out.shape[:-1]), res
        ),
        "backward-not-residuals": lambda: dist.ring_attention_backward(np.ones_like(out), object()),
        "still-works-afterwards": lambda: dist.ring_attention_backward(
            np.ones_like(dist.ring_attention_forward(q, k, v, comm=comm, causal=True)[0]), res
        ),
    }
    return {name: _call(fn) for name, fn in cases.items()}


def main(argv: list[str]) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mode, path, *names = argv
    if mode == "cases":
        results = {}
        for name in names or list(CASES):
            try:
                results[name] = run_case(comm, name)
            except Exception:
                results[name] = {"exception": traceback.format_exc()}
    elif mode == "errors":
        results = run_errors(comm)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    gathered = comm.gather(results, root=0)
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"size": comm.Get_size(), "ranks": gathered}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
