"""Metric formulas on hand-built records (every number below is worked out by hand)."""

from __future__ import annotations

import pytest

from servescope.load import metrics
from servescope.load.records import PointRecord, RequestRecord

MS = 1_000_000


def req(rid, send_ms, chunks_ms, tokens, end_ms=None, phase="measure", ok=True, out=None, point=0, kind=None,
        prompt=10, sched_ms=None, stamps_ms=()):
    return RequestRecord(
        request_id=rid, point=point, phase=phase,
        scheduled_ns=int((sched_ms if sched_ms is not None else send_ms) * MS), send_ns=int(send_ms * MS),
        end_ns=int((end_ms if end_ms is not None else (chunks_ms[-1] if chunks_ms else send_ms)) * MS),
        first_token_ns=int(chunks_ms[0] * MS) if chunks_ms else None,
        chunk_ns=tuple(int(c * MS) for c in chunks_ms), chunk_tokens=tuple(tokens), prompt_tokens=prompt,
        output_tokens=out if out is not None else sum(tokens), output_tokens_source="usage",
        requested_output_tokens=sum(tokens), ok=ok, error_kind=kind, chunk_tokens_source="usage",
        chunk_send_ns=tuple(int(s * MS) for s in stamps_ms),
    )


def test_chunk_aware_itl_splits_a_gap_over_its_tokens():
    r = req(0, 0, [100, 110, 140], [1, 1, 3])
    # gap 10 ms over 1 token, then 30 ms over 3 tokens -> 10, 10, 10, 10
    assert metrics.request_itl_ms(r) == pytest.approx([10, 10, 10, 10])
    assert metrics.request_icl_ms(r) == pytest.approx([10, 30])
    assert metrics.request_ttft_ms(r) == pytest.approx(100)
    # TPOT = (140 - 100) / (5 - 1) = 10
    assert metrics.request_tpot_ms(r) == pytest.approx(10)


def test_first_chunk_extra_tokens_add_no_itl_and_tpot_uses_the_server_count():
    r = req(0, 0, [50, 70], [4, 2])
    assert metrics.request_itl_ms(r) == pytest.approx([10, 10])
    assert metrics.request_tpot_ms(r) == pytest.approx(20 / 5)


def _point(conc=2, client=None):
    return PointRecord(point=0, label=f"c={conc}", concurrency=conc, request_rate=None, start_ns=0,
                       measure_start_ns=0, end_ns=1000 * MS, num_requests=3, num_warmup=1, client=client or {})


def test_point_throughputs_littles_law_failures_and_goodput():
    reqs = [
        req(0, 0, [10, 20], [1, 1], end_ms=20, phase="warmup"),
        req(1, 0, [100, 200, 300], [1, 1, 1], end_ms=400, prompt=10),
        req(2, 100, [150, 250], [2, 2], end_ms=500, prompt=20),
        req(3, 200, [], [], end_ms=300, ok=False, kind="http_status", out=0),
    ]
    s = metrics.summarize_point(_point(), reqs, slo={"ttft_ms": 60})
    assert s["completed"] == 2 and s["failed"] == 1 and s["failures_by_kind"] == {"http_status": 1}
    assert s["num_warmup"] == 1
    # measured span: first scheduled 0 ms -> last end 500 ms
    assert s["duration_s"] == pytest.approx(0.5)
    assert s["total_output_tokens"] == 7 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(2 / 0.5)
    assert s["output_throughput"] == pytest.approx(7 / 0.5)
    assert s["total_token_throughput"] == pytest.approx(37 / 0.5)
    # TTFTs 100 and 50; E2ELs 400 and 400 -> Little's law: 0.8 s / 0.5 s
    assert s["median_ttft_ms"] == pytest.approx(75)
    assert s["concurrency"] == pytest.approx(1.6)
    assert s["max_concurrent_requests"] == 3
    # only request 2 has TTFT <= 60 ms
    assert s["request_goodput"] == pytest.approx(1 / 0.5)
    assert s["goodput_fraction"] == pytest.approx(1 / 3)
    # pooled chunk-aware ITL: r1 [100, 100], r2 [50, 50] -> p50 75
    assert s["median_itl_ms"] == pytest.approx(75)
    assert s["max_output_tokens_per_s"] == 7


