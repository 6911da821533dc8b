"""Closed forms and implicit equations for the identity family on block-diagonal problems
(docs/theory.md §2–§6), computed robustly in log space with NumPy float64.

Family: d = n·s, observed = the n diagonal s×s blocks of X* = w·J, every layer
W_l(0) = α((1 − 1/m) I + (1/m) J). Every layer stays equal and in span{I, B, J}; its eigenvalues
λ_A (on **1**), λ_B (block-constant zero-sum, multiplicity n − 1) and λ_C (within-block
zero-sum, multiplicity n(s − 1)) follow three scalar ODEs, and σ_k = λ_k^L.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FamilyLimit:
    """Predicted t → ∞ singular values of the family (arrays broadcast over the inputs).

    `sigma_a` (multiplicity 1) and `log_sigma_b` (multiplicity n − 1); `sigma_b` is
    `exp(log_sigma_b)` and may underflow to 0 where the log does not. The n(s − 1) within-block
    values tend to 0 (algebraically slowly: see `sigma_c_at`).
    """

    sigma_a: np.ndarray
    log_sigma_b: np.ndarray
    n: int
    s: int

    @property
    def sigma_b(self) -> np.ndarray:
        return np.exp(self.log_sigma_b)

    @property
    def stable_rank(self) -> np.ndarray:
        """1 + (n − 1)(σ_B/σ_A)² (the within-block values are 0 in the limit)."""
        return 1.0 + (self.n - 1) * np.exp(2 * (self.log_sigma_b - np.log(self.sigma_a)))


def _validate(depth, n, s, alpha, m, w):
    if not isinstance(depth, int | np.integer) or depth < 2:
        raise ValueError(f"the family limit needs depth L >= 2, got {depth!r}")
    for name, v in (("n", n), ("s", s)):
        if not isinstance(v, int | np.integer) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    alpha, m, w = (np.asarray(x, dtype=np.float64) for x in (alpha, m, w))
    if not np.all(np.isfinite(alpha) & (alpha > 0)):
        raise ValueError("alpha must be finite and > 0")
    if not np.all(m > 1):
        raise ValueError("m must be > 1 (inf allowed)")
    if not np.all(np.isfinite(w) & (w > 0)):
        raise ValueError("w (the target value) must be finite and > 0")
    return alpha, m, w


def family_constants(n: int, s: int, m):
    """c_A = 1 + (d − 1)/m and c_B = 1 − 1/m: λ_A(0) = α c_A, λ_B(0) = λ_C(0) = α c_B."""
    m = np.asarray(m, dtype=np.float64)
    d = n * s
    return 1.0 + (d - 1) / m, 1.0 - 1.0 / m


def family_limit(depth: int, n: int, s: int, alpha, m=math.inf, w=1.0) -> FamilyLimit:
    """The t → ∞ singular values σ_A and σ_B of the family (docs/theory.md §2 item 4, §3).

    Robust for α down to 1e-8, L up to 10 and beyond, m from just above 1 to ∞ (σ_B is returned
    as a log, so it cannot underflow). Accurate to ~1e-14 relative.
    """
    alpha, m, w = _validate(depth, n, s, alpha, m, w)
    alpha, m, w = np.broadcast_arrays(alpha, m, w)
    d = n * s
    c_b = 1.0 - 1.0 / m
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_minus_one = np.where(np.isinf(m), 0.0, (d / m) / c_b)  # c_A/c_B − 1
    sigma_a = np.empty(alpha.shape)
    log_sigma_b = np.empty(alpha.shape)

    inf_m = np.isinf(m)
    sigma_a[inf_m] = s * w[inf_m]
    log_sigma_b[inf_m] = np.log(s * w[inf_m])
    rest = ~inf_m
    if depth == 2:
        rho2 = np.exp(2 * np.log1p(ratio_minus_one[rest]))
        sb = d * w[rest] / (rho2 + n - 1)
        sigma_a[rest] = d * w[rest] - (n - 1) * sb
        log_sigma_b[rest] = np.log(sb)
    elif rest.any():
        q = depth - 2
        p = q / depth
        a, cb, r1, ww = alpha[rest], c_b[rest], ratio_minus_one[rest], w[rest]
        log_k = -q * np.log(a) - q * np.log(cb) + np.log(-np.expm1(-q * np.log1p(r1)))

        def log_sb(sa):
            return -np.logaddexp(-p * np.log(sa), log_k) / p

        sa = d * ww
        for _ in range(100):
            lsb = log_sb(sa)
            phi = sa + (n - 1) * np.exp(lsb) - d * ww
            dphi = 1.0 + (n - 1) * np.exp((p + 1) * (lsb - np.log(sa)))
            new = np.maximum(sa - phi / dphi, s * ww)
            done = np.all(np.abs(new - sa) <= 1e-16 * sa)
            sa = new
            if done:
                break
        sigma_a[rest] = sa
        log_sigma_b[rest] = log_sb(sa)
    return FamilyLimit(sigma_a, log_sigma_b, n, s)


def log_lambda_c_at(depth: int, n: int, s: int, alpha, m, t):
    """ln λ_C(t) = −ln(λ_C(0)^{−(2L−2)} + (2L−2)t)/(2L−2), exact (docs/theory.md §2 item 3)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    _, c_b = family_constants(n, s, m)
    k = 2 * depth - 2
    t = np.asarray(t, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return -np.logaddexp(-k * np.log(alpha * c_b), np.log(k * t)) / k


def sigma_c_at(depth: int, n: int, s: int, alpha, m, t):
    """σ_C(t) = λ_C(t)^L, the n(s − 1) within-block singular values at time t."""
    return np.exp(depth * log_lambda_c_at(depth, n, s, alpha, m, t))


def escape_time(depth: int, n: int, s: int, alpha, m=math.inf, w=1.0):
    """Leading-order time at which λ_A leaves its plateau (docs/theory.md §5)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    c_a, _ = family_constants(n, s, m)
    if depth == 2:
        return np.log(1.0 / (alpha * c_a)) / (s * w)
    if depth < 2:
        raise ValueError("escape_time needs depth >= 2")
    return (alpha * c_a) ** (-(depth - 2)) / ((depth - 2) * s * w)


def family_invariant(depth: int, lam_a, lam_b):
    """λ_A^{−(L−2)} − λ_B^{−(L−2)} for L ≥ 3, λ_A/λ_B for L = 2: constant along the flow."""
    lam_a, lam_b = np.asarray(lam_a), np.asarray(lam_b)
    if depth == 2:
        return lam_a / lam_b
    q = depth - 2
    return lam_a ** (-q) - lam_b ** (-q)


def reduced_rhs(depth: int, n: int, s: int, w: float):
    """The 3-scalar ODE (λ_A, λ_B, λ_C)' of docs/theory.md §2, as a function f(t, λ) → λ'."""
    import jax.numpy as jnp

    def f(t, lam, args=None):
        la, lb, lc = lam[0], lam[1], lam[2]
        r = (la**depth + (n - 1) * lb**depth) / n - s * w
        return jnp.stack(
            [-(la ** (depth - 1)) * r, -(lb ** (depth - 1)) * r, -(lc ** (2 * depth - 1))]
        )

    return f


def reduced_flow(depth: int, n: int, s: int, alpha, m, w, ts, *, rtol=1e-13, atol=1e-300):
    """Integrate the reduced ODE with Dopri8 and return λ_A, λ_B, λ_C at times `ts`.

    An independent, cheap integrator for checking the full engine on moderate time spans.
    """
    import diffrax
    import jax.numpy as jnp

    c_a, c_b = family_constants(n, s, m)
    lam0 = jnp.asarray([alpha * c_a, alpha * c_b, alpha * c_b], dtype=jnp.float64)
    ts = jnp.asarray(ts, dtype=jnp.float64)
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(reduced_rhs(depth, n, s, w)),
        diffrax.Dopri8(),
        t0=0.0,
        t1=float(ts[-1]),
        dt0=None,
        y0=lam0,
        saveat=diffrax.SaveAt(ts=ts),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        max_steps=1_000_000,
    )
    return np.asarray(sol.ys)


def reduced_loss(depth: int, n: int, s: int, w: float, lam):
    """½ n r² + ½ n(s − 1) σ_C² from (λ_A, λ_B, λ_C)."""
    lam = np.asarray(lam)
    la, lb, lc = lam[..., 0], lam[..., 1], lam[..., 2]
    r = (la**depth + (n - 1) * lb**depth) / n - s * w
    return 0.5 * n * r**2 + 0.5 * n * (s - 1) * lc ** (2 * depth)


def diagonal_l2_limit(w2, w1, targets):
    """Closed-form t → ∞ end-to-end matrix of a depth-2 flow on diagonal observations
    (docs/theory.md §6), for any init (W₂, W₁ square) and any nonzero targets w_i (either sign).

    Row i of W₂ and column i of W₁ evolve alone: with P = u_i + v_i, Q = u_i − v_i,
    E_i = (−2w_i + √(4w_i² + |Q|²|P|²))/|Q|², u_i(∞) = (P/√E_i + Q√E_i)/2 and
    v_i(∞) = (P/√E_i − Q√E_i)/2.
    """
    w2, w1 = np.asarray(w2, dtype=np.float64), np.asarray(w1, dtype=np.float64)
    targets = np.asarray(targets, dtype=np.float64)
    d = targets.shape[0]
    if w2.shape[0] != d or w1.shape[1] != d:
        raise ValueError("W₂ must have d rows and W₁ d columns, d = len(targets)")
    u_inf = np.empty_like(w2)
    v_inf = np.empty_like(w1)
    for i in range(d):
        u, v = w2[i], w1[:, i]
        p, q = u + v, u - v
        q2, p2 = q @ q, p @ p
        if q2 == 0:
            if targets[i] <= 0:
                raise ValueError(f"target {i} must be > 0 when u_i(0) = v_i(0)")
            e = p2 / (4 * targets[i])
        else:
            e = (-2 * targets[i] + math.sqrt(4 * targets[i] ** 2 + q2 * p2)) / q2
        u_inf[i] = (p / math.sqrt(e) + q * math.sqrt(e)) / 2
        v_inf[:, i] = (p / math.sqrt(e) - q * math.sqrt(e)) / 2
    return u_inf @ v_inf


def family_prediction(depth: int, n: int, s: int, alpha, m=math.inf, w=1.0, *, t=math.inf):
    """Everything the theory predicts for one family configuration, as a JSON-ready dict.

    σ_A (×1) and σ_B (×(n − 1)) at t → ∞; σ_C(t) (×n(s − 1)) at time `t` (0 at t = ∞);
    the stable and effective rank built from them; the escape-time estimate.
    """
    from ._measures import family_ranks

    lim = family_limit(depth, n, s, alpha, m, w)
    sigma_a, log_sigma_b = float(lim.sigma_a), float(lim.log_sigma_b)
    if s > 1 and math.isfinite(t):
        log_sigma_c = float(depth * log_lambda_c_at(depth, n, s, alpha, m, t))
    else:
        log_sigma_c = -math.inf
    srank, erank = family_ranks(sigma_a, math.exp(log_sigma_b), math.exp(log_sigma_c), n, s)
    return {
        "sigma_a": sigma_a,
        "sigma_b": math.exp(log_sigma_b),
        "log_sigma_b": log_sigma_b,
        "sigma_c": math.exp(log_sigma_c),
        "log_sigma_c": log_sigma_c,
        "multiplicities": {"a": 1, "b": n - 1, "c": n * (s - 1)},
        "stable_rank": srank,
        "effective_rank": erank,
        "escape_time": float(escape_time(depth, n, s, alpha, m, w)),
        "t": t,
    }
