"""PyTorch as an optional float64 oracle for outputs and gradients (skipped
where torch is not installed): ``scaled_dot_product_attention`` for the mask
features, and plain torch autograd code for the variants of issue 14 (sinks
as an extra key column with a zero value row, softcap by tanh, ALiBi and
segment ids as an explicit bias and mask), compared on out, lse and every
gradient, dsinks and dalibi_slopes included; and for the user modifications
of issue 15, T5's relative-position bias (buckets by the transformers
formula in torch, the bias gathered from the table by torch indexing, so
autograd scatters d table) and a document mask given as ``mask_mod`` or as a
``block_mask``, on the dense path, the NumPy fast path and the generic
chunked path; and for the derivative modes of issue 16, ``torch.func`` on
plain float64 torch attention (matmul, masked_fill, softmax, GQA by
``repeat_interleave``): ``jvp`` for ``attention_jvp``, ``jvp`` of the ``vjp``
pullback for ``attention_backward_jvp`` and ``vjp`` of that pullback for
``attention_double_backward``."""

from __future__ import annotations

import math

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


def _backprop_and_compare(out, lse, grads, t_out, t_lse, leaves, dout, dlse) -> None:
    """Back-propagate ``<dout, out> + <dlse, lse>`` (finite lse only) through
    torch's graph; check npattn's out, lse (its -inf rows included) and each
    leaf's gradient against torch's to 1e-12."""
    finite = torch.isfinite(t_lse)
    loss = (t_out * torch.tensor(dout)).sum() + torch.where(finite, t_lse * torch.tensor(dlse), 0.0).sum()
    loss.backward()
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), ~finite.numpy())
    np.testing.assert_allclose(lse[finite.numpy()], t_lse[finite].detach().numpy(), rtol=0, atol=1e-12)
    for name, leaf in leaves.items():
        np.testing.assert_allclose(grads[name], leaf.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)


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
    grads = dict(q=g.dq, k=g.dk, v=g.dv, bias=g.dbias, sinks=g.dsinks, alibi_slopes=g.dalibi_slopes)
    _backprop_and_compare(out, res.lse, grads, t_out, t_lse, leaves, dout, dlse)
    for name in ("bias", "sinks", "alibi_slopes"):
        if name not in leaves:
            assert grads[name] is None, name


# --- user modifications of issue 15, as plain float64 torch autograd -------------------


