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

:func:`check_jvp` checks a forward-mode derivative (a ``jax.jvp``-style
``jvp(primals, tangents) -> (outputs, output_tangents)``) the same two ways:
``J w`` along random tangents, and the full Jacobian column by column.

:func:`check_score_mod` applies the same two checks to a user score
modification (:class:`~npattn.ScoreMod`) on random tiles, its parameters
included, and checks what the modification returns.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import array_api_compat
import numpy as np

from .namespace import array_device, check_namespace, resolve_namespace, to_numpy
from .options import check_int
from .scores.mods import ScoreMod, TileIndex, _check_tile

__all__ = ["check_gradients", "check_jvp", "check_score_mod", "GradcheckResult", "GradcheckError"]


class GradcheckError(AssertionError):
    """An analytic gradient disagrees with central differences."""


@dataclass
class GradcheckResult:
    """Outcome of :func:`check_gradients`, :func:`check_jvp` and :func:`check_score_mod`.

    ``max_abs_error[name]`` is the largest ``|numeric - analytic|`` seen for
    that input over both checks; ``vjp[name]`` holds ``(numeric, analytic)``
    of the random product: the VJP ``<backward(u), w>`` (for
    :func:`check_score_mod`, of the tile with the largest error), or for
    :func:`check_jvp` the JVP seen through a random cotangent, ``<u, J w>``;
    ``jacobian_checked`` says whether the elementwise check ran (for every
    input); ``failures`` lists human-readable messages; ``mode`` is ``"VJP"``
    or ``"JVP"``, the derivative checked.
    """

    names: list[str]
    max_abs_error: dict[str, float] = field(default_factory=dict)
    vjp: dict[str, tuple[float, float]] = field(default_factory=dict)
    jacobian_checked: bool = False
    failures: list[str] = field(default_factory=list)
    mode: str = "VJP"

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        lines = [
            f"{'JVP' if self.mode == 'JVP' else 'gradient'} check {'passed' if self.ok else 'FAILED'}"
            f" (full Jacobian: {'yes' if self.jacobian_checked else 'no'})"
        ]
        for name in self.max_abs_error:
            num, ana = self.vjp[name]
            lines.append(
                f"  {name}: max |numeric - analytic| = {self.max_abs_error[name]:.2e}"
                f"  ({self.mode} numeric {num:.10g}, analytic {ana:.10g})"
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
        self._take_outputs(outputs)

    def _take_outputs(self, outputs: Any) -> None:
        """Keep the forward's ``outputs`` at the inputs, and where they are finite."""
        xp = self.xp
        self.single_output = not isinstance(outputs, (tuple, list))
        self.outputs = _as_tuple(outputs)
        for n, o in enumerate(self.outputs):
            if not hasattr(o, "dtype") or not xp.isdtype(o.dtype, "real floating"):
                got = getattr(o, "dtype", type(o).__name__)
                raise TypeError(f"forward's output {n} must be a real floating array of the inputs' library, got {got}")
        self.finite = [xp.isfinite(o) for o in self.outputs]

    def _outputs_of(self, moved: list[Any]) -> Any:
        return self.forward(*moved)[0]

    def backward(self, cotangents: list[Any]) -> tuple:
        """The gradients for ``cotangents`` (one per output), one per input."""
        cots = cotangents[0] if self.single_output else tuple(cotangents)
        grads = _as_tuple(self._backward(cots, self.residuals))
        if len(grads) != len(self.inputs):
            raise ValueError(f"backward returned {len(grads)} gradients for {len(self.inputs)} inputs")
        return grads

    def outputs_at(self, i: int, direction: Any, step: float) -> list[Any]:
        """The outputs with input ``i`` moved by ``step * direction``, 0 where they are not finite at the inputs."""
        return self.outputs_along({i: direction}, step)

    def outputs_along(self, directions: Mapping[int, Any], step: float) -> list[Any]:
        """The outputs with each input ``i`` moved by ``step * directions[i]``,
        0 where they are not finite at the inputs."""
        xp = self.xp
        moved = list(self.inputs)
        for i, direction in directions.items():
            moved[i] = self.inputs[i] + step * direction
        outs = _as_tuple(self._outputs_of(moved))
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
    forward, backward, inputs, names, wrt, eps, atol, rtol, seed, jacobian, max_jacobian_elements, role="backward"
) -> None:
    """TypeError/ValueError naming the first bad argument of :func:`check_gradients`
    (of :func:`check_jvp` with ``role="jvp"``)."""
    for name, fn in (("forward", forward), (role, backward)):
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
    _check_options(eps, atol, rtol, seed, jacobian, max_jacobian_elements)


def _check_options(eps, atol, rtol, seed, jacobian, max_jacobian_elements) -> None:
    """TypeError/ValueError naming the first bad option the two checkers share."""
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


# --------------------------------------------------------------------------
# Forward mode
# --------------------------------------------------------------------------


