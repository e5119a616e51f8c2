"""Determinism (issue 7): same inputs, same bits, whatever the thread count.

The NumPy fast path runs independent work items on a thread pool of
``NPATTN_NUM_THREADS`` threads; every item accumulates in a fixed order, so
forward and backward must be bit-identical for 1, 2, 3, 4 and 8 threads, with
masks, bias, dropout, lengths and GQA, and repeated runs (any path, the dense
one included) must be bit-identical too.
"""

from __future__ import annotations

import os
import threading
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import attention_cases

import npattn

THREADS = ("1", "2", "3", "4", "8")


def _run(q, k, v, dout, dlse, *, threads=None, generic=False, **options):
    """Forward + backward through the public API; returns every array produced."""
    env = {}
    if threads is not None:
        env["NPATTN_NUM_THREADS"] = threads
    if generic:
        env["NPATTN_FAST_NUMPY"] = "0"
    with mock.patch.dict(os.environ, env):
        out, res = npattn.attention_forward(q, k, v, **options)
        g = npattn.attention_backward(dout, res, dlse=dlse)
    return [out, res.lse, *(a for a in g if a is not None)]


def _assert_bit_identical(first, other, label):
    assert len(first) == len(other)
    for n, (a, b) in enumerate(zip(first, other)):
        assert a.dtype == b.dtype and a.shape == b.shape, label
        # view as integers: bit equality, NaN and -0.0 included
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)), (
            f"{label}: array {n} differs"
        )


def _problem(dtype, rng, B=3, N=4, K=2, T=70, S=90, H=8, Hv=6):
    q = rng.standard_normal((B, N, T, H)).astype(dtype)
    k = rng.standard_normal((B, K, S, H)).astype(dtype)
    v = rng.standard_normal((B, K, S, Hv)).astype(dtype)
    dout = rng.standard_normal((B, N, T, Hv)).astype(dtype)
    dlse = rng.standard_normal((B, N, T)).astype(np.float64 if dtype == np.float64 else np.float32)
    return q, k, v, dout, dlse


