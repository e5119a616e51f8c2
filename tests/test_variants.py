"""The score-pipeline variants of issue 14 (CONVENTIONS §1b): softcap, ALiBi,
attention sinks and segment ids (packed documents).

- gradients by central differences in float64 (full Jacobian on tiny shapes)
  for q, k, v, bias, sinks and alibi_slopes, each variant alone and combined
  with masks, GQA/MQA and dropout, on three paths: dense, ``impl="chunked"``
  with small tiles (whichever kernel NumPy runs) and the generic chunked
  kernel (``NPATTN_FAST_NUMPY=0``); a hypothesis random-VJP check over every
  feature at once;
- semantics: a row whose real keys are all hidden gives out 0 and lse =
  sinks_n, padded query rows keep lse -inf and get no gradient, rows sum to
  one with the sink's share; softcap bounds the scores; segment ids equal the
  explicit bool mask; ALiBi equals the explicit bias built from its slopes,
  and dalibi_slopes equals dbias contracted with ``-|p_i - j|``;
  ``npattn.alibi_slopes`` against the formula of Press et al.'s code;
- tile skipping for packed documents on the generic chunked path, counted;
- the backend matrix (NumPy, read-only NumPy, array-api-strict on both
  devices, torch CPU) on a case combining every variant: equal to NumPy, and
  no input mutated.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from pairs import check_attention_gradients
from strategies import ALL_FEATURES, attention_cases

import npattn
import npattn.chunked as chunked

RNG = np.random.default_rng(1414)

#: The three paths every case runs on: options, and whether the NumPy fast
#: path is switched off (so ``impl="chunked"`` runs the generic kernel).
PATHS = {
    "dense": (dict(impl="dense"), False),
    "chunked": (dict(impl="chunked", block_q=2, block_k=3), False),
    "generic": (dict(impl="chunked", block_q=1, block_k=3), True),
}


@contextlib.contextmanager
def on_path(path: str):
    """Yield the path's options, with ``NPATTN_FAST_NUMPY=0`` for "generic"
    (a context, not the monkeypatch fixture, so it also works under @given)."""
    options, generic = PATHS[path]
    with pytest.MonkeyPatch.context() as patch:
        if generic:
            patch.setenv("NPATTN_FAST_NUMPY", "0")
        yield dict(options)


def _qkv(batch=(2,), N=2, K=2, T=3, S=4, H=2, Hv=2, rng=RNG):
    return (
        rng.standard_normal((*batch, N, T, H)),
        rng.standard_normal((*batch, K, S, H)),
        rng.standard_normal((*batch, K, S, Hv)),
    )


def _split(case: dict) -> tuple[dict, dict]:
    """``(shape keywords, attention options)`` of a case (``_T`` -> ``T``)."""
    options = dict(case)
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    return dims, options


def _run(path, q, k, v, dout, dlse=None, **options):
    """``(out, lse, grads)`` on ``path``."""
    with on_path(path) as path_options:
        out, res = npattn.attention_forward(q, k, v, **path_options, **options)
        return out, res.lse, npattn.attention_backward(dout, res, dlse=dlse)


# --- gradients by central differences ------------------------------------------------

PACKED_Q = np.array([[0, 0, 1], [0, 1, 1]])  # (B, T): two packed documents per row
PACKED_KV = np.array([[0, 0, 1, 1], [0, 1, 1, 1]])  # (B, S)

#: Each variant alone, then with masks, GQA/MQA, dropout and each other. The
#: first word of a name is the variant its errors are reported under.
CASES = {
    "softcap": dict(softcap=0.7),
    "softcap saturating (c = 0.05)": dict(softcap=0.05),
    "softcap + causal bottom_right + bias -inf entries": dict(
        softcap=1.5, causal=True, align="bottom_right", bias=np.where(RNG.random((3, 4)) < 0.25, -np.inf, 0.3)
    ),
    "softcap + GQA (N=4, K=2) + dropout": dict(softcap=0.8, _N=4, _K=2, dropout_p=0.3, seed=7),
    "alibi (N,) bottom_right T<S": dict(alibi_slopes=np.array([0.5, 0.25]), align="bottom_right"),
    "alibi per batch (B, N), top_left T>S": dict(
        alibi_slopes=RNG.uniform(0.1, 1.0, (2, 2)), align="top_left", _T=5, _S=3
    ),
    "alibi broadcast (B, 1) + window + lengths, bottom_right": dict(
        alibi_slopes=np.array([[0.3], [0.7]]),
        window=(2, 1),
        align="bottom_right",
        q_lengths=np.array([3, 2]),
        kv_lengths=np.array([4, 3]),
    ),
    "alibi + MQA (N=3, K=1) + bias": dict(
        alibi_slopes=npattn.alibi_slopes(3), _N=3, _K=1, _T=4, bias=RNG.standard_normal((3, 1, 4))
    ),
    "sinks (N,)": dict(sinks=np.array([0.3, -0.8])),
    "sinks per batch (B, N) + bool mask with a fully masked row": dict(
        sinks=RNG.standard_normal((2, 2)),
        mask=np.array([[True, False, True, True], [False] * 4, [True, True, False, True]]),
    ),
    "sinks very negative and very positive": dict(sinks=np.array([-25.0, 6.0])),
    "sinks + lengths (padded rows, an empty sequence)": dict(
        sinks=np.array([0.1, 1.2]), q_lengths=np.array([2, 3]), kv_lengths=np.array([4, 0])
    ),
    "sinks + GQA (N=4, K=2) + dropout + causal": dict(
        sinks=RNG.standard_normal(4), _N=4, _K=2, dropout_p=0.4, seed=3, causal=True, align="top_left"
    ),
    "segments packed": dict(q_segment_ids=PACKED_Q, kv_segment_ids=PACKED_KV),
    "segments unsorted, a query seeing no key": dict(
        q_segment_ids=np.array([[2, 0, 1], [1, 1, 0]]), kv_segment_ids=np.array([[0, 1, 0, 1], [0, 1, 0, 1]])
    ),
    "segments + causal + GQA + dropout": dict(
        q_segment_ids=PACKED_Q,
        kv_segment_ids=PACKED_KV,
        causal=True,
        align="bottom_right",
        _N=4,
        _K=2,
        dropout_p=0.25,
        seed=12,
    ),
    "combined: every variant, mask, bias, lengths, GQA, dropout": dict(
        softcap=1.1,
        alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]),
        sinks=RNG.standard_normal((2, 4)),
        q_segment_ids=PACKED_Q,
        kv_segment_ids=PACKED_KV,
        mask=RNG.random((2, 1, 3, 4)) < 0.8,
        bias=RNG.standard_normal((4, 1, 4)),
        causal=True,
        align="bottom_right",
        kv_lengths=np.array([4, 3]),
        q_lengths=np.array([3, 2]),
        _N=4,
        _K=2,
        dropout_p=0.3,
        seed=21,
    ),
    "combined: sinks + softcap + alibi, segments with no visible key": dict(
        sinks=np.array([0.4, -0.4]),
        softcap=0.9,
        alibi_slopes=np.array([0.25, 0.0625]),
        q_segment_ids=np.array([[5, 0, 0], [1, 1, 1]]),
        kv_segment_ids=np.array([[0, 0, 0, 1], [1, 1, 1, 1]]),
        align="top_left",
    ),
}

#: Largest central-difference error seen per case and path (filled as the tests run).
ERRORS: dict[tuple[str, str], float] = {}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(CASES))
def test_gradients_full_jacobian(case, path):
    dims, options = _split(CASES[case])
    q, k, v = _qkv(**dims, rng=np.random.default_rng(len(case)))
    with on_path(path) as path_options:
        result = check_attention_gradients(q, k, v, {**options, **path_options}, jacobian=True)
    assert result.ok and result.jacobian_checked, str(result)
    params = {"sinks", "alibi_slopes", "bias"} & set(options)
    assert set(result.max_abs_error) == {"q", "k", "v"} | params
    ERRORS[(case, path)] = max(result.max_abs_error.values())
    assert ERRORS[(case, path)] < 1e-7, str(result)


@settings(max_examples=12)
@given(case=attention_cases(max_len=4, features=ALL_FEATURES + ("masked_row",)))
@pytest.mark.parametrize("path", list(PATHS))
def test_gradients_random_vjp_every_feature(path, case):
    with on_path(path) as path_options:
        check_attention_gradients(*case.arrays, {**case.options, **path_options}, jacobian=False)


# --- semantics -------------------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
def test_sinks_hidden_rows_padded_rows_and_row_sums(path):
    """Row 0 of batch 0 sees no key (bool mask), batch 1 has no key at all
    (kv_lengths 0) and one padded query row: the first two give out 0 and
    lse = sinks_n, the padded row lse -inf; cotangents on the padded rows move
    no gradient; every other row's probabilities and the sink's share sum to 1."""
    q, k, v = _qkv(N=2, K=1, T=3, S=4)
    sinks = np.array([0.7, -1.3])
    mask = np.ones((2, 1, 3, 4), bool)
    mask[0, :, 0] = False
    options = dict(sinks=sinks, mask=mask, q_lengths=np.array([3, 2]), kv_lengths=np.array([4, 0]))
    dout = np.zeros((2, 2, 3, 2))
    out, lse, _ = _run(path, q, k, v, dout, **options)
    hidden = np.zeros((2, 2, 3), bool)
    hidden[0, :, 0] = hidden[1, :, :2] = True
    padded = np.zeros((2, 2, 3), bool)
    padded[1, :, 2] = True
    assert np.all(out[hidden] == 0) and np.all(out[padded] == 0)
    np.testing.assert_array_equal(lse[hidden], np.broadcast_to(sinks[:, None], (2, 2, 3))[hidden])
    assert np.all(np.isneginf(lse[padded])) and np.all(np.isfinite(lse[~padded]))
    if path == "dense":
        _, res = npattn.attention_forward(q, k, v, impl="dense", **options)
        total = res.probs.sum(-1) + np.exp(sinks[:, None] - lse)  # the real keys, then the sink
        np.testing.assert_allclose(total[~padded], 1.0, rtol=0, atol=1e-14)
        assert np.all(res.probs[padded] == 0)

    dout_padded = np.where(padded[..., None], RNG.standard_normal((2, 2, 3, 2)), 0.0)
    dlse_padded = np.where(padded, RNG.standard_normal((2, 2, 3)), 0.0)
    _, _, g = _run(path, q, k, v, dout_padded, dlse_padded, **options)
    for name in ("dq", "dk", "dv", "dsinks"):
        grad = getattr(g, name)
        assert np.all(grad == 0) and not np.isnan(grad).any(), name


@pytest.mark.parametrize("path", list(PATHS))
def test_sinks_gradient_of_a_hidden_row_moves_only_the_sink(path):
    """A row with only the sink: its lse is sinks_n itself, so a cotangent on
    that lse is dsinks_n and nothing else."""
    q, k, v = _qkv(batch=(1,), N=2, K=2, T=2, S=3)
    mask = np.array([[False] * 3, [True] * 3])
    dlse = np.array([[[1.5, 0.0], [0.0, 0.0]]])
    _, _, g = _run(path, q, k, v, np.zeros((1, 2, 2, 2)), dlse, sinks=np.zeros(2), mask=mask)
    np.testing.assert_array_equal(g.dsinks, [1.5, 0.0])
    assert all(np.all(getattr(g, name) == 0) for name in ("dq", "dk", "dv"))


def test_sinks_rescale_in_place_only_numpy_arrays_the_caller_hands_over():
    """``scaled_rows`` writes into ``x`` only with ``overwrite`` and on NumPy
    (a kernel's own ``out``: no second array's page faults); elsewhere, or
    without ``overwrite``, ``x`` is left as it was."""
    from npattn.scores.sinks import scaled_rows

    xps = pytest.importorskip("array_api_strict")
    factor = np.array([0.5, 2.0])
    x = np.ones((2, 3))
    kept = scaled_rows(np, x, factor)
    assert np.all(x == 1) and kept is not x
    scaled = scaled_rows(np, x, factor, overwrite=True)
    assert scaled is x and np.array_equal(x, [[0.5] * 3, [2.0] * 3])
    y = xps.ones((2, 3), dtype=xps.float64)
    result = scaled_rows(xps, y, xps.asarray(factor), overwrite=True)
    assert result is not y and bool(xps.all(y == 1))
    assert np.array_equal(np.asarray(result), [[0.5] * 3, [2.0] * 3])


@pytest.mark.parametrize("path", list(PATHS))
def test_softcap_bounds_the_scores(path):
    """Scores of about ±1e4 capped at c = 2: each finite lse lies within
    log(visible keys) ± c, outputs and gradients are finite, and a row sees
    its keys within a factor exp(2c) of each other."""
    cap = 2.0
    q, k, v = _qkv(T=4, S=5, H=3)
    q = q * 100.0
    k = k * 100.0
    mask = RNG.random((2, 2, 4, 5)) < 0.7
    mask[..., 0] = True
    dout = RNG.standard_normal((2, 2, 4, 2))
    out, lse, g = _run(path, q, k, v, dout, softcap=cap, mask=mask)
    count = mask.sum(-1)
    assert np.all(lse <= np.log(count) + cap + 1e-12) and np.all(lse >= np.log(count) - cap - 1e-12)
    for a in (out, lse, g.dq, g.dk, g.dv):
        assert np.all(np.isfinite(a))
    if path == "dense":
        _, res = npattn.attention_forward(q, k, v, impl="dense", softcap=cap, mask=mask)
        largest = res.probs.max(-1)  # (B, N, T)
        smallest = np.where(mask, res.probs, np.inf).min(-1)  # over the visible keys of each row
        assert np.all(smallest > 0) and np.all(largest / smallest <= math.exp(2 * cap) * (1 + 1e-12))
    unbounded = npattn.attention_forward(q, k, v, impl="dense", mask=mask)[1].lse
    assert np.abs(unbounded).max() > 100  # without the cap these scores are far outside ±c


SEGMENT_CASES = {
    "packed": (PACKED_Q, PACKED_KV, {}),
    "packed + causal + sinks": (PACKED_Q, PACKED_KV, dict(causal=True, align="top_left", sinks=np.array([0.2, 0.9]))),
    "unsorted + GQA + dropout": (
        np.array([[1, 0, 1], [0, 0, 2]]),
        np.array([[0, 1, 1, 0], [2, 0, 0, 1]]),
        dict(_N=4, _K=2, dropout_p=0.3, seed=8),
    ),
    "broadcast batch axes (2, 3)": (
        np.array([[[0, 0, 1]] * 3, [[0, 1, 1]] * 3]),
        np.array([[[0, 1, 1, 1]] * 3, [[0, 0, 1, 1]] * 3]),
        dict(_batch=(2, 3)),
    ),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(SEGMENT_CASES))
def test_segment_ids_equal_the_explicit_bool_mask(case, path):
    q_ids, kv_ids, extra = SEGMENT_CASES[case]
    dims, options = _split(extra)
    q, k, v = _qkv(**dims)
    dout, dlse = RNG.standard_normal(q.shape[:-1] + v.shape[-1:]), RNG.standard_normal(q.shape[:-1])
    mask = (q_ids[..., :, None] == kv_ids[..., None, :])[..., None, :, :]  # (..., 1, T, S)
    got = _run(path, q, k, v, dout, dlse, q_segment_ids=q_ids, kv_segment_ids=kv_ids, **options)
    want = _run(path, q, k, v, dout, dlse, mask=mask, **options)
    _assert_close(got, want, atol=1e-13)


def _assert_close(got, want, atol):
    """Two ``(out, lse, AttentionGrads)`` results equal to ``atol``."""
    (out, lse, g), (out_w, lse_w, g_w) = got, want
    np.testing.assert_allclose(out, out_w, rtol=0, atol=atol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_w))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse_w[np.isfinite(lse_w)], rtol=0, atol=atol)
    for name in ("dq", "dk", "dv", "dsinks"):
        a, b = getattr(g, name), getattr(g_w, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=name)


def _alibi_bias(slopes, batch, N, T, S, offset):
    """``-slope_n |p_i - j|`` as an explicit ``(*batch, N, T, S)`` bias, with
    ``offset`` the position of query 0 (a number, or one per batch element)."""
    positions = np.arange(T)[:, None] + np.reshape(offset, np.shape(offset) + (1, 1))  # (..., T, 1)
    distance = np.abs(positions - np.arange(S))  # (..., T, S)
    distance = np.reshape(distance, np.shape(offset) + (1, T, S))  # (..., 1, T, S)
    return -np.broadcast_to(slopes, (*batch, N))[..., None, None] * distance


ALIBI_CASES = {
    # name: (slopes, align, dims, options, offset of query 0)
    "(N,) top_left T=S": (np.array([0.5, 0.125]), None, dict(T=4, S=4), {}, 0),
    "(N,) bottom_right T<S + causal": (np.array([0.5, 0.125]), "bottom_right", dict(T=3, S=5), dict(causal=True), 2),
    "(B, N) top_left T>S + bias": (
        RNG.uniform(0.0, 1.0, (2, 2)),
        "top_left",
        dict(T=5, S=3),
        dict(bias=RNG.standard_normal((5, 3))),
        0,
    ),
    "(B, 1) bottom_right + lengths (per-batch offset) + sinks": (
        np.array([[0.25], [0.75]]),
        "bottom_right",
        dict(T=3, S=5),
        dict(q_lengths=np.array([3, 1]), kv_lengths=np.array([4, 5]), sinks=np.array([0.0, 1.0])),
        np.array([1, 4]),  # kv_len - q_len per batch element
    ),
    "GQA + softcap + dropout": (
        npattn.alibi_slopes(4),
        "top_left",
        dict(N=4, K=2, T=4, S=6),
        dict(softcap=1.3, dropout_p=0.2, seed=4),
        0,
    ),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", list(ALIBI_CASES))
def test_alibi_equals_the_explicit_bias_and_its_gradient_contracts_dbias(case, path):
    slopes, align, dims, options, offset = ALIBI_CASES[case]
    q, k, v = _qkv(**dims)
    batch, N, T, S = q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2]
    dout, dlse = RNG.standard_normal(q.shape[:-1] + v.shape[-1:]), RNG.standard_normal(q.shape[:-1])
    explicit = _alibi_bias(slopes, batch, N, T, S, offset)  # (..., N, T, S)
    options = dict(options, align=align)
    user_bias = options.pop("bias", 0.0)
    got = _run(
        path, q, k, v, dout, dlse, alibi_slopes=slopes, **options, **({"bias": user_bias} if np.ndim(user_bias) else {})
    )
    want = _run(path, q, k, v, dout, dlse, bias=explicit + user_bias, **options)
    _assert_close(got, want, atol=1e-13)
    # dL/dslope_n = sum over i, j of dbias_nij * d(bias_nij)/d(slope_n) = -|p_i - j|, summed to the slopes' shape
    distance = -_alibi_bias(np.ones(N), batch, N, T, S, offset)
    dslopes = (want[2].dbias * -distance).sum(axis=(-2, -1))  # (..., N)
    expected = _sum_to_shape(dslopes, np.shape(slopes))
    assert got[2].dalibi_slopes.shape == np.shape(slopes) and got[2].dalibi_slopes.dtype == np.float64
    np.testing.assert_allclose(got[2].dalibi_slopes, expected, rtol=1e-12, atol=1e-12)


def _sum_to_shape(a, shape):
    """``a`` summed over the axes that broadcasting ``shape`` to ``a.shape`` added or stretched."""
    lead = a.ndim - len(shape)
    a = a.sum(axis=tuple(range(lead))) if lead else a
    stretched = tuple(axis for axis, n in enumerate(shape) if n == 1 and a.shape[axis] != 1)
    return a.sum(axis=stretched, keepdims=True) if stretched else a


def _press_slopes(n):
    """The slopes of Press et al.'s reference code (ofirpress/attention_with_linear_biases)."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _press_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 64, 96, 100, 128])
