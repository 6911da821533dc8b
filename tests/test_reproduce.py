"""`gflow reproduce --quick`: the claims table is asserted, not just the files."""

import json

import pytest

import gflow
import gflow.cli


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert gflow.cli.main(["reproduce", "--quick", "--out", str(out), "--quiet"]) == 0
    return out


def test_every_claim_row_is_reproduced(report):
    facts = json.loads((report / "facts.json").read_text())
    assert len(facts["claims"]) == 5
    for row in facts["claims"]:
        assert all(mark is not False for mark in row["marks"]), row
    assert facts["identity"]["identity_max_relerr"] < 1e-8
    assert facts["plasticity"]["sign_flip_at_m_star"]
    assert abs(facts["plasticity"]["l3_minf_warm_x21"] - -0.049488016872) < 1e-8
    assert 0.9 <= facts["descent"]["slopes"]["3"] <= 1.1


def test_report_files(report):
    md = (report / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| L = ")]
    assert len(table) == 5
    assert sum(line.count("✓") for line in table) >= 12
    assert not any("✗" in line for line in table)
    html = (report / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 5
    for name in [
        "fig1_identity_family_rank.png",
        "fig2_random_init_rank.png",
        "fig3_spectra.png",
        "fig4_plasticity.png",
        "fig5_flow_vs_sgd.png",
        "identity_family.csv",
    ]:
        assert (report / name).stat().st_size > 1000, name
    assert (report / "identity_family.zarr").is_dir()


@pytest.mark.parametrize("name", ["01_quickstart", "02_depth_and_rank"])
def test_notebooks_run_small(tmp_path, monkeypatch, name):
    import os
    import runpy
    from pathlib import Path

    monkeypatch.setenv("GFLOW_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("GFLOW_NOTEBOOK_OUT", str(tmp_path))
    root = Path(__file__).resolve().parents[1]
    runpy.run_path(os.fspath(root / "notebooks" / f"{name}.py"), run_name="__main__")
    assert any(p.suffix == ".png" for p in tmp_path.iterdir())
