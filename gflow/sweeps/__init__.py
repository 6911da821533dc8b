"""Grids of flows run as a few compiled, vmapped programs into a resumable zarr store:
the grid (`SweepSpec`), the points' problems and inits, the runs, the store."""

from ._run import sweep as sweep
from ._spec import SweepSpec as SweepSpec
from ._spec import load_spec as load_spec
from ._store import export_table as export_table
from ._store import load_sweep as load_sweep
from ._store import status_labels as status_labels
from ._store import sweep_summary as sweep_summary

__all__ = [
    "SweepSpec",
    "export_table",
    "load_spec",
    "load_sweep",
    "status_labels",
    "sweep",
    "sweep_summary",
]
