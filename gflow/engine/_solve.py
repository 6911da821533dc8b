"""The solve: a flow as up to three phases (docs/theory.md §5).

1. The loss clock crosses the plateau of a small initialisation (t carried as a state), until
   the loss has dropped by `loss_clock_until` (or not at all when the clock is physical).
2. Physical time with the explicit solver (or the one solver that was forced).
3. With `solver="auto"`: when the explicit solver has spent `explicit_steps` steps without
   converging (a stiff tail), an L-stable Rosenbrock method (RODAS4P2, or RODAS5P on large
   problems: `tail_tableau`) to the end; with `tail_method="auto"`, a tail still running
   after `radau_after` steps goes on with Radau IIA, a stage of its own (`tail_stages`).

Every phase starts where the previous one stopped; the first that reaches a final status
(converged, diverged, t_max, …) ends the solve.
"""

from __future__ import annotations

import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp

from ..model import Factorization, tree_dot
from ..problem import Problem
from ._compile import compiler_options
from ._dynamics import MaskedRMS, loss_time_scale, masked_loss_and_gradient, physical_jacobian
from ._gram import GaussNewtonPreconditioner
from ._options import FlowOptions, solver_class
from ._phases import (
    CONTINUE,
    FiniteErrorPID,
    PhaseRun,
    Setup,
    loss_clock_phase,
    physical_phase,
    stiff_phase,
    summary,
)
from ._radau import MAX_PARAMETERS, RADAU_STEP_LIMITS, RadauIIA
from ._result import FlowResult, Phase, Status, Trajectory
from ._rosenbrock import TABLEAUS, Rodas4, rounding_gain
from ._stopping import default_atol


def solve(
    problem: Problem,
    model: Factorization,
    options: FlowOptions,
    depth=None,
    batch_axis=None,
    observed: int | None = None,
    defer_tail: bool = False,
    tangent_rank: int | None = None,
) -> FlowResult:
    """The flow engine: pure, jittable, vmappable. Use `flow` for validation and timing.

    `depth` (may be traced): train only the first `depth` layers; the others must be identity
    matrices, which then stay frozen, so the product is that of a depth-`depth` network. This
    lets one compiled program (and one batch) hold flows of several depths.

    `batch_axis`: under `jax.vmap(..., axis_name=batch_axis)`, the name of that axis: a batch
    in which no member reaches the stiff phase then skips it (otherwise every member pays for
    its set-up).

    `observed`: a static upper bound on the number of observed entries (of every member of a
    batch), which the Gauss–Newton preconditioner of the stiff tail needs; without it (or
    with `preconditioner="spectral"`) the tail's CG uses a spectral sketch.

    `tangent_rank`: the (static) rank of the tangent space where the Gauss–Newton
    preconditioner takes its `tangent` factorisation (`_gram`; `_flow.tangent_rank`), else
    None.

    `defer_tail`: stop where the stiff tail would begin, with status `PENDING`, so that a
    batch is not held up by its stiffest member; `finish_tail` then runs the tail of such a
    member alone, from the same state, as this solve would have."""
    dtype = model.layers[0].dtype
    layer_mask = None if depth is None else (jnp.arange(model.depth) < depth).astype(dtype)
    method, budget = tail_stages(options, model, continued=False)[0]
    setup = _setup(problem, model, options, layer_mask, observed, method)
    solvers = _solvers(options, setup, batch_axis, observed, tangent_rank, method)
    loss0, g0 = masked_loss_and_gradient(model, problem, layer_mask)
    use_loss_clock, tau_switch = _loss_clock_span(problem, model, options, depth, loss0, g0)

    y0 = {"model": model, "t": jnp.zeros((), dtype)}
    if options.certificates:
        y0["energy"] = jnp.zeros((), dtype)
    n1 = options.save if options.clock_in_use != "physical" else 0
    clock_steps = _loss_clock_steps(options)
    hands_over = clock_steps < options.max_steps
    first = loss_clock_phase(
        setup,
        solvers["loss clock"],
        y0,
        tau_switch,
        _dt0(options),
        clock_steps,
        n1,
        options.lean,
        LOSS_CLOCK_STALL if hands_over else 0,
    )
    finished = use_loss_clock & (first.status >= 0)  # the loss clock ended the solve
    if hands_over:
        # A loss clock out of its own steps stalled on a later plateau (a saddle after the
        # first escape, where it is stiff): physical time, with its stiff tail, goes on from
        # there. (Out of the user's `max_steps`, it ends the solve as before.)
        finished = finished & (first.status != Status.MAX_STEPS)
    if options.stop_loss is not None:  # the loss clock ran to the early stop, or ended first
        first = eqx.tree_at(
            lambda r: r.status,
            first,
            jnp.where(first.status == CONTINUE, Status.LOSS_REACHED, first.status),
        )
        finished = jnp.asarray(True)
    t_switch = first.y["t"]
    explicit = physical_phase(
        setup,
        solvers["explicit"],
        {k: v for k, v in first.y.items() if k != "t"},
        t_switch,
        jnp.where(finished, 0.0, setup.t_max - t_switch),
        _dt0(options),
        options.explicit_steps if options.stiff_tail else options.max_steps,
        options.lean,
    )
    end = _Ending(
        y=explicit.y,  # a solve the loss clock finished ran a zero-length explicit phase
        t=jnp.where(finished, t_switch, t_switch + explicit.t),
        status=jnp.where(finished, first.status, explicit.status),
        phase=jnp.where(finished, Phase.LOSS_CLOCK, Phase.EXPLICIT),
        code=jnp.where(finished, first.stats.solver_code, explicit.stats.solver_code),
    )
    runs = [first, explicit]
    handover = None  # where the stiff tail ran: None when it was not part of this solve
    if options.stiff_tail:
        reached = (~finished) & (explicit.status == Status.MAX_STEPS)
        if defer_tail:
            end.status = jnp.where(reached, Status.PENDING, end.status)
        else:
            handover = reached
            stiff = solvers["stiff"]
            tail = _stiff_tail(setup, stiff, end, handover, batch_axis, budget)
            end = end.then(handover, tail, Phase.STIFF_TAIL)
            runs.append(tail)
    trajectory = None
    if options.save or options.save_ts is not None:
        deferred = options.stiff_tail and defer_tail
        trajectory = _trajectory(runs, use_loss_clock, finished, handover, n1, deferred)
    return _result(problem, options, loss0, runs, end, handover, trajectory, solvers)