FEATURES = {
    "plain": lambda rng, B, N, T, S: {},
    "causal + dropout": lambda rng, B, N, T, S: dict(causal=True, align="bottom_right", dropout_p=0.2, seed=11),
    "mask + lengths": lambda rng, B, N, T, S: dict(
        mask=rng.random((B, 1, T, S)) < 0.8, q_lengths=np.array([T, 3, 0])[:B], kv_lengths=np.array([S, S // 2, 1])[:B]
    ),
    "bias (sequential backward) + window": lambda rng, B, N, T, S: dict(
        bias=rng.standard_normal((N, T, S)), window=(10, 5), align="top_left", dropout_p=0.1, seed=2
    ),
    "broadcast bias + everything": lambda rng, B, N, T, S: dict(
        bias=rng.standard_normal((B, 1, 1, S)).astype(np.float32),
        mask=rng.random((T, S)) < 0.9,
        causal=True,
        align="bottom_right",
        kv_lengths=np.array([S, 2 * S // 3, S // 3])[:B],
        dropout_p=0.3,
        seed=5,
    ),
}


@pytest.mark.parametrize("blocks", [(16, 32), (None, None)], ids=["tiles 16x32", "default tiles"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_fast_path_bits_do_not_depend_on_the_thread_count(feature, dtype, blocks):
    rng = np.random.default_rng(1)
    q, k, v, dout, dlse = _problem(dtype, rng)
    options = FEATURES[feature](rng, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    options.update(impl="chunked", block_q=blocks[0], block_k=blocks[1])
    results = {t: _run(q, k, v, dout, dlse, threads=t, **options) for t in THREADS}
    for t in THREADS[1:]:
        _assert_bit_identical(results["1"], results[t], f"{t} threads vs 1")
    assert all(np.isfinite(a).all() for a in results["1"][2:])
    pool = [t for t in threading.enumerate() if t.name.startswith("npattn")]
    assert len(pool) >= 2, "the fast path's thread pool was never used: the comparison proves nothing"


@pytest.mark.parametrize("path", ["dense", "chunked-fast", "chunked-generic"])
def test_repeated_runs_are_bit_identical(path):
    rng = np.random.default_rng(2)
    q, k, v, dout, dlse = _problem(np.float32, rng, T=40, S=50)
    options = FEATURES["broadcast bias + everything"](rng, 3, 4, 40, 50)
    options.update(impl="dense" if path == "dense" else "chunked", block_q=8, block_k=16)
    generic = path == "chunked-generic"
    first = _run(q, k, v, dout, dlse, generic=generic, **options)
    for _ in range(3):
        _assert_bit_identical(first, _run(q, k, v, dout, dlse, generic=generic, **options), f"{path} rerun")


def test_float16_fast_path_bits_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(3)
    q, k, v, dout, dlse = _problem(np.float16, rng, T=33, S=47)
    options = dict(impl="chunked", causal=True, align="bottom_right", dropout_p=0.25, seed=9, block_q=8, block_k=8)
    first = _run(q, k, v, dout, dlse, threads="1", **options)
    for t in THREADS[1:]:
        _assert_bit_identical(first, _run(q, k, v, dout, dlse, threads=t, **options), f"float16, {t} threads")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=attention_cases(max_len=12, min_batch_ndim=1),
    threads=st.sampled_from(THREADS[1:]),
    block_q=st.sampled_from([1, 3, 4, 64]),
    block_k=st.sampled_from([1, 2, 5, 64]),
)
def test_any_case_is_bit_identical_on_one_thread_and_on_many(case, threads, block_q, block_k):
    rng = np.random.default_rng(0)
    q, k, v = case.arrays
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    dlse = rng.standard_normal(q.shape[:-1])
    options = dict(case.options, impl="chunked", block_q=block_q, block_k=block_k)
    _assert_bit_identical(
        _run(q, k, v, dout, dlse, threads="1", **options),
        _run(q, k, v, dout, dlse, threads=threads, **options),
        f"{threads} threads vs 1",
    )


@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_mha_bits_do_not_depend_on_the_thread_count(impl):
    params = npattn.mha_init(16, 4, num_kv_heads=2, seed=3)
    rng = np.random.default_rng(4)
    x, context = rng.standard_normal((3, 20, 16)), rng.standard_normal((3, 30, 16))
    options = dict(
        num_heads=4,
        impl=impl,
        block_q=4,
        block_k=8,
        dropout_p=0.1,
        seed=1,
        kv_lengths=np.array([30, 10, 0]),
        need_weights=True,
    )

    def run(threads):
        with mock.patch.dict(os.environ, {"NPATTN_NUM_THREADS": threads}):
            y, res = npattn.mha_forward(params, x, context, **options)
            g = npattn.mha_backward(np.ones_like(y), res)
        return [y, res.lse, res.weights, g.dx, g.dcontext, *g.dparams.values()]

    first = run("1")
    for t in ("2", "4"):
        _assert_bit_identical(first, run(t), f"mha {impl}, {t} threads")


def test_dense_is_bit_identical_to_itself_across_thread_settings():
    """The dense path has no pool; the setting must not change anything either."""
    rng = np.random.default_rng(5)
    q, k, v, dout, dlse = _problem(np.float64, rng, T=20, S=30)
    options = dict(impl="dense", causal=True, align="top_left", dropout_p=0.5, seed=3)
    first = _run(q, k, v, dout, dlse, threads="1", **options)
    for t in THREADS[1:]:
        _assert_bit_identical(first, _run(q, k, v, dout, dlse, threads=t, **options), f"dense, {t} threads")


def test_a_bad_thread_count_setting_is_a_clear_error():
    rng = np.random.default_rng(6)
    q, k, v, dout, dlse = _problem(np.float32, rng, T=20, S=30)
    with pytest.raises(ValueError, match="NPATTN_NUM_THREADS"):
        _run(q, k, v, dout, dlse, threads="four", impl="chunked", block_q=4)
