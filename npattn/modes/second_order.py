r"""Second-order derivatives of attention: the backward's own derivatives,
dense and chunked.

Notation as in :mod:`npattn.dense` (per batch element and query head; dropout's
scaled keep mask ``M``, ``P_M = P * M``; ``a = dS/dR`` and ``b = d^2S/dR^2``
of the score pipeline, ``(1, 0)`` without a softcap,
:func:`npattn.scores.pipeline.raw_curvature`). The backward is::

    dP = (dO V^T) * M,   D = rowsum(dO * O) - dlse,   dS = P * (dP - D),   dR = a dS
    dQ = scale dR K,     dK = scale dR^T Q,           dV = P_M^T dO,       dbias = dS

**Forward-over-reverse** (:func:`attention_backward_jvp`): tangents ``Q', K',
V', b'`` of the inputs and ``dO'``, ``dlse'`` of the cotangents give, with
``R'``, ``S'``, ``lse'``, ``P' = P (S' - lse')`` and ``O'`` of :mod:`.jvp`::

    dP'  = (dO' V^T + dO V'^T) * M
    D'   = rowsum(dO' * O + dO * O') - dlse'
    dS'  = P' (dP - D) + P (dP' - D')
    dR'  = a dS' + b R' dS
    dQ'  = scale (dR' K + dR K'),   dK' = scale (dR'^T Q + dR^T Q'),
    dV'  = (P' M)^T dO + P_M^T dO',  dbias' = dS'

A Hessian-vector product is this with ``dO' = 0``. **Reverse-over-reverse**
(:func:`attention_double_backward`) is its transpose: with cotangents
``ddQ, ddK, ddV, ddb`` of ``dQ, dK, dV, dbias``::

    G_R  = scale (ddQ K^T + Q ddK^T)            cotangent of dR
    G    = a G_R + ddb                          cotangent of dS
    g_D  = -rowsum(P G)                         cotangent of D (per row)
    G_P  = (dO ddV^T) * M + G (dP - D) + g_D dP cotangent of P (its tangent's)
    G_S  = P (G_P - rowsum(P G_P))              cotangent of S  (= of the bias)
    G_R' = a G_S + b dS G_R
    cot Q    = scale (G_R' K + dR ddK)
    cot K    = scale (G_R'^T Q + dR^T ddQ)
    cot V    = ((P G) * M)^T dO + P_M^T (g_D dO)  = ((P (G + g_D)) * M)^T dO
    cot dO   = ((P G) * M) V + g_D O + P_M ddV     = ((P (G + g_D)) * M) V + P_M ddV
    cot dlse = -g_D

where ``rowsum(P G_P) = r + g_D rowsum(P dP)``, ``r = rowsum(P ((dO ddV^T) * M
+ G (dP - D)))`` (and ``rowsum(P dP) = rowsum(dO * O)``, ``O = P_M V``). The
chunked code takes the right-hand forms, through its own ``P``: in float32
its ``P`` and the forward's ``O`` differ in their roundings, and the
left-hand forms' cancellations (``P G V - rowsum(P G) O``) then lose up to
2x the dense path's accuracy.

**Chunked, linear memory.** Both recompute tiles as the backward does. The
forward-over-reverse needs ``O'`` and ``lse'``, row quantities: one JVP sweep
(:func:`npattn.modes.jvp.chunked_jvp`) first, then one sweep over tiles. The
double backward needs ``g_D`` and ``r`` per row: one sweep gathers them, a
second accumulates the cotangents. No ``T x S`` array per head is kept.

Sinks, ALiBi slopes and the softcap are constants here (the formulas hold with
the sink-aware ``P`` and ``lse`` of the forward); score modifications are
refused, since their interface gives no second derivative.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, NamedTuple

from ..attention import AttentionGrads, ChunkedResiduals, DenseResiduals, check_cotangent, inputs_in_compute_dtype
from ..chunked import DbiasAccumulator, default_blocks, dropout_tile, grouped, tile_ranges
from ..dense import dropout_scale, expand_kv_heads, raw_scores, reduce_kv_heads
from ..namespace import sum_to_shape
from ..options import AttentionSpec
from ..scores.pipeline import raw_curvature
from ..scores.sinks import sink_share
from ..scores.tiles import slice_tile
from ..scores.visibility import NONE, classify_tile
from . import numpy_kernels
from .jvp import check_tangents, chunked_jvp, merge_sinks_jvp, tile_scores_jvp

__all__ = ["attention_backward_jvp", "attention_double_backward", "SecondOrderCotangents"]


class SecondOrderCotangents(NamedTuple):
    """Cotangents of the backward's inputs from :func:`attention_double_backward`,
    each in its input's shape and dtype: ``dq``, ``dk``, ``dv`` (of q, k, v),
    ``ddout`` (of dout), ``dbias`` (of the bias, None without one) and
    ``ddlse`` (of dlse, in the compute dtype)."""

    dq: Any
    dk: Any
    dv: Any
    ddout: Any
    dbias: Any = None
    ddlse: Any = None


def _check_residuals(residuals: Any, what: str) -> AttentionSpec:
    if not isinstance(residuals, (DenseResiduals, ChunkedResiduals)):
        raise TypeError(f"residuals must come from npattn.attention_forward, got {type(residuals).__name__}")
    spec = residuals.spec
    if spec.score_mods:
        raise NotImplementedError(
            f"{what} with score_mods: a score modification gives its first derivative only (its backward), "
            "and the second-order modes need its second"
        )
    return spec


def _expected_primals(residuals: Any) -> list[tuple[tuple, Any]]:
    spec = residuals.spec
    shapes = [(tuple(a.shape), spec.dtype) for a in (residuals.q, residuals.k, residuals.v)]
    if spec.bias is not None:
        shapes.append((spec.bias_shape, spec.bias_dtype))
    return shapes


def attention_backward_jvp(dout, residuals, tangents, /, *, dlse=None, dout_dot=None, dlse_dot=None) -> AttentionGrads:
    r"""Forward-over-reverse: the tangents of :func:`npattn.attention_backward`'s
    gradients along tangents of the inputs (a Hessian-vector product when
    ``dout_dot`` is 0). See the module docstring for the formulas.

    Parameters
    ----------
    dout : array, (..., N, T, Hv)
        The backward's cotangent of ``out``.
    residuals : DenseResiduals or ChunkedResiduals
        From :func:`npattn.attention_forward` (its path is followed).
    tangents : tuple
        ``(q', k', v')``, with ``b'`` appended when the forward had a bias; the
        shapes and dtypes of the inputs.
    dlse : array, (..., N, T), optional
        The backward's cotangent of ``lse``.
    dout_dot, dlse_dot : arrays, optional
        Tangents of ``dout`` and ``dlse`` (0 by default).

    Returns
    -------
    AttentionGrads
        ``dq, dk, dv`` (and ``dbias``) hold the tangents of the gradients, in
        the inputs' shapes and dtypes; the other fields are None.

    Raises
    ------
    NotImplementedError
        Residuals of a forward with ``score_mods``.

    Examples
    --------
    A Hessian-vector product of ``L = <u, out>`` along ``q' = w``:

    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, u, w = (rng.standard_normal((1, 2, 5, 4)) for _ in range(5))
    >>> out, res = npattn.attention_forward(q, k, v, causal=True)
    >>> zero = np.zeros_like(q)
    >>> hvp = npattn.attention_backward_jvp(u, res, (w, zero, zero)).dq
    >>> eps = 1e-6
    >>> grad = lambda x: npattn.attention_backward(u, npattn.attention_forward(x, k, v, causal=True)[1]).dq
    >>> bool(np.allclose((grad(q + eps * w) - grad(q - eps * w)) / (2 * eps), hvp, atol=1e-7))
    True
    """
    spec = _check_residuals(residuals, "attention_backward_jvp")
    xp = spec.xp
    dO = check_cotangent(residuals, "dout", dout, tuple(residuals.out.shape), spec.dtype)
    lse_shape = tuple(residuals.lse.shape)
    dl = None if dlse is None else check_cotangent(residuals, "dlse", dlse, lse_shape, spec.compute_dtype)
    dO_dot = (
        xp.zeros_like(dO)
        if dout_dot is None
        else check_cotangent(residuals, "dout_dot", dout_dot, tuple(dO.shape), spec.dtype)
    )
    dl_dot = (
        None if dlse_dot is None else check_cotangent(residuals, "dlse_dot", dlse_dot, lse_shape, spec.compute_dtype)
    )
    dots = check_tangents(spec, _expected_primals(residuals), tangents, residuals.q)
    args = (spec, residuals, dO, dl, dots, dO_dot, dl_dot)
    dq, dk, dv, dbias = (
        _dense_backward_jvp(*args) if isinstance(residuals, DenseResiduals) else _chunked_backward_jvp(*args)
    )
    dq, dk, dv = (xp.astype(g, spec.dtype, copy=False) for g in (dq, dk, dv))
    return AttentionGrads(dq, dk, dv, None if dbias is None else xp.astype(dbias, spec.bias_dtype, copy=False))


def _row_terms(spec: AttentionSpec, out: Any, dO: Any, dl: Any, out_dot: Any, dO_dot: Any, dl_dot: Any) -> tuple:
    """``D = rowsum(dO O) - dlse`` and ``D' = rowsum(dO' O + dO O') - dlse'``, ``(..., N, T, 1)``."""
    xp = spec.xp
    D = xp.sum(dO * out, axis=-1, keepdims=True)
    D_dot = xp.sum(dO_dot * out + dO * out_dot, axis=-1, keepdims=True)
    if dl is not None:
        D = D - dl[..., None]
    if dl_dot is not None:
        D_dot = D_dot - dl_dot[..., None]
    return D, D_dot


def _dense_backward_jvp(spec, res, dO, dl, dots, dO_dot, dl_dot) -> tuple:
    """Forward-over-reverse over the whole ``(..., N, T, S)``."""
    xp, G, K = spec.xp, spec.group_size, spec.num_kv_heads
    q, k, v, p = res.q, res.k, res.v, res.probs  # p: (..., N, T, S), sinks included
    q_dot, k_dot, v_dot, bias_dot = dots
    kh, kh_dot = expand_kv_heads(xp, k, G), expand_kv_heads(xp, k_dot, G)  # (..., N, S, H)
    vh, vh_dot = expand_kv_heads(xp, v, G), expand_kv_heads(xp, v_dot, G)  # (..., N, S, Hv)
    raw_dot = spec.scale * (q_dot @ xp.matrix_transpose(kh) + q @ xp.matrix_transpose(kh_dot))  # (..., N, T, S)
    a, b = raw_curvature(spec, raw_scores(spec, q, k))
    s_dot = a * raw_dot if bias_dot is None else a * raw_dot + bias_dot
    ps = xp.where(p == 0, xp.zeros_like(p), p * s_dot)  # P S'
    p_dot = ps - p * xp.sum(ps, axis=-1, keepdims=True)  # P (S' - lse')
    drop = dropout_scale(spec)
    pm, pm_dot = (p, p_dot) if drop is None else (p * drop, p_dot * drop)
    out_dot = pm_dot @ vh + pm @ vh_dot  # (..., N, T, Hv)
    dp = dO @ xp.matrix_transpose(vh)  # (..., N, T, S)
    dp_dot = dO_dot @ xp.matrix_transpose(vh) + dO @ xp.matrix_transpose(vh_dot)
    if drop is not None:
        dp, dp_dot = dp * drop, dp_dot * drop
    D, D_dot = _row_terms(spec, res.out, dO, dl, out_dot, dO_dot, dl_dot)
    ds = p * (dp - D)
    ds_dot = p_dot * (dp - D) + p * (dp_dot - D_dot)  # (..., N, T, S)
    dr, dr_dot = a * ds, a * ds_dot + b * raw_dot * ds
    dq_dot = spec.scale * (dr_dot @ kh + dr @ kh_dot)  # (..., N, T, H)
    dk_dot = reduce_kv_heads(xp, spec.scale * (xp.matrix_transpose(dr_dot) @ q + xp.matrix_transpose(dr) @ q_dot), K)
    dv_dot = reduce_kv_heads(xp, xp.matrix_transpose(pm_dot) @ dO + xp.matrix_transpose(pm) @ dO_dot, K)
    dbias_dot = None if spec.bias is None else sum_to_shape(xp, ds_dot, spec.bias_shape)
    return dq_dot, dk_dot, dv_dot, dbias_dot


def _grouped_arrays(spec: AttentionSpec, **arrays: Any) -> Any:
    """The residuals and cotangents in the chunked path's grouped layout, as
    attributes: queries ``(..., K, G, T, .)``, keys and values (names
    starting with k, v, ddk, ddv) ``(..., K, 1, S, .)``, row terms
    ``(..., N, T)`` as ``(..., K, G, T, 1)``."""
    xp, bs = spec.xp, spec.batch_shape
    K, G = spec.num_kv_heads, spec.group_size
    views = {}
    for name, x in arrays.items():
        if name.startswith(("k", "v", "ddk", "ddv")):
            shape = bs + (K, 1) + tuple(x.shape[-2:])
        elif x.ndim == len(bs) + 2:  # (..., N, T): a row term
            shape = bs + (K, G, x.shape[-1], 1)
        else:
            shape = bs + (K, G) + tuple(x.shape[-2:])
        views[name] = xp.reshape(x, shape)
    return SimpleNamespace(**views)


def _chunked_backward_jvp(spec, res, dO, dl, dots, dO_dot, dl_dot) -> tuple:
    """Forward-over-reverse in two sweeps: the JVP's ``O'``, ``lse'``, then the tiles."""
    xp = spec.xp
    bs, N, K, G = spec.batch_shape, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    empty = _empty_sizes(spec, bs + (N, T, H), bs + (K, S, H), bs + (K, S, Hv), spec.bias_shape)
    if empty is not None:
        return empty
    q_dot, k_dot, v_dot, bias_dot = dots
    lse = xp.where(res.lse == -xp.inf, xp.zeros_like(res.lse), res.lse)  # masked rows: S = -inf gives P = 0
    fast = res.kernel == "numpy" and numpy_kernels.supports(spec)
    q, k, v = inputs_in_compute_dtype(res)
    if fast:
        out_dot, lse_dot = numpy_kernels.tangent_rows(spec, res, dots, lse)
    else:
        _, _, out_dot, lse_dot = merge_sinks_jvp(spec, *chunked_jvp(spec, q, k, v, dots))
    D, D_dot = _row_terms(spec, res.out, dO, dl, out_dot, dO_dot, dl_dot)
    if fast:
        row_terms = (lse, lse_dot, xp.reshape(D, D.shape[:-1]), xp.reshape(D_dot, D_dot.shape[:-1]))  # (..., N, T)
        return numpy_kernels.backward_jvp(spec, res, dO, row_terms, dots, dO_dot)
    g = _grouped_arrays(spec, qs=q * spec.scale, qs_dot=q_dot * spec.scale, k=k, k_dot=k_dot, v=v, v_dot=v_dot)
    r = _grouped_arrays(
        spec,
        dO=dO,
        dO_dot=dO_dot,
        lse=lse,
        lse_dot=lse_dot,
        D=xp.reshape(D, D.shape[:-1]),
        D_dot=xp.reshape(D_dot, D_dot.shape[:-1]),
    )
    block_q, block_k = default_blocks(spec)
    q_tiles, k_tiles = tile_ranges(T, block_q), tile_ranges(S, block_k)
    dq_dot = xp.zeros(bs + (K, G, T, H), dtype=spec.compute_dtype, device=spec.device)
    dk_tiles, dv_tiles, dbias = [], [], DbiasAccumulator(spec, q_tiles, k_tiles)
    for j, (k0, k1) in enumerate(k_tiles):
        kT, kT_dot = (
            xp.matrix_transpose(g.k[..., k0:k1, :]),
            xp.matrix_transpose(g.k_dot[..., k0:k1, :]),
        )  # (..., K, 1, H, tk)
        vT, vT_dot = (
            xp.matrix_transpose(g.v[..., k0:k1, :]),
            xp.matrix_transpose(g.v_dot[..., k0:k1, :]),
        )  # (..., K, 1, Hv, tk)
        dk_j = xp.zeros(bs + (K, 1, k1 - k0, H), dtype=spec.compute_dtype, device=spec.device)
        dv_j = xp.zeros(bs + (K, 1, k1 - k0, Hv), dtype=spec.compute_dtype, device=spec.device)
        for i, (q0, q1) in enumerate(q_tiles):
            kind = classify_tile(spec, q0, q1, k0, k1)
            if kind == NONE:
                continue
            rows = slice(q0, q1)
            qs, qs_dot = g.qs[..., rows, :], g.qs_dot[..., rows, :]  # (..., K, G, tq, H)
            raw = qs @ kT  # (..., K, G, tq, tk)
            raw_dot = qs_dot @ kT + qs @ kT_dot
            s, s_dot = tile_scores_jvp(spec, raw, raw_dot, bias_dot, (q0, q1, k0, k1), kind)
            a, b = raw_curvature(spec, raw)
            p = xp.exp(s - r.lse[..., rows, :])  # P (..., K, G, tq, tk)
            p_dot = p * (s_dot - r.lse_dot[..., rows, :])  # P (S' - lse')
            drop = dropout_tile(spec, q0, q1, k0, k1)
            pm, pm_dot = (p, p_dot) if drop is None else (p * drop, p_dot * drop)
            dO_i, dO_dot_i = r.dO[..., rows, :], r.dO_dot[..., rows, :]  # (..., K, G, tq, Hv)
            # (..., K, G, tk, tq) @ (..., K, G, tq, Hv), summed over G -> (..., K, 1, tk, Hv)
            dv_j = dv_j + xp.sum(
                xp.matrix_transpose(pm_dot) @ dO_i + xp.matrix_transpose(pm) @ dO_dot_i, axis=-3, keepdims=True
            )
            dp, dp_dot = dO_i @ vT, dO_dot_i @ vT + dO_i @ vT_dot  # (..., K, G, tq, tk)
            if drop is not None:
                dp, dp_dot = dp * drop, dp_dot * drop
            ds = p * (dp - r.D[..., rows, :])
            ds_dot = p_dot * (dp - r.D[..., rows, :]) + p * (dp_dot - r.D_dot[..., rows, :])
            dbias.add(i, j, ds_dot)
            dr, dr_dot = a * ds, a * ds_dot + b * raw_dot * ds
            k_j, k_dot_j = g.k[..., k0:k1, :], g.k_dot[..., k0:k1, :]  # (..., K, 1, tk, H)
            dq_dot = _add_rows(xp, dq_dot, rows, dr_dot @ k_j + dr @ k_dot_j)  # (..., K, G, tq, H)
            dk_j = dk_j + xp.sum(
                xp.matrix_transpose(dr_dot) @ qs + xp.matrix_transpose(dr) @ qs_dot, axis=-3, keepdims=True
            )
        dk_tiles.append(dk_j)
        dv_tiles.append(dv_j)
    dq_dot = spec.scale * xp.reshape(dq_dot, bs + (N, T, H))
    dk_dot = xp.reshape(xp.concat(dk_tiles, axis=-2), bs + (K, S, H))
    dv_dot = xp.reshape(xp.concat(dv_tiles, axis=-2), bs + (K, S, Hv))
    return dq_dot, dk_dot, dv_dot, dbias.result()


def _renormalize(spec: AttentionSpec, res: Any, r: Any, l_sum: Any, *row_sums: Any) -> tuple:
    """``P_ij = exp(S_ij - lse_i)`` from these scores sums to ``l_i`` over a
    row (``l_sum`` and the sink's share), exactly 1 only where the forward
    summed the same scores: the NumPy fast path's ``lse`` comes from its own,
    in base 2. Divides the row sums of ``P`` by ``l`` and moves ``r.lse`` to
    ``lse + log l``, so that both sweeps read ``P`` that sums to 1 (with the
    fast forward's ``lse``, float32 double backward had 1.4-1.8x the generic
    path's error on dQ and d dout). Rows that see nothing keep ``l = 1``."""
    xp = spec.xp
    share = sink_share(spec, res.lse)
    l = l_sum if share is None else l_sum + _grouped_arrays(spec, share=share).share  # (..., K, G, T, 1)
    l = xp.where(l == 0, xp.ones_like(l), l)
    r.lse = r.lse + xp.log(l)
    return tuple(x / l for x in row_sums)


def _add_rows(xp: Any, x: Any, rows: slice, update: Any) -> Any:
    """``x`` with ``update`` added to rows ``rows`` of axis -2 (no in-place
    writes: Array API arrays may be immutable)."""
    before, middle, after = x[..., : rows.start, :], x[..., rows, :] + update, x[..., rows.stop :, :]
    return xp.concat([before, middle, after], axis=-2)


def attention_double_backward(ddq, ddk, ddv, residuals, dout, /, *, ddbias=None, dlse=None) -> SecondOrderCotangents:
    r"""Reverse-over-reverse: the cotangents of :func:`npattn.attention_backward`'s
    inputs ``(q, k, v, dout[, bias], dlse)`` from cotangents ``ddq, ddk, ddv``
    (and ``ddbias``) of its gradients: the gradient of a scalar function of
    the gradients, as a gradient penalty needs. See the module docstring.

    Parameters
    ----------
    ddq, ddk, ddv : arrays
        Cotangents of ``dq (..., N, T, H)``, ``dk (..., K, S, H)``,
        ``dv (..., K, S, Hv)``, in the inputs' dtype.
    residuals : DenseResiduals or ChunkedResiduals
        From :func:`npattn.attention_forward` (its path is followed).
    dout : array, (..., N, T, Hv)
        The backward's cotangent of ``out``.
    ddbias : array, optional
        Cotangent of ``dbias`` (in the bias's shape and dtype), when the
        forward had a bias.
    dlse : array, (..., N, T), optional
        The backward's cotangent of ``lse``.

    Returns
    -------
    SecondOrderCotangents
        ``(dq, dk, dv, ddout, dbias, ddlse)``.

    Raises
    ------
    NotImplementedError
        Residuals of a forward with ``score_mods``.

    Examples
    --------
    The gradient of the penalty ``|dq|^2 / 2`` with respect to q:

    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, u = (rng.standard_normal((1, 2, 5, 4)) for _ in range(4))
    >>> out, res = npattn.attention_forward(q, k, v)
    >>> g = npattn.attention_backward(u, res)
    >>> cot = npattn.attention_double_backward(g.dq, np.zeros_like(k), np.zeros_like(v), res, u)
    >>> penalty = lambda x: 0.5 * np.sum(npattn.attention_backward(u, npattn.attention_forward(x, k, v)[1]).dq ** 2)
    >>> e = np.zeros_like(q); e[0, 1, 2, 3] = 1e-6
    >>> bool(np.isclose((penalty(q + e) - penalty(q - e)) / 2e-6, cot.dq[0, 1, 2, 3]))
    True
    """
    spec = _check_residuals(residuals, "attention_double_backward")
    xp = spec.xp
    dO = check_cotangent(residuals, "dout", dout, tuple(residuals.out.shape), spec.dtype)
    dl = (
        None
        if dlse is None
        else check_cotangent(residuals, "dlse", dlse, tuple(residuals.lse.shape), spec.compute_dtype)
    )
    expected = _expected_primals(residuals)
    given = (ddq, ddk, ddv) if spec.bias is None else (ddq, ddk, ddv, ddbias)
    if spec.bias is None and ddbias is not None:
        raise ValueError("ddbias was given, but the forward had no bias")
    dd = check_tangents(spec, expected, given, residuals.q, what="cotangents (ddq, ddk, ddv[, ddbias])")
    args = (spec, residuals, dO, dl, dd)
    cq, ck, cv, cdout, cbias, cdlse = (
        _dense_double_backward(*args) if isinstance(residuals, DenseResiduals) else _chunked_double_backward(*args)
    )
    cq, ck, cv, cdout = (xp.astype(c, spec.dtype, copy=False) for c in (cq, ck, cv, cdout))
    cbias = None if cbias is None else xp.astype(cbias, spec.bias_dtype, copy=False)
    return SecondOrderCotangents(cq, ck, cv, cdout, cbias, cdlse)


def _dense_double_backward(spec, res, dO, dl, dd) -> tuple:
    """Reverse-over-reverse over the whole ``(..., N, T, S)``."""
    xp, G, K = spec.xp, spec.group_size, spec.num_kv_heads
    q, k, v, p, out = res.q, res.k, res.v, res.probs, res.out
    ddq, ddk, ddv, ddb = dd
    kh, vh = expand_kv_heads(xp, k, G), expand_kv_heads(xp, v, G)  # (..., N, S, H|Hv)
    ddkh, ddvh = expand_kv_heads(xp, ddk, G), expand_kv_heads(xp, ddv, G)
    a, b = raw_curvature(spec, raw_scores(spec, q, k))
    drop = dropout_scale(spec)
    pm = p if drop is None else p * drop
    dp = dO @ xp.matrix_transpose(vh)  # (..., N, T, S)
    if drop is not None:
        dp = dp * drop
    D, _ = _row_terms(spec, out, dO, dl, out, dO, None)
    ds = p * (dp - D)
    dr = a * ds
    g_r = spec.scale * (ddq @ xp.matrix_transpose(kh) + q @ xp.matrix_transpose(ddkh))  # (..., N, T, S)
    g = a * g_r if ddb is None else a * g_r + ddb
    pg = p * g
    g_D = -xp.sum(pg, axis=-1, keepdims=True)  # (..., N, T, 1)
    dO_ddv = dO @ xp.matrix_transpose(ddvh)  # (..., N, T, S)
    if drop is not None:
        dO_ddv = dO_ddv * drop
    g_p = dO_ddv + g * (dp - D) + g_D * dp
    g_s = p * (g_p - xp.sum(p * g_p, axis=-1, keepdims=True))  # (..., N, T, S)
    g_r2 = a * g_s + b * ds * g_r
    pgm = pg if drop is None else pg * drop
    cot_q = spec.scale * (g_r2 @ kh + dr @ ddkh)  # (..., N, T, H)
    cot_k = reduce_kv_heads(xp, spec.scale * (xp.matrix_transpose(g_r2) @ q + xp.matrix_transpose(dr) @ ddq), K)
    cot_v = reduce_kv_heads(xp, xp.matrix_transpose(pgm) @ dO + xp.matrix_transpose(pm) @ (g_D * dO), K)
    cot_dout = pgm @ vh + g_D * out + pm @ ddvh  # (..., N, T, Hv)
    cot_bias = None if spec.bias is None else sum_to_shape(xp, g_s, spec.bias_shape)
    return cot_q, cot_k, cot_v, cot_dout, cot_bias, -g_D[..., 0]


def _empty_sizes(spec: AttentionSpec, *shapes: tuple | None) -> tuple | None:
    """Zeros of ``shapes`` (None stays None) when there is no query row or
    batch element to sweep over, else None."""
    if spec.num_batch and spec.q_len:
        return None
    xp = spec.xp
    return tuple(None if s is None else xp.zeros(s, dtype=spec.compute_dtype, device=spec.device) for s in shapes)


def _chunked_double_backward(spec, res, dO, dl, dd) -> tuple:
    """Reverse-over-reverse in two sweeps: ``g_D`` and ``r`` per row, then the cotangents."""
    xp = spec.xp
    bs, N, K, G = spec.batch_shape, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    empty = _empty_sizes(
        spec, bs + (N, T, H), bs + (K, S, H), bs + (K, S, Hv), bs + (N, T, Hv), spec.bias_shape, bs + (N, T)
    )
    if empty is not None:
        return empty
    ddq, ddk, ddv, ddb = dd
    D, _ = _row_terms(spec, res.out, dO, dl, res.out, dO, None)  # (..., N, T, 1)
    lse = xp.where(res.lse == -xp.inf, xp.zeros_like(res.lse), res.lse)
    q, k, v = inputs_in_compute_dtype(res)
    g = _grouped_arrays(spec, qs=q * spec.scale, k=k, v=v, ddq=ddq, ddk=ddk, ddv=ddv)
    r = _grouped_arrays(spec, dO=dO, out=res.out, lse=lse, D=xp.reshape(D, D.shape[:-1]))
    block_q, block_k = default_blocks(spec)
    q_tiles, k_tiles = tile_ranges(T, block_q), tile_ranges(S, block_k)
    kinds = {
        (i, j): classify_tile(spec, *q_tiles[i], *k_tiles[j]) for j in range(len(k_tiles)) for i in range(len(q_tiles))
    }
    visits = [(i, j) for (i, j), kind in kinds.items() if kind != NONE]  # key tiles outside, as the backward

    def tile(i: int, j: int) -> dict[str, Any]:
        """The terms of tile ``(i, j)`` both sweeps read (``(..., K, G, tq, tk)``)."""
        (q0, q1), (k0, k1) = q_tiles[i], k_tiles[j]
        rows, cols = slice(q0, q1), slice(k0, k1)
        kind = kinds[i, j]
        qs, kT = g.qs[..., rows, :], xp.matrix_transpose(g.k[..., cols, :])  # (..., K, G, tq, H), (..., K, 1, H, tk)
        raw = qs @ kT
        s, _ = tile_scores_jvp(spec, raw, raw, None, (q0, q1, k0, k1), kind)
        a, b = raw_curvature(spec, raw)
        p = xp.exp(s - r.lse[..., rows, :])
        drop = dropout_tile(spec, q0, q1, k0, k1)
        dp = r.dO[..., rows, :] @ xp.matrix_transpose(g.v[..., cols, :])  # (..., K, G, tq, tk)
        dO_ddv = r.dO[..., rows, :] @ xp.matrix_transpose(g.ddv[..., cols, :])
        if drop is not None:
            dp, dO_ddv = dp * drop, dO_ddv * drop
        g_r = spec.scale * (g.ddq[..., rows, :] @ kT) + qs @ xp.matrix_transpose(g.ddk[..., cols, :])
        bias_cot = None if ddb is None else grouped(spec, slice_tile(ddb, q0, q1, k0, k1))
        gg = a * g_r if bias_cot is None else a * g_r + bias_cot
        return dict(
            rows=rows,
            cols=cols,
            qs=qs,
            p=p,
            a=a,
            b=b,
            drop=drop,
            dp=dp,
            dO_ddv=dO_ddv,
            g_r=g_r,
            g=gg,
            D=r.D[..., rows, :],
        )

    # Sweep 1, per row: g_D = -rowsum(P G), r = rowsum(P ((dO ddV^T) M + G (dP - D))),
    # rowsum(P dP) and l = rowsum(P) (see _renormalize).
    zeros_rows = xp.zeros(bs + (K, G, T, 1), dtype=spec.compute_dtype, device=spec.device)
    g_D, r_sum, p_dp, l_sum = zeros_rows, zeros_rows, zeros_rows, zeros_rows
    for i, j in visits:
        t = tile(i, j)
        rows, p = t["rows"], t["p"]
        g_D = _add_rows(xp, g_D, rows, -xp.sum(p * t["g"], axis=-1, keepdims=True))
        p_gp_part = p * (t["dO_ddv"] + t["g"] * (t["dp"] - t["D"]))  # (..., K, G, tq, tk)
        r_sum = _add_rows(xp, r_sum, rows, xp.sum(p_gp_part, axis=-1, keepdims=True))
        p_dp = _add_rows(xp, p_dp, rows, xp.sum(p * t["dp"], axis=-1, keepdims=True))
        l_sum = _add_rows(xp, l_sum, rows, xp.sum(p, axis=-1, keepdims=True))
    g_D, r_sum, p_dp = _renormalize(spec, res, r, l_sum, g_D, r_sum, p_dp)
    p_gp = r_sum + g_D * p_dp  # rowsum(P G_P), rowsum(P dP) from these P rather than rowsum(dO O)
    # Sweep 2: the cotangents.
    cot_q = xp.zeros(bs + (K, G, T, H), dtype=spec.compute_dtype, device=spec.device)
    cot_dout = xp.zeros(bs + (K, G, T, Hv), dtype=spec.compute_dtype, device=spec.device)
    cot_k = [xp.zeros(bs + (K, 1, k1 - k0, H), dtype=spec.compute_dtype, device=spec.device) for k0, k1 in k_tiles]
    cot_v = [xp.zeros(bs + (K, 1, k1 - k0, Hv), dtype=spec.compute_dtype, device=spec.device) for k0, k1 in k_tiles]
    cot_bias = DbiasAccumulator(spec, q_tiles, k_tiles)
    for i, j in visits:
        t = tile(i, j)
        rows, cols, p, drop = t["rows"], t["cols"], t["p"], t["drop"]
        gD_i = g_D[..., rows, :]
        ds = p * (t["dp"] - t["D"])
        g_p = t["dO_ddv"] + t["g"] * (t["dp"] - t["D"]) + gD_i * t["dp"]
        g_s = p * (g_p - p_gp[..., rows, :])
        cot_bias.add(i, j, g_s)
        g_r2 = t["a"] * g_s + t["b"] * ds * t["g_r"]
        pg, pm = p * (t["g"] + gD_i), p  # P (G + g_D) = P G + g_D P: O = P_M V inside the products
        if drop is not None:
            pg, pm = pg * drop, pm * drop
        dr = t["a"] * ds
        dO_i = r.dO[..., rows, :]
        k_j, v_j = g.k[..., cols, :], g.v[..., cols, :]  # (..., K, 1, tk, H|Hv)
        cot_q = _add_rows(xp, cot_q, rows, g_r2 @ k_j + dr @ g.ddk[..., cols, :])
        cot_dout = _add_rows(xp, cot_dout, rows, pg @ v_j + pm @ g.ddv[..., cols, :])
        cot_k[j] = cot_k[j] + xp.sum(
            xp.matrix_transpose(g_r2) @ t["qs"] + spec.scale * (xp.matrix_transpose(dr) @ g.ddq[..., rows, :]),
            axis=-3,
            keepdims=True,
        )
        cot_v[j] = cot_v[j] + xp.sum(xp.matrix_transpose(pg) @ dO_i, axis=-3, keepdims=True)
    return (
        spec.scale * xp.reshape(cot_q, bs + (N, T, H)),
        xp.reshape(xp.concat(cot_k, axis=-2), bs + (K, S, H)),
        xp.reshape(xp.concat(cot_v, axis=-2), bs + (K, S, Hv)),
        xp.reshape(cot_dout, bs + (N, T, Hv)),
        cot_bias.result(),
        -xp.reshape(g_D, bs + (N, T)),
    )