def finish_tail(
    problem: Problem,
    model: Factorization,
    head: FlowResult,
    options: FlowOptions,
    observed: int | None = None,
    batch_axis=None,
    tangent_rank: int | None = None,
    stage: int = 0,
    stages: tuple | None = None,
) -> FlowResult:
    """The stiff tail of a solve run with `defer_tail=True` (`head`, from the initial `model`),
    as that solve would have run it: the whole flow's result. A head whose status is not
    `PENDING` is returned as it is (the branch costs it nothing). The tail's samples (where
    `options` saves them) fill the head's last rows, which the head left invalid. `model` and
    `head` are unpadded: a depth-padded solve's tail runs at its true depth (`finish_tails`
    strips the frozen identity layers first). `batch_axis`: as in `solve`, for the tails of a
    batch finished together under `jax.vmap`.

    `stage`: which of `stages` this program runs (`tail_stages` as the caller decided them;
    None: decided here from `observed`). A stage with one after it ends a flow that is out of
    its steps as `PENDING`, for the next stage's program to go on from it (`head` is then the
    previous stage's result): its samples are merged in, its work counts in its own row of
    `phase_work` (`Phase.RADAU_TAIL`)."""
    if stages is None:
        stages = tail_stages(options, model, continued=batch_axis is None, observed=observed)
    method, budget = stages[stage]
    setup = _setup(problem, model, options, None, observed, method)
    solver = _solvers(options, setup, batch_axis, observed, tangent_rank, method)["stiff"]
    y = {"model": head.model}
    if options.certificates:
        y["energy"] = head.energy
    end = _Ending(y, head.t_end, head.status, head.end_phase, head.solver_code)
    handover = head.status == Status.PENDING
    tail = _stiff_tail(setup, solver, end, handover, batch_axis, budget)
    phase = Phase.STIFF_TAIL if stage == 0 else Phase.RADAU_TAIL
    end = end.then(handover, tail, phase)
    if stage + 1 < len(stages):
        end.status = jnp.where(end.status == Status.MAX_STEPS, Status.PENDING, end.status)
    row = jnp.where(handover, _work_row(tail.stats), 0)
    phase_work = head.phase_work.at[phase].add(row)
    accepted = jnp.where(handover, tail.stats.num_accepted_steps, 0)
    trajectory = head.trajectory
    if trajectory is not None:
        samples = tail.samples | {"t": jnp.where(handover, tail.samples["t"], jnp.inf)}
        part = Trajectory(samples["t"], samples["loss"], samples["sv"], samples.get("layers"))
        rows = samples["t"].shape[0]
        reached = jnp.isfinite(part.t)  # rows outside the tail's span keep an earlier stage's

        def merge(old, new):
            kept = jnp.where(_by_row(reached, new), new, old[-rows:])
            return old.at[-rows:].set(kept)

        trajectory = jax.tree_util.tree_map(merge, trajectory, part)
    accepted = head.num_accepted_steps + accepted
    return _assemble(problem, options, head.loss_init, phase_work, accepted, end, trajectory)


