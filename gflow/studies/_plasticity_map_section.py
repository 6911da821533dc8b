"""The report's plasticity map: where depth protects plasticity, by the exact flow and by
gradient descent at the field's learning rates, with the claim tested cell by cell."""

from __future__ import annotations

import math

import numpy as np

from ._plasticity_map import PRESETS, plasticity_map
from ._plasticity_verdicts import (
    COLD_LIMIT,
    TOLERANCE,
    claim_summary,
    descent_disagreements,
    plasticity_endpoints,
    plasticity_verdicts,
    plot_deficit,
)
from ._report import Section, _figure, markdown_table


def _g(x, digits=3) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.{digits}g}"


def plasticity_map_sections(preset: str, out, progress=False):
    """Run the map of `preset` into `out/plasticity_map.zarr`; returns the sections (the
    flow's map with its verdicts, descent beside it) and their facts."""
    spec = PRESETS[preset]
    ds = plasticity_map(spec, out / "plasticity_map.zarr", progress=progress)
    rows = plasticity_verdicts(ds)
    summary = claim_summary(rows)
    flow_name = _figure(plot_deficit(ds), out, "fig4b_plasticity_map.png")
    endpoints = plasticity_endpoints(ds)
    n_cells, n_end = int(endpoints.size), int(endpoints.sum())
    grid = (
        f"d = {spec.dim}, a rank-{spec.rank} truth observed on |Ω₂| = {spec.observed} entries "
        f"(the diagonal and random ones, connected); depths {list(spec.depths)}, "
        f"α ∈ {[float(a) for a in spec.alphas]}, inits {list(spec.inits)} (identity: αF_m, "
        f"m = {spec.m:g}), Ω₁ ∈ {list(spec.subsets)} (blocks: Ω₂ on {spec.block_size}×"
        f"{spec.block_size} diagonal blocks; random-q: a fraction q of Ω₂), pretraining to the "
        f"endpoint or stopped early at loss {spec.early_loss:g}·loss(0), seeds "
        f"{list(spec.seeds)}. Store: `plasticity_map.zarr` (`gflow.studies.load_plasticity_map`)."
    )
    claim = [
        r
        for r in rows
        if r["verdict"] in ("holds", "fails", "no endpoint", "cold fails") and r["depth"] >= 3
    ]
    table = markdown_table(
        [
            "L",
            "α",
            "init",
            "Ω₁",
            "pretraining",
            "endpoints",
            "deficit (median, max)",
            "warm / cold error",
            "verdict",
        ],
        [
            [
                r["depth"],
                f"{r['alpha']:g}",
                r["init"],
                r["subset"],
                r["pretraining"],
                f"{r['endpoints']}/{r['seeds']}",
                f"{_g(r['error_deficit'])}, {_g(r['error_deficit_max'])}",
                f"{_g(r['warm_error'])} / {_g(r['cold_error'])}",
                {"holds": "✓ holds", "fails": "✗ fails"}.get(r["verdict"], r["verdict"]),
            ]
            for r in claim
        ],
    )
    depth2 = [r for r in rows if r["verdict"] in ("lost", "kept")]
    cold_fails2 = sum(r["verdict"] == "cold fails" and r["depth"] == 2 for r in rows)
    text = (
        f"Pretrain on Ω₁ ⊂ Ω₂, resume on Ω₂ from the pretrained weights (warm), and compare "
        f"with a fresh start on Ω₂ (cold). The **deficit** is warm/cold relative error on the "
        f"entries outside Ω₂; plasticity counts as kept when it is ≤ {TOLERANCE:g}. {grid}\n\n"
        f"{n_end} of {n_cells} cell-seeds reached endpoints (pretraining converged or stopped at "
        "its loss, warm and cold converged); the others are grey × in the figure and enter no "
        "number.\n\n"
        f"**Claim: depth ≥ 3 protects plasticity when pretraining is coupled** (cells with "
        f"L ≥ 3 whose pretraining starts coupled, docs/theory.md §10): holds in "
        f"{summary['holds']}, fails in {summary['fails']}, no endpoint in "
        f"{summary['no endpoint']}; not judged where the cold start itself does not complete "
        f"the matrix (median relative error ≥ {COLD_LIMIT:g}, `cold fails`): "
        f"{sum(r['verdict'] == 'cold fails' for r in claim)}.\n\n{table}\n\n"
        f"Depth 2 with decoupled pretraining: plasticity lost (deficit > {TOLERANCE:g}) in "
        f"{summary['lost']} cells, kept in {summary['kept']}, cold fails in {cold_fails2}"
        + (
            ": "
            + "; ".join(
                f"α={r['alpha']:g} {r['init']} {r['subset']} {r['pretraining']}: "
                f"{_g(r['error_deficit'])}"
                for r in depth2
            )
            if depth2
            else ""
        )
        + "."
    )
    caption = (
        "Median deficit (warm/cold unobserved error) over seeds, per depth and Ω₁; blue: the "
        "warm start does as well as the cold one, red: it is worse. d: pretraining starts "
        "decoupled. × : no seed reached an endpoint."
    )
    sections = [Section("Plasticity map: the exact flow", text, flow_name, caption)]
    facts = {
        "preset": preset,
        "summary": summary,
        "cells": rows,
        "endpoints": n_end,
        "cell_seeds": n_cells,
        "wall_time_s": float(np.nansum(ds.wall_time_s.values)),
    }
    if spec.sgd_lrs:
        section, facts["descent"] = _descent_section(ds, spec, out)
        sections.append(section)
    return sections, facts


