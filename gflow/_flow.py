"""Gradient flow dθ/dt = −∇loss(θ), integrated with diffrax until an honest stopping rule fires.

Two clocks drive the same path (theory.md §5):

- *physical time* t, the flow itself;
- the *loss clock* τ with dt/dτ = 2·loss/‖∇loss‖², along which loss(τ) = loss(0)·e^{−2τ}.
  A small initialisation spends almost all of its physical time (up to ~1e14) on a plateau
  where nothing moves; the loss clock crosses that plateau in O(1) and carries t as a state,
  so float64 never has to resolve an O(1) escape at t ~ 1e14.

With `clock="auto"` a flow whose initial loss time-scale is long (L ≥ 3, small α) uses the loss
clock until the loss has dropped by `loss_clock_until`, then hands over to physical time, whose
explicit steps stay efficient once modes start to converge at different rates.

**Stopping rule.** Near a minimum the flow converges like a linear system, and the distance
still to travel is ‖θ(∞) − θ(t)‖ ≈ 2·loss/‖∇loss‖ (exact for a quadratic with one rate; as
the slowest mode comes to dominate the loss it becomes exact for that mode). The flow stops when
the remaining displacement δ = (2·loss/‖∇loss‖²)·∇loss is within the integration tolerance,
RMS(δ_i / (atol + rtol·|θ_i|)) ≤ 1, the same norm diffrax's step controller uses. The loss
left at that point is ≈ ½λ(rtol·|θ|)²: relative to the initial loss, about rtol². Being
relative to ∇loss it is scale-free: on the plateau of a small init, loss is O(1) while
‖∇loss‖ ~ α^{L−1}, so the estimate is huge and the rule cannot fire at t = 0; at a minimum it
goes to zero like e^{−κt}, so it always fires. An exact stationary point (∇loss = 0) counts as
converged.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx

from ._cache import ALREADY_COMPILED, compile_timed
from ._model import Factorization, loss_and_gradient, loss_hessian, tree_dot
from ._problem import Problem
from ._result import FlowResult, Phase, Status, Trajectory, solver_code
from ._rosenbrock import Rodas4
from ._runge_kutta import REACHED_END, STOPPED, all_finite, integrate

SOLVERS = {
    "tsit5": diffrax.Tsit5,
    "dopri5": diffrax.Dopri5,
    "dopri8": diffrax.Dopri8,
    "kvaerno5": diffrax.Kvaerno5,
    "euler": diffrax.Euler,
    "rodas4": Rodas4,
}
FIXED_STEP = ("euler",)
LEAN_SOLVERS = ("auto", "tsit5", "dopri5")  # FSAL tableaus that `_runge_kutta` runs
CLOCKS = ("auto", "physical", "loss")
LINEAR_SOLVERS = ("auto", "dense", "cg")


@dataclass(frozen=True)
class FlowOptions:
    """How to integrate a flow. Validated at construction.

    - `solver`: `auto` (default): Tsit5, and if it has not converged after `explicit_steps`
      steps (a stiff tail: step size pinned at the stability bound of the fastest mode), the
      L-stable Rosenbrock method `rodas4` (dense or matrix-free linear algebra) to the end.
      Or one fixed solver: `tsit5`, `dopri5`, `dopri8` (explicit), `kvaerno5`, `rodas4` (stiff),
      `euler` (fixed step `dt`).
    - `rtol`, `atol`: tolerances of the PID step controller and of the stopping rule. `atol=None`
      uses `1e-2·rtol·RMS(θ(0))`, i.e. relative to the scale of the initialisation.
    - `t_max`: physical-time horizon (`inf` by default: stop on convergence).
    - `max_steps`: step budget per clock phase; the solve always terminates.
    - `clock`: `auto`, `physical` or `loss` (see the module docs).
    - `loss_clock_until`: the loss clock hands over to physical time once the loss has dropped
      to this fraction of its initial value.
    - `save`: trajectory samples per clock phase (0: none); `save_layers` keeps the layers too.
      On the loss clock samples are evenly spaced in log(loss); in physical time they are
      log-spaced from 1e-3 to 1e8 loss time-scales (or up to `t_max`).
    - `certificates`: carry the energy integral ∫‖∇loss‖² dt as an extra state.
    - `linear_solver`: how `rodas4` solves its linear systems: `auto` (dense Cholesky up to 200
      parameters, else matrix-free CG on Hessian-vector products), `dense` or `cg`.
    - `divergence_bound`: |θ_i| above this counts as diverged.
    - `dt`: the fixed step of `solver="euler"` (explicit Euler is gradient descent with
      learning rate dt: a reference for `descend`).
    - `save_ts`: explicit physical times to sample (implies the physical clock); with it the
      trajectory holds exactly these times (inf past the end of the solve).
    """

    solver: str = "auto"
    rtol: float = 1e-10
    atol: float | None = None
    t_max: float = math.inf
    max_steps: int = 100_000
    explicit_steps: int = 2_000
    clock: str = "auto"
    loss_clock_until: float = 1e-2
    save: int = 0
    save_layers: bool = False
    certificates: bool = False
    linear_solver: str = "auto"
    divergence_bound: float = 1e100
    dt: float | None = None
    save_ts: tuple[float, ...] | None = None

    def __post_init__(self):
        if self.save_ts is not None:
            ts = tuple(float(t) for t in self.save_ts)
            if not ts or any(b < a for a, b in zip(ts, ts[1:], strict=False)) or ts[0] < 0:
                raise ValueError("save_ts must be a non-empty, non-decreasing list of times >= 0")
            object.__setattr__(self, "save_ts", ts)
            if self.clock == "loss":
                raise ValueError("save_ts (physical times) needs clock='physical' or 'auto'")
            object.__setattr__(self, "clock", "physical")
        if self.solver in FIXED_STEP:
            if self.dt is None or not (self.dt > 0):
                raise ValueError(f"solver {self.solver!r} takes a fixed step: pass dt > 0")
            if self.clock == "loss":
                raise ValueError("fixed-step solvers run on the physical clock")
            object.__setattr__(self, "clock", "physical")
        elif self.dt is not None:
            raise ValueError("dt is only for fixed-step solvers (solver='euler')")
        if self.linear_solver not in LINEAR_SOLVERS:
            raise ValueError(
                f"unknown linear_solver {self.linear_solver!r}; choose from {LINEAR_SOLVERS}"
            )
        if self.solver not in SOLVERS and self.solver != "auto":
            raise ValueError(f"unknown solver {self.solver!r}; choose from {sorted(SOLVERS)}")
        if self.clock not in CLOCKS:
            raise ValueError(f"unknown clock {self.clock!r}; choose from {CLOCKS}")
        if not (0 < self.rtol < 1):
            raise ValueError(f"rtol must lie in (0, 1), got {self.rtol}")
        if self.atol is not None and not (self.atol > 0 and math.isfinite(self.atol)):
            raise ValueError(f"atol must be finite and > 0, got {self.atol}")
        if not (self.t_max > 0):
            raise ValueError(f"t_max must be > 0, got {self.t_max}")
        if not (isinstance(self.max_steps, int) and self.max_steps >= 1):
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")
        if not (isinstance(self.explicit_steps, int) and self.explicit_steps >= 1):
            raise ValueError(
                f"explicit_steps must be a positive integer, got {self.explicit_steps}"
            )
        if not (0 < self.loss_clock_until < 1):
            raise ValueError(f"loss_clock_until must lie in (0, 1), got {self.loss_clock_until}")
        if not (isinstance(self.save, int) and self.save >= 0):
            raise ValueError(f"save must be a non-negative integer, got {self.save!r}")


# --------------------------------------------------------------------------------------------
# Vector fields and the quantities the stopping rule needs.


def _flatten(tree):
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


def _loss_time_scale(loss, grad_sq):
    """h = 2·loss/‖∇loss‖²: dt/dτ of the loss clock; 0 at an exact stationary point."""
    safe = jnp.where(grad_sq > 0, grad_sq, 1.0)
    return jnp.where(grad_sq > 0, 2.0 * loss / safe, 0.0)


def _loss_and_gradient(model, problem, layer_mask):
    """loss and ∇loss; with a layer mask (depth padding), frozen layers get zero gradient."""
    loss, g = loss_and_gradient(model, problem)
    if layer_mask is not None:
        g = Factorization([w * layer_mask[i] for i, w in enumerate(g.layers)])
    return loss, g


def _rms(x, model, layer_mask):
    """RMS of a θ-shaped flat vector, over trainable parameters only when a mask is given."""
    if layer_mask is None:
        return jnp.sqrt(jnp.mean(x**2))
    weights = _entry_weights(model, layer_mask)
    return jnp.sqrt(jnp.sum(weights * x**2) / jnp.sum(weights))


def _entry_weights(model, layer_mask):
    """1 for every trainable parameter, 0 for a frozen (padding) one, flattened like θ."""
    return jnp.concatenate(
        [jnp.full(w.size, layer_mask[i], w.dtype) for i, w in enumerate(model.layers)]
    )


def _physical_rates(y, problem, layer_mask):
    """dy/dt in physical time, with the loss and gradient it came from."""
    loss, g = _loss_and_gradient(y["model"], problem, layer_mask)
    dy = {"model": jax.tree_util.tree_map(jnp.negative, g)}
    if "energy" in y:
        dy["energy"] = tree_dot(g, g)
    return dy, loss, g


def _physical_field(t, y, args):
    return _physical_rates(y, args[0], args[3])[0]


def _physical_jacobian(t, y, args):
    """−∇²loss of `_physical_field`, closed form. With a layer mask the frozen rows and columns
    are zero: exact for the stage systems, whose frozen components are always zero."""
    problem, layer_mask = args[0], args[3]
    hessian = loss_hessian(y["model"], problem)
    if layer_mask is not None:
        weights = _entry_weights(y["model"], layer_mask)
        hessian = weights[:, None] * hessian * weights[None, :]
    return -hessian


def _loss_clock_rates(y, problem, layer_mask):
    """dy/dτ on the loss clock (t is a state), with the loss and gradient it came from."""
    loss, g = _loss_and_gradient(y["model"], problem, layer_mask)
    h = _loss_time_scale(loss, tree_dot(g, g))
    dy = {"model": jax.tree_util.tree_map(lambda x: -h * x, g), "t": h}
    if "energy" in y:
        dy["energy"] = 2.0 * loss * (h > 0)
    return dy, loss, g


def _loss_clock_field(tau, y, args):
    return _loss_clock_rates(y, args[0], args[3])[0]


def remaining_distance_ratio(
    model: Factorization, problem: Problem, rtol, atol, layer_mask=None
) -> jax.Array:
    """RMS of the estimated remaining displacement in units of the tolerance (≤ 1: converged).

    δ = (2·loss/‖∇loss‖²)·∇loss. With a layer mask the RMS runs over trainable parameters
    only."""
    loss, g = _loss_and_gradient(model, problem, layer_mask)
    return _remaining_ratio(loss, g, model, rtol, atol, layer_mask)


def _remaining_ratio(loss, g, model, rtol, atol, layer_mask):
    return _convergence(loss, g, model, rtol, atol, layer_mask, jnp.inf)[0]


def _convergence(loss, g, model, rtol, atol, layer_mask, bound):
    """(remaining-distance ratio, diverged) from one loss and gradient, layer by layer.

    With c = max|g| and u = g/c, δ = (2·loss/(c·‖u‖²))·u: 1 ≤ ‖u‖² ≤ P, so huge gradients
    cannot overflow into a spurious δ = 0, nor tiny ones underflow into a spurious converged.
    Diverged: a non-finite loss, a gradient whose squared norm overflows, or a parameter that
    is non-finite or beyond `bound` (max propagates NaN)."""
    weights = [1.0] * model.depth if layer_mask is None else list(layer_mask)
    c = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)) for x in g.layers])
    safe_c = jnp.where(c > 0, c, 1.0)
    u_sq, scaled_sq, count = 0.0, 0.0, 0.0
    for w, gl, x in zip(weights, g.layers, model.layers, strict=True):
        u = gl / safe_c
        u_sq = u_sq + jnp.sum(u**2)
        scaled_sq = scaled_sq + w * jnp.sum((u / (atol + rtol * jnp.abs(x))) ** 2)
        count = count + w * x.size
    safe_u_sq = jnp.where(c > 0, u_sq, 1.0)
    ratio = jnp.where(c > 0, 2.0 * loss / (safe_c * safe_u_sq) * jnp.sqrt(scaled_sq / count), 0.0)
    theta_max = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(x)) for x in model.layers])
    diverged = ~jnp.isfinite(loss) | ~jnp.isfinite(c * c * u_sq) | ~(theta_max <= bound)
    return ratio, diverged


def _is_diverged(model, problem, bound):
    """Non-finite or huge parameters, or a loss or gradient beyond float range."""
    loss, g = loss_and_gradient(model, problem)
    return _diverged(loss, g, model, bound)


def _diverged(loss, g, model, bound):
    return _convergence(loss, g, model, 1.0, 1.0, None, bound)[1]


# --------------------------------------------------------------------------------------------
# The engine: jittable and vmappable over (problem, model).


class _MaskedRMS(eqx.Module):
    """diffrax's RMS norm over trainable parameters only: a depth-padded flow takes exactly the
    steps of the unpadded one (frozen layers have zero error but would dilute the mean)."""

    layer_mask: jax.Array

    def __call__(self, tree):
        total, count = 0.0, 0.0
        for key, value in tree.items():
            leaves = value.layers if key == "model" else (value,)
            for i, x in enumerate(leaves):
                w = self.layer_mask[i] if key == "model" else 1.0
                total = total + jnp.sum(jnp.where(w > 0, w * jnp.abs(x) ** 2, 0.0))
                count = count + w * x.size
        return jnp.sqrt(total / count)


class _FiniteErrorPID(diffrax.PIDController):
    """A PID controller that treats an overflowing trial step as a plain rejection.

    diffrax's controller computes the next step from the error norm; a trial step that
    overflows (large α: the polynomial vector field explodes before the controller has
    learned the step size) gives inf − inf = nan there, and a nan step size never recovers.
    Here a non-finite candidate counts as an infinite error, so the step shrinks instead.
    """

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
        return super().adapt_step_size(
            t0, t1, y0, y1_candidate, args, y_error, error_order, controller_state
        )


def _rhs_evals_per_step(solver) -> int:
    tableau = getattr(solver, "tableau", None)
    if tableau is None or not hasattr(tableau, "c"):
        return -1
    stages = len(tableau.c) + 1
    return stages - 1 if tableau.fsal else stages


def _summary(save_layers, num_sv):
    def fn(t, y, args):
        problem, t_offset, loss_clock, _ = args
        model = y["model"]
        x = model.product()
        t_phys = y["t"] if loss_clock else t + t_offset
        out = {
            "t": t_phys,
            "loss": problem.loss(x),
            "sv": jnp.linalg.svd(x, compute_uv=False)[:num_sv],
        }
        if save_layers:
            out["layers"] = model
        return out

    return fn


def solve(
    problem: Problem, model: Factorization, options: FlowOptions, depth=None, batch_axis=None
) -> FlowResult:
    """The flow engine: pure, jittable, vmappable. Use `flow` for validation and timing.

    `depth` (may be traced): train only the first `depth` layers; the others must be identity
    matrices, which then stay frozen, so the product is that of a depth-`depth` network. This
    lets one compiled program (and one batch) hold flows of several depths.

    `batch_axis`: under `jax.vmap(..., axis_name=batch_axis)`, the name of that axis: a batch
    in which no member reaches the stiff phase then skips it (otherwise every member pays for
    its set-up)."""
    dtype = model.layers[0].dtype
    layer_mask = None
    if depth is not None:
        layer_mask = (jnp.arange(model.depth) < depth).astype(dtype)
    rtol = options.rtol
    theta0 = _flatten(model)
    atol = options.atol
    if atol is None:
        atol = 1e-2 * rtol * _rms(theta0, model, layer_mask)
        atol = jnp.where(atol > 0, atol, 1e-2 * rtol)
    # In physical time the Jacobian is −∇²loss (symmetric); the energy integral is passive.
    stiff_solver = Rodas4(
        linear_solver=options.linear_solver,
        step_tolerance=(rtol, atol),
        symmetric=True,
        passive=("energy",),
        jacobian=_physical_jacobian,
    )
    if options.solver == "auto":
        solver = diffrax.Tsit5()
    elif options.solver == "rodas4":
        solver = stiff_solver
    else:
        solver = SOLVERS[options.solver]()
    loss_clock_solver = solver
    if options.solver == "rodas4":
        # On the loss clock the rates are scaled by 2·loss/‖∇loss‖²: not symmetric.
        loss_clock_solver = Rodas4(linear_solver="dense", step_tolerance=(rtol, atol))
    if options.solver in FIXED_STEP:
        controller, dt0 = diffrax.ConstantStepSize(), options.dt
    else:
        norm = {} if layer_mask is None else {"norm": _MaskedRMS(layer_mask)}
        controller, dt0 = _FiniteErrorPID(rtol=rtol, atol=atol, **norm), None

    loss0, g0 = _loss_and_gradient(model, problem, layer_mask)
    h0 = _loss_time_scale(loss0, tree_dot(g0, g0))
    depth = model.depth if depth is None else depth
    target_scale = jnp.max(jnp.abs(problem.mask * problem.target))
    h_ref = 1.0 / (depth * jnp.maximum(target_scale, 1e-300) ** (2.0 - 2.0 / depth))
    if options.clock == "physical":
        use_loss_clock = jnp.asarray(False)
    elif options.clock == "loss":
        use_loss_clock = jnp.asarray(True)
    else:
        use_loss_clock = (depth >= 3) & (h0 > 100.0 * h_ref)
    tau_switch = jnp.where(use_loss_clock, 0.5 * math.log(1.0 / options.loss_clock_until), 0.0)
    if options.clock == "loss":
        tau_switch = jnp.asarray(jnp.inf, dtype)

    def done(loss, g, model):
        # Converged or diverged; the phase's status tells which.
        ratio, diverged = _convergence(
            loss, g, model, rtol, atol, layer_mask, options.divergence_bound
        )
        return (ratio <= 1.0) | diverged

    def stop(t, y, args, **kwargs):
        loss, g = _loss_and_gradient(y["model"], problem, layer_mask)
        return done(loss, g, y["model"])

    lean = None  # the explicit phases' settings for `_runge_kutta`, when it runs them
    if _lean_explicit(options):
        lean = {
            "tableau": solver.tableau,
            "order": solver.order(None),
            "evals_per_step": _rhs_evals_per_step(solver),
            "rtol": rtol,
            "atol": atol,
            "norm": controller.norm,
            "done": done,
        }

    num_sv = min(problem.shape)
    n_save = options.save
    # Each clock phase gets the full sample budget; samples of a phase that did not run are
    # marked invalid (t = inf) and dropped by `Trajectory.compress`.
    n1 = n_save if options.clock != "physical" else 0
    summary = _summary(options.save_layers, num_sv)

    # Phase 1: the loss clock, carrying t.
    y1 = {"model": model, "t": jnp.zeros((), dtype)}
    if options.certificates:
        y1["energy"] = jnp.zeros((), dtype)
    t_max = jnp.asarray(options.t_max, dtype)
    # Relative, so that the root finder's absolute tolerance (1e-12) is within float64's
    # resolution of t: as (t − t_max) it asked for 1e-12 at t ~ 1e4, where one ulp is 1.8e-12,
    # never converged, and reported `failed` for a flow that had simply reached t_max.
    reached_t_max = lambda t, y, args, **kw: y["t"] / t_max - 1.0
    grid1 = None
    if n1:
        tau_end_for_grid = jnp.where(jnp.isfinite(tau_switch), tau_switch, 30.0)
        grid1 = tau_end_for_grid * jnp.linspace(0, 1, n1)
    if lean is not None:
        y_mid, _, status1, stats1, _ = _lean_phase(
            _loss_clock_rates,
            y1,
            tau_switch,
            problem,
            options,
            options.max_steps,
            layer_mask,
            lean,
            end_status=_CONTINUE,
        )
    else:
        sol1 = diffrax.diffeqsolve(
            diffrax.ODETerm(_loss_clock_field),
            loss_clock_solver,
            t0=0.0,
            t1=tau_switch,
            dt0=dt0,
            y0=y1,
            args=(problem, 0.0, True, layer_mask),
            stepsize_controller=controller,
            max_steps=options.max_steps,
            event=_phase1_event(stop, reached_t_max, math.isfinite(options.t_max)),
            saveat=_saveat(grid1, summary),
            throw=False,
        )
        y_mid = _final_state(sol1)
        status1 = _status(sol1, y_mid["model"], problem, options, phase_end_is_t_max=False)
        stats1 = _step_stats(sol1, loss_clock_solver)
    t_switch = y_mid["t"]
    finished = use_loss_clock & (status1 >= 0)  # phase 1 ended on its own status

    # Phase 2: physical time, from where phase 1 left off (explicit first under "auto").
    y2 = {"model": y_mid["model"]}
    if options.certificates:
        y2["energy"] = y_mid["energy"]
    t1_local = jnp.where(finished, 0.0, t_max - t_switch)
    stiff_phase = options.solver == "auto"
    y_end, t2, status2, stats2, samples2 = _physical_phase(
        solver,
        y2,
        problem,
        options,
        controller,
        dt0,
        t_switch,
        t1_local,
        summary,
        events={"stop": stop},
        max_steps=options.explicit_steps if stiff_phase else options.max_steps,
        layer_mask=layer_mask,
        lean=lean,
    )
    status = jnp.where(finished, status1, status2)
    t_end = jnp.where(finished, t_switch, t_switch + t2)
    samples = [samples2]

    # Phase 3 ("auto" only): the explicit solver spent its budget, so the tail is stiff:
    # continue with the Rosenbrock method from where it stopped.
    stats = [stats1, stats2]
    if stiff_phase:
        handover = (~finished) & (status2 == Status.MAX_STEPS)

        def stiff_tail():
            y3_end, t3, status3, stats3, samples3 = _physical_phase(
                stiff_solver,
                y_end,
                problem,
                options,
                controller,
                None,
                t_end,
                jnp.where(handover, t_max - t_end, 0.0),
                summary,
                events={"stop": stop},
                max_steps=options.max_steps,
                layer_mask=layer_mask,
            )
            return y3_end, status3, samples3, t3, stats3

        # A real branch: a flow (or a batch) the explicit phase finished never pays for the
        # stiff phase's set-up. Under vmap the branch needs a predicate shared by the batch.
        run_stiff = handover
        if batch_axis is not None:
            run_stiff = jax.lax.psum(handover.astype(jnp.int32), batch_axis) > 0
        y3_end, status3, samples3, t3, stats3 = jax.lax.cond(
            run_stiff, stiff_tail, lambda: _zeros_like_output(stiff_tail)
        )
        if samples3:
            samples3["t"] = jnp.where(handover, samples3["t"], jnp.inf)
        y_end = jax.tree_util.tree_map(lambda a, b: jnp.where(handover, b, a), y_end, y3_end)
        status = jnp.where(handover, status3, status)
        t_end = jnp.where(handover, t_end + t3, t_end)
        stats.append(stats3)
        samples.append(samples3)
        linear_iters = jnp.where(handover, stats3["iters"], 0)
    elif isinstance(solver, Rodas4):
        linear_iters = stats[1]["iters"]
    else:
        linear_iters = jnp.asarray(0, jnp.int32)

    steps = sum(s["num_steps"] for s in stats)
    # Which phase decided the status, and what its integrator said (for `status_message`).
    end_phase = jnp.where(finished, Phase.LOSS_CLOCK, Phase.EXPLICIT)
    solver_code = jnp.where(finished, stats[0]["result"], stats[1]["result"])
    if stiff_phase:
        end_phase = jnp.where(handover, Phase.STIFF_TAIL, end_phase)
        solver_code = jnp.where(handover, stats[2]["result"], solver_code)
    implicit_ran = jnp.any(jnp.stack([s["rhs"] < 0 for s in stats]))
    rhs = jnp.where(implicit_ran, -1, sum(s["rhs"] for s in stats))

    trajectory = None
    if n_save or options.save_ts is not None:
        parts = []
        if n1:
            s1 = dict(sol1.ys[1])
            s1["t"] = jnp.where(use_loss_clock, s1["t"], jnp.inf)
            parts.append(s1)
        for s in samples:
            s["t"] = jnp.where(finished, jnp.inf, s["t"])
            parts.append(s)
        cat = jax.tree_util.tree_map(lambda *xs: jnp.concatenate(xs), *parts)
        trajectory = Trajectory(cat["t"], cat["loss"], cat["sv"], cat.get("layers"))

    loss_end = problem.loss(y_end["model"].product())
    energy = y_end["energy"] if options.certificates else jnp.asarray(jnp.nan, dtype)
    return FlowResult(
        model=y_end["model"],
        status=status,
        t_end=t_end,
        loss=loss_end,
        loss_init=loss0,
        num_steps=steps,
        num_accepted_steps=sum(s["num_accepted_steps"] for s in stats),
        num_rejected_steps=sum(s["num_rejected_steps"] for s in stats),
        num_rhs_evals=rhs,
        num_linear_iters=linear_iters,
        energy=energy,
        end_phase=end_phase.astype(jnp.int32),
        solver_code=solver_code.astype(jnp.int32),
        trajectory=trajectory,
    )


def _physical_phase(
    solver,
    y0,
    problem,
    options,
    controller,
    dt0,
    t_offset,
    t1_local,
    summary,
    events,
    max_steps,
    layer_mask,
    lean=None,
):
    """Integrate in physical time from local time 0 (absolute time `t_offset`) to `t1_local`.

    Returns the final state, its local time, its status, the step statistics and the
    trajectory samples (a dict, empty when nothing is saved). With `lean` (nothing to save)
    the explicit solver runs in gflow's own loop (`_runge_kutta`)."""
    if lean is not None:
        return _lean_phase(
            _physical_rates,
            y0,
            t1_local,
            problem,
            options,
            max_steps,
            layer_mask,
            lean,
            end_status=Status.T_MAX,
        )
    dtype = t_offset.dtype if hasattr(t_offset, "dtype") else jnp.float64
    grid = None
    if options.save_ts is not None:
        grid = jnp.clip(jnp.asarray(options.save_ts, dtype) - t_offset, 0.0, t1_local)
    elif options.save:
        model = y0["model"]
        loss, g = _loss_and_gradient(model, problem, layer_mask)
        h = _loss_time_scale(loss, tree_dot(g, g))
        h = jnp.where(h > 0, h, 1.0)
        hi = jnp.where(jnp.isfinite(t1_local), t1_local, h * 1e8)
        lo = jnp.minimum(h * 1e-3, hi)
        n = options.save
        grid = jnp.concatenate([jnp.zeros(1, dtype), jnp.geomspace(1.0, hi / lo, n - 1) * lo])
        grid = jnp.minimum(grid, t1_local)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_physical_field),
        solver,
        t0=0.0,
        t1=t1_local,
        dt0=dt0,
        y0=y0,
        args=(problem, t_offset, False, layer_mask),
        stepsize_controller=controller,
        max_steps=max_steps,
        event=diffrax.Event(events),
        saveat=_saveat(grid, summary),
        throw=False,
    )
    y_end = _final_state(sol)
    status = _status(sol, y_end["model"], problem, options, phase_end_is_t_max=True)
    samples = {}
    if grid is not None:
        samples = dict(sol.ys[1])
        if options.save_ts is not None:
            # requested times outside this phase are clipped into it: mark them invalid
            ts = jnp.asarray(options.save_ts, dtype)
            inside = (ts >= t_offset) & (ts <= t_offset + _final_time(sol))
            samples["t"] = jnp.where(inside, samples["t"], jnp.inf)
    return y_end, _final_time(sol), status, _step_stats(sol, solver), samples


