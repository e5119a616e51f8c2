"""The public gradient checkers (check_gradients, check_jvp, check_score_mod):
pass correct derivatives, catch wrong ones and name the input and element
that fail."""

from __future__ import annotations

import numpy as np
import pytest

import npattn
from npattn import GradcheckError, check_gradients, check_jvp, check_score_mod

RNG = np.random.default_rng(7)


def _matmul_pair(wrong_element=None):
    """y = tanh(a @ b); backward optionally corrupted at one element of da."""

    def forward(a, b):
        y = np.tanh(a @ b)
        return y, (a, b, y)

    def backward(dy, res):
        a, b, y = res
        dz = dy * (1 - y**2)
        da, db = dz @ b.T, a.T @ dz
        if wrong_element is not None:
            da = da.copy()
            da[wrong_element] += 1e-3
        return da, db

    return forward, backward


def test_correct_backward_passes_both_checks():
    result = check_gradients(
        *_matmul_pair(), [RNG.standard_normal((3, 4)), RNG.standard_normal((4, 2))], names=["a", "b"]
    )
    assert result.ok and result.jacobian_checked
    assert max(result.max_abs_error.values()) < 1e-8
    assert "passed" in str(result)


def test_wrong_element_is_named_in_the_jacobian_failure():
    with pytest.raises(GradcheckError) as info:
        check_gradients(
            *_matmul_pair(wrong_element=(1, 2)),
            [RNG.standard_normal((3, 4)), RNG.standard_normal((4, 2))],
            names=["a", "b"],
        )
    message = str(info.value)
    assert "a[1, 2]" in message and "numeric" in message and "analytic" in message
    assert "b[" not in message


def test_random_vjp_catches_errors_without_the_jacobian():
    result = check_gradients(
        *_matmul_pair(wrong_element=(0, 0)),
        [RNG.standard_normal((3, 4)), RNG.standard_normal((4, 2))],
        names=["a", "b"],
        jacobian=False,
        raise_on_failure=False,
    )
    assert not result.ok and not result.jacobian_checked
    assert any(f.startswith("a: random VJP") for f in result.failures)


def test_wrong_gradient_shape_is_reported():
    def forward(x):
        return x * 2, None

    def backward(dy, res):
        return (dy[:1] * 2,)

    result = check_gradients(forward, backward, [np.ones((2, 2))], raise_on_failure=False)
    assert "input0: gradient has shape (1, 2)" in result.failures[0]


def test_nonfinite_outputs_are_excluded():
    # lse of a fully masked row is -inf; the checker must not produce NaN there.
    q = RNG.standard_normal((2, 3, 2))
    mask = np.array([[True, True, False], [False, False, False], [True, False, True]])

    def forward(q):
        out, res = npattn.attention_forward(q, q, q, mask=mask)
        return (out, res.lse), res

    def backward(cots, res):
        g = npattn.attention_backward(cots[0], res, dlse=cots[1])
        return (g.dq + g.dk + g.dv,)

    result = check_gradients(forward, backward, [q], names=["x"])
    assert result.ok and np.isfinite(result.max_abs_error["x"])


def test_non_floating_inputs_are_passed_through_and_not_checked():
    def forward(x, n):
        return x * n, (n,)

    def backward(dy, res):
        return dy * res[0], None

    result = check_gradients(forward, backward, [np.ones(3), np.array(3)], names=["x", "n"])
    assert list(result.max_abs_error) == ["x"]


def test_bad_arguments():
    forward, backward = _matmul_pair()
    with pytest.raises(ValueError, match="names must have one entry per input"):
        check_gradients(forward, backward, [np.ones((2, 2)), np.ones((2, 2))], names=["a"])
    with pytest.raises(ValueError, match="wrt index 5"):
        check_gradients(forward, backward, [np.ones((2, 2)), np.ones((2, 2))], wrt=[5])


