"""The dense path against the independent float64 oracle, its gradients by
central differences for every mask feature, and the semantic properties of
CONVENTIONS §1."""

from __future__ import annotations

import dataclasses
import math
import re
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pairs import check_attention_gradients
from reference import reference_attention
from strategies import ALL_FEATURES, attention_cases

import npattn

RNG = np.random.default_rng(1234)


def _qkv(batch=(2,), N=2, K=2, T=3, S=4, H=2, Hv=3, rng=RNG):
    return (
        rng.standard_normal((*batch, N, T, H)),
        rng.standard_normal((*batch, K, S, H)),
        rng.standard_normal((*batch, K, S, Hv)),
    )


@given(case=attention_cases())
def test_forward_matches_independent_reference(case):
    out, res = npattn.attention_forward(*case.arrays, impl="dense", **case.options)
    ref_out, ref_lse, ref_probs = reference_attention(*case.arrays, **case.options)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(res.lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(res.lse[finite], ref_lse[finite], rtol=0, atol=1e-12)
    np.testing.assert_allclose(res.probs, ref_probs, rtol=0, atol=1e-12)


@settings(max_examples=150)
@given(case=attention_cases(max_len=5, features=ALL_FEATURES + ("masked_row",), empty_sizes=True))
@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_variants_match_independent_reference(impl, case):
    """Softcap, ALiBi, sinks and segment ids with every mask feature, on the
    dense path and the chunked one (small blocks, whichever kernel runs):
    out, lse and (dense) the probabilities of the real keys, the sink's share
    removed, against the plain-Python oracle."""
    out, res = npattn.attention_forward(*case.arrays, impl=impl, block_q=2, block_k=3, **case.options)
    ref_out, ref_lse, ref_probs = reference_attention(*case.arrays, **case.options)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(res.lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(res.lse[finite], ref_lse[finite], rtol=1e-14, atol=1e-12)
    if impl == "dense":
        np.testing.assert_allclose(res.probs, ref_probs, rtol=0, atol=1e-12)


@settings(max_examples=15)
@given(case=attention_cases(max_len=4))
def test_gradients_by_central_differences(case):
    check_attention_gradients(*case.arrays, {**case.options, "impl": "dense"}, jacobian=False)


# One named case per mask feature (and combinations), small enough for the full Jacobian.
FEATURES = {
    "plain": dict(),
    "bool mask": dict(mask=RNG.random((2, 1, 3, 4)) < 0.6),
    "bias": dict(bias=RNG.standard_normal((2, 3, 4))),
    "bias -inf entries": dict(bias=np.where(RNG.random((3, 4)) < 0.3, -np.inf, 0.5)),
    "causal top_left T<S": dict(causal=True, align="top_left"),
    "causal bottom_right T<S": dict(causal=True, align="bottom_right"),
    "causal top_left T>S": dict(causal=True, align="top_left", _T=5, _S=3),
    "causal bottom_right T>S": dict(causal=True, align="bottom_right", _T=5, _S=3),
    "window": dict(window=(1, 1), align="top_left"),
    "window one-sided": dict(window=(None, 1), align="bottom_right"),
    "lengths": dict(q_lengths=np.array([3, 2]), kv_lengths=np.array([4, 2])),
    "lengths + causal bottom_right": dict(
        causal=True, align="bottom_right", q_lengths=np.array([2, 3]), kv_lengths=np.array([3, 4])
    ),
    "combined mask+bias+window+lengths": dict(
        mask=RNG.random((2, 2, 3, 4)) < 0.8,
        bias=RNG.standard_normal((4,)),
        window=(2, 0),
        align="bottom_right",
        kv_lengths=np.array([4, 3]),
    ),
    "GQA (N=4, K=2)": dict(_N=4, _K=2, causal=True, align="bottom_right"),
    "MQA (N=3, K=1)": dict(_N=3, _K=1, bias=RNG.standard_normal((3, 1, 4))),
    "dropout": dict(dropout_p=0.3, seed=11),
    "dropout + GQA + mask": dict(dropout_p=0.5, seed=5, _N=4, _K=2, mask=RNG.random((3, 4)) < 0.7),
    "fully masked rows": dict(
        mask=np.array([[True, False, True, True], [False] * 4, [True] * 4]), q_lengths=np.array([3, 1])
    ),
    "scale": dict(scale=1.7),
    # The score-pipeline variants (issue 14); tests/test_variants.py has many more.
    "softcap": dict(softcap=0.6),
    "alibi bottom_right": dict(alibi_slopes=np.array([0.5, 0.25]), align="bottom_right"),
    "sinks + fully masked row + padded row": dict(
        sinks=np.array([0.4, -1.0]), mask=np.array([[False] * 4, [True] * 4, [True] * 4]), q_lengths=np.array([3, 2])
    ),
    "segments": dict(
        q_segment_ids=np.array([[0, 0, 1], [0, 1, 1]]), kv_segment_ids=np.array([[0, 1, 1, 1], [0, 0, 1, 1]])
    ),
    "every variant + GQA + dropout": dict(
        _N=4,
        _K=2,
        softcap=1.2,
        alibi_slopes=RNG.uniform(0.1, 1.0, (2, 4)),
        sinks=RNG.standard_normal(4),
        q_segment_ids=np.array([[0, 0, 1], [0, 1, 1]]),
        kv_segment_ids=np.array([[0, 1, 1, 1], [0, 0, 1, 1]]),
        causal=True,
        align="top_left",
        dropout_p=0.3,
        seed=2,
    ),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_gradients_full_jacobian_per_feature(feature):
    options = dict(FEATURES[feature])
    shape = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    q, k, v = _qkv(**shape)
    result = check_attention_gradients(q, k, v, {**options, "impl": "dense"}, jacobian=True)
    assert result.jacobian_checked and result.ok
    assert max(result.max_abs_error.values()) < 1e-6


def test_unmasked_rows_sum_to_one_and_masked_rows_to_zero():
    q, k, v = _qkv(T=5, S=5)
    mask = RNG.random((2, 2, 5, 5)) < 0.5
    mask[0, 0, 1] = False
    _, res = npattn.attention_forward(q, k, v, mask=mask, causal=True)
    sums = res.probs.sum(-1)
    has_visible = (mask & np.tril(np.ones((5, 5), bool))).any(-1)
    np.testing.assert_allclose(sums[has_visible], 1.0, atol=1e-14)
    np.testing.assert_array_equal(sums[~has_visible], 0.0)
    assert np.all(np.isneginf(res.lse[~has_visible]))


def test_permuting_keys_and_values_together_leaves_output_unchanged():
    q, k, v = _qkv(S=6)
    perm = RNG.permutation(6)
    out = npattn.attention(q, k, v)
    out_perm = npattn.attention(q, k[..., perm, :], v[..., perm, :])
    np.testing.assert_allclose(out, out_perm, atol=1e-13)


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_causal_output_has_no_gradient_from_later_keys(align):
    T, S = 4, 6
    q, k, v = _qkv(T=T, S=S)
    offset = 0 if align == "top_left" else S - T
    for i in range(T):
        out, res = npattn.attention_forward(q, k, v, causal=True, align=align)
        dout = np.zeros_like(out)
        dout[..., i, :] = RNG.standard_normal(dout[..., i, :].shape)
        g = npattn.attention_backward(dout, res)
        later = slice(i + offset + 1, None)
        assert np.all(g.dk[..., later, :] == 0) and np.all(g.dv[..., later, :] == 0)
        assert np.any(g.dv[..., : i + offset + 1, :] != 0)


def test_fully_masked_rows_give_zero_output_neginf_lse_zero_gradients():
    q, k, v = _qkv()
    bias = RNG.standard_normal((2, 2, 3, 4))
    mask = np.ones((2, 2, 3, 4), bool)
    mask[1, 0, 2] = False
    bias[0, 1, 0] = -np.inf  # a row masked by the bias alone
    out, res = npattn.attention_forward(q, k, v, mask=mask, bias=bias)
    g = npattn.attention_backward(np.ones_like(out), res, dlse=np.ones_like(res.lse))
    for b, n, i in [(1, 0, 2), (0, 1, 0)]:
        assert np.all(out[b, n, i] == 0) and res.lse[b, n, i] == -np.inf
        assert np.all(g.dq[b, n, i] == 0) and np.all(g.dbias[b, n, i] == 0)
    for arr in (out, g.dq, g.dk, g.dv, g.dbias):
        assert np.all(np.isfinite(arr))


def test_every_row_masked_gives_zero_dk_dv():
    q, k, v = _qkv()
    out, res = npattn.attention_forward(q, k, v, kv_lengths=np.array([0, 0]))
    g = npattn.attention_backward(np.ones_like(out), res, dlse=np.ones_like(res.lse))
    assert np.all(out == 0) and np.all(np.isneginf(res.lse))
    assert all(np.all(x == 0) for x in (g.dq, g.dk, g.dv))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_dtype_policy_narrow_inputs_accumulate_in_float32(dtype):
    q, k, v = (a.astype(dtype) for a in _qkv(H=8, T=6, S=6))
    bias = RNG.standard_normal((6, 6)).astype(np.float64)
    out, res = npattn.attention_forward(q, k, v, bias=bias, causal=True)
    assert out.dtype == dtype
    assert res.lse.dtype == np.float32 and res.probs.dtype == np.float32
    g = npattn.attention_backward(np.ones_like(out), res)
    assert g.dq.dtype == g.dk.dtype == g.dv.dtype == dtype
    assert g.dbias.dtype == np.float64 and g.dbias.shape == (6, 6)
    ref_out, ref_lse, _ = reference_attention(q, k, v, bias=bias, causal=True)
    tol = 2e-3 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(out.astype(np.float64), ref_out, atol=tol)
    np.testing.assert_allclose(res.lse, ref_lse, atol=tol)


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = _qkv(H=4)
    np.testing.assert_allclose(npattn.attention(q, k, v), npattn.attention(q, k, v, scale=0.5), atol=0)


def test_backward_can_run_twice_on_the_same_residuals():
    q, k, v = _qkv()
    out, res = npattn.attention_forward(q, k, v, dropout_p=0.2, seed=3)
    g1 = npattn.attention_backward(np.ones_like(out), res)
    g2 = npattn.attention_backward(np.ones_like(out), res)
    for a, b in zip(g1[:3], g2[:3]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_residuals_hold_every_field_and_stay_frozen(impl):
    """The residual classes set their fields in their own ``__init__`` (for the
    per-call floor), still as frozen dataclasses: every field readable, none
    assignable, and the dataclass's repr and fields as generated."""
    q, k, v = _qkv()
    out, res = npattn.attention_forward(q, k, v, impl=impl)
    names = [field.name for field in dataclasses.fields(res)]
    extra = "probs" if impl == "dense" else "kernel"
    assert names == ["spec", "q", "k", "v", "out", "lse", extra]
    assert res.q is q and res.k is k and res.v is v and res.out is out and res.lse.shape == out.shape[:-1]
    assert (res.probs.shape == q.shape[:-1] + (k.shape[-2],)) if impl == "dense" else res.kernel == "numpy"
    assert repr(res).startswith(type(res).__name__ + "(spec=")
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.out = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(res, extra, None)


def test_bias_gradient_is_summed_to_the_bias_shape():
    q, k, v = _qkv()
    full_bias = np.broadcast_to(RNG.standard_normal((1, 4)), (2, 2, 3, 4))
    out, res = npattn.attention_forward(q, k, v, bias=full_bias[0, 0, :1])
    _out_full, res_full = npattn.attention_forward(q, k, v, bias=np.array(full_bias))
    dout = RNG.standard_normal(out.shape)
    small = npattn.attention_backward(dout, res).dbias
    big = npattn.attention_backward(dout, res_full).dbias
    assert small.shape == (1, 4)
    np.testing.assert_allclose(small, big.sum(axis=(0, 1, 2), keepdims=True)[0, 0], atol=1e-12)


def test_backend_matrix_forward_backward_and_no_mutation(backend):
    q, k, v = (a.astype(np.float32) for a in _qkv(batch=(2,), N=4, K=2, T=5, S=6, H=3))
    mask = RNG.random((5, 6)) < 0.8
    bias = RNG.standard_normal((2, 1, 5, 6)).astype(np.float32)
    kv_lengths = np.array([6, 4])
    dout = RNG.standard_normal((2, 4, 5, 3)).astype(np.float32)
    options = dict(causal=True, window=(3, None), align="bottom_right", dropout_p=0.25, seed=9)
    ref_out, ref_res = npattn.attention_forward(q, k, v, mask=mask, bias=bias, kv_lengths=kv_lengths, **options)
    ref_g = npattn.attention_backward(dout, ref_res)

    inputs = [backend.asarray(a) for a in (q, k, v, mask, bias, kv_lengths, dout)]
    before = [backend.to_numpy(a).copy() for a in inputs]
    bq, bk, bv, bmask, bbias, blen, bdout = inputs
    out, res = npattn.attention_forward(bq, bk, bv, mask=bmask, bias=bbias, kv_lengths=blen, **options)
    g = npattn.attention_backward(bdout, res)
    np.testing.assert_allclose(backend.to_numpy(out), ref_out, atol=1e-5)
    np.testing.assert_allclose(backend.to_numpy(res.lse), ref_res.lse, atol=1e-5)
    for got, want in zip(g, ref_g):
        if want is None:  # a gradient of an option not given (dsinks, dalibi_slopes)
            assert got is None
            continue
        np.testing.assert_allclose(backend.to_numpy(got), want, atol=1e-5)
    for arr, orig in zip(inputs, before):
        np.testing.assert_array_equal(backend.to_numpy(arr), orig)


def _softmax_in(base: int | str):
    """The plain lane's softmax: base 2 from a zero reference (its default
    where the scores fit), or ``base`` e, the general code's (the zero
    reference's bound set below every score)."""
    from npattn import dense_numpy

    bounds = dense_numpy.ZERO_REFERENCE_BOUND  # the fast path's, shared: patched only around dense calls
    return mock.patch.dict(bounds, {} if base == 2 else {dtype: -1.0 for dtype in bounds})


def _assert_general(base: int | str, got, want, dtype, err_msg: str = "") -> None:
    """The plain lane against the general dense code, both computing in
    ``dtype``: the same bits with the general code's softmax; in base 2, its
    numbers to the last bits of ``dtype``, -inf where it has them."""
    got, want = np.asarray(got), np.asarray(want)
    if base != 2:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
        return
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=err_msg)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=err_msg)


@settings(max_examples=60)
@given(
    shape=st.tuples(
        st.lists(st.integers(0, 2), max_size=2), st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(0, 5)
    ),
    S=st.integers(1, 5),
    dims=st.tuples(st.integers(0, 4), st.integers(0, 4)),
    dtype=st.sampled_from([np.float32, np.float64]),
    with_lse=st.booleans(),
    base=st.sampled_from([2, "e"]),
)
def test_a_call_without_options_takes_the_plain_lane_with_the_general_paths_numbers(
    shape, S, dims, dtype, with_lse, base
):
    """No option given: ``plain_spec`` builds the spec :func:`make_spec`
    would, and the dense path's NumPy plain kernels
    (:func:`npattn.dense_numpy.plain_forward` / ``plain_backward``) give the
    general dense code's numbers (which runs when ``scores_are_raw`` is
    False), forward and backward, GQA and empty sizes included: its bits
    with its softmax, its last bits with the base-2 one (:func:`_assert_general`)."""
    from npattn.attention import plain_call_spec
    from npattn.options import AttentionSpec, make_spec, plain_spec
    from npattn.scores.visibility import visible_tile

    batch, K, G, T = shape
    H, Hv = dims
    rng = np.random.default_rng(len(batch) + T + S)
    q = rng.standard_normal((*batch, K * G, T, H)).astype(dtype)
    k = rng.standard_normal((*batch, K, S, H)).astype(dtype)
    v = rng.standard_normal((*batch, K, S, Hv)).astype(dtype)
    plain = plain_spec(q, k, v)
    assert plain is not None and plain.scores_are_raw and visible_tile(plain, 0, T, 0, S) is None
    general = make_spec(q, k, v)
    assert plain.__dict__.keys() == general.__dict__.keys()
    for name, value in general.__dict__.items():
        assert getattr(plain, name) == value or getattr(plain, name) is value, name
    with _softmax_in(base):
        out, res = npattn.attention_forward(q, k, v)
    dout = rng.standard_normal(out.shape).astype(dtype)
    dlse = rng.standard_normal(res.lse.shape).astype(dtype) if with_lse else None
    grads = npattn.attention_backward(dout, res, dlse=dlse)
    assert res.spec is plain_call_spec(q, k, v)  # the plain lane: no dispatch between the cached spec and the kernel
    # impl="dense" takes make_spec and the general dispatch, where the patch selects the general code
    with mock.patch.object(AttentionSpec, "scores_are_raw", property(lambda spec: False)):
        ref, ref_res = npattn.attention_forward(q, k, v, impl="dense")
        ref_grads = npattn.attention_backward(dout, ref_res, dlse=dlse)
    for a, b in ((out, ref), (res.lse, ref_res.lse), (res.probs, ref_res.probs)):
        _assert_general(base, a, b, dtype)
    for name in ("dq", "dk", "dv"):
        _assert_general(base, getattr(grads, name), getattr(ref_grads, name), dtype, err_msg=name)


@pytest.mark.parametrize(
    "T, S, G, contiguous",
    [
        (64, 64, 1, True),
        (16, 64, 4, True),
        (1, 512, 4, True),
        (16, 16, 1, False),
        (128, 128, 1, False),
        (64, 512, 1, False),
    ],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_queries_taken_as_contiguous_columns_keep_the_general_paths_bits(T, S, G, contiguous, dtype):
    """Where :func:`npattn.dense_numpy.contiguous_columns` takes the scaled
    queries' transpose as a contiguous block (decoding's few columns, short
    square heads) and where not, the plain lane and the general dense code
    multiply the same layout and give the same bits, forward and backward
    (the lane with the general code's softmax). BLAS runs single-threaded,
    as in the lane's chunks: on some cores (OpenBLAS's "Haswell" kernels)
    how BLAS's own threads split a product changes the rounding of its
    entries."""
    from threadpoolctl import threadpool_limits

    from npattn import dense_numpy
    from npattn.options import AttentionSpec

    assert dense_numpy.contiguous_columns(G * T, S) is contiguous
    rng = np.random.default_rng(T + S + G)
    q = rng.standard_normal((2, 2 * G, T, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, S, 16)).astype(dtype) for _ in range(2))
    q_t = dense_numpy.scaled_transpose(q.reshape(2, 2, G * T, 16), 0.25, S)
    assert q_t.flags.c_contiguous is contiguous and np.array_equal(
        q_t, np.swapaxes(0.25 * q.reshape(2, 2, G * T, 16), -1, -2)
    )
    with threadpool_limits(limits=1, user_api="blas"):
        with _softmax_in("e"):
            out, res = npattn.attention_forward(q, k, v, impl="dense")
        dout = rng.standard_normal(out.shape).astype(dtype)
        grads = npattn.attention_backward(dout, res)
        with mock.patch.object(AttentionSpec, "scores_are_raw", property(lambda spec: False)):  # the general code
            ref, ref_res = npattn.attention_forward(q, k, v, impl="dense")
            ref_grads = npattn.attention_backward(dout, ref_res)
    for a, b in ((out, ref), (res.lse, ref_res.lse), (res.probs, ref_res.probs), *zip(grads[:3], ref_grads[:3])):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=60, deadline=None)
@given(
    case=attention_cases(features=("mask", "causal", "window", "lengths", "segments", "sinks", "masked_row")),
    repeats=st.sampled_from([1, 10**9]),
    base=st.sampled_from([2, "e"]),
)
def test_raw_scores_with_hidden_keys_take_the_numpy_lane_with_the_general_paths_numbers(case, repeats, base):
    """Options that only hide keys (mask, causal/window, lengths, segment
    ids) or merge after the kernel (sinks) keep the scores raw
    (``scores_are_raw``): the dense path runs the NumPy kernels of
    :mod:`npattn.dense_numpy` with the pipeline's visibility, and gives the
    general dense code's numbers (:func:`_assert_general`), forward and
    backward, fully masked rows included, whether the hidden keys are hidden
    through a float limit (``repeats`` 1) or the boolean mask
    (``dense_numpy.HIDING_REPEATS``)."""
    from npattn import dense_numpy
    from npattn.options import AttentionSpec

    for dtype in (np.float64, np.float32):
        q, k, v = (a.astype(dtype) for a in case.arrays)
        options = {**case.options, "impl": "dense"}
        with mock.patch.object(dense_numpy, "HIDING_REPEATS", repeats), _softmax_in(base):
            out, res = npattn.attention_forward(q, k, v, **options)
        assert res.spec.scores_are_raw
        rng = np.random.default_rng(0)
        dout = rng.standard_normal(out.shape).astype(dtype)
        dlse = rng.standard_normal(res.lse.shape).astype(dtype)
        grads = npattn.attention_backward(dout, res, dlse=dlse)
        with mock.patch.object(AttentionSpec, "scores_are_raw", property(lambda spec: False)):  # the general code
            ref, ref_res = npattn.attention_forward(q, k, v, **options)
            ref_grads = npattn.attention_backward(dout, ref_res, dlse=dlse)
        for a, b in ((out, ref), (res.lse, ref_res.lse), (res.probs, ref_res.probs)):
            _assert_general(base, a, b, dtype)
        for name in ("dq", "dk", "dv", "dsinks"):
            if getattr(ref_grads, name) is None:
                assert getattr(grads, name) is None
                continue
            _assert_general(base, getattr(grads, name), getattr(ref_grads, name), dtype, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_plain_lane_takes_base_2_where_the_scores_fit_and_the_general_softmax_where_not(dtype):
    """The zero reference needs every base-2 score within
    ``ZERO_REFERENCE_BOUND``: queries scaled past it, a NaN or an inf send
    the call to the general code's softmax, whose bits it then gives; scores
    within it take :func:`~npattn.dense_numpy.zero_reference_softmax`."""
    from npattn import dense_numpy
    from npattn.options import AttentionSpec

    bound = dense_numpy.ZERO_REFERENCE_BOUND[np.dtype(dtype)]
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 4, 6, 8)).astype(dtype) for _ in range(3))
    large = q * dtype(2 * bound)  # scores of about 2 bound * |q| |k| / sqrt(8): far past the bound
    nan = q.copy()
    nan[1, 2, 3, 4] = np.nan
    inf = k.copy()
    inf[0, 1, 5, 0] = np.inf  # a key hidden by causal from rows 0 to 4, seen by row 5
    taken: list[str] = []
    real = dense_numpy.zero_reference_softmax, dense_numpy.masked_softmax

    def noting(name, fn):
        return lambda *a, **kw: taken.append(name) or fn(*a, **kw)

    with (
        mock.patch.object(dense_numpy, "zero_reference_softmax", noting("base 2", real[0])),
        mock.patch.object(dense_numpy, "masked_softmax", noting("general", real[1])),
    ):
        for qq, kk, want in ((q, k, "base 2"), (large, k, "general"), (nan, k, "general"), (q, inf, "general")):
            taken.clear()
            with np.errstate(invalid="ignore"):
                out, res = npattn.attention_forward(qq, kk, v, causal=True, impl="dense")
            assert taken == [want]
            with (
                mock.patch.object(AttentionSpec, "scores_are_raw", property(lambda spec: False)),
                np.errstate(invalid="ignore"),
            ):
                ref, ref_res = npattn.attention_forward(qq, kk, v, causal=True, impl="dense")
            for a, b in ((out, ref), (res.lse, ref_res.lse), (res.probs, ref_res.probs)):
                _assert_general(2 if want == "base 2" else "e", a, b, dtype)
    assert np.isnan(out[0, 1, 5]).all() and not np.isnan(out[0, 1, :5]).any()  # the inf key: only the row that sees it


