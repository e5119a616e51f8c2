r"""CuPy fast path of the chunked algorithm: fused CUDA kernels for the GPU.

The same online-softmax forward and FlashAttention-2 backward as
:mod:`npattn.chunked`, each a single CUDA kernel launch instead of the
generic path's ~20 array operations per tile:

- ``npattn_forward`` (``npattn/cuda/forward.cu``; ``npattn_forward_tc`` on
  the tensor cores, ``tensor_forward.cu``): one block per range of
  stacked query rows of a kv head (the G query heads that share it,
  position-major as in :mod:`npattn.fast_numpy`), each row held by a few
  threads (:func:`launch_shape`), key and value tiles through shared
  memory, the online softmax in registers; ``O`` and ``lse`` written once.
- ``npattn_backward_dq`` and ``npattn_backward_dkdv``
  (``npattn/cuda/backward.cu``): ``dQ`` summed per query row over the keys,
  ``dK`` and ``dV`` per key over the query rows, each by one thread group in
  a fixed order, so the same inputs give the same bits (no atomics).
  ``P`` is recomputed from ``lse`` in both, FlashAttention-2's trade of
  arithmetic for memory: nothing of size ``T x S`` is ever stored.
- **flash-decoding**: where the call has too few query rows to fill the
  GPU (decoding, ``T`` small against a long ``S``), the forward cuts the
  keys into ranges, one block each, and merges their ``(O, lse)`` through
  ``lse`` in one more kernel (``npattn/cuda/merge.cu``).

The score pipeline's units run inside the kernels, transcribed once in
``npattn/cuda/pipeline.cuh`` from :mod:`npattn.scores`: softcap, ALiBi
(its slopes' gradient summed per query row, then over rows), causal/window
with either alignment, lengths, segment ids, and dropout with the hashed
keep mask of :mod:`npattn.dropout`, bit for bit, and the user's boolean
``mask`` and ``bias`` (read where they lie, through their strides, in
kernels built for such calls; the dQ kernels write ``dS``, the bias's
gradient before its broadcast axes are summed). Sinks are merged outside
the kernels as on every path. A call with score or mask modifications
runs the generic chunked path instead
(:func:`supports`), as do large float64 calls on the CUDA cores
(:func:`preferred`), every
namespace but CuPy, and CuPy with ``NPATTN_FAST_CUPY=0``. ``block_q`` and
``block_k`` do not apply here.

Two kinds of kernels, chosen per call (:func:`tensor_precision`):

- **on the tensor cores** (``npattn/cuda/tensor_forward.cu``,
  ``tensor_backward.cu``; FlashAttention-2's register layout, ``mma.sync``):
  float16 inputs with their products exact and summed in float32, float32
  inputs in three TensorFloat-32 passes (3xTF32, float32's accuracy to
  about 2\ :sup:`-21`), for ``H`` and ``Hv`` up to
  :data:`TENSOR_MAX_HEAD_DIM` in whole ``mma`` steps; float64 inputs on the
  float64 tensor cores for ``H`` and ``Hv`` up to
  :data:`TENSOR_F64_MAX_HEAD_DIM`; decoding steps included
  (:func:`tensor_warps`);
- **on the CUDA cores** (``forward.cu``, ``backward.cu``): everything else
  the path takes, in the compute dtype.

The kernels are compiled at first use for each (kind, dtype, ``H``, ``Hv``,
launch shape) by CuPy's ``RawModule`` (NVRTC) and cached for the process
(and on disk by CuPy), each twice where a process needs both: for calls
with plain scores (:func:`plain_scores`) and for every other. What a call
launches (module, kernels, grids, key ranges, the ``Config`` struct) is
kept for a spec that recurs (``_plan``), so that a repeated call (a decode
step at a fixed ``S``) runs little Python before its first launch.

The module talks to the GPU through a small :class:`Runtime` (compile,
launch), so that the tests can run the same kernels on the CPU through a
C++ emulator of CUDA's thread model (``tests/cuda_emulator``). A call
copies nothing to the device before its kernels: its scalar options and
the addresses of its per-batch arrays reach them by value, as one struct
(:data:`CONFIG_DTYPE`).
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass
from importlib import resources
from typing import Any, NamedTuple, Protocol

import array_api_compat
import numpy as np

from .dropout import _seed_hash, keep_threshold
from .namespace import sum_to_shape
from .options import RECURRING_SPECS, AttentionSpec
from .scores.pipeline import param_grads_from_heads
from .scores.visibility import window_reach

__all__ = [
    "supports",
    "preferred",
    "forward",
    "forward_and_output",
    "backward",
    "launch_shape",
    "kernel_source",
    "tensor_precision",
    "tensor_warps",
    "operand_dtype",
    "plain_scores",
]

#: Largest ``H`` and ``Hv`` the kernels take (their rows live in registers).
MAX_HEAD_DIM = 256

#: Shared memory per tile of keys (or query rows), in bytes: the key and
#: value tiles together stay within it (CUDA's static limit is 48 KiB).
TILE_BYTES = 32 * 1024

#: Threads per block.
BLOCK_THREADS = 128

#: Threads per block of ``npattn_merge_splits`` (``merge.cu``): one block a row.
MERGE_THREADS = 128

#: CUDA's limit on a grid's y and z sizes: kv heads run on y, batch
#: elements (times key ranges) on z.
MAX_GRID_YZ = 65535

#: Threads that share one row (its lanes), by compute dtype's itemsize, in
#: the forward and in the backward, when there are many rows; and when
#: there are few (decoding). Fewer lanes mean fewer shuffles per product,
#: more lanes fewer registers per thread and so more threads per
#: multiprocessor. The fastest of 1 to 8 on an H100 (B=1, N=8, T=S=4096,
#: H=64; decoding T=1 against S=32768, N=32 on 8 kv heads, H=128).
FORWARD_LANES = {4: 1, 8: 2}
BACKWARD_LANES = {4: 2, 8: 2}
FEW_ROWS_LANES = 8

#: Stacked rows ``G * T`` of a kv head up to which a call counts as "few rows".
FEW_ROWS = 32

#: The forward splits the keys (flash-decoding) while its blocks are fewer
#: than the multiprocessors: into enough ranges for this many blocks per
#: multiprocessor, each of at least :data:`MIN_SPLIT_KEYS` keys.
SPLIT_BLOCKS_PER_SM = 4
MIN_SPLIT_KEYS = 256

#: Where the fused kernels run float64 on the CUDA cores (heads the float64
#: tensor cores do not take: :func:`tensor_precision`), cuBLAS's products on
#: the float64 tensor cores make the generic chunked path the faster from
#: about this many scores (``B * N * T * S``; H100, B=1, N=8, H=64,
#: forward+backward: the CUDA-core kernels took 0.48-0.56x its time at
#: T=S=256, 1.16-1.44x at 1024, 1.82-2.26x at 2048 and 4096), and
#: :func:`preferred` leaves such calls to it.
FLOAT64_MAX_SCORES = 2**22

#: The headers every kind of kernels starts with: the score pipeline, the
#: stacked rows, and the entries' dtypes.
_COMMON_SOURCES = ("pipeline.cuh", "rows.cuh", "half.cuh", "entries.cuh")
#: The tensor-core kernels' own headers: PTX, float64's exp2, fragments and the tile loop.
_TENSOR_SOURCES = _COMMON_SOURCES + ("ptx.cuh", "exp2.cuh", "operands.cuh", "tensor_tiles.cuh")

#: The kernels' source files (``npattn/cuda``), in order, by kind: the
#: CUDA-core kernels (every dtype and head size), and the tensor-core
#: forward (with the merge of key ranges) and backward (with ``D``'s own
#: kernel, for the dK/dV kernel that sums dQ), compiled apart so that each
#: sizes its own tiles (:func:`tensor_precision`, :func:`tensor_tile`).
SOURCES = {
    "cuda_cores": _COMMON_SOURCES + ("tiles.cuh", "delta.cuh", "merge.cu", "forward.cu", "backward.cu"),
    "tensor_forward": _TENSOR_SOURCES + ("merge.cu", "tensor_forward.cu"),
    "tensor_backward": _TENSOR_SOURCES + ("delta.cuh", "backward_d.cu", "tensor_backward.cu"),
}

#: Largest ``H`` and ``Hv`` the tensor-core kernels take (their operands
#: and accumulators live in registers), and in float64, whose entries take
#: two registers each.
TENSOR_MAX_HEAD_DIM = 128
TENSOR_F64_MAX_HEAD_DIM = 64

#: Compute capability from which the tensor-core kernels run (``cp.async``
#: and the ``mma.sync`` shapes of ``ptx.cuh`` need sm_80); older GPUs run
#: every call on the CUDA cores.
TENSOR_MIN_CAPABILITY = 80

#: The ``PRECISION`` (``ptx.cuh``) and the entries' bytes of each precision.
TENSOR_PRECISIONS = {"f16": ("PRECISION_F16", 2), "tf32x3": ("PRECISION_TF32X3", 4), "f64": ("PRECISION_F64", 8)}

#: Stacked query rows (or keys, in dK/dV) per warp of the tensor-core
#: kernels: an ``mma``'s 16 rows.
TENSOR_WARP_ROWS = 16

#: Warps per block of the tensor-core backward, by precision: 4, but 8 in
#: float64, whose dQ an H100 ran in 1.54 ms with 8 warps against 1.69 with
#: 4 (dK/dV 2.245 against 2.239; T=S=4096, H=64; one block of 8 warps a
#: multiprocessor either way, at 255 registers). With 8, float16's dQ and
#: dK/dV took 0.235 and 0.350 ms against 0.211 and 0.324, float32's 0.982
#: and 1.500 against 0.957 and 1.467.
TENSOR_BACKWARD_WARPS = {"f16": 4, "tf32x3": 4, "f64": 8}


def supports(spec: AttentionSpec) -> bool:
    """Whether the fused kernels run ``spec``: CuPy arrays computing in
    float32 or float64 (float16 inputs compute in float32), ``H`` and ``Hv``
    up to :data:`MAX_HEAD_DIM`, no score or mask modification (a boolean
    mask and a bias are taken), at most :data:`MAX_GRID_YZ` batch elements
    and kv heads, and ``NPATTN_FAST_CUPY`` not ``0``. Empty calls take the
    generic path."""
    return (
        os.environ.get("NPATTN_FAST_CUPY", "1") != "0"
        and array_api_compat.is_cupy_namespace(spec.xp)
        and _kernels_take(spec)
    )


def preferred(spec: AttentionSpec) -> bool:
    """Whether the chunked path runs ``spec`` on the fused kernels: where
    they take it (:func:`supports`), except float64 calls on the CUDA cores
    of more than :data:`FLOAT64_MAX_SCORES` scores, which the generic path
    runs faster."""
    if not supports(spec):
        return False
    scores = spec.num_batch * spec.num_heads * spec.q_len * spec.kv_len
    on_cuda_cores = spec.compute_dtype == np.float64 and tensor_precision(spec) is None
    return not on_cuda_cores or scores <= FLOAT64_MAX_SCORES


def _kernels_take(spec: AttentionSpec) -> bool:
    """The part of :func:`supports` that does not depend on the namespace."""
    return (
        spec.compute_dtype in (np.float32, np.float64)
        and not spec.score_mods
        and spec.mask_mod is None
        and spec.block_mask is None
        and 0 < spec.head_dim <= MAX_HEAD_DIM
        and 0 < spec.value_dim <= MAX_HEAD_DIM
        and min(spec.num_batch, spec.num_heads, spec.q_len, spec.kv_len) > 0
        and max(spec.num_batch, spec.num_kv_heads) <= MAX_GRID_YZ
    )


# --- compiling and launching ------------------------------------------------------


class Runtime(Protocol):
    """What the kernels need from a GPU runtime (CuPy's, or the tests' emulator)."""

    def module(self, source: str, defines: tuple[tuple[str, str], ...]) -> Any:
        """The compiled module of ``source`` with these ``-D`` definitions."""

    def launch(
        self, module: Any, name: str, grid: tuple[int, int, int], threads: int, args: tuple, shared_bytes: int = 0
    ) -> None:
        """Run kernel ``name`` of ``module``; ``args`` are device arrays, None
        (a null pointer) or a host NumPy array of one :data:`CONFIG_DTYPE`
        entry (the ``Config`` struct, by value); ``shared_bytes`` of dynamic
        shared memory a block (``extern __shared__``), the same at every
        launch of a kernel."""

    def multiprocessors(self, like: Any) -> int:
        """Multiprocessors of ``like``'s device."""

    def shared_memory(self, like: Any) -> int:
        """Bytes of shared memory a block of ``like``'s device may take,
        static and dynamic together (CUDA's opt-in maximum)."""