def _descent_section(ds, spec, out):
    lr = max(spec.sgd_lrs)
    name = _figure(plot_deficit(ds, "sgd", lr), out, "fig4c_plasticity_map_sgd.png")
    disagree = descent_disagreements(ds)
    sgd_end = {float(x): int(plasticity_endpoints(ds, "sgd", x).sum()) for x in spec.sgd_lrs}
    rows = [
        [
            r["depth"],
            f"{r['alpha']:g}",
            r["init"],
            r["subset"],
            r["pretraining"],
            f"{r['lr']:g}",
            _g(r["flow_deficit"]),
            _g(r["sgd_deficit"]),
            ", ".join(f"{k:g}: {_g(v)}" for k, v in r["sgd_deficit_smaller_lr"].items()) or "—",
            f"{r['flow_pretrain_loss']:.1e} / {r['sgd_pretrain_loss']:.1e}",
            ", ".join(r["drivers"]),
        ]
        for r in disagree
    ]
    text = (
        "The same cells by full-batch gradient descent (optax SGD) on the mean squared error "
        f"over the observed entries at η ∈ {list(spec.sgd_lrs)} (Kleinman et al. 2024 train at "
        f"η = 0.2), at most {spec.sgd_steps:,} steps a phase, converged at rtol "
        f"{spec.sgd_rtol:g}; a run that did not converge is not an endpoint. Endpoints per η: "
        + ", ".join(
            f"η = {k:g}: {v} of {int(plasticity_endpoints(ds).size)}" for k, v in sgd_end.items()
        )
        + ".\n\n"
        + (
            f"**Where descent and the flow disagree** on whether plasticity is kept "
            f"({len(disagree)} cells), and what the map's numbers point to (`lr`: a smaller η "
            "agrees with the flow; `pretraining length`: descent's pretraining ended at another "
            "loss, or the flow with the other pretraining length gives descent's answer; `α`: "
            "the flow at another α does):\n\n"
            + markdown_table(
                [
                    "L",
                    "α",
                    "init",
                    "Ω₁",
                    "pretraining",
                    "η",
                    "flow deficit",
                    "SGD deficit",
                    "SGD at smaller η",
                    "pretrain loss flow / SGD",
                    "driver",
                ],
                rows,
            )
            if disagree
            else "Descent and the flow agree on every cell where both reached endpoints."
        )
    )
    caption = f"The map of fig. 4b by gradient descent at η = {lr:g} on the mean loss."
    facts = {"disagreements": disagree, "endpoints": sgd_end}
    return Section("Plasticity map: gradient descent beside the flow", text, name, caption), facts
