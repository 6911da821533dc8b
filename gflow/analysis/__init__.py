"""What an endpoint means: ranks and spectra, the theory's predictions, coupling, certificates,
and endpoints set against the theory."""

from ._certificates import balancedness as balancedness
from ._certificates import balancedness_drift as balancedness_drift
from ._certificates import certificates as certificates
from ._certificates import energy_residual as energy_residual
from ._compare import FamilyConfig as FamilyConfig
from ._compare import compare_family as compare_family
from ._compare import compare_family_batch as compare_family_batch
from ._compare import compare_family_trajectory as compare_family_trajectory
from ._compare import format_table as format_table
from ._compare import ill_conditioned_after as ill_conditioned_after
from ._compare import plot_rank_vs_alpha as plot_rank_vs_alpha
from ._coupling import CouplingReport as CouplingReport
from ._coupling import bipartite_components as bipartite_components
from ._coupling import coupling as coupling
from ._coupling import gram as gram
from ._coupling import trajectory_coupling as trajectory_coupling
from ._coupling import trajectory_models as trajectory_models
from ._family_flow import FamilyFlow as FamilyFlow
from ._family_flow import family_flow as family_flow
from ._measures import effective_rank as effective_rank
from ._measures import effective_rank_of as effective_rank_of
from ._measures import family_eigenvalues as family_eigenvalues
from ._measures import family_ranks as family_ranks
from ._measures import family_spectrum as family_spectrum
from ._measures import nuclear_norm as nuclear_norm
from ._measures import singular_values as singular_values
from ._measures import stable_rank as stable_rank
from ._measures import stable_rank_excess_of as stable_rank_excess_of
from ._measures import stable_rank_of as stable_rank_of
from ._measures import unobserved_error as unobserved_error
from ._sensitivity import Sensitivity as Sensitivity
from ._sensitivity import endpoint_quantities as endpoint_quantities
from ._sensitivity import reproducible_digits as reproducible_digits
from ._sensitivity import sensitivity as sensitivity
from ._theory import FamilyLimit as FamilyLimit
from ._theory import diagonal_l2_limit as diagonal_l2_limit
from ._theory import escape_time as escape_time
from ._theory import family_invariant as family_invariant
from ._theory import family_limit as family_limit
from ._theory import family_prediction as family_prediction
from ._theory import reduced_flow as reduced_flow
from ._theory import sigma_c_at as sigma_c_at

__all__ = [
    "CouplingReport",
    "FamilyConfig",
    "FamilyFlow",
    "FamilyLimit",
    "Sensitivity",
    "balancedness",
    "balancedness_drift",
    "bipartite_components",
    "certificates",
    "compare_family",
    "compare_family_batch",
    "compare_family_trajectory",
    "coupling",
    "diagonal_l2_limit",
    "effective_rank",
    "effective_rank_of",
    "endpoint_quantities",
    "energy_residual",
    "escape_time",
    "family_eigenvalues",
    "family_flow",
    "family_invariant",
    "family_limit",
    "family_prediction",
    "family_ranks",
    "family_spectrum",
    "format_table",
    "gram",
    "ill_conditioned_after",
    "nuclear_norm",
    "plot_rank_vs_alpha",
    "reduced_flow",
    "reproducible_digits",
    "sensitivity",
    "sigma_c_at",
    "singular_values",
    "stable_rank",
    "stable_rank_excess_of",
    "stable_rank_of",
    "trajectory_coupling",
    "trajectory_models",
    "unobserved_error",
]
