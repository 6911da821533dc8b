"""The plasticity map: where does depth protect plasticity? Warm vs cold starts over depth,
init scale α, init shape, the pretraining mask Ω₁ ⊂ Ω₂ and the length of pretraining, for the
exact flow and for gradient descent at the field's learning rates, side by side.

Every cell pretrains on Ω₁ (to its endpoint, or stopped early where the loss has fallen to
`early_loss` of its initial value), resumes on Ω₂ from the pretrained weights (warm), and is
compared with a fresh start on Ω₂ from the same initialisation (cold). The results stream
into a zarr store, one work unit (depth, α, init: every Ω₁, pretraining and seed) at a time,
so an interrupted map resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field

import jax
import numpy as np

from .._checks import seed_keys
from ..analysis._coupling import bipartite_components, coupling
from ..analysis._measures import stable_rank, unobserved_error
from ..descent import DescentOptions, descend_batch
from ..engine import FlowOptions, Status, flow_batch, stack
from ..inits import gaussian, identity_family
from ..problem import Problem, bernoulli
from ..sweeps._store import open_store
from ._plasticity import _flat, connected_superset_mask

INITS = ("gaussian", "identity")
PRETRAINING = ("endpoint", "early")
SUBSET_KINDS = ("diagonal", "blocks")  # and "random-q", q in (0, 1)
TRUTHS = ("psd", "gaussian")
LAYOUT = "plasticity-map-1"


def subset_fraction(name: str) -> float | None:
    """q of a `random-q` subset name (the fraction of Ω₂ it keeps), None for the others."""
    if name.startswith("random-"):
        return float(name.removeprefix("random-"))
    return None


@dataclass(frozen=True)
class PlasticityMapSpec:
    """The grid of a plasticity map and how each cell is run.

    - `depths`, `alphas`, `inits` (`gaussian`, or `identity`: the family αF_m with `m`),
      `subsets` (Ω₁: `diagonal`, `blocks` = Ω₂ on `block_size` × `block_size` diagonal blocks,
      `random-q` = a random fraction q of Ω₂), `pretraining` (`endpoint`: to the flow's limit;
      `early`: stopped where the loss reaches `early_loss` × its initial value), `seeds`.
    - The problem of a seed: a random rank-`rank` `dim` × `dim` truth observed on Ω₂ = the
      diagonal plus `observed − dim` random entries, drawn until Ω₂ is connected. `truth`:
      `psd` (default, U Uᵀ/√rank with Gaussian U) or `gaussian` (U Vᵀ/√rank, signed). The
      identity family at even depth keeps its product positive semi-definite on the diagonal
      (W_L = W_1ᵀ, … is conserved), so it can never fit a negative diagonal entry: on a
      signed truth those flows stall at the boundary and reach no endpoint.
    - `options`: the flow's `FlowOptions` for every phase.
    - Gradient descent beside it, for each `sgd_lrs` η: the learning rate of the *mean*
      squared error over the observed entries, as Kleinman et al. 2024 (η = 0.2) train; on
      gflow's loss ½Σ_Ω that is lr = 2η/|Ω| (so it changes between pretraining and resuming).
      At most `sgd_steps` steps per phase; a phase counts as an endpoint when the flow's
      stopping rule fires at `sgd_rtol` (1e-3: within 0.1% of its own limit, enough for a
      deficit judged at a factor of 2; descent's last digits take ~1/(η λ_min) steps on the
      small eigenvalues of a random mask's NTK). An empty `sgd_lrs` skips descent.
    """

    depths: tuple = (2, 3, 4, 5)
    alphas: tuple = (1e-1, 1e-2, 1e-3, 1e-4)
    inits: tuple = INITS
    subsets: tuple = ("diagonal", "blocks", "random-0.25", "random-0.5", "random-0.75")
    pretraining: tuple = PRETRAINING
    seeds: tuple = (0, 1, 2, 3, 4)
    dim: int = 20
    rank: int = 2
    truth: str = "psd"
    observed: int = 160
    m: float = 4.0
    block_size: int = 5
    early_loss: float = 1e-2
    sgd_lrs: tuple = (0.2, 0.02)
    sgd_steps: int = 100_000
    sgd_rtol: float = 1e-3
    options: FlowOptions = field(default_factory=FlowOptions)

    def __post_init__(self):
        for name in ("depths", "alphas", "inits", "subsets", "pretraining", "seeds", "sgd_lrs"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("depths", "alphas", "inits", "subsets", "pretraining", "seeds"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} must not be empty")
            if len(set(values)) != len(values):
                raise ValueError(f"{name} holds a value twice: {values}")
        if any(not (isinstance(n, int) and n >= 1) for n in self.depths):
            raise ValueError(f"depths must be integers >= 1, got {self.depths}")
        if any(not (math.isfinite(a) and a > 0) for a in self.alphas):
            raise ValueError(f"alphas must be finite and > 0, got {self.alphas}")
        if any(not (isinstance(s, int) and s >= 0) for s in self.seeds):
            raise ValueError(f"seeds must be integers >= 0, got {self.seeds}")
        if set(self.inits) - set(INITS):
            raise ValueError(f"unknown init in {self.inits}; choose from {INITS}")
        if set(self.pretraining) - set(PRETRAINING):
            raise ValueError(
                f"unknown pretraining in {self.pretraining}; choose from {PRETRAINING}"
            )
        for name in self.subsets:
            q = subset_fraction(name) if name.startswith("random-") else None
            if name not in SUBSET_KINDS and not (q is not None and 0 < q < 1):
                raise ValueError(
                    f"unknown subset {name!r}: use 'diagonal', 'blocks' or 'random-q', 0 < q < 1"
                )
        if not (self.dim >= 2 and self.dim - 1 <= self.observed - self.dim):
            raise ValueError(
                f"observed = {self.observed} cannot hold the diagonal and connect a "
                f"{self.dim} × {self.dim} mask (needs at least {2 * self.dim - 1})"
            )
        if self.observed > self.dim * self.dim:
            raise ValueError(f"observed = {self.observed} exceeds dim² = {self.dim**2}")
        if self.truth not in TRUTHS:
            raise ValueError(f"unknown truth {self.truth!r}; choose from {TRUTHS}")
        if not (1 <= self.rank <= self.dim):
            raise ValueError(f"rank must lie in [1, dim], got {self.rank}")
        if not (self.m > 1):
            raise ValueError(f"m must be > 1, got {self.m}")
        if not (1 <= self.block_size <= self.dim):
            raise ValueError(f"block_size must lie in [1, dim], got {self.block_size}")
        if not (0 < self.early_loss < 1):
            raise ValueError(f"early_loss must lie in (0, 1), got {self.early_loss}")
        if any(not (math.isfinite(lr) and lr > 0) for lr in self.sgd_lrs):
            raise ValueError(f"sgd_lrs must be finite and > 0, got {self.sgd_lrs}")
        if not (isinstance(self.sgd_steps, int) and self.sgd_steps >= 1):
            raise ValueError(f"sgd_steps must be a positive integer, got {self.sgd_steps}")

    @property
    def axes(self) -> dict:
        return {
            "depth": self.depths,
            "alpha": self.alphas,
            "init": self.inits,
            "subset": self.subsets,
            "pretraining": self.pretraining,
            "seed": self.seeds,
        }

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(len(v) for v in self.axes.values())

    def units(self) -> list[tuple[int, int, int]]:
        """The work units (depth, α, init indices), cheapest first: escape times grow like
        α^{−(L−2)}, so a partial map is filled from its fast corner."""
        units = [
            (i, j, k)
            for i in range(len(self.depths))
            for j in range(len(self.alphas))
            for k in range(len(self.inits))
        ]
        return sorted(units, key=lambda u: (self.alphas[u[1]] ** -max(self.depths[u[0]] - 2, 0), u))

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["options"] = dataclasses.asdict(self.options)
        return json.dumps(d, default=lambda o: list(o) if isinstance(o, tuple) else str(o))

    @classmethod
    def from_json(cls, text: str) -> PlasticityMapSpec:
        d = json.loads(text)
        d["options"] = FlowOptions(**d["options"])
        return cls(**d)


# The sizes `gflow plasticity-map` and the report run. `full` is the whole grid (days on a
# CPU: flows from α ≤ 1e-2 on random masks spend minutes each in their stiff tails);
# `default` took 39 min on 2 cores beside the test suite (its α = 1e-2 units most of it);
# `report` is the default report's section and `small` the tests' and the quick report's.
PRESETS = {
    "full": PlasticityMapSpec(),
    "default": PlasticityMapSpec(
        depths=(2, 3),
        alphas=(1e-1, 1e-2),
        subsets=("diagonal", "blocks", "random-0.5"),
        seeds=(0, 1, 2),
        dim=10,
        observed=50,
        sgd_steps=20_000,
    ),
    "report": PlasticityMapSpec(
        depths=(2, 3),
        alphas=(1e-1,),
        subsets=("diagonal", "blocks", "random-0.5"),
        seeds=(0, 1, 2),
        dim=6,
        observed=20,
        block_size=2,
        sgd_steps=20_000,
    ),
    "small": PlasticityMapSpec(
        depths=(2, 3),
        alphas=(1e-1,),
        inits=("gaussian",),
        subsets=("diagonal", "random-0.5"),
        seeds=(0, 1),
        dim=6,
        observed=20,
        block_size=2,
        sgd_lrs=(0.2,),
        sgd_steps=20_000,
    ),
}


# --- the problems of a seed ---------------------------------------------------------------------


def seed_problem(spec: PlasticityMapSpec, seed: int) -> Problem:
    """The truth of `seed` observed on its Ω₂ (the diagonal plus random entries, connected)."""
    k_problem = seed_keys(seed)[0]
    k_truth, k_mask = jax.random.split(k_problem)
    if spec.truth == "psd":
        u = np.asarray(jax.random.normal(k_truth, (spec.dim, spec.rank)))
        truth = Problem(u @ u.T / math.sqrt(spec.rank), np.ones((spec.dim, spec.dim)))
    else:
        truth = bernoulli(spec.dim, spec.dim, 1.0, spec.rank, k_truth)
    mask2 = connected_superset_mask(spec.dim, spec.observed - spec.dim, k_mask)
    return truth.with_mask(mask2)


def pretrain_mask(spec: PlasticityMapSpec, name: str, mask2: np.ndarray, seed: int) -> np.ndarray:
    """Ω₁ ⊂ Ω₂ of the subset `name` for `seed`."""
    d = spec.dim
    if name == "diagonal":
        return np.eye(d)
    if name == "blocks":
        block = np.arange(d) // spec.block_size
        return mask2 * (block[:, None] == block[None, :])
    q = subset_fraction(name)
    entries = np.flatnonzero(mask2.ravel())
    rng = np.random.default_rng([seed, round(q * 1_000_000)])
    keep = rng.choice(entries, size=max(1, round(q * entries.size)), replace=False)
    mask1 = np.zeros(d * d)
    mask1[keep] = 1.0
    return mask1.reshape(d, d)


def initial_model(spec: PlasticityMapSpec, depth: int, alpha: float, init: str, seed: int):
    if init == "identity":
        return identity_family(spec.dim, depth, alpha, spec.m)
    return gaussian([spec.dim] * (depth + 1), alpha, seed_keys(seed)[1])


# --- one work unit ------------------------------------------------------------------------------


def _cells(spec):
    """The (subset, pretraining, seed) index triples of a unit, in store order."""
    return [
        (a, b, c)
        for a in range(len(spec.subsets))
        for b in range(len(spec.pretraining))
        for c in range(len(spec.seeds))
    ]


def run_unit(spec: PlasticityMapSpec, depth: int, alpha: float, init: str) -> dict:
    """Every cell of one (depth, α, init): arrays of shape (subsets, pretraining, seeds) (and a
    trailing `lr` axis for descent)."""
    problems = {s: seed_problem(spec, s) for s in spec.seeds}
    inits = {s: initial_model(spec, depth, alpha, init, s) for s in spec.seeds}
    masks = {
        (name, s): pretrain_mask(spec, name, np.asarray(problems[s].mask), s)
        for name in spec.subsets
        for s in spec.seeds
    }
    cells = _cells(spec)
    shape = (len(spec.subsets), len(spec.pretraining), len(spec.seeds))
    out: dict[str, np.ndarray] = {}

    def put(name, values, dtype=np.float64, lr_axis=False):
        arr = np.asarray(values, dtype=dtype)
        out[name] = arr.reshape(shape + ((len(spec.sgd_lrs),) if lr_axis else ()))

    # Ω₁ as the model sees it at the start: coupled or not (docs/theory.md §10)
    cell_keys = [(spec.subsets[a], spec.pretraining[b], spec.seeds[c]) for a, b, c in cells]
    pre_problem = {
        (n, s): problems[s].with_mask(masks[(n, s)]) for n in spec.subsets for s in spec.seeds
    }
    put(
        "pretrain_coupled",
        [coupling(inits[s], pre_problem[(n, s)]).coupled for n, _, s in cell_keys],
        np.int8,
    )
    put(
        "pretrain_components",
        [len(bipartite_components(pre_problem[(n, s)])) for n, _, s in cell_keys],
        np.int16,
    )
    put("pretrain_observed", [masks[(n, s)].sum() for n, _, s in cell_keys], np.int16)
    put("observed", [np.asarray(problems[s].mask).sum() for _, _, s in cell_keys], np.int16)

    flows = _run_method(spec, cell_keys, problems, inits, pre_problem, "flow")
    for name, values in flows.items():
        put(name, values, np.int8 if name.startswith("status") else np.float64)
    if spec.sgd_lrs:
        sgd = _run_method(spec, cell_keys, problems, inits, pre_problem, "sgd")
        for name, values in sgd.items():
            dtype = np.int8 if name.startswith("status") else np.float64
            put("sgd_" + name, np.moveaxis(np.asarray(values), 0, -1), dtype, lr_axis=True)
    return out


def _run_method(spec, cell_keys, problems, inits, pre_problem, method) -> dict:
    """Pretrain (to the endpoint and stopped early), warm and cold runs of every cell of a
    unit, by the exact flow (`method="flow"`) or by gradient descent at every `sgd_lrs` (then
    each array has a leading `lr` axis)."""
    lrs = spec.sgd_lrs if method == "sgd" else (None,)
    seeds = spec.seeds
    pre_end = {}
    for stop in spec.pretraining:
        keys = [(n, s) for n in spec.subsets for s in seeds]
        jobs = [(pre_problem[k], inits[k[1]], lr) for lr in lrs for k in keys]
        results = _batch(spec, jobs, method, stop == "early")
        for i, (lr, key) in enumerate((lr, k) for lr in lrs for k in keys):
            pre_end[(lr, stop) + key] = results[i]
    # warm from each pretrained model, and cold from each init, in one batch
    jobs, tags = [], []
    for lr in lrs:
        for n, stop, s in cell_keys:
            jobs.append((problems[s], pre_end[(lr, stop, n, s)].model, lr))
            tags.append(("warm", lr, n, stop, s))
        for s in seeds:
            jobs.append((problems[s], inits[s], lr))
            tags.append(("cold", lr, s))
    results = _batch(spec, jobs, method, False)
    warm = {t[1:]: r for t, r in zip(tags, results, strict=True) if t[0] == "warm"}
    cold = {t[1:]: r for t, r in zip(tags, results, strict=True) if t[0] == "cold"}

    out = {k: [] for k in _VALUES}
    for lr in lrs:
        rows = {k: [] for k in _VALUES}
        for n, stop, s in cell_keys:
            p, w, c = pre_end[(lr, stop, n, s)], warm[(lr, n, stop, s)], cold[(lr, s)]
            truth = problems[s]
            theta_p = _flat(p.model)
            values = {
                "status_pretrain": int(p.status),
                "status_warm": int(w.status),
                "status_cold": int(c.status),
                "loss_pretrain": float(p.loss / p.loss_init),
                "steps_pretrain": float(p.num_steps),
                "t_pretrain": float(p.t_end),
                "error_warm": unobserved_error(w.model, truth)["rel"],
                "error_cold": unobserved_error(c.model, truth)["rel"],
                "srank_pretrain": stable_rank(p.model),
                "srank_warm": stable_rank(w.model),
                "srank_cold": stable_rank(c.model),
                "distance_warm": float(
                    np.linalg.norm(_flat(w.model) - theta_p) / np.linalg.norm(theta_p)
                ),
                "distance_cold": float(
                    np.linalg.norm(_flat(c.model) - _flat(inits[s]))
                    / np.linalg.norm(_flat(inits[s]))
                ),
            }
            for k in _VALUES:
                rows[k].append(values[k])
        for k in _VALUES:
            out[k].append(rows[k])
    return {k: v[0] if method == "flow" else v for k, v in out.items()}


_VALUES = (
    "status_pretrain",
    "status_warm",
    "status_cold",
    "loss_pretrain",
    "steps_pretrain",
    "t_pretrain",
    "error_warm",
    "error_cold",
    "srank_pretrain",
    "srank_warm",
    "srank_cold",
    "distance_warm",
    "distance_cold",
)


def _batch(spec, jobs, method, early) -> list:
    """Run (problem, start, η) jobs as one vmapped batch; one result per job. Flows finish
    their stiff tails apart (`tails="apart"`), so the batch does not wait for its stiffest."""
    problems = stack([j[0] for j in jobs])
    models = stack([j[1] for j in jobs])
    if method == "flow":
        options = spec.options
        if early:
            options = dataclasses.replace(options, stop_loss=spec.early_loss)
        result = flow_batch(problems, models, options, tails="apart")
    else:
        counts = np.array([float(np.asarray(j[0].mask).sum()) for j in jobs])
        lr = np.array([j[2] for j in jobs]) * 2.0 / counts  # η on the mean loss
        options = DescentOptions(
            "sgd",
            lr=1.0,
            max_steps=spec.sgd_steps,
            rtol=spec.sgd_rtol,
            stop_loss=spec.early_loss if early else None,
        )
        result = descend_batch(problems, models, options, lr=lr)
    result = jax.tree_util.tree_map(np.asarray, result)
    return [result.member(i) for i in range(len(jobs))]


# --- the store ----------------------------------------------------------------------------------

STATUS_VARIABLES = ("status_pretrain", "status_warm", "status_cold")


def _template(spec: PlasticityMapSpec):
    import xarray as xr

    dims = list(spec.axes)
    shape = spec.shape
    data = {}
    for name in _VALUES:
        int_var = name.startswith("status")
        fill = int(Status.PENDING) if int_var else np.nan
        data[name] = (dims, np.full(shape, fill, np.int8 if int_var else np.float64))
        if spec.sgd_lrs:
            data["sgd_" + name] = (
                dims + ["lr"],
                np.full(shape + (len(spec.sgd_lrs),), fill, np.int8 if int_var else np.float64),
            )
    data["pretrain_coupled"] = (dims, np.full(shape, -1, np.int8))
    data["pretrain_components"] = (dims, np.full(shape, -1, np.int16))
    data["pretrain_observed"] = (dims, np.full(shape, -1, np.int16))
    data["observed"] = (dims, np.full(shape, -1, np.int16))
    data["wall_time_s"] = (dims[:3], np.full(shape[:3], np.nan))
    data["done"] = (dims[:3], np.zeros(shape[:3], dtype=bool))
    coords = {k: np.array(v) for k, v in spec.axes.items()}
    if spec.sgd_lrs:
        coords["lr"] = np.array(spec.sgd_lrs, dtype=np.float64)
    ds = xr.Dataset(data, coords=coords)
    ds.attrs["spec"] = spec.to_json()
    ds.attrs["layout"] = LAYOUT
    ds.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return ds


def _open_or_create(path, spec: PlasticityMapSpec, resume: bool):
    """The map's store at `path` (`open_store`), one zarr chunk per work unit."""

    def make():
        template = _template(spec)
        chunks = {
            name: tuple(1 if i < 3 else n for i, n in enumerate(var.shape))
            for name, var in template.data_vars.items()
        }
        return template, chunks

    older = "holds a plasticity map of an older layout; use another path"
    return open_store(path, resume, make, spec.to_json(), "plasticity map", LAYOUT, older)


def _write_unit(path, unit, values: dict, wall: float):
    """The unit's results, then its `done` flag: a unit killed half-way stays not done."""
    import zarr

    group = zarr.open_group(os.fspath(path), mode="r+")
    for name, arr in values.items():
        group[name][unit] = arr
    group["wall_time_s"][unit] = wall
    group["done"][unit] = True


def plasticity_map(
    spec: PlasticityMapSpec | str = "default", out=None, *, resume=False, progress=True
):
    """Run a plasticity map (a `PlasticityMapSpec`, or a preset name: `small`, `default`,
    `full`) and return it as an `xarray.Dataset` with dimensions depth, alpha, init, subset,
    pretraining, seed (and lr for descent's variables).

    With `out` (a `.zarr` path) every finished unit (one depth, α and init: all its cells) is
    written as it completes; `resume=True` continues an interrupted store and recomputes only
    unfinished units. Ctrl-C keeps every finished unit. Statuses are `Status` codes: read the
    map through `plasticity_deficit` and `plasticity_verdicts`, which show only endpoints.
    """
    import xarray as xr
    from tqdm.auto import tqdm

    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown preset {spec!r}; choose from {sorted(PRESETS)}")
        spec = PRESETS[spec]
    ds = _template(spec) if out is None else _open_or_create(out, spec, resume)
    done = np.asarray(ds["done"].values)
    todo = [u for u in spec.units() if not done[u]]
    bar = tqdm(
        total=done.size,
        initial=done.size - len(todo),
        unit="unit",
        desc="plasticity map",
        disable=not progress,
    )
    try:
        for unit in todo:
            i, j, k = unit
            depth, alpha, init = spec.depths[i], spec.alphas[j], spec.inits[k]
            bar.set_postfix_str(f"L={depth} α={alpha:g} {init}")
            start = time.perf_counter()
            values = run_unit(spec, depth, alpha, init)
            wall = time.perf_counter() - start
            if out is None:
                for name, arr in values.items():
                    ds[name].values[unit] = arr
                ds["wall_time_s"].values[unit] = wall
                ds["done"].values[unit] = True
            else:
                _write_unit(out, unit, values, wall)
            bar.update(1)
    except KeyboardInterrupt:
        bar.close()
        where = f" in {out}" if out else ""
        print(f"plasticity map: interrupted; finished units are saved{where}")
        raise
    bar.close()
    if out is not None:
        ds = xr.open_zarr(out, consolidated=False).load()
    return ds


def load_plasticity_map(path):
    """A plasticity-map store, loaded into memory."""
    import xarray as xr

    ds = xr.open_zarr(path, consolidated=False).load()
    if ds.attrs.get("layout") != LAYOUT:
        raise ValueError(f"{path} is not a plasticity-map store")
    return ds


def map_spec(ds) -> PlasticityMapSpec:
    return PlasticityMapSpec.from_json(ds.attrs["spec"])
