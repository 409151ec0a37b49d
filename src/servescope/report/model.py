"""Everything a report shows, gathered from a run directory into plain data.

The renderers (``html.py``, ``markdown.py``, ``plots.py``) never open a file: they take a
``ReportModel``, so both formats show the same numbers and a test can check one model
instead of two documents. Gathering is deliberately forgiving, because a report is most
needed after something went wrong: a missing or malformed file, an unknown field, a sweep
point without its ``points.jsonl`` line (a crash mid-point) each become a note in
``ReportModel.notes`` and a "not recorded" section, never an exception.

Numbers come from the files the measuring side wrote (``summary.json``,
``telemetry_summary.json``, ``roofline.json``, ``diagnosis.json``); where a summary is
missing, the load metrics are recomputed from ``requests.jsonl`` by ``load.metrics`` (the
pure functions that write summary.json), so the numbers cannot drift apart.
"""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from servescope import run as rundir
from servescope.diagnose import Evidence, Finding, Mark
from servescope.errors import RunDirError
from servescope.load import metrics as load_metrics
from servescope.load.records import PointRecord, RequestRecord
from servescope.run import RunDir

log = logging.getLogger(__name__)

#: Probabilities at which each point's ITL distribution is kept for plotting: dense in
#: the tail, because the seed's story is a 12x gap between the median and the P99.
ITL_PROBS: tuple[float, ...] = tuple(
    sorted(
        {round(p, 6) for p in np.linspace(0.0, 0.9, 91)}
        | {round(p, 6) for p in np.linspace(0.9, 0.99, 46)}
        | {round(p, 6) for p in np.linspace(0.99, 0.999, 19)}
        | {0.9995, 0.9999, 1.0}
    )
)

#: Columns of ``telemetry/gpu_samples.csv`` that the timelines plot (docs/run-directory.md).
TIMELINE_COLUMNS = (
    "power_w",
    "power_limit_w",
    "sm_clock_mhz",
    "sm_clock_max_mhz",
    "gpu_util_pct",
    "mem_util_pct",
    "gpm_tensor_active_pct",
    "gpm_sm_active_pct",
    "gpm_dram_bw_pct",
    "temp_c",
)

# --------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class PointView:
    """One sweep point as the report shows it.

    ``recorded`` is False for a point known only from ``requests.jsonl`` (the run stopped
    before its ``points.jsonl`` line was written); its bounds then come from the requests.
    ``metrics`` uses vLLM/sglang names (``output_throughput``, ``p99_itl_ms``...);
    ``metrics_source`` says where they came from. ``itl_values_ms[i]`` is the ITL at
    probability ``ITL_PROBS[i]`` (chunk-aware, measured requests only).
    """

    point: int
    label: str
    concurrency: int | None
    request_rate: float | None
    start_ns: int | None
    measure_start_ns: int | None
    end_ns: int | None
    recorded: bool
    interrupted: bool
    client_limited: bool
    metrics: Mapping[str, float | None] = field(default_factory=dict)
    metrics_source: str = "not recorded"
    itl_values_ms: tuple[float, ...] = ()
    itl_count: int = 0
    errors_by_kind: Mapping[str, int] = field(default_factory=dict)
    error_examples: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    @property
    def x(self) -> float | None:
        """The swept variable: concurrency, else request rate."""
        if self.concurrency is not None:
            return float(self.concurrency)
        return self.request_rate

    def metric(self, name: str) -> float | None:
        """A metric by name; ``median_*`` and ``p50_*`` are the same number under two names."""
        value = self.metrics.get(name)
        if value is None and name.startswith("median_"):
            value = self.metrics.get("p50_" + name[len("median_") :])
        elif value is None and name.startswith("p50_"):
            value = self.metrics.get("median_" + name[len("p50_") :])
        return value


@dataclass
class GpuTimeline:
    """One GPU's samples: times in seconds since the run origin, one array per column (NaN = not offered)."""

    gpu: int
    name: str | None
    t_s: np.ndarray
    columns: dict[str, np.ndarray]
    gap_t_s: np.ndarray  # rows that recorded a sampling error

    def has(self, column: str) -> bool:
        values = self.columns.get(column)
        return values is not None and bool(np.isfinite(values).any())


