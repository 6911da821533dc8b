"""The stopping rule and the divergence test (docs/theory.md §5).

Near a minimum the flow converges like a linear system, and the distance still to travel is
‖θ(∞) − θ(t)‖ ≈ 2·loss/‖∇loss‖ (exact for a quadratic with one rate; as the slowest mode comes
to dominate the loss it becomes exact for that mode). The flow stops when the remaining
displacement δ = (2·loss/‖∇loss‖²)·∇loss is within the integration tolerance,
RMS(δ_i / (atol + rtol·|θ_i|)) ≤ 1, the same norm diffrax's step controller uses. The loss left
at that point is ≈ ½λ(rtol·|θ|)²: relative to the initial loss, about rtol². Being relative to
∇loss it is scale-free: on the plateau of a small init, loss is O(1) while ‖∇loss‖ ~ α^{L−1},
so the estimate is huge and the rule cannot fire at t = 0; at a minimum it goes to zero like
e^{−κt}, so it always fires. An exact stationary point (∇loss = 0) counts as converged.

The rounding floor (stiff tail only, opt-in: `FlowOptions.rounding_floor`): where the
gradient, evaluated a second time with the product associated the other way, disagrees with
itself by more than 1/`ROUNDING_RATIO` of its size while the loss is still above rtol × its
initial value, the tail stops with status `rounding_floor`: not an endpoint. The test is on the
whole gradient, whose rounding sits mostly in converged directions; it does not show that the
way out of the plateau is rounding (docs/theory.md §5).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model import Factorization, loss_and_gradient
from ..problem import Problem
from ._dynamics import flatten, masked_loss_and_gradient, rms

ROUNDING_RATIO = 2.0
"""‖∇loss‖ / ‖∇loss − ∇̃loss‖ at or below which a gradient counts as rounding."""


def default_atol(model: Factorization, rtol, layer_mask=None):
    """`1e-2·rtol·RMS(θ(0))`: relative to the scale of the initialisation (`1e-2·rtol` for an
    all-zero one)."""
    atol = 1e-2 * rtol * rms(flatten(model), model, layer_mask)
    return jnp.where(atol > 0, atol, 1e-2 * rtol)


def remaining_distance_ratio(
    model: Factorization, problem: Problem, rtol, atol, layer_mask=None
) -> jax.Array:
    """RMS of the estimated remaining displacement in units of the tolerance (≤ 1: converged).

    δ = (2·loss/‖∇loss‖²)·∇loss. With a layer mask the RMS runs over trainable parameters
    only."""
    loss, g = masked_loss_and_gradient(model, problem, layer_mask)
    return convergence(loss, g, model, rtol, atol, layer_mask, jnp.inf)[0]


def convergence(loss, g, model, rtol, atol, layer_mask, bound):
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


def is_diverged(model, problem, bound):
    """Non-finite or huge parameters, or a loss or gradient beyond float range."""
    loss, g = loss_and_gradient(model, problem)
    return convergence(loss, g, model, 1.0, 1.0, None, bound)[1]


def rounding_ratio(g, model: Factorization, problem: Problem, layer_mask=None) -> jax.Array:
    """‖∇loss‖ / ‖∇loss − ∇̃loss‖: ∇̃loss is the same gradient with the product associated the
    other way, (W_L W_{L−1})⋯W_1 against W_L(⋯(W_2 W_1)), so the difference is rounding alone
    (the ratio is inf where the two agree exactly, e.g. at depth 1). Near 1 the gradient is
    rounding; trainable layers only under a layer mask."""

    def loss(layers):
        x = functools.reduce(lambda x, w: x @ w, reversed(layers[:-1]), layers[-1])
        return problem.loss(x)

    other = jax.grad(loss)(tuple(model.layers))
    weights = [1.0] * model.depth if layer_mask is None else list(layer_mask)
    size = sum(w * jnp.sum(a**2) for w, a in zip(weights, g.layers, strict=True))
    apart = sum(w * jnp.sum((a - b) ** 2) for w, a, b in zip(weights, g.layers, other, strict=True))
    return jnp.where(apart > 0, jnp.sqrt(size / jnp.where(apart > 0, apart, 1.0)), jnp.inf)
