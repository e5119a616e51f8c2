"""The multi-head attention layer (npattn.mha): gradients of every input and
parameter by central differences, an independent NumPy oracle for the
forward, the dense and chunked paths against each other, need_weights, the
initialization, bad input, and the backend matrix."""

from __future__ import annotations

import importlib.util
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn.mha import MHAGrads, MultiheadAttention, layer_dims, mha_backward, mha_forward, mha_init

HAS_CHUNKED = importlib.util.find_spec("npattn.chunked") is not None
NO_CHUNKED = pytest.mark.skipif(not HAS_CHUNKED, reason="npattn.chunked not there yet")
IMPLS = ["dense", pytest.param("chunked", marks=NO_CHUNKED)]
CHUNKED_BLOCKS = {"block_q": 2, "block_k": 3}  # tiles that do not divide T or S


def random_params(rng, E, N, *, K=None, kdim=None, vdim=None, bias=True, sinks=False, dtype=np.float64):
    """mha_init's params with every entry random (zero biases test nothing)."""
    seed = int(rng.integers(1 << 30))
    params = mha_init(E, N, num_kv_heads=K, kdim=kdim, vdim=vdim, bias=bias, sinks=sinks, seed=seed)
    return {name: rng.standard_normal(a.shape).astype(dtype) * 0.5 for name, a in params.items()}


def reference_mha(params, x, key_source, value_source, *, num_heads, mask=None, bias=None, causal=False):
    """Plain float64 NumPy MHA, one (batch, head) at a time; no code shared
    with npattn. Returns ``(y, weights)``; top-left causal only."""
    p = {name: np.asarray(a, np.float64) for name, a in params.items()}
    B, T, E = x.shape
    S = key_source.shape[1]
    N = num_heads
    H = E // N
    K = p["k_weight"].shape[0] // H
    q = x @ p["q_weight"].T + p.get("q_bias", 0.0)
    k = key_source @ p["k_weight"].T + p.get("k_bias", 0.0)
    v = value_source @ p["v_weight"].T + p.get("v_bias", 0.0)
    full_mask = np.ones((B, N, T, S), bool) if mask is None else np.broadcast_to(mask, (B, N, T, S))
    full_bias = np.zeros((B, N, T, S)) if bias is None else np.broadcast_to(bias, (B, N, T, S))
    merged = np.zeros((B, T, E))
    weights = np.zeros((B, N, T, S))
    for b in range(B):
        for n in range(N):
            g = n // (N // K)
            qh, kh, vh = q[b, :, n * H : (n + 1) * H], k[b, :, g * H : (g + 1) * H], v[b, :, g * H : (g + 1) * H]
            for i in range(T):
                scores = qh[i] @ kh.T / math.sqrt(H) + full_bias[b, n, i]
                visible = full_mask[b, n, i] & (np.arange(S) <= i if causal else True)
                if not visible.any():
                    continue
                e = np.where(visible, np.exp(scores - scores[visible].max()), 0.0)
                weights[b, n, i] = e / e.sum()
                merged[b, i, n * H : (n + 1) * H] = weights[b, n, i] @ vh
    y = merged @ p["out_weight"].T + p.get("out_bias", 0.0)
    return y, weights


#: Options of mha_forward that are differentiable inputs, and their MHAGrads field.
DIFFERENTIABLE_OPTIONS = {"bias": "dbias", "alibi_slopes": "dalibi_slopes"}


def mha_pair(param_names, kind, options):
    """``forward(x, [context...], *params, *extras)`` and its backward, for
    check_gradients; ``extras`` are the differentiable options given (the
    attention bias, the ALiBi slopes), in DIFFERENTIABLE_OPTIONS' order."""
    extras = [name for name in DIFFERENTIABLE_OPTIONS if name in options]
    options = {k: v for k, v in options.items() if k not in extras}
    n_ctx = {"self": 0, "single": 1, "pair": 2}[kind]

    def split(inputs):
        x, rest = inputs[0], inputs[1:]
        ctx, rest = rest[:n_ctx], rest[n_ctx:]
        params = dict(zip(param_names, rest[: len(param_names)]))
        given = dict(zip(extras, rest[len(param_names) :]))
        context = None if kind == "self" else (ctx[0] if kind == "single" else tuple(ctx))
        return x, context, params, given

    def forward(*inputs):
        x, context, params, given = split(inputs)
        return mha_forward(params, x, context, **options, **given)

    def backward(dy, res):
        g = mha_backward(dy, res)
        ctx = () if g.dcontext is None else (g.dcontext,) if kind == "single" else tuple(g.dcontext)
        return (g.dx, *ctx, *(g.dparams[name] for name in param_names)) + tuple(
            getattr(g, DIFFERENTIABLE_OPTIONS[name]) for name in extras
        )

    return forward, backward


def gradcheck_mha(params, x, context, options, **check):
    kind = "self" if context is None else "pair" if isinstance(context, tuple) else "single"
    ctx = [] if context is None else list(context) if kind == "pair" else [context]
    names = list(params)
    forward, backward = mha_pair(names, kind, options)
    extras = [name for name in DIFFERENTIABLE_OPTIONS if name in options]
    inputs = [x, *ctx, *(params[n] for n in names), *(options[name] for name in extras)]
    labels = ["x", *[f"context{i}" for i in range(len(ctx))], *names, *extras]
    return npattn.check_gradients(forward, backward, inputs, names=labels, **check)


# One row per feature: (kind, E, N, K, kdim, vdim, B, T, S, attention options builder)
def _opts_plain(rng, B, N, T, S):
    return {}


def _opts_causal_lengths(rng, B, N, T, S):
    return {
        "causal": True,
        "align": "bottom_right",
        "q_lengths": np.array([T, T - 1]),
        "kv_lengths": np.array([S, S - 2]),
    }


def _opts_mask_bias(rng, B, N, T, S):
    mask = rng.random((B, 1, T, S)) > 0.3
    mask[..., 0] = True
    return {"mask": mask, "bias": rng.standard_normal((N, T, S))}


def _opts_dropout(rng, B, N, T, S):
    return {"dropout_p": 0.3, "seed": 1234, "causal": True, "align": "top_left"}


def _opts_window_bias_lengths(rng, B, N, T, S):
    return {
        "window": (1, 1),
        "align": "bottom_right",
        "bias": rng.standard_normal((B, 1, 1, S)),
        "kv_lengths": np.array([S - 1, S]),
    }


