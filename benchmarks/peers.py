"""Servers that serve_bench.py starts as subprocesses: nbserve's own `python app.py` (so that
its resident memory is measured as a user's server, apart from the benchmark's client), and
the peers: llama.cpp's own `llama-server`, `llama_cpp.server` and `transformers serve`.

Each peer runs as a subprocess on a free 127.0.0.1 port, with its output in a log file; it is
ready when GET /v1/models answers 200, and is stopped with terminate, then kill. The model file
it reads is read once before its clock starts (`PeerSpec.warm`), so that every peer's start to
ready is from the page cache: the first peer started used to pay for the disk (this VM hands
cold pages back to the host), the others not. A peer that is
not installed, cannot start or is not ready in time raises `PeerError` with the reason, which
the benchmark reports as "skipped: <reason>".

- `python app.py --model <source>`: nbserve as its users start it (defaults: a paged KV cache
  of 0.25 of the RAM, committed as used, max_batch 64, the chat UI mounted).
- `llama-server` (llama.cpp's own, built by llama_server.py) serves the .gguf file with
  continuous batching over `-np` parallel slots sharing one `-c` context, as llama.cpp users run
  it: `-np 16 -c 32768 -t <threads> --jinja` (its chat template from the file) for up to 16
  concurrent streams, and `-np 64 -c 65536` for more (a second start).
- `llama_cpp.server` (llama-cpp-python) serves the .gguf file itself. It answers one request at
  a time; `--interrupt_requests false` makes it queue the others instead of cutting the running
  stream short, so that every request gets its full answer, as on the other servers.
- `transformers serve` (transformers 5.24) cannot serve a local .gguf: `<dir>:<file>.gguf` loads,
  but the config read out of the GGUF has no `architectures`, and its model manager fails on
  `config.architectures[0]` (TypeError) before it listens. So the GGUF is first loaded with
  `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` (dequantized to float32) and written
  into a temporary directory (tokenizer with `save_pretrained`; the weights copied into a plain
  model first, as `save_pretrained` refuses a GGUF-loaded one), in a subprocess, and that
  directory is served with `--continuous-batching`. A HF directory is served as it is.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PEER_NAMES = ("nbserve_app", "llama_server", "llama_cpp", "transformers")
REPO = Path(__file__).resolve().parents[1]

# Peers must not reach the network: no hub look-ups, no update checks, no telemetry.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}

# save_pretrained refuses a model loaded from a GGUF (its GGUF quantizer "is not serializable"),
# even dequantized: copy its weights into a plain model built from the same config, and save that.
EXPORT_SCRIPT = """\
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
folder, name = os.path.split(os.path.abspath(sys.argv[1]))
out = sys.argv[2]
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                           quantization_config=GgufConfig(dequantize=True))
config = src.config
if getattr(config, "quantization_config", None) is not None:
    del config.quantization_config
config.architectures = [type(src).__name__]
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(src.state_dict())
model.generation_config = src.generation_config
model.save_pretrained(out)
"""


class PeerError(RuntimeError):
    """A peer could not be run; the message is the reason shown after "skipped:"."""


@dataclass
class PeerSpec:
    """How to start one peer: `argv` with "{port}" where the port goes."""

    name: str
    argv: list[str]
    requires: str | None = None  # module that must be importable, checked before starting
    python: str = sys.executable  # the interpreter that must import it (argv[0] for Python peers)
    install_hint: str = ""
    env: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[], None] | None = None  # runs first (e.g. writes the directory served)
    levels: tuple[int, int] = (1, 1 << 30)  # the concurrency levels (lowest, highest) it serves
    warm: tuple[Path, ...] = ()  # files read into the page cache before its clock starts


@dataclass
class Peer:
    """A started peer process and where it answers."""

    name: str
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT/v1
    log: Path
    ready_s: float


# ----------------------------------------------------------------------------- specs


def model_files(source: str) -> tuple[Path | None, Path | None]:
    """(gguf file, HF directory) the peers can serve for an nbserve model source, or Nones."""
    from nbserve.loading import DEFAULT_NAMES

    path = Path(source).expanduser()
    if source.lower() in DEFAULT_NAMES and not path.exists():
        from nbserve.loading.default import default_model_path

        return default_model_path(), None
    if path.is_file() and path.suffix == ".gguf":
        return path, None
    if path.is_dir():
        return None, path
    return None, None


def nbserve_app_spec(source: str) -> PeerSpec:
    """`python app.py --model <source>` with nbserve's defaults, as a user starts it."""
    return PeerSpec("nbserve_app", [sys.executable, str(REPO / "app.py"), "--model", source,
                                    "--port", "{port}"],
                    warm=(Path(source),) if Path(source).is_file() else ())


