"""User score and mask modifications (issue 15; CONVENTIONS §1b steps 4 and 5):
``npattn.ScoreMod``, ``mask_mod``, ``npattn.block_mask`` and the shipped
``softcap_mod``, ``alibi_mod``, ``head_temperature`` and T5's
``relative_position_bias``.

- every path against dense in float64 to 1e-12 (out, lse, dq, dk, dv, dbias,
  dsinks, dalibi_slopes and every ``dmods`` entry): hypothesis draws shapes,
  tile sizes (1 and sizes that do not divide T or S), one shipped or custom
  modification or a chain of two, with every mask feature and variant
  (causal both alignments, window, bool mask, bias, lengths, GQA/MQA,
  dropout, segment ids, sinks, built-in softcap and ALiBi) and a mask
  modification, plain or as a block mask, on the NumPy fast path and on the
  generic chunked path (``NPATTN_FAST_NUMPY=0``);
- an independent float64 oracle for the forward: the modifications written
  out by hand on the full score matrix (T5's bucket function as in the T5
  code), turned into an explicit bias for ``tests/reference.py``;
- central differences in float64 (full Jacobian) for q, k, v, the built-in
  parameters and each modification's parameters, on the dense path and
  directly on both chunked kernels;
- the shipped ``softcap_mod``/``alibi_mod`` equal the built-in ``softcap=`` /
  ``alibi_slopes=`` (``dmods["slopes"] == dalibi_slopes``);
- parameter gradients bit-identical whatever the thread count, equal across
  tile sizes;
- block masks: tiles skipped (counted) on both chunked kernels, results equal
  to ``mask_mod`` alone and to the explicit bool ``mask=``;
- bad input: clear TypeError/ValueError naming what is wrong;
- the backend matrix (NumPy, read-only NumPy, array-api-strict on both
  devices, torch): equal to NumPy, and no input or parameter mutated.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_attention
from strategies import ALL_FEATURES, attention_cases

import npattn
import npattn.chunked as chunked
from npattn import fast_numpy

RNG = np.random.default_rng(1515)

#: The paths: attention_forward's options and the NPATTN_FAST_NUMPY setting
#: (None: left as it is), and the kernel the residuals must name.
PATHS = {
    "dense": (dict(impl="dense"), None, None),
    "fast": (dict(impl="chunked"), "1", "numpy"),
    "generic": (dict(impl="chunked"), "0", "generic"),
}
CHUNKED = ("fast", "generic")


@contextlib.contextmanager
def on_path(path: str):
    """Yield the path's options with ``NPATTN_FAST_NUMPY`` set for it (a
    context, not the monkeypatch fixture, so it also works under @given)."""
    options, fast, _ = PATHS[path]
    with pytest.MonkeyPatch.context() as patch:
        if fast is not None:
            patch.setenv("NPATTN_FAST_NUMPY", fast)
        yield dict(options)


def _qkv(batch=(2,), N=2, K=2, T=3, S=4, H=2, Hv=2, rng=RNG):
    return (
        rng.standard_normal((*batch, N, T, H)),
        rng.standard_normal((*batch, K, S, H)),
        rng.standard_normal((*batch, K, S, Hv)),
    )


def _run(path, q, k, v, dout=None, dlse=None, **options) -> dict:
    """Every result of forward and backward on ``path``, by name: out, lse,
    dq, dk, dv, the built-in parameters' gradients that are not None, and
    ``dmods[name]`` for each modification parameter."""
    with on_path(path) as path_options:
        out, res = npattn.attention_forward(q, k, v, **{**path_options, **options})
        if dout is None:
            dout = np.random.default_rng(3).standard_normal(out.shape)
        g = npattn.attention_backward(dout, res, dlse=dlse)
    assert getattr(res, "kernel", None) == PATHS[path][2], "the path did not run the kernel it names"
    results = {"out": out, "lse": res.lse, "dq": g.dq, "dk": g.dk, "dv": g.dv}
    for name in ("dbias", "dsinks", "dalibi_slopes"):
        if getattr(g, name) is not None:
            results[name] = getattr(g, name)
    assert (g.dmods is None) == (not options.get("score_mods"))
    for name, grad in (g.dmods or {}).items():
        results[f"dmods[{name}]"] = grad
    return results


def _assert_same(got: dict, want: dict, tol: float = 1e-12) -> None:
    """Equal keys, shapes and dtypes, ``-inf`` lse entries in the same places,
    values within ``tol`` (relative to the largest magnitude, at least 1)."""
    assert got.keys() == want.keys()
    for name, expected in want.items():
        actual = np.asarray(got[name])
        expected = np.asarray(expected)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        assert not np.isnan(expected).any() and not np.isnan(actual).any(), f"{name}: NaN (never, CONVENTIONS §1)"
        np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected), err_msg=name)
        finite = np.isfinite(expected)
        assert np.all(np.isfinite(actual[finite])), name
        scale = max(1.0, float(np.abs(expected[finite]).max(initial=0.0)))
        np.testing.assert_allclose(actual[finite], expected[finite], rtol=0, atol=tol * scale, err_msg=name)


# --- modifications used throughout ----------------------------------------------------------


def _take_per_head(xp, values, idx):
    """``values[idx.head]`` for a ``(N,)`` array: ``(1, n, 1, 1)``."""
    return xp.reshape(xp.take(values, xp.reshape(idx.head, (-1,)), axis=0), (1, -1, 1, 1))


def distance_penalty(weights, bonus, *, names=("w", "bonus")) -> npattn.ScoreMod:
    """A user-written modification, with its own backward: a learned distance
    penalty ``s' = s - softplus(w_n) log1p(|p_i - j|) + b [j == p_i]`` with
    ``w`` per head ``(N,)`` and a scalar ``b`` ``()``;
    ``dw_n = -sigmoid(w_n) sum ds' log1p(|p_i - j|)``, ``db = sum_{j = p_i} ds'``."""
    w_name, b_name = names

    def terms(xp, s, idx):
        far = xp.log1p(xp.astype(xp.abs(idx.q - idx.k), s.dtype))  # (B'|1, 1, tq, tk)
        near = xp.astype(idx.q == idx.k, s.dtype)  # (B'|1, 1, tq, tk)
        return far, near

    def penalty(s, idx, **params):
        xp = array_api_compat.array_namespace(s)
        far, near = terms(xp, s, idx)
        softplus = xp.log1p(xp.exp(params[w_name]))  # (N,)
        return s - _take_per_head(xp, softplus, idx) * far + params[b_name] * near

    def penalty_grad(s, idx, ds, **params):
        xp = array_api_compat.array_namespace(s)
        far, near = terms(xp, s, idx)
        sigmoid = 1.0 / (1.0 + xp.exp(-params[w_name]))  # (N,)
        return ds, {w_name: -sigmoid * idx.per_head(ds * far), b_name: xp.sum(ds * near)}

    return npattn.ScoreMod(penalty, penalty_grad, params={w_name: weights, b_name: bonus}, name="distance_penalty")


def striped(idx):
    """A mask modification reading every index: hides about a quarter of the
    entries, differently per batch element, head and position."""
    return ((idx.q + 2 * idx.k + 3 * idx.head + 5 * idx.batch) % 4) != 0


def band(idx):
    """Keys within 2 positions of the query's (the same for every batch
    element and head)."""
    xp = array_api_compat.array_namespace(idx.q)
    return xp.abs(idx.q - idx.k) <= 2


def _explicit_mask(mask_mod, batch_shape, N, T, S, offset=0):
    """``mask_mod`` evaluated on the whole ``(..., N, T, S)`` grid, as a bool
    array for ``mask=`` (``offset``: the query positions' shift, per batch
    element or a scalar)."""
    B = math.prod(batch_shape)
    positions = np.arange(T)[None, :] + np.reshape(np.broadcast_to(offset, batch_shape), (B, 1))  # (B, T)
    idx = npattn.TileIndex(
        np.arange(B).reshape(B, 1, 1, 1),
        np.arange(N).reshape(1, N, 1, 1),
        positions.reshape(B, 1, T, 1),
        np.arange(S).reshape(1, 1, 1, S),
        (0, N),
        N,
    )
    return np.broadcast_to(mask_mod(idx), (B, N, T, S)).reshape(batch_shape + (N, T, S))


MOD_KINDS = ("softcap", "alibi", "temperature", "relative", "penalty")


def _shipped(draw, rng, kind: str, N: int, suffix: str) -> npattn.ScoreMod:
    """One modification of ``kind`` with drawn parameters (``suffix`` keeps
    parameter names unique in a chain)."""
    if kind == "softcap":
        return npattn.softcap_mod(draw(st.sampled_from([0.3, 2.0, 30.0])))
    if kind == "alibi":
        return npattn.alibi_mod(rng.uniform(-0.25, 1.0, N), name=f"slopes{suffix}")
    if kind == "temperature":
        return npattn.head_temperature(rng.uniform(0.25, 2.0, N), name=f"temperature{suffix}")
    if kind == "relative":
        num_buckets, bidirectional = draw(st.sampled_from([4, 5, 8, 32])), draw(st.booleans())
        exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
        return npattn.relative_position_bias(
            rng.standard_normal((N, num_buckets)),
            max_distance=draw(st.sampled_from([2 * exact, 128])),
            bidirectional=bidirectional,
            name=f"relative_bias{suffix}",
        )
    return distance_penalty(
        rng.standard_normal(N), np.array(rng.standard_normal()), names=(f"w{suffix}", f"bonus{suffix}")
    )


@st.composite
def mod_chains(draw, num_heads: int):
    """One modification, or a chain of two (possibly of the same kind)."""
    kinds = draw(st.lists(st.sampled_from(MOD_KINDS), min_size=1, max_size=2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return [_shipped(draw, rng, kind, num_heads, "" if i == 0 else "_2") for i, kind in enumerate(kinds)]


def _draw_mask_mod(draw, case, options) -> dict:
    """Nothing, a ``mask_mod``, or a block mask built for the call (with drawn
    block sizes; per batch element and head where the mask or the query
    positions need it)."""
    kind = draw(st.sampled_from(["none", "mask_mod", "block_mask striped", "block_mask band"]))
    if kind == "none":
        return {}
    if kind == "mask_mod":
        return {"mask_mod": draw(st.sampled_from([striped, band]))}
    batch_shape, (N, T, _) = case.q.shape[:-3], case.q.shape[-3:]
    S = case.k.shape[-2]
    per_batch = kind.endswith("striped") or "q_lengths" in options or "kv_lengths" in options
    mask = npattn.block_mask(
        striped if kind.endswith("striped") else band,
        T,
        S,
        block_q=draw(st.sampled_from([1, 2, 3, 128])),
        block_k=draw(st.sampled_from([1, 2, 5, 128])),
        batch_shape=batch_shape if per_batch else None,
        num_heads=N if kind.endswith("striped") else None,
        align=options.get("align"),
        q_lengths=options.get("q_lengths"),
        kv_lengths=options.get("kv_lengths"),
    )
    return {"block_mask": mask}


# --- 1. every path against dense ---------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(case=attention_cases(max_len=6, features=ALL_FEATURES + ("masked_row",)), data=st.data())
@pytest.mark.parametrize("path", CHUNKED)
def test_every_path_equals_dense(path, case, data):
    """Shipped and custom modifications, alone and chained, with every mask
    feature and variant and a mask modification: the chunked path at drawn
    tile sizes (and, on the fast path, drawn sub-block splits) equals dense
    to 1e-12 in float64, every gradient included."""
    T, S = case.q.shape[-2], case.k.shape[-2]
    options = dict(case.options, score_mods=data.draw(mod_chains(case.q.shape[-3])))
    if "bias" in options:  # -inf bias entries meet the modifications: see test_a_minus_inf_bias_entry_*
        options["bias"] = np.where(np.isneginf(options["bias"]), -30.0, options["bias"])
    if T != S and "align" not in options:
        options["align"] = data.draw(st.sampled_from(["top_left", "bottom_right"]))
    options.update(_draw_mask_mod(data.draw, case, options))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    dout = rng.standard_normal(case.q.shape[:-1] + case.v.shape[-1:])
    dlse = rng.standard_normal(case.q.shape[:-1]) if data.draw(st.booleans()) else None
    want = _run("dense", *case.arrays, dout, dlse, **options)
    blocks = dict(
        block_q=data.draw(st.sampled_from([1, 2, 3, 5, 64])), block_k=data.draw(st.sampled_from([1, 2, 4, 7, 64]))
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_numpy, "SPLIT_BLOCK", data.draw(st.sampled_from([1, 2, 3, fast_numpy.SPLIT_BLOCK])))
        got = _run(path, *case.arrays, dout, dlse, **options, **blocks)
    _assert_same(got, want)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "shapes",
    [dict(batch=(2,), T=0, S=3), dict(batch=(0,), T=3, S=4), dict(batch=(0,), T=3, S=4, lengths=True)],
    ids=["T=0", "batch 0", "batch 0 with lengths"],
)
def test_empty_sizes_with_every_shipped_mod(path, shapes):
    """T = 0 and a batch axis of 0 (CONVENTIONS §4): empty results and zero
    parameter gradients, every shipped modification and the custom one
    chained, bottom_right alignment (per-batch positions with lengths)."""
    shapes = dict(shapes)
    lengths = shapes.pop("lengths", False)
    q, k, v = _qkv(N=2, K=1, **shapes)
    batch = shapes["batch"]
    extra = (
        dict(kv_lengths=np.zeros(batch, dtype=np.int64), q_lengths=np.zeros(batch, dtype=np.int64)) if lengths else {}
    )
    mods = [
        npattn.relative_position_bias(RNG.standard_normal((2, 8)), max_distance=8),
        npattn.head_temperature(np.ones(2)),
        npattn.alibi_mod(np.full(2, 0.5)),
        npattn.softcap_mod(3.0),
        distance_penalty(np.zeros(2), np.array(0.5)),
    ]
    got = _run(path, q, k, v, score_mods=mods, mask_mod=band, align="bottom_right", **extra)
    assert got["out"].shape == q.shape[:-1] + (2,) and got["lse"].shape == q.shape[:-1]
    params = {name: value for mod in mods for name, value in mod.params.items()}
    assert len(params) == 5
    for name, value in params.items():
        grad = got[f"dmods[{name}]"]
        assert grad.shape == value.shape and not np.any(grad), name


# --- an independent oracle for the forward ------------------------------------------------------


def _t5_bucket(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's ``_relative_position_bucket`` (Mesh TensorFlow), one Python int at a time."""
    bucket, n = 0, -relative_position
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("num_buckets", "max_distance"), [(4, 3), (5, 8), (8, 16), (16, 20), (32, 128)])
def test_t5_buckets_follow_the_t5_code(num_buckets, max_distance, bidirectional):
    relative = np.arange(-300, 301)
    got = npattn.t5_buckets(relative, num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
    want = [_t5_bucket(int(r), bidirectional, num_buckets, max_distance) for r in relative]
    np.testing.assert_array_equal(got, want)
    assert got.dtype == relative.dtype


def _oracle_scores(q, k, bias, scale, positions, heads_params):
    """The full ``(B, N, T, S)`` scores after step 4, computed directly: step 1
    and the bias (step 3), then each modification by its formula (``heads_params``)."""
    G = q.shape[-3] // k.shape[-3]
    s = scale * q @ np.swapaxes(np.repeat(k, G, axis=-3), -1, -2) + bias  # (B, N, T, S)
    p = positions[:, None, :, None]  # (B, 1, T, 1)
    j = np.arange(k.shape[-2])[None, None, None, :]  # (1, 1, 1, S)
    n = np.arange(q.shape[-3])[None, :, None, None]  # (1, N, 1, 1)
    table, bidirectional, max_distance = heads_params["relative"]
    buckets = np.vectorize(lambda r: _t5_bucket(int(r), bidirectional, table.shape[1], max_distance))(j - p)
    s = s + table[n, buckets]
    s = s * heads_params["temperature"][n]
    s = s - heads_params["slopes"][n] * np.abs(p - j)
    cap = heads_params["softcap"]
    s = cap * np.tanh(s / cap)
    w, b = heads_params["penalty"]
    return s - np.log1p(np.exp(w))[n] * np.log1p(np.abs(p - j)) + b * (p == j)


@pytest.mark.parametrize("path", list(PATHS))
def test_every_shipped_mod_chained_equals_an_independent_oracle(path):
    """The five modifications chained, with a bias, causal bottom_right,
    per-batch lengths, GQA and sinks: out and lse equal those of
    tests/reference.py given the bias ``bias + (f(s) - s)`` built from the
    hand-written scores (so step 4 sits after the bias, at the positions
    ``i + kv_len - q_len``)."""
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=5, S=7, H=3, Hv=2)
    bias = RNG.standard_normal((2, 4, 5, 7))
    params = {
        "relative": (RNG.standard_normal((4, 8)), True, 6),
        "temperature": RNG.uniform(0.5, 1.5, 4),
        "slopes": RNG.uniform(0.0, 0.5, 4),
        "softcap": 1.7,
        "penalty": (RNG.standard_normal(4), 0.8),
    }
    mods = [
        npattn.relative_position_bias(params["relative"][0], max_distance=6, bidirectional=True),
        npattn.head_temperature(params["temperature"]),
        npattn.alibi_mod(params["slopes"]),
        npattn.softcap_mod(params["softcap"]),
        distance_penalty(params["penalty"][0], np.array(params["penalty"][1])),
    ]
    lengths = dict(q_lengths=np.array([5, 3]), kv_lengths=np.array([7, 6]))
    options = dict(bias=bias, causal=True, align="bottom_right", sinks=np.array([0.2, -0.5, 1.0, 0.0]), **lengths)
    positions = np.arange(5)[None, :] + np.array([2, 3])[:, None]  # i + kv_len - q_len
    s3 = 0.4 * q @ np.swapaxes(np.repeat(k, 2, axis=-3), -1, -2) + bias
    delta = _oracle_scores(q, k, bias, 0.4, positions, params) - s3
    out_ref, lse_ref, _ = reference_attention(q, k, v, scale=0.4, **{**options, "bias": bias + delta})
    got = _run(path, q, k, v, scale=0.4, score_mods=mods, block_q=2, block_k=3, **options)
    np.testing.assert_allclose(got["out"], out_ref, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(got["lse"]), np.isneginf(lse_ref))
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(got["lse"][finite], lse_ref[finite], rtol=0, atol=1e-12)
    assert not np.all(finite), "the padded query rows keep lse -inf"


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "mod",
    [
        npattn.softcap_mod(1.0),
        npattn.head_temperature(np.array([-1.0, 0.0])),
        npattn.head_temperature(np.array([0.5, 2.0])),
    ],
    ids=["softcap_mod", "head_temperature <= 0", "head_temperature > 0"],
)
def test_a_minus_inf_bias_entry_stays_hidden_through_score_mods(path, mod):
    """CONVENTIONS §1: "a -inf bias entry acts as a mask", and nothing is
    ever NaN. Row 0 is hidden from keys 1..3 by the bias, row 1 from every
    key: with a score modification after the bias, every result (dmods
    included) must be that of the same entries hidden by ``mask=``, row 1
    fully masked (out 0, lse -inf)."""
    q, k, v = _qkv(batch=(1,), N=2, K=2, T=4, S=4)
    hidden = np.zeros((4, 4), bool)
    hidden[0, 1:] = hidden[1, :] = True
    bias = np.where(hidden, -np.inf, RNG.standard_normal((4, 4)))
    options = dict(score_mods=[mod], block_q=2, block_k=2)
    want = _run(path, q, k, v, bias=np.where(hidden, 0.0, bias), mask=~hidden, **options)
    assert np.all(np.isneginf(want["lse"][..., 1])) and np.all(want["out"][..., 1, :] == 0)
    with np.errstate(invalid="ignore"):
        got = _run(path, q, k, v, bias=bias, **options)
    want["dbias"] = np.where(hidden, 0.0, want["dbias"])  # no gradient reaches a -inf entry
    _assert_same(got, want)


