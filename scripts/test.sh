#!/usr/bin/env bash
# Installs everything the tests need into ./.venv, then runs ruff and the whole test suite.
# Used as-is by the README and by .ci/run. Safe to re-run: installs are idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: on these machines 2.13.0 is a local CPU wheel; unpinned torch is a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[engine,test]'
# Headless Chromium opens report.html in a test (Debian's package; needs root and the registry).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "warning: could not install chromium; the report browser test will be skipped" >&2
fi
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest "$@"
