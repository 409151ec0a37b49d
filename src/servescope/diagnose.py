"""Findings with evidence: why did throughput stop rising?

``diagnose(run)`` is a pure function of a run directory: it reads the per-point load
summary, the request records, the telemetry aggregates and the roofline that
measurement wrote, and never talks to a server or to NVML. Each rule below looks for
one cause of a plateau and, when it fires, returns a ``Finding`` carrying the numbers
that convinced it (with the file they came from), a confidence, and what to try.

The rules mirror the seed diagnosis (``docs/seed-check.md``): a throughput knee, a
scheduler / KV-cache ceiling, a kernel-efficiency floor (GPUs "100% utilised" at full
clocks yet far under their power limit, little tensor-pipe activity), memory- vs
compute-bound per the roofline, power or thermal caps, a host-bound engine (GPU mostly
idle), a client that distorted its own measurement, failures, and tail-latency stalls.
Thresholds are named constants so the report can quote them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servescope.load.metrics import KNEE_FRACTION_OF_PEAK, scaling
from servescope.load.records import RequestRecord
from servescope.run import DIAGNOSIS, POINTS, REQUESTS, ROOFLINE, SUMMARY, TELEMETRY_SUMMARY, RunDir

#: "Busy" per NVML utilisation (percent of time a kernel ran).
BUSY_UTIL_PCT = 90.0
#: Clocks at or above this fraction of max count as "full clocks".
FULL_CLOCK_FRACTION = 0.90
#: Power under this fraction of the limit while busy at full clocks = kernel-efficiency floor.
LOW_POWER_FRACTION = 0.60
#: Tensor-pipe activity under this percentage while busy = tensor cores starved.
LOW_TENSOR_PCT = 20.0
#: Power at or above this fraction of the limit = power-capped.
POWER_CAP_FRACTION = 0.95
#: GPU utilisation under this while the plateau holds = the host side (scheduler, Python) is the bottleneck.
HOST_BOUND_UTIL_PCT = 40.0
#: An inter-token gap this many times the median is a stall.
STALL_FACTOR = 10.0
#: A point whose mean decoding set is under this fraction of its concurrency is queueing at the server.
CAPPED_RUNNING_FRACTION = 0.8
#: P99/median ITL ratio above which the tail is called heavy.
HEAVY_TAIL_RATIO = 4.0


@dataclass(frozen=True, slots=True)
class Evidence:
    """One number behind a finding, and where it came from (file and field)."""

    label: str
    value: float | int | str | None
    unit: str | None
    source: str


@dataclass(frozen=True, slots=True)
class Mark:
    """A moment on the run timeline worth pointing at (a stall, a queue build-up)."""

    t_ns: int
    label: str


@dataclass(frozen=True)
class Finding:
    id: str
    title: str
    severity: str  # "critical" | "warning" | "info"
    confidence: str  # "high" | "medium" | "low"
    verdict: str
    evidence: tuple[Evidence, ...] = ()
    points: tuple[int, ...] = ()
    recommendations: tuple[str, ...] = ()
    marks: tuple[Mark, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("evidence", "points", "recommendations", "marks"):
            d[key] = list(d[key])
        return d


@dataclass(frozen=True)
class Diagnosis:
    headline: str
    findings: tuple[Finding, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "headline": self.headline,
            "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class PointView:
    """The per-point numbers the rules use, gathered from summary.json and the records."""

    point: int
    label: str
    concurrency: int | None
    request_rate: float | None
    output_tok_s: float | None
    completed: int
    failed: int
    failures_by_kind: dict[str, int]
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    itl_max_ms: float | None
    decoding_peak: int | None  # most requests between first token and end at once (client-side view)
    decoding_mean: float | None
    waiting_mean: float | None  # sent but no first token yet (queued at the server, or prefilling)
    client_limited: bool
    client_notes: tuple[str, ...]
    start_ns: int | None
    end_ns: int | None


@dataclass
class Inputs:
    """Everything the rules read, loaded once from the run directory."""

    points: list[PointView]
    requests: dict[int, list[RequestRecord]]
    telemetry: dict[str, Any]
    roofline: dict[str, Any]
    config: dict[str, Any]
    env: dict[str, Any]
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Loading (the only part that touches files)


def load_inputs(run: RunDir) -> Inputs:
    """Read what measurement wrote. Missing parts become empty, with a note: a crashed run still diagnoses."""
    notes: list[str] = []
    records: dict[int, list[RequestRecord]] = {}
    for row in run.iter_jsonl(REQUESTS):
        rec = RequestRecord.from_dict(row)
        if rec.phase != "warmup":
            records.setdefault(rec.point, []).append(rec)
    point_rows = {int(p["point"]): p for p in run.iter_jsonl(POINTS)}
    summary = run.read_json(SUMMARY, default=None)
    if summary is None:
        summary = _summary_from_records(run, notes)
    telemetry = run.read_json(TELEMETRY_SUMMARY, default={}) or {}
    if not telemetry:
        notes.append("no GPU/server telemetry in this run: kernel efficiency and power findings are not assessed")
    roofline = run.read_json(ROOFLINE, default={}) or {}
    if not roofline:
        notes.append("no roofline.json (no model/GPU known): measured throughput is not compared with a model")
    views = [
        _point_view(p, records.get(int(p.get("point", -1)), []), point_rows.get(int(p.get("point", -1)), {}))
        for p in _summary_points(summary)
    ]
    if not views and records:
        notes.append("summary.json lists no points; points were rebuilt from requests.jsonl only")
        views = [_point_view({"point": k}, v, point_rows.get(k, {})) for k, v in sorted(records.items())]
    return Inputs(
        points=sorted(views, key=lambda v: (v.concurrency or 0, v.request_rate or 0.0, v.point)),
        requests=records,
        telemetry=telemetry,
        roofline=roofline,
        config=run.config,
        env=run.env,
        notes=notes,
    )


def _summary_from_records(run: RunDir, notes: list[str]) -> dict[str, Any]:
    """Recompute the load summary when summary.json is missing (e.g. the run was killed)."""
    try:
        from servescope.load.metrics import summarize_run
    except ImportError:  # pragma: no cover - load.metrics ships with the package
        notes.append("summary.json missing and load.metrics unavailable")
        return {}
    notes.append("summary.json was missing; recomputed from requests.jsonl")
    return summarize_run(run)


def _summary_points(summary: dict[str, Any]) -> list[dict[str, Any]]:
    pts = summary.get("points", [])
    return [p for p in pts if isinstance(p, dict)]


def _num(d: dict[str, Any], *keys: str) -> float | None:
    for key in keys:
        v = d.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def _point_view(p: dict[str, Any], recs: list[RequestRecord], point_row: dict[str, Any]) -> PointView:
    whole = p.get("whole_run", p)  # metrics may sit at top level or under "whole_run"
    conc = p.get("concurrency_target", p.get("target_concurrency", point_row.get("concurrency")))
    if conc is None and isinstance(p.get("concurrency"), int):
        conc = p.get("concurrency")
    rate = p.get("request_rate_target", point_row.get("request_rate"))
    failures = whole.get("failures_by_kind") or p.get("failures_by_kind") or {}
    client = p.get("client") or point_row.get("client") or {}
    client_limited = bool(p.get("client_limited", client.get("client_limited", False)))
    client_notes = tuple(str(x) for x in (client.get("client_limited_reasons") or client.get("reasons") or ()))
    dec_peak, dec_mean, wait_mean = _in_flight_stats(recs)
    start = point_row.get("measure_start_ns")
    end = point_row.get("end_ns")
    return PointView(
        point=int(p.get("point", point_row.get("point", -1))),
        label=str(p.get("label", point_row.get("label", f"c={conc}"))),
        concurrency=int(conc) if isinstance(conc, (int, float)) else None,
        request_rate=float(rate) if isinstance(rate, (int, float)) else None,
        output_tok_s=_num(whole, "output_throughput"),
        completed=int(_num(whole, "completed") or sum(1 for r in recs if r.ok)),
        failed=int(_num(whole, "failed") or sum(1 for r in recs if not r.ok)),
        failures_by_kind={str(k): int(v) for k, v in failures.items()} if isinstance(failures, dict) else {},
        ttft_p50_ms=_num(whole, "median_ttft_ms", "p50_ttft_ms"),
        ttft_p99_ms=_num(whole, "p99_ttft_ms"),
        tpot_p50_ms=_num(whole, "median_tpot_ms", "p50_tpot_ms"),
        itl_p50_ms=_num(whole, "median_itl_ms", "p50_itl_ms"),
        itl_p99_ms=_num(whole, "p99_itl_ms"),
        itl_max_ms=_num(whole, "max_itl_ms"),
        decoding_peak=dec_peak,
        decoding_mean=dec_mean,
        waiting_mean=wait_mean,
        client_limited=client_limited,
        client_notes=client_notes,
        start_ns=int(start) if isinstance(start, int) else None,
        end_ns=int(end) if isinstance(end, int) else None,
    )


def _in_flight_stats(recs: list[RequestRecord]) -> tuple[int | None, float | None, float | None]:
    """How many requests were decoding (first token seen, not finished) and waiting (sent, no token yet).

    This is the server's running set as seen from the client: if it stays near N while
    more requests are in flight, the server admits at most ~N at a time. Statistics are
    time-weighted over the middle 80% of the point, to leave out ramp-up and drain, and
    the "peak" is the 90th percentile of the decoding count over time rather than its
    maximum, so that a brief overshoot (a KV-block admission race) does not set the cap.
    """
    ok = [r for r in recs if r.ok and r.first_token_ns is not None]
    if len(ok) < 2:
        return None, None, None
    events: list[tuple[int, int, int]] = []  # (t, d_decoding, d_waiting)
    for r in ok:
        ft = r.first_token_ns
        assert ft is not None
        events.append((r.send_ns, 0, +1))
        events.append((ft, +1, -1))
        events.append((r.end_ns, -1, 0))
    events.sort()
    t0, t1 = events[0][0], events[-1][0]
    lo, hi = t0 + (t1 - t0) // 10, t1 - (t1 - t0) // 10
    if hi <= lo:
        return None, None, None
    dec = wait = 0
    area_wait = 0.0
    time_at: dict[int, int] = {}  # decoding count -> ns spent at it
    prev_t: int | None = None
    for t, dd, dw in events:
        if prev_t is not None:
            a, b = max(prev_t, lo), min(t, hi)
            if b > a:
                time_at[dec] = time_at.get(dec, 0) + (b - a)
                area_wait += wait * (b - a)
        dec += dd
        wait += dw
        prev_t = t
    span = hi - lo
    mean_dec = sum(k * v for k, v in time_at.items()) / span
    acc, p90 = 0, 0
    for k in sorted(time_at):
        acc += time_at[k]
        if acc >= 0.9 * span:
            p90 = k
            break
    return p90, mean_dec, area_wait / span


# ---------------------------------------------------------------------------------------------
# Rules (pure)


def find_knee(points: list[PointView]) -> tuple[PointView | None, list[tuple[PointView, PointView, float]]]:
    """The knee of the throughput curve, by the same rule as the load summary (``load.metrics.scaling``).

    One definition serves the bench table, the report and the diagnosis: the lowest concurrency
    whose throughput reaches KNEE_FRACTION_OF_PEAK of the sweep's best (None when only the last
    point does). Returns the knee and the scaling efficiency of each consecutive step (throughput
    gain over concurrency gain), for the evidence.
    """
    closed = [p for p in points if p.concurrency and p.output_tok_s and p.request_rate is None]
    rows = [{"target_concurrency": p.concurrency, "output_throughput": p.output_tok_s, "request_rate": None}
            for p in closed]
    result = scaling(rows)
    by_conc = {p.concurrency: p for p in closed}
    steps = [(by_conc[s["from"]], by_conc[s["to"]], float(s["efficiency"])) for s in result["steps"]]
    knee_c = result["knee_concurrency"]
    return (by_conc.get(knee_c) if knee_c is not None else None), steps


def rule_plateau(inp: Inputs) -> Finding | None:
    knee, steps = find_knee(inp.points)
    if not steps:
        return None
    ev = [
        Evidence(
            f"scaling efficiency c={a.concurrency}->{b.concurrency}",
            round(100 * eff, 1),
            "%",
            f"summary.json output_throughput {a.output_tok_s:.1f} -> {b.output_tok_s:.1f} tok/s",
        )
        for a, b, eff in steps
    ]
    if knee is None:
        last = steps[-1][1]
        return Finding(
            id="plateau",
            title="No plateau within the sweep",
            severity="info",
            confidence="high",
            verdict=(
                f"Output throughput still rises with concurrency up to c={last.concurrency} "
                f"({last.output_tok_s:.0f} tok/s): sweep higher to find the knee."
            ),
            evidence=tuple(ev),
            points=tuple(p.point for p in inp.points),
            recommendations=("Extend --concurrency beyond the last point.",),
        )
    peak = max((p.output_tok_s or 0.0) for p in inp.points)
    return Finding(
        id="plateau",
        title=f"Throughput plateaus at c={knee.concurrency}",
        severity="warning",
        confidence="high" if len(steps) >= 2 else "medium",
        verdict=(
            f"At c={knee.concurrency} throughput ({knee.output_tok_s:.0f} output tok/s) is already within "
            f"{100 * (1 - KNEE_FRACTION_OF_PEAK):.0f}% of the sweep's best ({peak:.0f} tok/s): more concurrency "
            "buys little beyond it."
        ),
        evidence=tuple(ev),
        points=(knee.point,),
        recommendations=("See the findings below for what sets the ceiling at the knee.",),
    )


def _server_series(inp: Inputs, point: int) -> dict[str, Any]:
    for p in inp.telemetry.get("points", []) or []:
        if isinstance(p, dict) and int(p.get("point", -1)) == point:
            return p.get("server", {}) or {}
    return {}


def _server_ceiling(inp: Inputs) -> tuple[float | None, str]:
    ceiling = inp.telemetry.get("server_ceiling") or {}
    if isinstance(ceiling, dict):
        for key in ("max_running_requests", "max_num_seqs"):
            v = ceiling.get(key)
            if isinstance(v, (int, float)):
                return float(v), key
    return None, ""


def rule_scheduler_ceiling(inp: Inputs) -> Finding | None:
    """Running requests pinned at a maximum while requests queue: a scheduler / KV-cache cap."""
    knee, _ = find_knee(inp.points)
    closed = [p for p in inp.points if p.concurrency]
    if len(closed) < 2:
        return None
    ev: list[Evidence] = []
    recs: list[str] = []
    cap_value, cap_key = _server_ceiling(inp)
    # Server-side evidence first: running pinned at its max while the queue grows.
    pinned_points = []
    for p in closed:
        s = _server_series(inp, p.point)
        run_max, queue_mean = _num(s, "running_requests_max"), _num(s, "queued_requests_mean")
        pinned = run_max is not None and queue_mean is not None and bool(p.concurrency)
        if pinned and run_max < 0.95 * p.concurrency and queue_mean >= 1.0:
            pinned_points.append((p, run_max, queue_mean))
    if pinned_points:
        first = pinned_points[0][0]
        for p, run_max, queue_mean in pinned_points:
            ev.append(Evidence(f"server running (max) at c={p.concurrency}", run_max, "requests",
                               "telemetry_summary.json server.running_requests_max"))
            ev.append(Evidence(f"server queue (mean) at c={p.concurrency}", round(queue_mean, 1), "requests",
                               "telemetry_summary.json server.queued_requests_mean"))
        if cap_value is not None:
            ev.append(Evidence(f"configured {cap_key}", cap_value, "requests", "telemetry_summary.json server_ceiling"))
        cap = pinned_points[0][1]
        return _ceiling_finding(inp, first, f"{cap:.0f}", "server metrics", ev, recs, confidence="high")

    # Client-side inference: decoding set pinned while waiting grows; TTFT climbs, TPOT flat.
    with_dec = [p for p in closed if p.decoding_peak and p.decoding_mean is not None and p.waiting_mean is not None]
    if len(with_dec) < 2:
        return None
    # A point is capped when a fifth or more of its streams wait for a first token on average:
    # the server holds them in its queue instead of decoding them.
    capped = [
        p for p in with_dec
        if p.concurrency and p.concurrency >= 2 and (p.decoding_mean or 0.0) < CAPPED_RUNNING_FRACTION * p.concurrency
        and (p.waiting_mean or 0.0) >= 1.0
    ]
    if not capped:
        return None
    first = capped[0]
    caps = sorted({p.decoding_peak or 0 for p in capped})
    cap_text = f"{caps[0]}" if len(caps) == 1 else f"{caps[0]}-{caps[-1]}"
    below = [p for p in with_dec if p.concurrency and p.concurrency < (first.concurrency or 0)]
    for p in with_dec:
        ev.append(Evidence(f"decoding in flight (p90 / mean over time) at c={p.concurrency}",
                           f"{p.decoding_peak} / {p.decoding_mean:.1f}", "requests",
                           "requests.jsonl: streams between first token and end"))
        ev.append(Evidence(f"waiting for first token (mean) at c={p.concurrency}", round(p.waiting_mean or 0, 1),
                           "requests", "requests.jsonl: sent, no first token yet"))
    ref = below[-1] if below else with_dec[0]
    if ref.ttft_p50_ms and first.ttft_p50_ms and ref.tpot_p50_ms and first.tpot_p50_ms:
        ev.append(Evidence(f"TTFT p50 c={ref.concurrency} -> c={first.concurrency}",
                           f"{ref.ttft_p50_ms:.0f} -> {first.ttft_p50_ms:.0f}", "ms", "summary.json median_ttft_ms"))
        ev.append(Evidence(f"TPOT p50 c={ref.concurrency} -> c={first.concurrency}",
                           f"{ref.tpot_p50_ms:.1f} -> {first.tpot_p50_ms:.1f}", "ms", "summary.json median_tpot_ms"))
    ttft_growth = (first.ttft_p50_ms / ref.ttft_p50_ms) if (ref.ttft_p50_ms and first.ttft_p50_ms) else None
    tpot_growth = (first.tpot_p50_ms / ref.tpot_p50_ms) if (ref.tpot_p50_ms and first.tpot_p50_ms) else None
    confident = ttft_growth is not None and tpot_growth is not None and ttft_growth >= 2.0 and tpot_growth < 1.5
    if cap_value is not None:
        ev.append(Evidence(f"configured {cap_key}", cap_value, "requests", "telemetry_summary.json server_ceiling"))
    if knee is not None:
        ev.append(Evidence("throughput knee", knee.concurrency, "concurrency", "plateau finding"))
    return _ceiling_finding(inp, first, cap_text, "client-side records", ev, recs,
                            confidence="high" if confident else "medium")


def _engine_kind(inp: Inputs) -> str:
    target = inp.config.get("target", {}) or {}
    engine = inp.config.get("engine", {}) or {}
    return str(engine.get("kind") or target.get("engine") or target.get("server_kind") or "")


def _ceiling_finding(
    inp: Inputs, first: PointView, cap: str, how: str, ev: list[Evidence], recs: list[str], confidence: str
) -> Finding:
    kind = _engine_kind(inp)
    setting = {
        "sglang": "--max-running-requests (and --mem-fraction-static for KV room)",
        "vllm": "--max-num-seqs (and --gpu-memory-utilization / --kv-cache-memory for KV room)",
        "transformers": "--cb-num-blocks / --cb-max-batch-tokens (KV blocks and batch size)",
    }.get(kind, "the server's running-request cap (sglang --max-running-requests, vLLM --max-num-seqs) or KV size")
    kv = _server_series(inp, first.point)
    kv_max = _num(kv, "kv_cache_usage_pct_max")  # percent
    if kv_max is not None:
        ev.append(Evidence(f"KV cache usage (max) at c={first.concurrency}", round(kv_max, 1), "%",
                           "telemetry_summary.json server.kv_cache_usage_pct_max"))
        if kv_max < 90.0:
            recs.append(f"KV cache has headroom ({kv_max:.0f}% used): raise {setting}.")
        else:
            recs.append("KV cache is full: give it more memory (or quantise the KV cache) before raising the cap.")
    else:
        recs.append(f"Raise {setting} if KV memory allows; check the server's KV usage.")
    recs.append("Throughput beyond this point is bought with queueing (TTFT), not with more batch.")
    return Finding(
        id="scheduler_ceiling",
        title=f"Scheduler / KV ceiling of ~{cap} running requests",
        severity="critical",
        confidence=confidence,
        verdict=(
            f"From c={first.concurrency} on, the server runs at most ~{cap} requests at once and queues the rest "
            f"(evidence from {how}); extra concurrency only lengthens the queue."
        ),
        evidence=tuple(ev),
        points=(first.point,),
        recommendations=tuple(recs),
    )


def _gpu_points(inp: Inputs) -> list[dict[str, Any]]:
    return [p for p in inp.telemetry.get("points", []) or [] if isinstance(p, dict)]


def _gpu_aggregate(tp: dict[str, Any]) -> dict[str, Any]:
    agg = tp.get("aggregate")
    if isinstance(agg, dict) and agg:
        return agg
    gpus = _per_gpu(tp)
    if not gpus:
        return {}
    out: dict[str, Any] = {}
    for key in gpus[0][1]:
        vals = [v for _, g in gpus if isinstance(v := g.get(key), (int, float)) and not isinstance(v, bool)]
        if vals:
            out[key] = statistics.fmean(vals)
    reasons: set[str] = set()
    for _, g in gpus:
        frac = g.get("clock_event_reasons_fraction") or {}
        if isinstance(frac, dict):
            reasons |= {k for k, v in frac.items() if isinstance(v, (int, float)) and v >= 0.25}
    out["clock_event_reasons"] = ";".join(sorted(reasons))
    return out


def _per_gpu(tp: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The per-GPU aggregates of a telemetry point, as (gpu index, stats) pairs."""
    gpus = tp.get("gpus") or {}
    if isinstance(gpus, dict):
        return [(str(k), v) for k, v in sorted(gpus.items()) if isinstance(v, dict)]
    return [(str(i), v) for i, v in enumerate(gpus) if isinstance(v, dict)]


