"""npattn.softmax: the NumPy in-place kernels (npattn.dense_numpy) against the generic ones.

The NumPy version is a fast path of the dense path's softmax: the same
arithmetic in the same order, so its results must be the generic version's
(run on array-api-strict) bit for bit, including fully masked rows and -inf
scores, and it must leave the scores untouched unless told it may take them
over (``overwrite=True``, for the dense path's own fresh products).
"""

from __future__ import annotations

import array_api_compat.numpy as xnp
import array_api_strict as xs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npattn.dense_numpy import LIST_SEARCH_ROWS
from npattn.softmax import masked_softmax, softmax_backward


@st.composite
def scores_and_masks(draw):
    shape = draw(st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 7)))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    s = (rng.standard_normal(shape) * draw(st.sampled_from([1.0, 30.0]))).astype(dtype)
    s[rng.random(shape) < draw(st.sampled_from([0.0, 0.2]))] = -np.inf  # hidden by the scores themselves
    visible = None if draw(st.booleans()) else rng.random(shape) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return s, visible


@settings(max_examples=60, deadline=None)
@given(scores_and_masks(), st.booleans())
def test_numpy_softmax_matches_the_generic_one_bit_for_bit(case, overwrite):
    s, visible = case
    before = s.copy()
    p_ref, lse_ref = masked_softmax(xs, xs.asarray(s), None if visible is None else xs.asarray(visible))
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
