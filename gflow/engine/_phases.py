"""One clock phase of a solve: integrate from a state until the phase's end, and say how it
ended. A phase runs in one of gflow's own loops (`_runge_kutta` for an explicit phase,
`_solver_loop` for the stiff tail; samples from their steps' dense output) or in diffrax's
`diffeqsolve` (a finite horizon, implicit solvers, fixed steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx

from ..model import Factorization, tree_dot
from ._compensated import gradient_rounding
from ._dynamics import (
    FieldArgs,
    loss_clock_field,
    loss_clock_rates,
    loss_time_scale,
    masked_loss_and_gradient,
    physical_field,
    physical_rates,
)
from ._result import Status, select_status, solver_code
from ._runge_kutta import REACHED_END, STOPPED, all_finite, integrate
from ._solver_loop import integrate_solver
from ._stopping import ROUNDING_RATIO, convergence, is_diverged, rounding_ratio

CONTINUE = -1  # a phase that reached its end without a final status: the next phase goes on


class StepStats(eqx.Module):
    """The work of one phase: steps, vector-field evaluations (−1 for diffrax's implicit
    solvers, whose Newton iterations are not reported), and the linear-solver work of a
    Rosenbrock phase: CG iterations (Hessian-vector products) and factorisations (dense
    Cholesky/LU, or preconditioner builds). `solver_code` is diffrax's result (0: ok)."""

    num_steps: jax.Array
    num_accepted_steps: jax.Array
    num_rejected_steps: jax.Array
    linear_iters: jax.Array
    rhs_evals: jax.Array
    solver_code: jax.Array
    factorizations: jax.Array = eqx.field(
        default_factory=lambda: jnp.asarray(0, jnp.int32), converter=jnp.asarray
    )


class PhaseRun(eqx.Module):
    """Where a phase ended: its final state, its local time, its status, its work and its
    trajectory samples (a dict, empty when nothing is saved)."""

    y: dict
    t: jax.Array
    status: jax.Array
    stats: StepStats
    samples: dict


class Setup(eqx.Module):
    """What every phase of one solve shares."""

    problem: object
    layer_mask: jax.Array | None
    rtol: float
    atol: jax.Array | float
    controller: diffrax.AbstractStepSizeController
    tail_controller: diffrax.AbstractStepSizeController  # `FlowOptions.tail_rtol`'s
    tail_tolerance: tuple  # the stiff tail's (rtol, atol): its controller's and CG's
    t_max: jax.Array
    loss_floor: jax.Array  # rtol × the initial loss: below it the rounding floor does not apply
    divergence_bound: float = eqx.field(static=True)
    finite_horizon: bool = eqx.field(static=True)
    save_ts: tuple | None = eqx.field(static=True)
    save: int = eqx.field(static=True)
    summary: Callable | None = eqx.field(static=True)
    rounding_floor: bool = eqx.field(static=True, default=False)  # checked now: `for_tail`
    tail_rounding_floor: bool = eqx.field(static=True, default=False)  # the option
    compensated: str = eqx.field(static=True, default="never")  # the gradient's, now
    tail_compensated: str = eqx.field(static=True, default="never")  # the option

    def for_tail(self) -> Setup:
        """This set-up with the stiff tail's step controller (`FlowOptions.tail_rtol`), its
        compensated gradient (`FlowOptions.compensated_gradient`) and, if asked for
        (`FlowOptions.rounding_floor`), its rounding floor; the stopping rule keeps `rtol` and
        `atol`."""
        return dataclasses.replace(
            self,
            controller=self.tail_controller,
            rounding_floor=self.tail_rounding_floor,
            compensated=self.tail_compensated,
        )

    def done(self, loss, g, model):
        """Converged, diverged or (in the stiff tail, if asked for) at the rounding floor: the
        phase's status tells which."""
        ratio, diverged = convergence(
            loss, g, model, self.rtol, self.atol, self.layer_mask, self.divergence_bound
        )
        stop = (ratio <= 1.0) | diverged
        if self.rounding_floor:
            stop = stop | self.at_rounding_floor(loss, g, model)
        return stop

    def at_rounding_floor(self, loss, g, model):
        """The gradient is rounding (`rounding_ratio` ≤ `ROUNDING_RATIO`) while the loss is still
        above `loss_floor`: a plateau the opt-in rounding floor stops on."""
        ratio = rounding_ratio(g, model, self.problem, self.layer_mask)
        return (loss > self.loss_floor) & (ratio <= ROUNDING_RATIO)

    def stop(self, t, y, args, **kwargs):
        loss, g = masked_loss_and_gradient(
            y["model"], self.problem, self.layer_mask, self.compensated
        )
        return self.done(loss, g, y["model"])

    @property
    def stop_evals(self) -> int:
        """Gradient evaluations of one `stop` test: with the rounding floor, a second one
        associated the other way (`rounding_ratio`)."""
        return 2 if self.rounding_floor else 1

    @property
    def status_evals(self) -> int:
        """Gradient evaluations of `_status` at a phase's end: the divergence test's, and the
        rounding floor's test (`stop_evals`) where it applies."""
        return 1 + (self.stop_evals if self.rounding_floor else 0)


