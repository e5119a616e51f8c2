r"""Second-order and forward-mode derivatives of a small attention layer, by hand.

    python examples/second_order.py            # E = 16, T = 12
    python examples/second_order.py --quick    # E = 8, T = 6 (used by the tests)

The layer (``E`` features, ``N`` heads of ``H = E / N``, causal, float64)::

    q, k, v = split(x Wq), split(x Wk), split(x Wv)      x (B, T, E) -> (B, N, T, H) each
    y       = merge(attention(q, k, v)) Wo               (B, T, E)
    L       = mean((y - target)^2) / 2

with ``split``/``merge`` the reshapes between ``(B, T, N H)`` and ``(B, N, T,
H)``. npattn differentiates the attention core; the projections are linear
maps, whose chain rule is one line each (``outer(a, b)`` sums ``a^T b`` over
batch and time)::

    gy   = dL/dy = (y - target) / y.size        dout = split(gy Wo^T)
    dq, dk, dv   = npattn.attention_backward(dout, res)
    dL/dWq       = outer(x, merge(dq))          (the same for Wk, Wv)
    dL/dWo       = outer(merge(out), gy)
    dL/dx        = merge(dq) Wq^T + merge(dk) Wk^T + merge(dv) Wv^T

The script

1. finds the top eigenvalue (the largest in magnitude) of the Hessian of ``L``
   with respect to ``Wq`` by power iteration on Hessian-vector products
   (forward-over-reverse: ``npattn.attention_jvp`` gives ``out'``, hence
   ``dout'``; ``npattn.attention_backward_jvp`` gives ``dq'``; ``H w =
   outer(x, merge(dq'))``), on the chunked path in linear memory. It checks one HVP
   against central differences of the gradient, builds the whole Hessian from
   ``E^2`` HVPs on the dense path (symmetric, and its eigenvalue of largest
   magnitude is the power iteration's) and compares the two paths;
2. takes one step on ``J = L + lam |dL/dx|^2``, the input-gradient penalty
   ("double backpropagation", Drucker and LeCun): its gradient runs
   ``npattn.attention_double_backward`` (reverse-over-reverse) with the
   cotangents of ``dq, dk, dv`` that the penalty hands back, then the
   ordinary backward, and is checked with ``npattn.check_gradients`` (central
   differences, full Jacobian);
3. pushes a tangent through two such layers with a ``tanh`` between
   (``npattn.attention_jvp`` in each, forward mode, as consistency models and
   MeanFlow need ``d/dt f(x_t, t)``), the input and every weight moving at
   once, and checks it with ``npattn.check_jvp`` (central differences).

Every check prints its error; the script exits with status 1 if one fails.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import npattn

NUM_HEADS = 2
WEIGHTS = ("wq", "wk", "wv", "wo")


# --- the layer and its first derivatives --------------------------------------


def split_heads(a: np.ndarray) -> np.ndarray:
    """``(B, T, N H) -> (B, N, T, H)``."""
    B, T, E = a.shape
    return a.reshape(B, T, NUM_HEADS, E // NUM_HEADS).transpose(0, 2, 1, 3)


def merge_heads(a: np.ndarray) -> np.ndarray:
    """``(B, N, T, H) -> (B, T, N H)``."""
    B, N, T, H = a.shape
    return a.transpose(0, 2, 1, 3).reshape(B, T, N * H)


def outer(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum over batch and time of a^T b``: ``(B, T, E1), (B, T, E2) -> (E1, E2)``,
    the gradient of a weight ``W`` in ``a W`` from the cotangent ``b`` of the product."""
    return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])


def init_weights(rng: np.random.Generator, E: int) -> dict[str, np.ndarray]:
    return {name: rng.standard_normal((E, E)) / np.sqrt(E) for name in WEIGHTS}


def layer_forward(w: dict, x: np.ndarray, opts: dict) -> tuple[np.ndarray, npattn.AttentionResiduals]:
    """``y = merge(attention(split(x Wq), split(x Wk), split(x Wv))) Wo`` and the residuals."""
    q, k, v = (split_heads(x @ w[name]) for name in ("wq", "wk", "wv"))  # (B, N, T, H) each
    out, res = npattn.attention_forward(q, k, v, causal=True, **opts)  # (B, N, T, H)
    return merge_heads(out) @ w["wo"], res  # (B, T, E)