#: Spread (max - min) / mean across GPUs above which one GPU is called a straggler.
IMBALANCE_SPREAD = 0.20


def rule_gpu_imbalance(inp: Inputs) -> Finding | None:
    """One GPU doing more work than the others (straggler experts hold every step at the collectives)."""
    for tp in _gpu_points(inp):
        gpus = _per_gpu(tp)
        if len(gpus) < 2:
            continue
        for key, label in (("gpm_tensor_active_pct_mean", "tensor-pipe activity"),
                           ("gpm_sm_active_pct_mean", "SM activity"), ("power_w_mean", "power")):
            vals = [(i, float(g[key])) for i, g in gpus if isinstance(g.get(key), (int, float))]
            if len(vals) < 2:
                continue
            mean = statistics.fmean(v for _, v in vals)
            hi = max(vals, key=lambda x: x[1])
            lo = min(vals, key=lambda x: x[1])
            if mean <= 0 or (hi[1] - lo[1]) / mean < IMBALANCE_SPREAD:
                continue
            point = int(tp.get("point", -1))
            src = f"telemetry_summary.json point {point} gpus.*.{key}"
            return Finding(
                id="gpu_imbalance", title=f"GPU {hi[0]} works harder than the others ({label})",
                severity="warning", confidence="medium",
                verdict=(f"At point {point} GPU {hi[0]} shows {hi[1]:.1f} {label} vs {lo[1]:.1f} on GPU {lo[0]} "
                         f"(spread {100 * (hi[1] - lo[1]) / mean:.0f}% of the mean): the busiest GPU sets the step "
                         "time and the others wait at the collectives."),
                evidence=tuple(Evidence(f"GPU {i} {label}", round(v, 1), None, src) for i, v in vals),
                points=(point,),
                recommendations=("With expert parallelism, balance experts across GPUs (EPLB / redundant experts).",
                                 "Check that all GPUs run at the same clocks and power limit."),
            )
    return None


