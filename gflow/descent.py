"""Discrete optimizers (optax) on the same model and problem, with the flow's stopping rule,
status codes and result type, so that every analysis works on both.

Iterate k sits at time t = k·lr, the time at which gradient descent is compared with the flow.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .engine._compile import program
from .engine._result import FlowResult, Status, Trajectory, select_status
from .engine._stopping import convergence, default_atol
from .model import Factorization, loss_and_gradient, tree_dot
from .problem import Problem

OPTIMIZERS = {
    "sgd": lambda lr: optax.sgd(lr),
    "momentum": lambda lr: optax.sgd(lr, momentum=0.9),
    "nesterov": lambda lr: optax.sgd(lr, momentum=0.9, nesterov=True),
    "adam": lambda lr: optax.adam(lr),
    "rmsprop": lambda lr: optax.rmsprop(lr),
    "adagrad": lambda lr: optax.adagrad(lr),
}


@dataclass(frozen=True)
class DescentOptions:
    """How to run a discrete optimizer.

    - `optimizer`: a preset name (`sgd`, `momentum`, `nesterov`, `adam`, `rmsprop`, `adagrad`)
      or any `optax.GradientTransformation` (then `lr` only sets the time axis t = k·lr).
    - `lr`: the learning rate (> 0).
    - `max_steps`: the step budget; `t_max`: stop at k·lr ≥ t_max.
    - `rtol`, `atol`: the stopping rule of `flow` (remaining displacement within tolerance).
    - `save_every`: record loss and singular values every this many steps (0: never);
      `save_layers` keeps the layers too; at most `max_saves` records.
    - `stop_loss`: stop early, with status `loss_reached`, at the first iterate whose loss is
      at most this fraction of the initial loss (`None`: no early stop).
    """

    optimizer: str | optax.GradientTransformation = "sgd"
    lr: float = 1e-2
    max_steps: int = 1_000_000
    t_max: float = math.inf
    rtol: float = 1e-10
    atol: float | None = None
    save_every: int = 0
    save_layers: bool = False
    max_saves: int = 256
    divergence_bound: float = 1e100
    stop_loss: float | None = None

    def __post_init__(self):
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose from {sorted(OPTIMIZERS)}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be finite and > 0, got {self.lr}")
        if not (isinstance(self.max_steps, int) and self.max_steps >= 1):
            raise ValueError(f"max_steps must be a positive integer, got {self.max_steps!r}")
        if not (0 < self.rtol < 1):
            raise ValueError(f"rtol must lie in (0, 1), got {self.rtol}")
        if not (isinstance(self.save_every, int) and self.save_every >= 0):
            raise ValueError("save_every must be a non-negative integer")
        if self.stop_loss is not None and not (0 < self.stop_loss < 1):
            raise ValueError(f"stop_loss must lie in (0, 1), got {self.stop_loss}")

    def transformation(self, lr=None) -> optax.GradientTransformation:
        """The optax transformation; `lr` (possibly traced) overrides `self.lr`."""
        if isinstance(self.optimizer, str):
            return OPTIMIZERS[self.optimizer](self.lr if lr is None else lr)
        return self.optimizer


# One function on purpose (~100 lines): the state of the while loop, its body and its saving
# buffers are one program; the flow's stopping rule and statuses come from the engine.
def descend_solve(
    problem: Problem, model: Factorization, options: DescentOptions, lr=None
) -> FlowResult:
    """The descent engine: one `lax.while_loop`, jittable and vmappable. `lr` may be a traced
    scalar (one compiled program serves every learning rate); default `options.lr`."""
    lr = options.lr if lr is None else lr
    opt = options.transformation(lr)
    dtype = model.layers[0].dtype
    rtol = options.rtol
    atol = options.atol if options.atol is not None else default_atol(model, rtol)
    if math.isinf(options.t_max):
        steps_for_t_max = options.max_steps
    else:
        steps_for_t_max = jnp.minimum(options.max_steps, jnp.ceil(options.t_max / lr - 1e-9))
    loss0 = problem.loss(model.product())
    num_sv = min(problem.shape)
    saving = options.save_every > 0
    n_save = min(options.max_saves, options.max_steps // max(options.save_every, 1) + 1)

    def record(buffers, k, params, loss):
        slot = k // options.save_every
        write = (k % options.save_every == 0) & (slot < n_save)
        slot = jnp.minimum(slot, n_save - 1)
        new = {
            "t": k * lr,
            "loss": loss,
            "sv": jnp.linalg.svd(params.product(), compute_uv=False)[:num_sv],
        }
        if options.save_layers:
            new["layers"] = params
        return jax.tree_util.tree_map(
            lambda buf, v: buf.at[slot].set(jnp.where(write, v, buf[slot])), buffers, new
        )

    def early_stop(loss):
        return False if options.stop_loss is None else loss <= options.stop_loss * loss0

    def cond(state):
        return state["status"] < 0

    def body(state):
        params, k = state["params"], state["k"]
        loss, g = loss_and_gradient(params, problem)  # the step's one gradient
        ratio, diverged = convergence(loss, g, params, rtol, atol, None, options.divergence_bound)
        out_of_time = k >= steps_for_t_max
        status = select_status(
            [
                (diverged, Status.DIVERGED),
                (early_stop(loss), Status.LOSS_REACHED),
                (ratio <= 1.0, Status.CONVERGED),
                (out_of_time & (k >= options.max_steps), Status.MAX_STEPS),
                (out_of_time, Status.T_MAX),
            ],
            otherwise=-1,
        )
        if saving:
            state["saves"] = record(state["saves"], k, params, loss)
        updates, opt_state = opt.update(g, state["opt_state"], params)
        stop = status >= 0
        new_params = jax.tree_util.tree_map(lambda p, u: jnp.where(stop, p, p + u), params, updates)
        return {
            **state,
            "params": new_params,
            "opt_state": opt_state,
            "k": jnp.where(stop, k, k + 1),
            "status": status,
            "loss": loss,
            "energy": state["energy"] + jnp.where(stop, 0.0, lr * tree_dot(g, g)),
        }

    state = {
        "params": model,
        "opt_state": opt.init(model),
        "k": jnp.zeros((), jnp.int64 if dtype == jnp.float64 else jnp.int32),
        "status": jnp.asarray(-1, jnp.int32),
        "loss": loss0,
        "energy": jnp.zeros((), dtype),
    }
    if saving:
        template = {
            "t": jnp.full((n_save,), jnp.inf, dtype),
            "loss": jnp.full((n_save,), jnp.inf, dtype),
            "sv": jnp.full((n_save, num_sv), jnp.inf, dtype),
        }
        if options.save_layers:
            template["layers"] = jax.tree_util.tree_map(
                lambda w: jnp.full((n_save,) + w.shape, jnp.inf, w.dtype), model
            )
        state["saves"] = template
    final = jax.lax.while_loop(cond, body, state)
    trajectory = None
    if saving:
        s = final["saves"]
        trajectory = Trajectory(s["t"], s["loss"], s["sv"], s.get("layers"))
    k = final["k"]
    return FlowResult(
        model=final["params"],
        status=final["status"],
        t_end=k * lr,
        loss=final["loss"],
        loss_init=loss0,
        num_steps=k,
        num_accepted_steps=k,
        num_rejected_steps=jnp.zeros_like(k),
        num_rhs_evals=k + 1,
        num_linear_iters=jnp.zeros((), jnp.int32),
        energy=final["energy"],
        trajectory=trajectory,
    )


def descend(
    problem: Problem,
    model: Factorization,
    options: DescentOptions | None = None,
    **kwargs,
) -> FlowResult:
    """Run an optax optimizer on `model` for `problem`, the whole loop compiled.

    Takes `DescentOptions` or its fields as keywords (`descend(p, m, optimizer="adam",
    lr=1e-3)`). Returns a `FlowResult` (t = steps × lr, `energy` = Σ lr·‖∇loss‖², which for
    gradient descent equals loss(0) − loss only up to O(lr²) per step). A diverging learning
    rate gives `Status.DIVERGED`, not an exception.
    """
    if options is None:
        options = DescentOptions(**kwargs)
    elif kwargs:
        raise TypeError("pass either `options` or keyword options, not both")
    model.check_problem(problem)
    import dataclasses

    # The learning rate is an argument of the compiled program, not part of its identity.
    lr = jnp.asarray(options.lr, model.layers[0].dtype)
    compiled, compile_time = program(
        "descend",
        dataclasses.replace(options, lr=1.0),
        (problem, model, lr),
        lambda: lambda p, m, lr: descend_solve(p, m, options, lr),
        out_like=_result_like(model, options),
        remember=isinstance(options.optimizer, str),  # an optax object has no stable identity
    )
    start = time.perf_counter()
    result = compiled(problem, model, jnp.asarray(options.lr, model.layers[0].dtype))
    jax.block_until_ready(result)
    return result.timed(time.perf_counter() - start, compile_time.seconds, compile_time.cache_hit)


def _result_like(model, options: DescentOptions) -> FlowResult:
    """The structure of the result a descent of `model` with `options` returns."""
    return FlowResult.skeleton(model, options.save_every > 0, options.save_layers)


def descend_batch(
    problem: Problem, model: Factorization, options: DescentOptions, lr=None
) -> FlowResult:
    """`descend` for a batch, in one compiled, vmapped program: `model` batched (leading axis
    on every layer, e.g. from `gflow.stack`), `problem` shared or batched, `lr` one learning
    rate per member (default `options.lr` for all). Each member has its own status; the batch
    runs until its last member stops."""
    import dataclasses

    if model.layers[0].ndim != 3:
        raise ValueError("descend_batch needs a batched model (layers of shape (batch, d, d))")
    size = model.layers[0].shape[0]
    dtype = model.layers[0].dtype
    lr = jnp.full((size,), options.lr, dtype) if lr is None else jnp.asarray(lr, dtype)
    if lr.shape != (size,) or not bool(jnp.all((lr > 0) & jnp.isfinite(lr))):
        raise ValueError(f"lr must hold {size} finite learning rates > 0, got shape {lr.shape}")
    in_axes = (0 if problem.target.ndim == 3 else None, 0, 0)
    compiled, compile_time = program(
        "descend-batch",
        dataclasses.replace(options, lr=1.0),
        (problem, model, lr),
        lambda: jax.vmap(lambda p, m, r: descend_solve(p, m, options, r), in_axes=in_axes),
        extra=(in_axes,),
        out_like=_result_like(model, options),
        remember=isinstance(options.optimizer, str),
    )
    start = time.perf_counter()
    result = jax.block_until_ready(compiled(problem, model, lr))
    return result.timed(time.perf_counter() - start, compile_time.seconds, compile_time.cache_hit)


def endpoint_distance(result: FlowResult, reference: FlowResult, problem: Problem, top=None):
    """How far an endpoint is from a reference endpoint (typically the flow's).

    Returns the max relative error of the top singular values (`top` of them, default all
    ≥ 1e-6·σ₁ of the reference), the stable-rank difference, and the max absolute difference on
    unobserved entries.
    """
    from .analysis._measures import singular_values, stable_rank_of

    s = singular_values(result.model)
    s_ref = singular_values(reference.model)
    if top is None:
        top = int(np.sum(s_ref >= 1e-6 * s_ref[0]))
    rel = np.abs(s[:top] / s_ref[:top] - 1)
    off = np.asarray(problem.mask) == 0
    x, x_ref = np.asarray(result.model.product()), np.asarray(reference.model.product())
    return {
        "singular_values": float(rel.max()),
        "stable_rank": abs(stable_rank_of(s) - stable_rank_of(s_ref)),
        "unobserved": float(np.max(np.abs(x - x_ref)[off])) if off.any() else 0.0,
    }


def loglog_slope(x, y) -> float:
    """Least-squares slope of log y against log x."""
    return float(np.polyfit(np.log(np.asarray(x, float)), np.log(np.asarray(y, float)), 1)[0])
