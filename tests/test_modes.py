"""The derivative modes of issue 16: forward mode (:func:`npattn.attention_jvp`),
forward-over-reverse (:func:`npattn.attention_backward_jvp`, Hessian-vector
products) and reverse-over-reverse (:func:`npattn.attention_double_backward`),
on three paths: dense, chunked (on NumPy the fast kernels of
:mod:`npattn.modes.numpy_kernels` for the first two, the generic chunked code
for the double backward) and generic (``NPATTN_FAST_NUMPY=0``: the Array API
chunked code throughout), with drawn block sizes, 1 and non-dividing ones
included.

1. central differences in float64, hypothesis over the option matrix
   (shapes with GQA/MQA, T != S under both aligns, bool masks with fully
   masked rows, a bias as a primal in broadcast shapes with ``-inf``
   entries, causal, window, lengths down to 0, dropout, softcap, ALiBi,
   sinks, segment ids, a ``mask_mod``): ``J t`` of the JVP along each input,
   the gradients' tangents along q, k, v, bias, dout and dlse, and the double
   backward as ``d/dt <dd, backward(x + t w)> = <double_backward(dd), w>``
   for q, k, v, dout, dlse and bias (:func:`npattn.check_gradients`);
   full Jacobians of all three on tiny shapes (:func:`npattn.check_jvp`,
   :func:`npattn.check_gradients`: a failure names the element);
2. chunked against dense to ~1e-11;
3. identities: ``<u, H v> = <H u, v>`` of a scalar loss, the JVP and the
   backward as transposes, the backward's JVP and the double backward as
   transposes;
4. fully masked rows (bool mask, padding, kv_lengths 0, a ``-inf`` bias row,
   segments, a window, a ``block_mask``, with and without sinks): 0 in every
   derivative, never NaN;
5. score modifications in the JVP (``relative_position_bias``,
   ``softcap_mod``, ``head_temperature``, ``alibi_mod``, a custom
   nonlinear one, chains) against central differences; refused by the
   second-order functions;
6. empty sizes, half dtypes, the bias as a constant keyword, defaults;
7. bad input, each case naming what is wrong;
8. the backend matrix (NumPy, read-only NumPy, array-api-strict on both
   devices: the generic chunked path, torch CPU) against NumPy, with no input
   mutated.

``test_largest_central_difference_errors`` (last) prints the largest
``|numeric - analytic|`` seen per function (run with ``-s``).
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import ALL_FEATURES, attention_cases

import npattn

RNG = np.random.default_rng(1616)

#: Central-difference step and tolerance: pass when ``|numeric - analytic| <= ATOL + RTOL * |numeric|``.
EPS, ATOL, RTOL = 1e-6, 1e-7, 1e-5

#: "chunked" runs the NumPy fast kernels where they exist, "generic" the Array API
#: chunked code (``NPATTN_FAST_NUMPY=0``), forward residuals included.
PATHS = ("dense", "chunked", "generic")
NAMES = ("q", "k", "v", "bias")
FIELDS = ("dq", "dk", "dv", "dbias")

#: Largest |numeric - analytic| seen per function (filled as the tests run).
ERRORS: dict[str, float] = defaultdict(float)


def stripes(idx):
    """A mask modification reading every index: hides about a quarter of the
    entries, differently per batch element, head and position."""
    return ((idx.q + 2 * idx.k + 3 * idx.head + 5 * idx.batch) % 4) != 0


def same_half(idx):
    """Two documents of keys, [0, 3) and [3, ...): a query sees the keys of its
    position's document (positions clipped into the keys)."""
    xp = array_api_compat.array_namespace(idx.q)
    return (xp.clip(idx.q, 0, None) < 3) == (idx.k < 3)


def hide_row_1(idx):
    """Query row 1 sees no key."""
    return (idx.q != 1) | (idx.k < 0)


# --- problems: primals, options and random directions --------------------------------------------


@dataclass
class Problem:
    """``primals`` ``(q, k, v[, bias])``, the options without the bias or the
    path's, and random arrays: ``tangents`` like the primals, the backward's
    cotangents ``dout``, ``dlse`` (None: not passed) and their tangents, and
    ``dd``, cotangents of ``(dq, dk, dv[, dbias])``."""

    primals: tuple
    options: dict
    blocks: tuple[int, int]
    tangents: tuple
    dout: np.ndarray
    dlse: np.ndarray | None
    dout_dot: np.ndarray
    dlse_dot: np.ndarray
    dd: tuple
    seed: int

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name}{a.shape}" for name, a in zip(NAMES, self.primals))
        opts = {key: (f"array{np.shape(val)}" if hasattr(val, "shape") else val) for key, val in self.options.items()}
        dlse = "None" if self.dlse is None else "given"
        return f"Problem({shapes}, {opts}, blocks={self.blocks}, dlse {dlse})"

    @property
    def has_bias(self) -> bool:
        return len(self.primals) == 4

    @contextlib.contextmanager
    def on(self, path: str):
        """Yield the options for ``path`` (``NPATTN_FAST_NUMPY=0`` on "generic")."""
        with pytest.MonkeyPatch.context() as patch:
            if path == "dense":
                yield {**self.options, "impl": "dense"}
                return
            if path == "generic":
                patch.setenv("NPATTN_FAST_NUMPY", "0")
            yield {**self.options, "impl": "chunked", "block_q": self.blocks[0], "block_k": self.blocks[1]}


def make_problem(q, k, v, options, rng, *, blocks=(2, 3), dlse=True) -> Problem:
    """A :class:`Problem`; a ``bias`` in ``options`` becomes the fourth primal."""
    options = dict(options)
    bias = options.pop("bias", None)
    primals = (q, k, v) if bias is None else (q, k, v, bias)
    N, T, Hv = q.shape[-3], q.shape[-2], v.shape[-1]
    out_shape, lse_shape = q.shape[:-3] + (N, T, Hv), q.shape[:-3] + (N, T)
    return Problem(
        primals=primals,
        options=options,
        blocks=blocks,
        tangents=tuple(rng.standard_normal(a.shape) for a in primals),
        dout=rng.standard_normal(out_shape),
        dlse=rng.standard_normal(lse_shape) if dlse else None,
        dout_dot=rng.standard_normal(out_shape),
        dlse_dot=rng.standard_normal(lse_shape),
        dd=tuple(rng.standard_normal(a.shape) for a in primals),
        seed=int(rng.integers(0, 2**31)),
    )


