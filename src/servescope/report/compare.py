"""``servescope compare RUN_A RUN_B``: the same sweep point before and after a change.

The seed's result after tuning was "1,640 -> 2,095 output tok/s at 2,048 concurrent
requests, +28%": one number per point, with its ratio. Points are matched by the swept
value (concurrency, else request rate), never by position, so two ladders of different
length still line up, and points present on one side only are listed, not dropped.
Both runs are read through ``model.gather``, so compare shows exactly the numbers the
two reports show.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servescope.report import display
from servescope.report.markdown import md, table
from servescope.report.model import PointView, ReportModel, TelemetryRow, gather
from servescope.run import RunDir

#: (metric name, display label, higher is better) compared at every matched point.
COMPARED_METRICS: tuple[tuple[str, str, bool], ...] = (
    ("output_throughput", "output tok/s", True),
    ("request_throughput", "requests/s", True),
    ("total_token_throughput", "total tok/s", True),
    ("median_ttft_ms", "TTFT p50 ms", False),
    ("p99_ttft_ms", "TTFT p99 ms", False),
    ("median_tpot_ms", "TPOT p50 ms", False),
    ("p99_tpot_ms", "TPOT p99 ms", False),
    ("median_itl_ms", "ITL p50 ms", False),
    ("p99_itl_ms", "ITL p99 ms", False),
    ("median_e2el_ms", "E2EL p50 ms", False),
    ("failed", "failed requests", False),
)

#: Telemetry aggregates compared when both runs recorded them: (key fragment, label, higher is better),
#: averaged over the GPUs of a point. None = neither direction is "better".
COMPARED_TELEMETRY: tuple[tuple[tuple[str, ...], str, bool | None], ...] = (
    (("power_w_mean", "power_mean_w"), "GPU power mean W", None),
    (("j_per_output_token", "j_per_output_tok", "j_per_token"), "J per output token", False),
    (("tensor_active_pct_mean", "tensor_active"), "tensor active %", True),
)


@dataclass(frozen=True, slots=True)
class MetricDelta:
    name: str
    label: str
    before: float | None
    after: float | None
    higher_is_better: bool | None

    @property
    def ratio(self) -> float | None:
        """after / before; None when either is missing or before is zero."""
        if self.before is None or self.after is None or self.before == 0:
            return None
        return self.after / self.before

    @property
    def change_pct(self) -> float | None:
        r = self.ratio
        return None if r is None else (r - 1.0) * 100.0

    @property
    def improved(self) -> bool | None:
        """True when B is better than A in this metric's direction (None: no direction or no data)."""
        r = self.ratio
        if r is None or self.higher_is_better is None or math.isclose(r, 1.0):
            return None
        return (r > 1.0) == self.higher_is_better

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.name,
            "label": self.label,
            "before": self.before,
            "after": self.after,
            "ratio": self.ratio,
            "change_pct": self.change_pct,
            "higher_is_better": self.higher_is_better,
            "improved": self.improved,
        }


@dataclass(frozen=True, slots=True)
class PointComparison:
    """One swept value present in both runs."""

    key: str  # "c=2048" or "rate=8"
    concurrency: int | None
    request_rate: float | None
    point_a: int
    point_b: int
    deltas: tuple[MetricDelta, ...]
    notes: tuple[str, ...] = ()

    def delta(self, name: str) -> MetricDelta | None:
        return next((d for d in self.deltas if d.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "point_a": self.point_a,
            "point_b": self.point_b,
            "metrics": [d.to_dict() for d in self.deltas],
            "notes": list(self.notes),
        }


@dataclass(frozen=True, slots=True)
class CompareResult:
    run_a: Path
    run_b: Path
    swept: str
    points: tuple[PointComparison, ...]
    only_a: tuple[str, ...]
    only_b: tuple[str, ...]
    peak_a_tok_s: float | None
    peak_b_tok_s: float | None
    notes: tuple[str, ...] = ()

    @property
    def peak(self) -> MetricDelta:
        """Best output tok/s of each run, wherever on the ladder it was reached."""
        return MetricDelta("peak_output_throughput", "peak output tok/s", self.peak_a_tok_s, self.peak_b_tok_s, True)

    def headline(self) -> str:
        """One line: the change in output tok/s at the highest swept value both runs share, and at peak."""
        parts = []
        if self.points:
            last = self.points[-1]
            d = last.delta("output_throughput")
            if d is not None and d.ratio is not None:
                parts.append(f"output tok/s at {last.key}: {display.num(d.before)} → {display.num(d.after)}, "
                             f"{display.ratio(d.before, d.after)}")
        if self.peak.ratio is not None:
            parts.append(f"peak {display.num(self.peak_a_tok_s)} → {display.num(self.peak_b_tok_s)}, "
                         f"{display.ratio(self.peak_a_tok_s, self.peak_b_tok_s)}")
        return "; ".join(parts) if parts else "no sweep point in common"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "run_a": str(self.run_a),
            "run_b": str(self.run_b),
            "swept": self.swept,
            "headline": self.headline(),
            "peak": self.peak.to_dict(),
            "points": [p.to_dict() for p in self.points],
            "only_a": list(self.only_a),
            "only_b": list(self.only_b),
            "notes": list(self.notes),
        }

    def to_markdown(self) -> str:
        out = ["# servescope compare", "", f"A (before): `{md(self.run_a)}`  ", f"B (after): `{md(self.run_b)}`", "",
               f"**{md(self.headline())}**", ""]
        if self.points:
            key_metrics = ("output_throughput", "median_ttft_ms", "p99_itl_ms")
            header = [self.swept]
            for name in key_metrics:
                label = next(lbl for n, lbl, _ in COMPARED_METRICS if n == name)
                header += [f"{label} A", f"{label} B", "change"]
            rows = []
            for p in self.points:
                row = [p.key]
                for name in key_metrics:
                    d = p.delta(name)
                    row += [display.num(d.before), display.num(d.after), display.ratio(d.before, d.after)] if d \
                        else [display.MISSING] * 3
                rows.append(row)
            out += [table(header, rows), ""]
            for p in self.points:
                out += [f"## {md(p.key)}", ""]
                out.append(table(("metric", "A", "B", "B / A", "better?"), [
                    (d.label, display.num(d.before), display.num(d.after), display.ratio(d.before, d.after),
                     {True: "yes", False: "no", None: ""}[d.improved])
                    for d in p.deltas if d.before is not None or d.after is not None
                ]))
                out.append("")
                if p.notes:
                    out += [f"- {md(n)}" for n in p.notes]
                    out.append("")
        else:
            out += ["No sweep point is present in both runs.", ""]
        if self.only_a:
            out += [f"Only in A: {md(', '.join(self.only_a))}", ""]
        if self.only_b:
            out += [f"Only in B: {md(', '.join(self.only_b))}", ""]
        out += [f"- {md(n)}" for n in self.notes]
        return "\n".join(out).rstrip() + "\n"


