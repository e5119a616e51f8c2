r"""NumPy fast path of the chunked algorithm, for the CPU.

The same online-softmax forward and FlashAttention-2 backward as
:mod:`npattn.chunked`, with the same masks (built by :mod:`npattn.scores.visibility`),
the same dropout mask and the same fully-masked-row rules, rearranged for
NumPy on a multi-core CPU:

- **independent work items on a thread pool.** The forward runs one item per
  (batch element, group of kv heads, query tile); the backward one per
  (batch element, group of kv heads), each owning its slices of ``dQ``,
  ``dK`` and ``dV`` (with few kv heads, as MQA at B=1, one per part of a kv
  head's query heads, each with its own share of ``dK`` and ``dV``:
  :func:`_head_parts`). Every item accumulates in a fixed order, so results
  are bit-identical whatever the number of threads.
- **single-threaded BLAS inside the items** (threadpoolctl), so that BLAS
  threads do not oversubscribe the pool's, each product through
  :func:`npattn.blas_numpy.matmul` (cut in two where that brings it within
  OpenBLAS's small-matrix kernels).
- **in-place float32/float64 ufuncs** (``out=``) on one preallocated score
  tile per item, and the G query heads that share a kv head stacked into one
  ``(tq * G, H)`` matrix, position-major (row ``t*G + g``), so each tile is
  one large GEMM and a range of query positions is a range of rows.
- **groups of kv heads per item** (:class:`_Item`, :func:`_kv_groups`):
  with short sequences an item stacks several kv heads, ``(nk, tq * G, ...)``
  arrays, so that each product and pass is one NumPy call for the group;
  per-span Python and the GIL hand-offs between the pool's threads, not the
  arithmetic, were what small shapes spent their time on. Short sequences
  that causal/window, lengths or segments cut take 128-row query tiles
  (:data:`SHORT_PARTIAL_LENGTH`), and the forward 32-row ones where a band
  alone cuts a short square (:data:`DIAGONAL_SPLIT_BLOCK`).
- **no running maximum where none is needed** (:func:`forward`): when the
  bound below (or a softcap) keeps every score within
  :data:`ZERO_REFERENCE_BOUND` of 0, the forward exponentiates the scores
  themselves, with no row-max pass, rescaling or flush.
- **per-row shifts inside the GEMMs.** ``[Q, -c] @ [scale K^T; 1]`` is
  ``scale Q K^T - c`` for a per-row constant ``c`` (the running maximum in the
  forward, ``lse`` and ``D`` in the backward), saving a pass over each tile.
  This rounds the shift with the product, which is harmless while scores are
  moderate; when a bias is given or the scores could reach
  :func:`_fused_shift_limit`, the shifts are applied after the product as in
  the generic path, so the backward recomputes exactly the forward's scores.
  Fused, the scores are kept in base 2 (``log2 e`` folded into the scale) and
  exponentiated with ``exp2``, about twice as fast as ``exp`` in float32.
  Neither costs float32 accuracy to speak of (issue 17): OpenBLAS's
  small-matrix kernels add the shift column last, as a separate
  subtraction would (the same bits), and ``P`` has the same error per
  entry in base 2 as in base e. (Kernels that round an entry by the
  product's shape, OpenBLAS's "Haswell" ones, recompute in the backward
  scores whose last bits differ from the forward's: ``dV``'s error then
  reached 1.72x the dense path's with a window of 8 and one query head
  per kv head, ``tests/test_fast_accuracy.py``.) ``lse`` stored
  as one float32 does: the backward's ``P = exp(S - lse)`` carries that
  rounding on every entry of a row (the dense path's ``P`` does not). So
  each rounding happens once: the forward sums ``m + log l`` in float64,
  the backward converts ``lse`` to base 2 in float64, and both multiply by
  the same float32 ``scale * log2 e`` (:func:`_base_scale`; the backward's
  own rounding of it differed for scales that are not powers of 2), on the
  same side: K, unless that could overflow (:func:`_keys_carry_scale`).
  The backward's ``P = exp(S - lse)`` is accurate where its ``S`` are the
  sums the forward's ``lse`` came from: a forward that scaled K (one query
  head per kv head, at the zero reference) beside a backward that scaled Q
  made dV 1.5x the dense path's error where a key's dV rests on a few
  large ``P_ij`` (windows of 8, documents of 8 to 16 positions).
- **float32 sums in the backward.** ``dV_j`` and ``dK_j`` sum over the
  item's ``tq * G`` stacked rows. In a partly visible span (a causal
  diagonal, a short packed document, a narrow window) a key's largest
  ``P_ij`` come first, and position-major rows put the G heads' largest
  terms together, so each later term rounds at their size: dV's error was
  up to 1.9x the dense path's (8 heads on one kv head, H=128, T=S=200),
  1.75x with 4 documents of 32 in T=S=128 and 1.65x with a window of 8
  (4 heads per kv head). Partly visible spans sum head by head, in
  products of :data:`ROW_CHUNK` positions, last positions first, and the
  query tiles and spans of a key tile run last first
  (:func:`_add_row_products`): 0.6-1.1x, for 0-4% of a GQA causal
  backward (B=4, N=16 on K=4, T=S=512), since fully visible spans, most of
  the work, stay one product.
  ``D = rowsum(dO * O)`` (FlashAttention-2's, and the dense path's) is not
  the ``rowsum(P * dP)`` of the ``P`` and ``dP`` that ``dS`` uses, whose
  rounding it would cancel: with it, dQ's error on a causal mask is
  1.2-1.6x smaller (as the dense path's was until issue 17), but the
  correction needs ``P K`` summed beside ``dS K``, one more product per
  span (24-47% more backward time when tried).
- **tile skipping** as the generic path (:func:`npattn.scores.visibility.classify_tile`),
  and within a partly visible tile, spans that skip what no row can see
  (:func:`plan_tile`). With lengths or segment ids each batch element
  plans its own square (:func:`_batch_plans`): padding is neither computed
  nor masked, and each element skips what its own documents cannot see.
- **no subnormal probabilities**: those below ``2**FLUSH_EXPONENT`` are
  flushed to zero (:class:`_Exp`), since NumPy's loops and the BLAS run
  10-100 times slower on subnormal numbers.
- **the Cauchy-Schwarz bound** ``|S_ij| <= |scale q_i| |k_j|``, checked in
  Python scalars per span, lets a span skip its row-max pass and keeps its
  hidden entries finite: they are zeroed after a plain ``exp`` rather than set
  to -inf before the flushed one, which -inf would need.
- **FlashAttention-2's loop order in the backward**: key tiles outside, so
  that ``dK_j`` and ``dV_j`` accumulate in cache-resident buffers.

The variants of the score pipeline (:mod:`npattn.scores`) call its units:
the softcap is :func:`~npattn.scores.softcap.softcap_forward_inplace` on
each span's products and :func:`~npattn.scores.softcap.softcap_backward_inplace`
on its ``dS``;
the bias is :func:`~npattn.scores.pipeline.bias_tile` and ALiBi
:func:`~npattn.scores.alibi.alibi_tile`, built along each span's diagonals
and added through a Toeplitz view (:meth:`_Item.add_bias`), never as a tile;
the slope gradients are :func:`~npattn.scores.alibi.alibi_slopes_grad_tile`
per span, summed per (batch element, kv head) item into its own slice of a
``(B, N)`` buffer (so in a fixed order whatever the thread count), then
:func:`~npattn.scores.pipeline.param_grads_from_heads`; sinks are merged
after the kernel and segment ids are visibility, as on every path. Which
tricks each variant keeps is decided per call (:class:`_Mode`):

- **softcap**: base 2 (the cap scales with the scores: ``b c tanh(r/c) =
  (b c) tanh(b r / (b c))``) and both bounds, now ``min(|scale q_i| |k_j|, c)``;
  the shifts leave the GEMMs, since they would enter ``tanh``. ``Q`` carries
  ``1 / c`` in its scale, so the product is ``s / c`` and ``tanh`` follows
  it directly; the backward keeps ``t = tanh(s / c)`` for ``1 - t^2``. Within
  :data:`ZERO_REFERENCE_BOUND` (Gemma 2's cap of 50 is) the forward needs no
  running maximum at all (see :func:`forward`).
- **ALiBi**: base 2 and the fused shifts only where every row sees the key
  at its own position (:func:`_rows_see_their_own_position`: no mask or
  segment ids, the valid rows' positions among the valid keys), as in
  self-attention; elsewhere base e with the shifts after the product and
  the term, as in the generic path. The term grows with the distance, so
  a row whose visible keys all lie far away (keys padded by
  ``kv_lengths``, queries past the keys with ``T > S``) has every score far
  below 0, and so its shift: in base 2 with the shift inside the product,
  float32 ``out`` had 2.1x the dense path's error and dQ 3.0x (N=8 heads,
  T=S=256, one element's keys cut to 40), and with 7 keys against 200 to
  513 queries the slopes' gradient 17-134x (single draws); in base e it
  has the generic path's own (1.0x and 1.6-1.7x: the backward's
  ``exp(S - lse)`` carries the rounding of a large float32 ``lse``, which
  the dense path's stored ``P`` does not), for 1.08-1.11x the time of base
  2. Where each row sees its own position, its maximum and ``lse`` stay
  within the raw bound, and base 2 kept every error within 1.5x the dense
  path's (T=S=256 full and causal, both lengths bottom-right aligned,
  T=16 against S=512). Items group kv heads where the keys fit one key
  tile (:func:`_kv_groups`). It keeps the upper bound when every
  slope is >= 0 (the term is then <= 0), so settled spans still skip
  their row-max pass. Where every row also sees its own position, the term
  is 0 there, so each row's maximum lies within the raw bound of 0, and
  the forward keeps the zero reference (:func:`forward`) as without ALiBi:
  no row-max pass, rescaling or unset rows, the flushed ``exp`` only in
  spans that reach the flush floor, and spans wholly below it skipped. The lower
  bound holds per span only, the raw one less ``max m_n`` times the span's
  largest distance (:meth:`_Item.alibi_reach`): where that keeps every entry
  above the flush floor (flat heads, spans near the diagonal), rows may start
  at the reference 0 without their row max and the ``exp`` is the plain
  one; elsewhere it is the flushed one, hidden entries set to -inf before
  it. Each query tile visits its nearest key tiles first,
  so a row's reference is set by its highest scores; then a span where the
  upper bound minus ``min m_n`` times its smallest distance
  (:func:`~npattn.scores.alibi.alibi_distance_bounds`) stays below the flush
  floor for every row, relative to the row's reference (``lse`` in the
  backward), holds only exact zeros after the flushed ``exp`` and is skipped
  in both passes: far from the diagonal, steep heads cost nothing.
- **a bias or user score modifications**: no bound, no fused shifts, base e
  (the modifications' functions see the scores in nats, as on every path).
  Each span's scores are handed to them head-major, ``(1, G, tq, tk)``
  (:func:`npattn.scores.mods.tile_index` for the item's batch element and
  heads), and their parameter cotangents summed per item, then over items
  in a fixed order. A mask modification keeps every trick: it only hides.

With an additive bias the backward's items would share ``dbias`` entries
wherever the bias broadcasts, so they then run one after another, in the same
fixed order, on the calling thread (BLAS keeps its own threads there).

This module is chosen by namespace (``supports``) when the forward runs, and
the residuals remember that choice. It is optional: setting the environment
variable ``NPATTN_FAST_NUMPY=0`` sends NumPy inputs through the generic Array
API path, which the tests compare this one against. ``NPATTN_NUM_THREADS``
(else ``OMP_NUM_THREADS``) sets how many items run at a time (default: the
CPUs available, the calling thread among them, see :mod:`npattn.threads`).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import array_api_compat
import numpy as np

from . import blas_numpy
from . import dropout as _dropout
from .chunked import tile_ranges
from .namespace import sum_to_shape
from .options import AttentionSpec, SegmentHost
from .scores.alibi import (
    alibi_distance,
    alibi_distance_bounds,
    alibi_slopes_grad_tile,
    alibi_tile,
)
from .scores.mods import mods_backward, tile_index
from .scores.pipeline import bias_tile, mods_keeping_masked, param_grads_from_heads
from .scores.softcap import softcap_backward_inplace, softcap_forward_inplace
from .scores.tiles import diagonal_view, select_item
from .scores.visibility import ALL, NONE, classify_tile, segments_hide_nothing, visible_tile
from .threads import num_threads, power_of_two_at_most, run_items

__all__ = ["supports", "forward", "backward", "num_threads", "FAST_BLOCKS"]

#: Default ``(block_q, block_k)`` of both passes when the caller gives none:
#: the fastest measured on a 2-core machine at T=S=4096, H=64 (see
#: ``benchmarks/bench_cpu_levers.py``), against 128x128 for the generic path.
FAST_BLOCKS = (512, 512)

#: The forward rescales a row only when its running maximum grows by more
#: than this (in nats): ``exp`` values then stay below ``e**16`` (9e6), far
#: from the float32 range even summed over 10**9 keys, and most tiles need no
#: rescaling pass at all.
RESCALE_THRESHOLD = 16.0

#: Probabilities below ``2**FLUSH_EXPONENT`` are flushed to zero, as a CPU
#: in flush-to-zero mode would (see :class:`_Exp`): float32 ``exp`` of a
#: score more than ~87 below its row maximum is subnormal, and NumPy's loops
#: and the BLAS run 10-100 times slower on subnormals (a forward at T=S=2048
#: took 809 ms instead of 55 ms with q scaled by 20). The exponents leave room
#: below them, so that ``P * (dP - D)`` stays normal too. What is flushed is
#: below 8e-31 (1e-301 in float64) in the backward, where ``P = exp(S - lse)``
#: is normalized, and in the forward below ``2**-77`` (``2**-977``) of the
#: row's largest entry, since its reference maximum may sit up to
#: :data:`RESCALE_THRESHOLD` above that entry: far below the dtype's precision
#: either way.
FLUSH_EXPONENT = {np.dtype(np.float32): -100, np.dtype(np.float64): -1000}

#: ``log2(e)``: fused passes work in base 2 (``exp2`` is about twice as fast
#: as ``exp`` in NumPy's float32 loops), as FlashAttention's kernels do.
LOG2E = 1.4426950408889634

#: In a partly visible span, the backward sums ``dV_j`` and ``dK_j`` over
#: one head's query positions at a time, in products of at most this many
#: positions, the last positions first (see :func:`_add_row_products`).
ROW_CHUNK = 128


# --- shared pieces ----------------------------------------------------------------------


def supports(spec: AttentionSpec) -> bool:
    """Whether this fast path handles ``spec``: see :func:`handles` (every
    variant of the score pipeline runs here)."""
    return handles(spec.xp, spec.compute_dtype)


def handles(xp: Any, compute_dtype: Any) -> bool:
    """Whether inputs of namespace ``xp`` computing in ``compute_dtype`` take
    this fast path: NumPy in float32 or float64, unless disabled with
    ``NPATTN_FAST_NUMPY=0``."""
    return (
        array_api_compat.is_numpy_namespace(xp)  # first: reading an unset variable takes 0.8 µs, each CuPy call
        and compute_dtype in (np.float32, np.float64)
        and os.environ.get("NPATTN_FAST_NUMPY", "1") != "0"
    )


#: ... but query tiles of :data:`SPLIT_BLOCK` rows for a short sequence
#: (``T`` up to this) that causal/window, lengths, segment ids or a block
#: mask cut: most of its tiles are then partly visible, which a 512-row tile
#: runs as several spans of SPLIT_BLOCK rows (:func:`plan_tile`), one kv head
#: at a time; 128-row tiles run one span each, over a group of kv heads
#: (:func:`_kv_groups`). Measured (2 cores, H=64, causal, forward): 0.83x the
#: time at T=512, 0.86-0.90x at T=1024, 0.97x at 2048, 1.04x at 4096.
SHORT_PARTIAL_LENGTH = 1024


#: ... and query tiles of at most this many rows of stacked query heads,
#: ``G * block_q``, but of at least :data:`SPLIT_BLOCK` positions: with
#: GQA an item stacks the G query heads of each kv head (:class:`_Item`),
#: so a 512-position tile of G=8 heads makes spans of 4096 rows, whose 8 MiB
#: of scores per key tile stream through the L3 cache four times. Measured
#: (2 cores, H=64, float32, one process, 7 rounds each; forward |
#: backward against 512-position tiles): G=8 with 128, T=S=2048 0.93x |
#: 0.94x, causal T=S=4096 0.88x | 1.02x; G=4 with 256, B=1, N=8 on K=2,
#: T=S=2048 1.01x | 1.00x, T=S=4096 0.90x | 1.00x, B=2, N=16 on 4,
#: T=S=1024 0.93x | 0.97x, N=32 on 8, T=S=2048 0.97x | 0.96x, N=16 on 4,
#: causal T=S=2048 0.96x | 1.01x.
GROUPED_TILE_ROWS = 1024


#: The forward's query tiles and sub-blocks (:func:`plan_tile`), instead of
#: :data:`SPLIT_BLOCK`, where a causal/window band alone decides visibility
#: and runs through a short square from its corner (``T = S`` up to
#: :data:`DIAGONAL_SHORT_LENGTH`, query offset 0), with at most
#: :data:`DIAGONAL_STACKED_ROWS` stacked rows ``G * T`` a kv head: a causal
#: tile of 128 then computes 10/16 of its area, a causal T=S=512 0.85x the
#: area of 128-row spans. The backward keeps SPLIT_BLOCK: its ``dK`` and
#: ``dV`` sum the rows of each span, products of 32 terms with 32-row spans
#: (0.87-1.63x the backward's time at seven shapes). Measured (2 cores,
#: H=64, float32, causal unless said, ``impl="chunked"``, one process,
#: interleaved; forward time against 128-row tiles): B=4, N=8, T=S=128
#: 0.69x; B=8, N=8 on K=1, T=S=128 0.77x; B=8, N=8, T=S=256 0.69-0.78x,
#: float64 0.86x, on K=2 0.86x, on K=4 0.79x; B=8, N=16 on K=4, T=S=256
#: 0.84x; B=4, N=8, T=S=512 0.80-0.85x; B=8, N=12, T=S=512 0.87-0.92x;
#: B=4, N=8 on K=2, T=S=512 0.97x; windows at B=8 of 64 and 128 keys
#: (T=S=512) 0.68x and 0.78x, of 32 each side (T=S=256) 0.54x. Left out:
#: B=4, N=16 on K=4, T=S=512 (2048 stacked rows) 1.00-1.04x; T=S=1024
#: 1.02-1.10x; 128 queries against 1024 keys and 512 against 2048
#: (bottom-right) 1.12x and 1.27x; causal with ``kv_lengths`` (B=8,
#: T=S=256) 1.30x and ``kv_lengths`` alone 1.32x (rows that see every key,
#: and plans per batch element at four times the classifications); packed
#: documents (causal, 2 to 8 of them in T=S=256 or 512) 1.16-1.64x; a bias,
#: ALiBi or dropout, whose terms each span builds, 1.17-1.69x (softcap
#: 0.75-0.80x and sinks 0.78-0.87x are in); 64-row sub-blocks inside
#: 512-row tiles at T=S=4096 1.03x (causal) and 1.04x (packed documents).
DIAGONAL_SPLIT_BLOCK = 32

#: See :data:`DIAGONAL_SPLIT_BLOCK`.
DIAGONAL_SHORT_LENGTH = 512

#: See :data:`DIAGONAL_SPLIT_BLOCK`.
DIAGONAL_STACKED_ROWS = 1024


def _forward_split(spec: AttentionSpec) -> int:
    """The forward's sub-block rows: :data:`DIAGONAL_SPLIT_BLOCK` (or
    :data:`SPLIT_BLOCK` if smaller) where its rule holds, else
    :data:`SPLIT_BLOCK`."""
    T = spec.q_len
    band = spec.window_left is not None or spec.window_right is not None
    other_rules = spec.has_user_mask or spec.q_lengths is not None or spec.kv_lengths is not None or spec.has_segments
    span_terms = spec.bias is not None or spec.alibi_slopes is not None or spec.dropout_p or spec.score_mods
    short_square = spec.kv_len == T <= DIAGONAL_SHORT_LENGTH and spec.offset_bounds == (0, 0)
    stacked = spec.group_size * T <= DIAGONAL_STACKED_ROWS
    if band and not other_rules and not span_terms and short_square and stacked and spec.block_q is None:
        return min(DIAGONAL_SPLIT_BLOCK, SPLIT_BLOCK)
    return SPLIT_BLOCK


def _blocks(spec: AttentionSpec, split: int | None = None) -> tuple[int, int]:
    """``(block_q, block_k)``: the caller's, else :data:`FAST_BLOCKS` (with
    :data:`SHORT_PARTIAL_LENGTH`'s and :data:`GROUPED_TILE_ROWS`'
    exceptions), clipped to the sequence lengths (at least 1). A pure
    function of ``spec`` and ``split``, the sub-block rows (:data:`SPLIT_BLOCK`
    unless given): the query tiles of a short partly visible sequence."""
    short_partial = spec.has_index_rules and spec.q_len <= SHORT_PARTIAL_LENGTH
    grouped = max(SPLIT_BLOCK, GROUPED_TILE_ROWS // max(spec.group_size, 1))
    split = SPLIT_BLOCK if split is None else split
    block_q = spec.block_q or (split if short_partial else min(FAST_BLOCKS[0], grouped))
    block_k = spec.block_k or FAST_BLOCKS[1]
    return max(1, min(block_q, spec.q_len)), max(1, min(block_k, spec.kv_len))


def _fused_shift_limit(dtype: Any) -> float:
    """Largest score magnitude for which a shift may ride inside the GEMM:
    ``2**(mantissa bits - 12)`` (4096 in float32), where one rounding of the
    product is within 2**-12 of the score's own rounding."""
    return 2.0 ** (np.finfo(dtype).nmant + 1 - 12)