@dataclass(frozen=True, slots=True)
class RooflinePoint:
    """The analytical model at one concurrency, as far as ``roofline.json`` states it."""

    concurrency: int
    tok_s_upper_bound: float | None
    step_time_us: float | None
    bound: str | None
    flops_per_step: float | None
    bytes_per_step: float | None
    tokens_per_expert_mean: float | None
    tokens_per_expert_max: float | None
    pct_of_peak: float | None

    @property
    def intensity(self) -> float | None:
        """FLOP per byte of the whole decode step."""
        if self.flops_per_step and self.bytes_per_step:
            return self.flops_per_step / self.bytes_per_step
        return None


@dataclass(frozen=True, slots=True)
class Roofline:
    gpu: str | None
    model: str | None
    dtype: str | None
    peak_tflops: float | None
    bandwidth_bytes_s: float | None
    parallelism: str | None  # e.g. "TP 8" or "TP 8, EP 8"
    points: tuple[RooflinePoint, ...]


@dataclass(frozen=True, slots=True)
class TelemetryRow:
    """Per-point aggregates: of one GPU (scope "gpu"), of all GPUs ("all"), or the server's own metrics ("server")."""

    point: int
    scope: str
    gpu: int | None
    values: Mapping[str, float | str | None]


@dataclass
class ReportModel:
    """Everything the report shows. ``notes`` lists what is missing or was repaired, for the reader."""

    run_path: Path
    config: dict[str, Any]
    env: dict[str, Any]
    points: list[PointView]
    knee_point: int | None
    knee_source: str
    gpus: list[GpuTimeline]
    origin_ns: int | None
    telemetry_rows: list[TelemetryRow]
    telemetry_warnings: list[str]
    telemetry_status: str | None  # notes.json "gpu_telemetry": on, or why it is off
    roofline: Roofline | None
    headline: str | None
    findings: list[Finding]
    diagnosis_notes: list[str]
    notes: list[str]
    files: dict[str, bool]  # run-directory file -> present

    @property
    def measured_points(self) -> list[PointView]:
        return [p for p in self.points if p.metrics]

    @property
    def swept(self) -> str:
        """What the sweep varied: "concurrency" or "request rate"."""
        if any(p.concurrency is not None for p in self.points) or not self.points:
            return "concurrency"
        return "request rate"

    def point_by_index(self, index: int) -> PointView | None:
        return next((p for p in self.points if p.point == index), None)

    def t_s(self, t_ns: int | None) -> float | None:
        """A run-clock timestamp as seconds since the report's origin."""
        if t_ns is None or self.origin_ns is None:
            return None
        return (t_ns - self.origin_ns) / 1e9


# --------------------------------------------------------------------------- small helpers


def first(d: Mapping[str, Any] | None, *keys: str, default: Any = None) -> Any:
    """The first present, non-None value among ``keys`` (field names differ between writers)."""
    if not isinstance(d, Mapping):
        return default
    for key in keys:
        value = d.get(key)
        if value is not None:
            return value
    return default


def as_float(value: Any) -> float | None:
    """A finite float, or None (for strings, NaN, booleans and anything unparsable)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def as_int(value: Any) -> int | None:
    f = as_float(value)
    return int(f) if f is not None else None


def _text(value: Any) -> str:
    return "" if value is None else str(value)


# --------------------------------------------------------------------------- gathering


class _Notes:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, text: str) -> None:
        log.info("report: %s", text)
        self.items.append(text)


def _read_json(run: RunDir, name: str, notes: _Notes) -> dict[str, Any] | None:
    if not run.exists(name):
        return None
    try:
        data = run.read_json(name)
    except RunDirError as err:
        notes.add(f"{name} could not be read ({err}); its sections are left out")
        return None
    if not isinstance(data, dict):
        notes.add(f"{name} is not a JSON object; its sections are left out")
        return None
    return data


def _read_records(run: RunDir, name: str, notes: _Notes) -> Iterator[dict[str, Any]]:
    try:
        yield from run.iter_jsonl(name)
    except RunDirError as err:
        notes.add(f"{name}: reading stopped early ({err}); the report shows the lines before it")


def _flatten_summary_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """One summary.json point as a flat dict: metrics at top level (or under "whole_run"),
    the steady-state window's as ``steady_state.<name>``; the original row kept as ``_row``."""
    flat: dict[str, Any] = {}
    for key in ("whole_run", "metrics", "whole", "all"):
        if isinstance(row.get(key), Mapping):
            flat.update(row[key])
    flat.update({k: v for k, v in row.items() if not isinstance(v, (Mapping, list))})
    steady = row.get("steady_state")
    if isinstance(steady, Mapping):
        flat.update({f"steady_state.{k}": v for k, v in steady.items() if not k.endswith("_ns")})
    flat["_row"] = row
    return flat


