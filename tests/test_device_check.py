"""The GPU device check, prepared here: its wheel set, and a dry run of the whole check in an
environment built like the bare device image (benchmarks/device_dry_run.sh). Needs the package
registry (pip), as CI has; no GPU (the check's CUDA parts skip)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import device_wheels  # noqa: E402
from packaging.requirements import Requirement  # noqa: E402


def test_the_requirements_walked_leave_torch_and_gradio_to_the_image_and_the_ui():
    names = {r.name for r in device_wheels.project_requirements(device_wheels.LEFT_OUT)}
    assert {"fastapi", "uvicorn", "pydantic", "gguf", "pytest-asyncio"} <= names
    assert not names & {"torch", "gradio"}
    with_ui = {r.name for r in device_wheels.project_requirements({"torch": ""})}
    assert "gradio" in with_ui and "torch" not in with_ui


def test_markers_are_read_for_the_device_python():
    env = device_wheels.marker_env("3.12")
    assert device_wheels.applies(Requirement("a; python_version < '3.13'"), env)
    assert not device_wheels.applies(Requirement("a; python_version < '3.11'"), env)
    assert not device_wheels.applies(Requirement("a; extra == 'full'"), env)
    assert not device_wheels.applies(Requirement("a; sys_platform == 'win32'"), env)
    assert "typing-inspection" not in device_wheels.IMAGE  # pydantic's: carried
    assert {"safetensors", "transformers", "httpx"} <= device_wheels.IMAGE


@pytest.mark.slow
def test_the_device_check_passes_in_an_environment_built_like_the_device_image():
    """A fresh venv with torch and only the image's packages (checked: nothing else), the
    carried wheels installed with --no-index, then gpu_check.sh's CPU part: imports (without
    gradio), the CUDA tests (skipped), the lifecycle and the benchmark."""
    out = subprocess.run(["bash", "benchmarks/device_dry_run.sh"], cwd=ROOT, text=True,
                         capture_output=True, timeout=1500)
    log = out.stdout[-6000:] + out.stderr[-3000:]
    assert out.returncode == 0, log
    assert "packages the image lacks: none" in out.stdout, log
    assert "device_dry_run: passed" in out.stdout, log
    assert "launch, stop, launch again on the same port answers: ok" in out.stdout, log
    assert "several models: the second loads on its first request: ok" in out.stdout, log
