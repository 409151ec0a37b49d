"""``servescope bench`` and ``selftest`` as a user runs them: a real subprocess against loopback servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from servescope.load.selftest_server import SelftestServerConfig, serve_in_thread


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servescope", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(SelftestServerConfig(tokens_per_s=1000.0, tokens_per_chunk=1, ttft_ms=2.0)) as url:
        yield url


def test_bench_writes_a_run_prints_its_path_and_never_the_api_key(tmp_path, server):
    out = tmp_path / "run"
    res = _cli("bench", "--url", server, "--concurrency", "1,2", "--dataset", "text:hi", "--output-len", "5",
               "--num-prompts", "6", "--api-key", "sk-FLAG-SECRET", "--slo", "ttft:1000", "--out", str(out),
               env={"OPENAI_API_KEY": "sk-ENV-SECRET"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    assert "c=2" in res.stderr and "TTFT p50" in res.stderr
    for f in out.rglob("*"):
        if f.is_file():
            text = f.read_text()
            assert "sk-FLAG-SECRET" not in text and "sk-ENV-SECRET" not in text, f
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["api_key_set"] is True and "***" in cfg["argv"]
    summary = json.loads((out / "summary.json").read_text())
    assert [p["completed"] for p in summary["points"]] == [6, 6]
    assert summary["points"][0]["request_goodput"] > 0


def test_bench_with_two_worker_processes(tmp_path, server):
    out = tmp_path / "run"
    res = _cli("bench", "--url", server, "--concurrency", "4", "--dataset", "text:hi", "--output-len", "5",
               "--num-prompts", "8", "--workers", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "on 2 client processes" in res.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["workers"] == 2
    summary = json.loads((out / "summary.json").read_text())
    p = summary["points"][0]
    assert p["completed"] == 8 and p["client"]["processes"] == 2 and p["max_concurrent_requests"] <= 4


def test_bench_with_telemetry_goes_on_without_nvml(tmp_path, server):
    """Issue 4, "Faults": no NVML means telemetry off with one clear line; the benchmark still runs."""
    from servescope.telemetry.nvml import describe_gpus

    out = tmp_path / "run"
    res = _cli("bench", "--url", server, "--concurrency", "2", "--dataset", "text:hi", "--output-len", "5",
               "--num-prompts", "4", "--telemetry", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert json.loads((out / "summary.json").read_text())["points"][0]["completed"] == 4
    notes = json.loads((out / "telemetry" / "notes.json").read_text())
    if not describe_gpus():  # this machine has no GPU: the run says so instead of failing
        assert notes["gpu_telemetry"].startswith("telemetry off:")
        assert "telemetry off" in res.stderr
    assert (out / "telemetry_summary.json").exists()


@pytest.mark.parametrize("args", [
    ["--concurrency", "0"], ["--concurrency", "a,b"], ["--backend", "tgi"], ["--slo", "ttft:x"],
    ["--num-prompts", "5", "--duration", "3"], ["--range", "0.5"], ["--dataset", "csv:x"], ["--request-rate", "-1"],
    ["--workers", "0"], ["--workers", "many"],
])
def test_bad_flags_are_one_line_exit_2(tmp_path, args):
    res = _cli("bench", "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "r"), *args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servescope: error: "), res.stderr
    assert not (tmp_path / "r").exists()


def test_unreachable_server_is_one_line_exit_2(tmp_path):
    res = _cli("bench", "--url", "http://127.0.0.1:9", "--model", "m", "--dataset", "text:x", "--out",
               str(tmp_path / "r"))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("servescope: error: ")
    assert "Traceback" not in res.stderr


def test_ctrl_c_records_in_flight_requests_as_cancelled_and_exits_130(tmp_path):
    with serve_in_thread(SelftestServerConfig(tokens_per_s=10.0, ttft_ms=1.0)) as slow:
        out = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "servescope", "bench", "--url", slow, "--concurrency", "3",
                                 "--dataset", "text:x", "--output-len", "200", "--num-prompts", "3", "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while time.time() < deadline and not (out / "requests.jsonl").exists():
            time.sleep(0.1)
        time.sleep(1.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stdout.strip() == str(out)
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    cancelled = [r for r in recs if r["error_kind"] == "cancelled"]
    assert len(cancelled) == 3 and all(len(r["chunk_ns"]) >= 5 for r in cancelled)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["points"][0]["interrupted"] is True


def test_selftest_reports_added_delay_per_level():
    res = _cli("selftest", "--streams", "4,16", "--tokens-per-s", "200", "--output-len", "10",
               "--requests-per-stream", "1", "--no-ceiling", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [lv["streams"] for lv in data["levels"]] == [4, 16]
    for lv in data["levels"]:
        assert lv["completed"] == lv["streams"] and lv["failed"] == 0
        assert 0 <= lv["added_delay_p50_ms"] <= lv["added_delay_p99_ms"] <= lv["added_delay_max_ms"]
        assert lv["chunk_events_per_s"] > 0