def test_every_metric_is_within_its_formula_bounds():
    reqs = [req(i, i * 10, [i * 10 + 30 + k * 5 for k in range(8)], [1] * 8, end_ms=i * 10 + 70) for i in range(20)]
    s = metrics.summarize_point(_point(conc=4), reqs)
    for name in ("ttft", "tpot", "itl", "icl", "e2el"):
        lo, med, hi = s[f"min_{name}_ms"], s[f"median_{name}_ms"], s[f"max_{name}_ms"]
        assert lo <= med <= s[f"p90_{name}_ms"] <= s[f"p99_{name}_ms"] <= hi
    assert s["median_ttft_ms"] <= s["median_e2el_ms"]
    assert s["concurrency"] <= s["max_concurrent_requests"]


def test_steady_window_closed_loop_and_client_limited_flag():
    # 2 slots: warm-ups end at 100, measured requests run back to back until 400.
    reqs = [req(0, 0, [50, 100], [1, 1], phase="warmup"), req(1, 0, [60, 100], [1, 1], phase="warmup"),
            req(2, 100, [150, 200], [1, 1]), req(3, 100, [160, 200], [1, 1]),
            req(4, 200, [250, 300], [1, 1]), req(5, 200, [260, 400], [1, 1])]
    s = metrics.summarize_point(_point(conc=2, client={"loop_lag_p99_ms": 25.0, "cpu_pct": 50.0}), reqs)
    ss = s["steady_state"]
    # in flight >= ceil(0.9*2)=2 from the first measured send (100 ms) to the last fall below 2 (300 ms)
    assert (ss["start_ns"], ss["end_ns"]) == (100 * MS, 300 * MS)
    # chunks in [100, 300] (inclusive): 100,100,150,160,200,200,250,260,300
    assert ss["output_throughput"] == pytest.approx(9 / 0.2)
    assert s["client"]["client_limited"] is True
    assert "event-loop lag" in s["client"]["client_limited_reasons"][0]


def test_added_delay_from_server_stamps():
    r = req(0, 0, [10, 20, 30], [1, 1, 1], stamps_ms=[9.5, 19.0, 29.9])
    s = metrics.summarize_point(_point(conc=1), [r])
    assert s["client"]["max_added_delay_ms"] == pytest.approx(1.0)
    assert s["client"]["median_added_delay_ms"] == pytest.approx(0.5)


def test_queue_and_lateness_split_at_the_slot():
    r = RequestRecord(request_id=0, point=0, phase="measure", scheduled_ns=0, send_ns=7 * MS, end_ns=20 * MS,
                      slot_ns=5 * MS)
    s = metrics.summarize_point(_point(conc=None), [r])
    assert s["mean_client_queue_ms"] == pytest.approx(5) and s["mean_send_lateness_ms"] == pytest.approx(2)


def test_scaling_and_knee_on_the_seed_ladder():
    # The seed: 704 / 1,106 / 1,601 / 1,640 output tok/s at 256 / 512 / 1,024 / 2,048.
    pts = [{"target_concurrency": c, "output_throughput": t, "request_rate": None}
           for c, t in ((256, 704), (512, 1106), (1024, 1601), (2048, 1640))]
    sc = metrics.scaling(pts)
    assert [round(s["efficiency"], 3) for s in sc["steps"]] == [0.571, 0.448, 0.024]
    assert sc["knee_concurrency"] == 1024 and sc["max_throughput"] == 1640


def test_summarize_reads_dicts_and_warns_on_token_fallback():
    r = req(0, 0, [10, 20], [1, 1]).to_dict()
    r["output_tokens_source"] = "chunks"
    out = metrics.summarize([r], [_point(conc=1).to_dict()])
    assert out["points"][0]["output_tokens_sources"] == {"chunks": 1}
    assert any("no server token count" in w for w in out["warnings"])
