"""PyTorch interop: weight layout round trips and mask polarity (no torch
needed), and, where torch is installed, torch.nn.MultiheadAttention as an
oracle for the outputs, the attention weights and every gradient."""

from __future__ import annotations

import numpy as np
import pytest

from npattn.interop import mha_masks_from_torch, mha_params_from_torch, mha_params_to_torch
from npattn.mha import mha_backward, mha_forward, mha_init


def random_params(rng, E, N, **kw):
    return {name: rng.standard_normal(a.shape) * 0.5 for name, a in mha_init(E, N, **kw).items()}


# --- layout, no torch -----------------------------------------------------------


@pytest.mark.parametrize(
    "kw, keys",
    [
        ({}, {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}),
        ({"bias": False}, {"in_proj_weight", "out_proj.weight"}),
        (
            {"kdim": 5, "vdim": 3},
            {"q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"},
        ),
        ({"kdim": 8, "vdim": 3, "bias": False}, {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}),
    ],
)
def test_round_trip(kw, keys):
    params = random_params(np.random.default_rng(0), 8, 2, **kw)
    sd = mha_params_to_torch(params)
    assert set(sd) == keys
    if "in_proj_weight" in sd:
        assert sd["in_proj_weight"].shape == (24, 8)
        np.testing.assert_array_equal(sd["in_proj_weight"][8:16], params["k_weight"])
    if "in_proj_bias" in sd:
        np.testing.assert_array_equal(sd["in_proj_bias"][16:], params["v_bias"])
    back = mha_params_from_torch(sd, 2)
    assert set(back) == set(params)
    for name in params:
        np.testing.assert_array_equal(back[name], params[name])
        assert not np.shares_memory(back[name], sd.get("in_proj_weight", np.zeros(1)))


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda sd: sd.update(bias_k=np.zeros((1, 1, 8))), ValueError, r"bias_k/bias_v \(add_bias_kv=True\)"),
        (lambda sd: sd.update(weight=np.zeros(1)), ValueError, r"keys nn.MultiheadAttention does not: \['weight'\]"),
        (
            lambda sd: sd.update(q_proj_weight=np.zeros((8, 8))),
            ValueError,
            r"both in_proj_weight and \['q_proj_weight'\]",
        ),
        (
            lambda sd: sd.update(in_proj_weight=np.zeros((16, 8))),
            ValueError,
            r"in_proj_weight'\] must have shape \(3E, E\)",
        ),
        (
            lambda sd: sd.update(in_proj_bias=np.zeros(16)),
            ValueError,
            r"in_proj_bias'\] must have shape \(3E,\) = \(24,\)",
        ),
        (lambda sd: sd.pop("out_proj.weight"), ValueError, r"missing 'out_proj.weight'"),
        (lambda sd: sd.pop("in_proj_weight"), ValueError, r"must have in_proj_weight, or all of"),
        (
            lambda sd: sd.update({"out_proj.bias": np.zeros(4)}),
            ValueError,
            r"params\['out_bias'\] must have shape \(8,\)",
        ),
    ],
)
def test_from_torch_bad_input(mutate, error, pattern):
    sd = mha_params_to_torch(mha_init(8, 2))
    mutate(sd)
    with pytest.raises(error, match=pattern):
        mha_params_from_torch(sd, 2)


def test_from_torch_heads_and_to_torch_limits():
    sd = mha_params_to_torch(mha_init(8, 2))
    with pytest.raises(ValueError, match=r"embed_dim=8 .* divisible by num_heads=3"):
        mha_params_from_torch(sd, 3)
    with pytest.raises(ValueError, match=r"no GQA: params\['k_weight'\] must have E=8 rows, got 4"):
        mha_params_to_torch(mha_init(8, 4, num_kv_heads=2))
    partial = mha_init(8, 2)
    del partial["out_bias"]
    with pytest.raises(ValueError, match=r"all four biases or none"):
        mha_params_to_torch(partial)
    with pytest.raises(ValueError, match=r"params is missing \['q_weight', 'v_weight', 'out_weight'\]"):
        mha_params_to_torch({"k_weight": np.zeros((8, 8))})


def test_sinks_have_no_torch_counterpart():
    """from_torch gives no sinks; to_torch refuses params with sinks unless
    drop_sinks=True, which writes the other weights and leaves params alone."""
    params = random_params(np.random.default_rng(1), 8, 2, sinks=True)
    with pytest.raises(
        ValueError, match=r"params have 'sinks', but torch.nn.MultiheadAttention has no attention sinks"
    ):
        mha_params_to_torch(params)
    with pytest.raises(ValueError, match=r"Pass drop_sinks=True"):
        mha_params_to_torch(params)
    with pytest.raises(TypeError, match=r"drop_sinks must be a bool, got 1"):
        mha_params_to_torch(params, drop_sinks=1)
    sd = mha_params_to_torch(params, drop_sinks=True)
    assert set(sd) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    assert "sinks" in params  # not mutated
    back = mha_params_from_torch(sd, 2)
    assert set(back) == set(params) - {"sinks"}
    for name in back:
        np.testing.assert_array_equal(back[name], params[name])
    assert set(mha_params_to_torch(mha_init(8, 2), drop_sinks=True)) == set(sd)  # no sinks: nothing to drop


