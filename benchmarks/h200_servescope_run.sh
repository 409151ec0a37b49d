#!/usr/bin/env bash
# The main job on the H200 machine (issue 6): `servescope run --device cuda` against the embedded engine
# (transformers serve, random Qwen3-30B-A3B-shaped MoE with 8 layers, built on the GPU), telemetry at 50 ms.
# Run through the device tool with `carry: [".whl"]` (wheels from scripts/gpu_wheels.sh); results land in $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SERVESCOPE_CACHE=/tmp/servescope-cache
OUT=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
date -u | tee -a "$OUT/nvidia-smi.txt"
python3 -m servescope run --device cuda --concurrency "${CONCURRENCY:-8,32,128,256}" --input-len 128 --output-len 128 \
  --duration "${DURATION_S:-15}" --interval-ms 50 --out /tmp/run-h200 2>&1 | tee "$OUT/run-log.txt"
rc=${PIPESTATUS[0]}
cp /tmp/run-h200/report.html /tmp/run-h200/report.md /tmp/run-h200/diagnosis.json "$OUT/" 2>/dev/null
tar czf "$OUT/run-h200.tgz" -C /tmp run-h200
exit "$rc"