def test_alibi_slopes_follow_press_et_al(n):
    slopes = npattn.alibi_slopes(n)
    assert slopes.shape == (n,) and slopes.dtype == np.float64
    np.testing.assert_allclose(slopes, _press_slopes(n), rtol=1e-13, atol=0)  # start**k vs repeated products
    if n & (n - 1) == 0:  # a power of two: 2**(-8 k / n), k = 1..n
        np.testing.assert_allclose(slopes, [2.0 ** (-8 * k / n) for k in range(1, n + 1)], rtol=1e-13)


def test_alibi_slopes_namespace_dtype_device_and_bad_input():
    assert npattn.alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert npattn.alibi_slopes(4, dtype=np.float32).dtype == np.float32
    xps = pytest.importorskip("array_api_strict")
    device = xps.Device("device1")
    got = npattn.alibi_slopes(6, xp=xps, device=device)
    assert got.device == device and got.dtype == xps.float64
    np.testing.assert_allclose(np.asarray(xps.asarray(got, device=xps.Device("CPU_DEVICE"))), _press_slopes(6))
    for bad, error in ((0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), ("8", TypeError)):
        with pytest.raises(error, match="num_heads"):
            npattn.alibi_slopes(bad)


# --- tile skipping for packed documents ---------------------------------------------------


