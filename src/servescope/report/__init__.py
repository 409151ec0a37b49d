"""Reports rendered from a run directory: ``report.html`` (self-contained, offline) and ``report.md``.

The report only reads files (``model.gather``), so ``servescope report RUN_DIR`` can rebuild
it any time, and a run that crashed still reports what it holds. ``compare.compare_runs``
puts two runs side by side per sweep point.
"""

from __future__ import annotations

import os
from pathlib import Path

from servescope import run as rundir
from servescope.report.html import render_html
from servescope.report.markdown import render_markdown
from servescope.report.model import ReportModel, gather
from servescope.run import RunDir

__all__ = ["ReportModel", "gather", "render_html", "render_markdown", "write_reports"]


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_reports(run: RunDir) -> dict[str, Path]:
    """Render ``report.html`` and ``report.md`` into the run directory; returns {"html": path, "md": path}.

    Files are replaced atomically, so a reader never sees half a report.
    """
    model = gather(run)
    html_path = run.file(rundir.REPORT_HTML)
    md_path = run.file(rundir.REPORT_MD)
    _write_atomic(html_path, render_html(model))
    _write_atomic(md_path, render_markdown(model))
    return {"html": html_path, "md": md_path}
