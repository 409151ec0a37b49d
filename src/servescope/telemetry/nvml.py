"""NVML behind one wrapper: the only module of servescope that touches ``pynvml``.

Why a wrapper (as zeus's ``device/gpu/nvidia.py``):
- Vendor units are converted once, here: NVML reports power in mW, energy in mJ, GPM
  PCIe/NVLink rates in MiB/s; everything leaving this module is W, J, bytes/s, MHz, %.
- NVML return codes become servescope errors in one place: a counter a GPU does not
  offer is ``CounterNotSupported`` at probe time (a *state*, recorded in the notes, not
  a crash); any other failure while sampling is ``GpuReadError``, which the sampler turns
  into a gap row for that GPU and carries on with the others.
- Each counter is probed once when a GPU is opened, and only the ones that answered are
  read in the sampling loop, so an unsupported counter costs nothing per sample.
- The library object is passed in (``lib``), never a module-level singleton: production
  passes nothing and gets ``pynvml``; tests pass ``fake_nvml.FakeNvml``, which replays
  responses recorded from a real H200 through ``fake_nvml.RecordingNvml``.

GPM (GPU Performance Monitoring, Hopper and newer) metrics are differences between two
samples (``nvmlGpmMetricsGet`` takes ``sample1`` and ``sample2``, ``nvml.h``): each read
takes a new sample and reports the metrics over the interval since the previous one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from servescope.errors import ConfigError, CounterNotSupported, NvmlUnavailable, TelemetryError

log = logging.getLogger(__name__)

_MIB = 1024 * 1024

#: GPM metrics we sample: (CSV column, pynvml constant name, scale to our unit).
#: Meanings from ``nvml.h`` / pynvml's comments: SM_UTIL is "percentage of SMs that were
#: busy" (SM activity); ANY_TENSOR_UTIL "percentage of time the SMs were doing ANY tensor
#: operations"; DRAM_BW_UTIL "percentage of DRAM bw used vs theoretical maximum"; the
#: PCIe / NVLink rates are MiB/s.
GPM_METRICS: tuple[tuple[str, str, float], ...] = (
    ("gpm_sm_active_pct", "NVML_GPM_METRIC_SM_UTIL", 1.0),
    ("gpm_sm_occupancy_pct", "NVML_GPM_METRIC_SM_OCCUPANCY", 1.0),
    ("gpm_tensor_active_pct", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 1.0),
    ("gpm_dram_bw_pct", "NVML_GPM_METRIC_DRAM_BW_UTIL", 1.0),
    ("gpm_fp16_active_pct", "NVML_GPM_METRIC_FP16_UTIL", 1.0),
    ("gpm_fp32_active_pct", "NVML_GPM_METRIC_FP32_UTIL", 1.0),
    ("gpm_fp64_active_pct", "NVML_GPM_METRIC_FP64_UTIL", 1.0),
    ("gpm_hmma_active_pct", "NVML_GPM_METRIC_HMMA_TENSOR_UTIL", 1.0),
    ("gpm_imma_active_pct", "NVML_GPM_METRIC_IMMA_TENSOR_UTIL", 1.0),
    ("pcie_tx_bytes_s", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", float(_MIB)),
    ("pcie_rx_bytes_s", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", float(_MIB)),
    ("nvlink_tx_bytes_s", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", float(_MIB)),
    ("nvlink_rx_bytes_s", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", float(_MIB)),
)

#: Clock-event ("throttle") reason bits, from nvml.h ``nvmlClocksEventReason*`` (the same
#: values pynvml exports). Decoded to names so a CSV reader needs no bit arithmetic.
CLOCK_EVENT_REASONS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

#: Pause between the two GPM samples taken at probe time: metrics over a zero-length
#: interval are meaningless, and the probe must see which metrics the GPU returns.
_GPM_PROBE_GAP_S = 0.02

#: Shortest interval between two GPM samples in the sampling loop. Measured on an H200
#: (driver 580.159.04, docs/measurements/telemetry-h200-physics.md): the GPM counters,
#: the averaged power and the energy counter all advance every ~100 ms, so two GPM
#: samples 50 ms apart often straddle no update and NVML returns 0 for every metric (and
#: NaN for DRAM bandwidth, 0/0). Above 100 ms plus jitter, every interval holds an update.
GPM_MIN_PERIOD_S = 0.15

#: Shortest interval between two reads of the energy counter in the loop. On the same
#: H200 one nvmlDeviceGetTotalEnergyConsumption call cost ~5.6 ms of CPU (the rest of a
#: sample ~0.2 ms), and the counter only advances every ~100 ms; per-point energy is
#: interpolated between readings, and windows read the counter directly at their bounds.
ENERGY_MIN_PERIOD_S = 0.5


def decode_clock_event_reasons(mask: int) -> list[str]:
    """Names of the bits set in an NVML clock-event reason mask (unknown bits as hex)."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    known = 0
    for bit, _ in CLOCK_EVENT_REASONS:
        known |= bit
    rest = mask & ~known
    if rest:
        names.append(f"bits_{rest:#x}")
    return names