def test_packed_documents_skip_tiles_on_the_generic_chunked_path(monkeypatch):
    """Four documents of 4 tokens with 4 x 4 tiles: each pass computes the 4
    diagonal tiles of the 16, and builds no mask (each is one document)."""
    scored, masks = [], []
    tile_scores, visible_tile = chunked._tile_scores, chunked.visible_tile

    def counting_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind):
        scored.append((q0, k0))
        return tile_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind)

    def counting_visible(*args):
        masks.append(args[1:5])
        return visible_tile(*args)

    monkeypatch.setattr(chunked, "_tile_scores", counting_scores)
    monkeypatch.setattr(chunked, "visible_tile", counting_visible)
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    q, k, v = _qkv(batch=(2,), N=2, K=1, T=16, S=16)
    ids = np.repeat(np.arange(4), 4)[None].repeat(2, axis=0)  # (B, T)
    options = dict(q_segment_ids=ids, kv_segment_ids=ids, sinks=np.array([0.1, 0.2]), softcap=3.0)
    out, res = npattn.attention_forward(q, k, v, impl="chunked", block_q=4, block_k=4, **options)
    assert res.kernel == "generic"
    g = npattn.attention_backward(np.ones_like(out), res)
    diagonal = [(i, i) for i in range(0, 16, 4)]
    assert scored == diagonal + diagonal and masks == []
    monkeypatch.undo()
    out_dense, res_dense = npattn.attention_forward(q, k, v, impl="dense", **options)
    g_dense = npattn.attention_backward(np.ones_like(out), res_dense)
    np.testing.assert_allclose(out, out_dense, rtol=0, atol=1e-13)
    for a, b in zip(g[:3], g_dense[:3]):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-13)
    # Shifting batch 1's boundaries by 2 makes the tiles across them mixed: computed, with a mask.
    scored.clear()
    shifted = np.stack([ids[0], np.repeat(np.arange(4), [2, 4, 4, 6])])
    monkeypatch.setattr(chunked, "_tile_scores", counting_scores)
    monkeypatch.setattr(chunked, "visible_tile", counting_visible)
    spec = npattn.options.make_spec(
        q, k, v, impl="chunked", block_q=4, block_k=4, q_segment_ids=shifted, kv_segment_ids=shifted
    )
    chunked.chunked_forward(spec, q, k, v)
    assert set(scored) == set(diagonal) | {(0, 4), (4, 0), (4, 8), (8, 4), (8, 12), (12, 8)}
    # Tile (12, 12) is document 3 alone in both batch elements: visible as a whole, no mask.
    assert sorted((m[0], m[2]) for m in masks) == sorted(set(scored) - {(12, 12)})


