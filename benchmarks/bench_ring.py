"""Ring attention on 1, 2 and 4 MPI ranks: time per ring step and bytes moved per rank.

    python benchmarks/bench_ring.py [--seq 2048] [--heads 8] [--dim 64] [--ranks 1 2 4] [--documents 16]

A correctness-and-scaling demonstration, not a speed claim: the global
problem is fixed (strong scaling) and split into equal shards; every rank
runs ring_attention_forward and ring_attention_backward on its shard, after
one warm-up, ``--repeats`` times, and the slowest rank's median counts. Each
pair runs the chunked path with the same tiles at every rank count, so the
arithmetic per query/key tile is the same. The driver launches
``mpiexec -n P python benchmarks/bench_ring.py --worker ...`` for each P
with one BLAS/OpenMP thread per rank (more ranks than cores is allowed: MPICH
oversubscribes, slowly). Three workloads: full attention, causal, and causal
packed documents (``--documents`` documents of seeded random lengths that
cross shard boundaries, passed as segment ids; steps whose documents cannot
meet are skipped). Columns:

    fwd/bwd ms       forward / backward wall time (median, slowest rank)
    ms/step          that time divided by the P ring steps
    steps run        pairs computed out of P*P (causal and packed documents skip hidden ones)
    MiB sent/rank    forward / backward bytes each rank sends (max over ranks)
    max err          max |ring out - single-process out| over the sequence

Expected traffic per rank with equal shards of ``T/P`` tokens, ``b`` bytes
for one shard's K plus V: forward ``(P - 1) b``, backward ``(2P - 1) b``
(K, V travel again and dK, dV travel with them, one extra hop home).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")
    if not found:
        raise SystemExit('no mpiexec found: pip install "npattn[mpi]"')
    return found


def document_ids(T: int, documents: int):
    """``(1, T)`` int64 ids of ``documents`` packed documents of seeded random
    lengths (each at least one token), in order."""
    import numpy as np

    cuts = np.sort(np.random.default_rng(1).choice(np.arange(1, T), size=documents - 1, replace=False))
    return np.searchsorted(cuts, np.arange(T), side="right")[None].astype(np.int64)  # (1, T)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from mpi4py import MPI

    import npattn
    import npattn.distributed as dist

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    T, N, H = args.seq, args.heads, args.dim
    if T % P:
        raise SystemExit(f"--seq {T} must be divisible by {P} ranks")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, N, T, H)).astype(args.dtype)  # (B, N, T, H)
    k = rng.standard_normal((1, N, T, H)).astype(args.dtype)
    v = rng.standard_normal((1, N, T, H)).astype(args.dtype)
    shard = slice(rank * T // P, (rank + 1) * T // P)
    q_r, k_r, v_r = (np.ascontiguousarray(a[..., shard, :]) for a in (q, k, v))
    options = dict(causal=args.mode != "full", impl="chunked", block_q=args.block, block_k=args.block)
    local = {}
    if args.mode == "packed":
        ids = document_ids(T, args.documents)  # (1, T)
        options.update(q_segment_ids=ids, kv_segment_ids=ids)
        local = dict(
            q_segment_ids=np.ascontiguousarray(ids[:, shard]), kv_segment_ids=np.ascontiguousarray(ids[:, shard])
        )
    dout = np.ones_like(q_r)

    forward_s, backward_s = [], []
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        comm.Barrier()
        t0 = time.perf_counter()
        fwd_stats, bwd_stats = {}, {}
        out, res = dist.ring_attention_forward(q_r, k_r, v_r, comm=comm, stats=fwd_stats, **(options | local))
        t1 = time.perf_counter()
        dist.ring_attention_backward(dout, res, stats=bwd_stats)
        t2 = time.perf_counter()
        if repeat:
            forward_s.append(comm.allreduce(t1 - t0, op=MPI.MAX))
            backward_s.append(comm.allreduce(t2 - t1, op=MPI.MAX))
    outs = comm.gather(out, root=0)
    sent = comm.gather((fwd_stats["bytes_sent"], bwd_stats["bytes_sent"]), root=0)
    computed = comm.reduce(fwd_stats["computed"], op=MPI.SUM, root=0)
    if rank == 0:
        reference = npattn.attention(q, k, v, **options)
        error = float(np.max(np.abs(np.concatenate(outs, axis=-2).astype(np.float64) - reference)))
        print(
            json.dumps(
                {
                    "P": P,
                    "forward_s": float(np.median(forward_s)),
                    "backward_s": float(np.median(backward_s)),
                    "forward_bytes": max(s[0] for s in sent),
                    "backward_bytes": max(s[1] for s in sent),
                    "computed": computed,
                    "error": error,
                    "transport": fwd_stats["transport"],
                }
            )
        )


def driver(args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    print(
        f"ring attention, B=1 N={args.heads} T={args.seq} H={args.dim} {args.dtype}, chunked pairs "
        f"(block {args.block}), {os.cpu_count()} CPU cores, 1 BLAS thread per rank, "
        f"median of {args.repeats} after a warm-up"
    )
    for mode in ("full", "causal", "packed"):
        title = {"full": "full", "causal": "causal", "packed": f"causal, {args.documents} packed documents"}
        print(f"\n{title[mode]}")
        header = (
            f"{'ranks':>5} {'shard':>6} {'fwd ms':>8} {'ms/step':>8} {'bwd ms':>8} {'ms/step':>8} "
            f"{'steps run':>9} {'fwd MiB sent/rank':>17} {'bwd MiB sent/rank':>17} {'max err':>8}"
        )
        print(header)
        print("-" * len(header))
        for P in args.ranks:
            command = [
                _mpiexec(),
                "-n",
                str(P),
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                "--seq",
                str(args.seq),
                "--heads",
                str(args.heads),
                "--dim",
                str(args.dim),
                "--dtype",
                args.dtype,
                "--block",
                str(args.block),
                "--repeats",
                str(args.repeats),
                "--mode",
                mode,
                "--documents",
                str(args.documents),
            ]
            proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(command)} failed:\n{proc.stdout}\n{proc.stderr}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            mib = 2.0**20
            print(
                f"{P:>5} {args.seq // P:>6} {r['forward_s'] * 1e3:>8.1f} {r['forward_s'] * 1e3 / P:>8.1f} "
                f"{r['backward_s'] * 1e3:>8.1f} {r['backward_s'] * 1e3 / P:>8.1f} "
                f"{str(r['computed']) + '/' + str(P * P):>9} {r['forward_bytes'] / mib:>17.2f} "
                f"{r['backward_bytes'] / mib:>17.2f} {r['error']:>8.1e}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--documents", type=int, default=16, help="documents in the packed row")
    parser.add_argument("--mode", default="full", choices=["full", "causal", "packed"], help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    main()
