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

# Documents, as the lengths of consecutive documents per batch element, repeated
# until they fill the sequence (ids 0, 1, 2, ... in order). With "equal" shards
# (3 each) batch 0 has a document inside rank 0 (positions 1-2) and, for P >= 3,
# one across ranks 1 and 2 (3-6); batch 1's first document crosses 2|3. With
# "unequal" shards at P = 4 (3, 1, 5, 2) batch 1's first document spans ranks
# 0, 1 and 2, and batch 0's positions 7-8 lie inside rank 2.
DOCS = ((1, 2, 4), (5, 3))
DOCS_KV = ((2, 1, 3), (1, 4))  # key documents of the T != S cases (paired by id with DOCS)
# Global lengths (the same array on every rank), functions of the totals T, S.
Q_LENGTHS = lambda T, S: [T - 2, (T + 1) // 2]  # noqa: E731
KV_LENGTHS = lambda T, S: [S, max(S - 3, 0)]  # noqa: E731


# name -> options. "lengths": per-P query/kv shard lengths ("equal", "unequal"
# or explicit {"q": {P: [...]}, "kv": {P: [...]}}); "shape": (B, N, K, H, Hv)
# with B=None for 3-D inputs (a tuple B for several batch axes). Options built from recipes (global arrays for the
# single-process reference, this rank's share for the ring):
#   "q_lengths"/"kv_lengths": global lengths, a list per batch element (a
#       1-element list for 3-D inputs), {P: list}, or a function of (T, S);
#   "segments": a DOCS-like recipe for q and kv ids alike (self-attention), or a
#       pair (q recipe, kv recipe); each rank passes the slices at its rows;
#   "bias": {"layout": "keys" | "rows" | "shard", "lead": leading axes as a
#       string of "B", "N", "1" (e.g. "B1" broadcasts over heads), "query":
#       "full" (a = T_r, or T for "shard") or "one" (a = 1), "neginf": True to
#       put -inf entries in it};
#   "alibi": True (npattn.alibi_slopes(N)); "sinks": True (random, per head);
# anything else goes to ring_attention_forward as it is.
def _all_options(**overrides) -> dict:
    """Every option at once: causal, packed documents crossing shards, global
    lengths, dropout, softcap, ALiBi and sinks (a case adds its bias, seed,
    shape, backend...)."""
    defaults = dict(lengths="unequal", causal=True, segments=DOCS, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS)
    return defaults | dict(dropout_p=0.2, softcap=2.0, alibi=True, sinks=True) | overrides


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
    # wider than a shard pair's T + S (at P = 4, rank 3 against shard 0: 2 + 3 keys,
    # queries 9 positions on), yet hiding some keys
    "window-wider-than-a-pair": dict(lengths="unequal", window=(8, 0)),
    "causal-bottom-right-T>S": dict(
        lengths={"q": {1: [4], 2: [4, 3], 4: [3, 2, 1, 3]}, "kv": {1: [2], 2: [2, 3], 4: [1, 2, 2, 1]}},
        causal=True,
        align="bottom_right",
    ),
    "causal-top-left-T<S": dict(
        lengths={"q": {1: [2], 2: [2, 1], 4: [1, 2, 1, 1]}, "kv": {1: [3], 2: [3, 4], 4: [4, 1, 3, 2]}},
        causal=True,
        align="top_left",
    ),
    "window-bottom-right-T<S": dict(
        lengths={"q": {1: [2], 2: [2, 2], 4: [1, 1, 2, 1]}, "kv": {1: [4], 2: [4, 3], 4: [2, 3, 3, 1]}},
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
    # --- the options of attention_forward, one at a time ---
    "lengths": dict(lengths="unequal", q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS),
    "lengths-causal": dict(lengths="equal", causal=True, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS),
    "segments": dict(lengths="equal", segments=DOCS),
    "segments-causal-unequal": dict(lengths="unequal", causal=True, segments=DOCS),
    # Documents of 6, 3, 3 tokens on shards of 3: at P = 4 shards 0-1 hold
    # document 0, shard 2 document 1, shard 3 document 2 (the skip test).
    "segments-aligned": dict(lengths="equal", segments=((6, 3, 3),)),
    "dropout": dict(lengths="unequal", dropout_p=0.3, seed=1234),
    "dropout-causal-chunked": dict(
        lengths="unequal", causal=True, dropout_p=0.5, seed=2**40 + 7, impl="chunked", block_q=2, block_k=2
    ),
    "bias-keys": dict(lengths="unequal", bias=dict(layout="keys", lead="BN")),
    "bias-keys-broadcast": dict(lengths="unequal", bias=dict(layout="keys", lead="B1", query="one")),
    "bias-rows-neginf-permuted": dict(
        lengths="unequal", causal=True, permute=True, bias=dict(layout="rows", lead="BN", neginf=True)
    ),
    "bias-rows-broadcast": dict(lengths="unequal", bias=dict(layout="rows", lead="N", query="one")),
    "bias-shard": dict(lengths="unequal", causal=True, bias=dict(layout="shard", lead="BN")),
    # At P = 4 rank 1 holds one key: its (B, 1, 1, 1) bias alone could read as
    # "keys", but the other ranks' (B, 1, 1, S_r) fit only "shard".
    "bias-shard-broadcast": dict(lengths="unequal", bias=dict(layout="shard", lead="B1", query="one")),
    "softcap": dict(lengths="unequal", softcap=1.5),
    "alibi-causal": dict(lengths="unequal", causal=True, alibi=True),
    "alibi-bottom-right-T<S-lengths": dict(
        lengths={"q": {1: [3], 2: [2, 2], 4: [1, 1, 2, 1]}, "kv": {1: [5], 2: [4, 3], 4: [2, 3, 3, 1]}},
        align="bottom_right",
        alibi=True,
        q_lengths=lambda T, S: [T, T - 1],
        kv_lengths=lambda T, S: [S - 1, S - 3],
    ),
    "sinks-lengths": dict(lengths="unequal", sinks=True, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS),
    # Shards of 3: the global q_lengths end before rank P/2 (its q shards and
    # later ones are all padding), kv_lengths before rank P-1 (its kv shard).
    "padding-shards": dict(
        lengths="equal", q_lengths=lambda T, S: [T // 2 - 1, T // 2], kv_lengths=lambda T, S: [max(S - 5, 0), S - 3]
    ),
    "padding-shards-causal-sinks-dropout": dict(
        lengths="equal",
        causal=True,
        sinks=True,
        dropout_p=0.25,
        seed=3,
        q_lengths=lambda T, S: [T // 2 - 1, T // 2],
        kv_lengths=lambda T, S: [max(S - 5, 0), S - 3],
        bias=dict(layout="shard", lead="BN"),  # its gradient travels through the skipped steps too
    ),
    # --- combinations ---
    "all-options-gqa": _all_options(
        shape=(2, 4, 2, 3, 2),
        seed=5,
        bias=dict(layout="shard", lead="B1"),
    ),
    "all-options-bottom-right-T>S-chunked": dict(
        lengths={"q": {1: [5], 2: [4, 3], 4: [3, 2, 1, 3]}, "kv": {1: [3], 2: [2, 3], 4: [1, 2, 2, 1]}},
        shape=(2, 4, 2, 3, 2),
        causal=True,
        align="bottom_right",
        segments=(DOCS, DOCS_KV),
        q_lengths=lambda T, S: [T - 1, T],
        kv_lengths=lambda T, S: [S, S - 2],
        dropout_p=0.3,
        seed=11,
        bias=dict(layout="keys", lead="BN"),
        softcap=1.5,
        alibi=True,
        sinks=True,
        impl="chunked",
        block_q=2,
        block_k=2,
    ),
    "all-options-window-rows-bias": dict(
        lengths="unequal",
        window=(2, 1),
        segments=DOCS,
        q_lengths=Q_LENGTHS,
        kv_lengths=KV_LENGTHS,
        dropout_p=0.2,
        seed=6,
        bias=dict(layout="rows", lead="B1", query="one"),
        alibi=True,
        sinks=True,
    ),
    "all-options-permuted-starts": _all_options(
        permute=True,
        seed=7,
        bias=dict(layout="shard", lead="BN"),
    ),
    "all-options-3d-mqa": dict(
        lengths="unequal",
        shape=(None, 2, 1, 3, 2),
        causal=True,
        segments=DOCS,
        q_lengths=lambda T, S: [T - 1],
        kv_lengths=lambda T, S: [S - 2],
        dropout_p=0.2,
        seed=8,
        bias=dict(layout="keys", lead="", query="one"),
        softcap=2.0,
        alibi=True,
        sinks=True,
    ),
    "all-options-float32-chunked": _all_options(
        dtype="float32",
        shape=(2, 4, 2, 3, 2),
        seed=9,
        bias=dict(layout="rows", lead="BN"),
        impl="chunked",
        block_q=2,
        block_k=3,
    ),
    # Two batch axes: the dropout hash's flattened batch index, lengths and
    # segment ids of shape (2, 2).
    "all-options-two-batch-axes": dict(
        lengths="unequal",
        shape=((2, 2), 2, 1, 3, 2),
        causal=True,
        segments=((1, 2, 4), (5, 3), (2,), (7, 1)),
        q_lengths=lambda T, S: [[T - 2, T], [(T + 1) // 2, T - 1]],
        kv_lengths=lambda T, S: [[S, S - 1], [S - 3, S]],
        dropout_p=0.3,
        seed=12,
        bias=dict(layout="keys", lead="B1"),
        alibi=True,
        sinks=True,
    ),
    "all-options-float16": _all_options(
        dtype="float16",
        seed=13,
        bias=dict(layout="shard", lead="BN"),
    ),
    "all-options-torch": _all_options(
        backend="torch",
        seed=14,
        bias=dict(layout="rows", lead="B1", query="one"),
    ),
    "all-options-array-api-strict-device1": _all_options(
        backend="strict-device1",
        transport="host",
        seed=10,
        bias=dict(layout="shard", lead="B1", query="one"),
    ),
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


def _global_lengths(spec, P: int, T: int, S: int, lead: tuple) -> np.ndarray:
    """A case's global lengths: the same integer array, of the batch shape, on every rank."""
    values = spec(T, S) if callable(spec) else spec[P] if isinstance(spec, dict) else spec
    return np.asarray(values, dtype=np.int64).reshape(lead)


def _segment_ids(recipe, total: int, lead: tuple) -> np.ndarray:
    """Global ids ``(*lead, total)``: per batch element, documents of the recipe's
    lengths (repeated, the last recipe for later elements), numbered 0, 1, ..."""
    count = int(np.prod(lead, dtype=np.int64))
    ids = np.empty((count, total), dtype=np.int64)
    for b in range(count):
        cycle = recipe[min(b, len(recipe) - 1)]
        position, doc = 0, 0
        while position < total:
            ids[b, position : position + cycle[doc % len(cycle)]] = doc
            position += cycle[doc % len(cycle)]
            doc += 1
    return ids.reshape(*lead, total)


def _bias(spec, rng, sizes, T, S, P, r, q_rows, kv_cols):
    """``(global bias, this rank's bias, reduce)`` for a bias recipe: the global
    equivalent (float64, at the resolution single-process attention needs) and
    ``reduce(dbias)``, the single-process dbias mapped to this rank's bias shape."""
    lead = tuple(size for c in spec["lead"] for size in sizes[c])
    one = spec.get("query", "full") == "one"
    if spec["layout"] == "shard":  # (..., 1 or T, S_r): this key shard's bias for all queries
        G = rng.standard_normal((*lead, 1 if one else T, S))
        if spec.get("neginf"):
            G[rng.random(G.shape) < 0.15] = -np.inf
        return G, G[..., kv_cols[r]], lambda d: d[..., kv_cols[r]]
    b = 1 if spec["layout"] == "keys" else S  # (..., 1 or T_r, b): this rank's query rows
    if one:  # each rank its own (..., 1, b), repeated over its rows in the global bias
        per_rank = rng.standard_normal((P, *lead, 1, b))
        G = np.empty((*lead, T, b))
        for rank in range(P):
            G[..., q_rows[rank], :] = per_rank[rank]
        return G, per_rank[r], lambda d: d[..., q_rows[r], :].sum(axis=-2, keepdims=True)
    G = rng.standard_normal((*lead, T, b))
    if spec.get("neginf"):
        G[rng.random(G.shape) < 0.15] = -np.inf
    return G, G[..., q_rows[r], :], lambda d: d[..., q_rows[r], :]


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
    lead = () if B is None else tuple(B) if isinstance(B, tuple) else (B,)
    q_lengths, kv_lengths = shard_lengths(case, P)
    order = list(reversed(range(P))) if case.get("permute") else list(range(P))
    q_starts, kv_starts = _starts(q_lengths, order), _starts(kv_lengths, order)
    T, S = sum(q_lengths), sum(kv_lengths)
    rng = np.random.default_rng(sum(map(ord, name)))
    dtype = np.dtype(case.get("dtype", "float64"))
    q = rng.standard_normal((*lead, N, T, H)).astype(dtype)
    k = rng.standard_normal((*lead, K, S, H)).astype(dtype)
    v = rng.standard_normal((*lead, K, S, Hv)).astype(dtype)
    options = {
        key: case[key] for key in ("causal", "window", "align", "scale", "dropout_p", "seed", "softcap") if key in case
    }
    asarray, to_numpy = _backend(case.get("backend", "numpy"))
    q_rows = [slice(q_starts[p], q_starts[p] + q_lengths[p]) for p in range(P)]
    kv_rows = [slice(kv_starts[p], kv_starts[p] + kv_lengths[p]) for p in range(P)]
    qs, ks = q_rows[r], kv_rows[r]

    # The array options: global (float64) for single-process attention, this
    # rank's share (case dtype and backend) for the ring; every rank builds all
    # of them from the same seeded generator.
    global_arrays, local_arrays = {}, {}
    for key in ("q_lengths", "kv_lengths"):
        if key in case:
            global_arrays[key] = _global_lengths(case[key], P, T, S, lead)
            local_arrays[key] = asarray(global_arrays[key])
    if "segments" in case:
        recipes = case["segments"]
        q_recipe, kv_recipe = recipes if len(recipes) == 2 and isinstance(recipes[0][0], tuple) else (recipes, recipes)
        q_ids, kv_ids = _segment_ids(q_recipe, T, lead), _segment_ids(kv_recipe, S, lead)
        global_arrays.update(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
        local_arrays.update(
            q_segment_ids=asarray(np.ascontiguousarray(q_ids[..., qs])),
            kv_segment_ids=asarray(np.ascontiguousarray(kv_ids[..., ks])),
        )
    if case.get("alibi"):
        global_arrays["alibi_slopes"] = np.asarray(npattn.alibi_slopes(N), dtype=np.float64)
    if case.get("sinks"):
        global_arrays["sinks"] = rng.standard_normal(N)
    for key in ("alibi_slopes", "sinks"):
        if key in global_arrays:
            local_arrays[key] = asarray(global_arrays[key].astype(dtype))
    reduce_dbias = None
    if "bias" in case:
        sizes = {"B": lead, "N": (N,), "1": (1,)}
        G, local_bias, reduce_dbias = _bias(case["bias"], rng, sizes, T, S, P, r, q_rows, kv_rows)
        global_arrays["bias"] = G
        local_arrays["bias"] = asarray(np.ascontiguousarray(local_bias).astype(dtype))

    # Single process, float64, on the concatenated sequence.
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref_out, ref_res = npattn.attention_forward(q64, k64, v64, impl="dense", **options, **global_arrays)
    oracle_out, oracle_lse, _ = reference_attention(q64, k64, v64, **options, **global_arrays)
    dout = rng.standard_normal(ref_out.shape)
    dlse = None if case.get("no_dlse") else rng.standard_normal(ref_res.lse.shape)
    ref = npattn.attention_backward(dout, ref_res, dlse=dlse)

    # This rank's shards, on the case's backend.
    local = lambda a, rows: asarray(np.ascontiguousarray(a[..., rows, :]))  # noqa: E731
    extra = {key: case[key] for key in ("impl", "block_q", "block_k", "transport") if key in case}
    if case.get("permute"):
        extra.update(q_start=q_starts[r], kv_start=kv_starts[r])
    fwd_stats, bwd_stats = {}, {}
    out, res = dist.ring_attention_forward(
        local(q, qs), local(k, ks), local(v, ks), comm=comm, stats=fwd_stats, **options, **local_arrays, **extra
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

    def param_err(got, want):
        """Error of a parameter gradient relative to max(1, its largest entry)
        (they sum over every row); inf where one is missing."""
        if got is None:
            return float("inf")
        return err(got, want) / max(1.0, float(np.abs(want).max(initial=0.0)))

    # Parameter gradients: this rank's dbias in its own bias's shape, dsinks and
    # dalibi_slopes in full on every rank (summed over the ranks).
    wanted = {"dbias": None if ref.dbias is None else reduce_dbias(ref.dbias)}
    wanted.update(dsinks=ref.dsinks, dalibi_slopes=ref.dalibi_slopes)
    param_errors = {key: param_err(getattr(grads, key), want) for key, want in wanted.items() if want is not None}
    unexpected = [key for key, want in wanted.items() if want is None and getattr(grads, key) is not None]

    lse = res.lse
    return {
        **param_errors,
        "unexpected_grads": unexpected,
        "dbias_dtype": None if grads.dbias is None else str(grads.dbias.dtype).rsplit(".", 1)[-1],
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
    ids = np.zeros((1, 3), dtype=np.int64)

    def ring(**options):
        return dist.ring_attention_forward(q, k, v, comm=comm, causal=True, **options)

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
        # The options (2 ranks of 3 queries and keys: T = S = 6).
        "q_lengths-differ": lambda: ring(q_lengths=np.array([3 + r])),
        "kv_lengths-differ": lambda: ring(kv_lengths=np.array([6 - r])),
        "q_lengths-past-total": lambda: ring(q_lengths=np.array([7])),
        "q_lengths-negative": lambda: ring(q_lengths=np.array([-1])),
        "segment-ids-some-ranks": lambda: ring(
            q_segment_ids=ids if r == 0 else None, kv_segment_ids=ids if r == 0 else None
        ),
        "bias-fits-no-layout": lambda: ring(bias=np.zeros((1, 2, 3, 2))),
        "bias-fits-no-layout-one-rank": lambda: ring(bias=np.zeros((1, 2, 3, 1 if r == 0 else 2))),
        "bias-some-ranks": lambda: ring(bias=np.zeros((1, 2, 3, 1)) if r == 0 else None),
        "bias-layouts-differ": lambda: ring(bias=np.zeros((1, 2, 3, 1 if r == 0 else 6))),  # keys on 0, rows on 1
        # A bias that travels with its key shard ("shard" layout: (..., T, S_r)).
        "bias-leading-axes-differ": lambda: ring(bias=np.zeros((1, 2 if r == 0 else 1, 6, 3))),
        "dropout-seed-differs": lambda: ring(dropout_p=0.1, seed=r),
        "dropout-p-differs": lambda: ring(dropout_p=0.1 * (r + 1), seed=0),
        "softcap-differs": lambda: ring(softcap=1.0 + r),
        "alibi-slopes-differ": lambda: ring(alibi_slopes=np.array([0.5, 0.25 * (r + 1)])),
        "sinks-differ": lambda: ring(sinks=np.array([0.0, float(r)])),
        "sinks-some-ranks": lambda: ring(sinks=np.zeros(2) if r == 0 else None),
        "alibi-T!=S-no-align": lambda: dist.ring_attention_forward(
            q, k[:, :, :2], v[:, :, :2], comm=comm, alibi_slopes=np.array([0.5, 0.25])
        ),
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
