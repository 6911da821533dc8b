"""A lean loop for a diffrax solver: the stiff tail's Rosenbrock phase.

`diffeqsolve` drives a solver and its step-size controller, then keeps or discards the whole
solver state with a select over every leaf. For `Rodas4` with the Gauss–Newton preconditioner
that state holds the |Ω| × |Ω| Gram inverse, which the select copies at every step: ~9% of the
`scale` problem's d = 100 solve (benchmarks/README). This loop drives the same solver and
controller as `diffeqsolve` does (the same initial step, accept/reject rule, clipping to t1 and
boolean stopping test, so the same steps and endpoint), but takes the leaves the solver names in
`kept_on_rejection` from every step as they are (`Rodas4` says why that is safe for its
preconditioner; its work counters then count rejected steps too), and evaluates the stopping
test only at accepted points (at a rejected one y has not moved, and the test had not fired
there). Under vmap every member's step is computed while any member runs; a solver whose state
holds `active` (`Rodas4` under a batch axis) is told there whether its member is still
running, so that its batch-wide decisions are the running members' alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import diffrax
import jax
import jax.numpy as jnp

from ._runge_kutta import (
    DIFFRAX_FIRST_STEP,
    empty_samples,
    end_floor,
    samples_of_a_run,
    samples_within_step,
)


class SolverRun(NamedTuple):
    y: object
    t: jax.Array
    result: diffrax.RESULTS  # diffrax's: successful (reached t1), event_occurred (stopped), …
    solver_state: object
    num_steps: jax.Array
    num_accepted_steps: jax.Array
    samples: object  # `sample(t, y, args)` at each of `save_ts` (inf where not reached), or None


def state_after_step(new_state, old_state, keep, kept=()):
    """The solver state after a step: `new_state` where the step is kept, else `old_state`,
    except the entries named in `kept` (the solver's `kept_on_rejection`), which come from the
    step either way."""
    return {
        k: v
        if k in kept
        else jax.tree_util.tree_map(lambda a, b: jnp.where(keep, a, b), v, old_state[k])
        for k, v in new_state.items()
    }


def integrate_solver(
    solver: diffrax.AbstractAdaptiveSolver,
    controller: diffrax.AbstractAdaptiveStepSizeController,
    field: Callable,
    stop: Callable,
    y0,
    t1,
    args,
    max_steps: int,
    save_ts=None,
    sample: Callable | None = None,
) -> SolverRun:
    """dy/dt = `field(t, y, args)` from t = 0 towards `t1`, until `stop(t, y, args)` holds at
    an accepted point (or at y0), as `diffeqsolve(ODETerm(field), solver, 0, t1, None, y0,
    args, stepsize_controller=controller, max_steps=max_steps, event=Event(stop),
    throw=False)` would run it; with `save_ts` (non-decreasing, within [0, `t1`]) and
    `sample`, also what its `SaveAt(ts=save_ts, fn=sample)` would save."""
    term = diffrax.ODETerm(field)
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(y0))
    t0 = jnp.zeros((), dtype)
    t1 = jnp.asarray(t1, dtype)
    error_order = solver.error_order(term)
    tnext, controller_state = controller.init(
        term, t0, t1, y0, DIFFRAX_FIRST_STEP, args, solver.func, error_order
    )
    tnext = jnp.minimum(tnext, t1)
    solver_state = solver.init(term, t0, tnext, y0, args)
    kept = getattr(solver, "kept_on_rejection", ())
    t1_floor = end_floor(t1)
    at = None if sample is None else (lambda t, y: sample(t, y, args))

    def unfinished(carry):
        return (carry["tprev"] < t1) & (carry["result"] == diffrax.RESULTS.successful)

    def running(carry):
        return unfinished(carry) & (carry["num_steps"] < max_steps)

    def body(carry):
        y, tprev, tnext = carry["y"], carry["tprev"], carry["tnext"]
        state = carry["solver_state"]
        if isinstance(state, dict) and "active" in state:
            state = {**state, "active": running(carry)}
        y1, y_error, dense, new_state, solver_result = solver.step(
            term, tprev, tnext, y, args, state, False
        )
        y_error = jax.tree_util.tree_map(lambda e: jnp.where(jnp.isnan(e), jnp.inf, e), y_error)
        keep, tprev, tnext, _, controller_state, controller_result = controller.adapt_step_size(
            tprev, tnext, y, y1, args, y_error, error_order, carry["controller_state"]
        )
        tprev = jnp.minimum(tprev, t1)
        clipped = jnp.where(keep, t1, tprev + 0.5 * (t1 - tprev))
        tnext = jnp.where(tnext > t1_floor, clipped, tnext)
        select = lambda new, old: jax.tree_util.tree_map(
            lambda a, b: jnp.where(keep, a, b), new, old
        )
        solver_state = state_after_step(new_state, carry["solver_state"], keep, kept)
        saved = {}
        if save_ts is not None:
            interpolation = solver.interpolation_cls(t0=carry["tprev"], t1=carry["tnext"], **dense)
            saved = samples_within_step(save_ts, at, interpolation, carry["tnext"], keep, carry)
        y = select(y1, y)
        result = diffrax.RESULTS.where(keep, solver_result, diffrax.RESULTS.successful)
        result = diffrax.RESULTS.where(
            result == diffrax.RESULTS.successful, controller_result, result
        )
        stopped = jax.lax.cond(keep, lambda: stop(tprev, y, args), lambda: jnp.asarray(False))
        result = diffrax.RESULTS.where(stopped, diffrax.RESULTS.event_occurred, result)
        return {
            "y": y,
            "tprev": tprev,
            "tnext": tnext,
            "solver_state": solver_state,
            "controller_state": controller_state,
            "result": result,
            "num_steps": carry["num_steps"] + 1,
            "num_accepted_steps": carry["num_accepted_steps"] + keep.astype(jnp.int32),
            **saved,
        }

    zero = jnp.asarray(0, jnp.int32)
    carry = {
        "y": y0,
        "tprev": t0,
        "tnext": tnext,
        "solver_state": solver_state,
        "controller_state": controller_state,
        "result": diffrax.RESULTS.where(
            stop(t0, y0, args), diffrax.RESULTS.event_occurred, diffrax.RESULTS.successful
        ),
        "num_steps": zero,
        "num_accepted_steps": zero,
    }
    if save_ts is not None:
        save_ts = jnp.asarray(save_ts, dtype)
        carry |= empty_samples(save_ts, at, t0, y0)
    out = jax.lax.while_loop(running, body, carry)
    samples = None if save_ts is None else samples_of_a_run(out, at, t0, t1, y0)
    result = diffrax.RESULTS.where(
        unfinished(out), diffrax.RESULTS.max_steps_reached, out["result"]
    )
    return SolverRun(
        y=out["y"],
        t=out["tprev"],
        result=result,
        solver_state=out["solver_state"],
        num_steps=out["num_steps"],
        num_accepted_steps=out["num_accepted_steps"],
        samples=samples,
    )