def _row_norms(x3: Any) -> Any:
    """An upper bound of ``|x_i|`` over the last axis: ``(B, heads, L, D) ->
    (B, heads, L)``, ``sqrt(x_i . x_i + D tiny)``: a square below the
    dtype's smallest normal number may round to 0, which without the ``D
    tiny`` would make a nonzero row's norm 0 and the bounds built on it
    wrong (rows of ``|x| < 1e-19`` in float32)."""
    tiny = np.finfo(x3.dtype).tiny if x3.dtype.kind == "f" else 0.0
    return np.sqrt(np.vecdot(x3, x3) + x3.shape[-1] * tiny)


class _Mode:
    """How one call computes its scores, decided from the inputs alone, so
    that the forward and the backward decide alike (see the module docstring).

    ``base2``: scores in base 2 (``log2 e`` folded into the scale, ``exp2``):
    no bias, ALiBi only where its term leaves every row's shift as small as
    without it (:func:`_rows_see_their_own_position`), and a bound on every
    score below :func:`_fused_shift_limit`.
    ``fused``: the per-row shifts ride inside the GEMMs, which needs
    ``base2`` and no softcap (the shift would enter ``tanh``). ``upper``:
    whether ``S_ij <= bound`` holds for the Cauchy-Schwarz bound ``|scale
    q_i| |k_j|`` (a softcap lowers it to ``min(bound, c)``): it needs no
    bias, and ALiBi keeps it when every slope is >= 0 (its term is then <=
    0). ALiBi loses the lower bound ``S_ij >= -bound`` over the call.
    ``cap``: the softcap in the scores' base, in the compute dtype (inf
    without one); ``ratio``: whether ``Q`` carries ``1 / softcap`` in its
    scale, so that the products already are ``s / c`` (see
    :func:`_base_scale`). User score modifications turn off the bounds and
    base 2, as a bias does: they may move any score anywhere, and they read
    scores in nats. ``bound``: a bound on every ``|S_ij|`` of the call, in
    base 2, and ``raw_bound`` the same before ALiBi's term
    (:meth:`_score_bounds`). ``maxima_near_zero``: whether every row that
    sees a key has its maximum within ``raw_bound`` of 0: the lower bound
    ``S_ij >= -raw_bound``, or ALiBi with the upper bound where each row
    sees the key at its own position (its term is 0 there); the forward
    may then keep the zero reference (:func:`_zero_reference_fits`).
    """

    def __init__(self, spec: AttentionSpec, q_norms: Any, k_norms: Any):
        slopes = None if spec.alibi_slopes is None else np.asarray(spec.alibi_slopes)
        plain = spec.bias is None and not spec.score_mods  # a user modification may move any score anywhere
        self.upper = plain and (slopes is None or bool(np.all(slopes >= 0)))
        self.raw_bound, alibi_reach = self._score_bounds(spec, q_norms, k_norms, slopes)
        self.bound = self.raw_bound + alibi_reach
        # ALiBi far from a row's keys takes base e and the generic path's order of
        # operations: see the module docstring. Near them, ALiBi's term is 0 at the
        # key of each row's own position, whose score bounds the row's maximum below.
        own_position = slopes is not None and self.upper and _rows_see_their_own_position(spec)
        near = slopes is None or own_position
        self.maxima_near_zero = (plain and slopes is None) or own_position  # the lower bound, or the own key's
        self.base2 = plain and near and self.bound < _fused_shift_limit(spec.compute_dtype)
        self.fused = self.base2 and spec.softcap is None
        self.base = LOG2E if self.base2 else 1.0
        self.ratio = spec.softcap is not None
        self.cap = np.inf if spec.softcap is None else spec.compute_dtype.type(spec.softcap * self.base)

    @classmethod
    def of_inputs(cls, spec: AttentionSpec, q: Any, k: Any) -> _Mode:
        """The mode of a call on ``q`` and ``k`` (it depends on the inputs
        alone: a backward in parts and the derivative modes take the fast
        forward's own again)."""
        q3 = np.reshape(q, (spec.num_batch, spec.num_heads, spec.q_len, spec.head_dim))  # (B, N, T, H)
        k3 = np.reshape(k, (spec.num_batch, spec.num_kv_heads, spec.kv_len, spec.head_dim))  # (B, K, S, H)
        return cls(spec, _row_norms(q3), _row_norms(k3))

    @classmethod
    def exact(cls, spec: AttentionSpec) -> _Mode:
        """Base e, no fused shifts, no bounds: the mode of the derivative
        modes' kernels (:mod:`npattn.modes.numpy_kernels`), whose tangents no
        bound covers."""
        mode = cls.__new__(cls)
        mode.upper = mode.maxima_near_zero = mode.base2 = mode.fused = mode.ratio = False
        mode.base, mode.bound, mode.raw_bound = 1.0, np.inf, np.inf
        mode.cap = np.inf if spec.softcap is None else spec.softcap
        return mode

    @staticmethod
    def _score_bounds(spec: AttentionSpec, q_norms: Any, k_norms: Any, slopes: Any | None) -> tuple[float, float]:
        """``(raw, reach)`` in base 2: a bound on every ``|S_ij|`` before ALiBi
        (Cauchy-Schwarz, or the softcap if lower) and how far ALiBi can move a
        score, ``max|m_n|`` times the largest ``|p_i - j|`` (0 without it)."""
        raw = reach = 0.0
        if q_norms.size and k_norms.size:
            raw = abs(spec.scale) * float(q_norms.max()) * float(k_norms.max())
        if spec.softcap is not None:
            raw = min(raw, spec.softcap)
        if slopes is not None and slopes.size:
            omin, omax = spec.offset_bounds  # positions p lie in [omin, T - 1 + omax], keys in [0, S - 1]
            distance = max(spec.q_len - 1 + omax, spec.kv_len - 1 - omin, 0)
            reach = float(np.abs(slopes).max()) * distance
        return LOG2E * raw, LOG2E * reach


def _rows_see_their_own_position(spec: AttentionSpec) -> bool:
    """Whether every query row that sees any key sees the key at its own
    position ``p_i``, where ALiBi's term is 0: then, with slopes >= 0, the
    row's maximum and ``lse`` lie within the raw bound (plus ``log S``) as
    without ALiBi, and the shifts may ride in the products (see the module
    docstring). Decided from the options alone, conservatively: no mask,
    mask function, block mask or segment ids (any may hide that key), and
    the valid rows' positions within the valid keys: ``p_i >= 0`` (the
    offsets), and ``p_i < kv_len`` (bottom-right alignment places the last
    valid row on the last valid key; top-left needs ``q_len <= kv_len``, in
    each batch element: a padded batch of self-attention, ``q_lengths =
    kv_lengths``, has it, though its longest queries pass its shortest keys).

    >>> import numpy as np
    >>> from npattn.options import make_spec
    >>> x, longer = np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 6, 2))
    >>> _rows_see_their_own_position(make_spec(x, x, x, causal=True))
    True
    >>> _rows_see_their_own_position(make_spec(longer, x, x, align="top_left"))  # queries 4, 5 past the keys
    False
    >>> _rows_see_their_own_position(make_spec(x, x, x, kv_lengths=np.array([2])))  # rows 2, 3 past the keys
    False
    >>> two = np.zeros((2, 1, 4, 2))
    >>> _rows_see_their_own_position(make_spec(two, two, two, q_lengths=np.array([2, 4]), kv_lengths=np.array([2, 4])))
    True
    """
    if spec.has_user_mask or spec.block_mask is not None or spec.has_segments:
        return False
    if spec.offset_bounds[0] < 0:
        return False
    if spec.align == "bottom_right" or spec.q_len_bounds[1] <= spec.kv_len_bounds[0]:
        return True
    if spec.q_lengths is None or spec.kv_lengths is None:  # then the bounds above decided it
        return False
    return bool(np.all(np.asarray(spec.q_lengths) <= np.asarray(spec.kv_lengths)))


