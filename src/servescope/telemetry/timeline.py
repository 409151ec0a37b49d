"""One timeline: GPU samples, server metrics and sweep points aggregated per point.

``summarize(run)`` is a pure function of the run directory (``points.jsonl`` for each
point's measured bounds ``[measure_start_ns, end_ns]``, ``requests.jsonl`` for output
tokens, ``telemetry/*.csv`` and ``telemetry/notes.json``). It writes
``telemetry_summary.json`` and can be re-run any time, e.g. after a formula is fixed.

Everything shares one clock (``servescope.run.now_ns``, CLOCK_MONOTONIC), so "samples
inside a point" is a plain comparison of nanoseconds. A GPU row at ``t`` holds readings
taken at ``t``; its GPM columns describe the interval since the previous row, so a point
uses rows with ``start < t <= end``.

Energy per point comes from the cumulative energy counter, interpolated linearly at the
point's bounds (as zeus subtracts counter readings, ``zeus/monitor/energy.py``); where a
GPU has no counter, power is integrated over the samples and the result is flagged
``energy_source: "integrated_power"``. This module never formats for humans: ``report/``
does.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

from servescope.errors import RunDataError
from servescope.run import GPU_SAMPLES, POINTS, REQUESTS, SERVER_SAMPLES, TELEMETRY_NOTES, TELEMETRY_SUMMARY, RunDir
from servescope.telemetry.sampler import GPU_COLUMNS

_INT_COLUMNS = ("t_ns", "gpu")
_TEXT_COLUMNS = ("clock_event_reasons", "error")
NUMERIC_GPU_COLUMNS = tuple(c for c in GPU_COLUMNS if c not in _INT_COLUMNS + _TEXT_COLUMNS)

#: Columns averaged per point (besides power, clocks and energy, which get more).
_MEAN_COLUMNS = (
    "power_instant_w", "mem_clock_mhz", "gpu_util_pct", "mem_util_pct",
    "pcie_tx_bytes_s", "pcie_rx_bytes_s", "nvlink_tx_bytes_s", "nvlink_rx_bytes_s",
    "gpm_sm_active_pct", "gpm_sm_occupancy_pct", "gpm_tensor_active_pct", "gpm_dram_bw_pct",
    "gpm_fp16_active_pct", "gpm_fp32_active_pct", "gpm_fp64_active_pct",
    "gpm_hmma_active_pct", "gpm_imma_active_pct",
)

#: Labels that distinguish replicas of the same scheduler state (tensor/pipeline ranks
#: all report the same running count): within one scrape these are collapsed with max,
#: what is left (data-parallel ranks, models) is summed or averaged.
_REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank", "attn_tp_rank", "attn_cp_rank", "__name__", "instance")

#: Server gauges: how several series of one scrape combine.
_SERVER_GAUGES = {
    "running_requests": "sum",
    "queued_requests": "sum",
    "swapped_requests": "sum",
    "retracted_requests": "sum",
    "kv_cache_usage": "mean",
    "kv_cache_cpu_usage": "mean",
    "kv_tokens_used": "sum",
    "gen_throughput_tok_s": "sum",
    "prefix_cache_hit_rate": "mean",
}
_SERVER_COUNTERS = ("preemptions_total", "generation_tokens_total", "prompt_tokens_total")
_SERVER_CAPACITIES = ("max_running_requests", "kv_tokens_capacity", "kv_cache_max_concurrency", "kv_blocks_capacity")

#: Shorter points are flagged: NVML's averaged power needs ~1 s to settle
#: (../shared/reference/h200-measurements.md) and few samples make p5/p95 meaningless.
MIN_POINT_S = 2.0
MIN_SAMPLES = 5


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------
def _num(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def load_gpu_samples(run: RunDir) -> dict[str, list[Any]]:
    """``telemetry/gpu_samples.csv`` as columns: ints for t_ns/gpu, floats or None, strings.

    A truncated last line (a crash mid-write) is skipped; a malformed line elsewhere raises.
    """
    cols: dict[str, list[Any]] = {c: [] for c in GPU_COLUMNS}
    path = run.file(GPU_SAMPLES)
    if not path.exists():
        return cols
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        lines = fh.readlines()
    if not lines:
        return cols
    reader = csv.reader(lines)
    header = next(reader)
    missing = [c for c in ("t_ns", "gpu") if c not in header]
    if missing:
        raise RunDataError(str(path), f"no {missing[0]} column")
    index = {c: header.index(c) for c in GPU_COLUMNS if c in header}
    for i, fields in enumerate(reader, start=2):
        if len(fields) != len(header):
            if i == len(lines) and not lines[-1].endswith("\n"):
                break  # the row being written when the run stopped
            raise RunDataError(str(path), f"line {i} has {len(fields)} fields, expected {len(header)}")
        try:
            t = int(fields[index["t_ns"]])
            g = int(fields[index["gpu"]])
        except ValueError as err:
            raise RunDataError(str(path), f"line {i}: bad t_ns/gpu ({err})") from err
        cols["t_ns"].append(t)
        cols["gpu"].append(g)
        for c in NUMERIC_GPU_COLUMNS:
            cols[c].append(_num(fields[index[c]]) if c in index else None)
        for c in _TEXT_COLUMNS:
            v = fields[index[c]] if c in index else ""
            cols[c].append(v if v != "" else None)
    return cols


def load_server_samples(run: RunDir) -> list[dict[str, Any]]:
    """``telemetry/server_samples.csv`` rows: t_ns, source, metric, labels (dict), value."""
    path = run.file(SERVER_SAMPLES)
    if not path.exists():
        return []
    out: list[dict[str, Any]] = []
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        lines = fh.readlines()
    for i, row in enumerate(csv.DictReader(lines), start=2):
        try:
            out.append({"t_ns": int(row["t_ns"]), "source": row["source"], "metric": row["metric"],
                        "labels": json.loads(row["labels"] or "{}"), "value": float(row["value"])})
        except (TypeError, ValueError, KeyError) as err:
            if i == len(lines) and not lines[-1].endswith("\n"):
                break
            raise RunDataError(str(path), f"line {i} is malformed ({err})") from err
    return out


# ---------------------------------------------------------------------------------------
# Small numeric helpers
# ---------------------------------------------------------------------------------------
def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (np.floating,)):
        return _clean(float(v))
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _counter_delta(t_ns: np.ndarray, values: np.ndarray, start: int, end: int) -> tuple[float | None, float]:
    """Increase of a cumulative counter over [start, end], interpolated at the bounds.

    Returns (delta, coverage): coverage is the share of the window the samples span.
    None when fewer than two readings or the counter went backwards (driver reload).
    """
    if len(t_ns) < 2:
        return None, 0.0
    if np.any(np.diff(values) < 0):
        return None, 0.0
    lo = max(start, int(t_ns[0]))
    hi = min(end, int(t_ns[-1]))
    if hi <= lo:
        return None, 0.0
    e0, e1 = np.interp([lo, hi], t_ns.astype(np.float64), values)
    return float(e1 - e0), (hi - lo) / (end - start) if end > start else 0.0


def _integrated(t_ns: np.ndarray, power_w: np.ndarray, start: int, end: int) -> float | None:
    mask = (t_ns >= start) & (t_ns <= end)
    if mask.sum() < 2:
        return None
    t_s = t_ns[mask].astype(np.float64) / 1e9
    p = power_w[mask]
    return float(np.sum((p[1:] + p[:-1]) * 0.5 * np.diff(t_s)))


# ---------------------------------------------------------------------------------------
# Per GPU
# ---------------------------------------------------------------------------------------
class _GpuSeries:
    def __init__(self, cols: dict[str, list[Any]], gpu: int) -> None:
        idx = [i for i, g in enumerate(cols["gpu"]) if g == gpu]
        self.t = np.array([cols["t_ns"][i] for i in idx], dtype=np.int64)
        order = np.argsort(self.t, kind="stable")
        self.t = self.t[order]
        self.cols = {c: [cols[c][idx[j]] for j in order] for c in GPU_COLUMNS if c not in _INT_COLUMNS}

    def numeric(self, col: str, mask: np.ndarray) -> np.ndarray:
        vals = [v for v, m in zip(self.cols[col], mask, strict=True) if m and v is not None]
        return np.array(vals, dtype=np.float64)

    def pairs(self, col: str) -> tuple[np.ndarray, np.ndarray]:
        rows = zip(self.t, self.cols[col], self.cols["error"], strict=True)
        sel = [(t, v) for t, v, e in rows if v is not None and e is None]
        if not sel:
            return np.array([], dtype=np.int64), np.array([], dtype=np.float64)
        ts = [p[0] for p in sel]
        vs = [p[1] for p in sel]
        return np.array(ts, dtype=np.int64), np.array(vs, dtype=np.float64)


def _gpu_point_stats(s: _GpuSeries, start: int, end: int, meta: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    warnings: list[str] = []
    in_window = (s.t > start) & (s.t <= end)
    ok = in_window & np.array([e is None for e in s.cols["error"]], dtype=bool)
    n_ok = int(ok.sum())
    out: dict[str, Any] = {"samples": n_ok, "gap_rows": int(in_window.sum()) - n_ok}
    if out["gap_rows"]:
        warnings.append(f"{out['gap_rows']} sample(s) are gaps (GPU read failed)")
    if n_ok < MIN_SAMPLES:
        warnings.append(f"only {n_ok} sample(s) inside the point")
    power = s.numeric("power_w", ok)
    if power.size:
        out["power_w_mean"] = float(power.mean())
        out["power_w_p5"] = float(np.percentile(power, 5))
        out["power_w_p95"] = float(np.percentile(power, 95))
    limit = s.numeric("power_limit_w", ok)
    limit_w = float(np.median(limit)) if limit.size else meta.get("power_limit_w")
    out["power_limit_w"] = limit_w
    if power.size and limit_w:
        out["power_limit_pct"] = 100.0 * out["power_w_mean"] / limit_w
    sm = s.numeric("sm_clock_mhz", ok)
    sm_max = s.numeric("sm_clock_max_mhz", ok)
    sm_max_mhz = float(sm_max.max()) if sm_max.size else meta.get("sm_clock_max_mhz")
    if sm.size:
        out["sm_clock_mhz_mean"] = float(sm.mean())
        out["sm_clock_max_mhz"] = sm_max_mhz
        if sm_max_mhz:
            out["sm_clock_pct_of_max"] = 100.0 * out["sm_clock_mhz_mean"] / sm_max_mhz
    for c in _MEAN_COLUMNS:
        v = s.numeric(c, ok)
        if v.size:
            out[f"{c}_mean"] = float(v.mean())
    temp = s.numeric("temp_c", ok)
    if temp.size:
        out["temp_c_max"] = float(temp.max())
    mem = s.numeric("mem_used_bytes", ok)
    if mem.size:
        out["mem_used_bytes_max"] = float(mem.max())
    reasons: dict[str, int] = defaultdict(int)
    n_reason_rows = 0
    for r, m in zip(s.cols["clock_event_reasons"], ok, strict=True):
        if m:
            n_reason_rows += 1
            for name in (r or "").split(";"):
                if name:
                    reasons[name] += 1
    if n_reason_rows:
        out["clock_event_reasons_fraction"] = {k: v / n_reason_rows for k, v in sorted(reasons.items())}

    # Energy: the counter first, integrated power as the flagged fallback.
    t_e, e = s.pairs("energy_j")
    delta, coverage = _counter_delta(t_e, e, start, end)
    if delta is not None:
        out["energy_j"], out["energy_source"] = delta, "counter"
        out["energy_coverage"] = coverage
        if coverage < 0.9:
            warnings.append(f"energy counter samples cover only {100 * coverage:.0f}% of the point")
    else:
        t_p, p = s.pairs("power_w")
        integ = _integrated(t_p, p, start, end)
        if integ is not None:
            out["energy_j"], out["energy_source"] = integ, "integrated_power"
            warnings.append("no usable energy counter: energy is integrated sampled power")
        else:
            out["energy_j"], out["energy_source"] = None, None
    return out, warnings


# ---------------------------------------------------------------------------------------
# Server and DCGM
# ---------------------------------------------------------------------------------------
def _collapse(rows: list[dict[str, Any]], how: str) -> float:
    """Combine the series of one scrape of one metric: max over replicas, then sum/mean."""
    groups: dict[str, float] = {}
    for r in rows:
        key = json.dumps({k: v for k, v in r["labels"].items() if k not in _REPLICA_LABELS}, sort_keys=True)
        groups[key] = max(groups.get(key, -math.inf), r["value"])
    vals = list(groups.values())
    return float(sum(vals)) if how == "sum" else float(np.mean(vals))


def _scrape_series(rows: list[dict[str, Any]], metric: str, how: str) -> tuple[np.ndarray, np.ndarray]:
    by_t: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["metric"] == metric:
            by_t[r["t_ns"]].append(r)
    ts = sorted(by_t)
    return np.array(ts, dtype=np.int64), np.array([_collapse(by_t[t], how) for t in ts], dtype=np.float64)


def _server_point_stats(rows: list[dict[str, Any]], start: int, end: int,
                        ceiling: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    scrapes = 0
    running_series = None
    for metric, how in _SERVER_GAUGES.items():
        t, v = _scrape_series(rows, metric, how)
        mask = (t >= start) & (t <= end)
        if not mask.any():
            continue
        vals = v[mask]
        scrapes = max(scrapes, int(mask.sum()))
        scale, name = (100.0, "kv_cache_usage_pct") if metric == "kv_cache_usage" else (1.0, metric)
        if metric == "kv_cache_cpu_usage":
            scale, name = 100.0, "kv_cache_cpu_usage_pct"
        out[f"{name}_mean"] = float(vals.mean()) * scale
        out[f"{name}_max"] = float(vals.max()) * scale
        if metric == "running_requests":
            running_series = vals
    for metric in _SERVER_COUNTERS:
        t, v = _scrape_series(rows, metric, "sum")
        delta, _ = _counter_delta(t, v, start, end)
        if delta is not None:
            out[metric.removesuffix("_total")] = delta
    out["scrapes"] = scrapes
    if ceiling and ceiling.get("max_running_requests"):
        cap = ceiling["max_running_requests"]
        out["max_running_requests"] = cap
        out["ceiling_source"] = ceiling.get("source")
        if running_series is not None and running_series.size:
            out["running_at_ceiling_fraction"] = float(np.mean(running_series >= cap))
    return out


def _server_capacities(rows: list[dict[str, Any]]) -> dict[str, float]:
    caps: dict[str, float] = {}
    for metric in _SERVER_CAPACITIES:
        _, v = _scrape_series(rows, metric, "sum" if metric != "kv_cache_max_concurrency" else "mean")
        if v.size:
            caps[metric] = float(v[-1])
    return caps


def _dcgm_point_stats(rows: list[dict[str, Any]], start: int, end: int) -> dict[str, dict[str, Any]]:
    by_gpu: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        lab = r["labels"]
        key = f"{lab.get('Hostname') or lab.get('instance', '?')}/gpu{lab.get('gpu', '?')}"
        if lab.get("GPU_I_ID"):
            key += f"/mig{lab['GPU_I_ID']}"
        by_gpu[key].append(r)
    out: dict[str, dict[str, Any]] = {}
    for key, grows in sorted(by_gpu.items()):
        stats: dict[str, Any] = {}
        metrics = sorted({r["metric"] for r in grows})
        for m in metrics:
            pts = sorted((r["t_ns"], r["value"]) for r in grows if r["metric"] == m)
            t = np.array([p[0] for p in pts], dtype=np.int64)
            v = np.array([p[1] for p in pts], dtype=np.float64)
            if m == "energy_j":
                delta, _ = _counter_delta(t, v, start, end)
                if delta is not None:
                    stats["energy_j"], stats["energy_source"] = delta, "counter"
                continue
            mask = (t >= start) & (t <= end)
            if mask.any():
                stats[f"{m}_mean"] = float(v[mask].mean())
                if m == "power_w":
                    stats["power_w_p5"] = float(np.percentile(v[mask], 5))
                    stats["power_w_p95"] = float(np.percentile(v[mask], 95))
        if stats:
            stats["instance"] = grows[0]["labels"].get("instance")
            out[key] = stats
    return out


# ---------------------------------------------------------------------------------------
# The summary
# ---------------------------------------------------------------------------------------
def _output_tokens_by_point(run: RunDir) -> dict[int, dict[str, int]]:
    out: dict[int, dict[str, int]] = defaultdict(lambda: {"tokens": 0, "requests": 0, "missing": 0})
    for r in run.iter_jsonl(REQUESTS):
        if r.get("phase") != "measure" or not r.get("ok", True):
            continue
        p = out[int(r.get("point", -1))]
        p["requests"] += 1
        if r.get("output_tokens") is None:
            p["missing"] += 1
        else:
            p["tokens"] += int(r["output_tokens"])
    return out


def summarize(run: RunDir) -> dict[str, Any]:
    """Aggregate telemetry per sweep point and per GPU; write and return ``telemetry_summary.json``."""
    notes = run.read_json(TELEMETRY_NOTES, default={}) or {}
    meta = {int(g["index"]): g for g in notes.get("gpus", []) if "index" in g}
    cols = load_gpu_samples(run)
    server_rows_all = load_server_samples(run)
    server_rows = [r for r in server_rows_all if r["source"] == "server"]
    dcgm_rows = [r for r in server_rows_all if r["source"] == "dcgm"]
    gpus = sorted(set(cols["gpu"]))
    series = {g: _GpuSeries(cols, g) for g in gpus}
    ceiling = notes.get("server_ceiling")
    capacities = _server_capacities(server_rows)
    if not ceiling and "max_running_requests" in capacities:
        ceiling = {"max_running_requests": int(capacities["max_running_requests"]),
                   "source": "metric max_running_requests"}

    points = list(run.iter_jsonl(POINTS))
    tokens = _output_tokens_by_point(run) if points else {}

    def window(label: str, start: int, end: int, point: dict[str, Any] | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"label": label, "start_ns": start, "end_ns": end, "duration_s": (end - start) / 1e9}
        warnings: list[str] = []
        if point is not None:
            entry["point"] = point.get("point")
            entry["concurrency"] = point.get("concurrency")
            entry["request_rate"] = point.get("request_rate")
            if point.get("interrupted"):
                warnings.append("the point was interrupted")
        if entry["duration_s"] < MIN_POINT_S:
            warnings.append(f"the point lasted {entry['duration_s']:.2f} s (< {MIN_POINT_S:g} s): "
                            "averaged power and energy are approximate")
        per_gpu: dict[str, Any] = {}
        total_e = 0.0
        e_gpus = 0
        for g in gpus:
            stats, w = _gpu_point_stats(series[g], start, end, meta.get(g, {}))
            per_gpu[str(g)] = stats
            warnings += [f"GPU {g}: {x}" for x in w]
            if stats.get("energy_j") is not None:
                total_e += stats["energy_j"]
                e_gpus += 1
        entry["gpus"] = per_gpu
        entry["energy_j_total"] = total_e if e_gpus else None
        if e_gpus and e_gpus < len(gpus):
            warnings.append(f"energy known for {e_gpus} of {len(gpus)} GPUs only")
        if point is not None:
            tok = tokens.get(int(point.get("point", -1)), {"tokens": 0, "requests": 0, "missing": 0})
            entry["output_tokens"] = tok["tokens"]
            entry["measured_requests"] = tok["requests"]
            if tok["missing"]:
                warnings.append(f"{tok['missing']} request(s) without an output token count")
            entry["j_per_output_token"] = (total_e / tok["tokens"]) if (e_gpus and tok["tokens"]) else None
        if server_rows:
            entry["server"] = _server_point_stats(server_rows, start, end, ceiling)
        if dcgm_rows:
            entry["dcgm_gpus"] = _dcgm_point_stats(dcgm_rows, start, end)
        entry["warnings"] = warnings
        return entry

    out_points = []
    for p in points:
        try:
            start, end = int(p["measure_start_ns"]), int(p["end_ns"])
        except (KeyError, TypeError, ValueError) as err:
            raise RunDataError(str(run.file(POINTS)), f"point without measure bounds ({err})") from err
        out_points.append(window(str(p.get("label", p.get("point"))), start, end, p))

    all_t = list(cols["t_ns"]) + [r["t_ns"] for r in server_rows_all]
    run_entry = window("whole run", min(all_t) - 1, max(all_t), None) if all_t else None

    summary = {
        "gpu_telemetry": notes.get("gpu_telemetry", "unknown (no telemetry/notes.json)"),
        "gpus": [meta[g] for g in sorted(meta)],
        "server_ceiling": ceiling,
        "server_capacities": capacities,
        "points": out_points,
        "run": run_entry,
        "warnings": [f"telemetry gap on GPU {g['gpu']}: {g['error']}" for g in notes.get("gaps", [])]
        + [f"metrics endpoint {f['url']} failed {f['failures']} time(s): {f['last_error']}"
           for f in notes.get("endpoint_failures", [])],
    }
    summary = _clean(summary)
    run.write_json(TELEMETRY_SUMMARY, summary)
    return summary