def _key(p: PointView) -> tuple[str, float] | None:
    if p.concurrency is not None:
        return "concurrency", float(p.concurrency)
    if p.request_rate is not None:
        return "request rate", round(float(p.request_rate), 9)
    return None


def _key_label(kind: str, value: float) -> str:
    return f"c={value:g}" if kind == "concurrency" else f"rate={value:g}"


def _telemetry_mean(rows: list[TelemetryRow], point: int, fragments: tuple[str, ...]) -> float | None:
    """Mean over a point's GPUs of the first aggregate whose name contains one of ``fragments``."""
    for scope in ("gpu", "all", "point"):  # per-GPU aggregates first; point totals (J per token) last
        values = []
        for r in rows:
            if r.point != point or r.scope != scope:
                continue
            key = next((k for frag in fragments for k in r.values if frag in k), None)
            v = r.values.get(key) if key else None
            if isinstance(v, (int, float)):
                values.append(float(v))
        if values:
            return sum(values) / len(values)
    return None


def _peak(model: ReportModel) -> float | None:
    vals = [v for p in model.points if (v := p.metric("output_throughput")) is not None]
    return max(vals) if vals else None


def compare_models(a: ReportModel, b: ReportModel) -> CompareResult:
    """Compare two gathered runs (see ``compare_runs``)."""
    keyed_a = {k: p for p in a.points if (k := _key(p)) is not None}
    keyed_b = {k: p for p in b.points if (k := _key(p)) is not None}
    notes = []
    if a.swept != b.swept:
        notes.append(f"A swept {a.swept}, B swept {b.swept}: only points with the same swept value are matched")
    matched = []
    for key in sorted(set(keyed_a) & set(keyed_b), key=lambda k: (k[0], k[1])):
        pa, pb = keyed_a[key], keyed_b[key]
        deltas = [MetricDelta(n, lbl, pa.metric(n), pb.metric(n), hib) for n, lbl, hib in COMPARED_METRICS]
        for frags, lbl, hib in COMPARED_TELEMETRY:
            ta = _telemetry_mean(a.telemetry_rows, pa.point, frags)
            tb = _telemetry_mean(b.telemetry_rows, pb.point, frags)
            if ta is not None or tb is not None:
                deltas.append(MetricDelta(frags[0], lbl, ta, tb, hib))
        pnotes = [f"{side}: {w}" for side, p in (("A", pa), ("B", pb)) for w in p.warnings]
        matched.append(PointComparison(
            key=_key_label(*key),
            concurrency=pa.concurrency,
            request_rate=pa.request_rate if pa.concurrency is None else None,
            point_a=pa.point,
            point_b=pb.point,
            deltas=tuple(deltas),
            notes=tuple(pnotes),
        ))
    only_a = tuple(_key_label(*k) for k in sorted(set(keyed_a) - set(keyed_b)))
    only_b = tuple(_key_label(*k) for k in sorted(set(keyed_b) - set(keyed_a)))
    for side, model in (("A", a), ("B", b)):
        unkeyed = [p.label for p in model.points if _key(p) is None]
        if unkeyed:
            notes.append(f"{side}: point(s) {', '.join(unkeyed)} have no concurrency or rate and cannot be matched")
        notes.extend(f"{side}: {n}" for n in model.notes)
    return CompareResult(
        run_a=a.run_path,
        run_b=b.run_path,
        swept=a.swept if a.swept == b.swept else f"{a.swept} / {b.swept}",
        points=tuple(matched),
        only_a=only_a,
        only_b=only_b,
        peak_a_tok_s=_peak(a),
        peak_b_tok_s=_peak(b),
        notes=tuple(notes),
    )


def compare_runs(run_a: RunDir, run_b: RunDir) -> CompareResult:
    """Per sweep point, every headline metric of ``run_b`` against ``run_a`` (before -> after), with ratios."""
    return compare_models(gather(run_a), gather(run_b))
