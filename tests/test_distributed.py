"""npattn.distributed: exact ring attention over MPI.

The MPI tests launch ``mpiexec -n P python tests/mpi_ring_worker.py`` as a
subprocess (with a timeout) for P = 1, 2 and 4, once per P, and check every
rank's shard of out, lse, dq, dk and dv against single-process dense
attention on the concatenated sequence in float64 (to 1e-12), and out/lse
against the independent oracle tests/reference.py too. They skip, saying
why, where mpi4py or an ``mpiexec`` is missing (``pip install "npattn[mpi]"``
brings both; MPICH's wheel puts ``mpiexec`` beside the Python executable).

The cases cover every option of attention_forward but user score mods:
global lengths (shards all padding included), packed documents (segment ids
crossing shard boundaries or inside one rank), dropout on global indices,
the three bias layouts (with broadcast query and head axes), softcap, ALiBi
and sinks, alone and together; their gradients (this rank's dbias in its own
bias's shape, dsinks and dalibi_slopes in full on every rank) are checked too.

Without MPI: the ImportError when mpi4py is missing.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import mpi_ring_worker as worker
import pytest
from mpi_support import find_mpiexec, mpi_skip_reason, run_mpi

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKER = pathlib.Path(worker.__file__).resolve()
TIMEOUT_S = 120
TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 5e-3}  # float16: outputs rounded to float16


needs_mpi = pytest.mark.skipif(mpi_skip_reason() is not None, reason=str(mpi_skip_reason()))


def run_worker(P: int, mode: str, path: pathlib.Path, names: list[str] = ()) -> dict:
    """Launch the worker on P ranks; return rank 0's JSON."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(WORKER.parent), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks on 2 cores: no thread oversubscription on top
    try:
        proc = run_mpi(P, WORKER, [mode, path, *names], env=env, cwd=REPO, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{' '.join(err.cmd)} did not finish in {TIMEOUT_S} s (deadlock?)\n{err.stdout}\n{err.stderr}")
    if proc.returncode != 0 or not path.exists():
        pytest.fail(f"{' '.join(proc.args)} exited with {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    result = json.loads(path.read_text())
    assert result["size"] == P, (
        f"mpiexec started {result['size']} rank(s), not {P}: {find_mpiexec()} belongs to a different MPI "
        "than mpi4py (singletons)"
    )
    return result


P1_CASES = [n for n, c in worker.CASES.items() if not isinstance(c.get("lengths"), dict) or 1 in c["lengths"]["q"]]
PARAM_GRADS = {"bias": "dbias", "sinks": "dsinks", "alibi": "dalibi_slopes"}  # case key -> gradient


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """``results(P)``: every case on P ranks, one mpiexec launch per P."""
    cache = {}

    def results(P: int) -> dict:
        if P not in cache:
            path = tmp_path_factory.mktemp(f"ring{P}") / "result.json"
            cache[P] = run_worker(P, "cases", path, P1_CASES if P == 1 else [])
        return cache[P]

    return results


def _case_params():
    for P in (1, 2, 4):
        for name in worker.CASES:
            if P == 1 and name not in P1_CASES:
                continue
            marks = [pytest.mark.gpu] if worker.CASES[name].get("backend") == "cupy" else []
            yield pytest.param(P, name, id=f"n{P}-{name}", marks=marks)


@needs_mpi
@pytest.mark.parametrize("P, name", list(_case_params()))
def test_ring_equals_single_process_attention(ring_results, P, name):
    ranks = ring_results(P)["ranks"]
    dtype = worker.CASES[name].get("dtype", "float64")
    tol = TOL[dtype]
    for r, res in enumerate(ranks):
        result = res[name]
        if "skipped" in result:
            pytest.skip(result["skipped"])
        assert "exception" not in result, f"rank {r} raised:\n{result.get('exception')}"
        case = worker.CASES[name]
        params = [grad for key, grad in PARAM_GRADS.items() if key in case]
        for key in ("out", "lse", "dq", "dk", "dv", "out_oracle", "lse_oracle", *params):
            assert result[key] <= tol, f"rank {r}: max |ring - single process| of {key} is {result[key]:.3g}"
        assert result["unexpected_grads"] == [], f"rank {r} returned gradients of inputs it was not given"
        assert result["out_dtype"] == dtype and result["grad_dtype"] == dtype
        assert result["dbias_dtype"] == (dtype if "bias" in case else None)
        backend = worker.CASES[name].get("backend", "numpy")
        expected_library = {"cupy": "cupy", "torch": "torch"}.get(
            backend, "numpy" if backend.startswith("numpy") else "array_api_strict"
        )
        assert result["libraries"] == [expected_library], f"rank {r} returned {result['libraries']}"


@needs_mpi
@pytest.mark.parametrize("P", [2, 4])
def test_causal_skips_hidden_steps_and_counts_bytes(ring_results, P):
    ranks = ring_results(P)["ranks"]
    T = 3  # "equal" shards: 3 queries and keys per rank, shape (B, N, K, H, Hv) = (2, 2, 2, 3, 2)
    kv_bytes = 2 * 2 * T * (3 + 2) * 8  # k and v of one shard, float64
    for r, res in enumerate(ranks):
        fwd, bwd = res["causal-equal"]["forward"], res["causal-equal"]["backward"]
        assert (fwd["computed"], fwd["skipped"]) == (r + 1, P - r - 1)  # shards after r are hidden
        assert fwd["bytes_sent"] == fwd["bytes_received"] == (P - 1) * kv_bytes
        assert bwd["bytes_sent"] == (P - 1) * kv_bytes + P * kv_bytes  # k, v; then dk, dv incl. the hop home
        assert fwd["transport"] == "buffer"
        assert res["noncausal-equal"]["forward"]["computed"] == P


def _computed(res: dict, name: str) -> list:
    fwd, bwd = res[name]["forward"], res[name]["backward"]
    return [(fwd["steps"], fwd["computed"], fwd["skipped"]), (bwd["steps"], bwd["computed"], bwd["skipped"])]


@needs_mpi
@pytest.mark.parametrize("P", [2, 4])
def test_packed_documents_skip_steps_whose_documents_cannot_meet(ring_results, P):
    """Case "segments-aligned": shards of 3, documents of 6, 3, 3 tokens, not
    causal. At P = 4 ranks 0-1 hold document 0, rank 2 document 1, rank 3
    document 2: each rank computes only the steps with a shard of its own
    document. At P = 2 one document covers everything."""
    ranks = ring_results(P)["ranks"]
    computed = {2: [2, 2], 4: [2, 2, 1, 1]}[P]
    for r, res in enumerate(ranks):
        expected = (P, computed[r], P - computed[r])
        assert _computed(res, "segments-aligned") == [expected, expected], f"rank {r}"


@needs_mpi
@pytest.mark.parametrize("P", [2, 4])
def test_all_padding_shards_are_skipped(ring_results, P):
    """Case "padding-shards": shards of 3, not causal; the global q_lengths end
    before rank P/2 and kv_lengths before rank P-1. Ranks from P/2 on compute
    nothing, forward or backward; the others skip only the step with rank
    P-1's keys."""
    ranks = ring_results(P)["ranks"]
    for r, res in enumerate(ranks):
        computed = P - 1 if r < P // 2 else 0
        expected = (P, computed, P - computed)
        assert _computed(res, "padding-shards") == [expected, expected], f"rank {r}"


@needs_mpi
def test_fully_masked_rows_cross_the_ring(ring_results):
    ranks = ring_results(4)["ranks"]
    assert sum(res["causal-bottom-right-T>S"]["fully_masked_rows"] for res in ranks) > 0


# What every rank must raise (type, part of the message or a tuple of parts); the
# worker runs each on 2 ranks.
EXPECTED_ERRORS = {
    "head-dim-mismatch": ("ValueError", "q/k head dim H (axis -1) differs across ranks: rank 0 has 4, rank 1 has 2"),
    "dtype-mismatch": ("ValueError", "rank 0 has float64, rank 1 has float32"),
    "heads-mismatch": ("ValueError", "number of query heads N"),
    "comm-none": ("TypeError", "comm is required"),
    "comm-not-communicator": ("TypeError", "comm must be an mpi4py communicator"),
    "comm-null": ("ValueError", "communicator of size 0"),
    "starts-overlap": ("ValueError", "q_start does not tile the sequence [0, 6)"),
    "starts-gap": ("ValueError", "found rank 1 starting at 4"),
    "starts-some-ranks": ("ValueError", "q_start was given on some ranks but not on ranks [1]"),
    "causal-T!=S-no-align": ("ValueError", "needs an explicit alignment"),
    "causal-mismatch": ("ValueError", "causal/window differs across ranks"),
    "bad-input-one-rank": ("ValueError", "rank 1: q must have rank >= 3"),
    "empty-kv-shard": ("ValueError", "rank 1: this rank's k/v shard holds no key"),
    "bad-transport": ("ValueError", "transport must be one of"),
    "backward-bad-dout-one-rank": ("ValueError", "rank 0: dout must have the forward's shape"),
    "backward-not-residuals": ("TypeError", "residuals must come from ring_attention_forward"),
    "q_lengths-differ": ("ValueError", ("q_lengths", "differs across ranks")),
    "kv_lengths-differ": ("ValueError", ("kv_lengths", "differs across ranks")),
    "q_lengths-past-total": ("ValueError", ("q_lengths", "[0, 6]")),
    "q_lengths-negative": ("ValueError", "q_lengths must lie in [0, 6]"),
    "segment-ids-some-ranks": ("ValueError", ("segment ids", "on some ranks")),
    "bias-fits-no-layout": ("ValueError", "bias"),
    "bias-fits-no-layout-one-rank": ("ValueError", ("bias", "rank 1: (1, 2, 3, 2)")),
    "bias-some-ranks": ("ValueError", "bias"),
    "bias-layouts-differ": ("ValueError", "bias"),
    "bias-leading-axes-differ": ("ValueError", "bias"),
    "dropout-seed-differs": ("ValueError", ("seed", "differs across ranks")),
    "dropout-p-differs": ("ValueError", "differs across ranks"),
    "softcap-differs": ("ValueError", "differs across ranks"),
    "alibi-slopes-differ": ("ValueError", "differs across ranks"),
    "sinks-differ": ("ValueError", "differs across ranks"),
    "sinks-some-ranks": ("ValueError", "sinks"),
    "alibi-T!=S-no-align": ("ValueError", "needs an explicit alignment"),
    "still-works-afterwards": None,
}


@pytest.fixture(scope="module")
def error_results(tmp_path_factory):
    return run_worker(2, "errors", tmp_path_factory.mktemp("errors") / "result.json")


@needs_mpi
@pytest.mark.parametrize("name", list(EXPECTED_ERRORS))
def test_bad_input_raises_on_every_rank(error_results, name):
    expected = EXPECTED_ERRORS[name]
    for r, res in enumerate(error_results["ranks"]):
        got = res[name]
        if expected is None:
            assert got is None, f"rank {r} raised {got}"
            continue
        assert got is not None, f"rank {r} raised nothing"
        parts = (expected[1],) if isinstance(expected[1], str) else expected[1]
        assert got[0] == expected[0] and all(part in got[1] for part in parts), f"rank {r}: {got}"
    assert error_results["ranks"][0][name] == error_results["ranks"][1][name]  # the same error everywhere


# --- without MPI ------------------------------------------------------------------


def test_import_needs_no_mpi4py_and_calling_names_the_extra():
    """``import npattn`` and ``import npattn.distributed`` work without mpi4py
    (and never import it); calling the ring raises a clear ImportError."""
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"
        "import numpy as np, npattn, npattn.distributed as dist\n"
        "assert sys.modules['mpi4py'] is None\n"
        "x = np.zeros((1, 2, 3))\n"
        "try:\n"
        "    dist.ring_attention_forward(x, x, x, comm=None)\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert 'pip install "npattn[mpi]"' in proc.stdout


def test_importing_npattn_does_not_import_mpi4py():
    code = "import sys, npattn, npattn.distributed, npattn.merge; print('mpi4py' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


@needs_mpi
def test_example_script_runs_on_two_ranks():
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = run_mpi(2, REPO / "examples" / "ring_attention.py", env=env, cwd=REPO, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "max |ring - single process|" in proc.stdout