def _lean_explicit(options) -> bool:
    """Whether the explicit phases can run in gflow's own Runge–Kutta loop: nothing is saved
    along the way and no finite horizon has to be located on the loss clock."""
    return (
        options.solver in LEAN_SOLVERS
        and not options.save
        and options.save_ts is None
        and not math.isfinite(options.t_max)
    )


def _lean_phase(rates, y0, t1, problem, options, max_steps, layer_mask, lean, end_status):
    """One clock phase in `_runge_kutta.integrate`, reported like a diffrax phase."""

    def field(y):
        dy, loss, g = rates(y, problem, layer_mask)
        return dy, lean["done"](loss, g, y["model"])

    run = integrate(
        field,
        y0,
        t1,
        tableau=lean["tableau"],
        order=lean["order"],
        rtol=lean["rtol"],
        atol=lean["atol"],
        norm=lean["norm"],
        max_steps=max_steps,
    )
    diverged = _is_diverged(run.y["model"], problem, options.divergence_bound)
    status = jnp.where(
        diverged,
        Status.DIVERGED,
        jnp.where(
            run.outcome == STOPPED,
            Status.CONVERGED,
            jnp.where(run.outcome == REACHED_END, end_status, Status.MAX_STEPS),
        ),
    ).astype(jnp.int32)
    stats = {
        "num_steps": run.num_steps,
        "num_accepted_steps": run.num_accepted_steps,
        "num_rejected_steps": run.num_rejected_steps,
        "iters": jnp.asarray(0, jnp.int32),
        "result": jnp.asarray(0, jnp.int32),  # gflow's loop has no failure mode of its own
        # f(y0) (which also tests y0), then every stage after the first of each step
        "rhs": 1 + lean["evals_per_step"] * run.num_steps,
    }
    return run.y, run.t, status, stats, {}


