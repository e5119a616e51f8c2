"""The CPU benchmark scripts run end to end in their quick mode and print
their tables (no timing is asserted: speed lives in the benchmarks)."""

from __future__ import annotations

import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _run_script(name: str, argv: list[str]) -> int:
    """Run a benchmark script as ``__main__``; return its exit code."""
    old = sys.argv
    sys.argv = [name, *argv]
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(BENCHMARKS / name), run_name="__main__")
    finally:
        sys.argv = old
    return exit_info.value.code


def test_cpu_benchmark_quick_prints_its_table(capsys):
    assert _run_script("bench_cpu.py", ["--quick", "--no-torch"]) == 0
    out = capsys.readouterr().out
    assert "large SGEMM" in out and "% SGEMM" in out
    assert out.count("chunked") == 4  # forward and fwd+bwd, full and causal
    (floor,) = [line for line in out.splitlines() if line.startswith("full fwd+bwd floor on ")]
    parts = re.search(
        r" (\d+\.\d) ms \+ 4 passes over the scores (\d+\.\d) ms = (\d+\.\d) ms, \d+\.\d\dx npattn's$", floor
    )
    assert parts, floor  # no torch: no ratio to it
    products, passes, total = (float(x) for x in parts.groups())
    assert products > 0 and passes > 0 and abs(products + passes - total) <= 0.11, floor
    for variant in ("softcap", "sinks", "ALiBi", "packed docs", "docs apart", "T5 rel. bias"):  # issue 14, 15 rows
        rows = [line for line in out.splitlines() if line.startswith(variant + " ")]
        # pass, ms, torch, ratio, ÷ plain, torch ÷ plain ("-" without torch)
        assert [row.split()[-6] for row in rows] == ["forward", "fwd+bwd"], rows
        assert all(row.split()[-2].endswith("x") and row.endswith(" -") for row in rows), rows
    assert "T=S=256, full" in out  # --quick shortens the score-modification table too