@st.composite
def problems(draw, *, max_len=5, features=ALL_FEATURES + ("masked_row",)):
    """Every feature of :func:`strategies.attention_cases` and its variants,
    sometimes a ``mask_mod``, drawn block sizes (1 and non-dividing ones
    included), dlse or none."""
    case = draw(attention_cases(max_len=max_len, features=features))
    options = dict(case.options)
    if draw(st.integers(0, 3)) == 0:
        options["mask_mod"] = stripes
        if "align" not in options and case.q.shape[-2] != case.k.shape[-2]:
            options["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    blocks = (draw(st.integers(1, max_len + 1)), draw(st.integers(1, max_len + 2)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return make_problem(case.q, case.k, case.v, options, rng, blocks=blocks, dlse=draw(st.booleans()))


# --- the functions under test, and central differences ------------------------------------------


def _forward(primals, options):
    q, k, v, *bias = primals
    return npattn.attention_forward(q, k, v, **options, **({"bias": bias[0]} if bias else {}))


def _out_lse(primals, options):
    out, res = _forward(primals, options)
    return out, res.lse


def _gradients(primals, options, dout, dlse):
    """``(dq, dk, dv[, dbias])`` of attention at ``primals``."""
    _, res = _forward(primals, options)
    g = npattn.attention_backward(dout, res, dlse=dlse)
    return (g.dq, g.dk, g.dv) + ((g.dbias,) if len(primals) == 4 else ())


def _moved(arrays, directions, step):
    return tuple(a if d is None else a + step * d for a, d in zip(arrays, directions))


def _only(arrays, i):
    """Zeros like ``arrays``, but ``arrays[i]``."""
    return tuple(a if j == i else np.zeros_like(a) for j, a in enumerate(arrays))


def _check(function: str, what: str, analytic, numeric) -> float:
    """Assert ``analytic`` equals the central difference ``numeric`` and keep
    the largest error per function in :data:`ERRORS`; return it."""
    analytic, numeric = np.asarray(analytic, np.float64), np.asarray(numeric, np.float64)
    assert analytic.shape == numeric.shape, f"{function} {what}: shape {analytic.shape} != {numeric.shape}"
    diff = np.abs(analytic - numeric)
    worst = float(np.where(np.isnan(diff), np.inf, diff).max(initial=0.0))
    ERRORS[function] = max(ERRORS[function], worst)
    bad = ~(diff <= ATOL + RTOL * np.abs(numeric))  # NaN fails
    if bad.any():
        at = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(diff, nan=np.inf), -1))), bad.shape)
        at = tuple(int(i) for i in at)
        raise AssertionError(
            f"{function} {what}: analytic {analytic[at]!r} vs numeric {numeric[at]!r} at {at} "
            f"({int(bad.sum())} of {bad.size} entries fail, largest error {worst:.3g})"
        )
    return worst


def _inner(xs, ys) -> tuple[float, float]:
    """``(sum_i <x_i, y_i>, sum_i <|x_i|, |y_i|>)`` over pairs with neither None."""
    pairs = [
        (np.asarray(x, np.float64), np.asarray(y, np.float64))
        for x, y in zip(xs, ys)
        if x is not None and y is not None
    ]
    return sum(float(np.sum(x * y)) for x, y in pairs), sum(float(np.sum(np.abs(x * y))) for x, y in pairs)


def _assert_same(got, want, what: str, tol: float = 1e-11) -> None:
    """``got`` equals ``want`` to ``tol`` relative to ``want``'s scale; the same -inf entries."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf entries")
    finite = np.isfinite(want)
    assert np.isfinite(got[finite]).all(), f"{what}: non-finite entries"
    scale = 1.0 + float(np.abs(want[finite]).max(initial=0.0))
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=tol * scale, err_msg=what)


def _double_backward_pair(options, with_bias):
    """``(q, k, v, dout, dlse[, bias]) -> ((dq, dk, dv[, dbias]), residuals)`` and
    its VJP by :func:`npattn.attention_double_backward`, for
    :func:`npattn.check_gradients`."""

    def forward(q, k, v, dout, dlse, *bias):
        _, res = _forward((q, k, v, *bias), options)
        g = npattn.attention_backward(dout, res, dlse=dlse)
        return (g.dq, g.dk, g.dv) + ((g.dbias,) if with_bias else ()), (res, dout, dlse)

    def backward(cotangents, saved):
        res, dout, dlse = saved
        ddq, ddk, ddv, *ddbias = cotangents
        c = npattn.attention_double_backward(
            ddq, ddk, ddv, res, dout, ddbias=ddbias[0] if with_bias else None, dlse=dlse
        )
        return (c.dq, c.dk, c.dv, c.ddout, c.ddlse) + ((c.dbias,) if with_bias else ())

    return forward, backward


def _check_jvp_along_each_input(problem: Problem, options: dict) -> None:
    """The JVP along each primal alone against central differences of (out, lse);
    the primal outputs equal the forward's; the JVP is linear in the tangents."""
    primals, tangents = problem.primals, problem.tangents
    out, lse, out_dot, lse_dot = npattn.attention_jvp(primals, tangents, **options)
    want_out, want_lse = _out_lse(primals, options)
    _assert_same(out, want_out, "out", tol=1e-12)
    _assert_same(lse, want_lse, "lse", tol=1e-12)
    masked = np.isneginf(lse)
    assert np.all(out_dot[masked] == 0) and np.all(lse_dot[masked] == 0), "fully masked rows"
    total_out, total_lse = np.zeros_like(out_dot), np.zeros_like(lse_dot)
    for i, name in enumerate(NAMES[: len(primals)]):
        one = _only(tangents, i)
        _, _, o_dot, l_dot = npattn.attention_jvp(primals, one, **options)
        plus, minus = _out_lse(_moved(primals, one, EPS), options), _out_lse(_moved(primals, one, -EPS), options)
        _check("attention_jvp", f"out' along {name}", o_dot, (plus[0] - minus[0]) / (2 * EPS))
        numeric_lse = np.where(masked, 0.0, plus[1] - np.where(masked, 0.0, minus[1])) / (2 * EPS)
        _check("attention_jvp", f"lse' along {name}", np.where(masked, 0.0, l_dot), numeric_lse)
        assert np.all(l_dot[masked] == 0), f"lse' along {name} on fully masked rows"
        total_out, total_lse = total_out + o_dot, total_lse + l_dot
    _assert_same(out_dot, total_out, "out' is linear in the tangents", tol=1e-12)
    _assert_same(lse_dot, total_lse, "lse' is linear in the tangents", tol=1e-12)


