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
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
ver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
"$PY" benchmarks/device_wheels.py --python-version "$ver" --dest "$work/whl" \
    --image-list "$work/image.txt" --constraints "$work/image-versions.txt"
"$PY" -m venv "$work/venv"
# shellcheck disable=SC2046 -- one package name a line
"$work/venv/bin/python" -m pip install -q --no-compile -c "$work/image-versions.txt" torch==2.13.0 \
    $(cat "$work/image.txt")
# what the registry's releases of those pulled in beyond the image goes again
"$work/venv/bin/python" benchmarks/device_wheels.py --foreign --remove
NBSERVE_WHEELS="$work/whl" NBSERVE_SITE="$work/site" PYTHON="$work/venv/bin/python" \
    OUT="$work/out" bash benchmarks/gpu_check.sh
echo "device_dry_run: passed"