class GpuReadError(TelemetryError):
    """Reading a GPU failed mid-run (GPU lost, driver error...): the sampler records a gap.

    ``code`` is the NVML return code (e.g. 15 GPU_IS_LOST, 19 IN_USE), None if unknown.
    """

    def __init__(self, gpu_index: int, counter: str, problem: str, code: int | None = None) -> None:
        self.gpu_index = gpu_index
        self.counter = counter
        self.code = code
        super().__init__(f"GPU {gpu_index}: reading {counter} failed ({problem})")


def load_pynvml() -> Any:
    """The real pynvml module (``RecordingNvml`` wraps it on GPU machines)."""
    try:
        import pynvml  # the one import of pynvml in servescope
    except ImportError as err:  # pragma: no cover - nvidia-ml-py is a declared dependency
        raise NvmlUnavailable("nvidia-ml-py is not installed; pip install nvidia-ml-py") from err
    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _field_value(fv: Any, lib: Any) -> float:
    """The number in an ``nvmlFieldValue_t``, read from the union member its type names."""
    vt = fv.valueType
    v = fv.value
    if vt == lib.NVML_VALUE_TYPE_DOUBLE:
        return float(v.dVal)
    if vt == lib.NVML_VALUE_TYPE_UNSIGNED_INT:
        return float(v.uiVal)
    if vt == lib.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return float(v.ulVal)
    if vt == lib.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return float(v.ullVal)
    if vt == lib.NVML_VALUE_TYPE_SIGNED_LONG_LONG:
        return float(v.sllVal)
    if vt == lib.NVML_VALUE_TYPE_SIGNED_INT:
        return float(v.siVal)
    return float(v.usVal)


Reader = Callable[[dict[str, Any]], None]


def _stale(values: dict[int, tuple[int, float]]) -> bool:
    """True when a GPM interval held no counter update (seen on H200: DRAM_BW_UTIL is NaN,
    i.e. 0/0 elapsed cycles, and every other metric 0): write nothing rather than zeros."""
    return any(ret == 0 and not math.isfinite(v) for ret, v in values.values())


@dataclass
class GpuInfo:
    """What one GPU is and which counters it offers (for ``env.json`` and the notes)."""

    index: int
    name: str
    uuid: str
    driver: str
    power_limit_w: float | None
    power_limit_default_w: float | None
    sm_clock_max_mhz: float | None
    mem_clock_max_mhz: float | None
    memory_total_bytes: int | None
    mig_mode: bool | None
    gpm_supported: bool
    #: counter name -> "ok" or the reason it is skipped
    counters: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "uuid": self.uuid,
            "driver": self.driver,
            "power_limit_w": self.power_limit_w,
            "power_limit_default_w": self.power_limit_default_w,
            "sm_clock_max_mhz": self.sm_clock_max_mhz,
            "mem_clock_max_mhz": self.mem_clock_max_mhz,
            "memory_total_bytes": self.memory_total_bytes,
            "mig_mode": self.mig_mode,
            "gpm_supported": self.gpm_supported,
            "counters": dict(self.counters),
        }


