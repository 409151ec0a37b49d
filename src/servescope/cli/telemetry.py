"""``servescope telemetry``: sample GPUs (and optionally a server's /metrics) on their own.

Thin: parse flags, create the run directory (``create_telemetry_run``), run a
``TelemetrySession`` for the duration (or until Ctrl-C), summarise with
``timeline.summarize``, print.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the servescope app."""

    @app.command("telemetry")
    def telemetry(
        gpus: Annotated[str, typer.Option("--gpus", help="'all' or NVML indices, e.g. '0,1'.")] = "all",
        interval_ms: Annotated[float, typer.Option("--interval-ms", help="NVML sampling period (>= 10 ms).")] = 100.0,
        duration: Annotated[
            float | None, typer.Option("--duration", help="Seconds to sample; without it, sample until Ctrl-C.")
        ] = None,
        out: Annotated[
            Path | None, typer.Option("--out", help="Run directory to create (default: ./telemetry-YYYYmmdd-HHMMSS).")
        ] = None,
        server_metrics: Annotated[
            str | None,
            typer.Option("--server-metrics", help="The inference server's Prometheus URL, e.g. http://host:8000/metrics."),
        ] = None,
        dcgm: Annotated[list[str] | None, typer.Option("--dcgm", help="A DCGM exporter URL (repeatable).")] = None,
        server_interval_ms: Annotated[
            float, typer.Option("--server-interval-ms", help="Scrape period of the metrics URLs.")
        ] = 1000.0,
        as_json: Annotated[bool, typer.Option("--json", help="Print the telemetry summary as JSON.")] = False,
    ) -> None:
        """Sample GPU power, clocks, utilisation and GPM activity (and server metrics) into a run directory."""
        from servescope.errors import ConfigError
        from servescope.telemetry.session import TelemetryConfig, TelemetrySession, create_telemetry_run
        from servescope.telemetry.timeline import summarize

        if duration is not None and duration <= 0:
            raise ConfigError("--duration must be positive")
        config = TelemetryConfig(gpus=gpus, interval_ms=interval_ms, server_metrics_url=server_metrics,
                                 dcgm_urls=tuple(dcgm or ()), server_interval_ms=server_interval_ms)
        # Without a URL there is nothing to sample but GPUs; explicit --gpus also means "I need them".
        require = config.explicit_gpus or not (server_metrics or dcgm)
        path = out or Path(f"telemetry-{datetime.now():%Y%m%d-%H%M%S}")
        run = create_telemetry_run(path, config, require_gpus=require,
                                   extra_config={"argv": sys.argv[1:], "duration_s": duration})
        interrupted = False
        typer.echo(f"sampling into {run.path} ...", err=True)
        try:
            with TelemetrySession(run, config, require_gpus=require):
                if duration is None:
                    while True:
                        time.sleep(3600)
                time.sleep(duration)
        except KeyboardInterrupt:
            interrupted = True
        summary = summarize(run)
        if as_json:
            typer.echo(json.dumps(summary, indent=2))
        else:
            _print_table(summary)
            typer.echo(str(run.path))
        if interrupted and duration is not None:
            raise typer.Exit(130)


def _print_table(summary: dict) -> None:
    whole = summary.get("run") or {}
    typer.echo(f"GPU telemetry: {summary.get('gpu_telemetry')}")
    for g, s in sorted((whole.get("gpus") or {}).items()):
        parts = [f"GPU {g}: {s.get('samples', 0)} samples"]
        for key, fmt in (("power_w_mean", "{:.0f} W"), ("power_limit_pct", "{:.0f}% of limit"),
                         ("sm_clock_mhz_mean", "SM {:.0f} MHz"), ("gpu_util_pct_mean", "util {:.0f}%"),
                         ("gpm_tensor_active_pct_mean", "tensor {:.1f}%"), ("gpm_dram_bw_pct_mean", "DRAM {:.1f}%"),
                         ("energy_j", "{:.0f} J")):
            if s.get(key) is not None:
                parts.append(fmt.format(s[key]))
        typer.echo(", ".join(parts))
    server = whole.get("server")
    if server:
        typer.echo("server: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in server.items()))
    for w in summary.get("warnings", []) + whole.get("warnings", []):
        typer.echo(f"warning: {w}", err=True)
