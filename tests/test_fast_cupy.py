"""The fused CUDA kernels of :mod:`npattn.fast_cupy`, on the CPU and on a GPU.

On the CPU (every CI run, where g++ is present): the kernels' own source,
compiled by g++ against ``tests/cuda_emulator`` (CUDA's thread model as
fibers), run through :mod:`npattn.fast_cupy`'s own Python side with NumPy
arrays standing in for CuPy's. So the launch geometry, the score
pipeline's transcription, the key ranges of flash-decoding and the backward
kernels are checked here against the generic chunked path, in float64 to
1e-12, and by central differences directly on the kernels.
The tensor-core kernels run here too, ``cuda_emulator/ptx.h`` standing in
for their PTX (mma.sync, ldmatrix, cp.async, with PTX's fragment layouts),
in float16 and float32 against the generic path in float64.

On a GPU (``gpu`` marker, skipped without CuPy and a device): the same
option matrix through the public API, the fused kernels against the generic
chunked path on CuPy, the dropout mask against NumPy's bit for bit,
float32/float16 within the CPU tests' tolerances, the tensor-core kernels
against NumPy in float64, and bitwise determinism.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import subprocess
import sys
from importlib import resources

import numpy as np
import pytest
from cuda_emulator import build
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import FEATURES, VARIANTS, attention_cases
from test_chunked import _chunked

import npattn
from npattn import fast_cupy
from npattn.chunked import chunked_backward, chunked_forward
from npattn.options import SpecMemo, make_spec
from npattn.scores.sinks import apply_sinks, sinks_grad

# --- the emulated runtime ------------------------------------------------------------

KERNEL_ARITY = {
    "npattn_backward_d": 5,
    "npattn_merge_splits": 6,
    "npattn_forward": 7,
    "npattn_backward_dq": 11,
    "npattn_backward_dkdv": 9,
    "npattn_forward_tc": 7,
    "npattn_backward_dq_tc": 11,
    "npattn_backward_dkdv_tc": 11,
}
#: The kernels that read ``k`` and ``v`` (arguments 1 and 2) where they lie:
#: C-order rows, kv heads ``Config.kv_head_rows`` rows apart.
KV_VIEWS_READ = {
    "npattn_forward",
    "npattn_backward_dq",
    "npattn_backward_dkdv",
    "npattn_forward_tc",
    "npattn_backward_dq_tc",
    "npattn_backward_dkdv_tc",
}
#: The kernels of each kind of source (npattn.fast_cupy.SOURCES).
KIND_KERNELS = {
    "cuda_cores": (
        "npattn_forward",
        "npattn_merge_splits",
        "npattn_backward_dq",
        "npattn_backward_dkdv",
    ),
    "tensor_forward": ("npattn_forward_tc", "npattn_merge_splits"),
    "tensor_backward": ("npattn_backward_d", "npattn_backward_dq_tc", "npattn_backward_dkdv_tc"),
}
#: The emulator's stand-ins for the kernels' PTX: the tensor cores'
#: (npattn/cuda/ptx.cuh) and float16's conversions (half.cuh).
EMULATED = {
    name: os.path.join(os.path.dirname(build.__file__), stand_in)
    for name, stand_in in (("ptx.cuh", "ptx.h"), ("half.cuh", "half.h"))
}

#: One extern "C" launcher per kernel: takes CUDA's kernelParams (a pointer
#: to each argument: an array's address, or the Config struct itself) and
#: runs the grid through the emulator.
WRAPPER = r"""
template <class P>
P argument(void* a) {
  if constexpr (std::is_pointer_v<P>) return *static_cast<P*>(a);
  else return *static_cast<const std::remove_cv_t<P>*>(a);
}
template <class... P, std::size_t... I>
void call_with(void (*kernel)(P...), void** a, std::index_sequence<I...>) { kernel(argument<P>(a[I])...); }
#define EMULATED(name, arity)                                                                               \
  extern "C" void launch_##name(unsigned gx, unsigned gy, unsigned gz, unsigned threads, std::size_t shared, \
                                void** a) {                                                                 \
    cuda_emulator::launch(                                                                                  \
        dim3(gx, gy, gz), dim3(threads), [&] { call_with(name, a, std::make_index_sequence<arity>{}); }, shared); \
  }
