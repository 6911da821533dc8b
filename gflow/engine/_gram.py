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
point θ₀ (J₀ = J(θ₀)) and factorised once, in one of two ways:

- `inverse` (default): M₀ = (s₀I + J₀J₀ᵀ)⁻¹ formed explicitly at the shift s₀ of the step that
  builds it, and M⁻¹ = (I − J₀ᵀM₀J₀)/s for the current shift s. Exact at s = s₀; for s ≠ s₀
  its eigenvalues on range(J₀ᵀ) are s₀/(s(s₀ + μ)) against 1/(s + μ), off by at most a factor
  max(s/s₀, s₀/s), which costs CG iterations as the step size drifts. Forming it takes under
  half an eigendecomposition's time (|Ω| = 2,945 on 2 CPU cores, 2026-12-05: 0.82 s against
  1.8–2.1 s), and applying it one matrix-vector product (a triangular solve per application,
  as a Cholesky factor would need, is 20× slower on CPU).
- `eigh`: JJᵀ = V diag(μ) Vᵀ, which serves every step size exactly:
  (s·I + J₀J₀ᵀ)⁻¹ = V diag(1/(s + μ)) Vᵀ, at two matrix-vector products an application. On
  the `scale` problem at d = 100 that exactness saves a tenth of the CG iterations (most come
  from the residual term and the layers moving since the build): 1.35× slower in all.

Both are symmetric positive definite for every s > 0 and every θ₀, and are rebuilt only when CG
starts to need more iterations than a rebuild costs.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..model import Factorization, partial_products

FACTORIZATIONS = ("inverse", "eigh")


class GaussNewtonState(eqx.Module):
    """The linearisation point (its layers), the observed entries (`rows`, `cols`, `weight`: 1
    observed, 0 padding up to the static size) and the factorised Gram: with `eigh`, its
    eigenvalues (`values`) and eigenvectors (`matrix`); with `inverse`, (s₀I + J₀J₀ᵀ)⁻¹
    (`matrix`) and s₀ (`values[0]`)."""

    layers: tuple
    rows: jax.Array
    cols: jax.Array
    weight: jax.Array
    layer_mask: jax.Array
    values: jax.Array
    matrix: jax.Array
    factorization: str = eqx.field(static=True, default="inverse")


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


def build(
    model: Factorization, mask, layer_mask, size: int, shift, factorization: str = "inverse"
) -> GaussNewtonState:
    """The preconditioner at `model` for a problem observed on `mask` (and, for `inverse`,
    at `shift`)."""
    rows, cols, weight = observed_entries(mask, size)
    if layer_mask is None:
        layer_mask = jnp.ones((model.depth,), model.layers[0].dtype)
    g = gram(model.layers, rows, cols, weight, layer_mask)
    g = 0.5 * (g + g.T)
    if factorization == "eigh":
        values, matrix = jnp.linalg.eigh(g)
        values = jnp.maximum(values, 0.0)
    else:
        matrix = jnp.linalg.inv(g + shift * jnp.eye(size, dtype=g.dtype))
        matrix = 0.5 * (matrix + matrix.T)  # symmetric to rounding: CG needs an SPD map
        values = jnp.full((1,), shift, g.dtype)
    ok = jnp.all(jnp.isfinite(values)) & jnp.all(jnp.isfinite(matrix))
    return GaussNewtonState(
        layers=tuple(model.layers),
        rows=rows,
        cols=cols,
        weight=weight,
        layer_mask=layer_mask,
        # A failed factorisation leaves the identity: CG then runs unpreconditioned.
        values=jnp.where(ok, values, 0.0 if factorization == "eigh" else 1.0),
        matrix=jnp.where(ok, matrix, 0.0),
        factorization=factorization,
    )


def empty(model: Factorization, size: int, factorization: str = "inverse") -> GaussNewtonState:
    """A placeholder of the right shapes (the preconditioner before its first build)."""
    dtype = model.layers[0].dtype
    index = jnp.zeros((size,), jnp.int32)
    return GaussNewtonState(
        layers=tuple(model.layers),
        rows=index,
        cols=index,
        weight=jnp.zeros((size,), dtype),
        layer_mask=jnp.zeros((model.depth,), dtype),
        values=jnp.zeros((size if factorization == "eigh" else 1,), dtype),
        matrix=jnp.zeros((size, size), dtype),
        factorization=factorization,
    )


def apply(state: GaussNewtonState, shift, r: Factorization) -> Factorization:
    """(s·I + J₀ᵀJ₀)⁻¹ r for a layer-shaped r (approximately for `inverse` at s ≠ s₀)."""
    mask = state.layer_mask
    observe = lambda layers: _observed(layers, state.rows, state.cols, state.weight)
    tangent = tuple(x * mask[i] for i, x in enumerate(r.layers))
    _, ju = jax.jvp(observe, (state.layers,), (tangent,))
    # ju @ v, not v.T @ ju: XLA on CPU copies the transposed matrix first (20× slower).
    if state.factorization == "eigh":
        v = state.matrix
        coefficients = v @ ((ju @ v) / (shift + state.values))
    else:
        # m @ ju (m is exactly symmetric): on CPU XLA's product this way round took 1.1×
        # (|Ω| = 2,945) to 1.4× (4,000–12,000) less time than ju @ m alone; whole solves 1.11×
        # faster at d = 100, 1.01× at d = 200 (benchmarks/README)
        coefficients = state.matrix @ ju
    _, pullback = jax.vjp(observe, state.layers)
    (jtc,) = pullback(coefficients)
    return Factorization(
        tuple((x - mask[i] * y) / shift for i, (x, y) in enumerate(zip(r.layers, jtc, strict=True)))
    )


class GaussNewtonPreconditioner(eqx.Module):
    """The Gauss–Newton preconditioner as `Rodas4` uses it, on a flow's state
    `{"model": Factorization, ...}` with `FieldArgs`: `size` is the static number of observed
    entries it holds (at least the mask's count; the rest is padding); `factorization`
    `inverse` or `eigh` (module docstring)."""

    size: int = eqx.field(static=True)
    factorization: str = eqx.field(static=True, default="inverse")

    @property
    def refresh_budget(self) -> int:
        """Excess CG iterations that justify a rebuild: about what a rebuild costs, so that
        staleness never costs more than twice the best schedule. Measured on 2 CPU cores at
        |Ω| = 2,945 (d = 100): the explicit inverse takes 0.93 s, a CG iteration (Hessian-vector
        product and preconditioner) 2.7 ms, i.e. ~|Ω|/8; an eigendecomposition 2.4 s, but its
        preconditioner is exact at every shift and goes stale more slowly. At |Ω| = 704
        (d = 50) budgets |Ω|/25…|Ω|/3 gave the same solve time to noise."""
        if self.factorization == "eigh":
            return max(self.size // 5, 32)
        return max(self.size // 8, 16)

    def init(self, y, args) -> GaussNewtonState:
        return empty(y["model"], self.size, self.factorization)

    def build(self, y, args, shift) -> GaussNewtonState:
        mask, layer_mask = args.problem.mask, args.layer_mask
        return build(y["model"], mask, layer_mask, self.size, shift, self.factorization)

    def apply(self, state: GaussNewtonState, shift, r: dict) -> dict:
        return {k: apply(state, shift, v) if k == "model" else v / shift for k, v in r.items()}
