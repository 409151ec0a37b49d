"""timeline.summarize on run directories with known contents (hand-made samples, so results are exact)."""

from __future__ import annotations

import json

import pytest

from servescope.errors import RunDataError
from servescope.load.records import PointRecord, RequestRecord
from servescope.run import GPU_SAMPLES, POINTS, REQUESTS, SERVER_SAMPLES, TELEMETRY_NOTES, TELEMETRY_SUMMARY, RunDir
from servescope.telemetry.prometheus import NormalisedSample, ServerSampleWriter
from servescope.telemetry.sampler import GPU_COLUMNS, GpuSampleWriter
from servescope.telemetry.timeline import load_gpu_samples, load_server_samples, summarize

S = 1_000_000_000  # ns per s
T0 = 1_000 * S


def _gpu_rows(gpu: int, t_from_s: float, t_to_s: float, power_w: float, step_s: float = 0.1, energy_j0: float = 0.0,
              with_energy: bool = True, **extra):
    rows = []
    n = round((t_to_s - t_from_s) / step_s)
    for i in range(n + 1):
        t_s = t_from_s + i * step_s
        row = {"t_ns": T0 + round(t_s * S), "gpu": gpu, "power_w": power_w, "power_limit_w": 700.0,
               "sm_clock_mhz": 1500.0, "sm_clock_max_mhz": 1980.0, "gpu_util_pct": 100.0,
               "gpm_tensor_active_pct": 50.0, "gpm_dram_bw_pct": 20.0, "clock_event_reasons": "sw_power_cap"}
        if with_energy:
            row["energy_j"] = energy_j0 + power_w * (t_s - t_from_s)
        row.update(extra)
        rows.append(row)
    return rows


def _run(tmp_path, rows, points=(), requests=(), notes=None, server=()):
    run = RunDir.create(tmp_path / "run", config={"test": True})
    w = GpuSampleWriter(run.file(GPU_SAMPLES))
    w.write(rows)
    w.close()
    if points:
        with run.jsonl_writer(POINTS) as pw:
            for p in points:
                pw.write(p)
    if requests:
        with run.jsonl_writer(REQUESTS) as rw:
            for r in requests:
                rw.write(r)
    if server:
        sw = ServerSampleWriter(run.file(SERVER_SAMPLES))
        for t, source, samples in server:
            sw.write(t, source, samples)
        sw.close()
    run.write_json(TELEMETRY_NOTES, notes or {"gpus": [{"index": 0, "power_limit_w": 700.0}], "gaps": []})
    return run


def _point(i, start_s, end_s, label=None):
    return PointRecord(point=i, label=label or f"c={i}", concurrency=i, request_rate=None, start_ns=T0,
                       measure_start_ns=T0 + int(start_s * S), end_ns=T0 + int(end_s * S), num_requests=2, num_warmup=0)


def _req(i, point, tokens, phase="measure", ok=True):
    return RequestRecord(request_id=i, point=point, phase=phase, scheduled_ns=T0, send_ns=T0, end_ns=T0 + S,
                         output_tokens=tokens, output_tokens_source="usage", ok=ok)


def test_power_energy_and_joules_per_token_per_point(tmp_path):
    # GPU 0 draws 300 W for 0-10 s then 600 W for 10-20 s; energy counter follows exactly.
    rows = _gpu_rows(0, 0, 10, 300.0) + _gpu_rows(0, 10.1, 20, 600.0, energy_j0=3030.0)
    points = [_point(0, 2, 8), _point(1, 12, 18)]
    reqs = [_req(1, 0, 100), _req(2, 0, 200), _req(3, 1, 1000), _req(4, 1, 999, phase="warmup"),
            _req(5, 1, 77, ok=False)]
    summary = summarize(_run(tmp_path, rows, points, reqs))
    p0, p1 = summary["points"]
    g0 = p0["gpus"]["0"]
    assert g0["power_w_mean"] == pytest.approx(300.0)
    assert g0["power_w_p5"] == g0["power_w_p95"] == pytest.approx(300.0)
    assert g0["power_limit_pct"] == pytest.approx(300 / 700 * 100)
    assert g0["energy_source"] == "counter"
    assert g0["energy_j"] == pytest.approx(300.0 * 6, rel=1e-6)  # 6 s at 300 W
    assert p0["output_tokens"] == 300 and p0["measured_requests"] == 2
    assert p0["j_per_output_token"] == pytest.approx(1800.0 / 300)
    assert p1["gpus"]["0"]["power_w_mean"] == pytest.approx(600.0)
    assert p1["output_tokens"] == 1000  # warm-up and failed requests excluded
    assert p1["j_per_output_token"] == pytest.approx(600.0 * 6 / 1000, rel=1e-6)
    assert g0["sm_clock_pct_of_max"] == pytest.approx(1500 / 1980 * 100)
    assert g0["gpm_tensor_active_pct_mean"] == pytest.approx(50.0)
    assert g0["clock_event_reasons_fraction"] == {"sw_power_cap": 1.0}
    assert g0["samples"] == 60  # rows with 2 s < t <= 8 s at 10 Hz
    assert p0["warnings"] == []
    # written to disk, and a pure function of the directory: the same result again
    on_disk = json.loads((tmp_path / "run" / TELEMETRY_SUMMARY).read_text())
    assert on_disk["points"][0]["gpus"]["0"]["energy_j"] == pytest.approx(g0["energy_j"])
    again = summarize(RunDir.open(tmp_path / "run"))
    assert again["points"] == summary["points"]


