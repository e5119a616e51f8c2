r"""Exact sequence-parallel (ring) attention over MPI, forward and backward.

Each of the ``P`` ranks of an MPI communicator holds one contiguous shard of
the sequence: queries ``Q_r (..., N, T_r, H)`` and keys/values
``K_r (..., K, S_r, H)``, ``V_r (..., K, S_r, Hv)`` (shard lengths may differ
across ranks). The result on rank ``r`` is exactly the rows ``T_r`` of
single-process attention over the concatenated sequence, ``lse`` and
gradients included.

Forward (ring step ``t = 0 .. P-1``; rank ``r`` holds the K/V shard of rank
``s = (r - t) mod P``, passes it to rank ``r + 1`` and receives the next one
from rank ``r - 1`` while it computes)::

    out_rs, lse_rs = attention(Q_r, K_s, V_s)        one (q-shard, kv-shard) pair
    lse_r  = logsumexp_s(lse_rs)                     merged step by step through lse
    out_r  = sum_s exp(lse_rs - lse_r) * out_rs      (npattn.merge.merge_partials)

Backward (the K/V shards travel again, each with its ``dK``/``dV``
accumulator; one last hop brings the accumulators home). With the GLOBAL
``out_r`` and ``lse_r``, the per-pair backward of :mod:`npattn.chunked` is
exact for that pair: ``P_rs = exp(S_rs - lse_r)`` is the global softmax
restricted to shard ``s`` and ``D_r = rowsum(dO_r * out_r) - dlse_r`` is the
global ``D``::

    dS_rs = P_rs * (dO_r V_s^T - D_r)
    dQ_r += scale * dS_rs K_s
    dK_s += scale * dS_rs^T Q_r                      travels with K_s
    dV_s += P_rs^T dO_r                              travels with V_s

Global positions. Rank ``r``'s shard holds the queries
``[q_start_r, q_start_r + T_r)`` and keys ``[kv_start_r, kv_start_r + S_r)``
of the full sequence. By default shards follow rank order: the lengths are
gathered once (``allgather``) and ``q_start_r = T_0 + ... + T_{r-1}``. Pass
``q_start=``/``kv_start=`` (on every rank) to place shards in another order;
they must tile ``[0, T)`` and ``[0, S)`` without gaps or overlaps. Causal and
window masks then use global positions exactly as :func:`npattn.attention_forward`
does for the full sequence (``align`` included, with the totals ``T`` and
``S``). Each pair is classified on the host: fully hidden pairs are skipped
(about half the steps for causal), fully visible pairs build no mask, and a
pair that crosses the diagonal becomes a local ``window``/``align`` (or, where
no such window exists, a boolean mask of that pair only).

Transport. Arrays move as raw bytes through mpi4py's buffer interface
(``Isend``/``Irecv``, no pickling). ``transport="auto"`` sends host arrays
(NumPy, PyTorch CPU, array-api-strict) directly and stages device arrays
(CuPy) through host NumPy buffers; ``transport="buffer"`` passes device
buffers to MPI as they are, which needs a CUDA-aware MPI. Everything travels
in the compute dtype (float32 for half inputs). Every call duplicates the
communicator (``comm.Dup()``) so its messages never meet the caller's.

Not supported in the ring (they would need global indices): ``mask``,
``bias``, ``q_lengths``/``kv_lengths`` and dropout.

mpi4py is imported on first use, so ``import npattn.distributed`` works
without it; calling these functions without it raises ``ImportError``
naming ``pip install "npattn[mpi]"``.

Dimension legend: B... batch axes, N query heads, K kv heads (N % K == 0;
K < N is GQA/MQA), T_r / S_r this rank's query / key shard lengths, T / S
their totals over the ranks, H head dim, Hv value dim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .attention import (
    AttentionGrads,
    ChunkedResiduals,
    attention_backward,
    attention_forward,
    choose_impl,
    chunked_kernel,
)
from .merge import merge_partials
from .namespace import array_device, compute_dtype, dtype_name, resolve_namespace, to_numpy
from .options import check_int, make_spec

__all__ = [
    "ring_attention_forward",
    "ring_attention_backward",
    "RingResiduals",
    "RingLayout",
    "TRANSPORTS",
]

INSTALL_HINT = 'pip install "npattn[mpi]"'
TRANSPORTS = ("auto", "buffer", "host")


def _mpi() -> Any:
    """``mpi4py.MPI``, or an ImportError that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(
            "npattn.distributed needs mpi4py and an MPI runtime: "
            f"{INSTALL_HINT} (mpi4py with MPICH's wheel), or pip install mpi4py "
            "built against the system's MPI"
        ) from err
    return MPI


