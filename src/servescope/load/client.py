"""The streaming HTTP client: owns sockets, the event loop and every timestamp.

Why not aiohttp on the hot path: the peer clients (sglang, vLLM: aiohttp) spend a task
switch, a future and a ``StreamReader`` copy per socket read, and the reference
measurements (shared/reference/serving-benchmarks.md) show them adding tens to hundreds
of ms to ITL tails at 512+ streams on a small machine. Here each connection is an
``asyncio.Protocol``: ``data_received`` stamps the read with ``now_ns()`` (the run clock,
CLOCK_MONOTONIC), strips HTTP chunked framing, feeds the pure SSE parser and the
backend's decoder, and only the end of a response wakes the request's coroutine.

- HTTP/1.1 with keep-alive; a pool that grows to the concurrency (no hidden 100-connection
  cap, vllm#14513) and reuses idle connections; TLS through the loop's ``ssl`` support.
- Reads are as large as the kernel hands over (uvloop reads up to 256 KiB), never the
  64 KiB ``StreamReader`` limit of vllm#39963.
- A per-request idle timeout (no byte for ``timeout_s``) is enforced by one watchdog task
  for all connections, not a timer per read.
- Failures become ``records.ERROR_KINDS``; nothing raises out of ``stream()`` except
  cancellation, so one bad request never stops a run.

No proxies and no HTTP/2: a benchmark talks straight to the server under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl as ssl_mod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from servescope.errors import ConfigError
from servescope.load.backends import StreamDecodeError, StreamDecoder, StreamServerError
from servescope.load.sse import SseParser
from servescope.run import now_ns

log = logging.getLogger(__name__)

_MAX_HEAD_BYTES = 64 * 1024
_ERROR_BODY_CHARS = 500


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed (it comes with transformers[serving]); else asyncio's default loop.

    uvloop roughly halves the per-read cost of a protocol callback, which is what bounds
    how many chunk events one client process can timestamp accurately.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the server is: scheme, host, port, and a path prefix from the URL."""

    scheme: str
    host: str
    port: int
    base_path: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"--url {url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as err:
            raise ConfigError(f"--url {url!r} has an invalid port") from err
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @property
    def origin(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.origin}{self.base_path}{path}"


def build_request(endpoint: Endpoint, path: str, body: dict[str, Any] | None, api_key: str | None = None,
                  method: str = "POST") -> bytes:
    """Serialise one HTTP/1.1 request. Done before a sweep point starts (off the hot path)."""
    payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else b""
    lines = [
        f"{method} {endpoint.base_path}{path} HTTP/1.1",
        f"Host: {endpoint.host}:{endpoint.port}",
        "User-Agent: servescope",
        "Accept: text/event-stream, application/json",
    ]
    if body is not None:
        lines.append("Content-Type: application/json")
        lines.append(f"Content-Length: {len(payload)}")
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


@dataclass(slots=True)
class StreamResult:
    """Everything one request produced, on the run clock; the sweep turns it into a record."""

    send_ns: int
    end_ns: int
    ok: bool
    status: int | None = None
    error_kind: str | None = None
    error_text: str | None = None
    decoded: Any = None  # backends.DecodedStream when the body was read as a stream
    body: bytes = b""  # non-stream body (error replies, JSON calls)
    bytes_received: int = 0
    reads: int = 0


