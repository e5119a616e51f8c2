r"""Exact sequence-parallel (ring) attention over MPI, forward and backward,
with every option of :func:`npattn.attention_forward` but user score mods.

Each of the ``P`` ranks of an MPI communicator holds one contiguous shard of
the sequence: queries ``Q_r (..., N, T_r, H)`` and keys/values
``K_r (..., K, S_r, H)``, ``V_r (..., K, S_r, Hv)`` (shard lengths may differ
across ranks). The result on rank ``r`` is exactly the rows ``T_r`` of
single-process attention over the concatenated sequence, ``lse`` and
gradients included.

Forward (ring step ``t = 0 .. P-1``; rank ``r`` holds the key shard of rank
``s = (r - t) mod P``, passes it to rank ``r + 1`` and receives the next one
from rank ``r - 1`` while it computes)::

    out_rs, lse_rs = attention(Q_r, K_s, V_s; options on global indices)
    lse_r  = logsumexp_s(lse_rs)                     merged step by step through lse
    out_r  = sum_s exp(lse_rs - lse_r) * out_rs      (npattn.merge.merge_partials)

then the sinks, once per row. The backward sends the key shards around again,
each with its ``dK``/``dV`` accumulators (:mod:`npattn.distributed.ring`).

Global indices (:mod:`npattn.distributed.plan`). Rank ``r``'s shard holds
the queries ``[q_start_r, q_start_r + T_r)`` and keys
``[kv_start_r, kv_start_r + S_r)`` of the full sequence; by default shards
follow rank order. Each step's spec places its queries at their global
positions (causal, window, ALiBi, ``align`` with the totals ``T`` and ``S``
and the global lengths), clips the global ``q_lengths``/``kv_lengths`` to the
shards, pairs this rank's query segment ids with the step's key ids, and
hashes dropout on global indices, so the keep mask is the single-process one.
A step the index rules hide entirely (causal, padding, documents that cannot
meet) is skipped. A bias either stays on its rank (its rows, over one or all
keys) or travels with its key shard. Sinks and ALiBi slopes are shared
parameters: their gradients are summed over the ranks.

Transport (:mod:`npattn.distributed.transport`). Arrays move as raw bytes
through mpi4py's buffer interface (``Isend``/``Irecv``, no pickling).
``transport="auto"`` sends host arrays (NumPy, PyTorch CPU, array-api-strict)
directly and stages device arrays (CuPy) through host NumPy buffers;
``transport="buffer"`` passes device buffers to MPI as they are, which needs
a CUDA-aware MPI. Everything travels in the compute dtype (float32 for half
inputs). Every call duplicates the communicator (``comm.Dup()``) so its
messages never meet the caller's. Options and key segment ids are checked
and gathered once per call (``allgather``), so a bad input raises the same
error on every rank instead of hanging.

mpi4py is imported on first use, so ``import npattn.distributed`` works
without it; calling these functions without it raises ``ImportError``
naming ``pip install "npattn[mpi]"``.

Dimension legend: B... batch axes, N query heads, K kv heads (N % K == 0;
K < N is GQA/MQA), T_r / S_r this rank's query / key shard lengths, T / S
their totals over the ranks, H head dim, Hv value dim.
"""

from .plan import RingLayout
from .ring import RingResiduals, ring_attention_backward, ring_attention_forward
from .transport import TRANSPORTS

__all__ = [
    "ring_attention_forward",
    "ring_attention_backward",
    "RingResiduals",
    "RingLayout",
    "TRANSPORTS",
]
