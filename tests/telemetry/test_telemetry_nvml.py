"""The NVML wrapper, driven by the fake replaying NVML responses recorded on a real H200."""

from __future__ import annotations

import pytest

from servescope.errors import ConfigError, NvmlUnavailable
from servescope.telemetry.fake_nvml import FakeNvml
from servescope.telemetry.nvml import GpuReadError, Nvml, decode_clock_event_reasons, describe_gpus, parse_gpu_list

from .conftest import derive_recording


def _first(fake: FakeNvml, fn: str, args_prefix: list | None = None):
    for e in fake.responses(fn):
        if args_prefix is None or e["args"][: len(args_prefix)] == args_prefix:
            return e["result"]
    raise AssertionError(f"no recorded {fn}")


def test_no_nvml_on_this_machine_means_no_gpus_and_no_crash():
    # The real pynvml: this CPU machine has no NVIDIA driver.
    assert describe_gpus() == []
    with pytest.raises(NvmlUnavailable, match="no NVIDIA driver or GPU"):
        Nvml()


def test_unavailable_fake_behaves_like_a_machine_without_driver():
    with pytest.raises(NvmlUnavailable):
        Nvml(FakeNvml.unavailable())
    assert describe_gpus(FakeNvml.unavailable()) == []


def test_describe_gpus_reports_the_recorded_h200(fake, recording):
    gpus = describe_gpus(fake)
    assert len(gpus) == len(recording["meta"]["gpus"])
    g = gpus[0]
    assert g == recording["meta"]["gpus"][0]  # what the GPU run itself described
    assert "H200" in g["name"]
    assert g["power_limit_w"] == _first(fake, "nvmlDeviceGetEnforcedPowerLimit") / 1000.0
    assert g["sm_clock_max_mhz"] == float(_first(fake, "nvmlDeviceGetMaxClockInfo", [{"gpu": 0}, 1]))
    assert g["gpm_supported"] is True
    for counter in ("power", "power_instant", "energy", "sm_clock", "utilization", "clock_event_reasons",
                    "gpm_tensor_active_pct", "gpm_dram_bw_pct", "gpm_hmma_active_pct"):
        assert g["counters"][counter] == "ok", counter
    assert fake.initialised == 0  # describe_gpus shut NVML down again


def test_one_read_converts_units_once(fake):
    with Nvml(fake) as nvml:
        gpu = nvml.open_gpus([0], gpm_period_s=0.0)[0]
        row: dict = {}
        gpu.read(row)
        gpu.close()
    powers = [e["result"] for e in fake.responses("nvmlDeviceGetPowerUsage")]
    assert row["power_w"] * 1000.0 in powers  # mW -> W
    energies = [e["result"] for e in fake.responses("nvmlDeviceGetTotalEnergyConsumption")]
    assert round(row["energy_j"] * 1000.0) in energies  # mJ -> J
    assert row["power_limit_w"] == 700.0
    assert row["sm_clock_max_mhz"] == 1980.0
    assert 0 <= row["gpu_util_pct"] <= 100 and 0 <= row["mem_util_pct"] <= 100
    assert row["mem_used_bytes"] > 0
    assert isinstance(row["clock_event_reasons"], str)


def test_gpm_intervals_without_a_counter_update_are_skipped_not_zeroed(fake):
    # On the H200 the GPM counters advance every ~100 ms: the recording (sampled every 50 ms)
    # holds intervals where NVML answered 0 for every metric and NaN for DRAM bandwidth.
    with Nvml(fake) as nvml:
        gpu = nvml.open_gpus([0], gpm_period_s=0.0)[0]
        rows = []
        for _ in range(8):
            row: dict = {}
            gpu.read(row)
            rows.append(row)
        gpu.close()
    with_gpm = [r for r in rows if "gpm_sm_active_pct" in r]
    assert with_gpm, "no GPM values in 8 reads"
    assert gpu.gpm_stale >= 1
    assert len(with_gpm) + gpu.gpm_stale == 8
    for r in with_gpm:
        for col in ("gpm_sm_active_pct", "gpm_tensor_active_pct", "gpm_dram_bw_pct", "gpm_hmma_active_pct"):
            assert 0.0 <= r[col] <= 100.0, col
        assert r["pcie_rx_bytes_s"] > 0  # idle PCIe traffic is never exactly 0 in a real interval


def test_gpu_indices_are_resolved_and_checked(fake):
    with Nvml(fake) as nvml:
        assert nvml.resolve("all") == list(range(nvml.device_count))
        assert nvml.resolve((0,)) == [0]
        with pytest.raises(ConfigError, match="GPU 7 not found"):
            nvml.resolve("7")
    assert parse_gpu_list(" 0, 2 ,3") == [0, 2, 3]
    with pytest.raises(ConfigError):
        parse_gpu_list("zero")
    with pytest.raises(ConfigError):
        parse_gpu_list(" , ")


def test_clock_event_reasons_are_decoded_to_names():
    assert decode_clock_event_reasons(0) == []
    assert decode_clock_event_reasons(0x1) == ["gpu_idle"]
    assert decode_clock_event_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert decode_clock_event_reasons(0x1 | 0x10000) == ["gpu_idle", "bits_0x10000"]


def test_a_gpu_failing_mid_run_raises_gpu_read_error(fake):
    with Nvml(fake) as nvml:
        gpu = nvml.open_gpus([0])[0]
        fake.fail(gpu=0, fn="nvmlDeviceGetPowerUsage", error=15)  # NVML_ERROR_GPU_IS_LOST
        with pytest.raises(GpuReadError, match="GPU 0: reading power failed"):
            gpu.read({})


def test_a_counter_that_stops_being_supported_is_dropped_with_a_note(fake):
    with Nvml(fake) as nvml:
        gpu = nvml.open_gpus([0])[0]
        fake.fail(gpu=0, fn="nvmlDeviceGetTemperature", error=3)  # NVML_ERROR_NOT_SUPPORTED
        row: dict = {}
        gpu.read(row)
        assert "temp_c" not in row and "power_w" in row
        assert gpu.dropped and gpu.dropped[0][0] == "temperature"
        assert gpu.info.counters["temperature"].startswith("stopped answering")
        row2: dict = {}
        gpu.read(row2)  # no longer asked
        assert "temp_c" not in row2 and "power_w" in row2


def test_a_gpu_without_gpm_is_sampled_without_gpm_columns(recording):
    # DERIVED recording: nvmlGpmQueryDeviceSupport answers "not supported" (pre-Hopper).
    fake = FakeNvml(derive_recording(recording, no_gpm=True))
    with Nvml(fake) as nvml:
        gpu = nvml.open_gpus([0])[0]
        assert gpu.info.gpm_supported is False
        assert "Hopper" in gpu.info.counters["gpm"]
        assert gpu.info.counters["pcie_throughput"].startswith("skipped")
        row: dict = {}
        gpu.read(row)
    assert "power_w" in row
    assert not any(k.startswith("gpm_") for k in row)
