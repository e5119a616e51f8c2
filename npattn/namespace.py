"""The array-module abstraction: which namespace and device the inputs live on,
and the dtype policy.

Every compute module in npattn receives an Array API namespace ``xp`` from
:func:`resolve_namespace` and calls nothing but standard functions on it, so
the same code runs on NumPy, CuPy, array-api-strict and PyTorch tensors.

Dtype policy (CONVENTIONS §1)::

    input dtype           compute dtype     returned dtype
    float64               float64           float64
    float32               float32           float32
    float16 / bfloat16    float32           input dtype

The compute dtype is also the dtype of ``lse`` and of the probabilities.
"""

from __future__ import annotations

import inspect
from typing import Any

import array_api_compat
import numpy as np

__all__ = [
    "resolve_namespace",
    "check_namespace",
    "array_device",
    "compute_dtype",
    "check_floating",
    "check_float_dtype",
    "sum_to_shape",
    "to_numpy",
    "dtype_name",
]


#: The namespace of NumPy arrays, as ``array_api_compat.array_namespace`` returns it.
_NUMPY = array_api_compat.array_namespace(np.empty(0))


def _library_name(x: Any) -> str:
    """A short human name for the library an array comes from."""
    module = type(x).__module__.split(".")[0]
    return module if module else type(x).__name__


def _namespace_library(xp: Any) -> str | None:
    """``"numpy"`` for both ``numpy`` and ``array_api_compat.numpy``; None for
    anything that is not a module-like namespace."""
    name = getattr(xp, "__name__", None)
    if not isinstance(name, str) or not hasattr(xp, "asarray"):
        return None
    return name.removeprefix("array_api_compat.").split(".")[0]


def check_namespace(xp: Any) -> Any:
    """Raise ``TypeError`` unless ``xp`` is an Array API namespace (a module
    such as ``array_api_compat.numpy``); return it."""
    if _namespace_library(xp) is None:
        raise TypeError(f"xp must be an Array API namespace (a module such as array_api_compat.numpy), got {xp!r}")
    return xp


def resolve_namespace(named_arrays: dict[str, Any], xp: Any = None) -> Any:
    """Return the Array API namespace shared by ``named_arrays``.

    ``named_arrays`` maps argument names to arrays (``None`` entries are
    skipped). Arrays from two libraries raise ``TypeError`` and arrays on two
    devices raise ``ValueError``; both messages name the disagreeing arguments.
    When ``xp`` is given it is used as the namespace, after the same checks;
    it must be a namespace of the arrays' library (``TypeError`` otherwise).

    >>> import numpy as np
    >>> xp = resolve_namespace({"q": np.zeros(2), "k": np.ones(2)})
    >>> xp.__name__
    'array_api_compat.numpy'
    """
    present = {name: a for name, a in named_arrays.items() if a is not None}
    if xp is None and present and all(type(a) is np.ndarray for a in present.values()):
        return _NUMPY  # the common case, decided without a namespace lookup per array (all on "cpu")
    first_name: str = ""
    first_ns: Any = None
    first_device: Any = None
    for name, a in present.items():
        try:
            ns = array_api_compat.array_namespace(a)
        except TypeError as err:
            raise TypeError(
                f"{name} must be an array of an Array API library "
                f"(NumPy, CuPy, array-api-strict, ...), got {type(a).__name__}"
            ) from err
        if first_ns is None:
            first_name, first_ns, first_device = name, ns, array_api_compat.device(a)
            continue
        if ns is not first_ns:
            raise TypeError(
                f"{first_name} and {name} come from different array libraries "
                f"({_library_name(present[first_name])} and {_library_name(a)}); "
                "pass all arrays from one library"
            )
        device = array_api_compat.device(a)
        if device != first_device:
            raise ValueError(
                f"{first_name} and {name} are on different devices "
                f"({first_device} and {device}); move them to one device"
            )
    if xp is not None:
        check_namespace(xp)
        if first_ns is not None and _namespace_library(xp) != _namespace_library(first_ns):
            raise TypeError(
                f"xp is {xp.__name__}, but {first_name} is an array of {_library_name(present[first_name])}; "
                "pass xp=None to infer the namespace from the arrays"
            )
        # The arrays' own Array API view of that library (array_api_compat's
        # wrapper where the bare module, torch say, is not compliant).
        return first_ns if first_ns is not None else xp
    if first_ns is None:
        raise TypeError("no array arguments were given to resolve a namespace from")
    return first_ns


