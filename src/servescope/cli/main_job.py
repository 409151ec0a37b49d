"""``servescope run`` (the main job), ``diagnose``, ``report`` and ``compare``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from servescope.errors import ConfigError


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from err
    if not values:
        raise ConfigError(f"{flag} is empty")
    return values


def _emit(msg: str) -> None:
    typer.echo(f"servescope: {msg}", err=True)


def register(app: typer.Typer) -> None:
    """Add run, diagnose, report and compare to the servescope app."""

    @app.command("run")
    def run_cmd(
        url: str | None = typer.Option(None, "--url", help="Server base URL. Omit to start the embedded engine."),
        backend: str = typer.Option("openai", help="API: openai | openai-chat | sglang."),
        served_model: str | None = typer.Option(None, "--served-model", help="Model name to put in requests."),
        concurrency: str = typer.Option("1,2,4,8,16", help="Closed-loop concurrency ladder, comma-separated."),
        input_len: int = typer.Option(128, help="Prompt length in tokens."),
        output_len: int = typer.Option(64, help="Output length in tokens."),
        num_prompts: int | None = typer.Option(None, help="Measured requests per point (default 4x concurrency)."),
        duration: float | None = typer.Option(None, "--duration", help="Seconds per point instead of a count."),
        warmup: int | None = typer.Option(None, help="Warm-up requests per point (default: the concurrency)."),
        seed: int = typer.Option(0, help="Seed for prompts."),
        timeout_s: float = typer.Option(300.0, "--timeout-s", help="Per-request time limit."),
        engine: str = typer.Option("transformers", help="Embedded engine: transformers | vllm."),
        device: str = typer.Option("cpu", help="Embedded engine device: cpu | cuda."),
        engine_arg: list[str] = typer.Option(  # noqa: B008
            [], "--engine-arg", help="Extra flag for the embedded engine (repeat), e.g. --engine-arg=--cb-num-blocks=8"
        ),
        engine_python: str | None = typer.Option(None, help="Python that has the engine installed (vLLM)."),
        model: str | None = typer.Option(None, help="Model for the roofline (catalog name or config path)."),
        model_config: Path | None = typer.Option(None, help="Path to the served model's config.json."),  # noqa: B008
        gpu: str | None = typer.Option(None, help="GPU for the roofline (catalog name); default: NVML's."),
        dtype: str | None = typer.Option(None, help="Expert weight dtype for the roofline."),
        calibrate: Path | None = typer.Option(  # noqa: B008
            None, help="`servescope kernels --out` results: use measured expert-GEMM efficiency in the roofline."
        ),
        tp: int = typer.Option(1, help="Tensor-parallel degree (roofline)."),
        ep: int = typer.Option(1, help="Expert-parallel degree (roofline)."),
        telemetry: bool = typer.Option(True, "--telemetry/--no-telemetry", help="Sample NVML and server metrics."),
        gpus: str = typer.Option("all", help="GPUs to sample: all or indices 0,1."),
        interval_ms: float = typer.Option(100.0, help="NVML sampling interval."),
        server_metrics: str | None = typer.Option(None, help="Server Prometheus /metrics URL."),
        dcgm: list[str] = typer.Option([], help="DCGM exporter URL (repeat)."),  # noqa: B008
        api_key: str | None = typer.Option(None, help="API key (or SERVESCOPE_API_KEY / OPENAI_API_KEY)."),
        out: Path | None = typer.Option(None, help="Run directory (default runs/run-<time>)."),  # noqa: B008
    ) -> None:
        """The main job: sweep + telemetry + roofline + diagnosis + report in one run directory."""
        from servescope.job import JobConfig, run_job

        if model and model_config:
            raise ConfigError("give --model or --model-config, not both")
        cfg = JobConfig(
            out=out, url=url, backend=backend, served_model=served_model,
            concurrency=_ints(concurrency, "--concurrency"), input_len=input_len, output_len=output_len,
            num_prompts=num_prompts, duration_s=duration, warmup=warmup, seed=seed, timeout_s=timeout_s,
            engine=engine, device=device, engine_args=tuple(engine_arg), engine_python=engine_python,
            model=str(model_config) if model_config else model, gpu=gpu, dtype=dtype, tp=tp, ep=ep, calibrate=calibrate,
            telemetry=telemetry, gpus=gpus, interval_ms=interval_ms, server_metrics=server_metrics, dcgm=tuple(dcgm),
        )
        key = api_key or os.environ.get("SERVESCOPE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        from servescope.cli.bench import _Printer as SweepPrinter

        result = run_job(cfg, emit=_emit, api_key=key, sweep_hook=SweepPrinter())
        _emit(f"diagnosis: {result.headline}")
        for name, path in sorted(result.reports.items()):
            _emit(f"{name}: {path}")
        typer.echo(str(result.run_dir))

    @app.command("diagnose")
    def diagnose_cmd(
        run_dir: Path = typer.Argument(..., help="A run directory."),  # noqa: B008
        as_json: bool = typer.Option(False, "--json", help="Print diagnosis.json to stdout."),
    ) -> None:
        """Diagnose a run directory (reads only its files) and write diagnosis.json."""
        from servescope.diagnose import diagnose
        from servescope.run import DIAGNOSIS, RunDir

        run = RunDir.open(run_dir)
        result = diagnose(run)
        run.write_json(DIAGNOSIS, result.to_dict())
        if as_json:
            typer.echo(json.dumps(result.to_dict(), indent=2))
            return
        typer.echo(result.headline)
        for f in result.findings:
            typer.echo(f"[{f.severity}/{f.confidence}] {f.title}: {f.verdict}")
            for rec in f.recommendations:
                typer.echo(f"    try: {rec}")
        for note in result.notes:
            typer.echo(f"note: {note}")

    @app.command("report")
    def report_cmd(run_dir: Path = typer.Argument(..., help="A run directory.")) -> None:  # noqa: B008
        """(Re)build report.html and report.md from a run directory (diagnosing it first)."""
        from servescope.diagnose import write_diagnosis
        from servescope.report import write_reports
        from servescope.run import RunDir

        run = RunDir.open(run_dir)
        write_diagnosis(run)
        for name, path in sorted(write_reports(run).items()):
            typer.echo(f"{name}: {path}")

    @app.command("compare")
    def compare_cmd(
        run_a: Path = typer.Argument(..., help="The 'before' run directory."),  # noqa: B008
        run_b: Path = typer.Argument(..., help="The 'after' run directory."),  # noqa: B008
        as_json: bool = typer.Option(False, "--json", help="JSON instead of a Markdown table."),
    ) -> None:
        """Compare two runs point by point (before / after, with ratios)."""
        from servescope.report.compare import compare_runs
        from servescope.run import RunDir

        result = compare_runs(RunDir.open(run_a), RunDir.open(run_b))
        typer.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.to_markdown())