def _roofline_point(inp: Inputs, concurrency: int | None) -> dict[str, Any]:
    for p in inp.roofline.get("points", []) or []:
        if isinstance(p, dict) and p.get("concurrency") == concurrency:
            return p
    return {}


def rule_gpu_efficiency(inp: Inputs) -> list[Finding]:
    """Kernel-efficiency floor, power/thermal cap, or host-bound engine, from GPU counters."""
    knee, _ = find_knee(inp.points)
    tps = {int(p.get("point", -1)): p for p in _gpu_points(inp)}
    if not tps:
        return []
    target = knee or (inp.points[-1] if inp.points else None)
    if target is None or target.point not in tps:
        return []
    g = _gpu_aggregate(tps[target.point])
    util = _num(g, "gpu_util_pct_mean")
    power = _num(g, "power_w_mean")
    limit = _num(g, "power_limit_w")
    pct_limit = _num(g, "power_limit_pct")
    if pct_limit is None and power is not None and limit:
        pct_limit = 100 * power / limit
    clock_frac = _num(g, "sm_clock_pct_of_max")
    clock_frac = clock_frac / 100 if clock_frac is not None else None
    tensor = _num(g, "gpm_tensor_active_pct_mean")
    dram = _num(g, "gpm_dram_bw_pct_mean")
    src = f"telemetry_summary.json point {target.point}"
    ev = [
        Evidence("GPU utilisation (NVML, mean)", _r(util), "%", src),
        Evidence("power (mean)", _r(power), "W", src),
        Evidence("power as % of limit", _r(pct_limit), "%", src),
        Evidence("SM clock as % of max", _r(100 * clock_frac) if clock_frac is not None else None, "%", src),
        Evidence("tensor-pipe activity (GPM, mean)", _r(tensor), "%", src),
        Evidence("DRAM bandwidth utilisation (GPM, mean)", _r(dram), "%", src),
    ]
    ev = [e for e in ev if e.value is not None]
    rp = _roofline_point(inp, target.concurrency)
    if rp:
        for key, label, unit in (
            ("tokens_per_expert_mean", "tokens per expert (roofline, mean)", "tokens"),
            ("tokens_per_expert_max", "tokens per expert (roofline, max)", "tokens"),
            ("tok_s_upper_bound", "roofline upper bound", "tok/s"),
            ("bound", "roofline bound", None),
        ):
            if key in rp:
                ev.append(Evidence(label, _r(rp[key]) if isinstance(rp[key], float) else rp[key], unit,
                                   f"roofline.json c={target.concurrency}"))
        cal = inp.roofline.get("calibration")
        for g in rp.get("gemms", []) or []:
            eff = g.get("efficiency") if isinstance(g, dict) else None
            if cal and str(g.get("group")) == "experts" and isinstance(eff, (int, float)):
                ev.append(Evidence(f"{g.get('name')} efficiency measured by `servescope kernels`",
                                   _r(100 * eff), "% of ideal", f"roofline.json calibration {cal.get('source')}"))
        bound = rp.get("tok_s_upper_bound")
        if isinstance(bound, (int, float)) and bound > 0 and target.output_tok_s:
            ev.append(Evidence("measured output throughput as % of the roofline bound",
                               _r(100 * target.output_tok_s / bound), "%",
                               f"summary.json output_throughput / roofline.json c={target.concurrency}"))
    findings: list[Finding] = []
    reasons = str(g.get("clock_event_reasons", "") or "")
    if (pct_limit is not None and pct_limit >= 100 * POWER_CAP_FRACTION) or any(
        s in reasons for s in ("sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake")
    ):
        findings.append(Finding(
            id="power_cap", title="GPUs at their power or thermal limit", severity="warning", confidence="high",
            verdict=(f"At c={target.concurrency} the GPUs draw {_fmt(pct_limit)}% of their power limit"
                     + (f" with clock-event reasons {reasons}" if reasons else "")
                     + ": clocks drop to stay within it, so throughput is capped by power, not by kernels."),
            evidence=tuple(ev), points=(target.point,),
            recommendations=("Check cooling and the power limit; a higher limit or better airflow buys clock.",
                             "Lower-energy kernels (FP8/FP4) do more work per joule at the same cap."),
        ))
        return findings
    busy = util is not None and util >= BUSY_UTIL_PCT
    full_clock = clock_frac is None or clock_frac >= FULL_CLOCK_FRACTION
    low_power = pct_limit is not None and pct_limit < 100 * LOW_POWER_FRACTION
    low_tensor = tensor is not None and tensor < LOW_TENSOR_PCT
    if busy and full_clock and (low_power or low_tensor):
        tpe = rp.get("tokens_per_expert_mean") if rp else None
        pct_peak = _expert_pct_of_peak(rp)
        what = []
        if low_power:
            what.append(f"draw only {_fmt(pct_limit)}% of their power limit")
        if low_tensor:
            what.append(f"keep the tensor pipes {_fmt(tensor)}% busy")
        verdict = (f"At c={target.concurrency} the GPUs report {_fmt(util)}% utilisation at full clocks yet "
                   + " and ".join(what) + ": kernels run but do little matrix work per launch.")
        if tpe is not None:
            verdict += f" Each expert sees ~{tpe:.0f} tokens per decode step"
            if pct_peak is not None:
                verdict += f", so its GEMMs can reach at most {pct_peak:.1f}% of peak"
            verdict += "."
        findings.append(Finding(
            id="kernel_efficiency_floor", title="Kernel-efficiency floor: busy GPUs doing little tensor work",
            severity="critical", confidence="high" if (low_power and low_tensor) else "medium", verdict=verdict,
            evidence=tuple(ev), points=(target.point,),
            recommendations=(
                "Batch more tokens per expert: expert parallelism (EP) instead of TP for the MoE layers, "
                "or more running requests if the scheduler cap allows.",
                "Use a grouped GEMM built for small M (one launch over all experts) and check its tile: "
                "`servescope tiles` shows how much of a 128-row tile is padding at this M.",
                "Cut launch overhead: CUDA graphs, more continuous decode steps per schedule.",
                "Measure the kernels on this GPU with `servescope kernels` and calibrate the roofline with them.",
            ),
        ))
    elif util is not None and util < HOST_BOUND_UTIL_PCT and knee is not None:
        findings.append(Finding(
            id="host_bound", title="The engine is bound by its host side, not by the GPU",
            severity="critical", confidence="medium",
            verdict=(f"Throughput stops rising at c={knee.concurrency} while the GPU is busy only {_fmt(util)}% "
                     "of the time: the scheduler, Python or tokenisation on the CPU sets the pace."),
            evidence=tuple(ev), points=(target.point,),
            recommendations=("Profile the server's CPU side (py-spy); use CUDA graphs, a faster engine or "
                             "more continuous decode steps per scheduling round.",),
        ))
    if dram is not None and rp.get("bound") == "memory":
        findings.append(Finding(
            id="memory_bound", title="Memory-bound decode step (roofline and DRAM counter agree)"
            if dram >= 50 else "Memory-bound by the roofline, yet DRAM bandwidth is not saturated",
            severity="info", confidence="medium",
            verdict=(f"The roofline says the c={target.concurrency} step is memory-bound; the DRAM counter reads "
                     f"{_fmt(dram)}% of peak bandwidth."),
            evidence=tuple(ev), points=(target.point,),
            recommendations=("Weight bytes dominate: lower-precision weights or more tokens per weight read "
                             "(larger batch per expert) raise throughput.",),
        ))
    return findings