def test_checker_runs_on_other_backends(backend):
    q = backend.asarray(RNG.standard_normal((2, 3, 2)))

    def forward(q):
        out, res = npattn.attention_forward(q, q, q, causal=True)
        return out, res

    def backward(dout, res):
        g = npattn.attention_backward(dout, res)
        return (g.dq + g.dk + g.dv,)

    assert check_gradients(forward, backward, [q]).ok


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nan_gradients_fail_in_both_checks():
    """A NaN compares False with every tolerance: it must count as a failure."""

    def forward(x):
        return np.sin(x), x

    def backward_nan_for_one_hot(dy, x):  # right for dense cotangents, NaN for the Jacobian's one-hot ones
        return (dy * np.cos(x) * (1 + 0 * np.log(np.count_nonzero(dy) - 1.0)),)

    def backward_nan(dy, x):
        return (dy * np.nan,)

    x = np.linspace(0, 1, 5)
    jac = check_gradients(forward, backward_nan_for_one_hot, [x], jacobian=True, raise_on_failure=False)
    assert not jac.ok and jac.max_abs_error["input0"] == np.inf
    vjp = check_gradients(forward, backward_nan, [x], jacobian=False, raise_on_failure=False)
    assert not vjp.ok and vjp.max_abs_error["input0"] == np.inf


# --------------------------------------------------------------------------
# check_score_mod
# --------------------------------------------------------------------------

TEMPERATURE = np.array([0.5, 1.0, 2.0])


def _shipped_mods(asarray=np.asarray):
    table = asarray(np.random.default_rng(3).standard_normal((3, 8)))
    return {
        "softcap": npattn.softcap_mod(2.0),
        "alibi": npattn.alibi_mod(asarray(npattn.alibi_slopes(3))),
        "temperature": npattn.head_temperature(asarray(TEMPERATURE)),
        "relative_bias": npattn.relative_position_bias(table, max_distance=16),
    }


@pytest.mark.parametrize("which", ["softcap", "alibi", "temperature", "relative_bias"])
def test_shipped_score_mods_pass(which):
    mod = _shipped_mods()[which]
    result = check_score_mod(mod)
    assert result.ok and result.jacobian_checked
    assert result.names == ["s", *mod.params]
    assert set(result.max_abs_error) == {"s", *mod.params}
    assert max(result.max_abs_error.values()) < 1e-7
    assert "passed" in str(result)


def test_shipped_score_mods_pass_on_other_backends(backend):
    for which, mod in _shipped_mods(backend.asarray).items():
        xp = backend.xp if which == "softcap" else None  # no parameters to infer the namespace from
        assert check_score_mod(mod, num_tiles=2, tile=(2, 2, 3, 2), xp=xp).ok, which


def _temperature_mod(*, share_at=None, ds_at=None, local_heads=False, local_share=False):
    """s' = s t_n with its backward, optionally corrupted: 0.1 added to the
    share's element ``share_at`` or to ds_in's element ``ds_at`` (where the
    tile has it), or with the tile's local head ids in place of the global."""

    def heads(idx):
        return idx.head - idx.heads[0] if local_heads else idx.head

    def forward(s, idx, temperature):
        return s * temperature[heads(idx)]

    def backward(s, idx, ds, temperature):
        ds_in = ds * temperature[heads(idx)]
        share = idx.per_head(ds * s)
        if local_heads or local_share:  # the tile's heads counted from 0
            n = idx.heads[1] - idx.heads[0]
            share = np.concatenate([np.sum(ds * s, axis=(0, 2, 3)), np.zeros(idx.num_heads - n)])
        if share_at is not None:
            share = share.copy()
            share[share_at] += 0.1
        if ds_at is not None and all(i < n for i, n in zip(ds_at, ds_in.shape)):
            ds_in = ds_in.copy()
            ds_in[ds_at] += 0.1
        return ds_in, {"temperature": share}

    return npattn.ScoreMod(forward, backward, params={"temperature": TEMPERATURE}, name="temperature")


def test_the_temperature_reference_passes():
    assert check_score_mod(_temperature_mod()).ok  # the corrupted ones below differ only in the corruption


