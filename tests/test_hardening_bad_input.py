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

import numpy as np
import pytest

import npattn

RNG = np.random.default_rng(7)
Q = RNG.standard_normal((2, 4, 3, 5))  # (B, N, T, H)
K = RNG.standard_normal((2, 2, 6, 5))  # (B, K, S, H)
V = RNG.standard_normal((2, 2, 6, 7))  # (B, K, S, Hv)


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


EMPTY_LAYER = {"q_weight": np.zeros((0, 0)), "k_weight": np.zeros((4, 0)), "v_weight": np.zeros((4, 0)),
               "out_weight": np.zeros((0, 0))}


@case("mha params: embed_dim 0 (ZeroDivisionError before)", ValueError, "with embed_dim >= 1, got (0, 0)")
def _():
    _mha(EMPTY_LAYER, np.zeros((2, 5, 0)))


@case("mha_params_from_torch: embed_dim 0 (ZeroDivisionError before)", ValueError, "embed_dim >= 1")
def _():
    npattn.mha_params_from_torch({"q_proj_weight": EMPTY_LAYER["q_weight"], "k_proj_weight": EMPTY_LAYER["k_weight"],
                                  "v_proj_weight": EMPTY_LAYER["v_weight"], "out_proj.weight": np.zeros((0, 0))}, 2)


@case("mha cache: of another library (misleading dtype message before)", TypeError,
      "x and cache come from different array libraries (numpy and array_api_strict)")
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


@case("check_gradients: inputs one array, not a list (rows became inputs)", TypeError,
      "inputs must be a list or tuple of arrays, one per argument of forward, got ndarray")
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


@case("check_gradients: integer output (broadcast error before)", TypeError, "forward's output 0 must be a real floating")
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


@case("plot_attention: unknown cmap (KeyError before)", ValueError, "cmap must name a matplotlib colour map, got 'nope'")
def _():
    pytest.importorskip("matplotlib")
    npattn.plot_attention(WEIGHTS, path="/nonexistent-dir/attn.png", cmap="nope")


# --- PyTorch interop -------------------------------------------------------------------------


@case("mha_masks_from_torch: masks disagree on S (numpy broadcast error before)", ValueError,
      "key_padding_mask and attn_mask must agree on S (last axis), got 4 and 3")
def _():
    npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 4), bool), attn_mask=np.zeros((3, 3), bool))


@case("mha_masks_from_torch: bool padding vs float attn_mask disagree on S", ValueError, "must agree on S")
def _():
    npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 4), bool), attn_mask=np.zeros((3, 3)))


@case("mha_masks_from_torch: 3-D attn_mask for another batch size", ValueError,
      "attn_mask's first axis (6) must be B * num_heads with B=2 from key_padding_mask and num_heads=2")
def _():
    npattn.mha_masks_from_torch(key_padding_mask=np.zeros((2, 3), bool), attn_mask=np.zeros((6, 3, 3), bool),
                                num_heads=2)


@case("mha_masks_from_torch: num_heads 0 (TypeError before)", ValueError, "num_heads must be an int >= 1, got 0")
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


@case("forward: xp of another library than the arrays", TypeError,
      "xp is array_api_strict, but q is an array of numpy")
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
@pytest.mark.parametrize("window, align, lengths", [
    ((2**63, 0), "top_left", False),
    ((10**30, 10**30), "bottom_right", False),
    ((0, 2**64), "bottom_right", True),
])
def test_window_wider_than_any_int64_is_unbounded(impl, window, align, lengths):
    """A window side of 2**63 or more overflowed int64 in the index arithmetic
    (OverflowError from deep inside); any side >= T + S hides nothing."""
    kv_lengths = np.array([3, 6]) if lengths else None
    unbounded = (None if window[0] > 10 else window[0], None if window[1] > 10 else window[1])
    got = npattn.attention(Q, K, V, window=window, align=align, kv_lengths=kv_lengths, impl=impl)
    want = npattn.attention(Q, K, V, window=unbounded, align=align, kv_lengths=kv_lengths, impl=impl)
    np.testing.assert_array_equal(got, want)


# --- the table --------------------------------------------------------------


@pytest.mark.parametrize("thunk, error, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(thunk, error, fragment):
    with pytest.raises(Exception) as info:
        thunk()
    assert isinstance(info.value, error), f"expected {error.__name__}, got {type(info.value).__name__}: {info.value}"
    assert fragment in str(info.value), f"{fragment!r} not in {str(info.value)!r}"


# --- command lines: bad values must be argparse errors (exit 2), never a run -----------


@pytest.mark.parametrize("argv, fragment", [
    (["--batch", "0"], "argument --batch: must be an integer >= 1, got 0"),
    (["--heads", "-2"], "argument --heads: must be an integer >= 1, got -2"),
    (["--length", "x"], "argument --length: must be an integer >= 1, got 'x'"),
    (["--head-dim", "0"], "argument --head-dim: must be an integer >= 1"),
    (["--kv-heads", "3"], "--heads (8) must be a multiple of --kv-heads (3)"),
    (["--backend", "jax"], "argument --backend: invalid choice"),
], ids=["batch 0", "heads negative", "length not int", "head-dim 0", "kv-heads not dividing", "backend unknown"])
def test_demo_cli_rejects_bad_values(monkeypatch, capsys, argv, fragment):
    """``python -m npattn`` took --batch 0, --kv-heads 3 etc. and failed deep
    inside the demo with a traceback; now argparse rejects them (exit 2)."""
    import npattn.__main__ as demo

    monkeypatch.setattr(demo, "_backend", lambda name: pytest.fail("the demo started"))
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err
