"""NumPy fast paths of the dense path's elementwise steps: in-place ufuncs.

The dense path (:mod:`npattn.dense`) is written once against the Array API;
on NumPy its softmax and the softmax's backward make a fresh temporary per
step, and a fresh ``(..., N, T, S)`` array costs page faults as well as a
pass. :func:`masked_softmax` and :func:`softmax_backward` do the same
arithmetic in the same order, hence give the same bits, on one buffer
updated with ``out=``. :mod:`npattn.softmax` calls them for NumPy
float32/float64 arrays; ``tests/test_softmax.py`` checks them against the
generic versions bit for bit.

:func:`plain_forward` and :func:`plain_backward` are the whole dense pass
for a call whose scores stay raw (``AttentionSpec.scores_are_raw``: keys
may be hidden, but no bias, softcap, ALiBi, score modification or dropout
applies), which :mod:`npattn.dense` hands them: NumPy's own methods, the
per-call floor of small calls, and from :data:`SPLIT_MIN_SCORES` scores in
chunks on the thread pool of :mod:`npattn.threads`. The forward's softmax
runs in base 2 from a zero reference where the scores fit
(:func:`zero_reference_softmax`), else the general code's
(:func:`masked_softmax`); the backward takes the general code's
operations. ``tests/test_dense.py`` checks them against the general code
(to its last bits in base 2, bit for bit otherwise), and the chunks
against one piece (the same bits on any thread count, one piece's to the
last bits).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat
import numpy as np

from . import blas_numpy
from .fast_numpy import LOG2E, ZERO_REFERENCE_BOUND
from .options import AUTO_FAST_MIN_SCORES
from .scores.visibility import NONE, classify_tile
from .threads import run_items

__all__ = [
    "handles",
    "masked_softmax",
    "hiding_limit",
    "fits_zero_reference",
    "zero_reference_softmax",
    "softmax_backward",
    "plain_forward",
    "plain_backward",
    "narrow_columns",
]


def handles(xp: Any, dtype: Any) -> bool:
    """Whether arrays of namespace ``xp`` and ``dtype`` take these kernels:
    NumPy in float32 or float64."""
    return array_api_compat.is_numpy_namespace(xp) and dtype in (np.float32, np.float64)


def masked_softmax(
    s: np.ndarray, visible: np.ndarray | None, *, overwrite: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`npattn.softmax.masked_softmax` for NumPy: the same arithmetic in the same order,
    hence the same bits, on one ``(..., T, S)`` buffer updated in place
    (``out=``) rather than a new temporary per step, and with the per-row
    fix-ups done on the ``(..., T, 1)`` vectors only. That buffer is ``s``
    itself with ``overwrite`` (the caller's fresh scores, which become P),
    else a fresh one and ``s`` is not modified. ``visible``: a boolean array
    broadcasting to ``s``, hidden through its :func:`hiding_limit` where
    ``s`` repeats it :data:`HIDING_REPEATS` times or more."""
    e: np.ndarray | None = None
    if visible is not None and visible.dtype == bool and s.size >= HIDING_REPEATS * visible.size:
        visible = hiding_limit(visible, s.dtype, transposed=s.ndim >= 2 and s.strides[-1] > s.strides[-2])
    if overwrite:
        e = s
        if visible is not None:
            _hide(e, visible, in_place=True)
    elif visible is not None:
        e = _hide(s, visible, in_place=False)  # (..., T, S), a fresh buffer
    m = np.maximum.reduce(s if e is None else e, axis=-1, keepdims=True)  # (..., T, 1), np.max minus its wrapper
    # Fully masked rows: m = -inf, and exactly these get l = 0 below (a finite m
    # gives its own entry exp(0) = 1); the fix-ups run only where one exists.
    empty = None
    if _has_empty_row(m):
        empty = m == -np.inf  # (..., T, 1)
        np.copyto(m, 0, where=empty)  # any finite m works
    e = np.subtract(s if e is None else e, m, out=e)  # (..., T, S); in place when masked or overwriting
    np.exp(e, out=e)  # exactly 0 where hidden
    l = np.add.reduce(e, axis=-1, keepdims=True)  # (..., T, 1), np.sum minus its wrapper
    if empty is not None:
        np.copyto(l, 1, where=empty)
    e /= l
    lse = np.log(l, out=l)  # l is spent: its buffer takes lse
    lse += m
    if empty is not None:
        np.copyto(lse, -np.inf, where=empty)
    return e, lse[..., 0]


