"""The deep matrix factorization X = W_L ⋯ W_1."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .problem import Problem


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


def partial_products(layers) -> tuple[list, list]:
    """(B, A) with B[l] = W_{l−1}⋯W_1 and A[l] = W_L⋯W_{l+1} (empty products are identities),
    so that X = A[l] W_l B[l]; NumPy layers give NumPy products."""
    module = np if all(isinstance(w, np.ndarray) for w in layers) else jnp
    below = [module.eye(layers[0].shape[1], dtype=layers[0].dtype)]
    for w in layers[:-1]:
        below.append(w @ below[-1])
    above = [module.eye(layers[-1].shape[0], dtype=layers[0].dtype)]
    for w in reversed(layers[1:]):
        above.insert(0, above[0] @ w)
    return below, above


def loss_and_gradient(model: Factorization, problem: Problem):
    return jax.value_and_grad(lambda f: f.loss(problem))(model)


def loss_hessian(model: Factorization, problem: Problem) -> Float[Array, "P P"]:
    """The exact Hessian ∇²loss(θ), θ the layers flattened in order (each row-major, as
    `jax.flatten_util.ravel_pytree` orders them), in closed form: cheaper than P
    Hessian-vector products. With S_l = W_L⋯W_{l+1}, P_l = W_{l-1}⋯W_1, R = M∘(X − X*):

    - Gauss–Newton blocks: ∂X_ij/∂(W_l)_ab = (S_l)_ia (P_l)_bj, weighted by the mask;
    - residual blocks (k > l): ⟨R, S_k dW_k (W_{k-1}⋯W_{l+1}) dW_l P_l⟩, i.e.
      (S_kᵀ R P_lᵀ)_ae (W_{k-1}⋯W_{l+1})_bc for the entries (W_k)_ab, (W_l)_ce.
    """
    ws = model.layers
    depth = len(ws)
    mask = problem.mask.astype(ws[0].dtype)
    residual = problem.residual(model.product())
    prefix, suffix = partial_products(ws)
    blocks = [[None] * depth for _ in range(depth)]
    for k in range(depth):
        between = jnp.eye(ws[k].shape[1], dtype=ws[0].dtype)  # W_{k-1}⋯W_{j+1}, for j = k−1
        for j in range(k, -1, -1):  # block (k, j): rows W_k, columns W_j
            if j < k - 1:
                between = between @ ws[j + 1]
            # Σ_i (S_k)_ia (S_j)_ic Σ_n M_in (P_k)_bn (P_j)_en, as one matrix product over i.
            pp = (mask[:, None, :] * prefix[k][None]) @ prefix[j].T
            ss = suffix[k][:, :, None] * suffix[j][:, None, :]
            shape = (ss.shape[1], ss.shape[2], pp.shape[1], pp.shape[2])
            gn = ss.reshape(ss.shape[0], -1).T @ pp.reshape(pp.shape[0], -1)
            block = gn.reshape(shape).transpose(0, 2, 1, 3)
            if j < k:
                g = suffix[k].T @ residual @ prefix[j].T
                block = block + jnp.einsum("ae,bc->abce", g, between)
            block = block.reshape(ws[k].size, ws[j].size)
            blocks[k][j] = block
            blocks[j][k] = block.T
    return jnp.block(blocks)


def tree_dot(a, b) -> Float[Array, ""]:
    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, y: jnp.sum(x * y), a, b))
    return sum(leaves)