def test_a_wrong_parameter_share_is_named_with_its_element():
    with pytest.raises(GradcheckError) as info:
        check_score_mod(_temperature_mod(share_at=2))
    message = str(info.value)
    assert message.startswith("score modification 'temperature': gradient check FAILED")
    assert "temperature[2]: numeric" in message
    assert "temperature[0]" not in message and "temperature[1]" not in message
    assert "): s" not in message  # ds_in is right


def test_a_wrong_ds_is_named_s_with_its_element():
    with pytest.raises(GradcheckError) as info:
        check_score_mod(_temperature_mod(ds_at=(1, 0, 2, 3)))
    message = str(info.value)
    assert "s[1, 0, 2, 3]: numeric" in message and "s: random VJP" in message
    assert "): temperature" not in message  # the share is right


def test_the_random_vjp_alone_catches_a_wrong_share():
    result = check_score_mod(_temperature_mod(share_at=0), jacobian=False, raise_on_failure=False)
    assert not result.ok and not result.jacobian_checked
    assert any("temperature: random VJP" in failure for failure in result.failures)
    assert not any("temperature[0]: numeric" in failure for failure in result.failures)


def test_a_share_with_local_head_ids_fails_on_a_tile_that_does_not_start_at_head_0():
    with pytest.raises(GradcheckError) as info:
        check_score_mod(_temperature_mod(local_share=True))
    failures = [line for line in str(info.value).splitlines() if "FAIL" in line]
    numeric = [line for line in failures if "): temperature[" in line and ": numeric" in line]
    assert numeric and all("heads [1, 3) of 3" in line for line in numeric)  # right where h0 = 0
    # and the tile's pieces that do not start at head 0 see it too:
    assert any("heads [0, 2) of 3" in line and "on its pieces" in line for line in failures)


def test_local_head_ids_in_both_functions_fail_the_tile_and_pieces_check():
    # Forward and backward agree, so only the comparison with the tile's pieces sees it.
    with pytest.raises(GradcheckError) as info:
        check_score_mod(_temperature_mod(local_heads=True))
    message = str(info.value)
    assert "s'[" in message and "on its pieces" in message and "global indices" in message
    assert "random VJP" not in message


def test_mixing_entries_of_the_tile_fails_the_tile_and_pieces_check():
    def forward(s, idx):  # subtracts the row maximum: not elementwise
        return s - np.max(s, axis=-1, keepdims=True)

    def backward(s, idx, ds):
        hot = s == np.max(s, axis=-1, keepdims=True)
        return ds - hot * np.sum(ds, axis=-1, keepdims=True)

    result = check_score_mod(npattn.ScoreMod(forward, backward), raise_on_failure=False)
    assert result.max_abs_error["s"] < 1e-7  # its derivative is right ...
    assert any("s'[" in f and "on its pieces" in f for f in result.failures)  # ... but it does not work tile by tile


def test_parameters_are_not_modified():
    temperature = np.array([0.5, 1.0, 2.0], dtype=np.float32)
    temperature.flags.writeable = False
    mod = npattn.head_temperature(temperature)
    assert check_score_mod(mod).ok
    assert mod.params["temperature"] is temperature and temperature.dtype == np.float32
    assert temperature.tolist() == [0.5, 1.0, 2.0]


def _mod(forward=None, backward=None, params=None):
    def default_forward(s, idx, **params):
        return s * 2

    def default_backward(s, idx, ds, **params):
        return (ds * 2, {name: np.zeros_like(p) for name, p in params.items()}) if params else ds * 2

    return npattn.ScoreMod(forward or default_forward, backward or default_backward, params=params or {}, name="m")


