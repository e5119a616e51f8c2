"""Every CPU workload of issue 17 in one table: npattn against torch, side by side.

    python benchmarks/bench_workloads.py                 # every row
    python benchmarks/bench_workloads.py --rows decode   # rows whose name contains "decode"
    python benchmarks/bench_workloads.py --base HEAD~1   # also that git revision of npattn, A/B
    python benchmarks/bench_workloads.py --quick         # small shapes, a smoke run
    python benchmarks/bench_workloads.py --auto-grid     # chunked ÷ dense: impl="auto"'s rules
    python benchmarks/bench_workloads.py --more          # workloads of the same kinds, not listed below

Rows (float32; torch's 2.x CPU kernels limited to the same threads):

========================  ==========================================================
decode S=8192 / S=512     T=1 query, N=32 query heads on K=8 kv heads, H=128, forward
                          (torch: SDPA with ``enable_gqa=True``)
B8 N12 T512 causal        B=8, N=12, T=S=512, H=64, causal
B32 N8 T128               B=32, N=8, T=S=128, H=64, full
tiny                      B=1, N=1, T=S=16, H=16, full: the per-call floor
MHA E512                  the layer, E=512, 8 heads, B=8, T=256, self-attention
                          (torch: ``nn.MultiheadAttention``, the same weights)
headline T4096            B=1, N=8, T=S=4096, H=64, full
========================  ==========================================================

``--more`` prints other mixes of the same kinds instead: float64, GQA
training (also MQA and GQA with one batch element and few kv heads, torch's
SDPA with ``enable_gqa=True``), a long causal call, H=128, padding by
``kv_lengths`` (torch: the
same keys hidden by a bool mask), batched decoding with lengths, short
sequences, full and causal, a sliding window of 256 at T=4096 (torch:
the band as a bool mask), and decoding from a growing cache, a new ``S``
each call (see :func:`more_workloads`).

Each row but decoding runs forward and forward+backward. npattn runs
``impl="auto"`` and the ``path`` column says which path that chose. The
samples of a row alternate (npattn, torch, npattn, ...) in one process; each
time is the median over samples, a sample being several calls where one call
is shorter than a millisecond. Before each sample its side runs untimed for
``SETTLE_S`` (0.15 s): the other side's idle threads stop spinning
meanwhile (OpenBLAS's spin for about 0.1 s after a threaded product and take
a core while they do; with short pauses instead, torch's forward at B=32,
T=128 took 23.8 ms against 12.8 ms alone), so each side is timed as in a
loop of its own calls. GFLOP/s counts ``4 B N T S H`` for the forward
(the visible half for causal), 3.5x that with the backward (the layer's
projections included for MHA).

``load`` is how many cores *other* processes kept busy during the row (from
``/proc/stat``, less this process's own CPU time). A row with more than
``--max-load`` is run again, at most twice, and marked ``*`` if it stayed
disturbed.

``--base REV`` loads the ``npattn`` package of that git revision (or a
folder holding a copy of the package, ``worktree`` for the files on disk) as
a second module and times it in the same interleaving: the columns ``base
ms`` and ``÷ base`` then attribute a change to it, measured A/B in one
process, which separate runs cannot on a machine whose speed drifts.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import npattn

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Workload:
    """One row of the table: a name, the shapes, and how to make its calls."""

    name: str
    shape: str
    flops_forward: float
    make: Callable[[Any, Any, np.random.Generator], dict[str, dict[str, Callable[[], Any]]]]
    backward: bool = True


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def _busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Cores kept busy by other processes between ``start()`` and ``stop()``."""

    def start(self) -> None:
        self.busy, self.own, self.wall = _busy_seconds(), time.process_time(), time.perf_counter()

    def stop(self) -> float | None:
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        others = (busy - self.busy) - (time.process_time() - self.own)
        return max(others, 0.0) / (time.perf_counter() - self.wall)


# --- the calls of each workload ---------------------------------------------