# A Radau IIA step's cost in Rosenbrock steps (the step budget it takes of `max_steps`): at
# depth 5, d = 8 (P = 320) ~10 ms against ~1.4 ms with its Newton matrix on 64 observed rows,
# 4.5 ms on the 40 it now takes (benchmarks/README, "nineteenth session"). Not tuned: the
# budget only decides how long a flow that does not converge in it runs.
RADAU_STEP_COST = 8

# The largest Newton matrix work (3·|Ω|)²·P at which `tail_method="auto"` hands a long
# Rosenbrock tail over to Radau IIA; none by default. Forming G⊥G⊥ᵀ for its 3|Ω| × 3|Ω|
# system dominates a Radau step on larger problems, which the Rosenbrock tail's Gram
# preconditioner does not pay, but the size alone does not say where the handover pays
# (2026-12-08, benchmarks/README, "twenty-eighth session"; `python -m benchmarks.handover`):
# on `bernoulli(d, d, 0.3, 5)` at depth 4, α = 1e-2, it took 2.27× (d = 16, 4.8e7) and 1.62×
# (d = 20, 1.8e8) the Rosenbrock tail's solve, a Radau step costing ~8–11 Rosenbrock steps;
# on a d = 12 sweep point (density 0.5, rank 2, depth 4, α = 1e-3, seed 3; 3.3e7), whose
# Rosenbrock tail factorises every other step, it took 0.29× (45.6 against 159.3 s).
RADAU_MAX_WORK = math.inf


def radau_work(observed: int, size: int) -> float:
    """(3·`observed`)²·`size`: the products that form a Radau step's Newton matrix (P = `size`
    parameters, `observed` rows of the observed Jacobian a stage)."""
    return float(3 * observed) ** 2 * size


