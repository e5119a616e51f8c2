"""PyTorch as an optional float64 oracle for outputs and gradients (skipped
where torch is not installed): ``scaled_dot_product_attention`` for the mask
features, and plain torch autograd code for the variants of issue 14 (sinks
as an extra key column with a zero value row, softcap by tanh, ALiBi and
segment ids as an explicit bias and mask), compared on out, lse and every
gradient, dsinks and dalibi_slopes included."""

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


# --- the variants of issue 14, as plain float64 torch autograd ---------------------------


def _torch_attention(
    q, k, v, *, scale, bias, mask, softcap, slopes, offset, sinks, q_ids, kv_ids, q_len, kv_len, causal
):
    """Attention written out in torch, every variant explicit: the softcap by
    tanh, ALiBi as a bias built from the slopes, segments as a bool mask, the
    sink as one more key column whose score is ``sinks_n`` and whose value row
    is zeros. Returns ``(out, lse)``; rows with nothing visible (not even a
    sink) give out 0, lse -inf and no gradient."""
    N, T, S = q.shape[-3], q.shape[-2], k.shape[-2]
    G = N // k.shape[-3]
    k, v = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)  # (B, N, S, H)
    s = scale * q @ k.transpose(-1, -2)  # (B, N, T, S)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    rows = torch.arange(T)[:, None]  # (T, 1)
    cols = torch.arange(S)[None, :]  # (1, S)
    positions = rows + offset[:, None, None, None]  # (B, 1, T, 1)
    if slopes is not None:
        s = s - slopes[..., None, None] * (positions - cols).abs()  # (B, N, T, S)
    visible = (rows < q_len[:, None, None, None]) & (cols < kv_len[:, None, None, None])  # (B, 1, T, S)
    if mask is not None:
        visible = visible & mask
    if causal:
        visible = visible & (cols <= positions)
    if q_ids is not None:
        visible = visible & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])
    s = s.masked_fill(~visible, -torch.inf)
    if sinks is not None:
        padded = (rows >= q_len[:, None, None, None]).expand(-1, N, -1, 1)  # (B, N, T, 1): no sink there
        column = sinks.expand(q.shape[0], N)[..., None, None].expand(-1, -1, T, 1)  # (B, N, T, 1)
        s = torch.cat([s, column.masked_fill(padded, -torch.inf)], dim=-1)  # (B, N, T, S + 1)
        v = torch.cat([v, torch.zeros_like(v[..., :1, :])], dim=-2)  # (B, N, S + 1, Hv): the sink's value 0
    empty = torch.isneginf(s).all(dim=-1)  # (B, N, T)
    s = s.masked_fill(empty[..., None], 0.0)  # any finite value: those rows are dropped below
    lse = torch.logsumexp(s, dim=-1)
    out = torch.exp(s - lse[..., None]) @ v
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, -torch.inf)


VARIANT_CASES = {
    "sinks": dict(sinks=True),
    "sinks + a fully masked row + padded rows": dict(sinks=True, mask=True, q_lengths=[5, 3], kv_lengths=[6, 4]),
    "softcap + bias": dict(softcap=0.8, bias=True),
    "alibi bottom_right + lengths": dict(alibi=True, align="bottom_right", q_lengths=[4, 5], kv_lengths=[6, 3]),
    "segments": dict(segments=True),
    "combined, GQA": dict(
        sinks=True, softcap=1.2, alibi=True, segments=True, bias=True, mask=True, causal=True, K=2, kv_lengths=[6, 5]
    ),
}


@pytest.mark.parametrize("path", ["dense", "chunked", "generic"])
@pytest.mark.parametrize("case", list(VARIANT_CASES))
def test_variants_match_torch_autograd(case, path, monkeypatch):
    spec = VARIANT_CASES[case]
    B, N, T, S, H = 2, 4, 5, 6, 3
    K = spec.get("K", N)
    rng = np.random.default_rng(len(case))
    q, k, v = rng.standard_normal((B, N, T, H)), rng.standard_normal((B, K, S, H)), rng.standard_normal((B, K, S, 2))
    dout, dlse = rng.standard_normal((B, N, T, 2)), rng.standard_normal((B, N, T))
    options: dict = dict(softcap=spec.get("softcap"), causal=spec.get("causal", False))
    align = spec.get("align", "bottom_right" if spec.get("alibi") or spec.get("causal") else None)
    if align is not None:
        options["align"] = align
    if spec.get("mask"):
        options["mask"] = rng.random((B, 1, T, S)) < 0.7
        options["mask"][0, 0, 1] = False  # a row that sees no key
    if spec.get("bias"):
        options["bias"] = rng.standard_normal((N, T, S))
    if spec.get("sinks"):
        options["sinks"] = rng.standard_normal(N)
    if spec.get("alibi"):
        options["alibi_slopes"] = npattn.alibi_slopes(N) * 2
    if spec.get("segments"):
        options["q_segment_ids"] = np.array([[0, 0, 1, 1, 2], [0, 1, 1, 1, 1]])
        options["kv_segment_ids"] = np.array([[0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]])
    for name in ("q_lengths", "kv_lengths"):
        if name in spec:
            options[name] = np.array(spec[name])
    if path == "generic":
        monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    out, res = npattn.attention_forward(
        q, k, v, impl="dense" if path == "dense" else "chunked", block_q=2, block_k=4, **options
    )
    g = npattn.attention_backward(dout, res, dlse=dlse)

    leaves = {name: torch.tensor(a, requires_grad=True) for name, a in dict(q=q, k=k, v=v).items()}
    for name in ("bias", "sinks", "alibi_slopes"):
        if name in options:
            leaves[name] = torch.tensor(options[name], requires_grad=True)
    q_len = torch.tensor(options.get("q_lengths", np.full(B, T)))
    kv_len = torch.tensor(options.get("kv_lengths", np.full(B, S)))
    offset = kv_len - q_len if align == "bottom_right" else torch.zeros(B, dtype=torch.int64)
    t_out, t_lse = _torch_attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        scale=1 / np.sqrt(H),
        bias=leaves.get("bias"),
        mask=torch.tensor(options["mask"]) if "mask" in options else None,
        softcap=options["softcap"],
        slopes=leaves.get("alibi_slopes"),
        offset=offset,
        sinks=leaves.get("sinks"),
        q_ids=torch.tensor(options["q_segment_ids"]) if "q_segment_ids" in options else None,
        kv_ids=torch.tensor(options["kv_segment_ids"]) if "kv_segment_ids" in options else None,
        q_len=q_len,
        kv_len=kv_len,
        causal=options["causal"],
    )
    finite = torch.isfinite(t_lse)
    loss = (t_out * torch.tensor(dout)).sum() + torch.where(finite, t_lse * torch.tensor(dlse), 0.0).sum()
    loss.backward()

    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(res.lse), ~finite.numpy())
    np.testing.assert_allclose(res.lse[finite.numpy()], t_lse[finite].detach().numpy(), rtol=0, atol=1e-12)
    grads = dict(q=g.dq, k=g.dk, v=g.dv, bias=g.dbias, sinks=g.dsinks, alibi_slopes=g.dalibi_slopes)
    for name, leaf in leaves.items():
        np.testing.assert_allclose(grads[name], leaf.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)
    for name in ("bias", "sinks", "alibi_slopes"):
        if name not in leaves:
            assert grads[name] is None, name
