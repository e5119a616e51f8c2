r"""Diagnostics for attention weights: the practical checklist, as functions.

For probabilities ``p`` of shape ``(..., N, T, S)`` (``DenseResiduals.probs``,
the softmax before dropout) and row ``r = (..., n, t)``::

    entropy_r = -sum_j p_rj log p_rj         nats, with 0 log 0 = 0
    peak_r    = max_j p_rj                   "how one-hot" a row is
    rowsum_r  = sum_j p_rj                   1 for a live row, 0 when fully masked

A *fully masked* row is a row of zeros, as npattn writes it (output 0,
``lse = -inf``). Per-head statistics average over the batch axes and the
query rows of that head, leaving fully masked rows out; a head with no live
row gets NaN. A softmax row always has an entry ``>= 1/S``, so a live row is
never all zeros.

How to read them (from the background checklists):

- ``row_sum_check`` failing by O(0.1) or more: softmax over the wrong axis,
  or a mask applied after the softmax instead of before.
- mean peak near 1 (``>= 0.98``) and entropy near 0: attention collapsed to
  one key per query; check the scale, the learning rate and warm-up.
- entropy near ``log S`` and peak near ``1/S``: nearly uniform attention, the
  head tells keys apart poorly.
- NaN/inf in scores, outputs or gradients: see :func:`check_finite` (``-inf``
  in ``lse`` on fully masked rows is expected).

Compute functions use only Array API calls on the weights' own namespace
(NumPy, CuPy, array-api-strict, PyTorch, ...); their reports hold plain Python
numbers. :func:`plot_attention` copies to NumPy and draws with matplotlib
(the ``plot`` extra, ``pip install "npattn[plot]"``).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np  # plotting only (matplotlib draws NumPy arrays); compute uses the array namespace

from .namespace import check_floating, compute_dtype, dtype_name, resolve_namespace, to_numpy
from .options import check_int

__all__ = [
    "attention_entropy",
    "attention_peak",
    "row_sum_check",
    "RowSumReport",
    "check_finite",
    "FiniteReport",
    "FiniteEntry",
    "summarize",
    "AttentionSummary",
    "plot_attention",
]

PEAK_WARNING = 0.98  # mean row maximum above which a head counts as nearly one-hot


# --------------------------------------------------------------------------- helpers


def _prepare(weights: Any, xp: Any) -> tuple[Any, Any]:
    """Validate ``weights``; return ``(xp, p)`` with ``p`` in the compute dtype."""
    xp = resolve_namespace({"weights": weights}, xp)
    check_floating(xp, "weights", weights)
    if weights.ndim < 2:
        raise ValueError(f"weights must have shape (..., N, T, S) or (T, S), got shape {tuple(weights.shape)}")
    return xp, xp.astype(weights, compute_dtype(xp, weights.dtype), copy=False)


def _as_heads(xp: Any, p: Any) -> Any:
    """A (T, S) matrix is one head: ``(T, S) -> (1, T, S)``."""
    if p.ndim == 2:
        return xp.reshape(p, (1, *p.shape))  # (1, T, S)
    return p


def _live_rows(xp: Any, p: Any) -> Any:
    """True on rows with any nonzero entry: ``(..., T, S) -> (..., T)``."""
    return xp.any(p != 0, axis=-1)


def _row_max(xp: Any, p: Any) -> Any:
    """``max_j p_rj``, 0 for rows with no keys at all (S == 0)."""
    if p.shape[-1] == 0:
        return xp.zeros(p.shape[:-1], dtype=p.dtype, device=array_api_compat.device(p))
    return xp.max(p, axis=-1)  # (..., N, T)


def _head_mean(xp: Any, per_row: Any, live: Any) -> Any:
    """Mean of ``per_row (..., N, T)`` over live rows, per head: ``(N,)``; NaN without any."""
    axes = tuple(i for i in range(per_row.ndim) if i != per_row.ndim - 2)
    w = xp.astype(live, per_row.dtype)  # (..., N, T)
    zero = xp.zeros_like(per_row)
    total = xp.sum(xp.where(live, per_row, zero), axis=axes)  # (N,)
    count = xp.sum(w, axis=axes)  # (N,)
    has_rows = count > 0
    mean = total / xp.where(has_rows, count, xp.ones_like(count))
    return xp.where(has_rows, mean, xp.full_like(mean, math.nan))


def _floats(x: Any) -> tuple[float, ...]:
    """A 1-D array as a tuple of Python floats (host copies of single elements)."""
    return tuple(float(x[i]) for i in range(x.shape[0]))


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """C-order index of element ``flat`` of an array of ``shape``."""
    index = []
    for n in reversed(shape):
        index.append(flat % n)
        flat //= n
    return tuple(reversed(index))


def _check_real(name: str, value: Any, *, minimum: float | None = None) -> float:
    """A finite real number (>= ``minimum`` when given), else TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return float(value)