def _check_comm(MPI: Any, comm: Any) -> int:
    """Validate the communicator; return its size."""
    if comm is None:
        raise TypeError("comm is required: pass an mpi4py communicator, e.g. comm=MPI.COMM_WORLD")
    if not isinstance(comm, MPI.Comm):
        raise TypeError(
            f"comm must be an mpi4py communicator (mpi4py.MPI.Intracomm such as MPI.COMM_WORLD), "
            f"got {type(comm).__name__}"
        )
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL, a communicator of size 0; ring attention needs at least one rank")
    if comm.Is_inter():
        raise ValueError("comm is an intercommunicator; ring attention needs an intracommunicator")
    size = comm.Get_size()
    if size < 1:
        raise ValueError(f"comm has size {size}; ring attention needs at least one rank")
    return size


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class RingLayout:
    """Where every rank's shard sits in the full sequence (the same on all ranks).

    ``q_lengths[r]``/``kv_lengths[r]`` are rank ``r``'s ``T_r``/``S_r``;
    ``q_starts[r]``/``kv_starts[r]`` the global index of its first query/key.
    ``q_offset`` is the position of global query 0 for causal/window
    (0 for top_left, ``S - T`` for bottom_right).
    """

    rank: int
    size: int
    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    q_offset: int


def _starts(name: str, given: list, lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Default (rank-order) or checked explicit shard starts."""
    if all(g is None for g in given):
        return tuple(sum(lengths[:r]) for r in range(len(lengths)))
    missing = [r for r, g in enumerate(given) if g is None]
    if missing:
        raise ValueError(
            f"{name} was given on some ranks but not on ranks {missing}; pass it on every rank "
            "(or on none, for shards in rank order)"
        )
    total = sum(lengths)
    expected = 0
    for r in sorted(range(len(given)), key=lambda r: (given[r], lengths[r])):
        if given[r] != expected:
            shards = ", ".join(f"rank {i}: [{given[i]}, {given[i] + lengths[i]})" for i in range(len(given)))
            raise ValueError(
                f"{name} does not tile the sequence [0, {total}) without gaps or overlaps: "
                f"expected a shard starting at {expected}, found rank {r} starting at {given[r]} ({shards}); "
                "global positions (and so causal/window masking) would be wrong"
            )
        expected += lengths[r]
    return tuple(given)


def _pair_options(layout: RingLayout, left: int | None, right: int | None, r: int, s: int) -> dict | None:
    """Masking options for queries of shard ``r`` against keys of shard ``s``.

    Local query ``i`` sees local key ``j`` iff ``c_L <= j - i <= c_R`` with
    ``d = q_start_r + q_offset - kv_start_s``, ``c_L = d - left`` and
    ``c_R = d + right`` (global positions; a None bound is unbounded).
    Returns None when the pair is fully hidden, ``{}`` when fully visible,
    else a local ``window``/``align`` or, failing that, a boolean ``mask``.
    """
    T, S = layout.q_lengths[r], layout.kv_lengths[s]
    if T == 0 or S == 0:
        return None
    d = layout.q_starts[r] + layout.q_offset - layout.kv_starts[s]
    c_left = None if left is None else d - left
    c_right = None if right is None else d + right
    lo, hi = -(T - 1), S - 1  # range of j - i over the pair
    if (c_right is not None and lo > c_right) or (c_left is not None and hi < c_left):
        return None
    if c_right is not None and hi <= c_right:
        c_right = None  # holds everywhere
    if c_left is not None and lo >= c_left:
        c_left = None
    if c_left is None and c_right is None:
        return {}
    for align, shift in (("top_left", 0), ("bottom_right", S - T)):  # local query i sits at i + shift
        w_left = None if c_left is None else shift - c_left
        w_right = None if c_right is None else c_right - shift
        if (w_left is None or w_left >= 0) and (w_right is None or w_right >= 0):
            return {"window": (w_left, w_right), "align": align}
    return {"mask": (c_left, c_right)}  # built by _pair_mask on the namespace


def _pair_mask(xp: Any, device: Any, T: int, S: int, c_left: int | None, c_right: int | None) -> Any:
    """``c_left <= j - i <= c_right`` as a bool ``(T, S)`` array."""
    rows = xp.reshape(xp.arange(T, dtype=xp.int64, device=device), (T, 1))  # (T, 1)
    cols = xp.reshape(xp.arange(S, dtype=xp.int64, device=device), (1, S))  # (1, S)
    diff = cols - rows  # (T, S)
    visible = xp.ones((T, S), dtype=xp.bool, device=device)
    if c_left is not None:
        visible = xp.logical_and(visible, diff >= c_left)
    if c_right is not None:
        visible = xp.logical_and(visible, diff <= c_right)
    return visible


# --------------------------------------------------------------------------- transport


def _is_host_array(x: Any) -> bool:
    """Whether ``x`` lives in host memory (DLPack device type kDLCPU = 1)."""
    try:
        return int(x.__dlpack_device__()[0]) == 1
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return type(x).__module__.split(".")[0] == "numpy"


def _is_c_contiguous(x: Any) -> bool:
    """Whether ``x``'s memory is known to be in C order (NumPy, CuPy, PyTorch);
    False when the library does not say."""
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):
        return bool(flags.c_contiguous)
    is_contiguous = getattr(x, "is_contiguous", None)
    if callable(is_contiguous):
        return bool(is_contiguous())
    return False


def _synchronize(x: Any) -> None:
    """Wait for pending device work on ``x`` before MPI reads its memory."""
    library = type(x).__module__.split(".")[0]
    if library == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    elif library == "torch" and getattr(x, "is_cuda", False):
        import torch

        torch.cuda.synchronize(x.device)


class _Transport:
    """Moves C-contiguous arrays of one dtype to the right ring neighbour and
    receives the left neighbour's, as raw bytes (``[buf, MPI.BYTE]``).

    ``buffer`` mode hands the arrays' memory to MPI directly; ``host`` mode
    stages through NumPy buffers. Both put the same bytes on the wire, so
    ranks may use different modes.
    """

    def __init__(self, MPI: Any, comm: Any, xp: Any, device: Any, dtype: Any, mode: str, probe: Any):
        self.MPI, self.comm, self.xp, self.device, self.dtype = MPI, comm, xp, device, dtype
        self.right = (comm.Get_rank() + 1) % comm.Get_size()
        self.left = (comm.Get_rank() - 1) % comm.Get_size()
        self.itemsize = xp.finfo(dtype).bits // 8
        if mode == "auto":
            mode = "buffer" if _is_host_array(probe) and self._accepts(probe) else "host"
        self.mode = mode
        self.bytes_sent = 0
        self.bytes_received = 0

    def _accepts(self, x: Any) -> bool:
        """Whether MPI takes this library's arrays as writable buffers."""
        try:
            probe = self.xp.empty((1,), dtype=self.dtype, device=self.device)
            return not self.MPI.buffer(probe).readonly
        except (TypeError, ValueError, BufferError, NotImplementedError):
            return False

    def contiguous(self, x: Any) -> Any:
        """A fresh C-contiguous copy of ``x`` to send from (MPI would take an
        F-ordered array as is, with its bytes in the wrong order)."""
        buf = self.xp.empty(tuple(x.shape), dtype=self.dtype, device=self.device)
        buf[...] = x
        return buf

    def exchange(self, arrays: list, shapes: list, tag: int = 0) -> _Exchange:
        """Start sending ``arrays`` right and receiving ``shapes`` from the left,
        with tags ``tag, tag + 1, ...``."""
        MPI = self.MPI
        requests, keep = [], []
        recvs = []
        for i, shape in enumerate(shapes):
            if self.mode == "buffer":
                buf = self.xp.empty(shape, dtype=self.dtype, device=self.device)
            else:
                buf = np.empty(shape, dtype=dtype_name(self.dtype))
            recvs.append(buf)
            requests.append(self.comm.Irecv([buf, MPI.BYTE], source=self.left, tag=tag + i))
            self.bytes_received += math.prod(shape) * self.itemsize
        for i, x in enumerate(arrays):
            if self.mode == "buffer":
                payload = x if _is_c_contiguous(x) else self.contiguous(x)
                _synchronize(payload)
            else:
                payload = np.ascontiguousarray(to_numpy(x))  # kept alive in `keep` until the wait
            keep.append(payload)
            requests.append(self.comm.Isend([payload, MPI.BYTE], dest=self.right, tag=tag + i))
            self.bytes_sent += math.prod(tuple(x.shape)) * self.itemsize
        return _Exchange(self, requests, recvs, keep)


class _Exchange:
    def __init__(self, transport: _Transport, requests: list, recvs: list, keep: list):
        self.transport, self.requests, self.recvs, self.keep = transport, requests, recvs, keep

    def wait(self) -> list:
        """Complete the exchange; return the received arrays on the namespace."""
        self.transport.MPI.Request.Waitall(self.requests)
        t = self.transport
        if t.mode == "buffer":
            return self.recvs
        return [t.xp.asarray(buf, device=t.device) for buf in self.recvs]


# --------------------------------------------------------------------------- residuals


@dataclass(frozen=True, eq=False)
class RingResiduals:
    """What :func:`ring_attention_backward` needs, saved on every rank.

    Attributes
    ----------
    comm : mpi4py communicator
        The caller's communicator (duplicated again for the backward).
    layout : RingLayout
        Every rank's shard lengths and global starts.
    xp : namespace
        The Array API namespace of the shards.
    q, k, v : arrays, (..., N, T_r, H), (..., K, S_r, H), (..., K, S_r, Hv)
        This rank's shards in the compute dtype.
    out : array, (..., N, T_r, Hv)
        This rank's rows of the global output, in the compute dtype.
    lse : array, (..., N, T_r)
        This rank's rows of the global logsumexp; ``-inf`` on rows that see
        no key anywhere.
    window_left, window_right : int or None
        The global window (causal is ``right = 0``).
    scale : float
    impl : str
        The per-pair path (``"auto"``, ``"dense"`` or ``"chunked"``).
    block_q, block_k : int or None
    transport : str
        The transport the forward chose on this rank.
    dtype : dtype
        The inputs' dtype (of ``out`` and of the gradients).
    """

    comm: Any
    layout: RingLayout
    xp: Any
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any
    window_left: int | None
    window_right: int | None
    scale: float
    impl: str
    block_q: int | None
    block_k: int | None
    transport: str
    dtype: Any


# --------------------------------------------------------------------------- collective checks


def _raise_gathered(errors: list) -> None:
    """Raise on every rank if any rank reported ``(type name, message)``."""
    for r, err in enumerate(errors):
        if err is not None:
            kind, message = err
            cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, ValueError)
            raise cls(f"rank {r}: {message}")


