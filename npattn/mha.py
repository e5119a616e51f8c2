r"""The multi-head attention layer: projections around the attention core,
as a JAX ``custom_vjp``-style pair with a hand-derived backward.

Forward (``W`` in PyTorch's ``(out_features, in_features)`` layout)::

    Q = x  Wq^T + bq          (B, T, E)     -> split heads (B, N, T, H)
    K = xk Wk^T + bk          (B, S, K*H)   -> split heads (B, K, S, H)
    V = xv Wv^T + bv          (B, S, K*H)   -> split heads (B, K, S, H)
    O = attention(Q, K, V)    (B, N, T, H)  -> merge heads (B, T, E)
    y = O  Wo^T + bo          (B, T, E)

``xk = xv = x`` for self-attention, ``xk = xv = context`` for cross-attention
with one context, ``(xk, xv) = context`` for a pair.

Backward, each linear ``Y = A W^T + b`` giving ``dA = dY W``,
``dW = dY^T A`` (summed over batch and positions) and ``db = sum(dY)``::

    dO  = dy Wo               dWo = dy^T O          dbo = sum(dy)
    dQ, dK, dV, dbias, dsinks, dslopes = attention_backward(dO)   (heads split / merged)
    dx  = dQ Wq  [+ dK Wk + dV Wv for self-attention]
    dWq = dQ^T x    dWk = dK^T xk    dWv = dV^T xv  dbq, dbk, dbv = sums
    dcontext = dK Wk + dV Wv   (one context)   or   (dK Wk, dV Wv)   (a pair)

Dimension legend: B batch, T query length, S key length, E embed_dim,
N num_heads, K num_kv_heads (N % K == 0; K < N is GQA/MQA), H = E // N head
dim, kdim/vdim the widths of the key/value sources.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import linear_numpy
from .attention import (
    AttentionResiduals,
    DenseResiduals,
    attention_backward,
    attention_forward,
    inputs_in_compute_dtype,
)
from .dense import dense_scores
from .kv_cache import KVCache, default_float_dtype
from .mha_params import PARAM_KEYS, WEIGHT_KEYS, LayerDims, layer_dims
from .namespace import (
    check_float_dtype,
    check_floating,
    check_namespace,
    compute_dtype,
    dtype_name,
    resolve_namespace,
)
from .options import check_int
from .scores.visibility import visible_tile

__all__ = [
    "mha_init",
    "mha_forward",
    "mha_backward",
    "MHAGrads",
    "MHAResiduals",
    "MultiheadAttention",
    "LayerDims",
    "layer_dims",
    "PARAM_KEYS",
]


def _check_heads(embed_dim: int, num_heads: Any, num_kv_heads: Any) -> tuple[int, int]:
    """Validate the head counts; returns ``(N, K)`` with ``K`` defaulting to ``N``."""
    N = check_int("num_heads", num_heads, minimum=1)
    K = N if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, minimum=1)
    if embed_dim % N:
        raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={N}")
    if N % K:
        raise ValueError(f"num_heads={N} must be divisible by num_kv_heads={K}")
    return N, K


# --- parameters -------------------------------------------------------------


def mha_init(
    embed_dim,
    num_heads,
    *,
    num_kv_heads=None,
    kdim=None,
    vdim=None,
    bias=True,
    dtype=None,
    device=None,
    xp=None,
    seed=0,
    sinks=False,
):
    r"""Parameters of a multi-head attention layer, initialized as PyTorch's
    ``nn.MultiheadAttention``.

    .. math::

        W_{q,k,v} \sim \mathcal U(-a, a),\ a = \sqrt{6 / (\mathrm{fan\_in} + \mathrm{fan\_out})}
        \qquad W_o \sim \mathcal U(-1/\sqrt E, 1/\sqrt E) \qquad b = 0

    Xavier-uniform in-projections: when ``kdim == vdim == E`` PyTorch packs
    them into one ``(E + 2 K H, E)`` matrix (``in_proj_weight``) and so does
    the bound here, ``a = sqrt(6 / (2 E + 2 K H))`` (``sqrt(6 / 4E)`` without
    GQA); otherwise each gets its own bound (``q_proj_weight`` etc.). The out
    projection keeps ``nn.Linear``'s default (Kaiming-uniform with
    ``a = sqrt(5)``, i.e. the bound ``1/sqrt(E)``); every bias is zero.
    Values are drawn on the host with ``numpy.random.default_rng(seed)`` in
    the order q, k, v, out, so a seed gives the same weights on every backend.

    ``sinks=True`` adds learnable attention sinks (gpt-oss): ``"sinks"`` of
    shape (N,), one logit per query head, initialized to zeros. A zero sink
    adds ``exp(0) = 1`` to every softmax denominator (the "softmax + 1" of
    "Attention is off by one"), draws nothing from the generator (a seed
    gives the same weights with or without sinks) and is within noise of the
    ``N(0, 0.02)`` that Hugging Face's gpt-oss draws (``initializer_range``).

    Dimension legend: E embed_dim, N num_heads, K num_kv_heads, H = E // N.

    Parameters
    ----------
    embed_dim : int
        E, width of the queries and of the output.
    num_heads : int
        N, query heads; must divide E.
    num_kv_heads : int, optional
        K, key/value heads (GQA; 1 is MQA); must divide N. Defaults to N.
    kdim, vdim : int, optional
        Widths of the key and value sources of cross-attention (default E).
    bias : bool
        Whether the four projections have biases.
    dtype : dtype, optional
        Defaults to the namespace's default float dtype.
    device : device, optional
        Defaults to the namespace's default device.
    xp : namespace, optional
        Array API namespace; NumPy (through ``array_api_compat``) by default.
    seed : int
        Seeds the host random generator.
    sinks : bool
        Whether the layer has learnable attention sinks, ``params["sinks"]``
        (N,), zeros (see above); :func:`mha_forward` passes them to the core
        and :func:`mha_backward` returns their gradient in
        ``dparams["sinks"]``.

    Returns
    -------
    params : dict of arrays
        ``"q_weight"`` (E, E), ``"k_weight"`` (K*H, kdim), ``"v_weight"``
        (K*H, vdim), ``"out_weight"`` (E, E), each ``(out, in)`` so that a
        projection is ``x @ W^T + b``; with ``bias=True`` also ``"q_bias"``
        (E,), ``"k_bias"`` (K*H,), ``"v_bias"`` (K*H,), ``"out_bias"`` (E,);
        with ``sinks=True`` also ``"sinks"`` (N,).

    Raises
    ------
    ValueError
        E not divisible by N, N not divisible by K, sizes < 1.

    Examples
    --------
    >>> from npattn.mha import mha_init
    >>> params = mha_init(8, 4, num_kv_heads=2, kdim=5)
    >>> {name: a.shape for name, a in params.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'q_weight': (8, 8), 'k_weight': (4, 5), 'v_weight': (4, 8), 'out_weight': (8, 8),
     'q_bias': (8,), 'k_bias': (4,), 'v_bias': (4,), 'out_bias': (8,)}
    """
    E = check_int("embed_dim", embed_dim, minimum=1)
    N, K = _check_heads(E, num_heads, num_kv_heads)
    kdim = E if kdim is None else check_int("kdim", kdim, minimum=1)
    vdim = E if vdim is None else check_int("vdim", vdim, minimum=1)
    for name, flag in (("bias", bias), ("sinks", sinks)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    check_int("seed", seed, minimum=0)
    if xp is None:
        import array_api_compat.numpy as xp
    check_namespace(xp)
    dtype = default_float_dtype(xp, device) if dtype is None else dtype
    check_float_dtype(xp, "dtype", dtype)
    Kd = K * (E // N)
    rng = np.random.default_rng(seed)
    if kdim == E and vdim == E:  # PyTorch's packed in_proj_weight (E + 2 Kd, E)
        a = math.sqrt(6.0 / (E + E + 2 * Kd))
        bounds = (a, a, a)
    else:  # separate q_proj_weight, k_proj_weight, v_proj_weight
        bounds = (math.sqrt(6.0 / (E + E)), math.sqrt(6.0 / (kdim + Kd)), math.sqrt(6.0 / (vdim + Kd)))
    shapes = {"q_weight": (E, E), "k_weight": (Kd, kdim), "v_weight": (Kd, vdim), "out_weight": (E, E)}
    host = {
        name: rng.uniform(-bound, bound, size=shapes[name])
        for name, bound in zip(WEIGHT_KEYS, bounds + (1.0 / math.sqrt(E),))
    }
    params = {name: xp.asarray(w, dtype=dtype, device=device) for name, w in host.items()}
    if bias:
        for name, size in (("q_bias", E), ("k_bias", Kd), ("v_bias", Kd), ("out_bias", E)):
            params[name] = xp.zeros((size,), dtype=dtype, device=device)
    if sinks:
        params["sinks"] = xp.zeros((N,), dtype=dtype, device=device)  # one logit per query head
    return params


# --- shape helpers ----------------------------------------------------------


def _matmul(xp, a, b):
    """``a @ b`` for 2-D arrays: on NumPy in row blocks on npattn's pool
    (:func:`npattn.linear_numpy.matmul`), leaving no BLAS thread spinning
    beside attention's kernels."""
    return linear_numpy.matmul(a, b) if linear_numpy.handles(xp, a.dtype) else a @ b