def _check_backward_jvp_along_each_input(problem: Problem, options: dict) -> None:
    """The gradients' tangents along q, k, v, bias, dout and dlse, one at a time,
    against central differences of attention_backward."""
    primals = problem.primals
    _, res = _forward(primals, options)
    dlse = problem.dlse
    zero = tuple(np.zeros_like(a) for a in primals)
    directions = [(name, _only(problem.tangents, i), None, None) for i, name in enumerate(NAMES[: len(primals)])]
    directions += [("dout", zero, problem.dout_dot, None), ("dlse", zero, None, problem.dlse_dot)]
    total = None
    for name, tangents, dout_dot, dlse_dot in directions:
        got = npattn.attention_backward_jvp(
            problem.dout, res, tangents, dlse=dlse, dout_dot=dout_dot, dlse_dot=dlse_dot
        )
        assert got.dsinks is None and got.dalibi_slopes is None and got.dmods is None
        assert (got.dbias is None) == (not problem.has_bias)

        def at(step, tangents=tangents, dout_dot=dout_dot, dlse_dot=dlse_dot):
            dout = problem.dout if dout_dot is None else problem.dout + step * dout_dot
            moved_dlse = dlse
            if dlse_dot is not None:
                moved_dlse = step * dlse_dot if dlse is None else dlse + step * dlse_dot
            return _gradients(_moved(primals, tangents, step), options, dout, moved_dlse)

        plus, minus = at(EPS), at(-EPS)
        for field, p, m in zip(FIELDS, plus, minus):
            _check("attention_backward_jvp", f"{field}' along {name}", getattr(got, field), (p - m) / (2 * EPS))
        parts = [getattr(got, field) for field in FIELDS[: len(primals)]]
        total = parts if total is None else [t + p for t, p in zip(total, parts)]
    together = npattn.attention_backward_jvp(
        problem.dout, res, problem.tangents, dlse=dlse, dout_dot=problem.dout_dot, dlse_dot=problem.dlse_dot
    )
    for field, part_sum in zip(FIELDS, total):
        _assert_same(getattr(together, field), part_sum, f"{field}' is linear in the tangents", tol=1e-12)


def _check_double_backward(problem: Problem, options: dict, *, jacobian: bool = False) -> None:
    """``d/dt <dd, backward(x + t w)> = <double_backward(dd), w>`` for q, k, v,
    dout, dlse and bias, by :func:`npattn.check_gradients` (random ``dd`` and
    ``w``; and with ``jacobian`` the full Jacobian)."""
    q, k, v, *bias = problem.primals
    dlse = problem.dlse if problem.dlse is not None else problem.dlse_dot
    forward, backward = _double_backward_pair(options, bool(bias))
    names = ["q", "k", "v", "dout", "dlse"] + (["bias"] if bias else [])
    result = npattn.check_gradients(
        forward,
        backward,
        [q, k, v, problem.dout, dlse, *bias],
        names=names,
        seed=problem.seed,
        eps=EPS,
        atol=ATOL,
        rtol=RTOL,
        jacobian=jacobian,
        max_jacobian_elements=10**6,
        raise_on_failure=False,
    )
    worst = max(result.max_abs_error.values())
    ERRORS["attention_double_backward"] = max(ERRORS["attention_double_backward"], worst)
    assert result.ok, str(result)
    assert set(result.max_abs_error) == set(names)
    assert result.jacobian_checked == jacobian


# --- 1. central differences over the option matrix ----------------------------------------------


@settings(max_examples=50, deadline=None)
@given(problem=problems())
@pytest.mark.parametrize("path", PATHS)
def test_jvp_matches_central_differences(path, problem):
    with problem.on(path) as options:
        _check_jvp_along_each_input(problem, options)


@settings(max_examples=40, deadline=None)
@given(problem=problems())
@pytest.mark.parametrize("path", PATHS)
def test_backward_jvp_matches_central_differences(path, problem):
    with problem.on(path) as options:
        _check_backward_jvp_along_each_input(problem, options)


@settings(max_examples=40, deadline=None)
@given(problem=problems())
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_central_differences(path, problem):
    with problem.on(path) as options:
        _check_double_backward(problem, options)


def _tiny(batch=(1,), N=2, K=1, T=2, S=3, H=2, Hv=2, rng=RNG):
    return (
        rng.standard_normal((*batch, N, T, H)),
        rng.standard_normal((*batch, K, S, H)),
        rng.standard_normal((*batch, K, S, Hv)),
    )


#: Tiny cases for full Jacobians (``_T`` etc. set the shapes).
TINY = {
    "plain": dict(),
    "bias (N, 1, S), causal bottom_right, T < S": dict(
        bias=RNG.standard_normal((2, 1, 3)), causal=True, align="bottom_right"
    ),
    "softcap 0.7 + bias (T, S) with -inf + dropout, GQA": dict(
        softcap=0.7,
        bias=np.array([[0.3, -np.inf, -0.2], [-np.inf, 0.5, 1.0]]),
        dropout_p=0.4,
        seed=5,
        _N=4,
        _K=2,
    ),
    "sinks + alibi + segments + mask, top_left T > S": dict(
        sinks=np.array([0.5, -1.0]),
        alibi_slopes=np.array([0.5, 0.25]),
        q_segment_ids=np.array([[0, 0, 1, 1]]),
        kv_segment_ids=np.array([[0, 1, 1]]),
        mask=np.array([[True, True, False], [True, True, True], [False, False, False], [True, False, True]]),
        align="top_left",
        _T=4,
    ),
    "window + lengths (a padded row) + block_mask, batch 2": dict(
        window=(1, 0),
        align="bottom_right",
        q_lengths=np.array([2, 1]),
        kv_lengths=np.array([3, 2]),
        block_mask=npattn.block_mask(
            same_half,
            2,
            3,
            block_q=1,
            block_k=2,
            align="bottom_right",
            batch_shape=(2,),
            q_lengths=np.array([2, 1]),
            kv_lengths=np.array([3, 2]),
        ),
        _batch=(2,),
    ),
}


def _tiny_problem(case: str) -> Problem:
    options = dict(TINY[case])
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    rng = np.random.default_rng(len(case))
    return make_problem(*_tiny(**dims, rng=rng), options, rng, blocks=(1, 2))


def _record(function: str, result) -> None:
    """Keep a checker's largest error in :data:`ERRORS`, then assert it passed."""
    ERRORS[function] = max(ERRORS[function], max(result.max_abs_error.values()))
    assert result.ok and result.jacobian_checked, str(result)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(TINY))
def test_full_jacobians_on_tiny_shapes(case, path):
    """Full Jacobians against central differences, each failure naming the
    input element: the JVP's and the backward JVP's (the latter a JVP of
    ``(q, k, v[, bias], dout, dlse) -> (dq, dk, dv[, dbias])``) by
    :func:`npattn.check_jvp`, the double backward's by
    :func:`npattn.check_gradients`."""
    problem = _tiny_problem(case)
    names = list(NAMES[: len(problem.primals)])
    check = dict(eps=EPS, atol=ATOL, rtol=RTOL, seed=problem.seed, jacobian=True, raise_on_failure=False)
    with problem.on(path) as options:

        def jvp(primals, tangents):
            return npattn.attention_jvp(primals, tangents, **options)

        result = npattn.check_jvp(
            lambda *primals: _out_lse(primals, options), jvp, problem.primals, names=names, **check
        )
        _record("attention_jvp", result)

        def gradients(*args):
            *primals, dout, dlse = args
            return _gradients(tuple(primals), options, dout, dlse)

        def gradients_jvp(args, tangents):
            *primals, dout, dlse = args
            *primals_dot, dout_dot, dlse_dot = tangents
            _, res = _forward(tuple(primals), options)
            got = npattn.attention_backward_jvp(
                dout, res, tuple(primals_dot), dlse=dlse, dout_dot=dout_dot, dlse_dot=dlse_dot
            )
            return gradients(*args), tuple(getattr(got, field) for field in FIELDS[: len(primals)])

        inputs = [*problem.primals, problem.dout, problem.dlse]
        result = npattn.check_jvp(gradients, gradients_jvp, inputs, names=[*names, "dout", "dlse"], **check)
        _record("attention_backward_jvp", result)
        _check_double_backward(problem, options, jacobian=True)


