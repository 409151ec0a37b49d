"""The decode-step roofline checked from first principles on the seed scenario and small cases."""

from __future__ import annotations

import json
import math

import pytest

from servescope import roofline
from servescope.errors import ConfigError, UnknownNameError
from servescope.hardware import get_gpu

RTX = "rtx-pro-6000-server"
BW = 1.792e12
FP4_PEAK = 1871e12


def _op(point: roofline.DecodePoint, name: str) -> roofline.Op:
    return next(o for o in point.ops if o.name == name)


def test_seed_expert_gemm_intensity_is_114_not_16():
    """[32, 6144] x [6144, 2048] in NVFP4: 2*M FLOP per weight / 0.5625 B per weight."""
    op = roofline.gemm(RTX, m=32, n=2048, k=6144, weight_format="nvfp4")
    assert op.flops == 2 * 32 * 2048 * 6144
    assert op.weight_bytes == 2048 * 6144 * 0.5625
    assert op.weight_intensity == pytest.approx(2 * 32 / 0.5625) == pytest.approx(113.8, abs=0.05)
    # With activations in (NVFP4) and out (BF16) counted: 805.3 MFLOP / 7.32 MB.
    act = 32 * 6144 * 0.5625 + 32 * 2048 * 2
    assert op.intensity == pytest.approx(op.flops / (op.weight_bytes + act))
    assert 105 < op.intensity < 114
    assert op.ridge == pytest.approx(FP4_PEAK / BW) == pytest.approx(1044, abs=1)
    assert op.bound == "memory"
    assert op.attainable_tflops == pytest.approx(op.intensity * BW / 1e12)
    assert op.pct_of_peak == pytest.approx(100 * op.intensity / op.ridge)
    assert op.time_us == pytest.approx((op.weight_bytes + act) / BW * 1e6)


def test_expert_gemm_turns_compute_bound_where_the_formula_says():
    m_star = roofline.expert_ridge_tokens_per_expert("glm-5", RTX, dtype="nvfp4")
    n, k = 2 * 2048, 6144
    below = roofline.gemm(RTX, m=m_star * 0.99, n=n, k=k, weight_format="nvfp4")
    above = roofline.gemm(RTX, m=m_star * 1.01, n=n, k=k, weight_format="nvfp4")
    at = roofline.gemm(RTX, m=m_star, n=n, k=k, weight_format="nvfp4")
    assert at.intensity == pytest.approx(at.ridge, rel=1e-9)
    assert (below.bound, above.bound) == ("memory", "compute")
    # Weights alone would give ridge * 0.5625 / 2 = 294 tokens; activation traffic pushes it higher.
    assert 1044 * 0.5625 / 2 < m_star < 450
    # With TP 8 the expert is 8x narrower: output bytes weigh more per FLOP, so it needs ~1,145 tokens.
    tp8 = roofline.expert_ridge_tokens_per_expert("glm-5", RTX, dtype="nvfp4", tp=8)
    assert 1100 < tp8 < 1200


