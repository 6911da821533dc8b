"""The zarr store of a sweep: a labelled grid that a crash cannot corrupt.

Every variable has one dimension per axis (`sigma` one more, `k`), so
`xr.open_zarr(store).stable_rank.sel(depth=3).plot()` works on the store as it is, also while a
sweep is still writing it. Each grid point is its own zarr chunk: the points of a batch lie
anywhere in the grid (`execution_order` groups them by shape and length), and workers writing
different points never write the same file. A batch's results are written first and its `done`
flags after, so a batch killed half-way stays not-done and is recomputed on resume; a finished
point is never recomputed. Points not written yet read `pending`.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import numpy as np

from ..engine import Status
from ._spec import SweepSpec, _scalar, execution_order

LAYOUT = "grid"  # stores before it were flat (one `point` dimension); `to_grid` still reads them

VARIABLES = {
    "status": np.int8,
    "t_end": np.float64,
    "loss": np.float64,
    "loss_init": np.float64,
    "num_steps": np.int64,
    "num_rejected_steps": np.int64,
    "end_phase": np.int8,
    "solver_code": np.int8,
    "stable_rank": np.float64,
    "effective_rank": np.float64,
    "batch_efficiency": np.float64,
    "wall_time_s": np.float64,
    "log_sigma_a_layers": np.float64,
    "log_sigma_b_layers": np.float64,
    "run_id": np.int64,
}

# With `SweepSpec.sensitivity`: reproducible digits (−1: not judged, a member did not converge)
SENSITIVITY_DIGITS = ("digits_stable_rank_excess", "digits_sigma_b_layers")


def _template(spec: SweepSpec):
    """The empty grid: every point pending."""
    import xarray as xr

    axes, shape = list(spec.axes), spec.shape
    data = {}
    for name, dtype in VARIABLES.items():
        fill = -1 if np.issubdtype(dtype, np.integer) else np.nan
        data[name] = (axes, np.full(shape, fill, dtype=dtype))
    data["sigma"] = ([*axes, "k"], np.full((*shape, spec.top), np.nan))
    if spec.sensitivity:
        data["digits_sigma"] = ([*axes, "k"], np.full((*shape, spec.top), -1, dtype=np.int8))
        for name in SENSITIVITY_DIGITS:
            data[name] = (axes, np.full(shape, -1, dtype=np.int8))
    data["done"] = (axes, np.zeros(shape, dtype=bool))
    coords = {a: np.array([_scalar(v) for v in values]) for a, values in spec.axes.items()}
    ds = xr.Dataset(data, coords=coords)
    ds.attrs["spec"] = spec.to_json()
    ds.attrs["axes"] = json.dumps(axes)
    ds.attrs["chunk_size"] = spec.chunk_size
    ds.attrs["layout"] = LAYOUT
    ds.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return ds


def _open_or_create(path, spec, resume):
    """The sweep's store at `path` (`open_store`), one zarr chunk per grid point."""

    def make():
        template = _template(spec)
        ones = (1,) * len(spec.axes)
        chunks = {name: ones + template[name].shape[len(ones) :] for name in template}
        return template, chunks

    older = (
        "was written by an older gflow (one flat `point` dimension): it can be read "
        "(gflow.load_sweep) but not resumed; run the sweep into a new --out path"
    )
    return open_store(path, resume, make, spec.to_json(), "sweep", LAYOUT, older)


