"""npattn on CuPy (a CUDA GPU) against NumPy on the CPU: the dense path and
the generic chunked path (``NPATTN_FAST_CUPY=0`` throughout; the fused
kernels of :mod:`npattn.fast_cupy` have ``tests/test_fast_cupy.py``).

Every test here is marked ``gpu`` and takes the conftest ``backend`` fixture
narrowed to ``"cupy"``, so without CuPy or a CUDA device each one is reported
as skipped (the fixture skips), never as an error. On a GPU:

- every mask feature of ``test_dense.FEATURES``, on ``impl="dense"`` and on
  ``impl="chunked"`` with tiles that do not divide the lengths: out, lse, dq,
  dk, dv, dbias (and the dense probabilities) equal NumPy's to ~1e-12 in
  float64, come back as CuPy arrays on the inputs' device, hold no NaN, and
  the inputs are not mutated;
- ``npattn.check_gradients`` (full Jacobian, float64) on CuPy, both paths;
- hypothesis: the chunked path equals the dense one on CuPy for the problems
  of ``test_chunked.problems()`` (block sizes 1, primes, larger than T);
- default tiles: without block sizes the chunked path on CuPy (and on torch
  CUDA tensors) takes the large accelerator tiles of
  ``chunked.default_blocks``, forward and backward alike, and equals dense;
- fully masked rows: output 0, lse -inf, zero gradients, no NaN;
- dropout: the keep mask is bit-identical to NumPy's on both paths;
- float32/float16 dtype policy and bitwise determinism on the device;
- the multi-head layer (self- and cross-attention, KV-cache decoding).
"""

from __future__ import annotations

import array_api_compat
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pairs import check_attention_gradients
from reference import dropout_keep_reference
from test_chunked import GRADCHECK_CASES, problems
from test_chunked import _assert_paths_agree as assert_paths_agree
from test_chunked import _qkv as chunked_qkv
from test_dense import FEATURES

import npattn
import npattn.chunked as chunked
from npattn.dropout import keep_tile
from npattn.mha import mha_backward, mha_forward, mha_init
from npattn.namespace import to_numpy
from npattn.options import make_spec

pytestmark = [pytest.mark.gpu, pytest.mark.parametrize("backend", ["cupy"], indirect=True)]


@pytest.fixture(autouse=True)
def _generic_chunked_path(monkeypatch):
    """Route ``impl="chunked"`` on CuPy to the generic Array API path."""
    monkeypatch.setenv("NPATTN_FAST_CUPY", "0")


TOL = dict(rtol=1e-12, atol=1e-12)
IMPLS = ["dense", "chunked"]
NAMES = ("out", "lse", "dq", "dk", "dv", "dbias")


# --- helpers --------------------------------------------------------------------


def _split(case: dict) -> tuple[dict, dict]:
    """``(shape keywords, attention options)`` of a FEATURES-style case (``_T`` -> ``T``)."""
    options = dict(case)
    dims = {key[1:]: options.pop(key) for key in list(options) if key.startswith("_")}
    return dims, options


def _qkv(batch=(2,), N=2, K=2, T=3, S=4, H=2, Hv=3, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((*batch, N, T, H)),
        rng.standard_normal((*batch, K, S, H)),
        rng.standard_normal((*batch, K, S, Hv)),
    )


def _non_dividing_block(n: int) -> int:
    """The smallest block in 2..n-1 that leaves a partial last tile (1 when n <= 2)."""
    return next((b for b in range(2, n) if n % b), 1)


def _on_device(backend, options: dict) -> dict:
    return {key: backend.asarray(val) if isinstance(val, np.ndarray) else val for key, val in options.items()}


def _run(q, k, v, dout, dlse, options):
    """``({name: array}, residuals)`` of the public forward and backward."""
    out, res = npattn.attention_forward(q, k, v, **options)
    g = npattn.attention_backward(dout, res, dlse=dlse)
    return dict(zip(NAMES, (out, res.lse, g.dq, g.dk, g.dv, g.dbias))), res


def _assert_on_device(cp, arrays: dict, device) -> None:
    for name, a in arrays.items():
        if a is None:
            continue
        assert isinstance(a, cp.ndarray), f"{name} is a {type(a).__module__}.{type(a).__name__}, not a cupy.ndarray"
        assert a.device == device, f"{name} is on {a.device}, the inputs on {device}"