def test_what_the_mod_returns_is_checked():
    with pytest.raises(ValueError, match="'m': forward returned shape \\(2, 2, 4\\), expected the tile's"):
        check_score_mod(_mod(forward=lambda s, idx: s[..., 0]))
    with pytest.raises(TypeError, match="'m': forward returned dtype float32, expected the compute dtype float64"):
        check_score_mod(_mod(forward=lambda s, idx: (2 * s).astype(np.float32)))
    with pytest.raises(ValueError, match="'m': backward returned shape \\(2, 2, 4, 1\\)"):
        check_score_mod(_mod(backward=lambda s, idx, ds: ds[..., :1]))
    with pytest.raises(TypeError, match="backward must return ds_in or \\(ds_in, \\{name: dparam\\}\\)"):
        check_score_mod(_mod(backward=lambda s, idx, ds: (ds * 2, {}, None)))
    with pytest.raises(ValueError, match="no cotangent for parameter 'w'"):
        check_score_mod(_mod(backward=lambda s, idx, ds, w: ds * 2, params={"w": np.ones(3)}))
    with pytest.raises(ValueError, match="cotangent for 'w' has shape \\(2,\\), expected the parameter's \\(3,\\)"):
        check_score_mod(_mod(backward=lambda s, idx, ds, w: (ds * 2, {"w": np.zeros(2)}), params={"w": np.ones(3)}))
    with pytest.raises(TypeError, match="cotangent for 'w' has dtype int64"):
        bad = {"w": np.zeros(3, dtype=np.int64)}
        check_score_mod(_mod(backward=lambda s, idx, ds, w: (ds * 2, bad), params={"w": np.ones(3)}))
    with pytest.raises(ValueError, match="cotangents for \\['x'\\], which are not among its parameters \\['w'\\]"):
        bad = {"w": np.zeros(3), "x": np.zeros(3)}
        check_score_mod(_mod(backward=lambda s, idx, ds, w: (ds * 2, bad), params={"w": np.ones(3)}))


def _in_place_forward(s, idx, w):
    s *= 2
    return s


def _in_place_backward(s, idx, ds, w):
    ds *= 2
    return ds, {"w": np.zeros_like(w)}


def _param_writing_forward(s, idx, w):
    w[0] = 5.0
    return s * 2


def test_writing_in_place_is_an_error():
    params = {"w": np.ones(3)}
    with pytest.raises(ValueError, match="'m': forward wrote to its argument s in place"):
        check_score_mod(_mod(forward=_in_place_forward, params=params))
    with pytest.raises(ValueError, match="'m': backward wrote to its argument ds in place"):
        check_score_mod(_mod(backward=_in_place_backward, params=params))
    with pytest.raises(ValueError, match="'m': forward wrote to its argument parameter 'w' in place"):
        check_score_mod(_mod(forward=_param_writing_forward, params=params))
    assert params["w"].tolist() == [1.0, 1.0, 1.0]


def test_an_error_of_the_mod_names_the_tile():
    def forward(s, idx):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        check_score_mod(_mod(forward=forward))
    notes = getattr(info.value, "__notes__", None)
    if notes is not None:  # Python >= 3.11
        assert notes == [
            "while checking score modification 'm' on tile 0 (batch [3, 5), heads [0, 2) of 3, "
            "queries from 5, keys from 5)"
        ]


def test_bad_score_mod_arguments():
    with pytest.raises(TypeError, match=r"mod must be an npattn\.ScoreMod"):
        check_score_mod(lambda s, idx: s)
    with pytest.raises(ValueError, match="tile holds n=4 heads, more than num_heads=3"):
        check_score_mod(_mod(), tile=(1, 4, 2, 2))
    with pytest.raises(TypeError, match="tile must be a tuple of 4 ints"):
        check_score_mod(_mod(), tile=(2, 2, 2))
    with pytest.raises(ValueError, match="tile\\[2\\] must be >= 1"):
        check_score_mod(_mod(), tile=(2, 2, 0, 2))
    with pytest.raises(ValueError, match="num_tiles must be >= 1"):
        check_score_mod(_mod(), num_tiles=0)
    with pytest.raises(TypeError, match="q_offset must be an int"):
        check_score_mod(_mod(), q_offset=1.5)
    with pytest.raises(ValueError, match="eps must be > 0"):
        check_score_mod(_mod(), eps=0.0)


