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
from strategies import ALL_FEATURES, attention_cases

import npattn
from npattn import chunked, fast_numpy
from npattn.chunked import tile_ranges
from npattn.options import make_spec
from npattn.scores.visibility import visible_tile


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


@settings(max_examples=60)
@given(
    case=attention_cases(features=ALL_FEATURES, kv_heads=(2, 3, 4)),
    block_q=st.sampled_from([2, 3, 64]),
    block_k=st.sampled_from([2, 5, 64]),
)
def test_items_of_several_kv_heads_equal_items_of_one(case, block_q, block_k):
    """Items that stack a group of kv heads (:func:`npattn.fast_numpy._kv_groups`,
    here as large as the heads allow) give the numbers of one kv head per
    item, forward and backward, over every option: masks, bias, lengths,
    dropout, segments and the variants (score modifications keep one head
    per item, and ALiBi where the keys span several key tiles)."""
    blocks = dict(block_q=block_q, block_k=block_k)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_numpy, "GROUP_MIN_ITEMS", 1)
        patch.setattr(fast_numpy, "GROUP_SCORES", 2**40)
        spec = make_spec(*case.arrays, impl="chunked", **case.options, **blocks)
        grouped = fast_numpy._kv_groups(spec, 1, 1)
        single = spec.alibi_slopes is not None and spec.kv_len > block_k
        assert len(grouped) == (spec.num_kv_heads if single else 1)
        together = _run(fast_numpy.forward, fast_numpy.backward, case, **blocks)
        patch.setattr(fast_numpy, "GROUP_SCORES", 0)  # one kv head per item
        alone = _run(fast_numpy.forward, fast_numpy.backward, case, **blocks)
    for name, a, b in zip(("out", "lse"), together[:2], alone[:2]):
        np.testing.assert_allclose(a, b, atol=1e-12, rtol=0, err_msg=name)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), together[2], alone[2]):
        if b is not None:
            np.testing.assert_allclose(a, b, atol=1e-11, rtol=0, err_msg=name)
    if "alibi_slopes" in alone[2][4]:
        np.testing.assert_allclose(together[2][4]["alibi_slopes"], alone[2][4]["alibi_slopes"], atol=1e-11, rtol=0)


def _tile_visibility(spec, q0, q1, k0, k1):
    """``(any item sees it, every item sees it)`` over the tile, each ``(tq, tk)``."""
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


@settings(max_examples=100)
@given(data=st.data(), split=st.integers(1, 5), block=st.integers(1, 7))
def test_batch_plans_cover_each_elements_visible_entries_once_and_mask_only_its_partial_ones(data, split, block):
    """With lengths or segment ids each batch element plans its own square
    (:func:`npattn.fast_numpy._batch_plans`): no span reaches past its
    ``q_len`` rows or ``kv_len`` keys, every entry it sees is in one span,
    every entry left unmasked is visible to it, and a hidden range's mask
    built with the plans (inside one document, or without ids) is exactly
    what it hides."""
    case = data.draw(attention_cases(max_len=12, features=("causal", "window", "lengths", "segments")))
    spec = make_spec(*case.arrays, impl="chunked", **case.options)
    T, S, Bf = spec.q_len, spec.kv_len, spec.num_batch
    q_tiles, k_tiles = tile_ranges(T, block), tile_ranges(S, block)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_numpy, "SPLIT_BLOCK", split)
        plans = fast_numpy._batch_plans(spec, q_tiles, k_tiles)
    q_lens = np.broadcast_to(T if spec.q_lengths is None else spec.q_lengths, spec.batch_shape).reshape(Bf)
    kv_lens = np.broadcast_to(S if spec.kv_lengths is None else spec.kv_lengths, spec.batch_shape).reshape(Bf)
    assert len(plans) == Bf
    for b in range(Bf):
        visible = visible_tile(spec, 0, T, 0, S, batch=b)
        visible = np.ones((T, S), dtype=bool) if visible is None else np.broadcast_to(visible, (T, S))
        covered = np.zeros((T, S), dtype=int)
        unmasked = np.zeros((T, S), dtype=bool)
        for row in plans[b]:
            for plan in row:
                for p0, p1, c0, c1, hidden in plan:
                    assert p1 <= q_lens[b] and c1 <= kv_lens[b], "a span reaches into the padding"
                    covered[p0:p1, c0:c1] += 1
                    unmasked[p0:p1, c0:c1] = True
                    for j0, j1, rows_hidden in hidden:
                        unmasked[p0:p1, j0:j1] = False
                        if rows_hidden is not None:  # (tq*G, tk), row t*G + g for position t
                            by_position = rows_hidden.reshape(p1 - p0, -1, j1 - j0)
                            expected = np.broadcast_to(~visible[p0:p1, None, j0:j1], by_position.shape)
                            assert np.array_equal(by_position, expected), "a built mask is not what the rules hide"
        assert covered.max(initial=0) <= 1, "spans overlap"
        assert np.all(covered[visible] == 1), "a visible entry is in no span"
        assert np.all(visible[unmasked]), "an entry left unmasked is hidden from this element"


def _count_computed_scores(monkeypatch):
    """A list that records the entries of every span whose scores the fast
    path computes (:meth:`npattn.fast_numpy._Item.scores`), from now on."""
    computed = []
    real_scores = fast_numpy._Item.scores

    def counting_scores(self, out, qa, kTa, span, **kwargs):
        computed.append(out.size)
        return real_scores(self, out, qa, kTa, span, **kwargs)

    monkeypatch.setattr(fast_numpy._Item, "scores", counting_scores)
    return computed