"""


def _wrapper(kind: str) -> str:
    return WRAPPER + "\n".join(f"EMULATED({name}, {KERNEL_ARITY[name]})" for name in KIND_KERNELS[kind])


class EmulatedRuntime:
    """:class:`npattn.fast_cupy.Runtime` on the CPU: g++ and the emulator, NumPy arrays."""

    def __init__(self, multiprocessors: int = 4, shared_memory: int = 227 * 1024):
        self.count, self.shared_bytes = multiprocessors, shared_memory  # an H100's opt-in shared memory a block
        self.launches: list[tuple[str, tuple[int, int, int], int]] = []  # name, grid, threads
        self.arguments: list[tuple] = []  # each launch's arguments, as given
        self.compiled: list[dict[str, str]] = []  # each module's definitions, as compiled

    def module(self, source: str, defines: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
        self.compiled.append(dict(defines))
        folder = resources.files("npattn") / "cuda"
        kinds = [kind for kind in fast_cupy.SOURCES if source == fast_cupy.kernel_source(kind)]
        assert len(kinds) == 1, "the emulator compiles the package's own files"
        paths = [EMULATED.get(name, str(folder / name)) for name in fast_cupy.SOURCES[kinds[0]]]
        return build.build(paths, _wrapper(kinds[0]), dict(defines), f"npattn_{kinds[0]}")

    def launch(self, module, name, grid, threads, args, shared_bytes=0) -> None:
        assert len(args) == KERNEL_ARITY[name], f"{name} takes {KERNEL_ARITY[name]} arguments, got {len(args)}"
        addresses = []  # each array's address, as a kernel argument of its own
        for position, a in enumerate(args):
            assert a is None or isinstance(a, np.ndarray)
            if a is not None and not a.flags.c_contiguous:  # k and v may be views of a longer buffer
                assert name in KV_VIEWS_READ and position in (1, 2), "kernels read C-order arrays"
                assert fast_cupy._head_rows(a) is not None, "k and v: C-order rows, heads a whole number of rows apart"
            assert a is None or a.ctypes.data % fast_cupy.ALIGNMENT == 0, "a GPU faults on misaligned 16-byte reads"
            addresses.append(ctypes.c_void_p(None if a is None else a.ctypes.data))
        by_value = [a is not None and a.dtype == fast_cupy.CONFIG_DTYPE for a in args]
        assert sum(by_value) <= 1 and all(a.shape == (1,) for a, v in zip(args, by_value) if v)
        params = [a.ctypes.data if v else ctypes.addressof(x) for a, v, x in zip(args, by_value, addresses)]
        self.launches.append((name, grid, threads))
        self.arguments.append(args)
        getattr(module, f"launch_{name}")(
            *(ctypes.c_uint(x) for x in (*grid, threads)),
            ctypes.c_size_t(shared_bytes),
            (ctypes.c_void_p * len(params))(*params),
        )

    def multiprocessors(self, like) -> int:
        return self.count

    def shared_memory(self, like) -> int:
        return self.shared_bytes


emulated = pytest.mark.skipif(not build.available(), reason="no working g++ to build the CUDA emulator")


# --- problems ----------------------------------------------------------------------------


def _problem(rng_seed=0, batch=(2,), N=2, K=2, T=11, S=13, H=8, Hv=6, dtype=np.float64, **options):
    rng = np.random.default_rng(rng_seed)
    q = rng.standard_normal((*batch, N, T, H)).astype(dtype)
    k = rng.standard_normal((*batch, K, S, H)).astype(dtype)
    v = rng.standard_normal((*batch, K, S, Hv)).astype(dtype)
    return q, k, v, options


def _segments(rng, batch, length, documents):
    cuts = np.sort(rng.integers(0, documents, size=(*batch, length)), axis=-1)
    return cuts.astype(np.int64)


_SEGMENT_RNG = np.random.default_rng(5)


def _mask(shape, keep=0.6, seed=6):
    """A boolean mask of ``shape`` (True = may attend), each entry kept with probability ``keep``."""
    return np.random.default_rng(seed).random(shape) < keep


def _bias(shape, hidden=0.0, seed=8):
    """A float64 bias of ``shape``, standard normal, each entry -inf (hidden) with probability ``hidden``."""
    rng = np.random.default_rng(seed)
    return np.where(rng.random(shape) < hidden, -np.inf, rng.standard_normal(shape))


def _with_rows_hidden(a, rows):
    """``a``, a mask or a bias, with every key of these ``rows`` (index tuples) hidden: fully masked rows."""
    for row in rows:
        a[row] = False if a.dtype == bool else -np.inf
    return a


#: name -> shape keywords and attention options; every option the kernels take.
CASES = {
    "plain": dict(T=37, S=45),
    "causal": dict(T=40, S=40, causal=True),
    "gqa causal bottom_right": dict(N=4, K=2, T=20, S=33, causal=True, align="bottom_right"),
    "window": dict(T=40, S=40, window=(5, 3)),
    "lengths bottom_right": dict(
        T=30, S=40, causal=True, align="bottom_right", q_lengths=np.array([30, 0]), kv_lengths=np.array([17, 40])
    ),
    "segments": dict(
        T=24,
        S=24,
        q_segment_ids=_segments(_SEGMENT_RNG, (2,), 24, 3),
        kv_segment_ids=_segments(_SEGMENT_RNG, (2,), 24, 3),
    ),
    "softcap alibi sinks": dict(
        N=4, K=2, T=21, S=21, causal=True, softcap=2.0, alibi_slopes=np.array([0.5, 0.25, 0.1, 0.0]), sinks=np.ones(4)
    ),
    "dropout": dict(T=19, S=23, causal=True, align="top_left", dropout_p=0.3, seed=7),
    "mqa odd dims": dict(N=3, K=1, H=3, Hv=5, T=9, S=17, window=(None, 2), align="top_left"),
    "wide heads": dict(batch=(1,), N=2, K=1, T=40, S=33, H=72, Hv=80, causal=True, align="bottom_right"),
    "many blocks window": dict(batch=(1,), N=4, K=1, T=90, S=90, H=4, Hv=4, window=(20, 0)),
    "decode splits": dict(batch=(1,), N=4, K=2, T=1, S=700, causal=True, align="bottom_right"),
    # the first key range sees nothing (its lse -inf), and then no range does
    "decode splits window": dict(batch=(1,), N=4, K=2, T=1, S=700, window=(100, 0), align="bottom_right"),
    "decode splits no keys": dict(
        batch=(1,), N=4, K=2, T=1, S=700, causal=True, align="bottom_right", kv_lengths=np.array([0])
    ),
    "scale and 3-d": dict(batch=(), T=12, S=10, scale=0.3),
    # the user's mask: over the batch, one row of it hiding every key; over the heads of a GQA group;
    # over the keys of a decode step, hiding the first key range's and others
    "mask": dict(
        T=21, S=30, causal=True, align="bottom_right", mask=_with_rows_hidden(_mask((2, 1, 21, 30)), [(0, 0, 3)])
    ),
    "mask per head": dict(N=4, K=2, T=20, S=33, mask=_mask((4, 1, 33), keep=0.5)),
    "decode splits mask": dict(
        batch=(1,), N=4, K=2, T=1, S=700, causal=True, align="bottom_right", mask=_mask(700) & (np.arange(700) >= 400)
    ),
    # the user's bias (dbias summed over its broadcast axes): -inf entries hiding keys, and every key of
    # batch 1's row 5; over the batch and the rows, per head of a GQA group; with every other unit
    "bias": dict(
        T=21, S=30, causal=True, align="bottom_right", bias=_with_rows_hidden(_bias((2, 1, 21, 30), 0.2), [(1, 0, 5)])
    ),
    "bias per head": dict(N=4, K=2, T=20, S=33, bias=_bias((4, 1, 33))),
    "bias with every unit": dict(
        N=4,
        K=2,
        T=19,
        S=23,
        causal=True,
        align="top_left",
        softcap=2.0,
        alibi_slopes=np.array([0.5, 0.25, 0.1, 0.0]),
        dropout_p=0.3,
        seed=7,
        mask=_mask((2, 1, 19, 23), keep=0.8),
        bias=_bias((19, 23), hidden=0.1),
    ),
    "decode splits bias": dict(batch=(1,), N=4, K=2, T=1, S=700, causal=True, align="bottom_right", bias=_bias(700)),
}


def _spec(q, k, v, options):
    return make_spec(q, k, v, impl="chunked", **{name: value for name, value in options.items() if name != "sinks"})


def _both_paths(case: str, dtype=np.float64, dlse=True):
    """``(fused, generic, runtime)``: (out, lse, dq, dk, dv, dbias, params) of
    the emulated kernels and of the generic path, and the emulated runtime
    (its launches)."""
    q, k, v, options = _problem(dtype=dtype, **CASES[case])
    spec = _spec(q, k, v, options)
    rng = np.random.default_rng(1)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1])).astype(dtype)
    g_lse = rng.standard_normal(q.shape[:-1]).astype(dtype) if dlse else None
    runtime = EmulatedRuntime()
    out, lse = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    fused = (out, lse, *fast_cupy.backward(spec, q, k, v, out, lse, dout, g_lse, runtime=runtime))
    out, lse = chunked_forward(spec, q, k, v)
    generic = (out, lse, *chunked_backward(spec, q, k, v, out, lse, dout, g_lse))
    return fused, generic, runtime


NAMES = ("out", "lse", "dq", "dk", "dv", "dbias", "params")


def _assert_close(fused, generic, rtol, atol):
    for name, a, b in zip(NAMES, fused, generic):
        if name == "params":
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_allclose(a[key], b[key], rtol=rtol, atol=atol, err_msg=key)
        elif b is None:
            assert a is None, name
        else:
            assert a.shape == b.shape and a.dtype == b.dtype, (name, a.shape, b.shape, a.dtype, b.dtype)
            assert not np.isnan(a).any(), f"{name} has NaN"
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)


# --- on the CPU, through the emulator ------------------------------------------------------


@emulated
@pytest.mark.parametrize("case", list(CASES))
def test_emulated_kernels_match_generic_float64(case):
    fused, generic, _ = _both_paths(case)
    _assert_close(fused, generic, rtol=1e-12, atol=1e-12)


@emulated
@pytest.mark.parametrize("case", ["plain", "softcap alibi sinks", "lengths bottom_right", "mqa odd dims"])
def test_emulated_kernels_match_generic_float32(case):
    """float32 takes other launch shapes (one lane per row in the forward)."""
    fused, generic, _ = _both_paths(case, dtype=np.float32)
    _assert_close(fused, generic, rtol=2e-4, atol=2e-5)


#: The cases of CASES on the tensor-core kernels (``H`` and ``Hv`` multiples
#: of 16), decoding steps among them (the forward in blocks of one warp,
#: its keys split); and some of their own: long enough for whole tiles
#: (every key of a 64-key tile seen by a warp's rows, and a 64-row tile
#: seeing a warp's 16 keys: the kernels' fast paths) beside the boundary
#: tiles, and a forward in blocks of two warps.
TENSOR_CASES = {
    name: {**CASES.get(name, {}), "H": 16, "Hv": 32, **extra}
    for name, extra in {
        "plain": {},
        "causal": {},
        "gqa causal bottom_right": {},
        "window": {},
        "lengths bottom_right": dict(N=2, K=1),
        "segments": dict(N=4, K=2),
        "softcap alibi sinks": {},
        "dropout": dict(N=4, K=2),
        "wide heads": dict(H=80, Hv=48),
        # an odd number of 8-column blocks (float32 and float64): the last one's B loaded alone
        "odd eighths": dict(H=24, Hv=40),
        # forward tiles halved so that two fit (tensor_tile): 32 keys in float32, 16 in float64
        "big heads": dict(batch=(1,), N=2, K=1, T=40, S=100, H=64, Hv=64, causal=True, align="bottom_right"),
        # 32 keys in float16, 16 in float32
        "widest heads": dict(batch=(1,), N=2, K=1, T=20, S=90, H=128, Hv=128),
        "many blocks window": dict(H=16, Hv=16),
        "decode splits": {},
        "decode splits window": {},
        "decode splits no keys": {},
        "whole tiles causal": dict(batch=(1,), N=2, K=1, T=150, S=150, causal=True),
        "whole tiles full": dict(batch=(1,), N=2, K=2, T=70, S=200),
        # 64 stacked rows against 700 keys: too few blocks, so the keys split (merge.cu)
        "key splits": dict(batch=(1,), N=4, K=1, T=16, S=700, causal=True, align="bottom_right"),
        # 28 stacked rows a kv head: blocks of two warps, the second one's last rows past the end
        "two warps": dict(N=4, K=1, T=7, S=90, window=(30, 0), align="bottom_right"),
        # scores hundreds apart: exp2's arguments past -1022 (float64's flushed to 0), and past -126
        "peaked scores": dict(batch=(1,), N=2, K=1, T=40, S=70, scale=60.0),
        "mask": {},
        "mask per head": {},
        "decode splits mask": {},
        "bias": {},
        "bias per head": {},
        "bias with every unit": {},
        "decode splits bias": {},
        # a bias hiding no key: its tiles test each score all the same (an entry might be -inf)
        "whole tiles bias": dict(batch=(1,), N=2, K=2, T=70, S=200, bias=_bias((2, 1, 200))),
        # a mask hiding a few keys of tiles every row's range takes whole: no tile skips the test per score
        "whole tiles mask": dict(batch=(1,), N=2, K=2, T=70, S=200, mask=_mask((70, 200), keep=0.97)),
    }.items()
}

#: Largest error of each tensor-core precision against float64, as a
#: fraction of the array's largest entry: float16 rounds the inputs, P and
#: dS to 11 bits; 3xTF32 keeps about 21 bits a product, and float32's sums
#: over thousands of terms (the ALiBi slopes' gradient sums T * S) lose some
#: more: within the CPU tests' float32 tolerance (rtol 2e-4).
TENSOR_TOLERANCE = {"f16": 3e-3, "tf32x3": 1e-4, "f64": 1e-12}

#: How many times the generic path's own float32 error (against float64) a
#: tensor-core result may be off, where that is above TENSOR_TOLERANCE.
FLOAT32_LOSS = 4


def _tensor_paths(case: str, dtype, cases=TENSOR_CASES, runtime=None):
    """The fused kernels (emulated, on ``runtime`` or a new
    EmulatedRuntime; the tensor cores for TENSOR_CASES) on ``dtype`` inputs,
    and the generic path in float64 on the same values: (out, lse, dq, dk,
    dv, the ALiBi slopes' gradient or None, the bias's or None) each, the
    launched kernels' names and the tensor cores' precision chosen."""
    q, k, v, options = _problem(dtype=dtype, **cases[case])
    spec = _spec(q, k, v, options)
    rng = np.random.default_rng(1)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1]))
    g_lse = rng.standard_normal(q.shape[:-1])
    runtime = runtime or EmulatedRuntime()
    operand = fast_cupy.operand_dtype(spec)  # float16 stays float16, as forward_from_spec passes it
    assert q.dtype == operand
    out, lse = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    dq, dk, dv, dbias, params = fast_cupy.backward(
        spec, q, k, v, out, lse, dout.astype(operand), g_lse.astype(spec.compute_dtype), runtime=runtime
    )
    assert out.dtype == lse.dtype == spec.compute_dtype and dq.dtype == dk.dtype == dv.dtype == operand
    fused = (out, lse, dq, dk, dv, params.get("alibi_slopes"), dbias)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    spec64 = _spec(q64, k64, v64, options)
    out, lse = chunked_forward(spec64, q64, k64, v64)
    dq, dk, dv, dbias, params = chunked_backward(spec64, q64, k64, v64, out, lse, dout, g_lse)
    exact = (out, lse, dq, dk, dv, params.get("alibi_slopes"), dbias)
    return fused, exact, [name for name, *_ in runtime.launches], fast_cupy.tensor_precision(spec)


def _assert_within(fused, exact, tolerance):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dalibi_slopes", "dbias"), fused, exact):
        if b is None:
            assert a is None, name
            continue
        a, b = np.asarray(a), np.asarray(b)
        seen = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), seen), f"{name}: -inf (a row that sees no key) in other places"
        scale = max(1.0, float(np.max(np.abs(b[seen]), initial=0.0)))
        np.testing.assert_allclose(a[seen], b[seen], rtol=0, atol=tolerance * scale, err_msg=name)


#: Each precision of the tensor cores by input dtype, and the widest head it takes.
TENSOR_DTYPES = [
    (np.float16, "f16", fast_cupy.TENSOR_MAX_HEAD_DIM),
    (np.float32, "tf32x3", fast_cupy.TENSOR_MAX_HEAD_DIM),
    (np.float64, "f64", fast_cupy.TENSOR_F64_MAX_HEAD_DIM),
]

#: The (case, dtype, precision) of every tensor-core kernel the cases reach
#: (float16 takes heads in steps of 16).
TENSOR_MATRIX = [
    (case, dtype, precision)
    for case, options in TENSOR_CASES.items()
    for dtype, precision, widest in TENSOR_DTYPES
    if max(options["H"], options["Hv"]) <= widest
    and not (precision == "f16" and (options["H"] % 16 or options["Hv"] % 16))
]


@emulated
@pytest.mark.parametrize("case, dtype, precision", TENSOR_MATRIX)
def test_emulated_tensor_cores_match_float64(case, dtype, precision):
    """The tensor-core kernels' operand layouts, key order and score
    pipeline, through the emulated mma.sync, against the generic path in
    float64: every option the kernels take, in each precision."""
    fused, exact, launched, chosen = _tensor_paths(case, dtype)
    assert chosen == precision
    merged = ["npattn_merge_splits"] if "splits" in case else []
    assert launched == [
        "npattn_forward_tc",
        *merged,
        "npattn_backward_dq_tc",
        "npattn_backward_dkdv_tc",
    ]
    _assert_within(fused, exact, TENSOR_TOLERANCE[precision])


@emulated
@pytest.mark.parametrize("case, dtype, precision", TENSOR_MATRIX)
def test_emulated_forward_with_one_key_and_one_value_tile(monkeypatch, case, dtype, precision):
    """The forward's pipeline of one key tile and one value tile
    (``TC_SPLIT_STAGES``, split_pipelined_tiles), which float64 takes where
    two tiles of 32 keys do not fit (H=Hv=64), forced for every case and
    precision, through _tensor_paths as test_emulated_tensor_cores_match_float64
    (the backward reading its outputs)."""
    monkeypatch.setattr(fast_cupy, "tensor_split_stages", lambda spec, precision: True)
    built, compile_module = [], EmulatedRuntime.module

    def module(runtime, source, defines):
        built.append(dict(defines))
        return compile_module(runtime, source, defines)

    monkeypatch.setattr(EmulatedRuntime, "module", module)
    fused, exact, _, chosen = _tensor_paths(case, dtype)
    assert chosen == precision
    assert [defines["TC_SPLIT_STAGES"] for defines in built if "TC_SPLIT_STAGES" in defines] == ["1"]
    _assert_within(fused, exact, TENSOR_TOLERANCE[precision])


#: The backward's operands kept in shared memory (TC_KEPT_DQ, TC_KEPT_DKDV)
#: forced, in every case and precision: both in both kernels, and the first
#: in each (the kernels read theirs apart, so these cover every count the
#: table ships: float16's dK/dV both or one, float32's one, float64's dQ one
#: and dK/dV both).
KEPT_MATRIX = [(case, dtype, precision, (n, n)) for n in (2, 1) for case, dtype, precision in TENSOR_MATRIX]


@emulated
@pytest.mark.parametrize("case, dtype, precision, kept", KEPT_MATRIX)
def test_emulated_backward_with_operands_kept_in_shared_memory(monkeypatch, case, dtype, precision, kept):
    """The tensor-core backward with the first ``kept`` A operands of dQ (Q
    then dO) and of dK/dV (K then V) read from dynamic shared memory
    (``TC_KEPT_DQ``, ``TC_KEPT_DKDV``, operands.cuh's RowOperand) rather
    than registers, through _tensor_paths as
    test_emulated_tensor_cores_match_float64; dQ and dK/dV launched with
    that memory, the other kernels with none."""
    monkeypatch.setattr(fast_cupy, "tensor_kept_operands", lambda spec, precision, shared_memory: kept)
    launched = []
    launch = EmulatedRuntime.launch

    def recorded(runtime, module, name, grid, threads, args, shared_bytes=0):
        launched.append((name, shared_bytes))
        launch(runtime, module, name, grid, threads, args, shared_bytes)

    monkeypatch.setattr(EmulatedRuntime, "launch", recorded)
    fused, exact, _, chosen = _tensor_paths(case, dtype)
    assert chosen == precision
    threads = 32 * fast_cupy.TENSOR_BACKWARD_WARPS[precision]
    expected = [
        threads
        * sum((TENSOR_CASES[case]["H"], TENSOR_CASES[case]["Hv"])[:n])
        // (16 if precision == "f16" else 8)
        * {"f16": 16, "tf32x3": 16, "f64": 32}[precision]
        for n in kept
    ]
    dq_dkdv = ("npattn_backward_dq", "npattn_backward_dkdv")  # the backward's two kernels (D is dQ's)
    assert [shared for name, shared in launched if name.startswith(dq_dkdv)] == expected
    assert all(shared == 0 for name, shared in launched if name.startswith(("npattn_forward", "npattn_merge")))
    _assert_within(fused, exact, TENSOR_TOLERANCE[precision])


def test_backward_keeps_the_operands_that_fit_the_devices_shared_memory(monkeypatch):
    """Wanting both operands kept in both kernels, float64's backward keeps
    them where a block's shared memory takes them (an H100's 227 KiB, an
    A100's 163), one at 99 KiB, none at CUDA's portable 48; float16 where
    the blocks its registers allow a multiprocessor (3 of dQ, 2 of dK/dV)
    fit its shared memory, fewer elsewhere. As shipped
    (``TENSOR_KEPT_OPERANDS``, as timed on an H100): float64 one in dQ and
    both in dK/dV, float16 both in dK/dV at heads up to 64 and one over,
    float32 one in dK/dV at heads up to 64 and, over, one in dQ and both in
    dK/dV (an A100's blocks take one); none in float16's dQ. A plan's dQ
    and dK/dV get that memory, and the module its TC_KEPT_DQ and
    TC_KEPT_DKDV."""

    def plan(kib, dtype, H):
        runtime = EmulatedRuntime(shared_memory=kib * 1024)
        runtime.module = lambda source, defines: dict(defines)  # the plan alone, nothing built
        x = np.zeros((1, 2, 64, H), dtype)
        spec = make_spec(x, x, x)
        found = fast_cupy._backward_plan(runtime, spec, x, fast_cupy.tensor_precision(spec))
        return (int(found.module["TC_KEPT_DQ"]), int(found.module["TC_KEPT_DKDV"])), found.shared_bytes

    assert plan(227, np.float64, 64) == ((1, 2), (256 * 8 * 32, 256 * 8 * 2 * 32))
    assert plan(227, np.float16, 64) == ((0, 2), (0, 128 * 8 * 16))
    assert plan(227, np.float16, 128) == ((0, 1), (0, 128 * 8 * 16))
    assert plan(227, np.float32, 64) == ((0, 1), (0, 128 * 8 * 16))
    assert plan(227, np.float32, 128) == ((1, 2), (128 * 16 * 16, 128 * 32 * 16))
    assert plan(163, np.float32, 128) == ((1, 1), (128 * 16 * 16,) * 2)
    wanted = {precision: ((2, 2), (2, 2)) for precision in fast_cupy.TENSOR_KEPT_OPERANDS}
    monkeypatch.setattr(fast_cupy, "TENSOR_KEPT_OPERANDS", wanted)
    for kib, kept in ((227, 2), (163, 2), (99, 1), (48, 0)):
        assert plan(kib, np.float64, 64) == ((kept, kept), (256 * 8 * kept * 32,) * 2)
    assert plan(227, np.float16, 64) == plan(163, np.float16, 64) == ((2, 2), (128 * 8 * 16,) * 2)
    assert plan(163, np.float16, 128) == ((1, 2), (128 * 8 * 16, 128 * 16 * 16))
    assert plan(99, np.float16, 64) == plan(99, np.float16, 128) == ((0, 0), (0, 0))


#: The float64 cases of TENSOR_MATRIX, whose dK/dV kernel can sum dQ
#: (TC_FUSED_DQ), each with V kept in shared memory (2, as on an H100 at
#: H=Hv=64) and in registers (1: an A100's, whose blocks take the keys alone).
FUSED_DQ_MATRIX = [(case, kept) for case, dtype, _ in TENSOR_MATRIX if dtype == np.float64 for kept in (2, 1)]


@emulated
@pytest.mark.parametrize("order", ["blockIdx", "reversed"])
@pytest.mark.parametrize("case, kept", FUSED_DQ_MATRIX)
def test_emulated_dkdv_kernel_sums_dq_in_order(monkeypatch, case, kept, order):
    """float64's dK/dV kernel summing dQ (``TC_FUSED_DQ``, forced: not yet
    shipped), through _tensor_paths as test_emulated_tensor_cores_match_float64:
    no dQ kernel for a call with plain scores (the others keep it), the
    plan's dynamic shared memory the keys' and dR's tiles, the kept shares
    and V's fragments where kept; each key block found the block before's
    flags released where it waited (the emulator's wait_for_flag aborts
    otherwise), with the emulator's blocks run in blockIdx order and in the
    reverse (the last block first: each block takes its keys by the order
    its kv head's blocks started in, so that no order of starting them
    leaves a block waiting for one that has not started); every block took
    a ticket, and, with a causal mask or none, each tile's flag ends at 1 +
    the last key block that added into it (fused_tiles, mirrored by
    _last_key_blocks)."""
    if order == "reversed":
        monkeypatch.setenv("CUDA_EMULATOR_BLOCK_ORDER", "reversed")
    fused_dq = fast_cupy.tensor_fused_dq
    monkeypatch.setattr(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"}))
    monkeypatch.setattr(fast_cupy, "tensor_fused_dq", lambda *arguments: fused_dq(*arguments) and kept)
    runtime = EmulatedRuntime()
    fused, exact, launched, chosen = _tensor_paths(case, np.float64, runtime=runtime)
    assert chosen == "f64"
    q, k, v, options = _problem(**TENSOR_CASES[case])
    spec = _spec(q, k, v, options)
    summed = fast_cupy.plain_scores(spec)
    assert ("npattn_backward_dq_tc" in launched) != summed
    _assert_within(fused, exact, TENSOR_TOLERANCE["f64"])
    if not summed:
        return
    (index,) = [i for i, (name, *_) in enumerate(runtime.launches) if name == "npattn_backward_dkdv_tc"]
    dq, flags = runtime.arguments[index][8:10]
    assert np.shares_memory(dq, fused[2]) and flags.dtype == np.int32
    plan = fast_cupy._backward_plan(runtime, spec, None, "f64")
    assert plan.dq_flags == flags.size and plan.shared_bytes == (0, fast_cupy._fused_bytes(spec, "f64", kept))
    key_blocks, kv_heads, batch = runtime.launches[index][1]
    by_head = flags.reshape(batch, kv_heads, -1)  # each kv head's ticket counter, then its tiles' flags
    assert (by_head[..., 0] == key_blocks).all()  # a ticket each block
    flags = by_head[..., 1:]
    if set(options) <= {"causal", "align", "scale"}:  # no window or lengths: _last_key_blocks' mirror
        tile = fast_cupy.tensor_tile(spec, "f64", backward=True)
        expected = _last_key_blocks(spec, options, tile) + 1
        assert (expected > 0).any()
        np.testing.assert_array_equal(flags.reshape(expected.shape)[expected > 0], expected[expected > 0])


def _last_key_blocks(spec, options, tile: int) -> np.ndarray:
    """The last key block (16 keys a warp) that adds into each tile of
    ``tile`` stacked rows of each (batch element, kv head), as fused_tiles
    reads query_range, for a causal mask or none (-1 where none does)."""
    B, K, G, T, S = spec.num_batch, spec.num_kv_heads, spec.group_size, spec.q_len, spec.kv_len
    rows = 16 * fast_cupy.TENSOR_BACKWARD_WARPS["f64"]
    offset = S - T if options.get("align") == "bottom_right" else 0
    last = np.full((B, K, -(-G * T // tile)), -1)
    for block in range(-(-S // rows)):
        first = max(0, block * rows - offset) if options.get("causal") else 0  # key j seen by rows j - offset on
        if first < T:
            last[:, :, first * G // tile : -(-T * G // tile)] = block
    return last


@emulated
@pytest.mark.parametrize("case, dtype, precision", TENSOR_MATRIX)
def test_emulated_forward_keeps_q_in_shared_memory(monkeypatch, case, dtype, precision):
    """The tensor-core forward with Q's fragments kept in dynamic shared
    memory (``TC_KEPT_Q``, forced at 3 blocks a multiprocessor: not yet
    shipped) writes the same bits of ``out`` and ``lse`` as with Q in
    registers (the same products in the same order), its plan the dynamic
    shared memory of 4 warps' 16 rows of Q each; a decode step's blocks of
    fewer warps and heads over 64 keep Q in registers, and so does a GPU
    on which 3 such blocks would not fit (16 KiB a block, here)."""
    q, k, v, options = _problem(dtype=dtype, **TENSOR_CASES[case])
    spec = _spec(q, k, v, options)
    runtime = EmulatedRuntime()
    in_registers = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    monkeypatch.setattr(fast_cupy, "TENSOR_KEPT_Q", {precision: 3})
    plan = fast_cupy._forward_plan(runtime, spec, q, precision)
    kept = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    for a, b in zip(kept, in_registers):
        np.testing.assert_array_equal(a, b)
    keeps = fast_cupy.tensor_warps(spec) == 4 and max(spec.head_dim, spec.value_dim) <= 64
    q_bytes = 4 * 16 * spec.head_dim * fast_cupy.TENSOR_PRECISIONS[precision][1]
    assert plan.shared_bytes == ((q_bytes if keeps else 0), 0)
    assert fast_cupy._forward_plan(EmulatedRuntime(shared_memory=16 * 1024), spec, q, precision).shared_bytes[0] == 0


#: The tensor-core cases but those about head sizes, each run at H = Hv =
#: 64, the heads the float16 kernels on wgmma take (a decode step's forward,
#: in blocks of fewer warps, does not).
WGMMA_CASES = [case for case in TENSOR_CASES if case not in ("widest heads", "odd eighths", "wide heads")]


@emulated
@pytest.mark.parametrize("case", WGMMA_CASES)
def test_emulated_kernels_on_wgmma_write_the_same_bits(monkeypatch, case):
    """The float16 kernels on sm_90a's warpgroup tensor cores (``TC_WGMMA``,
    forced: not yet shipped), which read their tiles in the 128-byte swizzle
    through descriptors (the emulator reads each entry where the canonical
    layout and the swizzle of its address put it), write the same bits of
    ``out``, ``lse`` and the gradients as on ``mma.sync`` (the same
    products, each 16-term sum in the same order), at H = Hv = 64 in every
    case with blocks of 4 warps; a decode step's forward, in blocks of fewer
    warps, and a GPU other than compute capability 9.0, keep ``mma.sync``."""
    q, k, v, options = _problem(dtype=np.float16, **{**TENSOR_CASES[case], "H": 64, "Hv": 64})
    spec = _spec(q, k, v, options)
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)

    def both(runtime):
        out, lse = fast_cupy.forward(spec, q, k, v, runtime=runtime)
        return out, lse, *fast_cupy.backward(spec, q, k, v, out, lse, dout, None, runtime=runtime)[:4]

    runtime = EmulatedRuntime()
    on_mma = both(runtime)
    monkeypatch.setattr(fast_cupy, "TENSOR_WGMMA", {"f16": (True, True)})
    on_wgmma = both(runtime)
    for a, b in zip(on_wgmma, on_mma):
        np.testing.assert_array_equal(a, b)
    forward = fast_cupy.tensor_warps(spec) == 4
    assert [fast_cupy.tensor_wgmma(spec, "f16", spec.device, backward) for backward in (False, True)] == [forward, True]
    assert [defines.get("TC_WGMMA") for defines in runtime.compiled] == [None, None] + ["1"] * (1 + forward)
    hopper, ampere = (type("Device", (), {"compute_capability": c})() for c in ("90", "80"))
    assert fast_cupy.tensor_wgmma(spec, "f16", hopper, True) and not fast_cupy.tensor_wgmma(spec, "f16", ampere, True)


@emulated
@pytest.mark.parametrize("case", ["plain", "decode splits", "mqa odd dims", "softcap alibi sinks", "dropout"])
def test_emulated_cuda_cores_read_float16_as_it_is(case, monkeypatch):
    """The CUDA-core kernels read float16 inputs as float16 too (decoding,
    heads the tensor cores do not take; ``H=3, Hv=5`` entry by entry) and
    write float16 gradients, summing in float32: float64's values within
    float16's rounding of the gradients."""
    monkeypatch.setenv("NPATTN_CUPY_TENSOR_CORES", "0")
    fused, exact, launched, precision = _tensor_paths(case, np.float16, CASES)
    assert precision is None and launched[0] == "npattn_forward" and launched[-1] == "npattn_backward_dkdv"
    _assert_within(fused, exact, 1e-3)


