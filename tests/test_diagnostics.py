"""npattn.diagnostics: each statistic against hand-computed values and an
independent per-row float64 oracle, fully masked rows, NaN/inf reporting, the
backend matrix for the compute functions, and the heatmap plotting (file
written, argument validation, the ImportError without matplotlib)."""

from __future__ import annotations

import dataclasses
import math
import sys

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from strategies import attention_cases

import npattn
from npattn import diagnostics as dg

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _oracle(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-head mean entropy and peak over live rows, one row at a time with math.log."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim == 2:
        w = w[None]
    N = w.shape[-3]
    entropy, peak = np.full(N, np.nan), np.full(N, np.nan)
    for n in range(N):
        rows = [r for r in w[..., n, :, :].reshape(-1, w.shape[-1]) if any(x != 0 for x in r)]
        if rows:
            entropy[n] = sum(-sum(x * math.log(x) for x in r if x > 0) for r in rows) / len(rows)
            peak[n] = sum(max(r) for r in rows) / len(rows)
    return entropy, peak


def _probs(rng, shape=(2, 3, 5, 6), q_lengths=None, **options):
    B, N, T, S = shape
    q, k, v = rng.standard_normal((B, N, T, 4)), rng.standard_normal((B, N, S, 4)), rng.standard_normal((B, N, S, 4))
    if options.get("causal") and T != S:
        options.setdefault("align", "bottom_right")
    _, res = npattn.attention_forward(q, k, v, q_lengths=q_lengths, impl="dense", **options)
    return res.probs


# --------------------------------------------------------------------------- hand-computed values


def test_entropy_and_peak_hand_computed():
    S = 4
    w = np.array(
        [
            [[0.25] * 4, [1.0, 0, 0, 0], [0.0] * 4],  # head 0: uniform, one-hot, fully masked
            [[0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5], [0.5, 0.5, 0, 0]],  # head 1: two keys each
            [[0.0] * 4] * 3,  # head 2: every row fully masked
        ]
    )  # (N=3, T=3, S=4)
    h = dg.attention_entropy(w)
    assert h.shape == (3,)
    np.testing.assert_allclose(h[:2], [math.log(S) / 2, math.log(2)], rtol=0, atol=1e-15)
    assert math.isnan(h[2])  # no live row
    pk = dg.attention_peak(w)
    np.testing.assert_allclose(pk[:2], [(0.25 + 1.0) / 2, 0.5], rtol=0, atol=1e-15)
    assert math.isnan(pk[2])


@pytest.mark.parametrize("S", [1, 2, 7, 64])
def test_uniform_rows_have_entropy_log_s_and_peak_one_over_s(S):
    w = np.full((2, 3, 5, S), 1.0 / S)
    np.testing.assert_allclose(dg.attention_entropy(w), np.full(3, math.log(S)), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(dg.attention_peak(w), np.full(3, 1.0 / S), rtol=1e-12)


def test_one_hot_rows_have_entropy_zero_and_peak_one():
    w = np.eye(6)[np.random.default_rng(0).integers(0, 6, size=(2, 4, 5))]  # (2, 4, 5, 6) one-hot rows
    np.testing.assert_array_equal(dg.attention_entropy(w), np.zeros(4))  # 0 log 0 = 0 exactly, no NaN
    np.testing.assert_array_equal(dg.attention_peak(w), np.ones(4))


def test_two_dimensional_weights_are_one_head():
    w = np.array([[0.5, 0.5], [0.9, 0.1], [0.0, 0.0]])  # (T, S)
    h, pk = dg.attention_entropy(w), dg.attention_peak(w)
    assert h.shape == pk.shape == (1,)
    expected = (math.log(2) - 0.9 * math.log(0.9) - 0.1 * math.log(0.1)) / 2
    assert float(h[0]) == pytest.approx(expected, abs=1e-15)
    assert float(pk[0]) == pytest.approx(0.7, abs=1e-15)


def test_fully_masked_rows_from_attention_are_left_out():
    rng = np.random.default_rng(1)
    probs = _probs(rng, q_lengths=np.array([5, 2]), causal=True)  # element 1: 3 padded query rows
    assert np.all(probs[1, :, 2:] == 0)
    live = probs[:, :, :, :][np.any(probs != 0, axis=-1)]
    assert live.shape[0] == 3 * (5 + 2)
    entropy, peak = _oracle(probs)
    np.testing.assert_allclose(dg.attention_entropy(probs), entropy, rtol=0, atol=1e-13)
    np.testing.assert_allclose(dg.attention_peak(probs), peak, rtol=0, atol=1e-14)
    # Padding more rows of a head changes nothing but the count of rows averaged.
    only_live = dg.attention_entropy(probs[:1])
    assert not np.allclose(only_live, dg.attention_entropy(probs))  # the rows of element 1 count


@settings(max_examples=25)
@given(case=attention_cases(features=("mask", "bias", "causal", "window", "lengths")))
def test_statistics_match_oracle_and_bounds_for_any_mask(case):
    _, res = npattn.attention_forward(*case.arrays, impl="dense", **case.options)
    probs = res.probs
    entropy, peak = _oracle(probs)
    got_h, got_p = dg.attention_entropy(probs), dg.attention_peak(probs)
    np.testing.assert_allclose(got_h, entropy, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got_p, peak, rtol=1e-12, atol=1e-14)
    S = probs.shape[-1]
    live = ~np.isnan(entropy)
    assert np.all(got_h[live] >= -1e-12) and np.all(got_h[live] <= math.log(S) + 1e-12)
    assert np.all(got_p[live] >= 1.0 / S - 1e-12) and np.all(got_p[live] <= 1.0 + 1e-12)
    report = dg.row_sum_check(probs)
    assert report.ok, report
    assert report.n_masked_rows == int(np.sum(~np.any(probs != 0, axis=-1)))


# --------------------------------------------------------------------------- row sums


def test_row_sum_check_passes_on_attention_probabilities_with_masked_rows():
    probs = _probs(np.random.default_rng(2), q_lengths=np.array([5, 0]))  # element 1 fully masked
    report = dg.row_sum_check(probs)
    assert report.ok and report.n_failing == 0 and report.failing_rows == ()
    assert report.n_rows == 2 * 3 * 5 and report.n_masked_rows == 3 * 5
    assert report.max_deviation < 1e-14
    assert report.atol == pytest.approx(math.sqrt(np.finfo(np.float64).eps))
    assert "ok" in str(report)


def test_row_sum_check_reports_failing_rows_worst_row_and_nan():
    w = np.full((2, 3, 4), 0.25)  # (N, T, S) all rows fine
    w[0, 1] = [0.5, 0.5, 0.5, 0.0]  # sums to 1.5
    w[1, 2] = [0.1, 0.0, 0.0, 0.0]  # sums to 0.1: not fully masked, not 1
    w[1, 0] = 0.0  # fully masked: passes
    report = dg.row_sum_check(w)
    assert not report.ok
    assert report.n_failing == 2 and report.failing_rows == ((0, 1), (1, 2))
    assert report.max_deviation == pytest.approx(0.9) and report.worst_row == (1, 2)
    assert report.n_masked_rows == 1
    text = str(report)
    assert "FAILED" in text and "(0, 1), (1, 2)" in text

    w[0, 0, 3] = np.nan
    report = dg.row_sum_check(w)
    assert report.n_failing == 3 and report.failing_rows[0] == (0, 0)
    assert math.isnan(report.max_deviation) and report.worst_row == (0, 0)


def test_row_sum_check_tolerance_and_listing_cap():
    w = np.full((30, 4), 0.25)
    w[:, 0] += 1e-6  # every row off by 1e-6
    assert dg.row_sum_check(w).n_failing == 30  # default float64 atol 1.5e-8
    assert dg.row_sum_check(w, atol=1e-5).ok
    report = dg.row_sum_check(w, max_listed=3)
    assert report.failing_rows == ((0,), (1,), (2,)) and "(27 more)" in str(report)
    assert dg.row_sum_check(w.astype(np.float32)).ok  # float32 default atol 3.5e-4


@pytest.mark.parametrize("dtype, atol", [(np.float64, 2**-26), (np.float32, 2**-11.5), (np.float16, 2**-9)])
def test_row_sum_default_tolerance_per_dtype(dtype, atol):
    probs = _probs(np.random.default_rng(3), shape=(2, 2, 9, 40), causal=True).astype(dtype)
    report = dg.row_sum_check(probs)
    assert report.ok, report  # rounding to a narrow dtype is within the default
    assert report.atol == pytest.approx(atol, rel=1e-6)


def test_row_sum_check_on_empty_rows():
    report = dg.row_sum_check(np.zeros((2, 0, 3)))
    assert report.ok and report.n_rows == 0 and report.worst_row is None


# --------------------------------------------------------------------------- NaN / inf


def test_check_finite_counts_and_first_bad_index():
    out = np.zeros((2, 3, 4))
    out[1, 2, 0] = np.nan
    out[1, 0, 3] = np.inf  # first in C order
    out[1, 1, 1] = -np.inf
    lse = np.array([[0.0, -np.inf], [1.0, -np.inf]])
    report = dg.check_finite({"out": out, "lse": lse, "lengths": np.array([3, 1]), "none": None}, allow_neginf=["lse"])
    assert not report.ok and report.bad == ["out"]
    assert list(report.entries) == ["out", "lse", "lengths"]  # None skipped
    e = report.entries["out"]
    assert (e.n_nan, e.n_posinf, e.n_neginf, e.first_bad) == (1, 1, 1, (1, 0, 3))
    e = report.entries["lse"]
    assert (e.n_neginf, e.ok, e.first_bad) == (2, True, None)
    assert report.entries["lengths"].ok
    text = str(report)
    assert "FAILED (out)" in text and "first bad at (1, 0, 3)" in text and "-inf=2 (allowed)" in text

    strict = dg.check_finite({"lse": lse})  # -inf not allowed: bad, first at (0, 1)
    assert strict.bad == ["lse"] and strict.entries["lse"].first_bad == (0, 1)
    assert dg.check_finite({"x": np.ones(3)}).ok
    assert dg.check_finite({"scalar": np.asarray(np.nan)}).entries["scalar"].first_bad == ()


def test_check_finite_rejects_bad_arguments():
    with pytest.raises(TypeError, match="mapping"):
        dg.check_finite([np.ones(2)])
    with pytest.raises(ValueError, match="allow_neginf names \\['lse'\\]"):
        dg.check_finite({"out": np.ones(2)}, allow_neginf=["lse"])
    with pytest.raises(TypeError, match="grad must be an array"):
        dg.check_finite({"grad": [1.0, 2.0]})
    with pytest.raises(TypeError, match="complex"):
        dg.check_finite({"z": np.ones(2, dtype=complex)})
    with pytest.raises(TypeError, match="names must be str"):
        dg.check_finite({0: np.ones(2)})


# --------------------------------------------------------------------------- summary


def test_summarize_fields_warnings_and_table():
    w = np.array([[[0.5, 0.5], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]])  # (N=2, T=2, S=2)
    s = dg.summarize(w)
    assert s.ok and s.shape == (2, 2, 2) and s.dtype == "float64"
    assert s.entropy == pytest.approx((math.log(2) / 2, 0.0)) and s.peak == pytest.approx((0.75, 1.0))
    assert s.uniform_entropy == pytest.approx(math.log(2))
    assert len(s.warnings) == 1 and "head 1 has mean peak >= 0.98" in s.warnings[0]
    assert dg.summarize(w, peak_warning=1.01).warnings == ()
    assert dataclasses.asdict(s)["row_sums"]["ok"] is True  # loggable
    text = str(s)
    assert "head  entropy   peak" in text and "   1    0.000  1.000" in text


def test_summarize_flags_nan_and_bad_rows():
    probs = _probs(np.random.default_rng(4))
    probs[0, 1, 2, 3] = np.nan
    probs[1, 0, 0] *= 0.5
    s = dg.summarize(probs)
    assert not s.ok and s.n_nan == 1 and s.n_inf == 0
    assert s.row_sums.failing_rows == ((0, 1, 2), (1, 0, 0))
    assert math.isnan(s.entropy[1]) and not math.isnan(s.entropy[0])
    assert any("do not sum to 1" in w for w in s.warnings)
    assert any("1 NaN and 0 inf entries, first at (0, 1, 2, 3)" in w for w in s.warnings)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("fn", [dg.attention_entropy, dg.attention_peak, dg.row_sum_check, dg.summarize])
def test_compute_functions_validate_weights(fn):
    with pytest.raises(TypeError, match="weights must be an array"):
        fn([[0.5, 0.5]])
    with pytest.raises(TypeError, match="weights must have a real floating dtype"):
        fn(np.ones((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"weights must have shape \(\.\.\., N, T, S\) or \(T, S\)"):
        fn(np.ones(3))


# --------------------------------------------------------------------------- backend matrix


def test_compute_functions_on_every_backend(backend):
    rng = np.random.default_rng(5)
    probs = _probs(rng, q_lengths=np.array([5, 3]), causal=True)
    probs[1, 2, 0, 0] += 0.25  # one row off by 0.25
    w = backend.asarray(probs)
    h, pk = dg.attention_entropy(w), dg.attention_peak(w)
    for got in (h, pk):
        assert array_api_compat.array_namespace(got) is array_api_compat.array_namespace(w)
        assert array_api_compat.device(got) == array_api_compat.device(w)
    entropy, peak = _oracle(probs)
    np.testing.assert_allclose(backend.to_numpy(h), entropy, rtol=0, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(pk), peak, rtol=0, atol=1e-12)
    report = dg.row_sum_check(w)
    assert report.failing_rows == ((1, 2, 0),) and report.max_deviation == pytest.approx(0.25)
    assert report.n_masked_rows == 3 * 2
    s = dg.summarize(w)
    assert s.dtype == "float64" and s.entropy == pytest.approx(tuple(entropy), abs=1e-12)
    bad = probs.copy()
    bad[0, 1, 2, 3] = np.inf
    e = dg.check_finite({"w": backend.asarray(bad)}).entries["w"]
    assert (e.n_posinf, e.first_bad) == (1, (0, 1, 2, 3))


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_narrow_dtypes_compute_in_float32(dtype):
    probs = _probs(np.random.default_rng(6), causal=True)
    w = probs.astype(dtype)
    h = dg.attention_entropy(w)
    assert h.dtype == np.float32
    np.testing.assert_allclose(h, _oracle(probs)[0], rtol=0, atol=1e-2 if dtype == "float16" else 1e-5)
    assert dg.summarize(w).ok


def test_bfloat16_torch_weights():
    torch = pytest.importorskip("torch")
    probs = _probs(np.random.default_rng(7), causal=True)
    w = torch.asarray(probs).to(torch.bfloat16)
    s = dg.summarize(w)
    assert s.ok and s.dtype == "bfloat16"
    np.testing.assert_allclose(s.entropy, _oracle(probs)[0], atol=3e-2)


# --------------------------------------------------------------------------- plotting


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 2000


def test_plot_writes_png_for_every_accepted_shape(tmp_path):
    pytest.importorskip("matplotlib")
    probs = _probs(np.random.default_rng(8), shape=(2, 3, 5, 5), q_lengths=np.array([5, 3]), causal=True)
    tokens = ["<s>", "a", "b", "c", "d"]
    cases = {
        "batch.png": dict(weights=probs, batch_index=1, tokens=tokens, title="padded"),
        "heads.png": dict(weights=probs[0], heads=[2, 0]),
        "single.png": dict(weights=probs[0, 0], tokens=tuple(tokens)),
    }
    for name, kw in cases.items():
        weights = kw.pop("weights")
        written = dg.plot_attention(weights, path=tmp_path / name, **kw)
        assert written == tmp_path / name
        _assert_png(written)
    cross = _probs(np.random.default_rng(9), shape=(1, 2, 3, 6))[0]  # (N, T=3, S=6)
    written = dg.plot_attention(
        cross, query_tokens=[1, 2, 3], key_tokens=list("uvwxyz"), path=str(tmp_path / "cross.png"), vmax=None
    )
    _assert_png(written)


def test_plot_on_every_backend(backend, tmp_path):
    pytest.importorskip("matplotlib")
    probs = _probs(np.random.default_rng(10), shape=(2, 2, 4, 4), causal=True)
    path = dg.plot_attention(backend.asarray(probs), batch_index=0, path=tmp_path / "p.png")
    _assert_png(path)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(), ValueError, "pass batch_index="),
        (dict(batch_index=2), ValueError, "batch_index 2 is out of range for batch size 2"),
        (dict(batch_index=True), TypeError, "batch_index must be an int"),
        (dict(batch_index=0.0), TypeError, "batch_index must be an int"),
        (dict(batch_index=0, tokens=["a", "b"]), ValueError, "tokens has 2 labels but the query axis has length 4"),
        (dict(batch_index=0, tokens="abcd"), TypeError, "tokens must be a sequence of labels"),
        (dict(batch_index=0, tokens=list("abcd"), key_tokens=list("abcd")), ValueError, "either tokens"),
        (dict(batch_index=0, key_tokens=list("abc")), ValueError, "key_tokens has 3 labels but the key axis"),
        (dict(batch_index=0, query_tokens={"a": 1}), TypeError, "query_tokens must be a sequence"),
        (dict(batch_index=0, heads=[0, 3]), ValueError, "heads holds 3, out of range for 3 heads"),
        (dict(batch_index=0, heads=[0.5]), TypeError, "heads must hold ints"),
        (dict(batch_index=0, heads=[]), ValueError, "at least one head"),
        (dict(batch_index=0, heads=1), TypeError, "heads must be a sequence"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_plot_validates_arguments(tmp_path, kwargs, error, match):
    w = np.full((2, 3, 4, 4), 0.25)  # (B, N, T, S)
    with pytest.raises(error, match=match):
        dg.plot_attention(w, path=tmp_path / "x.png", **kwargs)
    assert not (tmp_path / "x.png").exists()


def test_plot_validates_weights_and_path(tmp_path):
    with pytest.raises(ValueError, match="batch_index is only for 4-D"):
        dg.plot_attention(np.full((3, 4, 4), 0.25), batch_index=0, path=tmp_path / "x.png")
    with pytest.raises(ValueError, match=r"weights must have shape \(N, T, S\)"):
        dg.plot_attention(np.ones((1, 1, 2, 2, 2)), path=tmp_path / "x.png")
    with pytest.raises(ValueError, match="tokens labels both axes and needs T == S"):
        dg.plot_attention(np.full((3, 2), 0.5), tokens=["a", "b", "c"], path=tmp_path / "x.png")
    with pytest.raises(TypeError, match="weights must have a real floating dtype"):
        dg.plot_attention(np.ones((2, 2), dtype=bool), path=tmp_path / "x.png")
    with pytest.raises(TypeError, match="path must be a str or path-like"):
        dg.plot_attention(np.full((2, 2), 0.5), path=None)


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(ImportError, match=r'pip install "npattn\[plot\]"'):
        dg.plot_attention(np.full((2, 2), 0.5), path=tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    # The compute functions never need matplotlib.
    assert dg.summarize(np.full((2, 2), 0.5)).ok
