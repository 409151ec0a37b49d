"""Open-loop schedules and prompt workloads: determinism, conventions, exact lengths."""

from __future__ import annotations

import itertools
import random
import statistics
import typing

import pytest

from servescope.errors import ConfigError
from servescope.load.schedule import arrival_offsets_ns
from servescope.load.workload import WorkloadConfig, draw_length, make_prompts, parse_range


def test_schedule_is_absolute_deterministic_and_has_the_asked_rate():
    a = arrival_offsets_ns(4000, 200.0, 1.0, seed=3)
    assert a == arrival_offsets_ns(4000, 200.0, 1.0, seed=3)
    assert a[0] == 0 and all(x <= y for x, y in itertools.pairwise(a))
    rate = (len(a) - 1) / (a[-1] / 1e9)
    assert rate == pytest.approx(200.0, rel=0.06)


def test_burstiness_changes_dispersion_not_mean():
    gaps = lambda b: [y - x for x, y in zip(*(lambda s: (s, s[1:]))(arrival_offsets_ns(5000, 100.0, b, 1)),  # noqa: E731
                                            strict=False)]
    smooth, bursty = gaps(8.0), gaps(0.25)
    assert statistics.mean(smooth) == pytest.approx(statistics.mean(bursty), rel=0.15)
    assert statistics.pstdev(bursty) > 3 * statistics.pstdev(smooth)


def test_duration_limits_the_schedule_and_inf_sends_all_at_once():
    assert max(arrival_offsets_ns(10**6, 50.0, duration_s=2.0)) <= 2e9
    assert arrival_offsets_ns(5, float("inf")) == [0] * 5


def test_range_conventions_by_name():
    rng = random.Random(0)
    sg = [draw_length(rng, 100, "sglang", 0.5) for _ in range(2000)]
    vl = [draw_length(rng, 100, "vllm", 0.5) for _ in range(2000)]
    assert min(sg) >= 50 and max(sg) == 100
    assert min(vl) >= 50 and max(vl) <= 150 and max(vl) > 100
    assert parse_range("vllm:0.25") == ("vllm", 0.25) and parse_range(None) == ("fixed", 0.0)
    with pytest.raises(ConfigError):
        parse_range("0.5")


class CharTokenizer:
    """A real (if trivial) tokenizer: one token per character of 'a'..'z' and space."""

    allowed_ids: typing.ClassVar[list[int]] = list(range(27))
    name = "chars"

    def encode(self, text):
        return [26 if c == " " else ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(" " if i == 26 else chr(97 + i) for i in ids)


def test_random_prompts_have_exact_lengths_and_are_seeded():
    cfg = WorkloadConfig(dataset="random", input_len=37, output_len=9, seed=5)
    ps = make_prompts(cfg, 20, CharTokenizer())
    assert all(p.prompt_tokens == 37 and len(p.text) == 37 and p.output_len == 9 for p in ps)
    assert [p.text for p in ps] == [p.text for p in make_prompts(cfg, 20, CharTokenizer())]
    ids = make_prompts(cfg, 2, CharTokenizer(), want_ids=True)
    assert len(ids[0].token_ids) == 37


def test_random_without_tokenizer_is_a_config_error():
    with pytest.raises(ConfigError, match="--tokenizer"):
        make_prompts(WorkloadConfig(), 1, None)


def test_text_sharegpt_and_jsonl(tmp_path):
    assert make_prompts(WorkloadConfig(dataset="text:hello", output_len=4), 3, None)[2].text == "hello"
    sg = tmp_path / "sg.json"
    sg.write_text('[{"conversations":[{"from":"human","value":"q1"},{"from":"gpt","value":"ab cd"}]},'
                  '{"conversations":[{"from":"human","value":"lonely"}]}]')
    ps = make_prompts(WorkloadConfig(dataset=f"sharegpt:{sg}", output_len=None), 2, CharTokenizer())
    assert [p.text for p in ps] == ["q1", "q1"] and ps[0].output_len == 5
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "x", "output_len": 3}\n"plain"\n')
    ps = make_prompts(WorkloadConfig(dataset=f"jsonl:{jl}", output_len=7), 2, None)
    assert [(p.text, p.output_len) for p in ps] == [("x", 3), ("plain", 7)]
    with pytest.raises(ConfigError):
        make_prompts(WorkloadConfig(dataset=f"jsonl:{tmp_path / 'missing'}"), 1, None)
