"""Numerical stress on both paths (dense and chunked; NumPy), issue 7.

What "correct" means at the edges, and the assertions that pin it down:

- float32 scores up to +-1e4: finite, and equal to a float64 reference of the
  same (float32-rounded) inputs within the error float32 can make in the
  scores themselves, ``delta = scale * (|q| @ |k|^T) * H * eps32``.
- float16 inputs up to 6e4 compute in float32. Where the float32 math is
  finite the results are finite: ``out`` is a convex combination of rows of
  ``v``, so it always fits float16; ``lse`` is float32. A gradient is
  returned in float16 and is +-inf exactly where its true value lies beyond
  float16's range (IEEE rounding of an out-of-range value), finite and
  correctly rounded elsewhere.
- scale 1e-30 gives uniform attention over the visible keys (the limit);
  scale 1e30 gives a hard max (the value of the best key), never NaN.
- sizes of one and zero, lengths of 0 and all-False mask rows follow the
  fully-masked-row rule: out 0, lse -inf, gradients 0, never NaN.
"""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest

import npattn

PATHS = ("dense", "chunked-fast", "chunked-generic")


def run(path, q, k, v, dout=None, dlse=None, **options):
    """Forward (and backward when ``dout`` is given) on one path."""
    env = {"NPATTN_FAST_NUMPY": "0"} if path == "chunked-generic" else {}
    with mock.patch.dict(os.environ, env):
        out, res = npattn.attention_forward(q, k, v, impl="dense" if path == "dense" else "chunked", **options)
        grads = None if dout is None else npattn.attention_backward(dout, res, dlse=dlse)
    return out, res, grads


# --- float16 on every path ------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_float16_inputs_run_on_every_path(path):
    """float16 on the NumPy chunked fast path raised AttributeError ('numpy.float32'
    has no attribute 'type'): compute_dtype returned the scalar type, not a dtype."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8)))
    dout = rng.standard_normal((2, 4, 5, 8)).astype(np.float16)
    out, res, grads = run(path, q, k, v, dout, causal=True, align="bottom_right", block_q=2, block_k=3)
    out_d, res_d, grads_d = run("dense", q, k, v, dout, causal=True, align="bottom_right")
    assert out.dtype == np.float16 and res.lse.dtype == np.float32
    np.testing.assert_allclose(out.astype(np.float32), out_d.astype(np.float32), atol=2e-3)
    np.testing.assert_allclose(res.lse, res_d.lse, atol=1e-5)
    for g, g_d in zip(grads[:3], grads_d[:3]):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), g_d.astype(np.float32), atol=2e-2)