GRAD_CASES = {
    "self": ("self", 8, 2, 2, None, None, 2, 3, 3, _opts_plain),
    "self-gqa-causal-lengths": ("self", 8, 4, 2, None, None, 2, 4, 4, _opts_causal_lengths),
    "self-mqa-mask-bias": ("self", 8, 4, 1, None, None, 2, 3, 3, _opts_mask_bias),
    "self-dropout": ("self", 8, 2, 2, None, None, 2, 4, 4, _opts_dropout),
    "single-context-mask-bias": ("single", 8, 2, 2, 6, 6, 2, 3, 4, _opts_mask_bias),
    "single-context-causal-lengths": ("single", 8, 2, 1, 8, 8, 2, 3, 5, _opts_causal_lengths),
    "pair-context-gqa-window": ("pair", 8, 4, 2, 5, 3, 2, 3, 4, _opts_window_bias_lengths),
    "pair-context-dropout-nobias": ("pair", 4, 2, 2, 3, 5, 2, 2, 3, _opts_dropout),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_central_differences(case, impl):
    kind, E, N, K, kdim, vdim, B, T, S, make_options = GRAD_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    params = random_params(rng, E, N, K=K, kdim=kdim, vdim=vdim, bias="nobias" not in case)
    x = rng.standard_normal((B, T, E))
    context = None
    if kind == "single":
        context = rng.standard_normal((B, S, kdim))
    elif kind == "pair":
        context = (rng.standard_normal((B, S, kdim)), rng.standard_normal((B, S, vdim)))
    options = {"num_heads": N, "num_kv_heads": K, "impl": impl, **make_options(rng, B, N, T, S)}
    if impl == "chunked":
        options.update(CHUNKED_BLOCKS)
    result = gradcheck_mha(params, x, context, options)
    assert result.ok
    assert result.jacobian_checked  # the shapes are small enough for the full Jacobian
    assert max(result.max_abs_error.values()) < 1e-7


def test_forward_matches_independent_oracle():
    rng = np.random.default_rng(1)
    B, T, S, E, N, K = 2, 4, 5, 12, 4, 2
    params = random_params(rng, E, N, K=K, kdim=7, vdim=3)
    x, xk, xv = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, 7)), rng.standard_normal((B, S, 3))
    mask = rng.random((B, 1, T, S)) > 0.4
    bias = rng.standard_normal((N, T, S))
    y, res = mha_forward(params, x, (xk, xv), num_heads=N, mask=mask, bias=bias, need_weights=True)
    y_ref, w_ref = reference_mha(params, x, xk, xv, num_heads=N, mask=mask, bias=bias)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.weights, w_ref, rtol=1e-12, atol=1e-14)
    # self-attention, causal, no biases, GQA
    params = random_params(rng, E, N, K=1, bias=False)
    y, res = mha_forward(params, x, num_heads=N, causal=True, need_weights=True)
    y_ref, w_ref = reference_mha(params, x, x, x, num_heads=N, causal=True)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.weights, w_ref, rtol=1e-12, atol=1e-14)


@NO_CHUNKED
@pytest.mark.parametrize(
    "case", ["self-gqa-causal-lengths", "pair-context-gqa-window", "self-dropout", "single-context-mask-bias"]
)
def test_chunked_equals_dense(case):
    kind, E, N, K, kdim, vdim, B, T, S, make_options = GRAD_CASES[case]
    rng = np.random.default_rng(7)
    params = random_params(rng, E, N, K=K, kdim=kdim, vdim=vdim)
    x = rng.standard_normal((B, T, E))
    context = {
        "self": None,
        "single": rng.standard_normal((B, S, kdim or E)),
        "pair": (rng.standard_normal((B, S, kdim or E)), rng.standard_normal((B, S, vdim or E))),
    }[kind]
    options = {"num_heads": N, **make_options(rng, B, N, T, S), "need_weights": True}
    y_d, res_d = mha_forward(params, x, context, impl="dense", **options)
    y_c, res_c = mha_forward(params, x, context, impl="chunked", **CHUNKED_BLOCKS, **options)
    assert res_c.spec.impl == "chunked" and res_d.spec.impl == "dense"
    np.testing.assert_allclose(y_c, y_d, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res_c.weights, res_d.weights, rtol=0, atol=1e-12)
    dy = rng.standard_normal(y_d.shape)
    g_d, g_c = mha_backward(dy, res_d), mha_backward(dy, res_c)
    np.testing.assert_allclose(g_c.dx, g_d.dx, rtol=0, atol=1e-12)
    for name in params:
        np.testing.assert_allclose(g_c.dparams[name], g_d.dparams[name], rtol=0, atol=1e-11, err_msg=name)
    if g_d.dbias is not None:
        np.testing.assert_allclose(g_c.dbias, g_d.dbias, rtol=0, atol=1e-12)


@pytest.mark.parametrize("impl", IMPLS)
def test_need_weights_fully_masked_rows_and_pre_dropout(impl):
    """Weights are the softmax before dropout; fully masked rows (q_lengths)
    and -inf bias entries give 0, never NaN, on both paths."""
    rng = np.random.default_rng(3)
    B, T, E, N = 2, 5, 8, 2
    params = random_params(rng, E, N)
    x = rng.standard_normal((B, T, E))
    bias = np.where(rng.random((1, N, T, T)) > 0.8, -np.inf, 0.0)
    bias[..., 0] = 0.0
    opts = dict(
        num_heads=N,
        causal=True,
        bias=bias,
        q_lengths=np.array([3, 5]),
        impl=impl,
        need_weights=True,
        block_q=2,
        block_k=2,
    )
    y0, res0 = mha_forward(params, x, **opts)
    y1, res1 = mha_forward(params, x, dropout_p=0.5, seed=9, **opts)
    w = res0.weights
    assert w.shape == (B, N, T, T) and np.isfinite(w).all()
    np.testing.assert_array_equal(w[0, :, 3:], 0.0)  # padded queries
    np.testing.assert_allclose(w[1].sum(-1), 1.0, rtol=1e-13)
    assert (w[np.broadcast_to(bias, w.shape) == -np.inf] == 0).all()
    np.testing.assert_allclose(res1.weights, w, rtol=0, atol=1e-15)  # before dropout
    assert not np.allclose(y0, y1)  # ... but dropout did act on the output
    np.testing.assert_array_equal(y0[0, 3:], np.broadcast_to(params["out_bias"], (2, E)))  # masked rows: O = 0


def test_need_weights_false_keeps_none():
    params = mha_init(4, 2)
    _, res = mha_forward(params, np.ones((1, 2, 4)), num_heads=2)
    assert res.weights is None


def test_dropout_seeded_and_deterministic():
    rng = np.random.default_rng(4)
    params = random_params(rng, 8, 2)
    x = rng.standard_normal((2, 6, 8))
    a, _ = mha_forward(params, x, num_heads=2, dropout_p=0.4, seed=5)
    b, _ = mha_forward(params, x, num_heads=2, dropout_p=0.4, seed=5)
    c, _ = mha_forward(params, x, num_heads=2, dropout_p=0.4, seed=6)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    with pytest.raises(ValueError, match="seed"):
        mha_forward(params, x, num_heads=2, dropout_p=0.4)