@pytest.mark.parametrize(
    "T, S, options, corner",
    [
        (128, 128, dict(causal=True), 64),
        (129, 129, dict(causal=True, q_lengths=np.array([129, 90])), 64),
        (256, 200, dict(causal=True, align="top_left"), 128),
        (130, 130, dict(window=(20, 0), kv_lengths=np.array([130, 7])), 65),
        (200, 300, dict(causal=True, align="bottom_right"), None),  # every row sees past the corner
        (128, 128, dict(window=(0, 5)), None),  # the lower left is hidden, not the upper right
        (127, 127, dict(causal=True), None),  # below CORNER_MIN_ROWS
        (128, 128, dict(), None),
    ],
)
def test_the_plain_lane_skips_the_hidden_corner_of_a_banded_square(T, S, options, corner):
    """Where the queries before ``T // 2`` see none of the keys from there on
    (the pipeline's tile classification), the base-2 lane neither multiplies
    them nor weighs their values: the same numbers as the whole products, P
    0 in the corner, forward and backward; not with GQA, whose stacked heads
    interleave the rows."""
    from npattn import dense_numpy
    from npattn.options import make_spec

    rng = np.random.default_rng(T + S)
    q = rng.standard_normal((2, 4, T, 16))
    k, v = (rng.standard_normal((2, 4, S, 16)) for _ in range(2))
    assert dense_numpy._hidden_corner(make_spec(q, k, v, **options), T, S) == corner
    assert dense_numpy._hidden_corner(make_spec(q, k[:, :2], v[:, :2], **options), T, S) == corner  # the rule...
    taken: list = []
    real = dense_numpy._products

    def noting(k, qs_t, products, corner=None):  # the corner each product skipped
        taken.append(corner)
        return real(k, qs_t, products, corner)

    with mock.patch.object(dense_numpy, "_products", noting):
        out, res = npattn.attention_forward(q, k, v, impl="dense", **options)
    assert taken and set(taken) == {corner}  # in each chunk
    dout = rng.standard_normal(out.shape)
    grads = npattn.attention_backward(dout, res)
    with mock.patch.object(dense_numpy, "CORNER_MIN_ROWS", 10**9):
        ref, ref_res = npattn.attention_forward(q, k, v, impl="dense", **options)
        ref_grads = npattn.attention_backward(dout, ref_res)
    for a, b in ((out, ref), (res.lse, ref_res.lse), (res.probs, ref_res.probs), *zip(grads[:3], ref_grads[:3])):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)
    if corner is not None:
        assert not res.probs[..., :corner, corner:].any()
    taken.clear()
    with mock.patch.object(dense_numpy, "_products", noting):
        npattn.attention_forward(q, k[:, :2], v[:, :2], impl="dense", **options)  # ... but GQA multiplies them
    assert taken and set(taken) == {None}


