"""NumPy fast paths of the dense path's elementwise steps: in-place ufuncs.

The dense path (:mod:`npattn.dense`) is written once against the Array API;
on NumPy its softmax and the softmax's backward make a fresh temporary per
step, and a fresh ``(..., N, T, S)`` array costs page faults as well as a
pass. These functions do the same arithmetic in the same order, hence give
the same bits, on one buffer updated with ``out=``. :mod:`npattn.softmax`
calls them for NumPy float32/float64 arrays; ``tests/test_softmax.py``
checks them against the generic versions bit for bit.

:func:`plain_forward` and :func:`plain_backward` are the whole dense pass
for a call whose scores stay raw (``AttentionSpec.scores_are_raw``: keys
may be hidden, but no bias, softcap, ALiBi, score modification or dropout
applies), which :mod:`npattn.dense` hands them: the same operations with
NumPy's own methods, the per-call floor of small calls;
``tests/test_dense.py`` checks them against the general code bit for bit.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

__all__ = ["handles", "masked_softmax", "softmax_backward", "plain_forward", "plain_backward", "narrow_columns"]


def handles(xp: Any, dtype: Any) -> bool:
    """Whether arrays of namespace ``xp`` and ``dtype`` take these kernels:
    NumPy in float32 or float64."""
    return array_api_compat.is_numpy_namespace(xp) and dtype in (np.float32, np.float64)


def masked_softmax(
    s: np.ndarray, visible: np.ndarray | None, *, overwrite: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`npattn.softmax.masked_softmax` for NumPy: the same arithmetic in the same order,
    hence the same bits, on one ``(..., T, S)`` buffer updated in place
    (``out=``) rather than a new temporary per step, and with the per-row
    fix-ups done on the ``(..., T, 1)`` vectors only. That buffer is ``s``
    itself with ``overwrite`` (the caller's fresh scores, which become P),
    else a fresh one and ``s`` is not modified."""
    e: np.ndarray | None = None
    if overwrite:
        e = s
        if visible is not None:
            np.copyto(e, -np.inf, where=np.logical_not(visible))  # the bits of np.where(visible, s, -inf)
    elif visible is not None:
        e = np.where(visible, s, -np.inf)  # (..., T, S), a fresh buffer
    m = np.maximum.reduce(s if e is None else e, axis=-1, keepdims=True)  # (..., T, 1), np.max minus its wrapper
    # Fully masked rows: m = -inf, and exactly these get l = 0 below (a finite m
    # gives its own entry exp(0) = 1); the fix-ups run only where one exists.
    # One reduction asks whether any exists (fmin skips a NaN row beside an
    # empty one; ``initial`` covers T = 0): cheaper than (m == -inf).any().
    empty = None
    if np.fmin.reduce(m, axis=None, initial=np.inf) == -np.inf:
        empty = m == -np.inf  # (..., T, 1)
        np.copyto(m, 0, where=empty)  # any finite m works
    e = np.subtract(s if e is None else e, m, out=e)  # (..., T, S); in place when masked or overwriting
    np.exp(e, out=e)  # exactly 0 where hidden
    l = np.add.reduce(e, axis=-1, keepdims=True)  # (..., T, 1), np.sum minus its wrapper
    if empty is not None:
        np.copyto(l, 1, where=empty)
    e /= l
    lse = np.log(l, out=l)  # l is spent: its buffer takes lse
    lse += m
    if empty is not None:
        np.copyto(lse, -np.inf, where=empty)
    return e, lse[..., 0]


def softmax_backward(p: np.ndarray, dp: np.ndarray, D: np.ndarray, *, overwrite: bool = False) -> np.ndarray:
    """:func:`npattn.softmax.softmax_backward` for NumPy: ``(dP - D) * P``
    (the same bits as ``P * (dP - D)``) into one buffer: ``dp`` itself with
    ``overwrite``, else a fresh one."""
    ds = np.subtract(dp, D, out=dp if overwrite else None)  # (..., T, S)
    ds *= p
    return ds


