r"""Step 6 of the score pipeline: learnable attention sinks (as in gpt-oss).

Each query head ``n`` gets one virtual key with score ``sinks_n`` and value
0, visible on every row that is not padding. With ``lse⁰_i`` the logsumexp
over the real keys and ``O⁰_i`` their normalized output (what every kernel
computes)::

    lse_i = log(exp(sinks_n) + sum_j visible exp(s_ij)) = logaddexp(lse⁰_i, sinks_n)
    O_i   = sum_j P_ij v_j = exp(lse⁰_i - lse_i) O⁰_i,       P_ij = exp(s_ij - lse_i)

so a sink is one more piece merged through lse, after the kernel: the same
arithmetic as :func:`npattn.merge_partials` with a piece ``(out 0, lse
sinks_n)``. A row whose real keys are all hidden gets out 0 and lse
``sinks_n``; a padded query row (``q_lengths``) stays out 0, lse -inf.

The backward needs nothing new from the kernels: they recompute
``P_ij = exp(s_ij - lse_i)`` from the final ``lse`` and use
``D_i = rowsum(dO_i * O_i) - dlse_i`` as always. The sink's own column has
``dP = dO . 0 = 0``, so its ``dS = P_sink (0 - D)``::

    dsinks_n = -sum_{b, i} exp(sinks_n - lse_i) D_i          (0 on padded rows)

Dropout never touches the sink's probability (its value is 0 anyway).
"""

from __future__ import annotations

from typing import Any

import array_api_compat

from ..namespace import sum_to_shape
from ..options import AttentionSpec
from .tiles import row_indices

__all__ = ["apply_sinks", "scaled_rows", "sinks_grad", "sink_share"]


def _sinks(spec: AttentionSpec) -> Any:
    """``sinks`` as ``(..., N|1, 1)`` in the compute dtype."""
    return spec.xp.astype(spec.sinks, spec.compute_dtype, copy=False)


def _padded_rows(spec: AttentionSpec) -> Any | None:
    """Query rows at or past ``q_lengths``: bool ``(..., 1, T)``, or None."""
    if spec.q_lengths is None:
        return None
    xp = spec.xp
    rows = xp.reshape(row_indices(spec, 0, spec.q_len), (spec.q_len,))  # (T,)
    return rows >= xp.reshape(spec.q_lengths, spec.batch_shape + (1, 1))  # (..., 1, T)


def _finite_or_zero(xp: Any, x: Any) -> Any:
    return xp.where(x == -xp.inf, xp.zeros_like(x), x)


def apply_sinks(spec: AttentionSpec, out: Any, lse: Any, *, overwrite: bool = False) -> tuple[Any, Any, Any]:
    """Merge the sinks into a kernel's ``out (..., N, T, Hv)`` and ``lse
    (..., N, T)`` over the real keys: ``(out, lse, factor)`` with
    ``factor = exp(lse⁰ - lse)`` ``(..., N, T)``, which also rescales the
    dense path's probabilities. Without sinks, returns the inputs and None.
    With ``overwrite`` (a kernel's own fresh ``out``), ``out`` may be
    rescaled in place (:func:`scaled_rows`).
    """
    if spec.sinks is None:
        return out, lse, None
    xp = spec.xp
    merged = xp.logaddexp(lse, _sinks(spec))  # (..., N, T)
    padded = _padded_rows(spec)
    if padded is not None:
        merged = xp.where(padded, xp.full_like(merged, -xp.inf), merged)  # padded rows stay fully masked
    factor = xp.where(lse == -xp.inf, xp.zeros_like(lse), xp.exp(lse - _finite_or_zero(xp, merged)))  # (..., N, T)
    return scaled_rows(xp, out, factor, overwrite=overwrite), merged, factor


def scaled_rows(xp: Any, x: Any, factor: Any, *, overwrite: bool = False) -> Any:
    """``x * factor[..., None]``, ``(..., T, D) * (..., T)``: with
    ``overwrite`` (``x`` the caller's own fresh array) in place on NumPy,
    where a second ``x``-sized array cost its page faults (sinks' forward
    1.13-1.18x plain attention's time at B=8, N=12, T=S=512 against
    0.98-1.04x in place; 2 cores, float32); a new array on other namespaces,
    whose arrays may be immutable."""
    if overwrite and array_api_compat.is_numpy_namespace(xp):
        x *= factor[..., None]  # (..., T, D) *= (..., T, 1)
        return x
    return x * factor[..., None]


def sink_share(spec: AttentionSpec, lse: Any) -> Any | None:
    """The sink's probability on each row, ``exp(sinks_n - lse_i)``, ``(...,
    N, T)`` (0 on fully masked rows, ``lse = -inf``); None without sinks."""
    if spec.sinks is None:
        return None
    xp = spec.xp
    share = xp.exp(_sinks(spec) - _finite_or_zero(xp, lse))  # (..., N, T)
    return xp.where(lse == -xp.inf, xp.zeros_like(share), share)  # padded rows: no sink


def sinks_grad(spec: AttentionSpec, dout: Any, out: Any, lse: Any, dlse: Any | None) -> Any | None:
    """``dsinks`` in the sinks' own shape (compute dtype), from the cotangent
    ``dout``, the final ``out`` and ``lse`` and the optional ``dlse``; None
    without sinks."""
    if spec.sinks is None or spec.sinks_shape is None:
        return None
    xp = spec.xp
    D = xp.sum(dout * out, axis=-1)  # (..., N, T): rowsum(dO * O)
    if dlse is not None:
        D = D - dlse
    dsinks = -xp.sum(sink_share(spec, lse) * D, axis=-1)  # (..., N)
    return sum_to_shape(xp, dsinks, spec.sinks_shape)
