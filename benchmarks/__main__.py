"""`python -m benchmarks run [--quick] [--only NAME ...] [--out DIR]`

Runs each benchmark, writes `DIR/NAME.json` and `DIR/NAME.png`, and prints a summary of the
ratios measured side by side in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _plot(name, result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4), constrained_layout=True)
    if name == "sgd_matched_accuracy":
        for case, r in result.items():
            lrs = [x["lr"] for x in r["sgd_runs"]]
            errors = [x["error"] for x in r["sgd_runs"]]
            ax.loglog(lrs, errors, "o", label=f"SGD, {case} (slope {r['fitted_slope']:.2f})")
            if r["error_proportional_to_lr"]:
                xs = sorted([t["sgd_lr"] for t in r["targets"]] + lrs)
                ax.loglog(xs, [r["error_per_lr"] * x for x in xs], "--", lw=0.8)
        ax.set_xlabel("learning rate")
        ax.set_ylabel("endpoint error (σ ≥ 1e-6σ₁) vs the exact flow")
        ax.set_title("SGD error ∝ lr: the fit used to extrapolate")
    elif name == "small_alpha_reach":
        rows = result["rows"]
        labels = [f"L{r['L']} α{r['alpha']:.0e}" for r in rows]
        ax.bar(range(len(rows)), [r["sgd_steps_needed"] for r in rows], label="SGD steps needed")
        ax.bar(range(len(rows)), [r["gflow_steps"] for r in rows], label="gflow steps")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), labels, rotation=60, fontsize=7)
        ax.set_ylabel("steps to the endpoint")
        ax.set_title("Small-α reach")
    elif name == "other_integrators":
        names = ["gflow"] + list(result["baselines"])
        walls = [result["gflow_wall_s"]] + [b["wall_s"] for b in result["baselines"].values()]
        ax.bar(names, walls)
        ax.set_yscale("log")
        ax.set_ylabel("wall time per flow (s)")
        ax.set_title(f"One flow, {result['problem']}, rtol {result['rtol']:g}")
    elif name == "sweep_throughput":
        rows = result["rows"]
        ax.plot(
            [r["batch_size"] for r in rows],
            [r["flows_per_s"] for r in rows],
            "o-",
            label="gflow sweep",
        )
        ax.axhline(
            result["python_loop_flows_per_s"],
            ls="--",
            color="k",
            label="Python loop of jitted flows",
        )
        ax.set_xscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("flows per second")
        ax.set_title(f"Sweep throughput ({result['flows']} flows)")
    elif name == "rhs_efficiency":
        for depth in sorted({r["L"] for r in result["rows"]}):
            rows = [r for r in result["rows"] if r["L"] == depth]
            ax.semilogx(
                [r["d"] for r in rows],
                [r["fraction_of_matmul_rate"] for r in rows],
                "o-",
                label=f"L = {depth}",
            )
        ax.set_xlabel("matrix size d")
        ax.set_ylabel("gradient FLOP rate / matmul FLOP rate")
        ax.set_title("RHS efficiency")
    elif name == "startup":
        cases = result["cases"]
        modes = list(next(iter(cases.values()))["best_wall_s"])
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [j + i * width for j in range(len(cases))]
            walls = [case["best_wall_s"][mode] for case in cases.values()]
            compiles = [case["best_compile_s"][mode] for case in cases.values()]
            ax.bar(xs, walls, width, label=mode)
            ax.bar(xs, compiles, width, color="k", alpha=0.3)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], list(cases), fontsize=7)
        ax.axhline(result["import_s"], color="k", ls=":", label="import gflow")
        ax.set_ylabel("seconds per process (shaded: compile or load)")
        ax.set_title("start-up", fontsize=9)
        ax.legend(fontsize=7)
    elif name == "scale":
        rows = result["rows"]
        ds = [r["d"] for r in rows]
        ax.loglog(ds, [r["solve_s"] for r in rows], "o-", label="gflow exact flow (solve)")
        for r in rows:  # a flow that did not converge has no endpoint to match: say so
            if r["status"] != "converged":
                ax.annotate(
                    f"{r['status']}: not an endpoint",
                    (r["d"], r["solve_s"]),
                    fontsize=7,
                    color="C3",
                    xytext=(7, 5),
                    textcoords="offset points",
                )
        for k, eps in enumerate((1e-4, 1e-6)):
            ts = [next(t for t in r["targets"] if t["target"] == eps) for r in rows]
            keys = ("sgd_s", "sgd_s_extrapolated", "sgd_s_at_least")
            ys = [next(t[k] for k in keys if k in t) for t in ts]
            # Markers only: a measured time, an extrapolation and a lower bound are not one curve.
            (marker,) = ax.loglog(
                ds, ys, "sv"[k], ls="none", ms=7, label=f"SGD to within {eps:.0e}"
            )
            for x, y, t in zip(ds, ys, ts, strict=True):
                if "sgd_s" not in t:
                    note = "≈ extrapolated" if "sgd_s_extrapolated" in t else "≥ lower bound"
                    # 1e-6 (the higher point) labelled above, 1e-4 below: never on each other
                    ax.annotate(
                        note,
                        (x, y),
                        fontsize=7,
                        color=marker.get_color(),
                        xytext=(7, 4 if k else -10),
                        textcoords="offset points",
                        ha="left",
                    )
        ax.set_xticks(ds, [str(d) for d in ds])
        ax.minorticks_off()
        ax.set_xlim(ds[0] / 1.25, ds[-1] * 1.6)  # room for the notes right of the last size
        ax.set_xlabel("matrix size d (Bernoulli 0.3 mask, rank 5, L = 3)")
        ax.set_ylabel("seconds")
        ax.set_title("Field-size problems: exact flow vs SGD at matched accuracy", fontsize=9)
    elif name == "stiff_tail":
        width = 0.8 / len(result)
        names = list(dict.fromkeys(n for case in result.values() for n in case["rows"]))
        for k, (size, case) in enumerate(result.items()):
            xs = [names.index(n) + k * width for n in case["rows"]]
            ax.bar(xs, [v["wall_s"] for v in case["rows"].values()], width, label=size)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, fontsize=7)
        ax.tick_params(axis="x", labelrotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("wall time after compilation (s)")
        ax.set_title("stiff tails: Bernoulli masks, L = 3, Gaussian α = 0.05", fontsize=9)
    ax.legend(fontsize=8) if ax.get_legend_handles_labels()[0] else None
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _variant_text(row: dict, name: str) -> str:
    """A side-by-side variant of a `scale` flow: its solve time, the default's over it, and
    how far apart the endpoints are."""
    v = row[name]
    return (
        f"{v['solve_s']:.3g} s, {row['solve_s'] / v['solve_s']:.2g}× faster, "
        f"{v['tail_steps']} tail steps, σ {v['sigma_max_relative_difference']:.1e} apart"
    )


def _sgd_ratio(target: dict) -> str:
    """SGD's time over gflow's for one accuracy target: measured, extrapolated or a bound."""
    if "ratio" in target:
        return f"SGD/gflow = {target['ratio']:.3g}×"
    if "ratio_extrapolated" in target:
        return f"SGD/gflow ≈ {target['ratio_extrapolated']:.3g}× (extrapolated)"
    return f"SGD/gflow ≥ {target['ratio_at_least']:.3g}×"


def _summary(name, r):
    if name == "sgd_matched_accuracy":
        parts = []
        for case, v in r.items():
            if not v["error_proportional_to_lr"]:
                parts.append(
                    f"{case}: SGD error not ∝ lr (slope {v['fitted_slope']:.2f}, statuses "
                    f"{sorted({x['status'] for x in v['sgd_runs']})}), no extrapolation"
                )
            for t in v["targets"]:
                if "ratio" in t or "ratio_at_least" in t:
                    missed = "SGD never reached it; " if "ratio_at_least" in t else ""
                    parts.append(f"{case} {t['target']:.0e}: {missed}{_sgd_ratio(t)}")
        return "; ".join(parts)
    if name == "small_alpha_reach":
        worst = min(x["ratio"] for x in r["rows"])
        best = max(x["ratio"] for x in r["rows"])
        return f"SGD/gflow wall (estimated) = {worst:.3g}× … {best:.3g}×"
    if name == "other_integrators":
        parts = [f"{k}/gflow = {v['ratio']:.3g}×" for k, v in r["baselines"].items()]
        via = r["gflow_via_diffeqsolve"]["ratio"]
        parts.append(f"gflow through diffeqsolve/gflow's own loop = {via:.3g}×")
        parts.append(
            f"{r['sweep']['flows']}-flow sweep: scipy DOP853/gflow = {r['sweep']['ratio']:.3g}×"
        )
        t = r["torchdiffeq"]
        parts.append(
            t
            if isinstance(t, str)
            else (
                f"torchdiffeq/gflow = {t['ratio']:.3g}× per flow, {t['sweep_ratio']:.3g}× on the "
                f"{r['sweep']['flows']}-flow sweep at equal tolerance (torchdiffeq's faster "
                f"of a loop, {t['sweep_loop_estimated_s']:.3g} s, and one batched solve "
                f"holding every flow to the tolerance, "
                f"{t['sweep_batched_per_flow_tolerance_s']:.3g} s; batched with one RMS "
                f"over all flows: {t['sweep_batched_s']:.3g} s = "
                f"{t['sweep_batched_s'] / r['sweep']['gflow_wall_s']:.3g}×)"
            )
        )
        return "; ".join(parts)
    if name == "sweep_throughput":
        best = max(r["rows"], key=lambda x: x["flows_per_s"])
        text = (
            f"{best['flows_per_s']:.3g} flows/s at batch {best['batch_size']} "
            f"(efficiency {best['batch_efficiency']:.2f}), {best['speedup_vs_loop']:.3g}× "
            "a Python loop"
        )
        if isinstance(r["depth_modes"], dict):
            text += (
                "; depths padded/compiled separately = "
                f"{r['depth_modes']['pad_over_compile']:.3g}× the wall (with compilation)"
            )
        return text
    if name == "stiff_tail":
        parts = []
        for size, case in r.items():
            rows = "; ".join(
                f"{k}: {v['status']} {v['wall_s']:.3g} s ({v['steps']} steps)"
                for k, v in case["rows"].items()
            )
            ratio = case.get("ratio_kvaerno5_over_auto")
            parts.append(f"{size}: {rows}" + (f"; Kvaerno5/auto = {ratio:.3g}×" if ratio else ""))
        return " | ".join(parts)
    if name == "startup":
        parts = [
            f"{label}: repeated {c['best_wall_s']['repeated (cache hit)']:.2f} s vs "
            f"{c['best_wall_s']['no cache']:.2f} s uncached ({c['no_cache_over_repeated']:.3g}×),"
            f" compile {c['best_compile_s']['repeated (cache hit)']:.2f} vs "
            f"{c['best_compile_s']['no cache']:.2f} s, identical: {c['identical_results']}"
            for label, c in r["cases"].items()
        ]
        return " | ".join(parts) + f" | import {r['import_s']:.2f} s"
    if name == "scale":
        parts = [
            f"d={row['d']}: {row['status']} {row['solve_s']:.3g} s ({row['steps']} steps, "
            f"{row['linear_iters']} CG, {row['peak_rss_mb']:.0f} MB; RODAS4 "
            f"{row['rodas4']['solve_s']:.3g} s, {row['rodas4']['solve_s'] / row['solve_s']:.2g}×; "
            f"tail_rtol 1e-8 {_variant_text(row, 'tail_rtol_1e-8')}); "
            + ", ".join(f"{t['target']:.0e}: {_sgd_ratio(t)}" for t in row["targets"])
            for row in r["rows"]
        ]
        sweep = r["sweep"]
        apart = sweep["apart"]
        text = (
            f"{sweep['flows']}-flow sweep, tails apart: {apart['wall_s']:.3g} s "
            f"({apart['converged']} converged, {apart['max_steps']} out of steps, "
            f"{apart.get('rounding_floor', 0)} at the rounding floor)"
        )
        if "chunk by chunk_over_apart" in sweep:
            text += f"; chunk by chunk/across chunks = {sweep['chunk by chunk_over_apart']:.3g}×"
        if "batch_over_apart" in sweep:
            text += (
                f"; tails one at a time/side by side = {sweep['one at a time_over_apart']:.3g}×"
                f", batched/side by side = {sweep['batch_over_apart']:.3g}×"
            )
        return " | ".join(parts + [text])
    if name == "rhs_efficiency":
        return "; ".join(
            f"d={x['d']} L={x['L']}: {x['fraction_of_matmul_rate']:.0%}" for x in r["rows"]
        )
    return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("command", choices=["run"])
    parser.add_argument("--quick", action="store_true", help="CI sizes (≤ 2 min on 2 cores)")
    parser.add_argument("--only", nargs="+", help="run only these benchmarks")
    parser.add_argument("--out", default="benchmarks/results", help="output folder")
    args = parser.parse_args(argv)
    from benchmarks.suite import BENCHMARKS, environment

    names = args.only or list(BENCHMARKS)
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        parser.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {list(BENCHMARKS)}")
    os.makedirs(args.out, exist_ok=True)
    env = environment()
    print(
        f"gflow benchmarks ({'quick' if args.quick else 'full'}) on {env['device']}, "
        f"{env['dtype']}, jax {env['jax']}"
    )
    for name in names:
        start = time.perf_counter()
        result = BENCHMARKS[name](args.quick)
        elapsed = time.perf_counter() - start
        record = {
            "benchmark": name,
            "quick": args.quick,
            "elapsed_s": elapsed,
            **env,
            "result": result,
        }
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)
        _plot(name, result, os.path.join(args.out, f"{name}.png"))
        print(f"{name:>22} ({elapsed:5.1f} s)  {_summary(name, result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
