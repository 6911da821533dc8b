"""The report's sections on training: loss of plasticity, and discrete optimizers against the
exact flow."""

from __future__ import annotations

import json
import math

import numpy as np

from ._report import Section, _figure, _sentence, converged, status_note


def plasticity_section(size, out, bar):

    import gflow

    ms = size["ms"]
    curves = {depth: gflow.studies.two_by_two_warm_curve(depth, ms) for depth in (2, 3)}
    bar.update(1)
    rows = gflow.studies.dxd_study(
        size["dxd"], size["dxd_depths"], (0.1,), seed=0, extra=size["dxd"] - 1
    )
    # Depth 2 on the connected Ω₂ alone, from a small init: the low-rank bias of a connected
    # problem (same problem and programs as the cold starts above).
    connected = gflow.studies.dxd_study(size["dxd"], (2,), (1e-3,), seed=0, extra=size["dxd"] - 1)[
        0
    ]
    bar.update(1)
    name = _plasticity_figure(curves, rows, size, out)
    l2 = rows[0]
    # a NaN (not converged) fails every comparison: no sign claim rests on it
    sign_ok = bool(
        all(v > 0 for m, v in zip(ms, curves[2], strict=True) if m < 49)
        and all(v < 0 for m, v in zip(ms, curves[2], strict=True) if m > 51)
    )
    statuses = [r[f"{p}_status"] for r in rows for p in ("pretrain", "warm", "cold")]
    statuses += [connected["cold_status"]]
    codes = [int(gflow.Status[label.upper()]) for label in statuses]
    curve_values = np.concatenate(list(curves.values()))
    not_reached = int(np.isnan(curve_values).sum())
    caption = (
        f"Depth 2 loses plasticity: warm stable rank {l2['warm_stable_rank']:.4f} vs cold "
        f"{l2['cold_stable_rank']:.4f} (it moves only {l2['warm_distance']:.3f} of its norm); "
        f"the 2×2 warm start has the wrong sign exactly for m > m* ({'yes' if sign_ok else 'NO'}). "
        "Depth 3 after coupled pretraining recovers. The right panel's axis starts at stable "
        "rank 1 (rank one): its gaps are small in absolute terms. "
        + (
            f"{not_reached} of the {curve_values.size} 2×2 warm starts did not converge and are "
            "left out. "
            if not_reached
            else f"All {curve_values.size} 2×2 pretrain/warm pairs converged. "
        )
        + _sentence(status_note(codes, "d×d flows", "left out"))
        + "."
    )
    facts = {
        "rows": rows,
        "all_converged": statuses.count("converged") == len(statuses) and not not_reached,
        "l2_connected_small_alpha_srank": connected["cold_stable_rank"]
        if connected["cold_status"] == "converged"
        else None,
        "sign_flip_at_m_star": sign_ok,
        "l3_m4_warm_x21": float(curves[3][list(ms).index(4.0)]) if 4.0 in ms else None,
        "l3_minf_warm_x21": float(curves[3][-1]),
        "l2_minf_warm_x21": float(curves[2][-1]),
    }
    with open(out / "plasticity.json", "w") as f:
        json.dump(
            {
                "ms": [str(m) for m in ms],
                "curves": {k: v.tolist() for k, v in curves.items()},
                "dxd": rows,
            },
            f,
        )
    return Section("Loss of plasticity", "", name, caption), facts


