"""Three-stage Radau IIA for the stiff tail of gradient flows with a dense Hessian: where a
Rosenbrock tail still runs after `radau_after` steps (`FlowOptions(tail_method="auto")`, the
default; `_solve.tail_stages`), or throughout (`tail_method="radau"`).

Why (benchmarks/README, "A Radau IIA tail"): on flows whose top singular value runs off, the
Hessian's stiff eigenvectors turn with X's top singular vectors within a step, and a
Rosenbrock method, which linearises once a step, loses its accuracy past h ≈ 4e-5·t. A fully
implicit collocation step whose Newton iteration sees each stage's own curvature does not,
and is accurate at 100–250× the step. What makes that affordable is where the turning
curvature lives: in the Gauss–Newton term GᵀG, G = ∂X_Ω/∂θ the Jacobian of the observed
entries (rank ≤ |Ω|). Newton's matrix takes each stage's own G_i and the rest of the
Hessian, R = ∇²loss − GᵀG (which the residual weights and which changes slowly), from an
earlier point:

    M = I + h(A ⊗ I)·diag(G_iᵀ G_i) + h(A ⊗ R₀).

N₀ = I + h(A ⊗ R₀) is diagonal in Q ⊗ E (A = QΛQ⁻¹, R₀ = E diag(e) Eᵀ, an eigendecomposition
refreshed every `refresh_every` steps and after a failed Newton iteration), and the stages'
Gauss–Newton terms are a rank-3|Ω| correction, so M is solved through one 3|Ω| × 3|Ω|
system (Woodbury). M is formed once a step, at the stages predicted by the previous step's
collocation polynomial; Newton then costs three gradients and two passes through E a
iteration. The local error is RADAU5's embedded estimate (Hairer & Wanner IV.8), refined once
through f(y0 + err) where it exceeds the tolerance, with the same approximate Jacobian at y0.

E keeps R₀'s `basis_size` eigenpairs largest in |e| (`NEWTON_BASIS`, 32), and R₀ is taken as
zero outside them: an eigenvalue left out changes N₀ by h|e|, which costs Newton contraction,
never accuracy (the stages are solved to `newton_tol` all the same; the error filter then
damps less, which can only cost steps). On the d = 8 sweep's tails R₀ has 16–24 eigenvalues
with h|e| ≫ 1 and a tail mostly below 1, and the passes through E cost 3·P·32 instead of
3·P² a solve. Outside span(E), the Gauss–Newton rows enter as they are, projected twice
(`outside`): rounding left along a stiff direction, where N₀⁻¹ is tiny, would otherwise be
taken at weight 1.

Only the first decomposition of R₀, where the tail starts, is a full one. Each refresh after
it is a Rayleigh–Ritz step on span(E, R₀E) from the last kept eigenvectors (`ritz_pairs`;
3.2 ms against 8.5 ms for a full `eigh` at P = 320): R₀ moves little between refreshes, and
the refreshes together are a block subspace iteration that follows it. Where Newton fails
again after a refresh, the retry's refresh is one more iteration on the same R₀. On the d = 8
sweep the warm timeline took 204 s against 242–253 s with a full `eigh` at every refresh.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ..model import partial_products
from ._dynamics import entry_weights, split_passive

_S6 = np.sqrt(6.0)
NODES = np.array([(4 - _S6) / 10, (4 + _S6) / 10, 1.0])
A = np.array(
    [
        [(88 - 7 * _S6) / 360, (296 - 169 * _S6) / 1800, (-2 + 3 * _S6) / 225],
        [(296 + 169 * _S6) / 1800, (88 + 7 * _S6) / 360, (-2 - 3 * _S6) / 225],
        [(16 - _S6) / 36, (16 + _S6) / 36, 1 / 9],
    ]
)
# RADAU5's error estimate: err = (γ₀/h − J)⁻¹ (f(y0) + Σ_i d_i z_i / h), γ₀ A⁻¹'s real eigenvalue.
ESTIMATE = np.array([-(13 + 7 * _S6) / 3, (-13 + 7 * _S6) / 3, -1 / 3])


# The tail controller's growth limit with Radau: Newton starts from the last step's collocation
# polynomial, extrapolated past its step; beyond ~3× its length that start is poor and Newton
# fails (measured on a d = 8 random mask's slow approach to its limit: failures at growth
# 2.3–6×, accepted steps at 0.5–3×).
RADAU_STEP_LIMITS = {"factormax": 3.0}
# The error a step reports at least, by its Newton iterations: growth ≤ 3× up to 2 iterations,
# 1.5× at 3, none from 4 (0.9·err^(−1/4) = growth).
NEWTON_ERROR = tuple((0.9 / g) ** 4 for g in (3.0, 3.0, 3.0, 1.5, 1.0))


# R₀'s eigenpairs Newton's matrix and the error estimate keep, the largest in |e|. On the
# d = 8 sweep's Radau tails 16–24 eigenvalues have h|e| ~ 1e2–1e8; the 33rd has h|e| < 0.5 at
# 90% of the steps (at most 15), where a dropped eigenvalue costs Newton ~0.27·h|e| of
# contraction. Warm, that sweep took 175–185 s with 32, 202–219 s with 64 and 231–243 s with
# all P (benchmarks/README, "twenty-sixth session").
NEWTON_BASIS = 32

# The largest model the Radau tail takes: it holds P × P matrices (the Hessian, R₀ and, where
# it decomposes R₀ in full, its eigenvectors; 134 MB each at 4,096).
MAX_PARAMETERS = 4096


def _eigen():
    """A = QΛQ⁻¹ ordered (real, λ, conj λ), and the weights Q_ik (Q⁻¹A)_kj, (i, k, j)."""
    values, vectors = np.linalg.eig(A)
    order = np.argsort(np.imag(values))[[1, 2, 0]]
    values, vectors = values[order], vectors[:, order]
    inverse = np.linalg.inv(vectors)
    mix = vectors[:, :, None] * (inverse @ A)[None, :, :]
    return values, vectors, inverse, mix


LAMBDA, Q, Q_INVERSE, MIX = _eigen()
GAMMA0 = float(np.real(1 / LAMBDA[0]))


def _lagrange(theta):
    """Weights of the stage increments z_i in the collocation polynomial at θ (z(0) = 0)."""
    nodes = np.concatenate([[0.0], NODES])
    weights = []
    for k in range(1, 4):
        w = 1.0
        for j in range(4):
            if j != k:
                w = w * (theta - nodes[j]) / (nodes[k] - nodes[j])
        weights.append(w)
    return jnp.stack(weights, axis=-1)


class RadauInterpolation(diffrax.AbstractLocalInterpolation):
    """The collocation polynomial of a step: y0 + Σ_i ℓ_i(θ) z_i, ℓ_i the Lagrange basis on
    (0, c₁, c₂, 1) that vanishes at 0."""

    t0: jax.Array
    t1: jax.Array
    y0: object
    stages: object  # the increments z_i = Y_i − y0, with a leading axis of 3

    def evaluate(self, t0, t1=None, left=True):
        del left
        if t1 is not None:
            return jax.tree_util.tree_map(jnp.subtract, self.evaluate(t1), self.evaluate(t0))
        length = self.t1 - self.t0
        theta = jnp.where(length != 0, (t0 - self.t0) / jnp.where(length != 0, length, 1.0), 1.0)
        weights = _lagrange(theta)
        return jax.tree_util.tree_map(
            lambda y, z: y + jnp.tensordot(weights, z, axes=1), self.y0, self.stages
        )


def outside(x, basis):
    """The part of x's rows outside span(basis) (orthonormal columns), projected twice: one
    pass leaves rounding of x's size along the basis, where N₀⁻¹ may be ~1e-8 (stiff
    directions) but the complement's 1 would keep it."""
    for _ in range(2):
        x = x - (x @ basis) @ basis.T
    return x


