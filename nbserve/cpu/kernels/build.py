"""Compile nbserve's C kernels for this CPU at first use and load them with ctypes.

Why C and not a torch extension: the kernels are plain C files with no torch headers, so they
build in about a second (a torch C++ extension takes about a minute) and need only a C
compiler. They are built into one library with `-march=native` (the AVX-512 or AVX2 path
where the CPU has one) and `-fopenmp`, which links the OpenMP runtime torch has already loaded
(same soname), so the kernels share torch's thread pool instead of starting a second one. The
library is cached under `$NBSERVE_CACHE/kernels` (default `~/.cache/nbserve/kernels`), keyed
by the sources, the compiler and the CPU's flags.

The library is loaded with ctypes, its functions typed by `abi.declare` from the one header
(`nbserve_kernels.h`). cffi was weighed: its ABI mode cannot read that header as it is
(`_Float16`, the preprocessor) and wants each address cast per call, and a call measured no
faster than ctypes (a one-row float32 matmul: the kernel's own time either way); its API mode
would compile a Python extension, with the slow build above.

`NBSERVE_KERNEL_ISA=avx2` builds the AVX2 path even on a CPU with AVX-512 (`plain` builds the
plain C one), so that one machine can measure what an AVX2-only laptop runs.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from .abi import declare

SOURCES = [Path(__file__).with_name(name)
           for name in ("quant_matmul.c", "gguf_blocks.c", "paged_attention.c", "decode_stack.c")]
HEADERS = [Path(__file__).with_name(name)  # in the cache key, not built
           for name in ("nbserve_kernels.h", "matmul_common.h", "paged_attention_body.h",
                        "gguf_blocks_decode.h", "gguf_blocks_round16.h",
                        "gguf_blocks_round8.h", "gguf_blocks_gemm8.h", "gguf_blocks_gemm32.h")]
# -ffp-contract=off: a * b + c stays two roundings, as in torch's separate ops (no silent FMA)
FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-ffp-contract=off"]
BUILD_TIMEOUT_S = 120
# NBSERVE_KERNEL_ISA: which path the default build takes (each list is tried in turn)
ISA_ARCH: dict[str, list[list[str]]] = {
    "native": [["-march=native"], []],
    "avx2": [["-march=native", "-mno-avx512f"], ["-mavx2", "-mfma", "-mf16c"]],
    "plain": [["-mno-avx", "-mno-avx2"], []],
}
_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None


class KernelBuildError(RuntimeError):
    """The C kernels could not be compiled or loaded; the message says what to do."""


def quant_kernels(arch: list[str] | None = None) -> ctypes.CDLL:
    """The compiled quantized-matmul library (built once per machine, then loaded from cache).

    `arch`: compiler flags to build it with instead of `-march=native` (tests use them to run
    the AVX2 and plain C paths on any x86 machine); such builds are not kept in this process.
    """
    global _loaded
    if arch is None and _loaded is not None:  # the usual case, on every lone step: no lock
        return _loaded
    with _lock:
        if arch is not None:
            return _load(_build(SOURCES, [arch]))
        if _loaded is None:
            _loaded = _load(_build(SOURCES, _isa_arch()))
        return _loaded


def _isa_arch() -> list[list[str]]:
    """The compiler flags to try for the default build, from NBSERVE_KERNEL_ISA."""
    isa = os.environ.get("NBSERVE_KERNEL_ISA", "native").strip().lower() or "native"
    if isa not in ISA_ARCH:
        raise KernelBuildError(f"NBSERVE_KERNEL_ISA={isa!r} is not one of "
                               f"{', '.join(ISA_ARCH)} (native: the best path this CPU has)")
    return ISA_ARCH[isa]


def kernels_available() -> bool:
    """Whether nbserve's C kernels are built (or build now) here; False, with a warning once,
    when they cannot be (no C compiler...), or when NBSERVE_KERNELS=0 turns them off."""
    if os.environ.get("NBSERVE_KERNELS", "1") == "0":
        return False
    try:
        quant_kernels()
        return True
    except KernelBuildError as exc:
        warnings.warn(f"nbserve: float32 models run without nbserve's C kernel (single-stream "
                      f"decoding about 1.7x slower): {exc}", RuntimeWarning, stacklevel=3)
        return False


def _load(path: Path) -> ctypes.CDLL:
    try:
        return declare(ctypes.CDLL(str(path)))  # argument types from nbserve_kernels.h
    except OSError as exc:  # e.g. a cache on a noexec mount
        raise KernelBuildError(f"nbserve's C kernels were built but could not be loaded "
                               f"({exc}); point NBSERVE_CACHE at another folder, or set "
                               "NBSERVE_KERNELS=0 to run without them") from exc


def compiler() -> str:
    """The C compiler to use: `$CC`, else `cc` or `gcc` on the PATH."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not found or not shutil.which(found.split()[0]):
        raise KernelBuildError(
            "nbserve's C kernel (one-stream speed for float32 and weights='blocks') is "
            "compiled at first use, and no C compiler was found (tried $CC, cc, gcc). Install "
            "one (Debian/Ubuntu: `apt install gcc`), or load the model with weights='mixed16' "
            "or weights='dense' (NBSERVE_KERNELS=0 turns the kernel off).")
    return found


def _cache_dir() -> Path:
    env = os.environ.get("NBSERVE_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "nbserve") / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(sources: list[Path], arch_options: list[list[str]]) -> Path:
    """The library built from `sources` with the first of `arch_options` that compiles (some
    compilers or CPUs have no -march=native), from the cache when built before."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=False).stdout
    key = hashlib.sha256(b"".join(s.read_bytes() for s in [*sources, *HEADERS])
                         + version.encode()
                         + _cpu_flags().encode() + repr((FLAGS, arch_options)).encode())
    target = _cache_dir() / f"nbserve-kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    errors = ""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        for arch in arch_options:
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                run = subprocess.run([cc, *FLAGS, *arch, "-o", tmp, *map(str, sources), "-lm"],
                                     capture_output=True, text=True, check=False,
                                     timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                run = subprocess.CompletedProcess([], 1, "", f"timed out after {BUILD_TIMEOUT_S} s")
            if run.returncode == 0:
                os.replace(tmp, target)  # atomic: a concurrent build of the same key is fine
                return target
            Path(tmp).unlink(missing_ok=True)  # a failing compiler may have removed it
            errors = run.stderr.strip()[-2000:]
    except OSError as exc:
        raise KernelBuildError(f"nbserve's C kernels could not be built in {target.parent} "
                               f"({exc}); point NBSERVE_CACHE at a writable folder, or set "
                               "NBSERVE_KERNELS=0 to run without them") from exc
    raise KernelBuildError(f"compiling nbserve's kernels with {cc} failed:\n{errors}\n"
                           "Load the model with weights='mixed16' or weights='dense' instead "
                           "(NBSERVE_KERNELS=0 turns the kernel off).")
