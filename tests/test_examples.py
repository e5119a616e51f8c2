"""The runnable examples in examples/, each in its --quick mode: in-process
through ``main(argv)`` (loaded with runpy) to check what they print and
return, and once each as a script in a subprocess. ring_attention.py runs
under ``mpiexec`` on two ranks (skipped without MPI);
train_tiny_transformer.py has tests/test_train_example.py."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import runpy
import subprocess
import sys

import numpy as np
import pytest
from mpi_support import mpi_skip_reason, run_mpi

import npattn

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = ["quickstart", "gpu_swap", "gradcheck_custom_layer", "attention_maps", "custom_score_mod", "second_order"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(name: str) -> dict:
    """The example's module globals (its ``__main__`` block does not run)."""
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name=f"npattn_example_{name}")


def _has_cuda_cupy() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def test_quickstart(capsys):
    assert _load("quickstart")["main"](["--quick"]) == 0
    out = capsys.readouterr().out
    assert "out  (2, 2, 6, 8) float32" in out and "lse  (2, 2, 6) float32" in out
    assert "gradient reaching the padded keys of batch element 1: 0.0" in out


def test_gpu_swap_runs_numpy_and_says_why_cupy_is_missing(capsys):
    assert _load("gpu_swap")["main"](["--quick"]) == 0
    out = capsys.readouterr().out
    ran = out.split("ran on:")[1].split()
    assert "numpy" in ran[0]
    if _has_cuda_cupy():
        assert "cupy" in out and "max |cupy - numpy|" in out and "(agree)" in out
    else:
        assert "CuPy with a CUDA GPU is not available here" in out and 'pip install "npattn[cuda12]"' in out
    if importlib.util.find_spec("array_api_strict"):
        assert "max |array-api-strict - numpy|" in out and "(agree)" in out


def test_gpu_swap_step_is_library_agnostic():
    step = _load("gpu_swap")["step"]
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(0)
    arrays = dict(
        q=rng.standard_normal((2, 4, 5, 3)),
        k=rng.standard_normal((2, 2, 5, 3)),
        v=rng.standard_normal((2, 2, 5, 3)),
        dout=rng.standard_normal((2, 4, 5, 3)),
        kv_lengths=np.array([5, 2]),
    )
    ref = step(**arrays)
    got = step(**{key: xps.asarray(a) for key, a in arrays.items()})
    for key in ref:
        assert type(got[key]).__module__.startswith("array_api_strict")
        np.testing.assert_allclose(np.asarray(got[key]), ref[key], rtol=0, atol=1e-13)


def test_gradcheck_custom_layer(capsys):
    ns = _load("gradcheck_custom_layer")
    assert ns["main"](["--quick"]) == 0
    out = capsys.readouterr().out
    assert "gradient check passed (full Jacobian: yes)" in out
    assert "gradient check FAILED" in out and "wrong backward caught, blamed on x" in out

    good = ns["check"](ns["layer_norm_backward"], (3, 4))
    assert good.ok and good.jacobian_checked and set(good.names) == {"x", "gamma", "beta"}
    bad = ns["check"](ns["layer_norm_backward_wrong"], (3, 4))
    assert not bad.ok
    # Only x is wrong; the full-Jacobian failure names the input element.
    assert all(msg.startswith("x") for msg in bad.failures)
    assert any(msg.startswith("x[") and "-> output 0[" in msg for msg in bad.failures)
    assert bad.max_abs_error["gamma"] < 1e-6 and bad.max_abs_error["beta"] < 1e-6
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((2, 5)), np.ones(5), np.zeros(5)]
    with pytest.raises(npattn.GradcheckError, match="x"):
        npattn.check_gradients(
            ns["layer_norm_forward"], ns["layer_norm_backward_wrong"], inputs, names=["x", "gamma", "beta"]
        )


