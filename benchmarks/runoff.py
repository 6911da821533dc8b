"""`python -m benchmarks.runoff`: what limits the stiff tail's steps on a run-off flow.

A probe for the lead of benchmarks/README ("What limits the run-off steps"), not a solver.
On one 112-flow sweep point whose σ₁ runs off (depth 4, α = 1e-4, seed 2), it integrates
the same stretch of flow time twice, side by side:

- gflow's stiff tail (RODAS4P2): its tail steps between two `t_max` stops;
- a three-stage Radau IIA prototype (order 5, stiffly accurate collocation), each step's
  stage equations solved by Newton's method with every stage's own Jacobian (the closed-form
  Hessian at that stage, or with `--linear gauss-newton` its Gauss–Newton part and the rest
  from an earlier state), a dense 3P × 3P solve, and the local error by step doubling;
- and gflow's own Radau IIA tail (`tail_method="radau"`, gflow/engine/_radau.py), which
  solves the Gauss–Newton Newton matrix through a 3|Ω| system and steps by RADAU5's
  embedded estimate: its tail steps between the same two stops.

It prints the step counts, the prototype's Newton work and how far apart the singular values
end. The prototype's wall time is not a cost estimate (step doubling triples its work, and a
dense 3P solve is the simplest way to take a Newton iteration); gflow's is.
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
from gflow.engine import _radau  # noqa: E402
from gflow.engine._dynamics import FieldArgs, physical_field, physical_jacobian  # noqa: E402
from gflow.engine._solve import _setup  # noqa: E402
from gflow.sweeps._build import build  # noqa: E402

RADAU_IIA = _radau.A
ORDER = 5


# The 112-flow sweep's flow options (`scale`'s `random_mask_sweep`): the probes run its points
# at these unless told otherwise.
SWEEP_RTOL, SWEEP_MAX_STEPS = 1e-10, 100_000


def sweep_point(depth, alpha, seed, dim=8):
    """(problem, init) of a point of the 112-flow sweep's family (at dimension `dim`)."""
    point = dict(
        depth=depth, alpha=alpha, seed=seed, dim=dim, density=0.5, rank=2, noise=0.0, m=1.0
    )
    return build(point, "bernoulli", "gaussian")


