"""Public attention API: ``attention_forward`` / ``attention_backward`` as a
JAX ``custom_vjp``-style pair, and ``attention`` for the forward alone.

The forward returns ``(out, residuals)``; the backward takes the cotangent and
the residuals and returns one gradient per differentiable input. The
residuals record the path (``DenseResiduals`` or ``ChunkedResiduals``) and the
validated options, so the backward always follows the forward that made them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from . import dense_numpy, fast_cupy, fast_numpy
from .chunked import chunked_backward, chunked_forward
from .dense import dense_backward, dense_forward
from .namespace import array_device, resolve_namespace
from .options import (
    AUTO_CHUNKED_MIN_SCORES,
    AUTO_FAST_MIN_SCORES,
    AUTO_FAST_SINGLE_HEAD_MIN_SCORES,
    AUTO_FAST_VARIANT_MIN_SCORES,
    RECURRING_SPECS,
    AttentionSpec,
    make_spec,
    plain_key,
    plain_spec,
    with_kv_len,
)
from .scores.sinks import apply_sinks, scaled_rows, sinks_grad

__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "choose_impl",
    "forward_from_spec",
    "AttentionGrads",
    "AttentionResiduals",
    "DenseResiduals",
    "ChunkedResiduals",
]


class AttentionGrads(NamedTuple):
    """Gradients of attention, each in its input's shape and dtype.

    ``dq (..., N, T, H)``, ``dk (..., K, S, H)``, ``dv (..., K, S, Hv)``;
    ``dbias``, ``dsinks`` and ``dalibi_slopes`` have the shape and dtype of
    ``bias``, ``sinks`` and ``alibi_slopes``, or are None where that option
    was not given; ``dmods`` maps each parameter name of the score
    modifications (``score_mods``) to its gradient, in the parameter's shape
    and dtype, or is None without them. A named tuple of seven: read the fields
    by name (``grads.dq``); unpacking takes seven names.
    """

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None
    dsinks: Any = None
    dalibi_slopes: Any = None
    dmods: dict[str, Any] | None = None


@dataclass(frozen=True, eq=False)
class AttentionResiduals:
    """What the backward needs, saved by the forward.

    Attributes
    ----------
    spec : AttentionSpec
        The validated options (path, masks, scale, dropout seed, ...).
    q, k, v : arrays
        The inputs in the dtype the path reads them in (the caller's arrays
        themselves when no cast was needed; never modified): the compute
        dtype, except on the CuPy fast path, whose kernels read float16
        inputs as they are (:func:`npattn.fast_cupy.operand_dtype`).
    out : array, (..., N, T, Hv)
        The output in the compute dtype.
    lse : array, (..., N, T)
        Natural-log logsumexp of the scaled, biased, masked scores, in the
        compute dtype; ``-inf`` on fully masked rows.
    """

    spec: AttentionSpec
    q: Any
    k: Any
    v: Any
    out: Any
    lse: Any


@dataclass(frozen=True, eq=False)
class DenseResiduals(AttentionResiduals):
    """Residuals of the dense path; also exposes the attention matrix.

    probs : array, (..., N, T, S)
        The softmax before dropout, per query head, in the compute dtype;
        0 on hidden keys and on fully masked rows.
    """

    probs: Any = None

    def __init__(self, spec: AttentionSpec, q: Any, k: Any, v: Any, out: Any, lse: Any, probs: Any = None):
        # The frozen dataclass's own __init__ sets each field through object.__setattr__:
        # 0.8 us against 0.4 here, on the floor of every small call.
        self.__dict__.update(spec=spec, q=q, k=k, v=v, out=out, lse=lse, probs=probs)


@dataclass(frozen=True, eq=False)
class ChunkedResiduals(AttentionResiduals):
    """Residuals of the chunked path: only ``out`` and ``lse``, never the
    probabilities (memory linear in sequence length).

    kernel : {"generic", "numpy", "cupy"}
        Which implementation ran the forward (the Array API path of
        :mod:`npattn.chunked`, the NumPy fast path of
        :mod:`npattn.fast_numpy`, or the fused CUDA kernels of
        :mod:`npattn.fast_cupy`); the backward runs the same one.
    """

    kernel: str = "generic"

    def __init__(self, spec: AttentionSpec, q: Any, k: Any, v: Any, out: Any, lse: Any, kernel: str = "generic"):
        self.__dict__.update(spec=spec, q=q, k=k, v=v, out=out, lse=lse, kernel=kernel)  # as DenseResiduals'


def attention_forward(
    q,
    k,
    v,
    /,
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
):
    r"""Masked scaled dot-product attention, keeping residuals for the backward.

    .. math::

        s_{ij} = f\Big(c\tanh\big(\mathrm{scale}\; q_i\cdot k_j / c\big) + \mathrm{bias}_{ij}
        - m_n |p_i - j|\Big),\qquad
        \mathrm{lse}_i = \log\Big(e^{\mathrm{sinks}_n} + \sum_{j\ \mathrm{visible}} e^{s_{ij}}\Big)

    .. math::

        \mathrm{out}_i = \sum_j \mathrm{dropout}\big(e^{s_{ij} - \mathrm{lse}_i}\big)\, v_j

    where the softcap ``c``, the bias, the ALiBi slopes ``m_n``, the user
    score modifications ``f`` and the sinks each apply only when given (the
    score pipeline of :mod:`npattn.scores`, in this order: softcap, bias and
    ALiBi, score modifications, visibility, sinks).

    Dimension legend: B... batch axes, N query heads, K kv heads (N % K == 0;
    K < N is GQA/MQA), T query length, S key length, H head dim, Hv value dim.

    Parameters
    ----------
    q : array, (..., N, T, H)
    k : array, (..., K, S, H)
    v : array, (..., K, S, Hv)
        Same floating dtype and equal leading axes. float16/bfloat16 compute
        in float32 and return in the input dtype.
    mask : bool array broadcastable to (..., N, T, S), optional
        True = may attend (PyTorch SDPA, JAX, FlexAttention polarity).
    bias : float array broadcastable to (..., N, T, S), optional
        Added to the scaled scores; ``-inf`` entries act as a mask. Its
        gradient is returned in its own shape.
    causal : bool
        Each query sees keys at or before its position (``window`` right = 0).
    window : (left, right), ints >= 0 or None
        Query at position p sees keys j with ``p - left <= j <= p + right``.
    align : {"top_left", "bottom_right"}, optional
        Query i sits at position i (top_left) or ``i + S - T`` (bottom_right;
        with lengths, ``kv_len - q_len`` per batch element). Required for
        ``causal``/``window`` when T != S; None with T == S means top_left.
    q_lengths, kv_lengths : int arrays of shape ``q.shape[:-3]``, optional
        Valid lengths; padded keys are never attended, padded query rows are
        fully masked.
    scale : float, optional
        Defaults to ``1 / sqrt(H)``.
    dropout_p : float in [0, 1)
        Dropout on the probabilities after softmax, kept entries scaled by
        ``1 / (1 - p)``. The keep mask is a pure function of ``seed`` and the
        indices, identical on every path and backend.
    seed : int >= 0
        Required when ``dropout_p > 0``.
    impl : {"auto", "dense", "chunked"}
        ``"auto"`` is chunked once the score tensor would exceed
        ``npattn.options.AUTO_CHUNKED_MIN_SCORES`` (2**24) entries, and on
        NumPy (float32/float64, where the chunked path is the fast path of
        :mod:`npattn.fast_numpy`) also once they reach
        ``npattn.options.AUTO_FAST_MIN_SCORES`` (2**21; 2**20 with a
        softcap, ALiBi or dropout, 2**22 with score modifications), from
        where that path is the faster; on CuPy wherever the fused kernels
        run the call (:func:`npattn.fast_cupy.preferred`). Pass
        ``"dense"`` to get ``probs`` back.
    block_q, block_k : int, optional
        Tile sizes of the chunked path; given ones always win. Defaults
        (:func:`npattn.chunked.default_blocks`): the NumPy fast path picks
        sizes tuned for each pass; the generic path uses 128 x 128 on the CPU
        (array-api-strict on any device, torch CPU tensors) and, on an
        accelerator (CuPy; torch on a non-CPU device), powers of two in
        [128, 2048], clipped to T and S, as large as keeps one score tile over
        all batch elements and heads, ``B*N*block_q*block_k``, within
        ``npattn.options.ACCELERATOR_TILE_SCORES`` = 2**25 entries (2048 x 2048
        at B*N = 8): per-tile kernel launches, not tile size, dominate there.
    softcap : float > 0, optional
        Logit soft-capping (Gemma 2): the raw scores ``scale * q.k`` become
        ``softcap * tanh(s / softcap)``, before the bias.
    alibi_slopes : float array of shape (N,) or broadcastable to (..., N), optional
        ALiBi: ``-slope_n * |p_i - j|`` is added to the scores, with query
        positions ``p_i`` under ``align`` (required when T != S). Its gradient
        is returned as ``dalibi_slopes``. :func:`npattn.alibi_slopes` gives
        the standard slopes.
    sinks : float array of shape (N,) or broadcastable to (..., N), optional
        Learnable attention sinks: one virtual key per head with score
        ``sinks_n`` and value 0, in every row that is not padding; it enters
        ``lse``. A row whose keys are all hidden gets out 0 and lse
        ``sinks_n``. Its gradient is returned as ``dsinks``.
    q_segment_ids, kv_segment_ids : int arrays of shapes (..., T) and (..., S), optional
        Packed documents: key j is visible to query i only where their ids
        are equal (JAX, FlexAttention document masking). Both or neither.
        Tiles whose id ranges cannot meet are skipped.
    score_mods : ScoreMod or list of ScoreMod, optional
        User score modifications (:class:`npattn.ScoreMod`), applied in order
        after the bias and ALiBi, each on tiles ``(B', n, tq, tk)`` with their
        indices; their parameters' gradients come back in ``grads.dmods``.
        On the NumPy fast path they turn off the score bounds and base-2
        scores (see :doc:`/score_mods`). Query positions need ``align`` when
        T != S.
    mask_mod : callable ``(idx) -> bool array``, optional
        A user mask modification, True = may attend, ANDed with the other
        rules. Correct alone; pass a :func:`npattn.block_mask` instead to skip
        the tiles it hides.
    block_mask : BlockMask, optional
        From :func:`npattn.block_mask`, for this call's T, S, heads, batch
        and query positions: its mask_mod, with its tile classification.
    xp : namespace, optional
        Array API namespace; inferred from the inputs by default.

    Returns
    -------
    out : array, (..., N, T, Hv), in q's dtype
        Fully masked rows are 0.
    residuals : DenseResiduals or ChunkedResiduals
        Carries ``lse`` (..., N, T), and for the dense path ``probs``.

    Raises
    ------
    TypeError
        Non-floating or mixed dtypes, a non-bool mask, arrays from two libraries.
    ValueError
        Shapes that do not fit, options out of range, arrays on two devices.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 5, 8)) for _ in range(3))
    >>> out, res = npattn.attention_forward(q, k, v, causal=True)
    >>> out.shape, res.lse.shape
    ((2, 4, 5, 8), (2, 4, 5))
    >>> grads = npattn.attention_backward(np.ones_like(out), res)
    >>> grads.dq.shape
    (2, 4, 5, 8)
    """
    spec = None
    no_arrays = (  # no option that takes an array (or a callable, or a namespace): one chain of identity tests
        (mask is None and bias is None and q_lengths is None and kv_lengths is None and alibi_slopes is None)
        and (sinks is None and q_segment_ids is None and kv_segment_ids is None and score_mods is None)
        and (mask_mod is None and block_mask is None and xp is None)
    )
    if (  # each option at its default but causal (0.1 µs; a list and all() take 0.8)
        no_arrays
        and (type(causal) is bool and type(dropout_p) is float and dropout_p == 0.0)
        and (type(impl) is str and impl == "auto")
        and (window is None and align is None and scale is None and seed is None)
        and (block_q is None and block_k is None and softcap is None)
    ):
        spec = plain_call_spec(q, k, v, causal)  # no option but causal: the same spec from fewer checks, or None
        if spec is not None and spec.impl == "dense" and not causal:
            return _plain_dense_forward(spec, q, k, v)
    if spec is None:
        scalars = dict(causal=causal, window=window, align=align, scale=scale, dropout_p=dropout_p, seed=seed)
        scalars.update(impl=impl, block_q=block_q, block_k=block_k, softcap=softcap)
        if no_arrays:  # looked up where the same call was made before (a decode step's)
            spec = scalar_call_spec(q, k, v, **scalars)
        else:
            others = dict(mask=mask, bias=bias, q_lengths=q_lengths, kv_lengths=kv_lengths, alibi_slopes=alibi_slopes)
            others.update(sinks=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
            others.update(score_mods=score_mods, mask_mod=mask_mod, block_mask=block_mask, xp=xp)
            spec = make_spec(q, k, v, **scalars, **others)
    _, residuals, output = _forward_and_output(spec, q, k, v)
    return output, residuals


def _plain_dense_forward(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, DenseResiduals]:
    """:func:`forward_from_spec` for a spec of :func:`plain_call_spec` on the
    dense path without ``causal``: what its dispatch would find (NumPy
    float32 or float64 inputs computing in their own dtype, raw scores, no
    key hidden, no sinks) is known from how that spec was made, so the plain
    kernel runs without asking again (2 µs of the tiny call's 16)."""
    out, lse, probs = dense_numpy.plain_forward(spec, q, k, v)  # (..., N, T, Hv), (..., N, T), (..., N, T, S)
    return out, DenseResiduals(spec, q, k, v, out, lse, probs)


def forward_from_spec(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, AttentionResiduals]:
    """The forward for a validated ``spec``, on the path :func:`choose_impl`
    picks: ``(out, residuals)`` with ``out (..., N, T, Hv)`` in the compute
    dtype. For callers that build or adjust the spec themselves (ring
    attention's shard pairs); :func:`attention_forward` is this after
    :func:`~npattn.options.make_spec`."""
    out, residuals, _ = _forward_and_output(spec, q, k, v, output=False)
    return out, residuals


def _forward_and_output(
    spec: AttentionSpec, q: Any, k: Any, v: Any, output: bool = True
) -> tuple[Any, AttentionResiduals, Any]:
    """:func:`forward_from_spec`'s ``(out, residuals)`` and, with ``output``,
    the call's output: ``out`` in the inputs' dtype (else None), written by
    the CuPy kernels themselves where no sinks rescale ``out`` after them
    (:func:`npattn.fast_cupy.forward_and_output`), else cast."""
    kernel = "dense" if spec.impl == "dense" else chunked_kernel(spec)
    if spec.impl == "auto":
        spec = _resolved(spec, kernel)  # choose_impl(spec), its kernel asked once
        kernel = "dense" if spec.impl == "dense" else kernel
    xp = spec.xp
    dtype = fast_cupy.operand_dtype(spec) if kernel == "cupy" else spec.compute_dtype  # what the kernel reads
    qc, kc, vc = _in_dtype(xp, q, dtype), _in_dtype(xp, k, dtype), _in_dtype(xp, v, dtype)
    residuals: AttentionResiduals
    returned = None
    if spec.impl == "dense":
        out, lse, probs = dense_forward(spec, qc, kc, vc)
        out, lse, factor = apply_sinks(spec, out, lse, overwrite=True)  # out: the kernel's own
        if factor is not None:
            probs = scaled_rows(xp, probs, factor, overwrite=True)  # (..., N, T, S): the sinks' share leaves each row
        residuals = DenseResiduals(spec, qc, kc, vc, out, lse, probs)
    else:
        if kernel == "cupy" and output and spec.sinks is None:  # the kernels write the output too
            out, lse, returned = fast_cupy.forward_and_output(spec, qc, kc, vc)
        else:
            out, lse, _ = apply_sinks(spec, *_CHUNKED_KERNELS[kernel][0](spec, qc, kc, vc), overwrite=True)
        residuals = ChunkedResiduals(spec, qc, kc, vc, out, lse, kernel)
    if output:  # the inputs' dtype, whatever the kernels wrote (a no-op where they wrote it)
        returned = _in_dtype(xp, out if returned is None else returned, spec.dtype)
    return out, residuals, returned


def attention_backward(dout, residuals, /, *, dlse=None) -> AttentionGrads:
    r"""Gradients of :func:`attention_forward`, following its residuals.

    With ``D = rowsum(dO * O) - dlse`` and ``P`` the pre-dropout
    probabilities (the sink's share included in ``lse``): ``dS = P * (dP - D)``,
    ``dbias = dS`` (summed to the bias's shape), ``dalibi_slopes_n =
    -sum dS_nij |p_i - j|``, ``dsinks_n = -sum_i exp(sinks_n - lse_i) D_i``;
    through the softcap ``dR = dS (1 - tanh^2(R / c))``, then
    ``dQ = scale * dR K``, ``dK = scale * dR^T Q``, ``dV = Pd^T dO``; score
    modifications pass ``dS`` through their backward (in reverse order)
    before the bias's and ALiBi's share is taken. Fully masked rows
    contribute nothing.

    Parameters
    ----------
    dout : array, (..., N, T, Hv)
        Cotangent of ``out``, in ``out``'s dtype.
    residuals : AttentionResiduals
        From :func:`attention_forward`; reusable (backward may run twice).
    dlse : array, (..., N, T), optional
        Cotangent of ``residuals.lse``.

    Returns
    -------
    AttentionGrads
        ``(dq, dk, dv, dbias, dsinks, dalibi_slopes, dmods)``, each in its
        input's shape and dtype; ``dbias``, ``dsinks`` and ``dalibi_slopes``
        are None where ``bias``, ``sinks`` and ``alibi_slopes`` were not
        given; ``dmods`` maps the score modifications' parameter names to
        their gradients (None without ``score_mods``).

    Examples
    --------
    >>> import numpy as np, npattn
    >>> q = k = v = np.ones((1, 2, 3))
    >>> out, res = npattn.attention_forward(q, k, v)
    >>> g = npattn.attention_backward(np.ones_like(out), res, dlse=np.zeros((1, 2)))
    >>> g.dv.tolist()
    [[[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]]
    """
    if not isinstance(residuals, (DenseResiduals, ChunkedResiduals)):
        raise TypeError(f"residuals must come from npattn.attention_forward, got {type(residuals).__name__}")
    spec = residuals.spec
    xp = spec.xp
    # dO in the dtype the path reads q in: the compute dtype, or float16 where the fused kernels keep it
    dout_c = check_cotangent(residuals, "dout", dout, tuple(residuals.out.shape), spec.dtype, into=residuals.q.dtype)
    dlse_c = None
    if dlse is not None:
        dlse_c = check_cotangent(residuals, "dlse", dlse, tuple(residuals.lse.shape), spec.compute_dtype)
    if isinstance(residuals, DenseResiduals):
        dq, dk, dv, dbias, params = dense_backward(
            spec, residuals.q, residuals.k, residuals.v, residuals.probs, residuals.out, dout_c, dlse_c
        )
    else:
        dq, dk, dv, dbias, params = _CHUNKED_KERNELS[residuals.kernel][1](
            spec, residuals.q, residuals.k, residuals.v, residuals.out, residuals.lse, dout_c, dlse_c
        )
    dsinks = sinks_grad(spec, dout_c, residuals.out, residuals.lse, dlse_c)  # a float16 dO promotes exactly
    dq, dk, dv = _in_dtype(xp, dq, spec.dtype), _in_dtype(xp, dk, spec.dtype), _in_dtype(xp, dv, spec.dtype)
    return AttentionGrads(
        dq,
        dk,
        dv,
        dbias=_in_dtype(xp, dbias, spec.bias_dtype),
        dsinks=_in_dtype(xp, dsinks, spec.sinks_dtype),
        dalibi_slopes=_in_dtype(xp, params.get("alibi_slopes"), spec.alibi_dtype),
        dmods=_mod_grads(spec, params["mods"]) if spec.score_mods else None,
    )


def _mod_grads(spec: AttentionSpec, grads: dict[str, Any]) -> dict[str, Any]:
    """The score modifications' parameter gradients, each in its parameter's dtype."""
    dtypes = {name: param.dtype for mod in spec.score_mods for name, param in mod.params.items()}
    return {name: spec.xp.astype(grad, dtypes[name], copy=False) for name, grad in grads.items()}


def _in_dtype(xp: Any, x: Any | None, dtype: Any) -> Any | None:
    """``x`` in ``dtype``: ``x`` itself when it has it already (the common
    case, without the namespace's ``astype`` wrapper), and None stays None."""
    return x if x is None or x.dtype == dtype else xp.astype(x, dtype)


#: :func:`plain_call_spec`'s answers by ``(dtypes, shapes, causal)``, which
#: alone decide them; emptied when it reaches :data:`PLAIN_CALL_CACHE_SIZE`
#: entries.
_PLAIN_CALLS: dict[tuple, AttentionSpec | None] = {}
PLAIN_CALL_CACHE_SIZE = 256


def plain_call_spec(q: Any, k: Any, v: Any, causal: bool = False) -> AttentionSpec | None:
    """:func:`~npattn.options.plain_spec` for a call with every option at
    its default but ``causal``, with the path chosen (:func:`choose_impl`)
    where the sizes alone choose it: dense, below
    :data:`~npattn.options.AUTO_FAST_MIN_SCORES` scores. Looked up by the
    arrays' dtypes and shapes and ``causal``, so a repeated small call (a
    decode step, a training step) skips both (1 µs against 7, or 17 with
    ``causal``: the per-call floor). A larger call's path is chosen per
    call, since ``NPATTN_FAST_NUMPY`` may change between calls. A causal
    call with ``T != S`` raises :func:`~npattn.options.make_spec`'s error
    (it needs ``align``), and nothing is kept.

    >>> import numpy as np
    >>> x = np.zeros((1, 2, 3, 4))
    >>> plain_call_spec(x, x, x).impl, plain_call_spec(x, x, x) is plain_call_spec(x, x, x)
    ('dense', True)
    >>> plain_call_spec(x, x, x, causal=True).window_right
    0
    >>> plain_call_spec(x, x, x.astype(np.float32)) is None  # make_spec's checks then apply
    True
    """
    arrays = plain_key(q, k, v)  # NumPy arrays only: None for any other type
    if arrays is None:
        return None
    key = (arrays, causal)
    try:
        return _PLAIN_CALLS[key]
    except KeyError:
        pass
    spec = plain_spec(q, k, v)
    if spec is not None and causal:
        spec = make_spec(q, k, v, causal=True)  # the inputs fit; causal's own checks
    if spec is not None and _scores(spec) < _fast_min_scores(spec):
        spec = choose_impl(spec)  # dense on any platform and setting
    if len(_PLAIN_CALLS) >= PLAIN_CALL_CACHE_SIZE:
        _PLAIN_CALLS.clear()
    _PLAIN_CALLS[key] = spec
    return spec


#: :func:`scalar_call_spec`'s answers by the arrays' types, dtypes, shapes
#: and devices and the options with their types; emptied when it reaches
#: :data:`SCALAR_CALL_CACHE_SIZE` entries.
_SCALAR_CALLS: dict[tuple, AttentionSpec] = {}
SCALAR_CALL_CACHE_SIZE = 256

#: The option types :func:`scalar_call_spec` keys on: values of these types
#: that compare equal are read alike by :func:`~npattn.options.make_spec`.
_PLAIN_SCALARS = frozenset((bool, int, float, str, type(None)))


def scalar_call_spec(q: Any, k: Any, v: Any, **options: Any) -> AttentionSpec:
    """``make_spec(q, k, v, **options)`` for options that are all plain
    scalars (bools, ints, floats, strings, None, tuples of them): a function
    of the arrays' types, dtypes, shapes and devices and of the options
    alone, so it is looked up where the same call was made before (a decode
    step's ``causal=True, align="bottom_right"``: 2 µs against 18 on
    NumPy, the most of the Python time a step spends before its kernel on
    CuPy). A call that differs from a kept one in the keys' count ``S``
    alone, as a decoding loop's next step does, takes that spec with
    ``S``'s fields made anew (:func:`~npattn.options.with_kv_len`). Other
    options, and inputs that are not arrays, go to
    :func:`~npattn.options.make_spec` (its checks and messages); a call it
    rejects is not kept.

    >>> import numpy as np
    >>> q, kv = np.zeros((1, 4, 1, 8)), np.zeros((1, 4, 100, 8))
    >>> spec = scalar_call_spec(q, kv, kv, causal=True, align="bottom_right")
    >>> spec is scalar_call_spec(q.copy(), kv, kv, causal=True, align="bottom_right"), spec.q_offset
    (True, 99)
    """
    key = _scalar_call_key(q, k, v, options)
    try:
        spec = _SCALAR_CALLS.get(key) if key is not None else None
    except TypeError:  # a device that cannot be hashed
        key = spec = None
    if spec is not None:  # handed out again: it recurs
        RECURRING_SPECS.values(spec)
        return spec
    family = None
    if key is not None:
        family = _kv_len_family(key)
        if family is not None:
            spec = _spec_of_another_kv_len(family, key[1][1][-2], options)  # k's shape's S
    if spec is None:
        spec = make_spec(q, k, v, **options)
    if key is not None:
        if len(_SCALAR_CALLS) >= SCALAR_CALL_CACHE_SIZE:
            _SCALAR_CALLS.clear()
            _KV_LEN_FAMILIES.clear()
        _SCALAR_CALLS[key] = spec
        if family is not None:
            _KV_LEN_FAMILIES[family] = spec
    return spec


#: The latest spec :func:`scalar_call_spec` made of each call but for its
#: key count ``S`` (:func:`_kv_len_family`): a decode loop's cache grows by
#: a token a step, so its calls' keys differ in ``S`` alone.
_KV_LEN_FAMILIES: dict[tuple, AttentionSpec] = {}


def _kv_len_family(key: tuple) -> tuple | None:
    """A :func:`_scalar_call_key` with ``k``'s and ``v``'s key count ``S``
    (their shapes' axis -2) left out, or None where they do not share one
    (make_spec's error then)."""
    arrays, (q_shape, k_shape, v_shape), values = key
    if min(len(k_shape), len(v_shape)) < 2 or k_shape[-2] != v_shape[-2]:
        return None
    return arrays, (q_shape, k_shape[:-2] + k_shape[-1:], v_shape[:-2] + v_shape[-1:]), values


def _spec_of_another_kv_len(family: tuple, kv_len: int, options: dict[str, Any]) -> AttentionSpec | None:
    """The spec of a call of ``kv_len`` keys in :func:`_kv_len_family`
    ``family``, from the one :func:`scalar_call_spec` made before
    (:func:`~npattn.options.with_kv_len`), or None."""
    template = _KV_LEN_FAMILIES.get(family)
    if template is None or kv_len < 1:  # S = 0: make_spec's error
        return None
    return with_kv_len(template, kv_len, options.get("causal", False), options.get("window"), options.get("align"))


def _scalar_call_key(q: Any, k: Any, v: Any, options: dict[str, Any]) -> tuple | None:
    """:func:`scalar_call_spec`'s key, or None where the call is not one it keeps."""
    values: list[Any] = list(options)  # the names, in the caller's fixed order
    for value in options.values():
        kind = type(value)
        if kind is tuple:
            kinds = tuple(type(part) for part in value)
            if not set(kinds) <= _PLAIN_SCALARS:
                return None
            values += (kinds, value)
        elif kind in _PLAIN_SCALARS:
            values += (kind, value)
        else:
            return None
    try:
        devices = (_device_key(q), _device_key(k), _device_key(v))
        arrays = (type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, *devices)
        shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape))
    except (AttributeError, TypeError):  # not arrays: make_spec says so
        return None
    return arrays, shapes, tuple(values)