def open_store(path, resume: bool, make, spec_json: str, what: str, layout: str, older: str):
    """Open the zarr store of a run at `path` to resume it, or create it from `make()` (its
    template dataset and each variable's chunks). A new store is written under a temporary
    name and renamed into place, so that workers starting together agree on one store (the
    first rename wins). Consolidated once there: later writes change data, never metadata, so
    the store opens without xarray's warning even after a run killed midway. An existing store
    resumes only with `resume`, its `layout` and its stored spec (else the error names what
    changed); `what` names the kind of run in errors, `older` ends the message for another
    layout."""
    import shutil

    import xarray as xr

    if not os.path.exists(path):
        template, chunks = make()
        encoding = {name: {"chunks": chunks[name]} for name in template.data_vars}
        tmp = f"{os.fspath(path).rstrip(os.sep)}.creating-{os.getpid()}"
        with warnings.catch_warnings():
            # zarr 3: "not part of the format 3 specification"; fixed-length string labels
            warnings.filterwarnings("ignore", message="Consolidated metadata")
            warnings.filterwarnings("ignore", message=".*does not have a Zarr V3 specification")
            template.to_zarr(tmp, mode="w", encoding=encoding, compute=True, consolidated=True)
        try:
            os.rename(tmp, path)
            return xr.open_zarr(path, consolidated=False)
        except OSError:  # another worker created it first
            shutil.rmtree(tmp, ignore_errors=True)
    elif not resume:
        raise FileExistsError(f"{path} exists: pass resume=True (--resume) to continue it")
    ds = xr.open_zarr(path, consolidated=False)
    if ds.attrs.get("layout") != layout:
        raise ValueError(f"{path} {older}")
    if ds.attrs.get("spec") != spec_json:
        changes = "; ".join(spec_differences(ds.attrs.get("spec") or "{}", spec_json))
        raise ValueError(
            f"{path} holds a different {what} ({changes}): resume it with the stored settings, "
            "or run this one into another path"
        )
    return ds


def spec_differences(stored: str, current: str) -> list[str]:
    """'field: stored → current' for each top-level field (and each FlowOptions field) on
    which two `SweepSpec.to_json()` strings differ; `(absent)` where one lacks it (a store
    written by a gflow that did not have the option)."""
    a, b = json.loads(stored), json.loads(current)
    absent = "(absent)"

    def changes(x: dict, y: dict, prefix: str) -> list[str]:
        out = []
        for key in sorted(set(x) | set(y)):
            old, new = x.get(key, absent), y.get(key, absent)
            if key == "options" and isinstance(old, dict) and isinstance(new, dict):
                out += changes(old, new, "options.")
            elif old != new:
                out.append(f"{prefix}{key}: {old!r} → {new!r}")
        return out

    return changes(a, b, "")


def write_points(path, spec: SweepSpec, idx, results: dict[str, np.ndarray]):
    """Write the results of the points `idx` (canonical indices) into the store at `path`,
    then their `done` flags."""
    import zarr

    group = zarr.open_group(os.fspath(path), mode="r+")
    where = np.unravel_index(np.asarray(idx), spec.shape)
    for name, values in results.items():
        _set_points(group[name], where, values)
    _set_points(group["done"], where, np.ones(len(idx), dtype=bool))


def _set_points(array, where, values):
    for j, point in enumerate(zip(*where, strict=True)):
        array[tuple(int(i) for i in point)] = values[j]


def _chunk_indices(order, worker=None) -> list[list[int]]:
    """The canonical point indices of each batch; with `worker=(k, n)`, only the batches that
    worker runs (batch index k mod n)."""
    return [idx for b, (_, idx) in enumerate(order) if worker is None or b % worker[1] == worker[0]]


NOT_CONVERGED_LISTED = 20