def test_cpu_benchmark_score_mod_table_names_torch_side_and_agrees(capsys):
    """Issue 15's row with torch: the torch implementation is named, the two
    sides compute the same out and d table, and both columns are timed."""
    pytest.importorskip("torch")
    argv = ["--quick", "--score-mod-only", "--heads", "2", "--head-dim", "8", "--score-mod-length", "4096"]
    assert _run_script("bench_cpu.py", argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "large SGEMM" not in "\n".join(lines)  # only the score-modification table
    assert any(line.startswith("torch side: ") and ("FlexAttention" in line or "SDPA" in line) for line in lines)
    (agreement,) = [line for line in lines if line.startswith("max |npattn - torch|")]
    differences = re.fullmatch(r"max \|npattn - torch\|: out (\S+), d table (\S+) \(.*\)", agreement)
    assert differences and all(float(x) < 1e-4 for x in differences.groups()), agreement  # float32 sums
    rows = [line.split() for line in lines if line.startswith("T5 rel. bias ")]
    assert [row[3] for row in rows] == ["forward", "fwd+bwd"]
    assert all(float(row[5]) > 0 and float(row[6]) > 0 for row in rows), rows  # torch ms and ratio
    assert all(float(row[8].rstrip("x")) > 0 for row in rows), rows  # torch ÷ its plain attention


def test_lever_benchmark_quick_prints_every_lever(capsys):
    assert _run_script("bench_cpu_levers.py", ["--quick"]) == 0
    out = capsys.readouterr().out
    for label in (
        "generic Array API path",
        "1 pool thread",
        "not limited",
        "128x128",
        "causal",
        "not split",
        "as shipped",
    ):
        assert label in out


def _in_git_checkout() -> bool:
    try:
        done = subprocess.run(["git", "-C", str(BENCHMARKS), "rev-parse", "HEAD"], capture_output=True)
    except OSError:
        return False
    return done.returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git and a checkout")
def test_revision_benchmark_quick_times_each_revision(capsys):
    assert _run_script("bench_cpu_ab.py", ["HEAD", "worktree", "--quick"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith(("full", "causal"))]
    assert [(row[0], row[1]) for row in rows] == [
        ("full", "HEAD"),
        ("full", "worktree"),
        ("causal", "HEAD"),
        ("causal", "worktree"),
    ]
    assert all(float(row[3]) == 1.0 for row in rows if row[1] == "HEAD")  # ratios are to the first revision


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git and a checkout")
def test_revision_benchmark_names_a_revision_it_cannot_read():
    message = _run_script("bench_cpu_ab.py", ["no-such-revision", "--quick"])  # SystemExit(str): exit status 1
    assert "cannot read npattn/fast_numpy.py at 'no-such-revision'" in message


def test_modes_benchmark_quick_prints_every_mode(capsys):
    assert _run_script("bench_modes.py", ["--quick", "--double"]) == 0
    out = capsys.readouterr().out
    for mode in ("fwd+bwd", "jvp", "fwd-over-rev", "double bwd"):
        assert len(re.findall(rf"^(full|causal)\s+{re.escape(mode)}\s+[\d.]+\s+[\d.]+x$", out, re.MULTILINE)) == 2, mode
    assert "peak traced memory" in out and "threads; " in out.splitlines()[0]  # the CPU model follows


@pytest.mark.parametrize(
    "script, argv",
    [
        ("bench_cpu.py", ["--length", "0"]),
        ("bench_cpu.py", ["--score-mod-length", "0"]),
        ("bench_cpu_levers.py", ["--repeats", "0"]),
        ("bench_cpu_ab.py", ["HEAD", "--rounds", "0"]),
        ("bench_modes.py", ["--length", "0"]),
    ],
)
def test_benchmarks_reject_bad_arguments(script, argv, capsys):
    assert _run_script(script, argv) == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_workloads_benchmark_quick_prints_every_row_with_its_path(capsys):
    assert _run_script("bench_workloads.py", ["--quick", "--no-torch"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line and line[0].isalpha()][2:]
    names = {" ".join(row[:-7]) for row in rows}  # then mode, path, ms, torch ms, ratio, GFLOP/s, load
    assert names == {"decode S=512", "B2 N4 T64 causal", "tiny", "MHA E64"}
    assert all(row[-6] in ("dense", "fast", "generic") and float(row[-5]) > 0 for row in rows)
    assert sum(row[-7] == "fwd+bwd" for row in rows) == 3  # decoding runs forward only


def test_workloads_benchmark_more_prints_the_other_mixes_with_options_and_dtypes(capsys):
    assert _run_script("bench_workloads.py", ["--quick", "--no-torch", "--more"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line and line[0].isalpha()][2:]
    names = {" ".join(row[:-7]) for row in rows}
    assert names == {"f64 B2 N2 T32", "pad B2 N2 T32", "decode pad B2 S64", "window 8 B2 T64", "decode growing S64+"}
    assert "float64" in out and "kv_lengths" in out and "window=8" in out
    assert all(float(row[-5]) > 0 for row in rows)


def test_workloads_benchmark_times_a_base_revision_beside(capsys):
    assert _run_script("bench_workloads.py", ["--quick", "--no-torch", "--rows", "tiny", "--base", "worktree"]) == 0
    out = capsys.readouterr().out
    assert "base ms" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny")]
    assert len(rows) == 2 and all(row[-2].endswith("x") for row in rows)


def test_a_base_copy_compiles_its_own_kernel_sources(tmp_path, monkeypatch):
    """A base revision's package, copied under another name, reads the CUDA
    sources of its own ``cuda/`` folder, not this checkout's: as
    ``fast_cupy`` now asks for them, and as older revisions ask (for
    ``"npattn"`` by name), which ``load_base`` rewrites in the copy."""
    import importlib

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_workloads
    finally:
        sys.path.remove(str(BENCHMARKS))
    source = Path(__file__).resolve().parents[1] / "npattn"
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, old_style in (("npattn_copy_now", False), ("npattn_copy_old", True)):
        copy = tmp_path / name
        shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
        with (copy / "cuda" / "merge.cu").open("a") as cu:
            cu.write(f"// {name}'s own\n")
        if old_style:
            module = copy / "fast_cupy.py"
            text = module.read_text()
            assert "resources.files(__package__)" in text
            module.write_text(text.replace("resources.files(__package__)", 'resources.files("npattn")'))
        bench_workloads._own_kernel_sources(copy)
        try:
            fast_cupy = importlib.import_module(f"{name}.fast_cupy")
            assert f"// {name}'s own" in fast_cupy.kernel_source("tensor_forward")
        finally:
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]


def test_workloads_benchmark_prints_the_auto_rule_grid(capsys):
    assert _run_script("bench_workloads.py", ["--quick", "--auto-grid"]) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    rows = [line.split() for line in lines]
    rules = ["causal", "window", "kv_lengths", "segments", "causal+kv_lengths"]
    assert [(row[0], int(row[1]), int(row[2])) for row in rows] == [("full", 1, 32), ("full", 2, 32)] + [
        (rule, 1, 32) for rule in rules
    ]
    assert all(float(row[4]) > 0 and float(row[5]) > 0 for row in rows)


def test_sass_counts_run_or_say_why_not(capsys):
    """``count_sass.py`` prints its table where NVIDIA's compiler wheels are
    installed, else says what is missing; a bad head size exits with 2."""
    assert _run_script("count_sass.py", []) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("f16 ", "tf32x3 ", "f64 "))]
    kernels = ["npattn_forward_tc", "npattn_backward_dq_tc", "npattn_backward_dkdv_tc", "npattn_forward_tc"] * 3
    kernels += ["npattn_backward_dkdv_tc", "npattn_forward_tc"]  # float64's summing dQ too, keeping Q in shared
    assert out.startswith("skipped: no ") or [row[1] for row in rows] == kernels
    assert _run_script("count_sass.py", ["--head-dim", "20"]) == 2
    assert "--head-dim must be a multiple of 16" in capsys.readouterr().err


def test_sass_bounds_count_what_a_warps_tile_takes_of_each_resource():
    """``count_sass.py``'s static bounds of a loop: shared memory's passes by
    each instruction's width (128 bytes a pass, no bank taken twice), its
    instructions over the 4 schedulers, and DMMA_CYCLES a DMMA (none
    without DMMA), read off a listing's longest backward branch; a HGMMA
    (wgmma) HGMMA_CYCLES of the tensor cores and HGMMA_WAVEFRONTS passes."""
    sass = runpy.run_path(str(BENCHMARKS / "count_sass.py"))
    ops = ["LDS", "LDS.64", "LDS.U.128", "STS.128", "LDSM.16.M88.4", "LDSM.16.MT88.2", "LDSM.16.M88"]
    ops += ["LDGSTS.E.BYPASS.LTC128B.128", "LDGSTS.E.64", "DMMA.16", "LDG.E.128"]
    assert [sass["shared_wavefronts"](op) for op in ops] == [1, 2, 4, 4, 4, 2, 1, 4, 2, 0, 0]
    listing = """
        Function : kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDS.128 R4, [R2] ;
        /*0020*/                   DMMA.16x8x8 R8, R4, R12, R8 ;
        /*0030*/                   @!UPT UIADD3 URZ, URZ, URZ, URZ ;
        /*0040*/                   STL.64 [R1], R6 ;
        /*0050*/                   LDS.64 R6, [R2+0x8] ;
        /*0060*/               @P0 BRA 0x10 ;
        /*0070*/                   EXIT ;
    """
    loop = sass["tile_loops"](listing)["kernel"]
    assert loop == (6, 1, 1, 6, 1, 0)  # instructions, MMA, spills, wavefronts, DMMA, HGMMA
    assert loop.bounds() == (1.5, 6, sass["DMMA_CYCLES"])
    assert loop._replace(mma=0, dmma=0).bounds()[2] is None
    on_wgmma = listing.replace("DMMA.16x8x8 R8, R4, R12, R8", "HGMMA.64x64x16.F32 R24, R100, gdesc[UR20], R24")
    loop = sass["tile_loops"](on_wgmma)["kernel"]
    assert loop == (6, 1, 1, 6 + sass["HGMMA_WAVEFRONTS"], 0, 1)
    assert loop.bounds() == (1.5, 6 + sass["HGMMA_WAVEFRONTS"], sass["HGMMA_CYCLES"])


def test_gpu_benchmark_counts_the_fused_paths_memory_without_a_gpu(capsys):
    """``bench_gpu.py --count-memory`` runs the fused path's Python side on
    the CPU (kernels not run) and prints a row per dtype."""
    assert _run_script("bench_gpu.py", ["--count-memory", "--lengths", "128"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float")]
    expected = [("float16", "T=S=128", "f16)"), ("float32", "T=S=128", "tf32x3)")]
    assert [(row[0], row[1], row[-1]) for row in rows] == expected
    assert all(float(row[2]) > 0 for row in rows), rows


def test_gpu_benchmark_times_the_decode_steps_python_without_a_gpu(capsys, monkeypatch):
    """``bench_gpu.py --host-time --base worktree`` times each decode row's
    call on the fused path's Python side (a fixed ``S``, twice, and ``S``
    growing a key a call) and a training call's forward and backward, this
    checkout's and the base's, on the CPU; ``--base`` alone is an error."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the base package's folder goes onto it
    assert _run_script("bench_gpu.py", ["--host-time", "--base", "worktree", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("decode", "  ", "train"))]
    assert len(rows) == 4 and "growing" in rows[2] and "fwd+bwd" in rows[3]
    for row in rows:
        now, now_launch, base, base_launch, ratio, launch_ratio = (float(x) for x in row.split()[-6:])
        assert 0 < now_launch < now and 0 < base_launch < base
        assert ratio == pytest.approx(now / base, abs=1e-3) and launch_ratio == pytest.approx(
            now_launch / base_launch, abs=1e-3
        )
    assert _run_script("bench_gpu.py", ["--base", "HEAD"]) == 2
    assert "--base goes with --host-time or --kernels" in capsys.readouterr().err


class _FakeEvent:
    """A CUDA event whose elapsed time counts the events recorded in between."""

    recorded = 0

    def record(self):
        _FakeEvent.recorded += 1
        self.at = _FakeEvent.recorded


def _fake_gpu_bench(monkeypatch, runtime=None):
    """``bench_gpu`` with NumPy in CuPy's place: the fused path taken on
    NumPy arrays, its kernels run by ``runtime`` (which runs none; by
    default ``bench_gpu._NoKernels``), CUDA events that count the events
    recorded in between."""
    import types

    import numpy as np

    import npattn.fast_numpy
    from npattn import fast_cupy

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCHMARKS))
    device = types.SimpleNamespace(deviceSynchronize=lambda: None, getDeviceProperties=lambda i: {"name": "fake"})
    cuda = types.SimpleNamespace(
        Event=_FakeEvent,
        get_elapsed_time=lambda a, b: b.at - a.at,
        runtime=device,
        Device=lambda: types.SimpleNamespace(id=0),
    )
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    cp = types.SimpleNamespace(
        asarray=np.asarray,
        float16=np.float16,
        float32=np.float32,
        float64=np.float64,
        cuda=cuda,
        get_default_memory_pool=lambda: pool,
    )
    monkeypatch.setattr(npattn.fast_numpy, "supports", lambda spec: False)
    monkeypatch.setattr(fast_cupy, "supports", fast_cupy._kernels_take)
    monkeypatch.setattr(fast_cupy, "_CUPY_RUNTIME", runtime or bench_gpu._NoKernels())
    return bench_gpu, cp


def test_gpu_benchmark_kernel_breakdown_runs_its_python_side(capsys, monkeypatch):
    """``bench_gpu.py --kernels``'s own code (events around each launch, the
    rates, the back-to-back calls, a call's timeline) on NumPy in CuPy's
    place, kernels not run, so that a GPU session's short device time is
    not lost to it."""
    import numpy as np

    bench_gpu, cp = _fake_gpu_bench(monkeypatch)
    rows = [
        ("float16 causal", ("float16", 1, 8, 8, 4096, 4096, 16, True), True),
        ("decode", ("float16", 1, 8, 2, 1, 600, 16, False), False),
    ]
    monkeypatch.setattr(bench_gpu, "_kernel_rows", lambda: rows)
    with np.errstate(all="ignore"):  # the arrays the kernels would fill hold whatever was in memory
        assert bench_gpu.kernels(cp, repeats=2) == 0
    out = capsys.readouterr().out
    kernels = [line.split()[0] for line in out.splitlines() if line.startswith("  npattn_")]
    training = ["npattn_forward_tc", "npattn_backward_dq_tc", "npattn_backward_dkdv_tc"]
    decode = ["npattn_forward_tc", "npattn_merge_splits"]
    assert kernels == training + decode
    timelines = [line.split() for line in out.splitlines() if line.startswith("    npattn_")]
    assert [row[0] for row in timelines] == training + decode
    for row in timelines:  # issued, started, ended: each fake event a "ms" after the one before
        issued, started, ended = (float(x) for x in row[1:4])
        assert issued >= 0 and ended == started + 1
        assert (row[4:] == ["(idle", "1.000)"]) == (started > 1)  # a "ms" between one's end and the next's start
    assert "device idle: 1.000 ms before the first kernel, 2.000 between kernels" in out
    assert "device idle: 1.000 ms before the first kernel, 1.000 between kernels" in out
    assert out.count("TFLOP/s") == 3 and out.count("GB/s of k and v") == 1 and out.count("back to back") == 2
    # each launch spans one fake "ms"; 2 flops a multiply-add, B N T S H of them a product, halved by causal
    rates = [float(line.split()[3]) for line in out.splitlines() if line.endswith("TFLOP/s")]
    assert rates == pytest.approx([2 * products * 8 * 4096**2 * 16 / 2 / 1e9 for products in (2, 3, 4)], abs=0.06)


def test_gpu_benchmark_kernels_against_a_base_time_both_in_turn(capsys, monkeypatch):
    """``bench_gpu.py --kernels --base worktree``'s own code on NumPy in
    CuPy's place, kernels not run: each kernel of each package timed by its
    own events, both packages' rows printed with their ratio, their sums,
    and a call's timeline for each."""
    import numpy as np

    bench_gpu, cp = _fake_gpu_bench(monkeypatch)
    base = bench_gpu._workload_helpers()["load_base"]("worktree")
    monkeypatch.setattr(base.fast_numpy, "supports", lambda spec: False)
    monkeypatch.setattr(base.fast_cupy, "supports", base.fast_cupy._kernels_take)
    monkeypatch.setattr(base.fast_cupy, "_CUPY_RUNTIME", bench_gpu._NoKernels())
    rows = [("float32 full", ("float32", 1, 2, 2, 256, 256, 16, False), True)]
    monkeypatch.setattr(bench_gpu, "_kernel_rows", lambda: rows)
    with np.errstate(all="ignore"):
        assert bench_gpu.kernels_against(cp, base, "worktree", repeats=2) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [line.split() for line in out if line.startswith("  npattn_")]
    assert [line[0] for line in lines] == ["npattn_forward_tc", "npattn_backward_dq_tc", "npattn_backward_dkdv_tc"]
    for _, now, then, ratio in lines:  # each launch spans one fake "ms": its own two events
        assert float(now) == float(then) == 1.0 and float(ratio) == 1.0
    (every,) = [line.split()[2:] for line in out if line.startswith("  every kernel")]
    assert [float(x) for x in every] == [3.0, 3.0, 1.0]  # the three kernels' ms summed
    timelines = [line.split()[0] for line in out if line.startswith("    npattn_")]  # now's call, then base's
    assert timelines == [line[0] for line in lines] * 2
    assert [line for line in out if line.startswith("  ") and line.endswith("on the device")] == [
        f"  {side}'s timeline, ms from the call's start: kernel, issued by the host, started and ended on the device"
        for side in ("now", "base")
    ]


def test_gpu_benchmark_auto_rows_time_both_paths_and_say_which_auto_takes(capsys, monkeypatch):
    """``bench_gpu.py --auto``'s own code on NumPy in CuPy's place: each row
    times the dense path (for real, on NumPy) and the fused one (kernels
    not run), and reads the path ``impl="auto"`` takes from ``choose_impl``."""
    import numpy as np

    bench_gpu, cp = _fake_gpu_bench(monkeypatch)
    rows = [
        ("float32 T=S=16 causal fwd+bwd", ("float32", 1, 2, 2, 16, 16, 8, True), True),
        ("float16 decode T=1 S=300 fwd", ("float16", 1, 4, 2, 1, 300, 16, True), False),
    ]
    monkeypatch.setattr(bench_gpu, "_auto_rows", lambda: rows)
    monkeypatch.setattr(bench_gpu, "AUTO_REPEATS", 2)
    with np.errstate(all="ignore"):  # the arrays the kernels would fill hold whatever was in memory
        assert bench_gpu.auto(cp) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("float32", "float16"))]
    assert [line.rsplit(maxsplit=4)[0] for line in lines] == [label for label, *_ in rows]
    assert all(line.split()[-1] == "chunked" and float(line.split()[-2]) > 0 for line in lines)


def test_gpu_benchmark_scores_rows_give_npattn_each_kind_of_scores(monkeypatch):
    """``bench_gpu.py --scores``' problems on NumPy in CuPy's place (no
    torch): each kind reaches npattn's call as its option (a padding mask,
    a mask hiding no row whole, a bias in the inputs' dtype), which the
    fused path takes, forward and backward (kernels not run)."""
    import numpy as np

    bench_gpu, cp = _fake_gpu_bench(monkeypatch)
    expected = {"padding mask": ("mask", (1, 1, 1, 64)), "mask": ("mask", (64, 64)), "bias": ("bias", (2, 64, 64))}
    assert list(bench_gpu.SCORES) == list(expected)
    for kind, (name, shape) in expected.items():
        problem = bench_gpu._Problem(cp, None, "float16", 1, 2, 2, 64, 64, 16, False, scores=kind)
        (option,) = problem.scores.items()
        assert option[0] == name and option[1].shape == shape
        assert option[1].dtype == (np.float16 if name == "bias" else np.bool_)
        if name == "mask":
            assert option[1].any(axis=-1).all() and not option[1].all()  # some keys hidden, no row whole
        q, k, v, _ = problem.arrays
        with np.errstate(all="ignore"):  # the arrays the kernels would fill hold whatever was in memory
            _, res = bench_gpu.attention_forward(q, k, v, impl="chunked", **problem.options, **problem.scores)
            assert res.kernel == "cupy"
            problem.npattn(True)


def test_gpu_benchmark_cache_rows_time_views_copies_and_c_order_keys(capsys, monkeypatch):
    """``bench_gpu.py --cache``'s own code on NumPy in CuPy's place, kernels
    not run: a row per cache size, with the three steps' times and ratios."""
    import numpy as np

    bench_gpu, cp = _fake_gpu_bench(monkeypatch)
    monkeypatch.setattr(cp, "max", np.max, raising=False)
    monkeypatch.setattr(cp, "abs", np.abs, raising=False)
    monkeypatch.setattr(bench_gpu, "CACHE_ROWS", ((300, 20), (64, 1)))
    monkeypatch.setattr(bench_gpu, "DECODE_REPEATS", 2)
    with np.errstate(all="ignore"):  # the arrays the kernels would fill hold whatever was in memory
        assert bench_gpu.cache(cp) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert [row[:2] for row in rows] == [["300", "(20)"], ["64", "(1)"]]
    half = 0.0005  # ms are printed to 3 decimals, ratios to 2: a ratio lies within what the rounding allows
    for row in rows:
        ms, ratios = [float(x) for x in row[2:5]], [float(x) for x in row[5:7]]
        assert min(ms) > half
        for ratio, step in zip(ratios, ms[1:]):
            assert (step - half) / (ms[0] + half) - 0.005 <= ratio <= (step + half) / (ms[0] - half) + 0.005


def test_gpu_benchmark_kept_sweep_compiles_each_count_of_kept_operands(capsys, monkeypatch):
    """``bench_gpu.py --kept``' own code on NumPy in CuPy's place, kernels
    not run: a row per problem, dQ's and dK/dV's cells for 0, 1 and 2 kept
    operands, each count's backward compiled with it (``TC_KEPT_DQ``,
    ``TC_KEPT_DKDV``), ``*`` on ``tensor_kept_operands``' choice, and the
    count that fits in brackets where the device's shared memory takes
    fewer."""
    import numpy as np

    from npattn import fast_cupy
    from npattn.options import make_spec

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCHMARKS))

    class Compiled(bench_gpu._NoKernels):
        def __init__(self, shared_memory):
            self.kept, self.bytes = set(), shared_memory

        def module(self, source, defines):
            values = dict(defines)
            if "TC_KEPT_DQ" in values:
                self.kept.add((values["PRECISION"], int(values["TC_KEPT_DQ"]), int(values["TC_KEPT_DKDV"])))
            return super().module(source, defines)

        def shared_memory(self, like):
            return self.bytes

    rows = [(f"{dtype} full", (dtype, 1, 2, 2, 64, 64, 64, False)) for dtype in ("float16", "float64")]
    for kib in (227, 99):  # an H100's blocks keep what the table says; at 99 KiB float64 keeps one, float16 none
        runtime = Compiled(kib * 1024)
        bench_gpu, cp = _fake_gpu_bench(monkeypatch, runtime)
        monkeypatch.setattr(bench_gpu, "_kept_rows", lambda: rows)
        with np.errstate(all="ignore"):
            assert bench_gpu.kept(cp, repeats=2) == 0
        table = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
        assert [row[:2] for row in table] == [["float16", "full"], ["float64", "full"]]
        for (_, arguments), row in zip(rows, table):
            x = np.zeros(arguments[1:3] + arguments[4:5] + arguments[6:7], arguments[0])
            precision = "f16" if arguments[0] == "float16" else "f64"
            chosen = fast_cupy.tensor_kept_operands(make_spec(x, x, x), precision, kib * 1024)
            cells = row[2:]
            assert len(cells) == 6 and all(float(cell.split("(")[0].rstrip("*")) == 1.0 for cell in cells)
            stars = [index for index, cell in enumerate(cells) if cell.endswith("*")]
            assert stars == [chosen[0], 3 + chosen[1]]
        fits = {("PRECISION_F16", 227): 2, ("PRECISION_F64", 227): 2}
        fits |= {("PRECISION_F16", 99): 0, ("PRECISION_F64", 99): 1}
        expected = {
            (precision, min(n, fits[precision, kib]), min(n, fits[precision, kib]))
            for precision in ("PRECISION_F16", "PRECISION_F64")
            for n in (0, 1, 2)
        }
        assert runtime.kept == expected
        assert ("(1)" in " ".join(table[1])) == (kib == 99)  # float64's 2 fit as 1 at 99 KiB


