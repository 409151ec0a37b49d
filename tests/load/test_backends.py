"""Backend decoders on literal bytes recorded from real servers (tests/load/fixtures/*.json name the source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from servescope.load.backends import (
    Prompt,
    RequestOptions,
    StreamDecodeError,
    StreamServerError,
    get_backend,
)
from servescope.load.sse import SseParser

FIX = Path(__file__).parent / "fixtures"


def decode_fixture(name: str, backend: str, split: int = 0):
    """Feed a recorded body through the parser and decoder; arrival time = byte offset (a fake clock)."""
    data = (FIX / f"{name}.sse").read_bytes()
    meta = json.loads((FIX / f"{name}.json").read_text())
    dec = get_backend(backend).decoder()
    p = SseParser()
    pieces = [data[i : i + split] for i in range(0, len(data), split)] if split else [data]
    pos = 0
    for piece in pieces:
        pos += len(piece)
        for ev in p.feed(piece):
            dec.add(ev.data, ev.end_offset)
    for ev in p.close():
        dec.add(ev.data, ev.end_offset)
    return dec, meta


def _fixtures(prefix: str) -> list[str]:
    return sorted(f.stem for f in FIX.glob(f"{prefix}_*.sse"))


@pytest.mark.parametrize("name", _fixtures("transformers") + _fixtures("vllm"))
@pytest.mark.parametrize("split", [0, 1, 17])
def test_recorded_streams_decode_to_the_servers_usage(name, split):
    meta = json.loads((FIX / f"{name}.json").read_text())
    backend = "openai-chat" if "chat" in meta["path"] else "openai"
    dec, meta = decode_fixture(name, backend, split)
    assert dec.finished
    res = dec.finish()
    asked = meta["request"]["max_tokens"]
    if "stream_options" in meta["request"] or name.startswith("transformers"):
        # transformers serve sends usage on its final chunk whether asked or not; vLLM when asked.
        assert res.output_tokens_source == "usage"
        assert res.output_tokens == asked  # the tiny model cannot sample EOS
    else:
        assert res.output_tokens_source == "chunks"  # flagged: no usage sent
    assert res.finish_reason == "length"
    assert res.chunk_ns == sorted(res.chunk_ns)
    assert sum(res.chunk_tokens) <= max(asked, len(res.chunk_ns))


def test_transformers_serve_sends_fewer_chunks_than_tokens_and_no_done():
    # local-engine.md: chunks < tokens, usage on the final chunk, no [DONE].
    dec, _ = decode_fixture("transformers_completions_usage", "openai")
    res = dec.finish()
    assert not res.done_seen
    assert res.chunk_tokens_source == "count"  # continuous_usage_stats ignored
    assert res.output_tokens == 12


def test_vllm_continuous_usage_gives_per_chunk_token_deltas():
    if not (FIX / "vllm_completions_usage.sse").exists():
        pytest.skip("no vLLM fixture recorded (benchmarks/capture_fixtures.py --engine vllm)")
    dec, _ = decode_fixture("vllm_completions_usage", "openai")
    res = dec.finish()
    assert res.done_seen
    assert res.chunk_tokens_source == "usage"
    assert sum(res.chunk_tokens) == res.output_tokens == 12


def _feed(backend: str, lines: list[str]):
    dec = get_backend(backend).decoder()
    for i, line in enumerate(lines):
        dec.add(line, 1000 * (i + 1))
    return dec


def test_multi_token_chunks_from_running_usage():
    u = ',"usage":{"prompt_tokens":3,"completion_tokens":%d}'
    lines = [
        '{"choices":[{"text":"a"}]%s}' % (u % 1),
        '{"choices":[{"text":"bcd"}]%s}' % (u % 4),
        '{"choices":[{"text":""}]%s}' % (u % 4),  # no new token: not a token chunk
        '{"choices":[{"text":"ef","finish_reason":"length"}]%s}' % (u % 6),
        '{"choices":[]%s}' % (u % 6),
        "[DONE]",
    ]
    res = _feed("openai", lines).finish()
    assert res.chunk_tokens == [1, 3, 2]
    assert res.chunk_ns == [1000, 2000, 4000]
    assert (res.output_tokens, res.output_tokens_source, res.prompt_tokens) == (6, "usage", 3)


def test_chat_role_only_delta_is_not_a_token():
    lines = ['{"choices":[{"delta":{"role":"assistant"}}]}',
             '{"choices":[{"delta":{"content":"hi"}}]}',
             '{"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"completion_tokens":1,"prompt_tokens":2}}']
    res = _feed("openai-chat", lines).finish()
    assert res.chunk_ns == [2000]
    assert res.output_tokens == 1 and res.output_tokens_source == "usage"


def test_no_usage_falls_back_to_chunk_count_flagged():
    lines = ['{"choices":[{"text":"a"}]}', '{"choices":[{"text":"b","finish_reason":"length"}]}']
    res = _feed("openai", lines).finish()
    assert (res.output_tokens, res.output_tokens_source, res.chunk_tokens_source) == (2, "chunks", "count")


def test_sglang_generate_cumulative_counts():
    lines = ['{"text":"a","meta_info":{"prompt_tokens":5,"completion_tokens":2,"finish_reason":null}}',
             '{"text":"abc","meta_info":{"prompt_tokens":5,"completion_tokens":5,'
             '"finish_reason":{"type":"length","length":5}}}', "[DONE]"]
    res = _feed("sglang", lines).finish()
    assert res.chunk_tokens == [2, 3] and res.output_tokens == 5 and res.finish_reason == "length"


def test_malformed_and_server_errors_raise_their_own_types():
    with pytest.raises(StreamDecodeError):
        _feed("openai", ["{not json"])
    with pytest.raises(StreamDecodeError):
        _feed("openai", ["[1, 2]"])
    with pytest.raises(StreamDecodeError):
        _feed("sglang", ['{"text": "x"}'])
    with pytest.raises(StreamServerError):
        _feed("openai", ['{"error": {"message": "out of memory"}}'])


def test_request_bodies_carry_negotiated_options():
    p = Prompt("hi", 16, 1, (5, 6))
    o = RequestOptions(model="m")
    body = get_backend("openai").body(p, o)
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["max_tokens"] == 16 and body["ignore_eos"] is True and body["prompt"] == "hi"
    assert "stream_options" not in get_backend("openai").body(p, o.without("include_usage"))
    chat = get_backend("openai-chat").body(p, o.without("ignore_eos"))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    sg = get_backend("sglang").body(p, o)
    assert sg["input_ids"] == [5, 6] and sg["sampling_params"]["max_new_tokens"] == 16
    with pytest.raises(ValueError):
        get_backend("tgi")