class FiniteErrorPID(diffrax.PIDController):
    """A PID controller that treats an overflowing trial step as a plain rejection, and that
    can hold a layer's entries to the layer's scale and leave out of a step's error what
    rounding in the vector field puts there.

    - diffrax's controller computes the next step from the error norm; a trial step that
      overflows (large α: the polynomial vector field explodes before the controller has
      learned the step size) gives inf − inf = nan there, and a nan step size never recovers.
      Here a non-finite candidate counts as an infinite error, so the step shrinks instead.
    - `rounding_gain` κ > 0 (physical time only): each parameter's tolerance is widened by
      κ·h·δg, δg the bound on the rounding in its gradient component (`gradient_rounding`)
      and κ the factor by which the solver's error estimate can amplify rounding in its stage
      evaluations. In a direction where the true gradient vanishes (a converged direction or
      a symmetry of the factorisation) the error estimate is h × rounding: a smaller step
      does not make it smaller relative to the work (more steps carry the same rounding),
      and without this the controller pins h where h·δg meets the tolerance: a plateau at
      t ~ 1e10 then takes 95k steps instead of 3.7k (docs/theory.md §5).
    - `layer_scale` (physical time only): each parameter's tolerance is atol + rtol·max(|θ_i|,
      s_l), s_l the RMS entry of its layer at the step's start, instead of atol + rtol·|θ_i|
      (`FlowOptions.tail_scale`): X reads a layer through matrix products, and entries far
      below their layer's size otherwise set the step (docs/theory.md §5).
    - `stall_rejections` > 0: that many rejected steps in a row end the solve as out of steps
      (`max_steps_reached`), as `_runge_kutta.integrate` does with the same argument.
    """

    rounding_gain: float = 0.0
    layer_scale: bool = False
    stall_rejections: int = 0

    def init(self, terms, t0, t1, y0, dt0, args, func, error_order):
        t1, state = super().init(terms, t0, t1, y0, dt0, args, func, error_order)
        if self.stall_rejections > 0:
            state = (state, jnp.asarray(0, jnp.int32))  # and the rejections in a row
        return t1, state

    def adapt_step_size(
        self, t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
    ):
        finite = all_finite(y1_candidate)
        y1_candidate = jax.tree_util.tree_map(
            lambda a, b: jnp.where(finite, b, a), y0, y1_candidate
        )
        y_error = jax.tree_util.tree_map(
            lambda e: jnp.where(finite & jnp.isfinite(e), e, jnp.inf), y_error
        )
        widened = self.rounding_gain > 0 or self.layer_scale
        if widened and isinstance(args, FieldArgs) and not args.loss_clock:
            y_error = self._widened(t1 - t0, y0, y1_candidate, args, y_error)
        if self.stall_rejections <= 0:
            return super().adapt_step_size(
                t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
            )
        state, in_a_row = controller_state
        keep, next_t0, next_t1, jump, state, result = super().adapt_step_size(
            t0, t1, y0, y1_candidate, args, y_error, error_order, state
        )
        in_a_row = jnp.where(keep, 0, in_a_row + 1).astype(jnp.int32)
        stalled = in_a_row >= self.stall_rejections
        result = diffrax.RESULTS.where(stalled, diffrax.RESULTS.max_steps_reached, result)
        return keep, next_t0, next_t1, jump, (state, in_a_row), result

    def _widened(self, h, y0, y1, args, y_error):
        """The model's error rescaled so that diffrax's norm of it reads |e| against the
        widened tolerance atol + rtol·max(|y|, s_l) + κ·h·δg instead of atol + rtol·|y|
        (s_l: the RMS entry of the layer at the step's start, with `layer_scale`)."""
        rounding = None
        if self.rounding_gain > 0:
            rounding = gradient_rounding(y0["model"], args.problem, args.layer_mask).layers

        def rescale(e, a, b, delta):
            size = jnp.maximum(jnp.abs(a), jnp.abs(b))
            tolerance = self.atol + self.rtol * size
            # wide/tolerance, never e·tolerance/wide: a near-singular stage can make y1 and
            # the tolerance ~1e235, whose product overflows, and a nan step never recovers
            ratio = 1.0
            if self.layer_scale:
                scale = jnp.sqrt(jnp.mean(a**2))
                ratio = (self.atol + self.rtol * jnp.maximum(size, scale)) / tolerance
            if delta is not None:
                ratio = ratio + self.rounding_gain * jnp.abs(h) * delta / tolerance
            return e / ratio

        layers = zip(y_error["model"].layers, y0["model"].layers, y1["model"].layers, strict=True)
        model = [
            rescale(e, a, b, None if rounding is None else rounding[i])
            for i, (e, a, b) in enumerate(layers)
        ]
        return {**y_error, "model": Factorization(tuple(model))}