def tail_stages(
    options: FlowOptions, model: Factorization, continued: bool = True, observed: int | None = None
):
    """The stiff tail as a sequence of (method, step budget) stages, each a program of its own
    that goes on from where the previous one stopped. `tail_method="auto"`: the Rosenbrock
    method for `radau_after` steps, then Radau IIA for what is left of `max_steps` at
    `RADAU_STEP_COST` a step, where a Radau program can go on after it (`continued`: a tail
    run alone, not batched under vmap), the model is small enough for its dense Hessian
    (`_radau.MAX_PARAMETERS`), a Radau step is cheap enough beside a Rosenbrock one
    (`radau_work` of `observed`, the rows Radau's program would take, within
    `RADAU_MAX_WORK`; None: not limited) and its tails can run side by side
    (`tails_run_alone` would hold a sweep's others); else, with `rounding_allowance` (a
    Rosenbrock tableau's) and with `tail_scale="entry"` (Radau's errors are layer-scaled),
    the Rosenbrock method alone."""
    if options.tail_method != "auto":
        return ((options.tail_method, options.max_steps),)
    size = sum(math.prod(w.shape[-2:]) for w in model.layers)
    if (
        continued
        and not options.rounding_allowance
        and options.tail_scale == "layer"
        and options.max_steps > options.radau_after
        and size <= MAX_PARAMETERS
        and (observed is None or radau_work(observed, size) <= RADAU_MAX_WORK)
        and compiler_options()
    ):
        radau_steps = max(1, (options.max_steps - options.radau_after) // RADAU_STEP_COST)
        return (("rosenbrock", options.radau_after), ("radau", radau_steps))
    return (("rosenbrock", options.max_steps),)


class _Ending:
    """Where the solve stands after a phase: state, physical time, status, phase, solver code."""

    def __init__(self, y, t, status, phase, code):
        self.y, self.t, self.status, self.phase, self.code = y, t, status, phase, code

    def then(self, taken, run: PhaseRun, phase) -> _Ending:
        """This ending, or where `run` (which started here) ended, where `taken`."""
        return _Ending(
            y=_pick(taken, run.y, self.y, keys=self.y),
            t=jnp.where(taken, self.t + run.t, self.t),
            status=jnp.where(taken, run.status, self.status),
            phase=jnp.where(taken, phase, self.phase),
            code=jnp.where(taken, run.stats.solver_code, self.code),
        )


def _pick(condition, a: dict, b: dict, keys) -> dict:
    return {
        k: jax.tree_util.tree_map(lambda x, z: jnp.where(condition, x, z), a[k], b[k]) for k in keys
    }


def _setup(
    problem, model, options: FlowOptions, layer_mask, observed=None, method="rosenbrock"
) -> Setup:
    """The phases' shared settings; `method`: the stiff tail's (`tail_stages`)."""
    rtol = options.rtol
    atol = options.atol if options.atol is not None else default_atol(model, rtol, layer_mask)
    norm = {} if layer_mask is None else {"norm": MaskedRMS(layer_mask)}

    def controller(rtol, atol, gain=0.0, layer_scale=False, **limits):
        if options.fixed_step:
            return diffrax.ConstantStepSize()
        return FiniteErrorPID(
            rtol=rtol, atol=atol, rounding_gain=gain, layer_scale=layer_scale, **norm, **limits
        )

    tail_rtol = rtol if options.tail_rtol is None else options.tail_rtol
    tail_tolerance = (tail_rtol, atol * (tail_rtol / rtol))
    tableau = TABLEAUS[tail_tableau(options, observed)]
    tail_gain = rounding_gain(tableau) if options.rounding_allowance else 0.0
    return Setup(
        problem=problem,
        layer_mask=layer_mask,
        rtol=rtol,
        atol=atol,
        controller=controller(rtol, atol),
        tail_controller=controller(
            *tail_tolerance,
            tail_gain,
            options.tail_scale == "layer",
            **(RADAU_STEP_LIMITS if method == "radau" else {}),
        ),
        tail_tolerance=tail_tolerance,
        t_max=jnp.asarray(options.t_max, model.layers[0].dtype),
        loss_floor=rtol * problem.loss(model.product()),
        divergence_bound=options.divergence_bound,
        finite_horizon=math.isfinite(options.t_max),
        save_ts=options.save_ts,
        save=options.save,
        summary=summary(options.save_layers, min(problem.shape)),
        tail_rounding_floor=options.rounding_floor,
        tail_compensated=options.compensated_mode,
    )


# Observed entries from which a Gauss–Newton preconditioner application (an |Ω|² matrix-vector
# product) costs several Hessian-vector products, so that starting each stage's CG from the
# previous step's stage solutions too (six Hessian-vector products a step) pays: measured
# side by side (benchmarks/README, 2026-12-04) 1.16× faster at |Ω| = 2,945 (d = 100), the same
# at 704 (d = 50), and 8% slower on the 112-flow d = 8 sweep (|Ω| ≤ 64, cheap steps).
PREVIOUS_START_MIN_OBSERVED = 1024


def _gauss_newton_entries(options: FlowOptions, observed: int | None) -> int | None:
    """The observed entries the stiff tail's Gauss–Newton preconditioner holds, or None when
    the tail has none (another preconditioner, or no static bound on the observed entries)."""
    return observed if options.preconditioner == "gauss-newton" else None


# Observed entries from which `rosenbrock="auto"` takes RODAS5P (else RODAS4P2): there a step
# costs its Gram builds and |Ω|²-sized preconditioner applications, and RODAS5P's half as many
# steps need fewer of both. Measured side by side (benchmarks/README, 2026-12-05): the `scale`
# problem at |Ω| = 2,945 (d = 100) 1.04–1.15× faster, at 12,000 (d = 200) 505.6 s (576.8 s
# with RODAS4P2 in `diffeqsolve`); at 704 (d = 50) 1.04–1.09×; but the 112-flow d = 8 sweep
# (|Ω| ≤ 64) took 742 s with it, against 615 s that morning with RODAS4P2 (in `diffeqsolve`,
# not side by side): flows that spend their whole step budget pay 8 stages a step, not 6.
RODAS5P_MIN_OBSERVED = 1024


def tail_tableau(options: FlowOptions, observed: int | None) -> str:
    """The stiff tail's tableau: `options.rosenbrock`, with `auto` resolved by the number of
    observed entries the Gauss–Newton preconditioner holds."""
    if options.rosenbrock != "auto":
        return options.rosenbrock
    entries = _gauss_newton_entries(options, observed)
    return "rodas5p" if entries is not None and entries >= RODAS5P_MIN_OBSERVED else "rodas4p2"


# Observed entries from which `gauss_newton="auto"` keeps the Gram as a blocked Cholesky
# factor (else its explicit inverse): the factor is ~3.5× cheaper to form, and its block
# triangular solves read as much as the inverse's product but run 1.0–1.5× slower. Whole
# `scale` solves side by side (benchmarks/README, 2026-12-05): |Ω| = 12,000 (d = 200) 331.6
# against 472.5 s, 6,750 (d = 150) 118.8 against 152.9 s, 2,945 (d = 100) the same time
# (35.8 / 35.6 against 37.0 / 34.2 s), where an application takes 1.9 against 1.3 ms.
CHOLESKY_MIN_OBSERVED = 4096


# Observed entries from which `gauss_newton="auto"` takes the `tangent` factorisation, where
# the rank r (`_flow.tangent_rank`) keeps its system small: 2·r·(d_out + d_in) ≤ |Ω|. Below
# 1,024 entries the Gram itself is small: the `scale` problem at d = 50 (|Ω| = 704, k = 500)
# took 3.67 / 3.57 s with it forced against 3.77 / 3.67 s with the Gram's inverse, alternated
# (7,331 against 6,272 CG; 2026-12-06): a tie.
TANGENT_MIN_OBSERVED = 1024


def gauss_newton_factorization(
    options: FlowOptions, entries: int, rank: int | None = None, shape=None
) -> str:
    """How the tail's Gauss–Newton preconditioner of `entries` observed entries of a `shape`
    matrix of rank `rank` (`_flow.tangent_rank`: X's where the tail begins, or the target's)
    is factorised: `options.gauss_newton`, with `auto` resolved by these sizes."""
    if options.gauss_newton != "auto":
        return options.gauss_newton
    if rank and entries >= TANGENT_MIN_OBSERVED and 2 * rank * (shape[0] + shape[1]) <= entries:
        return "tangent"
    return "cholesky" if entries >= CHOLESKY_MIN_OBSERVED else "inverse"


def _solvers(
    options: FlowOptions,
    setup: Setup,
    batch_axis,
    observed,
    tangent_rank=None,
    method="rosenbrock",
) -> dict:
    """The solver of each phase; `method`: the stiff tail's (`tail_stages`). In physical time
    the Jacobian is −∇²loss (symmetric) and the energy integral is passive; on the loss clock
    the rates are scaled by 2·loss/‖∇loss‖².
    A `tangent_rank` means the `tangent` factorisation, decided on the host
    (`_flow.tangent_rank`); without one, `gauss_newton_factorization` decides by size alone."""
    if method == "radau":  # only under solver="auto" (`FlowOptions`)
        stiff = RadauIIA(
            entries=setup.problem.mask.size if observed is None else observed,
            jacobian=physical_jacobian,
            step_tolerance=setup.tail_tolerance,
        )
    else:
        stiff = _rosenbrock_tail(options, setup, batch_axis, observed, tangent_rank)
    if not isinstance(options.solver, str):
        explicit = options.solver
    elif options.solver == "auto":
        explicit = diffrax.Tsit5()
    elif options.solver == "rodas4":
        explicit = stiff
    else:
        explicit = solver_class(options.solver)()
    loss_clock = explicit
    if options.solver == "rodas4":
        loss_clock = Rodas4(
            linear_solver="dense",
            tableau=stiff.tableau,
            step_tolerance=(setup.rtol, setup.atol),
        )
    return {"loss clock": loss_clock, "explicit": explicit, "stiff": stiff}


def _rosenbrock_tail(options: FlowOptions, setup: Setup, batch_axis, observed, tangent_rank):
    """The Rosenbrock stiff tail, with its Gauss–Newton preconditioner where one applies."""
    entries = _gauss_newton_entries(options, observed)
    structured = None
    if entries is not None:
        if tangent_rank:
            factorization, rank = "tangent", tangent_rank
        else:
            factorization, rank = gauss_newton_factorization(options, entries), 0
        structured = GaussNewtonPreconditioner(entries, factorization, rank)
    from_previous = entries is not None and entries >= PREVIOUS_START_MIN_OBSERVED
    return Rodas4(
        preconditioner=structured,
        preconditioner_rank=0 if options.preconditioner == "none" else 64,
        batch_axis=batch_axis,
        linear_solver=options.linear_solver,
        tableau=tail_tableau(options, observed),
        stage_start="previous" if from_previous else "stages",
        step_tolerance=setup.tail_tolerance,
        symmetric=True,
        passive=("energy",),
        jacobian=physical_jacobian,
    )


# The loss clock's step budget under `clock="auto"`, in units of `explicit_steps`: crossing
# the plateau of a small init takes it hundreds of steps; a loss clock still running after
# this many has stalled on a saddle between plateaus and hands over to physical time.
LOSS_CLOCK_STEPS = 10
# Rejected steps in a row that end the loss clock as out of its budget (it then hands over to
# physical time from the same state). On a saddle its rates 2·loss·∇loss/‖∇loss‖² outgrow any
# step: the step size collapses to the rounding of τ and every later step is rejected. Measured
# on d = 8 random masks at depths 4–5 (2026-12-05, benchmarks/README): 1.3–1.4k accepted steps,
# then 18.6k rejected in a row, the solve 1.5× slower for nothing.
LOSS_CLOCK_STALL = 100


def _loss_clock_steps(options: FlowOptions) -> int:
    if options.clock == "auto" and options.stop_loss is None:
        return min(options.max_steps, LOSS_CLOCK_STEPS * options.explicit_steps)
    return options.max_steps


def _dt0(options: FlowOptions):
    return options.dt if options.fixed_step else None


def _loss_clock_span(problem, model, options: FlowOptions, depth, loss0, g0):
    """Whether the flow starts on the loss clock, and the τ at which it hands over: a long
    initial loss time-scale (L ≥ 3, small α) against that of the fitted target."""
    h0 = loss_time_scale(loss0, tree_dot(g0, g0))
    depth = model.depth if depth is None else depth
    target_scale = jnp.max(jnp.abs(problem.observed_target))
    h_ref = 1.0 / (depth * jnp.maximum(target_scale, 1e-300) ** (2.0 - 2.0 / depth))
    clock = options.clock_in_use
    if options.stop_loss is not None:  # the loss clock to exactly loss(0)·stop_loss
        return jnp.asarray(True), jnp.asarray(0.5 * math.log(1.0 / options.stop_loss))
    if clock == "physical":
        use = jnp.asarray(False)
    elif clock == "loss":
        use = jnp.asarray(True)
    else:
        use = (depth >= 3) & (h0 > 100.0 * h_ref)
    tau_switch = jnp.where(use, 0.5 * math.log(1.0 / options.loss_clock_until), 0.0)
    if clock == "loss":
        tau_switch = jnp.asarray(jnp.inf, model.layers[0].dtype)
    return use, tau_switch


def _stiff_tail(setup: Setup, solver, end: _Ending, handover, batch_axis, max_steps) -> PhaseRun:
    """The Rosenbrock phase from where the explicit one stopped. A real branch: a flow (or a
    batch) the explicit phase finished never pays for its set-up; under vmap the branch needs
    a predicate shared by the batch."""

    def run():
        t1 = jnp.where(handover, setup.t_max - end.t, 0.0)
        return stiff_phase(setup.for_tail(), solver, end.y, end.t, t1, max_steps)

    run_it = handover
    if batch_axis is not None:
        run_it = jax.lax.psum(handover.astype(jnp.int32), batch_axis) > 0
    shapes = jax.eval_shape(run)
    skipped = lambda: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.cond(run_it, run, skipped)


def _trajectory(runs, use_loss_clock, finished, handover, n1, deferred=False) -> Trajectory:
    """The samples of every phase that ran, in time order; those of a phase that did not run
    are marked invalid (t = inf) and dropped by `Trajectory.compress`. A `deferred` tail's
    rows are there too, invalid (as many as the explicit phase's: both sample the same
    grid), for `finish_tail` to fill: a trajectory's shape never depends on where the tail
    ran, or whether it did."""
    parts = []
    if n1:
        parts.append(
            runs[0].samples | {"t": jnp.where(use_loss_clock, runs[0].samples["t"], jnp.inf)}
        )
    for i, run in enumerate(runs[1:], start=1):
        t = run.samples["t"]
        if i == 2:
            t = jnp.where(handover, t, jnp.inf)
        parts.append(run.samples | {"t": jnp.where(finished, jnp.inf, t)})
    if deferred:
        parts.append(runs[1].samples | {"t": jnp.full_like(runs[1].samples["t"], jnp.inf)})
    cat = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)
    return Trajectory(cat["t"], cat["loss"], cat["sv"], cat.get("layers"))


