"""`gflow reproduce`: the paper's claims regenerated as a report a person reads.

Every number in the report is measured in the run that writes it; each claim row is marked ✓
when the measurement agrees with Shin & Yun (ICLR 2026) and ✗ when it does not.
"""

from __future__ import annotations

import base64
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SIZES = {
    "quick": dict(
        depths=(2, 3, 5),
        alphas=(1e-1, 1e-2, 1e-3),
        d=4,
        random_depths=(2, 3),
        random_alphas=(0.3, 0.1, 0.03),
        seeds=(0, 1),
        blocks=False,
        ms=(2.0, 4.0, 16.0, 64.0, math.inf),
        dxd=4,
        dxd_depths=(2, 3),
        lrs=(0.04, 0.02, 0.01),
    ),
    "default": dict(
        depths=(2, 3, 4, 5, 6),
        alphas=(1e-1, 3e-2, 1e-2, 3e-3, 1e-3, 1e-4),
        d=4,
        random_depths=(2, 3, 4),
        random_alphas=(0.3, 0.1, 0.03, 0.01),
        seeds=(0, 1, 2),
        blocks=True,
        ms=(1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 45.0, 55.0, 100.0, 400.0, math.inf),
        dxd=8,
        dxd_depths=(2, 3, 4),
        lrs=(0.04, 0.02, 0.01, 0.005),
    ),
    "full": dict(
        depths=(2, 3, 4, 5, 6),
        alphas=tuple(np.geomspace(0.3, 1e-4, 14)),
        d=6,
        random_depths=(2, 3, 4, 5),
        random_alphas=(0.3, 0.1, 0.03, 0.01, 0.003),
        seeds=tuple(range(8)),
        blocks=True,
        ms=tuple(np.geomspace(1.5, 500, 30)) + (math.inf,),
        dxd=16,
        dxd_depths=(2, 3, 4, 5),
        lrs=(0.08, 0.04, 0.02, 0.01, 0.005),
    ),
}


@dataclass
class Section:
    title: str
    text: str
    figure: str | None = None
    caption: str | None = None


def _figure(fig, out: Path, name: str) -> str:
    path = out / name
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name


def _rows_from_identity(ds, n):
    rows = []
    for depth in ds["depth"].values:
        for alpha in ds["alpha"].values:
            point = ds.sel(depth=depth, alpha=alpha).isel(m=0)
            la, lb = float(point["log_sigma_a_layers"]), float(point["log_sigma_b_layers"])
            rows.append(
                {
                    "L": int(depth),
                    "alpha": float(alpha),
                    "sigma_a": math.exp(la),
                    "sigma_b": math.exp(lb),
                    "stable_rank": 1 + (n - 1) * math.exp(2 * (lb - la)),
                    "srank_minus_1": (n - 1) * math.exp(2 * (lb - la)),
                    "status": int(point["status"]),
                }
            )
    return rows


def identity_family_section(size, out, bar):
    import gflow

    d = size["d"]
    spec = gflow.SweepSpec(
        axes={"depth": list(size["depths"]), "alpha": list(size["alphas"]), "m": [4.0]},
        fixed={"dim": d},
        chunk_size=len(size["alphas"]),
        top=d,
    )
    ds = gflow.sweep(spec, out / "identity_family.zarr", progress=False)
    gflow.export_table(ds, out / "identity_family.csv")
    bar.update(1)
    rows = _rows_from_identity(ds, d)
    worst = 0.0
    for r in rows:
        lim = gflow.family_limit(r["L"], d, 1, r["alpha"], 4.0)
        worst = max(
            worst,
            abs(math.log(r["sigma_b"]) - float(lim.log_sigma_b)),
            abs(r["sigma_a"] / float(lim.sigma_a) - 1),
        )
    fig = gflow.plot_rank_vs_alpha(rows, n=d, m=4.0)
    name = _figure(fig, out, "fig1_identity_family_rank.png")
    deep_small = [r for r in rows if r["L"] >= 3 and r["alpha"] == min(size["alphas"])]
    shallow = [r["stable_rank"] for r in rows if r["L"] == 2]
    caption = (
        f"Depth ≥ 3 drives the stable rank to 1 as α → 0 (srank − 1 = Θ(α^(2L)), Cor. 3.4); "
        f"depth 2 stays at {np.mean(shallow):.4f} for every α. Integrated endpoints agree with "
        f"the implicit equations to {worst:.1e} (max relative error of σ_A, σ_B)."
    )
    facts = {
        "identity_max_relerr": worst,
        "l2_srank": float(np.mean(shallow)),
        "deep_srank_minus_1": max(r["srank_minus_1"] for r in deep_small),
        "srank_minus_1_by_depth": {
            r["L"]: r["srank_minus_1"] for r in rows if r["alpha"] == min(size["alphas"])
        },
        "all_converged": bool(np.all(ds["status"].values == 0)),
    }
    text = (
        f"Identity family W_l(0) = α F_4, d = {d}, diagonal observations of X* = J. "
        f"{len(rows)} flows, all statuses: "
        f"{sorted({gflow.Status(int(s)).label for s in ds['status'].values.ravel()})}."
    )
    return (
        Section("Stable rank vs α, identity family (Thm 3.3 / Cor 3.4)", text, name, caption),
        facts,
        ds,
    )


