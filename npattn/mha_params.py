"""The multi-head layer's parameters: the keys of a params dict and the
layer sizes they imply.

Both the layer (:mod:`npattn.mha`) and its key/value cache
(:mod:`npattn.kv_cache`) read a params dict through :func:`layer_dims`; it
lives here so that each of them imports it, and neither imports the other's
way back (``mha -> kv_cache -> mha_params``).

Dimension legend: E embed_dim, N num_heads, K num_kv_heads (N % K == 0),
H = E // N head dim, kdim/vdim the widths of the key/value sources.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from .options import check_int

__all__ = ["PARAM_KEYS", "WEIGHT_KEYS", "LayerDims", "layer_dims"]

#: Every key a params dict may hold; the ``*_weight`` keys are required, a
#: missing ``*_bias`` key means that projection has no bias, and a missing
#: ``"sinks"`` key (shape (N,), :func:`npattn.mha_init` with ``sinks=True``)
#: means the layer has no attention sinks.
PARAM_KEYS = ("q_weight", "q_bias", "k_weight", "k_bias", "v_weight", "v_bias", "out_weight", "out_bias", "sinks")
WEIGHT_KEYS = ("q_weight", "k_weight", "v_weight", "out_weight")


class LayerDims(NamedTuple):
    """Sizes of a layer, read from its params and head counts."""

    embed_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kdim: int
    vdim: int


def layer_dims(params, /, *, num_heads, num_kv_heads=None) -> LayerDims:
    """Check a params dict and return its :class:`LayerDims`.

    ``num_kv_heads=None`` reads K from ``params["k_weight"]`` (``K*H`` rows);
    given, it must agree. Every error names the key and the expected shape.

    >>> from npattn.mha import layer_dims, mha_init
    >>> layer_dims(mha_init(8, 4, num_kv_heads=1, vdim=3), num_heads=4)
    LayerDims(embed_dim=8, num_heads=4, num_kv_heads=1, head_dim=2, kdim=8, vdim=3)
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict of arrays as made by npattn.mha_init, got {type(params).__name__}")
    unknown = sorted(set(params) - set(PARAM_KEYS), key=str)
    if unknown:
        raise ValueError(f"params has unknown keys {unknown}; the keys are {PARAM_KEYS}")
    missing = [name for name in WEIGHT_KEYS if name not in params]
    if missing:
        raise ValueError(f"params is missing {missing} (required: {WEIGHT_KEYS}; biases are optional)")
    for name in params:
        if not hasattr(params[name], "shape") or not hasattr(params[name], "dtype"):
            raise TypeError(f"params[{name!r}] must be an array, got {type(params[name]).__name__}")

    def shape(name):
        return tuple(params[name].shape)

    if len(shape("q_weight")) != 2 or shape("q_weight")[0] != shape("q_weight")[1] or shape("q_weight")[0] == 0:
        raise ValueError(
            f"params['q_weight'] must have shape (embed_dim, embed_dim) with embed_dim >= 1, got {shape('q_weight')}"
        )
    E = shape("q_weight")[0]
    N = check_int("num_heads", num_heads, minimum=1)
    if E % N:
        raise ValueError(f"embed_dim={E} (params['q_weight'].shape) must be divisible by num_heads={N}")
    H = E // N
    if len(shape("k_weight")) != 2 or shape("k_weight")[0] == 0 or shape("k_weight")[0] % H:
        raise ValueError(
            f"params['k_weight'] must have shape (num_kv_heads * head_dim, kdim) with head_dim={H} "
            f"(embed_dim {E} / num_heads {N}), got {shape('k_weight')}"
        )
    Kd, kdim = shape("k_weight")
    K = Kd // H
    if num_kv_heads is not None and check_int("num_kv_heads", num_kv_heads, minimum=1) != K:
        raise ValueError(
            f"num_kv_heads={num_kv_heads}, but params['k_weight'] has {Kd} rows = {K} heads of head_dim {H}"
        )
    if N % K:
        raise ValueError(f"num_heads={N} must be divisible by num_kv_heads={K} (params['k_weight'] rows / head_dim)")
    if len(shape("v_weight")) != 2 or shape("v_weight")[0] != Kd:
        raise ValueError(
            f"params['v_weight'] must have shape ({Kd}, vdim) like params['k_weight'], got {shape('v_weight')}"
        )
    vdim = shape("v_weight")[1]
    expected = {"out_weight": (E, E), "q_bias": (E,), "k_bias": (Kd,), "v_bias": (Kd,), "out_bias": (E,)}
    for name, want in expected.items():
        if name in params and shape(name) != want:
            raise ValueError(f"params[{name!r}] must have shape {want}, got {shape(name)}")
    if "sinks" in params and shape("sinks") != (N,):
        raise ValueError(
            f"params['sinks'] must have shape (num_heads,) = ({N},), one sink per query head, got {shape('sinks')}"
        )
    return LayerDims(E, N, K, H, kdim, vdim)
