"""Attention diagnostics and per-head heatmaps on a sequence with known structure.

    python examples/attention_maps.py --out maps/           # 17 tokens
    python examples/attention_maps.py --quick --out maps/   # 7 tokens (used by the tests)

Four query heads share one key/value head (MQA). Keys carry a one-hot
position and a one-hot token id; each head's queries are built to look for
one thing, so we know what the maps should show:

    head 0  previous token   q_i = c * onehot_pos(i - 1)
    head 1  first token      q_i = c * onehot_pos(0)        (an "attention sink")
    head 2  content match    q_i = c * onehot_tok(token_i)  (earlier copies of itself)
    head 3  uniform          q_i = 0                         (averages what it sees)

The attention is causal. Batch element 1 is the same sentence with its last
three positions padded (``q_lengths``, ``kv_lengths``), so its last rows are
fully masked. The script prints ``npattn.diagnostics.summarize`` (row sums,
NaN/inf, entropy and peak per head), a NaN/inf report of the outputs and
gradients, then shows the row-sum check catching two classic bugs, and writes
one heatmap PNG per batch element to ``--out`` (needs ``npattn[plot]``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

import npattn
from npattn import diagnostics

SENTENCE = [
    "<s>",
    "the",
    "cat",
    "sat",
    "on",
    "the",
    "mat",
    "because",
    "the",
    "cat",
    "was",
    "tired",
    "and",
    "the",
    "mat",
    "was",
    "warm",
]
HEADS = ("previous token", "first token", "content match", "uniform")


def build_qkv(tokens: list[str], c: float = 12.0, seed: int = 0):
    """``q (1, 4, T, P+V)``, ``k (1, 1, T, P+V)``, ``v (1, 1, T, 8)`` with the structure above."""
    T = len(tokens)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    pos = np.eye(T)  # (T, P) with P = T
    tok = np.eye(len(vocab))[[vocab[t] for t in tokens]]  # (T, V)
    k = np.concatenate([pos, tok], axis=1)  # (T, P+V)
    q = np.zeros((len(HEADS), T, k.shape[1]))  # (4, T, P+V)
    q[0, 1:, :T] = c * pos[:-1]  # head 0: position i - 1
    q[1, :, 0] = c  # head 1: position 0
    q[2, :, T:] = c * tok  # head 2: the same token id
    v = np.random.default_rng(seed).standard_normal((1, 1, T, 8))  # (1, 1, S, Hv)
    return q[None], k[None, None], v  # (1, 4, T, P+V), (1, 1, S, P+V), (1, 1, S, Hv)


def _softmax(s, axis):
    e = np.exp(s - np.max(s, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 7-token sentence, for a fast check")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("attention_maps"),
        help="directory for the PNGs (created if missing)",
    )
    args = parser.parse_args(argv)
    tokens = SENTENCE[:7] if args.quick else SENTENCE
    T, pad = len(tokens), 3

    q1, k1, v1 = build_qkv(tokens)
    q, k, v = (np.concatenate([a, a]) for a in (q1, k1, v1))  # batch of 2: (2, 4, T, P+V), ...
    lengths = np.array([T, T - pad])  # element 1: the last `pad` positions are padding
    out, res = npattn.attention_forward(
        q, k, v, causal=True, scale=1.0, q_lengths=lengths, kv_lengths=lengths, impl="dense"
    )  # dense: res.probs is the map
    grads = npattn.attention_backward(np.ones_like(out), res)
    print(f"sentence: {' '.join(tokens)}")
    print("heads: " + ", ".join(f"{n} = {name}" for n, name in enumerate(HEADS)) + "\n")

    summary = diagnostics.summarize(res.probs)
    print(summary)
    print(
        "(heads 0 and 1 are one-hot by construction, the warning is what a collapsed head looks like;\n"
        " head 2 splits its weight between repeated tokens, head 3 spreads it evenly)\n"
    )

    finite = diagnostics.check_finite(
        {"out": out, "lse": res.lse, "dq": grads.dq, "dk": grads.dk, "dv": grads.dv}, allow_neginf=["lse"]
    )
    print(finite)
    print("(lse is -inf exactly on the fully masked rows of batch element 1)\n")

    # Two classic bugs, written by hand, and what the row-sum check says about them.
    s = q[0] @ np.matrix_transpose(k[0])  # (4, T, S) scores of batch element 0
    causal = np.tril(np.ones((T, T), dtype=bool))  # (T, S)
    bugs = {
        "mask applied after the softmax": _softmax(s, axis=-1) * causal,  # (4, T, S)
        "softmax over the query axis": _softmax(np.where(causal, s, -np.inf), axis=-2),  # (4, T, S)
    }
    caught = True
    for name, weights in bugs.items():
        report = diagnostics.row_sum_check(weights)
        caught &= not report.ok
        print(f"bug: {name}\n{report}")

    titles = {
        "attention_maps_b0.png": "causal MQA: " + ", ".join(f"{n} {h}" for n, h in enumerate(HEADS)),
        "attention_maps_b1_padded.png": f"batch element 1: last {pad} positions padded (fully masked rows in grey)",
    }
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        written = [
            diagnostics.plot_attention(res.probs, batch_index=b, tokens=tokens, path=args.out / name, title=title)
            for b, (name, title) in enumerate(titles.items())
        ]
    except ImportError as err:
        print(f"\nno heatmaps: {err}")
    else:
        print("\nwrote " + ", ".join(str(p) for p in written))
    ok = summary.ok and finite.ok and caught
    print("diagnostics:", "clean example passes, both bugs caught" if ok else "UNEXPECTED RESULT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
