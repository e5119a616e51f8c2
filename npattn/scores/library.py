r"""Score modifications shipped with npattn, written through the public
interface (:class:`~npattn.scores.mods.ScoreMod`) exactly as a user would
write them: each is a forward and its hand-written backward on rank-4 tiles.

- :func:`softcap_mod`: ``c tanh(s / c)``, the same math as the built-in
  ``softcap=`` (which applies it before the bias, this one wherever it is
  placed among the modifications);
- :func:`alibi_mod`: ``s - m_n |p_i - j|`` with learnable slopes, as the
  built-in ``alibi_slopes=``;
- :func:`relative_position_bias`: T5's learned bias per head and bucket of
  the relative position ``j - p_i``;
- :func:`head_temperature`: ``s * t_n``, a learnable per-head temperature.

Parameter gathers use ``take`` on flattened arrays (portable across Array
API namespaces); the table's scatter-add in the backward uses ``bincount``
on NumPy and CuPy and a per-bucket sum elsewhere (same numbers, slower).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat
import numpy as np

from .mods import ScoreMod, TileIndex
from .softcap import softcap_backward, softcap_forward

__all__ = ["softcap_mod", "alibi_mod", "relative_position_bias", "t5_buckets", "head_temperature"]


def _per_head(xp: Any, values: Any, idx: TileIndex) -> Any:
    """``values[idx.head]`` for a ``(N,)`` array: ``(1, n, 1, 1)``."""
    picked = xp.take(values, xp.reshape(idx.head, (-1,)), axis=0)  # (n,)
    return xp.reshape(picked, (1, -1, 1, 1))  # (1, n, 1, 1)


def softcap_mod(cap: float) -> ScoreMod:
    r"""Logit soft-capping as a score modification: ``s' = c tanh(s / c)``,
    ``ds = ds' (1 - tanh^2(s / c))`` (the built-in ``softcap=``'s unit).

    >>> import numpy as np, npattn
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 6, 4))
    >>> mine, _ = npattn.attention_forward(q, k, v, score_mods=[npattn.softcap_mod(0.5)])
    >>> built_in, _ = npattn.attention_forward(q, k, v, softcap=0.5)
    >>> bool(np.allclose(mine, built_in))
    True
    """
    if not (isinstance(cap, (int, float)) and math.isfinite(cap) and cap > 0):
        raise ValueError(f"softcap_mod cap must be a finite float > 0, got {cap!r}")

    def softcap(s, idx):
        return softcap_forward(array_api_compat.array_namespace(s), s, cap)

    def softcap_grad(s, idx, ds):
        xp = array_api_compat.array_namespace(s)
        return softcap_backward(xp, softcap_forward(xp, s, cap), cap, ds)

    return ScoreMod(softcap, softcap_grad, name=f"softcap_mod({cap})")


def alibi_mod(slopes: Any, *, name: str = "slopes") -> ScoreMod:
    r"""ALiBi as a score modification with learnable slopes ``(N,)``:
    ``s' = s - m_n |p_i - j|``, ``dm_n = -sum_ij ds'_nij |p_i - j|``.

    >>> import numpy as np, npattn
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 4, 6, 4))
    >>> slopes = npattn.alibi_slopes(4)
    >>> mine, _ = npattn.attention_forward(q, k, v, score_mods=[npattn.alibi_mod(slopes)])
    >>> built_in, _ = npattn.attention_forward(q, k, v, alibi_slopes=slopes)
    >>> bool(np.allclose(mine, built_in))
    True
    """

    def alibi(s, idx, **params):
        xp = array_api_compat.array_namespace(s)
        distance = xp.astype(xp.abs(idx.q - idx.k), s.dtype)  # (B'|1, 1, tq, tk)
        return s - _per_head(xp, params[name], idx) * distance

    def alibi_grad(s, idx, ds, **params):
        xp = array_api_compat.array_namespace(s)
        distance = xp.astype(xp.abs(idx.q - idx.k), s.dtype)  # (B'|1, 1, tq, tk)
        return ds, {name: -idx.per_head(ds * distance)}

    return ScoreMod(alibi, alibi_grad, params={name: slopes}, name="alibi_mod")


def head_temperature(temperature: Any, *, name: str = "temperature") -> ScoreMod:
    r"""A learnable per-head temperature ``(N,)``: ``s' = s t_n``,
    ``ds = ds' t_n``, ``dt_n = sum_ij ds'_nij s_nij``.

    >>> import numpy as np, npattn
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 6, 4))
    >>> out, res = npattn.attention_forward(q, k, v, score_mods=[npattn.head_temperature(np.ones(2))])
    >>> npattn.attention_backward(np.ones_like(out), res).dmods["temperature"].shape
    (2,)
    """

    def temperature_forward(s, idx, **params):
        return s * _per_head(array_api_compat.array_namespace(s), params[name], idx)

    def temperature_backward(s, idx, ds, **params):
        xp = array_api_compat.array_namespace(s)
        return ds * _per_head(xp, params[name], idx), {name: idx.per_head(ds * s)}

    return ScoreMod(temperature_forward, temperature_backward, params={name: temperature}, name="head_temperature")


def t5_buckets(relative_position: Any, *, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True):
    """T5's bucket of each relative position ``j - p_i`` (int64): exact below
    ``num_buckets // 4`` (``// 2`` one-sided), then logarithmic up to
    ``max_distance``, the last bucket beyond; two halves (keys after or
    before the query) when ``bidirectional``, else keys after the query all
    fall in bucket 0 (as in the T5 decoder).

    >>> import numpy as np
    >>> t5_buckets(np.array([-200, -3, 0, 3, 200]), num_buckets=8, max_distance=16).tolist()
    [3, 2, 0, 6, 7]
    """
    xp = array_api_compat.array_namespace(relative_position)
    buckets = xp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = xp.astype(relative_position > 0, relative_position.dtype) * num_buckets
        distance = xp.abs(relative_position)
    else:
        distance = xp.maximum(-relative_position, xp.zeros_like(relative_position))
    max_exact = num_buckets // 2
    ratio = xp.astype(xp.maximum(distance, xp.ones_like(distance)), xp.float64) / max_exact
    spread = xp.log(ratio) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    large = xp.minimum(max_exact + xp.astype(spread, distance.dtype), xp.full_like(distance, num_buckets - 1))
    return buckets + xp.where(distance < max_exact, distance, large)


def relative_position_bias(
    table: Any, *, max_distance: int = 128, bidirectional: bool = True, name: str = "relative_bias"
) -> ScoreMod:
    r"""T5's learned relative-position bias: ``s' = s + table[n, bucket(j - p_i)]``
    with ``table`` of shape ``(N, num_buckets)`` and :func:`t5_buckets`;
    ``dtable[n, b] = sum over entries in bucket b of ds'_n``.

    >>> import numpy as np, npattn
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 6, 4))
    >>> bias = npattn.relative_position_bias(np.zeros((2, 8)), max_distance=16)
    >>> out, res = npattn.attention_forward(q, k, v, score_mods=[bias], causal=True)
    >>> npattn.attention_backward(np.ones_like(out), res).dmods["relative_bias"].shape
    (2, 8)
    """
    if getattr(table, "ndim", None) != 2:
        raise ValueError(
            f"relative_position_bias table must have shape (N, num_buckets), got {getattr(table, 'shape', None)}"
        )
    num_buckets = int(table.shape[1])

    def flat_index(xp: Any, idx: TileIndex) -> Any:
        """``n * num_buckets + bucket(j - p_i)``: ``(B'|1, n, tq, tk)``."""
        bucket = t5_buckets(
            idx.k - idx.q, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
        )
        return idx.head * num_buckets + bucket

    def relative_bias(s, idx, **params):
        xp = array_api_compat.array_namespace(s)
        index = flat_index(xp, idx)
        bias = xp.take(xp.reshape(params[name], (-1,)), xp.reshape(index, (-1,)), axis=0)
        return s + xp.reshape(bias, tuple(index.shape))  # (B'|1, n, tq, tk)

    def relative_bias_grad(s, idx, ds, **params):
        xp = array_api_compat.array_namespace(s)
        index = xp.broadcast_to(flat_index(xp, idx), tuple(ds.shape))  # (B', n, tq, tk)
        table_grad = _scatter_sum(xp, ds, index, idx.num_heads * num_buckets)
        return ds, {name: xp.reshape(table_grad, (idx.num_heads, num_buckets))}

    return ScoreMod(relative_bias, relative_bias_grad, params={name: table}, name="relative_position_bias")


def _scatter_sum(xp: Any, values: Any, index: Any, size: int) -> Any:
    """``out[i] = sum of values where index == i``, ``(size,)`` in ``values``'
    dtype: ``bincount`` on NumPy and CuPy, else one masked sum per entry."""
    flat_values, flat_index = xp.reshape(values, (-1,)), xp.reshape(index, (-1,))
    if array_api_compat.is_numpy_array(values):
        return xp.astype(np.bincount(flat_index, weights=flat_values, minlength=size), values.dtype)
    if array_api_compat.is_cupy_array(values):
        import cupy  # the optional GPU extra: only reached with CuPy arrays

        return xp.astype(cupy.bincount(flat_index, weights=flat_values, minlength=size), values.dtype)
    zero = xp.zeros_like(flat_values)
    return xp.stack([xp.sum(xp.where(flat_index == i, flat_values, zero)) for i in range(size)])
