r"""Forward-mode derivative (JVP) of attention, dense and chunked.

With tangents ``Q', K', V'`` of the inputs (and ``b'`` of a bias passed as a
primal), per batch element and query head, the scores' tangent follows the
score pipeline (:func:`npattn.scores.pipeline.transform_jvp`)::

    R'   = scale (Q' K^T + Q K'^T)                 the raw products'
    S'   = mods'(S3) * (softcap'(R) R' + b')        S3 = softcap(R) + bias - ALiBi

and with ``P = exp(S - lse)`` on the visible keys (0 elsewhere), dropout's
``M = keep / (1 - p)``::

    lse' = rowsum(P * S')
    P'   = P * (S' - lse')
    O'   = (P' * M) V + (P * M) V'  =  rowsum-weighted:  sum_j P_j M_j (S'_j V_j + V'_j) - lse' O

**Chunked, one sweep.** The last form is what the online softmax can carry:
beside ``m``, ``l`` and ``acc`` of the forward (see :mod:`npattn.chunked`),
each query tile keeps ``c = sum_j P~_j S'_j`` (per row) and
``acc' = sum_j P~_j M_j (S'_j V_j + V'_j)`` (per row, ``Hv`` wide), with
``P~ = exp(S - m)``, both rescaled by ``a = exp(m_old - m_new)`` exactly as
``l`` and ``acc``. At the end::

    lse' = c / l,        O' = acc' / l - lse' O

so memory stays ``O((T + S) (H + Hv))`` per head: no ``T x S`` array.

Sinks are constants here (their tangent is 0): merged after the kernel as in
the forward (:mod:`npattn.scores.sinks`), ``lse = logaddexp(lse0, sink)``,
``w = exp(lse0 - lse)``: ``lse' = w lse0'`` and ``O' = w (O0' + O0 (lse0' -
lse'))``. ALiBi slopes, the softcap and score modifications' parameters are
constants as well; score modifications enter through their backward, which
is their elementwise derivative (``f'(s) * s'``). Fully masked rows keep
``O' = 0`` and ``lse' = 0``.
"""

from __future__ import annotations

from typing import Any

from ..attention import choose_impl
from ..chunked import default_blocks, dropout_tile, grouped, tile_ranges
from ..dense import dropout_scale, expand_kv_heads
from ..namespace import resolve_namespace
from ..options import AttentionSpec, make_spec
from ..scores.pipeline import additive_tile, transform_jvp
from ..scores.sinks import apply_sinks
from ..scores.tiles import slice_tile
from ..scores.visibility import ALL, NONE, classify_tile, visible_tile
from ..softmax import masked_softmax
from . import numpy_kernels

__all__ = ["attention_jvp", "dense_jvp", "chunked_jvp", "check_tangents", "bias_tangent", "merge_sinks_jvp"]

PRIMAL_NAMES = ("q", "k", "v", "bias")


def attention_jvp(primals, tangents, /, **options):
    r"""Forward-mode derivative of :func:`npattn.attention_forward`, as ``jax.jvp``.

    .. math::

        \dot{\mathrm{lse}}_i = \sum_j P_{ij} \dot S_{ij}, \qquad
        \dot O_i = \sum_j P_{ij} M_{ij} (\dot S_{ij} v_j + \dot v_j) - \dot{\mathrm{lse}}_i O_i

    with ``S' = scale (Q' K^T + Q K'^T) + b'`` through the score pipeline
    (softcap, score modifications) and ``M`` dropout's scaled keep mask.

    Parameters
    ----------
    primals : tuple
        ``(q, k, v)``, or ``(q, k, v, bias)`` to take the bias as a primal
        (then it is not passed in ``options``).
    tangents : tuple
        Of the same structure, shapes and dtypes as ``primals``.
    **options
        Every keyword of :func:`npattn.attention_forward`. The path follows
        ``impl`` as there; the chunked path makes one sweep over the key
        tiles in linear memory (on NumPy float32/float64 in the fast path's
        machinery, :mod:`npattn.modes.numpy_kernels`).

    Returns
    -------
    out : array, (..., N, T, Hv), in q's dtype
    lse : array, (..., N, T), in the compute dtype
    out_dot, lse_dot : arrays
        Their tangents, in the same dtypes; 0 on fully masked rows.

    Raises
    ------
    TypeError, ValueError
        Bad primals or tangents (named by position and role), and every bad
        option, as :func:`npattn.attention_forward`.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> dq, dk, dv = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> out, lse, out_dot, lse_dot = npattn.attention_jvp((q, k, v), (dq, dk, dv), causal=True)
    >>> eps = 1e-6
    >>> up = npattn.attention(q + eps * dq, k + eps * dk, v + eps * dv, causal=True)
    >>> down = npattn.attention(q - eps * dq, k - eps * dk, v - eps * dv, causal=True)
    >>> bool(np.allclose((up - down) / (2 * eps), out_dot, atol=1e-8))
    True
    """
    spec, (q, k, v), dots = _spec_and_tangents(primals, tangents, options)
    if spec.impl == "dense":
        out, lse, out_dot, lse_dot = dense_jvp(spec, q, k, v, dots)
    elif numpy_kernels.supports(spec):
        out, lse, out_dot, lse_dot = numpy_kernels.forward_jvp(spec, q, k, v, dots)
    else:
        out, lse, out_dot, lse_dot = chunked_jvp(spec, q, k, v, dots)
    out, lse, out_dot, lse_dot = merge_sinks_jvp(spec, out, lse, out_dot, lse_dot)
    xp = spec.xp
    return xp.astype(out, spec.dtype, copy=False), lse, xp.astype(out_dot, spec.dtype, copy=False), lse_dot


