r"""NumPy fast path of the chunked algorithm, for the CPU.

The same online-softmax forward and FlashAttention-2 backward as
:mod:`npattn.chunked`, with the same masks (built by :mod:`npattn.masking`),
the same dropout mask and the same fully-masked-row rules, rearranged for
NumPy on a multi-core CPU:

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
- **per-row shifts inside the GEMMs.** ``[scale Q, -c] @ [K^T; 1]`` is
  ``scale Q K^T - c`` for a per-row constant ``c`` (the running maximum in the
  forward, ``lse`` and ``D`` in the backward), saving a pass over each tile.
  This rounds the shift with the product, which is harmless while scores are
  moderate; when a bias is given or the scores could reach
  :func:`_fused_shift_limit`, the shifts are applied after the product as in
  the generic path, so the backward recomputes exactly the forward's scores.
- **tile skipping** exactly as the generic path (:func:`npattn.masking.classify_tile`).

With an additive bias the backward's items would share ``dbias`` entries
wherever the bias broadcasts, so they then run one after another, in the same
fixed order, on the calling thread (BLAS keeps its own threads there).

This module is chosen by namespace (``supports``) when the forward runs, and
the residuals remember that choice. It is optional: setting the environment
variable ``NPATTN_FAST_NUMPY=0`` sends NumPy inputs through the generic Array
API path, which the tests compare this one against. ``NPATTN_NUM_THREADS``
(else ``OMP_NUM_THREADS``) sets the pool size (default: the CPUs available).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import array_api_compat
import numpy as np
from threadpoolctl import ThreadpoolController

from . import dropout as _dropout
from .chunked import tile_ranges
from .masking import ALL, NONE, bias_tile, classify_tile, visible_tile
from .namespace import sum_to_shape
from .options import AttentionSpec

__all__ = ["supports", "forward", "backward", "num_threads", "FAST_BLOCKS"]

#: Default ``(block_q, block_k)`` of both passes when the caller gives none:
#: the fastest measured on a 2-core machine at T=S=4096, H=64 (see
#: ``benchmarks/bench_cpu_levers.py``), against 128x128 for the generic path.
FAST_BLOCKS = (512, 512)

#: The forward rescales a row only when its running maximum grows by more
#: than this (in nats): ``exp`` values then stay below ``e**16`` (9e6), far
#: from the float32 range even summed over 10**9 keys, and most tiles need no
#: rescaling pass at all.
RESCALE_THRESHOLD = 16.0


# --- the thread pool and the BLAS limit ------------------------------------------------

_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_BLAS_USERS = 0  # calls currently inside _single_threaded_blas
_BLAS_LIMITER: Any = None
_CONTROLLER: ThreadpoolController | None = None


def _forget_pool_in_child() -> None:
    """A forked child inherits the pool object but not its threads: start afresh."""
    global _LOCK, _POOL, _POOL_SIZE, _BLAS_USERS, _BLAS_LIMITER
    _LOCK = threading.Lock()
    _POOL, _POOL_SIZE, _BLAS_USERS, _BLAS_LIMITER = None, 0, 0, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def num_threads() -> int:
    """Pool size: ``NPATTN_NUM_THREADS``, else ``OMP_NUM_THREADS`` (the usual
    way to cap threads per process, as under ``mpiexec``), else the number of
    usable CPUs."""
    for name in ("NPATTN_NUM_THREADS", "OMP_NUM_THREADS"):
        env = os.environ.get(name, "").strip()
        if env:
            try:
                return max(1, int(env.split(",")[0]))
            except ValueError:
                raise ValueError(f"{name} must be a positive integer, got {env!r}") from None
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _pool(size: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _LOCK:
        if _POOL is None or _POOL_SIZE != size:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = ThreadPoolExecutor(max_workers=size, thread_name_prefix="npattn"), size
        return _POOL


@contextmanager
def _single_threaded_blas():
    """Limit BLAS to one thread while any call is running items on the pool.

    The limit is process-wide, so concurrent calls share it: the first one in
    sets it and the last one out restores what was there before.
    """
    global _BLAS_USERS, _BLAS_LIMITER, _CONTROLLER
    with _LOCK:
        if _BLAS_USERS == 0:
            _CONTROLLER = _CONTROLLER or ThreadpoolController()
            _BLAS_LIMITER = _CONTROLLER.limit(limits=1, user_api="blas")
        _BLAS_USERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _BLAS_USERS -= 1
            if _BLAS_USERS == 0:
                _BLAS_LIMITER.restore_original_limits()
                _BLAS_LIMITER = None


def _run(items, work, *, parallel: bool = True) -> None:
    """Run ``work(item)`` for every item: on the pool with single-threaded
    BLAS when there is more than one item and thread, else in order here.
    If an item raises, the rest are cancelled or awaited, then it re-raises."""
    threads = num_threads()
    if not parallel or threads == 1 or len(items) < 2:
        for item in items:
            work(item)
        return
    pool = _pool(threads)
    with _single_threaded_blas():
        futures = [pool.submit(work, item) for item in items]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        wait(pending)
    for future in futures:
        if not future.cancelled() and future.exception() is not None:
            raise future.exception()


# --- shared pieces ----------------------------------------------------------------------


def supports(spec: AttentionSpec) -> bool:
    """Whether this fast path handles ``spec``: NumPy inputs computing in
    float32 or float64, unless disabled with ``NPATTN_FAST_NUMPY=0``."""
    return (
        os.environ.get("NPATTN_FAST_NUMPY", "1") != "0"
        and array_api_compat.is_numpy_namespace(spec.xp)
        and spec.compute_dtype in (np.float32, np.float64)
    )


def _blocks(spec: AttentionSpec) -> tuple[int, int]:
    """``(block_q, block_k)``: the caller's, else :data:`FAST_BLOCKS`,
    clipped to the sequence lengths (at least 1)."""
    block_q = spec.block_q or FAST_BLOCKS[0]
    block_k = spec.block_k or FAST_BLOCKS[1]
    return max(1, min(block_q, spec.q_len)), max(1, min(block_k, spec.kv_len))


def _fused_shift_limit(dtype: Any) -> float:
    """Largest score magnitude for which a shift may ride inside the GEMM:
    ``2**(mantissa bits - 12)`` (4096 in float32), where one rounding of the
    product is within 2**-12 of the score's own rounding."""
    return 2.0 ** (np.finfo(dtype).nmant + 1 - 12)


