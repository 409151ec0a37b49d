"""MoE routing maths: closed forms where they exist, seeded Monte Carlo checked against them."""

from __future__ import annotations

import numpy as np
import pytest

from servescope import routing
from servescope.errors import ConfigError


def test_seed_case_balanced_1024_tokens_top8_of_256_gives_32_per_expert():
    s = routing.tokens_per_expert(1024, 8, 256, ep=1, routing="balanced")
    assert s.tokens_per_expert_mean == 32.0
    assert s.tokens_per_expert_max == 32.0
    assert s.active_experts_mean == 256
    assert s.assignments == 8192
    assert s.method == "exact"


def test_balanced_remainder_and_sparse_batches():
    s = routing.tokens_per_expert(100, 8, 256, ep=8)
    assert s.tokens_per_expert_mean == pytest.approx(800 / 256)
    assert s.tokens_per_expert_max == 4  # 800 = 3 x 256 + 32: 32 experts get a 4th token
    assert s.gpu_tokens_max == s.gpu_tokens_mean == 100  # remainder spread round robin over GPUs
    tiny = routing.tokens_per_expert(2, 8, 256)
    assert tiny.active_experts_mean == 16 and tiny.tokens_per_expert_mean == 1.0


@pytest.mark.parametrize("b", [1, 4, 16, 64])
def test_uniform_active_experts_closed_form_matches_monte_carlo(b):
    k, e = 8, 256
    closed = e * (1 - (1 - k / e) ** b)
    assert routing.expected_active_experts(b, k, e) == pytest.approx(closed)
    samples, method = routing.sample_loads(b, k, e, 1, "uniform", seed=1, trials=400)
    assert method.startswith("monte-carlo per token")
    assert samples.active_experts.mean() == pytest.approx(closed, rel=0.02)
    # every token routes to exactly k distinct experts
    assert (samples.tokens.sum(axis=1) == b * k).all()
    stats = routing.tokens_per_expert(b, k, e, routing="uniform")
    assert stats.active_experts_closed_form == pytest.approx(closed)
    assert stats.tokens_per_expert_mean == pytest.approx(b * k / closed)


def test_uniform_straggler_is_well_above_the_mean():
    s = routing.tokens_per_expert(1024, 8, 256, ep=8, routing="uniform", seed=0, trials=64)
    # Binomial(1024, 1/32): mean 32, sd ~5.6; the max of 256 such counts sits ~2.8 sd above.
    assert 42 <= s.tokens_per_expert_max <= 56
    assert s.gpu_tokens_mean == 1024
    assert 1024 < s.gpu_tokens_max < 1024 * 1.15
    assert s.gpu_active_experts_max <= 32


def test_seeded_monte_carlo_is_reproducible():
    a = routing.tokens_per_expert(512, 8, 256, ep=4, routing="zipf:1.2", seed=7)
    b = routing.tokens_per_expert(512, 8, 256, ep=4, routing="zipf:1.2", seed=7)
    assert a == b


def test_zipf_skew_raises_the_straggler():
    uni = routing.tokens_per_expert(1024, 8, 256, routing="uniform", seed=3)
    flat = routing.tokens_per_expert(1024, 8, 256, routing="zipf:0.01", seed=3)
    skew = routing.tokens_per_expert(1024, 8, 256, routing="zipf:1.2", seed=3)
    assert flat.tokens_per_expert_max == pytest.approx(uni.tokens_per_expert_max, rel=0.15)
    assert skew.tokens_per_expert_max > 5 * uni.tokens_per_expert_max
    assert skew.tokens_per_expert_max <= 1024  # an expert gets each token at most once
    assert skew.active_experts_mean < uni.active_experts_mean


@pytest.mark.parametrize("kind", ["uniform", "zipf:0.8"])
def test_binomial_counts_approximation_agrees_with_per_token_sampling(monkeypatch, kind):
    exact = routing.tokens_per_expert(2048, 8, 128, ep=4, routing=kind, seed=5, trials=48)
    assert exact.method.startswith("monte-carlo per token")
    monkeypatch.setattr(routing, "EXACT_WORK_LIMIT", 0)
    approx = routing.tokens_per_expert(2048, 8, 128, ep=4, routing=kind, seed=5, trials=48)
    assert approx.method.startswith("monte-carlo binomial")
    assert approx.tokens_per_expert_max == pytest.approx(exact.tokens_per_expert_max, rel=0.1)
    assert approx.gpu_tokens_max == pytest.approx(exact.gpu_tokens_max, rel=0.05)
    assert approx.active_experts_mean == pytest.approx(exact.active_experts_mean, rel=0.02)


def test_large_batches_use_the_counts_approximation_and_stay_fast():
    s = routing.tokens_per_expert(1 << 18, 8, 256, ep=8, routing="uniform")
    assert s.method.startswith("monte-carlo binomial")
    assert s.tokens_per_expert_mean == pytest.approx(8192, rel=1e-6)
    assert s.tokens_per_expert_max > 8192


def test_per_gpu_fold_follows_contiguous_expert_placement():
    samples, _ = routing.sample_loads(64, 2, 16, ep=4, routing="balanced")
    assert samples.tokens.shape == (1, 4)
    assert samples.tokens.sum() == 128
    assert np.all(samples.active_experts == 4)


@pytest.mark.parametrize("text", ["", "zipf", "zipf:", "zipf:0", "zipf:-1", "zipf:abc", "random", "zipf:inf"])
def test_bad_routing_strings(text):
    with pytest.raises(ConfigError):
        routing.parse_routing(text)


def test_parse_routing_labels():
    assert routing.parse_routing("Zipf:1.20").label == "zipf:1.2"
    assert routing.parse_routing(" uniform ").label == "uniform"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((0, 8, 256, 1), "batch_tokens"),
        ((16, 0, 256, 1), "top_k"),
        ((16, 9, 8, 1), "exceeds"),
        ((16, 8, 256, 3), "does not divide"),
        ((16, 8, 256, -1), "ep"),
    ],
)
def test_invalid_sizes(args, needle):
    with pytest.raises(ConfigError, match=needle):
        routing.tokens_per_expert(*args)