def _linear(xp, a, w, b):
    """``a W^T + b``: ``(B, L, in) -> (B, L, out)``, as one product over the
    ``B*L`` rows (one large GEMM rather than B smaller ones)."""
    B, L, width = a.shape
    y = _matmul(xp, xp.reshape(a, (B * L, width)), xp.matrix_transpose(w))  # (B*L, in) @ (in, out) -> (B*L, out)
    y = xp.reshape(y, (B, L, w.shape[0]))  # (B, L, out)
    if b is not None:
        y += b  # in place: y is the product's own fresh array (a second (B, L, out) costs its page faults)
    return y


def _linear_backward(xp, dy, a, w, with_bias):
    """Adjoint of :func:`_linear`: ``(dA, dW, db)`` with ``dA = dY W``,
    ``dW = dY^T A`` over all batch rows and positions, ``db = sum(dY)``."""
    B, L, out = dy.shape
    dy_rows = xp.reshape(dy, (B * L, out))  # (B*L, out)
    a_rows = xp.reshape(a, (B * L, a.shape[-1]))  # (B*L, in)
    da = xp.reshape(_matmul(xp, dy_rows, w), (B, L, w.shape[1]))  # (B*L, out) @ (out, in) -> (B, L, in)
    dw = _matmul(xp, xp.matrix_transpose(dy_rows), a_rows)  # (out, B*L) @ (B*L, in) -> (out, in)
    db = xp.sum(dy_rows, axis=0) if with_bias else None  # (out,)
    return da, dw, db


