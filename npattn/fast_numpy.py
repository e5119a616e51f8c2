r"""NumPy fast path of the chunked algorithm, for the CPU.

The same online-softmax forward and FlashAttention-2 backward as
:mod:`npattn.chunked`, with the same tiles, the same masks (built by
:mod:`npattn.masking`), the same dropout mask and the same fully-masked-row
rules, rearranged for NumPy on a multi-core CPU:

- **independent work items on a thread pool.** The forward runs one item per
  (batch element, kv head, query tile); the backward one per (batch element,
  kv head), each owning its slices of ``dQ``, ``dK`` and ``dV``. Every item
  accumulates in a fixed order, so results are bit-identical whatever the
  number of threads.
- **single-threaded BLAS inside the items** (threadpoolctl), so that BLAS
  threads do not oversubscribe the pool's.
- **in-place float32/float64 ufuncs** (``out=``) on one preallocated score
  tile per item, and the G query heads that share a kv head stacked into one
  ``(G * tq, H)`` matrix so each tile is one large GEMM.
- **tile skipping** exactly as the generic path (:func:`npattn.masking.classify_tile`).

With an additive bias the backward's items would share ``dbias`` entries
wherever the bias broadcasts, so they then run one after another, in the same
fixed order, on the calling thread (BLAS keeps its own threads there).

This module is chosen by namespace (``supports``) and is optional: setting
the environment variable ``NPATTN_FAST_NUMPY=0`` sends NumPy inputs through
the generic Array API path, which the tests compare this one against.
``NPATTN_NUM_THREADS`` sets the pool size (default: the CPUs available).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import array_api_compat
import numpy as np
from threadpoolctl import threadpool_limits

from . import dropout as _dropout
from .masking import ALL, NONE, bias_tile, classify_tile, visible_tile
from .namespace import sum_to_shape
from .options import AttentionSpec

__all__ = ["supports", "forward", "backward", "num_threads"]

_POOL: ThreadPoolExecutor | None = None

#: Default ``(block_q, block_k)`` per pass when the caller gives none. The
#: backward recomputes ``P = exp(S - lse)``, which does not depend on the
#: forward's tiles, so each pass takes the sizes that run fastest for it.
FORWARD_BLOCKS = (512, 512)
BACKWARD_BLOCKS = (512, 512)


def _blocks(spec: AttentionSpec, defaults: tuple[int, int]) -> tuple[int, int]:
    """``(block_q, block_k)``: the caller's, else this pass's defaults,
    clipped to the sequence lengths (at least 1)."""
    block_q = spec.block_q or defaults[0]
    block_k = spec.block_k or defaults[1]
    return max(1, min(block_q, spec.q_len)), max(1, min(block_k, spec.kv_len))


def supports(spec: AttentionSpec) -> bool:
    """Whether this fast path handles ``spec``: NumPy inputs computing in
    float32 or float64, unless disabled with ``NPATTN_FAST_NUMPY=0``."""
    return (
        os.environ.get("NPATTN_FAST_NUMPY", "1") != "0"
        and array_api_compat.is_numpy_namespace(spec.xp)
        and spec.compute_dtype in (np.float32, np.float64)
    )


def num_threads() -> int:
    """Pool size: ``NPATTN_NUM_THREADS`` or the number of usable CPUs."""
    env = os.environ.get("NPATTN_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _run(items, work, *, parallel: bool = True) -> None:
    """Run ``work(item)`` for every item: on the pool with single-threaded
    BLAS when there is more than one item and thread, else in order here."""
    global _POOL
    threads = num_threads()
    if not parallel or threads == 1 or len(items) < 2:
        for item in items:
            work(item)
        return
    if _POOL is None or _POOL._max_workers != threads:
        _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="npattn")
    with threadpool_limits(limits=1, user_api="blas"):
        for future in [_POOL.submit(work, item) for item in items]:
            future.result()  # re-raises a worker's exception here


def _tiles(length: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, length)) for start in range(0, length, block)]


class _ItemView:
    """Selects one (batch element, kv-head group) from full-rank tiles.

    Tiles from :mod:`npattn.masking` and :mod:`npattn.dropout` have shape
    ``(..., N|1, tq|1, tk|1)`` (or rank 2 when built from indices alone); this
    picks batch element ``b`` (flat index) and query heads ``[n0, n1)`` and
    returns them as a ``(G * tq, tk)`` matrix matching the stacked scores.
    """

    def __init__(self, spec: AttentionSpec, b: int, kv_head: int):
        G = spec.group_size
        self.flat_batch = b
        self.batch_index = np.unravel_index(b, spec.batch_shape) if spec.batch_shape else ()
        self.heads = slice(kv_head * G, (kv_head + 1) * G)
        self.G = G

    def select(self, tile: Any, tq: int, tk: int) -> Any:
        if tile.ndim >= 3:
            lead = tile.ndim - 3
            batch = tuple(0 if tile.shape[a] == 1 else int(self.batch_index[a]) for a in range(lead))
            heads = slice(None) if tile.shape[-3] == 1 else self.heads
            tile = tile[batch + (heads,)]  # (G|1, tq|1, tk|1)
        tile = np.broadcast_to(tile, (self.G, tq, tk))  # (G, tq, tk)
        return tile.reshape(self.G * tq, tk)  # (G*tq, tk)


def _augmented_transposed(x3: Any, dtype: Any) -> Any:
    """``[x^T; 1]``: ``(B, K, L, D) -> (B, K, D + 1, L)``, contiguous, with a
    row of ones appended, so that ``[a, c] @ [x^T; 1] = a x^T + c`` adds a
    per-row constant ``c`` inside the matrix product."""
    Bf, K, L, D = x3.shape
    xt = np.ones((Bf, K, D + 1, L), dtype=dtype)
    xt[:, :, :D, :] = np.swapaxes(x3, -1, -2)  # (B, K, D, L)
    return xt


def _augmented_rows(x: Any, column: Any, scale: Any, dtype: Any) -> Any:
    """``[scale * x, column]``: ``(G, tq, D)`` and ``(G*tq,)`` -> ``(G*tq, D + 1)``."""
    G, tq, D = x.shape
    xa = np.empty((G * tq, D + 1), dtype=dtype)
    np.multiply(x.reshape(G * tq, D), scale, out=xa[:, :D])  # (G*tq, D)
    xa[:, D] = column
    return xa


def _mask_tile(spec, view, s, q0, q1, k0, k1, kind):
    """Add the bias tile to the scores ``s (G*tq, tk)`` and set hidden entries to -inf."""
    tq, tk = q1 - q0, k1 - k0
    bias = bias_tile(spec, q0, q1, k0, k1)
    if bias is not None:
        s += view.select(bias, tq, tk)
    if kind != ALL:
        visible = visible_tile(spec, q0, q1, k0, k1)
        if visible is not None:
            np.copyto(s, -np.inf, where=~view.select(visible, tq, tk))


def _dropout_scale(spec, view, q0, q1, k0, k1):
    """``keep_ij / (1 - p)`` as ``(G*tq, tk)``, or None without dropout."""
    if spec.dropout_p == 0:
        return None
    heads = (view.heads.start, view.heads.stop)
    keep = _dropout.keep_tile(spec, q0, q1, k0, k1, heads=heads, batch=view.flat_batch)  # (G, tq, tk)
    return keep.reshape(view.G * (q1 - q0), k1 - k0).astype(spec.compute_dtype) * (1.0 / (1.0 - spec.dropout_p))


#: The forward rescales a row only when its running maximum grows by more
#: than this (in nats): ``exp`` values then stay below ``e**8``, far from
#: float32's range, and most tiles need no rescaling pass at all.
RESCALE_THRESHOLD = 8.0


def forward(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Online-softmax forward; same contract as :func:`npattn.chunked.chunked_forward`.

    Each row keeps a reference maximum ``m`` (its running maximum, updated
    lazily) inside the query tile as an extra column, so one matrix product
    gives the shifted scores directly::

        [scale Q_i, -m] @ [K_j^T; 1] = scale Q_i K_j^T - m

    and after the bias and the mask, with ``t = rowmax``: rows whose ``t``
    exceeds :data:`RESCALE_THRESHOLD` (or that saw nothing yet) move ``m`` up
    by ``t`` and rescale ``l`` and ``acc`` by ``exp(-t)`` (FlashAttention-2's
    rescale, done only when needed); then ``P~ = exp(.)``, ``l += rowsum(P~)``
    and ``acc += P~ V_j``. At the end ``O = acc / l`` and ``lse = m + log l``.
    """
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    q3 = np.reshape(q, (Bf, N, T, H))  # (B, N, T, H), B = flattened batch axes
    v3 = np.reshape(v, (Bf, K, S, Hv))  # (B, K, S, Hv)
    kTa = _augmented_transposed(np.reshape(k, (Bf, K, S, H)), dtype)  # (B, K, H+1, S)
    out = np.zeros((Bf, N, T, Hv), dtype=dtype)
    lse = np.full((Bf, N, T), -np.inf, dtype=dtype)
    block_q, block_k = _blocks(spec, FORWARD_BLOCKS)
    q_tiles, k_tiles = _tiles(T, block_q), _tiles(S, block_k)
    scale = dtype.type(spec.scale)

    def work(item):
        b, kv, q0, q1 = item
        view = _ItemView(spec, b, kv)
        tq, rows = q1 - q0, G * (q1 - q0)
        m = np.zeros(rows, dtype=dtype)  # reference row maximum
        qa = _augmented_rows(q3[b, view.heads, q0:q1], -m, scale, dtype)  # (G*tq, H+1) = [scale Q_i, -m]
        unset = np.ones(rows, dtype=bool)  # rows that have seen no visible key yet
        s_buf = np.empty((rows, block_k), dtype=dtype)  # one score tile, reused
        pv = np.empty((rows, Hv), dtype=dtype)
        l = np.zeros(rows, dtype=dtype)  # running row sum
        acc = np.zeros((rows, Hv), dtype=dtype)  # unnormalized output
        for k0, k1 in k_tiles:
            kind = classify_tile(spec, q0, q1, k0, k1)
            if kind == NONE:
                continue
            s = s_buf[:, : k1 - k0]
            np.matmul(qa, kTa[b, kv, :, k0:k1], out=s)  # (G*tq, H+1) @ (H+1, tk) -> scale Q K^T - m
            _mask_tile(spec, view, s, q0, q1, k0, k1, kind)
            t = s.max(axis=1)  # (G*tq,) growth of the row maximum
            grow = (t > RESCALE_THRESHOLD) | (unset & (t > -np.inf))
            if grow.any():
                shift = np.where(grow, t, 0).astype(dtype, copy=False)  # (G*tq,)
                s -= shift[:, None]
                alpha = np.exp(-shift)  # rescales what came before
                l *= alpha
                acc *= alpha[:, None]
                m += shift
                qa[:, H] = -m
                unset &= ~grow
            np.exp(s, out=s)  # P~_ij
            l += s.sum(axis=1)
            drop = _dropout_scale(spec, view, q0, q1, k0, k1)
            if drop is not None:
                s *= drop
            np.matmul(s, v3[b, kv, k0:k1], out=pv)  # (G*tq, tk) @ (tk, Hv) -> (G*tq, Hv)
            acc += pv
        empty = l == 0
        l[empty] = 1
        acc /= l[:, None]
        out[b, view.heads, q0:q1] = acc.reshape(G, tq, Hv)  # (G, tq, Hv)
        row_lse = m + np.log(l)
        row_lse[empty] = -np.inf
        lse[b, view.heads, q0:q1] = row_lse.reshape(G, tq)

    _run([(b, kv, q0, q1) for b in range(Bf) for kv in range(K) for q0, q1 in q_tiles], work)
    return out.reshape(spec.batch_shape + (N, T, Hv)), lse.reshape(spec.batch_shape + (N, T))