def llama_server_spec(gguf: Path | None, binary: Path | None, parallel: int = 16,
                      context: int = 32768, threads: int | None = None,
                      levels: tuple[int, int] = (1, 1 << 30)) -> PeerSpec:
    """llama.cpp's `llama-server` on the .gguf file: `parallel` slots sharing `context` tokens,
    `threads` for generation and batches (default: every core, as nbserve uses them), for the
    concurrency `levels` (lowest, highest)."""
    if gguf is None:
        raise PeerError("llama-server needs a .gguf file (default model or --model x.gguf)")
    if binary is None:
        raise PeerError("llama-server is not built: python benchmarks/llama_server.py --build")
    n = str(threads or os.cpu_count() or 1)
    return PeerSpec(
        "llama_server",
        [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "{port}",
         "-np", str(parallel), "-c", str(context), "-t", n, "-tb", n, "--jinja", "--no-webui",
         "-a", gguf.stem], levels=levels, warm=(gguf,))


def llama_cpp_spec(gguf: Path | None, context: int, python: str = sys.executable) -> PeerSpec:
    """`python -m llama_cpp.server` on the .gguf file (`python`: an interpreter that has
    llama-cpp-python, e.g. a separate venv, so its dependencies stay out of nbserve's)."""
    if gguf is None:
        raise PeerError("llama_cpp.server needs a .gguf file (default model or --model x.gguf)")
    return PeerSpec(
        "llama_cpp",
        [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
         "--port", "{port}", "--n_ctx", str(context), "--interrupt_requests", "false"],
        requires="llama_cpp", install_hint='pip install "llama-cpp-python[server]"',
        python=python)


def transformers_spec(gguf: Path | None, hf_dir: Path | None, workdir: Path,
                      timeout: float) -> PeerSpec:
    """`transformers serve --continuous-batching` on a HF directory (exported from a GGUF)."""
    if hf_dir is None and gguf is None:
        raise PeerError("transformers serve needs a .gguf file or a HF directory")
    served = hf_dir or workdir / "transformers-hf"
    prepare = None if hf_dir else (lambda: export_hf_dir(gguf, served, timeout))
    return PeerSpec(
        "transformers",
        [sys.executable, "-m", "transformers.cli.transformers", "serve", str(served),
         "--continuous-batching", "--host", "127.0.0.1", "--port", "{port}"],
        requires="transformers", install_hint='pip install "transformers[serving]"',
        env=OFFLINE_ENV, prepare=prepare)


def peer_specs(names: list[str], source: str, workdir: Path, context: int,
               timeout: float, llama_cpp_python: str = sys.executable,
               llama_server_flavour: str = "native") -> list[tuple[str, PeerSpec | PeerError]]:
    """(name, spec) for each named peer (llama-server twice: `-np 16 -c 32768` for up to 16
    streams, `-np 64 -c 65536` past that), or (name, the PeerError saying why it cannot run)."""
    try:
        gguf, hf_dir = model_files(source)
    except (RuntimeError, OSError, ImportError) as exc:  # e.g. default model not fetchable
        return [(name, PeerError(f"no model file for the peers: {exc}")) for name in names]
    out: list[tuple[str, PeerSpec | PeerError]] = []
    for name in names:
        try:
            if name == "nbserve_app":
                out.append((name, nbserve_app_spec(source)))
            elif name == "llama_server":
                from llama_server import find

                binary = find(llama_server_flavour)
                out.append((name, llama_server_spec(gguf, binary, 16, 32768, levels=(1, 16))))
                out.append((name, llama_server_spec(gguf, binary, 64, 65536,
                                                    levels=(17, 1 << 30))))
            elif name == "llama_cpp":
                out.append((name, llama_cpp_spec(gguf, context, llama_cpp_python)))
            elif name == "transformers":
                out.append((name, transformers_spec(gguf, hf_dir, workdir, timeout)))
            else:
                out.append((name, PeerError(f"unknown peer {name!r} (known: "
                                            f"{', '.join(PEER_NAMES)})")))
        except PeerError as exc:
            out.append((name, exc))
    return out


