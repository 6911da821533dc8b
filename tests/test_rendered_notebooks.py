"""The rendered notebooks (notebooks/rendered/*.ipynb) come from the current scripts, ran to the
end at full size, and show their figures."""

import hashlib
import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("*.py") if p.name != "render.py")


def test_every_notebook_script_is_rendered():
    from notebooks.render import NOTEBOOKS as RENDERED_NAMES

    assert sorted(RENDERED_NAMES) == NAMES
    assert sorted(p.stem for p in (NOTEBOOKS / "rendered").glob("*.ipynb")) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_a_rendered_notebook_is_its_current_script_run_to_the_end(name):
    rendered = json.loads((NOTEBOOKS / "rendered" / f"{name}.ipynb").read_text())
    meta = rendered["metadata"]["gflow"]
    script = (NOTEBOOKS / f"{name}.py").read_bytes()
    assert meta["source_sha256"] == hashlib.sha256(script).hexdigest(), (
        f"notebooks/rendered/{name}.ipynb is stale: run `python notebooks/render.py {name}`"
    )
    assert meta["small"] is False
    code = [c for c in rendered["cells"] if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] is not None for c in code)
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure shown"
    text = "".join(
        "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
        for o in outputs
    )
    assert "np.float64(" not in text  # numbers print as numbers