def test_gpu_benchmark_tile_sweep_compiles_each_size_that_fits(capsys, monkeypatch):
    """``bench_gpu.py --tiles``' own code on NumPy in CuPy's place, kernels
    not run: a row per tile size whose two tiles fit, each kernel compiled
    with that size (``TC_KEYS``), ``*`` on fast_cupy's choice; then the
    decode step's key ranges at each blocks-per-multiprocessor rule."""
    import numpy as np

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCHMARKS))

    class Compiled(bench_gpu._NoKernels):
        def __init__(self):
            self.tiles, self.caps, self.split = set(), set(), set()

        def module(self, source, defines):
            values = dict(defines)
            self.tiles.add((values["PRECISION"], "npattn_backward_dq_tc(" in source, int(values["TC_KEYS"])))
            if "TC_MIN_BLOCKS" in values:  # the forward's
                self.caps.add((values["PRECISION"], int(values["TC_KEYS"]), int(values["TC_MIN_BLOCKS"])))
                self.split.add((values["PRECISION"], int(values["TC_KEYS"]), values["TC_SPLIT_STAGES"]))
            return super().module(source, defines)  # a module, kept by fast_cupy's caches as CuPy's is

    runtime = Compiled()
    bench_gpu, cp = _fake_gpu_bench(monkeypatch, runtime)
    rows = [(f"{dtype} full", (dtype, 1, 2, 2, 64, 64, 64, False)) for dtype in ("float16", "float64")]
    monkeypatch.setattr(bench_gpu, "_tile_rows", lambda: rows)
    with np.errstate(all="ignore"):
        assert bench_gpu.tiles(cp, repeats=1) == 0
    lines = capsys.readouterr().out.splitlines()
    decode = lines.index(next(line for line in lines if line.startswith("decode")))
    table = [line.split() for line in lines[2:decode]]
    # float64 at H=64: tiles of 16 fit twice; the forward takes 32 keys in one key and one value tile
    assert [(row[0], row[2]) for row in table] == [
        ("float16", "16"),
        ("float16", "32"),
        ("float16", "64"),
        ("float64", "16"),
        ("float64", "32"),
    ]
    assert [sum(cell.endswith("*") for cell in row[3:]) for row in table] == [0, 0, 3, 2, 1]
    assert table[-1][4:6] == ["-", "-"]  # dQ and dK/dV: no two tiles of 32 rows
    # the forward again with its registers uncapped where they are capped (float16: 3 blocks an SM)
    assert [row[-1] for row in table][-2:] == ["-", "-"] and all(row[-1] != "-" for row in table[:3])
    f16_caps = {("PRECISION_F16", t, c) for t in (16, 32, 64) for c in (3, 0)}
    assert runtime.caps == f16_caps | {("PRECISION_F64", 16, 0), ("PRECISION_F64", 32, 0)}
    assert runtime.split == {("PRECISION_F64", 16, "0"), ("PRECISION_F64", 32, "1")} | {
        ("PRECISION_F16", t, "0") for t in (16, 32, 64)
    }
    f16 = {(backward, tile) for precision, backward, tile in runtime.tiles if precision == "PRECISION_F16"}
    assert f16 == {(backward, tile) for backward in (False, True) for tile in (16, 32, 64)}
    # the decode step's keys split for 2, 4, 8, 16 blocks per SM of 132 (8 one-warp blocks a range),
    # at most S / MIN_SPLIT_KEYS = 128 ranges
    assert [int(line.split()[1]) for line in lines[decode + 1 :]] == [33, 66, 128, 128]