def test_tensor_precision_by_dtype_dims_and_rows(monkeypatch):
    def precision(dtype, T=64, H=64, Hv=64, N=1):
        q, k, v, _ = _problem(batch=(1,), N=N, K=1, T=T, S=8, H=H, Hv=Hv, dtype=dtype)
        return fast_cupy.tensor_precision(make_spec(q, k, v))

    assert precision(np.float16) == "f16" and precision(np.float32) == "tf32x3" and precision(np.float64) == "f64"
    assert precision(np.float64, H=72, Hv=72) is None and precision(np.float64, Hv=12) is None
    assert precision(np.float16, H=24) is None and precision(np.float32, H=24) == "tf32x3"
    assert precision(np.float32, Hv=12) is None and precision(np.float16, H=144, Hv=144) is None
    assert precision(np.float16, T=1, N=8) == "f16" and precision(np.float32, T=1) == "tf32x3"  # decoding
    monkeypatch.setenv("NPATTN_CUPY_TENSOR_CORES", "0")
    assert precision(np.float16) is None


@emulated
def test_decoding_on_the_tensor_cores_in_one_warp_blocks():
    """A decode step's forward (2 stacked rows a kv head) in blocks of one
    warp on the tensor cores, its keys split among them and merged (the
    values: test_emulated_tensor_cores_match_float64's decode cases); the
    backward in blocks of four."""
    q, k, v, options = _problem(dtype=np.float16, **TENSOR_CASES["decode splits"])
    runtime = EmulatedRuntime()
    spec = _spec(q, k, v, options)
    out, lse = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    fast_cupy.backward(spec, q, k, v, out, lse, np.ones(out.shape, np.float16), None, runtime=runtime)
    (forward, grid, threads), (merge, *_), *backward = runtime.launches
    assert (forward, merge, threads) == ("npattn_forward_tc", "npattn_merge_splits", 32) and grid[2] > 1
    assert [threads for name, _, threads in backward if name.endswith("_tc")] == [128, 128]


#: exp2.cuh's fast_exp2(double) of each of n entries (with PRECISION and
#: PRECISION_F64 defined as ptx.cuh defines them), and its launch on the emulator.
EXP2_DEFINES = {"PRECISION": "3", "PRECISION_F64": "3"}
EXP2_KERNEL = r"""
extern "C" __global__ void exp2_each(const double* x, double* y, long long n) {
  load_exp2_table();
  for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = fast_exp2(x[i]);
}
"""
EXP2_LAUNCH = r"""
extern "C" void run_exp2(const double* x, double* y, long long n) {
  cuda_emulator::launch(dim3(3), dim3(64), [&] { exp2_each(x, y, n); });
}
"""


def _float64_exp2(x: np.ndarray) -> np.ndarray:
    """exp2.cuh's fast_exp2(double) of each entry, run by the emulator."""
    source = resources.files("npattn") / "cuda" / "exp2.cuh"
    library = build.build([str(source)], EXP2_KERNEL + EXP2_LAUNCH, EXP2_DEFINES, "exp2")
    y = np.full_like(x, -1.0)
    library.run_exp2(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_longlong(x.size))
    return y


def _exp2_arguments() -> np.ndarray:
    """Where fast_exp2(double) must be within an ulp: across its range, the
    softmax's [-1, 0], and on both sides of each point where rint(16 x) turns."""
    rng = np.random.default_rng(7)
    sixteenths = np.arange(-1022 * 16, 1024 * 16) / 16.0
    x = np.concatenate(
        [
            rng.uniform(-1022.0, 1024.0, 100_000),
            rng.uniform(-1.0, 0.0, 50_000),  # the softmax's arguments: s - m <= 0
            sixteenths[:-1],
            sixteenths + 1 / 32,
            np.nextafter(sixteenths + 1 / 32, -np.inf),
            np.nextafter(sixteenths + 1 / 32, np.inf),
            [-1022.0, 0.0, -0.0, 1e-300, -1e-300, 5e-324, np.nextafter(1024.0, 0.0)],
        ]
    )
    return x[(x >= -1022.0) & (x < 1024.0)]


#: Arguments past the range, and what fast_exp2(double) gives for them.
EXP2_EDGES = (
    np.array([-1022.0 - 2**-40, -1075.0, -1e10, -np.inf, 1024.0, 1e10, np.inf, np.nan]),
    [0, 0, 0, 0, np.inf, np.inf, np.inf, np.nan],
)


