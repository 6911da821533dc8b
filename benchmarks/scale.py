"""Field-size problems: exact flows on random masks at d = 20…200, against optax SGD at
matched accuracy, and a random-mask sweep with its stiff tails apart and batched.

Each size runs in a fresh process (`python -m benchmarks.scale D`), so that its peak memory
(resident set) is its own. The problem is Arora et al.'s kind: a d × d rank-5 target seen on
a Bernoulli(0.3) mask, L = 3, Gaussian init of scale 0.1.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import gflow
from gflow.engine import _threads
from gflow.sweeps import _run as sweep_run

from .runoff import SWEEP_MAX_STEPS, SWEEP_RTOL

TOP = 5  # the target's rank: the singular values compared


def problem_and_init(d: int):
    problem = gflow.bernoulli(d, d, 0.3, TOP, key=jax.random.key(0))
    init = gflow.gaussian((d,) * 4, 0.1, key=jax.random.key(1))
    return problem, init


def _endpoint_error(problem, reference):
    """model ↦ its largest relative error against the flow's endpoint `reference`: over the
    top singular values and the unobserved error (the reference's measured once)."""
    s_ref = gflow.singular_values(reference)[:TOP]
    u_ref = gflow.unobserved_error(reference, problem)["rel"]

    def error(model) -> float:
        s = gflow.singular_values(model)[:TOP]
        u = gflow.unobserved_error(model, problem)["rel"]
        return max(float(np.max(np.abs(s - s_ref) / s_ref)), abs(u - u_ref) / u_ref)

    return error


def _largest_hessian_eigenvalue(model, problem, iterations=60) -> float:
    """λ_max(∇²loss) by power iteration on Hessian-vector products (no P × P matrix)."""
    from jax.flatten_util import ravel_pytree

    flat, unravel = ravel_pytree(model)
    grad = jax.grad(lambda theta: unravel(theta).loss(problem))
    hvp = jax.jit(lambda v: jax.jvp(grad, (flat,), (v,))[1])
    v = jax.random.normal(jax.random.key(2), flat.shape, flat.dtype)
    lam = 0.0
    for _ in range(iterations):
        w = hvp(v / jnp.linalg.norm(v))
        lam, v = float(jnp.linalg.norm(w)), w
    return lam


def one_size(d: int, sgd_budget_s: float) -> dict:
    """gflow's exact flow at size d, then SGD from the same init in segments until it is
    within 1e-4 and 1e-6 of the flow's endpoint (singular values and unobserved error) or
    its time budget is spent."""
    problem, init = problem_and_init(d)
    r = gflow.flow(problem, init)
    row = {
        "d": d,
        "observed": int(np.sum(np.asarray(problem.mask))),
        "parameters": 3 * d * d,
        "status": r.status_label,
        "loss_relative": float(r.loss) / float(r.loss_init),
        "solve_s": r.wall_time_s,
        "compile_s": r.compile_time_s,
        "steps": int(r.num_steps),
        "linear_iters": int(r.num_linear_iters),
        "factorizations": int(r.num_factorizations),
        "work": r.work(),
        "top_singular_values": gflow.singular_values(r.model)[:TOP].tolist(),
    }
    top = np.asarray(row["top_singular_values"])
    # Side by side: the previous default tableau (RODAS4, which loses order on stiff tails),
    # and a looser tail step control (`tail_rtol`, the stopping rule unchanged): the ratio of
    # solve times, and how far apart the endpoints are.
    row["rodas4"] = _variant(problem, init, top, rosenbrock="rodas4")
    row["tail_rtol_1e-8"] = _variant(problem, init, top, tail_rtol=1e-8)
    row |= _sgd_at_matched_accuracy(problem, init, r, sgd_budget_s)
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def _variant(problem, init, top, **options) -> dict:
    """The same flow with other options: its work and how far its top singular values are
    from `top` (the default's), relative."""
    r = gflow.flow(problem, init, **options)
    return {
        "status": r.status_label,
        "solve_s": r.wall_time_s,
        "steps": int(r.num_steps),
        "tail_steps": sum(
            r.work().get(phase, {}).get("steps", 0) for phase in ("stiff tail", "radau tail")
        ),
        "linear_iters": int(r.num_linear_iters),
        "factorizations": int(r.num_factorizations),
        "sigma_max_relative_difference": float(
            np.max(np.abs(gflow.singular_values(r.model)[:TOP] - top) / top)
        ),
    }


def _sgd_at_matched_accuracy(problem, init, flow, budget_s, targets=(1e-4, 1e-6)) -> dict:
    """SGD from the same init at lr = 1/λ_max (half its stability limit at the endpoint), then
    at lr/4, lr/16, … while the time budget lasts. Each run goes in segments (plain SGD has no
    state: resuming from the last iterate is exact) until it is within a target of the flow's
    endpoint or has converged to its own, biased one.

    Per target: the measured SGD time where a run got there (the fastest run), else, when
    the converged runs' error is ∝ lr (fitted slope 0.8…1.2), the extrapolated time at the lr
    that would reach it (steps ∝ 1/lr, measured time per step), else a lower bound: the time
    SGD spent without getting there."""
    lam = _largest_hessian_eigenvalue(flow.model, problem)
    segment = 20_000  # descend's wall time leaves out its compilation
    endpoint_error = _endpoint_error(problem, flow.model)
    runs, spent = [], 0.0
    lr = 1.0 / lam
    while spent < budget_s:
        model, wall, steps, reached = init, 0.0, 0, {}
        while spent + wall < budget_s:
            run = gflow.descend(problem, model, lr=lr, max_steps=segment)
            wall += run.wall_time_s
            steps += int(run.num_steps)
            model = run.model
            error = endpoint_error(model)
            for eps in targets:
                if eps not in reached and error <= eps:
                    reached[eps] = wall
            if run.status_label != "max_steps" or len(reached) == len(targets):
                break
        spent += wall
        runs.append(
            {"lr": lr, "steps": steps, "wall_s": wall, "status": run.status_label}
            | {"error": error, "reached_s": {str(k): v for k, v in reached.items()}}
        )
        if len(reached) == len(targets) or run.status_label != "converged":
            break
        lr /= 4
    converged = [x for x in runs if x["status"] == "converged"]
    slope = None
    if len(converged) >= 2:
        slope = gflow.loglog_slope([x["lr"] for x in converged], [x["error"] for x in converged])
    t_step = sum(x["wall_s"] for x in runs) / max(sum(x["steps"] for x in runs), 1)
    samples = {}  # the flow's trajectory, run only if a lower bound needs it
    out = []
    for eps in targets:
        times = [x["reached_s"][str(eps)] for x in runs if str(eps) in x["reached_s"]]
        row = {"target": eps}
        if times:
            row |= {"sgd_s": min(times), "ratio": min(times) / flow.wall_time_s}
        elif slope is not None and 0.8 <= slope <= 1.2:
            c = float(np.exp(np.mean([np.log(x["error"] / x["lr"]) for x in converged])))
            lr_needed = eps / c
            flow_time = float(np.mean([x["steps"] * x["lr"] for x in converged]))
            estimate = flow_time / lr_needed * t_step
            row |= {
                "sgd_lr_needed": lr_needed,
                "sgd_s_extrapolated": estimate,
                "ratio_extrapolated": estimate / flow.wall_time_s,
            }
        else:
            # SGD follows the flow (iterate k at t = k·lr) with lr < 2/λ_max, so it needs at
            # least t_ε·λ_max/2 steps, t_ε the flow time before which the flow itself is
            # still more than ε from its endpoint (in the same error as SGD's).
            t_eps = _flow_time_to_within(problem, init, eps, samples)
            least = max(spent, t_eps * lam / 2 * t_step)
            row |= {
                "flow_time_to_within": t_eps,
                "sgd_s_at_least": least,
                "ratio_at_least": least / flow.wall_time_s,
            }
        out.append(row)
    sgd = {"lambda_max": lam, "runs": runs, "slope": slope, "time_per_step_s": t_step}
    return {"sgd": sgd, "targets": out}


def _flow_time_to_within(problem, init, eps, samples) -> float:
    """The last sampled flow time at which the flow is still more than eps from the endpoint
    of the same sampled flow, in `_endpoint_error` (top singular values and unobserved error,
    relative): SGD's own measure."""
    if "errors" not in samples:
        run = gflow.flow(problem, init, save=200, save_layers=True)
        t = np.asarray(run.trajectory.t)
        valid = np.flatnonzero(np.isfinite(t))
        error = _endpoint_error(problem, run.model)
        layers = run.trajectory.layers.layers
        samples["t"] = t[valid]
        samples["errors"] = np.array(
            [error(gflow.Factorization([np.asarray(w[i]) for w in layers])) for i in valid]
        )
    outside = np.flatnonzero(samples["errors"] > eps)
    return float(samples["t"][outside[-1]]) if len(outside) else 0.0


@contextlib.contextmanager
def _chunk_by_chunk():
    """gflow before a sweep's tails ran across chunks: each chunk's tails side by side, and
    the next chunk only once the slowest of them is done."""
    saved = sweep_run.open_chunks
    sweep_run.open_chunks = lambda cores: 1
    try:
        yield
    finally:
        sweep_run.open_chunks = saved


@contextlib.contextmanager
def _tails_one_at_a_time():
    """gflow before tails ran side by side: one pending tail at a time, and SciPy's OpenBLAS
    (which jaxlib's factorisations call) with its threads as they are."""
    saved = _threads.available_cores, _threads.ONE_THREAD_UP_TO
    _threads.available_cores, _threads.ONE_THREAD_UP_TO = (lambda: 1), -1
    try:
        with _chunk_by_chunk():
            yield
    finally:
        _threads.available_cores, _threads.ONE_THREAD_UP_TO = saved


def random_mask_sweep(quick: bool) -> dict:
    """The issue's sweep: d = 8 random masks (density 0.5, rank 2), Gaussian inits, depths
    2–5 × α 1e-1…1e-4 × 4 seeds (112 flows; quick: 2 depths × 2 α × 4 seeds), chunks of 8;
    stiff tails apart (the default: side by side on the cores across chunks, one BLAS thread
    each) and chunk by chunk (each chunk waiting for its slowest tail before the next starts,
    as sweeps did before); on the quick grid also with the tails one at a time (BLAS threads
    as they are) and with the tails batched. The quick grid runs once first to compile (the
    full grid a grid of one point per depth), so that every mode is timed warm."""
    depths = [2, 3] if quick else [2, 3, 4, 5]
    alphas = [1e-1, 1e-2] if quick else [1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4]
    spec = dict(
        axes={"depth": depths, "alpha": alphas, "seed": [0, 1, 2, 3]},
        fixed={"dim": 8, "density": 0.5, "rank": 2},
        problem="bernoulli",
        init="gaussian",
        options=gflow.FlowOptions(rtol=SWEEP_RTOL, max_steps=SWEEP_MAX_STEPS),
        chunk_size=8,
    )
    out = {"flows": int(np.prod([len(depths), len(alphas), 4]))}
    results = {}
    modes = {
        "apart": ("apart", contextlib.nullcontext),
        "chunk by chunk": ("apart", _chunk_by_chunk),
    }
    if quick:
        modes["one at a time"] = ("apart", _tails_one_at_a_time)
        modes["batch"] = ("batch", contextlib.nullcontext)
        for tails in ("apart", "batch"):  # compile first
            gflow.sweep(gflow.SweepSpec(**spec, tails=tails), progress=False)
    else:  # compile first: the batch's program and a tail's for every depth
        # Seed 1 at α = 1e-2 converges within seconds at every depth (seed 0's depth-5 flow
        # runs out of its 100k tail steps: 430–540 s of warm-up); its depth-2 flow ends
        # before a stiff tail, seed 0's has one.
        for seeds, warm_depths in (([1], depths), ([0], [2])):
            axes = {"depth": warm_depths, "alpha": [1e-2], "seed": seeds}
            gflow.sweep(gflow.SweepSpec(**dict(spec, axes=axes)), progress=False)
    for mode, (tails, context) in modes.items():
        start = time.perf_counter()
        with context():
            ds = gflow.sweep(gflow.SweepSpec(**spec, tails=tails), progress=False)
        wall = time.perf_counter() - start
        status = np.asarray(ds.status.values).ravel()
        results[mode] = ds
        codes = np.asarray(ds.status.values)
        out[mode] = {
            "wall_s": wall,
            "converged": int(np.sum(status == 0)),
            "max_steps": int(np.sum(status == int(gflow.Status.MAX_STEPS))),
            "rounding_floor": int(np.sum(status == int(gflow.Status.ROUNDING_FLOOR))),
            "stiff_tail_flows": int(np.sum(np.asarray(ds.end_phase.values) == 2)),
            # (depth, α, seed) of the flows that ran out of steps (where the time goes) and of
            # those that stopped on a plateau whose gradient is rounding
            **{
                key: [
                    (int(ds.depth[i]), float(ds.alpha[j]), int(ds.seed[k]))
                    for i, j, k in zip(*np.nonzero(codes == int(code)), strict=True)
                ]
                for key, code in (
                    ("out_of_steps", gflow.Status.MAX_STEPS),
                    ("at_rounding_floor", gflow.Status.ROUNDING_FLOOR),
                )
            },
        }
    for mode in ("batch", "one at a time", "chunk by chunk"):
        if mode in out:
            out[f"{mode}_over_apart"] = out[mode]["wall_s"] / out["apart"]["wall_s"]
            # the target's rank (2) top singular values; below them σ's are init-sized
            a, b = results["apart"].sigma.values[..., :2], results[mode].sigma.values[..., :2]
            out[f"sigma_max_relative_difference_{mode}"] = float(
                np.nanmax(np.abs(a - b) / np.abs(b))
            )
    return out


def scale(quick: bool) -> dict:
    """Field-size flows (d = 20, 50 quick; 20, 50, 100, 200 full), each in its own process,
    and the random-mask sweep. `GFLOW_SCALE_SIZES` (e.g. "20,50,100") and `GFLOW_SCALE_SGD_S`
    (SGD's budget per size) override the sizes and the budget (60 s quick, 600 s full);
    `GFLOW_SCALE_SWEEP=full` runs the full 112-flow sweep in a quick run."""
    sizes = (20, 50) if quick else (20, 50, 100, 200)
    if os.environ.get("GFLOW_SCALE_SIZES"):
        sizes = tuple(int(d) for d in os.environ["GFLOW_SCALE_SIZES"].split(","))
    budget = float(os.environ.get("GFLOW_SCALE_SGD_S") or (60.0 if quick else 600.0))
    rows = []
    for d in sizes:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.scale", str(d), str(budget)],
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(done.stdout.splitlines()[-1]))
        # each size as it finishes: a long run interrupted later keeps these figures
        print(f"scale d={d}: {json.dumps(rows[-1], default=str)}", flush=True)
    full_sweep = os.environ.get("GFLOW_SCALE_SWEEP") == "full"
    return {"rows": rows, "sweep": random_mask_sweep(quick and not full_sweep)}


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    size, budget = int(sys.argv[1]), float(sys.argv[2])
    result = one_size(size, budget)
    print(json.dumps(result, default=str))
    if not math.isfinite(result["solve_s"]):
        sys.exit(1)