def loss_and_grads(w: dict, x: np.ndarray, target: np.ndarray, opts: dict) -> tuple[float, dict]:
    """``L`` and ``dL/dW`` for the four weights (one reverse pass)."""
    y, res = layer_forward(w, x, opts)
    gy = (y - target) / y.size  # dL/dy, (B, T, E)
    g = npattn.attention_backward(split_heads(gy @ w["wo"].T), res)  # dout (B, N, T, H)
    grads = {name: outer(x, merge_heads(d)) for name, d in zip(("wq", "wk", "wv"), g)}  # (E, E) each
    grads["wo"] = outer(merge_heads(res.out), gy)
    return 0.5 * float(np.mean((y - target) ** 2)), grads


# --- 1. the top Hessian eigenvalue by power iteration on HVPs -----------------


def hvp_wq(w: dict, x: np.ndarray, target: np.ndarray, direction: np.ndarray, opts: dict) -> np.ndarray:
    """``H w'`` with ``H = d^2 L / dWq^2``, forward-over-reverse: the tangent of
    the gradient ``outer(x, merge(dq))`` when ``Wq`` moves along ``w'``."""
    y, res = layer_forward(w, x, opts)
    gy = (y - target) / y.size  # (B, T, E)
    dout = split_heads(gy @ w["wo"].T)  # (B, N, T, H)
    q_dot = split_heads(x @ direction)  # q' = split(x w'); k' = v' = 0
    zero = np.zeros_like(res.k)
    _, _, out_dot, _ = npattn.attention_jvp((res.q, res.k, res.v), (q_dot, zero, zero), causal=True, **opts)
    gy_dot = merge_heads(out_dot) @ w["wo"] / y.size  # y' / y.size: the loss's curvature (Gauss-Newton part)
    dout_dot = split_heads(gy_dot @ w["wo"].T)  # (B, N, T, H)
    g_dot = npattn.attention_backward_jvp(dout, res, (q_dot, zero, zero), dout_dot=dout_dot)
    return outer(x, merge_heads(g_dot.dq))  # (E, E)


def power_iteration(
    hvp, shape: tuple, rng: np.random.Generator, tol: float, max_iter: int
) -> tuple[float, np.ndarray, int]:
    """The eigenvalue of largest magnitude of the symmetric map ``hvp``, its unit
    eigenvector and the number of HVPs taken: ``w <- H w / |H w|``, with the
    Rayleigh quotient ``<w, H w>`` as the estimate."""
    w = rng.standard_normal(shape)
    w /= np.linalg.norm(w)
    eigenvalue = 0.0
    for step in range(1, max_iter + 1):
        hw = hvp(w)
        new = float(np.sum(w * hw))  # <w, H w>, |w| = 1
        if abs(new - eigenvalue) <= tol * abs(new):
            return new, w, step
        w, eigenvalue = hw / np.linalg.norm(hw), new
    return eigenvalue, w, max_iter


