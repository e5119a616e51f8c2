"""The NumPy fast path against the generic Array API chunked path it
accelerates, and its determinism whatever the thread count."""

from __future__ import annotations

import importlib
import os
import threading
import time
import warnings

import numpy as np
import pytest
import threadpoolctl
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import attention_cases

import npattn
from npattn import chunked, fast_numpy
from npattn.chunked import tile_ranges
from npattn.options import make_spec


def _run(module_forward, module_backward, case, dout_seed=0, **extra):
    spec = make_spec(*case.arrays, impl="chunked", **case.options, **extra)
    q, k, v = case.arrays
    out, lse = module_forward(spec, q, k, v)
    rng = np.random.default_rng(dout_seed)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads = module_backward(spec, q, k, v, out, lse, dout, dlse)
    return out, lse, grads


@settings(max_examples=60)
@given(
    case=attention_cases(),
    block_q=st.sampled_from([1, 2, 3, 5, 64]),
    block_k=st.sampled_from([1, 2, 4, 7, 64]),
    split=st.sampled_from([1, 2, 3, fast_numpy.SPLIT_BLOCK]),
)
def test_fast_path_equals_generic_chunked_path(case, block_q, block_k, split):
    """``split`` below the block sizes makes partly visible tiles run as
    several spans (:func:`npattn.fast_numpy.plan_tile`)."""
    blocks = dict(block_q=block_q, block_k=block_k)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_numpy, "SPLIT_BLOCK", split)
        fast = _run(fast_numpy.forward, fast_numpy.backward, case, **blocks)
    generic = _run(chunked.chunked_forward, chunked.chunked_backward, case, **blocks)
    out_f, lse_f, grads_f = fast
    out_g, lse_g, grads_g = generic
    np.testing.assert_allclose(out_f, out_g, atol=1e-12, rtol=0)
    np.testing.assert_array_equal(np.isneginf(lse_f), np.isneginf(lse_g))
    finite = np.isfinite(lse_g)
    np.testing.assert_allclose(lse_f[finite], lse_g[finite], atol=1e-12, rtol=0)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads_f, grads_g):
        if b is None:
            assert a is None, name
        else:
            assert a.shape == b.shape, name
            np.testing.assert_allclose(a, b, atol=1e-11, rtol=0, err_msg=name)


def _tile_visibility(spec, q0, q1, k0, k1):
    """``(any item sees it, every item sees it)`` over the tile, each ``(tq, tk)``."""
    from npattn.scores.visibility import visible_tile

    visible = visible_tile(spec, q0, q1, k0, k1)
    if visible is None:
        everything = np.ones((q1 - q0, k1 - k0), dtype=bool)
        return everything, everything
    visible = np.broadcast_to(visible, visible.shape[:-2] + (q1 - q0, k1 - k0))
    lead = tuple(range(visible.ndim - 2))
    return np.any(visible, axis=lead), np.all(visible, axis=lead)


@settings(max_examples=200)
@given(data=st.data(), split=st.integers(1, 5))
def test_tile_plans_cover_every_visible_entry_once_and_mask_every_partial_one(data, split):
    case = data.draw(attention_cases(max_len=12, features=("causal", "window", "lengths")))
    spec = make_spec(*case.arrays, impl="chunked", **case.options)
    T, S = spec.q_len, spec.kv_len
    q0 = data.draw(st.integers(0, T - 1))
    q1 = data.draw(st.integers(q0 + 1, T))
    k0 = data.draw(st.integers(0, S - 1))
    k1 = data.draw(st.integers(k0 + 1, S))
    seen_by_some, seen_by_all = _tile_visibility(spec, q0, q1, k0, k1)
    covered = np.zeros((q1 - q0, k1 - k0), dtype=int)
    unmasked = np.zeros_like(covered, dtype=bool)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_numpy, "SPLIT_BLOCK", split)
        spans = fast_numpy.plan_tile(spec, q0, q1, k0, k1)
    for p0, p1, c0, c1, hidden in spans:
        assert q0 <= p0 < p1 <= q1 and k0 <= c0 < c1 <= k1
        covered[p0 - q0 : p1 - q0, c0 - k0 : c1 - k0] += 1
        unmasked[p0 - q0 : p1 - q0, c0 - k0 : c1 - k0] = True
        for j0, j1 in hidden:
            assert c0 <= j0 < j1 <= c1
            unmasked[p0 - q0 : p1 - q0, j0 - k0 : j1 - k0] = False
    assert covered.max(initial=0) <= 1, "spans overlap"
    assert np.all(covered[seen_by_some] == 1), "a visible entry is in no span"
    assert np.all(seen_by_all[unmasked]), "an entry left unmasked is hidden from some item"


