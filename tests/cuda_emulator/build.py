"""Compile CUDA C++ kernel sources for the CPU emulator (``emulator.h``) into a ctypes library.

The sources and the wrapper text are concatenated, in that order, into one
translation unit (like the one code string of a CuPy ``RawModule``), each
behind a ``#line`` directive so that g++ and the emulator's messages name the
original file. ``extern __shared__ T name[];`` is rewritten to
``auto* const name = ::cuda_emulator::dynamic_shared<T>();``. Libraries are
cached under ``$CUDA_EMULATOR_CACHE`` (default: a folder in the temp
directory), keyed by a hash of every input. A wrapper::

    extern "C" void run_scale(const float* x, float* y, int n) {
        cuda_emulator::launch(dim3((n + 255) / 256), dim3(256), [&] { scale(x, y, n); });
    }

is then ``build([path], wrapper, {}, "scale").run_scale(x_ptr, y_ptr, n)`` through ctypes.

``$CUDA_EMULATOR_FLAGS`` adds g++ flags to every build (and to its cache
key). Two environments of a new Python process set them:

- :func:`sanitizer_environment`: builds under AddressSanitizer and
  UndefinedBehaviorSanitizer: a kernel's read or write outside an array (its
  global memory is NumPy's, on the heap) or past a static shared array, a
  signed overflow in its index arithmetic, a misaligned access, each stops
  the process with the source line, where on a GPU it would read a
  neighbour's bytes unnoticed;
- :func:`racecheck_environment`: builds whose every access to shared memory
  is checked against the other threads' of the block (``racecheck.h``): a
  read and a write, or two writes, of a byte by two threads with no barrier
  between stop the process with both source lines, whatever order the
  emulator ran the threads in.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

HEADER = Path(__file__).with_name("emulator.h")
#: emulator.h and the header it includes, in every build's cache key.
HEADERS = (HEADER, HEADER.with_name("racecheck.h"))
CXX = "g++"
FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", *shlex.split(os.environ.get("CUDA_EMULATOR_FLAGS", "")))
#: ``$CUDA_EMULATOR_FLAGS`` under :func:`sanitizer_environment`: each
#: sanitizer's first report is fatal.
SANITIZER_FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
#: ``$CUDA_EMULATOR_FLAGS`` for the shared-memory race check (``racecheck.h``):
#: g++'s ThreadSanitizer instrumentation, whose hooks racecheck.h defines (so
#: the build compiles with it and links without it, and needs no runtime
#: preloaded), and line tables for its reports.
RACECHECK_FLAGS = "-DCUDA_EMULATOR_RACECHECK -fsanitize=thread --param=tsan-instrument-func-entry-exit=0 -g"
_INSTRUMENTATION_ONLY = "-fsanitize=thread"
CACHE_DIR = Path(os.environ.get("CUDA_EMULATOR_CACHE") or Path(tempfile.gettempdir()) / "npattn-cuda-emulator")

_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\s+(?P<type>[^;\[\]{}]*?)\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"\b(?:__align__|alignas)\s*\([^()]*\)")
_loaded: dict[Path, ctypes.CDLL] = {}


def _rewrite_extern_shared(text: str) -> str:
    """``extern __shared__ T name[];`` -> a pointer to the emulator's dynamic shared memory (same line count)."""

    def replace(m: re.Match[str]) -> str:
        type_ = " ".join(_ALIGN.sub(" ", m["type"]).split())  # the buffer is 256-byte aligned
        newlines = "\n" * m.group(0).count("\n")
        return f"auto* const {m['name']} = ::cuda_emulator::dynamic_shared<{type_}>();{newlines}"

    return _EXTERN_SHARED.sub(replace, text)


def _line(name: str) -> str:
    return '#line 1 "' + name.replace("\\", "\\\\").replace('"', '\\"') + '"\n'


