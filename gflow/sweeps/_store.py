"""The zarr store of a sweep, which a crash cannot corrupt.

The grid is flattened into one `point` dimension in execution order (`execution_order`); each
chunk of points is one zarr chunk. A chunk's results are written first and its `done` flag
after, so a chunk killed half-way stays not-done and is recomputed on resume; a finished chunk
is never recomputed. `to_grid` turns the flat store into a dataset with one dimension per axis;
points not written yet read `pending`.
"""

from __future__ import annotations

import json
import os
import time
import warnings

import numpy as np

from ..engine import Status
from ._spec import SweepSpec, _scalar, execution_order

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


def _template(spec: SweepSpec, order):
    import xarray as xr

    points = spec.points()
    flat = [i for _, idx in order for i in idx]
    n = len(flat)
    coords = {
        name: ("point", np.array([points[i][name] for i in flat], dtype=float))
        for name in spec.axes
    }
    coords["grid_index"] = ("point", np.array(flat, dtype=np.int64))
    data = {}
    for name, dtype in VARIABLES.items():
        fill = -1 if np.issubdtype(dtype, np.integer) else np.nan
        data[name] = ("point", np.full(n, fill, dtype=dtype))
    data["sigma"] = (("point", "k"), np.full((n, spec.top), np.nan))
    data["done"] = ("point", np.zeros(n, dtype=bool))
    ds = xr.Dataset(data, coords=coords)
    ds.attrs["spec"] = spec.to_json()
    ds.attrs["axes"] = json.dumps(list(spec.axes))
    ds.attrs["chunk_size"] = spec.chunk_size
    ds.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return ds


def _open_or_create(path, spec, order, resume):
    """Open the store at `path`, or create it: written under a temporary name and renamed into
    place, so that workers starting together agree on one store (the first rename wins)."""
    import shutil

    import xarray as xr

    if not os.path.exists(path):
        template = _template(spec, order)
        encoding = {
            name: {"chunks": (spec.chunk_size,) + template[name].shape[1:]}
            for name in template.data_vars
        }
        tmp = f"{os.fspath(path).rstrip(os.sep)}.creating-{os.getpid()}"
        # Consolidated once here: chunk writes change data, never metadata, so the store opens
        # without xarray's warning even after a run killed midway.
        with warnings.catch_warnings():  # zarr 3: "not part of the format 3 specification"
            warnings.filterwarnings("ignore", message="Consolidated metadata")
            template.to_zarr(tmp, mode="w", encoding=encoding, compute=True, consolidated=True)
        try:
            os.rename(tmp, path)
            return xr.open_zarr(path, consolidated=False)
        except OSError:  # another worker created it first
            shutil.rmtree(tmp, ignore_errors=True)
    elif not resume:
        raise FileExistsError(f"{path} exists: pass resume=True (--resume) to continue it")
    ds = xr.open_zarr(path, consolidated=False)
    if ds.attrs.get("spec") != spec.to_json():
        raise ValueError(f"{path} holds a different sweep; use another --out path")
    return ds


def _chunk_regions(order, worker=None) -> list[tuple[int, list[int]]]:
    """(offset in the store, canonical point indices) of each chunk; with `worker=(k, n)`, only
    the chunks that worker runs (chunk index k mod n)."""
    regions, offset = [], 0
    for chunk, (_, idx) in enumerate(order):
        if worker is None or chunk % worker[1] == worker[0]:
            regions.append((offset, idx))
        offset += len(idx)
    return regions


def sweep_summary(ds, worker=None) -> dict:
    """Status counts of a sweep (a gridded dataset from `sweep` or `load_sweep`), by label.

    With `worker=(k, n)` the counts cover that worker's own chunks. Points not written yet
    (another worker's chunk still running, or an interrupted run) count as `pending`, and
    `chunks_pending` says how many chunks of the whole store are still to be computed."""
    spec = SweepSpec.from_dict(json.loads(ds.attrs["spec"]))
    order = execution_order(spec)
    done = np.asarray(ds["done"].values).ravel()
    status = np.where(done, np.asarray(ds["status"].values).ravel(), int(Status.PENDING))
    # the grid is in canonical order: a chunk's points are its canonical indices
    pending = sum(not done[idx].all() for _, idx in order)
    own = np.concatenate([np.asarray(i, dtype=np.int64) for _, i in _chunk_regions(order, worker)])
    counts: dict[str, int] = {}
    for code in status[own]:
        label = Status(int(code)).label
        counts[label] = counts.get(label, 0) + 1
    out = {"flows": int(own.size), "status": counts, "chunks_pending": int(pending)}
    if worker is not None:
        out["worker"] = f"{worker[0]}/{worker[1]}"
        out["store_flows"] = int(done.size)
    return out


def status_labels(values) -> np.ndarray:
    """Status codes (any shape) as their labels; unwritten points read `pending`."""
    codes = np.asarray(values)
    return np.vectorize(lambda c: Status(int(c)).label, otypes=[object])(codes)


def to_grid(ds):
    """The flat store as a dataset with one dimension per axis (canonical order)."""
    axes = json.loads(ds.attrs["axes"])
    spec = json.loads(ds.attrs["spec"])
    shape = [len(spec["axes"][a]) for a in axes]
    order = np.argsort(ds["grid_index"].values)
    flat = ds.isel(point=order)
    import xarray as xr

    data = {}
    for name, var in flat.data_vars.items():
        values = var.values
        data[name] = (tuple(axes) + var.dims[1:], values.reshape(shape + list(values.shape[1:])))
    coords = {a: np.array([_scalar(v) for v in spec["axes"][a]]) for a in axes}
    grid = xr.Dataset(data, coords=coords, attrs=dict(ds.attrs))
    return grid


def load_sweep(path):
    """Open a sweep store as a gridded dataset."""
    import xarray as xr

    return to_grid(xr.open_zarr(path, consolidated=False).load())


def export_table(ds, path=None):
    """A flat table, one row per flow (axes as columns, `sigma_0 …` for the singular values),
    as a pandas DataFrame; written as CSV, or parquet when `path` ends in `.parquet`."""
    frame = ds.drop_vars("sigma").to_dataframe().reset_index()
    pending = ~frame["done"].to_numpy(dtype=bool)
    frame["status"] = frame["status"].where(~pending, int(Status.PENDING))
    labels = status_labels(frame["status"])
    frame.insert(frame.columns.get_loc("status") + 1, "status_label", labels)
    sigma = ds["sigma"].values.reshape(-1, ds.sizes["k"])
    for k in range(sigma.shape[1]):
        frame[f"sigma_{k}"] = sigma[:, k]
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