def radau_prototype(
    problem, model, options, newton_tol, max_newton=10, linear="dense", refresh=None
):
    """A jitted `attempt(y, h, r0)`: a step and two half steps, the step-doubling error (in
    units of the tail's tolerance), whether all three Newton solves converged, their
    iterations and how many times the stage Jacobians were evaluated.

    Each Newton iteration solves the dense 3P × 3P system with the stage Jacobians of
    `linear`: `"dense"`, each stage's Hessian; `"gauss-newton"`, each stage's Gauss–Newton
    matrix GᵢᵀGᵢ plus the residual part R₀ = ∇²loss − GᵀG taken at an earlier state (`r0`,
    from `attempt.residual_part`), the approximation gflow's `tail_method="radau"` solves
    through a 3|Ω| system. `refresh`: the iterations (from the first) that evaluate the
    stage Jacobians; later ones reuse the last (None: every iteration)."""
    flat, unravel = ravel_pytree(model)
    size = flat.size
    rtol, atol = _setup(problem, model, options, None).tail_tolerance
    a = jnp.asarray(RADAU_IIA)
    args = FieldArgs(problem, 0.0, False, None)  # the stiff tail's own field and Jacobian

    def rates(x):
        return ravel_pytree(physical_field(0.0, {"model": unravel(x)}, args)["model"])[0]

    def jacobian(x):
        return physical_jacobian(0.0, {"model": unravel(x)}, args)

    entries = int(np.sum(np.asarray(problem.mask) == 1))

    def observed_jacobian(x):
        return _radau.observed_jacobian(unravel(x), problem, None, entries)

    def gauss_newton(x):
        g = observed_jacobian(x)
        return -g.T @ g

    def tolerance(x):
        layers = unravel(x).layers
        scale = jnp.concatenate([jnp.full(w.size, jnp.sqrt(jnp.mean(w**2))) for w in layers])
        return atol + rtol * jnp.maximum(jnp.abs(x), scale)

    def residual_part(x):
        """−(∇²loss − GᵀG) at x, the Hessian's part that the residual weights, and its
        eigendecomposition."""
        r0 = jacobian(x) - gauss_newton(x)
        return r0, jnp.linalg.eigh(r0)

    def step(y0, h, r0):
        tol = tolerance(y0)

        def stage_jacobians(stages):
            if linear == "dense":
                return jax.vmap(jacobian)(stages)
            return jax.vmap(gauss_newton)(stages) + r0[0][None]

        def newton(state):
            z, it, _, jacobians, refreshes = state
            stages = y0[None] + z
            residual = z - h * a @ jax.vmap(rates)(stages)
            fresh = True if refresh is None else it < refresh
            jacobians = jax.lax.cond(fresh, stage_jacobians, lambda _: jacobians, stages)
            refreshes = refreshes + fresh
            blocks = [[a[i, j] * jacobians[j] for j in range(3)] for i in range(3)]
            matrix = jnp.eye(3 * size) - h * jnp.block(blocks)
            dz = jnp.linalg.solve(matrix, -residual.reshape(-1)).reshape(3, size)
            change = jnp.sqrt(jnp.mean((dz[2] / tol) ** 2))
            return z + dz, it + 1, change, jacobians, refreshes

        def going(state):
            _, it, change, *_ = state
            return (it < max_newton) & (change > newton_tol) & jnp.isfinite(change)

        jacobians = jnp.zeros((3, size, size))
        start = (jnp.zeros((3, size)), 0, jnp.asarray(1e30), jacobians, 0)
        z, iterations, change, _, refreshes = jax.lax.while_loop(going, newton, start)
        return y0 + z[2], iterations, change <= newton_tol, refreshes

    @jax.jit
    def attempt(y0, h, r0):
        whole, i1, ok1, r1 = step(y0, h, r0)
        half, i2, ok2, r2 = step(y0, h / 2, r0)
        y1, i3, ok3, r3 = step(half, h / 2, r0)
        error = jnp.sqrt(jnp.mean(((whole - y1) / tolerance(y0)) ** 2)) / (2**ORDER - 1)
        return y1, error, ok1 & ok2 & ok3, i1 + i2 + i3, r1 + r2 + r3

    attempt.residual_part = jax.jit(residual_part)

    return flat, unravel, attempt


