r"""Step 2 of the score pipeline: logit soft-capping (Gemma 2).

.. math::

    t = \tanh(s / c), \qquad s' = c\, t, \qquad \frac{\partial s'}{\partial s} = 1 - t^2

applied to the raw product ``s = scale * q.k``, before the bias. Scores are
then bounded by ``|s'| < c``, which the fast path's bounds use. Elementwise,
so it works in any tile layout; the FlashAttention-4 way of writing softcap
as a score modification with its derivative beside it.

The generic pair (:func:`softcap_forward`, :func:`softcap_backward`) works
on any namespace. The NumPy fast path uses the in-place pair
(:func:`softcap_forward_inplace`, :func:`softcap_backward_inplace`), the
same formulas written with ``out=``: it keeps ``t`` for the derivative
rather than ``s'``, and may fold ``1 / c`` into the scale of ``Q`` so that
its product already is ``s / c`` (``ratio=True``), one pass fewer each way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["softcap_forward", "softcap_backward", "softcap_forward_inplace", "softcap_backward_inplace"]


def softcap_forward(xp: Any, s: Any, cap: float) -> Any:
    """``cap * tanh(s / cap)``.

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> softcap_forward(xp, np.array([0.0, 1e6]), 5.0).tolist()
    [0.0, 5.0]
    """
    return cap * xp.tanh(s / cap)


def softcap_backward(xp: Any, capped: Any, cap: float, ds: Any) -> Any:
    """The cotangent of the raw scores, ``ds * (1 - t**2)``, from the capped
    scores ``capped = cap * tanh(s / cap)`` (so ``t = capped / cap``).

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> softcap_backward(xp, np.array([0.0, 3.0]), 5.0, np.ones(2)).tolist()
    [1.0, 0.64]
    """
    t = capped / cap
    return ds * (1 - t * t)


def softcap_forward_inplace(xp: Any, x: Any, cap: Any, *, out: Any, ratio: bool) -> None:
    """:func:`softcap_forward` in place: ``x`` becomes ``t = tanh(s / cap)``
    and ``out`` (of ``x``'s shape, or ``x`` itself) ``cap * t``. ``x`` holds
    ``s``, or already ``s / cap`` when ``ratio``. ``xp`` is a namespace
    whose functions take ``out=`` (the ``numpy`` module).

    >>> import numpy as np
    >>> x, out = np.array([0.0, 1e6]), np.empty(2)
    >>> softcap_forward_inplace(np, x, 5.0, out=out, ratio=False)
    >>> out.tolist(), x.tolist()
    ([0.0, 5.0], [0.0, 1.0])
    """
    if not ratio:
        xp.multiply(x, 1.0 / cap, out=x)  # s / cap
    xp.tanh(x, out=x)  # t
    xp.multiply(x, cap, out=out)  # cap t


def softcap_backward_inplace(xp: Any, t: Any, ds: Any) -> None:
    """:func:`softcap_backward` in place from ``t = tanh(s / cap)``:
    ``ds <- ds - ds t**2 = ds (1 - t**2)``; ``t`` is overwritten.

    >>> import numpy as np
    >>> t, ds = np.array([0.0, 0.6]), np.ones(2)
    >>> softcap_backward_inplace(np, t, ds)
    >>> ds.tolist()
    [1.0, 0.64]
    """
    xp.multiply(t, t, out=t)  # t^2
    xp.multiply(t, ds, out=t)  # ds t^2
    xp.subtract(ds, t, out=ds)
