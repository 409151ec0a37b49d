"""A minimal NVML reader for the kernel probe: power, clocks and GPM activity over one steady loop.

Why a reader of its own: the probe needs exactly one thing from NVML, a window (begin ... end) around a
steady kernel loop, read from the same thread that drives the loop. ``servescope.telemetry`` (owned by the
telemetry module) is the general sampler; this stays small so the probe works without it. It is the only
place in ``kernels/`` that imports pynvml.

What it reads and why:
- power as energy-counter difference / window length: NVML's ``nvmlDeviceGetPowerUsage`` is itself a ~1 s
  moving average on recent GPUs, so over a 1 s window the counter difference is the honest mean;
- SM clock, utilisation and (averaged) power polled a few times during the window and averaged;
- GPM (Hopper and later) tensor-pipe, DRAM-bandwidth and SM activity between two GPM samples taken at the
  window's ends (NVML computes the average over that interval itself);
- the clock-event (throttle) reasons seen during the window, by name.
Anything the GPU does not offer stays None; the reason is logged once, never raised: the timing is still
worth having without it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from servescope.kernels.results import WindowTelemetry

log = logging.getLogger(__name__)

# Clock-event reason bits, from nvml.h (nvmlClocksEventReason*; the older names are nvmlClocksThrottleReason*).
_CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def clock_reason_names(mask: int) -> tuple[str, ...]:
    """Names of the set bits of an NVML clock-event reason mask (unknown bits as hex)."""
    names = [name for bit, name in _CLOCK_REASONS.items() if mask & bit]
    rest = mask & ~sum(_CLOCK_REASONS)
    if rest:
        names.append(hex(rest))
    return tuple(names)


@dataclass
class _Window:
    t0: float
    energy0_mj: int | None
    gpm_sample: Any = None
    clocks_mhz: list[float] = field(default_factory=list)
    utils_pct: list[float] = field(default_factory=list)
    reasons_mask: int = 0


class NvmlWindowReader:
    """Reads one GPU's power, clock and GPM activity over windows. ``available`` is False without NVML.

    ``lib`` is a pynvml-compatible object; None means the real ``pynvml`` (tests pass a fake).
    """

    def __init__(self, *, uuid: str | None = None, index: int = 0, lib: Any = None) -> None:
        self.available = False
        self.gpm_available = False
        self.notes: list[str] = []
        self._nvml: Any = None
        self._handle: Any = None
        self._window: _Window | None = None
        if lib is not None:
            pynvml = lib
        else:
            try:
                import pynvml  # the one NVML import in kernels/
            except ImportError as err:
                self.notes.append(f"nvidia-ml-py not installed ({err}); power, clocks and GPM columns are empty")
                log.warning(self.notes[-1])
                return
        try:
            pynvml.nvmlInit()  # a missing libnvidia-ml is NVMLError_LibraryNotFound
        except pynvml.NVMLError as err:
            self.notes.append(f"NVML unavailable ({err}); power, clocks and GPM columns are empty")
            log.warning(self.notes[-1])
            return
        self._nvml = pynvml
        try:
            self._handle = self._find_handle(uuid, index)
        except pynvml.NVMLError as err:
            self.notes.append(f"NVML could not open the GPU ({err}); power, clocks and GPM columns are empty")
            log.warning(self.notes[-1])
            return
        self.available = True
        try:
            support = pynvml.nvmlGpmQueryDeviceSupport(self._handle)
            self.gpm_available = bool(support.isSupportedDevice)
        except (pynvml.NVMLError, AttributeError) as err:
            self.notes.append(f"GPM metrics unavailable ({err}); tensor and DRAM activity columns are empty")
        if not self.gpm_available and not any("GPM" in n for n in self.notes):
            self.notes.append("GPM metrics not supported on this GPU (Hopper or newer needed)")

    def _find_handle(self, uuid: str | None, index: int) -> Any:
        nv = self._nvml
        if uuid:
            count = nv.nvmlDeviceGetCount()
            for i in range(count):
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                got = nv.nvmlDeviceGetUUID(handle)
                got = got.decode() if isinstance(got, bytes) else got
                if got.replace("GPU-", "") == uuid.replace("GPU-", ""):
                    return handle
        return nv.nvmlDeviceGetHandleByIndex(index)

    def device_facts(self) -> dict[str, Any]:
        """Power limit, max SM clock and driver version, for the results file's GPU section."""
        if not self.available:
            return {}
        nv, h = self._nvml, self._handle
        facts: dict[str, Any] = {}
        for key, call in (
            ("power_limit_w", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
            ("sm_clock_max_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
            ("mem_clock_max_mhz", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM)),
            ("driver", lambda: nv.nvmlSystemGetDriverVersion()),
        ):
            try:
                value = call()
                facts[key] = value.decode() if isinstance(value, bytes) else value
            except nv.NVMLError as err:
                log.info("NVML %s not available: %s", key, err)
        return facts

    def _energy_mj(self) -> int | None:
        try:
            return int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle))
        except self._nvml.NVMLError:
            return None

    def begin(self) -> None:
        """Start a window: snapshot the energy counter and a GPM sample."""
        if not self.available:
            self._window = _Window(t0=time.perf_counter(), energy0_mj=None)
            return
        window = _Window(t0=time.perf_counter(), energy0_mj=self._energy_mj())
        if self.gpm_available:
            try:
                window.gpm_sample = self._nvml.nvmlGpmSampleAlloc()
                self._nvml.nvmlGpmSampleGet(self._handle, window.gpm_sample)
            except self._nvml.NVMLError as err:
                self.gpm_available = False
                self.notes.append(f"GPM sampling failed ({err}); tensor and DRAM activity columns are empty")
                window.gpm_sample = None
        self._window = window

    def poll(self) -> None:
        """Take one reading of SM clock, utilisation and clock-event reasons (call a few times per window)."""
        if not self.available or self._window is None:
            return
        nv, h, w = self._nvml, self._handle, self._window
        try:
            w.clocks_mhz.append(float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)))
            w.utils_pct.append(float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
        except nv.NVMLError as err:
            log.debug("NVML poll failed: %s", err)
        try:
            w.reasons_mask |= int(nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        except (nv.NVMLError, AttributeError):
            try:
                w.reasons_mask |= int(nv.nvmlDeviceGetCurrentClocksThrottleReasons(h))
            except (nv.NVMLError, AttributeError) as err:
                log.debug("NVML clock reasons unavailable: %s", err)

    def end(self) -> WindowTelemetry:
        """Close the window and return its readings."""
        w = self._window
        if w is None:
            raise RuntimeError("NvmlWindowReader.end() without begin()")
        self._window = None
        elapsed_s = time.perf_counter() - w.t0
        if not self.available:
            return WindowTelemetry(window_s=elapsed_s)
        self.poll()
        energy1 = self._energy_mj()
        power_w = energy_j = None
        if w.energy0_mj is not None and energy1 is not None and elapsed_s > 0:
            energy_j = (energy1 - w.energy0_mj) / 1000.0
            power_w = energy_j / elapsed_s
        tensor = dram = sm = None
        if w.gpm_sample is not None:
            tensor, dram, sm = self._gpm_end(w.gpm_sample)
        return WindowTelemetry(
            window_s=elapsed_s,
            power_w=power_w,
            energy_j=energy_j,
            sm_clock_mhz=sum(w.clocks_mhz) / len(w.clocks_mhz) if w.clocks_mhz else None,
            gpu_util_pct=sum(w.utils_pct) / len(w.utils_pct) if w.utils_pct else None,
            gpm_tensor_pct=tensor,
            gpm_dram_bw_pct=dram,
            gpm_sm_util_pct=sm,
            clock_event_reasons=clock_reason_names(w.reasons_mask),
        )

    def _gpm_end(self, sample1: Any) -> tuple[float | None, float | None, float | None]:
        nv = self._nvml
        sample2 = None
        try:
            sample2 = nv.nvmlGpmSampleAlloc()
            nv.nvmlGpmSampleGet(self._handle, sample2)
            request = nv.c_nvmlGpmMetricsGet_t()
            request.version = nv.NVML_GPM_METRICS_GET_VERSION
            request.sample1 = sample1
            request.sample2 = sample2
            ids = (nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL, nv.NVML_GPM_METRIC_DRAM_BW_UTIL, nv.NVML_GPM_METRIC_SM_UTIL)
            request.numMetrics = len(ids)
            for i, metric_id in enumerate(ids):
                request.metrics[i].metricId = metric_id
            nv.nvmlGpmMetricsGet(request)
            values = tuple(
                float(request.metrics[i].value) if request.metrics[i].nvmlReturn == nv.NVML_SUCCESS else None
                for i in range(len(ids))
            )
            return values  # type: ignore[return-value]
        except nv.NVMLError as err:
            log.warning("GPM metrics failed: %s", err)
            return None, None, None
        finally:
            for sample in (sample1, sample2):
                if sample is not None:
                    try:
                        nv.nvmlGpmSampleFree(sample)
                    except nv.NVMLError as err:
                        log.debug("GPM sample free failed: %s", err)

    def close(self) -> None:
        if self._nvml is not None and self.available:
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as err:
                log.debug("nvmlShutdown failed: %s", err)
        self.available = False

    def __enter__(self) -> NvmlWindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
