r"""What every rank of a ring agrees on, and how one (query shard, key shard)
pair becomes an :class:`~npattn.options.AttentionSpec` on global indices.

Rank ``r`` holds queries ``[q_start_r, q_start_r + T_r)`` and keys
``[kv_start_r, kv_start_r + S_r)`` of the full sequence (``T``, ``S`` the
totals). Ring step ``(r, s)`` attends rank ``r``'s queries to rank ``s``'s
keys with one ordinary spec whose index rules read global indices:

- positions (causal/window, ALiBi): local query ``i`` sits at
  ``i + d`` relative to local key 0, ``d = q_start_r + q_offset - kv_start_s``
  with ``q_offset`` the full sequence's (``S - T`` for bottom_right, or
  ``kv_len - q_len`` per batch element with lengths), set as the spec's
  ``q_offset``;
- lengths: the global ``q_lengths``/``kv_lengths`` minus the shard's start,
  clipped to ``[0, T_r]``/``[0, S_s]``;
- segment ids: rank ``r``'s query ids against rank ``s``'s key ids (every
  rank's key ids are gathered once, on the host);
- dropout: the spec's ``index_origin = (q_start_r, kv_start_s)``, so the
  keep mask hashes the full sequence's ``(b, n, i, j)``;
- bias: the pair's block of the bias (:meth:`RingPlan.pair_bias`);
- softcap and ALiBi slopes as given. Sinks enter once per row after the
  ring (:meth:`RingPlan.sinks_spec`), never per step.

A pair that :func:`~npattn.scores.visibility.classify_tile` finds hidden as a
whole (causal, segment ranges that cannot meet, a shard that is all
padding) is skipped. The bias has one of three layouts, chosen from its last
two axes ``(a, b)`` on every rank (first match in this order)::

    "keys"   (..., 1|T_r, 1)     this rank's rows, broadcast over every key      stays
    "rows"   (..., 1|T_r, S)     this rank's rows against all S keys, sliced     stays
    "shard"  (..., 1|T,   S_r)   every query against this rank's keys            travels with K/V

Dimension legend: B... batch axes, N query heads, K kv heads, T_r / S_r a
rank's query / key shard lengths, T / S their totals, H head dim, Hv value dim.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..namespace import array_device, dtype_name, resolve_namespace, to_numpy
from ..options import AttentionSpec, check_int, check_lengths, make_spec
from ..scores.visibility import NONE, classify_tile
from .transport import TRANSPORTS

__all__ = ["RingLayout", "RingPlan", "plan_ring", "raise_gathered", "local_error", "check_stats", "BIAS_LAYOUTS"]

BIAS_LAYOUTS = ("keys", "rows", "shard")

#: The per-pair options that ``make_spec`` checks on this rank's own shards.
_SPEC_OPTIONS = (
    *("causal", "window", "scale", "dropout_p", "seed", "softcap", "alibi_slopes", "sinks"),
    *("q_segment_ids", "kv_segment_ids", "impl", "block_q", "block_k"),
)


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True, eq=False)
class RingLayout:
    """Where every rank's shard sits in the full sequence (the same on all ranks).

    ``q_lengths[r]``/``kv_lengths[r]`` are rank ``r``'s ``T_r``/``S_r``;
    ``q_starts[r]``/``kv_starts[r]`` the global index of its first query/key.
    ``q_offset`` is the position of global query 0 for causal/window and
    ALiBi: 0 for top_left, ``S - T`` for bottom_right, or with lengths an
    int64 NumPy array of the batch shape, ``kv_len - q_len``.
    """

    rank: int
    size: int
    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    q_starts: tuple[int, ...]
    kv_starts: tuple[int, ...]
    q_offset: Any

    @property
    def q_len(self) -> int:
        return sum(self.q_lengths)

    @property
    def kv_len(self) -> int:
        return sum(self.kv_lengths)


def _starts(name: str, given: list, lengths: tuple[int, ...]) -> tuple[int, ...]:
    """Default (rank-order) or checked explicit shard starts."""
    if all(g is None for g in given):
        return tuple(sum(lengths[:r]) for r in range(len(lengths)))
    missing = [r for r, g in enumerate(given) if g is None]
    if missing:
        raise ValueError(
            f"{name} was given on some ranks but not on ranks {missing}; pass it on every rank "
            "(or on none, for shards in rank order)"
        )
    total = sum(lengths)
    expected = 0
    for r in sorted(range(len(given)), key=lambda r: (given[r], lengths[r])):
        if given[r] != expected:
            shards = ", ".join(f"rank {i}: [{given[i]}, {given[i] + lengths[i]})" for i in range(len(given)))
            raise ValueError(
                f"{name} does not tile the sequence [0, {total}) without gaps or overlaps: "
                f"expected a shard starting at {expected}, found rank {r} starting at {given[r]} ({shards}); "
                "global positions (and so causal/window masking) would be wrong"
            )
        expected += lengths[r]
    return tuple(given)


# --------------------------------------------------------------------------- collective checks


def raise_gathered(errors: list) -> None:
    """Raise on every rank if any rank reported ``(type name, message)``."""
    for r, err in enumerate(errors):
        if err is not None:
            kind, message = err
            cls = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, ValueError)
            raise cls(f"rank {r}: {message}")


def local_error(err: Exception) -> tuple[str, str]:
    return (type(err).__name__, str(err))


def check_stats(stats: Any) -> None:
    """TypeError unless ``stats`` is None or a dict to update (checked before any
    exchange, so that a bad one raises on every rank instead of on one)."""
    if stats is not None and not isinstance(stats, MutableMapping):
        raise TypeError(f"stats must be a dict (updated in place) or None, got {type(stats).__name__}")


def _agree(metas: list, key: str, what: str) -> None:
    """ValueError unless every rank reported the same ``metas[r][key]``."""
    values = [m[key] for m in metas]
    if any(v != values[0] for v in values):
        listing = ", ".join(f"rank {r} has {v}" for r, v in enumerate(values))
        raise ValueError(f"{what} differs across ranks: {listing}; every shard must agree")


def _given_everywhere_or_nowhere(metas: list, key: str, what: str) -> None:
    given = [m[key] is not None for m in metas]
    if any(given) and not all(given):
        missing = [r for r, g in enumerate(given) if not g]
        raise ValueError(f"{what} given on some ranks only (not on ranks {missing}); pass them on every rank or none")


def _host_list(x: Any) -> list | None:
    """A small array's values as nested Python lists (to compare across ranks)."""
    return None if x is None else np.asarray(to_numpy(x)).tolist()


