r"""Step 4 of the score pipeline: user score modifications, and the user mask
modification of step 5 (FlexAttention's ``score_mod`` and ``mask_mod``,
framework-free, each with a hand-written derivative).

A score modification is a pair of elementwise functions on one tile of scores
``s`` (after softcap, bias and ALiBi) and its :class:`TileIndex`::

    forward(s, idx, **params)            -> s'                      same shape and dtype as s
    backward(s, idx, ds_out, **params)   -> ds_in                   without parameters
                                         -> (ds_in, {name: dparam})  with them

where ``ds_in = ds_out * ds'/ds`` elementwise and ``dparam`` is this tile's
share of the parameter's cotangent, ``sum_ij ds_out_ij * ds'_ij/dparam``, in
the parameter's shape. npattn sums the shares over tiles in a fixed order
and returns them from :func:`npattn.attention_backward` as ``grads.dmods``,
keyed by the parameter names. A mask modification is
``mask_mod(idx) -> bool`` (True = may attend), ANDed with the other rules.

Every tile is rank 4, ``(B', n, tq, tk)``: batch elements (the flattened
batch axes: all of them on the dense and generic chunked paths, one on the
NumPy fast path), query heads, query rows, keys. ``idx`` holds int64 arrays
that broadcast to it (:func:`tile_index`). Each path converts its own layout
to this one and back; the functions here see only rank-4 tiles.
"""

from __future__ import annotations

import dataclasses
import keyword
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import array_api_compat

from ..options import AttentionSpec
from .tiles import key_positions, query_positions

__all__ = ["ScoreMod", "TileIndex", "tile_index", "mods_forward", "mods_backward", "mods_jvp", "mask_mod_tile"]


class TileIndex(NamedTuple):
    """Indices of one tile ``(B', n, tq, tk)`` of the scores, as int64 arrays
    broadcastable to it.

    Attributes
    ----------
    batch : (B', 1, 1, 1)
        Flat index over the batch axes (C order), as dropout's.
    head : (1, n, 1, 1)
        Query head ``n``; its key/value head is ``head // G``.
    q : (B'|1, 1, tq, 1)
        Query positions under ``align``: row ``i`` sits at ``i`` (top_left)
        or ``i + S - T`` (bottom_right, per batch element with lengths), as
        causal, window and ALiBi use them. They may lie outside ``[0, S)``:
        below 0 under bottom_right with T > S, at or past S on the padded
        rows of bottom_right with lengths; a function that indexes a
        per-token array with them clips first (``xp.clip(idx.q, 0, S - 1)``;
        the padded rows' values are never used).
    k : (1, 1, 1, tk)
        Key positions ``j``.
    heads : (h0, h1)
        The tile's query heads as Python ints (``head`` is ``h0 .. h1 - 1``).
    num_heads : int
        N, every query head of the call.

    A tile may hold a subset of the heads (the NumPy fast path's tiles hold
    one key/value head's group), so a backward computes its parameter shares
    with these global indices: :meth:`per_head` for per-head parameters.
    """

    batch: Any
    head: Any
    q: Any
    k: Any
    heads: tuple[int, int]
    num_heads: int

    def per_head(self, values: Any) -> Any:
        """``values`` (broadcastable to the tile) summed over batch elements,
        queries and keys per head, as ``(num_heads,)`` with zeros for the heads
        outside the tile: the share of a per-head parameter."""
        xp = array_api_compat.array_namespace(values)
        h0, h1 = self.heads
        shape = (self.batch.shape[0], h1 - h0, self.q.shape[2], self.k.shape[3])
        sums = xp.sum(xp.broadcast_to(values, shape), axis=(0, 2, 3))  # (h1 - h0,)
        device = array_api_compat.device(values)
        before = xp.zeros((h0,), dtype=sums.dtype, device=device)
        after = xp.zeros((self.num_heads - h1,), dtype=sums.dtype, device=device)
        return xp.concat([before, sums, after])  # (num_heads,)


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreMod:
    r"""A user score modification: an elementwise map of the scores with its
    hand-written derivative (step 4 of the score pipeline).

    .. math::

        s' = f(s, \mathrm{idx}; \theta), \qquad
        ds_{in} = ds_{out} \, \partial f / \partial s, \qquad
        d\theta = \sum_{ij} ds_{out,ij} \, \partial f_{ij} / \partial \theta

    Parameters
    ----------
    forward : callable ``(s, idx, **params) -> s'``
        ``s`` a rank-4 tile ``(B', n, tq, tk)`` in the compute dtype, ``idx``
        its :class:`TileIndex`. Returns an array of the same shape and dtype.
        Must not modify ``s``.
    backward : callable ``(s, idx, ds_out, **params) -> ds_in`` or ``-> (ds_in, {name: dparam})``
        The chain rule: ``s`` is the forward's input, ``ds_out`` the
        cotangent of its output. With parameters it returns the tile's
        share of each parameter's cotangent, in the parameter's shape.
    params : mapping of str to array, optional
        Learnable arrays the functions receive as keyword arguments (cast to
        the compute dtype). Names must be identifiers, unique across the
        modifications of one call.
    name : str, optional
        For error messages; the forward's ``__name__`` by default.

    Examples
    --------
    A per-head temperature ``s' = s * t_n``, with ``dt_n = sum ds * s``:

    >>> import numpy as np, npattn
    >>> def forward(s, idx, t):
    ...     return s * t[idx.head]
    >>> def backward(s, idx, ds, t):
    ...     return ds * t[idx.head], {"t": idx.per_head(ds * s)}
    >>> temperature = npattn.ScoreMod(forward, backward, params={"t": np.ones(2)})
    >>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 4, 8))
    >>> out, res = npattn.attention_forward(q, k, v, score_mods=[temperature])
    >>> npattn.attention_backward(np.ones_like(out), res).dmods["t"].shape
    (2,)
    """

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    name: str = ""

    def __post_init__(self):
        for role in ("forward", "backward"):
            if not callable(getattr(self, role)):
                raise TypeError(f"ScoreMod {role} must be callable, got {getattr(self, role)!r}")
        if not isinstance(self.params, Mapping):
            raise TypeError(f"ScoreMod params must be a mapping of names to arrays, got {type(self.params).__name__}")
        for key, value in self.params.items():
            if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
                raise ValueError(f"ScoreMod params names must be Python identifiers, got {key!r}")
            if not hasattr(value, "shape") or not hasattr(value, "dtype"):
                raise TypeError(f"ScoreMod params[{key!r}] must be an array, got {type(value).__name__}")
        object.__setattr__(self, "params", dict(self.params))
        if not self.name:
            object.__setattr__(self, "name", getattr(self.forward, "__name__", type(self.forward).__name__))


