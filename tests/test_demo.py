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
