"""The main job: sweep + telemetry + roofline + diagnosis + report into one run directory.

``run_job`` is what ``servescope run`` calls. It is the one place that wires the
measuring side (engine, load, telemetry) to the analysing side (roofline, diagnose,
report); each stage writes its files before the next starts, so an interrupted job
still leaves a run directory that ``servescope diagnose`` / ``report`` can finish.

With no ``url`` it starts the embedded engine: a real ``transformers serve`` (or vLLM)
on loopback serving a tiny random MoE model built locally, so the whole product runs on
a fresh machine with no GPU and no model hub.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from servescope import __version__
from servescope.errors import ConfigError, ServescopeError
from servescope.run import ROOFLINE, RunDir

log = logging.getLogger(__name__)

Event = Callable[[str], None]


@dataclass(frozen=True)
class JobConfig:
    """Everything ``servescope run`` was asked to do. Never holds an API key (that stays in memory)."""

    out: Path | None = None
    url: str | None = None
    backend: str = "openai"
    served_model: str | None = None
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    input_len: int = 128
    output_len: int = 64
    num_prompts: int | None = None  # per point; default max(4 x concurrency, 16)
    duration_s: float | None = None
    warmup: int | None = None
    seed: int = 0
    timeout_s: float = 300.0
    # embedded engine (used when url is None)
    engine: str = "transformers"
    device: str = "cpu"
    engine_args: tuple[str, ...] = ()
    engine_python: str | None = None
    # analytical side
    model: str | None = None  # catalog name or config path for the roofline
    gpu: str | None = None  # catalog name; default: what NVML reports
    dtype: str | None = None
    tp: int = 1
    ep: int = 1
    context_len: int | None = None
    calibrate: Path | None = None  # `servescope kernels --out` results: measured expert-GEMM efficiency
    # telemetry
    telemetry: bool = True
    gpus: str = "all"
    interval_ms: float = 100.0
    server_metrics: str | None = None
    dcgm: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.concurrency or any(c <= 0 for c in self.concurrency):
            raise ConfigError("--concurrency needs positive integers, e.g. 1,2,4,8")
        if self.input_len <= 0 or self.output_len <= 0:
            raise ConfigError("--input-len and --output-len must be positive")
        if self.num_prompts is not None and self.num_prompts <= 0:
            raise ConfigError("--num-prompts must be positive")
        if self.num_prompts is not None and self.duration_s is not None:
            raise ConfigError("give --num-prompts or --duration, not both")
        if self.tp <= 0 or self.ep <= 0:
            raise ConfigError("--tp and --ep must be positive")
        if self.engine not in ("transformers", "vllm"):
            raise ConfigError(f"--engine must be 'transformers' or 'vllm', not {self.engine!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be 'cpu' or 'cuda', not {self.device!r}")
        if self.url is not None and self.engine_args:
            raise ConfigError("--engine-arg applies to the embedded engine only; drop it or drop --url")


@dataclass
class JobResult:
    run_dir: Path
    headline: str = ""
    reports: dict[str, Path] = field(default_factory=dict)
    interrupted: bool = False


def default_out_dir() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"run-{stamp}"


def _environment(extra: dict[str, Any]) -> dict[str, Any]:
    env: dict[str, Any] = {
        "servescope_version": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": platform.node(),
    }
    try:
        from servescope.telemetry.nvml import describe_gpus

        env["gpus"] = describe_gpus()
    except (ImportError, ServescopeError) as err:  # telemetry optional: a CPU machine has no NVML
        env["gpus"] = []
        env["gpus_note"] = str(err)
    env.update(extra)
    return env


@contextlib.contextmanager
def _target(cfg: JobConfig, out: Path, emit: Event) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """Yield (base_url, served_model, engine_info): the user's server, or an embedded one we start."""
    if cfg.url is not None:
        yield cfg.url, cfg.served_model, {}
        return
    from servescope.engine.launcher import EngineConfig, start_engine
    from servescope.engine.tiny_model import TinyMoeSpec, build_tiny_moe

    spec = TinyMoeSpec.gpu() if cfg.device == "cuda" else TinyMoeSpec()
    emit(f"building the tiny random MoE model ({'GPU' if cfg.device == 'cuda' else 'CPU'} preset, cached)")
    model_dir = build_tiny_moe(spec)
    out.mkdir(parents=True, exist_ok=True)
    ecfg = EngineConfig(kind=cfg.engine, model_dir=model_dir, device=cfg.device, extra_args=cfg.engine_args,
                        log_path=out / "engine.log")
    if cfg.engine_python:
        ecfg = replace(ecfg, python=cfg.engine_python)
    emit(f"starting embedded engine: {cfg.engine} on {cfg.device}")
    with start_engine(ecfg) as eng:
        emit(f"engine ready at {eng.base_url} (log: {eng.log_path})")
        info = {
            "kind": cfg.engine,
            "device": cfg.device,
            "model_dir": str(model_dir),
            "command": list(eng.command),
            "extra_args": list(cfg.engine_args),
            "log_path": str(eng.log_path),
            "startup_s": eng.startup_s,
            "metrics_url": eng.metrics_url,
        }
        yield eng.base_url, eng.served_model, info


