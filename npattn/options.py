"""Argument checking for attention: turns the public keyword arguments into
one validated, immutable :class:`AttentionSpec` that every path reads.

All checks happen here, before any compute, so the dense and chunked paths
see identical, already-normalized options and every bad input gets one clear
``TypeError`` or ``ValueError`` that names the argument. This module imports
no kernel: the data flow is arguments -> validated spec (here) -> path choice
(:func:`npattn.attention.choose_impl`) -> kernel -> residuals -> backward.

:func:`check_int` is the integer-argument check every other module (the
layer, the KV cache, diagnostics, the gradient checker, interop, ring
attention, the demo's command line) uses too.
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, overload

import numpy as np

from .namespace import array_device, check_floating, compute_dtype, resolve_namespace, to_numpy

__all__ = ["AttentionSpec", "SegmentHost", "make_spec", "plain_spec", "check_int", "check_lengths", "IMPLS", "ALIGNS"]

IMPLS = ("auto", "dense", "chunked")
ALIGNS = ("top_left", "bottom_right")

#: ``impl="auto"`` switches to the chunked path once the dense score tensor
#: ``(..., N, T, S)`` would hold more than this many entries (per call, all
#: heads and batch elements together): 2**24 entries is 64 MiB in float32.
AUTO_CHUNKED_MIN_SCORES = 2**24

#: Where the chunked path runs the NumPy fast path (:mod:`npattn.fast_numpy`),
#: ``impl="auto"`` also picks it once the dense score tensor would hold at
#: least this many entries, all batch elements and heads together (8 MiB in
#: float32): from there its blocked, threaded items beat the dense path's
#: whole-tensor passes, with or without causal/window, lengths or segment
#: ids. Measured on 2 cores, N=8, H=64, float32, each side in a loop of its
#: own calls, interleaved in one process (chunked / dense time;
#: ``benchmarks/bench_workloads.py --auto-grid``), in a process whose
#: allocator returned freed arrays to the system (the dense path's arrays
#: then fault their pages in on every call) and in one whose allocator kept
#: them (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``): at 2**21,
#: full attention (B=1 T=S=512, B=4 T=256) forward 0.58-0.76 and
#: forward+backward 0.50-1.03; causal, window, segment ids, kv_lengths and
#: causal with kv_lengths (B=16 T=128, B=4 T=256, B=1 T=512) forward
#: 0.23-0.82 and forward+backward 0.47-1.01. At 2**20 the forward still wins
#: (0.56-0.88) but forward+backward does not everywhere (0.72-1.14), and at
#: 2**19 neither does (full: 0.91-1.11 and 0.75-1.31). A bool mask, a bias,
#: the softcap, dropout and sinks at 2**21 (B=4 T=256, B=1 T=512, one run):
#: forward 0.30-0.72, forward+backward 0.31-0.90. A softcap, ALiBi or
#: dropout start earlier (:data:`AUTO_FAST_VARIANT_MIN_SCORES`), score
#: modifications later (:data:`AUTO_FAST_SINGLE_HEAD_MIN_SCORES`). The
#: multi-head layer follows the same rule (its projections run on the same
#: pool, :mod:`npattn.linear_numpy`).
#: See ``docs/performance.rst``.
AUTO_FAST_MIN_SCORES = 2**21

#: :data:`AUTO_FAST_MIN_SCORES` for calls with a softcap, ALiBi or dropout
#: (and no score modification), whose dense path makes whole-tensor passes
#: of its own (``tanh``, the distances, the keep mask's hashes) on one core.
#: Measured as above (one run; N=8, H=64, standard slopes, cap 50, p=0.1):
#: at 2**20 (B=8 T=128, B=1 T=362, B=2 T=256, full and causal) the fast
#: path takes 0.30-0.73 of the dense path's time forward and 0.35-0.72
#: forward+backward; ALiBi at 2**21 (B=16 T=128 to N=2 T=1024) 0.22-0.72
#: and 0.23-0.70. At 2**19 ALiBi loses (0.89-1.44), and a softcap or
#: dropout win full attention (0.41-0.76) but not always causal
#: (0.94-1.02 forward, 0.49-0.98 forward+backward); a bias, sinks or a
#: mask at 2**20 do not win (1.00-1.72 in one of the passes), and keep
#: :data:`AUTO_FAST_MIN_SCORES`.
AUTO_FAST_VARIANT_MIN_SCORES = 2**20

#: :data:`AUTO_FAST_MIN_SCORES` for calls with score modifications, whose
#: fast-path items hold one kv head each (:func:`npattn.fast_numpy._kv_groups`),
#: so that short sequences make many small items. Measured as above, one
#: run, when ALiBi's items held one kv head too: at 2**21 the forward took
#: 1.22-2.67 of the dense path's time (B=4 T=256, B=16 T=128) but 0.45 at
#: B=1 T=512; at 2**22 (B=8 T=256, B=2 T=512) forward 0.38-1.01 and
#: forward+backward 0.42-0.89. ALiBi now groups kv heads where the keys fit
#: one key tile and keeps the zero reference where rows see their own keys,
#: and takes :data:`AUTO_FAST_MIN_SCORES`.
AUTO_FAST_SINGLE_HEAD_MIN_SCORES = 2**22

#: Tile sizes of the generic chunked path on the CPU (array-api-strict on any
#: device, torch CPU tensors) when ``block_q``/``block_k`` are None. On an
#: accelerator the defaults grow with the budget below, see
#: :func:`npattn.chunked.default_blocks`; the NumPy fast path picks its own,
#: see :mod:`npattn.fast_numpy`.
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128

#: On an accelerator (CuPy; torch on a non-CPU device) the generic chunked
#: path's default tiles are as large as keeps one score tile over all batch
#: elements and query heads, ``B * N * block_q * block_k``, within this many
#: entries: 2**25 is 128 MiB in float32, 2048 x 2048 tiles at ``B * N = 8``.
#: Each tile loop step launches ~20 small kernels, so on a GPU fewer, larger
#: tiles are what makes the path fast (see :func:`npattn.chunked.default_blocks`).
ACCELERATOR_TILE_SCORES = 2**25

#: The range of those accelerator default tile sides (powers of two), before
#: they are clipped to the sequence lengths.
ACCELERATOR_BLOCK_MIN = 128
ACCELERATOR_BLOCK_MAX = 2048


class SegmentHost(NamedTuple):
    """Host (NumPy) copies of the segment ids, flattened to ``q (B, T)`` and
    ``kv (B, S)``, for classifying tiles without a device sync; ``extremes``
    memoizes each batch element's (min, max) id over the ranges asked for
    (filled by :mod:`npattn.scores.visibility`: a call classifies the same
    query and key ranges over and over)."""

    q: Any
    kv: Any
    extremes: dict


@dataclass(frozen=True, eq=False)
class AttentionSpec:
    """Validated attention options, shared by the forward and the backward.

    Dimension legend: B... batch axes, N query heads, K key/value heads,
    T query length, S key length, H head dim, Hv value head dim.

    ``mask`` and ``bias`` are the user's arrays reshaped (a view, never a copy)
    to rank ``len(batch_shape) + 3`` so that tiles can be sliced uniformly;
    ``bias_shape`` and ``bias_dtype`` remember the original for ``dbias``.
    ``window_left``/``window_right`` already include ``causal`` (right = 0).
    ``q_offset`` is the position of query 0: ``0`` (top_left), an int
    (bottom_right without lengths) or an int64 array of shape ``batch_shape``
    (bottom_right with lengths). ``offset_bounds`` and the ``*_len_bounds``
    are its host-side (min, max), used to classify tiles without a sync.
    ``impl`` is the caller's, ``"auto"`` included: choosing the path is the
    dispatcher's job (:func:`npattn.attention.choose_impl`), not validation's.

    The variants of the score pipeline (:mod:`npattn.scores`): ``softcap`` a
    float or None; ``alibi_slopes`` the slopes viewed at rank
    ``len(batch_shape) + 3`` as ``(..., N|1, 1, 1)`` and ``sinks`` at rank
    ``len(batch_shape) + 2`` as ``(..., N|1, 1)`` (views, with their own
    ``*_shape`` and ``*_dtype`` for the gradients); ``q_segment_ids`` and
    ``kv_segment_ids`` int64 of shapes ``batch_shape + (T,)`` and
    ``batch_shape + (S,)``, with host (NumPy) copies flattened to
    ``(B, T)``/``(B, S)`` in ``segment_host`` for classifying tiles.
    ``q_offset`` is set whenever positions matter: causal/window, ALiBi or
    user modifications (:mod:`npattn.scores.mods`): ``score_mods`` a tuple of
    :class:`~npattn.scores.mods.ScoreMod`, their parameters by name in the
    compute dtype in ``mod_params``, ``mask_mod`` the user's callable (from
    ``block_mask`` when one is given) and ``block_mask`` a
    :class:`~npattn.scores.block_mask.BlockMask` or None. ``index_origin``
    is the (row, column) index that query 0 and key 0 have in the dropout
    hash: ``(0, 0)``, except for ring attention's shards
    (:mod:`npattn.distributed`), which draw the full sequence's bits.
    """

    xp: Any
    device: Any
    batch_shape: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    value_dim: int
    dtype: Any
    compute_dtype: Any
    scale: float
    mask: Any
    bias: Any
    bias_shape: tuple[int, ...] | None
    bias_dtype: Any
    window_left: int | None
    window_right: int | None
    align: str | None
    q_lengths: Any
    kv_lengths: Any
    q_offset: Any
    offset_bounds: tuple[int, int]
    q_len_bounds: tuple[int, int]
    kv_len_bounds: tuple[int, int]
    dropout_p: float
    seed: int | None
    impl: str
    block_q: int | None
    block_k: int | None
    softcap: float | None = None
    alibi_slopes: Any = None
    alibi_shape: tuple[int, ...] | None = None
    alibi_dtype: Any = None
    sinks: Any = None
    sinks_shape: tuple[int, ...] | None = None
    sinks_dtype: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    segment_host: SegmentHost | None = None
    score_mods: tuple[Any, ...] = ()
    mod_params: dict[str, Any] = field(default_factory=dict)
    mask_mod: Any = None
    block_mask: Any = None
    index_origin: tuple[int, int] = (0, 0)

    def replace(self, **changes: Any) -> AttentionSpec:
        """This spec with ``changes`` (field names to new values): what
        ``dataclasses.replace`` returns, without re-running ``__init__`` over
        every field (1 µs instead of 14, on every call's path choice). The
        fields are set as given, so they must already be validated.

        >>> import numpy as np
        >>> x = np.zeros((1, 2, 3))
        >>> make_spec(x, x, x).replace(impl="dense").impl
        'dense'
        """
        unknown = changes.keys() - self.__dataclass_fields__.keys()
        if unknown:
            raise TypeError(f"AttentionSpec has no fields {sorted(unknown)}")
        spec = object.__new__(AttentionSpec)
        spec.__dict__.update(self.__dict__, **changes)
        return spec

    @property
    def group_size(self) -> int:
        """Query heads per key/value head, ``G = N // K``."""
        return self.num_heads // self.num_kv_heads

    @property
    def has_positional_mask(self) -> bool:
        """Whether causal/window or lengths restrict which keys are visible."""
        return (
            self.window_left is not None
            or self.window_right is not None
            or self.q_lengths is not None
            or self.kv_lengths is not None
        )

    @property
    def has_segments(self) -> bool:
        """Whether segment ids (packed documents) restrict visibility."""
        return self.q_segment_ids is not None

    @property
    def has_index_rules(self) -> bool:
        """Whether a rule decided by indices alone (causal/window, lengths,
        segment ids, a block mask's mask_mod) hides some keys: such tiles can
        be classified and cut."""
        return self.has_positional_mask or self.has_segments or self.block_mask is not None

    @property
    def has_user_mask(self) -> bool:
        """Whether a user mask or mask modification restricts visibility."""
        return self.mask is not None or self.mask_mod is not None

    @property
    def scores_are_raw(self) -> bool:
        """Whether no option changes the scores or drops probabilities: no
        bias, softcap, ALiBi, score modification or dropout. The mask,
        causal/window, lengths, segment ids and a mask modification may
        still hide keys (:func:`~npattn.scores.visibility.visible_tile`);
        sinks merge after every path's kernel."""
        return not (
            self.bias is not None
            or self.dropout_p
            or self.softcap is not None
            or self.alibi_slopes is not None
            or self.score_mods
        )

    @property
    def num_batch(self) -> int:
        return math.prod(self.batch_shape)


class SpecMemo:
    """Values derived from specs, kept by each spec's identity: a dict per
    spec, dropped when the spec is (each entry holds a weak reference to
    its spec, so that it keeps no spec alive and is found for no other),
    for at most ``size`` specs at once (emptied when full).

    >>> import numpy as np
    >>> memo, x = SpecMemo(), np.zeros((1, 2, 3))
    >>> spec = make_spec(x, x, x)
    >>> memo.get(spec) is None
    True
    >>> memo.values(spec)["answer"] = 42
    >>> memo.get(spec), memo.get(make_spec(x, x, x))
    ({'answer': 42}, None)
    >>> del spec
    >>> len(memo)
    0
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._entries: dict[int, tuple[weakref.ref[AttentionSpec], dict[Any, Any]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, spec: AttentionSpec) -> dict[Any, Any] | None:
        """The values kept for ``spec``, or None where it has no entry."""
        entry = self._entries.get(id(spec))
        return entry[1] if entry is not None and entry[0]() is spec else None

    def values(self, spec: AttentionSpec) -> dict[Any, Any]:
        """The values kept for ``spec``: a new, empty dict where it had no entry."""
        values = self.get(spec)
        if values is None:
            if len(self._entries) >= self.size:
                self._entries.clear()
            values = {}
            self._entries[id(spec)] = (weakref.ref(spec, self._forget(id(spec))), values)
        return values

    def _forget(self, key: int) -> Any:
        """The callback that drops entry ``key`` when its spec is gone (and
        not a newer entry that took the same id)."""
        entries = self._entries

        def forget(ref: weakref.ref[AttentionSpec]) -> None:
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        return forget


#: The specs that recur, and what is derived from them once: a spec that
#: :func:`npattn.attention.scalar_call_spec` hands out again (a repeated
#: call's: a decode step with a fixed ``S``, a training step) gets an
#: entry, in which :func:`npattn.attention.choose_impl` keeps its resolved
#: spec (itself given an entry) and :mod:`npattn.fast_cupy` its launch
#: plans. A spec made for one call (a decoding loop's next step, whose keys
#: grew; a call with array options) gets none, so that such a call pays a
#: lookup (0.3 µs) and no entry.
RECURRING_SPECS = SpecMemo()


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s == t or s == 1 for s, t in zip(shape[::-1], target[::-1]))


@overload
def check_int(name: str, value: Any, *, minimum: int, allow_none: Literal[False] = False) -> int: ...


@overload
def check_int(name: str, value: Any, *, minimum: int, allow_none: bool) -> int | None: ...


def check_int(name: str, value: Any, *, minimum: int, allow_none: bool = False) -> int | None:
    """Return ``value`` as a Python int after checking it is an integer (any
    ``numbers.Integral``, NumPy's included; bool is not) ``>= minimum``, or
    None when ``allow_none`` and it is None.

    The one integer-argument check of npattn: ``TypeError`` ("{name} must be
    an int, got ...") or ``ValueError`` ("{name} must be >= {minimum}, got
    ..."), both naming the argument.

    >>> check_int("block_q", 64, minimum=1)
    64
    >>> check_int("seed", -1, minimum=0)
    Traceback (most recent call last):
    ...
    ValueError: seed must be >= 0, got -1
    """
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        expected = "an int or None" if allow_none else "an int"
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_lengths(xp, name, lengths, batch_shape, limit, device):
    """Validate ``q_lengths``/``kv_lengths``; returns (array, (min, max)).
    ``limit=None`` checks the type and shape only (ring attention checks
    the values once it knows the total length)."""
    if lengths is None:
        return None, (limit, limit)
    if isinstance(lengths, numbers.Integral) and not isinstance(lengths, bool):
        lengths = xp.asarray(lengths, dtype=xp.int64, device=device)
    if not hasattr(lengths, "shape") or not hasattr(lengths, "dtype"):
        raise TypeError(f"{name} must be an integer array of shape {batch_shape}, got {type(lengths).__name__}")
    if not xp.isdtype(lengths.dtype, "integral"):
        raise TypeError(f"{name} must have an integer dtype, got {lengths.dtype}")
    if tuple(lengths.shape) != batch_shape:
        raise ValueError(
            f"{name} must have the inputs' batch shape {batch_shape} (q.shape[:-3]), got shape {tuple(lengths.shape)}"
        )
    if math.prod(batch_shape) == 0:
        return xp.astype(lengths, xp.int64), (limit, limit)
    lo, hi = int(xp.min(lengths)), int(xp.max(lengths))
    if limit is not None and (lo < 0 or hi > limit):
        raise ValueError(f"{name} must lie in [0, {limit}], got values in [{lo}, {hi}]")
    return xp.astype(lengths, xp.int64), (lo, hi)


def _resolve_arrays(q, k, v, mask, bias, q_lengths, kv_lengths, xp, extra=None) -> Any:
    """The one namespace of every array argument (q, k, v must not be None)."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a is None:
            raise TypeError(f"{name} must be an array, got None")
    arrays = {
        "q": q,
        "k": k,
        "v": v,
        "mask": mask,
        "bias": bias,
        "q_lengths": q_lengths if hasattr(q_lengths, "shape") else None,
        "kv_lengths": kv_lengths if hasattr(kv_lengths, "shape") else None,
    }
    for name, a in (extra or {}).items():  # the score pipeline's arrays
        arrays[name] = a if hasattr(a, "shape") else None
    return resolve_namespace(arrays, xp)


def _shapes_fit(q_shape: tuple, k_shape: tuple, v_shape: tuple) -> bool:
    """Whether (..., N, T, H), (..., K, S, H), (..., K, S, Hv) fit: k and v
    share (K, S), S >= 1 and K divides N."""
    (N, _T, H), (K, S, Hk), (Kv, Sv, _Hv) = q_shape[-3:], k_shape[-3:], v_shape[-3:]
    return Hk == H and (Kv, Sv) == (K, S) and S >= 1 and K >= 1 and N % K == 0


def _layout_hint(q, k, v) -> str:
    """A sentence for shape errors that swapping axes -3 and -2 of some of
    q, k, v would fix (arrays passed as (..., length, heads, head_dim)); ""
    when no such swap makes the shapes fit."""
    shapes = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape)}

    def more_heads_than_positions(layout: dict) -> int:
        return sum(s[-3] > s[-2] for s in layout.values())

    # Heads are usually fewer than positions: a swap must not make that rarer,
    # and the one that leaves the fewest exceptions (then moves fewest arrays) wins.
    candidates = []
    for swapped in (("q",), ("k",), ("v",), ("k", "v"), ("q", "k"), ("q", "v"), ("q", "k", "v")):
        moved = {name: s[:-3] + (s[-2], s[-3], s[-1]) if name in swapped else s for name, s in shapes.items()}
        exceptions = more_heads_than_positions(moved)
        if _shapes_fit(moved["q"], moved["k"], moved["v"]) and exceptions <= more_heads_than_positions(shapes):
            candidates.append((exceptions, len(swapped), swapped))
    if not candidates:
        return ""
    swapped = min(candidates)[2]
    rank = len(shapes["q"])
    order = tuple(range(rank - 3)) + (rank - 2, rank - 3, rank - 1)
    if len(swapped) == 1:
        name = swapped[0]
        seen = f"{name}'s shape {shapes[name]} looks"
        fix = f"{name}.transpose{order} or np.swapaxes({name}, -3, -2)"
    else:
        names = ", ".join(swapped[:-1]) + " and " + swapped[-1]
        listed = ", ".join(str(shapes[name]) for name in swapped[:-1]) + f" and {shapes[swapped[-1]]}"
        seen = f"the shapes of {names}, {listed}, look"
        fix = f"x.transpose{order} or np.swapaxes(x, -3, -2) on each of {names}"
    return (
        f". q, k and v use the layout (..., heads, length, head_dim); {seen} like "
        f"(..., length, heads, head_dim): move the heads axis with {fix}"
    )


def _check_shapes(q, k, v) -> tuple[tuple[int, ...], tuple[int, int, int], tuple[int, int, int]]:
    """Ranks, batch axes, heads and lengths of q, k, v; returns
    ``(batch_shape, (N, T, H), (K, S, Hv))``."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim < 3:
            raise ValueError(
                f"{name} must have rank >= 3 with layout (..., heads, length, dim), got shape {tuple(a.shape)}"
            )
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(
            f"q, k and v must have the same rank, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    batch_shape = tuple(q.shape[:-3])
    if tuple(k.shape[:-3]) != batch_shape or tuple(v.shape[:-3]) != batch_shape:
        raise ValueError(
            f"q, k and v must have equal leading (batch) axes, got "
            f"{batch_shape}, {tuple(k.shape[:-3])}, {tuple(v.shape[:-3])}"
        )
    N, T, H = q.shape[-3:]
    K, S, Hk = k.shape[-3:]
    Kv, Sv, Hv = v.shape[-3:]
    if Hk != H:
        raise ValueError(f"k's head dim (last axis) must equal q's: q has H={H}, k has {Hk}")
    if (Kv, Sv) != (K, S):
        raise ValueError(
            f"v must have k's heads and length (axes -3, -2): k has (K={K}, S={S}), v has ({Kv}, {Sv})"
            + _layout_hint(q, k, v)
        )
    if S == 0:
        raise ValueError("k and v must hold at least one key (S >= 1); use kv_lengths=0 for an empty sequence")
    if K == 0 or N % K != 0:
        raise ValueError(
            f"the number of query heads N={N} must be a multiple of the number of "
            f"key/value heads K={K} (axis -3 of q and k)" + _layout_hint(q, k, v)
        )
    return batch_shape, (N, T, H), (K, S, Hv)


def _check_dtypes(xp, q, k, v) -> None:
    """q, k and v: one real floating dtype."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        check_floating(xp, name, a)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def _check_mask(xp, mask, full: tuple[int, ...]) -> Any:
    """A bool mask broadcastable to ``full`` (..., N, T, S), reshaped (a view) to its rank."""
    if mask is None:
        return None
    if mask.dtype != xp.bool:
        raise TypeError(
            f"mask must be a bool array (True = may attend), got dtype {mask.dtype}; "
            "pass additive float scores as bias="
        )
    if not _broadcasts_to(tuple(mask.shape), full):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (..., N, T, S) = {full}")
    return xp.reshape(mask, (1,) * (len(full) - mask.ndim) + tuple(mask.shape))


def _check_bias(xp, bias, full: tuple[int, ...]) -> tuple[Any, tuple[int, ...] | None, Any]:
    """A float bias broadcastable to ``full`` (..., N, T, S): ``(bias reshaped
    to that rank, its own shape, its dtype)``, or three Nones."""
    if bias is None:
        return None, None, None
    if not xp.isdtype(bias.dtype, "real floating"):
        raise TypeError(f"bias must have a real floating dtype, got {bias.dtype}; pass booleans as mask=")
    bias_shape = tuple(bias.shape)
    if not _broadcasts_to(bias_shape, full):
        raise ValueError(f"bias of shape {bias_shape} does not broadcast to (..., N, T, S) = {full}")
    return xp.reshape(bias, (1,) * (len(full) - bias.ndim) + bias_shape), bias_shape, bias.dtype


def _check_window(causal, window) -> tuple[int | None, int | None]:
    """``(left, right)`` of the visible band, ``causal`` folded in as right = 0."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    left = right = None
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of ints >= 0 or None, got {window!r}")
        left = check_int("window[0] (left)", window[0], minimum=0, allow_none=True)
        right = check_int("window[1] (right)", window[1], minimum=0, allow_none=True)
    if causal:
        if right not in (None, 0):
            raise ValueError(
                f"causal=True means window right = 0, but window=({left}, {right}) asks for {right}; "
                "drop causal or set the right side to 0 or None"
            )
        right = 0
    return left, right


def _check_align(align, positional: bool, T: int, S: int, what: str = "causal/window") -> str | None:
    """The alignment; None means top_left where positions matter (``what``:
    causal/window, ALiBi), allowed only when T == S."""
    if align is not None and align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS} or None, got {align!r}")
    if positional and align is None:
        if T != S:
            raise ValueError(
                f"{what} with T={T} != S={S} needs an explicit alignment: "
                "align='top_left' (query i at position i, PyTorch is_causal) or "
                "align='bottom_right' (query i at position i + S - T, FlashAttention-2 / KV cache)"
            )
        return "top_left"
    return align


def _query_offset(xp, bottom_right: bool, q_lengths, kv_lengths, batch_shape, T: int, S: int) -> tuple[Any, tuple]:
    """Position of query 0 and its host-side (min, max): 0 unless
    bottom_right, then ``S - T``, or with lengths ``kv_len - q_len`` per batch
    element (int64, shape ``batch_shape``)."""
    if not bottom_right:
        return 0, (0, 0)
    if q_lengths is None and kv_lengths is None:
        return S - T, (S - T, S - T)
    kv_valid = kv_lengths if kv_lengths is not None else S
    q_valid = q_lengths if q_lengths is not None else T
    q_offset = kv_valid - q_valid  # int64, shape batch_shape
    if math.prod(batch_shape) == 0:
        return q_offset, (0, 0)
    return q_offset, (int(xp.min(q_offset)), int(xp.max(q_offset)))


def _check_scale(xp, scale, H: int, cdtype) -> float:
    """The score scale, ``1 / sqrt(H)`` when None; finite and representable in the compute dtype."""
    if scale is None:
        return 1.0 / math.sqrt(H) if H > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    if abs(float(scale)) > float(xp.finfo(cdtype).max):
        raise ValueError(f"scale={scale!r} overflows the compute dtype {cdtype} (it would become inf)")
    return float(scale)


def _check_dropout(dropout_p, seed) -> tuple[float, int | None]:
    """``(dropout_p, seed)``: p in [0, 1), and a seed in [0, 2**64) whenever p > 0."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must lie in [0, 1), got {dropout_p}")
    if p > 0 and seed is None:
        raise ValueError("seed is required when dropout_p > 0: the keep mask is a pure function of the seed")
    if seed is None:
        return p, None
    checked = check_int("seed", seed, minimum=0)
    if checked >= 2**64:
        raise ValueError(f"seed must be < 2**64 (the dropout hash reads 64 bits), got {checked}")
    return p, checked