def _bias_shape(xp: Any, bias: Any, batch_shape: tuple[int, ...], N: int) -> tuple[int, ...] | None:
    """The bias's shape at rank >= 2, after checking its type and leading axes."""
    if bias is None:
        return None
    if not hasattr(bias, "shape") or not hasattr(bias, "dtype") or not xp.isdtype(bias.dtype, "real floating"):
        raise TypeError(f"bias must be a real floating array, got {getattr(bias, 'dtype', type(bias).__name__)}")
    shape = (1,) * max(0, 2 - bias.ndim) + tuple(bias.shape)
    lead, target = shape[:-2], batch_shape + (N,)
    if len(lead) > len(target) or any(a not in (1, b) for a, b in zip(lead[::-1], target[::-1])):
        raise ValueError(
            f"bias of shape {tuple(bias.shape)}: its leading axes {lead} do not broadcast to (..., N) = {target}"
        )
    return shape


def _describe_shard(q: Any, k: Any, v: Any, bias: Any, options: dict) -> dict:
    """Check this rank's inputs; describe its shard and options for the others."""
    check_stats(options["stats"])
    named = {"q": q, "k": k, "v": v, "bias": bias}
    named.update({n: options[n] for n in ("q_lengths", "kv_lengths", "q_segment_ids", "kv_segment_ids")})
    xp = resolve_namespace(named | {n: options[n] for n in ("alibi_slopes", "sinks")}, options["xp"])
    q_start = check_int("q_start", options["q_start"], minimum=0, allow_none=True)
    kv_start = check_int("kv_start", options["kv_start"], minimum=0, allow_none=True)
    if options["transport"] not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {options['transport']!r}")
    if getattr(k, "ndim", 0) >= 3 and k.shape[-2] == 0:
        raise ValueError("this rank's k/v shard holds no key (S_r = 0); every shard needs at least one key")
    # The rank's own pair checks shapes, dtypes and options (align given: T_r != S_r is fine here).
    spec = make_spec(q, k, v, align=options["align"] or "top_left", xp=xp, **{n: options[n] for n in _SPEC_OPTIONS})
    lengths = {
        name: _host_list(check_lengths(xp, name, options[name], spec.batch_shape, None, array_device(q))[0])
        for name in ("q_lengths", "kv_lengths")
    }
    return {
        "batch_shape": spec.batch_shape,
        "num_heads": spec.num_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "value_dim": spec.value_dim,
        "dtype": dtype_name(spec.dtype),
        "T": spec.q_len,
        "S": spec.kv_len,
        "q_start": q_start,
        "kv_start": kv_start,
        "window": (spec.window_left, spec.window_right),
        "align": options["align"],
        "scale": None if options["scale"] is None else float(options["scale"]),
        **lengths,
        "segments": True if spec.segment_host is not None else None,
        "kv_segment_ids": None if spec.segment_host is None else spec.segment_host[1],  # (B, S_r)
        "dropout_p": spec.dropout_p,
        "seed": spec.seed if spec.dropout_p > 0 else None,  # unread without dropout
        "softcap": spec.softcap,
        "alibi_slopes": _host_list(options["alibi_slopes"]),
        "sinks": _host_list(options["sinks"]),
        "bias": _bias_shape(xp, bias, spec.batch_shape, spec.num_heads),
        "error": None,
    }