def _local_error(err: Exception) -> tuple[str, str]:
    return (type(err).__name__, str(err))


def _check_stats(stats: Any) -> None:
    """TypeError unless ``stats`` is None or a dict to update (checked before any
    exchange, so that a bad one raises on every rank instead of on one)."""
    if stats is not None and not isinstance(stats, MutableMapping):
        raise TypeError(f"stats must be a dict (updated in place) or None, got {type(stats).__name__}")


def _agree(metas: list, key: str, what: str) -> None:
    """ValueError unless every rank reported the same ``metas[r][key]``."""
    values = [m[key] for m in metas]
    if any(v != values[0] for v in values):
        listing = ", ".join(f"rank {r} has {v}" for r, v in enumerate(values))
        raise ValueError(f"{what} differs across ranks: {listing}; every shard must agree")


# --------------------------------------------------------------------------- forward


def ring_attention_forward(
    q,
    k,
    v,
    /,
    *,
    comm,
    causal=False,
    window=None,
    align=None,
    scale=None,
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
        \mathrm{softmax}(\mathrm{scale}\cdot Q_r K_s^\top)\,V_s,\qquad
        \mathrm{lse}_r = \log\sum_s e^{\mathrm{lse}_{rs}}

    the sums running over the K/V shards ``s`` as they pass around the ring,
    skipping those a causal/window mask hides entirely.

    Dimension legend: B... batch axes, N query heads, K kv heads, T_r / S_r
    this rank's query / key shard lengths (may differ across ranks), H head
    dim, Hv value dim.

    Parameters
    ----------
    q : array, (..., N, T_r, H)
    k : array, (..., K, S_r, H)
    v : array, (..., K, S_r, Hv)
        This rank's contiguous shards. Batch axes, N, K, H, Hv and the dtype
        must agree across ranks; ``S_r >= 1``.
    comm : mpi4py.MPI.Intracomm
        The ranks holding the shards (e.g. ``MPI.COMM_WORLD``).
    causal : bool
        Each query sees keys at or before its global position.
    window : (left, right), ints >= 0 or None
        As in :func:`npattn.attention_forward`, on global positions.
    align : {"top_left", "bottom_right"}, optional
        As in :func:`npattn.attention_forward`, for the totals ``T`` and
        ``S``; required for causal/window when ``T != S``.
    scale : float, optional
        Defaults to ``1 / sqrt(H)``.
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
        ``comm`` is ``MPI.COMM_NULL`` (size 0); shards that disagree across
        ranks (head dims, heads, batch axes, dtype); ``q_start``/``kv_start``
        that do not tile the sequence, or given on some ranks only;
        causal/window with ``T != S`` and no ``align``.

    Examples
    --------
    Run with ``mpiexec -n 4 python script.py``; each rank passes its shard:

    >>> from mpi4py import MPI                                  # doctest: +SKIP
    >>> import numpy as np, npattn.distributed as dist
    >>> comm = MPI.COMM_WORLD                                   # doctest: +SKIP
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 8, 16)) for _ in range(3))  # (B, N, T_r, H)
    >>> out, res = dist.ring_attention_forward(q, k, v, comm=comm, causal=True)  # doctest: +SKIP
    >>> grads = dist.ring_attention_backward(np.ones_like(out), res)            # doctest: +SKIP
    >>> out.shape, res.lse.shape, grads.dk.shape                                # doctest: +SKIP
    ((1, 4, 8, 16), (1, 4, 8), (1, 4, 8, 16))
    """
    MPI = _mpi()
    P = _check_comm(MPI, comm)
    ring = comm.Dup()
    try:
        return _forward(
            MPI,
            ring,
            comm,
            P,
            q,
            k,
            v,
            causal,
            window,
            align,
            scale,
            q_start,
            kv_start,
            impl,
            block_q,
            block_k,
            transport,
            stats,
            xp,
        )
    finally:
        ring.Free()


def _local_meta(
    q, k, v, causal, window, align, scale, q_start, kv_start, impl, block_q, block_k, transport, xp
) -> dict:
    """Check this rank's inputs; describe the shard for the other ranks."""
    xp = resolve_namespace({"q": q, "k": k, "v": v}, xp)
    q_start = check_int("q_start", q_start, minimum=0, allow_none=True)
    kv_start = check_int("kv_start", kv_start, minimum=0, allow_none=True)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if getattr(k, "ndim", 0) >= 3 and k.shape[-2] == 0:
        raise ValueError("this rank's k/v shard holds no key (S_r = 0); every shard needs at least one key")
    # The local pair checks shapes, dtypes and options (align given: T_r != S_r is fine here).
    spec = make_spec(
        q,
        k,
        v,
        causal=causal,
        window=window,
        align=align or "top_left",
        scale=scale,
        impl=impl,
        block_q=block_q,
        block_k=block_k,
        xp=xp,
    )
    return {
        "batch_shape": spec.batch_shape,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "value_dim": spec.value_dim,
        "dtype": dtype_name(spec.dtype),
        "T": spec.q_len,
        "S": spec.kv_len,
        "q_start": q_start,
        "kv_start": kv_start,
        "window": (spec.window_left, spec.window_right),
        "align": align,
        "scale": None if scale is None else float(scale),
        "error": None,
    }


