"""The probe's NVML window: power from the energy counter, GPM activity between the window's two samples.

``FakeNvmlLib`` stands in for pynvml (NVML cannot exist on a CPU machine); it scripts the counters an H200
returns and records nothing else. The real library is exercised by tests/kernels/test_gpu.py on the GPU.
"""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from servescope.kernels.nvml_window import NvmlWindowReader, clock_reason_names


class FakeNvmlLib:
    """A pynvml look-alike with scripted counters: energy rises 300 J per second of fake time."""

    NVMLError = pynvml.NVMLError
    NVML_SUCCESS = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    NVML_GPM_METRIC_DRAM_BW_UTIL = pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL
    NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t

    def __init__(self, *, gpm: bool = True) -> None:
        self.energy_mj = 1_000_000
        self.gpm = gpm
        self.freed = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:
        self.energy_mj += 150_000  # each read is "half a second later" at 300 W
        return self.energy_mj

    def nvmlGpmQueryDeviceSupport(self, handle: str):
        if not self.gpm:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return type("Support", (), {"isSupportedDevice": 1})()

    def nvmlGpmSampleAlloc(self):
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, handle, sample):
        return sample

    def nvmlGpmSampleFree(self, sample) -> None:
        self.freed += 1

    def nvmlGpmMetricsGet(self, request):
        values = {self.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 5.9, self.NVML_GPM_METRIC_DRAM_BW_UTIL: 88.0,
                  self.NVML_GPM_METRIC_SM_UTIL: 99.0}
        for i in range(request.numMetrics):
            request.metrics[i].value = ctypes.c_double(values[request.metrics[i].metricId])
            request.metrics[i].nvmlReturn = 0
        return request

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1980

    def nvmlDeviceGetUtilizationRates(self, handle):
        return type("Util", (), {"gpu": 100, "memory": 60})()

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):
        return 0x4 | 0x1000

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        return 1980

    def nvmlSystemGetDriverVersion(self):
        return b"580.159.04"


def test_window_reads_power_from_energy_and_gpm_between_its_ends(monkeypatch):
    lib = FakeNvmlLib()
    reader = NvmlWindowReader(lib=lib)
    assert reader.available and reader.gpm_available
    times = iter([10.0, 11.0])  # begin at t=10 s, end at t=11 s: one second of window
    monkeypatch.setattr("servescope.kernels.nvml_window.time.perf_counter", lambda: next(times))
    reader.begin()
    reader.poll()
    tel = reader.end()
    assert tel.window_s == pytest.approx(1.0)
    assert tel.energy_j == pytest.approx(150.0)  # one counter step between begin and end
    assert tel.power_w == pytest.approx(150.0)
    assert (tel.gpm_tensor_pct, tel.gpm_dram_bw_pct, tel.gpm_sm_util_pct) == (5.9, 88.0, 99.0)
    assert tel.sm_clock_mhz == 1980 and tel.gpu_util_pct == 100
    assert tel.clock_event_reasons == ("sw_power_cap", "0x1000")
    assert lib.freed == 2  # both GPM samples released
    assert reader.device_facts() == {"power_limit_w": 700.0, "sm_clock_max_mhz": 1980, "mem_clock_max_mhz": 1980,
                                     "driver": "580.159.04"}


def test_without_gpm_the_activity_columns_stay_empty_with_a_note():
    reader = NvmlWindowReader(lib=FakeNvmlLib(gpm=False))
    reader.begin()
    tel = reader.end()
    assert tel.power_w is not None and tel.gpm_tensor_pct is None
    assert any("GPM" in note for note in reader.notes)


def test_no_nvml_gives_timing_only_windows():
    class NoDriver(FakeNvmlLib):
        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    reader = NvmlWindowReader(lib=NoDriver())
    assert not reader.available and "NVML unavailable" in reader.notes[0]
    reader.begin()
    tel = reader.end()
    assert tel.power_w is None and tel.window_s >= 0


def test_clock_reason_names():
    assert clock_reason_names(0) == ()
    assert clock_reason_names(0x4 | 0x40) == ("sw_power_cap", "hw_thermal_slowdown")
