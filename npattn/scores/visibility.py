"""Step 5 of the score pipeline: which keys each query may attend to, built
tile by tile from indices.

A query at row ``i`` sits at position ``p = i + q_offset`` (see
:mod:`npattn.scores.tiles`). Key ``j`` is visible to it iff every rule that
is set holds::

    mask[..., n, i, j]                       (user's boolean mask, True = keep)
    p - left <= j <= p + right               (window; causal is right = 0)
    i < q_lengths[...]  and  j < kv_lengths[...]
    q_segment_ids[..., i] == kv_segment_ids[..., j]    (packed documents)
    mask_mod(idx)[b, n, i, j]                (user mask modification, npattn.scores.mods)

The dense path asks for the tile ``[0, T) x [0, S)``; the chunked path asks for
``[q0, q1) x [k0, k1)`` and first calls :func:`classify_tile` to skip tiles
that are fully hidden and to build no mask at all for fully visible ones.
Nothing here ever allocates ``T x S`` unless the caller asks for that tile.
"""

from __future__ import annotations

from typing import Any

from ..options import AttentionSpec
from .mods import mask_mod_tile, tile_index
from .tiles import key_positions, per_batch, query_positions, row_indices, select_item, slice_tile

__all__ = ["visible_tile", "classify_tile", "segments_hide_nothing", "window_reach", "NONE", "ALL", "SOME"]

NONE, ALL, SOME = "none", "all", "some"


def window_reach(spec: AttentionSpec) -> int:
    """A window side at least this wide hides nothing: every ``|p_i - j|``
    is smaller. Query positions ``i + q_offset`` lie within ``T`` of the
    offsets' bounds and keys in ``[0, S)``; the offset may exceed ``T + S``
    (a ring shard's queries far from its keys), so it counts too.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 4, 2))
    >>> window_reach(make_spec(x, x[:, :3], x[:, :3], causal=True, align="bottom_right"))
    8
    """
    omin, omax = spec.offset_bounds
    return spec.q_len + spec.kv_len + max(abs(omin), abs(omax))


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
        cols = key_positions(spec, k0, k1)  # (1, tk)
        if spec.window_left is not None or spec.window_right is not None:
            position = query_positions(spec, q0, q1, batch)  # (tq, 1) or (..., 1, tq, 1)
            reach = window_reach(spec)  # a wider side hides nothing: clipped to stay within int64
            if spec.window_left is not None:
                parts.append(cols >= position - min(spec.window_left, reach))
            if spec.window_right is not None:
                parts.append(cols <= position + min(spec.window_right, reach))
        if spec.q_lengths is not None:
            rows = row_indices(spec, q0, q1)  # (tq, 1)
            parts.append(rows < per_batch(spec, spec.q_lengths, batch))  # (..., 1, tq, 1)
        if spec.kv_lengths is not None:
            parts.append(cols < per_batch(spec, spec.kv_lengths, batch))  # (..., 1, 1, tk)
    if spec.has_segments:
        parts.append(_same_segment(spec, q0, q1, k0, k1, batch))  # (..., 1, tq, tk) or (tq, tk)
    if spec.mask_mod is not None and (spec.block_mask is None or spec.block_mask.classify(q0, q1, k0, k1) != ALL):
        parts.append(_mask_mod_part(spec, q0, q1, k0, k1, batch, heads))  # (..., n, tq, tk) or (n, tq, tk)
    if not parts:
        return None
    visible = parts[0]
    for part in parts[1:]:
        visible = xp.logical_and(visible, part)
    return visible