def _host(arrays: dict) -> dict:
    return {name: None if a is None else to_numpy(a) for name, a in arrays.items()}


def _assert_equal_results(got: dict, want: dict, **tol) -> None:
    """Host dicts: same keys present, same shape and dtype, no NaN, values within tol."""
    for name, w in want.items():
        g = got[name]
        if w is None:
            assert g is None, f"{name}: NumPy gives None, CuPy {type(g).__name__}"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{name}: {g.shape} {g.dtype} vs {w.shape} {w.dtype}"
        assert not np.isnan(g).any(), f"{name} has NaN on CuPy"
        np.testing.assert_allclose(g, w, err_msg=name, **(tol or TOL))


# --- every feature, both paths, float64, against NumPy ----------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_matches_numpy_float64(backend, feature, impl):
    cp = backend.xp
    dims, options = _split(FEATURES[feature])
    q, k, v = _qkv(**dims, seed=len(feature))
    T, S = q.shape[-2], k.shape[-2]
    options["impl"] = impl
    if impl == "chunked":
        options.update(block_q=_non_dividing_block(T), block_k=_non_dividing_block(S))
        assert T % options["block_q"] and S % options["block_k"], "tiles must not divide the lengths"
    rng = np.random.default_rng(7)
    dout, dlse = rng.standard_normal(q.shape[:-1] + v.shape[-1:]), rng.standard_normal(q.shape[:-1])
    want, want_res = _run(q, k, v, dout, dlse, options)

    host_inputs = {
        "q": q,
        "k": k,
        "v": v,
        "dout": dout,
        "dlse": dlse,
        **{key: val for key, val in options.items() if isinstance(val, np.ndarray)},
    }
    device_inputs = {name: backend.asarray(a) for name, a in host_inputs.items()}
    dev_options = {**options, **{key: device_inputs[key] for key in options if key in device_inputs}}
    d = device_inputs
    got, res = _run(d["q"], d["k"], d["v"], d["dout"], d["dlse"], dev_options)

    device = d["q"].device
    _assert_on_device(cp, {**got, "residual lse": res.lse}, device)
    if impl == "chunked":
        assert isinstance(res, npattn.ChunkedResiduals) and res.kernel == "generic"
    else:
        assert isinstance(res, npattn.DenseResiduals)
        _assert_on_device(cp, {"probs": res.probs}, device)
        np.testing.assert_allclose(cp.asnumpy(res.probs), want_res.probs, err_msg="probs", **TOL)
    _assert_equal_results(_host(got), want)
    for name, original in host_inputs.items():  # inputs are never mutated
        np.testing.assert_array_equal(cp.asnumpy(device_inputs[name]), original, err_msg=name)


def test_longer_sequences_128_tiles_match_numpy(backend):
    """Many 128 x 128 tiles (the CPU default, asked for explicitly: on the GPU
    the default takes these lengths whole), the last one partial, with causal
    bottom_right, GQA, lengths, a bias row per query and dropout: CuPy's
    chunked and dense paths both equal NumPy's dense path."""
    cp = backend.xp
    q, k, v = _qkv(batch=(2,), N=4, K=2, T=300, S=389, H=16, Hv=8, seed=3)
    rng = np.random.default_rng(4)
    options = dict(
        causal=True,
        align="bottom_right",
        q_lengths=np.array([300, 211]),
        kv_lengths=np.array([389, 260]),
        bias=rng.standard_normal((300, 1)),
        dropout_p=0.1,
        seed=77,
        block_q=128,
        block_k=128,
    )
    dout, dlse = rng.standard_normal(q.shape[:-1] + v.shape[-1:]), rng.standard_normal(q.shape[:-1])
    want, _ = _run(q, k, v, dout, dlse, {**options, "impl": "dense"})
    args = [cp.asarray(a) for a in (q, k, v, dout, dlse)]
    for impl in IMPLS:
        got, _ = _run(*args, {**_on_device(backend, options), "impl": impl})
        _assert_equal_results(_host(got), want, rtol=1e-11, atol=1e-11)


