"""Tiles of the score matrix and the indices every pipeline step reads.

A tile is the block ``[q0, q1) x [k0, k1)`` of the scores ``(..., N, T, S)``,
optionally restricted to one batch element (``batch=b``, its flat index; the
batch axes are then dropped) and to query heads ``[h0, h1)``. Every step of
the pipeline builds its part of a tile in this *canonical layout*: arrays
broadcastable to ``(..., N, tq, tk)``, keeping size-1 (broadcast) axes. Each
path converts canonical tiles to its own layout (the generic chunked path's
grouped heads, the NumPy fast path's position-major rows).

A query at row ``i`` sits at position ``p = i + q_offset`` (``q_offset`` is 0
for ``align="top_left"``, ``S - T`` or ``kv_len - q_len`` per batch element
for ``"bottom_right"``); key ``j`` sits at position ``j``. Causal/window and
ALiBi read these positions.
"""

from __future__ import annotations

from typing import Any

from numpy.lib.stride_tricks import as_strided

from ..options import AttentionSpec

__all__ = [
    "slice_tile",
    "per_batch",
    "select_item",
    "unravel",
    "query_positions",
    "key_positions",
    "row_indices",
    "diagonal_view",
]


def slice_tile(a: Any, q0: int, q1: int, k0: int, k1: int) -> Any:
    """``a[..., q0:q1, k0:k1]``, leaving broadcast (size-1) axes whole."""
    rows = slice(None) if a.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if a.shape[-1] == 1 else slice(k0, k1)
    return a[..., rows, cols]


def per_batch(spec: AttentionSpec, a: Any, batch: int | None) -> Any:
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
        index = unravel(batch, spec.batch_shape)
        a = a[tuple(0 if a.shape[axis] == 1 else index[axis] for axis in range(lead))]  # (N|1, x, y)
    if heads is not None and a.shape[-3] != 1:
        a = a[..., heads[0] : heads[1], :, :]  # (..., h1 - h0, x, y)
    return a


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order multi-index of ``flat`` in ``shape``.

    >>> unravel(5, (2, 3))
    (1, 2)
    """
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def row_indices(spec: AttentionSpec, q0: int, q1: int) -> Any:
    """Query rows ``[q0, q1)`` as an int64 column ``(tq, 1)``."""
    xp = spec.xp
    return xp.reshape(xp.arange(q0, q1, dtype=xp.int64, device=spec.device), (q1 - q0, 1))  # (tq, 1)


def key_positions(spec: AttentionSpec, k0: int, k1: int) -> Any:
    """Key positions ``[k0, k1)`` as an int64 row ``(1, tk)``."""
    xp = spec.xp
    return xp.reshape(xp.arange(k0, k1, dtype=xp.int64, device=spec.device), (1, k1 - k0))  # (1, tk)


def query_positions(spec: AttentionSpec, q0: int, q1: int, batch: int | None = None) -> Any:
    """Positions ``i + q_offset`` of query rows ``[q0, q1)``: ``(tq, 1)``, or
    ``(..., 1, tq, 1)`` when the offset differs per batch element (bottom_right
    with lengths) and no single ``batch`` is selected."""
    offset = spec.q_offset
    if hasattr(offset, "shape"):
        offset = per_batch(spec, offset, batch)  # (..., 1, 1, 1) or ()
    return row_indices(spec, q0, q1) + offset  # (tq, 1) or (..., 1, tq, 1)


def diagonal_view(diagonals: Any, tq: int, tk: int) -> Any:
    """A NumPy array ``(..., tq + tk - 1)`` of values along a tile's
    diagonals, seen as the ``(..., tq, tk)`` tile: entry ``[..., i, j]`` is
    ``diagonals[..., tq - 1 - i + j]``, so entries with the same ``j - i``
    share a value (a Toeplitz matrix). A read-only strided view, no copy;
    the last axis stays contiguous. Position terms that depend on ``p_i - j``
    alone (ALiBi, relative-position biases) are built this way on NumPy.

    >>> import numpy as np
    >>> diagonal_view(np.arange(4), 2, 3).tolist()
    [[1, 2, 3], [0, 1, 2]]
    """
    contiguous = diagonals if diagonals.flags.c_contiguous else diagonals.copy()
    assert contiguous.shape[-1] == tq + tk - 1, "one value per diagonal of the tile"
    step = contiguous.itemsize
    return as_strided(
        contiguous[..., tq - 1 :],
        shape=contiguous.shape[:-1] + (tq, tk),
        strides=contiguous.strides[:-1] + (-step, step),
        writeable=False,
    )
