"""The public gradient checker: passes correct backwards, catches wrong ones
and names the input and element that fail."""

from __future__ import annotations

import numpy as np
import pytest

import npattn
from npattn import GradcheckError, check_gradients

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
