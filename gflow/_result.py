"""What a flow returns: the endpoint, a status, and how the solve went."""

from __future__ import annotations

import enum

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._model import Factorization


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
    PENDING = -1
    """Not computed yet: a sweep point whose chunk has not been written (a flow never returns
    this)."""

    @property
    def label(self) -> str:
        return self.name.lower()


class Trajectory(eqx.Module):
    """Samples of a flow, time-ordered. Rows past the end of the solve are `inf` (`valid` is
    False there); `compress()` drops them.

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
    - `num_steps`, `num_accepted_steps`, `num_rejected_steps`, `num_rhs_evals`: solver work;
      RHS evaluations count every gradient evaluation, the stopping rule's included.
    - `num_linear_iters`: conjugate-gradient iterations of the stiff (Rosenbrock) phase, 0 when
      it ran with dense linear algebra or did not run.
    - `energy`: ∫‖∇loss‖² dt when certificates were requested (else nan). For the exact flow
      `loss_init − loss = energy`.
    - `trajectory`: samples along the way, when requested.
    - `wall_time_s`, `compile_time_s`: seconds, measured on the host (nan inside `vmap`).
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
    trajectory: Trajectory | None = None
    wall_time_s: float = eqx.field(static=True, default=float("nan"))
    compile_time_s: float = eqx.field(static=True, default=float("nan"))

    def timed(self, wall_time_s: float, compile_time_s: float) -> FlowResult:
        """A copy carrying host-side timings."""
        import dataclasses

        return dataclasses.replace(self, wall_time_s=wall_time_s, compile_time_s=compile_time_s)

    def member(self, i: int) -> FlowResult:
        """Member `i` of a batched result (from `flow_batch`)."""
        return jax.tree_util.tree_map(lambda x: x[i] if getattr(x, "ndim", 0) else x, self)

    @property
    def status_label(self) -> str | list[str]:
        s = np.asarray(self.status)
        if s.ndim == 0:
            return Status(int(s)).label
        return [Status(int(v)).label for v in s.ravel()]
