"""The chunked online-softmax path (npattn.chunked) against the dense oracle.

- float64, every option of CONVENTIONS §1 and every variant of the score
  pipeline (softcap, ALiBi, sinks, segment ids), drawn by hypothesis, with
  block sizes of 1, primes that do not divide the lengths and sizes past the
  length: out, lse and every gradient (dlse, dsinks, dalibi_slopes included)
  agree with dense to ~1e-12, on the generic kernel and on whichever kernel
  ``impl="chunked"`` runs on NumPy;
- central-difference gradient checks of chunked_forward/chunked_backward;
- the backend matrix in float32 (and no input is mutated);
- edge cases: T=0, B=0, T=1 decoding, fully masked rows (0 / -inf / 0, no NaN);
- tile skipping, counted: hidden tiles are never computed, visible tiles build
  no mask (causal, window, lengths, packed documents);
- default tile sizes: 128 x 128 on every CPU backend, the score-budget rule
  of ``chunked.default_blocks`` on an accelerator (forced here by
  monkeypatching the detection), the caller's sizes always winning, and the
  backward tiling as the forward;
- memory: tracemalloc peak of forward+backward at T=S=4096 is < T*S*4/10 bytes;
- impl="auto" switches at AUTO_CHUNKED_MIN_SCORES, and on NumPy at AUTO_FAST_MIN_SCORES;
  the benchmark smoke-runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import pathlib
import tracemalloc
import types

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ALL_FEATURES, attention_cases

import npattn
import npattn.chunked as chunked
from npattn.attention import choose_impl
from npattn.options import (
    AUTO_CHUNKED_MIN_SCORES,
    AUTO_FAST_MIN_SCORES,
    AUTO_FAST_SINGLE_HEAD_MIN_SCORES,
    AUTO_FAST_VARIANT_MIN_SCORES,
    make_spec,
)
from npattn.scores.sinks import apply_sinks, sinks_grad

TOL = dict(rtol=1e-12, atol=1e-12)
REPO = pathlib.Path(__file__).resolve().parents[1]


# --- problems -----------------------------------------------------------------


blocks = st.one_of(st.integers(1, 3), st.sampled_from([2, 4, 5, 7, 11, 64]))  # 1, primes, > any length


@st.composite
def problems(draw, max_len=11):
    """``(q, k, v, options)`` in float64 covering every mask feature, every
    score-pipeline variant, GQA/MQA, dropout, fully masked rows, empty sizes
    and chunked block sizes."""
    case = draw(attention_cases(max_len=max_len, features=ALL_FEATURES + ("masked_row",), empty_sizes=True))
    return (*case.arrays, dict(case.options, impl="chunked", block_q=draw(blocks), block_k=draw(blocks)))


def _chunked(q, k, v, dout, dlse=None, **options):
    """``(out, lse, dq, dk, dv, dbias, dsinks, dalibi_slopes)`` of
    npattn.chunked itself, called as npattn.attention_forward/backward call it
    (sinks merged after the kernel; the public API may send NumPy inputs to a
    backend-specific fast path instead; this file tests the generic Array API
    path)."""
    spec = make_spec(q, k, v, **{**options, "impl": "chunked"})
    xp = spec.xp
    qc, kc, vc = (xp.astype(a, spec.compute_dtype, copy=False) for a in (q, k, v))
    out, lse, _ = apply_sinks(spec, *chunked.chunked_forward(spec, qc, kc, vc))
    dout = xp.astype(dout, spec.compute_dtype, copy=False)
    dq, dk, dv, dbias, params = chunked.chunked_backward(spec, qc, kc, vc, out, lse, dout, dlse)
    dsinks, dslopes = sinks_grad(spec, dout, out, lse, dlse), params.get("alibi_slopes")

    def in_dtype(grad, dtype):
        return None if grad is None else xp.astype(grad, dtype, copy=False)

    dbias, dsinks = in_dtype(dbias, spec.bias_dtype), in_dtype(dsinks, spec.sinks_dtype)
    dslopes = in_dtype(dslopes, spec.alibi_dtype)
    out, dq, dk, dv = (xp.astype(a, spec.dtype, copy=False) for a in (out, dq, dk, dv))
    return out, lse, dq, dk, dv, dbias, dsinks, dslopes


def _run(q, k, v, options, dout, dlse, impl):
    """``(out, lse, *AttentionGrads)``: ``impl="chunked"`` is the generic
    kernel itself (:func:`_chunked`); ``"dense"`` and ``"public chunked"``
    go through npattn.attention_forward (the latter with ``impl="chunked"``,
    whichever kernel that runs)."""
    if impl == "chunked":
        return _chunked(q, k, v, dout, dlse, **options)
    impl = "chunked" if impl == "public chunked" else impl
    out, res = npattn.attention_forward(q, k, v, **{**options, "impl": impl})
    return (out, res.lse) + tuple(npattn.attention_backward(dout, res, dlse=dlse))


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes")


def _assert_paths_agree(chunk, dense, names=NAMES, **tol):
    for name, c, d in zip(names, chunk, dense):
        if d is None:
            assert c is None, name
            continue
        assert c.shape == d.shape and c.dtype == d.dtype, name
        assert not np.isnan(c).any(), f"{name} has NaN"
        np.testing.assert_allclose(c, d, err_msg=name, **(tol or TOL))


# --- chunked vs dense, float64 ---------------------------------------------------


@settings(max_examples=400)
@given(problem=problems(), use_dlse=st.booleans())
def test_chunked_matches_dense(problem, use_dlse):
    q, k, v, options = problem
    rng = np.random.default_rng(0)
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    dlse = rng.standard_normal(q.shape[:-1]) if use_dlse else None
    dense = _run(q, k, v, options, dout, dlse, "dense")
    _assert_paths_agree(_run(q, k, v, options, dout, dlse, "chunked"), dense)
    _assert_paths_agree(_run(q, k, v, options, dout, dlse, "public chunked"), dense)


def _qkv(batch=(2,), N=2, K=2, T=5, S=7, H=3, Hv=4, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((*batch, N, T, H)),
        rng.standard_normal((*batch, K, S, H)),
        rng.standard_normal((*batch, K, S, Hv)),
    )


EDGE_CASES = {
    "T=1 decoding vs long S, bottom_right causal": dict(
        _T=1, _S=300, causal=True, align="bottom_right", block_q=16, block_k=37
    ),
    "T=1 decoding with kv_lengths": dict(
        _T=1, _S=130, causal=True, align="bottom_right", kv_lengths=np.array([130, 17]), block_k=32
    ),
    "blocks larger than both lengths": dict(_T=5, _S=7, causal=True, align="top_left", block_q=64, block_k=64),
    "blocks of 1": dict(_T=6, _S=6, causal=True, bias=np.ones((6, 1)), block_q=1, block_k=1),
    "prime blocks, T>S bottom_right": dict(_T=23, _S=11, causal=True, align="bottom_right", block_q=7, block_k=3),
    "prime blocks, T<S top_left window": dict(_T=11, _S=29, window=(4, 2), align="top_left", block_q=5, block_k=7),
    "GQA N=6 K=2, dropout, bias per head": dict(
        _N=6, _K=2, dropout_p=0.4, seed=5, bias=np.zeros((6, 1, 1)) + 0.5, block_q=3, block_k=4
    ),
    "MQA N=3 K=1, lengths 0": dict(
        _N=3, _K=1, q_lengths=np.array([0, 5]), kv_lengths=np.array([7, 0]), block_q=2, block_k=3
    ),
}


@pytest.mark.parametrize("case", list(EDGE_CASES), ids=list(EDGE_CASES))
def test_edge_cases_match_dense(case):
    options = dict(EDGE_CASES[case])
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    q, k, v = _qkv(**dims)
    rng = np.random.default_rng(1)
    dout, dlse = rng.standard_normal(q.shape[:-1] + v.shape[-1:]), rng.standard_normal(q.shape[:-1])
    _assert_paths_agree(_run(q, k, v, options, dout, dlse, "chunked"), _run(q, k, v, options, dout, dlse, "dense"))


@pytest.mark.parametrize("dims", [dict(T=0), dict(batch=(0,)), dict(batch=(0, 3), T=0)], ids=str)
def test_empty_inputs_give_shaped_empty_outputs(dims):
    q, k, v = _qkv(**dims)
    bias = np.zeros(q.shape[:-1] + (k.shape[-2],))
    out, lse, *grads = _chunked(
        q, k, v, np.zeros(q.shape[:-1] + v.shape[-1:]), np.zeros(q.shape[:-1]), bias=bias, causal=True, align="top_left"
    )
    assert out.shape == q.shape[:-1] + v.shape[-1:] and lse.shape == q.shape[:-1]
    assert [g.shape for g in grads[:4]] == [q.shape, k.shape, v.shape, bias.shape]
    assert grads[4:] == [None, None]  # no sinks, no ALiBi


def test_fully_masked_rows_give_zero_output_neginf_lse_zero_gradients():
    """Row 0 is hidden in every tile; row 3 is hidden in its first key tile but
    not its second (the running max starts at -inf and must recover)."""
    q, k, v = _qkv(batch=(1,), N=1, K=1, T=4, S=6)
    mask = np.ones((4, 6), dtype=bool)
    mask[0, :] = False
    mask[3, :3] = False
    bias = np.zeros((4, 6))
    bias[1, :] = -np.inf  # row 1 fully masked by the bias alone
    out, lse, dq, dk, dv, dbias, _, _ = _chunked(
        q, k, v, np.ones((1, 1, 4, 4)), np.ones((1, 1, 4)), mask=mask, bias=bias, block_q=2, block_k=3
    )
    assert np.all(out[..., :2, :] == 0) and np.all(np.isneginf(lse[..., :2]))
    assert np.all(np.isfinite(lse[..., 2:])) and np.all(out[..., 3, :] != 0)
    assert np.all(dq[..., :2, :] == 0) and np.all(dbias[:2] == 0)
    for a in (out, lse, dq, dk, dv, dbias):
        assert not np.isnan(a).any()


def test_deterministic_bits():
    q, k, v = _qkv()
    options = dict(
        impl="chunked",
        causal=True,
        bias=np.ones((5, 7)),
        dropout_p=0.3,
        seed=2,
        block_q=2,
        block_k=3,
        align="bottom_right",
    )
    first, second = (_run(q, k, v, options, np.ones((2, 2, 5, 4)), None, "chunked") for _ in range(2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


# --- gradients by central differences, on the chunked path itself ---------------


def _chunked_pair(options: dict, with_bias: bool):
    """chunked_forward/chunked_backward as a pair for npattn.check_gradients."""

    def forward(q, k, v, bias=None):
        spec = make_spec(q, k, v, **options, bias=bias, impl="chunked")
        out, lse = chunked.chunked_forward(spec, q, k, v)
        return (out, lse), (spec, q, k, v, out, lse)

    def backward(cotangents, residuals):
        dout, dlse = cotangents
        dq, dk, dv, dbias, _ = chunked.chunked_backward(*residuals, dout, dlse)
        return (dq, dk, dv, dbias) if with_bias else (dq, dk, dv)

    return forward, backward


def _check_chunked_gradients(q, k, v, options, **check):
    options = dict(options)
    options.pop("impl", None)
    bias = options.pop("bias", None)
    forward, backward = _chunked_pair(options, bias is not None)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    names = ["q", "k", "v", "bias"][: len(inputs)]
    return npattn.check_gradients(forward, backward, inputs, names=names, **check)


GRADCHECK_CASES = {
    "causal bottom_right T<S, bias, blocks 2x3": dict(
        _T=3, _S=5, causal=True, align="bottom_right", bias=np.linspace(-1, 1, 15).reshape(3, 5), block_q=2, block_k=3
    ),
    "GQA N=4 K=2, window, dropout, blocks 1": dict(
        _batch=(1,), _N=4, _K=2, _T=3, _S=3, window=(1, 0), dropout_p=0.3, seed=9, block_q=1, block_k=1
    ),
    "T>S top_left, lengths, mask, row bias": dict(
        _T=4,
        _S=3,
        causal=True,
        align="top_left",
        q_lengths=np.array([4, 2]),
        kv_lengths=np.array([3, 1]),
        mask=np.array([[True, False, True]]),
        bias=np.array([[0.5], [-0.2], [0.1], [0.3]]),
        block_q=3,
        block_k=2,
    ),
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES), ids=list(GRADCHECK_CASES))
def test_chunked_gradients_full_jacobian(case):
    options = dict(GRADCHECK_CASES[case])
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    q, k, v = _qkv(**{"H": 2, "Hv": 2, "N": 2, "K": 2, **dims}, seed=3)
    result = _check_chunked_gradients(q, k, v, options, jacobian=True, max_jacobian_elements=10**6)
    assert result.ok and result.jacobian_checked


@settings(max_examples=20)
@given(problem=problems(max_len=5))
def test_chunked_gradients_random_vjp(problem):
    q, k, v, options = problem
    _check_chunked_gradients(q, k, v, options, jacobian=False)


# --- the backend matrix ----------------------------------------------------------


BACKEND_CASES = {
    "gqa causal bottom_right, lengths, bias, dropout": dict(
        _N=4,
        _K=2,
        _T=6,
        _S=9,
        causal=True,
        align="bottom_right",
        q_lengths=np.array([6, 4]),
        kv_lengths=np.array([9, 5]),
        bias=np.linspace(-1, 1, 9),
        dropout_p=0.25,
        seed=4,
        block_q=4,
        block_k=5,
    ),
    "mask + window top_left, blocks 1 and 3": dict(
        _T=5, _S=5, mask=np.random.default_rng(5).random((2, 1, 5, 5)) < 0.7, window=(2, 1), block_q=1, block_k=3
    ),
}


@pytest.mark.parametrize("case", list(BACKEND_CASES), ids=list(BACKEND_CASES))
def test_backend_matrix_float32(backend, case):
    options = dict(BACKEND_CASES[case])
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    rng = np.random.default_rng(6)
    host = dict(zip("qkv", (a.astype(np.float32) for a in _qkv(**dims))))
    host["dout"] = rng.standard_normal(host["q"].shape[:-1] + host["v"].shape[-1:]).astype(np.float32)
    host["dlse"] = rng.standard_normal(host["q"].shape[:-1]).astype(np.float32)
    for name in ("mask", "bias", "q_lengths", "kv_lengths"):
        if name in options:
            value = options.pop(name)
            host[name] = value.astype(np.float32) if name == "bias" else value
    arrays = {name: backend.asarray(a) for name, a in host.items()}
    extra = {name: a for name, a in arrays.items() if name not in ("q", "k", "v", "dout", "dlse")}
    results = {}
    for impl in ("chunked", "dense"):
        got = _run(arrays["q"], arrays["k"], arrays["v"], {**options, **extra}, arrays["dout"], arrays["dlse"], impl)
        results[impl] = [None if a is None else backend.to_numpy(a) for a in got]
    _assert_paths_agree(results["chunked"], results["dense"], rtol=1e-4, atol=1e-5)
    assert all(a.dtype == np.float32 for a in results["chunked"] if a is not None)
    for name, original in host.items():  # inputs are never mutated
        np.testing.assert_array_equal(backend.to_numpy(arrays[name]), original, err_msg=name)


# --- tile skipping, counted --------------------------------------------------------


def _positional_visibility(T, S, *, left=None, right=None, offset=0, q_len=None, kv_len=None, segments=None):
    """An independent (T, S) oracle of the index rules, for one batch element
    (``segments``: its ``(q ids (T,), kv ids (S,))``)."""
    i = np.arange(T)[:, None]
    j = np.arange(S)[None, :]
    p = i + offset
    visible = np.ones((T, S), dtype=bool)
    if left is not None:
        visible &= j >= p - left
    if right is not None:
        visible &= j <= p + right
    if q_len is not None:
        visible &= i < q_len
    if kv_len is not None:
        visible &= j < kv_len
    if segments is not None:
        visible &= segments[0][:, None] == segments[1][None, :]
    return visible


def _expected_tiles(visible, bq, bk):
    """Tiles with any visible entry, and those among them that are mixed."""
    T, S = visible.shape
    some, mixed = set(), set()
    for q0 in range(0, T, bq):
        for k0 in range(0, S, bk):
            tile = visible[q0 : q0 + bq, k0 : k0 + bk]
            if tile.any():
                some.add((q0, k0))
                if not tile.all():
                    mixed.add((q0, k0))
    return some, mixed


class _Counter:
    """Records every tile whose scores are computed and every visibility mask built."""

    def __init__(self, monkeypatch):
        self.scored, self.masks = [], 0
        tile_scores, visible_tile = chunked._tile_scores, chunked.visible_tile

        def counting_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind):
            self.scored.append((q0, k0))
            return tile_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind)

        def counting_visible(*args):
            self.masks += 1
            return visible_tile(*args)

        monkeypatch.setattr(chunked, "_tile_scores", counting_scores)
        monkeypatch.setattr(chunked, "visible_tile", counting_visible)


_DOC_IDS = (np.repeat([0, 1, 2], [5, 3, 8]),) * 2  # (T,), (S,)
_DOCS = dict(q_segment_ids=_DOC_IDS[0][None], kv_segment_ids=_DOC_IDS[1][None])  # batch of one

SKIP_CASES = {
    # name: (T, S, block_q, block_k, options, oracle keywords)
    "causal, blocks of 1": (12, 12, 1, 1, dict(causal=True), dict(right=0)),
    "causal, blocks 4x4": (16, 16, 4, 4, dict(causal=True), dict(right=0)),
    "causal bottom_right T<S, blocks 3x5": (
        7,
        20,
        3,
        5,
        dict(causal=True, align="bottom_right"),
        dict(right=0, offset=13),
    ),
    "window (3, 2), blocks 2x3": (15, 15, 2, 3, dict(window=(3, 2)), dict(left=3, right=2)),
    "lengths, blocks 4x4": (
        14,
        18,
        4,
        4,
        dict(q_lengths=np.array([9]), kv_lengths=np.array([6])),
        dict(q_len=9, kv_len=6),
    ),
    "no rule: every tile, no mask": (6, 10, 4, 3, dict(), dict()),
    # Three packed documents of 5, 3 and 8 tokens: only tiles on the block
    # diagonal are computed, and the ones inside one document build no mask.
    "packed documents, blocks 2x2": (16, 16, 2, 2, _DOCS, dict(segments=_DOC_IDS)),
    "packed documents + causal, blocks 4x3": (16, 16, 4, 3, dict(_DOCS, causal=True), dict(right=0, segments=_DOC_IDS)),
    "packed documents, queries of the last two, blocks 3x4": (
        11,
        16,
        3,
        4,
        dict(q_segment_ids=_DOC_IDS[0][None, 5:], kv_segment_ids=_DOC_IDS[1][None]),
        dict(segments=(_DOC_IDS[0][5:], _DOC_IDS[1])),
    ),
}


@pytest.mark.parametrize("case", list(SKIP_CASES), ids=list(SKIP_CASES))
def test_hidden_tiles_are_never_computed(monkeypatch, case):
    T, S, bq, bk, options, rules = SKIP_CASES[case]
    q, k, v = _qkv(batch=(1,), N=2, K=1, T=T, S=S)
    counter = _Counter(monkeypatch)
    spec = make_spec(q, k, v, impl="chunked", block_q=bq, block_k=bk, **options)
    out, lse = chunked.chunked_forward(spec, q, k, v)
    forward_scored, forward_masks = list(counter.scored), counter.masks
    chunked.chunked_backward(spec, q, k, v, out, lse, np.ones_like(out), None)
    backward_scored = counter.scored[len(forward_scored) :]
    backward_masks = counter.masks - forward_masks

    visible = _positional_visibility(T, S, **rules)
    some, mixed = _expected_tiles(visible, bq, bk)
    for scored in (forward_scored, backward_scored):
        assert len(scored) == len(set(scored)), "a tile was computed twice"
        assert set(scored) == some
    assert forward_masks == backward_masks == len(mixed)
    if case == "causal, blocks of 1":  # T*(T+1)/2 of the T*T tiles, none above the diagonal
        assert len(forward_scored) == 12 * 13 // 2 and all(k0 <= q0 for q0, k0 in forward_scored)
        assert forward_masks == 0  # with blocks of 1 every computed tile is fully visible
    ref = npattn.attention(q, k, v, impl="dense", **options)
    np.testing.assert_allclose(out, ref, **TOL)


# --- default tile sizes: 128 on the CPU, a score budget on an accelerator ----------


def _spec_without_memory(B, N, T, S, **options):
    """A NumPy spec of q (B, N, T, 4), k = v (B, N, S, 4) with no memory behind it."""
    zero = np.zeros((), dtype=np.float32)
    q, kv = np.broadcast_to(zero, (B, N, T, 4)), np.broadcast_to(zero, (B, N, S, 4))
    return make_spec(q, kv, kv, impl="chunked", **options)


DEFAULT_BLOCK_CASES = {
    # name: (B, N, T, S, options, expected (block_q, block_k) on an accelerator)
    "B*N=8, T=S=16384: 2048x2048 = 2**25": (1, 8, 16384, 16384, {}, (2048, 2048)),
    "B*N=8, T=S=4096: same tiles": (1, 8, 4096, 4096, {}, (2048, 2048)),
    "B*N=16: b=1024, keys take the rest": (2, 8, 16384, 16384, {}, (1024, 2048)),
    "B*N=64: b=512, keys take the rest": (8, 8, 8192, 8192, {}, (512, 1024)),
    "B*N=2**17: clipped up to 128": (4096, 32, 4096, 4096, {}, (128, 128)),
    "short sequences: one whole tile": (1, 8, 300, 389, {}, (300, 389)),
    "decoding T=1, B*N=1024: keys get 2048": (32, 32, 1, 32768, {}, (1, 2048)),
    "short keys: queries get the rest": (1, 8, 16384, 100, {}, (2048, 100)),
    "caller's block_q wins, keys take the rest": (1, 8, 16384, 16384, dict(block_q=256), (256, 2048)),
    "caller's block_k wins, queries take the rest": (1, 8, 16384, 16384, dict(block_k=64), (2048, 64)),
    "caller's sizes win": (1, 8, 16384, 16384, dict(block_q=3, block_k=5000), (3, 5000)),
    "T=0: a valid size": (1, 8, 0, 5, {}, (1, 5)),
}


@pytest.mark.parametrize("case", list(DEFAULT_BLOCK_CASES), ids=list(DEFAULT_BLOCK_CASES))
def test_default_blocks_on_an_accelerator(monkeypatch, case):
    B, N, T, S, options, expected = DEFAULT_BLOCK_CASES[case]
    spec = _spec_without_memory(B, N, T, S, **options)
    assert chunked.default_blocks(spec) == (options.get("block_q", 128), options.get("block_k", 128))  # NumPy
    monkeypatch.setattr(chunked, "on_accelerator", lambda xp, device: True)
    bq, bk = chunked.default_blocks(spec)
    assert (bq, bk) == expected
    if not options:  # the rule's promises: powers of two in range, or a whole sequence; the budget holds
        for size, length in ((bq, T), (bk, S)):
            assert size == max(length, 1) or (128 <= size <= 2048 and size & (size - 1) == 0), (size, length)
        assert B * N * bq * bk <= chunked.ACCELERATOR_TILE_SCORES or (bq, bk) == (128, 128)


def test_default_blocks_on_the_cpu_backends_are_128(backend):
    """NumPy, read-only NumPy, array-api-strict on both devices (``device1`` is
    a CPU stand-in, not an accelerator) and torch CPU tensors keep 128 x 128;
    only CuPy is an accelerator."""
    q = backend.asarray(np.zeros((1, 2, 300, 4)))
    kv = backend.asarray(np.zeros((1, 2, 389, 4)))
    spec = make_spec(q, kv, kv, impl="chunked")
    accelerated = backend.name == "cupy"
    assert chunked.on_accelerator(spec.xp, spec.device) is accelerated
    assert chunked.default_blocks(spec) == ((300, 389) if accelerated else (128, 128))
    spec = make_spec(q, kv, kv, impl="chunked", block_q=64)
    assert chunked.default_blocks(spec) == ((64, 389) if accelerated else (64, 128))


def test_on_accelerator_detection():
    numpy_ns = array_api_compat.array_namespace(np.zeros(1))
    assert not chunked.on_accelerator(numpy_ns, "cpu")
    assert chunked.on_accelerator(types.ModuleType("cupy"), None)  # by namespace, no GPU needed
    xps = pytest.importorskip("array_api_strict")
    assert not chunked.on_accelerator(xps, xps.Device("device1"))
    torch = pytest.importorskip("torch")
    torch_ns = array_api_compat.array_namespace(torch.zeros(1))
    assert not chunked.on_accelerator(torch_ns, torch.device("cpu"))
    assert not chunked.on_accelerator(torch_ns, torch.device("meta"))
    assert chunked.on_accelerator(torch_ns, torch.device("cuda", 0))  # a device object needs no GPU


def test_accelerator_default_tiles_are_the_same_in_forward_and_backward(monkeypatch):
    """With the accelerator rule forced on the CPU and a budget of 2**17
    scores, B*N = 2 at T=300, S=389 gives 256 x 256 tiles: the forward and the
    backward compute the same four tiles, and the result equals dense."""
    monkeypatch.setattr(chunked, "on_accelerator", lambda xp, device: True)
    monkeypatch.setattr(chunked, "ACCELERATOR_TILE_SCORES", 2**17)
    q, k, v = _qkv(batch=(1,), N=2, K=1, T=300, S=389, seed=4)
    rng = np.random.default_rng(5)
    dout, dlse = rng.standard_normal((1, 2, 300, 4)), rng.standard_normal((1, 2, 300))
    options = dict(bias=rng.standard_normal((300, 1)))
    assert chunked.default_blocks(make_spec(q, k, v, impl="chunked", **options)) == (256, 256)
    counter = _Counter(monkeypatch)
    chunk = _chunked(q, k, v, dout, dlse, **options)
    tiles = {(q0, k0) for q0 in (0, 256) for k0 in (0, 256)}
    assert len(counter.scored) == 8 and set(counter.scored[:4]) == set(counter.scored[4:]) == tiles
    _assert_paths_agree(chunk, _run(q, k, v, options, dout, dlse, "dense"))


# --- memory ----------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_peak_memory_is_far_below_the_score_matrix(causal):
    T = S = 4096
    H = 16
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, n, H), dtype=np.float32) for n in (T, S, S, T))
    small = q[..., :8, :]
    _chunked(small, small, small, small)  # first-call costs (imports) stay out of the measurement
    tracemalloc.start()
    try:
        _out, _lse, dq, *_ = _chunked(q, k, v, dout, causal=causal)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert dq.shape == q.shape
    budget = T * S * 4 // 10
    assert peak < budget, f"peak {peak / 2**20:.2f} MiB >= {budget / 2**20:.2f} MiB"


# --- impl="auto" and the benchmark -----------------------------------------------


def test_auto_switches_to_chunked_above_the_threshold(monkeypatch):
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")  # the generic path: only the size rule applies
    side = math.isqrt(AUTO_CHUNKED_MIN_SCORES)  # T = S = side gives exactly the threshold
    for T, expected in ((side, "dense"), (side + 1, "chunked")):
        q = np.broadcast_to(np.zeros((), dtype=np.float32), (1, T, 1))  # no memory behind it
        assert choose_impl(make_spec(q, q, q)).impl == expected


def test_auto_picks_the_numpy_fast_path_from_2_to_the_21_scores_in_total(monkeypatch):
    def impl(T, S, dtype=np.float32, N=8, B=4, **options):
        q = np.broadcast_to(np.zeros((), dtype=dtype), (B, N, T, 4))  # no memory behind it
        k = np.broadcast_to(np.zeros((), dtype=dtype), (B, N, S, 4))
        return choose_impl(make_spec(q, k, k, **options)).impl

    assert AUTO_FAST_MIN_SCORES == 2**21
    assert impl(256, 256) == impl(512, 128) == impl(256, 256, np.float64) == impl(256, 256, np.float16) == "chunked"
    assert impl(128, 128, B=16) == "chunked"  # in total, not per head
    assert impl(255, 256) == impl(2048, 1) == impl(1448, 1448, N=1, B=1) == "dense"
    ids = np.zeros((4, 256), dtype=np.int64)
    for options in [
        dict(causal=True),
        dict(window=(8, 0)),
        dict(kv_lengths=np.full(4, 9)),
        dict(q_segment_ids=ids, kv_segment_ids=ids),
        dict(mask=np.ones((256, 256), dtype=bool)),
        dict(bias=np.zeros((256, 256))),
    ]:
        assert impl(256, 256, **options) == "chunked", options
        fewer = {**options, "kv_segment_ids": ids[:, :255]} if "kv_segment_ids" in options else options
        fewer = {**fewer, "mask": np.ones((256, 255), dtype=bool)} if "mask" in options else fewer
        fewer = {**fewer, "bias": np.zeros((256, 255))} if "bias" in options else fewer
        assert impl(256, 255, align="top_left", **fewer) == "dense", options
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    assert impl(256, 256) == impl(256, 256, causal=True) == "dense"
    xps = pytest.importorskip("array_api_strict")
    monkeypatch.delenv("NPATTN_FAST_NUMPY")
    x = xps.zeros((8, 512, 4), dtype=xps.float32)  # 2**21 scores
    assert choose_impl(make_spec(x, x, x)).impl == "dense"  # no fast path for other namespaces


def test_auto_thresholds_of_score_mods_and_of_softcap_alibi_and_dropout():
    """Score modifications run one kv head per fast-path item, so ``"auto"``
    takes that path from AUTO_FAST_SINGLE_HEAD_MIN_SCORES; a softcap, ALiBi
    or dropout, whose dense path makes passes of its own, from
    AUTO_FAST_VARIANT_MIN_SCORES; a bias or sinks from AUTO_FAST_MIN_SCORES,
    as plain attention."""

    def impl(T, **options):
        q = np.broadcast_to(np.zeros((), dtype=np.float32), (4, 8, T, 4))  # no memory behind it
        return choose_impl(make_spec(q, q, q, **options)).impl

    assert AUTO_FAST_SINGLE_HEAD_MIN_SCORES == 2**22 and AUTO_FAST_VARIANT_MIN_SCORES == 2**20
    mods = dict(score_mods=[npattn.head_temperature(np.ones(8))])
    assert impl(512, **mods) == "chunked"  # 2**23
    assert impl(362, **mods) == "dense"  # just below 2**22
    assert impl(256, causal=True, **mods) == "dense"  # 2**21
    for variant in [dict(alibi_slopes=np.ones(8)), dict(softcap=5.0), dict(dropout_p=0.1, seed=0)]:
        assert impl(182, causal=True, **variant) == impl(182, **variant) == "chunked", variant  # from 2**20
        assert impl(181, **variant) == "dense", variant  # just below 2**20
    assert impl(182, bias=np.zeros((182, 182))) == impl(182, sinks=np.zeros(8)) == "dense"  # 2**21 for them
    assert impl(256, sinks=np.zeros(8)) == "chunked"


def test_spec_replace_is_dataclasses_replace_without_init():
    x = np.zeros((2, 3, 5, 4))
    spec = make_spec(x, x, x, causal=True, q_lengths=np.array([5, 3]))
    fast, slow = spec.replace(impl="dense", block_q=7), dataclasses.replace(spec, impl="dense", block_q=7)
    assert all(getattr(fast, f.name) is getattr(slow, f.name) for f in dataclasses.fields(spec))
    assert spec.impl == "auto" and spec.block_q is None  # the original is untouched
    with pytest.raises(TypeError, match=r"AttentionSpec has no fields \['impll'\]"):
        spec.replace(impll="dense")


def test_benchmark_quick_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_chunked", REPO / "benchmarks" / "bench_chunked.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--quick"])
    printed = capsys.readouterr().out
    assert "chunked" in printed and "causal" in printed
