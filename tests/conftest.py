"""Shared test fixtures: the backend matrix of CONVENTIONS §4.

``backend`` is a session-scoped parametrized fixture (safe with hypothesis's
``@given``) yielding a :class:`Backend` that converts NumPy arrays into the
backend's arrays and back:

- ``numpy``, ``numpy-readonly`` (read-only inputs catch mutation),
- ``strict`` and ``strict-device1`` (array-api-strict; catches NumPy-only
  calls and missing ``device=``),
- ``cupy`` (``gpu`` marker; skipped without CuPy and a device),
- ``torch`` (CPU tensors; skipped where torch is not installed).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings

# With CI set, Hypothesis loads its built-in "ci" profile itself (derandomized,
# no deadline, no example database); locally, a quicker profile.
settings.register_profile("dev", max_examples=30, deadline=None)
if not os.environ.get("CI"):
    settings.load_profile("dev")


@dataclass(frozen=True)
class Backend:
    name: str
    asarray: Callable[[np.ndarray], Any]
    to_numpy: Callable[[Any], np.ndarray]
    xp: Any

    def __repr__(self) -> str:  # shows in test ids
        return self.name


def _numpy_backend(readonly: bool) -> Backend:
    def asarray(a):
        a = np.array(a)  # a private copy the test can freeze
        if readonly:
            a.flags.writeable = False
        return a

    return Backend("numpy-readonly" if readonly else "numpy", asarray, np.asarray, np)


def _strict_backend(device_name: str | None) -> Backend:
    xps = pytest.importorskip("array_api_strict")
    device = xps.Device(device_name) if device_name else None

    def asarray(a):
        a = np.asarray(a)
        return xps.asarray(a, device=device) if device is not None else xps.asarray(a)

    def to_numpy(x):
        if hasattr(x, "device") and device is not None:
            x = xps.asarray(x, device=xps.Device("CPU_DEVICE"), copy=True)
        return np.asarray(x)

    return Backend(f"strict-{device_name}" if device_name else "strict", asarray, to_numpy, xps)


def _cupy_backend() -> Backend:
    try:
        cp = importlib.import_module("cupy")
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception:
        pytest.skip("CuPy with a CUDA device is not available")
    return Backend("cupy", cp.asarray, cp.asnumpy, cp)


def _torch_backend() -> Backend:
    torch = pytest.importorskip("torch")
    return Backend("torch", lambda a: torch.asarray(np.asarray(a).copy()), lambda x: x.detach().cpu().numpy(), torch)


BACKEND_PARAMS = [
    "numpy",
    "numpy-readonly",
    "strict",
    "strict-device1",
    pytest.param("cupy", marks=pytest.mark.gpu),
    "torch",
]


def make_backend(name: str) -> Backend:
    if name in ("numpy", "numpy-readonly"):
        return _numpy_backend(name == "numpy-readonly")
    if name.startswith("strict"):
        return _strict_backend("device1" if name.endswith("device1") else None)
    if name == "cupy":
        return _cupy_backend()
    if name == "torch":
        return _torch_backend()
    raise ValueError(name)


@pytest.fixture(scope="session", params=BACKEND_PARAMS)
def backend(request) -> Backend:
    """Every backend of the test matrix."""
    return make_backend(request.param)


@pytest.fixture(scope="session")
def numpy_backend() -> Backend:
    return make_backend("numpy")


@pytest.fixture
def blas_with_small_kernels():
    """Skip unless NumPy's BLAS is an OpenBLAS whose core has the small-matrix
    kernels (:func:`npattn.blas_numpy.small_product_limit`): there a product
    cut into pieces of rows gives the bits of the whole, the property
    :func:`npattn.blas_numpy.matmul` cuts on, and it cuts nowhere else. Other
    cores' kernels (OpenBLAS 0.3.31 runs the AVX-512 AMD EPYC of some of
    these machines as "Haswell") round an entry by the product's shape."""
    from npattn import blas_numpy

    if not blas_numpy.small_product_limit():
        pytest.skip("NumPy's BLAS has no small-matrix kernels here: products are never cut")