def tile_index(
    spec: AttentionSpec,
    q0: int,
    q1: int,
    k0: int,
    k1: int,
    batch: int | None = None,
    heads: tuple[int, int] | None = None,
) -> TileIndex:
    """The :class:`TileIndex` of the tile ``[q0, q1) x [k0, k1)``: every batch
    element and head by default, or the flat batch element ``batch`` and the
    query heads ``[h0, h1)``."""
    xp, device = spec.xp, spec.device
    bf = spec.num_batch if batch is None else 1
    first = 0 if batch is None else batch
    h0, h1 = (0, spec.num_heads) if heads is None else heads
    batch_ids = xp.reshape(xp.arange(first, first + bf, dtype=xp.int64, device=device), (bf, 1, 1, 1))
    head_ids = xp.reshape(xp.arange(h0, h1, dtype=xp.int64, device=device), (1, h1 - h0, 1, 1))
    positions = query_positions(spec, q0, q1, batch)  # (tq, 1), or (..., 1, tq, 1) per batch element
    rows = 1 if positions.ndim == 2 else bf
    q_pos = xp.reshape(positions, (rows, 1, q1 - q0, 1))  # (B'|1, 1, tq, 1)
    k_pos = xp.reshape(key_positions(spec, k0, k1), (1, 1, 1, k1 - k0))  # (1, 1, 1, tk)
    return TileIndex(batch_ids, head_ids, q_pos, k_pos, (h0, h1), spec.num_heads)


def _params_of(spec: AttentionSpec, mod: ScoreMod) -> dict[str, Any]:
    """The modification's parameters in the compute dtype (the spec's copies)."""
    return {name: spec.mod_params[name] for name in mod.params}


