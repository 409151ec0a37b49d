"""The NVML sampler: a background thread writing one CSV row per GPU per interval, plus windows.

Why a thread (not a process): NVML calls release the GIL in ctypes, each sample costs a
few hundred microseconds of Python (measured by ``benchmarks/sampler_overhead.py``, see
``docs/telemetry.md``), and a thread shares the run clock and the open NVML handles with
the measurement windows. Rows are written and flushed every tick, so Ctrl-C or a crash
loses at most the tick in progress.

Windows follow zeus (``zeus/monitor/energy.py``): ``begin_window(name)`` snapshots the
time, each GPU's energy counter and a GPM sample; ``end_window(name)`` takes them again
and returns a ``WindowMeasurement``. Energy is a counter difference, not integrated
power; a window too short for the counter to move is flagged and approximated from the
sampled power (never a silent 0 J), and windows shorter than ``SHORT_WINDOW_S`` are
flagged because NVML's averaged power lags about a second behind the load.
"""

from __future__ import annotations

import csv
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from servescope.errors import ConfigError, TelemetryError
from servescope.run import now_ns
from servescope.telemetry.nvml import NvmlGpu

log = logging.getLogger(__name__)

#: Columns of ``telemetry/gpu_samples.csv`` (docs/run-directory.md), in order.
GPU_COLUMNS: tuple[str, ...] = (
    "t_ns", "gpu", "power_w", "power_instant_w", "energy_j", "power_limit_w",
    "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz",
    "gpu_util_pct", "mem_util_pct", "temp_c", "mem_used_bytes", "clock_event_reasons",
    "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes_s", "nvlink_rx_bytes_s",
    "gpm_sm_active_pct", "gpm_sm_occupancy_pct", "gpm_tensor_active_pct", "gpm_dram_bw_pct",
    "gpm_fp16_active_pct", "gpm_fp32_active_pct", "gpm_fp64_active_pct",
    "gpm_hmma_active_pct", "gpm_imma_active_pct", "error",
)

#: The fastest interval we allow: below ~10 ms the per-sample NVML cost (several calls
#: per GPU) becomes a visible share of a CPU core and the counters barely change.
MIN_INTERVAL_MS = 10.0

#: Windows shorter than this are flagged: NVML's averaged power reading needs ~1 s of
#: steady load to settle (measured, ../shared/reference/h200-measurements.md).
SHORT_WINDOW_S = 1.0

#: Longest pause between retries of a GPU that keeps failing.
MAX_RETRY_BACKOFF_S = 5.0


