"""report.compare: two real run directories side by side per sweep point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servescope.report.compare import compare_runs
from servescope.run import RunDir

from .conftest import SMALL
from .runfactory import RunSpec, build_run


@pytest.fixture(scope="module")
def before_after(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, RunDir]:
    """The seed's before/after: 1,640 -> 2,095 output tok/s at the top point (B also adds a point)."""
    base = tmp_path_factory.mktemp("compare")
    a = build_run(base / "a", RunSpec(**SMALL))
    after = {**SMALL, "concurrencies": (8, 16, 32, 64, 128), "tok_s": (720.0, 1180.0, 1790.0, 2095.0, 2110.0),
             "running_cap": 128, "seed": 2}
    b = build_run(base / "b", RunSpec(**after))
    return a, b


def test_points_are_matched_by_concurrency_with_ratios(before_after: tuple[RunDir, RunDir]):
    result = compare_runs(*before_after)
    assert [p.key for p in result.points] == ["c=8", "c=16", "c=32", "c=64"]
    assert result.only_a == () and result.only_b == ("c=128",)
    top = result.points[-1].delta("output_throughput")
    assert top.before == pytest.approx(1640.0) and top.after == pytest.approx(2095.0)
    assert top.ratio == pytest.approx(2095 / 1640)
    assert round(top.change_pct) == 28
    assert top.improved is True


def test_latency_direction_and_telemetry_deltas(before_after: tuple[RunDir, RunDir]):
    p = compare_runs(*before_after).points[-1]
    ttft = p.delta("median_ttft_ms")
    assert ttft.higher_is_better is False
    # A ran c=64 above its 32-request cap (queueing), B below its 128 cap: TTFT drops.
    assert ttft.after < ttft.before and ttft.improved is True
    failed = p.delta("failed")
    assert (failed.before, failed.after, failed.improved) == (2, 0, True)  # A failed 2 at its last point
    power = p.delta("power_w_mean")
    assert power is not None and power.before and power.after and power.higher_is_better is None
    assert p.delta("j_per_output_token") is not None


def test_markdown_and_json_outputs(before_after: tuple[RunDir, RunDir]):
    result = compare_runs(*before_after)
    md = result.to_markdown()
    assert "output tok/s at c=64: 1,640 → 2,095, x1.28 (+28%)" in md
    assert "| c=64 | 1,640 | 2,095 | x1.28 (+28%) |" in md
    assert "Only in B: c=128" in md
    data = json.loads(json.dumps(result.to_dict()))  # plain JSON types only
    top = data["points"][-1]
    assert top["key"] == "c=64" and top["concurrency"] == 64
    tput = next(m for m in top["metrics"] if m["metric"] == "output_throughput")
    assert tput["ratio"] == pytest.approx(2095 / 1640) and round(tput["change_pct"]) == 28
    assert data["peak"]["before"] == pytest.approx(1640.0) and data["peak"]["after"] == pytest.approx(2110.0)


def test_rate_sweeps_match_by_rate_and_mixed_sweeps_match_nothing(tmp_path: Path, before_after):
    def rate_run(name: str, rates: tuple[float, ...]) -> RunDir:
        run = RunDir.create(tmp_path / name, {"target": {"url": "http://127.0.0.1:1"}})
        with run.jsonl_writer("points.jsonl") as w:
            for i, r in enumerate(rates):
                w.write({"point": i, "label": f"rate={r:g}", "concurrency": None, "request_rate": r,
                         "start_ns": i, "measure_start_ns": i, "end_ns": i + 1, "num_requests": 0, "num_warmup": 0})
        return run

    result = compare_runs(rate_run("ra", (1.0, 2.0)), rate_run("rb", (2.0, 4.0)))
    assert [p.key for p in result.points] == ["rate=2"]
    assert result.only_a == ("rate=1",) and result.only_b == ("rate=4",)
    mixed = compare_runs(before_after[0], rate_run("rc", (2.0,)))
    assert mixed.points == () and "no sweep point in common" in mixed.headline()
    assert any("swept concurrency" in n for n in mixed.notes)
