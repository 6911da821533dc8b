"""The paper's studies on top of the core: loss of plasticity, and `reproduce`, which regenerates
the paper's claims as a report (`gflow reproduce`)."""

from ._plasticity import PlasticityResult as PlasticityResult
from ._plasticity import connected_superset_mask as connected_superset_mask
from ._plasticity import dxd_study as dxd_study
from ._plasticity import plasticity as plasticity
from ._plasticity import two_by_two_problem as two_by_two_problem
from ._plasticity import two_by_two_warm_curve as two_by_two_warm_curve
from ._reproduce import reproduce as reproduce

__all__ = [
    "PlasticityResult",
    "connected_superset_mask",
    "dxd_study",
    "plasticity",
    "reproduce",
    "two_by_two_problem",
    "two_by_two_warm_curve",
]
