"""notebooks/scale_out.ipynb in a real kernel: the default model with launch(), then on two Ray
Serve replicas (loopback only), both called with the OpenAI SDK, with the same answer."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "scale_out.ipynb"
KERNEL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
              "RAY_USAGE_STATS_ENABLED": "0", "GRADIO_ANALYTICS_ENABLED": "False",
              "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_scale_out_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)


def _text(cell: Any) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


@pytest.mark.slow
def test_scale_out_runs_in_a_real_kernel(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve", reason="needs: pip install 'nbserve[ray]'")
    from nbclient import NotebookClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**KERNEL_ENV, "NBSERVE_RAY_PORT": str(port)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits them (Ray reads these at import)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out = [_text(c) for c in nb.cells if c.cell_type == "code"]
    launched, _, started, via_ray, streamed, stats, stopped = out
    assert "launch(): The capital of France is Paris." in launched
    assert f"serving at http://127.0.0.1:{port}" in started
    assert "Ray Serve: The capital of France is Paris." in via_ray
    assert "same answer as launch(): True" in via_ray
    assert streamed.strip() and "\ufffd" not in streamed
    assert len([line for line in stats.splitlines() if "finished:" in line]) == 2
    assert "stopped" in stopped
