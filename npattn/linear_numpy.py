"""The multi-head layer's projections on NumPy: products in row blocks on
npattn's thread pool.

OpenBLAS threads a large product itself, and its idle threads then spin for
about 0.1 s, each taking a core. In the layer the next step is attention,
whose NumPy kernels run their items on npattn's own pool
(:mod:`npattn.threads`) and so found one core of two taken after every
projection. :func:`matmul` computes ``a @ b`` instead as blocks of
``a``'s rows, each one product on the pool with single-threaded BLAS: the
projections keep the cores, and no BLAS thread is left spinning when
attention starts.

The blocks depend only on the shapes, never on the thread count, so the
bits do not either. Each block is its own BLAS call, whose result may
differ in its last bits from one call over all rows.
"""

from __future__ import annotations

import numpy as np

from .dense_numpy import handles  # the same arrays: NumPy in float32 or float64
from .threads import power_of_two_at_most, run_items

__all__ = ["handles", "matmul", "POOL_MIN_MACS", "PART_MACS", "POOL_MAX_PARTS"]

#: Products ``(M, K) @ (K, N)`` with at least this many multiply-adds
#: ``M*K*N`` run on the pool; smaller ones are one BLAS call. Each block
#: packs all of ``b`` again and each hand-off to a pool thread costs about
#: 50 us on a 2-core VM, so small products lost to OpenBLAS's own threads,
#: even counting their spinning: in the layer (E=512, 8 heads), B=4, T=64
#: (256x512x512 products) took 1.09x the time forward on the pool, while
#: B=8, T=64 (512x512x512) took 0.95x (forward+backward 0.94x).
POOL_MIN_MACS = 2**27

#: ... in one row block per this many multiply-adds, at least 2 and at most
#: :data:`POOL_MAX_PARTS`, rounded down to a power of two: each block packs
#: all of ``b`` again, so fewer, larger blocks do less of it. Measured on 2
#: cores, float32, pool ÷ OpenBLAS time in loops of each: 512x512x512 in 2
#: blocks 0.89, in 4 1.00; 2048x512x512 in 2 1.04-1.08, in 4 1.06-1.15, in
#: 8 1.12; the layer (E=512, 8 heads, B=8, T=256), 2 blocks ÷ 4
#: (``bench_workloads.py --rows MHA --base``, two runs): forward 0.96-0.97,
#: forward+backward 0.97-0.99. A power of two, so that 2, 4, 8 or 16 threads
#: finish their blocks together: 3 blocks on 2 threads took 1.34x the time of
#: 2 (2048x512x1536, 6144x512x512), 5 blocks 1.19-1.22x that of 4
#: (2560x1024x1024, 10240x512x512).
PART_MACS = 2**29

#: The most row blocks of one product, whatever the thread count (the
#: blocks, and so the bits, depend on the shapes alone): a product of
#: ``2**33`` multiply-adds (the projections of 16384 tokens at E=4096) runs
#: on up to 16 threads.
POOL_MAX_PARTS = 16


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` for 2-D ``a (M, K)`` and ``b (K, N)`` (either may be a
    transposed view): from :data:`POOL_MIN_MACS` multiply-adds in row
    blocks (:data:`PART_MACS`) on the pool with single-threaded BLAS, else
    one product.

    >>> import numpy as np
    >>> a, b = np.ones((600, 64)), np.ones((64, 32))
    >>> bool((matmul(a, b) == 64).all())
    True
    """
    M, K = a.shape
    N = b.shape[1]
    macs = M * K * N
    if macs < POOL_MIN_MACS:
        return a @ b  # (M, K) @ (K, N) -> (M, N)
    parts = power_of_two_at_most(min(POOL_MAX_PARTS, M, max(2, macs // PART_MACS)))
    out = np.empty((M, N), dtype=np.result_type(a, b))
    blocks = [slice(M * i // parts, M * (i + 1) // parts) for i in range(parts)]

    def work(rows: slice) -> None:
        np.matmul(a[rows], b, out=out[rows])  # (m, K) @ (K, N) -> its rows of (M, N)

    run_items(blocks, work)
    return out
