"""The benchmark harness runs (cheap benchmarks at --quick sizes) so it cannot rot unnoticed."""

import json

from benchmarks.__main__ import main


def test_quick_benchmarks_write_json_and_plots(tmp_path, capsys):
    assert (
        main(
            [
                "run",
                "--quick",
                "--only",
                "rhs_efficiency",
                "small_alpha_reach",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "rhs_efficiency" in out and "small_alpha_reach" in out
    record = json.loads((tmp_path / "rhs_efficiency.json").read_text())
    assert record["dtype"] == "float64" and record["device"].startswith("cpu")
    assert all(r["fraction_of_matmul_rate"] > 0 for r in record["result"]["rows"])
    reach = json.loads((tmp_path / "small_alpha_reach.json").read_text())["result"]["rows"]
    assert all(r["status"] == "converged" for r in reach)
    assert (tmp_path / "small_alpha_reach.png").stat().st_size > 5000
