"""Attention as a (forward, backward) pair for npattn.check_gradients."""

from __future__ import annotations

import npattn


def attention_pair(options: dict, *, with_bias: bool):
    """``forward(q, k, v[, bias]) -> ((out, lse), residuals)`` and its backward
    returning ``(dq, dk, dv[, dbias])``; ``options`` are attention_forward's."""

    def forward(q, k, v, bias=None):
        extra = {"bias": bias} if with_bias else {}
        out, res = npattn.attention_forward(q, k, v, **options, **extra)
        return (out, res.lse), res

    def backward(cotangents, res):
        dout, dlse = cotangents
        g = npattn.attention_backward(dout, res, dlse=dlse)
        return (g.dq, g.dk, g.dv, g.dbias) if with_bias else (g.dq, g.dk, g.dv)

    return forward, backward


def check_attention_gradients(q, k, v, options: dict, **check_options):
    """Central-difference check of every input of attention (bias included
    when ``options`` has one); returns the GradcheckResult."""
    options = dict(options)
    bias = options.pop("bias", None)
    forward, backward = attention_pair(options, with_bias=bias is not None)
    inputs = [q, k, v] + ([bias] if bias is not None else [])
    names = ["q", "k", "v"] + (["bias"] if bias is not None else [])
    return npattn.check_gradients(forward, backward, inputs, names=names, **check_options)