def _check_gathered(metas: list) -> None:
    """ValueError unless the ranks' shards and options fit together."""
    _agree(metas, "head_dim", "q/k head dim H (axis -1)")
    _agree(metas, "value_dim", "v head dim Hv (axis -1)")
    _agree(metas, "num_heads", "the number of query heads N (axis -3 of q)")
    _agree(metas, "num_kv_heads", "the number of key/value heads K (axis -3 of k and v)")
    _agree(metas, "batch_shape", "the batch axes (q.shape[:-3])")
    _agree(metas, "dtype", "the dtype of q, k and v")
    _agree(metas, "window", "causal/window")
    _agree(metas, "align", "align")
    _agree(metas, "scale", "scale")
    _agree(metas, "q_lengths", "q_lengths (the full sequence's lengths, the same array on every rank)")
    _agree(metas, "kv_lengths", "kv_lengths (the full sequence's lengths, the same array on every rank)")
    _given_everywhere_or_nowhere(metas, "segments", "segment ids (q_segment_ids and kv_segment_ids) are")
    _agree(metas, "dropout_p", "dropout_p")
    _agree(metas, "seed", "the dropout seed")
    _agree(metas, "softcap", "softcap")
    _agree(metas, "alibi_slopes", "alibi_slopes")
    _agree(metas, "sinks", "sinks")
    _given_everywhere_or_nowhere(metas, "bias", "a bias is")


def _check_total_lengths(metas: list, T: int, S: int) -> None:
    for name, total in (("q_lengths", T), ("kv_lengths", S)):
        values = np.asarray(metas[0][name] if metas[0][name] is not None else [], dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() > total):
            raise ValueError(
                f"{name} must lie in [0, {total}] (the full sequence's length over all ranks), "
                f"got values in [{values.min()}, {values.max()}]"
            )