def check_jvp(
    forward: Callable[..., Any],
    jvp: Callable[[tuple, tuple], Any],
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
    xp: Any = None,
) -> GradcheckResult:
    r"""Check a forward-mode derivative (JVP) against central differences of
    its forward, in float64.

    With ``F = forward`` and a tangent ``w`` of the inputs ``x``, the output
    tangents ``jvp`` returns must be the directional derivative, entry by
    entry, of every output::

        analytic = J w = jvp(x, w)[1]
        numeric  = (F(x + eps w) - F(x - eps w)) / (2 eps)

    1. **Random tangents, at any size**: a seeded random ``w_i`` on each
       checked input ``i`` alone (0 on the others), then on all of them
       together (a JVP must be linear in the tangents).
    2. **Full Jacobian, on small inputs**: ``w_i = e``, each one-hot tangent
       of each checked input, column ``e`` of ``J_i``.

    A failure names the input (and its element, for the Jacobian), the
    output and its element with the largest error, and both values. Output
    entries that are not finite at ``x`` (such as ``lse = -inf`` on fully
    masked rows) are left out, as :func:`check_gradients` does. The primal
    outputs ``jvp`` returns must equal ``forward``'s.

    Parameters
    ----------
    forward : callable
        ``forward(*inputs) -> outputs``: an array or a tuple of arrays (no
        residuals, unlike :func:`check_gradients`'s forward).
    jvp : callable
        ``jvp(primals, tangents) -> (outputs, output_tangents)``, as
        ``jax.jvp(forward, primals, tangents)``: ``primals`` is the tuple of
        inputs and ``tangents`` a tuple with one entry per input (float64,
        0 for a floating input that is not checked, ``None`` for one that is
        not floating); ``outputs`` and ``output_tangents`` have the structure
        of ``forward``'s outputs. With several outputs, the flat tuple
        ``(*outputs, *output_tangents)`` is accepted too, as
        :func:`npattn.attention_jvp` returns ``(out, lse, out_dot, lse_dot)``.
    inputs : sequence of arrays
        Floating inputs are cast to float64 first; others pass through.
    names : sequence of str, optional
        Names used in reports (default ``input0``, ``input1``, ...).
    wrt : sequence of int, optional
        Indices of the inputs that get tangents (default: every floating input).
    eps, atol, rtol : float
        Step and tolerance: an output entry passes when
        ``|num - ana| <= atol + rtol * |ana|``.
    seed : int
        Seeds the random tangents (and the cotangent of the summary values).
    jacobian : bool or "auto"
        Also compare full Jacobians, one JVP and two forwards per input
        element; "auto" does so when every checked input has at most
        ``max_jacobian_elements`` entries.
    raise_on_failure : bool
        Raise :class:`GradcheckError` (an AssertionError) on any failure.
    xp : namespace, optional
        The array namespace; by default the inputs'.

    Returns
    -------
    GradcheckResult
        With ``mode="JVP"``; ``vjp[name]`` holds ``(<u, numeric>, <u,
        analytic>)`` of input ``name``'s random JVP seen through a random
        cotangent ``u``.

    Raises
    ------
    GradcheckError
        When a JVP disagrees with central differences, its primal outputs
        with ``forward``'s, or an output tangent has another shape than its
        output (and ``raise_on_failure``).
    TypeError, ValueError
        Bad arguments (named), a forward that does not return real floating
        arrays, or a ``jvp`` that returns another structure than the outputs'.

    Examples
    --------
    >>> import numpy as np, npattn
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal((1, 2, 3, 2)) for _ in range(3))
    >>> result = npattn.check_jvp(
    ...     lambda q, k, v: npattn.attention_forward(q, k, v, causal=True)[0],
    ...     lambda p, t: npattn.attention_jvp(p, t, causal=True)[::2],  # (out, out_dot)
    ...     (q, k, v),
    ...     names=["q", "k", "v"],
    ... )
    >>> result.ok, result.jacobian_checked
    (True, True)

    A JVP that forgets the term ``Q K'^T`` of the scores' tangent fails,
    naming ``k``, its element and the output element:

    >>> def jvp_without_dk(primals, tangents):
    ...     dq, dk, dv = tangents
    ...     return npattn.attention_jvp(primals, (dq, 0 * dk, dv), causal=True)[::2]
    >>> npattn.check_jvp(
    ...     lambda q, k, v: npattn.attention_forward(q, k, v, causal=True)[0],
    ...     jvp_without_dk,
    ...     (q, k, v),
    ...     names=["q", "k", "v"],
    ... )  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    ...
    npattn.gradient_check.GradcheckError: JVP check FAILED (full Jacobian: yes)
      q: max |numeric - analytic| = ...
      k: max |numeric - analytic| = ...
      v: max |numeric - analytic| = ...
      FAIL k: random JVP -> output 0[0, 0, 2, 0]: numeric 0.4613215... vs analytic 0 (8 of 12 output entries fail)
      FAIL q, k, v together: random JVP -> output 0[0, 0, 2, 0]: numeric 0.1407692... vs analytic -0.3205523...
      FAIL k[0, 0, 1, 1] -> output 0[0, 0, 1, 0]: numeric -0.5279186... vs analytic 0 (40 of 144 Jacobian entries fail)
    """
    _check_arguments(
        forward, jvp, inputs, names, wrt, eps, atol, rtol, seed, jacobian, max_jacobian_elements, role="jvp"
    )
    xp = resolve_namespace({f"inputs[{i}]": a for i, a in enumerate(inputs) if hasattr(a, "shape")}, xp)
    inputs, names, wrt = _float64_inputs(xp, inputs, names, wrt)
    device = array_device(inputs[wrt[0]])
    rng = np.random.default_rng(seed)

    def random_like(a: Any) -> Any:
        return xp.asarray(rng.standard_normal(tuple(a.shape)), dtype=xp.float64, device=device)

    probe = _JvpProbe(xp, forward, jvp, inputs)
    result = GradcheckResult(names=[names[i] for i in wrt], mode="JVP")
    directions = {i: random_like(inputs[i]) for i in wrt}
    u = np.where(probe.finite_host, _flat_host([random_like(o) for o in probe.outputs]), 0.0)

    def fail() -> GradcheckResult:
        if raise_on_failure and result.failures:
            raise GradcheckError(str(result))
        return result

    # 1. Random tangents: each input alone, then all together.
    first = True
    for i in wrt:
        outs, dots = probe.jvp({i: directions[i]})
        if first:
            first = False
            result.failures += probe.shape_failures(outs, dots)
            if result.failures:  # nothing to compare entry by entry
                return fail()
            result.failures += probe.primal_failures(outs, atol, rtol)
        numeric, analytic = probe.difference({i: directions[i]}, eps), probe.tangents_host(dots)
        diff, bad = _tangent_errors(numeric, analytic, probe.finite_host, atol, rtol)
        result.max_abs_error[names[i]] = float(diff.max(initial=0.0))
        result.vjp[names[i]] = (float(u @ numeric), float(u @ analytic))
        if bad.any():
            row = int(np.argmax(np.where(bad, diff, -1.0)))
            result.failures.append(
                f"{names[i]}: random JVP -> {probe.output_element(row)}: numeric {numeric[row]:.12g} vs "
                f"analytic {analytic[row]:.12g} ({int(bad.sum())} of {bad.size} output entries fail)"
            )
    if len(wrt) > 1:
        numeric, analytic = probe.difference(directions, eps), probe.tangents_host(probe.jvp(directions)[1])
        diff, bad = _tangent_errors(numeric, analytic, probe.finite_host, atol, rtol)
        if bad.any():
            row = int(np.argmax(np.where(bad, diff, -1.0)))
            result.failures.append(
                f"{', '.join(names[i] for i in wrt)} together: random JVP -> {probe.output_element(row)}: "
                f"numeric {numeric[row]:.12g} vs analytic {analytic[row]:.12g} "
                f"({int(bad.sum())} of {bad.size} output entries fail)"
            )

    # 2. The full Jacobian, column by column.
    if jacobian == "auto":
        jacobian = max(math.prod(inputs[i].shape) for i in wrt) <= max_jacobian_elements
    if jacobian:
        result.jacobian_checked = True
        for i in wrt:
            _check_jacobian_columns(xp, device, probe, i, names[i], eps, atol, rtol, result)
    return fail()