def backward(spec: AttentionSpec, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
             dlse: Any | None) -> tuple[Any, Any, Any, Any | None]:
    """FlashAttention-2 backward; same contract as :func:`npattn.chunked.chunked_backward`.

    The two per-row subtractions ride inside matrix products, as in the
    forward::

        P_ij          = exp([scale Q_i, -lse_i] @ [K_j^T; 1])
        dP_ij - D_i   = [dO_i, -D_i] @ [V_j^T; 1]          (without dropout)

    then ``dS = P * (dP - D)``, ``dV_j += Pd^T dO_i``, ``dQ_i += dS K_j``,
    ``dK_j += dS^T (scale Q_i)``. With dropout, ``dP`` is scaled by
    ``keep / (1 - p)`` before ``D`` is subtracted.
    """
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    q3 = np.reshape(q, (Bf, N, T, H))  # (B, N, T, H)
    k3 = np.reshape(k, (Bf, K, S, H))  # (B, K, S, H)
    kTa = _augmented_transposed(k3, dtype)  # (B, K, H+1, S)
    vTa = _augmented_transposed(np.reshape(v, (Bf, K, S, Hv)), dtype)  # (B, K, Hv+1, S)
    do3 = np.reshape(dout, (Bf, N, T, Hv))  # (B, N, T, Hv)
    D = np.sum(do3 * np.reshape(out, (Bf, N, T, Hv)), axis=-1)  # (B, N, T)
    if dlse is not None:
        D -= np.reshape(dlse, (Bf, N, T))
    lse3 = np.reshape(lse, (Bf, N, T))
    lse3 = np.where(lse3 == -np.inf, 0, lse3).astype(dtype, copy=False)  # masked rows: S = -inf gives P = 0
    dq = np.zeros((Bf, N, T, H), dtype=dtype)
    dk = np.zeros((Bf, K, S, H), dtype=dtype)
    dv = np.zeros((Bf, K, S, Hv), dtype=dtype)
    dbias = None if spec.bias is None else np.zeros(spec.bias.shape, dtype=dtype)  # full-rank view shape
    block_q, block_k = _blocks(spec, BACKWARD_BLOCKS)
    q_tiles, k_tiles = _tiles(T, block_q), _tiles(S, block_k)
    scale = dtype.type(spec.scale)
    one = dtype.type(1)

    def work(item):
        b, kv = item
        view = _ItemView(spec, b, kv)
        dk_item, dv_item = dk[b, kv], dv[b, kv]  # (S, H), (S, Hv): owned by this item
        s_buf = np.empty((G * block_q, block_k), dtype=dtype)  # scores, then P, of one tile
        dp_buf = np.empty_like(s_buf)  # dP - D, then dS, of one tile
        dk_tmp = np.empty((block_k, H), dtype=dtype)
        dv_tmp = np.empty((block_k, Hv), dtype=dtype)
        for q0, q1 in q_tiles:
            tq, rows = q1 - q0, G * (q1 - q0)
            heads = view.heads
            qa = _augmented_rows(q3[b, heads, q0:q1], -lse3[b, heads, q0:q1].reshape(rows), scale, dtype)
            D_i = D[b, heads, q0:q1].reshape(rows)  # (G*tq,)
            doa = _augmented_rows(do3[b, heads, q0:q1], 0 if spec.dropout_p else -D_i, one, dtype)
            qs_i, do_i = qa[:, :H], doa[:, :Hv]  # (G*tq, H), (G*tq, Hv) views
            dq_i = np.zeros((rows, H), dtype=dtype)
            for k0, k1 in k_tiles:
                kind = classify_tile(spec, q0, q1, k0, k1)
                if kind == NONE:
                    continue
                tk = k1 - k0
                p = s_buf[:rows, :tk]
                np.matmul(qa, kTa[b, kv, :, k0:k1], out=p)  # (G*tq, H+1) @ (H+1, tk) -> S_ij - lse_i
                _mask_tile(spec, view, p, q0, q1, k0, k1, kind)
                np.exp(p, out=p)  # P_ij
                drop = _dropout_scale(spec, view, q0, q1, k0, k1)
                p_dropped = p if drop is None else p * drop
                np.matmul(p_dropped.T, do_i, out=dv_tmp[:tk])  # (tk, G*tq) @ (G*tq, Hv) -> (tk, Hv)
                dv_item[k0:k1] += dv_tmp[:tk]
                ds = dp_buf[:rows, :tk]
                np.matmul(doa, vTa[b, kv, :, k0:k1], out=ds)  # (G*tq, Hv+1) @ (Hv+1, tk) -> dP (- D)
                if drop is not None:
                    ds *= drop
                    ds -= D_i[:, None]
                ds *= p  # dS_ij = P_ij * (dP_ij - D_i)
                dq_i += ds @ k3[b, kv, k0:k1]  # (G*tq, tk) @ (tk, H) -> (G*tq, H)
                np.matmul(ds.T, qs_i, out=dk_tmp[:tk])  # (tk, G*tq) @ (G*tq, H) -> (tk, H)
                dk_item[k0:k1] += dk_tmp[:tk]
                if dbias is not None:
                    _add_dbias(spec, view, dbias, ds, q0, q1, k0, k1)
            dq_i *= scale
            dq[b, heads, q0:q1] = dq_i.reshape(G, tq, H)  # (G, tq, H)

    _run([(b, kv) for b in range(Bf) for kv in range(K)], work, parallel=dbias is None)
    bs = spec.batch_shape
    grads = dq.reshape(bs + (N, T, H)), dk.reshape(bs + (K, S, H)), dv.reshape(bs + (K, S, Hv))
    return (*grads, None if dbias is None else dbias.reshape(spec.bias_shape))


def _add_dbias(spec, view, dbias, ds, q0, q1, k0, k1):
    """Add ``dS_ij (G*tq, tk)`` into the full-rank ``dbias`` over this item's
    batch element, heads and tile, summing over the bias's broadcast axes."""
    tq, tk = q1 - q0, k1 - k0
    lead = dbias.ndim - 3
    batch = tuple(0 if dbias.shape[a] == 1 else int(view.batch_index[a]) for a in range(lead))
    heads = slice(None) if dbias.shape[-3] == 1 else view.heads
    rows = slice(None) if dbias.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if dbias.shape[-1] == 1 else slice(k0, k1)
    target = dbias[batch + (heads, rows, cols)]  # (G|1, tq|1, tk|1)
    target += sum_to_shape(np, ds.reshape(view.G, tq, tk), target.shape)