def rhs_evals_per_step(solver) -> int:
    """Vector-field evaluations per step: one per stage of an explicit tableau (but the first
    of a first-same-as-last one, the last stage of the step before), of a RODAS tableau (the
    first from its linearisation) and of Euler; −1 for other solvers (not counted), among
    them diffrax's implicit ones (Kvaerno5: their Newton iterations stay inside diffrax)."""
    from ._rosenbrock import TABLEAUS, Rodas4

    if isinstance(solver, Rodas4):
        return TABLEAUS[solver.tableau].stages
    if isinstance(solver, diffrax.Euler):
        return 1
    tableau = getattr(solver, "tableau", None)
    if not isinstance(tableau, diffrax.ButcherTableau) or _implicit(tableau):
        return -1
    stages = len(tableau.c) + 1
    return stages - 1 if tableau.fsal else stages


def _implicit(tableau) -> bool:
    return tableau.a_diagonal is not None and bool(np.any(np.asarray(tableau.a_diagonal) != 0))


def _first_stage(solver) -> bool:
    """Whether the solver is one of diffrax's first-same-as-last explicit Runge–Kutta methods,
    which take f(y0) before the first step (`_initial_solver_state`)."""
    return isinstance(solver, diffrax.AbstractERK) and solver.tableau.fsal


def _initial_solver_state(solver, field, y0, args):
    """diffrax's initial state of `solver`, except that a first-same-as-last explicit method
    gets f(y0) now: left to diffrax, its first step evaluates it, and so does every retry of a
    rejected first step (the same value each time, uncounted by its statistics). The steps
    are the same."""
    if not _first_stage(solver):
        return None
    return (jnp.asarray(False), field(jnp.zeros(()), y0, args))


def summary(save_layers: bool, num_sv: int):
    """A trajectory sample: physical time, loss, top singular values (and the layers)."""

    def fn(t, y, args: FieldArgs):
        model = y["model"]
        x = model.product()
        out = {
            "t": y["t"] if args.loss_clock else t + args.t_offset,
            "loss": args.problem.loss(x),
            "sv": jnp.linalg.svd(x, compute_uv=False)[:num_sv],
        }
        if save_layers:
            out["layers"] = model
        return out

    return fn


def lean_phase(
    setup: Setup,
    solver,
    rates,
    y0,
    t1,
    max_steps,
    end_status,
    stall_rejections=0,
    grid=None,
    args: FieldArgs | None = None,
    extra_evals=0,
) -> PhaseRun:
    """One phase in gflow's own Runge–Kutta loop (`_runge_kutta.integrate`); with a `grid`
    of local times, also the trajectory's samples there (`setup.summary` with `args`).
    `extra_evals`: gradients the phase took outside the loop."""

    def field(y):
        dy, loss, g = rates(y, setup.problem, setup.layer_mask)
        return dy, setup.done(loss, g, y["model"])

    sampled = {}
    if grid is not None:
        sampled = dict(
            save_ts=grid,
            sample=lambda t, y: setup.summary(t, y, args),
            interpolation_cls=solver.interpolation_cls,
        )
    run = integrate(
        field,
        y0,
        t1,
        tableau=solver.tableau,
        order=solver.order(None),
        rtol=setup.rtol,
        atol=setup.atol,
        norm=setup.controller.norm,
        max_steps=max_steps,
        stall_rejections=stall_rejections,
        **sampled,
    )
    status = select_status(
        [
            (is_diverged(run.y["model"], setup.problem, setup.divergence_bound), Status.DIVERGED),
            (run.outcome == STOPPED, Status.CONVERGED),
            (run.outcome == REACHED_END, end_status),
        ],
        otherwise=Status.MAX_STEPS,
    )
    stats = StepStats(
        num_steps=run.num_steps,
        num_accepted_steps=run.num_accepted_steps,
        num_rejected_steps=run.num_rejected_steps,
        linear_iters=jnp.asarray(0, jnp.int32),
        # f(y0) (which also tests y0), every stage after the first of each step, and the
        # divergence test at the end
        rhs_evals=2 + extra_evals + rhs_evals_per_step(solver) * run.num_steps,
        solver_code=jnp.asarray(0, jnp.int32),  # the loop has no failure mode of its own
    )
    return PhaseRun(run.y, run.t, status, stats, {} if grid is None else dict(run.samples))


