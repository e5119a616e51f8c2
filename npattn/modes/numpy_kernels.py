r"""NumPy fast path of the derivative modes: the JVP and the forward-over-reverse
of :mod:`npattn.modes.jvp` and :mod:`npattn.modes.second_order`, with the
machinery of :mod:`npattn.fast_numpy` (its thread pool of independent items,
single-threaded BLAS inside them, tile plans and spans, position-major rows,
the flushed ``exp``, the score pipeline's per-span units). The JVP runs its
own forward in the exact mode (:meth:`npattn.fast_numpy._Mode.exact`: base
e, no fused shifts, no bounds, since no bound covers a tangent); the
forward-over-reverse takes ``P`` from the fast forward's ``lse`` in that
forward's own mode (see :class:`_Call`).

The tangents' operands sit side by side, ``[scale Q', scale Q]`` and
``[K^T; K'^T]``, ``[dO', dO]`` and ``[V^T; V'^T]``, and each tangent is the
sum of two products of their halves (:func:`_sum_of_products`), never one
product of twice the depth, nor one sum over all G heads' rows: the
dense path's float32 error, within 1.5x (``tests/test_fast_accuracy.py``).

**JVP** (:func:`forward_jvp`): one item per (batch element, kv head, query
tile), the sweep of :mod:`npattn.modes.jvp` with ``m``, ``l``, ``acc``,
``c``, ``acc'``; the running maximum is updated on every span (exact mode,
no lazy threshold). **Forward-over-reverse** (:func:`backward_jvp`): ``O'``
and ``lse'`` first (:func:`tangent_rows`, from the forward's ``O`` and ``lse``),
then one item per (batch element, kv head), key tiles outside, as the fast
backward. Both are tested against the generic
chunked code and against central differences. The double backward has no
fast path (it runs the generic chunked code on NumPy too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..chunked import tile_ranges
from ..fast_numpy import (
    _add_row_products,
    _augmented_rows,
    _augmented_transposed,
    _base_scale,
    _batch_plans,
    _blocks,
    _buffer,
    _Exp,
    _factor_sides,
    _head_major,
    _Item,
    _lse_in_base,
    _Mode,
    _position_major,
    _rows,
    handles,
)
from ..options import AttentionSpec
from ..scores.mods import mods_jvp
from ..scores.tiles import select_item, slice_tile
from ..threads import run_items

__all__ = ["supports", "forward_jvp", "tangent_rows", "backward_jvp"]


def supports(spec: AttentionSpec) -> bool:
    """Whether these kernels take ``spec``: NumPy in float32/float64 (as the
    fast path, ``NPATTN_FAST_NUMPY=0`` included)."""
    return handles(spec.xp, spec.compute_dtype)


def _pair_transposed(x3: Any, x3_dot: Any, dtype: Any) -> Any:
    """``[x^T; x'^T]``: two ``(..., L, D)`` -> ``(..., 2D, L)``, contiguous."""
    return np.ascontiguousarray(np.concatenate([np.swapaxes(x3, -1, -2), np.swapaxes(x3_dot, -1, -2)], axis=-2), dtype)


def _sum_of_products(left: Any, right: Any, out: Any = None) -> Any:
    """``a' b + a b'`` from ``left = [a', a] (R, 2D)`` and ``right = [b; b']
    (2D, L)``: two products of depth D, added. One product of depth 2D
    would round each sum of terms of both signs as one long sum, which cost
    the tangents up to 1.5x the dense path's float32 error (``lse'`` with a
    softcap, issue 17's shape)."""
    D = left.shape[-1] // 2
    out = np.matmul(left[:, :D], right[:D], out=out)  # (R, D) @ (D, L): a' b
    out += left[:, D:] @ right[D:]  # a b'
    return out


def _pair_rows(x_dot: Any, x: Any, scale: Any, dtype: Any) -> Any:
    """``[scale x', scale x]`` in position-major rows: ``(G, tq, D)`` x 2 -> ``(tq*G, 2D)``."""
    D = x.shape[-1]
    rows = np.empty((x.shape[0] * x.shape[1], 2 * D), dtype=dtype)
    np.multiply(_position_major(x_dot), scale, out=rows[:, :D])
    np.multiply(_position_major(x), scale, out=rows[:, D:])
    return rows


class _Tangents:
    """A span's tangent of the scores, ``S' (R, tk)``, built beside the scores
    by :meth:`_Item.scores` (the pipeline's units, written once)."""

    def __init__(self, spec: AttentionSpec, item: _Item, bias_dot: Any | None):
        self.spec, self.item, self.bias_dot = spec, item, bias_dot

    def scores(self, s: Any, sd: Any, tanh: Any, qs: Any, qcat: Any, kTa: Any, kcat: Any, span: tuple) -> Any:
        """Fill ``s`` (scores, hidden -> -inf) and ``sd`` (``S'``, hidden -> 0);
        return ``(a, b, R')`` for the second order (``a``, ``b`` Python floats
        without a softcap, ``R'`` a copy only with one); with a softcap,
        ``tanh`` receives ``t = tanh(R / c)``."""
        spec, item = self.spec, self.item
        p0, p1, c0, c1, _ = span
        _sum_of_products(qcat, kcat[:, c0:c1], out=sd)  # (R, 2H), (2H, tk) -> R' = scale (Q' K^T + Q K'^T)
        state = item.scores(s, qs, kTa, span, hide=False, tanh=tanh)
        a: Any = 1.0
        b: Any = 0.0
        raw_dot = sd
        if spec.softcap is not None:  # a = 1 - t^2, b = -2 t a / c
            a = 1.0 - tanh * tanh
            b = (-2.0 / spec.softcap) * tanh * a
            raw_dot = sd.copy()
            sd *= a
        if self.bias_dot is not None:
            tile = slice_tile(select_item(spec, self.bias_dot, item.b, item.heads), p0, p1, c0, c1)
            sd += item._as_rows(tile, p1 - p0, c1 - c0, like=sd)
        if state is not None:  # S' through the modifications (elementwise: their backward)
            sd4 = _head_major(sd, p1 - p0, item.G)[None]  # (1, G, tq, tk), a view
            np.copyto(sd4, mods_jvp(spec, sd4.copy(), state.inputs, state.index))
        item.fill_hidden(s, span, -np.inf)
        item.fill_hidden(sd, span, 0)
        return a, b, raw_dot


class _Call:
    """What every item of one call shares: the tiles and their plans, the
    mode of the scores, the flushed ``exp``, the scales and the ALiBi
    distances.

    ``mode`` is the exact one (:meth:`_Mode.exact`) for a JVP, which runs
    its own forward. The forward-over-reverse takes the fast forward's
    (:meth:`_Mode.of_inputs`), so that its ``P = exp(S - lse)`` comes from the
    scores that forward's ``lse`` summed, in its base and with its shifts in
    the products, as the fast backward's ``P`` does: in base e against a
    base-2 ``lse`` the two roundings no longer cancel in a row's sums, and
    float32 Hessian-vector products had 1.8x the dense path's dQ' error and
    2.4x its dV' (issue 17's causal case)."""

    def __init__(self, spec: AttentionSpec, mode: _Mode | None = None):
        dtype = spec.compute_dtype
        self.spec, self.mode = spec, _Mode.exact(spec) if mode is None else mode
        self.block_q, self.block_k = _blocks(spec)
        self.q_tiles, self.k_tiles = tile_ranges(spec.q_len, self.block_q), tile_ranges(spec.kv_len, self.block_k)
        self.plans = _batch_plans(spec, self.q_tiles, self.k_tiles)  # [b][qi][kj]
        self.exp = _Exp(self.mode.base2, dtype)
        self.scale = dtype.type(spec.scale)  # the tangents' factor: S' is in nats
        # The scores' factor c, on Q or on K as the fast path puts it, and their base b
        factor, self.base = _base_scale(spec, self.mode)
        self.q_factor, self.k_factor = _factor_sides(factor)
        self.ones_k = np.ones(self.block_k, dtype=dtype)

    def item(self, b: int, kv: int) -> _Item:
        """The (batch element, kv head) item ``(b, kv)``."""
        return _Item(self.spec, b, (kv, kv + 1), self.mode)

    def shift(self, lse_rows: Any) -> Any:
        """``lse`` in the scores' base, as the fast backward subtracts it."""
        return _lse_in_base(lse_rows, self.base, self.mode, self.spec.compute_dtype)

    def query_rows(self, q_rows: Any, shift: Any | None = None) -> Any:
        """``[c Q, -shift]`` in position-major rows, ``(G, tq, H) -> (tq*G,
        H+1)``: the row shifts ride in the products where the mode fuses
        them, else the column is 0 (and :attr:`unshifted` tells the caller
        to subtract them)."""
        column = -shift if shift is not None and self.mode.fused else 0
        return _augmented_rows(q_rows, column, self.q_factor, self.spec.compute_dtype)

    @property
    def unshifted(self) -> bool:
        """Whether the products leave the row shifts for a pass of their own."""
        return not self.mode.fused


class _QueryTile:
    """One query-tile item ``(b, kv, qi)`` of :func:`forward_jvp` and
    :func:`tangent_rows`: its rows ``[c Q, -shift]`` (:meth:`_Call.query_rows`;
    ``lse`` rows, in nats, give the shifts) and ``[scale Q', scale Q]`` and one
    set of span buffers, and its spans with ``S`` and ``S'`` built."""

    def __init__(
        self, call: _Call, job: tuple[int, int, int], inputs: tuple, dots: tuple, keep_inputs: bool, lse: Any = None
    ):
        spec, dtype = call.spec, call.spec.compute_dtype
        b, kv, qi = job
        q3, qd3, kTa, kcat = inputs  # (B, N, T, H) x 2, (B, K, H+1, S), (B, K, 2H, S)
        self.call, self.b, self.kv, self.qi = call, b, kv, qi
        self.q0, self.q1 = call.q_tiles[qi]
        self.item = call.item(b, kv)
        self.item.keep_inputs = keep_inputs
        self.tangents = _Tangents(spec, self.item, dots[3])
        heads, G = self.item.head_slice, spec.group_size
        self.rows = G * (self.q1 - self.q0)
        # the tile's lse rows in the scores' base, (tq*G,), or None
        self.shift: Any = None if lse is None else call.shift(_position_major(lse[b, heads, self.q0 : self.q1]))
        self.qa = call.query_rows(q3[b, heads, self.q0 : self.q1], self.shift)  # (tq*G, H+1)
        self.qcat = _pair_rows(qd3[b, heads, self.q0 : self.q1], q3[b, heads, self.q0 : self.q1], call.scale, dtype)
        self.kTa, self.kcat = kTa[b, kv], kcat[b, kv]  # (H+1, S), (2H, S)
        size = self.rows * call.block_k
        self.flats = [np.empty(size, dtype=dtype) for _ in range(2 if spec.softcap is None else 3)]

    def spans(self):
        """``(span, r, s, s')`` for each span of the tile, ``s`` the scores and
        ``s'`` their tangent, ``(R, tk)`` each, hidden entries -inf / 0."""
        G = self.call.spec.group_size
        for plan in self.call.plans[self.b][self.qi]:
            for span in plan:
                r, (c0, c1) = _rows(span, self.q0, G), span[2:4]
                s, sd, *tanh = (_buffer(flat, r.stop - r.start, c1 - c0) for flat in self.flats)
                self.tangents.scores(
                    s, sd, tanh[0] if tanh else None, self.qa[r], self.qcat[r], self.kTa, self.kcat, span
                )
                yield span, r, s, sd

    def write(self, target: Any, rows: Any) -> None:
        """Write ``rows (tq*G, ...)`` into ``target[b, heads, q0:q1]`` head-major."""
        target[self.b, self.item.head_slice, self.q0 : self.q1] = _head_major(rows, self.q1 - self.q0, self.item.G)


def _inputs(spec: AttentionSpec, q: Any, k: Any, v: Any, dots: tuple) -> tuple:
    """The inputs as ``(B, heads, L, D)`` and the keys' fused ``[K^T; K'^T]``."""
    Bf, N, K = spec.num_batch, spec.num_heads, spec.num_kv_heads
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    q3, qd3 = (np.reshape(x, (Bf, N, T, H)) for x in (q, dots[0]))  # (B, N, T, H)
    k3, kd3 = (np.reshape(x, (Bf, K, S, H)) for x in (k, dots[1]))  # (B, K, S, H)
    v3, vd3 = (np.reshape(x, (Bf, K, S, Hv)) for x in (v, dots[2]))  # (B, K, S, Hv)
    return q3, qd3, k3, kd3, v3, vd3


def forward_jvp(spec: AttentionSpec, q: Any, k: Any, v: Any, dots: tuple) -> tuple[Any, Any, Any, Any]:
    """``(out, lse, out', lse')`` over the real keys; same contract as
    :func:`npattn.modes.jvp.chunked_jvp`."""
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, Hv = spec.q_len, spec.value_dim
    q3, qd3, k3, kd3, v3, vd3 = _inputs(spec, q, k, v, dots)
    call = _Call(spec)
    kTa = _augmented_transposed(k3, dtype, scale=call.k_factor)  # (B, K, H+1, S)
    kcat = _pair_transposed(k3, kd3, dtype)  # (B, K, 2H, S)
    out, out_dot = np.zeros((Bf, N, T, Hv), dtype=dtype), np.zeros((Bf, N, T, Hv), dtype=dtype)
    lse, lse_dot = np.full((Bf, N, T), -np.inf, dtype=dtype), np.zeros((Bf, N, T), dtype=dtype)

    def work(job):
        tile = _QueryTile(call, job, (q3, qd3, kTa, kcat), dots, keep_inputs=bool(spec.score_mods))
        b, kv, rows = tile.b, tile.kv, tile.rows
        m = np.full(rows, -np.inf, dtype=dtype)
        l, c = np.zeros(rows, dtype=dtype), np.zeros(rows, dtype=dtype)
        acc, acc_dot = np.zeros((rows, Hv), dtype=dtype), np.zeros((rows, Hv), dtype=dtype)
        for span, r, s, sd in tile.spans():
            c0, c1 = span[2:4]
            m_new = np.maximum(m[r], s.max(axis=1))  # (R,)
            m_safe = np.where(m_new == -np.inf, 0, m_new).astype(dtype, copy=False)  # no exp(-inf - -inf)
            if np.any(m_new > m[r]):
                alpha = np.exp(m[r] - m_safe)  # (R,): 0 where nothing was seen yet
                l[r] *= alpha
                c[r] *= alpha
                acc[r] *= alpha[:, None]
                acc_dot[r] *= alpha[:, None]
                m[r] = m_new
            s -= m_safe[:, None]
            call.exp.flushed(s)  # P~ (R, tk): exact 0 where hidden, never subnormal
            l[r] += s @ call.ones_k[: c1 - c0]  # (R, tk) @ (tk,)
            sd *= s  # P~ S'
            c[r] += sd @ call.ones_k[: c1 - c0]
            drop = tile.item.dropout_scale(*span[:4], like=s)
            if drop is not None:
                s *= drop
                sd *= drop
            vj, vdj = v3[b, kv, c0:c1], vd3[b, kv, c0:c1]  # (tk, Hv)
            acc[r] += s @ vj  # (R, tk) @ (tk, Hv)
            acc_dot[r] += sd @ vj + s @ vdj
        empty = l == 0
        l[empty] = 1
        o = acc / l[:, None]  # (tq*G, Hv)
        row_lse_dot = c / l
        tile.write(out, o)
        tile.write(out_dot, acc_dot / l[:, None] - row_lse_dot[:, None] * o)
        tile.write(lse, np.where(empty, -np.inf, m + np.log(l)))
        tile.write(lse_dot, row_lse_dot)

    run_items(
        [(b, kv, qi) for qi in range(len(call.q_tiles)) for b in range(Bf) for kv in range(K) if G],
        work,
    )
    bs = spec.batch_shape
    return (
        out.reshape(bs + (N, T, Hv)),
        lse.reshape(bs + (N, T)),
        out_dot.reshape(bs + (N, T, Hv)),
        lse_dot.reshape(bs + (N, T)),
    )


def tangent_rows(spec: AttentionSpec, res: Any, dots: tuple, lse_safe: Any) -> tuple[Any, Any]:
    """``(O', lse')`` from the forward's own ``O`` and ``lse`` (sinks included,
    ``-inf`` replaced by 0 in ``lse_safe``): with ``P = exp(S - lse)`` known,
    ``lse' = rowsum(P S')`` and ``O' = sum_j P M (S' V + V') - lse' O`` need no
    running maximum, no rescaling and no ``P V`` (a JVP sweep less one GEMM),
    as :func:`backward_jvp`'s first sweep. ``P`` in the fast forward's mode
    (see :class:`_Call`)."""
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, Hv = spec.q_len, spec.value_dim
    q3, qd3, k3, kd3, v3, vd3 = _inputs(spec, res.q, res.k, res.v, dots)
    o3, lse3 = np.reshape(res.out, (Bf, N, T, Hv)), np.reshape(lse_safe, (Bf, N, T))
    call = _Call(spec, _Mode.of_inputs(spec, res.q, res.k))
    kTa = _augmented_transposed(k3, dtype, scale=call.k_factor)  # (B, K, H+1, S)
    kcat = _pair_transposed(k3, kd3, dtype)  # (B, K, 2H, S)
    out_dot, lse_dot = np.empty((Bf, N, T, Hv), dtype=dtype), np.empty((Bf, N, T), dtype=dtype)

    def work(job):
        tile = _QueryTile(call, job, (q3, qd3, kTa, kcat), dots, keep_inputs=False, lse=lse3)
        b, kv, heads = tile.b, tile.kv, tile.item.head_slice
        c, acc_dot = np.zeros(tile.rows, dtype=dtype), np.zeros((tile.rows, Hv), dtype=dtype)
        for span, r, p, sd in tile.spans():
            c0, c1 = span[2:4]
            if call.unshifted:
                p -= tile.shift[r, None]
            call.exp.flushed(p)  # P (R, tk)
            sd *= p  # P S'
            c[r] += sd @ call.ones_k[: c1 - c0]
            drop = tile.item.dropout_scale(*span[:4], like=p)
            if drop is not None:
                p *= drop
                sd *= drop
            acc_dot[r] += sd @ v3[b, kv, c0:c1] + p @ vd3[b, kv, c0:c1]  # (R, tk) @ (tk, Hv)
        o = _position_major(o3[b, heads, tile.q0 : tile.q1])  # (tq*G, Hv)
        tile.write(out_dot, acc_dot - c[:, None] * o)
        tile.write(lse_dot, c)

    run_items(
        [(b, kv, qi) for qi in range(len(call.q_tiles)) for b in range(Bf) for kv in range(K) if G],
        work,
    )
    return out_dot.reshape(spec.batch_shape + (N, T, Hv)), lse_dot.reshape(spec.batch_shape + (N, T))


def backward_jvp(spec: AttentionSpec, res: Any, dO: Any, rows_terms: tuple, dots: tuple, dO_dot: Any) -> tuple:
    """Forward-over-reverse: ``(dq', dk', dv', dbias')`` in the compute dtype.

    ``rows_terms`` is ``(lse, lse', D, D')``, each ``(..., N, T)`` (``lse``
    with ``-inf`` replaced by 0), from the JVP and the cotangents. As the
    fast backward: ``P`` in the fast forward's mode (see :class:`_Call`),
    and the query tiles and spans of a key tile last first. Unlike it, dK'
    and dV' sum head by head in every span
    (:func:`~npattn.fast_numpy._add_row_products`), and dQ' takes ``dR' K``
    and ``dR K'`` as two products: the tangents' terms carry both signs, and
    one long sum (all G heads' rows, or ``[dR', dR] @ [K; K']`` of depth
    ``2 tk``) loses more to rounding than the dense path's per-head
    products. With full attention (issue 17's shape) they had 1.5-1.8x the
    dense path's float32 error, now 1.1-1.3x."""
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    q3, qd3, k3, kd3, v3, vd3 = _inputs(spec, res.q, res.k, res.v, dots)
    do3, dod3 = (np.reshape(x, (Bf, N, T, Hv)) for x in (dO, dO_dot))  # (B, N, T, Hv)
    lse3, lse_dot3, D3, D_dot3 = (np.reshape(x, (Bf, N, T)) for x in rows_terms)  # (B, N, T)
    dq_dot = np.empty((Bf, N, T, H), dtype=dtype)
    dk_dot, dv_dot = np.empty((Bf, K, S, H), dtype=dtype), np.empty((Bf, K, S, Hv), dtype=dtype)
    dbias_dot = None if spec.bias is None else np.zeros(spec.bias.shape, dtype=dtype)
    call = _Call(spec, _Mode.of_inputs(spec, res.q, res.k))
    k_tiles, plans, exp, scale = call.k_tiles, call.plans, call.exp, call.scale

    def work(job):
        b, kv = job
        item = call.item(b, kv)
        tangents, heads = _Tangents(spec, item, dots[3]), item.head_slice
        lse_b, lse_dot_b, D_b, D_dot_b = (_position_major(x[b, heads]) for x in (lse3, lse_dot3, D3, D_dot3))  # (T*G,)
        shift = call.shift(lse_b)  # (T*G,): lse in the scores' base
        qa = call.query_rows(q3[b, heads], shift)  # (T*G, H+1) = [c Q, -shift]
        qcat = _pair_rows(qd3[b, heads], q3[b, heads], scale, dtype)  # (T*G, 2H) = [scale Q', scale Q]
        qds, qs = qcat[:, :H], qcat[:, H:]
        do_b = _position_major(do3[b, heads])  # (T*G, Hv)
        docat = _pair_rows(dod3[b, heads], do3[b, heads], 1, dtype)  # (T*G, 2Hv) = [dO', dO]
        kTa = _augmented_transposed(k3[b, kv], dtype, scale=call.k_factor)  # (H+1, S)
        kcat = _pair_transposed(k3[b, kv], kd3[b, kv], dtype)  # (2H, S)
        vT = np.ascontiguousarray(v3[b, kv].T)  # (Hv, S)
        vcat = _pair_transposed(v3[b, kv], vd3[b, kv], dtype)  # (2Hv, S)
        dq_b = np.zeros((T * G, H), dtype=dtype)
        dk_tmp, dv_tmp = np.empty((call.block_k, H), dtype=dtype), np.empty((call.block_k, Hv), dtype=dtype)
        for kj, (k0, k1) in enumerate(k_tiles):
            dk_j, dv_j = np.zeros((k1 - k0, H), dtype=dtype), np.zeros((k1 - k0, Hv), dtype=dtype)
            for plan in reversed([row[kj] for row in plans[b]]):
                for span in reversed(plan):
                    r, (c0, c1) = _rows(span, 0, G), span[2:4]
                    cols = slice(c0 - k0, c1 - k0)
                    R, tk = r.stop - r.start, c1 - c0
                    p, sd = np.empty((R, tk), dtype=dtype), np.empty((R, tk), dtype=dtype)
                    tanh = None if spec.softcap is None else np.empty((R, tk), dtype=dtype)
                    a, b2, raw_dot = tangents.scores(p, sd, tanh, qa[r], qcat[r], kTa, kcat, span)
                    if call.unshifted:
                        p -= shift[r, None]
                    exp.flushed(p)  # P (R, tk)
                    sd -= lse_dot_b[r, None]
                    sd *= p  # P' = P (S' - lse')
                    drop = item.dropout_scale(*span[:4], like=p)
                    pm, pm_dot = (p, sd) if drop is None else (p * drop, sd * drop)
                    _add_row_products(dv_j[cols], pm_dot, do_b[r], dv_tmp[:tk], True, G)  # (tk, R) @ (R, Hv)
                    _add_row_products(dv_j[cols], pm, docat[r, :Hv], dv_tmp[:tk], True, G)
                    dp = do_b[r] @ vT[:, c0:c1]  # (R, Hv) @ (Hv, tk)
                    dp_dot = _sum_of_products(docat[r], vcat[:, c0:c1])  # (R, 2Hv), (2Hv, tk) -> dO' V^T + dO V'^T
                    if drop is not None:
                        dp *= drop
                        dp_dot *= drop
                    dp -= D_b[r, None]  # dP - D
                    dp_dot -= D_dot_b[r, None]  # dP' - D'
                    dp_dot *= p
                    ds_dot = np.multiply(sd, dp)
                    ds_dot += dp_dot  # dS' = P' (dP - D) + P (dP' - D')
                    ds = np.multiply(dp, p)  # dS
                    if dbias_dot is not None:
                        item.add_dbias(dbias_dot, ds_dot, *span[:4])
                    if spec.softcap is not None:  # dR' = a dS' + b R' dS, dR = a dS
                        ds_dot *= a
                        ds_dot += b2 * raw_dot * ds
                        ds *= a
                    dq_b[r] += ds_dot @ k3[b, kv, c0:c1]  # (R, tk) @ (tk, H): dR' K
                    dq_b[r] += ds @ kd3[b, kv, c0:c1]  # dR K'
                    _add_row_products(dk_j[cols], ds_dot, qs[r], dk_tmp[:tk], True, G)  # (tk, R) @ (R, H)
                    _add_row_products(dk_j[cols], ds, qds[r], dk_tmp[:tk], True, G)
            dk_dot[b, kv, k0:k1] = dk_j
            dv_dot[b, kv, k0:k1] = dv_j
        dq_b *= scale
        dq_dot[b, heads] = _head_major(dq_b, T, G)  # (G, T, H)

    run_items([(b, kv) for b in range(Bf) for kv in range(K)], work, parallel=dbias_dot is None)
    bs = spec.batch_shape
    dbias_out = None if dbias_dot is None else dbias_dot.reshape(spec.bias_shape)
    return dq_dot.reshape(bs + (N, T, H)), dk_dot.reshape(bs + (K, S, H)), dv_dot.reshape(bs + (K, S, Hv)), dbias_out