def _expert_pct_of_peak(rp: dict[str, Any]) -> float | None:
    for g in rp.get("gemms", []) or []:
        if not isinstance(g, dict) or "expert" not in str(g.get("name", "")):
            continue
        if isinstance(g.get("pct_of_peak"), (int, float)):
            return float(g["pct_of_peak"])
    return None


def _failed_under_load(p: PointView) -> int:
    """Failures the server caused: requests cancelled because the user stopped the run don't count."""
    return max(0, p.failed - p.failures_by_kind.get("cancelled", 0))


def rule_failures(inp: Inputs) -> Finding | None:
    bad = [p for p in inp.points if _failed_under_load(p) > 0]
    if not bad:
        return None
    total = sum(_failed_under_load(p) for p in bad)
    kinds: dict[str, int] = {}
    for p in bad:
        for k, v in p.failures_by_kind.items():
            if k != "cancelled":
                kinds[k] = kinds.get(k, 0) + v
    ev = [Evidence(f"failed at {p.label}", _failed_under_load(p), "requests", "summary.json failed") for p in bad]
    ev += [Evidence(f"failures: {k}", v, "requests", "summary.json failures_by_kind") for k, v in sorted(kinds.items())]
    worst = max(bad, key=lambda p: _failed_under_load(p) / max(1, p.failed + p.completed))
    frac = _failed_under_load(worst) / max(1, worst.failed + worst.completed)
    return Finding(
        id="failures", title=f"{total} failed requests under load", severity="critical" if frac >= 0.05 else "warning",
        confidence="high",
        verdict=(f"{total} requests failed ({_kinds_text(kinds)});"
                 f" worst at {worst.label} ({100 * frac:.1f}%). Failed requests are counted, not dropped."),
        evidence=tuple(ev), points=tuple(p.point for p in bad),
        recommendations=("Read the error texts in requests.jsonl; timeouts under load usually mean queueing past "
                         "the client's --timeout-s.",),
    )


