r"""The ring's forward and backward loops (see :mod:`npattn.distributed`).

Forward, on rank ``r`` at step ``t = 0 .. P-1`` with rank ``s = (r - t) mod P``'s
key shard at hand (sent on to rank ``r + 1`` while it computes)::

    out_rs, lse_rs = attention(pair spec (r, s))     skipped when the spec hides it all
    out_r, lse_r   = merge_partials(out_r, out_rs; lse_r, lse_rs)
    afterwards:      the sinks, merged once per row

Backward: the key shards travel again, each with its gradient accumulators
``[dK_s, dV_s]`` (and ``dbias_s`` for a bias in the ``"shard"`` layout); one
last hop brings them home. With the global ``out_r`` and ``lse_r`` (sinks
included), the per-pair backward of :mod:`npattn.chunked` is exact for that
pair: ``P_rs = exp(S_rs - lse_r)`` is the global softmax restricted to shard
``s`` and ``D_r = rowsum(dO_r * out_r) - dlse_r`` the global ``D``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..attention import (
    AttentionGrads,
    ChunkedResiduals,
    attention_backward,
    choose_impl,
    chunked_kernel,
    forward_from_spec,
)
from ..merge import merge_partials
from ..namespace import array_device, compute_dtype, resolve_namespace, to_numpy
from ..scores.sinks import apply_sinks, sinks_grad
from .plan import RingLayout, RingPlan, check_stats, local_error, plan_ring, raise_gathered
from .transport import Transport, check_comm, mpi

__all__ = ["ring_attention_forward", "ring_attention_backward", "RingResiduals"]

#: The first MPI tag of the gradient accumulators (the shard itself uses 0, 1, 2).
_ACCUMULATOR_TAG = 4


@dataclass(frozen=True, eq=False)
class RingResiduals:
    """What :func:`ring_attention_backward` needs, saved on every rank.

    Attributes
    ----------
    comm : mpi4py communicator
        The caller's communicator (duplicated again for the backward).
    plan : RingPlan
        The options every rank agreed on, the layout of the shards and this
        rank's own option arrays (segment ids, slopes, sinks).
    q, k, v : arrays, (..., N, T_r, H), (..., K, S_r, H), (..., K, S_r, Hv)
        This rank's shards in the compute dtype.
    bias : array or None
        This rank's bias in the compute dtype, at rank >= 2.
    out : array, (..., N, T_r, Hv)
        This rank's rows of the global output, in the compute dtype.
    lse : array, (..., N, T_r)
        This rank's rows of the global logsumexp (sinks included); ``-inf``
        on rows that see no key anywhere, and on padded query rows.
    transport : str
        The transport the forward chose on this rank.
    dtype : dtype
        The inputs' dtype (of ``out`` and of the gradients).
    bias_shape, bias_dtype : tuple and dtype, or None
        The bias as the caller passed it (``dbias`` comes back so).
    """

    comm: Any
    plan: RingPlan
    q: Any
    k: Any
    v: Any
    bias: Any
    out: Any
    lse: Any
    transport: str
    dtype: Any
    bias_shape: tuple[int, ...] | None
    bias_dtype: Any

    @property
    def layout(self) -> RingLayout:
        """Every rank's shard lengths and global starts."""
        return self.plan.layout

    @property
    def xp(self) -> Any:
        """The Array API namespace of the shards."""
        return self.plan.xp