def _fuse_shifts(spec: AttentionSpec, q3: Any, k3: Any) -> bool:
    """Whether the per-row shifts may be fused into the GEMMs: no bias, and
    ``scale * max|q_i| * max|k_j|`` (a bound on every score) below
    :func:`_fused_shift_limit`. Computed from the inputs alone, so the
    forward and the backward decide alike."""
    if spec.bias is not None:
        return False
    if q3.size == 0 or k3.size == 0:
        return True
    bound = abs(spec.scale) * float(np.sqrt(np.max(np.sum(q3 * q3, axis=-1)))) \
        * float(np.sqrt(np.max(np.sum(k3 * k3, axis=-1))))
    return bound < _fused_shift_limit(spec.compute_dtype)


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


class _Item:
    """One (batch element, kv head) of the problem: its query heads, and the
    mask, bias and dropout tiles restricted to them as ``(G*tq, tk)`` matrices
    matching the stacked scores."""

    def __init__(self, spec: AttentionSpec, b: int, kv_head: int):
        self.spec, self.b, self.kv, self.G = spec, b, kv_head, spec.group_size
        self.heads = (kv_head * self.G, (kv_head + 1) * self.G)
        self.head_slice = slice(*self.heads)

    def _as_rows(self, tile: Any, tq: int, tk: int) -> Any:
        """``(G|1, tq|1, tk|1)`` or ``(tq|1, tk|1)`` -> ``(G*tq, tk)``."""
        return np.broadcast_to(tile, (self.G, tq, tk)).reshape(self.G * tq, tk)  # (G*tq, tk)

    def mask_scores(self, s: Any, q0: int, q1: int, k0: int, k1: int, kind: str) -> None:
        """Add the bias tile to the scores ``s (G*tq, tk)`` and set hidden entries to -inf."""
        tq, tk = q1 - q0, k1 - k0
        bias = bias_tile(self.spec, q0, q1, k0, k1, batch=self.b, heads=self.heads)
        if bias is not None:
            s += self._as_rows(bias, tq, tk)
        if kind != ALL:
            visible = visible_tile(self.spec, q0, q1, k0, k1, batch=self.b, heads=self.heads)
            if visible is not None:
                np.copyto(s, -np.inf, where=~self._as_rows(visible, tq, tk))

    def dropout_scale(self, q0: int, q1: int, k0: int, k1: int) -> Any | None:
        """``keep_ij / (1 - p)`` as ``(G*tq, tk)``, or None without dropout."""
        spec = self.spec
        if spec.dropout_p == 0:
            return None
        keep = _dropout.keep_tile(spec, q0, q1, k0, k1, heads=self.heads, batch=self.b)  # (G, tq, tk)
        scale = spec.compute_dtype.type(1.0 / (1.0 - spec.dropout_p))
        return keep.reshape(self.G * (q1 - q0), k1 - k0).astype(spec.compute_dtype) * scale

    def add_dbias(self, dbias: Any, ds: Any, q0: int, q1: int, k0: int, k1: int) -> None:
        """Add ``dS_ij (G*tq, tk)`` into the full-rank ``dbias`` over this
        item's batch element, heads and tile, summing over broadcast axes."""
        tq, tk = q1 - q0, k1 - k0
        lead = dbias.ndim - 3
        index = np.unravel_index(self.b, self.spec.batch_shape) if self.spec.batch_shape else ()
        batch = tuple(0 if dbias.shape[a] == 1 else int(index[a]) for a in range(lead))
        heads = slice(None) if dbias.shape[-3] == 1 else self.head_slice
        rows = slice(None) if dbias.shape[-2] == 1 else slice(q0, q1)
        cols = slice(None) if dbias.shape[-1] == 1 else slice(k0, k1)
        target = dbias[batch + (heads, rows, cols)]  # (G|1, tq|1, tk|1)
        target += sum_to_shape(np, ds.reshape(self.G, tq, tk), target.shape)