_CONTINUE = -1


def _phase1_event(stop, reached_t_max, finite_horizon):
    """Stop on convergence or divergence; with a finite horizon, also locate t = t_max exactly
    (t is a state on the loss clock, so this needs a root find)."""
    if not finite_horizon:
        return diffrax.Event({"stop": stop})
    return diffrax.Event(
        {"stop": stop, "t_max": reached_t_max},
        root_finder=optx.Newton(rtol=1e-12, atol=1e-12),
    )


def _saveat(grid, summary):
    """Always the final state (and the solver state, which counts linear-solve iterations for
    `Rodas4`); with a grid, also summaries at the grid points."""
    if grid is None:
        return diffrax.SaveAt(t1=True, solver_state=True)
    return diffrax.SaveAt(
        subs=[diffrax.SubSaveAt(t1=True), diffrax.SubSaveAt(ts=grid, fn=summary)],
        solver_state=True,
    )


def _step_stats(sol, solver):
    """Step counts of one phase, its linear-solve iterations (0 unless `Rodas4`) and its
    vector-field evaluations: known per step for explicit tableaus (+1 per step for the
    stopping rule; f(y0) and the test at y0); -1 once an implicit solver took a step."""
    keys = ("num_steps", "num_accepted_steps", "num_rejected_steps")
    out = {k: sol.stats[k] for k in keys}
    state = sol.solver_state
    out["iters"] = state["iters"] if isinstance(state, dict) else jnp.asarray(0, jnp.int32)
    out["result"] = solver_code(sol.result)
    per_step = _rhs_evals_per_step(solver)
    if per_step > 0:
        out["rhs"] = out["num_steps"] * (per_step + 1) + 2
    else:
        out["rhs"] = jnp.where(out["num_steps"] > 0, -1, 0)
    return out