def integrate(attempt, y, t, t_end, h, residual_every=1, max_attempts=20_000):
    """`residual_every`: accepted steps between evaluations of the residual part of the
    Hessian (also after every Newton failure); unused where the Newton matrix is exact."""
    accepted = rejected = newton_failures = newton = refreshes = residual_parts = 0
    r0, since = None, 0
    while t < t_end:
        if accepted + rejected >= max_attempts:
            raise SystemExit(f"the prototype stalled at t = {t:.3g} after {max_attempts} attempts")
        if r0 is None or since >= residual_every:
            r0, since, residual_parts = attempt.residual_part(y), 0, residual_parts + 1
        h = min(h, t_end - t)
        y1, error, ok, iterations, fresh = attempt(y, h, r0)
        error, ok = float(error), bool(ok)
        newton, refreshes = newton + int(iterations), refreshes + int(fresh)
        if not ok:
            r0 = None
        if ok and error <= 1.0:
            y, t, accepted, since = y1, t + h, accepted + 1, since + 1
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
        stage_jacobians=refreshes,
        residual_parts=residual_parts,
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
    parser.add_argument(
        "--linear",
        choices=("dense", "gauss-newton"),
        default="dense",
        help="the Newton matrix's stage Jacobians: each stage's Hessian, or each stage's "
        "Gauss–Newton matrix plus the residual part taken at an earlier state (gflow's "
        "`tail_method='radau'` solves that one through a 3|Ω| system)",
    )
    parser.add_argument(
        "--refresh",
        type=int,
        default=None,
        help="Newton iterations that evaluate the stage Jacobians (default: all)",
    )
    parser.add_argument(
        "--residual-every",
        type=int,
        default=1,
        help="accepted steps between evaluations of the residual part (gauss-newton)",
    )
    args = parser.parse_args(argv)
    depth, alpha, seed = int(args.point[0]), args.point[1], int(args.point[2])
    t0, t1 = args.span
    problem, init = sweep_point(depth, alpha, seed)
    options = gflow.FlowOptions()

    runs = {}
    for method in ("rosenbrock", "radau"):
        for t in (t0, t1):
            result = gflow.flow(problem, init, gflow.FlowOptions(t_max=t, tail_method=method))
            tail = result.work().get("stiff tail", {}).get("steps", 0)
            runs[method, t] = (result, tail, result.wall_time_s)
    start, rodas_t0, wall_t0 = runs["rosenbrock", t0]
    end, rodas_t1, wall_t1 = runs["rosenbrock", t1]
    radau_end, radau_t1, radau_wall_t1 = runs["radau", t1]
    _, radau_t0, radau_wall_t0 = runs["radau", t0]
    if start.status_label != "t_max" or end.status_label != "t_max":
        raise SystemExit(
            f"the flow ended before the span: {start.status_label}, {end.status_label}"
        )

    flat, unravel, attempt = radau_prototype(
        problem, start.model, options, args.newton_tol, linear=args.linear, refresh=args.refresh
    )
    attempt(flat, 1e-6 * t0, attempt.residual_part(flat))  # compile outside the clock
    clock = time.perf_counter()
    y, counts = integrate(attempt, flat, t0, t1, 1e-4 * t0, args.residual_every)
    radau_wall = time.perf_counter() - clock
    sv_radau = np.asarray(gflow.singular_values(unravel(y)))[:3]
    sv_rodas = np.asarray(gflow.singular_values(end.model))[:3]

    print(f"point (depth, α, seed) = ({depth}, {alpha:g}, {seed}), flow time {t0:.3g} → {t1:.3g}")
    print(f"  σ at {t0:.3g}: {np.asarray(gflow.singular_values(start.model))[:3]}")
    print(
        f"  RODAS4P2 (gflow's tail): {rodas_t1 - rodas_t0} tail steps "
        f"(solves to each end: {wall_t0:.1f} s, {wall_t1:.1f} s)"
    )
    print(
        f"  Radau IIA prototype: {counts['accepted']} accepted, {counts['rejected']} rejected "
        f"({counts['newton_failures']} by Newton), {counts['newton_iterations']} Newton "
        f"iterations, {counts.get('stage_jacobians', counts['accepted'] + counts['rejected'])} "
        f"Newton matrices, {counts['residual_parts']} residual parts, {radau_wall:.1f} s"
    )
    sv_gflow_radau = np.asarray(gflow.singular_values(radau_end.model))[:3]
    print(
        f"  gflow's Radau tail: {radau_t1 - radau_t0} tail steps (solves to each end: "
        f"{radau_wall_t0:.1f} s, {radau_wall_t1:.1f} s), top-3 σ at {t1:.3g} relative to "
        f"RODAS4P2's: {np.abs(sv_gflow_radau / sv_rodas - 1)}"
    )
    print(
        f"  tail steps, RODAS4P2 / Radau accepted: "
        f"{(rodas_t1 - rodas_t0) / max(counts['accepted'], 1):.0f}×"
    )
    print(f"  top-3 σ at {t1:.3g}, relative difference: {np.abs(sv_radau / sv_rodas - 1)}")


if __name__ == "__main__":
    main()