def test_scores_past_the_zero_reference_with_a_hidden_corner_take_the_whole_general_products():
    """A causal square whose scores do not fit the zero reference: the lane
    takes the products again, whole (the corner's zeros overwritten), at
    the general code's scale, and gives the general code's bits."""
    from npattn.options import AttentionSpec

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 2, 128, 16)) * s for s in (300.0, 1.0, 1.0))
    out, res = npattn.attention_forward(q, k, v, causal=True, impl="dense")
    with mock.patch.object(AttentionSpec, "scores_are_raw", property(lambda spec: False)):
        ref, ref_res = npattn.attention_forward(q, k, v, causal=True, impl="dense")
    for a, b in ((out, ref), (res.lse, ref_res.lse), (res.probs, ref_res.probs)):
        np.testing.assert_array_equal(a, b)


def test_zero_reference_softmax_hides_after_exp2_and_empties_rows():
    """``P = 2**s2 / l`` over the visible keys, ``lse = ln l``: the softmax of
    ``s2 ln 2``; a row without a visible key gets P = 0 and lse = -inf, whether
    the mask is boolean or a ``hidden=0`` limit, and ``s2`` becomes P."""
    from npattn.dense_numpy import hiding_limit, masked_softmax, zero_reference_softmax

    rng = np.random.default_rng(1)
    s2 = rng.standard_normal((3, 4, 5)) * 8
    visible = rng.random((1, 4, 5)) < 0.6
    visible[0, 2] = False  # an empty row
    p_ref, lse_ref = masked_softmax(s2 * np.log(2.0), np.broadcast_to(visible, s2.shape))
    for mask in (visible, hiding_limit(visible, s2.dtype, transposed=False, hidden=0)):
        x = s2.copy()
        p, lse = zero_reference_softmax(x, mask)
        assert p is x
        np.testing.assert_allclose(p, p_ref, rtol=1e-13, atol=1e-15)
        np.testing.assert_allclose(lse, lse_ref, rtol=1e-13)
        assert (p[:, 2] == 0).all() and (lse[:, 2] == -np.inf).all()


