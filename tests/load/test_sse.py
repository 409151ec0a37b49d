"""The pure SSE parser, on literal bytes (WHATWG event-stream rules) split every possible way."""

from __future__ import annotations

import pytest

from servescope.load.sse import SseParser

STREAM = (b'data: {"a":1}\n\n'
          b": keep-alive ping\n\n"
          b"event: note\r\ndata: line one\r\ndata: line two\r\n\r\n"
          b"data:no-space\r\rdata: [DONE]\n\n")


def _all(chunks: list[bytes]) -> list[tuple[str, str]]:
    p = SseParser()
    out = []
    for c in chunks:
        out += [(e.event, e.data) for e in p.feed(c)]
    out += [(e.event, e.data) for e in p.close()]
    return out


EXPECTED = [("", '{"a":1}'), ("note", "line one\nline two"), ("", "no-space"), ("", "[DONE]")]


def test_whole_stream_lf_crlf_cr_comments_multiline():
    assert _all([STREAM]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 13])
def test_any_split_gives_the_same_events(size):
    chunks = [STREAM[i : i + size] for i in range(0, len(STREAM), size)]
    assert _all(chunks) == EXPECTED


def test_every_two_way_split_gives_the_same_events():
    for cut in range(len(STREAM) + 1):
        assert _all([STREAM[:cut], STREAM[cut:]]) == EXPECTED, cut


def test_end_offsets_point_just_past_each_event():
    p = SseParser()
    evs = p.feed(b"data: x\n\ndata: y\n\n")
    assert [e.end_offset for e in evs] == [9, 18]


def test_unterminated_last_event_is_returned_flagged_on_close():
    p = SseParser()
    assert p.feed(b'data: {"last":true}') == []
    evs = p.close()
    assert len(evs) == 1 and evs[0].data == '{"last":true}' and evs[0].unterminated


def test_event_without_data_is_not_dispatched_and_unknown_fields_ignored():
    assert _all([b"event: x\nretry: 10\nfoo: bar\n\ndata: ok\n\n"]) == [("", "ok")]


def test_non_utf8_is_replaced_not_raised():
    assert _all([b"data: \xff\xfe\n\n"]) == [("", "\ufffd\ufffd")]