def _assert_fast_equals_generic(spec, q, k, v, dout, forward=None):
    """The fast path's forward (or its ``(out, lse)`` given as ``forward``) and
    backward against the generic chunked path, in float64: the same fully
    masked rows, and lse, out, dq, dk and dv to 1e-12."""
    out, lse = fast_numpy.forward(spec, q, k, v) if forward is None else forward
    grads = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)[:3]
    out_g, lse_g = chunked.chunked_forward(spec, q, k, v)
    grads_g = chunked.chunked_backward(spec, q, k, v, out_g, lse_g, dout, None)[:3]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_g))
    finite = np.isfinite(lse_g)
    np.testing.assert_allclose(lse[finite], lse_g[finite], atol=1e-12, rtol=0)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_g, *grads_g)):
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": True}, {"window": (5, 2)}, {"softcap": 3.0}, {"causal": True, "softcap": 3.0}],
    ids=["full", "causal", "window", "softcap", "causal+softcap"],
)
def test_batch_elements_fold_into_heads_where_nothing_tells_them_apart(monkeypatch, options):
    """Batch (2, 3), 8 query heads on 4 kv heads, T=S=24: the forward and
    backward run as the 24 kv heads of one element, in items of 3 kv heads
    (:func:`npattn.fast_numpy._kv_groups` keeps 8 items), some of which
    stack the heads of two elements, and give the generic path's numbers in
    float64."""
    rng = np.random.default_rng(3)
    q, dout = (rng.standard_normal((2, 3, 8, 24, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 4, 24, 8)) for _ in range(2))
    spec = make_spec(q, k, v, impl="chunked", **options)
    folded = fast_numpy._batch_as_heads(spec)
    assert (folded.batch_shape, folded.num_heads, folded.num_kv_heads) == ((), 48, 24)
    groups = []
    real_item = fast_numpy._Item

    def noting_groups(spec_, b, kv_heads, *rest):
        groups.append((spec_.batch_shape, b, kv_heads))
        return real_item(spec_, b, kv_heads, *rest)

    monkeypatch.setattr(fast_numpy, "_Item", noting_groups)
    _assert_fast_equals_generic(spec, q, k, v, dout)
    assert groups and all(shape == () and b == 0 for shape, b, _ in groups)
    assert {kv1 - kv0 for _, _, (kv0, kv1) in groups} == {3}
    assert any(kv0 // 4 != (kv1 - 1) // 4 for _, _, (kv0, kv1) in groups)  # heads of two batch elements


def test_strided_heads_fold_only_where_elements_could_share_an_item():
    """The layer's split heads, ``(B, L, N*H)`` viewed as ``(B, N, L, H)``,
    cannot fold batch into heads without a copy: they fold where a batch
    element's scores stay below one group (items then stack elements), and
    are read in place where an element fills a group; contiguous heads
    always fold. Either way the numbers are the same bits."""
    rng = np.random.default_rng(4)

    def split(B, N, L, H):  # (B, L, N*H) -> (B, N, L, H), a strided view
        return rng.standard_normal((B, L, N * H)).reshape(B, L, N, H).transpose(0, 2, 1, 3)

    assert fast_numpy.GROUP_SCORES == 2**18
    small, large = split(4, 2, 16, 8), split(2, 8, 192, 8)  # 2*16*16 and 8*192*192 >= 2**18 scores per element
    for x, folds in ((small, True), (large, False)):
        spec = make_spec(x, x, x, impl="chunked")
        assert (fast_numpy._batch_as_heads(spec, x, x, x) is not None) == folds
        contiguous = np.ascontiguousarray(x)
        assert fast_numpy._batch_as_heads(spec, contiguous, contiguous, contiguous) is not None
        out, lse = fast_numpy.forward(spec, x, x, x)
        out_c, lse_c = fast_numpy.forward(spec, contiguous, contiguous, contiguous)
        np.testing.assert_array_equal(out, out_c)
        np.testing.assert_array_equal(lse, lse_c)
        dout = rng.standard_normal(out.shape)
        grads = fast_numpy.backward(spec, x, x, x, out, lse, dout, None)[:3]
        grads_c = fast_numpy.backward(spec, contiguous, contiguous, contiguous, out, lse, dout, None)[:3]
        for got, want in zip(grads, grads_c):
            np.testing.assert_array_equal(got, want)
    spec = make_spec(large, large, large, impl="chunked")
    _assert_fast_equals_generic(spec, large, large, large, rng.standard_normal(large.shape))


@pytest.mark.parametrize("ones", [True, False])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_keys_transpose_alike_from_strided_and_contiguous_rows(ones, scale):
    """``[scale K^T; 1]`` from the layer's strided heads (copied first) is
    the same bits as from contiguous ones, and the input is left alone."""
    rng = np.random.default_rng(5)
    split = rng.standard_normal((1, 300, 3 * 8)).reshape(1, 300, 3, 8).transpose(0, 2, 1, 3)[0]  # (3, 300, 8) view
    before = split.copy()
    strided = fast_numpy._augmented_transposed(split, np.float64, ones=ones, scale=scale)
    contiguous = fast_numpy._augmented_transposed(np.ascontiguousarray(split), np.float64, ones=ones, scale=scale)
    np.testing.assert_array_equal(strided, contiguous)
    np.testing.assert_array_equal(split, before)
    assert strided.shape == (3, 8 + ones, 300) and strided.flags.c_contiguous
    np.testing.assert_array_equal(strided[:, :8], np.swapaxes(split, -1, -2) * (1 if scale is None else scale))


@pytest.mark.parametrize(
    "options",
    [
        {"mask": np.ones((24, 24), dtype=bool)},
        {"bias": np.zeros((24, 24))},
        {"kv_lengths": np.array([[24, 20, 9], [1, 24, 24]])},
        {"q_segment_ids": np.zeros((2, 3, 24), dtype=int), "kv_segment_ids": np.zeros((2, 3, 24), dtype=int)},
        {"alibi_slopes": np.ones(4)},
        {"dropout_p": 0.1, "seed": 0},
        {"score_mods": [npattn.head_temperature(np.ones(4))]},
    ],
    ids=["mask", "bias", "kv_lengths", "segments", "alibi", "dropout", "score_mods"],
)
def test_batch_elements_stay_apart_where_an_option_tells_them_apart(options):
    q = np.zeros((2, 3, 4, 24, 8))
    k = np.zeros((2, 3, 2, 24, 8))
    assert fast_numpy._batch_as_heads(make_spec(q, k, k, impl="chunked", **options)) is None
    assert fast_numpy._batch_as_heads(make_spec(q[0, 0], k[0, 0], k[0, 0], impl="chunked")) is None  # one element


@pytest.mark.parametrize(
    ("N", "K", "T", "options", "block_q"),
    [
        (8, 8, 2048, {}, 512),
        (8, 4, 2048, {}, 512),
        (8, 2, 2048, {}, 256),
        (8, 1, 2048, {}, 128),
        (32, 1, 2048, {}, 128),
        (8, 2, 2048, {"block_q": 512}, 512),  # the caller's size wins
        (8, 8, 1024, {"causal": True}, 128),  # a short sequence that causal cuts
        (8, 1, 96, {}, 96),  # clipped to T
    ],
)
def test_query_tiles_hold_at_most_grouped_tile_rows_of_stacked_heads(N, K, T, options, block_q):
    q, k = np.zeros((1, N, T, 4), np.float32), np.zeros((1, K, T, 4), np.float32)
    assert fast_numpy._blocks(make_spec(q, k, k, impl="chunked", **options))[0] == block_q


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True},
        {"kv_lengths": np.array([128, 70, 9, 128])},
        {"causal": True, "sinks": np.linspace(-1, 1, 8)},
    ],
    ids=["full", "causal", "padded keys (base e)", "causal+sinks"],
)
def test_alibi_items_of_several_kv_heads_equal_the_generic_path(monkeypatch, options):
    """Keys that fit one key tile (T=S=128): ALiBi's items stack kv heads
    (4 batch elements, 4 kv heads in 2 items each, 2 query heads per kv
    head, the slopes differing per head), with the generic path's numbers in
    float64, the slopes' gradient included."""
    rng = np.random.default_rng(11)
    q, dout = (rng.standard_normal((4, 8, 128, 16)) for _ in range(2))
    k, v = (rng.standard_normal((4, 4, 128, 16)) for _ in range(2))
    options = {"alibi_slopes": npattn.alibi_slopes(8), **options}
    spec = make_spec(q, k, v, impl="chunked", **options)
    assert [b - a for a, b in fast_numpy._kv_groups(spec, 128 * 128 * 2, 1)] == [2, 2]
    results = []
    for fast in ("1", "0"):
        monkeypatch.setenv("NPATTN_FAST_NUMPY", fast)
        out, res = npattn.attention_forward(q, k, v, impl="chunked", **options)
        assert res.kernel == ("numpy" if fast == "1" else "generic")
        grads = npattn.attention_backward(dout, res)
        results.append((out, res.lse, grads.dq, grads.dk, grads.dv, grads.dalibi_slopes))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv", "dalibi_slopes"), *results):
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_heads_in_short_query_tiles_equal_the_generic_path(causal):
    """8 query heads on one kv head at T=S=300 with the default tiles: 128
    positions a query tile (3 tiles, the last cut short), with the generic
    path's numbers, forward and backward, in float64."""
    rng = np.random.default_rng(8)
    q, dout = (rng.standard_normal((2, 8, 300, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 1, 300, 8)) for _ in range(2))
    spec = make_spec(q, k, v, impl="chunked", causal=causal)
    assert fast_numpy._blocks(spec) == (128, 300)
    _assert_fast_equals_generic(spec, q, k, v, dout)


def test_padded_keys_and_queries_are_neither_computed_nor_masked(monkeypatch):
    """Padding by ``kv_lengths`` and ``q_lengths`` alone, default tiles: each
    element's spans cover exactly its ``q_len x kv_len`` and need no mask,
    the forward computes exactly those entries (a shared plan would compute
    every element up to the longest lengths and mask the rest), and the
    numbers are the generic path's, backward included, in float64."""
    T = S = 640
    q_lens, kv_lens = np.array([640, 300, 77, 0]), np.array([640, 520, 128, 256])
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((4, 2, T, 8)) for _ in range(4))
    spec = make_spec(q, k, v, impl="chunked", q_lengths=q_lens, kv_lengths=kv_lens)
    block_q, block_k = fast_numpy._blocks(spec)
    plans = fast_numpy._batch_plans(spec, tile_ranges(T, block_q), tile_ranges(S, block_k))
    spans = [[span for row in element for plan in row for span in plan] for element in plans]
    assert all(hidden == () for element in spans for *_, hidden in element), "a span masks padding"
    areas = [sum((p1 - p0) * (c1 - c0) for p0, p1, c0, c1, _ in element) for element in spans]
    assert areas == (q_lens * kv_lens).tolist()
    computed = _count_computed_scores(monkeypatch)
    out, lse = fast_numpy.forward(spec, q, k, v)
    assert sum(computed) == 2 * sum(areas)  # two heads
    assert np.all(np.isneginf(lse[3])) and np.all(np.isneginf(lse[1, :, 300:])), "padded rows stay masked"
    _assert_fast_equals_generic(spec, q, k, v, dout, forward=(out, lse))


def test_narrow_spans_group_kv_heads_by_their_own_size():
    """A sliding window of 64 at T = S = 2048 cuts every 512-tile into spans
    of 128 positions by 256 keys: an item then stacks all 4 kv heads (a
    whole-tile span takes GROUP_MIN_HEADS, two), with the generic path's numbers."""
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((2, 4, 2048, 8)) for _ in range(4))
    spec = make_spec(q, k, v, impl="chunked", window=(64, 0))
    call = fast_numpy._Forward(spec, q, k, v)
    assert fast_numpy._largest_span(call.plans) == 128 * 256
    assert call.groups == [(0, 4)]
    causal = fast_numpy._Forward(make_spec(q, k, v, impl="chunked", causal=True), q, k, v)
    assert causal.groups == [(0, 2), (2, 4)]
    _assert_fast_equals_generic(spec, q, k, v, dout)


def test_a_causal_diagonal_tile_computes_ten_sixteenths_of_its_area():
    x = np.zeros((1, 1, 512, 4), dtype=np.float32)
    spec = make_spec(x, x, x, causal=True, impl="chunked")
    spans = fast_numpy.plan_tile(spec, 0, 512, 0, 512)  # SPLIT_BLOCK = 128: four row chunks
    assert [(p0, p1, c0, c1) for p0, p1, c0, c1, _ in spans] == [
        (128 * i, 128 * i + 128, 0, 128 * i + 128) for i in range(4)
    ]
    assert sum((p1 - p0) * (c1 - c0) for p0, p1, c0, c1, _ in spans) == 512 * 512 * 10 // 16
    assert [hidden for *_, hidden in spans] == [((128 * i, 128 * i + 128),) for i in range(4)]  # the diagonal blocks


def test_diagonal_blocks_of_the_same_shape_share_one_read_only_mask():
    """Causal visibility depends on ``j - i`` alone: the 16 diagonal 128-blocks
    of T = S = 2048 (4 per 512-tile) are planned with one mask, the one a
    block builds on its own."""
    x = np.zeros((1, 2, 2048, 4), dtype=np.float32)
    spec = make_spec(x, x, x, causal=True, impl="chunked")
    plans = fast_numpy._plans(spec, tile_ranges(2048, 512), tile_ranges(2048, 512))
    masks = [m for row in plans for plan in row for *_, hidden in plan for _, _, m in hidden]
    assert len(masks) == 16 and all(m is masks[0] for m in masks)
    expected = fast_numpy._plans(spec, [(0, 128)], [(0, 128)])[0][0][0][4][0][2]
    np.testing.assert_array_equal(masks[0], expected)
    assert expected.any() and not expected.all()


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