def test_masks_polarity_and_shapes():
    B, N, T, S = 2, 3, 4, 5
    rng = np.random.default_rng(1)
    kpm = rng.random((B, S)) > 0.5  # True = ignore
    am = rng.random((T, S)) > 0.5  # True = not allowed
    mask, bias = mha_masks_from_torch(key_padding_mask=kpm, attn_mask=am)
    assert bias is None and mask.shape == (B, 1, T, S)
    np.testing.assert_array_equal(mask, ~kpm[:, None, None, :] & ~am)
    am3 = rng.random((B * N, T, S)) > 0.5
    mask, _ = mha_masks_from_torch(attn_mask=am3, num_heads=N)
    np.testing.assert_array_equal(mask[1, 2], ~am3[1 * N + 2])  # PyTorch's b * N + n
    fkpm, fam = rng.standard_normal((B, S)), rng.standard_normal((T, S))
    mask, bias = mha_masks_from_torch(key_padding_mask=fkpm, attn_mask=fam)
    assert mask is None
    np.testing.assert_allclose(bias, fkpm[:, None, None, :] + fam)
    mask, bias = mha_masks_from_torch(key_padding_mask=kpm, attn_mask=fam)
    np.testing.assert_array_equal(mask, ~kpm[:, None, None, :])
    np.testing.assert_array_equal(bias, fam)
    assert mha_masks_from_torch() == (None, None)
    mask, _ = mha_masks_from_torch(key_padding_mask=kpm[0])
    assert mask.shape == (1, 1, S)
    with pytest.raises(ValueError, match=r"3-D attn_mask \(B\*N, T, S\) needs num_heads"):
        mha_masks_from_torch(attn_mask=am3)
    with pytest.raises(ValueError, match=r"attn_mask's first axis \(6\) must be B \* num_heads \(num_heads=4\)"):
        mha_masks_from_torch(attn_mask=am3, num_heads=4)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\)"):
        mha_masks_from_torch(key_padding_mask=np.zeros((1, 2, 3), bool))
    with pytest.raises(TypeError, match=r"attn_mask must be bool or floating"):
        mha_masks_from_torch(attn_mask=np.zeros((2, 3), np.int64))


# --- torch as the oracle -----------------------------------------------------------


def _torch_case(case, rng, B, T, S, E, N):
    """Return (kw for mha_init/torch, context kind, torch masks as NumPy)."""
    kpm = rng.random((B, S)) > 0.6
    kpm[:, 0] = False  # every row keeps a key (PyTorch gives NaN otherwise)
    am = rng.random((T, S)) > 0.6
    am[:, 0] = False
    return {
        "self": ({}, "self", {}),
        "self-nobias": ({"bias": False}, "self", {}),
        "self-causal": ({}, "self", {"attn_mask": np.triu(np.ones((T, T), bool), k=1)}),
        "self-bool-masks": ({}, "self", {"key_padding_mask": kpm[:, :T], "attn_mask": am[:, :T]}),
        "self-float-masks": (
            {},
            "self",
            {"key_padding_mask": rng.standard_normal((B, T)), "attn_mask": rng.standard_normal((T, T))},
        ),
        "self-3d-attn-mask": ({}, "self", {"attn_mask": np.concatenate([am[None, :, :T]] * (B * N))}),
        "cross-single": ({}, "single", {"key_padding_mask": kpm}),
        "cross-single-kdim": ({"kdim": 6, "vdim": 6}, "single", {"attn_mask": am}),
        "cross-pair-kdim-vdim": ({"kdim": 5, "vdim": 3}, "pair", {"key_padding_mask": kpm, "attn_mask": am}),
        "cross-pair-nobias": ({"kdim": 5, "vdim": 7, "bias": False}, "pair", {}),
    }[case]


TORCH_CASES = [
    "self",
    "self-nobias",
    "self-causal",
    "self-bool-masks",
    "self-float-masks",
    "self-3d-attn-mask",
    "cross-single",
    "cross-single-kdim",
    "cross-pair-kdim-vdim",
    "cross-pair-nobias",
]