def test_options_pass_through_to_core():
    """The layer's attention is exactly attention_forward on the projected heads."""
    rng = np.random.default_rng(5)
    B, T, S, E, N, K = 2, 3, 6, 8, 4, 2
    params = random_params(rng, E, N, K=K)
    x, ctx = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E))
    options = dict(
        causal=True,
        align="bottom_right",
        window=(2, None),
        kv_lengths=np.array([6, 4]),
        scale=0.3,
        dropout_p=0.2,
        seed=3,
    )
    y, res = mha_forward(params, x, ctx, num_heads=N, **options)
    H = E // N
    q = (x @ params["q_weight"].T + params["q_bias"]).reshape(B, T, N, H).transpose(0, 2, 1, 3)
    k = (ctx @ params["k_weight"].T + params["k_bias"]).reshape(B, S, K, H).transpose(0, 2, 1, 3)
    v = (ctx @ params["v_weight"].T + params["v_bias"]).reshape(B, S, K, H).transpose(0, 2, 1, 3)
    o, _ = npattn.attention_forward(q, k, v, **options)
    y_ref = o.transpose(0, 2, 1, 3).reshape(B, T, E) @ params["out_weight"].T + params["out_bias"]
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    assert res.lse.shape == (B, N, T) and res.spec.scale == 0.3
    with pytest.raises(ValueError, match="align"):  # T != S causal without align: the core's error
        mha_forward(params, x, ctx, num_heads=N, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dtypes(dtype):
    rng = np.random.default_rng(6)
    params64 = random_params(rng, 8, 2)
    x64 = rng.standard_normal((2, 3, 8))
    params = {n: a.astype(dtype) for n, a in params64.items()}
    y, res = mha_forward(params, x64.astype(dtype), num_heads=2, need_weights=True)
    assert y.dtype == dtype and res.weights.dtype == np.float32
    g = mha_backward(np.ones_like(y), res)
    assert g.dx.dtype == dtype and all(a.dtype == dtype for a in g.dparams.values())
    y_ref, _ = mha_forward(
        {n: a.astype(np.float64) for n, a in params.items()}, x64.astype(dtype).astype(np.float64), num_heads=2
    )
    tol = 1e-5 if dtype == np.float32 else 3e-3
    np.testing.assert_allclose(y.astype(np.float64), y_ref, rtol=tol, atol=tol)


def test_inputs_not_mutated_and_backward_reusable():
    rng = np.random.default_rng(8)
    params = random_params(rng, 8, 4, K=2, kdim=5, vdim=3)
    for a in params.values():
        a.flags.writeable = False
    x, xk, xv = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 5)), rng.standard_normal((2, 4, 3))
    for a in (x, xk, xv):
        a.flags.writeable = False
    y, res = mha_forward(params, x, (xk, xv), num_heads=4)
    dy = rng.standard_normal(y.shape)
    g1, g2 = mha_backward(dy, res), mha_backward(dy, res)
    for name in params:
        np.testing.assert_array_equal(g1.dparams[name], g2.dparams[name])
    assert isinstance(g1, MHAGrads) and list(g1.dparams) == list(params)


# --- initialization -----------------------------------------------------------


def test_init_shapes_bounds_and_defaults():
    E, N = 64, 8
    p = mha_init(E, N)
    assert p["q_weight"].dtype == np.float64
    assert set(p) == {"q_weight", "k_weight", "v_weight", "out_weight", "q_bias", "k_bias", "v_bias", "out_bias"}
    packed = math.sqrt(6 / (E + 3 * E))  # xavier on PyTorch's (3E, E) in_proj_weight
    for name in ("q_weight", "k_weight", "v_weight"):
        assert np.abs(p[name]).max() <= packed and np.abs(p[name]).max() > 0.95 * packed
    assert np.abs(p["out_weight"]).max() <= 1 / math.sqrt(E)
    assert all((p[b] == 0).all() for b in ("q_bias", "k_bias", "v_bias", "out_bias"))
    sep = mha_init(E, N, kdim=16, vdim=32, bias=False, seed=1)
    assert set(sep) == {"q_weight", "k_weight", "v_weight", "out_weight"}
    assert sep["k_weight"].shape == (E, 16) and sep["v_weight"].shape == (E, 32)
    assert np.abs(sep["k_weight"]).max() <= math.sqrt(6 / (16 + E))
    assert np.abs(sep["q_weight"]).max() <= math.sqrt(6 / (2 * E))
    gqa = mha_init(E, N, num_kv_heads=2, dtype=np.float32)
    assert gqa["k_weight"].shape == (16, E) and gqa["k_bias"].shape == (16,) and gqa["q_weight"].dtype == np.float32
    np.testing.assert_array_equal(mha_init(E, N, seed=3)["q_weight"], mha_init(E, N, seed=3)["q_weight"])
    assert not np.array_equal(mha_init(E, N, seed=3)["q_weight"], mha_init(E, N, seed=4)["q_weight"])


def test_class_wrapper():
    layer = MultiheadAttention(8, 4, num_kv_heads=2, seed=2)
    x = np.random.default_rng(0).standard_normal((2, 3, 8))
    y, res = layer(x, causal=True)
    y2, _ = mha_forward(mha_init(8, 4, num_kv_heads=2, seed=2), x, num_heads=4, causal=True)
    np.testing.assert_array_equal(y, y2)
    assert layer.backward(np.ones_like(y), res).dx.shape == x.shape
    adopted = MultiheadAttention(num_heads=4, params=layer.params)
    assert adopted.num_kv_heads == 2 and "num_kv_heads=2" in repr(adopted)


def test_repr_and_dtype_show_the_layer_dtype():
    layer = MultiheadAttention(8, 2)
    assert layer.dtype == np.float64 and repr(layer).endswith(", dtype=float64)")
    single = MultiheadAttention(8, 2, dtype=np.float32)
    assert single.dtype == np.float32 and "dtype=float32" in repr(single)


def test_float32_input_to_a_float64_layer_says_which_dtype_to_make_it_in():
    layer = MultiheadAttention(8, 2)  # float64 by default
    x32 = np.zeros((1, 3, 8), np.float32)
    with pytest.raises(TypeError) as info:
        layer(x32)
    message = str(info.value)
    assert message.startswith("params['q_weight'] has dtype float64 but x has float32; the layer needs one dtype")
    assert "mha_init(..., dtype=x.dtype) (here float32" in message and "cast x to float64" in message
    y, _ = MultiheadAttention(8, 2, dtype=x32.dtype)(x32)  # the suggested fix runs
    assert y.dtype == np.float32
    with pytest.raises(TypeError) as info:  # a context of another dtype: not the params' fault, no mha_init hint
        layer(np.zeros((1, 3, 8)), x32)
    assert str(info.value) == "context has dtype float32 but x has float64; the layer needs one dtype"


# --- bad input ------------------------------------------------------------------


def _gqa_rows(p, rows):
    """``p`` with key/value projections of ``rows`` rows."""
    return {
        **p,
        "k_weight": np.ones((rows, 8)),
        "k_bias": np.ones(rows),
        "v_weight": np.ones((rows, 8)),
        "v_bias": np.ones(rows),
    }