def test_a_causal_diagonal_tile_computes_ten_sixteenths_of_its_area():
    x = np.zeros((1, 1, 512, 4), dtype=np.float32)
    spec = make_spec(x, x, x, causal=True, impl="chunked")
    spans = fast_numpy.plan_tile(spec, 0, 512, 0, 512)  # SPLIT_BLOCK = 128: four row chunks
    assert [(p0, p1, c0, c1) for p0, p1, c0, c1, _ in spans] == [
        (128 * i, 128 * i + 128, 0, 128 * i + 128) for i in range(4)
    ]
    assert sum((p1 - p0) * (c1 - c0) for p0, p1, c0, c1, _ in spans) == 512 * 512 * 10 // 16
    assert [hidden for *_, hidden in spans] == [((128 * i, 128 * i + 128),) for i in range(4)]  # the diagonal blocks


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_results_are_bit_identical_whatever_the_thread_count(monkeypatch, dtype):
    # Tiles of 2 heads x 256 rows by 64 columns: large enough for BLAS to use
    # all its threads when the pool has one thread, and one when it has more.
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 300, 64)).astype(dtype)
    k = rng.standard_normal((2, 2, 330, 64)).astype(dtype)
    v = rng.standard_normal((2, 2, 330, 64)).astype(dtype)
    spec = make_spec(q, k, v, causal=True, align="bottom_right", dropout_p=0.2, seed=1, block_q=256, block_k=128)
    dout = rng.standard_normal((2, 4, 300, 64)).astype(dtype)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        out, lse = fast_numpy.forward(spec, q, k, v)
        results.append((out, lse, *fast_numpy.backward(spec, q, k, v, out, lse, dout, None)[:3]))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_fast_path_is_chosen_for_numpy_and_can_be_disabled(monkeypatch):
    x = np.ones((1, 2, 3))
    spec = make_spec(x, x, x, impl="chunked")
    assert fast_numpy.supports(spec)
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    assert not fast_numpy.supports(spec)
    monkeypatch.delenv("NPATTN_FAST_NUMPY")
    assert fast_numpy.supports(make_spec(*(a.astype(np.float16) for a in (x, x, x))))  # computes in float32
    xps = pytest.importorskip("array_api_strict")
    assert not fast_numpy.supports(make_spec(*(xps.asarray(a) for a in (x, x, x))))


def test_inputs_are_not_mutated_by_the_fast_path():
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(s) for s in ((2, 3, 9, 4), (2, 3, 11, 4), (2, 3, 11, 4))]
    bias = rng.standard_normal((3, 9, 11))
    for a in arrays + [bias]:
        a.flags.writeable = False
    spec = make_spec(*arrays, bias=bias, block_q=4, block_k=4)
    out, lse = fast_numpy.forward(spec, *arrays)
    dout = rng.standard_normal(out.shape)
    dout.flags.writeable = False
    fast_numpy.backward(spec, *arrays, out, lse, dout, None)


def _blas_threads():
    return [info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]


def test_concurrent_calls_restore_the_blas_thread_limit(monkeypatch):
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    before = _blas_threads()
    q = np.random.default_rng(0).standard_normal((2, 2, 64, 8))
    errors = []

    def call():
        try:
            for _ in range(30):
                npattn.attention(q, q, q, impl="chunked", block_q=16, block_k=16)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _blas_threads() == before


def test_an_exception_in_one_item_is_raised_after_the_others_finish(monkeypatch):
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    finished = []

    def work(item):
        if item == 3:
            raise RuntimeError("item 3 failed")
        finished.append(item)

    with pytest.raises(RuntimeError, match="item 3 failed"):
        fast_numpy._run(list(range(8)), work)
    assert 3 not in finished
    assert _blas_threads() == _blas_threads()  # the limit was released (no deadlock on the lock)


