"""Integrated endpoints against the theory, as a table and as a figure."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..engine._result import FlowResult, Status
from ._measures import family_ranks, family_spectrum
from ._theory import escape_time, family_limit, log_lambda_c_at


@dataclass(frozen=True)
class FamilyConfig:
    """One identity-family configuration: depth L, n blocks of size s, α, m, target value w."""

    depth: int
    n: int
    s: int
    alpha: float
    m: float = math.inf
    w: float = 1.0


def _rel(measured_log, predicted_log):
    """Relative error from logs: |exp(Δ) − 1|, exact for values far below float resolution."""
    return abs(math.expm1(measured_log - predicted_log))


AGREE = 1e-8  # relative agreement with the theory asked of a well-conditioned endpoint value


ILL_CONDITIONED_AFTER = 100.0  # escape times: then only mode C's slow decay is left (s > 1)


def ill_conditioned_after(config: FamilyConfig) -> float:
    """The time past which σ_B and σ_C of a block problem (s > 1) are ill-conditioned:
    `ILL_CONDITIONED_AFTER` escape times. By then modes A and B have converged and the flow
    follows mode C's algebraically slow decay, along which departures from the family's
    invariant set grow from rounding level (docs/theory.md §9): on 3 blocks of 2, L = 3,
    α = 0.02, m = 3 (escape t ≈ 9) λ_C leaves the reduced flow by 2e-8 at t ≈ 3e3 and by
    1e-5 at t ≈ 1e5, and the endpoint's σ_B keeps 4 reproducible digits."""
    c = config
    return ILL_CONDITIONED_AFTER * float(escape_time(c.depth, c.n, c.s, c.alpha, c.m, c.w))


def compare_family(result: FlowResult, config: FamilyConfig, sensitivity=None) -> dict:
    """One row: measured (from the layers) vs predicted σ_A, σ_B, σ_C(t_end), ranks, errors,
    and a verdict (`verdict`, `note`) that says what the comparison can and cannot show.

    On blocks (s > 1) past `ill_conditioned_after`, σ_B and σ_C are ill-conditioned
    (`ill_conditioned`): they are reported, not judged, unless a `Sensitivity` of this flow
    (`gflow.sensitivity(..., family=(n, s))`) says how many of their digits are reproducible;
    then each value is judged to those digits. Well-defined comparisons for them: at a finite
    time before that (`t_max`), or along the trajectory against the reduced flow
    (`compare_family_trajectory`, `family_flow`)."""
    c = config
    spec = family_spectrum(result.model, c.n, c.s)
    limit = family_limit(c.depth, c.n, c.s, c.alpha, c.m, c.w)
    t_end = float(result.t_end)
    row = {
        "L": c.depth,
        "n": c.n,
        "s": c.s,
        "alpha": c.alpha,
        "m": c.m,
        "w": c.w,
        "status": Status(int(result.status)).label,
        "t_end": t_end,
        "sigma_a": spec["sigma_a"],
        "sigma_a_pred": float(limit.sigma_a),
        "sigma_a_relerr": _rel(spec["log_sigma_a"], math.log(float(limit.sigma_a))),
    }
    if c.n >= 2:
        row |= {
            "sigma_b": spec["sigma_b"],
            "sigma_b_pred": float(limit.sigma_b),
            "sigma_b_relerr": _rel(spec["log_sigma_b"], float(limit.log_sigma_b)),
        }
    sigma_c_pred = 0.0
    if c.s >= 2:
        log_pred = c.depth * float(log_lambda_c_at(c.depth, c.n, c.s, c.alpha, c.m, t_end))
        sigma_c_pred = math.exp(log_pred)
        row |= {
            "sigma_c": spec["sigma_c"],
            "sigma_c_pred": sigma_c_pred,
            "sigma_c_relerr": _rel(spec["log_sigma_c"], log_pred),
        }
    srank, _ = family_ranks(
        spec["sigma_a"], spec.get("sigma_b", 0.0), spec.get("sigma_c", 0.0), c.n, c.s
    )
    srank_pred, _ = family_ranks(float(limit.sigma_a), float(limit.sigma_b), sigma_c_pred, c.n, c.s)
    row |= {"stable_rank": srank, "stable_rank_pred": srank_pred}
    row["max_relerr"] = max(v for k, v in row.items() if k.endswith("_relerr"))
    return row | _verdict(row, c, sensitivity)


