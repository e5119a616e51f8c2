"""Bad input to attention_forward / attention_backward: each case raises the
named exception type with a message that names the argument."""

from __future__ import annotations

import numpy as np
import pytest

import npattn

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((2, 4, 3, 5))
K = RNG.standard_normal((2, 2, 6, 5))
V = RNG.standard_normal((2, 2, 6, 7))
Q_SQUARE = RNG.standard_normal((2, 4, 6, 5))


def _strict(a, device=None):
    xps = pytest.importorskip("array_api_strict")
    return xps.asarray(a, device=xps.Device(device)) if device else xps.asarray(a)


# (id, callable producing the arguments, exception type, message fragment)
FORWARD_CASES = [
    ("rank q", lambda: ((Q[0, 0], K, V), {}), ValueError, "q must have rank >= 3"),
    ("rank mismatch", lambda: ((Q, K[0], V), {}), ValueError, "same rank"),
    ("head dim", lambda: ((Q, K[..., :4], V), {}), ValueError, "head dim"),
    ("leading axes", lambda: ((Q, K[:1], V[:1]), {}), ValueError, "leading (batch) axes"),
    ("v heads/length", lambda: ((Q, K, V[..., :5, :]), {}), ValueError, "v must have k's heads and length"),
    ("N not multiple of K", lambda: ((Q[:, :3], K, V), {}), ValueError, "multiple of the number of key/value heads"),
    ("empty keys", lambda: ((Q, K[..., :0, :], V[..., :0, :]), {}), ValueError, "at least one key"),
    ("integer q", lambda: ((Q.astype(np.int64), K, V), {}), TypeError, "q must have a real floating dtype"),
    ("bool v", lambda: ((Q, K, V > 0), {}), TypeError, "v must have a real floating dtype"),
    ("mixed dtypes", lambda: ((Q.astype(np.float32), K, V), {}), TypeError, "share one dtype"),
    ("not an array", lambda: (([[[1.0]]], K, V), {}), TypeError, "q must be an array"),
    ("mask not bool", lambda: ((Q, K, V), {"mask": np.ones((3, 6))}), TypeError, "mask must be a bool array"),
    ("mask shape", lambda: ((Q, K, V), {"mask": np.ones((3, 5), bool)}), ValueError, "mask of shape (3, 5)"),
    ("mask rank", lambda: ((Q, K, V), {"mask": np.ones((1, 1, 2, 4, 3, 6), bool)}), ValueError, "mask of shape"),
    ("bias shape", lambda: ((Q, K, V), {"bias": np.ones((4, 1, 2))}), ValueError, "bias of shape (4, 1, 2)"),
    ("bias bool", lambda: ((Q, K, V), {"bias": np.ones((3, 6), bool)}), TypeError, "bias must have a real floating"),
    ("causal T!=S no align", lambda: ((Q, K, V), {"causal": True}), ValueError, "align='bottom_right'"),
    ("window T!=S no align", lambda: ((Q, K, V), {"window": (1, 1)}), ValueError, "align='top_left'"),
    ("unknown align", lambda: ((Q, K, V), {"align": "center"}), ValueError, "align must be one of"),
    ("unknown impl", lambda: ((Q, K, V), {"impl": "flash"}), ValueError, "impl must be one of"),
    ("negative window", lambda: ((Q_SQUARE, K, V), {"window": (-1, 0)}), ValueError, "window[0] (left) must be >= 0"),
    ("window not pair", lambda: ((Q_SQUARE, K, V), {"window": 3}), TypeError, "window must be a pair"),
    ("window float", lambda: ((Q_SQUARE, K, V), {"window": (1.5, 0)}), TypeError, "window[0] (left) must be an int"),
    (
        "causal with a right window",
        lambda: ((Q_SQUARE, K, V), {"causal": True, "window": (2, 3)}),
        ValueError,
        "causal=True means window right = 0",
    ),
    ("causal not bool", lambda: ((Q_SQUARE, K, V), {"causal": 1}), TypeError, "causal must be a bool"),
    (
        "lengths shape",
        lambda: ((Q, K, V), {"kv_lengths": np.array([6, 6, 6])}),
        ValueError,
        "kv_lengths must have the inputs' batch shape (2,)",
    ),
    ("lengths scalar for batch", lambda: ((Q, K, V), {"q_lengths": 3}), ValueError, "q_lengths must have"),
    (
        "lengths dtype",
        lambda: ((Q, K, V), {"q_lengths": np.array([1.0, 2.0])}),
        TypeError,
        "q_lengths must have an integer dtype",
    ),
    (
        "lengths too large",
        lambda: ((Q, K, V), {"kv_lengths": np.array([7, 1])}),
        ValueError,
        "kv_lengths must lie in [0, 6]",
    ),
    (
        "lengths negative",
        lambda: ((Q, K, V), {"q_lengths": np.array([-1, 1])}),
        ValueError,
        "q_lengths must lie in [0, 3]",
    ),
    (
        "dropout too large",
        lambda: ((Q, K, V), {"dropout_p": 1.0, "seed": 0}),
        ValueError,
        "dropout_p must lie in [0, 1)",
    ),
    ("dropout negative", lambda: ((Q, K, V), {"dropout_p": -0.1, "seed": 0}), ValueError, "dropout_p must lie"),
    ("dropout no seed", lambda: ((Q, K, V), {"dropout_p": 0.1}), ValueError, "seed is required"),
    ("seed negative", lambda: ((Q, K, V), {"dropout_p": 0.1, "seed": -3}), ValueError, "seed must be >= 0"),
    ("seed too large", lambda: ((Q, K, V), {"dropout_p": 0.1, "seed": 2**64}), ValueError, "seed must be < 2**64"),
    ("scale nan", lambda: ((Q, K, V), {"scale": float("nan")}), TypeError, "scale must be a finite real"),
    ("block_q zero", lambda: ((Q, K, V), {"block_q": 0}), ValueError, "block_q must be >= 1"),
    ("mixed libraries", lambda: ((Q, _strict(K), V), {}), TypeError, "q and k come from different array libraries"),
    (
        "mixed devices",
        lambda: ((_strict(Q), _strict(K, "device1"), _strict(V)), {}),
        ValueError,
        "q and k are on different devices",
    ),
    (
        "mask other library",
        lambda: ((_strict(Q), _strict(K), _strict(V)), {"mask": np.ones((3, 6), bool)}),
        TypeError,
        "q and mask come from different array libraries",
    ),
]


