r"""The score pipeline of one tile, in the order every path applies it
(CONVENTIONS §1b), for query row ``i`` at position ``p_i`` and key ``j``::

    1. s = scale * q_i . k_j                         the raw product (the path's GEMM)
    2. s = c tanh(s / c)                             softcap          (softcap.py)
    3. s = s + bias_ij - m_n |p_i - j|               bias, ALiBi      (here, alibi.py)
    4. s = f_M(... f_1(s, idx) ...)                  user score mods  (mods.py)
    5. hidden -> excluded                            visibility       (visibility.py, mask_mod: mods.py)
    6. one virtual key per head, score sinks_n       sinks            (sinks.py)
    7. softmax, dropout, out = P V                   the path's kernel

Each step is written once,
with its derivative beside it, and called by the dense path, the generic
chunked path and the NumPy fast path alike. Steps 2-3 build canonical tiles
(broadcastable to ``(..., N, tq, tk)``, see :mod:`npattn.scores.tiles`) that
each path converts to its own layout; the backward runs them in reverse::

    dS (after step 4) = P * (dP - D)                  the kernel's
    dS (after step 3) = f_1'( ... f_M'(dS))            each mod's backward, d params by name
    d bias_ij        += dS_ij                          summed to the bias's shape (the kernel's)
    d m_n            += -sum_ij dS_nij |p_i - j|       ScoreParamGrads
    d raw_ij          = dS_ij (1 - tanh^2(raw_ij / c)) transform_backward
"""

from __future__ import annotations

from typing import Any

from ..namespace import sum_to_shape
from ..options import AttentionSpec
from .alibi import alibi_slopes_grad_tile, alibi_tile
from .mods import mods_backward, mods_forward, mods_jvp, tile_index
from .softcap import softcap_backward, softcap_forward
from .tiles import select_item, slice_tile

__all__ = [
    "bias_tile",
    "additive_tile",
    "transform",
    "transform_backward",
    "transform_jvp",
    "mods_keeping_masked",
    "raw_curvature",
    "ScoreParamGrads",
    "param_grads_from_heads",
]


def bias_tile(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    heads: tuple[int, int] | None = None,
) -> Any | None:
    """The user's bias over ``[q0, q1) x [k0, k1)`` in the compute dtype, or
    None; ``batch`` and ``heads`` select as in :mod:`npattn.scores.tiles`."""
    if spec.bias is None:
        return None
    bias = select_item(spec, spec.bias, batch, heads)
    return spec.xp.astype(slice_tile(bias, q0, q1, k0, k1), spec.compute_dtype, copy=False)