def _zeros_like_output(fn):
    shapes = jax.eval_shape(fn)
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _final_time(sol):
    ts = sol.ts[0] if isinstance(sol.ts, list | tuple) else sol.ts
    return ts[-1]


def _final_state(sol):
    ys = sol.ys[0] if isinstance(sol.ys, list | tuple) else sol.ys
    return jax.tree_util.tree_map(lambda x: x[-1], ys)


def _status(sol, model, problem, options, phase_end_is_t_max):
    mask = sol.event_mask
    result = sol.result
    nonfinite = _is_diverged(model, problem, options.divergence_bound)
    ev = jnp.asarray(result == diffrax.RESULTS.event_occurred)
    status = jnp.where(
        nonfinite,
        Status.DIVERGED,
        jnp.where(
            ev & mask["stop"],  # not diverged (above), so converged
            Status.CONVERGED,
            jnp.where(
                ev & mask.get("t_max", False),
                Status.T_MAX,
                jnp.where(
                    result == diffrax.RESULTS.successful,
                    Status.T_MAX if phase_end_is_t_max else _CONTINUE,
                    jnp.where(
                        result == diffrax.RESULTS.max_steps_reached,
                        Status.MAX_STEPS,
                        Status.FAILED,
                    ),
                ),
            ),
        ),
    )
    return status.astype(jnp.int32)