def _analytical_inputs(
    cfg: JobConfig, engine_info: dict[str, Any], env: dict[str, Any]
) -> tuple[Any, Any, str | None]:
    """Pick the model and GPU the roofline describes: flags first, then the served model and NVML's GPU."""
    from servescope import hardware, models

    model = None
    if cfg.model:
        model = models.get_model(cfg.model)
    elif engine_info.get("model_dir"):
        model = models.get_model(engine_info["model_dir"])
    gpu = None
    if cfg.gpu:
        gpu = hardware.get_gpu(cfg.gpu)
    else:
        names = [g.get("name") for g in env.get("gpus", []) if isinstance(g, dict) and g.get("name")]
        if names:
            try:
                gpu = hardware.get_gpu(names[0])
            except ServescopeError as err:
                log.warning("GPU %r is not in the catalog (%s); roofline skipped", names[0], err)
    return model, gpu, cfg.dtype  # None keeps the model's own per-component formats


def write_roofline(run: RunDir, cfg: JobConfig, model: Any, gpu: Any, dtype: str | None) -> Path | None:
    """Write roofline.json for the swept concurrencies, when a model and a GPU are known."""
    if model is None or gpu is None:
        return None
    from servescope import roofline

    context = cfg.context_len or (cfg.input_len + cfg.output_len // 2)
    efficiency = None
    calibration: dict[str, Any] | None = None
    if cfg.calibrate is not None:
        from servescope.kernels.calibration import load_calibration

        cal = load_calibration(cfg.calibrate)
        efficiency = cal.efficiency
        calibration = {"source": str(cfg.calibrate), "basis": getattr(cal, "basis", None)}
    sweep = roofline.build_sweep(
        model, gpu, dtype=dtype, tp=cfg.tp, ep=cfg.ep, concurrencies=list(cfg.concurrency), context_len=context,
        efficiency=efficiency,
    )
    data = sweep.to_dict()
    data["calibration"] = calibration  # None: the ideal roofline (every GEMM at its attainable rate)
    return run.write_json(ROOFLINE, data)


def run_job(
    cfg: JobConfig,
    emit: Event | None = None,
    api_key: str | None = None,
    sweep_hook: Callable[[str, dict[str, Any]], None] | None = None,
) -> JobResult:
    """Run the whole job. Each stage writes its files before the next; on Ctrl-C what was recorded stays.

    ``emit`` receives the job's own one-line messages; ``sweep_hook`` the load generator's
    structured events (progress, point ends) for a live display.
    """
    emit = emit or (lambda _msg: None)
    cfg.validate()
    out = Path(cfg.out) if cfg.out else default_out_dir()
    from servescope.load.sweep import SweepConfig, run_sweep

    result = JobResult(run_dir=out)
    if (out / "config.json").exists():
        raise ConfigError(f"{out} already holds a run; choose a new --out directory")
    with _target(cfg, out, emit) as (base_url, served_model, engine_info):
        env = _environment({"engine": engine_info} if engine_info else {})
        config = {
            "command": "run",
            "tool_version": __version__,
            "target": {"url": base_url, "backend": cfg.backend, "served_model": served_model,
                       "embedded": cfg.url is None},
            "engine": engine_info,
            "job": {k: (list(v) if isinstance(v, tuple) else (str(v) if isinstance(v, Path) else v))
                    for k, v in asdict(cfg).items()},
        }
        run = RunDir.create(out, config, env)
        emit(f"run directory: {out}")
        sweep_cfg = SweepConfig(
            url=base_url,
            backend=cfg.backend,
            model=served_model,
            concurrencies=tuple(cfg.concurrency),
            prompts_per_concurrency=None if (cfg.num_prompts or cfg.duration_s) else 4,
            input_len=cfg.input_len,
            output_len=cfg.output_len,
            num_prompts=cfg.num_prompts,
            duration_s=cfg.duration_s,
            warmup=cfg.warmup,
            seed=cfg.seed,
            timeout_s=cfg.timeout_s,
            tokenizer=engine_info.get("model_dir"),
            api_key=api_key,
        )
        telemetry_ctx: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if cfg.telemetry:
            from servescope.telemetry.session import TelemetryConfig, TelemetrySession

            gpus = cfg.gpus if cfg.gpus == "all" else tuple(int(x) for x in cfg.gpus.split(","))
            telemetry_ctx = TelemetrySession(
                run,
                TelemetryConfig(gpus=gpus, interval_ms=cfg.interval_ms,
                                server_metrics_url=cfg.server_metrics or engine_info.get("metrics_url"),
                                dcgm_urls=tuple(cfg.dcgm)),
            )
        try:
            with telemetry_ctx:
                summary = run_sweep(run, sweep_cfg, on_event=sweep_hook)
            # The sweep handles SIGINT itself (records in-flight requests as cancelled) and returns.
            result.interrupted = bool(summary.get("interrupted"))
            if result.interrupted:
                emit("interrupted: finishing the report from what was recorded")
        except KeyboardInterrupt:
            result.interrupted = True
            emit("interrupted: finishing the report from what was recorded")
    _finish(run, cfg, env, engine_info, result, emit)
    if result.interrupted:
        raise KeyboardInterrupt
    return result


def _finish(run: RunDir, cfg: JobConfig, env: dict[str, Any], engine_info: dict[str, Any], result: JobResult,
            emit: Event) -> None:
    """Analysis stages: summaries, roofline, diagnosis, report. Each reads only the run directory.

    A stage that fails on bad data is reported and skipped, so the stages after it still
    run: the report of a damaged run says what is missing instead of not existing.
    """
    from servescope.diagnose import write_diagnosis
    from servescope.load.metrics import summarize_run
    from servescope.report import write_reports

    def stage(name: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ServescopeError as err:
            emit(f"{name} skipped: {err}")
            return None

    if not run.exists("summary.json"):  # the sweep writes it after each point; missing only if it never finished one
        stage("load summary", lambda: summarize_run(run))
    if cfg.telemetry:
        from servescope.telemetry.timeline import summarize as summarize_telemetry

        stage("telemetry summary", lambda: summarize_telemetry(run))

    def roofline_stage() -> None:
        model, gpu, dtype = _analytical_inputs(cfg, engine_info, env)
        if write_roofline(run, cfg, model, gpu, dtype) is None:
            emit("roofline skipped: no GPU known (give --gpu NAME to model one)")

    stage("roofline", roofline_stage)
    stage("diagnosis", lambda: write_diagnosis(run))
    result.reports = stage("report", lambda: write_reports(run)) or {}
    result.headline = (run.read_json("diagnosis.json", default={}) or {}).get("headline", "")