def plain_forward(
    spec: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray | None = None
) -> tuple[Any, Any, Any]:
    """:func:`npattn.dense.dense_forward` for raw scores (``spec.scores_are_raw``:
    no step of the pipeline changes them), of which ``visible`` (the
    pipeline's :func:`~npattn.scores.visibility.visible_tile` over the whole
    ``(..., N, T, S)``, or None) hides some: the same operations in the same
    order, hence the same bits, with NumPy's own methods and without the
    namespace's wrappers (``np.reshape``'s and ``np.swapaxes``' Python layers
    cost 0.3-0.6 µs a call): a small call's floor."""
    *lead, N, T, H = q.shape
    K, S, Hv = k.shape[-3], k.shape[-2], v.shape[-1]
    rows = (N // K) * T if K else 0  # G*T: the query heads of a kv head, stacked
    qs = (spec.scale * q).reshape((*lead, K, rows, H))  # (..., K, G*T, H)
    qs_t = narrow_columns(qs.swapaxes(-1, -2))  # (..., K, H, G*T)
    s = (k @ qs_t).swapaxes(-1, -2).reshape((*lead, N, T, S))  # (..., N, T, S): (K Q^T)^T
    p, lse = masked_softmax(s, visible, overwrite=True)  # (..., N, T, S), (..., N, T): P over the products
    out = (p.reshape((*lead, K, rows, S)) @ v).reshape((*lead, N, T, Hv))  # (..., K, G*T, Hv) -> (..., N, T, Hv)
    return out, lse, p


def plain_backward(
    spec: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, p: np.ndarray, out: np.ndarray, dout: np.ndarray, dlse: Any
) -> tuple[Any, Any, Any]:
    """:func:`npattn.dense.dense_backward` for raw scores (``spec.scores_are_raw``):
    ``(dq, dk, dv)`` from the same operations in the same order, hence the
    same bits (hidden keys have ``P = 0``, so ``dS = 0`` there)."""
    *lead, N, T, H = q.shape
    K, S, Hv = k.shape[-3], k.shape[-2], v.shape[-1]
    rows = (N // K) * T if K else 0
    dout_g = np.reshape(dout, (*lead, K, rows, Hv))  # (..., K, G*T, Hv)
    dv = np.swapaxes(np.reshape(p, (*lead, K, rows, S)), -1, -2) @ dout_g  # (..., K, S, Hv)
    dp = np.reshape(np.swapaxes(v @ np.swapaxes(dout_g, -1, -2), -1, -2), (*lead, N, T, S))  # (..., N, T, S)
    D = np.sum(dout * out, axis=-1, keepdims=True)  # (..., N, T, 1): rowsum(P * dP), over Hv not S
    if dlse is not None:
        D = D - dlse[..., None]
    ds_g = np.reshape(softmax_backward(p, dp, D, overwrite=True), (*lead, K, rows, S))  # (..., K, G*T, S), over dP
    dq = spec.scale * np.reshape(ds_g @ k, (*lead, N, T, H))  # (..., N, T, H)
    dk = spec.scale * (np.swapaxes(ds_g, -1, -2) @ np.reshape(q, (*lead, K, rows, H)))  # (..., K, S, H)
    return dq, dk, dv


#: A product's right-hand operand with at most this many columns is made
#: C-contiguous first (:func:`narrow_columns`).
NARROW_COLUMNS = 8


def narrow_columns(x: np.ndarray) -> np.ndarray:
    """``x`` (..., H, n) as a C-contiguous copy when ``n <= NARROW_COLUMNS``,
    else as it is. OpenBLAS multiplies a row-major ``K`` by a contiguous
    block of a few columns up to 2.2x faster than by the transposed view of
    a few rows (decoding: 4 query heads per kv head, S=512: 0.46x the
    product's time; never slower from 1 to 8 columns, S=512 or 4096); from
    16 columns the view is as fast or faster.

    >>> x = np.zeros((4, 128), dtype=np.float32).T  # (128, 4): a transposed view
    >>> narrow_columns(x).flags["C_CONTIGUOUS"], narrow_columns(np.zeros((16, 128)).T) is not None
    (True, True)
    """
    return np.ascontiguousarray(x) if x.shape[-1] <= NARROW_COLUMNS else x