def test_seed_scenario_tp8_per_gpu_shapes_and_totals():
    p = roofline.decode_point("glm-5", RTX, dtype="nvfp4", tp=8, concurrency=1024, context_len=256)
    assert p.tokens_per_expert_mean == 32 and p.tokens_per_expert_max == 32
    gate_up = _op(p, "experts.gate_up")
    # TP 8 shards every expert's width: each GPU multiplies [32, 6144] x [6144, 2*2048/8] for all 256 experts.
    assert (gate_up.m, gate_up.n, gate_up.k) == (32, 512, 6144)
    assert gate_up.count == 256 * 75
    assert gate_up.flops == pytest.approx(2 * 32 * 512 * 6144 * 256 * 75)
    assert gate_up.weight_bytes == pytest.approx(512 * 6144 * 0.5625 * 256 * 75)
    down = _op(p, "experts.down")
    assert (down.m, down.n, down.k) == (32, 6144, 256)
    assert gate_up.bound == down.bound == "memory"
    # All-reduce: 2 per layer (78 layers) of 1024 x 6144 bf16, ring 2(T-1)/T, over PCIe 5 (~63 GB/s).
    ar = _op(p, "comm.allreduce")
    assert ar.bytes == pytest.approx(2 * 78 * 2 * 7 / 8 * 1024 * 6144 * 2)
    assert ar.time_us == pytest.approx(ar.bytes / get_gpu(RTX).link_bandwidth_bytes_s * 1e6)
    # MLA latent cache (576 elements/token/layer) read for every sequence; bf16 KV in the base GLM-5 config.
    mla = _op(p, "attn.mla_decode")
    assert mla.bytes == pytest.approx(1024 * 256 * 576 * 2 * 78)
    assert p.step_time_us == pytest.approx(sum(o.time_us for o in p.ops))
    assert p.tok_s_upper_bound == pytest.approx(1024 / (p.step_time_us * 1e-6))
    assert p.bound == "memory"


def test_nvfp4_checkpoint_uses_fp8_kv_and_bf16_attention():
    p = roofline.decode_point("glm-5-nvfp4", RTX, dtype=None, tp=8, concurrency=1024, context_len=256)
    assert _op(p, "attn.mla_decode").bytes == pytest.approx(1024 * 256 * 576 * 1 * 78)
    assert _op(p, "attn.q_b_proj").dtype == "bf16"
    assert _op(p, "experts.gate_up").dtype == "nvfp4"
    assert _op(p, "lm_head").weight_format == "bf16"
    assert p.dtype == "nvfp4"


def test_expert_parallel_keeps_full_width_and_fewer_experts():
    p = roofline.decode_point("glm-5", RTX, dtype="nvfp4", tp=8, ep=8, concurrency=1024, context_len=256)
    gate_up = _op(p, "experts.gate_up")
    assert (gate_up.m, gate_up.n, gate_up.k) == (32, 4096, 6144)
    assert gate_up.count == 32 * 75
    assert p.routing.gpu_tokens_max == 1024


def test_uniform_routing_straggler_slows_the_step():
    kw = {"dtype": "nvfp4", "tp": 8, "ep": 8, "concurrency": 512, "context_len": 256}
    bal = roofline.decode_point("glm-5", RTX, routing="balanced", **kw)
    uni = roofline.decode_point("glm-5", RTX, routing="uniform", seed=1, **kw)
    zipf = roofline.decode_point("glm-5", RTX, routing="zipf:1.2", seed=1, **kw)
    t = [sum(o.time_us for o in p.ops if o.group == "experts") for p in (bal, uni, zipf)]
    assert t[0] < t[1] < t[2]
    assert uni.tokens_per_expert_max > bal.tokens_per_expert_max


def test_sweep_is_monotone_and_json_ready():
    pts = roofline.decode_sweep(
        "glm-5", RTX, dtype="nvfp4", tp=8, concurrencies=[256, 512, 1024, 2048], context_len=256
    )
    assert [p.tokens_per_expert_mean for p in pts] == [8, 16, 32, 64]
    steps = [p.step_time_us for p in pts]
    tps = [p.tok_s_upper_bound for p in pts]
    assert steps == sorted(steps) and tps == sorted(tps)
    d = json.loads(json.dumps(pts[-1].to_dict()))
    for key in (
        "tokens_per_expert_mean",
        "tokens_per_expert_max",
        "step_time_us",
        "bound",
        "tok_s_upper_bound",
        "dominant_term",
        "gemms",
        "ops",
        "routing",
        "fits_in_memory",
    ):
        assert key in d
    for g in d["gemms"]:
        for key in (
            "name",
            "m",
            "n",
            "k",
            "count",
            "dtype",
            "flops",
            "bytes",
            "intensity",
            "ridge",
            "attainable_tflops",
            "pct_of_peak",
            "time_us",
        ):
            assert key in g
    names = {g["name"] for g in d["gemms"]}
    assert {
        "attn.qkv_a_proj",
        "attn.q_b_proj",
        "attn.o_proj",
        "mlp.gate_up",
        "mlp.down",
        "moe.router",
        "experts.gate_up",
        "experts.down",
        "shared.gate_up",
        "shared.down",
        "lm_head",
    } <= names
    assert d["bound"] in ("memory", "compute")