def _verdict(row: dict, c: FamilyConfig, sensitivity) -> dict:
    modes = [k for k in ("a", "b", "c") if f"sigma_{k}_relerr" in row]
    ill = []
    if c.s >= 2 and row["t_end"] > ill_conditioned_after(c):
        ill = [f"sigma_{k}" for k in modes if k != "a"]
    out = {"ill_conditioned": ill}
    if sensitivity is not None:
        for k in modes:
            out[f"sigma_{k}_digits"] = sensitivity.digits.get(f"sigma_{k}")
    if row["status"] not in ("converged", "t_max"):
        return out | {
            "verdict": "no endpoint",
            "note": f"the flow ended {row['status']}: not an endpoint, nothing to compare",
        }
    judged, failed, limited = [], [], []
    for k in modes:
        name = f"sigma_{k}"
        digits = out.get(f"{name}_digits")
        if name in ill and not digits:
            continue  # not judged: rounding decides its last digits (all of them, at 0)
        bound = AGREE if digits is None else max(AGREE, 10.0 ** (1 - digits))
        limited += [name] if bound > AGREE else []
        judged.append(name)
        if row[f"{name}_relerr"] > bound:
            failed.append(f"{name} off by {row[f'{name}_relerr']:.1e}")
    notes = []
    if ill:
        notes.append(
            f"{', '.join(ill)} are ill-conditioned here (s > 1, t_end beyond "
            f"{ILL_CONDITIONED_AFTER:g} escape times: the family's invariant set is unstable "
            "while mode C decays): float64 rounding decides their last digits"
            + ("" if sensitivity is not None else "; not judged (gflow.sensitivity measures them)")
            + "; compare them at finite t or along the trajectory (compare_family_trajectory)"
        )
    at = ""
    if row["status"] == "t_max":  # σ_C(T) is exact; σ_A, σ_B only once A and B have converged
        at = f" at t = {row['t_end']:.6g} (t_max, not the endpoint)"
    if failed:
        why = " beyond its reproducible digits" if limited else ""
        if at:
            why += "; modes A and B may not have converged by t_max"
        return out | {
            "verdict": "differs" + at,
            "note": "; ".join([", ".join(failed) + why, *notes]),
        }
    verdict = ("agrees to its reproducible digits" if limited else "agrees") + at
    notes.insert(0, f"{verdict}: {', '.join(judged)}")
    return out | {"verdict": verdict, "note": "; ".join(notes)}


def compare_family_trajectory(result: FlowResult, config: FamilyConfig) -> dict:
    """The full flow along its saved trajectory (`save_ts=…, save_layers=True`) against the
    family's reduced flow (`family_flow`) at the same times: λ_A, λ_B (and λ_C for s > 1)
    measured from the layers. Returns `t`, `modes`, `log_lambda_full`, `log_lambda_reduced`
    (rows: times), `relerr` (|λ_full/λ_reduced − 1|) and its `max_relerr`."""
    from ._coupling import trajectory_models
    from ._family_flow import family_flow

    c = config
    traj = result.trajectory.compress()
    models = trajectory_models(result.trajectory)
    ts = np.asarray(traj.t, dtype=np.float64)
    modes = [k for k, present in (("a", True), ("b", c.n >= 2), ("c", c.s >= 2)) if present]
    full = np.array(
        [
            [family_spectrum(mo, c.n, c.s)[f"log_sigma_{k}"] / c.depth for k in modes]
            for mo in models
        ]
    )
    reduced = family_flow(c.depth, c.n, c.s, c.alpha, c.m, c.w, ts=ts).log_lambda_ts
    reduced = reduced[:, ["abc".index(k) for k in modes]]
    relerr = np.abs(np.expm1(full - reduced))
    return {
        "t": ts,
        "modes": modes,
        "log_lambda_full": full,
        "log_lambda_reduced": reduced,
        "relerr": relerr,
        "max_relerr": float(relerr.max()) if relerr.size else 0.0,
    }


