"""Sweeps: a grid of flows (α × depth × m × seed × problem parameters) run as a few compiled,
vmapped programs, streamed chunk by chunk into a zarr store that a crash cannot corrupt.

Layout of the store. The grid is flattened into one `point` dimension in *execution order*:
points are grouped by shape (depth and matrix size need their own compiled program), and within
a group sorted by expected flow length (escape time grows like α^{−(L−2)}), because a vmapped
batch costs about (slowest member's steps) × (batch size). Each chunk of `chunk_size` points is
one batch and one zarr chunk. A chunk's results are written first and its `done` flag after, so
a chunk killed half-way stays not-done and is recomputed on resume; a finished chunk is never
recomputed. `to_grid` turns the flat store into a dataset with one dimension per axis.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field

import jax
import numpy as np

from ._checks import seed_keys
from ._flow import FlowOptions, _compiled_solver, pad_depth, stack
from ._init import gaussian, identity_family, orthogonal
from ._measures import effective_rank_of, family_spectrum, stable_rank_of
from ._problem import bernoulli, block_diagonal
from ._result import Status

DYNAMIC_AXES = ("alpha", "m", "seed", "value", "noise", "density")
STATIC_AXES = ("depth", "dim", "blocks", "block_size", "rank")
DEFAULTS = {
    "alpha": 0.01,
    "m": 4.0,
    "seed": 0,
    "value": 1.0,
    "noise": 0.0,
    "density": 0.5,
    "depth": 3,
    "dim": 4,
    "blocks": 2,
    "block_size": 2,
    "rank": 1,
}
PROBLEMS = ("diagonal", "block-diagonal", "bernoulli")
INITS = ("identity", "gaussian", "orthogonal")
DEPTH_MODES = ("auto", "compile", "pad")
# Padding costs ~35 % more per step and saves one compilation (~5–10 s) per extra depth: it
# pays up to grids of a few thousand flows (see `depth_mode`).
PAD_MAX_FLOWS = 4096


def _whole(v, low):
    return isinstance(v, int | np.integer) and not isinstance(v, bool) and v >= low


def _real(v):
    return isinstance(v, int | float | np.number) and not isinstance(v, bool)


_VALID = {
    "alpha": (lambda a: _real(a) and math.isfinite(a) and a > 0, "finite and > 0"),
    "m": (lambda m: _real(m) and m > 1, "> 1 (m = inf allowed)"),
    "seed": (lambda s: _whole(s, 0), "an integer >= 0"),
    "value": (lambda w: _real(w) and math.isfinite(w), "finite"),
    "noise": (lambda s: _real(s) and math.isfinite(s) and s >= 0, "finite and >= 0"),
    "density": (lambda p: _real(p) and 0 < p <= 1, "in (0, 1]"),
    "depth": (lambda n: _whole(n, 1), "an integer >= 1"),
    "dim": (lambda n: _whole(n, 1), "an integer >= 1"),
    "blocks": (lambda n: _whole(n, 1), "an integer >= 1"),
    "block_size": (lambda n: _whole(n, 1), "an integer >= 1"),
    "rank": (lambda n: _whole(n, 1), "an integer >= 1"),
}


@dataclass(frozen=True)
class SweepSpec:
    """A grid of flows.

    - `axes`: axis name → values; names from `alpha`, `m`, `seed`, `value`, `noise`, `density`
      (batched in one program) and `depth`, `dim`, `blocks`, `block_size`, `rank` (one program
      per combination). The grid is their cartesian product.
    - `fixed`: values for parameters that are not axes (defaults: `DEFAULTS`).
    - `problem`: `diagonal` (d = dim), `block-diagonal` (n = blocks, s = block_size) or
      `bernoulli` (dim × dim, density, rank); `init`: `identity`, `gaussian` or `orthogonal`.
    - `options`: `FlowOptions` for every flow; `chunk_size`: flows per batch;
      `top`: singular values stored per flow.
    - `depth_mode`: `compile` (one program per depth), `pad` (one program for all depths:
      every model padded to the largest depth with frozen identity layers; same endpoints,
      fewer compilations, more work per step) or `auto` (default): `pad` for grids of up to
      `PAD_MAX_FLOWS` flows, where compilation dominates, `compile` for larger ones. Measured
      on a 512-flow grid over 4 depths (d = 8, 2-core CPU): 16.6 s padded vs 36.5 s per-depth
      including compilation, 7.5 s vs 5.6 s once compiled.
    """

    axes: dict
    fixed: dict = field(default_factory=dict)
    problem: str = "diagonal"
    init: str = "identity"
    options: FlowOptions = field(default_factory=FlowOptions)
    chunk_size: int = 64
    top: int = 4
    depth_mode: str = "auto"

    def __post_init__(self):
        if not self.axes:
            raise ValueError("a sweep needs at least one axis")
        axes = {}
        for name, values in self.axes.items():
            if name not in DEFAULTS:
                raise ValueError(f"unknown axis {name!r}; choose from {sorted(DEFAULTS)}")
            values = tuple(_scalar(v) for v in np.atleast_1d(np.asarray(values, dtype=object)))
            if not values:
                raise ValueError(f"axis {name!r} has no values")
            axes[name] = values
        object.__setattr__(self, "axes", axes)
        for name in self.fixed:
            if name not in DEFAULTS:
                raise ValueError(f"unknown parameter {name!r} in fixed")
        if self.problem not in PROBLEMS:
            raise ValueError(f"unknown problem {self.problem!r}; choose from {PROBLEMS}")
        if self.init not in INITS:
            raise ValueError(f"unknown init {self.init!r}; choose from {INITS}")
        if self.depth_mode not in DEPTH_MODES:
            raise ValueError(f"unknown depth_mode {self.depth_mode!r}; choose from {DEPTH_MODES}")
        if not (isinstance(self.chunk_size, int) and self.chunk_size >= 1):
            raise ValueError("chunk_size must be a positive integer")
        # Every value is checked here, before a store is created or any work done (models
        # are built traced, where the builders could not check their scalars).
        for name, (ok, rule) in _VALID.items():
            values = self.axes.get(name, (self.fixed.get(name, DEFAULTS[name]),))
            bad = [v for v in values if not ok(v)]
            if bad:
                raise ValueError(f"{name} must be {rule}, got {bad[0]!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(v) for v in self.axes.values())

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def points(self) -> list[dict]:
        """Every grid point as a full parameter dict, in canonical (row-major) order."""
        base = DEFAULTS | dict(self.fixed)
        names = list(self.axes)
        return [
            base | dict(zip(names, combo, strict=True))
            for combo in itertools.product(*self.axes.values())
        ]

    @property
    def pads_depths(self) -> bool:
        if self.depth_mode == "auto":
            return len(self.axes.get("depth", ())) > 1 and self.size <= PAD_MAX_FLOWS
        return self.depth_mode == "pad"

    @property
    def max_depth(self) -> int:
        return int(max(self.axes.get("depth", [(DEFAULTS | self.fixed)["depth"]])))

    def to_json(self) -> str:
        d = asdict(self)
        d["options"] = asdict(self.options)
        return json.dumps(d, default=_json_default)

    @classmethod
    def from_dict(cls, d: dict) -> SweepSpec:
        d = dict(d)
        options = d.pop("options", {}) or {}
        if isinstance(options, dict):
            options = FlowOptions(**{k: _scalar(v) for k, v in options.items()})
        axes = {k: [_scalar(x) for x in v] for k, v in d.pop("axes").items()}
        sweep = d.pop("sweep", {}) or {}
        return cls(axes=axes, options=options, **d, **sweep)


def _scalar(v):
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity"):
        return math.inf
    if isinstance(v, np.generic):
        return v.item()
    return v


def _json_default(o):
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def build(point: dict, problem_kind: str, init_kind: str, pad_to: int | None = None):
    """The (problem, model) of one grid point; with `pad_to`, the model is padded with
    identity layers to that depth (`pad_depth`)."""
    problem = _build_problem(point, problem_kind)
    d_out, d_in = problem.shape
    model = _init(init_kind, d_in, d_out, int(point["depth"]), pad_to)(
        int(point["seed"]), point["alpha"], point["m"]
    )
    return problem, model


def build_chunk(points: list[dict], problem_kind: str, init_kind: str, pad_to=None):
    """`build` for a chunk of points, stacked: what `build` gives point by point, without its
    per-point cost (~2 ms of small dispatches, as much as a small flow). Problems are built
    once per distinct problem (a seed grid over a noiseless diagonal problem shares one);
    models of one depth in one jitted, vmapped call."""
    by_key: dict = {}
    problems = []
    for p in points:
        key = tuple(p[k] for k in _PROBLEM_FIELDS[problem_kind])
        if problem_kind == "bernoulli" or p["noise"] > 0:
            key += (p["seed"],)
        if key not in by_key:
            by_key[key] = _build_problem(p, problem_kind)
        problems.append(by_key[key])
    d_out, d_in = problems[0].shape
    depths = {int(p["depth"]) for p in points}
    if len(depths) == 1:
        seeds = np.array([int(p["seed"]) for p in points])
        alphas = np.array([float(p["alpha"]) for p in points])
        ms = np.array([float(p["m"]) for p in points])
        init = _init(init_kind, d_in, d_out, depths.pop(), pad_to)
        models = _vmapped(init)(seeds, alphas, ms)
    else:
        models = stack([build(p, problem_kind, init_kind, pad_to)[1] for p in points])
    return stack(problems), models


_PROBLEM_FIELDS = {
    "diagonal": ("dim", "value", "noise"),
    "block-diagonal": ("blocks", "block_size", "value", "noise"),
    "bernoulli": ("dim", "density", "rank", "noise"),
}


@functools.cache
def _init(init_kind: str, d_in: int, d_out: int, depth: int, pad_to: int | None):
    """(seed, alpha, m) ↦ the initial model of a grid point; traceable in all three."""

    def init(seed, alpha, m):
        k_init = seed_keys(seed)[1]
        if init_kind == "identity":
            model = identity_family(d_in, depth, alpha, m)
        elif init_kind == "gaussian":
            model = gaussian([d_in] + [d_out] * depth, alpha, k_init)
        else:
            model = orthogonal([d_in] + [d_out] * depth, alpha, k_init)
        return model if pad_to is None else pad_depth(model, pad_to)

    return init


@functools.cache
def _vmapped(init):
    return jax.jit(jax.vmap(init))


def _build_problem(point: dict, problem_kind: str):
    k_problem = seed_keys(int(point["seed"]))[0]
    if problem_kind == "diagonal":
        problem = block_diagonal(
            int(point["dim"]), 1, point["value"], noise=point["noise"], key=k_problem
        )
    elif problem_kind == "block-diagonal":
        problem = block_diagonal(
            int(point["blocks"]),
            int(point["block_size"]),
            point["value"],
            noise=point["noise"],
            key=k_problem,
        )
    else:
        d = int(point["dim"])
        problem = bernoulli(
            d, d, point["density"], int(point["rank"]), k_problem, noise=point["noise"]
        )
    return problem


def _expected_length(point: dict) -> float:
    depth, alpha = int(point["depth"]), float(point["alpha"])
    if depth >= 3:
        return alpha ** (-(depth - 2))
    return math.log(1.0 / alpha) if alpha < 1 else 0.0


def execution_order(spec: SweepSpec) -> list[tuple[tuple, list[int]]]:
    """Groups of canonical point indices: one group per static shape key, each sorted by
    expected flow length and cut into chunks of `chunk_size`."""
    points = spec.points()
    groups: dict[tuple, list[int]] = {}
    pads = spec.pads_depths  # then every depth shares one program: not part of the key
    for i, p in enumerate(points):
        key = (0 if pads else p["depth"], p["dim"], p["blocks"], p["block_size"], p["rank"])
        groups.setdefault(key, []).append(i)
    order = []
    for key in sorted(groups):
        idx = sorted(groups[key], key=lambda i: _expected_length(points[i]))
        for start in range(0, len(idx), spec.chunk_size):
            order.append((key, idx[start : start + spec.chunk_size]))
    return order


# --------------------------------------------------------------------------------------------
# Running chunks


def run_chunk(spec: SweepSpec, chosen: list[dict], devices=None) -> dict[str, np.ndarray]:
    """Integrate the flows of one chunk (grid points as parameter dicts) as one vmapped batch,
    padded to `chunk_size` so every chunk of a group shares one compiled program; returns
    per-point result arrays."""
    n_dev = len(devices) if devices else 1
    size = -(-spec.chunk_size // n_dev) * n_dev  # every device gets an equal slice
    padded = chosen + [chosen[-1]] * (size - len(chosen))
    pad_to = spec.max_depth if spec.pads_depths else None
    problems, models = build_chunk(padded, spec.problem, spec.init, pad_to)
    depths = None
    if pad_to is not None:
        depths = np.array([int(p["depth"]) for p in padded], dtype=np.int32)
    compiled, _ = _compiled_solver(
        problems, models, spec.options, in_axes=(0, 0), devices=devices, depths=depths
    )
    result = compiled(problems, models) if depths is None else compiled(problems, models, depths)
    jax.block_until_ready(result)
    n = len(chosen)
    out = {
        "status": np.asarray(result.status)[:n].astype(np.int8),
        "t_end": np.asarray(result.t_end)[:n],
        "loss": np.asarray(result.loss)[:n],
        "loss_init": np.asarray(result.loss_init)[:n],
        "num_steps": np.asarray(result.num_steps)[:n].astype(np.int64),
        "num_rejected_steps": np.asarray(result.num_rejected_steps)[:n].astype(np.int64),
        "end_phase": np.asarray(result.end_phase)[:n].astype(np.int8),
        "solver_code": np.asarray(result.solver_code)[:n].astype(np.int8),
    }
    x = np.asarray(result.model.product())[:n]
    sigma = np.linalg.svd(x, compute_uv=False)
    top = min(spec.top, sigma.shape[1])
    out["sigma"] = np.full((n, spec.top), np.nan)
    out["sigma"][:, :top] = sigma[:, :top]
    out["stable_rank"] = np.array([stable_rank_of(s) for s in sigma])
    out["effective_rank"] = np.array([effective_rank_of(s) for s in sigma])
    if spec.init == "identity" and spec.problem != "bernoulli":
        n_blocks = [p["dim"] if spec.problem == "diagonal" else p["blocks"] for p in chosen]
        s_blocks = [1 if spec.problem == "diagonal" else p["block_size"] for p in chosen]
        spectra = [
            family_spectrum(result.member(i).model, n_blocks[i], s_blocks[i]) for i in range(n)
        ]
        out["log_sigma_a_layers"] = np.array([s["log_sigma_a"] for s in spectra])
        out["log_sigma_b_layers"] = np.array([s.get("log_sigma_b", np.nan) for s in spectra])
    steps = out["num_steps"].astype(float)
    out["batch_efficiency"] = np.full(n, steps.mean() / max(steps.max(), 1.0))
    return out


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
        template.to_zarr(tmp, mode="w", encoding=encoding, compute=True, consolidated=False)
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


def sweep(spec: SweepSpec, out=None, *, resume=False, progress=True, devices=None, worker=None):
    """Run every flow of `spec` and return the results as an `xarray.Dataset` with one
    dimension per axis (see `to_grid`).

    With `out` (a path ending in `.zarr`), results stream into that store chunk by chunk;
    `resume=True` continues a store left by an interrupted run, recomputing only unfinished
    chunks. Ctrl-C stops after the chunk in flight is discarded; every finished chunk is kept.
    `devices`: spread each batch over these JAX devices (default: all local devices).
    `worker=(k, n)`: one of n independent processes (hosts, Slurm array tasks) sharing the
    store `out`: this one runs the chunks whose index is k mod n (and implies `resume`). Chunks
    are disjoint zarr regions, so workers never write the same bytes; rerunning a worker after
    a crash resumes it. The returned dataset holds whatever the store holds when it finishes.
    """
    import xarray as xr

    if worker is not None:
        k, n = worker
        if out is None or not (isinstance(n, int) and n >= 1 and 0 <= k < n):
            raise ValueError("worker=(k, n) needs 0 <= k < n and a shared store `out`")
        resume = True
    order = execution_order(spec)
    points = spec.points()
    devices = devices if devices is not None else jax.local_devices()
    if out is None:
        ds = _template(spec, order)
        store = None
    else:
        ds = _open_or_create(out, spec, order, resume)
        store = out
    done = np.asarray(ds["done"].values)
    run_id = os.getpid()
    mine = _chunk_regions(order, worker)
    todo = [(offset, idx) for offset, idx in mine if not done[offset : offset + len(idx)].all()]
    total = sum(len(idx) for _, idx in mine)
    bar = _progress(len(todo), total - sum(len(i) for _, i in todo), total, progress)
    try:
        for offset, idx in todo:
            start = time.perf_counter()
            res = run_chunk(spec, [points[i] for i in idx], devices)
            wall = time.perf_counter() - start
            region = slice(offset, offset + len(idx))
            res["wall_time_s"] = np.full(len(idx), wall / len(idx))
            res["run_id"] = np.full(len(idx), run_id, dtype=np.int64)
            if store is None:
                for name, values in res.items():
                    ds[name][region] = values
                ds["done"][region] = True
            else:
                chunk = xr.Dataset({name: (ds[name].dims, values) for name, values in res.items()})
                chunk.to_zarr(store, region={"point": region}, consolidated=False)
                flag = xr.Dataset({"done": ("point", np.ones(len(idx), dtype=bool))})
                flag.to_zarr(store, region={"point": region}, consolidated=False)
            bar.update(len(idx))
    except KeyboardInterrupt:
        bar.close()
        print(
            f"gflow sweep: interrupted; finished chunks are saved{' in ' + str(out) if out else ''}"
        )
        raise
    bar.close()
    if store is not None:
        ds = xr.open_zarr(store, consolidated=False).load()
    return to_grid(ds)


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


def _progress(chunks, already, total, enabled):
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total,
        initial=already,
        unit="flow",
        disable=not enabled,
        desc=f"sweep ({chunks} chunks to run)",
        smoothing=0.1,
    )
    return bar


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


def load_spec(path) -> SweepSpec:
    """A `SweepSpec` from a TOML file (see `examples/sweep.toml`)."""
    import tomllib

    with open(path, "rb") as f:
        return SweepSpec.from_dict(tomllib.load(f))
