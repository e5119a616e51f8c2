r"""Softmax cross-entropy, averaged over the target positions only.

.. math::

    \mathcal L = \frac{1}{M}\sum_{b,t} m_{bt}\,\big(\mathrm{lse}(z_{bt}) - z_{bt,\,y_{bt}}\big),
    \qquad M = \sum_{b,t} m_{bt}

    \frac{\partial\mathcal L}{\partial z_{bt}}
        = \frac{m_{bt}}{M}\,\big(\mathrm{softmax}(z_{bt}) - \mathrm{onehot}(y_{bt})\big)

Dimension legend: B batch, T positions, V vocabulary; ``z`` logits
(B, T, V), ``y`` integer targets (B, T), ``m`` a bool mask (B, T) that is
True where the position counts (the output digits).
"""

from __future__ import annotations

import numpy as np


def cross_entropy_forward(logits, targets, mask):
    """Masked mean cross-entropy; returns ``(loss, residuals)`` with ``loss`` a 0-d array."""
    z_max = logits.max(axis=-1, keepdims=True)  # (B, T, 1)
    e = np.exp(logits - z_max)  # (B, T, V)
    sum_e = e.sum(axis=-1, keepdims=True)  # (B, T, 1)
    lse = (z_max + np.log(sum_e))[..., 0]  # (B, T)
    z_y = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
    m = mask.astype(logits.dtype)  # (B, T)
    count = max(float(m.sum()), 1.0)  # M
    loss = ((lse - z_y) * m).sum() / count  # ()
    probs = e / sum_e  # (B, T, V)
    return np.asarray(loss, dtype=logits.dtype), (probs, targets, m, count)


def cross_entropy_backward(dloss, residuals):
    """``dz = dloss * m / M * (softmax(z) - onehot(y))``; returns ``(dlogits, None, None)``."""
    probs, targets, m, count = residuals
    dz = probs.copy()  # (B, T, V)
    np.put_along_axis(
        dz, targets[..., None], np.take_along_axis(dz, targets[..., None], axis=-1) - 1.0, axis=-1
    )  # softmax - onehot
    dz *= (np.asarray(dloss, dtype=probs.dtype) * m / count)[..., None]  # (B, T, V)
    return dz, None, None


def token_accuracy(logits, targets, mask) -> float:
    """Fraction of masked positions where ``argmax_v z == y`` (teacher forcing)."""
    correct = (logits.argmax(axis=-1) == targets) & mask  # (B, T)
    return float(correct.sum()) / max(int(mask.sum()), 1)