def _attention_calls(
    lib, torch, q, k, v, dout, causal: bool, kv_lengths: Any = None, window: int | None = None
) -> dict:
    """``{"forward": {...}, "fwd+bwd": {...}}``, each mapping a side to a call;
    ``window``: each query sees itself and the ``window`` keys before it."""
    options: dict = {"causal": causal}
    if kv_lengths is not None:
        options["kv_lengths"] = kv_lengths
    if window is not None:
        options["window"] = (window, 0)

    def fwd():
        return lib.attention_forward(q, k, v, **options)

    def fwd_bwd():
        return lib.attention_backward(dout, fwd()[1])

    calls: dict = {"forward": {"npattn": fwd}, "fwd+bwd": {"npattn": fwd_bwd}}
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        gqa = q.shape[-3] != k.shape[-3]
        tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
        tdout = torch.from_numpy(dout)
        mask = None
        if kv_lengths is not None:  # (B, 1, 1, S): the keys each batch element sees
            mask = torch.from_numpy(np.arange(k.shape[-2]) < kv_lengths[:, None])[:, None, None, :]
        if window is not None:  # (T, S): the band 0 <= i - j <= window (T = S)
            offset = np.arange(q.shape[-2])[:, None] - np.arange(k.shape[-2])
            mask = torch.from_numpy((offset >= 0) & (offset <= window))

        def t_fwd():
            with torch.no_grad():
                return sdpa(tq, tk, tv, attn_mask=mask, is_causal=causal, enable_gqa=gqa)

        def t_fwd_bwd():
            sdpa(tq, tk, tv, attn_mask=mask, is_causal=causal, enable_gqa=gqa).backward(tdout)
            tq.grad = tk.grad = tv.grad = None

        calls["forward"]["torch"], calls["fwd+bwd"]["torch"] = t_fwd, t_fwd_bwd
    return calls


def attention_workload(
    name: str,
    B: int,
    N: int,
    K: int,
    T: int,
    S: int,
    H: int,
    causal=False,
    backward=True,
    dtype: Any = np.float32,
    kv_lengths: list[int] | None = None,
    window: int | None = None,
):
    """A row of :func:`npattn.attention_forward` on ``(B, N, T, H)`` queries
    against ``(B, K, S, H)`` keys and values, each batch element seeing its
    first ``kv_lengths[b]`` keys when given (B of them, non-causal), each
    query its ``window`` preceding keys and itself when given (``T = S``,
    not causal: the window is)."""
    visible = 0.5 if causal and T == S else 1.0
    if kv_lengths is not None:
        visible = sum(kv_lengths) / (B * S)
    if window is not None:
        visible = sum(min(i, window) + 1 for i in range(T)) / (T * S)
    lengths = None if kv_lengths is None else np.asarray(kv_lengths)

    def make(lib, torch, rng):
        q = rng.standard_normal((B, N, T, H)).astype(dtype)  # (B, N, T, H)
        k = rng.standard_normal((B, K, S, H)).astype(dtype)  # (B, K, S, H)
        v = rng.standard_normal((B, K, S, H)).astype(dtype)  # (B, K, S, Hv)
        dout = rng.standard_normal((B, N, T, H)).astype(dtype)  # (B, N, T, Hv)
        return _attention_calls(lib, torch, q, k, v, dout, causal, lengths, window)

    kv = f" on K={K}" if K != N else ""
    extra = (" causal" if causal else "") + (" kv_lengths" if kv_lengths else "")
    extra += "" if window is None else f" window={window}"
    extra += "" if np.dtype(dtype) == np.float32 else f" {np.dtype(dtype).name}"
    shape = f"B={B} N={N}{kv} T={T} S={S} H={H}{extra}"
    return Workload(name, shape, 4 * B * N * T * S * H * visible, make, backward)


def mha_workload(name: str, B: int, T: int, E: int, heads: int) -> Workload:
    """A row of the layer, :func:`npattn.mha_forward`, self-attention against
    torch's ``nn.MultiheadAttention`` holding the same weights."""

    def make(lib, torch, rng):
        params = lib.mha_init(E, heads, dtype=np.float32, seed=0)
        x = rng.standard_normal((B, T, E), dtype=np.float32)  # (B, T, E)
        dy = rng.standard_normal((B, T, E), dtype=np.float32)  # (B, T, E)

        def fwd():
            return lib.mha_forward(params, x, num_heads=heads)

        def fwd_bwd():
            return lib.mha_backward(dy, fwd()[1])

        calls: dict = {"forward": {"npattn": fwd}, "fwd+bwd": {"npattn": fwd_bwd}}
        if torch is not None:
            layer = torch.nn.MultiheadAttention(E, heads, batch_first=True)
            state = lib.mha_params_to_torch(params)
            layer.load_state_dict({key: torch.from_numpy(np.asarray(a)) for key, a in state.items()})
            tx, tdy = torch.from_numpy(x.copy()).requires_grad_(), torch.from_numpy(dy)

            def t_fwd():
                with torch.no_grad():
                    return layer(tx, tx, tx, need_weights=False)

            def t_fwd_bwd():
                layer(tx, tx, tx, need_weights=False)[0].backward(tdy)
                layer.zero_grad(set_to_none=True)
                tx.grad = None

            calls["forward"]["torch"], calls["fwd+bwd"]["torch"] = t_fwd, t_fwd_bwd
        return calls

    projections = 2 * B * T * E * E * 4  # q, k, v and out projections
    attention = 4 * B * T * T * E
    return Workload(name, f"B={B} T={T} E={E} heads={heads}", projections + attention, make)