def _default_atol(xp: Any, dtype: Any) -> float:
    """``sqrt(eps)`` of the compute dtype, or ``2 eps`` of a narrower input dtype:
    rounding each probability to the input dtype moves a row sum by at most
    ``eps / 2``."""
    eps_in = float(xp.finfo(dtype).eps)
    eps_compute = float(xp.finfo(compute_dtype(xp, dtype)).eps)
    return max(math.sqrt(eps_compute), 2 * eps_in)


# --------------------------------------------------------------------------- statistics


def attention_entropy(weights, /, *, xp=None):
    r"""Mean attention entropy per head, in nats.

    .. math::

        H_n = \frac{1}{|R_n|}\sum_{r \in R_n} -\sum_j p_{rj}\log p_{rj},
        \qquad 0 \log 0 = 0

    where :math:`R_n` are the live (not fully masked) rows of head ``n`` over
    all batch axes and query positions. Uniform attention over ``S`` keys has
    entropy ``log S``; one-hot attention has 0.

    Parameters
    ----------
    weights : array, (..., N, T, S) or (T, S)
        Attention probabilities, e.g. ``DenseResiduals.probs``. Rows of zeros
        are fully masked and left out. A ``(T, S)`` matrix is one head.
        float16/bfloat16 are computed in float32.
    xp : namespace, optional
        Array API namespace; inferred from ``weights`` by default.

    Returns
    -------
    array, (N,)
        In the compute dtype, on ``weights``' device; NaN for a head whose rows
        are all fully masked.

    Raises
    ------
    TypeError
        ``weights`` is not a floating array of an Array API library.
    ValueError
        ``weights`` has fewer than 2 dimensions.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.array([[[0.25, 0.25, 0.25, 0.25],
    ...                [1.0, 0.0, 0.0, 0.0],
    ...                [0.0, 0.0, 0.0, 0.0]]])    # head 0: uniform, one-hot, masked
    >>> h = attention_entropy(w)                     # mean of log 4 and 0
    >>> h.shape, bool(np.isclose(h[0], np.log(4) / 2))
    ((1,), True)
    """
    xp, p = _prepare(weights, xp)
    p = _as_heads(xp, p)  # (..., N, T, S)
    log_p = xp.log(xp.where(p > 0, p, xp.ones_like(p)))  # 0 where p == 0, so 0 log 0 = 0
    h_row = -xp.sum(p * log_p, axis=-1)  # (..., N, T)
    return _head_mean(xp, h_row, _live_rows(xp, p))  # (N,)


def attention_peak(weights, /, *, xp=None):
    r"""Mean row maximum ("peak") per head.

    .. math::

        \mathrm{peak}_n = \frac{1}{|R_n|}\sum_{r \in R_n} \max_j p_{rj}

    over the live rows :math:`R_n` of head ``n`` (fully masked rows left out).
    ``1/S`` for uniform attention, 1 for one-hot attention; heads at or above
    0.98 are nearly one-hot (check the scale, the learning rate, warm-up).

    Parameters
    ----------
    weights : array, (..., N, T, S) or (T, S)
        Attention probabilities; a ``(T, S)`` matrix is one head.
    xp : namespace, optional
        Array API namespace; inferred from ``weights`` by default.

    Returns
    -------
    array, (N,)
        In the compute dtype; NaN for a head with no live row.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.array([[0.5, 0.5], [0.9, 0.1], [0.0, 0.0]])   # (T, S), last row masked
    >>> attention_peak(w).tolist()
    [0.7]
    """
    xp, p = _prepare(weights, xp)
    p = _as_heads(xp, p)  # (..., N, T, S)
    return _head_mean(xp, _row_max(xp, p), _live_rows(xp, p))  # (N,)


