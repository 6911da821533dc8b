"""What a flow returns: the endpoint, a status, and how the solve went."""

from __future__ import annotations

import enum

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ..model import Factorization


class Status(enum.IntEnum):
    """Why a flow (or a discrete descent) stopped. Stored as an int array inside results."""

    CONVERGED = 0
    """The stopping rule fired: the estimated distance to the limit is within tolerance."""
    T_MAX = 1
    """The time horizon `t_max` was reached before convergence."""
    MAX_STEPS = 2
    """The step budget `max_steps` ran out before convergence."""
    DIVERGED = 3
    """The state, loss or gradient left the float range, or |θ| exceeded the bound."""
    FAILED = 4
    """The solver failed for another reason (e.g. a nonlinear solve in an implicit step)."""
    LOSS_REACHED = 5
    """An early stop: the loss fell to `stop_loss` × its initial value (`FlowOptions`,
    `DescentOptions`). Not an endpoint of the flow."""
    ROUNDING_FLOOR = 6
    """An early stop asked for with `FlowOptions(rounding_floor=True)`: the stiff tail reached
    a plateau where the gradient is mostly rounding (evaluated with the product associated the
    other way it differs by more than half its size) while the loss is still above rtol × its
    initial value. Not an endpoint; whether the flow would leave the plateau, and where to,
    this stop does not say."""
    PENDING = -1
    """Not computed yet: a sweep point whose chunk has not been written, or a flow solved with
    `defer_tail=True` whose stiff tail is still to run (`flow` never returns this)."""

    @property
    def label(self) -> str:
        return self.name.lower()


class Phase(enum.IntEnum):
    """The part of a solve that ended it (see `FlowResult.end_phase`)."""

    LOSS_CLOCK = 0
    """The loss clock, which crosses the plateau of a small initialisation."""
    EXPLICIT = 1
    """Physical time with the explicit solver (or the one solver that was forced)."""
    STIFF_TAIL = 2
    """The stiff tail of `solver="auto"` (Rosenbrock, or Radau IIA with `tail_method="radau"`)."""
    RADAU_TAIL = 3
    """Radau IIA, where `tail_method="auto"` hands a long Rosenbrock tail over to it."""

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


def select_status(cases, otherwise) -> jax.Array:
    """The status of the first `(condition, status)` case that holds, else `otherwise`."""
    conditions = [jnp.asarray(condition) for condition, _ in cases]
    return jnp.select(conditions, [int(s) for _, s in cases], int(otherwise)).astype(jnp.int32)


def solver_code(result) -> jax.Array:
    """diffrax's result as an int (0: successful), storable in a result or a sweep store."""
    return jnp.asarray(result._value, jnp.int32)


def solver_message(code: int) -> str:
    """diffrax's own words for a result code from `solver_code`."""
    import diffrax

    messages = diffrax.RESULTS._index_to_message
    first_line = messages[code].strip().splitlines()[0] if 0 <= code < len(messages) else ""
    return first_line or "successful"


def status_message(status: int, end_phase: int, code: int) -> str:
    """A sentence saying why a flow stopped: the status, the phase and the integrator's reason."""
    label = Status(int(status)).label
    if int(status) == Status.PENDING:
        return "pending: not computed yet"
    where = f"in the {Phase(int(end_phase)).label} phase"
    if int(status) == Status.FAILED:
        return f"failed {where}: the integrator reported: {solver_message(int(code))}"
    reasons = {
        Status.CONVERGED: "the stopping rule fired (remaining distance within tolerance)",
        Status.T_MAX: "the time horizon t_max was reached before convergence",
        Status.MAX_STEPS: "the step budget max_steps ran out before convergence",
        Status.DIVERGED: "the state, loss or gradient left the float range or the bound",
        Status.LOSS_REACHED: "stopped early where the loss fell to stop_loss × its initial value",
        Status.ROUNDING_FLOOR: "stopped early (rounding_floor=True) on a plateau whose gradient "
        "is mostly float64 rounding, the loss still above rtol × its initial value",
    }
    return f"{label} {where}: {reasons[Status(int(status))]}"


