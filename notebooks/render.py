"""Render the notebooks: run each script at full size and save it as an executed notebook,
with its outputs and figures, under notebooks/rendered/ (what a reader sees on the
repository's web page without running anything).

    pip install -e ".[notebooks]" && python notebooks/render.py [NAME ...]

Each rendered notebook records the SHA-256 of the script it came from
(`metadata.gflow.source_sha256`); the tests check it against the current script, so a
rendered copy can never silently describe code that has changed since.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RENDERED = HERE / "rendered"
NOTEBOOKS = ["01_quickstart", "02_depth_and_rank", "flow_vs_gd", "plasticity", "plasticity_map"]


def source_sha256(name: str) -> str:
    return hashlib.sha256((HERE / f"{name}.py").read_bytes()).hexdigest()


def render(name: str, timeout: int = 3600) -> Path:
    import jupytext
    import nbformat
    from nbclient import NotebookClient

    import gflow

    notebook = jupytext.read(HERE / f"{name}.py")
    with tempfile.TemporaryDirectory() as out:
        env = {"GFLOW_NOTEBOOK_OUT": out, "GFLOW_NOTEBOOK_SMALL": "0"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            start = time.perf_counter()
            resources = {"metadata": {"path": os.fspath(HERE.parent)}}
            client = NotebookClient(
                notebook, timeout=timeout, kernel_name="python3", resources=resources
            )
            client.execute()
            seconds = time.perf_counter() - start
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    notebook.metadata["gflow"] = {
        "source": f"notebooks/{name}.py",
        "source_sha256": source_sha256(name),
        "gflow_version": gflow.__version__,
        "rendered": time.strftime("%Y-%m-%d"),
        "run_seconds": round(seconds, 1),
        "small": False,
    }
    notebook.metadata.pop("jupytext", None)
    RENDERED.mkdir(exist_ok=True)
    path = RENDERED / f"{name}.ipynb"
    nbformat.write(notebook, path)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(NOTEBOOKS)}")
    names = parser.parse_args(argv).names or NOTEBOOKS
    unknown = sorted(set(names) - set(NOTEBOOKS))
    if unknown:
        parser.error(f"no notebook named {', '.join(unknown)}; choose from {', '.join(NOTEBOOKS)}")
    for name in names:
        path = render(name)
        print(f"{path.relative_to(HERE.parent)}  ({path.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
