"""Running a sweep: chunk after chunk as vmapped batches, their stiff tails side by side across
chunks, each chunk written to the store when its last tail is done."""

from __future__ import annotations

import numbers
import os
import queue
import threading
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
from ..engine import Status, _threads, stack
from ..engine._flow import PendingTails, _compiled_solver, flow_blas_threads
from ._build import build_chunk
from ._spec import SweepSpec, execution_order
from ._store import _chunk_indices, _open_or_create, _template, write_points


class StartedChunk:
    """A chunk of grid points (parameter dicts) whose batched heads have run (padded to
    `chunk_size`, so that every chunk of a group shares one compiled program; with
    `tails="apart"`, up to where each member's stiff tail would begin; with `sensitivity`,
    also from the perturbed inits, keyed by the points' canonical `indices`): `calls` are
    its points' pending stiff tails (never the padding's), to run anywhere and side by
    side, and `finish(results)` gives the chunk's per-point arrays from their results (in
    the order of `calls`). Each point's `wall_time_s` is its share of the heads' time plus
    its own tails' time."""

    def __init__(self, spec: SweepSpec, chosen: list[dict], devices=None, indices=None):
        start = time.perf_counter()
        self.spec, self.chosen, self.n = spec, chosen, len(chosen)
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

        def head(models):
            with flow_blas_threads(problems, models, spec.options):
                args = (problems, models) if depths is None else (problems, models, depths)
                result = jax.block_until_ready(compiled(*args))  # before the threads are restored
            # With tails="apart", stiff tails finish apart, side by side on the cores: the
            # batch waits for none (with "batch", none is pending).
            return PendingTails(problems, models, result, spec.options, depths, self.n)

        self.runs = [head(models)]
        if spec.sensitivity:
            indices = list(range(self.n)) if indices is None else list(indices)
            keys = [jax.random.fold_in(jax.random.key(0), i) for i in indices]
            keys += keys[-1:] * (size - self.n)
            for j in range(1, spec.sensitivity + 1):
                perturbed = stack(
                    [
                        perturb(_member(models, b), spec.sensitivity_eps, jax.random.fold_in(k, j))
                        for b, k in enumerate(keys)
                    ]
                )
                self.runs.append(head(perturbed))
        self.head_time_s = time.perf_counter() - start
        # each tail timed where it runs, and charged to its member
        self.calls, self.owners, self.members = [], [], []
        for run in self.runs:
            for i, call in zip(run.pending, run.calls, strict=True):
                self.calls.append(self._timed(call, len(self.calls)))
                self.owners.append(run)
                self.members.append(i)
        self.call_time_s = [0.0] * len(self.calls)

    def _timed(self, call, k):
        def timed():
            start = time.perf_counter()
            result = call()
            self.call_time_s[k] = time.perf_counter() - start
            return result

        return timed

    def label(self, k) -> str:
        """The grid point of call `k`, by its axes (`depth=5 alpha=0.0001 seed=2`); a
        sensitivity rerun's is marked `perturbed`."""
        point = self.chosen[self.members[k]]
        value = lambda v: f"{v:g}" if isinstance(v, numbers.Real) else str(v)
        text = " ".join(f"{name}={value(point[name])}" for name in self.spec.axes)
        return text if self.owners[k] is self.runs[0] else f"{text} perturbed"

    def finish(self, results) -> dict:
        """The per-point arrays of the chunk, from its tails' `results` (in `calls` order)."""
        mine = {id(run): [] for run in self.runs}
        for run, result in zip(self.owners, results, strict=True):
            mine[id(run)].append(result)
        endpoints = [
            _endpoints(self.spec, self.chosen, run.assemble(mine[id(run)]), self.n)
            for run in self.runs
        ]
        out = endpoints[0]
        if self.spec.sensitivity:
            out |= _digits(endpoints)
        del out["_stable_rank_excess"]
        steps = out["num_steps"].astype(float)
        out["batch_efficiency"] = np.full(self.n, steps.mean() / max(steps.max(), 1.0))
        tail_time_s = np.zeros(self.n)
        for i, seconds in zip(self.members, self.call_time_s, strict=True):
            if i < self.n:  # not padding
                tail_time_s[i] += seconds
        out["wall_time_s"] = self.head_time_s / self.n + tail_time_s
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
    chunks. Ctrl-C stops at once, discarding the chunks in flight; every finished chunk is kept.
    The stiff tails of `tails="apart"` run side by side on the CPU cores across chunks: while a
    long tail runs, the next chunks' heads and tails go on (at most one chunk more than there
    are cores in flight), and each chunk is saved as soon as its last tail is done.
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

    def save(idx, res):
        res["run_id"] = np.full(len(idx), run_id, dtype=np.int64)
        if out is None:
            where = np.unravel_index(idx, spec.shape)
            for name, values in res.items():
                ds[name].values[where] = values
            ds["done"].values[where] = True
        else:
            write_points(out, spec, idx, res)
        bar.update(len(idx))

    cores = _threads.available_cores()
    threads = 1 if spec.options.tails_run_alone else cores
    report = bar.set_postfix_str if progress else None
    pool = _TailPool(threads, open_chunks=open_chunks(cores), report=report)
    try:
        # Tails side by side, across chunks too: one BLAS thread each (`_threads`).
        with _threads.blas_threads(1 if cores > 1 else None):
            for idx in todo:
                pool.wait_for_room(save)
                pool.submit(idx, StartedChunk(spec, [points[i] for i in idx], devices, idx))
                pool.save_finished(save, block=False)
            pool.save_finished(save, block=True)
    except KeyboardInterrupt:
        pool.close(wait=False)  # a tail in flight is not waited for
        bar.close()
        print(
            f"gflow sweep: interrupted; finished chunks are saved{' in ' + str(out) if out else ''}"
        )
        raise
    except BaseException:
        pool.close(wait=False)
        raise
    pool.close(wait=True)
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


