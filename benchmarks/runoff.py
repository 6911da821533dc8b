"""`python -m benchmarks.runoff`: what limits the stiff tail's steps on a run-off flow.

A probe for the lead of benchmarks/README ("What limits the run-off steps"), not a solver.
On one 112-flow sweep point whose σ₁ runs off (depth 4, α = 1e-4, seed 2), it integrates
the same stretch of flow time twice, side by side:

- gflow's stiff tail (RODAS4P2): its tail steps between two `t_max` stops;
- a three-stage Radau IIA prototype (order 5, stiffly accurate collocation), each step's
  stage equations solved by Newton's method with every stage's own Jacobian (the closed-form
  Hessian at that stage), a dense 3P × 3P solve, and the local error by step doubling.

It prints both step counts, the prototype's Newton work and how far apart the singular values
end. The prototype's wall time is not a cost estimate: step doubling triples its work and the
dense 3P solve is the simplest, not the cheapest, way to take a Newton iteration.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402
from gflow.engine._dynamics import FieldArgs, physical_field, physical_jacobian  # noqa: E402
from gflow.engine._solve import _setup  # noqa: E402
from gflow.sweeps._build import build  # noqa: E402

_S6 = np.sqrt(6.0)
RADAU_IIA = np.array(
    [
        [(88 - 7 * _S6) / 360, (296 - 169 * _S6) / 1800, (-2 + 3 * _S6) / 225],
        [(296 + 169 * _S6) / 1800, (88 + 7 * _S6) / 360, (-2 - 3 * _S6) / 225],
        [(16 - _S6) / 36, (16 + _S6) / 36, 1 / 9],
    ]
)
ORDER = 5


def sweep_point(depth, alpha, seed):
    point = dict(depth=depth, alpha=alpha, seed=seed, dim=8, density=0.5, rank=2, noise=0.0, m=1.0)
    return build(point, "bernoulli", "gaussian")


def radau_prototype(problem, model, options, newton_tol, max_newton=10):
    """A jitted `attempt(y, h)`: two half steps, the step-doubling error (in units of the
    tail's tolerance), whether all three Newton solves converged, and their iterations."""
    flat, unravel = ravel_pytree(model)
    size = flat.size
    rtol, atol = _setup(problem, model, options, None).tail_tolerance
    a = jnp.asarray(RADAU_IIA)
    args = FieldArgs(problem, 0.0, False, None)  # the stiff tail's own field and Jacobian

    def rates(x):
        return ravel_pytree(physical_field(0.0, {"model": unravel(x)}, args)["model"])[0]

    def jacobian(x):
        return physical_jacobian(0.0, {"model": unravel(x)}, args)

    def tolerance(x):
        layers = unravel(x).layers
        scale = jnp.concatenate([jnp.full(w.size, jnp.sqrt(jnp.mean(w**2))) for w in layers])
        return atol + rtol * jnp.maximum(jnp.abs(x), scale)

    def step(y0, h):
        tol = tolerance(y0)

        def newton(state):
            z, it, _ = state
            stages = y0[None] + z
            residual = z - h * a @ jax.vmap(rates)(stages)
            jacobians = jax.vmap(jacobian)(stages)
            blocks = [[a[i, j] * jacobians[j] for j in range(3)] for i in range(3)]
            matrix = jnp.eye(3 * size) - h * jnp.block(blocks)
            dz = jnp.linalg.solve(matrix, -residual.reshape(-1)).reshape(3, size)
            return z + dz, it + 1, jnp.sqrt(jnp.mean((dz[2] / tol) ** 2))

        def going(state):
            _, it, change = state
            return (it < max_newton) & (change > newton_tol) & jnp.isfinite(change)

        start = (jnp.zeros((3, size)), 0, jnp.asarray(1e30))
        z, iterations, change = jax.lax.while_loop(going, newton, start)
        return y0 + z[2], iterations, change <= newton_tol

    @jax.jit
    def attempt(y0, h):
        whole, i1, ok1 = step(y0, h)
        half, i2, ok2 = step(y0, h / 2)
        y1, i3, ok3 = step(half, h / 2)
        error = jnp.sqrt(jnp.mean(((whole - y1) / tolerance(y0)) ** 2)) / (2**ORDER - 1)
        return y1, error, ok1 & ok2 & ok3, i1 + i2 + i3

    return flat, unravel, attempt


def integrate(attempt, y, t, t_end, h, max_attempts=20_000):
    accepted = rejected = newton_failures = newton = 0
    while t < t_end:
        if accepted + rejected >= max_attempts:
            raise SystemExit(f"the prototype stalled at t = {t:.3g} after {max_attempts} attempts")
        h = min(h, t_end - t)
        y1, error, ok, iterations = attempt(y, h)
        error, ok = float(error), bool(ok)
        newton += int(iterations)
        if ok and error <= 1.0:
            y, t, accepted = y1, t + h, accepted + 1
            h *= 5.0 if error == 0 else min(5.0, max(0.2, 0.9 * error ** (-1 / (ORDER + 1))))
        elif not ok:
            rejected, newton_failures, h = rejected + 1, newton_failures + 1, h / 4
        else:
            rejected, h = rejected + 1, h * max(0.2, 0.9 * error ** (-1 / (ORDER + 1)))
    return y, dict(
        accepted=accepted,
        rejected=rejected,
        newton_failures=newton_failures,
        newton_iterations=newton,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--point", type=float, nargs=3, default=(4, 1e-4, 2), metavar=("DEPTH", "ALPHA", "SEED")
    )
    parser.add_argument("--span", type=float, nargs=2, default=(1e8, 3e8), metavar=("T0", "T1"))
    parser.add_argument(
        "--newton-tol",
        type=float,
        default=3e-2,
        help="Newton stops when its last change is this × the tail's tolerance",
    )
    args = parser.parse_args(argv)
    depth, alpha, seed = int(args.point[0]), args.point[1], int(args.point[2])
    t0, t1 = args.span
    problem, init = sweep_point(depth, alpha, seed)
    options = gflow.FlowOptions()

    runs = {}
    for t in (t0, t1):
        clock = time.perf_counter()
        result = gflow.flow(problem, init, gflow.FlowOptions(t_max=t))
        tail = result.work().get("stiff tail", {}).get("steps", 0)
        runs[t] = (result, tail, time.perf_counter() - clock)
    start, rodas_t0, wall_t0 = runs[t0]
    end, rodas_t1, wall_t1 = runs[t1]
    if start.status_label != "t_max" or end.status_label != "t_max":
        raise SystemExit(
            f"the flow ended before the span: {start.status_label}, {end.status_label}"
        )

    flat, unravel, attempt = radau_prototype(problem, start.model, options, args.newton_tol)
    attempt(flat, 1e-6 * t0)  # compile outside the clock
    clock = time.perf_counter()
    y, counts = integrate(attempt, flat, t0, t1, 1e-4 * t0)
    radau_wall = time.perf_counter() - clock
    sv_radau = np.asarray(gflow.singular_values(unravel(y)))[:3]
    sv_rodas = np.asarray(gflow.singular_values(end.model))[:3]

    print(f"point (depth, α, seed) = ({depth}, {alpha:g}, {seed}), flow time {t0:.3g} → {t1:.3g}")
    print(f"  σ at {t0:.3g}: {np.asarray(gflow.singular_values(start.model))[:3]}")
    print(
        f"  RODAS4P2 (gflow's tail): {rodas_t1 - rodas_t0} tail steps "
        f"(flows to each end: {wall_t0:.1f} s, {wall_t1:.1f} s)"
    )
    print(
        f"  Radau IIA prototype: {counts['accepted']} accepted, {counts['rejected']} rejected "
        f"({counts['newton_failures']} by Newton), {counts['newton_iterations']} Newton "
        f"iterations, {radau_wall:.1f} s"
    )
    print(
        f"  tail steps, RODAS4P2 / Radau accepted: "
        f"{(rodas_t1 - rodas_t0) / max(counts['accepted'], 1):.0f}×"
    )
    print(f"  top-3 σ at {t1:.3g}, relative difference: {np.abs(sv_radau / sv_rodas - 1)}")


if __name__ == "__main__":
    main()