def _gpu_session():
    return runpy.run_path(str(BENCHMARKS / "gpu_session.py"))


def test_gpu_session_runs_its_steps_within_the_budget(tmp_path, capsys):
    """``gpu_session.py``'s runner: each step's output in its own log, a
    summary line with its exit status (124 where its limit ran out), and a
    step that would start with too little of the budget left skipped; the
    exit status says whether every step ran and passed."""
    session = _gpu_session()
    python = sys.executable
    plan = [
        ("passes", [python, "-c", "print('ran')"], 30),
        ("fails", [python, "-c", "raise SystemExit(3)"], 30),
        ("too-long", [python, "-c", "import time; time.sleep(30)"], 1),
        ("passes-too", [python, "-c", "print('ran too')"], 30),
    ]
    assert session["run_steps"](plan, tmp_path, 60.0) == 1
    summary = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in summary] == [
        ["passes", "exit", "0"],
        ["fails", "exit", "3"],
        ["too-long", "exit", "124"],
        ["passes-too", "exit", "0"],
    ]
    assert (tmp_path / "01-passes.log").read_text() == "ran\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "01-passes.log",
        "02-fails.log",
        "03-too-long.log",
        "04-passes-too.log",
    ]
    assert session["run_steps"](plan[:1], tmp_path / "late", session["MIN_STEP_SECONDS"] - 1) == 1
    assert "passes                   skipped: " in capsys.readouterr().out