# --- 2. chunked against dense --------------------------------------------------------------------


def _all_modes(problem: Problem, options: dict) -> dict:
    """Every output of the three functions, by name."""
    jvp = npattn.attention_jvp(problem.primals, problem.tangents, **options)
    _, res = _forward(problem.primals, options)
    hvp = npattn.attention_backward_jvp(
        problem.dout, res, problem.tangents, dlse=problem.dlse, dout_dot=problem.dout_dot, dlse_dot=problem.dlse_dot
    )
    ddbias = problem.dd[3] if problem.has_bias else None
    cot = npattn.attention_double_backward(*problem.dd[:3], res, problem.dout, ddbias=ddbias, dlse=problem.dlse)
    got = dict(zip(("out", "lse", "out'", "lse'"), jvp))
    got.update({f"{field}'": getattr(hvp, field) for field in FIELDS})
    got.update({f"cot {field}": value for field, value in cot._asdict().items()})
    return got


@settings(max_examples=80, deadline=None)
@given(problem=problems(max_len=6))
def test_chunked_equals_dense(problem):
    """The NumPy fast kernels and the generic chunked code, at the drawn block sizes."""
    with problem.on("dense") as options:
        want = _all_modes(problem, options)
    for path in ("chunked", "generic"):
        with problem.on(path) as options:
            got = _all_modes(problem, options)
        assert got.keys() == want.keys()
        for name, value in want.items():
            if value is None:
                assert got[name] is None, name
            else:
                _assert_same(got[name], value, f"{name} {path} {problem.blocks} vs dense")


@settings(max_examples=15, deadline=None)
@given(problem=problems(max_len=4))
@pytest.mark.parametrize("device", [None, "device1"])
def test_array_api_strict_chunked_equals_numpy_dense(device, problem):
    """array-api-strict (no NumPy-only call, ``device=`` everywhere) through the
    generic chunked code over the option matrix: equal to NumPy's dense results."""
    xps = pytest.importorskip("array_api_strict")
    to = (lambda a: xps.asarray(a, device=xps.Device(device))) if device else xps.asarray

    def move(arrays):
        return tuple(None if a is None else to(a) for a in arrays)

    strict = Problem(
        primals=move(problem.primals),
        options={key: to(value) if hasattr(value, "shape") else value for key, value in problem.options.items()},
        blocks=problem.blocks,
        tangents=move(problem.tangents),
        dout=to(problem.dout),
        dlse=None if problem.dlse is None else to(problem.dlse),
        dout_dot=to(problem.dout_dot),
        dlse_dot=to(problem.dlse_dot),
        dd=move(problem.dd),
        seed=problem.seed,
    )
    with problem.on("dense") as options:
        want = _all_modes(problem, options)
    with strict.on("chunked") as options:
        got = _all_modes(strict, options)
    cpu = xps.Device("CPU_DEVICE")
    for name, value in got.items():
        if value is None:
            assert want[name] is None, name
            continue
        assert value.device == strict.primals[0].device, name
        _assert_same(np.asarray(xps.asarray(value, device=cpu, copy=True)), want[name], f"strict {name}")


