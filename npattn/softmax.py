"""Masked softmax with a defined result for fully masked rows.

For scores ``s`` and visibility ``V`` along the last axis::

    m   = max_j { s_j : V_j }                (0 when no j is visible)
    l   = sum_j V_j * exp(s_j - m)
    P_j = V_j * exp(s_j - m) / l             (all 0 when l == 0)
    lse = m + log(l)                         (-inf when l == 0)

A row with nothing visible (or only ``-inf`` scores) is *fully masked*: its
probabilities are 0 and its ``lse`` is ``-inf``, never NaN. The backward of
``P`` and ``lse`` is in :mod:`npattn.dense`:
``dS = P * (dP - D)`` with ``D = rowsum(P * dP) - dlse``.
"""

from __future__ import annotations

from typing import Any

from . import dense_numpy

__all__ = ["masked_softmax", "softmax_backward"]


def masked_softmax(xp: Any, s: Any, visible: Any | None, *, overwrite: bool = False) -> tuple[Any, Any]:
    """Return ``(P, lse)``: ``P`` shaped like ``s``, ``lse`` without the last axis.

    ``overwrite``: ``s`` is the caller's own fresh array, which ``P`` may
    take over (on NumPy it does: one ``(..., T, S)`` array less to allocate
    and fault in); otherwise ``s`` is left as it is.

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> s = np.array([[0.0, 0.0], [1.0, 2.0]])
    >>> p, lse = masked_softmax(xp, s, np.array([[False, False], [True, True]]))
    >>> p[0].tolist(), float(lse[0])
    ([0.0, 0.0], -inf)
    """
    if dense_numpy.handles(xp, s.dtype):
        return dense_numpy.masked_softmax(s, visible, overwrite=overwrite)
    if visible is not None:
        s = xp.where(visible, s, -xp.inf)
    m = xp.max(s, axis=-1, keepdims=True)  # (..., T, 1)
    m = xp.where(m == -xp.inf, xp.zeros_like(m), m)  # fully masked rows: any finite m works
    e = xp.exp(s - m)  # (..., T, S), exactly 0 where hidden
    l = xp.sum(e, axis=-1, keepdims=True)  # (..., T, 1)
    empty = l == 0
    l_safe = xp.where(empty, xp.ones_like(l), l)
    p = e / l_safe
    lse = xp.where(empty, xp.full_like(l, -xp.inf), m + xp.log(l_safe))
    return p, lse[..., 0]


def softmax_backward(xp: Any, p: Any, dp: Any, D: Any, *, overwrite: bool = False) -> Any:
    """``dS = P * (dP - D)``: the softmax's backward, ``D (..., T, 1)`` the
    row sums ``rowsum(P * dP) - dlse`` (``= rowsum(dO * O) - dlse``).
    ``overwrite``: ``dp`` is the caller's own fresh array, which ``dS`` may
    take over (on NumPy it does).

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> softmax_backward(xp, np.array([[0.5, 0.5]]), np.array([[1.0, 3.0]]), np.array([[2.0]])).tolist()
    [[-0.5, 0.5]]
    """
    if dense_numpy.handles(xp, dp.dtype):
        return dense_numpy.softmax_backward(p, dp, D, overwrite=overwrite)
    return p * (dp - D)
