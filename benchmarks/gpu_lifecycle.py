"""The notebook lifecycle on a GPU: memory back after stop() and update(), launch again works.

What vLLM users complain about most in notebooks: stopping a server leaves its GPU memory
taken until the kernel restarts. This runs, in one process, on cuda when there is one (else on
cpu, where the memory checks are skipped and the rest still runs):

1. launch a model nbserve loads itself (a tiny HF checkpoint directory written here), chat once,
   stop, twice: the first cycle's residue is what the CUDA libraries keep for the life of the
   process (cuBLAS a workspace a stream: the engine thread's, the graph capture's, the warm-up
   stream's), reported; after the second, `torch.cuda.memory_allocated()` is back at its value
   after the first (launch/stop cycles never grow);
2. launch a model object the caller holds, chat, `update()` to a second one (the first engine
   retired: its KV cache freed), chat, stop: back to the caller's weights (with the rope tables
   each model derived at first use and keeps for the next engine); once the caller drops them,
   back to where the first part left it;
3. launch two models, load the second on its first request, unload it: the memory is back
   to where the default alone left it;
4. launch, stop, launch again on the same port: the second server answers.

    python benchmarks/gpu_lifecycle.py [--json out.json]

Prints one line per check and a JSON summary; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import httpx  # noqa: E402
import torch  # noqa: E402

import nbserve  # noqa: E402

SERVE = {"ui": False, "max_batch": 4, "max_context": 256, "kv_memory": 64 << 20}


def allocated() -> int | None:
    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def derived_tables(*models: Any) -> int:
    """Bytes of the tables a model derives at first use and keeps for every engine that serves
    it (rope's cos/sin for its context): the model's, not an engine's, so they stay while the
    caller holds the model."""
    return sum(t.numel() * t.element_size() for m in models
               for pair in getattr(m.model, "_rope_cache", {}).values() for t in pair)


def chat(srv: Any) -> str:
    """One completion (the random models have no chat template); its text."""
    r = httpx.post(f"{srv.api_base}/completions", timeout=120, json={
        "model": srv.backend.model_name, "max_tokens": 8, "temperature": 0, "prompt": "hello"})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


class Checks:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def memory(self, name: str, got: int | None, want: int | None) -> None:
        if got is None or want is None:
            self.rows.append({"check": name, "ok": None, "note": "no CUDA: not measured"})
            print(f"  {name}: skipped (no CUDA)")
            return
        ok = got <= want
        self.rows.append({"check": name, "ok": ok, "allocated": got, "baseline": want})
        print(f"  {name}: {'ok' if ok else 'FAILED'} (allocated {got / 2**20:.1f} MiB, "
              f"baseline {want / 2**20:.1f} MiB)")

    def true(self, name: str, ok: bool, note: str = "") -> None:
        self.rows.append({"check": name, "ok": ok, "note": note})
        print(f"  {name}: {'ok' if ok else 'FAILED'} {note}")

    @property
    def failed(self) -> bool:
        return any(row["ok"] is False for row in self.rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from gpu_bench import build_random_model
    from tiny_models import make_tiny_hf_dir

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    checks = Checks()
    print(f"lifecycle on {device} (torch {torch.__version__})")
    start = allocated()

    with tempfile.TemporaryDirectory() as tmp:  # 1. a model nbserve loads and owns
        path = make_tiny_hf_dir(Path(tmp) / "tiny", arch="llama")
        srv = nbserve.launch(str(path), device=device, **SERVE)
        checks.true("owned model answers", bool(chat(srv) is not None))
        srv.stop()
        warm = allocated()
        if warm is not None and start is not None:
            checks.true("the first launch's residue: the CUDA libraries' workspaces", True,
                        f"{(warm - start) / 2**20:.1f} MiB, kept for the process")
        srv = nbserve.launch(str(path), device=device, **SERVE)
        chat(srv)
        engine = weakref.ref(srv.backend)
        srv.stop()
        gc.collect()
        checks.true("after stop(), nothing holds the engine (collected)", engine() is None)
        checks.memory("after stop(), an owned model's memory is back", allocated(), warm)

    first = build_random_model("tiny", device, dtype)  # 2. models the caller holds
    second = build_random_model("tiny", device, dtype, seed=1)
    held = allocated()
    srv = nbserve.launch(first, **SERVE)
    chat(srv)
    with_first = allocated()
    old = srv.backend
    srv.update(second)
    chat(srv)
    for _ in range(300):  # the old engine closes on a thread of its own once it is idle
        if old.cache is None:
            break
        time.sleep(0.1)
    after_update = allocated()  # `old` still refers to the retired engine here
    checks.true("update() swapped the engine", srv.backend is not old and not old.health()
                .get("ready", False))
    old_ref = weakref.ref(old)
    del old
    gc.collect()
    checks.true("after update(), nothing holds the old engine (collected)", old_ref() is None)
    if with_first is not None and after_update is not None and held is not None:
        # the first engine's KV cache went with it: one engine's worth over the weights
        checks.memory("after update(), the old engine's memory is back", after_update,
                      with_first + derived_tables(second))
    srv.stop()
    tables = derived_tables(first, second)
    checks.memory("after stop(), only the caller's weights (and their rope tables) stay",
                  allocated(), None if held is None else held + tables)
    checks.true("the models' rope tables", True, f"{tables / 2**10:.0f} KiB, kept with them")
    del first, second, srv
    checks.memory("after the caller drops its models, everything is back", allocated(), warm)

    with tempfile.TemporaryDirectory() as tmp:  # 3. several models: one unloaded, back
        one = make_tiny_hf_dir(Path(tmp) / "one", arch="llama")
        two = make_tiny_hf_dir(Path(tmp) / "two", arch="qwen2", tie=False, seed=1)
        srv = nbserve.launch({"one": str(one), "two": str(two)}, device=device, **SERVE)
        checks.true("several models: the default answers", chat(srv) is not None)
        with_one = allocated()
        r = httpx.post(f"{srv.api_base}/completions", timeout=120, json={
            "model": "two", "max_tokens": 8, "temperature": 0, "prompt": "hello"})
        checks.true("several models: the second loads on its first request",
                    r.status_code == 200, f"HTTP {r.status_code}")
        loaded_two = allocated()
        if loaded_two is not None and with_one is not None:
            checks.true("the second model's memory", True,
                        f"{(loaded_two - with_one) / 2**20:.1f} MiB")
        checks.true("several models: unload", srv.unload("two"))
        checks.memory("after unload, the second model's memory is back", allocated(), with_one)
        srv.stop()

    port = None  # 4. launch, stop, launch again on the same port
    again = build_random_model("tiny", device, dtype)
    srv = nbserve.launch(again, **SERVE)
    port = srv.port
    srv.stop()
    srv = nbserve.launch(again, port=port, **SERVE)
    checks.true("launch, stop, launch again on the same port answers", bool(chat(srv) is not None),
                f"port {port}")
    srv.stop()

    summary = {"device": device, "torch": torch.__version__, "checks": checks.rows,
               "ok": not checks.failed}
    print("JSON " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())