def ritz_pairs(r0, previous):
    """R₀'s eigenpairs largest in |e|, as many as `previous` has columns, by Rayleigh–Ritz on
    span(E, R₀E), E = `previous` (an earlier R₀'s kept eigenvectors): one step of a block
    subspace iteration that the refreshes continue along the flow."""
    kept = previous.shape[1]
    trial, _ = jnp.linalg.qr(jnp.concatenate([previous, r0 @ previous], axis=1))
    projected = trial.T @ (r0 @ trial)
    values, vectors = jnp.linalg.eigh(0.5 * (projected + projected.T))
    largest = jnp.argsort(-jnp.abs(values))[:kept]
    return values[largest], trial @ vectors[:, largest]


def stage_system(g, h, e, basis):
    """The factorised Newton matrix of a step, M = I + h(A ⊗ I)·diag(G_iᵀG_i) + h(A ⊗ R₀),
    from the stages' observed Jacobians `g` (3, m, P) and R₀ = E diag(e) Eᵀ over k ≤ P
    eigenpairs (`e`, `basis` P × k; with k < P, R₀ is zero outside span(E)).

    In R₀'s eigenbasis (x̂ = x E) N₀ = I + h(A ⊗ R₀) is a 3 × 3 block per eigenvalue e_p,
    N̂₀⁻¹ = Q diag(1/(1 + hλ_k e_p)) Q⁻¹ (A = QΛQ⁻¹; real: the complex pair's terms are
    conjugate), and the identity outside span(E). Woodbury leaves the 3m × 3m system
    I + V N₀⁻¹ U, U = h(A ⊗ I)·diag(G_iᵀ), V = diag(G_i), whose (i, j) block is
    h Σ_k Q_ik (Q⁻¹A)_kj Ĝ_i diag(1/(1 + hλ_k e)) Ĝ_jᵀ + h A_ij G⊥_i G⊥_jᵀ with Ĝ = G E and
    G⊥ = G's rows outside span(E). Returns Ĝ, G⊥ (None where k = P), the blocks N̂₀⁻¹
    (k, 3, 3) and the LU factors of the small system with their row permutation."""
    m, size = g.shape[1], g.shape[2]
    kept = basis.shape[1]
    dtype = g.dtype
    inverse = 1.0 / (1.0 + h * jnp.asarray(LAMBDA)[:, None] * e[None, :])
    weights = jnp.stack([jnp.real(inverse[0]), jnp.real(inverse[1]), jnp.imag(inverse[1])])
    g_hat = g @ basis
    rows = g_hat.reshape(3 * m, kept)
    kernels = (rows[None] * weights[:, None, :]).reshape(9 * m, kept) @ rows.T
    spread = lambda w: jnp.kron(jnp.asarray(w, dtype), jnp.ones((m, m), dtype))
    mixes = (
        spread(np.real(MIX[:, 0])),
        spread(2 * np.real(MIX[:, 1])),
        -spread(2 * np.imag(MIX[:, 1])),
    )
    capacity = sum(w * k for w, k in zip(mixes, kernels.reshape(3, 3 * m, 3 * m), strict=True))
    g_perp = None
    if kept < size:
        g_perp = outside(g, basis)
        flat = g_perp.reshape(3 * m, size)
        capacity = capacity + spread(A) * (flat @ flat.T)
    blocks = jnp.real(jnp.einsum("ik,kp,kj->pij", jnp.asarray(Q), inverse, jnp.asarray(Q_INVERSE)))
    return g_hat, g_perp, blocks, lu_factor(jnp.eye(3 * m, dtype=dtype) + h * capacity)


