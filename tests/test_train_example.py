"""examples/train_tiny_transformer.py in --quick mode (40 steps, a few seconds):
the gradient checks pass, the loss falls, the files are written; and the
checks catch a wrong backward, the held-out split holds, the script runs as
a script."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import runpy
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
SCRIPT = EXAMPLES / "train_tiny_transformer.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYERS = ("embedding", "layer norm", "MLP (GELU)", "npattn MHA (causal)", "cross-entropy (masked)", "whole model")


def _main():
    """The example's ``main`` (its ``__main__`` block does not run)."""
    return runpy.run_path(str(SCRIPT), run_name="npattn_example_train_tiny_transformer")["main"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``--quick`` run shared by the tests below: ``(exit code, stdout, out dir)``."""
    out_dir = tmp_path_factory.mktemp("train") / "out"  # created by the example
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = _main()(["--quick", "--out", str(out_dir)])
    return code, stdout.getvalue(), out_dir


def test_gradient_checks_pass(quick_run):
    code, out, _ = quick_run
    assert code == 0, out
    for layer in LAYERS:
        assert re.search(rf"^  ok +{re.escape(layer)} ", out, re.M), f"{layer} not checked or failed:\n{out}"
    assert "FAILED" not in out
    assert re.search(r"ok +npattn MHA \(causal\) +full Jacobian \+ random VJP", out)


def test_loss_falls_and_history_is_saved(quick_run):
    _code, out, out_dir = quick_run
    history = json.loads((out_dir / "history.json").read_text())
    assert history["gradcheck_ok"] is True
    loss = history["loss"]
    assert len(loss) == 40 and history["step"][-1] == 40
    first, last = np.mean(loss[:5]), np.mean(loss[-5:])
    assert last < 0.5 * first, (first, last)  # about 2.4 -> 0.65 in 40 steps
    assert history["val_loss"][-1] < 0.5 * history["val_loss"][0]
    assert history["val_acc"][-1] > history["val_acc"][0] + 0.3  # chance is ~10% per digit
    assert 0.0 <= history["greedy_exact"] <= history["greedy_token_acc"] <= 1.0
    # Progress lines carry a rate and an ETA; the last line the final accuracy and time.
    assert re.search(r"step +40/40 +loss [\d.]+ +val loss [\d.]+ +val acc +[\d.]+% +[\d.]+ steps/s +ETA", out)
    final = out.strip().splitlines()[-1]
    match = re.fullmatch(r"final held-out token accuracy ([\d.]+)% after 40 steps; total time ([\d.]+) s", final)
    assert match, final
    assert float(match[1]) == pytest.approx(100 * history["final_val_acc"], abs=0.01)


def test_pngs_are_written(quick_run):
    pytest.importorskip("matplotlib")
    _, _, out_dir = quick_run
    for name in ("loss_curve.png", "attention_layer0.png", "attention_layer1.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name


def test_without_matplotlib(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert _main()(["--quick", "--steps", "3", "--no-check", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert 'no plots: they need matplotlib: pip install "npattn[plot]"' in out
    assert not list(tmp_path.glob("*.png"))
    assert (tmp_path / "history.json").exists() and (tmp_path / "params.npz").exists()


def _wrong_layer_norm_backward(dy, residuals):
    """The classic bug: the variance treated as a constant (the last term of dx missing)."""
    xhat, rstd, gamma = residuals
    rows = tuple(range(dy.ndim - 1))
    g = dy * gamma
    return rstd * (g - g.mean(axis=-1, keepdims=True)), (dy * xhat).sum(axis=rows), dy.sum(axis=rows)


def test_checks_catch_a_wrong_backward(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from tiny_transformer import checks, model

    monkeypatch.setattr(checks, "layer_norm_backward", _wrong_layer_norm_backward)
    monkeypatch.setattr(model, "layer_norm_backward", _wrong_layer_norm_backward)
    results = checks.run_checks()
    failed = {name for name, r in results.items() if not r.ok}
    assert failed == {"layer norm", "whole model"}
    assert all(msg.startswith("x") for msg in results["layer norm"].failures)  # gamma, beta are right
    assert "FAILED layer norm" in checks.report(results)


def test_held_out_sequences_never_train(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from tiny_transformer.data import SEP, DigitTask

    task = DigitTask(2, "sort", num_val=60, seed=3)  # 60 of the 100 two-digit strings are held out
    val = {tuple(d) for d in task.val_digits.tolist()}
    for _ in range(20):
        ids, targets, mask = task.train_batch(50)  # (50, 4) each
        assert not {tuple(d) for d in ids[:, :2].tolist()} & val
    assert np.all(ids[:, 2] == SEP) and np.all(ids[:, 3] == np.minimum(ids[:, 0], ids[:, 1]))
    np.testing.assert_array_equal(targets[:, 2:], np.sort(ids[:, :2], axis=1))
    assert mask.tolist() == [[False, False, True, True]] * 50  # positions L.. predict the outputs


def test_runs_as_a_script(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--steps", "3", "--out", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("final held-out token accuracy")
