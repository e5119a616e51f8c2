"""An independent, deliberately plain float64 oracle for masked attention.

It shares no code with npattn: every query row of every batch element and
head is handled by an explicit Python loop, positions and visibility are
decided element by element from CONVENTIONS §1, and the softmax is written
out. Slow, obvious, and only for small shapes.

The variants of issue 14 follow the score pipeline of CONVENTIONS §1b, one
scalar at a time: the softcap ``c tanh(s / c)`` of the raw score, then the
bias and ALiBi's ``-slope_n |p_i - j|``, then visibility (segment ids: equal
ids only), then the sink: one more term ``exp(sinks_n)`` in the row's
normalizer, present on every row that is not padding, with value 0.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def dropout_keep_reference(seed: int, p: float, batch: int, head: int, i: int, j: int) -> bool:
    """The keep decision of CONVENTIONS §1, in pure Python integers."""
    M = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x846CA68B) & M
        return x ^ (x >> 16)

    h = mix((seed & M) ^ mix((seed >> 32) & M))
    for index in (batch, head, i, j):
        h = mix(h ^ index)
    return h >= min(round(p * 2**32), 2**32)


def reference_attention(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    causal=False,
    window=None,
    align=None,
    q_lengths=None,
    kv_lengths=None,
    scale=None,
    dropout_p=0.0,
    seed=None,
    softcap=None,
    alibi_slopes=None,
    sinks=None,
    q_segment_ids=None,
    kv_segment_ids=None,
):
    """Return ``(out, lse, probs)`` as float64 NumPy arrays.

    ``probs`` are the probabilities of the real keys (the sink's share
    removed from each row, so a row sums to ``1 - exp(sinks_n - lse_i)``).
    """
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    *batch_shape, N, T, H = q.shape
    K, S = k.shape[-3], k.shape[-2]
    Hv = v.shape[-1]
    G = N // K
    scale = 1 / math.sqrt(H) if scale is None else scale
    full = (*batch_shape, N, T, S)
    mask = np.broadcast_to(mask, full) if mask is not None else np.ones(full, bool)
    bias = np.broadcast_to(np.asarray(bias, np.float64), full) if bias is not None else np.zeros(full)
    heads = (*batch_shape, N)
    slopes = np.broadcast_to(np.asarray(alibi_slopes, np.float64), heads) if alibi_slopes is not None else None
    sink = np.broadcast_to(np.asarray(sinks, np.float64), heads) if sinks is not None else None
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    if align is None:
        align = "top_left"
    out = np.zeros((*batch_shape, N, T, Hv))
    lse = np.full((*batch_shape, N, T), -np.inf)
    probs = np.zeros(full)
    for flat, b in enumerate(itertools.product(*[range(n) for n in batch_shape])):
        t_valid = T if q_lengths is None else int(np.asarray(q_lengths)[b])
        s_valid = S if kv_lengths is None else int(np.asarray(kv_lengths)[b])
        offset = 0 if align == "top_left" else s_valid - t_valid
        for n in range(N):
            for i in range(T):
                position = i + offset
                scores, visible = [], []
                for j in range(S):
                    ok = bool(mask[b + (n, i, j)]) and i < t_valid and j < s_valid
                    if left is not None:
                        ok = ok and j >= position - left
                    if right is not None:
                        ok = ok and j <= position + right
                    if q_segment_ids is not None:
                        ok = ok and int(np.asarray(q_segment_ids)[b + (i,)]) == int(
                            np.asarray(kv_segment_ids)[b + (j,)]
                        )
                    score = scale * float(q[b + (n, i)] @ k[b + (n // G, j)])
                    if softcap is not None:
                        score = softcap * math.tanh(score / softcap)
                    score += bias[b + (n, i, j)]
                    if slopes is not None:
                        score -= float(slopes[b + (n,)]) * abs(position - j)
                    ok = ok and score != -np.inf
                    scores.append(score)
                    visible.append(ok)
                # The sink: one virtual key of value 0 on every row that is not padding.
                sink_score = float(sink[b + (n,)]) if sink is not None and i < t_valid else None
                if not any(visible):
                    if sink_score is not None:
                        lse[b + (n, i)] = sink_score  # only the sink: out 0, probs 0
                    continue  # fully masked row: out 0, lse -inf, probs 0
                m = max(s for s, ok in zip(scores, visible) if ok)
                if sink_score is not None:
                    m = max(m, sink_score)
                weights = [math.exp(s - m) if ok else 0.0 for s, ok in zip(scores, visible)]
                total = sum(weights) + (math.exp(sink_score - m) if sink_score is not None else 0.0)
                lse[b + (n, i)] = m + math.log(total)
                for j in range(S):
                    p = weights[j] / total
                    probs[b + (n, i, j)] = p
                    if dropout_p > 0:
                        keep = dropout_keep_reference(seed, dropout_p, flat, n, i, j)
                        p = p / (1 - dropout_p) if keep else 0.0
                    out[b + (n, i)] += p * v[b + (n // G, j)]
    return out, lse, probs
