"""Incremental decoding through npattn.kv_cache.KVCache: feeding a sequence
token by token or a few tokens at a time equals one causal forward over the
whole sequence, for growing and preallocated caches; bad use is a clear error."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import npattn
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
    with pytest.raises(ValueError, match=r"x has no new positions \(T=0\) and the cache is empty"):
        mha_forward(params, x[:, :0], cache=fresh, num_heads=2, causal=True)
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


# --- variants: softcap, sinks, ALiBi, segment ids (issue 14) -------------------


def decode_with_ids(params, x, cache, steps, ids=None, **options):
    """Feed ``x (B, L, E)`` through ``cache`` in chunks of the sizes in
    ``steps`` (cycled), passing each chunk's ``q_segment_ids`` when ``ids``
    (B, L) is given; returns the concatenated outputs."""
    outs, start, i = [], 0, 0
    while start < x.shape[1]:
        stop = min(start + steps[i % len(steps)], x.shape[1])
        chunk_ids = {} if ids is None else {"q_segment_ids": ids[:, start:stop]}
        outs.append(mha_forward(params, x[:, start:stop], cache=cache, **chunk_ids, **options)[0])
        start, i = stop, i + 1
    return np.concatenate(outs, axis=1)


def _variant_options(rng, N, variant):
    return {
        "softcap": {"softcap": 0.8},
        "alibi": {"alibi_slopes": rng.uniform(0.1, 1.0, N)},
        "softcap-alibi-window": {"softcap": 2.0, "alibi_slopes": rng.uniform(0.1, 1.0, N), "window": (3, 0)},
        # positions are the whole sequence's (bottom_right against the cache): key 2 back is hidden
        "score-mods": {
            "score_mods": [npattn.relative_position_bias(rng.standard_normal((N, 8)), max_distance=16)],
            "mask_mod": lambda idx: (idx.q - idx.k) != 2,
        },
    }.get(variant, {})


VARIANTS = ["sinks", "softcap", "alibi", "segments", "softcap-alibi-window", "sinks-alibi-segments", "score-mods"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_length", [None, 9], ids=["growing", "prealloc"])
@pytest.mark.parametrize("steps", [(1,), (4, 1, 2)], ids=["token-by-token", "prompt-then-mixed"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_with_variants_equals_full_causal_forward(variant, steps, max_length, impl):
    """Every variant decodes to the outputs of one causal forward: softcap
    and sinks are stateless, ALiBi reads the bottom-right positions against
    the cached keys, and the cache remembers the segment ids of its tokens."""
    rng = np.random.default_rng(len(variant) * 10 + len(steps))
    B, L, E, N, K = 2, 9, 8, 4, 2
    params = random_params(rng, E, N, K)
    if "sinks" in variant:
        params["sinks"] = rng.standard_normal(N)
    x = rng.standard_normal((B, L, E))
    ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2, 3]]) if "segments" in variant else None
    options = {"num_heads": N, "causal": True, **_variant_options(rng, N, variant)}
    y_full, _ = mha_forward(params, x, q_segment_ids=ids, **options)
    cache = KVCache.for_mha(params, B, num_heads=N, max_length=max_length)
    y_dec = decode_with_ids(params, x, cache, steps, ids, impl=impl, block_q=2, block_k=2, **options)
    np.testing.assert_allclose(y_dec, y_full, rtol=1e-13, atol=1e-13)
    assert cache.length == L
    if ids is None:
        assert cache.segment_ids is None
    else:
        np.testing.assert_array_equal(cache.segment_ids, ids)
        assert cache.segment_ids.dtype == np.int64
    plain = {name: a for name, a in params.items() if name != "sinks"}
    assert not np.allclose(mha_forward(plain, x, num_heads=N, causal=True)[0], y_full)  # the variant acts


def test_alibi_decoding_uses_bottom_right_positions():
    """One new query over 5 cached keys sits at position 5: its ALiBi bias is
    -m |5 - j|, which a top-left alignment (position 0) would get wrong."""
    rng = np.random.default_rng(11)
    B, L, E, N = 1, 6, 4, 2
    params = random_params(rng, E, N)
    x = rng.standard_normal((B, L, E))
    slopes = np.array([0.5, 2.0])
    cache = KVCache.for_mha(params, B, num_heads=N)
    mha_forward(params, x[:, :5], cache=cache, num_heads=N, causal=True, alibi_slopes=slopes)
    y_last, res = mha_forward(
        params, x[:, 5:], cache=cache, num_heads=N, causal=True, alibi_slopes=slopes, need_weights=True
    )
    assert res.spec.align == "bottom_right"
    y_full, res_full = mha_forward(params, x, num_heads=N, causal=True, alibi_slopes=slopes, need_weights=True)
    np.testing.assert_allclose(y_last, y_full[:, 5:], rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(res.weights, res_full.weights[:, :, 5:], rtol=1e-13, atol=1e-15)
    w = res.weights[0, 1, 0]  # steep head: the nearest key (j = 5) weighs most
    assert w.argmax() == 5
    with pytest.raises(ValueError, match=r"align must be None or 'bottom_right', got 'top_left'"):
        mha_forward(params, x[:, 5:], cache=cache, num_heads=N, alibi_slopes=slopes, align="top_left")


def test_segment_ids_hide_earlier_documents_while_decoding():
    """A new document's first token sees only itself (and the sink): its
    output equals that of the token decoded alone."""
    rng = np.random.default_rng(12)
    B, E, N = 1, 4, 2
    params = random_params(rng, E, N)
    params["sinks"] = rng.standard_normal(N)
    x = rng.standard_normal((B, 4, E))
    cache = KVCache.for_mha(params, B, num_heads=N, max_length=4)
    mha_forward(params, x[:, :3], cache=cache, num_heads=N, causal=True, q_segment_ids=np.array([[0, 0, 0]]))
    y_new, res = mha_forward(
        params, x[:, 3:], cache=cache, num_heads=N, causal=True, q_segment_ids=np.array([[1]]), need_weights=True
    )
    alone, _ = mha_forward(params, x[:, 3:], num_heads=N, causal=True)
    np.testing.assert_allclose(y_new, alone, rtol=1e-13, atol=1e-13)
    np.testing.assert_array_equal(res.weights[..., :3], 0.0)
    np.testing.assert_array_equal(cache.segment_ids, [[0, 0, 0, 1]])


def test_cache_segment_ids_misuse_is_a_clear_error():
    rng = np.random.default_rng(13)
    params = random_params(rng, 8, 2)
    x = rng.standard_normal((2, 3, 8))
    ids = np.zeros((2, 3), dtype=np.int32)
    plain = KVCache.for_mha(params, 2, num_heads=2)
    mha_forward(params, x, cache=plain, num_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"q_segment_ids given, but the cache holds 3 positions without segment ids"):
        mha_forward(params, x, cache=plain, num_heads=2, causal=True, q_segment_ids=ids)
    with_ids = KVCache.for_mha(params, 2, num_heads=2, max_length=8)
    mha_forward(params, x, cache=with_ids, num_heads=2, causal=True, q_segment_ids=ids)
    with pytest.raises(ValueError, match=r"the cache holds segment ids for its 3 positions: pass q_segment_ids"):
        mha_forward(params, x, cache=with_ids, num_heads=2, causal=True)
    with pytest.raises(ValueError, match=r"with cache= pass only q_segment_ids, the new tokens' ids"):
        mha_forward(params, x, cache=with_ids, num_heads=2, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    with pytest.raises(ValueError, match=r"q_segment_ids must have shape \(B, T\) = \(2, 3\)"):
        mha_forward(params, x, cache=with_ids, num_heads=2, causal=True, q_segment_ids=np.zeros((2, 6), int))
    with pytest.raises(TypeError, match=r"q_segment_ids must have an integer dtype"):
        mha_forward(params, x, cache=with_ids, num_heads=2, causal=True, q_segment_ids=np.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"mask of shape"):  # fails in the core, after staging: nothing moves
        mha_forward(params, x, cache=with_ids, num_heads=2, q_segment_ids=ids + 1, mask=np.ones((2, 5), bool))
    assert with_ids.length == 3
    np.testing.assert_array_equal(with_ids.segment_ids, np.zeros((2, 3)))
    held = with_ids.segment_ids
    with_ids.reset()
    assert with_ids.segment_ids is None and with_ids.length == 0
    mha_forward(params, x, cache=with_ids, num_heads=2, causal=True)  # after reset: either kind again
    assert with_ids.segment_ids is None
    np.testing.assert_array_equal(held, np.zeros((2, 3)))  # views handed out before reset keep their values
    ids[:] = 7  # the caller's array is copied, never stored
    fresh = KVCache.for_mha(params, 2, num_heads=2)
    mha_forward(params, x, cache=fresh, num_heads=2, q_segment_ids=ids)
    ids[:] = 0
    np.testing.assert_array_equal(fresh.segment_ids, np.full((2, 3), 7))


def test_kvcache_append_with_segment_ids():
    for max_length in (None, 5):
        cache = KVCache(2, 1, 3, max_length=max_length)
        k = np.ones((2, 1, 2, 3))
        cache.append(k, k, segment_ids=np.array([[0, 0], [0, 1]], dtype=np.int8))
        cache.append(k[:, :, :1], k[:, :, :1], segment_ids=np.array([[1], [1]]))
        np.testing.assert_array_equal(cache.segment_ids, [[0, 0, 1], [0, 1, 1]])
        assert cache.segment_ids.dtype == np.int64
        with pytest.raises(ValueError, match=r"segment_ids must have shape \(B, t\) = \(2, 1\), got \(2, 2\)"):
            cache.append(k[:, :, :1], k[:, :, :1], segment_ids=np.zeros((2, 2), int))
        with pytest.raises(TypeError, match=r"segment_ids must have an integer dtype, got float64"):
            cache.append(k[:, :, :1], k[:, :, :1], segment_ids=np.zeros((2, 1)))
        with pytest.raises(TypeError, match=r"segment_ids must be an integer array of shape \(B, t\) = \(2, 1\)"):
            cache.append(k[:, :, :1], k[:, :, :1], segment_ids=[[0], [0]])
        with pytest.raises(ValueError, match=r"pass segment_ids \(B, t\) for the new positions too"):
            cache.append(k[:, :, :1], k[:, :, :1])
        assert cache.length == 3


def test_decode_variants_on_backends(backend):
    """Segment ids in growing and preallocated caches, with sinks and ALiBi,
    on every backend match NumPy's full forward."""
    rng = np.random.default_rng(14)
    B, L, E, N = 2, 5, 8, 2
    params = random_params(rng, E, N, K=1)
    params["sinks"] = rng.standard_normal(N)
    x = rng.standard_normal((B, L, E))
    ids = np.array([[0, 0, 1, 1, 1], [0, 0, 0, 0, 2]])
    slopes = np.array([0.25, 1.0])
    y_ref, _ = mha_forward(params, x, num_heads=N, causal=True, alibi_slopes=slopes, q_segment_ids=ids)
    to = backend.asarray
    b_params, b_x, b_ids, b_slopes = {n: to(a) for n, a in params.items()}, to(x), to(ids), to(slopes)
    for max_length in (None, L):
        cache = KVCache.for_mha(b_params, B, num_heads=N, max_length=max_length)
        outs = [
            mha_forward(
                b_params,
                b_x[:, i : min(i + 2, L), :],
                cache=cache,
                num_heads=N,
                causal=True,
                alibi_slopes=b_slopes,
                q_segment_ids=b_ids[:, i : min(i + 2, L)],
            )[0]
            for i in range(0, L, 2)
        ]
        got = np.concatenate([backend.to_numpy(o) for o in outs], axis=1)
        np.testing.assert_allclose(got, y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(backend.to_numpy(cache.segment_ids), ids)
    np.testing.assert_array_equal(backend.to_numpy(b_ids), ids)  # not mutated
