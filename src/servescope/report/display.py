"""Number formatting shared by the HTML and Markdown reports.

Display units are chosen here and only here (measurement keeps SI units in field names):
both reports then print the same digits for the same number.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math

from servescope.report.model import PointView, ReportModel, as_float

MISSING = "–"


def num(value: object, digits: int = 3) -> str:
    """A number with thousands separators and about ``digits`` significant figures; "–" when absent."""
    if isinstance(value, str):
        return value
    v = as_float(value)
    if v is None:
        return MISSING
    if v == 0:
        return "0"
    if v.is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"  # counts (requests, tokens) and round values read best without decimals
    a = abs(v)
    if a >= 10 ** (digits - 1):
        return f"{v:,.0f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(a)))
    return f"{v:,.{min(decimals, 6)}f}"


def with_unit(value: object, unit: str | None) -> str:
    text = num(value)
    if text == MISSING or not unit:
        return text
    return f"{text} %" if unit in ("%", "pct") else f"{text} {unit}"


def ratio(before: float | None, after: float | None) -> str:
    """``x1.28 (+28%)`` for after/before, or "–" when either side is missing or zero."""
    if before is None or after is None or before == 0:
        return MISSING
    r = after / before
    pct = round((r - 1) * 100)
    return f"x{r:.2f} ({'±0' if pct == 0 else f'{pct:+d}'}%)"


def point_label(model: ReportModel, index: int) -> str:
    p = model.point_by_index(index)
    return p.label if p is not None else f"point {index}"


def point_flags(model: ReportModel, p: PointView) -> str:
    """Short tags for a point's row: knee, interrupted, client-limited, failures, reconstructed."""
    tags = []
    if model.knee_point == p.point:
        tags.append("knee")
    if p.interrupted:
        tags.append("interrupted")
    if not p.recorded:
        tags.append("no point record")
    if p.client_limited:
        tags.append("client-limited")
    failed = p.metric("failed")
    if failed:
        tags.append(f"{failed:,.0f} failed")
    return ", ".join(tags)


#: The sweep table's columns: (header, metric name, significant digits).
SWEEP_COLUMNS: tuple[tuple[str, str], ...] = (
    ("completed", "completed"),
    ("output tok/s", "output_throughput"),
    ("req/s", "request_throughput"),
    ("TTFT p50 ms", "median_ttft_ms"),
    ("TTFT p99 ms", "p99_ttft_ms"),
    ("TPOT p50 ms", "median_tpot_ms"),
    ("TPOT p99 ms", "p99_tpot_ms"),
    ("ITL p50 ms", "median_itl_ms"),
    ("ITL p99 ms", "p99_itl_ms"),
    ("E2EL p50 ms", "median_e2el_ms"),
    ("in flight (Little)", "concurrency"),
)

#: Shown after the whole-run throughput when summary.json has a steady-state window.
STEADY_COLUMN = ("steady tok/s", "steady_state.output_throughput")


def sweep_columns(model: ReportModel) -> list[tuple[str, str]]:
    """The sweep table's columns that at least one point has a value for."""
    cols = list(SWEEP_COLUMNS)
    cols.insert(2, STEADY_COLUMN)
    return [(h, m) for h, m in cols if any(p.metric(m) is not None for p in model.points)]


ITL_COLUMNS: tuple[tuple[str, str], ...] = (
    ("p50", "median_itl_ms"),
    ("p90", "p90_itl_ms"),
    ("p95", "p95_itl_ms"),
    ("p99", "p99_itl_ms"),
    ("max", "max_itl_ms"),
)


def scaling_rows(model: ReportModel) -> list[tuple[str, str, str]]:
    """(from -> to, throughput gain, gain per doubling) for each step of the sweep."""
    pts = [p for p in model.points if p.x and p.metric("output_throughput")]
    rows = []
    for a, b in itertools.pairwise(pts):
        ya, yb = a.metric("output_throughput"), b.metric("output_throughput")
        assert ya is not None and yb is not None and a.x is not None and b.x is not None
        if b.x <= a.x or ya <= 0:
            continue
        gain = yb / ya - 1
        per_doubling = (yb / ya) ** (1 / math.log2(b.x / a.x)) - 1
        rows.append((f"{a.label} → {b.label}", f"{gain:+.0%}", f"{per_doubling:+.0%}"))
    return rows