# --- 3. identities -------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(problem=problems(), data=st.data())
@pytest.mark.parametrize("path", PATHS)
def test_hessian_of_a_scalar_loss_is_symmetric(path, problem, data):
    """``L = <dout, out> + <dlse, lse>``: ``H w = attention_backward_jvp(dout,
    res, w, dlse=dlse)`` (dout_dot = 0) gives ``<u, H w> = <H u, w>``."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    u = problem.tangents
    w = tuple(rng.standard_normal(a.shape) for a in problem.primals)
    with problem.on(path) as options:
        _, res = _forward(problem.primals, options)
        Hu, Hw = (
            npattn.attention_backward_jvp(problem.dout, res, t, dlse=problem.dlse, dout_dot=np.zeros_like(problem.dout))
            for t in (u, w)
        )
    u_Hw, size1 = _inner(u, [getattr(Hw, field) for field in FIELDS])
    Hu_w, size2 = _inner([getattr(Hu, field) for field in FIELDS], w)
    assert abs(u_Hw - Hu_w) <= 1e-12 * (1 + size1 + size2), (u_Hw, Hu_w)


@settings(max_examples=30, deadline=None)
@given(problem=problems())
@pytest.mark.parametrize("path", PATHS)
def test_the_modes_are_transposes(path, problem):
    """``<u, J t> = <J^T u, t>`` twice: the JVP against attention_backward
    (cotangents of out and lse), and the backward's JVP against the double
    backward (tangents of q, k, v, bias, dout, dlse; cotangents of dq, dk,
    dv, dbias)."""
    with problem.on(path) as options:
        _, _, out_dot, lse_dot = npattn.attention_jvp(problem.primals, problem.tangents, **options)
        _, res = _forward(problem.primals, options)
        dlse = problem.dlse if problem.dlse is not None else np.zeros_like(problem.dlse_dot)
        g = npattn.attention_backward(problem.dout, res, dlse=dlse)
        left, size1 = _inner((problem.dout, np.where(np.isneginf(res.lse), 0.0, dlse)), (out_dot, lse_dot))
        right, size2 = _inner(problem.tangents, [getattr(g, field) for field in FIELDS])
        assert abs(left - right) <= 1e-12 * (1 + size1 + size2), ("JVP vs VJP", left, right)

        hvp = npattn.attention_backward_jvp(
            problem.dout, res, problem.tangents, dlse=dlse, dout_dot=problem.dout_dot, dlse_dot=problem.dlse_dot
        )
        ddbias = problem.dd[3] if problem.has_bias else None
        cot = npattn.attention_double_backward(*problem.dd[:3], res, problem.dout, ddbias=ddbias, dlse=dlse)
        left, size1 = _inner(problem.dd, [getattr(hvp, field) for field in FIELDS])
        cots = [cot.dq, cot.dk, cot.dv, cot.dbias, cot.ddout, cot.ddlse]
        right, size2 = _inner(
            cots,
            [
                *problem.tangents[:3],
                problem.tangents[3] if problem.has_bias else None,
                problem.dout_dot,
                problem.dlse_dot,
            ],
        )
        assert abs(left - right) <= 1e-12 * (1 + size1 + size2), ("backward JVP vs double backward", left, right)


# --- 4. fully masked rows ------------------------------------------------------------------------

#: Each hides whole query rows in its own way (batch (2,), N=2, K=1, T=4, S=5).
MASKED_ROWS = {
    "bool mask": dict(mask=np.array([True, False, True, True])[:, None] & np.ones(5, bool)),
    "padding and an empty sequence": dict(q_lengths=np.array([2, 4]), kv_lengths=np.array([5, 0])),
    "-inf bias row": dict(bias=np.where(np.arange(4)[:, None] == 2, -np.inf, RNG.standard_normal((4, 5)))),
    "segments no key shares": dict(
        q_segment_ids=np.array([[0, 7, 1, 1], [2, 2, 0, 0]]),
        kv_segment_ids=np.array([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]),
    ),
    "causal bottom_right T > S": dict(causal=True, align="bottom_right", _T=7),
    "window (0, 0) + kv_lengths": dict(window=(0, 0), kv_lengths=np.array([2, 5]), align="top_left"),
    "block_mask hiding a row": dict(
        block_mask=npattn.block_mask(hide_row_1, 4, 5, block_q=2, block_k=2, align="top_left"), align="top_left"
    ),
    "sinks + bool mask + padding + dropout + softcap": dict(
        sinks=np.array([0.3, -2.0]),
        mask=np.array([True, True, False, True])[:, None] & np.ones(5, bool),
        q_lengths=np.array([3, 4]),
        dropout_p=0.3,
        seed=1,
        softcap=2.0,
    ),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(MASKED_ROWS))
def test_fully_masked_rows_give_zero_in_every_derivative(case, path):
    """Rows with no visible key: out' = lse' = 0, the rows of dq', of the
    double backward's dq, ddout and ddlse are 0, nothing is NaN; and
    tangents and cotangents that live only on those rows move nothing."""
    options = dict(MASKED_ROWS[case])
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    rng = np.random.default_rng(len(case))
    q, k, v = _tiny(batch=(2,), N=2, K=1, T=dims.get("T", 4), S=5, H=3, Hv=2, rng=rng)
    problem = make_problem(q, k, v, options, rng, blocks=(3, 2))
    with problem.on("dense") as dense:
        _, dense_res = _forward(problem.primals, dense)
    rows = np.all(dense_res.probs == 0, axis=-1)  # (B, N, T): no real key visible
    assert rows.any(), "the case hides no row"
    with problem.on(path) as options:
        _, res = _forward(problem.primals, options)
        _, _, out_dot, lse_dot = npattn.attention_jvp(problem.primals, problem.tangents, **options)
        hvp = npattn.attention_backward_jvp(
            problem.dout, res, problem.tangents, dlse=problem.dlse, dout_dot=problem.dout_dot, dlse_dot=problem.dlse_dot
        )
        ddbias = problem.dd[3] if problem.has_bias else None
        cot = npattn.attention_double_backward(*problem.dd[:3], res, problem.dout, ddbias=ddbias, dlse=problem.dlse)
        results = [out_dot, lse_dot, *hvp[:4], *cot]
        for value in results:
            assert value is None or np.isfinite(value).all()
        for name, value in (("out'", out_dot), ("lse'", lse_dot), ("dq'", hvp.dq), ("cot dq", cot.dq)):
            assert np.all(value[rows] == 0), name
        assert np.all(cot.ddout[rows] == 0) and np.all(cot.ddlse[rows] == 0)

        # Tangents and cotangents only on those rows.
        on_rows = rows[..., None]  # (B, N, T, 1)
        q_rows = np.where(on_rows, problem.tangents[0], 0.0)
        zeros = tuple(np.zeros_like(a) for a in problem.primals)
        _, _, out_dot, lse_dot = npattn.attention_jvp(problem.primals, (q_rows, *zeros[1:]), **options)
        assert not out_dot.any() and not lse_dot.any()
        dout_rows = np.where(on_rows, problem.dout, 0.0)
        hvp = npattn.attention_backward_jvp(
            dout_rows,
            res,
            problem.tangents,
            dlse=np.where(rows, problem.dlse, 0.0),
            dout_dot=np.where(on_rows, problem.dout_dot, 0.0),
            dlse_dot=np.where(rows, problem.dlse_dot, 0.0),
        )
        for field in FIELDS[: len(problem.primals)]:
            assert not getattr(hvp, field).any(), field
        ddbias = np.zeros_like(problem.primals[3]) if problem.has_bias else None
        cot = npattn.attention_double_backward(
            np.where(on_rows, problem.dd[0], 0.0), *zeros[1:3], res, dout_rows, ddbias=ddbias, dlse=problem.dlse
        )
        for field, value in cot._asdict().items():
            assert value is None or not value.any(), field


# --- 5. score modifications ----------------------------------------------------------------------


def wiggle(amplitude: float) -> npattn.ScoreMod:
    """A nonlinear modification without parameters: ``s + a sin(s)``."""

    def forward(s, idx):
        return s + amplitude * array_api_compat.array_namespace(s).sin(s)

    def backward(s, idx, ds):
        return ds * (1 + amplitude * array_api_compat.array_namespace(s).cos(s))

    return npattn.ScoreMod(forward, backward, name="wiggle")


SCORE_MOD_CASES = {
    "relative_position_bias, causal, bias": lambda rng: dict(
        score_mods=[npattn.relative_position_bias(rng.standard_normal((4, 8)), max_distance=8)],
        causal=True,
        align="top_left",
        bias=rng.standard_normal((4, 1, 6)),
    ),
    "softcap_mod, GQA, bias (T, S), bottom_right": lambda rng: dict(
        score_mods=[npattn.softcap_mod(0.8)], bias=rng.standard_normal((4, 6)), align="bottom_right"
    ),
    "head_temperature + alibi_mod + mask_mod": lambda rng: dict(
        score_mods=[npattn.head_temperature(rng.uniform(0.5, 2.0, 4)), npattn.alibi_mod(rng.uniform(0, 1, 4))],
        mask_mod=stripes,
        align="top_left",
    ),
    "relative bias + block_mask, lengths, sinks, softcap": lambda rng: dict(
        score_mods=[npattn.relative_position_bias(rng.standard_normal((4, 4)), bidirectional=False)],
        block_mask=npattn.block_mask(
            same_half,
            4,
            6,
            block_q=2,
            block_k=4,
            align="bottom_right",
            batch_shape=(2,),
            q_lengths=np.array([4, 3]),
            kv_lengths=np.array([6, 4]),
        ),
        align="bottom_right",
        q_lengths=np.array([4, 3]),
        kv_lengths=np.array([6, 4]),
        sinks=rng.standard_normal(4),
        softcap=1.5,
    ),
    "wiggle after softcap_mod, dropout, bias": lambda rng: dict(
        score_mods=[npattn.softcap_mod(2.0), wiggle(0.4)],
        dropout_p=0.25,
        seed=3,
        bias=rng.standard_normal((2, 4, 1, 6)),
        align="top_left",
    ),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(SCORE_MOD_CASES))
def test_score_mods_in_the_jvp_match_central_differences(case, path):
    """Score modifications enter the JVP through their elementwise backward;
    their parameters are constants (batch 2, N=4, K=2, T=4, S=6)."""
    rng = np.random.default_rng(len(case) + 16)
    q, k, v = _tiny(batch=(2,), N=4, K=2, T=4, S=6, H=3, Hv=2, rng=rng)
    problem = make_problem(q, k, v, SCORE_MOD_CASES[case](rng), rng, blocks=(3, 4))
    with problem.on(path) as options:
        _check_jvp_along_each_input(problem, options)


@settings(max_examples=25, deadline=None)
@given(problem=problems(), data=st.data())
@pytest.mark.parametrize("path", PATHS)
def test_score_mods_in_the_jvp_over_the_option_matrix(path, problem, data):
    """A drawn chain of shipped modifications (and the custom one) with every
    drawn option (a bias primal with -inf entries included), against central
    differences."""
    N = problem.primals[0].shape[-3]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    makers = {
        "relative": lambda: npattn.relative_position_bias(rng.standard_normal((N, 8)), max_distance=8, name="rel"),
        "softcap": lambda: npattn.softcap_mod(data.draw(st.sampled_from([0.3, 2.0]))),
        "temperature": lambda: npattn.head_temperature(rng.uniform(0.5, 2.0, N), name="temp"),
        "alibi": lambda: npattn.alibi_mod(rng.uniform(0.0, 1.0, N), name="slopes"),
        "wiggle": lambda: wiggle(0.3),
    }
    kinds = data.draw(st.lists(st.sampled_from(list(makers)), min_size=1, max_size=2, unique=True))
    problem.options["score_mods"] = [makers[kind]() for kind in kinds]
    if "align" not in problem.options:
        problem.options["align"] = data.draw(st.sampled_from(["top_left", "bottom_right"]))
    with problem.on(path) as options:
        _check_jvp_along_each_input(problem, options)


@pytest.mark.parametrize("path", PATHS)
def test_score_mods_are_refused_in_second_order(path):
    """NotImplementedError naming the function and ``score_mods``, on every
    path; a mask modification alone is accepted."""
    q, k, v = _tiny(batch=(2,), N=2, K=1, T=3, S=3)
    mods = [npattn.relative_position_bias(RNG.standard_normal((2, 4))), wiggle(0.1)]
    problem = make_problem(q, k, v, dict(score_mods=mods), RNG)
    zeros = (np.zeros_like(q), np.zeros_like(k), np.zeros_like(v))
    with problem.on(path) as options:
        out, res = _forward(problem.primals, options)
        with pytest.raises(NotImplementedError, match=r"attention_backward_jvp with score_mods.*second"):
            npattn.attention_backward_jvp(out, res, zeros)
        with pytest.raises(NotImplementedError, match=r"attention_double_backward with score_mods.*second"):
            npattn.attention_double_backward(*zeros, res, out)
        out, res = _forward(problem.primals, {**options, "score_mods": None, "mask_mod": stripes})
        assert npattn.attention_backward_jvp(out, res, zeros).dq.shape == q.shape
        assert npattn.attention_double_backward(*zeros, res, out).dq.shape == q.shape


# --- 6. sizes, dtypes, defaults ------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("shapes", ["T=0", "batch 0"])
@pytest.mark.parametrize("function", ["attention_jvp", "attention_backward_jvp", "attention_double_backward"])
def test_empty_sizes(function, shapes, bias, path):
    """T = 0 or a batch axis of 0 (causal bottom_right, GQA): each function
    returns zeros of the right shapes, as the first-order paths do."""
    batch, T = ((2,), 0) if shapes == "T=0" else ((0,), 3)
    rng = np.random.default_rng(0)
    q, k, v = _tiny(batch=batch, N=4, K=2, T=T, S=5, H=3, Hv=2, rng=rng)
    options = dict(causal=True, align="bottom_right")
    if bias:
        options["bias"] = rng.standard_normal((4, 1, 5))
    problem = make_problem(q, k, v, options, rng)
    out, lse = (*batch, 4, T, 2), (*batch, 4, T)
    with problem.on(path) as options:
        _, res = _forward(problem.primals, options)
        if function == "attention_jvp":
            got = npattn.attention_jvp(problem.primals, problem.tangents, **options)
            shapes = [out, lse, out, lse]
        elif function == "attention_backward_jvp":
            got = npattn.attention_backward_jvp(
                problem.dout, res, problem.tangents, dlse=problem.dlse, dout_dot=problem.dout_dot
            )[:4]
            shapes = [a.shape for a in problem.primals] + [None] * (4 - len(problem.primals))
        else:
            ddbias = problem.dd[3] if bias else None
            got = npattn.attention_double_backward(*problem.dd[:3], res, problem.dout, ddbias=ddbias, dlse=problem.dlse)
            shapes = [q.shape, k.shape, v.shape, out, (4, 1, 5) if bias else None, lse]
    for value, shape in zip(got, shapes, strict=True):
        if shape is None:
            assert value is None
        else:
            assert tuple(value.shape) == shape and not np.any(value)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_half_and_single_precision(dtype, path):
    """Outputs in the input dtype (lse, lse' and ddlse in the compute dtype,
    float32), near the float64 results."""
    rng = np.random.default_rng(3)
    q, k, v = _tiny(batch=(2,), N=4, K=2, T=4, S=5, H=3, Hv=2, rng=rng)
    problem = make_problem(q, k, v, dict(bias=rng.standard_normal((4, 5)), causal=True, align="top_left"), rng)
    with problem.on(path) as options:
        want = _all_modes(problem, options)
    low = dataclasses_replace_dtype(problem, dtype)
    with low.on(path) as options:
        got = _all_modes(low, options)
    compute = {"lse", "lse'", "cot ddlse"}
    tol = 2e-5 if dtype == np.float32 else 2e-2
    for name, value in got.items():
        assert value.dtype == (np.float32 if name in compute else dtype), name
        _assert_same(value.astype(np.float64), want[name], f"{name} in {np.dtype(dtype).name}", tol=tol)


def dataclasses_replace_dtype(problem: Problem, dtype) -> Problem:
    """``problem`` with every array in ``dtype`` (lse's cotangents in float32, the compute dtype)."""

    def cast(a, to=dtype):
        return None if a is None else a.astype(to)

    return Problem(
        primals=tuple(cast(a) for a in problem.primals),
        options=problem.options,
        blocks=problem.blocks,
        tangents=tuple(cast(a) for a in problem.tangents),
        dout=cast(problem.dout),
        dlse=cast(problem.dlse, np.float32),
        dout_dot=cast(problem.dout_dot),
        dlse_dot=cast(problem.dlse_dot, np.float32),
        dd=tuple(cast(a) for a in problem.dd),
        seed=problem.seed,
    )


@pytest.mark.parametrize("path", PATHS)
def test_a_bias_keyword_is_a_constant_and_defaults_are_zeros(path):
    """``bias=`` as a keyword (not a primal) is held constant in the JVP;
    dout_dot/dlse_dot None equal zeros, dlse None equals zeros."""
    rng = np.random.default_rng(9)
    q, k, v = _tiny(batch=(2,), N=4, K=2, T=4, S=5, H=3, Hv=2, rng=rng)
    bias = rng.standard_normal((4, 1, 5))
    problem = make_problem(q, k, v, dict(causal=True, align="top_left"), rng)
    with problem.on(path) as options:
        options = {**options, "bias": bias}
        _check_jvp_along_each_input(problem, options)
        _, res = _forward(problem.primals, options)
        tangents = (*problem.tangents, rng.standard_normal(bias.shape))
        got = npattn.attention_backward_jvp(problem.dout, res, tangents)
        zeros = npattn.attention_backward_jvp(
            problem.dout,
            res,
            tangents,
            dlse=np.zeros_like(problem.dlse),
            dout_dot=np.zeros_like(problem.dout),
            dlse_dot=np.zeros_like(problem.dlse),
        )
        for field in FIELDS:
            np.testing.assert_array_equal(getattr(got, field), getattr(zeros, field), err_msg=field)
        dd = (*problem.dd, rng.standard_normal(bias.shape))
        got = npattn.attention_double_backward(*dd[:3], res, problem.dout, ddbias=dd[3])
        zeros = npattn.attention_double_backward(
            *dd[:3], res, problem.dout, ddbias=dd[3], dlse=np.zeros_like(problem.dlse)
        )
        for field, value in got._asdict().items():
            np.testing.assert_array_equal(value, getattr(zeros, field), err_msg=field)


# --- 7. bad input --------------------------------------------------------------------------------

Q, K, V = _tiny(batch=(2,), N=4, K=2, T=3, S=5, H=3, Hv=2)
BIAS = RNG.standard_normal((4, 1, 5))
DOUT, DLSE = RNG.standard_normal((2, 4, 3, 2)), RNG.standard_normal((2, 4, 3))
_, RES = npattn.attention_forward(Q, K, V, impl="dense")
_, RES_BIAS = npattn.attention_forward(Q, K, V, bias=BIAS, impl="chunked", block_q=2, block_k=2)
ZEROS = (np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V))


