r"""The score pipeline of one tile, in the order every path applies it
(CONVENTIONS §1b), for query row ``i`` at position ``p_i`` and key ``j``::

    1. s = scale * q_i . k_j                         the raw product (the path's GEMM)
    2. s = c tanh(s / c)                             softcap          (softcap.py)
    3. s = s + bias_ij - m_n |p_i - j|               bias, ALiBi      (here, alibi.py)
    5. hidden -> excluded                            visibility       (visibility.py)
    6. one virtual key per head, score sinks_n       sinks            (sinks.py)
    7. softmax, dropout, out = P V                   the path's kernel

(Step 4, user score modifications, is to come.) Each step is written once,
with its derivative beside it, and called by the dense path, the generic
chunked path and the NumPy fast path alike. Steps 2-3 build canonical tiles
(broadcastable to ``(..., N, tq, tk)``, see :mod:`npattn.scores.tiles`) that
each path converts to its own layout; the backward runs them in reverse::

    dS (after step 3) = P * (dP - D)                  the kernel's
    d bias_ij        += dS_ij                          summed to the bias's shape (the kernel's)
    d m_n            += -sum_ij dS_nij |p_i - j|       ScoreParamGrads
    d raw_ij          = dS_ij (1 - tanh^2(raw_ij / c)) transform_backward
"""

from __future__ import annotations

from typing import Any

from ..namespace import sum_to_shape
from ..options import AttentionSpec
from .alibi import alibi_slopes_grad_tile, alibi_tile
from .softcap import softcap_backward, softcap_forward
from .tiles import select_item, slice_tile

__all__ = ["bias_tile", "additive_tile", "transform", "transform_backward", "ScoreParamGrads", "param_grads_from_heads"]


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
    distance: Any | None = None,
) -> Any | None:
    """Step 3's term over the tile, ``bias_ij - m_n |p_i - j|``, in the
    canonical layout and the compute dtype; None when neither is set.
    ``distance``: the tile's ``|p_i - j|`` when the caller has it (see
    :func:`~npattn.scores.alibi.alibi_tile`)."""
    terms = [bias_tile(spec, q0, q1, k0, k1, batch, heads)]
    if spec.alibi_slopes is not None:
        terms.append(alibi_tile(spec, q0, q1, k0, k1, batch, heads, distance))
    present = [term for term in terms if term is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else present[0] + present[1]


def transform(spec: AttentionSpec, raw: Any, additive: Any | None) -> Any:
    """Steps 2-3 on raw products of any layout: ``softcap(raw) + additive``,
    where ``additive`` is :func:`additive_tile` already in ``raw``'s layout."""
    s = raw if spec.softcap is None else softcap_forward(spec.xp, raw, spec.softcap)
    return s if additive is None else s + additive


def transform_backward(spec: AttentionSpec, ds: Any, raw: Any) -> Any:
    """The cotangent of the raw products from that of the scores (step 3 is
    a sum, so only the softcap's chain rule remains)."""
    if spec.softcap is None:
        return ds
    return softcap_backward(spec.xp, softcap_forward(spec.xp, raw, spec.softcap), spec.softcap, ds)


class ScoreParamGrads:
    """Gradients of the pipeline's own parameters (the ALiBi slopes), summed
    over whole-batch tiles (the dense and generic chunked paths) in the order
    the path visits them, so deterministic. The NumPy fast path sums its own
    per-item shares of :func:`~npattn.scores.alibi.alibi_slopes_grad_tile`
    and hands the total to :func:`param_grads_from_heads`.
    """

    def __init__(self, spec: AttentionSpec):
        self.spec = spec
        self.alibi: Any = None

    @property
    def needed(self) -> bool:
        """Whether any tile's ``dS`` must be passed to :meth:`add`."""
        return self.spec.alibi_slopes is not None

    def add(self, ds: Any, q0: int, q1: int, k0: int, k1: int) -> None:
        """Add the tile ``[q0, q1) x [k0, k1)``'s share, from its ``dS (..., N, tq, tk)``."""
        if self.spec.alibi_slopes is not None:
            partial = alibi_slopes_grad_tile(self.spec, ds, q0, q1, k0, k1)  # (..., N)
            self.alibi = partial if self.alibi is None else self.alibi + partial

    def result(self) -> dict[str, Any]:
        """``{"alibi_slopes": d slopes}`` in the slopes' shape (compute dtype), or ``{}``."""
        return param_grads_from_heads(self.spec, self.alibi)


def param_grads_from_heads(spec: AttentionSpec, alibi_total: Any | None) -> dict[str, Any]:
    """The parameter gradients from the per-head total ``-sum dS |p - j|``
    (broadcastable to ``(..., N)``; None when every tile was skipped), summed
    to the slopes' own shape: ``{"alibi_slopes": ...}``, or ``{}`` without ALiBi."""
    if spec.alibi_slopes is None or spec.alibi_shape is None:
        return {}
    xp = spec.xp
    heads = spec.batch_shape + (spec.num_heads,)  # (..., N)
    if alibi_total is None:
        alibi_total = xp.zeros(heads, dtype=spec.compute_dtype, device=spec.device)
    return {"alibi_slopes": sum_to_shape(xp, xp.broadcast_to(alibi_total, heads), spec.alibi_shape)}