def stage_solve(system, h, basis, rhs):
    """M⁻¹ rhs (rhs: (3, P), a row per stage) for M of `stage_system`: in R₀'s eigenbasis
    within span(E), as it stands outside."""
    g_hat, g_perp, blocks, small = system
    a = jnp.asarray(A, rhs.dtype)
    n0_solve = lambda x: jnp.einsum("pij,jp->ip", blocks, x)
    u = n0_solve(rhs @ basis)
    gu = jnp.einsum("iok,ik->io", g_hat, u)
    if g_perp is not None:
        u_perp = outside(rhs, basis)
        gu = gu + jnp.einsum("iop,ip->io", g_perp, u_perp)
    c = lu_solve(small, gu.reshape(-1)).reshape(3, -1)
    x = (u - n0_solve(h * a @ jnp.einsum("iok,io->ik", g_hat, c))) @ basis.T
    if g_perp is not None:
        x = x + u_perp - h * a @ jnp.einsum("iop,io->ip", g_perp, c)
    return x


def estimate_system(g0, h, e, basis):
    """RADAU5's error filter (γ₀/h − J₀)⁻¹ with the same approximate Jacobian as Newton's:
    −J₀ = G₀ᵀG₀ + R₀⁺, R₀⁺ = E diag(max(e, 0)) Eᵀ (R₀'s negative curvature, a saddle, is left
    out: (γ₀/h − μ)⁻¹ with μ > 0 would amplify the estimate near h = γ₀/μ). D = γ₀/h + R₀⁺
    is diagonal in R₀'s eigenbasis and γ₀/h outside span(E); G₀ (m × P) enters by Woodbury.
    Returns Ĝ₀ = G₀E, G₀'s rows outside span(E) (None where E is square), D's diagonal
    within span(E) and the LU factors of I + G₀ D⁻¹ G₀ᵀ."""
    g0_hat = g0 @ basis
    diagonal = GAMMA0 / h + jnp.maximum(e, 0.0)
    inner = (g0_hat / diagonal) @ g0_hat.T
    g0_perp = None
    if basis.shape[1] < basis.shape[0]:
        g0_perp = outside(g0, basis)
        inner = inner + (h / GAMMA0) * (g0_perp @ g0_perp.T)
    return g0_hat, g0_perp, diagonal, lu_factor(jnp.eye(g0.shape[0], dtype=g0.dtype) + inner)


