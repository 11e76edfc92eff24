"""notebooks/your_model.ipynb runs top to bottom in a real kernel: train, launch, chat over the
Python API and the OpenAI SDK, train more, update, and the answer changes."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import nbformat
import pytest
from notebook_util import cell_text, code_cells, execute

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "your_model.ipynb"


def test_notebook_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = code_cells(nb)
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_your_model_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A "python3" kernelspec for this interpreter, found first (JUPYTER_PATH has priority), so the
    # kernel runs in this venv whatever kernels the machine has installed.
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (nbserve tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    t0 = time.monotonic()
    execute(nb, NOTEBOOK.parent, timeout=180)
    elapsed = time.monotonic() - t0
    out = "\n".join(cell_text(c) for c in code_cells(nb))
    assert "Traceback" not in out
    assert re.search(r"nbserve: .* at http://127\.0\.0\.1:\d+", out)  # launch's line
    assert "nbserve.StepModel" in out  # the recompute path says how to speed it up
    python_api = re.search(r"Python API: (.*)", out).group(1)
    assert re.search(r"OpenAI SDK: (.*)", out).group(1) == python_api  # same greedy answer
    assert "now serves" in out and "answers changed: True" in out
    after = re.search(r"after: +'(.*)'", out).group(1)
    assert after and after != re.search(r"before: '(.*)'", out).group(1)
    assert elapsed < 120, f"the notebook took {elapsed:.0f} s; keep it under a minute"
