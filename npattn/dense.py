"""The dense reference path: materializes the ``(..., N, T, S)`` scores.

Forward (per batch element and query head ``n``, kv head ``n // G``)::

    R   = (scale Q) K^T                      (..., N, T, S), the raw products
    S   = pipeline(R)                        mods(softcap, + bias - ALiBi) (npattn.scores)
    P   = masked_softmax(S)                  hidden -> 0, fully masked row -> 0
    lse = logsumexp(S over visible keys)     (..., N, T), -inf if none visible
    Pd  = P * keep / (1 - p)                 dropout (keep = 1 when p = 0)
    O   = Pd V                               (..., N, T, Hv)

Backward, given ``dO`` and optionally ``dlse``::

    dV  = Pd^T dO                            summed over the G heads sharing it
    dPd = dO V^T
    dP  = dPd * keep / (1 - p)
    D   = rowsum(dO * O) - dlse              (= rowsum(P * dP) - dlse)
    dS  = P * (dP - D)
    dS3 = mods'(dS)                          user score mods' chain rules, d params
    dR  = softcap'(dS3)                      dS3 also gives dbias (summed to bias's shape), d slopes
    dQ  = scale * dR K
    dK  = scale * dR^T Q                     summed over the G heads sharing it

Sinks (:mod:`npattn.scores.sinks`) are merged into ``O``, ``lse`` and ``P``
after this forward, by :func:`npattn.attention_forward`, as on every path.

This is the readable oracle the chunked path is tested against.
"""

from __future__ import annotations

from typing import Any

from . import dense_numpy
from . import dropout as _dropout
from .namespace import sum_to_shape
from .options import AttentionSpec
from .scores.pipeline import ScoreParamGrads, additive_tile, transform, transform_backward
from .scores.visibility import visible_tile
from .softmax import masked_softmax, softmax_backward

__all__ = [
    "dense_forward",
    "dense_backward",
    "dense_scores",
    "expand_kv_heads",
    "reduce_kv_heads",
    "by_kv_head",
    "by_query_head",
    "raw_scores",
    "dropout_scale",
]


def expand_kv_heads(xp: Any, x: Any, group_size: int) -> Any:
    """Repeat each of the K key/value heads G times: ``(..., K, S, D) -> (..., K*G, S, D)``.

    Query head ``n`` reads kv head ``n // G`` (PyTorch ``enable_gqa``, JAX).
    """
    if group_size == 1:
        return x
    *lead, K, S, D = x.shape
    x = xp.reshape(x, (*lead, K, 1, S, D))  # (..., K, 1, S, D)
    x = xp.broadcast_to(x, (*lead, K, group_size, S, D))  # (..., K, G, S, D)
    return xp.reshape(x, (*lead, K * group_size, S, D))  # (..., N, S, D)