class CupyRuntime:
    """:class:`Runtime` on CuPy: NVRTC through ``cupy.RawModule``, each
    kernel looked up once (``RawModule.get_function`` makes a new
    ``RawKernel`` and asks the driver for the function on every call)."""

    def __init__(self) -> None:
        self._attributes: dict[int, dict[str, int]] = {}
        self._kernels: dict[tuple[Any, str], Any] = {}
        self._opted_in: set[tuple[Any, int]] = set()  # (kernel, device id) given its dynamic shared memory
        self._by_value: dict[int, tuple[np.ndarray, Any]] = {}  # id(host array) -> (it, its CPointer)

    def module(self, source: str, defines: tuple[tuple[str, str], ...]) -> Any:
        import cupy  # the optional GPU extra: only reached with CuPy arrays

        options = ("--std=c++17",) + tuple(f"-D{name}={value}" for name, value in defines)
        if ("TC_WGMMA", "1") in defines:  # sm_90a's wgmma: NVRTC takes this beside CuPy's own -arch=sm_90
            options += ("-arch=sm_90a",)
        return cupy.RawModule(code=source, options=options)

    def launch(
        self, module: Any, name: str, grid: tuple[int, int, int], threads: int, args: tuple, shared_bytes: int = 0
    ) -> None:
        kernel = self._kernels.get((module, name))
        if kernel is None:
            kernel = self._kernels[(module, name)] = module.get_function(name)
        # None as a NULL pointer and the Config struct by value, each a
        # pointer to host bytes the driver copies (_by_value); device arrays
        # as they are: one comprehension, no call per device array
        by_value = self._by_value_pointer
        converted = [by_value(a) if type(a) is np.ndarray else by_value(_NULL) if a is None else a for a in args]
        device = args[0].device
        with device:  # the arrays' device, whichever is current
            if shared_bytes and (kernel, device.id) not in self._opted_in:
                # past 48 KiB a kernel opts in, on each device (cudaFuncAttributeMaxDynamicSharedMemorySize)
                kernel.max_dynamic_shared_size_bytes = shared_bytes
                self._opted_in.add((kernel, device.id))
            kernel(grid, (threads, 1, 1), tuple(converted), shared_mem=shared_bytes)

    def _by_value_pointer(self, host: np.ndarray) -> Any:
        """CuPy's kernel argument for the bytes of ``host``, passed by value:
        a ``CPointer`` to them, kept by the array's identity (a recurring
        spec's launch plan hands the same ``Config`` to every launch), so
        that a launch neither views the array again nor has CuPy read its
        ``__array_interface__`` (which NumPy builds field by field for
        ``Config``'s structured dtype: 7.0 µs a launch of the merge, raw and
        viewed as bytes, against 4.9 with a kept pointer, on an H100's
        host). The array is held with its pointer, so its id stays its own;
        at most :data:`BY_VALUE_POINTERS` are kept."""
        kept = self._by_value.get(id(host))
        if kept is None:
            from cupy.cuda.function import CPointer

            if len(self._by_value) >= BY_VALUE_POINTERS:
                self._by_value.clear()
            kept = self._by_value[id(host)] = (host, CPointer(host.ctypes.data))
        return kept[1]

    def multiprocessors(self, like: Any) -> int:
        return self._device_attributes(like)["MultiProcessorCount"]

    def shared_memory(self, like: Any) -> int:
        # CUDA's portable 48 KiB where a CuPy's attributes lack the opt-in maximum
        return self._device_attributes(like).get("MaxSharedMemoryPerBlockOptin", 48 * 1024)

    def _device_attributes(self, like: Any) -> dict[str, int]:
        device = like.device.id
        if device not in self._attributes:  # Device.attributes reads every attribute: once per device
            self._attributes[device] = dict(like.device.attributes)
        return self._attributes[device]


_CUPY_RUNTIME = CupyRuntime()

_NULL = np.zeros(1, np.uint64)  # a NULL pointer's bytes (CuPy turns None into 0xffffffff in some versions)

#: Host arrays passed by value whose pointers :class:`CupyRuntime` keeps.
BY_VALUE_POINTERS = 64


@functools.cache
def kernel_source(kind: str = "cuda_cores") -> str:
    """The CUDA C++ source of one kind of kernels (:data:`SOURCES`):
    ``npattn/cuda``'s files, in order: this package's own, also in a copy
    imported under another name (a benchmark's base revision)."""
    folder = resources.files(__package__) / "cuda"
    return "\n".join((folder / name).read_text(encoding="utf-8") for name in SOURCES[kind])


@dataclass(frozen=True)
class LaunchShape:
    """How a kernel's rows map onto threads: ``lanes`` threads per row,
    ``rows`` thread groups per block, each holding ``tile`` rows (keys in
    ``npattn_backward_dkdv``), ``keys`` rows per shared-memory tile, scored
    ``chunk`` at a time."""

    lanes: int
    rows: int
    tile: int
    keys: int
    chunk: int


#: 32-bit registers a thread may give to its rows' slices: ``q`` (or
#: ``k``) and the accumulator (or ``v``) in the forward, twice that many
#: slices per row in the backward. Lanes double until one row's forward
#: slices fit, for wide heads: at H=Hv=128 in float32 the forward spilled
#: 1232 bytes with one lane, none with two; at H=Hv=256, 4880 bytes with
#: one lane, none with four; float64 at H=Hv=128, 1144 bytes with two
#: lanes, none with four (``nvcc -Xptxas -v``, sm_90). Then a thread takes
#: as many rows as fit (its register tile, up to 4). The backward at H=64
#: in float64 still spills about 780 bytes with two lanes, which measured faster
#: than four (forward+backward 29.2 against 32.4-32.7 ms, T=S=4096).
SLICE_REGISTERS = 128