def _gather_layout(ring: Any, meta: dict, align: str | None) -> RingLayout:
    """Allgather every rank's shard description once; check that the shards
    fit together; return the layout (identical on every rank, or every rank
    raises the same error)."""
    metas = ring.allgather(meta)
    _raise_gathered([m["error"] for m in metas])
    _agree(metas, "head_dim", "q/k head dim H (axis -1)")
    _agree(metas, "value_dim", "v head dim Hv (axis -1)")
    _agree(metas, "num_heads", "the number of query heads N (axis -3 of q)")
    _agree(metas, "num_kv_heads", "the number of key/value heads K (axis -3 of k and v)")
    _agree(metas, "batch_shape", "the batch axes (q.shape[:-3])")
    _agree(metas, "dtype", "the dtype of q, k and v")
    _agree(metas, "window", "causal/window")
    _agree(metas, "align", "align")
    _agree(metas, "scale", "scale")
    q_lengths = tuple(m["T"] for m in metas)
    kv_lengths = tuple(m["S"] for m in metas)
    q_starts = _starts("q_start", [m["q_start"] for m in metas], q_lengths)
    kv_starts = _starts("kv_start", [m["kv_start"] for m in metas], kv_lengths)
    T, S = sum(q_lengths), sum(kv_lengths)
    positional = metas[0]["window"] != (None, None)
    if positional and align is None and T != S:
        raise ValueError(
            f"causal/window with T={T} queries != S={S} keys over all ranks needs an explicit alignment "
            "to know the queries' global positions: align='top_left' (query i at position i) or "
            "align='bottom_right' (query i at position i + S - T)"
        )
    q_offset = S - T if positional and align == "bottom_right" else 0
    return RingLayout(ring.Get_rank(), ring.Get_size(), q_lengths, kv_lengths, q_starts, kv_starts, q_offset)


