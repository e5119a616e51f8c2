"""CPU speed of npattn's chunked path against PyTorch's C++ kernels, side by side.

    python benchmarks/bench_cpu.py            # the issue's shape: B=1, N=8, H=64, T=S=4096, float32
    python benchmarks/bench_cpu.py --quick    # a small shape, seconds

Prints one table: for each shape and mask (non-causal, causal), the forward
and forward+backward times of npattn (``impl="chunked"``, which on NumPy is
the fast path of :mod:`npattn.fast_numpy`) and of
``torch.nn.functional.scaled_dot_product_attention`` (when torch is
installed, limited to the same number of threads), their ratio, the attained
GFLOP/s and its share of this machine's large-SGEMM GFLOP/s measured in the
same run, and npattn's peak traced memory. A line below it gives a floor
under full attention's forward+backward: its seven products alone at
NumPy's one-thread GFLOP/s on the fast path's tile shapes, measured in the
same run, and the four passes over the scores it cannot skip (``exp2``
twice, ``dP - D``, ``P (dP - D)``) at NumPy's one-thread speed, spread over
the threads with no other work (:func:`fwd_bwd_floor`), against torch's
time and npattn's.

FLOPs are counted as the issue fixes them: forward ``4 B N T S H`` (halved
for causal, whose hidden half is skipped), backward 2.5x the forward.
Times are the best of ``--repeats`` calls of each side in turn, each call
after ``SETTLE_S`` of the same side's untimed calls.

A second table times the variants of the score pipeline at the same shape
(``--no-variants`` skips it), each beside plain attention of that shape in
npattn and beside torch, all interleaved in one process: npattn ms, torch
ms, their ratio, npattn's time ÷ its plain attention ("÷ plain"), and
torch's time ÷ torch's plain attention ("torch ÷ plain": SDPA of the plain
side's arrays, causal where that side is), so that each library's own price
of a variant shows beside the other's. Torch has no softcap or sinks in
SDPA, so the torch side is:

- softcap (c = 50, Gemma 2's): explicit math, ``c tanh(s / c)`` on
  ``scale q k^T``, softmax, ``@ v`` (autograd through every step);
- sinks: SDPA with one extra key column (key and value rows 0) whose float
  mask entry is ``sinks_n``, so its score is the sink's;
- ALiBi (:func:`npattn.alibi_slopes`): SDPA with the float bias
  ``-m_n |i - j|``, ``(N, T, S)``;
- packed documents (4 of T/4, causal; T = S): SDPA with the equivalent bool
  mask, causal and same document; npattn takes segment ids and is compared
  with its causal attention without them;
- the same documents apart ("docs apart"): the 4 documents as batch
  elements of length T/4, causal, on both sides. Its "÷ plain" is also
  against causal attention over T, so the two rows show whether packing
  costs what the documents would cost separately (issue 14's criterion),
  and its "torch ÷ plain" is what torch's own flash kernel takes for those
  documents against its causal attention over T.

The other three compare with full (non-causal) attention.

A third table (``--no-score-mod`` skips it, ``--score-mod-only`` prints only
it) times the user score modification of issue 15 at its own length,
``--score-mod-length`` (T = S = 2048 by default, the issue's target shape; 256
with ``--quick``): T5's relative-position bias, bidirectional, 32 buckets,
max_distance 128, one learned table ``(N, 32)``, full attention. npattn takes
:func:`npattn.relative_position_bias` (``impl="chunked"``; its backward
returns the table's gradient), beside its plain attention. The torch side is
FlexAttention with the same ``score_mod`` (compiled) when it runs forward
*and* backward on the CPU; torch 2.13 refuses the backward on the CPU
("FlexAttention does not support backward on CPU"), so there it is SDPA with
a float bias ``(1, N, T, S)`` gathered from the table each call
(``table[:, bucket]``, buckets computed once, so autograd scatter-adds d
table): torch picks its CPU flash kernel for the forward without grad and
the math kernel when the bias needs a gradient. The table names the
implementation and kernels used and the two sides' largest differences.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import npattn
from npattn.__main__ import traced_peak_mib
from npattn.fast_numpy import num_threads


def _best(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


#: Seconds of untimed calls of a function before each of its timed calls
#: (at least one call): the other library's idle threads stop spinning
#: meanwhile, and this one's are awake, as in a loop of its own calls. A
#: pause instead (0.3 s of sleep, before 2026-11-26) left the VM's cores
#: cold: a packed-documents forward of 39-40 ms back to back took 44-83 ms
#: after each pause, a causal one of 116-120 ms 120-168 ms, which skewed
#: every ratio of a short call to a long one.
SETTLE_S = 0.15


def _settle(fn, seconds: float) -> None:
    """Untimed calls of ``fn`` for ``seconds``, at least one."""
    deadline = time.perf_counter() + seconds
    fn()
    while time.perf_counter() < deadline:
        fn()


def _best_side_by_side(fns: dict, repeats: int) -> dict:
    """Best time of each function, running them in turn ``repeats`` times so
    that a slow spell of the machine hits all of them alike, each timed call
    after :data:`SETTLE_S` of the same function's untimed calls."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _settle(fn, SETTLE_S)
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def sgemm_gflops(n: int = 4096, repeats: int = 3) -> float:
    """GFLOP/s of one large float32 matrix product with all BLAS threads."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / _best(lambda: a @ a, repeats) / 1e9


def tile_gemm_gflops(
    matmul, make, rows: int = 512, cols: int = 512, depth: int = 64, *, transposed_left: bool = False
) -> float:
    """GFLOP/s of one ``(rows, depth) @ (depth, cols)`` tile product (by
    default the shape the chunked path multiplies most), on the threads the
    caller allows; with ``transposed_left`` the left operand is the
    transposed view of a ``(depth, rows)`` array, as in ``P^T dO``."""
    a = make((depth, rows)).T if transposed_left else make((rows, depth))
    b, out = make((depth, cols)), make((rows, cols))
    return 2 * rows * cols * depth / _best(lambda: [matmul(a, b, out=out) for _ in range(50)], 3) * 50 / 1e9


def fwd_bwd_floor(B: int, N: int, T: int, H: int, threads: int, make) -> dict:
    """A floor under full attention's forward+backward on the fast path: the
    work it cannot skip, at NumPy's one-thread speeds on its tile shapes
    (best of three loops each), spread over ``threads`` threads with nothing
    else to do. Returns seconds for ``"products"`` and ``"passes"``, and the
    products' GFLOP/s as ``"rates"``.

    - The seven products, each ``2 B N T^2 H`` FLOPs: ``Q K^T`` (forward and
      backward) and ``dO V^T`` are ``(L, H) @ (H, L)``, ``P V`` and ``dS K``
      ``(L, L) @ (L, H)``, ``P^T dO`` and ``dS^T Q`` the same with the left
      operand transposed, for tiles of ``L = min(512, T)``.
    - Four passes over the ``B N T^2`` scores: ``exp2`` in the forward and
      again in the backward, ``dP - D`` (a row broadcast) and ``P (dP - D)``.
    """
    from threadpoolctl import threadpool_limits

    L = min(512, T)
    scores_count = B * N * T * T
    s, p, r, d = make((L, L)), make((L, L)), make((L, L)), make((L, 1))  # s the output: no input changes
    with threadpool_limits(limits=1, user_api="blas"):
        rates = (
            tile_gemm_gflops(np.matmul, make, L, L, H),  # (L, H) @ (H, L)
            tile_gemm_gflops(np.matmul, make, L, H, L),  # (L, L) @ (L, H)
            tile_gemm_gflops(np.matmul, make, L, H, L, transposed_left=True),  # (L, L)^T @ (L, H)
        )
    per_score = [  # seconds per score of each pass, on one thread
        _best(lambda: [np.exp2(p, out=s) for _ in range(50)], 3) / (50 * L * L),
        _best(lambda: [np.subtract(p, d, out=s) for _ in range(50)], 3) / (50 * L * L),
        _best(lambda: [np.multiply(p, r, out=s) for _ in range(50)], 3) / (50 * L * L),
    ]
    gflop = 2 * scores_count * H / 1e9  # one product
    products = gflop * (3 / rates[0] + 2 / rates[1] + 2 / rates[2]) / threads
    passes = scores_count * (2 * per_score[0] + per_score[1] + per_score[2]) / threads
    return {"products": products, "passes": passes, "rates": rates}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--length", type=int, default=4096, help="T = S")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="T=S=512 (score-mod table 256), one repeat")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch columns")
    parser.add_argument("--no-variants", action="store_true", help="skip the table of score-pipeline variants")
    parser.add_argument(
        "--score-mod-length", type=int, default=2048, help="T = S of the score-modification table (issue 15)"
    )
    parser.add_argument("--no-score-mod", action="store_true", help="skip the score-modification table")
    parser.add_argument("--score-mod-only", action="store_true", help="print only the score-modification table")
    args = parser.parse_args(argv)
    for name in ("batch", "heads", "head_dim", "length", "repeats", "score_mod_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.score_mod_only and args.no_score_mod:
        parser.error("--score-mod-only and --no-score-mod exclude each other")
    if args.quick:
        args.length, args.repeats, args.score_mod_length = 512, 1, 256

    torch = None
    if not args.no_torch:
        try:
            import torch
        except ImportError:
            print("torch is not installed: torch columns are skipped (pip install torch)")
    threads = num_threads()
    if torch is not None:
        torch.set_num_threads(threads)

    B, N, H, T = args.batch, args.heads, args.head_dim, args.length
    if args.score_mod_only:
        print(f"npattn CPU benchmark: float32; {threads} threads")
        score_mod_table(torch, (B, N, args.score_mod_length, H), args.repeats)
        return 0
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))
    sgemm = sgemm_gflops()
    print(
        f"npattn CPU benchmark: float32, B={B}, N={N}, H={H}, T=S={T}; {threads} threads; "
        f"large SGEMM {sgemm:.0f} GFLOP/s"
    )
    header = (
        f"{'shape / mask':<26} {'pass':<8} {'impl':<8} {'npattn ms':>10} {'torch ms':>9} {'ratio':>6} "
        f"{'GFLOP/s':>8} {'% SGEMM':>8} {'peak MiB':>9}"
    )
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        numpy_tile = tile_gemm_gflops(np.matmul, lambda shape: rng.standard_normal(shape, dtype=np.float32))
    tile_line = f"one 512x64x512 tile product, 1 thread: NumPy's BLAS {numpy_tile:.0f} GFLOP/s"
    if torch is not None:
        with torch.no_grad():
            previous = torch.get_num_threads()
            torch.set_num_threads(1)
            torch_tile = tile_gemm_gflops(torch.matmul, lambda shape: torch.randn(shape))
            torch.set_num_threads(previous)
        tile_line += f", torch's {torch_tile:.0f} GFLOP/s"
    print(tile_line)
    print(header)
    print("-" * len(header))
    for causal in (False, True):

        def fwd(causal=causal):
            return npattn.attention_forward(q, k, v, causal=causal, impl="chunked")

        def fwd_bwd():
            _out, res = fwd()
            return npattn.attention_backward(dout, res)

        fns = {"forward": fwd, "fwd+bwd": fwd_bwd}
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
            tdout = torch.from_numpy(dout)

            def t_fwd(tq=tq, tk=tk, tv=tv, causal=causal):
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            def t_fwd_bwd(tq=tq, tk=tk, tv=tv, tdout=tdout, causal=causal):
                out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                out.backward(tdout)

            fns.update({"torch forward": t_fwd, "torch fwd+bwd": t_fwd_bwd})
        best = _best_side_by_side(fns, args.repeats)
        times = {name: best[name] for name in ("forward", "fwd+bwd")}
        torch_times = {name: best[f"torch {name}"] for name in times if f"torch {name}" in best}
        peaks = {"forward": traced_peak_mib(fwd), "fwd+bwd": traced_peak_mib(fwd_bwd)}
        flops_fwd = 4 * B * N * T * T * H * (0.5 if causal else 1.0)
        for name, flops in (("forward", flops_fwd), ("fwd+bwd", 3.5 * flops_fwd)):
            ms = times[name] * 1e3
            gflops = flops / times[name] / 1e9
            t_ms = torch_times.get(name)
            torch_col = f"{t_ms * 1e3:9.1f}" if t_ms else f"{'-':>9}"
            ratio = f"{times[name] / t_ms:6.2f}" if t_ms else f"{'-':>6}"
            label = f"({B},{N},{T},{H}) {'causal' if causal else 'full'}"
            print(
                f"{label:<26} {name:<8} {'chunked':<8} {ms:10.1f} {torch_col} {ratio} "
                f"{gflops:8.1f} {100 * gflops / sgemm:7.1f}% {peaks[name]:9.1f}"
            )
        if not causal:
            full_fwd_bwd = times["fwd+bwd"], torch_times.get("fwd+bwd")
    _print_floor((B, N, T, H), threads, rng, *full_fwd_bwd)
    if not args.no_variants:
        variant_table(torch, (q, k, v, dout), args.repeats)
    if not args.no_score_mod:
        score_mod_table(torch, (B, N, args.score_mod_length, H), args.repeats)
    return 0


#: The packed-documents rows pack this many documents into each sequence.
DOCUMENTS = 4


def _documents_apart(x: np.ndarray) -> np.ndarray:
    """``(B, N, T, D) -> (DOCUMENTS B, N, T / DOCUMENTS, D)``: the packed
    documents of each batch element as batch elements of their own (a
    contiguous copy)."""
    B, N, T, D = x.shape
    n, L = DOCUMENTS, T // DOCUMENTS
    split = x.reshape(B, N, n, L, D)  # (B, N, n, L, D)
    return np.ascontiguousarray(split.transpose(0, 2, 1, 3, 4)).reshape(B * n, N, L, D)  # (n B, N, L, D)


def _variants(torch, q, k, v):
    """``{name: (npattn options, plain npattn options, torch forward or None,
    layout or None)}`` for the variant rows; torch's forward takes torch
    tensors ``(q, k, v)``; a layout maps each array to the row's own (the
    plain side keeps the call's arrays)."""
    N, T, S = q.shape[-3], q.shape[-2], k.shape[-2]
    cap = 50.0
    rng = np.random.default_rng(1)
    sinks = rng.standard_normal(N).astype(np.float32)
    slopes = npattn.alibi_slopes(N, dtype=np.float32)
    ids = np.repeat(np.arange(DOCUMENTS), -(-T // DOCUMENTS))[:T][None].repeat(q.shape[0], axis=0)  # (B, T)
    rows = {
        "softcap": ({"softcap": cap}, {}),
        "sinks": ({"sinks": sinks}, {}),
        "ALiBi": ({"alibi_slopes": slopes}, {}),
        "packed docs": ({"causal": True, "q_segment_ids": ids, "kv_segment_ids": ids}, {"causal": True}),
    }
    layouts = {}
    if T % DOCUMENTS == 0:  # documents of equal length: batch elements of their own
        rows["docs apart"] = ({"causal": True}, {"causal": True})
        layouts["docs apart"] = _documents_apart
    if torch is None:
        return {name: (ours, plain, None, layouts.get(name)) for name, (ours, plain) in rows.items()}
    F = torch.nn.functional
    scale = q.shape[-1] ** -0.5
    position = np.arange(T)[:, None] - np.arange(S)[None, :]  # (T, S)
    # (1, N, T, S): with a 4-D float mask torch runs its flash kernel (a 3-D one sends it to the math kernel)
    alibi_bias = torch.from_numpy((-slopes[:, None, None] * np.abs(position)).astype(np.float32))[None]
    same_doc = torch.from_numpy((ids[0][:, None] == ids[0][None, :]) & (position >= 0))  # (T, S) bool
    sink_mask = torch.zeros((N, 1, S + 1))
    sink_mask[:, 0, S] = torch.from_numpy(sinks)  # (N, 1, S + 1): the extra column scores sinks_n

    def t_softcap(tq, tk, tv):
        s = (tq @ tk.transpose(-1, -2)) * scale  # (B, N, T, S)
        return torch.softmax(cap * torch.tanh(s / cap), dim=-1) @ tv

    def t_sinks(tq, tk, tv):
        zero = tk.new_zeros(tk.shape[:-2] + (1, tk.shape[-1]))
        tk1, tv1 = torch.cat([tk, zero], dim=-2), torch.cat([tv, zero], dim=-2)  # (B, N, S + 1, H)
        return F.scaled_dot_product_attention(tq, tk1, tv1, attn_mask=sink_mask)

    def t_alibi(tq, tk, tv):
        return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=alibi_bias)

    def t_packed(tq, tk, tv):
        return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=same_doc)

    def t_apart(tq, tk, tv):  # (4B, N, T/4, H) each
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    torch_fns = {
        "softcap": t_softcap,
        "sinks": t_sinks,
        "ALiBi": t_alibi,
        "packed docs": t_packed,
        "docs apart": t_apart,
    }
    return {name: (ours, plain, torch_fns[name], layouts.get(name)) for name, (ours, plain) in rows.items()}


