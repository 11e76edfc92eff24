"""KV memory after distinct prompts (issue 40): `python app.py` (the default model, default KV
budget) of a checkout as a subprocess; its resident memory after a warm-up, after 450 distinct
~110-token prompts (4 at a time, 2 new tokens each) and after 5 s idle, with the cache's blocks.

    python benchmarks/kv_memory_bench.py CHECKOUT PORT
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main() -> None:
    root, port = sys.argv[1], int(sys.argv[2])
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen([sys.executable, f"{root}/app.py", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"

    def ask(i: int) -> None:
        words = " ".join(f"item{(i * 31 + j) % 997}" for j in range(40))
        httpx.post(base + "/v1/completions", json={"model": "", "prompt": f"{i}: {words}",
                   "max_tokens": 2, "temperature": 0}, timeout=120).raise_for_status()

    try:
        for _ in range(360):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        ask(100_000)
        time.sleep(1)
        warm = rss_mib(proc.pid)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(ask, range(450)))
        after = rss_mib(proc.pid)
        time.sleep(5)
        idle = rss_mib(proc.pid)
        st = httpx.get(base + "/stats").json()
        print(f"{root}: RSS warm {warm:.0f} MiB, after 450 prompts {after:.0f} "
              f"(+{after - warm:.0f}), idle 5 s {idle:.0f} (+{idle - warm:.0f}); blocks touched "
              f"{st.get('kv_blocks_touched')}, cached {st.get('kv_blocks_cached')}, committed "
              f"{st.get('kv_committed_bytes', 'n/a')}")
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