def _raw_lane(q, k, v, dout, dlse, options, *, split_from, threads):
    """Forward and backward of the dense raw-score lane with the chunks from
    ``split_from`` scores on ``threads`` threads."""
    from npattn import dense_numpy

    with (
        mock.patch.object(dense_numpy, "SPLIT_MIN_SCORES", split_from),
        mock.patch.dict("os.environ", {"NPATTN_NUM_THREADS": threads}),
    ):
        out, res = npattn.attention_forward(q, k, v, impl="dense", **options)
        grads = npattn.attention_backward(dout, res, dlse=dlse)
    return out, res, grads


@settings(max_examples=60, deadline=None)
@given(case=attention_cases(features=("mask", "causal", "window", "lengths", "segments", "gqa", "masked_row")))
def test_the_raw_score_lane_in_chunks_on_the_pool_is_the_same_on_any_thread_count(case):
    """From ``SPLIT_MIN_SCORES`` (here 0) the raw-score lane runs in chunks
    of batch elements, or of kv heads for one element, on the thread pool,
    each writing its rows of out, lse, P, dq, dk and dv: the same bits on
    1, 2 and 3 threads, and one piece's numbers (to the last bits, which
    BLAS may round differently for a product of vectors elsewhere in
    memory), forward and backward, GQA, masks and fully masked rows
    included."""
    for dtype, tol in ((np.float64, 1e-13), (np.float32, 1e-5)):
        q, k, v = (a.astype(dtype) for a in case.arrays)
        rng = np.random.default_rng(0)
        dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(dtype)
        dlse = rng.standard_normal(q.shape[:-1]).astype(dtype)
        runs = [_raw_lane(q, k, v, dout, dlse, case.options, split_from=0, threads=t) for t in ("1", "2", "3")]
        whole = _raw_lane(q, k, v, dout, dlse, case.options, split_from=2**62, threads="2")
        for got in runs[1:]:
            for a, b in ((got[0], runs[0][0]), (got[1].lse, runs[0][1].lse), (got[1].probs, runs[0][1].probs)):
                np.testing.assert_array_equal(a, b)
            for name in ("dq", "dk", "dv"):
                np.testing.assert_array_equal(getattr(got[2], name), getattr(runs[0][2], name), err_msg=name)
        got = runs[0]
        assert got[1].spec.scores_are_raw
        np.testing.assert_array_equal(np.isneginf(got[1].lse), np.isneginf(whole[1].lse))
        finite = np.isfinite(whole[1].lse)
        np.testing.assert_allclose(got[1].lse[finite], whole[1].lse[finite], rtol=tol, atol=tol)
        for a, b in ((got[0], whole[0]), (got[1].probs, whole[1].probs)):
            np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
        for name in ("dq", "dk", "dv"):
            np.testing.assert_allclose(getattr(got[2], name), getattr(whole[2], name), rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_raw_score_lane_cuts_its_chunks_products_with_the_same_bits(monkeypatch, blas_with_small_kernels, dtype):
    """The chunks' products through :func:`npattn.blas_numpy.matmul`, cut
    into pieces of rows (here from 2**15 multiply-adds, so that these small
    products are cut): the bits of the products whole, forward and backward."""
    from npattn import blas_numpy

    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 8, 40, 16)).astype(dtype)  # chunks of 4 kv heads: batches of 4 products
    k, v = (rng.standard_normal((4, 4, 40, 16)).astype(dtype) for _ in range(2))
    dout, dlse = rng.standard_normal(q.shape).astype(dtype), rng.standard_normal(q.shape[:-1]).astype(dtype)
    options = {"causal": True, "kv_lengths": np.array([40, 31, 9, 40])}
    whole = _raw_lane(q, k, v, dout, dlse, options, split_from=0, threads="2")
    monkeypatch.setattr(blas_numpy, "small_product_limit", lambda: 2**15)
    pieces, row_pieces = [], blas_numpy.row_pieces
    monkeypatch.setattr(blas_numpy, "row_pieces", lambda a, b: pieces.append(row_pieces(a, b)) or pieces[-1])
    cut = _raw_lane(q, k, v, dout, dlse, options, split_from=0, threads="2")
    assert max(pieces) == 2, "no product was cut"
    for a, b in ((cut[0], whole[0]), (cut[1].lse, whole[1].lse), (cut[1].probs, whole[1].probs)):
        np.testing.assert_array_equal(a, b)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(cut[2], name), getattr(whole[2], name), err_msg=name)


