"""Static counts of the tensor-core kernels' machine code, without a GPU.

    python benchmarks/count_sass.py             # float16, float32 (3xTF32) and float64, H=Hv=64
    python benchmarks/count_sass.py --head-dim 128

Compiles ``npattn.fast_cupy``'s tensor-core kernels as CuPy would (NVRTC,
``-arch=compute_90``), assembles them for an H100 (``ptxas -arch=sm_90 -v``)
and disassembles them (``cuobjdump -sass``), with the tiles ``fast_cupy``
picks for T=S=4096 (and for a decode step's forward: T=1 at 32 query heads
on 8 kv heads, in blocks of one warp; and float64's dK/dV kernel summing
dQ, ``TC_FUSED_DQ``, and its forward keeping Q in shared memory,
``TC_KEPT_Q`` at 3 blocks a multiprocessor, and float16's kernels on
sm_90a's wgmma, ``TC_WGMMA``, compiled for sm_90a, none of them shipped
yet, built for plain scores alone, their operands as
``fast_cupy.tensor_fused_dq`` and ``fast_cupy.tensor_kept_q`` keep them on
an H100), and prints per kernel:
the registers a thread takes and the bytes it spills (the shipped kernels: those built
for plain scores, ``PLAIN_SCORES=1``, which plain calls run, and those
built for every option, ``all``), and the
instructions of the loop over tiles on a plain call's path: the kernels
built again with that call's runtime flags made compile-time (no softcap,
ALiBi, dropout or segment ids; a positive scale; every key of a tile seen,
every row of a tile copied; one query head per kv head, as in the
targets' B=1, N=8, K=8), so that the
compiler drops the other branches and the loop holds what a whole tile of a
plain call executes, with its tensor-core instructions (HMMA; DMMA in
float64; HGMMA on wgmma) and its spill loads and stores (LDL, STL: spilled bytes outside
the loop cost once a block) counted apart; and the spill loads and stores
in the tile loop of the kernel shipped for plain scores ("shipped loop"),
whose registers are allocated for every branch left in it (masks,
windows, lengths), so that a plain call can spill there where the plain
build does not (the float16 forward when it was capped to 4 blocks:
Nsight Compute counted 3.5 million spill requests in one call at T=S=4096
on an H100, before the kernels were built apart for plain scores). The
last three columns bound a warp's pass through the plain loop from below,
in the multiprocessor's cycles of each resource its warps share
(:meth:`Loop.bounds`): issue, shared memory and, in float64 and on wgmma,
the tensor cores; the largest bounds the kernel (docs/gpu_performance.rst's "Static
bounds of the tile loops"). Whether a change makes the kernels faster is
for ``bench_gpu.py --targets`` on a GPU to say.

The tools come from NVIDIA's pip wheels (none of them a dependency of
npattn): ``nvidia-cuda-nvrtc-cu12`` (libnvrtc), ``nvidia-cuda-nvcc-cu12``
(ptxas), ``nvidia-cuda-cuobjdump`` (cuobjdump) and ``nvidia-cuda-nvdisasm``
(nvdisasm, which cuobjdump 13 runs to print machine code), found in the
Python path's ``nvidia`` packages or given by ``--nvrtc``, ``--ptxas``,
``--cuobjdump`` and ``--nvdisasm``. Without the first three it prints
``skipped: ...`` and exits with 0.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple
from unittest import mock

import numpy as np

try:
    import npattn  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from npattn import fast_cupy
from npattn.options import make_spec

#: The runtime flags of a plain call, made compile-time: (text, replacement)
#: in the kernels' source.
PLAIN_CALL = (
    ("const bool plain = pb.softcap == 0 && !pb.slopes;", "const bool plain = true;"),
    ("sees(range, pb, rows, b, i, offset)", "true"),
    ("pb.dropout ?", "false ?"),
    ("if (pb.dropout)", "if (false)"),
    ("!pb.dropout &&", ""),
    ("!pb.kv_segments", "true"),
    ("sees_whole_tile(range)", "true"),
    ("scale_log2 > 0 &&", ""),
    ("if (end - first >= ROWS_)", "if (true)"),
    ("if (pb.G == 1)", "if (true)"),
    ("seen && warp_last < pb.S", "true"),
)


#: Shared memory a block of an H100 may take (CUDA's opt-in maximum), for
#: the backward's operands kept there (``fast_cupy.tensor_kept_operands``).
H100_SHARED_MEMORY = 227 * 1024


def _find(pattern: str) -> str | None:
    for folder in sys.path:
        found = sorted(glob.glob(os.path.join(folder or ".", "nvidia", "**", pattern), recursive=True))
        if found:
            return found[-1]
    return None


class Tools:
    """NVRTC through ctypes, ptxas and cuobjdump (which runs nvdisasm, found
    on ``PATH``: ``nvdisasm``'s folder goes first there when given)."""

    def __init__(self, nvrtc: str, ptxas: str, cuobjdump: str, nvdisasm: str | None = None):
        self.lib, self.ptxas, self.cuobjdump = ctypes.CDLL(nvrtc), ptxas, cuobjdump
        self.environment = dict(os.environ)
        if nvdisasm:
            self.environment["PATH"] = os.pathsep.join((os.path.dirname(nvdisasm), os.environ.get("PATH", "")))

    def ptx(self, source: str, options: list[str]) -> str:
        lib, program, size = self.lib, ctypes.c_void_p(), ctypes.c_size_t()
        if lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernels.cu", 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        encoded = [o.encode() for o in options]
        status = lib.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(program, log)
        if status:
            raise RuntimeError(f"NVRTC failed:\n{log.value.decode()}")
        lib.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(program, ptx)
        return ptx.value.decode()

    def assemble(self, ptx: str, folder: str, arch: str = "sm_90") -> tuple[str, str]:
        """``(ptxas -v's report, cuobjdump -sass's listing)``."""
        ptx_path, cubin = os.path.join(folder, "kernels.ptx"), os.path.join(folder, "kernels.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        report = subprocess.run(
            [self.ptxas, f"-arch={arch}", "-v", ptx_path, "-o", cubin], capture_output=True, text=True
        )
        if report.returncode:
            raise RuntimeError(f"ptxas failed:\n{report.stderr}")
        listing = subprocess.run([self.cuobjdump, "-sass", cubin], capture_output=True, text=True, env=self.environment)
        if listing.returncode:
            raise RuntimeError(f"cuobjdump failed:\n{listing.stderr}")
        return report.stderr, listing.stdout


def registers(report: str) -> dict[str, tuple[int, int]]:
    """``{kernel: (registers, bytes of spill stores)}`` from ptxas -v."""
    found = {}
    for block in report.split("Compiling entry function ")[1:]:
        name = block.split("'")[1]
        spills = re.search(r"(\d+) bytes spill stores", block)
        found[name] = (int(re.search(r"Used (\d+) registers", block).group(1)), int(spills.group(1)) if spills else 0)
    return found


#: Multiprocessor cycles of the float64 tensor cores a DMMA.16x8x8 (1024
#: multiply-adds, the only DMMA shape the kernels issue) takes at an H100
#: SXM's float64 tensor peak: 67 TFLOP/s at 1.98 GHz on 132
#: multiprocessors is 256 flops a cycle each, so 2048 / 256 = 8 (on each of
#: the 4 sub-partitions' tensor cores, 32 of its scheduler's cycles).
DMMA_CYCLES = 8

#: Multiprocessor cycles of the float16 tensor cores a warp's
#: HGMMA.64x64x16 (wgmma: its quarter of the warpgroup's 64 x 64 x 16
#: product, 16384 multiply-adds) takes at an H100 SXM's dense float16 peak:
#: 989.4 TFLOP/s at 1.83 GHz on 132 multiprocessors is 4096 flops a cycle
#: each, so 32768 / 4096 = 8.
HGMMA_CYCLES = 8

#: Shared memory's passes (128 bytes each) a warp's HGMMA.64x64x16 takes: its
#: quarter of B's 16 x 64 float16 (2048 bytes), which the tensor cores read
#: once for the warpgroup (at shared memory's 128 bytes a cycle: an
#: assumption, NVIDIA publishes no rate for it).
HGMMA_WAVEFRONTS = 4

#: Schedulers of a multiprocessor, each issuing one instruction a cycle.
SCHEDULERS = 4


def shared_wavefronts(op: str) -> int:
    """Passes of shared memory (128 bytes a cycle) a warp's instruction
    ``op`` takes at the fewest, its lanes hitting no bank twice: loads and
    stores by their width (``LDS``, ``LDS.64``, ``STS.128``), ``ldmatrix``
    by its matrices (``LDSM.16.M88.4``), ``cp.async`` by what it writes
    (``LDGSTS.E.BYPASS.LTC128B.128``); 0 for any other instruction."""
    parts = op.split(".")
    if parts[0] == "LDSM":
        return {"2": 2, "4": 4}.get(parts[-1], 1)
    if parts[0] not in ("LDS", "STS", "LDGSTS"):
        return 0
    return 4 if "128" in parts[1:] else 2 if "64" in parts[1:] else 1


class Loop(NamedTuple):
    """What a warp's pass through a kernel's tile loop issues."""

    instructions: int
    mma: int  # HMMA, DMMA or HGMMA
    spills: int  # spill loads and stores (LDL, STL)
    wavefronts: int  # shared memory's passes at the fewest (shared_wavefronts, HGMMA_WAVEFRONTS)
    dmma: int
    hgmma: int = 0

    def bounds(self) -> tuple[float, int, int | None]:
        """The multiprocessor cycles a warp's tile takes at the least of
        each resource it shares with the other warps there: issue (its
        instructions over the 4 schedulers), shared memory (its wavefronts)
        and, in float64 and on wgmma, the tensor cores (DMMA_CYCLES a DMMA,
        HGMMA_CYCLES a HGMMA; None otherwise: the H100's rate for
        ``mma.sync`` in float16 and TensorFloat-32 is not published)."""
        tensor = self.dmma * DMMA_CYCLES + self.hgmma * HGMMA_CYCLES
        return self.instructions / SCHEDULERS, self.wavefronts, tensor or None


def tile_loops(listing: str) -> dict[str, Loop]:
    """Each kernel's longest loop (the span of its longest backward branch),
    counted (:class:`Loop`)."""
    loops = {}
    for part in listing.split("Function : ")[1:]:
        name = part.split()[0]
        code = [
            (int(a, 16), op)
            for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", part)
        ]
        jumps = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA[^;]*?0x([0-9a-f]+)", part)
        spans = [(int(to, 16), int(at, 16)) for at, to in jumps if int(to, 16) < int(at, 16)]
        if spans:
            first, last = max(spans, key=lambda s: s[1] - s[0])
            body = [op for a, op in code if first <= a <= last]
            hgmma = sum(op.startswith("HGMMA") for op in body)
            loops[name] = Loop(
                instructions=len(body),
                mma=sum(op.startswith(("HMMA", "DMMA", "HGMMA")) for op in body),
                spills=sum(op.startswith(("LDL", "STL")) for op in body),
                wavefronts=sum(shared_wavefronts(op) for op in body) + hgmma * HGMMA_WAVEFRONTS,
                dmma=sum(op.startswith("DMMA") for op in body),
                hgmma=hgmma,
            )
    return loops


def _wgmma_takes(spec, backward: bool) -> bool:
    """Whether ``fast_cupy.tensor_wgmma`` would run ``spec``'s float16
    forward (or backward) on wgmma, were it shipped."""
    with mock.patch.object(fast_cupy, "TENSOR_WGMMA", {"f16": (True, True)}):
        return fast_cupy.tensor_wgmma(spec, "f16", None, backward)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-dim", type=int, default=64, help="H = Hv (default 64)")
    parser.add_argument("--nvrtc", default=_find("libnvrtc.so*"), help="libnvrtc (default: the nvidia wheels')")
    parser.add_argument("--ptxas", default=_find("ptxas"), help="ptxas (default: the nvidia wheels')")
    parser.add_argument("--cuobjdump", default=_find("cuobjdump"), help="cuobjdump (default: the nvidia wheels')")
    parser.add_argument(
        "--nvdisasm", default=_find("nvdisasm"), help="nvdisasm, which cuobjdump runs (default: the nvidia wheels')"
    )
    args = parser.parse_args(argv)
    if not 0 < args.head_dim <= fast_cupy.TENSOR_MAX_HEAD_DIM or args.head_dim % 16:
        parser.error(
            f"--head-dim must be a multiple of 16 in [16, {fast_cupy.TENSOR_MAX_HEAD_DIM}], got {args.head_dim}"
        )
    missing = [name for name in ("nvrtc", "ptxas", "cuobjdump") if not getattr(args, name)]
    if missing:
        print(
            f"skipped: no {', '.join(missing)} (pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12 "
            "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, or give their paths)"
        )
        return 0
    tools = Tools(args.nvrtc, args.ptxas, args.cuobjdump, args.nvdisasm)
    H = args.head_dim
    print(
        f"tensor-core kernels, H=Hv={H}, sm_90: registers / spilled bytes (as shipped for plain scores, "
        "and for every option); the plain tile loop"
    )
    header = f"{'precision':<10} {'kernel':<34} {'registers':>9} {'spilled':>8} {'all: regs':>9} {'spilled':>8}"
    header += f" {'loop instr':>11} {'MMA':>5} {'per MMA':>9} {'loop spills':>12} {'shipped loop':>13}"
    print(f"{header} {'issue':>7} {'shared':>7} {'tensor':>7}")
    with tempfile.TemporaryDirectory() as folder:
        for dtype in (np.float16, np.float32, np.float64):
            x = np.zeros((1, 8, 4096, H), dtype)
            full, step = make_spec(x, x, x), make_spec(np.zeros((1, 32, 1, H), dtype), x, x)  # step: one-warp blocks
            variants = ((full, False, ""), (full, True, ""), (step, False, ""), (full, True, "fused dQ"))
            wgmma = ((full, False, "wgmma"), (full, True, "wgmma"))
            for spec, backward, variant in (*variants, (full, False, "kept Q"), *wgmma):
                precision = fast_cupy.tensor_precision(spec)
                if precision is None or (variant and precision != ("f16" if variant == "wgmma" else "f64")):
                    continue  # float64 above its widest; wgmma: float16 alone, the other variants float64
                if variant == "wgmma" and not _wgmma_takes(spec, backward):
                    continue
                source = fast_cupy.kernel_source("tensor_backward" if backward else "tensor_forward")
                plain = source
                for text, replacement in PLAIN_CALL:
                    plain = plain.replace(text, replacement)
                kept = fast_cupy.tensor_kept_operands(spec, precision, H100_SHARED_MEMORY) if backward else (0, 0)
                fused = variant == "fused dQ"
                if fused:  # the dK/dV kernel summing dQ, its operands as tensor_fused_dq keeps them on an H100
                    with mock.patch.object(fast_cupy, "TENSOR_FUSED_DQ", frozenset({precision})):
                        kept = (0, fast_cupy.tensor_fused_dq(spec, precision, H100_SHARED_MEMORY))
                if variant == "kept Q":  # the forward keeping Q in shared memory, 3 blocks a multiprocessor
                    with mock.patch.object(fast_cupy, "TENSOR_KEPT_Q", {precision: 3}):
                        kept = (fast_cupy.tensor_kept_q(spec, precision, H100_SHARED_MEMORY), 0)
                on_wgmma = variant == "wgmma"
                defines = dict(fast_cupy._tensor_defines(spec, precision, backward, kept, fused, on_wgmma))
                arch = "sm_90a" if on_wgmma else "sm_90"  # wgmma: sm_90a's alone
                options = ["--std=c++17", f"-arch=compute_{arch[3:]}"] + [f"-D{k}={v}" for k, v in defines.items()]
                report, listing = tools.assemble(tools.ptx(source, options), folder, arch)  # PLAIN_SCORES=1
                shipped, shipped_loops = registers(report), tile_loops(listing)
                every = [option.replace("-DPLAIN_SCORES=1", "-DPLAIN_SCORES=0") for option in options]
                general = {} if variant else registers(tools.assemble(tools.ptx(source, every), folder, arch)[0])
                loops = tile_loops(tools.assemble(tools.ptx(plain, options), folder, arch)[1])
                names = ("npattn_backward_dq_tc", "npattn_backward_dkdv_tc") if backward else ("npattn_forward_tc",)
                for name in names[1:] if fused else names:
                    loop = loops[name]
                    label = name + (" (decode)" if spec is step else f" ({variant})" if variant else "")
                    regs, spilled = shipped[name]
                    every_regs, every_spilled = general.get(name, ("-", "-"))  # variants: plain scores alone
                    figures = f"{regs:9d} {spilled:8d} {every_regs:>9} {every_spilled:>8} "
                    figures += f"{loop.instructions:11d} {loop.mma:5d} {loop.instructions / loop.mma:9.1f}"
                    figures += f" {loop.spills:12d} {shipped_loops[name].spills:13d}"
                    issue, shared, tensor = loop.bounds()
                    figures += f" {issue:7.0f} {shared:7d} {'-' if tensor is None else tensor:>7}"
                    print(f"{precision:<10} {label:<34} {figures}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
