"""The fused kernels' CUDA source through NVIDIA's own compiler, without a GPU.

The emulated tests (``test_fast_cupy.py``) compile the kernels with g++; on
a GPU, CuPy compiles them with NVRTC, which may refuse what g++ takes, and
``ptxas`` a block's static shared memory past CUDA's 48 KiB. A GPU is lent
to a session for minutes, so what its first compile would tell is asked
here: every module the emulated tests build, and those of issue 18's
shapes (``bench_gpu.py --targets``, both builds: for plain scores and for
every option), compiled to PTX by NVRTC and assembled by ``ptxas`` for
sm_80 and sm_90 (the A100 and the H100, the tensor cores' oldest and
newest), as CuPy's ``RawModule`` compiles them (``--std=c++17`` and the
module's ``-D`` definitions). NVIDIA's compiler wheels are found as
``benchmarks/count_sass.py`` finds them (``nvidia-cuda-nvrtc-cu12`` and
``nvidia-cuda-nvcc-cu12``, or the CUDA 13 ``nvidia-cuda-nvrtc`` and
``nvidia-cuda-nvcc``, on the Python path); skipped where they are not (CI).
"""

from __future__ import annotations

import os
import runpy
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from test_fast_cupy import CASES, TENSOR_CASES, TENSOR_MATRIX, WGMMA_CASES, _problem, _spec

from npattn import fast_cupy

COUNT_SASS = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "count_sass.py"))
NVRTC, PTXAS = COUNT_SASS["_find"]("libnvrtc.so*"), COUNT_SASS["_find"]("ptxas")

#: Multiprocessors of the modules' plans (an H100's): only a decode step's
#: key ranges depend on them, not which modules it builds.
MULTIPROCESSORS = 132


class _Recorder:
    """:class:`npattn.fast_cupy.Runtime` that compiles nothing: it keeps
    each module's ``(source, defines)`` in the order asked."""

    def __init__(self, shared_memory: int) -> None:
        self.modules: dict[tuple[str, tuple[tuple[str, str], ...]], None] = {}
        self.shared_bytes = shared_memory

    def module(self, source: str, defines: tuple[tuple[str, str], ...]) -> object:
        self.modules[(source, defines)] = None
        return object()

    def multiprocessors(self, like) -> int:
        return MULTIPROCESSORS

    def shared_memory(self, like) -> int:
        return self.shared_bytes


def _targets_specs():
    """Issue 18's shapes (B=1, N=8, H=64, float16, float32, float64; H=128
    in float16 and float32; the decode step, T=1 against N=32 on 8 kv heads),
    plain, with a softcap (the build for every option) and with a mask and
    a bias (``USER_MASK`` and ``USER_BIAS``, whose rows take more of dK/dV's
    shared memory)."""
    for dtype in (np.float16, np.float32, np.float64):
        for H in (64, 128) if dtype != np.float64 else (64,):
            x = np.zeros((1, 8, 4096, H), dtype)
            step = np.zeros((1, 32, 1, H), dtype)
            masked = {"mask": np.ones((1, 4096), bool), "bias": np.zeros((1, 4096))}
            for options in ({}, {"softcap": 30.0}, masked):
                yield _spec(x, x, x, options)
                yield _spec(step, x, x, dict(options, causal=True, align="bottom_right"))