def _device_key(x: Any) -> Any:
    """``x``'s device as a key: CuPy's ``Device`` by its id."""
    device = array_device(x)
    return getattr(device, "id", device)


def _scores(spec: AttentionSpec) -> int:
    """Entries of the dense score tensor ``(..., N, T, S)``."""
    return spec.num_batch * spec.num_heads * spec.q_len * spec.kv_len


def _fast_min_scores(spec: AttentionSpec) -> int:
    """Scores from which ``"auto"`` takes the NumPy fast path: more with
    score modifications, whose items hold one kv head each; fewer with a
    softcap, ALiBi or dropout, whose dense path makes passes of its own."""
    if spec.score_mods:
        return AUTO_FAST_SINGLE_HEAD_MIN_SCORES
    if spec.softcap is not None or spec.alibi_slopes is not None or spec.dropout_p:
        return AUTO_FAST_VARIANT_MIN_SCORES
    return AUTO_FAST_MIN_SCORES


def choose_impl(spec: AttentionSpec, *, fused_cupy: bool = True) -> AttentionSpec:
    """``spec`` with ``impl="auto"`` resolved to the path that runs it; a
    forced ``"dense"`` or ``"chunked"`` is returned as is.

    Chunked once the dense score tensor ``(..., N, T, S)`` would hold more
    than :data:`~npattn.options.AUTO_CHUNKED_MIN_SCORES` entries, or where the
    NumPy fast path takes the inputs and they reach
    :data:`~npattn.options.AUTO_FAST_MIN_SCORES` (or
    :data:`~npattn.options.AUTO_FAST_VARIANT_MIN_SCORES` with a softcap,
    ALiBi or dropout, :data:`~npattn.options.AUTO_FAST_SINGLE_HEAD_MIN_SCORES`
    with score modifications), or, with ``fused_cupy``, wherever the CuPy
    fused kernels run the call (:func:`npattn.fast_cupy.preferred`: a
    launch or three against the dense path's dozen array operations; on an
    H100 they took 0.12-0.74x its time from T=S=16 up and in decode steps);
    dense otherwise. Callers whose computation has no fused kernel (the
    forward-mode JVP) pass ``fused_cupy=False``.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 8))
    >>> spec = make_spec(x, x, x)
    >>> spec.impl, choose_impl(spec).impl, choose_impl(make_spec(x[..., :10, :], x, x)).impl
    ('auto', 'chunked', 'dense')
    """
    if spec.impl != "auto":
        return spec
    return _resolved(spec, chunked_kernel(spec), fused_cupy)