def test_positions_reach_the_mod():
    seen = []

    def forward(s, idx):
        seen.append(idx)
        return s * 2

    check_score_mod(_mod(forward=forward), num_heads=4, tile=(3, 1, 2, 2), num_tiles=4, q_offset=-7, seed=1)
    tiles = {(idx.heads, idx.q.shape) for idx in seen}
    assert {heads for heads, _ in tiles} >= {(0, 1), (3, 4)}  # the first and the last head
    assert {shape for _, shape in tiles} >= {(1, 1, 2, 1), (3, 1, 2, 1)}  # shared and per-batch query positions
    for idx in seen:
        assert idx.num_heads == 4 and idx.head.dtype == np.int64
        assert idx.head.reshape(-1).tolist() == list(range(*idx.heads))
        assert int(idx.q.min()) >= -7


# --------------------------------------------------------------------------
# check_jvp
# --------------------------------------------------------------------------


def _attention_pair(**options):
    """forward -> (out, lse) and the flat JVP (out, lse, out', lse') of npattn,
    the bias a primal when a fourth input is given."""

    def forward(q, k, v, *bias):
        out, res = npattn.attention_forward(q, k, v, bias=bias[0] if bias else None, **options)
        return out, res.lse

    def jvp(primals, tangents):
        return npattn.attention_jvp(primals, tangents, **options)

    return forward, jvp


MASK = np.array([[True, False, True, True], [False, False, False, False], [True, True, False, True]])
JVP_CASES = {
    "causal": ((2, 3, 2), (2, 3, 2), {"causal": True}),
    "mask with a fully masked row": ((2, 3, 2), (2, 4, 2), {"mask": MASK}),
    "gqa bottom_right": ((4, 3, 2), (2, 4, 2), {"causal": True, "align": "bottom_right"}),
    "dropout": ((2, 3, 2), (2, 4, 2), {"dropout_p": 0.4, "seed": 5, "mask": MASK}),
    "bias primal": ((2, 3, 2), (2, 4, 2), {"window": (1, 1), "align": "top_left"}),
}


@pytest.mark.parametrize("impl", ["dense", "chunked"])
@pytest.mark.parametrize("case", list(JVP_CASES))
def test_attention_jvp_passes(case, impl):
    q_shape, kv_shape, options = JVP_CASES[case]
    rng = np.random.default_rng(11)
    inputs = [
        rng.standard_normal((1, *q_shape)),
        rng.standard_normal((1, *kv_shape)),
        rng.standard_normal((1, *kv_shape)),
    ]
    names = ["q", "k", "v"]
    if case == "bias primal":
        inputs.append(rng.standard_normal((q_shape[1], kv_shape[1])))  # (T, S), broadcast over heads
        names.append("bias")
    extra = {"block_q": 2, "block_k": 3} if impl == "chunked" else {}
    forward, jvp = _attention_pair(impl=impl, **options, **extra)
    result = check_jvp(forward, jvp, inputs, names=names)
    assert result.ok and result.jacobian_checked and result.mode == "JVP"
    assert result.names == names and set(result.max_abs_error) == set(names)
    assert max(result.max_abs_error.values()) < 1e-7
    assert str(result).startswith("JVP check passed (full Jacobian: yes)")
    if "mask" in options:  # the fully masked row's lse is -inf at x: left out, not NaN
        assert np.isneginf(forward(*inputs)[1][0, :, 1]).all()


def test_check_jvp_runs_on_other_backends(backend):
    rng = np.random.default_rng(12)
    q = backend.asarray(rng.standard_normal((1, 2, 3, 2)))
    kv = [backend.asarray(rng.standard_normal((1, 1, 4, 2))) for _ in range(2)]
    for impl in ("dense", "chunked"):
        forward, jvp = _attention_pair(impl=impl, causal=True, align="bottom_right", block_q=2, block_k=3)
        result = check_jvp(forward, jvp, [q, *kv], names=["q", "k", "v"])
        assert result.ok and result.jacobian_checked, impl
        assert max(result.max_abs_error.values()) < 1e-7
    wrong = check_jvp(forward, _without_dk(jvp), [q, *kv], names=["q", "k", "v"], raise_on_failure=False)
    assert any(f.startswith("k: random JVP") for f in wrong.failures)