def _query_offset(metas: list, positional: bool, T: int, S: int) -> Any:
    """Position of global query 0 (CONVENTIONS: align and lengths)."""
    align = metas[0]["align"]
    if positional and align is None and T != S:
        raise ValueError(
            f"causal/window or ALiBi with T={T} queries != S={S} keys over all ranks needs an explicit alignment "
            "to know the queries' global positions: align='top_left' (query i at position i) or "
            "align='bottom_right' (query i at position i + S - T)"
        )
    if not positional or align != "bottom_right":
        return 0
    q_lengths, kv_lengths = metas[0]["q_lengths"], metas[0]["kv_lengths"]
    if q_lengths is None and kv_lengths is None:
        return S - T
    kv_valid = np.asarray(kv_lengths if kv_lengths is not None else S, dtype=np.int64)
    q_valid = np.asarray(q_lengths if q_lengths is not None else T, dtype=np.int64)
    return np.broadcast_to(kv_valid - q_valid, np.broadcast_shapes(kv_valid.shape, q_valid.shape))


def _bias_layout(metas: list, layout: RingLayout) -> str | None:
    """The one bias layout (:data:`BIAS_LAYOUTS`) every rank's bias fits."""
    shapes = [m["bias"] for m in metas]
    if shapes[0] is None:
        return None
    T, S = layout.q_len, layout.kv_len
    fits = {
        "keys": lambda r, a, b: b == 1 and a in (1, layout.q_lengths[r]),
        "rows": lambda r, a, b: b == S and a in (1, layout.q_lengths[r]),
        "shard": lambda r, a, b: b == layout.kv_lengths[r] and a in (1, T),
    }
    for name in BIAS_LAYOUTS:
        if all(fits[name](r, *shape[-2:]) for r, shape in enumerate(shapes)):
            if name == "shard" and any(shape[:-1] != shapes[0][:-1] for shape in shapes):
                listing = ", ".join(f"rank {r} has {shape}" for r, shape in enumerate(shapes))
                raise ValueError(
                    f"bias travels with the key shards, so every rank's needs the same axes but the last ({listing})"
                )
            return name
    listing = ", ".join(
        f"rank {r}: {shape} (T_r={layout.q_lengths[r]}, S_r={layout.kv_lengths[r]})" for r, shape in enumerate(shapes)
    )
    raise ValueError(
        "bias must have one layout on every rank: (..., 1 or T_r, 1) this rank's rows over every key, "
        f"(..., 1 or T_r, S={S}) this rank's rows against all keys, or (..., 1 or T={T}, S_r) every query "
        f"against this rank's keys (it travels with them); got {listing}"
    )


def _layout(ring: Any, metas: list) -> RingLayout:
    q_lengths = tuple(m["T"] for m in metas)
    kv_lengths = tuple(m["S"] for m in metas)
    q_starts = _starts("q_start", [m["q_start"] for m in metas], q_lengths)
    kv_starts = _starts("kv_start", [m["kv_start"] for m in metas], kv_lengths)
    T, S = sum(q_lengths), sum(kv_lengths)
    _check_total_lengths(metas, T, S)
    positional = metas[0]["window"] != (None, None) or metas[0]["alibi_slopes"] is not None
    q_offset = _query_offset(metas, positional, T, S)
    return RingLayout(ring.Get_rank(), ring.Get_size(), q_lengths, kv_lengths, q_starts, kv_starts, q_offset)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, eq=False)