def _strict(a, device=None):
    xps = pytest.importorskip("array_api_strict")
    return xps.asarray(a, device=xps.Device(device)) if device else xps.asarray(a)


def _torch(a):
    torch = pytest.importorskip("torch")
    return torch.asarray(a)


# (id, call, exception type, message fragment)
BAD_INPUT = [
    ("primals not a tuple", lambda: npattn.attention_jvp(Q, ZEROS), TypeError, "primals must be a tuple"),
    ("two primals", lambda: npattn.attention_jvp((Q, K), ZEROS[:2]), TypeError, r"primals must be a tuple \(q, k, v\)"),
    (
        "tangents not a tuple",
        lambda: npattn.attention_jvp((Q, K, V), {"q": Q}),
        TypeError,
        "tangents must be a tuple of 3",
    ),
    ("two tangents", lambda: npattn.attention_jvp((Q, K, V), ZEROS[:2]), TypeError, "tangents must be a tuple of 3"),
    (
        "None tangent",
        lambda: npattn.attention_jvp((Q, K, V), (Q, None, V)),
        TypeError,
        r"tangents\[1\] \(k\) must be an array",
    ),
    (
        "tangent shape",
        lambda: npattn.attention_jvp((Q, K, V), (Q, K, V[..., :1])),
        ValueError,
        r"tangents\[2\] \(v\) must have the primal's shape \(2, 2, 5, 2\), got \(2, 2, 5, 1\)",
    ),
    (
        "tangent dtype",
        lambda: npattn.attention_jvp((Q, K, V), (Q.astype(np.float32), K, V)),
        TypeError,
        r"tangents\[0\] \(q\) must have the primal's dtype float64, got float32",
    ),
    (
        "integer tangent",
        lambda: npattn.attention_jvp((Q, K, V), (Q, K.astype(np.int64), V)),
        TypeError,
        r"tangents\[1\] \(k\) must have the primal's dtype",
    ),
    (
        "tangent of another library (torch)",
        lambda: npattn.attention_jvp((Q, K, V), (Q, K, _torch(V))),
        TypeError,
        "different array libraries",
    ),
    (
        "tangents of another library (array-api-strict)",
        lambda: npattn.attention_jvp((Q, K, V), tuple(_strict(a) for a in ZEROS)),
        TypeError,
        r"the primals' q and tangents\[0\] \(q\) come from different array libraries",
    ),
    (
        "tangent on another device",
        lambda: npattn.attention_jvp(
            tuple(_strict(a) for a in (Q, K, V)), (_strict(Q), _strict(K), _strict(V, "device1"))
        ),
        ValueError,
        r"the primals' q and tangents\[2\] \(v\) are on different devices",
    ),
    (
        "every tangent on another device",
        lambda: npattn.attention_jvp(
            tuple(_strict(a) for a in (Q, K, V)), tuple(_strict(a, "device1") for a in (Q, K, V))
        ),
        ValueError,
        r"tangents.* on different devices",
    ),
    (
        "bias tangent without a bias",
        lambda: npattn.attention_jvp((Q, K, V), (*ZEROS, BIAS)),
        TypeError,
        "tangents must be a tuple of 3 arrays",
    ),
    (
        "bias tangent missing",
        lambda: npattn.attention_jvp((Q, K, V, BIAS), ZEROS),
        TypeError,
        "tangents must be a tuple of 4 arrays",
    ),
    (
        "bias tangent shape",
        lambda: npattn.attention_jvp((Q, K, V, BIAS), (*ZEROS, BIAS[0])),
        ValueError,
        r"tangents\[3\] \(bias\) must have the primal's shape \(4, 1, 5\)",
    ),
    (
        "bias as a primal and a keyword",
        lambda: npattn.attention_jvp((Q, K, V, BIAS), (*ZEROS, BIAS), bias=BIAS),
        TypeError,
        "the bias is a primal here",
    ),
    ("bad option", lambda: npattn.attention_jvp((Q, K, V), ZEROS, impl="flash"), ValueError, "impl must be one of"),
    (
        "causal T != S without align",
        lambda: npattn.attention_jvp((Q, K, V), ZEROS, causal=True),
        ValueError,
        "align='bottom_right'",
    ),
    # attention_backward_jvp
    (
        "backward_jvp: residuals not from attention_forward",
        lambda: npattn.attention_backward_jvp(DOUT, (Q, K, V), ZEROS),
        TypeError,
        "residuals must come from npattn.attention_forward, got tuple",
    ),
    (
        "backward_jvp: bias tangent without a bias",
        lambda: npattn.attention_backward_jvp(DOUT, RES, (*ZEROS, BIAS)),
        TypeError,
        "tangents must be a tuple of 3 arrays",
    ),
    (
        "backward_jvp: bias tangent missing",
        lambda: npattn.attention_backward_jvp(DOUT, RES_BIAS, ZEROS),
        TypeError,
        "tangents must be a tuple of 4 arrays",
    ),
    (
        "backward_jvp: tangent shape",
        lambda: npattn.attention_backward_jvp(DOUT, RES, (Q[:1], K, V)),
        ValueError,
        r"tangents\[0\] \(q\) must have the primal's shape",
    ),
    (
        "backward_jvp: bias tangent dtype",
        lambda: npattn.attention_backward_jvp(DOUT, RES_BIAS, (*ZEROS, BIAS.astype(np.float32))),
        TypeError,
        r"tangents\[3\] \(bias\) must have the primal's dtype float64",
    ),
    (
        "backward_jvp: dout shape",
        lambda: npattn.attention_backward_jvp(DOUT[..., :1], RES, ZEROS),
        ValueError,
        "dout must have the forward's shape",
    ),
    (
        "backward_jvp: dout_dot dtype",
        lambda: npattn.attention_backward_jvp(DOUT, RES, ZEROS, dout_dot=DOUT.astype(np.float32)),
        TypeError,
        "dout_dot must have dtype float64",
    ),
    (
        "backward_jvp: dlse_dot shape",
        lambda: npattn.attention_backward_jvp(DOUT, RES, ZEROS, dlse_dot=DLSE[0]),
        ValueError,
        "dlse_dot must have the forward's shape",
    ),
    (
        "backward_jvp: tangents on another device",
        lambda: npattn.attention_backward_jvp(
            _strict(DOUT),
            npattn.attention_forward(*(_strict(a) for a in (Q, K, V)))[1],
            tuple(_strict(a, "device1") for a in ZEROS),
        ),
        ValueError,
        r"tangents.* on different devices",
    ),
    # attention_double_backward
    (
        "double_backward: residuals not from attention_forward",
        lambda: npattn.attention_double_backward(*ZEROS, None, DOUT),
        TypeError,
        "residuals must come from npattn.attention_forward, got NoneType",
    ),
    (
        "double_backward: ddbias without a bias",
        lambda: npattn.attention_double_backward(*ZEROS, RES, DOUT, ddbias=BIAS),
        ValueError,
        "ddbias was given, but the forward had no bias",
    ),
    (
        "double_backward: ddbias missing",
        lambda: npattn.attention_double_backward(*ZEROS, RES_BIAS, DOUT),
        TypeError,
        r"\[3\] \(bias\) must be an array",
    ),
    (
        "double_backward: ddbias shape",
        lambda: npattn.attention_double_backward(*ZEROS, RES_BIAS, DOUT, ddbias=BIAS[0]),
        ValueError,
        r"\[3\] \(bias\) must have the primal's shape \(4, 1, 5\)",
    ),
    (
        "double_backward: ddv shape",
        lambda: npattn.attention_double_backward(*ZEROS[:2], Q, RES, DOUT),
        ValueError,
        r"\[2\] \(v\) must have the primal's shape",
    ),
    (
        "double_backward: ddq dtype",
        lambda: npattn.attention_double_backward(Q.astype(np.float32), *ZEROS[1:], RES, DOUT),
        TypeError,
        r"\[0\] \(q\) must have the primal's dtype float64",
    ),
    (
        "double_backward: ddk of another library",
        lambda: npattn.attention_double_backward(ZEROS[0], _torch(ZEROS[1]), ZEROS[2], RES, DOUT),
        TypeError,
        "different array libraries",
    ),
    (
        "double_backward: dlse dtype",
        lambda: npattn.attention_double_backward(*ZEROS, RES, DOUT, dlse=DLSE.astype(np.float32)),
        TypeError,
        "dlse must have dtype float64",
    ),
    (
        "double_backward: cotangents on another device",
        lambda: npattn.attention_double_backward(
            *(_strict(a, "device1") for a in ZEROS),
            npattn.attention_forward(*(_strict(a) for a in (Q, K, V)))[1],
            _strict(DOUT),
        ),
        ValueError,
        r"(ddq|cotangents).* on different devices",
    ),
]


