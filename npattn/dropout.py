"""Counter-based dropout: the keep mask is a pure function of the indices.

For every score ``(b, n, i, j)`` (flattened batch index, query head, query
row, key column) the keep decision is::

    h    = mix(mix(mix(mix(mix(seed) ^ b) ^ n) ^ i) ^ j)     32-bit integers
    keep = h >= round(p * 2**32)                              P(keep) = 1 - p

where ``mix`` is the ``lowbias32`` integer finalizer (two xorshift-multiply
rounds, a bijection on 32-bit words with full avalanche). It is computed with
int64 arithmetic in the array namespace, masking to 32 bits after each
multiply, so the dense path, the chunked path at any block size and every
backend (NumPy, CuPy, array-api-strict, torch) draw bit-identical masks.
Kept probabilities are scaled by ``1 / (1 - p)``.
"""

from __future__ import annotations

from typing import Any

from .options import AttentionSpec

__all__ = ["keep_tile", "mix32", "keep_threshold"]

_MASK32 = 0xFFFFFFFF


def mix32(x: Any) -> Any:
    """lowbias32 finalizer on values in ``[0, 2**32)``; works on Python ints
    and on int64 arrays alike (products wrap, then are masked to 32 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keep_threshold(dropout_p: float) -> int:
    """Hashes at or above this 32-bit threshold are kept."""
    return min(round(dropout_p * 2**32), 2**32)


def _seed_hash(seed: int) -> int:
    return mix32((seed & _MASK32) ^ mix32((seed >> 32) & _MASK32))


def keep_tile(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    heads: tuple[int, int] | None = None,
    batch: int | None = None,
) -> Any:
    """Boolean keep mask of shape ``(..., N, q1 - q0, k1 - k0)``, for rows
    and columns counted from ``spec.index_origin``.

    ``heads=(h0, h1)`` restricts it to query heads ``[h0, h1)``; ``batch=b``
    to the one batch element of flat index ``b`` (the batch axes are dropped).
    """
    xp, dev = spec.xp, spec.device
    h0, h1 = heads if heads is not None else (0, spec.num_heads)
    if batch is None:
        batch = xp.reshape(
            xp.arange(spec.num_batch, dtype=xp.int64, device=dev), spec.batch_shape + (1, 1, 1)
        )  # (..., 1, 1, 1)
    head = xp.reshape(xp.arange(h0, h1, dtype=xp.int64, device=dev), (h1 - h0, 1, 1))  # (N, 1, 1)
    row0, col0 = spec.index_origin  # nonzero for a ring shard: the full sequence's indices
    rows = xp.reshape(xp.arange(row0 + q0, row0 + q1, dtype=xp.int64, device=dev), (q1 - q0, 1))  # (tq, 1)
    cols = xp.reshape(xp.arange(col0 + k0, col0 + k1, dtype=xp.int64, device=dev), (1, k1 - k0))  # (1, tk)
    assert spec.seed is not None, "make_spec requires a seed whenever dropout_p > 0"
    h = mix32(batch ^ _seed_hash(spec.seed))  # (..., 1, 1, 1)
    h = mix32(h ^ head)  # (..., N, 1, 1)
    h = mix32(h ^ rows)  # (..., N, tq, 1)
    h = mix32(h ^ cols)  # (..., N, tq, tk)
    return h >= keep_threshold(spec.dropout_p)