def ring_attention_forward(
    q,
    k,
    v,
    /,
    *,
    comm,
    bias=None,
    causal=False,
    window=None,
    align=None,
    q_lengths=None,
    kv_lengths=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    scale=None,
    dropout_p=0.0,
    seed=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    q_start=None,
    kv_start=None,
    impl="auto",
    block_q=None,
    block_k=None,
    transport="auto",
    stats=None,
    xp=None,
):
    r"""Sequence-parallel attention: this rank's rows of attention over the
    full, sharded sequence, exactly. Collective: every rank of ``comm`` calls it.

    .. math::

        \mathrm{out}_r = \sum_s e^{\mathrm{lse}_{rs} - \mathrm{lse}_r}\,
        \mathrm{out}_{rs},\qquad
        \mathrm{lse}_r = \log\Big(e^{\mathrm{sinks}} + \sum_s e^{\mathrm{lse}_{rs}}\Big)

    where ``(out_rs, lse_rs)`` is attention of this rank's queries to rank
    ``s``'s keys with every option on global indices, the sums running over
    the key shards as they pass around the ring and skipping those the index
    rules (causal/window, lengths, segment ids) hide entirely. Every option
    means what it means in :func:`npattn.attention_forward` for the
    concatenated sequence.

    Dimension legend: B... batch axes, N query heads, K kv heads, T_r / S_r
    this rank's query / key shard lengths (may differ across ranks), T / S
    their totals, H head dim, Hv value dim.

    Parameters
    ----------
    q : array, (..., N, T_r, H)
    k : array, (..., K, S_r, H)
    v : array, (..., K, S_r, Hv)
        This rank's contiguous shards. Batch axes, N, K, H, Hv and the dtype
        must agree across ranks; ``S_r >= 1``.
    comm : mpi4py.MPI.Intracomm
        The ranks holding the shards (e.g. ``MPI.COMM_WORLD``).
    bias : array, optional
        Additive, in one of three layouts read from its last two axes (the
        same layout on every rank; the first that fits, in this order):
        ``(..., 1|T_r, 1)`` this rank's query rows, broadcast over every key;
        ``(..., 1|T_r, S)`` this rank's rows against all ``S`` keys (sliced
        per step); ``(..., 1|T, S_r)`` every query against this rank's keys,
        which travels around the ring with them. Leading axes broadcast to
        ``(..., N)`` as in :func:`npattn.attention_forward`.
    causal, window, align
        As in :func:`npattn.attention_forward`, on global positions (``align``
        for the totals ``T`` and ``S``; required for causal/window/ALiBi when
        ``T != S``).
    q_lengths, kv_lengths : integer arrays of the batch shape, optional
        The full sequence's valid lengths, in ``[0, T]`` / ``[0, S]``: the same
        array on every rank. A shard that is all padding skips its steps.
    q_segment_ids, kv_segment_ids : integer arrays (..., T_r), (..., S_r), optional
        This rank's shard of the packed documents' ids (on every rank or
        none). Key ids are gathered once, on the host; steps whose id ranges
        cannot meet are skipped.
    scale, softcap, alibi_slopes, sinks
        As in :func:`npattn.attention_forward`, the same on every rank; ALiBi
        reads global positions, and a sink enters each row's softmax once.
    dropout_p, seed
        As in :func:`npattn.attention_forward`, the same on every rank: the
        keep mask hashes global indices, so it is the single-process mask.
    q_start, kv_start : int, optional
        Global index of this rank's first query / key. Default: shards in
        rank order (from the gathered lengths). If given, give them on every
        rank; they must tile the sequence.
    impl : {"auto", "dense", "chunked"}
        The path of each (q-shard, kv-shard) pair.
    block_q, block_k : int, optional
        Tile sizes of the chunked path.
    transport : {"auto", "buffer", "host"}
        ``"buffer"`` hands array memory to MPI (device arrays need a
        CUDA-aware MPI); ``"host"`` stages through NumPy; ``"auto"`` is
        ``"buffer"`` for host arrays and ``"host"`` for device arrays.
    stats : dict, optional
        If given, updated with ``transport``, ``steps``, ``computed``,
        ``skipped``, ``bytes_sent`` and ``bytes_received`` for this rank.
    xp : namespace, optional
        Array API namespace; inferred from the inputs by default.

    Returns
    -------
    out : array, (..., N, T_r, Hv), in q's dtype
        This rank's rows of the output; 0 on rows that see no key.
    residuals : RingResiduals
        Carries this rank's rows of the global ``lse`` (..., N, T_r).

    Raises
    ------
    ImportError
        mpi4py is not installed (``pip install "npattn[mpi]"``).
    TypeError
        ``comm`` is None or not an mpi4py communicator; bad dtypes or options
        (on any rank: every rank raises, naming it).
    ValueError
        ``comm`` is ``MPI.COMM_NULL`` (size 0); shards or options that
        disagree across ranks (head dims, heads, batch axes, dtype, lengths,
        segment ids on some ranks only, the dropout seed, softcap, slopes,
        sinks); a bias that fits no layout; ``q_start``/``kv_start`` that do
        not tile the sequence; causal/window/ALiBi with ``T != S`` and no
        ``align``.

    Examples
    --------
    Run with ``mpiexec -n 4 python script.py``; each rank passes its shard:

    >>> from mpi4py import MPI                                  # doctest: +SKIP
    >>> import numpy as np, npattn.distributed as dist
    >>> comm = MPI.COMM_WORLD                                   # doctest: +SKIP
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 8, 16)) for _ in range(3))  # (B, N, T_r, H)
    >>> ids = np.zeros((1, 8), dtype=np.int64)                  # this shard's document ids
    >>> out, res = dist.ring_attention_forward(
    ...     q, k, v, comm=comm, causal=True, q_segment_ids=ids, kv_segment_ids=ids)  # doctest: +SKIP
    >>> grads = dist.ring_attention_backward(np.ones_like(out), res)            # doctest: +SKIP
    >>> out.shape, res.lse.shape, grads.dk.shape                                # doctest: +SKIP
    ((1, 4, 8, 16), (1, 4, 8), (1, 4, 8, 16))
    """
    options = dict(locals())
    MPI = mpi()
    check_comm(MPI, comm)
    ring = comm.Dup()
    try:
        return _forward(MPI, ring, options)
    finally:
        ring.Free()


