#!/usr/bin/env bash
# Rebuild docs/cutlass-probe/results.{json,md} from CUTLASS itself.
#
# Installs the nvidia-cutlass wheel (only its C++ headers are used) into a throwaway venv OUTSIDE the project, then
# compiles and runs the probe with nvcc for sm_120a / sm_100a / sm_90a. No GPU is needed. Takes 15-30 minutes on two
# CPU cores (about 20 translation units of CUTLASS headers plus 10 complete kernel builds).
#
#   docs/cutlass-probe/build.sh            # default: nvidia-cutlass 4.2.0.0, 2 parallel nvcc
#   JOBS=4 docs/cutlass-probe/build.sh --only '^sm120-nvfp4'   # extra args go to run_probe.py
set -euo pipefail
VENV=${CUTLASS_VENV:-/tmp/cutlass-venv}
VERSION=${CUTLASS_PIP_VERSION:-4.2.0.0}
command -v nvcc >/dev/null || { echo "build.sh: nvcc not on PATH (CUDA 12.8+ needed for sm_120a)" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --no-deps "nvidia-cutlass==$VERSION"
INCLUDE=$("$VENV/bin/python" -c 'import importlib.util, os
spec = importlib.util.find_spec("cutlass_library")
print(os.path.join(spec.submodule_search_locations[0], "source", "include"))')
cd "$(dirname "$0")/../.."
python3 docs/cutlass-probe/run_probe.py --include "$INCLUDE" --jobs "${JOBS:-2}" "$@"
