r"""Merging partial attention results computed over disjoint sets of keys.

If the keys (and values) of one attention call are split into pieces
``K = [K_1, ..., K_P]``, attention over all of them is a weighted sum of
attention over each piece, the weights coming from the pieces' logsumexps::

    lse   = logsumexp_i(lse_i)                  (..., T)
    w_i   = exp(lse_i - lse)                    (..., T), sums to 1 over i
    out   = sum_i w_i * out_i                   (..., T, Hv)

because ``out_i = sum_{j in piece i} exp(s_j - lse_i) v_j`` and
``exp(s_j - lse) = w_i * exp(s_j - lse_i)``. This is the step that
FlashAttention's split-KV decoding and ring (sequence-parallel) attention
repeat, and it is useful on one machine too: attending over a long KV cache
held in pieces, one piece at a time.

Backward (hand-derived; ``<a, b>`` is the dot product over the last axis).
With ``dlse_total/dlse_i = w_i`` and ``dw_i/dlse_k = w_i (delta_ik - w_k)``::

    dout_i = w_i * dout                                       (..., T, Hv)
    dlse_i = w_i * (dlse + <dout, out_i - out>)               (..., T)

``dlse`` (the cotangent of the merged ``lse``) may be None, meaning 0.

Rows where ``lse_i = -inf`` (part ``i`` saw no key) get ``w_i = 0``: they add
nothing to ``out`` and receive zero gradient. A row that is ``-inf`` in every
part stays fully masked: ``out = 0``, ``lse = -inf`` and all its gradients 0,
never NaN (CONVENTIONS §1). The ``out_i`` must be finite (attention returns 0
on fully masked rows).

Attention sinks (``sinks=`` of :func:`npattn.attention_forward`) are one more
piece: a virtual key per head with score ``sinks_n`` and value 0, i.e. the
piece ``(out 0, lse sinks_n)``. So the merge stays exact with sinks when the
sink enters exactly once:

* pass ``sinks=`` to exactly one piece's ``attention_forward`` (any one) and
  none to the others; that piece's ``attention_backward`` (with the
  ``dlse`` from :func:`merge_partials_backward`) returns ``dsinks``; or
* merge the sink-free pieces, then one more piece ``out = 0``,
  ``lse = sinks`` broadcast to ``(..., N, T)`` (``-inf`` on padded query
  rows, where attention gives the sink no share); its ``dlse``, summed over
  the batch axes and rows, is ``dsinks``.

Passing ``sinks=`` to two pieces counts the sink twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .namespace import array_device, check_floating, compute_dtype, resolve_namespace

__all__ = ["merge_partials", "merge_partials_backward", "MergeResiduals"]


@dataclass(frozen=True, eq=False)
class MergeResiduals:
    """What :func:`merge_partials_backward` needs, saved by :func:`merge_partials`.

    Attributes
    ----------
    xp : namespace
        The Array API namespace of the parts.
    outs : tuple of arrays, each (..., T, Hv)
        The partial outputs in the compute dtype.
    weights : tuple of arrays, each (..., T)
        ``w_i = exp(lse_i - lse)``; 0 where ``lse_i = -inf``.
    out : array, (..., T, Hv)
        The merged output in the compute dtype.
    out_dtype, lse_dtype : dtypes
        The dtypes of the parts' ``outs`` and ``lses`` (and of their gradients).
    """

    xp: Any
    outs: tuple
    weights: tuple
    out: Any
    out_dtype: Any
    lse_dtype: Any


def _check_parts(outs: Any, lses: Any, xp: Any) -> Any:
    """Validate the parts and return their namespace."""
    for name, parts in (("outs", outs), ("lses", lses)):
        if not isinstance(parts, (list, tuple)):
            raise TypeError(f"{name} must be a list or tuple of arrays, got {type(parts).__name__}")
    if len(outs) != len(lses):
        raise ValueError(f"outs and lses must have one entry per part, got {len(outs)} and {len(lses)}")
    if not outs:
        raise ValueError("merge_partials needs at least one part")
    named = {f"outs[{i}]": o for i, o in enumerate(outs)}
    named.update({f"lses[{i}]": s for i, s in enumerate(lses)})
    for name, a in named.items():
        if a is None:
            raise TypeError(f"{name} must be an array, got None")
    xp = resolve_namespace(named, xp)
    shape = tuple(outs[0].shape)
    if len(shape) < 1:
        raise ValueError("each out must have rank >= 1 with layout (..., T, Hv), got a scalar")
    for i, (o, s) in enumerate(zip(outs, lses)):
        if tuple(o.shape) != shape:
            raise ValueError(f"outs must share one shape: outs[0] has {shape}, outs[{i}] has {tuple(o.shape)}")
        if tuple(s.shape) != shape[:-1]:
            raise ValueError(
                f"lses[{i}] must have shape out.shape[:-1] = {shape[:-1]} (one lse per row), got {tuple(s.shape)}"
            )
        for name, a, first in ((f"outs[{i}]", o, outs[0]), (f"lses[{i}]", s, lses[0])):
            check_floating(xp, name, a)
            if a.dtype != first.dtype:
                raise TypeError(f"{name} has dtype {a.dtype}, but part 0 has {first.dtype}; parts must share one dtype")
    return xp


def merge_partials(outs, lses, /, *, xp=None):
    r"""Combine attention results computed over disjoint sets of keys.

    .. math::

        \mathrm{lse} = \log\sum_i e^{\mathrm{lse}_i},\qquad
        \mathrm{out} = \sum_i e^{\mathrm{lse}_i - \mathrm{lse}}\,\mathrm{out}_i

    Attention of queries ``Q`` over the keys ``[K_1, ..., K_P]`` (any split
    along the key axis) equals the merge of attention of ``Q`` over each
    ``K_i`` with its values ``V_i``, out and lse alike; gradients flow back
    through :func:`merge_partials_backward`. With attention sinks, give
    ``sinks=`` to exactly one piece (or merge one extra piece ``(0,
    sinks)``; see the module docstring): a sink is a piece of its own.

    Dimension legend: ... leading axes (batch, heads), T rows (queries),
    Hv value dim.

    Parameters
    ----------
    outs : sequence of P arrays, each (..., T, Hv)
        Partial outputs, one per part; finite, one shape and dtype.
    lses : sequence of P arrays, each (..., T)
        Their natural-log logsumexps; ``-inf`` where a part saw no key.
    xp : namespace, optional
        Array API namespace; inferred from the arrays by default.

    Returns
    -------
    out : array, (..., T, Hv), in the outs' dtype
        0 on rows that are ``-inf`` in every part.
    lse : array, (..., T), in the lses' dtype
        ``-inf`` on rows that are ``-inf`` in every part.
    residuals : MergeResiduals
        For :func:`merge_partials_backward`.

    Raises
    ------
    TypeError
        Not a list/tuple, non-floating or mixed dtypes, arrays from two libraries.
    ValueError
        No parts, unequal numbers of outs and lses, shapes that do not match.

    Examples
    --------
    Attention over a long key sequence, held in two pieces:

    >>> import numpy as np, npattn
    >>> from npattn.merge import merge_partials
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 3, 4))        # (N, T, H)
    >>> k = rng.standard_normal((2, 7, 4))        # (K, S, H)
    >>> v = rng.standard_normal((2, 7, 5))        # (K, S, Hv)
    >>> full, res = npattn.attention_forward(q, k, v)
    >>> o1, r1 = npattn.attention_forward(q, k[:, :3], v[:, :3])
    >>> o2, r2 = npattn.attention_forward(q, k[:, 3:], v[:, 3:])
    >>> out, lse, _ = merge_partials([o1, o2], [r1.lse, r2.lse])
    >>> bool(np.allclose(out, full)), bool(np.allclose(lse, res.lse))
    (True, True)

    With attention sinks: exactly one piece gets them.

    >>> sinks = np.array([0.5, -1.0])             # (N,)
    >>> full, res = npattn.attention_forward(q, k, v, sinks=sinks)
    >>> o1, r1 = npattn.attention_forward(q, k[:, :3], v[:, :3], sinks=sinks)
    >>> o2, r2 = npattn.attention_forward(q, k[:, 3:], v[:, 3:])
    >>> out, lse, _ = merge_partials([o1, o2], [r1.lse, r2.lse])
    >>> bool(np.allclose(out, full)), bool(np.allclose(lse, res.lse))
    (True, True)

    A row that no part saw stays fully masked:

    >>> out, lse, _ = merge_partials([np.zeros((1, 2))] * 2, [np.array([-np.inf])] * 2)
    >>> out.tolist(), lse.tolist()
    ([[0.0, 0.0]], [-inf])
    """
    xp = _check_parts(outs, lses, xp)
    out_dtype, lse_dtype = outs[0].dtype, lses[0].dtype
    cdtype = compute_dtype(xp, xp.result_type(out_dtype, lse_dtype))
    outs_c = tuple(xp.astype(o, cdtype, copy=False) for o in outs)
    lses_c = tuple(xp.astype(s, cdtype, copy=False) for s in lses)
    m = lses_c[0]
    for s in lses_c[1:]:
        m = xp.maximum(m, s)  # (..., T)
    m_safe = xp.where(m == -xp.inf, xp.zeros_like(m), m)  # all -inf: any finite m works
    total = xp.zeros_like(m)
    for s in lses_c:
        total = total + xp.exp(s - m_safe)  # (..., T); exp(-inf) = 0
    empty = total == 0  # rows that no part saw
    lse = xp.where(empty, xp.full_like(m, -xp.inf), m_safe + xp.log(xp.where(empty, xp.ones_like(total), total)))
    lse_safe = xp.where(empty, xp.zeros_like(lse), lse)
    weights = tuple(xp.exp(s - lse_safe) for s in lses_c)  # w_i (..., T); 0 where lse_i = -inf
    out = xp.zeros_like(outs_c[0])
    for w, o in zip(weights, outs_c):
        out = out + w[..., None] * o  # (..., T, 1) * (..., T, Hv) -> (..., T, Hv)
    residuals = MergeResiduals(xp, outs_c, weights, out, out_dtype, lse_dtype)
    return xp.astype(out, out_dtype, copy=False), xp.astype(lse, lse_dtype, copy=False), residuals


def merge_partials_backward(dout, dlse, residuals, /):
    r"""Gradients of :func:`merge_partials` with respect to every part.

    .. math::

        w_i = e^{\mathrm{lse}_i - \mathrm{lse}},\qquad
        d\mathrm{out}_i = w_i\, d\mathrm{out},\qquad
        d\mathrm{lse}_i = w_i \big(d\mathrm{lse} + \langle d\mathrm{out},\ \mathrm{out}_i - \mathrm{out}\rangle\big)

    where ``<., .>`` sums over the last (value) axis.

    Parameters
    ----------
    dout : array, (..., T, Hv)
        Cotangent of the merged ``out``, in its dtype.
    dlse : array, (..., T), or None
        Cotangent of the merged ``lse``; None means 0.
    residuals : MergeResiduals
        From :func:`merge_partials`; reusable.

    Returns
    -------
    douts : tuple of P arrays, each (..., T, Hv), in the outs' dtype
    dlses : tuple of P arrays, each (..., T), in the lses' dtype
        Zero on rows where that part's ``lse_i`` was ``-inf``.

    Raises
    ------
    TypeError
        Residuals not from :func:`merge_partials`, cotangents of the wrong dtype.
    ValueError
        Cotangents of the wrong shape.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.merge import merge_partials, merge_partials_backward
    >>> outs = [np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]])]
    >>> lses = [np.array([0.0]), np.array([0.0])]        # equal weights 1/2
    >>> out, lse, res = merge_partials(outs, lses)
    >>> douts, dlses = merge_partials_backward(np.array([[1.0, 0.0]]), None, res)
    >>> douts[0].tolist(), dlses[0].tolist(), dlses[1].tolist()
    ([[0.5, 0.0]], [0.25], [-0.25])
    """
    if not isinstance(residuals, MergeResiduals):
        raise TypeError(f"residuals must come from merge_partials, got {type(residuals).__name__}")
    xp = residuals.xp
    out = residuals.out
    cdtype = out.dtype
    if dout is None:
        raise TypeError(f"dout must be an array of the merged out's shape {tuple(out.shape)}, got None")
    resolve_namespace({"the merged parts": out, "dout": dout, "dlse": dlse})
    if tuple(dout.shape) != tuple(out.shape):
        raise ValueError(f"dout must have the merged out's shape {tuple(out.shape)}, got {tuple(dout.shape)}")
    if dout.dtype != residuals.out_dtype:
        raise TypeError(f"dout must have dtype {residuals.out_dtype} (as the merged out), got {dout.dtype}")
    dout_c = xp.astype(dout, cdtype, copy=False)
    if dlse is None:
        dlse_c = xp.zeros(tuple(out.shape[:-1]), dtype=cdtype, device=array_device(out))
    else:
        if tuple(dlse.shape) != tuple(out.shape[:-1]):
            raise ValueError(f"dlse must have the merged lse's shape {tuple(out.shape[:-1])}, got {tuple(dlse.shape)}")
        if dlse.dtype != residuals.lse_dtype:
            raise TypeError(f"dlse must have dtype {residuals.lse_dtype} (as the merged lse), got {dlse.dtype}")
        dlse_c = xp.astype(dlse, cdtype, copy=False)
    douts, dlses = [], []
    for w, o in zip(residuals.weights, residuals.outs):
        douts.append(xp.astype(w[..., None] * dout_c, residuals.out_dtype, copy=False))  # (..., T, Hv)
        inner = xp.sum(dout_c * (o - out), axis=-1)  # <dout, out_i - out>  (..., T)
        dlses.append(xp.astype(w * (dlse_c + inner), residuals.lse_dtype, copy=False))  # (..., T)
    return tuple(douts), tuple(dlses)
