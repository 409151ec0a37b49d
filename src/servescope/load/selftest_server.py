# ruff: noqa: UP031  (%-formatting of pre-shaped chunk templates is the fastest path here)
"""A fast, stamped streaming server on loopback: the yardstick for the client itself.

It speaks just enough OpenAI (``/v1/completions``, ``/v1/chat/completions``) and sglang
(``/generate``) SSE for servescope's and the peer benchmark clients to drive it, and it
generates "tokens" on a fixed cadence per stream (``tokens_per_s`` per stream,
``tokens_per_chunk`` per event, first event after ``ttft_ms``). Every chunk carries its
send time on CLOCK_MONOTONIC twice: as the JSON field ``servescope_send_ns`` (read by our
client) and as text `` t<ns>`` (so peer clients that keep the generated text, and their
own ``time.perf_counter()`` arrival stamps, also on CLOCK_MONOTONIC, can be checked the
same way). A client's added delay is then ``arrival - stamp`` for each chunk: loopback
transit (tens of us) plus whatever time the chunk waited for the client's event loop.

Why a hand-written asyncio protocol instead of aiohttp.web: the server must not be the
bottleneck when measuring a client's ceiling. One timer drives all streams from a heap
of due times; a chunk is one pre-formatted ``transport.write``.

Faults for tests are asked for in the prompt: ``<<fault:KIND>>`` with KIND one of
``status=NNN`` (reply with that HTTP status), ``stall`` (two chunks, then silence with
the connection open), ``drop`` (two chunks, then the connection is closed mid-stream),
``bad_json`` (a chunk that is not JSON), ``bad_sse`` (lines that are not SSE fields, then
a clean end without finish), ``bad_chunk`` (broken HTTP chunked framing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from servescope.load.client import new_event_loop
from servescope.run import now_ns

log = logging.getLogger(__name__)

_FAULT_RE = re.compile(r"<<fault:([a-z_]+(?:=\d+)?)>>")
_LATENESS_CAP = 500_000


@dataclass(frozen=True)
class SelftestServerConfig:
    """Cadence of the fake model. ``tokens_per_s`` is per stream."""

    tokens_per_s: float = 50.0
    tokens_per_chunk: int = 1
    ttft_ms: float = 20.0
    model: str = "servescope-selftest"
    send_done: bool = True  # end with "data: [DONE]" (vLLM/OpenAI) or just close the body (transformers serve)
    #: SSE events written together at each tick of a stream (each its own chunk and stamp). Above 1 it
    #: lets one server core offer more events than any client can read: a write costs more than an event.
    burst: int = 1

    @property
    def interval_ns(self) -> int:
        return max(1, int(self.burst * self.tokens_per_chunk / self.tokens_per_s * 1e9))


class _Stream:
    __slots__ = ("api", "conn", "cont_usage", "due_ns", "fault", "id", "incl_usage", "max_tokens", "prompt_tokens",
                 "sent_chunks", "sent_tokens")

    def __init__(self, conn: _ServerConn, api: str, rid: int, max_tokens: int, prompt_tokens: int,
                 incl_usage: bool, cont_usage: bool, fault: str | None, due_ns: int) -> None:
        self.conn = conn
        self.api = api
        self.id = rid
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.incl_usage = incl_usage
        self.cont_usage = cont_usage
        self.fault = fault
        self.due_ns = due_ns
        self.sent_tokens = 0
        self.sent_chunks = 0


class _ServerConn(asyncio.Protocol):
    def __init__(self, server: SelftestServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.busy = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            lines = head.split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value.strip() or 0)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            parts = lines[0].split(" ")
            if len(parts) < 2:
                self.reply(400, b'{"error":"bad request line"}')
                continue
            self.server._handle(self, parts[0], parts[1], body)

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "Error")
        self.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
                   .encode() + body)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class SelftestServer:
    """The server. ``await start()``; ``close()``. All streams share one timer."""

    def __init__(self, cfg: SelftestServerConfig) -> None:
        self.cfg = cfg
        self._heap: list[tuple[int, int, _Stream]] = []
        self._seq = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0
        self._server: asyncio.AbstractServer | None = None
        self.chunks_sent = 0
        self.streams_started = 0
        self.lateness_ns: list[int] = []

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ServerConn(self), host, port, backlog=4096)
        return self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._server is not None:
            self._server.close()

    # -- requests --------------------------------------------------------------------
    def _handle(self, conn: _ServerConn, method: str, path: str, body: bytes) -> None:
        if method == "GET" and path in ("/health", "/v1/health"):
            conn.reply(200, b'{"status":"ok"}')
            return
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": self.cfg.model, "object": "model"}]}
            conn.reply(200, json.dumps(models).encode())
            return
        if method == "GET" and path == "/stats":
            conn.reply(200, json.dumps(self.stats()).encode())
            return
        if method == "POST" and path == "/stats/reset":
            self.chunks_sent = 0
            self.streams_started = 0
            self.lateness_ns = []
            conn.reply(200, b"{}")
            return
        api = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}.get(path)
        if method != "POST" or api is None:
            conn.reply(404, b'{"error":"not found"}')
            return
        try:
            req = json.loads(body or b"{}")
            if not isinstance(req, dict):
                raise ValueError("not an object")
        except ValueError:
            conn.reply(400, b'{"error":"body is not a JSON object"}')
            return
        if api == "generate":
            sp = req.get("sampling_params") or {}
            max_tokens = int(sp.get("max_new_tokens") or 16)
            prompt: Any = req.get("text") if req.get("text") is not None else req.get("input_ids", "")
        else:
            max_tokens = int(req.get("max_tokens") or req.get("max_completion_tokens") or 16)
            if api == "chat":
                msgs = req.get("messages") or []
                prompt = " ".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))
            else:
                prompt = req.get("prompt", "")
        if not req.get("stream", False):
            conn.reply(400, b'{"error":"the selftest server only streams (stream=true)"}')
            return
        text = prompt if isinstance(prompt, str) else ""
        fault = None
        m = _FAULT_RE.search(text)
        if m:
            fault = m.group(1)
            if fault.startswith("status="):
                code = int(fault.split("=", 1)[1])
                conn.reply(code, json.dumps({"error": {"message": f"injected HTTP {code}"}}).encode())
                return
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(text.split())
        so = req.get("stream_options") or {}
        incl = bool(so.get("include_usage")) and api != "generate"
        cont = bool(so.get("continuous_usage_stats")) and incl
        conn.busy = True
        conn.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n")
        self._seq += 1
        self.streams_started += 1
        due = now_ns() + int(self.cfg.ttft_ms * 1e6)
        st = _Stream(conn, api, self._seq, max(1, max_tokens), prompt_tokens, incl, cont, fault, due)
        self._push(st)

    # -- the cadence -----------------------------------------------------------------
    def _push(self, st: _Stream) -> None:
        heapq.heappush(self._heap, (st.due_ns, st.id, st))
        if self._timer is None or st.due_ns < self._timer_due:
            self._arm(st.due_ns)

    def _arm(self, due_ns: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer_due = due_ns
        self._timer = loop.call_at(loop.time() + max(0, due_ns - now_ns()) / 1e9, self._tick)

    def _tick(self) -> None:
        self._timer = None
        heap = self._heap
        t = now_ns()
        while heap and heap[0][0] <= t:
            _, _, st = heapq.heappop(heap)
            if st.conn.closed:
                continue
            self._send_chunk(st)
            if (st.sent_tokens < st.max_tokens and not st.conn.closed
                    and not (st.fault == "stall" and st.sent_chunks >= 2)):
                st.due_ns += self.cfg.interval_ns
                heapq.heappush(heap, (st.due_ns, st.id, st))
        if heap:
            self._arm(heap[0][0])

    def _send_chunk(self, st: _Stream) -> None:
        if self.cfg.burst == 1:
            self._send_one(st)
            return
        for _ in range(self.cfg.burst):
            if st.sent_tokens >= st.max_tokens or st.conn.closed:
                return
            self._send_one(st)

    def _send_one(self, st: _Stream) -> None:
        conn = st.conn
        if st.fault in ("stall", "drop") and st.sent_chunks >= 2:
            if st.fault == "drop":
                conn.close()
            st.sent_tokens = st.max_tokens if st.fault == "drop" else st.sent_tokens
            return
        if st.fault == "bad_chunk":
            conn.write(b"zz-not-hex\r\n")
            st.sent_tokens = st.max_tokens
            conn.busy = False
            return
        k = min(self.cfg.tokens_per_chunk, st.max_tokens - st.sent_tokens)
        st.sent_tokens += k
        st.sent_chunks += 1
        last = st.sent_tokens >= st.max_tokens
        stamp = now_ns()
        if len(self.lateness_ns) < _LATENESS_CAP:
            self.lateness_ns.append(stamp - st.due_ns)
        text = f" t{stamp}" + " x" * (k - 1)
        if st.fault == "bad_json":
            events = ['data: {"choices": [oops\n\n']
            last = True
        elif st.fault == "bad_sse":
            events = ["this is not an sse field\n\n"]
            last = True
        else:
            events = [self._event(st, text, stamp, last)]
            if last:
                if st.incl_usage:
                    events.append(self._usage_event(st))
                if self.cfg.send_done:
                    events.append("data: [DONE]\n\n")
        out = []
        for ev in events:
            b = ev.encode()
            out.append(b"%x\r\n%s\r\n" % (len(b), b))
        if last:
            out.append(b"0\r\n\r\n")
        conn.write(b"".join(out))
        self.chunks_sent += 1
        if last:
            st.sent_tokens = st.max_tokens
            conn.busy = False
            if conn.buf:
                conn.data_received(b"")

    def _usage_json(self, st: _Stream) -> str:
        return ('{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
                % (st.prompt_tokens, st.sent_tokens, st.prompt_tokens + st.sent_tokens))

    def _event(self, st: _Stream, text: str, stamp: int, last: bool) -> str:
        fr = '"length"' if last else "null"
        usage = (',"usage":' + self._usage_json(st)) if st.cont_usage else ""
        if st.api == "completions":
            return ('data: {"id":"cmpl-%d","object":"text_completion","created":0,"model":"%s","choices":[{"index":0,'
                    '"text":"%s","logprobs":null,"finish_reason":%s}]%s,"servescope_send_ns":%d}\n\n'
                    % (st.id, self.cfg.model, text, fr, usage, stamp))
        if st.api == "chat":
            role = '"role":"assistant",' if st.sent_chunks == 1 else ""
            return ('data: {"id":"chatcmpl-%d","object":"chat.completion.chunk","created":0,"model":"%s","choices":'
                    '[{"index":0,"delta":{%s"content":"%s"},"finish_reason":%s}]%s,"servescope_send_ns":%d}\n\n'
                    % (st.id, self.cfg.model, role, text, fr, usage, stamp))
        meta_fr = '{"type":"length","length":%d}' % st.sent_tokens if last else "null"
        return ('data: {"text":"%s","meta_info":{"id":"%d","prompt_tokens":%d,"completion_tokens":%d,'
                '"finish_reason":%s},"servescope_send_ns":%d}\n\n'
                % (text, st.id, st.prompt_tokens, st.sent_tokens, meta_fr, stamp))

    def _usage_event(self, st: _Stream) -> str:
        obj = "chat.completion.chunk" if st.api == "chat" else "text_completion"
        return ('data: {"id":"cmpl-%d","object":"%s","created":0,"model":"%s","choices":[],"usage":%s}\n\n'
                % (st.id, obj, self.cfg.model, self._usage_json(st)))

    def stats(self) -> dict[str, Any]:
        """Chunks sent and how late the server itself was against its cadence."""
        lat = sorted(self.lateness_ns)

        def pct(p: float) -> float | None:
            return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] / 1e6 if lat else None

        return {"chunks_sent": self.chunks_sent, "streams_started": self.streams_started,
                "lateness_p50_ms": pct(50), "lateness_p99_ms": pct(99),
                "lateness_max_ms": lat[-1] / 1e6 if lat else None,
                "config": asdict(self.cfg)}


@contextlib.contextmanager
def serve_in_thread(cfg: SelftestServerConfig, host: str = "127.0.0.1") -> Iterator[str]:
    """Run the server in a background thread (tests); yields its base URL."""
    loop = new_event_loop()
    server = SelftestServer(cfg)
    ready = threading.Event()
    port_box: list[int] = []

    def _run() -> None:
        asyncio.set_event_loop(loop)
        port_box.append(loop.run_until_complete(server.start(host, 0)))
        ready.set()
        loop.run_forever()

    th = threading.Thread(target=_run, name="selftest-server", daemon=True)
    th.start()
    ready.wait(10)
    try:
        yield f"http://{host}:{port_box[0]}"
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        th.join(10)
        loop.close()


@contextlib.contextmanager
def spawn(cfg: SelftestServerConfig, cpu: int | None = None, host: str = "127.0.0.1") -> Iterator[str]:
    """Run the server in its own process (its own core when ``cpu`` is given); yields its base URL."""
    cmd = [sys.executable, "-m", "servescope.load.selftest_server", "--host", host, "--port", "0",
           "--tokens-per-s", str(cfg.tokens_per_s), "--tokens-per-chunk", str(cfg.tokens_per_chunk),
           "--ttft-ms", str(cfg.ttft_ms), "--model", cfg.model]
    if not cfg.send_done:
        cmd.append("--no-done")
    if cfg.burst != 1:
        cmd += ["--burst", str(cfg.burst)]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("PORT "):
            raise RuntimeError(f"selftest server did not start: {line!r}")
        yield f"http://{host}:{int(line.split()[1])}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="servescope's stamped streaming test server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--tokens-per-s", type=float, default=50.0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--model", default="servescope-selftest")
    ap.add_argument("--no-done", action="store_true")
    ap.add_argument("--burst", type=int, default=1, help="SSE events written together per tick")
    ap.add_argument("--cpu", type=int, default=None)
    a = ap.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})
    cfg = SelftestServerConfig(a.tokens_per_s, a.tokens_per_chunk, a.ttft_ms, a.model, not a.no_done, a.burst)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    server = SelftestServer(cfg)
    port = loop.run_until_complete(server.start(a.host, a.port))
    sys.stdout.write(f"PORT {port}\n")
    sys.stdout.flush()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, loop.stop)
    try:
        loop.run_forever()
    finally:
        server.close()
        loop.close()


if __name__ == "__main__":
    main()