def estimate_solve(system, h, basis, rhs):
    """(γ₀/h − J₀)⁻¹ rhs for the system of `estimate_system`."""
    g0_hat, g0_perp, diagonal, small = system
    x = (rhs @ basis) / diagonal
    gx = g0_hat @ x
    if g0_perp is not None:
        x_perp = (h / GAMMA0) * outside(rhs, basis)
        gx = gx + g0_perp @ x_perp
    c = lu_solve(small, gx)
    err = (x - (c @ g0_hat) / diagonal) @ basis.T
    if g0_perp is not None:
        err = err + x_perp - (h / GAMMA0) * (c @ g0_perp)
    return err


def lu_factor(matrix):
    """LU factors of `matrix` with the row permutation, taken once for all solves with it
    (`jax.scipy.linalg.lu_solve` turns the pivots into a permutation at each solve)."""
    lu, _, permutation = jax.lax.linalg.lu(matrix)
    return lu, permutation


def lu_solve(factors, rhs):
    lu, permutation = factors
    x = jax.lax.linalg.triangular_solve(
        lu, rhs[permutation, None], left_side=True, lower=True, unit_diagonal=True
    )
    return jax.lax.linalg.triangular_solve(lu, x, left_side=True, lower=False)[:, 0]


def layer_scaled_tolerance(active, *flats, step_tolerance):
    """Each entry's tolerance in a Radau step, atol + rtol·max(|θ_i| over `flats`, the RMS
    entry of θ_i's layer in `active`), as the tail's controller holds it."""
    rtol, atol = step_tolerance
    layer_rms = jnp.concatenate(
        [jnp.full(w.size, jnp.sqrt(jnp.mean(w**2))) for w in jax.tree_util.tree_leaves(active)]
    )
    size = functools.reduce(jnp.maximum, [jnp.abs(flat) for flat in flats])
    return atol + rtol * jnp.maximum(size, layer_rms)


