"""A lean adaptive explicit Runge–Kutta loop for autonomous flows that stop on their own test.

diffrax's `diffeqsolve` is general: dense output, saving, events with root finding, adjoints.
A flow that stops on a boolean test needs little of that, and at small sizes
diffrax's per-step machinery costs about as much as the gradients themselves (measured in
benchmarks/README: `other_integrators`). This loop takes the same steps as `diffeqsolve`
with diffrax's `PIDController` (integral control, the same initial step, the same
accept/reject rule), but

- the stopping test reads the last stage of a first-same-as-last tableau, which is the vector
  field at the accepted point: no extra gradient evaluation per step (diffrax evaluates an
  event's condition separately);
- the carry is only (y, its vector field, t, dt, counters, status), and the samples where
  some are asked for: taken, as `diffeqsolve`'s `SaveAt(ts=…, fn=…)` takes them, from each
  accepted step's dense output (the solver's own interpolation).

Under `vmap` every member keeps its own t and dt; the loop runs until the slowest member is done.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

# How the loop ended (`Integration.outcome`).
RUNNING, STOPPED, REACHED_END, MAX_STEPS = 0, 1, 2, 3

# diffrax's first step for an `ODETerm` wrapped as `diffeqsolve` wraps it (`dt0=None`): its
# `_select_initial_step` only recognises a bare `ODETerm`, and otherwise returns 0.01.
# gflow's own loops start there too, to stay on `diffeqsolve`'s steps.
DIFFRAX_FIRST_STEP = 0.01


def end_floor(t1, ulps: int = 100):
    """t1 − `ulps` ulp (100, as in `diffeqsolve`): a step ending past it ends at t1.

    Bit for bit what `ulps` chained `jnp.nextafter(·, −∞)` give (±0, subnormals, ±∞ and nan
    included; tests/test_flow.py), in a few integer operations on the bit pattern: in batched
    programs XLA's algebraic simplifier cycled on the chain (~12 operations a step) and
    logged an error line at every compilation."""
    t1 = jnp.asarray(t1)
    int_dtype = {8: jnp.int64, 4: jnp.int32}[t1.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(t1, int_dtype)
    top = jnp.iinfo(int_dtype).max  # all bits but the sign
    # An integer that orders the floats as they are ordered, ±0 both 0.
    key = jnp.where(bits < 0, -(bits & top), bits & top)
    infinity = jax.lax.bitcast_convert_type(jnp.asarray(jnp.inf, t1.dtype), int_dtype)
    key = jnp.maximum(key - ulps, -infinity)  # the chain stops at −∞
    floor = jnp.where(key < 0, (-key) | ~top, key)
    return jnp.where(jnp.isnan(t1), t1, jax.lax.bitcast_convert_type(floor, t1.dtype))


class Integration(NamedTuple):
    y: object
    t: jax.Array
    outcome: jax.Array  # STOPPED (the test fired at y), REACHED_END (t = t1) or MAX_STEPS
    # (out of steps, or with `stall_rejections`, that many rejected steps in a row)
    num_steps: jax.Array
    num_accepted_steps: jax.Array
    num_rejected_steps: jax.Array
    samples: object = None  # `sample` at each of `save_ts`, or None


def _combine(y, coeffs, stages, h):
    """y + h·Σ coeffs_i·stages_i, skipping zero coefficients."""
    terms = [(float(c), k) for c, k in zip(coeffs, stages, strict=False) if c != 0.0]
    if not terms:
        return y
    return jax.tree_util.tree_map(
        lambda y0, *ks: y0 + h * sum(c * k for (c, _), k in zip(terms, ks, strict=True)),
        y,
        *[k for _, k in terms],
    )


def all_finite(tree):
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


# One function on purpose (~120 lines): the loop's carry, its step and its accept/reject rule
# mirror diffrax's and are checked against it line by line; split, they would hide that.
def integrate(
    field: Callable,
    y0,
    t1,
    *,
    tableau,
    order: int,
    rtol,
    atol,
    norm: Callable,
    max_steps: int,
    safety: float = 0.9,
    factormin: float = 0.2,
    factormax: float = 10.0,
    first_step: float = DIFFRAX_FIRST_STEP,
    stall_rejections: int = 0,
    save_ts=None,
    sample: Callable | None = None,
    interpolation_cls=None,
) -> Integration:
    """Integrate dy/dt = f(y) from t = 0 towards `t1` with an embedded FSAL pair.

    `field(y)` returns `(f(y), done)`: the vector field and whether the flow should stop at `y`
    (converged or diverged). It is tested at `y0` and at every accepted point. `tableau` is a
    diffrax `ButcherTableau` with the FSAL property (Tsit5, Dopri5); `order` its order.
    Steps are controlled like diffrax's `PIDController(rtol, atol, norm=norm)`; a trial step
    with a non-finite value counts as an infinite error. With `stall_rejections` > 0 the loop
    also ends as out of steps after that many rejected steps in a row: a step size that no
    longer finds an acceptable step (it collapses to the rounding of t) would otherwise spend
    the rest of `max_steps` without moving y.

    `save_ts` (non-decreasing local times within [0, `t1`]), `sample(t, y)` and the tableau's
    dense output `interpolation_cls` (diffrax's, e.g. `Tsit5.interpolation_cls`): also
    `sample` at those times (inf where the loop did not reach them), in `Integration.samples`.
    """
    if not tableau.fsal:
        raise ValueError("the lean Runge–Kutta loop needs a first-same-as-last tableau")
    exponent = 1.0 / order  # diffrax's error order for an ODE: (order − 1) + 1
    dtype = jnp.result_type(*jax.tree_util.tree_leaves(y0))
    t1 = jnp.asarray(t1, dtype)
    f0, done0 = field(y0)
    dt0 = jnp.asarray(first_step, dtype)
    t1_floor = end_floor(t1)

    a_rows = list(tableau.a_lower)
    b_sol, b_err = tableau.b_sol, tableau.b_error

    def step(y, f, h):
        stages = [f]
        for row in a_rows[:-1]:
            k, _ = field(_combine(y, row, stages, h))
            stages.append(k)
        y1 = _combine(y, b_sol[:-1], stages, h)  # the FSAL stage's own row equals b_sol
        f1, done1 = field(y1)
        stages.append(f1)
        err = _combine(jax.tree_util.tree_map(jnp.zeros_like, y), b_err, stages, h)
        return y1, f1, done1, err, stages

    def cond(carry):
        return carry["outcome"] == RUNNING

    def body(carry):
        y, f, t, dt = carry["y"], carry["f"], carry["t"], carry["dt"]
        t_next = jnp.where(t + dt > t1_floor, t1, t + dt)
        h = t_next - t
        y1, f1, done1, err, stages = step(y, f, h)
        finite = all_finite(y1)
        scaled = jax.tree_util.tree_map(
            lambda a, b, e: e / (atol + rtol * jnp.maximum(jnp.abs(a), jnp.abs(b))),
            y,
            jax.tree_util.tree_map(lambda a, b: jnp.where(finite, b, a), y, y1),
            err,
        )
        error = norm(scaled)
        error = jnp.where(finite & jnp.isfinite(error), error, jnp.inf)
        accept = error < 1.0
        inv = jnp.where(error > 0, 1.0 / error, jnp.inf)
        factor = jnp.clip(
            safety * inv**exponent,
            jnp.where(accept, 1.0, factormin),
            jnp.where(accept, factormax, safety),
        )
        keep = lambda new, old: jax.tree_util.tree_map(
            lambda a, b: jnp.where(accept, a, b), new, old
        )
        t_new = jnp.where(accept, t_next, t)
        steps = carry["num_steps"] + 1
        accepted = carry["num_accepted_steps"] + accept
        saved = {}
        if save_ts is not None:
            # diffrax's dense output takes the stages as increments, h·f_i
            ks = jax.tree_util.tree_map(lambda *fs: jnp.stack([h * k for k in fs]), *stages)
            interpolation = interpolation_cls(t0=t, t1=t_next, y0=y, y1=y1, k=ks)
            saved = samples_within_step(save_ts, sample, interpolation, t_next, accept, carry)
        in_a_row = jnp.where(accept, 0, carry["rejected_in_a_row"] + 1)
        out_of_steps = steps >= max_steps
        if stall_rejections > 0:
            out_of_steps = out_of_steps | (in_a_row >= stall_rejections)
        outcome = jnp.where(
            accept & done1,
            STOPPED,
            jnp.where(t_new >= t1, REACHED_END, jnp.where(out_of_steps, MAX_STEPS, RUNNING)),
        )
        return {
            "y": keep(y1, y),
            "f": keep(f1, f),
            "t": t_new,
            "dt": (h * factor).astype(dtype),
            "outcome": outcome.astype(jnp.int32),
            "num_steps": steps,
            "num_accepted_steps": accepted,
            "rejected_in_a_row": in_a_row.astype(jnp.int32),
            **saved,
        }

    outcome0 = jnp.where(done0, STOPPED, jnp.where(t1 <= 0, REACHED_END, RUNNING))
    zero = jnp.asarray(0, jnp.int32)
    carry = {
        "y": y0,
        "f": f0,
        "t": jnp.zeros((), dtype),
        "dt": dt0,
        "outcome": outcome0.astype(jnp.int32),
        "num_steps": zero,
        "num_accepted_steps": zero,
        "rejected_in_a_row": zero,
    }
    if save_ts is not None:
        save_ts = jnp.asarray(save_ts, dtype)
        carry |= empty_samples(save_ts, sample, carry["t"], y0)
    out = jax.lax.while_loop(cond, body, carry)
    samples = None
    if save_ts is not None:
        samples = samples_of_a_run(out, sample, carry["t"], t1, y0)
    return Integration(
        y=out["y"],
        t=out["t"],
        outcome=out["outcome"],
        num_steps=out["num_steps"],
        num_accepted_steps=out["num_accepted_steps"],
        num_rejected_steps=out["num_steps"] - out["num_accepted_steps"],
        samples=samples,
    )


def empty_samples(save_ts, sample, t0, y0) -> dict:
    """A loop's carry for samples at `save_ts`: every row inf (not reached) until filled."""
    shapes = jax.eval_shape(sample, t0, y0)
    samples = jax.tree_util.tree_map(
        lambda s: jnp.full((save_ts.shape[0], *s.shape), jnp.inf, s.dtype), shapes
    )
    return {"samples": samples, "save_index": jnp.asarray(0, jnp.int32)}


def samples_within_step(save_ts, sample, interpolation, t_end, accepted, carry) -> dict:
    """The samples at the times in `save_ts` that an accepted step ending at `t_end` passed,
    from its dense output `interpolation` (none where the step was rejected), as
    `diffeqsolve` takes them."""
    n = save_ts.shape[0]

    def more(state):
        index, _ = state
        return accepted & (index < n) & (save_ts[jnp.minimum(index, n - 1)] <= t_end)

    def one(state):
        index, samples = state
        t = save_ts[index]
        value = sample(t, interpolation.evaluate(t))
        samples = jax.tree_util.tree_map(lambda a, v: a.at[index].set(v), samples, value)
        return index + 1, samples

    index, samples = jax.lax.while_loop(more, one, (carry["save_index"], carry["samples"]))
    return {"save_index": index, "samples": samples}


def samples_of_a_run(out, sample, t0, t1, y0):
    """A loop's samples; a run of zero length samples y0 at every time, as `diffeqsolve`
    does."""
    at_y0 = sample(t0, y0)
    return jax.tree_util.tree_map(
        lambda a, b: jnp.where(t1 == t0, jnp.broadcast_to(b, a.shape), a), out["samples"], at_y0
    )
