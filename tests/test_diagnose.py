"""diagnose.py on run directories whose records come from a small discrete-event server model.

The model is a continuous-batching server that admits at most ``cap`` requests at once
(the rest wait in its queue), spends ``prefill_ms`` before the first token and then
emits one token per ``step_ms``. With a known cap the rules must find the ceiling at the
right concurrency; with no cap they must not invent one. The end-to-end test against a
real engine lives in tests/test_job_e2e.py.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path

from servescope.diagnose import diagnose, find_knee, load_inputs
from servescope.load.records import PointRecord, RequestRecord
from servescope.run import DIAGNOSIS, POINTS, REQUESTS, TELEMETRY_SUMMARY, RunDir


def simulate_point(
    point: int,
    concurrency: int,
    n_requests: int,
    cap: int,
    t0_ns: int,
    output_tokens: int = 16,
    prefill_ms: float = 20.0,
    step_ms: float = 10.0,
    stall_every: int = 0,
    stall_ms: float = 0.0,
) -> tuple[list[RequestRecord], PointRecord]:
    """Closed loop at ``concurrency`` against a server running at most ``cap`` requests."""
    ms = 1_000_000
    prefill, step = int(prefill_ms * ms), int(step_ms * ms)
    records: list[RequestRecord] = []
    free_slots: list[int] = [t0_ns] * cap  # heap of times a server slot frees up
    heapq.heapify(free_slots)
    client_ready = [t0_ns] * concurrency  # when each client stream can send its next request
    heapq.heapify(client_ready)
    for rid in range(n_requests):
        send = heapq.heappop(client_ready)
        slot = heapq.heappop(free_slots)
        start = max(send, slot)
        first = start + prefill
        chunks = [first + i * step for i in range(output_tokens)]
        if stall_every and rid % stall_every == 0:
            chunks = chunks[: output_tokens // 2] + [c + int(stall_ms * ms) for c in chunks[output_tokens // 2 :]]
        end = chunks[-1] + ms // 10
        heapq.heappush(free_slots, end)
        heapq.heappush(client_ready, end)
        records.append(
            RequestRecord(
                request_id=point * 100_000 + rid, point=point, phase="measure", scheduled_ns=send, send_ns=send,
                end_ns=end, first_token_ns=first, chunk_ns=tuple(chunks), chunk_tokens=(1,) * output_tokens,
                prompt_tokens=32, output_tokens=output_tokens, output_tokens_source="usage",
                requested_output_tokens=output_tokens, finish_reason="length",
            )
        )
    end_all = max(r.end_ns for r in records)
    pt = PointRecord(point=point, label=f"c={concurrency}", concurrency=concurrency, request_rate=None,
                     start_ns=t0_ns, measure_start_ns=t0_ns, end_ns=end_all, num_requests=n_requests, num_warmup=0)
    return records, pt


def make_run(tmp_path: Path, cap: int, ladder=(1, 2, 4, 8, 16), **kw) -> RunDir:
    run = RunDir.create(tmp_path / f"run-cap{cap}", {"command": "test", "engine": {"kind": "transformers"}}, {})
    t = 1_000_000_000
    with run.jsonl_writer(REQUESTS) as reqs, run.jsonl_writer(POINTS) as pts:
        for i, c in enumerate(ladder):
            recs, pt = simulate_point(i, c, n_requests=max(6 * c, 24), cap=cap, t0_ns=t, **kw)
            for r in recs:
                reqs.write(r)
            pts.write(pt)
            t = pt.end_ns + 1_000_000_000
    from servescope.load.metrics import summarize_run

    summarize_run(run)
    return run


def test_capped_server_is_diagnosed_at_the_cap(tmp_path):
    run = make_run(tmp_path, cap=4)
    d = diagnose(run)
    ids = [f.id for f in d.findings]
    assert "scheduler_ceiling" in ids, d.to_dict()
    ceiling = next(f for f in d.findings if f.id == "scheduler_ceiling")
    assert "~4 running" in ceiling.title
    # The first point beyond the cap is c=8 (index 3 of 1,2,4,8,16).
    assert ceiling.points == (3,)
    assert ceiling.confidence == "high"  # TTFT grows, TPOT flat
    assert any("cb-num-blocks" in r for r in ceiling.recommendations)
    knee, gains = find_knee(load_inputs(run).points)
    assert knee is not None and knee.concurrency == 4
    assert len(gains) == 4


def test_uncapped_server_has_no_ceiling_and_no_knee(tmp_path):
    run = make_run(tmp_path, cap=64)
    d = diagnose(run)
    assert "scheduler_ceiling" not in [f.id for f in d.findings]
    plateau = next(f for f in d.findings if f.id == "plateau")
    assert plateau.severity == "info"  # still rising: sweep higher


def test_stalls_give_a_tail_latency_finding_with_marks(tmp_path):
    run = make_run(tmp_path, cap=64, stall_every=3, stall_ms=400.0)
    d = diagnose(run)
    tail = next(f for f in d.findings if f.id == "tail_latency")
    assert tail.marks, "stalls must be placed on the timeline"
    ratio = next(e.value for e in tail.evidence if e.label == "P99 / median")
    assert ratio >= 4


def test_gpu_counters_give_kernel_efficiency_floor(tmp_path):
    run = make_run(tmp_path, cap=4)
    # Seed-like counters at the knee (point 2, c=4): busy, full clocks, 39% of the power limit, 6% tensor.
    run.write_json(TELEMETRY_SUMMARY, {"points": [{"point": 2, "gpus": {
        str(i): {"gpu_util_pct_mean": 100.0, "power_w_mean": 235.0, "power_limit_w": 600.0,
                 "power_limit_pct": 235.0 / 6, "sm_clock_pct_of_max": 98.0,
                 "gpm_tensor_active_pct_mean": 5.9, "gpm_dram_bw_pct_mean": 30.0} for i in range(8)}}]})
    d = diagnose(run)
    floor = next(f for f in d.findings if f.id == "kernel_efficiency_floor")
    assert floor.severity == "critical" and floor.confidence == "high"
    assert "39%" in floor.verdict
    assert "gpu_imbalance" not in [f.id for f in d.findings]


def test_one_busy_gpu_is_flagged_as_straggler(tmp_path):
    run = make_run(tmp_path, cap=4)
    gpus = {str(i): {"gpu_util_pct_mean": 100.0, "power_w_mean": 240.0, "gpm_tensor_active_pct_mean": 6.0}
            for i in range(8)}
    gpus["5"] = {"gpu_util_pct_mean": 100.0, "power_w_mean": 330.0, "gpm_tensor_active_pct_mean": 14.0}
    run.write_json(TELEMETRY_SUMMARY, {"points": [{"point": 2, "gpus": gpus}]})
    imb = next(f for f in diagnose(run).findings if f.id == "gpu_imbalance")
    assert imb.title.startswith("GPU 5 ")


def test_idle_gpu_under_plateau_is_host_bound(tmp_path):
    run = make_run(tmp_path, cap=4)
    run.write_json(TELEMETRY_SUMMARY, {"points": [{"point": 2, "gpus": {"0": {
        "gpu_util_pct_mean": 8.0, "power_w_mean": 130.0, "power_limit_w": 700.0, "power_limit_pct": 18.6}}}]})
    ids = [f.id for f in diagnose(run).findings]
    assert "host_bound" in ids and "kernel_efficiency_floor" not in ids


def test_truncated_run_still_diagnoses(tmp_path):
    run = make_run(tmp_path, cap=4)
    (run.path / "summary.json").unlink()
    with run.file(REQUESTS).open("a") as fh:
        fh.write('{"request_id": 1, "point": 0, "pha')  # a crash mid-line
    d = diagnose(run)
    assert any("recomputed" in n for n in d.notes)
    assert "scheduler_ceiling" in [f.id for f in d.findings]


def test_cli_diagnose_writes_json(tmp_path):
    import subprocess
    import sys

    run = make_run(tmp_path, cap=4)
    res = subprocess.run([sys.executable, "-m", "servescope", "diagnose", str(run.path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert any(f["id"] == "scheduler_ceiling" for f in out["findings"])
    assert (run.path / DIAGNOSIS).exists()
    bad = subprocess.run([sys.executable, "-m", "servescope", "diagnose", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
