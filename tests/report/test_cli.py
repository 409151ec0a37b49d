"""``servescope report`` and ``servescope compare`` as a user runs them (subprocess: the exit-code contract)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servescope.run import RunDir

from .conftest import SMALL
from .runfactory import RunSpec, build_run


def _servescope(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servescope", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, RunDir]:
    base = tmp_path_factory.mktemp("cli")
    a = build_run(base / "a", RunSpec(**SMALL))
    b = build_run(base / "b", RunSpec(**{**SMALL, "tok_s": (704.0, 1106.0, 1790.0, 2095.0), "running_cap": 64}))
    return a, b


def test_compare_prints_the_before_after_table(pair: tuple[RunDir, RunDir]):
    res = _servescope("compare", str(pair[0].path), str(pair[1].path))
    assert res.returncode == 0, res.stderr
    assert "| c=64 | 1,640 | 2,095 | x1.28 (+28%) |" in res.stdout


def test_compare_json_is_machine_readable(pair: tuple[RunDir, RunDir]):
    res = _servescope("compare", "--json", str(pair[0].path), str(pair[1].path))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    top = next(p for p in data["points"] if p["key"] == "c=64")
    assert round(next(m for m in top["metrics"] if m["metric"] == "output_throughput")["change_pct"]) == 28


def test_compare_with_a_missing_run_is_one_line_exit_2(pair: tuple[RunDir, RunDir], tmp_path: Path):
    res = _servescope("compare", str(pair[0].path), str(tmp_path / "nope"))
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_report_rebuilds_both_files(pair: tuple[RunDir, RunDir]):
    run = pair[0]
    for name in ("report.html", "report.md"):
        run.file(name).unlink(missing_ok=True)
    res = _servescope("report", str(run.path))
    assert res.returncode == 0, res.stderr
    assert run.file("report.html").stat().st_size > 10_000
    assert run.file("report.md").read_text().startswith("# servescope report")
