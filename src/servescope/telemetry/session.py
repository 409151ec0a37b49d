"""A telemetry session: NVML sampler + Prometheus/DCGM scrapers around a benchmark.

``with TelemetrySession(run, TelemetryConfig(...)) as tel:`` starts everything, writes
samples into the run directory as they come (flushed, so Ctrl-C loses nothing already
sampled) and writes ``telemetry/notes.json`` at the start and again at the end.

No NVML (no driver or GPU, as on CI machines): GPU sampling is off with one log line and
a note "telemetry off: ...", and the benchmark goes on. Only a caller that cannot do
without GPUs (the standalone ``servescope telemetry`` command asked for explicit GPUs)
passes ``require_gpus=True`` to get ``NvmlUnavailable`` instead.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servescope import __version__
from servescope.errors import ConfigError, NvmlUnavailable
from servescope.run import GPU_SAMPLES, SERVER_SAMPLES, TELEMETRY_NOTES, RunDir, now_ns
from servescope.telemetry.nvml import Nvml, NvmlGpu, describe_gpus, parse_gpu_list
from servescope.telemetry.prometheus import PrometheusScraper, ServerSampleWriter, metrics_url
from servescope.telemetry.sampler import MIN_INTERVAL_MS, GpuSampler, GpuSampleWriter, WindowMeasurement

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TelemetryConfig:
    """What to sample and how often.

    ``gpus`` is "all" or NVML indices (a tuple, or text like "0,1"); ``interval_ms`` the
    NVML sampling period (>= 10 ms); ``server_metrics_url`` the inference server's
    Prometheus endpoint; ``dcgm_urls`` DCGM exporters of GPUs on other hosts;
    ``server_interval_ms`` the scrape period of those endpoints (>= 100 ms).
    ``max_running_requests`` is the server's scheduler ceiling when the caller knows it
    (e.g. the launcher passed ``--max-num-seqs``): vLLM does not export it.
    """

    gpus: str | tuple[int, ...] = "all"
    interval_ms: float = 100
    server_metrics_url: str | None = None
    dcgm_urls: tuple[str, ...] = ()
    server_interval_ms: float = 1000
    max_running_requests: int | None = field(default=None)

    def __post_init__(self) -> None:
        if self.interval_ms < MIN_INTERVAL_MS:
            raise ConfigError(f"--interval-ms {self.interval_ms:g} is below the {MIN_INTERVAL_MS:g} ms minimum")
        if self.server_interval_ms < 100:
            raise ConfigError(f"server metrics interval {self.server_interval_ms:g} ms is below the 100 ms minimum")
        if isinstance(self.gpus, str):
            if self.gpus.strip().lower() != "all":
                object.__setattr__(self, "gpus", tuple(parse_gpu_list(self.gpus)))
        else:
            object.__setattr__(self, "gpus", tuple(int(g) for g in self.gpus))
        if self.server_metrics_url is not None:
            metrics_url(self.server_metrics_url)  # validates
        object.__setattr__(self, "dcgm_urls", tuple(self.dcgm_urls))
        for u in self.dcgm_urls:
            metrics_url(u)

    @property
    def explicit_gpus(self) -> bool:
        return self.gpus != "all"

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus if isinstance(self.gpus, str) else list(self.gpus),
            "interval_ms": self.interval_ms,
            "server_metrics_url": self.server_metrics_url,
            "dcgm_urls": list(self.dcgm_urls),
            "server_interval_ms": self.server_interval_ms,
            "max_running_requests": self.max_running_requests,
        }


class TelemetrySession:
    """Starts the sampler and scrapers on ``__enter__``, stops them cleanly on ``__exit__``.

    ``nvml_lib`` replaces pynvml (tests pass ``fake_nvml.FakeNvml``; the GPU benchmark a
    ``RecordingNvml``). Windows (``begin_window`` / ``end_window``) measure energy and GPM
    metrics between two instants, one per sweep point.
    """

    def __init__(self, run: RunDir, config: TelemetryConfig, *, nvml_lib: Any = None,
                 require_gpus: bool = False) -> None:
        self.run = run
        self.config = config
        self._lib = nvml_lib
        self._require = require_gpus
        self._nvml: Nvml | None = None
        self._gpus: list[NvmlGpu] = []
        self.sampler: GpuSampler | None = None
        self._gpu_writer: GpuSampleWriter | None = None
        self._server_writer: ServerSampleWriter | None = None
        self.scrapers: list[PrometheusScraper] = []
        self.gpu_status = "not started"
        self.windows: list[WindowMeasurement] = []
        self._started = False
        self._stopped = False
        self._started_ns: int | None = None
        self._off_windows: dict[str, int] = {}  # windows opened while GPU telemetry is off

    # -- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> TelemetrySession:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self._started:
            raise RuntimeError("telemetry session already started")
        self._started = True
        self._started_ns = now_ns()
        try:
            self._start_gpus()
            self._start_scrapers()
        except BaseException:
            self.stop()
            raise
        self._write_notes(final=False)

    def _start_gpus(self) -> None:
        try:
            self._nvml = Nvml(self._lib)
        except NvmlUnavailable as err:
            if self._require:
                raise
            self.gpu_status = f"telemetry off: {err}"
            log.warning("GPU %s; the benchmark goes on without GPU telemetry", self.gpu_status)
            return
        indices = self._nvml.resolve(self.config.gpus)
        self._gpus = self._nvml.open_gpus(indices)
        self._gpu_writer = GpuSampleWriter(self.run.file(GPU_SAMPLES))
        self.sampler = GpuSampler(self._gpus, self.config.interval_ms, self._gpu_writer)
        self.sampler.start()
        self.gpu_status = "on"
        log.info("sampling %d GPU(s) every %g ms", len(self._gpus), self.config.interval_ms)

    def _start_scrapers(self) -> None:
        targets = []
        if self.config.server_metrics_url:
            targets.append((self.config.server_metrics_url, "server"))
        targets += [(u, "dcgm") for u in self.config.dcgm_urls]
        if not targets:
            return
        self._server_writer = ServerSampleWriter(self.run.file(SERVER_SAMPLES))
        for url, kind in targets:
            s = PrometheusScraper(url, kind, self._server_writer, self.config.server_interval_ms)
            s.start()
            self.scrapers.append(s)

    def stop(self) -> None:
        """Stop sampling and scraping, close files, write the final notes. Idempotent."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        if self.sampler is not None:
            self.sampler.stop()
        for s in self.scrapers:
            s.stop()
        for g in self._gpus:
            g.close()
        if self._nvml is not None:
            self._nvml.close()
        if self._gpu_writer is not None:
            self._gpu_writer.close()
        if self._server_writer is not None:
            self._server_writer.close()
        self._write_notes(final=True)

    # -- windows ----------------------------------------------------------------------
    def begin_window(self, name: str) -> None:
        """Start a named window (see ``GpuSampler.begin_window``); a no-op record without GPUs."""
        if self.sampler is not None:
            self.sampler.begin_window(name)
        else:
            if name in self._off_windows:
                raise ValueError(f"measurement window {name!r} is already open")
            self._off_windows[name] = now_ns()

    def end_window(self, name: str, cancel: bool = False) -> WindowMeasurement:
        if self.sampler is not None:
            m = self.sampler.end_window(name, cancel=cancel)
        else:
            try:
                start = self._off_windows.pop(name)
            except KeyError:
                raise ValueError(f"measurement window {name!r} was never begun") from None
            m = WindowMeasurement(name, start, now_ns(), warnings=(f"no GPU telemetry: {self.gpu_status}",))
        if not cancel:
            self.windows.append(m)
        return m

    # -- notes ------------------------------------------------------------------------
    @property
    def gpu_info(self) -> list[dict[str, Any]]:
        return [g.info.to_dict() for g in self._gpus]

    def server_ceiling(self) -> dict[str, Any] | None:
        for s in self.scrapers:
            if s.kind == "server" and s.ceiling:
                return dict(s.ceiling)
        if self.config.max_running_requests is not None:
            return {"max_running_requests": self.config.max_running_requests, "source": "configured by caller"}
        return None

    def _write_notes(self, final: bool) -> None:
        dropped = [{"gpu": g.index, "counter": c, "reason": r} for g in self._gpus for c, r in g.dropped]
        skipped = [
            {"gpu": g.index, "counter": c, "reason": status}
            for g in self._gpus for c, status in g.info.counters.items() if status != "ok"
        ]
        notes: dict[str, Any] = {
            "final": final,
            "started_ns": self._started_ns,
            "ended_ns": now_ns() if final else None,
            "config": self.config.to_dict(),
            "gpu_telemetry": self.gpu_status,
            "gpus": self.gpu_info,
            "skipped_counters": skipped,
            "dropped_counters": dropped,
            "gaps": [g.to_dict() for g in self.sampler.gaps] if self.sampler else [],
            "sampler": self.sampler.stats() if (self.sampler and final) else None,
            "sampler_crash": self.sampler.crash if self.sampler else None,
            "endpoints": [s.notes() for s in self.scrapers],
            "endpoint_failures": [s.failures.to_dict() for s in self.scrapers if s.failures.count],
            "server_ceiling": self.server_ceiling(),
            "windows": [w.to_dict() for w in self.windows],
        }
        self.run.write_json(TELEMETRY_NOTES, notes)


def create_telemetry_run(path: str | Path, config: TelemetryConfig, *, require_gpus: bool = False,
                         extra_config: dict[str, Any] | None = None, nvml_lib: Any = None) -> RunDir:
    """Check what can be sampled, then create a run directory for a standalone telemetry recording.

    Checked first, so that a refused request leaves no half-made directory: with
    ``require_gpus`` NVML must work, and explicit GPU indices must exist.
    """
    gpus = describe_gpus(nvml_lib)
    if require_gpus and not gpus:
        raise NvmlUnavailable(
            "NVML is unavailable here (no NVIDIA driver or GPU); to sample only server metrics, "
            "give --server-metrics or --dcgm URLs without --gpus"
        )
    if config.explicit_gpus and gpus:
        known = {g["index"] for g in gpus}
        bad = [i for i in config.gpus if i not in known]
        if bad:
            raise ConfigError(f"GPU {bad[0]} not found: NVML sees GPU(s) {sorted(known)}")
    return RunDir.create(
        path,
        config={"command": "telemetry", "telemetry": config.to_dict(), **(extra_config or {})},
        env={"host": platform.node(), "python": platform.python_version(), "servescope": __version__, "gpus": gpus},
    )