# --- the backend matrix --------------------------------------------------------------------


def test_backend_matrix_every_variant_and_no_mutation(backend):
    """Softcap, ALiBi, sinks and segment ids with GQA, causal, lengths and
    dropout, in float64 on every backend, both paths: equal to NumPy's dense
    result, gradients included, and no input (ids and parameters included) mutated."""
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=5, S=6, H=3, Hv=2)
    host = dict(
        q=q,
        k=k,
        v=v,
        dout=RNG.standard_normal((2, 4, 5, 2)),
        dlse=RNG.standard_normal((2, 4, 5)),
        alibi_slopes=npattn.alibi_slopes(4),
        sinks=RNG.standard_normal((2, 4)),
        q_segment_ids=np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]]),
        kv_segment_ids=np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]),
        kv_lengths=np.array([6, 5]),
    )
    options = dict(softcap=2.0, causal=True, align="bottom_right", dropout_p=0.2, seed=17)
    names = ("alibi_slopes", "sinks", "q_segment_ids", "kv_segment_ids", "kv_lengths")
    ref = _run("dense", q, k, v, host["dout"], host["dlse"], **options, **{n: host[n] for n in names})
    arrays = {name: backend.asarray(a) for name, a in host.items()}
    for impl in ("dense", "chunked"):
        out, res = npattn.attention_forward(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            impl=impl,
            block_q=2,
            block_k=4,
            **options,
            **{n: arrays[n] for n in names},
        )
        g = npattn.attention_backward(arrays["dout"], res, dlse=arrays["dlse"])
        np.testing.assert_allclose(backend.to_numpy(out), ref[0], rtol=0, atol=1e-12, err_msg=impl)
        np.testing.assert_allclose(backend.to_numpy(res.lse), ref[1], rtol=0, atol=1e-12, err_msg=impl)
        for name in ("dq", "dk", "dv", "dsinks", "dalibi_slopes"):
            got = backend.to_numpy(getattr(g, name))
            np.testing.assert_allclose(got, getattr(ref[2], name), rtol=0, atol=1e-12, err_msg=f"{impl} {name}")
        assert g.dbias is None
    for name, original in host.items():
        np.testing.assert_array_equal(backend.to_numpy(arrays[name]), original, err_msg=name)