class _Failure(Exception):
    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind
        self.text = text


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, pool: ConnectionPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self._reset(None, None)

    # -- request lifecycle -------------------------------------------------------------
    def _reset(self, fut: asyncio.Future[StreamResult] | None, decoder: StreamDecoder | None) -> None:
        self.fut = fut
        self.decoder = decoder
        self.sse = SseParser() if decoder is not None else None
        self.head = b""
        self.in_body = False
        self.status: int | None = None
        self.chunked = False
        self.content_left: int | None = None  # Content-Length remaining
        self.chunk_left = 0  # bytes left in the current HTTP chunk (+2 for its CRLF)
        self.chunk_tail = b""  # incomplete chunk-size line
        self.keep_alive = True
        self.body: list[bytes] = []
        self.send_ns = 0
        self.last_rx_ns = 0
        self.nbytes = 0
        self.reads = 0
        self.got_any = False

    def start(self, request: bytes, fut: asyncio.Future[StreamResult], decoder: StreamDecoder | None) -> int:
        self._reset(fut, decoder)
        assert self.transport is not None
        t = now_ns()
        self.send_ns = t
        self.last_rx_ns = t
        self.transport.write(request)
        return t

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        t = now_ns()
        if self.fut is None:
            # Bytes on an idle connection: the server broke the protocol; drop the connection.
            self._close()
            return
        self.last_rx_ns = t
        self.nbytes += len(data)
        self.reads += 1
        self.got_any = True
        try:
            if not self.in_body:
                data = self._head(data)
                if not self.in_body:
                    return
            if self.chunked:
                self._dechunk(data, t)
            else:
                self._body(data, t)
        except _Failure as f:
            self._fail(f.kind, f.text)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.fut is None or self.fut.done():
            return
        if self.in_body and not self.chunked and self.content_left is None:
            # Close-delimited body (HTTP/1.0 style): the close is the end.
            self._complete()
            return
        if not self.got_any:
            kind = "unreachable"
            text = f"connection closed before any reply ({exc or 'EOF'})"
        else:
            kind = "disconnect"
            text = f"connection closed mid-{'stream' if self.in_body else 'headers'} ({exc or 'EOF'})"
        self._fail(kind, text)

    # -- parsing ---------------------------------------------------------------------
    def _head(self, data: bytes) -> bytes:
        buf = self.head + data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEAD_BYTES:
                raise _Failure("malformed", "response headers too large")
            self.head = buf
            return b""
        head, rest = buf[:end].decode("latin-1"), buf[end + 4 :]
        lines = head.split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise _Failure("malformed", f"not an HTTP response: {lines[0][:100]!r}")
        self.status = int(parts[1])
        if 100 <= self.status < 200:
            # Interim response (100 Continue): skip it and parse the real one.
            self.head = b""
            return self._head(rest) if rest else b""
        http10 = parts[0] == "HTTP/1.0"
        conn_hdr = ""
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            value = value.strip()
            if name == "transfer-encoding" and "chunked" in value.lower():
                self.chunked = True
            elif name == "content-length" and value.isdigit():
                self.content_left = int(value)
            elif name == "connection":
                conn_hdr = value.lower()
        self.keep_alive = ("close" not in conn_hdr) and (not http10 or "keep-alive" in conn_hdr)
        if self.chunked:
            self.content_left = None
        if not self.chunked and self.content_left is None:
            self.keep_alive = False  # body ends at close
        self.in_body = True
        self.head = b""
        if self.status != 200 or self.decoder is None:
            self.sse = None  # collect raw body
        if self.content_left == 0:
            self._complete()
            return b""
        return rest

    def _dechunk(self, data: bytes, t: int) -> None:
        """Strip HTTP chunked framing from one socket read and pass its payload on in ONE piece.

        Servers often send each SSE event as its own HTTP chunk; all chunks of one read share
        the read's arrival time, so joining them before the SSE parser loses nothing and saves
        a parser and decoder round trip per event (the per-event cost bounds the client's ceiling).
        """
        pos = 0
        n = len(data)
        if self.chunk_tail:
            data = self.chunk_tail + data
            n = len(data)
            self.chunk_tail = b""
        pieces: list[bytes] = []
        try:
            while pos < n:
                if self.chunk_left > 0:
                    take = min(self.chunk_left, n - pos)
                    payload_end = pos + take
                    # The last 2 bytes of chunk_left are the CRLF after the payload.
                    data_end = min(payload_end, pos + max(self.chunk_left - 2, 0))
                    if data_end > pos:
                        pieces.append(data[pos:data_end])
                    self.chunk_left -= take
                    pos = payload_end
                    continue
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    self.chunk_tail = data[pos:]
                    if len(self.chunk_tail) > 1024:
                        raise _Failure("malformed", "chunk-size line too long")
                    return
                size_s = data[pos:eol].split(b";", 1)[0].strip()
                try:
                    size = int(size_s, 16)
                except ValueError:
                    raise _Failure("malformed", f"bad HTTP chunk size {size_s[:20]!r}") from None
                pos = eol + 2
                if size == 0:
                    # Last chunk; trailers (rare) are ignored up to the blank line.
                    self._flush_pieces(pieces, t)
                    pieces = []
                    self._complete()
                    return
                self.chunk_left = size + 2
        finally:
            # Payload read before a framing error or the end of this read still counts (a failure keeps it too).
            self._flush_pieces(pieces, t)

    def _flush_pieces(self, pieces: list[bytes], t: int) -> None:
        if pieces:
            self._body_piece(pieces[0] if len(pieces) == 1 else b"".join(pieces), t)
            pieces.clear()

    def _body(self, data: bytes, t: int) -> None:
        if self.content_left is not None:
            if len(data) >= self.content_left:
                data = data[: self.content_left]
                self.content_left = 0
                self._body_piece(data, t)
                self._complete()
                return
            self.content_left -= len(data)
        self._body_piece(data, t)

    def _body_piece(self, data: bytes, t: int) -> None:
        if self.fut is None or self.fut.done():
            return
        if self.sse is None:
            self.body.append(data)
            return
        dec = self.decoder
        assert dec is not None
        for ev in self.sse.feed(data):
            try:
                dec.add(ev.data, t)
            except StreamServerError as err:
                raise _Failure("stream_error", str(err)) from None
            except StreamDecodeError as err:
                raise _Failure("malformed", str(err)) from None

    # -- completion ------------------------------------------------------------------
    def _complete(self) -> None:
        fut = self.fut
        if fut is None or fut.done():
            return
        end = now_ns()
        res = StreamResult(send_ns=self.send_ns, end_ns=end, ok=True, status=self.status,
                           bytes_received=self.nbytes, reads=self.reads)
        if self.sse is not None and self.decoder is not None:
            try:
                for ev in self.sse.close():
                    self.decoder.add(ev.data, self.last_rx_ns)
            except StreamServerError as err:
                self._fail("stream_error", str(err))
                return
            except StreamDecodeError as err:
                self._fail("malformed", str(err))
                return
            if not self.decoder.finished:
                res.ok = False
                res.error_kind = "malformed"
                res.error_text = "stream ended without a finish_reason or [DONE]"
            res.decoded = self.decoder.finish()
        else:
            res.body = b"".join(self.body)
            if self.status != 200:
                res.ok = False
                res.error_kind = "http_status"
                res.error_text = f"HTTP {self.status}: " + res.body.decode("utf-8", "replace")[:_ERROR_BODY_CHARS]
        self.fut = None
        self.decoder = None
        self.sse = None
        fut.set_result(res)
        if self.keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self._close()

    def _fail(self, kind: str, text: str) -> None:
        fut = self.fut
        self.fut = None
        dec = self.decoder
        self.decoder = None
        self.sse = None
        self._close()
        if fut is not None and not fut.done():
            res = StreamResult(send_ns=self.send_ns, end_ns=now_ns(), ok=False, status=self.status,
                               error_kind=kind, error_text=text[:_ERROR_BODY_CHARS],
                               bytes_received=self.nbytes, reads=self.reads)
            if dec is not None:
                res.decoded = dec.finish()  # keep what arrived before the failure
            fut.set_result(res)

    def timeout(self, idle_s: float) -> None:
        self._fail("timeout", f"no data for {idle_s:g} s")

    def cancel(self) -> None:
        self._fail("cancelled", "run interrupted while the request was in flight")

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