def test_few_kv_heads_split_their_query_heads_into_backward_parts():
    """MQA and GQA at B=1 have fewer (batch element, kv head) items than
    GROUP_MIN_ITEMS: the backward splits each kv head's query heads into
    parts of at least PART_MIN_HEADS, each with PART_MIN_SCORES scores, from
    the shapes alone; never where an option tells query heads apart."""

    def parts(N, K, T, B=1, **options):
        q, kv = np.zeros((B, N, T, 4)), np.zeros((B, K, T, 4))
        return fast_numpy._head_parts(make_spec(q, kv, kv, **options))

    assert parts(8, 1, 2048) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # MQA: 4 parts of 2 heads
    assert parts(8, 1, 1024) == [(0, 4), (4, 8)]  # 2**23 scores: 2 parts of 2**22
    assert parts(8, 2, 4096, causal=True) == [(0, 2), (2, 4)]
    assert parts(8, 1, 512) == [(0, 8)]  # too few scores for two parts
    assert parts(6, 1, 2048) == [(0, 3), (3, 6)]  # 3 parts wanted: a power of two, for two threads to share
    assert parts(12, 1, 1024) == [(0, 6), (6, 12)]  # 3 by the scores: 2
    assert parts(8, 8, 2048) == [(0, 1)]  # one query head per kv head
    assert parts(16, 2, 2048, B=4) == [(0, 8)]  # 8 items already
    for options in ({"bias": np.zeros((2048, 2048))}, {"dropout_p": 0.1, "seed": 0}, {"alibi_slopes": np.ones(8)}):
        assert parts(8, 1, 2048, **options) == [(0, 8)]


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"causal": True, "align": "bottom_right"},
        {"window": (5, 2), "align": "top_left"},
        {"softcap": 3.0},
        {"kv_lengths": np.array([[30], [17]]), "q_lengths": np.array([[20], [9]])},
        {
            "kv_lengths": np.array([[30], [17]]),
            "q_lengths": np.array([[20], [9]]),
            "causal": True,
            "align": "bottom_right",
        },
        {"q_segment_ids": np.repeat([[[0, 1, 1, 2]]], 2, axis=0).repeat(6, axis=2)},
        {"sinks": np.linspace(-1, 1, 8)},
    ],
    ids=["full", "causal", "window", "softcap", "lengths", "causal+lengths", "segments", "sinks"],
)
def test_backward_in_query_head_parts_gives_the_generic_paths_numbers(monkeypatch, options):
    """Batch (2, 1), 8 query heads on 1 kv head, T=24, S=30 (24 with segment
    ids): with the thresholds lowered, the backward runs as 4 parts of 2
    query heads (one item each, their dK and dV shares summed in part order),
    with the generic path's numbers in float64, and the same bits on 1, 2
    and 3 threads (with a cotangent of lse too)."""
    monkeypatch.setattr(fast_numpy, "PART_MIN_SCORES", 1)
    rng = np.random.default_rng(7)
    S = 24 if "q_segment_ids" in options else 30
    if "q_segment_ids" in options:
        options = {**options, "kv_segment_ids": options["q_segment_ids"]}
    q, dout = (rng.standard_normal((2, 1, 8, 24, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 1, 1, S, 8)) for _ in range(2))
    spec = make_spec(q, k, v, impl="chunked", **options)
    assert fast_numpy._head_parts(spec) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    _assert_fast_equals_generic(spec, q, k, v, dout)
    out, lse = fast_numpy.forward(spec, q, k, v)
    dlse = rng.standard_normal(lse.shape)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        results.append(fast_numpy.backward(spec, q, k, v, out, lse, dout, dlse)[:3])
    assert all(np.isfinite(grad).all() for grad in results[0])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_backward_parts_compute_in_the_whole_calls_mode(monkeypatch):
    """MQA, 4 query heads in 2 parts, float32: the first part's queries are
    large enough that the call's bound leaves base 2 and the fused shifts
    (as the forward decided), the second part's alone would not. Every part
    runs in the whole call's mode, with the gradients of the unsplit call
    to within what float32's rounding of these scores (|S| up to 3500)
    moves ``P`` by: the parts' products have other shapes than the whole
    call's, which some BLAS kernels (OpenBLAS's "Haswell") round otherwise."""
    monkeypatch.setattr(fast_numpy, "PART_MIN_SCORES", 1)
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 4, 32, 8)).astype(np.float32)
    q[:, :2] *= 1000  # |scale q_i| |k_j| log2(e) reaches the fused-shift limit (4096) only in part 0
    k, v, dout = (rng.standard_normal(shape).astype(np.float32) for shape in ((1, 1, 32, 8),) * 2 + ((1, 4, 32, 8),))
    spec = make_spec(q, k, v, impl="chunked")
    assert fast_numpy._head_parts(spec) == [(0, 2), (2, 4)]
    out, lse = fast_numpy.forward(spec, q, k, v)
    modes = []
    real_base_scale = fast_numpy._base_scale

    def noting_mode(spec_, mode):  # each part's backward reads its mode's scale here
        modes.append(mode.fused)
        return real_base_scale(spec_, mode)

    monkeypatch.setattr(fast_numpy, "_base_scale", noting_mode)
    split = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)[:3]
    whole_mode = fast_numpy._Mode(spec, fast_numpy._row_norms(q), fast_numpy._row_norms(k))
    part_alone = fast_numpy._Mode(spec, fast_numpy._row_norms(q[:, 2:]), fast_numpy._row_norms(k))
    assert not whole_mode.fused and part_alone.fused  # the case the test is about
    assert modes == [False, False]
    monkeypatch.setattr(fast_numpy, "_head_parts", lambda spec: [(0, spec.group_size)])
    whole = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)[:3]
    reach = np.abs(np.einsum("bnth,bksh->bnts", q, k)).max() * spec.scale  # (1, 4, 32, 32): |S|'s largest
    for got, want in zip(split, whole):
        np.testing.assert_allclose(got, want, rtol=0, atol=reach * np.finfo(np.float32).eps * np.abs(want).max())


