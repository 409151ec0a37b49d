"""The two numbers (FLOPs, minimum bytes) and the roofline floor."""

from __future__ import annotations

import pytest

from servescope.errors import ConfigError
from servescope.kernels.cost import Ceilings, datasheet_ceilings, gemm_cost
from servescope.kernels.shapes import GemmShape

GLM5_GATE_UP = GemmShape(model="glm-5", gemm="gate_up", n=4096, k=6144, local_experts=32)


def test_bf16_cost_counts_weights_activations_and_outputs_once():
    cost = gemm_cost(GLM5_GATE_UP, "bf16", 4)
    assert cost.flops == 2 * 32 * 4 * 4096 * 6144
    assert cost.weight_bytes == 2 * 32 * 4096 * 6144
    assert cost.activation_bytes == 2 * 32 * 4 * 6144
    assert cost.output_bytes == 2 * 32 * 4 * 4096
    assert cost.scale_bytes == 0
    assert cost.total_bytes == cost.weight_bytes + cost.activation_bytes + cost.output_bytes


def test_fp8_halves_weight_bytes_adds_scales_and_fused_silu_halves_output():
    cost = gemm_cost(GLM5_GATE_UP, "fp8", 4, fused_silu=True)
    assert cost.weight_bytes == 32 * 4096 * 6144
    assert cost.scale_bytes == 4 * 32 * (4 + 4096)
    assert cost.output_bytes == 2 * 32 * 4 * 2048


def test_fused_silu_only_on_gate_up_and_dtype_checked():
    down = GemmShape(model="m", gemm="down", n=6144, k=2048, local_experts=32)
    with pytest.raises(ConfigError, match="gate_up"):
        gemm_cost(down, "bf16", 1, fused_silu=True)
    with pytest.raises(ConfigError, match="unknown kernel dtype"):
        gemm_cost(down, "int4", 1)


def test_roofline_floor_switches_from_memory_to_compute_at_the_ridge():
    ceilings = Ceilings(bandwidth_bytes_s=4e12, matmul_flops_s={"bf16": 800e12}, source="measured")
    small = gemm_cost(GLM5_GATE_UP, "bf16", 1)
    large = gemm_cost(GLM5_GATE_UP, "bf16", 1024)
    assert ceilings.bound(small, "bf16") == "memory"
    assert ceilings.ideal_time_s(small, "bf16") == pytest.approx(small.total_bytes / 4e12)
    assert ceilings.bound(large, "bf16") == "compute"
    assert ceilings.ideal_time_s(large, "bf16") == pytest.approx(large.flops / 800e12)
    # a dtype without a measured matrix rate is drawn against bandwidth alone
    assert ceilings.bound(large, "fp8") == "memory"


def test_ceilings_round_trip_and_datasheet_lookup():
    c = Ceilings(bandwidth_bytes_s=4.2e12, matmul_flops_s={"bf16": 7.7e14}, source="measured")
    assert Ceilings.from_dict(c.to_dict()) == c
    h200 = datasheet_ceilings("NVIDIA H200")
    assert h200 is not None and h200.bandwidth_bytes_s == 4.8e12
    assert h200.matmul_flops_s["bf16"] == pytest.approx(989e12)
    assert datasheet_ceilings("Imaginary GPU 9000") is None
