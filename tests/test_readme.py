"""The README's Python example and CLI commands run as written."""

import json
import re
from pathlib import Path

import gflow
import gflow.cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _numbers(text):
    return re.findall(r"[-+]?\d+\.?\d*(?:e[-+]?\d+)?", text)


def test_python_example_prints_what_the_readme_says(capsys):
    """Every `print(...)  # comment` of the example prints the numbers of its comment, to the
    digits the comment shows."""
    block = re.search(r"## Python API\n\n```python\n(.*?)```", README, re.S).group(1)
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["result"].status_label == "converged"
    printed = capsys.readouterr().out.splitlines()
    claims = [line.split("#", 1)[1] for line in block.splitlines() if line.startswith("print(")]
    assert len(printed) == len(claims)
    checked = 0
    for out, claim in zip(printed, claims, strict=True):
        if claim.split()[0].rstrip(":") in ("converged", "theory") or "[" in claim:
            expected = _numbers(claim.replace("theory:", ""))
            got = _numbers(out)[: len(expected)]
            assert len(got) == len(expected), (out, claim)
            for g, e in zip(got, expected, strict=True):
                mantissa = e.split("e")[0]
                digits = len(mantissa.replace("-", "").replace(".", "").lstrip("0")) or 1
                assert abs(float(g) - float(e)) <= 0.51 * 10.0 ** (1 - digits) * abs(float(e)), (
                    out,
                    claim,
                )
                checked += 1
    assert checked >= 6


def test_quick_start_commands_are_the_ci_commands():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    test_command = ci.strip().splitlines()[-1]
    assert test_command in README
    assert "gflow reproduce" in README


def test_theory_cli_prints_a_summary_and_json_on_request(capsys):
    assert gflow.cli.main(["theory", "--depth", "3", "--alpha", "1e-2", "--dim", "4"]) == 0
    text = capsys.readouterr().out
    assert "σ_B  2.20581801274e-06   (×3)" in text and "stable rank     1.000000000000" in text


def test_theory_cli(capsys):
    assert (
        gflow.cli.main(["theory", "--depth", "6", "--alpha", "1e-4", "--dim", "4", "--json"]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert abs(report["sigma_b"] / 1.8738026254e-25 - 1) < 1e-9
    assert (
        gflow.cli.main(
            [
                "theory",
                "--problem",
                "block-diagonal",
                "--blocks",
                "2",
                "--block-size",
                "2",
                "--depth",
                "3",
                "--alpha",
                "0.1",
                "--t",
                "1000",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert abs(report["sigma_c"] / 3.858045295e-4 - 1) < 1e-9


def test_sweep_example_config_prints_and_parses(capsys, tmp_path):
    assert gflow.cli.main(["sweep", "--example"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "example.toml"
    path.write_text(text)
    spec = gflow.load_spec(path)
    assert spec.size == 4 * 7 * 4 and spec.axes["m"][-1] == float("inf")