def _resolved(spec: AttentionSpec, kernel: str, fused_cupy: bool = True) -> AttentionSpec:
    """:func:`choose_impl` for an ``impl="auto"`` spec whose
    :func:`chunked_kernel` is ``kernel`` (:func:`forward_from_spec` asks it
    once for both). A spec that recurs
    (:data:`~npattn.options.RECURRING_SPECS`) resolves to the same spec
    each time, which recurs too, so that the fused path's launch plans kept
    by spec are found (0.3 µs a lookup where making the spec takes 1.5)."""
    kept = RECURRING_SPECS.get(spec)
    resolved = None if kept is None else kept.get((kernel, fused_cupy))
    if resolved is None:
        scores = _scores(spec)
        large = scores > AUTO_CHUNKED_MIN_SCORES
        fast = kernel == "numpy" and scores >= _fast_min_scores(spec)
        fused = fused_cupy and kernel == "cupy"
        resolved = spec.replace(impl="chunked" if large or fast or fused else "dense")
        if kept is not None:
            kept[(kernel, fused_cupy)] = resolved
            RECURRING_SPECS.values(resolved)
    return resolved


def chunked_kernel(spec: AttentionSpec) -> str:
    """The chunked kernel a forward with ``spec`` runs: ``"numpy"`` or
    ``"cupy"`` (the fast paths) for NumPy or CuPy inputs they support, else
    ``"generic"``."""
    if fast_numpy.supports(spec):
        return "numpy"
    return "cupy" if fast_cupy.preferred(spec) else "generic"


