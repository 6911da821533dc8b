"""Coupling diagnostic (docs/theory.md §10): which observations move each other under the flow.

Along the flow the observed entries obey Ẋ_Ω = −Θ r_Ω with the per-observation gradient Gram
matrix (the NTK on Ω)

    Θ[o, o'] = Σ_l (A_l A_lᵀ)[i_o, i_o'] · (B_lᵀ B_l)[j_o, j_o'],
    A_l = W_L ⋯ W_{l+1},  B_l = W_{l−1} ⋯ W_1.

Observations in different connected components of the graph {C[o, o'] > τ}, with the cosine
C = |Θ|/√(diag ⊗ diag), evolve independently: the dynamics are *decoupled*.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import Factorization, partial_products
from ..problem import Problem

DEFAULT_TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-5}


def observations(problem: Problem) -> np.ndarray:
    """The observed (row, column) pairs, shape (|Ω|, 2), in row-major order."""
    return np.argwhere(np.asarray(problem.mask) == 1)


def gram(model: Factorization, problem: Problem) -> np.ndarray:
    """Θ restricted to Ω, in closed form: O(L d³ + L |Ω|²), no autodiff loop."""
    layers = [np.asarray(w, dtype=np.float64) for w in model.layers]
    obs = observations(problem)
    rows, cols = obs[:, 0], obs[:, 1]
    depth = len(layers)
    prefix, suffix = partial_products(layers)  # B_l = W_{l-1} ⋯ W_1, A_l = W_L ⋯ W_{l+1}
    theta = np.zeros((len(obs), len(obs)))
    for l_idx in range(depth):
        a, b = suffix[l_idx], prefix[l_idx]
        p = (a @ a.T)[np.ix_(rows, rows)]
        q = (b.T @ b)[np.ix_(cols, cols)]
        theta += p * q
    return theta


def cosine(theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C = |Θ|/√(Θ_oo Θ_o'o'), and a mask of observations with Θ_oo = 0 (e.g. at W = 0), which
    are treated as singletons (their cosine row is 0)."""
    diag = np.diag(theta).copy()
    dead = diag <= 0
    norm = np.sqrt(np.where(dead, 1.0, diag))
    c = np.abs(theta) / np.outer(norm, norm)
    c[dead, :] = 0.0
    c[:, dead] = 0.0
    np.fill_diagonal(c, 1.0)
    return c, dead


def components(adjacency: np.ndarray) -> list[list[int]]:
    """Connected components of an undirected graph given by a boolean adjacency matrix."""
    n = adjacency.shape[0]
    label = -np.ones(n, dtype=int)
    groups = []
    for start in range(n):
        if label[start] >= 0:
            continue
        stack, members = [start], []
        label[start] = len(groups)
        while stack:
            node = stack.pop()
            members.append(node)
            for nxt in np.flatnonzero(adjacency[node] & (label < 0)):
                label[nxt] = len(groups)
                stack.append(nxt)
        groups.append(sorted(members))
    return groups


@dataclass
class CouplingReport:
    """The verdict of the coupling diagnostic.

    - `groups`: the partition of Ω, each group a list of (row, column) observations.
    - `coupled`: True when Ω forms one group (the dynamics cannot be split).
    - `max_cosine_between_groups`: the largest cosine across groups (≤ τ by construction).
    - `max_cross_cosine`: for a `reference` partition (e.g. the blocks), the largest cosine
      across its parts (nan without one).
    - `flagged`: observations whose Θ_oo = 0 (treated as singletons).
    """

    groups: list[list[tuple[int, int]]]
    tolerance: float
    max_cosine_between_groups: float
    max_cross_cosine: float = float("nan")
    flagged: list[tuple[int, int]] = field(default_factory=list)

    @property
    def coupled(self) -> bool:
        return len(self.groups) == 1

    @property
    def verdict(self) -> str:
        return "coupled" if self.coupled else f"decoupled ({len(self.groups)} groups)"


def _report(c, dead, obs, tolerance, reference):
    adjacency = c > tolerance
    parts = components(adjacency)
    label = np.empty(len(obs), dtype=int)
    for k, members in enumerate(parts):
        label[members] = k
    across = label[:, None] != label[None, :]
    max_between = float(c[across].max()) if across.any() else 0.0
    max_cross = float("nan")
    if reference is not None:
        ref = np.asarray([reference(int(i), int(j)) for i, j in obs])
        cross = ref[:, None] != ref[None, :]
        max_cross = float(c[cross].max()) if cross.any() else 0.0
    to_pairs = lambda idx: [(int(obs[k, 0]), int(obs[k, 1])) for k in idx]
    return CouplingReport(
        groups=[to_pairs(members) for members in parts],
        tolerance=tolerance,
        max_cosine_between_groups=max_between,
        max_cross_cosine=max_cross,
        flagged=to_pairs(np.flatnonzero(dead)),
    )


def coupling(model: Factorization, problem: Problem, *, tolerance=None, reference=None):
    """Snapshot partition of Ω at the weights of `model`.

    `tolerance` τ defaults to 1e-10 in float64 (1e-5 in float32): structural zeros of Θ come
    out as exactly 0.0, coupled entries are O(1/m). `reference(i, j) -> label` names a partition
    (e.g. `lambda i, j: i // s` for blocks) whose largest cross-part cosine is reported.
    """
    tolerance = _tolerance(model, tolerance)
    c, dead = cosine(gram(model, problem))
    return _report(c, dead, observations(problem), tolerance, reference)


def trajectory_coupling(models, problem: Problem, *, tolerance=None, reference=None):
    """Partition of Ω from the union of the coupling graphs over all sampled weights.

    This is the "for all t" definition: a snapshot can be diagonal (at a warm start from I, say)
    while the flow that follows is coupled. `models` is an iterable of Factorizations (e.g. the
    layers saved on a trajectory, see `trajectory_models`).
    """
    models = list(models)
    if not models:
        raise ValueError("trajectory_coupling needs at least one sampled model")
    tolerance = _tolerance(models[0], tolerance)
    union = None
    dead_all = None
    for model in models:
        c, dead = cosine(gram(model, problem))
        union = c if union is None else np.maximum(union, c)
        dead_all = dead if dead_all is None else dead_all & dead
    return _report(union, dead_all, observations(problem), tolerance, reference)


def trajectory_models(trajectory) -> list[Factorization]:
    """The Factorizations saved on a (compressed) trajectory with `save_layers=True`."""
    if trajectory.layers is None:
        raise ValueError("the trajectory has no layers: run flow(..., save_layers=True)")
    traj = trajectory.compress()
    stacks = [np.asarray(w) for w in traj.layers.layers]
    return [Factorization([w[k] for w in stacks]) for k in range(len(traj.t))]


def bipartite_components(problem: Problem) -> list[list[tuple[int, int]]]:
    """Observations grouped by the connected components of the bipartite graph (rows ∪
    columns, Ω as edges). For L = 2 the coupling partition refines these, and equals them for
    generic weights."""
    obs = observations(problem)
    shares = (obs[:, None, 0] == obs[None, :, 0]) | (obs[:, None, 1] == obs[None, :, 1])
    return [[(int(obs[k, 0]), int(obs[k, 1])) for k in g] for g in components(shares)]


def _tolerance(model, tolerance):
    if tolerance is not None:
        return float(tolerance)
    return DEFAULT_TOLERANCE.get(np.dtype(model.layers[0].dtype), 1e-10)