def array_device(x: Any) -> Any:
    """The device ``x`` lives on, for ``device=`` of new arrays: NumPy's
    ``"cpu"``; ``x.device`` where it is an attribute (CuPy, PyTorch,
    array-api-strict: 0.1 µs, where ``array_api_compat.device`` takes 1.4 to
    test ``x`` against each library it knows first, 2-core EPYC); else
    ``array_api_compat.device``'s answer (an old JAX's ``device()`` method,
    arrays without the attribute).

    >>> import numpy as np
    >>> array_device(np.zeros(3))
    'cpu'
    """
    if type(x) is np.ndarray:
        return "cpu"
    device = getattr(x, "device", None)
    if device is None or inspect.ismethod(device):
        return array_api_compat.device(x)
    return device


def compute_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype attention computes in for inputs of ``dtype``.

    float64 and float32 compute in themselves; narrower floats (float16,
    bfloat16) accumulate in float32. Always a dtype object as arrays report
    it (``dtype('float32')`` for NumPy, not the scalar type ``numpy.float32``).
    """
    if dtype == xp.float64 or dtype == xp.float32:
        return dtype
    return xp.result_type(xp.float32)


def check_floating(xp: Any, name: str, x: Any) -> None:
    """Raise ``TypeError`` unless ``x`` has a real floating dtype."""
    if type(x) is np.ndarray and x.dtype.kind == "f":  # NumPy's "real floating", without isdtype's parsing
        return
    if not xp.isdtype(x.dtype, "real floating"):
        raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")


def check_float_dtype(xp: Any, name: str, dtype: Any) -> None:
    """Raise ``TypeError`` unless ``dtype`` is a real floating dtype of ``xp``
    (a string such as ``"float32"`` or another library's dtype is not)."""
    try:
        ok = xp.isdtype(dtype, "real floating")
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise TypeError(f"{name} must be a real floating dtype of {xp.__name__} (e.g. xp.float32), got {dtype!r}")


def dtype_name(dtype: Any) -> str:
    """``"float32"`` whatever the library prints (``torch.float32``,
    ``array_api_strict.float32``); a name NumPy understands.

    >>> import numpy as np
    >>> dtype_name(np.dtype("float16"))
    'float16'
    """
    return str(dtype).rsplit(".", 1)[-1]


def to_numpy(x: Any) -> np.ndarray:
    """``x``'s values as a NumPy array, from any supported library and device:
    for host work (plots, MPI staging, the gradient checker's float64 sums),
    never for compute.

    CuPy copies with ``.get()``; PyTorch is detached and moved to the CPU;
    array-api-strict, which refuses ``__array__`` off its CPU device, is moved
    there first; anything else goes through ``np.asarray``, then DLPack. A
    NumPy array comes back as it is, and a CPU array may share its memory.

    >>> import numpy as np
    >>> to_numpy(np.arange(3)).tolist()
    [0, 1, 2]
    """
    library = _library_name(x)
    if library == "cupy":
        return x.get()
    if library == "torch":
        x = x.detach().cpu()
    try:
        return np.asarray(x)
    except (TypeError, ValueError, RuntimeError):
        pass
    if library == "array_api_strict":
        xps = array_api_compat.array_namespace(x)
        return np.asarray(xps.asarray(x, device=xps.Device("CPU_DEVICE"), copy=True))
    return np.from_dlpack(x)


def sum_to_shape(xp: Any, x: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``x`` over the axes that broadcasting added to reach ``x.shape``
    from ``shape``: the adjoint of ``broadcast_to(·, x.shape)``.

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> sum_to_shape(xp, np.ones((2, 3, 4)), (3, 1)).tolist()
    [[8.0], [8.0], [8.0]]
    """
    extra = x.ndim - len(shape)
    if extra > 0:
        x = xp.sum(x, axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if axes:
        x = xp.sum(x, axis=axes, keepdims=True)
    return x