@pytest.mark.parametrize(
    "spare, env, expected",
    [(False, None, 2), (True, None, 3), (True, "2", 2)],
    ids=["backward", "forward: one spare", "forward, NPATTN_NUM_THREADS=2: no spare"],
)
def test_items_in_flight_at_once(monkeypatch, spare, env, expected):
    monkeypatch.setattr(fast_numpy, "num_threads", lambda: 2)  # a 2-CPU machine
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if env is None:
        monkeypatch.delenv("NPATTN_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("NPATTN_NUM_THREADS", env)
    fast_numpy._pool(4)  # a pool larger than this call may use, as after an earlier call
    lock, running, most = threading.Lock(), [0], [0]

    def work(item):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # lets every thread that may run pick an item meanwhile
        with lock:
            running[0] -= 1

    fast_numpy._run(list(range(12)), work, spare_thread=spare)
    assert most[0] == expected


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_can_use_the_pool(monkeypatch):
    monkeypatch.setenv("NPATTN_NUM_THREADS", "2")
    q = np.random.default_rng(0).standard_normal((2, 2, 64, 8))
    expected = npattn.attention(q, q, q, impl="chunked", block_q=16, block_k=16)  # the parent's pool exists now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must not hang on the parent's pool, whose threads did not survive the fork
        try:
            out = npattn.attention(q, q, q, impl="chunked", block_q=16, block_k=16)
            os.write(write, b"ok" if np.array_equal(out, expected) else b"bad")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.read(read, 8) == b"ok"


def test_backward_follows_the_kernel_of_the_forward(monkeypatch):
    attention_module = importlib.import_module("npattn.attention")  # npattn.attention is the function
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 9, 4)) for _ in range(3))
    out, res = npattn.attention_forward(q, k, v, impl="chunked")
    assert res.kernel == "numpy"
    calls = []
    kernels = attention_module._CHUNKED_KERNELS
    monkeypatch.setitem(
        kernels, "numpy", (fast_numpy.forward, lambda *a: calls.append("numpy") or fast_numpy.backward(*a))
    )
    monkeypatch.setitem(
        kernels,
        "generic",
        (chunked.chunked_forward, lambda *a: calls.append("generic") or chunked.chunked_backward(*a)),
    )
    monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")  # switching the fast path off after the forward changes nothing
    npattn.attention_backward(np.ones_like(out), res)
    assert calls == ["numpy"]
    _, res_generic = npattn.attention_forward(q, k, v, impl="chunked")
    assert res_generic.kernel == "generic"


def test_fast_path_memory_stays_linear_in_sequence_length():
    """T=S=4096, one head, H=16: forward+backward through the public API (the
    fast path) peaks under a tenth of one T x S float32 score matrix."""
    import tracemalloc

    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((1, 1, 4096, 16), dtype=np.float32) for _ in range(4))
    npattn.attention_backward(dout, npattn.attention_forward(q, k, v, impl="chunked")[1])  # imports, pool
    tracemalloc.start()
    try:
        _out, res = npattn.attention_forward(q, k, v, impl="chunked", causal=True)
        assert res.kernel == "numpy"
        npattn.attention_backward(dout, res)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4096 * 4096 * 4 / 10, f"peak {peak / 2**20:.1f} MiB"


# --- subnormal probabilities ------------------------------------------------------------