@pytest.mark.skipif(not _in_git_checkout(), reason="needs git and a checkout")
def test_gpu_session_prepares_bases_and_plans_a_kernels_step_each(tmp_path, capsys):
    """``--prepare``'s copy of a revision's package is a folder ``--base``
    takes, and the plan (``--dry-run``) has the env and tests steps, the
    first base folder's kernels step, the targets, then a kernels step for
    each further base; with ``--fused-dq`` and ``--kept-q``, the timing
    steps run ``bench_gpu.py`` with them (and with ``--wgmma``)."""
    session = _gpu_session()
    assert session["prepare"](["HEAD"], tmp_path) == 0
    assert (tmp_path / "HEAD" / "npattn" / "fast_cupy.py").is_file()
    shutil.copytree(tmp_path / "HEAD", tmp_path / "older")  # a second base (a shallow clone has one revision)
    bases = [str(tmp_path / "HEAD"), str(tmp_path / "older")]
    assert _run_script("gpu_session.py", ["--dry-run", *bases]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["env", "tests", "kernels-HEAD", "targets", "kernels-older"]
    assert lines[-1].endswith(f"--kernels --base {bases[1]}")
    assert _run_script("gpu_session.py", ["--dry-run", "--fused-dq", bases[0]]) == 0
    fused = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in fused] == ["env", "tests", "kernels-HEAD", "targets"]
    assert all("bench_gpu.py --fused-dq --" in line for line in fused[2:])
    assert _run_script("gpu_session.py", ["--dry-run", "--kept-q", "--fused-dq", "--wgmma", bases[0]]) == 0
    every = capsys.readouterr().out.splitlines()
    assert all("bench_gpu.py --fused-dq --kept-q --wgmma --" in line for line in every[2:])
    assert _run_script("gpu_session.py", [str(tmp_path)]) == 2  # no npattn/ there
    assert "no npattn/ package in" in capsys.readouterr().err