def _forward(
    MPI,
    ring,
    comm,
    P,
    q,
    k,
    v,
    causal,
    window,
    align,
    scale,
    q_start,
    kv_start,
    impl,
    block_q,
    block_k,
    transport,
    stats,
    xp,
):
    try:
        _check_stats(stats)
        meta = _local_meta(
            q, k, v, causal, window, align, scale, q_start, kv_start, impl, block_q, block_k, transport, xp
        )
    except (TypeError, ValueError) as err:
        meta = {"error": _local_error(err)}
    layout = _gather_layout(ring, meta, align)
    left, right = meta["window"]
    xp = resolve_namespace({"q": q, "k": k, "v": v}, xp)
    device = array_device(q)
    dtype = q.dtype
    cdtype = compute_dtype(xp, dtype)
    scale = 1.0 / math.sqrt(meta["head_dim"]) if scale is None else float(scale)
    qc, kc, vc = (xp.astype(a, cdtype, copy=False) for a in (q, k, v))
    r = layout.rank
    bs, N, Hv = tuple(q.shape[:-3]), q.shape[-3], v.shape[-1]
    K, H = k.shape[-3], k.shape[-1]
    wire = _Transport(MPI, ring, xp, device, cdtype, transport, kc)

    out = xp.zeros(bs + (N, layout.q_lengths[r], Hv), dtype=cdtype, device=device)  # (..., N, T_r, Hv)
    lse = xp.full(bs + (N, layout.q_lengths[r]), -xp.inf, dtype=cdtype, device=device)  # (..., N, T_r)
    k_s, v_s = (wire.contiguous(kc), wire.contiguous(vc)) if P > 1 else (kc, vc)
    computed = 0
    for t in range(P):
        s = (r - t) % P  # the rank whose K/V shard is here
        pending = None
        if t < P - 1:
            S_next = layout.kv_lengths[(s - 1) % P]
            pending = wire.exchange([k_s, v_s], [bs + (K, S_next, H), bs + (K, S_next, Hv)])
        pair = _pair_options(layout, left, right, r, s)
        if pair is not None:
            pair = _materialize(xp, device, layout, r, s, pair)
            _, res = attention_forward(
                qc, k_s, v_s, scale=scale, impl=impl, block_q=block_q, block_k=block_k, xp=xp, **pair
            )
            out, lse, _ = merge_partials([out, res.out], [lse, res.lse], xp=xp)  # (..., N, T_r, Hv), (..., N, T_r)
            computed += 1
        if pending is not None:
            k_s, v_s = pending.wait()
    if stats is not None:
        stats.update(
            transport=wire.mode,
            steps=P,
            computed=computed,
            skipped=P - computed,
            bytes_sent=wire.bytes_sent,
            bytes_received=wire.bytes_received,
        )
    residuals = RingResiduals(
        comm, layout, xp, qc, kc, vc, out, lse, left, right, scale, impl, block_q, block_k, wire.mode, dtype
    )
    return xp.astype(out, dtype, copy=False), residuals


