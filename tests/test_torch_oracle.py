"""PyTorch's scaled_dot_product_attention as an optional float64 oracle for
outputs and gradients (skipped where torch is not installed)."""

from __future__ import annotations

import numpy as np
import pytest

import npattn

torch = pytest.importorskip("torch")
F = torch.nn.functional

RNG = np.random.default_rng(21)

CASES = {
    "plain": dict(),
    "bool mask": dict(mask=True),
    "float bias": dict(bias=True),
    "causal": dict(causal=True),
    "GQA causal": dict(causal=True, K=2),
    "scale": dict(scale=0.37),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", ["dense", "chunked"])
def test_matches_torch_sdpa_outputs_and_gradients(case, impl):
    spec = CASES[case]
    B, N, T, S, H = 2, 4, 5, 5, 3
    K = spec.get("K", N)
    q, k, v = RNG.standard_normal((B, N, T, H)), RNG.standard_normal((B, K, S, H)), RNG.standard_normal((B, K, S, H))
    dout = RNG.standard_normal((B, N, T, H))
    mask = RNG.random((B, 1, T, S)) < 0.7 if spec.get("mask") else None
    if mask is not None:
        mask[..., 0] = True  # fully masked rows are tested against npattn's own semantics elsewhere
    bias = RNG.standard_normal((N, T, S)) if spec.get("bias") else None
    options = dict(causal=spec.get("causal", False), scale=spec.get("scale"))

    out, res = npattn.attention_forward(q, k, v, mask=mask, bias=bias, impl=impl, block_q=2, block_k=3, **options)
    g = npattn.attention_backward(dout, res)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    attn_mask = None
    if mask is not None:
        attn_mask = torch.tensor(mask)
    if bias is not None:
        attn_mask = torch.tensor(bias, requires_grad=True)
    t_out = F.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=attn_mask, is_causal=options["causal"], scale=options["scale"], enable_gqa=K != N
    )
    t_out.backward(torch.tensor(dout))
    np.testing.assert_allclose(out, t_out.detach().numpy(), atol=1e-12)
    for mine, theirs in ((g.dq, tq), (g.dk, tk), (g.dv, tv)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), atol=1e-12)
    if bias is not None:
        np.testing.assert_allclose(g.dbias, attn_mask.grad.numpy(), atol=1e-12)