def roofline_rows(model: ReportModel) -> list[dict[str, str]]:
    """One row per roofline concurrency: the model's prediction beside the measured throughput."""
    if model.roofline is None:
        return []
    measured = {p.concurrency: p.metric("output_throughput") for p in model.points if p.concurrency is not None}
    rows = []
    for rp in model.roofline.points:
        got = measured.get(rp.concurrency)
        pct = f"{got / rp.tok_s_upper_bound:.1%}" if got and rp.tok_s_upper_bound else MISSING
        rows.append(
            {
                "concurrency": f"{rp.concurrency:,}",
                "tokens/expert mean": num(rp.tokens_per_expert_mean),
                "tokens/expert max": num(rp.tokens_per_expert_max),
                "FLOP/byte": num(rp.intensity),
                "bound": rp.bound or MISSING,
                "step µs": num(rp.step_time_us),
                "bound tok/s": num(rp.tok_s_upper_bound),
                "measured tok/s": num(got),
                "measured / bound": pct,
            }
        )
    return rows


def telemetry_table(model: ReportModel, max_columns: int = 11) -> tuple[list[str], list[list[str]]]:
    """The per-point GPU aggregates as (header, rows); the most telling columns first.

    Up to ``PER_GPU_ROWS_UP_TO`` GPUs get a row each; more are folded into one row per point
    showing "mean (min–max)" over the GPUs, which keeps an imbalance visible in a short table.
    """
    gpu_rows = [r for r in model.telemetry_rows if r.scope in ("gpu", "all")]
    if not gpu_rows:
        return [], []
    keys: list[str] = []
    for row in gpu_rows:
        keys.extend(k for k in row.values if k not in keys)

    def rank(key: str) -> tuple[int, int]:
        for i, word in enumerate(PREFERRED_TELEMETRY_WORDS):
            if word in key:
                return i, keys.index(key)
        return len(PREFERRED_TELEMETRY_WORDS), keys.index(key)

    keys = [k for k in sorted(keys, key=rank) if not k.startswith(_TELEMETRY_NOISE)][:max_columns]
    per_gpu = [r for r in gpu_rows if r.scope == "gpu"]
    n_gpus = len({r.gpu for r in per_gpu})
    if n_gpus > PER_GPU_ROWS_UP_TO:
        keys = keys[: max_columns - 3]  # "mean (min–max)" cells are wide
        rows = []
        for point in sorted({r.point for r in per_gpu}):
            mine = [r for r in per_gpu if r.point == point]
            cells = []
            for k in keys:
                vals = [v for r in mine if (v := as_float(r.values.get(k))) is not None]
                if not vals:
                    cells.append(MISSING)
                elif min(vals) == max(vals):
                    cells.append(num(vals[0]))
                else:
                    cells.append(f"{num(sum(vals) / len(vals))} ({num(min(vals))}–{num(max(vals))})")
            rows.append([point_label(model, point), str(len(mine)), *cells])
        return ["point", "GPUs: mean (min–max)", *map(column_label, keys)], rows
    order = {"gpu": 0, "all": 1}
    rows = []
    for row in sorted(gpu_rows, key=lambda r: (r.point, order.get(r.scope, 3), r.gpu or 0)):
        who = str(row.gpu) if row.scope == "gpu" else row.scope
        rows.append([point_label(model, row.point), who] + [num(row.values.get(k)) for k in keys])
    return ["point", "GPU", *map(column_label, keys)], rows


#: Display names of the aggregate fields telemetry/timeline.py writes; others show as written.
COLUMN_LABELS = {
    "power_w_mean": "power W",
    "power_limit_pct": "% of power limit",
    "power_w_p5": "power p5 W",
    "power_w_p95": "power p95 W",
    "sm_clock_pct_of_max": "SM clock % of max",
    "sm_clock_mhz_mean": "SM clock MHz",
    "gpu_util_pct_mean": "utilisation %",
    "gpm_tensor_active_pct_mean": "tensor active %",
    "gpm_sm_active_pct_mean": "SM active %",
    "gpm_dram_bw_pct_mean": "DRAM bandwidth %",
    "gpm_sm_occupancy_pct_mean": "SM occupancy %",
    "mem_util_pct_mean": "memory busy %",
    "temp_c_max": "max temp °C",
    "energy_j": "energy J",
    "duration_s": "duration s",
    "energy_j_total": "energy J (all GPUs)",
    "output_tokens": "output tokens",
    "measured_requests": "requests",
    "j_per_output_token": "J per output token",
    "running_requests_mean": "running (mean)",
    "running_requests_max": "running (max)",
    "queued_requests_mean": "queued (mean)",
    "queued_requests_max": "queued (max)",
    "kv_cache_usage_pct_mean": "KV cache % (mean)",
    "kv_cache_usage_pct_max": "KV cache % (max)",
    "max_running_requests": "running cap",
    "running_at_ceiling_fraction": "time at cap",
    "preemptions": "preemptions",
}


def cell(key: str, value: object) -> str:
    """A table cell: fractions (``*_fraction``, 0-1) as percentages, the rest as numbers."""
    v = as_float(value)
    if key.endswith("_fraction") and v is not None:
        return f"{v:.0%}"
    return num(value)