def _ulps(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    """|y - 2^x| in units in the last place of 2^x in float64 (2^x in long double)."""
    exact = np.exp2(x.astype(np.longdouble))
    return np.abs(y - exact) / np.spacing(exact.astype(np.float64))


@emulated
@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs an 80-bit or wider long double as reference")
def test_float64_exp2_within_an_ulp():
    """The float64 kernels' 2^x (exp2.cuh: a table of 2^(j/16) and a degree-7
    polynomial) within 1.1 ulp of 2^x in long double wherever the result is
    a normal float64, at the table's boundaries and across the range; flushed
    to 0 below 2^-1022, inf from 2^1024, NaN for NaN."""
    x = _exp2_arguments()
    ulps = _ulps(_float64_exp2(x), x)
    assert ulps.max() <= 1.1, (x[ulps.argmax()], ulps.max())
    np.testing.assert_array_equal(_float64_exp2(EXP2_EDGES[0]), EXP2_EDGES[1])


def test_float64_exp2_tables_are_correctly_rounded():
    """exp2.cuh's constants: 2^(j/16) and (ln 2)^i / i!, each the float64
    nearest the 60-digit value."""
    from decimal import Decimal, localcontext

    text = (resources.files("npattn") / "cuda" / "exp2.cuh").read_text()

    def table(name: str) -> list[float]:
        body = re.search(name + r"\[\d+\] = \{(.*?)\};", text, re.S).group(1)
        return [float.fromhex(item) for item in re.findall(r"0x[0-9a-f.]+p[-+]\d+", body)]

    with localcontext() as decimal:
        decimal.prec = 60
        sixteenths = [float(Decimal(2) ** (Decimal(j) / 16)) for j in range(16)]
        taylor, term = [], Decimal(1)
        for i in range(1, 8):
            term = term * Decimal(2).ln() / i
            taylor.append(float(term))
    assert table("EXP2_SIXTEENTHS") == sixteenths
    assert table("EXP2_TAYLOR") == taylor


#: A warp's reads of one float64 tile (operands.cuh): the tile copied in by
#: load_rows (cp.async), its shared memory written out as it lies, and each
#: lane's B operands from b_pair_from_rows (every k0) and b_from_columns
#: (every k0, n0), with TILE_WIDTH and the tensor kernels' definitions.
TILE_READS_KERNEL = r"""
extern "C" __global__ void tile_reads(const tile_t* matrix, tile_t* layout, tile_t* rows, tile_t* columns) {
  __shared__ __align__(16) tile_t tile[16 * tile_stride<TILE_WIDTH>];
  for (int i = threadIdx.x; i < 16 * tile_stride<TILE_WIDTH>; i += 32) tile[i] = -1;  // padding
  __syncthreads();
  load_rows<TILE_WIDTH, 16, 32>(tile, matrix, 0, 16);
  async_commit();
  async_wait<0>();
  __syncthreads();
  for (int i = threadIdx.x; i < 16 * tile_stride<TILE_WIDTH>; i += 32) layout[i] = tile[i];
  const int lane = threadIdx.x;
  for (int k0 = 0; k0 < TILE_WIDTH; k0 += 8) {  // rows (k0, m, lane, 2)
    FragB b[2];
    b_pair_from_rows<TILE_WIDTH>(b, tile, 0, k0, lane);
    for (int m = 0; m < 2; ++m)
      for (int e = 0; e < 2; ++e) rows[((k0 / 8 * 2 + m) * 32 + lane) * 2 + e] = b[m].r[e];
  }
  for (int k0 = 0; k0 < 16; k0 += 8)  // columns (k0, n0, lane, 2)
    for (int n0 = 0; n0 < TILE_WIDTH; n0 += 8) {
      const FragB b = b_from_columns<TILE_WIDTH>(tile, k0, n0, lane);
      for (int e = 0; e < 2; ++e) columns[(((k0 / 8) * (TILE_WIDTH / 8) + n0 / 8) * 32 + lane) * 2 + e] = b.r[e];
    }
}
"""
TILE_READS_LAUNCH = r"""
extern "C" void run_tile_reads(const tile_t* matrix, tile_t* layout, tile_t* rows, tile_t* columns) {
  cuda_emulator::launch(dim3(1), dim3(32), [&] { tile_reads(matrix, layout, rows, columns); });
}
"""


def _tile_reads(width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TILE_READS_KERNEL on the emulator for a (16, width) float64 tile whose
    entry (r, c) is 1000 r + c: (the tile's shared memory, b_pair_from_rows'
    entries (k0 / 8, m, lane, 2), b_from_columns' (k0 / 8, n0 / 8, lane, 2))."""
    x = np.zeros((1, 1, 16, width))
    defines = dict(fast_cupy._tensor_defines(make_spec(x, x, x), "f64", backward=False), TILE_WIDTH=str(width))
    folder = resources.files("npattn") / "cuda"
    sources = [EMULATED.get(name, str(folder / name)) for name in fast_cupy._TENSOR_SOURCES]
    library = build.build(sources, TILE_READS_KERNEL + TILE_READS_LAUNCH, defines, f"tile_reads_{width}")
    matrix = 1000.0 * np.arange(16)[:, None] + np.arange(width)
    layout = np.zeros(16 * fast_cupy._tile_stride(width, "f64"))
    rows, columns = np.zeros((width // 8, 2, 32, 2)), np.zeros((2, width // 8, 32, 2))
    library.run_tile_reads(*(ctypes.c_void_p(a.ctypes.data) for a in (matrix, layout, rows, columns)))
    return layout, rows, columns


def _passes(layout: np.ndarray, entries: np.ndarray, lanes_a_pass: int) -> int:
    """Passes of shared memory (32 banks of 4 bytes) a warp's load of
    `entries` (lane, entries a lane: adjacent float64s, 8 or 16 bytes) takes,
    its lanes served `lanes_a_pass` at a time (16 for 8-byte loads, 8 for
    16-byte ones): in each group, the most distinct words any one bank
    holds."""
    where = {code: index for index, code in enumerate(layout)}
    passes = 0
    for group in entries.reshape(-1, lanes_a_pass, entries.shape[-1]):
        words = {2 * where[code] + half for code in group.ravel() for half in (0, 1)}
        passes += max(np.bincount([w % 32 for w in words], minlength=32))
    return passes


@emulated
@pytest.mark.parametrize("width", [64, 48, 24])
def test_float64_tiles_read_without_bank_conflicts(width):
    """operands.cuh's float64 tile layout: each lane's B operands are the
    entries the mma's fragment layout asks for (rows: entries k0 + 2t and
    k0 + 2t + 1 of row n0 + 8m + g, a_from_rows' order, adjacent in shared
    memory; columns: entry n0 + g of rows k0 + 2t and k0 + 2t + 1), and
    where the width is a multiple of 16 (swizzled) every load takes the
    fewest passes of shared memory: a 16-byte load one for each of its 4
    quarter-warps, an 8-byte load one for each of its 2 half-warps. Other
    widths, padded, are read right, b_pair_from_rows in more passes."""
    layout, rows, columns = _tile_reads(width)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for k in range(width // 8):
        for m in range(2):
            expected = np.stack([1000.0 * (8 * m + g) + 8 * k + 2 * t, 1000.0 * (8 * m + g) + 8 * k + 2 * t + 1], -1)
            np.testing.assert_array_equal(rows[k, m], expected)
    for k in range(2):
        for n in range(width // 8):
            expected = np.stack([1000.0 * (8 * k + 2 * t + e) + 8 * n + g for e in (0, 1)], -1)
            np.testing.assert_array_equal(columns[k, n], expected)
    where = {code: index for index, code in enumerate(layout)}
    assert all(where[a] % 2 == 0 and where[b] == where[a] + 1 for a, b in rows.reshape(-1, 2))  # 16-byte loads
    row_passes = [_passes(layout, rows[k, m], 8) for k in range(width // 8) for m in range(2)]
    column_passes = [  # b.r[0] and b.r[1]: a load each
        _passes(layout, columns[k, n, :, e : e + 1], 16) for k in range(2) for n in range(width // 8) for e in range(2)
    ]
    if width % 16 == 0:
        assert row_passes == [4] * len(row_passes)
        assert column_passes == [2] * len(column_passes)
    else:
        assert max(row_passes) > 4


class _Device:
    """A CuPy device's ``compute_capability`` and nothing else."""

    def __init__(self, capability: str):
        self.compute_capability = capability


def test_tensor_cores_need_compute_capability_80():
    """A GPU before sm_80 (a V100: "70", a T4: "75") runs every call on the
    CUDA cores: the tensor-core kernels use cp.async and sm_80's mma shapes."""
    q, k, v, _ = _problem(batch=(1,), N=1, K=1, T=64, S=8, H=16, Hv=16, dtype=np.float16)
    spec = make_spec(q, k, v)
    precisions = [fast_cupy.tensor_precision(spec.replace(device=_Device(cc))) for cc in ("70", "75", "80", "90")]
    assert precisions == [None, None, "f16", "f16"]
    in_float64 = make_spec(*_problem(batch=(1,), N=1, K=1, T=64, S=8, H=16, Hv=16)[:3])
    assert fast_cupy.tensor_precision(in_float64) == "f64"
    assert fast_cupy.tensor_precision(in_float64.replace(device=_Device("75"))) is None


def test_tensor_warps_hold_the_forwards_rows():
    """As many warps of 16 rows as a block's stacked rows need, up to 4; the
    backward's blocks always 4, 8 in float64."""

    def warps(T, N=1, backward=False, dtype=np.float16):
        q, k, v, _ = _problem(batch=(1,), N=N, K=1, T=T, S=8, H=16, Hv=16, dtype=dtype)
        return fast_cupy.tensor_warps(make_spec(q, k, v), backward)

    assert [warps(1), warps(1, N=16), warps(17), warps(4, N=8), warps(33), warps(5000)] == [1, 1, 2, 2, 4, 4]
    assert [warps(1, backward=True, dtype=dtype) for dtype in (np.float16, np.float32, np.float64)] == [4, 4, 8]
    assert warps(5000, dtype=np.float64) == 4


def test_tensor_tiles_fit_static_shared_memory():
    """The tensor-core kernels' static shared memory, two tiles each, or one
    of each in a forward of split stages (the forward's: key and value
    tiles, rows padded by 16 bytes or, in float64 at widths a multiple of
    16, swizzled unpadded; the backward's largest, dK/dV's: query and dO
    tiles, and a ``Row`` (with a mask and a bias, their offsets in it), lse, D and row
    index per query row; ptxas reports 44032 bytes for float16 at H=Hv=64,
    as computed here) stays within
    CUDA's 48 KiB for every head size they take; and the tiles halved to fit
    are the sizes tensor_tile's docstring names."""
    for dtype, precision, widest in TENSOR_DTYPES:
        step, item = (16 if precision == "f16" else 8), np.dtype(dtype).itemsize
        for H, Hv, masks in itertools.product(range(step, widest + 1, step), range(step, widest + 1, step), (0, 2)):
            q, k, v, _ = _problem(batch=(1,), N=1, K=1, T=64, S=8, H=H, Hv=Hv, dtype=dtype)
            both = dict(mask=np.ones((64, 8), bool), bias=np.zeros((64, 8))) if masks else {}
            spec = make_spec(q, k, v, **both)
            assert fast_cupy.tensor_precision(spec) == precision
            for backward in (False, True):
                tile = fast_cupy.tensor_tile(spec, precision, backward)
                stride = H + 16 // item if precision != "f64" or H % 16 else H
                value_stride = Hv + 16 // item if precision != "f64" or Hv % 16 else Hv
                rows = tile * (stride + value_stride) * item
                row_bytes = fast_cupy.TENSOR_ROW_BYTES[precision] + masks * fast_cupy.ROW_OFFSET_BYTES
                per_row = row_bytes if backward else 0
                stages = 1 if not backward and fast_cupy.tensor_split_stages(spec, precision) else 2
                assert stages * (rows + tile * per_row) <= 48 * 1024, (dtype, H, Hv, backward)
                assert tile % 16 == 0

    def forward_tile(dtype, H):
        x = np.zeros((1, 1, 64, H), dtype)
        return fast_cupy.tensor_tile(make_spec(x, x, x), fast_cupy.tensor_precision(make_spec(x, x, x)))

    tiles = [forward_tile(np.float16, 64), forward_tile(np.float16, 128), forward_tile(np.float32, 64)]
    assert tiles + [forward_tile(np.float32, 128), forward_tile(np.float64, 64)] == [64, 32, 32, 16, 32]
    x = np.zeros((1, 1, 64, 64))
    assert fast_cupy.tensor_split_stages(make_spec(x, x, x), "f64")  # 32 keys, one tile of each
    x = np.zeros((1, 1, 64, 32))
    assert not fast_cupy.tensor_split_stages(make_spec(x, x, x), "f64")  # two tiles of 32 keys fit
    wide = np.zeros((1, 1, 64, 128), np.float16)
    assert fast_cupy.tensor_tile(make_spec(wide, wide, wide), "f16", backward=True) == 32


def test_tensor_min_blocks_cap_only_the_four_warp_forward():
    """The forward's registers are capped (``TC_MIN_BLOCKS``) by precision and
    head size; decode steps' one-warp blocks and the backward are not."""

    def caps(dtype, H, T=64, N=8):
        q, kv = np.zeros((1, N, T, H), dtype), np.zeros((1, 8, 64, H), dtype)
        spec = make_spec(q, kv, kv)
        precision = fast_cupy.tensor_precision(spec)
        forward, backward = (dict(fast_cupy._tensor_defines(spec, precision, b)) for b in (False, True))
        assert "TC_MIN_BLOCKS" not in backward
        return int(forward["TC_MIN_BLOCKS"])

    assert [caps(np.float16, 64), caps(np.float16, 128), caps(np.float32, 64), caps(np.float32, 128)] == [3, 3, 2, 0]
    assert [caps(np.float64, 64), caps(np.float16, 64, T=1, N=32)] == [0, 0]


@emulated
@pytest.mark.parametrize("case", ["decode splits", "decode splits window", "decode splits no keys"])
def test_decoding_splits_the_keys(case):
    """Several key ranges, merged by their own kernel (the values: the CASES tests)."""
    _, _, runtime = _both_paths(case)
    (name, grid, _), (merge, *_), *_ = runtime.launches
    assert name == "npattn_forward" and grid[2] > 1, f"one key range only: grid {grid}"
    assert merge == "npattn_merge_splits"
    assert fast_cupy.launch_shape(_spec(*_problem(**CASES["decode splits"])[:3], {})).lanes == fast_cupy.FEW_ROWS_LANES
    parts = runtime.arguments[0][3:5]  # the forward's (O_r, lse_r): pieces of one scratch allocation
    B, N, T, Hv = runtime.arguments[1][2].shape  # the merge's out, float64
    splits = grid[2] // B
    assert [a.nbytes for a in parts] == [splits * B * N * T * Hv * 8, splits * B * N * T * 8]
    assert parts[0].base is parts[1].base and all(a.ctypes.data % fast_cupy.SCRATCH_ALIGNMENT == 0 for a in parts)
    assert parts[0].ctypes.data + parts[0].nbytes <= parts[1].ctypes.data  # apart


def test_scratch_pieces_are_aligned_and_apart():
    """``_scratch``'s pieces of one allocation: each of its size, starting on
    a SCRATCH_ALIGNMENT boundary, none overlapping the next."""
    x = np.zeros((1, 1, 1, 8))
    pieces = fast_cupy._scratch(make_spec(x, x, x), (1, 300, 256, 8))
    assert [piece.nbytes for piece in pieces] == [1, 300, 256, 8]
    starts = [piece.ctypes.data for piece in pieces]
    assert all(start % fast_cupy.SCRATCH_ALIGNMENT == 0 for start in starts)
    assert [b - a for a, b in itertools.pairwise(starts)] == [256, 512, 256]


@emulated
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_merge_kernel_merges_many_ranges(tensor_cores):
    """``npattn_merge_splits`` against :func:`npattn.merge.merge_partials`
    directly: more ranges than the block has threads (each thread and warp
    strides over several), more columns than a warp has lanes, a row that
    no range saw and ranges that saw no key."""
    from npattn.merge import merge_partials

    splits, N, Hv = 2 * fast_cupy.MERGE_THREADS + 37, 3, 40
    q, k, v = (np.zeros((1, N, 1, 8)), np.zeros((1, N, 4, 8)), np.zeros((1, N, 4, Hv)))
    spec, runtime = make_spec(q, k, v), EmulatedRuntime()
    if tensor_cores:
        module = fast_cupy._tensor_module(runtime, spec, "f64", fast_cupy.tensor_warps(spec))
    else:
        module = fast_cupy._module(runtime, spec, fast_cupy.launch_shape(spec))
    rng = np.random.default_rng(0)
    outs = rng.standard_normal((splits, N, Hv))  # (splits, rows, Hv)
    lses = 3 * rng.standard_normal((splits, N))  # (splits, rows)
    lses[:, 1], lses[::5, 2], outs[:, 1] = -np.inf, -np.inf, 0.0
    out, lse = np.empty((N, Hv)), np.empty(N)
    config = fast_cupy._Call(spec, 4, splits).config
    runtime.launch(
        module, "npattn_merge_splits", (N, 1, 1), fast_cupy.MERGE_THREADS, (outs, lses, out, lse, None, config)
    )
    expected_out, expected_lse, _ = merge_partials(list(outs), list(lses))
    np.testing.assert_allclose(out, expected_out, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-13)
    assert lse[1] == -np.inf and not out[1].any()


@emulated
def test_fully_masked_rows():
    fused, _, _ = _both_paths("lengths bottom_right")
    out, lse, dq = fused[:3]
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf) and np.all(dq[1] == 0)


#: Calls whose D (the backward's rowsum(dO * O) - dlse) is checked row by
#: row: (options, dtype, whether the dK/dV kernel sums dQ). Fully masked
#: rows (the second batch element's, O = 0) on the CUDA cores and the
#: tensor cores, a block's last warp past the stacked rows, float16's dO
#: read as float16, and float64's D kernel where no dQ kernel runs.
D_MATRIX = {
    "cuda cores": (CASES["lengths bottom_right"], np.float64, False),
    "tensor cores": (TENSOR_CASES["lengths bottom_right"], np.float64, False),
    "rows past the last": (TENSOR_CASES["two warps"], np.float64, False),
    "float16": (TENSOR_CASES["lengths bottom_right"], np.float16, False),
    "dkdv sums dq": (TENSOR_CASES["lengths bottom_right"], np.float64, True),
}


@emulated
@pytest.mark.parametrize("case", D_MATRIX)
def test_backward_writes_d_for_every_row(monkeypatch, case):
    """``D = rowsum(dO * O) - dlse`` (``npattn/cuda/delta.cuh``) as the dK/dV
    kernel reads it: written by the dQ kernel for its rows (or, where the
    dK/dV kernel sums dQ, by ``npattn_backward_d``), every row of it, those
    that see no key included (``D = -dlse``), its arrays filled with NaN
    before the kernels run; against NumPy's float64 sum of the same ``dO``
    and ``O``."""
    call, dtype, fused_dq = D_MATRIX[case]
    if fused_dq:
        monkeypatch.setattr(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"}))
    empties = fast_cupy._empties

    def poisoned(spec, *requests):  # what a kernel leaves unwritten stays NaN
        arrays = empties(spec, *requests)
        for a in arrays:
            if a is not None and a.dtype.kind == "f":
                a.fill(np.nan)
        return arrays

    monkeypatch.setattr(fast_cupy, "_empties", poisoned)
    q, k, v, options = _problem(dtype=dtype, **call)
    spec = _spec(q, k, v, options)
    rng = np.random.default_rng(2)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1])).astype(dtype)
    dlse = rng.standard_normal(q.shape[:-1]).astype(spec.compute_dtype)
    runtime = EmulatedRuntime()
    out, lse = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    fast_cupy.backward(spec, q, k, v, out, lse, dout, dlse, runtime=runtime)
    first = runtime.launches[-2][0]  # the launch before dK/dV's: dQ's, or D's own
    on_tensor_cores = fast_cupy.tensor_precision(spec) is not None
    assert first == ("npattn_backward_d" if fused_dq else "npattn_backward_dq" + ("_tc" if on_tensor_cores else ""))
    D = runtime.arguments[-2][3 if fused_dq else 5].reshape(dlse.shape)
    expected = np.sum(dout.astype(np.float64) * out.astype(np.float64), axis=-1) - dlse
    masked = lse == -np.inf  # the rows that see no key: O = 0
    assert not np.isnan(D).any() and masked.any() == ("q_lengths" in call)
    np.testing.assert_array_equal(D[masked], -dlse[masked])
    tolerance = 1e-12 if spec.compute_dtype == np.float64 else 1e-5
    np.testing.assert_allclose(D, expected, rtol=tolerance, atol=tolerance)


@emulated
@pytest.mark.parametrize("heads", [dict(), dict(H=16, Hv=8)], ids=["cuda cores", "tensor cores"])
@pytest.mark.parametrize(
    "case", ["plain", "softcap alibi sinks", "dropout", "lengths bottom_right", "bias with every unit"]
)
def test_emulated_kernels_central_differences(case, heads):
    """<dout, d out> + <dlse, d lse> along random directions of q, k, v (and
    the ALiBi slopes and the bias), from the kernels' backward and from
    central differences of their forward, float64: on the CUDA cores
    (CASES' heads, ``Hv=6``) and on the float64 tensor cores. A bias's -inf
    entries (hidden keys) stay -inf in every step."""
    shape = dict(CASES[case], **heads)
    shape.update(T=9, S=10 if "align" in shape else 9)  # T != S needs an alignment
    if "q_lengths" in shape:
        shape.update(q_lengths=np.array([9, 0]), kv_lengths=np.array([6, 10]))
    for name, make in (("mask", _mask), ("bias", lambda shape: _bias(shape, hidden=0.1))):
        if name in shape:
            shape[name] = make((shape["T"], shape["S"]))
    q, k, v, options = _problem(rng_seed=3, **shape)
    rng = np.random.default_rng(4)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1]))
    dlse = rng.standard_normal(q.shape[:-1])
    runtime = EmulatedRuntime()
    params = [name for name in ("alibi_slopes", "bias") if name in options]

    def loss(q, k, v, *values):
        opts = dict(options, **dict(zip(params, values)))
        out, lse = fast_cupy.forward(_spec(q, k, v, opts), q, k, v, runtime=runtime)
        finite = np.isfinite(lse)
        return np.sum(out * dout) + np.sum(np.where(finite, lse, 0) * dlse)

    spec = _spec(q, k, v, options)
    assert fast_cupy.tensor_precision(spec) == ("f64" if heads else None)
    out, lse = fast_cupy.forward(spec, q, k, v, runtime=runtime)
    dlse_used = np.where(np.isfinite(lse), dlse, 0)
    dq, dk, dv, dbias, grads_of = fast_cupy.backward(spec, q, k, v, out, lse, dout, dlse_used, runtime=runtime)
    inputs = [q, k, v] + [options[name] for name in params]
    grads = [dq, dk, dv] + [dbias if name == "bias" else grads_of[name] for name in params]
    eps = 1e-6
    for index, (x, g) in enumerate(zip(inputs, grads)):
        direction = np.where(np.isfinite(x), rng.standard_normal(x.shape), 0)  # -inf + eps * 0 stays -inf
        plus, minus = list(inputs), list(inputs)
        plus[index], minus[index] = x + eps * direction, x - eps * direction
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(np.sum(g * direction), numeric, rtol=1e-6, atol=1e-8, err_msg=f"input {index}")


def _fused(q, k, v, dout, dlse=None, runtime=None, **options):
    """``(out, lse, dq, dk, dv, dbias, dsinks, dalibi_slopes)`` of the emulated
    kernels, called as npattn.attention_forward/backward call them (as
    test_chunked's ``_chunked`` calls the generic path): with the arrays in
    :func:`npattn.fast_cupy.operand_dtype` (float16 on the float16 tensor
    cores, else the compute dtype), ``dlse`` in the compute dtype."""
    spec = make_spec(q, k, v, **{**options, "impl": "chunked"})
    q, k, v, dout = (x.astype(fast_cupy.operand_dtype(spec)) for x in (q, k, v, dout))
    dlse = None if dlse is None else dlse.astype(spec.compute_dtype)
    runtime = runtime or EmulatedRuntime()
    out, lse, _ = apply_sinks(spec, *fast_cupy.forward(spec, q, k, v, runtime=runtime))
    dq, dk, dv, dbias, params = fast_cupy.backward(spec, q, k, v, out, lse, dout, dlse, runtime=runtime)
    return out, lse, dq, dk, dv, dbias, sinks_grad(spec, dout, out, lse, dlse), params.get("alibi_slopes")


@emulated
@settings(max_examples=25, deadline=None)
@given(
    case=attention_cases(max_len=40, features=(*FEATURES, *VARIANTS, "masked_row")),
    use_dlse=st.booleans(),
)
def test_emulated_kernels_match_generic_on_drawn_problems(case, use_dlse):
    """Every option the kernels take, drawn together (hypothesis), float64."""
    q, k, v = case.arrays
    assume(q.size > 0)  # empty calls take the generic path
    rng = np.random.default_rng(0)
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    dlse = rng.standard_normal(q.shape[:-1]) if use_dlse else None
    fused = _fused(q, k, v, dout, dlse, **case.options)
    generic = _chunked(q, k, v, dout, dlse, **case.options)
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes")
    for name, a, b in zip(names, fused, generic):
        if b is None:
            assert a is None, name
            continue
        assert not np.isnan(a).any(), name
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11, err_msg=name)


@emulated
@settings(max_examples=30, deadline=None)
@given(
    case=attention_cases(max_len=70, features=(*FEATURES, *VARIANTS, "masked_row")),
    dtype=st.sampled_from([np.float16, np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_emulated_tensor_cores_on_drawn_problems(case, dtype, seed):
    """The drawn problems of the test above, with heads of 16 so that the
    tensor-core kernels take them (partial row and key tiles, windows,
    lengths, segments, GQA, dropout, sinks, ALiBi and softcap together),
    against the generic path in float64 on the same rounded inputs: the
    forward on them, the backward on them and the kernels' own ``out`` and
    ``lse`` (so that float16's rounding of ``O``, which enters every
    gradient through ``D = rowsum(dO * O)``, is checked once, in ``out``).
    Within the precision's tolerance, or :data:`FLOAT32_LOSS` times what the
    generic path itself loses in float32 where that is more: a negative ALiBi
    slope makes scores of 50 over 70 keys, and the slope's gradient a small
    sum of large terms (1.345 from terms of 70 |dS|: float32 loses 7e-4).
    float64 on its tensor cores: within 1e-12 of the largest entry."""
    q, k, v = case.arrays
    assume(q.size > 0)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(x.shape[:-1] + (16,)).astype(dtype) for x in (q, k, v))
    dout = rng.standard_normal(q.shape).astype(dtype)
    dlse = rng.standard_normal(q.shape[:-1]).astype(dtype)
    precision = fast_cupy.tensor_precision(_spec(q, k, v, case.options))
    assert precision == {kind: name for kind, name, _ in TENSOR_DTYPES}[dtype]
    runtime = EmulatedRuntime()
    fused = _fused(q, k, v, dout, dlse, runtime=runtime, **case.options)
    assert [name for name, *_ in runtime.launches][-1] == "npattn_backward_dkdv_tc"
    in_float32 = _chunked(*(x.astype(np.float32) for x in (q, k, v, dout, dlse)), **case.options)
    q, k, v, dout, dlse = (x.astype(np.float64) for x in (q, k, v, dout, dlse))
    spec = make_spec(q, k, v, **{**case.options, "impl": "chunked"})
    out, lse, _ = apply_sinks(spec, *chunked_forward(spec, q, k, v))
    fused_out, fused_lse = (x.astype(np.float64) for x in fused[:2])
    dq, dk, dv, dbias, params = chunked_backward(spec, q, k, v, fused_out, fused_lse, dout, dlse)
    dsinks = sinks_grad(spec, dout, fused_out, fused_lse, dlse)
    exact = (out, lse, dq, dk, dv, dbias, dsinks, params.get("alibi_slopes"))
    names = ("out", "lse", "dq", "dk", "dv", "dbias", "dsinks", "dalibi_slopes")
    for name, a, b, c in zip(names, fused, exact, in_float32):
        if b is None:
            assert a is None, name
            continue
        seen = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), seen), name
        scale = max(1.0, float(np.max(np.abs(b[seen]), initial=0.0)))
        float32_loss = float(np.max(np.abs(c[seen] - b[seen]), initial=0.0)) if precision != "f64" else 0.0
        atol = max(TENSOR_TOLERANCE[precision] * scale, FLOAT32_LOSS * float32_loss)
        np.testing.assert_allclose(a[seen], b[seen], rtol=0, atol=atol, err_msg=name)


@emulated
def test_misaligned_inputs_are_copied_not_misread():
    """A C-order view that starts off a 16-byte boundary (the kernels read
    rows in 16-byte pieces) is copied first; the results do not change."""
    q, k, v, options = _problem(H=8, Hv=8, **CASES["plain"])
    buffer = np.empty(q.size + 1)
    shifted = buffer[1:].reshape(q.shape)  # 8 bytes past an aligned start
    shifted[...] = q
    assert shifted.ctypes.data % 16 == 8 and fast_cupy._contiguous(shifted).ctypes.data % 16 == 0
    spec = _spec(q, k, v, options)
    want = fast_cupy.forward(spec, q, k, v, runtime=EmulatedRuntime())
    got = fast_cupy.forward(spec, shifted, k, v, runtime=EmulatedRuntime())
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _kv_view(layout: str, k: np.ndarray) -> np.ndarray:
    """``k`` (B, K, S, W) laid out as ``layout`` says, the same entries."""
    B, K, S, W = k.shape
    if layout == "cache":  # a preallocated KV cache's first S positions
        buffer = np.full((B, K, S + 9, W), np.nan)
        buffer[:, :, :S] = k
        return buffer[:, :, :S]
    if layout == "two batch axes":  # (B, 1, K, S, W) viewed from a longer (B, 1, K, S + 5, W)
        buffer = np.full((B, 1, K, S + 5, W), np.nan)
        buffer[:, 0, :, :S] = k
        return buffer[:, :, :, :S]
    if layout == "one head, broadcast":  # every batch element reads the same rows: heads 0 apart
        return np.broadcast_to(k[:1, :1], (B, 1, S, W))
    if layout == "heads last":  # (B, S, K, W) transposed: rows K * W apart, not C-order
        return np.ascontiguousarray(np.swapaxes(k, 1, 2)).swapaxes(1, 2)
    assert layout == "misaligned"  # 8 bytes past a 16-byte boundary
    buffer = np.empty(k.size + 1)
    shifted = buffer[1:].reshape(k.shape)
    shifted[...] = k
    return shifted


#: Masks or biases of one call with two batch axes (B = 2 x 3, N=2, T=9,
#: S=11), each made by ``draw(shape)``, and by how the kernels read it: a
#: view of the user's array (True) through its strides, or a copy over the
#: batch axes it broadcasts along (False).
SCORE_OPERAND_LAYOUTS = {
    "C order": (lambda draw: draw((2, 3, 2, 9, 11)), True),
    "keys reversed": (lambda draw: draw((2, 3, 2, 9, 11))[..., ::-1], True),
    "rows and keys swapped": (lambda draw: np.swapaxes(draw((2, 3, 2, 11, 9)), -1, -2), True),
    "a broadcast view": (lambda draw: np.broadcast_to(draw((9, 11)), (2, 3, 2, 9, 11)), True),
    "padding, per batch element": (lambda draw: draw((2, 3, 1, 1, 11)), True),
    "along the first batch axis": (lambda draw: draw((2, 1, 1, 9, 11)), False),
    "along the second, over the keys": (lambda draw: draw((3, 1, 9, 1)), False),
}

#: How each kind of operand is drawn: a mask, a float64 bias with -inf
#: entries, and a float32 one (cast to the compute dtype, float64: a copy).
SCORE_OPERANDS = {
    "mask": lambda shape: _mask(shape, keep=0.7),
    "bias": lambda shape: _bias(shape, hidden=0.2),
    "float32 bias": lambda shape: _bias(shape).astype(np.float32),
}


@emulated
@pytest.mark.parametrize("tensor_cores", ["1", "0"])
@pytest.mark.parametrize("operand", list(SCORE_OPERANDS))
@pytest.mark.parametrize("layout", list(SCORE_OPERAND_LAYOUTS))
def test_masks_and_biases_are_read_through_their_strides(layout, operand, tensor_cores, monkeypatch):
    """A boolean mask or a bias in any layout gives the generic path's
    numbers, ``dbias`` included, float64, on the tensor cores and the CUDA
    cores: read where it lies through its strides (negative, zero along
    broadcast axes, keys not adjacent), or copied only where its batch
    axes do not flatten into one (or a bias's dtype is not the compute
    dtype); never written."""
    monkeypatch.setenv("NPATTN_CUPY_TENSOR_CORES", tensor_cores)
    make, in_place = SCORE_OPERAND_LAYOUTS[layout]
    name = "mask" if operand == "mask" else "bias"
    array = make(SCORE_OPERANDS[operand])
    before = array.copy()
    q, k, v, options = _problem(batch=(2, 3), T=9, S=11, H=16, Hv=16, **{name: array})
    spec = _spec(q, k, v, options)
    assert fast_cupy.tensor_precision(spec) == ("f64" if tensor_cores == "1" else None)
    read = fast_cupy._flat_scores_operand(spec, spec.mask if name == "mask" else fast_cupy._compute_dtype_bias(spec))
    assert np.shares_memory(read, array) == (in_place and operand != "float32 bias")
    rng = np.random.default_rng(1)
    dout, dlse = rng.standard_normal((*q.shape[:-1], 16)), rng.standard_normal(q.shape[:-1])
    fused = _fused(q, k, v, dout, dlse, **options)
    generic = _chunked(q, k, v, dout, dlse, **options)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), fused, generic):
        if b is None:
            assert a is None, name
            continue
        assert not np.isnan(a).any() and a.shape == b.shape, name
        tolerance = 1e-12 if b.dtype == np.float64 else 1e-6  # the float32 bias's gradient: in its dtype
        np.testing.assert_allclose(a.astype(b.dtype), b, rtol=tolerance, atol=tolerance, err_msg=name)
    np.testing.assert_array_equal(array, before)


def test_head_rows_of_each_layout():
    """The rows between kv heads that the kernels read a layout at, or None
    where it is copied to C order first."""
    from numpy.lib.stride_tricks import as_strided

    k = np.zeros((2, 4, 10, 8))
    row = 8 * k.itemsize
    assert fast_cupy._head_rows(k) == 10 and fast_cupy._head_rows(k[:, :, :4]) == 10
    assert fast_cupy._head_rows(k[:1, :1, :4]) == 4  # one head: C-order
    assert fast_cupy._head_rows(k[:1, 1:, :4]) == 10 and fast_cupy._head_rows(k[1:, :1]) == 10
    assert fast_cupy._head_rows(np.broadcast_to(k[:1, :1], (2, 1, 10, 8))) == 0
    assert fast_cupy._head_rows(k[:, ::2]) == 20  # every other head: evenly spaced
    assert fast_cupy._head_rows(k[:, :2]) is None and fast_cupy._head_rows(k[:, ::3]) is None  # uneven
    assert fast_cupy._head_rows(k[:1, ::-1]) is None  # heads backwards
    assert fast_cupy._head_rows(k[:, :, ::2]) is None and fast_cupy._head_rows(k[..., :4]) is None
    assert fast_cupy._head_rows(as_strided(k, (2, 1, 4, 8), (2**31 * row, row, row, k.itemsize))) is None
    assert fast_cupy._head_rows(as_strided(k, (2, 1, 4, 8), ((2**31 - 1) * row, row, row, k.itemsize))) == 2**31 - 1


@emulated
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize(
    "layout, in_place",
    [
        ("cache", True),
        ("two batch axes", True),
        ("one head, broadcast", True),
        ("heads last", False),
        ("misaligned", False),
    ],
)
def test_kv_views_are_read_where_they_lie(layout, in_place, tensor_cores, monkeypatch):
    """``k`` and ``v`` as views: the kernels read them where they lie when
    their rows are C-order and their kv heads evenly spaced (a preallocated
    KV cache's first S positions; one head broadcast over the batch, its
    heads 0 entries apart), and read C-order copies otherwise; either way
    the forward, its key ranges (T=1 against S=700) and the backward give
    the bits they give on C-order copies."""
    monkeypatch.setenv("NPATTN_CUPY_TENSOR_CORES", "1" if tensor_cores else "0")
    for T, S in ((1, 700), (9, 21)):
        q, k, v, _ = _problem(N=4, K=2, T=T, S=S, H=8, Hv=8)
        if layout == "one head, broadcast":
            q = q[:, :2]  # two query heads on one kv head
        k_view, v_view = _kv_view(layout, k), _kv_view(layout, v)
        if layout == "two batch axes":
            q = q[:, None]
        k, v = np.ascontiguousarray(k_view), np.ascontiguousarray(v_view)
        options = dict(causal=True, align="bottom_right")
        spec = _spec(q, k, v, options)
        dout = np.random.default_rng(2).standard_normal(q.shape)
        runtime = EmulatedRuntime(multiprocessors=16)  # T=1: 4 blocks a range, so 2 ranges of 350 keys
        forward = fast_cupy.forward(spec, q, k_view, v_view, runtime=runtime)
        backward = fast_cupy.backward(spec, q, k_view, v_view, *forward, dout, None, runtime=runtime)
        reads = {name: args for (name, *_), args in zip(runtime.launches, runtime.arguments)}
        assert (fast_cupy.tensor_precision(spec) is not None) == tensor_cores
        assert ("npattn_merge_splits" in reads) == (T == 1)  # T=1: the keys in ranges
        for name in ("npattn_forward", "npattn_backward_dq", "npattn_backward_dkdv"):
            args = reads[name + ("_tc" if tensor_cores else "")]
            assert (args[1] is k_view and args[2] is v_view) == in_place, name
        want_forward = fast_cupy.forward(spec, q, k, v, runtime=EmulatedRuntime(multiprocessors=16))
        want_backward = fast_cupy.backward(spec, q, k, v, *want_forward, dout, None, runtime=EmulatedRuntime())
        for got, want in zip((*forward, *backward[:3]), (*want_forward, *want_backward[:3])):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("window", [(25, None), (40, 0), (None, 12)])
def test_windows_wider_than_t_plus_s_with_a_far_offset(window):
    """A ring shard's queries can sit far from its keys (``q_offset`` beyond
    ``T + S``): a window side wider than ``T + S`` must still hide exactly
    what it hides. Generic path, dense path and the emulated kernels against
    the rule itself."""
    from npattn.dense import dense_forward

    q, k, v, _ = _problem(batch=(1,), N=1, K=1, T=10, S=10, H=4, Hv=4)
    spec = make_spec(q, k, v, window=window, align="top_left", impl="chunked").replace(
        q_offset=30, offset_bounds=(30, 30)
    )
    left, right = window
    p = np.arange(10)[:, None] + 30  # query positions
    j = np.arange(10)[None, :]
    visible = ((left is None) | (j >= p - (left or 0))) & ((right is None) | (j <= p + (right or 0)))
    s = np.where(visible, q[0, 0] @ k[0, 0].T / 2.0, -np.inf)  # scale 1/sqrt(4)
    with np.errstate(invalid="ignore", divide="ignore"):
        lse = np.log(np.sum(np.exp(s), axis=-1))
    assert visible.any()  # (25, None) also hides some rows entirely
    paths = {"generic": chunked_forward(spec, q, k, v), "dense": dense_forward(spec, q, k, v)[:2]}
    if build.available():
        paths["fused"] = fast_cupy.forward(spec, q, k, v, runtime=EmulatedRuntime())
    for name, (_, got) in paths.items():
        np.testing.assert_allclose(got[0, 0], lse, rtol=1e-12, err_msg=name)


def test_supports_only_cupy_and_the_kernels_options():
    q, k, v, _ = _problem()
    spec = make_spec(q, k, v)
    assert not fast_cupy.supports(spec)  # NumPy: the NumPy fast path's
    assert fast_cupy._kernels_take(spec)
    assert fast_cupy._kernels_take(
        make_spec(q, k, v, softcap=1.0, alibi_slopes=np.ones(2), sinks=np.ones(2), align="top_left")
    )
    mask = np.ones((11, 13), dtype=bool)
    assert fast_cupy._kernels_take(make_spec(q, k, v, mask=mask))
    assert fast_cupy._kernels_take(make_spec(q, k, v, bias=np.zeros((11, 13))))
    many = np.broadcast_to(np.zeros(()), (fast_cupy.MAX_GRID_YZ + 1, 1, 2, 4))  # batch elements past the grid's z
    assert not fast_cupy._kernels_take(make_spec(many, many, many))
    mod = npattn.ScoreMod(lambda s, idx, p: s, lambda ds, s, idx, p: (ds, {}))
    assert not fast_cupy._kernels_take(make_spec(q, k, v, score_mods=[mod], align="top_left"))


def test_preferred_leaves_large_float64_calls_on_the_cuda_cores_to_the_generic_path(monkeypatch):
    """Hv=6 keeps float64 off the tensor cores: a large call then goes to
    the generic path; on the float64 tensor cores (Hv=8), or in float32, not."""
    monkeypatch.setattr(fast_cupy, "supports", lambda spec: True)  # as if on CuPy
    small, large = (_problem(T=T, S=T, N=1, K=1, batch=(1,)) for T in (64, 4096))
    assert fast_cupy.preferred(make_spec(*small[:3]))
    assert not fast_cupy.preferred(make_spec(*large[:3]))
    assert fast_cupy.preferred(make_spec(*(x.astype(np.float32) for x in large[:3])))
    q, k, v, _ = _problem(T=4096, S=4096, N=1, K=1, batch=(1,), Hv=8)
    assert fast_cupy.tensor_precision(make_spec(q, k, v)) == "f64" and fast_cupy.preferred(make_spec(q, k, v))


def test_auto_takes_the_fused_kernels_wherever_they_run_the_call(monkeypatch):
    """On CuPy, ``impl="auto"`` goes chunked wherever :func:`fast_cupy.preferred`
    takes the call, however small (a decode step's 128 scores, a 16 x 16
    call), since the fused kernels outran the dense path at every size
    measured; not with ``NPATTN_FAST_CUPY=0``, nor for the JVP
    (``fused_cupy=False``: no fused JVP kernel), nor where preferred declines."""
    import npattn.fast_numpy
    from npattn.attention import choose_impl
    from npattn.modes.jvp import _spec_and_tangents

    monkeypatch.setattr(npattn.fast_numpy, "supports", lambda spec: False)  # as if on CuPy
    monkeypatch.setattr(fast_cupy, "supports", lambda spec: os.environ.get("NPATTN_FAST_CUPY") != "0")
    q, k, v, _ = _problem(batch=(1,), N=4, K=2, T=1, S=32, causal=True, align="bottom_right")
    step = make_spec(q, k, v, causal=True, align="bottom_right")
    tiny = make_spec(*_problem(T=16, S=16)[:3])
    assert choose_impl(step).impl == choose_impl(tiny).impl == "chunked"
    assert choose_impl(step, fused_cupy=False).impl == "dense"
    assert _spec_and_tangents((q, k, v), (q, k, v), dict(causal=True, align="bottom_right"))[0].impl == "dense"
    monkeypatch.setenv("NPATTN_FAST_CUPY", "0")
    assert choose_impl(step).impl == "dense"
    monkeypatch.setattr(fast_cupy, "preferred", lambda spec: False)
    monkeypatch.delenv("NPATTN_FAST_CUPY")
    assert choose_impl(tiny).impl == "dense"


@emulated
def test_public_api_decodes_on_the_fused_kernels_by_default(fused_on_numpy):
    """A decode step with every option at its default but the alignment
    runs the fused forward (and its merge of key ranges), and gives the
    dense path's numbers."""
    q, k, v, _ = _problem(batch=(1,), N=4, K=2, T=1, S=600, Hv=8)  # float64 on the tensor cores
    out, res = npattn.attention_forward(q, k, v, causal=True, align="bottom_right")
    assert res.spec.impl == "chunked" and res.kernel == "cupy"
    assert [name for name, *_ in fused_on_numpy.launches][-2:] == ["npattn_forward_tc", "npattn_merge_splits"]
    dense, _ = npattn.attention_forward(q, k, v, causal=True, align="bottom_right", impl="dense")
    np.testing.assert_allclose(out, dense, rtol=1e-12, atol=1e-12)


@emulated
def test_preallocated_kv_cache_is_read_in_place(fused_on_numpy):
    """Decoding through ``mha_forward`` with a preallocated
    :class:`npattn.KVCache`: each step's forward reads the cache's buffers
    where they lie (its views of the first L positions, kv heads
    ``max_length`` rows apart), not copies, and gives the full causal
    forward's outputs."""
    from npattn.kv_cache import KVCache

    rng = np.random.default_rng(3)
    B, L, E, N, K = 2, 6, 32, 4, 2
    params = {name: rng.standard_normal(a.shape) * 0.5 for name, a in npattn.mha_init(E, N, num_kv_heads=K).items()}
    x = rng.standard_normal((B, L, E))
    want, _ = npattn.mha_forward(params, x, num_heads=N, causal=True, impl="dense")
    cache = KVCache.for_mha(params, B, num_heads=N, max_length=L + 10)
    steps = [npattn.mha_forward(params, x[:, i : i + 1], num_heads=N, causal=True, cache=cache)[0] for i in range(L)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), want, rtol=1e-12, atol=1e-12)
    launches = zip(fused_on_numpy.launches, fused_on_numpy.arguments)
    forwards = [args for (name, *_), args in launches if name.startswith("npattn_forward")]
    assert len(forwards) == L
    buffers = (cache._keys.ctypes.data, cache._values.ctypes.data)
    assert all((args[1].ctypes.data, args[2].ctypes.data) == buffers for args in forwards)