def _report(stats: Any, wire: Transport, steps: int, computed: int) -> None:
    if stats is not None:
        stats.update(
            transport=wire.mode,
            steps=steps,
            computed=computed,
            skipped=steps - computed,
            bytes_sent=wire.bytes_sent,
            bytes_received=wire.bytes_received,
        )


def _forward(MPI: Any, ring: Any, options: dict) -> tuple[Any, RingResiduals]:
    q, k, v, bias = options["q"], options["k"], options["v"], options["bias"]
    plan = plan_ring(ring, q, k, v, bias, options)
    xp, layout = plan.xp, plan.layout
    r, P = layout.rank, layout.size
    cdtype = compute_dtype(xp, q.dtype)
    qc, kc, vc = (xp.astype(a, cdtype, copy=False) for a in (q, k, v))
    bias_c = None
    if bias is not None:  # at rank >= 2, in the compute dtype
        bias_c = xp.astype(xp.reshape(bias, plan.bias_shape), cdtype, copy=False)
    wire = Transport(MPI, ring, xp, plan.device, cdtype, options["transport"], kc)

    bs, N, T_r, Hv = tuple(q.shape[:-3]), q.shape[-3], q.shape[-2], v.shape[-1]
    out = xp.zeros(bs + (N, T_r, Hv), dtype=cdtype, device=plan.device)  # (..., N, T_r, Hv)
    lse = xp.full(bs + (N, T_r), -xp.inf, dtype=cdtype, device=plan.device)  # (..., N, T_r)
    shard = plan.travelling(kc, vc, bias_c)  # K_s, V_s (, bias_s): rank s's, passed on each step
    if P > 1:
        shard = [wire.contiguous(a) for a in shard]
    computed = 0
    for t in range(P):
        s = (r - t) % P  # the rank whose key shard is here
        pending = None
        if t < P - 1:
            pending = wire.exchange(shard, plan.travelling_shapes((s - 1) % P, shard))
        spec = plan.pair_spec(qc, shard[0], shard[1], s, plan.pair_bias(bias_c, shard, s))
        if spec is not None:
            out_rs, res = forward_from_spec(spec, qc, shard[0], shard[1])
            out, lse, _ = merge_partials([out, out_rs], [lse, res.lse], xp=xp)  # (..., N, T_r, Hv), (..., N, T_r)
            computed += 1
        if pending is not None:
            shard = pending.wait()
    sinks_spec = plan.sinks_spec(qc, kc, vc)
    if sinks_spec is not None:  # one virtual key per head, once per row: after every step
        out, lse, _ = apply_sinks(sinks_spec, out, lse)
    _report(options["stats"], wire, P, computed)
    bias_shape, bias_dtype = (None, None) if bias is None else (tuple(bias.shape), bias.dtype)
    residuals = RingResiduals(
        options["comm"], plan, qc, kc, vc, bias_c, out, lse, wire.mode, q.dtype, bias_shape, bias_dtype
    )
    return xp.astype(out, q.dtype, copy=False), residuals


# --------------------------------------------------------------------------- backward