def classify_tile(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> str:
    """Whether the tile ``[q0, q1) x [k0, k1)`` is fully hidden (``NONE``), fully
    visible (``ALL``) or mixed (``SOME``), for every batch element and head.

    Decided on the host from the index rules and the (min, max) bounds of the
    per-batch offsets and lengths, the range of the segment ids of each
    batch element, and a block mask (:func:`npattn.block_mask`); a user mask,
    or a mask modification without a block mask, makes a tile that the other
    rules leave visible ``SOME``, since only its values could tell.
    """
    if q1 <= q0 or k1 <= k0:
        return NONE
    hidden = False
    partial = spec.mask is not None or (spec.mask_mod is not None and spec.block_mask is None)
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
    if spec.has_segments:
        segments = _classify_segments(spec, q0, q1, k0, k1)
        hidden |= segments == NONE
        partial |= segments == SOME
    if spec.block_mask is not None:  # the user mask modification, classified once per block
        blocks = spec.block_mask.classify(q0, q1, k0, k1)
        hidden |= blocks == NONE
        partial |= blocks == SOME
    if hidden:
        return NONE
    return SOME if partial else ALL


def segments_hide_nothing(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> bool:
    """Whether the segment-id rule leaves the whole tile visible in every
    batch element (no ids given, or one id throughout each element's tile),
    so that the tile's visibility is that of the other rules alone."""
    return not spec.has_segments or _classify_segments(spec, q0, q1, k0, k1) == ALL


def _same_segment(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int, batch: int | None) -> Any:
    """``q_segment_ids[..., i] == kv_segment_ids[..., j]`` over the tile:
    ``(..., 1, tq, tk)``, or ``(tq, tk)`` for one batch element."""
    xp = spec.xp
    q_ids, kv_ids = spec.q_segment_ids, spec.kv_segment_ids
    if batch is not None:
        q_ids = xp.reshape(q_ids, (spec.num_batch, spec.q_len))[batch, :]  # (T,)
        kv_ids = xp.reshape(kv_ids, (spec.num_batch, spec.kv_len))[batch, :]  # (S,)
    lead = tuple(q_ids.shape[:-1])
    rows = xp.reshape(q_ids[..., q0:q1], lead + (q1 - q0, 1))  # (..., tq, 1)
    cols = xp.reshape(kv_ids[..., k0:k1], lead + (1, k1 - k0))  # (..., 1, tk)
    same = rows == cols  # (..., tq, tk)
    return same if batch is not None else xp.reshape(same, lead + (1, q1 - q0, k1 - k0))  # (..., 1, tq, tk)


def _classify_segments(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int) -> str:
    """``NONE`` where, in every batch element, the tile's query ids and key
    ids lie in disjoint ranges; ``ALL`` where every id of the tile is one and
    the same value (per batch element); ``SOME`` otherwise. Host-side, from
    the spec's NumPy copies of the ids."""
    host = spec.segment_host
    assert host is not None, "segment ids come with their host copies"
    if host.q.shape[0] == 0:
        return NONE
    q_min, q_max = _extremes(host, "q", q0, q1)
    kv_min, kv_max = _extremes(host, "kv", k0, k1)
    per_batch = list(zip(q_min, q_max, kv_min, kv_max))
    if all(qx < kn or kx < qn for qn, qx, kn, kx in per_batch):
        return NONE
    if all(qn == qx == kn == kx for qn, qx, kn, kx in per_batch):
        return ALL
    return SOME


def _extremes(host: Any, side: str, start: int, stop: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each batch element's (min, max) id over ``[start, stop)`` of the
    ``side`` (``"q"`` or ``"kv"``) ids, as Python ints, memoized in
    ``host.extremes`` (threads may compute one twice; both are equal)."""
    key = (side, start, stop)
    found = host.extremes.get(key)
    if found is None:
        ids = (host.q if side == "q" else host.kv)[:, start:stop]  # (B, n)
        found = host.extremes[key] = (tuple(ids.min(axis=1).tolist()), tuple(ids.max(axis=1).tolist()))
    return found


def _mask_mod_part(
    spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int, batch: int | None, heads: tuple[int, int] | None
) -> Any:
    """The user's ``mask_mod`` over the tile, in the canonical layout:
    ``(..., n, tq, tk)``, or ``(n, tq, tk)`` for one batch element."""
    xp = spec.xp
    idx = tile_index(spec, q0, q1, k0, k1, batch, heads)
    n = idx.head.shape[1]
    tile = (idx.batch.shape[0], n, q1 - q0, k1 - k0)  # (B', n, tq, tk)
    visible = xp.broadcast_to(mask_mod_tile(spec, idx, tile), tile)
    lead = () if batch is not None else spec.batch_shape
    return xp.reshape(visible, lead + tile[1:])  # (..., n, tq, tk)
