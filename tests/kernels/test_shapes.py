"""Shape derivation: from a model's MoE geometry and TP/EP to the GEMMs one GPU runs."""

from __future__ import annotations

import pytest

from servescope.errors import ConfigError, UnknownNameError
from servescope.kernels.shapes import ExpertShape, expert_shape, tokens_per_expert_for_batch


def test_gate_up_and_down_shapes_under_ep_and_tp():
    shape = ExpertShape(name="m", hidden=6144, expert_width=2048, experts=256, top_k=8)
    gu = shape.gemm("gate_up", ep=8)
    assert (gu.n, gu.k, gu.local_experts) == (4096, 6144, 32)
    down = shape.gemm("down", tp=2, ep=4)
    assert (down.n, down.k, down.local_experts) == (6144, 1024, 64)
    gu_tp = shape.gemm("gate_up", tp=4)
    assert (gu_tp.n, gu_tp.k, gu_tp.local_experts) == (1024, 6144, 256)


@pytest.mark.parametrize(("kwargs", "needle"), [({"ep": 3}, "ep=3"), ({"tp": 3}, "tp=3"), ({"ep": 0}, ">= 1")])
def test_uneven_or_invalid_parallelism_is_a_config_error(kwargs, needle):
    shape = ExpertShape(name="m", hidden=6144, expert_width=2048, experts=256)
    with pytest.raises(ConfigError, match=needle):
        shape.gemm("gate_up", **kwargs)


def test_unknown_gemm_and_bad_dimensions_are_config_errors():
    with pytest.raises(ConfigError, match="unknown expert GEMM"):
        ExpertShape(name="m", hidden=64, expert_width=32, experts=4).gemm("up")
    with pytest.raises(ConfigError, match="hidden"):
        ExpertShape(name="m", hidden=0, expert_width=32, experts=4)


@pytest.mark.parametrize(
    ("model", "hidden", "width", "experts", "local"),
    [("glm-5", 6144, 2048, 256, 32), ("deepseek-v3", 7168, 2048, 256, 32), ("qwen3-235b-a22b", 4096, 1536, 128, 16)],
)
def test_catalog_models_give_the_issue_shapes_at_ep8(model, hidden, width, experts, local):
    shape = expert_shape(model)
    assert (shape.hidden, shape.expert_width, shape.experts, shape.top_k) == (hidden, width, experts, 8)
    gu = shape.gemm("gate_up", ep=8)
    assert (gu.n, gu.k, gu.local_experts) == (2 * width, hidden, local)


def test_dense_and_unknown_models_are_refused():
    with pytest.raises(ConfigError, match="no routed experts"):
        expert_shape("llama-3.1-8b")
    with pytest.raises(UnknownNameError):
        expert_shape("no-such-model")


def test_tokens_per_expert_for_a_decode_batch():
    shape = ExpertShape(name="m", hidden=6144, expert_width=2048, experts=256, top_k=8)
    assert tokens_per_expert_for_batch(1024, shape) == 32.0
    with pytest.raises(ConfigError, match="top_k"):
        tokens_per_expert_for_batch(8, ExpertShape(name="m", hidden=64, expert_width=32, experts=4))