@emulated
def test_repeated_calls_launch_from_their_specs_plans(fused_on_numpy, monkeypatch):
    """A repeated step (a decode step's forward and backward: its spec handed
    out again, resolved to the same spec) launches what its spec's plans
    keep: the same kernels, grids and configurations;
    ``NPATTN_CUPY_TENSOR_CORES=0`` between two such steps sends the next to
    the CUDA-core kernels. Every output and gradient is the dense path's."""
    q, k, v, _ = _problem(batch=(1,), N=4, K=2, T=1, S=600, Hv=8)  # float64 on the tensor cores, keys in ranges
    dout = np.random.default_rng(5).standard_normal((1, 4, 1, 8))
    options = dict(causal=True, align="bottom_right")

    def step(**impl):
        out, res = npattn.attention_forward(q, k, v, **options, **impl)
        return res.spec, (out, *npattn.attention_backward(dout, res)[:3])

    _, want = step(impl="dense")
    steps = [step(), step(), step()]  # the spec recurs from the second: its plans are kept from then
    monkeypatch.setenv("NPATTN_CUPY_TENSOR_CORES", "0")
    steps.append(step())
    assert steps[1][0] is steps[2][0] is steps[3][0]
    launched = list(zip(fused_on_numpy.launches, fused_on_numpy.arguments))
    tensor = ["npattn_forward_tc", "npattn_merge_splits", "npattn_backward_dq_tc", "npattn_backward_dkdv_tc"]
    assert [launch[0] for launch, _ in launched] == tensor * 3 + [name.removesuffix("_tc") for name in tensor]
    for (launch, args), (again, args_again) in zip(launched[4:8], launched[8:12]):
        assert launch == again and args[-1] is args_again[-1]  # the plans' Configs, as they were
    for _, got in steps:
        for value, expected in zip(got, want):
            np.testing.assert_allclose(value, expected, rtol=1e-11, atol=1e-12)