def _torch_t5_buckets(relative_position, *, num_buckets, max_distance, bidirectional):
    """T5's bucket of ``j - p_i``, as in transformers' ``T5Attention._relative_position_bucket``
    (float32 logarithm, as there), independent of npattn's."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).to(torch.int64) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.minimum(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.int64)
    large = torch.minimum(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(distance < max_exact, distance, large)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 16), (8, 6), (16, 64)])
def test_t5_buckets_match_the_transformers_formula(num_buckets, max_distance, bidirectional):
    relative = np.arange(-3000, 3000)
    options = dict(num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional)
    np.testing.assert_array_equal(
        npattn.t5_buckets(relative, **options), _torch_t5_buckets(torch.tensor(relative), **options).numpy()
    )


def _documents(S):
    """Document ids of key positions 0 .. S - 1: ragged documents of 3, 1, 4, ... tokens."""
    return np.repeat(np.arange(S), [3, 1, 4, 2, 5, 1, 3] + [S] * (S - 7))[:S]


MOD_CASES = {
    "relative bias": dict(relative=dict()),
    "relative bias, causal, one-sided": dict(relative=dict(bidirectional=False), causal=True, T=11),
    "relative bias after softcap and ALiBi, bias, GQA, bottom_right + lengths": dict(
        relative=dict(max_distance=8),
        softcap=1.5,
        alibi=True,
        bias=True,
        K=2,
        causal=True,
        align="bottom_right",
        q_lengths=[7, 4],
        kv_lengths=[11, 6],
    ),
    "document mask_mod": dict(documents="mask_mod"),
    "document mask_mod, causal": dict(documents="mask_mod", causal=True, T=11),
    "document block_mask": dict(documents="block_mask"),
    "document block_mask, causal": dict(documents="block_mask", causal=True, T=11),
    "document block_mask, causal bottom_right, a hidden row": dict(
        documents="block_mask", hidden_row=2, causal=True, align="bottom_right"
    ),
    "relative bias + document mask_mod, causal, GQA": dict(
        relative=dict(num_buckets=16), documents="mask_mod", causal=True, K=2, T=11
    ),
    "relative bias + document block_mask, causal bottom_right + lengths (padded rows past the keys)": dict(
        relative=dict(), documents="block_mask", causal=True, align="bottom_right", q_lengths=[2, 4], kv_lengths=[11, 6]
    ),
    "document mask_mod, bottom_right + lengths": dict(
        documents="mask_mod", align="bottom_right", q_lengths=[2, 7], kv_lengths=[11, 9]
    ),
}


@pytest.mark.parametrize("path", ["dense", "chunked", "generic"])
@pytest.mark.parametrize("case", list(MOD_CASES))
def test_user_modifications_match_torch_autograd(case, path, monkeypatch):
    """T5's relative bias (``relative_position_bias``: out, lse, dq, dk, dv and
    the table's gradient) and a document mask (``mask_mod`` or ``block_mask``)
    against the same attention written out in torch."""
    spec = MOD_CASES[case]
    B, N, T, S, H = 2, 4, spec.get("T", 7), 11, 3
    K = spec.get("K", N)
    rng = np.random.default_rng(len(case) + 15)
    q, k, v = rng.standard_normal((B, N, T, H)), rng.standard_normal((B, K, S, H)), rng.standard_normal((B, K, S, 2))
    dout, dlse = rng.standard_normal((B, N, T, 2)), rng.standard_normal((B, N, T))
    align = spec.get("align", "top_left" if spec.get("causal") or "relative" in spec or "documents" in spec else None)
    options: dict = dict(causal=spec.get("causal", False), softcap=spec.get("softcap"), align=align)
    for name in ("q_lengths", "kv_lengths"):
        if name in spec:
            options[name] = np.array(spec[name])
    if spec.get("bias"):
        options["bias"] = rng.standard_normal((N, T, S))
    if spec.get("alibi"):
        options["alibi_slopes"] = npattn.alibi_slopes(N) * 2
    relative = spec.get("relative")
    if relative is not None:
        relative = dict(dict(num_buckets=8, max_distance=6, bidirectional=True), **relative)
        table = rng.standard_normal((N, relative["num_buckets"]))
        mod_options = {name: relative[name] for name in ("max_distance", "bidirectional")}
        options["score_mods"] = [npattn.relative_position_bias(table, **mod_options)]
    docs = _documents(S)
    hidden_row = spec.get("hidden_row")

    def same_document(idx):
        position = np.clip(idx.q, 0, S - 1)  # padded rows may sit past the keys (bottom_right with lengths)
        visible = docs[position] == docs[idx.k]  # (B'|1, 1, tq, tk)
        if hidden_row is not None:
            visible = visible & (idx.q != hidden_row + S - T)  # one query sees nothing at all
        return visible

    if spec.get("documents") == "mask_mod":
        options["mask_mod"] = same_document
    elif spec.get("documents") == "block_mask":
        lengths = {name: options[name] for name in ("q_lengths", "kv_lengths") if name in options}
        if lengths:
            lengths["batch_shape"] = (B,)  # query positions differ per batch element
        options["block_mask"] = npattn.block_mask(same_document, T, S, block_q=3, block_k=2, align=align, **lengths)
    if path == "generic":
        monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    out, res = npattn.attention_forward(
        q, k, v, impl="dense" if path == "dense" else "chunked", block_q=4, block_k=5, **options
    )
    g = npattn.attention_backward(dout, res, dlse=dlse)

    leaves = {name: torch.tensor(a, requires_grad=True) for name, a in dict(q=q, k=k, v=v).items()}
    for name in ("bias", "alibi_slopes"):
        if name in options:
            leaves[name] = torch.tensor(options[name], requires_grad=True)
    q_len = torch.tensor(options.get("q_lengths", np.full(B, T)))
    kv_len = torch.tensor(options.get("kv_lengths", np.full(B, S)))
    offset = kv_len - q_len if align == "bottom_right" else torch.zeros(B, dtype=torch.int64)
    positions = torch.arange(T)[:, None] + offset[:, None, None, None]  # (B, 1, T, 1): p_i
    keys = torch.arange(S)  # (S,): j
    bias = leaves.get("bias")
    if relative is not None:
        leaves["relative_bias"] = torch.tensor(table, requires_grad=True)
        buckets = _torch_t5_buckets(keys - positions, **relative)  # (B, 1, T, S)
        heads = torch.arange(N)[:, None, None]  # (N, 1, 1)
        gathered = leaves["relative_bias"][heads, buckets]  # (B, N, T, S): table[n, bucket(j - p_i)]
        bias = gathered if bias is None else bias + gathered  # both additive after softcap: order is free
    mask = None
    if "documents" in spec:
        t_docs = torch.tensor(docs)
        mask = t_docs[positions.clamp(0, S - 1)] == t_docs[keys]  # (B, 1, T, S)
        if hidden_row is not None:
            mask = mask & (positions != hidden_row + S - T)
    t_out, t_lse = _torch_attention(
        leaves["q"],
        leaves["k"],
        leaves["v"],
        scale=1 / np.sqrt(H),
        bias=bias,
        mask=mask,
        softcap=options["softcap"],
        slopes=leaves.get("alibi_slopes"),
        offset=offset,
        sinks=None,
        q_ids=None,
        kv_ids=None,
        q_len=q_len,
        kv_len=kv_len,
        causal=options["causal"],
    )
    dmods = g.dmods or {}
    grads = dict(q=g.dq, k=g.dk, v=g.dv, bias=g.dbias, alibi_slopes=g.dalibi_slopes, **dmods)
    _backprop_and_compare(out, res.lse, grads, t_out, t_lse, leaves, dout, dlse)
    if hidden_row is not None:
        assert np.isneginf(res.lse[:, :, hidden_row]).all()  # the case's hidden row is fully masked
    assert set(dmods) == ({"relative_bias"} if relative is not None else set())


# --- the derivative modes of issue 16, by torch.func over plain float64 torch ----------


def _torch_plain_attention(q, k, v, bias, *, mask, causal, offset, scale, softcap):
    """Attention in plain torch: matmul, masked_fill, softmax, GQA by
    ``repeat_interleave``. Rows with no visible key give out 0 and lse 0
    (npattn's lse is -inf there; those rows are compared on out and on
    every derivative, all 0). Returns ``(out, lse)``."""
    N, T, S = q.shape[-3], q.shape[-2], k.shape[-2]
    G = N // k.shape[-3]
    k, v = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)  # (B, N, S, H|Hv)
    s = scale * (q @ k.transpose(-1, -2))  # (B, N, T, S)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    visible = torch.ones(T, S, dtype=torch.bool)
    if causal:
        visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + offset  # (T, S)
    if mask is not None:
        visible = visible & mask
    visible = visible.expand(s.shape)
    empty = ~visible.any(dim=-1)  # (B, N, T)
    s = s.masked_fill(~visible, -torch.inf).masked_fill(empty[..., None], 0.0)  # empty rows: any finite value
    p = torch.softmax(s, dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    return (p @ v).masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, 0.0)


MODE_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "bool mask with a fully masked row": dict(mask=True),
    "GQA causal bottom_right, T < S": dict(causal=True, K=2, S=7, align="bottom_right"),
    "bias (N, T, S) + bool mask": dict(bias=(4, 5, 6), mask=True),
    "softcap + bias (1, T, S) + GQA causal": dict(softcap=0.9, bias=(1, 5, 6), K=1, causal=True, align="top_left"),
}


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # inside torch.func
@pytest.mark.parametrize("path", ["dense", "chunked", "generic"])
@pytest.mark.parametrize("case", list(MODE_CASES))
def test_derivative_modes_match_torch_func(case, path, monkeypatch):
    """``npattn.attention_jvp`` against ``torch.func.jvp`` (out, lse and their
    tangents), ``attention_backward_jvp`` against ``torch.func.jvp`` of the
    ``torch.func.vjp`` pullback (tangents of dq, dk, dv, dbias along q, k, v,
    bias, dout and dlse), and ``attention_double_backward`` against
    ``torch.func.vjp`` of that pullback (cotangents of q, k, v, dout, bias,
    dlse), on plain float64 torch attention."""
    spec = MODE_CASES[case]
    B, N, T, S, H, Hv = 2, 4, 5, spec.get("S", 6), 3, 2
    K = spec.get("K", N)
    rng = np.random.default_rng(len(case) + 16)
    q, k, v = rng.standard_normal((B, N, T, H)), rng.standard_normal((B, K, S, H)), rng.standard_normal((B, K, S, Hv))
    primals = [q, k, v]
    if "bias" in spec:
        primals.append(rng.standard_normal(spec["bias"]))
    tangents = [rng.standard_normal(a.shape) for a in primals]
    dd = [rng.standard_normal(a.shape) for a in primals]  # cotangents of dq, dk, dv[, dbias]
    dout, dout_dot = rng.standard_normal((B, N, T, Hv)), rng.standard_normal((B, N, T, Hv))
    dlse, dlse_dot = rng.standard_normal((B, N, T)), rng.standard_normal((B, N, T))
    mask = None
    if spec.get("mask"):
        mask = rng.random((T, S)) < 0.7
        mask[:, 0] = True
        mask[2] = False  # a row that sees no key
    align = spec.get("align", "top_left" if spec.get("causal") else None)
    options = dict(causal=spec.get("causal", False), softcap=spec.get("softcap"), mask=mask, align=align)
    if path == "generic":
        monkeypatch.setenv("NPATTN_FAST_NUMPY", "0")
    options.update(impl="dense" if path == "dense" else "chunked", block_q=2, block_k=4)

    out, lse, out_dot, lse_dot = npattn.attention_jvp(tuple(primals), tuple(tangents), **options)
    _, res = npattn.attention_forward(q, k, v, bias=primals[3] if len(primals) == 4 else None, **options)
    hvp = npattn.attention_backward_jvp(dout, res, tuple(tangents), dlse=dlse, dout_dot=dout_dot, dlse_dot=dlse_dot)
    ddbias = dd[3] if len(dd) == 4 else None
    cot = npattn.attention_double_backward(*dd[:3], res, dout, ddbias=ddbias, dlse=dlse)

    def attention(q, k, v, *bias):
        return _torch_plain_attention(
            q,
            k,
            v,
            bias[0] if bias else None,
            mask=None if mask is None else torch.tensor(mask),
            causal=options["causal"],
            offset=S - T if align == "bottom_right" else 0,
            scale=1 / math.sqrt(H),
            softcap=options["softcap"],
        )

    def gradients(*args):  # (q, k, v[, bias], dout, dlse) -> (dq, dk, dv[, dbias])
        *x, t_dout, t_dlse = args
        _, pullback = torch.func.vjp(attention, *x)
        return pullback((t_dout, t_dlse))

    t = [torch.tensor(a) for a in primals]
    t_dot = [torch.tensor(a) for a in tangents]
    (t_out, t_lse), (t_out_dot, t_lse_dot) = torch.func.jvp(attention, tuple(t), tuple(t_dot))
    cotangents = (torch.tensor(dout), torch.tensor(dlse))
    _, t_hvp = torch.func.jvp(gradients, (*t, *cotangents), (*t_dot, torch.tensor(dout_dot), torch.tensor(dlse_dot)))
    _, pullback = torch.func.vjp(gradients, *t, *cotangents)
    t_cot = pullback(tuple(torch.tensor(a) for a in dd))

    finite = np.isfinite(lse)
    assert (~finite).any() == (mask is not None)
    close = dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out, t_out.numpy(), **close, err_msg="out")
    np.testing.assert_allclose(lse[finite], t_lse.numpy()[finite], **close, err_msg="lse")
    np.testing.assert_allclose(out_dot, t_out_dot.numpy(), **close, err_msg="out'")
    np.testing.assert_allclose(lse_dot, t_lse_dot.numpy(), **close, err_msg="lse'")
    names = ["dq", "dk", "dv", "dbias"][: len(primals)]
    for name, theirs in zip(names, t_hvp):
        np.testing.assert_allclose(getattr(hvp, name), theirs.numpy(), **close, err_msg=f"{name}'")
    mine = [cot.dq, cot.dk, cot.dv] + ([cot.dbias] if len(primals) == 4 else []) + [cot.ddout, cot.ddlse]
    for name, value, theirs in zip(["q", "k", "v", "bias"][: len(primals)] + ["dout", "dlse"], mine, t_cot):
        np.testing.assert_allclose(value, theirs.numpy(), **close, err_msg=f"cotangent of {name}")
    assert (cot.dbias is None) == (len(primals) == 3)
