r"""Step 3 (in part) of the score pipeline: ALiBi linear position biases
(Press et al., *Train Short, Test Long*, 2022).

.. math::

    s_{ij} \leftarrow s_{ij} - m_n \, |p_i - j|, \qquad
    \frac{\partial L}{\partial m_n} = -\sum_{b, i, j} dS_{nij} \, |p_i - j|

for query head ``n`` with slope ``m_n``, query position ``p_i`` (under
``align``, exactly as causal/window use it) and key position ``j``. The term
is built per tile from indices; no ``T x S`` bias is ever stored.
:func:`alibi_slopes` gives the paper's geometric slopes.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.numpy as numpy_namespace

from ..options import AttentionSpec, check_int
from .tiles import key_positions, query_positions, select_item

__all__ = [
    "alibi_slopes",
    "alibi_distance",
    "alibi_distance_bounds",
    "alibi_tile",
    "alibi_slopes_grad_tile",
]


def _geometric(n: int) -> list[float]:
    """``2**(-8 k / n)`` for ``k = 1..n``, ``n`` a power of two."""
    start = 2.0 ** (-8.0 / n)
    return [start ** (k + 1) for k in range(n)]


def alibi_slopes(num_heads: int, /, *, xp: Any = None, dtype: Any = None, device: Any = None) -> Any:
    r"""The ALiBi slopes of Press et al. for ``num_heads`` heads, shape ``(num_heads,)``.

    For a power of two ``n``: ``m_k = 2**(-8 k / n)``, ``k = 1..n``. Otherwise,
    with ``c`` the largest power of two below ``n``: the ``c`` slopes of ``c``
    heads, then every other slope of ``2 c`` heads (the odd ones), until there
    are ``n`` (the reference implementation's rule).

    Parameters
    ----------
    num_heads : int >= 1
    xp : namespace, optional
        Array API namespace of the result; NumPy by default.
    dtype, device : optional
        Of the result; float64 on the default device by default.

    Returns
    -------
    array, (num_heads,)

    Examples
    --------
    >>> import npattn
    >>> npattn.alibi_slopes(8).tolist()
    [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625]
    >>> [round(m, 4) for m in npattn.alibi_slopes(6).tolist()]
    [0.25, 0.0625, 0.0156, 0.0039, 0.5, 0.125]
    """
    n = check_int("num_heads", num_heads, minimum=1)
    closest = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    slopes = _geometric(closest)
    if closest < n:
        slopes += _geometric(2 * closest)[0::2][: n - closest]
    xp = numpy_namespace if xp is None else xp
    return xp.asarray(slopes, dtype=dtype if dtype is not None else xp.float64, device=device)


def alibi_distance(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int, batch: int | None = None) -> Any:
    """``|p_i - j|`` over the tile, in the compute dtype: ``(tq, tk)``, or
    ``(..., 1, tq, tk)`` when positions differ per batch element."""
    xp = spec.xp
    distance = xp.abs(query_positions(spec, q0, q1, batch) - key_positions(spec, k0, k1))  # (..., tq, tk)
    return xp.astype(distance, spec.compute_dtype)


def alibi_distance_bounds(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> tuple[int, int]:
    """The smallest and largest ``|p_i - j|`` over the tile in any batch
    element, on the host from the offsets' bounds (whole-tile knowledge).
    With slopes ``m_n >= 0`` every ALiBi term of the tile lies between
    ``-max_n m_n`` times the largest and ``-m_n`` times the smallest: far
    from the diagonal a steep head's scores all fall below what a softmax
    can see, and near it or on a flat head they stay within a known
    distance below the raw products.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 2))
    >>> spec = make_spec(x, x, x, alibi_slopes=np.ones(1))
    >>> alibi_distance_bounds(spec, 6, 8, 0, 2), alibi_distance_bounds(spec, 0, 4, 2, 8)
    ((5, 7), (0, 7))
    """
    omin, omax = spec.offset_bounds
    first, last = q0 + omin, q1 - 1 + omax  # extreme query positions of the tile
    # |p - j| over the box [first, last] x [k0, k1 - 1]: at least the gap between
    # the two ranges (0 where they meet), at most the farther of the two corners.
    return max(0, k0 - last, first - (k1 - 1)), max(last - k0, k1 - 1 - first)


def _slopes(spec: AttentionSpec, batch: int | None, heads: tuple[int, int] | None) -> Any:
    """The slopes as ``(..., N|1, 1, 1)`` in the compute dtype, selected like a tile."""
    slopes = select_item(spec, spec.alibi_slopes, batch, heads)
    return spec.xp.astype(slopes, spec.compute_dtype, copy=False)


def alibi_tile(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    heads: tuple[int, int] | None = None,
    distance: Any | None = None,
) -> Any:
    """``-m_n |p_i - j|`` over the tile, broadcastable to ``(..., N, tq, tk)``.

    ``distance``: the tile's :func:`alibi_distance`, when the caller already
    has it, in any layout that broadcasts against the slopes (the NumPy fast
    path passes it along a span's diagonals); a multiple ``c |p_i - j|``
    gives ``c`` times the term."""
    if distance is None:
        distance = alibi_distance(spec, q0, q1, k0, k1, batch)
    return -_slopes(spec, batch, heads) * distance  # (..., N|1, tq, tk)


def alibi_slopes_grad_tile(
    spec: AttentionSpec,
    ds: Any,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    distance: Any | None = None,
) -> Any:
    """This tile's share of ``dL/dm_n = -sum_ij dS_nij |p_i - j|``: ``ds`` is
    ``(..., N', tq, tk)`` in the canonical layout (``N'`` the selected heads),
    the result ``(..., N')``. ``distance`` as in :func:`alibi_tile`."""
    xp = spec.xp
    if distance is None:
        distance = alibi_distance(spec, q0, q1, k0, k1, batch)
    # each row's dot product over its keys, then the sum over rows: no (..., N', tq, tk) temporary
    # (on NumPy 0.09-0.10 against 0.42 ns an entry for ds * distance summed, 2 and 4 heads of 512 keys)
    return -xp.sum(xp.vecdot(ds, distance), axis=-1)  # (..., N', tq) -> (..., N')