def _slice_values(spec: AttentionSpec, lanes: int) -> int:
    """Values of one row's ``q`` and ``v`` slices that a thread holds, with
    ``lanes`` threads to a row (each slice in whole 16-byte pieces)."""
    piece = 16 // np.dtype(spec.compute_dtype).itemsize

    def per_lane(width: int) -> int:
        return piece * -(-width // (lanes * piece))

    return per_lane(spec.head_dim) + per_lane(spec.value_dim)


def launch_shape(spec: AttentionSpec, backward: bool = False) -> LaunchShape:
    """The launch shape of the forward's kernel or the backward's for
    ``spec``: lanes from :data:`FORWARD_LANES` and its kin (more for wide
    heads), register tiles within :data:`SLICE_REGISTERS`, shared-memory
    tiles within :data:`TILE_BYTES`.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64), np.float32)
    >>> launch_shape(make_spec(x, x, x)), launch_shape(make_spec(x, x, x), backward=True).lanes
    (LaunchShape(lanes=1, rows=128, tile=1, keys=64, chunk=8), 2)
    >>> launch_shape(make_spec(x[..., :1, :], x, x, causal=True, align="bottom_right")).lanes
    8
    >>> wide = np.zeros((1, 8, 1024, 256), np.float32)
    >>> launch_shape(make_spec(wide, wide, wide)).lanes
    4
    """
    few = spec.group_size * spec.q_len <= FEW_ROWS
    itemsize = np.dtype(spec.compute_dtype).itemsize
    lanes = FEW_ROWS_LANES if few else (BACKWARD_LANES if backward else FORWARD_LANES)[itemsize]
    budget = SLICE_REGISTERS * 4 // itemsize  # values of the compute dtype
    while lanes < 32 and _slice_values(spec, lanes) > budget:
        lanes *= 2  # wide heads: more lanes, so that a thread's slices stay in registers
    per_row = _slice_values(spec, lanes) * (2 if backward else 1)
    tile = 1 if few else max(1, min(4, budget // per_row))
    keys = 64
    while keys > 1 and keys * (spec.head_dim + spec.value_dim) * itemsize > TILE_BYTES:
        keys //= 2
    return LaunchShape(lanes, BLOCK_THREADS // lanes, tile, keys, min(8, keys))


def _module(runtime: Runtime, spec: AttentionSpec, shape: LaunchShape) -> Any:
    """The kernels compiled for ``spec``'s dtype and dims and ``shape``,
    once per runtime and process."""
    scalar = "double" if spec.compute_dtype == np.float64 else "float"
    defines = (
        ("scalar_t", scalar),
        *_score_defines(spec),
        ("OPERANDS_F16", str(int(operand_dtype(spec) == np.float16))),
        ("HEAD_DIM", str(spec.head_dim)),
        ("VALUE_DIM", str(spec.value_dim)),
        ("LANES", str(shape.lanes)),
        ("ROWS", str(shape.rows)),
        ("TILE", str(shape.tile)),
        ("KEYS", str(shape.keys)),
        ("CHUNK", str(shape.chunk)),
    )
    return _compiled(runtime, "cuda_cores", defines)


def _score_defines(spec: AttentionSpec) -> tuple[tuple[str, str], ...]:
    """The definitions that pick ``pipeline.cuh``'s build of the score
    pipeline for ``spec``: ``PLAIN_SCORES`` (:func:`plain_scores`), and
    ``USER_MASK`` and ``USER_BIAS`` where the call has a boolean mask or a
    bias (each then an offset in every ``Row``; calls without them build
    the kernels as they were)."""
    mask, bias = spec.mask is not None, spec.bias is not None
    return (
        ("PLAIN_SCORES", str(int(plain_scores(spec)))),
        *((("USER_MASK", "1"),) if mask else ()),
        *((("USER_BIAS", "1"),) if bias else ()),
    )


def plain_scores(spec: AttentionSpec) -> bool:
    """Whether ``spec``'s call runs the kernels built for plain scores
    (``PLAIN_SCORES``, ``pipeline.cuh``): no softcap, ALiBi, dropout,
    segment ids, boolean mask or bias, options those kernels leave out at
    compile time, so that their branches and the registers those hold leave
    them too (ptxas for
    sm_90, H=64: the float32 forward 167 registers against 201, the float64
    dQ spilling 184 bytes against 356; ``benchmarks/count_sass.py``). Other
    calls run the kernels built for every option.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64), np.float32)
    >>> plain_scores(make_spec(x, x, x, causal=True)), plain_scores(make_spec(x, x, x, softcap=30.0))
    (True, False)
    """
    return (
        spec.softcap is None
        and spec.alibi_slopes is None
        and not spec.dropout_p
        and not spec.has_segments
        and spec.mask is None
        and spec.bias is None
    )


def _compiled(runtime: Runtime, kind: str, defines: tuple[tuple[str, str], ...]) -> Any:
    """``kind``'s kernels compiled with ``defines``, once per runtime and process."""
    key = (runtime, kind, defines)
    if key not in _MODULES:
        _MODULES[key] = runtime.module(kernel_source(kind), defines)
    return _MODULES[key]


_MODULES: dict[tuple[Runtime, str, tuple[tuple[str, str], ...]], Any] = {}


# --- the tensor-core kernels ------------------------------------------------------------


def tensor_precision(spec: AttentionSpec) -> str | None:
    r"""The tensor cores' precision for ``spec`` (``ptx.cuh``), or None where
    the CUDA-core kernels run it.

    - ``"f16"``: float16 inputs, their products exact on the tensor cores
      and summed in float32; ``P`` and ``dS`` rounded to float16 before the
      second product, as in FlashAttention-2. ``H`` and ``Hv`` multiples of 16.
    - ``"tf32x3"``: float32 inputs, each product in three TensorFloat-32
      passes (big and small halves of each operand: float32's accuracy to
      about 2\ :sup:`-21`). ``H`` and ``Hv`` multiples of 8.
    - ``"f64"``: float64 inputs on the float64 tensor cores (IEEE float64
      products and sums, as the CUDA cores'). ``H`` and ``Hv`` multiples of 8
      up to :data:`TENSOR_F64_MAX_HEAD_DIM`.

    float16 and float32 up to :data:`TENSOR_MAX_HEAD_DIM`; every precision
    for any number of rows (a decode step's forward runs in blocks of one warp:
    :func:`tensor_warps`); none on a GPU of compute capability below
    :data:`TENSOR_MIN_CAPABILITY`, nor with ``NPATTN_CUPY_TENSOR_CORES=0``.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64), np.float16)
    >>> y, wide = x.astype(np.float64), np.zeros((1, 8, 1024, 128))
    >>> [tensor_precision(make_spec(a, a, a)) for a in (x, y, wide)]
    ['f16', 'f64', None]
    """
    return _precision(spec, os.environ.get("NPATTN_CUPY_TENSOR_CORES", "1"))


def _precision(spec: AttentionSpec, setting: str) -> str | None:
    """:func:`tensor_precision` with ``NPATTN_CUPY_TENSOR_CORES`` read as
    ``setting`` (:func:`_plan` reads it once a call: 0.8 µs where it is unset)."""
    if setting == "0" or not _tensor_capable(spec.device):
        return None
    if spec.compute_dtype == np.float64:
        precision, step, widest = "f64", 8, TENSOR_F64_MAX_HEAD_DIM
    elif np.dtype(spec.dtype) == np.float16:
        precision, step, widest = "f16", 16, TENSOR_MAX_HEAD_DIM
    elif np.dtype(spec.dtype) == np.float32:
        precision, step, widest = "tf32x3", 8, TENSOR_MAX_HEAD_DIM
    else:
        return None
    if max(spec.head_dim, spec.value_dim) > widest or spec.head_dim % step or spec.value_dim % step:
        return None
    return precision


def _tensor_capable(device: Any) -> bool:
    """Whether ``device`` runs the tensor-core kernels: a CuPy device of
    compute capability :data:`TENSOR_MIN_CAPABILITY` or more (CuPy's
    ``Device.compute_capability``: ``"90"`` on an H100, cached by CuPy), or
    any other (the tests' emulator, on NumPy's ``"cpu"``)."""
    capability = getattr(device, "compute_capability", None)
    return capability is None or int(capability) >= TENSOR_MIN_CAPABILITY


def tensor_warps(spec: AttentionSpec, backward: bool = False) -> int:
    """Warps per block of the tensor-core kernels (``TC_WARPS``), each with
    :data:`TENSOR_WARP_ROWS` stacked query rows (or keys, in dK/dV): 4, or
    :data:`TENSOR_BACKWARD_WARPS` in the backward; in the forward of a call
    with at most 32 stacked rows ``G * T`` per kv head (a decode step:
    ``G * T = 4`` at 32 query heads on 8 kv heads, ``T = 1``), as few as
    hold them, so that no warp of a block idles and the blocks, one or two
    warps each, split the keys among more of them (flash-decoding,
    :func:`_splits`).

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> q, kv = np.zeros((1, 32, 1, 128), np.float16), np.zeros((1, 8, 4096, 128), np.float16)
    >>> tensor_warps(make_spec(q, kv, kv)), tensor_warps(make_spec(kv, kv, kv))
    (1, 4)
    >>> x64 = np.zeros((1, 8, 4096, 64))
    >>> tensor_warps(make_spec(kv, kv, kv), backward=True), tensor_warps(make_spec(x64, x64, x64), backward=True)
    (4, 8)
    """
    if backward:
        precision = tensor_precision(spec)
        return 4 if precision is None else TENSOR_BACKWARD_WARPS[precision]
    rows = spec.group_size * spec.q_len
    if rows > 2 * TENSOR_WARP_ROWS:
        return 4
    return 1 if rows <= TENSOR_WARP_ROWS else 2


def operand_dtype(spec: AttentionSpec) -> Any:
    """The dtype in which the fused kernels read ``q``, ``k``, ``v`` and
    ``dO`` and write ``dQ``, ``dK`` and ``dV`` (``npattn/cuda/entries.cuh``):
    float16 for float16 inputs, on both kinds of kernels, so that the
    caller's arrays are read as they are, with no float32 copies
    (:func:`npattn.attention.forward_from_spec` keeps them as the
    residuals); else the compute dtype. ``out``, ``lse`` and ``D`` are in the
    compute dtype, and every sum runs in it.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64), np.float16)
    >>> operand_dtype(make_spec(x, x, x)), operand_dtype(make_spec(*(a.astype(np.float32) for a in (x, x, x))))
    (dtype('float16'), dtype('float32'))
    """
    return _FLOAT16 if spec.dtype == _FLOAT16 else spec.compute_dtype


_FLOAT16 = np.dtype(np.float16)


def _tensor_module(
    runtime: Runtime,
    spec: AttentionSpec,
    precision: str,
    warps: int,
    backward: bool = False,
    kept: tuple[int, int] = (0, 0),
    fused_dq: bool = False,
    wgmma: bool = False,
) -> Any:
    """The tensor-core forward (with the merge of key ranges) or backward
    (with ``D``) for ``spec``'s dims, ``precision`` and ``warps``
    (:func:`tensor_warps`), each with its own tiles (:func:`tensor_tile`),
    the backward with ``kept`` operands in shared memory
    (:func:`tensor_kept_operands`) and its dK/dV kernel summing dQ where
    ``fused_dq`` (:func:`tensor_fused_dq`), the forward with Q kept there
    where ``kept[0]``, its blocks a multiprocessor (:func:`tensor_kept_q`),
    and its products on ``wgmma`` (:func:`tensor_wgmma`): looked up by these,
    :func:`plain_scores` and whether a mask and a bias are given alone (1
    µs; building its definitions takes 2.5 more, 2-core EPYC)."""
    key = (
        runtime,
        precision,
        spec.head_dim,
        spec.value_dim,
        warps,
        backward,
        plain_scores(spec),
        spec.mask is not None,
        spec.bias is not None,
        kept,
        fused_dq,
        wgmma,
    )
    module = _TENSOR_MODULES.get(key)
    if module is None:
        kind = "tensor_backward" if backward else "tensor_forward"
        defines = _tensor_defines(spec, precision, backward, kept, fused_dq, wgmma)
        module = _TENSOR_MODULES[key] = _compiled(runtime, kind, defines)
    return module


_TENSOR_MODULES: dict[tuple[Runtime, str, int, int, int, bool, bool, bool, bool, tuple[int, int], bool, bool], Any] = {}


def _tensor_defines(
    spec: AttentionSpec,
    precision: str,
    backward: bool,
    kept: tuple[int, int] = (0, 0),
    fused_dq: bool = False,
    wgmma: bool = False,
) -> tuple[tuple[str, str], ...]:
    """The ``-D`` definitions of :func:`_tensor_module`, the backward's with
    ``kept`` operands in shared memory (:func:`tensor_kept_operands`) and
    ``TC_FUSED_DQ`` where ``fused_dq``, the forward's with ``TC_KEPT_Q``
    and its registers capped to ``kept[0]`` blocks where that is not 0
    (:func:`tensor_kept_q`) and ``TC_WGMMA`` where ``wgmma``
    (:func:`tensor_wgmma`; ``benchmarks/count_sass.py`` compiles with them
    too)."""
    tile = tensor_tile(spec, precision, backward)
    defines = (
        ("scalar_t", "double" if precision == "f64" else "float"),
        *_score_defines(spec),
        ("OPERANDS_F16", str(int(precision == "f16"))),
        ("PRECISION", TENSOR_PRECISIONS[precision][0]),
        ("HEAD_DIM", str(spec.head_dim)),
        ("VALUE_DIM", str(spec.value_dim)),
        ("TC_KEYS", str(tile)),
        ("TC_WARPS", str(tensor_warps(spec, backward))),
    )
    wgmma_define = (("TC_WGMMA", "1"),) if wgmma else ()
    if backward:
        kept_defines = (("TC_KEPT_DQ", str(kept[0])), ("TC_KEPT_DKDV", str(kept[1])))
        return defines + kept_defines + ((("TC_FUSED_DQ", "1"),) if fused_dq else ()) + wgmma_define
    q_blocks = kept[0]  # with Q kept, the blocks a multiprocessor its registers are capped to fit
    return defines + (
        ("TC_MIN_BLOCKS", str(q_blocks or tensor_min_blocks(spec, precision))),
        ("TC_SPLIT_STAGES", str(int(tensor_split_stages(spec, precision)))),
        *((("TC_KEPT_Q", "1"),) if q_blocks else ()),
        *wgmma_define,
    )


#: Blocks per multiprocessor the tensor-core forward's registers are capped
#: to fit (``TC_MIN_BLOCKS``), by precision, for heads up to 64 and wider
#: ones; 0: the compiler's choice. Measured on an H100 (2026-11-27, T=S=4096
#: unless said, H=64, the build for plain scores, best of 3 interleaved
#: rounds): float16 capped to 3 blocks (167 registers, no spill) 0.179 ms
#: full, 0.129 causal, 2.164 at 16384 full, against 0.179, 0.160 and 2.296
#: capped to 4 (128 registers, spilling in its loop) and 0.178, 0.131 and
#: 2.148 uncapped (167). float32 capped to 2 blocks 0.663 ms: the cap
#: allows 256 registers, but ptxas then takes 196 where uncapped it took
#: 167, which let 3 blocks run a multiprocessor at 0.850 ms (capped to 3,
#: 0.869). float64 uncapped 1.227 ms, capped to 3 1.594. Wider heads:
#: float16 at 3 (168 registers, like uncapped; ptxas for sm_90), float32's
#: 255 registers fit 2 blocks uncapped.
TENSOR_FORWARD_MIN_BLOCKS = {"f16": (3, 3), "tf32x3": (2, 0), "f64": (0, 0)}


def tensor_min_blocks(spec: AttentionSpec, precision: str) -> int:
    """Blocks of 4 warps per multiprocessor the tensor-core forward is
    compiled to fit (``__launch_bounds__``'s second argument): from
    :data:`TENSOR_FORWARD_MIN_BLOCKS`, the caps measured fastest; 0 (the
    compiler's choice) for the blocks of one or two warps of a few stacked
    rows, which registers do not limit.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x, wide = np.zeros((1, 8, 1024, 64), np.float32), np.zeros((1, 8, 1024, 128), np.float32)
    >>> tensor_min_blocks(make_spec(x, x, x), "tf32x3"), tensor_min_blocks(make_spec(wide, wide, wide), "tf32x3")
    (2, 0)
    """
    if tensor_warps(spec) < 4:
        return 0
    narrow, wide = TENSOR_FORWARD_MIN_BLOCKS[precision]
    return narrow if max(spec.head_dim, spec.value_dim) <= 64 else wide


#: Blocks of 4 warps a multiprocessor runs of the tensor-core forward that
#: keeps Q's fragments in dynamic shared memory rather than registers
#: (``TC_KEPT_Q``, :func:`tensor_kept_q`), its registers capped to fit that
#: many, by precision (heads up to 64); a precision absent keeps Q in
#: registers. None yet: not timed on a GPU (``benchmarks/bench_gpu.py
#: --kept-q`` runs float64's at 3). float64's forward takes 255 registers
#: with Q in them, so 2 blocks (8 warps, 2 a scheduler) run a
#: multiprocessor; with Q kept, ``count_sass.py`` (sm_90, H=Hv=64, CUDA
#: 13.5) counts 206 registers uncapped and 168 capped to 3 blocks, no spill
#: in the loop a plain call's whole tile runs (1043 instructions against
#: 1041; 9 spill loads and stores in the shipped loop), where capped to 3
#: with Q in registers it spills 52 loads and stores there.
TENSOR_KEPT_Q: dict[str, int] = {}


def _row_operand_bytes(warps: int, widths: tuple[int, ...], precision: str) -> int:
    """Dynamic shared memory of a tensor-core block of ``warps`` warps that
    keeps A operands there (``RowOperand``, ``operands.cuh``): each warp's 16
    rows of each operand, ``widths`` entries a row, of the precision's size."""
    return warps * 16 * sum(widths) * TENSOR_PRECISIONS[precision][1]


def _blocks_fit(blocks: int, static: int, dynamic: int, shared_memory: int) -> bool:
    """Whether ``blocks`` blocks, each of ``static`` and ``dynamic`` bytes of
    shared memory and the 1 KiB CUDA reserves for it, fit a multiprocessor
    whose blocks may take ``shared_memory`` bytes (CUDA's opt-in maximum:
    the multiprocessor's shared memory less that 1 KiB)."""
    return blocks * (static + dynamic + 1024) <= shared_memory + 1024


def _kept_q_bytes(spec: AttentionSpec, precision: str) -> int:
    """Dynamic shared memory of a tensor-core forward block that keeps Q's
    fragments there."""
    return _row_operand_bytes(tensor_warps(spec), (spec.head_dim,), precision)


def tensor_kept_q(spec: AttentionSpec, precision: str, shared_memory: int) -> int:
    """Blocks a multiprocessor runs of the tensor-core forward that keeps
    Q's fragments in dynamic shared memory (``TC_KEPT_Q``), its registers
    capped to fit them: :data:`TENSOR_KEPT_Q`'s for the forward's 4-warp
    blocks at heads up to 64, where that many blocks' static and dynamic
    shared memory, with the 1 KiB CUDA reserves for each, fit the device's
    ``shared_memory`` bytes a block (as in :func:`tensor_kept_operands`);
    0 where Q stays in registers.

    >>> import numpy as np
    >>> from unittest import mock
    >>> from npattn import fast_cupy
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64))
    >>> with mock.patch.object(fast_cupy, "TENSOR_KEPT_Q", {"f64": 3}):
    ...     [tensor_kept_q(make_spec(x, x, x), "f64", kib * 1024) for kib in (227, 163)]
    [3, 0]
    >>> tensor_kept_q(make_spec(x, x, x), "f64", 227 * 1024)  # not in TENSOR_KEPT_Q
    0
    """
    blocks = TENSOR_KEPT_Q.get(precision, 0)
    if not blocks or tensor_warps(spec) < 4 or max(spec.head_dim, spec.value_dim) > 64:
        return 0
    stages = 1 if tensor_split_stages(spec, precision) else 2  # a key and a value tile each
    static = _static_shared_bytes(spec, precision, tensor_tile(spec, precision), backward=False, stages=stages)
    return blocks if _blocks_fit(blocks, static, _kept_q_bytes(spec, precision), shared_memory) else 0


#: Precisions whose tensor-core kernels run their products on sm_90a's
#: warpgroup tensor cores (``TC_WGMMA``: ``wgmma`` in ``ptx.cuh``, as
#: FlashAttention-3 does, where the other kernels take ``mma.sync``;
#: :func:`tensor_wgmma`), ``(forward, backward)``: the block's 4 warps
#: multiply together, the tensor cores reading the tiles of keys and values
#: (of queries and dO in dK/dV) from shared memory once for them all, where
#: each warp's ``ldmatrix`` read them for its own 16 rows (128 of the
#: float16 forward's 163 cycles of shared memory a warp's tile,
#: ``count_sass.py``), at the rate NVIDIA publishes for the H100 (989
#: TFLOP/s in float16), which ``mma.sync`` does not reach. float16 alone
#: (the instruction takes float16, bfloat16, TensorFloat-32 and 8-bit
#: floats, no float64). None yet: not timed on a GPU
#: (``benchmarks/bench_gpu.py --wgmma``).
TENSOR_WGMMA: dict[str, tuple[bool, bool]] = {}

#: The compute capability whose GPUs run sm_90a's ``wgmma`` (the H100, H200,
#: H20; CuPy's ``Device.compute_capability``): a cubin built for sm_90a runs
#: on no other.
WGMMA_CAPABILITY = "90"


def tensor_wgmma(spec: AttentionSpec, precision: str, device: Any, backward: bool = False) -> bool:
    """Whether the tensor-core forward (or backward) runs on ``wgmma``
    (``TC_WGMMA``): where :data:`TENSOR_WGMMA` says so for ``precision``,
    for blocks of 4 warps (a warpgroup: :func:`tensor_warps`), ``H = Hv =
    64`` (a row of the tiles 128 bytes, the width of the swizzle the tensor
    cores read) and tiles of 64 rows (:func:`tensor_tile`), on a GPU of
    :data:`WGMMA_CAPABILITY` (or the tests' emulator, whose device has none).

    >>> import numpy as np
    >>> from unittest import mock
    >>> from npattn import fast_cupy
    >>> from npattn.options import make_spec
    >>> x, wide = np.zeros((1, 8, 1024, 64), np.float16), np.zeros((1, 8, 1024, 128), np.float16)
    >>> with mock.patch.object(fast_cupy, "TENSOR_WGMMA", {"f16": (True, False)}):
    ...     [tensor_wgmma(make_spec(a, a, a), "f16", "cpu", backward) for a in (x, wide) for backward in (False, True)]
    [True, False, False, False]
    >>> tensor_wgmma(make_spec(x, x, x), "f16", "cpu")  # not in TENSOR_WGMMA
    False
    """
    if precision != "f16" or not TENSOR_WGMMA.get(precision, (False, False))[backward]:
        return False
    capability = getattr(device, "compute_capability", None)
    return (
        (capability is None or str(capability) == WGMMA_CAPABILITY)
        and tensor_warps(spec, backward) == 4
        and spec.head_dim == spec.value_dim == 64
        and tensor_tile(spec, precision, backward) == 64
    )


#: Bytes of ``pipeline.cuh``'s ``Row`` at most (four int64, a scalar_t and
#: a uint32), and the dK/dV kernel's lse, D (scalar_t) and row index beside
#: each, by precision.
TENSOR_ROW_BYTES = {"f16": 40 + 8 + 8, "tf32x3": 40 + 8 + 8, "f64": 48 + 16 + 8}

#: Bytes a ``Row`` holds more for each of a boolean mask and a bias, in the
#: kernels built for them (``USER_MASK``, ``USER_BIAS``): the offset of the
#: row's entries in it, an int64.
ROW_OFFSET_BYTES = 8


def _tile_stride(width: int, precision: str) -> int:
    """Entries between rows of a tile in shared memory (``tile_stride``,
    ``operands.cuh``): ``width``, padded by 16 bytes unless float64's
    swizzled layout takes it (``width`` a multiple of 16)."""
    if precision == "f64" and width % 16 == 0:
        return width
    return width + 16 // TENSOR_PRECISIONS[precision][1]


#: How many of its two A operands (``Q`` and ``dO`` in dQ, ``K`` and ``V``
#: in dK/dV: 16 rows a warp, read once) each kernel of the tensor-core
#: backward keeps in dynamic shared memory rather than registers
#: (``TC_KEPT_DQ``, ``TC_KEPT_DKDV``; 1: the first), at most, by precision:
#: ``(dQ, dK/dV)`` for heads up to 64 and for wider ones. The fastest count
#: of each on an H100 (2026-11-27, tenth session; ``bench_gpu.py --kept
#: --repeats 5``: 0, 1 and 2 kept, best of 5 calls each in turn, B=1, N=8,
#: T=S=4096 unless said; ms for 0, 1, 2, of the first of three runs on three
#: machines, two for float32 at H=Hv=128; the runs agree on these counts,
#: but for float16's dQ at T=S=4096 causal, where both kept took 0.97-1.01x
#: the time of none, and its dK/dV at T=S=16384 full, both kept 0.98-1.01x):
#:
#: - float16 at H=Hv=64: dQ none (full 0.203, 0.232, 0.265; causal 0.144,
#:   0.169, 0.139; T=S=16384 full 2.687, 3.132, 2.981), dK/dV both (full
#:   0.313, 0.320, 0.307; causal 0.233, 0.235, 0.224; T=S=16384 full 4.609,
#:   4.703, 4.504, causal 2.331, 2.382, 2.284);
#: - float16 at H=Hv=128: dQ none (full 0.342, 0.374, 0.413; causal 0.252,
#:   0.281, 0.285), dK/dV one (full 0.568, 0.523, 0.598; causal 0.417,
#:   0.391, 0.450);
#: - float32 at H=Hv=64: dQ none (full 0.878, 0.919, 0.940), dK/dV one
#:   (full 1.404, 1.267, 1.428; causal 1.024, 0.906, 0.977);
#: - float32 at H=Hv=128: dQ one (full 2.553, 2.083, 2.118; causal 1.878,
#:   1.527, 1.557), dK/dV both (full 4.097, 3.329, 2.761; causal 2.975,
#:   2.495, 1.974), where ``count_sass.py`` (sm_90) had counted dK/dV's
#:   plain loop longer kept (2531 instructions against 2102, its fragments
#:   split into TensorFloat-32 halves again each tile) but not its spills;
#: - float64 at H=Hv=64: dQ one (full 1.344, 1.284, 1.400; causal 1.078,
#:   1.030, 1.118), dK/dV both (full 1.944, 1.878, 1.786; causal 1.556,
#:   1.503, 1.430).
TENSOR_KEPT_OPERANDS = {"f16": ((0, 2), (0, 1)), "tf32x3": ((0, 1), (1, 2)), "f64": ((1, 2), (1, 2))}

#: Blocks of the backward's dQ and dK/dV kernels a multiprocessor runs, as
#: their registers allow, with their operands kept in shared memory (float16
#: dQ's 168 registers, 3 blocks of 4 warps; float64's 8 warps, one): the
#: shared memory they keep must leave room for that many
#: (:func:`tensor_kept_operands`).
TENSOR_BACKWARD_BLOCKS = {"f16": (3, 2), "tf32x3": (2, 2), "f64": (1, 1)}


def _kept_bytes(spec: AttentionSpec, precision: str, kept: int) -> int:
    """Dynamic shared memory of a tensor-core backward block whose first
    ``kept`` A operands (of ``H``, then ``Hv`` entries a row) are kept there:
    each warp's 16 rows of an operand (:func:`_row_operand_bytes`)."""
    return _row_operand_bytes(TENSOR_BACKWARD_WARPS[precision], (spec.head_dim, spec.value_dim)[:kept], precision)


def tensor_kept_operands(spec: AttentionSpec, precision: str, shared_memory: int) -> tuple[int, int]:
    """How many A operands the tensor-core backward's dQ and dK/dV kernels
    keep in dynamic shared memory (``TC_KEPT_DQ``, ``TC_KEPT_DKDV``):
    :data:`TENSOR_KEPT_OPERANDS`, fewer where the blocks of a kernel that a
    multiprocessor runs (:data:`TENSOR_BACKWARD_BLOCKS`), with their static
    and dynamic shared memory and the 1 KiB CUDA reserves for each, would
    pass its shared memory: the device's ``shared_memory`` bytes a block
    (CUDA's opt-in maximum: 227 KiB on an H100, 163 on an A100, 99 on the
    GeForce GPUs of compute capability 8.6 and 8.9) and that 1 KiB.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64))
    >>> [tensor_kept_operands(make_spec(x, x, x), "f64", kib * 1024) for kib in (227, 163, 99, 48)]
    [(1, 2), (1, 2), (1, 1), (0, 0)]
    >>> [tensor_kept_operands(make_spec(*(x.astype(np.float16),) * 3), "f16", kib * 1024) for kib in (227, 99)]
    [(0, 2), (0, 0)]
    """
    tile = tensor_tile(spec, precision, backward=True)
    statics = (  # dQ's: its key and value tiles, as the forward's; dK/dV's: query and dO tiles, and their rows'
        _static_shared_bytes(spec, precision, tile, backward=False),
        _static_shared_bytes(spec, precision, tile, backward=True),
    )
    narrow, wide = TENSOR_KEPT_OPERANDS[precision]

    def fitting(kept: int, static: int, blocks: int) -> int:
        while kept and not _blocks_fit(blocks, static, _kept_bytes(spec, precision, kept), shared_memory):
            kept -= 1
        return kept

    wanted = narrow if max(spec.head_dim, spec.value_dim) <= 64 else wide
    dq, dkdv = (fitting(*kernel) for kernel in zip(wanted, statics, TENSOR_BACKWARD_BLOCKS[precision]))
    return dq, dkdv


#: Precisions whose tensor-core dK/dV kernel sums dQ as well
#: (``TC_FUSED_DQ``, ``tensor_backward.cu``; :func:`tensor_fused_dq`): each
#: key block adds its share of a tile's dQ after the key block before it,
#: where the dQ kernel computes ``S = Q K^T`` and ``dP = dO V^T`` a second
#: time, 2 of the backward's 7 products. float64 alone can (its dQ is summed
#: in its own dtype, with no buffer beside it). None yet: not timed on a
#: GPU (``benchmarks/bench_gpu.py --fused-dq`` times the backward both ways).
TENSOR_FUSED_DQ: frozenset[str] = frozenset()


def _fused_bytes(spec: AttentionSpec, precision: str, kept: int) -> int:
    """Dynamic shared memory of a dK/dV block that sums dQ too: its keys'
    tile (its rows, ``H`` entries each), dR's (a tile's query rows, an entry
    a key of the block), each thread's kept share of a tile's dQ (two
    16-byte pieces for each of its warp's (16, 8) blocks of it, a half of
    the warps summing each block over one half of the keys, the other half
    over the other), and, where ``kept`` is 2, V's fragments as
    :func:`_kept_bytes` counts them."""
    item = TENSOR_PRECISIONS[precision][1]
    warps = TENSOR_BACKWARD_WARPS[precision]
    keys, tile = TENSOR_WARP_ROWS * warps, tensor_tile(spec, precision, backward=True)
    tiles = keys * _tile_stride(spec.head_dim, precision) + tile * keys
    share = 2 * -(-(spec.head_dim // 8) // (warps // 2)) * 32 * warps * 16  # a tile of 16 rows: DQ_BLOCKS_A_WARP
    values = _kept_bytes(spec, precision, 2) - _kept_bytes(spec, precision, 1) if kept == 2 else 0
    return tiles * item + share + values


def tensor_fused_dq(spec: AttentionSpec, precision: str, shared_memory: int) -> int:
    """Whether the tensor-core backward's dK/dV kernel sums dQ as well
    (``TC_FUSED_DQ``), so that no dQ kernel runs: 0 where it does not,
    else its operands in shared memory, 1 (the keys, as a tile its dQ
    products read too) or 2 (and V, where :func:`tensor_kept_operands`
    keeps both). It does for the precisions of :data:`TENSOR_FUSED_DQ`,
    calls with plain scores (:func:`plain_scores`: ALiBi's slopes are summed
    in the dQ kernel) and devices whose blocks take those tiles beside the
    kernel's static ones (``shared_memory``: as for
    :func:`tensor_kept_operands`).

    >>> import numpy as np
    >>> from unittest import mock
    >>> from npattn import fast_cupy
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64))
    >>> with mock.patch.object(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"})):
    ...     [tensor_fused_dq(make_spec(x, x, x), "f64", kib * 1024) for kib in (227, 163, 99)]
    [2, 1, 0]
    >>> tensor_fused_dq(make_spec(x, x, x), "f64", 227 * 1024)  # not in TENSOR_FUSED_DQ
    0
    """
    if precision not in TENSOR_FUSED_DQ or not plain_scores(spec):
        return 0
    static = _static_shared_bytes(spec, precision, tensor_tile(spec, precision, backward=True), backward=True)
    blocks = TENSOR_BACKWARD_BLOCKS[precision][1]
    kept = 2 if tensor_kept_operands(spec, precision, shared_memory)[1] == 2 else 1
    while kept and not _blocks_fit(blocks, static, _fused_bytes(spec, precision, kept), shared_memory):
        kept -= 1
    return kept


def _static_shared_bytes(spec: AttentionSpec, precision: str, tile: int, backward: bool, stages: int = 2) -> int:
    """A tensor-core kernel's static shared memory at most with ``stages``
    tiles of ``tile`` rows (:func:`_tiles_fit`), and 256 bytes for the
    block's key span and ``exp2.cuh``'s table."""
    item = TENSOR_PRECISIONS[precision][1]
    padded = _tile_stride(spec.head_dim, precision) + _tile_stride(spec.value_dim, precision)
    offsets = (spec.mask is not None) + (spec.bias is not None)
    row_bytes = TENSOR_ROW_BYTES[precision] + offsets * ROW_OFFSET_BYTES
    per_stage = tile * (padded * item + (row_bytes if backward else 0))
    return stages * per_stage + 256


def _tiles_fit(spec: AttentionSpec, precision: str, tile: int, backward: bool, stages: int = 2) -> bool:
    """Whether ``stages`` tiles (two: ``TC_STAGES``, ``tensor_tiles.cuh``)
    fit CUDA's 48 KiB of static shared memory: a key and a value tile each
    in the forward (rows :func:`_tile_stride` entries apart); in the
    backward, the largest kernel's, dK/dV's: a query and a ``dO`` tile each,
    with :data:`TENSOR_ROW_BYTES` per query row (and :data:`ROW_OFFSET_BYTES`
    with a mask, and again with a bias)."""
    return _static_shared_bytes(spec, precision, tile, backward, stages) <= 48 * 1024


#: Precisions whose tensor-core forward keeps the tile its registers allow
#: where two of them do not fit in shared memory, with one key and one value
#: tile (``TC_SPLIT_STAGES``, FlashAttention-2's forward: the values' copy
#: overlaps the scores, the next keys' the products with the values), rather
#: than halving it to keep two of each: float64, whose 16-key loop issued
#: 19.7 instructions per tensor-core product (sm_90, ``count_sass.py``),
#: where the 32-key one issues 15.7 (its exponentials, running maxima and
#: per-tile work over twice the keys). Not yet timed on a GPU.
TENSOR_SPLIT_STAGES = frozenset({"f64"})


def _register_tile(spec: AttentionSpec, precision: str, backward: bool) -> int:
    """Keys per tile (query rows in dK/dV) as many as a thread's registers take (:func:`tensor_tile`)."""
    if backward:
        return {"f16": 64, "tf32x3": 32, "f64": 16}[precision]
    wide = max(spec.head_dim, spec.value_dim) > 64
    return 32 if precision == "f64" or (precision == "tf32x3" and wide) else 64


def tensor_split_stages(spec: AttentionSpec, precision: str) -> bool:
    """Whether the tensor-core forward runs with one key and one value tile
    (:data:`TENSOR_SPLIT_STAGES`): where two tiles of the size its registers
    take do not fit in static shared memory and one does.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64))
    >>> tensor_split_stages(make_spec(x, x, x), "f64"), tensor_tile(make_spec(x, x, x), "f64")
    (True, 32)
    """
    tile = _register_tile(spec, precision, False)
    return (
        precision in TENSOR_SPLIT_STAGES
        and not _tiles_fit(spec, precision, tile, False)
        and _tiles_fit(spec, precision, tile, False, stages=1)
    )


def tensor_tile(spec: AttentionSpec, precision: str, backward: bool = False) -> int:
    """Keys per shared-memory tile of the tensor-core forward (query rows in
    the backward's dK/dV kernel): as many as a thread's operands and
    accumulators fit its registers, halved (down to 16) until two tiles fit
    in shared memory, so that the next tile's copy overlaps this one's
    products (every head size the tensor cores take fits two tiles of 16);
    not halved in a forward of one key and one value tile
    (:func:`tensor_split_stages`).

    - By registers: 64; 32 in float32 in the backward and with heads over
      64 in the forward; in float64 32 in the forward and 16 in the backward
      (whose kernels, before their operands were kept in shared memory,
      :func:`tensor_kept_operands`, took 255 registers and spilled some
      even so: ptxas reported 420 bytes each for dQ and dK/dV at H=64,
      against 936 and 1568 with 32-row tiles).
    - Halved: 32 keys in the float16 forward at H=Hv=128 (a decode step's
      head) and the float32 forward at H=Hv=64 (the float64 forward at
      H=Hv=64 keeps 32 keys, one tile of each); in the backward, 32 rows in
      float16 with heads over 64 (at H=Hv=128, dK/dV then spills 168 bytes,
      none in its plain-call loop, where it spilled 888) and 16 in float32
      with heads over 80.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 8, 1024, 64), np.float32)
    >>> tensor_tile(make_spec(x, x, x), "tf32x3"), tensor_tile(make_spec(x, x, x), "tf32x3", backward=True)
    (32, 32)
    """
    tile = _register_tile(spec, precision, backward)
    if not backward and tensor_split_stages(spec, precision):
        return tile
    while tile > 16 and not _tiles_fit(spec, precision, tile, backward):
        tile //= 2
    return tile


# --- one call's arguments ------------------------------------------------------------


# ``Config``'s int64 fields, then its float64 ones (CONFIG_DTYPE, _CONFIG_STRUCT).
_CONFIG_INTS = (
    "B",
    "N",
    "KH",
    "T",
    "S",
    "left",
    "right",
    "q_offset",
    "drop_threshold",
    "seed_hash",
    "row0",
    "col0",
    "splits",
    "dropout",
    "kv_head_rows",
    "q_offsets",
    "q_lengths",
    "kv_lengths",
    "q_segments",
    "kv_segments",
    "slopes",
    "mask",
    "mask_stride_b",
    "mask_stride_n",
    "mask_stride_i",
    "mask_stride_j",
    "bias",
    "bias_stride_b",
    "bias_stride_n",
    "bias_stride_i",
    "bias_stride_j",
    "bias_grad",
)
_CONFIG_FLOATS = ("scale", "softcap", "keep_scale")
#: ``pipeline.cuh``'s ``struct Config``, field for field: the call's scalar
#: options and its per-batch arrays' addresses (0: none), which every kernel
#: takes by value (a NumPy array of one entry is
#: a by-value argument to CuPy), so that a call copies nothing to the device
#: before its kernels run (a test reads the struct's fields there).
CONFIG_DTYPE = np.dtype([(name, np.int64) for name in _CONFIG_INTS] + [(name, np.float64) for name in _CONFIG_FLOATS])


#: ``Config`` as a ``struct`` layout, field for field (int64 ``q``, float64 ``d``).
_CONFIG_STRUCT = struct.Struct(f"<{len(_CONFIG_INTS)}q{len(_CONFIG_FLOATS)}d")


def _config(values: tuple) -> np.ndarray:
    """One read-only :data:`CONFIG_DTYPE` entry of ``values``: packed by
    ``struct`` (1 µs; ``np.array`` of the record takes 2.5, 2-core EPYC)."""
    return np.frombuffer(_CONFIG_STRUCT.pack(*values), dtype=CONFIG_DTYPE)


class _Call:
    """The kernels' shared argument for one call: ``pipeline.cuh``'s
    ``Config`` (:data:`CONFIG_DTYPE`, one entry, passed by value), which
    holds the addresses of the optional per-batch arrays (``optional``,
    each flattened over the batch axes, kept here for the call: contiguous
    on the device, but for the mask and the bias, read through their
    strides) where arguments of their own held them (each a conversion in
    CuPy's launch). ``kv_head_rows``: the rows of ``k`` and ``v`` from one
    kv head's first key to the next's (:func:`_kv_operands`); ``bias_grad``:
    the backward's ``(B, N, T, S)`` zeros for ``dS``, with a bias."""

    def __init__(self, spec: AttentionSpec, kv_head_rows: int, splits: int = 1, bias_grad: Any = None):
        B = spec.num_batch
        reach = window_reach(spec)  # a window side wider than this hides nothing
        offset = spec.q_offset if spec.q_offset is not None else 0
        per_batch_offset = hasattr(offset, "shape")  # bottom_right with lengths
        if _has_per_batch_arrays(spec):
            self.optional = _per_batch_arrays(spec, offset if per_batch_offset else None)
            *per_batch, mask, bias = self.optional
            addresses = (*(0 if a is None else _address(a) for a in per_batch), *_strided(mask), *_strided(bias))
        else:  # a plain call's (a decode step's): none
            self.optional, addresses = _NO_ARRAYS, _NO_ADDRESSES
        self.config = _config(
            (
                B,
                spec.num_heads,
                spec.num_kv_heads,
                spec.q_len,
                spec.kv_len,
                -1 if spec.window_left is None else min(spec.window_left, reach),
                -1 if spec.window_right is None else min(spec.window_right, reach),
                0 if per_batch_offset else int(offset),
                keep_threshold(spec.dropout_p) if spec.dropout_p else 0,
                _seed_hash(spec.seed) if spec.dropout_p and spec.seed is not None else 0,
                spec.index_origin[0],
                spec.index_origin[1],
                splits,
                int(spec.dropout_p > 0),
                kv_head_rows,
                *addresses,
                0 if bias_grad is None else _address(bias_grad),
                spec.scale,
                spec.softcap or 0.0,
                1.0 / (1.0 - spec.dropout_p),
            )
        )


#: :class:`_Call`'s ``optional`` where a call has no per-batch array.
_NO_ARRAYS = (None,) * 8

#: ``Config``'s addresses and strides where a call has no per-batch array:
#: the six arrays', then the mask's and the bias's address and four strides.
_NO_ADDRESSES = (0,) * 16


def _has_per_batch_arrays(spec: AttentionSpec) -> bool:
    """Whether ``spec`` holds arrays the kernels read by address: per-batch
    query offsets (``bottom_right`` with lengths), lengths, segment ids,
    ALiBi slopes, a boolean mask or a bias."""
    return not (  # one chain of identity tests (0.15 µs; any() over a tuple takes 0.5)
        spec.q_lengths is None
        and spec.kv_lengths is None
        and spec.q_segment_ids is None
        and spec.alibi_slopes is None
        and spec.mask is None
        and spec.bias is None
        and not hasattr(spec.q_offset, "shape")
    )


def _per_batch_arrays(spec: AttentionSpec, offsets: Any) -> tuple:
    """:class:`_Call`'s optional arrays, each None where ``spec`` has none:
    the per-batch query ``offsets`` (bottom_right with lengths), the
    lengths, segment ids and ALiBi slopes, flattened over the batch axes,
    and the boolean mask and the bias, the latter in the compute dtype
    (:func:`_flat_scores_operand`)."""
    xp, B = spec.xp, spec.num_batch

    def flat(a: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        return None if a is None else _contiguous(xp.reshape(xp.astype(a, dtype), shape))

    segments = spec.q_segment_ids is not None
    slopes = spec.alibi_slopes
    if slopes is not None:
        heads = spec.batch_shape + (spec.num_heads,)
        slopes = xp.broadcast_to(xp.reshape(slopes, slopes.shape[:-2]), heads)  # (..., N|1, 1, 1) -> (..., N)
    return (
        flat(offsets, (B,), xp.int64),
        flat(spec.q_lengths, (B,), xp.int64),
        flat(spec.kv_lengths, (B,), xp.int64),
        flat(spec.q_segment_ids if segments else None, (B, spec.q_len), xp.int64),
        flat(spec.kv_segment_ids if segments else None, (B, spec.kv_len), xp.int64),
        flat(slopes, (B, spec.num_heads), spec.compute_dtype),
        _flat_scores_operand(spec, spec.mask),
        _flat_scores_operand(spec, _compute_dtype_bias(spec)),
    )


def _compute_dtype_bias(spec: AttentionSpec) -> Any:
    """The call's bias in the compute dtype (a copy where it comes in
    another), or None."""
    bias = spec.bias
    return bias if bias is None or bias.dtype == spec.compute_dtype else spec.xp.astype(bias, spec.compute_dtype)


def _flat_scores_operand(spec: AttentionSpec, a: Any) -> Any:
    """A boolean mask or a bias of the call, at its full rank (``spec.mask``,
    ``spec.bias``; None: None), as the kernels read it: ``(B | 1, N | 1, T |
    1, S | 1)``, its batch axes flattened into one, a view of the user's
    array where they flatten (one batch axis, or none it varies along),
    else a copy over the batch axes it broadcasts along; read where it lies,
    through its strides (:func:`_strided`).

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> q, kv = np.zeros((2, 3, 4, 5, 8)), np.zeros((2, 3, 4, 6, 8))  # batch (2, 3), T=5, S=6
    >>> spec = make_spec(q, kv, kv, mask=np.ones((2, 1, 1, 5, 6), bool))
    >>> _flat_scores_operand(spec, spec.mask).shape  # copied over the 3
    (6, 1, 5, 6)
    >>> spec = make_spec(q, kv, kv, mask=np.ones((5, 6), bool))
    >>> _flat_scores_operand(spec, spec.mask).shape  # a view
    (1, 1, 5, 6)
    """
    if a is None:
        return None
    rows = tuple(a.shape[-3:])  # (N | 1, T | 1, S | 1)
    if math.prod(a.shape[:-3]) > 1:
        a = spec.xp.broadcast_to(a, spec.batch_shape + rows)  # (..., N | 1, T | 1, S | 1)
    return spec.xp.reshape(a, (-1, *rows))  # (B | 1, N | 1, T | 1, S | 1)


def _strided(a: Any) -> tuple[int, int, int, int, int]:
    """The address of a :func:`_flat_scores_operand` and the entries
    between neighbours along each of its four axes (``pipeline.cuh``'s
    ``Config.mask`` and ``mask_stride_*``, or ``bias`` and
    ``bias_stride_*``), 0 along those of length 1 (which it broadcasts
    along); zeros for None.

    >>> import numpy as np
    >>> _strided(np.ones((1, 4, 5, 6), bool)[:, ::-1, :, ::2])[1:]
    (0, -30, 6, 2)
    """
    if a is None:
        return (0, 0, 0, 0, 0)
    b, n, i, j = (0 if size == 1 else stride // a.itemsize for size, stride in zip(a.shape, a.strides))
    return (_address(a), b, n, i, j)


#: Alignment of the arrays the kernels read, in bytes: they read rows in
#: 16-byte pieces (``read_slice`` in ``tiles.cuh``).
ALIGNMENT = 16


def _contiguous(a: Any) -> Any:
    """``a`` in C order, starting on an :data:`ALIGNMENT` boundary (a copy
    where it is not): kernels read raw pointers and ignore strides. ``a``
    itself where it is, found by its flags and address alone (the common
    case: ``cupy.ascontiguousarray`` and the namespace tests are left out)."""
    if a.flags.c_contiguous and _address(a) % ALIGNMENT == 0:
        return a
    if isinstance(a, np.ndarray):
        a = np.ascontiguousarray(a)
    else:
        import cupy

        a = cupy.ascontiguousarray(a)
    return a if _address(a) % ALIGNMENT == 0 else a.copy()


def _operands(spec: AttentionSpec, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` (``q``, ``dO``) as the kernels read them: in
    :func:`operand_dtype`, C order, aligned; each the array itself where it is."""
    dtype = operand_dtype(spec)  # a test of the dtype first: the namespace's astype wrapper costs ~2 µs a call
    return tuple(_contiguous(a if a.dtype == dtype else spec.xp.astype(a, dtype)) for a in arrays)


def _kv_operands(spec: AttentionSpec, k: Any, v: Any) -> tuple[Any, Any, int]:
    """``k`` and ``v`` as the kernels read them, and the rows from one kv
    head's first key to the next's: each in :func:`operand_dtype`, both
    read where they lie when their heads are that many rows apart
    (:func:`_head_rows`: the first ``S`` positions of a longer buffer, as a
    preallocated KV cache hands them out), else C-order copies (``S``)."""
    dtype = operand_dtype(spec)
    k, v = (a if a.dtype == dtype else spec.xp.astype(a, dtype) for a in (k, v))
    rows = _head_rows(k)
    if rows is None or rows != _head_rows(v):
        return _contiguous(k), _contiguous(v), spec.kv_len
    return k, v, rows


def _head_rows(a: Any) -> int | None:
    """Rows from one kv head's first key to the next's in ``a`` ``(..., K,
    S, W)`` (the batch and head axes flattened), where its rows are
    C-order, its heads a whole number of rows apart, evenly, and it starts
    on an :data:`ALIGNMENT` boundary (so then does every row the kernels
    read, as in a C-order array), 0 to 2**31 - 1 rows apart; else None.

    >>> import numpy as np
    >>> cache = np.zeros((2, 4, 100, 8), np.float32)
    >>> _head_rows(cache[:, :, :10]), _head_rows(cache[:, :, :10].copy()), _head_rows(cache[:, :, ::2])
    (100, 10, None)
    """
    *heads, S, W = a.shape
    if a.flags.c_contiguous:  # the common case: heads S rows apart
        return None if _address(a) % ALIGNMENT else S
    row = W * a.itemsize
    if (W > 1 and a.strides[-1] != a.itemsize) or (S > 1 and a.strides[-2] != row):
        return None
    stride, span = S * row, 1  # bytes between heads (C-order's, where every head axis has length 1)
    for size, step in zip(reversed(heads), reversed(a.strides[:-2])):
        if size == 1:
            continue
        if span == 1:
            stride = step  # the innermost axis of several heads
        elif step != stride * span:
            return None  # this axis's heads are not evenly spaced with the inner ones
        span *= size
    if stride % row or not 0 <= stride // row < 2**31 or _address(a) % ALIGNMENT:
        return None  # pipeline.cuh's Problem holds the rows in an int, as it holds S
    return stride // row


def _address(a: Any) -> int:
    """The host (NumPy: the tests' emulator) or device (CuPy) address of ``a``'s first entry."""
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def _empties(spec: AttentionSpec, *requests: tuple[tuple[int, ...], Any] | None) -> list[Any]:
    """New arrays of these ``(shape, dtype)`` on the call's device (None for
    a None request): on CuPy, ``cupy.empty`` under that device, entered once
    for them all (array-api-compat's ``empty`` allocates on the current
    device whatever ``device=`` says, and costs ~1 µs more a call; one
    allocation by itself, its namespace test and device included, took 5.1
    µs on an H100's host, ``cupy.empty`` 2.5); the namespace's ``empty``
    otherwise (the tests' emulator, on NumPy)."""
    if array_api_compat.is_cupy_namespace(spec.xp):
        import cupy

        with spec.device:
            return [None if request is None else cupy.empty(*request) for request in requests]
    xp, device = spec.xp, spec.device
    return [None if request is None else xp.empty(request[0], dtype=request[1], device=device) for request in requests]


def _zeros(spec: AttentionSpec, *requests: tuple[tuple[int, ...], Any]) -> list[Any]:
    """New arrays of zeros of these ``(shape, dtype)`` on the call's device,
    as :func:`_empties` makes its arrays."""
    if array_api_compat.is_cupy_namespace(spec.xp):
        import cupy

        with spec.device:
            return [cupy.zeros(*request) for request in requests]
    xp, device = spec.xp, spec.device
    return [xp.zeros(request[0], dtype=request[1], device=device) for request in requests]


def _scratch(spec: AttentionSpec, sizes: tuple[int, ...]) -> list[Any]:
    """Device memory for the kernels' own use within a call, pieces of these
    byte ``sizes`` (each starting :data:`SCRATCH_ALIGNMENT`-aligned) in one
    allocation: on CuPy, of one ``cupy.cuda.alloc``, which kernels take as
    they take arrays' addresses (a decode step's key ranges' outputs before
    their merge, where two ``cupy.empty`` arrays took 16 µs on an H100's
    host before the step's kernel started); on NumPy (the tests' emulator),
    views of one byte array."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += -(-size // SCRATCH_ALIGNMENT) * SCRATCH_ALIGNMENT
    if array_api_compat.is_cupy_namespace(spec.xp):
        import cupy

        with spec.device:
            memory = cupy.cuda.alloc(total)
        return [memory + start for start in starts]
    memory = np.empty(total + SCRATCH_ALIGNMENT, np.uint8)
    first = -memory.ctypes.data % SCRATCH_ALIGNMENT
    return [memory[first + start : first + start + size] for start, size in zip(starts, sizes)]


#: Bytes each piece of :func:`_scratch` starts on a multiple of (CuPy's
#: allocations' own alignment).
SCRATCH_ALIGNMENT = 256


def _shaped(xp: Any, a: Any, shape: tuple[int, ...]) -> Any:
    """``a`` in ``shape``: itself where it has it (one batch axis, the
    common case: a reshape costs ~1.5 µs on CuPy)."""
    return a if a.shape == shape else xp.reshape(a, shape)


def _grid_rows(spec: AttentionSpec, shape: LaunchShape) -> int:
    """Blocks of ``shape.rows * shape.tile`` stacked rows over one kv head's ``G * T``."""
    return -(-spec.group_size * spec.q_len // (shape.rows * shape.tile))


def _splits(spec: AttentionSpec, row_blocks: int, multiprocessors: int) -> int:
    """Key ranges for the forward (flash-decoding): 1 unless the blocks of
    one range (``row_blocks`` per kv head) would leave the GPU idle."""
    blocks = row_blocks * spec.num_kv_heads * spec.num_batch
    if blocks >= multiprocessors:
        return 1
    wanted = -(-SPLIT_BLOCKS_PER_SM * multiprocessors // blocks)
    return max(1, min(wanted, spec.kv_len // MIN_SPLIT_KEYS, MAX_GRID_YZ // spec.num_batch))


# --- forward and backward -----------------------------------------------------------


#: One kernel's launch: its name, grid and threads per block (a plain
#: tuple: a NamedTuple takes 0.3 µs more to make, on every new spec's call).
_Launch = tuple[str, tuple[int, int, int], int]


class _Plan(NamedTuple):
    """What :func:`forward` or :func:`backward` launches for one spec,
    worked out by :func:`_plan` (and kept there for a spec that recurs):
    ``launches`` of ``module``'s kernels
    (the forward's, then the merge's where the keys are cut into ``splits``
    ranges; or ``dQ``'s (with ``D``), or ``D``'s where the dK/dV kernel
    sums dQ, and ``dK``/``dV``'s); ``calls``, the
    kernels' :class:`_Call` by the rows between kv heads
    (:func:`_kv_operands`), kept where the spec has no per-batch arrays
    (whose copies, and so addresses, are a call's own); and ``scratch``,
    the bytes of the ranges' outputs before their merge (:func:`_scratch`),
    with several ranges; ``shared_bytes``, the dynamic shared memory of the
    tensor-core backward's dQ and dK/dV blocks (:func:`tensor_kept_operands`),
    or of the forward's blocks and none (:func:`tensor_kept_q`);
    ``dq_flags``, the int32 entries the tensor-core dK/dV kernel orders its
    blocks by where it sums dQ (:func:`tensor_fused_dq`: for each kv head
    its blocks' ticket counter, then a flag a tile of its stacked rows; and
    no dQ kernel launched), 0 where it does not, None for the CUDA cores'
    (which take no dQ)."""

    module: Any
    launches: tuple[_Launch, ...]
    splits: int
    calls: dict[int, _Call]
    scratch: tuple[int, ...] = ()
    shared_bytes: tuple[int, int] = (0, 0)
    dq_flags: int | None = None

    def call(self, spec: AttentionSpec, kv_head_rows: int) -> _Call:
        """The kernels' :class:`_Call` for ``spec`` (the plan's) with ``k``
        and ``v`` heads ``kv_head_rows`` rows apart."""
        call = self.calls.get(kv_head_rows)
        if call is None:
            call = _Call(spec, kv_head_rows, self.splits)
            if call.optional is _NO_ARRAYS and len(self.calls) < PLAN_CALLS:  # no address of the call's own
                self.calls[kv_head_rows] = call
        return call


#: :class:`_Call`\ s a :class:`_Plan` keeps, one per layout of ``k`` and
#: ``v`` (a KV cache's, a C-order copy's).
PLAN_CALLS = 4


def _plan(runtime: Runtime, spec: AttentionSpec, like: Any, backward: bool) -> _Plan:
    """The forward's or the backward's plan for ``spec`` on ``runtime``:
    kept for a spec that recurs (:data:`~npattn.options.RECURRING_SPECS`:
    a repeated call's, which :func:`npattn.attention.scalar_call_spec` hands
    out again) by ``NPATTN_CUPY_TENSOR_CORES``, which picks the kernels,
    and made anew for any other (a decoding loop's next step, whose keys
    grew)."""
    setting = os.environ.get("NPATTN_CUPY_TENSOR_CORES", "1")
    plans = RECURRING_SPECS.get(spec)
    plan = None if plans is None else plans.get((runtime, setting, backward))
    if plan is None:
        precision = _precision(spec, setting)
        plan = (_backward_plan if backward else _forward_plan)(runtime, spec, like, precision)
        if plans is not None:
            plans[(runtime, setting, backward)] = plan
    return plan


def _forward_plan(runtime: Runtime, spec: AttentionSpec, like: Any, precision: str | None) -> _Plan:
    """:func:`forward`'s launches on the tensor cores of ``precision``
    (None: the CUDA cores): the forward kernel's over (row blocks, kv heads,
    batch times key ranges), with the dynamic shared memory of Q's
    fragments where it keeps them there (:func:`tensor_kept_q`), and with
    several ranges the merge's, a block per row."""
    shared_bytes = (0, 0)
    if precision is None:
        shape = launch_shape(spec)
        module, kernel, threads = _module(runtime, spec, shape), "npattn_forward", BLOCK_THREADS
        row_blocks = _grid_rows(spec, shape)
    else:
        warps, q_blocks = tensor_warps(spec), tensor_kept_q(spec, precision, runtime.shared_memory(like))
        wgmma = tensor_wgmma(spec, precision, spec.device)
        module = _tensor_module(runtime, spec, precision, warps, kept=(q_blocks, 0), wgmma=wgmma)
        kernel, threads = "npattn_forward_tc", 32 * warps
        row_blocks = -(-spec.group_size * spec.q_len // (TENSOR_WARP_ROWS * warps))
        shared_bytes = (_kept_q_bytes(spec, precision) if q_blocks else 0, 0)
    B = spec.num_batch
    splits = _splits(spec, row_blocks, runtime.multiprocessors(like))
    launches: tuple[_Launch, ...] = ((kernel, (row_blocks, spec.num_kv_heads, B * splits), threads),)
    scratch: tuple[int, ...] = ()
    if splits > 1:
        rows = B * spec.num_heads * spec.q_len
        launches += (("npattn_merge_splits", (rows, 1, 1), MERGE_THREADS),)
        item = np.dtype(spec.compute_dtype).itemsize
        scratch = (splits * rows * spec.value_dim * item, splits * rows * item)  # (splits, B, N, T, Hv), (.., T)
    return _Plan(module, launches, splits, {}, scratch, shared_bytes)


def _backward_plan(runtime: Runtime, spec: AttentionSpec, like: Any, precision: str | None) -> _Plan:
    """:func:`backward`'s launches: ``dQ``'s over (row blocks, kv heads,
    batch), which writes ``D`` too, or, where the dK/dV kernel sums dQ
    (:func:`tensor_fused_dq`), ``D``'s own (a warp per row); then
    ``dK``/``dV``'s over (key blocks, kv heads, batch), with the dynamic
    shared memory of the operands they keep there on ``like``'s device."""
    B, K = spec.num_batch, spec.num_kv_heads
    shared_bytes, dq_flags = (0, 0), None
    if precision is None:
        shape = launch_shape(spec, backward=True)
        module, threads, suffix = _module(runtime, spec, shape), BLOCK_THREADS, ""
        row_blocks, key_blocks = _grid_rows(spec, shape), -(-spec.kv_len // (shape.rows * shape.tile))
    else:
        warps = TENSOR_BACKWARD_WARPS[precision]  # tensor_warps(spec, backward=True), the precision known
        shared = runtime.shared_memory(like)
        fused = tensor_fused_dq(spec, precision, shared)
        kept = (0, fused) if fused else tensor_kept_operands(spec, precision, shared)
        wgmma = tensor_wgmma(spec, precision, spec.device, backward=True)
        module = _tensor_module(
            runtime, spec, precision, warps, backward=True, kept=kept, fused_dq=bool(fused), wgmma=wgmma
        )
        dkdv_bytes = _fused_bytes(spec, precision, fused) if fused else _kept_bytes(spec, precision, kept[1])
        shared_bytes = (_kept_bytes(spec, precision, kept[0]), dkdv_bytes)
        tiles = -(-spec.group_size * spec.q_len // tensor_tile(spec, precision, backward=True))
        dq_flags = B * K * (1 + tiles) if fused else 0  # a kv head's ticket counter, then its tiles' flags
        threads, suffix, block_rows = 32 * warps, "_tc", TENSOR_WARP_ROWS * warps
        row_blocks, key_blocks = -(-spec.group_size * spec.q_len // block_rows), -(-spec.kv_len // block_rows)
    if dq_flags:
        rows = B * spec.num_heads * spec.q_len
        first: _Launch = ("npattn_backward_d", (-(-rows // (BLOCK_THREADS // 32)), 1, 1), BLOCK_THREADS)
    else:
        first = ("npattn_backward_dq" + suffix, (row_blocks, K, B), threads)
    launches = (first, ("npattn_backward_dkdv" + suffix, (key_blocks, K, B), threads))
    return _Plan(module, launches, 1, {}, shared_bytes=shared_bytes, dq_flags=dq_flags)


def forward(spec: AttentionSpec, q: Any, k: Any, v: Any, runtime: Runtime | None = None) -> tuple[Any, Any]:
    """Online-softmax forward; same contract as :func:`npattn.chunked.chunked_forward`.

    ``O = softmax(S) V`` row by row in one kernel (``npattn/cuda/forward.cu``,
    or ``tensor_forward.cu`` where :func:`tensor_precision` picks the tensor cores);
    with several key ranges (:func:`_splits`), each range's ``(O_r, lse_r)``
    merged as ``lse = logsumexp_r lse_r``, ``O = sum_r exp(lse_r - lse) O_r``.
    """
    out, lse, _ = _forward(spec, q, k, v, runtime, None)
    return out, lse


def forward_and_output(spec: AttentionSpec, q: Any, k: Any, v: Any, runtime: Runtime | None = None) -> tuple:
    """:func:`forward`'s ``(out, lse)`` and the call's output, ``out`` in
    the inputs' dtype: for float16 inputs written by the kernels beside
    ``out`` (the forward's, or the merge's with several key ranges), each
    entry rounded to nearest even as a cast of ``out`` would round it, so
    that no cast kernel runs after them; else ``out`` itself.
    :func:`npattn.attention.attention_forward` takes it where no sinks
    rescale ``out`` after the kernels.

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x = np.zeros((1, 2, 3, 8), np.float16)
    >>> spec = make_spec(x, x, x)
    >>> spec.compute_dtype, operand_dtype(spec)  # out in the first, the call's output in the second
    (dtype('float32'), dtype('float16'))
    """
    dtype = operand_dtype(spec)
    out, lse, rounded = _forward(spec, q, k, v, runtime, None if dtype == spec.compute_dtype else dtype)
    return out, lse, out if rounded is None else rounded


def _forward(spec: AttentionSpec, q: Any, k: Any, v: Any, runtime: Runtime | None, rounded_dtype: Any) -> tuple:
    """``(out, lse, out_rounded)``: :func:`forward`'s, and ``out`` again in
    ``rounded_dtype`` (float16), written by the kernel that writes ``out``
    (None where ``rounded_dtype`` is)."""
    runtime = runtime or _CUPY_RUNTIME
    xp, B, N, T, Hv = spec.xp, spec.num_batch, spec.num_heads, spec.q_len, spec.value_dim
    plan = _plan(runtime, spec, q, backward=False)
    (qc,) = _operands(spec, q)
    kc, vc, kv_head_rows = _kv_operands(spec, k, v)
    call = plan.call(spec, kv_head_rows)
    forward_launch, *merge = plan.launches
    shape = (B, N, T, Hv)
    outputs = (
        (shape, spec.compute_dtype),
        ((B, N, T), spec.compute_dtype),
        None if rounded_dtype is None else (shape, rounded_dtype),
    )
    if merge:  # each range's (O_r, lse_r): (splits, B, N, T, Hv) and (splits, B, N, T), merged into the outputs
        parts = _scratch(spec, plan.scratch)
        runtime.launch(plan.module, *forward_launch, (qc, kc, vc, *parts, None, call.config), plan.shared_bytes[0])
        out, lse, out_rounded = _empties(spec, *outputs)
        runtime.launch(plan.module, *merge[0], (*parts, out, lse, out_rounded, call.config))
    else:
        out, lse, out_rounded = _empties(spec, *outputs)
        forward_arguments = (qc, kc, vc, out, lse, out_rounded, call.config)
        runtime.launch(plan.module, *forward_launch, forward_arguments, plan.shared_bytes[0])
    bs = spec.batch_shape
    out_shape = bs + (N, T, Hv)
    out_rounded = None if out_rounded is None else _shaped(xp, out_rounded, out_shape)  # (..., N, T, Hv)
    return _shaped(xp, out, out_shape), _shaped(xp, lse, bs + (N, T)), out_rounded  # (..., N, T, Hv), (..., N, T)


def backward(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    dlse: Any | None,
    runtime: Runtime | None = None,
) -> tuple[Any, Any, Any, Any | None, dict[str, Any]]:
    """FlashAttention-2 backward; same contract as :func:`npattn.chunked.chunked_backward`,
    but for the gradients' dtype: :func:`operand_dtype` (float16 for
    float16 inputs, else the compute dtype).

    ``D = rowsum(dO * O) - dlse`` (``npattn/cuda/delta.cuh``) and ``dQ``
    (and the ALiBi slopes' per-row sums ``-sum_j dS_ij |p_i - j|``, and
    with a bias ``dS`` itself, zeros where no row sees a key, summed over
    the bias's broadcast axes here: ``(B, N, T, S)`` entries of the compute
    dtype for the call) in ``npattn_backward_dq``, then ``dK``, ``dV`` in
    ``npattn_backward_dkdv``
    (``npattn/cuda/backward.cu``; on the tensor cores their ``_tc`` twins
    of ``tensor_backward.cu``, whose dK/dV kernel sums dQ too where
    :func:`tensor_fused_dq` says, so that no dQ kernel runs and
    ``npattn_backward_d`` writes ``D`` before it).
    ``q``, ``k``, ``v`` and ``dout`` may come in the compute dtype or in
    :func:`operand_dtype`; they are read in the latter.
    """
    runtime = runtime or _CUPY_RUNTIME
    xp, B, N, K, T, S = spec.xp, spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.q_len, spec.kv_len
    H, Hv, bs = spec.head_dim, spec.value_dim, spec.batch_shape
    plan = _plan(runtime, spec, q, backward=True)
    qc, doc = _operands(spec, q, dout)
    kc, vc, kv_head_rows = _kv_operands(spec, k, v)
    bias_grad = None if spec.bias is None else _zeros(spec, ((B, N, T, S), spec.compute_dtype))[0]  # dS
    call = plan.call(spec, kv_head_rows) if bias_grad is None else _Call(spec, kv_head_rows, bias_grad=bias_grad)
    first_launch, dkdv_launch = plan.launches  # dQ's (or, where dK/dV sums dQ, D's), then dK/dV's
    grads, rows = operand_dtype(spec), ((B, N, T), spec.compute_dtype)
    D, dq, dk, dv, slope_rows = _empties(  # slope_rows: ALiBi's per-row sums, None without ALiBi
        spec,
        rows,
        None if plan.dq_flags else ((B, N, T, H), grads),
        ((B, K, S, H), grads),
        ((B, K, S, Hv), grads),
        rows if spec.alibi_slopes is not None else None,
    )
    outc, lsec, dlsec = (None if x is None else _contiguous(x) for x in (out, lse, dlse))
    inputs = (qc, kc, vc, doc, lsec, D)
    dq_shared, dkdv_shared = plan.shared_bytes
    if plan.dq_flags:  # the tensor-core dK/dV kernel sums dQ: its dQ and flags
        dq, flags = _zeros(spec, ((B, N, T, H), grads), ((plan.dq_flags,), np.int32))
        sums: tuple[Any, ...] = (dq, flags)
        runtime.launch(plan.module, *first_launch, (doc, outc, dlsec, D, call.config))
    else:
        sums = () if plan.dq_flags is None else (None, None)
        dq_arguments = (*inputs, outc, dlsec, dq, slope_rows, call.config)
        runtime.launch(plan.module, *first_launch, dq_arguments, dq_shared)
    runtime.launch(plan.module, *dkdv_launch, (*inputs, dk, dv, *sums, call.config), dkdv_shared)
    alibi_total = None if slope_rows is None else xp.reshape(xp.sum(slope_rows, axis=-1), bs + (N,))  # (..., N)
    params = param_grads_from_heads(spec, alibi_total)
    return (
        _shaped(xp, dq, bs + (N, T, H)),  # (..., N, T, H)
        _shaped(xp, dk, bs + (K, S, H)),  # (..., K, S, H)
        _shaped(xp, dv, bs + (K, S, Hv)),  # (..., K, S, Hv)
        None if bias_grad is None else _bias_grad(spec, bias_grad),
        params,
    )


def _bias_grad(spec: AttentionSpec, ds: Any) -> Any:
    """``dbias``: the dQ kernels' ``dS`` ``(B, N, T, S)`` summed over the
    bias's broadcast axes, in its shape (``spec.bias_shape``) and the
    compute dtype (as :func:`npattn.chunked.chunked_backward` returns it)."""
    xp = spec.xp
    full = xp.reshape(ds, spec.batch_shape + tuple(ds.shape[1:]))  # (..., N, T, S)
    return xp.reshape(sum_to_shape(xp, full, tuple(spec.bias.shape)), spec.bias_shape)
