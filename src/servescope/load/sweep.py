"""The sweep: one run directory, a ladder of load points, records written as they happen.

``run_sweep(run, cfg)`` is the library entry of ``servescope bench`` and ``servescope run``.
For each point it prepares prompts and request bytes first (off the hot path), runs a
warm-up that flows straight into the measured requests under the same load limit (so
the measured phase starts with the target load already in flight, and the warm-up
respects ``--max-concurrency``, unlike sglang#39398), appends a ``RequestRecord`` line
per finished request, a ``PointRecord`` per point, and rewrites ``summary.json`` from
the files (``metrics.summarize_run``). A crash or Ctrl-C loses nothing already received:
in-flight requests are recorded as ``cancelled`` with the chunks they had.

A point runs in this process (``driver.drive``), or, with ``workers`` > 1, split over that
many client processes (``load/workers.py``) whose records this process alone writes.

Before the first point one probe request negotiates the options the server accepts
(``stream_options.include_usage`` / ``continuous_usage_stats``, ``ignore_eos``,
``min_tokens``): a 400/422 drops the option the error names (or the next one) and the
probe is retried; every dropped option is noted in the points' ``extra`` and the summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from servescope.errors import ConfigError, TargetError, TargetHTTPStatus, TargetTimeout, TargetUnreachable
from servescope.load import metrics
from servescope.load.backends import DROPPABLE, OPTION_HINTS, Backend, Prompt, RequestOptions, get_backend
from servescope.load.client import Endpoint, StreamingClient, StreamResult, build_request, new_event_loop
from servescope.load.driver import LocalGate, PointState, Slice, Stop, client_check, drive, gc_frozen, lag_monitor
from servescope.load.records import PointRecord
from servescope.load.schedule import ClosedLoop, OpenLoop, arrival_offsets_ns
from servescope.load.workers import PointPlan, WorkerPool, closed_slices, open_slices, parse_workers, resolve_workers
from servescope.load.workload import LocalTokenizer, ServerTokenizer, Tokenizer, WorkloadConfig, make_prompts
from servescope.run import POINTS, REQUESTS, JsonlWriter, RunDir, now_ns

log = logging.getLogger(__name__)

EventHook = Callable[[str, dict[str, Any]], None]

#: Duration-bounded points cycle through a pool of this many prompts beyond the warm-up (at least 4 x concurrency).
DURATION_POOL = 512
#: Auto-stop: throughput step efficiency below this while median E2EL grew by this factor.
AUTO_STOP_EFFICIENCY = metrics.KNEE_EFFICIENCY
AUTO_STOP_LATENCY_GROWTH = 1.2


@dataclass(frozen=True)
class SweepConfig:
    """Everything a sweep needs. ``api_key`` is sent, never written (``to_config`` drops it)."""

    url: str
    backend: str = "openai"
    model: str | None = None
    concurrencies: tuple[int, ...] = (1,)
    request_rates: tuple[float, ...] = ()  # open loop when given (each rate is a point)
    burstiness: float = 1.0
    max_concurrency: int | None = None  # cap in flight in open loop
    input_len: int = 128
    output_len: int | None = 128
    dataset: str = "random"
    range_convention: str = "fixed"
    range_ratio: float = 0.0
    seed: int = 0
    num_prompts: int | None = None
    #: measured requests per point = this x the point's concurrency (when --num-prompts is not given)
    prompts_per_concurrency: int | None = None
    duration_s: float | None = None
    warmup: int | None = None  # default: the concurrency (closed loop) or ~1 s of arrivals (open loop)
    slo: dict[str, float] | None = None
    api_key: str | None = field(default=None, repr=False)
    tokenizer: str | None = None
    timeout_s: float = 60.0
    auto_stop: bool = False
    ignore_eos: bool = True
    min_tokens: bool = False
    temperature: float | None = 0.0
    telemetry: bool = False
    telemetry_gpus: str = "all"
    telemetry_interval_ms: int = 100
    server_metrics_url: str | None = None
    dcgm_urls: tuple[str, ...] = ()
    #: client processes per point: an integer, or "auto" (one per ``workers.STREAMS_PER_WORKER`` streams);
    #: never more than the point's concurrency (closed loop) or ``max_concurrency`` (open loop).
    workers: int | str = 1

    def validate(self) -> None:
        parse_workers(self.workers)
        if self.backend not in ("openai", "openai-chat", "sglang"):
            raise ConfigError(f"--backend {self.backend!r}: choose openai, openai-chat or sglang")
        Endpoint.parse(self.url)
        if self.request_rates:
            if any(not (r > 0) for r in self.request_rates):
                raise ConfigError("--request-rate values must be > 0 (inf for all at once)")
            if self.burstiness <= 0:
                raise ConfigError("--burstiness must be > 0")
        elif not self.concurrencies or any(c < 1 for c in self.concurrencies):
            raise ConfigError("--concurrency needs one or more integers >= 1, e.g. 1,2,4")
        if self.num_prompts is not None and self.duration_s is not None:
            raise ConfigError("give --num-prompts or --duration, not both")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ConfigError("--num-prompts must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ConfigError("--duration must be > 0 seconds")
        if self.warmup is not None and self.warmup < 0:
            raise ConfigError("--warmup must be >= 0")
        if self.timeout_s <= 0:
            raise ConfigError("--timeout-s must be > 0")
        self.workload().validate()

    def workload(self, seed_offset: int = 0) -> WorkloadConfig:
        return WorkloadConfig(self.dataset, self.input_len, self.output_len, self.range_convention,
                              self.range_ratio, self.seed * 1_000_003 + seed_offset)

    def schedules(self) -> list[ClosedLoop | OpenLoop]:
        if self.request_rates:
            return [OpenLoop(r, self.burstiness, self.max_concurrency) for r in self.request_rates]
        return [ClosedLoop(c) for c in self.concurrencies]

    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` view: everything asked for, never the API key."""
        d = asdict(self)
        d.pop("api_key", None)
        d["api_key_set"] = self.api_key is not None
        d["concurrencies"] = list(self.concurrencies)
        d["request_rates"] = [r if math.isfinite(r) else "inf" for r in self.request_rates]
        d["dcgm_urls"] = list(self.dcgm_urls)
        return d