def top_eigenvalue(args: argparse.Namespace, rng: np.random.Generator) -> bool:
    E = args.features
    w = init_weights(rng, E)
    x = rng.standard_normal((args.batch, args.length, E))  # (B, T, E)
    target = rng.standard_normal((args.batch, args.length, E))  # (B, T, E)
    dense = {"impl": "dense"}
    chunked = {"impl": "chunked", "block_q": 4, "block_k": 4}  # 4 x 4 tiles: no (T, S) array kept
    eps = 1e-5

    def grad_wq(wq: np.ndarray) -> np.ndarray:
        return loss_and_grads({**w, "wq": wq}, x, target, dense)[1]["wq"]

    def fd_hvp(direction: np.ndarray) -> np.ndarray:  # central differences of the gradient
        return (grad_wq(w["wq"] + eps * direction) - grad_wq(w["wq"] - eps * direction)) / (2 * eps)

    def relative(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max() / np.abs(b).max())

    # One HVP against central differences of the gradient, along a random direction.
    direction = rng.standard_normal((E, E))
    hvp = hvp_wq(w, x, target, direction, chunked)
    fd_error = relative(fd_hvp(direction), hvp)
    print(f"HVP (chunked) vs central differences of the gradient (eps {eps:g}): relative error {fd_error:.1e}")

    # Power iteration on the chunked path's HVPs; the eigenvalue's Rayleigh quotient by central differences.
    eigenvalue, vector, steps = power_iteration(
        lambda d: hvp_wq(w, x, target, d, chunked), (E, E), rng, tol=1e-13, max_iter=args.max_iter
    )
    fd_eigenvalue = float(np.sum(vector * fd_hvp(vector)))  # <w, H w> with a finite-difference H w
    rayleigh_error = abs(fd_eigenvalue - eigenvalue) / abs(eigenvalue)
    print(
        f"power iteration (chunked): top eigenvalue {eigenvalue:.10g} after {steps} HVPs; "
        f"<w, H w> by central differences {fd_eigenvalue:.10g}, relative error {rayleigh_error:.1e}"
    )

    # The whole Hessian from E^2 HVPs on the basis (dense path): symmetric, with the same extreme eigenvalue.
    basis = np.eye(E * E).reshape(E * E, E, E)
    hessian = np.stack([hvp_wq(w, x, target, e, dense).ravel() for e in basis])  # (E^2, E^2), row a: H e_a
    asymmetry = relative(hessian, hessian.T)
    paths_error = relative(hessian @ direction.ravel(), hvp.ravel())
    spectrum = np.linalg.eigvalsh(0.5 * (hessian + hessian.T))
    top, second = spectrum[np.argsort(-np.abs(spectrum))[:2]]  # largest magnitudes
    eig_error = abs(eigenvalue - top) / abs(top)
    print(
        f"the whole Hessian d^2L/dWq^2 ({E * E} x {E * E}, {E * E} dense HVPs): relative asymmetry "
        f"{asymmetry:.1e}; times the direction vs the chunked HVP: {paths_error:.1e}\n"
        f"  its eigenvalues of largest magnitude (eigvalsh): {top:.10g}, {second:.4g} (ratio "
        f"{abs(second / top):.2f}: the power iteration's rate); vs the power iteration: {eig_error:.1e}"
    )
    ok = fd_error < 1e-7 and rayleigh_error < 1e-7 and asymmetry < 1e-10 and paths_error < 1e-10 and eig_error < 1e-8
    print(f"  {'ok' if ok else 'FAILED'}: the HVPs are the Hessian's, and so is the eigenvalue")
    return ok


# --- 2. a gradient-penalty step: reverse over reverse -------------------------


