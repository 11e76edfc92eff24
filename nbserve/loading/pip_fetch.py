"""`pip download` of one wheel with a progress bar (tqdm.auto: a terminal bar, or a widget in a
notebook), reaching the package index only through pip.

pip >= 24.1 reports its own progress (`--progress-bar raw`: "Progress CURRENT of TOTAL" lines
on stdout); with an older pip, the bar follows the bytes arriving in pip's temporary folder,
which is pointed (TMPDIR) at a folder of ours.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

RAW_PROGRESS_PIP = (24, 1)  # the first pip with --progress-bar raw
_RAW_LINE = re.compile(r"^Progress (\d+) of (\d+)\s*$")
_POLL_S = 0.2


def pip_version() -> tuple[int, ...] | None:
    """The version of the pip that `python -m pip` runs here, or None if it does not run."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                             text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.match(r"pip (\d+)\.(\d+)", out.stdout.strip())
    return (int(match[1]), int(match[2])) if match else None


def download_command(requirement: str, dest: Path) -> list[str]:
    """The `pip download` of one wheel, without its dependencies."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", requirement, "-d", str(dest)]


def pip_download(requirement: str, dest: Path, *, size: int | None, desc: str) -> tuple[int, str]:
    """Run `download_command(requirement, dest)` with a progress bar of `size` bytes (pip's own
    figure wins where it gives one). Returns (pip's exit code, the last lines it printed).
    The bar appears once bytes arrive: a fetch that fails at once shows none."""
    raw = (pip_version() or (0,)) >= RAW_PROGRESS_PIP
    scratch = dest / ".pip-tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    cmd = download_command(requirement, dest) + ["--progress-bar", "raw" if raw else "off"]
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: deque[str] = deque(maxlen=20)
    reported = [0, 0]  # pip's last "Progress CURRENT of TOTAL"
    reader = threading.Thread(target=_read, args=(proc.stdout, lines, reported), daemon=True,
                              name="nbserve-pip-output")
    reader.start()
    bar: Any = None
    try:
        while True:
            done = proc.poll() is not None
            if done:
                reader.join()
            current, total = (reported if raw else (_folder_bytes(scratch), 0))
            if current and bar is None:
                bar = tqdm(total=total or size, unit="B", unit_scale=True, desc=desc)
            if bar is not None:
                if done and proc.returncode == 0:
                    current = bar.total or current  # finished: pip has removed its copy
                bar.update(min(current, bar.total or current) - bar.n)
            if done:
                break
            time.sleep(_POLL_S)
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, a notebook's stop button)
            proc.kill()
            proc.wait()
        if bar is not None:
            bar.close()
    return proc.returncode, "\n".join(lines)


def _read(stream: Any, lines: deque[str], reported: list[int]) -> None:
    for line in stream:
        match = _RAW_LINE.match(line)
        if match:
            reported[:] = [int(match[1]), int(match[2])]
        elif line.strip():
            lines.append(line.rstrip())


def _folder_bytes(folder: Path) -> int:
    """Bytes in the files under `folder` (pip's download in progress), 0 where it cannot tell."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass  # pip moved or removed it meanwhile
    return total