def _work_row(s) -> jax.Array:
    """One phase's row of `FlowResult.phase_work` (columns `WORK_COLUMNS`)."""
    row = [s.num_steps, s.num_rejected_steps, s.rhs_evals, s.linear_iters, s.factorizations]
    return jnp.stack(row).astype(jnp.int32)


def _result(problem, options, loss0, runs, end: _Ending, handover, trajectory, solvers):
    stats = [run.stats for run in runs]
    if handover is not None:  # a stiff tail that did not run for this member did no work
        stats[2] = jax.tree_util.tree_map(lambda x: jnp.where(handover, x, 0), stats[2])
    rows = [_work_row(s) for s in stats]
    # the initial gradient, which chose the clock, counts in the first phase's evaluations
    rows[0] = rows[0].at[2].add(jnp.where(rows[0][2] < 0, 0, 1))
    rows += [jnp.zeros_like(rows[0])] * (len(Phase) - len(rows))
    accepted = sum(s.num_accepted_steps for s in stats)
    return _assemble(problem, options, loss0, jnp.stack(rows), accepted, end, trajectory)


def _not_samples_inf(trajectory: Trajectory | None) -> Trajectory | None:
    """The trajectory with the rows that are not samples (t = inf: a phase that did not run,
    rows past the end) reading inf throughout, as a descent's do, instead of the state a
    phase left in them."""
    if trajectory is None:
        return None
    valid = jnp.isfinite(trajectory.t)
    return jax.tree_util.tree_map(lambda x: jnp.where(_by_row(valid, x), x, jnp.inf), trajectory)


