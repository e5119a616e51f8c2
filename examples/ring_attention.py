"""Exact sequence-parallel (ring) attention across MPI ranks.

    pip install -e ".[mpi]"
    mpiexec -n 4 python examples/ring_attention.py [--seq 1000] [--no-causal]
    mpiexec -n 2 python examples/ring_attention.py --quick   # 64 tokens (used by the tests)

Every rank builds the same seeded full sequence, keeps one contiguous shard
of it (shard lengths differ on purpose), and runs ring attention forward and
backward on its shard; K/V shards travel around the ring. Rank 0 then
gathers the shards and checks them against single-process attention on the
whole sequence, printing the max error of out, lse, dq, dk and dv; the exit
status is 1 if one exceeds 1e-10.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 64-token sequence, for a fast check")
    parser.add_argument("--seq", type=int, default=None, help="total sequence length (default 512; 64 with --quick)")
    parser.add_argument("--heads", type=int, default=4, help="query heads N")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads K (GQA when < N)")
    parser.add_argument("--dim", type=int, default=32, help="head dim H")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    args = parser.parse_args(argv)
    if args.seq is None:
        args.seq = 64 if args.quick else 512

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(0)
    B, N, K, T, H = 1, args.heads, args.kv_heads, args.seq, args.dim
    q = rng.standard_normal((B, N, T, H))  # (B, N, T, H), the same on every rank
    k = rng.standard_normal((B, K, T, H))  # (B, K, T, H)
    v = rng.standard_normal((B, K, T, H))  # (B, K, T, H)
    dout = rng.standard_normal((B, N, T, H))
    lo, hi = shard_bounds(T, P)[rank]

    comm.Barrier()
    start = time.perf_counter()
    out, res = dist.ring_attention_forward(
        q[..., lo:hi, :], k[..., lo:hi, :], v[..., lo:hi, :], comm=comm, causal=args.causal
    )
    grads = dist.ring_attention_backward(dout[..., lo:hi, :], res)
    seconds = comm.reduce(time.perf_counter() - start, op=MPI.MAX, root=0)

    gathered = comm.gather((out, res.lse, grads.dq, grads.dk, grads.dv), root=0)
    if rank != 0:
        return 0
    ring = [np.concatenate(parts, axis=-2 if parts[0].ndim == 4 else -1) for parts in zip(*gathered)]
    ref_out, ref_res = npattn.attention_forward(q, k, v, causal=args.causal)
    ref = npattn.attention_backward(dout, ref_res)
    shards = ", ".join(str(b - a) for a, b in shard_bounds(T, P))
    print(
        f"ring attention on {P} rank(s), shards of {shards} tokens, causal={args.causal}, "
        f"GQA {N}/{K} heads, float64: forward+backward {seconds * 1e3:.1f} ms (first call)"
    )
    worst = 0.0
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ring, (ref_out, ref_res.lse, ref.dq, ref.dk, ref.dv)):
        error = float(np.max(np.abs(got - want)))
        worst = max(worst, error)
        print(f"  max |ring - single process| {name:>3}: {error:.2e}")
    return 0 if worst <= 1e-10 else 1  # float64: the ring equals one process to rounding


if __name__ == "__main__":
    sys.exit(main())