# --------------------------------------------------------------------------------------------
# The front door.

_COMPILED: dict = {}


COMPILE_COUNT = {"flow": 0}


def _compiled_solver(problem, model, options, in_axes=None, devices=None, depths=None):
    """One compiled program per (options, batching, shapes, devices), cached: a sweep compiles
    once per shape group, and a later call with other shapes cannot silently recompile (the
    cached executable only accepts its own shapes). With `depths` (an int array, batched like
    the model) the program takes it as a third argument: depth-padded models (`pad_depth`)."""
    devices = tuple(devices) if devices is not None and len(devices) > 1 else None
    args = (problem, model) if depths is None else (problem, model, depths)
    if depths is not None and in_axes is not None:
        in_axes = (*in_axes, 0)
    key = (
        options,
        in_axes,
        devices,
        jax.tree_util.tree_structure(args),
        tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)),
    )
    hit = _COMPILED.get(key)
    if hit is not None:
        return hit, ALREADY_COMPILED
    axis = None if in_axes is None else "flows"
    if depths is None:
        fn = lambda p, m: solve(p, m, options, batch_axis=axis)
    else:
        fn = lambda p, m, d: solve(p, m, options, depth=d, batch_axis=axis)
    if in_axes is not None:
        fn = jax.vmap(fn, in_axes=in_axes, axis_name=axis)
        if devices is not None:
            # Each device loops over its own slice of the batch: no per-step synchronisation
            # with the slowest member elsewhere (a sharded `jit` would synchronise every step).
            mesh = jax.sharding.Mesh(np.array(devices), ("batch",))
            spec = jax.sharding.PartitionSpec
            fn = jax.shard_map(
                fn,
                mesh=mesh,
                in_specs=tuple(spec("batch") if ax == 0 else spec() for ax in in_axes),
                out_specs=spec("batch"),
                # diffrax's while loops mix per-device and replicated values; each device's
                # program is a plain vmapped solve, so there is nothing to check across devices.
                check_vma=False,
            )
    # Kept on disk whole (see `compile_timed`) unless spread over devices.
    program_key = None if devices is not None else repr(("flow", options, in_axes, depths is None))
    samples = options.save or options.save_ts is not None
    out_like = None if samples else FlowResult.skeleton(model)
    compiled, compile_time = compile_timed(fn, *args, key=program_key, out_like=out_like)
    COMPILE_COUNT["flow"] += 1
    _COMPILED[key] = compiled
    return compiled, compile_time


