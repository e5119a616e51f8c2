r"""Step 2 of the score pipeline: logit soft-capping (Gemma 2).

.. math::

    s' = c \tanh(s / c), \qquad \frac{\partial s'}{\partial s} = 1 - \tanh^2(s / c) = 1 - (s' / c)^2

applied to the raw product ``s = scale * q.k``, before the bias. Scores are
then bounded by ``|s'| < c``, which the fast path's bounds use. Elementwise,
so it works in any tile layout; the FlashAttention-4 way of writing softcap
as a score modification with its derivative beside it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["softcap_forward", "softcap_backward"]


def softcap_forward(xp: Any, s: Any, cap: float, *, out: Any = None) -> Any:
    """``cap * tanh(s / cap)``.

    ``out``: write the result there, in place (``out`` may be ``s``), with
    ufuncs that take ``out=``: the NumPy fast path's form of the same steps,
    which then passes the ``numpy`` module itself as ``xp``.

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> softcap_forward(xp, np.array([0.0, 1e6]), 5.0).tolist()
    [0.0, 5.0]
    >>> s = np.array([0.0, 1e6]); _ = softcap_forward(np, s, 5.0, out=s); s.tolist()
    [0.0, 5.0]
    """
    if out is None:
        return cap * xp.tanh(s / cap)
    xp.multiply(s, 1.0 / cap, out=out)
    xp.tanh(out, out=out)
    xp.multiply(out, cap, out=out)
    return out


def softcap_backward(xp: Any, capped: Any, cap: float, ds: Any, *, out: Any = None) -> Any:
    """The cotangent of the raw scores: ``ds * (1 - (capped / cap)**2)``,
    from the capped scores ``capped = cap * tanh(s / cap)``.

    ``out``: in place as in :func:`softcap_forward` (``out`` may be ``ds``);
    ``capped`` is then overwritten with ``1 - tanh**2``.

    >>> import numpy as np, array_api_compat.numpy as xp
    >>> softcap_backward(xp, np.array([0.0, 3.0]), 5.0, np.ones(2)).tolist()
    [1.0, 0.64]
    """
    if out is None:
        t = capped / cap  # tanh(s / cap)
        return ds * (1 - t * t)
    xp.multiply(capped, 1.0 / cap, out=capped)  # tanh(s / cap)
    xp.multiply(capped, capped, out=capped)
    xp.subtract(1.0, capped, out=capped)
    xp.multiply(ds, capped, out=out)
    return out
