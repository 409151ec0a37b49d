"""Render a report and save a PNG of it from headless Chromium: ``docs/report-screenshot.png``.

    .venv/bin/python tests/report/make_screenshot.py docs/report-screenshot.png [RUN_DIR]

With RUN_DIR, that run's report is rebuilt and shot; without, a SYNTHETIC seed-shaped run
(tests/report/runfactory.py: 8 GPUs, c = 256..2,048, summary, telemetry summary, roofline and
diagnosis from the real servescope modules) is built in a temporary directory first.
Not a test (pytest does not collect it); it needs Debian's ``chromium``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, so `report.*` imports

from report.headless_chromium import HeadlessChromium, find_chromium
from report.runfactory import RunSpec, build_run
from servescope.report import write_reports
from servescope.run import RunDir


def _to_palette(png: bytes) -> bytes:
    """256-colour PNG: a third of the size for a page of flat colours and thin lines, same look."""
    from PIL import Image  # pillow comes with matplotlib

    buf = io.BytesIO()
    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE).save(
        buf, format="PNG", optimize=True
    )
    return buf.getvalue()


async def _shoot(html: Path, out: Path, width_px: int, max_height_px: int, palette: bool) -> None:
    binary = find_chromium()
    if binary is None:
        raise SystemExit("no chromium binary: apt-get install chromium")
    async with HeadlessChromium(binary) as browser:
        log = await browser.load(html)
        if not log.loaded or log.console_errors or log.exceptions:
            raise SystemExit(f"report did not load cleanly: {log}")
        png = await browser.screenshot(width_px=width_px, max_height_px=max_height_px)
    out.write_bytes(_to_palette(png) if palette else png)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("run_dir", type=Path, nargs="?")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--max-height", type=int, default=16000)
    ap.add_argument("--full-colour", action="store_true", help="keep Chromium's RGB PNG (3x larger)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="servescope-shot-") as tmp:
        if args.run_dir is not None:
            run = RunDir.open(args.run_dir)
        else:
            run = build_run(Path(tmp) / "seed-shaped", RunSpec(gpus=8, requests_per_slot=2, diagnosis="real"))
        html = write_reports(run)["html"]
        asyncio.run(_shoot(html, args.out, args.width, args.max_height, not args.full_colour))
    print(f"{args.out}: screenshot of {html}")


if __name__ == "__main__":
    main()
