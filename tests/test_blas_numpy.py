"""Products cut to the BLAS's small-kernel sizes (:mod:`npattn.blas_numpy`):
the same bits as one product, the rule for when to cut, and its detection."""

from __future__ import annotations

import numpy as np
import pytest
import threadpoolctl

import npattn
from npattn import blas_numpy, fast_numpy
from npattn.options import make_spec


@pytest.fixture
def small_kernels(monkeypatch):
    """Products cut as on a BLAS with the small kernels, whatever this machine's."""
    monkeypatch.setattr(blas_numpy, "small_product_limit", lambda: blas_numpy.SMALL_PRODUCT_LIMIT)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    ("M", "K", "N", "pieces"),
    [
        (128, 64, 128, 2),
        (128, 65, 128, 2),
        (128, 128, 64, 2),
        (256, 64, 128, 3),
        (257, 64, 128, 3),
        (400, 64, 128, 4),
        (48, 384, 64, 2),  # the longest sums cut: SAME_BITS_TERMS
    ],
)
def test_pieces_give_the_bits_of_one_product(monkeypatch, blas_with_small_kernels, dtype, M, K, N, pieces):
    """A batch of products cut into pieces of rows (up to 4 here), against
    ``np.matmul`` whole, with ``a`` as it is and as a transposed view."""
    monkeypatch.setattr(blas_numpy, "MAX_PIECES", 4)
    rng = np.random.default_rng(M + K + N)
    b = rng.standard_normal((4, K, N)).astype(dtype)
    for a in (rng.standard_normal((4, M, K)).astype(dtype), np.swapaxes(rng.standard_normal((4, K, M)), -1, -2)):
        a = a.astype(dtype, copy=False)
        assert blas_numpy.row_pieces(a, b) == pieces
        out = np.full((4, M, N), np.nan, dtype=dtype)
        assert blas_numpy.matmul(a, b, out=out) is out
        np.testing.assert_array_equal(out, np.matmul(a, b))


@pytest.mark.parametrize(
    ("a_shape", "b_view", "why"),
    [
        ((4, 96, 64), lambda b: b[:, :64, :128], "fits the small kernels whole"),
        ((4, 128, 64), lambda b: np.swapaxes(b[:, :128, :64], -1, -2), "a transposed b"),
        ((4, 128, 64), lambda b: b[:, :64, ::2][..., :128], "b's columns strided"),
        ((4, 128, 64), lambda b: np.zeros((4, 64, 1024), np.float32)[..., :128], "b's rows 4 KiB apart"),
        ((4, 256, 64), lambda b: b[:, :64, :128], "more than MAX_PIECES pieces"),
        ((4, 48, 385), lambda b: np.zeros((4, 385, 64), np.float32), "sums longer than SAME_BITS_TERMS"),
        ((3, 128, 64), lambda b: b[:3, :64, :128], "fewer than MIN_BATCH products"),
        ((4, 128, 64), lambda b: b[:, :64, 0], "a product with a vector"),
    ],
)
def test_products_stay_whole_outside_the_rule(small_kernels, a_shape, b_view, why):
    b = b_view(np.zeros((4, 512, 512), np.float32))
    assert blas_numpy.row_pieces(np.zeros(a_shape, np.float32), b) == 1, why
    assert blas_numpy.row_pieces(np.zeros((4, 128, 64), np.float32), np.zeros((4, 64, 128), np.float32)) == 2


class _FakeController:
    """threadpoolctl's controller, reporting one loaded OpenBLAS per core in ``cores``."""

    cores: tuple[str, ...] = ()

    def select(self, **_):
        return self

    def info(self):
        return [{"internal_api": "openblas", "architecture": core} for core in self.cores]


@pytest.mark.parametrize(
    ("blas", "cores", "cuts"),
    [
        ("scipy-openblas", ("SkylakeX",), True),
        ("openblas", ("SapphireRapids", "Cooperlake"), True),
        ("mkl", ("SkylakeX",), False),  # NumPy's BLAS is not the OpenBLAS loaded beside it
        ("scipy-openblas", ("Haswell",), False),
        ("scipy-openblas", ("SkylakeX", "Zen"), False),  # one loaded OpenBLAS without the kernels
        ("scipy-openblas", (), False),  # threadpoolctl found none
    ],
)
def test_the_small_kernels_are_found_only_where_numpys_openblas_has_them(monkeypatch, blas, cores, cuts):
    """:func:`~npattn.blas_numpy.small_product_limit` from NumPy's build
    configuration and what threadpoolctl reports, whatever this machine's."""
    config = {"Build Dependencies": {"blas": {"name": blas}}}
    monkeypatch.setattr(np, "show_config", lambda mode=None: config)
    monkeypatch.setattr(_FakeController, "cores", cores)
    monkeypatch.setattr(threadpoolctl, "ThreadpoolController", _FakeController)
    blas_numpy.small_product_limit.cache_clear()
    try:
        assert blas_numpy.small_product_limit() == (blas_numpy.SMALL_PRODUCT_LIMIT if cuts else 0)
        a, b = np.zeros((4, 128, 64), np.float32), np.zeros((4, 64, 128), np.float32)
        assert blas_numpy.row_pieces(a, b) == (2 if cuts else 1)
    finally:
        blas_numpy.small_product_limit.cache_clear()


@pytest.mark.parametrize(
    "options", [{}, {"causal": True}, {"kv_lengths": np.array([128, 77, 128, 5])}], ids=["full", "causal", "kv_lengths"]
)
def test_fast_path_in_pieces_equals_the_generic_path(monkeypatch, options):
    """The fast path with its products cut (here from 2**17 multiply-adds,
    so that these small shapes cut too) against the generic chunked path in
    float64: forward and backward."""
    monkeypatch.setattr(blas_numpy, "small_product_limit", lambda: 2**17)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 8, 128, 16)) for _ in range(3))  # items of 4 kv heads
    dout = rng.standard_normal(q.shape)
    spec = make_spec(q, k, v, impl="chunked", **options)
    cut = []
    row_pieces = blas_numpy.row_pieces

    def counted_pieces(a, b):
        cut.append(row_pieces(a, b))
        return cut[-1]

    monkeypatch.setattr(blas_numpy, "row_pieces", counted_pieces)
    out, lse = fast_numpy.forward(spec, q, k, v)
    grads = fast_numpy.backward(spec, q, k, v, out, lse, dout, None)[:3]
    assert max(cut) > 1, "no product was cut"
    out_g, lse_g = npattn.chunked.chunked_forward(spec, q, k, v)
    grads_g = npattn.chunked.chunked_backward(spec, q, k, v, out_g, lse_g, dout, None)[:3]
    np.testing.assert_allclose(lse, lse_g, atol=1e-12, rtol=0)
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_g, *grads_g), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0, err_msg=name)
