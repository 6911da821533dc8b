"""The benchmarks: each measures gflow against a baseline in the same run and returns a dict
with the measured numbers and the ratios (see benchmarks/README.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import gflow
from gflow.sweeps._build import build

from .scale import scale


def _best_of(fn, *args, repeats=3, **kwargs):
    """Best wall time of `repeats` calls of fn(*args, **kwargs) (compiled beforehand)."""
    best = math.inf
    out = None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - start)
    return best, out


def environment() -> dict:
    dev = jax.devices()[0]
    return {
        "device": f"{dev.platform}:{getattr(dev, 'device_kind', '')}",
        "num_devices": jax.device_count(),
        "dtype": str(jnp.zeros(1).dtype),
        "jax": jax.__version__,
    }


# ---------------------------------------------------------------------------------------------
# 1. Time to endpoint at matched accuracy: gflow vs optax SGD


def sgd_matched_accuracy(quick: bool) -> dict:
    """SGD's endpoint error is ∝ lr, so the lr reaching a target error ε is ε/C with C fitted
    on measured runs, and its cost is (steps to converge ∝ 1/lr) × (measured time per step).
    gflow's cost is measured at the loosest rtol that reaches ε. The error is the largest
    relative error over every singular value ≥ 1e-6·σ₁ of the reference: the small ones carry
    the rank, and they carry SGD's O(lr) bias.

    Where SGD's error is not ∝ lr (it has not converged within its step budget: a stiff tail),
    nothing is extrapolated: a target SGD missed at every measured lr gets a lower bound, the
    larger of (wall SGD spent without reaching it) and (steps it needs at least) × (time per
    step). SGD needs at least t_ε·λ_max/2 steps: t_ε is the flow time before which the flow
    itself is still more than ε from its endpoint (GD follows the flow, iterate k at t = k·lr),
    and lr < 2/λ_max, λ_max the endpoint's largest Hessian eigenvalue, or GD cannot converge
    there."""
    d, depth, alpha = (8, 3, 0.1) if quick else (20, 3, 0.1)
    cases = {
        "diagonal": (gflow.diagonal(d), gflow.identity_family(d, depth, alpha, 4.0)),
        "bernoulli": (
            gflow.bernoulli(d, d, 0.6, 1, key=0),
            gflow.identity_family(d, depth, alpha, 4.0),
        ),
    }
    lrs = (0.02, 0.01) if quick else (0.02, 0.01, 0.005)
    budget = 200_000 if quick else 1_000_000
    timing_steps = budget // 10
    targets = (1e-4, 1e-5, 1e-6)
    out = {}
    for name, (problem, init) in cases.items():
        ref = gflow.flow(problem, init, rtol=1e-13, save=400)
        lam_max = float(jnp.linalg.eigvalsh(gflow.loss_hessian(ref.model, problem))[-1])
        sgd = []
        for lr in lrs:
            r = gflow.descend(problem, init, lr=lr, max_steps=budget)
            sgd.append(
                {
                    "lr": lr,
                    "status": r.status_label,
                    "steps": int(r.num_steps),
                    "wall_s": r.wall_time_s,
                    "error": gflow.endpoint_distance(r, ref, problem)["singular_values"],
                }
            )
        errors = [x["error"] for x in sgd]
        slope = gflow.loglog_slope(lrs, errors)
        c = float(np.exp(np.mean(np.log(errors) - np.log(lrs))))  # error ≈ c·lr
        # Time per step from runs long enough that the call's fixed cost is negligible (the
        # fitting runs of a converging case take hundreds of steps, where it is not): else one
        # run at a learning rate too small to converge within `timing_steps`.
        timed = [x for x in sgd if x["steps"] >= timing_steps]
        if not timed:
            r = gflow.descend(problem, init, lr=min(lrs) / 1000, max_steps=timing_steps)
            timed = [{"steps": int(r.num_steps), "wall_s": r.wall_time_s}]
        t_step = float(np.median([x["wall_s"] / x["steps"] for x in timed]))
        steps_times_lr = float(np.mean([x["steps"] * x["lr"] for x in sgd]))  # ≈ flow time
        converged = all(x["status"] == "converged" for x in sgd)
        proportional = converged and 0.8 <= slope <= 1.2
        rows = []
        runs_by_rtol = {}  # each rtol timed once, shared by the targets
        for eps in targets:
            flow_wall, flow_rtol, flow_err = _gflow_reaching(
                problem, init, ref, eps, runs_by_rtol, quick
            )
            row = {
                "target": eps,
                "gflow_rtol": flow_rtol,
                "gflow_error": flow_err,
                "gflow_wall_s": flow_wall,
            }
            if proportional:
                lr_needed = eps / c
                sgd_wall = steps_times_lr / lr_needed * t_step
                row |= {"sgd_lr": lr_needed, "sgd_wall_s": sgd_wall, "ratio": sgd_wall / flow_wall}
            elif all(x["error"] > eps for x in sgd):
                steps_needed = _flow_time_to_within(ref, eps) * lam_max / 2
                least = max(min(x["wall_s"] for x in sgd), steps_needed * t_step)
                row |= {
                    "sgd_steps_at_least": steps_needed,
                    "sgd_wall_s_at_least": least,
                    "ratio_at_least": least / flow_wall,
                }
            rows.append(row)
        out[name] = {
            "sgd_runs": sgd,
            "lambda_max_at_endpoint": lam_max,
            "sgd_stable_lr_below": 2 / lam_max,
            "sgd_step_budget": budget,
            "fitted_slope": slope,
            "error_proportional_to_lr": proportional,
            "error_per_lr": c,
            "sgd_time_per_step_s": t_step,
            "sgd_time_per_step_from": timed,
            "targets": rows,
        }
    return out


def _flow_time_to_within(ref, eps):
    """The last saved time at which the flow's singular values (those ≥ 1e-6·σ₁) are still
    more than eps (relative) from its endpoint: a lower bound on the flow time to get within."""
    s_ref = gflow.singular_values(ref.model)
    top = s_ref >= 1e-6 * s_ref[0]
    t = np.asarray(ref.trajectory.t)
    sv = np.asarray(ref.trajectory.singular_values)
    valid = np.isfinite(t)
    err = np.max(np.abs(sv[valid][:, top] / s_ref[top] - 1), axis=1)
    outside = np.nonzero(err > eps)[0]
    return float(t[valid][outside[-1]]) if len(outside) else 0.0


def _gflow_reaching(problem, init, ref, eps, runs_by_rtol, quick):
    """(best wall, rtol, error) of gflow at the loosest rtol whose endpoint is within eps,
    on a 1-2-5 grid from eps down (SGD's lr is matched to eps exactly, by its fit; `quick`:
    decades, fewer compilations); `runs_by_rtol` caches (wall, error) per rtol across
    targets."""
    steps = [1.0, 0.1, 0.01] if quick else [1.0, 0.5, 0.2, 0.1, 0.05, 0.02, 0.01]
    for rtol in eps * np.array(steps + [1e-3, 1e-4, 1e-5]):
        rtol = float(f"{rtol:.0e}")
        if rtol not in runs_by_rtol:
            first = gflow.flow(problem, init, rtol=rtol)  # compiles
            repeats = 10 if first.wall_time_s < 0.1 else 2  # short flows: noise dominates
            wall, r = _best_of(gflow.flow, problem, init, rtol=rtol, repeats=repeats)
            runs_by_rtol[rtol] = wall, gflow.endpoint_distance(r, ref, problem)["singular_values"]
        wall, err = runs_by_rtol[rtol]
        if err <= eps:
            return wall, rtol, err
    return math.nan, math.nan, math.nan


# ---------------------------------------------------------------------------------------------
# 2. Small-α reach


def small_alpha_reach(quick: bool) -> dict:
    depths = (3, 4) if quick else (3, 4, 5, 6)
    alphas = (1e-2, 1e-3) if quick else (1e-2, 1e-3, 1e-4, 1e-5)
    problem = gflow.diagonal(4)
    lr = 0.1  # stable for SGD on this problem (κ∞ ≈ L·σ^(2−2/L) < 20)
    probe = gflow.descend(problem, gflow.identity_family(4, 3, 0.1, 4.0), lr=lr, max_steps=2000)
    sgd_step = probe.wall_time_s / int(probe.num_steps)
    rows = []
    for depth in depths:
        for alpha in alphas:
            init = gflow.identity_family(4, depth, alpha, 4.0)
            gflow.flow(problem, init)
            wall, r = _best_of(gflow.flow, problem, init, repeats=2)
            sgd_steps = float(r.t_end) / lr
            rows.append(
                {
                    "L": depth,
                    "alpha": alpha,
                    "status": r.status_label,
                    "t_end": float(r.t_end),
                    "gflow_steps": int(r.num_steps),
                    "gflow_wall_s": wall,
                    "sgd_steps_needed": sgd_steps,
                    "sgd_wall_s_estimated": sgd_steps * sgd_step,
                    "ratio": sgd_steps * sgd_step / wall,
                }
            )
    return {"sgd_lr": lr, "sgd_time_per_step_s": sgd_step, "rows": rows}


# ---------------------------------------------------------------------------------------------
# 3. Other ODE integrators: SciPy solve_ivp (and torchdiffeq when installed)


def _numpy_flow_rhs(problem, depth):
    target, mask = np.asarray(problem.target), np.asarray(problem.mask)
    d = target.shape[0]

    def rhs(t, y):
        ws = y.reshape(depth, d, d)
        prefix = [np.eye(d)]
        for w in ws:
            prefix.append(w @ prefix[-1])
        upstream = mask * (prefix[-1] - target)
        grads = np.empty_like(ws)
        for i in range(depth - 1, -1, -1):
            grads[i] = upstream @ prefix[i].T
            upstream = ws[i].T @ upstream
        return -grads.ravel()

    return rhs


def other_integrators(quick: bool) -> dict:
    from scipy.integrate import solve_ivp

    # A non-stiff flow (diagonal observations, Gaussian init): this compares integrators and
    # their overheads at equal tolerance; the stiff tail has its own benchmark.
    d, depth = 8, 3
    problem = gflow.diagonal(d)
    init = gflow.gaussian([d] * (depth + 1), 0.3, key=2)
    rtol, atol = 1e-8, 1e-10
    opts = gflow.FlowOptions(rtol=rtol, atol=atol)
    gflow.flow(problem, init, opts)
    wall, r = _best_of(gflow.flow, problem, init, opts, repeats=10)
    t_end = float(r.t_end)
    # The same flow through diffrax's `diffeqsolve` (which a finite horizon forces; this one
    # is never reached): what gflow's own explicit loop saves, on the same steps.
    via_diffrax = dataclasses.replace(opts, t_max=1e300)
    gflow.flow(problem, init, via_diffrax)
    wall_diffrax, r_diffrax = _best_of(gflow.flow, problem, init, via_diffrax, repeats=10)
    y0 = np.concatenate([np.asarray(w).ravel() for w in init.layers])
    rhs = _numpy_flow_rhs(problem, depth)
    out = {
        "problem": f"diagonal {d}x{d}, L={depth}, Gaussian α=0.3",
        "t_end": t_end,
        "rtol": rtol,
        "atol": atol,
        "gflow_wall_s": wall,
        "gflow_steps": int(r.num_steps),
        "gflow_via_diffeqsolve": {
            "wall_s": wall_diffrax,
            "steps": int(r_diffrax.num_steps),
            "ratio": wall_diffrax / wall,
        },
        "baselines": {},
    }
    for method in ("DOP853", "LSODA"):
        start = time.perf_counter()
        sol = solve_ivp(rhs, (0, t_end), y0, method=method, rtol=rtol, atol=atol)
        elapsed = time.perf_counter() - start
        out["baselines"][f"scipy {method}"] = {
            "wall_s": elapsed,
            "nfev": int(sol.nfev),
            "ratio": elapsed / wall,
        }
    n_sweep = 16 if quick else 256
    seeds = list(range(n_sweep))
    spec = gflow.SweepSpec(
        axes={"seed": seeds},
        fixed={"dim": d, "depth": depth, "alpha": 0.3},
        problem="diagonal",
        init="gaussian",
        options=opts,
        chunk_size=min(n_sweep, 64),
    )
    gflow.sweep(spec, progress=False)  # compile
    start = time.perf_counter()
    ds = gflow.sweep(spec, progress=False)
    sweep_wall = time.perf_counter() - start
    per_flow_scipy = out["baselines"]["scipy DOP853"]["wall_s"]
    out["sweep"] = {
        "flows": n_sweep,
        "gflow_wall_s": sweep_wall,
        "scipy_dop853_estimated_s": per_flow_scipy * n_sweep,
        "ratio": per_flow_scipy * n_sweep / sweep_wall,
        "converged": int((ds["status"].values == 0).sum()),
    }
    try:
        import torch  # noqa: F401
        import torchdiffeq  # noqa: F401
    except ImportError:
        out["torchdiffeq"] = "skipped: torchdiffeq is not installed (pip install torchdiffeq)"
    else:
        inits = [build(p, spec.problem, spec.init)[1] for p in spec.points()]
        td = _torchdiffeq(problem, init, t_end, inits, ds["t_end"].values, rtol, atol, quick)
        td["ratio"] = td["wall_s"] / wall
        td["sweep_ratio"] = td["sweep_best_s"] / sweep_wall
        out["torchdiffeq"] = td
    return out


def _torchdiffeq(problem, init, t_end, inits, t_ends, rtol, atol, quick):
    """torchdiffeq dopri5 on the same flows: one flow (best of 1 thread and all threads), and
    the sweep the ways a user would write it: a loop of single solves (timed on a sample of
    the flows, scaled to all), and one batched solve of every flow stacked into one state (one
    shared step size, run to the longest flow's end time). A batched solve's default error
    norm is one RMS over *all* flows, so a single flow may exceed the tolerance by up to
    √(flows); it is timed that way and with every flow held to the tolerance (the worst flow's
    RMS as the norm, as gflow's sweep holds each flow). The faster of the loop and the
    equal-tolerance batch counts."""
    import torch
    from torchdiffeq import odeint

    torch.set_default_dtype(torch.float64)
    target = torch.tensor(np.asarray(problem.target))
    mask = torch.tensor(np.asarray(problem.mask))

    def f(t, ws):
        ws = ws.detach().requires_grad_(True)
        with torch.enable_grad():
            x = ws[..., 0, :, :]
            for i in range(1, ws.shape[-3]):
                x = ws[..., i, :, :] @ x
            loss = 0.5 * ((mask * (x - target)) ** 2).sum()
            (g,) = torch.autograd.grad(loss, ws)
        return -g

    def solve(y0, t1, options=None):
        start = time.perf_counter()
        odeint(
            f, y0, torch.tensor([0.0, t1]), method="dopri5", rtol=rtol, atol=atol, options=options
        )
        return time.perf_counter() - start

    def worst_member(scaled_error):
        # Per-flow RMS of the scaled error, worst flow: every member held to rtol/atol.
        return scaled_error.reshape(scaled_error.shape[0], -1).pow(2).mean(1).sqrt().max()

    def layers(model):
        return torch.tensor(np.stack([np.asarray(w) for w in model.layers]))

    by_threads = {}
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        by_threads[threads] = solve(layers(init), t_end)
    threads = min(by_threads, key=by_threads.get)
    torch.set_num_threads(threads)
    sample = 4 if quick else 16
    loop_sample = sum(solve(layers(inits[i]), float(t_ends[i])) for i in range(sample))
    loop_estimate = loop_sample / sample * len(inits)
    stacked = torch.stack([layers(m) for m in inits])
    batched = solve(stacked, float(np.max(t_ends)))
    batched_per_flow = solve(stacked, float(np.max(t_ends)), {"norm": worst_member})
    return {
        "wall_s": min(by_threads.values()),
        "wall_s_by_threads": by_threads,
        "sweep_threads": threads,
        "sweep_loop_estimated_s": loop_estimate,
        "sweep_loop_sample": sample,
        "sweep_batched_s": batched,
        "sweep_batched_per_flow_tolerance_s": batched_per_flow,
        # At equal tolerance: the loop, or the batch with every flow held to the tolerance.
        "sweep_best_s": min(loop_estimate, batched_per_flow),
    }


# ---------------------------------------------------------------------------------------------
# 4. Sweep throughput and batch efficiency


def sweep_throughput(quick: bool) -> dict:
    alphas = list(np.geomspace(0.1, 1e-3, 8 if quick else 16))
    ms = [2.0, 4.0] if quick else [2.0, 4.0, 16.0, math.inf]
    axes = {"alpha": alphas, "m": ms}
    fixed = {"dim": 6, "depth": 3}
    n = len(alphas) * len(ms)
    loop_problem = gflow.diagonal(6)
    gflow.flow(loop_problem, gflow.identity_family(6, 3, 0.1, 2.0))  # compile
    start = time.perf_counter()
    for a in alphas:
        for m in ms:
            gflow.flow(loop_problem, gflow.identity_family(6, 3, a, m))
    loop_wall = time.perf_counter() - start
    rows = []
    for chunk in sorted({4, 16, n}):
        spec = gflow.SweepSpec(axes=axes, fixed=fixed, chunk_size=chunk)
        gflow.sweep(spec, progress=False)  # compile
        start = time.perf_counter()
        ds = gflow.sweep(spec, progress=False)
        wall = time.perf_counter() - start
        rows.append(
            {
                "batch_size": chunk,
                "wall_s": wall,
                "flows_per_s": n / wall,
                "batch_efficiency": float(ds["batch_efficiency"].mean()),
                "speedup_vs_loop": loop_wall / wall,
            }
        )
    return {
        "flows": n,
        "python_loop_wall_s": loop_wall,
        "python_loop_flows_per_s": n / loop_wall,
        "rows": rows,
        # Several compilations per mode: full runs only (keeps --quick within its budget).
        "depth_modes": "full runs only" if quick else _depth_modes(),
    }


def _depth_modes() -> dict:
    """A grid over several depths, both ways: one compiled program per depth, or every model
    padded to the deepest with frozen identity layers (one program). Wall time includes the
    compilations, which is what padding saves."""
    axes = {
        "depth": [2, 3, 4, 5],
        "alpha": list(np.geomspace(1e-1, 1e-4, 8)),
        "m": [2.0, 4.0, 16.0, math.inf],
        "seed": [0, 1, 2, 3],
    }
    out = {}
    for mode in ("compile", "pad"):
        spec = gflow.SweepSpec(axes=axes, fixed={"dim": 8}, chunk_size=64, depth_mode=mode)
        before = gflow.compile_count()
        start = time.perf_counter()
        ds = gflow.sweep(spec, progress=False)
        wall = time.perf_counter() - start
        out[mode] = {
            "flows": spec.size,
            "wall_s_with_compilation": wall,
            "compilations": gflow.compile_count() - before,
            "batch_efficiency": float(ds["batch_efficiency"].mean()),
            "converged": int((ds["status"].values == 0).sum()),
        }
        start = time.perf_counter()
        gflow.sweep(spec, progress=False)
        out[mode]["wall_s_compiled"] = time.perf_counter() - start
    out["pad_over_compile"] = (
        out["pad"]["wall_s_with_compilation"] / out["compile"]["wall_s_with_compilation"]
    )
    return out


# ---------------------------------------------------------------------------------------------
# 5. RHS efficiency: gradient FLOP rate vs matmul rate


def rhs_efficiency(quick: bool) -> dict:
    sizes = (64, 256) if quick else (64, 256, 1024)
    rows = []
    for d in sizes:
        a = jax.random.normal(jax.random.key(0), (d, d))
        b = jax.random.normal(jax.random.key(1), (d, d))
        for depth in (3, 6):
            # The physical limit of one gradient: the same number of d×d matmuls, in one program.
            count = 3 * depth - 2

            def chain(x, y, count=count):
                for _ in range(count):
                    x = x @ y
                return x

            matmul = jax.jit(chain)
            matmul(a, b).block_until_ready()
            t_mm, _ = _best_of(matmul, a, b, repeats=5)
            mm_rate = count * 2 * d**3 / t_mm
            problem = gflow.bernoulli(d, d, 0.3, 2, key=0)
            model = gflow.gaussian([d] * (depth + 1), 1.0, key=1)
            grad = jax.jit(gflow.Factorization.gradient)
            jax.block_until_ready(grad(model, problem))
            t_g, _ = _best_of(grad, model, problem, repeats=5)
            flops = (3 * depth - 2) * 2 * d**3  # forward chain + two products per layer back
            rows.append(
                {
                    "d": d,
                    "L": depth,
                    "grad_s": t_g,
                    "matmul_s": t_mm,
                    "grad_flops_per_s": flops / t_g,
                    "matmul_flops_per_s": mm_rate,
                    "fraction_of_matmul_rate": flops / t_g / mm_rate,
                }
            )
    return {"rows": rows}


# ---------------------------------------------------------------------------------------------
# 6. The stiff tail: explicit only vs diffrax's dense-Jacobian Kvaerno5 vs gflow's auto strategy


def stiff_tail(quick: bool) -> dict:
    """Random-mask flows whose tail is stiff (issue 4's example is the full-size 12×12 case).
    gflow's Rosenbrock phase is dense at 8×8 (192 parameters) and matrix-free CG above; a
    dense-Jacobian solver is out of reach at 32×32 (3,072 parameters)."""
    cases = [(8, 0.4, True)] if quick else [(12, 0.35, True), (32, 0.35, False)]
    depth, alpha, rtol = 3, 0.05, 1e-8
    out = {}
    for d, p, with_kvaerno in cases:
        problem = gflow.bernoulli(d, d, p, 1, key=0)
        init = gflow.gaussian([d] * (depth + 1), alpha, key=1)
        runs = {
            "tsit5 (explicit only)": gflow.FlowOptions(
                solver="tsit5",
                rtol=rtol,
                max_steps=30_000 if quick else 100_000 if d > 16 else 400_000,
            ),
            "gflow auto": gflow.FlowOptions(rtol=rtol),
        }
        if not quick:
            runs["gflow auto, rtol 1e-10"] = gflow.FlowOptions()
        if with_kvaerno:
            runs["kvaerno5 (dense Jacobian)"] = gflow.FlowOptions(solver="kvaerno5", rtol=rtol)
        case = {"problem": f"bernoulli {d}x{d} p={p}, L={depth}, Gaussian α={alpha}", "rows": {}}
        results = {}
        for name, opts in runs.items():
            r = gflow.flow(problem, init, opts)  # wall_time_s excludes the compilation
            results[name] = r
            case["rows"][name] = {
                "status": r.status_label,
                "loss_relative": float(r.loss / r.loss_init),
                "steps": int(r.num_steps),
                "rejected": int(r.num_rejected_steps),
                "linear_iters": int(r.num_linear_iters),
                "wall_s": r.wall_time_s,
                "compile_s": r.compile_time_s,
            }
        ref_name = "kvaerno5 (dense Jacobian)" if with_kvaerno else "gflow auto, rtol 1e-10"
        for name, r in results.items():
            case["rows"][name][f"sigma_relerr_vs_{ref_name.split()[0]}"] = gflow.endpoint_distance(
                r, results[ref_name], problem
            )["singular_values"]
        if with_kvaerno:
            k_wall = case["rows"][ref_name]["wall_s"]
            case["ratio_kvaerno5_over_auto"] = k_wall / case["rows"]["gflow auto"]["wall_s"]
        out[f"{d}x{d}"] = case
    return out


# A flow as a notebook runs it to plot its trajectory: samples, and a stiff tail on the way.
_SAMPLED_FLOW = """
import json, jax, gflow
problem = gflow.bernoulli(8, 8, 0.5, 2, jax.random.key(1))
r = gflow.flow(problem, gflow.gaussian((8,) * 4, 1e-2, jax.random.key(0)), save=50)
sigma = gflow.singular_values(r.model).tolist()
print(json.dumps({"compile_time_s": r.compile_time_s, "compile_cache_hit": r.compile_cache_hit,
                  "singular_values": sigma, "status": r.status_label}))
"""


def startup(quick: bool) -> dict:
    """Wall time of fresh processes: without the persistent compilation cache, into an empty
    cache (the first call) and from it (the repeated call), side by side, for three programs:
    `gflow run`, the same with a horizon (`--t-max`), and a flow that saves samples (as a
    notebook plots one); and of `import gflow` alone. Each call is a new process, as a user
    typing the command."""
    import subprocess
    import sys
    import tempfile

    run = [sys.executable, "-m", "gflow.cli", "run", "--depth", "3", "--alpha", "1e-3", "--json"]
    commands = {
        "gflow run --depth 3 --alpha 1e-3": run,
        "gflow run ... --t-max 30": run + ["--t-max", "30"],
        "flow with save=50 (Python)": [sys.executable, "-c", _SAMPLED_FLOW],
    }
    repeats = 1 if quick else 3

    def call(env_extra, command):
        env = dict(os.environ, **env_extra)
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        wall = time.perf_counter() - start
        report = json.loads(done.stdout.splitlines()[-1]) if done.stdout.strip() else {}
        return wall, report

    modes = (
        ("no cache", lambda cache: {"GFLOW_NO_CACHE": "1"}),
        ("first (empty cache)", lambda cache: {"GFLOW_CACHE_DIR": cache}),
        ("repeated (cache hit)", lambda cache: {"GFLOW_CACHE_DIR": cache}),
    )
    cases = {}
    for label, command in commands.items():
        rows = {name: [] for name, _ in modes}
        reports = {}
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as cache:
                for name, env in modes:
                    wall, reports[name] = call(env(cache), command)
                    rows[name].append(
                        {
                            "wall_s": wall,
                            "compile_s": reports[name]["compile_time_s"],
                            "cache_hit": reports[name]["compile_cache_hit"],
                        }
                    )
        best = {name: min(r["wall_s"] for r in runs) for name, runs in rows.items()}
        cases[label] = {
            "runs": rows,
            "best_wall_s": best,
            "best_compile_s": {n: min(r["compile_s"] for r in runs) for n, runs in rows.items()},
            "first_over_no_cache": best["first (empty cache)"] / best["no cache"],
            "no_cache_over_repeated": best["no cache"] / best["repeated (cache hit)"],
            "identical_results": reports["no cache"]["singular_values"]
            == reports["repeated (cache hit)"]["singular_values"],
        }
    imports = [
        call({"GFLOW_NO_CACHE": "1"}, [sys.executable, "-c", "import gflow"])[0]
        for _ in range(repeats)
    ]
    return {"cases": cases, "import_s": min(imports)}


BENCHMARKS = {
    "sgd_matched_accuracy": sgd_matched_accuracy,
    "small_alpha_reach": small_alpha_reach,
    "other_integrators": other_integrators,
    "sweep_throughput": sweep_throughput,
    "rhs_efficiency": rhs_efficiency,
    "stiff_tail": stiff_tail,
    "startup": startup,
    "scale": scale,
}
