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
from numpy.lib.stride_tricks import as_strided

from ..namespace import to_numpy
from .mods import ScoreMod, TileIndex
from .softcap import softcap_backward, softcap_forward
from .tiles import diagonal_view

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
    _check_buckets(num_buckets, max_distance, bidirectional)
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


def _check_buckets(num_buckets: int, max_distance: int, bidirectional: bool) -> None:
    """T5's bucketing needs one exact bucket per side at least and a
    logarithmic range beyond it: ``max_exact = num_buckets // 2`` (halved
    again when bidirectional) ``>= 1`` and ``max_distance > max_exact``."""
    per_side = num_buckets // 2 if bidirectional else num_buckets
    max_exact = per_side // 2
    if max_exact < 1:
        need = 4 if bidirectional else 2
        raise ValueError(f"num_buckets must be >= {need} (bidirectional={bidirectional}), got {num_buckets}")
    if max_distance <= max_exact:
        raise ValueError(
            f"max_distance must exceed the {max_exact} exact buckets (num_buckets={num_buckets}, "
            f"bidirectional={bidirectional}), got {max_distance}"
        )


def relative_position_bias(
    table: Any, *, max_distance: int = 128, bidirectional: bool = True, name: str = "relative_bias"
) -> ScoreMod:
    r"""T5's learned relative-position bias: ``s' = s + table[n, bucket(j - p_i)]``
    with ``table`` of shape ``(N, num_buckets)`` and :func:`t5_buckets`;
    ``dtable[n, b] = sum over entries in bucket b of ds'_n``.

    The bias of a tile depends on ``j - p_i`` alone, which takes
    ``tq + tk - 1`` values there: each head's bias is gathered once per value
    (``vec[n, r]``), and the tile reads ``vec`` along its diagonals (a
    Toeplitz matrix; on NumPy a strided view, no copy); the backward sums
    ``ds'`` along the same diagonals first, then per bucket.

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
    _check_buckets(num_buckets, max_distance, bidirectional)

    def buckets_of(relative: Any) -> Any:
        return t5_buckets(relative, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)

    def bias(xp: Any, table: Any, idx: TileIndex) -> Any:
        """The tile's bias ``(1, n, tq, tk)``, one batch row's positions."""
        diagonals = _Diagonals(xp, idx)
        buckets = buckets_of(diagonals.relative)  # (R,)
        flat = xp.reshape(xp.reshape(idx.head, (-1, 1)) * num_buckets + xp.reshape(buckets, (1, -1)), (-1,))  # (n*R,)
        vec = xp.reshape(xp.take(xp.reshape(table, (-1,)), flat, axis=0), (-1, diagonals.size))  # (n, R)
        return diagonals.spread(vec)  # (1, n, tq, tk)

    def table_grad(xp: Any, ds: Any, idx: TileIndex) -> Any:
        """The tile's share of ``dtable``, ``(N * num_buckets,)``, one batch row's positions."""
        diagonals = _Diagonals(xp, idx)
        buckets = buckets_of(diagonals.relative)  # (R,)
        per_diagonal = diagonals.gather(ds)  # (n, R): ds summed along each diagonal
        flat = xp.reshape(idx.head, (-1, 1)) * num_buckets + xp.reshape(buckets, (1, -1))  # (n, R)
        return _scatter_sum(
            xp, per_diagonal, xp.broadcast_to(flat, tuple(per_diagonal.shape)), idx.num_heads * num_buckets
        )

    def relative_bias(s, idx, **params):
        xp = array_api_compat.array_namespace(s)
        parts = [s_b + bias(xp, params[name], idx_b) for s_b, idx_b in _position_groups(s, idx)]  # (B'', n, tq, tk)
        return parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)

    def relative_bias_grad(s, idx, ds, **params):
        xp = array_api_compat.array_namespace(s)
        shares = [table_grad(xp, ds_b, idx_b) for ds_b, idx_b in _position_groups(ds, idx)]
        total = shares[0]
        for share in shares[1:]:
            total = total + share
        return ds, {name: xp.reshape(total, (idx.num_heads, num_buckets))}

    return ScoreMod(relative_bias, relative_bias_grad, params={name: table}, name="relative_position_bias")


def _position_groups(x: Any, idx: TileIndex) -> list[tuple[Any, TileIndex]]:
    """``[(x, idx)]`` when every batch row of the tile has the same query
    positions, else one ``(x[b:b+1], idx of row b)`` per row (bottom right
    with lengths)."""
    firsts = to_numpy(idx.q[:, 0, 0, 0])
    if firsts.shape[0] == 1 or bool(np.all(firsts == firsts[0])):
        return [(x, idx)]
    rows = range(int(x.shape[0]))
    return [(x[b : b + 1, ...], idx._replace(batch=idx.batch[b : b + 1, ...], q=idx.q[b : b + 1, ...])) for b in rows]


class _Diagonals:
    """The diagonals ``r = j - p_i`` of a tile whose queries and keys are
    consecutive positions (every path's tiles): ``relative`` holds the
    ``R = tq + tk - 1`` values ``k0 - q_last .. k_last - q0`` of one batch
    row (int64, ``(R,)``), and entry ``(i, j)`` of the tile lies on
    diagonal ``tq - 1 - i + j``. Batch rows whose positions differ are
    split apart first (:func:`_position_groups`)."""

    def __init__(self, xp: Any, idx: TileIndex):
        self.xp, self.idx = xp, idx
        self.tq, self.tk = int(idx.q.shape[2]), int(idx.k.shape[3])
        self.size = self.tq + self.tk - 1
        first = int(to_numpy(idx.q[:1, 0, :1, 0])[0, 0])  # p_0, the same in every batch row here
        k0 = int(to_numpy(idx.k[0, 0, 0, :1])[0])
        low = k0 - (first + self.tq - 1)
        self.relative = xp.arange(low, low + self.size, dtype=xp.int64, device=array_api_compat.device(idx.k))

    def spread(self, vec: Any) -> Any:
        """``out[., n, i, j] = vec[n, tq - 1 - i + j]``: ``(1, n, tq, tk)``."""
        n, tq, tk = vec.shape[0], self.tq, self.tk
        if array_api_compat.is_numpy_array(vec):
            return diagonal_view(vec, tq, tk)[None]  # (1, n, tq, tk)
        xp = self.xp
        index = xp.reshape(self.idx.k - self.idx.q[:1, ...], (tq, tk)) - int(self.relative[0])  # (tq, tk) in [0, R)
        flat = xp.reshape(
            xp.reshape(xp.arange(n, dtype=xp.int64, device=array_api_compat.device(vec)), (n, 1, 1)) * self.size
            + index,
            (-1,),
        )
        return xp.reshape(xp.take(xp.reshape(vec, (-1,)), flat, axis=0), (1, n, tq, tk))

    def gather(self, ds: Any) -> Any:
        """``out[n, r] = sum of ds[., n, i, j]`` over the entries on diagonal ``r``: ``(n, R)``."""
        xp, tq, tk = self.xp, self.tq, self.tk
        total = xp.sum(ds, axis=0)  # (n, tq, tk): one set of diagonals for every batch row
        n = total.shape[0]
        if array_api_compat.is_numpy_array(total):
            padded = np.zeros((n, tq * self.size + tk), dtype=total.dtype)  # row i of (tq, R) shifted by tq - 1 - i
            item = padded.itemsize
            shifted = as_strided(
                padded[:, tq - 1 :], shape=(n, tq, tk), strides=(padded.strides[0], (self.size - 1) * item, item)
            )
            np.copyto(shifted, total)
            return padded[:, : tq * self.size].reshape(n, tq, self.size).sum(axis=1)  # (n, R)
        index = xp.broadcast_to(
            xp.reshape(self.idx.k - self.idx.q[:1, ...], (1, tq, tk)) - int(self.relative[0]), (n, tq, tk)
        )
        heads = xp.reshape(xp.arange(n, dtype=xp.int64, device=array_api_compat.device(total)), (n, 1, 1))
        return xp.reshape(_scatter_sum(xp, total, heads * self.size + index, n * self.size), (n, self.size))


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