class _NoKernels:
    """A :class:`npattn.fast_cupy.Runtime` that compiles and runs nothing."""

    def module(self, source, defines):
        return defines

    def launch(self, module, name, grid, threads, args, shared_bytes=0):
        pass

    def multiprocessors(self, like):
        return 4

    def shared_memory(self, like):
        return 227 * 1024


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("H", [64, 200])  # the tensor cores', and (above their widest heads) the CUDA cores'
def test_plain_calls_run_the_kernels_built_without_the_variants(dtype, H):
    """Calls with no softcap, ALiBi, dropout or segment ids (masks,
    windows and lengths included) run the kernels built with
    ``PLAIN_SCORES=1``, which leave those options out; every other call
    the kernels built for every option, forward and backward."""
    q, k, v, _ = _problem(batch=(2,), N=4, K=2, T=5, S=40, H=H, Hv=H, dtype=dtype)
    segments = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    calls = {
        True: [
            {},
            dict(causal=True, align="top_left"),
            dict(window=(3, 2), align="bottom_right"),
            dict(kv_lengths=np.array([30, 40])),
        ],
        False: [
            dict(softcap=20.0),
            dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), align="top_left"),
            dict(dropout_p=0.1, seed=3),
            dict(q_segment_ids=segments, kv_segment_ids=np.repeat(segments, 8, axis=1)),
        ],
    }
    runtime = _NoKernels()
    for plain, options in ((plain, options) for plain, cases in calls.items() for options in cases):
        spec = make_spec(q, k, v, **options)
        assert fast_cupy.plain_scores(spec) is plain
        for backward in (False, True):
            defines = dict(fast_cupy._plan(runtime, spec, q, backward).module)
            assert defines["PLAIN_SCORES"] == str(int(plain)), (options, backward)