def export_hf_dir(gguf: Path, out: Path, timeout: float) -> None:
    """Write a HF directory (model + tokenizer) from a .gguf, in a subprocess."""
    if (out / "config.json").is_file():
        return
    log = out.parent / "transformers-export.log"
    with open(log, "wb") as f:
        try:
            rc = subprocess.run([sys.executable, "-c", EXPORT_SCRIPT, str(gguf), str(out)],
                                stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False,
                                env={**os.environ, **OFFLINE_ENV}).returncode
        except subprocess.TimeoutExpired:
            raise PeerError(f"writing a HF directory from the GGUF took over {timeout:.0f} s"
                            ) from None
    if rc != 0:
        raise PeerError(f"writing a HF directory from the GGUF failed: {log_tail(log)}")


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 3, width: int = 400) -> str:
    """The last non-empty lines of a log file, on one line."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = " | ".join(x.strip() for x in text.splitlines() if x.strip())
    kept = " | ".join(tail.split(" | ")[-lines:])
    return kept[-width:] or "(empty log)"


def module_available(python: str, module: str) -> bool:
    """Whether `python` (this interpreter or another one) can import `module`."""
    if python == sys.executable:
        return importlib.util.find_spec(module) is not None
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_peer(spec: PeerSpec, timeout: float, log_dir: Path) -> Peer:
    """Start `spec` on a free port and wait until it is ready; raise PeerError otherwise."""
    if spec.requires and not module_available(spec.python, spec.requires):
        hint = f" ({spec.install_hint})" if spec.install_hint else ""
        raise PeerError(f"{spec.requires} is not installed{hint}")
    for path in spec.warm:
        read_through(path)
    t0 = time.perf_counter()
    if spec.prepare is not None:
        spec.prepare()
    port = free_port()
    argv = [a.replace("{port}", str(port)) for a in spec.argv]
    log = log_dir / f"{spec.name}.log"
    try:
        with open(log, "wb") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **spec.env})
    except OSError as exc:  # FileNotFoundError, PermissionError: the command is not there
        raise PeerError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    peer = Peer(spec.name, proc, f"http://127.0.0.1:{port}/v1", log, 0.0)
    try:
        wait_ready(peer, timeout - (time.perf_counter() - t0))
    except BaseException:
        stop_peer(peer)
        raise
    peer.ready_s = time.perf_counter() - t0
    return peer


def read_through(path: Path, chunk: int = 16 << 20) -> None:
    """Read `path` once, so that its pages are in the page cache."""
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def wait_ready(peer: Peer, timeout: float, interval: float = 0.5) -> None:
    """Poll GET /v1/models until 200; PeerError if the process exits or `timeout` passes."""
    import httpx

    deadline = time.perf_counter() + timeout
    while True:
        rc = peer.proc.poll()
        if rc is not None:
            raise PeerError(f"exited with code {rc} before it was ready: {log_tail(peer.log)}")
        try:
            if httpx.get(f"{peer.base}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.perf_counter() > deadline:
            raise PeerError(f"not ready after {timeout:.0f} s: {log_tail(peer.log)}")
        time.sleep(interval)


def status_kib(pid: int, key: str = "VmRSS") -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_mib(pid: int) -> float | None:
    kib = status_kib(pid)
    return None if kib is None else kib / 1024


def idle_rss(pid: int, samples: int = 5, interval: float = 0.2) -> float | None:
    values = []
    for _ in range(samples):
        v = rss_mib(pid)
        if v is not None:
            values.append(v)
        time.sleep(interval)
    return statistics.median(values) if values else None


class RssPeak:
    """Samples a process's VmRSS every `interval` s in a thread while the block runs: `peak`
    (MiB; 0.0 where /proc cannot tell) and how many `samples` were read."""

    def __init__(self, pid: int, interval: float = 0.2):
        self.pid, self.interval = pid, interval
        self.peak = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        v = rss_mib(self.pid)
        if v is not None:
            self.peak = max(self.peak, v)
            self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def stop_peer(peer: Peer, grace: float = 15.0) -> None:
    """Terminate the peer process, then kill it if it is still there after `grace` seconds."""
    if peer.proc.poll() is not None:
        return
    peer.proc.terminate()
    try:
        peer.proc.wait(grace)
    except subprocess.TimeoutExpired:
        peer.proc.kill()
        peer.proc.wait(10)


def make_workdir() -> Path:
    """A fresh temporary directory for peer logs and exported models."""
    return Path(tempfile.mkdtemp(prefix="serve_bench_peers_"))
