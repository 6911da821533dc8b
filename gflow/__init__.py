"""gflow: exact continuous-time gradient flow on deep matrix factorizations."""

from . import _cli as _cli
from . import _flow as _flow
from . import _precision as _precision  # noqa: F401  (switches on float64)
from ._flow import FlowOptions as FlowOptions
from ._flow import flow as flow
from ._flow import flow_batch as flow_batch
from ._flow import solve as solve
from ._flow import stack as stack
from ._init import gaussian as gaussian
from ._init import identity_family as identity_family
from ._init import load_init as load_init
from ._init import orthogonal as orthogonal
from ._model import Factorization as Factorization
from ._problem import Problem as Problem
from ._problem import bernoulli as bernoulli
from ._problem import block_diagonal as block_diagonal
from ._problem import diagonal as diagonal
from ._problem import load_problem as load_problem
from ._result import FlowResult as FlowResult
from ._result import Status as Status
from ._result import Trajectory as Trajectory

__version__ = "0.1.0"
from ._certificates import balancedness as balancedness
from ._certificates import balancedness_drift as balancedness_drift
from ._certificates import certificates as certificates
from ._certificates import energy_residual as energy_residual
from ._compare import FamilyConfig as FamilyConfig
from ._compare import compare_family as compare_family
from ._compare import compare_family_batch as compare_family_batch
from ._compare import format_table as format_table
from ._compare import plot_rank_vs_alpha as plot_rank_vs_alpha
from ._coupling import CouplingReport as CouplingReport
from ._coupling import bipartite_components as bipartite_components
from ._coupling import coupling as coupling
from ._coupling import gram as gram
from ._coupling import trajectory_coupling as trajectory_coupling
from ._coupling import trajectory_models as trajectory_models
from ._measures import effective_rank as effective_rank
from ._measures import effective_rank_of as effective_rank_of
from ._measures import family_eigenvalues as family_eigenvalues
from ._measures import family_ranks as family_ranks
from ._measures import family_spectrum as family_spectrum
from ._measures import nuclear_norm as nuclear_norm
from ._measures import singular_values as singular_values
from ._measures import stable_rank as stable_rank
from ._measures import stable_rank_of as stable_rank_of
from ._measures import unobserved_error as unobserved_error
from ._theory import FamilyLimit as FamilyLimit
from ._theory import diagonal_l2_limit as diagonal_l2_limit
from ._theory import escape_time as escape_time
from ._theory import family_invariant as family_invariant
from ._theory import family_limit as family_limit
from ._theory import family_prediction as family_prediction
from ._theory import reduced_flow as reduced_flow
from ._theory import sigma_c_at as sigma_c_at