def _spec_and_tangents(primals, tangents, options: dict) -> tuple[AttentionSpec, tuple, tuple]:
    """The validated spec (path chosen), the primals and the tangents in the compute dtype."""
    if not isinstance(primals, (tuple, list)) or len(primals) not in (3, 4):
        raise TypeError(f"primals must be a tuple (q, k, v) or (q, k, v, bias), got {type(primals).__name__}")
    if len(primals) == 4 and "bias" in options:
        raise TypeError("the bias is a primal here (primals[3]): do not pass bias= as well")
    bias = primals[3] if len(primals) == 4 else options.pop("bias", None)
    spec = choose_impl(make_spec(*primals[:3], bias=bias, **options), fused_cupy=False)  # no fused JVP kernel
    xp = spec.xp
    q, k, v = (xp.astype(a, spec.compute_dtype, copy=False) for a in primals[:3])
    dots = check_tangents(spec, [(tuple(a.shape), a.dtype) for a in primals], tangents, primals[0])
    return spec, (q, k, v), dots


def check_tangents(
    spec: AttentionSpec, expected: list[tuple[tuple, Any]], tangents: Any, primal_q: Any, what: str = "tangents"
) -> tuple:
    """``tangents`` checked against the ``(shape, dtype)`` of each primal
    ``(q, k, v[, bias])`` (same structure, shapes and dtypes, and the library
    and device of ``primal_q``) and cast: ``(q', k', v', b')`` in the compute
    dtype, ``b'`` as the full-rank view of the bias (or None)."""
    if not isinstance(tangents, (tuple, list)) or len(tangents) != len(expected):
        raise TypeError(f"{what} must be a tuple of {len(expected)} arrays, like the primals, got {tangents!r:.80}")
    xp = spec.xp
    named = {f"{what}[{i}] ({PRIMAL_NAMES[i]})": t for i, t in enumerate(tangents) if hasattr(t, "shape")}
    resolve_namespace({"the primals' q": primal_q} | named, xp)
    cast = []
    for i, ((shape, dtype), tangent) in enumerate(zip(expected, tangents)):
        name = f"{what}[{i}] ({PRIMAL_NAMES[i]})"
        if tangent is None or not hasattr(tangent, "shape"):
            raise TypeError(f"{name} must be an array of shape {shape}, got {type(tangent).__name__}")
        if tuple(tangent.shape) != tuple(shape):
            raise ValueError(f"{name} must have the primal's shape {tuple(shape)}, got {tuple(tangent.shape)}")
        if tangent.dtype != dtype:
            raise TypeError(f"{name} must have the primal's dtype {dtype}, got {tangent.dtype}")
        cast.append(xp.astype(tangent, spec.compute_dtype, copy=False))
    bias_dot = bias_tangent(spec, cast[3]) if len(cast) == 4 else None
    return cast[0], cast[1], cast[2], bias_dot


def bias_tangent(spec: AttentionSpec, bias_dot: Any) -> Any:
    """The bias tangent viewed as the spec's bias, ``(..., N|1, T|1, S|1)``."""
    return spec.xp.reshape(bias_dot, tuple(spec.bias.shape))