class NvmlGpu:
    """One GPU: probes its counters once, then reads the supported ones each sample.

    Not thread-safe by itself: the sampler thread owns ``read``; windows use their own
    GPM samples (``gpm_snapshot`` / ``gpm_between``) and the energy counter, which NVML
    allows from any thread.
    """

    def __init__(self, nvml: Nvml, index: int, *, gpm_period_s: float = GPM_MIN_PERIOD_S,
                 energy_period_s: float = ENERGY_MIN_PERIOD_S) -> None:
        self._nvml = nvml
        self._lib = nvml.lib
        self.index = index
        self._handle = self._call("handle", "nvmlDeviceGetHandleByIndex", index)
        self._readers: list[tuple[str, Reader]] = []
        #: counters that stopped answering NOT_SUPPORTED mid-run: (counter, reason)
        self.dropped: list[tuple[str, str]] = []
        self._gpm_ids: list[int] = []
        self._gpm_cols: list[tuple[str, float]] = []
        self._gpm_prev: Any = None
        self._gpm_next: Any = None
        self._gpm_prev_t = 0.0
        self._gpm_period_s = gpm_period_s
        # NVML answers IN_USE when two GPM samples of one GPU are taken at once (seen on the
        # H200 when a window began during a sampler tick): the sampler and windows share it.
        self._gpm_lock = threading.Lock()
        self._energy_period_s = energy_period_s
        self._energy_t = -math.inf
        #: GPM intervals that held no counter update (skipped, not written as zeros)
        self.gpm_stale = 0
        #: GPM samples refused with IN_USE (another GPM client at that instant; retried)
        self.gpm_in_use = 0
        self.info = self._probe()

    # -- NVML calls and error mapping ------------------------------------------------
    def _call(self, counter: str, fn_name: str, *args: Any) -> Any:
        lib = self._lib
        fn = getattr(lib, fn_name, None)
        if fn is None:
            unsupported = CounterNotSupported(self.index, counter, "not in this nvidia-ml-py")
            unsupported.reason = "not in this nvidia-ml-py"  # type: ignore[attr-defined]
            raise unsupported
        try:
            return fn(*args)
        except lib.NVMLError as err:
            if err.value in (lib.NVML_ERROR_NOT_SUPPORTED, lib.NVML_ERROR_FUNCTION_NOT_FOUND):
                reason = "not supported" if err.value == lib.NVML_ERROR_NOT_SUPPORTED else "not in this driver's NVML"
                unsupported = CounterNotSupported(self.index, counter, reason)
                unsupported.reason = reason  # type: ignore[attr-defined]
                raise unsupported from err
            raise GpuReadError(self.index, counter, str(err), int(err.value)) from err

    def _optional(self, counter: str, fn_name: str, *args: Any) -> tuple[Any, str]:
        """Probe one call: (value, "ok") or (None, reason). Any NVML error is a reason here."""
        try:
            return self._call(counter, fn_name, *args), "ok"
        except CounterNotSupported as err:
            return None, getattr(err, "reason", "not supported")
        except GpuReadError as err:
            return None, f"error at probe: {err}"

    # -- probing -----------------------------------------------------------------------
    def _probe(self) -> GpuInfo:
        lib = self._lib
        counters: dict[str, str] = {}
        name, _ = self._optional("name", "nvmlDeviceGetName", self._handle)
        uuid, _ = self._optional("uuid", "nvmlDeviceGetUUID", self._handle)
        sm_max, counters["sm_clock_max"] = self._optional(
            "sm_clock_max", "nvmlDeviceGetMaxClockInfo", self._handle, lib.NVML_CLOCK_SM
        )
        mem_max, counters["mem_clock_max"] = self._optional(
            "mem_clock_max", "nvmlDeviceGetMaxClockInfo", self._handle, lib.NVML_CLOCK_MEM
        )
        mem, counters["memory"] = self._optional("memory", "nvmlDeviceGetMemoryInfo", self._handle)
        limit_default, _ = self._optional(
            "power_limit_default", "nvmlDeviceGetPowerManagementDefaultLimit", self._handle
        )
        mig, _ = self._optional("mig_mode", "nvmlDeviceGetMigMode", self._handle)
        mig_on = bool(mig[0]) if mig is not None else None
        self._sm_max = float(sm_max) if sm_max is not None else None
        # nvidia-ml-py renamed "throttle" reasons to "clock event" reasons (same bits).
        self._reasons_fn = ("nvmlDeviceGetCurrentClocksEventReasons"
                            if hasattr(lib, "nvmlDeviceGetCurrentClocksEventReasons")
                            else "nvmlDeviceGetCurrentClocksThrottleReasons")
        self._mem_max = float(mem_max) if mem_max is not None else None

        # Per-sample counters: probe each once and keep a reader for those that answered.
        probes: list[tuple[str, str, tuple[Any, ...], Reader]] = [
            ("power", "nvmlDeviceGetPowerUsage", (self._handle,), self._read_power),
            ("power_instant", "nvmlDeviceGetFieldValues", (self._handle, [lib.NVML_FI_DEV_POWER_INSTANT]),
             self._read_power_instant),
            ("energy", "nvmlDeviceGetTotalEnergyConsumption", (self._handle,), self._read_energy),
            ("power_limit", "nvmlDeviceGetEnforcedPowerLimit", (self._handle,), self._read_power_limit),
            ("sm_clock", "nvmlDeviceGetClockInfo", (self._handle, lib.NVML_CLOCK_SM), self._read_sm_clock),
            ("mem_clock", "nvmlDeviceGetClockInfo", (self._handle, lib.NVML_CLOCK_MEM), self._read_mem_clock),
            ("utilization", "nvmlDeviceGetUtilizationRates", (self._handle,), self._read_util),
            ("temperature", "nvmlDeviceGetTemperature", (self._handle, lib.NVML_TEMPERATURE_GPU),
             self._read_temp),
            ("memory_used", "nvmlDeviceGetMemoryInfo", (self._handle,), self._read_mem_used),
            ("clock_event_reasons", self._reasons_fn, (self._handle,), self._read_reasons),
        ]
        limit_w = None
        for counter, fn_name, args, reader in probes:
            value, status = self._optional(counter, fn_name, *args)
            if status == "ok" and counter == "power_instant":
                fv = value[0]
                if fv.nvmlReturn != 0:
                    status = "not supported" if fv.nvmlReturn == lib.NVML_ERROR_NOT_SUPPORTED else (
                        f"field returned NVML error {fv.nvmlReturn}"
                    )
            if status == "ok" and counter == "power_limit":
                limit_w = value / 1000.0
            counters[counter] = status
            if status == "ok":
                self._readers.append((counter, reader))

        gpm_ok = self._probe_gpm(counters, mig_on)
        self._probe_legacy_pcie(counters)
        if gpm_ok:
            self._readers.append(("gpm", self._read_gpm))

        return GpuInfo(
            index=self.index,
            name=_text(name) if name is not None else "unknown",
            uuid=_text(uuid) if uuid is not None else "",
            driver=self._nvml.driver_version,
            power_limit_w=limit_w,
            power_limit_default_w=limit_default / 1000.0 if limit_default is not None else None,
            sm_clock_max_mhz=self._sm_max,
            mem_clock_max_mhz=self._mem_max,
            memory_total_bytes=int(mem.total) if mem is not None else None,
            mig_mode=mig_on,
            gpm_supported=gpm_ok,
            counters=counters,
        )

    def _probe_gpm(self, counters: dict[str, str], mig_on: bool | None) -> bool:
        """Check GPM support and which metrics answer; leaves ``_gpm_prev`` ready for reads."""
        lib = self._lib
        if not hasattr(lib, "nvmlGpmQueryDeviceSupport"):
            counters["gpm"] = "this nvidia-ml-py has no GPM API"
            return False
        support, status = self._optional("gpm", "nvmlGpmQueryDeviceSupport", self._handle)
        if status != "ok":
            counters["gpm"] = status
            return False
        if not support.isSupportedDevice:
            counters["gpm"] = "not supported (GPM needs Hopper or newer)"
            return False
        if mig_on:
            counters["gpm"] = "skipped: MIG mode is on (GPM is per GPU instance there; not sampled)"
            return False
        wanted = [(col, getattr(lib, const), scale) for col, const, scale in GPM_METRICS if hasattr(lib, const)]
        taken: list[Any] = []
        try:
            taken.append(self.gpm_snapshot())
            time.sleep(_GPM_PROBE_GAP_S)
            taken.append(self.gpm_snapshot())
            values = self._gpm_get(taken[0], taken[1], [mid for _, mid, _ in wanted])
        except (CounterNotSupported, GpuReadError) as err:
            for sample in taken:
                self.gpm_free(sample)
            counters["gpm"] = f"error at probe: {err}"
            return False
        a, b = taken
        self.gpm_free(a)
        for col, mid, scale in wanted:
            ret, _ = values[mid]
            if ret == 0:
                self._gpm_ids.append(mid)
                self._gpm_cols.append((col, scale))
                counters[col] = "ok"
            else:
                counters[col] = "not supported" if ret == lib.NVML_ERROR_NOT_SUPPORTED else f"NVML error {ret}"
        if not self._gpm_ids:
            counters["gpm"] = "no GPM metric answered"
            self.gpm_free(b)
            return False
        counters["gpm"] = "ok"
        self._gpm_prev = b
        self._gpm_prev_t = time.monotonic()
        self._gpm_next = self._call("gpm", "nvmlGpmSampleAlloc")
        return True

    def _probe_legacy_pcie(self, counters: dict[str, str]) -> None:
        """PCIe rates come from GPM; without it we say why they are missing.

        nvmlDeviceGetPcieThroughput samples over 20 ms *inside* the call (nvml.h), two
        calls per GPU per tick would stall a 10-100 ms sampler, so it is not read in the
        loop. ``pcie_legacy_read_s`` times it for the overhead benchmark.
        """
        if counters.get("pcie_tx_bytes_s") == "ok":
            return
        counters["pcie_throughput"] = (
            "skipped: GPM offers no PCIe rate here and nvmlDeviceGetPcieThroughput blocks ~20 ms per call"
        )

    def pcie_legacy_read_s(self) -> float | None:
        """Seconds one nvmlDeviceGetPcieThroughput call takes (None if unsupported)."""
        t0 = time.perf_counter()
        _, status = self._optional("pcie_throughput", "nvmlDeviceGetPcieThroughput", self._handle,
                                   self._lib.NVML_PCIE_UTIL_TX_BYTES)
        return time.perf_counter() - t0 if status == "ok" else None

    # -- readers (one per counter; each fills columns of a sample row) -------------------
    def _read_power(self, row: dict[str, Any]) -> None:
        row["power_w"] = self._call("power", "nvmlDeviceGetPowerUsage", self._handle) / 1000.0

    def _read_power_instant(self, row: dict[str, Any]) -> None:
        fv = self._call("power_instant", "nvmlDeviceGetFieldValues", self._handle,
                        [self._lib.NVML_FI_DEV_POWER_INSTANT])[0]
        if fv.nvmlReturn == 0:
            row["power_instant_w"] = _field_value(fv, self._lib) / 1000.0

    def _read_energy(self, row: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._energy_t < self._energy_period_s:
            return  # see ENERGY_MIN_PERIOD_S: an expensive call for a slowly moving counter
        row["energy_j"] = self._call("energy", "nvmlDeviceGetTotalEnergyConsumption", self._handle) / 1000.0
        self._energy_t = now

    def _read_power_limit(self, row: dict[str, Any]) -> None:
        row["power_limit_w"] = self._call("power_limit", "nvmlDeviceGetEnforcedPowerLimit", self._handle) / 1000.0

    def _read_sm_clock(self, row: dict[str, Any]) -> None:
        row["sm_clock_mhz"] = float(self._call("sm_clock", "nvmlDeviceGetClockInfo", self._handle,
                                               self._lib.NVML_CLOCK_SM))
        row["sm_clock_max_mhz"] = self._sm_max

    def _read_mem_clock(self, row: dict[str, Any]) -> None:
        row["mem_clock_mhz"] = float(self._call("mem_clock", "nvmlDeviceGetClockInfo", self._handle,
                                                self._lib.NVML_CLOCK_MEM))
        row["mem_clock_max_mhz"] = self._mem_max

    def _read_util(self, row: dict[str, Any]) -> None:
        u = self._call("utilization", "nvmlDeviceGetUtilizationRates", self._handle)
        row["gpu_util_pct"] = float(u.gpu)
        row["mem_util_pct"] = float(u.memory)

    def _read_temp(self, row: dict[str, Any]) -> None:
        row["temp_c"] = float(self._call("temperature", "nvmlDeviceGetTemperature", self._handle,
                                         self._lib.NVML_TEMPERATURE_GPU))

    def _read_mem_used(self, row: dict[str, Any]) -> None:
        row["mem_used_bytes"] = int(self._call("memory_used", "nvmlDeviceGetMemoryInfo", self._handle).used)

    def _read_reasons(self, row: dict[str, Any]) -> None:
        mask = self._call("clock_event_reasons", self._reasons_fn, self._handle)
        row["clock_event_reasons"] = ";".join(decode_clock_event_reasons(int(mask)))

    def _read_gpm(self, row: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - self._gpm_prev_t < self._gpm_period_s:
            return  # see GPM_MIN_PERIOD_S: too soon for the counters to have moved
        with self._gpm_lock:
            try:
                self._call("gpm", "nvmlGpmSampleGet", self._handle, self._gpm_next)
            except GpuReadError as err:
                if err.code == getattr(self._lib, "NVML_ERROR_IN_USE", 19):  # 19: nvml.h
                    self.gpm_in_use += 1
                    return  # another GPM client this instant: try again next tick, no gap
                raise
            values = self._gpm_get(self._gpm_prev, self._gpm_next, self._gpm_ids)
            if _stale(values):
                self.gpm_stale += 1
                return  # keep the previous sample: the next interval will cover this one
            self._gpm_prev, self._gpm_next = self._gpm_next, self._gpm_prev
            self._gpm_prev_t = now
        for mid, (col, scale) in zip(self._gpm_ids, self._gpm_cols, strict=True):
            ret, value = values[mid]
            if ret == 0 and math.isfinite(value):
                row[col] = value * scale

    # -- GPM building blocks (also used by measurement windows) --------------------------
    def gpm_snapshot(self) -> Any:
        """Allocate and fill one GPM sample (free it with ``gpm_free``)."""
        sample = self._call("gpm", "nvmlGpmSampleAlloc")
        try:
            with self._gpm_lock:
                self._call("gpm", "nvmlGpmSampleGet", self._handle, sample)
        except TelemetryError:
            self.gpm_free(sample)
            raise
        return sample

    def gpm_free(self, sample: Any) -> None:
        try:
            self._call("gpm", "nvmlGpmSampleFree", sample)
        except TelemetryError as err:  # freeing is best effort; a leak beats a crash
            log.debug("GPU %d: freeing a GPM sample failed: %s", self.index, err)

    def _gpm_get(self, a: Any, b: Any, metric_ids: list[int]) -> dict[int, tuple[int, float]]:
        lib = self._lib
        mg = lib.c_nvmlGpmMetricsGet_t()
        mg.version = lib.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(metric_ids)
        mg.sample1 = a
        mg.sample2 = b
        for i, mid in enumerate(metric_ids):
            mg.metrics[i].metricId = mid
        self._call("gpm", "nvmlGpmMetricsGet", mg)
        out: dict[int, tuple[int, float]] = {}
        for i, mid in enumerate(metric_ids):
            m = mg.metrics[i]
            out[mid] = (int(m.nvmlReturn), float(m.value))
        return out

    def gpm_between(self, a: Any, b: Any) -> dict[str, float]:
        """GPM metrics (our column names and units) over the interval between two snapshots."""
        values = self._gpm_get(a, b, self._gpm_ids)
        if _stale(values):
            return {}
        pairs = zip(self._gpm_ids, self._gpm_cols, strict=True)
        return {col: values[mid][1] * scale for mid, (col, scale) in pairs
                if values[mid][0] == 0 and math.isfinite(values[mid][1])}

    @property
    def gpm_enabled(self) -> bool:
        return bool(self._gpm_ids) and self._gpm_prev is not None

    @property
    def has_energy_counter(self) -> bool:
        return self.info.counters.get("energy") == "ok"

    def energy_j(self) -> float:
        """The cumulative energy counter (J since the driver loaded); raises on failure."""
        return self._call("energy", "nvmlDeviceGetTotalEnergyConsumption", self._handle) / 1000.0

    def power_w(self) -> float:
        return self._call("power", "nvmlDeviceGetPowerUsage", self._handle) / 1000.0

    # One-counter reads for callers that poll a few counters themselves (the kernel probe's
    # window reads clock, utilisation and clock-event reasons, never the slow energy counter,
    # between its bounds). Check ``info.counters[name] == "ok"`` first; they raise on failure.
    def sm_clock_mhz(self) -> float:
        """The current SM clock (MHz)."""
        return float(self._call("sm_clock", "nvmlDeviceGetClockInfo", self._handle, self._lib.NVML_CLOCK_SM))

    def gpu_util_pct(self) -> float:
        """NVML's GPU utilisation (%: share of time some kernel ran, not how busy the SMs were)."""
        return float(self._call("utilization", "nvmlDeviceGetUtilizationRates", self._handle).gpu)

    def clock_event_mask(self) -> int:
        """The raw clock-event reason bits (``decode_clock_event_reasons`` names them); a mask, so
        several polls of one window can be OR-ed before naming."""
        return int(self._call("clock_event_reasons", self._reasons_fn, self._handle))

    # -- the per-sample read ----------------------------------------------------------
    def read(self, row: dict[str, Any]) -> None:
        """Fill ``row`` with every supported counter.

        A counter that starts answering NOT_SUPPORTED is dropped (noted in ``dropped``);
        any other failure raises ``GpuReadError`` so the caller records a gap.
        """
        for entry in list(self._readers):
            counter, reader = entry
            try:
                reader(row)
            except CounterNotSupported as err:
                log.warning("%s; no longer sampled", err)
                self.dropped.append((counter, str(err)))
                self._readers.remove(entry)
                self.info.counters[counter] = "stopped answering: not supported"

    def close(self) -> None:
        for s in (self._gpm_prev, self._gpm_next):
            if s is not None:
                self.gpm_free(s)
        self._gpm_prev = self._gpm_next = None


class Nvml:
    """An initialised NVML library; ``close`` (or ``with``) shuts it down.

    ``lib`` is a pynvml-compatible object: None means the real ``pynvml``. Opening
    raises ``NvmlUnavailable`` (with the reason) when there is no driver or no GPU.
    """

    def __init__(self, lib: Any = None) -> None:
        self.lib = lib if lib is not None else load_pynvml()
        try:
            self.lib.nvmlInit()
        except self.lib.NVMLError as err:
            raise NvmlUnavailable(f"NVML cannot start ({err}): no NVIDIA driver or GPU on this machine") from err
        self._open = True
        try:
            self.device_count = int(self.lib.nvmlDeviceGetCount())
            self.driver_version = _text(self.lib.nvmlSystemGetDriverVersion())
        except self.lib.NVMLError as err:
            self.close()
            raise NvmlUnavailable(f"NVML started but cannot list GPUs ({err})") from err
        if self.device_count == 0:
            self.close()
            raise NvmlUnavailable("NVML sees no GPU on this machine")

    def resolve(self, gpus: str | Iterable[int]) -> list[int]:
        """Turn ``"all"`` or explicit indices into NVML indices, refusing unknown ones."""
        if isinstance(gpus, str):
            if gpus.strip().lower() == "all":
                return list(range(self.device_count))
            gpus = parse_gpu_list(gpus)
        indices = list(gpus)
        bad = [i for i in indices if not 0 <= i < self.device_count]
        if bad:
            raise ConfigError(
                f"GPU {bad[0]} not found: NVML sees {self.device_count} GPU(s), indices 0-{self.device_count - 1}"
            )
        return indices

    def index_of_uuid(self, uuid: str) -> int | None:
        """The NVML index of the GPU with this UUID (with or without the ``GPU-`` prefix), None if
        no GPU has it. CUDA's device order and NVML's differ under CUDA_VISIBLE_DEVICES, so a
        caller holding a CUDA device finds its NVML index through the UUID both report."""
        want = uuid.strip().removeprefix("GPU-")
        for i in range(self.device_count):
            try:
                got = _text(self.lib.nvmlDeviceGetUUID(self.lib.nvmlDeviceGetHandleByIndex(i)))
            except self.lib.NVMLError as err:
                raise GpuReadError(i, "uuid", str(err), int(err.value)) from err
            if got.removeprefix("GPU-") == want:
                return i
        return None

    def open_gpus(self, indices: Iterable[int], **options: float) -> list[NvmlGpu]:
        """Open (and probe) GPUs; ``options`` are ``NvmlGpu``'s gpm_period_s / energy_period_s."""
        return [NvmlGpu(self, i, **options) for i in indices]

    def close(self) -> None:
        if getattr(self, "_open", False):
            self._open = False
            try:
                self.lib.nvmlShutdown()
            except self.lib.NVMLError as err:
                log.debug("nvmlShutdown failed: %s", err)

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_gpu_list(text: str) -> list[int]:
    """Parse ``"0,2,3"`` (or ``"all"`` -> raises: callers resolve that with NVML)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise ConfigError(f"--gpus: {part!r} is not a GPU index; use 'all' or e.g. '0,1'") from None
    if not out:
        raise ConfigError("--gpus is empty; use 'all' or e.g. '0,1'")
    return out


def describe_gpus(lib: Any = None) -> list[dict[str, Any]]:
    """Every GPU NVML sees, with its limits and counter availability, for ``env.json``.

    Returns ``[]`` where NVML is unavailable (no driver / no GPU), never raises for that.
    """
    try:
        nvml = Nvml(lib)
    except NvmlUnavailable as err:
        log.info("no GPUs described: %s", err)
        return []
    try:
        gpus = nvml.open_gpus(range(nvml.device_count))
        out = [g.info.to_dict() for g in gpus]
        for g in gpus:
            g.close()
        return out
    finally:
        nvml.close()
