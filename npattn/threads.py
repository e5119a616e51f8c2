"""The thread pool that the NumPy kernels run their items on, and the BLAS
limit while they do.

:func:`run_items` runs independent work items (the fast path's
(batch element, kv heads, query tile) items, the dense path's chunks of
batch elements) on the calling thread and ``num_threads() - 1`` threads
of one shared pool, with BLAS limited to one thread meanwhile
(threadpoolctl), so that the pool's threads and BLAS's do not
oversubscribe the cores. NumPy releases the GIL inside its ufunc loops
and products, so the items overlap wherever their arrays are large enough
for the Python between NumPy calls not to dominate.

``NPATTN_NUM_THREADS`` (else ``OMP_NUM_THREADS``) sets how many items run
at once; by default one per usable CPU.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

from threadpoolctl import ThreadpoolController

__all__ = ["num_threads", "run_items", "shared_pool", "single_threaded_blas", "power_of_two_at_most"]

_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_BLAS_USERS = 0  # calls currently inside single_threaded_blas
_BLAS_LIMITER: Any = None
_CONTROLLER: ThreadpoolController | None = None


def _forget_pool_in_child() -> None:
    """A forked child inherits the pool object but not its threads: start afresh."""
    global _LOCK, _POOL, _POOL_SIZE, _BLAS_USERS, _BLAS_LIMITER
    _LOCK = threading.Lock()
    _POOL, _POOL_SIZE, _BLAS_USERS, _BLAS_LIMITER = None, 0, 0, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def num_threads() -> int:
    """Pool size: ``NPATTN_NUM_THREADS``, else ``OMP_NUM_THREADS`` (the usual
    way to cap threads per process, as under ``mpiexec``), else the number of
    usable CPUs."""
    requested = _requested_threads()
    if requested is not None:
        return requested
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _requested_threads() -> int | None:
    """The thread count set by ``NPATTN_NUM_THREADS`` or ``OMP_NUM_THREADS``, or None."""
    for name in ("NPATTN_NUM_THREADS", "OMP_NUM_THREADS"):
        env = os.environ.get(name, "").strip()
        if env:
            try:
                return max(1, int(env.split(",")[0]))
            except ValueError:
                raise ValueError(f"{name} must be a positive integer, got {env!r}") from None
    return None


def shared_pool(size: int) -> ThreadPoolExecutor:
    """The shared pool, with at least ``size`` threads (it only grows: each
    call limits its own concurrency, see :func:`run_items`)."""
    global _POOL, _POOL_SIZE
    with _LOCK:
        if _POOL is None or size > _POOL_SIZE:
            if _POOL is not None:
                _POOL.shutdown(wait=False)
            _POOL, _POOL_SIZE = ThreadPoolExecutor(max_workers=size, thread_name_prefix="npattn"), size
        return _POOL


@contextmanager
def single_threaded_blas():
    """Limit BLAS to one thread while any call is running items on the pool.

    The limit is process-wide, so concurrent calls share it: the first one in
    sets it and the last one out restores what was there before.
    """
    global _BLAS_USERS, _BLAS_LIMITER, _CONTROLLER
    with _LOCK:
        if _BLAS_USERS == 0:
            _CONTROLLER = _CONTROLLER or ThreadpoolController()
            _BLAS_LIMITER = _CONTROLLER.limit(limits=1, user_api="blas")
        _BLAS_USERS += 1
    try:
        yield
    finally:
        with _LOCK:
            _BLAS_USERS -= 1
            if _BLAS_USERS == 0:
                _BLAS_LIMITER.restore_original_limits()
                _BLAS_LIMITER = None


def run_items(items: Sequence[Any], work: Callable[[Any], None], *, parallel: bool = True) -> None:
    """Run ``work(item)`` for every item, in order when there is one item
    or thread (or not ``parallel``); else this thread and ``threads - 1`` of
    the pool take the items one after another from a shared queue. Several
    items run with single-threaded BLAS, on one thread too, so that the
    bits do not depend on the thread count: how BLAS's own threads split a
    product changes the rounding of its entries on some cores (OpenBLAS's
    "Haswell" kernels). If an item raises, no thread takes another, and
    the first error re-raises here once the others are done.

    This thread works rather than waits: one future per item, each held at
    a semaphore, plus a spare pool thread to cover the waits for the GIL,
    left three threads handing the GIL to one another on two cores, and took
    1.07-1.3x this time on small items (2 cores, forward: B=16, N=12,
    T=S=64 3.9 -> 3.6 ms; B=4, N=8, T=S=128 causal 2.8 -> 2.1 ms;
    B=8, N=12, T=S=512 causal 41 -> 38 ms).
    """
    threads = min(num_threads(), len(items))
    if not parallel or len(items) < 2:
        for item in items:
            work(item)
        return
    if threads < 2:  # one thread: BLAS single-threaded as on the pool, so that the bits are the same
        with single_threaded_blas():
            for item in items:
                work(item)
        return
    queue, lock, done = iter(items), threading.Lock(), object()
    errors: list[BaseException] = []

    def drain() -> None:
        while not errors:
            with lock:
                item = next(queue, done)
            if item is done:
                return
            try:
                work(item)
            except BaseException as error:  # re-raised in the caller's thread
                errors.append(error)

    pool = shared_pool(threads - 1)
    with single_threaded_blas():
        helpers = [pool.submit(drain) for _ in range(threads - 1)]
        drain()
        for helper in helpers:
            helper.cancel()  # not started: the queue is empty (or an item failed), nothing left to take
        wait(helpers)
    if errors:
        raise errors[0]


def power_of_two_at_most(n: int) -> int:
    """The largest power of two ``<= n`` (``n >= 1``): how many equal parts
    to cut work into when the count must not depend on the thread count (so
    that the bits do not), yet 2, 4, 8 or 16 threads should finish their
    parts together. Three parts on two threads leave one thread a part
    alone at the end: a product in 3 row blocks took 1.34x the time of 2
    blocks, a backward in 3 parts of query heads 1.25-1.31x that of 2
    (2 cores).

    >>> [power_of_two_at_most(n) for n in (1, 2, 3, 5, 16)]
    [1, 2, 2, 4, 16]
    """
    return 1 << (n.bit_length() - 1)