def sweep_summary(ds, worker=None) -> dict:
    """Status counts of a sweep (a gridded dataset from `sweep` or `load_sweep`), by label.

    With `worker=(k, n)` the counts cover that worker's own chunks. Points not written yet
    (another worker's chunk still running, or an interrupted run) count as `pending`, and
    `chunks_pending` says how many chunks of the whole store are still to be computed.
    Written points that stopped short of their endpoint where the user did not ask them to
    (out of steps, diverged, a solver failure; not `t_max`, `stop_loss` or `rounding_floor`
    stops) are listed by their axes and status under `not_converged` (the first
    `NOT_CONVERGED_LISTED`, in grid order; the key is absent where there are none)."""
    spec = SweepSpec.from_dict(json.loads(ds.attrs["spec"]))
    order = execution_order(spec)
    done = np.asarray(ds["done"].values).ravel()  # the grid is in canonical (row-major) order
    status = np.where(done, np.asarray(ds["status"].values).ravel(), int(Status.PENDING))
    pending = sum(not done[idx].all() for _, idx in order)
    own = np.concatenate([np.asarray(i, dtype=np.int64) for i in _chunk_indices(order, worker)])
    counts: dict[str, int] = {}
    for code in status[own]:
        label = Status(int(code)).label
        counts[label] = counts.get(label, 0) + 1
    out = {"flows": int(own.size), "status": counts, "chunks_pending": int(pending)}
    unasked = (Status.MAX_STEPS, Status.DIVERGED, Status.FAILED)
    unfinished = [int(i) for i in np.sort(own) if status[i] in unasked]
    if unfinished:
        points = spec.points()
        out["not_converged"] = [
            {name: points[i][name] for name in spec.axes}  # plain scalars (`SweepSpec`)
            | {"status": Status(int(status[i])).label}
            for i in unfinished[:NOT_CONVERGED_LISTED]
        ]
    if worker is not None:
        out["worker"] = f"{worker[0]}/{worker[1]}"
        out["store_flows"] = int(done.size)
    return out


def status_labels(values) -> np.ndarray:
    """Status codes (any shape) as their labels; unwritten points read `pending`."""
    codes = np.asarray(values)
    return np.vectorize(lambda c: Status(int(c)).label, otypes=[object])(codes)


def to_grid(ds):
    """A sweep's dataset with one dimension per axis: a store is one already; a store written
    before gflow kept the grid (one flat `point` dimension) is reshaped."""
    if "point" not in ds.dims:
        return ds
    import xarray as xr

    axes = json.loads(ds.attrs["axes"])
    spec = json.loads(ds.attrs["spec"])
    shape = [len(spec["axes"][a]) for a in axes]
    flat = ds.isel(point=np.argsort(ds["grid_index"].values))
    data = {}
    for name, var in flat.data_vars.items():
        values = var.values
        data[name] = (tuple(axes) + var.dims[1:], values.reshape(shape + list(values.shape[1:])))
    coords = {a: np.array([_scalar(v) for v in spec["axes"][a]]) for a in axes}
    return xr.Dataset(data, coords=coords, attrs=dict(ds.attrs))


def load_sweep(path):
    """Open a sweep store as a gridded dataset, loaded into memory."""
    import xarray as xr

    return to_grid(xr.open_zarr(path, consolidated=False).load())


def export_table(ds, path=None):
    """A flat table, one row per flow (axes as columns, `sigma_0 …` for the singular values,
    `digits_sigma_0 …` for their reproducible digits), as a pandas DataFrame; written as CSV,
    or parquet when `path` ends in `.parquet`."""
    per_value = [name for name in ds.data_vars if "k" in ds[name].dims]  # one column per k
    frame = ds.drop_vars(per_value).drop_dims("k", errors="ignore").to_dataframe().reset_index()
    pending = ~frame["done"].to_numpy(dtype=bool)
    frame["status"] = frame["status"].where(~pending, int(Status.PENDING))
    labels = status_labels(frame["status"])
    frame.insert(frame.columns.get_loc("status") + 1, "status_label", labels)
    for name in per_value:
        values = ds[name].transpose(..., "k").values.reshape(-1, ds.sizes["k"])
        for k in range(values.shape[1]):
            frame[f"{name}_{k}"] = values[:, k]
    if path is not None:
        if str(path).endswith(".parquet"):
            try:
                import pyarrow  # noqa: F401
            except ImportError as err:
                raise ImportError(
                    "writing .parquet needs pyarrow: pip install 'gflow[parquet]' (or write .csv)"
                ) from err
            frame.to_parquet(path, index=False)
        else:
            frame.to_csv(path, index=False)
    return frame