# name: (call(params, x), error, message pattern); params = mha_init(8, 2), x (2, 3, 8)
BAD_INPUTS = {
    "init embed_dim % num_heads": (
        lambda p, x: mha_init(10, 3),
        ValueError,
        r"embed_dim=10 must be divisible by num_heads=3",
    ),
    "init num_heads % num_kv_heads": (
        lambda p, x: mha_init(8, 4, num_kv_heads=3),
        ValueError,
        r"num_heads=4 must be divisible by num_kv_heads=3",
    ),
    "init num_heads type": (lambda p, x: mha_init(8, 2.0), TypeError, r"num_heads must be an int"),
    "forward embed_dim % num_heads": (
        lambda p, x: mha_forward(p, x, num_heads=3),
        ValueError,
        r"embed_dim=8 .* divisible by num_heads=3",
    ),
    "forward num_kv_heads disagrees": (
        lambda p, x: mha_forward(p, x, num_heads=4, num_kv_heads=1),
        ValueError,
        r"num_kv_heads=1, but params\['k_weight'\] has 8 rows",
    ),
    "forward num_heads % inferred kv heads": (
        lambda p, x: mha_forward(_gqa_rows(p, 6), x, num_heads=4),
        ValueError,
        r"num_heads=4 must be divisible by num_kv_heads=3",
    ),
    "params missing key": (
        lambda p, x: mha_forward({k: v for k, v in p.items() if k != "k_weight"}, x, num_heads=2),
        ValueError,
        r"params is missing \['k_weight'\]",
    ),
    "params unknown key": (
        lambda p, x: mha_forward({**p, "q_bais": p["q_bias"]}, x, num_heads=2),
        ValueError,
        r"unknown keys \['q_bais'\]",
    ),
    "params misshapen bias": (
        lambda p, x: mha_forward({**p, "q_bias": np.zeros(7)}, x, num_heads=2),
        ValueError,
        r"params\['q_bias'\] must have shape \(8,\)",
    ),
    "params misshapen out_weight": (
        lambda p, x: mha_forward({**p, "out_weight": np.zeros((8, 4))}, x, num_heads=2),
        ValueError,
        r"params\['out_weight'\] must have shape \(8, 8\)",
    ),
    "params misshapen q_weight": (
        lambda p, x: mha_forward({**p, "q_weight": np.zeros((8, 4))}, x, num_heads=2),
        ValueError,
        r"params\['q_weight'\] must have shape \(embed_dim, embed_dim\)",
    ),
    "params misshapen v_weight": (
        lambda p, x: mha_forward({**p, "v_weight": np.zeros((4, 8))}, x, num_heads=2),
        ValueError,
        r"params\['v_weight'\] must have shape \(8, vdim\)",
    ),
    "params not a dict": (lambda p, x: mha_forward([1, 2], x, num_heads=2), TypeError, r"params must be a dict"),
    "params value not an array": (
        lambda p, x: mha_forward({**p, "q_bias": [0.0] * 8}, x, num_heads=2),
        TypeError,
        r"params\['q_bias'\] must be an array",
    ),
    "x width": (lambda p, x: mha_forward(p, x[..., :6], num_heads=2), ValueError, r"x has width 6 .* embed_dim=8"),
    "x rank": (lambda p, x: mha_forward(p, x[0], num_heads=2), ValueError, r"x must have shape \(B, length, width\)"),
    "context width": (
        lambda p, x: mha_forward(p, x, np.zeros((2, 4, 5)), num_heads=2),
        ValueError,
        r"context has width 5 .* kdim=8",
    ),
    "context batch": (
        lambda p, x: mha_forward(p, x, np.zeros((3, 4, 8)), num_heads=2),
        ValueError,
        r"context has batch size 3, but x has 2",
    ),
    "context triple": (
        lambda p, x: mha_forward(p, x, (x, x, x), num_heads=2),
        ValueError,
        r"context must be an array or a pair",
    ),
    "x dtype": (
        lambda p, x: mha_forward(p, x.astype(np.float32), num_heads=2),
        TypeError,
        r"has dtype float64 but x has float32",
    ),
    "x integer": (
        lambda p, x: mha_forward({k: v.astype(np.int64) for k, v in p.items()}, x.astype(np.int64), num_heads=2),
        TypeError,
        r"x must have a real floating dtype",
    ),
    "mask polarity type": (
        lambda p, x: mha_forward(p, x, num_heads=2, mask=np.ones((3, 3))),
        TypeError,
        r"mask must be a bool",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input(name):
    call, error, pattern = BAD_INPUTS[name]
    params = mha_init(8, 2)
    x = np.zeros((2, 3, 8))
    with pytest.raises(error, match=pattern):
        call(params, x)


def test_bad_cross_attention_layouts():
    cross = mha_init(8, 2, kdim=5, vdim=3)
    x = np.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"cross-attention \(kdim=5, vdim=3, embed_dim=8\); pass context"):
        mha_forward(cross, x, num_heads=2)
    with pytest.raises(ValueError, match=r"kdim=5 != vdim=3: pass context as a pair"):
        mha_forward(cross, x, np.zeros((2, 4, 5)), num_heads=2)
    with pytest.raises(ValueError, match=r"context\[1\] \(value source\) has width 5 .* vdim=3"):
        mha_forward(cross, x, (np.zeros((2, 4, 5)), np.zeros((2, 4, 5))), num_heads=2)
    with pytest.raises(ValueError, match=r"one length S"):
        mha_forward(cross, x, (np.zeros((2, 4, 5)), np.zeros((2, 5, 3))), num_heads=2)


def test_bad_backward_input():
    params = mha_init(8, 2)
    y, res = mha_forward(params, np.zeros((2, 3, 8)), num_heads=2)
    with pytest.raises(ValueError, match=r"dy must have y's shape \(2, 3, 8\)"):
        mha_backward(np.zeros((2, 3, 4)), res)
    with pytest.raises(TypeError, match=r"dy must have y's dtype float64"):
        mha_backward(np.zeros((2, 3, 8), np.float32), res)
    with pytest.raises(TypeError, match=r"residuals must come from npattn.mha_forward"):
        mha_backward(y, res.attention)


def test_layer_dims_reads_gqa():
    assert layer_dims(mha_init(12, 6, num_kv_heads=3, kdim=5), num_heads=6) == (12, 6, 3, 2, 5, 12)


# --- backend matrix -------------------------------------------------------------


def test_backends_match_numpy(backend):
    """Forward and backward on every backend equal NumPy's; inputs unchanged."""
    rng = np.random.default_rng(11)
    B, T, S, E, N, K = 2, 3, 4, 8, 4, 2
    params = random_params(rng, E, N, K=K, kdim=5, vdim=3)
    x, xk, xv = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, 5)), rng.standard_normal((B, S, 3))
    mask = rng.random((B, 1, T, S)) > 0.3
    bias = rng.standard_normal((N, 1, S))
    options = dict(
        num_heads=N,
        mask=mask,
        bias=bias,
        causal=True,
        align="bottom_right",
        kv_lengths=np.array([4, 3]),
        dropout_p=0.25,
        seed=2,
        need_weights=True,
    )
    y_ref, res_ref = mha_forward(params, x, (xk, xv), **options)
    dy = rng.standard_normal(y_ref.shape)
    g_ref = mha_backward(dy, res_ref)

    to = backend.asarray
    b_params = {n: to(a) for n, a in params.items()}
    b_x, b_xk, b_xv, b_dy = to(x), to(xk), to(xv), to(dy)
    b_options = {**options, "mask": to(mask), "bias": to(bias), "kv_lengths": to(options["kv_lengths"])}
    before = {n: backend.to_numpy(a).copy() for n, a in {**b_params, "x": b_x, "xk": b_xk, "xv": b_xv}.items()}
    y, res = mha_forward(b_params, b_x, (b_xk, b_xv), **b_options)
    g = mha_backward(b_dy, res)
    back = backend.to_numpy
    np.testing.assert_allclose(back(y), y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(back(res.weights), res_ref.weights, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(back(g.dx), g_ref.dx, rtol=1e-12, atol=1e-12)
    for got, want in zip(g.dcontext, g_ref.dcontext):
        np.testing.assert_allclose(back(got), want, rtol=1e-12, atol=1e-12)
    for n in params:
        np.testing.assert_allclose(back(g.dparams[n]), g_ref.dparams[n], rtol=1e-11, atol=1e-12, err_msg=n)
    np.testing.assert_allclose(back(g.dbias), g_ref.dbias, rtol=1e-12, atol=1e-12)
    after = {n: back(a) for n, a in {**b_params, "x": b_x, "xk": b_xk, "xv": b_xv}.items()}
    for n in before:
        np.testing.assert_array_equal(after[n], before[n], err_msg=f"{n} was mutated")


def test_init_on_backends(backend):
    """mha_init on a backend's namespace and device draws NumPy's values."""
    import array_api_compat

    probe = backend.asarray(np.zeros(1))
    xp = array_api_compat.array_namespace(probe)
    p = mha_init(8, 2, num_kv_heads=1, dtype=xp.float64, xp=xp, device=array_api_compat.device(probe))
    ref = mha_init(8, 2, num_kv_heads=1)
    for n in ref:
        np.testing.assert_array_equal(backend.to_numpy(p[n]), ref[n])
        assert array_api_compat.device(p[n]) == array_api_compat.device(probe)


# --- property test --------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    kind=st.sampled_from(["self", "single", "pair"]),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 2), (4, 2), (4, 1)]),
    head_dim=st.integers(1, 3),
    B=st.integers(1, 2),
    T=st.integers(1, 4),
    S=st.integers(1, 5),
    causal=st.booleans(),
    align=st.sampled_from(["top_left", "bottom_right"]),
    with_mask=st.booleans(),
    with_bias=st.booleans(),
    with_lengths=st.booleans(),
    dropout=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_gradients_and_paths(
    kind, heads, head_dim, B, T, S, causal, align, with_mask, with_bias, with_lengths, dropout, seed
):
    """Random layouts and options: the random-VJP central-difference check of
    every input and parameter passes, and chunked equals dense."""
    N, K = heads
    E = N * head_dim
    rng = np.random.default_rng(seed)
    if kind == "self":
        S = T
    kdim, vdim = (E, E) if kind != "pair" else (int(rng.integers(1, 5)), int(rng.integers(1, 5)))
    params = random_params(rng, E, N, K=K, kdim=kdim, vdim=vdim, bias=bool(rng.integers(2)))
    x = rng.standard_normal((B, T, E))
    context = {
        "self": None,
        "single": rng.standard_normal((B, S, E)),
        "pair": (rng.standard_normal((B, S, kdim)), rng.standard_normal((B, S, vdim))),
    }[kind]
    options = {"num_heads": N, "causal": causal, "align": align}
    if with_mask:
        options["mask"] = rng.random((B, 1, T, S)) > 0.3  # fully masked rows allowed
    if with_bias:
        options["bias"] = rng.standard_normal((N, T, S))
    if with_lengths:
        options["q_lengths"] = rng.integers(0, T + 1, size=B)
        options["kv_lengths"] = rng.integers(0, S + 1, size=B)
    if dropout:
        options.update(dropout_p=0.3, seed=seed)
    result = gradcheck_mha(params, x, context, {**options, "impl": "dense"}, jacobian=False)
    assert result.ok
    if HAS_CHUNKED:
        y_d, res_d = mha_forward(params, x, context, impl="dense", need_weights=True, **options)
        y_c, res_c = mha_forward(params, x, context, impl="chunked", need_weights=True, block_q=2, block_k=3, **options)
        np.testing.assert_allclose(y_c, y_d, rtol=0, atol=1e-12)
        np.testing.assert_allclose(res_c.weights, res_d.weights, rtol=0, atol=1e-12)
        dy = rng.standard_normal(y_d.shape)
        g_d, g_c = mha_backward(dy, res_d), mha_backward(dy, res_c)
        np.testing.assert_allclose(g_c.dx, g_d.dx, rtol=0, atol=1e-11)
        for name in params:
            np.testing.assert_allclose(g_c.dparams[name], g_d.dparams[name], rtol=0, atol=1e-11, err_msg=name)


# --- variants: sinks, softcap, ALiBi, segment ids (issue 14) ------------------


def reference_mha_variants(params, x, key_source, value_source, *, num_heads, causal=False, **variants):
    """Plain float64 NumPy MHA with the score pipeline's variants, one
    (batch, head, query) at a time; no code shared with npattn. ``variants``:
    ``softcap``, ``bias`` (broadcastable to (B, N, T, S)), ``alibi_slopes``
    (N,), ``q_segment_ids`` (B, T), ``kv_segment_ids`` (B, S), ``q_lengths``
    (B,) (padded rows: out 0, no sink); sinks from ``params["sinks"]``. Query i sits at
    position ``i + S - T`` (bottom-right; T == S is top-left). Returns
    ``(y, weights)`` with the sink's share left out of the weights."""
    p = {name: np.asarray(a, np.float64) for name, a in params.items()}
    B, T, E = x.shape
    S, N = key_source.shape[1], num_heads
    H = E // N
    K = p["k_weight"].shape[0] // H
    q = x @ p["q_weight"].T + p.get("q_bias", 0.0)
    k = key_source @ p["k_weight"].T + p.get("k_bias", 0.0)
    v = value_source @ p["v_weight"].T + p.get("v_bias", 0.0)
    cap, slopes = variants.get("softcap"), variants.get("alibi_slopes")
    q_ids, kv_ids = variants.get("q_segment_ids"), variants.get("kv_segment_ids")
    bias = np.broadcast_to(variants.get("bias", 0.0), (B, N, T, S))
    q_lengths = variants.get("q_lengths", np.full(B, T))
    merged, weights = np.zeros((B, T, E)), np.zeros((B, N, T, S))
    for b, n, i in itertools.product(range(B), range(N), range(T)):
        if i >= q_lengths[b]:
            continue
        g, position = n // (N // K), i + S - T
        kh, vh = k[b, :, g * H : (g + 1) * H], v[b, :, g * H : (g + 1) * H]
        scores = kh @ q[b, i, n * H : (n + 1) * H] / math.sqrt(H)  # (S,)
        if cap is not None:
            scores = cap * np.tanh(scores / cap)
        scores = scores + bias[b, n, i]
        if slopes is not None:
            scores = scores - slopes[n] * np.abs(position - np.arange(S))
        visible = np.arange(S) <= position if causal else np.ones(S, bool)
        if q_ids is not None:
            visible &= kv_ids[b] == q_ids[b, i]
        logits = list(scores[visible]) + ([p["sinks"][n]] if "sinks" in p else [])
        if not logits:
            continue
        m = max(logits)
        denominator = sum(math.exp(s - m) for s in logits)
        weights[b, n, i] = np.where(visible, np.exp(scores - m) / denominator, 0.0)
        merged[b, i, n * H : (n + 1) * H] = weights[b, n, i] @ vh
    return merged @ p["out_weight"].T + p.get("out_bias", 0.0), weights


def _packed_ids(rng, B, L):
    """Sorted segment ids (packed documents) of shape (B, L), 1-3 documents a row."""
    return np.sort(rng.integers(0, 3, size=(B, L)), axis=1)


# name: (kind, E, N, K, B, T, S, sinks, options builder(rng, B, N, T, S))
VARIANT_CASES = {
    "self-sinks": ("self", 8, 2, 2, 2, 4, 4, True, lambda rng, B, N, T, S: {"causal": True}),
    "self-softcap-alibi-gqa": (
        "self",
        8,
        4,
        2,
        2,
        4,
        4,
        False,
        lambda rng, B, N, T, S: {"softcap": 0.7, "alibi_slopes": rng.uniform(0.1, 1.0, N), "causal": True},
    ),
    "self-sinks-segments-lengths": (
        "self",
        8,
        2,
        1,
        2,
        5,
        5,
        True,
        lambda rng, B, N, T, S: {"q_segment_ids": _packed_ids(rng, B, T), "q_lengths": np.array([5, 3])},
    ),
    "self-everything": (
        "self",
        8,
        4,
        2,
        2,
        4,
        4,
        True,
        lambda rng, B, N, T, S: {
            "softcap": 1.5,
            "alibi_slopes": rng.uniform(0.1, 1.0, N),
            "q_segment_ids": _packed_ids(rng, B, T),
            "bias": rng.standard_normal((N, T, S)),
            "causal": True,
        },
    ),
    "pair-sinks-alibi-segments": (
        "pair",
        8,
        2,
        2,
        2,
        3,
        5,
        True,
        lambda rng, B, N, T, S: {
            "alibi_slopes": rng.uniform(0.1, 1.0, N),
            "align": "bottom_right",
            "q_segment_ids": _packed_ids(rng, B, T),
            "kv_segment_ids": _packed_ids(rng, B, S),
        },
    ),
}


def _variant_problem(case, seed=0):
    kind, E, N, K, B, T, S, sinks, make_options = VARIANT_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)) + seed)
    params = random_params(rng, E, N, K=K, kdim=5 if kind == "pair" else None, vdim=3 if kind == "pair" else None)
    if sinks:
        params["sinks"] = rng.standard_normal(N)
    x = rng.standard_normal((B, T, E))
    context = None if kind == "self" else (rng.standard_normal((B, S, 5)), rng.standard_normal((B, S, 3)))
    return params, x, context, {"num_heads": N, "num_kv_heads": K, **make_options(rng, B, N, T, S)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_variant_gradients_central_differences(case, impl):
    """Full Jacobians in float64 of x, the context, every parameter
    (params["sinks"] included), the bias and the ALiBi slopes."""
    params, x, context, options = _variant_problem(case)
    options = {**options, "impl": impl, **(CHUNKED_BLOCKS if impl == "chunked" else {})}
    result = gradcheck_mha(params, x, context, options)
    assert result.ok and result.jacobian_checked
    assert max(result.max_abs_error.values()) < 1e-7
    if "sinks" in params:
        assert "sinks" in result.max_abs_error


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_variant_forward_and_weights_match_oracle(case, impl):
    """Output and need_weights against the independent oracle; with sinks
    each row of the weights sums to 1 - P_sink."""
    params, x, context, options = _variant_problem(case, seed=1)
    key_source, value_source = (x, x) if context is None else context
    exact = {k: v for k, v in options.items() if k not in ("num_kv_heads", "align")}
    if context is None and "q_segment_ids" in exact:
        exact["kv_segment_ids"] = exact["q_segment_ids"]
    y_ref, w_ref = reference_mha_variants(params, x, key_source, value_source, **exact)
    y, res = mha_forward(params, x, context, impl=impl, need_weights=True, block_q=2, block_k=3, **options)
    np.testing.assert_allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(res.weights, w_ref, rtol=1e-12, atol=1e-14)
    if "sinks" in params:
        rows = np.arange(x.shape[1]) < np.asarray(options.get("q_lengths", x.shape[1]))[..., None, None]  # (B|1, 1, T)
        p_sink = np.where(rows, np.exp(params["sinks"][:, None] - res.lse), 0.0)  # (B, N, T); padded rows: none
        np.testing.assert_allclose(res.weights.sum(-1), np.where(rows, 1.0 - p_sink, 0.0), rtol=1e-12, atol=1e-14)
        assert (p_sink[np.broadcast_to(rows, p_sink.shape)] > 0).all() and (p_sink < 1).all()


@NO_CHUNKED
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_variant_chunked_equals_dense(case):
    """Outputs, rebuilt weights (lengths, bias and fully hidden rows
    included) and every gradient agree between the paths."""
    params, x, context, options = _variant_problem(case, seed=2)
    y_d, res_d = mha_forward(params, x, context, impl="dense", need_weights=True, **options)
    y_c, res_c = mha_forward(params, x, context, impl="chunked", need_weights=True, **CHUNKED_BLOCKS, **options)
    np.testing.assert_allclose(y_c, y_d, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res_c.weights, res_d.weights, rtol=0, atol=1e-13)
    dy = np.random.default_rng(3).standard_normal(y_d.shape)
    g_d, g_c = mha_backward(dy, res_d), mha_backward(dy, res_c)
    np.testing.assert_allclose(g_c.dx, g_d.dx, rtol=0, atol=1e-12)
    for name in params:
        np.testing.assert_allclose(g_c.dparams[name], g_d.dparams[name], rtol=0, atol=1e-11, err_msg=name)
    for field in ("dbias", "dalibi_slopes"):
        if getattr(g_d, field) is not None:
            np.testing.assert_allclose(getattr(g_c, field), getattr(g_d, field), rtol=0, atol=1e-11, err_msg=field)


def test_variants_pass_through_to_core():
    """The layer's attention is attention_forward on the projected heads with
    sinks=params["sinks"] and the variants as given; dsinks and dalibi_slopes
    are the core's."""
    params, x, context, options = _variant_problem("pair-sinks-alibi-segments", seed=4)
    B, T, E = x.shape
    N, K, S = options["num_heads"], options["num_kv_heads"], context[0].shape[1]
    H = E // N
    y, res = mha_forward(params, x, context, **options)
    q = (x @ params["q_weight"].T + params["q_bias"]).reshape(B, T, N, H).transpose(0, 2, 1, 3)
    k = (context[0] @ params["k_weight"].T + params["k_bias"]).reshape(B, S, K, H).transpose(0, 2, 1, 3)
    v = (context[1] @ params["v_weight"].T + params["v_bias"]).reshape(B, S, K, H).transpose(0, 2, 1, 3)
    core = {k_: v_ for k_, v_ in options.items() if k_ not in ("num_heads", "num_kv_heads")}
    o, res_core = npattn.attention_forward(q, k, v, sinks=params["sinks"], **core)
    y_ref = o.transpose(0, 2, 1, 3).reshape(B, T, E) @ params["out_weight"].T + params["out_bias"]
    np.testing.assert_allclose(y, y_ref, rtol=1e-13, atol=1e-13)
    dy = np.random.default_rng(5).standard_normal(y.shape)
    g = mha_backward(dy, res)
    do = (dy @ params["out_weight"]).reshape(B, T, N, H).transpose(0, 2, 1, 3)
    g_core = npattn.attention_backward(do, res_core)
    np.testing.assert_allclose(g.dparams["sinks"], g_core.dsinks, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(g.dalibi_slopes, g_core.dalibi_slopes, rtol=1e-12, atol=1e-13)
    assert g.dparams["sinks"].shape == (N,) and g.dalibi_slopes.shape == (N,)


def test_self_attention_kv_segment_ids_default_to_q_segment_ids():
    params, x, _, options = _variant_problem("self-sinks-segments-lengths", seed=6)
    ids = options.pop("q_segment_ids")
    y1, _ = mha_forward(params, x, q_segment_ids=ids, **options)
    y2, _ = mha_forward(params, x, q_segment_ids=ids, kv_segment_ids=ids, **options)
    y3, _ = mha_forward(params, x, **options)
    np.testing.assert_array_equal(y1, y2)
    assert not np.allclose(y1, y3)  # the ids did hide keys


def test_sinks_hidden_rows_and_dtypes():
    """A row whose keys are all hidden gives the sink all its mass: out 0
    before the out projection, weights 0, lse = sinks; float32 params keep
    float32 dparams["sinks"]."""
    rng = np.random.default_rng(7)
    params = random_params(rng, 8, 2, sinks=True)
    x = rng.standard_normal((1, 3, 8))
    mask = np.ones((1, 1, 3, 3), bool)
    mask[..., 1, :] = False  # query 1 sees no key
    for impl in ("dense", "chunked"):
        y, res = mha_forward(params, x, num_heads=2, mask=mask, need_weights=True, impl=impl)
        np.testing.assert_array_equal(res.weights[0, :, 1], 0.0)
        np.testing.assert_allclose(res.lse[0, :, 1], params["sinks"], rtol=1e-15)
        np.testing.assert_allclose(y[0, 1], params["out_bias"], rtol=1e-15)
    p32 = {n: a.astype(np.float32) for n, a in params.items()}
    y, res = mha_forward(p32, x.astype(np.float32), num_heads=2, softcap=2.0, alibi_slopes=np.ones(2, np.float32))
    g = mha_backward(np.ones_like(y), res)
    assert g.dparams["sinks"].dtype == np.float32 and g.dalibi_slopes.dtype == np.float32


def test_init_with_sinks():
    p = mha_init(8, 4, num_kv_heads=2, sinks=True, dtype=np.float32, seed=3)
    assert p["sinks"].shape == (4,) and p["sinks"].dtype == np.float32 and (p["sinks"] == 0).all()
    plain = mha_init(8, 4, num_kv_heads=2, dtype=np.float32, seed=3)
    assert set(p) - set(plain) == {"sinks"}
    for name in plain:  # sinks draw nothing: the same seed gives the same weights
        np.testing.assert_array_equal(p[name], plain[name])
    with pytest.raises(TypeError, match=r"sinks must be a bool, got 1"):
        mha_init(8, 4, sinks=1)
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    y, _ = mha_forward(p, x, num_heads=4)  # zero sinks still act: every row loses some mass to the sink
    y_plain, _ = mha_forward(plain, x, num_heads=4)
    assert not np.allclose(y, y_plain)


def test_class_with_sinks():
    layer = MultiheadAttention(8, 2, sinks=True, seed=1)
    assert layer.has_sinks and layer.params["sinks"].shape == (2,)
    assert repr(layer) == (
        "MultiheadAttention(embed_dim=8, num_heads=2, num_kv_heads=2, kdim=8, vdim=8, sinks=True, dtype=float64)"
    )
    assert "sinks=False" in repr(MultiheadAttention(8, 2))
    x = np.random.default_rng(1).standard_normal((2, 4, 8))
    y, res = layer(x, causal=True, softcap=5.0, alibi_slopes=npattn.alibi_slopes(2))
    g = layer.backward(np.ones_like(y), res)
    assert g.dparams["sinks"].shape == (2,) and g.dalibi_slopes.shape == (2,)
    assert MultiheadAttention(num_heads=2, params=layer.params).has_sinks  # sinks=None adopts
    assert MultiheadAttention(num_heads=2, params=layer.params, sinks=True).has_sinks
    with pytest.raises(ValueError, match=r"sinks=True, but params has no 'sinks' key: make them with mha_init"):
        MultiheadAttention(num_heads=2, params=mha_init(8, 2), sinks=True)
    with pytest.raises(ValueError, match=r"sinks=False, but params has 'sinks'; pass sinks=None"):
        MultiheadAttention(num_heads=2, params=layer.params, sinks=False)
    with pytest.raises(TypeError, match=r"sinks must be a bool or None, got 'yes'"):
        MultiheadAttention(num_heads=2, params=layer.params, sinks="yes")


# name: (call(params, x), error, pattern); params = mha_init(8, 2, sinks=True), x (2, 3, 8)
VARIANT_BAD_INPUTS = {
    "sinks of another shape": (
        lambda p, x: mha_forward({**p, "sinks": np.zeros(4)}, x, num_heads=2),
        ValueError,
        r"params\['sinks'\] must have shape \(num_heads,\) = \(2,\), one sink per query head, got \(4,\)",
    ),
    "sinks per batch": (
        lambda p, x: mha_forward({**p, "sinks": np.zeros((2, 2))}, x, num_heads=2),
        ValueError,
        r"params\['sinks'\] must have shape \(num_heads,\)",
    ),
    "sinks of another dtype": (
        lambda p, x: mha_forward({**p, "sinks": np.zeros(2, np.float32)}, x, num_heads=2),
        TypeError,
        r"params\['sinks'\] has dtype float32 but x has float64",
    ),
    "sinks not an array": (
        lambda p, x: mha_forward({**p, "sinks": [0.0, 0.0]}, x, num_heads=2),
        TypeError,
        r"params\['sinks'\] must be an array",
    ),
    "sinks as an argument": (
        lambda p, x: mha_forward(p, x, num_heads=2, sinks=np.zeros(2)),
        TypeError,
        r"unexpected keyword argument 'sinks'",
    ),
    "q_segment_ids of another shape": (
        lambda p, x: mha_forward(p, x, num_heads=2, q_segment_ids=np.zeros((3, 2), int)),
        ValueError,
        r"q_segment_ids must have shape \(B, T\) = \(2, 3\) \(batch first, like x\), got \(3, 2\)",
    ),
    "q_segment_ids per head": (
        lambda p, x: mha_forward(p, x, num_heads=2, q_segment_ids=np.zeros((2, 2, 3), int)),
        ValueError,
        r"q_segment_ids must have shape \(B, T\) = \(2, 3\)",
    ),
    "q_segment_ids float": (
        lambda p, x: mha_forward(p, x, num_heads=2, q_segment_ids=np.zeros((2, 3))),
        TypeError,
        r"q_segment_ids must have an integer dtype, got float64",
    ),
    "q_segment_ids a list": (
        lambda p, x: mha_forward(p, x, num_heads=2, q_segment_ids=[[0, 0, 0]] * 2),
        TypeError,
        r"q_segment_ids must be an array",
    ),
    "kv_segment_ids alone": (
        lambda p, x: mha_forward(p, x, num_heads=2, kv_segment_ids=np.zeros((2, 3), int)),
        ValueError,
        r"kv_segment_ids was given without q_segment_ids",
    ),
    "kv_segment_ids of another shape": (
        lambda p, x: mha_forward(
            p, x, num_heads=2, q_segment_ids=np.zeros((2, 3), int), kv_segment_ids=np.zeros(3, int)
        ),
        ValueError,
        r"kv_segment_ids must have shape \(2, 3\)",
    ),
    "cross-attention without kv_segment_ids": (
        lambda p, x: mha_forward(p, x, np.zeros((2, 4, 8)), num_heads=2, q_segment_ids=np.zeros((2, 3), int)),
        ValueError,
        r"cross-attention needs kv_segment_ids \(B, S\)",
    ),
    "alibi with T != S and no align": (
        lambda p, x: mha_forward(p, x, np.zeros((2, 4, 8)), num_heads=2, alibi_slopes=np.ones(2)),
        ValueError,
        r"align",
    ),
    "alibi slopes of another length": (
        lambda p, x: mha_forward(p, x, num_heads=2, alibi_slopes=np.ones(3)),
        ValueError,
        r"alibi_slopes must have shape \(N,\) = \(2,\)",
    ),
    "softcap zero": (lambda p, x: mha_forward(p, x, num_heads=2, softcap=0.0), ValueError, r"softcap must be"),
}


@pytest.mark.parametrize("name", list(VARIANT_BAD_INPUTS))
def test_variant_bad_input(name):
    call, error, pattern = VARIANT_BAD_INPUTS[name]
    with pytest.raises(error, match=pattern):
        call(mha_init(8, 2, sinks=True), np.zeros((2, 3, 8)))


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(["self", "pair"]),
    heads=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    B=st.integers(1, 2),
    T=st.integers(1, 4),
    S=st.integers(1, 5),
    sinks=st.booleans(),
    softcap=st.sampled_from([None, 0.5, 3.0]),
    alibi=st.booleans(),
    segments=st.booleans(),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_variant_gradients_and_paths(kind, heads, B, T, S, sinks, softcap, alibi, segments, causal, seed):
    """Random variants: the random-VJP check of every input and parameter
    passes on the dense path, and chunked equals dense (weights included)."""
    N, K = heads
    E = 2 * N
    rng = np.random.default_rng(seed)
    S = T if kind == "self" else S
    params = random_params(rng, E, N, K=K, kdim=3 if kind == "pair" else None, vdim=2 if kind == "pair" else None)
    if sinks:
        params["sinks"] = rng.standard_normal(N)
    x = rng.standard_normal((B, T, E))
    context = None if kind == "self" else (rng.standard_normal((B, S, 3)), rng.standard_normal((B, S, 2)))
    options = {"num_heads": N, "softcap": softcap, "causal": causal, "align": "bottom_right"}
    if alibi:
        options["alibi_slopes"] = rng.uniform(0.05, 1.0, N)
    if segments:
        options["q_segment_ids"] = _packed_ids(rng, B, T)
        if kind == "pair":
            options["kv_segment_ids"] = _packed_ids(rng, B, S)
    assert gradcheck_mha(params, x, context, {**options, "impl": "dense"}, jacobian=False).ok
    y_d, res_d = mha_forward(params, x, context, impl="dense", need_weights=True, **options)
    y_c, res_c = mha_forward(params, x, context, impl="chunked", need_weights=True, block_q=2, block_k=3, **options)
    np.testing.assert_allclose(y_c, y_d, rtol=0, atol=1e-12)
    np.testing.assert_allclose(res_c.weights, res_d.weights, rtol=0, atol=1e-12)
    dy = rng.standard_normal(y_d.shape)
    g_d, g_c = mha_backward(dy, res_d), mha_backward(dy, res_c)
    for name in params:
        np.testing.assert_allclose(g_c.dparams[name], g_d.dparams[name], rtol=0, atol=1e-11, err_msg=name)


def test_variants_on_backends(backend):
    """Sinks, softcap, ALiBi and segment ids on every backend equal NumPy's,
    forward, weights and gradients; inputs unchanged."""
    params, x, context, options = _variant_problem("pair-sinks-alibi-segments", seed=8)
    options = {**options, "softcap": 2.0, "need_weights": True}
    y_ref, res_ref = mha_forward(params, x, context, **options)
    dy = np.random.default_rng(9).standard_normal(y_ref.shape)
    g_ref = mha_backward(dy, res_ref)
    to, back = backend.asarray, backend.to_numpy
    arrays = {"alibi_slopes", "q_segment_ids", "kv_segment_ids"}
    b_params = {n: to(a) for n, a in params.items()}
    b_options = {k: to(v) if k in arrays else v for k, v in options.items()}
    b_context = tuple(to(c) for c in context)
    before = {n: back(a).copy() for n, a in b_params.items()}
    for impl in ("dense", "chunked"):
        y, res = mha_forward(b_params, to(x), b_context, impl=impl, block_q=2, block_k=3, **b_options)
        g = mha_backward(to(dy), res)
        np.testing.assert_allclose(back(y), y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(back(res.weights), res_ref.weights, rtol=1e-12, atol=1e-13)
        for n in params:
            np.testing.assert_allclose(back(g.dparams[n]), g_ref.dparams[n], rtol=1e-11, atol=1e-12, err_msg=n)
        np.testing.assert_allclose(back(g.dalibi_slopes), g_ref.dalibi_slopes, rtol=1e-11, atol=1e-12)
    for n in before:
        np.testing.assert_array_equal(back(b_params[n]), before[n], err_msg=f"{n} was mutated")


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_score_mods_pass_through_the_layer_with_their_parameter_gradients(impl):
    """``score_mods`` and ``mask_mod`` reach the core; ``MHAGrads.dmods`` holds
    the modifications' parameter gradients, checked by central differences
    in float64 through the whole layer."""
    rng = np.random.default_rng(11)
    B, T, E, N = 2, 7, 8, 4
    params = mha_init(E, N, num_kv_heads=2, seed=3)
    x = rng.standard_normal((B, T, E))
    dy = rng.standard_normal((B, T, E))
    table = rng.standard_normal((N, 8))

    def loss(table):
        mods = [npattn.relative_position_bias(table, max_distance=16), npattn.head_temperature(np.full(N, 0.7))]
        y, res = mha_forward(
            params,
            x,
            num_heads=N,
            causal=True,
            impl=impl,
            block_q=3,
            block_k=2,
            score_mods=mods,
            mask_mod=lambda idx: idx.q - idx.k != 1,
        )
        return float(np.sum(y * dy)), res

    _, res = loss(table)
    grads = mha_backward(dy, res)
    assert sorted(grads.dmods) == ["relative_bias", "temperature"]
    eps = 1e-6
    for index in [(0, 0), (1, 3), (3, 7)]:
        up, down = table.copy(), table.copy()
        up[index] += eps
        down[index] -= eps
        numeric = (loss(up)[0] - loss(down)[0]) / (2 * eps)
        np.testing.assert_allclose(grads.dmods["relative_bias"][index], numeric, rtol=1e-6, atol=1e-8)
    plain_y, _ = mha_forward(params, x, num_heads=N, causal=True, impl=impl)
    assert not np.allclose(plain_y, mha_forward(params, x, num_heads=N, causal=True, score_mods=res.spec.score_mods)[0])


def test_the_layers_auto_follows_attentions_own_rule():
    """``impl="auto"`` in the layer picks the path exactly as
    :func:`npattn.attention_forward` does on the split heads: the NumPy fast
    path from AUTO_FAST_MIN_SCORES (2**21) scores, its projections sharing
    npattn's pool (:mod:`npattn.linear_numpy`) rather than leaving BLAS
    threads spinning beside it; a forced impl passes through."""
    from npattn.options import AUTO_FAST_MIN_SCORES

    params = mha_init(16, 8, seed=0, dtype=np.float32)  # H = 2: small arrays, many scores
    rng = np.random.default_rng(0)

    def kernel(T, **options):
        x = rng.standard_normal((1, T, 16), dtype=np.float32)
        return mha_forward(params, x, num_heads=8, **options)[1].attention.spec.impl

    assert 8 * 511 * 511 < AUTO_FAST_MIN_SCORES <= 8 * 513 * 513
    assert kernel(511) == kernel(513, impl="dense") == "dense"
    assert kernel(513) == kernel(511, impl="chunked") == "chunked"
    for T in (511, 513):
        q = rng.standard_normal((1, 8, T, 2), dtype=np.float32)
        assert npattn.attention_forward(q, q, q)[1].spec.impl == kernel(T)
    with pytest.raises(ValueError, match="impl"):
        kernel(16, impl="fast")