def _by_row(flags, x):
    """A flag per row of a trajectory's field `x`, broadcast over its other axes."""
    return flags.reshape(flags.shape + (1,) * (x.ndim - flags.ndim))


def _assemble(problem, options, loss0, phase_work, accepted, end: _Ending, trajectory):
    rhs = phase_work[:, 2]
    dtype = end.t.dtype
    return FlowResult(
        model=end.y["model"],
        status=end.status,
        t_end=end.t,
        loss=problem.loss(end.y["model"].product()),
        loss_init=loss0,
        num_steps=jnp.sum(phase_work[:, 0]),
        num_accepted_steps=jnp.asarray(accepted, jnp.int32),
        num_rejected_steps=jnp.sum(phase_work[:, 1]),
        num_rhs_evals=jnp.where(jnp.any(rhs < 0), -1, jnp.sum(rhs)),
        num_linear_iters=jnp.sum(phase_work[:, 3]),
        num_factorizations=jnp.sum(phase_work[:, 4]),
        phase_work=phase_work,
        energy=end.y["energy"] if options.certificates else jnp.asarray(jnp.nan, dtype),
        end_phase=end.phase.astype(jnp.int32),
        solver_code=end.code.astype(jnp.int32),
        trajectory=_not_samples_inf(trajectory),
    )