# The variants of issue 14 (Q: N=4, T=3; K: S=6; batch (2,)). Every message names the argument.
Q_IDS, KV_IDS = np.zeros((2, 3), np.int64), np.zeros((2, 6), np.int64)
SQUARE = (Q_SQUARE, K, V)
SQUARE32 = tuple(a.astype(np.float32) for a in SQUARE)
VARIANT_CASES = [
    ("softcap zero", lambda: (SQUARE, {"softcap": 0.0}), ValueError, "softcap must be a finite float > 0"),
    ("softcap negative", lambda: (SQUARE, {"softcap": -2.0}), ValueError, "softcap must be a finite float > 0"),
    ("softcap nan", lambda: (SQUARE, {"softcap": float("nan")}), ValueError, "softcap must be a finite float > 0"),
    ("softcap inf", lambda: (SQUARE, {"softcap": float("inf")}), ValueError, "softcap must be a finite float > 0"),
    ("softcap string", lambda: (SQUARE, {"softcap": "30"}), TypeError, "softcap must be a positive finite float"),
    ("softcap bool", lambda: (SQUARE, {"softcap": True}), TypeError, "softcap must be a positive finite float"),
    ("softcap array", lambda: (SQUARE, {"softcap": np.array([1.0])}), TypeError, "softcap must be"),
    # Finite in float64 but not in the float32 compute dtype: they would become inf or 0 there.
    ("softcap beyond float32", lambda: (SQUARE32, {"softcap": 1e39}), ValueError, "softcap=1e+39 is not a normal"),
    ("softcap below float32", lambda: (SQUARE32, {"softcap": 1e-50}), ValueError, "softcap=1e-50 is not a normal"),
    (
        "sinks beyond float32",
        lambda: (SQUARE32, {"sinks": np.array([1e39, 0, 0, 0])}),
        ValueError,
        "sinks overflows the compute dtype float32",
    ),
    (
        "slopes beyond float32",
        lambda: (SQUARE32, {"alibi_slopes": np.array([1e39, 0, 0, 0])}),
        ValueError,
        "alibi_slopes overflows the compute dtype float32",
    ),
    ("slopes wrong length", lambda: (SQUARE, {"alibi_slopes": np.ones(3)}), ValueError, "alibi_slopes must have shape"),
    ("slopes 0-d", lambda: (SQUARE, {"alibi_slopes": np.float64(0.5)}), ValueError, "alibi_slopes must have shape"),
    (
        "slopes batch axis wrong",
        lambda: (SQUARE, {"alibi_slopes": np.ones((3, 4))}),
        ValueError,
        "alibi_slopes must have shape (N,) = (4,) or broadcast to (..., N) = (2, 4)",
    ),
    (
        "slopes integer dtype",
        lambda: (SQUARE, {"alibi_slopes": np.ones(4, np.int64)}),
        TypeError,
        "alibi_slopes must have a real floating dtype",
    ),
    ("slopes bool", lambda: (SQUARE, {"alibi_slopes": np.ones(4, bool)}), TypeError, "alibi_slopes must have a real"),
    ("slopes list", lambda: (SQUARE, {"alibi_slopes": [0.5] * 4}), TypeError, "alibi_slopes must be a float array"),
    (
        "slopes nan",
        lambda: (SQUARE, {"alibi_slopes": np.array([0.5, np.nan, 0.1, 0.2])}),
        ValueError,
        "alibi_slopes must be finite",
    ),
    ("slopes inf", lambda: (SQUARE, {"alibi_slopes": np.full(4, np.inf)}), ValueError, "alibi_slopes must be finite"),
    ("sinks wrong length", lambda: (SQUARE, {"sinks": np.zeros(2)}), ValueError, "sinks must have shape (N,) = (4,)"),
    ("sinks 0-d", lambda: (SQUARE, {"sinks": np.zeros(())}), ValueError, "sinks must have shape"),
    ("sinks per position", lambda: (SQUARE, {"sinks": np.zeros((4, 6))}), ValueError, "sinks must have shape"),
    ("sinks integer dtype", lambda: (SQUARE, {"sinks": np.zeros(4, np.int32)}), TypeError, "sinks must have a real"),
    ("sinks nan", lambda: (SQUARE, {"sinks": np.array([0.0, np.nan, 0, 0])}), ValueError, "sinks must be finite"),
    ("sinks -inf", lambda: (SQUARE, {"sinks": np.full(4, -np.inf)}), ValueError, "sinks must be finite"),
    ("sinks a float", lambda: (SQUARE, {"sinks": 0.5}), TypeError, "sinks must be a float array"),
    (
        "sinks other library",
        lambda: ((_strict(Q_SQUARE), _strict(K), _strict(V)), {"sinks": np.zeros(4)}),
        TypeError,
        "q and sinks come from different array libraries",
    ),
    (
        "slopes other device",
        lambda: ((_strict(Q_SQUARE), _strict(K), _strict(V)), {"alibi_slopes": _strict(np.ones(4), "device1")}),
        ValueError,
        "q and alibi_slopes are on different devices",
    ),
    (
        "segment ids float",
        lambda: ((Q, K, V), {"q_segment_ids": Q_IDS.astype(float), "kv_segment_ids": KV_IDS}),
        TypeError,
        "q_segment_ids must have an integer dtype",
    ),
    (
        "segment ids bool",
        lambda: ((Q, K, V), {"q_segment_ids": Q_IDS, "kv_segment_ids": KV_IDS.astype(bool)}),
        TypeError,
        "kv_segment_ids must have an integer dtype",
    ),
    (
        "segment ids swapped lengths",
        lambda: ((Q, K, V), {"q_segment_ids": KV_IDS, "kv_segment_ids": Q_IDS}),
        ValueError,
        "q_segment_ids must have shape (2, 3)",
    ),
    (
        "segment ids without batch axis",
        lambda: ((Q, K, V), {"q_segment_ids": Q_IDS, "kv_segment_ids": KV_IDS[0]}),
        ValueError,
        "kv_segment_ids must have shape (2, 6)",
    ),
    (
        "segment ids a list",
        lambda: ((Q, K, V), {"q_segment_ids": [[0, 0, 0]] * 2, "kv_segment_ids": KV_IDS}),
        TypeError,
        "q_segment_ids must be an integer array",
    ),
    (
        "q segment ids alone",
        lambda: ((Q, K, V), {"q_segment_ids": Q_IDS}),
        ValueError,
        "q_segment_ids was given without kv_segment_ids",
    ),
    (
        "kv segment ids alone",
        lambda: ((Q, K, V), {"kv_segment_ids": KV_IDS}),
        ValueError,
        "kv_segment_ids was given without q_segment_ids",
    ),
    (
        "segment ids other library",
        lambda: ((Q, K, V), {"q_segment_ids": _strict(Q_IDS), "kv_segment_ids": KV_IDS}),
        TypeError,
        "q and q_segment_ids come from different array libraries",
    ),
    (
        "alibi T!=S no align",
        lambda: ((Q, K, V), {"alibi_slopes": np.ones(4)}),
        ValueError,
        "alibi_slopes (ALiBi) with T=3 != S=6 needs an explicit alignment",
    ),
]


