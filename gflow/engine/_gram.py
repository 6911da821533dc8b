"""A Gauss–Newton preconditioner for the stiff tail's stage systems (docs/theory.md §5).

Each Rosenbrock stage solves (s·I + H) K = r, s = 1/(hγ), H = ∇²loss. Near the end of a flow
H = JᵀJ + (a term proportional to the residual), J the |Ω| × P Jacobian of the observed entries
of X. By Woodbury,

    (s·I + JᵀJ)⁻¹ = (I − Jᵀ (s·I + JJᵀ)⁻¹ J) / s,

an |Ω| × |Ω| system instead of a P × P one. JJᵀ is the per-observation NTK Gram, which for a
deep linear network is Σ_l (A_l A_lᵀ)[rows, rows] ∘ (B_lᵀ B_l)[cols, cols] (A_l = W_L⋯W_{l+1},
B_l = W_{l−1}⋯W_1): d × d layer products, no autodiff loop. J v and Jᵀu are a JVP and a VJP
of the product. Nothing P × P is formed: memory O(P + |Ω|²).

Conjugate gradients then run on the exact H with this preconditioner, so the residual term and
a stale linearisation point cost iterations, never accuracy. The preconditioner is built at a
point θ₀ (J₀ = J(θ₀)) and eigendecomposed once, JJᵀ = V diag(μ) Vᵀ, so that it serves every
step size: (s·I + J₀J₀ᵀ)⁻¹ = V diag(1/(s + μ)) Vᵀ. It is symmetric positive definite for every
s > 0 and every θ₀, and is rebuilt only when CG starts to need many iterations.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..model import Factorization, partial_products


class GaussNewtonState(eqx.Module):
    """The linearisation point (its layers), the observed entries (`rows`, `cols`, `weight`: 1
    observed, 0 padding up to the static size) and the eigenpairs of the Gram J₀J₀ᵀ."""

    layers: tuple
    rows: jax.Array
    cols: jax.Array
    weight: jax.Array
    layer_mask: jax.Array
    eigenvalues: jax.Array
    eigenvectors: jax.Array


def observed_entries(mask, size: int):
    """(rows, cols, weight) of the observed entries of a 0/1 mask, padded to `size` entries
    with weight 0 (a static size, so that masks with different counts share one program)."""
    flat = jnp.ravel(mask)
    (index,) = jnp.nonzero(flat, size=size, fill_value=0)
    weight = jnp.where(jnp.arange(size) < jnp.sum(flat != 0), flat[index], 0.0)
    index = index.astype(jnp.int32)
    return index // mask.shape[1], index % mask.shape[1], weight.astype(mask.dtype)


def _observed(layers, rows, cols, weight):
    return Factorization(layers).product()[rows, cols] * weight


def gram(layers, rows, cols, weight, layer_mask) -> jax.Array:
    """J Jᵀ over the (padded) observed entries, in closed form: O(L d³ + L |Ω|²)."""
    below, above = partial_products(list(layers))
    total = 0.0
    for i in range(len(layers)):
        left = (above[i] @ above[i].T)[rows][:, rows]
        right = (below[i].T @ below[i])[cols][:, cols]
        total = total + layer_mask[i] * left * right
    return total * weight[:, None] * weight[None, :]


def build(model: Factorization, mask, layer_mask, size: int) -> GaussNewtonState:
    """The preconditioner at `model` for a problem observed on `mask`."""
    rows, cols, weight = observed_entries(mask, size)
    if layer_mask is None:
        layer_mask = jnp.ones((model.depth,), model.layers[0].dtype)
    g = gram(model.layers, rows, cols, weight, layer_mask)
    mu, v = jnp.linalg.eigh(0.5 * (g + g.T))
    ok = jnp.all(jnp.isfinite(mu)) & jnp.all(jnp.isfinite(v))
    return GaussNewtonState(
        layers=tuple(model.layers),
        rows=rows,
        cols=cols,
        weight=weight,
        layer_mask=layer_mask,
        # A failed decomposition leaves the identity: CG then runs unpreconditioned.
        eigenvalues=jnp.where(ok, jnp.maximum(mu, 0.0), 0.0),
        eigenvectors=jnp.where(ok, v, 0.0),
    )


def empty(model: Factorization, size: int) -> GaussNewtonState:
    """A placeholder of the right shapes (the preconditioner before its first build)."""
    dtype = model.layers[0].dtype
    index = jnp.zeros((size,), jnp.int32)
    return GaussNewtonState(
        layers=tuple(model.layers),
        rows=index,
        cols=index,
        weight=jnp.zeros((size,), dtype),
        layer_mask=jnp.zeros((model.depth,), dtype),
        eigenvalues=jnp.zeros((size,), dtype),
        eigenvectors=jnp.zeros((size, size), dtype),
    )


def apply(state: GaussNewtonState, shift, r: Factorization) -> Factorization:
    """(s·I + J₀ᵀJ₀)⁻¹ r for a layer-shaped r."""
    mask = state.layer_mask
    observe = lambda layers: _observed(layers, state.rows, state.cols, state.weight)
    tangent = tuple(x * mask[i] for i, x in enumerate(r.layers))
    _, ju = jax.jvp(observe, (state.layers,), (tangent,))
    v = state.eigenvectors
    # ju @ v, not v.T @ ju: XLA on CPU copies the transposed matrix first (20× slower).
    coefficients = v @ ((ju @ v) / (shift + state.eigenvalues))
    _, pullback = jax.vjp(observe, state.layers)
    (jtc,) = pullback(coefficients)
    return Factorization(
        tuple((x - mask[i] * y) / shift for i, (x, y) in enumerate(zip(r.layers, jtc, strict=True)))
    )


class GaussNewtonPreconditioner(eqx.Module):
    """The Gauss–Newton preconditioner as `Rodas4` uses it, on a flow's state
    `{"model": Factorization, ...}` with `FieldArgs`: `size` is the static number of observed
    entries it holds (at least the mask's count; the rest is padding)."""

    size: int = eqx.field(static=True)

    @property
    def refresh_budget(self) -> int:
        """Excess CG iterations that justify a rebuild. Measured on CPU, an eigendecomposition
        of the Gram costs as much as 130 (|Ω| = 704) to 660 (|Ω| = 2945) extra iterations,
        about |Ω|/5: a rebuild is then never more than twice the cheaper of the two."""
        return max(self.size // 5, 32)

    def init(self, y, args) -> GaussNewtonState:
        return empty(y["model"], self.size)

    def build(self, y, args) -> GaussNewtonState:
        return build(y["model"], args.problem.mask, args.layer_mask, self.size)

    def apply(self, state: GaussNewtonState, shift, r: dict) -> dict:
        return {k: apply(state, shift, v) if k == "model" else v / shift for k, v in r.items()}
