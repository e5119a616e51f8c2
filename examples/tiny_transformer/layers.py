r"""Hand-written layers of the tiny transformer, each a forward/backward pair.

Weights use PyTorch's ``(out_features, in_features)`` layout, as
``npattn.mha`` does: a linear layer is ``y = x W^T + b``.

Dimension legend: B batch, T positions, D d_model, F MLP width (4 D),
V vocabulary, Tmax the longest context the position table holds.

Each backward is the chain rule written out; the derivations are one line
each in the docstrings, and :mod:`.checks` compares every one with central
differences through :func:`npattn.check_gradients`.
"""

from __future__ import annotations

import math

import numpy as np

# --- token + position embedding ----------------------------------------------


def embedding_forward(tok_emb, pos_emb, ids):
    r"""Token plus learned position embedding.

    .. math:: x_{bt} = E_{\mathrm{tok}}[\,\mathrm{ids}_{bt}\,] + E_{\mathrm{pos}}[\,t\,]

    Parameters
    ----------
    tok_emb : (V, D)
    pos_emb : (Tmax, D)
    ids : int array, (B, T) with T <= Tmax

    Returns
    -------
    x : (B, T, D)
    residuals : ``(ids, V, Tmax)``
    """
    T = ids.shape[1]
    x = tok_emb[ids] + pos_emb[:T]  # (B, T, D) gather + (T, D) broadcast over B
    return x, (ids, tok_emb.shape[0], pos_emb.shape[0])


def embedding_backward(dx, residuals):
    r"""Scatter-add for the gather, a batch sum for the broadcast.

    .. math::

        dE_{\mathrm{tok}}[v] = \sum_{b,t:\ \mathrm{ids}_{bt} = v} dx_{bt},\qquad
        dE_{\mathrm{pos}}[t] = \sum_b dx_{bt}\ (t < T),\ 0\ \text{beyond}

    Returns ``(dtok_emb (V, D), dpos_emb (Tmax, D), None)``; ``ids`` are integers.
    """
    ids, V, Tmax = residuals
    _B, T, D = dx.shape
    dtok = np.zeros((V, D), dtype=dx.dtype)  # (V, D)
    np.add.at(dtok, ids, dx)  # rows ids[b, t] += dx[b, t]: repeated ids accumulate
    dpos = np.zeros((Tmax, D), dtype=dx.dtype)  # (Tmax, D)
    dpos[:T] = dx.sum(axis=0)  # (T, D)
    return dtok, dpos, None


# --- layer norm ----------------------------------------------------------------

LN_EPS = 1e-5


def layer_norm_forward(x, gamma, beta):
    r"""Layer normalization over the last axis.

    .. math::

        \mu = \overline{x},\quad \sigma^{-1} = \big(\overline{(x - \mu)^2} + \epsilon\big)^{-1/2},
        \quad \hat x = (x - \mu)\,\sigma^{-1},\quad y = \gamma \odot \hat x + \beta

    (bars: means over the last axis, D). Shapes: x (..., D), gamma and beta
    (D,); returns y (..., D) and the residuals ``(xhat, rstd, gamma)``.
    """
    mu = x.mean(axis=-1, keepdims=True)  # (..., 1)
    xc = x - mu  # (..., D)
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + LN_EPS)  # (..., 1)
    xhat = xc * rstd  # (..., D)
    return gamma * xhat + beta, (xhat, rstd, gamma)


def layer_norm_backward(dy, residuals):
    r"""With :math:`g = dy \odot \gamma`:

    .. math::

        dx = \sigma^{-1}\big(g - \overline{g} - \hat x\,\overline{g \odot \hat x}\big),\quad
        d\gamma = \textstyle\sum_{\text{rows}} dy \odot \hat x,\quad
        d\beta = \textstyle\sum_{\text{rows}} dy

    Returns ``(dx (..., D), dgamma (D,), dbeta (D,))``.
    """
    xhat, rstd, gamma = residuals
    rows = tuple(range(dy.ndim - 1))  # every axis but the normalized one
    g = dy * gamma  # (..., D)
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xhat * (g * xhat).mean(axis=-1, keepdims=True))  # (..., D)
    return dx, (dy * xhat).sum(axis=rows), dy.sum(axis=rows)  # (..., D), (D,), (D,)


# --- linear --------------------------------------------------------------------


def linear_forward(x, w, b):
    r"""``y = x W^T + b``: x (..., in), w (out, in), b (out,) -> y (..., out)."""
    return x @ w.T + b, (x, w)  # (..., out)


def linear_backward(dy, residuals):
    r"""``dx = dy W``, ``dW = dy^T x`` and ``db = sum dy`` over all leading axes.

    Returns ``(dx (..., in), dw (out, in), db (out,))``.
    """
    x, w = residuals
    dx = dy @ w  # (..., in)
    dy_rows = dy.reshape(-1, dy.shape[-1])  # (rows, out)
    x_rows = x.reshape(-1, x.shape[-1])  # (rows, in)
    dw = dy_rows.T @ x_rows  # (out, in)
    return dx, dw, dy_rows.sum(axis=0)  # (..., in), (out, in), (out,)


# --- GELU MLP --------------------------------------------------------------------

_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def gelu_forward(h):
    r"""GELU, tanh approximation (GPT-2, ``nn.GELU(approximate="tanh")``).

    .. math:: \mathrm{gelu}(h) = \tfrac12 h\,(1 + \tanh u),\qquad u = c\,(h + a h^3),\
              c = \sqrt{2/\pi},\ a = 0.044715

    Elementwise; returns ``(gelu(h), (h, tanh u))``.
    """
    t = np.tanh(_GELU_C * (h + _GELU_A * (h * h * h)))  # same shape as h; h*h*h, as h**3 calls pow()
    return 0.5 * h * (1.0 + t), (h, t)


def gelu_backward(dy, residuals):
    r""".. math:: \mathrm{gelu}'(h) = \tfrac12(1 + \tanh u) + \tfrac12 h\,(1 - \tanh^2 u)\,c\,(1 + 3 a h^2)"""
    h, t = residuals
    return dy * (0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * _GELU_C * (1.0 + 3.0 * _GELU_A * h * h))


def mlp_forward(x, w1, b1, w2, b2):
    r"""The position-wise feed-forward block.

    .. math:: y = \mathrm{gelu}(x W_1^T + b_1)\,W_2^T + b_2

    Shapes: x (B, T, D), w1 (F, D), b1 (F,), w2 (D, F), b2 (D,) -> y (B, T, D).
    """
    h, r1 = linear_forward(x, w1, b1)  # (B, T, F)
    a, r_act = gelu_forward(h)  # (B, T, F)
    y, r2 = linear_forward(a, w2, b2)  # (B, T, D)
    return y, (r1, r_act, r2)


def mlp_backward(dy, residuals):
    r"""The three backwards in reverse order:
    ``da, dW2, db2 = linear'(dy)``, ``dh = gelu'(h) da``, ``dx, dW1, db1 = linear'(dh)``.

    Returns ``(dx, dw1, db1, dw2, db2)``.
    """
    r1, r_act, r2 = residuals
    da, dw2, db2 = linear_backward(dy, r2)  # (B, T, F), (D, F), (D,)
    dh = gelu_backward(da, r_act)  # (B, T, F)
    dx, dw1, db1 = linear_backward(dh, r1)  # (B, T, D), (F, D), (F,)
    return dx, dw1, db1, dw2, db2