#: ``(forward, backward)`` of the chunked path by kernel name: the generic
#: Array API path, and the fast paths chosen for NumPy and CuPy inputs.
_CHUNKED_KERNELS = {
    "generic": (chunked_forward, chunked_backward),
    "numpy": (fast_numpy.forward, fast_numpy.backward),
    "cupy": (fast_cupy.forward, fast_cupy.backward),
}


def inputs_in_compute_dtype(residuals: AttentionResiduals) -> tuple[Any, Any, Any]:
    """The residuals' ``q``, ``k``, ``v`` in the compute dtype: themselves,
    or a cast where the CuPy fast path kept float16 inputs as they are."""
    xp, dtype = residuals.spec.xp, residuals.spec.compute_dtype
    return _in_dtype(xp, residuals.q, dtype), _in_dtype(xp, residuals.k, dtype), _in_dtype(xp, residuals.v, dtype)


def check_cotangent(
    residuals: AttentionResiduals, name: str, g: Any, shape: tuple, dtype: Any, into: Any = None
) -> Any:
    """Check a cotangent against the forward's output; return it in ``into``
    (default: the compute dtype)."""
    spec = residuals.spec
    if g is None:
        raise TypeError(f"{name} must be an array of the forward's output shape {shape}, got None")
    resolve_namespace({"the forward's inputs": residuals.q, name: g})
    if tuple(g.shape) != shape:
        raise ValueError(f"{name} must have the forward's shape {shape}, got {tuple(g.shape)}")
    if g.dtype != dtype:
        raise TypeError(
            f"{name} must have dtype {dtype} (as the forward's {'lse' if name == 'dlse' else 'output'}), got {g.dtype}"
        )
    return _in_dtype(spec.xp, g, spec.compute_dtype if into is None else into)


def attention(q, k, v, /, **options):
    """Forward only: ``attention_forward(q, k, v, **options)[0]``.

    Takes the same keyword options as :func:`attention_forward`.

    >>> import numpy as np, npattn
    >>> x = np.zeros((1, 3, 4))
    >>> npattn.attention(x, x, x + 1.0).tolist()[0][0]
    [1.0, 1.0, 1.0, 1.0]
    """
    out, _ = attention_forward(q, k, v, **options)
    return out
