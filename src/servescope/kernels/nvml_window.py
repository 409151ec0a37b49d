"""The kernel probe's NVML window: power, clocks and GPM activity over one steady loop.

Why a window of its own: the probe needs exactly one thing from NVML, a window (begin ... end) around a
steady kernel loop, read from the same thread that drives the loop, with no sampler thread competing for
the CPU. It reads through ``servescope.telemetry.nvml`` (``Nvml`` / ``NvmlGpu``), the only module that
imports pynvml: units (mW, mJ) are converted there, NVML errors become servescope errors there, and each
counter is probed once when the GPU is opened, so a counter the GPU does not offer is never polled.

What it reads and why:
- power as energy-counter difference / window length: NVML's ``nvmlDeviceGetPowerUsage`` is itself a ~1 s
  moving average on recent GPUs, so over a 1 s window the counter difference is the honest mean. The
  counter call is slow (3-6 ms of CPU on the H200 VM, docs/telemetry.md), so it is read only at the
  window's two bounds, never in ``poll``;
- SM clock, utilisation and the clock-event (throttle) reasons polled a few times during the window
  (clock and utilisation averaged, reasons OR-ed and named);
- GPM (Hopper and later) tensor-pipe, DRAM-bandwidth and SM activity between two GPM samples taken at the
  window's ends (NVML computes the average over that interval itself). ``NvmlGpu`` serialises the GPM
  samples of one GPU, which NVML refuses to take concurrently.

Short windows: on the H200 the energy counter and the GPM counters advance only every ~100 ms
(docs/measurements/telemetry-h200-physics.md). A window that holds no update would read 0 J and 0 %
activity; such values are left None, never reported as 0, and the window is flagged in ``notes``
(which the probe copies into the results' warnings), as is any window shorter than ``MIN_WINDOW_S``.
Anything the GPU does not offer stays None; the reason is noted once, never raised: the timing is still
worth having without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from servescope.errors import NvmlUnavailable, TelemetryError
from servescope.kernels.results import WindowTelemetry
from servescope.telemetry.nvml import CLOCK_EVENT_REASONS, GPM_MIN_PERIOD_S, GpuReadError, Nvml, NvmlGpu

log = logging.getLogger(__name__)

#: Windows shorter than this are flagged: the energy counter and GPM advance only every ~100 ms on the
#: H200, and an interval of this length always held an update there (``telemetry.nvml.GPM_MIN_PERIOD_S``).
MIN_WINDOW_S = GPM_MIN_PERIOD_S

#: nvml.h ``NVML_ERROR_IN_USE``: NVML refused a GPM sample because another GPM client (e.g. a telemetry
#: sampler in another process) was sampling this GPU at that instant. Transient, so only that window loses GPM.
_NVML_ERROR_IN_USE = 19

_KNOWN_REASON_BITS = sum(bit for bit, _ in CLOCK_EVENT_REASONS)


def clock_reason_names(mask: int) -> tuple[str, ...]:
    """Names of the set bits of an NVML clock-event reason mask (unknown bits as hex)."""
    names = [name for bit, name in CLOCK_EVENT_REASONS if mask & bit]
    rest = mask & ~_KNOWN_REASON_BITS
    if rest:
        names.append(hex(rest))
    return tuple(names)


@dataclass
class _Window:
    t0: float
    energy0_j: float | None
    gpm_sample: Any = None
    clocks_mhz: list[float] = field(default_factory=list)
    utils_pct: list[float] = field(default_factory=list)
    reasons_mask: int = 0


class NvmlWindowReader:
    """Reads one GPU's power, clock and GPM activity over windows. ``available`` is False without NVML.

    ``uuid`` (as CUDA reports it, with or without ``GPU-``) picks the GPU, since CUDA's and NVML's device
    order differ under CUDA_VISIBLE_DEVICES; ``index`` (an NVML index) is the fallback. ``lib`` is a
    pynvml-compatible object, None meaning the real ``pynvml`` (tests pass ``telemetry.fake_nvml.FakeNvml``).
    ``clock`` times the window (seconds; tests pass a scripted one).
    """

    def __init__(self, *, uuid: str | None = None, index: int = 0, lib: Any = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.available = False
        self.gpm_available = False
        self.notes: list[str] = []
        self._clock = clock
        self._nvml: Nvml | None = None
        self._gpu: NvmlGpu | None = None
        self._window: _Window | None = None
        self._flagged: set[str] = set()
        try:
            nvml = Nvml(lib)  # a missing driver or library is NvmlUnavailable, with the reason
        except NvmlUnavailable as err:
            self._note(f"NVML unavailable ({err}); power, clocks and GPM columns are empty")
            return
        try:
            found = nvml.index_of_uuid(uuid) if uuid else None
            if uuid and found is None:
                log.info("no NVML GPU has UUID %s; reading NVML GPU %d", uuid, index)
            self._gpu = NvmlGpu(nvml, found if found is not None else index)
        except TelemetryError as err:
            nvml.close()
            self._note(f"NVML could not open the GPU ({err}); power, clocks and GPM columns are empty")
            return
        self._nvml = nvml
        self.available = True
        counters = self._gpu.info.counters
        self.gpm_available = self._gpu.gpm_enabled
        if not self.gpm_available:
            self.notes.append(f"GPM metrics unavailable ({counters.get('gpm', 'not probed')}); "
                              "tensor and DRAM activity columns are empty")
        if not self._gpu.has_energy_counter:
            self.notes.append(f"energy counter unavailable ({counters.get('energy', 'not probed')}); "
                              "power and energy columns are empty")

    def _note(self, text: str) -> None:
        self.notes.append(text)
        log.warning("%s", text)

    def _flag(self, kind: str, text: str) -> None:
        """A data-quality problem of a window: noted (and logged as a warning) once per kind."""
        if kind in self._flagged:
            log.debug("%s", text)
            return
        self._flagged.add(kind)
        self._note(text)

    def device_facts(self) -> dict[str, Any]:
        """Power limit, max SM and memory clocks and driver version, for the results file's GPU section."""
        if not self.available or self._gpu is None:
            return {}
        info = self._gpu.info
        facts: dict[str, Any] = {}
        if info.power_limit_w is not None:
            facts["power_limit_w"] = info.power_limit_w
        # nvmlDeviceGetMaxClockInfo returns an unsigned int (MHz); int() keeps kernels.json as it was.
        if info.sm_clock_max_mhz is not None:
            facts["sm_clock_max_mhz"] = int(info.sm_clock_max_mhz)
        if info.mem_clock_max_mhz is not None:
            facts["mem_clock_max_mhz"] = int(info.mem_clock_max_mhz)
        facts["driver"] = info.driver
        return facts

    def _energy_j(self) -> float | None:
        gpu = self._gpu
        if gpu is None or not gpu.has_energy_counter:
            return None
        try:
            return gpu.energy_j()
        except TelemetryError as err:
            log.debug("energy counter read failed: %s", err)
            return None

    def begin(self) -> None:
        """Start a window: snapshot the energy counter and a GPM sample."""
        t0 = self._clock()
        if not self.available or self._gpu is None:
            self._window = _Window(t0=t0, energy0_j=None)
            return
        window = _Window(t0=t0, energy0_j=self._energy_j())
        if self.gpm_available:
            try:
                window.gpm_sample = self._gpu.gpm_snapshot()
            except GpuReadError as err:
                if err.code == _NVML_ERROR_IN_USE:
                    self._flag("gpm_in_use", f"GPM sample refused ({err}: another GPM client on this GPU); "
                                             "windows that hit it have empty tensor and DRAM activity")
                else:
                    self._disable_gpm(err)
            except TelemetryError as err:
                self._disable_gpm(err)
        self._window = window

    def _disable_gpm(self, err: TelemetryError) -> None:
        self.gpm_available = False
        self._note(f"GPM sampling failed ({err}); tensor and DRAM activity columns are empty")

    def poll(self) -> None:
        """Take one reading of SM clock, utilisation and clock-event reasons (call a few times per window)."""
        if not self.available or self._window is None or self._gpu is None:
            return
        self._poll(self._gpu, self._window)

    @staticmethod
    def _poll(gpu: NvmlGpu, w: _Window) -> None:
        counters = gpu.info.counters
        try:
            if counters.get("sm_clock") == "ok":
                w.clocks_mhz.append(gpu.sm_clock_mhz())
            if counters.get("utilization") == "ok":
                w.utils_pct.append(gpu.gpu_util_pct())
        except TelemetryError as err:
            log.debug("NVML poll failed: %s", err)
        if counters.get("clock_event_reasons") == "ok":
            try:
                w.reasons_mask |= gpu.clock_event_mask()
            except TelemetryError as err:
                log.debug("NVML clock reasons unavailable: %s", err)

    def end(self) -> WindowTelemetry:
        """Close the window and return its readings (None where a reading is missing, never a silent 0)."""
        w = self._window
        if w is None:
            raise RuntimeError("NvmlWindowReader.end() without begin()")
        self._window = None
        elapsed_s = self._clock() - w.t0
        if not self.available or self._gpu is None:
            return WindowTelemetry(window_s=elapsed_s)
        gpu = self._gpu
        self._poll(gpu, w)  # one reading at the end, so even a window shorter than the poll period has one
        if elapsed_s < MIN_WINDOW_S:
            self._flag("short", f"a {elapsed_s:.3f} s NVML window is shorter than {MIN_WINDOW_S:g} s: the energy "
                                "and GPM counters advance only every ~0.1 s (H200), so power, energy and GPM "
                                "activity of such windows are coarse or empty; use --window-s 1")
        energy1 = self._energy_j() if w.energy0_j is not None else None
        power_w = energy_j = None
        if w.energy0_j is not None and energy1 is not None and elapsed_s > 0:
            delta_j = energy1 - w.energy0_j
            if delta_j > 0:
                energy_j = delta_j
                power_w = delta_j / elapsed_s
            else:
                self._flag("energy_still", f"the energy counter did not advance over a {elapsed_s:.3f} s window "
                                           "(NVML updates it every ~0.1 s on H200): power_w and energy_j of such "
                                           "windows are empty, not 0; use a longer --window-s")
        tensor = dram = sm = None
        if w.gpm_sample is not None:
            tensor, dram, sm = self._gpm_end(gpu, w.gpm_sample, elapsed_s)
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

    def _gpm_end(self, gpu: NvmlGpu, sample1: Any,
                 elapsed_s: float) -> tuple[float | None, float | None, float | None]:
        """Tensor, DRAM-bandwidth and SM activity (%) between ``sample1`` and a sample taken now."""
        sample2 = None
        try:
            sample2 = gpu.gpm_snapshot()
            metrics = gpu.gpm_between(sample1, sample2)
        except TelemetryError as err:
            log.warning("GPM metrics failed: %s", err)
            return None, None, None
        finally:
            for sample in (sample1, sample2):
                if sample is not None:
                    gpu.gpm_free(sample)
        if not metrics:  # gpm_between drops an interval that held no counter update (0 % and NaN)
            self._flag("gpm_still", f"GPM counters did not update within a {elapsed_s:.3f} s window (NVML "
                                    "updates them every ~0.1 s on H200): its tensor, DRAM and SM activity are "
                                    "empty, not 0; use a longer --window-s")
        return (metrics.get("gpm_tensor_active_pct"), metrics.get("gpm_dram_bw_pct"),
                metrics.get("gpm_sm_active_pct"))

    def close(self) -> None:
        """Free the GPU's GPM samples and shut NVML down (safe to call twice)."""
        if self._gpu is not None:
            if self._window is not None and self._window.gpm_sample is not None:
                self._gpu.gpm_free(self._window.gpm_sample)
            self._window = None
            self._gpu.close()
            self._gpu = None
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
        self.available = False

    def __enter__(self) -> NvmlWindowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