def test_unfused_gate_and_up():
    p = roofline.decode_point("glm-5", RTX, dtype="nvfp4", tp=8, concurrency=256, context_len=64, fused_gate_up=False)
    names = [o.name for o in p.ops if o.group == "experts"]
    assert names == ["experts.gate", "experts.up", "experts.down"]
    assert _op(p, "experts.gate").n == 256


def test_dense_model_turns_compute_bound_near_the_bf16_ridge():
    g = get_gpu("h100-sxm")
    c = roofline.compute_bound_concurrency("llama-3.1-70b", g, dtype=None, context_len=1)
    ridge = g.ridge_flops_per_byte("bf16")  # ~295 FLOP/B: a bf16 GEMM with M rows has AI ~ M
    assert c is not None and 0.8 * ridge < c < 1.3 * ridge
    at = roofline.decode_point("llama-3.1-70b", g, dtype=None, concurrency=c, context_len=1)
    before = roofline.decode_point("llama-3.1-70b", g, dtype=None, concurrency=c - 1, context_len=1)
    assert (before.bound, at.bound) == ("memory", "compute")
    assert at.tokens_per_expert_mean is None


def test_glm5_step_never_turns_compute_bound_with_a_growing_kv_cache():
    # MLA decode reads the whole latent cache per sequence: its traffic grows with concurrency like the FLOPs.
    assert (
        roofline.compute_bound_concurrency("glm-5", RTX, dtype="nvfp4", tp=8, context_len=4096, max_concurrency=1 << 16)
        is None
    )


def test_build_sweep_reports_crossings():
    s = roofline.build_sweep("qwen3-30b-a3b", "h200", dtype="bf16", concurrencies=[64, 128], context_len=1)
    d = s.to_dict()
    assert d["schema_version"] == 1 and len(d["points"]) == 2
    m_star = d["expert_ridge_tokens_per_expert"]
    assert d["expert_ridge_concurrency"] == pytest.approx(m_star * 128 / 8)
    assert d["compute_bound_concurrency"] is None or d["compute_bound_concurrency"] > 0


def test_efficiency_callable_scales_expert_gemms_only():
    seen = []

    def eff(dtype: str, tpe: float) -> float:
        seen.append((dtype, tpe))
        return 0.01

    base = roofline.decode_point("glm-5", RTX, dtype="nvfp4", tp=8, concurrency=1024, context_len=256)
    cal = roofline.decode_point("glm-5", RTX, dtype="nvfp4", tp=8, concurrency=1024, context_len=256, efficiency=eff)
    assert ("nvfp4", 32.0) in seen
    gu = _op(cal, "experts.gate_up")
    assert gu.efficiency == 0.01
    assert gu.time_us == pytest.approx(gu.flops / (FP4_PEAK * 0.01) * 1e6)
    assert gu.attainable_tflops == pytest.approx(0.01 * gu.intensity * BW / 1e12)
    assert _op(cal, "attn.o_proj").time_us == _op(base, "attn.o_proj").time_us
    assert cal.step_time_us > base.step_time_us
    with pytest.raises(ConfigError, match="efficiency"):
        roofline.decode_point(
            "glm-5", RTX, dtype="nvfp4", tp=8, concurrency=64, context_len=16, efficiency=lambda d, m: 1.5
        )


def test_gpu_without_fp4_runs_nvfp4_weight_only():
    p = roofline.decode_point("glm-5", "h200", dtype="nvfp4", tp=8, concurrency=256, context_len=256)
    gu = _op(p, "experts.gate_up")
    assert gu.dtype == "bf16" and gu.weight_format == "nvfp4"
    assert gu.weight_bytes == pytest.approx(512 * 6144 * 0.5625 * 256 * 75)
    assert any("weight-only" in w for w in p.warnings)


