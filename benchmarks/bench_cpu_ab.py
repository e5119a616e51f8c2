"""The NumPy fast path at several git revisions, timed side by side in one process.

    python benchmarks/bench_cpu_ab.py HEAD~1 HEAD           # what the last commit moved
    python benchmarks/bench_cpu_ab.py 5efacb1 worktree      # a commit against uncommitted edits
    python benchmarks/bench_cpu_ab.py HEAD --quick          # T=S=512, a smoke run
    python benchmarks/bench_cpu_ab.py HEAD /tmp/variant.py  # a copy of the file, edited

This machine's speed drifts by 5-20% over minutes, more than most single
levers move, so separate runs of ``bench_cpu.py`` cannot attribute a change.
Here every revision's ``npattn/fast_numpy.py`` is loaded as its own module
(``worktree`` is the file on disk, and a path ending in ``.py`` is that file)
and the revisions run in turn, round after round, on the same inputs
(float32, B=1, N=8, H=64, T=S=4096 by default, non-causal then causal). The table holds each revision's best forward and
backward times and their ratio to the first revision's.

Only ``fast_numpy.py`` changes between rows: the rest of npattn (masks, tile
classification, options) is the installed one, so a revision whose fast path
needs other internals than today's cannot be loaded.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import npattn
from npattn.options import make_spec

SOURCE = "npattn/fast_numpy.py"


def load_revision(revision: str, index: int, folder: Path):
    """``npattn/fast_numpy.py`` at ``revision`` (a git revision, ``worktree``
    or the path of a ``.py`` copy) as the module ``npattn._fast_numpy_<index>``."""
    root = Path(npattn.__file__).resolve().parent.parent
    if revision == "worktree":
        path = root / SOURCE
    elif revision.endswith(".py"):
        path = Path(revision)
        if not path.is_file():
            raise SystemExit(f"bench_cpu_ab: no such file: {revision!r}")
    else:
        shown = subprocess.run(["git", "-C", str(root), "show", f"{revision}:{SOURCE}"], capture_output=True, text=True)
        if shown.returncode != 0:
            raise SystemExit(f"bench_cpu_ab: cannot read {SOURCE} at {revision!r}: {shown.stderr.strip()}")
        path = folder / f"fast_numpy_{index}.py"
        path.write_text(shown.stdout)
    name = f"npattn._fast_numpy_{index}"  # a submodule of npattn, so its relative imports resolve
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "revisions", nargs="+", help="git revisions, 'worktree' for the file on disk, or paths to .py copies of it"
    )
    parser.add_argument("--length", type=int, default=4096, help="T = S")
    parser.add_argument("--rounds", type=int, default=5, help="best of this many rounds")
    parser.add_argument("--quick", action="store_true", help="T=S=512, two rounds")
    args = parser.parse_args(argv)
    if args.length < 1 or args.rounds < 1:
        parser.error("--length and --rounds must be >= 1")
    if args.quick:
        args.length, args.rounds = 512, 2

    with tempfile.TemporaryDirectory() as folder:
        modules = [load_revision(rev, i, Path(folder)) for i, rev in enumerate(args.revisions)]
    B, N, H, T = 1, 8, 64, args.length
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))
    print(f"fast path by revision: float32, B={B}, N={N}, H={H}, T=S={T}; best of {args.rounds} interleaved rounds")
    print(
        f"{'mask':<7} {'revision':<16} {'fwd ms':>8} {'x first':>8} {'bwd ms':>8} {'x first':>8} "
        f"{'f+b ms':>8} {'x first':>8}"
    )
    for causal in (False, True):
        spec = make_spec(q, k, v, causal=causal, impl="chunked")
        best = [[float("inf"), float("inf")] for _ in modules]
        for module in modules:  # warm-up: imports, the thread pool, page faults
            module.backward(spec, q, k, v, *module.forward(spec, q, k, v), dout, None)
        for _ in range(args.rounds):
            for times, module in zip(best, modules):
                start = time.perf_counter()
                out, lse = module.forward(spec, q, k, v)
                times[0] = min(times[0], time.perf_counter() - start)
                time.sleep(0.1)
                start = time.perf_counter()
                module.backward(spec, q, k, v, out, lse, dout, None)
                times[1] = min(times[1], time.perf_counter() - start)
                time.sleep(0.1)
        first = best[0]
        for revision, (fwd, bwd) in zip(args.revisions, best):
            print(
                f"{'causal' if causal else 'full':<7} {revision:<16} {fwd * 1e3:8.1f} {fwd / first[0]:8.2f} "
                f"{bwd * 1e3:8.1f} {bwd / first[1]:8.2f} {(fwd + bwd) * 1e3:8.1f} "
                f"{(fwd + bwd) / sum(first):8.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
