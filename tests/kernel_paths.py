"""What the C-kernel tests share: whether a compiler is there, and the builds to run them on
(the native one, AVX2 and plain C, the last two through `build.quant_kernels(arch)`)."""

from __future__ import annotations

import platform
import shutil

import pytest

X86 = platform.machine().lower() in ("x86_64", "amd64")
NEEDS_COMPILER = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")),
                                    reason="nbserve's C kernels need a C compiler "
                                    "(apt install gcc)")
PATHS = [pytest.param(None, id="native"),
         pytest.param(["-mavx2", "-mfma"], id="avx2",
                      marks=pytest.mark.skipif(not X86, reason="x86 only")),
         pytest.param(["-mno-avx", "-mno-avx2"] if X86 else [], id="plain-c")]