def ring_attention_backward(dout, residuals, /, *, dlse=None, stats=None) -> AttentionGrads:
    r"""Gradients of :func:`ring_attention_forward` for this rank's shards.
    Collective: every rank of the forward's communicator calls it.

    With the global ``O_r`` and ``lse_r`` of this rank's rows (sinks
    included), ``D_r = rowsum(dO_r * O_r) - dlse_r`` and, for every key shard
    ``s`` the forward did not skip, ``P_rs = exp(S_rs - lse_r)`` (``S_rs`` the
    pair's scores after softcap, bias and ALiBi, dropout as in the forward):

    .. math::

        dS_{rs} = P_{rs} \circ (dO_r V_s^\top - D_r),\quad
        dQ_r = \mathrm{scale}\sum_s dR_{rs} K_s,\quad
        dK_s = \mathrm{scale}\sum_r dR_{rs}^\top Q_r,\quad
        dV_s = \sum_r P_{rs}^\top dO_r

    with ``dR = dS (1 - tanh^2)`` through a softcap. ``dK_s``, ``dV_s`` (and
    ``dbias_s`` for a bias that travels) accumulate while they travel around
    the ring with ``K_s`` and ``V_s``; one last hop brings them to the rank
    that owns ``s``. ``dsinks`` and ``dalibi_slopes`` are summed over every
    rank's rows.

    Parameters
    ----------
    dout : array, (..., N, T_r, Hv)
        Cotangent of this rank's ``out``, in its dtype.
    residuals : RingResiduals
        From :func:`ring_attention_forward` on this rank; reusable.
    dlse : array, (..., N, T_r), optional
        Cotangent of ``residuals.lse``, in the compute dtype.
    stats : dict, optional
        If given, updated with this rank's traffic as in the forward.

    Returns
    -------
    AttentionGrads
        ``dq (..., N, T_r, H)``, ``dk (..., K, S_r, H)``, ``dv (..., K, S_r,
        Hv)`` for this rank's shards, in the inputs' dtype; ``dbias`` in the
        shape and dtype of this rank's bias; ``dsinks`` and ``dalibi_slopes``
        the full gradients (the same on every rank: do not sum them over
        ranks again); None for what was not given, and ``dmods`` None.

    Raises
    ------
    TypeError, ValueError
        Residuals not from the ring forward, cotangents of the wrong shape or
        dtype on any rank (every rank raises, naming it).

    Examples
    --------
    See :func:`ring_attention_forward`.
    """
    if not isinstance(residuals, RingResiduals):
        raise TypeError(f"residuals must come from ring_attention_forward, got {type(residuals).__name__}")
    MPI = mpi()
    check_comm(MPI, residuals.comm)
    ring = residuals.comm.Dup()
    try:
        return _backward(MPI, ring, dout, residuals, dlse, stats)
    finally:
        ring.Free()


def _check_cotangents(res: RingResiduals, dout: Any, dlse: Any) -> tuple[Any, Any]:
    xp = res.xp
    if dout is None:
        raise TypeError(f"dout must be an array of the forward's output shape {tuple(res.out.shape)}, got None")
    resolve_namespace({"the forward's inputs": res.q, "dout": dout, "dlse": dlse})
    if tuple(dout.shape) != tuple(res.out.shape):
        raise ValueError(f"dout must have the forward's shape {tuple(res.out.shape)}, got {tuple(dout.shape)}")
    if dout.dtype != res.dtype:
        raise TypeError(f"dout must have dtype {res.dtype} (as the forward's output), got {dout.dtype}")
    dout_c = xp.astype(dout, res.out.dtype, copy=False)
    dlse_c = None
    if dlse is not None:
        if tuple(dlse.shape) != tuple(res.lse.shape):
            raise ValueError(f"dlse must have the lse's shape {tuple(res.lse.shape)}, got {tuple(dlse.shape)}")
        if dlse.dtype != res.lse.dtype:
            raise TypeError(f"dlse must have dtype {res.lse.dtype} (as the lse), got {dlse.dtype}")
        dlse_c = dlse
    return dout_c, dlse_c


def _pair_backward(spec: Any, res: RingResiduals, k: Any, v: Any, dout: Any, dlse: Any) -> AttentionGrads:
    """One pair's gradients, on the chunked path from the global out and lse."""
    spec = choose_impl(spec)  # the path the forward took for this pair
    if spec.impl == "dense":  # one tile: the dense computation
        spec = spec.replace(block_q=max(spec.q_len, 1), block_k=spec.kv_len)
    spec = spec.replace(impl="chunked")
    pair_res = ChunkedResiduals(spec, res.q, k, v, res.out, res.lse, chunked_kernel(spec))
    return attention_backward(dout, pair_res, dlse=dlse)


def _sum_over_ranks(ring: Any, res: RingResiduals, x: Any) -> Any:
    """``sum_r x_r``, the same bits on every rank (gathered, added in rank order)."""
    parts = ring.allgather(to_numpy(x))
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return res.xp.asarray(total, device=array_device(res.q))