def run_sweep(run: RunDir, cfg: SweepConfig, on_event: EventHook | None = None) -> dict[str, Any]:
    """Run every point of ``cfg`` into ``run``; return the summary (also in ``summary.json``).

    The summary has ``interrupted: True`` when Ctrl-C stopped the sweep; the caller maps
    that to exit code 130. Telemetry (``--telemetry`` / ``--server-metrics`` / ``--dcgm``)
    wraps the whole sweep when asked for.
    """
    cfg.validate()
    hook = on_event or (lambda kind, data: None)
    with _telemetry(run, cfg):
        summary = _run_loop(run, cfg, hook)
    if _telemetry_wanted(cfg):
        try:
            from servescope.telemetry.timeline import summarize as telemetry_summarize
        except ImportError as err:
            raise ConfigError("telemetry timeline is not available in this servescope build") from err
        telemetry_summarize(run)
    return summary


def _telemetry_wanted(cfg: SweepConfig) -> bool:
    return bool(cfg.telemetry or cfg.server_metrics_url or cfg.dcgm_urls)


@contextlib.contextmanager
def _telemetry(run: RunDir, cfg: SweepConfig) -> Iterator[None]:
    if not _telemetry_wanted(cfg):
        yield
        return
    try:
        from servescope.telemetry.session import TelemetryConfig, TelemetrySession
    except ImportError as err:
        raise ConfigError("telemetry is not available in this servescope build (servescope.telemetry.session); "
                          "run without --telemetry/--server-metrics/--dcgm") from err
    tcfg = TelemetryConfig(gpus=cfg.telemetry_gpus, interval_ms=cfg.telemetry_interval_ms,
                           server_metrics_url=cfg.server_metrics_url, dcgm_urls=tuple(cfg.dcgm_urls))
    # Without NVML (no driver, no GPU) GPU telemetry goes off with one clear line and the benchmark goes on
    # (issue 4, "Faults"): a load test is never lost to a missing counter. `servescope telemetry --gpus` alone fails.
    with TelemetrySession(run, tcfg, require_gpus=False):
        yield


def _run_loop(run: RunDir, cfg: SweepConfig, hook: EventHook) -> dict[str, Any]:
    loop = new_event_loop()
    stop = Stop()
    main_thread = threading.current_thread() is threading.main_thread()
    try:
        asyncio.set_event_loop(loop)
        if main_thread:
            loop.add_signal_handler(signal.SIGINT, lambda: _request_stop(stop))
        return loop.run_until_complete(_sweep(run, cfg, hook, stop))
    finally:
        if main_thread:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGINT)
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()


def _request_stop(stop: Stop) -> None:
    stop.set()


