"""notebooks/quickstart.ipynb, executed in a real Jupyter kernel (nbclient + ipykernel)."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebook_util import cell_text, code_cells, execute

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"


@pytest.fixture
def this_python_kernel(tmp_path, monkeypatch) -> None:
    """A "python3" kernelspec for this interpreter (JUPYTER_PATH wins): see test_notebooks_byo"""
    import json
    import sys

    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (nbserve tests)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))


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
    # launch() returned at once (the model loads in the background), unless it had loaded
    # before the server answered; the next cell's srv.engine waited for it
    assert ("nbserve: loading smollm2 at http://127.0.0.1:" in launched
            or "nbserve: SmolLM2-135M-Instruct at http://127.0.0.1:" in launched)
    assert "OpenAI API base http://127.0.0.1:" in launched
    assert "Paris" in chat
    assert sdk.strip()
    assert stream.strip() and "\ufffd" not in stream
    assert "<iframe src=\"http://127.0.0.1:" in shown and "/v1</code>" in shown
    assert "now serves SmolLM2-135M-Instruct" in updated and "Paris" in updated
    assert "stopped" in stopped


@pytest.mark.slow
@pytest.mark.usefixtures("this_python_kernel")
def test_launch_in_a_notebook_returns_before_the_model_loads(tmp_path, tiny_llama_dir):
    """In a kernel, launch() returns at once while the model loads (here: until the second
    cell opens the gate of a model whose load waits for it; 60 s at most, so that a launch()
    that blocks fails instead of hanging); srv.engine then waits for it."""
    import nbformat

    tests = str(Path(__file__).resolve().parent)
    launch_cell = (f"import sys, threading\nsys.path.insert(0, {tests!r})\n"
                   "import nbserve\nfrom slow_loads import gated\n"
                   "gate = threading.Event()\nthreading.Timer(60, gate.set).start()\n"
                   f"srv = nbserve.launch(gated({str(tiny_llama_dir)!r}, gate), max_batch=2)\n"
                   "print('ready:', srv.ready)")
    chat_cell = ("gate.set()\nprint('answer:', srv.engine.chat('Hi', max_tokens=3) is not None)"
                 "\nprint('ready:', srv.ready)\nsrv.stop()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(launch_cell),
                                         nbformat.v4.new_code_cell(chat_cell)])
    execute(nb, tmp_path, timeout=300, env={"GRADIO_ANALYTICS_ENABLED": "False"})
    launched, chatted = (cell_text(c) for c in code_cells(nb))
    assert "nbserve: loading tiny-llama at http://127.0.0.1:" in launched
    assert "ready: False" in launched
    assert "answer: True" in chatted and "ready: True" in chatted


@pytest.mark.slow
@pytest.mark.usefixtures("this_python_kernel")
def test_rerunning_the_launch_cell_leaves_one_server(tmp_path, tiny_llama_dir):
    import nbformat

    launch_cell = f"import nbserve\nsrv = nbserve.launch({str(tiny_llama_dir)!r}, max_batch=2)"
    check = ("from nbserve.serving.launch import running_servers\n"
             "print('servers:', [s.port for s in running_servers()] == [srv.port])\nsrv.stop()")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(launch_cell),
                                         nbformat.v4.new_code_cell(launch_cell),  # a re-run
                                         nbformat.v4.new_code_cell(check)])
    execute(nb, tmp_path, timeout=300, env={"GRADIO_ANALYTICS_ENABLED": "False"})
    first, again, checked = (cell_text(c) for c in code_cells(nb))
    assert "stopping" not in first
    # of tiny-llama, or of its path while the first one still loads
    assert "nbserve: stopping the previous server of " in again and "tiny-llama" in again
    assert "servers: True" in checked
