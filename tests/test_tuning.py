"""cpu.kernels.tuning: which row kernels a machine takes for weights="blocks" one- and
two-row steps (16-bit inputs or float32), decided once per machine and kept beside the
library, overridable by NBSERVE_ROUND16."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from kernel_paths import NEEDS_COMPILER, PATHS, X86

from nbserve.cpu.kernels import build, tuning
from nbserve.execution.quant import ROUND16, KernelLinear, QuantBlocks

pytestmark = NEEDS_COMPILER
AVX2, PLAIN = PATHS[1].values[0], PATHS[2].values[0]
NATIVE = ["-march=native"]


def _record(lib) -> Path:
    library = Path(lib._name)
    return library.with_name(library.name + ".round16.json")


@pytest.fixture()
def fresh(monkeypatch, tmp_path):
    """Builds into an empty cache, and no choice remembered in this process."""
    monkeypatch.setenv("NBSERVE_CACHE", str(tmp_path))
    monkeypatch.delenv("NBSERVE_ROUND16", raising=False)
    monkeypatch.setattr(tuning, "_choices", {})


@pytest.mark.skipif(not X86, reason="x86 only")
def test_avx2_always_takes_the_16_bit_kernels_and_plain_c_never(fresh):
    avx2, plain = build.quant_kernels(AVX2), build.quant_kernels(PLAIN)
    assert tuning.round16_pays(avx2) and not tuning.round16_pays(plain)
    assert not _record(avx2).exists() and not _record(plain).exists()  # nothing measured


def test_the_environment_decides_without_measuring(fresh, monkeypatch):
    lib = build.quant_kernels(NATIVE)  # built into the empty cache
    monkeypatch.setenv("NBSERVE_ROUND16", "0")
    assert not tuning.round16_pays(lib)
    monkeypatch.setenv("NBSERVE_ROUND16", "1")
    assert tuning.round16_pays(lib) == bool(lib.nbq_round16_max_rows())
    assert not _record(lib).exists()
    monkeypatch.setenv("NBSERVE_ROUND16", "yes")
    with pytest.raises(ValueError, match="NBSERVE_ROUND16='yes': use 1"):
        tuning.round16_pays(lib)


def test_the_row_paths_are_timed(fresh):
    timings = tuning.time_row_paths(build.quant_kernels(NATIVE), threads=1, n=256, k=256, rounds=2)
    assert set(timings) == {"float32", "round16"}
    assert all(0 < t < math.inf for t in timings.values())


def test_avx512_measures_once_and_keeps_the_choice(fresh):
    lib = build.quant_kernels(NATIVE)
    if lib.nbq_simd_width() != 16:
        pytest.skip("needs a CPU with AVX-512")
    choice = tuning.round16_pays(lib)
    kept = json.loads(_record(lib).read_text())
    assert kept["round16"] == choice == (kept["ms"]["round16"] < kept["ms"]["float32"])
    # a later process reads the record instead of measuring again: made to say the other way
    _record(lib).write_text(json.dumps({"round16": not choice, "ms": kept["ms"]}))
    tuning._choices.clear()
    assert tuning.round16_pays(lib) is (not choice)
    blocks = QuantBlocks.from_float(torch.randn(8, 64))
    assert blocks is not None
    assert bool(KernelLinear(blocks, kernels=lib, round16=True).flags & ROUND16) is (not choice)
    assert not KernelLinear(blocks, kernels=lib, round16=False).flags & ROUND16