def penalty_and_grads(w: dict, x: np.ndarray, target: np.ndarray, lam: float, opts: dict) -> tuple[float, float, dict]:
    """``J = L + lam |dL/dx|^2``, ``|dL/dx|^2`` and ``dJ/dW`` for the four weights.

    Reverse over the backward: the penalty's cotangent of ``gx = dL/dx`` is
    ``c = 2 lam gx``; through ``gx = merge(dq) Wq^T + ...`` it reaches ``Wq``
    directly (``outer(c, merge(dq))``) and ``dq`` as ``split(c Wq)``;
    ``attention_double_backward`` turns the cotangents of ``dq, dk, dv`` into
    those of ``q, k, v`` and ``dout``; ``dout = split(gy Wo^T)`` passes them
    to ``gy`` and ``Wo``, and ``gy = (y - target) / n`` to ``y``, where the
    loss's own ``dL/dy`` joins; the ordinary backward takes them from there."""
    y, res = layer_forward(w, x, opts)
    n = y.size
    gy = (y - target) / n  # dL/dy, (B, T, E)
    dout = split_heads(gy @ w["wo"].T)  # (B, N, T, H)
    g = npattn.attention_backward(dout, res)
    dqkv = {"wq": g.dq, "wk": g.dk, "wv": g.dv}  # (B, N, T, H) each
    gx = sum(merge_heads(dqkv[name]) @ w[name].T for name in dqkv)  # dL/dx, (B, T, E)
    penalty = float(np.sum(gx**2))
    c = 2 * lam * gx  # cotangent of gx
    grads = {name: outer(c, merge_heads(dqkv[name])) for name in dqkv}  # gx's direct use of Wq, Wk, Wv
    dd = [split_heads(c @ w[name]) for name in dqkv]  # cotangents of dq, dk, dv
    second = npattn.attention_double_backward(*dd, res, dout)  # SecondOrderCotangents: dq, dk, dv, ddout, ...
    c_dout = merge_heads(second.ddout)  # (B, T, E)
    grads["wo"] = outer(c_dout, gy)  # through dout = split(gy Wo^T)
    c_y = (c_dout @ w["wo"]) / n + gy  # cotangent of y: through gy, plus the loss's dL/dy
    grads["wo"] += outer(merge_heads(res.out), c_y)  # through y = merge(out) Wo
    first = npattn.attention_backward(split_heads(c_y @ w["wo"].T), res)  # the ordinary backward
    for name, d2, d1 in zip(("wq", "wk", "wv"), second, first):  # q, k, v's cotangents: both routes
        grads[name] += outer(x, merge_heads(d2 + d1))
    loss = 0.5 * float(np.mean((y - target) ** 2))
    return loss + lam * penalty, penalty, grads


def gradient_penalty_step(args: argparse.Namespace, rng: np.random.Generator) -> bool:
    E, lam, lr = args.features, args.penalty, args.lr
    w = init_weights(rng, E)
    x = rng.standard_normal((args.batch, args.length, E))  # (B, T, E)
    target = rng.standard_normal((args.batch, args.length, E))  # (B, T, E)
    chunked = {"impl": "chunked", "block_q": 4, "block_k": 4}

    def forward(*weights):  # check_gradients' pair over the four weights, J as a 0-d output
        J, _, grads = penalty_and_grads(dict(zip(WEIGHTS, weights)), x, target, lam, chunked)
        return np.asarray(J), grads

    def backward(dJ, grads):
        return tuple(dJ * grads[name] for name in WEIGHTS)

    result = npattn.check_gradients(
        forward, backward, [w[name] for name in WEIGHTS], names=list(WEIGHTS), raise_on_failure=False
    )
    print(f"npattn.check_gradients, dJ/dW of J = L + {lam:g} |dL/dx|^2 (chunked): {result}")
    J, penalty, grads = penalty_and_grads(w, x, target, lam, chunked)
    _, _, loss_grads = penalty_and_grads(w, x, target, 0.0, chunked)  # dL/dW alone
    _, _, dense_grads = penalty_and_grads(w, x, target, lam, {"impl": "dense"})

    def norm(g: dict) -> float:
        return float(np.sqrt(sum(np.sum(g[name] ** 2) for name in WEIGHTS)))

    share = norm({name: grads[name] - loss_grads[name] for name in WEIGHTS}) / norm(grads)
    paths = max(float(np.abs(grads[name] - dense_grads[name]).max()) for name in WEIGHTS)
    print(
        f"  the penalty's part of |dJ/dW|: {share:.0%} (so the check sees the double backward); "
        f"chunked vs dense dJ/dW: max difference {paths:.1e}"
    )
    stepped = {name: w[name] - lr * grads[name] for name in WEIGHTS}
    J_new, penalty_new, _ = penalty_and_grads(stepped, x, target, lam, chunked)
    print(
        f"one step of gradient descent (lr {lr:g}): J {J:.6f} -> {J_new:.6f}, "
        f"|dL/dx|^2 {penalty:.6f} -> {penalty_new:.6f}"
    )
    ok = result.ok and share > 0.1 and paths < 1e-12 and J_new < J
    print(f"  {'ok' if ok else 'FAILED'}: the penalty's gradient is right and the step lowers J")
    return ok


# --- 3. a JVP through two layers ------------------------------------------------