def _without_dk(jvp):
    """``jvp`` with the term Q K'^T of the scores' tangent left out."""

    def wrong(primals, tangents):
        dq, dk, dv = tangents
        return jvp(primals, (dq, 0 * dk, dv))

    return wrong


def test_a_missing_term_of_the_attention_jvp_is_named():
    rng = np.random.default_rng(13)
    inputs = [rng.standard_normal((1, 2, 3, 2)) for _ in range(3)]
    forward, jvp = _attention_pair(causal=True)
    with pytest.raises(GradcheckError) as info:
        check_jvp(forward, _without_dk(jvp), inputs, names=["q", "k", "v"])
    message = str(info.value)
    assert message.startswith("JVP check FAILED (full Jacobian: yes)")
    assert "FAIL k: random JVP -> output " in message and "FAIL q, k, v together: random JVP" in message
    assert "FAIL k[0, " in message and "Jacobian entries fail" in message
    assert "FAIL q" not in message.replace("FAIL q, k, v together", "") and "FAIL v" not in message


def _tanh_matmul(*, wrong_column=None, missing_db=False, cross_term=False):
    """y = tanh(a @ b) and its JVP dy = (1 - y^2) (da b + a db), optionally
    wrong: 1e-3 da[wrong_column] added to dy[0, 1], the term a db left out,
    or the (nonlinear) da db added."""

    def forward(a, b):
        return np.tanh(a @ b)

    def jvp(primals, tangents):
        (a, b), (da, db) = primals, tangents
        y = np.tanh(a @ b)
        dz = da @ b + (0 if missing_db else a @ db) + (da @ db if cross_term else 0)
        dy = (1 - y**2) * dz
        if wrong_column is not None:
            dy[0, 1] += 1e-3 * da[wrong_column]
        return y, dy

    inputs = [np.random.default_rng(14).standard_normal((3, 4)), np.random.default_rng(15).standard_normal((4, 2))]
    return forward, jvp, inputs


def test_tanh_matmul_reference_passes():
    result = check_jvp(*_tanh_matmul(), names=["a", "b"])
    assert result.ok and result.jacobian_checked and max(result.max_abs_error.values()) < 1e-8
    for name in ("a", "b"):
        numeric, analytic = result.vjp[name]
        assert numeric == pytest.approx(analytic, rel=1e-7) and analytic != 0.0


def test_a_wrong_jacobian_column_names_the_input_element_and_output_element():
    with pytest.raises(GradcheckError) as info:
        check_jvp(*_tanh_matmul(wrong_column=(1, 2)), names=["a", "b"])
    message = str(info.value)
    assert "FAIL a[1, 2] -> output 0[0, 1]: numeric 0 vs analytic 0.001 (1 of 72 Jacobian entries fail)" in message
    assert "FAIL b" not in message


def test_a_missing_term_fails_the_random_and_the_jacobian_check():
    result = check_jvp(*_tanh_matmul(missing_db=True), names=["a", "b"], raise_on_failure=False)
    assert not result.ok and result.max_abs_error["a"] < 1e-8 and result.max_abs_error["b"] > 1e-3
    assert len(result.failures) == 3
    assert result.failures[0].startswith("b: random JVP -> output 0[")
    assert "(6 of 6 output entries fail)" in result.failures[0]
    assert result.failures[1].startswith("a, b together: random JVP -> output 0[")
    # b[i, j] moves the column j of y only: 3 of its 6 entries, for each of b's 8 elements;
    # the one named is the largest entry of the Jacobian dy[r, j]/db[i, j] = (1 - y[r, j]^2) a[r, i]
    forward, _, (a, b) = _tanh_matmul()
    jac = (1 - forward(a, b) ** 2)[:, None, :] * a[:, :, None]  # (r, i, j)
    r, i, j = np.unravel_index(np.argmax(np.abs(jac)), jac.shape)
    assert result.failures[2].startswith(f"b[{i}, {j}] -> output 0[{r}, {j}]: numeric {jac[r, i, j]:.6f}")
    assert result.failures[2].endswith("vs analytic 0 (24 of 48 Jacobian entries fail)")