def test_fast_path_is_chosen_for_numpy_and_can_be_disabled(monkeypatch):
    x = np.ones((1, 2, 3))
    spec = make_spec(x, x, x, impl="chunked")
    assert fast_numpy.supports(spec)
    variants = dict(softcap=5.0, alibi_slopes=np.array([0.5]), sinks=np.zeros(1))
    segments = dict(q_segment_ids=np.array([0, 1]), kv_segment_ids=np.array([0, 1]))
    assert fast_numpy.supports(make_spec(x, x, x, impl="chunked", **variants, **segments))
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

    callers = [threading.Thread(target=call) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
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
        npattn.threads.run_items(list(range(8)), work)
    assert 3 not in finished
    assert _blas_threads() == _blas_threads()  # the limit was released (no deadlock on the lock)


@pytest.mark.parametrize("count", [1, 2, 3])
def test_items_in_flight_at_once_and_the_calling_thread_takes_part(monkeypatch, count):
    monkeypatch.setattr(npattn.threads, "num_threads", lambda: count)
    npattn.threads.shared_pool(4)  # a pool larger than this call may use, as after an earlier call
    lock, running, most, workers = threading.Lock(), [0], [0], set()

    def work(item):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            workers.add(threading.get_ident())
        time.sleep(0.05)  # lets every thread that may run pick an item meanwhile
        with lock:
            running[0] -= 1

    npattn.threads.run_items(list(range(12)), work)
    assert most[0] == count
    assert len(workers) == count
    assert threading.get_ident() in workers


def test_one_thread_runs_the_items_in_order_here(monkeypatch):
    monkeypatch.setenv("NPATTN_NUM_THREADS", "1")
    seen = []
    npattn.threads.run_items(list(range(6)), lambda item: seen.append((item, threading.get_ident())))
    assert seen == [(item, threading.get_ident()) for item in range(6)]


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


def _count_subnormal_matmul_operands(monkeypatch) -> list[int]:
    """Make the fast path's ``np.matmul`` record how many subnormal entries
    its operands hold, one count per call, in the list returned (undo with
    ``monkeypatch.undo()``)."""
    counts: list[int] = []
    real_matmul = np.matmul

    def checking_matmul(a, b, *args, **kwargs):
        counts.append(_subnormal_count(a) + _subnormal_count(b))
        return real_matmul(a, b, *args, **kwargs)

    class NumpyWithCheckedMatmul:
        def __getattr__(self, name):
            return checking_matmul if name == "matmul" else getattr(np, name)

    monkeypatch.setattr(fast_numpy, "np", NumpyWithCheckedMatmul())
    return counts


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
    subnormal_operands = _count_subnormal_matmul_operands(monkeypatch)
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


@pytest.mark.parametrize(
    "T, options, single",
    [
        (128, {}, True),  # one whole tile per item
        (128, {"causal": True}, True),  # one span with its diagonal hidden
        (128, {"dropout_p": 0.3, "seed": 2}, True),
        (600, {}, False),  # two key tiles: two spans
        (512, {"causal": True}, True),  # short causal calls tile by 128 rows: one span each
        (512, {"causal": True, "block_q": 512}, False),  # the diagonal's four 128-row spans
        (128, {"bias": np.zeros((128, 128))}, False),  # a running maximum
    ],
    ids=["full", "causal", "dropout", "two key tiles", "causal 512", "causal 512-row tile", "bias"],
)
def test_an_item_with_one_span_over_all_its_rows_writes_its_sums_directly(monkeypatch, T, options, single):
    """Such an item's products write ``l`` and ``acc`` rather than adding
    to zeroed buffers; every other item accumulates. The numbers are the
    generic path's either way."""
    seen = []
    real = fast_numpy._Sums

    def recording(*args, **kwargs):
        sums = real(*args, **kwargs)
        seen.append(sums.single_span)
        return sums

    monkeypatch.setattr(fast_numpy, "_Sums", recording)
    rng = np.random.default_rng(8)
    q, k, v, dout = (rng.standard_normal((1, 2, T, 8)) for _ in range(4))
    spec = make_spec(q, k, v, impl="chunked", **options)
    _assert_fast_equals_generic(spec, q, k, v, dout)
    assert seen and set(seen) == {single}


@pytest.mark.parametrize(
    "N, K, T, options, direct",
    [
        (2, 2, 128, {}, True),  # one whole tile
        (2, 2, 128, {"causal": True}, True),  # one partial span, one head per kv head
        (4, 2, 128, {"causal": True}, False),  # two heads: _add_row_products cuts it head by head
        (2, 2, 128, {"kv_lengths": np.array([100])}, False),  # the span stops short of the key tile
        (2, 2, 600, {}, False),  # two key tiles
        (2, 2, 256, {"causal": True}, False),  # two 128-row query tiles
    ],
    ids=["full", "causal", "causal GQA", "kv_lengths", "two key tiles", "causal 256"],
)
def test_a_backward_item_with_one_span_writes_its_gradients_directly(monkeypatch, N, K, T, options, direct):
    """Where an item's plans are one span over every query and the one key
    tile, its products write dQ, dK and dV rather than adding to zeroed
    buffers (no call of ``_add_row_products``); either way the gradients are
    the generic path's."""
    added = []
    real = fast_numpy._add_row_products
    monkeypatch.setattr(fast_numpy, "_add_row_products", lambda *args: added.append(1) or real(*args))
    rng = np.random.default_rng(9)
    q, dout = (rng.standard_normal((1, N, T, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, K, T, 8)) for _ in range(2))
    spec = make_spec(q, k, v, impl="chunked", **options)
    q_tiles, k_tiles = (tile_ranges(n, block) for n, block in zip((T, T), fast_numpy._blocks(spec)))
    plans = fast_numpy._batch_plans(spec, q_tiles, k_tiles)[0]
    assert fast_numpy._one_backward_span(plans, k_tiles, T, N // K) == direct
    _assert_fast_equals_generic(spec, q, k, v, dout)
    assert bool(added) != direct


def _zero_reference(q, k, v, **options):
    """Whether the fast forward keeps every row at the reference 0 for these inputs."""
    spec = make_spec(q, k, v, impl="chunked", **options)
    call = fast_numpy._Forward(spec, q, k, v)
    return all(call._at_zero_reference(b, g) for b in range(spec.num_batch) for g in range(len(call.groups)))


def test_the_forward_keeps_the_zero_reference_only_where_every_score_and_sum_is_bounded():
    """No running maximum only while nothing can move a score past
    ``ZERO_REFERENCE_BOUND`` (a bias, large products, ALiBi where a row may
    not see its own position) and the sums ``S 2**bound max|v|`` stay
    finite; a softcap bounds the products."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 2, 32, 8)).astype(np.float32) for _ in range(3))
    assert _zero_reference(q, k, v)
    assert _zero_reference(q, k, v, causal=True, softcap=50.0, dropout_p=0.5, seed=1, kv_lengths=np.array([20]))
    assert not _zero_reference(q, k, v, bias=np.zeros((32, 32), np.float32))
    ones = np.ones(2, np.float32)
    assert _zero_reference(q, k, v, alibi_slopes=ones, causal=True)  # 0 at each row's own key: maxima >= -bound
    assert not _zero_reference(q, k, v, alibi_slopes=-ones)  # a negative slope lifts scores past the bound
    assert not _zero_reference(q, k, v, alibi_slopes=ones, kv_lengths=np.array([20]))  # rows 20-31: no own key
    assert not _zero_reference(q, k, v, alibi_slopes=ones, mask=np.eye(32, dtype=bool)[::-1])  # it may be hidden
    assert not _zero_reference(q, k, v, score_mods=[npattn.softcap_mod(5.0)])
    assert not _zero_reference(40 * q, k, v)  # |S_ij| up to ~300 in base 2
    assert _zero_reference(40 * q, k, v, softcap=50.0)  # capped at 50 nats, 72 in base 2
    assert not _zero_reference(40 * q, k, v, softcap=100.0)
    assert not _zero_reference(q, k, 1e36 * v)  # l max|v| could reach float32's overflow
    assert not _zero_reference(40 * q, k, 1e-20 * v, softcap=50.0)  # P~ v down to 2**-72 * 1e-20: subnormal
    assert _zero_reference(q, k, np.zeros_like(v))  # exact zeros either way


@pytest.mark.parametrize(
    ("v_value", "dropout_p"),
    [(2.0**44, 0.9), (1e-20, 0.0), (1e-30, 0.0)],
    ids=["dropout scale would overflow", "small v", "v that would flush"],
)
def test_scores_at_the_zero_reference_bound_keep_extreme_values_finite_and_exact(v_value, dropout_p):
    """Every score 79.93 in base 2 (just within float32's bound): with
    ``1/(1 - p)`` on top, ``2**44`` values would overflow the sums, and with
    every score at -79.93 a tiny ``v`` would underflow in ``P~ v``; the
    running maximum takes over in both, and the fast path equals dense."""
    a = np.float32(np.sqrt(55.4))  # scale * q.k = 55.4 nats (H = 1)
    sign = 1.0 if dropout_p else -1.0
    q = np.full((1, 1, 64, 1), sign * a, np.float32)
    k = np.full((1, 1, 4, 1), a, np.float32)
    v = np.full((1, 1, 4, 1), v_value, np.float32)
    options = dict(dropout_p=dropout_p, seed=0)
    assert not _zero_reference(q, k, v, **options)
    spec = make_spec(q, k, v, impl="chunked", **options)
    out, lse = fast_numpy.forward(spec, q, k, v)
    want, res = npattn.attention_forward(q, k, v, impl="dense", **options)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)
    np.testing.assert_allclose(lse, res.lse, rtol=1e-6)


@pytest.mark.parametrize(
    "options",
    [{"kv_lengths": np.array([3])}, {"mask": np.array([True, True, True, False])}, {"causal": True}],
    ids=["padding", "mask", "causal"],
)
def test_small_visible_values_beside_large_hidden_ones_do_not_underflow_at_the_zero_reference(options):
    """Every score at -79.93 in base 2; the keys a row sees carry v = 1e-25
    and a hidden key v = 1: the zero reference's ``P~ v`` would be
    subnormal, so the running maximum runs, and the fast path equals dense."""
    a = np.float32(np.sqrt(55.4))
    q = np.full((1, 1, 4, 1), -a, np.float32)
    k = np.full((1, 1, 4, 1), a, np.float32)
    small = [1e-25, 1.0, 1.0, 1.0] if options.get("causal") else [1e-25, 1e-25, 1e-25, 1.0]  # causal row 0: key 0
    v = np.array(small, np.float32).reshape(1, 1, 4, 1)
    assert not _zero_reference(q, k, v, **options)
    out, _ = npattn.attention_forward(q, k, v, impl="chunked", **options)
    want, _ = npattn.attention_forward(q, k, v, impl="dense", **options)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("q_value", "k_scale", "scale"), [(1e-23, 1e18, 3e10), (1e-38, 1e19, 1e20)])
def test_row_norms_that_underflow_still_bound_the_scores(q_value, k_scale, scale):
    """Rows of ``|q| < 1e-19`` square to 0 in float32; the bound must not
    read them as 0 (the zero reference would then exponentiate scores of
    thousands), nor may ``scale K`` overflow: fast equals dense, finite."""
    rng = np.random.default_rng(0)
    H = 4 if q_value > 1e-30 else 1
    q = np.full((1, 1, 4, H), q_value, np.float32)
    k = (rng.standard_normal((1, 1, 8, H)) * k_scale).astype(np.float32)
    v = rng.standard_normal((1, 1, 8, 1)).astype(np.float32)
    out, _ = npattn.attention_forward(q, k, v, impl="chunked", scale=scale)
    want, _ = npattn.attention_forward(q, k, v, impl="dense", scale=scale)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale_v", [1.0, 1e15], ids=["moderate v", "large v"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_softcapped_scores_near_the_zero_reference_bound_match_float64(causal, scale_v):
    """Products far beyond the bound, capped at 50 nats (72 in base 2): at
    the zero reference ``exp2`` runs on scores up to +-72, with no flush; and
    with v large enough that the sums could overflow, the running maximum
    takes over. Both match float64 dense, forward and backward."""
    rng = np.random.default_rng(8)
    q = (40 * rng.standard_normal((1, 2, 48, 8))).astype(np.float32)
    k = rng.standard_normal((1, 2, 48, 8)).astype(np.float32)
    v = (scale_v * rng.standard_normal((1, 2, 48, 8))).astype(np.float32)
    assert _zero_reference(q, k, v, softcap=50.0) == (scale_v == 1.0)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    spec = make_spec(q, k, v, impl="chunked", causal=causal, softcap=50.0, block_q=16, block_k=16)
    out, lse = fast_numpy.forward(spec, q, k, v)
    dq, dk, dv, *_ = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    ref_out, ref_res = npattn.attention_forward(*wide, impl="dense", causal=causal, softcap=50.0)
    ref = npattn.attention_backward(dout.astype(np.float64), ref_res)
    for got, want in ((out, ref_out), (lse, ref_res.lse), (dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        assert np.all(np.isfinite(got))
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=2e-5)


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


def test_rows_that_see_no_key_of_a_bounded_first_span_stay_unset():
    """The first key tile scores within the threshold of 0, so its rows take
    the reference 0 without a row-max pass; but rows 8-15 see none of its keys
    (another document) and only keys 16-31, which score -80. They must stay
    unset and take their reference from those keys: left at 0, the flushed
    ``exp`` would zero every one of their probabilities and empty the rows."""
    q, k, v = (a.astype(np.float32) for a in _scores_split_by_key(16, [0] * 16 + [-80] * 16, heads=2))
    q_ids = np.repeat([0, 1], 8)[None]  # (1, 16)
    kv_ids = np.repeat([0, 1], 16)[None]  # (1, 32)
    options = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    dout = np.random.default_rng(6).standard_normal(q.shape[:-1] + v.shape[-1:]).astype(q.dtype)
    spec = make_spec(q, k, v, impl="chunked", block_q=16, block_k=16, **options)
    out, lse = fast_numpy.forward(spec, q, k, v)
    dq, dk, dv, *_ = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
    wide = [a.astype(np.float64) for a in (q, k, v)]
    ref_out, ref_res = npattn.attention_forward(*wide, impl="dense", **options)
    ref = npattn.attention_backward(dout.astype(np.float64), ref_res)
    assert np.all(np.abs(out[..., 8:, :]) > 0)  # the rows behind the far keys are not empty
    for got, want in ((out, ref_out), (lse, ref_res.lse), (dq, ref.dq), (dk, ref.dk), (dv, ref.dv)):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


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
    "causal bottom_right, both lengths": dict(
        T=700, S=900, causal=True, align="bottom_right", q_lengths=np.array([650, 700]), kv_lengths=np.array([900, 333])
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
    _assert_fast_equals_generic(spec, q, k, v, rng.standard_normal((2, 4, T, 4)))  # dout: (B, N, T, Hv)


@pytest.mark.parametrize(
    ("N", "K", "T", "options", "split"),
    [
        (8, 8, 128, {"causal": True}, fast_numpy.DIAGONAL_SPLIT_BLOCK),
        (8, 8, 512, {"window": (64, 0)}, fast_numpy.DIAGONAL_SPLIT_BLOCK),
        (8, 2, 256, {"causal": True, "softcap": 30.0, "sinks": np.zeros(8)}, fast_numpy.DIAGONAL_SPLIT_BLOCK),
        (8, 1, 128, {"causal": True, "align": "bottom_right"}, fast_numpy.DIAGONAL_SPLIT_BLOCK),  # T = S: offset 0
        (8, 8, 1024, {"causal": True}, fast_numpy.SPLIT_BLOCK),  # not short
        (8, 2, 512, {"causal": True}, fast_numpy.SPLIT_BLOCK),  # 2048 stacked rows
        (8, 8, 128, {}, fast_numpy.SPLIT_BLOCK),  # no band
        (8, 8, 128, {"causal": True, "kv_lengths": np.array([128])}, fast_numpy.SPLIT_BLOCK),
        (8, 8, 128, {"causal": True, "bias": np.zeros((128, 128))}, fast_numpy.SPLIT_BLOCK),
        (8, 8, 128, {"causal": True, "alibi_slopes": np.ones(8)}, fast_numpy.SPLIT_BLOCK),
        (8, 8, 128, {"causal": True, "dropout_p": 0.1, "seed": 0}, fast_numpy.SPLIT_BLOCK),
        (8, 8, 128, {"causal": True, "block_q": 64}, fast_numpy.SPLIT_BLOCK),  # the caller's tiles
    ],
)
def test_forward_cuts_short_banded_squares_into_diagonal_blocks(N, K, T, options, split):
    """:func:`npattn.fast_numpy._forward_split`: 32-row tiles and sub-blocks
    only where :data:`~npattn.fast_numpy.DIAGONAL_SPLIT_BLOCK`'s rule holds."""
    q, k = np.zeros((1, N, T, 4)), np.zeros((1, K, T, 4))
    spec = make_spec(q, k, k, impl="chunked", **options)
    assert fast_numpy._forward_split(spec) == split
    if split == fast_numpy.DIAGONAL_SPLIT_BLOCK:
        assert fast_numpy._blocks(spec, split)[0] == split  # the forward's query tiles
        assert fast_numpy._blocks(spec)[0] == fast_numpy.SPLIT_BLOCK  # the backward's


@pytest.mark.parametrize(
    "options",
    [{"causal": True}, {"window": (20, 3)}, {"causal": True, "softcap": 2.0, "sinks": np.linspace(-1, 1, 4)}],
    ids=["causal", "window", "causal+softcap+sinks"],
)
def test_diagonal_blocks_compute_less_and_equal_the_generic_path(options):
    """The forward in 32-row diagonal blocks (T=S=200, 4 query heads on 2 kv
    heads) computes less of the square than 128-row spans, and, with the
    backward on its own 128-row tiles, gives the generic path's numbers in
    float64."""
    T = 200
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 4, T, 8)), rng.standard_normal((2, 2, T, 8)), rng.standard_normal((2, 2, T, 4))
    spec = make_spec(q, k, v, impl="chunked", **options)
    split = fast_numpy._forward_split(spec)
    assert split == fast_numpy.DIAGONAL_SPLIT_BLOCK

    def area(split):
        block_q, block_k = fast_numpy._blocks(spec, split)
        plans = fast_numpy._plans(spec, tile_ranges(T, block_q), tile_ranges(T, block_k), split=split)
        return sum((p1 - p0) * (c1 - c0) for row in plans for plan in row for p0, p1, c0, c1, _ in plan)

    assert area(split) < 0.85 * area(fast_numpy.SPLIT_BLOCK)
    _assert_fast_equals_generic(spec, q, k, v, rng.standard_normal((2, 4, T, 4)))


# --- score-pipeline variants: softcap, ALiBi, sinks, segment ids ----------------------------


def _draw_variants(draw, case, *, sinks_and_segments=False):
    """Variant options on top of an :func:`attention_cases` case: a softcap,
    ALiBi slopes (per head or per batch element and head, sometimes negative),
    and with ``sinks_and_segments`` sinks and packed-document ids."""
    q, k, _ = case.arrays
    batch, N, T, S = q.shape[:-3], q.shape[-3], q.shape[-2], k.shape[-2]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    options = {}
    if draw(st.booleans()):
        options["softcap"] = draw(st.sampled_from([0.4, 1.0, 3.0]))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(N,), batch + (N,)]))
        options["alibi_slopes"] = rng.uniform(-0.3 if draw(st.booleans()) else 0.0, 1.0, size=shape)
        if T != S and "align" not in case.options:
            options["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if sinks_and_segments and draw(st.booleans()):
        options["sinks"] = rng.standard_normal((N,))
    if sinks_and_segments and draw(st.booleans()):
        options["q_segment_ids"] = np.sort(rng.integers(0, 3, size=batch + (T,)), axis=-1)
        options["kv_segment_ids"] = np.sort(rng.integers(0, 3, size=batch + (S,)), axis=-1)
    return options


def _assert_kernels_agree(fast, generic, atol=1e-12):
    """``(out, lse, (dq, dk, dv, dbias, params))`` of two kernels, to ``atol``
    (slope gradients, sums over whole rows of scores, relative to their size)."""
    (out_f, lse_f, grads_f), (out_g, lse_g, grads_g) = fast, generic
    np.testing.assert_allclose(out_f, out_g, atol=atol, rtol=0)
    np.testing.assert_array_equal(np.isneginf(lse_f), np.isneginf(lse_g))
    finite = np.isfinite(lse_g)
    np.testing.assert_allclose(lse_f[finite], lse_g[finite], atol=atol, rtol=0)
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), grads_f[:4], grads_g[:4]):
        if b is None:
            assert a is None, name
        else:
            assert a.shape == b.shape, name
            np.testing.assert_allclose(a, b, atol=10 * atol, rtol=0, err_msg=name)
    assert grads_f[4].keys() == grads_g[4].keys()
    for name in grads_g[4]:
        a, b = grads_f[4][name], grads_g[4][name]
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_allclose(a, b, atol=10 * atol * max(1.0, float(np.abs(b).max())), rtol=0, err_msg=name)


