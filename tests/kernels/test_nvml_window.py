"""The probe's NVML window, replayed from a real H200 on CPU.

NVML cannot exist on a CPU machine, so ``telemetry.fake_nvml.FakeNvml`` replays every NVML answer recorded on
an H200 while it ran idle / memcpy / matmul / cooldown phases (tests/telemetry/fixtures/README.md). The
recording is cut so that the window opens in the steady part of one phase: the window then reads the energy
counter, clocks and GPM answers the H200 gave there. The real library is exercised by tests/kernels/test_gpu.py
on the GPU.
"""

from __future__ import annotations

import ast
import copy
import statistics
from pathlib import Path
from typing import Any

import pytest

import servescope.kernels
from servescope.kernels.nvml_window import MIN_WINDOW_S, NvmlWindowReader, clock_reason_names
from servescope.telemetry.fake_nvml import FakeNvml, load_recording

RECORDING = Path(__file__).parent.parent / "telemetry" / "fixtures" / "nvml_recording_h200.json.gz"
TICK_S = 0.05  # the recorded sampler read the GPU every 50 ms
SETTLE_TICKS = 20  # open the window 1 s into the phase, past the ramp
POWER = "nvmlDeviceGetPowerUsage"
ENERGY = "nvmlDeviceGetTotalEnergyConsumption"
H200_UUID = "GPU-332b2738-c7a4-3a25-0f95-15996bd2a499"  # the recorded GPU (recording meta)


@pytest.fixture(scope="module")
def recording() -> dict[str, Any]:
    return load_recording(RECORDING)


