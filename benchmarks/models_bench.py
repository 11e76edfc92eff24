"""Several models in one server (issue 44): `python app.py --model default=A --model second=B`
as a subprocess; the time of the first request that names the second model (its load, then
a short answer) against the same request once it is loaded, and the server's resident memory
before that load, with both loaded, and after `POST /models/unload`.

    python benchmarks/models_bench.py [--default smollm2] [--second smollm2] [--port 8011]

Prints one line per figure; `benchmarks/README.md` keeps the runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
ASK = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
       "temperature": 0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def timed(base: str, model: str) -> float:
    start = time.perf_counter()
    httpx.post(base + "/v1/chat/completions", json={**ASK, "model": model},
               timeout=600).raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", default="smollm2")
    ap.add_argument("--second", default="smollm2")
    ap.add_argument("--port", type=int, default=8011)
    ap.add_argument("--repeat", type=int, default=3, help="load/unload cycles")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "app.py"), "--no-ui", "--port", str(args.port),
           "--model", f"default={args.default}", "--model", f"second={args.second}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        started = time.perf_counter()
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.perf_counter() - started > 300:
                raise SystemExit("the server did not start")
            time.sleep(0.1)
        print(f"start to ready (default model): {time.perf_counter() - started:.2f} s")
        timed(base, "default")  # warm
        for cycle in range(args.repeat):
            before = rss_mib(proc.pid)
            cold = timed(base, "second")  # loads it
            loaded = rss_mib(proc.pid)
            warm = min(timed(base, "second") for _ in range(3))
            r = httpx.post(base + "/models/unload", json={"model": "second"}, timeout=120)
            r.raise_for_status()
            time.sleep(0.5)
            after = rss_mib(proc.pid)
            print(f"cycle {cycle + 1}: first request to the second model {cold:.2f} s "
                  f"(warm {warm:.3f} s: load about {cold - warm:.2f} s); resident "
                  f"{before:.0f} -> {loaded:.0f} MiB loaded -> {after:.0f} MiB unloaded "
                  f"(gave back {loaded - after:.0f} of {loaded - before:.0f})")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