@pytest.mark.parametrize(
    "batch, K, G, options",
    [
        ((2,), 2, 1, {}),
        ((1, 2), 2, 3, {"causal": True}),
        ((), 2, 2, {"window": (3, 1)}),
        ((), 2, 1, {"mask": np.tri(9, 9, dtype=bool)}),
    ],
    ids=["batch", "batch axes, GQA, causal", "heads, GQA, window", "heads, mask"],
)
def test_chunks_split_batch_elements_else_kv_heads(monkeypatch, batch, K, G, options):
    """Chunks of batch elements where there are several, else of the one
    element's kv heads (their query heads with them), whatever the thread
    count: here two, of two or more; their results are one piece's."""
    from npattn import dense_numpy

    rng = np.random.default_rng(1)
    q = rng.standard_normal((*batch, K * G, 9, 5))
    k, v = (rng.standard_normal((*batch, K, 9, 5)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    chunks = []
    real_forward = dense_numpy.plain_forward

    def noting_chunks(spec, q_rows, k_rows, *args, **kwargs):
        if kwargs.get("out") is not None:  # a chunk's call
            chunks.append((q_rows.shape, k_rows.shape))
        return real_forward(spec, q_rows, k_rows, *args, **kwargs)

    monkeypatch.setattr(dense_numpy, "plain_forward", noting_chunks)
    got = _raw_lane(q, k, v, dout, None, options, split_from=0, threads="2")
    flat = math.prod(batch)
    if flat >= 2:
        assert sorted(c[1][0] for c in chunks) == [flat // 2, flat - flat // 2]  # batch elements
    else:
        assert sorted(c[1][:2] for c in chunks) == [(1, K // 2), (1, K - K // 2)]  # (element, kv heads)
        assert sorted(c[0][:2] for c in chunks) == [(1, G * (K // 2)), (1, G * (K - K // 2))]
    chunks.clear()
    want = _raw_lane(q, k, v, dout, None, options, split_from=2**62, threads="2")
    assert not chunks
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got[1].probs, want[1].probs, rtol=1e-13, atol=1e-13)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(got[2], name), getattr(want[2], name), rtol=1e-13, atol=1e-13, err_msg=name)


def test_a_mask_modification_and_a_block_mask_keep_the_raw_score_lane_bit_for_bit():
    """A user's ``mask_mod`` (and the block mask built from it) only hides
    keys: the raw-score lane gives the general code's bits with them too
    (with the general code's softmax)."""
    from npattn.options import AttentionSpec

    def striped(idx):
        return ((idx.q + 2 * idx.k + 3 * idx.head + 5 * idx.batch) % 4) != 0

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 5, 3)) for _ in range(3))
    blocks = npattn.block_mask(striped, 5, 5, block_q=2, block_k=2, batch_shape=(2,), num_heads=2, align="top_left")
    for options in (dict(mask_mod=striped, align="top_left"), dict(block_mask=blocks, align="top_left")):
        with _softmax_in("e"):
            out, res = npattn.attention_forward(q, k, v, impl="dense", **options)
        assert res.spec.scores_are_raw
        grads = npattn.attention_backward(out, res)
        with mock.patch.object(AttentionSpec, "scores_are_raw", property(lambda spec: False)):
            ref, ref_res = npattn.attention_forward(q, k, v, impl="dense", **options)
            ref_grads = npattn.attention_backward(out, ref_res)
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(res.probs, ref_res.probs)
        for name in ("dq", "dk", "dv"):
            np.testing.assert_array_equal(getattr(grads, name), getattr(ref_grads, name), err_msg=name)


def test_options_that_change_the_scores_leave_the_raw_score_lane():
    """A bias, softcap, ALiBi, score modifications or dropout change the
    scores or the probabilities: ``scores_are_raw`` is False for each, so
    the dense path runs its general code."""
    from npattn.options import make_spec

    x = np.zeros((1, 2, 3, 4))
    assert make_spec(x, x, x, causal=True, mask=np.ones((3, 3), bool), sinks=np.zeros(2)).scores_are_raw
    changes = [
        dict(bias=np.zeros((3, 3))),
        dict(softcap=5.0),
        dict(alibi_slopes=np.ones(2)),
        dict(dropout_p=0.1, seed=0),
        dict(score_mods=npattn.ScoreMod(lambda s, idx: s * 1.0, lambda s, idx, ds: ds)),
    ]
    for options in changes:
        assert not make_spec(x, x, x, **options).scores_are_raw, options


def test_a_repeated_plain_call_looks_up_its_spec_with_the_path_chosen_by_size(monkeypatch):
    """``plain_call_spec``: one spec object per dtypes and shapes, equal to
    ``choose_impl(make_spec(...))`` where the sizes alone send the call to
    the dense path; from AUTO_FAST_MIN_SCORES the path stays unchosen, so
    ``NPATTN_FAST_NUMPY`` read at each call still decides; None where
    ``make_spec``'s checks must run; and the table stays bounded."""
    from npattn.attention import _PLAIN_CALLS, PLAIN_CALL_CACHE_SIZE, choose_impl, plain_call_spec
    from npattn.options import AUTO_FAST_MIN_SCORES, make_spec, plain_key

    x = np.zeros((2, 4, 8, 3), dtype=np.float32)
    small = plain_call_spec(x, x, x)
    assert small is plain_call_spec(x.copy(), x.copy(), x.copy())
    assert small.__dict__ == choose_impl(make_spec(x, x, x)).__dict__ and small.impl == "dense"
    side = math.isqrt(AUTO_FAST_MIN_SCORES // 2)  # N = 2, T = S = side: exactly the threshold
    assert 2 * side * side == AUTO_FAST_MIN_SCORES
    big = np.zeros((1, 2, side, 1), dtype=np.float32)
    assert plain_call_spec(big, big, big).impl == "auto"
    assert choose_impl(plain_call_spec(big, big, big)).impl == "chunked"
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    assert choose_impl(plain_call_spec(big, big, big)).impl == "dense"
    causal = plain_call_spec(x, x, x, True)
    assert causal is plain_call_spec(x, x, x, True) and causal is not small
    assert causal.__dict__ == choose_impl(make_spec(x, x, x, causal=True)).__dict__
    wide = np.zeros((2, 4, 9, 3), dtype=np.float32)  # S = 9 != T = 8: causal needs align, as make_spec says
    for _ in range(2):
        with pytest.raises(ValueError, match="align"):
            npattn.attention_forward(x, wide, wide, causal=True)
    assert (plain_key(x, x, x), True) in _PLAIN_CALLS and (plain_key(x, wide, wide), True) not in _PLAIN_CALLS
    assert plain_call_spec(x, x, x.astype(np.float64)) is None
    assert plain_call_spec(x.tolist(), x, x) is None
    for T in range(1, PLAIN_CALL_CACHE_SIZE + 2):
        y = np.zeros((1, 1, T, 2))
        assert plain_call_spec(y, y, y).q_len == T
    assert 0 < len(_PLAIN_CALLS) <= PLAIN_CALL_CACHE_SIZE


def test_a_repeated_call_with_scalar_options_looks_up_make_specs_answer():
    """``scalar_call_spec``: make_spec's spec, one object per arrays' types,
    dtypes, shapes and devices and options with their types (so ``causal=1``,
    which equals True, still gets make_spec's TypeError); a call make_spec
    rejects raises every time and is not kept; options that are not plain
    scalars, and inputs that are not arrays, go to make_spec; the table
    stays bounded."""
    from npattn.attention import _SCALAR_CALLS, SCALAR_CALL_CACHE_SIZE, scalar_call_spec
    from npattn.options import make_spec

    _SCALAR_CALLS.clear()  # the counts below, whatever earlier tests kept
    q, kv = np.zeros((1, 4, 1, 8)), np.zeros((1, 4, 100, 8))
    options = dict(causal=True, align="bottom_right", window=(16, 0), impl="chunked")
    spec = scalar_call_spec(q, kv, kv, **options)
    assert spec.__dict__ == make_spec(q, kv, kv, **options).__dict__
    assert scalar_call_spec(q.copy(), kv.copy(), kv.copy(), **options) is spec
    size = len(_SCALAR_CALLS)
    public = npattn.attention_forward(q, kv, kv, **options)[1].spec  # the public call looks its spec up
    assert npattn.attention_forward(q, kv, kv, **options)[1].spec is public and len(_SCALAR_CALLS) == size + 1
    narrow = scalar_call_spec(*(x.astype(np.float32) for x in (q, kv, kv)), **options)
    assert narrow is not spec and narrow.dtype == np.float32
    assert scalar_call_spec(q, kv, kv, **dict(options, window=(15, 0))).window_left == 15
    for _ in range(2):
        with pytest.raises(TypeError, match="causal must be a bool"):
            npattn.attention_forward(q, kv, kv, causal=1, align="bottom_right")
        with pytest.raises(ValueError, match="align"):
            npattn.attention_forward(q, kv, kv, causal=True)
    size = len(_SCALAR_CALLS)
    numpy_scale = scalar_call_spec(q, kv, kv, scale=np.float64(0.5))  # a NumPy scalar: make_spec, not kept
    assert numpy_scale.scale == 0.5 and len(_SCALAR_CALLS) == size
    with pytest.raises(TypeError):
        scalar_call_spec(q.tolist(), kv, kv, causal=False)
    import array_api_strict as strict

    for device in strict.__array_namespace_info__().devices()[1:3]:  # two devices: two specs, each its own
        on_device = [strict.asarray(x, device=device) for x in (q, kv)]
        assert scalar_call_spec(*on_device, on_device[1], **options).device == device
    for T in range(1, SCALAR_CALL_CACHE_SIZE + 2):
        y = np.zeros((1, 1, T, 2))
        assert scalar_call_spec(y, y, y, causal=True).q_len == T
    assert 0 < len(_SCALAR_CALLS) <= SCALAR_CALL_CACHE_SIZE


_SCALAR_OPTIONS = st.fixed_dictionaries(
    {},
    optional={
        "causal": st.booleans(),
        "window": st.none() | st.tuples(st.integers(0, 40), st.integers(0, 40)),
        "align": st.sampled_from([None, "top_left", "bottom_right"]),
        "scale": st.none() | st.floats(0.1, 2.0),
        "softcap": st.none() | st.floats(1.0, 50.0),
        "impl": st.sampled_from(["auto", "dense", "chunked"]),
        "block_k": st.none() | st.integers(1, 64),
    },
)


@settings(max_examples=60, deadline=None)
@given(
    options=_SCALAR_OPTIONS,
    T=st.integers(1, 40),
    lengths=st.lists(st.integers(0, 60), min_size=2, max_size=4),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_a_call_whose_keys_grew_gets_make_specs_answer_for_its_length(options, T, lengths, dtype):
    """A call that differs from a kept one in ``S`` alone (a decode loop's
    next step) gets make_spec's spec for its ``S`` field for field, or
    make_spec's error (``S = 0``; causal with T != S and no ``align``)."""
    from npattn.attention import scalar_call_spec
    from npattn.options import make_spec

    q = np.zeros((2, 4, T, 8), dtype)
    for S in lengths:
        kv = np.zeros((2, 2, S, 8), dtype)
        try:
            want = make_spec(q, kv, kv, **options)
        except (TypeError, ValueError) as err:
            with pytest.raises(type(err), match=re.escape(str(err))):
                scalar_call_spec(q, kv, kv, **options)
            continue
        assert scalar_call_spec(q, kv, kv, **options).__dict__ == want.__dict__


def test_a_decode_loop_makes_its_spec_once():
    """A decode loop over a growing cache calls make_spec for its first step
    only: each later step's spec comes from the one before (``with_kv_len``)."""
    import importlib

    from npattn.options import make_spec, with_kv_len

    module = importlib.import_module("npattn.attention")  # npattn.attention is the function
    q, cache = np.zeros((1, 4, 1, 8)), np.zeros((1, 2, 50, 8))
    options = dict(causal=True, align="bottom_right", window=(7, 0))
    module._SCALAR_CALLS.clear()  # no spec kept by an earlier test
    module._KV_LEN_FAMILIES.clear()
    made = []
    with mock.patch.object(module, "make_spec", lambda *a, **kw: made.append(1) or make_spec(*a, **kw)):
        steps = [npattn.attention_forward(q, cache[..., :S, :], cache[..., :S, :], **options) for S in range(1, 50)]
    specs = [residuals.spec for _, residuals in steps]
    assert len(made) == 1 and [spec.q_offset for spec in specs] == list(range(49))
    lengths = make_spec(q, cache, cache, kv_lengths=np.array([30]), **options)  # its checks read S
    with pytest.raises(ValueError, match="options are all scalars"):
        with_kv_len(lengths, 40, **options)


def test_inputs_the_plain_lane_does_not_take_still_get_make_specs_checks():
    """``plain_spec`` returns None for anything but NumPy float32/float64
    arrays of one dtype whose shapes fit, and ``attention_forward`` then
    raises make_spec's own errors."""
    from npattn.options import plain_spec

    x = np.zeros((1, 2, 3, 4))
    assert plain_spec(x, x, x.astype(np.float32)) is None
    assert plain_spec(*(a.astype(np.float16) for a in (x, x, x))) is None  # computes in float32: make_spec's
    assert plain_spec(x, x[..., :3], x) is None
    assert plain_spec(x, x[:, :0], x[:, :0]) is None
    assert plain_spec(x[0], x, x) is None
    assert plain_spec(x.tolist(), x, x) is None
    with pytest.raises(TypeError, match="share one dtype"):
        npattn.attention_forward(x, x, x.astype(np.float32))
    with pytest.raises(ValueError, match="head dim"):
        npattn.attention_forward(x, x[..., :3], x)
    with pytest.raises(TypeError, match="real floating"):
        npattn.attention_forward(*(a.astype(np.int64) for a in (x, x, x)))
    with pytest.raises(ValueError, match="rank >= 3"):
        npattn.attention_forward(x[0, 0], x[0, 0], x[0, 0])
