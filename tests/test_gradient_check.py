"""The public gradient checker: passes correct backwards, catches wrong ones
and names the input and element that fail."""

from __future__ import annotations

import numpy as np
import pytest

import npattn
from npattn import GradcheckError, check_gradients, check_score_mod

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
