"""Attention as a (forward, backward) pair for npattn.check_gradients.

The differentiable inputs are q, k, v and, when the options hold them, the
float parameters ``bias``, ``sinks`` and ``alibi_slopes`` (their gradients are
AttentionGrads' ``dbias``, ``dsinks`` and ``dalibi_slopes``).
"""

from __future__ import annotations

import npattn

#: Options with a gradient: (option name, AttentionGrads field).
PARAMETERS = (("bias", "dbias"), ("sinks", "dsinks"), ("alibi_slopes", "dalibi_slopes"))


def attention_pair(options: dict, *, with_bias: bool = False, params: tuple[str, ...] | None = None):
    """``forward(q, k, v, *params) -> ((out, lse), residuals)`` and its
    backward returning ``(dq, dk, dv, *dparams)``; ``options`` are
    attention_forward's, ``params`` the names (from :data:`PARAMETERS`) that
    are passed as inputs, in that order (``with_bias=True`` is ``("bias",)``)."""
    if params is None:
        params = ("bias",) if with_bias else ()
    fields = dict(PARAMETERS)
    unknown = [name for name in params if name not in fields]
    assert not unknown, f"no gradient for {unknown}"

    def forward(q, k, v, *values):
        out, res = npattn.attention_forward(q, k, v, **options, **dict(zip(params, values)))
        return (out, res.lse), res

    def backward(cotangents, res):
        dout, dlse = cotangents
        g = npattn.attention_backward(dout, res, dlse=dlse)
        return (g.dq, g.dk, g.dv) + tuple(getattr(g, fields[name]) for name in params)

    return forward, backward


def check_attention_gradients(q, k, v, options: dict, **check_options):
    """Central-difference check of every input of attention (bias, sinks and
    alibi_slopes included when ``options`` has them); returns the GradcheckResult."""
    options = dict(options)
    params = tuple(name for name, _ in PARAMETERS if options.get(name) is not None)
    values = [options.pop(name) for name in params]
    forward, backward = attention_pair(options, params=params)
    return npattn.check_gradients(
        forward, backward, [q, k, v, *values], names=["q", "k", "v", *params], **check_options
    )
