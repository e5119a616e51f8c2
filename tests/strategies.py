"""Hypothesis strategies for attention problems: shapes, masks and options.

``attention_cases()`` draws an :class:`AttentionCase`: float64 NumPy inputs
plus a dict of keyword options covering every mask feature of CONVENTIONS §1
(bool mask, bias with ``-inf`` entries, causal, window, both alignments,
lengths, GQA/MQA, dropout) and their combinations. On request it also draws
empty sizes (T=0, a batch axis of 0) and masks with a fully masked row, and
the score-pipeline variants of issue 14 (:data:`VARIANTS`: softcap, ALiBi,
sinks, segment ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

#: Every feature :func:`attention_cases` draws by default.
FEATURES = ("mask", "bias", "causal", "window", "lengths", "dropout")

#: The score-pipeline variants (CONVENTIONS §1b), drawn on request:
#: ``features=ALL_FEATURES`` or ``FEATURES + ("sinks",)``.
VARIANTS = ("softcap", "alibi", "sinks", "segments")

#: Every mask feature and every variant.
ALL_FEATURES = FEATURES + VARIANTS


@dataclass
class AttentionCase:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    options: dict = field(default_factory=dict)

    @property
    def arrays(self):
        return self.q, self.k, self.v

    def __repr__(self) -> str:
        opts = {key: (f"array{np.shape(val)}" if hasattr(val, "shape") else val) for key, val in self.options.items()}
        return f"AttentionCase(q{self.q.shape}, k{self.k.shape}, v{self.v.shape}, {opts})"


def _segment_ids(draw, rng, batch_shape, T, S):
    """``(q_segment_ids (..., T), kv_segment_ids (..., S))``: usually sorted
    ids of packed documents (each document's queries and keys contiguous),
    sometimes unsorted ids, sometimes with ids of one side the other never has."""
    kind = draw(st.sampled_from(["packed", "packed", "unsorted", "disjoint"]))
    docs = draw(st.integers(1, 3))
    if kind == "unsorted":
        return rng.integers(0, docs, size=(*batch_shape, T)), rng.integers(0, docs, size=(*batch_shape, S))
    q_ids = np.sort(rng.integers(0, docs, size=(*batch_shape, T)), axis=-1)
    kv_ids = np.sort(rng.integers(0, docs, size=(*batch_shape, S)), axis=-1)
    if kind == "disjoint":
        kv_ids = kv_ids + 1  # queries of document 0 see no key at all
    return q_ids, kv_ids


def _per_head(draw, rng, heads, kinds):
    """A per-head float parameter (sinks, ALiBi slopes): shape (N,), or one
    that broadcasts to ``heads`` (..., N)."""
    shape = heads[-1:] if draw(st.booleans()) else _broadcast_shape(draw, heads + (1,))[:-1] or heads[-1:]
    kind = draw(kinds)
    if kind == "very negative":
        return rng.uniform(-60.0, -20.0, size=shape)  # the sink holds next to nothing
    if kind == "very positive":
        return rng.uniform(20.0, 60.0, size=shape)  # the sink takes almost every row
    if kind == "positive":
        return rng.uniform(0.0, 1.0, size=shape)  # ALiBi's own slopes are in (0, 1]
    return rng.standard_normal(shape)


def _broadcast_shape(draw, full):
    """A shape that broadcasts to ``full``: some leading axes dropped, some axes set to 1."""
    drop = draw(st.integers(0, len(full) - 2))
    return tuple(n if draw(st.booleans()) else 1 for n in full[drop:])


@st.composite
def attention_cases(draw, *, max_len=6, features=FEATURES, min_batch_ndim=0, empty_sizes=False, kv_heads=(1, 2)):
    """``features`` may also hold ``"masked_row"``: a drawn mask then sometimes
    hides one query row entirely, and the :data:`VARIANTS`. ``empty_sizes``:
    T=0 and a batch axis of 0 are drawn too. ``kv_heads``: the numbers of kv
    heads K to draw from."""
    batch_shape = tuple(draw(st.lists(st.integers(1, 2), min_size=min_batch_ndim, max_size=2)))
    if empty_sizes and draw(st.integers(0, 6)) == 0:
        batch_shape = (0,) + batch_shape[1:]
    K = draw(st.sampled_from(list(kv_heads)))
    N = K * draw(st.sampled_from([1, 2, 3]))  # G = 1 (MHA), 2, 3 (GQA); K = 1 is MQA
    T = draw(st.integers(0 if empty_sizes else 1, max_len))
    S = draw(st.integers(1, max_len + 1))
    H = draw(st.integers(1, 4))
    Hv = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((*batch_shape, N, T, H))
    k = rng.standard_normal((*batch_shape, K, S, H))
    v = rng.standard_normal((*batch_shape, K, S, Hv))
    full = (*batch_shape, N, T, S)
    options: dict = {}
    if "mask" in features and draw(st.booleans()):
        mask = rng.random(_broadcast_shape(draw, full)) < 0.7
        if "masked_row" in features and mask.shape[-2] == T and T and draw(st.booleans()):
            mask[..., rng.integers(T), :] = False  # a fully masked row
        options["mask"] = mask
    if "bias" in features and draw(st.booleans()):
        bias = rng.standard_normal(_broadcast_shape(draw, full))
        if draw(st.booleans()):
            bias = np.where(rng.random(bias.shape) < 0.15, -np.inf, bias)
        options["bias"] = bias
    if "softcap" in features and draw(st.booleans()):
        options["softcap"] = draw(st.sampled_from([0.05, 0.5, 1.0, 5.0, 30.0]))  # tiny ones saturate every score
    if "segments" in features and draw(st.booleans()):
        options["q_segment_ids"], options["kv_segment_ids"] = _segment_ids(draw, rng, batch_shape, T, S)
    heads = (*batch_shape, N)
    if "sinks" in features and draw(st.booleans()):
        options["sinks"] = _per_head(draw, rng, heads, st.sampled_from(["normal", "very negative", "very positive"]))
    positional = False
    if "alibi" in features and draw(st.booleans()):
        options["alibi_slopes"] = _per_head(draw, rng, heads, st.sampled_from(["positive", "normal"]))
        positional = True  # ALiBi reads positions: T != S needs an explicit align
    if "causal" in features and draw(st.booleans()):
        options["causal"] = True
        positional = True
    if "window" in features and draw(st.booleans()):
        side = st.one_of(st.none(), st.integers(0, max_len))
        right = st.sampled_from([None, 0]) if options.get("causal") else side  # causal means right = 0
        options["window"] = (draw(side), draw(right))
        positional = True
    if positional and (T != S or draw(st.booleans())):
        options["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    if "lengths" in features and draw(st.booleans()):
        if draw(st.booleans()):
            options["q_lengths"] = rng.integers(0, T + 1, size=batch_shape)
        if draw(st.booleans()):
            options["kv_lengths"] = rng.integers(0, S + 1, size=batch_shape)
    if "dropout" in features and draw(st.booleans()):
        options["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
        options["seed"] = draw(st.integers(0, 2**40))
    if draw(st.booleans()):
        options["scale"] = draw(st.sampled_from([0.3, 1.0, 2.5]))
    return AttentionCase(q, k, v, options)