def _subnormal_count(x):
    x = np.asarray(x)
    if x.dtype.kind != "f":
        return 0
    return int(np.count_nonzero((x != 0) & (np.abs(x) < np.finfo(x.dtype).tiny)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_flushed_exp_gives_zeros_for_hidden_and_tiny_entries_and_no_subnormals(dtype):
    for fused in (True, False):
        exp = fast_numpy._Exp(fused, np.dtype(dtype))
        s = np.array([[-np.inf, 0.0, -1.0, -30.0, exp.floor * 0.99, exp.floor * 1.01, -1e6]], dtype=dtype)
        expected = (np.exp2 if fused else np.exp)(s.astype(np.float64))
        expected[expected < 2.0 ** fast_numpy.FLUSH_EXPONENT[np.dtype(dtype)]] = 0
        got = s.copy()
        exp.flushed(got)
        assert got[0, 0] == 0 and got[0, -1] == 0 and got[0, -2] == 0
        assert got[0, 4] > 0  # just above the floor: kept
        assert _subnormal_count(got) == 0
        np.testing.assert_allclose(got, expected, rtol=4 * np.finfo(dtype).eps, atol=2 * float(exp.tiny))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("options", [{}, {"causal": True}, {"bias": "random"}], ids=["plain", "causal", "bias"])
def test_large_logits_send_no_subnormal_into_a_matrix_product(monkeypatch, dtype, options):
    """Scores spread over hundreds of units (q scaled by 40 for float32, 600 for
    float64) make most probabilities underflow; none reaches a GEMM as a
    subnormal (which would run 10-100x slower), and the results still match
    the float64 dense path."""
    rng = np.random.default_rng(11)
    big = 40.0 if dtype == np.float32 else 600.0
    q = (rng.standard_normal((1, 2, 96, 16)) * big).astype(dtype)
    k, v, dout = (rng.standard_normal((1, 2, 96, 16)).astype(dtype) for _ in range(3))
    if options.get("bias") == "random":
        options = {"bias": rng.standard_normal((2, 96, 96)).astype(dtype)}
    subnormal_operands = []
    real_matmul = np.matmul

    def checking_matmul(a, b, *args, **kwargs):
        subnormal_operands.append(_subnormal_count(a) + _subnormal_count(b))
        return real_matmul(a, b, *args, **kwargs)

    class NumpyWithCheckedMatmul:
        def __getattr__(self, name):
            return checking_matmul if name == "matmul" else getattr(np, name)

    monkeypatch.setattr(fast_numpy, "np", NumpyWithCheckedMatmul())
    spec = make_spec(q, k, v, impl="chunked", block_q=32, block_k=32, **options)
    out, lse = fast_numpy.forward(spec, q, k, v)
    dq, dk, dv, *_ = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
    monkeypatch.undo()
    assert subnormal_operands and max(subnormal_operands) == 0
    wide = [a.astype(np.float64) for a in (q, k, v)]
    wide_options = {
        name: (value.astype(np.float64) if isinstance(value, np.ndarray) else value) for name, value in options.items()
    }
    ref_out, ref_res = npattn.attention_forward(*wide, impl="dense", **wide_options)
    ref = npattn.attention_backward(dout.astype(np.float64), ref_res)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == np.float32 else dict(rtol=1e-9, atol=1e-9)
    for got, want in ((out, ref_out), (lse, ref_res.lse), (dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, **tol)


def _unit_rows(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _scores_split_by_key(q_len, key_scores, H=8, heads=1):
    """float64 q, k, v where every query scores ``key_scores[j]`` (nats, within
    0.1) against key j: all queries along one unit direction, keys along it
    at the lengths that give those scores (scale = H**-0.5)."""
    rng = np.random.default_rng(0)
    direction = np.ones(H) / np.sqrt(H)
    q = np.broadcast_to(direction, (1, heads, q_len, H)).copy()
    k = np.asarray(key_scores, dtype=float)[:, None] * np.sqrt(H) * direction
    k = np.broadcast_to(k, (1, heads) + k.shape) + 0.01 * rng.standard_normal((1, heads) + k.shape)
    v = rng.standard_normal((1, heads, len(key_scores), 4))
    return q, k, v


def _fast_against_float64_dense(q, k, v, causal, **blocks):
    """Forward and backward of the fast path, checked against float64 dense."""
    dout = np.random.default_rng(6).standard_normal(q.shape[:-1] + v.shape[-1:]).astype(q.dtype)
    spec = make_spec(q, k, v, impl="chunked", causal=causal, **blocks)
    out, lse = fast_numpy.forward(spec, q, k, v)
    dq, dk, dv, *_ = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    ref_out, ref_res = npattn.attention_forward(*wide, impl="dense", causal=causal)
    ref = npattn.attention_backward(dout.astype(np.float64), ref_res)
    for got, want in ((out, ref_out), (lse, ref_res.lse), (dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_rows_that_start_at_reference_zero_still_rescale_on_later_large_scores(causal):
    """The first key tile's scores are bounded within the rescale threshold,
    so every row keeps the reference maximum 0 without a row-max pass; later
    keys score up to 100 above it, which must move ``m`` (float32 ``exp2`` of
    100 * log2(e) overflows)."""
    rng = np.random.default_rng(5)
    q = _unit_rows(rng.standard_normal((1, 2, 64, 8))).astype(np.float32)  # scale = 8**-0.5
    k = _unit_rows(rng.standard_normal((1, 2, 64, 8))).astype(np.float32)
    k[..., 16:, :] *= 100 * np.sqrt(8)  # |scale q_i . k_j| <= 100 from key 16 on, <= 0.36 before
    threshold = fast_numpy.RESCALE_THRESHOLD
    assert float(np.abs(q @ np.swapaxes(k[..., :16, :], -1, -2)).max()) / np.sqrt(8) <= threshold
    v = rng.standard_normal((1, 2, 64, 8)).astype(np.float32)
    _fast_against_float64_dense(q, k, v, causal, block_q=16, block_k=16)


def test_rows_whose_first_keys_all_score_far_below_zero_keep_their_weight():
    """Every score is about -80: a reference maximum left at 0 would flush
    them all (below 2**-100) and leave the rows empty, so the bound must send
    these rows through the row-max pass."""
    q, k, v = (a.astype(np.float32) for a in _scores_split_by_key(16, [-80] * 16, heads=2))
    _fast_against_float64_dense(q, k, v, False, block_q=16, block_k=16)


HIDDEN_ABOVE_VISIBLE = {
    # Causal: rows 0-7 see keys 0-7 only (-60); keys 8-15 (+60) are hidden from them. Hidden
    # scores that reached the row max would move m to +60 and flush the visible ones.
    "causal, hidden keys 120 above": (16, [-60] * 8 + [60] * 8, dict(causal=True, block_q=16, block_k=8)),
    # Padding: keys 8-15 (+55) are beyond kv_lengths. In the backward exp(S - lse) of them
    # would overflow float32 (2**159) if they were exponentiated before being zeroed.
    "padded keys 110 above": (16, [-55] * 8 + [55] * 8, dict(kv_lengths=np.array([8]), block_q=16, block_k=16)),
}


@pytest.mark.parametrize("case", list(HIDDEN_ABOVE_VISIBLE), ids=list(HIDDEN_ABOVE_VISIBLE))
def test_hidden_keys_scoring_far_above_the_visible_ones_change_nothing(case):
    """Hidden entries are exponentiated from their finite scores and zeroed
    after only where the bound keeps them in range; here it does not, and
    float32 results still match float64, with no overflow warning."""
    q_len, key_scores, options = HIDDEN_ABOVE_VISIBLE[case]
    q, k, v = _scores_split_by_key(q_len, key_scores, heads=2)
    dout = np.random.default_rng(1).standard_normal(q.shape[:-1] + v.shape[-1:])
    narrow = [a.astype(np.float32) for a in (q, k, v, dout)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in exp2 is a RuntimeWarning
        spec = make_spec(*narrow[:3], impl="chunked", **options)
        out, lse = fast_numpy.forward(spec, *narrow[:3])
        grads = fast_numpy.backward(spec, *narrow[:3], out, lse, narrow[3], None)[:3]
    wide = make_spec(q, k, v, impl="chunked", **options)
    out_w, lse_w = chunked.chunked_forward(wide, q, k, v)
    grads_w = chunked.chunked_backward(wide, q, k, v, out_w, lse_w, dout, None)[:3]
    np.testing.assert_allclose(lse, lse_w, rtol=1e-5, atol=1e-4)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_w, *grads_w)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, np.abs(want).max()), err_msg=name)


# --- default tiles: spans at the real SPLIT_BLOCK ------------------------------------------


REAL_SIZE_CASES = {
    "causal bottom_right, lengths": dict(
        T=600, S=900, causal=True, align="bottom_right", kv_lengths=np.array([900, 401])
    ),
    "window, T != S": dict(T=700, S=1000, window=(150, 0), align="top_left"),
    "causal, dropout": dict(T=640, S=640, causal=True, dropout_p=0.1, seed=3),
}


@pytest.mark.parametrize("case", list(REAL_SIZE_CASES), ids=list(REAL_SIZE_CASES))
def test_default_tiles_and_spans_equal_the_generic_path(case):
    """512-tiles cut into 128-row spans, as shipped, against the generic path in float64."""
    options = dict(REAL_SIZE_CASES[case])
    T, S = options.pop("T"), options.pop("S")
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 4, T, 8)), rng.standard_normal((2, 2, S, 8)), rng.standard_normal((2, 2, S, 4))
    spec = make_spec(q, k, v, impl="chunked", **options)
    plans = fast_numpy._plans(spec, tile_ranges(T, 512), tile_ranges(S, 512))
    assert any(len(plan) > 1 for row in plans for plan in row), "no tile was cut into spans"
    out, lse = fast_numpy.forward(spec, q, k, v)
    out_g, lse_g = chunked.chunked_forward(spec, q, k, v)
    dout = rng.standard_normal(out.shape)
    grads = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)[:3]
    grads_g = chunked.chunked_backward(spec, q, k, v, out_g, lse_g, dout, None)[:3]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_g))
    finite = np.isfinite(lse_g)
    np.testing.assert_allclose(lse[finite], lse_g[finite], atol=1e-12, rtol=0)
    for got, want in zip((out, *grads), (out_g, *grads_g)):
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