def test_plans_are_kept_for_recurring_specs_alone_and_leave_with_them():
    """A spec that recurs (``RECURRING_SPECS``, as ``scalar_call_spec``
    marks one it hands out again) keeps its plans, and in them its
    ``Config`` for each layout of ``k`` and ``v`` (C order, a longer
    buffer's view), none where the spec has per-batch arrays (a call's own
    copies, whose addresses the ``Config`` holds); a spec made for one call
    keeps none; and a plan leaves with its spec."""
    import gc
    import weakref

    from npattn.options import RECURRING_SPECS

    q, k, v, _ = _problem(batch=(1,), N=4, K=2, T=1, S=600, Hv=8)
    runtime, buffer = _NoKernels(), np.zeros(k.shape[:-2] + (700, k.shape[-1]))
    once, spec = make_spec(q, k, v), make_spec(q, k, v)
    assert fast_cupy._plan(runtime, once, q, False) is not fast_cupy._plan(runtime, once, q, False)
    RECURRING_SPECS.values(spec)
    for keys in (k, buffer[..., :600, :]):
        fast_cupy.forward(spec, q, keys, keys, runtime=runtime)
    plan = fast_cupy._plan(runtime, spec, q, backward=False)
    assert fast_cupy._plan(runtime, spec, q, backward=False) is plan and sorted(plan.calls) == [600, 700]
    with_lengths = make_spec(q, k, v, kv_lengths=np.array([500]))
    RECURRING_SPECS.values(with_lengths)
    fast_cupy.forward(with_lengths, q, k, v, runtime=runtime)
    assert fast_cupy._plan(runtime, with_lengths, q, backward=False).calls == {}
    spec_gone, entries = weakref.ref(spec), len(RECURRING_SPECS)
    del spec
    gc.collect()
    assert spec_gone() is None and len(RECURRING_SPECS) == entries - 1  # its entry, and its plans, gone with it


def test_config_dtype_follows_the_kernels_struct():
    """:data:`fast_cupy.CONFIG_DTYPE` has ``pipeline.cuh``'s ``struct Config``
    fields in its order and types, 8 bytes each, with no padding (the bytes
    the kernels read by value)."""
    import re

    source = (resources.files("npattn") / "cuda" / "pipeline.cuh").read_text()
    body = re.search(r"struct Config \{(.*?)\};", source, re.S).group(1)
    fields = re.findall(r"^\s*(long long|double) (\w+);", body, re.M)
    c_types = {"long long": np.dtype(np.int64), "double": np.dtype(np.float64)}
    assert [(name, c_types[c]) for c, name in fields] == [
        (name, fast_cupy.CONFIG_DTYPE.fields[name][0]) for name in fast_cupy.CONFIG_DTYPE.names
    ]
    assert fast_cupy.CONFIG_DTYPE.itemsize == 8 * len(fields)


def test_merge_threads_follow_the_kernel():
    """The merge's launches use the block size ``merge.cu`` is written for."""
    source = (resources.files("npattn") / "cuda" / "merge.cu").read_text()
    assert f"constexpr int MERGE_THREADS = {fast_cupy.MERGE_THREADS};" in source


def test_cupy_runtime_looks_each_kernel_up_once(monkeypatch):
    """CupyRuntime asks a module for a kernel once, then reuses it (without
    CuPy: a module, arrays and a ``CPointer`` that record what they are
    given), passing ``None`` as a pointer to eight zero bytes and the
    ``Config`` struct as a pointer to its bytes, kept for the next launch;
    a kernel launched with dynamic shared memory opts in to that much once
    (``max_dynamic_shared_size_bytes``) and gets it at every launch."""
    import contextlib
    import types

    class CPointer:  # cupy.cuda.function's: the address of an argument's bytes
        def __init__(self, p=0):
            self.ptr = p

    for name in ("cupy", "cupy.cuda", "cupy.cuda.function"):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(CPointer=CPointer))
    asked, launched = [], []

    class Kernel:  # cupy.RawKernel's launch and its attribute
        def __init__(self, name):
            self.name, self.max_dynamic_shared_size_bytes = name, 0

        def __call__(self, grid, block, args, shared_mem=0):
            launched.append((self.name, grid, block, args, shared_mem, self.max_dynamic_shared_size_bytes))

    class Module:
        def get_function(self, name):
            asked.append(name)
            return Kernel(name)

    class Device(contextlib.nullcontext):  # cupy.cuda.Device: a context with an id
        def __init__(self, id):
            super().__init__()
            self.id = id

    array = types.SimpleNamespace(device=Device(0))
    runtime, module = fast_cupy.CupyRuntime(), Module()
    config = np.zeros(1, fast_cupy.CONFIG_DTYPE)
    config["T"], config["scale"] = 7, 0.125
    before = config.copy()
    for name in ("npattn_forward_tc", "npattn_merge_splits", "npattn_forward_tc"):
        runtime.launch(module, name, (1, 2, 3), 32, (array, None, config))
    assert asked == ["npattn_forward_tc", "npattn_merge_splits"] and len(launched) == 3
    assert launched[0][1:3] == ((1, 2, 3), (32, 1, 1)) and launched[0][3][0] is array
    null, passed = launched[0][3][1:]
    assert ctypes.c_uint64.from_address(null.ptr).value == 0  # None: a null pointer
    assert ctypes.string_at(passed.ptr, config.nbytes) == config.tobytes()
    assert all(launch[3][2] is passed for launch in launched)  # kept by the config's identity
    assert config.dtype == fast_cupy.CONFIG_DTYPE and config.tobytes() == before.tobytes()  # left as it was
    assert all(launch[4:] == (0, 0) for launch in launched)
    for _ in range(fast_cupy.BY_VALUE_POINTERS + 1):  # a new config a call: the kept pointers stay few
        runtime.launch(module, "npattn_forward_tc", (1, 1, 1), 32, (array, config.copy()))
    assert len(runtime._by_value) <= fast_cupy.BY_VALUE_POINTERS
    for _ in range(2):
        runtime.launch(module, "npattn_backward_dq_tc", (1, 1, 1), 256, (array, config), 131072)
    assert asked.count("npattn_backward_dq_tc") == 1 and [launch[4:] for launch in launched[-2:]] == [(131072,) * 2] * 2
    assert len(runtime._opted_in) == 1  # once a kernel and device
    runtime.launch(
        module, "npattn_backward_dq_tc", (1, 1, 1), 256, (types.SimpleNamespace(device=Device(1)), config), 131072
    )
    assert len(runtime._opted_in) == 2 and launched[-1][4] == 131072


def test_splits_stay_within_the_grid():
    q, k, v, _ = _problem(batch=(6000,), N=1, K=1, T=1, S=4096, H=2, Hv=2)
    spec = make_spec(q, k, v)
    row_blocks = fast_cupy._grid_rows(spec, fast_cupy.launch_shape(spec))
    assert spec.num_batch * fast_cupy._splits(spec, row_blocks, multiprocessors=10**6) <= fast_cupy.MAX_GRID_YZ
    assert fast_cupy._splits(make_spec(q[:1], k[:1], v[:1]), row_blocks, multiprocessors=132) > 1


#: Bytes of ``pipeline.cuh``'s ``Row`` at most (float64: four int64, a
#: double and a uint32, padded to 8 bytes, and with a mask and a bias an
#: int64 each).
ROW_BYTES = 64


def test_launch_shape_fits_static_shared_memory():
    """Every kernel's static shared memory, for every launch shape the rule
    can give, stays within CUDA's 48 KiB: the key and value (or query and
    dO) tiles, the forward's and dQ's 2 * ROWS int64 scratch, dK/dV's
    per-row ``Row``, lse and D."""
    for H, Hv, dtype, T in itertools.product([1, 3, 64, 100, 256], [1, 64, 256], [np.float32, np.float64], [1, 500]):
        q, k, v, _ = _problem(batch=(1,), N=1, K=1, T=T, S=8, H=H, Hv=Hv, dtype=dtype)
        spec = make_spec(q, k, v)
        item = np.dtype(dtype).itemsize
        for backward in (False, True):
            shape = fast_cupy.launch_shape(spec, backward=backward)
            tiles = shape.keys * (H + Hv) * item
            rows_part = shape.keys * (ROW_BYTES + 2 * item) if backward else 2 * shape.rows * 8
            assert tiles + rows_part <= 48 * 1024, (H, Hv, dtype, T, backward, shape)
            assert shape.lanes * shape.rows == fast_cupy.BLOCK_THREADS and shape.keys % shape.chunk == 0


#: The emulated tests that :func:`test_fused_kernels_run_clean_under_the_sanitizers`
#: reruns (a ``-k`` expression): every option on the CUDA and the tensor
#: cores, drawn problems, KV cache views read in place, misaligned inputs,
#: key ranges and their merge, windows far out, fully masked rows, float16
#: outputs written by the kernels; of the views on the CUDA cores (60-70 s
#: each under the sanitizers) only the KV cache's.
SANITIZED_TESTS = (
    "test_emulated_kernels_match_generic_float64 or test_emulated_tensor_cores_match_float64"
    " or test_emulated_kernels_match_generic_on_drawn_problems or test_emulated_tensor_cores_on_drawn_problems"
    " or (test_kv_views_are_read_where_they_lie and (True] or cache-True-False))"
    " or test_misaligned_inputs or test_merge_kernel_merges or test_decoding_splits_the_keys"
    " or test_windows_wider or test_fully_masked_rows or test_float64_exp2_within_an_ulp"
    " or test_float16_output_is_written_by_the_kernels or test_backward_writes_d_for_every_row"
)


@emulated
@pytest.mark.slow
def test_fused_kernels_run_clean_under_the_sanitizers():
    """:data:`SANITIZED_TESTS` rerun in a process of their own whose kernels
    are built under AddressSanitizer and UndefinedBehaviorSanitizer
    (:func:`cuda_emulator.build.sanitizer_environment`, whose own test shows
    each fault stopping its process): no kernel reads or writes outside an
    array or past a static shared array, overflows a signed index or reads
    off an entry's alignment, as the outputs alone cannot show (a GPU reads
    a neighbour's bytes unnoticed)."""
    environment = build.sanitizer_environment(build.CACHE_DIR / "sanitized")
    if environment is None:
        pytest.skip("no AddressSanitizer runtime (libasan) that a Python starts with")
    _rerun_emulated(environment, SANITIZED_TESTS, 80)


#: The emulated tests that :func:`test_fused_kernels_have_no_shared_memory_races`
#: reruns (a ``-k`` expression): every kernel and tile pipeline, the CUDA
#: cores' and the tensor cores' in each precision, the forward's split stages
#: forced, key ranges and their merge, float16 read as it is, a KV cache
#: read in place.
RACECHECKED_TESTS = (
    "test_emulated_kernels_match_generic_float64 or test_emulated_tensor_cores_match_float64"
    " or test_emulated_forward_with_one_key_and_one_value_tile or test_decoding_splits_the_keys"
    " or test_merge_kernel_merges or test_emulated_cuda_cores_read_float16"
    " or (test_kv_views_are_read_where_they_lie and True])"
    " or (test_emulated_dkdv_kernel_sums_dq_in_order and 2-blockIdx])"
    " or (test_emulated_forward_keeps_q_in_shared_memory and float64)"
    " or (test_emulated_kernels_on_wgmma_write_the_same_bits and (plain] or segments] or dropout]))"
)


@emulated
@pytest.mark.slow
def test_fused_kernels_have_no_shared_memory_races():
    """:data:`RACECHECKED_TESTS` rerun in a process of their own whose
    kernels check every access to shared memory against the block's other
    threads (:func:`cuda_emulator.build.racecheck_environment`, whose own
    tests show each kind of race stopping its process): no tile is read
    before the barrier after its copy or its writes, none is copied or
    written over while another warp may still read it, and none is read
    before the block wrote it; the emulator's lockstep hides the second
    kind from the other tests (about 3 minutes on 2 cores)."""
    _rerun_emulated(build.racecheck_environment(build.CACHE_DIR / "racecheck"), RACECHECKED_TESTS, 140)


def _rerun_emulated(environment: dict[str, str], selection: str, at_least: int) -> None:
    """Run this file's tests ``selection`` (a ``-k`` expression) in a new
    process with ``environment``; assert that at least ``at_least`` ran and
    all passed. Output not captured there (``-s``), so that a check that
    aborts the process leaves its report, which heads the failure's."""
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", __file__, "-k", selection]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=3600, cwd=root)
    found = [line for line in result.stderr.splitlines() if line.startswith(("cuda_emulator:", "==", "SUMMARY"))]
    report = "\n".join(found[:40]) + "\n" + result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed is not None and int(passed.group(1)) >= at_least, report  # the selection ran, not skipped


# --- on a GPU ------------------------------------------------------------------------------------


def _on(backend, options):
    return {key: backend.asarray(val) if isinstance(val, np.ndarray) else val for key, val in options.items()}


def _public(q, k, v, options, dout, generic=False, dlse=None):
    if generic:
        os.environ["NPATTN_FAST_CUPY"] = "0"
    try:
        out, res = npattn.attention_forward(q, k, v, impl="chunked", **options)
        grads = npattn.attention_backward(dout, res, dlse=dlse)
    finally:
        os.environ.pop("NPATTN_FAST_CUPY", None)
    return res.kernel, [out, res.lse, grads.dq, grads.dk, grads.dv, grads.dsinks, grads.dalibi_slopes, grads.dbias]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_fused_matches_generic_and_numpy(backend, case):
    q, k, v, options = _problem(**CASES[case])
    rng = np.random.default_rng(1)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1]))
    dlse = rng.standard_normal(q.shape[:-1])
    device = [backend.asarray(x) for x in (q, k, v, dout, dlse)]
    kernel, fused = _public(*device[:3], _on(backend, options), device[3], dlse=device[4])
    assert kernel == "cupy"
    generic_kernel, generic = _public(*device[:3], _on(backend, options), device[3], generic=True, dlse=device[4])
    assert generic_kernel == "generic"
    _, host = _public(q, k, v, options, dout, dlse=dlse)  # NumPy: the dropout mask of the CPU, bit for bit
    for a, b, c in zip(fused, generic, host):
        if c is None:
            assert a is None and b is None
            continue
        np.testing.assert_allclose(backend.to_numpy(a), backend.to_numpy(b), rtol=1e-11, atol=1e-11)
        np.testing.assert_allclose(backend.to_numpy(a), c, rtol=1e-11, atol=1e-11)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("dtype, H, T", [(np.float16, 128, 1), (np.float16, 64, 300), (np.float32, 64, 300)])
def test_gpu_kv_views_give_the_bits_of_copies(backend, dtype, H, T):
    """On the GPU: ``k`` and ``v`` as the first S positions of longer
    buffers (read where they lie) give the bits that C-order copies give,
    forward and backward, in a decode step's shape and a training one's."""
    q, k, v, options = _problem(batch=(2,), N=8, K=2, T=T, S=700, H=H, Hv=H, causal=True, align="bottom_right")
    dout = np.random.default_rng(1).standard_normal((*q.shape[:-1], H))
    q, dout = (backend.asarray(x.astype(dtype)) for x in (q, dout))
    views = [backend.asarray(_kv_view("cache", x).base.astype(dtype))[:, :, :700] for x in (k, v)]
    copies = [x.copy() for x in views]
    assert not views[0].flags.c_contiguous and copies[0].flags.c_contiguous
    in_place = _public(q, *views, options, dout)
    copied = _public(q, *copies, options, dout)
    assert in_place[0] == copied[0] == "cupy"
    for a, b in zip(in_place[1], copied[1]):
        if b is not None:
            assert np.array_equal(backend.to_numpy(a), backend.to_numpy(b))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 63, reason="needs an 80-bit or wider long double as reference")
