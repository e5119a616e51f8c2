"""Which keys each query may attend to, built tile by tile from indices.

A query at row ``i`` sits at position ``p = i + q_offset`` (``q_offset`` is 0
for ``align="top_left"``, ``S - T`` or ``kv_len - q_len`` per batch element for
``"bottom_right"``). Key ``j`` is visible to it iff every rule that is set
holds::

    mask[..., n, i, j]                       (user's boolean mask, True = keep)
    p - left <= j <= p + right               (window; causal is right = 0)
    i < q_lengths[...]  and  j < kv_lengths[...]

The dense path asks for the tile ``[0, T) x [0, S)``; the chunked path asks for
``[q0, q1) x [k0, k1)`` and first calls :func:`classify_tile` to skip tiles
that are fully hidden and to build no mask at all for fully visible ones.
Nothing here ever allocates ``T x S`` unless the caller asks for that tile.
"""

from __future__ import annotations

from typing import Any

from .options import AttentionSpec

__all__ = ["visible_tile", "bias_tile", "classify_tile", "slice_tile", "select_item", "NONE", "ALL", "SOME"]

NONE, ALL, SOME = "none", "all", "some"


def slice_tile(a: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
    """``a[..., q0:q1, k0:k1]``, leaving broadcast (size-1) axes whole."""
    rows = slice(None) if a.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if a.shape[-1] == 1 else slice(k0, k1)
    return a[..., rows, cols]


def _per_batch(spec: AttentionSpec, a: Any, batch: int | None) -> Any:
    """An array of shape ``batch_shape`` viewed as ``(..., 1, 1, 1)``, or its
    entry for the flat batch index ``batch`` (a 0-d array)."""
    if batch is not None:
        return spec.xp.reshape(a, (-1,))[batch]  # ()
    return spec.xp.reshape(a, spec.batch_shape + (1, 1, 1))


def select_item(spec: AttentionSpec, a: Any, batch: int | None, heads: tuple[int, int] | None) -> Any:
    """``a (..., N|1, x, y)`` restricted to one batch element (flat index,
    batch axes dropped) and/or query heads ``[h0, h1)``; size-1 (broadcast)
    axes are kept as they are."""
    if batch is not None:
        lead = a.ndim - 3
        index = _unravel(batch, spec.batch_shape)
        a = a[tuple(0 if a.shape[axis] == 1 else index[axis] for axis in range(lead))]  # (N|1, x, y)
    if heads is not None and a.shape[-3] != 1:
        a = a[..., heads[0] : heads[1], :, :]  # (..., h1 - h0, x, y)
    return a


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order multi-index of ``flat`` in ``shape``."""
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def visible_tile(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    heads: tuple[int, int] | None = None,
) -> Any | None:
    """Boolean visibility of the tile ``[q0, q1) x [k0, k1)``.

    Returns an array broadcastable to ``(..., N, q1 - q0, k1 - k0)``, or
    ``None`` when no rule is set (every key visible). ``batch=b`` (flat
    index) restricts it to one batch element, dropping the batch axes, and
    ``heads=(h0, h1)`` to query heads ``[h0, h1)``.
    """
    xp = spec.xp
    parts = []
    if spec.mask is not None:
        mask = select_item(spec, spec.mask, batch, heads)
        parts.append(slice_tile(mask, q0, q1, k0, k1))  # (..., N|1, tq|1, tk|1)
    if spec.has_positional_mask:
        rows = xp.reshape(xp.arange(q0, q1, dtype=xp.int64, device=spec.device), (q1 - q0, 1))  # (tq, 1)
        cols = xp.reshape(xp.arange(k0, k1, dtype=xp.int64, device=spec.device), (1, k1 - k0))  # (1, tk)
        if spec.window_left is not None or spec.window_right is not None:
            offset = spec.q_offset
            if hasattr(offset, "shape"):
                offset = _per_batch(spec, offset, batch)  # (..., 1, 1, 1)
            position = rows + offset  # (tq, 1) or (..., 1, tq, 1)
            # Positions lie in [-T, T + S) and keys in [0, S), so a side wider
            # than T + S hides nothing: clip it there to stay within int64.
            reach = spec.q_len + spec.kv_len
            if spec.window_left is not None:
                parts.append(cols >= position - min(spec.window_left, reach))
            if spec.window_right is not None:
                parts.append(cols <= position + min(spec.window_right, reach))
        if spec.q_lengths is not None:
            parts.append(rows < _per_batch(spec, spec.q_lengths, batch))  # (..., 1, tq, 1)
        if spec.kv_lengths is not None:
            parts.append(cols < _per_batch(spec, spec.kv_lengths, batch))  # (..., 1, 1, tk)
    if not parts:
        return None
    visible = parts[0]
    for part in parts[1:]:
        visible = xp.logical_and(visible, part)
    return visible


def bias_tile(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    heads: tuple[int, int] | None = None,
) -> Any | None:
    """The bias over ``[q0, q1) x [k0, k1)`` in the compute dtype, or None;
    ``batch`` and ``heads`` select as in :func:`visible_tile`."""
    if spec.bias is None:
        return None
    bias = select_item(spec, spec.bias, batch, heads)
    return spec.xp.astype(slice_tile(bias, q0, q1, k0, k1), spec.compute_dtype, copy=False)


def classify_tile(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> str:
    """Whether the tile ``[q0, q1) x [k0, k1)`` is fully hidden (``NONE``), fully
    visible (``ALL``) or mixed (``SOME``), for every batch element and head.

    Decided on the host from the index rules and the (min, max) bounds of the
    per-batch offsets and lengths; a user mask or a bias makes a tile that the
    index rules leave visible ``SOME``, since only its values could tell.
    """
    if q1 <= q0 or k1 <= k0:
        return NONE
    hidden = False
    partial = spec.mask is not None
    (omin, omax), (qmin, qmax), (kmin, kmax) = spec.offset_bounds, spec.q_len_bounds, spec.kv_len_bounds
    first_pos, last_pos = q0 + omin, q1 - 1 + omax  # extreme query positions in the tile
    if spec.window_right is not None:  # j <= p + right
        hidden |= k0 > last_pos + spec.window_right
        partial |= k1 - 1 > first_pos + spec.window_right
    if spec.window_left is not None:  # j >= p - left
        hidden |= k1 - 1 < first_pos - spec.window_left
        partial |= k0 < last_pos - spec.window_left
    if spec.q_lengths is not None:  # i < q_len
        hidden |= q0 >= qmax
        partial |= q1 > qmin
    if spec.kv_lengths is not None:  # j < kv_len
        hidden |= k0 >= kmax
        partial |= k1 > kmin
    if hidden:
        return NONE
    return SOME if partial else ALL
