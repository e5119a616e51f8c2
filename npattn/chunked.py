r"""The chunked path: FlashAttention-2's online softmax in plain array code.

Queries are cut into tiles of ``block_q`` rows and keys into tiles of
``block_k`` columns; no array with ``T x S`` entries per head is ever built.

Forward, for each query tile ``i`` (``Q_i``, rows ``[q0, q1)``), visiting key
tiles ``j`` in order with running row max ``m``, row sum ``l`` and an
unnormalized output ``acc`` (``m = -inf``, ``l = 0``, ``acc = 0`` at the start)::

    S_ij  = pipeline(scale * Q_i K_j^T)          softcap, + bias - ALiBi; hidden -> -inf
    m_new = max(m, rowmax(S_ij))
    a     = exp(m - m_new)                       rescales what came before
    P~_ij = exp(S_ij - m_new)
    l     = a * l + rowsum(P~_ij)
    acc   = a * acc + (P~_ij * keep_ij / (1 - p)) V_j
    m     = m_new

and at the end ``O_i = acc / l`` and ``lse_i = m + log(l)``. The residuals are
``O`` and ``lse`` only, never probabilities. A row that sees no key has
``l = 0``: its output is 0 and its ``lse`` is ``-inf``. While ``m_new`` is
still ``-inf`` it is replaced by 0 in the two ``exp`` above, so
``exp(-inf - -inf)`` (NaN) never happens.

Backward, given ``dO`` and ``dlse`` (FlashAttention-2, Algorithm 2: outer loop
over key tiles ``j``, inner loop over query tiles ``i``)::

    D     = rowsum(dO * O) - dlse                (..., N, T), computed once
    P_ij  = exp(S_ij - lse_i)                    recomputed; 0 on masked rows
    Pd_ij = P_ij * keep_ij / (1 - p)
    dV_j += Pd_ij^T dO_i
    dP_ij = (dO_i V_j^T) * keep_ij / (1 - p)
    dS_ij = P_ij * (dP_ij - D_i)                 also the bias gradient tile (and d slopes)
    dR_ij = pipeline'(dS_ij)                      the softcap's chain rule
    dQ_i += scale * dR_ij K_j
    dK_j += scale * dR_ij^T Q_i

``dbias`` is accumulated tile by tile, each ``dS_ij`` summed to the bias
tile's own shape (a bias tile keeps its size-1 broadcast axes, see
:func:`npattn.scores.tiles.slice_tile`), then the tiles are concatenated.

Dimension legend: B... batch axes, N query heads, K kv heads, G = N // K
query heads per kv head, T query length, S key length, H head dim, Hv value
dim, tq/tk the rows/columns of one tile. Heads are kept in a grouped layout,
``Q (..., K, G, T, H)`` against ``K (..., K, 1, S, H)``, so GQA/MQA never
copies keys or values G times; ``dK`` and ``dV`` are summed over the group.

Tiles are classified first (:func:`npattn.scores.visibility.classify_tile`): tiles that
causal/window/lengths/segment ids hide completely are skipped in both passes (so causal
costs about half), fully visible tiles build no mask, and only mixed tiles
build their visibility from indices. Dropout's keep mask is regenerated per
tile from the seed (:func:`npattn.dropout.keep_tile`), bit-identical to the
dense path's. Accumulation order is fixed (tiles in index order), so results
are deterministic.

Memory: besides the inputs and a user mask or bias (sliced per tile, never
copied whole), forward + backward allocate ``O((T + S) * H + block_q * block_k)``
per head: ``out``, ``lse``, ``D``, the gradients and one tile of scores.

Tile sizes: the caller's ``block_q``/``block_k``, else :func:`default_blocks`:
128 x 128 on the CPU; on an accelerator (CuPy, torch on a GPU) as large as
keeps one score tile over all batch elements and heads within
``npattn.options.ACCELERATOR_TILE_SCORES`` = 2**25 entries, because there the
cost is the ~20 kernel launches per tile, not the tile's size.

``impl="auto"`` picks this path when the dense score tensor ``(..., N, T, S)``
would hold more than ``npattn.options.AUTO_CHUNKED_MIN_SCORES`` = 2**24
entries (64 MiB in float32), all batch elements and heads together; on NumPy
also from ``npattn.options.AUTO_FAST_MIN_SCORES`` = 2**21 entries (2**20 with
a softcap, ALiBi or dropout, 2**22 with score modifications), where its fast
path (:mod:`npattn.fast_numpy`) overtakes the dense path.
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat

from . import dropout as _dropout
from .namespace import sum_to_shape
from .options import (
    ACCELERATOR_BLOCK_MAX,
    ACCELERATOR_BLOCK_MIN,
    ACCELERATOR_TILE_SCORES,
    DEFAULT_BLOCK_K,
    DEFAULT_BLOCK_Q,
    AttentionSpec,
)
from .scores.pipeline import ScoreParamGrads, additive_tile, transform, transform_backward
from .scores.visibility import ALL, NONE, classify_tile, visible_tile

__all__ = [
    "chunked_forward",
    "chunked_backward",
    "tile_ranges",
    "default_blocks",
    "on_accelerator",
    "grouped",
    "ungrouped",
    "dropout_tile",
    "DbiasAccumulator",
]

#: torch device types that are not accelerators ("meta" holds no data at all).
_HOST_TORCH_DEVICE_TYPES = ("cpu", "meta")


def on_accelerator(xp: Any, device: Any) -> bool:
    """Whether arrays of namespace ``xp`` on ``device`` live on an accelerator:
    CuPy arrays, or torch tensors on a non-CPU device (``cuda``, ``xpu``,
    ``mps``, ...). NumPy, array-api-strict (whatever its device, ``device1``
    included: it is a CPU stand-in) and torch CPU tensors are not.

    >>> import numpy as np, array_api_compat
    >>> on_accelerator(array_api_compat.array_namespace(np.zeros(1)), "cpu")
    False
    """
    if array_api_compat.is_cupy_namespace(xp):
        return True
    if array_api_compat.is_torch_namespace(xp):
        return getattr(device, "type", "cpu") not in _HOST_TORCH_DEVICE_TYPES
    return False


def _fit(x: int) -> int:
    """The largest power of two ``<= x``, clipped to
    ``[ACCELERATOR_BLOCK_MIN, ACCELERATOR_BLOCK_MAX]``."""
    power = 1 << (x.bit_length() - 1) if x >= 1 else 0
    return min(max(power, ACCELERATOR_BLOCK_MIN), ACCELERATOR_BLOCK_MAX)


def default_blocks(spec: AttentionSpec) -> tuple[int, int]:
    r"""``(block_q, block_k)`` of the generic chunked path: the caller's where
    given, else a default that depends on where the arrays live.

    On an accelerator (:func:`on_accelerator`: CuPy, torch on a non-CPU
    device), with ``P = B * N`` (batch elements times query heads),
    ``E = ACCELERATOR_TILE_SCORES`` = 2**25 and ``fit(x)`` the largest power of
    two ``<= x`` clipped to ``[128, 2048]``::

        b  = fit(sqrt(E / P))                    the square share of the budget
        bq = block_q, else T when T <= b         a fixed side: the caller's size,
        bk = block_k, else S when S <= b         or a whole short sequence
        free sides (still unset) take the rest of the budget:
          both free:  bq = b,  bk = min(S, fit(E / (P * bq)))
          bq free:    bq = min(T, fit(E / (P * bk)))
          bk free:    bk = min(S, fit(E / (P * bq)))

    so one score tile over all (batch, head) pairs, ``P * bq * bk`` entries,
    stays within ``E`` (128 MiB in float32) unless the lower clip at 128 or a
    caller's size asks for more. Each tile costs ~20 small kernel launches
    whatever its size, so on a GPU large tiles are what makes the path fast
    (H100, float32, T = S = 16384, B*N = 8: 128 x 128 tiles are ~200-330x
    slower than torch SDPA in forward + backward, 2048 x 2048 ~3.5x).

    On the CPU (NumPy's generic path, array-api-strict on any device, torch
    CPU tensors) a missing size is ``DEFAULT_BLOCK_Q`` x ``DEFAULT_BLOCK_K`` =
    128 x 128, as it always was.

    A pure function of ``spec``, so the backward tiles exactly as the forward.

    Examples
    --------
    ``B = 1``, ``N = 8``, ``T = S = 16384``: ``P = 8``, ``b = fit(2048)``,
    tiles 2048 x 2048 (exactly 2**25 entries). With ``B = 2``: ``P = 16``,
    ``b = fit(1448) = 1024``, and keys take the rest, 1024 x 2048. Decoding
    one token against 32768 keys with ``B = 32``, ``N = 32``: ``P = 1024``,
    ``b = 128``, ``bq = T = 1``, ``bk = fit(32768) = 2048``. On NumPy, the
    CPU default:

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> q = np.zeros((1, 8, 300, 4))
    >>> default_blocks(make_spec(q, q, q)), default_blocks(make_spec(q, q, q, block_q=64))
    ((128, 128), (64, 128))
    """
    if not on_accelerator(spec.xp, spec.device):
        return spec.block_q or DEFAULT_BLOCK_Q, spec.block_k or DEFAULT_BLOCK_K
    E, P = ACCELERATOR_TILE_SCORES, max(spec.num_batch * spec.num_heads, 1)
    T, S = max(spec.q_len, 1), max(spec.kv_len, 1)
    b = _fit(math.isqrt(E // P))
    bq = spec.block_q or (T if b >= T else None)
    bk = spec.block_k or (S if b >= S else None)
    if bq is None and bk is not None:
        bq = min(T, _fit(E // (P * bk)))
    else:
        bq = bq or b
        if bk is None:
            bk = min(S, _fit(E // (P * bq)))
    return bq, bk


def tile_ranges(length: int, block: int) -> list[tuple[int, int]]:
    """``[(0, b), (b, 2b), ..., (., length)]``; the last tile may be shorter.

    The tiling of both chunked paths (this one and :mod:`npattn.fast_numpy`).

    >>> tile_ranges(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def grouped(spec: AttentionSpec, x: Any) -> Any:
    """View a per-head tile ``(..., N|1, a, b)`` as ``(..., K|1, G|1, a, b)``.

    Tiles built only from row/column indices (rank 2) broadcast as they are.
    """
    if x.ndim < 3:
        return x
    n = x.shape[-3]
    heads = (1, 1) if n == 1 else (spec.num_kv_heads, spec.group_size)
    return spec.xp.reshape(x, tuple(x.shape[:-3]) + heads + tuple(x.shape[-2:]))  # (..., K|1, G|1, a, b)


def ungrouped(spec: AttentionSpec, x: Any) -> Any:
    """``(..., K, G, a, b) -> (..., N, a, b)``, the inverse of :func:`grouped`."""
    return spec.xp.reshape(x, tuple(x.shape[:-4]) + (spec.num_heads,) + tuple(x.shape[-2:]))


def _tile_scores(
    spec: AttentionSpec, qs_i: Any, kT_j: Any, q0: int, q1: int, k0: int, k1: int, kind: str
) -> tuple[Any, Any, Any]:
    """``(S_ij, R_ij, A_ij)``: the raw products ``R_ij = (scale * Q_i) K_j^T``,
    the scores ``S_ij`` after the pipeline (:mod:`npattn.scores.pipeline`:
    softcap, bias, ALiBi, user modifications), hidden entries set to
    ``-inf``, and step 3's additive term (grouped, or None) for the backward.

    ``qs_i`` is the pre-scaled query tile ``(..., K, G, tq, H)``, ``kT_j`` the
    transposed key tile ``(..., K, 1, H, tk)``. A fully visible tile
    (``kind == ALL``) builds no mask.
    """
    xp = spec.xp
    raw = qs_i @ kT_j  # (..., K, G, tq, tk)
    additive = additive_tile(spec, q0, q1, k0, k1)  # (..., N|1, tq|1, tk|1) or None
    additive = None if additive is None else grouped(spec, additive)  # (..., K|1, G|1, tq|1, tk|1)
    s = transform(spec, raw, additive, (q0, q1, k0, k1))  # (..., K, G, tq, tk)
    if kind != ALL:
        visible = visible_tile(spec, q0, q1, k0, k1)  # broadcastable to (..., N, tq, tk)
        if visible is not None:
            s = xp.where(grouped(spec, visible), s, -xp.inf)  # (..., K, G, tq, tk)
    return s, raw, additive


def dropout_tile(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> Any | None:
    """``keep_ij / (1 - p)`` as ``(..., K, G, tq, tk)``, or None without dropout."""
    if spec.dropout_p == 0:
        return None
    xp = spec.xp
    keep = _dropout.keep_tile(spec, q0, q1, k0, k1)  # (..., N, tq, tk)
    return grouped(spec, xp.astype(keep, spec.compute_dtype)) / (1.0 - spec.dropout_p)


def _zeros(spec: AttentionSpec, shape: tuple[int, ...]) -> Any:
    return spec.xp.zeros(shape, dtype=spec.compute_dtype, device=spec.device)


def _is_empty(spec: AttentionSpec) -> bool:
    return spec.num_batch == 0 or spec.q_len == 0


def chunked_forward(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Online-softmax attention, tile by tile.

    Parameters
    ----------
    spec : AttentionSpec
        Validated options (``block_q``, ``block_k``, masks, dropout, ...).
    q : array, (..., N, T, H)
    k : array, (..., K, S, H)
    v : array, (..., K, S, Hv)
        Already in ``spec.compute_dtype``; never modified.

    Returns
    -------
    out : array, (..., N, T, Hv)
        0 on fully masked rows.
    lse : array, (..., N, T)
        ``m + log(l)``; ``-inf`` on fully masked rows.

    Examples
    --------
    Three equal scores ``2 / sqrt(2)``, causal, tiles of 2: row i sees i + 1
    keys, so ``lse_i = sqrt(2) + log(i + 1)``.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> q = k = v = np.ones((1, 3, 2))
    >>> spec = make_spec(q, k, v, impl="chunked", block_q=2, block_k=2, causal=True)
    >>> out, lse = chunked_forward(spec, q, k, v)
    >>> out.shape, lse.round(4).tolist()
    ((1, 3, 2), [[1.4142, 2.1074, 2.5128]])
    """
    xp = spec.xp
    bs, N, K, G = spec.batch_shape, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    if _is_empty(spec):
        return _zeros(spec, bs + (N, T, Hv)), _zeros(spec, bs + (N, T))
    qs = xp.reshape(q, bs + (K, G, T, H)) * spec.scale  # (..., K, G, T, H), pre-scaled
    kT = xp.matrix_transpose(xp.reshape(k, bs + (K, 1, S, H)))  # (..., K, 1, H, S)
    vg = xp.reshape(v, bs + (K, 1, S, Hv))  # (..., K, 1, S, Hv)
    block_q, block_k = default_blocks(spec)
    k_tiles = tile_ranges(S, block_k)
    out_tiles, lse_tiles = [], []
    for q0, q1 in tile_ranges(T, block_q):
        qs_i = qs[..., q0:q1, :]  # (..., K, G, tq, H)
        m = xp.full(bs + (K, G, q1 - q0, 1), -xp.inf, dtype=spec.compute_dtype, device=spec.device)
        l = _zeros(spec, bs + (K, G, q1 - q0, 1))  # (..., K, G, tq, 1)
        acc = _zeros(spec, bs + (K, G, q1 - q0, Hv))  # (..., K, G, tq, Hv)
        for k0, k1 in k_tiles:
            kind = classify_tile(spec, q0, q1, k0, k1)
            if kind == NONE:
                continue
            s, _, _ = _tile_scores(spec, qs_i, kT[..., k0:k1], q0, q1, k0, k1, kind)  # (..., K, G, tq, tk)
            m_new = xp.maximum(m, xp.max(s, axis=-1, keepdims=True))  # (..., K, G, tq, 1)
            m_safe = xp.where(m_new == -xp.inf, xp.zeros_like(m_new), m_new)  # no exp(-inf - -inf)
            a = xp.exp(m - m_safe)  # (..., K, G, tq, 1)
            p = xp.exp(s - m_safe)  # P~_ij (..., K, G, tq, tk)
            l = a * l + xp.sum(p, axis=-1, keepdims=True)  # (..., K, G, tq, 1)
            drop = dropout_tile(spec, q0, q1, k0, k1)
            if drop is not None:
                p = p * drop  # (..., K, G, tq, tk)
            acc = a * acc + p @ vg[..., k0:k1, :]  # (..., K, G, tq, tk) @ (..., K, 1, tk, Hv) -> (..., K, G, tq, Hv)
            m = m_new
        empty = l == 0  # rows that saw no key
        l_safe = xp.where(empty, xp.ones_like(l), l)
        out_tiles.append(acc / l_safe)  # (..., K, G, tq, Hv)
        lse_tiles.append(xp.where(empty, xp.full_like(l, -xp.inf), m + xp.log(l_safe)))  # (..., K, G, tq, 1)
    out = xp.reshape(xp.concat(out_tiles, axis=-2), bs + (N, T, Hv))  # (..., N, T, Hv)
    lse = xp.reshape(xp.concat(lse_tiles, axis=-2), bs + (N, T))  # (..., N, T)
    return out, lse


def chunked_backward(
    spec: AttentionSpec, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dlse: Any | None
) -> tuple[Any, Any, Any, Any | None, dict[str, Any]]:
    """Gradients of :func:`chunked_forward`, recomputing ``P`` tile by tile.

    Parameters
    ----------
    spec : AttentionSpec
        The forward's options.
    q, k, v : arrays, (..., N, T, H), (..., K, S, H), (..., K, S, Hv)
        The forward's inputs in the compute dtype.
    out : array, (..., N, T, Hv)
    lse : array, (..., N, T)
        The forward's residuals.
    dout : array, (..., N, T, Hv)
        Cotangent of ``out``, in the compute dtype.
    dlse : array, (..., N, T), optional
        Cotangent of ``lse``.

    Returns
    -------
    dq : array, (..., N, T, H)
    dk : array, (..., K, S, H)
    dv : array, (..., K, S, Hv)
        Summed over the G query heads sharing each kv head.
    dbias : array in ``spec.bias_shape``, or None without a bias
        Summed over the bias's broadcast axes; in the compute dtype.
    param_grads : dict
        The score pipeline's parameter gradients (``"alibi_slopes"``, ``"mods"``), see
        :class:`npattn.scores.pipeline.ScoreParamGrads`.
    """
    xp = spec.xp
    bs, N, K, G = spec.batch_shape, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    if _is_empty(spec):
        dbias = None if spec.bias_shape is None else _zeros(spec, spec.bias_shape)
        grads = _zeros(spec, bs + (N, T, H)), _zeros(spec, bs + (K, S, H)), _zeros(spec, bs + (K, S, Hv))
        return (*grads, dbias, ScoreParamGrads(spec).result())
    qs = xp.reshape(q, bs + (K, G, T, H)) * spec.scale  # (..., K, G, T, H), scale * Q
    kg = xp.reshape(k, bs + (K, 1, S, H))  # (..., K, 1, S, H)
    vg = xp.reshape(v, bs + (K, 1, S, Hv))  # (..., K, 1, S, Hv)
    do = xp.reshape(dout, bs + (K, G, T, Hv))  # (..., K, G, T, Hv)
    D = xp.sum(dout * out, axis=-1, keepdims=True)  # (..., N, T, 1)
    if dlse is not None:
        D = D - dlse[..., None]
    D = xp.reshape(D, bs + (K, G, T, 1))  # (..., K, G, T, 1)
    lse = xp.reshape(lse, bs + (K, G, T, 1))  # (..., K, G, T, 1)
    lse = xp.where(lse == -xp.inf, xp.zeros_like(lse), lse)  # masked rows: S = -inf gives P = 0
    block_q, block_k = default_blocks(spec)  # the forward's tiles: a pure function of spec
    q_tiles, k_tiles = tile_ranges(T, block_q), tile_ranges(S, block_k)
    dq_tiles: list[Any] = [None] * len(q_tiles)  # sum_j dS_ij K_j, each (..., K, G, tq, H)
    dk_tiles, dv_tiles = [], []
    dbias_acc = DbiasAccumulator(spec, q_tiles, k_tiles)
    params = ScoreParamGrads(spec)
    for j, (k0, k1) in enumerate(k_tiles):
        k_j = kg[..., k0:k1, :]  # (..., K, 1, tk, H)
        kT_j = xp.matrix_transpose(k_j)  # (..., K, 1, H, tk)
        vT_j = xp.matrix_transpose(vg[..., k0:k1, :])  # (..., K, 1, Hv, tk)
        dk_j = _zeros(spec, bs + (K, k1 - k0, H))  # (..., K, tk, H)
        dv_j = _zeros(spec, bs + (K, k1 - k0, Hv))  # (..., K, tk, Hv)
        for i, (q0, q1) in enumerate(q_tiles):
            kind = classify_tile(spec, q0, q1, k0, k1)
            if kind == NONE:
                continue
            qs_i, do_i = qs[..., q0:q1, :], do[..., q0:q1, :]  # (..., K, G, tq, H), (..., K, G, tq, Hv)
            s, raw, additive = _tile_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind)  # (..., K, G, tq, tk)
            p = xp.exp(s - lse[..., q0:q1, :])  # P_ij (..., K, G, tq, tk)
            drop = dropout_tile(spec, q0, q1, k0, k1)
            p_dropped = p if drop is None else p * drop  # Pd_ij
            # (..., K, G, tk, tq) @ (..., K, G, tq, Hv) -> (..., K, G, tk, Hv), summed over G
            dv_j = dv_j + xp.sum(xp.matrix_transpose(p_dropped) @ do_i, axis=-3)
            dp = do_i @ vT_j  # (..., K, G, tq, Hv) @ (..., K, 1, Hv, tk) -> (..., K, G, tq, tk)
            if drop is not None:
                dp = dp * drop
            ds = p * (dp - D[..., q0:q1, :])  # dS_ij (..., K, G, tq, tk)
            # dS3_ij through the modifications, then dR_ij through the softcap
            ds3, ds = transform_backward(spec, ds, raw, additive, (q0, q1, k0, k1), params)
            dbias_acc.add(i, j, ds3)
            dq_ij = ds @ k_j  # (..., K, G, tq, tk) @ (..., K, 1, tk, H) -> (..., K, G, tq, H)
            dq_tiles[i] = dq_ij if dq_tiles[i] is None else dq_tiles[i] + dq_ij
            # (..., K, G, tk, tq) @ (..., K, G, tq, H) -> (..., K, G, tk, H), summed over G
            dk_j = dk_j + xp.sum(xp.matrix_transpose(ds) @ qs_i, axis=-3)
        dk_tiles.append(dk_j)
        dv_tiles.append(dv_j)
    dq_tiles = [
        _zeros(spec, bs + (K, G, q1 - q0, H)) if dq_i is None else dq_i for dq_i, (q0, q1) in zip(dq_tiles, q_tiles)
    ]
    dq = spec.scale * xp.reshape(xp.concat(dq_tiles, axis=-2), bs + (N, T, H))  # (..., N, T, H)
    dk = xp.concat(dk_tiles, axis=-2)  # (..., K, S, H)
    dv = xp.concat(dv_tiles, axis=-2)  # (..., K, S, Hv)
    return dq, dk, dv, dbias_acc.result(), params.result()


class DbiasAccumulator:
    """Collects ``dS_ij`` summed to the bias tile's shape, then assembles
    ``dbias`` in ``spec.bias_shape``.

    The bias (viewed at full rank ``(..., N|1, T|1, S|1)``) is cut into the
    same tiles as the scores, except along a size-1 (broadcast) row or column
    axis, where all tiles of that line add into one piece. Pieces are summed
    in visiting order; tiles that were skipped contribute zeros.
    """

    def __init__(self, spec: AttentionSpec, q_tiles: list, k_tiles: list):
        self.spec, self.q_tiles, self.k_tiles = spec, q_tiles, k_tiles
        self.pieces: dict[tuple[int, int], Any] = {}
        if spec.bias is not None:
            self.rows_summed = spec.bias.shape[-2] == 1
            self.cols_summed = spec.bias.shape[-1] == 1

    def _key(self, i: int, j: int) -> tuple[int, int]:
        return (0 if self.rows_summed else i, 0 if self.cols_summed else j)

    def _tile_shape(self, i: int, j: int) -> tuple[int, ...]:
        (q0, q1), (k0, k1) = self.q_tiles[i], self.k_tiles[j]
        rows = 1 if self.rows_summed else q1 - q0
        cols = 1 if self.cols_summed else k1 - k0
        return tuple(self.spec.bias.shape[:-2]) + (rows, cols)

    def add(self, i: int, j: int, ds: Any) -> None:
        """Add ``dS_ij (..., K, G, tq, tk)`` summed to the bias tile's shape."""
        if self.spec.bias is None:
            return
        piece = sum_to_shape(self.spec.xp, ungrouped(self.spec, ds), self._tile_shape(i, j))  # (..., N|1, tq|1, tk|1)
        key = self._key(i, j)
        self.pieces[key] = piece if key not in self.pieces else self.pieces[key] + piece

    def result(self) -> Any | None:
        spec = self.spec
        if spec.bias is None:
            return None
        xp = spec.xp
        row_keys = [0] if self.rows_summed else range(len(self.q_tiles))
        col_keys = [0] if self.cols_summed else range(len(self.k_tiles))
        rows = []
        for i in row_keys:
            row = [self.pieces.get((i, j)) for j in col_keys]
            row = [_zeros(spec, self._tile_shape(i, j)) if piece is None else piece for piece, j in zip(row, col_keys)]
            rows.append(xp.concat(row, axis=-1))  # (..., N|1, tq|1, S|1)
        dbias = xp.concat(rows, axis=-2)  # (..., N|1, T|1, S|1)
        return xp.reshape(dbias, spec.bias_shape)
