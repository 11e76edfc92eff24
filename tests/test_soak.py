"""A short soak (the one in benchmarks/soak.py, 200 requests): a real `python app.py` server
under mixed load at concurrency 32 ends with no 5xx, nothing running, no extra threads."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import soak


@pytest.mark.slow
def test_soak_200_mixed_requests(tiny_llama_dir: Path) -> None:
    proc, url = soak.start_server(str(tiny_llama_dir), ui=False, extra=[])
    try:
        res = asyncio.run(soak.drive(url, proc.pid, 200, 32, seed=1, progress=False))
    finally:
        code = soak.stop_server(proc)
    summary = soak.report(res, 200, 32)
    assert res.server_errors == 0, summary
    assert not res.problems, summary
    kinds = {k.split(":")[0] for k in res.outcomes}
    assert {"stream", "plain", "cancel", "invalid", "overlong"} <= kinds, summary
    assert res.cancels_sent == res.server_cancelled > 0, summary
    assert res.after["running"] == res.after["waiting"] == res.after["slots_used"] == 0, summary
    assert res.threads_after <= res.threads_before, summary
    assert res.other_growth < 50 * 2**20, summary
    assert code == 0, summary