def test_memory_capacity_warning():
    p = roofline.decode_point("glm-5", RTX, dtype=None, tp=8, concurrency=64, context_len=256)  # 1.5 TB of bf16
    assert p.fits_in_memory is False
    assert any("GB per GPU" in w for w in p.warnings)
    ok = roofline.decode_point("qwen3-30b-a3b", "h200", dtype=None, concurrency=64, context_len=256)
    assert ok.fits_in_memory is True and not ok.warnings


def test_link_bandwidth_override_and_single_gpu_has_no_comm():
    p = roofline.decode_point(
        "glm-5", RTX, dtype="nvfp4", tp=8, concurrency=256, context_len=256, link_bandwidth_bytes_s=600e9
    )
    assert _op(p, "comm.allreduce").time_us == pytest.approx(_op(p, "comm.allreduce").bytes / 600e9 * 1e6)
    single = roofline.decode_point("qwen3-30b-a3b", "h200", dtype=None, concurrency=8, context_len=8)
    assert single.comm_time_us == 0 and not [o for o in single.ops if o.kind == "comm"]


@pytest.mark.parametrize(
    "model",
    [
        "gpt-oss-120b",
        "llama-4-maverick",
        "qwen3.5-397b-a17b",
        "nemotron-3-nano-30b-a3b",
        "mixtral-8x7b",
        "kimi-k2",
        "minimax-m2.5",
        "deepseek-v3.1-nvfp4",
    ],
)
def test_every_family_produces_a_finite_step(model):
    p = roofline.decode_point(model, "b200", dtype=None, tp=2, concurrency=128, context_len=512)
    assert 0 < p.step_time_us < math.inf
    assert all(o.time_us >= 0 for o in p.ops)
    json.dumps(p.to_dict())


def test_sliding_window_caps_kv_traffic():
    p = roofline.decode_point("gpt-oss-20b", "h200", dtype=None, concurrency=16, context_len=4096)
    full, swa = _op(p, "attn.gqa_decode"), _op(p, "attn.swa_decode")
    assert swa.bytes == pytest.approx(full.bytes * 128 / 4096)


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"tp": 8, "ep": 3}, ConfigError, "must divide --tp"),
        ({"tp": 3}, ConfigError, "expert width 2048 of glm-5 is not divisible by tp/ep = 3"),
        ({"tp": 0}, ConfigError, "tp must be a positive integer"),
        ({"concurrency": 0}, ConfigError, "concurrency must be a positive integer"),
        ({"context_len": -5}, ConfigError, "context_len"),
        ({"dtype": "fp5"}, UnknownNameError, "unknown format"),
        ({"routing": "zipf:0"}, ConfigError, "routing"),
        ({"link_bandwidth_bytes_s": -1.0}, ConfigError, "link bandwidth"),
    ],
)
def test_bad_arguments(kwargs, exc, needle):
    args = {"dtype": "nvfp4", "tp": 8, "concurrency": 64, "context_len": 16} | kwargs
    with pytest.raises(exc, match=needle):
        roofline.decode_point("glm-5", RTX, **args)


def test_ep_errors_for_dense_models_and_indivisible_experts():
    with pytest.raises(ConfigError, match="no MoE layers"):
        roofline.decode_point("llama-3.1-8b", "h200", dtype=None, tp=2, ep=2, concurrency=8, context_len=8)
    with pytest.raises(ConfigError, match="does not divide the 32 attention heads"):
        roofline.decode_point("qwen3-30b-a3b", "h200", dtype=None, tp=3, concurrency=8, context_len=8)
    with pytest.raises(ConfigError, match="does not divide the 8 experts"):
        roofline.check_parallelism(roofline.get_model("mixtral-8x7b"), tp=16, ep=16)
