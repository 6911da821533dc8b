"""The deep matrix factorization X = W_L ⋯ W_1."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._problem import Problem


class Factorization(eqx.Module):
    """An L-layer linear network X = W_L ⋯ W_1.

    `layers[0]` is W_1 (shape `(d_1, d_0)`) and `layers[-1]` is W_L (shape `(d_L, d_{L-1})`),
    so X has shape `(d_L, d_0)`. The widths d_0 … d_L are fixed by the layer shapes; the depth
    is the number of layers (static: it changes the pytree). Leading axes, if any, are batch
    axes (see `gflow.stack`).
    """

    layers: tuple[Float[Array, ...], ...]

    def __init__(self, layers):
        layers = tuple(jnp.asarray(w) for w in layers)
        if len(layers) < 1:
            raise ValueError("a factorization needs at least one layer (depth L >= 1)")
        for i, w in enumerate(layers):
            if w.ndim < 2:
                raise ValueError(f"layer {i + 1} must be a matrix, got shape {w.shape}")
        for i in range(1, len(layers)):
            if layers[i].shape[-1] != layers[i - 1].shape[-2]:
                raise ValueError(
                    f"layer widths do not chain: W_{i + 1} has shape {layers[i].shape} but "
                    f"W_{i} has shape {layers[i - 1].shape}"
                )
        self.layers = layers

    @property
    def depth(self) -> int:
        return len(self.layers)

    @property
    def widths(self) -> tuple[int, ...]:
        return (self.layers[0].shape[-1],) + tuple(w.shape[-2] for w in self.layers)

    def product(self) -> Float[Array, "d_out d_in"]:
        """The end-to-end matrix W_L ⋯ W_1."""
        return functools.reduce(lambda x, w: w @ x, self.layers[1:], self.layers[0])

    def loss(self, problem: Problem) -> Float[Array, ""]:
        """½ Σ_Ω (X − X*)²."""
        return problem.loss(self.product())

    def gradient(self, problem: Problem) -> Factorization:
        """∇_{W_l} loss for every layer, as a Factorization-shaped pytree."""
        return jax.grad(lambda f: f.loss(problem))(self)

    def check_problem(self, problem: Problem) -> None:
        if (self.widths[-1], self.widths[0]) != problem.shape:
            raise ValueError(
                f"model maps {self.widths[0]} -> {self.widths[-1]} (X has shape "
                f"{(self.widths[-1], self.widths[0])}) but the problem is {problem.shape}"
            )


def loss_and_gradient(model: Factorization, problem: Problem):
    return jax.value_and_grad(lambda f: f.loss(problem))(model)


def tree_dot(a, b) -> Float[Array, ""]:
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: jnp.sum(x * y), a, b))
    return sum(leaves)
