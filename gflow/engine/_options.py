"""How a flow is integrated: `FlowOptions`, checked when built and never rewritten."""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx

# Names only: diffrax is imported when a program is traced, not when options are made (a
# program loaded from the cache needs no diffrax: `import gflow` stays light).
SOLVERS = ("dopri5", "dopri8", "euler", "kvaerno5", "rodas4", "tsit5")
FIXED_STEP = ("euler",)
LEAN_SOLVERS = ("auto", "tsit5", "dopri5")  # FSAL tableaus that gflow's own loop runs
CLOCKS = ("auto", "physical", "loss")
LINEAR_SOLVERS = ("auto", "dense", "cg")
# the stiff tail's Rosenbrock tableau: `auto` (the default, `_solve.tail_tableau`), then the
# tableaus of `_rosenbrock.TABLEAUS`
ROSENBROCK = ("auto", "rodas4p2", "rodas5p", "rodas4p", "rodas4")
# how the stiff tail steps: the Rosenbrock method handing a long tail over to Radau IIA
# (`auto`, the default: `_solve.tail_stages`), a Rosenbrock method (`_rosenbrock`) throughout,
# or Radau IIA (`_radau`) throughout
TAIL_METHODS = ("auto", "rosenbrock", "radau")
PRECONDITIONERS = ("gauss-newton", "spectral", "none")
GAUSS_NEWTON = ("auto", "inverse", "eigh", "cholesky", "tangent")
TAIL_SCALES = ("layer", "entry")
# why `tails="batch"` is refused where `FlowOptions.tails_batch_refused`
BATCHED_TAILS_REFUSED = (
    "tail_method='radau' does not batch its stiff tails: use tails='apart' (the default), not "
    "tails='batch' (a batched Radau tail hung under vmap)"
)
# the options that only the stiff tail of `solver="auto"` reads (`FlowOptions.head`)
TAIL_ONLY = (
    "tail_rtol",
    "tail_scale",
    "rounding_floor",
    "rounding_allowance",
    "compensated_gradient",
    "linear_solver",
    "tail_method",
    "radau_after",
    "rosenbrock",
    "preconditioner",
    "gauss_newton",
)


def _times(ts):
    return None if ts is None else tuple(float(t) for t in ts)


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def solver_class(name: str):
    """The diffrax (or gflow) solver class of a solver name."""
    import diffrax

    from ._rosenbrock import Rodas4

    classes = {
        "tsit5": diffrax.Tsit5,
        "dopri5": diffrax.Dopri5,
        "dopri8": diffrax.Dopri8,
        "kvaerno5": diffrax.Kvaerno5,
        "euler": diffrax.Euler,
        "rodas4": Rodas4,
    }
    return classes[name]