# --- 2. central differences ----------------------------------------------------------------------


def _mod_pair(options: dict, recipes: list, builtins: tuple[str, ...]):
    """``forward(q, k, v, *mod params, *built-in params)`` and its backward for
    npattn.check_gradients: ``recipes`` are ``(make, names)`` with
    ``make(*values) -> ScoreMod``; ``builtins`` the attention options
    (bias, sinks, alibi_slopes) passed as inputs."""
    fields = {"bias": "dbias", "sinks": "dsinks", "alibi_slopes": "dalibi_slopes"}
    counts = [len(names) for _, names in recipes]

    def forward(q, k, v, *values):
        mods, start = [], 0
        for (make, _), count in zip(recipes, counts):
            mods.append(make(*values[start : start + count]))
            start += count
        extra = dict(zip(builtins, values[start:]))
        out, res = npattn.attention_forward(q, k, v, score_mods=mods, **options, **extra)
        return (out, res.lse), res

    def backward(cotangents, res):
        dout, dlse = cotangents
        g = npattn.attention_backward(dout, res, dlse=dlse)
        mods = tuple(g.dmods[name] for _, names in recipes for name in names)
        return (g.dq, g.dk, g.dv, *mods, *(getattr(g, fields[name]) for name in builtins))

    return forward, backward