def test_gpu_float64_exp2_within_an_ulp_and_the_emulators_bits(backend):
    """On the GPU, the float64 kernels' 2^x (exp2.cuh) within 1.1 ulp, and,
    where g++ builds the emulator, the emulator's bits: each of its steps
    (fma, the table, integer arithmetic) is exact or IEEE-rounded on both,
    so test_float64_exp2_within_an_ulp speaks for the GPU."""
    import cupy

    source = (resources.files("npattn") / "cuda" / "exp2.cuh").read_text()
    defines = tuple(f"-D{name}={value}" for name, value in EXP2_DEFINES.items())
    kernel = cupy.RawModule(code=source + EXP2_KERNEL, options=("--std=c++17", *defines)).get_function("exp2_each")
    for x, expected in ((_exp2_arguments(), None), EXP2_EDGES):
        on_device = cupy.asarray(x)
        y = cupy.full_like(on_device, -1.0)
        kernel((256,), (64,), (on_device, y, np.int64(x.size)))
        y = cupy.asnumpy(y)
        if expected is None:
            ulps = _ulps(y, x)
            assert ulps.max() <= 1.1, (x[ulps.argmax()], ulps.max())
        else:
            np.testing.assert_array_equal(y, expected)
        if build.available():
            np.testing.assert_array_equal(y, _float64_exp2(x))  # NaN as NaN, whatever its payload


class _HostBackend:
    """The test backend's interface on NumPy arrays (as conftest's ``Backend``)."""

    asarray = staticmethod(np.asarray)
    to_numpy = staticmethod(np.asarray)


@pytest.fixture
def fused_on_numpy(monkeypatch):
    """The public API with NumPy arrays routed to the fused kernels (as CuPy
    arrays are), run by the emulator; yields its runtime (the launches)."""
    import npattn.fast_numpy

    runtime = EmulatedRuntime()
    monkeypatch.setattr(npattn.fast_numpy, "supports", lambda spec: False)
    take = fast_cupy._kernels_take
    monkeypatch.setattr(fast_cupy, "supports", lambda spec: os.environ.get("NPATTN_FAST_CUPY") != "0" and take(spec))
    monkeypatch.setattr(fast_cupy, "_CUPY_RUNTIME", runtime)
    return runtime


@emulated
@pytest.mark.parametrize("case", ["softcap alibi sinks", "dropout", "decode splits"])
def test_public_api_dispatches_to_the_fused_kernels(fused_on_numpy, case):
    """The GPU test above on the CPU, through attention_forward/backward: the
    dispatch, ``residuals.kernel`` and the backward following it, ``dlse``,
    sinks and ALiBi gradients."""
    test_gpu_fused_matches_generic_and_numpy(_HostBackend(), case)


def _float16_problem():
    q, k, v, options = _problem(dtype=np.float16, **TENSOR_CASES["gqa causal bottom_right"])
    dout = np.random.default_rng(1).standard_normal((*q.shape[:-1], v.shape[-1])).astype(np.float16)
    return q, k, v, dout, options


@emulated
def test_public_api_reads_float16_as_it_is_on_the_tensor_cores(fused_on_numpy):
    """float16 inputs on the float16 tensor cores: the residuals keep the
    caller's arrays (no float32 copies), ``out`` and ``lse`` stay in
    float32 there, the kernels write float16 gradients, and the values are
    float64's within the tensor-core tolerance (and float16's own rounding)."""
    q, k, v, dout, options = _float16_problem()
    out, res = npattn.attention_forward(q, k, v, impl="chunked", **options)
    assert res.kernel == "cupy" and res.q is q and res.k is k and res.v is v
    assert out.dtype == np.float16 and res.out.dtype == res.lse.dtype == np.float32
    grads = npattn.attention_backward(dout, res)
    assert [name for name, *_ in fused_on_numpy.launches][-2:] == ["npattn_backward_dq_tc", "npattn_backward_dkdv_tc"]
    assert grads.dq.dtype == grads.dk.dtype == grads.dv.dtype == np.float16
    fused = [x.astype(np.float64) for x in (out, res.lse, grads.dq, grads.dk, grads.dv)]
    _, exact = _public(*(x.astype(np.float64) for x in (q, k, v)), options, dout.astype(np.float64))
    _assert_within(fused, exact[:5], TENSOR_TOLERANCE["f16"] + 1e-3)


#: float16 calls whose output the kernels write, by the kernel that writes
#: it, and one whose sinks rescale ``out`` after the kernels (so cast).
FLOAT16_OUTPUTS = {
    "gqa causal bottom_right": "npattn_forward_tc",
    "odd eighths": "npattn_forward",  # H = 24: on the CUDA cores (float16's tensor cores take heads in 16s)
    "decode splits": "npattn_merge_splits",
    "softcap alibi sinks": None,
}


@emulated
@pytest.mark.parametrize("case", FLOAT16_OUTPUTS)
def test_float16_output_is_written_by_the_kernels(fused_on_numpy, case):
    """A float16 call's output: written by the kernel that writes ``out``
    (the forward, or the merge of key ranges), each entry ``out`` rounded as
    NumPy's cast rounds it, with no cast; where sinks rescale ``out``
    after the kernels, cast from the rescaled ``out``."""
    q, k, v, options = _problem(dtype=np.float16, **TENSOR_CASES[case])
    writer = FLOAT16_OUTPUTS[case]
    out, res = npattn.attention_forward(q, k, v, impl="chunked", **options)
    assert res.kernel == "cupy" and out.dtype == np.float16 and res.out.dtype == np.float32
    assert np.array_equal(out.view(np.uint16), res.out.astype(np.float16).view(np.uint16))  # the same bits
    # the call's launches (the fixture's runtime is the test's own), each with its output's pointer
    written = [(name, args[-2]) for (name, *_), args in zip(fused_on_numpy.launches, fused_on_numpy.arguments)]
    assert [name for name, rounded in written if rounded is not None] == ([writer] if writer else [])
    if writer:
        assert next(rounded for name, rounded in written if name == writer).ctypes.data == out.ctypes.data
    assert len(written) == (2 if "splits" in case else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("case", FLOAT16_OUTPUTS)
def test_gpu_float16_output_is_the_cast_of_out(backend, case):
    """On the GPU: a float16 call's output, written by the kernels (or cast,
    with sinks), has the bits of CuPy's cast of the float32 ``out`` the
    residuals keep, on the tensor cores, the CUDA cores and over key
    ranges (test_float16_output_is_written_by_the_kernels on the CPU)."""
    q, k, v, options = _problem(dtype=np.float16, **TENSOR_CASES[case])
    out, res = npattn.attention_forward(
        *(backend.asarray(x) for x in (q, k, v)), impl="chunked", **_on(backend, options)
    )
    assert res.kernel == "cupy" and out.dtype == np.float16
    assert np.array_equal(
        backend.to_numpy(out).view(np.uint16), backend.to_numpy(res.out.astype(np.float16)).view(np.uint16)
    )


@emulated
def test_modes_read_kept_float16_residuals_in_the_compute_dtype(fused_on_numpy):
    """Second-order modes and the MHA weights' recomputation read float16
    residuals kept by the fused path as the same residuals in float32: the
    same bits."""
    from npattn.attention import ChunkedResiduals
    from npattn.mha import _recompute_weights

    q, k, v, dout, options = _float16_problem()
    _, kept = npattn.attention_forward(q, k, v, impl="chunked", **options)
    assert kept.q.dtype == np.float16
    as_float32 = ChunkedResiduals(kept.spec, *(x.astype(np.float32) for x in (q, k, v)), kept.out, kept.lse)
    rng = np.random.default_rng(2)
    tangents = tuple(rng.standard_normal(x.shape).astype(np.float16) for x in (q, k, v))
    for compute in (
        lambda res: npattn.attention_backward_jvp(dout, res, tangents)[:3],
        lambda res: npattn.attention_double_backward(*tangents, res, dout)[:4],
        lambda res: [_recompute_weights(res)],
    ):
        for a, b in zip(compute(kept), compute(as_float32), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)


@emulated
def test_backward_reads_kept_float16_residuals_on_the_cuda_cores(fused_on_numpy, monkeypatch):
    """A forward on the tensor cores keeps float16 residuals; a backward
    after ``NPATTN_CUPY_TENSOR_CORES=0`` runs the CUDA-core kernels on them:
    the gradients of the tensor cores' backward, within its tolerance."""
    q, k, v, dout, options = _float16_problem()
    _, res = npattn.attention_forward(q, k, v, impl="chunked", **options)
    tensor = npattn.attention_backward(dout, res)
    monkeypatch.setenv("NPATTN_CUPY_TENSOR_CORES", "0")
    cores = npattn.attention_backward(dout, res)
    assert [name for name, *_ in fused_on_numpy.launches][-1] == "npattn_backward_dkdv"
    _assert_within([x.astype(np.float64) for x in cores[:3]], tensor[:3], TENSOR_TOLERANCE["f16"])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-5), (np.float16, 2e-3)])
def test_gpu_low_precision_within_tolerance(backend, dtype, tol):
    q, k, v, options = _problem(N=4, K=2, T=300, S=300, H=64, Hv=64, causal=True)
    dout = np.random.default_rng(1).standard_normal((*q.shape[:-1], 64))
    _, want = _public(q, k, v, options, dout)
    out, res = npattn.attention_forward(
        *(backend.asarray(x.astype(dtype)) for x in (q, k, v)), impl="chunked", **options
    )
    assert res.kernel == "cupy" and out.dtype == dtype
    grads = npattn.attention_backward(backend.asarray(dout.astype(dtype)), res)
    for a, b in zip([out, grads.dq, grads.dk, grads.dv], [want[0], want[2], want[3], want[4]]):
        scale = np.max(np.abs(b))
        np.testing.assert_allclose(backend.to_numpy(a).astype(np.float64), b, rtol=0, atol=tol * 10 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("case, dtype, precision", TENSOR_MATRIX)
def test_gpu_tensor_cores_match_float64(backend, case, dtype, precision):
    """The tensor-core kernels on the GPU, through the public API, against
    NumPy in float64 on the same values (dropout's keep mask included)."""
    q, k, v, options = _problem(dtype=dtype, **TENSOR_CASES[case])
    rng = np.random.default_rng(1)
    dout = rng.standard_normal((*q.shape[:-1], v.shape[-1])).astype(dtype)
    out, res = npattn.attention_forward(
        *(backend.asarray(x) for x in (q, k, v)), impl="chunked", **_on(backend, options)
    )
    assert res.kernel == "cupy" and fast_cupy.tensor_precision(res.spec) == precision
    grads = npattn.attention_backward(backend.asarray(dout), res)
    fused = [backend.to_numpy(x).astype(np.float64) for x in (out, res.lse, grads.dq, grads.dk, grads.dv)]
    _, exact = _public(*(x.astype(np.float64) for x in (q, k, v)), options, dout.astype(np.float64))
    # float16 outputs and gradients carry float16's own rounding on top of the kernels'
    _assert_within(fused, exact[:5], TENSOR_TOLERANCE[precision] + (1e-3 if dtype == np.float16 else 0.0))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("case", [case for case, dtype, _ in TENSOR_MATRIX if dtype == np.float64])
def test_gpu_dkdv_kernel_sums_dq_as_the_dq_kernel(backend, case, monkeypatch):
    """float64's dK/dV kernel summing dQ (``TC_FUSED_DQ``, forced) on the
    GPU, its key blocks ordered by flags, against NumPy in float64."""
    monkeypatch.setattr(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"}))
    test_gpu_tensor_cores_match_float64(backend, case, np.float64, "f64")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("case", [case for case, dtype, _ in TENSOR_MATRIX if dtype == np.float64])
def test_gpu_forward_keeping_q_writes_the_same_bits(backend, case, monkeypatch):
    """float64's tensor-core forward with Q's fragments kept in shared
    memory (``TC_KEPT_Q``, forced at 3 blocks a multiprocessor) on the GPU:
    the same bits of every output and gradient as with Q in registers (the
    launch plans made anew, so that the second call does not find the
    first's)."""
    q, k, v, options = _problem(dtype=np.float64, **TENSOR_CASES[case])
    dout = np.random.default_rng(1).standard_normal((*q.shape[:-1], v.shape[-1]))
    args = [backend.asarray(x) for x in (q, k, v, dout)]
    in_registers = _public(*args[:3], _on(backend, options), args[3])[1]
    monkeypatch.setattr(fast_cupy, "TENSOR_KEPT_Q", {"f64": 3})
    monkeypatch.setattr(fast_cupy, "RECURRING_SPECS", SpecMemo())
    kept = _public(*args[:3], _on(backend, options), args[3])[1]
    for a, b in zip(kept, in_registers):
        assert (a is None) == (b is None)
        if a is not None:
            assert np.array_equal(backend.to_numpy(a), backend.to_numpy(b))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize("case", WGMMA_CASES)
def test_gpu_kernels_on_wgmma_match_those_on_mma(backend, case, monkeypatch):
    """float16's kernels on sm_90a's warpgroup tensor cores (``TC_WGMMA``,
    forced; on an H100 or H200, where ``tensor_wgmma`` takes them): every
    output and gradient within float16's tolerance of the kernels on
    ``mma.sync`` (the hardware may sum a product's 16 terms in another
    order, and P and dS round to float16 from there), at H = Hv = 64."""
    q, k, v, options = _problem(dtype=np.float16, **{**TENSOR_CASES[case], "H": 64, "Hv": 64})
    dout = np.random.default_rng(1).standard_normal(q.shape).astype(np.float16)
    args = [backend.asarray(x) for x in (q, k, v, dout)]
    on_mma = _public(*args[:3], _on(backend, options), args[3])[1]
    monkeypatch.setattr(fast_cupy, "TENSOR_WGMMA", {"f16": (True, True)})
    monkeypatch.setattr(fast_cupy, "RECURRING_SPECS", SpecMemo())
    spec = _spec(*args[:3], _on(backend, options))
    if not fast_cupy.tensor_wgmma(spec, "f16", spec.device, backward=True):
        pytest.skip(f"no wgmma on compute capability {spec.device.compute_capability}")
    on_wgmma = _public(*args[:3], _on(backend, options), args[3])[1]
    _assert_within(
        [backend.to_numpy(a) if a is not None else None for a in on_wgmma[:5]],
        [backend.to_numpy(a).astype(np.float64) if a is not None else None for a in on_mma[:5]],
        TENSOR_TOLERANCE["f16"],
    )


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cupy"], indirect=True)
@pytest.mark.parametrize(
    "dtype, unshipped, bias",
    [(np.float32, False, False), (np.float64, False, False), (np.float64, True, False), (np.float16, True, False)]
    + [(np.float32, False, True)],
)
def test_gpu_fused_is_deterministic(backend, dtype, unshipped, bias, monkeypatch):
    """Two runs give the same bits, float64's with its dK/dV kernel summing
    dQ too (its key blocks' adds in a fixed order) and without, float16's
    on wgmma (on an H100 or H200), and with a bias broadcast over the batch
    and the heads (``dbias`` summed over them)."""
    monkeypatch.setattr(fast_cupy, "TENSOR_FUSED_DQ", frozenset({"f64"} if unshipped else ()))
    monkeypatch.setattr(fast_cupy, "TENSOR_WGMMA", {"f16": (True, True)} if unshipped else {})
    biased = {"bias": backend.asarray(_bias((500, 700), hidden=0.1))} if bias else {}
    q, k, v, options = _problem(N=8, K=2, T=500, S=700, H=64, Hv=64, causal=True, align="bottom_right", **biased)
    dout = np.random.default_rng(1).standard_normal((*q.shape[:-1], 64))
    args = [backend.asarray(x.astype(dtype)) for x in (q, k, v, dout)]
    first = _public(*args[:3], options, args[3])[1]
    second = _public(*args[:3], options, args[3])[1]
    for a, b in zip(first, second):
        if a is not None:
            assert np.array_equal(backend.to_numpy(a), backend.to_numpy(b))
