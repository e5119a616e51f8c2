r"""A pre-norm, decoder-only transformer, assembled from the hand-written layers
and ``npattn``'s multi-head attention, with its backward written out.

.. math::

    x^{(0)} &= E_{\mathrm{tok}}[\mathrm{ids}] + E_{\mathrm{pos}}[t] \\
    x &\leftarrow x + \mathrm{MHA}_{\mathrm{causal}}(\mathrm{LN}_1(x)) \qquad \text{(each of the layers)} \\
    x &\leftarrow x + \mathrm{MLP}(\mathrm{LN}_2(x)) \\
    z &= \mathrm{LN}_f(x)\,W_{\mathrm{head}}^T + b_{\mathrm{head}}

Backward: the same steps in reverse; a residual ``x + f(LN(x))`` passes its
cotangent ``dx`` straight through and adds ``LN'(f'(dx))``.

Dimension legend: B batch, T positions, D d_model, N heads, H = D / N, F
MLP width, V vocabulary.

Parameters live in one flat dict, keyed ``"tok_emb"``, ``"block0.ln1.gamma"``,
``"block0.attn.q_weight"`` (the keys of ``npattn.mha_init`` after
``"blockI.attn."``), ``"block0.mlp.w1"``, ... ``"head.weight"``; the
gradients come back in a dict with the same keys, which is all
:class:`~.adam.Adam` needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npattn import mha_backward, mha_forward, mha_init

from .layers import (
    embedding_backward,
    embedding_forward,
    layer_norm_backward,
    layer_norm_forward,
    linear_backward,
    linear_forward,
    mlp_backward,
    mlp_forward,
)


@dataclass(frozen=True)
class Config:
    """Model sizes: V vocab_size, Tmax max_len, D d_model, N num_heads, layers, F = mlp_ratio * D."""

    vocab_size: int
    max_len: int
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4


def init_params(cfg: Config, *, seed: int = 0, dtype=np.float32) -> dict:
    """Fresh parameters: embeddings ~ N(0, 0.02^2) (GPT-2), layer norms at
    (1, 0), attention from ``npattn.mha_init`` (PyTorch's initialization),
    MLP and head weights ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (``nn.Linear``),
    biases 0."""
    rng = np.random.default_rng(seed)
    V, D, F = cfg.vocab_size, cfg.d_model, cfg.mlp_ratio * cfg.d_model

    def uniform(out_features, in_features):
        bound = 1.0 / np.sqrt(in_features)
        return rng.uniform(-bound, bound, size=(out_features, in_features)).astype(dtype)

    p = {
        "tok_emb": (0.02 * rng.standard_normal((V, D))).astype(dtype),  # (V, D)
        "pos_emb": (0.02 * rng.standard_normal((cfg.max_len, D))).astype(dtype),  # (Tmax, D)
    }
    for i in range(cfg.num_layers):
        pre = f"block{i}."
        p[pre + "ln1.gamma"], p[pre + "ln1.beta"] = np.ones(D, dtype), np.zeros(D, dtype)
        # q/k/v/out weights (D, D) and biases (D,); a seed per layer, or every layer starts the same
        attn = mha_init(D, cfg.num_heads, dtype=dtype, seed=seed * 1000 + i)
        p.update({pre + "attn." + key: np.asarray(a) for key, a in attn.items()})
        p[pre + "ln2.gamma"], p[pre + "ln2.beta"] = np.ones(D, dtype), np.zeros(D, dtype)
        p[pre + "mlp.w1"], p[pre + "mlp.b1"] = uniform(F, D), np.zeros(F, dtype)  # (F, D), (F,)
        p[pre + "mlp.w2"], p[pre + "mlp.b2"] = uniform(D, F), np.zeros(D, dtype)  # (D, F), (D,)
    p["ln_f.gamma"], p["ln_f.beta"] = np.ones(D, dtype), np.zeros(D, dtype)
    p["head.weight"], p["head.bias"] = uniform(V, D), np.zeros(V, dtype)  # (V, D), (V,)
    return p


def _sub(params: dict, prefix: str) -> dict:
    """The entries under ``prefix`` with the prefix removed: ``_sub(p, "block0.attn.")``."""
    return {key[len(prefix) :]: a for key, a in params.items() if key.startswith(prefix)}


def model_forward(params: dict, ids, cfg: Config, *, need_weights: bool = False):
    """Logits for every position, and the residuals of every layer.

    Parameters
    ----------
    params : dict
        As made by :func:`init_params`.
    ids : int array, (B, T), T <= cfg.max_len
    cfg : Config
    need_weights : bool
        Keep each layer's attention probabilities (``residuals["weights"]``,
        a list of (B, N, T, T) arrays, one per layer) for plotting.

    Returns
    -------
    logits : (B, T, V)
    residuals : dict
    """
    res = {"blocks": [], "weights": []}
    x, res["emb"] = embedding_forward(params["tok_emb"], params["pos_emb"], ids)  # (B, T, D)
    for i in range(cfg.num_layers):
        pre = f"block{i}."
        h, r_ln1 = layer_norm_forward(x, params[pre + "ln1.gamma"], params[pre + "ln1.beta"])  # (B, T, D)
        a, r_attn = mha_forward(
            _sub(params, pre + "attn."), h, num_heads=cfg.num_heads, causal=True, need_weights=need_weights
        )  # (B, T, D)
        x = x + a  # (B, T, D)
        h, r_ln2 = layer_norm_forward(x, params[pre + "ln2.gamma"], params[pre + "ln2.beta"])  # (B, T, D)
        m, r_mlp = mlp_forward(
            h, params[pre + "mlp.w1"], params[pre + "mlp.b1"], params[pre + "mlp.w2"], params[pre + "mlp.b2"]
        )  # (B, T, D)
        x = x + m  # (B, T, D)
        res["blocks"].append((r_ln1, r_attn, r_ln2, r_mlp))
        if need_weights:
            res["weights"].append(r_attn.weights)  # (B, N, T, T)
    h, res["ln_f"] = layer_norm_forward(x, params["ln_f.gamma"], params["ln_f.beta"])  # (B, T, D)
    logits, res["head"] = linear_forward(h, params["head.weight"], params["head.bias"])  # (B, T, V)
    return logits, res


def model_backward(dlogits, residuals) -> dict:
    """Gradients of every parameter from the cotangent of the logits ``(B, T, V)``;
    a dict with the keys of ``params``."""
    g = {}
    dh, g["head.weight"], g["head.bias"] = linear_backward(dlogits, residuals["head"])  # (B, T, D)
    dx, g["ln_f.gamma"], g["ln_f.beta"] = layer_norm_backward(dh, residuals["ln_f"])  # (B, T, D)
    for i in reversed(range(len(residuals["blocks"]))):
        pre = f"block{i}."
        r_ln1, r_attn, r_ln2, r_mlp = residuals["blocks"][i]
        # x = x + MLP(LN2(x))
        dh, g[pre + "mlp.w1"], g[pre + "mlp.b1"], g[pre + "mlp.w2"], g[pre + "mlp.b2"] = mlp_backward(dx, r_mlp)
        dln, g[pre + "ln2.gamma"], g[pre + "ln2.beta"] = layer_norm_backward(dh, r_ln2)  # (B, T, D)
        dx = dx + dln  # (B, T, D)
        # x = x + MHA(LN1(x))
        attn = mha_backward(dx, r_attn)  # dx (B, T, D), dparams keyed like mha_init's dict
        g.update({pre + "attn." + key: d for key, d in attn.dparams.items()})
        dln, g[pre + "ln1.gamma"], g[pre + "ln1.beta"] = layer_norm_backward(attn.dx, r_ln1)  # (B, T, D)
        dx = dx + dln  # (B, T, D)
    g["tok_emb"], g["pos_emb"], _ = embedding_backward(dx, residuals["emb"])  # (V, D), (Tmax, D)
    return g


def greedy_decode(params: dict, prompt, cfg: Config, num_tokens: int):
    """Append ``num_tokens`` tokens to ``prompt`` (B, P), each the argmax of the
    model's next-token logits given everything before it (no teacher forcing;
    the whole prefix is recomputed each step, which is fine at these sizes).
    Returns the new tokens, (B, num_tokens)."""
    seq = prompt  # (B, P)
    for _ in range(num_tokens):
        logits, _ = model_forward(params, seq, cfg)  # (B, P + i, V)
        seq = np.concatenate([seq, logits[:, -1].argmax(axis=-1)[:, None]], axis=1)  # (B, P + i + 1)
    return seq[:, prompt.shape[1] :]  # (B, num_tokens)