def workloads(quick: bool) -> list[Workload]:
    if quick:
        return [
            attention_workload("decode S=512", 1, 8, 2, 1, 512, 32, backward=False),
            attention_workload("B2 N4 T64 causal", 2, 4, 4, 64, 64, 16, causal=True),
            attention_workload("tiny", 1, 1, 1, 16, 16, 16),
            mha_workload("MHA E64", 2, 32, 64, 4),
        ]
    return [
        attention_workload("decode S=8192", 1, 32, 8, 1, 8192, 128, backward=False),
        attention_workload("decode S=512", 1, 32, 8, 1, 512, 128, backward=False),
        attention_workload("B8 N12 T512 causal", 8, 12, 12, 512, 512, 64, causal=True),
        attention_workload("B32 N8 T128", 32, 8, 8, 128, 128, 64),
        attention_workload("tiny", 1, 1, 1, 16, 16, 16),
        mha_workload("MHA E512", 8, 256, 512, 8),
        attention_workload("headline T4096", 1, 8, 8, 4096, 4096, 64),
    ]


def growing_decode_workload(name: str, N: int, K: int, S: int, steps: int, H: int) -> Workload:
    """Decoding from a growing cache: each call one query against the first
    ``S``, ``S + 1``, ..., ``S + steps - 1`` keys of a preallocated cache,
    then around again, so that no two calls in a row share a shape (npattn:
    ``causal=True, align="bottom_right"``, as :func:`npattn.mha_forward`
    with a :class:`npattn.KVCache`; torch: SDPA on the same views, where
    one query sees every key)."""

    def make(lib, torch, rng):
        q = rng.standard_normal((1, N, 1, H)).astype(np.float32)  # (1, N, 1, H)
        k, v = (rng.standard_normal((1, K, S + steps, H)).astype(np.float32) for _ in range(2))  # (1, K, S + steps, H)
        lengths = {side: itertools.cycle(range(S, S + steps)) for side in ("npattn", "torch")}

        def fwd():
            n = next(lengths["npattn"])
            return lib.attention_forward(q, k[..., :n, :], v[..., :n, :], causal=True, align="bottom_right")

        calls: dict = {"forward": {"npattn": fwd}}
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

            def t_fwd():
                n = next(lengths["torch"])
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(
                        tq, tk[..., :n, :], tv[..., :n, :], enable_gqa=N != K
                    )

            calls["forward"]["torch"] = t_fwd
        return calls

    shape = f"B=1 N={N} on K={K} T=1 S={S}..{S + steps - 1} H={H}, a new S each call"
    return Workload(name, shape, 4 * N * (S + (steps - 1) / 2) * H, make, backward=False)


