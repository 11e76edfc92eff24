#!/usr/bin/env bash
# The device check's dry run, here: proves that the carried wheel set is complete.
#
#     bash benchmarks/device_dry_run.sh     # a few minutes; tests/test_device_check.py runs it
#
# A fresh virtual environment gets what the device image has: torch (this machine's CPU build,
# where the image has its CUDA one) and the image's packages that nbserve's requirements reach
# (named by device_wheels.py, installed from the registry with their own requirements, at the
# versions KINDS.md gives at most); whatever else those pulled in is removed, so
# the environment holds nothing the image lacks. The carried set, made by device_wheels.py for this
# machine's Python (the device's is 3.12; the names are the same), goes in with --no-index
# into a folder on PYTHONPATH, as on the device, and gpu_check.sh runs its CPU part there.
#
# Time: while device_wheels.py downloads the carried set, the venv gets pip, setuptools, torch
# and the image packages that nbserve and the check name directly (the ones the carried set's
# own requirements reach follow); pip runs from this Python (`pip --python`, pip 22.3 or
# later) and byte-compiles nothing at install; Python may write bytecode as it imports
# (PYTHONDONTWRITEBYTECODE unset), so a module is compiled by the first of the check's
# processes that imports it, not by every one; the folder is removed in the background.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work" </dev/null >/dev/null 2>&1 &' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
unset PYTHONDONTWRITEBYTECODE
ver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
pip_in() { "$PY" -m pip --python "$work/venv/bin/python" "$@"; }
# the image's versions at most, and the image packages among the direct requirements
"$PY" - "$work" "$ver" <<'PYEOF'
import sys
from pathlib import Path

sys.path.insert(0, "benchmarks")
from device_wheels import (IMAGE, IMAGE_VERSIONS, LEFT_OUT, applies, marker_env,
                           project_requirements)
from packaging.utils import canonicalize_name

work, env = Path(sys.argv[1]), marker_env(sys.argv[2])
direct = {canonicalize_name(r.name) for r in project_requirements(LEFT_OUT) if applies(r, env)}
(work / "direct.txt").write_text("".join(f"{n}\n" for n in sorted(direct & IMAGE)))
versions = "".join(f"{n}<={v}\n" for n, v in IMAGE_VERSIONS.items())
(work / "early-versions.txt").write_text(versions)  # device_wheels.py writes the same later
PYEOF
# shellcheck disable=SC2046 -- one package name a line
( "$PY" -m venv --without-pip "$work/venv" \
    && pip_in install -q --no-compile -c "$work/early-versions.txt" pip setuptools \
        torch==2.13.0 $(cat "$work/direct.txt") ) > "$work/early.log" 2>&1 &
early=$!
wheels_rc=0
"$PY" benchmarks/device_wheels.py --python-version "$ver" --dest "$work/whl" \
    --image-list "$work/image.txt" --constraints "$work/image-versions.txt" || wheels_rc=$?
wait "$early" || { cat "$work/early.log"; echo "device_dry_run: the early install failed"; exit 1; }
[ "$wheels_rc" -eq 0 ] || { echo "device_dry_run: device_wheels.py failed"; exit "$wheels_rc"; }
# shellcheck disable=SC2046 -- one package name a line
pip_in install -q --no-compile -c "$work/image-versions.txt" torch==2.13.0 $(cat "$work/image.txt")
# what the registry's releases of those pulled in beyond the image goes again
"$work/venv/bin/python" benchmarks/device_wheels.py --foreign --remove
NBSERVE_WHEELS="$work/whl" NBSERVE_SITE="$work/site" PYTHON="$work/venv/bin/python" \
    OUT="$work/out" bash benchmarks/gpu_check.sh
echo "device_dry_run: passed"
