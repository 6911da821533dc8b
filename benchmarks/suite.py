"""The benchmarks: each measures gflow against a baseline in the same run and returns a dict
with the measured numbers and the ratios (see benchmarks/README.md)."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import gflow


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
    the rank, and they carry SGD's O(lr) bias."""
    d, depth, alpha = (8, 3, 0.1) if quick else (20, 3, 0.1)
    cases = {
        "diagonal": (gflow.diagonal(d), gflow.identity_family(d, depth, alpha, 4.0)),
        "bernoulli": (
            gflow.bernoulli(d, d, 0.6, 1, key=0),
            gflow.identity_family(d, depth, alpha, 4.0),
        ),
    }
    lrs = (0.02, 0.01) if quick else (0.02, 0.01, 0.005, 0.0025)
    targets = (1e-4, 1e-5, 1e-6)
    out = {}
    for name, (problem, init) in cases.items():
        ref = gflow.flow(problem, init, rtol=1e-13)
        errors, per_step, steps = [], [], []
        for lr in lrs:
            gflow.descend(problem, init, lr=lr, max_steps=10)  # compile once, outside timing
            r = gflow.descend(problem, init, lr=lr)
            errors.append(gflow.endpoint_distance(r, ref, problem)["singular_values"])
            per_step.append(r.wall_time_s / int(r.num_steps))
            steps.append(int(r.num_steps))
        slope = gflow.loglog_slope(lrs, errors)
        c = float(np.exp(np.mean(np.log(errors) - np.log(lrs))))  # error ≈ c·lr
        t_step = float(np.median(per_step))
        steps_times_lr = float(np.mean(np.array(steps) * np.array(lrs)))  # ≈ flow time
        rows = []
        proportional = 0.8 <= slope <= 1.2  # else the extrapolation below is meaningless
        for eps in targets if proportional else ():
            lr_needed = eps / c
            sgd_wall = steps_times_lr / lr_needed * t_step
            flow_wall, flow_rtol, flow_err = math.nan, math.nan, math.nan
            for rtol in (1e-5, 1e-6, 1e-7, 1e-8, 1e-9, 1e-10, 1e-11):
                gflow.flow(problem, init, rtol=rtol)  # compile
                wall, r = _best_of(gflow.flow, problem, init, rtol=rtol, repeats=2)
                err = gflow.endpoint_distance(r, ref, problem)["singular_values"]
                if err <= eps:
                    flow_wall, flow_rtol, flow_err = wall, rtol, err
                    break
            rows.append(
                {
                    "target": eps,
                    "sgd_lr": lr_needed,
                    "sgd_wall_s": sgd_wall,
                    "gflow_rtol": flow_rtol,
                    "gflow_error": flow_err,
                    "gflow_wall_s": flow_wall,
                    "ratio": sgd_wall / flow_wall,
                }
            )
        out[name] = {
            "lrs": list(lrs),
            "sgd_errors": errors,
            "fitted_slope": slope,
            "error_proportional_to_lr": proportional,
            "error_per_lr": c,
            "sgd_time_per_step_s": t_step,
            "targets": rows,
        }
    return out


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
    wall, r = _best_of(gflow.flow, problem, init, opts)
    t_end = float(r.t_end)
    y0 = np.concatenate([np.asarray(w).ravel() for w in init.layers])
    rhs = _numpy_flow_rhs(problem, depth)
    out = {
        "problem": f"diagonal {d}x{d}, L={depth}, Gaussian α=0.3",
        "t_end": t_end,
        "rtol": rtol,
        "atol": atol,
        "gflow_wall_s": wall,
        "gflow_steps": int(r.num_steps),
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
        out["torchdiffeq"] = _torchdiffeq(problem, init, depth, t_end, rtol, atol, wall)
        per_flow = out["torchdiffeq"]["wall_s"]
        out["torchdiffeq"]["sweep_estimated_s"] = per_flow * n_sweep
        out["torchdiffeq"]["sweep_ratio"] = per_flow * n_sweep / sweep_wall
    return out


def _torchdiffeq(problem, init, depth, t_end, rtol, atol, gflow_wall):
    import torch
    from torchdiffeq import odeint

    torch.set_default_dtype(torch.float64)
    target = torch.tensor(np.asarray(problem.target))
    mask = torch.tensor(np.asarray(problem.mask))
    y0 = torch.tensor(np.stack([np.asarray(w) for w in init.layers]))

    def f(t, ws):
        ws = ws.detach().requires_grad_(True)
        with torch.enable_grad():
            x = ws[0]
            for w in ws[1:]:
                x = w @ x
            loss = 0.5 * ((mask * (x - target)) ** 2).sum()
            (g,) = torch.autograd.grad(loss, ws)
        return -g

    best = {}
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        start = time.perf_counter()
        odeint(f, y0, torch.tensor([0.0, t_end]), method="dopri5", rtol=rtol, atol=atol)
        best[threads] = time.perf_counter() - start
    wall = min(best.values())
    return {"wall_s_by_threads": best, "wall_s": wall, "ratio": wall / gflow_wall}


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
    for chunk in (4, 16, n):
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
    }


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
    """Random-mask flows whose tail is stiff (issue 4's example is the full-size case)."""
    d, p, depth, alpha = (8, 0.4, 3, 0.05) if quick else (12, 0.35, 3, 0.05)
    problem = gflow.bernoulli(d, d, p, 1, key=0)
    init = gflow.gaussian([d] * (depth + 1), alpha, key=1)
    rtol = 1e-8
    runs = {
        "tsit5 (explicit only)": gflow.FlowOptions(
            solver="tsit5", rtol=rtol, max_steps=100_000 if quick else 400_000
        ),
        "kvaerno5 (dense Jacobian)": gflow.FlowOptions(solver="kvaerno5", rtol=rtol),
        "gflow auto": gflow.FlowOptions(rtol=rtol),
        "gflow auto, rtol 1e-10": gflow.FlowOptions(),
    }
    out = {"problem": f"bernoulli {d}x{d} p={p}, L={depth}, Gaussian α={alpha}", "rows": {}}
    results = {}
    for name, opts in runs.items():
        r = gflow.flow(problem, init, opts)
        results[name] = r
        out["rows"][name] = {
            "status": r.status_label,
            "loss_relative": float(r.loss / r.loss_init),
            "steps": int(r.num_steps),
            "rejected": int(r.num_rejected_steps),
            "linear_iters": int(r.num_linear_iters),
            "wall_s": r.wall_time_s,
            "compile_s": r.compile_time_s,
        }
    ref = results["kvaerno5 (dense Jacobian)"]
    for name, r in results.items():
        out["rows"][name]["sigma_relerr_vs_kvaerno5"] = gflow.endpoint_distance(r, ref, problem)[
            "singular_values"
        ]
    k_wall = out["rows"]["kvaerno5 (dense Jacobian)"]["wall_s"]
    out["ratio_kvaerno5_over_auto"] = k_wall / out["rows"]["gflow auto"]["wall_s"]
    return out


BENCHMARKS = {
    "sgd_matched_accuracy": sgd_matched_accuracy,
    "small_alpha_reach": small_alpha_reach,
    "other_integrators": other_integrators,
    "sweep_throughput": sweep_throughput,
    "rhs_efficiency": rhs_efficiency,
    "stiff_tail": stiff_tail,
}
