"""`python -m benchmarks.radau_step`: the Radau tail's linear algebra, today's against earlier.

The Radau IIA tail (gflow/engine/_radau.py) spends its time in Newton's matrix and in the
stage solves with it. Since the twenty-sixth session they keep R₀'s `NEWTON_BASIS` (32)
eigenpairs largest in |e| and take R₀ as zero outside them (way "kept"); before, all P
("all"). Since the twenty-third session the stage solves run in the eigenbasis of R₀ (the
Hessian's residual part), where N₀ = I + h(A ⊗ R₀) is a real 3 × 3 block per eigenvalue:
two passes through E a solve, real arithmetic, and the small system's row permutation taken
once per factorisation. Before ("previous", with all P eigenpairs), each solve went through E
four times with A's complex eigenvectors, and `jax.scipy.linalg.lu_solve` turned the pivots
into a permutation at each solve. Since the twenty-seventh session the kept eigenpairs are
refreshed by a Rayleigh–Ritz step from the last ones; "eigh" refreshes them by a full
eigendecomposition, as before. This probe keeps the earlier formulation
(`previous_stage_system`, `previous_stage_solve`) and times the ways (`--ways`, all four by
default) in one process, alternated:

- for each point (depth:α:seed@t, a d = 8 point of the 112-flow sweep and a flow time inside
  its Radau tail), `gflow.flow` at the sweep's options to that time;
- from there `--attempts` Radau attempts in one compiled loop, each sized by the tail's own
  step-size controller and kept or rejected as gflow's loop does, compiled each way
  (gflow's compiler options; compilation outside the clock), `--rounds` rounds in
  alternation from the same state;
- per way: ms an attempt, Newton iterations an attempt, the attempts accepted, the flow time
  reached, and how far each way's parameters end from the first way's (relative, max over
  entries; the ways' rounding differs, and the flows' step sequences with it).

    python -m benchmarks.radau_step 5:1e-2:0@1e15 4:1e-4:2@1e9 --attempts 300 --rounds 6
    python -m benchmarks.radau_step 4:1e-4:2@1e9 --ways kept eigh
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

jax.config.update("jax_enable_x64", True)

import diffrax  # noqa: E402

import gflow  # noqa: E402
from gflow.engine import _radau  # noqa: E402
from gflow.engine._compile import compiler_options  # noqa: E402
from gflow.engine._dynamics import FieldArgs, physical_field  # noqa: E402
from gflow.engine._flow import RADAU_MULTIPLE, observed_bound  # noqa: E402
from gflow.engine._solve import _setup, _solvers  # noqa: E402
from gflow.engine._solver_loop import state_after_step  # noqa: E402

from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL, sweep_point  # noqa: E402
from .tails import parse_point  # noqa: E402

WAYS = ("kept", "eigh", "all", "previous")  # gflow's first


def previous_stage_system(g, h, e, basis):
    """Newton's matrix as the tail formed it before: the stages' G kept, the small system's
    pivots kept (`jax.scipy.linalg.lu_factor`)."""
    m, size = g.shape[1], g.shape[2]
    dtype = g.dtype
    inverse = 1.0 / (1.0 + h * jnp.asarray(_radau.LAMBDA)[:, None] * e[None, :])
    weights = jnp.stack([jnp.real(inverse[0]), jnp.real(inverse[1]), jnp.imag(inverse[1])])
    g_hat = (g @ basis).reshape(3 * m, size)
    kernels = (g_hat[None] * weights[:, None, :]).reshape(9 * m, size) @ g_hat.T
    spread = lambda w: jnp.kron(jnp.asarray(w, dtype), jnp.ones((m, m), dtype))
    mix = _radau.MIX
    mixes = (
        spread(np.real(mix[:, 0])),
        spread(2 * np.real(mix[:, 1])),
        -spread(2 * np.imag(mix[:, 1])),
    )
    capacity = sum(w * k for w, k in zip(mixes, kernels.reshape(3, 3 * m, 3 * m), strict=True))
    small = jax.scipy.linalg.lu_factor(jnp.eye(3 * m, dtype=dtype) + h * capacity)
    return g, e, small


def previous_stage_solve(system, h, basis, rhs):
    """M⁻¹ rhs as the tail solved it before: N₀⁻¹ through A's complex eigenvectors in the
    original basis (four passes through E), the pivots made a permutation at each solve."""
    g, e, small = system
    q, q_inverse = jnp.asarray(_radau.Q), jnp.asarray(_radau.Q_INVERSE)
    scale = 1.0 + h * jnp.asarray(_radau.LAMBDA)[:, None] * e[None, :]

    def n0_solve(x):
        x = (q_inverse @ (x @ basis).astype(q.dtype)) / scale
        return jnp.real(q @ x) @ basis.T

    u = n0_solve(rhs)
    c = jax.scipy.linalg.lu_solve(small, jnp.einsum("iop,ip->io", g, u).reshape(-1))
    a = jnp.asarray(_radau.A, rhs.dtype)
    return u - n0_solve(h * a @ jnp.einsum("iop,io->ip", g, c.reshape(3, g.shape[1])))


@contextlib.contextmanager
def traced(way):
    """Within the block, the Radau step traces with the linear algebra of `way`."""
    saved = _radau.stage_system, _radau.stage_solve
    if way == "previous":
        _radau.stage_system, _radau.stage_solve = previous_stage_system, previous_stage_solve
    try:
        yield
    finally:
        _radau.stage_system, _radau.stage_solve = saved


def solver_for(way, solver):
    """The engine's Radau solver as `way` runs it: R₀'s kept eigenpairs refreshed by
    Rayleigh–Ritz ("kept") or by a full eigendecomposition ("eigh"), or all of them."""
    if way == "kept":
        return solver
    if way == "eigh":
        return dataclasses.replace(solver, ritz=False)
    return dataclasses.replace(solver, basis_size=None)


def parse_case(text):
    point, _, t_max = text.partition("@")
    return parse_point(point), float(t_max)


def tail_from(point, t_max, rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS):
    """The flow of `point` to `t_max` (or the end of its budget) and the Radau tail the engine
    would step it on with: (result, solver, terms, args, controller)."""
    problem, init = sweep_point(*point)
    options = gflow.FlowOptions(rtol=rtol, max_steps=max_steps, t_max=t_max)
    result = gflow.flow(problem, init, options)
    setup = _setup(problem, result.model, options, None, method="radau")
    bound = observed_bound(problem, RADAU_MULTIPLE)
    solver = _solvers(options, setup, None, bound, method="radau")["stiff"]
    args = FieldArgs(problem, 0.0, False, None, setup.tail_compensated)
    return result, solver, diffrax.ODETerm(physical_field), args, setup.tail_controller


def attempts_program(way, solver, terms, args, controller, start, attempts):
    """`attempts` Radau attempts from `start` = (t0, t1, y, state, control), each sized by
    the controller and kept or rejected as gflow's loop does, in one program compiled with
    `way`'s linear algebra (`solver` as `solver_for(way, …)` made it): returns the final
    (t0, t1, y, state, control) and the attempts accepted."""
    order = solver.error_order(terms)

    def attempt(_, carry):
        (t0, t1, y0, state, control), accepted = carry
        y1, error, _, new, _ = solver.step(terms, t0, t1, y0, args, state, False)
        keep, t0, t1, _, control, _ = controller.adapt_step_size(
            t0, t1, y0, y1, args, error, order, control
        )
        y = jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), y1, y0)
        state = state_after_step(new, state, keep, solver.kept_on_rejection)
        return (t0, t1, y, state, control), accepted + keep.astype(jnp.int32)

    def run(start):
        return jax.lax.fori_loop(0, attempts, attempt, (start, jnp.asarray(0, jnp.int32)))

    with traced(way):
        return jax.jit(run).lower(start).compile(compiler_options=compiler_options())


def start_of(solver, terms, args, controller, t0, y):
    """(t0, t1, y, state, control) of a Radau run from (t0, y), a first step of 1e-6·t0."""
    state = solver.init(terms, t0, jnp.inf, y, args)
    order = solver.error_order(terms)
    _, control = controller.init(terms, t0, jnp.inf, y, 1e-6 * t0, args, solver.func, order)
    return jax.tree_util.tree_map(jnp.asarray, (t0, t0 + 1e-6 * t0, y, state, control))


def timed(program, start):
    """Seconds, Newton iterations, attempts accepted, the flow time reached and the final
    parameters of a run."""
    clock = time.perf_counter()
    (t, _, y, state, _), accepted = jax.block_until_ready(program(start))
    seconds = time.perf_counter() - clock
    iterations = int(state["iters"]) - int(start[3]["iters"])
    return seconds, iterations, int(accepted), float(t), np.asarray(ravel_pytree(y)[0])


def compare(case, attempts, rounds, ways=WAYS):
    """Rows (way, round, ms an attempt, iterations an attempt, accepted, t reached / t0) and
    each way's parameters' relative distance from the first way's after the last round."""
    point, t_max = case
    result, solver, terms, args, controller = tail_from(point, t_max)
    t0 = float(result.t_end)
    y = {"model": result.model}
    solvers = {w: solver_for(w, solver) for w in ways}
    starts = {w: start_of(solvers[w], terms, args, controller, t0, y) for w in ways}
    programs = {
        w: attempts_program(w, solvers[w], terms, args, controller, starts[w], attempts)
        for w in ways
    }
    rows, ends = [], {}
    for k in range(rounds):
        for way in ways:
            seconds, iterations, accepted, t, end = timed(programs[way], starts[way])
            ms = 1e3 * seconds / attempts
            rows.append((way, k, ms, iterations / attempts, accepted, t / t0))
            ends[way] = end
    first = ends[ways[0]]
    scale = np.maximum(np.abs(first), np.sqrt(np.mean(first**2)))
    apart = {w: float(np.max(np.abs(ends[w] - first) / scale)) for w in ways[1:]}
    return result, rows, apart


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", type=parse_case, default=[parse_case("5:1e-2:0@1e15")])
    parser.add_argument("--attempts", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per case")
    parser.add_argument(
        "--ways", nargs="+", choices=WAYS, default=list(WAYS), help="the first is the reference"
    )
    args = parser.parse_args(argv)
    ways = tuple(args.ways)
    for case in args.cases:
        result, rows, apart = compare(case, args.attempts, args.rounds, ways)
        print(f"{case[0]} from t = {float(result.t_end):.4g} ({result.status_label}):")
        for way, k, ms, iterations, accepted, reached in rows:
            print(
                f"  {way:>9} round {k}: {ms:6.3f} ms an attempt, {iterations:.2f} Newton "
                f"iterations an attempt, {accepted}/{args.attempts} accepted, t × {reached:.3g}"
            )
        mean = {w: np.mean([r[2] for r in rows if r[0] == w]) for w in ways}
        ratios = ", ".join(f"{w} / {ways[0]} {mean[w] / mean[ways[0]]:.2f}" for w in ways[1:])
        distances = ", ".join(f"{w} {d:.1e}" for w, d in apart.items())
        print(
            f"  ms an attempt, mean over rounds: {ratios}; parameters apart after "
            f"{args.attempts} attempts (relative): {distances}"
        )


if __name__ == "__main__":
    main()