#: ``([(make, {param name: value}[, softcap_mod's cap or make's keywords]), ...],
#: other options)``. Option names starting with "_" are shapes; bias, sinks and
#: alibi_slopes are checked as inputs too.
GRAD_CASES = {
    "softcap_mod": ([(npattn.softcap_mod, {}, 0.7)], dict(align="bottom_right")),
    "alibi_mod, bottom_right T<S, lengths": (
        [(npattn.alibi_mod, {"slopes": np.array([0.5, -0.25])})],
        dict(align="bottom_right", q_lengths=np.array([3, 2]), kv_lengths=np.array([4, 3])),
    ),
    "head_temperature, causal, GQA, dropout": (
        [(npattn.head_temperature, {"temperature": np.array([0.7, 1.3, -0.4, 2.0])})],
        dict(causal=True, align="top_left", _N=4, _K=2, dropout_p=0.3, seed=5),
    ),
    "relative_position_bias bidirectional, bool mask, bias": (
        [(npattn.relative_position_bias, {"relative_bias": RNG.standard_normal((2, 6))}, dict(max_distance=4))],
        dict(mask=RNG.random((3, 4)) < 0.8, bias=RNG.standard_normal((2, 1, 4)), align="top_left"),
    ),
    "relative_position_bias one-sided, causal top_left T>S, MQA": (
        [
            (
                npattn.relative_position_bias,
                {"relative_bias": RNG.standard_normal((3, 4))},
                dict(max_distance=4, bidirectional=False),
            )
        ],
        dict(causal=True, align="top_left", _T=5, _S=3, _N=3, _K=1),
    ),
    "custom distance_penalty, window, segments": (
        [(distance_penalty, {"w": np.array([0.3, -1.0]), "bonus": np.array(0.6)})],
        dict(
            window=(2, 1),
            align="bottom_right",
            q_segment_ids=np.array([[0, 0, 1], [0, 1, 1]]),
            kv_segment_ids=np.array([[0, 0, 1, 1], [0, 0, 1, 1]]),
        ),
    ),
    "chain temperature then softcap, with built-in softcap, ALiBi, sinks, bias": (
        [
            (npattn.head_temperature, {"temperature": np.array([1.5, 0.6])}),
            (npattn.softcap_mod, {}, 0.9),
        ],
        dict(
            softcap=2.0,
            alibi_slopes=np.array([0.3, 0.1]),
            sinks=np.array([0.4, -0.6]),
            bias=RNG.standard_normal((3, 4)),
            align="bottom_right",
        ),
    ),
    "chain relative bias then alibi_mod then custom, mask_mod": (
        [
            (npattn.relative_position_bias, {"relative_bias": RNG.standard_normal((2, 8))}, dict(max_distance=6)),
            (npattn.alibi_mod, {"slopes": np.array([0.2, 0.7])}),
            (distance_penalty, {"w": np.array([-0.5, 0.5]), "bonus": np.array(-0.3)}),
        ],
        dict(mask_mod=striped, align="bottom_right", dropout_p=0.2, seed=9),
    ),
    "custom distance_penalty with a block mask": (
        [(distance_penalty, {"w": np.array([0.1, 0.9]), "bonus": np.array(1.2)})],
        dict(
            block_mask=npattn.block_mask(
                striped, 3, 4, block_q=2, block_k=2, batch_shape=(2,), num_heads=2, align="top_left"
            ),
            align="top_left",
        ),
    ),
}