def _check_softcap(xp, softcap, cdtype) -> float | None:
    """``softcap``: None, or a real number > 0 that stays finite and normal
    in the compute dtype (else ``s / cap`` would be inf or NaN there)."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a positive finite float or None, got {softcap!r}")
    cap = float(softcap)
    if not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"softcap must be a finite float > 0 (scores become cap * tanh(s / cap)), got {softcap!r}")
    info = xp.finfo(cdtype)
    if not float(info.smallest_normal) <= cap <= float(info.max):
        raise ValueError(
            f"softcap={softcap!r} is not a normal number of the compute dtype {cdtype} "
            f"(it must lie in [{float(info.smallest_normal):g}, {float(info.max):g}])"
        )
    return cap


def _check_per_head(xp, name: str, a, batch_shape: tuple[int, ...], N: int, trailing: int, cdtype):
    """A float per-head parameter (``alibi_slopes``, ``sinks``) of shape (N,)
    or broadcastable to (..., N), with values finite in the compute dtype
    ``cdtype`` (they are cast to it): ``(a viewed at rank
    len(batch_shape) + 1 + trailing as (..., N|1, 1...), its shape, its dtype)``."""
    if a is None:
        return None, None, None
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be a float array of shape (N,) = ({N},) or (..., N), got {type(a).__name__}")
    if not xp.isdtype(a.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {a.dtype}")
    shape = tuple(a.shape)
    target = batch_shape + (N,)
    if a.ndim == 0 or not _broadcasts_to(shape, target):
        raise ValueError(f"{name} must have shape (N,) = ({N},) or broadcast to (..., N) = {target}, got {shape}")
    if math.prod(shape) and not bool(xp.all(xp.isfinite(a))):
        raise ValueError(f"{name} must be finite, got NaN or inf entries")
    if math.prod(shape) and float(xp.max(xp.abs(a))) > float(xp.finfo(cdtype).max):
        raise ValueError(f"{name} overflows the compute dtype {cdtype}: entries beyond {float(xp.finfo(cdtype).max):g}")
    rank = len(batch_shape) + 1
    view = xp.reshape(a, (1,) * (rank - a.ndim) + shape + (1,) * trailing)
    return view, shape, a.dtype


def _check_segment_ids(xp, q_segment_ids, kv_segment_ids, batch_shape: tuple[int, ...], T: int, S: int):
    """Integer ``q_segment_ids (..., T)`` and ``kv_segment_ids (..., S)``,
    given together: ``(q ids, kv ids, host copies flattened to (B, T), (B, S))``
    as int64, or three Nones."""
    if q_segment_ids is None and kv_segment_ids is None:
        return None, None, None
    if q_segment_ids is None or kv_segment_ids is None:
        given, missing = ("q", "kv") if kv_segment_ids is None else ("kv", "q")
        raise ValueError(
            f"{given}_segment_ids was given without {missing}_segment_ids: pass both "
            "(key j is visible to query i only where their ids are equal)"
        )
    checked = []
    for name, ids, length in (("q_segment_ids", q_segment_ids, T), ("kv_segment_ids", kv_segment_ids, S)):
        expected = batch_shape + (length,)
        if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
            raise TypeError(f"{name} must be an integer array of shape {expected}, got {type(ids).__name__}")
        if not xp.isdtype(ids.dtype, "integral"):
            raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
        if tuple(ids.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (batch axes, then length), got {tuple(ids.shape)}")
        checked.append(xp.astype(ids, xp.int64))
    B = math.prod(batch_shape)
    host = SegmentHost(to_numpy(checked[0]).reshape(B, T), to_numpy(checked[1]).reshape(B, S), {})  # (B, T), (B, S)
    return checked[0], checked[1], host


def _check_variants(
    xp, batch_shape, sizes, cdtype, softcap, alibi_slopes, sinks, q_segment_ids, kv_segment_ids
) -> dict:
    """The score pipeline's options (softcap, ALiBi, sinks, segment ids) as
    :class:`AttentionSpec` fields; ``sizes`` is ``(N, T, S)``, ``cdtype`` the
    compute dtype."""
    N, T, S = sizes
    slopes, alibi_shape, alibi_dtype = _check_per_head(xp, "alibi_slopes", alibi_slopes, batch_shape, N, 2, cdtype)
    sinks, sinks_shape, sinks_dtype = _check_per_head(xp, "sinks", sinks, batch_shape, N, 1, cdtype)
    q_ids, kv_ids, host = _check_segment_ids(xp, q_segment_ids, kv_segment_ids, batch_shape, T, S)
    return {
        "softcap": _check_softcap(xp, softcap, cdtype),
        "alibi_slopes": slopes,
        "alibi_shape": alibi_shape,
        "alibi_dtype": alibi_dtype,
        "sinks": sinks,
        "sinks_shape": sinks_shape,
        "sinks_dtype": sinks_dtype,
        "q_segment_ids": q_ids,
        "kv_segment_ids": kv_ids,
        "segment_host": host,
    }


def _normalize_score_mods(score_mods) -> tuple[Any, ...]:
    """``score_mods`` as a tuple: None, one :class:`~npattn.scores.mods.ScoreMod`
    or a sequence of them (checked by their attributes: options imports no
    pipeline module)."""
    if score_mods is None:
        return ()
    mods = (score_mods,) if hasattr(score_mods, "forward") else score_mods
    if not isinstance(mods, (list, tuple)):
        raise TypeError(f"score_mods must be a ScoreMod or a list of them, got {type(score_mods).__name__}")
    seen: set[str] = set()
    for mod in mods:
        if not all(hasattr(mod, role) for role in ("forward", "backward", "params")):
            raise TypeError(f"score_mods must hold npattn.ScoreMod objects, got {type(mod).__name__}")
        for name in mod.params:
            if name in seen:
                raise ValueError(f"score_mods: two modifications declare the parameter {name!r}; rename one")
            seen.add(name)
    return tuple(mods)


def _check_mod_params(xp, mods: tuple[Any, ...], cdtype) -> dict[str, Any]:
    """The modifications' parameters by name, cast to the compute dtype."""
    cast = {}
    for mod in mods:
        for name, value in mod.params.items():
            if not xp.isdtype(value.dtype, "real floating"):
                raise TypeError(f"score_mods parameter {name!r} must be a real floating array, got dtype {value.dtype}")
            cast[name] = xp.astype(value, cdtype, copy=False)
    return cast