def more_workloads(quick: bool) -> list[Workload]:
    """Other mixes of the same kinds (issue 17: "workloads of the same kinds
    that are not listed here ... are measured too")."""
    pad = [512, 400, 300, 512, 256, 128, 500, 450]  # kv_lengths of B=8
    if quick:
        return [
            attention_workload("f64 B2 N2 T32", 2, 2, 2, 32, 32, 16, dtype=np.float64),
            attention_workload("pad B2 N2 T32", 2, 2, 2, 32, 32, 16, kv_lengths=[32, 20]),
            attention_workload("decode pad B2 S64", 2, 4, 2, 1, 64, 16, backward=False, kv_lengths=[64, 9]),
            attention_workload("window 8 B2 T64", 2, 2, 2, 64, 64, 16, window=8),
            growing_decode_workload("decode growing S64+", 4, 2, 64, 16, 16),
        ]
    return [
        attention_workload("f64 B8 N8 T256", 8, 8, 8, 256, 256, 64, dtype=np.float64),
        attention_workload("GQA B4 N16/4 T512 c", 4, 16, 4, 512, 512, 64, causal=True),
        attention_workload("B1 N16 T2048 causal", 1, 16, 16, 2048, 2048, 64, causal=True),
        attention_workload("B2 N4 T1024 H128", 2, 4, 4, 1024, 1024, 128),
        attention_workload("MQA B1 N8/1 T2048", 1, 8, 1, 2048, 2048, 64),
        attention_workload("GQA B1 N8/2 T4096 c", 1, 8, 2, 4096, 4096, 64, causal=True),
        attention_workload("pad B8 N12 T512", 8, 12, 12, 512, 512, 64, kv_lengths=pad),
        attention_workload(
            "decode pad B8 S4096", 8, 32, 8, 1, 4096, 128, backward=False, kv_lengths=[x * 8 for x in pad]
        ),
        attention_workload("B16 N12 T64", 16, 12, 12, 64, 64, 64),
        attention_workload("B4 N8 T128 causal", 4, 8, 8, 128, 128, 64, causal=True),
        attention_workload("B1 N8 T64", 1, 8, 8, 64, 64, 64),
        attention_workload("window 256 B1 T4096", 1, 8, 8, 4096, 4096, 64, window=256),
        growing_decode_workload("decode growing S512+", 32, 8, 512, 512, 128),
    ]


# --- timing -----------------------------------------------------------------


def _calls_per_sample(fn: Callable[[], Any]) -> int:
    """Calls per timed sample: enough to fill about a millisecond."""
    start = time.perf_counter()
    fn()
    return max(1, int(1e-3 / max(time.perf_counter() - start, 1e-7)))


#: Seconds of untimed calls a side makes before each of its samples: the
#: other side's idle threads stop spinning meanwhile (OpenBLAS's spin for
#: about 0.1 s after a threaded product, and take a core while they do), and
#: this side's own threads are awake, as in a loop of its own calls.
SETTLE_S = 0.15


def _settle(fn: Callable[[], Any], seconds: float) -> None:
    """Untimed calls of ``fn`` for ``seconds``, at least one."""
    deadline = time.perf_counter() + seconds
    fn()
    while time.perf_counter() < deadline:
        fn()