def loss_clock_phase(
    setup: Setup, solver, y0, tau_end, dt0, max_steps, n_samples, lean, stall_rejections=0
):
    """The loss clock (t carried as a state) from τ = 0 to `tau_end`, or until the stopping
    rule fires; with a finite horizon it also stops where t reaches `t_max`. With
    `stall_rejections` > 0 that many rejected steps in a row end it as out of steps."""
    grid = None
    if n_samples:
        grid = jnp.where(jnp.isfinite(tau_end), tau_end, 30.0) * jnp.linspace(0, 1, n_samples)
    if lean:
        args = FieldArgs(setup.problem, 0.0, True, setup.layer_mask)
        return lean_phase(
            setup,
            solver,
            loss_clock_rates,
            y0,
            tau_end,
            max_steps,
            CONTINUE,
            stall_rejections,
            grid=grid,
            args=args,
        )
    if stall_rejections > 0 and isinstance(setup.controller, FiniteErrorPID):
        controller = dataclasses.replace(setup.controller, stall_rejections=stall_rejections)
        setup = dataclasses.replace(setup, controller=controller)
    conditions = {"stop": setup.stop}
    root_finder = None
    if setup.finite_horizon:
        # Relative, so that the root finder's absolute tolerance (1e-12) is within float64's
        # resolution of t: as (t − t_max) it asked for 1e-12 at t ~ 1e4, where one ulp is
        # 1.8e-12, never converged, and reported `failed` for a flow that had reached t_max.
        conditions["t_max"] = lambda t, y, args, **kw: y["t"] / setup.t_max - 1.0
        # SVD, not lineax's default QR, whose LAPACK call has no export guarantee: a
        # program holding it could not be stored (every process traced it again)
        root_finder = optx.Newton(rtol=1e-12, atol=1e-12, linear_solver=lx.SVD())
    sol = _diffeqsolve(
        setup,
        loss_clock_field,
        solver,
        y0,
        tau_end,
        dt0,
        FieldArgs(setup.problem, 0.0, True, setup.layer_mask),
        max_steps,
        diffrax.Event(conditions, root_finder=root_finder),
        grid,
    )
    return _diffrax_run(setup, sol, solver, end_status=CONTINUE, samples=grid is not None)


def physical_phase(setup: Setup, solver, y0, t_offset, t1, dt0, max_steps, lean) -> PhaseRun:
    """Physical time from local time 0 (absolute time `t_offset`) to `t1`, or until the
    stopping rule fires."""
    grid = _sample_grid(setup, y0, t_offset, t1)
    args = FieldArgs(setup.problem, t_offset, False, setup.layer_mask, setup.compensated)
    spacing = _spacing_evals(setup)
    if lean:
        run = lean_phase(
            setup,
            solver,
            physical_rates,
            y0,
            t1,
            max_steps,
            Status.T_MAX,
            grid=grid,
            args=args,
            extra_evals=spacing,
        )
    else:
        sol = _diffeqsolve(
            setup,
            physical_field,
            solver,
            y0,
            t1,
            dt0,
            args,
            max_steps,
            diffrax.Event({"stop": setup.stop}),
            grid,
        )
        run = _diffrax_run(setup, sol, solver, Status.T_MAX, grid is not None, spacing)
    samples = _within_phase(setup, run.samples, t_offset, run.t)
    return PhaseRun(run.y, run.t, run.status, run.stats, samples)


