"""Rodas4: stiffly accurate, L-stable Rosenbrock methods of order 4 (embedded order 3) and 5
(embedded 4), as a diffrax solver, for the stiff tail of a gradient flow.

A Rosenbrock method replaces the Newton iterations of an implicit Runge–Kutta method by one
linear system per stage, all with the same matrix (I/(hγ) − J), so a step never fails for lack
of nonlinear convergence. For a gradient flow J = −∇²loss is symmetric, and the systems are
solved either densely (Cholesky of the P×P matrix, P = number of parameters) or matrix-free with
conjugate gradients on Hessian-vector products (`jax.linearize` of the vector field), which needs
no P×P matrix at all.

Four tableaus of the same form, for autonomous systems with s stages
    (I/(hγ) − J) K_i = f(y + Σ_j a_ij K_j) + Σ_j (c_ij/h) K_j,
    y₁ = y + Σ m_i K_i (m_i = a_si, then 1: stiffly accurate),  error = K_s:

- `rodas4p2` (s = 6, γ = 1/4; the default, and `flow`'s below 1,024 observed entries):
  G. Steinebach, "Improvement of Rosenbrock-Wanner method RODASP", in *Progress in
  Differential-Algebraic Equations II*, Springer 2020, pp. 165–184;
- `rodas5p` (s = 8, γ ≈ 0.2119, order 5; `flow`'s from 1,024 observed entries):
  G. Steinebach, "Construction of Rosenbrock–Wanner method Rodas5P and numerical benchmarks
  within the Julia Differential Equations package", BIT Numer. Math. 63 (2023);
- `rodas4p` (s = 6, γ = 1/4): G. Steinebach, "Order-reduction of ROW-methods for DAEs and
  method of lines applications", preprint 1741, TH Darmstadt 1995;
- `rodas4` (s = 6, γ = 1/4): E. Hairer and G. Wanner, *Solving Ordinary Differential Equations
  II*, 2nd ed., Springer 1996, §VI.4.

On a flow's stiff tail (eigenvalues of the Hessian spread over ten or more decades) RODAS4
loses order: its steps grew as rtol^−0.42 instead of rtol^−1/5, the order reduction of
Prothero–Robinson-type problems that RODAS4P, RODAS4P2 and RODAS5P were built to avoid.
Measured (benchmarks/README, `scale`): RODAS4P2 reaches the same endpoints in 1.9× (d = 50) to
2.6× (d = 8, depth 3) fewer steps than RODAS4 at rtol 1e-10; RODAS5P in 1.4–2× fewer than
RODAS4P2. Each of its steps solves eight systems instead of six, at more CG iterations per
system, but with fewer steps go fewer preconditioner builds: 1.04–1.15× faster on the `scale`
problem at d = 50 and 100, the same time to noise on single d = 8 random masks, and slower
on a sweep whose slowest flows spend their whole step budget (2026-12-05; `_solve.tail_tableau`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import diffrax
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ._dynamics import split_passive

STAGE_STARTS = ("stages", "previous", "zero")  # where a stage's CG starts (`Rodas4`)


class Tableau(NamedTuple):
    a: dict  # a_ij, i > j
    c: dict  # c_ij
    m: list  # the solution's weights
    dense: tuple  # rows (h_k1, h_k2, …): the dense output's (`RosenbrockInterpolation`)
    gamma: float = 0.25
    order: int = 4  # of the solution; its embedded pair (the error estimate K_s) is one lower

    @property
    def stages(self) -> int:
        return len(self.m)


def stage_loop(stage, start, first: int, count: int):
    """`start` through `stage(i, carry)` for i = first … count − 1, as one loop: a Rosenbrock
    step's program then holds the vector field (with its compensated gradient, the bulk of a
    stiff-tail program) and each linear solve once for all its stages after the first,
    however many its tableau has. The d = 8 sweep's tail programs compile in ~0.6 of the time
    they took with the stages unrolled, and take their steps 1.15–1.4× faster
    (`python -m benchmarks.tail_compile`, which unrolls them)."""
    return jax.lax.fori_loop(first, count, stage, start)


def _lower_rows(coefficients: dict, stages: int) -> list:
    """A tableau's strictly lower-triangular a_ij or c_ij (1-based keys) as rows of a matrix."""
    return [
        [coefficients.get((i, j), 0.0) if j < i else 0.0 for j in range(1, stages + 1)]
        for i in range(1, stages + 1)
    ]


def _tableau(a: dict, c: dict, dense: tuple, stages=6, gamma=0.25, order=4) -> Tableau:
    """A stiffly accurate tableau from its a_ij up to the row b of the solution's weights
    (rows 2…b, b = the last row given), its c_ij and dense output: each later stage is
    evaluated at the previous one's argument plus the previous stage (a_ij = a_bj for j < b,
    1 for b ≤ j < i), the solution is the last stage's argument plus K_s, and K_s is the
    error estimate."""
    a = dict(a)
    b = max(i for i, _ in a)
    for i in range(b + 1, stages + 1):
        for j in range(1, i):
            a[(i, j)] = a[(b, j)] if j < b else 1.0
    m = [a[(stages, j)] for j in range(1, stages)] + [1.0]
    return Tableau(a, c, m, dense, gamma, order)