def test_gpu_session_profile_steps_follow_the_kernels_and_read_the_report(tmp_path, capsys):
    """``--profile`` puts ``profile_gpu.py`` under Nsight Compute (from its
    own start, clocks left alone, the npattn kernels) after the first
    kernels step, then reads the report back as CSV and as text; a step
    whose program is missing (no ``ncu``) fails with 127, saying so in
    its log, and the steps after it still run."""
    session = _gpu_session()
    plan = session["steps"]([str(tmp_path / "base")], profile=True)
    names = [name for name, _, _ in plan]
    assert names == ["env", "tests", "kernels-base", "profile", "profile-metrics", "profile-details", "targets"]
    collect, metrics, details = (command for name, command, _ in plan if name.startswith("profile"))
    report = f"{session['PROFILE_REPORT']}.ncu-rep"
    assert collect[-1].endswith("profile_gpu.py") and collect[collect.index("-o") + 1] == str(session["PROFILE_REPORT"])
    assert {"--profile-from-start", "off", "--clock-control", "none", "regex:npattn_"} <= set(collect)
    assert metrics[1:] == ["--import", report, "--page", "raw", "--csv"]
    assert details[1:] == ["--import", report, "--page", "details"]
    python = sys.executable
    missing = [("no-ncu", [str(tmp_path / "ncu")], 30), ("after", [python, "-c", "print('ran')"], 30)]
    assert session["run_steps"](missing, tmp_path, 60.0) == 1
    assert [line.split()[:3] for line in capsys.readouterr().out.splitlines()] == [
        ["no-ncu", "exit", "127"],
        ["after", "exit", "0"],
    ]
    assert str(tmp_path / "ncu") in (tmp_path / "01-no-ncu.log").read_text()


