"""``servescope tiles`` as users run it: a real subprocess, so exit codes and stdout/stderr are the real contract."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from servescope import tiles


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servescope", "tiles", *args], capture_output=True, text=True,
                          timeout=120)


def _one_error_line(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("servescope: error: ")
    assert "Traceback" not in res.stderr
    assert res.stdout == ""
    return lines[0]


def test_default_tiles_table():
    res = _run("--arch", "sm120", "--a", "nvfp4", "--out", "bf16")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "sm_120  nvfp4 x nvfp4 -> bf16  dense" in out and "capacity 101,376 B per block" in out
    for t in tiles.default_tiles("sm120", "nvfp4"):
        assert str(t) in out
    row = next(line for line in out.splitlines() if line.startswith("128x256x128 "))
    assert row.split()[-1] == "yes" and " 93,184 " in row  # 3 stages, CUTLASS's own sizeof (probe table)


def test_failing_tile_prints_the_reason():
    res = _run("--arch", "sm_120a", "--a", "mxfp8", "--tile", "128x256x128", "--tile", "128x128x128")
    assert res.returncode == 0, res.stderr
    assert "128x256x128: Specialization requires Stages set to value 2 or more. (2 stages need 110,624 B > " \
           "101,376 B)" in res.stdout
    rows = {line.split()[0]: line.split()[-1] for line in res.stdout.splitlines() if line[:1].isdigit()}
    assert rows["128x128x128"] == "yes"


def test_padding_flag_in_table():
    res = _run("--arch", "sm120", "--a", "mxfp4", "--source", "--grouped", "--tile", "128x128x128")
    assert res.returncode == 0, res.stderr
    assert "NO (padding)" in res.stdout
    assert "102,400 B > 101,376 B" in res.stdout


def test_json_output_matches_the_library():
    res = _run("--arch", "sm100", "--a", "nvfp4", "--out", "nvfp4", "--grouped", "--tile", "256x256x256", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["schema_version"] == 1 and doc["cutlass_version"] == tiles.CUTLASS_VERSION
    (rec,) = doc["tiles"]
    want = tiles.analyze_tile("sm100", "nvfp4", None, "nvfp4", "256x256x256", grouped=True)
    assert rec == json.loads(json.dumps(want.to_dict()))
    assert rec["schedule"] == "2sm" and rec["kernel"] == "grouped" and rec["fits"] is True


def test_small_m_section_with_catalog_gpu():
    res = _run("--gpu", "rtx-pro-6000", "--a", "nvfp4", "--grouped", "--tile", "128x128x128",
               "--tokens-per-expert", "32", "--gemm-n", "2048", "--gemm-k", "6144", "--experts", "256", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["tiles"][0]["arch"] == "sm_120"
    (cost,) = doc["small_m"]
    assert cost["sm_count"] == 188 and cost["row_padding_fraction"] == pytest.approx(0.75)
    assert cost["summary"].startswith("at 32 tokens per expert a 128-row tile does 75% padding")


@pytest.mark.parametrize("args,needle", [
    (("--arch", "sm120", "--a", "nvfp4", "--tile", "128x256"), "bad tile '128x256'"),
    (("--arch", "sm120", "--a", "nvfp4", "--tile", "128x256x100"), "bad tile"),
    (("--arch", "sm120", "--a", "nvfp5"), "unknown operand format 'nvfp5'"),
    (("--arch", "sm120", "--a", "nvfp4", "--out", "int4"), "unknown output format 'int4'"),
    (("--arch", "sm999", "--a", "nvfp4"), "unknown architecture 'sm999'"),
    (("--arch", "sm90", "--a", "nvfp4"), "no block-scaled"),
    (("--arch", "sm120", "--a", "nvfp4", "--schedule", "2sm"), "schedule '2sm'"),
    (("--a", "nvfp4"), "give --arch"),
    (("--arch", "sm120", "--a", "nvfp4", "--tokens-per-expert", "32"), "--tokens-per-expert needs"),
])
def test_user_errors_are_one_line_exit_2(args, needle):
    line = _one_error_line(_run(*args))
    assert needle in line
