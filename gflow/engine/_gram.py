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

- `inverse`: M₀ = (s₀I + J₀J₀ᵀ)⁻¹ formed explicitly at the shift s₀ of the step that builds
  it, and M⁻¹ = (I − J₀ᵀM₀J₀)/s for the current shift s. Exact at s = s₀; for s ≠ s₀ its
  eigenvalues on range(J₀ᵀ) are s₀/(s(s₀ + μ)) against 1/(s + μ), off by at most a factor
  max(s/s₀, s₀/s), which costs CG iterations as the step size drifts. Formed from its
  Cholesky factor in blocks (`_spd_inverse`), it takes under a third of an
  eigendecomposition's time (|Ω| = 2,945 on 2 CPU cores, 2026-12-05: 0.55 s against
  1.8–2.1 s; `jnp.linalg.inv` 0.82 s), and applying it one matrix-vector product.
- `cholesky`: the same M₀, kept as the Cholesky factor L of s₀I + J₀J₀ᵀ. XLA's triangular
  solve of one vector is ~6× slower on CPU than a product with the inverse, so the factor is
  stored as panels for block triangular solves (`_block_cholesky`): together they hold as
  many entries as the inverse and an application is products with them, 1.0–1.3× the
  inverse's time at |Ω| = 12,000, while forming them takes ~3.5× less (12.6–13.7 s against
  45.5 s). `flow`'s default (`gauss_newton="auto"`) takes it from 4,096 observed entries.
- `eigh`: JJᵀ = V diag(μ) Vᵀ, which serves every step size exactly:
  (s·I + J₀J₀ᵀ)⁻¹ = V diag(1/(s + μ)) Vᵀ, at two matrix-vector products an application. On
  the `scale` problem at d = 100 that exactness saves a tenth of the CG iterations (most come
  from the residual term and the layers moving since the build): 1.35× slower in all.