class RingPlan:
    """The ring's options, agreed by every rank, with this rank's own arrays:
    everything needed to turn any step ``(r, s)`` into an AttentionSpec.

    ``q_lengths``/``kv_lengths`` are the global lengths on the host (int64,
    batch shape); ``kv_segment_ids`` every rank's key ids on the host
    (``(B, S_s)`` each) and ``q_segment_ids`` this rank's query ids as given;
    ``bias_layout`` one of :data:`BIAS_LAYOUTS` or None, and
    ``bias_shape`` this rank's bias shape at rank >= 2.
    """

    layout: RingLayout
    xp: Any
    device: Any
    batch_shape: tuple[int, ...]
    window: tuple[int | None, int | None]
    scale: float | None
    impl: str
    block_q: int | None
    block_k: int | None
    dropout_p: float
    seed: int | None
    softcap: float | None
    alibi_slopes: Any
    sinks: Any
    q_lengths: np.ndarray | None
    kv_lengths: np.ndarray | None
    q_segment_ids: Any
    kv_segment_ids: tuple[np.ndarray, ...] | None
    bias_layout: str | None
    bias_shape: tuple[int, ...] | None

    @property
    def positional(self) -> bool:
        """Whether positions matter (causal/window or ALiBi)."""
        return self.window != (None, None) or self.alibi_slopes is not None

    def _local_lengths(self, lengths: np.ndarray | None, start: int, n: int) -> Any:
        """A shard's lengths, from the full sequence's: ``clip(len - start, 0, n)``."""
        if lengths is None:
            return None
        return self.xp.asarray(np.clip(lengths - start, 0, n), dtype=self.xp.int64, device=self.device)

    def _positions(self, q_start: int, kv_start: int) -> dict:
        """The pair's ``q_offset`` and bounds: local query ``i`` at ``i + d``."""
        if not self.positional:
            return {}
        d = q_start + self.layout.q_offset - kv_start  # int, or int64 (batch shape)
        if isinstance(d, np.ndarray):
            bounds = (int(d.min()), int(d.max())) if d.size else (0, 0)
            return {"q_offset": self.xp.asarray(d, device=self.device), "offset_bounds": bounds}
        return {"q_offset": int(d), "offset_bounds": (int(d), int(d))}

    def pair_spec(self, q: Any, k: Any, v: Any, s: int, bias: Any) -> AttentionSpec | None:
        """The spec of this rank's queries against rank ``s``'s keys ``k``,
        ``v`` and the pair's ``bias`` block, on global indices; None when the
        index rules hide the whole pair."""
        layout, xp = self.layout, self.xp
        r = layout.rank
        T_r, S_s = layout.q_lengths[r], layout.kv_lengths[s]
        q_start, kv_start = layout.q_starts[r], layout.kv_starts[s]
        kv_ids = None
        if self.kv_segment_ids is not None:  # (B, S_s) on the host -> (..., S_s)
            kv_ids = xp.asarray(np.reshape(self.kv_segment_ids[s], self.batch_shape + (S_s,)), device=self.device)
        spec = make_spec(
            q,
            k,
            v,
            bias=bias,
            window=None if self.window == (None, None) else self.window,
            align="top_left",  # a placeholder: the global positions replace it below
            q_lengths=self._local_lengths(self.q_lengths, q_start, T_r),
            kv_lengths=self._local_lengths(self.kv_lengths, kv_start, S_s),
            q_segment_ids=self.q_segment_ids,
            kv_segment_ids=kv_ids,
            scale=self.scale,
            dropout_p=self.dropout_p,
            seed=self.seed,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            impl=self.impl,
            block_q=self.block_q,
            block_k=self.block_k,
            xp=xp,
        )
        spec = spec.replace(index_origin=(q_start, kv_start), **self._positions(q_start, kv_start))
        return None if classify_tile(spec, 0, T_r, 0, S_s) == NONE else spec

    def sinks_spec(self, q: Any, k: Any, v: Any) -> AttentionSpec | None:
        """The spec that merges the sinks into this rank's rows (its query
        lengths, from the global ones); None without sinks."""
        if self.sinks is None:
            return None
        layout = self.layout
        r = layout.rank
        q_lengths = self._local_lengths(self.q_lengths, layout.q_starts[r], layout.q_lengths[r])
        return make_spec(q, k, v, sinks=self.sinks, q_lengths=q_lengths, xp=self.xp)

    # ------------------------------------------------------------------ the bias

    def travelling(self, k: Any, v: Any, bias: Any) -> list:
        """What travels around the ring with a key shard: ``[K, V]``, and the
        bias in the ``"shard"`` layout. Their gradients travel the same way."""
        return [k, v, bias] if self.bias_layout == "shard" else [k, v]

    def travelling_shapes(self, s: int, arrays: list) -> list[tuple[int, ...]]:
        """Shapes of rank ``s``'s travelling arrays (the key axis is ``S_s``),
        from this rank's ``arrays``."""
        S_s = self.layout.kv_lengths[s]
        return [tuple(a.shape[:-2]) + (S_s, a.shape[-1]) for a in arrays[:2]] + [
            tuple(a.shape[:-1]) + (S_s,) for a in arrays[2:]
        ]

    def pair_bias(self, bias: Any, travelling: list, s: int) -> Any:
        """The bias block of this rank's queries against rank ``s``'s keys:
        ``(..., 1|T_r, 1|S_s)``; None without a bias."""
        layout = self.layout
        if self.bias_layout == "keys":
            return bias
        if self.bias_layout == "rows":
            kv_start = layout.kv_starts[s]
            return bias[..., kv_start : kv_start + layout.kv_lengths[s]]  # (..., 1|T_r, S_s)
        if self.bias_layout == "shard":
            shard_bias = travelling[2]  # (..., 1|T, S_s)
            if shard_bias.shape[-2] == 1:
                return shard_bias
            q_start = layout.q_starts[layout.rank]
            return shard_bias[..., q_start : q_start + layout.q_lengths[layout.rank], :]  # (..., T_r, S_s)
        return None

    def add_pair_dbias(self, dbias: Any, pair_dbias: Any, s: int) -> Any:
        """Add a pair's ``dbias`` (the shape of :meth:`pair_bias`) into the
        gradient of the array it came from: this rank's bias (``"keys"``,
        ``"rows"``) or rank ``s``'s travelling one (``"shard"``)."""
        layout = self.layout
        if self.bias_layout == "keys" or (self.bias_layout == "shard" and dbias.shape[-2] == 1):
            return dbias + pair_dbias
        if self.bias_layout == "rows":
            cols = slice(layout.kv_starts[s], layout.kv_starts[s] + layout.kv_lengths[s])
            dbias[..., cols] = pair_dbias  # each key shard once: its columns are this pair's alone
            return dbias
        rows = slice(layout.q_starts[layout.rank], layout.q_starts[layout.rank] + layout.q_lengths[layout.rank])
        dbias[..., rows, :] = dbias[..., rows, :] + pair_dbias  # (..., T_r, S_s) into (..., T, S_s)
        return dbias


