"""Bad input across the whole public API (issue 7).

One table, ``CASES``: each row is an invalid input class, the call that makes
it, and the exception type and message fragment it must produce. The message
must name the offending argument; no row may leak an IndexError,
AttributeError, ZeroDivisionError, OverflowError or a broadcasting error from
deep inside. ``tests/test_attention_bad_input.py`` already covers the basic
attention_forward/backward rows; this table covers everything else and the
combinations that one lacks.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

import npattn

RNG = np.random.default_rng(7)
Q = RNG.standard_normal((2, 4, 3, 5))  # (B, N, T, H)
K = RNG.standard_normal((2, 2, 6, 5))  # (B, K, S, H)
V = RNG.standard_normal((2, 2, 6, 7))  # (B, K, S, Hv)
Q_SQUARE = RNG.standard_normal((2, 4, 6, 5))  # T == S


# Each row: (id, thunk that makes the bad call, exception type, message fragment).
CASES: list[tuple[str, object, type, str]] = []


def case(name: str, error: type, fragment: str):
    """Register the decorated thunk as one row of the table."""

    def register(thunk):
        CASES.append((name, thunk, error, fragment))
        return thunk

    return register


# --- attention_forward: arguments that are missing ----------------------------


@case("forward: k is None", TypeError, "k must be an array, got None")
def _():
    npattn.attention_forward(Q, None, V)


@case("forward: q is None", TypeError, "q must be an array, got None")
def _():
    npattn.attention_forward(None, K, V)


@case("forward: v is None (chunked)", TypeError, "v must be an array, got None")
def _():
    npattn.attention_forward(Q, K, None, impl="chunked")


# --- attention_backward: cotangents that do not fit the residuals --------------


def _forward(*args, **options):
    args = args or (Q, K, V)
    return npattn.attention_forward(*args, **options)


@case("backward: dout is None (dense)", TypeError, "dout must be an array of the forward's output shape")
def _():
    npattn.attention_backward(None, _forward()[1])


@case("backward: dout is None (chunked)", TypeError, "dout must be an array")
def _():
    npattn.attention_backward(None, _forward(impl="chunked")[1])


# --- the multi-head layer -----------------------------------------------------------

PARAMS = npattn.mha_init(8, 2, num_kv_heads=1)  # E=8, N=2, K=1, H=4
X = RNG.standard_normal((2, 5, 8))  # (B, T, E)


def _mha(*args, **options):
    options.setdefault("num_heads", 2)
    return npattn.mha_forward(*(args or (PARAMS, X)), **options)


@case("mha backward: dy is None", TypeError, "dy must be an array of y's shape (2, 5, 8)")
def _():
    npattn.mha_backward(None, _mha()[1])


EMPTY_LAYER = {
    "q_weight": np.zeros((0, 0)),
    "k_weight": np.zeros((4, 0)),
    "v_weight": np.zeros((4, 0)),
    "out_weight": np.zeros((0, 0)),
}


@case("mha params: embed_dim 0 (ZeroDivisionError before)", ValueError, "with embed_dim >= 1, got (0, 0)")
def _():
    _mha(EMPTY_LAYER, np.zeros((2, 5, 0)))


@case("mha_params_from_torch: embed_dim 0 (ZeroDivisionError before)", ValueError, "embed_dim >= 1")
def _():
    npattn.mha_params_from_torch(
        {
            "q_proj_weight": EMPTY_LAYER["q_weight"],
            "k_proj_weight": EMPTY_LAYER["k_weight"],
            "v_proj_weight": EMPTY_LAYER["v_weight"],
            "out_proj.weight": np.zeros((0, 0)),
        },
        2,
    )


@case(
    "mha cache: of another library (misleading dtype message before)",
    TypeError,
    "x and cache come from different array libraries (numpy and array_api_strict)",
)
def _():
    _mha(PARAMS, X[:, :1], cache=npattn.KVCache(2, 1, 4, xp=_xps()), causal=True)


@case("mha cache: on another device (named an internal 'k' before)", ValueError, "x and cache are on different devices")
def _():
    xps = _xps()
    params = {name: _strict(a) for name, a in PARAMS.items()}
    cache = npattn.KVCache(2, 1, 4, xp=xps, device=xps.Device("device1"))
    _mha(params, _strict(X[:, :1]), cache=cache, causal=True)


@case("mha: need_weights not a bool (silently truthy before)", TypeError, "need_weights must be a bool, got 'no'")
def _():
    _mha(need_weights="no")


@case("mha_init: xp is a string (AttributeError before)", TypeError, "xp must be an Array API namespace")
def _():
    npattn.mha_init(8, 2, xp="numpy")


@case("mha_init: dtype given as a string", TypeError, "dtype must be a real floating dtype of array_api_compat.numpy")
def _():
    npattn.mha_init(8, 2, dtype="float32")


@case("mha_init: integer dtype", TypeError, "dtype must be a real floating dtype")
def _():
    npattn.mha_init(8, 2, dtype=np.int32)


@case("KVCache: xp is a string (AttributeError before)", TypeError, "xp must be an Array API namespace")
def _():
    npattn.KVCache(2, 1, 4, xp="np")


@case("KVCache: dtype of another library", TypeError, "dtype must be a real floating dtype of array_api_strict")
def _():
    npattn.KVCache(2, 1, 4, xp=_xps(), dtype=np.float32)


@case("KVCache.append: None (AttributeError before)", TypeError, "k must be an array of shape (B, K, t, H), got None")
def _():
    npattn.KVCache(2, 1, 4).append(None, None)


@case("KVCache.append: v is None", TypeError, "v must be an array")
def _():
    npattn.KVCache(2, 1, 4, max_length=3).append(np.zeros((2, 1, 1, 4)), None)


# --- check_gradients ------------------------------------------------------------------

XG = np.linspace(0.0, 1.0, 5)


def _sin_forward(x):
    return np.sin(x), x


def _sin_backward(dy, x):
    return (dy * np.cos(x),)


def _gradcheck(inputs=None, forward=_sin_forward, backward=_sin_backward, **options):
    return npattn.check_gradients(forward, backward, [XG] if inputs is None else inputs, **options)


@case("check_gradients: eps=0 (ZeroDivisionError before)", ValueError, "eps must be > 0, got 0")
def _():
    _gradcheck(eps=0)


@case("check_gradients: eps nan", TypeError, "eps must be a finite real number, got nan")
def _():
    _gradcheck(eps=float("nan"))


@case("check_gradients: atol negative (every check failed before)", ValueError, "atol must be >= 0, got -1")
def _():
    _gradcheck(atol=-1)


@case("check_gradients: rtol a string", TypeError, "rtol must be a finite real number, got 'a'")
def _():
    _gradcheck(rtol="a")


@case(
    "check_gradients: inputs one array, not a list (rows became inputs)",
    TypeError,
    "inputs must be a list or tuple of arrays, one per argument of forward, got ndarray",
)
def _():
    _gradcheck(inputs=XG)


@case("check_gradients: no floating input (vacuous pass before)", ValueError, "nothing to check")
def _():
    _gradcheck(inputs=[np.arange(3)])


@case("check_gradients: wrt holds a name", TypeError, "wrt must hold int indices into inputs, got 'x'")
def _():
    _gradcheck(wrt=["x"])


@case("check_gradients: wrt an int", TypeError, "wrt must be a list or tuple of input indices, got int")
def _():
    _gradcheck(wrt=0)


@case("check_gradients: forward not callable", TypeError, "forward must be callable, got int")
def _():
    _gradcheck(forward=1)


@case("check_gradients: forward returns no residuals", TypeError, "forward must return a pair (outputs, residuals)")
def _():
    _gradcheck(forward=np.sin)


@case(
    "check_gradients: integer output (broadcast error before)", TypeError, "forward's output 0 must be a real floating"
)
def _():
    _gradcheck(forward=lambda x: (np.arange(3), x))


@case("check_gradients: jacobian='yes'", TypeError, "jacobian must be True, False or 'auto', got 'yes'")
def _():
    _gradcheck(jacobian="yes")


@case("check_gradients: seed a string", TypeError, "seed must be an int, got 'a'")
def _():
    _gradcheck(seed="a")


@case("check_gradients: max_jacobian_elements negative", ValueError, "max_jacobian_elements must be >= 0")
def _():
    _gradcheck(max_jacobian_elements=-1)


@case("check_gradients: names a string", TypeError, "names must be a list or tuple of str, got str")
def _():
    _gradcheck(names="x")


# --- diagnostics ------------------------------------------------------------------------

WEIGHTS = np.full((2, 3, 4), 0.25)  # (N, T, S)


@case("row_sum_check: atol a string (numpy UFuncTypeError before)", TypeError, "atol must be a finite real number")
def _():
    npattn.row_sum_check(WEIGHTS, atol="a")


@case("row_sum_check: atol negative (every row failed before)", ValueError, "atol must be >= 0.0, got -1.0")
def _():
    npattn.row_sum_check(WEIGHTS, atol=-1.0)


@case("row_sum_check: atol nan", TypeError, "atol must be a finite real number, got nan")
def _():
    npattn.row_sum_check(WEIGHTS, atol=float("nan"))


@case("row_sum_check: max_listed a float", TypeError, "max_listed must be an int, got 1.5")
def _():
    npattn.row_sum_check(WEIGHTS, max_listed=1.5)


@case("row_sum_check: max_listed negative", ValueError, "max_listed must be >= 0")
def _():
    npattn.row_sum_check(WEIGHTS, max_listed=-1)


@case("summarize: peak_warning a string", TypeError, "peak_warning must be a finite real number, got 'high'")
def _():
    npattn.summarize(WEIGHTS, peak_warning="high")


@case("summarize: atol a string", TypeError, "atol must be a finite real number")
def _():
    npattn.summarize(WEIGHTS, atol="a")


@case("check_finite: allow_neginf an int", TypeError, "allow_neginf must be a name or an iterable of names, got 3")
def _():
    npattn.check_finite({"lse": WEIGHTS}, allow_neginf=3)


@case("plot_attention: no heads (ZeroDivisionError before)", ValueError, "weights has no heads to draw")
def _(tmp="/nonexistent-dir/attn.png"):
    npattn.plot_attention(np.zeros((0, 2, 3)), path=tmp)


@case("plot_attention: dpi a string", ValueError, "dpi must be a positive number, got 'high'")
def _():
    npattn.plot_attention(WEIGHTS, path="/nonexistent-dir/attn.png", dpi="high")


@case("plot_attention: vmin a string", TypeError, "vmin must be a finite real number, got 'a'")
def _():
    npattn.plot_attention(WEIGHTS, path="/nonexistent-dir/attn.png", vmin="a")


@case(
    "plot_attention: unknown cmap (KeyError before)", ValueError, "cmap must name a matplotlib colour map, got 'nope'"
)
def _():
    pytest.importorskip("matplotlib")
    npattn.plot_attention(WEIGHTS, path="/nonexistent-dir/attn.png", cmap="nope")


# --- PyTorch interop -------------------------------------------------------------------------


@case(
    "mha_masks_from_torch: masks disagree on S (numpy broadcast error before)",
    ValueError,
    "key_padding_mask and attn_mask must agree on S (last axis), got 4 and 3",
)
def _():
    npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 4), bool), attn_mask=np.zeros((3, 3), bool))


@case("mha_masks_from_torch: bool padding vs float attn_mask disagree on S", ValueError, "must agree on S")
def _():
    npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 4), bool), attn_mask=np.zeros((3, 3)))


@case(
    "mha_masks_from_torch: 3-D attn_mask for another batch size",
    ValueError,
    "attn_mask's first axis (6) must be B * num_heads with B=2 from key_padding_mask and num_heads=2",
)
def _():
    npattn.mha_masks_from_torch(
        key_padding_mask=np.zeros((2, 3), bool), attn_mask=np.zeros((6, 3, 3), bool), num_heads=2
    )


@case("mha_masks_from_torch: num_heads 0 (TypeError before)", ValueError, "num_heads must be >= 1, got 0")
def _():
    npattn.mha_masks_from_torch(attn_mask=np.zeros((4, 3, 3), bool), num_heads=0)


def test_mha_masks_from_torch_takes_numpy_integer_num_heads():
    """num_heads=np.int64(2) was a TypeError ('must be an int >= 1') before."""
    attn_mask = RNG.random((4, 3, 3)) < 0.5
    got = npattn.mha_masks_from_torch(attn_mask=attn_mask, num_heads=np.int64(2))[0]
    np.testing.assert_array_equal(got, npattn.mha_masks_from_torch(attn_mask=attn_mask, num_heads=2)[0])


# --- merge_partials ---------------------------------------------------------------

O_PART = RNG.standard_normal((2, 3, 4))  # (..., T, Hv)
L_PART = RNG.standard_normal((2, 3))  # (..., T)


def _merged():
    return npattn.merge_partials([O_PART, O_PART], [L_PART, L_PART])


@case("merge backward: dout is None", TypeError, "dout must be an array of the merged out's shape (2, 3, 4)")
def _():
    npattn.merge_partials_backward(None, None, _merged()[2])


# --- namespaces: xp that is not one, or not the arrays' ------------------------


def _strict(a, device=None):
    xps = pytest.importorskip("array_api_strict")
    return xps.asarray(a, device=xps.Device(device)) if device else xps.asarray(a)


def _xps():
    return pytest.importorskip("array_api_strict")


@case("forward: xp is a string", TypeError, "xp must be an Array API namespace")
def _():
    npattn.attention_forward(Q, K, V, xp="numpy")


@case("forward: xp of another library than the arrays", TypeError, "xp is array_api_strict, but q is an array of numpy")
def _():
    npattn.attention_forward(Q, K, V, xp=_xps())


@case("forward: strict arrays, xp=numpy", TypeError, "xp is numpy, but q is an array of array_api_strict")
def _():
    npattn.attention_forward(_strict(Q), _strict(K), _strict(V), xp=np)


@case("merge_partials: xp of another library", TypeError, "xp is array_api_strict, but outs[0]")
def _():
    npattn.merge_partials([V], [V[..., 0]], xp=_xps())


@case("diagnostics: xp is a string", TypeError, "xp must be an Array API namespace")
def _():
    npattn.attention_entropy(np.full((2, 2), 0.5), xp="np")


@case("mha_masks_from_torch: xp of another library", TypeError, "xp is array_api_strict, but key_padding_mask")
def _():
    npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 3), bool), xp=_xps())


# --- options out of range -----------------------------------------------------


@case("forward: scale beyond float32 (NaN before)", ValueError, "scale=1e+39 overflows the compute dtype float32")
def _():
    f32 = [a.astype(np.float32) for a in (Q, K, V)]
    npattn.attention_forward(*f32, scale=1e39)


@case("forward: scale beyond float32, float16 inputs, chunked", ValueError, "scale=-1e+300 overflows")
def _():
    f16 = [a.astype(np.float16) for a in (Q, K, V)]
    npattn.attention_forward(*f16, scale=-1e300, impl="chunked")


# --- huge but valid options ---------------------------------------------------


@pytest.mark.parametrize("impl", ["dense", "chunked"])
@pytest.mark.parametrize(
    "window, align, lengths",
    [
        ((2**63, 0), "top_left", False),
        ((10**30, 10**30), "bottom_right", False),
        ((0, 2**64), "bottom_right", True),
    ],
)
def test_window_wider_than_any_int64_is_unbounded(impl, window, align, lengths):
    """A window side of 2**63 or more overflowed int64 in the index arithmetic
    (OverflowError from deep inside); any side >= T + S hides nothing."""
    kv_lengths = np.array([3, 6]) if lengths else None
    unbounded = (None if window[0] > 10 else window[0], None if window[1] > 10 else window[1])
    got = npattn.attention(Q, K, V, window=window, align=align, kv_lengths=kv_lengths, impl=impl)
    want = npattn.attention(Q, K, V, window=unbounded, align=align, kv_lengths=kv_lengths, impl=impl)
    np.testing.assert_array_equal(got, want)


# --- compact rows: every other public function and the combinations ------------------


def rows(*entries):
    """Register ``(name, error, fragment, thunk)`` rows."""
    for name, error, fragment, thunk in entries:
        CASES.append((name, thunk, error, fragment))


def _f16(*arrays):
    return [a.astype(np.float16) for a in arrays]


def _res(**options):
    return _forward(**options)[1]


def _res16(impl="dense"):
    return _forward(*_f16(Q, K, V), impl=impl)[1]


OUT_SHAPE = (2, 4, 3, 7)  # (B, N, T, Hv)
LSE_SHAPE = (2, 4, 3)

rows(
    # attention_forward: combinations the basic table lacks
    (
        "forward: float16 q with float32 k and v",
        TypeError,
        "q, k and v must share one dtype, got float16",
        lambda: npattn.attention_forward(Q.astype(np.float16), K.astype(np.float32), V.astype(np.float32)),
    ),
    (
        "forward: complex q",
        TypeError,
        "q must have a real floating dtype, got complex128",
        lambda: npattn.attention_forward(Q.astype(complex), K.astype(complex), V.astype(complex)),
    ),
    (
        "forward: object q",
        TypeError,
        "q must have a real floating dtype, got object",
        lambda: npattn.attention_forward(Q.astype(object), K, V),
    ),
    ("forward: q a string", TypeError, "q must be an array", lambda: npattn.attention_forward("q", K, V)),
    (
        "forward: bias of another library",
        TypeError,
        "q and bias come from different array libraries",
        lambda: npattn.attention_forward(Q, K, V, bias=_strict(np.zeros((3, 6)))),
    ),
    (
        "forward: mask on another device",
        ValueError,
        "q and mask are on different devices",
        lambda: npattn.attention_forward(
            _strict(Q), _strict(K), _strict(V), mask=_strict(np.ones((3, 6), bool), "device1")
        ),
    ),
    (
        "forward: kv_lengths on another device",
        ValueError,
        "q and kv_lengths are on different devices",
        lambda: npattn.attention_forward(
            _strict(Q), _strict(K), _strict(V), kv_lengths=_strict(np.array([6, 6]), "device1")
        ),
    ),
    (
        "forward: kv_lengths of another library",
        TypeError,
        "q and kv_lengths come from different array libraries",
        lambda: npattn.attention_forward(Q, K, V, kv_lengths=_strict(np.array([6, 6]))),
    ),
    (
        "forward: kv_lengths bool",
        TypeError,
        "kv_lengths must have an integer dtype, got bool",
        lambda: npattn.attention_forward(Q, K, V, kv_lengths=np.array([True, False])),
    ),
    (
        "forward: q_lengths a list",
        TypeError,
        "q_lengths must be an integer array of shape (2,), got list",
        lambda: npattn.attention_forward(Q, K, V, q_lengths=[1, 2]),
    ),
    (
        "forward: q_lengths a float for 3-D inputs",
        TypeError,
        "q_lengths must be an integer array of shape ()",
        lambda: npattn.attention_forward(Q[0], K[0], V[0], q_lengths=2.0),
    ),
    (
        "forward: kv_lengths beyond int64 (uint64)",
        ValueError,
        "kv_lengths must lie in [0, 6]",
        lambda: npattn.attention_forward(Q, K, V, kv_lengths=np.array([2**63 + 5, 1], np.uint64)),
    ),
    (
        "forward: lengths too long with causal bottom_right",
        ValueError,
        "q_lengths must lie in [0, 3]",
        lambda: npattn.attention_forward(Q, K, V, causal=True, align="bottom_right", q_lengths=np.array([4, 1])),
    ),
    (
        "forward: window an array",
        TypeError,
        "window must be a pair",
        lambda: npattn.attention_forward(Q_SQUARE, K, V, window=np.array([1, 2])),
    ),
    (
        "forward: window of bools",
        TypeError,
        "window[0] (left) must be an int or None, got True",
        lambda: npattn.attention_forward(Q_SQUARE, K, V, window=(True, 0)),
    ),
    (
        "forward: window right negative, causal too",
        ValueError,
        "window[1] (right) must be >= 0",
        lambda: npattn.attention_forward(Q_SQUARE, K, V, window=(2, -1), causal=True),
    ),
    (
        "forward: window with T != S and no align",
        ValueError,
        "needs an explicit alignment",
        lambda: npattn.attention_forward(Q, K, V, window=(None, 2)),
    ),
    (
        "forward: seed a float with dropout",
        TypeError,
        "seed must be an int, got 1.0",
        lambda: npattn.attention_forward(Q, K, V, dropout_p=0.1, seed=1.0),
    ),
    (
        "forward: seed negative without dropout",
        ValueError,
        "seed must be >= 0",
        lambda: npattn.attention_forward(Q, K, V, seed=-1),
    ),
    (
        "forward: dropout_p a string",
        TypeError,
        "dropout_p must be a float in [0, 1), got '0.1'",
        lambda: npattn.attention_forward(Q, K, V, dropout_p="0.1", seed=0),
    ),
    (
        "forward: dropout_p nan",
        ValueError,
        "dropout_p must lie in [0, 1), got nan",
        lambda: npattn.attention_forward(Q, K, V, dropout_p=float("nan"), seed=0),
    ),
    (
        "forward: dropout_p True",
        TypeError,
        "dropout_p must be a float",
        lambda: npattn.attention_forward(Q, K, V, dropout_p=True, seed=0),
    ),
    (
        "forward: scale a string",
        TypeError,
        "scale must be a finite real number or None, got '1'",
        lambda: npattn.attention_forward(Q, K, V, scale="1"),
    ),
    (
        "forward: scale a 0-d array",
        TypeError,
        "scale must be a finite real number or None",
        lambda: npattn.attention_forward(Q, K, V, scale=np.array(0.5)),
    ),
    (
        "forward: scale inf (chunked)",
        TypeError,
        "scale must be a finite real number",
        lambda: npattn.attention_forward(Q, K, V, scale=float("inf"), impl="chunked"),
    ),
    (
        "forward: block_k a float",
        TypeError,
        "block_k must be an int or None, got 8.0",
        lambda: npattn.attention_forward(Q, K, V, impl="chunked", block_k=8.0),
    ),
    (
        "forward: block_q True",
        TypeError,
        "block_q must be an int or None, got True",
        lambda: npattn.attention_forward(Q, K, V, impl="chunked", block_q=True),
    ),
    (
        "forward: block_k negative with dense",
        ValueError,
        "block_k must be >= 1",
        lambda: npattn.attention_forward(Q, K, V, impl="dense", block_k=-4),
    ),
    ("forward: impl None", ValueError, "impl must be one of", lambda: npattn.attention_forward(Q, K, V, impl=None)),
    (
        "forward: align bottom-right spelled wrong",
        ValueError,
        "align must be one of",
        lambda: npattn.attention_forward(Q, K, V, causal=True, align="bottom-right"),
    ),
    (
        "forward: float16 mask",
        TypeError,
        "mask must be a bool array",
        lambda: npattn.attention_forward(Q, K, V, mask=np.ones((3, 6), np.float16)),
    ),
    (
        "forward: mask for another batch size",
        ValueError,
        "mask of shape (3, 4, 3, 6) does not broadcast",
        lambda: npattn.attention_forward(Q, K, V, mask=np.ones((3, 4, 3, 6), bool)),
    ),
    (
        "forward: bias for another number of heads",
        ValueError,
        "bias of shape (3, 3, 6) does not broadcast",
        lambda: npattn.attention_forward(Q, K, V, bias=np.zeros((3, 3, 6))),
    ),
    (
        "forward: GQA heads do not divide (MQA-like K=3)",
        ValueError,
        "N=4 must be a multiple of",
        lambda: npattn.attention_forward(Q, np.ones((2, 3, 6, 5)), np.ones((2, 3, 6, 7))),
    ),
    # attention_backward: residuals used with the wrong cotangents, both paths
    (
        "backward: dout of the wrong shape (chunked)",
        ValueError,
        "dout must have the forward's shape (2, 4, 3, 7)",
        lambda: npattn.attention_backward(np.zeros((2, 4, 3, 6)), _res(impl="chunked")),
    ),
    (
        "backward: dout transposed",
        ValueError,
        "dout must have the forward's shape",
        lambda: npattn.attention_backward(np.zeros((2, 4, 7, 3)), _res()),
    ),
    (
        "backward: dout float32 for a float64 forward (chunked)",
        TypeError,
        "dout must have dtype float64",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE, np.float32), _res(impl="chunked")),
    ),
    (
        "backward: dout float32 for a float16 forward",
        TypeError,
        "dout must have dtype float16",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE, np.float32), _res16()),
    ),
    (
        "backward: dout integer",
        TypeError,
        "dout must have dtype float64",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE, np.int64), _res()),
    ),
    (
        "backward: dout a list",
        TypeError,
        "dout must be an array of an Array API library",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE).tolist(), _res()),
    ),
    (
        "backward: dout of another library (chunked)",
        TypeError,
        "come from different array libraries",
        lambda: npattn.attention_backward(_strict(np.zeros(OUT_SHAPE)), _res(impl="chunked")),
    ),
    (
        "backward: dout on another device",
        ValueError,
        "the forward's inputs and dout are on different devices",
        lambda: npattn.attention_backward(
            _strict(np.zeros(OUT_SHAPE), "device1"), _forward(_strict(Q), _strict(K), _strict(V))[1]
        ),
    ),
    (
        "backward: dlse float16 for a float16 forward (lse is float32)",
        TypeError,
        "dlse must have dtype float32",
        lambda: npattn.attention_backward(
            np.zeros(OUT_SHAPE, np.float16), _res16("chunked"), dlse=np.zeros(LSE_SHAPE, np.float16)
        ),
    ),
    (
        "backward: dlse of another library",
        TypeError,
        "the forward's inputs and dlse come from different",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE), _res(), dlse=_strict(np.zeros(LSE_SHAPE))),
    ),
    (
        "backward: dlse a list",
        TypeError,
        "dlse must be an array",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE), _res(), dlse=[0.0]),
    ),
    (
        "backward: dlse with the out's shape",
        ValueError,
        "dlse must have the forward's shape (2, 4, 3)",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE), _res(impl="chunked"), dlse=np.zeros(OUT_SHAPE)),
    ),
    (
        "backward: residuals None",
        TypeError,
        "residuals must come from npattn.attention_forward, got NoneType",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE), None),
    ),
    (
        "backward: residuals of the MHA layer",
        TypeError,
        "residuals must come from npattn.attention_forward, got MHAResiduals",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE), _mha()[1]),
    ),
    (
        "backward: residuals of merge_partials",
        TypeError,
        "got MergeResiduals",
        lambda: npattn.attention_backward(np.zeros(OUT_SHAPE), _merged()[2]),
    ),
    # the multi-head layer: params
    (
        "mha params: not a dict",
        TypeError,
        "params must be a dict of arrays as made by npattn.mha_init, got list",
        lambda: _mha([PARAMS["q_weight"]], X),
    ),
    ("mha params: None", TypeError, "params must be a dict of arrays", lambda: _mha(None, X)),
    (
        "mha params: missing weight",
        ValueError,
        "params is missing ['v_weight']",
        lambda: _mha({k: a for k, a in PARAMS.items() if k != "v_weight"}, X),
    ),
    (
        "mha params: unknown key (PyTorch's name)",
        ValueError,
        "params has unknown keys ['in_proj_weight']",
        lambda: _mha({**PARAMS, "in_proj_weight": PARAMS["q_weight"]}, X),
    ),
    ("mha params: non-str key", ValueError, "params has unknown keys [3]", lambda: _mha({**PARAMS, 3: X}, X)),
    (
        "mha params: value None",
        TypeError,
        "params['q_bias'] must be an array, got NoneType",
        lambda: _mha({**PARAMS, "q_bias": None}, X),
    ),
    (
        "mha params: value a list",
        TypeError,
        "params['out_bias'] must be an array, got list",
        lambda: _mha({**PARAMS, "out_bias": [0.0] * 8}, X),
    ),
    (
        "mha params: q_weight not square",
        ValueError,
        "params['q_weight'] must have shape (embed_dim, embed_dim)",
        lambda: _mha({**PARAMS, "q_weight": np.zeros((8, 6))}, X),
    ),
    (
        "mha params: q_weight 3-D",
        ValueError,
        "params['q_weight'] must have shape",
        lambda: _mha({**PARAMS, "q_weight": np.zeros((8, 8, 1))}, X),
    ),
    (
        "mha params: k_weight rows not a multiple of head_dim",
        ValueError,
        "params['k_weight'] must have shape",
        lambda: _mha({**PARAMS, "k_weight": np.zeros((6, 8)), "k_bias": np.zeros(6)}, X),
    ),
    (
        "mha params: v_weight rows unlike k_weight's",
        ValueError,
        "params['v_weight'] must have shape (4, vdim)",
        lambda: _mha({**PARAMS, "v_weight": np.zeros((8, 8))}, X),
    ),
    (
        "mha params: out_weight shape",
        ValueError,
        "params['out_weight'] must have shape (8, 8)",
        lambda: _mha({**PARAMS, "out_weight": np.zeros((8, 4))}, X),
    ),
    (
        "mha params: k_bias shape",
        ValueError,
        "params['k_bias'] must have shape (4,)",
        lambda: _mha({**PARAMS, "k_bias": np.zeros(8)}, X),
    ),
    (
        "mha params: one of another dtype",
        TypeError,
        "params['v_weight'] has dtype float32 but x has float64",
        lambda: _mha({**PARAMS, "v_weight": PARAMS["v_weight"].astype(np.float32)}, X),
    ),
    (
        "mha params: integer params and x",
        TypeError,
        "x must have a real floating dtype, got int64",
        lambda: _mha({k: a.astype(np.int64) for k, a in PARAMS.items()}, X.astype(np.int64)),
    ),
    (
        "mha params: of another library than x",
        TypeError,
        "x and params['q_weight'] come from different",
        lambda: _mha({k: _strict(a) for k, a in PARAMS.items()}, X),
    ),
    (
        "mha: num_heads does not divide embed_dim",
        ValueError,
        "embed_dim=8 (params['q_weight'].shape) must be divisible by num_heads=3",
        lambda: _mha(num_heads=3),
    ),
    ("mha: num_heads 0", ValueError, "num_heads must be >= 1, got 0", lambda: _mha(num_heads=0)),
    ("mha: num_heads a string", TypeError, "num_heads must be an int, got '2'", lambda: _mha(num_heads="2")),
    (
        "mha: num_kv_heads disagrees with params",
        ValueError,
        "num_kv_heads=2, but params['k_weight'] has 4 rows",
        lambda: _mha(num_kv_heads=2),
    ),
    # the multi-head layer: inputs
    ("mha: x None", TypeError, "x must be an array, got NoneType", lambda: _mha(PARAMS, None)),
    (
        "mha: x 2-D (no batch)",
        ValueError,
        "x must have shape (B, length, width) (batch first), got (5, 8)",
        lambda: _mha(PARAMS, X[0]),
    ),
    (
        "mha: x width",
        ValueError,
        "x has width 7 (last axis), but params expect embed_dim=8",
        lambda: _mha(PARAMS, X[..., :7]),
    ),
    (
        "mha: x float32, params float64",
        TypeError,
        "params['q_weight'] has dtype float64 but x has float32",
        lambda: _mha(PARAMS, X.astype(np.float32)),
    ),
    ("mha: context batch size", ValueError, "context has batch size 1, but x has 2", lambda: _mha(PARAMS, X, X[:1])),
    (
        "mha: context width",
        ValueError,
        "context has width 5 (last axis), but params expect kdim=8",
        lambda: _mha(PARAMS, X, X[..., :5]),
    ),
    (
        "mha: context of three arrays",
        ValueError,
        "context must be an array or a pair (key_source, value_source), got 3",
        lambda: _mha(PARAMS, X, (X, X, X)),
    ),
    (
        "mha: context pair with None",
        TypeError,
        "context[1] (value source) must be an array, got NoneType",
        lambda: _mha(PARAMS, X, (X, None)),
    ),
    (
        "mha: context pair of two lengths",
        ValueError,
        "context[0] and context[1] must have one length S",
        lambda: _mha(PARAMS, X, (X, X[:, :3])),
    ),
    (
        "mha: context a string",
        TypeError,
        "context must be an array of an Array API library",
        lambda: _mha(PARAMS, X, "context"),
    ),
    (
        "mha: self-attention with cross-attention params",
        ValueError,
        "params were made for cross-attention",
        lambda: _mha(npattn.mha_init(8, 2, kdim=3), X),
    ),
    (
        "mha: one context with kdim != vdim",
        ValueError,
        "pass context as a pair",
        lambda: _mha(npattn.mha_init(8, 2, kdim=3, vdim=5), X, X[..., :3]),
    ),
    (
        "mha: mask of the wrong shape (named by the core)",
        ValueError,
        "mask of shape (5, 4) does not broadcast",
        lambda: _mha(mask=np.ones((5, 4), bool)),
    ),
    ("mha: dropout without seed", ValueError, "seed is required", lambda: _mha(dropout_p=0.1)),
    (
        "mha: kv_lengths for another batch size",
        ValueError,
        "kv_lengths must have the inputs' batch shape (2,)",
        lambda: _mha(kv_lengths=np.array([5])),
    ),
    # the multi-head layer: backward
    (
        "mha backward: dy of another shape",
        ValueError,
        "dy must have y's shape (2, 5, 8), got (2, 5, 7)",
        lambda: npattn.mha_backward(np.zeros((2, 5, 7)), _mha()[1]),
    ),
    (
        "mha backward: dy of another dtype",
        TypeError,
        "dy must have y's dtype float64, got float32",
        lambda: npattn.mha_backward(np.zeros((2, 5, 8), np.float32), _mha()[1]),
    ),
    (
        "mha backward: dy of another library",
        TypeError,
        "the forward's x and dy come from different array libraries",
        lambda: npattn.mha_backward(_strict(np.zeros((2, 5, 8))), _mha()[1]),
    ),
    (
        "mha backward: attention residuals",
        TypeError,
        "residuals must come from npattn.mha_forward, got DenseResiduals",
        lambda: npattn.mha_backward(np.zeros((2, 5, 8)), _res()),
    ),
    (
        "mha backward: residuals of a cached (decoding) forward",
        ValueError,
        "which is forward only",
        lambda: npattn.mha_backward(np.zeros((2, 1, 8)), _mha(PARAMS, X[:, :1], cache=npattn.KVCache(2, 1, 4))[1]),
    ),
    # mha_init and the layer object
    ("mha_init: embed_dim 0", ValueError, "embed_dim must be >= 1, got 0", lambda: npattn.mha_init(0, 1)),
    (
        "mha_init: num_heads does not divide embed_dim",
        ValueError,
        "embed_dim=8 must be divisible by num_heads=3",
        lambda: npattn.mha_init(8, 3),
    ),
    (
        "mha_init: num_kv_heads does not divide num_heads",
        ValueError,
        "num_heads=4 must be divisible by num_kv_heads=3",
        lambda: npattn.mha_init(8, 4, num_kv_heads=3),
    ),
    ("mha_init: kdim 0", ValueError, "kdim must be >= 1, got 0", lambda: npattn.mha_init(8, 2, kdim=0)),
    ("mha_init: vdim a float", TypeError, "vdim must be an int, got 3.0", lambda: npattn.mha_init(8, 2, vdim=3.0)),
    ("mha_init: bias 1", TypeError, "bias must be a bool, got 1", lambda: npattn.mha_init(8, 2, bias=1)),
    ("mha_init: seed negative", ValueError, "seed must be >= 0, got -1", lambda: npattn.mha_init(8, 2, seed=-1)),
    ("MultiheadAttention: no num_heads", TypeError, "num_heads is required", lambda: npattn.MultiheadAttention(8)),
    (
        "MultiheadAttention: no embed_dim and no params",
        TypeError,
        "embed_dim is required unless params= is given",
        lambda: npattn.MultiheadAttention(None, 2),
    ),
    (
        "MultiheadAttention: embed_dim disagrees with params",
        ValueError,
        "embed_dim=4, but params have embed_dim=8",
        lambda: npattn.MultiheadAttention(4, 2, params=PARAMS),
    ),
    # KV cache misuse
    ("cache: not a KVCache", TypeError, "cache must be an npattn KVCache, got dict", lambda: _mha(cache={})),
    (
        "cache: with a context (cross-attention)",
        ValueError,
        "cache= decodes self-attention only",
        lambda: _mha(PARAMS, X[:, :1], X, cache=npattn.KVCache(2, 1, 4)),
    ),
    (
        "cache: align top_left",
        ValueError,
        "align must be None or 'bottom_right', got 'top_left'",
        lambda: _mha(PARAMS, X[:, :1], cache=npattn.KVCache(2, 1, 4), causal=True, align="top_left"),
    ),
    (
        "cache: made for other heads",
        ValueError,
        "cache holds num_kv_heads=2, head_dim=4, but the layer has 1 and 4",
        lambda: _mha(PARAMS, X[:, :1], cache=npattn.KVCache(2, 2, 4)),
    ),
    (
        "cache: made for another head dim",
        ValueError,
        "cache holds num_kv_heads=1, head_dim=2",
        lambda: _mha(PARAMS, X[:, :1], cache=npattn.KVCache(2, 1, 2)),
    ),
    (
        "cache: of another dtype",
        TypeError,
        "cache stores float32, but the layer computes in float64",
        lambda: _mha(PARAMS, X[:, :1], cache=npattn.KVCache(2, 1, 4, dtype=np.float32)),
    ),
    (
        "cache: made for another batch size",
        ValueError,
        "cache was made for batch_size=3, but x has batch size 2",
        lambda: _mha(PARAMS, X[:, :1], cache=npattn.KVCache(3, 1, 4)),
    ),
    (
        "cache: full",
        ValueError,
        "cache is full: max_length=4 holds 0 positions and cannot take 5 more",
        lambda: _mha(PARAMS, X, cache=npattn.KVCache(2, 1, 4, max_length=4), causal=True),
    ),
    ("KVCache: batch_size 0", ValueError, "batch_size must be >= 1, got 0", lambda: npattn.KVCache(0, 1, 4)),
    (
        "KVCache: num_kv_heads a float",
        TypeError,
        "num_kv_heads must be an int, got 1.0",
        lambda: npattn.KVCache(2, 1.0, 4),
    ),
    ("KVCache: head_dim True", TypeError, "head_dim must be an int, got True", lambda: npattn.KVCache(2, 1, True)),
    (
        "KVCache: max_length 0",
        ValueError,
        "max_length must be >= 1, got 0",
        lambda: npattn.KVCache(2, 1, 4, max_length=0),
    ),
    (
        "KVCache: max_length a float",
        TypeError,
        "max_length must be an int, got 2.0",
        lambda: npattn.KVCache(2, 1, 4, max_length=2.0),
    ),
    (
        "KVCache: integer dtype",
        TypeError,
        "dtype must be a real floating dtype",
        lambda: npattn.KVCache(2, 1, 4, dtype=np.int32),
    ),
    (
        "KVCache.for_mha: bad params",
        ValueError,
        "params is missing",
        lambda: npattn.KVCache.for_mha({}, 2, num_heads=2),
    ),
    (
        "KVCache.for_mha: batch_size a float",
        TypeError,
        "batch_size must be an int, got 2.0",
        lambda: npattn.KVCache.for_mha(PARAMS, 2.0, num_heads=2),
    ),
    (
        "KVCache.append: 3-D keys",
        ValueError,
        "k must have shape (B, K, t, H), got (2, 1, 4)",
        lambda: npattn.KVCache(2, 1, 4).append(np.zeros((2, 1, 4)), np.zeros((2, 1, 4))),
    ),
    (
        "KVCache.append: k and v of two shapes",
        ValueError,
        "k and v must have one shape",
        lambda: npattn.KVCache(2, 1, 4).append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 2, 4))),
    ),
    (
        "KVCache.append: float32 into a float64 cache",
        TypeError,
        "k has dtype float32 but the cache stores float64",
        lambda: npattn.KVCache(2, 1, 4).append(np.zeros((2, 1, 3, 4), np.float32), np.zeros((2, 1, 3, 4), np.float32)),
    ),
    (
        "KVCache.append: another head dim",
        ValueError,
        "got k with 1 heads of dim 5",
        lambda: npattn.KVCache(2, 1, 4).append(np.zeros((2, 1, 3, 5)), np.zeros((2, 1, 3, 5))),
    ),
    (
        "KVCache.append: another batch size",
        ValueError,
        "cache was made for batch_size=2, but k has batch size 1",
        lambda: npattn.KVCache(2, 1, 4).append(np.zeros((1, 1, 3, 4)), np.zeros((1, 1, 3, 4))),
    ),
    (
        "KVCache.append: past max_length",
        ValueError,
        "cache is full: max_length=2",
        lambda: npattn.KVCache(2, 1, 4, max_length=2).append(np.zeros((2, 1, 3, 4)), np.zeros((2, 1, 3, 4))),
    ),
    (
        "KVCache.append: lists",
        TypeError,
        "k must be an array of an Array API library",
        lambda: npattn.KVCache(2, 1, 4).append([0.0], [0.0]),
    ),
    (
        "KVCache.append: another library",
        TypeError,
        "cache and k come from different array libraries",
        lambda: npattn.KVCache(2, 1, 4).append(_strict(np.zeros((2, 1, 3, 4))), _strict(np.zeros((2, 1, 3, 4)))),
    ),
    # merge_partials
    (
        "merge: outs a generator",
        TypeError,
        "outs must be a list or tuple of arrays, got generator",
        lambda: npattn.merge_partials((o for o in [O_PART]), [L_PART]),
    ),
    ("merge: no parts", ValueError, "merge_partials needs at least one part", lambda: npattn.merge_partials([], [])),
    (
        "merge: more outs than lses",
        ValueError,
        "outs and lses must have one entry per part, got 2 and 1",
        lambda: npattn.merge_partials([O_PART, O_PART], [L_PART]),
    ),
    (
        "merge: scalar parts",
        ValueError,
        "each out must have rank >= 1",
        lambda: npattn.merge_partials([np.array(1.0)], [np.array(0.0)]),
    ),
    (
        "merge: outs of two shapes",
        ValueError,
        "outs must share one shape: outs[0] has (2, 3, 4), outs[1] has (2, 3, 5)",
        lambda: npattn.merge_partials([O_PART, np.zeros((2, 3, 5))], [L_PART, L_PART]),
    ),
    (
        "merge: lse with the out's shape",
        ValueError,
        "lses[1] must have shape out.shape[:-1] = (2, 3)",
        lambda: npattn.merge_partials([O_PART, O_PART], [L_PART, O_PART]),
    ),
    (
        "merge: integer lse",
        TypeError,
        "lses[0] must have a real floating dtype, got int64",
        lambda: npattn.merge_partials([O_PART], [L_PART.astype(np.int64)]),
    ),
    (
        "merge: parts of two dtypes",
        TypeError,
        "outs[1] has dtype float32, but part 0 has float64",
        lambda: npattn.merge_partials([O_PART, O_PART.astype(np.float32)], [L_PART, L_PART]),
    ),
    (
        "merge: a part None",
        TypeError,
        "lses[1] must be an array, got None",
        lambda: npattn.merge_partials([O_PART, O_PART], [L_PART, None]),
    ),
    (
        "merge: parts of two libraries",
        TypeError,
        "come from different array libraries",
        lambda: npattn.merge_partials([O_PART, _strict(O_PART)], [L_PART, _strict(L_PART)]),
    ),
    (
        "merge: parts on two devices",
        ValueError,
        "are on different devices",
        lambda: npattn.merge_partials([_strict(O_PART), _strict(O_PART, "device1")], [_strict(L_PART)] * 2),
    ),
    (
        "merge backward: dout of another shape",
        ValueError,
        "dout must have the merged out's shape (2, 3, 4)",
        lambda: npattn.merge_partials_backward(np.zeros((2, 3)), None, _merged()[2]),
    ),
    (
        "merge backward: dout of another dtype",
        TypeError,
        "dout must have dtype float64",
        lambda: npattn.merge_partials_backward(np.zeros((2, 3, 4), np.float32), None, _merged()[2]),
    ),
    (
        "merge backward: dout of another library",
        TypeError,
        "the merged parts and dout come from different",
        lambda: npattn.merge_partials_backward(_strict(np.zeros((2, 3, 4))), None, _merged()[2]),
    ),
    (
        "merge backward: dlse of another shape",
        ValueError,
        "dlse must have the merged lse's shape (2, 3)",
        lambda: npattn.merge_partials_backward(np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), _merged()[2]),
    ),
    (
        "merge backward: dlse of another dtype",
        TypeError,
        "dlse must have dtype float64",
        lambda: npattn.merge_partials_backward(np.zeros((2, 3, 4)), np.zeros((2, 3), np.float32), _merged()[2]),
    ),
    (
        "merge backward: attention residuals",
        TypeError,
        "residuals must come from merge_partials, got DenseResiduals",
        lambda: npattn.merge_partials_backward(np.zeros((2, 3, 4)), None, _res()),
    ),
    # check_gradients: the rest
    (
        "check_gradients: names of another length",
        ValueError,
        "names must have one entry per input (1), got 2",
        lambda: _gradcheck(names=["x", "y"]),
    ),
    (
        "check_gradients: wrt out of range",
        ValueError,
        "wrt index 3 does not name a floating input",
        lambda: _gradcheck(wrt=[3]),
    ),
    (
        "check_gradients: wrt an integer input",
        ValueError,
        "wrt index 1 does not name a floating input",
        lambda: _gradcheck(
            inputs=[XG, np.arange(3)],
            forward=lambda x, n: (np.sin(x), x),
            backward=lambda dy, x: (dy * np.cos(x), None),
            wrt=[1],
        ),
    ),
    (
        "check_gradients: inputs of two libraries",
        TypeError,
        "inputs[0] and inputs[1] come from different",
        lambda: _gradcheck(inputs=[XG, _strict(XG)]),
    ),
    ("check_gradients: no array inputs", TypeError, "no array arguments were given", lambda: _gradcheck(inputs=[])),
    (
        "check_gradients: backward returns too many gradients",
        ValueError,
        "backward returned 2 gradients for 1 inputs",
        lambda: _gradcheck(backward=lambda dy, x: (dy, dy)),
    ),
    (
        "check_gradients: a wrong backward (raises GradcheckError)",
        npattn.GradcheckError,
        "gradient check FAILED",
        lambda: _gradcheck(backward=lambda dy, x: (dy * np.sin(x),)),
    ),
    # diagnostics: the rest
    (
        "entropy: integer weights",
        TypeError,
        "weights must have a real floating dtype, got int64",
        lambda: npattn.attention_entropy(np.ones((2, 2), np.int64)),
    ),
    (
        "peak: 1-D weights",
        ValueError,
        "weights must have shape (..., N, T, S) or (T, S), got shape (3,)",
        lambda: npattn.attention_peak(np.ones(3)),
    ),
    (
        "row_sum_check: a list",
        TypeError,
        "weights must be an array of an Array API library",
        lambda: npattn.row_sum_check([[0.5, 0.5]]),
    ),
    (
        "summarize: bool weights",
        TypeError,
        "weights must have a real floating dtype, got bool",
        lambda: npattn.summarize(np.ones((2, 2), bool)),
    ),
    (
        "check_finite: not a mapping",
        TypeError,
        "arrays must be a mapping of names to arrays, got list",
        lambda: npattn.check_finite([WEIGHTS]),
    ),
    (
        "check_finite: a name that is not a str",
        TypeError,
        "array names must be str, got 3",
        lambda: npattn.check_finite({3: WEIGHTS}),
    ),
    (
        "check_finite: a value that is a list",
        TypeError,
        "out must be an array of an Array API library",
        lambda: npattn.check_finite({"out": [1.0]}),
    ),
    (
        "check_finite: complex",
        TypeError,
        "out: complex arrays are not supported",
        lambda: npattn.check_finite({"out": WEIGHTS.astype(complex)}),
    ),
    (
        "check_finite: allow_neginf names an absent array",
        ValueError,
        "allow_neginf names ['lse'], which are not among",
        lambda: npattn.check_finite({"out": WEIGHTS}, allow_neginf=["lse"]),
    ),
    (
        "plot_attention: path an int",
        TypeError,
        "path must be a str or path-like, got int",
        lambda: npattn.plot_attention(WEIGHTS, path=3),
    ),
    (
        "plot_attention: 5-D weights",
        ValueError,
        "weights must have shape (N, T, S), (T, S) or (B, N, T, S)",
        lambda: npattn.plot_attention(np.zeros((1, 1, 1, 2, 2)), path="a.png"),
    ),
    (
        "plot_attention: 4-D without batch_index",
        ValueError,
        "pass batch_index= to pick the batch element",
        lambda: npattn.plot_attention(WEIGHTS[None], path="a.png"),
    ),
    (
        "plot_attention: batch_index out of range",
        ValueError,
        "batch_index 1 is out of range for batch size 1",
        lambda: npattn.plot_attention(WEIGHTS[None], path="a.png", batch_index=1),
    ),
    (
        "plot_attention: batch_index a float",
        TypeError,
        "batch_index must be an int, got float",
        lambda: npattn.plot_attention(WEIGHTS[None], path="a.png", batch_index=0.0),
    ),
    (
        "plot_attention: batch_index for 3-D weights",
        ValueError,
        "batch_index is only for 4-D",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", batch_index=0),
    ),
    (
        "plot_attention: heads out of range",
        ValueError,
        "heads holds 5, out of range for 2 heads",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", heads=[5]),
    ),
    (
        "plot_attention: heads empty",
        ValueError,
        "heads must name at least one head",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", heads=[]),
    ),
    (
        "plot_attention: heads a string",
        TypeError,
        "heads must be a sequence of ints, got str",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", heads="01"),
    ),
    (
        "plot_attention: query_tokens of another count",
        ValueError,
        "query_tokens has 1 labels but the query axis has length 3",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", query_tokens=["a"]),
    ),
    (
        "plot_attention: key_tokens a string",
        TypeError,
        "key_tokens must be a sequence of labels (list or tuple), got str",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", key_tokens="abcd"),
    ),
    (
        "plot_attention: tokens with T != S",
        ValueError,
        "tokens labels both axes and needs T == S, got T=3, S=4",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", tokens=["a"] * 3),
    ),
    (
        "plot_attention: tokens and key_tokens",
        ValueError,
        "pass either tokens (both axes) or query_tokens/key_tokens",
        lambda: npattn.plot_attention(WEIGHTS, path="a.png", tokens=["a"] * 3, key_tokens=["a"] * 4),
    ),
    # PyTorch interop: the rest
    (
        "from_torch: not a mapping",
        TypeError,
        "state_dict must be a mapping of names to arrays, got list",
        lambda: npattn.mha_params_from_torch([], 2),
    ),
    (
        "from_torch: unknown key",
        ValueError,
        "state_dict has keys nn.MultiheadAttention does not: ['q_weight']",
        lambda: npattn.mha_params_from_torch({"q_weight": np.eye(4)}, 2),
    ),
    (
        "from_torch: bias_k (add_bias_kv)",
        ValueError,
        "add_bias_kv=True",
        lambda: npattn.mha_params_from_torch(
            {"in_proj_weight": np.zeros((12, 4)), "out_proj.weight": np.eye(4), "bias_k": np.zeros((1, 1, 4))}, 2
        ),
    ),
    (
        "from_torch: in_proj_weight and q_proj_weight",
        ValueError,
        "state_dict has both in_proj_weight and ['q_proj_weight']",
        lambda: npattn.mha_params_from_torch(
            {"in_proj_weight": np.zeros((12, 4)), "q_proj_weight": np.eye(4), "out_proj.weight": np.eye(4)}, 2
        ),
    ),
    (
        "from_torch: in_proj_weight not (3E, E)",
        ValueError,
        "state_dict['in_proj_weight'] must have shape (3E, E), got (12,)",
        lambda: npattn.mha_params_from_torch({"in_proj_weight": np.zeros(12), "out_proj.weight": np.eye(4)}, 2),
    ),
    (
        "from_torch: only some of q/k/v_proj_weight",
        ValueError,
        "or all of q_proj_weight, k_proj_weight, v_proj_weight",
        lambda: npattn.mha_params_from_torch({"q_proj_weight": np.eye(4), "out_proj.weight": np.eye(4)}, 2),
    ),
    (
        "from_torch: no out_proj.weight",
        ValueError,
        "state_dict is missing 'out_proj.weight'",
        lambda: npattn.mha_params_from_torch({"in_proj_weight": np.zeros((12, 4))}, 2),
    ),
    (
        "from_torch: in_proj_bias 2-D",
        ValueError,
        "state_dict['in_proj_bias'] must have shape (3E,) = (12,)",
        lambda: npattn.mha_params_from_torch(
            {"in_proj_weight": np.zeros((12, 4)), "in_proj_bias": np.zeros((12, 1)), "out_proj.weight": np.eye(4)}, 2
        ),
    ),
    (
        "from_torch: num_heads does not divide E",
        ValueError,
        "must be divisible by num_heads=3",
        lambda: npattn.mha_params_from_torch({"in_proj_weight": np.zeros((12, 4)), "out_proj.weight": np.eye(4)}, 3),
    ),
    (
        "from_torch: a value that is a list",
        TypeError,
        "state_dict['in_proj_weight'] must be an array",
        lambda: npattn.mha_params_from_torch({"in_proj_weight": [[0.0]], "out_proj.weight": np.eye(4)}, 2),
    ),
    (
        "to_torch: GQA params",
        ValueError,
        "PyTorch's nn.MultiheadAttention has no GQA",
        lambda: npattn.mha_params_to_torch(PARAMS),
    ),
    (
        "to_torch: some biases only",
        ValueError,
        "all four biases or none",
        lambda: npattn.mha_params_to_torch({k: a for k, a in npattn.mha_init(8, 2).items() if k != "out_bias"}),
    ),
    ("to_torch: not a dict", TypeError, "params must be a dict of arrays", lambda: npattn.mha_params_to_torch([])),
    (
        "masks_from_torch: integer key_padding_mask",
        TypeError,
        "key_padding_mask must be bool or floating, got int64",
        lambda: npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 3), np.int64)),
    ),
    (
        "masks_from_torch: 3-D key_padding_mask",
        ValueError,
        "key_padding_mask must have shape (B, S) or (S,)",
        lambda: npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 3, 1), bool)),
    ),
    (
        "masks_from_torch: 1-D attn_mask",
        ValueError,
        "attn_mask must have shape (T, S) or (B*N, T, S), got (3,)",
        lambda: npattn.mha_masks_from_torch(attn_mask=np.zeros(3, bool)),
    ),
    (
        "masks_from_torch: 3-D attn_mask without num_heads",
        ValueError,
        "needs num_heads to split its first axis",
        lambda: npattn.mha_masks_from_torch(attn_mask=np.zeros((4, 3, 3), bool)),
    ),
    (
        "masks_from_torch: num_heads a string",
        TypeError,
        "num_heads must be an int, got '2'",
        lambda: npattn.mha_masks_from_torch(attn_mask=np.zeros((4, 3, 3), bool), num_heads="2"),
    ),
    (
        "masks_from_torch: first axis not B * num_heads",
        ValueError,
        "attn_mask's first axis (4) must be B * num_heads",
        lambda: npattn.mha_masks_from_torch(attn_mask=np.zeros((4, 3, 3), bool), num_heads=3),
    ),
    (
        "masks_from_torch: a list",
        TypeError,
        "attn_mask must be an array of an Array API library",
        lambda: npattn.mha_masks_from_torch(attn_mask=[[True]]),
    ),
    (
        "masks_from_torch: masks of two libraries",
        TypeError,
        "key_padding_mask and attn_mask come from different",
        lambda: npattn.mha_masks_from_torch(
            key_padding_mask=np.zeros((2, 3), bool), attn_mask=_strict(np.zeros((3, 3), bool))
        ),
    ),
)


# --- the table --------------------------------------------------------------


@pytest.mark.parametrize("thunk, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(thunk, error, fragment):
    with pytest.raises(Exception) as info:
        thunk()
    assert isinstance(info.value, error), f"expected {error.__name__}, got {type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# --- command lines: bad values must be argparse errors (exit 2), never a run -----------


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--batch", "0"], "argument --batch: must be an integer >= 1, got 0"),
        (["--heads", "-2"], "argument --heads: must be an integer >= 1, got -2"),
        (["--length", "x"], "argument --length: must be an integer >= 1, got 'x'"),
        (["--head-dim", "0"], "argument --head-dim: must be an integer >= 1"),
        (["--kv-heads", "3"], "--heads (8) must be a multiple of --kv-heads (3)"),
        (["--backend", "jax"], "argument --backend: invalid choice"),
    ],
    ids=["batch 0", "heads negative", "length not int", "head-dim 0", "kv-heads not dividing", "backend unknown"],
)
def test_demo_cli_rejects_bad_values(monkeypatch, capsys, argv, fragment):
    """``python -m npattn`` took --batch 0, --kv-heads 3 etc. and failed deep
    inside the demo with a traceback; now argparse rejects them (exit 2)."""
    import npattn.__main__ as demo

    monkeypatch.setattr(demo, "_backend", lambda name: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def _load_bench_chunked():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_chunked.py"
    spec = importlib.util.spec_from_file_location("bench_chunked_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _never_measure(*args, **kwargs):
    raise RuntimeError("the benchmark started measuring: a bad value got past argparse")


BENCH_TYPE_ERRORS = [
    (["--lengths", "abc"], "argument --lengths: invalid int value: 'abc'"),
    (["--repeats", "2.5"], "argument --repeats: invalid int value: '2.5'"),
    (["--memory-gib", "lots"], "argument --memory-gib: invalid float value: 'lots'"),
    (["--lengths"], "argument --lengths: expected at least one argument"),
    (["--quick", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize("argv, fragment", BENCH_TYPE_ERRORS, ids=[" ".join(a) for a, _ in BENCH_TYPE_ERRORS])
def test_bench_chunked_rejects_malformed_flags(monkeypatch, capsys, argv, fragment):
    bench = _load_bench_chunked()
    monkeypatch.setattr(bench, "_measure", _never_measure)
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2 and fragment in capsys.readouterr().err


# Regression: bench_chunked.py took any int/float here: --lengths 0 died mid-run,
# --repeats 0 printed inf times, --memory-gib 0/-1/nan silently meant other budgets.
BENCH_RANGE_ERRORS = [
    ["--lengths", "0"],
    ["--lengths", "128", "-5"],
    ["--repeats", "0"],
    ["--memory-gib", "0"],
    ["--memory-gib", "-1"],
    ["--memory-gib", "nan"],
]


@pytest.mark.parametrize("argv", BENCH_RANGE_ERRORS, ids=[" ".join(a) for a in BENCH_RANGE_ERRORS])
def test_bench_chunked_rejects_out_of_range_values(monkeypatch, argv):
    """Never runs a benchmark: _measure is replaced by a tripwire, so a value
    that gets past argparse fails this test at once instead of measuring."""
    bench = _load_bench_chunked()
    monkeypatch.setattr(bench, "_measure", _never_measure)
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2


def test_bench_chunked_help_exits_cleanly(monkeypatch, capsys):
    bench = _load_bench_chunked()
    monkeypatch.setattr(bench, "_measure", _never_measure)
    with pytest.raises(SystemExit) as info:
        bench.main(["--help"])
    assert info.value.code == 0 and "--memory-gib" in capsys.readouterr().out


# --- misuse that must work, or leave things as they were ------------------------------------


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_backward_twice_on_the_same_residuals_gives_the_same_bits(impl):
    """attention_backward documents residuals as reusable: a second (and a
    failed) backward in between changes nothing."""
    bias = RNG.standard_normal((4, 3, 6))
    out, res = npattn.attention_forward(
        Q, K, V, bias=bias, dropout_p=0.3, seed=1, impl=impl, causal=True, align="bottom_right"
    )
    saved = [np.array(a, copy=True) for a in (res.q, res.k, res.v, res.out, res.lse)]
    dout, dlse = RNG.standard_normal(out.shape), RNG.standard_normal(res.lse.shape)
    first = npattn.attention_backward(dout, res, dlse=dlse)
    with pytest.raises(ValueError):
        npattn.attention_backward(dout[..., :2], res)
    second = npattn.attention_backward(dout, res, dlse=dlse)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(saved, (res.q, res.k, res.v, res.out, res.lse)):
        np.testing.assert_array_equal(a, b)


def test_mha_and_merge_backward_twice_give_the_same_bits():
    y, res = _mha(dropout_p=0.2, seed=3, causal=True)
    first, second = npattn.mha_backward(np.ones_like(y), res), npattn.mha_backward(np.ones_like(y), res)
    np.testing.assert_array_equal(first.dx, second.dx)
    for name in first.dparams:
        np.testing.assert_array_equal(first.dparams[name], second.dparams[name])
    out, lse, merge_res = _merged()
    a = npattn.merge_partials_backward(np.ones_like(out), np.ones_like(lse), merge_res)
    b = npattn.merge_partials_backward(np.ones_like(out), np.ones_like(lse), merge_res)
    for x, z in zip(a[0] + a[1], b[0] + b[1]):
        np.testing.assert_array_equal(x, z)


@pytest.mark.parametrize("max_length", [None, 8])
def test_a_failed_cached_forward_leaves_the_cache_as_it_was(max_length):
    cache = npattn.KVCache(2, 1, 4, max_length=max_length)
    _mha(PARAMS, X[:, :2], cache=cache, causal=True)
    keys, values = np.array(cache.keys, copy=True), np.array(cache.values, copy=True)
    failures = [
        dict(mask=np.ones((3, 3), bool)),  # fails in the core, after the keys were staged
        dict(dropout_p=0.5),  # no seed
        dict(kv_lengths=np.array([9, 9])),  # beyond the cached length
    ]
    for options in failures:
        with pytest.raises(ValueError):
            _mha(PARAMS, X[:, 2:3], cache=cache, causal=True, **options)
        assert cache.length == 2
        np.testing.assert_array_equal(cache.keys, keys)
        np.testing.assert_array_equal(cache.values, values)
    y, _ = _mha(PARAMS, X[:, 2:3], cache=cache, causal=True)  # and it still decodes correctly
    full, _ = _mha(PARAMS, X[:, :3], causal=True)
    np.testing.assert_allclose(y[:, 0], full[:, 2], atol=1e-12)


# --- ring attention (npattn.distributed): errors must be collective -----------------------

RING_SCRIPT = r"""
import json, sys
import numpy as np
from mpi4py import MPI
import npattn.distributed as dist

