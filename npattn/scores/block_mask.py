"""Block masks: a user mask modification evaluated once per tile and
classified, so that calls skip the tiles it hides and build no mask where it
hides nothing (FlexAttention's ``create_block_mask``, framework-free).

The classification is a property of the mask alone, so one block mask serves
every call and layer of the same sizes. It is exact for any tiling of the
call: a tile is hidden where every block it overlaps is hidden, fully
visible where every one is fully visible, and mixed otherwise; so the NumPy
fast path's 512-wide tiles and 128-wide sub-blocks read a mask built with
128-wide blocks as well as the generic path's tiles do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import array_api_compat
import array_api_compat.numpy as numpy_namespace
import numpy as np

from ..namespace import to_numpy
from ..options import check_int, make_spec
from .mods import mask_mod_tile, tile_index

__all__ = ["BlockMask", "block_mask"]

#: Codes of :attr:`BlockMask.kinds`.
HIDDEN, VISIBLE, MIXED = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask modification with its per-block classification; build it with
    :func:`block_mask` and pass it as ``attention_forward(..., block_mask=)``.

    Attributes
    ----------
    mask_mod : callable
        The user's ``mask_mod(idx) -> bool``.
    q_len, kv_len, block_q, block_k : int
        The sizes it was built for.
    batch_shape : tuple of int, or None
        The batch axes it was evaluated over; None: the mask is the same for
        every batch element (evaluated at batch index 0).
    num_heads : int or None
        Likewise for the query heads (None: evaluated at head 0).
    q_offset : int or numpy array
        The position of query 0 (see :mod:`npattn.scores.tiles`), per batch
        element with ``bottom_right`` and lengths.
    kinds : numpy int8 array, (B|1, N|1, ceil(T / block_q), ceil(S / block_k))
        0 hidden, 1 fully visible, 2 mixed, per batch element, head and block.
    """

    mask_mod: Callable[[Any], Any]
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    batch_shape: tuple[int, ...] | None
    num_heads: int | None
    q_offset: Any
    kinds: np.ndarray

    def classify(self, q0: int, q1: int, k0: int, k1: int) -> str:
        """``"none"``, ``"all"`` or ``"some"`` for the tile ``[q0, q1) x [k0, k1)``
        over every batch element and head (the codes of
        :func:`npattn.scores.visibility.classify_tile`)."""
        blocks = self.kinds[
            :, :, q0 // self.block_q : -(-q1 // self.block_q), k0 // self.block_k : -(-k1 // self.block_k)
        ]
        if not np.any(blocks != HIDDEN):
            return "none"
        return "all" if np.all(blocks == VISIBLE) else "some"

    @property
    def sparsity(self) -> float:
        """The fraction of blocks (over batch elements and heads) that are hidden."""
        return float(np.mean(self.kinds == HIDDEN)) if self.kinds.size else 0.0

    def __repr__(self) -> str:
        counts = [int(np.sum(self.kinds == code)) for code in (HIDDEN, VISIBLE, MIXED)]
        return (
            f"BlockMask(q_len={self.q_len}, kv_len={self.kv_len}, block_q={self.block_q}, block_k={self.block_k}, "
            f"hidden={counts[0]}, visible={counts[1]}, mixed={counts[2]})"
        )