def test_the_random_jvp_alone_catches_errors_without_the_jacobian():
    result = check_jvp(*_tanh_matmul(wrong_column=(0, 0)), names=["a", "b"], jacobian=False, raise_on_failure=False)
    assert not result.ok and not result.jacobian_checked
    assert result.failures[0].startswith("a: random JVP -> output 0[0, 1]: numeric")
    assert "(1 of 6 output entries fail)" in result.failures[0]
    assert not any(f.startswith("b") for f in result.failures)


def test_a_jvp_that_is_not_linear_in_the_tangents_fails_only_together():
    result = check_jvp(*_tanh_matmul(cross_term=True), names=["a", "b"], raise_on_failure=False)
    assert len(result.failures) == 1 and result.failures[0].startswith("a, b together: random JVP")


def test_the_jacobian_is_auto_only_for_small_inputs():
    forward, jvp, inputs = _tanh_matmul()
    assert not check_jvp(forward, jvp, inputs, max_jacobian_elements=11).jacobian_checked  # a has 12
    assert check_jvp(forward, jvp, inputs, max_jacobian_elements=12).jacobian_checked
    assert check_jvp(forward, jvp, inputs, max_jacobian_elements=0, jacobian=True).jacobian_checked


def _masked_pair(lse_dot_there=0.0, lse_dot_at_a_finite_entry=None):
    """Attention with a fully masked row (lse = -inf there) and its JVP, the
    lse tangent of that row replaced by ``lse_dot_there`` and, optionally,
    of entry [0, 0] by ``lse_dot_at_a_finite_entry``."""
    forward, jvp = _attention_pair(mask=MASK[:, :3])

    def patched(primals, tangents):
        out, lse, out_dot, lse_dot = jvp(primals, tangents)
        lse_dot = lse_dot.copy()
        lse_dot[:, 1] = lse_dot_there
        if lse_dot_at_a_finite_entry is not None:
            lse_dot[0, 0] = lse_dot_at_a_finite_entry
        return (out, lse), (out_dot, lse_dot)  # the structured form

    return forward, patched


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_outputs_that_are_not_finite_are_left_out():
    x = np.random.default_rng(16).standard_normal((2, 3, 2))
    forward, _ = _masked_pair()
    assert np.isneginf(forward(x, x, x)[1][:, 1]).all()
    for there in (0.0, np.nan, np.inf, 1e3):  # whatever the JVP says where lse = -inf
        result = check_jvp(*_masked_pair(there), [x, x, x])
        assert result.ok and all(np.isfinite(e) and e < 1e-7 for e in result.max_abs_error.values())
    # ... but not at a finite entry: a NaN fails with an infinite error, named
    result = check_jvp(*_masked_pair(0.0, np.nan), [x, x, x], jacobian=False, raise_on_failure=False)
    assert not result.ok and result.max_abs_error["input0"] == np.inf
    assert result.failures[0].startswith("input0: random JVP -> output 1[0, 0]: numeric")


def test_the_primal_outputs_and_shapes_of_the_jvp_are_checked():
    forward, jvp, inputs = _tanh_matmul()

    def shifted(primals, tangents):
        y, dy = jvp(primals, tangents)
        return y + np.eye(3, 2) * 1e-3, dy

    result = check_jvp(forward, shifted, inputs, raise_on_failure=False)
    assert result.failures[0] == (
        f"jvp's primal output 0[0, 0] is {forward(*inputs)[0, 0] + 1e-3:.12g}, forward's "
        f"{forward(*inputs)[0, 0]:.12g} (2 of 6 entries differ)"
    )
    assert len(result.failures) == 1  # the tangents are right

    def wrong_shape(primals, tangents):
        y, dy = jvp(primals, tangents)
        return y, dy[:, :1]

    with pytest.raises(GradcheckError, match=r"jvp's output tangent 0 has shape \(3, 1\), forward's has \(3, 2\)"):
        check_jvp(forward, wrong_shape, inputs)