def _kinds_text(kinds: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) or "see records"


def rule_client_limited(inp: Inputs) -> Finding | None:
    bad = [p for p in inp.points if p.client_limited]
    if not bad:
        return None
    return Finding(
        id="client_limited", title="The load generator itself distorted some points", severity="warning",
        confidence="high",
        verdict=(f"At {', '.join(p.label for p in bad)} the client fell behind (event-loop lag, CPU or send "
                 "lateness past its limits): latencies there include the client's own delay."),
        evidence=tuple(Evidence(f"client at {p.label}", "; ".join(p.client_notes) or "flagged", None,
                                "points.jsonl client") for p in bad),
        points=tuple(p.point for p in bad),
        recommendations=("Run the client on a separate, idle machine or with more worker processes; "
                         "`servescope selftest` measures its ceiling here.",),
    )


def rule_tail_latency(inp: Inputs) -> Finding | None:
    worst: tuple[float, PointView] | None = None
    for p in inp.points:
        if p.itl_p50_ms and p.itl_p99_ms and p.itl_p50_ms > 0:
            ratio = p.itl_p99_ms / p.itl_p50_ms
            if worst is None or ratio > worst[0]:
                worst = (ratio, p)
    if worst is None or worst[0] < HEAVY_TAIL_RATIO:
        return None
    ratio, p = worst
    stalls, arrivals_near, arrivals_base = _stalls(inp.requests.get(p.point, []), p.itl_p50_ms or 0.0)
    ev = [
        Evidence(f"ITL p50 at {p.label}", _r(p.itl_p50_ms), "ms", "summary.json median_itl_ms"),
        Evidence(f"ITL p99 at {p.label}", _r(p.itl_p99_ms), "ms", "summary.json p99_itl_ms"),
        Evidence("P99 / median", _r(ratio), "x", "summary.json"),
        Evidence(f"stalls (gap >= {STALL_FACTOR:.0f}x median ITL)", len(stalls), "gaps", "requests.jsonl chunk_ns"),
    ]
    if p.itl_max_ms:
        ev.append(Evidence(f"ITL max at {p.label}", _r(p.itl_max_ms), "ms", "summary.json max_itl_ms"))
    lined_up = ""
    if stalls and arrivals_base is not None and arrivals_near is not None:
        ev.append(Evidence("new requests sent within a stall (per stall)", _r(arrivals_near), "requests",
                           "requests.jsonl send_ns"))
        ev.append(Evidence("new requests sent in a gap of the same length elsewhere", _r(arrivals_base),
                           "requests", "requests.jsonl send_ns"))
        if arrivals_near > 1.5 * max(arrivals_base, 0.1):
            lined_up = " The stalls line up with new arrivals: prefill of new requests pauses running decodes."
    marks = tuple(Mark(t, f"stall {ms:.0f} ms") for t, ms in stalls[:20])
    return Finding(
        id="tail_latency", title=f"Heavy ITL tail: P99 is {ratio:.1f}x the median at {p.label}",
        severity="warning", confidence="high" if len(stalls) >= 3 else "medium",
        verdict=(f"Inter-token latency p99 {p.itl_p99_ms:.0f} ms vs median {p.itl_p50_ms:.0f} ms at {p.label}; "
                 f"{len(stalls)} stalls of >= {STALL_FACTOR:.0f}x the median." + lined_up),
        evidence=tuple(ev), points=(p.point,), marks=marks,
        recommendations=(
            "Chunked prefill (a smaller prefill chunk) or a prefill/decode split keeps decodes running.",
            "Check the client first: see the client-limited finding and `servescope selftest`.",
        ),
    )


