"""report.model: what the report shows, gathered from real run-directory files, including damaged ones."""

from __future__ import annotations

import json

import numpy as np
import pytest

from servescope import run as rundir
from servescope.load import metrics
from servescope.report.model import ITL_PROBS, gather
from servescope.run import RunDir


def test_points_carry_the_summary_metrics_in_sweep_order(small_run: RunDir):
    model = gather(small_run)
    summary = small_run.read_json(rundir.SUMMARY)
    assert [p.concurrency for p in model.points] == [8, 16, 32, 64]
    for p, s in zip(model.points, summary["points"], strict=True):
        assert p.metrics_source == rundir.SUMMARY
        assert p.metric("output_throughput") == pytest.approx(s["output_throughput"])
        assert p.metric("p99_itl_ms") == pytest.approx(s["p99_itl_ms"])
        assert p.metric("median_ttft_ms") == p.metric("p50_ttft_ms") == pytest.approx(s["median_ttft_ms"])
    # The fixture delivers the seed's ladder exactly (it scales its timeline to do so).
    assert [round(p.metric("output_throughput")) for p in model.points] == [704, 1106, 1601, 1640]


def test_knee_is_the_plateau_the_diagnosis_names(small_run: RunDir):
    model = gather(small_run)
    knee = model.point_by_index(model.knee_point)
    assert knee is not None and knee.concurrency == 32
    assert "diagnosis.json" in model.knee_source


def test_knee_falls_back_to_load_metrics_scaling_without_a_diagnosis(fresh_run: RunDir):
    fresh_run.file(rundir.DIAGNOSIS).unlink()
    model = gather(fresh_run)
    assert model.point_by_index(model.knee_point).concurrency == 32
    assert model.knee_source == f"{rundir.SUMMARY} scaling.knee_concurrency"
    fresh_run.file(rundir.SUMMARY).unlink()
    model = gather(fresh_run)
    assert model.point_by_index(model.knee_point).concurrency == 32
    assert "recomputed" in model.knee_source


def test_itl_distribution_is_chunk_aware_and_matches_load_metrics(small_run: RunDir):
    model = gather(small_run)
    p = model.points[2]
    itls = []
    for row in small_run.iter_jsonl(rundir.REQUESTS):
        if row["point"] == p.point and row["phase"] == "measure" and row["ok"]:
            from servescope.load.records import RequestRecord

            itls.extend(metrics.request_itl_ms(RequestRecord.from_dict(row)))
    assert p.itl_count == len(itls)
    assert len(p.itl_values_ms) == len(ITL_PROBS)
    assert p.itl_values_ms[ITL_PROBS.index(0.5)] == pytest.approx(np.median(itls))
    assert p.itl_values_ms[-1] == pytest.approx(max(itls))
    # 2-token chunks: every gap is split over its 2 tokens, so ITLs come in equal pairs.
    assert p.itl_count % 2 == 0


def test_failures_are_counted_with_their_text(small_run: RunDir):
    last = gather(small_run).points[-1]
    assert last.errors_by_kind == {"http_status": 2}
    assert last.error_examples == ("HTTP 503: server overloaded",)
    assert last.metric("failed") == 2


def test_timelines_per_gpu_on_the_run_clock(small_run: RunDir):
    model = gather(small_run)
    assert [g.gpu for g in model.gpus] == [0, 1]
    g0 = model.gpus[0]
    assert g0.name == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
    assert g0.t_s[0] == pytest.approx(0.0)  # origin = the first point's warm-up start = first sample
    assert g0.has("power_w") and g0.has("gpm_tensor_active_pct")
    assert not g0.has("nvlink_tx_bytes_s")
    assert model.gpus[1].gap_t_s.size == 1  # the recorded NVML error row
    # Sweep points lie inside the sampled span.
    first, last = model.points[0], model.points[-1]
    assert 0 <= model.t_s(first.measure_start_ns) < model.t_s(last.end_ns) <= g0.t_s[-1]


def test_telemetry_summary_rows_by_scope(small_run: RunDir):
    model = gather(small_run)
    scopes = {(r.point, r.scope, r.gpu) for r in model.telemetry_rows}
    assert (2, "gpu", 0) in scopes and (2, "gpu", 1) in scopes
    assert (2, "server", None) in scopes and (2, "point", None) in scopes
    server = next(r for r in model.telemetry_rows if r.point == 3 and r.scope == "server")
    assert server.values["running_requests_max"] == 32
    assert server.values["queued_requests_mean"] == pytest.approx(32)
    power = next(r for r in model.telemetry_rows if r.point == 2 and r.scope == "gpu").values["power_w_mean"]
    assert 150 < power < 300
    assert model.telemetry_status == "on (synthetic fixture)"
    assert any("not supported" in w for w in model.telemetry_warnings)