@pytest.mark.parametrize("case", TORCH_CASES)
def test_matches_torch_multihead_attention(case):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(sum(map(ord, case)))
    B, T, S, E, N = 2, 3, 4, 8, 2
    kw, kind, torch_masks = _torch_case(case, rng, B, T, S, E, N)
    params = random_params(rng, E, N, **kw)
    module = torch.nn.MultiheadAttention(
        E, N, batch_first=True, dtype=torch.float64, **{k: v for k, v in kw.items() if k in ("kdim", "vdim", "bias")}
    )
    module.load_state_dict({k: torch.from_numpy(a) for k, a in mha_params_to_torch(params).items()})

    x = rng.standard_normal((B, T, E))
    if kind == "self":
        key = value = x
        context = None
    elif kind == "single":
        key = value = rng.standard_normal((B, S, kw.get("kdim", E)))
        context = key
    else:
        key, value = rng.standard_normal((B, S, kw["kdim"])), rng.standard_normal((B, S, kw["vdim"]))
        context = (key, value)
    mask, bias = mha_masks_from_torch(**torch_masks, num_heads=N)
    y, res = mha_forward(params, x, context, num_heads=N, mask=mask, bias=bias, need_weights=True)
    dy = rng.standard_normal(y.shape)
    g = mha_backward(dy, res)

    tx = torch.tensor(x, requires_grad=True)
    tk = tx if kind == "self" else torch.tensor(key, requires_grad=True)
    tv = tk if kind != "pair" else torch.tensor(value, requires_grad=True)
    t_masks = {name: torch.from_numpy(a) for name, a in torch_masks.items()}
    ty, tw = module(tx, tk, tv, need_weights=True, average_attn_weights=False, **t_masks)
    ty.backward(torch.from_numpy(dy))

    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(res.weights, tw.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g.dx, tx.grad.numpy(), rtol=1e-12, atol=1e-13)
    if kind == "single":
        np.testing.assert_allclose(g.dcontext, tk.grad.numpy(), rtol=1e-12, atol=1e-13)
    elif kind == "pair":
        np.testing.assert_allclose(g.dcontext[0], tk.grad.numpy(), rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(g.dcontext[1], tv.grad.numpy(), rtol=1e-12, atol=1e-13)
    torch_grads = mha_params_from_torch({n: p.grad.numpy() for n, p in module.named_parameters()}, N)
    assert set(torch_grads) == set(g.dparams)
    for name, want in torch_grads.items():
        np.testing.assert_allclose(g.dparams[name], want, rtol=1e-11, atol=1e-13, err_msg=name)


def test_causal_matches_torch_is_causal_mask():
    """npattn's causal=True is PyTorch's upper-triangular boolean attn_mask."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    params = random_params(rng, 8, 4)
    x = rng.standard_normal((2, 5, 8))
    module = torch.nn.MultiheadAttention(8, 4, batch_first=True, dtype=torch.float64)
    module.load_state_dict({k: torch.from_numpy(a) for k, a in mha_params_to_torch(params).items()})
    t_mask = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    tx = torch.from_numpy(x)
    ty, _ = module(tx, tx, tx, attn_mask=t_mask, is_causal=True, need_weights=False)
    y, _ = mha_forward(params, x, num_heads=4, causal=True)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("kw", [{}, {"kdim": 5, "vdim": 3}])
def test_torch_initialized_module_runs_in_npattn(kw):
    """torch's own init, moved through mha_params_from_torch, gives torch's outputs."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64, **kw)
    with torch.no_grad():
        module.in_proj_bias.normal_()
        module.out_proj.bias.normal_()
    params = mha_params_from_torch({k: t.detach().numpy() for k, t in module.state_dict().items()}, 2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8))
    key, value = rng.standard_normal((2, 4, kw.get("kdim", 8))), rng.standard_normal((2, 4, kw.get("vdim", 8)))
    y, _ = mha_forward(params, x, (key, value), num_heads=2)
    ty, _ = module(*(torch.from_numpy(a) for a in (x, key, value)), need_weights=False)
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    # the init bounds agree with torch's
    ours = mha_init(8, 2, **kw)
    for name_t, name_o in (("out_proj.weight", "out_weight"),):
        bound = 1 / np.sqrt(8)
        assert np.abs(module.state_dict()[name_t].numpy()).max() <= bound and np.abs(ours[name_o]).max() <= bound


def test_dropped_sinks_give_torch_the_sink_free_layer():
    """With drop_sinks=True the torch module computes npattn's layer without
    its sinks, which is another function than the layer with them."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    params = random_params(rng, 8, 2, sinks=True)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64)
    module.load_state_dict({k: torch.from_numpy(a) for k, a in mha_params_to_torch(params, drop_sinks=True).items()})
    x = rng.standard_normal((2, 3, 8))
    ty, _ = module(*(torch.from_numpy(x),) * 3, need_weights=False)
    without = {name: a for name, a in params.items() if name != "sinks"}
    np.testing.assert_allclose(mha_forward(without, x, num_heads=2)[0], ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    assert not np.allclose(mha_forward(params, x, num_heads=2)[0], ty.detach().numpy())
