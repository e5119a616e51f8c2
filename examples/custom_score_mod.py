r"""A new attention variant as two small functions: a learned relative-position
bias (a score modification) inside a document mask (a mask modification).

    python examples/custom_score_mod.py                         # T = 128, 200 steps, ~10 s
    python examples/custom_score_mod.py --quick --out bias.png  # T = 48, 40 steps (used by the tests)

The variant. Every head ``n`` has a table of biases over the clipped relative
distance ``r = clip(j - p_i, -R, R)`` between key ``j`` and query ``i``::

    s'_nij = s_nij + table[n, r + R]                                  forward
    ds_nij = ds'_nij                                                  backward, scores
    dtable[n, b] = sum of ds'_nij over the entries with r + R = b     backward, table

written as an :class:`npattn.ScoreMod` (its own forward and backward, not the
shipped :func:`npattn.relative_position_bias`, so the whole pattern shows):
the forward gathers ``table[idx.head, bucket]``, the backward scatters the
cotangents back with ``np.bincount`` over *global* indices
``head * (2R + 1) + bucket``, since a tile may hold only some of the heads
(on the NumPy fast path, the two query heads that share a kv head here).
The documents are packed into one row and a query sees only keys of its own
document: ``mask_mod(idx) = doc[idx.q] == doc[idx.k]``, precomputed once as an
:func:`npattn.block_mask` that every training step reuses.

The script

1. checks the modification's backward (table included) with
   ``npattn.check_score_mod``, shows it catching a backward that numbers
   the heads from the tile's first, and checks the whole attention, ``q, k,
   v`` and the table through the document mask, with
   ``npattn.check_gradients`` (central differences, float64), on the dense
   and the chunked path;
2. trains the table alone with Adam on a task only locality solves: queries
   and keys are noise, and each head's target is a positional pattern of the
   values (the previous token, the next one, the mean of the last four, the
   mean of a five-token window), each cut off at its document's edges. The
   loss (mean squared error) falls as the heads learn where to look;
3. prints what each head learned and draws the table (``--out``, a PNG; needs
   matplotlib: ``pip install "npattn[plot]"``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

import npattn

#: What each query head must learn: its name and the relative positions
#: ``j - i`` its target averages over (cut off at the document's edges).
HEADS = (
    ("previous token", (-1,)),
    ("next token", (1,)),
    ("mean of the last four", (-3, -2, -1, 0)),
    ("mean of a five-token window", (-2, -1, 0, 1, 2)),
)


# --- the score modification: a learned relative-position bias --------------


def relative_bucket(idx: npattn.TileIndex, max_distance: int) -> np.ndarray:
    """``clip(j - p_i, -R, R) + R`` in ``[0, 2R]``: ``(B'|1, 1, tq, tk)``."""
    return np.clip(idx.k - idx.q, -max_distance, max_distance) + max_distance


def learned_relative_bias(table: np.ndarray, max_distance: int) -> npattn.ScoreMod:
    """``s' = s + table[n, clip(j - p_i, -R, R) + R]`` with ``table`` of shape
    ``(N, 2R + 1)``, as a ScoreMod whose parameter is called ``"table"``."""

    def forward(s, idx, table):
        bucket = relative_bucket(idx, max_distance)  # (B'|1, 1, tq, tk)
        return s + table[idx.head, bucket]  # (1, n, 1, 1) x (B'|1, 1, tq, tk) -> (B'|1, n, tq, tk)

    def backward(s, idx, ds, table):
        num_heads, width = table.shape  # every head of the call: idx.head is a global index
        flat = idx.head * width + relative_bucket(idx, max_distance)  # (B'|1, n, tq, tk)
        flat = np.broadcast_to(flat, ds.shape)  # (B', n, tq, tk)
        dtable = np.bincount(flat.ravel(), weights=ds.ravel(), minlength=num_heads * width)  # float64
        return ds, {"table": dtable.reshape(num_heads, width).astype(ds.dtype)}  # ds' / ds = 1

    return npattn.ScoreMod(forward, backward, params={"table": table}, name="learned_relative_bias")


def learned_relative_bias_local_heads(table: np.ndarray, max_distance: int) -> npattn.ScoreMod:
    """The same forward with a classic slip in the backward: it numbers the
    heads from the tile's first (``idx.head - h0``), as if every tile held
    every head; tiles that start at another head put their shares in the
    wrong rows of ``dtable``."""
    correct = learned_relative_bias(table, max_distance)

    def backward(s, idx, ds, table):
        num_heads, width = table.shape
        local = idx.head - idx.heads[0]  # WRONG: 0 .. n-1 within the tile, not the call's head ids
        flat = np.broadcast_to(local * width + relative_bucket(idx, max_distance), ds.shape)
        dtable = np.bincount(flat.ravel(), weights=ds.ravel(), minlength=num_heads * width)
        return ds, {"table": dtable.reshape(num_heads, width).astype(ds.dtype)}

    return npattn.ScoreMod(correct.forward, backward, params={"table": table}, name="local_heads")


# --- the mask modification: packed documents ---------------------------------


def document_mask(doc: np.ndarray):
    """``mask_mod(idx)``: True where query and key lie in the same document;
    ``doc`` holds the document id of every position, ``(T,)``."""

    def same_document(idx):
        return doc[idx.q] == doc[idx.k]  # (B'|1, 1, tq, 1) vs (1, 1, 1, tk) -> (B'|1, 1, tq, tk)

    return same_document


def documents(lengths: list[int]) -> np.ndarray:
    """The document id of each position of a row packing documents of ``lengths``."""
    return np.repeat(np.arange(len(lengths)), lengths)  # (T,)


# --- the task ----------------------------------------------------------------


def target_weights(doc: np.ndarray, offsets: tuple[int, ...]) -> np.ndarray:
    """``W (T, T)``: row i averages the keys ``j = i + r``, ``r`` in ``offsets``,
    that lie in query i's document; a row with none takes the token itself
    (the previous token of a document's first token)."""
    T = len(doc)
    relative = np.arange(T)[None, :] - np.arange(T)[:, None]  # (T, T): j - i
    weights = np.isin(relative, offsets) & (doc[:, None] == doc[None, :])  # (T, T)
    weights |= ~weights.any(axis=1, keepdims=True) & (relative == 0)  # empty rows: the token itself
    return weights / weights.sum(axis=1, keepdims=True)  # (T, T), rows sum to 1


def targets(v: np.ndarray, doc: np.ndarray, num_heads: int) -> np.ndarray:
    """Each query head's target, ``(B, N, T, Hv)``, from ``v (B, K, T, Hv)``:
    head n averages its kv head's values (``n // (N // K)``) as
    ``target_weights`` with its offsets in ``HEADS`` says."""
    group = num_heads // v.shape[1]
    return np.stack(
        [target_weights(doc, HEADS[n][1]) @ v[:, n // group] for n in range(num_heads)], axis=1
    )  # (T, T) @ (B, T, Hv) -> (B, T, Hv), stacked on axis 1


def mse(out: np.ndarray, target: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean squared error and its gradient with respect to ``out``."""
    diff = out - target
    return float(np.mean(diff * diff)), 2.0 * diff / diff.size


class Adam:
    """Adam (Kingma and Ba) on one array."""

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8):
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.m = self.v = None
        self.t = 0

    def step(self, param: np.ndarray, grad: np.ndarray) -> np.ndarray:
        if self.m is None:
            self.m, self.v = np.zeros_like(param), np.zeros_like(param)
        self.t += 1
        self.m = self.beta1 * self.m + (1 - self.beta1) * grad
        self.v = self.beta2 * self.v + (1 - self.beta2) * grad * grad
        m_hat, v_hat = self.m / (1 - self.beta1**self.t), self.v / (1 - self.beta2**self.t)
        return param - self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


# --- 1. gradient checks ------------------------------------------------------


def check(max_distance: int, seed: int = 0) -> bool:
    """Check the modification alone, then attention with it and the document mask."""
    rng = np.random.default_rng(seed)
    num_heads = 4
    table = rng.standard_normal((num_heads, 2 * max_distance + 1))  # (N, 2R + 1)
    result = npattn.check_score_mod(learned_relative_bias(table, max_distance), num_heads=num_heads, seed=seed)
    print(f"npattn.check_score_mod(learned_relative_bias): {result}")
    wrong = npattn.check_score_mod(
        learned_relative_bias_local_heads(table, max_distance), num_heads=num_heads, seed=seed, raise_on_failure=False
    )
    caught = not wrong.ok and all("table" in failure for failure in wrong.failures)
    print(
        "the backward with local head ids: "
        + (f"caught, {len(wrong.failures)} failures, e.g.\n  {wrong.failures[0]}" if caught else "NOT CAUGHT")
    )

    doc = documents([3, 5])  # T = 8
    mask = npattn.block_mask(document_mask(doc), 8, 8, block_q=4, block_k=4)
    q = rng.standard_normal((1, num_heads, 8, 3))  # (B, N, T, H)
    k = rng.standard_normal((1, 2, 8, 3))  # (B, K, S, H): two query heads per kv head
    v = rng.standard_normal((1, 2, 8, 3))  # (B, K, S, Hv)
    ok = result.ok and caught
    for impl in ("dense", "chunked"):
        forward, backward = attention_pair(mask, max_distance, impl)
        result = npattn.check_gradients(
            forward, backward, [q, k, v, table], names=["q", "k", "v", "table"], raise_on_failure=False
        )
        print(f"npattn.check_gradients, attention with the bias and the document mask, impl={impl!r}: {result}")
        ok = ok and result.ok
    return ok


def attention_pair(mask, max_distance: int, impl: str):
    """Attention with the bias and ``mask`` as a ``custom_vjp``-style pair over
    ``(q, k, v, table)``, for :func:`npattn.check_gradients`."""

    def forward(q, k, v, table):
        mod = learned_relative_bias(table, max_distance)
        return npattn.attention_forward(q, k, v, score_mods=[mod], block_mask=mask, impl=impl, block_q=4, block_k=4)

    def backward(dout, res):
        grads = npattn.attention_backward(dout, res)
        return grads.dq, grads.dk, grads.dv, grads.dmods["table"]

    return forward, backward


# --- 2. training -------------------------------------------------------------


def train(args: argparse.Namespace) -> tuple[np.ndarray, list[float]]:
    """Train the bias table; returns it and the loss of every step."""
    rng = np.random.default_rng(args.seed)
    doc = documents(args.docs)
    T, N, K, H = len(doc), len(HEADS), 2, 16
    mask = npattn.block_mask(document_mask(doc), T, T, block_q=16, block_k=16)  # once, reused by every step
    print(
        f"documents of {args.docs} tokens packed in T = {T}; {mask!r}: {mask.sparsity:.0%} of the blocks hidden, "
        "skipped by every call"
    )
    table = np.zeros((N, 2 * args.max_distance + 1))  # (N, 2R + 1): no preference at first
    adam = Adam(args.lr)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        q = 0.5 * rng.standard_normal((args.batch_size, N, T, H))  # (B, N, T, H): noise, no content to match
        k = 0.5 * rng.standard_normal((args.batch_size, K, T, H))  # (B, K, S, H)
        v = rng.standard_normal((args.batch_size, K, T, H))  # (B, K, S, Hv)
        mod = learned_relative_bias(table, args.max_distance)
        out, res = npattn.attention_forward(
            q, k, v, score_mods=[mod], block_mask=mask, impl="chunked", block_q=32, block_k=32
        )  # (B, N, T, Hv): 32-wide tiles read the mask's 16-wide blocks exactly
        loss, dout = mse(out, targets(v, doc, N))
        grads = npattn.attention_backward(dout, res)
        table = adam.step(table, grads.dmods["table"])  # (N, 2R + 1)
        losses.append(loss)
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            print(f"step {step:4d}/{args.steps}  loss {loss:.4f}")
    if args.steps:
        mask_alone, _ = npattn.attention_forward(q, k, v, score_mods=[mod], mask_mod=mask.mask_mod, impl="dense")
        print(
            f"{args.steps} steps in {time.perf_counter() - start:.1f} s; the block mask gives what the mask_mod "
            f"alone gives on the dense path: max difference {np.abs(out - mask_alone).max():.1e}"
        )
    return table, losses


# --- 3. what the heads learned -----------------------------------------------


def favoured(row: np.ndarray, max_distance: int) -> list[int]:
    """The relative positions whose bias lies within a quarter of the way
    from the row's largest to its median: where the head looks."""
    cut = row.max() - (row.max() - np.median(row)) / 4
    return [int(r) for r in np.flatnonzero(row > cut) - max_distance]


def summary(table: np.ndarray, max_distance: int) -> tuple[str, bool]:
    """One line per head, and whether every head looks where its target is."""
    lines, all_right = [], True
    for n, row in enumerate(table):
        name, wanted = HEADS[n]
        seen = favoured(row, max_distance)
        right = seen == list(wanted)
        all_right &= right
        lines.append(
            f"head {n} ({name}): favours j - i in {seen}, bias {row.max():+.1f} there vs "
            f"{np.median(row):+.1f} typical ({'as its target' if right else f'target {list(wanted)}'})"
        )
    return "\n".join(lines), all_right


def plot(table: np.ndarray, losses: list[float], max_distance: int, path: pathlib.Path) -> bool:
    """The loss curve and each head's learned bias against ``j - i``."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print('no plot: it needs matplotlib: pip install "npattn[plot]"')
        return False
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_loss, ax_bias = fig.subplots(1, 2, width_ratios=(1, 1.6))
    ax_loss.plot(np.arange(1, len(losses) + 1), losses)
    ax_loss.set(xlabel="step", ylabel="mean squared error", yscale="log", title="training loss")
    offsets = np.arange(-max_distance, max_distance + 1)
    for n, row in enumerate(table):
        ax_bias.plot(offsets, row, "o-", ms=3, label=f"head {n}: {HEADS[n][0]}")
    ax_bias.axvline(0, color="grey", lw=0.8, ls="--")
    ax_bias.set(
        xlabel=f"relative position j - i (clipped at ±{max_distance})",
        ylabel="learned bias",
        title="learned relative-position bias per head",
    )
    ax_bias.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="T = 48, 40 steps, for a fast check")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 200; 40 with --quick)")
    parser.add_argument("--lr", type=float, default=0.1, help="Adam's learning rate")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="seeds the checks' inputs and the training data")
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("custom_score_mod.png"), help="the PNG of the learned bias"
    )
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (40 if args.quick else 200)
    args.docs = [20, 12, 16] if args.quick else [40, 24, 36, 28]
    args.max_distance = 6 if args.quick else 8
    args.log_every = 10 if args.quick else 50
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("1. gradient checks (float64, central differences)")
    checked = check(args.max_distance, seed=args.seed)
    if not checked:
        print("a hand-written backward is wrong: not training")
        return 1
    print(f"\n2. training the bias table ({len(HEADS)} heads, R = {args.max_distance}) with Adam, lr {args.lr:g}")
    table, losses = train(args)
    print("\n3. what the heads learned")
    text, all_right = summary(table, args.max_distance)
    print(text)
    print("every head looks where its target lies" if all_right else "some heads have not found their target (--steps)")
    if losses:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({losses[0] / losses[-1]:.0f}x lower)")
    plot(table, losses, args.max_distance, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