class GpuSampleWriter:
    """Appends rows to ``gpu_samples.csv``, writing the header once, flushing every batch."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        self.path = path
        self._fh: TextIO | None = path.open("a", newline="", encoding="utf-8")
        self._csv = csv.writer(self._fh)
        if new:
            self._csv.writerow(GPU_COLUMNS)
            self._fh.flush()

    def write(self, rows: Sequence[dict[str, Any]]) -> None:
        if self._fh is None:
            return
        for row in rows:
            self._csv.writerow(["" if row.get(c) is None else _fmt(row[c]) for c in GPU_COLUMNS])
        self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _fmt(value: Any) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            return ""
        return str(int(value)) if value.is_integer() else repr(round(value, 6))
    return value


@dataclass(frozen=True, slots=True)
class WindowMeasurement:
    """What one named window measured on each GPU (keys are NVML GPU indices).

    ``energy_j[g]`` is the energy counter's difference over the window; where the counter
    is missing or did not move, it is power x time and ``energy_source[g]`` says so.
    ``gpm[g]`` holds GPM metrics (our column names) between the two window snapshots.
    """

    name: str
    start_ns: int
    end_ns: int
    energy_j: dict[int, float | None] = field(default_factory=dict)
    energy_source: dict[int, str] = field(default_factory=dict)
    power_mean_w: dict[int, float | None] = field(default_factory=dict)
    samples: dict[int, int] = field(default_factory=dict)
    gpm: dict[int, dict[str, float]] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def total_energy_j(self) -> float | None:
        vals = [v for v in self.energy_j.values() if v is not None]
        return sum(vals) if vals else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "duration_s": self.duration_s,
            "energy_j": {str(k): v for k, v in self.energy_j.items()},
            "energy_source": {str(k): v for k, v in self.energy_source.items()},
            "total_energy_j": self.total_energy_j,
            "power_mean_w": {str(k): v for k, v in self.power_mean_w.items()},
            "samples": {str(k): v for k, v in self.samples.items()},
            "gpm": {str(k): v for k, v in self.gpm.items()},
            "warnings": list(self.warnings),
        }


@dataclass
class _WindowState:
    start_ns: int
    energy_j: dict[int, float | None]
    gpm: dict[int, Any]
    power_sum_w: dict[int, float]
    power_n: dict[int, int]


@dataclass
class _Gap:
    gpu: int
    start_ns: int
    end_ns: int
    error: str
    failed_reads: int = 1
    open: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {"gpu": self.gpu, "start_ns": self.start_ns, "end_ns": self.end_ns, "error": self.error,
                "failed_reads": self.failed_reads, "open_at_end": self.open}


class GpuSampler:
    """Samples every given GPU each ``interval_ms`` in a background thread.

    ``writer`` receives each tick's rows (one per GPU; a GPU whose read failed gets a row
    with only ``t_ns``, ``gpu`` and ``error``: a gap). The sampler never stops because
    one GPU fails: that GPU is retried with a growing pause, the others go on.
    """

    def __init__(self, gpus: Sequence[NvmlGpu], interval_ms: float = 100.0,
                 writer: GpuSampleWriter | None = None, clock: Callable[[], int] = now_ns) -> None:
        if interval_ms < MIN_INTERVAL_MS:
            raise ConfigError(f"interval {interval_ms:g} ms is below the {MIN_INTERVAL_MS:g} ms minimum")
        self.gpus = list(gpus)
        self.interval_s = interval_ms / 1000.0
        self._writer = writer
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._windows: dict[str, _WindowState] = {}
        self._retry_at: dict[int, float] = {}
        self._fail_streak: dict[int, int] = {}
        self._open_gaps: dict[int, _Gap] = {}
        self.gaps: list[_Gap] = []
        self.ticks = 0
        self.rows_written = 0
        self.overruns = 0
        self.tick_time_s = 0.0
        self.thread_cpu_s = 0.0
        self.started_ns: int | None = None
        self.stopped_ns: int | None = None
        self.crash: str | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("sampler already started")
        self.started_ns = self._clock()
        self._thread = threading.Thread(target=self._run, name="servescope-nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("NVML sampler thread did not stop within %.1f s", timeout_s)
        self.stopped_ns = self._clock()

    def _run(self) -> None:
        cpu0 = time.thread_time()
        next_t = time.monotonic()
        try:
            self._loop(next_t)
        except Exception as err:
            # A bug must not silently end sampling: say so loudly and in the notes.
            self.crash = f"{type(err).__name__}: {err}"
            log.exception("NVML sampler stopped after an unexpected error")
        finally:
            self.thread_cpu_s = time.thread_time() - cpu0

    def _loop(self, next_t: float) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.tick()
            self.tick_time_s += time.perf_counter() - t0
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay < 0:
                # We fell behind (slow NVML calls, a stalled machine): skip the missed
                # ticks rather than firing a burst of back-to-back samples.
                missed = int(-delay / self.interval_s) + 1
                self.overruns += missed
                next_t += missed * self.interval_s
                delay = next_t - time.monotonic()
            self._stop.wait(max(0.0, delay))

    # -- one tick ---------------------------------------------------------------------
    def tick(self) -> list[dict[str, Any]]:
        """Read every GPU once and write the rows (public so tests can step it by hand)."""
        rows: list[dict[str, Any]] = []
        mono = time.monotonic()
        for gpu in self.gpus:
            idx = gpu.index
            if mono < self._retry_at.get(idx, 0.0):
                continue
            t = self._clock()
            row: dict[str, Any] = {"t_ns": t, "gpu": idx}
            try:
                gpu.read(row)
            except TelemetryError as err:
                rows.append({"t_ns": t, "gpu": idx, "error": str(err)})
                self._record_failure(idx, t, str(err), mono)
                continue
            self._record_success(idx, t)
            rows.append(row)
        with self._lock:
            for state in self._windows.values():
                for row in rows:
                    p = row.get("power_w")
                    if p is not None:
                        g = row["gpu"]
                        state.power_sum_w[g] = state.power_sum_w.get(g, 0.0) + p
                        state.power_n[g] = state.power_n.get(g, 0) + 1
        if self._writer is not None and rows:
            self._writer.write(rows)
        self.ticks += 1
        self.rows_written += len(rows)
        return rows

    def _record_failure(self, idx: int, t: int, error: str, mono: float) -> None:
        streak = self._fail_streak.get(idx, 0) + 1
        self._fail_streak[idx] = streak
        backoff = min(self.interval_s * (2 ** (streak - 1)), MAX_RETRY_BACKOFF_S)
        self._retry_at[idx] = mono + backoff
        gap = self._open_gaps.get(idx)
        if gap is None:
            log.warning("GPU %d: %s; recording a gap and retrying", idx, error)
            gap = _Gap(idx, t, t, error)
            self._open_gaps[idx] = gap
            self.gaps.append(gap)
        else:
            gap.end_ns = t
            gap.failed_reads += 1
            gap.error = error

    def _record_success(self, idx: int, t: int) -> None:
        if self._fail_streak.pop(idx, 0):
            self._retry_at.pop(idx, None)
            gap = self._open_gaps.pop(idx, None)
            if gap is not None:
                gap.end_ns = t
                gap.open = False
                log.warning("GPU %d: readable again after %d failed reads", idx, gap.failed_reads)

    # -- windows (zeus-style) ----------------------------------------------------------
    def begin_window(self, name: str) -> None:
        """Start a named window: snapshot time, energy counters and GPM samples now."""
        with self._lock:
            if name in self._windows:
                raise ValueError(f"measurement window {name!r} is already open")
        energy: dict[int, float | None] = {}
        gpm: dict[int, Any] = {}
        for gpu in self.gpus:
            energy[gpu.index] = self._try(gpu.energy_j) if gpu.has_energy_counter else None
            if gpu.gpm_enabled:
                gpm[gpu.index] = self._try(gpu.gpm_snapshot)
        state = _WindowState(self._clock(), energy, gpm, {}, {})
        with self._lock:
            self._windows[name] = state

    def end_window(self, name: str, cancel: bool = False) -> WindowMeasurement:
        """Close a window and return what it measured (``cancel`` discards it)."""
        with self._lock:
            try:
                state = self._windows.pop(name)
            except KeyError:
                raise ValueError(f"measurement window {name!r} was never begun") from None
        end_ns = self._clock()
        duration_s = (end_ns - state.start_ns) / 1e9
        warnings: list[str] = []
        energy_j: dict[int, float | None] = {}
        source: dict[int, str] = {}
        power_mean: dict[int, float | None] = {}
        samples: dict[int, int] = {}
        gpm_out: dict[int, dict[str, float]] = {}
        for gpu in self.gpus:
            g = gpu.index
            snap = state.gpm.get(g)
            if cancel:
                if snap is not None:
                    gpu.gpm_free(snap)
                continue
            n = state.power_n.get(g, 0)
            samples[g] = n
            power_mean[g] = state.power_sum_w[g] / n if n else None
            start_e = state.energy_j.get(g)
            end_e = self._try(gpu.energy_j) if start_e is not None else None
            delta = end_e - start_e if (start_e is not None and end_e is not None) else None
            if delta is not None and delta > 0:
                energy_j[g], source[g] = delta, "counter"
            else:
                power = power_mean[g]
                if power is None:
                    power = self._try(gpu.power_w) if gpu.info.counters.get("power") == "ok" else None
                if power is not None:
                    energy_j[g], source[g] = power * duration_s, "power_x_time"
                    why = "did not move" if delta is not None else "is unavailable"
                    warnings.append(
                        f"GPU {g}: energy counter {why} over window {name!r} ({duration_s:.3f} s); "
                        "energy approximated as power x time"
                    )
                else:
                    energy_j[g], source[g] = None, "none"
                    warnings.append(f"GPU {g}: no energy or power reading for window {name!r}")
            if snap is not None:
                end_snap = self._try(gpu.gpm_snapshot)
                if end_snap is not None:
                    try:
                        gpm_out[g] = gpu.gpm_between(snap, end_snap)
                    except TelemetryError as err:
                        warnings.append(f"GPU {g}: GPM metrics for window {name!r} failed ({err})")
                    gpu.gpm_free(end_snap)
                gpu.gpm_free(snap)
        if not cancel and duration_s < SHORT_WINDOW_S:
            warnings.append(
                f"window {name!r} lasted {duration_s:.3f} s (< {SHORT_WINDOW_S:g} s): "
                "NVML's averaged power lags ~1 s, treat power and energy as approximate"
            )
        for w in warnings:
            log.warning("%s", w)
        if cancel:
            return WindowMeasurement(name, state.start_ns, end_ns)
        return WindowMeasurement(name, state.start_ns, end_ns, energy_j, source, power_mean, samples, gpm_out,
                                 tuple(warnings))

    @staticmethod
    def _try(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except TelemetryError as err:
            log.warning("%s", err)
            return None

    def stats(self) -> dict[str, Any]:
        """The sampler's own bookkeeping, for notes.json (and the overhead benchmark)."""
        wall_s = ((self.stopped_ns or self._clock()) - (self.started_ns or self._clock())) / 1e9
        return {
            "interval_ms": self.interval_s * 1000.0,
            "ticks": self.ticks,
            "rows": self.rows_written,
            "overruns": self.overruns,
            "wall_s": wall_s,
            "tick_time_s": self.tick_time_s,
            "thread_cpu_s": self.thread_cpu_s,
            "cpu_pct_of_one_core": 100.0 * self.thread_cpu_s / wall_s if wall_s > 0 else None,
            "crash": self.crash,
        }
