"""On a machine with an NVIDIA GPU: the real NVML through the same session (skipped elsewhere)."""

from __future__ import annotations

import time

import pytest

from servescope.run import RunDir
from servescope.telemetry.nvml import describe_gpus
from servescope.telemetry.session import TelemetryConfig, TelemetrySession
from servescope.telemetry.timeline import load_gpu_samples, summarize

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpus():
    found = describe_gpus()
    if not found:
        pytest.skip("no NVIDIA GPU / NVML on this machine")
    return found


def test_real_nvml_session_samples_every_gpu(gpus, tmp_path):
    run = RunDir.create(tmp_path / "run", config={"gpu_test": True})
    with TelemetrySession(run, TelemetryConfig(interval_ms=50), require_gpus=True) as tel:
        tel.begin_window("w")
        time.sleep(1.5)
        m = tel.end_window("w")
    cols = load_gpu_samples(run)
    assert set(cols["gpu"]) == {g["index"] for g in gpus}
    assert all(p is None or p > 0 for p in cols["power_w"])
    summary = summarize(run)
    for g in gpus:
        stats = summary["run"]["gpus"][str(g["index"])]
        assert stats["samples"] >= 10
        assert stats["power_w_mean"] > 0
        assert m.energy_j[g["index"]] is None or m.energy_j[g["index"]] > 0
