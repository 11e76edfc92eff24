"""notebooks/quickstart.ipynb, executed in a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebook_util import cell_text, code_cells, execute

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"


def test_quickstart_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(QUICKSTART, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.mark.slow
def test_quickstart_runs_in_a_real_kernel(tmp_path):
    import nbformat

    nb = nbformat.read(QUICKSTART, as_version=4)
    execute(nb, tmp_path, timeout=600,
            env={"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1"})
    launched, chat, sdk, stream, shown, updated, stopped = (cell_text(c, html=True)
                                                             for c in code_cells(nb))
    assert "nbserve: SmolLM2-135M-Instruct at http://127.0.0.1:" in launched
    assert "OpenAI API base http://127.0.0.1:" in launched
    assert "Paris" in chat
    assert sdk.strip()
    assert stream.strip() and "\ufffd" not in stream
    assert "<iframe src=\"http://127.0.0.1:" in shown and "/v1</code>" in shown
    assert "now serves SmolLM2-135M-Instruct" in updated and "Paris" in updated
    assert "stopped" in stopped
