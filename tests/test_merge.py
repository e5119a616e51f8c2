"""npattn.merge: merging partial attention results over disjoint key sets.

- attention over concatenated keys == merge of attention over the pieces
  (out and lse), on every backend, with GQA, masks that hide whole pieces
  from some rows (-inf parts) and rows no key is visible to;
- gradients compose: the full attention backward equals the merge backward
  followed by each piece's attention backward (dq summed, dk/dv concatenated);
- central differences (npattn.check_gradients, full Jacobian) of
  merge_partials itself, with -inf parts and all -inf rows;
- an independent float64 oracle (np.logaddexp) for the forward;
- attention sinks: on exactly one piece, or as one extra piece (0, sinks),
  out, lse and every gradient (dsinks too) equal single-call attention;
- fully masked rows: 0 / -inf / zero gradients, no NaN, no warnings;
- dtypes, bad input.
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import npattn
from npattn.merge import MergeResiduals, merge_partials, merge_partials_backward

TOL = dict(rtol=1e-12, atol=1e-12)


def _split_points(draw, S):
    """Sorted cut points splitting ``range(S)`` into 1..4 non-empty pieces."""
    cuts = draw(st.sets(st.integers(1, S - 1), max_size=min(3, S - 1))) if S > 1 else set()
    return [0, *sorted(cuts), S]


@st.composite
def split_problems(draw):
    """``(q, k, v, mask, edges)``: a float64 attention problem, a bool mask
    (possibly hiding whole pieces from some rows, or every key from a row)
    and the key-axis cut points."""
    K = draw(st.sampled_from([1, 2]))
    N = K * draw(st.sampled_from([1, 2]))
    T, S = draw(st.integers(1, 5)), draw(st.integers(1, 9))
    H, Hv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((2, N, T, H))
    k = rng.standard_normal((2, K, S, H))
    v = rng.standard_normal((2, K, S, Hv))
    mask = None
    if draw(st.booleans()):
        mask = rng.random((2, N, T, S)) < draw(st.sampled_from([0.2, 0.5, 0.9]))
        mask[0, 0, 0, :] = False  # one row sees no key at all
    return q, k, v, mask, _split_points(draw, S)


def _piece_forward(q, k, v, mask, edges):
    """Attention of q over each key piece: lists of (out, residuals)."""
    pieces = []
    for k0, k1 in itertools.pairwise(edges):
        piece_mask = None if mask is None else mask[..., k0:k1]
        pieces.append(npattn.attention_forward(q, k[..., k0:k1, :], v[..., k0:k1, :], mask=piece_mask, impl="dense"))
    return pieces


@settings(max_examples=25)
@given(problem=split_problems())
def test_concatenated_keys_equal_merged_pieces(backend, problem):
    q, k, v, mask, edges = (backend.asarray(a) if isinstance(a, np.ndarray) else a for a in problem)
    full_out, full_res = npattn.attention_forward(q, k, v, mask=mask, impl="dense")
    pieces = _piece_forward(q, k, v, mask, edges)
    out, lse, _ = merge_partials([o for o, _ in pieces], [r.lse for _, r in pieces])
    out_np, lse_np = backend.to_numpy(out), backend.to_numpy(lse)
    np.testing.assert_allclose(out_np, backend.to_numpy(full_out), **TOL)
    full_lse = backend.to_numpy(full_res.lse)
    np.testing.assert_array_equal(np.isneginf(lse_np), np.isneginf(full_lse))
    finite = np.isfinite(full_lse)
    np.testing.assert_allclose(lse_np[finite], full_lse[finite], **TOL)
    assert not np.isnan(out_np).any()


@settings(max_examples=25)
@given(problem=split_problems(), with_dlse=st.booleans())
def test_gradients_compose_with_piece_backward(problem, with_dlse):
    """d(full attention) == merge backward, then each piece's attention backward."""
    q, k, v, mask, edges = problem
    rng = np.random.default_rng(0)
    full_out, full_res = npattn.attention_forward(q, k, v, mask=mask, impl="dense")
    dout = rng.standard_normal(full_out.shape)
    dlse = np.where(np.isfinite(full_res.lse), rng.standard_normal(full_res.lse.shape), 0.0) if with_dlse else None
    expected = npattn.attention_backward(dout, full_res, dlse=dlse)

    pieces = _piece_forward(q, k, v, mask, edges)
    _, _, merge_res = merge_partials([o for o, _ in pieces], [r.lse for _, r in pieces])
    douts, dlses = merge_partials_backward(dout, dlse, merge_res)
    grads = [npattn.attention_backward(do, r, dlse=dl) for do, dl, (_, r) in zip(douts, dlses, pieces)]
    np.testing.assert_allclose(sum(g.dq for g in grads), expected.dq, **TOL)
    np.testing.assert_allclose(np.concatenate([g.dk for g in grads], axis=-2), expected.dk, **TOL)
    np.testing.assert_allclose(np.concatenate([g.dv for g in grads], axis=-2), expected.dv, **TOL)


