"""Loss of plasticity: pretrain on Ω₁, resume on Ω₂ ⊇ Ω₁ from the pretrained weights (warm),
and compare with a fresh start on Ω₂ from the original initialisation (cold).

A depth-2 model pretrained on disconnected observations converges fast to a high-rank solution
and, resumed with more data, barely moves (lazy training): it keeps the high rank and can get
the unobserved entries wrong, even in sign (docs/theory.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..analysis._coupling import coupling, trajectory_coupling, trajectory_models
from ..analysis._measures import effective_rank, singular_values, stable_rank, unobserved_error
from ..descent import DescentOptions, descend
from ..engine import FlowOptions, flow
from ..engine._result import FlowResult
from ..model import Factorization
from ..problem import Problem


def _flat(model: Factorization) -> np.ndarray:
    return np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in model.layers])


@dataclass
class PhaseReport:
    """Metrics of one phase (pretrain, warm resume or cold start)."""

    status: str
    t_end: float
    loss: float
    singular_values: list[float]
    stable_rank: float
    effective_rank: float
    unobserved_error: dict
    unobserved_values: dict
    parameter_norm: float
    distance_travelled: float
    coupling: str
    groups: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PlasticityResult:
    """Pretrain → warm resume vs cold start. `warm`, `cold` and `pretrain` are `PhaseReport`s;
    the models are kept for further analysis."""

    pretrain: PhaseReport
    warm: PhaseReport
    cold: PhaseReport
    models: dict = field(repr=False, default_factory=dict)

    def as_dict(self) -> dict:
        return {k: getattr(self, k).as_dict() for k in ("pretrain", "warm", "cold")}


def _run(problem, init, method):
    if isinstance(method, DescentOptions):
        return descend(problem, init, method)
    return flow(problem, init, method)


def _phase(
    result: FlowResult,
    start: Factorization,
    problem: Problem,
    truth: Problem,
    judge_trajectory: bool,
) -> PhaseReport:
    model = result.model
    off = np.argwhere(np.asarray(truth.mask) == 0)
    x = np.asarray(model.product())
    if judge_trajectory and result.trajectory is not None and result.trajectory.layers is not None:
        report = trajectory_coupling(
            [start] + trajectory_models(result.trajectory) + [model], problem
        )
    else:
        report = coupling(start, problem)
    w_end, w_start = _flat(model), _flat(start)
    return PhaseReport(
        status=result.status_label,
        t_end=float(result.t_end),
        loss=float(result.loss),
        singular_values=[float(s) for s in singular_values(model)],
        stable_rank=stable_rank(model),
        effective_rank=effective_rank(model),
        unobserved_error=unobserved_error(model, truth),
        unobserved_values={f"{i},{j}": float(x[i, j]) for i, j in off[:16]},
        parameter_norm=float(np.linalg.norm(w_end)),
        distance_travelled=float(np.linalg.norm(w_end - w_start) / np.linalg.norm(w_start)),
        coupling=report.verdict,
        groups=len(report.groups),
    )


def plasticity(
    problem: Problem,
    pretrain_mask,
    init: Factorization,
    method: FlowOptions | DescentOptions | None = None,
    *,
    judge_trajectory: bool = True,
) -> PlasticityResult:
    """Pretrain on `pretrain_mask` (Ω₁), then resume on `problem.mask` (Ω₂ ⊇ Ω₁) warm, and
    start cold on Ω₂ from `init`.

    **Arguments:**

    - `problem`: the target and the resume mask Ω₂ (its unobserved entries are scored).
    - `pretrain_mask`: Ω₁, a 0/1 matrix contained in Ω₂.
    - `init`: the initialisation of the pretraining and of the cold start.
    - `method`: `FlowOptions` (default: the exact flow) or `DescentOptions` (an optax optimizer).
    - `judge_trajectory`: judge coupling over the whole trajectory (saves layers along the way),
      not only at the phase's start.

    **Returns:** a `PlasticityResult`. "Distance travelled" is ‖θ_end − θ_start‖/‖θ_start‖ over
    all layers (docs/theory.md §7's ‖ΔW‖/‖W‖): small after a warm start is the lazy-training
    signature; a cold start from a small init travels ≫ 1.
    """
    mask1 = np.asarray(pretrain_mask, dtype=np.float64)
    mask2 = np.asarray(problem.mask, dtype=np.float64)
    if mask1.shape != mask2.shape:
        raise ValueError(f"pretrain mask shape {mask1.shape} differs from {mask2.shape}")
    if np.any(mask1 > mask2):
        raise ValueError("the pretraining mask Ω₁ must be contained in the resume mask Ω₂")
    method = method or FlowOptions()
    if judge_trajectory and isinstance(method, FlowOptions) and not method.save_layers:
        import dataclasses

        method = dataclasses.replace(method, save=max(method.save, 12), save_layers=True)
    pre_problem = problem.with_mask(mask1)
    pre = _run(pre_problem, init, method)
    warm = _run(problem, pre.model, method)
    cold = _run(problem, init, method)
    return PlasticityResult(
        pretrain=_phase(pre, init, pre_problem, problem, judge_trajectory),
        warm=_phase(warm, pre.model, problem, problem, judge_trajectory),
        cold=_phase(cold, init, problem, problem, judge_trajectory),
        models={"init": init, "pretrain": pre.model, "warm": warm.model, "cold": cold.model},
    )


# --- the studies of docs/theory.md §7 -----------------------------------------------------------


def two_by_two_problem(value: float = 1.0) -> tuple[Problem, np.ndarray]:
    """X* = w·J (2×2); Ω₂ = {(1,1), (1,2), (2,2)} (X₂₁ unobserved); Ω₁ = the diagonal."""
    target = np.full((2, 2), float(value))
    resume_mask = np.array([[1.0, 1.0], [0.0, 1.0]])
    return Problem(target, resume_mask), np.eye(2)


def two_by_two_warm_curve(depth: int, ms, alpha: float = 0.1, value: float = 1.0) -> np.ndarray:
    """The unobserved X₂₁ after the warm start of the 2×2 study, for each init shape m of the
    pretraining (docs/theory.md §7: for depth 2 it changes sign at m* ≈ 49.99). NaN where the
    pretraining or the warm start did not converge: that value would not be an endpoint."""
    from ..inits import identity_family

    problem, pretrain_mask = two_by_two_problem(value)
    values = []
    for m in ms:
        r = plasticity(
            problem, pretrain_mask, identity_family(2, depth, alpha, m), judge_trajectory=False
        )
        reached = r.pretrain.status == "converged" and r.warm.status == "converged"
        values.append(r.warm.unobserved_values["1,0"] if reached else np.nan)
    return np.array(values)


def connected_superset_mask(d: int, extra: int, key) -> np.ndarray:
    """The diagonal plus `extra` random off-diagonal entries, redrawn until the bipartite graph
    of rows and columns is connected (so the resumed problem is connected; d − 1 ≤ extra)."""
    import jax

    from ..analysis._coupling import bipartite_components

    if extra < d - 1:
        raise ValueError(f"need at least d − 1 = {d - 1} extra entries to connect {d} rows")
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel())
    off = [(i, j) for i in range(d) for j in range(d) if i != j]
    for _ in range(1000):
        mask = np.eye(d)
        for k in rng.choice(len(off), size=extra, replace=False):
            mask[off[k]] = 1.0
        if len(bipartite_components(Problem(np.zeros((d, d)), mask))) == 1:
            return mask
    raise RuntimeError("could not draw a connected mask; raise `extra`")


def dxd_problem(d: int, *, rank: int = 1, extra: int | None = None, seed: int = 0):
    """The resumed problem of `dxd_study` (truth J, or a random rank-`rank` matrix; Ω₂ = the
    diagonal + `extra` random entries, connected) and the key its Gaussian inits use."""
    import jax

    from ..problem import bernoulli

    k_truth, k_mask, k_init = jax.random.split(jax.random.key(seed), 3)
    if rank == 1:  # the paper's truth, X* = J
        truth = Problem(np.ones((d, d)), np.ones((d, d)))
    else:
        truth = bernoulli(d, d, 1.0, rank, k_truth)
    mask2 = connected_superset_mask(d, extra if extra is not None else 2 * d, k_mask)
    return truth.with_mask(mask2), k_init


def dxd_study(
    d: int = 12,
    depths=(2, 3, 4, 5),
    alphas=(0.1, 0.01),
    *,
    rank: int = 1,
    extra: int | None = None,
    seed: int = 0,
    init: str = "identity",
    m: float = 4.0,
    method: FlowOptions | DescentOptions | None = None,
) -> list[dict]:
    """Warm vs cold across depths and α on a d×d problem: truth J (rank 1, as in the paper) or a
    random rank-`rank` matrix, Ω₁ = diagonal
    (disconnected), Ω₂ = diagonal + `extra` random entries making the bipartite graph connected.

    `init` is `identity` (αF_m, coupled pretraining for L ≥ 3 when m < ∞) or `gaussian`.
    Returns one row per (depth, α) with both phases' stable rank, unobserved error and distance
    travelled.
    """
    from ..inits import gaussian, identity_family

    problem, k_init = dxd_problem(d, rank=rank, extra=extra, seed=seed)
    rows = []
    for depth in depths:
        for alpha in alphas:
            if init == "identity":
                start = identity_family(d, depth, alpha, m)
            else:
                start = gaussian([d] * (depth + 1), alpha, k_init)
            r = plasticity(problem, np.eye(d), start, method, judge_trajectory=False)
            rows.append(
                {
                    "L": depth,
                    "alpha": alpha,
                    "pretrain_coupling": r.pretrain.coupling,
                    "pretrain_stable_rank": r.pretrain.stable_rank,
                    "warm_stable_rank": r.warm.stable_rank,
                    "cold_stable_rank": r.cold.stable_rank,
                    "warm_unobserved_rel": r.warm.unobserved_error["rel"],
                    "cold_unobserved_rel": r.cold.unobserved_error["rel"],
                    "warm_distance": r.warm.distance_travelled,
                    "cold_distance": r.cold.distance_travelled,
                    "pretrain_status": r.pretrain.status,
                    "warm_status": r.warm.status,
                    "cold_status": r.cold.status,
                }
            )
    return rows