TABLEAUS = {
    "rodas4": _tableau(
        {
            (2, 1): 1.544,
            (3, 1): 0.9466785280815826,
            (3, 2): 0.2557011698983284,
            (4, 1): 3.314825187068521,
            (4, 2): 2.896124015972201,
            (4, 3): 0.9986419139977817,
            (5, 1): 1.221224509226641,
            (5, 2): 6.019134481288629,
            (5, 3): 12.53708332932087,
            (5, 4): -0.687886036105895,
        },
        {
            (2, 1): -5.6688,
            (3, 1): -2.430093356833875,
            (3, 2): -0.2063599157091915,
            (4, 1): -0.1073529058151375,
            (4, 2): -9.594562251023355,
            (4, 3): -20.47028614809616,
            (5, 1): 7.496443313967647,
            (5, 2): -10.24680431464352,
            (5, 3): -33.99990352819905,
            (5, 4): 11.7089089320616,
            (6, 1): 8.083246795921522,
            (6, 2): -7.981132988064893,
            (6, 3): -31.52159432874371,
            (6, 4): 16.31930543123136,
            (6, 5): -6.058818238834054,
        },
        (
            [
                10.12623508344586,
                -7.487995877610167,
                -34.80091861555747,
                -7.992771707568823,
                1.025137723295662,
            ],
            [
                -0.6762803392801253,
                6.087714651680015,
                16.43084320892478,
                24.76722511418386,
                -6.594389125716872,
            ],
        ),
    ),
    "rodas4p": _tableau(
        {
            (2, 1): 3.0,
            (3, 1): 1.831036793486759,
            (3, 2): 0.4955183967433795,
            (4, 1): 2.304376582692669,
            (4, 2): -0.05249275245743001,
            (4, 3): -1.176798761832782,
            (5, 1): -7.170454962423024,
            (5, 2): -4.741636671481785,
            (5, 3): -16.31002631330971,
            (5, 4): -1.062004044111401,
        },
        {
            (2, 1): -12.0,
            (3, 1): -8.791795173947035,
            (3, 2): -2.207865586973518,
            (4, 1): 10.81793056857153,
            (4, 2): 6.780270611428266,
            (4, 3): 19.53485944642410,
            (5, 1): 34.19095006749676,
            (5, 2): 15.49671153725963,
            (5, 3): 54.74760875964130,
            (5, 4): 14.16005392148534,
            (6, 1): 34.62605830930532,
            (6, 2): 15.30084976114473,
            (6, 3): 56.99955578662667,
            (6, 4): 18.40807009793095,
            (6, 5): -5.714285714285717,
        },
        (
            [25.09876703708589, 11.62013104361867, 28.49148307714626, -5.664021568594133, 0.0],
            [
                1.638054557396973,
                -0.7373619806678748,
                8.47791821923899,
                15.9925314877952,
                -1.882352941176471,
            ],
        ),
    ),
    "rodas4p2": _tableau(
        {
            (2, 1): 3.0,
            (3, 1): 0.906377755268814,
            (3, 2): -0.189707390391685,
            (4, 1): 3.758617027739064,
            (4, 2): 1.161741776019525,
            (4, 3): -0.849258085312803,
            (5, 1): 7.089566927282776,
            (5, 2): 4.573591406461604,
            (5, 3): -8.423496976860259,
            (5, 4): -0.959280113459775,
        },
        {
            (2, 1): -12.0,
            (3, 1): -6.354581592719008,
            (3, 2): 0.338972550544623,
            (4, 1): -8.575016317114033,
            (4, 2): -7.606483992117508,
            (4, 3): 12.224997650124820,
            (5, 1): -5.888975457523102,
            (5, 2): -8.157396617841821,
            (5, 3): 24.805546872612922,
            (5, 4): 12.790401512796979,
            (6, 1): -4.408651676063871,
            (6, 2): -6.692003137674639,
            (6, 3): 24.625568527593117,
            (6, 4): 16.627521966636085,
            (6, 5): -5.714285714285718,
        },
        (
            [
                -5.323528268423303,
                -10.042123754867493,
                17.175254928256965,
                -5.079931171878093,
                -0.016185991706112,
            ],
            [
                6.984505741529879,
                6.914061169603662,
                -0.849178943070653,
                18.104410789349338,
                -3.516963011559032,
            ],
        ),
    ),
    # G. Steinebach, "Construction of Rosenbrock–Wanner method Rodas5P and numerical
    # benchmarks within the Julia Differential Equations package", BIT Numer. Math. 63 (2023)
    "rodas5p": _tableau(
        {
            (2, 1): 3.0,
            (3, 1): 2.849394379747939,
            (3, 2): 0.45842242204463923,
            (4, 1): -6.954028509809101,
            (4, 2): 2.489845061869568,
            (4, 3): -10.358996098473584,
            (5, 1): 2.8029986275628964,
            (5, 2): 0.5072464736228206,
            (5, 3): -0.3988312541770524,
            (5, 4): -0.04721187230404641,
            (6, 1): -7.502846399306121,
            (6, 2): 2.561846144803919,
            (6, 3): -11.627539656261098,
            (6, 4): -0.18268767659942256,
            (6, 5): 0.030198172008377946,
        },
        {
            (2, 1): -14.155112264123755,
            (3, 1): -17.97296035885952,
            (3, 2): -2.859693295451294,
            (4, 1): 147.12150275711716,
            (4, 2): -1.41221402718213,
            (4, 3): 71.68940251302358,
            (5, 1): 165.43517024871676,
            (5, 2): -0.4592823456491126,
            (5, 3): 42.90938336958603,
            (5, 4): -5.961986721573306,
            (6, 1): 24.854864614690072,
            (6, 2): -3.0009227002832186,
            (6, 3): 47.4931110020768,
            (6, 4): 5.5814197821558125,
            (6, 5): -0.6610691825249471,
            (7, 1): 30.91273214028599,
            (7, 2): -3.1208243349937974,
            (7, 3): 77.79954646070892,
            (7, 4): 34.28646028294783,
            (7, 5): -19.097331116725623,
            (7, 6): -28.087943162872662,
            (8, 1): 37.80277123390563,
            (8, 2): -3.2571969029072276,
            (8, 3): 112.26918849496327,
            (8, 4): 66.9347231244047,
            (8, 5): -40.06618937091002,
            (8, 6): -54.66780262877968,
            (8, 7): -9.48861652309627,
        },
        (
            [
                25.948786856663858,
                -2.5579724845846235,
                10.433815404888879,
                -2.3679251022685204,
                0.524948541321073,
                1.1241088310450404,
                0.4272876194431874,
                -0.17202221070155493,
            ],
            [
                -9.91568850695171,
                -0.9689944594115154,
                3.0438037242978453,
                -24.495224566215796,
                20.176138334709044,
                15.98066361424651,
                -6.789040303419874,
                -6.710236069923372,
            ],
            [
                11.419903575922262,
                2.8879645146136994,
                72.92137995996029,
                80.12511834622643,
                -52.072871366152654,
                -59.78993625266729,
                -0.15582684282751913,
                4.883087185713722,
            ],
        ),
        stages=8,
        gamma=0.21193756319429014,
        order=5,
    ),
}