def _recipes(entries):
    """``(make, names)`` pairs and the initial parameter values, in order."""
    recipes, values = [], []
    for make, params, *rest in entries:
        extra = rest[0] if rest else None
        names = tuple(params)
        if make is npattn.softcap_mod:
            recipes.append((lambda cap=extra: npattn.softcap_mod(cap), names))
        elif make is distance_penalty:
            recipes.append((lambda w, b: distance_penalty(w, b), names))
        else:
            kwargs = dict(extra or {})
            recipes.append((lambda value, make=make, kwargs=kwargs: make(value, **kwargs), names))
        values.extend(params.values())
    return recipes, values


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_full_jacobian(case, path):
    """q, k, v, each modification's parameters and the built-in parameters
    against central differences (full Jacobian), through the public API on
    the dense path and directly on each chunked kernel (small tiles)."""
    entries, options = GRAD_CASES[case]
    options = dict(options)
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    q, k, v = _qkv(**dims, rng=np.random.default_rng(len(case)))
    builtins = tuple(name for name in ("bias", "sinks", "alibi_slopes") if name in options)
    inputs = [options.pop(name) for name in builtins]
    recipes, values = _recipes(entries)
    blocks = dict(block_q=2, block_k=3) if path == "fast" else dict(block_q=1, block_k=3)
    names = ["q", "k", "v", *(name for _, names in recipes for name in names), *builtins]
    with on_path(path) as path_options:
        forward, backward = _mod_pair({**options, **path_options, **blocks}, recipes, builtins)
        _, res = forward(q, k, v, *values, *inputs)
        assert getattr(res, "kernel", None) == PATHS[path][2]
        result = npattn.check_gradients(forward, backward, [q, k, v, *values, *inputs], names=names, jacobian=True)
    assert result.ok and result.jacobian_checked, str(result)
    assert set(result.max_abs_error) == set(names)
    assert max(result.max_abs_error.values()) < 1e-7, str(result)


# --- 3. the shipped mods equal the built-in options ----------------------------------------------


