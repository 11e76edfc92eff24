"""The caller's OpenMP pool is freed when an engine starts and, in IPython, after each cell.

Each check runs in a fresh Python process, so that no pool left by other tests blurs the
thread counts: with 2 torch threads, libgomp's pool of the main thread is one worker thread.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nbserve.cpu.openmp_pool import release_openmp_pool

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not release_openmp_pool(),
                                reason="torch does not run on libgomp here")

PRELUDE = """
import json, os, threading, time
import torch
def threads():  # OS threads Python did not start: OpenMP workers (and any other native ones)
    time.sleep(0.3)  # a released worker exits on its own schedule
    return len(os.listdir("/proc/self/task")) - threading.active_count()
def pool():  # give this thread an OpenMP pool: one worker with 2 torch threads
    torch.set_num_threads(2)
    torch.randn(4_000_000).exp()
"""


def run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PRELUDE + code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_release_frees_the_calling_threads_pool():
    got = run("""
from nbserve.cpu.openmp_pool import release_openmp_pool
pool(); before = threads()
released = release_openmp_pool(); after = threads()
pool(); again = threads()
print(json.dumps({"released": released, "before": before, "after": after, "again": again}))
""")
    assert got["released"] and got["after"] == got["before"] - 1
    assert got["again"] == got["before"]  # the next parallel op makes a new pool


def test_an_engine_frees_its_callers_pool_when_it_starts(tiny_llama_dir):
    got = run(f"""
import nbserve
loaded = nbserve.load({str(tiny_llama_dir)!r}, verbose=False)
pool(); before = threads()
engine = nbserve.Engine(loaded, max_batch=2, max_context=64, quiet=True)
after = threads()
engine.close()
print(json.dumps({{"before": before, "after": after}}))
""")
    assert got["after"] == got["before"] - 1, got


def test_in_ipython_each_cell_leaves_no_pool_while_an_engine_runs(tiny_llama_dir):
    got = run(f"""
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
out = {{}}
def cell(src):
    result = shell.run_cell(src)
    assert result.success, result.error_in_exec
shell.user_ns.update(pool=pool, threads=threads, out=out)
cell("import nbserve; engine = nbserve.Engine({str(tiny_llama_dir)!r}, max_batch=2, "
     "max_context=64, quiet=True)")
cell("pool(); out['in_cell'] = threads()")
cell("out['next_cell'] = threads()")
cell("engine.close(); pool(); out['in_cell_closed'] = threads()")
cell("out['next_cell_closed'] = threads()")
print(json.dumps(out))
""")
    assert got["next_cell"] == got["in_cell"] - 1, got  # freed after the cell
    assert got["next_cell_closed"] == got["in_cell_closed"], got  # no engine: left alone
