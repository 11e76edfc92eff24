"""The wheels a lent GPU machine lacks for `benchmarks/gpu_check.sh`, downloaded here.

The device image (Python 3.12, its own CUDA torch) reaches no package registry. It holds most of
what nbserve needs (the device tool's KINDS.md lists its packages; `IMAGE` below is that list),
not fastapi, starlette, uvicorn, pydantic, gguf or pytest-asyncio. This script walks the
requirements of nbserve (its pyproject, less torch and gradio: the check uses the image's torch
and runs without the UI) and of the check's tests, keeps every name the image does not hold,
and downloads each with `pip download --no-deps` for CPython 3.12 manylinux x86-64 into a
git-ignored folder, reading each wheel's own Requires-Dist (markers evaluated for that target)
to find the next names. It prints the set and its size (a device call carries 64 MiB at most).

    python benchmarks/device_wheels.py                    # into .whl/, for the device
    python benchmarks/device_wheels.py --python-version 3.11 --dest /tmp/w --image-list /tmp/i
        # the same names for this machine's Python (the dry run, benchmarks/device_dry_run.sh);
        # --image-list writes the image's names among the requirements, one per line

On the device: `pip install --no-index --no-deps --target /tmp/site .whl/*.whl` (gpu_check.sh).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# The device image's Python packages (KINDS.md, "Python packages already there", read there
# on 2026-11-17): a name here is not carried.
IMAGE = frozenset(canonicalize_name(n) for n in """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt
xarray xxhash yarl zipp
""".split())

# The versions KINDS.md gives for some of them (its pip list): the dry run installs none newer,
# so that a later release's new requirements (huggingface-hub 2 needs httpx2) do not count.
IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2",
                  "safetensors": "0.8.0", "tokenizers": "0.23.2", "transformers": "5.17.0"}

LEFT_OUT = {"torch": "the image's own CUDA build is used, never replaced",
            "gradio": "the check serves without the UI (ui=False); --with-ui carries it"}
# What the check itself imports beyond nbserve's requirements (tests/conftest.py, test_cuda.py,
# the lifecycle script): transformers, httpx and pytest come with the image.
CHECK_NEEDS = ("pytest", "pytest-asyncio", "transformers", "httpx", "hypothesis")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
LIMIT_MIB = 64


def project_requirements(left_out: dict[str, str]) -> list[Requirement]:
    """nbserve's runtime requirements (pyproject.toml) and the check's, less `left_out`."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in [*meta["dependencies"], *CHECK_NEEDS]]
    return [r for r in reqs if canonicalize_name(r.name) not in left_out]


def marker_env(python_version: str) -> dict[str, str]:
    return {"python_version": python_version, "python_full_version": f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": "x86_64", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "extra": ""}


def applies(req: Requirement, env: dict[str, str]) -> bool:
    """Whether a requirement holds on the target (no extras asked for)."""
    return req.marker is None or Marker(str(req.marker)).evaluate(env)


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """A wheel's Requires-Dist lines."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [Requirement(line.split(":", 1)[1].strip()) for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def wheel_name(wheel: Path) -> str:
    return canonicalize_name(wheel.name.split("-")[0])


def download(req: Requirement, dest: Path, python_version: str) -> Path:
    """One wheel for the target, `--no-deps`; returns its path."""
    before = set(dest.glob("*.whl"))
    spec = f"{req.name}{req.specifier}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", str(dest), spec]
    for platform in PLATFORMS:
        cmd[cmd.index("-d"):cmd.index("-d")] = ["--platform", platform]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    found = new or {w for w in before if wheel_name(w) == canonicalize_name(req.name)}
    if not found:
        raise RuntimeError(f"pip downloaded no wheel for {spec}")
    return sorted(found)[0]


def resolve(dest: Path, python_version: str, left_out: dict[str, str]
            ) -> tuple[list[Path], list[str]]:
    """Download every requirement the image lacks; (the wheels, the image's names met)."""
    env = marker_env(python_version)
    dest.mkdir(parents=True, exist_ok=True)
    for stale in dest.glob("*.whl"):  # one version of each: two would stop the install
        stale.unlink()
    todo = [r for r in project_requirements(left_out) if applies(r, env)]
    carried: dict[str, Path] = {}
    from_image: set[str] = set()
    while todo:
        req = todo.pop(0)
        name = canonicalize_name(req.name)
        if name in left_out or name in carried:
            continue
        if name in IMAGE:
            from_image.add(name)
            continue
        wheel = download(req, dest, python_version)
        carried[name] = wheel
        todo += [r for r in wheel_requirements(wheel) if applies(r, env)]
    return sorted(carried.values()), sorted(from_image)


def remove_foreign(names: list[str]) -> None:
    """Uninstall packages the image lacks from this environment (the dry run's: a newer
    release of an image package may have pulled them in)."""
    if names:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *names],
                       check=True)


def foreign_packages() -> list[str]:
    """Installed distributions of this interpreter that the device image does not hold (the
    dry run's environment must have none: whatever it needs is then in the image or carried)."""
    from importlib.metadata import distributions

    names = {canonicalize_name(d.metadata["Name"]) for d in distributions()}
    return sorted(n for n in names if n not in IMAGE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl")
    ap.add_argument("--python-version", default="3.12", help="the target's (default: the image's)")
    ap.add_argument("--image-list", type=Path, default=None,
                    help="write the image's packages among the requirements here")
    ap.add_argument("--foreign", action="store_true",
                    help="only list the packages of this environment the image lacks (exit 1 "
                    "if any): the dry run's check that its environment is the image's")
    ap.add_argument("--remove", action="store_true",
                    help="with --foreign: uninstall them (then list again)")
    ap.add_argument("--constraints", type=Path, default=None,
                    help="write pip constraints here: none newer than the image's versions")
    ap.add_argument("--with-ui", action="store_true",
                    help="carry gradio and its requirements too (measure whether they fit)")
    args = ap.parse_args(argv)
    if args.foreign:
        foreign = foreign_packages()
        if foreign and args.remove:
            print("removing what the image lacks:", " ".join(foreign))
            remove_foreign(foreign)
            foreign = foreign_packages()
        print("packages the image lacks:", " ".join(foreign) or "none")
        return 1 if foreign else 0
    if args.constraints is not None:
        # no newer than the image's (this machine's Python may not have that very release)
        args.constraints.write_text("".join(f"{n}<={v}\n" for n, v in IMAGE_VERSIONS.items()))
    if not re.fullmatch(r"3\.\d+", args.python_version):
        ap.error("--python-version looks like 3.12")
    left_out = {k: v for k, v in LEFT_OUT.items() if not (args.with_ui and k == "gradio")}
    wheels, image = resolve(args.dest, args.python_version, left_out)
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:7.2f} MiB  {w.name}")
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB (a device call carries {LIMIT_MIB} MiB "
          f"with the working tree) in {args.dest}")
    print("from the image:", " ".join(image))
    print("left out:", "; ".join(f"{k} ({v})" for k, v in left_out.items()))
    if args.image_list is not None:
        args.image_list.write_text("".join(f"{n}\n" for n in image))
    return 0 if total < LIMIT_MIB * 2**20 else 1


if __name__ == "__main__":
    sys.exit(main())