def reduce_kv_heads(xp: Any, dx: Any, num_kv_heads: int) -> Any:
    """Adjoint of :func:`expand_kv_heads`: ``(..., N, S, D) -> (..., K, S, D)``,
    summing the ``G = N // K`` query heads of each kv head (K given, so that
    N = 0 query heads gives K zero rows rather than a division by G = 0)."""
    *lead, N, S, D = dx.shape
    if num_kv_heads == N:
        return dx
    dx = xp.reshape(dx, (*lead, num_kv_heads, N // num_kv_heads, S, D))  # (..., K, G, S, D)
    return xp.sum(dx, axis=-3)  # (..., K, S, D)


def by_kv_head(xp: Any, x: Any, num_kv_heads: int) -> Any:
    """Stack the ``G = N // K`` query heads of each kv head along the rows:
    ``(..., N, T, D) -> (..., K, G*T, D)`` (a view of a contiguous ``x``).
    Products of the stack with a kv head's ``K``/``V`` are then one matmul
    per kv head, with no copy of K or V per query head (GQA, MQA, decoding).
    """
    *lead, N, T, D = x.shape
    return xp.reshape(x, (*lead, num_kv_heads, (N // num_kv_heads) * T, D))  # (..., K, G*T, D)


def by_query_head(xp: Any, x: Any, num_heads: int, rows: int) -> Any:
    """Inverse of :func:`by_kv_head`: ``(..., K, G*T, D) -> (..., N, T, D)``
    with ``N = num_heads`` and ``T = rows``."""
    return xp.reshape(x, (*x.shape[:-3], num_heads, rows, x.shape[-1]))  # (..., N, T, D)


def dropout_scale(spec: AttentionSpec) -> Any | None:
    """``keep / (1 - p)`` over the whole ``(..., N, T, S)``, or None without dropout."""
    if spec.dropout_p == 0:
        return None
    xp = spec.xp
    keep = _dropout.keep_tile(spec, 0, spec.q_len, 0, spec.kv_len)  # (..., N, T, S)
    return xp.astype(keep, spec.compute_dtype) / (1.0 - spec.dropout_p)


def raw_scores(spec: AttentionSpec, q: Any, k: Any) -> Any:
    """``R = (scale * Q) K^T`` over the whole ``(..., N, T, S)``: Q is scaled
    before the product, as on the chunked paths (one pass over ``T x H``
    rather than over ``T x S``, and the same rounding as theirs).

    The product is taken as ``(K Q^T)^T``, the same sums of the same
    products: OpenBLAS, NumPy's BLAS, multiplies a row-major ``K`` by a few
    query columns 1.3-2x faster than a few query rows by the transposed view
    ``K^T`` (decoding: 0.69x the dense forward's time at T=1, S=512), and
    never slower at the shapes measured (see ``docs/performance.rst``)."""
    xp = spec.xp
    if dense_numpy.handles(xp, q.dtype):  # scaled straight into the layout the product takes (one pass)
        qs_t = dense_numpy.scaled_transpose(by_kv_head(xp, q, spec.num_kv_heads), spec.scale, k.shape[-2])
    else:
        qs = by_kv_head(xp, spec.scale * q, spec.num_kv_heads)  # (..., K, G*T, H)
        qs_t = xp.matrix_transpose(qs)  # (..., K, H, G*T), a transposed view
    products = xp.matrix_transpose(k @ qs_t)  # (..., K, G*T, S), a transposed view
    return by_query_head(xp, products, spec.num_heads, spec.q_len)  # (..., N, T, S)


def dense_scores(spec: AttentionSpec, q: Any, k: Any) -> Any:
    """The scores over the whole ``(..., N, T, S)`` after the pipeline's
    transforms (softcap, bias, ALiBi), before masking: the one definition of
    the dense scores (the multi-head layer rebuilds the chunked path's
    probabilities from it)."""
    whole = (0, spec.q_len, 0, spec.kv_len)
    return transform(spec, raw_scores(spec, q, k), additive_tile(spec, *whole), whole)


def dense_forward(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    """Return ``(out, lse, probs)`` in the compute dtype; inputs already cast."""
    if spec.scores_are_raw and dense_numpy.handles(spec.xp, spec.compute_dtype):  # the same bits, a smaller floor
        return dense_numpy.plain_forward(spec, q, k, v, visible_tile(spec, 0, spec.q_len, 0, spec.kv_len))
    xp = spec.xp
    s = dense_scores(spec, q, k)  # (..., N, T, S)
    visible = visible_tile(spec, 0, spec.q_len, 0, spec.kv_len)
    p, lse = masked_softmax(xp, s, visible, overwrite=not spec.score_mods)  # s is fresh unless a user's mod returned it
    drop = dropout_scale(spec)
    p_dropped = p if drop is None else p * drop  # (..., N, T, S)
    out = by_kv_head(xp, p_dropped, spec.num_kv_heads) @ v  # (..., K, G*T, Hv)
    out = by_query_head(xp, out, spec.num_heads, spec.q_len)  # (..., N, T, Hv)
    return out, lse, p


def dense_backward(
    spec: AttentionSpec, q: Any, k: Any, v: Any, p: Any, out: Any, dout: Any, dlse: Any | None
) -> tuple[Any, Any, Any, Any | None, dict[str, Any]]:
    """Return ``(dq, dk, dv, dbias, param_grads)`` in the compute dtype
    (dbias in the bias's shape, or None; ``param_grads`` the pipeline's, see
    :class:`~npattn.scores.pipeline.ScoreParamGrads`). ``p`` is the saved
    pre-dropout probabilities and ``out`` the forward's output (sinks merged,
    like ``p``): ``D = rowsum(dO * O)`` equals ``rowsum(P * dP)`` and costs
    ``T x Hv`` rather than ``T x S``."""
    if spec.scores_are_raw and dense_numpy.handles(spec.xp, spec.compute_dtype):
        return (*dense_numpy.plain_backward(spec, q, k, v, p, out, dout, dlse), None, {})  # the same bits
    xp = spec.xp
    N, K = spec.num_heads, spec.num_kv_heads
    drop = dropout_scale(spec)
    p_dropped = p if drop is None else p * drop  # (..., N, T, S)
    dout_g = by_kv_head(xp, dout, K)  # (..., K, G*T, Hv)
    dv = xp.matrix_transpose(by_kv_head(xp, p_dropped, K)) @ dout_g  # (..., K, S, Hv)
    dout_t = xp.matrix_transpose(dout_g)  # (..., K, Hv, G*T), a transposed view
    if dense_numpy.handles(xp, dout_t.dtype):
        dout_t = dense_numpy.narrow_columns(dout_t, v.shape[-2])
    dp_g = xp.matrix_transpose(v @ dout_t)  # (..., K, G*T, S): (V dO^T)^T, as in raw_scores
    dp = by_query_head(xp, dp_g, N, spec.q_len)  # (..., N, T, S)
    if drop is not None:
        dp = dp * drop
    D = xp.sum(dout * out, axis=-1, keepdims=True)  # (..., N, T, 1): rowsum(P * dP), over Hv not S
    if dlse is not None:
        D = D - dlse[..., None]
    ds = softmax_backward(xp, p, dp, D, overwrite=True)  # (..., N, T, S), over dP: a fresh product
    params = ScoreParamGrads(spec)
    whole = (0, spec.q_len, 0, spec.kv_len)
    if spec.softcap is not None or spec.score_mods:  # their chain rules read the raw products
        raw, additive = raw_scores(spec, q, k), additive_tile(spec, *whole)
        ds, ds_raw = transform_backward(spec, ds, raw, additive, whole, params)  # dS3, dR (..., N, T, S)
    else:
        ds, ds_raw = transform_backward(spec, ds, None, None, whole, params)  # both dS: step 3 is a sum
    dbias = None if spec.bias_shape is None else sum_to_shape(xp, ds, spec.bias_shape)
    ds = ds_raw
    ds_g = by_kv_head(xp, ds, K)  # (..., K, G*T, S)
    dq = spec.scale * by_query_head(xp, ds_g @ k, N, spec.q_len)  # (..., N, T, H)
    dk = spec.scale * (xp.matrix_transpose(ds_g) @ by_kv_head(xp, q, K))  # (..., K, S, H)
    return dq, dk, dv, dbias, params.result()