@dataclass(frozen=True)
class RowSumReport:
    """Outcome of :func:`row_sum_check`.

    Attributes
    ----------
    ok : bool
        Every row passes.
    max_deviation : float
        Worst ``|rowsum - target|`` (NaN when a row holds NaN).
    worst_row : tuple of int or None
        Index into ``weights.shape[:-1]`` of the worst row (None without rows).
    atol : float
        The tolerance used.
    n_rows, n_masked_rows, n_failing : int
        All rows, all-zero (fully masked) rows, rows outside the tolerance.
    failing_rows : tuple of tuple of int
        The first failing rows in C order (at most ``max_listed``), as
        indices into ``weights.shape[:-1]``.
    """

    ok: bool
    max_deviation: float
    worst_row: tuple[int, ...] | None
    atol: float
    n_rows: int
    n_masked_rows: int
    n_failing: int
    failing_rows: tuple[tuple[int, ...], ...]

    def __str__(self) -> str:
        head = (
            f"row sums: {'ok' if self.ok else 'FAILED'} (worst |sum - target| = "
            f"{self.max_deviation:.3g} at row {self.worst_row}, atol {self.atol:.2g}; "
            f"{self.n_rows} rows, {self.n_masked_rows} fully masked)"
        )
        if self.ok:
            return head
        more = self.n_failing - len(self.failing_rows)
        listed = ", ".join(str(r) for r in self.failing_rows) + (f", ... ({more} more)" if more else "")
        return f"{head}\n  {self.n_failing} failing rows: {listed}"


def row_sum_check(weights, /, *, atol=None, max_listed=10, xp=None) -> RowSumReport:
    r"""Check that every row of the attention weights sums to 1, or is all zeros.

    .. math::

        \mathrm{dev}_r = \Big|\sum_j p_{rj} - [\,\exists j: p_{rj} \ne 0\,]\Big|
        \le \mathrm{atol}

    A live row must sum to 1; a fully masked row (all zeros) sums to 0 and
    passes. A row holding NaN fails. Deviations of O(0.1) or more usually mean
    the softmax ran over the wrong axis or a mask was applied after it.

    Parameters
    ----------
    weights : array, (..., T, S)
        Attention probabilities; rows are along the last axis.
    atol : float, optional
        Default: 1.5e-8 for float64 and 3.5e-4 for float32 (``sqrt(eps)``);
        2e-3 for float16 and 1.6e-2 for bfloat16 (``2 eps``: rounding each
        probability to the narrow dtype moves a row sum by up to ``eps / 2``).
    max_listed : int
        How many failing rows to list in the report.
    xp : namespace, optional
        Array API namespace; inferred from ``weights`` by default.

    Returns
    -------
    RowSumReport

    Examples
    --------
    >>> import numpy as np
    >>> w = np.array([[0.5, 0.5], [0.0, 0.0], [0.3, 0.3]])
    >>> report = row_sum_check(w)
    >>> report.ok, report.failing_rows, round(report.max_deviation, 12)
    (False, ((2,),), 0.4)
    """
    xp, p = _prepare(weights, xp)
    atol = _default_atol(xp, weights.dtype) if atol is None else _check_real("atol", atol, minimum=0.0)
    max_listed = check_int("max_listed", max_listed, minimum=0)
    sums = xp.sum(p, axis=-1)  # (..., T)
    live = _live_rows(xp, p)  # (..., T)
    dev = xp.abs(sums - xp.astype(live, p.dtype))  # (..., T)
    fail = ~(dev <= atol)  # NaN fails
    rows_shape = tuple(dev.shape)
    n_rows = math.prod(rows_shape)
    n_masked = n_rows - int(xp.sum(xp.astype(live, xp.int64)))
    n_failing = int(xp.sum(xp.astype(fail, xp.int64)))
    if n_rows == 0:
        return RowSumReport(True, 0.0, None, float(atol), 0, 0, 0, ())
    flat_dev = xp.reshape(dev, (-1,))  # (rows,)
    max_dev = float(xp.max(flat_dev))
    ranked = xp.where(xp.isnan(flat_dev), xp.full_like(flat_dev, math.inf), flat_dev)
    worst = _unravel(int(xp.argmax(ranked)), rows_shape)
    listed: list[tuple[int, ...]] = []
    if n_failing:
        idx = xp.nonzero(xp.reshape(fail, (-1,)))[0]  # (n_failing,) flat row indices
        listed = [_unravel(int(idx[i]), rows_shape) for i in range(min(n_failing, max_listed))]
    return RowSumReport(n_failing == 0, max_dev, worst, float(atol), n_rows, n_masked, n_failing, tuple(listed))


