"""report.html and report.md written into real run directories: content, escaping, self-containment."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from servescope import run as rundir
from servescope.report import write_reports
from servescope.report.html import render_html
from servescope.report.markdown import render_markdown
from servescope.report.model import gather
from servescope.run import RunDir

from .runfactory import MALICIOUS, RunSpec, build_run

PLOTS = ("throughput", "latency", "itl", "timeline-0", "roofline")


class _Tags(HTMLParser):
    """Collects every start tag with its attributes, as a browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _tags(html_text: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Tags()
    parser.feed(html_text)
    return parser.tags


@pytest.fixture(scope="module")
def written(small_run: RunDir) -> dict[str, Path]:
    return write_reports(small_run)


def test_write_reports_writes_both_files_into_the_run(written: dict[str, Path], small_run: RunDir):
    assert written == {"html": small_run.file(rundir.REPORT_HTML), "md": small_run.file(rundir.REPORT_MD)}
    assert written["html"].read_text().startswith("<!DOCTYPE html>")
    assert written["md"].read_text().startswith("# servescope report")
    assert not list(small_run.path.glob("*.tmp"))


def test_every_plot_is_an_inline_svg_that_parses(written: dict[str, Path]):
    text = written["html"].read_text()
    svgs = re.findall(r"<svg .*?</svg>", text, flags=re.S)
    names = [re.search(r'data-plot="([^"]+)"', s).group(1) for s in svgs]
    assert names == list(PLOTS)
    for svg in svgs:
        ET.fromstring(svg)  # well-formed XML, no prolog or DOCTYPE left inside the page


def test_the_page_loads_nothing_from_outside(written: dict[str, Path]):
    text = written["html"].read_text()
    tags = _tags(text)
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe", "object", "embed", "base")]
    for tag, attrs in tags:
        for name in ("src", "href", "xlink:href", "action"):
            value = attrs.get(name)
            assert value is None or value.startswith(("#", "data:")), (tag, name, value)
    assert not re.search(r"url\((?!#)", text)  # CSS / SVG url() only to ids in the page
    assert "@import" not in text
    csp = next(a for t, a in tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in csp["content"]


def test_html_shows_verdict_knee_findings_and_tables(written: dict[str, Path]):
    text = written["html"].read_text()
    assert "Throughput plateaus at c=32" in text
    assert '<tr class="knee"><td>c=32</td>' in text
    for section in ("findings", "sweep", "itl", "gpus", "roofline", "failures", "run"):
        assert f'<section id="{section}">' in text
    assert "Scheduler / KV ceiling of ~32 running requests" in text
    assert "KV cache has headroom" in text  # a recommendation
    assert "HTTP 503: server overloaded" in text  # a failure example, as received
    assert "not recorded" not in text  # every section had its data


def test_markdown_carries_the_same_numbers_as_tables(written: dict[str, Path], small_run: RunDir):
    md = written["md"].read_text()
    model = gather(small_run)
    for p in model.points:
        assert f"| {p.label} |" in md
    assert "| c=32 | 32 | 1,601 |" in md  # completed, output tok/s
    assert "Knee: **c=32**" in md
    assert "## Roofline: measured vs predicted" in md and "measured / bound" in md
    assert "| http\\_status | 2 |" in md
    for f in model.findings:
        assert f.title.split(" ")[0] in md


def test_file_sourced_text_is_escaped_in_html_and_markdown(malicious_run: RunDir):
    paths = write_reports(malicious_run)
    html_text = paths["html"].read_text()
    md_text = paths["md"].read_text()
    assert MALICIOUS not in html_text and "<script" not in html_text.lower()
    assert not [t for t, _ in _tags(html_text) if t == "script"]
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    # config (model, URL), env (GPU names), error texts, finding verdicts and recommendations, diagnosis notes
    assert html_text.count(escaped) >= 8
    assert MALICIOUS not in md_text and "<script" not in md_text.lower()
    assert escaped in md_text


def test_a_bare_run_reports_not_recorded_everywhere(tmp_path: Path):
    run = RunDir.create(tmp_path / "bare", {"target": {"url": "http://127.0.0.1:9"}})
    paths = write_reports(run)
    text = paths["html"].read_text()
    assert "<svg" not in text
    assert text.count("not recorded") >= 5
    assert "_not recorded_" in paths["md"].read_text()


def test_a_crashed_run_still_reports_what_it_holds(fresh_run: RunDir):
    lines = fresh_run.file(rundir.POINTS).read_text().splitlines(keepends=True)
    fresh_run.file(rundir.POINTS).write_text("".join(lines[:-1]))
    for name in (rundir.SUMMARY, rundir.TELEMETRY_SUMMARY, rundir.DIAGNOSIS, rundir.ROOFLINE):
        fresh_run.file(name).unlink()
    with fresh_run.file(rundir.REQUESTS).open("a") as fh:
        fh.write('{"request_id": 1, "po')
    text = render_html(gather(fresh_run))
    assert "no points.jsonl record" in text
    assert 'data-plot="throughput"' in text and 'data-plot="timeline-0"' in text
    assert "no diagnosis.json" in text and "no roofline.json" in text
    md = render_markdown(gather(fresh_run))
    assert "| c=64 |" in md


def test_dollar_signs_in_names_do_not_become_mathtext(tmp_path: Path):
    spec = RunSpec(concurrencies=(2, 4), tok_s=(10.0, 15.0), running_cap=4, output_len=8, warmup=1, gpus=1,
                   gpu_name="GPU $\\frac{1}{0}$ $", failures=0)
    run = build_run(tmp_path / "dollars", spec)
    text = render_html(gather(run))
    assert 'data-plot="timeline-0"' in text
    assert "GPU $\\frac{1}{0}$ $" in text  # shown literally, in the facts table and the figure title
