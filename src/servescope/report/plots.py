"""The report's figures, drawn with matplotlib's SVG backend and returned as inline SVG text.

SVG rather than PNG because the report must be one file that opens offline and stays
sharp when zoomed; text is kept as ``<text>`` (``svg.fonttype = none``) so it is small
and searchable. Figures are built on ``matplotlib.figure.Figure`` directly, not pyplot,
so no global figure registry is touched; the few rc settings are scoped with
``rc_context``. Every figure function returns None when its data was not recorded; the
caller then writes "not recorded" instead of an empty chart.

Label text that came from a file (point labels, finding marks, GPU names) goes through
``plain`` so matplotlib never parses it as mathtext (a ``$`` in a model name would
otherwise raise); matplotlib escapes XML in text it writes to SVG.
"""

from __future__ import annotations

import functools
import io
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from servescope.report.model import ITL_PROBS, GpuTimeline, PointView, ReportModel

_F = TypeVar("_F", bound=Callable[..., Any])

#: Timelines keep at most this many plotted samples per series: an hour at 100 ms is 36,000 rows
#: per GPU, which would make a multi-megabyte SVG without showing more than the page can resolve.
MAX_TIMELINE_POINTS = 1200
#: GPUs per timeline figure (columns); more GPUs wrap into further figures.
GPUS_PER_FIGURE = 4
#: Up to this many marks are labelled individually; more are drawn as lines only (the title counts them).
MAX_LABELLED_MARKS = 6

C_MEASURED = "#1f5fa8"
C_P99 = "#c2410c"
C_BOUND = "#6b7280"
C_KNEE = "#b91c1c"
C_SHADE = ("#dbeafe", "#fef3c7")
C_WARMUP = "#f3f4f6"
SERIES_COLORS = ("#1f5fa8", "#c2410c", "#15803d", "#7c3aed", "#0f766e", "#be185d", "#a16207", "#334155")