def shipped_modules() -> dict[tuple[str, tuple[tuple[str, str], ...]], None]:
    """Every module (source, defines) the emulated tests and issue 18's
    shapes build, on the tensor cores and, with ``NPATTN_CUPY_TENSOR_CORES=0``,
    the CUDA cores; the backward's on GPUs whose blocks take 227, 163 or 99
    KiB of shared memory (H100, A100, GeForce 8.6 and 8.9: its operands kept
    there, ``TC_KEPT_DQ`` and ``TC_KEPT_DKDV``, as many as fit), and the
    tensor cases' backward with one and with both kept in each kernel, as
    ``KEPT_MATRIX``'s emulated tests force them, float64's dK/dV summing
    dQ, and the tensor cases' forward keeping Q in shared memory."""
    tensor_problems = [_problem(dtype=dtype, **TENSOR_CASES[case]) for case, dtype, _ in TENSOR_MATRIX]
    tensor_specs = [_spec(q, k, v, options) for q, k, v, options in tensor_problems]
    problems = [
        _problem(dtype=dtype, **case) for case in CASES.values() for dtype in (np.float64, np.float32, np.float16)
    ]
    specs = tensor_specs + [_spec(q, k, v, options) for q, k, v, options in problems] + list(_targets_specs())
    modules: dict[tuple[str, tuple[tuple[str, str], ...]], None] = {}
    for kib in (227, 163, 99):
        recorder = _Recorder(kib * 1024)
        for spec in specs:
            for setting in ("1", "0"):
                precision = fast_cupy._precision(spec, setting)
                fast_cupy._forward_plan(recorder, spec, None, precision)
                fast_cupy._backward_plan(recorder, spec, None, precision)
        modules.update(recorder.modules)
    recorder = _Recorder(227 * 1024)
    for n in (1, 2):
        with mock.patch.object(fast_cupy, "tensor_kept_operands", lambda spec, precision, shared, n=n: (n, n)):
            for spec in tensor_specs:
                fast_cupy._backward_plan(recorder, spec, None, fast_cupy._precision(spec, "1"))
        # float64's dK/dV summing dQ (TC_FUSED_DQ), V kept (n = 2) and not, as the emulated tests force it
        with (
            mock.patch.object(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"})),
            mock.patch.object(fast_cupy, "tensor_fused_dq", lambda *arguments, n=n: n if arguments[1] == "f64" else 0),
        ):
            for spec in tensor_specs + list(_targets_specs()):
                if fast_cupy._precision(spec, "1") == "f64" and fast_cupy.plain_scores(spec):
                    fast_cupy._backward_plan(recorder, spec, None, "f64")
    # the forwards keeping Q in shared memory (TC_KEPT_Q), as the emulated tests force them
    for spec in tensor_specs + list(_targets_specs()):
        precision = fast_cupy._precision(spec, "1")
        if precision is not None:
            with mock.patch.object(fast_cupy, "TENSOR_KEPT_Q", {precision: 3}):
                fast_cupy._forward_plan(recorder, spec, None, precision)
    modules.update(recorder.modules)
    return modules


def _compile_error(tools, source: str, defines: tuple[tuple[str, str], ...], arch: str, folder: Path) -> str | None:
    """NVRTC's or ptxas's complaint about one module for ``sm_{arch}``, or None."""
    options = ["--std=c++17", f"-arch=compute_{arch}"] + [f"-D{name}={value}" for name, value in defines]
    try:
        ptx = tools.ptx(source, options)  # ctypes lets other threads run meanwhile
    except RuntimeError as error:
        return f"{dict(defines)}: {error}"
    folder.mkdir()
    (folder / "kernels.ptx").write_text(ptx)
    command = [PTXAS, f"-arch=sm_{arch}", str(folder / "kernels.ptx"), "-o", str(folder / "kernels.cubin")]
    assembled = subprocess.run(command, capture_output=True, text=True)
    return f"{dict(defines)}: ptxas: {assembled.stderr.strip()}" if assembled.returncode else None


@pytest.mark.skipif(NVRTC is None or PTXAS is None, reason="no NVRTC and ptxas (NVIDIA's compiler wheels)")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_kernels_compile_with_nvrtc_and_ptxas(tmp_path, arch):
    tools = COUNT_SASS["Tools"](NVRTC, PTXAS, None)
    modules = list(shipped_modules())
    assert len(modules) > 100  # both kinds of kernels, three precisions, forward and backward, both builds
    assert any(("TC_KEPT_Q", "1") in defines for _, defines in modules)  # and the kernels not yet shipped
    assert any(("TC_FUSED_DQ", "1") in defines for _, defines in modules)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        errors = pool.map(lambda n: _compile_error(tools, *modules[n], arch, tmp_path / str(n)), range(len(modules)))
        failures = [error for error in errors if error is not None]
    assert not failures, f"{len(failures)} of {len(modules)} modules:\n" + "\n".join(failures[:5])


def wgmma_modules() -> dict[tuple[str, tuple[tuple[str, str], ...]], None]:
    """The float16 modules on sm_90a's wgmma (``TC_WGMMA``, not yet
    shipped), forward and backward, as the emulated tests force them (the
    tensor cases at H = Hv = 64) and for issue 18's float16 shapes."""
    problems = [_problem(dtype=np.float16, **{**TENSOR_CASES[case], "H": 64, "Hv": 64}) for case in WGMMA_CASES]
    specs = [_spec(q, k, v, options) for q, k, v, options in problems] + list(_targets_specs())
    recorder = _Recorder(227 * 1024)
    with mock.patch.object(fast_cupy, "TENSOR_WGMMA", {"f16": (True, True)}):
        for spec in specs:
            if fast_cupy._precision(spec, "1") == "f16":
                fast_cupy._forward_plan(recorder, spec, None, "f16")
                fast_cupy._backward_plan(recorder, spec, None, "f16")
    return {module: None for module in recorder.modules if ("TC_WGMMA", "1") in module[1]}


@pytest.mark.skipif(NVRTC is None or PTXAS is None, reason="no NVRTC and ptxas (NVIDIA's compiler wheels)")
def test_wgmma_kernels_compile_for_sm_90a(tmp_path):
    """The wgmma modules compile with the options CuPy's RawModule gives
    them (``fast_cupy.CupyRuntime.module``'s ``-arch=sm_90a``, then CuPy's
    own ``-arch``: NVRTC builds for sm_90a), and ptxas assembles them for
    sm_90a without serializing a wgmma (its warning where a register a wgmma
    in flight holds is touched), each kernel's loop holding HGMMA."""
    tools = COUNT_SASS["Tools"](NVRTC, PTXAS, COUNT_SASS["_find"]("cuobjdump"), COUNT_SASS["_find"]("nvdisasm"))
    modules = list(wgmma_modules())
    assert len(modules) >= 4  # forward and backward, plain scores and every option

    def problems(n: int) -> str | None:
        source, defines = modules[n]
        options = ["--std=c++17"] + [f"-D{name}={value}" for name, value in defines] + ["-arch=sm_90a", "-arch=sm_90"]
        try:
            ptx = tools.ptx(source, options)
        except RuntimeError as error:
            return f"{dict(defines)}: {error}"
        if ".target sm_90a" not in ptx:
            return f"{dict(defines)}: NVRTC built for another target"
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "kernels.ptx").write_text(ptx)
        command = [PTXAS, "-arch=sm_90a", "-v", str(tmp_path / str(n) / "kernels.ptx")]
        assembled = subprocess.run(
            command + ["-o", str(tmp_path / str(n) / "kernels.cubin")], capture_output=True, text=True
        )
        if assembled.returncode or "serialized" in assembled.stderr:
            return f"{dict(defines)}: ptxas: {assembled.stderr.strip()}"
        return None

    with ThreadPoolExecutor(os.cpu_count()) as pool:
        failures = [error for error in pool.map(problems, range(len(modules))) if error is not None]
    assert not failures, f"{len(failures)} of {len(modules)} modules:\n" + "\n".join(failures[:5])
    if tools.cuobjdump:
        listing = subprocess.run(
            [tools.cuobjdump, "-sass", str(tmp_path / "0" / "kernels.cubin")],
            capture_output=True,
            text=True,
            env=tools.environment,
        ).stdout
        loops = COUNT_SASS["tile_loops"](listing)
        assert all(loops[name].hgmma > 0 for name in loops if name.endswith("_tc")), loops
