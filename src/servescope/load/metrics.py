"""Per-point serving metrics, recomputed from the raw records: a pure function.

``summarize(requests, points)`` never reads a clock, a server or a file, so a formula
can be fixed and every past run re-summarised (``summarize_run`` does the file part).
Names follow vLLM's ``bench serve`` (and sglang's ``bench_serving`` where vLLM has none);
``docs/metrics.md`` gives each formula, its source, and the AIPerf / guidellm /
inference-perf aliases. Where we deliberately differ from a peer (chunk-aware ITL, the
first token needs a token, failures never dropped) the doc says so.

Only requests of phase ``measure`` enter the whole-run numbers; latency distributions
use completed (``ok``) requests only, and failures are counted by kind beside them. The
steady-state window uses every request of the point (warm-up included), because it
measures what the server delivered while the target load was actually in flight.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from servescope.load.records import PointRecord, RequestRecord
from servescope.run import POINTS, REQUESTS, SUMMARY, RunDir

#: Percentiles reported for every latency (vLLM's default set is 99; we add 50/90/95).
PERCENTILES = (50, 90, 95, 99)
#: In-flight fraction of the target that defines the steady-state window (issue #3).
STEADY_FRACTION = 0.9
#: A step whose throughput gain is below this fraction of the proportional gain is flat.
KNEE_EFFICIENCY = 0.1
#: The knee: the lowest concurrency whose throughput reaches this fraction of the sweep's best.
KNEE_FRACTION_OF_PEAK = 0.9
#: Client self-check thresholds above which a point is flagged "client-limited".
CLIENT_LAG_P99_MS = 10.0
CLIENT_CPU_PCT = 90.0
CLIENT_LATENESS_P99_MS = 10.0
CLIENT_ADDED_DELAY_P99_MS = 10.0

_NS_PER_MS = 1e6
_NS_PER_S = 1e9


def _as_req(r: RequestRecord | dict[str, Any]) -> RequestRecord:
    return r if isinstance(r, RequestRecord) else RequestRecord.from_dict(r)


def _as_point(p: PointRecord | dict[str, Any]) -> PointRecord:
    return p if isinstance(p, PointRecord) else PointRecord.from_dict(p)


def distribution(name: str, values_ms: Sequence[float]) -> dict[str, float | None]:
    """``mean/median/std/min/max/pNN`` of ``values_ms`` under vLLM's names (``{stat}_{name}_ms``).

    Percentiles are numpy's linear interpolation, as vLLM (``np.percentile``); std is the
    population standard deviation (``np.std``), as vLLM. Empty input gives ``None``s.
    """
    keys = ["mean", "median", "std", "min", "max", *(f"p{p}" for p in PERCENTILES)]
    if len(values_ms) == 0:
        return {f"{k}_{name}_ms": None for k in keys}
    a = np.asarray(values_ms, dtype=float)
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(a.mean()),
        f"median_{name}_ms": float(np.median(a)),
        f"std_{name}_ms": float(a.std()),
        f"min_{name}_ms": float(a.min()),
        f"max_{name}_ms": float(a.max()),
    }
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{p}_{name}_ms"] = float(v)
    return out


def request_ttft_ms(r: RequestRecord) -> float | None:
    """Send to the first chunk that carried an output token."""
    if r.first_token_ns is None:
        return None
    return (r.first_token_ns - r.send_ns) / _NS_PER_MS


def request_e2el_ms(r: RequestRecord) -> float:
    """Send to the last byte of the reply (includes a trailing usage chunk and [DONE])."""
    return (r.end_ns - r.send_ns) / _NS_PER_MS


def request_tpot_ms(r: RequestRecord) -> float | None:
    """(last token chunk - first token chunk) / (output_tokens - 1); vLLM's TPOT with the server's count."""
    n = r.output_tokens or 0
    if n < 2 or r.first_token_ns is None or not r.chunk_ns:
        return None
    return (r.chunk_ns[-1] - r.first_token_ns) / (n - 1) / _NS_PER_MS


def request_itl_ms(r: RequestRecord) -> list[float]:
    """Chunk-aware ITL: chunk i>0 carrying n tokens adds n entries of gap_i / n.

    The first chunk's extra tokens add none (they arrived with the first token, which
    TTFT covers), exactly as sglang's native client splits a multi-token gap
    (sglang bench_serving, ``async_request_sglang_generate``).
    """
    out: list[float] = []
    ts, ns = r.chunk_ns, r.chunk_tokens
    for i in range(1, len(ts)):
        n = ns[i] if i < len(ns) and ns[i] > 0 else 1
        gap = (ts[i] - ts[i - 1]) / _NS_PER_MS / n
        out.extend([gap] * n)
    return out


def request_icl_ms(r: RequestRecord) -> list[float]:
    """Inter-chunk latency: one entry per gap between token-bearing chunks (AIPerf's ICL)."""
    ts = r.chunk_ns
    return [(ts[i] - ts[i - 1]) / _NS_PER_MS for i in range(1, len(ts))]


def _queue_ms(r: RequestRecord) -> float:
    slot = r.slot_ns if r.slot_ns is not None else r.scheduled_ns
    return max(0, slot - r.scheduled_ns) / _NS_PER_MS


def _lateness_ms(r: RequestRecord) -> float:
    slot = r.slot_ns if r.slot_ns is not None else r.scheduled_ns
    return max(0, r.send_ns - slot) / _NS_PER_MS


def _meets_slo(r: RequestRecord, slo: dict[str, float]) -> bool:
    checks = {"ttft_ms": request_ttft_ms(r), "tpot_ms": request_tpot_ms(r), "e2el_ms": request_e2el_ms(r)}
    for key, limit in slo.items():
        v = checks.get(key)
        if v is not None and v > limit:
            return False
        if v is None and key == "ttft_ms":
            return False
    return True


def chunk_weights(r: RequestRecord) -> tuple[float, ...]:
    """Tokens per chunk for throughput-over-time: ``chunk_tokens`` scaled to the server's total.

    When per-chunk counts are unknown (``chunk_tokens_source == "count"``) and the server's
    usage says more tokens than chunks (transformers serve holds back partial characters),
    each chunk carries output_tokens / chunks: an approximation, flagged in the warnings.
    """
    total = sum(r.chunk_tokens)
    if not r.chunk_tokens or not r.output_tokens or total == r.output_tokens or total == 0:
        return tuple(float(n) for n in r.chunk_tokens)
    k = r.output_tokens / total
    return tuple(n * k for n in r.chunk_tokens)


def peak_concurrency(reqs: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (vLLM's ``max_concurrent_requests``)."""
    events = sorted([(r.send_ns, 1) for r in reqs] + [(r.end_ns, -1) for r in reqs], key=lambda e: (e[0], e[1]))
    cur = best = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def peak_output_tok_s(reqs: Sequence[RequestRecord], origin_ns: int) -> float:
    """Most output tokens arriving in one 1-s bucket from ``origin_ns`` (vLLM's ``max_output_tokens_per_s``).

    Counts each chunk's token delta, so multi-token chunks are not undercounted
    (vLLM counts one token per ITL entry: sglang#33193).
    """
    buckets: Counter[int] = Counter()
    for r in reqs:
        for t, n in zip(r.chunk_ns, chunk_weights(r), strict=False):
            buckets[(t - origin_ns) // 1_000_000_000] += n
    return float(max(buckets.values())) if buckets else 0.0


def steady_window(all_reqs: Sequence[RequestRecord], measured: Sequence[RequestRecord],
                  target: int | None) -> tuple[int, int] | None:
    """The steady-state window (ns): in flight >= 90% of ``target``, from the first measured send.

    Starts when in-flight (all requests of the point) first reaches ceil(0.9 * target) at
    or after the first measured send, ends at its last fall below that level. Without a
    target (open loop), it spans first to last measured send: the arrival period, without
    the drain tail.
    """
    if not measured:
        return None
    first_send = min(r.send_ns for r in measured)
    if not target:
        last_send = max(r.send_ns for r in measured)
        return (first_send, last_send) if last_send > first_send else None
    need = max(1, math.ceil(STEADY_FRACTION * target))
    events = sorted([(r.send_ns, 1) for r in all_reqs] + [(r.end_ns, -1) for r in all_reqs],
                    key=lambda e: (e[0], -e[1]))
    cur = 0
    start = end = None
    for t, d in events:
        before = cur
        cur += d
        if t < first_send:
            continue
        if start is None:
            if cur >= need:
                start = t
        elif cur < need <= before:
            end = t  # the last fall below the level wins
    if start is None or end is None or end <= start:
        return None
    return start, end


def _steady_metrics(win: tuple[int, int], all_reqs: Sequence[RequestRecord]) -> dict[str, Any]:
    s, e = win
    dur_s = (e - s) / _NS_PER_S
    tokens = 0.0
    itl: list[float] = []
    for r in all_reqs:
        prev = None
        for t, n, w in zip(r.chunk_ns, r.chunk_tokens, chunk_weights(r), strict=False):
            if s <= t <= e:
                tokens += w
                if prev is not None and r.ok:
                    itl.extend([(t - prev) / _NS_PER_MS / max(n, 1)] * max(n, 1))
            prev = t
    done = [r for r in all_reqs if r.ok and s <= r.end_ns <= e]
    ttft = [v for r in all_reqs if r.ok and s <= r.send_ns <= e and (v := request_ttft_ms(r)) is not None]
    # Time-weighted mean in flight over the window.
    area = sum(max(0, min(r.end_ns, e) - max(r.send_ns, s)) for r in all_reqs)
    return {
        "start_ns": s,
        "end_ns": e,
        "duration_s": dur_s,
        "output_throughput": tokens / dur_s if dur_s > 0 else None,
        "request_throughput": len(done) / dur_s if dur_s > 0 else None,
        "mean_in_flight": area / (e - s) if e > s else None,
        "median_itl_ms": float(np.median(itl)) if itl else None,
        "p99_itl_ms": float(np.percentile(itl, 99)) if itl else None,
        "median_ttft_ms": float(np.median(ttft)) if ttft else None,
        "p99_ttft_ms": float(np.percentile(ttft, 99)) if ttft else None,
    }


def summarize_point(point: PointRecord | None, reqs_all: Sequence[RequestRecord],
                    slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The metrics of one sweep point (see docs/metrics.md for every formula)."""
    measured = [r for r in reqs_all if r.phase == "measure"]
    ok = [r for r in measured if r.ok]
    warnings: list[str] = []
    out: dict[str, Any] = {}
    if point is not None:
        out.update(point=point.point, label=point.label, target_concurrency=point.concurrency,
                   request_rate=point.request_rate, interrupted=point.interrupted)
    elif reqs_all:
        out.update(point=reqs_all[0].point, label=f"point {reqs_all[0].point}", target_concurrency=None,
                   request_rate=None, interrupted=False)
    kinds = Counter(r.error_kind or "unknown" for r in measured if not r.ok)
    out["num_requests"] = len(measured)
    out["num_warmup"] = len(reqs_all) - len(measured)
    out["completed"] = len(ok)
    out["failed"] = len(measured) - len(ok)
    out["failures_by_kind"] = dict(sorted(kinds.items()))
    if measured:
        start = min(r.scheduled_ns for r in measured)
        end = max(r.end_ns for r in measured)
        duration_s = (end - start) / _NS_PER_S
    else:
        start = end = 0
        duration_s = 0.0
    out["duration_s"] = duration_s
    in_tok = sum(r.prompt_tokens or 0 for r in ok)
    out_tok = sum(r.output_tokens or 0 for r in ok)
    out["total_input_tokens"] = in_tok
    out["total_output_tokens"] = out_tok
    out["request_throughput"] = len(ok) / duration_s if duration_s > 0 else None
    out["output_throughput"] = out_tok / duration_s if duration_s > 0 else None
    out["total_token_throughput"] = (in_tok + out_tok) / duration_s if duration_s > 0 else None
    ttft = [v for r in ok if (v := request_ttft_ms(r)) is not None]
    tpot = [v for r in ok if (v := request_tpot_ms(r)) is not None]
    e2el = [request_e2el_ms(r) for r in ok]
    itl = [v for r in ok for v in request_itl_ms(r)]
    icl = [v for r in ok for v in request_icl_ms(r)]
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("icl", icl), ("e2el", e2el)):
        out.update(distribution(name, vals))
    out["concurrency"] = sum(e2el) / 1e3 / duration_s if duration_s > 0 else None
    out["max_concurrent_requests"] = peak_concurrency(reqs_all) if reqs_all else 0
    out["max_output_tokens_per_s"] = peak_output_tok_s(ok, start) if ok else 0.0
    queue = [_queue_ms(r) for r in measured]
    late = [_lateness_ms(r) for r in measured]
    out.update(distribution("client_queue", queue))
    out.update(distribution("send_lateness", late))
    if slo:
        good = [r for r in ok if _meets_slo(r, slo)]
        out["slo"] = dict(slo)
        out["request_goodput"] = len(good) / duration_s if duration_s > 0 else None
        out["goodput_fraction"] = len(good) / len(measured) if measured else None
    # Token-count provenance: never trust silently.
    out_src = Counter(r.output_tokens_source for r in ok)
    chunk_src = Counter(r.chunk_tokens_source for r in ok)
    out["output_tokens_sources"] = dict(sorted(out_src.items()))
    out["chunk_tokens_sources"] = dict(sorted(chunk_src.items()))
    n_not_usage = sum(v for k, v in out_src.items() if k != "usage")
    if n_not_usage:
        warnings.append(f"{n_not_usage} of {len(ok)} completed requests have no server token count "
                        f"(sources {dict(out_src)}): output tokens counted from chunks, which undercounts "
                        "multi-token chunks")
    if ok and chunk_src.get("count", 0):
        warnings.append("per-chunk token counts not sent by the server (no continuous usage): ITL treats each "
                        "chunk as one token, so ITL equals inter-chunk latency; TPOT uses the server's total")
    mismatched = [r for r in ok if r.requested_output_tokens and r.output_tokens is not None
                  and r.output_tokens != r.requested_output_tokens]
    out["requests_with_output_len_mismatch"] = len(mismatched)
    # Steady-state window.
    target = point.concurrency if point is not None else None
    if point is not None and point.request_rate is not None and point.concurrency is None:
        target = None
    win = steady_window(reqs_all, measured, target)
    if win is None:
        out["steady_state"] = None
        if measured:
            warnings.append("no steady-state window: in-flight never held >= 90% of the target after warm-up")
    else:
        ss = _steady_metrics(win, reqs_all)
        out["steady_state"] = ss
        if duration_s > 0 and ss["duration_s"] < 0.5 * duration_s:
            warnings.append(f"steady-state window is only {ss['duration_s']:.2f} s of {duration_s:.2f} s: "
                            "ramp-up and drain dominate; use more requests or --duration")
    # Client self-check.
    client = dict(point.client) if point is not None else {}
    delays = [(t - s) / _NS_PER_MS for r in ok
              for t, s in zip(r.chunk_ns, r.chunk_send_ns, strict=False)]
    if delays:
        d = distribution("added_delay", delays)
        client.update({k: d[k] for k in ("mean_added_delay_ms", "median_added_delay_ms", "p99_added_delay_ms",
                                         "max_added_delay_ms")})
    reasons = client_limited_reasons(client, out.get("p99_send_lateness_ms"))
    client["client_limited"] = bool(reasons)
    client["client_limited_reasons"] = reasons
    out["client"] = client
    if reasons:
        warnings.append("client-limited: " + "; ".join(reasons))
    if out["failed"]:
        warnings.append(f"{out['failed']} of {len(measured)} requests failed: {dict(kinds)}")
    if 0 < len(ok) < 30:
        warnings.append(f"only {len(ok)} completed requests: percentiles are rough")
    out["warnings"] = warnings
    return out


def client_limited_reasons(client: dict[str, Any], lateness_p99_ms: float | None) -> list[str]:
    """Why the client itself may have distorted a point (empty when it did not)."""
    reasons = []
    lag = client.get("loop_lag_p99_ms")
    if lag is not None and lag > CLIENT_LAG_P99_MS:
        reasons.append(f"event-loop lag p99 {lag:.1f} ms > {CLIENT_LAG_P99_MS:g} ms")
    cpu = client.get("cpu_pct")
    if cpu is not None and cpu > CLIENT_CPU_PCT:
        reasons.append(f"client CPU {cpu:.0f}% of a core > {CLIENT_CPU_PCT:g}%")
    if lateness_p99_ms is not None and lateness_p99_ms > CLIENT_LATENESS_P99_MS:
        reasons.append(f"send lateness p99 {lateness_p99_ms:.1f} ms > {CLIENT_LATENESS_P99_MS:g} ms")
    ad = client.get("p99_added_delay_ms")
    if ad is not None and ad > CLIENT_ADDED_DELAY_P99_MS:
        reasons.append(f"added delay p99 {ad:.1f} ms > {CLIENT_ADDED_DELAY_P99_MS:g} ms")
    return reasons


def scaling(points: Sequence[dict[str, Any]], key: str = "output_throughput") -> dict[str, Any]:
    """Scaling efficiency between consecutive closed-loop points, and the knee.

    efficiency_i = (T_i / T_{i-1} - 1) / (c_i / c_{i-1} - 1): 1 when throughput grows in
    proportion to concurrency, 0 when flat, negative when it falls. The knee is the lowest
    concurrency reaching KNEE_FRACTION_OF_PEAK of the best throughput (None when only the
    last point does, i.e. throughput still rises).
    """
    tc = "target_concurrency"
    pts = sorted((p for p in points if p.get(tc) and p.get(key) and p.get("request_rate") is None),
                 key=lambda p: p[tc])
    steps = []
    for a, b in itertools.pairwise(pts):
        if b[tc] == a[tc]:
            continue
        eff = (b[key] / a[key] - 1) / (b[tc] / a[tc] - 1)
        steps.append({"from": a[tc], "to": b[tc], "throughput_ratio": b[key] / a[key], "efficiency": eff})
    # The knee is read against the sweep's best throughput rather than step by step: on a
    # shared machine one noisy point can make a single step look flat (or steep), but it
    # rarely moves which concurrency first gets within 10% of the best. When that is the
    # last point, throughput was still rising and there is no knee yet.
    best = max(pts, key=lambda p: p[key]) if pts else None
    knee = None
    if best is not None and len(pts) >= 2:
        first = next(p for p in pts if p[key] >= KNEE_FRACTION_OF_PEAK * best[key])
        if first is not pts[-1]:
            knee = first[tc]
    return {"metric": key, "steps": steps, "knee_concurrency": knee,
            "max_throughput": best[key] if best else None,
            "max_throughput_concurrency": best[tc] if best else None}


def summarize(requests: Iterable[RequestRecord | dict[str, Any]], points: Iterable[PointRecord | dict[str, Any]],
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Every point's metrics plus sweep-level scaling, from raw records only (pure)."""
    reqs = [_as_req(r) for r in requests]
    pts = {p.point: p for p in (_as_point(p) for p in points)}
    by_point: dict[int, list[RequestRecord]] = {}
    for r in reqs:
        by_point.setdefault(r.point, []).append(r)
    out_points = [summarize_point(pts.get(i), by_point.get(i, []), slo) for i in sorted(set(pts) | set(by_point))]
    warnings = [f"{p['label']}: {w}" for p in out_points for w in p["warnings"]]
    notes: list[str] = []
    for p in pts.values():
        for n in p.extra.get("notes", ()):
            if n not in notes:
                notes.append(n)
    return {
        "points": out_points,
        "interrupted": any(p.interrupted for p in pts.values()),
        "notes": notes,
        "scaling": scaling(out_points),
        "scaling_steady_state": scaling(
            [{**p, "ss_tput": (p["steady_state"] or {}).get("output_throughput")} for p in out_points], "ss_tput"),
        "warnings": warnings,
        "formulas": "docs/metrics.md",
    }


def summarize_run(run: RunDir) -> dict[str, Any]:
    """Recompute ``summary.json`` from ``requests.jsonl`` and ``points.jsonl``; returns it."""
    slo = (run.config.get("slo") or None) if run.exists("config.json") else None
    summary = summarize(run.iter_jsonl(REQUESTS), run.iter_jsonl(POINTS), slo)
    run.write_json(SUMMARY, summary)
    return summary
