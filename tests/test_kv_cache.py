"""Incremental decoding through npattn.kv_cache.KVCache: feeding a sequence
token by token or a few tokens at a time equals one causal forward over the
whole sequence, for growing and preallocated caches; bad use is a clear error."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from npattn.kv_cache import KVCache
from npattn.mha import MultiheadAttention, mha_backward, mha_forward, mha_init

HAS_CHUNKED = importlib.util.find_spec("npattn.chunked") is not None
NO_CHUNKED = pytest.mark.skipif(not HAS_CHUNKED, reason="npattn.chunked not there yet")
IMPLS = ["dense", pytest.param("chunked", marks=NO_CHUNKED)]


def random_params(rng, E, N, K=None):
    params = mha_init(E, N, num_kv_heads=K)
    return {name: rng.standard_normal(a.shape) * 0.5 for name, a in params.items()}


def decode(params, x, cache, step, **options):
    """Feed ``x (B, L, E)`` through ``cache`` ``step`` positions at a time;
    returns the concatenated outputs and the per-call weights."""
    outs, weights = [], []
    for start in range(0, x.shape[1], step):
        y, res = mha_forward(params, x[:, start : start + step], cache=cache, **options)
        outs.append(y)
        weights.append(res.weights)
    return np.concatenate(outs, axis=1), weights


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_length", [None, 7, 12], ids=["growing", "prealloc-exact", "prealloc-roomy"])
@pytest.mark.parametrize("step", [1, 3])
def test_decode_equals_full_causal_forward(step, max_length, impl):
    rng = np.random.default_rng(step * 100 + (max_length or 0))
    B, L, E, N, K = 2, 7, 8, 4, 2  # L = 7: chunks of 3 end with a chunk of 1
    params = random_params(rng, E, N, K)
    x = rng.standard_normal((B, L, E))
    y_full, res_full = mha_forward(params, x, num_heads=N, causal=True, need_weights=True)
    cache = KVCache.for_mha(params, B, num_heads=N, max_length=max_length)
    y_dec, weights = decode(
        params, x, cache, step, num_heads=N, causal=True, impl=impl, need_weights=True, block_q=2, block_k=2
    )
    np.testing.assert_allclose(y_dec, y_full, rtol=1e-13, atol=1e-13)
    assert cache.length == L and cache.keys.shape == (B, K, L, E // N)
    # each call's weights are rows of the full causal attention matrix
    start = 0
    for w in weights:
        t = w.shape[2]
        np.testing.assert_allclose(w, res_full.weights[:, :, start : start + t, : start + t], rtol=1e-13, atol=1e-15)
        start += t


def test_decode_with_sliding_window_and_prompt():
    """A prompt fed at once, then tokens one by one, with a sliding window."""
    rng = np.random.default_rng(1)
    B, L, E, N = 3, 9, 6, 2
    params = random_params(rng, E, N, K=1)
    x = rng.standard_normal((B, L, E))
    options = dict(num_heads=N, causal=True, window=(2, 0))
    y_full, _ = mha_forward(params, x, **options)
    cache = KVCache.for_mha(params, B, num_heads=N, max_length=L)
    y_prompt, _ = mha_forward(params, x[:, :4], cache=cache, **options)
    y_rest, _ = decode(params, x[:, 4:], cache, 1, **options)
    np.testing.assert_allclose(np.concatenate([y_prompt, y_rest], axis=1), y_full, rtol=1e-13, atol=1e-13)


def test_cached_keys_are_the_projections():
    rng = np.random.default_rng(2)
    params = random_params(rng, 8, 2)
    x = rng.standard_normal((1, 5, 8))
    cache = KVCache.for_mha(params, 1, num_heads=2)
    mha_forward(params, x, cache=cache, num_heads=2, causal=True)
    k = (x @ params["k_weight"].T + params["k_bias"]).reshape(1, 5, 2, 4).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(cache.keys, k, rtol=1e-14)
    assert cache.values.shape == (1, 2, 5, 4)


def test_cache_errors_name_the_problem():
    rng = np.random.default_rng(3)
    params = random_params(rng, 8, 2)
    x = rng.standard_normal((2, 3, 8))
    cache = KVCache.for_mha(params, 2, num_heads=2, max_length=4)
    mha_forward(params, x, cache=cache, num_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"cache is full: max_length=4 holds 3 positions and cannot take 3 more"):
        mha_forward(params, x, cache=cache, num_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"cache was made for batch_size=2, but x has batch size 1"):
        mha_forward(params, x[:1, :1], cache=cache, num_heads=2, causal=True)
    assert cache.length == 3  # failed calls did not advance it
    mha_forward(params, x[:, :1], cache=cache, num_heads=2, causal=True)  # exactly fills it
    assert cache.length == 4
    with pytest.raises(ValueError, match=r"cannot take 1 more"):
        mha_forward(params, x[:, :1], cache=cache, num_heads=2, causal=True)
    fresh = KVCache.for_mha(params, 2, num_heads=2)
    with pytest.raises(ValueError, match=r"context must be None"):
        mha_forward(params, x, x, cache=fresh, num_heads=2)
    with pytest.raises(ValueError, match=r"align must be None or 'bottom_right', got 'top_left'"):
        mha_forward(params, x, cache=fresh, num_heads=2, causal=True, align="top_left")
    with pytest.raises(ValueError, match=r"cache holds num_kv_heads=2, head_dim=4, but the layer has 1 and 4"):
        mha_forward(random_params(rng, 8, 2, K=1), x, cache=fresh, num_heads=2)
    with pytest.raises(TypeError, match=r"cache stores float32, but the layer computes in float64"):
        mha_forward(params, x, cache=KVCache(2, 2, 4, dtype=np.float32), num_heads=2)
    with pytest.raises(ValueError, match=r"dropout_p must be 0 with cache="):
        mha_forward(params, x, cache=fresh, num_heads=2, causal=True, dropout_p=0.5, seed=3)
    with pytest.raises(TypeError, match=r"cache must be an npattn KVCache"):
        mha_forward(params, x, cache={"k": None}, num_heads=2)
    with pytest.raises(ValueError, match=r"mask of shape"):  # the core's error, raised before the cache moves
        mha_forward(params, x, cache=fresh, num_heads=2, mask=np.ones((2, 5), bool))
    assert fresh.length == 0 and fresh.keys.shape == (2, 2, 0, 4)
    y, res = mha_forward(params, x, cache=fresh, num_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"forward only"):
        mha_backward(np.ones_like(y), res)


def test_kvcache_direct_use_and_reset():
    cache = KVCache(2, 1, 3, max_length=4)
    k = np.arange(2 * 1 * 2 * 3, dtype=np.float64).reshape(2, 1, 2, 3)
    keys, _values = cache.append(k, -k)
    np.testing.assert_array_equal(keys, k)
    held = cache.keys
    cache.reset()
    assert cache.length == 0
    cache.append(k + 100, k)
    np.testing.assert_array_equal(held, k)  # reset gave a fresh buffer: old views unchanged
    with pytest.raises(ValueError, match=r"got k with 2 heads of dim 3"):
        cache.append(np.zeros((2, 2, 1, 3)), np.zeros((2, 2, 1, 3)))
    with pytest.raises(TypeError, match=r"k has dtype float32 but the cache stores float64"):
        cache.append(np.zeros((2, 1, 1, 3), np.float32), np.zeros((2, 1, 1, 3), np.float32))
    with pytest.raises(ValueError, match=r"k and v must have one shape"):
        cache.append(np.zeros((2, 1, 1, 3)), np.zeros((2, 1, 2, 3)))
    with pytest.raises(ValueError, match=r"max_length must be >= 1"):
        KVCache(2, 1, 3, max_length=0)
    with pytest.raises(TypeError, match=r"batch_size must be an int"):
        KVCache(2.0, 1, 3)
    assert "length=2" in repr(cache) and "max_length=4" in repr(cache)


def test_layer_new_cache():
    layer = MultiheadAttention(8, 4, num_kv_heads=1, seed=5)
    x = np.random.default_rng(4).standard_normal((1, 4, 8))
    y_full, _ = layer(x, causal=True)
    cache = layer.new_cache(1)
    y_dec = np.concatenate([layer(x[:, i : i + 1], cache=cache, causal=True)[0] for i in range(4)], axis=1)
    np.testing.assert_allclose(y_dec, y_full, rtol=1e-13, atol=1e-13)


def test_decode_on_backends(backend):
    """Preallocated and growing caches on every backend match NumPy's decode."""
    import array_api_compat

    rng = np.random.default_rng(6)
    B, L, E, N = 2, 5, 8, 2
    params = random_params(rng, E, N, K=1)
    x = rng.standard_normal((B, L, E))
    y_ref, _ = mha_forward(params, x, num_heads=N, causal=True)
    b_params = {n: backend.asarray(a) for n, a in params.items()}
    b_x = backend.asarray(x)
    for max_length in (None, L):
        cache = KVCache.for_mha(b_params, B, num_heads=N, max_length=max_length)
        assert array_api_compat.device(cache.keys) == array_api_compat.device(b_x)
        outs = [
            mha_forward(b_params, b_x[:, i : min(i + 2, L), :], cache=cache, num_heads=N, causal=True)[0]
            for i in range(0, L, 2)
        ]
        np.testing.assert_allclose(
            np.concatenate([backend.to_numpy(o) for o in outs], axis=1), y_ref, rtol=1e-12, atol=1e-12
        )
    np.testing.assert_array_equal(backend.to_numpy(b_x), x)  # not mutated