def test_default_tiles_are_large_on_the_gpu_and_match_dense(backend, monkeypatch):
    """``impl="chunked"`` with no block sizes on CuPy follows the accelerator
    rule of ``chunked.default_blocks``: B*N = 2 at T=3000, S=2500 gives
    2048 x 2048 tiles, two per side with the last partial. Causal bottom_right
    hides tile (0, 2048); the forward and the backward compute the same three
    tiles, and out, lse and every gradient equal the dense path's on CuPy and
    NumPy's dense path."""
    cp = backend.xp
    q, k, v = _qkv(batch=(1,), N=2, K=1, T=3000, S=2500, H=16, Hv=8, seed=12)
    rng = np.random.default_rng(13)
    options = dict(causal=True, align="bottom_right", bias=rng.standard_normal((3000, 1)), dropout_p=0.1, seed=3)
    dout, dlse = rng.standard_normal((1, 2, 3000, 8)), rng.standard_normal((1, 2, 3000))
    args = [cp.asarray(a) for a in (q, k, v, dout, dlse)]
    dev_options = _on_device(backend, options)
    spec = make_spec(*args[:3], impl="chunked", **dev_options)
    assert chunked.on_accelerator(spec.xp, spec.device)
    assert chunked.default_blocks(spec) == (2048, 2048)
    scored = []
    tile_scores = chunked._tile_scores

    def counting_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind):
        scored.append((q0, k0))
        return tile_scores(spec, qs_i, kT_j, q0, q1, k0, k1, kind)

    monkeypatch.setattr(chunked, "_tile_scores", counting_scores)
    chunk, res = _run(*args, {**dev_options, "impl": "chunked"})
    monkeypatch.undo()
    assert res.kernel == "generic"
    assert scored[:3] == [(0, 0), (2048, 0), (2048, 2048)] and sorted(scored[3:]) == sorted(scored[:3])
    dense, _ = _run(*args, {**dev_options, "impl": "dense"})
    chunk, dense = _host(chunk), _host(dense)
    assert_paths_agree([chunk[n] for n in NAMES], [dense[n] for n in NAMES], rtol=1e-11, atol=1e-11)
    want, _ = _run(q, k, v, dout, dlse, {**options, "impl": "dense"})
    _assert_equal_results(dense, want, rtol=1e-11, atol=1e-11)


