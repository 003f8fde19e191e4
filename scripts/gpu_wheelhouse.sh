#!/usr/bin/env bash
# Build the wheelhouse that lets scripts/gpu_check.py run every stage on the lent GPU machine:
# Python 3.12, torch (CUDA), transformers, peft, msgpack and psutil installed, but no DeepSpeed, no
# pydantic and no network. It holds DeepSpeed (and what it needs beyond that machine's packages)
# and pydantic (asyncrl.config, read by the learner's real train_step), as wheels for CPython 3.12
# on manylinux x86_64; gpu_check.py --wheelhouse DIR installs them there with `pip --no-index`.
# asyncrl itself travels as the checkout (the device run copies the working tree).
#
#   scripts/gpu_wheelhouse.sh [OUT_DIR]        # default: wheelhouse/ (git-ignored), must stay < 60 MB
#
# DeepSpeed publishes only a source distribution, so its wheel is built here (pure Python,
# py3-none-any: its CUDA ops are JIT-compiled on first use, none is prebuilt); everything else is
# downloaded as binaries for the target interpreter (`--only-binary=:all: --python-version 3.12`).
# Versions are the ones this repository's environment runs.
set -euo pipefail
OUT=${1:-wheelhouse}
PY=${PYTHON:-.venv/bin/python}
LIMIT_MB=60

rm -rf "$OUT"
mkdir -p "$OUT"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT" "deepspeed==0.19.8"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$OUT" \
    "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
    "typing-extensions==4.16.0" "hjson==3.1.0" "ninja==1.13.2" "py-cpuinfo==9.0.0" "einops==0.8.2" \
    "pyyaml==6.0.4"
size_mb=$(du -sm "$OUT" | cut -f1)
ls -1 "$OUT"
echo "wheelhouse $OUT: $(ls "$OUT" | wc -l) wheels, ${size_mb} MB (limit ${LIMIT_MB} MB)"
if [ "$size_mb" -ge "$LIMIT_MB" ]; then
    echo "error: the wheelhouse is over ${LIMIT_MB} MB; the device run carries at most 64 MiB" >&2
    exit 1
fi