def test_percentiles_follow_the_samples(tmp_path):
    rows = []
    for i, p in enumerate(range(100, 300)):  # powers 100..299 W, one per 10 ms
        rows.append({"t_ns": T0 + i * 10_000_000, "gpu": 0, "power_w": float(p), "energy_j": float(i)})
    summary = summarize(_run(tmp_path, rows, [_point(0, -1, 3)]))
    g = summary["points"][0]["gpus"]["0"]
    assert g["power_w_p5"] == pytest.approx(109.95)
    assert g["power_w_p95"] == pytest.approx(289.05)
    assert g["power_w_mean"] == pytest.approx(199.5)


def test_without_energy_counter_power_is_integrated_and_flagged(tmp_path):
    rows = _gpu_rows(0, 0, 10, 250.0, with_energy=False)
    p = summarize(_run(tmp_path, rows, [_point(0, 0, 10)]))["points"][0]
    g = p["gpus"]["0"]
    assert g["energy_source"] == "integrated_power"
    assert g["energy_j"] == pytest.approx(250.0 * 10, rel=1e-6)  # trapezoid over the samples spanning 0-10 s
    assert any("integrated sampled power" in w for w in p["warnings"])


def test_gap_rows_and_short_points_are_flagged(tmp_path):
    rows = [*_gpu_rows(0, 0, 1, 300.0), {"t_ns": T0 + int(1.05 * S), "gpu": 0, "error": "GPU 0: GPU is lost"}]
    p = summarize(_run(tmp_path, rows, [_point(0, 0.5, 1.1)]))["points"][0]
    assert p["gpus"]["0"]["gap_rows"] == 1
    assert any("gaps" in w for w in p["warnings"])
    assert any("lasted 0.60 s" in w for w in p["warnings"])


def test_multi_gpu_energy_is_summed(tmp_path):
    rows = _gpu_rows(0, 0, 10, 300.0) + _gpu_rows(1, 0, 10, 100.0)
    p = summarize(_run(tmp_path, rows, [_point(0, 1, 9)], [_req(1, 0, 800)]))["points"][0]
    assert set(p["gpus"]) == {"0", "1"}
    assert p["energy_j_total"] == pytest.approx(400.0 * 8, rel=1e-6)
    assert p["j_per_output_token"] == pytest.approx(3200.0 / 800, rel=1e-6)


