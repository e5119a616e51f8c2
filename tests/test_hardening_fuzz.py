"""Property fuzzing of the public API with hypothesis (issue 7).

Every example either raises a clean npattn error (TypeError or ValueError
whose message names the bad argument; never an IndexError, AttributeError,
ZeroDivisionError, OverflowError or a broadcasting error from deep inside) or
returns finite, correct results:

- inputs are bit-identical before and after every call (and read-only inputs
  are accepted);
- outputs and gradients are finite whenever the inputs are (a fully masked
  row has out 0 and lse -inf, its documented exception, and a -inf bias entry
  is a mask, not a non-finite input);
- the dense path, the NumPy fast chunked path and the generic Array API
  chunked path (``NPATTN_FAST_NUMPY=0``) agree, forward and backward, and in
  float64 they equal the independent oracle of ``tests/reference.py``;
- a backward may run twice on the same residuals, with identical bits.

``EXAMPLES`` counts the examples each test ran; the totals are written to the
terminal when the module finishes.
"""

from __future__ import annotations

import collections
import math
import os
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_attention
from strategies import attention_cases

import npattn

EXAMPLES: collections.Counter = collections.Counter()

#: Names of the errors that may only come from deep inside, never from a check.
LEAKS = (IndexError, AttributeError, ZeroDivisionError, OverflowError, KeyError, AssertionError)

TOL = {"float64": 1e-10, "float32": 3e-5, "float16": 4e-3}
PATHS = ("dense", "chunked-fast", "chunked-generic")


