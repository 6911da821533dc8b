"""`python -m benchmarks.newton`: what sets the Radau tail's steps where a flow crawls.

For a d = 8 point of the `scale` benchmark's 112-flow sweep (depth:α:seed) it runs
`gflow.flow` at the sweep's options to the end of its step budget (`--max-steps`), or to
`--t-max` to look inside a tail that converges, then takes `--attempts` more steps of
gflow's own Radau IIA tail from there, one at a time from Python, each sized by the tail's
own step-size controller. For each attempt it keeps h/t, the Newton iterations, whether
Newton failed, and RADAU5's embedded error estimate with and without the Newton-aware floor
(`_radau.NEWTON_ERROR`) that the controller sees. It prints how the rejections split (Newton
failures, estimates over the tolerance) and the estimate against the floor: where the
estimate is far below the tolerance and the steps still do not grow, Newton's iterations, not
the error, set the step (benchmarks/README, "twentieth session"). It also
prints ‖∇²loss‖ and its lowest eigenvalue where the flow stopped, and h·ε·‖∇²loss‖ of the
accepted steps, about ε times the condition number of Newton's matrix: the run-off crawl's
steps, and a dense exact Newton's, stop where it nears 1 (benchmarks/README, "twenty-first
session").

    python -m benchmarks.newton 5:3e-4:2 --attempts 3000
    python -m benchmarks.newton 5:1e-2:0 --attempts 400 --t-max 1e15
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

jax.config.update("jax_enable_x64", True)

import gflow  # noqa: E402
from gflow.engine._radau import NEWTON_ERROR, layer_scaled_tolerance  # noqa: E402
from gflow.engine._solver_loop import state_after_step  # noqa: E402
from gflow.model import loss_hessian  # noqa: E402

from .radau_step import start_of, tail_from  # noqa: E402
from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL  # noqa: E402
from .tails import parse_point  # noqa: E402


def crawl(point, attempts, rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS, t_max=math.inf):
    """The flow of `point` to the end of its budget (or to `t_max`), then `attempts` Radau
    steps from there: the flow's result and a dict of per-attempt arrays (`h_over_t`, `h`,
    `iterations`, `newton_failed`, `accepted`, `estimate`: RMS of the embedded estimate over
    the tolerance, `reported`: the same with the Newton-aware floor), with the spectrum of
    ∇²loss where the flow stopped (`hessian`: its eigenvalues, ascending)."""
    result, solver, terms, args, controller = tail_from(point, t_max, rtol, max_steps)
    model, problem = result.model, args.problem
    order = solver.error_order(terms)
    floors = jnp.asarray(NEWTON_ERROR)

    @jax.jit
    def attempt(t0, t1, y0, state, control):
        y1, error, _, new, _ = solver.step(terms, t0, t1, y0, args, state, False)
        keep, next_t0, next_t1, _, control, _ = controller.adapt_step_size(
            t0, t1, y0, y1, args, error, order, control
        )
        iterations = new["iters"] - state["iters"]
        flats = (ravel_pytree(y0)[0], ravel_pytree(y1)[0])
        tol = layer_scaled_tolerance(y0, *flats, step_tolerance=solver.step_tolerance)
        reported = ravel_pytree(error)[0]
        floor = floors[jnp.minimum(iterations, len(NEWTON_ERROR) - 1)] * tol
        # `step` adds the floor with the estimate's own sign: |reported| = |estimate| + floor
        estimate = reported - jnp.sign(reported) * floor
        rms = lambda x: jnp.sqrt(jnp.mean((x / tol) ** 2))
        row = (iterations, new["stale"], keep, rms(estimate), rms(reported))
        return y1, new, keep, next_t0, next_t1, control, row

    # the first attempt 1e-6·t long; the controller sizes the others
    t0, t1, y, state, control = start_of(
        solver, terms, args, controller, float(result.t_end), {"model": model}
    )
    rows, h_over_t, lengths = [], [], []
    for _ in range(attempts):
        y1, new, keep, next_t0, next_t1, control, row = attempt(t0, t1, y, state, control)
        length = float(t1) - float(t0)
        h_over_t.append(length / float(t0))
        lengths.append(length)
        rows.append([float(x) for x in row])
        if bool(keep):
            y = y1
        # as gflow's loop does: a rejected step keeps only what the solver names
        state = state_after_step(new, state, keep, solver.kept_on_rejection)
        t0, t1 = next_t0, next_t1
    columns = np.asarray(rows).T
    return result, {
        "h_over_t": np.asarray(h_over_t),
        "h": np.asarray(lengths),
        "iterations": columns[0].astype(int),
        "newton_failed": columns[1].astype(bool),
        "accepted": columns[2].astype(bool),
        "estimate": columns[3],
        "reported": columns[4],
        "t": (float(result.t_end), float(t0)),
        "hessian": np.linalg.eigvalsh(np.asarray(loss_hessian(model, problem))),
    }


def summary(result, runs) -> list[str]:
    accepted, failed = runs["accepted"], runs["newton_failed"]
    errors = ~accepted & ~failed
    iterations = runs["iterations"]
    counts = np.bincount(iterations, minlength=8)[1:]
    estimate = runs["estimate"][~failed]
    sigma = np.asarray(gflow.singular_values(result.model))[:3]
    t0, t1 = runs["t"]
    spectrum = runs["hessian"]
    norm, eps = np.abs(spectrum).max(), np.finfo(spectrum.dtype).eps
    resolved = (
        "beyond float64's resolution ε‖∇²loss‖"
        if abs(spectrum[0]) > 10 * eps * norm
        else "within 10 ε‖∇²loss‖ of 0: rounding"
    )
    return [
        f"  the flow: {result.status_label} at t = {t0:.4g}, loss {float(result.loss):.3g}, "
        f"top σ {sigma}, radau tail {result.work().get('radau tail')}",
        f"  {accepted.size} attempts to t = {t1:.4g}: {accepted.sum()} accepted, "
        f"{failed.sum()} Newton failures, {errors.sum()} estimates over the tolerance",
        f"  Newton iterations: {iterations.mean():.2f} an attempt; attempts by iterations "
        f"1…7: {counts.tolist()}",
        f"  embedded estimate / tolerance (RMS, Newton converged): median "
        f"{np.median(estimate):.2e}, max {estimate.max():.2e}; with the Newton-aware floor: "
        f"median {np.median(runs['reported'][~failed]):.2e}",
        f"  h/t of accepted steps: median {np.median(runs['h_over_t'][accepted]):.2e}, "
        f"range {runs['h_over_t'][accepted].min():.2e} … {runs['h_over_t'][accepted].max():.2e}",
        f"  ∇²loss where the flow stopped: ‖∇²loss‖ {norm:.3g}, λ_min {spectrum[0]:.3g} "
        f"({resolved}); accepted steps' h·ε·‖∇²loss‖: median "
        f"{np.median(runs['h'][accepted]) * eps * norm:.3g} (ε times the Newton matrix's "
        f"condition number, about)",
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("point", type=parse_point, help="depth:alpha:seed of the sweep")
    parser.add_argument("--attempts", type=int, default=3000)
    parser.add_argument("--rtol", type=float, default=SWEEP_RTOL)
    parser.add_argument("--max-steps", type=int, default=SWEEP_MAX_STEPS)
    parser.add_argument("--t-max", type=float, default=math.inf, help="stop the flow here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    result, runs = crawl(args.point, args.attempts, args.rtol, args.max_steps, args.t_max)
    print(f"point (depth, α, seed) = {args.point}, {time.perf_counter() - start:.1f} s")
    for line in summary(result, runs):
        print(line)


if __name__ == "__main__":
    main()
