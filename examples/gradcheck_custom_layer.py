"""Check a hand-written backward with npattn.check_gradients.

    python examples/gradcheck_custom_layer.py            # also a larger random-VJP check
    python examples/gradcheck_custom_layer.py --quick    # small shapes (used by the tests)

The layer is a layer norm over the last axis, written as a JAX ``custom_vjp``
style pair (the convention npattn's own attention follows)::

    forward(x, gamma, beta)  -> (y, residuals)
    backward(dy, residuals)  -> (dx, dgamma, dbeta)

    mu   = mean(x)              xhat = (x - mu) * rstd,  rstd = 1 / sqrt(var(x) + eps)
    y    = gamma * xhat + beta
    dxhat = dy * gamma
    dx    = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    dgamma = sum over rows of dy * xhat,     dbeta = sum over rows of dy

The checker compares the backward with central differences in float64: a
random vector-Jacobian product at any size and, on small inputs, the full
Jacobian, whose failures name the input and the element. A second backward
drops the ``xhat * mean(dxhat * xhat)`` term (treating the variance as a
constant, a classic slip); the checker catches it and points at ``x``.
"""

from __future__ import annotations

import argparse
import sys

import array_api_compat
import numpy as np

import npattn

EPS = 1e-5


def layer_norm_forward(x, gamma, beta):
    """``y = gamma * (x - mean) / sqrt(var + eps) + beta`` over the last axis; any namespace."""
    xp = array_api_compat.array_namespace(x, gamma, beta)
    mu = xp.mean(x, axis=-1, keepdims=True)  # (..., 1)
    xc = x - mu  # (..., D)
    rstd = 1.0 / xp.sqrt(xp.mean(xc * xc, axis=-1, keepdims=True) + EPS)  # (..., 1)
    xhat = xc * rstd  # (..., D)
    return gamma * xhat + beta, (xhat, rstd, gamma)


def layer_norm_backward(dy, residuals):
    """The hand-derived gradients ``(dx, dgamma, dbeta)``."""
    xhat, rstd, gamma = residuals
    xp = array_api_compat.array_namespace(dy, xhat)
    rows = tuple(range(dy.ndim - 1))  # every axis but the normalized one
    dxhat = dy * gamma  # (..., D)
    dx = rstd * (
        dxhat - xp.mean(dxhat, axis=-1, keepdims=True) - xhat * xp.mean(dxhat * xhat, axis=-1, keepdims=True)
    )  # (..., D)
    return dx, xp.sum(dy * xhat, axis=rows), xp.sum(dy, axis=rows)  # (..., D), (D,), (D,)


def layer_norm_backward_wrong(dy, residuals):
    """The same, with the variance treated as a constant: ``dx`` is wrong."""
    xhat, rstd, gamma = residuals
    xp = array_api_compat.array_namespace(dy, xhat)
    rows = tuple(range(dy.ndim - 1))
    dxhat = dy * gamma  # (..., D)
    dx = rstd * (dxhat - xp.mean(dxhat, axis=-1, keepdims=True))  # missing: - xhat * mean(dxhat * xhat)
    return dx, xp.sum(dy * xhat, axis=rows), xp.sum(dy, axis=rows)


def check(backward, shape, *, jacobian="auto", seed=0):
    """Run npattn.check_gradients on the layer norm with ``backward``; return the result."""
    rng = np.random.default_rng(seed)
    D = shape[-1]
    inputs = [rng.standard_normal(shape), 1.0 + 0.1 * rng.standard_normal(D), rng.standard_normal(D)]
    return npattn.check_gradients(
        layer_norm_forward, backward, inputs, names=["x", "gamma", "beta"], jacobian=jacobian, raise_on_failure=False
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes only, for a fast check")
    args = parser.parse_args(argv)
    small = (2, 3, 5)  # (B, T, D): x, y have 30 entries, small enough for the full Jacobian

    print(f"layer norm, correct backward, x {small} (full Jacobian):")
    good = check(layer_norm_backward, small)
    print(good)
    if not args.quick:
        large = (8, 64, 128)
        print(f"\nlayer norm, correct backward, x {large} (random vector-Jacobian product only):")
        good_large = check(layer_norm_backward, large, jacobian=False)
        print(good_large)
        good_ok = good.ok and good_large.ok
    else:
        good_ok = good.ok

    print(f"\nlayer norm, WRONG backward (variance treated as constant), x {small}:")
    bad = check(layer_norm_backward_wrong, small)
    print(bad)
    caught = not bad.ok and all(msg.startswith("x") for msg in bad.failures)
    print(
        "\nresult:",
        "correct backward passes;" if good_ok else "CORRECT BACKWARD FAILED;",
        "wrong backward caught, blamed on x" if caught else "WRONG BACKWARD NOT CAUGHT",
    )
    print("(in a test, leave raise_on_failure=True: a failure raises npattn.GradcheckError)")
    return 0 if good_ok and caught else 1


if __name__ == "__main__":
    sys.exit(main())