- `tangent` (`flow`'s default from 1,024 observed entries where X's rank r keeps
  2·r·(d_out + d_in) ≤ |Ω|): the Gram approximated on the observed entries of X's rank-r
  tangent space, {U A + B Vᵀ} (U, V: X's top-r singular vectors at θ₀), never forming the
  |Ω|² Gram. Near the end of a flow toward a rank-r completion the Gram's spectrum is
  bimodal: exactly r(d_out + d_in − r) eigenvalues of the learned scale (0.28–113 at d = 50,
  0.5–224 at d = 100 on the `scale` problem, r = 5) and the rest of the init's scale
  (≤ 1.2e-2): those modes move through init-sized singular values of the layers. Z, the
  |Ω| × r(d_out + d_in) matrix of the observed entries of U·e_jᵀ and e_i·V[:, a]ᵀ, is
  applied as products with U and V, and ZᵀZ and ZᵀGZ come in closed form from d × d layer
  products (`_tangent_system`). The preconditioner is the exact Woodbury inverse of
  s·I + J₀ᵀ Z (ZᵀZ + δ/s)⁻¹ Zᵀ J₀, i.e. (I − J₀ᵀZ (s·ZᵀZ + ZᵀGZ + δ)⁻¹ ZᵀJ₀)/s: SPD for
  every θ₀, s and basis, exact on the tangent directions and treating the init-scale rest
  like the null space. The k × k system (k = r(d_out + d_in)) is kept as the inverse of its
  Cholesky factor, applied as L⁻ᵀ(L⁻¹·), a product BᵀB that stays symmetric to rounding.
  On 2 CPU cores (2026-12-06) a build takes 48 ms at d = 100 (k = 1,000) and 317 ms at
  d = 200 (k = 2,000), against 0.6 s and 11 s for the Gram's inverse or factor, and an
  application 0.75 ms and 4.0 ms against 2.3 ms and 38 ms: it is rebuilt ~2.5× as often
  and its CG needs fewer iterations (d = 100: 4,724 against 5,402; d = 200: 4,490 against
  5,548).

All four are symmetric positive definite for every s > 0 and every θ₀, and are rebuilt only
when CG starts to need more iterations than a rebuild costs.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ..model import Factorization, partial_products

FACTORIZATIONS = ("inverse", "eigh", "cholesky", "tangent")
# Rows of a diagonal block of the `cholesky` factorization's block triangular solves: large
# enough that each panel product runs near memory bandwidth, small enough that the blocks'
# inverses (|Ω| × BLOCK entries) stay a small part of what an application reads.
CHOLESKY_BLOCK = 1024
# Rows of a block of the `inverse` factorization's blocked L⁻ᵀL⁻¹ (`_spd_inverse`), used from
# three blocks on: below that `jnp.linalg.inv` is as fast (2 CPU cores, 2026-12-05: 1,536
# entries in two blocks 0.148 s against 0.147 s, in three 0.131 s).
INVERSE_BLOCK = 512


class GaussNewtonState(eqx.Module):
    """The linearisation point (its layers), the observed entries (`rows`, `cols`, `weight`: 1
    observed, 0 padding up to the static size) and the factorised Gram: with `eigh`, its
    eigenvalues (`values`) and eigenvectors (`matrix`); with `inverse`, (s₀I + J₀J₀ᵀ)⁻¹
    (`matrix`) and s₀ (`values[0]`); with `cholesky`, s₀ (`values[0]`), the inverses of the
    Cholesky factor's diagonal blocks (`matrix`, stacked) and its off-diagonal `panels`
    (`_block_cholesky`); with `tangent`, s₀ (`values[0]`), X's directions (U, V) as
    `panels` and the inverse Cholesky factor L⁻¹ of its tangent system (`matrix`)."""

    layers: tuple
    rows: jax.Array
    cols: jax.Array
    weight: jax.Array
    layer_mask: jax.Array
    values: jax.Array
    matrix: jax.Array
    panels: tuple = ()
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


def _blocks(size: int, rows: int | None = None) -> list[tuple[int, int]]:
    """(start, end) of the diagonal blocks of `rows` rows (the last one shorter); by default
    at most CHOLESKY_BLOCK rows each, as even as can be."""
    if rows is None:
        rows = -(-size // -(-size // CHOLESKY_BLOCK))
    edges = [min(i * rows, size) for i in range(-(-size // rows) + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def _spd_inverse(matrix):
    """The inverse of an SPD matrix as L⁻ᵀL⁻¹ from its Cholesky factor L, block by block
    (`INVERSE_BLOCK` rows): the blocks of L⁻¹ below the diagonal and of L⁻ᵀL⁻¹ above it are
    matrix products, ~n³ flops in all where `jnp.linalg.inv` (an LU factorisation and two
    triangular solves with n right-hand sides) takes ~2.7n³. On 2 CPU cores (2026-12-05):
    0.55 s against 0.82 s at 2,944 rows, 1.21 s against 2.08 s at 4,096. Exactly symmetric
    (the blocks below the diagonal are those above it, transposed, and the diagonal blocks
    are symmetrised); not finite where the matrix is not numerically positive definite."""
    blocks = _blocks(matrix.shape[0], INVERSE_BLOCK)
    count = len(blocks)
    if count < 3:
        inverse = jnp.linalg.inv(0.5 * (matrix + matrix.T))
        return 0.5 * (inverse + inverse.T)
    factor = jnp.linalg.cholesky(matrix, symmetrize_input=False)
    part = lambda x, i, j: x[blocks[i][0] : blocks[i][1], blocks[j][0] : blocks[j][1]]
    lower = {}  # the blocks of L⁻¹
    for j, (start, end) in enumerate(blocks):
        eye = jnp.eye(end - start, dtype=matrix.dtype)
        lower[j, j] = jax.scipy.linalg.solve_triangular(part(factor, j, j), eye, lower=True)
    for j in range(count):
        for i in range(j + 1, count):
            below = sum(part(factor, i, k) @ lower[k, j] for k in range(j, i))
            lower[i, j] = -lower[i, i] @ below
    upper = {
        (i, j): sum(lower[k, i].T @ lower[k, j] for k in range(j, count))
        for i in range(count)
        for j in range(i, count)
    }
    # A product BᵀB is symmetric only up to rounding, which depends on how XLA tiles it
    for i in range(count):
        upper[i, i] = 0.5 * (upper[i, i] + upper[i, i].T)
    return jnp.block(
        [[upper[i, j] if i <= j else upper[j, i].T for j in range(count)] for i in range(count)]
    )


def _block_cholesky(matrix):
    """M = L Lᵀ prepared for block triangular solves that read no more than M itself: the
    inverses D_i of L's diagonal blocks (stacked, the last padded with the identity), and for
    each block row i the panels D_i L[i, :i] and D_iᵀ L[i+1:, i]ᵀ. An application is then
    matrix-vector products on panels, which run near memory bandwidth on CPU, where XLA's
    triangular solve of one vector is ~6× slower than a product with the explicit inverse."""
    blocks = _blocks(matrix.shape[0])
    rows = blocks[0][1] - blocks[0][0]
    factor = jnp.linalg.cholesky(matrix, symmetrize_input=False)
    eye = jnp.eye(rows, dtype=matrix.dtype)
    diagonal = []
    for start, end in blocks:
        block = eye.at[: end - start, : end - start].set(factor[start:end, start:end])
        diagonal.append(jax.scipy.linalg.solve_triangular(block, eye, lower=True))
    inverses = jnp.stack(diagonal)
    forward = tuple(
        inverses[i, : end - start, : end - start] @ factor[start:end, :start]
        for i, (start, end) in enumerate(blocks)
        if i > 0
    )
    backward = tuple(
        inverses[i, : end - start, : end - start].T @ factor[end:, start:end].T
        for i, (start, end) in enumerate(blocks)
        if i < len(blocks) - 1
    )
    return inverses, (forward, backward)


def _block_cholesky_solve(inverses, panels, r):
    """M⁻¹ r = L⁻ᵀ L⁻¹ r from `_block_cholesky`: y_i = D_i r_i − (D_i L[i, :i]) y_:i, then
    x_i = D_iᵀ y_i − (D_iᵀ L[i+1:, i]ᵀ) x_i+1:."""
    forward, backward = panels
    count, rows = inverses.shape[:2]
    size = r.shape[0]
    split = lambda v: jnp.pad(v, (0, count * rows - size)).reshape(count, rows)
    ends = [end - start for start, end in _blocks(size, rows)]
    c = jnp.einsum("kij,kj->ki", inverses, split(r))
    y = c[0, : ends[0]]
    for i in range(1, count):
        y = jnp.concatenate([y, c[i, : ends[i]] - forward[i - 1] @ y])
    e = jnp.einsum("kji,kj->ki", inverses, split(y))
    x = e[-1, : ends[-1]]
    for i in reversed(range(count - 1)):
        x = jnp.concatenate([e[i, : ends[i]] - backward[i] @ x, x])
    return x


# Singular values of X below this fraction of the largest leave the `tangent` basis: they are
# the init's residue, not yet (or never) learned directions.
TANGENT_GAP = 1e-2
# Excess CG iterations that justify rebuilding the `tangent` preconditioner: a build over a CG
# iteration's cost, measured on 2 CPU cores (2026-12-06, rank 5): 48 ms against ~1.5 ms at
# d = 100 (|Ω| = 2,945, k = 1,000), 317 ms against ~7 ms at d = 200 (11,941, k = 2,000).
TANGENT_REFRESH_BUDGET = 48
# The tangent system's jitter, relative to its largest diagonal entry.
TANGENT_JITTER = 1e-12


def _tangent_directions(model: Factorization, rank: int):
    """X's top `rank` singular vectors (U: d_out × r, V: d_in × r), those with σ below
    TANGENT_GAP·σ₁ set to zero."""
    u, sigma, vt = jnp.linalg.svd(model.product(), full_matrices=False)
    keep = (sigma[:rank] > TANGENT_GAP * sigma[0]).astype(u.dtype)
    return u[:, :rank] * keep, vt[:rank].T * keep


def _tangent_system(layers, mask, layer_mask, u, v):
    """(ZᵀZ, ZᵀGZ) for Z the observed entries of X's tangent directions U·e_jᵀ (columns (a, j))
    and e_i·V[:, a]ᵀ (columns (a, i)), G = JJᵀ: in closed form from the layer products, never
    forming the |Ω|² Gram. Layout: [(a, j) for a < r, j < d_in] then [(a, i) for i < d_out]."""
    below, above = partial_products(list(layers))
    d_out, d_in = mask.shape
    r = u.shape[1]
    um = u.T[:, :, None] * mask[None]  # (a, i, j): U[i, a] m_ij
    vm = v.T[:, None, :] * mask[None]  # (a, i, j): V[j, a] m_ij
    c11 = jnp.einsum("aij,ib->ajb", um, u)  # δ_jj' Σ_i m_ij U_ia U_ib
    c22 = jnp.einsum("aij,jb->aib", vm, v)
    c12 = jnp.einsum("aij,jb->ajbi", um, v)  # m_ij U_ia V_jb
    k11 = k22 = k12 = 0.0
    for n in range(len(layers)):
        p = above[n] @ above[n].T  # d_out × d_out
        q = below[n].T @ below[n]  # d_in × d_in
        pu = jnp.einsum("ik,bkj->bij", p, um)
        qv = jnp.einsum("bij,jk->bik", vm, q)
        k11 = k11 + layer_mask[n] * jnp.einsum("aij,bik->ajbk", um, pu) * q[None, :, None, :]
        k22 = k22 + layer_mask[n] * jnp.einsum("aij,bkj->aibk", vm, qv) * p[None, :, None, :]
        k12 = k12 + layer_mask[n] * jnp.einsum("aij,bij->ajbi", pu, qv)
    eye_in = jnp.eye(d_in, dtype=u.dtype)
    eye_out = jnp.eye(d_out, dtype=u.dtype)
    c11 = jnp.einsum("ajb,jk->ajbk", c11, eye_in)
    c22 = jnp.einsum("aib,ik->aibk", c22, eye_out)
    n1, n2 = r * d_in, r * d_out

    def assemble(a11, a12, a22):
        a11, a12, a22 = a11.reshape(n1, n1), a12.reshape(n1, n2), a22.reshape(n2, n2)
        return jnp.block([[a11, a12], [a12.T, a22]])

    return assemble(c11, c12, c22), assemble(k11, k12, k22)


def build(
    model: Factorization,
    mask,
    layer_mask,
    size: int,
    shift,
    factorization: str = "inverse",
    rank: int = 0,
) -> GaussNewtonState:
    """The preconditioner at `model` for a problem observed on `mask` (and, but for `eigh`,
    at `shift`); `rank` is the `tangent` factorization's."""
    rows, cols, weight = observed_entries(mask, size)
    if layer_mask is None:
        layer_mask = jnp.ones((model.depth,), model.layers[0].dtype)
    panels = ()
    if factorization == "tangent":
        u, v = _tangent_directions(model, rank)
        c, k = _tangent_system(model.layers, mask, layer_mask, u, v)
        # ZᵀZ and ZᵀGZ share a null space (U C Vᵀ lies in both halves; unobserved rows or
        # columns; σ below the gap): a jitter δ keeps the system SPD at a condition ≲ 1/δ.
        # It only regularises ZᵀZ (by δ/s), so the preconditioner stays an exact Woodbury
        # inverse of s·I + J₀ᵀZ(ZᵀZ + δ/s)⁻¹ZᵀJ₀: SPD.
        system = shift * c + k
        eye = jnp.eye(c.shape[0], dtype=c.dtype)
        system = system + TANGENT_JITTER * jnp.max(jnp.diagonal(system)) * eye
        factor = jnp.linalg.cholesky(system, symmetrize_input=False)
        matrix = jax.scipy.linalg.solve_triangular(factor, eye, lower=True)  # L⁻¹
        values = jnp.full((1,), shift, c.dtype)
        panels = (u, v)
    elif factorization == "eigh":
        g = gram(model.layers, rows, cols, weight, layer_mask)
        values, matrix = jnp.linalg.eigh(g)  # symmetrises g; the Cholesky-based read one triangle
        values = jnp.maximum(values, 0.0)
    else:
        g = gram(model.layers, rows, cols, weight, layer_mask)
        shifted = g + shift * jnp.eye(size, dtype=g.dtype)
        values = jnp.full((1,), shift, g.dtype)
        if factorization == "cholesky":
            matrix, panels = _block_cholesky(shifted)
        else:
            matrix = _spd_inverse(shifted)  # exactly symmetric: CG needs an SPD map
    leaves = jax.tree_util.tree_leaves((values, matrix, panels))
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    return GaussNewtonState(
        layers=tuple(model.layers),
        rows=rows,
        cols=cols,
        weight=weight,
        layer_mask=layer_mask,
        # A failed factorisation leaves the identity: CG then runs unpreconditioned.
        values=jnp.where(ok, values, 0.0 if factorization == "eigh" else 1.0),
        matrix=jnp.where(ok, matrix, 0.0),
        panels=jax.tree_util.tree_map(lambda x: jnp.where(ok, x, 0.0), panels),
        factorization=factorization,
    )


def empty(
    model: Factorization, size: int, factorization: str = "inverse", rank: int = 0
) -> GaussNewtonState:
    """A placeholder of the right shapes (the preconditioner before its first build)."""
    dtype = model.layers[0].dtype
    index = jnp.zeros((size,), jnp.int32)
    matrix, panels = jax.ShapeDtypeStruct((size, size), dtype), ()
    if factorization == "cholesky":
        matrix, panels = jax.eval_shape(_block_cholesky, matrix)
    elif factorization == "tangent":
        d_out, d_in = model.widths[-1], model.widths[0]
        matrix = jax.ShapeDtypeStruct((rank * (d_in + d_out),) * 2, dtype)
        panels = (
            jax.ShapeDtypeStruct((d_out, rank), dtype),
            jax.ShapeDtypeStruct((d_in, rank), dtype),
        )
    matrix, panels = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), (matrix, panels))
    return GaussNewtonState(
        layers=tuple(model.layers),
        rows=index,
        cols=index,
        weight=jnp.zeros((size,), dtype),
        layer_mask=jnp.zeros((model.depth,), dtype),
        values=jnp.zeros((size if factorization == "eigh" else 1,), dtype),
        matrix=matrix,
        panels=panels,
        factorization=factorization,
    )


def _tangent_apply(state: GaussNewtonState, ju):
    """Z (s₀ZᵀZ + ZᵀGZ + δ)⁻¹ Zᵀ ju = Z L⁻ᵀ(L⁻¹ Zᵀ ju), with Zᵀ and Z as products with U and V
    (`_tangent_system`)."""
    u, v = state.panels
    d_out, d_in = u.shape[0], v.shape[0]
    r = u.shape[1]
    observed = jnp.zeros((d_out, d_in), ju.dtype).at[state.rows, state.cols].add(ju)
    z_ju = jnp.concatenate([(u.T @ observed).ravel(), (observed @ v).T.ravel()])
    c = (state.matrix @ z_ju) @ state.matrix
    c1, c2 = c[: r * d_in].reshape(r, d_in), c[r * d_in :].reshape(r, d_out)
    return (u @ c1 + c2.T @ v.T)[state.rows, state.cols] * state.weight


def apply(state: GaussNewtonState, shift, r: Factorization) -> Factorization:
    """(s·I + J₀ᵀJ₀)⁻¹ r for a layer-shaped r (approximately for `inverse` and
    `cholesky` at s ≠ s₀)."""
    mask = state.layer_mask
    observe = lambda layers: _observed(layers, state.rows, state.cols, state.weight)
    tangent = tuple(x * mask[i] for i, x in enumerate(r.layers))
    _, ju = jax.jvp(observe, (state.layers,), (tangent,))
    # ju @ v, not v.T @ ju: XLA on CPU copies the transposed matrix first (20× slower).
    if state.factorization == "eigh":
        v = state.matrix
        coefficients = v @ ((ju @ v) / (shift + state.values))
    elif state.factorization == "cholesky":
        coefficients = _block_cholesky_solve(state.matrix, state.panels, ju)
    elif state.factorization == "tangent":
        coefficients = _tangent_apply(state, ju)
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
    one of FACTORIZATIONS (module docstring); `rank`: the `tangent` factorisation's."""

    size: int = eqx.field(static=True)
    factorization: str = eqx.field(static=True, default="inverse")
    rank: int = eqx.field(static=True, default=0)

    @property
    def refresh_budget(self) -> int:
        """Excess CG iterations that justify a rebuild: about what a rebuild costs, so that
        staleness never costs more than twice the best schedule. Measured on 2 CPU cores at
        |Ω| = 2,945 (d = 100): the explicit inverse took 0.93 s, a CG iteration (Hessian-vector
        product and preconditioner) 2.7 ms, i.e. ~|Ω|/8 (the blocked inverse now takes
        ~0.6 s, but |Ω|/12 and |Ω|/16 gave the same solve time to noise: 26.9–28.1 s against
        27.0–27.9 s, 2026-12-05); an eigendecomposition 2.4 s, but its
        preconditioner is exact at every shift and goes stale more slowly. At |Ω| = 704
        (d = 50) budgets |Ω|/25…|Ω|/3 gave the same solve time to noise. The blocked Cholesky
        factor at |Ω| = 12,000: 11.4 s against 30–40 ms an iteration, ~|Ω|/24 (at |Ω| = 6,750,
        d = 150: 112.8 s with |Ω|/24, 10 builds, against 127.9 s with |Ω|/48, 14 builds).
        The `tangent` system: TANGENT_REFRESH_BUDGET (d = 100: a build every step 23.5 s,
        budgets 20 and 80 16.6 and 15.8 s, 48 13.9 s; 2026-12-06)."""
        if self.factorization == "tangent":
            return TANGENT_REFRESH_BUDGET
        if self.factorization == "eigh":
            return max(self.size // 5, 32)
        if self.factorization == "cholesky":
            return max(self.size // 24, 16)
        return max(self.size // 8, 16)

    def init(self, y, args) -> GaussNewtonState:
        if self.factorization == "tangent" and self.rank < 1:
            raise ValueError("the `tangent` factorisation needs its tangent space's rank (≥ 1)")
        return empty(y["model"], self.size, self.factorization, self.rank)

    def build(self, y, args, shift) -> GaussNewtonState:
        mask, layer_mask = args.problem.mask, args.layer_mask
        return build(y["model"], mask, layer_mask, self.size, shift, self.factorization, self.rank)

    def apply(self, state: GaussNewtonState, shift, r: dict) -> dict:
        return {k: apply(state, shift, v) if k == "model" else v / shift for k, v in r.items()}