def additive_tile(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    heads: tuple[int, int] | None = None,
) -> Any | None:
    """Step 3's term over the tile, ``bias_ij - m_n |p_i - j|``, in the
    canonical layout and the compute dtype; None when neither is set."""
    terms = [bias_tile(spec, q0, q1, k0, k1, batch, heads)]
    if spec.alibi_slopes is not None:
        terms.append(alibi_tile(spec, q0, q1, k0, k1, batch, heads))
    present = [term for term in terms if term is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else present[0] + present[1]


def transform(spec: AttentionSpec, raw: Any, additive: Any | None, tile: tuple[int, int, int, int]) -> Any:
    """Steps 2-4 on the raw products of the tile ``(q0, q1, k0, k1)`` over every
    batch element and head, in a layout that reshapes to ``(B, N, tq, tk)``
    (the dense path's ``(..., N, T, S)``, the generic chunked path's
    ``(..., K, G, tq, tk)``): ``mods(softcap(raw) + additive)``, where
    ``additive`` is :func:`additive_tile` already in ``raw``'s layout."""
    s = _steps_2_3(spec, raw, additive)
    return s if not spec.score_mods else _mods_on(spec, s, tile)[0]


def transform_backward(
    spec: AttentionSpec,
    ds: Any,
    raw: Any,
    additive: Any | None,
    tile: tuple[int, int, int, int],
    params: ScoreParamGrads,
) -> tuple[Any, Any]:
    """The chain rule of :func:`transform`, from the scores' cotangent ``ds``:
    ``(ds3, draw)``, the cotangents of step 3's output (the bias's and
    ALiBi's, whose shares go to ``params`` with the modifications') and of
    the raw products."""
    if spec.score_mods:
        s3 = _steps_2_3(spec, raw, additive)
        _, inputs = _mods_on(spec, s3, tile)
        xp = spec.xp
        ds4 = xp.reshape(ds, _rank4(spec, tile))  # (B, N, tq, tk)
        ds4, shares = mods_backward(spec, ds4, inputs, tile_index(spec, *tile))
        params.add_mods(shares)
        ds = xp.reshape(ds4, tuple(ds.shape))
    if params.needed:
        params.add(ds, *tile)
    if spec.softcap is None:
        return ds, ds
    return ds, softcap_backward(spec.xp, softcap_forward(spec.xp, raw, spec.softcap), spec.softcap, ds)


def transform_jvp(
    spec: AttentionSpec, raw: Any, raw_dot: Any, additive: Any | None, additive_dot: Any | None, tile: tuple
) -> tuple[Any, Any]:
    """:func:`transform` and its tangent, ``(s, s_dot)``, in ``raw``'s layout:
    ``s_dot = mods'(s3) * (softcap'(raw) * raw_dot + additive_dot)``, where
    ``additive_dot`` is the bias's tangent (or None)."""
    s = _steps_2_3(spec, raw, additive)
    s_dot = raw_dot
    if spec.softcap is not None:
        s_dot = s_dot * raw_curvature(spec, raw)[0]
    if additive_dot is not None:
        s_dot = s_dot + additive_dot
    if spec.score_mods:
        xp = spec.xp
        s, inputs = _mods_on(spec, s, tile)
        s_dot4 = xp.reshape(s_dot, _rank4(spec, tile))  # (B, N, tq, tk): raw_dot's full shape
        s_dot = xp.reshape(mods_jvp(spec, s_dot4, inputs, tile_index(spec, *tile)), tuple(raw.shape))
    return s, s_dot


def raw_curvature(spec: AttentionSpec, raw: Any) -> tuple[Any, Any]:
    """``(a, b) = (dS/dR, d^2S/dR^2)`` of steps 2-3 at the raw products, for
    the second-order modes: with a softcap ``a = 1 - t^2``, ``b = -2 t a / c``
    (``t = tanh(R / c)``); without one ``(1, 0)`` as Python floats. Score
    modifications would need their second derivative, which their interface
    does not give (:func:`npattn.attention_backward_jvp` refuses them)."""
    if spec.softcap is None:
        return 1.0, 0.0
    t = spec.xp.tanh(raw / spec.softcap)
    a = 1 - t * t
    return a, (-2.0 / spec.softcap) * t * a


def _steps_2_3(spec: AttentionSpec, raw: Any, additive: Any | None) -> Any:
    """``softcap(raw) + additive`` in ``raw``'s layout."""
    s = raw if spec.softcap is None else softcap_forward(spec.xp, raw, spec.softcap)
    return s if additive is None else s + additive


def _rank4(spec: AttentionSpec, tile: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    q0, q1, k0, k1 = tile
    return (spec.num_batch, spec.num_heads, q1 - q0, k1 - k0)


def _mods_on(spec: AttentionSpec, s: Any, tile: tuple[int, int, int, int]) -> tuple[Any, list[Any]]:
    """Step 4 on a tile over every batch element and head, seen as rank 4
    (see :func:`mods_keeping_masked`)."""
    xp = spec.xp
    s4 = xp.reshape(s, _rank4(spec, tile))  # (B, N, tq, tk)
    out, inputs = mods_keeping_masked(spec, s4, tile_index(spec, *tile))
    return xp.reshape(out, tuple(s.shape)), inputs


def mods_keeping_masked(spec: AttentionSpec, s4: Any, idx: Any) -> tuple[Any, list[Any]]:
    """:func:`~npattn.scores.mods.mods_forward`, where a ``-inf`` bias entry
    stays a mask (CONVENTIONS §1): the modifications see 0 there (their
    functions and derivatives stay finite) and their output is ``-inf``
    again. Only a bias can make a score ``-inf`` before step 4."""
    if spec.bias is None:
        return mods_forward(spec, s4, idx)
    xp = spec.xp
    masked = s4 == -xp.inf
    out, inputs = mods_forward(spec, xp.where(masked, xp.zeros_like(s4), s4), idx)
    return xp.where(masked, xp.full_like(out, -xp.inf), out), inputs


class ScoreParamGrads:
    """Gradients of the pipeline's own parameters (the ALiBi slopes, the
    score modifications' parameters), summed over tiles in the order the path
    visits them, so deterministic. The NumPy fast path sums per-item shares
    (:func:`~npattn.scores.alibi.alibi_slopes_grad_tile`, the modifications'
    backward) and hands the totals to :func:`param_grads_from_heads`.
    """

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.alibi: Any = None
        self.mods: dict[str, Any] = {}

    @property
    def needed(self) -> bool:
        """Whether any tile's ``dS`` must be passed to :meth:`add`."""
        return self.spec.alibi_slopes is not None

    def add(self, ds: Any, q0: int, q1: int, k0: int, k1: int) -> None:
        """Add the tile ``[q0, q1) x [k0, k1)``'s share, from its ``dS (..., N, tq, tk)``
        (or ``(..., K, G, tq, tk)``), the cotangent of step 3's output."""
        if self.spec.alibi_slopes is not None:
            ds = self.spec.xp.reshape(ds, self.spec.batch_shape + (self.spec.num_heads, q1 - q0, k1 - k0))
            partial = alibi_slopes_grad_tile(self.spec, ds, q0, q1, k0, k1)  # (..., N)
            self.alibi = partial if self.alibi is None else self.alibi + partial

    def add_mods(self, shares: dict[str, Any]) -> None:
        """Add one tile's shares of the modifications' parameter cotangents."""
        for name, share in shares.items():
            self.mods[name] = share if name not in self.mods else self.mods[name] + share

    def result(self) -> dict[str, Any]:
        """See :func:`param_grads_from_heads`."""
        return param_grads_from_heads(self.spec, self.alibi, self.mods)


def param_grads_from_heads(
    spec: AttentionSpec, alibi_total: Any | None, mods: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The parameter gradients in the compute dtype: ``"alibi_slopes"`` from
    the per-head total ``-sum dS |p - j|`` (broadcastable to ``(..., N)``;
    None when every tile was skipped), summed to the slopes' shape, and
    ``"mods"``, the modifications' parameters by name (zeros for one no tile
    reached). Keys only for what the call has."""
    xp = spec.xp
    grads: dict[str, Any] = {}
    if spec.alibi_slopes is not None and spec.alibi_shape is not None:
        heads = spec.batch_shape + (spec.num_heads,)  # (..., N)
        if alibi_total is None:
            alibi_total = xp.zeros(heads, dtype=spec.compute_dtype, device=spec.device)
        grads["alibi_slopes"] = sum_to_shape(xp, xp.broadcast_to(alibi_total, heads), spec.alibi_shape)
    if spec.score_mods:
        grads["mods"] = {
            name: mods[name] if mods and name in mods else xp.zeros_like(param)
            for name, param in spec.mod_params.items()
        }
    return grads
