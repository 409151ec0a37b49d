"""report.html opened in a real headless Chromium (Debian's ``chromium``), driven over the DevTools protocol.

Asserts what a user would see go wrong: the page does not load, the console shows an
error (a CSP violation, i.e. something tried to load from outside, is one), a script runs
(an alert from an unescaped error text), a request leaves the file, or the plots are missing.
Skipped with the reason when no Chromium is installed (scripts/test.sh installs it in CI).
"""

from __future__ import annotations

import asyncio

import pytest

from servescope.report import write_reports
from servescope.run import RunDir

from .headless_chromium import HeadlessChromium, find_chromium
from .runfactory import MALICIOUS

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")

PLOTS_JS = (
    "Array.from(document.querySelectorAll('svg.plot')).map(s => [s.dataset.plot, s.getBoundingClientRect().width])"
)


async def _open(run: RunDir) -> tuple[object, list, str, int]:
    path = write_reports(run)["html"]
    assert CHROMIUM is not None
    async with HeadlessChromium(CHROMIUM) as browser:
        log = await browser.load(path)
        plots = await browser.evaluate(PLOTS_JS)
        text = await browser.evaluate("document.body.innerText")
        scripts = await browser.evaluate("document.scripts.length")
    return log, plots, text, scripts


@pytest.mark.timeout(180)
def test_report_loads_without_console_errors_and_shows_every_plot(small_run: RunDir):
    log, plots, text, scripts = asyncio.run(_open(small_run))
    assert log.loaded
    assert log.console_errors == [] and log.exceptions == [] and log.dialogs == []
    assert log.external_requests == []
    assert [name for name, _ in plots] == ["throughput", "latency", "itl", "timeline-0", "roofline"]
    assert all(width > 300 for _, width in plots)  # laid out, not collapsed to nothing
    assert scripts == 0
    assert "Throughput plateaus at c=32" in text


@pytest.mark.timeout(180)
def test_malicious_error_text_is_shown_not_run(malicious_run: RunDir):
    log, plots, text, scripts = asyncio.run(_open(malicious_run))
    assert log.loaded
    assert log.dialogs == []  # alert(1) never ran
    assert log.console_errors == [] and log.exceptions == []
    assert scripts == 0
    assert MALICIOUS in text  # the text is displayed literally
    assert len(plots) == 5


@pytest.mark.timeout(180)
def test_the_harness_sees_errors_blocked_loads_and_dialogs(tmp_path):
    """A negative control: without it, "no console errors" could mean the listener heard nothing at all."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!DOCTYPE html><html><head><meta http-equiv=\"Content-Security-Policy\" content=\"img-src data:\">"
        "</head><body><img src=\"http://192.0.2.1/x.png\"><script>console.error('boom'); alert('hi');"
        "undefined_fn();</script></body></html>"
    )

    async def go() -> object:
        assert CHROMIUM is not None
        async with HeadlessChromium(CHROMIUM) as browser:
            return await browser.load(page)

    log = asyncio.run(go())
    assert any("boom" in e for e in log.console_errors)
    assert any("Content Security Policy" in e or "img-src" in e for e in log.console_errors)
    assert log.dialogs == ["hi"]
    assert any("undefined_fn" in e for e in log.exceptions)
    assert log.external_requests == ["http://192.0.2.1/x.png"]  # attempted, then blocked by the CSP
