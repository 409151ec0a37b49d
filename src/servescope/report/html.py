"""``report.html``: one self-contained page, readable offline, safe to open.

Self-contained: CSS inline, figures as inline SVG, no script, no font, no URL fetched;
a Content-Security-Policy meta tag (``default-src 'none'``) makes the browser refuse any
load that slipped in anyway. Safe: every string that came from a file or a server
(model names, URLs, error texts, finding texts) passes through ``esc`` (html.escape,
quotes included) before it reaches the page; the only unescaped markup is our own and
matplotlib's SVG, whose text matplotlib escapes itself.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

from servescope import __version__
from servescope.report import display, plots
from servescope.report.model import Finding, ReportModel

NOT_RECORDED = '<p class="missing">not recorded{why}</p>'


def esc(value: object) -> str:
    """HTML-escape any value (None becomes empty)."""
    return html.escape("" if value is None else str(value), quote=True)


def _missing(why: str = "") -> str:
    return NOT_RECORDED.format(why=f": {esc(why)}" if why else "")


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], classes: Sequence[str] | None = None) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for i, row in enumerate(rows):
        cls = f' class="{esc(classes[i])}"' if classes and classes[i] else ""
        body.append(f"<tr{cls}>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>")
    return f'<div class="tw"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _figure(svg: str | None, caption: str, why_missing: str, cls: str = "") -> str:
    if svg is None:
        return _missing(why_missing)
    klass = f' class="{cls}"' if cls else ""
    return f"<figure{klass}>{svg}<figcaption>{esc(caption)}</figcaption></figure>"


def _finding_html(model: ReportModel, f: Finding) -> str:
    sev = f.severity if f.severity in ("critical", "warning", "info") else "info"
    parts = [
        f'<article class="finding {sev}" id="finding-{esc(f.id)}">',
        f'<h3><span class="badge {sev}">{esc(f.severity)}</span> {esc(f.title)}'
        f' <span class="conf">confidence: {esc(f.confidence)}</span></h3>',
        f'<p class="verdict">{esc(f.verdict)}</p>',
    ]
    if f.points:
        labels = ", ".join(display.point_label(model, i) for i in f.points)
        parts.append(f'<p class="pts">sweep points: {esc(labels)}</p>')
    if f.evidence:
        rows = [(e.label, display.with_unit(e.value, e.unit), e.source) for e in f.evidence]
        parts.append(_table(("evidence", "value", "source"), rows))
    if f.recommendations:
        items = "".join(f"<li>{esc(r)}</li>" for r in f.recommendations)
        parts.append(f'<p class="rec-h">What to try</p><ul class="rec">{items}</ul>')
    if f.marks:
        parts.append(f'<p class="pts">{len(f.marks)} moment(s) marked on the GPU timelines</p>')
    parts.append("</article>")
    return "".join(parts)


def _sweep_section(model: ReportModel) -> str:
    if not model.points:
        return _missing("no requests.jsonl, points.jsonl or summary.json entries")
    cols = display.sweep_columns(model)
    header = [model.swept, *[h for h, _ in cols], "notes"]
    rows, classes = [], []
    for p in model.points:
        rows.append([p.label, *[display.num(p.metric(m)) for _, m in cols],
                     display.point_flags(model, p)])
        classes.append("knee" if p.point == model.knee_point else ("bad" if p.interrupted else ""))
    out = [_table(header, rows, classes)]
    if model.knee_point is not None:
        out.append(f'<p class="small">knee: {esc(display.point_label(model, model.knee_point))}'
                   f" (source: {esc(model.knee_source)})</p>")
    scaling = display.scaling_rows(model)
    if scaling:
        out.append("<h3>Scaling between points</h3>")
        out.append(_table(("step", "throughput gain", "gain per doubling"), scaling))
    sources = sorted({p.metrics_source for p in model.points})
    out.append(f'<p class="small">metrics from: {esc("; ".join(sources))}</p>')
    return "".join(out)


def _itl_section(model: ReportModel) -> str:
    pts = [p for p in model.points if p.itl_count]
    if not pts:
        return _missing("no streamed chunks in requests.jsonl")
    rows = []
    for p in pts:
        p50, p99 = p.metric("median_itl_ms"), p.metric("p99_itl_ms")
        tail = f"{p99 / p50:.1f}x" if p50 and p99 else display.MISSING
        rows.append([p.label, f"{p.itl_count:,}", *[display.num(p.metric(m)) for _, m in display.ITL_COLUMNS], tail])
    return _figure(plots.itl_figure(model), "Chunk-aware inter-token latency by percentile (log scale).", "",
                   cls="narrow") + \
        _table([model.swept, "ITLs", *[f"{h} ms" for h, _ in display.ITL_COLUMNS], "p99 / p50"], rows)


def _gpu_section(model: ReportModel) -> str:
    out = []
    if model.telemetry_status:
        out.append(f'<p class="small">GPU telemetry: {esc(model.telemetry_status)}</p>')
    figs = plots.timeline_figures(model)
    if figs:
        for svg in figs:
            out.append(_figure(svg, "Shaded: measured window of each sweep point (grey: warm-up). "
                                    "Dashed: limits. Red lines: stalls the findings point at.", ""))
    else:
        out.append(_missing("no telemetry/gpu_samples.csv (no NVML, or telemetry was off)"))
    header, rows = display.telemetry_table(model)
    out.append("<h3>Per-point aggregates</h3>")
    out.append(_table(header, rows) if rows else _missing("no telemetry_summary.json"))
    theader, trows = display.point_totals_table(model)
    if trows:
        out.append("<h3>Energy and totals per point</h3>")
        out.append(_table(theader, trows))
    sheader, srows = display.server_table(model)
    if srows:
        out.append("<h3>Server metrics per point</h3>")
        out.append(_table(sheader, srows))
    if model.telemetry_warnings:
        out.append("<ul class=\"notes\">" + "".join(f"<li>{esc(w)}</li>" for w in model.telemetry_warnings) + "</ul>")
    return "".join(out)


def _roofline_section(model: ReportModel) -> str:
    rl = model.roofline
    if rl is None:
        return _missing("no roofline.json (the model or the GPU was not known)")
    out = []
    facts = [("model", rl.model), ("GPU", rl.gpu), ("dtype", rl.dtype),
             ("dense peak", display.with_unit(rl.peak_tflops, "TFLOPS") if rl.peak_tflops else None),
             ("memory bandwidth", display.with_unit(rl.bandwidth_bytes_s / 1e9, "GB/s") if rl.bandwidth_bytes_s
              else None), ("parallelism", rl.parallelism)]
    out.append('<p class="small">' + " · ".join(f"{esc(k)}: {esc(v)}" for k, v in facts if v is not None) + "</p>")
    out.append(_figure(plots.roofline_figure(model), "Left: measured output tok/s against the roofline's upper "
                       "bound. Right: each concurrency on the GPU's roofline; hollow = predicted, filled = measured "
                       "(decode-step FLOPs x measured steps/s).", "roofline.json has no points"))
    rows = display.roofline_rows(model)
    if rows:
        out.append(_table(list(rows[0]), [list(r.values()) for r in rows]))
    return "".join(out)


def _failures_section(model: ReportModel) -> str:
    rows = []
    for p in model.points:
        for kind, count in sorted(p.errors_by_kind.items()):
            rows.append([p.label, kind, f"{count:,}", " | ".join(p.error_examples)])
    if not rows:
        return '<p class="small">no failed measured requests.</p>'
    return _table((model.swept, "kind", "count", "examples (as received)"), rows)


def _json_block(title: str, data: dict[str, Any]) -> str:
    if not data:
        return f"<details><summary>{esc(title)}</summary>{_missing()}</details>"
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    return f"<details><summary>{esc(title)}</summary><pre>{esc(text)}</pre></details>"


CSS = """
:root{--fg:#111827;--mut:#6b7280;--line:#e5e7eb;--crit:#b91c1c;--warn:#b45309;--info:#1d4ed8}
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:var(--fg);
margin:0 auto;max-width:1240px;padding:20px 28px 60px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:30px 0 8px;border-bottom:1px solid var(--line);
padding-bottom:4px}h3{font-size:15px;margin:14px 0 6px}
.sub{color:var(--mut);margin:0 0 12px}.small{color:var(--mut);font-size:12px}
.headline{font-size:17px;font-weight:600;background:#fef2f2;border-left:4px solid var(--crit);padding:10px 14px;
margin:12px 0}
table{border-collapse:collapse;margin:6px 0 10px;font-size:12.5px}
th,td{border:1px solid var(--line);padding:3px 8px;text-align:right;vertical-align:top}
td{white-space:nowrap}.finding td,.facts td{white-space:normal}
th{background:#f9fafb;font-weight:600}td:first-child,th:first-child{text-align:left}
tr.knee td{background:#fee2e2;font-weight:600}tr.bad td{background:#fef3c7}
.facts td{text-align:left}.facts td:first-child{color:var(--mut);white-space:nowrap}
figure{margin:8px 0 14px}figcaption{color:var(--mut);font-size:12px}
svg.plot{width:100%;height:auto;max-width:100%}
.finding{border:1px solid var(--line);border-left:5px solid var(--info);border-radius:4px;padding:8px 14px;
margin:10px 0}.finding.critical{border-left-color:var(--crit)}.finding.warning{border-left-color:var(--warn)}
.finding h3{margin:4px 0}.finding td,.finding th{text-align:left}figure.narrow{max-width:760px}
.badge{display:inline-block;font-size:11px;text-transform:uppercase;color:#fff;background:var(--info);
border-radius:3px;padding:1px 6px;vertical-align:2px}.badge.critical{background:var(--crit)}
.badge.warning{background:var(--warn)}.conf{color:var(--mut);font-weight:400;font-size:12px}
.verdict{margin:4px 0 6px}.pts{color:var(--mut);font-size:12px;margin:2px 0}.rec-h{font-weight:600;margin:6px 0 2px}
.rec{margin:2px 0 6px}.missing{color:var(--mut);font-style:italic}
pre{background:#f9fafb;border:1px solid var(--line);padding:8px;overflow:auto;font-size:12px;max-height:420px}
nav a{margin-right:12px;color:var(--info);text-decoration:none}
ul.notes li{color:var(--warn)}.tw{max-width:100%;overflow-x:auto}

"""


def render_html(model: ReportModel) -> str:
    """The whole page as a string."""
    title_bits = [str(model.config.get("name") or model.run_path.name)]
    facts = display.target_facts(model)
    sections: list[str] = []

    verdict = [f'<p class="headline">{esc(model.headline)}</p>' if model.headline else
               _missing("no diagnosis.json (run `servescope diagnose RUN_DIR`)")]
    if model.findings:
        verdict.extend(_finding_html(model, f) for f in model.findings)
    if model.diagnosis_notes:
        verdict.append('<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in model.diagnosis_notes) + "</ul>")
    sections.append(_section("findings", "Diagnosis", "".join(verdict)))

    charts = (
        _figure(plots.throughput_figure(model), "Output tokens/s per sweep point; dashed red: the knee.",
                "no measured throughput", cls="narrow")
        + _figure(plots.latency_figure(model), "p50 (solid) and p99 (dashed) latencies per sweep point.",
                  "no latency metrics")
    )
    sections.append(_section("sweep", "Throughput and latency", charts + _sweep_section(model)))
    sections.append(_section("itl", "Inter-token latency", _itl_section(model)))
    sections.append(_section("gpus", "GPU telemetry", _gpu_section(model)))
    sections.append(_section("roofline", "Roofline: measured vs predicted", _roofline_section(model)))
    sections.append(_section("failures", "Failures", _failures_section(model)))

    warn_items = [f"{p.label}: {w}" for p in model.points for w in p.warnings] + model.notes
    notes_html = ('<ul class="notes">' + "".join(f"<li>{esc(w)}</li>" for w in warn_items) + "</ul>") if warn_items \
        else '<p class="small">none.</p>'
    files = _table(("file", "present"), [(k, "yes" if v else "no") for k, v in model.files.items()])
    run_html = (
        _json_block("config.json", model.config) + _json_block("env.json", model.env)
        + "<h3>Data quality and notes</h3>" + notes_html + "<h3>Files read</h3>" + files
    )
    sections.append(_section("run", "Run configuration and environment", run_html))

    nav = "".join(f'<a href="#{sid}">{esc(name)}</a>' for sid, name in (
        ("findings", "Diagnosis"), ("sweep", "Throughput & latency"), ("itl", "ITL"), ("gpus", "GPUs"),
        ("roofline", "Roofline"), ("failures", "Failures"), ("run", "Run")))
    facts_html = '<table class="facts">' + "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in facts) + "</table>" if facts else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
        "img-src data:\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>servescope report: {esc(title_bits[0])}</title><style>{CSS}</style></head><body>"
        f"<header><h1>servescope report</h1><p class=\"sub\">{esc(model.run_path)}</p>{facts_html}"
        f"<nav>{nav}</nav></header>"
        + "".join(sections)
        + f'<footer class="small"><p>servescope {esc(__version__)} · rebuilt from the run directory only '
        "(servescope report RUN_DIR)</p></footer></body></html>\n"
    )


def _section(sid: str, title: str, body: str) -> str:
    return f'<section id="{sid}"><h2>{esc(title)}</h2>{body}</section>'
