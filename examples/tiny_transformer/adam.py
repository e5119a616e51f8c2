r"""Adam with bias correction, global-norm clipping and a warm-up/cosine schedule.

Adam (Kingma & Ba, 2015), for each parameter ``p`` with gradient ``g`` at step ``t``::

    m = beta1 m + (1 - beta1) g             first moment
    v = beta2 v + (1 - beta2) g^2           second moment
    m_hat = m / (1 - beta1^t),  v_hat = v / (1 - beta2^t)
    p = p - lr_t * m_hat / (sqrt(v_hat) + eps)

Optimizers have no backward; this is the update rule, written out.
"""

from __future__ import annotations

import math

import numpy as np


class Adam:
    """Adam over a flat dict of NumPy arrays, updated in place.

    Parameters
    ----------
    params : dict of str to array
        The arrays to update (their moments are allocated here).
    betas : (float, float)
    eps : float
    """

    def __init__(self, params: dict, *, betas=(0.9, 0.98), eps: float = 1e-8):
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.t = 0
        self.m = {name: np.zeros_like(p) for name, p in params.items()}
        self.v = {name: np.zeros_like(p) for name, p in params.items()}

    def step(self, params: dict, grads: dict, lr: float) -> None:
        """One update of every ``params[name]`` with ``grads[name]``, in place."""
        self.t += 1
        c1 = 1.0 - self.beta1**self.t  # bias corrections
        c2 = 1.0 - self.beta2**self.t
        for name, p in params.items():
            g = grads[name]
            m, v = self.m[name], self.v[name]
            m *= self.beta1
            m += (1.0 - self.beta1) * g
            v *= self.beta2
            v += (1.0 - self.beta2) * (g * g)
            p -= lr * (m / c1) / (np.sqrt(v / c2) + self.eps)


def clip_grad_norm(grads: dict, max_norm: float) -> float:
    r"""Scale every gradient by ``min(1, max_norm / ||g||)``, in place, with
    ``||g||`` the norm of all gradients together; returns ``||g||`` before clipping."""
    norm = math.sqrt(sum(float(np.vdot(g, g)) for g in grads.values()))
    if norm > max_norm:
        for g in grads.values():
            g *= max_norm / norm
    return norm


def learning_rate(step: int, total: int, peak: float, warmup: int) -> float:
    r"""Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``peak / 10``.

    .. math::

        \eta_t = \eta\,t / t_w \ (t \le t_w),\qquad
        \eta_t = \eta\,\big(0.1 + 0.45\,(1 + \cos \pi\,\tfrac{t - t_w}{t_{\max} - t_w})\big)\ \text{after}
    """
    if step <= warmup:
        return peak * step / max(warmup, 1)
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(progress, 1.0))))