# --------------------------------------------------------------------------- NaN / inf


@dataclass(frozen=True)
class FiniteEntry:
    """Non-finite counts of one array: NaN, +inf, -inf, and the first bad element.

    ``first_bad`` is the C-order index of the first element that counts as bad
    (NaN, +inf, or -inf unless allowed for this array), or None.
    """

    shape: tuple[int, ...]
    dtype: str
    n_nan: int
    n_posinf: int
    n_neginf: int
    neginf_allowed: bool
    first_bad: tuple[int, ...] | None

    @property
    def ok(self) -> bool:
        return self.first_bad is None


@dataclass(frozen=True)
class FiniteReport:
    """Outcome of :func:`check_finite`: one :class:`FiniteEntry` per named array."""

    entries: dict[str, FiniteEntry] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.entries.values())

    @property
    def bad(self) -> list[str]:
        """Names of the arrays that hold a bad value."""
        return [name for name, e in self.entries.items() if not e.ok]

    def __str__(self) -> str:
        lines = [f"non-finite check: {'ok' if self.ok else 'FAILED (' + ', '.join(self.bad) + ')'}"]
        width = max((len(n) for n in self.entries), default=0)
        for name, e in self.entries.items():
            neginf = f"{e.n_neginf}" + (" (allowed)" if e.neginf_allowed and e.n_neginf else "")
            where = "" if e.first_bad is None else f"  first bad at {e.first_bad}"
            lines.append(
                f"  {name:<{width}} {e.shape!s:<16} {e.dtype:<8} nan={e.n_nan} +inf={e.n_posinf} -inf={neginf}{where}"
            )
        return "\n".join(lines)


def check_finite(arrays: Mapping[str, Any], /, *, allow_neginf: Iterable[str] = ()) -> FiniteReport:
    r"""Count NaN, +inf and -inf in each of a set of named arrays.

    .. math::

        \mathrm{bad}(x) = \mathrm{isnan}(x) \lor (x = +\infty) \lor
        \big((x = -\infty) \land \text{not allowed}\big)

    Use it on scores, outputs, ``lse`` and gradients when a loss turns NaN.
    ``lse`` is ``-inf`` on fully masked rows by design: name it in
    ``allow_neginf`` so those do not count as bad (they are still counted).

    Parameters
    ----------
    arrays : mapping of str to array
        Named arrays of any Array API library (each may come from a different
        one); ``None`` values are skipped. Integer and bool arrays are always
        finite.
    allow_neginf : iterable of str
        Names whose ``-inf`` entries are expected.

    Returns
    -------
    FiniteReport
        ``.ok``, ``.bad`` (names), ``.entries[name]`` with the counts and the
        first bad index; printable.

    Raises
    ------
    TypeError
        ``arrays`` is not a mapping of str to arrays, or holds a complex array.
    ValueError
        ``allow_neginf`` names an array that is not in ``arrays``.

    Examples
    --------
    >>> import numpy as np
    >>> out = np.array([[0.0, np.nan], [np.inf, 1.0]])
    >>> lse = np.array([0.5, -np.inf])
    >>> report = check_finite({"out": out, "lse": lse}, allow_neginf=["lse"])
    >>> report.ok, report.bad, report.entries["out"].first_bad
    (False, ['out'], (0, 1))
    >>> print(report)
    non-finite check: FAILED (out)
      out (2, 2)           float64  nan=1 +inf=1 -inf=0  first bad at (0, 1)
      lse (2,)             float64  nan=0 +inf=0 -inf=1 (allowed)
    """
    if not isinstance(arrays, Mapping):
        raise TypeError(f"arrays must be a mapping of names to arrays, got {type(arrays).__name__}")
    if isinstance(allow_neginf, str):
        allow_neginf = [allow_neginf]
    if not isinstance(allow_neginf, Iterable):
        raise TypeError(f"allow_neginf must be a name or an iterable of names, got {allow_neginf!r}")
    allowed = set(allow_neginf)
    unknown = sorted(allowed - set(arrays))
    if unknown:
        raise ValueError(f"allow_neginf names {unknown}, which are not among the arrays {list(arrays)}")
    entries = {}
    for name, a in arrays.items():
        if not isinstance(name, str):
            raise TypeError(f"array names must be str, got {name!r}")
        if a is None:
            continue
        xp = resolve_namespace({name: a})
        entries[name] = _finite_entry(xp, name, a, name in allowed)
    return FiniteReport(entries)


