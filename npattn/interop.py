"""PyTorch interop by names and layout only (torch is not imported).

Weights: ``torch.nn.MultiheadAttention.state_dict()`` (tensors converted to
arrays, e.g. ``{k: t.numpy() for k, t in sd.items()}``) maps to npattn params
as::

    torch key                          npattn key                 shape
    in_proj_weight[0:E]                q_weight                   (E, E)
    in_proj_weight[E:2E]               k_weight                   (E, E)
    in_proj_weight[2E:3E]              v_weight                   (E, E)
      or q_proj_weight / k_proj_weight / v_proj_weight (when kdim or vdim != E)
                                       q_weight, k_weight, v_weight  (E, E), (E, kdim), (E, vdim)
    in_proj_bias[0:E], [E:2E], [2E:3E] q_bias, k_bias, v_bias     (E,) each
    out_proj.weight                    out_weight                 (E, E)
    out_proj.bias                      out_bias                   (E,)

Both use the ``(out_features, in_features)`` layout, so no transposes.
``bias_k``/``bias_v`` (``add_bias_kv=True``) have no npattn counterpart.

Attention sinks (``params["sinks"]``, :func:`npattn.mha_init` with
``sinks=True``) have no counterpart in ``nn.MultiheadAttention``: params read
from PyTorch have none, and writing params with sinks is a ``ValueError``
unless ``drop_sinks=True`` says to leave them out (the PyTorch layer then
computes attention without them, which is another function).

Masks: PyTorch's ``key_padding_mask`` (True = ignore this key) and boolean
``attn_mask`` (True = not allowed) have the *opposite* polarity of npattn's
``mask`` (True = may attend, as SDPA, JAX and FlexAttention);
:func:`mha_masks_from_torch` inverts and reshapes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .mha_params import layer_dims
from .namespace import resolve_namespace
from .options import check_int

__all__ = ["mha_params_from_torch", "mha_params_to_torch", "mha_masks_from_torch"]

_TORCH_KEYS = (
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "out_proj.weight",
    "out_proj.bias",
    "bias_k",
    "bias_v",
)


def _copy(xp: Any, a: Any) -> Any:
    return xp.asarray(a, copy=True)


def mha_params_from_torch(state_dict, num_heads):
    """npattn params from a ``torch.nn.MultiheadAttention`` state dict.

    ``in_proj_weight (3E, E)`` is split into ``q_weight``, ``k_weight``,
    ``v_weight`` in that order (rows ``[0:E]``, ``[E:2E]``, ``[2E:3E]``);
    ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` (PyTorch's layout
    when kdim or vdim != E) are taken as they are; ``in_proj_bias (3E,)`` is
    split the same way; ``out_proj.weight``/``out_proj.bias`` become
    ``out_weight``/``out_bias``. The arrays are copied.

    Parameters
    ----------
    state_dict : mapping of str to arrays
        Keyed like ``nn.MultiheadAttention.state_dict()``, values converted to
        arrays of one Array API library (NumPy, CuPy, ...).
    num_heads : int
        N, to check that it divides E.

    Returns
    -------
    params : dict of arrays
        As made by :func:`npattn.mha_init`; biases present iff PyTorch's
        were; no ``"sinks"`` (PyTorch's layer has none).

    Raises
    ------
    ValueError
        Missing, unknown, ambiguous or misshapen keys, ``bias_k``/``bias_v``
        (``add_bias_kv=True`` is not supported), E not divisible by N.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.interop import mha_params_from_torch, mha_params_to_torch
    >>> sd = {"in_proj_weight": np.ones((12, 4)), "in_proj_bias": np.zeros(12),
    ...       "out_proj.weight": np.eye(4), "out_proj.bias": np.zeros(4)}
    >>> params = mha_params_from_torch(sd, 2)
    >>> sorted((name, a.shape) for name, a in params.items())[:2]
    [('k_bias', (4,)), ('k_weight', (4, 4))]
    >>> sorted(mha_params_to_torch(params)) == sorted(sd)
    True
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to arrays, got {type(state_dict).__name__}")
    unknown = sorted(set(state_dict) - set(_TORCH_KEYS), key=str)
    if unknown:
        raise ValueError(f"state_dict has keys nn.MultiheadAttention does not: {unknown}")
    if "bias_k" in state_dict or "bias_v" in state_dict:
        raise ValueError("state_dict has bias_k/bias_v (add_bias_kv=True), which npattn does not support")
    xp = resolve_namespace({f"state_dict[{name!r}]": a for name, a in state_dict.items()})
    separate = [name for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight") if name in state_dict]
    if "in_proj_weight" in state_dict:
        if separate:
            raise ValueError(f"state_dict has both in_proj_weight and {separate}; PyTorch has one or the other")
        w = state_dict["in_proj_weight"]
        if w.ndim != 2 or w.shape[0] != 3 * w.shape[1]:
            raise ValueError(f"state_dict['in_proj_weight'] must have shape (3E, E), got {tuple(w.shape)}")
        E = w.shape[1]
        params = {
            "q_weight": _copy(xp, w[:E, :]),
            "k_weight": _copy(xp, w[E : 2 * E, :]),
            "v_weight": _copy(xp, w[2 * E :, :]),
        }
    else:
        if len(separate) != 3:
            raise ValueError(
                "state_dict must have in_proj_weight, or all of q_proj_weight, k_proj_weight, v_proj_weight; "
                f"got {sorted(state_dict)}"
            )
        params = {
            "q_weight": _copy(xp, state_dict["q_proj_weight"]),
            "k_weight": _copy(xp, state_dict["k_proj_weight"]),
            "v_weight": _copy(xp, state_dict["v_proj_weight"]),
        }
        if params["q_weight"].ndim != 2:
            got = tuple(params["q_weight"].shape)
            raise ValueError(f"state_dict['q_proj_weight'] must have shape (E, E), got {got}")
        E = params["q_weight"].shape[0]
    if "out_proj.weight" not in state_dict:
        raise ValueError("state_dict is missing 'out_proj.weight'")
    params["out_weight"] = _copy(xp, state_dict["out_proj.weight"])
    if "in_proj_bias" in state_dict:
        b = state_dict["in_proj_bias"]
        if tuple(b.shape) != (3 * E,):
            raise ValueError(f"state_dict['in_proj_bias'] must have shape (3E,) = ({3 * E},), got {tuple(b.shape)}")
        params.update(q_bias=_copy(xp, b[:E]), k_bias=_copy(xp, b[E : 2 * E]), v_bias=_copy(xp, b[2 * E :]))
    if "out_proj.bias" in state_dict:
        params["out_bias"] = _copy(xp, state_dict["out_proj.bias"])
    try:
        dims = layer_dims(params, num_heads=num_heads)
    except ValueError as err:
        raise ValueError(f"state_dict does not describe an nn.MultiheadAttention: {err}") from None
    if dims.num_kv_heads != dims.num_heads:  # k/v rows must be E in PyTorch
        rows = dims.num_kv_heads * dims.head_dim
        raise ValueError(f"state_dict's key/value projections must have E={E} rows, got {rows}")
    return params


def mha_params_to_torch(params, *, drop_sinks=False):
    """The inverse of :func:`mha_params_from_torch`: a dict keyed like
    ``nn.MultiheadAttention.state_dict()``.

    ``in_proj_weight`` (concatenated q, k, v) when ``kdim == vdim == E``, as
    PyTorch stores it then; otherwise ``q_proj_weight``, ``k_proj_weight``,
    ``v_proj_weight``. ``in_proj_bias`` is always the concatenation of the
    three in-projection biases (PyTorch keeps it packed either way). Load it
    with ``module.load_state_dict({k: torch.from_numpy(a) for k, a in d.items()})``
    into a module made with the same E, N, kdim, vdim and ``bias``.

    Parameters
    ----------
    params : dict of arrays
        As made by :func:`npattn.mha_init`, without GQA (PyTorch's layer
        has K = N) and with all four biases or none.
    drop_sinks : bool
        PyTorch's layer has no attention sinks: params with ``"sinks"`` are a
        ``ValueError`` unless this is True, which leaves them out (the
        PyTorch layer then computes attention without sinks).

    Returns
    -------
    dict of arrays (new arrays, not views of ``params``)

    Raises
    ------
    ValueError
        GQA params, some but not all biases, sinks without ``drop_sinks=True``,
        params that fail the layer's checks.

    Examples
    --------
    >>> from npattn import mha_init
    >>> from npattn.interop import mha_params_to_torch
    >>> mha_params_to_torch(mha_init(4, 2, sinks=True))
    Traceback (most recent call last):
    ...
    ValueError: params have 'sinks', but torch.nn.MultiheadAttention has no attention sinks: ...
    >>> sorted(mha_params_to_torch(mha_init(4, 2, sinks=True), drop_sinks=True))
    ['in_proj_bias', 'in_proj_weight', 'out_proj.bias', 'out_proj.weight']
    """
    if not isinstance(drop_sinks, bool):
        raise TypeError(f"drop_sinks must be a bool, got {drop_sinks!r}")
    if isinstance(params, Mapping) and "sinks" in params:
        if not drop_sinks:
            raise ValueError(
                "params have 'sinks', but torch.nn.MultiheadAttention has no attention sinks: the PyTorch layer "
                "would compute another function. Pass drop_sinks=True to write the other weights without them"
            )
        params = {name: a for name, a in params.items() if name != "sinks"}
    if isinstance(params, Mapping) and all(hasattr(params.get(n), "shape") for n in ("q_weight", "k_weight")):
        E, Kd = params["q_weight"].shape[0], params["k_weight"].shape[0]
        if Kd != E:
            raise ValueError(
                f"PyTorch's nn.MultiheadAttention has no GQA: params['k_weight'] must have E={E} rows, got {Kd}"
            )
    dims = layer_dims(params, num_heads=1)  # every other check; one head of E divides any E
    E = dims.embed_dim
    xp = resolve_namespace({f"params[{name!r}]": a for name, a in params.items()})
    biases = [name for name in ("q_bias", "k_bias", "v_bias", "out_bias") if name in params]
    if biases and len(biases) != 4:
        raise ValueError(f"PyTorch's layer has all four biases or none; params have only {biases}")
    out = {}
    if dims.kdim == E and dims.vdim == E:
        in_proj = (params["q_weight"], params["k_weight"], params["v_weight"])
        out["in_proj_weight"] = xp.concat(in_proj, axis=0)  # (3E, E)
    else:
        out["q_proj_weight"] = _copy(xp, params["q_weight"])  # (E, E)
        out["k_proj_weight"] = _copy(xp, params["k_weight"])  # (E, kdim)
        out["v_proj_weight"] = _copy(xp, params["v_weight"])  # (E, vdim)
    if biases:
        out["in_proj_bias"] = xp.concat((params["q_bias"], params["k_bias"], params["v_bias"]), axis=0)  # (3E,)
    out["out_proj.weight"] = _copy(xp, params["out_weight"])
    if biases:
        out["out_proj.bias"] = _copy(xp, params["out_bias"])
    return out


def _sort_torch_mask(xp: Any, name: str, m: Any, masks: list, biases: list) -> None:
    """File one PyTorch mask: a bool one (True = not allowed) is inverted into
    ``masks`` (True = may attend), a float one (additive) goes to ``biases``."""
    if m.dtype == xp.bool:
        masks.append(xp.logical_not(m))
    elif xp.isdtype(m.dtype, "real floating"):
        biases.append(m)
    else:
        raise TypeError(f"{name} must be bool or floating, got {m.dtype}")


def mha_masks_from_torch(*, key_padding_mask=None, attn_mask=None, num_heads=None, xp=None):
    r"""Convert ``nn.MultiheadAttention``'s masks to npattn's ``(mask, bias)``.

    .. math::

        \mathrm{mask} = \lnot\,\mathrm{key\_padding\_mask}[:, \mathrm{None}, \mathrm{None}, :]
        \ \wedge\ \lnot\,\mathrm{attn\_mask}, \qquad
        \mathrm{bias} = \text{the float masks, summed}

    PyTorch's boolean masks say True = *ignore* (``key_padding_mask``) and
    True = *not allowed* (``attn_mask``); npattn's ``mask`` says True = may
    attend, so boolean masks are inverted. Float masks are additive in both
    libraries and become ``bias``. Pass the results straight on:
    ``mha_forward(params, x, ..., mask=mask, bias=bias)``. One difference
    remains: a query row that sees no key is NaN in PyTorch and 0 in npattn.

    Keyword-only, unlike npattn's positional-only arrays, because either
    mask may come alone and the names are PyTorch's.

    Parameters
    ----------
    key_padding_mask : array, (B, S) or (S,), optional
        Bool (True = ignore that key) or float (added).
    attn_mask : array, (T, S) or (B*N, T, S), optional
        Bool (True = not allowed) or float (added). The 3-D form is indexed
        ``b * N + n`` as in PyTorch and needs ``num_heads``.
    num_heads : int, optional
        N, required for a 3-D ``attn_mask``.
    xp : namespace, optional
        Inferred from the masks by default.

    Returns
    -------
    mask : bool array broadcastable to (B, N, T, S), or None
        True = may attend.
    bias : float array broadcastable to (B, N, T, S), or None

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.interop import mha_masks_from_torch
    >>> key_padding_mask = np.array([[False, False, True]])  # B=1, S=3: ignore key 2
    >>> attn_mask = np.triu(np.ones((2, 3), dtype=bool), k=2)  # T=2: query 0 may not see key 2
    >>> mask, bias = mha_masks_from_torch(key_padding_mask=key_padding_mask, attn_mask=attn_mask)
    >>> mask.shape, bias
    ((1, 1, 2, 3), None)
    >>> mask[0, 0].tolist()
    [[True, True, False], [True, True, False]]
    """
    xp = (
        resolve_namespace({"key_padding_mask": key_padding_mask, "attn_mask": attn_mask}, xp)
        if (key_padding_mask is not None or attn_mask is not None)
        else xp
    )
    masks: list[Any] = []
    biases: list[Any] = []
    if key_padding_mask is not None:
        kpm = key_padding_mask
        if kpm.ndim not in (1, 2):
            raise ValueError(f"key_padding_mask must have shape (B, S) or (S,), got {tuple(kpm.shape)}")
        if kpm.ndim == 2:
            kpm = xp.reshape(kpm, (kpm.shape[0], 1, 1, kpm.shape[1]))  # (B, 1, 1, S)
        else:
            kpm = xp.reshape(kpm, (1, 1, kpm.shape[0]))  # (1, 1, S)
        _sort_torch_mask(xp, "key_padding_mask", kpm, masks, biases)
    if attn_mask is not None:
        am = attn_mask
        if am.ndim == 3:
            if num_heads is None:
                raise ValueError("a 3-D attn_mask (B*N, T, S) needs num_heads to split its first axis")
            num_heads = check_int("num_heads", num_heads, minimum=1)
            if am.shape[0] % num_heads:
                raise ValueError(
                    f"attn_mask's first axis ({am.shape[0]}) must be B * num_heads (num_heads={num_heads})"
                )
            am = xp.reshape(am, (am.shape[0] // num_heads, num_heads, am.shape[1], am.shape[2]))  # (B, N, T, S)
        elif am.ndim != 2:
            raise ValueError(f"attn_mask must have shape (T, S) or (B*N, T, S), got {tuple(am.shape)}")
        _sort_torch_mask(xp, "attn_mask", am, masks, biases)
    if key_padding_mask is not None and attn_mask is not None:
        S_kpm, S_am = key_padding_mask.shape[-1], attn_mask.shape[-1]
        if S_kpm != S_am:
            raise ValueError(f"key_padding_mask and attn_mask must agree on S (last axis), got {S_kpm} and {S_am}")
        if key_padding_mask.ndim == 2 and attn_mask.ndim == 3 and am.shape[0] != key_padding_mask.shape[0]:
            raise ValueError(
                f"attn_mask's first axis ({attn_mask.shape[0]}) must be B * num_heads with "
                f"B={key_padding_mask.shape[0]} from key_padding_mask and num_heads={num_heads}"
            )
    mask = bias = None
    for m in masks:
        mask = m if mask is None else xp.logical_and(mask, m)  # broadcast to (B|1, N|1, T|1, S)
    for b in biases:
        bias = b if bias is None else b + bias  # broadcast to (B|1, N|1, T|1, S)
    return mask, bias