def layer_jvp(w: dict, w_dot: dict, x: np.ndarray, x_dot: np.ndarray, opts: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(y, y')``: forward mode through the layer, with the input and every weight moving."""
    qkv = [split_heads(x @ w[name]) for name in ("wq", "wk", "wv")]  # (B, N, T, H) each
    dots = [split_heads(x_dot @ w[name] + x @ w_dot[name]) for name in ("wq", "wk", "wv")]  # product rule
    out, _, out_dot, _ = npattn.attention_jvp(tuple(qkv), tuple(dots), causal=True, **opts)  # (B, N, T, H) x 2
    y = merge_heads(out) @ w["wo"]  # (B, T, E)
    return y, merge_heads(out_dot) @ w["wo"] + merge_heads(out) @ w_dot["wo"]


def two_layers(x, *weights, opts: dict) -> np.ndarray:
    """``z = layer2(tanh(layer1(x)))``; the eight weights in ``WEIGHTS`` order, layer 1's first."""
    w1, w2 = dict(zip(WEIGHTS, weights[:4])), dict(zip(WEIGHTS, weights[4:]))
    h = np.tanh(layer_forward(w1, x, opts)[0])  # (B, T, E)
    return layer_forward(w2, h, opts)[0]


def two_layers_jvp(primals, tangents, opts: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(z, z')`` along tangents of the input and all eight weights."""
    x, x_dot = primals[0], tangents[0]
    w1, w2 = (dict(zip(WEIGHTS, primals[i : i + 4])) for i in (1, 5))
    w1_dot, w2_dot = (dict(zip(WEIGHTS, tangents[i : i + 4])) for i in (1, 5))
    y1, y1_dot = layer_jvp(w1, w1_dot, x, x_dot, opts)
    h = np.tanh(y1)
    h_dot = (1 - h**2) * y1_dot  # tanh' = 1 - tanh^2
    return layer_jvp(w2, w2_dot, h, h_dot, opts)


def two_layer_jvp(args: argparse.Namespace, rng: np.random.Generator) -> bool:
    E = args.features
    x = rng.standard_normal((args.batch, args.length, E))
    weights = [*init_weights(rng, E).values(), *init_weights(rng, E).values()]
    names = ["x"] + [f"layer{i}.{name}" for i in (1, 2) for name in WEIGHTS]
    ok = True
    for opts in ({"impl": "dense"}, {"impl": "chunked", "block_q": 4, "block_k": 4}):
        result = npattn.check_jvp(
            lambda *inputs, opts=opts: two_layers(*inputs, opts=opts),
            lambda primals, tangents, opts=opts: two_layers_jvp(primals, tangents, opts),
            [x, *weights],
            names=names,
            raise_on_failure=False,
        )
        print(f"npattn.check_jvp, two layers with tanh between, impl={opts['impl']!r}: {result}")
        ok = ok and result.ok
    print(f"  {'ok' if ok else 'FAILED'}: the JVP is the central difference's")
    return ok


# --- main ------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="E = 8, T = 6, for a fast check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--penalty", type=float, default=10.0, help="lam, the weight of |dL/dx|^2")
    parser.add_argument("--lr", type=float, default=0.5, help="the penalty step's learning rate")
    parser.add_argument("--max-iter", type=int, default=500, help="power iteration's most HVPs")
    args = parser.parse_args(argv)
    args.features, args.length, args.batch = (8, 6, 2) if args.quick else (16, 12, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print(f"B = {args.batch}, T = {args.length}, E = {args.features}, N = {NUM_HEADS} heads, causal, float64\n")
    print("1. the top eigenvalue of d^2L/dWq^2 (forward-over-reverse)")
    checks = [top_eigenvalue(args, rng)]
    print("\n2. a gradient-penalty step (reverse-over-reverse)")
    checks.append(gradient_penalty_step(args, rng))
    print("\n3. a JVP through two attention layers (forward mode)")
    checks.append(two_layer_jvp(args, rng))
    print("\n" + ("every check passed" if all(checks) else f"{checks.count(False)} check(s) FAILED"))
    return 0 if all(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