def _check_block_mask(block_mask, mask_mod, batch_shape, sizes, q_offset) -> Any:
    """The mask modification: ``block_mask``'s (checked against the call's
    sizes and query positions), else ``mask_mod`` (callable or None)."""
    N, T, S = sizes
    if block_mask is None:
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be a callable mask_mod(idx) -> bool array, got {type(mask_mod).__name__}")
        return mask_mod
    if not hasattr(block_mask, "kinds"):
        raise TypeError(f"block_mask must come from npattn.block_mask(...), got {type(block_mask).__name__}")
    if mask_mod is not None and mask_mod is not block_mask.mask_mod:
        raise ValueError("mask_mod and block_mask were both given with different functions: pass the block mask alone")
    built = (block_mask.q_len, block_mask.kv_len)
    if built != (T, S):
        raise ValueError(f"block_mask was built for (T, S) = {built}, but this call has (T, S) = {(T, S)}")
    if block_mask.num_heads not in (None, N):
        raise ValueError(f"block_mask was built for num_heads={block_mask.num_heads}, but this call has N={N}")
    if block_mask.batch_shape not in (None, batch_shape):
        raise ValueError(
            f"block_mask was built for batch_shape={block_mask.batch_shape}, but this call has {batch_shape}"
        )
    if not np.array_equal(
        np.asarray(block_mask.q_offset), to_numpy(q_offset) if hasattr(q_offset, "shape") else q_offset
    ):
        raise ValueError(
            "block_mask was built for other query positions than this call's (align, or q_lengths/kv_lengths "
            "with align='bottom_right'): build it with the call's align and lengths"
        )
    return block_mask.mask_mod


