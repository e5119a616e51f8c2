"""NumPy's BLAS: products cut to the sizes it runs fastest.

OpenBLAS, the BLAS of NumPy's wheels, multiplies ``(M, K) @ (K, N)`` with at
most :data:`SMALL_PRODUCT_LIMIT` multiply-adds ``M N K`` in its small-matrix
kernels, which read the operands where they lie, and larger products in its
packed kernels, which first copy both into panels. On the cores that have
the small kernels (x86-64 with AVX-512: :data:`SMALL_KERNEL_CORES`) the
packed path runs products of 1 to 4 million multiply-adds slower than the
same rows cut into pieces that each fit the small kernels. Measured on one
thread (2 cores of an AMD EPYC that OpenBLAS 0.3.31 runs as SkylakeX, 8
products per call), GFLOP/s whole -> in pieces:

=======================  ===================  ===================
product (M x K x N)      float32              float64
=======================  ===================  ===================
128 x 64 x 128           92 -> 109 (2)        45 -> 55 (2)
128 x 128 x 64           92 -> 111 (2)        44 -> 55 (2)
256 x 64 x 128           95 -> 110 (3)        46 -> 54 (3)
128 x 64 x 128, A^T      91 -> 107 (2)        37 -> 54 (2)
=======================  ===================  ===================

A transposed right-hand operand takes a kernel that the small path
refuses, and cut into pieces it ran slower (81 -> 65 at 128 x 64 x 128),
so :func:`matmul` leaves it whole. A piece sums each entry's ``K`` terms
one after another, as the packed kernels do up to their block of ``K``:
the same bits for sums of up to :data:`SAME_BITS_TERMS` terms, while
longer sums, which the packed kernels add block by block, may differ in
their last bits; :func:`matmul` cuts only the former, so that a product
gives the same bits cut or whole (``tests/test_blas_numpy.py``).

The small kernels run on the calling thread alone, while OpenBLAS threads a
packed product of this size when it may: :func:`matmul` is for products
inside :func:`~npattn.threads.single_threaded_blas`, the pool's items.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

__all__ = [
    "matmul",
    "row_pieces",
    "small_product_limit",
    "SMALL_PRODUCT_LIMIT",
    "SMALL_KERNEL_CORES",
    "MAX_PIECES",
    "ROW_STRIDE_LIMIT",
    "SAME_BITS_TERMS",
    "MIN_BATCH",
]

#: OpenBLAS's bound on ``M N K`` for its small-matrix kernels
#: (``kernel/x86_64/sgemm_small_kernel_permit_skylakex.c``).
SMALL_PRODUCT_LIMIT = 10**6

#: The OpenBLAS cores (``openblas_get_corename``, as threadpoolctl reports
#: it) whose kernels include the small-matrix ones.
SMALL_KERNEL_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})

#: Products needing more pieces than this stay whole. Alone, more pieces
#: paid too (256 x 64 x 128 in 3 pieces: 95 -> 110 GFLOP/s; a 512 x 64 x 512
#: tile in 22 pieces of 24 rows: 94 -> 106), but each piece is a NumPy call
#: of its own, and products that need more than two are those of longer
#: spans, whose right-hand rows lie further apart. In the fast path
#: (``impl="chunked"``, 2 cores, float32, one process, interleaved) against
#: no cutting: up to 2 pieces, B=32, N=8, T=S=128 forward 0.96x and backward
#: 0.88x, B=8, N=8, T=S=256 causal backward 0.96x, B=8, N=12, T=S=512
#: causal backward 0.98x; up to 4, the same 0.93x, 0.89x, 0.96x and
#: 1.02x, and B=4, N=16 on K=4, T=S=512 causal backward 0.98-1.04x; up to
#: 32, B=1, N=8, T=S=4096 1.06x forward and 1.21x forward+backward.
MAX_PIECES = 2

#: ... and products of longer sums stay whole: up to 384 terms the small
#: kernels gave the packed kernels' bits, float32 and float64 alike, but not
#: from 449 (float32) and 448 (float64) on (OpenBLAS 0.3.31, SkylakeX).
SAME_BITS_TERMS = 384

#: ... and batches of fewer products than this stay whole: a piece is a
#: NumPy call of its own (a few microseconds, against the 3 or so that
#: cutting saves a 128 x 64 x 128 product), and the fast path's items of one
#: or two kv heads on long sequences took 1.03-1.05x the time with their
#: diagonal spans' products cut (B=1, N=8, T=S=4096 window of 256;
#: B=1, N=16, T=S=2048 causal forward), against 0.88-0.96x for items of 8
#: to 16 heads at T=S=128 and 256.
MIN_BATCH = 4

#: ... and products whose right-hand rows lie this many bytes apart or more
#: stay whole: rows a page apart share cache sets, which the packed kernels'
#: copy undoes but the small kernels read as they lie. Pieces of products
#: against rows 4 KiB or more apart (keys of long sequences) took 0.99-1.06x
#: the time of whole products in the fast path (causal, T=S=2048 and 4096).
ROW_STRIDE_LIMIT = 4096


@functools.cache
def small_product_limit() -> int:
    """:data:`SMALL_PRODUCT_LIMIT` where NumPy's BLAS is an OpenBLAS whose
    core has the small-matrix kernels (every OpenBLAS loaded in the process
    reports one of :data:`SMALL_KERNEL_CORES`), else 0: no product is cut.
    Asked once per process."""
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    if "openblas" not in str(blas.get("name", "")).lower():
        return 0
    from threadpoolctl import ThreadpoolController

    openblas = ThreadpoolController().select(internal_api="openblas").info()
    cores = [str(info.get("architecture", "")).lower() for info in openblas]
    return SMALL_PRODUCT_LIMIT if cores and all(core in SMALL_KERNEL_CORES for core in cores) else 0


def matmul(a: Any, b: Any, out: Any) -> Any:
    """``np.matmul(a, b, out=out)`` for ``a (..., M, K)`` and ``b (..., K, N)``,
    with ``a``'s rows (and ``out``'s) cut into :func:`row_pieces` near-equal
    pieces. Returns ``out``.

    >>> a, b = np.ones((128, 64), np.float32), np.ones((64, 128), np.float32)
    >>> bool((matmul(a, b, out=np.empty((128, 128), np.float32)) == 64).all())
    True
    """
    pieces = row_pieces(a, b)
    if pieces == 1:
        return np.matmul(a, b, out=out)
    M = a.shape[-2]
    step = -(-M // pieces)
    for r0 in range(0, M, step):
        np.matmul(a[..., r0 : r0 + step, :], b, out=out[..., r0 : r0 + step, :])
    return out


def row_pieces(a: Any, b: Any) -> int:
    """Into how many pieces of rows :func:`matmul` cuts ``a @ b``: the fewest
    that each fit the small kernels (:func:`small_product_limit`), where the
    whole product does not but 2 to :data:`MAX_PIECES` pieces do, each
    entry sums at most :data:`SAME_BITS_TERMS` terms, the batch holds at
    least :data:`MIN_BATCH` products, and ``b``'s rows are contiguous and
    less than :data:`ROW_STRIDE_LIMIT` bytes apart; else 1.

    >>> x = np.zeros((4, 128, 128), np.float32)  # 4 x (128 x 64 x 128): 2 pieces, unless b is transposed or it fits
    >>> a, b = x[..., :64], x[:, :64]
    >>> pieces = row_pieces(a, b), row_pieces(a, np.swapaxes(x[..., :64], -1, -2)), row_pieces(a[:, :32], b)
    >>> pieces == ((2, 1, 1) if small_product_limit() else (1, 1, 1))  # 1 throughout where BLAS has no small kernels
    True
    """
    limit = small_product_limit()
    if not limit or b.ndim < 2 or b.strides[-1] != b.itemsize or abs(b.strides[-2]) >= ROW_STRIDE_LIMIT:
        return 1
    M, K, N = a.shape[-2], a.shape[-1], b.shape[-1]
    if K > SAME_BITS_TERMS or max(math.prod(a.shape[:-2]), math.prod(b.shape[:-2])) < MIN_BATCH:
        return 1
    rows = limit // max(N * K, 1)  # the most rows a piece may hold
    pieces = -(-M // rows) if rows else 0
    return pieces if 2 <= pieces <= MAX_PIECES else 1