def test_torch_cuda_tensors_take_the_accelerator_default(backend):
    """torch tensors on CUDA are an accelerator too (torch CPU tensors are
    not), and the generic chunked path with its large default tiles runs on
    them and equals NumPy's dense path."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    q, k, v = _qkv(batch=(1,), N=2, K=1, T=3000, S=2500, H=16, Hv=8, seed=14)
    cuda = [torch.asarray(a, device="cuda") for a in (q, k, v)]
    spec = make_spec(*cuda, impl="chunked")
    assert chunked.on_accelerator(spec.xp, spec.device)
    assert chunked.default_blocks(spec) == (2048, 2048)
    assert chunked.default_blocks(make_spec(*(t.cpu() for t in cuda), impl="chunked")) == (128, 128)
    options = dict(causal=True, align="bottom_right", bias=np.linspace(-1, 1, 2500))
    out = npattn.attention(*cuda, impl="chunked", **{**options, "bias": torch.asarray(options["bias"], device="cuda")})
    assert out.device.type == "cuda"
    np.testing.assert_allclose(
        out.cpu().numpy(), npattn.attention(q, k, v, impl="dense", **options), rtol=1e-11, atol=1e-11
    )


# --- gradients by central differences on the device --------------------------------


GRADCHECK_FEATURES = [
    "combined mask+bias+window+lengths",
    "dropout + GQA + mask",
    "fully masked rows",
    "causal bottom_right T>S",
    "MQA (N=3, K=1)",
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("feature", GRADCHECK_FEATURES)
def test_check_gradients_full_jacobian(backend, feature, impl):
    dims, options = _split(FEATURES[feature])
    q, k, v = (backend.asarray(a) for a in _qkv(**dims, seed=11))
    options = {**_on_device(backend, options), "impl": impl}
    if impl == "chunked":
        options.update(block_q=_non_dividing_block(q.shape[-2]), block_k=_non_dividing_block(k.shape[-2]))
    result = check_attention_gradients(q, k, v, options, jacobian=True, max_jacobian_elements=10**6)
    assert result.ok and result.jacobian_checked
    assert set(result.max_abs_error) >= {"q", "k", "v"}
    assert max(result.max_abs_error.values()) < 1e-6


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_check_gradients_chunked_cases(backend, case):
    dims, options = _split(GRADCHECK_CASES[case])
    q, k, v = (backend.asarray(a) for a in chunked_qkv(**{"H": 2, "Hv": 2, "N": 2, "K": 2, **dims}, seed=3))
    result = check_attention_gradients(
        q, k, v, {**_on_device(backend, options), "impl": "chunked"}, jacobian=True, max_jacobian_elements=10**6
    )
    assert result.ok and result.jacobian_checked


# --- hypothesis: chunked == dense on the device ---------------------------------------


@settings(max_examples=25, deadline=None)
@given(problem=problems(), use_dlse=st.booleans())
def test_chunked_matches_dense_on_device(backend, problem, use_dlse):
    q, k, v, options = problem  # float64, impl="chunked" with drawn block sizes
    rng = np.random.default_rng(0)
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:])
    dlse = rng.standard_normal(q.shape[:-1]) if use_dlse else None
    args = [None if a is None else backend.asarray(a) for a in (q, k, v, dout, dlse)]
    dev_options = _on_device(backend, options)
    chunk, res = _run(*args, dev_options)
    dense, _ = _run(*args, {**dev_options, "impl": "dense"})
    assert res.kernel == "generic"
    _assert_on_device(backend.xp, {**chunk, **{f"dense {n}": a for n, a in dense.items()}}, args[0].device)
    chunk, dense = _host(chunk), _host(dense)
    assert_paths_agree([chunk[n] for n in NAMES], [dense[n] for n in NAMES])
    want, _ = _run(q, k, v, dout, dlse, {**options, "impl": "dense"})  # and the device equals the host
    _assert_equal_results(dense, want)


# --- fully masked rows ---------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_zero_output_neginf_lse_zero_gradients(backend, impl):
    """Batch 0: row 0 hidden by the mask, row 1 by a -inf bias, row 3 hidden
    in its first key tile only (must recover). Batch 1: kv_lengths 0, every
    row masked, so dk and dv are 0 there too."""
    cp = backend.xp
    q, k, v = _qkv(batch=(2,), N=2, K=1, T=4, S=6, H=3, Hv=2, seed=5)
    mask = np.ones((4, 6), dtype=bool)
    mask[0, :] = False
    mask[3, :3] = False
    bias = np.zeros((2, 1, 4, 6))
    bias[0, 0, 1, :] = -np.inf
    options = dict(mask=mask, bias=bias, kv_lengths=np.array([6, 0]), impl=impl, block_q=2, block_k=3)
    rng = np.random.default_rng(2)
    dout, dlse = rng.standard_normal((2, 2, 4, 2)), rng.standard_normal((2, 2, 4))
    args = [cp.asarray(a) for a in (q, k, v, dout, dlse)]
    got, _ = _run(*args, _on_device(backend, options))
    h = _host(got)
    assert np.all(h["out"][0, :, :2] == 0) and np.all(np.isneginf(h["lse"][0, :, :2]))
    assert np.all(h["out"][1] == 0) and np.all(np.isneginf(h["lse"][1]))
    assert np.all(np.isfinite(h["lse"][0, :, 2:])) and np.all(h["out"][0, :, 3] != 0)
    assert np.all(h["dq"][0, :, :2] == 0) and np.all(h["dq"][1] == 0)
    assert np.all(h["dbias"][0, 0, :2] == 0) and np.all(h["dbias"][1] == 0)
    assert np.all(h["dk"][1] == 0) and np.all(h["dv"][1] == 0)
    assert np.any(h["dk"][0] != 0) and np.any(h["dv"][0] != 0)
    for name in ("out", "dq", "dk", "dv", "dbias"):
        assert np.all(np.isfinite(h[name])), f"{name} is not finite"
    assert not np.isnan(h["lse"]).any()
    want, _ = _run(q, k, v, dout, dlse, options)
    _assert_equal_results(h, want)


# --- dropout -------------------------------------------------------------------------


def test_dropout_keep_tile_is_bit_identical_to_numpy(backend):
    cp = backend.xp
    shape_q, shape_kv = (2, 3, 4, 33, 8), (2, 3, 2, 47, 8)
    seed, p = 2**40 + 12345, 0.37  # a seed past 32 bits exercises both halves
    specs = {
        name: make_spec(xp.zeros(shape_q), xp.zeros(shape_kv), xp.zeros(shape_kv), dropout_p=p, seed=seed)
        for name, xp in (("numpy", np), ("cupy", cp))
    }
    full_np = np.asarray(keep_tile(specs["numpy"], 0, 33, 0, 47))  # (2, 3, 4, 33, 47)
    full_cp = keep_tile(specs["cupy"], 0, 33, 0, 47)
    assert isinstance(full_cp, cp.ndarray) and full_cp.shape == full_np.shape == (2, 3, 4, 33, 47)
    np.testing.assert_array_equal(cp.asnumpy(full_cp), full_np)
    np.testing.assert_array_equal(
        cp.asnumpy(keep_tile(specs["cupy"], 5, 12, 40, 47, heads=(1, 3), batch=4)),
        full_np.reshape(6, 4, 33, 47)[4, 1:3, 5:12, 40:47],
    )
    assert 0.55 < full_np.mean() < 0.70  # P(keep) = 1 - p = 0.63
    rng = np.random.default_rng(0)
    for _ in range(200):  # the independent pure-Python oracle
        b, n, i, j = (int(rng.integers(m)) for m in (6, 4, 33, 47))
        assert full_np.reshape(6, 4, 33, 47)[b, n, i, j] == dropout_keep_reference(seed, p, b, n, i, j)


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_mask_in_outputs_is_bit_identical_to_numpy(backend, impl):
    """With V = identity, ``out[..., i, j] = P_ij * keep_ij / (1 - p)``: the
    keep mask can be read off the output and must equal NumPy's bit for bit."""
    cp = backend.xp
    B, N, K, T, S, p, seed = 2, 4, 2, 13, 17, 0.45, 987654321
    q, k, _ = _qkv(batch=(B,), N=N, K=K, T=T, S=S, H=5, Hv=1, seed=9)
    v = np.broadcast_to(np.eye(S), (B, K, S, S)).copy()
    options = dict(dropout_p=p, seed=seed, impl=impl, block_q=5, block_k=7)
    kept_np = npattn.attention(q, k, v, **options) != 0  # (B, N, T, S)
    out = npattn.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), **options)
    kept_cp = cp.asnumpy(out) != 0
    np.testing.assert_array_equal(kept_cp, kept_np)
    spec = make_spec(q, k, v, dropout_p=p, seed=seed)
    np.testing.assert_array_equal(kept_cp, np.asarray(keep_tile(spec, 0, T, 0, S)))
    assert 0.4 < kept_cp.mean() < 0.7


