"""Quickstart: masked attention forward, logsumexp, and the hand-derived backward.

    python examples/quickstart.py            # B=2, N=4 heads, T=S=128, H=64
    python examples/quickstart.py --quick    # a tiny problem (used by the tests)

Shapes follow PyTorch SDPA: q (B, N, T, H), k and v (B, K, S, H); a boolean
mask is True where a query may attend (the same polarity as PyTorch and JAX).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import npattn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, for a fast check")
    args = parser.parse_args(argv)
    B, N, T, H = (2, 2, 6, 8) if args.quick else (2, 4, 128, 64)

    # --- the real use: about ten lines --------------------------------------------------
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(3))
    keep = np.ones((B, 1, 1, T), dtype=bool)  # (B, 1, 1, S) broadcasts over heads and queries
    keep[1, ..., T // 2 :] = False  # batch element 1: the last half of its keys are padding
    # impl="dense" keeps the attention matrix in res.probs (printed below)
    out, res = npattn.attention_forward(q, k, v, mask=keep, causal=True, impl="dense")  # out (B, N, T, H)
    lse = res.lse  # (B, N, T) logsumexp of the scaled, masked scores
    dout = rng.standard_normal(out.shape, dtype=np.float32)  # the cotangent from the layer above
    grads = npattn.attention_backward(dout, res)  # dq, dk, dv (and dbias, None here)
    # ------------------------------------------------------------------------------------

    print(f"q, k, v {q.shape} {q.dtype}; mask {keep.shape} (True = may attend), causal")
    print(f"out  {out.shape} {out.dtype}")
    print(
        f"lse  {lse.shape} {lse.dtype}  head 0, first queries: " + ", ".join(f"{x:.3f}" for x in lse[0, 0, :4].tolist())
    )
    print(
        f"probs (dense residuals) {res.probs.shape}, rows sum to "
        f"{float(res.probs.sum(-1).min()):.6f}..{float(res.probs.sum(-1).max()):.6f}"
    )
    print(f"dq {grads.dq.shape}, dk {grads.dk.shape}, dv {grads.dv.shape}, dbias {grads.dbias}")
    hidden = float(np.abs(grads.dk[1, :, T // 2 :]).max()) + float(np.abs(grads.dv[1, :, T // 2 :]).max())
    print(f"gradient reaching the padded keys of batch element 1: {hidden}")
    return 0 if hidden == 0.0 and np.isfinite(out).all() else 1


if __name__ == "__main__":
    sys.exit(main())