def plan_ring(ring: Any, q: Any, k: Any, v: Any, bias: Any, options: dict) -> RingPlan:
    """Check every rank's inputs, gather them once and agree on the plan.
    Collective: on a bad input anywhere, every rank raises the same error."""
    try:
        meta = _describe_shard(q, k, v, bias, options)
    except (TypeError, ValueError) as err:
        meta = {"error": local_error(err)}
    metas = ring.allgather(meta)
    raise_gathered([m["error"] for m in metas])
    _check_gathered(metas)
    layout = _layout(ring, metas)
    xp = resolve_namespace({"q": q}, options["xp"])
    first = metas[0]
    return RingPlan(
        layout=layout,
        xp=xp,
        device=array_device(q),
        batch_shape=first["batch_shape"],
        window=first["window"],
        scale=options["scale"],
        impl=options["impl"],
        block_q=options["block_q"],
        block_k=options["block_k"],
        dropout_p=first["dropout_p"],
        seed=first["seed"],
        softcap=first["softcap"],
        alibi_slopes=options["alibi_slopes"],
        sinks=options["sinks"],
        q_lengths=None if first["q_lengths"] is None else np.asarray(first["q_lengths"], dtype=np.int64),
        kv_lengths=None if first["kv_lengths"] is None else np.asarray(first["kv_lengths"], dtype=np.int64),
        q_segment_ids=options["q_segment_ids"],
        kv_segment_ids=None if first["segments"] is None else tuple(m["kv_segment_ids"] for m in metas),
        bias_layout=_bias_layout(metas, layout),
        bias_shape=metas[layout.rank]["bias"],
    )