def block_mask(
    mask_mod: Callable[[Any], Any],
    /,
    q_len: int,
    kv_len: int,
    *,
    block_q: int = 128,
    block_k: int = 128,
    batch_shape: tuple[int, ...] | None = None,
    num_heads: int | None = None,
    align: str | None = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    xp: Any = None,
    device: Any = None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once over ``(T, S) = (q_len, kv_len)``, tile by
    tile, and classify every block as hidden, fully visible or mixed.

    Parameters
    ----------
    mask_mod : callable ``(idx) -> bool array``
        True = may attend; ``idx`` is a :class:`npattn.TileIndex` of a rank-4
        tile ``(B', n, tq, tk)``, the result must broadcast to it.
    q_len, kv_len : int
        T and S of the calls it will serve.
    block_q, block_k : int, optional
        Block sizes of the classification (128 by default). Any tiling of a
        call reads it exactly; finer blocks skip more of a ragged mask.
    batch_shape : tuple of int, optional
        The calls' batch axes, when the mask depends on the batch element;
        None (the default) evaluates at batch index 0 for all.
    num_heads : int, optional
        N, when the mask depends on the query head; None evaluates at head 0.
    align, q_lengths, kv_lengths : optional
        As in :func:`npattn.attention_forward`: they set the query positions
        ``idx.q``, which must be the calls' (checked when a call gets it).
    xp, device : optional
        Namespace and device of the index arrays ``mask_mod`` receives
        (NumPy by default, or that of the lengths).

    Returns
    -------
    BlockMask

    Raises
    ------
    TypeError, ValueError
        Bad sizes, or a ``mask_mod`` that does not return a bool array that
        broadcasts to the tile.

    Examples
    --------
    Four documents of 64 tokens, causal inside each:

    >>> import numpy as np, npattn
    >>> doc = np.repeat(np.arange(4), 64)
    >>> def same_doc_causal(idx):
    ...     return (doc[idx.q] == doc[idx.k]) & (idx.k <= idx.q)
    >>> mask = npattn.block_mask(same_doc_causal, 256, 256, block_q=64, block_k=64)
    >>> mask
    BlockMask(q_len=256, kv_len=256, block_q=64, block_k=64, hidden=12, visible=0, mixed=4)
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 256, 16))
    >>> out, _ = npattn.attention_forward(q, k, v, block_mask=mask, impl="chunked")
    >>> out.shape
    (1, 2, 256, 16)
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a callable mask_mod(idx) -> bool array, got {type(mask_mod).__name__}")
    T, S = check_int("q_len", q_len, minimum=0), check_int("kv_len", kv_len, minimum=1)
    bq, bk = check_int("block_q", block_q, minimum=1), check_int("block_k", block_k, minimum=1)
    heads = None if num_heads is None else check_int("num_heads", num_heads, minimum=1)
    if batch_shape is not None:
        batch_shape = tuple(check_int("batch_shape", size, minimum=0) for size in batch_shape)
    else:
        _check_lengths_need_no_batch(q_lengths, kv_lengths)
    spec = _index_spec(mask_mod, (batch_shape, heads, T, S), align, (q_lengths, kv_lengths), xp, device)
    kinds = np.empty((spec.num_batch, spec.num_heads, -(-T // bq), -(-S // bk)), dtype=np.int8)
    for i, q0 in enumerate(range(0, T, bq)):
        for j, k0 in enumerate(range(0, S, bk)):
            q1, k1 = min(q0 + bq, T), min(k0 + bk, S)
            tile = (spec.num_batch, spec.num_heads, q1 - q0, k1 - k0)
            visible = to_numpy(spec.xp.broadcast_to(mask_mod_tile(spec, tile_index(spec, q0, q1, k0, k1), tile), tile))
            seen, full = visible.any(axis=(2, 3)), visible.all(axis=(2, 3))  # (B', n) each
            kinds[:, :, i, j] = np.where(full, VISIBLE, np.where(seen, MIXED, HIDDEN))
    offset = spec.q_offset
    return BlockMask(
        mask_mod, T, S, bq, bk, batch_shape, heads, to_numpy(offset) if hasattr(offset, "shape") else offset, kinds
    )


def _check_lengths_need_no_batch(q_lengths: Any, kv_lengths: Any) -> None:
    """Raise ``ValueError`` where lengths differ per batch element but
    ``batch_shape`` is None (one batch element's positions for all)."""
    for name, lengths in (("q_lengths", q_lengths), ("kv_lengths", kv_lengths)):
        shape = tuple(getattr(lengths, "shape", ()))
        if math.prod(shape) > 1:
            raise ValueError(
                f"{name} of shape {shape} set positions per batch element: pass the calls' batch axes "
                f"as batch_shape={shape} (block_mask evaluates one element for all without it)"
            )


def _index_spec(mask_mod, sizes, align, lengths, xp, device) -> Any:
    """A spec of the calls' sizes (over zero-stride inputs) whose
    :func:`~npattn.scores.mods.tile_index` gives ``mask_mod`` its indices."""
    batch_shape, heads, T, S = sizes
    lead = (1,) if batch_shape is None else batch_shape
    xp = xp if xp is not None else _namespace_of(lengths)
    zero = xp.zeros((), dtype=xp.float32, device=device)
    q = xp.broadcast_to(zero, (*lead, heads or 1, T, 1))  # (..., N|1, T, 1), no memory behind it
    kv = xp.broadcast_to(zero, (*lead, 1, S, 1))  # (..., 1, S, 1)
    return make_spec(q, kv, kv, align=align, q_lengths=lengths[0], kv_lengths=lengths[1], mask_mod=mask_mod, xp=xp)


def _namespace_of(lengths: tuple[Any, Any]) -> Any:
    """The namespace of the lengths that are arrays, else NumPy's."""
    arrays = [a for a in lengths if hasattr(a, "shape")]
    return array_api_compat.array_namespace(*arrays) if arrays else numpy_namespace
