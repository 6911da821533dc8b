"""Accuracy certificates: quantities the exact flow conserves (docs/theory.md §9)."""

from __future__ import annotations

import numpy as np

from ..engine._result import FlowResult
from ..model import Factorization
from ..problem import Problem


def balancedness(model: Factorization) -> list[np.ndarray]:
    """D_l = W_{l+1}ᵀW_{l+1} − W_l W_lᵀ for l = 1 … L−1, conserved by gradient flow on any
    problem."""
    ws = [np.asarray(w, dtype=np.float64) for w in model.layers]
    return [ws[i + 1].T @ ws[i + 1] - ws[i] @ ws[i].T for i in range(len(ws) - 1)]


def balancedness_drift(start: Factorization, end: Factorization) -> float:
    """max_l ‖D_l(end) − D_l(start)‖_F relative to the size of the terms that make D_l(end)."""
    ws = [np.asarray(w, dtype=np.float64) for w in end.layers]
    worst = 0.0
    for i, (d0, d1) in enumerate(zip(balancedness(start), balancedness(end), strict=True)):
        scale = np.linalg.norm(ws[i + 1].T @ ws[i + 1]) + np.linalg.norm(ws[i] @ ws[i].T)
        worst = max(worst, float(np.linalg.norm(d1 - d0) / max(scale, np.finfo(float).tiny)))
    return worst


def energy_residual(result: FlowResult) -> float:
    """|loss(0) − loss(t) − ∫‖∇loss‖² dt| / loss(0); nan when the energy was not carried."""
    loss0 = float(result.loss_init)
    return abs(loss0 - float(result.loss) - float(result.energy)) / loss0


def certificates(result: FlowResult, start: Factorization, problem: Problem) -> dict:
    """Balancedness drift and energy residual of one flow result (both ≈ tolerance when the
    integration is faithful)."""
    del problem
    return {
        "balancedness_drift": balancedness_drift(start, result.model),
        "energy_residual": energy_residual(result),
    }