WORK_COLUMNS = ("steps", "rejected_steps", "rhs_evals", "linear_iters", "factorizations")


class Trajectory(eqx.Module):
    """Samples of a flow, time-ordered. Rows that are not samples (past the end of the solve,
    or of a phase that did not run) are `inf` in every field (`valid` is False there);
    `compress()` drops them.

    During the loss-clock phase (small inits, see `flow`) samples are evenly spaced in
    log(loss); in physical time they are log-spaced in t.
    """

    t: Float[Array, " n"]
    loss: Float[Array, " n"]
    singular_values: Float[Array, "n k"]
    layers: Factorization | None

    @property
    def valid(self):
        return jnp.isfinite(self.t)

    def compress(self) -> Trajectory:
        keep = np.asarray(self.valid)
        layers = None
        if self.layers is not None:
            layers = Factorization([np.asarray(w)[keep] for w in self.layers.layers])
        return Trajectory(
            np.asarray(self.t)[keep],
            np.asarray(self.loss)[keep],
            np.asarray(self.singular_values)[keep],
            layers,
        )


class FlowResult(eqx.Module):
    """The outcome of `flow` (or `descend`).

    - `model`: the endpoint factorization.
    - `status`: a `Status` code (int array; `status_label` gives its name).
    - `t_end`: the physical time reached (for descent: steps × learning rate).
    - `loss`, `loss_init`: the loss at the end and at the start.
    - `num_steps`, `num_accepted_steps`, `num_rejected_steps`, `num_rhs_evals`: solver work.
      RHS evaluations count every gradient evaluation the solve asks for: the steps'
      (rejected ones included), the stopping rule's, the one that picks the clock and each
      phase's status (with `rounding_floor`, its second gradient too). XLA may merge two on
      the same point into one (the clock's and the first step's). −1 where a phase ran one of
      diffrax's implicit solvers (`kvaerno5`), whose Newton iterations diffrax does not
      report. The one gap: `solver="rodas4"` (its phases run in `diffeqsolve`) misses the
      dense re-solves of its rejected steps' failed CG (tests/test_flow.py counts the rest).
    - `num_linear_iters`: conjugate-gradient iterations (a Hessian-vector product and a
      preconditioner application each) of the Rosenbrock phases, 0 when they ran with dense
      linear algebra or did not run (with a Gauss–Newton preconditioner of ≥ 1,024 observed
      entries each CG step also spends one Hessian-vector product per stage, uncounted, on
      starting its stages' CG from the previous step's stage solutions);
      `num_factorizations`: their dense factorisations or preconditioner builds. A Radau IIA
      tail (`tail_method`) counts its Newton iterations and its factorisations (Newton
      matrices and decompositions of the Hessian's residual part). Both count every step of
      the stiff tail of `solver="auto"`, rejected ones included, but only accepted steps
      where a Rosenbrock phase runs in `diffeqsolve` (`solver="rodas4"`): diffrax keeps no
      solver state from a rejected step (`num_rejected_steps` says how many steps that is).
    - `phase_work`: the work of each phase, an int array of shape (len(Phase), 5): rows
      indexed by `Phase` (loss clock, explicit, stiff tail, and the Radau tail that a long
      stiff tail hands over to), columns `WORK_COLUMNS` (steps, rejected steps,
      vector-field evaluations, CG or Newton iterations, factorisations); `work()` gives it
      as a dict.
    - `energy`: ∫‖∇loss‖² dt when certificates were requested (else nan). For the exact flow
      `loss_init − loss = energy`.
    - `end_phase`: the `Phase` that ended the solve; `solver_code`: what its integrator
      reported (diffrax's result, 0 when successful). `status_message` puts status, phase and
      reason into words.
    - `trajectory`: samples along the way, when requested.
    - `wall_time_s`, `compile_time_s`: seconds, measured on the host (nan inside `vmap`);
      `compile_time_s` is 0 when the program was already compiled in this process. A `flow`
      (or `flow_batch`) that reaches its stiff tail runs two programs (the tail's is
      compiled only then): both times cover both.
    - `compile_cache_hit`: True when XLA's compilation was loaded from the persistent cache
      (`GFLOW_CACHE_DIR`), False when it was compiled (either program), None when nothing
      was compiled.
    """

    model: Factorization
    status: Int[Array, ""]
    t_end: Float[Array, ""]
    loss: Float[Array, ""]
    loss_init: Float[Array, ""]
    num_steps: Int[Array, ""]
    num_accepted_steps: Int[Array, ""]
    num_rejected_steps: Int[Array, ""]
    num_rhs_evals: Int[Array, ""]
    num_linear_iters: Int[Array, ""]
    energy: Float[Array, ""]
    end_phase: Int[Array, ""] = eqx.field(default_factory=lambda: jnp.asarray(1, jnp.int32))
    solver_code: Int[Array, ""] = eqx.field(default_factory=lambda: jnp.asarray(0, jnp.int32))
    num_factorizations: Int[Array, ""] = eqx.field(
        default_factory=lambda: jnp.asarray(0, jnp.int32)
    )
    phase_work: Int[Array, "phases 5"] = eqx.field(
        default_factory=lambda: jnp.zeros((len(Phase), len(WORK_COLUMNS)), jnp.int32)
    )
    trajectory: Trajectory | None = None
    wall_time_s: float = eqx.field(static=True, default=float("nan"))
    compile_time_s: float = eqx.field(static=True, default=float("nan"))
    compile_cache_hit: bool | None = eqx.field(static=True, default=None)

    @classmethod
    def skeleton(cls, model: Factorization, samples: bool = False, layers: bool = False):
        """A result with `model`'s structure: the pytree structure of what a solve returns
        (its leaves are placeholders), with a trajectory where it saves `samples` (holding the
        layers too with `layers`; without samples, `layers` saves nothing)."""
        zero = np.zeros(())
        trajectory = None
        if samples:
            trajectory = Trajectory(zero, zero, zero, model if layers else None)
        return cls(
            model,
            *[zero] * 10,
            end_phase=zero,
            solver_code=zero,
            num_factorizations=zero,
            phase_work=np.zeros((len(Phase), len(WORK_COLUMNS))),
            trajectory=trajectory,
        )

    def work(self) -> dict:
        """The work of each phase that did any: {phase label: {column: count}} (one member).
        A phase can evaluate without taking a step (its start and its status)."""
        table = np.asarray(self.phase_work)
        if table.ndim != 2:
            raise ValueError("work() reads one result; use result.member(i) on a batch")
        return {
            Phase(i).label: dict(zip(WORK_COLUMNS, (int(v) for v in row), strict=True))
            for i, row in enumerate(table)
            if np.any(row != 0)
        }

    def timed(
        self, wall_time_s: float, compile_time_s: float, compile_cache_hit: bool | None = None
    ) -> FlowResult:
        """A copy carrying host-side timings."""
        import dataclasses

        return dataclasses.replace(
            self,
            wall_time_s=wall_time_s,
            compile_time_s=compile_time_s,
            compile_cache_hit=compile_cache_hit,
        )

    def member(self, i: int) -> FlowResult:
        """Member `i` of a batched result (from `flow_batch`)."""
        return jax.tree_util.tree_map(lambda x: x[i] if getattr(x, "ndim", 0) else x, self)

    @property
    def status_message(self) -> str | list[str]:
        """Why the flow stopped, in words (a list for a batched result)."""
        codes = [np.asarray(x).ravel() for x in (self.status, self.end_phase, self.solver_code)]
        messages = [status_message(*row) for row in zip(*codes, strict=True)]
        return messages[0] if np.asarray(self.status).ndim == 0 else messages

    @property
    def status_label(self) -> str | list[str]:
        s = np.asarray(self.status)
        if s.ndim == 0:
            return Status(int(s)).label
        return [Status(int(v)).label for v in s.ravel()]
