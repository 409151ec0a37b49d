"""The H200 physics run, replayed on CPU: recorded NVML answers -> wrapper -> sampler -> timeline.

benchmarks/gpu_telemetry_physics.py recorded every NVML answer of an idle / memcpy / matmul /
cooldown run on a real H200 (docs/measurements/telemetry-h200-physics.md). Replaying them
here must show the same physics through the whole CPU-side pipeline.
"""

from __future__ import annotations

import pytest

from servescope.load.records import PointRecord
from servescope.run import GPU_SAMPLES, POINTS, TELEMETRY_NOTES, RunDir
from servescope.telemetry.fake_nvml import FakeNvml
from servescope.telemetry.nvml import Nvml
from servescope.telemetry.sampler import GpuSampler, GpuSampleWriter
from servescope.telemetry.timeline import summarize

from .conftest import derive_per_tick
from .test_telemetry_sampler import StepClock

STEP_NS = 50_000_000  # the recorded run sampled every 50 ms
SETTLE_TICKS = 20  # points start 1 s into each phase, as in the recorded run


@pytest.fixture(scope="module")
def replayed(recording, tmp_path_factory):
    rec, n_ticks = derive_per_tick(recording)
    fake = FakeNvml(rec)
    run = RunDir.create(tmp_path_factory.mktemp("replay") / "run", config={"replay": True})
    clock = StepClock(STEP_NS)
    t0 = clock.t
    with Nvml(fake) as nvml:
        gpus = nvml.open_gpus([0], gpm_period_s=0.0, energy_period_s=0.0)
        writer = GpuSampleWriter(run.file(GPU_SAMPLES))
        sampler = GpuSampler(gpus, 50, writer, clock=clock)
        for _ in range(n_ticks):
            sampler.tick()
        writer.close()
        run.write_json(TELEMETRY_NOTES, {"gpus": [g.info.to_dict() for g in gpus], "gaps": []})
    with run.jsonl_writer(POINTS) as pw:
        for i, ph in enumerate(recording["meta"]["phases"]):
            first = ph["power_reads_before"] - 2  # minus describe's and the probe's reads
            last = ph["power_reads_after"] - 2
            pw.write(PointRecord(point=i, label=ph["label"], concurrency=None, request_rate=None,
                                 start_ns=t0 + first * STEP_NS, measure_start_ns=t0 + (first + SETTLE_TICKS) * STEP_NS,
                                 end_ns=t0 + last * STEP_NS, num_requests=0, num_warmup=0))
    summary = summarize(run)
    return {p["label"]: p["gpus"]["0"] for p in summary["points"]}


def test_power_follows_the_load(replayed):
    idle, mem, mm, cool = (replayed[k]["power_w_mean"] for k in ("idle", "memcpy", "matmul", "cooldown"))
    assert mem > idle + 300 and mm > idle + 300
    assert abs(cool - idle) < 30
    assert replayed["matmul"]["power_limit_pct"] > 90


def test_dram_bandwidth_is_high_only_for_the_copy_loop(replayed):
    assert replayed["memcpy"]["gpm_dram_bw_pct_mean"] > 60
    assert replayed["idle"]["gpm_dram_bw_pct_mean"] < 1
    assert replayed["memcpy"]["gpm_dram_bw_pct_mean"] > 2 * replayed["matmul"]["gpm_dram_bw_pct_mean"]


def test_tensor_pipes_are_busy_only_for_the_bf16_matmul(replayed):
    assert replayed["matmul"]["gpm_tensor_active_pct_mean"] > 60
    assert replayed["matmul"]["gpm_hmma_active_pct_mean"] > 60
    assert replayed["matmul"]["gpm_imma_active_pct_mean"] < 1
    assert replayed["memcpy"]["gpm_tensor_active_pct_mean"] < 1
    # ...while "utilisation" reads ~100% for both: the number that hides the difference
    assert replayed["memcpy"]["gpu_util_pct_mean"] > 90 and replayed["matmul"]["gpu_util_pct_mean"] > 90


def test_the_matmul_is_power_capped(replayed):
    mm = replayed["matmul"]
    assert mm["sm_clock_mhz_mean"] < 0.9 * mm["sm_clock_max_mhz"]
    assert mm["clock_event_reasons_fraction"].get("sw_power_cap", 0) > 0.5


def test_energy_counter_agrees_with_sampled_power(replayed):
    for phase in ("memcpy", "matmul"):
        g = replayed[phase]
        assert g["energy_source"] == "counter"
        duration_s = g["samples"] * STEP_NS / 1e9
        assert g["energy_j"] / duration_s == pytest.approx(g["power_w_mean"], rel=0.15)