def _finite_entry(xp: Any, name: str, a: Any, neginf_allowed: bool) -> FiniteEntry:
    shape, dtype = tuple(a.shape), dtype_name(a.dtype)
    if xp.isdtype(a.dtype, "complex floating"):
        raise TypeError(f"{name}: complex arrays are not supported, got {a.dtype}")
    if not xp.isdtype(a.dtype, "real floating"):
        return FiniteEntry(shape, dtype, 0, 0, 0, neginf_allowed, None)
    flat = xp.reshape(a, (-1,))  # (size,)
    nan, pos, neg = xp.isnan(flat), flat == math.inf, flat == -math.inf

    def count(mask):
        return int(xp.sum(xp.astype(mask, xp.int64)))

    bad = nan | pos if neginf_allowed else nan | pos | neg
    first = None
    if count(bad):
        first = _unravel(int(xp.argmax(xp.astype(bad, xp.int8))), shape)  # first True in C order
    return FiniteEntry(shape, dtype, count(nan), count(pos), count(neg), neginf_allowed, first)


# --------------------------------------------------------------------------- summary


@dataclass(frozen=True)
class AttentionSummary:
    """Outcome of :func:`summarize`; ``print`` it for a table.

    Attributes
    ----------
    shape : tuple of int
        Shape of the weights.
    dtype : str
    entropy, peak : tuple of float
        Per head (see :func:`attention_entropy`, :func:`attention_peak`).
    uniform_entropy : float
        ``log S``, the entropy of uniform attention over all ``S`` keys.
    row_sums : RowSumReport
    n_nan, n_inf : int
        Non-finite entries in the weights.
    warnings : tuple of str
        What the checklist flags: failing row sums, NaN/inf, nearly one-hot heads.
    """

    shape: tuple[int, ...]
    dtype: str
    entropy: tuple[float, ...]
    peak: tuple[float, ...]
    uniform_entropy: float
    row_sums: RowSumReport
    n_nan: int
    n_inf: int
    warnings: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Row sums pass and the weights are finite (peaky heads are only warned about)."""
        return self.row_sums.ok and self.n_nan == 0 and self.n_inf == 0

    def __str__(self) -> str:
        lines = [
            f"attention weights {self.shape} {self.dtype}",
            str(self.row_sums),
            f"non-finite entries: nan={self.n_nan}, inf={self.n_inf}",
            f"{'head':>4} {'entropy':>8} {'peak':>6}",
        ]
        lines += [f"{n:>4} {h:8.3f} {pk:6.3f}" for n, (h, pk) in enumerate(zip(self.entropy, self.peak))]
        lines.append(f"(entropy in nats; uniform over all keys = log S = {self.uniform_entropy:.3f})")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def summarize(weights, /, *, atol=None, peak_warning=PEAK_WARNING, xp=None) -> AttentionSummary:
    r"""The quick debug smoke test in one call: row sums, NaN/inf, entropy, peak.

    .. math::

        \text{per head } n:\quad H_n = \overline{-\textstyle\sum_j p\log p},\qquad
        \mathrm{peak}_n = \overline{\max_j p},\qquad
        \text{per row: } \big|\textstyle\sum_j p - 1\big| \le \mathrm{atol}

    Parameters
    ----------
    weights : array, (..., N, T, S) or (T, S)
        Attention probabilities, e.g. ``DenseResiduals.probs``; all-zero rows
        are fully masked.
    atol : float, optional
        Row-sum tolerance (see :func:`row_sum_check`).
    peak_warning : float
        Heads whose mean peak reaches this are warned about as nearly one-hot.
    xp : namespace, optional
        Array API namespace; inferred from ``weights`` by default.

    Returns
    -------
    AttentionSummary
        Plain Python numbers; ``print`` it, or ``dataclasses.asdict`` it for logs.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.array([[[0.5, 0.5], [1.0, 0.0]],
    ...               [[1.0, 0.0], [0.0, 1.0]]])          # (N=2, T=2, S=2)
    >>> print(summarize(w))
    attention weights (2, 2, 2) float64
    row sums: ok (worst |sum - target| = 0 at row (0, 0), atol 1.5e-08; 4 rows, 0 fully masked)
    non-finite entries: nan=0, inf=0
    head  entropy   peak
       0    0.347  0.750
       1    0.000  1.000
    (entropy in nats; uniform over all keys = log S = 0.693)
    warning: head 1 has mean peak >= 0.98: nearly one-hot attention (check the scale, learning rate, warm-up)
    """
    xp, p = _prepare(weights, xp)
    if atol is not None:
        _check_real("atol", atol, minimum=0.0)
    peak_warning = _check_real("peak_warning", peak_warning)
    entropy = _floats(attention_entropy(p, xp=xp))
    peak = _floats(attention_peak(p, xp=xp))
    row_sums = row_sum_check(p, atol=_default_atol(xp, weights.dtype) if atol is None else atol, xp=xp)
    finite = _finite_entry(xp, "weights", p, False)
    n_inf = finite.n_posinf + finite.n_neginf
    warnings = []
    if not row_sums.ok:
        warnings.append(
            f"{row_sums.n_failing} rows do not sum to 1 (or 0 when fully masked): "
            "check the softmax axis and that masks are applied before the softmax"
        )
    if finite.n_nan or n_inf:
        warnings.append(f"weights hold {finite.n_nan} NaN and {n_inf} inf entries, first at {finite.first_bad}")
    peaky = [n for n, pk in enumerate(peak) if pk >= peak_warning]
    if peaky:
        heads = ", ".join(map(str, peaky))
        warnings.append(
            f"head{'s' if len(peaky) > 1 else ''} {heads} ha{'ve' if len(peaky) > 1 else 's'} "
            f"mean peak >= {peak_warning}: nearly one-hot attention "
            "(check the scale, learning rate, warm-up)"
        )
    S = weights.shape[-1]
    return AttentionSummary(
        tuple(weights.shape),
        dtype_name(weights.dtype),
        entropy,
        peak,
        math.log(S) if S else math.nan,
        row_sums,
        finite.n_nan,
        n_inf,
        tuple(warnings),
    )


# --------------------------------------------------------------------------- plotting


def _labels(name: str, tokens: Any, length: int, axis: str) -> list[str] | None:
    if tokens is None:
        return None
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a sequence of labels (list or tuple), got {type(tokens).__name__}")
    if len(tokens) != length:
        raise ValueError(f"{name} has {len(tokens)} labels but the {axis} axis has length {length}")
    return [str(t) for t in tokens]


def plot_attention(
    weights,
    /,
    *,
    path,
    tokens=None,
    query_tokens=None,
    key_tokens=None,
    batch_index=None,
    heads=None,
    title=None,
    vmin=0.0,
    vmax=1.0,
    cmap="viridis",
    dpi=100,
    xp=None,
) -> pathlib.Path:
    r"""Draw per-head attention heatmaps to an image file (PNG by default).

    Cell ``(t, s)`` of head ``n``'s panel is :math:`p_{nts}`, how much query
    ``t`` attends to key ``s``; one panel per head on a grid, each titled with
    the head's entropy and peak, one shared colour bar. Fully masked rows (all
    zeros) are drawn light grey, apart from keys a live row gives no weight.

    Parameters
    ----------
    weights : array, (N, T, S), (T, S), or (B, N, T, S) with ``batch_index``
        Attention probabilities of any Array API library (copied to NumPy).
    path : str or path-like
        Where to write; the format follows the suffix (PNG without one). The
        directory must exist.
    tokens : sequence, optional
        Labels for both axes when ``T == S`` (self-attention).
    query_tokens, key_tokens : sequence, optional
        Labels for the query (y, length T) and key (x, length S) axes; use them
        for cross-attention instead of ``tokens``.
    batch_index : int, optional
        Which batch element of 4-D weights to draw (required for them).
    heads : sequence of int, optional
        Which heads to draw (default all).
    title : str, optional
        Figure title.
    vmin, vmax : float or None
        Colour limits, ``[0, 1]`` by default so heads compare; None scales to
        the data.
    cmap : str
        A matplotlib colour map name.
    dpi : int
        Resolution of the image.
    xp : namespace, optional
        Array API namespace; inferred from ``weights`` by default.

    Returns
    -------
    pathlib.Path
        The file written.

    Raises
    ------
    ImportError
        matplotlib is missing: ``pip install "npattn[plot]"``.
    TypeError
        ``weights`` is not a floating array; ``tokens``/``heads``/
        ``batch_index``/``path`` have the wrong type.
    ValueError
        Shapes, label counts, ``batch_index`` or ``heads`` that do not fit.

    Examples
    --------
    >>> import numpy as np
    >>> w = np.tril(np.ones((3, 3))) / np.arange(1, 4)[:, None]   # (T, S) causal, uniform
    >>> plot_attention(w, tokens=["the", "cat", "sat"], path="attn.png")  # doctest: +SKIP
    PosixPath('attn.png')
    >>> plot_attention(w, tokens=["the", "cat"], path="attn.png")
    Traceback (most recent call last):
    ...
    ValueError: tokens has 2 labels but the query axis has length 3
    """
    xp = resolve_namespace({"weights": weights}, xp)
    check_floating(xp, "weights", weights)
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or path-like, got {type(path).__name__}")
    w = _weights_to_draw(xp, weights, batch_index)  # (N, T, S)
    N, T, S = w.shape
    if N == 0:
        raise ValueError(f"weights has no heads to draw (shape {tuple(weights.shape)})")
    for name, value in (("vmin", vmin), ("vmax", vmax)):
        if value is not None:
            _check_real(name, value)
    if isinstance(dpi, bool) or not isinstance(dpi, numbers.Real) or not float(dpi) > 0:
        raise ValueError(f"dpi must be a positive number, got {dpi!r}")
    y_labels, x_labels = _axis_labels(tokens, query_tokens, key_tokens, T, S)
    heads = _head_indices(heads, N)

    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError('plot_attention needs matplotlib: pip install "npattn[plot]"') from err

    p = xp.astype(w, compute_dtype(xp, w.dtype), copy=False)  # (N, T, S)
    entropy = _floats(attention_entropy(p, xp=xp))
    peak = _floats(attention_peak(p, xp=xp))
    host = to_numpy(p)  # (N, T, S)
    try:
        colormap = matplotlib.colormaps[cmap].with_extremes(bad="lightgrey")  # fully masked rows
    except (KeyError, TypeError) as err:
        raise ValueError(f"cmap must name a matplotlib colour map, got {cmap!r}") from err

    ncols = min(len(heads), 4)
    nrows = math.ceil(len(heads) / ncols)
    cell = min(max(3.0, 0.22 * max(T, S) + 1.0), 12.0)
    fig = Figure(figsize=(cell * ncols + 1.0, cell * nrows + (0.5 if title else 0.0)), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    images = []
    for n, ax in zip(heads, axes.flat):
        cells = _masked_rows(host[n])  # (T, S)
        images.append(ax.imshow(cells, vmin=vmin, vmax=vmax, cmap=colormap, aspect="auto", interpolation="nearest"))
        ax.set_title(f"head {n}  (entropy {entropy[n]:.2f}, peak {peak[n]:.2f})", fontsize=9)
        _label_axes(ax, x_labels, y_labels, T, S)
    for ax in axes.flat[len(heads) :]:
        ax.set_axis_off()
    fig.colorbar(images[-1], ax=axes, shrink=0.8, label="attention weight")
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=dpi)
    return pathlib.Path(path)


def _weights_to_draw(xp: Any, weights: Any, batch_index: Any) -> Any:
    """``weights`` as ``(N, T, S)``: a (T, S) map gets a head axis, a
    (B, N, T, S) one is indexed by ``batch_index`` (required for it only)."""
    shape = tuple(weights.shape)
    if weights.ndim == 4:
        if batch_index is None:
            raise ValueError(
                f"weights has a batch axis (shape {shape}, B={shape[0]}); "
                "pass batch_index= to pick the batch element to draw"
            )
        if isinstance(batch_index, bool) or not hasattr(batch_index, "__index__"):
            raise TypeError(f"batch_index must be an int, got {type(batch_index).__name__}")
        batch_index = operator.index(batch_index)
        if not -shape[0] <= batch_index < shape[0]:
            raise ValueError(f"batch_index {batch_index} is out of range for batch size {shape[0]}")
        return weights[batch_index, ...]  # (N, T, S)
    if weights.ndim in (2, 3):
        if batch_index is not None:
            raise ValueError(f"batch_index is only for 4-D (B, N, T, S) weights, got shape {shape}")
        return _as_heads(xp, weights)  # (N, T, S)
    raise ValueError(f"weights must have shape (N, T, S), (T, S) or (B, N, T, S), got {shape}")


def _axis_labels(tokens: Any, query_tokens: Any, key_tokens: Any, T: int, S: int) -> tuple[Any, Any]:
    """``(y_labels, x_labels)``, the query and key axes' labels (None: unlabelled)."""
    if tokens is not None and (query_tokens is not None or key_tokens is not None):
        raise ValueError("pass either tokens (both axes) or query_tokens/key_tokens, not both")
    if tokens is None:
        return _labels("query_tokens", query_tokens, T, "query"), _labels("key_tokens", key_tokens, S, "key")
    if T != S:
        raise ValueError(
            f"tokens labels both axes and needs T == S, got T={T}, S={S}; "
            "pass query_tokens= and key_tokens= for cross-attention"
        )
    return _labels("tokens", tokens, T, "query"), _labels("tokens", tokens, S, "key")