def flow(
    problem: Problem,
    model: Factorization,
    options: FlowOptions | None = None,
    **kwargs,
) -> FlowResult:
    """Integrate the gradient flow of `model` on `problem` to its limit (or until told to stop).

    **Arguments:**

    - `problem`: a `Problem` (target and mask).
    - `model`: the initial `Factorization`.
    - `options`: a `FlowOptions`; or pass its fields as keyword arguments
      (`flow(p, m, rtol=1e-12, t_max=100.0)`).

    **Returns:** a `FlowResult` with the endpoint model, a `Status`, solver statistics and the
    wall time of the solve alone (`wall_time_s`) and of compiling it (`compile_time_s`, 0 when
    a compiled program for the same shapes and options was reused).

    **Raises:** `ValueError` for a model that does not fit the problem or bad options. A
    diverging flow does not raise: its status is `Status.DIVERGED`.

    ```python
    import gflow
    p = gflow.diagonal(4)
    m = gflow.identity_family(4, depth=3, alpha=1e-2, m=4)
    r = gflow.flow(p, m)
    r.status_label, gflow.singular_values(r.model)
    ```
    """
    if options is None:
        options = FlowOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either `options` or keyword options, not both")
    model.check_problem(problem)
    if problem.target.dtype != model.layers[0].dtype:
        raise ValueError(
            f"problem dtype {problem.target.dtype} differs from model dtype {model.layers[0].dtype}"
        )
    compiled, compile_time = _compiled_solver(problem, model, options)
    start = time.perf_counter()
    result = compiled(problem, model)
    jax.block_until_ready(result)
    return result.timed(time.perf_counter() - start, compile_time.seconds, compile_time.cache_hit)


