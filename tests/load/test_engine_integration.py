"""A closed-loop ladder against a REAL ``transformers serve`` (tiny random MoE, CPU, loopback).

The tiny model cannot sample EOS (servescope.engine.tiny_model), so every request must
return exactly --output-len tokens, as counted by the server's own usage.
"""

from __future__ import annotations

import math

import pytest

from servescope.load.sweep import SweepConfig, run_sweep
from servescope.run import RunDir

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

OUTPUT_LEN = 8
PER_POINT = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    try:
        from servescope.engine.launcher import EngineConfig, start_engine
        from servescope.engine.tiny_model import build_tiny_moe
    except ImportError as err:  # pragma: no cover - the engine module ships with servescope
        pytest.skip(f"embedded engine not available: {err}")
    model_dir = build_tiny_moe(cache_dir=tmp_path_factory.mktemp("models"))
    with start_engine(EngineConfig(kind="transformers", model_dir=model_dir, device="cpu")) as handle:
        yield handle, model_dir


@pytest.mark.parametrize(("backend", "workers"), [("openai", 1), ("openai-chat", 1), ("openai", 2)])
def test_ladder_against_transformers_serve(tmp_path, engine, backend, workers):
    """``workers=2``: the same ladder from two client processes (c=1 runs in one) must give the same counts."""
    handle, model_dir = engine
    cfg = SweepConfig(url=handle.base_url, backend=backend, model=handle.served_model,
                      concurrencies=(1, 2, 4, 8, 16), input_len=32, output_len=OUTPUT_LEN, num_prompts=PER_POINT,
                      tokenizer=str(model_dir), timeout_s=120, seed=1, workers=workers)
    run = RunDir.create(tmp_path / "run", cfg.to_config())
    summary = run_sweep(run, cfg)
    assert len(summary["points"]) == 5
    for p in summary["points"]:
        c = p["target_concurrency"]
        assert p["completed"] == PER_POINT and p["failed"] == 0, p["failures_by_kind"]
        assert p["output_tokens_sources"] == {"usage": PER_POINT}
        assert p["total_output_tokens"] == PER_POINT * OUTPUT_LEN
        if backend == "openai":
            assert p["total_input_tokens"] == PER_POINT * 32  # exact random prompt lengths, by the server's count
        # Formula bounds.
        d = p["duration_s"]
        assert p["request_throughput"] == pytest.approx(PER_POINT / d)
        assert p["output_throughput"] == pytest.approx(PER_POINT * OUTPUT_LEN / d)
        assert 0 < p["concurrency"] <= c + 1e-9  # Little's law cannot exceed what was in flight
        assert p["max_concurrent_requests"] <= c
        for m in ("ttft", "tpot", "itl", "e2el"):
            assert 0 <= p[f"min_{m}_ms"] <= p[f"median_{m}_ms"] <= p[f"p99_{m}_ms"] <= p[f"max_{m}_ms"]
        assert p["max_ttft_ms"] <= p["max_e2el_ms"]
        assert p["median_tpot_ms"] * (OUTPUT_LEN - 1) <= p["max_e2el_ms"]
        # The fullest 1-s bucket holds at least an even share of the tokens over the buckets spanned.
        assert p["max_output_tokens_per_s"] >= p["total_output_tokens"] / (math.ceil(d) + 1) * 0.99
        assert p["client"]["processes"] == min(workers, c)
    # Served tokens across the run match requests x output-len, warm-ups included.
    recs = list(run.iter_jsonl("requests.jsonl"))
    assert sorted(r["request_id"] for r in recs) == list(range(len(recs)))
    assert all(r["ok"] and r["output_tokens"] == OUTPUT_LEN for r in recs)
