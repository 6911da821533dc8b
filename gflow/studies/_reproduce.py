"""`gflow reproduce`: the paper's claims regenerated as a report a person reads.

Every number in the report is measured in the run that writes it; each claim row is marked ✓
when the measurement agrees with Shin & Yun (ICLR 2026) and ✗ when it does not, or when the
flow it rests on did not converge.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np

from ._digits_section import claim_digits, digits_section
from ._plasticity_map_section import plasticity_map_sections
from ._rank_sections import (
    _random_init_panel,
    coupling_section,
    identity_family_section,
    random_init_section,
    spectra_section,
)
from ._report import _write_report, claims_table, converged, status_note
from ._training_sections import descent_section, plasticity_section

__all__ = [
    "SIZES",
    "_random_init_panel",
    "claims_table",
    "converged",
    "coupling_section",
    "identity_family_section",
    "random_init_section",
    "reproduce",
    "status_note",
]

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
        sensitivity=2,
        sensitivity_eps=1e-14,
        plasticity_map="small",
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
        sensitivity=4,
        sensitivity_eps=1e-14,
        plasticity_map="report",
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
        sensitivity=8,
        sensitivity_eps=1e-14,
        plasticity_map="full",
    ),
}


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
    bar = tqdm(total=10, desc=f"gflow reproduce ({mode})", unit="stage", disable=not progress)
    stage = lambda name: bar.set_description_str(f"gflow reproduce ({mode}): {name}")
    facts = {}
    sections = []
    stage("identity family sweep")
    sec, facts["identity"], ds_identity = identity_family_section(size, out, bar)
    sections.append(sec)
    stage("random inits (diagonal, block-diagonal)")
    sec, facts["random"] = random_init_section(size, out, bar)
    sections.append(sec)
    stage("coupling verdicts")
    sec, facts["coupling"] = coupling_section()
    sections.append(sec)
    bar.update(1)
    sections.append(spectra_section(ds_identity, out))
    stage("plasticity (2×2 curves, d×d warm vs cold)")
    sec, facts["plasticity"] = plasticity_section(size, out, bar)
    sections.append(sec)
    stage("plasticity map (depth × α × init × Ω₁)")
    secs, facts["plasticity_map"] = plasticity_map_sections(size["plasticity_map"], out)
    sections += secs
    bar.update(1)
    stage("SGD and Adam against the flow")
    sec, facts["descent"] = descent_section(size, out, bar)
    sections.append(sec)
    stage("reproducible digits")
    sec, facts["digits"] = digits_section(out, size["sensitivity"], size["sensitivity_eps"])
    sections.append(sec)
    facts["claim_digits"] = claim_digits(size, facts)
    bar.update(1)
    stage("claims and report")
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
