"""Running a sweep: chunk after chunk as vmapped batches, each written to the store when done."""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from ..analysis import (
    effective_rank_of,
    family_spectrum,
    reproducible_digits,
    stable_rank_excess_of,
    stable_rank_of,
)
from ..analysis._sensitivity import perturb
from ..engine import Status, stack
from ..engine._flow import _compiled_solver, finish_tails, flow_blas_threads
from ._build import build_chunk
from ._spec import SweepSpec, execution_order
from ._store import _chunk_indices, _open_or_create, _template, write_points


def run_chunk(spec: SweepSpec, chosen: list[dict], devices=None, indices=None) -> dict:
    """Integrate the flows of one chunk (grid points as parameter dicts) as one vmapped batch,
    padded to `chunk_size` so every chunk of a group shares one compiled program; returns
    per-point result arrays. With `spec.sensitivity`, the chunk is run again from perturbed
    inits (keyed by the points' canonical `indices`, so a point's perturbations do not depend
    on its chunk) and the reproducible digits are added."""
    n_dev = len(devices) if devices else 1
    size = -(-spec.chunk_size // n_dev) * n_dev  # every device gets an equal slice
    padded = chosen + [chosen[-1]] * (size - len(chosen))
    pad_to = spec.max_depth if spec.pads_depths else None
    problems, models = build_chunk(padded, spec.problem, spec.init, pad_to)
    depths = None
    if pad_to is not None:
        depths = np.array([int(p["depth"]) for p in padded], dtype=np.int32)
    compiled, _ = _compiled_solver(
        problems,
        models,
        spec.options,
        in_axes=(0, 0),
        devices=devices,
        depths=depths,
        defer_tail=spec.tails == "apart",
    )

    def solve(models):
        with flow_blas_threads(problems, models, spec.options):
            args = (problems, models) if depths is None else (problems, models, depths)
            result = jax.block_until_ready(compiled(*args))  # before the threads are restored
        if spec.tails == "apart":
            # Stiff tails finish apart, side by side on the cores: the batch waits for none.
            result = finish_tails(problems, models, result, spec.options, depths)
        return jax.block_until_ready(result)

    n = len(chosen)
    out = _endpoints(spec, chosen, solve(models), n)
    if spec.sensitivity:
        indices = list(range(n)) if indices is None else list(indices)
        keys = [jax.random.fold_in(jax.random.key(0), i) for i in indices]
        keys += keys[-1:] * (size - n)
        runs = [out]
        for j in range(1, spec.sensitivity + 1):
            perturbed = stack(
                [
                    perturb(_member(models, b), spec.sensitivity_eps, jax.random.fold_in(k, j))
                    for b, k in enumerate(keys)
                ]
            )
            runs.append(_endpoints(spec, chosen, solve(perturbed), n))
        out |= _digits(runs)
    del out["_stable_rank_excess"]
    steps = out["num_steps"].astype(float)
    out["batch_efficiency"] = np.full(n, steps.mean() / max(steps.max(), 1.0))
    return out


def _member(models, b):
    return jax.tree_util.tree_map(lambda x: x[b], models)


def _endpoints(spec: SweepSpec, chosen: list[dict], result, n: int) -> dict[str, np.ndarray]:
    """The stored per-point quantities of the first `n` members of a batched result."""
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
    out["_stable_rank_excess"] = np.array([stable_rank_excess_of(s) for s in sigma])
    if spec.init == "identity" and spec.problem != "bernoulli":
        n_blocks = [p["dim"] if spec.problem == "diagonal" else p["blocks"] for p in chosen]
        s_blocks = [1 if spec.problem == "diagonal" else p["block_size"] for p in chosen]
        spectra = [
            family_spectrum(result.member(i).model, n_blocks[i], s_blocks[i]) for i in range(n)
        ]
        out["log_sigma_a_layers"] = np.array([s["log_sigma_a"] for s in spectra])
        out["log_sigma_b_layers"] = np.array([s.get("log_sigma_b", np.nan) for s in spectra])
    return out


def _digits(runs: list[dict]) -> dict[str, np.ndarray]:
    """Reproducible digits per point over the unperturbed run and its perturbed reruns; −1
    where a member did not converge (not an endpoint: no digits to judge)."""
    converged = np.all([r["status"] == int(Status.CONVERGED) for r in runs], axis=0)
    n, top = runs[0]["sigma"].shape

    def digits(values):  # (runs, n) → (n,)
        return np.array(
            [reproducible_digits(values[:, i]) if converged[i] else -1 for i in range(n)],
            dtype=np.int8,
        )

    sigma = np.stack([r["sigma"] for r in runs])
    out = {
        "digits_sigma": np.stack(
            [
                digits(sigma[:, :, k]) if np.isfinite(sigma[0, 0, k]) else np.full(n, -1, np.int8)
                for k in range(top)
            ],
            axis=1,
        ).astype(np.int8),
        "digits_stable_rank_excess": digits(np.stack([r["_stable_rank_excess"] for r in runs])),
    }
    if "log_sigma_b_layers" in runs[0]:
        sigma_b = np.exp(np.stack([r["log_sigma_b_layers"] for r in runs]))
        out["digits_sigma_b_layers"] = digits(sigma_b)
    return out


def sweep(spec: SweepSpec, out=None, *, resume=False, progress=True, devices=None, worker=None):
    """Run every flow of `spec` and return the results as an `xarray.Dataset` with one
    dimension per axis, the same grid the store holds.

    With `out` (a path ending in `.zarr`), results stream into that store chunk by chunk;
    `resume=True` continues a store left by an interrupted run, recomputing only unfinished
    chunks. Ctrl-C stops after the chunk in flight is discarded; every finished chunk is kept.
    `devices`: spread each batch over these JAX devices (default: all local devices).
    `worker=(k, n)`: one of n independent processes (hosts, Slurm array tasks) sharing the
    store `out`: this one runs the chunks whose index is k mod n (and implies `resume`). Each
    point is its own zarr chunk, so workers never write the same file; rerunning a worker after
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
    ds = _template(spec) if out is None else _open_or_create(out, spec, resume)
    done = np.asarray(ds["done"].values).ravel()
    run_id = os.getpid()
    mine = _chunk_indices(order, worker)
    todo = [idx for idx in mine if not done[idx].all()]
    total = sum(len(idx) for idx in mine)
    bar = _progress(len(todo), total - sum(len(idx) for idx in todo), total, progress)
    try:
        for idx in todo:
            start = time.perf_counter()
            res = run_chunk(spec, [points[i] for i in idx], devices, idx)
            wall = time.perf_counter() - start
            res["wall_time_s"] = np.full(len(idx), wall / len(idx))
            res["run_id"] = np.full(len(idx), run_id, dtype=np.int64)
            if out is None:
                where = np.unravel_index(idx, spec.shape)
                for name, values in res.items():
                    ds[name].values[where] = values
                ds["done"].values[where] = True
            else:
                write_points(out, spec, idx, res)
            bar.update(len(idx))
    except KeyboardInterrupt:
        bar.close()
        print(
            f"gflow sweep: interrupted; finished chunks are saved{' in ' + str(out) if out else ''}"
        )
        raise
    bar.close()
    if out is not None:
        ds = xr.open_zarr(out, consolidated=False).load()
    return ds


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
