"""The multi-head layer's projections on NumPy (:mod:`npattn.linear_numpy`):
row blocks on the thread pool, the same product as one BLAS call, the same
bits on any thread count."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

import npattn
from npattn import linear_numpy, threads


def _blocks_seen(monkeypatch):
    """Record the row blocks each pooled product hands to the pool."""
    seen: list[list[slice]] = []
    real = linear_numpy.run_items

    def recording(items, work, **kwargs):
        seen.append(list(items))
        return real(items, work, **kwargs)

    monkeypatch.setattr(linear_numpy, "run_items", recording)
    return seen


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed view"])
def test_pooled_products_equal_one_product(monkeypatch, dtype, transposed):
    monkeypatch.setattr(linear_numpy, "POOL_MIN_MACS", 1000)
    monkeypatch.setattr(linear_numpy, "PART_MACS", 4000)
    seen = _blocks_seen(monkeypatch)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 11)).astype(dtype)  # (M, K)
    b = rng.standard_normal((13, 11)).astype(dtype).T if transposed else rng.standard_normal((11, 13)).astype(dtype)
    a_before, b_before = a.copy(), b.copy()
    got = linear_numpy.matmul(a, b)  # 37*11*13 = 5291 multiply-adds: 2 blocks
    assert got.dtype == dtype and got.shape == (37, 13)
    np.testing.assert_allclose(got, a @ b, rtol=1e-5 if dtype == np.float32 else 1e-13)
    np.testing.assert_array_equal(a, a_before)
    np.testing.assert_array_equal(b, b_before)
    assert seen == [[slice(0, 18), slice(18, 37)]]


def test_the_block_count_follows_the_size_within_its_bounds(monkeypatch):
    monkeypatch.setattr(linear_numpy, "POOL_MIN_MACS", 64)
    monkeypatch.setattr(linear_numpy, "PART_MACS", 64)
    monkeypatch.setattr(linear_numpy, "POOL_MAX_PARTS", 4)
    seen = _blocks_seen(monkeypatch)
    x = np.ones((3, 4))
    np.testing.assert_array_equal(linear_numpy.matmul(x, np.ones((4, 4))), np.full((3, 4), 4.0))  # 48 < 64: one call
    np.testing.assert_array_equal(linear_numpy.matmul(x, np.ones((4, 8))), np.full((3, 8), 4.0))  # 96: 2 blocks
    np.testing.assert_array_equal(linear_numpy.matmul(np.ones((9, 4)), np.ones((4, 64))), np.full((9, 64), 4.0))
    np.testing.assert_array_equal(linear_numpy.matmul(np.ones((2, 64)), np.ones((64, 64))), np.full((2, 64), 64.0))
    np.testing.assert_array_equal(linear_numpy.matmul(np.ones((3, 4)), np.ones((4, 16))), np.full((3, 16), 4.0))
    assert [len(blocks) for blocks in seen] == [2, 4, 2, 2]  # 96 // 64 = 1 -> 2; 36 -> 4; M = 2; 192 // 64 = 3 -> 2


def test_the_block_count_is_a_power_of_two(monkeypatch):
    """3 blocks on 2 threads would leave one thread a block alone at the end
    (1.34x the time of 2 blocks, see :data:`~npattn.linear_numpy.PART_MACS`)."""
    monkeypatch.setattr(linear_numpy, "POOL_MIN_MACS", 64)
    monkeypatch.setattr(linear_numpy, "PART_MACS", 64)
    seen = _blocks_seen(monkeypatch)
    for rows in (3, 5, 6, 7, 12, 15, 17):  # rows * 4 * 16 // 64 = rows blocks wanted
        a, b = np.ones((rows, 4)), np.ones((4, 16))
        np.testing.assert_array_equal(linear_numpy.matmul(a, b), np.full((rows, 16), 4.0))
    assert [len(blocks) for blocks in seen] == [2, 4, 4, 4, 8, 8, 16]


@pytest.mark.parametrize("workers", ["1", "2", "3"])
def test_pooled_products_are_the_same_bits_on_any_thread_count(monkeypatch, workers):
    monkeypatch.setattr(linear_numpy, "POOL_MIN_MACS", 1000)
    monkeypatch.setattr(linear_numpy, "PART_MACS", 1000)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((48, 40)).astype(np.float32)
    with mock.patch.dict("os.environ", {"NPATTN_NUM_THREADS": "1"}):
        one = linear_numpy.matmul(a, b)
    with mock.patch.dict("os.environ", {"NPATTN_NUM_THREADS": workers}):
        assert threads.num_threads() == int(workers)
        np.testing.assert_array_equal(linear_numpy.matmul(a, b), one)


def test_the_layer_projects_on_the_pool_and_keeps_its_gradients(monkeypatch):
    """Every projection of the layer, forward and backward, goes through
    :func:`npattn.linear_numpy.matmul` on NumPy; with the pool forced for
    these small products the layer gives one product's numbers and the same
    gradients as with one BLAS call each."""
    params = npattn.mha_init(16, 4, seed=0)
    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 5, 16))
    y_one, res_one = npattn.mha_forward(params, x, num_heads=4, causal=True)
    grads_one = npattn.mha_backward(dy, res_one)
    monkeypatch.setattr(linear_numpy, "POOL_MIN_MACS", 1)
    monkeypatch.setattr(linear_numpy, "PART_MACS", 1)
    seen = _blocks_seen(monkeypatch)
    y, res = npattn.mha_forward(params, x, num_heads=4, causal=True)
    assert len(seen) == 4  # q, k, v and out projections
    grads = npattn.mha_backward(dy, res)
    assert len(seen) == 4 + 2 * 4  # dA and dW of each
    np.testing.assert_allclose(y, y_one, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(grads.dx, grads_one.dx, rtol=1e-13, atol=1e-14)
    for name, want in grads_one.dparams.items():
        np.testing.assert_allclose(grads.dparams[name], want, rtol=1e-13, atol=1e-14, err_msg=name)


def test_other_namespaces_and_dtypes_keep_the_operator():
    import array_api_strict as xps

    assert linear_numpy.handles(np, np.float32) and linear_numpy.handles(np, np.float64)
    assert not linear_numpy.handles(np, np.float16)
    assert not linear_numpy.handles(xps, xps.float32)