@pytest.mark.parametrize("make, error, fragment", [c[1:] for c in VARIANT_CASES], ids=[c[0] for c in VARIANT_CASES])
def test_forward_rejects_bad_variant_options(make, error, fragment):
    args, kwargs = make()
    with pytest.raises(error) as info:
        npattn.attention_forward(*args, **kwargs)
    assert fragment in str(info.value)


def test_good_variant_options_pass_where_the_bad_ones_fail():
    """The other side of VARIANT_CASES: the same arguments, made valid, run."""
    npattn.attention(Q, K, V, softcap=1, alibi_slopes=np.ones((2, 1), np.float32), align="top_left")
    npattn.attention(Q_SQUARE, K, V, sinks=np.zeros((2, 4)), alibi_slopes=np.ones(4))  # T == S: top_left
    npattn.attention(Q, K, V, q_segment_ids=Q_IDS.astype(np.int8), kv_segment_ids=KV_IDS.astype(np.uint16))


@pytest.mark.parametrize("make, error, fragment", [c[1:] for c in FORWARD_CASES], ids=[c[0] for c in FORWARD_CASES])
def test_forward_rejects_bad_input(make, error, fragment):
    args, kwargs = make()
    with pytest.raises(error) as info:
        npattn.attention_forward(*args, **kwargs)
    assert fragment in str(info.value)