# --- dtypes and determinism -----------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_narrow_dtypes_match_numpy(backend, dtype, impl):
    cp = backend.xp
    q, k, v = (a.astype(dtype) for a in _qkv(batch=(2,), N=4, K=2, T=37, S=45, H=16, Hv=8, seed=1))
    rng = np.random.default_rng(3)
    bias = rng.standard_normal((37, 45)).astype(np.float32)
    dout = rng.standard_normal((2, 4, 37, 8)).astype(dtype)
    options = dict(
        bias=bias,
        causal=True,
        align="bottom_right",
        kv_lengths=np.array([45, 30]),
        dropout_p=0.2,
        seed=4,
        impl=impl,
        block_q=16,
        block_k=16,
    )
    want, _ = _run(q, k, v, dout, None, options)
    got, res = _run(*(cp.asarray(a) for a in (q, k, v, dout)), None, _on_device(backend, options))
    assert got["out"].dtype == got["dq"].dtype == got["dk"].dtype == got["dv"].dtype == np.dtype(dtype)
    assert res.lse.dtype == np.float32 and got["dbias"].dtype == np.float32
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == "float32" else dict(rtol=5e-3, atol=2e-3)
    _assert_equal_results(_host(got), want, **tol)


@pytest.mark.parametrize("impl", IMPLS)
def test_same_inputs_same_bits(backend, impl):
    cp = backend.xp
    q, k, v = (cp.asarray(a.astype(np.float32)) for a in _qkv(batch=(2,), N=4, K=2, T=50, S=70, H=8, Hv=8))
    dout = cp.ones((2, 4, 50, 8), dtype=cp.float32)
    options = dict(
        causal=True,
        align="bottom_right",
        bias=cp.ones((50, 70), dtype=cp.float32),
        dropout_p=0.3,
        seed=2,
        impl=impl,
        block_q=16,
        block_k=24,
    )
    first, second = (_host(_run(q, k, v, dout, None, options)[0]) for _ in range(2))
    for name in NAMES:
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)


# --- the multi-head layer ---------------------------------------------------------------