def test_roofline_points_and_the_peak_recovered_from_gemm_entries(small_run: RunDir):
    rl = gather(small_run).roofline
    assert rl is not None and rl.dtype == "nvfp4" and rl.parallelism == "TP 8"
    assert [p.concurrency for p in rl.points] == [8, 16, 32, 64]
    data = small_run.read_json(rundir.ROOFLINE)
    expert = next(g for g in data["points"][0]["gemms"] if g["name"].startswith("experts"))
    assert rl.peak_tflops == pytest.approx(expert["attainable_tflops"] / (expert["pct_of_peak"] / 100))
    assert rl.peak_tflops * 1e12 / rl.bandwidth_bytes_s == pytest.approx(expert["ridge"])
    p = rl.points[0]
    assert p.tok_s_upper_bound == pytest.approx(data["points"][0]["tok_s_upper_bound"])
    assert p.intensity == pytest.approx(data["points"][0]["flops_per_step"] / data["points"][0]["bytes_per_step"])


def test_findings_are_sorted_by_severity_with_marks(small_run: RunDir):
    model = gather(small_run)
    assert [f.severity for f in model.findings] == sorted(
        (f.severity for f in model.findings), key=["critical", "warning", "info"].index
    )
    tail = next(f for f in model.findings if f.id == "tail_latency")
    assert tail.marks and all(isinstance(m.t_ns, int) for m in tail.marks)
    assert model.headline.startswith("Throughput plateaus at c=32")


# ------------------------------------------------------------------ crashed and partial runs


def test_a_point_without_its_points_record_is_rebuilt_from_requests(fresh_run: RunDir):
    """A crash during the last point: no points.jsonl line for it, no summary.json yet."""
    lines = fresh_run.file(rundir.POINTS).read_text().splitlines(keepends=True)
    fresh_run.file(rundir.POINTS).write_text("".join(lines[:-1]))
    fresh_run.file(rundir.SUMMARY).unlink()
    model = gather(fresh_run)
    last = model.points[-1]
    assert not last.recorded and last.interrupted
    assert last.concurrency == 64  # from config.json's sweep list
    assert last.metrics_source.startswith(rundir.REQUESTS)
    assert last.metric("completed") == 62 and last.metric("output_throughput") > 0
    assert any("no points.jsonl record" in w for w in last.warnings)


def test_truncated_and_damaged_files_become_notes_not_errors(fresh_run: RunDir):
    with fresh_run.file(rundir.REQUESTS).open("a") as fh:
        fh.write('{"request_id": 99999, "point": 3, "pha')  # the line being written at the crash
    fresh_run.file(rundir.DIAGNOSIS).write_text("{not json")
    with fresh_run.file(rundir.GPU_SAMPLES).open("a") as fh:
        fh.write("123,0,45")  # truncated CSV row
    model = gather(fresh_run)
    assert len(model.points) == 4
    assert model.findings == [] and model.headline is None
    assert any("diagnosis.json could not be read" in n for n in model.notes)
    assert len(model.gpus) == 2


def test_a_run_with_only_its_config_gathers_to_empty_sections(tmp_path):
    run = RunDir.create(tmp_path / "bare", {"target": {"url": "http://127.0.0.1:1"}})
    model = gather(run)
    assert model.points == [] and model.gpus == [] and model.roofline is None and model.findings == []
    assert model.knee_point is None
    assert model.files[rundir.REQUESTS] is False


def test_a_malformed_middle_line_keeps_the_lines_before_it(fresh_run: RunDir):
    path = fresh_run.file(rundir.REQUESTS)
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(len(lines) // 2, "garbage\n")
    path.write_text("".join(lines))
    fresh_run.file(rundir.SUMMARY).unlink()
    model = gather(fresh_run)
    assert any("reading stopped early" in n for n in model.notes)
    assert model.points  # what was read before the damage still reports


def test_summary_fields_nested_under_whole_run_are_read(fresh_run: RunDir):
    summary = fresh_run.read_json(rundir.SUMMARY)
    for p in summary["points"]:
        p["whole_run"] = {"output_throughput": 1234.5}
        del p["output_throughput"]
    fresh_run.write_json(rundir.SUMMARY, summary)
    assert gather(fresh_run).points[0].metric("output_throughput") == 1234.5


def test_telemetry_summary_with_gpus_as_a_list_is_read(fresh_run: RunDir):
    data = fresh_run.read_json(rundir.TELEMETRY_SUMMARY)
    for p in data["points"]:
        p["gpus"] = [dict(v, gpu=int(k)) for k, v in p["gpus"].items()]
    fresh_run.write_json(rundir.TELEMETRY_SUMMARY, data)
    rows = [r for r in gather(fresh_run).telemetry_rows if r.scope == "gpu"]
    assert {r.gpu for r in rows} == {0, 1}


def test_env_gpu_names_are_taken_verbatim(small_run: RunDir):
    env = json.loads(small_run.file(rundir.ENV).read_text())
    assert gather(small_run).gpus[0].name == env["gpus"][0]["name"]