def _backward(MPI: Any, ring: Any, dout: Any, res: RingResiduals, dlse: Any, stats: Any) -> AttentionGrads:
    try:
        check_stats(stats)
        dout_c, dlse_c = _check_cotangents(res, dout, dlse)
        error = None
    except (TypeError, ValueError) as err:
        error = local_error(err)
    raise_gathered(ring.allgather(error))
    plan, xp = res.plan, res.xp
    r, P = plan.layout.rank, plan.layout.size
    wire = Transport(MPI, ring, xp, plan.device, res.out.dtype, res.transport, res.k)

    dq = xp.zeros_like(res.q)  # (..., N, T_r, H)
    dbias = None if res.bias is None or plan.bias_layout == "shard" else xp.zeros_like(res.bias)  # stays here
    dslopes = None if plan.alibi_slopes is None else 0.0
    shard = plan.travelling(res.k, res.v, res.bias)  # K_s, V_s (, bias_s)
    if P > 1:
        shard = [wire.contiguous(a) for a in shard]
    travelling = None  # the exchange bringing shard s's accumulators [dK_s, dV_s (, dbias_s)] from the left
    computed = 0
    for t in range(P):
        s = (r - t) % P  # the rank whose key shard (and its accumulators) is here
        pending = None
        if t < P - 1:
            pending = wire.exchange(shard, plan.travelling_shapes((s - 1) % P, shard))
        spec = plan.pair_spec(res.q, shard[0], shard[1], s, plan.pair_bias(res.bias, shard, s))
        g = None
        if spec is not None:
            g = _pair_backward(spec, res, shard[0], shard[1], dout_c, dlse_c)
            dq = dq + g.dq  # (..., N, T_r, H)
            if dbias is not None:
                dbias = plan.add_pair_dbias(dbias, g.dbias, s)
            if dslopes is not None:
                dslopes = dslopes + g.dalibi_slopes
            computed += 1
        accumulators = [xp.zeros_like(a) for a in shard] if travelling is None else travelling.wait()
        if g is not None:  # (..., K, S_s, H), (..., K, S_s, Hv) (, (..., 1|T, S_s))
            accumulators[0], accumulators[1] = accumulators[0] + g.dk, accumulators[1] + g.dv
            if plan.bias_layout == "shard":
                accumulators[2] = plan.add_pair_dbias(accumulators[2], g.dbias, s)
        if P > 1:  # pass the accumulators on with their shard; after step P - 1 this hop brings them home
            shapes = plan.travelling_shapes((s - 1) % P if t < P - 1 else r, shard)
            travelling = wire.exchange(accumulators, shapes, tag=_ACCUMULATOR_TAG)
        if pending is not None:
            shard = pending.wait()
    if travelling is not None:
        accumulators = travelling.wait()  # this rank's own shard's, home
    _report(stats, wire, P, computed)
    return _grads(ring, res, plan, dq, accumulators, dbias, dslopes, dout_c, dlse_c)


def _grads(ring, res, plan, dq, accumulators, dbias, dslopes, dout, dlse) -> AttentionGrads:
    """The gradients in the caller's shapes and dtypes; the parameters that
    every rank shares (sinks, slopes) summed over the ranks."""
    xp = res.xp
    if plan.bias_layout == "shard":
        dbias = accumulators[2]
    if dbias is not None:
        dbias = xp.astype(xp.reshape(dbias, res.bias_shape), res.bias_dtype, copy=False)
    dsinks = None
    sinks_spec = plan.sinks_spec(res.q, res.k, res.v)
    if sinks_spec is not None:
        dsinks = _sum_over_ranks(ring, res, sinks_grad(sinks_spec, dout, res.out, res.lse, dlse))
        dsinks = xp.astype(dsinks, plan.sinks.dtype, copy=False)
    if dslopes is not None:
        slopes = plan.alibi_slopes
        if isinstance(dslopes, float):  # this rank computed no step
            dslopes = xp.zeros(tuple(slopes.shape), dtype=slopes.dtype, device=plan.device)
        dslopes = xp.astype(_sum_over_ranks(ring, res, dslopes), slopes.dtype, copy=False)
    dq, dk, dv = (xp.astype(g, res.dtype, copy=False) for g in (dq, accumulators[0], accumulators[1]))
    return AttentionGrads(dq, dk, dv, dbias=dbias, dsinks=dsinks, dalibi_slopes=dslopes)