@settings(max_examples=80)
@given(
    data=st.data(),
    block_q=st.sampled_from([1, 3, 5, 64]),
    block_k=st.sampled_from([1, 4, 7, 64]),
    split=st.sampled_from([1, 2, 3, fast_numpy.SPLIT_BLOCK]),
)
def test_variants_on_the_fast_path_equal_the_generic_path(data, block_q, block_k, split):
    """Softcap and ALiBi (alone, together, with every mask feature, GQA/MQA,
    dropout, dlse and fully masked rows) through both kernels, float64."""
    case = data.draw(attention_cases(features=("mask", "bias", "causal", "window", "lengths", "dropout", "masked_row")))
    variants = _draw_variants(data.draw, case)
    blocks = dict(block_q=block_q, block_k=block_k, **variants)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast_numpy, "SPLIT_BLOCK", split)
        fast = _run(fast_numpy.forward, fast_numpy.backward, case, **blocks)
    generic = _run(chunked.chunked_forward, chunked.chunked_backward, case, **blocks)
    _assert_kernels_agree(fast, generic)


def _assert_grads_agree(got, want, atol):
    """Every array field of two AttentionGrads: None on both sides, or equal
    to ``atol`` times the larger of 1 and ``want``'s largest magnitude."""
    for field in ("dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes"):
        a, b = getattr(got, field), getattr(want, field)
        if b is None:
            assert a is None, field
        else:
            np.testing.assert_allclose(a, b, atol=atol * max(1.0, float(np.abs(b).max())), rtol=0, err_msg=field)


def _public(case, options, dout_seed=1):
    """out, lse and every gradient of the public API (``impl="chunked"``)."""
    out, res = npattn.attention_forward(*case.arrays, impl="chunked", **case.options, **options)
    rng = np.random.default_rng(dout_seed)
    grads = npattn.attention_backward(rng.standard_normal(out.shape), res, dlse=rng.standard_normal(res.lse.shape))
    return res.kernel, out, res.lse, grads


