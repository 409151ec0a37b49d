#!/usr/bin/env bash
# Downloads into ./.whl the wheels that `transformers serve` (and servescope's CLI) need on the H200 machine, which has
# no package registry: Python 3.12, manylinux x86_64.
#
# What is missing there (shared/reference/h200-measurements.md, "A real engine on the H200", and the image's package
# list in the device notes): transformers 5.24.0 (the image has 5.17), fastapi < 0.130, starlette < 1.0, uvicorn,
# pydantic + pydantic-core (pydantic pins the exact core), typing-inspection, annotated-types, openai < 2 (openai 3.x
# needs httpx2), jiter, distro, sniffio; and typer 0.29 for servescope's own CLI. Everything else (torch,
# tokenizers 0.23, safetensors, huggingface-hub >= 1.31, anyio, httpx, h11, numpy...) is already in the image.
#
# Method: let pip resolve the set above together for the target platform (--only-binary lets pip resolve for another
# platform), then keep only the wheels of the missing packages, so the image's own torch/numpy/... are never shadowed
# and exactly one version of each package is carried (two versions stop the install there).
#
# Use on the GPU machine (carry ".whl"):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PWD/src
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=.whl
KEEP="transformers fastapi starlette uvicorn pydantic pydantic_core typing_inspection annotated_types openai jiter
distro sniffio typer"
REQS=(
  "transformers==5.24.0"
  "fastapi<0.130"
  "starlette<1.0"
  "uvicorn"
  "pydantic>=2"
  "openai>=1.98,<2"
  "typer>=0.29,<0.30"
  # Pinned to what the image has, so the resolver picks versions compatible with it rather than the newest.
  "huggingface-hub==1.33.0"
  "tokenizers==0.23.2"
  "safetensors==0.8.0"
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$tmp" "${REQS[@]}"

mkdir -p "$OUT"
rm -f "$OUT"/*.whl
for whl in "$tmp"/*.whl; do
  base=$(basename "$whl")
  name=$(echo "${base%%-*}" | tr 'A-Z-' 'a-z_')
  for keep in $KEEP; do
    if [ "$name" = "$keep" ]; then cp "$whl" "$OUT/"; fi
  done
done
echo "wheels in $OUT:" >&2
ls -1 "$OUT" >&2
du -sh "$OUT" >&2