def _base_scale(spec: AttentionSpec, mode: _Mode) -> tuple[Any, float]:
    """``(c, b)``: the factor ``Q`` is multiplied by before the products, in
    the compute dtype, and the base that gives the scores, ``b`` (``log2 e``
    but for rounding; 1 in base e). Without a softcap ``c = scale * base``,
    rounded once, and ``b = c / scale``; with one (``mode.ratio``) ``c =
    scale / softcap``, so that the products are ``s / softcap``, and ``b =
    mode.cap / softcap``. The forward and the backward both multiply the
    same side by ``c`` (:func:`_keys_carry_scale`), so that the backward's
    products are the forward's (bit for bit unfused; fused, the shift column
    then adds to the same sums), and convert ``lse`` with ``b``."""
    dtype = spec.compute_dtype
    if mode.ratio:
        assert spec.softcap is not None, "a ratio mode has a softcap"
        return dtype.type(spec.scale / spec.softcap), (float(mode.cap) / spec.softcap if mode.base2 else 1.0)
    c = dtype.type(spec.scale * mode.base)
    return c, (float(c) / spec.scale if mode.base2 and spec.scale else mode.base)


def _keys_carry_scale(c: Any) -> bool:
    """Whether ``K`` carries the scores' factor ``c`` (:func:`_base_scale`),
    as ``[c K^T; 1]``, built once per group of kv heads, rather than ``Q``:
    whenever ``|c| <= 1``, so that ``c K`` cannot overflow where ``c Q K^T``
    would not (tiny queries against huge keys). The forward and the backward
    both ask it, so both compute the same products: the backward's
    ``P = exp(S - lse)`` is accurate where its ``S`` are the sums the
    forward's ``lse`` came from."""
    return abs(float(c)) <= 1.0


def _factor_sides(c: Any) -> tuple[Any, Any]:
    """``(q_factor, k_factor)``: the scores' factor ``c`` on the side
    :func:`_keys_carry_scale` picks, None on the other (no scaling there)."""
    return (None, c) if _keys_carry_scale(c) else (c, None)


def _lse_in_base(lse: Any, b: float, mode: _Mode, dtype: Any) -> Any:
    """``lse`` (nats) in the scores' base: ``b lse`` rounded once from
    float64 (``b`` of :func:`_base_scale`); ``lse`` itself in base e. What
    the backward's ``exp(S - lse)`` subtracts, in the forward's own base."""
    if mode.base == 1.0:
        return lse
    return (lse.astype(np.float64) * b).astype(dtype)


#: Positions transposed at a time by :func:`_augmented_transposed`: a
#: ``(128, 64)`` float32 block and its transpose stay in the L1 cache, which
#: makes the copy 2.5x faster than one strided copy of the whole array.
TRANSPOSE_CHUNK = 128


def _augmented_transposed(x3: Any, dtype: Any, *, ones: bool = True, scale: Any = None) -> Any:
    """``[x^T; 1]``: ``(..., L, D) -> (..., D + 1, L)``, contiguous, with a
    row of ones appended, so that ``[a, c] @ [x^T; 1] = a x^T + c`` adds a
    per-row constant ``c`` inside the matrix product; ``x^T`` alone, ``(...,
    D, L)``, without ``ones`` (the forward's zero reference has no ``c``);
    ``[scale x^T; 1]`` with a ``scale``. Rows that are not contiguous (the
    multi-head layer's split heads, ``E`` floats apart) are copied first:
    transposed where they lie, 4 kv heads of 256 keys took 171 us against
    49 us with the copy (38 us from contiguous rows)."""
    *lead, L, D = x3.shape
    if x3.strides[-1] != x3.itemsize or x3.strides[-2] != D * x3.itemsize:
        x3 = np.ascontiguousarray(x3)  # (..., L, D)
    xt = np.empty((*lead, D + ones, L), dtype=dtype)
    if ones:
        xt[..., D, :] = 1
    for start in range(0, L, TRANSPOSE_CHUNK):
        chunk = slice(start, start + TRANSPOSE_CHUNK)
        x_chunk_t = np.swapaxes(x3[..., chunk, :], -1, -2)  # (..., D, chunk)
        if scale is None:
            xt[..., :D, chunk] = x_chunk_t
        else:
            np.multiply(x_chunk_t, scale, out=xt[..., :D, chunk])
    return xt


def _augmented_rows(x: Any, column: Any, scale: Any, dtype: Any, nk: int | None = None) -> Any:
    """``[scale * x, column]`` in position-major row order: ``(G, tq, D)`` and
    ``(tq*G,)`` -> ``(tq*G, D + 1)``, row ``t*G + g`` holding ``x[g, t]``;
    with ``nk``, one such stack per kv head of a group (:class:`_Item`):
    ``(nk*G, tq, D)`` and ``(nk, tq*G)`` -> ``(nk, tq*G, D + 1)``. A
    ``column`` of None appends none: ``scale * x`` alone, ``(..., tq*G, D)``;
    a ``scale`` of None copies ``x`` as it is."""
    GN, tq, D = x.shape
    n = 1 if nk is None else nk
    G = GN // n if n else 0
    width = D if column is None else D + 1
    xa = np.empty((n, tq * G, width), dtype=dtype)
    rows = np.swapaxes(np.reshape(x, (n, G, tq, D)), 1, 2)  # (n, tq, G, D)
    if scale is None:
        xa.reshape(n, tq, G, width)[..., :D] = rows
    else:
        np.multiply(rows, scale, out=xa.reshape(n, tq, G, width)[..., :D])
    if column is not None:
        xa[..., D] = column
    return xa[0] if nk is None else xa