def _split_heads(xp, y, heads):
    """``(B, L, heads*H) -> (B, heads, L, H)``."""
    B, L, width = y.shape
    y = xp.reshape(y, (B, L, heads, width // heads))  # (B, L, heads, H)
    return xp.permute_dims(y, (0, 2, 1, 3))  # (B, heads, L, H)


def _merge_heads(xp, o):
    """``(B, heads, L, H) -> (B, L, heads*H)``; the adjoint of :func:`_split_heads`."""
    B, heads, L, H = o.shape
    o = xp.permute_dims(o, (0, 2, 1, 3))  # (B, L, heads, H)
    return xp.reshape(o, (B, L, heads * H))  # (B, L, heads*H)


def _check_source(name: str, a: Any, width: int, width_name: str, batch: int | None) -> None:
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if a.ndim != 3:
        raise ValueError(f"{name} must have shape (B, length, width) (batch first), got {tuple(a.shape)}")
    if a.shape[-1] != width:
        raise ValueError(f"{name} has width {a.shape[-1]} (last axis), but params expect {width_name}={width}")
    if batch is not None and a.shape[0] != batch:
        raise ValueError(f"{name} has batch size {a.shape[0]}, but x has {batch}")


def _recompute_weights(attn: AttentionResiduals) -> Any:
    """``P = exp(s - lse)`` on visible keys, 0 elsewhere and on fully masked
    rows: the chunked path's probabilities, rebuilt from its saved ``lse``
    (materializes ``(B, N, T, S)``). ``s`` is the score pipeline's (softcap,
    bias, ALiBi) and visibility includes segment ids; the saved ``lse``
    already holds the sinks, so each row sums to ``1 - exp(sinks_n - lse)``
    as on the dense path."""
    spec = attn.spec
    xp = spec.xp
    q, k, _ = inputs_in_compute_dtype(attn)
    s = dense_scores(spec, q, k)  # (B, N, T, S)
    visible = visible_tile(spec, 0, spec.q_len, 0, spec.kv_len)
    if visible is not None:
        s = xp.where(visible, s, -xp.inf)  # (B, N, T, S)
    lse = attn.lse[..., None]  # (B, N, T, 1)
    finite = xp.isfinite(lse)
    lse_safe = xp.where(finite, lse, xp.zeros_like(lse))
    p = xp.exp(s - lse_safe)  # (B, N, T, S), exactly 0 where hidden
    return xp.where(finite, p, xp.zeros_like(p))


# --- the forward's steps ----------------------------------------------------


def _sources(x: Any, context: Any) -> tuple[str, Any, Any, tuple[str, str]]:
    """``(kind, key_source, value_source, names)`` of a ``context`` argument:
    ``"self"`` (None: keys and values from ``x``), ``"single"`` (one array) or
    ``"pair"`` (``(key_source, value_source)``); ``names`` are the sources'
    names in error messages."""
    if isinstance(context, (tuple, list)):
        if len(context) != 2:
            raise ValueError(f"context must be an array or a pair (key_source, value_source), got {len(context)} items")
        return "pair", context[0], context[1], ("context[0] (key source)", "context[1] (value source)")
    if context is None:
        return "self", x, x, ("x", "x")
    return "single", context, context, ("context", "context")


def _layer_namespace(arrays: dict[str, Any], params: Any, cache: Any, xp: Any) -> Any:
    """The one namespace of ``arrays``, the params' arrays and the cache's
    keys (one library, one device), each named in the error otherwise."""
    named = dict(arrays)
    if isinstance(params, Mapping):
        named.update({f"params[{name!r}]": a for name, a in params.items() if hasattr(a, "shape")})
    if isinstance(cache, KVCache):
        named["cache"] = cache.keys  # (B, K, L, H): the cache's library and device
    return resolve_namespace(named, xp)


def _check_source_shapes(
    kind: str, names: tuple[str, str], x: Any, key_source: Any, value_source: Any, dims: LayerDims
) -> tuple[int, int]:
    """``x`` (B, T, E) and the key/value sources (B, S, kdim), (B, S, vdim)
    against the params' widths; returns ``(B, T)``."""
    E, kdim, vdim = dims.embed_dim, dims.kdim, dims.vdim
    _check_source("x", x, E, "embed_dim", None)
    B, T = x.shape[0], x.shape[1]
    if kind == "self":
        if (kdim, vdim) != (E, E):
            raise ValueError(
                f"params were made for cross-attention (kdim={kdim}, vdim={vdim}, embed_dim={E}); pass context"
            )
    elif kind == "single":
        if kdim != vdim:
            raise ValueError(
                f"params have kdim={kdim} != vdim={vdim}: pass context as a pair (key_source, value_source)"
            )
        _check_source("context", key_source, kdim, "kdim", B)
    else:
        _check_source(names[0], key_source, kdim, "kdim", B)
        _check_source(names[1], value_source, vdim, "vdim", B)
        if key_source.shape[1] != value_source.shape[1]:
            raise ValueError(
                f"context[0] and context[1] must have one length S (axis 1), got "
                f"{key_source.shape[1]} and {value_source.shape[1]}"
            )
    return B, T


def _check_layer_dtypes(
    xp: Any, names: tuple[str, str], x: Any, key_source: Any, value_source: Any, params: Mapping
) -> Any:
    """One floating dtype for ``x``, the sources and the params; returns the compute dtype."""
    check_floating(xp, "x", x)
    sources = [(names[0], key_source), (names[1], value_source)]
    for name, a in sources + [(f"params[{key!r}]", a) for key, a in params.items()]:
        if a.dtype != x.dtype:
            message = f"{name} has dtype {a.dtype} but x has {x.dtype}; the layer needs one dtype"
            if name.startswith("params["):
                message += (
                    f": make the params in x's dtype with mha_init(..., dtype=x.dtype) (here {dtype_name(x.dtype)}; "
                    f"MultiheadAttention takes the same dtype=), or cast x to {dtype_name(a.dtype)}"
                )
            raise TypeError(message)
    return compute_dtype(xp, x.dtype)


def _segment_ids(xp: Any, kind: str, cache: Any, q_ids: Any, kv_ids: Any, B: int, T: int) -> tuple[Any, Any]:
    """``(q_segment_ids, kv_segment_ids)`` for the core, or two Nones.

    Self-attention's keys are its queries' tokens, so ``kv_segment_ids``
    defaults to ``q_segment_ids`` there; with a cache the kv ids are the
    cache's business (the new tokens' ids are appended to the cached ones by
    ``cache._stage``), so passing them is an error. Cross-attention needs both.
    """
    if cache is not None:
        cache._check_segment_ids(q_ids is not None, what="q_segment_ids")
    if q_ids is None:
        if kv_ids is not None:
            raise ValueError("kv_segment_ids was given without q_segment_ids (B, T): pass both, or neither")
        return None, None
    if not hasattr(q_ids, "shape") or not hasattr(q_ids, "dtype"):
        raise TypeError(
            f"q_segment_ids must be an integer array of shape (B, T) = ({B}, {T}), got {type(q_ids).__name__}"
        )
    if not xp.isdtype(q_ids.dtype, "integral"):
        raise TypeError(f"q_segment_ids must have an integer dtype, got {q_ids.dtype}")
    if tuple(q_ids.shape) != (B, T):
        raise ValueError(
            f"q_segment_ids must have shape (B, T) = ({B}, {T}) (batch first, like x), got {tuple(q_ids.shape)}"
        )
    if kind == "self" and cache is not None and kv_ids is not None:
        raise ValueError(
            "with cache= pass only q_segment_ids, the new tokens' ids: the cache keeps the cached tokens' "
            "ids and appends these, so kv_segment_ids must be None"
        )
    if kind != "self" and kv_ids is None:
        raise ValueError(
            "cross-attention needs kv_segment_ids (B, S) beside q_segment_ids: the keys are the context's tokens"
        )
    return q_ids, q_ids if kv_ids is None else kv_ids


def _check_cache(
    cache: Any, kind: str, dropout_p: Any, align: Any, dims: LayerDims, cdtype: Any, B: int, T: int
) -> str:
    """Check a decoding ``cache`` against the call; returns the alignment it implies, ``"bottom_right"``."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be an npattn KVCache, got {type(cache).__name__}")
    if kind != "self":
        raise ValueError("cache= decodes self-attention only: context must be None")
    if dropout_p:
        raise ValueError(
            "dropout_p must be 0 with cache=: the dropout mask is keyed by each call's query index, "
            "so decoding step by step would not draw the mask of one full forward"
        )
    if align not in (None, "bottom_right"):
        raise ValueError(
            f"with a cache the new queries sit at the end of the cached keys: align must be "
            f"None or 'bottom_right', got {align!r}"
        )
    K, H = dims.num_kv_heads, dims.head_dim
    if (cache.num_kv_heads, cache.head_dim) != (K, H):
        raise ValueError(
            f"cache holds num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}, but the layer has {K} and {H}"
        )
    if cache.dtype != cdtype:
        raise TypeError(f"cache stores {cache.dtype}, but the layer computes in {cdtype}")
    cache.check_new(B, T)
    if cache.length + T == 0:
        raise ValueError(
            "x has no new positions (T=0) and the cache is empty: the queries would attend to no key; "
            "pass at least one position"
        )
    return "bottom_right"


def _in_compute_dtype(
    xp: Any, kind: str, params: Mapping, x: Any, key_source: Any, value_source: Any, cdtype: Any
) -> tuple[dict[str, Any], Any, Any, Any]:
    """``(params, x, key_source, value_source)`` in the compute dtype, sharing
    arrays where the caller passed one array twice (no second cast)."""
    P = {name: xp.astype(a, cdtype, copy=False) for name, a in params.items()}
    xc = xp.astype(x, cdtype, copy=False)  # (B, T, E)
    ks = xc if kind == "self" else xp.astype(key_source, cdtype, copy=False)  # (B, S, kdim)
    vs = ks if kind != "pair" else xp.astype(value_source, cdtype, copy=False)  # (B, S, vdim)
    return P, xc, ks, vs


def _project_heads(
    xp: Any, P: Mapping, xc: Any, ks: Any, vs: Any, dims: LayerDims, cache: Any, kv_ids: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """The in-projections, heads split: ``(q, k, v, kv_ids, state)`` with
    ``q (B, N, T, H)``, ``k``, ``v`` ``(B, K, S, H)`` and ``kv_ids`` the
    keys' segment ids (B, S) or None. With a cache, ``k``, ``v`` and
    ``kv_ids`` are the cached ones with the new positions appended (S = L + T)
    and ``state`` is what ``cache._commit`` takes once the forward succeeded;
    without one ``state`` is None."""
    q = _split_heads(xp, _linear(xp, xc, P["q_weight"], P.get("q_bias")), dims.num_heads)  # (B, N, T, H)
    k = _split_heads(xp, _linear(xp, ks, P["k_weight"], P.get("k_bias")), dims.num_kv_heads)  # (B, K, S, H)
    v = _split_heads(xp, _linear(xp, vs, P["v_weight"], P.get("v_bias")), dims.num_kv_heads)  # (B, K, S, H)
    if cache is None:
        return q, k, v, kv_ids, None
    k, v, kv_ids, state = cache._stage(k, v, segment_ids=kv_ids)  # (B, K, L + T, H) x 2, (B, L + T) or None
    return q, k, v, kv_ids, state


def _dtypes(params: Mapping) -> dict[str, Any]:
    """The caller's dtype of each parameter, in which its gradient returns."""
    return {name: a.dtype for name, a in params.items()}


def _attention_weights(attn: AttentionResiduals) -> Any:
    """``need_weights``: the dense path's probabilities, or the chunked path's rebuilt, ``(B, N, T, S)``."""
    return attn.probs if isinstance(attn, DenseResiduals) else _recompute_weights(attn)


# --- forward and backward ---------------------------------------------------


class MHAGrads(NamedTuple):
    """Gradients of :func:`mha_forward`, each in its input's shape and dtype.

    Attributes
    ----------
    dx : array, (B, T, E)
    dcontext : None (self-attention), an array (B, S, kdim) (one context),
        or a pair ``(dkey_source, dvalue_source)`` (a pair context).
    dparams : dict
        Same keys as ``params`` (``"sinks"`` included when the layer has
        sinks).
    dbias : array or None
        Gradient of the additive attention ``bias``, in its own shape.
    dalibi_slopes : array or None
        Gradient of the ``alibi_slopes`` argument, in its own shape and
        dtype; None without ALiBi.
    dmods : dict or None
        Gradients of the ``score_mods`` parameters by name (None without
        them). (A named tuple of six: read the fields by name; unpacking
        takes six names.)
    """

    dx: Any
    dcontext: Any
    dparams: dict
    dbias: Any
    dalibi_slopes: Any = None
    dmods: Any = None


@dataclass(frozen=True, eq=False)
class MHAResiduals:
    """What :func:`mha_backward` needs, saved by :func:`mha_forward`.

    Attributes
    ----------
    attention : DenseResiduals or ChunkedResiduals
        The core's residuals (heads split: ``q (B, N, T, H)``, ``k``, ``v``
        ``(B, K, S, H)``, ``lse (B, N, T)``, the validated ``spec``).
    x, key_source, value_source : arrays, (B, T, E), (B, S, kdim), (B, S, vdim)
        The projections' inputs in the compute dtype (``x`` itself for
        self-attention; None for the sources of a cached forward).
    context_kind : {"self", "single", "pair"}
    merged : array, (B, T, E)
        The attention output with heads merged: the out projection's input.
    params : dict
        The params in the compute dtype.
    dims : LayerDims
        ``(embed_dim, num_heads, num_kv_heads, head_dim, kdim, vdim)``.
    dtype, param_dtypes : dtype, dict of dtypes
        The caller's dtypes, in which the gradients are returned.
    weights : array (B, N, T, S) or None
        With ``need_weights=True``: per-head softmax before dropout, in the
        compute dtype (not differentiated through).
    cached : bool
        Made with ``cache=``: forward only, :func:`mha_backward` refuses it.
    """

    attention: AttentionResiduals
    x: Any
    key_source: Any
    value_source: Any
    context_kind: str
    merged: Any
    params: dict
    dims: LayerDims
    dtype: Any
    param_dtypes: dict
    weights: Any = None
    cached: bool = False

    @property
    def lse(self) -> Any:
        """Logsumexp of the attention scores, ``(B, N, T)``."""
        return self.attention.lse

    @property
    def spec(self):
        """The core's validated options (path, masks, dropout, ...)."""
        return self.attention.spec


def mha_forward(
    params,
    x,
    context=None,
    /,
    *,
    num_heads,
    num_kv_heads=None,
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
    q_segment_ids=None,
    kv_segment_ids=None,
    score_mods=None,
    mask_mod=None,
    block_mask=None,
    need_weights=False,
    cache=None,
    xp=None,
):
    r"""Multi-head attention (self- or cross-), keeping residuals for the backward.

    .. math::

        y = \mathrm{concat}_n\big(\mathrm{attention}(x W_{q,n}^\top + b_{q,n},\
        x_k W_{k,g(n)}^\top + b_{k,g(n)},\ x_v W_{v,g(n)}^\top + b_{v,g(n)})\big) W_o^\top + b_o

    with ``g(n) = n // (N / K)`` the key/value head that query head ``n``
    reads, and ``attention`` :func:`npattn.attention_forward` (scaled,
    masked, biased softmax, seeded dropout on the probabilities; softcap,
    ALiBi, segment ids, and the layer's sinks ``params["sinks"]`` when
    present).

    Dimension legend: B batch, T query length, S key length, E embed_dim,
    N num_heads, K num_kv_heads, H = E // N, kdim/vdim source widths.

    Parameters
    ----------
    params : dict of arrays
        As made by :func:`mha_init` (keys documented there); one floating
        dtype shared with ``x`` and the context.
    x : array, (B, T, E)
        Queries' source, batch first. Also the keys' and values' source when
        ``context`` is None (self-attention).
    context : array (B, S, kdim), or pair of arrays ((B, S, kdim), (B, S, vdim)), optional
        Cross-attention source of keys and values; a pair
        ``(key_source, value_source)`` when ``kdim != vdim`` (PyTorch's
        separate ``key``/``value``).
    num_heads : int
        N; must divide E.
    num_kv_heads : int, optional
        K; None reads it from ``params["k_weight"]``, given it must agree.
    mask, bias, causal, window, align, q_lengths, kv_lengths, scale, dropout_p, seed, impl, block_q, block_k
        Passed to :func:`npattn.attention_forward` unchanged, same semantics:
        bool ``mask`` broadcastable to (B, N, T, S) with True = may attend
        (``nn.MultiheadAttention``'s masks are the opposite; see
        :func:`npattn.mha_masks_from_torch`), additive float ``bias``,
        ``q_lengths``/``kv_lengths`` of shape (B,), ``dropout_p`` with a
        ``seed`` on the probabilities, ``impl="auto"`` choosing the path by
        attention's own rule. On NumPy the projections run on npattn's
        thread pool (:func:`npattn.linear_numpy.matmul`).
    softcap, alibi_slopes
        Passed to :func:`npattn.attention_forward`: ``softcap * tanh(s /
        softcap)`` on the raw scores; ALiBi slopes (N,) (e.g.
        :func:`npattn.alibi_slopes`), which need ``align`` when T != S
        (a cache implies ``"bottom_right"``). Their gradient is
        :attr:`MHAGrads.dalibi_slopes`. The sinks are not an argument: they
        are the layer's parameter ``params["sinks"]`` (``mha_init(...,
        sinks=True)``).
    score_mods, mask_mod, block_mask
        User score and mask modifications (:class:`npattn.ScoreMod`,
        :func:`npattn.block_mask`), passed to :func:`npattn.attention_forward`
        on the split heads ``(B, N, T, S)``; positions are the core's (a
        cache implies ``"bottom_right"``, so ``idx.q`` is the token's place
        in the whole sequence). Their parameters' gradients are
        :attr:`MHAGrads.dmods`.
    q_segment_ids, kv_segment_ids : int arrays (B, T) and (B, S), optional
        Packed documents: key j is visible to query i only where the ids are
        equal. For self-attention ``kv_segment_ids`` defaults to
        ``q_segment_ids`` (the keys are the same tokens); cross-attention
        needs both. With ``cache``, pass only ``q_segment_ids``, the new
        tokens' ids: the cache remembers the ids of the tokens it holds and
        appends these (a cache is used with ids from its first token, or
        never).
    need_weights : bool
        Keep the per-head attention probabilities (softmax before dropout) as
        ``residuals.weights``, (B, N, T, S). The dense path has them already.
        On the chunked path (``impl="chunked"``, or ``"auto"`` choosing it)
        they are recomputed after the forward as ``P = exp(s - lse)`` on
        visible keys from the saved ``lse``, ``s`` the scores after softcap,
        bias and ALiBi; this materializes the (B, N, T, S) tensor the chunked
        path otherwise avoids, but leaves its output and backward unchanged.
        With sinks the sink's share is not a key: each row sums to
        ``1 - exp(sinks_n - lse)``.
    cache : KVCache, optional
        Incremental decoding, forward only (self-attention): the new
        positions' keys and values are appended to ``cache`` and the queries
        attend over all cached positions with ``align="bottom_right"``
        (``align`` must be None or ``"bottom_right"``); with ``causal=True``
        the outputs equal one causal forward over the whole sequence, with
        every variant (softcap, sinks, ALiBi at those positions, segment
        ids). ``mask``,
        ``bias`` and lengths then refer to the (T new, S cached) scores. The
        cache is only advanced when the forward succeeds.
    xp : namespace, optional
        Inferred from the arrays by default.

    Returns
    -------
    y : array, (B, T, E), in x's dtype
    residuals : MHAResiduals
        For :func:`mha_backward`; ``residuals.weights`` with ``need_weights``,
        ``residuals.lse`` (B, N, T).

    Raises
    ------
    TypeError
        Arrays of other dtypes or libraries, a params value that is not an array.
    ValueError
        E not divisible by N, N not divisible by K, params with missing,
        unknown or misshapen keys, ``x``/``context`` widths that do not match
        the params, a cache that is full or made for another batch size, and
        every invalid attention option (named by the core).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.mha import mha_init, mha_forward, mha_backward
    >>> params = mha_init(8, 2, num_kv_heads=1)
    >>> x = np.random.default_rng(0).standard_normal((3, 5, 8))
    >>> y, res = mha_forward(params, x, num_heads=2, causal=True, need_weights=True)
    >>> y.shape, res.weights.shape
    ((3, 5, 8), (3, 2, 5, 5))
    >>> grads = mha_backward(np.ones_like(y), res)
    >>> grads.dx.shape, grads.dcontext, grads.dparams["k_weight"].shape
    ((3, 5, 8), None, (4, 8))
    """
    kind, key_source, value_source, names = _sources(x, context)
    arrays = {"x": x, names[0]: key_source, names[1]: value_source, "mask": mask, "bias": bias}
    arrays.update(alibi_slopes=alibi_slopes, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
    xp = _layer_namespace(arrays, params, cache, xp)
    dims = layer_dims(params, num_heads=num_heads, num_kv_heads=num_kv_heads)
    B, T = _check_source_shapes(kind, names, x, key_source, value_source, dims)
    cdtype = _check_layer_dtypes(xp, names, x, key_source, value_source, params)
    if not isinstance(need_weights, bool):
        raise TypeError(f"need_weights must be a bool, got {need_weights!r}")
    align = align if cache is None else _check_cache(cache, kind, dropout_p, align, dims, cdtype, B, T)
    q_ids, kv_ids = _segment_ids(xp, kind, cache, q_segment_ids, kv_segment_ids, B, T)  # (B, T), (B, S) or None

    P, xc, ks, vs = _in_compute_dtype(xp, kind, params, x, key_source, value_source, cdtype)
    q, k, v, kv_ids, state = _project_heads(xp, P, xc, ks, vs, dims, cache, kv_ids)  # (B, N, T, H), (B, K, S, H) x 2
    core = dict(mask=mask, bias=bias, causal=causal, window=window, align=align, q_lengths=q_lengths)
    core.update(kv_lengths=kv_lengths, scale=scale, dropout_p=dropout_p, seed=seed, block_q=block_q)
    core.update(impl=impl)
    core.update(block_k=block_k, softcap=softcap, alibi_slopes=alibi_slopes, score_mods=score_mods, mask_mod=mask_mod)
    core.update(block_mask=block_mask, sinks=P.get("sinks"), q_segment_ids=q_ids, kv_segment_ids=kv_ids, xp=xp)
    o, attn = attention_forward(q, k, v, **core)  # o: (B, N, T, H)
    merged = _merge_heads(xp, o)  # (B, T, E)
    y = _linear(xp, merged, P["out_weight"], P.get("out_bias"))  # (B, T, E)
    weights = _attention_weights(attn) if need_weights else None  # (B, N, T, S)
    if cache is not None:
        cache._commit(state)
        ks = vs = None  # forward only: no sources kept
    residuals = MHAResiduals(
        attn, xc, ks, vs, kind, merged, P, dims, x.dtype, _dtypes(params), weights, cached=cache is not None
    )
    return xp.astype(y, x.dtype, copy=False), residuals


def mha_backward(dy, residuals, /) -> MHAGrads:
    r"""Gradients of :func:`mha_forward` through every input and parameter.

    .. math::

        dO = dy\,W_o,\quad dW_o = dy^\top O,\quad db_o = \textstyle\sum dy,\qquad
        (dQ, dK, dV, d\mathrm{bias}, d\mathrm{sinks}, d\mathrm{slopes}) = \mathrm{attention\_backward}(dO)

        dx = dQ\,W_q\ [+\,dK\,W_k + dV\,W_v],\quad dW_q = dQ^\top x,\quad
        dW_k = dK^\top x_k,\quad dW_v = dV^\top x_v

    (sums over batch and positions; heads split and merged around the core).

    Parameters
    ----------
    dy : array, (B, T, E)
        Cotangent of ``y``, in ``y``'s dtype.
    residuals : MHAResiduals
        From :func:`mha_forward` without ``cache``; reusable.

    Returns
    -------
    MHAGrads
        ``(dx, dcontext, dparams, dbias, dalibi_slopes, dmods)``: ``dcontext`` is
        None for self-attention, an array for one context, a pair for a pair;
        ``dparams`` has the keys of ``params`` (``dparams["sinks"]`` the
        sinks' gradient when the layer has them); ``dbias`` and
        ``dalibi_slopes`` are the gradients of the ``bias`` and
        ``alibi_slopes`` arguments in their own shapes, or None; ``dmods``
        the ``score_mods`` parameters' gradients by name, or None.

    Raises
    ------
    TypeError
        ``residuals`` not from :func:`mha_forward`, ``dy`` of another dtype
        or library.
    ValueError
        ``dy`` of another shape, or residuals of a cached (decoding) forward.

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.mha import mha_init, mha_forward, mha_backward
    >>> params = mha_init(4, 2, kdim=3, vdim=5, bias=False)
    >>> rng = np.random.default_rng(0)
    >>> x, xk, xv = rng.random((2, 6, 4)), rng.random((2, 7, 3)), rng.random((2, 7, 5))
    >>> y, res = mha_forward(params, x, (xk, xv), num_heads=2)
    >>> g = mha_backward(np.ones_like(y), res)
    >>> g.dcontext[0].shape, g.dcontext[1].shape, sorted(g.dparams)
    ((2, 7, 3), (2, 7, 5), ['k_weight', 'out_weight', 'q_weight', 'v_weight'])
    """
    if not isinstance(residuals, MHAResiduals):
        raise TypeError(f"residuals must come from npattn.mha_forward, got {type(residuals).__name__}")
    if residuals.cached:
        raise ValueError(
            "residuals come from a forward with cache= (incremental decoding), which is forward only; "
            "run mha_forward over the whole sequence without a cache to get gradients"
        )
    xp = residuals.spec.xp
    expected = tuple(residuals.merged.shape)
    if dy is None:
        raise TypeError(f"dy must be an array of y's shape {expected}, got None")
    resolve_namespace({"the forward's x": residuals.x, "dy": dy})
    if tuple(dy.shape) != expected:
        raise ValueError(f"dy must have y's shape {expected}, got {tuple(dy.shape)}")
    if dy.dtype != residuals.dtype:
        raise TypeError(f"dy must have y's dtype {residuals.dtype}, got {dy.dtype}")
    P, (_E, N, _K, _H, _kdim, _vdim) = residuals.params, residuals.dims
    dy_c = xp.astype(dy, residuals.params["q_weight"].dtype, copy=False)  # (B, T, E), compute dtype

    # y = O Wo^T + bo
    d_merged, d_out_weight, d_out_bias = _linear_backward(
        xp, dy_c, residuals.merged, P["out_weight"], "out_bias" in P
    )  # (B, T, E), (E, E), (E,)
    g = attention_backward(_split_heads(xp, d_merged, N), residuals.attention)  # dO: (B, N, T, H)
    dq = _merge_heads(xp, g.dq)  # (B, T, E)
    dk = _merge_heads(xp, g.dk)  # (B, S, K*H)
    dv = _merge_heads(xp, g.dv)  # (B, S, K*H)
    # Q = x Wq^T + bq,  K = xk Wk^T + bk,  V = xv Wv^T + bv
    dx, d_q_weight, d_q_bias = _linear_backward(xp, dq, residuals.x, P["q_weight"], "q_bias" in P)
    d_key_source, d_k_weight, d_k_bias = _linear_backward(
        xp, dk, residuals.key_source, P["k_weight"], "k_bias" in P
    )  # (B, S, kdim), (K*H, kdim), (K*H,)
    d_value_source, d_v_weight, d_v_bias = _linear_backward(
        xp, dv, residuals.value_source, P["v_weight"], "v_bias" in P
    )  # (B, S, vdim), (K*H, vdim), (K*H,)

    by_name = {
        "q_weight": d_q_weight,
        "q_bias": d_q_bias,
        "k_weight": d_k_weight,
        "k_bias": d_k_bias,
        "v_weight": d_v_weight,
        "v_bias": d_v_bias,
        "out_weight": d_out_weight,
        "out_bias": d_out_bias,
        "sinks": g.dsinks,  # (N,) when params have sinks
    }
    dparams = {name: xp.astype(by_name[name], dtype, copy=False) for name, dtype in residuals.param_dtypes.items()}
    kind = residuals.context_kind
    if kind == "self":
        dx += d_key_source  # x fed queries, keys and values; in place: dx is the product's own fresh array
        dx += d_value_source
        dcontext = None
    elif kind == "single":
        dcontext = xp.astype(d_key_source + d_value_source, residuals.dtype, copy=False)
    else:
        dcontext = (
            xp.astype(d_key_source, residuals.dtype, copy=False),
            xp.astype(d_value_source, residuals.dtype, copy=False),
        )
    return MHAGrads(xp.astype(dx, residuals.dtype, copy=False), dcontext, dparams, g.dbias, g.dalibi_slopes, g.dmods)


# --- a thin object wrapper --------------------------------------------------


def _check_adopted_sinks(params: Any, sinks: Any) -> None:
    """``MultiheadAttention(params=..., sinks=True/False)``: the dict must agree."""
    if not isinstance(sinks, bool):
        raise TypeError(f"sinks must be a bool or None, got {sinks!r}")
    if isinstance(params, Mapping) and sinks != ("sinks" in params):
        if sinks:
            hint = "make them with mha_init(..., sinks=True), or add params['sinks'] of shape (num_heads,)"
            raise ValueError(f"sinks=True, but params has no 'sinks' key: {hint}")
        raise ValueError("sinks=False, but params has 'sinks'; pass sinks=None to adopt the dict as it is")


class MultiheadAttention:
    """A thin holder of ``params`` and head counts around :func:`mha_forward`
    and :func:`mha_backward`; the functions remain the API.

    Parameters are those of :func:`mha_init`; ``params=`` adopts an existing
    dict instead of initializing one. ``sinks=None`` (the default) means
    ``False`` when initializing and "whatever the dict has" when adopting;
    ``True`` or ``False`` with ``params=`` must agree with the dict (a
    ``ValueError`` otherwise, rather than silently ignoring the request).

    Examples
    --------
    >>> import numpy as np
    >>> from npattn.mha import MultiheadAttention
    >>> layer = MultiheadAttention(8, 4, num_kv_heads=2)
    >>> x = np.zeros((1, 3, 8))
    >>> y, res = layer(x, causal=True)
    >>> layer.backward(np.ones_like(y), res).dx.shape
    (1, 3, 8)
    >>> cache = layer.new_cache(1, max_length=3)
    >>> [layer(x[:, i:i + 1], cache=cache, causal=True)[0].shape for i in range(3)]
    [(1, 1, 8), (1, 1, 8), (1, 1, 8)]
    """

    def __init__(
        self,
        embed_dim=None,
        num_heads=None,
        *,
        num_kv_heads=None,
        kdim=None,
        vdim=None,
        bias=True,
        dtype=None,
        device=None,
        xp=None,
        seed=0,
        sinks=None,
        params=None,
    ):
        if num_heads is None:
            raise TypeError("num_heads is required")
        if params is None:
            if embed_dim is None:
                raise TypeError("embed_dim is required unless params= is given")
            params = mha_init(
                embed_dim,
                num_heads,
                num_kv_heads=num_kv_heads,
                kdim=kdim,
                vdim=vdim,
                bias=bias,
                dtype=dtype,
                device=device,
                xp=xp,
                seed=seed,
                sinks=False if sinks is None else sinks,
            )
        elif sinks is not None:
            _check_adopted_sinks(params, sinks)
        self.dims = layer_dims(params, num_heads=num_heads, num_kv_heads=num_kv_heads)
        if embed_dim is not None and embed_dim != self.dims.embed_dim:
            raise ValueError(f"embed_dim={embed_dim}, but params have embed_dim={self.dims.embed_dim}")
        self.params = params

    @property
    def num_heads(self) -> int:
        return self.dims.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.dims.num_kv_heads

    @property
    def dtype(self) -> Any:
        """The params' dtype, which inputs must share (``x``, ``context``)."""
        return self.params["q_weight"].dtype

    @property
    def has_sinks(self) -> bool:
        """Whether the layer has learnable attention sinks, ``params["sinks"]``."""
        return "sinks" in self.params

    def forward(self, x, context=None, /, **options):
        """``mha_forward(self.params, x, context, num_heads=..., **options)``."""
        return mha_forward(self.params, x, context, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, **options)

    __call__ = forward

    def backward(self, dy, residuals, /) -> MHAGrads:
        """``mha_backward(dy, residuals)``."""
        return mha_backward(dy, residuals)

    def new_cache(self, batch_size, /, *, max_length=None) -> KVCache:
        """A :class:`KVCache` for this layer (growing, or preallocated with ``max_length``)."""
        return KVCache.for_mha(
            self.params, batch_size, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, max_length=max_length
        )

    def __repr__(self) -> str:
        E, N, K, _H, kdim, vdim = self.dims
        return (
            f"MultiheadAttention(embed_dim={E}, num_heads={N}, num_kv_heads={K}, kdim={kdim}, vdim={vdim}, "
            f"sinks={self.has_sinks}, dtype={dtype_name(self.dtype)})"
        )