def _plasticity_figure(curves, rows, size, out) -> str:
    """fig 4: the 2×2 warm-start curves against m, and the d×d stable ranks against depth."""
    import matplotlib.pyplot as plt

    ms = size["ms"]
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 4), constrained_layout=True)
    finite = np.array([m if math.isfinite(m) else 2e3 for m in ms])
    for depth, vals in curves.items():
        axes[0].semilogx(finite, vals, "o-", ms=3, label=f"warm start, L = {depth}")
    axes[0].axhline(0, color="k", lw=0.8)
    axes[0].axvline(49.99, color="r", ls="--", lw=0.8, label="m* ≈ 49.99")
    axes[0].set_xlabel("init shape m of the pretraining (m = ∞ plotted at 2000)")
    axes[0].set_ylabel("unobserved X₂₁ after resuming (truth 1)")
    axes[0].set_title("2×2: pretrain on the diagonal, resume with X₁₂")
    axes[0].legend(fontsize=8)
    depths = [r["L"] for r in rows]
    for phase, style in (("warm", "o-"), ("cold", "s--")):
        reached = [r["pretrain_status"] == r[f"{phase}_status"] == "converged" for r in rows]
        values = [r[f"{phase}_stable_rank"] for r in rows]
        axes[1].plot(depths, np.where(reached, values, np.nan), style, label=phase)
    axes[1].set_xticks(depths)
    axes[1].set_xlabel("depth L")
    axes[1].set_ylabel("stable rank after training on Ω₂")
    # the baseline: stable rank 1 is a rank-one matrix (a margin keeps points on it whole)
    axes[1].axhline(1.0, color="k", lw=0.8, label="rank one")
    top = axes[1].get_ylim()[1]
    axes[1].set_ylim(1.0 - 0.04 * (top - 1.0), top)
    axes[1].set_title(f"{size['dxd']}×{size['dxd']}, X* = J, Ω₁ = diag ⊂ Ω₂ (connected)")
    axes[1].legend()
    return _figure(fig, out, "fig4_plasticity.png")


ADAM_LR = 1e-3


def descent_section(size, out, bar):
    import matplotlib.pyplot as plt

    import gflow

    problem = gflow.diagonal(2)  # shares compiled programs with the 2×2 plasticity flows
    lrs = size["lrs"]
    fig, ax = plt.subplots(figsize=(5.5, 4), constrained_layout=True)
    slopes = {}
    statuses = []
    for depth in (2, 3):
        init = gflow.identity_family(2, depth, 0.3, 4.0)
        ref = gflow.flow(problem, init)
        statuses.append(int(ref.status))
        runs = [gflow.descend(problem, init, lr=lr) for lr in lrs]
        statuses += [int(gd.status) for gd in runs]
        # only descents that converged, measured against a converged flow, are endpoints
        errs = np.array(
            [
                gflow.endpoint_distance(gd, ref, problem)["singular_values"]
                if converged(gd.status) and converged(ref.status)
                else np.nan
                for gd in runs
            ]
        )
        errs = np.maximum(errs, 1e-16)
        good = ~np.isnan(errs)
        fit = good.sum() >= 2 and errs[good].min() > 1e-12
        slopes[depth] = gflow.loglog_slope(np.asarray(lrs)[good], errs[good]) if fit else None
        slope = "no fit" if slopes[depth] is None else f"slope {slopes[depth]:.2f}"
        if good.any() and errs[good].max() < 1e-8:  # the flow's limit, to its tolerance
            slope = f"= the flow's limit to {errs[good].max():.0e}"
        ax.loglog(np.asarray(lrs)[good], errs[good], "o-", label=f"SGD, L = {depth} ({slope})")
        adam = gflow.descend(problem, init, optimizer="adam", lr=ADAM_LR, max_steps=50_000)
        statuses.append(int(adam.status))
        if converged(adam.status) and converged(ref.status):
            # one run at one learning rate: a marker, not a line across rates it never ran
            ax.plot(
                [ADAM_LR],
                [max(gflow.endpoint_distance(adam, ref, problem)["singular_values"], 1e-16)],
                ls="none",
                marker="D" if depth == 2 else "s",
                ms=10 if depth == 2 else 5,  # the larger hollow one stays visible beneath
                mfc="none" if depth == 2 else ax.lines[-1].get_color(),
                color=ax.lines[-1].get_color(),
                label=f"Adam (lr {ADAM_LR:g}), L = {depth}",
            )
    bar.update(1)
    ticks = sorted({*lrs, ADAM_LR})
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.set_xlabel("learning rate")
    ax.set_ylabel("endpoint error vs the flow (max rel., σ)")
    ax.set_title("Discrete optimizers vs the exact flow")
    ax.legend(fontsize=7)
    name = _figure(fig, out, "fig5_flow_vs_sgd.png")
    slope3 = "(no fit: too few converged runs)" if slopes[3] is None else f"{slopes[3]:.2f}"
    caption = (
        f"SGD's endpoint error scales like lr^{slope3} at depth 3; at depth 2 on "
        "the identity family GD reaches the flow's limit exactly (λ_A/λ_B is conserved). "
        f"{_sentence(status_note(statuses, 'runs (flows, SGD and Adam)', 'left out'))}."
    )
    return Section("Flow vs SGD / Adam", "", name, caption), {"slopes": slopes}