def _flat_host(arrays: Sequence[Any]) -> np.ndarray:
    """``arrays`` flattened and concatenated, as one float64 NumPy vector."""
    return np.concatenate([_to_host(a).reshape(-1) for a in arrays]) if arrays else np.zeros(0)


def _tangent_errors(
    numeric: np.ndarray, analytic: np.ndarray, finite: np.ndarray, atol: float, rtol: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(|numeric - analytic|, failing entries)`` of two flat output
    tangents, entries where the output is not finite left out (0, passing);
    a NaN or infinity among the others counts as an infinite error."""
    numeric, analytic = np.where(finite, numeric, 0.0), np.where(finite, analytic, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf
        diff = np.abs(numeric - analytic)
    diff = np.where(np.isfinite(numeric) & np.isfinite(analytic), diff, np.inf)
    return diff, ~(diff <= atol + rtol * np.abs(analytic))


class _JvpProbe(_Probe):
    """The forward under test and its ``jvp``, run at ``inputs``: the
    outputs there (which entries are finite), calls of the forward at moved
    inputs and of the ``jvp`` with given tangents (0 on the other inputs)."""

    def __init__(self, xp: Any, forward: Callable, jvp: Callable, inputs: list[Any]):
        self.xp, self.forward, self._jvp, self.inputs = xp, forward, jvp, inputs
        self._take_outputs(forward(*inputs))
        self.finite_host = _flat_host(self.finite) > 0
        self.sizes = [math.prod(o.shape) for o in self.outputs]
        floating = [hasattr(a, "dtype") and xp.isdtype(a.dtype, "real floating") for a in inputs]
        self.zero_tangents = [xp.zeros_like(a) if f else None for a, f in zip(inputs, floating)]

    def _take_outputs(self, outputs: Any) -> None:
        if isinstance(outputs, (tuple, list)) and len(outputs) == 2 and not hasattr(outputs[1], "dtype"):
            raise TypeError(
                f"forward's output 1 must be a real floating array of the inputs' library, got "
                f"{type(outputs[1]).__name__} (check_jvp's forward returns the outputs alone, without residuals)"
            )
        super()._take_outputs(outputs)

    def _outputs_of(self, moved: list[Any]) -> Any:
        return self.forward(*moved)

    def jvp(self, directions: Mapping[int, Any]) -> tuple[list[Any], list[Any]]:
        """``(outputs, output_tangents)`` of the ``jvp`` with the tangents ``directions``."""
        tangents = tuple(directions.get(j, zero) for j, zero in enumerate(self.zero_tangents))
        returned = self._jvp(tuple(self.inputs), tangents)
        n = len(self.outputs)
        pair: tuple[Any, Any] | None = None
        if isinstance(returned, (tuple, list)):
            if self.single_output and len(returned) == 2:
                pair = ((returned[0],), (returned[1],))
            elif not self.single_output and len(returned) == 2 and all(isinstance(r, (tuple, list)) for r in returned):
                pair = (returned[0], returned[1])
            elif not self.single_output and len(returned) == 2 * n:
                pair = (returned[:n], returned[n:])
        if pair is None or len(pair[0]) != n or len(pair[1]) != n:
            got = f"a tuple of {len(returned)}" if isinstance(returned, (tuple, list)) else type(returned).__name__
            expected = "(output, output_tangent)" if self.single_output else f"(outputs, output_tangents) of {n} each"
            raise TypeError(
                f"jvp must return {expected}, with the structure of forward's outputs"
                f"{'' if self.single_output else ', or the flat tuple (*outputs, *output_tangents)'}; got {got}"
            )
        outs, dots = list(pair[0]), list(pair[1])
        for what, arrays in (("primal output", outs), ("output tangent", dots)):
            for o, a in enumerate(arrays):
                if not hasattr(a, "shape"):
                    raise TypeError(f"jvp's {what} {o} must be an array, got {type(a).__name__}")
        return outs, dots

    def shape_failures(self, outs: list[Any], dots: list[Any]) -> list[str]:
        """A message for each primal output or output tangent of the ``jvp`` whose shape is not the output's."""
        failures = []
        for o, (out, a, b) in enumerate(zip(self.outputs, outs, dots)):
            for what, x in (("primal output", a), ("output tangent", b)):
                if tuple(x.shape) != tuple(out.shape):
                    failures.append(f"jvp's {what} {o} has shape {tuple(x.shape)}, forward's has {tuple(out.shape)}")
        return failures

    def primal_failures(self, outs: list[Any], atol: float, rtol: float) -> list[str]:
        """A message for each primal output of the ``jvp`` that differs from the forward's (non-finite ones equal)."""
        failures = []
        for o, (want, got) in enumerate(zip(self.outputs, outs)):
            a, b = _to_host(want).reshape(-1), _to_host(got).reshape(-1)
            with np.errstate(invalid="ignore"):  # inf - inf
                close = np.isfinite(a) & (np.abs(a - b) <= atol + rtol * np.abs(a))
            bad = ~(close | (a == b) | (np.isnan(a) & np.isnan(b)))
            if bad.any():
                e = int(np.argmax(bad))
                index = [int(j) for j in np.unravel_index(e, tuple(want.shape))]
                failures.append(
                    f"jvp's primal output {o}{index} is {b[e]:.12g}, forward's {a[e]:.12g} "
                    f"({int(bad.sum())} of {bad.size} entries differ)"
                )
        return failures

    def tangents_host(self, dots: list[Any]) -> np.ndarray:
        """The output tangents as one float64 vector (ValueError if a shape changed since the first call)."""
        failures = self.shape_failures(list(self.outputs), dots)
        if failures:
            raise ValueError(failures[0])
        return _flat_host(dots)

    def difference(self, directions: Mapping[int, Any], eps: float) -> np.ndarray:
        """The central difference of the outputs along ``directions``, one float64 vector (0 where not finite at x)."""
        plus, minus = self.outputs_along(directions, eps), self.outputs_along(directions, -eps)
        return (_flat_host(plus) - _flat_host(minus)) / (2 * eps)

    def output_element(self, row: int) -> str:
        """``output o[index]`` of the entry ``row`` of the flat outputs."""
        o = int(np.searchsorted(np.cumsum(self.sizes), row, side="right"))
        index = [int(j) for j in np.unravel_index(row - sum(self.sizes[:o]), tuple(self.outputs[o].shape))]
        return f"output {o}{index}"


def _check_jacobian_columns(
    xp: Any,
    device: Any,
    probe: _JvpProbe,
    i: int,
    name: str,
    eps: float,
    atol: float,
    rtol: float,
    result: GradcheckResult,
) -> None:
    """Column ``e`` of the Jacobian in input ``i``, the JVP with the one-hot
    tangent ``e``, against its central difference, for every ``e``; a
    failure names the worst input element and output element."""
    shape = tuple(probe.inputs[i].shape)
    worst_error, failing, worst = 0.0, 0, None
    for e in range(math.prod(shape)):
        direction = _one_hot(xp, shape, e, device)
        numeric = probe.difference({i: direction}, eps)
        analytic = probe.tangents_host(probe.jvp({i: direction})[1])
        diff, bad = _tangent_errors(numeric, analytic, probe.finite_host, atol, rtol)
        worst_error = max(worst_error, float(diff.max(initial=0.0)))
        if bad.any():
            failing += int(bad.sum())
            row = int(np.argmax(np.where(bad, diff, -1.0)))
            if worst is None or diff[row] > worst[0]:
                worst = (float(diff[row]), e, row, numeric[row], analytic[row])
    result.max_abs_error[name] = max(result.max_abs_error.get(name, 0.0), worst_error)
    if worst is not None:
        _, e, row, num, ana = worst
        element = f"{name}{[int(j) for j in np.unravel_index(e, shape)]}" if shape else name
        result.failures.append(
            f"{element} -> {probe.output_element(row)}: numeric {num:.12g} vs analytic {ana:.12g} "
            f"({failing} of {math.prod(shape) * probe.finite_host.size} Jacobian entries fail)"
        )


# --------------------------------------------------------------------------
# Score modifications
# --------------------------------------------------------------------------


def check_score_mod(
    mod: ScoreMod,
    /,
    *,
    num_heads: int = 3,
    tile: tuple[int, int, int, int] = (2, 2, 4, 5),
    num_tiles: int = 3,
    q_offset: int = 0,
    eps: float = 1e-6,
    atol: float = 1e-7,
    rtol: float = 1e-5,
    seed: int = 0,
    jacobian: bool | str = "auto",
    max_jacobian_elements: int = 256,
    raise_on_failure: bool = True,
    xp: Any = None,
) -> GradcheckResult:
    r"""Check a score modification's hand-written backward against central
    differences of its forward, in float64, its parameters included.

    On each random tile ``s`` ``(B', n, tq, tk)`` with its index ``idx`` and a
    random cotangent ``u``, with ``(ds, {name: dp}) = backward(s, idx, u, **p)``::

        L(s, p) = sum_ij u_ij forward(s, idx, **p)_ij
        ds      = dL/ds,     dp = dL/dp       (for every parameter p)

    each compared with ``(L(x + eps w) - L(x - eps w)) / (2 eps)`` along a
    random direction ``w`` (the random VJP, at any size) and along every
    one-hot ``w`` (the elementwise check, on inputs of at most
    ``max_jacobian_elements`` entries), as :func:`check_gradients` does.

    Each tile holds random scores (float64, standard deviation 2), batch
    elements ``[b0, b0 + B')``, the query heads ``[h0, h0 + n)`` of
    ``num_heads`` (the first tile starts at head 0, the last ends at head
    ``num_heads``), and random query and key positions; every other tile
    gives each batch element its own query positions (with B' > 1), ``idx.q`` of shape
    ``(B', 1, tq, 1)``, as bottom_right alignment with lengths does. The
    backward's parameter shares must therefore use ``idx``'s global head ids
    (``idx.per_head(values)``), as npattn's tiles may hold any subset of the
    heads.

    Besides the derivatives, it checks what the modification returns and
    that it works tile by tile: the forward and backward on each tile must
    agree with their values on the tile's pieces (the tile cut in two along
    each axis, with the pieces' own indices), which an elementwise
    modification using ``idx``'s global indices does and one that mixes
    entries or uses local head ids does not. The parameters are cast to
    float64 copies; ``mod.params`` is never modified.

    Parameters
    ----------
    mod : ScoreMod
        The modification under test.
    num_heads : int
        N, the query heads of the call (``idx.num_heads``); the parameters'
        shapes must fit it (a per-head parameter has ``(num_heads,)``).
    tile : tuple of 4 int
        ``(B', n, tq, tk)``: batch elements, query heads (at most
        ``num_heads``), query rows and keys of each tile.
    num_tiles : int
        How many random tiles to check.
    q_offset : int
        Added to every query position (``S - T`` under bottom_right alignment).
    eps, atol, rtol : float
        Step and tolerance: passes when ``|num - ana| <= atol + rtol * |ana|``
        (the VJP uses the scale of the summed terms in place of ``|ana|``).
    seed : int
        Seeds the tiles, scores, cotangents and directions.
    jacobian : bool or "auto"
        Check every element of ``s`` and of each parameter; "auto" does so
        for those with at most ``max_jacobian_elements`` entries.
    raise_on_failure : bool
        Raise :class:`GradcheckError` (an AssertionError) on any failure.
    xp : namespace, optional
        The array namespace of the tiles; by default the parameters', or
        NumPy for a modification without parameters.

    Returns
    -------
    GradcheckResult
        Reports ``s`` and each parameter by name; a failure names the tile
        (its batch elements, heads and positions), the input and the element.

    Raises
    ------
    GradcheckError
        When a derivative disagrees with central differences or the tile and
        its pieces disagree (and ``raise_on_failure``).
    TypeError, ValueError
        When the modification returns what npattn would refuse: a tile of
        another shape or dtype, no ``(ds_in, {name: dparam})`` pair with
        parameters, a share missing, of another shape or not floating, a share
        for a name that is no parameter; or when it writes to ``s``, ``ds``
        or a parameter in place. An error raised by the modification itself
        carries a note naming the tile.

    Examples
    --------
    A per-head temperature ``s' = s t_n``, with ``dt_n = sum_ij ds'_nij s_nij``:

    >>> import numpy as np, npattn
    >>> def forward(s, idx, t):
    ...     return s * t[idx.head]
    >>> def backward(s, idx, ds, t):
    ...     return ds * t[idx.head], {"t": idx.per_head(ds * s)}
    >>> t = np.array([0.5, 1.0, 2.0])
    >>> npattn.check_score_mod(npattn.ScoreMod(forward, backward, params={"t": t}, name="temperature")).ok
    True

    A backward that forgets the factor ``s`` in the share fails, naming the
    parameter's element:

    >>> def wrong_backward(s, idx, ds, t):
    ...     return ds * t[idx.head], {"t": idx.per_head(ds)}
    >>> npattn.check_score_mod(npattn.ScoreMod(forward, wrong_backward, params={"t": t}, name="temperature"))
    ... # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    npattn.gradient_check.GradcheckError: score modification 'temperature': gradient check FAILED ...
    ...
      FAIL tile 0 (batch [...), heads [0, 2) of 3, ...): t[...]: numeric ... vs analytic ...
    ...
    """
    if not isinstance(mod, ScoreMod):
        raise TypeError(f"mod must be an npattn.ScoreMod, got {type(mod).__name__}")
    num_heads = check_int("num_heads", num_heads, minimum=1)
    num_tiles = check_int("num_tiles", num_tiles, minimum=1)
    if isinstance(tile, (str, bytes)) or not isinstance(tile, Sequence) or len(tile) != 4:
        raise TypeError(f"tile must be a tuple of 4 ints (B', n, tq, tk), got {tile!r}")
    shape = tuple(check_int(f"tile[{a}]", size, minimum=1) for a, size in enumerate(tile))
    if shape[1] > num_heads:
        raise ValueError(f"tile holds n={shape[1]} heads, more than num_heads={num_heads}")
    if isinstance(q_offset, bool) or not isinstance(q_offset, numbers.Integral):
        raise TypeError(f"q_offset must be an int, got {q_offset!r}")
    _check_options(eps, atol, rtol, seed, jacobian, max_jacobian_elements)

    names = list(mod.params)
    labels = [name if name != "s" else "params['s']" for name in names]  # "s" is the scores
    if mod.params:
        xp = resolve_namespace({f"params[{name!r}]": p for name, p in mod.params.items()}, xp)
        device = array_device(next(iter(mod.params.values())))
    else:
        xp = array_api_compat.array_namespace(check_namespace(xp).zeros(())) if xp is not None else None
        xp = xp if xp is not None else array_api_compat.array_namespace(np.zeros(()))
        device = None
    values = [xp.astype(p, xp.float64) for p in mod.params.values()]  # float64 copies
    rng = np.random.default_rng(seed)
    result = GradcheckResult(names=["s", *labels], jacobian_checked=True)
    for t in range(num_tiles):
        idx, where = _random_tile_index(xp, device, rng, t, num_tiles, shape, num_heads, int(q_offset))
        try:
            tile_result = _check_one_tile(
                mod, xp, device, rng, idx, names, labels, values, eps, atol, rtol, jacobian, max_jacobian_elements
            )
        except Exception as error:
            add_note = getattr(error, "add_note", None)  # Python >= 3.11
            if add_note is not None:
                add_note(f"while checking score modification {mod.name!r} on {where}")
            raise
        result.jacobian_checked &= tile_result.jacobian_checked
        for label in tile_result.max_abs_error:
            if tile_result.max_abs_error[label] >= result.max_abs_error.get(label, -1.0):
                result.max_abs_error[label] = tile_result.max_abs_error[label]
                result.vjp[label] = tile_result.vjp[label]
        result.failures += [f"{where}: {failure}" for failure in tile_result.failures]
    if raise_on_failure and result.failures:
        raise GradcheckError(f"score modification {mod.name!r}: {result}")
    return result


def _random_tile_index(
    xp: Any,
    device: Any,
    rng: np.random.Generator,
    t: int,
    num_tiles: int,
    shape: tuple[int, ...],
    num_heads: int,
    q_offset: int,
) -> tuple[TileIndex, str]:
    """Tile ``t``'s random :class:`TileIndex` and a description of it."""
    bf, n, tq, tk = shape
    b0 = int(rng.integers(0, 4))
    h0 = 0 if t == 0 else num_heads - n if t == num_tiles - 1 else int(rng.integers(0, num_heads - n + 1))
    q0 = int(rng.integers(0, 2 * tq + 1)) + q_offset
    k0 = int(rng.integers(0, 2 * tk + 1))
    per_batch = t % 2 == 1 and bf > 1
    shifts = rng.integers(0, tq + 1, size=(bf, 1, 1, 1)) if per_batch else np.zeros((1, 1, 1, 1), dtype=np.int64)

    def ints(a: Any) -> Any:
        return xp.asarray(np.asarray(a, dtype=np.int64), device=device)

    idx = TileIndex(
        ints(np.arange(b0, b0 + bf).reshape(bf, 1, 1, 1)),  # (B', 1, 1, 1)
        ints(np.arange(h0, h0 + n).reshape(1, n, 1, 1)),  # (1, n, 1, 1)
        ints(q0 + shifts + np.arange(tq).reshape(1, 1, tq, 1)),  # (B'|1, 1, tq, 1)
        ints(np.arange(k0, k0 + tk).reshape(1, 1, 1, tk)),  # (1, 1, 1, tk)
        (h0, h0 + n),
        num_heads,
    )
    queries = f"queries from {q0}" + (f" + {shifts.reshape(-1).tolist()} per batch element" if per_batch else "")
    where = f"tile {t} (batch [{b0}, {b0 + bf}), heads [{h0}, {h0 + n}) of {num_heads}, {queries}, keys from {k0})"
    return idx, where


def _bind(mod: ScoreMod, xp: Any, idx: TileIndex, names: list[str]) -> tuple[Callable, Callable]:
    """``mod`` on the tile ``idx`` as a :func:`check_gradients` pair of
    ``(s, *params)``, checking what it returns as npattn does (and more)."""

    def forward(s, *values):
        out = mod.forward(s, idx, **dict(zip(names, values)))
        _check_tile(mod, "forward", out, s)
        return out, (s, values)

    def backward(ds, residuals):
        s, values = residuals
        returned = mod.backward(s, idx, ds, **dict(zip(names, values)))
        if isinstance(returned, tuple):
            if len(returned) != 2 or not isinstance(returned[1], Mapping):
                raise TypeError(
                    f"score modification {mod.name!r}: backward must return ds_in or (ds_in, {{name: dparam}}), "
                    f"got a tuple of {len(returned)}"
                )
            ds_in, shares = returned
        else:
            ds_in, shares = returned, {}
        _check_tile(mod, "backward", ds_in, ds)
        for name, value in zip(names, values):
            if name not in shares:
                raise ValueError(
                    f"score modification {mod.name!r}: backward returned no cotangent for parameter {name!r} "
                    f"(return (ds_in, {{name: dparam, ...}}); it returned {sorted(shares)})"
                )
            share = shares[name]
            if not hasattr(share, "shape") or tuple(share.shape) != tuple(value.shape):
                raise ValueError(
                    f"score modification {mod.name!r}: backward's cotangent for {name!r} has shape "
                    f"{getattr(share, 'shape', None)}, expected the parameter's {tuple(value.shape)}"
                )
            if not xp.isdtype(share.dtype, "real floating"):
                raise TypeError(
                    f"score modification {mod.name!r}: backward's cotangent for {name!r} has dtype {share.dtype}, "
                    "expected a real floating one"
                )
        extra = sorted(set(shares) - set(names))
        if extra:
            raise ValueError(
                f"score modification {mod.name!r}: backward returned cotangents for {extra}, which are not among "
                f"its parameters {names}"
            )
        return (ds_in, *(shares[name] for name in names))

    return forward, backward


def _host_copies(arrays: dict[str, Any]) -> dict[str, np.ndarray]:
    return {what: np.array(_to_host(a), copy=True) for what, a in arrays.items()}


def _check_untouched(mod: ScoreMod, role: str, arrays: dict[str, Any], copies: dict[str, np.ndarray]) -> None:
    """ValueError unless ``role`` left each of ``arrays`` as ``copies`` hold it."""
    for what, a in arrays.items():
        if not np.array_equal(_to_host(a), copies[what], equal_nan=True):
            raise ValueError(
                f"score modification {mod.name!r}: {role} wrote to its argument {what} in place "
                "(a score modification must leave s, ds and its parameters as they are)"
            )


def _check_one_tile(
    mod: ScoreMod,
    xp: Any,
    device: Any,
    rng: np.random.Generator,
    idx: TileIndex,
    names: list[str],
    labels: list[str],
    values: list[Any],
    eps: float,
    atol: float,
    rtol: float,
    jacobian: bool | str,
    max_jacobian_elements: int,
) -> GradcheckResult:
    """Every check of :func:`check_score_mod` on the tile ``idx``."""
    shape = (int(idx.batch.shape[0]), idx.heads[1] - idx.heads[0], int(idx.q.shape[2]), int(idx.k.shape[3]))

    def random_like(a_shape: tuple[int, ...], scale: float = 1.0) -> Any:
        return xp.asarray(scale * rng.standard_normal(a_shape), dtype=xp.float64, device=device)

    s, u = random_like(shape, 2.0), random_like(shape)  # (B', n, tq, tk) each
    inputs = [s, *values]
    arguments = {"s": s, **{f"parameter {name!r}": v for name, v in zip(names, values)}}
    copies = _host_copies(arguments)
    forward, backward = _bind(mod, xp, idx, names)
    probe = _Probe(xp, forward, backward, inputs)  # runs the forward once
    _check_untouched(mod, "forward", arguments, copies)
    cotangents = [xp.where(probe.finite[0], u, xp.zeros_like(u))]  # no cotangent where s' is not finite
    arguments["ds"] = cotangents[0]
    copies |= _host_copies({"ds": cotangents[0]})
    grads = probe.backward(cotangents)
    _check_untouched(mod, "backward", arguments, copies)

    result = GradcheckResult(names=["s", *labels], jacobian_checked=True)
    for i, label in enumerate(["s", *labels]):
        direction = random_like(tuple(inputs[i].shape))
        _check_random_vjp(xp, probe, cotangents, i, label, grads[i], direction, eps, atol, rtol, result)
        size = math.prod(inputs[i].shape)
        if jacobian is True or (jacobian == "auto" and size <= max_jacobian_elements):
            _check_elements(xp, device, probe, cotangents, i, label, grads[i], eps, atol, rtol, result)
        else:
            result.jacobian_checked = False
    _check_pieces(
        mod, xp, rng, idx, names, labels, s, cotangents[0], values, probe.outputs[0], grads, atol, rtol, result
    )
    return result


def _check_elements(
    xp: Any,
    device: Any,
    probe: _Probe,
    cotangents: list[Any],
    i: int,
    name: str,
    grad: Any,
    eps: float,
    atol: float,
    rtol: float,
    result: GradcheckResult,
) -> None:
    """``grad[e]`` against the central difference of ``L = <u, outputs>`` along
    each element ``e`` of input ``i``; a failure names the worst element."""
    shape = tuple(probe.inputs[i].shape)
    analytic = _to_host(grad).reshape(-1)
    numeric = np.zeros_like(analytic)
    for e in range(analytic.size):
        direction = _one_hot(xp, shape, e, device)
        plus, minus = probe.outputs_at(i, direction, eps), probe.outputs_at(i, direction, -eps)
        numeric[e] = sum(float(xp.sum(u * (p - m))) for u, p, m in zip(cotangents, plus, minus)) / (2 * eps)
    diff = np.abs(numeric - analytic)
    worst = float(np.where(np.isnan(diff), np.inf, diff).max(initial=0.0))
    result.max_abs_error[name] = max(result.max_abs_error.get(name, 0.0), worst)
    bad = ~(diff <= atol + rtol * np.abs(analytic))  # a NaN anywhere fails
    if bad.any():
        e = int(np.argmax(np.where(bad, np.where(np.isnan(diff), np.inf, diff), -1.0)))
        element = f"{name}{[int(j) for j in np.unravel_index(e, shape)]}" if shape else name
        result.failures.append(
            f"{element}: numeric {numeric[e]:.12g} vs analytic {analytic[e]:.12g} "
            f"({int(bad.sum())} of {bad.size} elements fail)"
        )


def _sub_index(idx: TileIndex, spans: Sequence[tuple[int, int]]) -> TileIndex:
    """The :class:`TileIndex` of the piece ``spans`` (one ``(start, stop)`` per
    tile axis) of the tile ``idx``, with its own global indices."""
    (b0, b1), (n0, n1), (i0, i1), (j0, j1) = spans
    q = idx.q[b0:b1, ...] if idx.q.shape[0] > 1 else idx.q  # (B'|1, 1, tq, 1)
    h0 = idx.heads[0]
    return TileIndex(
        idx.batch[b0:b1, ...],
        idx.head[:, n0:n1, ...],
        q[:, :, i0:i1, :],
        idx.k[..., j0:j1],
        (h0 + n0, h0 + n1),
        idx.num_heads,
    )


def _check_pieces(
    mod: ScoreMod,
    xp: Any,
    rng: np.random.Generator,
    idx: TileIndex,
    names: list[str],
    labels: list[str],
    s: Any,
    u: Any,
    values: list[Any],
    out: Any,
    grads: tuple,
    atol: float,
    rtol: float,
    result: GradcheckResult,
) -> None:
    """The tile cut in two at a random place along each axis: the forward and
    the ``ds`` of each piece must equal the tile's there, and the pieces'
    parameter shares must sum to the tile's."""
    cuts = [
        [(0, size)] if size == 1 else [(0, c), (c, size)]
        for size in s.shape
        for c in [int(rng.integers(1, max(size, 2)))]
    ]
    shares = [None] * len(names)
    mismatches: dict[str, tuple] = {}

    def compare(what: str, whole: Any, piece: Any, offset: tuple[int, ...]) -> None:
        a, b = _to_host(whole), _to_host(piece)
        bad = ~((a == b) | (np.abs(a - b) <= atol + rtol * np.abs(a)))
        if bad.any() and what not in mismatches:
            e = tuple(int(j) for j in np.unravel_index(int(np.argmax(bad)), bad.shape))
            mismatches[what] = (tuple(o + j for o, j in zip(offset, e)), a[e], b[e])

    for spans in itertools.product(*cuts):
        piece = tuple(slice(a, b) for a, b in spans)
        forward, backward = _bind(mod, xp, _sub_index(idx, spans), names)
        piece_out, residuals = forward(s[piece], *values)
        piece_grads = backward(u[piece], residuals)
        offset = tuple(a for a, _ in spans)
        compare("s'", out[piece], piece_out, offset)
        compare("s", grads[0][piece], piece_grads[0], offset)
        shares = [g if total is None else total + g for total, g in zip(shares, piece_grads[1:])]
    for label, whole, total in zip(labels, grads[1:], shares):
        compare(label, whole, total, (0,) * whole.ndim)
    if mismatches:
        split = ", ".join(
            f"{axis} {'+'.join(f'[{a}, {b})' for a, b in c)}"
            for axis, c in zip(("batch", "heads", "rows", "keys"), cuts)
        )
        for what, (element, whole, piece) in mismatches.items():
            role = "forward" if what == "s'" else "backward"
            named = f"{what}{list(element)}" if element else what
            result.failures.append(
                f"{named}: the {role} on the whole tile gives {whole:.12g}, on its pieces {piece:.12g} "
                f"(the tile cut as {split}; a score modification must be elementwise and use idx's global indices)"
            )