#: A boolean ``visible`` that ``s`` repeats at least this many times (one
#: mask broadcast over heads or batch elements, as causal, windows and
#: lengths are) hides through :func:`hiding_limit`: ``np.fmin`` against a
#: float array runs in SIMD, where ``np.copyto(..., where=)`` walks a
#: boolean mask, and building the limit costs a pass over the mask alone.
#: Measured at ``(8, 128, 128)`` float32 scores hiding a causal ``(128,
#: 128)`` mask, one thread: ``copyto`` 90 us (73 with the mask laid out as
#: the scores), ``fmin`` 18-20 us, building the limit 10.6 us.
HIDING_REPEATS = 4


def hiding_limit(visible: np.ndarray, dtype: Any, *, transposed: bool, hidden: float = -np.inf) -> np.ndarray:
    """The float limit that hides what ``visible`` hides: ``+inf`` where
    visible, ``hidden`` (``-inf``, or 0 for probabilities) where hidden, of
    ``dtype``, its last two axes laid out in the scores' memory order
    (``transposed``: the dense path's scores are the transposed view of
    ``K Q^T``), so that ``np.fmin(s, limit)`` walks both contiguously.

    ``fmin(x, -inf) = -inf`` for every ``x``, NaN included, and ``fmin(x,
    +inf) = x`` for every ``x`` but NaN, which becomes ``+inf``: the bits of
    ``np.where(visible, s, -inf)`` except a visible NaN, whose row's P and
    lse come out all NaN either way (its maximum is NaN there, +inf here,
    and ``inf - inf`` is NaN). With ``hidden=0``, ``fmin(p, limit)`` is
    ``np.where(visible, p, 0)`` for every ``p >= 0``.

    >>> visible = np.array([[True, False], [True, True]])
    >>> limit = hiding_limit(visible, np.float32, transposed=True)
    >>> limit.tolist(), limit.dtype.name, limit.strides
    ([[inf, -inf], [inf, inf]], 'float32', (4, 8))
    """
    order = np.swapaxes(visible, -1, -2) if transposed else visible
    limit = np.empty(order.shape, dtype=dtype)
    limit.fill(hidden)
    np.copyto(limit, np.inf, where=order)
    return np.swapaxes(limit, -1, -2) if transposed else limit


def _hide(s: np.ndarray, visible: np.ndarray, *, in_place: bool, hidden: float = -np.inf) -> np.ndarray:
    """``s`` with its hidden entries set to ``hidden``, in place or in a
    fresh array: ``visible`` is a boolean mask or a :func:`hiding_limit`
    made with ``hidden``."""
    if visible.dtype != bool:
        return np.fmin(s, visible, out=s if in_place else None)
    if not in_place:
        return np.where(visible, s, hidden)
    np.copyto(s, hidden, where=np.logical_not(visible))  # the bits of np.where(visible, s, hidden)
    return s


#: Row maxima up to this many are searched for ``-inf`` as a Python list
#: (0.4 µs for 16 against the reduction's 1.1: a small call's floor).
LIST_SEARCH_ROWS = 64


def _has_empty_row(m: np.ndarray, empty: float = -math.inf) -> bool:
    """Whether the row maxima ``m`` hold ``-inf`` (a row with no visible
    key), or the row sums ``m`` hold ``empty = 0``. One reduction asks (fmin
    skips a NaN row beside an empty one; ``initial`` covers T = 0): cheaper
    than ``(m == -inf).any()``; a few values are searched as a Python list
    instead, cheaper still.

    >>> _has_empty_row(np.array([[0.0], [-np.inf]])), _has_empty_row(np.array([[np.nan], [1.0]]))
    (True, False)
    >>> _has_empty_row(np.array([[2.0], [0.0]]), empty=0.0)
    True
    """
    if m.size <= LIST_SEARCH_ROWS:
        return empty in m.ravel().tolist()
    return bool(np.fmin.reduce(m, axis=None, initial=np.inf) == empty)