def pad_depth(model: Factorization, depth: int) -> Factorization:
    """`model` with identity layers appended up to `depth` layers: the same product. Pass the
    true depth to the engine (`solve(..., depth=)`, `SweepSpec(depth_mode="pad")`) to keep the
    padding frozen."""
    d = model.widths[-1]
    if depth < model.depth:
        raise ValueError(f"cannot pad a depth-{model.depth} model down to depth {depth}")
    eye = jnp.eye(d, dtype=model.layers[0].dtype)
    return Factorization(list(model.layers) + [eye] * (depth - model.depth))


def stack(items):
    """Stack equal-structure pytrees (problems, models) along a new leading batch axis."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *items)


def flow_batch(
    problem: Problem,
    model: Factorization,
    options: FlowOptions | None = None,
    **kwargs,
) -> FlowResult:
    """Integrate a batch of flows in one compiled, vmapped program.

    `model` is a batched Factorization (leading axis on every layer, e.g. from `stack`);
    `problem` is either one shared Problem or a batched one. Every field of the returned
    `FlowResult` has the batch axis in front; each member has its own status, so one diverging
    member never stops the others. Under `vmap` a batch costs about (slowest member's steps) ×
    (batch size): group members of similar flow length.
    """
    if options is None:
        options = FlowOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either `options` or keyword options, not both")
    if model.layers[0].ndim != 3:
        raise ValueError("flow_batch needs a batched model (layers of shape (batch, d_out, d_in))")
    batched_problem = problem.target.ndim == 3
    if (model.widths[-1], model.widths[0]) != problem.target.shape[-2:]:
        raise ValueError(
            f"model output shape {(model.widths[-1], model.widths[0])} does not match the "
            f"problem's {problem.target.shape[-2:]}"
        )
    in_axes = (0 if batched_problem else None, 0)
    compiled, compile_time = _compiled_solver(problem, model, options, in_axes)
    start = time.perf_counter()
    result = compiled(problem, model)
    jax.block_until_ready(result)
    return result.timed(time.perf_counter() - start, compile_time.seconds, compile_time.cache_hit)
