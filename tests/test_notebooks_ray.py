"""notebooks/scale_out.ipynb in a real kernel: the default model with launch(), then on two Ray
Serve replicas (loopback only), both called with the OpenAI SDK, with the same answer."""

from __future__ import annotations

import socket
from pathlib import Path

import nbformat
import pytest
from notebook_util import cell_text, code_cells, execute

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "scale_out.ipynb"
KERNEL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
              "RAY_USAGE_STATS_ENABLED": "0", "GRADIO_ANALYTICS_ENABLED": "False",
              "HF_HUB_DISABLE_TELEMETRY": "1"}


def test_scale_out_is_committed_without_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = code_cells(nb)
    assert code and all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.slow
def test_scale_out_runs_in_a_real_kernel(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve", reason="needs: pip install 'nbserve[ray]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nb = nbformat.read(NOTEBOOK, as_version=4)
    execute(nb, tmp_path, timeout=300, env={**KERNEL_ENV, "NBSERVE_RAY_PORT": str(port)})
    out = [cell_text(c) for c in code_cells(nb)]
    launched, _, started, via_ray, streamed, stats, stopped = out
    assert "launch(): The capital of France is Paris." in launched
    assert f"serving at http://127.0.0.1:{port}" in started
    assert "Ray Serve: The capital of France is Paris." in via_ray
    assert "same answer as launch(): True" in via_ray
    assert streamed.strip() and "\ufffd" not in streamed
    assert len([line for line in stats.splitlines() if "finished:" in line]) == 2
    assert "stopped" in stopped