@pytest.mark.parametrize("call, error, message", [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT])
def test_bad_input_is_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- 8. backends and mutation --------------------------------------------------------------------


def test_backend_matrix_and_no_mutation(backend):
    """GQA, bias as a primal, bottom_right causal with lengths, sinks, softcap,
    ALiBi, dropout and a mask_mod, dense and chunked (array-api-strict: the
    generic path, on both devices; read-only NumPy: a write raises): every
    output of the three functions equal to NumPy's, on the inputs' device,
    and no input changed."""
    rng = np.random.default_rng(161)
    q, k, v = _tiny(batch=(2,), N=4, K=2, T=4, S=6, H=3, Hv=2, rng=rng)
    options = dict(
        bias=rng.standard_normal((4, 1, 6)),
        causal=True,
        align="bottom_right",
        q_lengths=np.array([4, 3]),
        kv_lengths=np.array([6, 4]),
        sinks=rng.standard_normal(4),
        softcap=2.0,
        alibi_slopes=rng.uniform(0, 0.5, 4),
        dropout_p=0.2,
        seed=11,
        mask_mod=stripes,
    )
    problem = make_problem(q, k, v, options, rng, blocks=(3, 4))
    host = {
        "primals": problem.primals,
        "tangents": problem.tangents,
        "dd": problem.dd,
        "cotangents": (problem.dout, problem.dlse, problem.dout_dot, problem.dlse_dot),
        "options": tuple(value for value in problem.options.values() if hasattr(value, "shape")),
    }
    copies = {name: tuple(a.copy() for a in arrays) for name, arrays in host.items()}
    on = {name: tuple(backend.asarray(a) for a in arrays) for name, arrays in host.items()}
    moved_options = {
        key: backend.asarray(value) if hasattr(value, "shape") else value for key, value in problem.options.items()
    }
    moved = Problem(
        primals=on["primals"],
        options=moved_options,
        blocks=problem.blocks,
        tangents=on["tangents"],
        dout=on["cotangents"][0],
        dlse=on["cotangents"][1],
        dout_dot=on["cotangents"][2],
        dlse_dot=on["cotangents"][3],
        dd=on["dd"],
        seed=problem.seed,
    )
    for path in PATHS:
        with problem.on(path) as options:
            want = _all_modes(problem, options)
        with moved.on(path) as options:
            got = _all_modes(moved, options)
        assert got.keys() == want.keys()
        for name, value in got.items():
            if want[name] is None:
                assert value is None, name
                continue
            if backend.name.startswith("strict"):
                assert value.device == on["primals"][0].device, f"{path} {name}"
            _assert_same(backend.to_numpy(value), want[name], f"{backend.name} {path} {name}", tol=1e-12)
    for name, originals in copies.items():
        for a, original, given_array in zip(host[name], originals, on[name]):
            np.testing.assert_array_equal(a, original, err_msg=name)
            np.testing.assert_array_equal(backend.to_numpy(given_array), original, err_msg=name)


# --- the largest errors ---------------------------------------------------------------------------


def test_largest_central_difference_errors():
    """Prints what the tests above saw (run with -s); checks nothing when run alone."""
    for function in ("attention_jvp", "attention_backward_jvp", "attention_double_backward"):
        if function in ERRORS:
            print(f"\nlargest |numeric - analytic| of {function}: {ERRORS[function]:.3g}")
    assert all(math.isfinite(error) for error in ERRORS.values())
