"""The CLI's exit-code contract, run as a real subprocess (what users and scripts see)."""

from __future__ import annotations

import subprocess
import sys

from servescope import __version__


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servescope", *args], capture_output=True, text=True, timeout=120
    )


def test_version_prints_package_version():
    res = _run("--version")
    assert res.returncode == 0
    assert res.stdout.strip() == f"servescope {__version__}"


def test_unknown_option_is_one_line_exit_2_without_traceback():
    res = _run("--no-such-flag")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("servescope: error: ")
    assert "Traceback" not in res.stderr


def test_help_lists_commands():
    res = _run("--help")
    assert res.returncode == 0
    assert "Usage" in res.stdout