def fuzz(max_examples: int) -> settings:
    """Explicit example counts (cheap tests), no deadline (thread pool start-up)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module", autouse=True)
def _report_example_counts(request):
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and EXAMPLES:
        total = sum(EXAMPLES.values())
        detail = ", ".join(f"{name} {n}" for name, n in sorted(EXAMPLES.items()))
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\nhardening fuzz: {total} hypothesis examples ({detail})")


@contextmanager
def _generic_chunked():
    """Send NumPy inputs through the generic Array API chunked path."""
    with mock.patch.dict(os.environ, {"NPATTN_FAST_NUMPY": "0"}):
        yield


def _impl(path):
    return "dense" if path == "dense" else "chunked"


def _frozen_copies(arrays):
    """Private read-only copies, and a second set of copies to compare against afterwards."""
    frozen, pristine = [], []
    for a in arrays:
        if isinstance(a, np.ndarray):
            a = a.copy()
            pristine.append(a.copy())
            a.flags.writeable = False
        else:
            pristine.append(a)
        frozen.append(a)
    return frozen, pristine


def _assert_unchanged(arrays, pristine):
    for a, b in zip(arrays, pristine):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), "an input was modified"


def _close(name, got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{name}: -inf pattern")
    finite = np.isfinite(want)
    scale = max(1.0, float(np.max(np.abs(want[finite]), initial=0.0)))
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=tol * scale, err_msg=name)


# --- valid calls --------------------------------------------------------------------


def _run_path(path, q, k, v, options, dout, dlse):
    impl = _impl(path)
    if path == "chunked-generic":
        with _generic_chunked():
            out, res = npattn.attention_forward(q, k, v, impl=impl, **options)
            grads = npattn.attention_backward(dout, res, dlse=dlse)
            again = npattn.attention_backward(dout, res, dlse=dlse)
    else:
        out, res = npattn.attention_forward(q, k, v, impl=impl, **options)
        grads = npattn.attention_backward(dout, res, dlse=dlse)
        again = npattn.attention_backward(dout, res, dlse=dlse)
    for a, b in zip(grads, again):  # the residuals are reusable, with identical bits
        if a is None:
            assert b is None
        else:
            np.testing.assert_array_equal(a, b)
    return out, res, grads


@fuzz(300)
@given(
    case=st.one_of(attention_cases(), attention_cases(max_len=16)),
    dtype=st.sampled_from(["float64", "float32", "float16"]),
    block_q=st.sampled_from([None, 1, 2, 3, 7, 64]),
    block_k=st.sampled_from([None, 1, 2, 5, 8, 64]),
    bias_in_input_dtype=st.booleans(),
    data_seed=st.integers(0, 2**16),
)
def test_valid_calls_are_finite_agree_on_every_path_and_leave_inputs_alone(
    case, dtype, block_q, block_k, bias_in_input_dtype, data_seed
):
    EXAMPLES["valid attention"] += 1
    q, k, v = (a.astype(dtype) for a in case.arrays)
    options = dict(case.options, block_q=block_q, block_k=block_k)
    if "bias" in options and bias_in_input_dtype:
        options["bias"] = options["bias"].astype(dtype)
    rng = np.random.default_rng(data_seed)
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
    cdtype = np.float64 if dtype == "float64" else np.float32
    dlse = rng.standard_normal(q.shape[:-1]).astype(cdtype)

    option_names = [name for name, a in options.items() if isinstance(a, np.ndarray)]
    arrays, pristine = _frozen_copies([q, k, v, dout, dlse] + [options[n] for n in option_names])
    q, k, v, dout, dlse = arrays[:5]
    options.update(zip(option_names, arrays[5:]))

    results = {path: _run_path(path, q, k, v, options, dout, dlse) for path in PATHS}
    _assert_unchanged(arrays, pristine)

    out, res, grads = results["dense"]
    assert out.dtype == q.dtype and res.lse.dtype == cdtype
    lse = np.asarray(res.lse)
    assert not np.isnan(lse).any() and not np.isposinf(lse).any()
    masked = np.isneginf(lse)  # fully masked rows
    assert np.isfinite(out).all()
    assert not np.asarray(out)[masked].any(), "a fully masked row is not 0"
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        if g is not None:
            assert np.isfinite(g).all(), f"{name} is not finite"
    assert not np.asarray(grads.dq)[masked].any(), "dq of a fully masked row is not 0"

    tol = TOL[dtype]
    for path in PATHS[1:]:
        out_c, res_c, grads_c = results[path]
        _close(f"{path} out", out_c, out, tol)
        _close(f"{path} lse", res_c.lse, res.lse, tol)
        for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads_c, grads):
            if b is None:
                assert a is None
            else:
                assert a.dtype == b.dtype and a.shape == b.shape, name
                _close(f"{path} {name}", a, b, 10 * tol)

    if dtype == "float64":
        ref_out, ref_lse, _ = reference_attention(*case.arrays, **case.options)
        _close("out vs oracle", out, ref_out, 1e-10)
        _close("lse vs oracle", res.lse, ref_lse, 1e-10)


# --- invalid calls: a valid case with one or two corruptions ------------------------


def _other_float(dtype):
    return np.float32 if dtype == np.float64 else np.float64


def _strict(a):
    xps = pytest.importorskip("array_api_strict")
    return xps.asarray(a)


def _corrupt(name, q, k, v, options, rng, dims):
    """Apply corruption ``name`` to the arguments; returns them and the
    message fragments (naming the argument) of which one must appear.
    ``dims = (batch_shape, N, T, S)`` of the valid case."""
    batch, N, T, S = dims
    args = {"q": q, "k": k, "v": v}
    if name == "q rank":
        args["q"] = np.reshape(q, (-1, q.shape[-1]))
        frags = ["q must have rank >= 3"]
    elif name == "q None":
        args["q"] = None
        frags = ["q must be an array"]
    elif name == "q list":
        args["q"] = q.tolist()
        frags = ["q must be an array"]
    elif name == "k head dim":
        args["k"] = np.concatenate([k, k[..., :1]], axis=-1)
        frags = ["k's head dim"]
    elif name == "v length":
        args["v"] = np.concatenate([v, v[..., :1, :]], axis=-2)
        frags = ["v must have k's heads and length"]
    elif name == "kv heads":
        n_bad = N + 1
        args["k"] = np.concatenate([k] * n_bad, axis=-3)[..., :n_bad, :, :]
        args["v"] = np.concatenate([v] * n_bad, axis=-3)[..., :n_bad, :, :]
        frags = ["must be a multiple of the number of key/value heads"]
    elif name == "batch axes":
        args["k"], args["v"] = k[None], v[None]
        frags = ["same rank", "leading (batch) axes"]
    elif name == "integer q":
        args["q"] = np.round(q).astype(np.int64)
        frags = ["q must have a real floating dtype"]
    elif name == "mixed dtypes":
        args["v"] = v.astype(_other_float(v.dtype))
        frags = ["q, k and v must share one dtype"]
    elif name == "other library":
        args["k"] = _strict(k if k.dtype != np.float16 else k.astype(np.float32))  # strict has no float16
        frags = ["different array libraries"]
    elif name == "mask float":
        options["mask"] = np.ones((T, S))
        frags = ["mask must be a bool array"]
    elif name == "mask shape":
        options["mask"] = np.ones((T + 1, S), bool)
        frags = ["mask of shape"]
    elif name == "bias shape":
        options["bias"] = np.zeros((T, S + 1))
        frags = ["bias of shape"]
    elif name == "bias bool":
        options["bias"] = np.zeros((T, S), bool)
        frags = ["bias must have a real floating dtype"]
    elif name == "q_lengths too long":
        options["q_lengths"] = np.full(batch, T + 1)
        frags = ["q_lengths must lie in"]
    elif name == "kv_lengths negative":
        options["kv_lengths"] = np.full(batch, -1)
        frags = ["kv_lengths must lie in"]
    elif name == "lengths float":
        options["kv_lengths"] = np.full(batch, 1.0)
        frags = ["kv_lengths must have an integer dtype"]
    elif name == "lengths shape":
        options["q_lengths"] = np.zeros(batch + (2,), np.int64)
        frags = ["q_lengths must have the inputs' batch shape"]
    elif name == "dropout out of range":
        options["dropout_p"] = float(rng.choice([1.0, -0.1, 1.5, math.nan]))
        options["seed"] = 1
        frags = ["dropout_p must lie in [0, 1)"]
    elif name == "dropout without seed":
        options["dropout_p"] = 0.3
        options.pop("seed", None)
        frags = ["seed is required"]
    elif name == "seed negative":
        options["seed"] = -5
        frags = ["seed must be >= 0"]
    elif name == "window negative":
        options["window"] = (int(rng.integers(-3, 0)), None)
        frags = ["window[0] (left) must be >= 0"]
    elif name == "window not a pair":
        options["window"] = 2
        frags = ["window must be a pair"]
    elif name == "scale not finite":
        options["scale"] = rng.choice([math.inf, -math.inf, math.nan]).item()
        frags = ["scale must be a finite real number"]
    elif name == "scale overflows":
        options["scale"] = 1e39 if q.dtype != np.float64 else math.inf
        frags = ["scale=", "scale must be a finite real number"]
    elif name == "block zero":
        options["block_k"] = int(rng.integers(-2, 1))
        frags = ["block_k must be >= 1"]
    elif name == "impl unknown":
        options["impl"] = "flash"
        frags = ["impl must be one of"]
    elif name == "align unknown":
        options["align"] = "center"
        frags = ["align must be one of"]
    elif name == "causal not bool":
        options["causal"] = 1
        frags = ["causal must be a bool"]
    elif name == "xp wrong":
        options["xp"] = "numpy"
        frags = ["xp must be an Array API namespace"]
    else:
        raise AssertionError(name)
    return args["q"], args["k"], args["v"], frags


#: Corruptions that change what kind of object an array is run after the
#: ones that reshape or recast it (so that those still see NumPy arrays).
LATE = {"integer q": 1, "mixed dtypes": 1, "other library": 2, "q list": 3, "q None": 4}

CORRUPTIONS = (
    "q rank",
    "q None",
    "q list",
    "k head dim",
    "v length",
    "kv heads",
    "batch axes",
    "integer q",
    "mixed dtypes",
    "other library",
    "mask float",
    "mask shape",
    "bias shape",
    "bias bool",
    "q_lengths too long",
    "kv_lengths negative",
    "lengths float",
    "lengths shape",
    "dropout out of range",
    "dropout without seed",
    "seed negative",
    "window negative",
    "window not a pair",
    "scale not finite",
    "scale overflows",
    "block zero",
    "impl unknown",
    "align unknown",
    "causal not bool",
    "xp wrong",
)


@fuzz(500)
@given(
    case=attention_cases(),
    dtype=st.sampled_from([np.float64, np.float32, np.float16]),
    corruptions=st.lists(st.sampled_from(CORRUPTIONS), min_size=1, max_size=2, unique=True),
    impl=st.sampled_from(["dense", "chunked", "auto"]),
    rng_seed=st.integers(0, 2**16),
)
def test_invalid_calls_raise_a_clean_error_naming_the_argument(case, dtype, corruptions, impl, rng_seed):
    EXAMPLES["invalid attention"] += 1
    rng = np.random.default_rng(rng_seed)
    q, k, v = (a.astype(dtype) for a in case.arrays)
    options = dict(case.options, impl=impl)
    frags = []
    dims = (q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2])
    for name in sorted(corruptions, key=lambda c: LATE.get(c, 0)):
        q, k, v, more = _corrupt(name, q, k, v, options, rng, dims)
        frags += more
    snapshot = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in (q, k, v, *options.values())]
    with pytest.raises((TypeError, ValueError)) as info:
        npattn.attention_forward(q, k, v, **options)
    assert not isinstance(info.value, LEAKS)
    message = str(info.value)
    assert any(f in message for f in frags), f"{message!r} names none of {frags}"
    _assert_unchanged([a for a in (q, k, v, *options.values())], snapshot)


# --- backward misuse: cotangents that do not fit the residuals ----------------------


def _bad_cotangent(kind, out, lse):
    if kind == "dout shape":
        return {
            "dout": np.zeros(out.shape[:-1] + (out.shape[-1] + 1,), out.dtype)
        }, "dout must have the forward's shape"
    if kind == "dout rank":
        return {"dout": np.zeros(out.shape[1:], out.dtype)}, "dout must have the forward's shape"
    if kind == "dout dtype":
        return {"dout": np.zeros(out.shape, _other_float(out.dtype))}, "dout must have dtype"
    if kind == "dout int":
        return {"dout": np.zeros(out.shape, np.int32)}, "dout must have dtype"
    if kind == "dout library":
        return {"dout": _strict(np.zeros(out.shape, np.float32))}, "different array libraries"
    if kind == "dout None":
        return {"dout": None}, "dout must be an array"
    if kind == "dout list":
        return {"dout": np.zeros(out.shape).tolist()}, "dout must be an array"
    if kind == "dlse shape":
        return {"dlse": np.zeros(lse.shape + (1,), lse.dtype)}, "dlse must have the forward's shape"
    if kind == "dlse dtype":
        return {"dlse": np.zeros(lse.shape, _other_float(lse.dtype))}, "dlse must have dtype"
    if kind == "dlse library":
        return {"dlse": _strict(np.zeros(lse.shape, lse.dtype))}, "different array libraries"
    raise AssertionError(kind)


@fuzz(150)
@given(
    case=attention_cases(),
    dtype=st.sampled_from([np.float64, np.float32, np.float16]),
    impl=st.sampled_from(["dense", "chunked"]),
    kind=st.sampled_from(
        [
            "dout shape",
            "dout rank",
            "dout dtype",
            "dout int",
            "dout library",
            "dout None",
            "dout list",
            "dlse shape",
            "dlse dtype",
            "dlse library",
        ]
    ),
)
def test_backward_rejects_cotangents_that_do_not_fit_and_stays_usable(case, dtype, impl, kind):
    EXAMPLES["backward misuse"] += 1
    q, k, v = (a.astype(dtype) for a in case.arrays)
    out, res = npattn.attention_forward(q, k, v, impl=impl, **case.options)
    lse_before, out_before = np.array(res.lse, copy=True), np.array(res.out, copy=True)
    bad, fragment = _bad_cotangent(kind, out, res.lse)
    dout = bad.get("dout", np.ones_like(out))
    with pytest.raises((TypeError, ValueError), match=None) as info:
        npattn.attention_backward(dout, res, dlse=bad.get("dlse"))
    assert not isinstance(info.value, LEAKS)
    assert fragment in str(info.value)
    # The failed call left the residuals as they were: a good backward still works.
    np.testing.assert_array_equal(res.lse, lse_before)
    np.testing.assert_array_equal(res.out, out_before)
    grads = npattn.attention_backward(np.ones_like(out), res)
    assert all(np.isfinite(g).all() for g in grads if g is not None)


# --- the multi-head layer -----------------------------------------------------------


@st.composite
def mha_cases(draw):
    K = draw(st.sampled_from([1, 2]))
    N = K * draw(st.sampled_from([1, 2]))
    E = N * draw(st.sampled_from([1, 2, 3]))
    kind = draw(st.sampled_from(["self", "single", "pair"]))
    kdim = E if kind == "self" else draw(st.integers(1, 5))
    vdim = kdim if kind != "pair" else draw(st.integers(1, 5))
    B, T = draw(st.integers(1, 2)), draw(st.integers(1, 5))
    S = T if kind == "self" else draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    params = npattn.mha_init(E, N, num_kv_heads=K, kdim=kdim, vdim=vdim, bias=draw(st.booleans()), seed=seed)
    x = rng.standard_normal((B, T, E))
    context = None
    if kind == "single":
        context = rng.standard_normal((B, S, kdim))
    elif kind == "pair":
        context = (rng.standard_normal((B, S, kdim)), rng.standard_normal((B, S, vdim)))
    options = {}
    if draw(st.booleans()):
        options["causal"] = True
        options["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if draw(st.booleans()):
        options["kv_lengths"] = rng.integers(0, S + 1, size=B)
    if draw(st.booleans()):
        options["mask"] = rng.random((N, T, S)) < 0.7
    if draw(st.booleans()):
        options["bias"] = rng.standard_normal((1, T, S))
    if draw(st.booleans()):
        options["dropout_p"], options["seed"] = 0.25, draw(st.integers(0, 99))
    return params, x, context, N, K, options


@fuzz(100)
@given(case=mha_cases(), dtype=st.sampled_from([np.float64, np.float32]))
def test_mha_is_finite_path_independent_and_leaves_inputs_alone(case, dtype):
    EXAMPLES["valid mha"] += 1
    params, x, context, N, K, options = case
    params = {name: a.astype(dtype) for name, a in params.items()}
    x = x.astype(dtype)
    if context is not None:
        context = tuple(c.astype(dtype) for c in context) if isinstance(context, tuple) else context.astype(dtype)
    sources = () if context is None else context if isinstance(context, tuple) else (context,)
    flat = list(params.values()) + [x, *sources]
    pristine = [a.copy() for a in flat]
    for a in flat:
        a.flags.writeable = False
    results = {}
    for impl in ("dense", "chunked"):
        y, res = npattn.mha_forward(
            params, x, context, num_heads=N, num_kv_heads=K, impl=impl, need_weights=True, **options
        )
        dy = np.ones_like(y)
        g = npattn.mha_backward(dy, res)
        results[impl] = (y, res, g)
        assert np.isfinite(y).all() and np.isfinite(res.weights).all()
        assert np.isfinite(g.dx).all() and all(np.isfinite(d).all() for d in g.dparams.values())
    _assert_unchanged(flat, pristine)
    tol = TOL[np.dtype(dtype).name]
    (y_d, res_d, g_d), (y_c, res_c, g_c) = results["dense"], results["chunked"]
    _close("y", y_c, y_d, tol)
    _close("weights", res_c.weights, res_d.weights, tol)
    _close("dx", g_c.dx, g_d.dx, 10 * tol)
    for name in g_d.dparams:
        _close(f"d{name}", g_c.dparams[name], g_d.dparams[name], 10 * tol)


def _params_corruption(name, params):
    params = dict(params)
    if name == "missing weight":
        del params["k_weight"]
        return params, ValueError, "params is missing ['k_weight']"
    if name == "unknown key":
        params["in_proj_weight"] = params["q_weight"]
        return params, ValueError, "params has unknown keys ['in_proj_weight']"
    if name == "bias shape":
        params["q_bias"] = np.zeros(params["q_weight"].shape[0] + 1)
        return params, ValueError, "params['q_bias'] must have shape"
    if name == "out_weight shape":
        params["out_weight"] = params["out_weight"][:, :-1]
        return params, ValueError, "params['out_weight'] must have shape"
    if name == "v rows":
        params["v_weight"] = np.concatenate([params["v_weight"]] * 2)
        return params, ValueError, "params['v_weight'] must have shape"
    if name == "value not an array":
        params["k_bias"] = [0.0]
        return params, TypeError, "params['k_bias'] must be an array"
    if name == "dtype":
        params["v_weight"] = params["v_weight"].astype(np.float32)
        return params, TypeError, "params['v_weight'] has dtype float32 but x has float64"
    if name == "not a dict":
        return list(params.values()), TypeError, "params must be a dict of arrays"
    raise AssertionError(name)


@fuzz(100)
@given(
    case=mha_cases(),
    corruption=st.sampled_from(
        [
            "missing weight",
            "unknown key",
            "bias shape",
            "out_weight shape",
            "v rows",
            "value not an array",
            "dtype",
            "not a dict",
        ]
    ),
)
def test_mha_rejects_bad_params(case, corruption):
    EXAMPLES["invalid mha params"] += 1
    params, x, context, N, _K, options = case
    params, error, fragment = _params_corruption(corruption, params)
    with pytest.raises(error) as info:
        npattn.mha_forward(params, x, context, num_heads=N, **options)
    assert fragment in str(info.value)


# --- merge_partials over a random split of the keys -----------------------------------


@fuzz(100)
@given(
    case=attention_cases(features=("mask", "bias", "lengths")),
    n_cuts=st.integers(0, 3),
    cut_seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.float64, np.float32]),
)
def test_merge_of_any_key_split_equals_full_attention(case, n_cuts, cut_seed, dtype):
    EXAMPLES["merge split"] += 1
    q, k, v = (a.astype(dtype) for a in case.arrays)
    options = dict(case.options)
    S = k.shape[-2]
    full_shape = q.shape[:-1] + (S,)
    mask = np.broadcast_to(options.pop("mask", np.ones((1,), bool)), full_shape)
    bias = options.pop("bias", None)
    bias = None if bias is None else np.broadcast_to(bias, full_shape)
    kv_lengths = options.pop("kv_lengths", None)
    if kv_lengths is not None:  # as a mask, since each part sees its own slice of keys
        mask = mask & (np.arange(S) < np.asarray(kv_lengths)[..., None, None, None])
    rng = np.random.default_rng(cut_seed)
    cuts = sorted(set(rng.integers(1, S, size=n_cuts).tolist())) if S > 1 else []
    bounds = list(zip([0] + cuts, cuts + [S]))
    out, res = npattn.attention_forward(q, k, v, mask=mask, bias=bias, **options)
    outs, lses = [], []
    for s0, s1 in bounds:
        o, r = npattn.attention_forward(
            q,
            k[..., s0:s1, :],
            v[..., s0:s1, :],
            mask=mask[..., s0:s1],
            bias=None if bias is None else bias[..., s0:s1],
            **options,
        )
        outs.append(o)
        lses.append(r.lse)
    merged, lse, merge_res = npattn.merge_partials(outs, lses)
    tol = TOL[np.dtype(dtype).name]
    _close("merged out", merged, out, tol)
    _close("merged lse", lse, res.lse, tol)
    douts, dlses = npattn.merge_partials_backward(np.ones_like(merged), np.ones_like(lse), merge_res)
    assert all(np.isfinite(d).all() for d in douts + dlses)
