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

import array_api_compat
import numpy as np

__all__ = ["masked_softmax"]


def masked_softmax(xp: Any, s: Any, visible: Any | None) -> tuple[Any, Any]:
    """Return ``(P, lse)``: ``P`` shaped like ``s``, ``lse`` without the last axis.

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> s = np.array([[0.0, 0.0], [1.0, 2.0]])
    >>> p, lse = masked_softmax(xp, s, np.array([[False, False], [True, True]]))
    >>> p[0].tolist(), float(lse[0])
    ([0.0, 0.0], -inf)
    """
    if array_api_compat.is_numpy_namespace(xp) and s.dtype in (np.float32, np.float64):
        return _masked_softmax_numpy(s, visible)
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


def _masked_softmax_numpy(s: np.ndarray, visible: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`masked_softmax` for NumPy: the same arithmetic in the same order,
    hence the same bits, on one fresh ``(..., T, S)`` buffer updated in place
    (``out=``) rather than a new temporary per step, and with the per-row
    fix-ups done on the ``(..., T, 1)`` vectors only. ``s`` is not modified."""
    e = np.where(visible, s, -np.inf) if visible is not None else None  # (..., T, S), a fresh buffer
    m = np.maximum.reduce(s if e is None else e, axis=-1, keepdims=True)  # (..., T, 1), np.max minus its wrapper
    np.copyto(m, 0, where=m == -np.inf)  # fully masked rows: any finite m works
    e = np.subtract(s if e is None else e, m, out=e)  # (..., T, S); in place when masked
    np.exp(e, out=e)  # exactly 0 where hidden
    l = np.add.reduce(e, axis=-1, keepdims=True)  # (..., T, 1), np.sum minus its wrapper
    empty = l == 0
    np.copyto(l, 1, where=empty)
    e /= l
    lse = np.log(l)
    lse += m
    np.copyto(lse, -np.inf, where=empty)
    return e, lse[..., 0]
