"""``report.md``: the same content as ``report.html``, as tables, for a terminal, a PR or an issue.

Markdown renderers pass raw HTML through, so text from files is escaped here too
(``<``, ``>``, ``&``), plus ``|`` and newlines, which would break a table row.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from servescope import __version__
from servescope.report import display
from servescope.report.model import Finding, ReportModel

NOT_RECORDED = "_not recorded_"


def md(value: object) -> str:
    """Escape a file-sourced string for a Markdown table cell or paragraph."""
    text = "" if value is None else str(value)
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "\\`")
    text = text.replace("*", "\\*").replace("_", "\\_").replace("[", "\\[").replace("]", "\\]")
    return " ".join(text.split())


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-flavoured table; first column left-aligned, the rest right-aligned (numbers)."""
    lines = ["| " + " | ".join(md(h) for h in header) + " |",
             "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines.extend("| " + " | ".join(md(c) for c in row) + " |" for row in rows)
    return "\n".join(lines)


def _missing(why: str = "") -> str:
    return NOT_RECORDED + (f" ({md(why)})" if why else "")


def _finding(model: ReportModel, f: Finding) -> list[str]:
    out = [f"### [{md(f.severity.upper())}] {md(f.title)}", "",
           f"{md(f.verdict)}", "", f"Confidence: {md(f.confidence)}."]
    if f.points:
        out.append(f"Sweep points: {md(', '.join(display.point_label(model, i) for i in f.points))}.")
    out.append("")
    if f.evidence:
        out.append(table(("evidence", "value", "source"),
                         [(e.label, display.with_unit(e.value, e.unit), e.source) for e in f.evidence]))
        out.append("")
    if f.recommendations:
        out.append("What to try:")
        out.append("")
        out.extend(f"- {md(r)}" for r in f.recommendations)
        out.append("")
    if f.marks:
        out.append(table(("marked moment (s since start)", "label"),
                         [(display.num(model.t_s(m.t_ns)), m.label) for m in f.marks[:20]]))
        if len(f.marks) > 20:
            out.append(f"\n({len(f.marks) - 20} more marks in diagnosis.json)")
        out.append("")
    return out


def _json_for_markdown(data: object) -> str:
    """JSON for a fenced block: ``<``, ``>``, ``&`` and backticks as JSON \\u escapes (the same
    data, still valid JSON), so no renderer can turn a file's content into markup or end the fence."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    for ch in "<>&`":
        text = text.replace(ch, f"\\u{ord(ch):04x}")
    return text


def render_markdown(model: ReportModel) -> str:
    """The whole report as Markdown text."""
    out: list[str] = ["# servescope report", "", f"Run: `{md(model.run_path)}`", ""]
    facts = display.target_facts(model)
    if facts:
        out += [table(("", ""), facts), ""]

    out += ["## Diagnosis", ""]
    out.append(f"**{md(model.headline)}**" if model.headline else _missing("no diagnosis.json"))
    out.append("")
    for f in model.findings:
        out += _finding(model, f)
    for n in model.diagnosis_notes:
        out.append(f"- {md(n)}")
    if model.diagnosis_notes:
        out.append("")

    out += ["## Throughput and latency", ""]
    if model.points:
        cols = display.sweep_columns(model)
        header = [model.swept, *[h for h, _ in cols], "notes"]
        rows = [[p.label, *[display.num(p.metric(m)) for _, m in cols],
                 display.point_flags(model, p)] for p in model.points]
        out += [table(header, rows), ""]
        if model.knee_point is not None:
            out += [f"Knee: **{md(display.point_label(model, model.knee_point))}** "
                    f"(source: {md(model.knee_source)}).", ""]
        scaling = display.scaling_rows(model)
        if scaling:
            out += [table(("step", "throughput gain", "gain per doubling"), scaling), ""]
        out += [f"Metrics from: {md('; '.join(sorted({p.metrics_source for p in model.points})))}.", ""]
    else:
        out += [_missing("no requests.jsonl, points.jsonl or summary.json entries"), ""]

    out += ["## Inter-token latency (chunk-aware)", ""]
    itl_pts = [p for p in model.points if p.itl_count]
    if itl_pts:
        rows = []
        for p in itl_pts:
            p50, p99 = p.metric("median_itl_ms"), p.metric("p99_itl_ms")
            rows.append([p.label, f"{p.itl_count:,}", *[display.num(p.metric(m)) for _, m in display.ITL_COLUMNS],
                         f"{p99 / p50:.1f}x" if p50 and p99 else display.MISSING])
        out += [table([model.swept, "ITLs", *[f"{h} ms" for h, _ in display.ITL_COLUMNS], "p99 / p50"], rows), ""]
    else:
        out += [_missing("no streamed chunks in requests.jsonl"), ""]

    out += ["## GPU telemetry", ""]
    if model.telemetry_status:
        out += [f"GPU telemetry: {md(model.telemetry_status)}", ""]
    header, rows = display.telemetry_table(model)
    out.append(table(header, rows) if rows else _missing("no telemetry_summary.json"))
    out.append("")
    theader, trows = display.point_totals_table(model)
    if trows:
        out += ["Energy and totals per point:", "", table(theader, trows), ""]
    sheader, srows = display.server_table(model)
    if srows:
        out += ["Server metrics per point:", "", table(sheader, srows), ""]
    if model.gpus:
        out += [f"Timelines of {len(model.gpus)} GPU(s) are in report.html.", ""]
    for w in model.telemetry_warnings:
        out.append(f"- {md(w)}")
    if model.telemetry_warnings:
        out.append("")

    out += ["## Roofline: measured vs predicted", ""]
    rl_rows = display.roofline_rows(model)
    if model.roofline is None:
        out += [_missing("no roofline.json"), ""]
    else:
        rl = model.roofline
        facts_rl = [f"{k}: {md(v)}" for k, v in (("model", rl.model), ("GPU", rl.gpu), ("dtype", rl.dtype),
                                                  ("dense peak TFLOPS", display.num(rl.peak_tflops)),
                                                  ("parallelism", rl.parallelism)) if v is not None]
        out += [" · ".join(facts_rl), ""]
        out += [table(list(rl_rows[0]), [list(r.values()) for r in rl_rows]) if rl_rows else _missing(), ""]

    out += ["## Failures", ""]
    fail_rows = [[p.label, kind, f"{count:,}", " | ".join(p.error_examples)]
                 for p in model.points for kind, count in sorted(p.errors_by_kind.items())]
    out += [table((model.swept, "kind", "count", "examples (as received)"), fail_rows) if fail_rows
            else "No failed measured requests.", ""]

    out += ["## Data quality and notes", ""]
    notes = [f"{p.label}: {w}" for p in model.points for w in p.warnings] + model.notes
    out += [f"- {md(n)}" for n in notes] or ["None."]
    out.append("")
    out += ["## Run configuration and environment", ""]
    for name, data in (("config.json", model.config), ("env.json", model.env)):
        out += [f"<details><summary>{name}</summary>", "", "```json",
                _json_for_markdown(data), "```", "",
                "</details>", ""]
    out += [table(("file", "present"), [(k, "yes" if v else "no") for k, v in model.files.items()]), "",
            f"_servescope {__version__}; rebuilt from the run directory only._", ""]
    return "\n".join(out)