def _session_calls(recording: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded TelemetrySession's calls: describe_gpus() ran first, before the second nvmlInit."""
    calls = recording["calls"]
    inits = [i for i, c in enumerate(calls) if c["fn"] == "nvmlInit"]
    return copy.deepcopy(calls[inits[1]:])


def _derived(recording: dict[str, Any], calls: list[dict[str, Any]], what: str) -> dict[str, Any]:
    return {**recording, "calls": calls, "meta": {**recording["meta"], "derived": what}}


def phase_window(recording: dict[str, Any], phase: str, *, no_gpm: bool = False) -> tuple[FakeNvml, dict[str, float]]:
    """A FakeNvml whose answers jump from the GPU's probe to ``phase`` (+ ``SETTLE_TICKS``), and what the
    recording says about the window it will see: between the first two energy-counter reads after the cut.

    DERIVED recording: the recorded calls between the probe and that tick are cut out; each NVML function
    answers in recorded order, so the window gets the answers the H200 gave in that phase. ``no_gpm``
    makes nvmlGpmQueryDeviceSupport answer "not supported", as on pre-Hopper GPUs.
    """
    calls = _session_calls(recording)
    power_at = [i for i, c in enumerate(calls) if c["fn"] == POWER]
    ph = next(p for p in recording["meta"]["phases"] if p["label"] == phase)
    # power read 0 is the session's probe; phase tick k (counted as in meta.phases) is power read k - 1.
    cut = power_at[ph["power_reads_before"] - 1 + SETTLE_TICKS]
    e0, e1 = [i for i in range(cut, len(calls)) if calls[i]["fn"] == ENERGY and "result" in calls[i]][:2]
    ticks = [i for i in power_at if e0 < i < e1]  # ticks between the two energy reads
    expected = {
        "window_s": len(ticks) * TICK_S,
        "energy_j": (calls[e1]["result"] - calls[e0]["result"]) / 1000.0,  # recorded in mJ
        "power_w_mean": statistics.fmean(calls[i]["result"] for i in ticks) / 1000.0,  # recorded in mW
    }
    kept = calls[:power_at[1]] + calls[cut:]
    if no_gpm:
        for c in kept:
            if c["fn"] == "nvmlGpmQueryDeviceSupport" and "result" in c:
                c["result"] = {**c["result"], "isSupportedDevice": 0}
    return FakeNvml(_derived(recording, kept, f"cut to {phase}, no_gpm={no_gpm}")), expected


def scripted_clock(*times_s: float):
    it = iter(times_s)
    return lambda: next(it)


def _assert_no_gpm_sample_leaked(fake: FakeNvml) -> None:
    assert fake.call_counts.get("nvmlGpmSampleAlloc", 0) == fake.call_counts.get("nvmlGpmSampleFree", 0)


@pytest.mark.parametrize("phase", ["memcpy", "matmul"])
def test_a_window_over_the_recorded_h200_reads_power_clock_energy_and_gpm(recording, phase):
    fake, expected = phase_window(recording, phase)
    reader = NvmlWindowReader(lib=fake, clock=scripted_clock(100.0, 100.0 + expected["window_s"]))
    assert reader.available and reader.gpm_available and reader.notes == []
    reader.begin()
    for _ in range(4):  # the probe polls every 0.1 s
        reader.poll()
    tel = reader.end()
    reader.close()

    assert tel.window_s == pytest.approx(expected["window_s"])
    assert 0.4 <= tel.window_s <= 0.7  # the recorded sampler read energy every ~0.5 s
    # energy: the counter's difference, in J (NVML's mJ converted once); power: that over the window
    assert tel.energy_j == pytest.approx(expected["energy_j"])
    assert tel.power_w == pytest.approx(tel.energy_j / tel.window_s)
    assert tel.power_w == pytest.approx(expected["power_w_mean"], rel=0.15)  # agrees with sampled power
    # a busy H200 near its 700 W limit (the window's length is rebuilt from 50 ms ticks, so a few % either way)
    assert 400 < tel.power_w < 1.15 * 700
    assert 200 < tel.sm_clock_mhz <= 1980 and tel.gpu_util_pct > 90
    assert 0 <= tel.gpm_sm_util_pct <= 100 and tel.gpm_sm_util_pct > 90
    if phase == "memcpy":
        assert tel.gpm_dram_bw_pct > 60 and tel.gpm_tensor_pct < 1
    else:
        assert tel.gpm_tensor_pct > 60 and tel.gpm_dram_bw_pct < 40
        assert tel.sm_clock_mhz < 0.9 * 1980 and "sw_power_cap" in tel.clock_event_reasons  # power capped
    assert reader.notes == []  # a healthy window raises no flag
    assert fake.call_counts[ENERGY] == 3  # the probe, then only the window's two bounds (a slow call)
    _assert_no_gpm_sample_leaked(fake)


def test_device_facts_and_gpu_choice_by_cuda_uuid(recording):
    fake, _ = phase_window(recording, "idle")
    with NvmlWindowReader(uuid=H200_UUID.removeprefix("GPU-"), index=5, lib=fake) as reader:  # CUDA drops GPU-
        assert reader.available
        facts = reader.device_facts()
    assert facts == {"power_limit_w": 700.0, "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 3201,
                     "driver": "580.159.04"}
    assert isinstance(facts["sm_clock_max_mhz"], int)  # as NVML returns it, so kernels.json is unchanged
    assert not reader.available  # closed
    _assert_no_gpm_sample_leaked(fake)


def test_an_unknown_uuid_falls_back_to_the_index(recording):
    fake, _ = phase_window(recording, "idle")
    with NvmlWindowReader(uuid="GPU-00000000-0000-0000-0000-000000000000", index=0, lib=fake) as reader:
        assert reader.available and reader.device_facts()["driver"] == "580.159.04"


def test_a_window_that_saw_no_counter_update_is_flagged_not_zero(recording):
    """DERIVED: every energy answer is the first one and every GPM answer the recorded stale one (the H200's
    answer over an interval with no GPM update: 0 % and NaN DRAM bandwidth), as inside a 50 ms window."""
    calls = _session_calls(recording)
    first_energy = next(c["result"] for c in calls if c["fn"] == ENERGY and "result" in c)
    stale_gpm = next(c["result"] for c in calls if c["fn"] == "nvmlGpmMetricsGet")
    dram = next(m for m in stale_gpm["metrics"] if m["metricId"] == 10)  # NVML_GPM_METRIC_DRAM_BW_UTIL
    assert dram["value"] != dram["value"]  # the recorded answer is NaN
    for c in calls:
        if c["fn"] == ENERGY and "result" in c:
            c["result"] = first_energy
        if c["fn"] == "nvmlGpmMetricsGet":
            c["result"] = stale_gpm
    fake = FakeNvml(_derived(recording, calls, "energy and GPM frozen"))
    reader = NvmlWindowReader(lib=fake, clock=scripted_clock(1.0, 1.05))
    for _ in range(2):  # two windows: each problem is noted once
        reader.begin()
        tel = reader.end()
        assert tel.window_s == pytest.approx(0.05) and tel.window_s < MIN_WINDOW_S
        assert tel.power_w is None and tel.energy_j is None  # not 0 W / 0 J
        assert tel.gpm_tensor_pct is None and tel.gpm_dram_bw_pct is None and tel.gpm_sm_util_pct is None
        assert tel.sm_clock_mhz is not None  # the end-of-window poll still reads the clock
        reader._clock = scripted_clock(2.0, 2.05)
    assert len(reader.notes) == 3
    assert any("shorter than 0.15 s" in n for n in reader.notes)
    assert any("energy counter did not advance" in n for n in reader.notes)
    assert any("GPM counters did not update" in n for n in reader.notes)
    reader.close()
    _assert_no_gpm_sample_leaked(fake)


def test_without_gpm_the_activity_columns_stay_empty_with_a_note(recording):
    fake, expected = phase_window(recording, "matmul", no_gpm=True)
    with NvmlWindowReader(lib=fake, clock=scripted_clock(0.0, expected["window_s"])) as reader:
        assert reader.available and not reader.gpm_available
        assert any("GPM" in n and "Hopper" in n for n in reader.notes)
        reader.begin()
        tel = reader.end()
    assert tel.power_w == pytest.approx(expected["energy_j"] / expected["window_s"])
    assert tel.gpm_tensor_pct is None and tel.gpm_dram_bw_pct is None
    assert fake.call_counts.get("nvmlGpmSampleGet", 0) == 0


def test_a_gpm_sample_refused_in_use_costs_only_that_window(recording):
    fake, _ = phase_window(recording, "memcpy")
    reader = NvmlWindowReader(lib=fake, clock=scripted_clock(0.0, 0.5, 1.0, 1.5))
    fake.fail(fn="nvmlGpmSampleGet", error=19, times=1)  # 19: NVML_ERROR_IN_USE, another GPM client
    reader.begin()
    first = reader.end()
    reader.begin()
    second = reader.end()
    assert reader.gpm_available  # IN_USE is transient: GPM stays on for later windows
    reader.close()
    assert first.gpm_dram_bw_pct is None and first.power_w is not None
    assert second.gpm_dram_bw_pct is not None and second.gpm_dram_bw_pct > 60
    assert any("GPM sample refused" in n for n in reader.notes)
    _assert_no_gpm_sample_leaked(fake)


def test_a_failing_clock_read_leaves_the_clock_empty_not_the_window(recording):
    fake, expected = phase_window(recording, "matmul")
    reader = NvmlWindowReader(lib=fake, clock=scripted_clock(0.0, expected["window_s"]))
    fake.fail(fn="nvmlDeviceGetClockInfo", error=15)  # 15: GPU_IS_LOST
    reader.begin()
    reader.poll()
    tel = reader.end()
    reader.close()
    assert tel.sm_clock_mhz is None and tel.power_w is not None and tel.gpm_tensor_pct is not None


def test_no_nvml_gives_timing_only_windows_with_a_clear_note():
    reader = NvmlWindowReader(lib=FakeNvml.unavailable(), clock=scripted_clock(3.0, 4.25))
    assert not reader.available and not reader.gpm_available
    assert reader.notes[0].startswith("NVML unavailable (NVML cannot start")
    assert reader.device_facts() == {}
    reader.begin()
    reader.poll()
    tel = reader.end()
    assert tel == type(tel)(window_s=1.25)  # every reading None, no reason tuple
    reader.close()


def test_no_driver_on_this_machine_is_the_unavailable_path():
    reader = NvmlWindowReader()  # the real pynvml
    if reader.available:
        reader.close()
        pytest.skip("this machine has NVML; the GPU path is tests/kernels/test_gpu.py")
    assert "NVML unavailable" in reader.notes[0]
    reader.begin()
    assert reader.end().power_w is None


def test_end_without_begin_is_a_bug():
    with pytest.raises(RuntimeError):
        NvmlWindowReader(lib=FakeNvml.unavailable()).end()


def test_clock_reason_names():
    assert clock_reason_names(0) == ()
    assert clock_reason_names(0x4 | 0x40) == ("sw_power_cap", "hw_thermal_slowdown")
    assert clock_reason_names(0x4 | 0x1000) == ("sw_power_cap", "0x1000")


def test_kernels_never_import_pynvml():
    """NVML lives behind telemetry/nvml.py (docs/architecture.md): no module of kernels/ imports pynvml."""
    for path in Path(servescope.kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "pynvml" for n in names), f"{path.name} imports pynvml"


def test_a_gpm_sample_failing_otherwise_turns_gpm_off_with_a_note(recording):
    fake, _ = phase_window(recording, "memcpy")
    reader = NvmlWindowReader(lib=fake, clock=scripted_clock(0.0, 0.5, 1.0, 1.5))
    fake.fail(fn="nvmlGpmSampleGet", error=15, times=1)  # 15: GPU_IS_LOST
    reader.begin()
    first = reader.end()
    assert not reader.gpm_available and any("GPM sampling failed" in n for n in reader.notes)
    reader.begin()
    second = reader.end()
    reader.close()
    assert first.gpm_dram_bw_pct is None and second.gpm_dram_bw_pct is None and second.power_w is not None
    _assert_no_gpm_sample_leaked(fake)
