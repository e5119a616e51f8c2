r"""Gradient checks of every hand-written backward, on tiny float64 inputs.

For each layer, :func:`npattn.check_gradients` compares the backward with
central differences of the forward: a random vector-Jacobian product
``<backward(u), w>`` against ``(L(x + eps w) - L(x - eps w)) / 2 eps`` with
``L = <u, forward(x)>``, and, where every array has at most 256 entries, the
full Jacobian element by element. The last check runs the assembled model
end to end (VJP only: it has thousands of parameters), which also checks how
the layers are wired together, the residual connections and npattn's MHA
included.

Run this whenever a backward changes: a wrong derivative shows up here as a
named input and element, long before it shows up as a loss that will not fall.
"""

from __future__ import annotations

import numpy as np

import npattn
from npattn import mha_backward, mha_forward, mha_init

from .layers import (
    embedding_backward,
    embedding_forward,
    layer_norm_backward,
    layer_norm_forward,
    mlp_backward,
    mlp_forward,
)
from .loss import cross_entropy_backward, cross_entropy_forward
from .model import Config, init_params, model_backward, model_forward


def _mha_pair(keys: list[str], num_heads: int):
    """``forward(x, *params) -> (y, res)`` and ``backward(dy, res) -> (dx, *dparams)`` around
    ``npattn.mha_forward`` (causal self-attention), params passed as separate arrays in ``keys`` order."""

    def forward(x, *arrays):
        return mha_forward(dict(zip(keys, arrays)), x, num_heads=num_heads, causal=True)

    def backward(dy, res):
        g = mha_backward(dy, res)
        return (g.dx, *(g.dparams[k] for k in keys))

    return forward, backward


def _model_pair(keys: list[str], ids, cfg: Config):
    """The whole model as a function of its parameters (``ids`` fixed): logits (B, T, V)."""

    def forward(*arrays):
        return model_forward(dict(zip(keys, arrays)), ids, cfg)

    def backward(dlogits, res):
        g = model_backward(dlogits, res)
        return tuple(g[k] for k in keys)

    return forward, backward


def run_checks(*, seed: int = 0) -> dict[str, npattn.GradcheckResult]:
    """Check every layer; returns ``{layer name: GradcheckResult}`` (failures are
    recorded in the results, not raised)."""
    rng = np.random.default_rng(seed)
    B, T, D, F, V, N = 2, 3, 4, 6, 5, 2  # tiny: every Jacobian has at most 256 entries
    ids = rng.integers(0, V, size=(B, T))  # (B, T)
    results = {}

    def check(name, forward, backward, inputs, names, **kw):
        results[name] = npattn.check_gradients(
            forward, backward, inputs, names=names, seed=seed, raise_on_failure=False, **kw
        )

    check(
        "embedding",
        embedding_forward,
        embedding_backward,
        [rng.standard_normal((V, D)), rng.standard_normal((T + 1, D)), ids],
        ["tok_emb", "pos_emb", "ids"],
    )
    check(
        "layer norm",
        layer_norm_forward,
        layer_norm_backward,
        [rng.standard_normal((B, T, D)), 1 + 0.1 * rng.standard_normal(D), rng.standard_normal(D)],
        ["x", "gamma", "beta"],
    )
    check(
        "MLP (GELU)",
        mlp_forward,
        mlp_backward,
        [
            rng.standard_normal((B, T, D)),
            rng.standard_normal((F, D)),
            rng.standard_normal(F),
            rng.standard_normal((D, F)),
            rng.standard_normal(D),
        ],
        ["x", "w1", "b1", "w2", "b2"],
    )
    mha_params = mha_init(D, N, dtype=np.float64, seed=seed)
    keys = list(mha_params)
    for k in keys:  # random biases, so their gradients are exercised away from 0
        if k.endswith("bias"):
            mha_params[k] = rng.standard_normal(mha_params[k].shape)
    check(
        "npattn MHA (causal)",
        *_mha_pair(keys, N),
        [rng.standard_normal((B, T, D)), *(np.asarray(mha_params[k]) for k in keys)],
        ["x", *keys],
    )
    targets = rng.integers(0, V, size=(B, T))  # (B, T)
    mask = np.array([[False, True, True], [False, False, True]])  # (B, T)
    check(
        "cross-entropy (masked)",
        cross_entropy_forward,
        cross_entropy_backward,
        [rng.standard_normal((B, T, V)), targets, mask],
        ["logits", "targets", "mask"],
    )
    cfg = Config(vocab_size=V, max_len=T + 1, d_model=D, num_heads=N, num_layers=2, mlp_ratio=2)
    params = init_params(cfg, seed=seed, dtype=np.float64)
    for k in params:  # move every parameter off its initial value (gammas 1, biases 0)
        params[k] = params[k] + 0.1 * rng.standard_normal(params[k].shape)
    keys = list(params)
    check("whole model", *_model_pair(keys, ids, cfg), [params[k] for k in keys], keys, jacobian=False)
    return results


def report(results: dict[str, npattn.GradcheckResult]) -> str:
    """One line per layer; the full :class:`npattn.GradcheckResult` text of any failure."""
    lines = []
    for name, r in results.items():
        how = "full Jacobian + random VJP" if r.jacobian_checked else "random VJP"
        worst = max(r.max_abs_error.values(), default=0.0)
        status = "ok    " if r.ok else "FAILED"
        lines.append(f"  {status} {name:<24} {how:<26} {len(r.names):>2} inputs, max |numeric - analytic| {worst:.1e}")
        if not r.ok:
            lines.append("    " + str(r).replace("\n", "\n    "))
    return "\n".join(lines)
