"""The report's vocabulary and its writing: sections, figures, honest captions (only converged
flows are endpoints), the claims table, Markdown and HTML."""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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


def converged(status) -> np.ndarray:
    """Which flows reached an endpoint: only these enter a figure as endpoints, or a number."""
    return np.asarray(status) == 0  # Status.CONVERGED


def status_note(status, what="flows", shown="drawn as grey crosses") -> str:
    """'all N flows converged', or how many did not, with their statuses, for a caption."""
    import gflow

    status = np.asarray(status).ravel()
    n, bad = status.size, status[~converged(status)]
    if bad.size == 0:
        return f"all {n} {what} converged"
    labels, counts = np.unique(gflow.status_labels(bad).astype(str), return_counts=True)
    listed = ", ".join(f"{c} {lab}" for lab, c in zip(labels, counts, strict=True))
    return (
        f"{bad.size} of {n} {what} did not converge ({listed}): {shown}, they are not "
        "endpoints and enter no number here"
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _claim_rows(facts) -> list[dict]:
    """The paper's claims, one row per setting: what was measured, and what the paper expects
    (coupled?, low rank?, loses plasticity?; None: not claimed)."""
    couple = {(c["L"], c["init"], c["Ω"]): c["verdict"] for c in facts["coupling"]}
    plast = facts["plasticity"]
    reached = lambda r: all(r[f"{p}_status"] == "converged" for p in ("pretrain", "warm", "cold"))
    l2row = next((r for r in plast["rows"] if r["L"] == 2 and reached(r)), None)
    l3row = next((r for r in plast["rows"] if r["L"] == 3 and reached(r)), None)
    diag = facts["random"]["diagonal"]
    deep = facts["identity"]["srank_minus_1_by_depth"]
    below = lambda v, bound: None if v is None else v < bound
    show = lambda v, spec: "not converged" if v is None else format(v, spec)
    x21 = plast["l3_minf_warm_x21"]
    x21 = None if x21 is None or math.isnan(x21) else x21
    connected = plast["l2_connected_small_alpha_srank"]
    dig = facts.get("claim_digits", {})
    digits = lambda *keys: " / ".join(
        "no endpoint" if dig.get(k) is None else str(dig[k]) for k in keys
    )
    rows = [
        {
            "row": "L = 2, general init, disconnected Ω",
            "coupled": couple[(2, "Gaussian", "diagonal")],
            "expect_coupled": False,
            "rank": f"stable rank {show(diag[2], '.3f')}",
            "low_rank": below(diag[2], 1.01),
            "plasticity": f"warm {l2row['warm_stable_rank']:.3f} vs cold "
            f"{l2row['cold_stable_rank']:.3f}"
            if l2row
            else "not converged",
            "loses": l2row["warm_stable_rank"] > l2row["cold_stable_rank"] + 1e-3
            if l2row
            else None,
            "expect": (False, False, True),
            "digits": f"rank {digits('gaussian_L2')} · warm / cold {digits('warm_L2', 'cold_L2')}",
        },
        {
            "row": "L = 2, connected Ω",
            "coupled": couple[(2, "Gaussian", "connected")],
            "expect_coupled": True,
            "rank": f"cold start on connected Ω₂ from α = 1e-3: {show(connected, '.5f')}",
            "low_rank": below(connected, 1.01),
            "plasticity": "—",
            "loses": None,
            "expect": (True, True, None),
            "digits": f"rank {digits('connected_L2')}",
        },
        {
            "row": "L = 3, general init (m = 4 / Gaussian)",
            "coupled": couple[(3, "identity, m = 4", "diagonal")],
            "expect_coupled": True,
            "rank": f"stable rank − 1 = {show(deep[3], '.1e')}",
            "low_rank": below(deep[3], 1e-3),
            "plasticity": (
                f"warm {l3row['warm_stable_rank']:.4f} vs cold {l3row['cold_stable_rank']:.4f}"
            )
            if l3row
            else "—",
            "loses": (l3row["warm_stable_rank"] > 1.01) if l3row else None,
            "expect": (True, True, False),
            "digits": f"rank {digits('identity_L3')} · warm / cold {digits('warm_L3', 'cold_L3')}",
        },
        {
            "row": "L = 3, diagonal init (m = ∞)",
            "coupled": couple[(3, "identity, m = ∞ (diagonal init)", "diagonal")],
            "expect_coupled": False,
            "rank": "X = w·B, rank n",
            "low_rank": False,
            "plasticity": f"2×2 warm X₂₁ = {show(x21, '+.6f')}",
            "loses": None if x21 is None else x21 < 0,
            "expect": (False, False, True),
            "digits": f"X₂₁ {digits('x21_L3')}",
        },
        {
            "row": "L = 5, general init",
            "coupled": couple[(5, "Gaussian", "diagonal")],
            "expect_coupled": True,
            "rank": f"stable rank − 1 = {show(deep[5], '.1e')}",
            "low_rank": below(deep[5], 1e-3),
            "plasticity": "—",
            "loses": None,
            "expect": (True, True, None),
            "digits": f"rank {digits('identity_L5')}",
        },
    ]
    return rows


def claims_table(facts) -> tuple[str, list[dict]]:
    """The claims as a Markdown table with ✓/✗ marks, and the marks of each row."""
    cells, verdicts = [], []
    for r in _claim_rows(facts):
        is_coupled = r["coupled"] == "coupled"
        # A measurement that is not a converged endpoint reproduces nothing: ✗, "no endpoint".
        marks = [
            is_coupled == r["expect"][0],
            r["low_rank"] is not None and r["low_rank"] == r["expect"][1],
            None
            if r["expect"][2] is None
            else r["loses"] is not None and r["loses"] == r["expect"][2],
        ]
        r["marks"] = marks
        cell = lambda ok, text: text if ok is None else f"{'✓' if ok else '✗'} {text}"
        verdict = lambda v, yes, no: "no endpoint: " if v is None else (yes if v else no)
        rank = verdict(r["low_rank"], "low: ", "high: ") + r["rank"]
        plasticity = "—"
        if r["expect"][2] is not None:
            plasticity = cell(marks[2], verdict(r["loses"], "yes: ", "no: ") + r["plasticity"])
        row = [r["row"], cell(marks[0], r["coupled"]), cell(marks[1], rank), plasticity]
        cells.append(row + [r["digits"] if "claim_digits" in facts else "—"])
        verdicts.append({"row": r["row"], "marks": marks})
    header = ["claim row", "coupled?", "limit rank", "loss of plasticity?", "reproducible digits"]
    return markdown_table(header, cells), verdicts


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A pipe table: a header row, a rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _write_report(out: Path, sections, table, mode, elapsed):
    import gflow

    head = (
        "# gflow reproduce: depth promotes low-rankness\n\n"
        f"Generated by gflow {gflow.__version__} with `{_command(mode)}` in "
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


def _command(mode: str) -> str:
    """The command that regenerates a report of this mode."""
    return "gflow reproduce" if mode == "default" else f"gflow reproduce --{mode}"


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
