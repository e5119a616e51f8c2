"""A GPU session's checks and timings in one command, each step under a time limit.

    python benchmarks/gpu_session.py --prepare aed86d4 1395c71  # here, with git: gpu_bases/REV/npattn
    python benchmarks/gpu_session.py gpu_bases/*                # on the GPU machine: logs under $OUT
    python benchmarks/gpu_session.py --dry-run gpu_bases/*      # the steps and their limits, nothing run
    python benchmarks/gpu_session.py --fused-dq gpu_bases/REV   # the timings with float64's dQ fused, against REV
    python benchmarks/gpu_session.py --kept-q gpu_bases/REV     # and with float64's forward keeping Q in shared memory
    python benchmarks/gpu_session.py --wgmma gpu_bases/REV      # and with float16's kernels on sm_90a's wgmma
    python benchmarks/gpu_session.py --profile gpu_bases/REV    # and Nsight Compute's metrics of the kernels

A GPU is lent to some sessions only, for minutes at a time (the project's
device tool: one machine, 15 minutes of device time a session, its start
included, at most 10 minutes a command, and no network there). So what a
session must learn from it is prepared beforehand and asked in one call:

1. ``env``: the host's CPU, the device and the libraries (``nvidia-smi
   -L``; CuPy's, its CUDA runtime's and torch's versions);
2. ``tests``: ``python -m pytest -m gpu -x`` (in :data:`TEST_WORKERS`
   processes where pytest-xdist is installed): the fused kernels against the
   generic path and NumPy, gradient checks, dropout bits, determinism;
3. ``kernels-REV`` for the first folder given (a copy of another revision's
   package, which ``--prepare`` writes, since the device's copy of the
   checkout has no git history): ``bench_gpu.py --kernels --base FOLDER``,
   every fused kernel against that revision's, call by call in turn;
4. ``targets``: ``bench_gpu.py --targets``, issue 18's table;
5. ``kernels-REV`` for each further folder.

With ``--fused-dq`` the timing steps run ``bench_gpu.py --fused-dq``
(float64's dK/dV kernel summing dQ, not yet shipped): against a base of
the same revision, the fused kernel against the dQ and dK/dV kernels.
With ``--kept-q`` they run ``bench_gpu.py --kept-q`` (float64's forward
keeping Q in shared memory, 3 blocks a multiprocessor, not yet shipped):
against such a base, the forward kernel each way. With ``--wgmma`` they
run ``bench_gpu.py --wgmma`` (float16's kernels on sm_90a's warpgroup
tensor cores, not yet shipped): against such a base, each float16 kernel
each way. The three go together.

With ``--profile``, three steps follow the first kernels step: ``profile``
runs ``profile_gpu.py`` under Nsight Compute (``ncu --set full``, the
clocks left alone, the npattn kernels of one profiled call of each
workload: float64 with its dQ kernel and with the kernels not yet
shipped, float16 on ``mma.sync`` and on ``wgmma``, and a float16 decode
step's forward), its report kept outside ``OUT``; ``profile-metrics``
prints the report's every metric as CSV (``--page raw``) and
``profile-details`` its sections' figures and advice (``--page
details``), each into its log.

Each step's output goes to ``OUT/NN-step.log`` (``OUT``: ``--out``, else
``$OUT``, which the device tool brings back, else ``gpu_session/``) and a
line of the summary on stdout: its exit status (124: its time ran out) and
seconds. A step runs for at most its own limit (:data:`STEP_LIMITS`) and
what is left of ``--budget``; one that would start with less than
:data:`MIN_STEP_SECONDS` left is skipped and says so. The later steps reuse
the kernels the earlier ones compiled (CuPy's cache on disk), so the order
also saves compile time.

The device tool's call for it (the bases carried, being ignored by git)::

    run(command="python benchmarks/gpu_session.py --budget 540 gpu_bases/*",
        carry=["gpu_bases"], timeout_s=600)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Each step's limit in seconds (a kernels step's for each base).
STEP_LIMITS = {"env": 30, "tests": 240, "targets": 300, "kernels": 150, "profile": 180, "profile-report": 60}

#: Where ``--profile``'s Nsight Compute report goes on the GPU machine (not
#: under ``OUT``, whose files come back: the logs hold what is read of it).
PROFILE_REPORT = Path(tempfile.gettempdir()) / "npattn-profile"

#: pytest-xdist's workers for the tests step, where it is installed (the GPU
#: machines have it and 16 cores): most of the step is NVRTC compiling kernels.
TEST_WORKERS = 8

#: A step that would start with less than this left of the budget is skipped.
MIN_STEP_SECONDS = 30


def print_environment() -> int:
    """The ``env`` step: the host's CPU, the device, CuPy with its CUDA
    runtime, torch, and what the tests need (the machine cannot install what
    is missing)."""
    host = runpy.run_path(str(ROOT / "benchmarks" / "bench_workloads.py"))["cpu_model"]()
    print(f"host {host}, {os.cpu_count()} CPUs")
    smi = shutil.which("nvidia-smi")
    print(subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip() if smi else "no nvidia-smi")
    try:
        import cupy

        print("cupy", cupy.__version__, "CUDA runtime", cupy.cuda.runtime.runtimeGetVersion())
    except Exception as error:  # no CuPy, or no device: say which
        print("cupy:", error)
    try:
        import torch

        print("torch", torch.__version__, "CUDA", torch.version.cuda)
    except Exception as error:
        print("torch:", error)
    for name in ("numpy", "array_api_compat", "pytest", "hypothesis", "array_api_strict"):
        try:
            print(name, importlib.import_module(name).__version__)
        except ImportError as error:
            print(f"{name}:", error)
    return 0


def profile_steps() -> list[tuple[str, list[str], int]]:
    """``--profile``'s steps: the calls of ``profile_gpu.py`` under Nsight
    Compute, then its report read back as every metric and as each section's text."""
    ncu, python = shutil.which("ncu") or "ncu", sys.executable
    report = f"{PROFILE_REPORT}.ncu-rep"
    collect = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--set", "full"]
    collect += ["--kernel-name", "regex:npattn_", "-f", "-o", str(PROFILE_REPORT)]
    collect += [python, str(ROOT / "benchmarks" / "profile_gpu.py")]
    return [
        ("profile", collect, STEP_LIMITS["profile"]),
        ("profile-metrics", [ncu, "--import", report, "--page", "raw", "--csv"], STEP_LIMITS["profile-report"]),
        ("profile-details", [ncu, "--import", report, "--page", "details"], STEP_LIMITS["profile-report"]),
    ]


