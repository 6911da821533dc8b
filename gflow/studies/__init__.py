"""The paper's studies on top of the core: loss of plasticity (one pretrain → warm vs cold
study, and the map of where depth protects plasticity), and `reproduce`, which regenerates the
paper's claims as a report (`gflow reproduce`)."""

from ._plasticity import PlasticityResult as PlasticityResult
from ._plasticity import connected_superset_mask as connected_superset_mask
from ._plasticity import dxd_study as dxd_study
from ._plasticity import plasticity as plasticity
from ._plasticity import two_by_two_problem as two_by_two_problem
from ._plasticity import two_by_two_warm_curve as two_by_two_warm_curve
from ._plasticity_map import PRESETS as PLASTICITY_MAP_PRESETS
from ._plasticity_map import PlasticityMapSpec as PlasticityMapSpec
from ._plasticity_map import load_plasticity_map as load_plasticity_map
from ._plasticity_map import plasticity_map as plasticity_map
from ._plasticity_verdicts import claim_summary as claim_summary
from ._plasticity_verdicts import descent_disagreements as descent_disagreements
from ._plasticity_verdicts import plasticity_deficit as plasticity_deficit
from ._plasticity_verdicts import plasticity_endpoints as plasticity_endpoints
from ._plasticity_verdicts import plasticity_verdicts as plasticity_verdicts
from ._plasticity_verdicts import plot_deficit as plot_deficit
from ._reproduce import reproduce as reproduce

__all__ = [
    "PLASTICITY_MAP_PRESETS",
    "PlasticityMapSpec",
    "PlasticityResult",
    "claim_summary",
    "connected_superset_mask",
    "descent_disagreements",
    "dxd_study",
    "load_plasticity_map",
    "plasticity",
    "plasticity_deficit",
    "plasticity_endpoints",
    "plasticity_map",
    "plasticity_verdicts",
    "plot_deficit",
    "reproduce",
    "two_by_two_problem",
    "two_by_two_warm_curve",
]