def random_init_section(size, out, bar):
    import matplotlib.pyplot as plt

    import gflow

    problems = [("diagonal", {"dim": size["d"] + 2})]
    if size["blocks"]:
        problems.append(("block-diagonal", {"blocks": 3, "block_size": 2}))
    fig, axes = plt.subplots(
        1, len(problems), figsize=(5.2 * len(problems), 4), constrained_layout=True, squeeze=False
    )
    facts = {}
    for ax, (kind, fixed) in zip(axes[0], problems, strict=True):
        options = gflow.FlowOptions(t_max=1e4) if kind == "block-diagonal" else gflow.FlowOptions()
        spec = gflow.SweepSpec(
            axes={
                "depth": list(size["random_depths"]),
                "alpha": list(size["random_alphas"]),
                "seed": list(size["seeds"]),
            },
            fixed=fixed,
            problem=kind,
            init="gaussian",
            options=options,
            chunk_size=len(size["random_alphas"]) * len(size["seeds"]),
            top=6,
        )
        ds = gflow.sweep(spec, out / f"random_{kind}.zarr", progress=False)
        gflow.export_table(ds, out / f"random_{kind}.csv")
        bar.update(1)
        for depth in ds["depth"].values:
            sr = ds["stable_rank"].sel(depth=depth).values - 1.0
            mean, lo, hi = sr.mean(axis=-1), sr.min(axis=-1), sr.max(axis=-1)
            ax.errorbar(
                ds["alpha"].values,
                np.maximum(mean, 1e-16),
                yerr=[mean - lo, hi - mean],
                fmt="o-",
                capsize=3,
                label=f"L = {depth}",
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("init scale α (Gaussian, per layer)")
        ax.set_ylabel("stable rank − 1 (mean, min–max over seeds)")
        ax.set_title(f"random init, {kind} observations")
        ax.legend(fontsize=8)
        small = ds.sel(alpha=min(size["random_alphas"]))
        facts[kind] = {
            int(dep): float(small["stable_rank"].sel(depth=dep).mean())
            for dep in ds["depth"].values
        }
        facts[kind + "_status"] = sorted(
            {gflow.Status(int(s)).label for s in ds["status"].values.ravel()}
        )
    name = _figure(fig, out, "fig2_random_init_rank.png")
    diag = facts["diagonal"]
    caption = (
        "Beyond the family: with Gaussian inits the depth-2 endpoint stays high-rank "
        f"(stable rank {diag[2]:.3f} at the smallest α) while depth ≥ 3 approaches 1 "
        f"(L = 3: {diag[3]:.6f})."
    )
    text = (
        "Gaussian inits α·N(0, 1/d), seeds as error bars. Block-diagonal flows run to "
        "t = 1e4: their within-block modes decay only algebraically (theory.md §5)."
    )
    return Section("Random initialisations", text, name, caption), facts


def coupling_section():
    import gflow

    cases = []
    d = 4
    diag = gflow.diagonal(d)
    blocks = gflow.block_diagonal(2, 2)
    connected = gflow.Problem(np.ones((d, d)), np.eye(d) + np.eye(d, k=1))
    for depth in (2, 3, 5):
        for init_name, init in (
            ("identity, m = ∞ (diagonal init)", gflow.identity_family(d, depth, 0.1, math.inf)),
            ("identity, m = 4", gflow.identity_family(d, depth, 0.1, 4.0)),
            ("Gaussian", gflow.gaussian([d] * (depth + 1), 0.5, key=depth)),
        ):
            for omega_name, problem in (
                ("diagonal", diag),
                ("2 blocks", blocks),
                ("connected", connected),
            ):
                report = gflow.coupling(init, problem)
                cases.append(
                    {
                        "L": depth,
                        "init": init_name,
                        "Ω": omega_name,
                        "verdict": report.verdict,
                        "max cosine between groups": report.max_cosine_between_groups,
                    }
                )
    lines = ["| L | init | Ω | verdict |", "|---|---|---|---|"]
    lines += [f"| {c['L']} | {c['init']} | {c['Ω']} | {c['verdict']} |" for c in cases]
    text = (
        "Coupling at initialisation (the per-observation NTK Θ, cosine > 1e-10 joins two "
        "observations; theory.md §10). Depth 2 never couples observations that share no "
        "row or column; depth ≥ 3 couples everything unless the init is diagonal.\n\n"
        + "\n".join(lines)
    )
    return Section("Coupling verdicts", text), cases


def spectra_section(ds, out):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4), constrained_layout=True)
    alpha = float(min(ds["alpha"].values))
    for depth in ds["depth"].values:
        point = ds.sel(depth=depth, alpha=alpha).isel(m=0)
        la, lb = float(point["log_sigma_a_layers"]), float(point["log_sigma_b_layers"])
        n = ds.sizes["k"]
        values = [math.exp(la)] + [math.exp(lb)] * (n - 1)
        ax.semilogy(range(1, n + 1), values, "o-", label=f"L = {depth}")
    ax.set_xlabel("index i")
    ax.set_ylabel("singular value σ_i (from the layers)")
    ax.set_xticks(range(1, ds.sizes["k"] + 1))
    ax.set_title(f"Endpoint spectra, identity family, α = {alpha:g}")
    ax.legend(fontsize=8)
    name = _figure(fig, out, "fig3_spectra.png")
    caption = (
        "The tail of the spectrum falls like α^L with depth: the SVD of the product could "
        "not resolve these values (below 1e-15·σ₁); gflow measures them from the layers."
    )
    return Section("Endpoint spectra", "", name, caption)


