"""The main job, ``python -m npattn``, runs end to end and reports success."""

from __future__ import annotations

import subprocess
import sys

import pytest

from npattn.__main__ import main


def test_demo_runs_and_gradient_checks_pass(capsys):
    assert main(["--length", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]) == 0
    report = capsys.readouterr().out
    assert "all gradient checks passed" in report
    assert "dense" in report and "chunked" in report and "max |dense - chunked|" in report


def test_demo_cupy_backend_fails_clearly_without_a_gpu():
    try:
        import cupy  # noqa: F401

        pytest.skip("CuPy is installed; the no-GPU path is not reachable here")
    except ImportError:
        pass
    run = subprocess.run([sys.executable, "-m", "npattn", "--backend", "cupy"], capture_output=True, text=True)
    assert run.returncode != 0
    assert "--backend cupy needs CuPy and a CUDA GPU" in run.stderr


def test_max_difference_counts_nan_and_mismatched_masking_as_infinite():
    """Regression: the demo took max(0, nan) = 0, so a NaN read as agreement."""
    import numpy as np

    from npattn.__main__ import max_difference

    assert max_difference(np.array([1.0, -np.inf]), np.array([1.25, -np.inf])) == 0.25
    assert max_difference(np.array([1.0]), np.array([np.nan])) == float("inf")
    assert max_difference(np.array([np.nan]), np.array([1.0])) == float("inf")
    assert max_difference(np.array([-np.inf]), np.array([0.0])) == float("inf")


def test_help_is_plain_text_and_every_option_has_help(capsys):
    from npattn.__main__ import _parser

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for markup in ("``", ":func:", ":mod:", ":class:", ":data:"):
        assert markup not in text, f"--help shows reStructuredText markup {markup!r}"
    assert "Exit status 0 when the paths agree" in text
    assert "python -m npattn --backend cupy" in text  # the examples keep their line breaks
    for action in _parser()._actions:
        assert action.help, f"{action.option_strings} has no help string"
    assert "(default: 512)" in text and "grouped-query attention" in text
