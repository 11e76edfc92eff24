"""Run a notebook in a real Jupyter kernel (nbclient + ipykernel) and read its cells' output."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def code_cells(nb: Any) -> list[Any]:
    return [c for c in nb.cells if c.cell_type == "code"]


def cell_text(cell: Any, html: bool = False) -> str:
    """Everything a code cell printed or displayed, as text (with `html`, HTML too)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append((out.data.get("text/html", "") if html else "")
                         + out.data.get("text/plain", ""))
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
    return "".join(parts)


def execute(nb: Any, cwd: Path, timeout: int, env: dict[str, str] | None = None) -> None:
    """Run `nb` in place in a "python3" kernel started in `cwd`, with `env` set in os.environ
    while it runs (the kernel inherits it; Ray and Gradio read theirs at import)."""
    from nbclient import NotebookClient

    env = env or {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(cwd)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