def plasticity_section(size, out, bar):
    import matplotlib.pyplot as plt

    import gflow

    ms = size["ms"]
    curves = {depth: gflow.two_by_two_warm_curve(depth, ms) for depth in (2, 3)}
    bar.update(1)
    rows = gflow.dxd_study(size["dxd"], size["dxd_depths"], (0.1,), seed=0, extra=size["dxd"] - 1)
    # Depth 2 on the connected Ω₂ alone, from a small init: the low-rank bias of a connected
    # problem (same problem and programs as the cold starts above).
    connected = gflow.dxd_study(size["dxd"], (2,), (1e-3,), seed=0, extra=size["dxd"] - 1)[0]
    bar.update(1)
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
    axes[1].plot(depths, [r["warm_stable_rank"] for r in rows], "o-", label="warm")
    axes[1].plot(depths, [r["cold_stable_rank"] for r in rows], "s--", label="cold")
    axes[1].set_xticks(depths)
    axes[1].set_xlabel("depth L")
    axes[1].set_ylabel("stable rank after training on Ω₂")
    axes[1].set_title(f"{size['dxd']}×{size['dxd']}, X* = J, Ω₁ = diag ⊂ Ω₂ (connected)")
    axes[1].legend()
    name = _figure(fig, out, "fig4_plasticity.png")
    l2 = rows[0]
    sign_ok = bool(
        all(v > 0 for m, v in zip(ms, curves[2], strict=True) if m < 49)
        and all(v < 0 for m, v in zip(ms, curves[2], strict=True) if m > 51)
    )
    caption = (
        f"Depth 2 loses plasticity: warm stable rank {l2['warm_stable_rank']:.4f} vs cold "
        f"{l2['cold_stable_rank']:.4f} (it moves only {l2['warm_distance']:.3f} of its norm); "
        f"the 2×2 warm start has the wrong sign exactly for m > m* ({'yes' if sign_ok else 'NO'}). "
        "Depth 3 after coupled pretraining recovers."
    )
    facts = {
        "rows": rows,
        "l2_connected_small_alpha_srank": connected["cold_stable_rank"],
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


def descent_section(size, out, bar):
    import matplotlib.pyplot as plt

    import gflow

    problem = gflow.diagonal(2)  # shares compiled programs with the 2×2 plasticity flows
    lrs = size["lrs"]
    fig, ax = plt.subplots(figsize=(5.5, 4), constrained_layout=True)
    slopes = {}
    for depth in (2, 3):
        init = gflow.identity_family(2, depth, 0.3, 4.0)
        ref = gflow.flow(problem, init)
        errs = []
        for lr in lrs:
            gd = gflow.descend(problem, init, lr=lr)
            errs.append(gflow.endpoint_distance(gd, ref, problem)["singular_values"])
        errs = np.maximum(errs, 1e-16)
        slopes[depth] = gflow.loglog_slope(lrs, errs) if errs.min() > 1e-12 else 0.0
        ax.loglog(lrs, errs, "o-", label=f"SGD, L = {depth} (slope {slopes[depth]:.2f})")
        adam = gflow.descend(problem, init, optimizer="adam", lr=1e-3, max_steps=50_000)
        ax.axhline(
            max(gflow.endpoint_distance(adam, ref, problem)["singular_values"], 1e-16),
            ls=":",
            color=ax.lines[-1].get_color(),
            label=f"Adam lr 1e-3, L = {depth}",
        )
    bar.update(1)
    ax.set_xlabel("learning rate")
    ax.set_ylabel("endpoint error vs the flow (max rel., σ)")
    ax.set_title("Discrete optimizers vs the exact flow")
    ax.legend(fontsize=7)
    name = _figure(fig, out, "fig5_flow_vs_sgd.png")
    caption = (
        f"SGD's endpoint error scales like lr^{slopes[3]:.2f} at depth 3; at depth 2 on "
        "the identity family GD reaches the flow's limit exactly (λ_A/λ_B is conserved)."
    )
    return Section("Flow vs SGD / Adam", "", name, caption), {"slopes": slopes}


def claims_table(facts) -> tuple[str, list[dict]]:
    couple = {(c["L"], c["init"], c["Ω"]): c["verdict"] for c in facts["coupling"]}
    plast = facts["plasticity"]
    l2row = plast["rows"][0]
    l3row = next((r for r in plast["rows"] if r["L"] == 3), None)
    diag = facts["random"]["diagonal"]
    rows = [
        {
            "row": "L = 2, general init, disconnected Ω",
            "coupled": couple[(2, "Gaussian", "diagonal")],
            "expect_coupled": False,
            "rank": f"stable rank {diag[2]:.3f}",
            "low_rank": diag[2] < 1.01,
            "plasticity": f"warm {l2row['warm_stable_rank']:.3f} vs cold "
            f"{l2row['cold_stable_rank']:.3f}",
            "loses": l2row["warm_stable_rank"] > l2row["cold_stable_rank"] + 1e-3,
            "expect": (False, False, True),
        },
        {
            "row": "L = 2, connected Ω",
            "coupled": couple[(2, "Gaussian", "connected")],
            "expect_coupled": True,
            "rank": "cold start on connected Ω₂ from α = 1e-3: "
            f"{plast['l2_connected_small_alpha_srank']:.5f}",
            "low_rank": plast["l2_connected_small_alpha_srank"] < 1.01,
            "plasticity": "—",
            "loses": None,
            "expect": (True, True, None),
        },
        {
            "row": "L = 3, general init (m = 4 / Gaussian)",
            "coupled": couple[(3, "identity, m = 4", "diagonal")],
            "expect_coupled": True,
            "rank": f"stable rank − 1 = {facts['identity']['srank_minus_1_by_depth'][3]:.1e}",
            "low_rank": facts["identity"]["srank_minus_1_by_depth"][3] < 1e-3,
            "plasticity": (
                f"warm {l3row['warm_stable_rank']:.4f} vs cold {l3row['cold_stable_rank']:.4f}"
            )
            if l3row
            else "—",
            "loses": (l3row["warm_stable_rank"] > 1.01) if l3row else None,
            "expect": (True, True, False),
        },
        {
            "row": "L = 3, diagonal init (m = ∞)",
            "coupled": couple[(3, "identity, m = ∞ (diagonal init)", "diagonal")],
            "expect_coupled": False,
            "rank": "X = w·B, rank n",
            "low_rank": False,
            "plasticity": f"2×2 warm X₂₁ = {plast['l3_minf_warm_x21']:+.6f}",
            "loses": plast["l3_minf_warm_x21"] < 0,
            "expect": (False, False, True),
        },
        {
            "row": "L = 5, general init",
            "coupled": couple[(5, "Gaussian", "diagonal")],
            "expect_coupled": True,
            "rank": f"stable rank − 1 = {facts['identity']['srank_minus_1_by_depth'][5]:.1e}",
            "low_rank": facts["identity"]["srank_minus_1_by_depth"][5] < 1e-3,
            "plasticity": "—",
            "loses": None,
            "expect": (True, True, None),
        },
    ]
    lines = ["| claim row | coupled? | limit rank | loss of plasticity? |", "|---|---|---|---|"]
    verdicts = []
    for r in rows:
        is_coupled = r["coupled"] == "coupled"
        marks = [
            is_coupled == r["expect"][0],
            r["low_rank"] == r["expect"][1],
            r["loses"] == r["expect"][2] if r["expect"][2] is not None else None,
        ]
        r["marks"] = marks
        cell = lambda ok, text: text if ok is None else f"{'✓' if ok else '✗'} {text}"
        rank = ("low: " if r["low_rank"] else "high: ") + r["rank"]
        plasticity = "—"
        if r["loses"] is not None:
            plasticity = cell(marks[2], ("yes: " if r["loses"] else "no: ") + r["plasticity"])
        lines.append(
            f"| {r['row']} | {cell(marks[0], r['coupled'])} | {cell(marks[1], rank)} | "
            f"{plasticity} |"
        )
        verdicts.append({"row": r["row"], "marks": marks})
    return "\n".join(lines), verdicts


def reproduce(out="gflow-report", mode="default", progress=True) -> dict:
    """Run the built-in study and write `report.md`, `report.html`, figures and raw data to
    `out`. Returns the facts and the claims verdicts."""
    from tqdm.auto import tqdm

    if mode not in SIZES:
        raise ValueError(f"unknown mode {mode!r}; choose from {sorted(SIZES)}")
    size = SIZES[mode]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.zarr"):
        import shutil

        shutil.rmtree(stale)
    start = time.perf_counter()
    bar = tqdm(total=8, desc=f"gflow reproduce ({mode})", unit="stage", disable=not progress)
    facts = {}
    sections = []
    sec, facts["identity"], ds_identity = identity_family_section(size, out, bar)
    sections.append(sec)
    sec, facts["random"] = random_init_section(size, out, bar)
    sections.append(sec)
    sec, facts["coupling"] = coupling_section()
    sections.append(sec)
    bar.update(1)
    sections.append(spectra_section(ds_identity, out))
    sec, facts["plasticity"] = plasticity_section(size, out, bar)
    sections.append(sec)
    sec, facts["descent"] = descent_section(size, out, bar)
    sections.append(sec)
    table, verdicts = claims_table(facts)
    bar.update(bar.total - bar.n)
    bar.close()
    elapsed = time.perf_counter() - start
    facts["claims"] = verdicts
    facts["elapsed_s"] = elapsed
    _write_report(out, sections, table, mode, elapsed)
    with open(out / "facts.json", "w") as f:
        json.dump(facts, f, indent=1, default=str)
    return facts


def _write_report(out: Path, sections, table, mode, elapsed):
    import gflow

    head = (
        "# gflow reproduce: depth promotes low-rankness\n\n"
        f"Generated by gflow {gflow.__version__} (`gflow reproduce --{mode}` mode: {mode}) in "
        f"{elapsed:.0f} s. Every number below was measured in this run; ✓ marks agreement with "
        "Shin & Yun, *Implicit Bias and Loss of Plasticity in Matrix Completion: Depth Promotes "
        "Low-Rankness* (ICLR 2026), ✗ disagreement.\n\n## Claims\n\n" + table + "\n"
    )
    md = [head]
    html = [_md_to_html(head)]
    for s in sections:
        block = f"\n## {s.title}\n\n{s.text}\n"
        if s.figure:
            block += f"\n![{s.caption}]({s.figure})\n\n*{s.caption}*\n"
        md.append(block)
        html.append(_md_to_html(f"\n## {s.title}\n\n{s.text}\n"))
        if s.figure:
            data = base64.b64encode((out / s.figure).read_bytes()).decode()
            html.append(
                f'<figure><img src="data:image/png;base64,{data}" style="max-width:100%">'
                f"<figcaption>{s.caption}</figcaption></figure>"
            )
    (out / "report.md").write_text("".join(md))
    (out / "report.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>gflow reproduce</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 6px}</style>"
        + "".join(html)
    )


def _md_to_html(text: str) -> str:
    """Just enough Markdown for the report: headings, paragraphs, pipe tables."""
    import html as _html

    out, table = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not all(set(c) <= {"-"} for c in cells):
                table.append(cells)
            continue
        if table:
            rows = "".join(
                "<tr>"
                + "".join(
                    f"<{'th' if i == 0 else 'td'}>{_html.escape(c)}</{'th' if i == 0 else 'td'}>"
                    for c in r
                )
                + "</tr>"
                for i, r in enumerate(table)
            )
            out.append(f"<table>{rows}</table>")
            table = []
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_html.escape(line.lstrip('# '))}</h{level}>")
        elif line.strip():
            out.append(f"<p>{_html.escape(line)}</p>")
    if table:
        rows = "".join(
            "<tr>" + "".join(f"<td>{_html.escape(c)}</td>" for c in r) + "</tr>" for r in table
        )
        out.append(f"<table>{rows}</table>")
    return "\n".join(out)
