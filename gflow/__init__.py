"""gflow: exact continuous-time gradient flow on deep matrix factorizations."""

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