def test_server_metrics_collapse_tp_replicas_sum_dp_ranks_and_report_the_ceiling(tmp_path):
    # Hand-made scrapes: 2 DP ranks x 2 TP ranks; TP replicas repeat the same count.
    def scrape(t_s, running, queued, kv, gen_tokens):
        samples = []
        for dp in ("0", "1"):
            for tp in ("0", "1"):
                labels = {"dp_rank": dp, "tp_rank": tp, "__name__": "sglang:num_running_reqs"}
                samples.append(NormalisedSample("running_requests", dict(labels), running))
                samples.append(NormalisedSample("queued_requests", dict(labels), queued))
                samples.append(NormalisedSample("kv_cache_usage", dict(labels), kv))
            samples.append(NormalisedSample("generation_tokens_total", {"dp_rank": dp}, gen_tokens))
        return (T0 + int(t_s * S), "server", samples)

    server = [scrape(t, 512, 100 + t, 0.9, 1000.0 * t) for t in range(0, 11)]
    rows = _gpu_rows(0, 0, 10, 300.0)
    notes = {"gpus": [], "gaps": [], "server_ceiling": {"max_running_requests": 1024, "source": "test"}}
    p = summarize(_run(tmp_path, rows, [_point(0, 2, 8)], notes=notes, server=server))["points"][0]
    s = p["server"]
    assert s["running_requests_mean"] == 1024.0  # 512 per DP rank, TP replicas not double counted
    assert s["queued_requests_max"] == 2 * (100 + 8)
    assert s["kv_cache_usage_pct_mean"] == pytest.approx(90.0)
    assert s["generation_tokens"] == pytest.approx(2 * 6000.0)
    assert s["max_running_requests"] == 1024 and s["running_at_ceiling_fraction"] == 1.0


def test_dcgm_gpus_get_their_own_per_point_stats(tmp_path):
    def scrape(t_s):
        samples = []
        for gpu, power in (("0", 690.0), ("1", 560.0)):
            labels = {"gpu": gpu, "Hostname": "node-b", "instance": "node-b:9400"}
            samples.append(NormalisedSample("power_w", dict(labels), power))
            samples.append(NormalisedSample("gpm_tensor_active_pct", dict(labels), 85.0 if gpu == "0" else 1.0))
            samples.append(NormalisedSample("energy_j", dict(labels), power * t_s))
        return (T0 + int(t_s * S), "dcgm", samples)

    rows = _gpu_rows(0, 0, 10, 300.0)
    p = summarize(_run(tmp_path, rows, [_point(0, 2, 8)], server=[scrape(t) for t in range(11)]))["points"][0]
    d = p["dcgm_gpus"]
    assert set(d) == {"node-b/gpu0", "node-b/gpu1"}
    assert d["node-b/gpu0"]["power_w_mean"] == 690.0
    assert d["node-b/gpu1"]["gpm_tensor_active_pct_mean"] == 1.0
    assert d["node-b/gpu0"]["energy_j"] == pytest.approx(690.0 * 6)


def test_without_points_the_whole_run_is_summarised(tmp_path):
    summary = summarize(_run(tmp_path, _gpu_rows(0, 0, 5, 200.0)))
    assert summary["points"] == []
    assert summary["run"]["gpus"]["0"]["power_w_mean"] == pytest.approx(200.0)
    assert summary["run"]["gpus"]["0"]["energy_j"] == pytest.approx(1000.0, rel=1e-6)


def test_load_gpu_samples_returns_typed_columns_and_tolerates_a_truncated_last_line(tmp_path):
    run = _run(tmp_path, _gpu_rows(0, 0, 0.2, 123.5))
    with run.file(GPU_SAMPLES).open("a") as fh:
        fh.write(f"{T0 + 5 * S},0,99")  # a crash mid-row: no newline
    cols = load_gpu_samples(run)
    assert list(cols) == list(GPU_COLUMNS)
    assert cols["gpu"] == [0, 0, 0]
    assert cols["power_w"] == [123.5, 123.5, 123.5]
    assert cols["clock_event_reasons"][0] == "sw_power_cap"
    assert cols["nvlink_tx_bytes_s"] == [None, None, None]
    assert isinstance(cols["t_ns"][0], int)


def test_a_malformed_row_in_the_middle_raises(tmp_path):
    run = _run(tmp_path, _gpu_rows(0, 0, 0.2, 100.0))
    text = run.file(GPU_SAMPLES).read_text().splitlines()
    text.insert(2, "garbage,row")
    run.file(GPU_SAMPLES).write_text("\n".join(text) + "\n")
    with pytest.raises(RunDataError):
        load_gpu_samples(run)


def test_load_server_samples_parses_labels(tmp_path):
    run = _run(tmp_path, _gpu_rows(0, 0, 1, 1.0),
               server=[(T0, "server", [NormalisedSample("running_requests", {"__name__": "x", "a": "b"}, 3.0)])])
    assert load_server_samples(run) == [{"t_ns": T0, "source": "server", "metric": "running_requests",
                                         "labels": {"__name__": "x", "a": "b"}, "value": 3.0}]