def _point_rows_from_summary(summary: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    """Per-point metric dicts from summary.json, keyed by point index, whatever the nesting."""
    if not summary:
        return {}
    rows = first(summary, "points", "results", "sweep", default=[])
    if isinstance(rows, Mapping):
        rows = [dict(v, point=as_int(k)) if isinstance(v, Mapping) else {} for k, v in rows.items()]
    out: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        if not isinstance(row, Mapping):
            continue
        idx = as_int(first(row, "point", "index", default=i))
        if idx is not None:
            out[idx] = _flatten_summary_row(row)
    return out


def _knee_at(points: list[PointView], concurrency: Any) -> int | None:
    conc = as_float(concurrency)
    hit = next((p for p in points if conc is not None and p.concurrency is not None and p.concurrency == conc), None)
    return hit.point if hit else None


def _summary_knee(summary: dict[str, Any] | None, points: list[PointView]) -> int | None:
    """The knee load.metrics put in summary.json (``scaling.knee_concurrency``)."""
    scaling = first(summary, "scaling", default=None)
    return _knee_at(points, first(scaling, "knee_concurrency")) if isinstance(scaling, Mapping) else None


def _sweep_values(config: dict[str, Any]) -> list[float]:
    """The swept concurrencies (or rates) the config asked for, to label points without a record.

    ``servescope run`` keeps them under ``job.concurrency``, ``servescope bench`` at the top
    level as ``concurrencies`` / ``request_rates``.
    """
    for holder in (config.get("job"), config.get("sweep"), config):
        if not isinstance(holder, Mapping):
            continue
        values = first(holder, "concurrency", "concurrencies", "request_rates", "rates")
        if isinstance(values, (int, float)):
            values = [values]
        if isinstance(values, list) and values:
            return [v for v in (as_float(x) for x in values) if v is not None]
    return []


def _metric_block(raw: Mapping[str, Any]) -> dict[str, float | None]:
    return {k: as_float(v) for k, v in raw.items() if not k.startswith("_") and as_float(v) is not None}


def _gather_points(
    run: RunDir, config: dict[str, Any], summary: dict[str, Any] | None, notes: _Notes
) -> tuple[list[PointView], int | None]:
    point_records: dict[int, PointRecord] = {}
    for obj in _read_records(run, rundir.POINTS, notes):
        try:
            rec = PointRecord.from_dict(obj)
        except TypeError as err:
            notes.add(f"{rundir.POINTS}: a line is not a point record ({err}); skipped")
            continue
        point_records[rec.point] = rec

    by_point: dict[int, list[RequestRecord]] = {}
    bad = 0
    for obj in _read_records(run, rundir.REQUESTS, notes):
        try:
            rec = RequestRecord.from_dict(obj)
        except TypeError:
            bad += 1
            continue
        by_point.setdefault(rec.point, []).append(rec)
    if bad:
        notes.add(f"{rundir.REQUESTS}: {bad} line(s) are not request records; skipped")

    summary_rows = _point_rows_from_summary(summary)
    sweep_values = _sweep_values(config)
    indices = sorted(set(point_records) | set(by_point) | set(summary_rows))
    points: list[PointView] = []
    for idx in indices:
        rec = point_records.get(idx)
        reqs = by_point.get(idx, [])
        measured = [r for r in reqs if r.phase != "warmup"]
        srow = summary_rows.get(idx, {})
        warnings: list[str] = []

        itls: list[float] = []
        for r in measured:
            if r.ok:
                itls.extend(load_metrics.request_itl_ms(r))  # chunk-aware, the summary's own definition
        itl_arr = np.asarray(itls, dtype=float)
        itl_arr = itl_arr[np.isfinite(itl_arr)]
        itl_values = tuple(float(v) for v in np.quantile(itl_arr, ITL_PROBS)) if itl_arr.size else ()

        if rec is not None:
            conc, rate, label = rec.concurrency, rec.request_rate, rec.label
            start, mstart, end = rec.start_ns, rec.measure_start_ns, rec.end_ns
            interrupted = rec.interrupted
        else:
            row = srow.get("_row", {})
            conc = as_int(first(row, "concurrency_target", "target_concurrency", "max_concurrency"))
            if conc is None and isinstance(row.get("concurrency"), int):
                conc = as_int(row.get("concurrency"))  # an int target; sglang's Little's-law value is a float
            rate = as_float(first(row, "request_rate_target", "request_rate", "target_rate"))
            if conc is None and rate is None and idx < len(sweep_values):
                conc = int(sweep_values[idx])
            label = _text(srow.get("label")) or (f"c={conc}" if conc is not None else f"point {idx}")
            start = min((r.scheduled_ns for r in reqs), default=None)
            mstart = min((r.send_ns for r in measured), default=None)
            end = max((r.end_ns for r in reqs), default=None)
            interrupted = True
            warnings.append("no points.jsonl record: the run stopped during this point; bounds come from its requests")

        metrics: dict[str, float | None] = {}
        source = "not recorded"
        if srow:
            metrics = _metric_block(srow)
            source = rundir.SUMMARY
        elif measured:
            # No summary entry (the run stopped before summarising, or summary.json is gone):
            # recompute with load.metrics, the same pure function that writes summary.json.
            srow = _flatten_summary_row(load_metrics.summarize_point(rec, reqs))
            metrics = _metric_block(srow)
            source = f"{rundir.REQUESTS} (recomputed: no summary.json entry)"

        errors_by_kind: dict[str, int] = {}
        examples: list[str] = []
        for r in measured:
            if not r.ok:
                kind = r.error_kind or "unknown"
                errors_by_kind[kind] = errors_by_kind.get(kind, 0) + 1
                if r.error_text and len(examples) < 3 and r.error_text not in examples:
                    examples.append(r.error_text[:300])
        if not errors_by_kind:
            raw_kinds = first(srow.get("_row", {}), "failures_by_kind", default={})
            if isinstance(raw_kinds, Mapping):
                errors_by_kind = {str(k): n for k, v in raw_kinds.items() if (n := as_int(v))}
        row = srow.get("_row", {})
        summary_client = row.get("client") if isinstance(row.get("client"), Mapping) else {}
        client = {**(rec.client if rec else {}), **summary_client}
        client_limited = bool(first(row, "client_limited", default=False) or client.get("client_limited"))
        for w in first(row, "warnings", default=[]) or []:
            warnings.append(_text(w))
        if interrupted and rec is not None:
            warnings.append("interrupted: the point did not run to its end")
        if client_limited and not any("client-limited" in w for w in warnings):
            reasons = "; ".join(_text(r) for r in client.get("client_limited_reasons") or [])
            warnings.append("client-limited: the load generator itself distorted this point"
                            + (f" ({reasons})" if reasons else ""))
        points.append(
            PointView(
                point=idx,
                label=label or f"point {idx}",
                concurrency=conc,
                request_rate=rate,
                start_ns=start,
                measure_start_ns=mstart,
                end_ns=end,
                recorded=rec is not None,
                interrupted=interrupted,
                client_limited=client_limited,
                metrics=metrics,
                metrics_source=source,
                itl_values_ms=itl_values,
                itl_count=int(itl_arr.size),
                errors_by_kind=errors_by_kind,
                error_examples=tuple(examples),
                warnings=tuple(dict.fromkeys(warnings)),
            )
        )
    points.sort(key=lambda p: (p.x if p.x is not None else math.inf, p.point))
    return points, _summary_knee(summary, points)


def _gather_findings(diagnosis: dict[str, Any] | None) -> list[Finding]:
    findings: list[Finding] = []
    for raw in first(diagnosis, "findings", default=[]) or []:
        if not isinstance(raw, Mapping):
            continue
        evidence = tuple(
            Evidence(
                label=_text(e.get("label")),
                value=e.get("value") if isinstance(e.get("value"), (int, float, str)) else _text(e.get("value")),
                unit=_text(e.get("unit")) or None,
                source=_text(e.get("source")),
            )
            for e in raw.get("evidence") or []
            if isinstance(e, Mapping)
        )
        marks = tuple(
            Mark(t_ns=int(m["t_ns"]), label=_text(m.get("label")))
            for m in raw.get("marks") or []
            if isinstance(m, Mapping) and as_int(m.get("t_ns")) is not None
        )
        findings.append(
            Finding(
                id=_text(raw.get("id")),
                title=_text(raw.get("title")) or _text(raw.get("id")),
                severity=_text(raw.get("severity")) or "info",
                confidence=_text(raw.get("confidence")) or "n/a",
                verdict=_text(raw.get("verdict")),
                evidence=evidence,
                points=tuple(i for i in (as_int(p) for p in raw.get("points") or []) if i is not None),
                recommendations=tuple(_text(r) for r in raw.get("recommendations") or []),
                marks=marks,
            )
        )
    order = {"critical": 0, "warning": 1, "info": 2}
    findings.sort(key=lambda f: order.get(f.severity, 3))
    return findings


def _diagnosis_knee(findings: list[Finding], points: list[PointView]) -> int | None:
    """The knee the plateau finding names (one point, and a warning or worse: "no plateau" lists them all)."""
    known = {p.point for p in points}
    for f in findings:
        if f.id == "plateau" and len(f.points) == 1 and f.severity in ("warning", "critical") and f.points[0] in known:
            return f.points[0]
    return None


def _gpu_names(env: dict[str, Any]) -> dict[int, str]:
    gpus = first(env, "gpus", "nvml_gpus", default=None)
    if isinstance(gpus, Mapping):
        gpus = first(gpus, "devices", "gpus", default=[])
    names: dict[int, str] = {}
    for i, g in enumerate(gpus if isinstance(gpus, list) else []):
        if isinstance(g, Mapping):
            idx = as_int(first(g, "index", "gpu", default=i))
            name = first(g, "name", "model")
            if idx is not None and name is not None:
                names[idx] = _text(name)
    return names


def _gather_timelines(run: RunDir, names: dict[int, str], notes: _Notes) -> list[GpuTimeline]:
    path = run.file(rundir.GPU_SAMPLES)
    if not path.exists():
        return []
    rows_by_gpu: dict[int, list[dict[str, str]]] = {}
    try:
        with path.open(encoding="utf-8", errors="replace", newline="") as fh:
            reader = csv.DictReader(fh)
            if not reader.fieldnames or "t_ns" not in reader.fieldnames or "gpu" not in reader.fieldnames:
                notes.add(f"{rundir.GPU_SAMPLES} has no t_ns/gpu header; timelines are left out")
                return []
            for row in reader:
                gpu = as_int(row.get("gpu"))
                if gpu is None or as_int(row.get("t_ns")) is None:
                    continue  # a truncated last line, or a damaged one
                rows_by_gpu.setdefault(gpu, []).append(row)
    except (OSError, csv.Error) as err:
        notes.add(f"{rundir.GPU_SAMPLES} could not be read ({err}); timelines are left out")
        return []
    timelines = []
    for gpu, rows in sorted(rows_by_gpu.items()):
        rows.sort(key=lambda r: int(float(r["t_ns"])))
        t_ns = np.array([int(float(r["t_ns"])) for r in rows], dtype=np.int64)
        cols: dict[str, np.ndarray] = {}
        for col in TIMELINE_COLUMNS:
            vals = [as_float(r.get(col)) for r in rows]
            cols[col] = np.array([v if v is not None else np.nan for v in vals], dtype=float)
        gap = np.array([bool((r.get("error") or "").strip()) for r in rows], dtype=bool)
        timelines.append(
            GpuTimeline(
                gpu=gpu, name=names.get(gpu), t_s=t_ns.astype(float), columns=cols, gap_t_s=t_ns[gap].astype(float)
            )
        )
    return timelines


#: Point-level telemetry fields that are bookkeeping, not measurements, and stay out of the tables.
_TELEMETRY_POINT_SKIP = ("label", "start_ns", "end_ns", "concurrency", "request_rate", "warnings", "gpus",
                         "per_gpu", "server", "server_metrics", "aggregate", "all_gpus", "dcgm_gpus")


def _gather_telemetry_summary(
    data: dict[str, Any] | None, points: list[PointView]
) -> tuple[list[TelemetryRow], list[str]]:
    """Flatten telemetry_summary.json into rows of (point, scope, gpu, values), whatever its nesting.

    Scopes: "gpu" (one GPU), "all" (an aggregate over GPUs), "server" (the server's own
    metrics), "point" (point-level totals such as energy and J per output token).
    """
    if not data:
        return [], []
    labels = {p.point: p.label for p in points}
    rows: list[TelemetryRow] = []
    warnings: list[str] = []
    entries = first(data, "points", "per_point", default=[])
    if isinstance(entries, Mapping):
        entries = [dict(v, point=as_int(k)) if isinstance(v, Mapping) else {} for k, v in entries.items()]
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        if not isinstance(entry, Mapping):
            continue
        idx = as_int(first(entry, "point", "index", default=i))
        if idx is None:
            continue
        gpus = first(entry, "gpus", "per_gpu", default=None)
        if isinstance(gpus, Mapping):  # {"0": {...}, "1": {...}}
            gpus = [dict(v, gpu=as_int(k)) if isinstance(v, Mapping) else {} for k, v in gpus.items()]
        if isinstance(gpus, list):
            for j, g in enumerate(gpus):
                if isinstance(g, Mapping):
                    gpu = as_int(first(g, "gpu", "index", default=j))
                    rows.append(TelemetryRow(idx, "gpu", gpu, _flat_values(g)))
        aggregate = first(entry, "aggregate", "all_gpus", default=None)
        if isinstance(aggregate, Mapping) and aggregate and not isinstance(gpus, list):
            rows.append(TelemetryRow(idx, "all", None, _flat_values(aggregate)))
        server = first(entry, "server", "server_metrics", default=None)
        if isinstance(server, Mapping) and server:
            rows.append(TelemetryRow(idx, "server", None, _flat_values(server)))
        totals = {k: v for k, v in entry.items() if k not in _TELEMETRY_POINT_SKIP}
        totals_flat = {k: v for k, v in _flat_values(totals).items() if v is not None}
        if totals_flat:
            rows.append(TelemetryRow(idx, "point", None, totals_flat))
        label = labels.get(idx, _text(entry.get("label")) or f"point {idx}")
        warnings.extend(f"{label}: {_text(w)}" for w in entry.get("warnings") or [])
    warnings.extend(_text(w) for w in first(data, "warnings", default=[]) or [] if w)
    return rows, warnings


def _flat_values(d: Mapping[str, Any], prefix: str = "") -> dict[str, float | str | None]:
    out: dict[str, float | str | None] = {}
    for k, v in d.items():
        if k in ("point", "gpu", "index", "schema_version"):
            continue
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_values(v, prefix=f"{key}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = as_float(v)
        elif isinstance(v, str):
            out[key] = v
    return out


def _gather_roofline(data: dict[str, Any] | None) -> Roofline | None:
    if not data:
        return None
    gpu_info = first(data, "gpu", default=None)
    gpu_name = first(gpu_info, "name", "key") if isinstance(gpu_info, Mapping) else gpu_info
    model_info = first(data, "model", default=None)
    model_name = first(model_info, "name", "key") if isinstance(model_info, Mapping) else model_info
    peak = as_float(first(data, "peak_tflops", "dense_peak_tflops"))
    if peak is None and isinstance(gpu_info, Mapping):
        peak = as_float(first(gpu_info, "peak_tflops", "dense_peak_tflops"))
    bw = as_float(first(data, "bandwidth_bytes_s", "mem_bandwidth_bytes_s", "hbm_bandwidth_bytes_s"))
    if bw is None:
        gbs = as_float(first(data, "bandwidth_gb_s", "mem_bandwidth_gb_s", "bandwidth_gbs"))
        if gbs is None and isinstance(gpu_info, Mapping):
            gbs = as_float(first(gpu_info, "bandwidth_gb_s", "mem_bandwidth_gb_s", "memory_bandwidth_gb_s"))
        bw = gbs * 1e9 if gbs is not None else None
    if peak is None or bw is None:
        derived = _roofline_from_gemms(data)
        peak = peak if peak is not None else derived[0]
        bw = bw if bw is not None else derived[1]
    points = []
    for entry in first(data, "points", "concurrency_points", default=[]) or []:
        if not isinstance(entry, Mapping):
            continue
        conc = as_int(first(entry, "concurrency", "batch", "tokens_per_step"))
        if conc is None:
            continue
        gemms = [g for g in first(entry, "gemms", "per_gemm", default=[]) or [] if isinstance(g, Mapping)]
        flops = as_float(first(entry, "flops_per_step", "step_flops", "flops", "total_flops"))
        bytes_ = as_float(first(entry, "bytes_per_step", "step_bytes", "bytes", "total_bytes"))
        if flops is None and gemms:
            flops = sum(as_float(g.get("flops")) or 0.0 for g in gemms) or None
        if bytes_ is None and gemms:
            bytes_ = sum(as_float(g.get("bytes")) or 0.0 for g in gemms) or None
        expert = next((g for g in gemms if "expert" in _text(first(g, "name", "gemm", "kind")).lower()), None)
        tpe_mean = as_float(first(entry, "tokens_per_expert_mean", default=first(expert, "tokens_per_expert_mean")))
        tpe_max = as_float(first(entry, "tokens_per_expert_max", default=first(expert, "tokens_per_expert_max")))
        points.append(
            RooflinePoint(
                concurrency=conc,
                tok_s_upper_bound=as_float(first(entry, "tok_s_upper_bound", "output_tok_s_upper_bound")),
                step_time_us=as_float(first(entry, "step_time_us")),
                bound=_text(first(entry, "bound")) or None,
                flops_per_step=flops,
                bytes_per_step=bytes_,
                tokens_per_expert_mean=tpe_mean,
                tokens_per_expert_max=tpe_max,
                pct_of_peak=as_float(first(entry, "pct_of_peak", default=first(expert, "pct_of_peak"))),
            )
        )
    points.sort(key=lambda p: p.concurrency)
    return Roofline(
        gpu=_text(gpu_name) or None,
        model=_text(model_name) or None,
        dtype=_text(first(data, "dtype", "format")) or None,
        peak_tflops=peak,
        bandwidth_bytes_s=bw,
        parallelism=_parallelism(data),
        points=tuple(points),
    )


def _parallelism(data: Mapping[str, Any]) -> str | None:
    tp, ep = as_int(first(data, "tp")), as_int(first(data, "ep"))
    parts = [f"TP {tp}" if tp else "", f"EP {ep}" if ep and ep > 1 else ""]
    text = ", ".join(p for p in parts if p)
    return text or None


def _roofline_from_gemms(data: Mapping[str, Any]) -> tuple[float | None, float | None]:
    """(peak TFLOPS, bandwidth B/s) of the run's dtype, recovered from a GEMM entry of roofline.json.

    roofline.py stores per GEMM ``attainable_tflops``, ``pct_of_peak`` (= attainable / peak)
    and ``ridge`` (= peak / bandwidth), so peak = attainable / pct and bandwidth = peak / ridge.
    The expert GEMMs are preferred: their dtype is the one the kernel-efficiency story is about.
    """
    dtype = _text(first(data, "dtype"))
    candidates = []
    for entry in first(data, "points", default=[]) or []:
        for g in (entry.get("gemms") or []) if isinstance(entry, Mapping) else []:
            if isinstance(g, Mapping):
                candidates.append(g)
    candidates.sort(key=lambda g: ("expert" not in _text(g.get("name")), _text(g.get("dtype")) != dtype))
    for g in candidates:
        att, pct, ridge = as_float(g.get("attainable_tflops")), as_float(g.get("pct_of_peak")), as_float(g.get("ridge"))
        if att and pct and ridge:
            peak_tflops = att / (pct / 100.0)  # exact: both carry the op's efficiency factor
            return peak_tflops, peak_tflops * 1e12 / ridge
    return None, None


def gather(run: RunDir) -> ReportModel:
    """Read every file of ``run`` the report uses; never raises for a missing or damaged file."""
    notes = _Notes()
    try:
        config = run.config
    except RunDirError as err:
        notes.add(f"{rundir.CONFIG} could not be read ({err})")
        config = {}
    env = _read_json(run, rundir.ENV, notes) or {}
    summary = _read_json(run, rundir.SUMMARY, notes)
    points, knee = _gather_points(run, config, summary, notes)
    diagnosis = _read_json(run, rundir.DIAGNOSIS, notes)
    findings = _gather_findings(diagnosis)
    # The knee the verdict names wins, so the charts mark what the headline says; then
    # load.metrics' knee from summary.json; then that same rule applied here.
    knee_source = f"{rundir.SUMMARY} scaling.knee_concurrency" if knee is not None else ""
    diag_knee = _diagnosis_knee(findings, points)
    if diag_knee is not None:
        knee, knee_source = diag_knee, f"{rundir.DIAGNOSIS} plateau finding"
    if knee is None:
        rows = [{"target_concurrency": p.concurrency, "concurrency": p.concurrency, "request_rate": p.request_rate,
                 "output_throughput": p.metric("output_throughput")} for p in points if p.concurrency is not None]
        knee = _knee_at(points, load_metrics.scaling(rows).get("knee_concurrency"))
        knee_source = "recomputed with load.metrics.scaling" if knee is not None else ""

    tel_notes_gpus = _gpu_names(_read_json(run, rundir.TELEMETRY_NOTES, notes) or {})
    timelines = _gather_timelines(run, {**tel_notes_gpus, **_gpu_names(env)}, notes)
    starts = [p.start_ns for p in points if p.start_ns is not None]
    sample_starts = [int(t.t_s[0]) for t in timelines if t.t_s.size]
    origin = min(starts + sample_starts) if starts or sample_starts else None
    if origin is not None:
        for t in timelines:
            t.t_s = (t.t_s - origin) / 1e9
            t.gap_t_s = (t.gap_t_s - origin) / 1e9

    tel_summary = _read_json(run, rundir.TELEMETRY_SUMMARY, notes)
    tel_rows, tel_warnings = _gather_telemetry_summary(tel_summary, points)
    tel_notes = _read_json(run, rundir.TELEMETRY_NOTES, notes) or {}
    status = first(tel_notes, "gpu_telemetry") or first(tel_summary, "gpu_telemetry")
    skipped: dict[str, list[str]] = {}
    for item in first(tel_notes, "skipped_counters", default=[]) or []:
        if isinstance(item, Mapping):
            key = f"{_text(item.get('counter'))}: {_text(item.get('reason'))}"
            skipped.setdefault(key, []).append(_text(item.get("gpu")))
    tel_warnings.extend(f"{k} (GPU {', '.join(v)})" for k, v in skipped.items())

    headline = _text(first(diagnosis, "headline")) or None
    diag_notes = [_text(n) for n in first(diagnosis, "notes", default=[]) or []]
    files = {
        name: run.exists(name)
        for name in (
            rundir.CONFIG,
            rundir.ENV,
            rundir.REQUESTS,
            rundir.POINTS,
            rundir.SUMMARY,
            rundir.GPU_SAMPLES,
            rundir.TELEMETRY_SUMMARY,
            rundir.ROOFLINE,
            rundir.DIAGNOSIS,
        )
    }
    return ReportModel(
        run_path=run.path,
        config=config,
        env=env,
        points=points,
        knee_point=knee,
        knee_source=knee_source,
        gpus=timelines,
        origin_ns=origin,
        telemetry_rows=tel_rows,
        telemetry_warnings=tel_warnings,
        telemetry_status=_text(status) or None,
        roofline=_gather_roofline(_read_json(run, rundir.ROOFLINE, notes)),
        headline=headline,
        findings=findings,
        diagnosis_notes=diag_notes,
        notes=notes.items,
        files=files,
    )