class FlowOptions(eqx.Module):
    """How to integrate a flow. Checked at construction; what you pass is what is used.

    - `solver`: `auto` (default): Tsit5, and if it has not converged after `explicit_steps`
      steps (a stiff tail: step size pinned at the stability bound of the fastest mode), the
      L-stable Rosenbrock method `rodas4` (dense or matrix-free linear algebra) to the end.
      Or one fixed solver: `tsit5`, `dopri5`, `dopri8` (explicit), `kvaerno5`, `rodas4` (stiff),
      `euler` (fixed step `dt`), or any diffrax solver object (e.g. `diffrax.Heun()`; with
      `dt` it takes fixed steps).
    - `rtol`, `atol`: tolerances of the PID step controller and of the stopping rule. `atol=None`
      uses `1e-2·rtol·RMS(θ(0))`, i.e. relative to the scale of the initialisation.
    - `tail_rtol`: the step controller's rtol in the stiff tail of `solver="auto"` (its atol
      scaled alike); `None` (default): `rtol`. The stopping rule keeps `rtol` and `atol`, so
      the flow stops at the same distance from its limit. A tail that contracts onto its
      limit damps each step's local error on the way: on the `scale` problem (d = 50, 100)
      1e-8 took 3× fewer tail steps and moved the top singular values by 4e-12 and 3e-13.
      A tail that converges algebraically (deep small-α flows) does not: on d = 8 random
      masks they moved by up to 8e-10, beyond rtol. Check a looser tail against the default
      on one flow of a study (docs/theory.md §5).
    - `tail_scale`: what each parameter's error in a stiff-tail step is held against:
      `layer` (default) atol + rtol·max(|θ_i|, s_l), s_l the RMS entry of θ_i's layer at the
      step's start; `entry` atol + rtol·|θ_i| (diffrax's rule, and gflow's before 2026-12-04).
      X and its singular values read a layer through matrix products, where an entry's error
      counts against the size of its layer, not its own: late in a tail the per-entry rule held
      the step to the relative accuracy of one entry 1e-4 the size of its layer. Measured
      (benchmarks/README, 2026-12-04): the `scale` problem 2.3× (d = 50, 100) fewer tail steps,
      top-5 singular values 8e-14 apart; d = 8 random masks 1.4–7× fewer, and flows that ran out
      of 100k tail steps converge. Against rtol 1e-12 references the leading singular values
      were ≤ 1e-10 off with `layer`, ≤ 5.4e-10 with `entry` (docs/theory.md §5).
    - `rounding_floor`: an opt-in early stop of the stiff tail (default off): stop with status
      `rounding_floor` where the gradient is mostly float64 rounding (evaluated with the
      product associated the other way it differs by more than half its size) while the loss
      is still above rtol × its initial value. Such a plateau can cost the whole step budget;
      the stop is not an endpoint, and it does not mean the flow's limit is decided by
      rounding: the rounding sits mostly in directions that have converged, and the flow can
      still leave the plateau the same way every time (a d = 8 random mask, depth 5,
      α = 3e-4, with RODAS4P2, converges after 95k steps to singular values reproduced to
      1e-12 from inits perturbed by 1e-15, where this stop fired after 25; docs/theory.md §5).
    - `rounding_allowance`: an opt-in (default off) widening of the stiff tail's step
      tolerance by what float64 rounding in the gradient can put in a step's error: κ·h·δg per
      parameter, δg a bound on the rounding in its gradient component and κ how much the
      Rosenbrock error estimate can amplify it (1.4 for RODAS5P, 2.9 for RODAS4P2; the figures
      that follow were measured with RODAS4P2). In directions the flow has
      converged in, the error estimate is h × rounding and pins the step size on plateaus: a
      d = 8 random mask, depth 5, α = 3e-4 took 95k tail steps (3 min) strictly and 3.7k (8 s)
      with it, to the same singular values (6e-14, 5e-13 relative). Not the default: on the
      112-flow sweep four flows that converge strictly ran out of steps with it, and the sweep
      as a whole was not faster; re-measured on 2026-12-05, three of them still ran out (86–96%
      of their steps rejected), one having left the strict flow's path (docs/theory.md §5).
    - `compensated_gradient`: where the stiff tail evaluates the gradient (its vector field and
      its stopping rule) with the layer products in double-double arithmetic (~32 digits;
      engine/_compensated.py, docs/theory.md §5): `auto` (default) where float64 rounding may
      be 1e-3 of the gradient (a bound from the layers' norms), on factorisations whose widths
      are all ≤ 32; `True` at every evaluation; `False` never (float64 throughout, as before
      2026-12-07). On a saddle plateau, or where the top singular value runs off, the float64
      gradient can be rounding and nothing else, and the flow it integrates is not the
      gradient flow: a d = 8 random mask (depth 5, α = 1e-4, seed 1) ran out of 100k tail
      steps in float64 and converges in 1,989 with `auto` (3.0 s). Its derivative (the
      Hessian-vector products and Hessians of the stiff solvers) stays float64. A
      double-double gradient costs ~1.6 float64 ones at d = 8 (square layers, called alone), and
      a tail program that may take it compiles ~3 s longer.
    - `t_max`: physical-time horizon (`inf` by default: stop on convergence).
    - `max_steps`: step budget per clock phase; the solve always terminates.
    - `clock`: `auto`, `physical` or `loss` (docs/theory.md §5). Sampling at `save_ts` and
      fixed steps run on the physical clock: `auto` then means physical (`clock_in_use`).
    - `loss_clock_until`: the loss clock hands over to physical time once the loss has dropped
      to this fraction of its initial value.
    - `save`: trajectory samples per clock phase (0: none); `save_layers` keeps the layers too.
      On the loss clock samples are evenly spaced in log(loss); in physical time they are
      log-spaced from 1e-3 to 1e8 loss time-scales (or up to `t_max`).
    - `certificates`: carry the energy integral ∫‖∇loss‖² dt as an extra state.
    - `linear_solver`: how `rodas4` solves its linear systems: `auto` (dense Cholesky up to 200
      parameters, else matrix-free CG on Hessian-vector products; up to 1,024 parameters a
      step whose CG does not converge within about a dense step's cost is solved densely),
      `dense` or `cg`.
    - `tail_method`: how the stiff tail steps: `auto` (default): the Rosenbrock method (the
      options below), and where its tail has not converged after `radau_after` steps, Radau
      IIA from where it stands, for what is left of `max_steps` (a Radau step counted as
      `_solve.RADAU_STEP_COST` = 8 of them; `Phase.RADAU_TAIL` in `work()`). Only a tail run
      alone hands over: tails batched under vmap (`tails="batch"`, `solver="rodas4"`), models
      past Radau's dense limit, `rounding_allowance`, `tail_scale="entry"` (Radau's errors
      are layer-scaled) and compilations with XLA's YNNPACK fusion (off the CPU) keep the
      Rosenbrock method throughout. On the 112-flow d = 8 sweep of the `scale` benchmark 110
      flows converged against 108, in 239.9 s against 522.3 s side by side, the top two
      singular values of the 108 flows that converge both ways within 3.6e-9 of each other;
      a third singular value that escapes last was 1.9e-8 off an rtol-1e-12 reference where
      the Rosenbrock tail throughout is 1.0e-8 off (benchmarks/README, "nineteenth session";
      1.1e-8 against a reference Rosenbrock throughout at 89ad362, "twenty-seventh
      session"). Past d = 8 the handover can cost as well as pay: a Radau step's Newton
      matrix takes ~(3|Ω|)²·P, and at depth 4 on 30%-observed 16 × 16 and 20 × 20 targets
      the handover took 2.27× and 1.62× the Rosenbrock tail's solve, where on a
      50%-observed 12 × 12 one it took 0.29× (`python -m benchmarks.handover`); pass
      `tail_method="rosenbrock"` or `"radau"` where it matters.
      `rosenbrock`: the Rosenbrock method throughout (before 2026-12-07). `radau`:
      three-stage Radau IIA (order 5) throughout, its Newton iteration taking each stage's own
      Gauss–Newton curvature (engine/_radau.py). On flows whose top singular value runs off
      it keeps its accuracy at 100–250× the Rosenbrock method's step: a d = 8 random mask
      (depth 4, α = 1e-4, seed 2) crossed t = 1e8 → 3e8 in 156 steps against 30,153, with σ₁
      6.5e-10 apart (benchmarks/README, "A Radau IIA tail"); where the Rosenbrock method is
      not held it is no faster. It forms the P × P Hessian and its eigendecomposition every
      50 steps (P ≤ 4,096, else an error); its tails run side by side in sweeps and batches
      where gflow compiles without XLA's YNNPACK fusion (on the CPU; elsewhere one at a time:
      with it they leaked memory, `tails_run_alone`) and are never batched under vmap
      (`tails="batch"` is refused: a batched one hung); `linear_solver`, `rosenbrock`,
      `preconditioner` and `gauss_newton` do not apply to it.
    - `radau_after`: with `tail_method="auto"`, the Rosenbrock tail steps after which Radau
      IIA goes on (default 3,000).
    - `rosenbrock`: the tableau of that Rosenbrock method: `auto` (default): `rodas5p` where
      the Gauss–Newton preconditioner holds ≥ 1,024 observed entries, else `rodas4p2`;
      `rodas4p2` (order 4, six stages); `rodas5p` (order 5, eight stages: 1.4–2× fewer tail
      steps and fewer preconditioner builds, so faster where those dominate: the `scale`
      problem 1.04–1.15× at d = 100, d = 200 in 506 s; but slower where flows spend their
      whole step budget: the 112-flow d = 8 sweep took 742 s, against 615 s with `rodas4p2`
      the same morning, 2026-12-05); either is an independent check of the other's endpoint;
      `rodas4p` or `rodas4` (Hairer–Wanner's, which loses order on stiff flow tails and takes
      1.9–2.6× the steps; docs/theory.md §5).
    - `preconditioner`: of that CG: `gauss-newton` (default: the Woodbury solve through the
      |Ω| × |Ω| NTK Gram, docs/theory.md §5), `spectral` (a randomized rank-64 sketch of the
      Hessian) or `none`; `gauss_newton`: how its Gram is factorised: `auto` (default):
      `tangent` from 1,024 observed entries where the rank r X has learned when the tail
      begins (the largest gap in its spectrum above 1e-2·σ₁; the target's rank when samples
      are saved) has
      2·r·(d_out + d_in) ≤ |Ω|, else `cholesky` from 4,096 observed entries, else `inverse`;
      `tangent`: the Gram on the observed entries of the rank-r tangent space of X only, a
      system of r·(d_out + d_in) rows in closed form, cheap enough to rebuild every few
      steps (the `scale` problem at d = 100: 15.1 s against 28.3 s; d = 200: 76 s against
      315 s; 2026-12-06, docs/theory.md §5); `inverse`: its inverse at the
      shift of the step that builds it (2–2.5× cheaper to form than `eigh`; the `scale`
      problem at d = 100: 1.35× faster solve, 2026-12-05); `cholesky`: the same matrix as a
      Cholesky factor stored for blocked triangular solves, ~3.5× cheaper to form than the
      inverse and up to 1.3× slower to apply (the `scale` problem at d = 200: 1.43× faster
      solve, at d = 100 the same time); `eigh`: serves every shift.
    - `divergence_bound`: |θ_i| above this counts as diverged.
    - `stop_loss`: stop early, with status `loss_reached`, where the loss has fallen to this
      fraction of its initial value (in (0, 1); `None`: run to the limit). The flow runs on
      the loss clock, on which the loss is exactly loss(0)·e^{−2τ}, so the stop lands on that
      loss to the integration tolerance; a flow that converges first reports `converged`.
    - `dt`: the fixed step of `solver="euler"` (explicit Euler is gradient descent with
      learning rate dt: a reference for `descend`).
    - `save_ts`: explicit physical times to sample; the trajectory then holds exactly these
      times (inf past the end of the solve).
    """

    solver: str | object = "auto"  # a name, or a diffrax.AbstractSolver
    rtol: float = 1e-10
    atol: float | None = None
    tail_rtol: float | None = None
    tail_scale: str = "layer"
    rounding_floor: bool = False
    rounding_allowance: bool = False
    compensated_gradient: bool | str = "auto"
    t_max: float = math.inf
    max_steps: int = 100_000
    explicit_steps: int = 2_000
    clock: str = "auto"
    loss_clock_until: float = 1e-2
    save: int = 0
    save_layers: bool = False
    certificates: bool = False
    linear_solver: str = "auto"
    tail_method: str = "auto"
    radau_after: int = 3_000
    rosenbrock: str = "auto"
    preconditioner: str = "gauss-newton"
    gauss_newton: str = "auto"
    divergence_bound: float = 1e100
    dt: float | None = None
    stop_loss: float | None = None
    save_ts: tuple[float, ...] | None = eqx.field(default=None, converter=_times)

    def __check_init__(self):
        if isinstance(self.solver, str):
            if self.solver not in SOLVERS and self.solver != "auto":
                raise ValueError(f"unknown solver {self.solver!r}; choose from {sorted(SOLVERS)}")
        else:
            import diffrax

            if not isinstance(self.solver, diffrax.AbstractSolver):
                raise ValueError(f"solver must be a name or a diffrax solver, got {self.solver!r}")
        if self.save_ts is not None:
            ts = self.save_ts
            if not ts or any(b < a for a, b in zip(ts, ts[1:], strict=False)) or ts[0] < 0:
                raise ValueError("save_ts must be a non-empty, non-decreasing list of times >= 0")
            if self.clock == "loss":
                raise ValueError("save_ts (physical times) needs clock='physical' or 'auto'")
        if self.solver in FIXED_STEP:
            if self.dt is None or not (self.dt > 0):
                raise ValueError(f"solver {self.solver!r} takes a fixed step: pass dt > 0")
        elif self.dt is not None and isinstance(self.solver, str):
            raise ValueError("dt is only for fixed-step solvers (solver='euler')")
        if self.fixed_step and self.clock == "loss":
            raise ValueError("fixed-step solvers run on the physical clock")
        if self.linear_solver not in LINEAR_SOLVERS:
            raise ValueError(
                f"unknown linear_solver {self.linear_solver!r}; choose from {LINEAR_SOLVERS}"
            )
        if self.tail_method not in TAIL_METHODS:
            raise ValueError(
                f"unknown tail_method {self.tail_method!r}; choose from {TAIL_METHODS}"
            )
        if self.tail_method == "radau" and self.tail_scale == "entry":
            raise ValueError(
                "tail_scale='entry' holds each entry's step error to its own size; "
                "tail_method='radau' measures its Newton and step errors against each layer's "
                "RMS entry (tail_scale='layer') and rejected every step under the per-entry rule"
            )
        if self.tail_method == "radau" and self.rounding_allowance:
            raise ValueError(
                "rounding_allowance widens a Rosenbrock step's tolerance by its tableau's "
                "rounding gain; tail_method='radau' has none"
            )
        if self.rosenbrock not in ROSENBROCK:
            raise ValueError(f"unknown rosenbrock {self.rosenbrock!r}; choose from {ROSENBROCK}")
        if self.gauss_newton not in GAUSS_NEWTON:
            raise ValueError(
                f"unknown gauss_newton {self.gauss_newton!r}; choose from {GAUSS_NEWTON}"
            )
        if self.preconditioner not in PRECONDITIONERS:
            raise ValueError(
                f"unknown preconditioner {self.preconditioner!r}; choose from {PRECONDITIONERS}"
            )
        if self.clock not in CLOCKS:
            raise ValueError(f"unknown clock {self.clock!r}; choose from {CLOCKS}")
        if not (0 < self.rtol < 1):
            raise ValueError(f"rtol must lie in (0, 1), got {self.rtol}")
        if self.tail_rtol is not None and not (0 < self.tail_rtol < 1):
            raise ValueError(f"tail_rtol must lie in (0, 1), got {self.tail_rtol}")
        if self.tail_scale not in TAIL_SCALES:
            raise ValueError(f"unknown tail_scale {self.tail_scale!r}; choose from {TAIL_SCALES}")
        if not isinstance(self.rounding_floor, bool):
            raise ValueError(f"rounding_floor must be True or False, got {self.rounding_floor!r}")
        if not isinstance(self.rounding_allowance, bool):
            raise ValueError(
                f"rounding_allowance must be True or False, got {self.rounding_allowance!r}"
            )
        if not (isinstance(self.compensated_gradient, bool) or self.compensated_gradient == "auto"):
            raise ValueError(
                "compensated_gradient must be True, False or 'auto', got "
                f"{self.compensated_gradient!r}"
            )
        tail_options = (  # (asked for, what it does to the stiff tail, a hint)
            (self.tail_rtol is not None, "tail_rtol is the stiff tail's tolerance", " (use rtol)"),
            (
                self.tail_scale != TAIL_SCALES[0],
                f"tail_scale={self.tail_scale!r} sets the stiff tail's step error",
                "",
            ),
            (self.rounding_floor, "rounding_floor stops the stiff tail", ""),
            (
                self.tail_method != TAIL_METHODS[0],
                f"tail_method={self.tail_method!r} steps the stiff tail",
                "",
            ),
            (
                self.compensated_gradient is True,
                "compensated_gradient=True evaluates the stiff tail's gradient",
                "",
            ),
            (
                self.rounding_allowance,
                "rounding_allowance widens the stiff tail's step tolerance",
                "",
            ),
        )
        for asked, what, hint in tail_options:
            if asked and not self.stiff_tail:
                raise ValueError(
                    f"{what} of solver='auto'; solver={self.solver!r} has no tail{hint}"
                )
        if self.atol is not None and not (self.atol > 0 and math.isfinite(self.atol)):
            raise ValueError(f"atol must be finite and > 0, got {self.atol}")
        if not (self.t_max > 0):
            raise ValueError(f"t_max must be > 0, got {self.t_max}")
        if not _positive_int(self.max_steps):
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")
        if not _positive_int(self.radau_after):
            raise ValueError(f"radau_after must be a positive integer, got {self.radau_after!r}")
        if not _positive_int(self.explicit_steps):
            raise ValueError(
                f"explicit_steps must be a positive integer, got {self.explicit_steps}"
            )
        if self.stop_loss is not None:
            if not (0 < self.stop_loss < 1):
                raise ValueError(f"stop_loss must lie in (0, 1), got {self.stop_loss}")
            if self.clock_in_use == "physical":
                raise ValueError(
                    "stop_loss runs on the loss clock: it cannot be combined with "
                    "clock='physical', save_ts or fixed steps"
                )
        if not (0 < self.loss_clock_until < 1):
            raise ValueError(f"loss_clock_until must lie in (0, 1), got {self.loss_clock_until}")
        if not (isinstance(self.save, int) and self.save >= 0):
            raise ValueError(f"save must be a non-negative integer, got {self.save!r}")

    @property
    def fixed_step(self) -> bool:
        return self.solver in FIXED_STEP or (
            not isinstance(self.solver, str) and self.dt is not None
        )

    @property
    def clock_in_use(self) -> str:
        """The clock the flow runs on: `clock`, except that sampling at `save_ts` and fixed steps
        need physical time."""
        if self.save_ts is not None or self.fixed_step:
            return "physical"
        return self.clock

    @property
    def compensated_mode(self) -> str:
        """`compensated_gradient` as the stiff tail reads it: `auto`, `always` or `never`."""
        if isinstance(self.compensated_gradient, bool):
            return "always" if self.compensated_gradient else "never"
        return "auto"

    @property
    def stiff_tail(self) -> bool:
        """`solver="auto"`: an explicit phase, then the Rosenbrock tail if it has not converged."""
        return self.solver == "auto"

    def head(self) -> FlowOptions:
        """These options with the stiff tail's own (`TAIL_ONLY`) at their defaults: what the
        flow before its tail depends on, where the tail is a program of its own. Flows that
        differ only in how their tails are solved share that first program."""
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in TAIL_ONLY}
        return dataclasses.replace(self, **defaults)

    @property
    def tails_batch_refused(self) -> bool:
        """Whether a batch's stiff tails must not run batched under vmap (`tails="batch"`):
        Radau IIA's (`tail_method="radau"`), a batch of two of which hung in the test suite
        (XLA waiting, no CPU; not seen since and not explained)."""
        return self.tail_method == "radau"

    @property
    def tails_run_alone(self) -> bool:
        """Whether each stiff tail must run on one thread at a time. Radau IIA's must where
        gflow cannot compile its programs without XLA's YNNPACK fusion (`_compile.
        compiler_options`: off the CPU, or on a jaxlib that does not know the option): with
        it, two of its d = 8 tails on two threads grew the process by ~20 MB/s (a 112-flow
        sweep reached 14 GB), and nothing without it (benchmarks/README, "seventeenth
        session")."""
        from ._compile import compiler_options

        return self.tail_method == "radau" and not compiler_options()

    @property
    def lean(self) -> bool:
        """Whether the explicit phases run in gflow's own Runge–Kutta loop: no finite horizon
        has to be located (a root find on the loss clock, an end at `t_max`)."""
        return (
            isinstance(self.solver, str)
            and self.solver in LEAN_SOLVERS
            and not math.isfinite(self.t_max)
        )
