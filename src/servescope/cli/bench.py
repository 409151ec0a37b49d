"""``servescope bench`` (load sweep) and ``servescope selftest`` (the client measures itself).

Thin: parse flags into a ``SweepConfig`` / ``SelftestConfig``, call one library function,
print progress and a table per point on stderr and the run directory on stdout.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

import typer

from servescope import __version__
from servescope.errors import ConfigError
from servescope.load.workload import parse_range
from servescope.run import RunDir

_SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


def parse_int_list(flag: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,2,4") from err
    if not vals or any(v < 1 for v in vals):
        raise ConfigError(f"{flag} {text!r}: values must be integers >= 1")
    return vals


def parse_rates(text: str) -> tuple[float, ...]:
    out = []
    for x in text.split(","):
        x = x.strip()
        if not x:
            continue
        try:
            v = float(x)
        except ValueError as err:
            raise ConfigError(f"--request-rate {text!r}: expected numbers or inf, e.g. 2,4,inf") from err
        if not v > 0 or math.isnan(v):
            raise ConfigError(f"--request-rate {text!r}: rates must be > 0")
        out.append(v)
    if not out:
        raise ConfigError("--request-rate needs at least one rate")
    return tuple(out)


def parse_slo(text: str | None) -> dict[str, float] | None:
    """``ttft:500,tpot:50`` -> {"ttft_ms": 500.0, "tpot_ms": 50.0} (milliseconds, vLLM's --goodput)."""
    if not text:
        return None
    out: dict[str, float] = {}
    for part in text.split(","):
        name, _, val = part.partition(":")
        key = _SLO_KEYS.get(name.strip())
        try:
            ms = float(val)
        except ValueError:
            ms = -1.0
        if key is None or not ms > 0:
            raise ConfigError(f"--slo {text!r}: write e.g. ttft:500,tpot:50,e2el:10000 (milliseconds)")
        out[key] = ms
    return out


def redact_argv(argv: list[str]) -> list[str]:
    """The command line with any API key value replaced: config.json must never hold it."""
    out: list[str] = []
    hide = False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a == "--api-key":
            out.append(a)
            hide = True
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
    return out


def _env() -> dict[str, Any]:
    versions = {}
    for mod in ("aiohttp", "uvloop", "numpy", "transformers"):
        try:
            versions[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            versions[mod] = None
    return {"host": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
            "servescope": __version__, "cpu_count": os.cpu_count(), "packages": versions}


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    return str(v)


_HEAD = (f"{'point':>14} {'ok':>6} {'fail':>5} {'req/s':>8} {'out tok/s':>10} {'steady tok/s':>12} "
         f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'ITL p50':>8} {'p99':>8} {'E2EL p50':>9} {'conc':>7}  client")


def _row(p: dict[str, Any]) -> str:
    ss = p.get("steady_state") or {}
    flag = "LIMITED" if (p.get("client") or {}).get("client_limited") else "ok"
    return (f"{p.get('label', ''):>14} {p['completed']:>6} {p['failed']:>5} {_fmt(p.get('request_throughput'), 2):>8} "
            f"{_fmt(p.get('output_throughput')):>10} {_fmt(ss.get('output_throughput')):>12} "
            f"{_fmt(p.get('median_ttft_ms')):>9} {_fmt(p.get('p99_ttft_ms')):>8} {_fmt(p.get('median_tpot_ms'), 2):>9} "
            f"{_fmt(p.get('median_itl_ms'), 2):>8} {_fmt(p.get('p99_itl_ms'), 2):>8} "
            f"{_fmt(p.get('median_e2el_ms')):>9} {_fmt(p.get('concurrency')):>7}  {flag}")


class _Printer:
    """Progress and per-point table on stderr."""

    def __init__(self) -> None:
        self.header_done = False
        self.tty = sys.stderr.isatty()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        err = sys.stderr
        if kind == "negotiated":
            print(f"model {data['model']}; request options {data['options']}", file=err)
            for n in data["notes"]:
                print(f"note: {n}", file=err)
        elif kind == "point_start":
            bound = f"{data['measure']} measured" if data.get("measure") is not None else f"{data['duration_s']} s"
            procs = f" on {data['workers']} client processes" if data.get("workers", 1) > 1 else ""
            print(f"{data['label']}: {data['warmup']} warm-up + {bound}{procs}", file=err)
        elif kind == "progress":
            total = f"/{data['total']}" if data.get("total") else ""
            line = (f"  {data['label']}: {data['done']}{total} done, {data['failed']} failed, "
                    f"{data['in_flight']} in flight, {data['output_tok_s']:,.0f} tok/s, {data['elapsed_s']:.0f} s")
            print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=err, flush=True)
        elif kind == "point_end":
            if self.tty:
                print("", file=err)
            p = data["point"]
            if not p:
                return
            if not self.header_done:
                print(_HEAD, file=err)
                self.header_done = True
            print(_row(p), file=err)
            for w in p.get("warnings", []):
                print(f"  warning: {w}", file=err)


def register(app: typer.Typer) -> None:
    """Add ``bench`` and ``selftest`` to the servescope app."""

    @app.command("bench")
    def bench(
        url: str = typer.Option(..., "--url", help="Server base URL, e.g. http://127.0.0.1:8000"),
        out: Path = typer.Option(..., "--out", help="New run directory to write."),  # noqa: B008
        backend: str = typer.Option("openai", "--backend", help="openai | openai-chat | sglang"),
        model: str = typer.Option(None, "--model", help="Served model name (default: first of /v1/models)."),
        concurrency: str = typer.Option("1", "--concurrency", help="Closed-loop ladder, e.g. 256,512,1024"),
        input_len: int = typer.Option(128, "--input-len", help="Prompt tokens (random dataset)."),
        output_len: int = typer.Option(128, "--output-len", help="Output tokens asked for (max_tokens)."),
        num_prompts: int = typer.Option(None, "--num-prompts", help="Measured requests per point."),
        duration: float = typer.Option(None, "--duration", help="Measured seconds per point (instead of a count)."),
        request_rate: str = typer.Option(None, "--request-rate", help="Open loop: rates in req/s, e.g. 2,4,inf"),
        burstiness: float = typer.Option(1.0, "--burstiness", help="Gamma shape of arrivals (1 = Poisson)."),
        max_concurrency: int = typer.Option(None, "--max-concurrency", help="Open loop: cap on requests in flight."),
        warmup: int = typer.Option(
            None, "--warmup", help="Warm-up requests per point (default and minimum: the concurrency; 0 = none)."
        ),
        slo: str = typer.Option(None, "--slo", help="Goodput SLOs in ms, e.g. ttft:500,tpot:50,e2el:10000"),
        api_key: str = typer.Option(None, "--api-key", help="Bearer token (or env SERVESCOPE_API_KEY/OPENAI_API_KEY)."),
        tokenizer: str = typer.Option(None, "--tokenizer", help="Local Hugging Face tokenizer folder."),
        dataset: str = typer.Option("random", "--dataset", help="random | text:PROMPT | sharegpt:PATH | jsonl:PATH"),
        length_range: str = typer.Option(None, "--range", help="Length range by convention: sglang:R or vllm:R"),
        seed: int = typer.Option(0, "--seed"),
        timeout_s: float = typer.Option(60.0, "--timeout-s", help="Longest silence allowed within a request."),
        auto_stop: bool = typer.Option(False, "--auto-stop", help="Stop once throughput is flat and latency climbs."),
        ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos"),
        min_tokens: bool = typer.Option(False, "--min-tokens", help="Also send min_tokens = output length."),
        telemetry: bool = typer.Option(False, "--telemetry", help="Sample NVML GPU telemetry during the sweep."),
        server_metrics: str = typer.Option(None, "--server-metrics", help="Prometheus /metrics URL of the server."),
        dcgm: list[str] = typer.Option(None, "--dcgm", help="DCGM exporter URL (repeatable)."),  # noqa: B008
        workers: str = typer.Option(
            "1", "--workers", help="Client processes per point: N, or auto (one per 2,048 streams, at most one per "
            "CPU). Use more than 1 when the self-check flags a point client-limited."
        ),
        json_out: bool = typer.Option(False, "--json", help="Print the summary JSON on stdout."),
    ) -> None:
        """Run a load sweep against a streaming LLM server and write a run directory."""
        from servescope.load.sweep import SweepConfig, run_sweep
        from servescope.load.workers import parse_workers

        key = api_key or os.environ.get("SERVESCOPE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        conv, ratio = parse_range(length_range)
        cfg = SweepConfig(
            url=url, backend=backend, model=model,
            concurrencies=() if request_rate else parse_int_list("--concurrency", concurrency),
            request_rates=parse_rates(request_rate) if request_rate else (),
            burstiness=burstiness, max_concurrency=max_concurrency, input_len=input_len, output_len=output_len,
            dataset=dataset, range_convention=conv, range_ratio=ratio, seed=seed, num_prompts=num_prompts,
            duration_s=duration, warmup=warmup, slo=parse_slo(slo), api_key=key, tokenizer=tokenizer,
            timeout_s=timeout_s, auto_stop=auto_stop, ignore_eos=ignore_eos, min_tokens=min_tokens,
            telemetry=telemetry, server_metrics_url=server_metrics, dcgm_urls=tuple(dcgm or ()),
            workers=parse_workers(workers),
        )
        cfg.validate()
        config = {"command": "bench", "argv": redact_argv(sys.argv[1:]), **cfg.to_config()}
        run = RunDir.create(out, config, _env())
        summary = run_sweep(run, cfg, _Printer())
        _print_end(summary)
        if json_out:
            import json

            typer.echo(json.dumps(summary, indent=2))
        else:
            typer.echo(str(run.path))
        if summary.get("interrupted"):
            typer.echo("servescope: interrupted; everything received is in the run directory", err=True)
            raise typer.Exit(130)

    @app.command("selftest")
    def selftest(
        streams: str = typer.Option("64,256,1024", "--streams", help="Concurrent streams per level."),
        tokens_per_s: float = typer.Option(50.0, "--tokens-per-s", help="Server cadence per stream."),
        tokens_per_chunk: int = typer.Option(1, "--tokens-per-chunk"),
        ttft_ms: float = typer.Option(20.0, "--ttft-ms"),
        output_len: int = typer.Option(64, "--output-len", help="Tokens per request."),
        requests_per_stream: int = typer.Option(2, "--requests-per-stream"),
        ceiling: bool = typer.Option(True, "--ceiling/--no-ceiling", help="Also measure the chunk-event ceiling."),
        ceiling_streams: int = typer.Option(256, "--ceiling-streams"),
        out: Path = typer.Option(None, "--out", help="Run directory to keep (default: a temporary one)."),  # noqa: B008
        json_out: bool = typer.Option(False, "--json", help="Print the results as JSON on stdout."),
    ) -> None:
        """Measure this client's added delay and event ceiling against a local stamped server."""
        import json
        import tempfile

        from servescope.load.selftest import SelftestConfig, run_selftest

        if tokens_per_s <= 0 or tokens_per_chunk < 1 or output_len < 1 or requests_per_stream < 1:
            raise ConfigError("--tokens-per-s, --tokens-per-chunk, --output-len, --requests-per-stream must be > 0")
        cfg = SelftestConfig(streams=parse_int_list("--streams", streams), tokens_per_s=tokens_per_s,
                             tokens_per_chunk=tokens_per_chunk, ttft_ms=ttft_ms, output_len=output_len,
                             requests_per_stream=requests_per_stream, ceiling=ceiling, ceiling_streams=ceiling_streams)
        with tempfile.TemporaryDirectory(prefix="servescope-selftest-") as tmp:
            base = Path(out) if out else Path(tmp)
            config = {"command": "selftest", "argv": sys.argv[1:], "selftest": cfg.__dict__}
            run = RunDir.create(base / "levels", {**config, "part": "levels"}, _env())
            run_c = RunDir.create(base / "ceiling", {**config, "part": "ceiling"}, _env()) if ceiling else None
            res = run_selftest(run, run_c, cfg, _Printer())
        if json_out:
            typer.echo(json.dumps(res, indent=2))
        else:
            typer.echo(_selftest_table(res))
            if out:
                typer.echo(str(out))
        if res.get("interrupted"):
            raise typer.Exit(130)


def _selftest_table(res: dict[str, Any]) -> str:
    lines = [f"client-added delay (arrival - server send stamp), cadence {res['cadence_ms']:.1f} ms per chunk per "
             f"stream; goal p99 <= {res['goal_p99_added_delay_ms']:g} ms",
             f"{'streams':>8} {'events/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'loop lag p99':>12} "
             f"{'CPU %':>6}  goal"]
    for lv in res["levels"]:
        lines.append(f"{lv['streams']:>8} {_fmt(lv['chunk_events_per_s'], 0):>10} "
                     f"{_fmt(lv['added_delay_p50_ms'], 2):>8} "
                     f"{_fmt(lv['added_delay_p99_ms'], 2):>8} {_fmt(lv['added_delay_max_ms'], 2):>8} "
                     f"{_fmt(lv['loop_lag_p99_ms'], 2):>12} {_fmt(lv['client_cpu_pct'], 0):>6}  "
                     f"{'met' if lv['goal_met'] else 'MISSED'}")
    c = res.get("ceiling")
    if c:
        lines.append(f"event ceiling: {c['chunk_events_per_s']:,.0f} chunk events/s sustained at {c['streams']} "
                     "streams "
                     f"(client CPU {_fmt(c['client_cpu_pct'], 0)}%, i.e. ~{_fmt(c.get('events_per_cpu_s'), 0)} events "
                     f"per client CPU-second; server lateness p99 "
                     f"{_fmt(c.get('server_lateness_p99_ms'), 1)} ms; the server shares this machine, so this is a "
                     "lower bound)")
    return "\n".join(lines)


def _print_end(summary: dict[str, Any]) -> None:
    sc = summary.get("scaling") or {}
    for st in sc.get("steps", []):
        print(f"scaling c={st['from']}->{st['to']}: throughput x{st['throughput_ratio']:.2f}, "
              f"efficiency {st['efficiency']:.2f}", file=sys.stderr)
    if sc.get("knee_concurrency"):
        print(f"knee: throughput stops rising past c={sc['knee_concurrency']}", file=sys.stderr)
    if summary.get("auto_stopped_after"):
        print(f"auto-stop after {summary['auto_stopped_after']}: throughput flat while latency climbs",
              file=sys.stderr)