comm = MPI.COMM_WORLD
r = comm.Get_rank()
q, k, v = (np.random.default_rng(r).standard_normal((1, 2, 3, 4)) for _ in range(3))
out, res = dist.ring_attention_forward(q, k, v, comm=comm, causal=True)


def call(fn):
    try:
        fn()
        return None
    except Exception as err:  # noqa: BLE001 - recorded per rank, then the next case runs
        return [type(err).__name__, str(err)]


cases = {
    "dout None on rank 0": lambda: dist.ring_attention_backward(None if r == 0 else np.ones_like(out), res),
    "dout None everywhere": lambda: dist.ring_attention_backward(None, res),
    "stats a list on rank 1": lambda: dist.ring_attention_forward(q, k, v, comm=comm, stats=[] if r else None),
    "backward stats a list": lambda: dist.ring_attention_backward(np.ones_like(out), res, stats=[]),
    "still works": lambda: dist.ring_attention_backward(np.ones_like(out), res, stats={}),
}
results = {name: call(fn) for name, fn in cases.items()}
gathered = comm.gather(results, root=0)
if r == 0:
    json.dump(gathered, open(sys.argv[1], "w"))
"""

RING_EXPECTED = {
    "dout None on rank 0": ("TypeError", "rank 0: dout must be an array of the forward's output shape (1, 2, 3, 4)"),
    "dout None everywhere": ("TypeError", "dout must be an array"),
    "stats a list on rank 1": ("TypeError", "rank 1: stats must be a dict (updated in place) or None, got list"),
    "backward stats a list": ("TypeError", "stats must be a dict"),
    "still works": None,
}


def test_ring_attention_bad_dout_or_stats_raise_on_every_rank(tmp_path):
    """dout=None raised AttributeError on its rank only, outside the gathered
    checks, so the other ranks waited in allgather for ever; a non-dict stats
    raised AttributeError after the exchange on its rank only. Both are now
    TypeErrors raised on every rank, and the communicator stays usable."""
    import json
    import subprocess

    from mpi_support import mpi_skip_reason, run_mpi

    if mpi_skip_reason():
        pytest.skip(mpi_skip_reason())
    script, result = tmp_path / "ring_errors.py", tmp_path / "result.json"
    script.write_text(RING_SCRIPT)
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    try:
        proc = run_mpi(2, script, [result], env=env, cwd=repo, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("ring attention deadlocked on a bad argument given to one rank")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = json.loads(result.read_text())
    assert len(ranks) == 2
    for name, expected in RING_EXPECTED.items():
        for r, got in enumerate(r_results[name] for r_results in ranks):
            if expected is None:
                assert got is None, f"{name}: rank {r} raised {got}"
            else:
                assert got is not None and got[0] == expected[0] and expected[1] in got[1], f"{name}: rank {r}: {got}"