def variant_table(torch, arrays, repeats: int) -> None:
    """One row per variant and pass: npattn, torch, ratio, npattn ÷ plain, torch ÷ plain."""
    q, k, v = arrays[:3]
    B, N, T, H = q.shape
    print()
    print(f"score-pipeline variants, B={B}, N={N}, H={H}, T=S={T} (torch side: see the module docstring)")
    _variant_rows(torch, arrays, _variants(torch, q, k, v), repeats)


def _variant_rows(torch, arrays, variants: dict, repeats: int) -> None:
    """Time ``{name: (npattn options, plain npattn options, torch forward or
    None, layout or None)}`` side by side and print one row per variant and
    pass; a row's layout maps ``arrays`` to its own (npattn's and torch's),
    while its plain side keeps ``arrays`` (torch's plain side is SDPA,
    causal where npattn's plain options are)."""
    columns = f"{'npattn ms':>10} {'torch ms':>9} {'ratio':>6} {'÷ plain':>8} {'torch ÷ plain':>14}"
    header = f"{'variant':<12} {'pass':<8} {columns}"
    print(header)
    print("-" * len(header))
    for name, (ours, plain, torch_fn, layout) in variants.items():
        own = arrays if layout is None else tuple(layout(a) for a in arrays)
        fns = {}
        for label, options, (q, k, v, dout) in (("", ours, own), ("plain ", plain, arrays)):

            def fwd(options=options, q=q, k=k, v=v):
                return npattn.attention_forward(q, k, v, impl="chunked", **options)

            def fwd_bwd(fwd=fwd, dout=dout):
                return npattn.attention_backward(dout, fwd()[1])

            fns.update({f"{label}forward": fwd, f"{label}fwd+bwd": fwd_bwd})
        if torch_fn is not None:
            t_plain = _torch_plain(torch, causal=bool(plain.get("causal")))
            for label, fn, (q, k, v, dout) in (("", torch_fn, own), ("plain ", t_plain, arrays)):
                tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
                tdout = torch.from_numpy(dout)

                def t_fwd(tq=tq, tk=tk, tv=tv, fn=fn):
                    with torch.no_grad():
                        return fn(tq, tk, tv)

                def t_fwd_bwd(tq=tq, tk=tk, tv=tv, tdout=tdout, fn=fn):
                    fn(tq, tk, tv).backward(tdout)

                fns.update({f"torch {label}forward": t_fwd, f"torch {label}fwd+bwd": t_fwd_bwd})
        best = _best_side_by_side(fns, repeats)
        for pass_name in ("forward", "fwd+bwd"):
            ms, plain_ms = best[pass_name] * 1e3, best[f"plain {pass_name}"] * 1e3
            t_ms = best.get(f"torch {pass_name}")
            torch_col = f"{t_ms * 1e3:9.1f}" if t_ms else f"{'-':>9}"
            ratio = f"{best[pass_name] / t_ms:6.2f}" if t_ms else f"{'-':>6}"
            t_plain_ms = best.get(f"torch plain {pass_name}")
            torch_plain = f"{t_ms / t_plain_ms:.2f}x" if t_ms else "-"
            print(f"{name:<12} {pass_name:<8} {ms:10.1f} {torch_col} {ratio} {ms / plain_ms:7.2f}x {torch_plain:>14}")