def steps(
    bases: list[str], fused_dq: bool = False, profile: bool = False, kept_q: bool = False, wgmma: bool = False
) -> list[tuple[str, list[str], int]]:
    """``(name, command, limit)`` of each step, in order; with ``fused_dq``,
    ``kept_q`` and ``wgmma``, the timings' with ``bench_gpu.py
    --fused-dq``, ``--kept-q`` and ``--wgmma``; with ``profile``,
    :func:`profile_steps` after the first kernels step."""
    python, bench = sys.executable, str(ROOT / "benchmarks" / "bench_gpu.py")
    unshipped = [flag for flag, on in (("--fused-dq", fused_dq), ("--kept-q", kept_q), ("--wgmma", wgmma)) if on]
    bench_gpu = [python, bench, *unshipped]
    pytest = [python, "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:  # the kernels compile in TEST_WORKERS processes
        pytest += ["-n", str(TEST_WORKERS)]
    kernels = [("kernels-" + Path(base).name, [*bench_gpu, "--kernels", "--base", base]) for base in bases]
    return [
        ("env", [python, str(Path(__file__).resolve()), "--env"], STEP_LIMITS["env"]),
        ("tests", pytest, STEP_LIMITS["tests"]),
        *((name, command, STEP_LIMITS["kernels"]) for name, command in kernels[:1]),
        *(profile_steps() if profile else []),
        ("targets", [*bench_gpu, "--targets"], STEP_LIMITS["targets"]),
        *((name, command, STEP_LIMITS["kernels"]) for name, command in kernels[1:]),
    ]


def run_steps(plan: list[tuple[str, list[str], int]], out: Path, budget: float) -> int:
    """Run ``plan`` within ``budget`` seconds, each step's output into ``out``;
    print a summary line per step. Returns 0 if every step ran and passed."""
    out.mkdir(parents=True, exist_ok=True)
    start, failures = time.monotonic(), 0
    for number, (name, command, limit) in enumerate(plan, 1):
        left = budget - (time.monotonic() - start)
        if left < MIN_STEP_SECONDS:
            print(f"{name:<24} skipped: {left:.0f} s of the budget left", flush=True)
            failures += 1
            continue
        log = out / f"{number:02d}-{name}.log"
        began = time.monotonic()
        with log.open("w") as sink:
            try:
                status = subprocess.run(
                    command, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, timeout=min(limit, left)
                ).returncode
            except subprocess.TimeoutExpired:
                status = 124
            except OSError as error:  # the command is not there (ncu on a machine without it)
                print(f"{command[0]}: {error}", file=sink)
                status = 127
        failures += status != 0
        print(f"{name:<24} exit {status:<4} {time.monotonic() - began:6.1f} s  {log}", flush=True)
    return int(failures > 0)


def prepare(revisions: list[str], folder: Path) -> int:
    """``folder/REV/npattn`` for each git revision: the package as it was, for
    ``--base`` on a machine whose copy of the checkout has no history."""
    for revision in revisions:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "npattn"], capture_output=True)
        if archive.returncode != 0:
            print(f"git archive {revision}: {archive.stderr.decode().strip()}", file=sys.stderr)
            return 1
        target = folder / revision
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
        print(target)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bases", nargs="*", help="folders holding another revision's npattn/, for --kernels --base")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all the steps (default 540)")
    parser.add_argument("--out", help="folder for the logs (default: $OUT, else gpu_session/)")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their limits, run nothing")
    parser.add_argument(
        "--prepare", nargs="+", metavar="REV", help="instead: write gpu_bases/REV/npattn for each git revision"
    )
    parser.add_argument("--env", action="store_true", help="instead: the env step alone")
    parser.add_argument(
        "--fused-dq", action="store_true", help="time with float64's dQ summed in dK/dV (bench_gpu.py --fused-dq)"
    )
    parser.add_argument(
        "--kept-q", action="store_true", help="time with float64's forward keeping Q in shared memory (bench_gpu.py)"
    )
    parser.add_argument(
        "--wgmma", action="store_true", help="time with float16's kernels on sm_90a's wgmma (bench_gpu.py --wgmma)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="Nsight Compute's metrics of profile_gpu.py's calls, after the kernels"
    )
    args = parser.parse_args(argv)
    if args.env:
        return print_environment()
    if args.prepare:
        return prepare(args.prepare, ROOT / "gpu_bases")
    if args.budget < MIN_STEP_SECONDS:
        parser.error(f"--budget must be at least {MIN_STEP_SECONDS} s, got {args.budget}")
    missing = [base for base in args.bases if not (Path(base) / "npattn").is_dir()]
    if missing:
        parser.error(f"no npattn/ package in {', '.join(missing)} (write them with --prepare)")
    bases = [str(Path(base).resolve()) for base in args.bases]
    plan = steps(bases, args.fused_dq, args.profile, args.kept_q, args.wgmma)
    if args.dry_run:
        for name, command, limit in plan:
            print(f"{name:<24} {limit:4d} s  {' '.join(command)}")
        return 0
    return run_steps(plan, Path(args.out or os.environ.get("OUT") or ROOT / "gpu_session"), args.budget)


if __name__ == "__main__":
    sys.exit(main())