def rounding_gain(tableau: Tableau) -> float:
    """Σ_i |e_i|, where the error estimate K_s = h Σ_i e_i n_i in a direction of zero curvature
    whose stage evaluations carry rounding n_i: the most the estimate can make of rounding in
    the vector field (2.9 for RODAS4P2, 1.4 RODAS5P, 4.7 RODAS4P, 5.1 RODAS4; Σ_i e_i = 0, so
    rounding that is the same in every stage cancels)."""
    s, gamma = tableau.stages, tableau.gamma
    e = [[0.0] * (s + 1) for _ in range(s + 1)]  # K_i = h Σ_j e[i][j] n_j
    for i in range(1, s + 1):
        e[i][i] = gamma
        for j in range(1, i):
            coefficient = gamma * tableau.c.get((i, j), 0.0)
            for k in range(1, j + 1):
                e[i][k] += coefficient * e[j][k]
    return sum(abs(x) for x in e[s][1:])


def conjugate_gradient(
    matvec, b, *, rtol, max_iters, precondition=lambda r: r, atol=0.0, x0=None, r0=None
):
    """Solve A x = b for symmetric positive definite A, matrix-free, with an optional SPD
    preconditioner (a function r ↦ M⁻¹r), until ‖r‖ ≤ max(rtol·‖b‖, atol), from `x0` (default
    0) whose residual b − A x0 is `r0`. Returns (x, converged, iterations, r)."""
    b_norm = jnp.linalg.norm(b)
    target = jnp.maximum(rtol * b_norm, atol)

    def cond(state):
        _, r, _, _, k = state
        return (jnp.linalg.norm(r) > target) & (k < max_iters)

    def body(state):
        # Precondition first: the last iteration spends no preconditioner application on a
        # search direction it will not take.
        x, r, p, rz, k = state
        z = precondition(r)
        rz_new = r @ z
        p = z + jnp.where(k > 0, rz_new / jnp.where(rz != 0, rz, 1.0), 0.0) * p
        ap = matvec(p)
        curvature = p @ ap
        step = rz_new / jnp.where(curvature > 0, curvature, 1.0)
        x = x + step * p
        r = r - step * ap
        # A direction of non-positive curvature: stop, and let the caller reject the step.
        k = jnp.where(curvature > 0, k + 1, max_iters + 1)
        return x, r, p, rz_new, k

    zero = jnp.zeros_like(b)
    x0 = zero if x0 is None else x0
    r0 = b if r0 is None else r0
    state = (x0, r0, zero, jnp.ones((), b.dtype), jnp.asarray(0))
    x, r, _, _, k = jax.lax.while_loop(cond, body, state)
    converged = (jnp.linalg.norm(r) <= target) | (b_norm == 0)
    return x, converged, k, r


