"""The flow engine: options, the two clocks, the stopping rule, the integrators, compilation."""

from ._compile import compile_count as compile_count
from ._flow import flow as flow
from ._flow import flow_batch as flow_batch
from ._flow import pad_depth as pad_depth
from ._flow import stack as stack
from ._options import SOLVERS as SOLVERS
from ._options import FlowOptions as FlowOptions
from ._result import FlowResult as FlowResult
from ._result import Phase as Phase
from ._result import Status as Status
from ._result import Trajectory as Trajectory
from ._stopping import remaining_distance_ratio as remaining_distance_ratio

__all__ = [
    "FlowOptions",
    "FlowResult",
    "Phase",
    "Rodas4",
    "SOLVERS",
    "Status",
    "Trajectory",
    "compile_count",
    "flow",
    "flow_batch",
    "pad_depth",
    "remaining_distance_ratio",
    "solve",
    "stack",
]


def __getattr__(name):
    # The engine's diffrax side (the solve and RODAS4) is imported on first use, so that a
    # process whose programs come from the cache never imports diffrax.
    if name == "solve":
        from ._solve import solve

        return solve
    if name == "Rodas4":
        from ._rosenbrock import Rodas4

        return Rodas4
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
