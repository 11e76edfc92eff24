"""notebooks/quickstart.ipynb, executed in a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"


def _text(cell) -> str:
    """Everything a code cell printed or displayed, as text (HTML included)."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("execute_result", "display_data"):
            data = out["data"]
            parts.append(data.get("text/html", "") + data.get("text/plain", ""))
        elif out["output_type"] == "error":
            parts.append("\n".join(out["traceback"]))
    return "".join(parts)


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
    from nbclient import NotebookClient

    nb = nbformat.read(QUICKSTART, as_version=4)
    env = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    code = [c for c in nb.cells if c.cell_type == "code"]
    launched, chat, sdk, stream, shown, updated, stopped = (_text(c) for c in code)
    assert "nbserve: SmolLM2-135M-Instruct at http://127.0.0.1:" in launched
    assert "OpenAI API base http://127.0.0.1:" in launched
    assert "Paris" in chat
    assert sdk.strip()
    assert stream.strip() and "\ufffd" not in stream
    assert "<iframe src=\"http://127.0.0.1:" in shown and "/v1</code>" in shown
    assert "now serves SmolLM2-135M-Instruct" in updated and "Paris" in updated
    assert "stopped" in stopped