def _sample_grid(setup: Setup, y0, t_offset, t1):
    """A physical phase's sample times in its local time, or None: `save_ts` clipped into the
    phase, or `save` times spaced geometrically from the loss time-scale at y0 (from 1e-3 of
    it to `t1`, or to 1e8 of it on an infinite horizon)."""
    dtype = t_offset.dtype if hasattr(t_offset, "dtype") else jnp.float64
    if setup.save_ts is not None:
        return jnp.clip(jnp.asarray(setup.save_ts, dtype) - t_offset, 0.0, t1)
    if not setup.save:
        return None
    loss, g = masked_loss_and_gradient(y0["model"], setup.problem, setup.layer_mask)
    h = loss_time_scale(loss, tree_dot(g, g))
    h = jnp.where(h > 0, h, 1.0)
    hi = jnp.where(jnp.isfinite(t1), t1, h * 1e8)
    lo = jnp.minimum(h * 1e-3, hi)
    n = setup.save
    grid = jnp.concatenate([jnp.zeros(1, dtype), jnp.geomspace(1.0, hi / lo, n - 1) * lo])
    return jnp.minimum(grid, t1)


def _spacing_evals(setup: Setup) -> int:
    """Gradients a physical phase takes outside its solver: with `save` (not `save_ts`), the
    one at y0 that spaces the samples."""
    return int(setup.save_ts is None and bool(setup.save))


def _within_phase(setup: Setup, samples: dict, t_offset, t_end) -> dict:
    """A physical phase's `samples` (the phase ran from `t_offset` for `t_end`), with
    requested `save_ts` outside the phase (clipped into it by `_sample_grid`) marked
    invalid."""
    if setup.save_ts is None:
        return samples
    ts = jnp.asarray(setup.save_ts, t_end.dtype)
    inside = (ts >= t_offset) & (ts <= t_offset + t_end)
    return samples | {"t": jnp.where(inside, samples["t"], jnp.inf)}


def stiff_phase(setup: Setup, solver, y0, t_offset, t1, max_steps) -> PhaseRun:
    """The stiff tail in physical time from local time 0 (absolute time `t_offset`) to `t1`, or
    until the stopping rule fires, in `_solver_loop`'s lean loop (it keeps the preconditioner
    out of a copy per step; samples from the steps' dense output, as `diffeqsolve` takes
    them); with a fixed step in `diffeqsolve`."""
    if not isinstance(setup.controller, diffrax.AbstractAdaptiveStepSizeController):
        return physical_phase(setup, solver, y0, t_offset, t1, None, max_steps, lean=False)
    args = FieldArgs(setup.problem, t_offset, False, setup.layer_mask, setup.compensated)
    grid = _sample_grid(setup, y0, t_offset, t1)
    run = integrate_solver(
        solver,
        setup.controller,
        physical_field,
        setup.stop,
        y0,
        t1,
        args,
        max_steps,
        save_ts=grid,
        sample=setup.summary if grid is not None else None,
    )
    stopped = run.result == diffrax.RESULTS.event_occurred
    status = _status(setup, run.y, run.result, stopped, False, Status.T_MAX)
    per_step = rhs_evals_per_step(solver)
    counted = isinstance(run.solver_state, dict) and "evaluations" in run.solver_state
    stats = StepStats(
        num_steps=run.num_steps,
        num_accepted_steps=run.num_accepted_steps,
        num_rejected_steps=run.num_steps - run.num_accepted_steps,
        # every stage of every step (and those solved again densely; or the evaluations the
        # solver counted itself), the stopping rule at y0 and at each accepted point, the
        # status at the end, and the samples' spacing
        rhs_evals=(run.solver_state["evaluations"] if counted else per_step * run.num_steps)
        + _redone_stages(run.solver_state)
        + setup.stop_evals * (run.num_accepted_steps + 1)
        + setup.status_evals
        + _spacing_evals(setup)
        if per_step > 0 or counted
        else jnp.where(run.num_steps > 0, -1, _spacing_evals(setup)),
        solver_code=solver_code(run.result),
        **_linear_work(run.solver_state),
    )
    samples = {} if grid is None else _within_phase(setup, dict(run.samples), t_offset, run.t)
    return PhaseRun(run.y, run.t, status, stats, samples)


def _diffeqsolve(setup: Setup, field, solver, y0, t1, dt0, args, max_steps, event, grid):
    """`diffeqsolve` from local time 0 to `t1`; it reports its failures, it does not raise."""
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        solver,
        t0=0.0,
        t1=t1,
        dt0=dt0,
        y0=y0,
        args=args,
        stepsize_controller=setup.controller,
        max_steps=max_steps,
        event=event,
        saveat=_saveat(grid, setup.summary),
        solver_state=_initial_solver_state(solver, field, y0, args),
        throw=False,
    )