def galerkin_start(solutions, images, b):
    """The best start for A x = b in span{x_j} (A-norm), given A x_j = `images[j]` (rows, or
    lists of vectors): earlier solves with the same matrix, so no product with A is spent.
    Returns (x0, b − A x0).

    A Rosenbrock stage's right-hand side is made of the earlier stages' solutions (its memory
    terms Σ c_ij K_j/h, and f evaluated at y + Σ a_ij K_j), so much of its solution lies in
    their span: CG then starts from there. Directions the span barely resolves (near-parallel
    solutions) are dropped, so the start is never worse than 0 in the A-norm; so are zero rows
    (stages not solved yet), and with none left the start is 0."""
    z = jnp.stack(solutions, axis=1)
    az = jnp.stack(images, axis=1)
    small = z.T @ az
    small = 0.5 * (small + small.T)
    lam, v = jnp.linalg.eigh(small)
    keep = lam > 1e-12 * jnp.max(jnp.abs(lam))
    coeffs = v @ jnp.where(keep, (v.T @ (z.T @ b)) / jnp.where(keep, lam, 1.0), 0.0)
    ok = jnp.all(jnp.isfinite(coeffs))
    coeffs = jnp.where(ok, coeffs, 0.0)
    return z @ coeffs, b - az @ coeffs


def _cholesky_qr(y, passes=2):
    """Orthonormal basis of range(y) by shifted Cholesky QR, repeated (Fukaya et al. 2020):
    matrix products instead of Householder QR, several times faster on a tall, thin y; the
    tiny shift keeps the Cholesky factorisation defined when y is nearly rank-deficient."""
    eye = jnp.eye(y.shape[1], dtype=y.dtype)
    for _ in range(passes):
        gram = y.T @ y
        shift = 1e-13 * jnp.trace(gram) / y.shape[1] + jnp.finfo(y.dtype).tiny
        chol = jnp.linalg.cholesky(gram + shift * eye)
        y = jax.scipy.linalg.solve_triangular(chol, y.T, lower=True).T
    return y


def spectral_sketch(hvp, omega):
    """Randomized Rayleigh–Ritz approximation H ≈ U diag(λ) Uᵀ of a symmetric H given by `hvp`
    (Halko, Martinsson & Tropp 2011, with one power step): Q = orth(HΩ), then the eigenpairs of
    QᵀHQ. Unlike a Nyström sketch it needs no definiteness: near a saddle H has small negative
    eigenvalues, which are clipped to 0 (the preconditioner then treats those directions like
    the rest of the spectrum). For a flow's tail the top eigenpairs are its stiff directions."""
    batched = jax.vmap(hvp, in_axes=1, out_axes=1)
    q = _cholesky_qr(batched(omega))
    core = q.T @ batched(q)
    lam, v = jnp.linalg.eigh(0.5 * (core + core.T))
    u = q @ v
    lam = jnp.maximum(lam, 0.0)
    ok = jnp.all(jnp.isfinite(u)) & jnp.all(jnp.isfinite(lam))
    # Descending order, so that lam[-1] is the smallest eigenvalue the sketch resolved.
    return jnp.where(ok, u[:, ::-1], 0.0), jnp.where(ok, lam[::-1], 0.0)


def sketch_preconditioner(u, lam, shift):
    """r ↦ P⁻¹r for (H + shift·I) from a sketch (U, λ): exact on span U, scaled
    elsewhere. Any sketch gives a valid SPD preconditioner; a stale one only slows CG."""
    scale = lam[-1] + shift

    weights = scale / (lam + shift) - 1.0

    def apply(r):
        return r + u @ (weights * (r @ u))  # r @ u: XLA on CPU would copy u.T

    return apply


class RosenbrockInterpolation(diffrax.AbstractLocalInterpolation):
    """The RODAS family's dense output within a step (Hairer & Wanner §VI.4; Steinebach 2023
    for RODAS5P): y(t0 + θh) = (1 − θ)·y0 + θ·(y1 + (1 − θ)(k1 + θ·(k2 + θ·(k3 + …)))),
    k_r = Σ_j h_rj K_j (two rows for the order-4 tableaus: third order; three for RODAS5P).
    Trajectory samples in a stiff tail come from it; a linear interpolant between steps is off
    by O(h²), which the tail's long steps make visible (1e-8 in the balancedness invariant)."""

    t0: jax.Array
    t1: jax.Array
    y0: object
    y1: object
    ks: tuple

    def evaluate(self, t0, t1=None, left=True):
        del left
        if t1 is not None:
            return jax.tree_util.tree_map(jnp.subtract, self.evaluate(t1), self.evaluate(t0))
        length = self.t1 - self.t0
        theta = jnp.where(length != 0, (t0 - self.t0) / jnp.where(length != 0, length, 1.0), 1.0)

        def at(y0, y1, *ks):
            inner = ks[-1]
            for k in reversed(ks[:-1]):
                inner = k + theta * inner
            return (1 - theta) * y0 + theta * (y1 + (1 - theta) * inner)

        return jax.tree_util.tree_map(at, self.y0, self.y1, *self.ks)


