r"""Train a tiny transformer to sort (or reverse) digits, every backward by hand.

    python examples/train_tiny_transformer.py                    # sort 10 digits, 1000 steps, ~1 min
    python examples/train_tiny_transformer.py --task reverse     # reverse them instead (easier)
    python examples/train_tiny_transformer.py --quick --out tmp  # 40 steps, seconds (used by the tests)

The task. An example is ``d_1 .. d_L | o_1 .. o_L`` with ``o = sorted(d)``
(``--task reverse``: ``o = reversed(d)``); the model reads the sequence
without its last token and is trained to predict each next token, the loss
and accuracy counting only the ``L`` positions that predict an output digit.
Accuracy is measured on 1000 held-out digit strings that never appear in
training.

Why decoder-only with causal attention: the same layers then both learn and
generate. Training is teacher-forced next-token prediction, all positions at
once; at the end the script also generates the outputs greedily, one token at
a time from ``d_1 .. d_L |`` alone, so the reported accuracy is backed by the
model actually solving the task. (An encoder with bidirectional attention
would also fit the task, but it needs the output length fixed up front and
shows nothing about causal masking.) Sorting rather than only reversing
because it needs attention by *content* (find the input copies of the next
digit) rather than by position alone; the heatmaps show the difference.

The model (``examples/tiny_transformer/``, one module per idea)::

    x = tok_emb[ids] + pos_emb[t]                     embedding        layers.py
    x = x + MHA_causal(LN1(x))     } x num_layers     npattn.mha       model.py
    x = x + MLP(LN2(x))            }  (pre-norm)      GELU MLP, LN     layers.py
    logits = LN_f(x) W_head^T + b                     linear           layers.py
    loss = masked softmax cross-entropy               loss.py
    update = Adam, global-norm clipping, warm-up + cosine schedule   adam.py

Every backward is written by hand (npattn's ``mha_backward`` for attention)
and, before training, checked against central differences with
``npattn.check_gradients`` on tiny float64 inputs (``checks.py``; skip with
``--no-check``). Training runs in float32.

Outputs in ``--out``: ``loss_curve.png``, ``attention_layer{i}.png`` (every
head of layer i on one held-out sequence, drawn by ``npattn.plot_attention``
from ``mha_forward(..., need_weights=True)``; row t is the query at position
t, which predicts token t+1), and ``history.json`` (losses, accuracies,
timings) and ``params.npz`` (the trained weights). The PNGs need matplotlib (``pip install "npattn[plot]"``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import numpy as np

import npattn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/, home of tiny_transformer/
from tiny_transformer.adam import Adam, clip_grad_norm, learning_rate
from tiny_transformer.checks import report, run_checks
from tiny_transformer.data import TASKS, VOCAB_SIZE, DigitTask, targets_of, token_label
from tiny_transformer.loss import cross_entropy_backward, cross_entropy_forward, token_accuracy
from tiny_transformer.model import Config, greedy_decode, init_params, model_backward, model_forward


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 1000; 40 with --quick)")
    parser.add_argument(
        "--quick", action="store_true", help="a small fast run for tests: 40 steps, d_model 32, 6 digits"
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("tiny_transformer_out"),
        help="directory for the PNGs and history.json (created if missing)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, the data and the held-out set")
    parser.add_argument("--task", choices=TASKS, default="sort")
    parser.add_argument("--length", type=int, default=None, help="digits per example, L (default 10; 6 with --quick)")
    parser.add_argument("--d-model", type=int, default=None, help="D (default 64; 32 with --quick)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gradient-check every hand-written layer before training",
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=1,
        help="BLAS threads while training (needs threadpoolctl; 0 leaves the default)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.steps = args.steps if args.steps is not None else (40 if quick else 1000)
    args.length = args.length if args.length is not None else (6 if quick else 10)
    args.d_model = args.d_model if args.d_model is not None else (32 if quick else 64)
    args.num_val = 200 if quick else 1000
    args.log_every = 10 if quick else 100
    args.warmup = min(100, max(args.steps // 10, 1))
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def evaluate(params, task: DigitTask, cfg: Config) -> tuple[float, float]:
    """Held-out ``(loss, token accuracy)``, teacher forced, all sequences in one batch."""
    ids, targets, mask = task.val_batch()  # (Bv, T) each
    logits, _ = model_forward(params, ids, cfg)  # (Bv, T, V)
    loss, _ = cross_entropy_forward(logits, targets, mask)
    return float(loss), token_accuracy(logits, targets, mask)


def train(args: argparse.Namespace) -> dict:
    """Gradient checks, the training loop and the final evaluation; returns the history."""
    start = time.perf_counter()
    history = {"args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}
    if args.check:
        print("gradient checks (npattn.check_gradients, float64, central differences):")
        results = run_checks(seed=args.seed)
        print(report(results))
        history["gradcheck_ok"] = all(r.ok for r in results.values())
        if not history["gradcheck_ok"]:
            print("a hand-written backward is wrong: not training")
            return history

    task = DigitTask(args.length, args.task, num_val=args.num_val, seed=args.seed)
    cfg = Config(VOCAB_SIZE, task.seq_len, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers)
    params = init_params(cfg, seed=args.seed)
    opt = Adam(params)
    n_params = sum(p.size for p in params.values())
    print(
        f"\ntask: {args.task} {args.length} digits (T = {task.seq_len} positions, {args.num_val} held-out "
        f"sequences); model: d_model {cfg.d_model}, {cfg.num_layers} layers, {cfg.num_heads} heads, "
        f"{n_params:,} parameters; Adam, peak lr {args.lr:g}, batch {args.batch_size}, {args.steps} steps"
    )
    history.update(step=[], loss=[], eval_step=[], val_loss=[], val_acc=[])

    def record_eval(step: int) -> tuple[float, float]:
        val_loss, val_acc = evaluate(params, task, cfg)
        history["eval_step"].append(step)
        history["val_loss"].append(val_loss)
        history["val_acc"].append(val_acc)
        return val_loss, val_acc

    val_loss, val_acc = record_eval(0)
    print(f"step {0:5d}/{args.steps}  val loss {val_loss:.4f}  val acc {val_acc:6.2%}  (before training)")

    t_train = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids, targets, mask = task.train_batch(args.batch_size)  # (B, T) each
        logits, res = model_forward(params, ids, cfg)  # (B, T, V)
        loss, res_loss = cross_entropy_forward(logits, targets, mask)  # ()
        dlogits, _, _ = cross_entropy_backward(np.ones((), dtype=loss.dtype), res_loss)  # (B, T, V)
        grads = model_backward(dlogits, res)  # keyed like params
        clip_grad_norm(grads, 1.0)
        opt.step(params, grads, learning_rate(step, args.steps, args.lr, args.warmup))
        history["step"].append(step)
        history["loss"].append(float(loss))

        if step % args.log_every == 0 or step == args.steps:
            val_loss, val_acc = record_eval(step)
            elapsed = time.perf_counter() - t_train
            rate = step / elapsed
            recent = np.mean(history["loss"][-args.log_every :])
            print(
                f"step {step:5d}/{args.steps}  loss {recent:.4f}  val loss {val_loss:.4f}  "
                f"val acc {val_acc:6.2%}  {rate:5.1f} steps/s  ETA {(args.steps - step) / rate:5.0f} s",
                flush=True,
            )
    history["train_seconds"] = time.perf_counter() - t_train

    # Greedy generation from the prompt alone: no teacher forcing.
    prompt = task.val_batch()[0][:, : args.length + 1]  # (Bv, L + 1): d_1 .. d_L |
    generated = greedy_decode(params, prompt, cfg, args.length)  # (Bv, L)
    wanted = targets_of(task.val_digits, args.task)  # (Bv, L)
    history["greedy_token_acc"] = float((generated == wanted).mean())
    history["greedy_exact"] = float((generated == wanted).all(axis=1).mean())
    d, o = task.val_digits[0], generated[0]
    print(
        f"\ngreedy generation on held-out sequences: {history['greedy_token_acc']:.2%} of digits right, "
        f"{history['greedy_exact']:.2%} of sequences entirely right; e.g. "
        f"{' '.join(map(str, d))} | {' '.join(map(str, o))}"
    )

    save_plots(params, task, cfg, history, args.out)
    history["final_val_acc"] = history["val_acc"][-1]
    history["total_seconds"] = time.perf_counter() - start
    (args.out / "history.json").write_text(json.dumps(history, indent=1))
    np.savez(args.out / "params.npz", **params)  # reload: dict(np.load(path)); keys as in model.init_params
    return history


def save_plots(params, task: DigitTask, cfg: Config, history: dict, out: pathlib.Path) -> None:
    """``loss_curve.png`` and ``attention_layer{i}.png`` in ``out`` (skipped without matplotlib)."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print(f'no plots: they need matplotlib: pip install "npattn[plot]" (history.json is in {out})')
        return

    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot(history["step"], history["loss"], lw=0.8, alpha=0.6, label="train (per step)")
    ax_loss.plot(history["eval_step"], history["val_loss"], "o-", ms=3, label="held-out")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (target positions)", yscale="log", title="loss")
    ax_loss.legend()
    ax_acc.plot(history["eval_step"], [100 * a for a in history["val_acc"]], "o-", ms=3, color="C1")
    ax_acc.axhline(95, color="grey", lw=0.8, ls="--")
    ax_acc.set(xlabel="step", ylabel="token accuracy (%)", ylim=(0, 101), title="held-out accuracy")
    fig.suptitle(f"tiny transformer, {task.task} {task.length} digits")
    fig.savefig(out / "loss_curve.png", dpi=100)

    ids = task.val_batch()[0][:1]  # (1, T): one held-out sequence
    _, res = model_forward(params, ids, cfg, need_weights=True)
    labels = [token_label(int(t)) for t in ids[0]]
    for i, weights in enumerate(res["weights"]):  # (1, N, T, T) per layer
        npattn.plot_attention(
            weights,
            batch_index=0,
            tokens=labels,
            path=out / f"attention_layer{i}.png",
            title=f"layer {i}, {task.task}: {' '.join(labels)} (query t predicts token t+1)",
        )
    print(f"wrote {out / 'loss_curve.png'} and attention_layer0..{cfg.num_layers - 1}.png")


def blas_threads(n: int):
    """Limit BLAS to ``n`` threads (a no-op for ``n == 0`` or without threadpoolctl).

    The matrices here are tiny (at most 1024 x 256), so one thread is as fast
    as several on an idle machine, and much faster on a busy one: OpenBLAS
    threads wait on each other, and stall whenever another process holds a
    core (on a 2-core machine with one other busy process: 2.8 steps/s with
    two BLAS threads, 21 steps/s with one).
    """
    if n <= 0:
        return contextlib.nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with blas_threads(args.blas_threads):
        history = train(args)
    if not history.get("gradcheck_ok", True):
        return 1
    print(
        f"final held-out token accuracy {history['final_val_acc']:.2%} after {args.steps} steps; "
        f"total time {history['total_seconds']:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