def build(
    source_paths: Iterable[str | os.PathLike[str]],
    wrapper_source: str,
    defines: Mapping[str, str] | None = None,
    name: str = "kernels",
) -> ctypes.CDLL:
    """Compile ``source_paths`` + ``wrapper_source`` (``extern "C"`` functions calling
    ``cuda_emulator::launch``) with ``-D key=value`` for each define; load and return the library.

    Raises ``RuntimeError`` with g++'s messages when the compile fails.
    """
    paths = [Path(p) for p in source_paths]
    parts = [_line(p.name) + _rewrite_extern_shared(p.read_text()) + "\n" for p in paths]
    parts.append(_line(f"{name}-wrapper") + wrapper_source + "\n")
    unit = "".join(parts)
    args = [f"-D{key}={value}" for key, value in sorted((defines or {}).items())]
    digest = hashlib.sha256()
    for item in (CXX, *FLAGS, *args, *(header.read_text() for header in HEADERS), unit):
        digest.update(item.encode() + b"\0")
    stem = f"{name}-{digest.hexdigest()[:24]}"
    library = CACHE_DIR / f"{stem}.so"
    if library in _loaded:
        return _loaded[library]
    if not library.exists():
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # each process its own source and library, the library renamed when
        # complete: safe with parallel builds (a shared source, rewritten by
        # one process while another's g++ read it, once built a library
        # without its functions)
        unit_path = CACHE_DIR / f"{stem}.{os.getpid()}.cu"
        unit_path.write_text(unit)
        partial = CACHE_DIR / f"{stem}.{os.getpid()}.so"
        result = _compile(unit_path, args, partial)
        unit_path.unlink(missing_ok=True)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            sources = ", ".join(str(p) for p in paths) or "no sources"
            raise RuntimeError(f"g++ failed to build {name!r} ({sources}):\n{result.stderr}")
        os.replace(partial, library)
    _loaded[library] = ctypes.CDLL(str(library))
    return _loaded[library]


def _compile(unit_path: Path, args: list[str], library: Path) -> subprocess.CompletedProcess[str]:
    """g++ on one translation unit; with :data:`RACECHECK_FLAGS`, compiled with
    the instrumentation and linked without it (its runtime, libtsan, left out)."""
    compile_ = [CXX, *FLAGS, "-include", str(HEADER), *args, "-x", "c++", str(unit_path)]
    if _INSTRUMENTATION_ONLY not in FLAGS:
        return subprocess.run([*compile_, "-o", str(library)], capture_output=True, text=True, check=False)
    objects = library.with_suffix(".o")
    try:
        result = subprocess.run([*compile_, "-c", "-o", str(objects)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            return result
        link = [CXX, *(flag for flag in FLAGS if flag != _INSTRUMENTATION_ONLY), str(objects), "-o", str(library)]
        return subprocess.run(link, capture_output=True, text=True, check=False)
    finally:
        objects.unlink(missing_ok=True)


_PROBE = """
extern "C" int cuda_emulator_probe() {
  int n = 0;
  cuda_emulator::launch(dim3(2), dim3(3), [&] { __syncthreads(); n += 1; });
  return n;
}
"""


@functools.cache
def available() -> bool:
    """Whether g++ is on PATH and can build and run an emulated kernel."""
    if shutil.which(CXX) is None:
        return False
    try:
        return bool(build([], _PROBE, {}, "probe").cuda_emulator_probe() == 6)
    except (RuntimeError, OSError):
        return False


def racecheck_environment(cache: str | os.PathLike[str]) -> dict[str, str]:
    """``os.environ`` for a new Python process whose builds take
    :data:`RACECHECK_FLAGS` (the shared-memory race check, ``racecheck.h``)
    and are kept in ``cache``. Nothing is preloaded: racecheck.h defines the
    instrumentation's hooks itself."""
    return dict(os.environ, CUDA_EMULATOR_FLAGS=RACECHECK_FLAGS, CUDA_EMULATOR_CACHE=str(cache))


def sanitizer_environment(cache: str | os.PathLike[str]) -> dict[str, str] | None:
    """``os.environ`` for a new Python process whose builds take
    :data:`SANITIZER_FLAGS` and are kept in ``cache``: g++'s AddressSanitizer
    runtime preloaded (a Python not built with it must load it first), leak
    checks off (the interpreter's own allocations outlive it). None where
    g++ has no AddressSanitizer runtime, or a Python cannot start with it
    (some kernels' address-space layouts)."""
    result = subprocess.run([CXX, "-print-file-name=libasan.so"], capture_output=True, text=True, check=False)
    runtime = result.stdout.strip()
    if result.returncode != 0 or not os.path.isabs(runtime) or not os.path.exists(runtime):
        return None  # g++ prints the bare name when it has no such file
    preload = " ".join(filter(None, (runtime, os.environ.get("LD_PRELOAD"))))
    environment = dict(
        os.environ,
        LD_PRELOAD=preload,
        CUDA_EMULATOR_FLAGS=SANITIZER_FLAGS,
        CUDA_EMULATOR_CACHE=str(cache),
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    started = subprocess.run([sys.executable, "-c", "pass"], env=environment, capture_output=True, check=False)
    return environment if started.returncode == 0 else None
