"""NumPy fast paths of the dense path's elementwise steps: in-place ufuncs.

The dense path (:mod:`npattn.dense`) is written once against the Array API;
on NumPy its softmax and the softmax's backward make a fresh temporary per
step, and a fresh ``(..., N, T, S)`` array costs page faults as well as a
pass. These functions do the same arithmetic in the same order, hence give
the same bits, on one buffer updated with ``out=``. :mod:`npattn.softmax`
calls them for NumPy float32/float64 arrays; ``tests/test_softmax.py``
checks them against the generic versions bit for bit.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

__all__ = ["handles", "masked_softmax", "softmax_backward"]


def handles(xp: Any, dtype: Any) -> bool:
    """Whether arrays of namespace ``xp`` and ``dtype`` take these kernels:
    NumPy in float32 or float64."""
    return array_api_compat.is_numpy_namespace(xp) and dtype in (np.float32, np.float64)


def masked_softmax(s: np.ndarray, visible: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`npattn.softmax.masked_softmax` for NumPy: the same arithmetic in the same order,
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


def softmax_backward(p: np.ndarray, dp: np.ndarray, D: np.ndarray) -> np.ndarray:
    """:func:`npattn.softmax.softmax_backward` for NumPy: ``(dP - D) * P``
    (the same bits as ``P * (dP - D)``) into one fresh buffer."""
    ds = np.subtract(dp, D)  # (..., T, S)
    ds *= p
    return ds