def _check_positions(xp, device, band, lengths, batch_shape, sizes, readers: list[str]) -> dict:
    """Causal/window, alignment, lengths and the query offset as
    :class:`AttentionSpec` fields; ``band`` is ``(causal, window, align)``,
    ``lengths`` ``(q_lengths, kv_lengths)``, ``sizes`` ``(T, S)``, ``readers``
    the other options that read positions (ALiBi, user modifications)."""
    causal, window, align = band
    T, S = sizes
    left, right = _check_window(causal, window)
    positional = left is not None or right is not None
    align = _check_align(align, positional, T, S)
    for reader in readers:
        align = _check_align(align, True, T, S, what=reader)
    q_lengths, q_len_bounds = check_lengths(xp, "q_lengths", lengths[0], batch_shape, T, device)
    kv_lengths, kv_len_bounds = check_lengths(xp, "kv_lengths", lengths[1], batch_shape, S, device)
    bottom_right = (positional or bool(readers)) and align == "bottom_right"
    q_offset, offset_bounds = _query_offset(xp, bottom_right, q_lengths, kv_lengths, batch_shape, T, S)
    return {
        "window_left": left,
        "window_right": right,
        "align": align,
        "q_lengths": q_lengths,
        "kv_lengths": kv_lengths,
        "q_offset": q_offset,
        "offset_bounds": offset_bounds,
        "q_len_bounds": q_len_bounds,
        "kv_len_bounds": kv_len_bounds,
    }