def _position_major(x: Any, nk: int | None = None) -> Any:
    """``(G, tq, ...) -> (tq*G, ...)``, row ``t*G + g`` holding ``x[g, t]``;
    with ``nk``, the same per kv head of a group: ``(nk*G, tq, ...) -> (nk, tq*G, ...)``."""
    if nk is None:
        return np.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
    G, tq = (x.shape[0] // nk if nk else 0), x.shape[1]
    grouped = np.swapaxes(np.reshape(x, (nk, G) + x.shape[1:]), 1, 2)  # (nk, tq, G, ...)
    return grouped.reshape((nk, tq * G) + x.shape[2:])


def _head_major(x: Any, tq: int, G: int, nk: int | None = None) -> Any:
    """Inverse of :func:`_position_major`: ``(tq*G, ...) -> (G, tq, ...)`` (a
    view); with ``nk``, ``(nk, tq*G, ...) -> (nk*G, tq, ...)`` (a copy unless
    ``nk`` or ``G`` is 1)."""
    if nk is None:
        return np.swapaxes(x.reshape((tq, G) + x.shape[1:]), 0, 1)
    grouped = np.swapaxes(x.reshape((nk, tq, G) + x.shape[2:]), 1, 2)  # (nk, G, tq, ...)
    return grouped.reshape((nk * G, tq) + x.shape[2:])


#: An item of the fast path groups consecutive kv heads of one batch
#: element (see :class:`_Item`) until one span of scores holds about this
#: many entries, ``nk`` times one head's largest span (a 512 x 512 tile): with
#: short sequences one NumPy call then covers several heads, and the pool's
#: threads hand the GIL to one another far less often.
GROUP_SCORES = 2**18

#: ... but at least this many heads where the call has the items for it: two
#: heads of 512 x 512 tiles per item. A causal diagonal's four narrow spans,
#: and the spans of packed documents, then run two heads per NumPy call
#: (forward, 2 cores, float32, against one head: see ``docs/performance.rst``).
#: Not more for shorter spans: 32 heads of 128 x 128 (B=32, N=8) took 1.06-1.19x
#: the time of 16, and float64 at 8 heads of 256 x 256 1.11x that of 4.
GROUP_MIN_HEADS = 2

#: ... while a call keeps at least this many items (when it has as many kv
#: heads and tiles), for its threads to share. A constant, not the thread
#: count: the groups decide the bounds each item checks, so they must not
#: change with it (the same bits whatever the thread count).
GROUP_MIN_ITEMS = 8


def _kv_groups(spec: AttentionSpec, span_scores: int, tiles: int) -> list[tuple[int, int]]:
    """The ``(kv0, kv1)`` ranges of kv heads an item takes: as many as keep
    ``span_scores`` (one head's largest span of the plans, :func:`_largest_span`)
    times their count within :data:`GROUP_SCORES` (but at least
    :data:`GROUP_MIN_HEADS`), and few enough that the
    ``B * groups * tiles`` items are at least :data:`GROUP_MIN_ITEMS`. One
    head each with score modifications (their functions see one kv head's
    tile), and with ALiBi where the keys span several key tiles: a span is
    skipped where its item's flattest head leaves nothing above the flush
    floor (:meth:`_Item.below_floor`), and far key tiles are what steep
    heads skip. Where the keys fit one key tile, a query tile's spans hold
    its nearest keys, and one-head items only multiplied the items: B=32,
    N=8, T=S=128 took 4.3x the time forward (256 items of one head, each
    mostly Python), T=S=512 causal or padded 2.2-2.4x."""
    K, items = spec.num_kv_heads, spec.num_batch * spec.num_kv_heads * tiles
    single = bool(spec.score_mods) or (spec.alibi_slopes is not None and spec.kv_len > _blocks(spec)[1])
    heads = max(GROUP_MIN_HEADS, GROUP_SCORES // max(span_scores, 1))
    nk = 1 if single else max(1, min(K, heads, items // GROUP_MIN_ITEMS))
    return [(kv0, min(kv0 + nk, K)) for kv0 in range(0, K, nk)]


def _tells_heads_apart(spec: AttentionSpec) -> bool:
    """Whether an option of ``spec`` may treat query heads (or batch
    elements) differently: a mask, bias, ALiBi, score modifications, a mask
    function or block mask, or dropout (its keep mask hashes both indices)."""
    return (
        spec.mask is not None
        or spec.bias is not None
        or spec.alibi_slopes is not None
        or bool(spec.score_mods)
        or spec.mask_mod is not None
        or spec.block_mask is not None
        or bool(spec.dropout_p)
    )


def _batch_as_heads(spec: AttentionSpec, *arrays: Any) -> AttentionSpec | None:
    """``spec`` with its batch axes folded into the heads, ``(B, N) -> (B*N,)``
    and ``(B, K) -> (B*K,)``, where nothing in it tells batch elements or
    heads apart: no mask, bias, lengths, segment ids, ALiBi, score
    modifications or dropout (causal/window and the softcap are the same for
    every head). Query head ``b N + n`` then reads kv head
    ``(b N + n) // G = b K + n // G``, as before, and one item may stack
    the kv heads of several batch elements (:func:`_kv_groups`): at B=64,
    N=8, T=S=32, 8-head items spent their time handing the GIL between
    threads, and the pool took 2x one thread's time. None where there is
    nothing to fold (one batch element) or something to tell apart, and
    where folding ``arrays`` (``(*batch, heads, L, D)`` each) would copy one
    while a batch element's scores ``N*T*S`` fill a group already
    (:data:`GROUP_SCORES`), so that items could not stack elements anyway:
    the multi-head layer's split heads are strided views, and their copies'
    fresh pages cost more than the rest of the call's setup (B=8, N=8,
    T=S=256: 18.4 ms against 10.2 ms from contiguous arrays)."""
    per_element = spec.q_lengths is not None or spec.kv_lengths is not None or spec.has_segments
    if spec.num_batch <= 1 or per_element or _tells_heads_apart(spec):
        return None
    element_fills_group = spec.num_heads * spec.q_len * spec.kv_len >= GROUP_SCORES
    if element_fills_group and not all(_heads_merge_with_batch(x) for x in arrays):
        return None
    return spec.replace(
        batch_shape=(), num_heads=spec.num_batch * spec.num_heads, num_kv_heads=spec.num_batch * spec.num_kv_heads
    )


def _heads_merge_with_batch(x: Any) -> bool:
    """Whether ``x (*batch, heads, L, D)``'s batch and head axes merge into
    one without a copy: each axis longer than 1 steps over whole runs of the
    next such axis."""
    axes = [(n, step) for n, step in zip(x.shape[:-2], x.strides[:-2], strict=True) if n > 1]
    return all(step == n_next * step_next for (_, step), (n_next, step_next) in itertools.pairwise(axes))


# --- tile plans -------------------------------------------------------------------------

#: Partly visible tiles are planned in sub-blocks of this many query
#: positions and keys (see :func:`plan_tile`).
SPLIT_BLOCK = 128


def _coalesce(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted union of half-open ranges, touching ones merged."""
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return tuple((start, stop) for start, stop in merged)


def plan_tile(spec: AttentionSpec, q0: int, q1: int, k0: int, k1: int, split: int | None = None) -> list[tuple]:
    """The spans of the tile ``[q0, q1) x [k0, k1)`` worth computing.

    Each span is ``(p0, p1, c0, c1, hidden)``: query positions ``[p0, p1)``
    against keys ``[c0, c1)``, where ``hidden`` lists the key ranges that need
    the visibility mask (the rest of the span is fully visible). A fully
    visible tile is one span with nothing hidden, a fully hidden tile none.

    A partly visible tile (a causal diagonal, a window's edge, the end of the
    padded keys) is cut into ``split``-row chunks (:data:`SPLIT_BLOCK` unless
    given); each chunk keeps the keys from its first to its last sub-block
    that is not fully hidden, and consecutive chunks with the same keys are
    merged. A causal diagonal tile of 512 thus computes 10/16 of its area,
    and masks only its four 128x128 diagonal sub-blocks. Only the index
    rules can hide a sub-block, so tiles that only a user mask makes partial
    stay whole.
    """
    kind = classify_tile(spec, q0, q1, k0, k1)
    if kind == NONE:
        return []
    if kind == ALL:
        return [(q0, q1, k0, k1, ())]
    sub = SPLIT_BLOCK if split is None else split
    if not spec.has_index_rules or (q1 - q0 <= sub and k1 - k0 <= sub):
        return [(q0, q1, k0, k1, ((k0, k1),))]
    key_blocks = [(j0, min(j0 + sub, k1)) for j0 in range(k0, k1, sub)]
    spans: list[tuple] = []
    for p0 in range(q0, q1, sub):
        p1 = min(p0 + sub, q1)
        kinds = [classify_tile(spec, p0, p1, j0, j1) for j0, j1 in key_blocks]
        shown = [i for i, block_kind in enumerate(kinds) if block_kind != NONE]
        if not shown:
            continue
        first, last = shown[0], shown[-1]
        c0, c1 = key_blocks[first][0], key_blocks[last][1]
        hidden = [key_blocks[i] for i in range(first, last + 1) if kinds[i] != ALL]
        if spans and spans[-1][1] == p0 and spans[-1][2:4] == (c0, c1):
            hidden += spans[-1][4]
            p0 = spans.pop()[0]
        spans.append((p0, p1, c0, c1, _coalesce(hidden)))
    return spans


def _plans(
    spec: AttentionSpec, q_tiles: list, k_tiles: list, masks: dict | None = None, split: int | None = None
) -> list[list[list[tuple]]]:
    """``plans[i][j]``: :func:`plan_tile` of query tile ``i`` and key tile ``j``,
    made once per call and shared by every (batch element, kv head) item
    (per batch element with lengths or segment ids, see :func:`_batch_plans`).

    Each hidden range becomes ``(j0, j1, hidden)``: when visibility is the
    same for every item (only causal/window rules, no mask, no lengths, no
    segment ids or one id throughout the range),
    ``hidden`` is the ``(R, j1 - j0)`` boolean of entries to hide, built here
    once rather than per item; otherwise None, and each item builds its own.
    Causal/window visibility depends on ``j - (i + offset)`` alone: ranges of
    the same shape at the same distance from the diagonal share one mask,
    read-only (every causal diagonal, every window's edge), kept in
    ``masks`` (a dict the caller may share between calls of one spec's
    elements, :func:`_batch_plans`).
    """
    index_rules_only = not spec.has_user_mask and spec.q_lengths is None and spec.kv_lengths is None
    # Where the segment ids are one and the same throughout a range (inside a
    # packed document), the range's visibility is causal/window's alone.
    positions_only = spec.replace(q_segment_ids=None, kv_segment_ids=None, segment_host=None)
    G = spec.group_size
    masks_by_shape: dict[tuple[int, int, int], Any] = {} if masks is None else masks

    def rows_hidden_of(p0: int, p1: int, j0: int, j1: int) -> Any:
        key = (j0 - p0 - int(positions_only.q_offset), p1 - p0, j1 - j0)  # index rules only: one offset
        found = masks_by_shape.get(key)
        if found is None:
            visible = visible_tile(positions_only, p0, p1, j0, j1)  # (tq, tk)
            assert visible is not None, "a hidden range comes from an index rule, so visibility is set"
            found = _position_major(np.broadcast_to(~visible, (G, p1 - p0, j1 - j0)))  # (tq*G, tk)
            masks_by_shape[key] = found
        return found

    def with_masks(span, one_document: bool):
        p0, p1, c0, c1, hidden = span
        masks = []
        for j0, j1 in hidden:
            rows_hidden = None
            if index_rules_only and (one_document or segments_hide_nothing(spec, p0, p1, j0, j1)):
                rows_hidden = rows_hidden_of(p0, p1, j0, j1)
            masks.append((j0, j1, rows_hidden))
        return (p0, p1, c0, c1, tuple(masks))

    def tile_plan(q0: int, q1: int, k0: int, k1: int) -> list[tuple]:
        # Inside one document (or without segment ids) the tile's sub-blocks are the
        # index rules' alone: planned without the ids (a packed call's plans 1.8x faster).
        one_document = q0 < q1 and k0 < k1 and segments_hide_nothing(spec, q0, q1, k0, k1)
        rules = positions_only if one_document else spec
        return [with_masks(span, one_document) for span in plan_tile(rules, q0, q1, k0, k1, split)]

    return [[tile_plan(q0, q1, k0, k1) for k0, k1 in k_tiles] for q0, q1 in q_tiles]


def _batch_plans(
    spec: AttentionSpec, q_tiles: list, k_tiles: list, split: int | None = None
) -> list[list[list[list[tuple]]]]:
    """``plans[b][i][j]``: the spans of batch element ``b``'s tile ``(i, j)``,
    partly visible tiles cut into ``split``-row chunks (:func:`plan_tile`).

    Where every element sees the same keys, they share :func:`_plans`. With
    ``q_lengths`` or ``kv_lengths``, or segment ids over several elements,
    each element plans its own square: its tiles cut at its ``q_len`` rows
    and ``kv_len`` keys, planned with a spec that has no lengths, that
    element's query offset and only its own segment ids. Its spans then
    compute no padded key or query and mask nothing for the lengths, and
    skip what its own documents cannot see (a shared plan would compute
    every element up to the longest lengths, and every tile that any
    element's documents reach). Elements with the same lengths, offset and
    ids share one plan."""
    lengths = spec.q_lengths is not None or spec.kv_lengths is not None
    segments = spec.segment_host if spec.has_segments and spec.num_batch > 1 else None
    if not lengths and segments is None:
        return [_plans(spec, q_tiles, k_tiles, split=split)] * spec.num_batch
    Bf, T, S = spec.num_batch, spec.q_len, spec.kv_len
    q_lens = np.full(Bf, T) if spec.q_lengths is None else np.reshape(spec.q_lengths, (Bf,))
    kv_lens = np.full(Bf, S) if spec.kv_lengths is None else np.reshape(spec.kv_lengths, (Bf,))
    offsets = np.reshape(np.broadcast_to(np.asarray(spec.q_offset), spec.batch_shape), (Bf,))
    by_element: dict[tuple, list] = {}
    masks: dict = {}  # shared by the elements' plans: see _plans
    plans = []
    for b, (q_len, kv_len, offset) in enumerate(zip(q_lens.tolist(), kv_lens.tolist(), offsets.tolist())):
        ids = () if segments is None else (segments.q[b].tobytes(), segments.kv[b].tobytes())
        key = (q_len, kv_len, offset, *ids)
        found = by_element.get(key)
        if found is None:
            host = spec.segment_host
            if segments is not None:  # (1, T), (1, S): this element's ids alone
                host = SegmentHost(segments.q[b : b + 1], segments.kv[b : b + 1], {})
            element = spec.replace(
                q_lengths=None,
                kv_lengths=None,
                q_len_bounds=(T, T),
                kv_len_bounds=(S, S),
                q_offset=offset,
                offset_bounds=(offset, offset),
                segment_host=host,
            )
            cut_q = [(q0, min(q1, q_len)) for q0, q1 in q_tiles]  # empty past q_len: no spans
            cut_k = [(k0, min(k1, kv_len)) for k0, k1 in k_tiles]
            found = by_element[key] = _plans(element, cut_q, cut_k, masks, split)
        plans.append(found)
    return plans


def _largest_span(plans_by_batch: list) -> int:
    """Query positions times keys of the largest span of any element's plans
    (:func:`_batch_plans`), at least 1: what one head's span buffer holds,
    and what :func:`_kv_groups` sizes an item's group of kv heads by. A
    tile's area where a span covers a whole tile; far less where the plans
    cut every tile into narrow spans (a sliding window)."""
    largest = 1
    for plans in {id(plans): plans for plans in plans_by_batch}.values():  # elements may share one plan
        for row in plans:
            for plan in row:
                for p0, p1, c0, c1, _ in plan:
                    largest = max(largest, (p1 - p0) * (c1 - c0))
    return largest


class ModState(NamedTuple):
    """A span's score modifications: what each received, and the span's
    :class:`~npattn.scores.mods.TileIndex` (built once, read again by their
    backward or tangent)."""

    inputs: list[Any]
    index: Any


class _Item:
    """A group of ``nk`` consecutive kv heads of one batch element, the G
    query heads of each stacked position-major (row ``t*G + g`` is its head
    ``g`` at query ``t``), so that a range of query positions is a
    contiguous range of rows. The item's arrays are stacks of one matrix
    per kv head, ``(nk, rows, ...)``, so that each product and pass covers
    the group in one NumPy call (:func:`_kv_groups`); the mask, bias and
    dropout tiles of its heads come as ``(nk, tq*G, tk)`` stacks. The
    methods that modify or match a span's array also take a single kv
    head's 2-D ``(tq*G, tk)`` (``nk = 1``), as the derivative modes'
    kernels pass."""

    def __init__(
        self, spec: AttentionSpec, b: int, kv_heads: tuple[int, int], mode: _Mode, alibi_memo: dict | None = None
    ):
        kv0, kv1 = kv_heads
        self.spec, self.b, self.G = spec, b, spec.group_size
        self.kv_slice, self.nk = slice(kv0, kv1), kv1 - kv0
        self.heads = (kv0 * self.G, kv1 * self.G)
        self.head_slice = slice(*self.heads)
        self.mode = mode
        self.mod_grads: dict[str, Any] = {}  # the score modifications' parameter cotangents, summed over spans
        self.keep_inputs = False  # the backward sets it: the modifications' inputs are read after scores()
        # min_n m_n and max_n m_n over this item's heads, in the scores' base
        self.slope_min: float | None = None
        self.slope_max: float | None = None
        self.additive = spec.bias is not None or spec.alibi_slopes is not None  # step 3 adds a term
        if spec.alibi_slopes is not None:
            slopes = select_item(spec, spec.alibi_slopes, b, self.heads)  # (nk*G|1, 1, 1)
            self.slope_min, self.slope_max = float(np.min(slopes)) * mode.base, float(np.max(slopes)) * mode.base
        # ALiBi's distances and terms by span shape (:meth:`_diagonals`), shared by a call's items;
        # this element's index only where its positions (or slopes) differ from the others'
        self.alibi_memo = {} if alibi_memo is None else alibi_memo
        self._positions_key = b if np.ndim(spec.q_offset) else None
        self._slopes_key = b if spec.alibi_slopes is not None and np.ndim(spec.alibi_slopes) > 1 else None

    def _as_rows(self, tile: Any, tq: int, tk: int, like: Any = None) -> Any:
        """``(nk*G|1, tq|1, tk|1)`` or ``(tq|1, tk|1)`` -> ``(nk, tq*G, tk)``,
        or ``like``'s shape (a single kv head's 2-D array)."""
        rows = _position_major(np.broadcast_to(tile, (self.nk * self.G, tq, tk)), self.nk)  # (nk, tq*G, tk)
        return rows if like is None else rows.reshape(like.shape)

    def _heads(self, x: Any, tq: int) -> Any:
        """A span's ``(nk, tq*G, tk)`` or ``(tq*G, tk)`` -> ``(nk*G, tq, tk)``, head-major."""
        return _head_major(x.reshape((self.nk,) + x.shape[-2:]), tq, self.G, self.nk)

    def add_bias(self, s: Any, p0: int, p1: int, c0: int, c1: int) -> None:
        """Add step 3 (bias, ALiBi) over positions ``[p0, p1)`` and keys
        ``[c0, c1)`` to the span's contiguous ``s``, in the scores' base
        (base 2 means no bias, so the base-scaled distance scales the ALiBi
        term alone). The ALiBi term ``-m_n b |p_i - j|`` is the pipeline's
        :func:`~npattn.scores.alibi.alibi_tile` along the span's diagonals
        (:meth:`_diagonals`), added through a Toeplitz view: one pass over
        ``s``, reading ``tq + tk - 1`` values per head."""
        spec, tq, tk = self.spec, p1 - p0, c1 - c0
        bias = bias_tile(spec, p0, p1, c0, c1, batch=self.b, heads=self.heads)
        if bias is not None:
            s += self._as_rows(bias, tq, tk, like=s)
        if spec.alibi_slopes is not None:
            assert s.flags.c_contiguous, "s a span's buffer"
            term = self._alibi_term(p0, p1, c0, c1)  # (nk*G|1, 1, tq + tk - 1)
            heads = term.shape[0]
            view = diagonal_view(term.reshape(heads, -1), tq, tk)  # (nk*G|1, tq, tk)
            groups = self.nk if heads > 1 else 1
            view = np.swapaxes(view.reshape(groups, heads // groups, tq, tk), 1, 2)  # (nk|1, tq, G|1, tk)
            s.reshape(-1, tq, self.G, tk)[...] += view  # rows t*G + g of each kv head as (nk, tq, G, tk)

    def _diagonals(self, p0: int, p1: int, c0: int, c1: int) -> Any:
        """The base-scaled ``b |p_i - j|`` along the diagonals of the span
        ``[p0, p1) x [c0, c1)``, ``(tq + tk - 1,)``: entry ``z`` holds every
        ``(i, j)`` with ``j - i = z - (tq - 1)``, so
        :func:`~npattn.scores.tiles.diagonal_view` views
        it as the span's distances. It is the pipeline's
        :func:`~npattn.scores.alibi.alibi_distance` of the span's first query
        against the keys its diagonals start at, ``[c0 - tq + 1, c1)``
        (``|p_i - j|`` depends on ``p_i - j`` alone). Built once per span
        shape and offset ``p0 - c0`` and kept in :attr:`alibi_memo`: the
        forward's items, the backward's scores and its slope gradients read
        them in turn (each took 13 us of small array calls: alibi_distance
        8, alibi_tile 5). The memo holds a row of ``tq + tk - 1`` values per
        offset and span shape (per head, for the terms): a few times
        ``N (T + S) / 128`` rows of at most 1023 values, linear in the
        sequence."""
        tq = p1 - p0
        key = ("distance", self._positions_key, p0 - c0, tq, c1 - c0)
        found = self.alibi_memo.get(key)
        if found is None:
            distance = alibi_distance(self.spec, p0, p0 + 1, c0 - (tq - 1), c1, batch=self.b)  # (1, tq + tk - 1)
            base = self.spec.compute_dtype.type(self.mode.base)
            found = self.alibi_memo[key] = distance.reshape(-1) * base if base != 1 else distance.reshape(-1)
        return found

    def _alibi_term(self, p0: int, p1: int, c0: int, c1: int) -> Any:
        """The pipeline's :func:`~npattn.scores.alibi.alibi_tile` of this
        item's heads along the span's diagonals (:meth:`_diagonals`),
        ``(nk*G|1, 1, tq + tk - 1)``, kept in :attr:`alibi_memo` as they are."""
        tq = p1 - p0
        key = ("term", self._slopes_key, self.heads, self._positions_key, p0 - c0, tq, c1 - c0)
        found = self.alibi_memo.get(key)
        if found is None:
            distance = self._diagonals(p0, p1, c0, c1)
            term = alibi_tile(self.spec, p0, p0 + 1, c0 - (tq - 1), c1, self.b, self.heads, distance)
            found = self.alibi_memo[key] = term
        return found

    def fill_hidden(self, s: Any, span: tuple, value: float) -> None:
        """Set the hidden entries of the span's ``(..., R, c1 - c0)`` array ``s`` to ``value``."""
        p0, p1, c0, _, hidden = span
        for j0, j1, rows_hidden in hidden:
            target = s[..., j0 - c0 : j1 - c0]
            if rows_hidden is None:  # visibility differs between items: this item's own
                visible = visible_tile(self.spec, p0, p1, j0, j1, batch=self.b, heads=self.heads)
                if visible is None:
                    continue
                rows_hidden = ~self._as_rows(visible, p1 - p0, j1 - j0, like=target)  # (..., R, j1 - j0)
            np.copyto(target, value, where=rows_hidden)

    def scores(
        self, out: Any, qa: Any, kTa: Any, span: tuple, *, hide: bool = True, tanh: Any = None
    ) -> ModState | None:
        """``out = qa @ kTa[..., c0:c1]``, then the softcap, the bias and ALiBi,
        the user score modifications and, with ``hide``, the span's hidden
        entries set to -inf. With a softcap and a ``tanh`` buffer of
        ``out``'s shape (the backward's), ``t = tanh(s / c)`` is kept there
        for the softcap's derivative. With modifications, returns their
        :class:`ModState` (for their backward), else None.

        The softcap is the pipeline's own
        :func:`~npattn.scores.softcap.softcap_forward_inplace`, in the
        scores' base: ``b c tanh(r / c) = (b c) tanh(b r / (b c))``, so the
        base-``b`` products take the cap ``b c``; in ``ratio`` mode the
        product already is ``s / c`` (see :func:`_base_scale`).
        """
        p0, p1, c0, c1, _ = span
        if self.spec.softcap is None:
            blas_numpy.matmul(qa, kTa[..., c0:c1], out=out)  # (nk, R, H[+1]) @ (nk, H[+1], tk) -> (nk, R, tk)
        else:
            t = out if tanh is None else tanh
            blas_numpy.matmul(qa, kTa[..., c0:c1], out=t)  # (nk, R, H[+1]) @ (nk, H[+1], tk): s, or s / c
            softcap_forward_inplace(np, t, self.mode.cap, out=out, ratio=self.mode.ratio)  # t, out = c t
        if self.additive:
            self.add_bias(out, p0, p1, c0, c1)
        state = self.modify(out, p0, p1, c0, c1, keep=self.keep_inputs) if self.spec.score_mods else None
        if hide:
            self.fill_hidden(out, span, -np.inf)
        return state

    def modify(self, s: Any, p0: int, p1: int, c0: int, c1: int, *, keep: bool) -> ModState:
        """Step 4 in place on the span's scores of one kv head (``nk = 1``,
        see :func:`_kv_groups`), ``(..., tq*G, tk)``, seen head-major as the
        rank-4 tile ``(1, G, tq, tk)``; returns what each modification
        received, valid after the call only with ``keep`` (the backward's:
        then the first receives a copy, since ``s`` is overwritten), and the
        span's index."""
        s4 = _head_major(s.reshape(s.shape[-2:]), p1 - p0, self.G)[None]  # (1, G, tq, tk), a view
        index = tile_index(self.spec, p0, p1, c0, c1, batch=self.b, heads=self.heads)
        result, inputs = mods_keeping_masked(self.spec, s4.copy() if keep else s4, index)
        np.copyto(s4, result)
        return ModState(inputs, index)

    def modify_backward(self, ds: Any, state: ModState, p0: int, p1: int) -> None:
        """Step 4's chain rule in place on the span's ``dS`` of one kv head;
        adds the parameter shares to :attr:`mod_grads`, in the span order."""
        ds4 = _head_major(ds.reshape(ds.shape[-2:]), p1 - p0, self.G)[None]  # (1, G, tq, tk), a view
        ds_in, shares = mods_backward(self.spec, ds4.copy(), state.inputs, state.index)
        np.copyto(ds4, ds_in)
        for name, share in shares.items():
            self.mod_grads[name] = share if name not in self.mod_grads else self.mod_grads[name] + share

    def below_floor(self, row_bounds: Any, span: tuple, floor: float) -> bool:
        """Whether every score of the span, shifted by its row's reference, lies
        below ``floor`` (the flushed exp's, so every probability there is an
        exact 0): ``row_bounds`` bound ``S_ij - ref_i`` without ALiBi, per row,
        in the scores' base, and ALiBi takes at least ``min_n m_n`` times the
        span's smallest distance (:func:`~npattn.scores.alibi.alibi_distance_bounds`)
        off every entry (slopes >= 0, which the caller's ``upper`` mode
        ensures). False without ALiBi."""
        if self.slope_min is None:
            return False
        p0, p1, c0, c1, _ = span
        reach = self.slope_min * alibi_distance_bounds(self.spec, p0, p1, c0, c1)[0]
        return reach > 0 and float(np.max(row_bounds)) - reach < floor

    def alibi_reach(self, span: tuple) -> float:
        """How far below its raw product ALiBi can take a score of the span,
        in the scores' base: ``max_n m_n`` times the span's largest distance
        (:func:`~npattn.scores.alibi.alibi_distance_bounds`), for slopes >= 0
        (which the caller's ``upper`` mode ensures); 0 without ALiBi. With
        the raw bound, ``S_ij >= -(bound + reach)``: the lower bound ALiBi
        keeps per span, though not per call."""
        if self.slope_max is None:
            return 0.0
        return self.slope_max * alibi_distance_bounds(self.spec, *span[:4])[1]

    def alibi_grad(self, ds: Any, p0: int, p1: int, c0: int, c1: int) -> Any:
        """This span's share of the item's slope gradients, ``(nk*G,)``, from
        its ``dS``; times the base (the distances carry it)."""
        distance = diagonal_view(self._diagonals(p0, p1, c0, c1), p1 - p0, c1 - c0)  # (tq, tk), a view
        ds_heads = self._heads(ds, p1 - p0)  # (nk*G, tq, tk)
        return alibi_slopes_grad_tile(self.spec, ds_heads, p0, p1, c0, c1, batch=self.b, distance=distance)

    def dropout_scale(self, p0: int, p1: int, c0: int, c1: int, *, like: Any = None) -> Any | None:
        """``keep_ij / (1 - p)`` as ``(nk, tq*G, tk)`` (or ``like``'s shape),
        or None without dropout."""
        spec = self.spec
        if spec.dropout_p == 0:
            return None
        keep = _dropout.keep_tile(spec, p0, p1, c0, c1, heads=self.heads, batch=self.b)  # (nk*G, tq, tk)
        scale = spec.compute_dtype.type(1.0 / (1.0 - spec.dropout_p))
        return self._as_rows(np.multiply(keep, scale, dtype=spec.compute_dtype), p1 - p0, c1 - c0, like=like)

    def add_dbias(self, dbias: Any, ds: Any, p0: int, p1: int, c0: int, c1: int) -> None:
        """Add the span's ``dS`` into the full-rank ``dbias`` over this item's
        batch element and heads, positions ``[p0, p1)`` and keys ``[c0, c1)``,
        summing over broadcast axes."""
        lead = dbias.ndim - 3
        index = np.unravel_index(self.b, self.spec.batch_shape) if self.spec.batch_shape else ()
        batch = tuple(0 if dbias.shape[a] == 1 else int(index[a]) for a in range(lead))
        heads = slice(None) if dbias.shape[-3] == 1 else self.head_slice
        rows = slice(None) if dbias.shape[-2] == 1 else slice(p0, p1)
        cols = slice(None) if dbias.shape[-1] == 1 else slice(c0, c1)
        target = dbias[batch + (heads, rows, cols)]  # (nk*G|1, tq|1, tk|1)
        target += sum_to_shape(np, self._heads(ds, p1 - p0), target.shape)


class _RangeMax:
    """``self[c0, c1]``: ``max(values[..., c0:c1])`` as a Python float, memoized
    (the same key ranges recur for every query tile)."""

    def __init__(self, values: Any):
        self.values = values
        self.memo: dict[tuple[int, int], float] = {}

    def __getitem__(self, key: tuple[int, int]) -> float:
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = float(self.values[..., key[0] : key[1]].max())
        return found


class _Exp:
    """The exponential of shifted scores, in the scores' base (2 when ``base2``).

    ``fast(s)`` is ``exp(s)`` in place. ``flushed(s)`` is
    ``exp(max(s, floor)) - exp(floor)`` in place: exact zeros for -inf (hidden
    entries) and for every score below ``floor``, never a subnormal, and at
    most ``2**FLUSH_EXPONENT`` below ``exp(s)`` elsewhere. Branch-free, it
    costs two light passes more than ``fast``, whose float32 ``exp2`` is
    itself 25-80 times slower on -inf or underflowing inputs than on others.
    """

    def __init__(self, base2: bool, dtype: Any):
        self.fast = np.exp2 if base2 else np.exp
        self.floor = dtype.type(FLUSH_EXPONENT[np.dtype(dtype)] * (1.0 if base2 else np.log(2.0)))
        self.tiny = self.fast(self.floor)

    def flushed(self, s: Any) -> None:
        np.maximum(s, self.floor, out=s)
        self.fast(s, out=s)
        s -= self.tiny


def _key_order(spec: AttentionSpec, row: list, q0: int, k_tiles: list) -> list:
    """The forward's order of the key tiles of one query tile: in index
    order, except with ALiBi, nearest to the tile's query positions first.
    ALiBi's scores fall with the distance, so a row's running maximum is
    then set by its highest scores at once, and farther tiles need no
    rescaling (in index order, every tile closer to the diagonal than the
    last would raise the maximum again). A fixed order: deterministic."""
    if spec.alibi_slopes is None:
        return row
    first_position = q0 + spec.offset_bounds[0]
    distance = [max(k0 - first_position, first_position - (k1 - 1), 0) for k0, k1 in k_tiles]
    return [row[j] for j in sorted(range(len(row)), key=lambda j: (distance[j], j))]


def _add_row_products(acc: Any, a: Any, b: Any, tmp: Any, partial: bool, G: int) -> None:
    """``acc += a^T b`` for ``a (..., R, n)`` and ``b (..., R, m)`` whose
    ``R = tq * G`` rows stack G heads position-major (row ``t*G + g``); with
    ``partial``, head by head, each as products of :data:`ROW_CHUNK`
    positions, the last positions first.

    A float32 product adds its R terms one after another, each rounded at
    the size of the sum so far. In a partly visible span (a causal diagonal,
    a short packed document, a window's edge), key j's largest ``P_ij`` and
    ``dS_ij`` are in the first rows that see it, and position-major rows put
    the G heads' largest terms together: summed first, they make every later
    term of ``dV_j`` and ``dK_j`` round at G times their size. One head's
    rows at a time (strided views, no copy), in short products last
    positions first, keep those roundings few (see the module docstring)."""
    R = a.shape[-2]
    if not _cuts_row_products(partial, G, R):
        blas_numpy.matmul(np.swapaxes(a, -1, -2), b, out=tmp)  # (..., n, R) @ (..., R, m) -> (..., n, m)
        acc += tmp
        return
    tq = R // G
    a_heads = np.reshape(a, (*a.shape[:-2], tq, G, a.shape[-1]))  # (..., tq, G, n), a view
    b_heads = np.reshape(b, (*b.shape[:-2], tq, G, b.shape[-1]))  # (..., tq, G, m)
    for g in range(G):
        for t0 in range((tq - 1) // ROW_CHUNK * ROW_CHUNK, -1, -ROW_CHUNK):
            rows = slice(t0, t0 + ROW_CHUNK)
            a_rows, b_rows = a_heads[..., rows, g, :], b_heads[..., rows, g, :]  # (..., chunk, n), (..., chunk, m)
            blas_numpy.matmul(np.swapaxes(a_rows, -1, -2), b_rows, out=tmp)  # (..., n, chunk) @ (..., chunk, m)
            acc += tmp


def _cuts_row_products(partial: bool, G: int, R: int) -> bool:
    """Whether :func:`_add_row_products` cuts the products of a span of ``R``
    rows (``G`` heads stacked): where some entries are hidden, unless one
    head (or none, ``R = 0``) of at most :data:`ROW_CHUNK` rows."""
    return partial and not (G <= 1 and R <= ROW_CHUNK)


def _only_span(plans: Iterable[list[tuple]]) -> tuple | None:
    """The one span of these tile plans; None where they hold none or several."""
    spans = [span for plan in plans for span in plan]
    return spans[0] if len(spans) == 1 else None


def _one_backward_span(plans: list, k_tiles: list, T: int, G: int) -> bool:
    """Whether a backward item's ``plans [qi][kj]`` are one span over all
    ``T`` query positions and the one key tile, whose products
    :func:`_add_row_products` would not cut."""
    span = _only_span(plan for row in plans for plan in row)
    if len(k_tiles) != 1 or span is None or span[:4] != (0, T, *k_tiles[0]):
        return False
    return not _cuts_row_products(bool(span[4]), G, T * G)


def _rows(span: tuple, q0: int, G: int) -> slice:
    """The item rows of a span's query positions (position-major stacking)."""
    return slice((span[0] - q0) * G, (span[1] - q0) * G)


def _buffer(flat: Any, *shape: int) -> Any:
    """A contiguous array of ``shape`` at the start of a flat buffer."""
    return flat[: math.prod(shape)].reshape(shape)


# --- forward ----------------------------------------------------------------------------


def forward(spec: AttentionSpec, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
    """Online-softmax forward; same contract as :func:`npattn.chunked.chunked_forward`.

    One item per (batch element, kv head, query tile), each running the spans
    of its key tiles (see :func:`plan_tile`) in one of two loops:

    - **at the zero reference**, when the Cauchy-Schwarz bound
      ``|S_ij| <= |scale q_i| |k_j|`` (or the softcap) keeps every score of
      the call within :data:`ZERO_REFERENCE_BOUND` of 0 and no bias or
      score modification can move it (:class:`_Forward`): ``P~ = exp(S)``
      with no running maximum or rescaling, hidden entries zeroed after the
      ``exp``; ``l = rowsum(P~)``, ``acc = P~ V``. ALiBi (slopes >= 0) only
      lowers scores, and where every row sees the key at its own position,
      whose term is 0, each row's maximum stays within the bound of 0 too:
      its far spans take the flushed ``exp``, or are skipped where every
      entry lies below the flush floor.
    - **with a running maximum** otherwise: each row keeps a reference
      maximum ``m``, updated lazily. Per span, with the shifted scores
      ``S_ij - m`` (from one GEMM when fused, see the module docstring) and
      ``t = rowmax``: rows whose ``t`` exceeds :data:`RESCALE_THRESHOLD` (or
      that saw nothing yet) move ``m`` up by ``t`` and rescale ``l`` and
      ``acc`` by ``exp(-t)`` (FlashAttention-2's rescale, done only when
      needed; where the bound proves that no row can need it, ``t`` is not
      computed, and rows whose first keys all score within the threshold of
      0 keep ``m = 0``); then ``P~ = exp(.)``, flushed where it could be
      subnormal.

    Then ``l += rowsum(P~)`` and ``acc += P~ V`` (:class:`_Sums`). At the end
    ``O = acc / l`` and ``lse = m + log l``, all in the scores' base (2 when
    fused, with ``lse`` converted to nats).
    """
    folded = _batch_as_heads(spec, q, k, v)
    if folded is not None:
        out, lse = forward(folded, q, k, v)  # (B*N, T, Hv), (B*N, T)
        N, T = spec.num_heads, spec.q_len
        return out.reshape(spec.batch_shape + (N, T, spec.value_dim)), lse.reshape(spec.batch_shape + (N, T))
    call = _Forward(spec, q, k, v)
    # Costliest (batch element, query tile) first, so that no thread is left with a long one at the end.
    cost = {
        (b, qi): sum((p1 - p0) * (c1 - c0) for plan in row for p0, p1, c0, c1, _ in plan)
        for b, plans in enumerate(call.plans)
        for qi, row in enumerate(plans)
    }
    order = sorted(cost, key=lambda tile: -cost[tile])
    groups = range(len(call.groups))
    items = [(b, g, qi) for b, qi in order for g in groups if cost[b, qi] and spec.group_size]
    run_items(items, call.work)
    for b, qi in (tile for tile in order if not cost[tile]):  # query tiles that see no key: fully masked rows (l = 0)
        q0, q1 = call.q_tiles[qi]
        call.out[b, :, q0:q1] = 0
    bs, N, T = spec.batch_shape, spec.num_heads, spec.q_len
    return call.out.reshape(bs + (N, T, spec.value_dim)), call.lse().reshape(bs + (N, T))


#: The forward keeps every row's reference at 0 (no running maximum) when
#: every score of the call lies within +-this bound, in base 2: ``exp2``
#: then stays within ``[2**-bound, 2**bound]``, never subnormal nor flushed,
#: and P~ carries the same relative rounding as ``exp2(S - m)`` would (the
#: product's own error is relative to ``|q_i| |k_j|`` either way). Gemma 2's
#: softcap of 50 (72 in base 2) is within it. The sums must also stay finite
#: and their terms ``P~ v`` clear of the subnormals, which
#: :func:`_zero_reference_fits` checks against ``S``, dropout and every ``|v|``.
ZERO_REFERENCE_BOUND = {np.dtype(np.float32): 80.0, np.dtype(np.float64): 900.0}


def _zero_reference_fits(bound: float, v_rows: Any, dropout_p: float, dtype: Any) -> bool:
    """Whether a group of kv heads may keep its rows at the zero reference,
    given ``bound`` (base 2, on every ``|S_ij|`` of the call) and the
    group's values ``v_rows``, ``(..., S, Hv)``. It needs:

    - ``bound`` within :data:`ZERO_REFERENCE_BOUND`;
    - no overflow: ``l <= S 2**bound`` and ``|acc| <= S 2**bound max|v| /
      (1 - dropout_p)`` two binades below the dtype's largest power of 2;
    - no underflow that the running maximum would not have: a term ``P~_ij
      v_jh`` can be ``2**bound`` times smaller than with ``m_i``, so every
      nonzero ``|v_jh|`` must keep it ``2**(log2 S + 2)`` above the
      smallest normal number, whichever keys a row sees (a row that sees
      only small values, next to hidden large ones, is the case to guard).
    """
    finfo, S = np.finfo(dtype), v_rows.shape[-2]
    if not bound <= ZERO_REFERENCE_BOUND[np.dtype(dtype)]:  # also False for a NaN bound
        return False
    if not v_rows.size:
        return True
    magnitudes = np.abs(v_rows)  # (..., S, Hv)
    log_s, dropout_scale = math.log2(S), -math.log2(1.0 - dropout_p)
    largest = float(np.max(magnitudes))
    if not bound + log_s + math.log2(max(largest, 1.0)) + dropout_scale <= finfo.maxexp - 2:  # also for NaN or inf
        return False
    smallest = 2.0 ** (bound + log_s + finfo.minexp + 2)  # the least nonzero |v_jh| allowed
    if float(np.min(magnitudes)) >= smallest:  # no zero either (the common case)
        return True
    return float(np.min(magnitudes, where=magnitudes > 0, initial=np.inf)) >= smallest


class _Forward:
    """One forward call: what its items share, and the loops an item runs
    (see :func:`forward`). An item is a (batch element, group of kv heads,
    query tile), its arrays ``(nk, rows, ...)`` (see :class:`_Item`)."""

    def __init__(self, spec: AttentionSpec, q: Any, k: Any, v: Any):
        dtype = spec.compute_dtype
        Bf, N, K = spec.num_batch, spec.num_heads, spec.num_kv_heads
        T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
        self.spec, self.dtype, self.G, self.Hv = spec, dtype, spec.group_size, Hv
        self.q3 = np.reshape(q, (Bf, N, T, H))  # (B, N, T, H), B = flattened batch axes
        self.k3 = np.reshape(k, (Bf, K, S, H))  # (B, K, S, H)
        self.v3 = np.reshape(v, (Bf, K, S, Hv))  # (B, K, S, Hv)
        self.q_norms3, self.k_norms = _row_norms(self.q3), _row_norms(self.k3)  # (B, N, T), (B, K, S): for the bounds
        self.mode = mode = _Mode(spec, self.q_norms3, self.k_norms)
        # Every item writes its rows of out, l and m; query tiles that see no key
        # are filled in forward(), which turns l and m into lse in one pass (lse()).
        self.out = np.empty((Bf, N, T, Hv), dtype=dtype)
        self.row_l = np.zeros((Bf, N, T), dtype=dtype)  # rowsum(P~), 0 on rows that saw no key
        self.row_m = np.zeros((Bf, N, T), dtype=dtype)  # the reference maximum, 0 at the zero reference
        split = _forward_split(spec)  # the backward's tiles may be larger (DIAGONAL_SPLIT_BLOCK)
        block_q, self.block_k = _blocks(spec, split)
        self.q_tiles, self.k_tiles = tile_ranges(T, block_q), tile_ranges(S, self.block_k)
        self.plans = _batch_plans(spec, self.q_tiles, self.k_tiles, split)  # [b][qi][kj]
        self.span_size = self.G * _largest_span(self.plans)  # one kv head's largest span of scores
        self.groups = _kv_groups(spec, self.span_size, len(self.q_tiles))
        # [K^T; 1] per (batch element, group), built by its first item, in
        # parallel and while K is in cache (_keys).
        self.keys: list[Any] = [None] * (Bf * len(self.groups))
        # Whether each (batch element, group) keeps its rows at the zero
        # reference (_at_zero_reference), decided by its first item.
        self.zero_reference: list[bool | None] = [None] * (Bf * len(self.groups))
        # In base 2 (log2(e) folded into the scale, exp2 for exp) where the mode
        # allows; otherwise in base e, exactly as the generic path.
        self.exp = _Exp(mode.base2, dtype)
        self.scale, self.b_eff = _base_scale(spec, mode)  # the products' factor c; the scores are b_eff times nats
        self.keys_scaled = _keys_carry_scale(self.scale)  # c on K (else on Q)
        self.norm_scale = abs(spec.scale) * mode.base  # |S_ij| <= norm_scale |q_i| |k_j|, in the scores' base
        self.threshold = RESCALE_THRESHOLD * mode.base
        self.ones_k = np.ones(self.block_k, dtype=dtype)
        self.k_norm_max = [[_RangeMax(self.k_norms[b, slice(*group)]) for group in self.groups] for b in range(Bf)]
        self.alibi_memo: dict = {}  # ALiBi's span terms, shared by the items (_Item._diagonals)

    def _at_zero_reference(self, b: int, g: int) -> bool:
        """Whether batch element ``b``'s group ``g`` keeps every row at the
        zero reference: the call's bound and the group's values allow it
        (:func:`_zero_reference_fits`), decided by the first item that asks,
        in parallel (threads may decide it twice, alike)."""
        slot = b * len(self.groups) + g
        found = self.zero_reference[slot]
        if found is None:
            v_rows = self.v3[b, slice(*self.groups[g])]  # (nk, S, Hv)
            bound, dropout_p = self.mode.raw_bound, self.spec.dropout_p
            found = self.mode.maxima_near_zero and _zero_reference_fits(bound, v_rows, dropout_p, self.dtype)
            self.zero_reference[slot] = found
        return found

    def _keys(self, b: int, g: int) -> Any:
        """``[K^T; 1] (nk, H+1, S)`` of batch element ``b``'s group ``g``
        (``K^T (nk, H, S)`` at the zero reference), times the scores' factor
        ``c`` where it carries it (:func:`_keys_carry_scale`), built by the
        first item that asks (threads may build it twice; both copies are
        equal)."""
        slot = b * len(self.groups) + g
        found = self.keys[slot]
        if found is None:
            k_rows = self.k3[b, slice(*self.groups[g])]  # (nk, S, H)
            scale = self.scale if self.keys_scaled else None
            found = _augmented_transposed(k_rows, self.dtype, ones=not self._at_zero_reference(b, g), scale=scale)
            self.keys[slot] = found
        return found

    def work(self, job: tuple[int, int, int]) -> None:
        """The item ``(b, g, qi)``: its spans, then its rows of ``out`` and ``lse``."""
        b, g, qi = job
        q0, q1 = self.q_tiles[qi]
        item = _Item(self.spec, b, self.groups[g], self.mode, self.alibi_memo)
        q_rows = self.q3[b, item.head_slice, q0:q1]  # (nk*G, tq, H)
        # (nk, tq*G, H+1) = [Q_i, -m], the running maximum's shift riding in the
        # product; (nk, tq*G, H) = Q_i at the zero reference, which has none
        # (Q's own rows with one query head per kv head, when K carries c).
        zero = self._at_zero_reference(b, g)
        if zero and self.G == 1 and self.keys_scaled:
            qa = q_rows  # (nk, tq, H): position-major already
        else:
            q_scale = None if self.keys_scaled else self.scale
            qa = _augmented_rows(q_rows, None if zero else 0, q_scale, self.dtype, item.nk)
        single_span = zero and self._one_span_over_all_rows(item.b, qi)
        sums = _Sums(item.nk, qa.shape[1], self.Hv, self.dtype, single_span=single_span)
        if zero:
            self._spans_at_zero_reference(item, g, qi, q0, qa, sums)
            m = None
        else:
            m = self._spans_with_running_max(item, g, qi, q0, qa, sums)
        self._finish(item, q0, q1, sums, m)

    def _one_span_over_all_rows(self, b: int, qi: int) -> bool:
        """Whether batch element ``b``'s query tile ``qi`` runs one span, over
        all of its rows (at the zero reference every span runs)."""
        span = _only_span(self.plans[b][qi])
        return span is not None and span[:2] == self.q_tiles[qi]

    def _query_norms(self, item: _Item, q0: int, rows: int) -> Any:
        """``|c q_i|`` in the scores' base of the item's ``rows`` stacked rows
        from position ``q0``, position-major: ``(nk, rows)``, for the bounds."""
        positions = self.q_norms3[item.b, item.head_slice, q0 : q0 + rows // self.G]  # (nk*G, rows / G)
        return _position_major(positions, item.nk) * self.norm_scale

    def _spans_at_zero_reference(self, item: _Item, g: int, qi: int, q0: int, qa: Any, sums: _Sums) -> None:
        """The spans of one query tile with every row's reference at 0.

        Without ALiBi every score lies within the call's bound, so ``P~ =
        exp(S)`` is never subnormal nor inf. ALiBi's term can take a score
        far below it: there the exp is the flushed one, except in a span whose
        raw bound plus ALiBi's reach (:meth:`_Item.alibi_reach`) keeps every
        entry above the flush floor, and a span whose every entry lies below
        that floor (:meth:`_Item.below_floor`, its row bounds ``|c q_i|
        max_j |k_j|`` against the reference 0) holds only exact zeros after
        the flushed exp and is skipped, as in the loop with a running maximum."""
        nk, G, exp = item.nk, self.G, self.exp
        keys, values = self._keys(item.b, g), self.v3[item.b, item.kv_slice]  # (nk, H, S), (nk, S, Hv)
        s_flat = np.empty(nk * self.span_size, dtype=self.dtype)  # one span's scores, reused
        alibi = item.slope_min is not None
        if alibi:
            q_norms = self._query_norms(item, q0, qa.shape[1])  # (nk, rows)
        for plan in self.plans[item.b][qi]:
            for span in plan:
                r, (c0, c1) = _rows(span, q0, G), span[2:4]
                flushed = False
                if alibi:
                    row_bounds = q_norms[:, r] * self.k_norm_max[item.b][g][c0, c1]  # (nk, R): S_ij before ALiBi
                    # (a single span over all rows writes the sums: it holds each row's own position)
                    if not sums.single_span and item.below_floor(row_bounds, span, exp.floor):
                        continue
                    flushed = min(float(row_bounds.max()), self.mode.cap) + item.alibi_reach(span) >= -exp.floor
                s = _buffer(s_flat, nk, r.stop - r.start, c1 - c0)  # (nk, R, tk)
                item.scores(s, qa[:, r], keys, span, hide=False)  # scale Q K^T, softcapped, ALiBi's term
                if flushed:
                    exp.flushed(s)  # P~_ij = exp(S_ij), exactly 0 far below the bound
                else:
                    exp.fast(s, out=s)  # P~_ij = exp(S_ij), never subnormal nor inf
                item.fill_hidden(s, span, 0)
                sums.add(s, r, self.ones_k[: c1 - c0], values[:, c0:c1], item.dropout_scale(*span[:4]))

    def _spans_with_running_max(self, item: _Item, g: int, qi: int, q0: int, qa: Any, sums: _Sums) -> Any:
        """The spans of one query tile with a reference maximum ``m`` per
        row, updated lazily (see :func:`forward`); returns ``m``."""
        spec, mode, dtype, exp, G, nk = self.spec, self.mode, self.dtype, self.exp, self.G, item.nk
        fused, upper, threshold = mode.fused, mode.upper, self.threshold
        H, rows = qa.shape[2] - 1, qa.shape[1]
        m = np.zeros((nk, rows), dtype=dtype)  # reference row maximum
        l = sums.l
        unset = np.ones((nk, rows), dtype=bool)  # rows that have seen no visible key yet
        q_norms = self._query_norms(item, q0, rows)  # (nk, rows)
        keys, values = self._keys(item.b, g), self.v3[item.b, item.kv_slice]  # (nk, H+1, S), (nk, S, Hv)
        k_norm_max = self.k_norm_max[item.b][g]  # read only when upper
        s_flat = np.empty(nk * self.span_size, dtype=dtype)  # one span's scores, reused
        # Python scalars for the cheap form of the bounds below: max_i |scale q_i|,
        # min_i and max_i of m over all rows (unset rows keep m = 0, which only
        # widens them), and whether any row is unset (refreshed when m moves).
        q_norm_max = float(q_norms.max()) if upper and q_norms.size else 0.0
        m_min, m_max, any_unset = 0.0, 0.0, True
        for plan in _key_order(spec, self.plans[item.b][qi], q0, self.k_tiles):
            for span in plan:
                r, (c0, c1) = _rows(span, q0, G), span[2:4]
                s = _buffer(s_flat, nk, r.stop - r.start, c1 - c0)  # (nk, R, tk)
                m_r, unset_r = m[:, r], unset[:, r]  # views
                span_unset = any_unset and bool(unset_r.any())
                # Cauchy-Schwarz: -low <= S_ij <= bound with bound = |scale q_i| |k_j|, and
                # low = bound + ALiBi's reach (slopes >= 0: its term lies in [-reach, 0]).
                if upper:
                    k_max = k_norm_max[c0, c1]
                    bound = min(q_norm_max * k_max, mode.cap)  # a softcap bounds |S_ij| too
                    low = bound + item.alibi_reach(span)
                else:
                    k_max = bound = low = np.inf
                # ALiBi far from the diagonal: when S_ij - m_i < floor for every entry, the
                # flushed exp gives exactly 0 throughout, so the span adds nothing to l and
                # acc and is skipped (the same numbers, no GEMMs).
                if upper and not any_unset and item.below_floor(q_norms[:, r] * k_max - m_r, span, exp.floor):
                    continue
                # A row's first visible keys set its reference m. When the bounds keep
                # every score of the span within +-threshold, the unset rows take m = 0
                # (their visible scores are within the threshold of it, so no exp can
                # overflow or lose the row), and no row-max pass is needed. The rows
                # that see no key here (hidden, as on a causal diagonal) are unset
                # again after it: their l stayed 0.
                provisional = None
                if span_unset and low <= threshold:
                    provisional = unset_r.copy()
                    unset_r[...] = False
                    span_unset = False
                # Settled: S_ij - m_i <= bound - m_i stays under the threshold for every
                # row of the span, so no row can need a rescale and the row-max pass is
                # skipped. Tried first in scalars (no array operation, so no GIL hand-off
                # between the pool's threads), then row by row.
                settled = (
                    upper
                    and not span_unset
                    and (bound - m_min <= threshold or np.max(q_norms[:, r] * k_max - m_r) <= threshold)
                )
                # In a settled span where also S_ij - m_i >= -low - m_max stays above the
                # floor, every entry, hidden or not, has a plain exp: the hidden ones are
                # zeroed after it rather than set to -inf before (two passes fewer than
                # the flushed exp, which -inf needs).
                exp_then_hide = settled and low + m_max < -exp.floor
                item.scores(s, qa[:, r], keys, span, hide=not exp_then_hide)  # scale Q K^T [- m]
                if settled:
                    grow = None
                else:
                    # t: the span's row maximum, relative to m when fused, raw otherwise
                    t = s.max(axis=-1)  # (nk, R)
                    growth = t if fused else t - m_r
                    grow = (growth > threshold) | (unset_r & (t > -np.inf))
                if grow is not None and grow.any():
                    m_new = np.where(grow, m_r + t if fused else t, m_r).astype(dtype, copy=False)  # (nk, R)
                    alpha = exp.fast(np.where(unset_r, 0, m_r - m_new)).astype(dtype, copy=False)  # 1 if unset
                    l[:, r] *= alpha
                    sums.acc[:, r] *= alpha[..., None]
                    if fused:
                        s -= (m_new - m_r)[..., None]
                        qa[:, r, H] = -m_new
                    m_r[...] = m_new
                    unset_r &= ~grow
                    span_unset = bool(unset_r.any())
                    m_min, m_max = float(m.min()), float(m.max())
                # Unfused, m stays an exact score (or 0), so the backward's S - lse matches.
                if not fused and not (m_min == 0.0 == m_max):
                    s -= m_r[..., None]
                # P~_ij, never subnormal: the plain exp where no entry can underflow
                if exp_then_hide:
                    exp.fast(s, out=s)
                    item.fill_hidden(s, span, 0)
                elif not span_unset and not span[4] and low + m_max < -exp.floor:  # after the row max
                    exp.fast(s, out=s)
                else:
                    exp.flushed(s)
                sums.add(s, r, self.ones_k[: c1 - c0], values[:, c0:c1], item.dropout_scale(*span[:4]))
                if provisional is not None:
                    unset_r |= provisional & (l[:, r] == 0)
                any_unset = any_unset and bool(unset.any())
        return m

    def _finish(self, item: _Item, q0: int, q1: int, sums: _Sums, m: Any | None) -> None:
        """``O = acc / l`` (0 where ``l = 0``), and the rows' ``l`` and ``m``
        for :meth:`lse`, written head-major."""
        tq, G, nk, heads, l = q1 - q0, self.G, item.nk, item.head_slice, sums.l
        self.row_l[item.b, heads, q0:q1] = _head_major(l, tq, G, nk)  # (nk*G, tq)
        if m is not None:
            self.row_m[item.b, heads, q0:q1] = _head_major(m, tq, G, nk)
        # A row with l > 0 has l >= 2**-bound (its largest P~; 1 with a running
        # maximum; P~ is never subnormal), far above tiny: only rows with l = 0
        # move, and their acc = 0 divides to 0 as before.
        np.maximum(l, np.finfo(self.dtype).tiny, out=l)
        np.divide(
            _head_major(sums.acc, tq, G, nk), _head_major(l, tq, G, nk)[..., None], out=self.out[item.b, heads, q0:q1]
        )  # (nk*G, tq, Hv) / (nk*G, tq, 1)

    def lse(self) -> Any:
        """``lse = (m + log_b l) / b`` in nats over every row (``m = 0`` at
        the zero reference; -inf where ``l = 0``), summed in float64 and
        rounded once: one pass after the items rather than one per item."""
        l64 = self.row_l.astype(np.float64)  # (B, N, T)
        empty = l64 == 0
        l64[empty] = 1
        m64 = self.row_m.astype(np.float64)
        lse = ((m64 + np.log2(l64)) / self.b_eff if self.mode.base2 else m64 + np.log(l64)).astype(self.dtype)
        lse[empty] = -np.inf
        return lse


class _Sums:
    """A forward item's running sums, ``l = rowsum(P~)`` ``(nk, rows)`` and
    ``acc = P~ V`` ``(nk, rows, Hv)``, with the buffers of their products.

    An item whose one span covers all its rows (``single_span``: a whole
    tile at the zero reference, as every item of full attention up to
    T=S=512) has its products write ``l`` and ``acc`` directly, with no
    zeroed buffers to add them to: 0.97x the forward's time at B=32, N=8,
    T=S=128 and 0.93x at B=16, N=12, T=S=64 (1.00x at B=8, N=8, T=S=256;
    one process, interleaved, 2 cores). The same numbers but for the sign
    of a zero (``0 + (-0) = +0``)."""

    def __init__(self, nk: int, rows: int, Hv: int, dtype: Any, *, single_span: bool = False):
        self.single_span = single_span
        make = np.empty if single_span else np.zeros
        self.l = make((nk, rows), dtype=dtype)
        self.acc = make((nk, rows, Hv), dtype=dtype)
        if not single_span:
            self.row_sum_flat = np.empty(nk * rows, dtype=dtype)
            self.pv_flat = np.empty(nk * rows * Hv, dtype=dtype)

    def add(self, p: Any, r: slice, ones: Any, v_rows: Any, drop: Any | None) -> None:
        """``l[:, r] += rowsum(P~)`` and ``acc[:, r] += Pd~ V`` for ``P~ = p
        (nk, R, tk)`` and the span's ``V (nk, tk, Hv)`` (``=`` for the single
        span); with dropout (``drop``, ``keep / (1 - p)``), ``Pd~ = P~ *
        drop`` overwrites ``p``."""
        nk, R, _ = p.shape
        single = self.single_span
        row_sum = self.l if single else _buffer(self.row_sum_flat, nk, R)
        np.matmul(p, ones, out=row_sum)  # (nk, R, tk) @ (tk,): a GEMV, 4x faster than p.sum(axis=-1)
        if not single:
            self.l[:, r] += row_sum
        if drop is not None:
            p *= drop
        pv = self.acc if single else _buffer(self.pv_flat, nk, R, v_rows.shape[-1])
        blas_numpy.matmul(p, v_rows, out=pv)  # (nk, R, tk) @ (nk, tk, Hv) -> (nk, R, Hv)
        if not single:
            self.acc[:, r] += pv


# --- backward ---------------------------------------------------------------------------


def backward(
    spec: AttentionSpec, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dlse: Any | None
) -> tuple[Any, Any, Any, Any | None, dict[str, Any]]:
    """FlashAttention-2 backward; same contract as :func:`npattn.chunked.chunked_backward`.

    When fused (see the module docstring), the two per-row subtractions ride
    inside matrix products, as in the forward::

        P_ij          = exp([Q_i, -lse_i] @ [scale K_j^T; 1])
        dP_ij - D_i   = [dO_i, -D_i] @ [V_j^T; 1]          (without dropout)

    then ``dS = P * (dP - D)``, ``dV_j += Pd^T dO_i``, ``dQ_i += dS K_j``,
    ``dK_j += dS^T (scale Q_i)``, span by span of each tile (:func:`plan_tile`).
    With dropout, ``dP`` is scaled by ``keep / (1 - p)`` before ``D`` is
    subtracted.
    """
    folded = _batch_as_heads(spec, q, k, v, out, dout)
    if folded is not None:
        dq, dk, dv, _, params = backward(folded, q, k, v, out, lse, dout, dlse)  # (B*N|B*K, ...): no dbias
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), None, params
    parts = _head_parts(spec)
    if len(parts) > 1:
        return _backward_in_head_parts(spec, parts, q, k, v, out, lse, dout, dlse)
    call = _backward_call(spec, q, k, v, out, lse, dout, dlse)
    run_items(call.items, call.work, parallel=call.parallel)
    return call.finish()


class _BackwardCall(NamedTuple):
    """One backward call, ready to run: ``work(item)`` for each of
    ``items`` (on the pool where ``parallel``), then ``finish()`` returns
    :func:`backward`'s result."""

    items: list[tuple[int, int]]
    work: Callable[[tuple[int, int]], None]
    parallel: bool
    finish: Callable[[], tuple[Any, Any, Any, Any | None, dict[str, Any]]]


def _backward_call(
    spec: AttentionSpec,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    dlse: Any | None,
    mode: _Mode | None = None,
) -> _BackwardCall:
    """The items of :func:`backward`, one per (batch element, group of kv
    heads), and the work they do (see :func:`backward`). ``mode``: the
    whole call's, where this is a part of its query heads
    (:func:`_backward_in_head_parts`); else decided here."""
    dtype = spec.compute_dtype
    Bf, N, K, G = spec.num_batch, spec.num_heads, spec.num_kv_heads, spec.group_size
    T, S, H, Hv = spec.q_len, spec.kv_len, spec.head_dim, spec.value_dim
    q3 = np.reshape(q, (Bf, N, T, H))  # (B, N, T, H)
    k3 = np.reshape(k, (Bf, K, S, H))  # (B, K, S, H)
    v3 = np.reshape(v, (Bf, K, S, Hv))  # (B, K, S, Hv)
    q_norms3, k_norms = _row_norms(q3), _row_norms(k3)  # (B, N, T), (B, K, S): for the flush bound
    mode = _Mode(spec, q_norms3, k_norms) if mode is None else mode
    fused = mode.fused
    do3 = np.reshape(dout, (Bf, N, T, Hv))  # (B, N, T, Hv)
    D = np.vecdot(do3, np.reshape(out, (Bf, N, T, Hv)))  # (B, N, T): rowsum(dO * O)
    if dlse is not None:
        D -= np.reshape(dlse, (Bf, N, T))
    lse3 = np.reshape(lse, (Bf, N, T))
    lse3 = np.where(lse3 == -np.inf, 0, lse3).astype(dtype, copy=False)  # masked rows: S = -inf gives P = 0
    # Not zero-filled: every (b, kv) item runs, even one that sees no key, and
    # writes all of its slices of dq, dk and dv. Skipping items would need zeros.
    dq = np.empty((Bf, N, T, H), dtype=dtype)
    dk = np.empty((Bf, K, S, H), dtype=dtype)
    dv = np.empty((Bf, K, S, Hv), dtype=dtype)
    dbias = None if spec.bias is None else np.zeros(spec.bias.shape, dtype=dtype)  # full-rank view shape
    block_q, block_k = _blocks(spec)
    q_tiles, k_tiles = tile_ranges(T, block_q), tile_ranges(S, block_k)
    plans_by_batch = _batch_plans(spec, q_tiles, k_tiles)  # [b][qi][kj]
    base = mode.base  # as in the forward
    exp = _Exp(mode.base2, dtype)
    scale = dtype.type(spec.scale)
    base_scale, b_eff = _base_scale(spec, mode)  # the forward's own scale and base of the scores
    # c on the side the forward put it; dK = scale dR^T Q, from dR^T Q or dR^T (c Q)
    q_factor, k_factor = _factor_sides(base_scale)
    dk_factor = dtype.type(spec.scale if q_factor is None else spec.scale / float(base_scale))
    one = dtype.type(1)
    fold_D = mode.base2 and spec.dropout_p == 0
    span_size = G * _largest_span(plans_by_batch)  # one kv head's largest span of scores
    groups = _kv_groups(spec, span_size, 1)  # an item: (batch element, group of kv heads), every query
    # Each item writes the slope gradients of its own heads: summed in a fixed order.
    alibi_grads = None if spec.alibi_slopes is None else np.zeros((Bf, N), dtype=dtype)
    mod_grads: list[dict[str, Any]] = [{} for _ in range(Bf * len(groups))]  # per item, summed in item order below
    alibi_memo: dict = {}  # ALiBi's span terms, shared by the items (_Item._diagonals)

    def work(job):
        b, g = job
        item = _Item(spec, b, groups[g], mode, alibi_memo)
        item.keep_inputs = True
        plans = plans_by_batch[b]
        heads, kvs, nk = item.head_slice, item.kv_slice, item.nk
        # The item's query side, all T positions stacked position-major: row t*G + g' per kv head.
        lse_b = _position_major(lse3[b, heads], nk)  # (nk, T*G)
        D_b = _position_major(D[b, heads], nk)  # (nk, T*G)
        lse_shift = _lse_in_base(lse_b, b_eff, mode, dtype)  # (nk, T*G)
        qa = _augmented_rows(q3[b, heads], -lse_shift if fused else 0, q_factor, dtype, nk)  # (nk, T*G, H+1)
        doa = _augmented_rows(do3[b, heads], -D_b if fold_D else 0, one, dtype, nk)  # (nk, T*G, Hv+1)
        q_b, do_b = qa[..., :H], doa[..., :Hv]  # (nk, T*G, H) Q (or c Q), (nk, T*G, Hv) dO: views
        alibi_g = np.zeros(nk * G, dtype=dtype)  # this item's slope gradients, base-scaled
        kTa = _augmented_transposed(k3[b, kvs], dtype, scale=k_factor)  # (nk, H+1, S), built here, in parallel
        vTa = _augmented_transposed(v3[b, kvs], dtype)  # (nk, Hv+1, S)
        # One span over every row and key (a whole tile, a short causal call's one
        # tile): its products write dQ, dK and dV, with no zeroed buffers to add to.
        direct = _one_backward_span(plans, k_tiles, T, G) and item.slope_min is None  # ALiBi may skip it (below_floor)
        dq_b = (np.empty if direct else np.zeros)((nk, T * G, H), dtype=dtype)
        # S_ij - lse_i >= -|base scale q_i| max_j |k_j| - lse_i (the forward's bound), per query tile
        q_norms = _position_major(q_norms3[b, heads], nk) * abs(scale * base)  # (nk, T*G) |base scale q_i|
        bounds = [
            (
                float(q_norms[:, q0 * G : q1 * G].max()) if mode.upper and q1 > q0 and G else 0.0,
                base * float(lse_b[:, q0 * G : q1 * G].min()) if q1 > q0 and G else 0.0,
                base * float(lse_b[:, q0 * G : q1 * G].max()) if q1 > q0 and G else 0.0,
            )
            for q0, q1 in q_tiles
        ]
        k_norm_max = _RangeMax(k_norms[b, kvs])  # read only when upper
        s_flat = np.empty(nk * span_size, dtype=dtype)  # scores, then P, of one span
        dp_flat = np.empty_like(s_flat)  # dP - D, then dS, of one span
        tanh_flat = None if spec.softcap is None else np.empty_like(s_flat)  # tanh(s / c) of one span
        dk_j, dv_j = np.empty((nk, block_k, H), dtype=dtype), np.empty((nk, block_k, Hv), dtype=dtype)
        dk_tmp, dv_tmp = np.empty_like(dk_j), np.empty_like(dv_j)
        dq_tmp = np.empty((nk, G * block_q, H), dtype=dtype)
        # Key tiles outside, query tiles inside (FlashAttention-2's order): dK_j and
        # dV_j accumulate in small buffers that stay in cache, written out once.
        # The query tiles and spans run last first: a causal mask's largest P_ij
        # are on the diagonal, then added last (see _add_row_products).
        for kj, (k0, k1) in enumerate(k_tiles):
            if not direct:
                dk_j[:] = 0
                dv_j[:] = 0
            for plan, (q_norm_max, lse_min, lse_max) in reversed(list(zip((row[kj] for row in plans), bounds))):
                for span in reversed(plan):
                    r, (c0, c1) = _rows(span, 0, G), span[2:4]
                    R, tk, cols = r.stop - r.start, c1 - c0, slice(c0 - k0, c1 - k0)
                    # As in the forward: where ALiBi takes every S_ij - lse_i of the span
                    # below the floor, P_ij (flushed) and so dS_ij are 0 throughout: skip.
                    row_bounds = q_norms[:, r] * k_norm_max[c0, c1] - lse_shift[:, r]
                    if mode.upper and item.below_floor(row_bounds, span, exp.floor):
                        continue
                    p = _buffer(s_flat, nk, R, tk)  # (nk, R, tk)
                    # As in the forward: when every S_ij - lse_i of the span lies above
                    # the floor, and the hidden ones (which lse_i does not bound, as it
                    # does the visible ones) also below -floor, the plain exp runs on all
                    # of them and the hidden entries are zeroed after it.
                    # The lower bound (-low, ALiBi's reach below the raw one) is needed for
                    # every entry, the upper one for the hidden.
                    bound = min(q_norm_max * k_norm_max[c0, c1], mode.cap) if mode.upper else np.inf
                    low = bound + item.alibi_reach(span)
                    exp_then_hide = low + lse_max < -exp.floor and (not span[4] or bound - lse_min < -exp.floor)
                    t = None if tanh_flat is None else _buffer(tanh_flat, nk, R, tk)
                    inputs = item.scores(p, qa[:, r], kTa, span, hide=not exp_then_hide, tanh=t)  # S_ij [- lse_i]
                    if not fused:
                        p -= lse_shift[:, r, None]
                    if exp_then_hide:
                        exp.fast(p, out=p)  # P_ij
                        item.fill_hidden(p, span, 0)
                    else:
                        exp.flushed(p)
                    drop = item.dropout_scale(*span[:4])
                    p_dropped = p if drop is None else p * drop
                    partial = bool(span[4])  # some entries hidden: a diagonal, an edge
                    if direct:  # (nk, tk, R) @ (nk, R, Hv) -> (nk, tk, Hv)
                        blas_numpy.matmul(np.swapaxes(p_dropped, -1, -2), do_b[:, r], out=dv_j[:, cols])
                    else:
                        _add_row_products(dv_j[:, cols], p_dropped, do_b[:, r], dv_tmp[:, :tk], partial, G)
                    ds = _buffer(dp_flat, nk, R, tk)
                    blas_numpy.matmul(doa[:, r], vTa[..., c0:c1], out=ds)  # (nk, R, Hv+1) @ (nk, Hv+1, tk) -> dP [- D]
                    if drop is not None:
                        ds *= drop
                    if not fold_D:
                        ds -= D_b[:, r, None]
                    ds *= p  # dS_ij = P_ij * (dP_ij - D_i)
                    if inputs is not None:  # dS3_ij: through the score modifications
                        item.modify_backward(ds, inputs, *span[:2])
                    if dbias is not None:
                        item.add_dbias(dbias, ds, *span[:4])
                    if alibi_grads is not None:
                        alibi_g += item.alibi_grad(ds, *span[:4])
                    if t is not None:  # dR_ij: through the softcap (the pipeline's derivative)
                        softcap_backward_inplace(np, t, ds)
                    if direct:  # (nk, R, tk) @ (nk, tk, H) -> (nk, R, H); (nk, tk, R) @ (nk, R, H) -> (nk, tk, H)
                        blas_numpy.matmul(ds, k3[b, kvs, c0:c1], out=dq_b[:, r])
                        blas_numpy.matmul(np.swapaxes(ds, -1, -2), q_b[:, r], out=dk_j[:, cols])
                    else:
                        # (nk, R, tk) @ (nk, tk, H) -> (nk, R, H)
                        blas_numpy.matmul(ds, k3[b, kvs, c0:c1], out=dq_tmp[:, :R])
                        dq_b[:, r] += dq_tmp[:, :R]
                        _add_row_products(dk_j[:, cols], ds, q_b[:, r], dk_tmp[:, :tk], partial, G)  # (nk, tk, H)
            dk_j *= dk_factor
            dk[b, kvs, k0:k1] = dk_j[:, : k1 - k0]
            dv[b, kvs, k0:k1] = dv_j[:, : k1 - k0]
        dq_b *= scale
        dq[b, heads] = _head_major(dq_b, T, G, nk)  # (nk*G, T, H)
        if alibi_grads is not None:
            alibi_grads[b, heads] = alibi_g / dtype.type(base)  # the distances carried the base
        mod_grads[b * len(groups) + g] = item.mod_grads

    def finish() -> tuple[Any, Any, Any, Any | None, dict[str, Any]]:
        bs = spec.batch_shape
        grads = dq.reshape(bs + (N, T, H)), dk.reshape(bs + (K, S, H)), dv.reshape(bs + (K, S, Hv))
        alibi_total = None if alibi_grads is None else alibi_grads.reshape(bs + (N,))
        mods_total: dict[str, Any] = {}
        for shares in mod_grads:  # a fixed order, whatever the thread count
            for name, share in shares.items():
                mods_total[name] = share if name not in mods_total else mods_total[name] + share
        params = param_grads_from_heads(spec, alibi_total, mods_total)  # {"alibi_slopes": ..., "mods": ...} or {}
        return (*grads, None if dbias is None else dbias.reshape(spec.bias_shape), params)

    items = [(b, g) for b in range(Bf) for g in range(len(groups))]
    return _BackwardCall(items, work, dbias is None, finish)


def _head_parts(spec: AttentionSpec) -> list[tuple[int, int]]:
    """The backward's parts of each kv head's ``G`` query heads, ``[(a, b),
    ...]`` (``[(0, G)]``: one part). Where the batch elements times kv heads
    are fewer than :data:`GROUP_MIN_ITEMS`, as with MQA or GQA at B=1, the
    (batch element, kv head) items would leave threads idle: then each kv
    head's query heads split into enough parts (at most ``G``), each part an
    item with its own ``dK`` and ``dV`` share, summed in part order
    (:func:`_backward_in_head_parts`).
    From the shapes alone, so the same bits on any thread count; not where
    an option tells query heads apart (a mask, bias, ALiBi, score
    modifications, dropout), which the parts' narrower spec would misread.
    Before, MQA's one item ran alone, its products on BLAS's threads and
    every other pass on one core: B=1, N=8 on K=1, T=S=2048, 2 cores,
    float32, forward+backward 0.79x the time with 4 parts
    (``bench_workloads.py --more``); N=8 on K=2, T=S=4096 causal, 2 parts,
    1.01x. A power of two of parts (:func:`~npattn.threads.power_of_two_at_most`),
    so that two threads share them evenly: N=6 on K=1, T=S=2048 and N=12
    on 1, T=S=1024 made 3 parts, whose backward took 1.25-1.31x the time
    of 2 (causal or not, 2 cores, float32)."""
    G, items = spec.group_size, spec.num_batch * spec.num_kv_heads
    scores = spec.num_batch * spec.num_heads * spec.q_len * spec.kv_len
    count = min(G // PART_MIN_HEADS, -(-GROUP_MIN_ITEMS // max(items, 1)), scores // PART_MIN_SCORES)
    if count < 2 or _tells_heads_apart(spec):  # count < 2 also where the items are enough
        return [(0, G)]
    count = power_of_two_at_most(count)
    return [(G * i // count, G * (i + 1) // count) for i in range(count)]


#: :func:`_head_parts` keeps at least this many query heads per part (MQA,
#: N=8, T=S=1024: eight parts of one head took 1.16-1.47x one part's time) ...
PART_MIN_HEADS = 2

#: ... and this many scores ``B N T S / parts`` in each (MQA, N=8: at
#: T=S=256 eight parts took 2.3x one part's time, at T=S=1024 four parts of
#: 2**21 scores 1.09x; N=8 on K=4, T=S=512 causal, two parts 1.18x).
PART_MIN_SCORES = 2**22


def _query_heads(spec: AttentionSpec, x: Any | None, part: tuple[int, int], rows: bool) -> Any | None:
    """``x``'s query heads ``k G + a .. k G + b - 1`` of every kv head ``k``,
    ``part = (a, b)``: ``(..., N, T, D) -> (..., K*(b - a), T, D)`` (``rows``),
    else ``(..., N, T) -> (..., K*(b - a), T)``, a copy; None stays None."""
    if x is None:
        return None
    a, b = part
    K, G, T = spec.num_kv_heads, spec.group_size, spec.q_len
    tail = (T, x.shape[-1]) if rows else (T,)
    by_kv = np.reshape(x, (spec.num_batch, K, G) + tail)  # (B, K, G, T[, D]), B: the batch axes flattened
    return np.reshape(by_kv[:, :, a:b], spec.batch_shape + (K * (b - a),) + tail)


def _backward_in_head_parts(
    spec: AttentionSpec,
    parts: list[tuple[int, int]],
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    dlse: Any | None,
) -> tuple[Any, Any, Any, None, dict[str, Any]]:
    """:func:`backward` as one call per part of each kv head's query heads
    (:func:`_head_parts`), whose items share one run of the pool: each part
    writes its heads' ``dQ`` and its own share of ``dK`` and ``dV``, summed
    in part order. Every part computes its scores in the whole call's
    :class:`_Mode`, which the forward decided from every query head: a part's
    own bound, from its heads alone, could pick base 2 or the fused shifts
    where the forward did not."""
    Bf, K, G, T, H = spec.num_batch, spec.num_kv_heads, spec.group_size, spec.q_len, spec.head_dim
    mode = _Mode.of_inputs(spec, q, k)
    calls = []
    for part in parts:
        sub = spec.replace(num_heads=K * (part[1] - part[0]))  # the part's own call: b - a query heads per kv head
        q_p, out_p, dout_p = (_query_heads(spec, x, part, rows=True) for x in (q, out, dout))
        lse_p, dlse_p = (_query_heads(spec, x, part, rows=False) for x in (lse, dlse))
        calls.append(_backward_call(sub, q_p, k, v, out_p, lse_p, dout_p, dlse_p, mode))
    jobs = [(i, item) for i, call in enumerate(calls) for item in call.items]
    run_items(jobs, lambda job: calls[job[0]].work(job[1]))
    dq = np.empty((Bf, K, G, T, H), dtype=spec.compute_dtype)
    shares = []
    for (a, b), call in zip(parts, calls):
        dq_part, dk_part, dv_part, _, _ = call.finish()  # (..., K*(b - a), T, H), (..., K, S, H), (..., K, S, Hv)
        dq[:, :, a:b] = np.reshape(dq_part, (Bf, K, b - a, T, H))
        shares.append((dk_part, dv_part))
    dk, dv = shares[0]
    for dk_part, dv_part in shares[1:]:  # in part order, whatever the thread count
        dk += dk_part
        dv += dv_part
    return np.reshape(dq, q.shape), np.reshape(dk, k.shape), np.reshape(dv, v.shape), None, {}