def _head_indices(heads: Any, N: int) -> list[int]:
    """The heads to draw as indices in ``[0, N)`` (negative ones count from the end); all by default."""
    if heads is None:
        return list(range(N))
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence):
        raise TypeError(f"heads must be a sequence of ints, got {type(heads).__name__}")
    if not heads:
        raise ValueError("heads must name at least one head")
    for n in heads:
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"heads must hold ints, got {n!r}")
        if not -N <= operator.index(n) < N:
            raise ValueError(f"heads holds {n}, out of range for {N} heads")
    return [operator.index(n) % N for n in heads]


def _masked_rows(head: np.ndarray) -> np.ma.MaskedArray:
    """One head's (T, S) map with its fully masked (all-zero) rows masked, drawn as the colour map's "bad" colour."""
    masked_rows = ~(head != 0).any(axis=-1, keepdims=True)  # (T, 1)
    return np.ma.masked_array(head, mask=np.broadcast_to(masked_rows, head.shape))  # (T, S)


def _label_axes(ax: Any, x_labels: list[str] | None, y_labels: list[str] | None, T: int, S: int) -> None:
    """Axis names, and the token labels where given (smaller type on long axes)."""
    fontsize = 8 if max(T, S) <= 24 else 6
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    if x_labels is not None:
        ax.set_xticks(range(S), labels=x_labels, rotation=90, fontsize=fontsize)
    if y_labels is not None:
        ax.set_yticks(range(T), labels=y_labels, fontsize=fontsize)
