"""``servescope kernels`` as users run it: a subprocess, so the exit-code contract is what is tested."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servescope", "kernels", *args], capture_output=True, text=True,
                          timeout=120)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU; the no-GPU path cannot be exercised")
def test_without_a_gpu_one_line_and_exit_2():
    res = _run("--model", "glm-5", "--ep", "8", "--dtype", "bf16,fp8")
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("servescope: error: ")
    assert "GPU" in lines[0]
    assert "Traceback" not in res.stderr
    assert res.stdout == ""


def test_bad_flags_are_one_line_exit_2():
    res = _run("--model", "glm-5", "--tokens-per-expert", "1,two")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "servescope: error: --tokens-per-expert takes comma-separated integers, got '1,two'"
    ]
    res = _run("--hidden", "1024")
    assert res.returncode == 2
    assert "--expert-width" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_help_describes_the_command():
    res = _run("--help")
    assert res.returncode == 0
    assert "--tokens-per-expert" in res.stdout and "--backends" in res.stdout
