"""The vector fields of the two clocks (docs/theory.md §5), for a model whose first `depth`
layers train and whose others, identity padding, stay frozen (`layer_mask`)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..model import Factorization, loss_hessian, tree_dot
from ._compensated import compensated_loss_and_gradient


def flatten(tree):
    return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(tree)])


def split_passive(y, passive: tuple[str, ...]):
    """(active, passive) parts of a stiff solver's state: the top-level entries named in
    `passive` (an energy integral, whose rates depend on the model only) apart; passive is {}
    when there are none."""
    if not (passive and isinstance(y, dict)):
        return y, {}
    return (
        {k: v for k, v in y.items() if k not in passive},
        {k: v for k, v in y.items() if k in passive},
    )


def loss_time_scale(loss, grad_sq):
    """h = 2·loss/‖∇loss‖²: dt/dτ of the loss clock; 0 at an exact stationary point."""
    safe = jnp.where(grad_sq > 0, grad_sq, 1.0)
    return jnp.where(grad_sq > 0, 2.0 * loss / safe, 0.0)


def masked_loss_and_gradient(model, problem, layer_mask, compensated="never"):
    """loss and ∇loss; with a layer mask (depth padding), frozen layers get zero gradient.
    `compensated`: where the products are taken in double-double arithmetic (`_compensated`:
    `never`, `auto` or `always`)."""
    loss, g = compensated_loss_and_gradient(model, problem, compensated, layer_mask)
    if layer_mask is not None:
        g = Factorization([w * layer_mask[i] for i, w in enumerate(g.layers)])
    return loss, g


def entry_weights(model, layer_mask):
    """1 for every trainable parameter, 0 for a frozen (padding) one, flattened like θ."""
    return jnp.concatenate(
        [jnp.full(w.size, layer_mask[i], w.dtype) for i, w in enumerate(model.layers)]
    )


def rms(x, model, layer_mask):
    """RMS of a θ-shaped flat vector, over trainable parameters only when a mask is given."""
    if layer_mask is None:
        return jnp.sqrt(jnp.mean(x**2))
    weights = entry_weights(model, layer_mask)
    return jnp.sqrt(jnp.sum(weights * x**2) / jnp.sum(weights))


def physical_rates(y, problem, layer_mask, compensated="never"):
    """dy/dt in physical time, with the loss and gradient it came from."""
    loss, g = masked_loss_and_gradient(y["model"], problem, layer_mask, compensated)
    dy = {"model": jax.tree_util.tree_map(jnp.negative, g)}
    if "energy" in y:
        dy["energy"] = tree_dot(g, g)
    return dy, loss, g


def loss_clock_rates(y, problem, layer_mask):
    """dy/dτ on the loss clock (t is a state), with the loss and gradient it came from."""
    loss, g = masked_loss_and_gradient(y["model"], problem, layer_mask)
    h = loss_time_scale(loss, tree_dot(g, g))
    dy = {"model": jax.tree_util.tree_map(lambda x: -h * x, g), "t": h}
    if "energy" in y:
        dy["energy"] = 2.0 * loss * (h > 0)
    return dy, loss, g


class FieldArgs(eqx.Module):
    """What a diffrax vector field needs besides (t, y): the problem, the absolute time at the
    phase's local t = 0, whether t is a state (loss clock), the layer mask, and where the
    gradient is compensated (`masked_loss_and_gradient`; the stiff tail's)."""

    problem: object
    t_offset: jax.Array | float
    loss_clock: bool = eqx.field(static=True)
    layer_mask: jax.Array | None
    compensated: str = eqx.field(static=True, default="never")


def physical_field(t, y, args: FieldArgs):
    return physical_rates(y, args.problem, args.layer_mask, args.compensated)[0]


def loss_clock_field(tau, y, args: FieldArgs):
    return loss_clock_rates(y, args.problem, args.layer_mask)[0]


def physical_jacobian(t, y, args: FieldArgs):
    """−∇²loss of `physical_field`, closed form. With a layer mask the frozen rows and columns
    are zero: exact for the stage systems, whose frozen components are always zero."""
    hessian = loss_hessian(y["model"], args.problem)
    if args.layer_mask is not None:
        weights = entry_weights(y["model"], args.layer_mask)
        hessian = weights[:, None] * hessian * weights[None, :]
    return -hessian


class MaskedRMS(eqx.Module):
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