def interleaved_medians(calls: dict[str, Callable[[], Any]], budget_s: float, min_samples: int) -> dict[str, float]:
    """Median seconds per call of each of ``calls``, the sides alternating
    sample by sample, each leading a round in turn, each sample preceded by
    :data:`SETTLE_S` of the same side's untimed calls; samples
    continue until ``budget_s`` is spent (at least ``min_samples`` each)."""
    for fn in calls.values():
        fn()  # warm-up
    per_sample = {name: _calls_per_sample(fn) for name, fn in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    deadline = time.perf_counter() + budget_s
    names = list(calls)
    while len(times[names[0]]) < min_samples or time.perf_counter() < deadline:
        first = len(times[names[0]]) % len(names)  # each side leads in turn: no side always follows another
        for name in names[first:] + names[:first]:
            _settle(calls[name], SETTLE_S)
            start = time.perf_counter()
            for _ in range(per_sample[name]):
                calls[name]()
            times[name].append((time.perf_counter() - start) / per_sample[name])
    return {name: float(np.median(t)) for name, t in times.items()}


def timed_row(calls: dict, args) -> tuple[dict[str, float], float | None, bool]:
    """Times of one row, rerun while other processes load the machine."""
    load = OtherLoad()
    for _attempt in range(3):
        load.start()
        medians = interleaved_medians(calls, args.budget, args.min_samples)
        other = load.stop()
        if other is None or other <= args.max_load:
            return medians, other, False
    return medians, other, True


def npattn_path(residuals: Any) -> str:
    """The path ``impl="auto"`` took (with the chunked kernel's name)."""
    residuals = getattr(residuals, "attention", residuals)  # the layer's core
    if residuals.spec.impl == "dense":
        return "dense"
    return "fast" if getattr(residuals, "kernel", "numpy") == "numpy" else "generic"


# --- the base revision ------------------------------------------------------


def load_base(revision: str) -> Any:
    """The ``npattn`` package of ``revision`` as a module named ``npattn_base``:
    ``git archive`` of that revision (or the folder ``revision/npattn``, or
    this checkout's files for ``worktree``) copied under a new name. The
    package uses relative imports only, so the copy imports itself."""
    folder = Path(tempfile.mkdtemp(prefix="npattn_base_"))
    target = folder / "npattn_base"
    if revision == "worktree":
        subprocess.run(["cp", "-r", str(ROOT / "npattn"), str(target)], check=True)
    elif Path(revision, "npattn").is_dir():
        subprocess.run(["cp", "-r", str(Path(revision, "npattn")), str(target)], check=True)
    else:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", revision, "npattn"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        (folder / "npattn").rename(target)
    _own_kernel_sources(target)
    sys.path.insert(0, str(folder))
    return importlib.import_module("npattn_base")


def _own_kernel_sources(package: Path) -> None:
    """Point a base copy's ``fast_cupy`` at its own CUDA sources: revisions
    before 2026-11-27's tenth session read them as ``resources.files("npattn")``,
    which in the copy ``npattn_base`` is this checkout's package, so that an
    A/B compiled this checkout's kernels with the base's definitions (and a
    base whose sources list differs failed to compile)."""
    module = package / "fast_cupy.py"
    if module.is_file():
        text = module.read_text(encoding="utf-8")
        module.write_text(text.replace('resources.files("npattn")', "resources.files(__package__)"), encoding="utf-8")


# --- the table --------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="", help="only rows whose name contains this text")
    parser.add_argument("--base", help="a git revision (or folder, or 'worktree') of npattn to time beside")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of samples per row (default 2)")
    parser.add_argument("--min-samples", type=int, default=7)
    parser.add_argument("--max-load", type=float, default=0.2, help="other processes' cores before a rerun")
    parser.add_argument("--quick", action="store_true", help="small shapes, short rows")
    parser.add_argument("--no-torch", action="store_true", help="npattn only")
    parser.add_argument(
        "--auto-grid", action="store_true", help="instead: chunked ÷ dense time by B and T=S, for impl='auto''s rule"
    )
    parser.add_argument("--more", action="store_true", help="instead: other mixes of the same kinds of workload")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget, args.min_samples = min(args.budget, 0.05), 2
    if args.auto_grid:
        return print_auto_grid(args)
    torch = None
    if not args.no_torch:
        try:
            import torch

            torch.set_num_threads(os.cpu_count() or 1)
        except ImportError:
            print("torch is not installed: npattn only")
    libraries = {"npattn": npattn}
    if args.base:
        libraries["base"] = load_base(args.base)
    dtype = "float32 unless a row says" if args.more else "float32"
    print(f"{cpu_model()}, {os.cpu_count()} cores, {dtype}, torch {torch.__version__ if torch else '-'}")
    header = (
        f"{'workload':<20} {'mode':<8} {'path':<6} {'npattn ms':>10} {'torch ms':>9} {'ratio':>6} {'GFLOP/s':>8}"
        + (f" {'base ms':>9} {'÷ base':>6}" if args.base else "")
        + f" {'load':>5}"
    )
    print(header)
    print("-" * len(header))
    for workload in more_workloads(args.quick) if args.more else workloads(args.quick):
        if args.rows in workload.name:
            print_workload(workload, libraries, torch, args)
    return 0


def auto_grid_shapes(quick: bool) -> list[tuple[int, int]]:
    """``(B, T)`` of the auto-rule grid (N=8, H=64, T=S): every B of 1, 4, 8
    and 32 against every T of 128 to 512, then shapes of exactly 2**22
    scores."""
    if quick:
        return [(1, 32), (2, 32)]
    grid = [(B, T) for B in (1, 4, 8, 32) for T in (128, 256, 384, 512)]
    return grid + [(1, 724), (2, 512), (16, 181)]


#: The index rules of the auto grid's second table: causal/window, lengths
#: and segment ids, which the fast path's plans cut or skip, against the
#: same :data:`~npattn.options.AUTO_FAST_MIN_SCORES` as full attention.
CUT_RULES = ("causal", "window", "kv_lengths", "segments", "causal+kv_lengths")


def cut_grid_shapes(quick: bool) -> list[tuple[int, int]]:
    """``(B, T)`` of the second table: 2**21 scores (N=8) three ways, and
    2**20 once."""
    return [(1, 32)] if quick else [(16, 128), (4, 256), (1, 512), (2, 256)]


def _rule_options(rule: str, B: int, T: int, rng: np.random.Generator) -> dict:
    """The options of one index rule at ``(B, T)``: lengths drawn from
    ``[T/3, T]``, a causal window of ``T/4``, four documents."""
    lengths = rng.integers(T // 3, T + 1, size=B)
    ids = np.repeat(np.arange(4), -(-T // 4))[:T][None].repeat(B, axis=0)  # (B, T)
    return {
        "causal": dict(causal=True),
        "window": dict(window=(T // 4, 0)),
        "kv_lengths": dict(kv_lengths=lengths),
        "segments": dict(causal=True, q_segment_ids=ids, kv_segment_ids=ids),
        "causal+kv_lengths": dict(causal=True, kv_lengths=lengths),
    }[rule]


def _path_call(impl: str, q: Any, k: Any, v: Any, dout: Any, options: dict | None = None) -> Callable[[], Any]:
    """One call of ``impl``'s forward, and its backward when ``dout`` is given."""

    def call() -> Any:
        out, residuals = npattn.attention_forward(q, k, v, impl=impl, **(options or {}))
        return out if dout is None else npattn.attention_backward(dout, residuals)

    return call


def print_auto_grid(args) -> int:
    """The tables behind ``impl="auto"``'s NumPy rules: the chunked (fast)
    path's time over the dense path's, forward and forward+backward, each
    side settled in a loop of its own calls and the two interleaved; full
    attention, then each index rule."""
    N, H = 8, 64
    print(f"{cpu_model()}, {os.cpu_count()} cores, float32, N={N}, H={H}: chunked ÷ dense time")
    print(
        f"{'rule':<18} {'B':>3} {'T=S':>5} {'log2 scores':>11} {'forward':>8} {'fwd+bwd':>8}"
        f" {'dense ms':>17} {'chunked ms':>17}"
    )
    rows = [("full", B, T) for B, T in auto_grid_shapes(args.quick)]
    rows += [(rule, B, T) for rule in CUT_RULES for B, T in cut_grid_shapes(args.quick)]
    for rule, B, T in rows:
        rng = np.random.default_rng(0)
        q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))
        options = {} if rule == "full" else _rule_options(rule, B, T, rng)
        ratios, dense_ms, chunked_ms = [], [], []
        for backward in (False, True):
            calls = {
                impl: _path_call(impl, q, k, v, dout if backward else None, options) for impl in ("dense", "chunked")
            }
            medians = interleaved_medians(calls, args.budget, args.min_samples)
            ratios.append(medians["chunked"] / medians["dense"])
            dense_ms.append(f"{medians['dense'] * 1e3:.2f}")
            chunked_ms.append(f"{medians['chunked'] * 1e3:.2f}")
        log_scores = np.log2(B * N * T * T)
        print(
            f"{rule:<18} {B:>3} {T:>5} {log_scores:>11.2f} {ratios[0]:>8.2f} {ratios[1]:>8.2f}"
            f" {' | '.join(dense_ms):>17} {' | '.join(chunked_ms):>17}",
            flush=True,
        )
    return 0


def print_workload(workload: Workload, libraries: dict, torch: Any, args) -> None:
    rng = np.random.default_rng(0)
    by_library = {name: workload.make(lib, torch if name == "npattn" else None, rng) for name, lib in libraries.items()}
    print(f"# {workload.name}: {workload.shape}")
    for mode in ("forward", "fwd+bwd") if workload.backward else ("forward",):
        calls = dict(by_library["npattn"][mode])
        if "base" in by_library:
            calls["base"] = by_library["base"][mode]["npattn"]
        medians, other, disturbed = timed_row(calls, args)
        path = npattn_path(by_library["npattn"]["forward"]["npattn"]()[1])
        flops = workload.flops_forward * (3.5 if mode == "fwd+bwd" else 1.0)
        ms = medians["npattn"] * 1e3
        torch_ms = f"{medians['torch'] * 1e3:>9.3f}" if "torch" in medians else f"{'-':>9}"
        ratio = f"{medians['npattn'] / medians['torch']:>5.2f}x" if "torch" in medians else f"{'-':>6}"
        base = ""
        if "base" in medians:
            base = f" {medians['base'] * 1e3:>9.3f} {medians['npattn'] / medians['base']:>5.2f}x"
        load = f"{other:>5.2f}" if other is not None else f"{'-':>5}"
        print(
            f"{workload.name:<20} {mode:<8} {path:<6} {ms:>10.3f} {torch_ms} {ratio} "
            f"{flops / medians['npattn'] / 1e9:>8.1f}{base} {load}{'*' if disturbed else ''}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