@settings(max_examples=40)
@given(data=st.data())
def test_every_variant_through_the_public_api_equals_the_generic_path(data):
    """Sinks (merged after the kernel) and segment ids (visibility, tile
    classification) with softcap and ALiBi: the fast path against
    ``NPATTN_FAST_NUMPY=0``, every field of AttentionGrads."""
    case = data.draw(attention_cases(features=("mask", "causal", "window", "lengths", "dropout")))
    variants = _draw_variants(data.draw, case, sinks_and_segments=True)
    variants.update(block_q=data.draw(st.sampled_from([2, 5, 64])), block_k=data.draw(st.sampled_from([3, 64])))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NPATTN_FAST_NUMPY", "1")
        fast = _public(case, variants)
        patch.setenv("NPATTN_FAST_NUMPY", "0")
        generic = _public(case, variants)
    assert (fast[0], generic[0]) == ("numpy", "generic")
    for name, a, b in zip(("out", "lse"), fast[1:3], generic[1:3]):
        np.testing.assert_allclose(a, b, atol=1e-12, rtol=0, err_msg=name)
    _assert_grads_agree(fast[3], generic[3], 1e-11)


VARIANT_SIZE_CASES = {
    "softcap, causal bottom_right, lengths": dict(
        T=600, S=900, softcap=2.0, causal=True, align="bottom_right", kv_lengths=np.array([900, 401])
    ),
    "ALiBi, window, T != S": dict(T=700, S=1000, alibi=True, window=(150, 0), align="top_left"),
    "softcap + ALiBi, causal, dropout": dict(T=640, S=640, softcap=1.0, alibi=True, causal=True, dropout_p=0.1, seed=3),
    "ALiBi, causal bottom_right, q and kv lengths": dict(
        T=600,
        S=1100,
        alibi=True,
        causal=True,
        align="bottom_right",
        q_lengths=np.array([600, 300]),
        kv_lengths=np.array([1000, 700]),
    ),
}


@pytest.mark.parametrize("case", list(VARIANT_SIZE_CASES), ids=list(VARIANT_SIZE_CASES))
def test_variants_with_default_tiles_and_spans_equal_the_generic_path(case):
    """512-tiles cut into 128-row spans, as shipped, float64; ALiBi slopes
    from :func:`npattn.alibi_slopes` (per-batch offsets in the last case)."""
    options = dict(VARIANT_SIZE_CASES[case])
    T, S = options.pop("T"), options.pop("S")
    if options.pop("alibi", False):
        options["alibi_slopes"] = npattn.alibi_slopes(4)
    rng = np.random.default_rng(8)
    q, k, v = rng.standard_normal((2, 4, T, 8)), rng.standard_normal((2, 2, S, 8)), rng.standard_normal((2, 2, S, 4))
    spec = make_spec(q, k, v, impl="chunked", **options)
    plans = fast_numpy._plans(spec, tile_ranges(T, 512), tile_ranges(S, 512))
    assert any(len(plan) > 1 for row in plans for plan in row), "no tile was cut into spans"
    out, lse = fast_numpy.forward(spec, q, k, v)
    out_g, lse_g = chunked.chunked_forward(spec, q, k, v)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    grads = fast_numpy.backward(spec, q, k, v, out, lse, dout, dlse)
    grads_g = chunked.chunked_backward(spec, q, k, v, out_g, lse_g, dout, dlse)
    _assert_kernels_agree((out, lse, grads), (out_g, lse_g, grads_g))


def _random_real_size_call(seed):
    """A call drawn from ``seed`` at the shipped tile sizes (T and S from 1 to
    1100: 512-tiles, 128-row spans, diagonal blocks, groups of kv heads, GQA
    stacks and backward head parts), with any mix of causal or window (both
    alignments), lengths, segment ids, a mask, a bias, sinks, softcap, ALiBi,
    dropout and dlse; queries scaled by up to 40, past the zero reference's
    bound. ``(q, k, v, dout, dlse, options)`` in float64."""
    rng = np.random.default_rng(seed)
    B, K, G = int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.choice([1, 2, 3, 8]))
    N, T = K * G, int(rng.choice([1, 129, 384, 513, 700, 1100]))
    S = T if rng.random() < 0.6 else int(rng.choice([50, 300, 512, 600, 1100]))
    H, Hv = int(rng.choice([8, 16])), int(rng.choice([8, 4]))
    options: dict = {}
    if rng.random() < 0.4:
        options["causal"] = True
    elif rng.random() < 0.3:
        options["window"] = (int(rng.integers(0, 300)), int(rng.choice([0, 3, 100])))
    if rng.random() < 0.3:
        options["alibi_slopes"] = npattn.alibi_slopes(N) * float(rng.choice([1, -1, 10]))
    if T != S and options:
        options["align"] = str(rng.choice(["top_left", "bottom_right"]))
    if rng.random() < 0.3:
        options["kv_lengths"] = rng.integers(0, S + 1, size=B)
    if rng.random() < 0.2:
        options["q_lengths"] = rng.integers(0, T + 1, size=B)
    if T == S and rng.random() < 0.3:
        ids = np.sort(rng.integers(0, int(rng.integers(1, 6)), size=(B, T)), axis=1)
        options["q_segment_ids"] = options["kv_segment_ids"] = ids
    if rng.random() < 0.15:
        options["mask"] = rng.random((B, 1, T, S)) < 0.8
    if rng.random() < 0.15:
        options["bias"] = rng.standard_normal((1, N, T, S)) if rng.random() < 0.5 else rng.standard_normal((T, S))
    if rng.random() < 0.3:
        options["sinks"] = rng.standard_normal(N) * float(rng.choice([1, 10]))
    if rng.random() < 0.3:
        options["softcap"] = float(rng.choice([0.5, 5.0, 30.0]))
    if rng.random() < 0.15:
        options.update(dropout_p=0.3, seed=int(rng.integers(0, 100)))
    q = rng.standard_normal((B, N, T, H)) * float(rng.choice([1.0, 4.0, 40.0]))
    k, v = rng.standard_normal((B, K, S, H)), rng.standard_normal((B, K, S, Hv))
    dout = rng.standard_normal((B, N, T, Hv))
    dlse = rng.standard_normal((B, N, T)) if rng.random() < 0.3 else None
    return q, k, v, dout, dlse, options