_RC = {
    "svg.fonttype": "none",
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial", "Helvetica"],
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.grid": True,
    "grid.alpha": 0.35,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


def plain(text: object) -> str:
    """File-sourced text made safe for matplotlib: ``$`` escaped so it is never mathtext."""
    return str(text).replace("\\", "\\\\").replace("$", r"\$")


def to_svg(fig: Figure, name: str) -> str:
    """Render a figure as an inline ``<svg>`` element (no XML prolog, no DOCTYPE, no date).

    ``svg.hashsalt`` is set per figure so clip-path ids are stable across rebuilds and
    distinct between figures sharing one HTML page.
    """
    buf = io.StringIO()
    with matplotlib.rc_context({**_RC, "svg.hashsalt": f"servescope-{name}"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "servescope"}, bbox_inches="tight")
    text = buf.getvalue()
    start = text.find("<svg")
    text = text[start:] if start >= 0 else text
    # Responsive: keep the viewBox, drop the fixed size so CSS sets the width.
    text = re.sub(r'<svg([^>]*?) width="[^"]*" height="[^"]*"', r"<svg\1", text, count=1)
    return text.replace("<svg", f'<svg class="plot" data-plot="{name}" role="img"', 1)


def _styled(fn: _F) -> _F:
    """Build the whole figure under the report's rc settings (fonts and grids are read at artist creation)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with matplotlib.rc_context(_RC):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _figure(width_in: float, height_in: float) -> Figure:
    return Figure(figsize=(width_in, height_in), layout="constrained")


def _fmt_num(v: float) -> str:
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2g}"


def _x_axis(ax, model: ReportModel, xs: list[float]) -> None:
    """Concurrency ladders are doublings: a log2 axis spaces them evenly, labelled with the real values."""
    if xs and min(xs) > 0 and (max(xs) / min(xs) >= 4):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_xticks(xs)
    ax.set_xlabel(model.swept)


def _knee_line(ax, model: ReportModel, label: bool = True) -> None:
    knee = model.point_by_index(model.knee_point) if model.knee_point is not None else None
    if knee is None or knee.x is None:
        return
    ax.axvline(knee.x, color=C_KNEE, linestyle="--", linewidth=1.2, alpha=0.8)
    if label:
        ax.annotate(
            plain(f"knee: {knee.label}"),
            xy=(knee.x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(4, -12),
            textcoords="offset points",
            color=C_KNEE,
            fontsize=8,
        )


def _scaled_points(model: ReportModel, metric: str) -> list[tuple[PointView, float]]:
    out = []
    for p in model.points:
        v = p.metric(metric)
        if p.x is not None and v is not None:
            out.append((p, v))
    return out


@_styled
def throughput_figure(model: ReportModel) -> str | None:
    """Output tok/s against the swept variable, each point labelled, the knee marked.

    The roofline bound is left to the roofline chart: drawn here it would flatten the
    measured curve whose shape (the knee) is the point of this chart.
    """
    data = _scaled_points(model, "output_throughput")
    if not data:
        return None
    fig = _figure(6.2, 3.4)
    ax = fig.add_subplot()
    xs = [p.x for p, _ in data]
    ys = [v for _, v in data]
    ax.plot(xs, ys, marker="o", color=C_MEASURED, linewidth=2, label="measured output tok/s")
    for (p, v), x in zip(data, xs, strict=True):
        ax.annotate(_fmt_num(v), (x, v), xytext=(0, 7), textcoords="offset points", ha="center", fontsize=8)
        if p.client_limited or p.interrupted:
            ax.plot([x], [v], marker="x", color=C_KNEE, markersize=9)
    _x_axis(ax, model, xs)
    _knee_line(ax, model)
    ax.set_ylabel("output tokens / s")
    ax.set_ylim(bottom=0, top=max(ys) * 1.18)
    flagged = any(p.client_limited or p.interrupted for p, _ in data)
    ax.set_title("Output throughput" + (" (x: client-limited or interrupted point)" if flagged else ""))
    return to_svg(fig, "throughput")


@_styled
def latency_figure(model: ReportModel) -> str | None:
    """TTFT, TPOT and ITL, p50 and p99, against the swept variable (log y: tails span decades)."""
    panels = [(m, _scaled_points(model, f"median_{m}_ms"), _scaled_points(model, f"p99_{m}_ms")) for m in
              ("ttft", "tpot", "itl")]
    if not any(p50 or p99 for _, p50, p99 in panels):
        return None
    fig = _figure(9.6, 3.0)
    axes = fig.subplots(1, 3)
    for ax, (metric, p50, p99) in zip(axes, panels, strict=True):
        xs = sorted({p.x for p, _ in p50 + p99 if p.x is not None})
        if p50:
            ax.plot([p.x for p, _ in p50], [v for _, v in p50], marker="o", color=C_MEASURED, label="p50")
        if p99:
            ax.plot([p.x for p, _ in p99], [v for _, v in p99], marker="s", linestyle="--", color=C_P99, label="p99")
        values = [v for _, v in p50 + p99 if v > 0]
        if values and max(values) / min(values) > 20:
            ax.set_yscale("log")
        _x_axis(ax, model, xs)
        _knee_line(ax, model, label=False)
        ax.set_title(f"{metric.upper()} (ms)")
        if not (p50 or p99):
            ax.text(0.5, 0.5, "not recorded", transform=ax.transAxes, ha="center", color=C_BOUND)
        else:
            ax.legend(fontsize=8)
    return to_svg(fig, "latency")


_TAIL_TICKS = (0.5, 0.9, 0.99, 0.999, 0.9999)


def _tail_x(p: np.ndarray | float) -> np.ndarray | float:
    """Percentile axis stretched toward the tail: x = -log10(1 - p), so p90, p99, p99.9 are evenly spaced."""
    return -np.log10(np.clip(1.0 - np.asarray(p, dtype=float), 1e-4, 1.0))


@_styled
def itl_figure(model: ReportModel) -> str | None:
    """ITL by percentile, one line per sweep point: the median and the tail on one chart."""
    pts = [p for p in model.points if p.itl_values_ms]
    if not pts:
        return None
    fig = _figure(6.8, 3.6)
    ax = fig.add_subplot()
    probs = np.asarray(ITL_PROBS)
    xs = _tail_x(probs)
    keep = probs >= 0.0
    for i, p in enumerate(pts):
        vals = np.asarray(p.itl_values_ms)
        ax.plot(xs[keep], np.maximum(vals[keep], 1e-3), color=SERIES_COLORS[i % len(SERIES_COLORS)],
                linewidth=1.6, label=plain(f"{p.label} (n={p.itl_count:,})"))
    ax.set_yscale("log")
    ax.set_xticks([float(_tail_x(t)) for t in _TAIL_TICKS])
    ax.set_xticklabels([f"p{t * 100:g}" for t in _TAIL_TICKS])
    ax.set_xlim(0, float(_tail_x(1.0)) + 0.05)
    ax.set_xlabel("percentile (chunk-aware ITL, measured requests)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.set_title("ITL distribution per point")
    ax.legend(fontsize=8, loc="upper left")
    return to_svg(fig, "itl")


def _downsample(t: np.ndarray, v: np.ndarray, limit: int = MAX_TIMELINE_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """Bin means, keeping the shape of long series while bounding SVG size (NaN bins stay NaN = a gap)."""
    if t.size <= limit:
        return t, v
    edges = np.linspace(t[0], t[-1], limit + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, limit - 1)
    finite = np.isfinite(v)
    sums = np.bincount(idx[finite], weights=v[finite], minlength=limit)
    counts = np.bincount(idx[finite], minlength=limit)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return (edges[:-1] + edges[1:]) / 2, means


#: (row title, unit, [(column, legend label, style)]) for the timeline rows.
_TIMELINE_ROWS: tuple[tuple[str, str, tuple[tuple[str, str, str], ...]], ...] = (
    ("Power", "W", (("power_w", "power", "-"), ("power_limit_w", "power limit", "--"))),
    ("SM clock", "MHz", (("sm_clock_mhz", "SM clock", "-"), ("sm_clock_max_mhz", "max SM clock", "--"))),
    (
        "Activity",
        "%",
        (
            ("gpu_util_pct", "utilisation (NVML)", "-"),
            ("gpm_sm_active_pct", "SM active (GPM)", "-"),
            ("gpm_tensor_active_pct", "tensor active (GPM)", "-"),
        ),
    ),
    ("Memory", "%", (("gpm_dram_bw_pct", "DRAM bandwidth (GPM)", "-"), ("mem_util_pct", "memory busy (NVML)", "-"))),
)


def _shade_points(ax, model: ReportModel, label_top: bool) -> None:
    for i, p in enumerate(model.points):
        start, mstart, end = model.t_s(p.start_ns), model.t_s(p.measure_start_ns), model.t_s(p.end_ns)
        if start is not None and mstart is not None and mstart > start:
            ax.axvspan(start, mstart, color=C_WARMUP, alpha=0.9, linewidth=0, zorder=0)
        if mstart is not None and end is not None and end > mstart:
            ax.axvspan(mstart, end, color=C_SHADE[i % 2], alpha=0.7, linewidth=0, zorder=0)
            if label_top:
                ax.annotate(plain(p.label), xy=((mstart + end) / 2, 1.0), xycoords=("data", "axes fraction"),
                            xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)


def _marks(model: ReportModel) -> list[tuple[float, str]]:
    out = []
    for f in model.findings:
        for m in f.marks:
            t = model.t_s(m.t_ns)
            if t is not None:
                out.append((t, m.label))
    return out


@_styled
def timeline_figures(model: ReportModel) -> list[str]:
    """Per-GPU timelines (rows: power, SM clock, activity, memory), sweep points shaded, stalls marked.

    Several GPUs sit side by side with shared y axes, so an imbalance between them shows.
    """
    gpus = [g for g in model.gpus if g.t_s.size]
    if not gpus:
        return []
    marks = _marks(model)
    out = []
    for chunk_start in range(0, len(gpus), GPUS_PER_FIGURE):
        group = gpus[chunk_start : chunk_start + GPUS_PER_FIGURE]
        rows = [r for r in _TIMELINE_ROWS if any(g.has(col) for g in group for col, _, _ in r[2])]
        if not rows:
            continue
        ncol = len(group)
        fig = _figure(max(4.4, 3.5 * ncol), 1.75 * len(rows) + 0.6)
        axes = np.atleast_2d(fig.subplots(len(rows), ncol, sharex="col", sharey="row", squeeze=False))
        for c, gpu in enumerate(group):
            for r, (title, unit, series) in enumerate(rows):
                ax = axes[r][c]
                _shade_points(ax, model, label_top=(r == 0))
                _plot_series(ax, gpu, series)
                for t, label in marks:
                    ax.axvline(t, color=C_KNEE, linewidth=0.8, alpha=0.7)
                    if r == 0 and len(marks) <= MAX_LABELLED_MARKS:
                        ax.annotate(plain(label[:40]), xy=(t, 0.02), xycoords=("data", "axes fraction"),
                                    rotation=90, fontsize=6, color=C_KNEE, ha="right", va="bottom")
                if gpu.gap_t_s.size:
                    ax.plot(gpu.gap_t_s, np.zeros_like(gpu.gap_t_s), "x", color=C_KNEE, markersize=4)
                if c == 0:
                    ax.set_ylabel(f"{title} ({unit})")
                if unit == "%":
                    ax.set_ylim(0, 105)
                if r == 0:
                    ax.set_title(f"GPU {gpu.gpu}", pad=14)
                if r == len(rows) - 1:
                    ax.set_xlabel("time since start of run (s)")
                if c == ncol - 1:
                    handles, labels = ax.get_legend_handles_labels()
                    if handles:
                        ax.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
        names = sorted({g.name for g in group if g.name})
        title = ", ".join(names)[:120]
        if marks:
            title += ("; " if title else "") + f"red lines: {len(marks)} moment(s) marked by the findings"
        if title:
            fig.suptitle(plain(title), fontsize=9)
        out.append(to_svg(fig, f"timeline-{chunk_start // GPUS_PER_FIGURE}"))
    return out


def _plot_series(ax, gpu: GpuTimeline, series: tuple[tuple[str, str, str], ...]) -> None:
    for k, (col, label, style) in enumerate(series):
        if not gpu.has(col):
            continue
        t, v = _downsample(gpu.t_s, gpu.columns[col])
        color = SERIES_COLORS[k % len(SERIES_COLORS)]
        if style == "--":
            ax.plot(t, v, linestyle="--", color=C_BOUND, linewidth=1, label=label)
        else:
            ax.plot(t, v, color=color, linewidth=1.1, label=label)


@_styled
def roofline_figure(model: ReportModel) -> str | None:
    """Measured against predicted: tok/s vs the roofline bound, and each point on the GPU's roofline.

    The right panel places each swept concurrency at its decode step's arithmetic intensity
    (FLOP per byte, from roofline.json): the predicted point at the attainable TFLOPS the
    model gives, the measured one at flops_per_step x measured tok/s / concurrency, i.e.
    assuming each decode step emits one token per running sequence. The vertical distance
    is the efficiency the run left on the table.
    """
    rl = model.roofline
    if rl is None or not rl.points:
        return None
    measured = {p.x: v for p, v in _scaled_points(model, "output_throughput") if p.concurrency is not None}
    can_roof = bool(rl.peak_tflops and rl.bandwidth_bytes_s and any(p.intensity for p in rl.points))
    fig = _figure(10.0 if can_roof else 5.6, 3.6)
    axes = fig.subplots(1, 2 if can_roof else 1, squeeze=False)[0]
    ax = axes[0]
    bounds = [(float(p.concurrency), p.tok_s_upper_bound) for p in rl.points if p.tok_s_upper_bound]
    if bounds:
        ax.plot([c for c, _ in bounds], [b for _, b in bounds], marker="o", linestyle="--", color=C_BOUND,
                label="predicted (roofline bound)")
    if measured:
        mx = sorted(measured)
        ax.plot(mx, [measured[x] for x in mx], marker="o", color=C_MEASURED, linewidth=2, label="measured")
        for c, b in bounds:
            if c in measured and b:
                ax.annotate(f"{measured[c] / b:.0%}", (c, measured[c]), xytext=(0, 7), textcoords="offset points",
                            ha="center", fontsize=8, color=C_MEASURED)
    values = [b for _, b in bounds] + list(measured.values())
    if values and min(values) > 0 and max(values) / min(values) > 30:
        ax.set_yscale("log")
    xs = sorted({c for c, _ in bounds} | set(measured))
    _x_axis(ax, model, xs)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Measured vs roofline bound (% = measured / bound)")
    ax.legend(fontsize=8)
    if can_roof:
        _roofline_panel(axes[1], model, measured)
    return to_svg(fig, "roofline")


def _roofline_panel(ax, model: ReportModel, measured: dict[float, float]) -> None:
    rl = model.roofline
    assert rl is not None and rl.peak_tflops and rl.bandwidth_bytes_s
    peak_flops = rl.peak_tflops * 1e12
    bw = rl.bandwidth_bytes_s
    ridge = peak_flops / bw
    pts = [p for p in rl.points if p.intensity]
    lo = min([p.intensity for p in pts] + [ridge]) / 4  # type: ignore[type-var]
    hi = max([p.intensity for p in pts] + [ridge]) * 4  # type: ignore[type-var]
    ai = np.logspace(math.log10(lo), math.log10(hi), 200)
    ax.plot(ai, np.minimum(peak_flops, ai * bw) / 1e12, color="#111827", linewidth=1.5, label="roof")
    ax.axvline(ridge, color=C_BOUND, linestyle=":", linewidth=1)
    ax.annotate(f"ridge {ridge:,.0f} FLOP/B", (ridge, peak_flops / 1e12), xytext=(4, -12),
                textcoords="offset points", fontsize=7, color=C_BOUND)
    for i, p in enumerate(pts):
        color = SERIES_COLORS[i % len(SERIES_COLORS)]
        x = p.intensity
        if p.flops_per_step and p.step_time_us:
            pred = p.flops_per_step / (p.step_time_us * 1e-6) / 1e12
        else:
            pred = min(peak_flops, x * bw) / 1e12  # type: ignore[operator]
        ax.plot([x], [pred], marker="o", markerfacecolor="none", color=color, markersize=7)
        got = measured.get(float(p.concurrency))
        if got and p.flops_per_step:
            meas = p.flops_per_step * got / p.concurrency / 1e12
            ax.plot([x], [meas], marker="o", color=color, markersize=6)
            ax.plot([x, x], [meas, pred], color=color, linewidth=0.8, alpha=0.6)
        ax.annotate(f"c={p.concurrency}", (x, pred), xytext=(5, 2), textcoords="offset points", fontsize=7,
                    color=color)
    ax.plot([], [], marker="o", markerfacecolor="none", color="#374151", linestyle="none", label="predicted")
    ax.plot([], [], marker="o", color="#374151", linestyle="none", label="measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity of the decode step (FLOP/byte)")
    ax.set_ylabel("TFLOPS per GPU")
    title = "Roofline" + (f": {rl.gpu}" if rl.gpu else "") + (f", {rl.dtype}" if rl.dtype else "")
    ax.set_title(plain(title))
    ax.legend(fontsize=8, loc="lower right")
