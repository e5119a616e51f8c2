"""The dropout hash against its pure-Python definition, its statistics and
reproducibility, and tile classification against the per-element masks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference import dropout_keep_reference
from strategies import attention_cases

import npattn
from npattn.dropout import keep_tile
from npattn.options import make_spec
from npattn.scores.visibility import ALL, NONE, classify_tile, visible_tile


def _spec(q, k, v, **options):
    return make_spec(q, k, v, **options)


def test_keep_mask_matches_pure_python_definition():
    q = np.zeros((2, 3, 3, 4, 2))  # batch (2, 3), N=3, T=4
    k = v = np.zeros((2, 3, 1, 5, 2))
    spec = _spec(q, k, v, dropout_p=0.4, seed=2**35 + 17)
    keep = keep_tile(spec, 0, 4, 0, 5)
    assert keep.shape == (2, 3, 3, 4, 5) and keep.dtype == bool
    for index in np.ndindex(keep.shape):
        flat = index[0] * 3 + index[1]
        assert keep[index] == dropout_keep_reference(spec.seed, 0.4, flat, *index[2:])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    q = np.zeros((1, 4, 64, 2))
    k = v = np.zeros((1, 4, 256, 2))
    keep = keep_tile(_spec(q, k, v, dropout_p=p, seed=123, causal=False), 0, 64, 0, 256)
    n = keep.size
    # 6 standard deviations of a Binomial(n, 1-p) proportion.
    assert abs(keep.mean() - (1 - p)) < 6 * np.sqrt(p * (1 - p) / n)


def test_tiles_of_the_keep_mask_equal_the_whole_mask():
    q = np.zeros((2, 2, 7, 2))
    k = v = np.zeros((2, 2, 9, 2))
    spec = _spec(q, k, v, dropout_p=0.3, seed=5)
    whole = keep_tile(spec, 0, 7, 0, 9)
    np.testing.assert_array_equal(keep_tile(spec, 2, 5, 3, 8), whole[..., 2:5, 3:8])
    np.testing.assert_array_equal(keep_tile(spec, 0, 7, 0, 9, heads=(1, 2)), whole[..., 1:2, :, :])


def test_different_seeds_draw_different_masks_and_zero_p_draws_none():
    q = k = v = np.ones((2, 16, 4))
    spec_a = _spec(q, k, v, dropout_p=0.5, seed=1)
    spec_b = _spec(q, k, v, dropout_p=0.5, seed=2)
    assert np.mean(keep_tile(spec_a, 0, 16, 0, 16) != keep_tile(spec_b, 0, 16, 0, 16)) > 0.3
    np.testing.assert_array_equal(npattn.attention(q, k, v, dropout_p=0.0, seed=1), npattn.attention(q, k, v))


def test_dropout_output_is_identical_across_backends(backend):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 2, 5, 3)).astype(np.float32) for _ in range(3))
    ref = npattn.attention(q, k, v, dropout_p=0.5, seed=99)
    got = npattn.attention(*(backend.asarray(a) for a in (q, k, v)), dropout_p=0.5, seed=99)
    # Same keep mask bit for bit: the zero pattern of the probabilities survives into out's support.
    np.testing.assert_allclose(backend.to_numpy(got), ref, atol=1e-5)


@given(
    case=attention_cases(features=("mask", "causal", "window", "lengths")),
    q_split=st.integers(0, 8),
    k_split=st.integers(0, 8),
    width=st.integers(1, 8),
)
def test_classify_tile_agrees_with_visible_tile(case, q_split, k_split, width):
    spec = make_spec(*case.arrays, **case.options)
    T, S = spec.q_len, spec.kv_len
    q0, k0 = min(q_split, T), min(k_split, S)
    q1, k1 = min(q0 + width, T), min(k0 + width, S)
    status = classify_tile(spec, q0, q1, k0, k1)
    visible = visible_tile(spec, q0, q1, k0, k1)
    shape = (*spec.batch_shape, spec.num_heads, q1 - q0, k1 - k0)
    visible = np.broadcast_to(True if visible is None else visible, shape)
    if status == NONE:
        assert not visible.any()
    elif status == ALL:
        assert visible.all()
