"""The machine a benchmark ran on, in one line: its figures hold for that class of CPU only."""

from __future__ import annotations

import os
from pathlib import Path


def cpu_line() -> str:
    """The CPU's model and SIMD flags: figures hold for that class of machine only."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni",
                        "avx512_bf16", "amx_tile") if f in flags]
    return f"cpu: {model}, {os.cpu_count()} cores, {' '.join(simd) or 'no AVX2'}"
