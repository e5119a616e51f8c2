"""npattn.distributed.plan without MPI: every ring step's spec, built on
global indices, sees exactly its block of the full sequence's visibility,
ALiBi distances and dropout keep mask, and a step is skipped only where that
block is hidden throughout. (The MPI tests in test_distributed.py check the
results themselves against single-process attention.)"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npattn.distributed.plan import RingLayout, RingPlan
from npattn.dropout import keep_tile
from npattn.namespace import resolve_namespace
from npattn.options import make_spec
from npattn.scores.alibi import alibi_distance
from npattn.scores.visibility import visible_tile

XP = resolve_namespace({"x": np.zeros(1)})
B, N = 2, 2


def _dense(spec, T, S) -> np.ndarray:
    """The spec's visibility over ``(B, N, T, S)``."""
    visible = visible_tile(spec, 0, T, 0, S)
    return np.ones((B, N, T, S), bool) if visible is None else np.broadcast_to(np.asarray(visible), (B, N, T, S))


@st.composite
def rings(draw):
    P = draw(st.integers(1, 4))
    q_shards = draw(st.lists(st.integers(0, 4), min_size=P, max_size=P))
    kv_shards = draw(st.lists(st.integers(1, 4), min_size=P, max_size=P))
    T, S = sum(q_shards), sum(kv_shards)
    causal = draw(st.booleans())
    window = draw(st.sampled_from([None, (1, 0), (2, None), (None, 1)])) if not causal else None
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    options = dict(causal=causal, window=window, align=align)
    if draw(st.booleans()):
        options["q_lengths"] = np.array(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    if draw(st.booleans()):
        options["kv_lengths"] = np.array(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
    if draw(st.booleans()):

        def ids(n: int) -> np.ndarray:  # (B, n) sorted document ids
            values = draw(st.lists(st.integers(0, 3), min_size=B * n, max_size=B * n))
            return np.sort(np.array(values, dtype=np.int64).reshape(B, n), axis=1)

        options.update(q_segment_ids=ids(T), kv_segment_ids=ids(S))
    if draw(st.booleans()):
        options["alibi_slopes"] = np.array([0.5, 0.25])
    order = draw(st.permutations(range(P)))
    return q_shards, kv_shards, order, options


def _starts(lengths, order):
    starts, position = [0] * len(lengths), 0
    for r in order:
        starts[r], position = position, position + lengths[r]
    return tuple(starts)


def _plan(r, q_shards, kv_shards, order, options, full) -> RingPlan:
    """Rank ``r``'s plan, as plan_ring would agree it (the offset from the full spec)."""
    q_offset = (
        full.q_offset if (full.window_left, full.window_right) != (None, None) or full.alibi_slopes is not None else 0
    )
    layout = RingLayout(
        r,
        len(q_shards),
        tuple(q_shards),
        tuple(kv_shards),
        _starts(q_shards, order),
        _starts(kv_shards, order),
        np.asarray(q_offset) if hasattr(q_offset, "shape") else q_offset,
    )
    q_ids = options.get("q_segment_ids")
    kv_ids = options.get("kv_segment_ids")
    rows = slice(layout.q_starts[r], layout.q_starts[r] + q_shards[r])
    return RingPlan(
        layout=layout,
        xp=XP,
        device=None,
        batch_shape=(B,),
        window=(full.window_left, full.window_right),
        scale=None,
        impl="auto",
        block_q=None,
        block_k=None,
        dropout_p=0.5,
        seed=11,
        softcap=None,
        alibi_slopes=options.get("alibi_slopes"),
        sinks=None,
        q_lengths=options.get("q_lengths"),
        kv_lengths=options.get("kv_lengths"),
        q_segment_ids=None if q_ids is None else q_ids[:, rows],
        kv_segment_ids=None
        if kv_ids is None
        else tuple(kv_ids[:, s0 : s0 + n] for s0, n in zip(layout.kv_starts, kv_shards)),
        bias_layout=None,
        bias_shape=None,
    )


@settings(max_examples=60, deadline=None)
@given(rings())
def test_every_step_sees_its_block_of_the_full_sequence(ring):
    q_shards, kv_shards, order, options = ring
    T, S = sum(q_shards), sum(kv_shards)
    q, k = np.zeros((B, N, T, 1)), np.zeros((B, N, S, 1))
    full = make_spec(q, k, k, dropout_p=0.5, seed=11, **options)
    visible = _dense(full, T, S)  # (B, N, T, S)
    keep = np.asarray(keep_tile(full, 0, T, 0, S))
    for r in range(len(q_shards)):
        plan = _plan(r, q_shards, kv_shards, order, options, full)
        rows = slice(plan.layout.q_starts[r], plan.layout.q_starts[r] + q_shards[r])
        for s in range(len(kv_shards)):
            cols = slice(plan.layout.kv_starts[s], plan.layout.kv_starts[s] + kv_shards[s])
            block = visible[..., rows, cols]
            spec = plan.pair_spec(q[..., rows, :], k[..., cols, :], k[..., cols, :], s, None)
            if spec is None:
                assert not block.any(), f"step ({r}, {s}) skipped but sees {block.sum()} keys"
                continue
            np.testing.assert_array_equal(_dense(spec, q_shards[r], kv_shards[s]), block)
            np.testing.assert_array_equal(
                np.asarray(keep_tile(spec, 0, q_shards[r], 0, kv_shards[s])), keep[..., rows, cols]
            )
            if "alibi_slopes" in options:
                want = np.broadcast_to(np.asarray(alibi_distance(full, 0, T, 0, S)), (B, 1, T, S))[..., rows, cols]
                got = np.broadcast_to(np.asarray(alibi_distance(spec, 0, q_shards[r], 0, kv_shards[s])), want.shape)
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("documents_per_rank", [1, 2])
def test_packed_documents_aligned_to_shards_skip_every_step_they_cannot_meet(documents_per_rank):
    """Four ranks of 4 tokens; documents never cross a shard boundary: each
    rank computes only its own step."""
    P, n = 4, 4
    ids = np.repeat(np.arange(P * documents_per_rank), n // documents_per_rank)[None].repeat(B, 0)  # (B, 16)
    options = {"q_segment_ids": ids, "kv_segment_ids": ids}
    q = np.zeros((B, N, P * n, 1))
    full = make_spec(q, q, q, **options)
    for r in range(P):
        plan = _plan(r, [n] * P, [n] * P, list(range(P)), options, full)
        shard = q[..., r * n : (r + 1) * n, :]
        computed = [s for s in range(P) if plan.pair_spec(shard, shard, shard, s, None) is not None]
        assert computed == [r]