@pytest.mark.parametrize("seed", range(32))
def test_random_real_size_calls_equal_the_generic_path(seed):
    """Calls drawn at the shipped tile sizes with every option and variant
    (:func:`_random_real_size_call`), through the public API: the fast path
    against ``NPATTN_FAST_NUMPY=0`` in float64, the same fully masked rows,
    and out, lse and every field of AttentionGrads to 1e-10 of their
    largest entry."""
    q, k, v, dout, dlse, options = _random_real_size_call(seed)
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        for switch in ("1", "0"):
            patch.setenv("NPATTN_FAST_NUMPY", switch)
            out, res = npattn.attention_forward(q, k, v, impl="chunked", **options)
            results[switch] = res.kernel, out, res.lse, npattn.attention_backward(dout, res, dlse=dlse)
    (kernel, *fast), (kernel_g, *generic) = results["1"], results["0"]
    assert (kernel, kernel_g) == ("numpy", "generic")
    np.testing.assert_array_equal(np.isneginf(fast[1]), np.isneginf(generic[1]))
    for name, a, b in (("out", fast[0], generic[0]), ("lse", fast[1], generic[1])):
        finite = np.isfinite(b)
        assert not np.isnan(a).any(), name
        scale = max(1.0, float(np.abs(b[finite]).max(initial=0.0)))
        np.testing.assert_allclose(a[finite], b[finite], atol=1e-10 * scale, rtol=0, err_msg=name)
    assert fast[2].dmods is None and generic[2].dmods is None  # no score modifications drawn
    _assert_grads_agree(fast[2], generic[2], 1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softcap", "alibi", "both"])
def test_variants_in_the_compute_dtype_match_float64(dtype, variant):
    """float32 (base 2, bounds, flushed exp) within the file's float32 tolerances."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 4, 300, 16)) for _ in range(4))
    options = dict(causal=True, block_q=128, block_k=64)
    if variant in ("softcap", "both"):
        options["softcap"] = 1.5
    if variant in ("alibi", "both"):
        options["alibi_slopes"] = npattn.alibi_slopes(4)
    narrow = [a.astype(dtype) for a in (q, k, v, dout)]
    spec = make_spec(*narrow[:3], impl="chunked", **options)
    out, lse = fast_numpy.forward(spec, *narrow[:3])
    grads = fast_numpy.backward(spec, *narrow[:3], out, lse, narrow[3], None)
    wide = make_spec(q, k, v, impl="chunked", **options)
    out_w, lse_w = chunked.chunked_forward(wide, q, k, v)
    grads_w = chunked.chunked_backward(wide, q, k, v, out_w, lse_w, dout, None)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads[:3]), (out_w, lse_w, *grads_w[:3])):
        assert got.dtype == dtype, name
        np.testing.assert_allclose(got, want, err_msg=name, **tol)
    if "alibi_slopes" in options:
        want = grads_w[4]["alibi_slopes"]
        np.testing.assert_allclose(grads[4]["alibi_slopes"], want, rtol=0, atol=tol["atol"] * np.abs(want).max())


def test_alibi_slope_gradients_are_bit_identical_whatever_the_thread_count(monkeypatch):
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 330, 32)).astype(np.float32) for _ in range(2))
    slopes = npattn.alibi_slopes(4, dtype=np.float32)
    spec = make_spec(
        q, k, v, causal=True, align="bottom_right", softcap=3.0, alibi_slopes=slopes, block_q=128, block_k=64
    )
    dout = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
    results = []
    for threads in ("1", "2"):
        monkeypatch.setenv("NPATTN_NUM_THREADS", threads)
        out, lse = fast_numpy.forward(spec, q, k, v)
        dq, dk, dv, _, params = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
        results.append((out, lse, dq, dk, dv, params["alibi_slopes"]))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "options",
    [
        dict(softcap=0.8),
        dict(alibi_slopes=np.array([0.7, 0.2]), align="bottom_right"),
        dict(softcap=1.2, alibi_slopes=np.array([[0.3, 0.9], [0.5, 0.1]]), causal=True, align="top_left"),
    ],
    ids=["softcap", "ALiBi", "softcap + per-batch ALiBi, causal"],
)
def test_fast_path_gradients_match_central_differences(options):
    """npattn.check_gradients on the fast path itself (``impl="chunked"`` on
    NumPy, asserted), slopes included, with blocks that do not divide."""
    rng = np.random.default_rng(12)
    q, k, v = rng.standard_normal((2, 2, 5, 3)), rng.standard_normal((2, 2, 7, 3)), rng.standard_normal((2, 2, 7, 2))
    options = dict(options, impl="chunked", block_q=2, block_k=3)
    slopes = options.pop("alibi_slopes", None)
    inputs, names = [q, k, v], ["q", "k", "v"]
    if slopes is not None:
        inputs, names = inputs + [slopes], names + ["alibi_slopes"]

    def forward(q, k, v, slopes=None):
        extra = {} if slopes is None else {"alibi_slopes": slopes}
        out, res = npattn.attention_forward(q, k, v, **options, **extra)
        assert res.kernel == "numpy"
        return (out, res.lse), res

    def backward(cotangents, res):
        g = npattn.attention_backward(cotangents[0], res, dlse=cotangents[1])
        return (g.dq, g.dk, g.dv) + ((g.dalibi_slopes,) if slopes is not None else ())

    assert npattn.check_gradients(forward, backward, inputs, names=names).ok


def test_modes_of_each_variant():
    """Which tricks each variant keeps (see the module docstring): a softcap
    keeps base 2, the upper bound and the zero reference but not the fused
    shifts; ALiBi keeps the upper bound (slopes >= 0), and base 2, the fused
    shifts and the zero reference only where every row sees the key at its
    own position (else its shift may lie far below 0: see
    test_fast_accuracy.py); a bias keeps none. The fourth entry is
    ``maxima_near_zero``, which the zero reference needs."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 8, 4))

    def mode(**options):
        spec = make_spec(q, q, q, impl="chunked", **options)
        m = fast_numpy._Mode(spec, fast_numpy._row_norms(q), fast_numpy._row_norms(q))
        return m.base2, m.fused, m.upper, m.maxima_near_zero

    assert mode() == (True, True, True, True)
    assert mode(softcap=2.0) == (True, False, True, True)
    slopes = np.array([0.5, 0.0])
    assert mode(alibi_slopes=slopes) == (True, True, True, True)
    assert mode(alibi_slopes=slopes, causal=True, window=(3, 0)) == (True, True, True, True)
    assert mode(alibi_slopes=slopes, kv_lengths=np.array([5])) == (False, False, True, False)  # rows 5-7 past the keys
    assert mode(alibi_slopes=slopes, mask=np.eye(8, dtype=bool)) == (False, False, True, False)  # may hide p_i
    assert mode(alibi_slopes=np.array([0.5, -0.1])) == (False, False, False, False)  # the term grows with the distance
    assert mode(bias=np.zeros((8, 8))) == (False, False, False, False)
    # Slopes large enough that |m| * |p - j| could reach the fused-shift limit: base e, no fused shifts.
    limit = fast_numpy._fused_shift_limit(np.float64)
    assert mode(alibi_slopes=np.array([limit, 0.0]))[:2] == (False, False)


def test_softcap_with_scores_that_move_the_row_maximum_equals_the_generic_path():
    """Raw products up to ~60 with a cap of 100: rows rescale, so a shift
    fused into the GEMM would enter tanh (why a softcap unfuses them)."""
    rng = np.random.default_rng(1)
    q = _unit_rows(rng.standard_normal((1, 2, 64, 8))) * 8.0
    k = _unit_rows(rng.standard_normal((1, 2, 64, 8))) * np.sqrt(8) * np.linspace(0.1, 8.0, 64)[:, None]
    v = rng.standard_normal((1, 2, 64, 4))
    case = type("Case", (), {"arrays": (q, k, v), "options": {}})()
    blocks = dict(softcap=100.0, block_q=16, block_k=16)
    _assert_kernels_agree(
        _run(fast_numpy.forward, fast_numpy.backward, case, **blocks),
        _run(chunked.chunked_forward, chunked.chunked_backward, case, **blocks),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_alibi_rows_that_see_only_far_keys_keep_their_weight(dtype):
    """top_left, T=200 queries against S=64 keys: rows past ~70 see only keys
    at distance > 70, whose ALiBi scores lie far below the flush floor. Small
    |q_i| |k_j| bound the raw products within the threshold, but ALiBi has no
    lower bound, so these rows must not start at the reference maximum 0 (they
    would be flushed to nothing)."""
    rng = np.random.default_rng(2)
    q = _unit_rows(rng.standard_normal((1, 1, 200, 8)))
    k = _unit_rows(rng.standard_normal((1, 1, 64, 8)))
    v = rng.standard_normal((1, 1, 64, 4))
    slopes = np.array([1.0 if dtype == np.float32 else 8.0])
    options = dict(alibi_slopes=slopes, align="top_left", block_q=256, block_k=64)
    narrow = [a.astype(dtype) for a in (q, k, v)]
    spec = make_spec(*narrow, impl="chunked", **options)
    out, lse = fast_numpy.forward(spec, *narrow)
    wide = make_spec(q, k, v, impl="chunked", **options)
    out_w, lse_w = chunked.chunked_forward(wide, q, k, v)
    assert np.all(np.isfinite(lse))
    np.testing.assert_allclose(lse, lse_w, rtol=1e-5)
    np.testing.assert_allclose(out, out_w, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_negative_alibi_slopes_lose_the_upper_bound(dtype):
    """Slopes < 0 make far keys score up to |m| * 63 above the raw products
    (float32: past exp's range), which the Cauchy-Schwarz bound alone does
    not see: rows must still rescale."""
    rng = np.random.default_rng(3)
    q, k = (_unit_rows(rng.standard_normal((1, 2, 64, 8))) for _ in range(2))
    v = rng.standard_normal((1, 2, 64, 4))
    slopes = np.array([-3.0, -0.5]) * (1.0 if dtype == np.float32 else 20.0)
    options = dict(alibi_slopes=slopes, block_q=16, block_k=16)
    narrow = [a.astype(dtype) for a in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an overflow in exp is a RuntimeWarning
        spec = make_spec(*narrow, impl="chunked", **options)
        out, lse = fast_numpy.forward(spec, *narrow)
        grads = fast_numpy.backward(spec, *narrow, out, lse, np.ones_like(out), None)
    wide = make_spec(q, k, v, impl="chunked", **options)
    out_w, lse_w = chunked.chunked_forward(wide, q, k, v)
    grads_w = chunked.chunked_backward(wide, q, k, v, out_w, lse_w, np.ones_like(out_w), None)
    np.testing.assert_allclose(lse, lse_w, rtol=1e-5)
    np.testing.assert_allclose(out, out_w, rtol=2e-3, atol=2e-3)
    for got, want in zip(grads[:3], grads_w[:3]):
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_alibi_scores_below_the_flush_floor_send_no_subnormal_into_a_matrix_product(monkeypatch):
    """Unit q and k (the bound allows a plain exp without ALiBi), slope 1 over
    96 keys: scores reach -95 nats, where float32 exp is subnormal. ALiBi has
    no lower bound, so the flushed exp must run."""
    rng = np.random.default_rng(4)
    q, k = (_unit_rows(rng.standard_normal((1, 2, 96, 16))).astype(np.float32) for _ in range(2))
    v, dout = (rng.standard_normal((1, 2, 96, 16)).astype(np.float32) for _ in range(2))
    subnormal_operands = _count_subnormal_matmul_operands(monkeypatch)
    spec = make_spec(q, k, v, impl="chunked", alibi_slopes=np.array([1.0, 1.0]), block_q=32, block_k=32)
    out, lse = fast_numpy.forward(spec, q, k, v)
    fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
    monkeypatch.undo()
    assert subnormal_operands and max(subnormal_operands) == 0


def _computed_tile_pairs(spec, block):
    """(query tile, key tile) pairs the fast path runs, and the score entries
    it computes per item, from its plans."""
    plans = fast_numpy._plans(spec, tile_ranges(spec.q_len, block), tile_ranges(spec.kv_len, block))
    pairs = sum(1 for row in plans for plan in row if plan)
    area = sum((p1 - p0) * (c1 - c0) for row in plans for plan in row for p0, p1, c0, c1, _ in plan)
    return pairs, area


def test_batch_elements_packed_differently_each_skip_their_own_cross_document_tiles(monkeypatch):
    """Two batch elements with their documents in other places (4 of 256 and
    2 of 512 in T = S = 1024, causal, 256-tiles): each computes the spans of
    its own documents alone, where one plan for both would compute every
    tile that either element's documents reach; the numbers are the generic
    path's, backward included, in float64."""
    T, block = 1024, 256
    ids = np.stack([np.repeat(np.arange(4), 256), np.repeat(np.arange(2), 512)])  # (B, T), B = 2
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal((2, 2, T, 8)) for _ in range(4))
    options = dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids, block_q=block, block_k=block)
    spec = make_spec(q, k, v, impl="chunked", **options)
    plans = fast_numpy._batch_plans(spec, tile_ranges(T, block), tile_ranges(T, block))
    pairs = [sum(1 for row in element for plan in row if plan) for element in plans]
    assert pairs == [4, 2 * 3]  # each document's diagonal tiles, and the tile below them in documents of 2 tiles
    shared = fast_numpy._plans(spec, tile_ranges(T, block), tile_ranges(T, block))
    assert sum(1 for row in shared for plan in row if plan) == 6, "a plan for both covers either's tiles"
    areas = [sum((p1 - p0) * (c1 - c0) for row in el for plan in row for p0, p1, c0, c1, _ in plan) for el in plans]
    computed = _count_computed_scores(monkeypatch)
    forward = fast_numpy.forward(spec, q, k, v)
    assert sum(computed) == 2 * sum(areas)  # two heads
    _assert_fast_equals_generic(spec, q, k, v, dout, forward)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_packed_documents_skip_the_cross_document_tiles(monkeypatch, causal):
    """4 documents of 1024 in T = S = 4096 with 512-tiles: each document
    covers 2 x 2 tiles, so 16 of the 64 pairs run (causal: 12 of 36), and the
    forward computes exactly the plans' entries."""
    T, block = 4096, 512
    x = np.zeros((1, 1, T, 4), dtype=np.float32)
    ids = np.repeat(np.arange(4), 1024)[None]  # (B, T), B = 1
    plain = make_spec(x, x, x, impl="chunked", causal=causal)
    packed = make_spec(x, x, x, impl="chunked", causal=causal, q_segment_ids=ids, kv_segment_ids=ids)
    plain_pairs, plain_area = _computed_tile_pairs(plain, block)
    pairs, area = _computed_tile_pairs(packed, block)
    assert (plain_pairs, pairs) == ((36, 12) if causal else (64, 16))
    # Causal: per document two diagonal tiles (10/16 of their area, see above) and one whole.
    tile = block * block
    assert area == (4 * (tile * 20 // 16 + tile) if causal else 4 * 4 * tile)
    assert plain_area == (tile * 80 // 16 + 28 * tile if causal else 64 * tile)  # area: 9/33 (causal), 1/4
    computed = _count_computed_scores(monkeypatch)
    fast_numpy.forward(packed, x, x, x)
    assert sum(computed) == area


def _assert_causal_alibi_matches_generic(monkeypatch, arrays, slopes, dtype, tolerance):
    """Causal ALiBi in 32-tiles: the fast path in ``dtype`` (under the
    caller's monkeypatches, undone after it) against the generic chunked path
    in float64, for out, lse, dq, dk, dv and dalibi_slopes. ``arrays``:
    float64 ``(q, k, v, dout, dlse)``, ``dlse`` may be None."""
    q, k, v, dout, dlse = arrays
    options = dict(alibi_slopes=slopes, causal=True, block_q=32, block_k=32)
    narrow = [a.astype(dtype) for a in (q, k, v)]
    spec = make_spec(*narrow, impl="chunked", **options)
    out, lse = fast_numpy.forward(spec, *narrow)
    grads = fast_numpy.backward(
        spec, *narrow, out, lse, dout.astype(dtype), None if dlse is None else dlse.astype(dtype)
    )
    monkeypatch.undo()
    wide = make_spec(q, k, v, impl="chunked", **options)
    out_w, lse_w = chunked.chunked_forward(wide, q, k, v)
    grads_w = chunked.chunked_backward(wide, q, k, v, out_w, lse_w, dout, dlse)
    np.testing.assert_allclose(out, out_w, **tolerance)
    np.testing.assert_allclose(lse, lse_w, **tolerance)
    for got, want in zip([*grads[:3], grads[4]["alibi_slopes"]], [*grads_w[:3], grads_w[4]["alibi_slopes"]]):
        np.testing.assert_allclose(got, want, rtol=tolerance["rtol"], atol=tolerance["atol"] * np.abs(want).max())


@pytest.mark.parametrize(("dtype", "steep"), [(np.float64, 64.0), (np.float32, 4.0)])
def test_steep_alibi_spans_below_the_flush_floor_are_skipped_with_the_same_numbers(monkeypatch, dtype, steep):
    """Far from the diagonal a steep head's every probability is below the
    flush floor (exactly 0 on the fast path), so those spans are skipped in
    both passes: fewer score tiles, and the same numbers as the generic path
    (which computes them) for out, lse and every gradient, dalibi_slopes too.
    A zero slope skips nothing."""
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 2, 256, 8)) for _ in range(4))
    dlse = rng.standard_normal((1, 2, 256))
    calls = []
    real_scores = fast_numpy._Item.scores

    def counted(self, *args, **kwargs):
        calls.append(self.kv_slice.start)  # one kv head per item with ALiBi
        return real_scores(self, *args, **kwargs)

    def run(slopes):
        calls.clear()
        monkeypatch.setattr(fast_numpy._Item, "scores", counted)
        tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-3, atol=2e-3)
        _assert_causal_alibi_matches_generic(monkeypatch, (q, k, v, dout, dlse), slopes, dtype, tolerance)
        return calls.count(0), calls.count(1)

    steep_head, flat_head = run(np.array([steep, 0.0]))
    assert steep_head < flat_head / 2  # the steep head's far spans were skipped, the flat head's not
    assert run(np.array([0.0, 0.0]))[0] == flat_head


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_flat_alibi_spans_keep_a_lower_bound_and_take_the_plain_exp(monkeypatch, dtype):
    """ALiBi has no lower bound over a call, but has one per span: the raw
    bound less ``max m_n`` times the span's largest distance. Unit q and k
    with a flat slope keep every score of every span far above the flush
    floor, so neither pass runs the flushed exp (nor a forward row-max pass
    for the first keys); a steep slope over the same keys needs it. Both
    give the generic path's numbers, dalibi_slopes too."""
    rng = np.random.default_rng(6)
    q, k = (_unit_rows(rng.standard_normal((1, 2, 256, 8))) for _ in range(2))
    v, dout = (rng.standard_normal((1, 2, 256, 4)) for _ in range(2))
    flushed = []
    real_flushed = fast_numpy._Exp.flushed

    def counting_flushed(self, s):
        flushed.append(s.size)
        return real_flushed(self, s)

    def run(slopes):
        flushed.clear()
        monkeypatch.setattr(fast_numpy._Exp, "flushed", counting_flushed)
        tolerance = dict(rtol=1e-12, atol=1e-12) if dtype == np.float64 else dict(rtol=2e-4, atol=2e-5)
        _assert_causal_alibi_matches_generic(monkeypatch, (q, k, v, dout, None), slopes, dtype, tolerance)
        return len(flushed)

    assert run(np.array([1e-3, 2e-3])) == 0
    assert run(np.array([1.0, 4.0])) > 0  # 4 x 255 keys: 1470 below the raw bound in base 2, past float64's floor


LENGTHS = np.array([300, 131])


@pytest.mark.parametrize(
    ("options", "far_spans"),
    [
        ({}, True),
        ({"causal": True}, True),
        ({"window": (40, 7)}, False),
        ({"q_lengths": LENGTHS, "kv_lengths": LENGTHS}, True),
    ],
    ids=["full", "causal", "window", "padded self-attention"],
)
def test_alibi_where_each_row_sees_its_own_key_runs_at_the_zero_reference(monkeypatch, options, far_spans):
    """ALiBi with slopes >= 0 only lowers scores, and is 0 at each row's own
    key: where every row sees that key (self-attention, a window around it,
    a padded batch with ``q_lengths = kv_lengths``) each row's maximum lies
    within the raw bound of 0, and the forward keeps the zero reference, no
    running maximum. A steep head's far spans take the flushed exp or are
    skipped (fewer score tiles than a flat head's), and out, lse and every
    gradient, the slopes' too, are the generic path's in float64."""
    rng = np.random.default_rng(11)
    q, k, v, dout = (rng.standard_normal((2, 4, 300, 16)) for _ in range(4))
    slopes = np.array([32.0, 0.5, 0.05, 0.0])  # 32: float64's flush floor (2**-1000) 22 keys away
    options = dict(options, alibi_slopes=slopes, block_q=64, block_k=64)
    loops, heads = [], []

    def count_calls(name):
        real = getattr(fast_numpy._Forward, name)

        def loop(self, *args):
            loops.append(name)
            return real(self, *args)

        monkeypatch.setattr(fast_numpy._Forward, name, loop)

    count_calls("_spans_at_zero_reference")
    count_calls("_spans_with_running_max")
    real_scores = fast_numpy._Item.scores

    def scores(self, *args, **kwargs):
        heads.append(self.kv_slice.start)  # one kv head per item: the keys span several key tiles
        return real_scores(self, *args, **kwargs)

    monkeypatch.setattr(fast_numpy._Item, "scores", scores)
    spec = make_spec(q, k, v, impl="chunked", **options)
    out, lse = fast_numpy.forward(spec, q, k, v)
    grads = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)
    assert set(loops) == {"_spans_at_zero_reference"}
    if far_spans:  # the steep head skips them in both passes; a window of 40 has none
        assert heads.count(0) < heads.count(3)
    else:
        assert heads.count(0) == heads.count(3)
    out_g, lse_g = chunked.chunked_forward(spec, q, k, v)
    grads_g = chunked.chunked_backward(spec, q, k, v, out_g, lse_g, dout, None)
    finite = np.isfinite(lse_g)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], lse_g[finite], atol=1e-12, rtol=0)
    np.testing.assert_allclose(out, out_g, atol=1e-12, rtol=0)
    for got, want in zip([*grads[:3], grads[4]["alibi_slopes"]], [*grads_g[:3], grads_g[4]["alibi_slopes"]]):
        np.testing.assert_allclose(got, want, atol=1e-12 * max(1.0, np.abs(want).max()), rtol=0)