def _stalls(recs: list[RequestRecord], median_ms: float) -> tuple[list[tuple[int, float]], float | None, float | None]:
    """Inter-chunk gaps >= STALL_FACTOR x the median ITL, and how many requests were sent inside them."""
    if median_ms <= 0:
        return [], None, None
    threshold_ns = STALL_FACTOR * median_ms * 1e6
    stalls: list[tuple[int, int]] = []
    for r in recs:
        times = ([r.first_token_ns] if r.first_token_ns is not None else []) + list(r.chunk_ns)
        times = sorted(set(times))
        for a, b in itertools.pairwise(times):
            if b - a >= threshold_ns:
                stalls.append((a, b))
    if not stalls:
        return [], None, None
    sends = sorted(r.send_ns for r in recs)
    def count(a: int, b: int) -> int:
        return bisect.bisect_right(sends, b) - bisect.bisect_left(sends, a)

    near = statistics.fmean(count(a, b) for a, b in stalls)
    t0, t1 = sends[0], max(r.end_ns for r in recs)
    mean_len = statistics.fmean(b - a for a, b in stalls)
    n_windows = max(1, int((t1 - t0) // max(1, mean_len)))
    base = len(sends) / n_windows
    merged = sorted({a: (b - a) / 1e6 for a, b in stalls}.items())
    return merged, near, base


def _r(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 2) if abs(v) < 100 else round(v, 1)
    return v


def _fmt(v: float | None) -> str:
    return "?" if v is None else f"{v:.0f}"


RULES = ("plateau", "scheduler_ceiling", "gpu", "failures", "client_limited", "tail_latency")


def diagnose_inputs(inp: Inputs) -> Diagnosis:
    """Apply every rule to loaded inputs (pure: unit-testable without files)."""
    findings: list[Finding] = []
    for f in (rule_plateau(inp), rule_scheduler_ceiling(inp)):
        if f is not None:
            findings.append(f)
    findings.extend(rule_gpu_efficiency(inp))
    imbalance = rule_gpu_imbalance(inp)
    if imbalance is not None:
        findings.append(imbalance)
    for f in (rule_failures(inp), rule_client_limited(inp), rule_tail_latency(inp)):
        if f is not None:
            findings.append(f)
    order = {"critical": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: order.get(f.severity, 3))
    notes = list(inp.notes)
    cancelled = sum(p.failures_by_kind.get("cancelled", 0) for p in inp.points)
    if cancelled:
        notes.append(f"the run was interrupted: {cancelled} in-flight request(s) recorded as cancelled")
    if not inp.points:
        notes.append("no completed sweep point in this run")
    headline = _headline(findings, inp)
    return Diagnosis(headline=headline, findings=tuple(findings), notes=tuple(notes))


def _headline(findings: list[Finding], inp: Inputs) -> str:
    if not inp.points:
        return "No measurements to diagnose."
    crit = [f for f in findings if f.severity == "critical"]
    plateau = next((f for f in findings if f.id == "plateau"), None)
    parts = []
    if plateau is not None:
        parts.append(plateau.title)
    parts += [f.title for f in crit]
    if not parts:
        peak = max((p.output_tok_s or 0.0) for p in inp.points)
        return f"Peak {peak:.0f} output tok/s; no limiting cause found."
    return "; ".join(parts) + "."


def diagnose(run: RunDir) -> Diagnosis:
    """Diagnose a run directory (reads only the files measurement wrote)."""
    return diagnose_inputs(load_inputs(run))


def write_diagnosis(run: RunDir) -> Path:
    """Diagnose and write diagnosis.json into the run directory."""
    return run.write_json(DIAGNOSIS, diagnose(run).to_dict())
