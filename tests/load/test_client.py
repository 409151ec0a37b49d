"""The streaming client against real loopback servers: every fault becomes a recorded kind."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from servescope.errors import ConfigError
from servescope.load.backends import Prompt, RequestOptions, get_backend
from servescope.load.client import Endpoint, StreamingClient, build_request, new_event_loop


def _run(url: str, prompts: list[str], backend: str = "openai", timeout_s: float = 2.0):
    ep = Endpoint.parse(url)
    b = get_backend(backend)

    async def go():
        async with StreamingClient(ep, timeout_s=timeout_s) as c:
            out = []
            for p in prompts:
                req = build_request(ep, b.path, b.body(Prompt(p, 7), RequestOptions(model="m")), api_key="k")
                out.append(await c.stream(req, b.decoder()))
            return out

    loop = new_event_loop()
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


@pytest.mark.parametrize("backend", ["openai", "openai-chat", "sglang"])
def test_each_fault_is_recorded_with_its_kind_and_the_connection_pool_recovers(fast_server, backend):
    prompts = ["ok", "<<fault:status=500>>", "<<fault:status=404>>", "x <<fault:stall>>", "x <<fault:drop>>",
               "<<fault:bad_json>>", "<<fault:bad_sse>>", "<<fault:bad_chunk>>", "ok again"]
    res = _run(fast_server, prompts, backend, timeout_s=0.6)
    kinds = [r.error_kind for r in res]
    assert kinds == [None, "http_status", "http_status", "timeout", "disconnect", "malformed", "malformed",
                     "malformed", None]
    assert res[1].status == 500 and "injected HTTP 500" in res[1].error_text
    # Data received before a failure is kept.
    assert res[3].decoded.chunk_tokens == [2, 2] and res[4].decoded.chunk_tokens == [2, 2]
    for good in (res[0], res[-1]):
        assert good.ok and good.decoded.output_tokens == 7 and good.decoded.chunk_tokens == [2, 2, 2, 1]
        assert len(good.decoded.stamps_ns) == 4
        # arrival never precedes the server's send stamp (same CLOCK_MONOTONIC)
        assert all(a >= s for a, s in zip(good.decoded.chunk_ns, good.decoded.stamps_ns, strict=True))


def test_unreachable_url_is_a_recorded_failure(closed_port):
    res = _run(f"http://127.0.0.1:{closed_port}", ["hi"])
    assert res[0].error_kind == "unreachable" and not res[0].ok


def test_server_that_closes_before_replying_and_one_that_stays_silent():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    held = []

    def accept():
        for i in range(2):
            c, _ = srv.accept()
            c.recv(65536)
            if i == 0:
                c.close()  # reset before any reply
            else:
                held.append(c)  # never answers

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    res = _run(f"http://127.0.0.1:{port}", ["a", "b"], timeout_s=0.5)
    assert [r.error_kind for r in res] == ["unreachable", "timeout"]
    for c in held:
        c.close()
    srv.close()


def test_plain_json_call_and_bad_urls(fast_server):
    ep = Endpoint.parse(fast_server + "/")
    assert ep.base_path == ""

    async def go():
        async with StreamingClient(ep, timeout_s=2) as c:
            return await c.stream(build_request(ep, "/v1/models", None, method="GET"), None)

    loop = new_event_loop()
    res = loop.run_until_complete(go())
    loop.close()
    assert res.ok and b"servescope-selftest" in res.body
    for bad in ("ftp://x", "not a url", "http://:80"):
        with pytest.raises(ConfigError):
            Endpoint.parse(bad)


def test_api_key_goes_in_the_authorization_header_only():
    ep = Endpoint.parse("http://127.0.0.1:9/base")
    raw = build_request(ep, "/v1/completions", {"a": 1}, api_key="sk-123")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"Authorization: Bearer sk-123" in head and b"sk-123" not in body
    assert head.startswith(b"POST /base/v1/completions HTTP/1.1")


def test_many_concurrent_streams_share_a_growing_pool(fast_server):
    ep = Endpoint.parse(fast_server)
    b = get_backend("openai")

    async def go():
        async with StreamingClient(ep, timeout_s=5) as c:
            req = build_request(ep, b.path, b.body(Prompt("p", 6), RequestOptions(model="m")))
            first = await asyncio.gather(*(c.stream(req, b.decoder()) for _ in range(300)))
            n_conns = len(c.pool._idle)
            again = await asyncio.gather(*(c.stream(req, b.decoder()) for _ in range(300)))
            return first, again, n_conns, len(c.pool._idle)

    loop = new_event_loop()
    first, again, n1, n2 = loop.run_until_complete(go())
    loop.close()
    assert all(r.ok and r.decoded.output_tokens == 6 for r in first + again)
    assert n1 == 300 and n2 == 300  # no hidden connection cap; connections reused