def _materialize(xp: Any, device: Any, layout: RingLayout, r: int, s: int, pair: dict) -> dict:
    """Turn a ``{"mask": (c_left, c_right)}`` description into the bool array."""
    if "mask" not in pair:
        return pair
    return {"mask": _pair_mask(xp, device, layout.q_lengths[r], layout.kv_lengths[s], *pair["mask"])}


# --------------------------------------------------------------------------- backward


def ring_attention_backward(dout, residuals, /, *, dlse=None, stats=None) -> AttentionGrads:
    r"""Gradients of :func:`ring_attention_forward` for this rank's shards.
    Collective: every rank of the forward's communicator calls it.

    With the global ``O_r`` and ``lse_r`` of this rank's rows,
    ``D_r = rowsum(dO_r * O_r) - dlse_r`` and, for every K/V shard ``s`` the
    forward did not skip, ``P_rs = exp(scale * Q_r K_s^T - lse_r)``:

    .. math::

        dS_{rs} = P_{rs} \circ (dO_r V_s^\top - D_r),\quad
        dQ_r = \mathrm{scale}\sum_s dS_{rs} K_s,\quad
        dK_s = \mathrm{scale}\sum_r dS_{rs}^\top Q_r,\quad
        dV_s = \sum_r P_{rs}^\top dO_r

    ``dK_s`` and ``dV_s`` accumulate while they travel around the ring with
    ``K_s`` and ``V_s``; one last hop brings them to the rank that owns ``s``.

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
        ``(dq, dk, dv, None)``: ``dq (..., N, T_r, H)``, ``dk (..., K, S_r, H)``,
        ``dv (..., K, S_r, Hv)`` for this rank's shards, in the inputs' dtype.

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
    MPI = _mpi()
    P = _check_comm(MPI, residuals.comm)
    ring = residuals.comm.Dup()
    try:
        return _backward(MPI, ring, P, dout, residuals, dlse, stats)
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


def _backward(MPI, ring, P, dout, res: RingResiduals, dlse, stats) -> AttentionGrads:
    try:
        _check_stats(stats)
        dout_c, dlse_c = _check_cotangents(res, dout, dlse)
        error = None
    except (TypeError, ValueError) as err:
        error = _local_error(err)
    _raise_gathered(ring.allgather(error))
    xp, layout = res.xp, res.layout
    device = array_device(res.q)
    cdtype = res.out.dtype
    r = layout.rank
    bs, _N, H = tuple(res.q.shape[:-3]), res.q.shape[-3], res.q.shape[-1]
    K, Hv = res.k.shape[-3], res.v.shape[-1]
    wire = _Transport(MPI, ring, xp, device, cdtype, res.transport, res.k)

    dq = xp.zeros(tuple(res.q.shape), dtype=cdtype, device=device)  # (..., N, T_r, H)
    k_s, v_s = (wire.contiguous(res.k), wire.contiguous(res.v)) if P > 1 else (res.k, res.v)
    travelling = None  # the exchange bringing shard s's dK/dV accumulators from the left
    computed = 0
    for t in range(P):
        s = (r - t) % P  # the rank whose K/V shard (and dK/dV accumulators) is here
        S_s, S_next = layout.kv_lengths[s], layout.kv_lengths[(s - 1) % P]
        pending = None
        if t < P - 1:
            pending = wire.exchange([k_s, v_s], [bs + (K, S_next, H), bs + (K, S_next, Hv)])
        pair = _pair_options(layout, res.window_left, res.window_right, r, s)
        dk_rs = dv_rs = None
        if pair is not None:
            pair = _materialize(xp, device, layout, r, s, pair)
            options = dict(scale=res.scale, impl=res.impl, block_q=res.block_q, block_k=res.block_k, xp=xp, **pair)
            spec = choose_impl(make_spec(res.q, k_s, v_s, **options))  # the path the forward took for this pair
            if spec.impl == "dense":  # one tile: the dense computation, from the global out and lse
                spec = dataclasses.replace(spec, block_q=max(spec.q_len, 1), block_k=spec.kv_len)
            spec = dataclasses.replace(spec, impl="chunked")
            pair_res = ChunkedResiduals(spec, res.q, k_s, v_s, res.out, res.lse, chunked_kernel(spec))
            g = attention_backward(dout_c, pair_res, dlse=dlse_c)
            dq = dq + g.dq  # (..., N, T_r, H)
            dk_rs, dv_rs = g.dk, g.dv  # (..., K, S_s, H), (..., K, S_s, Hv)
            computed += 1
        if travelling is None:  # t = 0: shard s = r starts its trip here
            dk_s = xp.zeros(bs + (K, S_s, H), dtype=cdtype, device=device) if dk_rs is None else dk_rs
            dv_s = xp.zeros(bs + (K, S_s, Hv), dtype=cdtype, device=device) if dv_rs is None else dv_rs
        else:
            dk_s, dv_s = travelling.wait()  # (..., K, S_s, H), (..., K, S_s, Hv): from ranks s .. r-1
            if dk_rs is not None:
                dk_s, dv_s = dk_s + dk_rs, dv_s + dv_rs
        if P > 1:  # pass the accumulators on with their shard; after step P - 1 this hop brings them home
            S_acc = S_next if t < P - 1 else layout.kv_lengths[r]
            travelling = wire.exchange([dk_s, dv_s], [bs + (K, S_acc, H), bs + (K, S_acc, Hv)], tag=2)
        if pending is not None:
            k_s, v_s = pending.wait()
    if travelling is not None:
        dk_s, dv_s = travelling.wait()  # this rank's own shard, home: (..., K, S_r, H), (..., K, S_r, Hv)
    if stats is not None:
        stats.update(
            transport=wire.mode,
            steps=P,
            computed=computed,
            skipped=P - computed,
            bytes_sent=wire.bytes_sent,
            bytes_received=wire.bytes_received,
        )
    dq, dk_s, dv_s = (xp.astype(g, res.dtype, copy=False) for g in (dq, dk_s, dv_s))
    return AttentionGrads(dq, dk_s, dv_s, None)