def test_tangents_follow_wrt_and_the_structure_of_the_outputs():
    seen = []

    def forward(x, y, n):
        return x * y * n, x + y

    def jvp(primals, tangents):
        (x, y, n), (dx, dy, dn) = primals, tangents
        seen.append((dx, dy, dn))
        return (x * y * n, x + y), ((dx * y + x * dy) * n, dx + dy)

    inputs = [np.linspace(0.5, 1.0, 3), np.linspace(-1.0, 2.0, 3), np.array(3)]
    result = check_jvp(forward, jvp, inputs, names=["x", "y", "n"], wrt=[1])
    assert result.ok and result.names == ["y"] and list(result.max_abs_error) == ["y"]
    assert all(dn is None and not np.any(dx) and dx.dtype == np.float64 for dx, _, dn in seen)
    assert all(dy.dtype == np.float64 and dy.shape == (3,) for _, dy, _ in seen)
    # the flat form (*outputs, *output_tangents) works too
    flat = check_jvp(forward, lambda p, t: (*jvp(p, t)[0], *jvp(p, t)[1]), inputs, wrt=[0, 1])
    assert flat.ok and flat.names == ["input0", "input1"]
    # float32 inputs are checked in float64
    assert check_jvp(forward, jvp, [a.astype(np.float32) for a in inputs[:2]] + [inputs[2]]).ok


def test_bad_check_jvp_arguments():
    forward, jvp, inputs = _tanh_matmul()
    with pytest.raises(TypeError, match="jvp must be callable, got int"):
        check_jvp(forward, 3, inputs)
    with pytest.raises(TypeError, match="forward must be callable"):
        check_jvp(None, jvp, inputs)
    with pytest.raises(TypeError, match="inputs must be a list or tuple of arrays"):
        check_jvp(forward, jvp, inputs[0])
    with pytest.raises(ValueError, match="names must have one entry per input"):
        check_jvp(forward, jvp, inputs, names=["a"])
    with pytest.raises(ValueError, match="wrt index 2 does not name a floating input"):
        check_jvp(forward, jvp, inputs, wrt=[2])
    with pytest.raises(ValueError, match="eps must be > 0"):
        check_jvp(forward, jvp, inputs, eps=0.0)
    with pytest.raises(TypeError, match="jacobian must be True, False or 'auto'"):
        check_jvp(forward, jvp, inputs, jacobian="yes")
    with pytest.raises(ValueError, match="seed must be >= 0"):
        check_jvp(forward, jvp, inputs, seed=-1)
    strict = pytest.importorskip("array_api_strict")
    with pytest.raises(TypeError, match="xp is array_api_strict"):
        check_jvp(forward, jvp, inputs, xp=strict)


def test_what_the_functions_return_is_checked():
    forward, jvp, inputs = _tanh_matmul()
    with pytest.raises(TypeError, match=r"forward's output 1 .* got DenseResiduals \(check_jvp's forward returns the"):
        check_jvp(lambda q, k, v: npattn.attention_forward(q, k, v), jvp, [np.ones((1, 2, 2))] * 3)
    with pytest.raises(TypeError, match="forward's output 0 must be a real floating array"):
        check_jvp(lambda a, b: a @ b > 0, jvp, inputs)
    with pytest.raises(TypeError, match=r"jvp must return \(output, output_tangent\), .* got a tuple of 3"):
        check_jvp(forward, lambda p, t: (*jvp(p, t), None), inputs)
    with pytest.raises(TypeError, match=r"jvp must return .* or the flat tuple .* got ndarray"):
        check_jvp(lambda a, b: (forward(a, b), a), lambda p, t: jvp(p, t)[1], inputs)
    with pytest.raises(TypeError, match="jvp's output tangent 0 must be an array, got NoneType"):
        check_jvp(forward, lambda p, t: (jvp(p, t)[0], None), inputs)