def observed_jacobian(model, problem, layer_mask, entries: int):
    """G = ∂X_Ω/∂θ (`entries` × P, rows past the observed count zero), in closed form:
    ∂X_ij/∂(W_l)_ab = (W_L⋯W_{l+1})_ia (W_{l−1}⋯W_1)_bj; frozen layers' columns zero."""
    layers = model.layers
    count = jnp.sum(problem.mask == 1)
    rows, cols = jnp.nonzero(problem.mask == 1, size=entries, fill_value=0)
    valid = (jnp.arange(entries) < count).astype(layers[0].dtype)
    below, above = partial_products(layers)
    blocks = [
        (above[k][rows][:, :, None] * below[k][:, cols].T[:, None, :]).reshape(entries, -1)
        for k in range(len(layers))
    ]
    g = valid[:, None] * jnp.concatenate(blocks, axis=1)
    if layer_mask is not None:
        g = g * entry_weights(model, layer_mask)[None, :]
    return g


class RadauIIA(diffrax.AbstractAdaptiveSolver):
    """Radau IIA (order 5) for y' = f(y) = −∇loss on a factorisation (module docstring).

    - `entries`: a static bound on the observed entries (`_flow.observed_bound`).
    - `jacobian`: (t, y, args) ↦ the dense Jacobian −∇²loss of the model's rates.
    - `passive`: top-level entries of y (the energy integral) whose rates depend on the model
      only; their stages follow from the model's, their error from the same estimate.
    - `step_tolerance`: the tail's (rtol, atol): Newton stops where its last correction of
      the step is `newton_tol` of it (RMS, each entry's tolerance taken with its layer's RMS
      size as floor, as the tail's controller does), and fails after `max_newton`
      iterations or where a correction grows.
    - `refresh_every`: steps between eigendecompositions of R₀ (an approximate Newton matrix
      costs iterations, never accuracy: the stage equations are solved to `newton_tol`).
    - `basis_size`: R₀'s eigenpairs kept, the largest in |e| (R₀ is zero outside them; None:
      all P).
    - `ritz`: with fewer than P kept, refresh them by Rayleigh–Ritz from the last ones
      (`ritz_pairs`; in full only at the tail's start); False: a full eigendecomposition at
      every refresh.

    State: R₀'s eigendecomposition and the steps since (`age`), whether Newton failed on the
    last attempt (`stale`: R₀ is refreshed before the retry), the last accepted step's stage
    increments and length (Newton's start), and the work: Newton iterations (`iters`),
    factorisations (`factorizations`: eigendecompositions and Newton matrices) and
    evaluations of the rates (`evaluations`).
    """

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar[Callable[..., RadauInterpolation]] = RadauInterpolation
    # A refreshed R₀ is valid where the retry starts (the same y0); a failure's `stale` flag
    # must reach the retry; work done is work done.
    kept_on_rejection: ClassVar[tuple[str, ...]] = (
        "residual",
        "age",
        "stale",
        "iters",
        "factorizations",
        "evaluations",
    )
    entries: int
    jacobian: Callable
    step_tolerance: tuple
    passive: tuple[str, ...] = ("energy",)
    newton_tol: float = 0.03
    max_newton: int = 7
    refresh_every: int = 50
    newton_floor: float = 0.5
    basis_size: int | None = NEWTON_BASIS
    ritz: bool = True

    def _kept(self, size: int) -> int:
        return size if self.basis_size is None else min(size, self.basis_size)

    def order(self, terms):
        return 5

    def error_order(self, terms):
        return 4  # the embedded estimate is O(h⁴): the controller steps by err^(−1/4)

    def _split(self, y):
        return split_passive(y, self.passive)

    def _ritz(self, size: int) -> bool:
        return self.ritz and self._kept(size) < size

    def _gauss_newton_rows(self, model, args):
        return observed_jacobian(model, args.problem, args.layer_mask, self.entries)

    def _residual(self, t0, y0, args):
        """R₀ = ∇²loss − GᵀG = −(J + GᵀG) at y0, J the rates' Jacobian, symmetrised."""
        g = self._gauss_newton_rows(self._split(y0)[0]["model"], args)
        r0 = -(self.jacobian(t0, y0, args) + g.T @ g)
        return 0.5 * (r0 + r0.T)

    def _eigenpairs(self, r0):
        e, basis = jnp.linalg.eigh(r0)
        largest = jnp.argsort(-jnp.abs(e))[: self._kept(e.shape[0])]
        return e[largest], basis[:, largest]

    def init(self, terms, t0, t1, y0, args):
        flat, _ = ravel_pytree(self._split(y0)[0])
        size = flat.shape[0]
        if size > MAX_PARAMETERS:
            raise ValueError(
                f"tail_method='radau' forms the P × P Hessian and its eigendecomposition; "
                f"this model has P = {size} > {MAX_PARAMETERS} parameters: use the Rosenbrock "
                f"tail (tail_method='rosenbrock')"
            )
        zero = jnp.asarray(0, jnp.int32)
        return {
            # R₀ decomposed in full where the tail starts: Ritz refreshes start from it
            "residual": self._eigenpairs(self._residual(t0, y0, args)),
            "age": zero,
            "stale": jnp.asarray(False),
            "z": jnp.zeros((3, size), flat.dtype),
            "h": jnp.zeros((), flat.dtype),
            "iters": zero,
            "factorizations": jnp.asarray(1, jnp.int32),
            "evaluations": zero,
        }

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del made_jump
        active0, passive0 = self._split(y0)
        flat0, unravel = ravel_pytree(active0)
        passive_flat0, unravel_passive = ravel_pytree(passive0)
        h = t1 - t0
        a = jnp.asarray(A, flat0.dtype)

        def rates(flat):
            dy = terms.vf(t0, {**unravel(flat), **passive0}, args)
            active, passive = self._split(dy)
            return ravel_pytree(active)[0], ravel_pytree(passive)[0]

        def gauss_newton_rows(flat):
            return self._gauss_newton_rows(unravel(flat)["model"], args)

        def residual_part():
            r0 = self._residual(t0, y0, args)
            if self._ritz(r0.shape[0]):
                return ritz_pairs(r0, solver_state["residual"][1])
            return self._eigenpairs(r0)

        refresh = solver_state["stale"] | (solver_state["age"] >= self.refresh_every)
        e, basis = jax.lax.cond(refresh, residual_part, lambda: solver_state["residual"])
        tol = layer_scaled_tolerance(active0, flat0, step_tolerance=self.step_tolerance)

        # Newton's start: the last step's collocation polynomial at this step's nodes.
        previous = solver_state["h"]
        ratio = jnp.where(previous > 0, h / jnp.where(previous > 0, previous, 1.0), 0.0)
        z_last = solver_state["z"]
        at = _lagrange(1.0 + jnp.asarray(NODES) * ratio) - _lagrange(jnp.asarray(1.0))[None]
        z0 = jnp.where(previous > 0, at @ z_last, 0.0)

        # M at the predicted stages (module docstring), formed again once at the current
        # stages where a correction grows (a poor start: the step grew past what the last
        # step's polynomial predicts).
        def newton_matrix(z):
            g = jax.vmap(gauss_newton_rows)(flat0[None] + z)  # (3, m, P)
            return stage_system(g, h, e, basis)

        def solve(matrix, rhs):
            return stage_solve(matrix, h, basis, rhs)

        def newton(carry):
            z, it, change, growing, matrix, formed = carry
            again = growing & (formed < 2)
            matrix = jax.lax.cond(again, newton_matrix, lambda _: matrix, z)
            formed = formed + again.astype(jnp.int32)
            f, _ = jax.vmap(rates)(flat0[None] + z)
            dz = solve(matrix, -(z - h * a @ f))
            new = jnp.sqrt(jnp.mean((dz[2] / tol) ** 2))
            growing = (it > 0) & (new > change)
            return z + dz, it + 1, new, growing, matrix, formed

        def going(carry):
            _, it, change, growing, _, formed = carry
            return (
                (it < self.max_newton)
                & (change > self.newton_tol)
                & jnp.isfinite(change)
                & ~(growing & (formed >= 2))
            )

        big = jnp.asarray(1e300, flat0.dtype)
        one = jnp.asarray(1, jnp.int32)
        start = (z0, jnp.asarray(0, jnp.int32), big, jnp.asarray(False), newton_matrix(z0), one)
        z, iterations, change, stalled, _, formed = jax.lax.while_loop(going, newton, start)
        # Where the corrections stop shrinking below the tolerance, they are rounding in the
        # stage rates (h·f to ~1e-3 of itself late in a flow): the stages are then as good as
        # float64 allows, and the error estimate decides the step.
        converged = (change <= self.newton_tol) | (stalled & (change <= self.newton_floor))
        y1_flat = flat0 + z[2]

        # RADAU5's estimate, with the same approximate Jacobian at y0 (one |Ω| × |Ω| system)
        estimator = estimate_system(gauss_newton_rows(flat0), h, e, basis)
        estimate = functools.partial(estimate_solve, estimator, h, basis)

        # f(y0), and for passive rows the rates' derivative there (their error, below)
        if passive0:
            (f0, p0), jvp = jax.linearize(rates, flat0)
        else:
            f0, p0 = rates(flat0)
        combined = jnp.asarray(ESTIMATE, flat0.dtype) @ z / h
        err = estimate(f0 + combined)
        y1_tol = layer_scaled_tolerance(active0, flat0, y1_flat, step_tolerance=self.step_tolerance)
        err_size = lambda x: jnp.sqrt(jnp.mean((x / y1_tol) ** 2))
        refine = err_size(err) > 1
        err = jax.lax.cond(
            refine, lambda x: estimate(rates(flat0 + x)[0] + combined), lambda x: x, err
        )

        # Passive rows: stages by collocation on the model's stages, error from the same
        # estimate (γ₀/h)·err_p − (∂f_p/∂θ)·err = f_p(y0) + Σ d_i z_p,i / h.
        if passive0:
            _, stage_passive = jax.vmap(rates)(flat0[None] + z)
            z_passive = h * a @ stage_passive
            err_passive = (h / GAMMA0) * (
                p0 + jnp.asarray(ESTIMATE, flat0.dtype) @ z_passive / h + jvp(err)[1]
            )
        else:
            z_passive = jnp.zeros((3, 0), flat0.dtype)
            err_passive = jnp.zeros_like(passive_flat0)
        p1 = passive_flat0 + z_passive[2]

        # Newton-aware growth (as RADAU5's safety factor): a step that took many iterations
        # reports at least NEWTON_ERROR[iterations] × its tolerance, so that the controller
        # (0.9·err^(−1/4)) grows the next step less; below 1 it never rejects one.
        floor = jnp.asarray(NEWTON_ERROR, flat0.dtype)[
            jnp.minimum(iterations, len(NEWTON_ERROR) - 1)
        ]
        err = err + floor * y1_tol * jnp.where(err < 0, -1.0, 1.0)
        ok = converged & jnp.all(jnp.isfinite(y1_flat)) & jnp.all(jnp.isfinite(err))
        y1 = {**unravel(y1_flat), **unravel_passive(p1)}
        y_error = {
            **unravel(jnp.where(ok, err, jnp.inf)),
            **unravel_passive(jnp.where(ok, err_passive, jnp.inf)),
        }
        stages = {**jax.vmap(unravel)(z), **jax.vmap(unravel_passive)(z_passive)}
        evaluations = 3 * iterations + 1 + refine.astype(jnp.int32) + 3 * bool(passive0)
        new_state = {
            "residual": (e, basis),
            "age": jnp.where(refresh, 1, solver_state["age"] + 1).astype(jnp.int32),
            "stale": ~ok,
            "z": z,
            "h": h,
            "iters": solver_state["iters"] + iterations.astype(jnp.int32),
            "factorizations": solver_state["factorizations"] + formed + refresh.astype(jnp.int32),
            "evaluations": solver_state["evaluations"] + evaluations.astype(jnp.int32),
        }
        dense_info = dict(y0=y0, stages=stages)
        return y1, y_error, dense_info, new_state, diffrax.RESULTS.successful