def compare_family_batch(result: FlowResult, configs) -> list[dict]:
    """Rows for a batched result (from `flow_batch`), one per config, in order."""
    return [compare_family(result.member(i), config) for i, config in enumerate(configs)]


def format_table(rows: list[dict], columns=None) -> str:
    """A plain-text table of comparison rows."""
    if not rows:
        return "(no rows)"
    columns = columns or [
        "L",
        "n",
        "s",
        "alpha",
        "m",
        "status",
        "sigma_a_relerr",
        "sigma_b",
        "sigma_b_pred",
        "sigma_b_relerr",
        "stable_rank",
        "stable_rank_pred",
    ]
    columns = [c for c in columns if any(c in r for r in rows)]

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}" if (v == 0 or 1e-3 <= abs(v) < 1e4) else f"{v:.3e}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[k]) for row in cells)) for k, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True))
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _converged(row) -> bool:
    """A comparison row's flow reached its endpoint (`status` as a label or a code)."""
    return row.get("status", "converged") in ("converged", int(Status.CONVERGED))


def _rank_excess(row, n, s) -> float:
    """stable rank − 1 from the family's singular values (docs/theory.md §11): computed as
    `stable_rank − 1` it is lost to rounding below 1e-16 and vanishes from a log axis."""
    ratio_b = row["sigma_b"] / row["sigma_a"]
    ratio_c = row.get("sigma_c", 0.0) / row["sigma_a"]
    return (n - 1) * ratio_b**2 + n * (s - 1) * ratio_c**2


def plot_rank_vs_alpha(
    rows: list[dict],
    *,
    n: int,
    s: int = 1,
    m: float = 4.0,
    w: float = 1.0,
    alphas=None,
    ax=None,
    title=None,
):
    """Stable rank − 1 and σ_B/σ_A against α on log axes: one theory curve per depth, the
    integrated endpoints (comparison rows) as markers on top; rows whose flow did not converge
    as grey crosses. Returns the figure."""

    import matplotlib.pyplot as plt

    depths = sorted({r["L"] for r in rows})
    measured_alphas = [r["alpha"] for r in rows]
    if alphas is None:
        lo, hi = min(measured_alphas), max(measured_alphas)
        alphas = np.geomspace(lo / 2, hi * 2, 200)
    if ax is None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    else:
        axes, fig = ax, ax[0].figure
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(depths)))
    off = dict(marker="x", color="0.5")  # flows that did not converge
    for depth, color in zip(depths, colors, strict=True):
        lim = family_limit(depth, n, s, alphas, m, w)
        ratio = np.exp(lim.log_sigma_b - np.log(lim.sigma_a))
        axes[0].plot(alphas, (n - 1) * ratio**2, color=color, label=f"L = {depth} (theory)")
        axes[1].plot(alphas, ratio, color=color)
        for reached, style in ((True, dict(marker="o", color=color, mfc="none")), (False, off)):
            pts = [r for r in rows if r["L"] == depth and _converged(r) == reached]
            xs = [r["alpha"] for r in pts]
            axes[0].plot(xs, [_rank_excess(r, n, s) for r in pts], ls="none", **style)
            axes[1].plot(xs, [r["sigma_b"] / r["sigma_a"] for r in pts], ls="none", **style)
    axes[0].plot([], [], "ok", mfc="none", label="integrated endpoint (gflow)")
    if not all(_converged(r) for r in rows):
        axes[0].plot([], [], ls="none", label="did not converge (not an endpoint)", **off)
    for a, ylabel in zip(axes, ["stable rank − 1", "σ_B / σ_A"], strict=True):
        a.set_xscale("log")
        a.set_yscale("log")
        a.set_xlabel("init scale α (per layer)")
        a.set_ylabel(ylabel)
        a.grid(True, which="major", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or f"Identity family, n = {n}, s = {s}, m = {m:g}: depth ≥ 3 → rank 1")
    return fig