def test_profiled_calls_run_once_each_between_start_and_stop(capsys, monkeypatch):
    """``profile_gpu.py``'s own code on NumPy in CuPy's place, kernels not
    run: each workload's call is made once to warm up, then once between
    the profiler's start and stop (float64 with the dQ kernel, then with dQ
    summed by dK/dV and the forward keeping Q in shared memory, then
    float16, then float16 on wgmma, its kernels built with ``TC_WGMMA``,
    then a float16 decode step's forward over key ranges and their merge),
    and ``TENSOR_FUSED_DQ``, ``TENSOR_KEPT_Q`` and ``TENSOR_WGMMA`` are as
    they were after."""
    import numpy as np

    from npattn import fast_cupy

    launched: list[str] = []
    forward_shared: list[int] = []  # the forward's dynamic shared memory, each call
    on_wgmma: list[bool] = []  # each tensor-core kernel's, launch by launch
    bench_gpu, _ = _fake_gpu_bench(monkeypatch)

    class Recorded(bench_gpu._NoKernels):
        def launch(self, module, name, grid, threads, args, shared_bytes=0):
            launched.append(name)  # module: its -D definitions (_NoKernels.module's stand-in)
            on_wgmma.extend([("TC_WGMMA", "1") in module] if name.endswith("_tc") else [])
            if name == "npattn_forward_tc":
                forward_shared.append(shared_bytes)

    bench_gpu, cp = _fake_gpu_bench(monkeypatch, Recorded())
    profile_gpu = runpy.run_path(str(BENCHMARKS / "profile_gpu.py"))
    before = fast_cupy.TENSOR_FUSED_DQ, fast_cupy.TENSOR_KEPT_Q, fast_cupy.TENSOR_WGMMA
    with np.errstate(all="ignore"):  # the arrays the kernels would fill hold whatever was in memory
        status = profile_gpu["profile"](
            cp, lambda: launched.append("start"), lambda: launched.append("stop"), (1, 2, 64, 64), (4, 2, 700, 64)
        )
    assert status == 0 and before == (fast_cupy.TENSOR_FUSED_DQ, fast_cupy.TENSOR_KEPT_Q, fast_cupy.TENSOR_WGMMA)
    profiled = " ".join(launched).split("start ")[1:]
    every = ["npattn_forward_tc", "npattn_backward_dq_tc", "npattn_backward_dkdv_tc"]
    assert [call.split(" stop")[0].split() for call in profiled] == [
        every,
        ["npattn_forward_tc", "npattn_backward_d", "npattn_backward_dkdv_tc"],
        every,
        every,
        ["npattn_forward_tc", "npattn_merge_splits"],
    ]
    assert launched.count("npattn_forward_tc") == 10  # a warm-up call before each profiled one
    q_bytes = 4 * 16 * 64 * 8  # Q kept: 4 warps' 16 rows of H=64 in float64
    assert forward_shared == [0, 0, q_bytes, q_bytes, 0, 0, 0, 0, 0, 0]
    assert on_wgmma == [False] * 16 + [True] * 6 + [False] * 2  # float16 on wgmma: its warm-up and profiled calls
    labels = [line.removeprefix("profiled: ") for line in capsys.readouterr().out.splitlines()]
    assert labels == [label for label, _, _ in profile_gpu["WORKLOADS"]] + [profile_gpu["DECODE_LABEL"]]
