"""Moving ring attention's shards between neighbouring ranks over MPI.

Arrays move as raw bytes through mpi4py's buffer interface
(``Isend``/``Irecv``, no pickling). ``"buffer"`` mode hands host arrays
(NumPy, PyTorch CPU, array-api-strict) or, with a CUDA-aware MPI, device
arrays to MPI as they are; ``"host"`` mode stages through NumPy buffers.
Both put the same bytes on the wire, so ranks may use different modes.
mpi4py is imported on first use (:func:`mpi`), so importing this module
works without it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..namespace import dtype_name, to_numpy

__all__ = ["INSTALL_HINT", "TRANSPORTS", "mpi", "check_comm", "Transport"]

INSTALL_HINT = 'pip install "npattn[mpi]"'
TRANSPORTS = ("auto", "buffer", "host")


def mpi() -> Any:
    """``mpi4py.MPI``, or an ImportError that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(
            "npattn.distributed needs mpi4py and an MPI runtime: "
            f"{INSTALL_HINT} (mpi4py with MPICH's wheel), or pip install mpi4py "
            "built against the system's MPI"
        ) from err
    return MPI


def check_comm(MPI: Any, comm: Any) -> int:
    """Validate the communicator; return its size."""
    if comm is None:
        raise TypeError("comm is required: pass an mpi4py communicator, e.g. comm=MPI.COMM_WORLD")
    if not isinstance(comm, MPI.Comm):
        raise TypeError(
            f"comm must be an mpi4py communicator (mpi4py.MPI.Intracomm such as MPI.COMM_WORLD), "
            f"got {type(comm).__name__}"
        )
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL, a communicator of size 0; ring attention needs at least one rank")
    if comm.Is_inter():
        raise ValueError("comm is an intercommunicator; ring attention needs an intracommunicator")
    size = comm.Get_size()
    if size < 1:
        raise ValueError(f"comm has size {size}; ring attention needs at least one rank")
    return size


def _is_host_array(x: Any) -> bool:
    """Whether ``x`` lives in host memory (DLPack device type kDLCPU = 1)."""
    try:
        return int(x.__dlpack_device__()[0]) == 1
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return type(x).__module__.split(".")[0] == "numpy"


def _is_c_contiguous(x: Any) -> bool:
    """Whether ``x``'s memory is known to be in C order (NumPy, CuPy, PyTorch);
    False when the library does not say."""
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous"):
        return bool(flags.c_contiguous)
    is_contiguous = getattr(x, "is_contiguous", None)
    if callable(is_contiguous):
        return bool(is_contiguous())
    return False


def _synchronize(x: Any) -> None:
    """Wait for pending device work on ``x`` before MPI reads its memory."""
    library = type(x).__module__.split(".")[0]
    if library == "cupy":
        import cupy

        cupy.cuda.get_current_stream().synchronize()
    elif library == "torch" and getattr(x, "is_cuda", False):
        import torch

        torch.cuda.synchronize(x.device)


class Transport:
    """Moves C-contiguous arrays of one dtype to the right ring neighbour and
    receives the left neighbour's, as raw bytes (``[buf, MPI.BYTE]``).

    ``buffer`` mode hands the arrays' memory to MPI directly; ``host`` mode
    stages through NumPy buffers. Both put the same bytes on the wire, so
    ranks may use different modes.
    """

    def __init__(self, MPI: Any, comm: Any, xp: Any, device: Any, dtype: Any, mode: str, probe: Any):
        self.MPI, self.comm, self.xp, self.device, self.dtype = MPI, comm, xp, device, dtype
        self.right = (comm.Get_rank() + 1) % comm.Get_size()
        self.left = (comm.Get_rank() - 1) % comm.Get_size()
        self.itemsize = xp.finfo(dtype).bits // 8
        if mode == "auto":
            mode = "buffer" if _is_host_array(probe) and self._accepts(probe) else "host"
        self.mode = mode
        self.bytes_sent = 0
        self.bytes_received = 0

    def _accepts(self, x: Any) -> bool:
        """Whether MPI takes this library's arrays as writable buffers."""
        try:
            probe = self.xp.empty((1,), dtype=self.dtype, device=self.device)
            return not self.MPI.buffer(probe).readonly
        except (TypeError, ValueError, BufferError, NotImplementedError):
            return False

    def contiguous(self, x: Any) -> Any:
        """A fresh C-contiguous copy of ``x`` to send from (MPI would take an
        F-ordered array as is, with its bytes in the wrong order)."""
        buf = self.xp.empty(tuple(x.shape), dtype=self.dtype, device=self.device)
        buf[...] = x
        return buf

    def exchange(self, arrays: list, shapes: list, tag: int = 0) -> _Exchange:
        """Start sending ``arrays`` right and receiving ``shapes`` from the left,
        with tags ``tag, tag + 1, ...``."""
        MPI = self.MPI
        requests, keep = [], []
        recvs = []
        for i, shape in enumerate(shapes):
            if self.mode == "buffer":
                buf = self.xp.empty(shape, dtype=self.dtype, device=self.device)
            else:
                buf = np.empty(shape, dtype=dtype_name(self.dtype))
            recvs.append(buf)
            requests.append(self.comm.Irecv([buf, MPI.BYTE], source=self.left, tag=tag + i))
            self.bytes_received += math.prod(shape) * self.itemsize
        for i, x in enumerate(arrays):
            if self.mode == "buffer":
                payload = x if _is_c_contiguous(x) else self.contiguous(x)
                _synchronize(payload)
            else:
                payload = np.ascontiguousarray(to_numpy(x))  # kept alive in `keep` until the wait
            keep.append(payload)
            requests.append(self.comm.Isend([payload, MPI.BYTE], dest=self.right, tag=tag + i))
            self.bytes_sent += math.prod(tuple(x.shape)) * self.itemsize
        return _Exchange(self, requests, recvs, keep)


class _Exchange:
    def __init__(self, transport: Transport, requests: list, recvs: list, keep: list):
        self.transport, self.requests, self.recvs, self.keep = transport, requests, recvs, keep

    def wait(self) -> list:
        """Complete the exchange; return the received arrays on the namespace."""
        self.transport.MPI.Request.Waitall(self.requests)
        t = self.transport
        if t.mode == "buffer":
            return self.recvs
        return [t.xp.asarray(buf, device=t.device) for buf in self.recvs]
