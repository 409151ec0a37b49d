"""Several client processes (``workers``) against the real stamped selftest server on loopback.

What must hold whatever the number of processes: every request recorded once (ids unique and
contiguous per sweep), warm-up = the first requests of each point, in flight never above the
target, the open-loop union of slices = the one absolute schedule, and records shaped as with
one process (summaries recomputed from requests.jsonl).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields

import pytest

from servescope.errors import ConfigError
from servescope.load.metrics import summarize_run
from servescope.load.records import RequestRecord
from servescope.load.schedule import arrival_offsets_ns
from servescope.load.selftest_server import SelftestServerConfig, serve_in_thread
from servescope.load.sweep import SweepConfig, run_sweep
from servescope.load.workers import STREAMS_PER_WORKER, closed_slices, open_slices, parse_workers, resolve_workers
from servescope.run import RunDir


def _run(tmp_path, cfg: SweepConfig, name: str = "run"):
    run = RunDir.create(tmp_path / name, cfg.to_config())
    return run, run_sweep(run, cfg)


def _max_in_flight(recs: list[dict]) -> int:
    """Most requests open at once, from their send and end stamps (an end before a send at the same ns)."""
    events = sorted([(r["send_ns"], 1) for r in recs] + [(r["end_ns"], -1) for r in recs])
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def test_closed_loop_on_two_processes_records_every_request_once(tmp_path, fast_server):
    cfg = SweepConfig(url=fast_server, concurrencies=(2, 5), dataset="text:hello", output_len=9, num_prompts=15,
                      workers=2)
    run, summary = _run(tmp_path, cfg)
    reqs = list(run.iter_jsonl("requests.jsonl"))
    assert sorted(r["request_id"] for r in reqs) == list(range((2 + 15) + (5 + 15)))
    assert all(set(r) == {f.name for f in fields(RequestRecord)} for r in reqs)  # the 1-process schema
    first_id = 0
    for p, c in zip(summary["points"], (2, 5), strict=True):
        mine = [r for r in reqs if r["point"] == p["point"]]
        # Warm-up is the point's first c ids, whichever process sent them.
        assert {r["request_id"] for r in mine if r["phase"] == "warmup"} == set(range(first_id, first_id + c))
        first_id += c + 15
        assert p["completed"] == 15 and p["failed"] == 0 and p["total_output_tokens"] == 15 * 9
        assert _max_in_flight(mine) <= c and p["max_concurrent_requests"] <= c
        client = p["client"]
        assert client["processes"] == 2 and client["workers_lost"] == 0
        assert [w["requests"] > 0 for w in client["workers"]] == [True, True]
        assert sum(w["requests"] for w in client["workers"]) == c + 15
        assert client["loop_lag_samples"] > 0 and client["p99_added_delay_ms"] is not None
        assert all(r["chunk_ns"] == sorted(r["chunk_ns"]) and len(r["chunk_send_ns"]) == len(r["chunk_ns"])
                   for r in mine)
    again = summarize_run(RunDir.open(run.path))
    assert again["points"] == json.loads((run.path / "summary.json").read_text())["points"]


def test_large_record_batches_cross_the_pipe_intact(tmp_path, fast_server):
    """Batches of long records over 16 KiB go as two writes (header, payload); one CPU for all makes the reader
    wake between them, which once failed ``recv`` with EAGAIN (uvloop had made the socket non-blocking)."""
    cfg = SweepConfig(url=fast_server, concurrencies=(64,), dataset="text:x", output_len=128, num_prompts=128,
                      warmup=0, workers=2)
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})  # the workers inherit it
    try:
        run, summary = _run(tmp_path, cfg)
    finally:
        os.sched_setaffinity(0, cpus)
    reqs = list(run.iter_jsonl("requests.jsonl"))
    assert sorted(r["request_id"] for r in reqs) == list(range(128))
    assert all(r["ok"] and r["output_tokens"] == 128 and len(r["chunk_ns"]) == 64 for r in reqs)
    assert summary["points"][0]["client"]["workers_lost"] == 0


def test_open_loop_slices_add_up_to_exactly_the_schedule(tmp_path, fast_server):
    cfg = SweepConfig(url=fast_server, request_rates=(150.0,), dataset="text:hi", output_len=2, num_prompts=60,
                      warmup=5, seed=3, workers=3)
    run, summary = _run(tmp_path, cfg)
    p = summary["points"][0]
    assert p["completed"] == 60 and p["client"]["processes"] == 3
    reqs = sorted(run.iter_jsonl("requests.jsonl"), key=lambda r: r["request_id"])
    assert [r["request_id"] for r in reqs] == list(range(65))
    offsets = arrival_offsets_ns(65, 150.0, 1.0, 3 * 7919 + 0)
    t0 = reqs[0]["scheduled_ns"]  # offset 0 is request 0
    assert [r["scheduled_ns"] - t0 for r in reqs] == offsets  # to the nanosecond: one t0, one schedule
    assert [r["phase"] for r in reqs] == ["warmup"] * 5 + ["measure"] * 60
    assert p["p99_send_lateness_ms"] < 50


def test_open_loop_cap_is_never_exceeded_across_processes(tmp_path, fast_server):
    cfg = SweepConfig(url=fast_server, request_rates=(float("inf"),), max_concurrency=4, dataset="text:hi",
                      output_len=6, num_prompts=24, warmup=0, workers=2)
    run, summary = _run(tmp_path, cfg)
    reqs = list(run.iter_jsonl("requests.jsonl"))
    assert len(reqs) == 24 and all(r["ok"] for r in reqs)
    assert _max_in_flight(reqs) <= 4 and summary["points"][0]["max_concurrent_requests"] <= 4
    assert all(r["slot_ns"] is not None and r["slot_ns"] >= r["scheduled_ns"] for r in reqs)


def test_duration_bound_is_shared_by_the_processes(tmp_path, fast_server):
    cfg = SweepConfig(url=fast_server, concurrencies=(4,), dataset="text:hi", output_len=4, duration_s=1.0,
                      workers=2)
    run, summary = _run(tmp_path, cfg)
    reqs = list(run.iter_jsonl("requests.jsonl"))
    assert sorted(r["request_id"] for r in reqs) == list(range(len(reqs)))
    measured = [r for r in reqs if r["phase"] == "measure"]
    assert len(measured) > 10 and summary["points"][0]["completed"] == len(measured)
    start = min(r["send_ns"] for r in measured)
    assert next(iter(run.iter_jsonl("points.jsonl")))["measure_start_ns"] == start
    # No process sends a measured request after the one deadline (first measured send + 1 s).
    assert max(r["send_ns"] for r in measured) - start <= 1.0e9 + 50e6


def test_worker_counts_and_slices():
    assert parse_workers("auto") == "auto" and parse_workers("3") == 3 and parse_workers(2) == 2
    for bad in ("0", "x", -1, 1000):
        with pytest.raises(ConfigError):
            parse_workers(bad)
    with pytest.raises(ConfigError):
        SweepConfig(url="http://127.0.0.1:1", workers=0).validate()
    assert resolve_workers(4, 2) == 2  # never more processes than streams
    assert resolve_workers(3, None) == 3  # open loop without a cap
    assert resolve_workers("auto", STREAMS_PER_WORKER) == 1
    assert resolve_workers("auto", 4 * STREAMS_PER_WORKER, cpu_count=8) == 4
    assert resolve_workers("auto", 4 * STREAMS_PER_WORKER, cpu_count=2) == 2
    assert resolve_workers("auto", None) == 1
    assert [s.slots for s in closed_slices(0, 0, 7, 3)] == [3, 2, 2]
    sl = open_slices(0, 0, [0, 5, 9, 12, 20], cap=5, n=2)
    assert [s.offsets for s in sl] == [((0, 0), (2, 9), (4, 20)), ((1, 5), (3, 12))]
    assert [s.cap for s in sl] == [3, 2]


def test_terminal_ctrl_c_stops_workers_records_in_flight_and_exits_130(tmp_path):
    """SIGINT to the whole process group, as a terminal sends it: workers must not die mid-way."""
    with serve_in_thread(SelftestServerConfig(tokens_per_s=10.0, ttft_ms=1.0)) as slow:
        out = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "servescope", "bench", "--url", slow, "--concurrency", "4",
                                 "--dataset", "text:x", "--output-len", "200", "--num-prompts", "4", "--workers", "2",
                                 "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.time() + 60
            while time.time() < deadline and not (out / "requests.jsonl").exists():
                time.sleep(0.1)
            time.sleep(2.0)
            os.killpg(proc.pid, signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert proc.returncode == 130, stderr
    assert stdout.strip() == str(out)
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert sorted(r["request_id"] for r in recs) == [0, 1, 2, 3]  # the 4 warm-ups in flight, once each
    assert all(r["error_kind"] == "cancelled" and len(r["chunk_ns"]) >= 5 for r in recs)
    points = [json.loads(line) for line in (out / "points.jsonl").read_text().splitlines()]
    assert points[0]["interrupted"] is True
    workers = points[0]["client"]["workers"]
    assert len(workers) == 2 and all(not w.get("lost") for w in workers)
    for w in workers:  # the workers exited with the run
        with pytest.raises(ProcessLookupError):
            os.kill(w["pid"], 0)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True