@st.composite
def sink_problems(draw):
    """A split problem with sinks ((N,) or per batch (2, N)), optional
    q_lengths (padded rows get no sink) and the piece that gets the sinks."""
    q, k, v, mask, edges = draw(split_problems())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    N, T = q.shape[1], q.shape[2]
    sinks = rng.standard_normal((N,) if draw(st.booleans()) else (2, N)) * 2
    q_lengths = rng.integers(0, T + 1, size=2) if draw(st.booleans()) else None
    holder = draw(st.integers(0, len(edges) - 2))
    return q, k, v, mask, edges, sinks, q_lengths, holder


def _sink_pieces(q, k, v, mask, edges, q_lengths, sinks_of):
    """Attention of q over each key piece, piece ``i`` with ``sinks=sinks_of(i)``."""
    pieces = []
    for i, (k0, k1) in enumerate(itertools.pairwise(edges)):
        piece_mask = None if mask is None else mask[..., k0:k1]
        options = dict(mask=piece_mask, q_lengths=q_lengths, sinks=sinks_of(i), impl="dense")
        pieces.append(npattn.attention_forward(q, k[..., k0:k1, :], v[..., k0:k1, :], **options))
    return pieces


def _check_sink_merge(pieces, full_out, full_res, expected, dout, dlse, extra=None):
    """Merge the pieces (and the ``extra`` (out, lse) piece), compare out and
    lse with single-call attention, then the merge backward and each piece's
    attention backward with its gradients; returns the pieces' grads and the
    extra piece's dlse."""
    outs = [o for o, _ in pieces] + ([] if extra is None else [extra[0]])
    lses = [r.lse for _, r in pieces] + ([] if extra is None else [extra[1]])
    out, lse, merge_res = merge_partials(outs, lses)
    np.testing.assert_allclose(out, full_out, **TOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(full_res.lse))
    finite = np.isfinite(full_res.lse)
    np.testing.assert_allclose(lse[finite], full_res.lse[finite], **TOL)
    douts, dlses = merge_partials_backward(dout, dlse, merge_res)
    grads = [npattn.attention_backward(do, r, dlse=dl) for do, dl, (_, r) in zip(douts, dlses, pieces)]
    np.testing.assert_allclose(sum(g.dq for g in grads), expected.dq, **TOL)
    np.testing.assert_allclose(np.concatenate([g.dk for g in grads], axis=-2), expected.dk, **TOL)
    np.testing.assert_allclose(np.concatenate([g.dv for g in grads], axis=-2), expected.dv, **TOL)
    return grads, None if extra is None else dlses[-1]


@settings(max_examples=30, deadline=None)
@given(problem=sink_problems(), with_dlse=st.booleans())
def test_sinks_merge_exactly_through_one_piece(problem, with_dlse):
    """Sinks on exactly one piece (any one), or as one extra piece (0, sinks):
    out, lse and every gradient, dsinks included, equal single-call attention
    with sinks to 1e-12 in float64; masks hiding whole pieces or rows, padded
    query rows and per-batch sinks included."""
    q, k, v, mask, edges, sinks, q_lengths, holder = problem
    rng = np.random.default_rng(1)
    full_out, full_res = npattn.attention_forward(q, k, v, mask=mask, q_lengths=q_lengths, sinks=sinks, impl="dense")
    dout = rng.standard_normal(full_out.shape)
    dlse = np.where(np.isfinite(full_res.lse), rng.standard_normal(full_res.lse.shape), 0.0) if with_dlse else None
    expected = npattn.attention_backward(dout, full_res, dlse=dlse)

    # 1. sinks= on piece `holder` only: its backward returns dsinks
    pieces = _sink_pieces(q, k, v, mask, edges, q_lengths, lambda i: sinks if i == holder else None)
    grads, _ = _check_sink_merge(pieces, full_out, full_res, expected, dout, dlse)
    np.testing.assert_allclose(grads[holder].dsinks, expected.dsinks, **TOL)
    assert grads[holder].dsinks.shape == sinks.shape
    assert all(g.dsinks is None for i, g in enumerate(grads) if i != holder)

    # 2. sink-free pieces, plus the piece (out 0, lse sinks); -inf on padded rows
    pieces = _sink_pieces(q, k, v, mask, edges, q_lengths, lambda i: None)
    sink_lse = np.broadcast_to(sinks[..., None], full_res.lse.shape)  # (N, 1) or (2, N, 1) -> (2, N, T)
    if q_lengths is not None:
        padded = np.arange(q.shape[2]) >= q_lengths[:, None, None]  # (2, 1, T)
        sink_lse = np.where(padded, -np.inf, sink_lse)
    extra = (np.zeros_like(full_out), sink_lse)
    _, dlse_sink = _check_sink_merge(pieces, full_out, full_res, expected, dout, dlse, extra)
    dsinks = dlse_sink.sum(axis=-1)  # (2, N): summed over rows
    dsinks = dsinks.sum(axis=0) if sinks.ndim == 1 else dsinks  # and over the batch for (N,) sinks
    np.testing.assert_allclose(dsinks, expected.dsinks, **TOL)


