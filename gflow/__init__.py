"""gflow: exact continuous-time gradient flow on deep matrix factorizations.

Data flows one way: a `Problem` (target and mask) and a `Factorization` (an initialisation)
go into `flow`, which returns a `FlowResult`; `gflow.analysis` reads its endpoint (ranks,
theory, coupling, certificates); sweeps run grids of flows; `gflow.studies` holds the paper's
plasticity study and the report of `gflow reproduce`.
"""

from importlib.metadata import version as _version

from . import _precision  # noqa: F401  (switches JAX to float64)
from . import analysis as analysis
from . import engine as engine
from . import studies as studies
from . import sweeps as sweeps
from ._checks import seed_keys as seed_keys
from .analysis import *  # noqa: F403  (the analysis functions stay at the top level)
from .descent import OPTIMIZERS as OPTIMIZERS
from .descent import DescentOptions as DescentOptions
from .descent import descend as descend
from .descent import descend_batch as descend_batch
from .descent import endpoint_distance as endpoint_distance
from .descent import loglog_slope as loglog_slope
from .engine import FlowOptions as FlowOptions
from .engine import FlowResult as FlowResult
from .engine import Phase as Phase
from .engine import Status as Status
from .engine import Trajectory as Trajectory
from .engine import compile_count as compile_count
from .engine import flow as flow
from .engine import flow_batch as flow_batch
from .engine import pad_depth as pad_depth
from .engine import stack as stack
from .inits import gaussian as gaussian
from .inits import identity_family as identity_family
from .inits import load_init as load_init
from .inits import orthogonal as orthogonal
from .model import Factorization as Factorization
from .model import loss_hessian as loss_hessian
from .problem import Problem as Problem
from .problem import bernoulli as bernoulli
from .problem import block_diagonal as block_diagonal
from .problem import diagonal as diagonal
from .problem import load_problem as load_problem
from .sweeps import *  # noqa: F403

__version__ = _version("gflow")

__all__ = [
    # problem → model → flow
    "Problem",
    "diagonal",
    "block_diagonal",
    "bernoulli",
    "load_problem",
    "Factorization",
    "loss_hessian",
    "identity_family",
    "gaussian",
    "orthogonal",
    "load_init",
    "seed_keys",
    "FlowOptions",
    "FlowResult",
    "Phase",
    "Status",
    "Trajectory",
    "flow",
    "flow_batch",
    "solve",  # noqa: F405  (a lazy attribute, see __getattr__)
    "stack",
    "pad_depth",
    "compile_count",
    # discrete optimizers, for comparison
    "DescentOptions",
    "OPTIMIZERS",
    "descend",
    "descend_batch",
    "endpoint_distance",
    "loglog_slope",
    # analysis and sweeps (also as gflow.analysis, gflow.sweeps)
    *analysis.__all__,
    *sweeps.__all__,
    # submodules
    "analysis",
    "engine",
    "studies",
    "sweeps",
]


def __getattr__(name):
    if name == "solve":  # imported on first use: it pulls in diffrax (see gflow.engine)
        from .engine._solve import solve

        return solve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