def fits_zero_reference(s2: np.ndarray) -> bool:
    """Whether every base-2 score of ``s2`` (hidden ones included: they are
    exponentiated before they are hidden) lies within the NumPy fast path's
    zero-reference bound, :data:`npattn.fast_numpy.ZERO_REFERENCE_BOUND`
    (80 for float32, 900 for float64): ``2**s2`` is then a normal number and
    a row's sum of up to ``2**bound S`` stays far below the dtype's largest.
    False for a NaN or inf. Two reductions over the whole array, order-free,
    so they run at memory speed.

    >>> fits_zero_reference(np.array([[-70.0, 3.0]], np.float32)), fits_zero_reference(np.array([[90.0]], np.float32))
    (True, False)
    """
    bound = ZERO_REFERENCE_BOUND[s2.dtype]
    if not s2.size:
        return True
    return bool(np.maximum.reduce(s2, axis=None) <= bound and np.minimum.reduce(s2, axis=None) >= -bound)


def zero_reference_softmax(s2: np.ndarray, visible: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    r"""``(P, lse)`` of the scores ``s = s2 \ln 2`` from their base-2 form
    ``s2``, in place (``s2`` becomes P), where :func:`fits_zero_reference`:

    .. math::

        \tilde P_{ij} = 2^{s2_{ij}} [j \text{ visible}],\qquad
        l_i = \sum_j \tilde P_{ij},\qquad P = \tilde P / l,\qquad
        \mathrm{lse}_i = \ln l_i

    The softmax with its shift at 0 rather than at the row's maximum (the
    NumPy fast path's forward keeps the same reference): no pass for the
    maximum nor for the shift, and ``exp2`` runs 1.6x as fast as ``exp``.
    Every ``2**s2`` is then a normal number and is exact to the same relative
    rounding as ``exp(s - max)``, whose argument carries the shift's
    rounding besides the product's. The hidden entries are zeroed after
    ``exp2``, which NumPy runs about 7x slower where its input is ``-inf``.
    ``visible``: a boolean mask or its :func:`hiding_limit` with ``hidden=0``.
    A row without a visible key gets P = 0 and lse = -inf.

    >>> s2 = np.array([[1.0, 0.0, 5.0], [2.0, 2.0, 2.0]])
    >>> p, lse = zero_reference_softmax(s2, np.array([[True, True, False], [False, False, False]]))
    >>> p.round(4).tolist(), lse.round(4).tolist()
    ([[0.6667, 0.3333, 0.0], [0.0, 0.0, 0.0]], [1.0986, -inf])
    """
    p = np.exp2(s2, out=s2)  # (..., T, S): P~, 2**s2 within [2**-bound, 2**bound]
    if visible is not None:
        _hide(p, visible, in_place=True, hidden=0)
    l = np.add.reduce(p, axis=-1, keepdims=True)  # (..., T, 1)
    empty = None
    if _has_empty_row(l, empty=0.0):  # no visible key: exactly these sum to 0
        empty = l == 0  # (..., T, 1)
        np.copyto(l, 1, where=empty)  # P stays 0 there
    p /= l
    lse = np.log(l, out=l)  # l is spent: its buffer takes lse
    if empty is not None:
        np.copyto(lse, -np.inf, where=empty)
    return p, lse[..., 0]


def softmax_backward(p: np.ndarray, dp: np.ndarray, D: np.ndarray, *, overwrite: bool = False) -> np.ndarray:
    """:func:`npattn.softmax.softmax_backward` for NumPy: ``(dP - D) * P``
    (the same bits as ``P * (dP - D)``) into one buffer: ``dp`` itself with
    ``overwrite``, else a fresh one."""
    ds = np.subtract(dp, D, out=dp if overwrite else None)  # (..., T, S)
    ds *= p
    return ds


#: A plain call with at least this many scores ``B*N*T*S`` runs as
#: :data:`SPLIT_CHUNKS` chunks of batch elements (or, with one element, of
#: kv heads) on the pool of :mod:`npattn.threads`: NumPy releases the GIL in
#: the chunks' products and passes, which the dense path otherwise runs on
#: one core (BLAS threads only the larger products). Measured on 2 cores,
#: forward, a prototype with one chunk per thread ÷ one piece (one process,
#: interleaved, no page faults): 0.53x at B=16, N=12, T=S=64; 0.68x at B=8,
#: N=8, T=S=128; 0.85x at B=4, N=8, T=S=64 (2**17 scores); 0.98x at B=1,
#: N=8, T=S=128 (heads split); 1.17x at B=2, N=8, T=S=64 (2**16), below
#: it; in four chunks, B=16, N=12, T=S=64 0.54x forward and 0.56x
#: forward+backward (``benchmarks/bench_workloads.py --more``). Only below
#: :data:`~npattn.options.AUTO_FAST_MIN_SCORES`, where ``impl="auto"`` takes
#: the dense path: above, behind projections that left OpenBLAS's threads
#: spinning, the chunks took 1.13x the time of one piece forward+backward
#: (the layer, E=512, B=8, T=256), and a forced ``impl="dense"`` keeps the
#: products that BLAS threads itself.
SPLIT_MIN_SCORES = 2**17

#: ... in this many chunks (fewer where there are fewer batch elements or kv
#: heads), whatever the thread count, so that the results do not depend on
#: it: each chunk does the same operations on its own rows, but BLAS may
#: round a product of vectors differently at another offset in memory.
SPLIT_CHUNKS = 4


def _chunks(batch: int, K: int, scores: int) -> list[tuple[slice, slice]]:
    """``(batch elements, kv heads)`` of each chunk of a plain call: up to
    :data:`SPLIT_CHUNKS` over the batch elements, or over the kv heads of a
    single element, from :data:`SPLIT_MIN_SCORES` scores up to
    :data:`~npattn.options.AUTO_FAST_MIN_SCORES`; else the whole."""
    if not SPLIT_MIN_SCORES <= scores < AUTO_FAST_MIN_SCORES or (batch < 2 and K < 2):
        return [(slice(None), slice(None))]
    count = batch if batch >= 2 else K
    pieces = min(SPLIT_CHUNKS, count)
    ranges = [slice(count * i // pieces, count * (i + 1) // pieces) for i in range(pieces)]
    return [(r, slice(None)) for r in ranges] if batch >= 2 else [(slice(None), r) for r in ranges]


def _as_batch_rank(x: np.ndarray | None, lead: list[int], tail: int) -> np.ndarray | None:
    """``x`` broadcastable to ``(*lead, ...)`` with ``tail`` axes after the
    batch axes, as ``(B, ...)`` with ``B = prod(lead)``, or ``(1, ...)``
    where its batch axes are all 1 (a view, unless the batch axes cannot
    merge without a copy)."""
    if x is None:
        return None
    full = np.reshape(x, (1,) * (len(lead) + tail - x.ndim) + x.shape)  # (*lead|1, ...)
    if all(n == 1 for n in full.shape[: len(lead)]):
        return np.reshape(full, (1,) + full.shape[len(lead) :])
    full = np.broadcast_to(full, (*lead, *full.shape[len(lead) :]))
    return np.reshape(full, (math.prod(lead),) + full.shape[len(lead) :])


def _rows_of(x: Any, batch: slice, heads: slice, G: int) -> Any:
    """The chunk ``(batch, kv heads)`` of a ``(B|1, N|1, ...)`` array whose
    axis 1 holds query heads (or is broadcast)."""
    if x is None:
        return None
    b = slice(None) if x.shape[0] == 1 else batch
    h = heads if x.shape[1] != 1 and heads != slice(None) else slice(None)
    if h != slice(None):
        h = slice(h.start * G, h.stop * G)
    return x[b, h]


def plain_forward(
    spec: Any,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    visible: np.ndarray | None = None,
    *,
    out: np.ndarray | None = None,
    products: np.ndarray | None = None,
    zero_limit: np.ndarray | None = None,
) -> tuple[Any, Any, Any]:
    """:func:`npattn.dense.dense_forward` for raw scores (``spec.scores_are_raw``:
    no step of the pipeline changes them), of which ``visible`` (the
    pipeline's :func:`~npattn.scores.visibility.visible_tile` over the whole
    ``(..., N, T, S)``, or None) hides some: ``(out, lse, P)``, with NumPy's
    own methods and without the namespace's wrappers (``np.reshape``'s and
    ``np.swapaxes``' Python layers cost 0.3-0.6 µs a call): a small call's
    floor.

    The softmax runs in base 2 from a zero reference
    (:func:`zero_reference_softmax`, ``log2(e)`` folded into the queries'
    scale) where every score fits (:func:`fits_zero_reference`): the general
    code's numbers to its last bits, in fewer and cheaper passes. Where a
    score does not fit, the products are taken again at the general code's
    scale and :func:`masked_softmax` gives its bits. ``zero_limit``: the
    :func:`hiding_limit` of ``visible`` with ``hidden=0``, made once for
    every chunk where the mask repeats (:data:`HIDING_REPEATS`).

    From :data:`SPLIT_MIN_SCORES` scores it runs in chunks on the thread
    pool (:func:`_forward_in_chunks`), each a call of this function on its
    rows with ``out (..., N, T, Hv)`` and ``products (..., K, S, G*T)``
    (which takes ``K Q^T``), the rows of the call's arrays: the same
    operations per row, but a product of vectors may round in its last bits
    unlike the whole call's (see :data:`SPLIT_CHUNKS`). P is the products'
    transposed view with one query head per kv head, else a copy."""
    *lead, N, T, H = q.shape
    K, S, Hv = k.shape[-3], k.shape[-2], v.shape[-1]
    if zero_limit is None and visible is not None and q.size * S >= HIDING_REPEATS * H * visible.size:
        zero_limit = hiding_limit(visible, q.dtype, transposed=True, hidden=0)  # once for every chunk: P~^T's layout
    if out is None and q.size * S >= SPLIT_MIN_SCORES * H:  # B*N*T*S scores, from the sizes alone
        chunked = _forward_in_chunks(spec, q, k, v, visible, zero_limit)
        if chunked is not None:
            return chunked
    grouped = N != K  # G > 1 query heads per kv head, stacked as G*T rows (reshapes that are no-ops else)
    rows = (N // K) * T if K else 0  # G*T
    q_g = q.reshape((*lead, K, rows, H)) if grouped else q  # (..., K, G*T, H)
    base2 = scaled_transpose(q_g, spec.scale * LOG2E, S)  # (..., K, H, G*T): base-2 scores, log2(e) in the scale
    corner = None if grouped or visible is None else _hidden_corner(spec, T, S)
    products = _products(k, base2, products, corner)  # (..., K, S, G*T)
    s = _scores_of(products, lead, N, T)  # (..., N, T, S), a view
    if fits_zero_reference(products):
        p, lse = zero_reference_softmax(s, visible if zero_limit is None else zero_limit)  # (..., N, T, S), (..., N, T)
    else:  # a score past the bound, NaN or inf: the general code's scale and softmax, with its bits
        corner = None
        products = _products(k, scaled_transpose(q_g, spec.scale, S), products)
        p, lse = masked_softmax(_scores_of(products, lead, N, T), visible, overwrite=True)
    p_g = p.reshape((*lead, K, rows, S)) if grouped else p  # (..., K, G*T, S)
    if out is None and corner is None:  # (..., K, G*T, S) @ (..., K, S, Hv) -> (..., K, G*T, Hv)
        out = p_g @ v
        return (out.reshape((*lead, N, T, Hv)) if grouped else out), lse, p
    if out is None:
        out = np.empty((*lead, N, T, Hv), dtype=q.dtype)
    out_g = out.reshape((*lead, K, rows, Hv)) if grouped else out  # the chunk's rows, or the call's
    if corner is None:
        blas_numpy.matmul(p_g, v, out=out_g)
    else:  # the first rows see none of the keys from the corner on
        blas_numpy.matmul(p_g[..., :corner, :corner], v[..., :corner, :], out=out_g[..., :corner, :])
        blas_numpy.matmul(p_g[..., corner:, :], v, out=out_g[..., corner:, :])
    return out, lse, p


#: The plain lane skips the hidden corner of a banded square
#: (:func:`_hidden_corner`) from this many query rows.
CORNER_MIN_ROWS = 128


def _hidden_corner(spec: Any, T: int, S: int) -> int | None:
    """``c = T // 2`` where the queries ``[0, c)`` see none of the keys ``[c,
    S)`` for every batch element and head (a causal square's upper right
    quarter: the pipeline's :func:`~npattn.scores.visibility.classify_tile`
    says so), from :data:`CORNER_MIN_ROWS` rows; else None."""
    corner = T // 2
    if T < CORNER_MIN_ROWS or corner >= S or classify_tile(spec, 0, corner, corner, S) != NONE:
        return None
    return corner


def _products(k: np.ndarray, qs_t: np.ndarray, products: np.ndarray | None, corner: int | None = None) -> np.ndarray:
    """``K Q^T``: ``(..., K, S, H) @ (..., K, H, G*T) -> (..., K, S, G*T)``, into
    ``products`` where given (a chunk's, on one BLAS thread: through
    :func:`npattn.blas_numpy.matmul`, the same bits), else fresh (the
    operator: a small call's floor). With a hidden ``corner``
    (:func:`_hidden_corner`, one query head per kv head), the keys from it
    on are not multiplied by the queries before it: 0 there."""
    if corner is None:
        return k @ qs_t if products is None else blas_numpy.matmul(k, qs_t, out=products)
    if products is None:
        products = np.empty(k.shape[:-1] + qs_t.shape[-1:], dtype=k.dtype)
    c = corner
    products[..., c:, :c] = 0  # (..., K, S - c, c): keys c.. against queries ..c, hidden
    blas_numpy.matmul(k[..., :c, :], qs_t[..., :c], out=products[..., :c, :c])  # (..., K, c, H) @ (..., K, H, c)
    blas_numpy.matmul(k, qs_t[..., c:], out=products[..., c:])  # (..., K, S, H) @ (..., K, H, T - c)
    return products


def _scores_of(products: np.ndarray, lead: list[int], N: int, T: int) -> np.ndarray:
    """The scores ``(..., N, T, S)`` as a view of the products ``(..., K, S,
    G*T)``: their transpose, the G stacked query heads of a kv head split
    (a reshape that is a no-op where G = 1)."""
    s = products.swapaxes(-1, -2)  # (..., K, G*T, S): (K Q^T)^T
    return s if products.shape[-3] == N else s.reshape((*lead, N, T, s.shape[-1]))  # (..., N, T, S)


def _forward_in_chunks(
    spec: Any,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    visible: np.ndarray | None,
    zero_limit: np.ndarray | None,
) -> tuple[Any, Any, Any] | None:
    """:func:`plain_forward` in :func:`_chunks` on the thread pool, each
    writing its rows of ``out``, ``lse`` and P; None where the call is one
    chunk."""
    *lead, N, T, _ = q.shape
    K, S, Hv = k.shape[-3], k.shape[-2], v.shape[-1]
    G = N // K if K else 0
    batch = math.prod(lead)
    chunks = _chunks(batch, K, batch * N * T * S)
    if len(chunks) == 1:
        return None
    out = np.empty((*lead, N, T, Hv), dtype=q.dtype)
    lse = np.empty((*lead, N, T), dtype=q.dtype)
    # One query head per kv head: the chunks' products K Q^T (..., K, S, T) become P^T
    # in place, and P is their transposed view. With G > 1 that view is not (..., N, T, S)
    # (its rows interleave heads and positions), so each chunk copies its P into probs.
    products = np.empty((*lead, K, S, T), dtype=q.dtype) if G == 1 else None
    probs = np.empty((*lead, N, T, S), dtype=q.dtype) if G != 1 else None
    q4, k4, v4, o4, l4, p4, r4 = (_merge_batch(x, lead) for x in (q, k, v, out, lse, products, probs))
    vis4, zero4 = (_as_batch_rank(x, lead, 3) for x in (visible, zero_limit))  # (B|1, N|1, T|1, S|1)

    def work(c: tuple[slice, slice]) -> None:  # (batch elements, kv heads); query heads are G per kv head
        qc, visc, zeroc, oc, lc, rc = (_rows_of(x, *c, G) for x in (q4, vis4, zero4, o4, l4, r4))
        _, lse_rows, p_rows = plain_forward(
            spec, qc, k4[c], v4[c], visc, out=oc, products=None if p4 is None else p4[c], zero_limit=zeroc
        )
        lc[...] = lse_rows
        if rc is not None:
            rc[...] = p_rows

    run_items(chunks, work)
    probs = probs if products is None else np.swapaxes(products, -1, -2).reshape((*lead, N, T, S))  # a view
    return out, lse, probs


def _merge_batch(x: Any, lead: list[int]) -> Any:
    """``(*lead, ...) -> (B, ...)``, ``B = prod(lead)``: a view for the
    C-contiguous arrays and products here; None stays None."""
    return None if x is None else np.reshape(x, (math.prod(lead),) + x.shape[len(lead) :])


def plain_backward(
    spec: Any,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    p: np.ndarray,
    out: np.ndarray,
    dout: np.ndarray,
    dlse: Any,
    *,
    grads: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[Any, Any, Any]:
    """:func:`npattn.dense.dense_backward` for raw scores (``spec.scores_are_raw``):
    ``(dq, dk, dv)`` from the same operations in the same order, hence the
    same bits (hidden keys have ``P = 0``, so ``dS = 0`` there); in chunks on
    the thread pool as :func:`plain_forward`, with its rounding, each
    writing into ``grads``, its rows of the call's ``(dq, dk, dv)``."""
    *lead, N, T, H = q.shape
    K, S, Hv = k.shape[-3], k.shape[-2], v.shape[-1]
    if grads is None and q.size * S >= SPLIT_MIN_SCORES * H:  # B*N*T*S scores, from the sizes alone
        chunked = _backward_in_chunks(spec, q, k, v, p, out, dout, dlse)
        if chunked is not None:
            return chunked
    rows = (N // K) * T if K else 0
    dout_g = np.reshape(dout, (*lead, K, rows, Hv))  # (..., K, G*T, Hv)
    p_t = np.swapaxes(np.reshape(p, (*lead, K, rows, S)), -1, -2)  # (..., K, S, G*T)
    dv = p_t @ dout_g if grads is None else blas_numpy.matmul(p_t, dout_g, out=grads[2])  # (..., K, S, Hv)
    dout_t = narrow_columns(np.swapaxes(dout_g, -1, -2), S)  # (..., K, Hv, G*T)
    dp = np.reshape(np.swapaxes(v @ dout_t, -1, -2), (*lead, N, T, S))  # (..., N, T, S): (V dO^T)^T
    D = np.sum(dout * out, axis=-1, keepdims=True)  # (..., N, T, 1): rowsum(P * dP), over Hv not S
    if dlse is not None:
        D = D - dlse[..., None]
    ds_g = np.reshape(softmax_backward(p, dp, D, overwrite=True), (*lead, K, rows, S))  # (..., K, G*T, S), over dP
    q_g = np.reshape(q, (*lead, K, rows, H))  # (..., K, G*T, H)
    if grads is None:  # fresh: the products' own arrays
        dq = spec.scale * np.reshape(ds_g @ k, (*lead, N, T, H))  # (..., K, G*T, S) @ (..., K, S, H)
        dk = spec.scale * (np.swapaxes(ds_g, -1, -2) @ q_g)  # (..., K, S, H)
        return dq, dk, dv
    dq, dk, _ = grads
    blas_numpy.matmul(ds_g, k, out=np.reshape(dq, (*lead, K, rows, H)))  # into a view of the chunk's rows
    dq *= spec.scale
    blas_numpy.matmul(np.swapaxes(ds_g, -1, -2), q_g, out=dk)
    dk *= spec.scale
    return dq, dk, dv


def _backward_in_chunks(
    spec: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, p: np.ndarray, out: np.ndarray, dout: np.ndarray, dlse: Any
) -> tuple[Any, Any, Any] | None:
    """:func:`plain_backward` in :func:`_chunks` on the thread pool; None
    where the call is one chunk."""
    *lead, N, T, _ = q.shape
    K, S = k.shape[-3], k.shape[-2]
    G = N // K if K else 0
    batch = math.prod(lead)
    chunks = _chunks(batch, K, batch * N * T * S)
    if len(chunks) == 1:
        return None
    dq, dk, dv = (np.empty(x.shape, dtype=q.dtype) for x in (q, k, v))
    q4, k4, v4, p4, o4, do4, dlse4, dq4, dk4, dv4 = (
        _merge_batch(x, lead) for x in (q, k, v, p, out, dout, dlse, dq, dk, dv)
    )

    def work(c: tuple[slice, slice]) -> None:  # (batch elements, kv heads); query heads are G per kv head
        qc, pc, oc, doc, dlsec, dqc = (_rows_of(x, *c, G) for x in (q4, p4, o4, do4, dlse4, dq4))
        plain_backward(spec, qc, k4[c], v4[c], pc, oc, doc, dlsec, grads=(dqc, dk4[c], dv4[c]))

    run_items(chunks, work)
    return dq, dk, dv


#: A product's right-hand operand with at most this many columns is made
#: C-contiguous first (:func:`contiguous_columns`): decoding's few queries.
NARROW_COLUMNS = 8

#: ... and with at most this many, against between :data:`SHORT_KEYS`
#: keys: short sequences' square heads.
SHORT_COLUMNS = 64
SHORT_KEYS = (32, 256)


def contiguous_columns(columns: int, keys: int) -> bool:
    """Whether ``K (keys, H)`` times ``columns`` query columns takes them as
    a C-contiguous block rather than as the transposed view of their rows.

    OpenBLAS multiplies a row-major ``K`` by a contiguous block of columns
    faster than by a transposed view: up to 2.2x at 1 to 8 columns (decoding:
    4 query heads per kv head, S=512: 0.46x the product's time; never slower
    at S=512 or 4096), and 1.3-2.2x at 16 to 64 columns against 32 to 192
    keys (8 heads, H=16 to 128, one thread). At 256 keys and 64 columns it is
    1.07-1.08x, and the copy about evens that out: NumPy transposes at about
    0.4 ns an entry. The copy pays from about 32 keys, and not for the tiny
    call (16x16).

    >>> contiguous_columns(4, 8192), contiguous_columns(64, 64), contiguous_columns(64, 512), contiguous_columns(16, 16)
    (True, True, False, False)
    """
    return columns <= NARROW_COLUMNS or (columns <= SHORT_COLUMNS and SHORT_KEYS[0] <= keys <= SHORT_KEYS[1])


def narrow_columns(x: np.ndarray, keys: int) -> np.ndarray:
    """``x`` (..., H, n) as a C-contiguous copy where :func:`contiguous_columns`
    says so for ``keys`` keys, else as it is.

    >>> x = np.zeros((4, 128), dtype=np.float32).T  # (128, 4): a transposed view
    >>> narrow_columns(x, 512).flags["C_CONTIGUOUS"], narrow_columns(np.zeros((16, 128)).T, 512).flags["C_CONTIGUOUS"]
    (True, False)
    """
    return np.ascontiguousarray(x) if contiguous_columns(x.shape[-1], keys) else x


def scaled_transpose(x: np.ndarray, scale: Any, keys: int) -> np.ndarray:
    """``narrow_columns((scale * x)^T, keys)`` in one pass: ``(..., n, H) ->
    (..., H, n)``, ``scale * x`` written in the transposed layout where
    :func:`contiguous_columns` says so, else the transposed view of ``scale
    * x``. The same values either way, so the same product's bits. ``scale``
    is a Python float, which keeps ``x``'s dtype.

    >>> x = np.arange(6.0).reshape(3, 2)
    >>> scaled_transpose(x, 2.0, 512).tolist(), scaled_transpose(x, 2.0, 512).flags["C_CONTIGUOUS"]
    ([[0.0, 4.0, 8.0], [2.0, 6.0, 10.0]], True)
    """
    if not contiguous_columns(x.shape[-2], keys):
        return (scale * x).swapaxes(-1, -2)  # the method: np.swapaxes' wrapper costs 0.3 us on a small call's floor
    x_t = x.swapaxes(-1, -2)  # (..., H, n), a view
    return np.multiply(x_t, scale, out=np.empty(x_t.shape, dtype=x.dtype))