def _saveat(grid, summary_fn):
    """Always the final state (and the solver state, which counts linear-solve iterations for
    `Rodas4`); with a grid, also summaries at the grid points."""
    if grid is None:
        return diffrax.SaveAt(t1=True, solver_state=True)
    return diffrax.SaveAt(
        subs=[diffrax.SubSaveAt(t1=True), diffrax.SubSaveAt(ts=grid, fn=summary_fn)],
        solver_state=True,
    )


def _diffrax_run(setup: Setup, sol, solver, end_status, samples: bool, extra_evals=0) -> PhaseRun:
    """A `diffeqsolve` phase's final state, status and work; `extra_evals`: gradients the
    phase took outside `diffeqsolve`."""
    ys = sol.ys[0] if isinstance(sol.ys, list | tuple) else sol.ys
    ts = sol.ts[0] if isinstance(sol.ts, list | tuple) else sol.ts
    y_end = jax.tree_util.tree_map(lambda x: x[-1], ys)
    event = jnp.asarray(sol.result == diffrax.RESULTS.event_occurred)
    mask = sol.event_mask
    status = _status(
        setup, y_end, sol.result, event & mask["stop"], event & mask.get("t_max", False), end_status
    )
    num_steps = sol.stats["num_steps"]
    per_step = rhs_evals_per_step(solver)
    stats = StepStats(
        num_steps=num_steps,
        num_accepted_steps=sol.stats["num_accepted_steps"],
        num_rejected_steps=sol.stats["num_rejected_steps"],
        # known per step (explicit tableaus, Euler, RODAS), f(y0) where the tableau takes it
        # (`_first_stage`), the stopping rule at y0 and after every step, and the status at
        # the end; diffrax's implicit solvers: not counted
        rhs_evals=per_step * num_steps
        + _first_stage(solver)
        + _redone_stages(sol.solver_state)
        + setup.stop_evals * (num_steps + 1)
        + setup.status_evals
        + extra_evals
        if per_step > 0
        else jnp.where(num_steps > 0, -1, extra_evals),
        solver_code=solver_code(sol.result),
        **_linear_work(sol.solver_state),
    )
    return PhaseRun(y_end, ts[-1], status, stats, dict(sol.ys[1]) if samples else {})


def _status(setup: Setup, y_end, result, stopped, at_t_max, end_status) -> jax.Array:
    """A phase's status from where it ended, diffrax's `result`, and whether the stopping test
    (`stopped`) or the horizon `t_max` ended it."""
    floor = []
    if setup.rounding_floor:  # the stop fired on the rounding floor, not on the stopping rule
        model = y_end["model"]
        loss, g = masked_loss_and_gradient(model, setup.problem, setup.layer_mask)
        ratio, _ = convergence(loss, g, model, setup.rtol, setup.atol, setup.layer_mask, jnp.inf)
        at_floor = setup.at_rounding_floor(loss, g, model) & ~(ratio <= 1.0)
        floor = [(stopped & at_floor, Status.ROUNDING_FLOOR)]
    return select_status(
        [
            (is_diverged(y_end["model"], setup.problem, setup.divergence_bound), Status.DIVERGED),
            *floor,
            (stopped, Status.CONVERGED),  # not diverged nor at the floor (above)
            (at_t_max, Status.T_MAX),
            (result == diffrax.RESULTS.successful, end_status),
            (result == diffrax.RESULTS.max_steps_reached, Status.MAX_STEPS),
        ],
        otherwise=Status.FAILED,
    )


def _redone_stages(solver_state):
    """Vector-field evaluations of `Rodas4` stages solved again densely after a failed CG (0
    for other solvers)."""
    if isinstance(solver_state, dict) and "redone_stages" in solver_state:
        return solver_state["redone_stages"]
    return 0


def _linear_work(solver_state) -> dict:
    """`StepStats`' linear-solver counts from a `Rodas4` state (zero for other solvers)."""
    if not isinstance(solver_state, dict):
        zero = jnp.asarray(0, jnp.int32)
        return {"linear_iters": zero, "factorizations": zero}
    return {
        "linear_iters": solver_state["iters"],
        "factorizations": solver_state["factorizations"],
    }