def _residuals():
    out, res = npattn.attention_forward(Q, K, V)
    return out, res


BACKWARD_CASES = [
    ("dout shape", lambda out: (out[..., :2],), {}, ValueError, "dout must have the forward's shape"),
    ("dout dtype", lambda out: (out.astype(np.float32),), {}, TypeError, "dout must have dtype float64"),
    ("dout library", lambda out: (_strict(out),), {}, TypeError, "come from different array libraries"),
    ("dlse shape", lambda out: (out,), {"dlse": np.zeros((2, 4))}, ValueError, "dlse must have the forward's shape"),
]


@pytest.mark.parametrize(
    "make, kwargs, error, fragment", [c[1:] for c in BACKWARD_CASES], ids=[c[0] for c in BACKWARD_CASES]
)
def test_backward_rejects_bad_cotangents(make, kwargs, error, fragment):
    out, res = _residuals()
    with pytest.raises(error) as info:
        npattn.attention_backward(*make(out), res, **kwargs)
    assert fragment in str(info.value)


def test_backward_rejects_foreign_residuals():
    with pytest.raises(TypeError, match=r"residuals must come from npattn\.attention_forward"):
        npattn.attention_backward(np.zeros((2, 4, 3, 7)), {"lse": None})


def test_align_none_with_equal_lengths_means_top_left():
    k, v = K[..., :3, :], V[..., :3, :]
    np.testing.assert_array_equal(
        npattn.attention(Q, k, v, causal=True), npattn.attention(Q, k, v, causal=True, align="top_left")
    )