def merge_sinks_jvp(spec: AttentionSpec, out: Any, lse: Any, out_dot: Any, lse_dot: Any) -> tuple:
    """The sinks merged into a kernel's results and their tangents (sinks constant)."""
    merged_out, merged_lse, w = apply_sinks(spec, out, lse)
    if w is None:
        return out, lse, out_dot, lse_dot
    merged_lse_dot = w * lse_dot  # (..., N, T)
    merged_out_dot = w[..., None] * (out_dot + out * (lse_dot - merged_lse_dot)[..., None])  # (..., N, T, Hv)
    return merged_out, merged_lse, merged_out_dot, merged_lse_dot


def dense_jvp(spec: AttentionSpec, q: Any, k: Any, v: Any, dots: tuple) -> tuple[Any, Any, Any, Any]:
    """The JVP over the whole ``(..., N, T, S)``: ``(out, lse, out', lse')``
    over the real keys (sinks merged by the caller)."""
    xp, G = spec.xp, spec.group_size
    q_dot, k_dot, v_dot, bias_dot = dots
    kh, kh_dot = expand_kv_heads(xp, k, G), expand_kv_heads(xp, k_dot, G)  # (..., N, S, H)
    raw = spec.scale * (q @ xp.matrix_transpose(kh))  # (..., N, T, S)
    raw_dot = spec.scale * (q_dot @ xp.matrix_transpose(kh) + q @ xp.matrix_transpose(kh_dot))  # (..., N, T, S)
    whole = (0, spec.q_len, 0, spec.kv_len)
    s, s_dot = transform_jvp(spec, raw, raw_dot, additive_tile(spec, *whole), bias_dot, whole)
    p, lse = masked_softmax(xp, s, visible_tile(spec, *whole))  # (..., N, T, S), (..., N, T)
    ps = xp.where(p == 0, xp.zeros_like(p), p * s_dot)  # P * S', 0 where hidden
    lse_dot = xp.sum(ps, axis=-1)  # (..., N, T)
    p_dot = ps - p * lse_dot[..., None]  # (..., N, T, S)
    drop = dropout_scale(spec)
    if drop is not None:
        p, p_dot = p * drop, p_dot * drop
    vh, vh_dot = expand_kv_heads(xp, v, G), expand_kv_heads(xp, v_dot, G)  # (..., N, S, Hv)
    return p @ vh, lse, p_dot @ vh + p @ vh_dot, lse_dot  # (..., N, T, Hv) x 2


def chunked_jvp(spec: AttentionSpec, q: Any, k: Any, v: Any, dots: tuple) -> tuple[Any, Any, Any, Any]:
    """The JVP in one online-softmax sweep per query tile (see the module
    docstring): ``(out, lse, out', lse')`` over the real keys."""
    xp = spec.xp
    bs, N, K, G = spec.batch_shape, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    if spec.num_batch == 0 or T == 0:  # nothing to sweep
        zeros = [xp.zeros(bs + (N, T) + tail, dtype=spec.compute_dtype, device=spec.device) for tail in ((Hv,), ())]
        return zeros[0], xp.full(bs + (N, T), -xp.inf, dtype=spec.compute_dtype, device=spec.device), *zeros
    q_dot, k_dot, v_dot, bias_dot = dots
    qs, qs_dot = (xp.reshape(x, bs + (K, G, T, H)) * spec.scale for x in (q, q_dot))  # (..., K, G, T, H), scaled
    kT, kT_dot = (xp.matrix_transpose(xp.reshape(x, bs + (K, 1, S, H))) for x in (k, k_dot))  # (..., K, 1, H, S)
    vg, vg_dot = (xp.reshape(x, bs + (K, 1, S, Hv)) for x in (v, v_dot))  # (..., K, 1, S, Hv)
    block_q, block_k = default_blocks(spec)
    tiles = []
    for q0, q1 in tile_ranges(T, block_q):
        sweep = _TangentSweep(spec, q1 - q0)
        for k0, k1 in tile_ranges(S, block_k):
            kind = classify_tile(spec, q0, q1, k0, k1)
            if kind == NONE:
                continue
            raw = qs[..., q0:q1, :] @ kT[..., k0:k1]  # (..., K, G, tq, tk)
            raw_dot = qs_dot[..., q0:q1, :] @ kT[..., k0:k1] + qs[..., q0:q1, :] @ kT_dot[..., k0:k1]
            s, s_dot = tile_scores_jvp(spec, raw, raw_dot, bias_dot, (q0, q1, k0, k1), kind)
            sweep.add(s, s_dot, vg[..., k0:k1, :], vg_dot[..., k0:k1, :], dropout_tile(spec, q0, q1, k0, k1))
        tiles.append(sweep.result())
    out, lse, out_dot, lse_dot = (xp.concat([tile[i] for tile in tiles], axis=-2) for i in range(4))
    return (
        xp.reshape(out, bs + (N, T, Hv)),
        xp.reshape(lse, bs + (N, T)),
        xp.reshape(out_dot, bs + (N, T, Hv)),
        xp.reshape(lse_dot, bs + (N, T)),
    )