def column_label(key: str) -> str:
    return COLUMN_LABELS.get(key, key)


#: Per-GPU aggregate names left out of the table (bookkeeping, or better read on the timelines).
_TELEMETRY_NOISE = ("samples", "gap_rows", "energy_coverage", "energy_source", "clock_event_reasons_fraction.",
                    "pcie_", "nvlink_", "mem_clock", "power_instant", "gpm_fp", "gpm_hmma", "gpm_imma",
                    "mem_used", "power_limit_w", "sm_clock_max_mhz", "temp_c", "mem_util", "gpm_sm_occupancy",
                    "scrapes", "ceiling_source")

#: The telemetry table lists GPUs one per row up to this many; beyond, one row per point.
PER_GPU_ROWS_UP_TO = 2


def point_totals_table(model: ReportModel) -> tuple[list[str], list[list[str]]]:
    """Point-level telemetry totals (energy over all GPUs, J per output token, duration)."""
    return _scope_table(model, "point")


def server_table(model: ReportModel) -> tuple[list[str], list[list[str]]]:
    """The server's own per-point view (running / queued requests, KV usage), when it was scraped."""
    return _scope_table(model, "server")


def _scope_table(model: ReportModel, scope: str) -> tuple[list[str], list[list[str]]]:
    scoped = [r for r in model.telemetry_rows if r.scope == scope]
    keys: list[str] = []
    for row in scoped:
        keys.extend(k for k in row.values if k not in keys and not k.startswith(_TELEMETRY_NOISE))
    if not keys:
        return [], []
    rows = [[point_label(model, r.point), *[cell(k, r.values.get(k)) for k in keys]]
            for r in sorted(scoped, key=lambda r: r.point)]
    return ["point", *map(column_label, keys)], rows


#: Column-name fragments in the order the telemetry table shows them (the seed's evidence first).
PREFERRED_TELEMETRY_WORDS = (
    "power_w_mean",
    "power_mean",
    "power_limit_pct",
    "pct_of_limit",
    "power_pct",
    "sm_clock_pct",
    "sm_clock",
    "gpu_util",
    "tensor",
    "sm_active",
    "dram",
    "energy",
    "j_per",
    "power_w_p5",
    "power_p5",
    "power_w_p95",
    "power_p95",
)


#: ``config.json`` ``job`` fields (servescope run) shown in the header, in this order.
JOB_FACTS = ("concurrency", "request_rate", "input_len", "output_len", "num_prompts", "duration_s", "model", "gpu",
             "dtype", "tp", "ep", "engine", "device")


def target_facts(model: ReportModel) -> list[tuple[str, str]]:
    """The header facts: what was measured, on what, when, with which command (strings as found in the files)."""
    cfg = model.config
    rows: list[tuple[str, str]] = []
    target = cfg.get("target")
    if isinstance(target, dict):
        for key in ("url", "backend", "model", "served_model", "engine", "device"):
            if target.get(key) is not None:
                rows.append((f"target {key}", str(target[key])))
    elif target is not None:
        rows.append(("target", str(target)))
    for key in ("url", "backend", "model", "served_model", "engine", "workload", "sweep", "analytical"):
        value = cfg.get(key)
        if value is not None and not any(r[0].endswith(key) for r in rows):
            rows.append((key, value if isinstance(value, str) else json.dumps(value, sort_keys=True)[:300]))
    job = cfg.get("job")
    if isinstance(job, dict):  # servescope run: the asked-for workload and analytical model
        asked = {k: job[k] for k in JOB_FACTS if job.get(k) is not None}
        if asked:
            rows.append(("job", ", ".join(f"{k}={v}" for k, v in asked.items())))
    gpus = model.env.get("gpus")
    if isinstance(gpus, list) and gpus:
        names = [str(g.get("name", "?")) if isinstance(g, dict) else str(g) for g in gpus]
        rows.append(("GPUs", f"{len(names)} x " + ", ".join(sorted(set(names)))))
    anchor = model.env.get("clock_anchor")
    if isinstance(anchor, dict) and isinstance(anchor.get("unix_ns"), int):
        when = datetime.datetime.fromtimestamp(anchor["unix_ns"] / 1e9, tz=datetime.timezone.utc)
        rows.append(("started", when.strftime("%Y-%m-%d %H:%M:%S UTC")))
    argv = cfg.get("argv") or cfg.get("command_line")
    if isinstance(argv, list) and argv:
        words = [str(a) for a in argv]
        if words[0] != "servescope":  # argv as recorded is sys.argv[1:]
            words = ["servescope", *words]
        rows.append(("command", " ".join(words)))
    elif cfg.get("command"):
        rows.append(("command", f"servescope {cfg['command']}"))
    return rows
