"""npattn.softmax: the NumPy in-place kernels (npattn.dense_numpy) against the generic ones.

The NumPy version is a fast path of the dense path's softmax: the same
arithmetic in the same order, so its results must be the generic version's
(run on array-api-strict) bit for bit, including fully masked rows and -inf
scores, and it must leave the scores untouched unless told it may take them
over (``overwrite=True``, for the dense path's own fresh products).
"""

from __future__ import annotations

from unittest import mock

import array_api_compat.numpy as xnp
import array_api_strict as xs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npattn import dense_numpy
from npattn.dense_numpy import HIDING_REPEATS, LIST_SEARCH_ROWS, hiding_limit
from npattn.softmax import masked_softmax, softmax_backward


@st.composite
def scores_and_masks(draw):
    shape = draw(st.tuples(st.integers(1, 5), st.integers(1, 5), st.integers(1, 7)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    s = (rng.standard_normal(shape) * draw(st.sampled_from([1.0, 30.0]))).astype(dtype)
    s[rng.random(shape) < draw(st.sampled_from([0.0, 0.2]))] = -np.inf  # hidden by the scores themselves
    s[rng.random(shape) < draw(st.sampled_from([0.0, 0.1]))] = -0.0  # kept as -0.0 where visible
    if draw(st.booleans()):
        s = np.swapaxes(np.ascontiguousarray(np.swapaxes(s, -1, -2)), -1, -2)  # the dense path's layout, (K Q^T)^T
    mask_shape = draw(st.sampled_from([shape, (1,) + shape[1:], shape[1:]]))  # whole, or broadcast over the batch
    visible = None if draw(st.booleans()) else rng.random(mask_shape) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return s, visible


@settings(max_examples=60, deadline=None)
@given(scores_and_masks(), st.booleans(), st.sampled_from([1, HIDING_REPEATS, 10**9]))
def test_numpy_softmax_matches_the_generic_one_bit_for_bit(case, overwrite, repeats):
    # ``repeats``: the hiding limit always (1), where the mask repeats (the default), never
    s, visible = case
    before = s.copy()
    p_ref, lse_ref = masked_softmax(xs, xs.asarray(s), None if visible is None else xs.asarray(visible))
    with mock.patch.object(dense_numpy, "HIDING_REPEATS", repeats):
        p, lse = masked_softmax(xnp, s, visible, overwrite=overwrite)
    np.testing.assert_array_equal(p, np.asarray(p_ref))
    np.testing.assert_array_equal(lse, np.asarray(lse_ref))
    if overwrite:
        assert p is s  # P took the scores' buffer over
    else:
        np.testing.assert_array_equal(s, before)  # inputs are never mutated
    assert p.dtype == s.dtype and lse.dtype == s.dtype
    assert not np.isnan(p).any() and not np.isnan(lse).any()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_softmax_fully_masked_rows_are_zero_with_lse_minus_infinity(dtype):
    s = np.array([[1.0, 2.0, 3.0], [-np.inf, -np.inf, -np.inf], [0.0, 0.0, 0.0]], dtype=dtype)
    visible = np.array([[True, True, False], [True, True, True], [False, False, False]])
    p, lse = masked_softmax(xnp, s, visible)
    np.testing.assert_array_equal(p[1:], 0.0)
    assert lse[1] == -np.inf and lse[2] == -np.inf
    np.testing.assert_allclose(p[0], [1 / (1 + np.e), np.e / (1 + np.e), 0.0], rtol=1e-6)
    np.testing.assert_allclose(lse[0], np.logaddexp(1.0, 2.0), rtol=1e-6)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hiding_limit_hides_what_the_mask_hides_in_the_scores_layout(transposed, dtype):
    # +inf where visible, -inf where hidden, laid out as the scores are: fmin against it keeps
    # every visible value's bits (-0.0 and +-inf included) and hides every hidden one (NaN included)
    visible = np.array([[True, False, True], [False, True, True]])
    limit = hiding_limit(visible, dtype, transposed=transposed)
    assert limit.dtype == dtype and limit.shape == visible.shape
    np.testing.assert_array_equal(limit, np.where(visible, np.inf, -np.inf))
    assert (limit.strides[-1] > limit.strides[-2]) == transposed  # the scores' memory order
    s = np.array([[-0.0, np.nan, np.inf], [np.inf, -np.inf, 2.5]], dtype=dtype)
    hidden = np.fmin(s, limit)
    np.testing.assert_array_equal(hidden, [[-0.0, -np.inf, np.inf], [-np.inf, -np.inf, 2.5]])
    assert np.signbit(hidden[0, 0])


@pytest.mark.parametrize("repeats", [1, 10**9])
def test_numpy_softmax_a_visible_nan_makes_its_row_nan_through_either_hiding(repeats):
    # The limit turns a visible NaN into +inf; its row's P and lse still come out NaN, as the
    # generic softmax gives them, and a hidden NaN still hides
    s = np.random.default_rng(0).standard_normal((3, 2, 4))
    s[0, 0, 1] = np.nan  # visible
    s[0, 1, 3] = np.nan  # hidden
    visible = np.array([[True, True, True, True], [True, True, True, False]])
    p_ref, lse_ref = masked_softmax(xs, xs.asarray(s), xs.asarray(visible))
    with mock.patch.object(dense_numpy, "HIDING_REPEATS", repeats), np.errstate(invalid="ignore"):  # inf - inf
        p, lse = masked_softmax(xnp, s.copy(), visible, overwrite=True)
    np.testing.assert_array_equal(p, np.asarray(p_ref))
    np.testing.assert_array_equal(lse, np.asarray(lse_ref))
    assert np.isnan(p[0, 0]).all() and np.isnan(lse[0, 0])
    assert not np.isnan(p[0, 1]).any() and p[0, 1, 3] == 0


@pytest.mark.parametrize("rows", [LIST_SEARCH_ROWS, LIST_SEARCH_ROWS + 1])
@pytest.mark.parametrize("nan_row", [False, True])
def test_numpy_softmax_finds_a_fully_masked_row_by_either_search(rows, nan_row):
    # Up to LIST_SEARCH_ROWS row maxima are searched as a list, above by a reduction;
    # either finds the empty last row, also beside a NaN row (which stays NaN).
    s = np.random.default_rng(rows).standard_normal((2, rows, 5))
    if nan_row:
        s[0, 0, 2] = np.nan
    visible = np.ones(s.shape, dtype=bool)
    visible[1, -1] = False
    p, lse = masked_softmax(xnp, s, visible)
    p_ref, lse_ref = masked_softmax(xs, xs.asarray(s), xs.asarray(visible))
    np.testing.assert_array_equal(p, np.asarray(p_ref))
    np.testing.assert_array_equal(lse, np.asarray(lse_ref))
    assert lse[1, -1] == -np.inf and not p[1, -1].any()
    assert np.isnan(lse[0, 0]) == nan_row and not np.isnan(lse[1:]).any()


@settings(max_examples=30, deadline=None)
@given(scores_and_masks(), st.integers(0, 2**32 - 1), st.booleans())
def test_numpy_softmax_backward_matches_the_generic_one_bit_for_bit(case, seed, overwrite):
    s, visible = case
    p, _ = masked_softmax(xnp, s, visible)
    rng = np.random.default_rng(seed)
    dp = rng.standard_normal(s.shape).astype(s.dtype)
    D = rng.standard_normal(s.shape[:-1] + (1,)).astype(s.dtype)
    before = (p.copy(), dp.copy(), D.copy())
    ds_ref = softmax_backward(xs, xs.asarray(p), xs.asarray(dp), xs.asarray(D))
    ds = softmax_backward(xnp, p, dp, D, overwrite=overwrite)
    np.testing.assert_array_equal(ds, np.asarray(ds_ref))
    if overwrite:
        assert ds is dp  # dS took dP's buffer over
    kept = [(p, before[0]), (D, before[2])] + ([] if overwrite else [(dp, before[1])])
    for a, b in kept:
        np.testing.assert_array_equal(a, b)  # inputs are never mutated (but dP, taken over, with overwrite)
