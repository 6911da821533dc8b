"""Measures of an endpoint: spectra, rank measures, completion error, per-mode eigenvalues."""

from __future__ import annotations

import numpy as np

from ..model import Factorization
from ..problem import Problem


def _matrix(x) -> np.ndarray:
    if isinstance(x, Factorization):
        x = x.product()
    return np.asarray(x, dtype=np.float64)


def singular_values(x) -> np.ndarray:
    """Singular values (descending) of a matrix or of a Factorization's product.

    Float64 SVD resolves only σ ≳ 1e-15·σ₁; use `family_spectrum` for smaller ones."""
    return np.linalg.svd(_matrix(x), compute_uv=False)


def stable_rank(x) -> float:
    """‖X‖_F² / ‖X‖₂² = Σσ_i²/σ₁², in [1, rank]."""
    return stable_rank_of(singular_values(x))


def stable_rank_of(sigma) -> float:
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.size == 0 or sigma[0] == 0:
        return float("nan")
    return float(np.sum((sigma / sigma[0]) ** 2))


def stable_rank_excess_of(sigma) -> float:
    """stable rank − 1 = Σ_{i≥2} (σ_i/σ₁)², summed directly: `stable_rank_of(σ) − 1` loses it
    to rounding once it is below ~1e-15. NaN for a zero matrix, like `stable_rank_of`."""
    sigma = np.asarray(sigma, dtype=np.float64)
    if sigma.size == 0 or sigma[0] == 0:
        return float("nan")
    return float(np.sum((sigma[1:] / sigma[0]) ** 2))


def effective_rank(x) -> float:
    """exp(−Σ p_i ln p_i), p_i = σ_i/Σσ_j (Roy & Vetterli 2007); 0·ln 0 = 0, no ε."""
    return effective_rank_of(singular_values(x))


def effective_rank_of(sigma, multiplicity=None) -> float:
    sigma = np.asarray(sigma, dtype=np.float64)
    mult = np.ones_like(sigma) if multiplicity is None else np.asarray(multiplicity, float)
    total = np.sum(mult * sigma)
    if total == 0:
        return float("nan")
    p = sigma / total
    positive = p > 0
    return float(np.exp(-np.sum(mult[positive] * p[positive] * np.log(p[positive]))))


def nuclear_norm(x) -> float:
    return float(np.sum(singular_values(x)))


def unobserved_error(x, problem: Problem) -> dict:
    """Error on the entries the flow never saw, against the problem's ground truth: those off Ω
    whose truth is known (finite; a nan target entry is unknown, as in real data with a
    held-out set).

    Returns `abs` (Frobenius norm of the error there), `rel` (divided by the norm of the truth
    there; nan if that is 0), `max` (largest absolute error) and `count` (how many entries);
    with unobserved entries but none known, the errors are nan.
    """
    x = _matrix(x)
    target = np.asarray(problem.target)
    off = np.asarray(problem.mask) == 0
    known = off & np.isfinite(target)
    if off.any() and not known.any():
        return {"abs": float("nan"), "rel": float("nan"), "max": float("nan"), "count": 0}
    err = (x - target)[known]
    truth = float(np.linalg.norm(target[known]))
    abs_err = float(np.linalg.norm(err))
    return {
        "abs": abs_err,
        "rel": abs_err / truth if truth > 0 else float("nan"),
        "max": float(np.max(np.abs(err))) if err.size else 0.0,
        "count": int(known.sum()),
    }


def family_directions(n: int, s: int) -> dict[str, np.ndarray]:
    """Unit vectors of the three eigenspaces (docs/theory.md §4): A = **1**/√d,
    B = (**1**_s, −**1**_s, 0 …)/√(2s) (needs n ≥ 2), C = (e₁ − e₂)/√2 (needs s ≥ 2)."""
    d = n * s
    out = {"A": np.ones(d) / np.sqrt(d)}
    if n >= 2:
        v = np.zeros(d)
        v[:s], v[s : 2 * s] = 1.0, -1.0
        out["B"] = v / np.sqrt(2 * s)
    if s >= 2:
        v = np.zeros(d)
        v[0], v[1] = 1.0, -1.0
        out["C"] = v / np.sqrt(2)
    return out


def family_eigenvalues(model: Factorization, n: int, s: int) -> dict[str, np.ndarray]:
    """Per-layer eigenvalues λ_k^{(l)} = v_kᵀ W_l v_k, measured by projection (shape (L,))."""
    dirs = family_directions(n, s)
    layers = [np.asarray(w, dtype=np.float64) for w in model.layers]
    return {k: np.array([v @ w @ v for w in layers]) for k, v in dirs.items()}


def family_spectrum(model: Factorization, n: int, s: int) -> dict[str, float]:
    """Singular values σ_k = |Π_l λ_k^{(l)}| of the product, from the layers, with their logs.

    Resolves σ_B far below the SVD's 1e-15·σ₁ floor (at L = 6, α = 1e-4, σ_B ≈ 1.9e-25)."""
    lam = family_eigenvalues(model, n, s)
    out = {}
    for k, vals in lam.items():
        log_sigma = float(np.sum(np.log(np.abs(vals))))
        out[f"log_sigma_{k.lower()}"] = log_sigma
        out[f"sigma_{k.lower()}"] = float(np.exp(log_sigma))
    return out


def family_ranks(sigma_a, sigma_b, sigma_c, n: int, s: int) -> tuple[float, float]:
    """(stable rank, effective rank) from the three family values with their multiplicities."""
    sig = np.array([sigma_a, sigma_b, sigma_c], dtype=np.float64)
    mult = np.array([1, n - 1, n * (s - 1)], dtype=np.float64)
    keep = mult > 0
    sig, mult = sig[keep], mult[keep]
    top = sig.max()
    srank = float(np.sum(mult * (sig / top) ** 2))
    return srank, effective_rank_of(sig, mult)