def _make_tokenizer(cfg: SweepConfig, model: str) -> Tokenizer | None:
    if cfg.tokenizer:
        return LocalTokenizer(cfg.tokenizer)
    kind = cfg.dataset.split(":", 1)[0]
    if kind != "random" and cfg.output_len is not None:
        return None  # not needed: token counts come from the server's usage
    ep = Endpoint.parse(cfg.url)
    st = ServerTokenizer(ep.origin + ep.base_path, model, cfg.api_key, timeout_s=min(cfg.timeout_s, 30.0))
    return st if st.available() else None


async def _discover_model(client: StreamingClient, cfg: SweepConfig) -> str:
    """The first model the server lists on ``/v1/models`` when ``--model`` is not given."""
    if cfg.model:
        return cfg.model
    import json

    ep = client.endpoint
    res = await client.stream(build_request(ep, "/v1/models", None, cfg.api_key, method="GET"), None)
    if res.ok:
        try:
            data = json.loads(res.body)
            return str(data["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            pass
    if cfg.backend == "sglang":
        return "default"
    _raise_for(ep.url("/v1/models"), res, "cannot list models; pass --model NAME")
    raise ConfigError("the server lists no model on /v1/models; pass --model NAME")


def _raise_for(url: str, res: StreamResult, hint: str) -> None:
    if res.ok:
        return
    if res.error_kind == "unreachable":
        raise TargetUnreachable(url, f"{res.error_text}; is the server up? ({hint})")
    if res.error_kind == "timeout":
        raise TargetTimeout(url, f"{res.error_text} ({hint})")
    if res.error_kind == "http_status" and res.status is not None:
        raise TargetHTTPStatus(url, res.status, (res.error_text or "") + f" ({hint})")
    raise TargetError(url, f"{res.error_kind}: {res.error_text} ({hint})")


async def _negotiate(client: StreamingClient, backend: Backend, cfg: SweepConfig, model: str,
                     probe: Prompt) -> tuple[RequestOptions, list[str]]:
    """Send one short probe; drop options the server rejects (400/422). Returns options and notes."""
    opts = RequestOptions(model=model, ignore_eos=cfg.ignore_eos, min_tokens=cfg.min_tokens,
                          temperature=cfg.temperature)
    if backend.name == "sglang":
        opts = replace(opts, include_usage=False, continuous_usage=False)
    notes: list[str] = []
    probe = replace(probe, output_len=min(4, probe.output_len))
    url = client.endpoint.url(backend.path)
    for _ in range(len(DROPPABLE) + 1):
        req = build_request(client.endpoint, backend.path, backend.body(probe, opts), cfg.api_key)
        res = await client.stream(req, backend.decoder())
        if res.ok:
            dec = res.decoded
            if dec is not None and dec.output_tokens_source != "usage":
                notes.append("the server sent no token usage: output tokens are counted from chunks (flagged)")
            if dec is not None and opts.continuous_usage and dec.chunk_tokens_source != "usage":
                notes.append("the server ignored continuous_usage_stats: per-chunk token counts are unknown, "
                             "so ITL falls back to one token per chunk")
            return opts, notes
        if res.error_kind == "http_status" and res.status in (400, 422):
            text = (res.error_text or "").lower()
            live = [n for n in DROPPABLE if _option_on(opts, n)]
            if not live:
                break
            named = [n for n in live if any(h in text for h in OPTION_HINTS[n])]
            drop = named[0] if named else live[0]
            notes.append(f"server rejected {drop} (HTTP {res.status}); sent without it")
            if drop == "ignore_eos":
                notes.append("without ignore_eos, outputs may stop early at EOS: lengths are taken from usage")
            opts = opts.without(drop)
            continue
        _raise_for(url, res, "the probe request failed; check --url, --backend and --model")
    _raise_for(url, res, "the server rejects even a minimal request; check --backend and --model")
    raise TargetError(url, "the probe request failed")


def _option_on(opts: RequestOptions, name: str) -> bool:
    if name == "temperature":
        return opts.temperature is not None
    return bool(getattr(opts, name))


async def _sweep(run: RunDir, cfg: SweepConfig, hook: EventHook, stop: Stop) -> dict[str, Any]:
    stop.event = asyncio.Event()
    if stop.flag:
        stop.event.set()
    backend = get_backend(cfg.backend)
    endpoint = Endpoint.parse(cfg.url)
    summary: dict[str, Any] = {}
    async with StreamingClient(endpoint, timeout_s=cfg.timeout_s) as client:
        model = await _discover_model(client, cfg)
        loop = asyncio.get_running_loop()
        tokenizer = await loop.run_in_executor(None, _make_tokenizer, cfg, model)
        want_ids = backend.name == "sglang"
        probe_prompt = make_prompts(cfg.workload(seed_offset=999_983), 1, tokenizer, want_ids)[0]
        opts, notes = await _negotiate(client, backend, cfg, model, probe_prompt)
        hook("negotiated", {"model": model, "options": _opts_dict(opts), "notes": notes,
                            "tokenizer": getattr(tokenizer, "name", None)})
        auto_stopped = None
        pool = WorkerPool(cfg.url, backend.name, cfg.timeout_s) if parse_workers(cfg.workers) != 1 else None
        with (pool if pool is not None else contextlib.nullcontext()), \
                run.jsonl_writer(REQUESTS) as req_w, run.jsonl_writer(POINTS) as pt_w:
            next_id = 0
            for idx, sched in enumerate(cfg.schedules()):
                if stop.flag:
                    break
                point, next_id = await _run_point(idx, sched, cfg, backend, opts, tokenizer, want_ids, client,
                                                  req_w, next_id, hook, stop,
                                                  extra={"model": model, "request_options": _opts_dict(opts),
                                                         "notes": notes}, pool=pool)
                pt_w.write(point)
                summary = metrics.summarize_run(run)
                hook("point_end", {"point": summary["points"][-1] if summary["points"] else {},
                                   "summary": summary})
                if cfg.auto_stop and not stop.flag and _should_stop(summary):
                    auto_stopped = point.label
                    break
        summary = metrics.summarize_run(run)
        summary["interrupted"] = summary["interrupted"] or stop.flag
        summary["auto_stopped_after"] = auto_stopped
        run.write_json("summary.json", summary)
    return summary


def _opts_dict(opts: RequestOptions) -> dict[str, Any]:
    return {"include_usage": opts.include_usage, "continuous_usage_stats": opts.continuous_usage,
            "ignore_eos": opts.ignore_eos, "min_tokens": opts.min_tokens, "temperature": opts.temperature}


def _should_stop(summary: dict[str, Any]) -> bool:
    pts = [p for p in summary["points"] if p.get("target_concurrency") and p.get("request_rate") is None]
    if len(pts) < 2:
        return False
    a, b = pts[-2], pts[-1]
    ta, tb = a.get("output_throughput"), b.get("output_throughput")
    la, lb = a.get("median_e2el_ms"), b.get("median_e2el_ms")
    ca, cb = a["target_concurrency"], b["target_concurrency"]
    if not (ta and tb and la and lb) or cb <= ca:
        return False
    eff = (tb / ta - 1) / (cb / ca - 1)
    return eff < AUTO_STOP_EFFICIENCY and lb >= AUTO_STOP_LATENCY_GROWTH * la


def _default_warmup(cfg: SweepConfig, sched: ClosedLoop | OpenLoop) -> int:
    if cfg.warmup is not None:
        # 0 turns warm-up off (explicitly asked for); any other count below the concurrency is raised to it.
        if isinstance(sched, ClosedLoop) and 0 < cfg.warmup < sched.concurrency:
            log.info("warm-up %d < concurrency %d: raised to the concurrency", cfg.warmup, sched.concurrency)
            return sched.concurrency
        return cfg.warmup
    if isinstance(sched, ClosedLoop):
        return sched.concurrency
    if math.isinf(sched.rate):
        return sched.max_concurrency or 1
    return max(1, min(math.ceil(sched.rate), 1000))


async def _run_point(idx: int, sched: ClosedLoop | OpenLoop, cfg: SweepConfig, backend: Backend,
                     opts: RequestOptions, tokenizer: Tokenizer | None, want_ids: bool, client: StreamingClient,
                     writer: JsonlWriter, first_id: int, hook: EventHook, stop: Stop, extra: dict[str, Any],
                     pool: WorkerPool | None = None) -> tuple[PointRecord, int]:
    warm = _default_warmup(cfg, sched)
    conc = sched.concurrency if isinstance(sched, ClosedLoop) else (sched.max_concurrency or 0)
    if cfg.duration_s is not None:
        n_measure = None
        n_pool = warm + max(DURATION_POOL, 4 * conc)
    else:
        per_c = cfg.prompts_per_concurrency or 10
        n_measure = cfg.num_prompts if cfg.num_prompts is not None else max(per_c * max(conc, 1),
                                                                          100 if cfg.prompts_per_concurrency is None
                                                                          else 1)
        n_pool = warm + n_measure
    # Prepare everything before the clock starts: prompts (tokenisation) and request bytes.
    loop = asyncio.get_running_loop()
    prompts = await loop.run_in_executor(None, make_prompts, cfg.workload(seed_offset=idx), n_pool, tokenizer,
                                         want_ids)
    bodies = [build_request(client.endpoint, backend.path, backend.body(p, opts), cfg.api_key) for p in prompts]
    n_proc = resolve_workers(cfg.workers, conc or None) if pool is not None else 1
    state = PointState(sched.label, None if n_measure is None else warm + n_measure, now_ns())
    hook("point_start", {"point": idx, "label": sched.label, "warmup": warm, "measure": n_measure,
                         "duration_s": cfg.duration_s, "workers": n_proc})
    offsets: list[int] = []
    if isinstance(sched, OpenLoop):
        total = n_pool if (n_measure is not None or math.isinf(sched.rate)) else 10_000_000
        dur = None if cfg.duration_s is None else cfg.duration_s + warm / (sched.rate if math.isfinite(sched.rate)
                                                                             else 1e9)
        offsets = arrival_offsets_ns(total, sched.rate, sched.burstiness, cfg.seed * 7919 + idx, dur)
    cpu0 = time.process_time()
    wall0 = now_ns()
    prog_task = loop.create_task(_progress(state, hook))
    if n_proc == 1:
        lag_task = loop.create_task(lag_monitor(state))
        gate = LocalGate(warm, n_measure, cfg.duration_s, stop)
        with gc_frozen():  # before the schedule's t0: the collection it starts with can take tens of ms
            if isinstance(sched, ClosedLoop):
                sl = Slice(idx, first_id, slots=sched.concurrency)
            else:
                sl = Slice(idx, first_id, slots=None, offsets=tuple(enumerate(offsets)), cap=sched.max_concurrency,
                           start_ns=now_ns() + 1_000_000)
            await drive(sl, gate, client, backend, bodies, prompts, writer.write, state, stop)
        lag_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lag_task
        end = now_ns()
        check = client_check(state, time.process_time() - cpu0, (end - wall0) / 1e9)
        issued, measure_start, start = gate.issued, gate.measure_start_ns, wall0
    else:
        assert pool is not None
        if isinstance(sched, ClosedLoop):
            slices = closed_slices(idx, first_id, sched.concurrency, n_proc)
        else:
            slices = open_slices(idx, first_id, offsets, sched.max_concurrency, n_proc)
        plan = PointPlan(tuple(bodies), tuple(prompts), warm, n_measure, cfg.duration_s)
        out = await pool.run_point(slices, plan, writer.write, state, stop)
        end = now_ns()
        parent_s = (time.process_time() - cpu0, max(1e-9, (end - wall0) / 1e9))
        check = {**out.client, "parent_cpu_pct": 100.0 * parent_s[0] / parent_s[1]}
        issued, measure_start, start = out.issued, out.measure_start_ns, out.start_ns
    prog_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await prog_task
    done = state.done
    point = PointRecord(
        point=idx,
        label=sched.label,
        concurrency=sched.concurrency if isinstance(sched, ClosedLoop) else sched.max_concurrency,
        request_rate=None if isinstance(sched, ClosedLoop) else (sched.rate if math.isfinite(sched.rate) else None),
        start_ns=start,
        measure_start_ns=measure_start or end,
        end_ns=end,
        num_requests=max(0, done - min(done, warm)),
        num_warmup=min(done, warm),
        interrupted=stop.flag,
        client=check,
        extra={**extra, "open_loop": isinstance(sched, OpenLoop),
               "burstiness": None if isinstance(sched, ClosedLoop) else sched.burstiness,
               "rate_inf": isinstance(sched, OpenLoop) and math.isinf(sched.rate), "workers": n_proc},
    )
    return point, first_id + issued




async def _progress(state: PointState, hook: EventHook) -> None:
    last_tokens = 0
    last_t = now_ns()
    while True:
        await asyncio.sleep(1.0)
        t = now_ns()
        rate = (state.tokens - last_tokens) / max(1e-9, (t - last_t) / 1e9)
        last_tokens, last_t = state.tokens, t
        hook("progress", {"label": state.label, "done": state.done, "total": state.total, "failed": state.failed,
                          "in_flight": state.in_flight, "output_tok_s": rate,
                          "elapsed_s": (t - state.started_ns) / 1e9})