class Rodas4(diffrax.AbstractAdaptiveSolver):
    """A RODAS-type Rosenbrock method (`tableau`: `rodas4p2`, `rodas5p`, `rodas4p` or `rodas4`,
    module docstring; named for the order-4 family it began with) for autonomous systems
    y' = f(y), with dense or matrix-free (CG) linear algebra.

    - `symmetric`: the Jacobian is symmetric (a gradient flow: J = −∇²loss), apart from the
      `passive` entries. Then the dense path factorises (I/(hγ) − J) by Cholesky, about twice
      as fast as LU; a factorisation that fails (a saddle's negative curvature with hγ|λ| ≥ 1)
      rejects the step and the controller retries a smaller one. A non-symmetric system always
      takes the dense LU path.
    - `passive`: names of top-level dict entries of y (e.g. an energy integral) whose rates
      depend on the other entries only and which feed nothing back. Their rows of the stage
      systems are solved by substitution, so they do not spoil the symmetry of the rest.
    - `jacobian`: optional (t, y, args) ↦ the dense Jacobian of the active entries' rates with
      respect to the active entries (flattened as `ravel_pytree` orders them), used by the
      dense path in place of P Jacobian-vector products (e.g. a closed-form Hessian).
    - `linear_solver`: `"dense"`, `"cg"` (conjugate gradients on Jacobian-vector products;
      needs `symmetric`), or `"auto"` (dense up to `dense_max` unknowns: a Cholesky
      per step grows as P³, CG's cost as P; the crossover is measured in benchmarks/README).
    - `cg_rtol`, `cg_max_iters`: CG stopping rule. A CG solve that does not converge (or meets
      negative curvature) makes the step fail, and the controller retries a smaller one.
    - `fallback_max`, `fallback_hold`: with `linear_solver="auto"`, on the CG path with at
      most `fallback_max` unknowns (0: never), a stage's CG is capped at about a dense
      step's cost (P/8 iterations, at least 32); a step whose CG fails is solved densely
      instead (a Cholesky of the `jacobian`), and the next `fallback_hold` steps stay dense.
      Each dense step counts as a factorisation. This bounds a step's cost where the
      preconditioner stops working (the residual's part of a flow's Hessian, late on some
      random-mask flows). While the steps stay dense, a structured preconditioner due for a
      rebuild waits for the next CG step.
    - `step_tolerance`: the step controller's `(rtol, atol)`. With it CG also stops once its
      residual r is below `solve_fraction`·(1/(hγ))·‖atol + rtol·|y|‖: the error it leaves in
      a stage, ‖r‖·hγ, is then that fraction of the step's own tolerance (for a positive
      semi-definite Hessian), so no iterations are spent below the integration error. The
      default 1e-3 is not slack to take: CG leaves its residual in the directions it resolves
      last, the flat ones, where hγ amplifies it most and nothing damps it, so the stages'
      errors add up from step to step. Measured (2026-12-04, RODAS4P2, whose stage errors
      reach the solution with gain Σ|mᵀ(I − γC)⁻¹| = 4.9): at 2e-2 the `scale` problem's
      d = 100 solve was 1.2× faster with top singular values 3e-15 apart, but a d = 8 random
      mask (depth 4, α = 0.01, seed 2) moved σ₁ by 1.2e-8 and another (depth 5, α = 0.01,
      seed 1) by 1.8e-10 (RODAS4P2 and RODAS5P at 1e-3: 9e-10 and 4.5e-11 apart).
    - `preconditioner_rank`: rank of a randomized spectral preconditioner for CG (0: none),
      rebuilt every `preconditioner_refresh` step attempts and carried in between (the
      Hessian of a flow's tail changes slowly; a stale preconditioner costs iterations, never
      accuracy).
    - `preconditioner`: in place of the spectral one, a structured preconditioner with
      `init(y, args)`, `build(y, args, shift)` (its state at y, for the step's shift) and
      `apply(state, shift, r)` (an SPD approximation of (shift·I − J)⁻¹ on the active
      entries' tree), e.g. the Gauss–Newton one of `_gram`. It is built at the first step
      and rebuilt once the CG iterations beyond those of the first step after the last build
      add up to its `refresh_budget` (a rebuild then costs about what its staleness has
      cost).
    - `batch_axis`: under `jax.vmap(..., axis_name=batch_axis)`, the batch rebuilds the
      preconditioner together (a real branch, not a per-member select that would build it
      at every step), and falls back to dense steps together. Only members still stepping
      decide either (`solver_state["active"]`, which `_solver_loop.integrate_solver`
      sets): under vmap a finished member's step is computed and thrown away, and a member
      that never reached the tail (a zero-length span, h = 0) has a failing CG and a
      pending first build at every step.
    - `stage_start`: where each stage's CG starts: the Galerkin projection (`galerkin_start`)
      of its right-hand side onto a span of known solutions, or zero (`zero`). `stages`
      (default): the step's earlier stages (free: their images are known); `previous`: also
      the previous accepted step's stage solutions, whose images under this step's matrix
      cost one Hessian-vector product each: it pays where a preconditioner application costs
      several of those (`flow` uses it with a Gauss–Newton preconditioner of ≥ 1,024
      observed entries). Measured side by side with that preconditioner (benchmarks/README,
      2026-12-04): d = 100 `scale` problem 11.5k → 8.4k CG iterations, 1.16× faster; d = 50
      11.2k → 8.0k, same time; the 112-flow d = 8 sweep 8% slower (single d = 8 flows from
      2.3× faster to equal). Unpreconditioned on the stiff linear test system of
      tests/test_stiff.py it took 2,171 iterations against 1,810 for `stages` (2,172 from 0).

    The solver state counts CG iterations (`iters`), `factorizations` and the vector-field
    evaluations of stages solved again densely after a failed CG (`redone_stages`).
    `_solver_loop` keeps these counts from rejected steps too; `diffeqsolve` discards the state
    of a rejected step, so there its work goes uncounted. Either way a rebuild or fallback a
    rejected step decided on is decided again by its retry.
    """

    term_structure: ClassVar = diffrax.AbstractTerm
    interpolation_cls: ClassVar[Callable[..., RosenbrockInterpolation]] = RosenbrockInterpolation
    # State a loop may keep from a rejected step instead of restoring it (`_solver_loop`): the
    # structured preconditioner changes only in a step that rebuilds it, and whether a step
    # rebuilds is decided from the state it starts from. A rejected step's retry starts from
    # the same state, so it rebuilds again where the rejected step did (the kept one is then
    # overwritten), and otherwise the kept one is the one it started with. Only under a
    # batch (whose rebuilds are shared) can a rejected member keep a preconditioner built at
    # its own point that `diffeqsolve` would have discarded: still a valid SPD one. The work
    # counters are kept too: a rejected step's work was done.
    kept_on_rejection: ClassVar[tuple[str, ...]] = (
        "structured",
        "iters",
        "factorizations",
        "redone_stages",
    )
    linear_solver: str = "auto"
    tableau: str = "rodas4p2"
    symmetric: bool = False
    passive: tuple[str, ...] = ()
    jacobian: Callable | None = None
    dense_max: int = 200
    fallback_max: int = 1024
    fallback_hold: int = 64
    cg_rtol: float = 1e-10
    cg_max_iters: int = 2000
    preconditioner_rank: int = 64
    preconditioner_refresh: int = 25
    step_tolerance: tuple | None = None
    solve_fraction: float = 1e-3
    preconditioner: object | None = None
    batch_axis: str | None = None
    stage_start: str = "stages"

    def order(self, terms):
        return TABLEAUS[self.tableau].order

    def error_order(self, terms):
        return TABLEAUS[self.tableau].order  # the estimate K_s is O(h^order)

    def __check_init__(self):
        if self.stage_start not in STAGE_STARTS:
            raise ValueError(
                f"unknown stage_start {self.stage_start!r}; choose from {STAGE_STARTS}"
            )

    def _uses_cg(self, size):
        return self.symmetric and (
            self.linear_solver == "cg" or (self.linear_solver == "auto" and size > self.dense_max)
        )

    def _split(self, y):
        return split_passive(y, self.passive)

    def _falls_back(self, size) -> bool:
        return self.linear_solver == "auto" and size <= self.fallback_max

    def _any_member(self, flag, solver_state) -> jax.Array:
        """`flag`, or under vmap whether it holds for any member still stepping."""
        if self.batch_axis is None:
            return flag
        flag = flag & solver_state["active"]
        return jax.lax.psum(flag.astype(jnp.int32), self.batch_axis) > 0

    def _holds_dense(self, solver_state) -> jax.Array:
        """Whether this step stays dense after a fallback (for the whole batch under vmap)."""
        return self._any_member(solver_state["dense_hold"] > 0, solver_state)

    def _cg_iteration_cap(self, size) -> int:
        """CG iterations a stage may spend: with a dense fallback, about one dense step's
        cost (~P/8 Hessian-vector products, at least 32); else `cg_max_iters`."""
        if self._falls_back(size):
            return min(self.cg_max_iters, max(32, size // 8))
        return self.cg_max_iters

    def _cg_solver(self, jvp, shift, flat0, unravel, y0, args, solver_state):
        """The preconditioned CG stage solve (I/(hγ) − J) K = rhs, −J = ∇²loss; whether the
        structured preconditioner was rebuilt this step; the solver state it carries."""
        size = flat0.shape[0]
        hvp = lambda v: -jvp(v)
        matvec = lambda v: shift * v + hvp(v)
        precondition = lambda r: r
        rebuilt = jnp.asarray(0, jnp.int32)
        carried = {}
        if "structured" in solver_state:
            rebuild = self._any_member(solver_state["rebuild"], solver_state)
            if "dense_hold" in solver_state:
                # Holding dense, CG does not run: the rebuild waits for the first CG step.
                rebuild = rebuild & ~self._holds_dense(solver_state)
            structured = jax.lax.cond(
                rebuild,
                lambda: self.preconditioner.build(y0, args, shift),
                lambda: solver_state["structured"],
            )
            carried["structured"] = structured
            precondition = lambda r: ravel_pytree(
                self.preconditioner.apply(structured, shift, unravel(r))
            )[0]
            rebuilt = rebuild.astype(jnp.int32)
        elif "u" in solver_state:
            # Shared by the batch: a per-member predicate would sketch at every step.
            rebuild = self._any_member(
                solver_state["age"] >= self.preconditioner_refresh, solver_state
            )
            rebuilt = rebuild.astype(jnp.int32)
            u, lam = jax.lax.cond(
                rebuild,
                lambda: spectral_sketch(hvp, solver_state["omega"]),
                lambda: (solver_state["u"], solver_state["lam"]),
            )
            precondition = sketch_preconditioner(u, lam, shift)
            age = jnp.where(rebuild, 1, solver_state["age"] + 1)
            carried |= {"u": u, "lam": lam, "age": age.astype(jnp.int32)}

        floor = 0.0
        if self.step_tolerance is not None:
            rtol, atol = self.step_tolerance
            floor = self.solve_fraction * shift * jnp.linalg.norm(atol + rtol * jnp.abs(flat0))

        # The previous step's stage solutions, with their images under this step's matrix
        # (a Hessian-vector product each: far cheaper than a preconditioned CG iteration).
        earlier = earlier_images = None
        if "previous" in solver_state:
            earlier = solver_state["previous"].T
            earlier_images = jax.vmap(matvec)(earlier)

        def solve(rhs, solutions, images):
            """`solutions`, `images`: the step's stage solutions so far and their images, as
            rows (zero rows for the stages still to come)."""
            x0 = r0 = None
            if earlier is not None:
                solutions = jnp.concatenate([earlier, solutions])
                images = jnp.concatenate([earlier_images, images])
            if self.stage_start in ("stages", "previous"):
                x0, r0 = galerkin_start(solutions, images, rhs)
            x, converged, n, r = conjugate_gradient(
                matvec,
                rhs,
                rtol=self.cg_rtol,
                atol=floor,
                max_iters=self._cg_iteration_cap(size),
                precondition=precondition,
                x0=x0,
                r0=r0,
            )
            return x, converged, n, rhs - r  # (I/(hγ) − J) x = rhs − r

        return solve, rebuilt, carried

    def init(self, terms, t0, t1, y0, args):
        # CG iterations so far (0 when dense), and the carried preconditioner.
        flat, _ = ravel_pytree(self._split(y0)[0])
        # The linear-solver work so far: CG iterations (Hessian-vector products; 0 when dense)
        # and factorisations (dense Cholesky/LU, or preconditioner builds).
        state = {"iters": jnp.asarray(0, jnp.int32), "factorizations": jnp.asarray(0, jnp.int32)}
        if self.batch_axis is not None:
            state["active"] = jnp.asarray(True)  # still stepping (`batch_axis`)
        size = flat.shape[0]
        if self._uses_cg(size) and self.preconditioner is not None:
            state["structured"] = self.preconditioner.init(y0, args)
            state["rebuild"] = jnp.asarray(True)
            state["excess"] = jnp.asarray(0, jnp.int32)
            state["baseline"] = jnp.asarray(0, jnp.int32)
        elif self._uses_cg(size) and self.preconditioner_rank > 0:
            rank = min(self.preconditioner_rank, size)
            state["u"] = jnp.zeros((size, rank), flat.dtype)
            state["omega"] = jax.random.normal(jax.random.key(0), (size, rank), flat.dtype)
            state["lam"] = jnp.zeros((rank,), flat.dtype)
            state["age"] = jnp.asarray(self.preconditioner_refresh, jnp.int32)
        if self._uses_cg(size) and self.stage_start == "previous":
            state["previous"] = jnp.zeros((size, TABLEAUS[self.tableau].stages), flat.dtype)
        if self._uses_cg(size) and self._falls_back(size):
            state["dense_hold"] = jnp.asarray(0, jnp.int32)  # steps to stay dense
            # vector-field evaluations of stages solved again densely after a failed CG
            state["redone_stages"] = jnp.asarray(0, jnp.int32)
        return state

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)

    # One method on purpose (~90 lines): a tableau's stages share one factorisation or
    # preconditioner, and run as one loop over its rows (`stage_loop`).
    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del made_jump
        tableau = TABLEAUS[self.tableau]
        a_, c_, m_, rows_ = tableau.a, tableau.c, tableau.m, tableau.dense
        active0, passive0 = self._split(y0)
        flat0, unravel = ravel_pytree(active0)
        passive_flat0, unravel_passive = ravel_pytree(passive0)
        size = flat0.shape[0]

        def f(flat):
            # Rates of (active, passive) entries; passive values never enter a rate.
            dy = terms.vf(t0, {**unravel(flat), **passive0} if passive0 else unravel(flat), args)
            active, passive = self._split(dy)
            return ravel_pytree(active)[0], ravel_pytree(passive)[0]

        h = t1 - t0
        shift = 1.0 / (h * tableau.gamma)
        (f0, g0), jvp_both = jax.linearize(f, flat0)
        jvp = lambda v: jvp_both(v)[0]
        new_state = dict(solver_state)

        def dense_solver():
            if self.jacobian is None:
                jac = jax.vmap(jvp, out_axes=1)(jnp.eye(size, dtype=flat0.dtype))
            else:
                jac = self.jacobian(t0, y0, args)
            matrix = shift * jnp.eye(size, dtype=flat0.dtype) - jac
            if self.symmetric:
                factor = (jnp.linalg.cholesky(matrix), True)
                dense_solve = jax.scipy.linalg.cho_solve
            else:
                factor = jax.scipy.linalg.lu_factor(matrix)
                dense_solve = jax.scipy.linalg.lu_solve

            def solve(rhs, solutions, images):
                x = dense_solve(factor, rhs)
                return x, jnp.all(jnp.isfinite(x)), jnp.asarray(0), rhs

            return solve

        # The first stage (its rate is f0), then the others as one loop (`stage_loop`: its
        # body, the vector field and the solve, compiled once), their solutions as rows K
        # (zero rows for those still to come): row i of the tableau's a and c has a_ij, c_ij
        # for j < i only.
        stage_count = tableau.stages
        a_rows = jnp.asarray(_lower_rows(a_, stage_count), flat0.dtype)
        c_rows = jnp.asarray(_lower_rows(c_, stage_count), flat0.dtype) / h
        # Σ_j w_j·K_j term by term in j's order, for the stages, the solution and the dense
        # output: the same sums in every program the step is part of (the zero weights of
        # stages still to come add exactly nothing)
        weighted = lambda weights, kk: functools.reduce(
            operator.add, (w * k for w, k in zip(weights, kk, strict=False))
        )

        def stages(solve):
            """The stage solutions (and their passive rows), whether every solve succeeded,
            and the CG iterations spent."""

            def stage(i, carry, first=False):
                ks, kps, images, ok, iters = carry
                a_row, c_row = a_rows[i], c_rows[i]
                fi, gi = (f0, g0) if first else f(flat0 + weighted(a_row, ks))
                k, good, n, image = solve(fi + weighted(c_row, ks), ks, images)
                if passive0:
                    # Passive rows: K_p/(hγ) − (∂f_p/∂y_a) K_a = rhs_p.
                    kps = kps.at[i].set((gi + weighted(c_row, kps) + jvp_both(k)[1]) / shift)
                ok = ok & good
                iters = iters + jnp.asarray(n, jnp.int32)
                return ks.at[i].set(k), kps, images.at[i].set(image), ok, iters

            zeros = jnp.zeros((stage_count, size), flat0.dtype)
            kps = jnp.zeros((stage_count, passive_flat0.shape[0]), flat0.dtype)
            start = (zeros, kps, zeros, jnp.asarray(True), jnp.asarray(0, jnp.int32))
            start = stage(0, start, first=True)
            ks, kps, _, ok, iters = stage_loop(stage, start, 1, stage_count)
            return list(ks), list(kps), ok, iters

        rebuilt = jnp.asarray(0, jnp.int32)  # the structured preconditioner, this step
        if not self._uses_cg(size):
            ks, kps, ok, iters = stages(dense_solver())
            factorized = jnp.asarray(1, jnp.int32)
        else:
            cg_solve, rebuilt, carried = self._cg_solver(
                jvp, shift, flat0, unravel, y0, args, solver_state
            )
            new_state |= carried
            factorized = jnp.asarray(0, jnp.int32)
            if not self._falls_back(size):
                ks, kps, ok, iters = stages(cg_solve)
            else:
                # CG capped at about a dense factorisation's cost; where it fails, the step is
                # solved densely, and the next `fallback_hold` steps stay dense.
                hold = solver_state["dense_hold"]
                use_dense = self._holds_dense(solver_state)
                # Each branch traced once (compile time): CG unless holding dense, then dense
                # where CG was skipped or failed. A failed CG's iterations still count.
                skipped = lambda: jax.tree_util.tree_map(
                    lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(lambda: stages(cg_solve))
                )
                ks, kps, ok, iters = jax.lax.cond(use_dense, skipped, lambda: stages(cg_solve))
                failed = self._any_member(~ok & ~use_dense, solver_state)
                dense_now = use_dense | failed
                ks, kps, ok, _ = jax.lax.cond(
                    dense_now, lambda: stages(dense_solver()), lambda: (ks, kps, ok, iters)
                )
                factorized = dense_now.astype(jnp.int32)
                new_hold = jnp.where(failed, self.fallback_hold, jnp.maximum(hold - 1, 0))
                new_state["dense_hold"] = new_hold.astype(jnp.int32)
                redone = (tableau.stages - 1) * failed.astype(jnp.int32)
                new_state["redone_stages"] = solver_state["redone_stages"] + redone

        y1 = unravel(flat0 + weighted(m_, ks))
        y_error = unravel(jnp.where(ok, ks[-1], jnp.inf))
        if passive0:
            p1 = unravel_passive(passive_flat0 + weighted(m_, kps))
            y1 = {**y1, **p1}
            y_error = {**y_error, **unravel_passive(jnp.where(ok, kps[-1], jnp.inf))}
        ks_dense = tuple(unravel(weighted(row, ks)) for row in rows_)
        if passive0:
            ks_dense = tuple(
                {**k, **unravel_passive(weighted(row, kps))}
                for k, row in zip(ks_dense, rows_, strict=True)
            )
        dense_info = dict(y0=y0, y1=y1, ks=ks_dense)
        result = diffrax.RESULTS.successful
        if "previous" in solver_state:
            new_state["previous"] = jnp.stack(ks, axis=1)
        new_state["iters"] = solver_state["iters"] + iters.astype(jnp.int32)
        new_state["factorizations"] = solver_state["factorizations"] + rebuilt + factorized
        if "rebuild" in solver_state:
            # Staleness is what a rebuild cures: count iterations beyond those of the first
            # step after the last build (the residual term's share, which no rebuild removes).
            baseline = jnp.where(rebuilt > 0, iters, solver_state["baseline"]).astype(jnp.int32)
            excess = jnp.where(rebuilt > 0, 0, solver_state["excess"])
            excess = excess + jnp.maximum(iters - baseline, 0).astype(jnp.int32)
            new_state["excess"] = excess
            new_state["baseline"] = baseline
            new_state["rebuild"] = excess > self.preconditioner.refresh_budget
        return y1, y_error, dense_info, new_state, result