def test_error_leaves_inputs_untouched():
    q = Q.copy()
    q.flags.writeable = False
    with pytest.raises(ValueError):
        npattn.attention_forward(q, K, V, causal=True)
    np.testing.assert_array_equal(q, Q)


def test_xp_given_as_the_bare_torch_module_uses_the_compat_namespace():
    """Regression: xp=torch was used as is and failed on torch.isdtype."""
    torch = pytest.importorskip("torch")
    t = torch.asarray(Q[:, :2, :, :3].copy())
    out = npattn.attention(t, t, t, xp=torch)
    np.testing.assert_allclose(out.numpy(), npattn.attention(Q[:, :2, :, :3], Q[:, :2, :, :3], Q[:, :2, :, :3]))


# --- the layout hint: arrays passed as (..., length, heads, head_dim) -------------

LAYOUT = "q, k and v use the layout (..., heads, length, head_dim)"


def _swap(a):
    return np.swapaxes(a, -3, -2)


def test_query_passed_length_first_gets_the_layout_hint():
    q = RNG.standard_normal((2, 4, 9, 5))  # N=4 heads, T=9: passed as (B, T, N, H) it reads as N=9
    with pytest.raises(ValueError) as info:
        npattn.attention(_swap(q), K, V)
    message = str(info.value)
    assert message.startswith("the number of query heads N=9 must be a multiple of the number of key/value heads K=2")
    assert LAYOUT in message
    assert "q's shape (2, 9, 4, 5) looks like (..., length, heads, head_dim)" in message
    assert "q.transpose(0, 2, 1, 3) or np.swapaxes(q, -3, -2)" in message
    npattn.attention(q, K, V)  # the suggested fix runs


def test_keys_and_values_passed_length_first_name_both():
    with pytest.raises(ValueError, match="multiple of the number of key/value heads") as info:
        npattn.attention(Q, _swap(K), _swap(V))  # k, v (2, 6, 2, 5): K reads as 6, which 4 heads cannot share
    assert "the shapes of k and v, (2, 6, 2, 5) and (2, 6, 2, 7), look like" in str(info.value)
    assert "on each of k and v" in str(info.value)


def test_values_alone_passed_length_first_get_the_hint_on_the_kv_check():
    with pytest.raises(ValueError) as info:
        npattn.attention(Q, K, _swap(V))
    message = str(info.value)
    assert message.startswith("v must have k's heads and length (axes -3, -2): k has (K=2, S=6), v has (6, 2)")
    assert "v's shape (2, 6, 2, 7) looks like" in message and "np.swapaxes(v, -3, -2)" in message


def test_three_d_inputs_get_a_transpose_of_their_rank():
    q = RNG.standard_normal((4, 9, 5))  # (N, T, H)
    with pytest.raises(ValueError, match=r"q\.transpose\(1, 0, 2\)"):
        npattn.attention(_swap(q), K[0], V[0])


def test_a_genuine_head_count_error_gets_no_layout_hint():
    # N=4, K=3: swapping q's axes would give N=6 (a multiple of 3), but 6 heads over 4 positions; no hint.
    q, k = RNG.standard_normal((1, 4, 6, 5)), RNG.standard_normal((1, 3, 6, 5))
    with pytest.raises(ValueError, match="multiple of the number of key/value heads") as info:
        npattn.attention(q, k, k)
    assert LAYOUT not in str(info.value)
    with pytest.raises(ValueError) as info:
        npattn.attention(Q[:, :3], K, V)  # 3 heads over 2 kv heads, all axes as documented
    assert LAYOUT not in str(info.value)