@settings(max_examples=15, deadline=None)
@given(
    case=attention_cases(max_len=6, features=("mask", "causal", "window", "lengths", "dropout", "sinks", "segments")),
    data=st.data(),
)
@pytest.mark.parametrize("path", list(PATHS))
def test_shipped_softcap_and_alibi_mods_equal_the_built_in_options(path, case, data):
    """``softcap=c, alibi_slopes=m`` (softcap, then ALiBi) is
    ``score_mods=[softcap_mod(c), alibi_mod(m)]`` (the mod first); each alone
    too, ALiBi with a bias; ``dmods["slopes"] == dalibi_slopes``."""
    T, S, N = case.q.shape[-2], case.k.shape[-2], case.q.shape[-3]
    options = dict(case.options)
    if T != S and "align" not in options:
        options["align"] = data.draw(st.sampled_from(["top_left", "bottom_right"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    cap, slopes = data.draw(st.sampled_from([0.2, 1.0, 5.0])), rng.uniform(-0.3, 1.0, N)
    blocks = dict(block_q=data.draw(st.sampled_from([1, 2, 5])), block_k=data.draw(st.sampled_from([1, 3, 64])))
    dout = rng.standard_normal(case.q.shape[:-1] + case.v.shape[-1:])
    variants = {
        "both": (dict(softcap=cap, alibi_slopes=slopes), [npattn.softcap_mod(cap), npattn.alibi_mod(slopes)]),
        "softcap": (dict(softcap=cap), [npattn.softcap_mod(cap)]),
        "alibi with a bias": (dict(alibi_slopes=slopes, bias=rng.standard_normal((T, S))), [npattn.alibi_mod(slopes)]),
    }
    for built_in, mods in variants.values():
        want = _run(path, *case.arrays, dout, **options, **built_in, **blocks)
        as_mods = {key: value for key, value in built_in.items() if key == "bias"}
        got = _run(path, *case.arrays, dout, **options, **as_mods, score_mods=mods, **blocks)
        if "dalibi_slopes" in want:
            got["dalibi_slopes"] = got.pop("dmods[slopes]")
        _assert_same(got, want)


@pytest.mark.parametrize("path", list(PATHS))
def test_softcap_mod_applies_after_the_bias_and_built_in_softcap_before(path):
    """With a bias the two differ by design (§1b: softcap is step 2, the
    modifications step 4): ``softcap_mod`` caps ``raw + bias``, the built-in
    option caps ``raw`` and then adds the bias, each equal to the oracle."""
    q, k, v = _qkv(batch=(1,), N=2, K=1, T=3, S=4, H=4)
    bias = 3.0 * RNG.standard_normal((3, 4))
    raw = 0.5 * q @ np.swapaxes(np.repeat(k, 2, axis=-3), -1, -2)  # (1, 2, 3, 4)
    mod = _run(path, q, k, v, bias=bias, scale=0.5, score_mods=[npattn.softcap_mod(0.8)], align="top_left")
    built_in = _run(path, q, k, v, bias=bias, scale=0.5, softcap=0.8)
    after = reference_attention(q, k, v, scale=0.5, bias=0.8 * np.tanh((raw + bias) / 0.8) - raw)
    before = reference_attention(q, k, v, scale=0.5, bias=bias, softcap=0.8)
    np.testing.assert_allclose(mod["out"], after[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(built_in["out"], before[0], rtol=0, atol=1e-12)
    assert np.abs(mod["out"] - built_in["out"]).max() > 1e-3


# --- 4. determinism -------------------------------------------------------------------------------


def _determinism_problem():
    rng = np.random.default_rng(44)
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=33, S=40, H=8, Hv=4, rng=rng)
    mods = [
        npattn.relative_position_bias(rng.standard_normal((4, 16)), max_distance=32),
        npattn.head_temperature(rng.uniform(0.5, 1.5, 4)),
        npattn.alibi_mod(rng.uniform(0.0, 0.3, 4)),
        distance_penalty(rng.standard_normal(4), np.array(0.4)),
    ]
    options = dict(score_mods=mods, causal=True, align="bottom_right", kv_lengths=np.array([40, 29]), dropout_p=0.1)
    options.update(seed=2, sinks=rng.standard_normal(4), mask_mod=striped)
    dout, dlse = rng.standard_normal((2, 4, 33, 4)), rng.standard_normal((2, 4, 33))
    return (q, k, v, dout, dlse), options


def test_parameter_gradients_are_bit_identical_whatever_the_thread_count(monkeypatch):
    """Fast path, 4 items (batch x kv heads) run on 1 or 2 threads: every
    result, each ``dmods`` entry included, bit for bit; with 2 threads the
    modifications ran on this thread and on one of the pool's."""
    (q, k, v, dout, dlse), options = _determinism_problem()
    seen: list[set] = []
    forward = options["score_mods"][0].forward

    def noting_the_thread(s, idx, **params):
        name = threading.current_thread().name
        if len(seen) == 2 and not seen[1] and name == "MainThread":
            time.sleep(0.05)  # the first item waits here, so that a pool thread starts and takes another
        seen[-1].add(name)
        return forward(s, idx, **params)

    options["score_mods"][0] = npattn.ScoreMod(
        noting_the_thread, options["score_mods"][0].backward, params=options["score_mods"][0].params
    )
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        seen.append(set())
        results.append(_run("fast", q, k, v, dout, dlse, block_q=8, block_k=16, **options))
    assert seen[0] == {threading.current_thread().name}
    assert "MainThread" in seen[1] and any(name.startswith("npattn") for name in seen[1]), seen[1]
    assert {"dmods[relative_bias]", "dmods[temperature]", "dmods[slopes]", "dmods[w]", "dmods[bonus]"} <= set(
        results[0]
    )
    for name, value in results[0].items():
        np.testing.assert_array_equal(results[1][name], value, err_msg=name)


@pytest.mark.parametrize("path", CHUNKED)
def test_parameter_gradients_equal_across_tile_sizes(path):
    """The same problem at tile sizes from 1 x 3 to one tile: equal to 1e-12,
    and to dense."""
    (q, k, v, dout, dlse), options = _determinism_problem()
    want = _run("dense", q, k, v, dout, dlse, **options)
    first = _run(path, q, k, v, dout, dlse, block_q=1, block_k=3, **options)
    _assert_same(first, want)
    for block_q, block_k in ((4, 7), (16, 16), (64, 64)):
        got = _run(path, q, k, v, dout, dlse, block_q=block_q, block_k=block_k, **options)
        _assert_same(got, first)
        _assert_same(got, want)


# --- 5. block masks: skipping, and equal to mask_mod and mask= ---------------------------------------

DOCS = np.repeat(np.arange(4), 4)  # four documents of 4 tokens: T = S = 16


def same_doc(idx):
    return DOCS[idx.q] == DOCS[idx.k]


def same_doc_causal(idx):
    return (DOCS[idx.q] == DOCS[idx.k]) & (idx.k <= idx.q)


def recording(record: list) -> npattn.ScoreMod:
    """The identity as a score modification that records each tile it sees,
    ``(role, first query position, first key, tq, tk)``: what a path computes."""

    def where(role, idx):
        return (role, int(idx.q[0, 0, 0, 0]), int(idx.k[0, 0, 0, 0]), idx.q.shape[2], idx.k.shape[3])

    def forward(s, idx):
        record.append(where("forward", idx))
        return s * 1.0

    def backward(s, idx, ds):
        record.append(where("backward", idx))
        return ds

    return npattn.ScoreMod(forward, backward, name="recording")


def _counted(mask_mod):
    """``mask_mod`` that counts the entries it is asked about."""
    calls = []

    def counted(idx):
        calls.append(idx.q.shape[2] * idx.k.shape[3])
        return mask_mod(idx)

    return counted, calls


@pytest.mark.parametrize("causal", [False, True], ids=["documents", "documents causal"])
def test_block_mask_skips_tiles_on_the_generic_path(monkeypatch, causal):
    """4 documents of 4 tokens with 4 x 4 tiles: with the block mask each
    pass computes the 4 diagonal tiles of 16, building no mask and never
    calling mask_mod (documents) or only on those tiles (documents causal:
    the diagonal blocks are mixed); mask_mod alone computes all 16 tiles with
    a mask each. Same numbers as the explicit bool mask on the dense path."""
    fn, calls = _counted(same_doc_causal if causal else same_doc)
    mask = npattn.block_mask(fn, 16, 16, block_q=4, block_k=4)
    assert mask.kinds.shape == (1, 1, 4, 4) and mask.sparsity == 12 / 16
    assert sum(calls) == 16 * 16  # built once: every block evaluated
    calls.clear()
    q, k, v = _qkv(batch=(2,), N=2, K=1, T=16, S=16)
    tiles, masks = [], []
    visible_tile = chunked.visible_tile

    def counting_visible(spec, q0, q1, k0, k1, *args):
        masks.append((q0, k0))
        return visible_tile(spec, q0, q1, k0, k1, *args)

    monkeypatch.setattr(chunked, "visible_tile", counting_visible)
    mods = [npattn.head_temperature(np.array([0.8, 1.2])), distance_penalty(np.array([0.2, -0.1]), np.array(0.3))]
    options = dict(sinks=np.array([0.1, -0.2]), block_q=4, block_k=4)
    with_blocks = _run("generic", q, k, v, block_mask=mask, score_mods=[*mods, recording(tiles)], **options)
    diagonal = [(i, i) for i in range(0, 16, 4)]
    assert [t[:3] for t in tiles if t[0] == "forward"][: len(diagonal)] == [("forward", *d) for d in diagonal]
    assert {t[1:] for t in tiles} == {(i, i, 4, 4) for i in range(0, 16, 4)}
    assert sum(t[0] == "backward" for t in tiles) == 4
    assert masks == (diagonal + diagonal if causal else [])  # one mask per mixed tile and pass
    assert sum(calls) == (2 * 4 * 16 if causal else 0)
    for record in (tiles, masks, calls):
        record.clear()
    alone = _run("generic", q, k, v, mask_mod=fn, score_mods=[*mods, recording(tiles)], **options)
    every = {(i, j, 4, 4) for i in range(0, 16, 4) for j in range(0, 16, 4)}
    assert {t[1:] for t in tiles} == every and sum(t[0] == "backward" for t in tiles) == 16
    assert sorted(masks) == sorted(2 * [t[:2] for t in every])
    assert sum(calls) == 2 * 16 * 16
    monkeypatch.undo()
    explicit = _run("dense", q, k, v, mask=_explicit_mask(fn, (), 2, 16, 16), score_mods=mods, **options)
    for result in (with_blocks, alone):
        _assert_same(result, explicit)


def test_block_mask_skips_spans_on_the_fast_path(monkeypatch):
    """The fast path with 8 x 8 tiles over a block mask of 4 x 4 blocks and
    4-row sub-blocks: each item computes only the four diagonal 4 x 4 blocks
    per pass (mask_mod alone: every tile whole), with the same numbers."""
    mask = npattn.block_mask(same_doc, 16, 16, block_q=4, block_k=4)
    q, k, v = _qkv(batch=(2,), N=2, K=1, T=16, S=16)
    tiles = []
    options = dict(block_q=8, block_k=8)
    mods = [npattn.alibi_mod(np.array([0.3, 0.6]))]
    monkeypatch.setattr(fast_numpy, "SPLIT_BLOCK", 4)
    with_blocks = _run("fast", q, k, v, block_mask=mask, score_mods=[*mods, recording(tiles)], **options)
    items = 2  # batch elements x kv heads
    for role, passes in (("forward", 2), ("backward", 1)):  # the backward recomputes the scores
        spans = [t[1:] for t in tiles if t[0] == role]
        assert sorted(spans) == sorted(passes * items * [(i, i, 4, 4) for i in range(0, 16, 4)]), role
    tiles.clear()
    alone = _run("fast", q, k, v, mask_mod=same_doc, score_mods=[*mods, recording(tiles)], **options)
    for role, passes in (("forward", 2), ("backward", 1)):
        spans = [t[1:] for t in tiles if t[0] == role]
        assert sorted(spans) == sorted(passes * items * [(i, j, 8, 8) for i in (0, 8) for j in (0, 8)]), role
    monkeypatch.undo()
    explicit = _run("dense", q, k, v, mask=_explicit_mask(same_doc, (), 2, 16, 16), score_mods=mods, **options)
    for result in (with_blocks, alone):
        _assert_same(result, explicit)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("path", list(PATHS))
def test_block_mask_equals_mask_mod_and_the_explicit_mask(path, data):
    """A mask depending on batch, head and position, at drawn block-mask
    blocks, call tiles, alignments and lengths: block_mask, mask_mod and the
    explicit ``mask=`` give the same numbers, with a custom modification."""
    T, S = data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9))
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=T, S=S, rng=np.random.default_rng(data.draw(st.integers(0, 99))))
    align = data.draw(st.sampled_from(["top_left", "bottom_right"]))
    lengths = {}
    if data.draw(st.booleans()):
        lengths = dict(q_lengths=np.array([T, T // 2]), kv_lengths=np.array([S // 2, S]))
    mask = npattn.block_mask(
        striped,
        T,
        S,
        block_q=data.draw(st.integers(1, 4)),
        block_k=data.draw(st.integers(1, 4)),
        batch_shape=(2,),
        num_heads=4,
        align=align,
        **lengths,
    )
    offset = 0 if align == "top_left" else lengths.get("kv_lengths", S) - lengths.get("q_lengths", T)
    explicit = _explicit_mask(striped, (2,), 4, T, S, offset)
    options = dict(score_mods=[distance_penalty(np.array([0.1, 0.2, -0.3, 0.4]), np.array(0.5))], align=align)
    options.update(lengths, block_q=data.draw(st.integers(1, 5)), block_k=data.draw(st.integers(1, 5)))
    want = _run(path, q, k, v, mask=explicit, **options)
    _assert_same(_run(path, q, k, v, block_mask=mask, **options), want)
    _assert_same(_run(path, q, k, v, mask_mod=striped, **options), want)
    _assert_same(_run(path, q, k, v, mask_mod=striped, block_mask=mask, **options), want)  # the same function: allowed


def test_block_mask_records_what_it_was_built_for():
    mask = npattn.block_mask(striped, 5, 7, block_q=2, block_k=3, batch_shape=(2,), num_heads=4, align="top_left")
    assert (mask.q_len, mask.kv_len, mask.block_q, mask.block_k) == (5, 7, 2, 3)
    assert mask.batch_shape == (2,) and mask.num_heads == 4 and mask.mask_mod is striped
    assert mask.kinds.shape == (2, 4, 3, 3) and mask.kinds.dtype == np.int8
    explicit = _explicit_mask(striped, (2,), 4, 5, 7)
    for i, j in np.ndindex(3, 3):
        block = explicit[:, :, 2 * i : 2 * i + 2, 3 * j : 3 * j + 3]
        expected = np.where(block.all(axis=(2, 3)), 1, np.where(block.any(axis=(2, 3)), 2, 0))
        np.testing.assert_array_equal(mask.kinds[:, :, i, j], expected)
    counts = [int(np.sum(mask.kinds == code)) for code in (0, 1, 2)]
    hidden, visible, mixed = counts
    assert repr(mask) == (
        f"BlockMask(q_len=5, kv_len=7, block_q=2, block_k=3, hidden={hidden}, visible={visible}, mixed={mixed})"
    )
    assert mask.sparsity == hidden / mask.kinds.size


# --- 6. bad input ---------------------------------------------------------------------------------


def _identity_backward(s, idx, ds):
    return ds


def _bad_forward_call(path, forward=None, backward=None, params=None):
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=3, S=5)
    mod = npattn.ScoreMod(forward or (lambda s, idx, **p: s * 1.0), backward or _identity_backward, params=params or {})
    with on_path(path) as options:
        out, res = npattn.attention_forward(q, k, v, score_mods=[mod], align="top_left", **options)
        npattn.attention_backward(np.ones_like(out), res)


@pytest.mark.parametrize("path", list(PATHS))
def test_bad_modification_results_are_named(path):
    with pytest.raises(ValueError, match=r"forward returned shape \(.*, 1\), expected the tile's"):
        _bad_forward_call(path, forward=lambda s, idx: s[..., None])
    with pytest.raises(TypeError, match=r"forward returned dtype float32, expected the compute dtype float64"):
        _bad_forward_call(path, forward=lambda s, idx: s.astype(np.float32))
    with pytest.raises(ValueError, match=r"forward returned shape None"):
        _bad_forward_call(path, forward=lambda s, idx: None)
    with pytest.raises(ValueError, match=r"backward returned shape .*\b4\).*expected the tile's .*\b5\)"):
        _bad_forward_call(path, backward=lambda s, idx, ds: ds[..., 1:])
    with pytest.raises(TypeError, match=r"backward returned dtype float32"):
        _bad_forward_call(path, backward=lambda s, idx, ds: ds.astype(np.float32))
    w = np.ones(4)
    with_w = dict(forward=lambda s, idx, w: s * 1.0, params={"w": w})
    with pytest.raises(ValueError, match=r"backward returned no cotangent for parameter 'w'"):
        _bad_forward_call(path, backward=lambda s, idx, ds, w: ds, **with_w)
    with pytest.raises(ValueError, match=r"backward returned no cotangent for parameter 'w'"):
        _bad_forward_call(path, backward=lambda s, idx, ds, w: (ds, {"v": np.zeros(4)}), **with_w)
    with pytest.raises(ValueError, match=r"cotangent for 'w' has shape \(3,\), expected the parameter's \(4,\)"):
        _bad_forward_call(path, backward=lambda s, idx, ds, w: (ds, {"w": np.zeros(3)}), **with_w)
    with pytest.raises(ValueError, match=r"cotangent for 'w' has shape None"):
        _bad_forward_call(path, backward=lambda s, idx, ds, w: (ds, {"w": 0.0}), **with_w)


def test_the_modification_name_in_messages():
    def wide(s, idx):
        return s[..., None]

    with pytest.raises(ValueError, match=r"score modification 'wide': forward returned shape"):
        _bad_forward_call("dense", forward=wide)
    q, k, v = _qkv()
    named = npattn.ScoreMod(lambda s, idx: s[..., None], _identity_backward, name="my_mod")
    with pytest.raises(ValueError, match=r"score modification 'my_mod'"):
        npattn.attention_forward(q, k, v, score_mods=[named], align="top_left")


@pytest.mark.parametrize("path", list(PATHS))
def test_bad_mask_mod_results_are_named(path):
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=3, S=5)
    with on_path(path) as options:
        options["align"] = "top_left"
        with pytest.raises(TypeError, match=r"mask_mod must return a bool array .* got dtype int64"):
            npattn.attention_forward(q, k, v, mask_mod=lambda idx: (idx.k <= idx.q).astype(np.int64), **options)
        with pytest.raises(TypeError, match=r"mask_mod must return a bool array .* got dtype None"):
            npattn.attention_forward(q, k, v, mask_mod=lambda idx: True, **options)
        with pytest.raises(ValueError, match=r"mask_mod returned shape \(3, 1, 1, 1\), which does not broadcast"):
            npattn.attention_forward(q, k, v, mask_mod=lambda idx: np.ones((3, 1, 1, 1), bool), **options)
        with pytest.raises(ValueError, match=r"mask_mod returned shape \(1, 1, 1, 3, 5\)"):
            npattn.attention_forward(q, k, v, mask_mod=lambda idx: (idx.k <= idx.q)[None], block_q=3, **options)
    with pytest.raises(TypeError, match=r"mask_mod must return a bool array"):
        npattn.block_mask(lambda idx: idx.k - idx.q, 3, 5, align="top_left")
    with pytest.raises(ValueError, match=r"does not broadcast"):
        npattn.block_mask(lambda idx: np.ones((2, 1, 1, 1), bool), 3, 5, num_heads=3, align="top_left")
    per_element = r"kv_lengths of shape \(2,\) set positions per batch element: pass .* batch_shape=\(2,\)"
    with pytest.raises(ValueError, match=per_element):
        npattn.block_mask(band, 4, 6, align="bottom_right", kv_lengths=np.array([6, 3]))
    npattn.block_mask(band, 4, 6, align="bottom_right", kv_lengths=np.array([6, 3]), batch_shape=(2,))


def test_block_mask_for_another_call_is_rejected():
    q, k, v = _qkv(batch=(2,), N=2, K=2, T=4, S=4)
    q3 = _qkv(batch=(2,), N=2, K=2, T=3, S=4)[0]
    F = npattn.attention_forward
    with pytest.raises(
        ValueError, match=r"block_mask was built for \(T, S\) = \(4, 5\), but this call has \(T, S\) = \(4, 4\)"
    ):
        F(q, k, v, block_mask=npattn.block_mask(band, 4, 5, align="top_left"))
    with pytest.raises(ValueError, match=r"block_mask was built for num_heads=3, but this call has N=2"):
        F(q, k, v, block_mask=npattn.block_mask(band, 4, 4, num_heads=3))
    with pytest.raises(ValueError, match=r"block_mask was built for batch_shape=\(3,\), but this call has \(2,\)"):
        F(q, k, v, block_mask=npattn.block_mask(band, 4, 4, batch_shape=(3,)))
    positions = r"block_mask was built for other query positions .*align.*lengths"
    with pytest.raises(ValueError, match=positions):
        F(q3, k, v, align="bottom_right", block_mask=npattn.block_mask(band, 3, 4, align="top_left"))
    with pytest.raises(ValueError, match=positions):
        F(q3, k, v, align="top_left", block_mask=npattn.block_mask(band, 3, 4, align="bottom_right"))
    built = npattn.block_mask(band, 3, 4, batch_shape=(2,), align="bottom_right", kv_lengths=np.array([4, 2]))
    with pytest.raises(ValueError, match=positions):
        F(q3, k, v, align="bottom_right", kv_lengths=np.array([4, 3]), block_mask=built)
    with pytest.raises(ValueError, match=positions):
        F(q3, k, v, align="bottom_right", block_mask=built)
    with pytest.raises(ValueError, match=positions):
        F(q3, k, v, align="bottom_right", q_lengths=np.array([3, 1]), kv_lengths=np.array([4, 2]), block_mask=built)
    F(q3, k, v, align="bottom_right", kv_lengths=np.array([4, 2]), block_mask=built)  # the call it was built for
    with pytest.raises(ValueError, match=r"mask_mod and block_mask were both given with different functions"):
        F(q, k, v, block_mask=npattn.block_mask(band, 4, 4), mask_mod=striped)
    with pytest.raises(TypeError, match=r"block_mask must come from npattn.block_mask"):
        F(q, k, v, block_mask=band)


def test_bad_modification_arguments_are_named():
    q, k, v = _qkv(batch=(2,), N=2, K=2, T=3, S=4)
    F = npattn.attention_forward
    w = np.ones(2)
    with pytest.raises(ValueError, match=r"two modifications declare the parameter 'slopes'; rename one"):
        F(q, k, v, align="top_left", score_mods=[npattn.alibi_mod(w), npattn.alibi_mod(w)])
    with pytest.raises(ValueError, match=r"two modifications declare the parameter 'w'"):
        F(q, k, v, align="top_left", score_mods=[distance_penalty(w, np.array(0.0)), npattn.alibi_mod(w, name="w")])
    with pytest.raises(TypeError, match=r"score_mods must hold npattn.ScoreMod objects, got function"):
        F(q, k, v, align="top_left", score_mods=[npattn.softcap_mod(1.0), lambda s, idx: s])
    with pytest.raises(TypeError, match=r"score_mods must be a ScoreMod or a list of them, got str"):
        F(q, k, v, align="top_left", score_mods="softcap")
    with pytest.raises(TypeError, match=r"mask_mod must be a callable .* got ndarray"):
        F(q, k, v, align="top_left", mask_mod=np.ones((3, 4), bool))
    with pytest.raises(TypeError, match=r"mask_mod must be a callable .* got ndarray"):
        npattn.block_mask(np.ones((3, 4), bool), 3, 4)
    for bad in (np.array([1, 2]), np.array([True, False]), np.array([1j, 2j])):
        with pytest.raises(TypeError, match=r"score_mods parameter 'slopes' must be a real floating array, got dtype"):
            F(q, k, v, align="top_left", score_mods=[npattn.alibi_mod(bad)])
    for mods in ([npattn.softcap_mod(1.0)], npattn.softcap_mod(1.0)):
        with pytest.raises(
            ValueError, match=r"score_mods/mask_mod/block_mask with T=3 != S=4 .*'top_left'.*'bottom_right'"
        ):
            F(q, k, v, score_mods=mods)
    with pytest.raises(ValueError, match=r"with T=3 != S=4 needs an explicit alignment"):
        F(q, k, v, mask_mod=band)
    xps = pytest.importorskip("array_api_strict")
    with pytest.raises(TypeError, match=r"score_mods parameter 'slopes' come from different array libraries"):
        F(q, k, v, align="top_left", score_mods=[npattn.alibi_mod(xps.asarray(w))])


def test_bad_score_mod_construction_is_named():
    with pytest.raises(TypeError, match=r"ScoreMod forward must be callable, got 'f'"):
        npattn.ScoreMod("f", _identity_backward)
    with pytest.raises(TypeError, match=r"ScoreMod backward must be callable, got None"):
        npattn.ScoreMod(lambda s, idx: s, None)
    for bad in ("1x", "a-b", "class", "", 3):
        with pytest.raises(ValueError, match=r"ScoreMod params names must be Python identifiers, got"):
            npattn.ScoreMod(lambda s, idx, **p: s, _identity_backward, params={bad: np.ones(2)})
    with pytest.raises(TypeError, match=r"ScoreMod params\['w'\] must be an array, got list"):
        npattn.ScoreMod(lambda s, idx, w: s, _identity_backward, params={"w": [1.0, 2.0]})
    with pytest.raises(TypeError, match=r"ScoreMod params must be a mapping"):
        npattn.ScoreMod(lambda s, idx, w: s, _identity_backward, params=[("w", np.ones(2))])
    with pytest.raises(ValueError, match=r"softcap_mod cap must be a finite float > 0"):
        npattn.softcap_mod(0.0)
    with pytest.raises(ValueError, match=r"relative_position_bias table must have shape \(N, num_buckets\)"):
        npattn.relative_position_bias(np.zeros(8))


# --- 7. backends and mutation -------------------------------------------------------------------------


def test_backend_matrix_relative_bias_mask_mod_and_no_mutation(backend):
    """relative_position_bias, head_temperature, alibi_mod and the custom
    modification with a mask_mod, bottom_right with lengths, sinks and GQA,
    on every backend (array-api-strict: the generic path, on both devices;
    read-only NumPy: mutation raises), dense and chunked: equal to NumPy's
    dense result, every dmods entry on the inputs' device, and no input or
    parameter changed."""
    rng = np.random.default_rng(77)
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=5, S=6, H=3, Hv=2, rng=rng)
    host = dict(
        q=q,
        k=k,
        v=v,
        dout=rng.standard_normal((2, 4, 5, 2)),
        dlse=rng.standard_normal((2, 4, 5)),
        table=rng.standard_normal((4, 8)),
        temperature=rng.uniform(0.5, 1.5, 4),
        slopes=rng.uniform(0.0, 0.5, 4),
        w=rng.standard_normal(4),
        bonus=np.array(0.7),
        sinks=rng.standard_normal(4),
        kv_lengths=np.array([6, 4]),
        q_lengths=np.array([5, 4]),
    )
    copies = {name: value.copy() for name, value in host.items()}

    def mods(a):
        return [
            npattn.relative_position_bias(a["table"], max_distance=8),
            npattn.head_temperature(a["temperature"]),
            npattn.alibi_mod(a["slopes"]),
            distance_penalty(a["w"], a["bonus"]),
        ]

    def options(a):
        lengths = dict(kv_lengths=a["kv_lengths"], q_lengths=a["q_lengths"])
        return dict(score_mods=mods(a), mask_mod=striped, align="bottom_right", sinks=a["sinks"], **lengths)

    want = _run("dense", q, k, v, host["dout"], host["dlse"], **options(host))
    arrays = {name: backend.asarray(value) for name, value in host.items()}
    for impl in ("dense", "chunked"):
        out, res = npattn.attention_forward(
            arrays["q"], arrays["k"], arrays["v"], impl=impl, block_q=2, block_k=4, **options(arrays)
        )
        g = npattn.attention_backward(arrays["dout"], res, dlse=arrays["dlse"])
        got = {"out": out, "lse": res.lse, "dq": g.dq, "dk": g.dk, "dv": g.dv, "dsinks": g.dsinks}
        got.update({f"dmods[{name}]": grad for name, grad in g.dmods.items()})
        assert got.keys() == want.keys()
        for name, value in got.items():
            if backend.name.startswith("strict"):
                assert value.device == arrays["q"].device, name
            np.testing.assert_allclose(
                backend.to_numpy(value), want[name], rtol=0, atol=1e-12, err_msg=f"{impl} {name}"
            )
        if backend.name.startswith("strict") and impl == "chunked":
            assert res.kernel == "generic"
    for name, original in copies.items():
        np.testing.assert_array_equal(backend.to_numpy(arrays[name]), original, err_msg=name)
        np.testing.assert_array_equal(host[name], original, err_msg=name)


@pytest.mark.parametrize("device", [None, "device1"])
@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_array_api_strict_relative_bias_with_equal_per_batch_positions(device, impl):
    """bottom_right with lengths whose ``kv_len - q_len`` is the same in every
    batch element: the query positions are per batch element (shape (B, 1, tq,
    1)) yet equal. array-api-strict runs the generic path; equal to NumPy."""
    xps = pytest.importorskip("array_api_strict")
    to = (lambda a: xps.asarray(a, device=xps.Device(device))) if device else xps.asarray
    q, k, v = _qkv(batch=(2,), N=2, K=2, T=5, S=6)
    table = RNG.standard_normal((2, 8))
    options = dict(align="bottom_right", kv_lengths=np.array([6, 6]), block_q=2, block_k=4)
    want = _run("dense", q, k, v, np.ones((2, 2, 5, 2)), score_mods=[npattn.relative_position_bias(table)], **options)
    arrays = [to(a) for a in (q, k, v)]
    mod = npattn.relative_position_bias(to(table))
    out, res = npattn.attention_forward(
        *arrays, score_mods=[mod], impl=impl, **{**options, "kv_lengths": to(options["kv_lengths"])}
    )
    g = npattn.attention_backward(to(np.ones((2, 2, 5, 2))), res)
    back = xps.Device("CPU_DEVICE")
    np.testing.assert_allclose(np.asarray(xps.asarray(out, device=back, copy=True)), want["out"], rtol=0, atol=1e-12)
    got = np.asarray(xps.asarray(g.dmods["relative_bias"], device=back, copy=True))
    np.testing.assert_allclose(got, want["dmods[relative_bias]"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("path", list(PATHS))
def test_inputs_and_parameters_are_not_mutated(path):
    """Read-only q, k, v, cotangents and parameters (writing to any raises),
    and the values unchanged after forward and backward; the modifications
    receive tiles they may not write either, so they get copies or views of
    library buffers, never the caller's arrays."""
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=6, S=7)
    params = dict(table=RNG.standard_normal((4, 8)), t=RNG.uniform(0.5, 1.5, 4), m=RNG.uniform(0, 1, 4))
    params.update(w=RNG.standard_normal(4), b=np.array(0.2))
    arrays = dict(q=q, k=k, v=v, dout=RNG.standard_normal((2, 4, 6, 2)), dlse=RNG.standard_normal((2, 4, 6)), **params)
    copies = {name: value.copy() for name, value in arrays.items()}
    for value in arrays.values():
        value.flags.writeable = False
    mods = [
        npattn.relative_position_bias(arrays["table"], max_distance=8),
        npattn.head_temperature(arrays["t"]),
        npattn.alibi_mod(arrays["m"]),
        npattn.softcap_mod(2.0),
        distance_penalty(arrays["w"], arrays["b"]),
    ]
    got = _run(
        path,
        arrays["q"],
        arrays["k"],
        arrays["v"],
        arrays["dout"],
        arrays["dlse"],
        score_mods=mods,
        mask_mod=striped,
        causal=True,
        align="bottom_right",
        block_q=4,
        block_k=3,
    )
    for name, original in copies.items():
        np.testing.assert_array_equal(arrays[name], original, err_msg=name)
    sources = dict(relative_bias="table", temperature="t", slopes="m", w="w", bonus="b")
    for name, source in sources.items():
        assert not np.shares_memory(got[f"dmods[{name}]"], arrays[source]), name