def test_attention_maps_writes_pngs_and_catches_bugs(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "maps"  # created by the example
    assert _load("attention_maps")["main"](["--quick", "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    for name in ("attention_maps_b0.png", "attention_maps_b1_padded.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000
    assert "row sums: ok" in out and "12 fully masked" in out  # 3 padded rows x 4 heads
    assert out.count("row sums: FAILED") == 2  # both hand-written bugs caught
    assert "-inf=12 (allowed)" in out
    assert "clean example passes, both bugs caught" in out


def test_attention_maps_structure_is_what_the_heads_claim():
    ns = _load("attention_maps")
    tokens = ns["SENTENCE"][:7]
    q, k, v = ns["build_qkv"](tokens)
    _, res = npattn.attention_forward(q, k, v, causal=True, scale=1.0)
    p = res.probs[0]  # (4, T, S)
    T = len(tokens)
    assert np.all(p[0, np.arange(1, T), np.arange(T - 1)] > 0.99)  # previous token
    assert np.all(p[1, :, 0] > 0.99)  # first token
    the = [i for i, t in enumerate(tokens) if t == "the"]
    np.testing.assert_allclose(p[2, the[1], the], 0.5, atol=1e-3)  # earlier copies of itself
    np.testing.assert_allclose(p[3], np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None])  # uniform


def test_attention_maps_without_matplotlib(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _load("attention_maps")["main"](["--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert 'no heatmaps: plot_attention needs matplotlib: pip install "npattn[plot]"' in out
    assert not list(tmp_path.glob("*.png"))


def test_custom_score_mod_checks_trains_and_plots(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plots" / "bias.png"  # the folder is created by the example
    assert _load("custom_score_mod")["main"](["--quick", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    assert "npattn.check_score_mod(learned_relative_bias): gradient check passed (full Jacobian: yes)" in out
    assert "the backward with local head ids: caught" in out
    for impl in ("dense", "chunked"):
        assert f"impl={impl!r}: gradient check passed (full Jacobian: yes)" in out
    losses = [float(line.split("loss")[1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 5  # steps 1, 10, 20, 30, 40
    assert "every head looks where its target lies" in out
    assert "head 0 (previous token): favours j - i in [-1]" in out
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_custom_score_mod_is_the_explicit_bias_and_mask():
    """The example's modification equals ``bias=table[n, bucket(j - i)]``, its
    mask the boolean mask of the documents, on every path; dmods is dbias
    summed per bucket."""
    ns = _load("custom_score_mod")
    rng = np.random.default_rng(3)
    R, doc = 2, ns["documents"]([3, 4])  # T = 7
    table = rng.standard_normal((4, 2 * R + 1))  # (N, 2R + 1)
    q = rng.standard_normal((2, 4, 7, 3))  # (B, N, T, H)
    k, v = rng.standard_normal((2, 2, 2, 7, 3))  # (B, K, S, H) each
    bucket = np.clip(np.arange(7)[None, :] - np.arange(7)[:, None], -R, R) + R  # (T, S)
    bias = table[:, bucket]  # (N, T, S)
    mask = doc[:, None] == doc[None, :]  # (T, S)
    ref, ref_res = npattn.attention_forward(q, k, v, bias=bias, mask=mask, impl="dense")
    ref_grads = npattn.attention_backward(np.ones_like(ref), ref_res)
    dtable = np.stack([np.bincount(bucket.ravel(), ref_grads.dbias[n].ravel(), 2 * R + 1) for n in range(4)])
    block_mask = npattn.block_mask(ns["document_mask"](doc), 7, 7, block_q=2, block_k=2)
    for impl, blocks in (("dense", None), ("chunked", 2), ("chunked", 3)):
        mod = ns["learned_relative_bias"](table, R)
        out, res = npattn.attention_forward(
            q, k, v, score_mods=[mod], block_mask=block_mask, impl=impl, block_q=blocks, block_k=blocks
        )
        grads = npattn.attention_backward(np.ones_like(out), res)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-13)
        np.testing.assert_allclose(grads.dq, ref_grads.dq, rtol=0, atol=1e-12)
        np.testing.assert_allclose(grads.dmods["table"], dtable, rtol=0, atol=1e-12)


def test_second_order_checks_pass(capsys):
    assert _load("second_order")["main"](["--quick"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and out.count("  ok: ") == 3 and "every check passed" in out
    assert "ok: the HVPs are the Hessian's, and so is the eigenvalue" in out
    assert "dJ/dW of J = L + 10 |dL/dx|^2 (chunked): gradient check passed (full Jacobian: yes)" in out
    for impl in ("dense", "chunked"):
        assert f"impl={impl!r}: JVP check passed (full Jacobian: yes)" in out
    hvp_line = next(line for line in out.splitlines() if line.startswith("HVP (chunked) vs central differences"))
    assert float(hvp_line.rsplit(" ", 1)[1]) < 1e-7  # its relative error


def test_second_order_layer_is_the_multihead_layer():
    """The example's layer and its hand-written first derivatives are
    npattn.mha_forward / mha_backward's (torch's convention: y = x W^T, zero
    biases), so the second-order steps build on a correct chain rule."""
    ns = _load("second_order")
    rng = np.random.default_rng(5)
    E, N = 8, ns["NUM_HEADS"]
    w = ns["init_weights"](rng, E)
    x, target = rng.standard_normal((2, 2, 6, E))  # (B, T, E) each
    params = npattn.mha_init(E, N, seed=0)
    params.update({f"{name}_weight": w[f"w{name[0]}"].T for name in ("q", "k", "v", "out")})
    for impl in ("dense", "chunked"):
        opts = {"impl": impl}
        y, _ = ns["layer_forward"](w, x, opts)
        ref, ref_res = npattn.mha_forward(params, x, num_heads=N, causal=True, impl=impl)
        np.testing.assert_allclose(y, ref, rtol=0, atol=1e-13)
        _, grads = ns["loss_and_grads"](w, x, target, opts)
        ref_grads = npattn.mha_backward((ref - target) / ref.size, ref_res).dparams
        for name in ("q", "k", "v", "out"):
            np.testing.assert_allclose(grads[f"w{name[0]}"], ref_grads[f"{name}_weight"].T, rtol=0, atol=1e-13)


def test_second_order_power_iteration_and_penalty_without_the_penalty():
    ns = _load("second_order")
    rng = np.random.default_rng(2)
    basis, _ = np.linalg.qr(rng.standard_normal((6, 6)))  # a symmetric matrix with known eigenvalues
    matrix = basis @ np.diag([0.5, -3.0, 1.0, 2.0, 0.1, -0.2]) @ basis.T
    value, vector, steps = ns["power_iteration"](lambda w: matrix @ w, (6,), rng, tol=1e-14, max_iter=1000)
    assert abs(value + 3.0) < 1e-10 and steps < 1000  # the largest magnitude, negative here
    np.testing.assert_allclose(abs(vector @ basis[:, 1]), 1.0, atol=1e-6)
    # lam = 0: J is L and its gradient the ordinary one.
    w = ns["init_weights"](rng, 8)
    x, target = rng.standard_normal((2, 2, 4, 8))
    J, _, grads = ns["penalty_and_grads"](w, x, target, 0.0, {"impl": "dense"})
    L, ref = ns["loss_and_grads"](w, x, target, {"impl": "dense"})
    assert J == L
    for name in ns["WEIGHTS"]:
        np.testing.assert_allclose(grads[name], ref[name], rtol=0, atol=1e-15)


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_runs_as_a_script(name, tmp_path):
    extra = {"attention_maps": ["--out", str(tmp_path)], "custom_score_mod": ["--out", str(tmp_path / "bias.png")]}
    extra = extra.get(name, [])
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--quick", *extra],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip()


@pytest.mark.skipif(mpi_skip_reason() is not None, reason=str(mpi_skip_reason()))
def test_ring_attention_quick_on_two_ranks(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(EXAMPLES.parent), "OMP_NUM_THREADS": "1"}
    proc = run_mpi(2, EXAMPLES / "ring_attention.py", ["--quick"], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "on 2 rank(s), shards of 21, 43 tokens" in proc.stdout  # 64 tokens, shares 1:2
    assert proc.stdout.count("max |ring - single process|") == 6  # out, lse, dq, dk, dv, dsinks
    assert "4 packed documents, 4 padding tokens, sinks" in proc.stdout


def test_every_example_takes_quick():
    """The README and docs say each example takes --quick."""
    for script in sorted(EXAMPLES.glob("*.py")):
        assert '"--quick"' in script.read_text(), f"{script.name} has no --quick flag"