def tile_scores_jvp(spec: AttentionSpec, raw: Any, raw_dot: Any, bias_dot: Any, tile: tuple, kind: str) -> tuple:
    """A tile's scores and their tangent, ``(..., K, G, tq, tk)`` each, hidden
    scores set to ``-inf`` (and their tangents to 0)."""
    xp = spec.xp
    additive = additive_tile(spec, *tile)
    additive = None if additive is None else grouped(spec, additive)  # (..., K|1, G|1, tq|1, tk|1)
    additive_dot = None if bias_dot is None else grouped(spec, slice_tile(bias_dot, *tile))
    s, s_dot = transform_jvp(spec, raw, raw_dot, additive, additive_dot, tile)
    if kind != ALL:
        visible = visible_tile(spec, *tile)
        if visible is not None:
            visible = grouped(spec, visible)
            s = xp.where(visible, s, -xp.inf)
            s_dot = xp.where(visible, s_dot, xp.zeros_like(s_dot))
    return s, s_dot


class _TangentSweep:
    """One query tile's online softmax with its tangent: ``m``, ``l``,
    ``acc`` of the forward and ``c = sum P~ S'``, ``acc' = sum P~ M (S' V + V')``."""

    def __init__(self, spec: AttentionSpec, rows: int):
        xp, bs = spec.xp, spec.batch_shape
        K, G, Hv = spec.num_kv_heads, spec.group_size, spec.value_dim
        self.xp = xp

        def zeros(width):
            return xp.zeros(bs + (K, G, rows, width), dtype=spec.compute_dtype, device=spec.device)

        self.m = xp.full(bs + (K, G, rows, 1), -xp.inf, dtype=spec.compute_dtype, device=spec.device)
        self.l, self.c, self.acc, self.acc_dot = zeros(1), zeros(1), zeros(Hv), zeros(Hv)

    def add(self, s: Any, s_dot: Any, v: Any, v_dot: Any, drop: Any | None) -> None:
        """One key tile: scores and tangents ``(..., K, G, tq, tk)``, values ``(..., K, 1, tk, Hv)``."""
        xp = self.xp
        m_new = xp.maximum(self.m, xp.max(s, axis=-1, keepdims=True))  # (..., K, G, tq, 1)
        m_safe = xp.where(m_new == -xp.inf, xp.zeros_like(m_new), m_new)  # no exp(-inf - -inf)
        a = xp.exp(self.m - m_safe)  # (..., K, G, tq, 1)
        p = xp.exp(s - m_safe)  # P~ (..., K, G, tq, tk)
        ps = p * s_dot  # P~ S'
        self.l = a * self.l + xp.sum(p, axis=-1, keepdims=True)
        self.c = a * self.c + xp.sum(ps, axis=-1, keepdims=True)
        if drop is not None:
            p, ps = p * drop, ps * drop
        self.acc = a * self.acc + p @ v  # (..., K, G, tq, tk) @ (..., K, 1, tk, Hv) -> (..., K, G, tq, Hv)
        self.acc_dot = a * self.acc_dot + ps @ v + p @ v_dot  # (..., K, G, tq, Hv)
        self.m = m_new

    def result(self) -> tuple[Any, Any, Any, Any]:
        """``(O, lse, O', lse')`` of the tile's rows: ``(..., K, G, tq, Hv|1)``."""
        xp = self.xp
        empty = self.l == 0  # rows that saw no key
        l_safe = xp.where(empty, xp.ones_like(self.l), self.l)
        out = self.acc / l_safe
        lse = xp.where(empty, xp.full_like(self.l, -xp.inf), self.m + xp.log(l_safe))
        lse_dot = self.c / l_safe
        return out, lse, self.acc_dot / l_safe - lse_dot * out, lse_dot