def _print_floor(shape: tuple, threads: int, rng, ours: float, torch_time: float | None) -> None:
    """One line: :func:`fwd_bwd_floor` for full attention, against npattn's
    forward+backward time and torch's (when timed) from the table above."""
    floor = fwd_bwd_floor(*shape, threads, lambda shape: rng.standard_normal(shape, dtype=np.float32))
    total = floor["products"] + floor["passes"]
    against = f"{total / torch_time:.2f}x torch's, " if torch_time else ""
    rates = ", ".join(f"{rate:.0f}" for rate in floor["rates"])
    print(
        f"full fwd+bwd floor on {threads} threads at NumPy's 1-thread speeds on the tiles: "
        f"7 products ({rates} GFLOP/s) {floor['products'] * 1e3:.1f} ms + 4 passes over the scores "
        f"{floor['passes'] * 1e3:.1f} ms = {total * 1e3:.1f} ms, {against}{total / ours:.2f}x npattn's"
    )


def _torch_plain(torch, causal: bool):
    """torch's plain attention, the variant rows' "torch ÷ plain" baseline:
    SDPA without a mask, causal or not."""

    def t_plain(tq, tk, tv):
        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    return t_plain


RELATIVE_BIAS = {"num_buckets": 32, "max_distance": 128, "bidirectional": True}  # the T5 variant