# --- forward ----------------------------------------------------------------------------


def forward(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Online-softmax forward; same contract as :func:`npattn.chunked.chunked_forward`.

    Each row keeps a reference maximum ``m``, updated lazily. Per key tile,
    with the shifted scores ``S_ij - m`` (from one GEMM when fused, see the
    module docstring) and ``t = rowmax``: rows whose ``t`` exceeds
    :data:`RESCALE_THRESHOLD` (or that saw nothing yet) move ``m`` up by
    ``t`` and rescale ``l`` and ``acc`` by ``exp(-t)`` (FlashAttention-2's
    rescale, done only when needed); then ``P~ = exp(.)``,
    ``l += rowsum(P~)`` and ``acc += P~ V_j``. At the end ``O = acc / l`` and
    ``lse = m + log l``.
    """
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    q3 = np.reshape(q, (Bf, N, T, H))  # (B, N, T, H), B = flattened batch axes
    k3 = np.reshape(k, (Bf, K, S, H))  # (B, K, S, H)
    v3 = np.reshape(v, (Bf, K, S, Hv))  # (B, K, S, Hv)
    kTa = _augmented_transposed(k3, dtype)  # (B, K, H+1, S)
    fused = _fuse_shifts(spec, q3, k3)
    k_norms = np.sqrt(np.sum(k3 * k3, axis=-1)) if fused else None  # (B, K, S): |k_j|, for the bound below
    out = np.zeros((Bf, N, T, Hv), dtype=dtype)
    lse = np.full((Bf, N, T), -np.inf, dtype=dtype)
    block_q, block_k = _blocks(spec)
    q_tiles, k_tiles = tile_ranges(T, block_q), tile_ranges(S, block_k)
    scale = dtype.type(spec.scale)
    ones_k = np.ones(block_k, dtype=dtype)

    def work(job):
        b, kv, q0, q1 = job
        item = _Item(spec, b, kv)
        tq, rows = q1 - q0, G * (q1 - q0)
        m = np.zeros(rows, dtype=dtype)  # reference row maximum
        qa = _augmented_rows(q3[b, item.head_slice, q0:q1], 0, scale, dtype)  # (G*tq, H+1) = [scale Q_i, -m]
        unset = np.ones(rows, dtype=bool)  # rows that have seen no visible key yet
        q_norms = np.sqrt(np.sum(qa[:, :H] * qa[:, :H], axis=1)) if fused else None  # (G*tq,) |scale q_i|
        s_buf = np.empty((rows, block_k), dtype=dtype)  # one score tile, reused
        pv = np.empty((rows, Hv), dtype=dtype)
        row_sum = np.empty(rows, dtype=dtype)
        l = np.zeros(rows, dtype=dtype)  # running row sum
        acc = np.zeros((rows, Hv), dtype=dtype)  # unnormalized output
        for k0, k1 in k_tiles:
            kind = classify_tile(spec, q0, q1, k0, k1)
            if kind == NONE:
                continue
            s = s_buf[:, : k1 - k0]
            np.matmul(qa, kTa[b, kv, :, k0:k1], out=s)  # (G*tq, H+1) @ (H+1, tk) -> scale Q K^T [- m]
            item.mask_scores(s, q0, q1, k0, k1, kind)
            # Cauchy-Schwarz: S_ij - m <= |scale q_i| max_j |k_j| - m. When that
            # bound stays under the threshold for every row (fused means no
            # bias), no row can need a rescale and the row-max pass is skipped.
            if fused and rows and not unset.any() and \
                    np.max(q_norms * k_norms[b, kv, k0:k1].max() - m) <= RESCALE_THRESHOLD:
                grow = None
            else:
                # t: the tile's row maximum, relative to m when fused, raw otherwise
                t = s.max(axis=1)  # (G*tq,)
                growth = t if fused else t - m
                grow = (growth > RESCALE_THRESHOLD) | (unset & (t > -np.inf))
            if grow is not None and grow.any():
                m_new = np.where(grow, m + t if fused else t, m).astype(dtype, copy=False)  # (G*tq,)
                alpha = np.exp(np.where(unset, 0, m - m_new)).astype(dtype, copy=False)  # nothing to rescale yet
                l *= alpha
                acc *= alpha[:, None]
                if fused:
                    s -= (m_new - m)[:, None]
                    qa[:, H] = -m_new
                m = m_new
                unset &= ~grow
            if not fused:  # m stays an exact score, so the backward's S - lse matches
                s -= m[:, None]
            np.exp(s, out=s)  # P~_ij
            np.matmul(s, ones_k[: k1 - k0], out=row_sum)  # (G*tq, tk) @ (tk,): a GEMV, 4x faster than s.sum(axis=1)
            l += row_sum
            drop = item.dropout_scale(q0, q1, k0, k1)
            if drop is not None:
                s *= drop
            np.matmul(s, v3[b, kv, k0:k1], out=pv)  # (G*tq, tk) @ (tk, Hv) -> (G*tq, Hv)
            acc += pv
        empty = l == 0
        l[empty] = 1
        acc /= l[:, None]
        out[b, item.head_slice, q0:q1] = acc.reshape(G, tq, Hv)  # (G, tq, Hv)
        row_lse = m + np.log(l)
        row_lse[empty] = -np.inf
        lse[b, item.head_slice, q0:q1] = row_lse.reshape(G, tq)

    _run([(b, kv, q0, q1) for b in range(Bf) for kv in range(K) for q0, q1 in q_tiles], work)
    return out.reshape(spec.batch_shape + (N, T, Hv)), lse.reshape(spec.batch_shape + (N, T))


# --- backward ---------------------------------------------------------------------------


def backward(spec: AttentionSpec, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any,
             dlse: Any | None) -> tuple[Any, Any, Any, Any | None]:
    """FlashAttention-2 backward; same contract as :func:`npattn.chunked.chunked_backward`.

    When fused (see the module docstring), the two per-row subtractions ride
    inside matrix products, as in the forward::

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
    fused = _fuse_shifts(spec, q3, k3)
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
    block_q, block_k = _blocks(spec)
    q_tiles, k_tiles = tile_ranges(T, block_q), tile_ranges(S, block_k)
    scale = dtype.type(spec.scale)
    one = dtype.type(1)
    fold_D = fused and spec.dropout_p == 0

    def work(job):
        b, kv = job
        item = _Item(spec, b, kv)
        heads = item.head_slice
        dk_item, dv_item = dk[b, kv], dv[b, kv]  # (S, H), (S, Hv): owned by this item
        s_buf = np.empty((G * block_q, block_k), dtype=dtype)  # scores, then P, of one tile
        dp_buf = np.empty_like(s_buf)  # dP - D, then dS, of one tile
        dk_tmp = np.empty((block_k, H), dtype=dtype)
        dv_tmp = np.empty((block_k, Hv), dtype=dtype)
        dq_tmp = np.empty((G * block_q, H), dtype=dtype)
        for q0, q1 in q_tiles:
            tq, rows = q1 - q0, G * (q1 - q0)
            lse_i = lse3[b, heads, q0:q1].reshape(rows)  # (G*tq,)
            D_i = D[b, heads, q0:q1].reshape(rows)  # (G*tq,)
            qa = _augmented_rows(q3[b, heads, q0:q1], -lse_i if fused else 0, scale, dtype)  # (G*tq, H+1)
            doa = _augmented_rows(do3[b, heads, q0:q1], -D_i if fold_D else 0, one, dtype)  # (G*tq, Hv+1)
            qs_i, do_i = qa[:, :H], doa[:, :Hv]  # (G*tq, H), (G*tq, Hv) views
            dq_i = np.zeros((rows, H), dtype=dtype)
            for k0, k1 in k_tiles:
                kind = classify_tile(spec, q0, q1, k0, k1)
                if kind == NONE:
                    continue
                tk = k1 - k0
                p = s_buf[:rows, :tk]
                np.matmul(qa, kTa[b, kv, :, k0:k1], out=p)  # (G*tq, H+1) @ (H+1, tk) -> S_ij [- lse_i]
                item.mask_scores(p, q0, q1, k0, k1, kind)
                if not fused:
                    p -= lse_i[:, None]
                np.exp(p, out=p)  # P_ij
                drop = item.dropout_scale(q0, q1, k0, k1)
                p_dropped = p if drop is None else p * drop
                np.matmul(p_dropped.T, do_i, out=dv_tmp[:tk])  # (tk, G*tq) @ (G*tq, Hv) -> (tk, Hv)
                dv_item[k0:k1] += dv_tmp[:tk]
                ds = dp_buf[:rows, :tk]
                np.matmul(doa, vTa[b, kv, :, k0:k1], out=ds)  # (G*tq, Hv+1) @ (Hv+1, tk) -> dP [- D]
                if drop is not None:
                    ds *= drop
                if not fold_D:
                    ds -= D_i[:, None]
                ds *= p  # dS_ij = P_ij * (dP_ij - D_i)
                np.matmul(ds, k3[b, kv, k0:k1], out=dq_tmp[:rows])  # (G*tq, tk) @ (tk, H) -> (G*tq, H)
                dq_i += dq_tmp[:rows]
                np.matmul(ds.T, qs_i, out=dk_tmp[:tk])  # (tk, G*tq) @ (G*tq, H) -> (tk, H)
                dk_item[k0:k1] += dk_tmp[:tk]
                if dbias is not None:
                    item.add_dbias(dbias, ds, q0, q1, k0, k1)
            dq_i *= scale
            dq[b, heads, q0:q1] = dq_i.reshape(G, tq, H)  # (G, tq, H)

    _run([(b, kv) for b in range(Bf) for kv in range(K)], work, parallel=dbias is None)
    bs = spec.batch_shape
    grads = dq.reshape(bs + (N, T, H)), dk.reshape(bs + (K, S, H)), dv.reshape(bs + (K, S, Hv))
    return (*grads, None if dbias is None else dbias.reshape(spec.bias_shape))