def _check_tile(mod: ScoreMod, role: str, result: Any, like: Any) -> None:
    """A forward's or backward's tile must have ``like``'s shape and dtype."""
    shape = getattr(result, "shape", None)
    if shape is None or tuple(shape) != tuple(like.shape):
        raise ValueError(
            f"score modification {mod.name!r}: {role} returned shape {shape}, expected the tile's {tuple(like.shape)}"
        )
    if result.dtype != like.dtype:
        raise TypeError(
            f"score modification {mod.name!r}: {role} returned dtype {result.dtype}, expected the compute dtype "
            f"{like.dtype}"
        )


def mods_forward(spec: AttentionSpec, s: Any, idx: TileIndex) -> tuple[Any, list[Any]]:
    """Step 4 on a rank-4 tile: ``(s', inputs)``, where ``inputs[m]`` is what
    modification ``m`` received (kept for :func:`mods_backward`)."""
    if 0 in tuple(s.shape):  # an empty tile: nothing to modify
        return s, [s] * len(spec.score_mods)
    inputs = []
    for mod in spec.score_mods:
        inputs.append(s)
        s_next = mod.forward(s, idx, **_params_of(spec, mod))
        _check_tile(mod, "forward", s_next, s)
        s = s_next
    return s, inputs


def mods_backward(spec: AttentionSpec, ds: Any, inputs: list[Any], idx: TileIndex) -> tuple[Any, dict[str, Any]]:
    """Step 4's chain rule on a rank-4 tile, in reverse: ``(ds_in, shares)``
    with ``shares`` this tile's parameter cotangents by name."""
    shares: dict[str, Any] = {}
    if 0 in tuple(ds.shape):  # an empty tile: no cotangent to pass on
        return ds, shares
    for mod, s in zip(reversed(spec.score_mods), reversed(inputs)):
        result = mod.backward(s, idx, ds, **_params_of(spec, mod))
        ds_in, grads = result if isinstance(result, tuple) else (result, {})
        _check_tile(mod, "backward", ds_in, ds)
        for name, param in mod.params.items():
            if name not in grads:
                raise ValueError(
                    f"score modification {mod.name!r}: backward returned no cotangent for parameter {name!r} "
                    "(return (ds_in, {name: dparam, ...}))"
                )
            share = grads[name]
            if tuple(getattr(share, "shape", ())) != tuple(param.shape) or not hasattr(share, "shape"):
                raise ValueError(
                    f"score modification {mod.name!r}: backward's cotangent for {name!r} has shape "
                    f"{getattr(share, 'shape', None)}, expected the parameter's {tuple(param.shape)}"
                )
            shares[name] = spec.xp.astype(share, spec.compute_dtype, copy=False)
        ds = ds_in
    return ds, shares


def mods_jvp(spec: AttentionSpec, s_dot: Any, inputs: list[Any], idx: TileIndex) -> Any:
    """Step 4's tangent on a rank-4 tile, in order: each modification is
    elementwise, so its backward applied to a tangent, ``backward(s, idx,
    s_dot)``, is ``f'(s) * s_dot``, the forward-mode derivative (the
    parameters' shares it also returns are not used)."""
    if 0 in tuple(s_dot.shape):
        return s_dot
    for mod, s in zip(spec.score_mods, inputs):
        result = mod.backward(s, idx, s_dot, **_params_of(spec, mod))
        s_dot_next = result[0] if isinstance(result, tuple) else result
        _check_tile(mod, "backward", s_dot_next, s_dot)
        s_dot = s_dot_next
    return s_dot


def mask_mod_tile(spec: AttentionSpec, idx: TileIndex, tile_shape: tuple[int, ...]) -> Any:
    """The user's ``mask_mod(idx)`` on a tile of shape ``tile_shape``
    ``(B', n, tq, tk)``: a bool array broadcastable to it, checked."""
    visible = spec.mask_mod(idx)
    dtype = getattr(visible, "dtype", None)
    if dtype != spec.xp.bool:
        raise TypeError(f"mask_mod must return a bool array (True = may attend), got dtype {dtype}")
    shape = tuple(visible.shape)
    fits = len(shape) <= 4 and all(a in (1, b) for a, b in zip(shape[::-1], tile_shape[::-1]))
    if not fits:
        raise ValueError(f"mask_mod returned shape {shape}, which does not broadcast to the tile's {tile_shape}")
    return visible