def _flex_relative_bias(torch, table, buckets):
    """``(torch forward, None)`` with FlexAttention's ``score_mod`` (compiled)
    when a tiny forward and backward run on this CPU, else ``(None, why not)``."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as error:
        return None, f"no FlexAttention ({error})"

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, buckets[q_idx, kv_idx]]

    probe = torch.zeros((1, table.shape[0], 16, 16), requires_grad=True)  # (1, N, 16, 16)
    try:
        flex_attention(probe, probe, probe, score_mod=score_mod).sum().backward()
    except Exception as error:  # torch 2.13: NotImplementedError, no backward on CPU
        return None, f"{type(error).__name__}: {error}"
    compiled = torch.compile(flex_attention)

    def t_flex(tq, tk, tv):
        return compiled(tq, tk, tv, score_mod=score_mod)

    return t_flex, None


def _sdpa_kernel(torch, *args) -> str:
    """The kernel SDPA picks for these arguments in the current grad mode."""
    try:
        return torch.nn.attention.SDPBackend(torch._fused_sdp_choice(*args, 0.0, False)).name.lower()
    except Exception:  # a private function: name nothing rather than fail
        return "unknown"


def score_mod_table(torch, shape: tuple[int, int, int, int], repeats: int) -> None:
    """Issue 15's row: T5's relative-position bias in npattn and in torch
    (FlexAttention if it runs forward and backward here, else SDPA with the
    gathered bias), beside npattn's plain attention, side by side."""
    B, N, T, H = shape
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((B, N, T, H), dtype=np.float32) for _ in range(4))
    table = (0.5 * rng.standard_normal((N, RELATIVE_BIAS["num_buckets"]))).astype(np.float32)  # (N, 32)
    mod_options = {name: RELATIVE_BIAS[name] for name in ("max_distance", "bidirectional")}
    ours = {"score_mods": [npattn.relative_position_bias(table, **mod_options)]}
    print()
    print(
        f"user score modification (issue 15): T5 relative bias, {RELATIVE_BIAS['num_buckets']} buckets, "
        f"max_distance {RELATIVE_BIAS['max_distance']}, bidirectional; B={B}, N={N}, H={H}, T=S={T}, full"
    )
    torch_fn = None
    if torch is not None:
        buckets = torch.from_numpy(npattn.t5_buckets(np.arange(T)[None, :] - np.arange(T)[:, None], **RELATIVE_BIAS))
        t_table = torch.from_numpy(table.copy()).requires_grad_()  # (N, 32), d table by autograd
        torch_fn, why_not = _flex_relative_bias(torch, t_table, buckets)
        if torch_fn is not None:
            print(f"torch side: FlexAttention score_mod, torch.compile (torch {torch.__version__})")
        else:

            def torch_fn(tq, tk, tv):
                bias = t_table[:, buckets][None]  # (1, N, T, S): table[n, bucket(j - i)]
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=bias)

            tq = torch.from_numpy(q).requires_grad_()
            with torch.no_grad():
                forward_kernel = _sdpa_kernel(torch, tq, tq, tq, t_table[:, buckets][None])
            backward_kernel = _sdpa_kernel(torch, tq, tq, tq, t_table[:, buckets][None])
            print(
                f"torch side: SDPA with the gathered float bias (1, N, T, S), kernel {forward_kernel} forward, "
                f"{backward_kernel} forward+backward (torch {torch.__version__})"
            )
            print(f"FlexAttention not used: {why_not}")
        _report_agreement(torch, (q, k, v, dout), ours, torch_fn, t_table)
    _variant_rows(torch, (q, k, v, dout), {"T5 rel. bias": (ours, {}, torch_fn, None)}, repeats)


def _report_agreement(torch, arrays, ours: dict, torch_fn, t_table) -> None:
    """Print the largest differences of out and d table between the sides."""
    q, k, v, dout = arrays
    out, res = npattn.attention_forward(q, k, v, impl="chunked", **ours)
    dtable = npattn.attention_backward(dout, res).dmods["relative_bias"]
    tq, tk, tv = (torch.from_numpy(a.copy()).requires_grad_() for a in (q, k, v))
    t_table.grad = None
    t_out = torch_fn(tq, tk, tv)
    t_out.backward(torch.from_numpy(dout))
    out_diff = float(np.max(np.abs(out - t_out.detach().numpy())))
    table_diff = float(np.max(np.abs(dtable - t_table.grad.numpy())) / np.max(np.abs(dtable)))
    t_table.grad = None
    print(f"max |npattn - torch|: out {out_diff:.1e}, d table {table_diff:.1e} (relative to max |d table|)")


if __name__ == "__main__":
    sys.exit(main())