def test_sinks_on_two_pieces_count_twice():
    """The documented pitfall: a sink on every piece is not the sink once."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 4))
    sinks = np.array([1.0, 2.0])
    full, _ = npattn.attention_forward(q, k, v, sinks=sinks)
    pieces = [npattn.attention_forward(q, k[:, a:b], v[:, a:b], sinks=sinks) for a, b in ((0, 3), (3, 6))]
    out, _, _ = merge_partials([o for o, _ in pieces], [r.lse for _, r in pieces])
    assert not np.allclose(out, full)
    once = [
        npattn.attention_forward(q, k[:, a:b], v[:, a:b], sinks=s) for (a, b), s in (((0, 3), sinks), ((3, 6), None))
    ]
    out, _, _ = merge_partials([o for o, _ in once], [r.lse for _, r in once])
    np.testing.assert_allclose(out, full, **TOL)


def _merge_pair(P):
    """merge_partials as a (forward, backward) pair over ``outs + lses``."""

    def forward(*parts):
        out, lse, res = merge_partials(list(parts[:P]), list(parts[P:]))
        return (out, lse), res

    def backward(cotangents, res):
        douts, dlses = merge_partials_backward(*cotangents, res)
        return (*douts, *dlses)

    return forward, backward


def _parts_with_neginf(P=3, T=4, Hv=3, seed=0):
    """P parts over (2, T) rows: some -inf entries, row (0, 1) -inf in every part."""
    rng = np.random.default_rng(seed)
    outs = [rng.standard_normal((2, T, Hv)) for _ in range(P)]
    lses = [rng.standard_normal((2, T)) * 2 for _ in range(P)]
    lses[0][1, 0] = -np.inf  # one part saw nothing for this row
    for s in lses[1:]:
        s[0, 3] = -np.inf  # only part 0 saw this row
    for s in lses:
        s[0, 1] = -np.inf  # no part saw this row
    return outs, lses


@pytest.mark.parametrize("P", [1, 2, 3])
def test_merge_gradients_by_central_differences(P):
    outs, lses = _parts_with_neginf(P=max(P, 3))
    outs, lses = outs[:P], lses[:P]
    forward, backward = _merge_pair(P)
    names = [f"out{i}" for i in range(P)] + [f"lse{i}" for i in range(P)]
    result = npattn.check_gradients(forward, backward, outs + lses, names=names, jacobian=True)
    assert result.ok and result.jacobian_checked
    assert max(result.max_abs_error.values()) < 1e-7


def test_merge_gradients_random_vjp_larger():
    rng = np.random.default_rng(3)
    outs = [rng.standard_normal((2, 3, 17, 8)) for _ in range(4)]
    lses = [rng.standard_normal((2, 3, 17)) * 5 for _ in range(4)]
    lses[2][..., ::3] = -np.inf
    forward, backward = _merge_pair(4)
    result = npattn.check_gradients(forward, backward, outs + lses, jacobian=False)
    assert result.ok


def test_forward_matches_logaddexp_oracle():
    outs, lses = _parts_with_neginf(P=3)
    out, lse, _ = merge_partials(outs, lses)
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_lse = np.logaddexp.reduce(np.stack(lses), axis=0)
        weights = np.nan_to_num(np.exp(np.stack(lses) - ref_lse), nan=0.0)
    ref_out = np.sum(weights[..., None] * np.stack(outs), axis=0)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))  # -inf where every part is -inf
    np.testing.assert_allclose(lse, ref_lse, **TOL)
    np.testing.assert_allclose(out, ref_out, **TOL)


def test_fully_masked_rows_are_zero_without_nan_or_warnings():
    outs, lses = _parts_with_neginf(P=3)
    rng = np.random.default_rng(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with np.errstate(all="raise"):
            out, lse, res = merge_partials(outs, lses)
            douts, dlses = merge_partials_backward(rng.standard_normal(out.shape), rng.standard_normal(lse.shape), res)
    assert lse[0, 1] == -np.inf and np.all(out[0, 1] == 0)
    for d in douts:
        assert np.all(d[0, 1] == 0)
    for d in dlses:
        assert d[0, 1] == 0
    assert dlses[0][1, 0] == 0 and np.all(douts[0][1, 0] == 0)  # a -inf part gets no gradient
    assert all(np.isfinite(a).all() for a in (out, *douts, *dlses))


def test_dlse_none_means_zero():
    outs, lses = _parts_with_neginf(P=2)
    out, lse, res = merge_partials(outs, lses)
    dout = np.ones_like(out)
    a = merge_partials_backward(dout, None, res)
    b = merge_partials_backward(dout, np.zeros_like(lse), res)
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        np.testing.assert_array_equal(x, y)


def test_single_part_is_identity():
    outs, lses = _parts_with_neginf(P=1)
    out, lse, res = merge_partials(outs, lses)
    np.testing.assert_array_equal(lse, lses[0])
    finite = np.isfinite(lses[0])
    np.testing.assert_allclose(out[finite], outs[0][finite], **TOL)
    assert isinstance(res, MergeResiduals)


def test_inputs_are_not_mutated_and_backward_is_reusable():
    outs, lses = _parts_with_neginf(P=3)
    for a in outs + lses:
        a.flags.writeable = False
    out, _lse, res = merge_partials(outs, lses)
    dout = np.ones_like(out)
    first = merge_partials_backward(dout, None, res)
    second = merge_partials_backward(dout, None, res)
    for x, y in zip(first[0] + first[1], second[0] + second[1]):
        np.testing.assert_array_equal(x, y)


def test_half_outs_merge_in_float32():
    rng = np.random.default_rng(2)
    outs = [rng.standard_normal((3, 4)).astype(np.float16) for _ in range(2)]
    lses = [rng.standard_normal(3).astype(np.float32) for _ in range(2)]
    out, lse, res = merge_partials(outs, lses)
    assert out.dtype == np.float16 and lse.dtype == np.float32 and res.out.dtype == np.float32
    douts, dlses = merge_partials_backward(np.ones((3, 4), np.float16), np.ones(3, np.float32), res)
    assert all(d.dtype == np.float16 for d in douts) and all(d.dtype == np.float32 for d in dlses)


BAD_INPUT = {
    "not a list": (lambda: merge_partials(np.zeros((2, 3)), [np.zeros(2)]), TypeError, "list or tuple"),
    "no parts": (lambda: merge_partials([], []), ValueError, "at least one part"),
    "count mismatch": (lambda: merge_partials([np.zeros((2, 3))] * 2, [np.zeros(2)]), ValueError, "one entry per part"),
    "None part": (lambda: merge_partials([None], [np.zeros(2)]), TypeError, "outs[0] must be an array"),
    "out shapes differ": (
        lambda: merge_partials([np.zeros((2, 3)), np.zeros((2, 4))], [np.zeros(2)] * 2),
        ValueError,
        "outs[1] has (2, 4)",
    ),
    "lse shape": (lambda: merge_partials([np.zeros((2, 3))], [np.zeros(3)]), ValueError, "lses[0] must have shape"),
    "integer lse": (lambda: merge_partials([np.zeros((2, 3))], [np.zeros(2, int)]), TypeError, "real floating"),
    "mixed dtypes": (
        lambda: merge_partials([np.zeros((2, 3)), np.zeros((2, 3), np.float32)], [np.zeros(2)] * 2),
        TypeError,
        "share one dtype",
    ),
    "scalar out": (lambda: merge_partials([np.float64(1.0)], [np.float64(0.0)]), ValueError, "rank >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input(case):
    call, error, message = BAD_INPUT[case]
    with pytest.raises(error, match=__import__("re").escape(message)):
        call()


def test_mixed_libraries_is_type_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="different array libraries"):
        merge_partials([np.zeros((2, 3)), torch.zeros((2, 3), dtype=torch.float64)], [np.zeros(2)] * 2)


def test_backward_bad_input():
    out, _lse, res = merge_partials([np.zeros((2, 3))], [np.zeros(2)])
    with pytest.raises(TypeError, match="residuals must come from merge_partials"):
        merge_partials_backward(out, None, object())
    with pytest.raises(ValueError, match="dout must have the merged out's shape"):
        merge_partials_backward(np.zeros((2, 4)), None, res)
    with pytest.raises(TypeError, match="dout must have dtype"):
        merge_partials_backward(np.zeros((2, 3), np.float32), None, res)
    with pytest.raises(ValueError, match="dlse must have the merged lse's shape"):
        merge_partials_backward(out, np.zeros(3), res)