def _mha_host(params, *args, **options):
    y, res = mha_forward(params, *args, **options)
    return y, res, mha_backward(np.ones_like(y) * 0.5 + np.arange(y.shape[-1]) / y.shape[-1], res)


@pytest.mark.parametrize("impl", IMPLS)
def test_multihead_layer_matches_numpy(backend, impl):
    cp = backend.xp
    xp_cupy = array_api_compat.array_namespace(cp.zeros(1))
    E, N, K, B, T, S = 16, 4, 2, 2, 7, 9
    params_np = mha_init(E, N, num_kv_heads=K, seed=3)
    params_cp = mha_init(E, N, num_kv_heads=K, seed=3, xp=xp_cupy, dtype=cp.float64)
    assert set(params_cp) == set(params_np)
    for name, w in params_cp.items():  # one seed, the same weights on every backend
        assert isinstance(w, cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(w), params_np[name], err_msg=name)
    rng = np.random.default_rng(8)
    x = rng.standard_normal((B, T, E))
    xk, xv = rng.standard_normal((B, S, 5)), rng.standard_normal((B, S, 6))
    cross_np = mha_init(E, N, num_kv_heads=K, kdim=5, vdim=6, seed=4)
    cross_cp = {name: cp.asarray(w) for name, w in cross_np.items()}
    blocks = dict(impl=impl, block_q=3, block_k=4)
    cases = {
        "self, causal, GQA, dropout": (params_np, params_cp, (x,), dict(causal=True, dropout_p=0.2, seed=5)),
        "cross pair, kv_lengths, bias": (
            cross_np,
            cross_cp,
            (x, (xk, xv)),
            dict(kv_lengths=np.array([9, 4]), bias=rng.standard_normal((T, S))),
        ),
    }
    for case, (p_np, p_cp, inputs, options) in cases.items():
        options = dict(num_heads=N, num_kv_heads=K, need_weights=True, **blocks, **options)
        y_np, res_np, g_np = _mha_host(p_np, *inputs, **options)
        dev_inputs = tuple(
            cp.asarray(a) if isinstance(a, np.ndarray) else tuple(cp.asarray(b) for b in a) for a in inputs
        )
        y_cp, res_cp = mha_forward(p_cp, *dev_inputs, **_on_device(backend, options))
        dy = cp.ones_like(y_cp) * 0.5 + cp.arange(E) / E
        g_cp = mha_backward(dy, res_cp)
        assert isinstance(y_cp, cp.ndarray) and isinstance(g_cp.dx, cp.ndarray)
        np.testing.assert_allclose(cp.asnumpy(y_cp), y_np, err_msg=f"{case}: y", **TOL)
        np.testing.assert_allclose(cp.asnumpy(res_cp.weights), res_np.weights, err_msg=f"{case}: weights", **TOL)
        np.testing.assert_allclose(cp.asnumpy(g_cp.dx), g_np.dx, err_msg=f"{case}: dx", **TOL)
        for name, dw in g_np.dparams.items():
            np.testing.assert_allclose(cp.asnumpy(g_cp.dparams[name]), dw, err_msg=f"{case}: d{name}", **TOL)
        if g_np.dcontext is not None:
            for i, dc in enumerate(g_np.dcontext):
                np.testing.assert_allclose(cp.asnumpy(g_cp.dcontext[i]), dc, err_msg=f"{case}: dcontext[{i}]", **TOL)
        if g_np.dbias is not None:
            np.testing.assert_allclose(cp.asnumpy(g_cp.dbias), g_np.dbias, err_msg=f"{case}: dbias", **TOL)


def test_multihead_layer_cached_decoding_equals_one_causal_forward(backend):
    cp = backend.xp
    layer = npattn.MultiheadAttention(
        params={name: cp.asarray(w) for name, w in mha_init(12, 4, num_kv_heads=1, seed=6).items()}, num_heads=4
    )
    x = cp.asarray(np.random.default_rng(1).standard_normal((2, 6, 12)))
    full, _ = layer(x, causal=True, impl="dense")
    cache = layer.new_cache(2, max_length=6)
    steps = [layer(x[:, i : i + 2], cache=cache, causal=True)[0] for i in range(0, 6, 2)]
    assert isinstance(cache.keys, cp.ndarray) and cache.length == 6
    np.testing.assert_allclose(cp.asnumpy(cp.concatenate(steps, axis=1)), cp.asnumpy(full), **TOL)