def open_chunks(cores: int) -> int:
    """Chunks a sweep keeps in flight: one more than the cores, so that a core freed by a
    finished tail finds the next chunk's tails ready (with 1, a sweep would finish chunk by
    chunk, each waiting for its slowest tail: `scale` benchmarks both)."""
    return cores + 1


class _TailPool:
    """The stiff tails of started chunks (`StartedChunk.calls`), run on `threads` daemon
    threads (so that Ctrl-C or an error reaches the caller at once) whatever chunk they
    belong to; a chunk is finished, in the calling thread, once its last tail is done. At most
    `open_chunks` chunks are in flight: `wait_for_room` saves finished ones until there is
    room for the next. `report` (a progress bar's postfix) is given `activity()` every
    `report_every` seconds from a thread of its own, heads running or not: a sweep's last
    chunks can run one long tail for minutes while the bar, which counts saved points, stands
    still."""

    def __init__(self, threads: int, open_chunks: int, report=None, report_every=1.0):
        self.todo, self.finished = queue.Queue(), queue.Queue()
        self.lock = threading.Lock()
        self.open, self.open_chunks, self.closed = 0, open_chunks, False
        self.running = {}  # thread → (label, start)
        self.stop_reporting = threading.Event()
        self.threads = [
            threading.Thread(target=self._work, name="gflow-tails", daemon=True)
            for _ in range(threads)
        ]
        self.reporter = None
        if report is not None:
            self.reporter = threading.Thread(
                target=self._report, args=(report, report_every), name="gflow-progress", daemon=True
            )
            self.reporter.start()
        for thread in self.threads:
            thread.start()

    def submit(self, idx, chunk: StartedChunk):
        self.open += 1
        if not chunk.calls:
            self.finished.put((idx, chunk, [], None))
            return
        state = {"left": len(chunk.calls), "results": [None] * len(chunk.calls)}
        for j, call in enumerate(chunk.calls):
            self.todo.put((idx, chunk, state, j, call))

    def _work(self):
        while True:
            task = self.todo.get()
            if task is None:  # closed: the thread ends
                return
            idx, chunk, state, j, call = task
            me = threading.get_ident()
            with self.lock:
                skip = self.closed
                if not skip:
                    self.running[me] = (chunk.label(j), time.monotonic())
            if skip:
                continue
            error = None
            try:
                state["results"][j] = call()
            except BaseException as e:  # handed to the caller, which raises it
                error = e
            with self.lock:
                del self.running[me]
                state["left"] -= 1
                last = state["left"] == 0
            if error is not None or last:
                self.finished.put((idx, chunk, state["results"], error))

    def activity(self) -> str:
        """The tails in flight: `2 tails running (longest: depth=5 alpha=0.0001 seed=2, 41 s),
        3 waiting`; empty where none is."""
        with self.lock:
            running = list(self.running.values())
        waiting = self.todo.qsize()  # tails no thread has taken yet
        if not running and not waiting:
            return ""
        text = f"{len(running)} tail{'s' * (len(running) != 1)} running"
        if running:
            label, start = min(running, key=lambda item: item[1])
            text += f" (longest: {label}, {time.monotonic() - start:.0f} s)"
        return text + (f", {waiting} waiting" if waiting else "")

    def _report(self, report, every: float):
        while not self.stop_reporting.wait(every):
            report(self.activity())
        report("")  # a finished bar carries no stale postfix

    def save_finished(self, save, block: bool):
        """Finish and `save(idx, per-point arrays)` every chunk whose tails are done; with
        `block`, wait until no chunk is in flight."""
        while self.open > 0:
            if not self._save_next(save, wait=block) and not block:
                return

    def wait_for_room(self, save):
        while self.open >= self.open_chunks:
            self._save_next(save, wait=True)

    def _save_next(self, save, wait: bool) -> bool:
        """Finish and save the next finished chunk, if there is one (waiting up to 0.2 s, so
        that a wait never holds up Ctrl-C); raise the error of a tail that failed."""
        try:
            item = self.finished.get(timeout=0.2) if wait else self.finished.get_nowait()
        except queue.Empty:
            return False
        idx, chunk, results, error = item
        if error is not None:
            raise error
        self.open -= 1
        save(idx, chunk.finish(results))
        return True

    def close(self, wait: bool):
        """Start no further tail; each thread ends once the tail it runs (if any) is done. With
        `wait`, return once they have ended: a thread still tearing down (freeing the compiled
        programs and arrays it held) while the interpreter exits aborts the process."""
        self.closed = True
        self.stop_reporting.set()
        for _ in self.threads:
            self.todo.put(None)
        if wait:
            for thread in self.threads + [self.reporter] * (self.reporter is not None):
                thread.join()