def _check_path(impl, block_q, block_k) -> tuple[str, int | None, int | None]:
    """``impl`` and the tile sizes."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return (
        impl,
        check_int("block_q", block_q, minimum=1, allow_none=True),
        check_int("block_k", block_k, minimum=1, allow_none=True),
    )


#: Per NumPy dtype, the spec of a call with every option at its default, on
#: inputs of one element: :func:`plain_spec` takes it with the call's sizes.
_PLAIN_SPECS: dict[Any, AttentionSpec] = {}


def plain_key(q: Any, k: Any, v: Any) -> tuple | None:
    """``(dtypes, shapes)`` of NumPy arrays ``q``, ``k``, ``v``, which alone
    decide :func:`plain_spec`; None for arrays of any other type (the key
    of :func:`npattn.attention.plain_call_spec`'s table)."""
    if not (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray):
        return None
    return (q.dtype, k.dtype, v.dtype, q.shape, k.shape, v.shape)


def plain_spec(q: Any, k: Any, v: Any) -> AttentionSpec | None:
    """:func:`make_spec` for a call whose every option is at its default, on
    NumPy float32 or float64 arrays of one dtype whose shapes fit: the same
    spec, from fewer checks (the per-call floor of a small call). None for
    any other inputs: the caller then runs :func:`make_spec`, whose checks
    and messages apply.

    >>> x = np.zeros((2, 3, 4), dtype=np.float32)
    >>> plain_spec(x, x, x).__dict__ == make_spec(x, x, x).__dict__
    True
    >>> plain_spec(x, x, x.astype(np.float64)) is None
    True
    """
    if plain_key(q, k, v) is None:
        return None
    dtype = q.dtype
    if not (dtype == k.dtype == v.dtype and dtype in (np.float32, np.float64) and q.ndim == k.ndim == v.ndim >= 3):
        return None
    *lead, N, T, H = q.shape
    K, S, Hk = k.shape[-3:]
    Kv, Sv, Hv = v.shape[-3:]
    batch_shape = tuple(lead)
    if not (
        k.shape[:-3] == batch_shape == v.shape[:-3]
        and Hk == H
        and (Kv, Sv) == (K, S)
        and S >= 1
        and K >= 1
        and N % K == 0
    ):
        return None
    template = _PLAIN_SPECS.get(dtype)
    if template is None:  # once per dtype: make_spec's own defaults, so the two cannot drift apart
        one = np.zeros((1, 1, 1), dtype=dtype)
        template = _PLAIN_SPECS[dtype] = make_spec(one, one, one)
    sizes = _size_fields(batch_shape, (N, T, H), (K, S, Hv))
    return template.replace(
        **sizes, scale=_check_scale(np, None, H, dtype), q_len_bounds=(T, T), kv_len_bounds=(S, S), mod_params={}
    )


def _size_fields(batch_shape: tuple[int, ...], q_sizes: tuple[int, int, int], kv_sizes: tuple[int, int, int]) -> dict:
    """The spec's size fields from ``(N, T, H)`` and ``(K, S, Hv)``."""
    (N, T, H), (K, S, Hv) = q_sizes, kv_sizes
    return dict(batch_shape=batch_shape, num_heads=N, num_kv_heads=K, q_len=T, kv_len=S, head_dim=H, value_dim=Hv)


def with_kv_len(
    spec: AttentionSpec, kv_len: int, causal: Any = False, window: Any = None, align: Any = None
) -> AttentionSpec:
    """:func:`make_spec`'s answer for the call that made ``spec`` with keys
    of length ``kv_len`` in place of ``spec.kv_len``, for a call whose
    options are all scalars, given its ``causal``, ``window`` and ``align``:
    only ``kv_len`` and the position fields change, checked by make_spec's
    own :func:`_check_positions` (a decode step whose cache grew by a
    token: 4.4 µs against make_spec's 17.4, 2-core EPYC). A spec with a
    mask, bias, lengths, ALiBi, sinks, segment ids or modifications, whose
    checks read ``S`` too, is a ``ValueError``.

    >>> import numpy as np
    >>> q, kv = np.zeros((1, 4, 1, 8)), np.zeros((1, 4, 100, 8))
    >>> spec = make_spec(q, kv, kv, causal=True, align="bottom_right")
    >>> with_kv_len(spec, 101, causal=True, align="bottom_right").q_offset
    100
    """
    arrays = (spec.mask, spec.bias, spec.q_lengths, spec.kv_lengths, spec.alibi_slopes, spec.sinks)
    others = (spec.q_segment_ids, spec.mask_mod, spec.block_mask)
    if spec.score_mods or any(x is not None for x in arrays + others):
        raise ValueError("with_kv_len takes the spec of a call whose options are all scalars; use make_spec")
    band, sizes = (causal, window, align), (spec.q_len, kv_len)
    positions = _check_positions(spec.xp, spec.device, band, (None, None), spec.batch_shape, sizes, [])
    return spec.replace(kv_len=kv_len, **positions)


def make_spec(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    causal=False,
    window=None,
    align=None,
    q_lengths=None,
    kv_lengths=None,
    scale=None,
    dropout_p=0.0,
    seed=None,
    impl="auto",
    block_q=None,
    block_k=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    score_mods=None,
    mask_mod=None,
    block_mask=None,
    xp=None,
) -> AttentionSpec:
    """Check every argument of :func:`npattn.attention_forward` and return the
    normalized :class:`AttentionSpec`. Raises ``TypeError``/``ValueError``
    naming the offending argument."""
    mods = _normalize_score_mods(score_mods)
    extra = {"alibi_slopes": alibi_slopes, "sinks": sinks, "q_segment_ids": q_segment_ids}
    extra.update(
        kv_segment_ids=kv_segment_ids, **{f"score_mods parameter {n!r}": p for m in mods for n, p in m.params.items()}
    )
    xp = _resolve_arrays(q, k, v, mask, bias, q_lengths, kv_lengths, xp, extra)
    batch_shape, (N, T, H), (K, S, Hv) = _check_shapes(q, k, v)
    _check_dtypes(xp, q, k, v)
    device = array_device(q)
    cdtype = compute_dtype(xp, q.dtype)
    full = batch_shape + (N, T, S)  # (..., N, T, S): what mask and bias broadcast to
    mask = _check_mask(xp, mask, full)
    bias, bias_shape, bias_dtype = _check_bias(xp, bias, full)
    variants = _check_variants(
        xp, batch_shape, (N, T, S), cdtype, softcap, alibi_slopes, sinks, q_segment_ids, kv_segment_ids
    )
    readers = ["alibi_slopes (ALiBi)"] * (alibi_slopes is not None)
    readers += ["score_mods/mask_mod/block_mask"] * bool(mods or mask_mod is not None or block_mask is not None)
    positions = _check_positions(
        xp, device, (causal, window, align), (q_lengths, kv_lengths), batch_shape, (T, S), readers
    )
    variants.update(score_mods=mods, mod_params=_check_mod_params(xp, mods, cdtype), block_mask=block_mask)
    variants["mask_mod"] = _check_block_mask(block_mask, mask_mod, batch_shape, (N, T, S), positions["q_offset"])
    scale = _check_scale(xp, scale, H, cdtype)
    dropout_p, seed = _check_dropout(dropout_p, seed)
    impl, block_q, block_k = _check_path(impl, block_q, block_k)

    return AttentionSpec(
        xp=xp,
        device=device,
        **_size_fields(batch_shape, (N, T, H), (K, S, Hv)),
        dtype=q.dtype,
        compute_dtype=cdtype,
        scale=scale,
        mask=mask,
        bias=bias,
        bias_shape=bias_shape,
        bias_dtype=bias_dtype,
        **positions,
        dropout_p=dropout_p,
        seed=seed,
        impl=impl,
        block_q=block_q,
        block_k=block_k,
        **variants,
    )
