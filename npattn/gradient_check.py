"""Finite-difference gradient checking for any forward/backward pair.

Works on a JAX ``custom_vjp``-style pair, the convention npattn itself uses::

    forward(*inputs)                 -> (outputs, residuals)
    backward(cotangents, residuals)  -> gradients, one per input

``outputs`` is an array or a tuple of arrays (``cotangents`` has the same
structure); ``gradients`` is a tuple aligned with ``inputs`` (an array alone
when there is one input; ``None`` for an input that is not differentiable).

Two checks, both with central differences in float64:

1. **Random vector-Jacobian product, at any size.** With seeded random
   cotangents ``u`` and a random direction ``w_i`` per input::

       analytic = <backward(u)_i, w_i>
       numeric  = (L(x_i + eps w_i) - L(x_i - eps w_i)) / (2 eps),
       L(x)     = sum_o <u_o, outputs_o(x)>

2. **Full Jacobian, on small inputs.** Row ``o`` of the analytic Jacobian is
   ``backward(e_o)``; column ``e`` of the numeric one is
   ``(F(x + eps e) - F(x - eps e)) / (2 eps)``. A failure names the input,
   the input element, the output element and both values.

Output entries that are not finite at ``x`` (such as ``lse = -inf`` on fully
masked rows) carry a zero cotangent and are left out of the numeric
differences.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .namespace import array_device, resolve_namespace, to_numpy
from .options import check_int

__all__ = ["check_gradients", "GradcheckResult", "GradcheckError"]


class GradcheckError(AssertionError):
    """An analytic gradient disagrees with central differences."""


@dataclass
class GradcheckResult:
    """Outcome of :func:`check_gradients`.

    ``max_abs_error[name]`` is the largest ``|numeric - analytic|`` seen for
    that input over both checks; ``vjp[name]`` holds ``(numeric, analytic)``
    of the random VJP; ``failures`` lists human-readable messages.
    """

    names: list[str]
    max_abs_error: dict[str, float] = field(default_factory=dict)
    vjp: dict[str, tuple[float, float]] = field(default_factory=dict)
    jacobian_checked: bool = False
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        lines = [
            f"gradient check {'passed' if self.ok else 'FAILED'}"
            f" (full Jacobian: {'yes' if self.jacobian_checked else 'no'})"
        ]
        for name in self.max_abs_error:
            num, ana = self.vjp[name]
            lines.append(
                f"  {name}: max |numeric - analytic| = {self.max_abs_error[name]:.2e}"
                f"  (VJP numeric {num:.10g}, analytic {ana:.10g})"
            )
        lines += [f"  FAIL {msg}" for msg in self.failures]
        return "\n".join(lines)


def _to_host(x: Any) -> np.ndarray:
    """``x`` as a float64 NumPy array: the checker compares in float64."""
    return np.asarray(to_numpy(x), dtype=np.float64)


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def check_gradients(
    forward: Callable[..., tuple[Any, Any]],
    backward: Callable[[Any, Any], Any],
    inputs: Sequence[Any],
    /,
    *,
    names: Sequence[str] | None = None,
    wrt: Sequence[int] | None = None,
    eps: float = 1e-6,
    atol: float = 1e-7,
    rtol: float = 1e-5,
    seed: int = 0,
    jacobian: bool | str = "auto",
    max_jacobian_elements: int = 256,
    raise_on_failure: bool = True,
) -> GradcheckResult:
    """Check ``backward`` against central differences of ``forward`` in float64.

    Parameters
    ----------
    forward : callable
        ``forward(*inputs) -> (outputs, residuals)``.
    backward : callable
        ``backward(cotangents, residuals) -> gradients`` (one per input).
    inputs : sequence of arrays
        Floating inputs are cast to float64 first; others pass through.
    names : sequence of str, optional
        Names used in reports (default ``input0``, ``input1``, ...).
    wrt : sequence of int, optional
        Indices of the inputs to check (default: every floating input).
    eps, atol, rtol : float
        Step and tolerance: passes when ``|num - ana| <= atol + rtol * |ana|``
        (the VJP uses the scale of the summed terms in place of ``|ana|``).
    seed : int
        Seeds the random cotangents and directions.
    jacobian : bool or "auto"
        Also compare full Jacobians; "auto" does so when every checked input
        and the outputs have at most ``max_jacobian_elements`` entries.
    raise_on_failure : bool
        Raise :class:`GradcheckError` (an AssertionError) on any failure.

    Returns
    -------
    GradcheckResult

    Examples
    --------
    >>> import numpy as np
    >>> def forward(x):
    ...     return np.sin(x), x
    >>> def backward(dy, x):
    ...     return (dy * np.cos(x),)
    >>> result = check_gradients(forward, backward, [np.linspace(0, 1, 5)], names=["x"])
    >>> result.ok, result.jacobian_checked
    (True, True)
    """
    _check_arguments(forward, backward, inputs, names, wrt, eps, atol, rtol, seed, jacobian, max_jacobian_elements)
    xp = resolve_namespace({f"inputs[{i}]": a for i, a in enumerate(inputs) if hasattr(a, "shape")})
    inputs, names, wrt = _float64_inputs(xp, inputs, names, wrt)
    device = array_device(inputs[wrt[0]])
    rng = np.random.default_rng(seed)

    def random_like(a):
        return xp.asarray(rng.standard_normal(tuple(a.shape)), dtype=xp.float64, device=device)

    probe = _Probe(xp, forward, backward, inputs)
    cotangents = [xp.where(f, random_like(o), xp.zeros_like(o)) for o, f in zip(probe.outputs, probe.finite)]
    result = GradcheckResult(names=[names[i] for i in wrt])
    grads = probe.backward(cotangents)
    well_shaped = []
    for i in wrt:
        name = names[i]
        if grads[i] is None or tuple(grads[i].shape) != tuple(inputs[i].shape):
            got = None if grads[i] is None else tuple(grads[i].shape)
            result.failures.append(f"{name}: gradient has shape {got}, input has {tuple(inputs[i].shape)}")
            continue
        well_shaped.append(i)
        _check_random_vjp(xp, probe, cotangents, i, name, grads[i], random_like(inputs[i]), eps, atol, rtol, result)

    sizes = [math.prod(o.shape) for o in probe.outputs] + [math.prod(inputs[i].shape) for i in wrt]
    if jacobian == "auto":
        jacobian = max(sizes, default=0) <= max_jacobian_elements
    if jacobian:
        result.jacobian_checked = True
        _check_full_jacobian(
            xp,
            device,
            inputs,
            names,
            well_shaped,
            probe.outputs,
            probe.finite,
            probe.backward,
            probe.outputs_at,
            eps,
            atol,
            rtol,
            result,
        )
    if raise_on_failure and result.failures:
        raise GradcheckError(str(result))
    return result


def _float64_inputs(xp: Any, inputs: Sequence[Any], names: Any, wrt: Any) -> tuple[list[Any], list[str], list[int]]:
    """``(inputs, names, wrt)``: floating inputs cast to float64, a name per
    input, and the indices to check (every floating input by default)."""
    names = list(names) if names is not None else [f"input{i}" for i in range(len(inputs))]
    if len(names) != len(inputs):
        raise ValueError(f"names must have one entry per input ({len(inputs)}), got {len(names)}")
    floating = [hasattr(a, "dtype") and xp.isdtype(a.dtype, "real floating") for a in inputs]
    inputs = [xp.astype(a, xp.float64) if f else a for a, f in zip(inputs, floating)]
    wrt = [i for i, f in enumerate(floating) if f] if wrt is None else list(wrt)
    for i in wrt:
        if not 0 <= i < len(inputs) or not floating[i]:
            raise ValueError(f"wrt index {i} does not name a floating input")
    if not wrt:
        raise ValueError("nothing to check: no input has a real floating dtype (wrt is empty)")
    return inputs, names, wrt


class _Probe:
    """The pair under test, run once at ``inputs``: its outputs there (which
    entries are finite), and calls of the backward and of the forward at
    moved inputs, with non-finite output entries zeroed."""

    def __init__(self, xp: Any, forward: Callable, backward: Callable, inputs: list[Any]):
        self.xp, self.forward, self._backward, self.inputs = xp, forward, backward, inputs
        returned = forward(*inputs)
        if not isinstance(returned, (tuple, list)) or len(returned) != 2:
            raise TypeError(f"forward must return a pair (outputs, residuals), got {type(returned).__name__}")
        outputs, self.residuals = returned
        self.single_output = not isinstance(outputs, (tuple, list))
        self.outputs = _as_tuple(outputs)
        for n, o in enumerate(self.outputs):
            if not hasattr(o, "dtype") or not xp.isdtype(o.dtype, "real floating"):
                got = getattr(o, "dtype", type(o).__name__)
                raise TypeError(f"forward's output {n} must be a real floating array of the inputs' library, got {got}")
        self.finite = [xp.isfinite(o) for o in self.outputs]

    def backward(self, cotangents: list[Any]) -> tuple:
        """The gradients for ``cotangents`` (one per output), one per input."""
        cots = cotangents[0] if self.single_output else tuple(cotangents)
        grads = _as_tuple(self._backward(cots, self.residuals))
        if len(grads) != len(self.inputs):
            raise ValueError(f"backward returned {len(grads)} gradients for {len(self.inputs)} inputs")
        return grads

    def outputs_at(self, i: int, direction: Any, step: float) -> list[Any]:
        """The outputs with input ``i`` moved by ``step * direction``, 0 where they are not finite at the inputs."""
        xp = self.xp
        moved = list(self.inputs)
        moved[i] = self.inputs[i] + step * direction
        outs = _as_tuple(self.forward(*moved)[0])
        return [xp.where(f, o, xp.zeros_like(o)) for o, f in zip(outs, self.finite)]


def _check_random_vjp(
    xp: Any,
    probe: _Probe,
    cotangents: list[Any],
    i: int,
    name: str,
    grad: Any,
    w: Any,
    eps: float,
    atol: float,
    rtol: float,
    result: GradcheckResult,
) -> None:
    """``<grad, w>`` against the central difference of ``L = sum <u, outputs>`` along ``w``, into ``result``."""
    analytic = float(xp.sum(xp.astype(grad, xp.float64) * w))
    plus, minus = probe.outputs_at(i, w, eps), probe.outputs_at(i, w, -eps)
    terms = [u * (p - m) for u, p, m in zip(cotangents, plus, minus)]
    numeric = sum(float(xp.sum(t)) for t in terms) / (2 * eps)
    magnitude = sum(float(xp.sum(xp.abs(t))) for t in terms) / (2 * eps)
    error = abs(numeric - analytic)
    error = math.inf if math.isnan(error) else error
    result.vjp[name] = (numeric, analytic)
    result.max_abs_error[name] = error
    if not error <= atol + rtol * max(abs(analytic), magnitude):
        result.failures.append(
            f"{name}: random VJP numeric {numeric:.12g} vs analytic {analytic:.12g} (error {error:.3g})"
        )


def _check_arguments(
    forward, backward, inputs, names, wrt, eps, atol, rtol, seed, jacobian, max_jacobian_elements
) -> None:
    """TypeError/ValueError naming the first bad argument of :func:`check_gradients`."""
    for name, fn in (("forward", forward), ("backward", backward)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    if hasattr(inputs, "shape") or isinstance(inputs, (str, bytes)) or not isinstance(inputs, Sequence):
        raise TypeError(
            f"inputs must be a list or tuple of arrays, one per argument of forward, got {type(inputs).__name__}"
        )
    if names is not None and (isinstance(names, (str, bytes)) or not isinstance(names, Sequence)):
        raise TypeError(f"names must be a list or tuple of str, got {type(names).__name__}")
    if wrt is not None:
        if isinstance(wrt, (str, bytes)) or not isinstance(wrt, Sequence):
            raise TypeError(f"wrt must be a list or tuple of input indices, got {type(wrt).__name__}")
        for i in wrt:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral):
                raise TypeError(f"wrt must hold int indices into inputs, got {i!r}")
    for name, value, positive in (("eps", eps, True), ("atol", atol, False), ("rtol", rtol, False)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise TypeError(f"{name} must be a finite real number, got {value!r}")
        if value < 0 or (positive and value == 0):
            raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    check_int("seed", seed, minimum=0)
    check_int("max_jacobian_elements", max_jacobian_elements, minimum=0)
    if not (isinstance(jacobian, bool) or (isinstance(jacobian, str) and jacobian == "auto")):
        raise TypeError(f"jacobian must be True, False or 'auto', got {jacobian!r}")


def _one_hot(xp, shape, index, device):
    n = math.prod(shape)
    flat = xp.arange(n, device=device) == index
    return xp.reshape(xp.astype(flat, xp.float64), shape)


def _check_full_jacobian(
    xp, device, inputs, names, wrt, outputs, finite, call_backward, outputs_at, eps, atol, rtol, result
):
    """Compare analytic and numeric Jacobians element by element."""
    out_sizes = [math.prod(o.shape) for o in outputs]
    finite_host = np.concatenate([_to_host(f).reshape(-1) for f in finite]) > 0
    total_out = sum(out_sizes)
    # Analytic: one backward per output element (row of the Jacobian).
    analytic = {i: np.zeros((total_out, math.prod(inputs[i].shape))) for i in wrt}
    row = 0
    for o_index, o in enumerate(outputs):
        for e in range(out_sizes[o_index]):
            cots = [
                _one_hot(xp, tuple(o.shape), e, device) if j == o_index else xp.zeros_like(oo)
                for j, oo in enumerate(outputs)
            ]
            grads = call_backward(cots)
            for i in wrt:
                if grads[i] is not None:
                    analytic[i][row] = _to_host(grads[i]).reshape(-1)
            row += 1
    # Numeric: two forwards per input element (column of the Jacobian).
    for i in wrt:
        shape = tuple(inputs[i].shape)
        numeric = np.zeros_like(analytic[i])
        for e in range(math.prod(shape)):
            direction = _one_hot(xp, shape, e, device)
            plus, minus = outputs_at(i, direction, eps), outputs_at(i, direction, -eps)
            numeric[:, e] = np.concatenate([(_to_host(p) - _to_host(m)).reshape(-1) for p, m in zip(plus, minus)]) / (
                2 * eps
            )
        numeric[~finite_host] = 0.0
        analytic[i][~finite_host] = 0.0
        diff = np.abs(numeric - analytic[i])
        name = names[i]
        worst = float(np.where(np.isnan(diff), np.inf, diff).max(initial=0.0))
        result.max_abs_error[name] = max(result.max_abs_error.get(name, 0.0), worst)
        bad = ~(diff <= atol + rtol * np.abs(analytic[i]))  # a NaN anywhere fails
        if bad.any():
            o_row, column = (int(j) for j in np.unravel_index(np.argmax(np.where(bad, diff, -1)), bad.shape))
            o_index = int(np.searchsorted(np.cumsum(out_sizes), o_row, side="right"))
            o_elem = o_row - sum(out_sizes[:o_index])
            in_index = tuple(int(i) for i in np.unravel_index(column, shape))
            out_index = tuple(int(i) for i in np.unravel_index(o_elem, tuple(outputs[o_index].shape)))
            result.failures.append(
                f"{name}{list(in_index)} -> output {o_index}{list(out_index)}: "
                f"numeric {numeric[o_row, column]:.12g} vs analytic {analytic[i][o_row, column]:.12g} "
                f"({int(bad.sum())} of {bad.size} Jacobian entries fail)"
            )
