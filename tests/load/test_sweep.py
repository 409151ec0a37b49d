"""The sweep end to end against real loopback servers: records, faults, summary, mid-run outage."""

from __future__ import annotations

import json

from servescope.load.metrics import summarize_run
from servescope.load.sweep import SweepConfig, run_sweep
from servescope.run import RunDir

from .conftest import start_server_process


def _run(tmp_path, cfg: SweepConfig, name: str = "run", hook=None):
    run = RunDir.create(tmp_path / name, cfg.to_config())
    return run, run_sweep(run, cfg, hook)


def test_closed_loop_ladder_records_every_request_and_summaries_recompute(tmp_path, fast_server):
    cfg = SweepConfig(url=fast_server, concurrencies=(1, 4), dataset="text:hello", output_len=9, num_prompts=12)
    run, summary = _run(tmp_path, cfg)
    reqs = list(run.iter_jsonl("requests.jsonl"))
    assert len(reqs) == (1 + 12) + (4 + 12)
    assert sum(r["phase"] == "warmup" for r in reqs) == 5
    for p in summary["points"]:
        assert p["completed"] == 12 and p["failed"] == 0
        assert p["total_output_tokens"] == 12 * 9 and p["output_tokens_sources"] == {"usage": 12}
        assert p["client"]["loop_lag_samples"] > 0 and p["client"]["p99_added_delay_ms"] is not None
    assert summary["points"][1]["max_concurrent_requests"] == 4
    again = summarize_run(RunDir.open(run.path))
    assert again["points"] == json.loads((run.path / "summary.json").read_text())["points"]


def test_faults_are_counted_by_kind_and_the_run_goes_on(tmp_path, fast_server):
    lines = ["clean", "clean", "<<fault:status=500>>", "<<fault:status=404>>", "<<fault:stall>>",
             "<<fault:drop>>", "<<fault:bad_json>>", "<<fault:bad_sse>>", "<<fault:bad_chunk>>", "clean"]
    ds = tmp_path / "faults.jsonl"
    ds.write_text("\n".join(json.dumps({"prompt": x}) for x in lines) + "\n")
    cfg = SweepConfig(url=fast_server, concurrencies=(2,), dataset=f"jsonl:{ds}", output_len=6, num_prompts=8,
                      warmup=2, timeout_s=0.7)
    run, summary = _run(tmp_path, cfg)
    p = summary["points"][0]
    assert p["completed"] == 1 and p["failed"] == 7
    assert p["failures_by_kind"] == {"disconnect": 1, "http_status": 2, "malformed": 3, "timeout": 1}
    recs = [r for r in run.iter_jsonl("requests.jsonl") if not r["ok"]]
    assert all(r["error_text"] for r in recs)


def test_server_going_away_between_points_is_recorded_as_unreachable(tmp_path):
    proc, url = start_server_process("--tokens-per-s", "1000", "--ttft-ms", "1")

    def hook(kind, data):
        if kind == "point_end" and data["point"].get("point") == 0:
            proc.terminate()
            proc.wait(10)

    try:
        cfg = SweepConfig(url=url, concurrencies=(1, 2), dataset="text:hi", output_len=3, num_prompts=5)
        _, summary = _run(tmp_path, cfg, hook=hook)
    finally:
        proc.kill()
        proc.wait(10)
    p0, p1 = summary["points"]
    assert p0["completed"] == 5
    assert p1["completed"] == 0 and p1["failures_by_kind"] == {"unreachable": 5}


def test_open_loop_rate_keeps_an_absolute_schedule(tmp_path, fast_server):
    cfg = SweepConfig(url=fast_server, request_rates=(100.0,), dataset="text:hi", output_len=2, num_prompts=100,
                      warmup=5)
    run, summary = _run(tmp_path, cfg)
    p = summary["points"][0]
    assert p["completed"] == 100 and p["request_rate"] == 100.0
    reqs = [r for r in run.iter_jsonl("requests.jsonl") if r["phase"] == "measure"]
    span_s = (max(r["scheduled_ns"] for r in reqs) - min(r["scheduled_ns"] for r in reqs)) / 1e9
    assert 0.5 < span_s < 2.0  # ~99 Poisson gaps at 100/s
    assert p["p99_send_lateness_ms"] < 50


def test_rejected_options_are_dropped_and_noted(tmp_path):
    """A strict server (422 on unknown fields, like transformers serve) gets a request without them."""
    import asyncio
    import threading

    from aiohttp import web

    async def completions(request):
        body = await request.json()
        if "ignore_eos" in body:
            return web.json_response({"detail": "Extra inputs are not permitted: ignore_eos"}, status=422)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            fr = '"length"' if i == body["max_tokens"] - 1 else "null"
            await resp.write(b'data: {"choices":[{"text":"t","finish_reason":%s}]}\n\n' % fr.encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()
    try:
        cfg = SweepConfig(url=f"http://127.0.0.1:{port}", model="m", concurrencies=(2,), dataset="text:x",
                          output_len=3, num_prompts=4)
        _, summary = _run(tmp_path, cfg)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        th.join(5)
    p = summary["points"][0]
    assert p["completed"] == 4 and p["output_tokens_sources"] == {"chunks": 4}
    assert any("rejected ignore_eos" in n for n in summary["notes"])
    assert any("no server token count" in w for w in p["warnings"])
