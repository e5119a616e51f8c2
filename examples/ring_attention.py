"""Exact sequence-parallel (ring) attention across MPI ranks.

    pip install -e ".[mpi]"
    mpiexec -n 4 python examples/ring_attention.py [--seq 1000] [--no-causal] [--documents 6] [--pad 20]
    mpiexec -n 2 python examples/ring_attention.py --quick   # 64 tokens (used by the tests)

Every rank builds the same seeded full sequence, keeps one contiguous shard
of it (shard lengths differ on purpose), and runs ring attention forward and
backward on its shard; K/V shards travel around the ring. The sequence is a
training batch as it usually comes: packed documents of random lengths that
cross shard boundaries (segment ids), padding at the end (lengths), and a
learnable sink per head. Rank 0 then gathers the shards and checks them
against single-process attention on the whole sequence, printing the max
error of out, lse, dq, dk, dv and dsinks; the exit status is 1 if one
exceeds 1e-10.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import npattn
import npattn.distributed as dist


def shard_bounds(total: int, P: int) -> list[tuple[int, int]]:
    """Unequal contiguous shards: rank r gets a share proportional to r + 1."""
    weights = np.arange(1, P + 1)
    ends = np.round(np.cumsum(weights) / weights.sum() * total).astype(int)
    starts = np.concatenate([[0], ends[:-1]])
    return list(zip(starts.tolist(), ends.tolist()))


def document_ids(T: int, documents: int, rng: np.random.Generator) -> np.ndarray:
    """``(1, T)`` ids of ``documents`` packed documents of random lengths."""
    cuts = np.sort(rng.choice(np.arange(1, T), size=documents - 1, replace=False))
    return np.searchsorted(cuts, np.arange(T), side="right")[None].astype(np.int64)  # (1, T)


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    """``max |got - want|``, counting equal infinities (padded rows' lse) as 0."""
    with np.errstate(invalid="ignore"):  # -inf - -inf, masked out below
        difference = np.abs(got - want)
    return float(np.max(np.where(got == want, 0.0, difference), initial=0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 64-token sequence, for a fast check")
    parser.add_argument("--seq", type=int, default=None, help="total sequence length (default 512; 64 with --quick)")
    parser.add_argument("--heads", type=int, default=4, help="query heads N")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads K (GQA when < N)")
    parser.add_argument("--dim", type=int, default=32, help="head dim H")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--documents", type=int, default=4, help="packed documents in the sequence")
    parser.add_argument("--pad", type=int, default=None, help="padding tokens at the end (default seq // 16)")
    args = parser.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.quick else 512
    if args.pad is None:
        args.pad = args.seq // 16

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)
    B, N, K, T, H = 1, args.heads, args.kv_heads, args.seq, args.dim
    q = rng.standard_normal((B, N, T, H))  # (B, N, T, H), the same on every rank
    k = rng.standard_normal((B, K, T, H))  # (B, K, T, H)
    v = rng.standard_normal((B, K, T, H))  # (B, K, T, H)
    dout = rng.standard_normal((B, N, T, H))
    ids = document_ids(T, args.documents, rng)  # (B, T): the same ids for queries and keys
    lengths = np.array([T - args.pad])  # (B,): the valid tokens, global
    sinks = rng.standard_normal(N)  # (N,): one learnable sink logit per head
    options = dict(causal=args.causal, q_lengths=lengths, kv_lengths=lengths, sinks=sinks)
    lo, hi = shard_bounds(T, P)[rank]

    comm.Barrier()
    start = time.perf_counter()
    stats: dict = {}
    out, res = dist.ring_attention_forward(
        q[..., lo:hi, :],
        k[..., lo:hi, :],
        v[..., lo:hi, :],
        comm=comm,
        q_segment_ids=ids[:, lo:hi],  # this rank's shard of the ids
        kv_segment_ids=ids[:, lo:hi],
        stats=stats,
        **options,
    )
    grads = dist.ring_attention_backward(dout[..., lo:hi, :], res)
    seconds = comm.reduce(time.perf_counter() - start, op=MPI.MAX, root=0)
    computed = comm.reduce(stats["computed"], op=MPI.SUM, root=0)

    gathered = comm.gather((out, res.lse, grads.dq, grads.dk, grads.dv), root=0)
    if rank != 0:
        return 0
    ring = [np.concatenate(parts, axis=-2 if parts[0].ndim == 4 else -1) for parts in zip(*gathered)]
    ring.append(grads.dsinks)  # summed over the ranks already: the same on each
    ref_out, ref_res = npattn.attention_forward(q, k, v, q_segment_ids=ids, kv_segment_ids=ids, **options)
    ref = npattn.attention_backward(dout, ref_res)
    shards = ", ".join(str(b - a) for a, b in shard_bounds(T, P))
    print(
        f"ring attention on {P} rank(s), shards of {shards} tokens, causal={args.causal}, "
        f"{args.documents} packed documents, {args.pad} padding tokens, sinks, GQA {N}/{K} heads, float64: "
        f"forward+backward {seconds * 1e3:.1f} ms (first call), {computed} of {P * P} steps computed"
    )
    worst = 0.0
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for name, got, want in zip(names, ring, (ref_out, ref_res.lse, ref.dq, ref.dk, ref.dv, ref.dsinks)):
        error = max_error(got, want)
        worst = max(worst, error)
        print(f"  max |ring - single process| {name:>6}: {error:.2e}")
    return 0 if worst <= 1e-10 else 1  # float64: the ring equals one process to rounding


if __name__ == "__main__":
    sys.exit(main())
