"""The identity family's reduced flow on gflow's own Runge–Kutta loop (docs/theory.md §2, §12).

Inside the family every layer is the same matrix of span{I, B, J}, so the d²L-dimensional flow
is exactly a flow of its eigenvalues λ_A, λ_B (λ_C decays on its own, in closed form). The
state is u_k = ln λ_k, so σ_k = e^{L·u_k} keeps its relative accuracy at any α and depth
(σ_B reaches 1e-44); the error tolerance on u is a relative tolerance on λ.

- To the endpoint, on the loss clock τ: the loss ½n r² falls like e^{−2τ}, so r = r₀e^{−τ}
  exactly (carried as ln|r|, which every Runge–Kutta method integrates exactly), dt/dτ = 1/κ
  with κ = (L/n)(λ_A^{2L−2} + (n − 1)λ_B^{2L−2}), and du_k/dτ = −λ_k^{L−2} r/κ. The plateau
  costs a handful of steps whatever its length, the escape time is the t at which the loss
  has halved (τ = ½ ln 2), and the flow stops when the change still ahead of every ln λ_k,
  λ_k^{L−2}|r|/κ, is below the tolerance.
- Along a trajectory, in physical time: du_k/dt = −λ_k^{L−2} r(u), sampled at given times.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from ._theory import _validate, family_constants, log_lambda_c_at

_HALF_LOSS = 0.5 * math.log(2.0)  # τ at which loss = loss₀/2


@dataclass(frozen=True)
class FamilyFlow:
    """The reduced flow of one identity-family configuration.

    - `status`: "converged", or "max_steps" (the endpoint fields are then where it stopped);
    - `t_end`: the time the stopping rule fired; `escape_time`: the time the loss had halved;
    - `log_lambda`: ln λ_A, ln λ_B, ln λ_C at `t_end` (λ_C from its closed form);
    - `log_sigma_a`, `log_sigma_b`: L·ln λ at `t_end`; modes A and B have converged there, so
      these are the t = ∞ values to set beside `family_limit` (mode C tends to 0);
    - `ts`, `log_lambda_ts`: the trajectory (rows: times; columns: A, B, C), when asked for;
    - `num_steps`: Runge–Kutta steps, accepted and rejected.
    """

    depth: int
    n: int
    s: int
    status: str
    t_end: float
    escape_time: float
    log_lambda: np.ndarray
    num_steps: int
    ts: np.ndarray | None = None
    log_lambda_ts: np.ndarray | None = None

    @property
    def log_sigma_a(self) -> float:
        return self.depth * float(self.log_lambda[0])

    @property
    def log_sigma_b(self) -> float:
        return self.depth * float(self.log_lambda[1])

    @property
    def sigma_a(self) -> float:
        return math.exp(self.log_sigma_a)

    @property
    def sigma_b(self) -> float:
        return math.exp(self.log_sigma_b)


def _kappa(depth, n, u):
    import jax.numpy as jnp

    return (depth / n) * (
        jnp.exp((2 * depth - 2) * u[0]) + (n - 1) * jnp.exp((2 * depth - 2) * u[1])
    )


def _residual(depth, n, s, w, u):
    import jax.numpy as jnp

    return (jnp.exp(depth * u[0]) + (n - 1) * jnp.exp(depth * u[1])) / n - s * w


@functools.cache
def _endpoint_program(tol: float, max_steps: int):
    """One compiled program for every configuration: L and n enter as traced scalars."""
    import diffrax
    import jax
    import jax.numpy as jnp

    from ..engine._runge_kutta import STOPPED, integrate

    def rates(y, sign, depth, n):
        u, log_r = y["u"], y["log_r"]
        kappa = _kappa(depth, n, u)
        r = sign * jnp.exp(log_r)
        du = -jnp.exp((depth - 2) * u) * r / kappa
        ahead = jnp.max(jnp.abs(du))  # ∫ of du/dτ = −λ^{L−2} r₀e^{−τ}/κ from τ to ∞, κ frozen
        return {"u": du, "log_r": -jnp.ones_like(log_r), "t": 1.0 / kappa}, ahead

    def run(u0, log_r0, sign, depth, n):
        y0 = {"u": u0, "log_r": log_r0, "t": jnp.zeros_like(log_r0)}
        common = dict(tableau=diffrax.Tsit5().tableau, order=5, rtol=tol, atol=tol, norm=_rms)
        # The plateau and the escape up to half the loss: ends exactly at τ = ½ ln 2.
        head = integrate(
            lambda y: (rates(y, sign, depth, n)[0], False),
            y0,
            _HALF_LOSS,
            max_steps=max_steps,
            **common,
        )

        def until_converged(y):
            f, ahead = rates(y, sign, depth, n)
            return f, ahead <= tol

        tail = integrate(
            until_converged,
            head.y,
            jnp.inf,
            max_steps=max_steps,
            **common,
        )
        steps = head.num_steps + tail.num_steps
        return tail.y["u"], tail.y["t"], head.y["t"], tail.outcome == STOPPED, steps

    return jax.jit(run)


@functools.cache
def _trajectory_program(tol: float, max_steps: int):
    """One compiled program for every configuration and number of times of the same length."""
    import diffrax
    import jax
    import jax.numpy as jnp

    from ..engine._runge_kutta import integrate

    def run(u0, ts, depth, n, s, w):
        def field(u):
            return -jnp.exp((depth - 2) * u) * _residual(depth, n, s, w, u), False

        def segment(u, interval):
            out = integrate(
                field,
                u,
                interval,
                tableau=diffrax.Tsit5().tableau,
                order=5,
                rtol=tol,
                atol=tol,
                norm=_rms,
                max_steps=max_steps,
            )
            return out.y, (out.y, out.num_steps)

        intervals = jnp.diff(ts, prepend=0.0)
        _, (us, steps) = jax.lax.scan(segment, u0, intervals)
        return us, jnp.sum(steps)

    return jax.jit(run)


def _rms(tree):
    import jax.numpy as jnp

    from ..engine._dynamics import flatten

    return jnp.sqrt(jnp.mean(flatten(tree) ** 2))


def family_flow(
    depth: int,
    n: int,
    s: int,
    alpha: float,
    m: float = math.inf,
    w: float = 1.0,
    *,
    ts=None,
    rtol: float = 1e-13,
    max_steps: int = 100_000,
) -> FamilyFlow:
    """The identity family's exact reduced flow (module docstring): its endpoint, escape time
    and, with `ts` (increasing times ≥ 0), its trajectory λ_A, λ_B, λ_C(t).

    `rtol` bounds the local error of every ln λ_k (a relative error of λ_k) and of t, and the
    change still ahead of ln λ_k when the flow stops. The same configuration as
    `family_limit(depth, n, s, alpha, m, w)`, whose implicit equations its endpoint solves.
    """
    import jax.numpy as jnp

    if not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth L must be an integer >= 1, got {depth!r}")
    alpha, m, w = (float(x) for x in _validate(max(depth, 2), n, s, alpha, m, w))
    c_a, c_b = (float(c) for c in family_constants(n, s, m))
    u0 = np.log([alpha * c_a, alpha * c_b])
    r0 = float(_residual(depth, n, s, w, jnp.asarray(u0)))
    log_c = lambda t: float(log_lambda_c_at(depth, n, s, alpha, m, t)) if s > 1 else -math.inf
    if r0 == 0.0:  # the initialisation fits the observations: it is its own endpoint
        u, t_end, t_half, converged, steps = u0, 0.0, 0.0, True, 0
    else:
        program = _endpoint_program(float(rtol), int(max_steps))
        scalars = (math.log(abs(r0)), math.copysign(1.0, r0), float(depth), float(n))
        out = program(jnp.asarray(u0), *(jnp.asarray(x) for x in scalars))
        u, t_end, t_half, converged, steps = (np.asarray(x) for x in out)
    traj = None
    if ts is not None:
        ts = np.asarray(ts, dtype=np.float64)
        if ts.ndim != 1 or np.any(ts < 0) or np.any(np.diff(ts) < 0):
            raise ValueError("ts must be a 1-D array of increasing times >= 0")
        program = _trajectory_program(float(rtol), int(max_steps))
        scalars = (float(depth), float(n), float(s), w)
        us, _ = program(jnp.asarray(u0), jnp.asarray(ts), *(jnp.asarray(x) for x in scalars))
        log_c_ts = [log_c(t) for t in ts]
        traj = np.column_stack([np.asarray(us), log_c_ts])
    return FamilyFlow(
        depth=depth,
        n=n,
        s=s,
        status="converged" if bool(converged) else "max_steps",
        t_end=float(t_end),
        escape_time=float(t_half),
        log_lambda=np.array([float(u[0]), float(u[1]), log_c(float(t_end))]),
        num_steps=int(steps),
        ts=ts,
        log_lambda_ts=traj,
    )