@dataclass
class ConnectionPool:
    """Keep-alive connections to one endpoint. Grows on demand; no upper limit of its own."""

    endpoint: Endpoint
    connect_timeout_s: float = 10.0
    _idle: list[_Connection] = field(default_factory=list)
    _busy: set[_Connection] = field(default_factory=set)
    _ssl: ssl_mod.SSLContext | None = None

    def __post_init__(self) -> None:
        if self.endpoint.scheme == "https":
            self._ssl = ssl_mod.create_default_context()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self), self.endpoint.host, self.endpoint.port,
                                       ssl=self._ssl),
                timeout=self.connect_timeout_s,
            )
        except asyncio.TimeoutError as err:
            raise _Failure("timeout", f"connect timed out after {self.connect_timeout_s:g} s") from err
        except (OSError, ssl_mod.SSLError) as err:
            raise _Failure("unreachable", f"cannot connect to {self.endpoint.origin}: {err}") from err
        return proto

    async def acquire(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                self._busy.add(conn)
                return conn
        conn = await self._connect()
        self._busy.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if not conn.closed:
            self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    def busy(self) -> list[_Connection]:
        return list(self._busy)

    def close(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn._close()
        self._idle.clear()
        self._busy.clear()


class StreamingClient:
    """Sends prepared requests and returns ``StreamResult``s. Use as an async context manager.

    ``timeout_s`` is the longest silence allowed within one request (connect, first byte,
    or between two reads); a watchdog checks every connection a few times per second.
    """

    def __init__(self, endpoint: Endpoint, timeout_s: float = 60.0) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.pool = ConnectionPool(endpoint, connect_timeout_s=timeout_s)
        self._watchdog: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StreamingClient:
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        self.pool.close()

    async def _watch(self) -> None:
        limit_ns = int(self.timeout_s * 1e9)
        period = min(0.25, self.timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            t = now_ns()
            for conn in self.pool.busy():
                if conn.fut is not None and t - conn.last_rx_ns > limit_ns:
                    conn.timeout(self.timeout_s)

    async def stream(self, request: bytes, decoder: StreamDecoder | None,
                     on_send: Callable[[int], None] | None = None) -> StreamResult:
        """Send ``request`` and wait for the whole reply. Never raises except CancelledError.

        ``send_ns`` of the result is when this call began, so a new connection's setup counts
        in TTFT, as it does for the peers' clients (they stamp before ``session.post``).

        ``decoder=None`` reads a plain body (JSON calls). A request that fails on a reused
        connection before any byte came back is retried once on a fresh connection: the
        server may have closed the idle connection just as we wrote (a keep-alive race,
        not a server failure).
        """
        loop = asyncio.get_running_loop()
        t0 = now_ns()
        if on_send is not None:
            on_send(t0)
        dec = decoder
        res: StreamResult | None = None
        for attempt in (0, 1):
            try:
                conn = await self.pool.acquire()
            except _Failure as f:
                return StreamResult(send_ns=t0, end_ns=now_ns(), ok=False, error_kind=f.kind, error_text=f.text)
            fut: asyncio.Future[StreamResult] = loop.create_future()
            conn.start(request, fut, dec)
            try:
                res = await fut
            except asyncio.CancelledError:
                conn.cancel()
                raise
            retry = (attempt == 0 and conn.reused and not res.ok and res.error_kind == "unreachable"
                     and res.bytes_received == 0)
            if not retry:
                res.send_ns = t0
                return res
            dec = decoder.__class__() if decoder is not None else None
        assert res is not None
        return res

    def cancel_all(self) -> None:
        """Fail every in-flight request as ``cancelled`` (Ctrl-C): their data so far is kept."""
        for conn in self.pool.busy():
            conn.cancel()
